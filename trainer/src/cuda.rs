//! Device memory through `cudarc` (feature `cuda`): snapshot from GPU memory, restore to it,
//! and an optional NCCL path that serves a recovery from survivors' GPU memory.
//!
//! # Snapshot
//!
//! A [`DeviceTensor`] is a span of device memory (a `cudarc` slice it owns, or a raw pointer
//! owned elsewhere, such as a framework's tensor) plus the **compute stream** the training loop
//! writes it on. [`MemorySource::pin`], called inside `save` on the training thread, records an
//! event on the compute stream and makes the GPU's dedicated copy stream wait for it: every
//! write enqueued before `save` lands in the checkpoint. `copy_to` enqueues
//! `cuMemcpyDtoHAsync` (or `cuMemcpy2DAsync` for the strided rows of a sub-box) on the copy
//! stream into the staging slab and returns at once; `fence` waits for the copies enqueued so
//! far, before the snapshot hands a batch of chunks to the persist task. So `save` returns as
//! soon as the events are recorded; the forward and backward passes that follow overlap with
//! the copies; the loop calls `SaveHandle::wait_snapshot` only before the optimizer step
//! mutates the tensors (the compute stream does not wait for the copies by itself).
//!
//! Staging slabs are page-locked once: opening a [`Gpu`] installs a [`crate::staging`] slab
//! hook that `cuMemHostRegister`s every slab of the pools created afterwards (and unregisters
//! it when the pool is dropped), so the copies are DMA at the speed of the link. A slab that
//! cannot be locked stays pageable: the copy is then synchronous, slower but still correct.
//!
//! # Restore
//!
//! [`MemorySink::write_at`] copies the bytes into pinned bounce buffers (allocated once per
//! GPU, reused) and enqueues `cuMemcpyHtoDAsync` from them, double-buffered, on the GPU's
//! restore stream, after the work already enqueued on the tensor's compute stream; it returns
//! when the bytes are on the device. The restore engine runs several pieces at once, so chunk
//! fetching, hashing and decompression overlap with the device copies.
//!
//! # No GPU
//!
//! Every entry point checks `cudarc::driver::sys::is_culib_present()` before any other cudarc
//! call (cudarc panics when the library is missing) and catches unwinds as a second line of
//! defence: without a driver, [`Gpu::open`] returns an [`ErrorKind::NoDevice`] error saying
//! that no CUDA driver was found, never a panic.
//!
//! # Recovery from peers' GPU memory
//!
//! See [`peer`].

use std::any::Any;
use std::collections::HashSet;
use std::ffi::{CString, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use ckpt_store::{Error, ErrorKind, NdBox, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError};
use cudarc::driver::{result, sys};
use parking_lot::{Condvar, Mutex};
use tracing::warn;

use crate::manager::TensorMemory;
use crate::memory::{MemorySink, MemorySource, PinnedSource};
use crate::staging::{SlabHook, set_slab_hook};

// ---------------------------------------------------------------------------------------------
// Availability and errors
// ---------------------------------------------------------------------------------------------

/// Whether the CUDA driver library (`libcuda`) can be loaded. Never panics.
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the library under its usual names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Whether the NCCL library (`libnccl.so`) can be loaded. Never panics.
pub fn nccl_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the library under its usual names.
    *PRESENT.get_or_init(|| unsafe { cudarc::nccl::sys::is_culib_present() })
}

fn no_driver() -> Error {
    Error::new(
        ErrorKind::NoDevice,
        "no CUDA driver was found: libcuda.so could not be loaded, so device tensors cannot be \
         used here (they need an NVIDIA GPU and its driver; host tensors work without)",
    )
}

fn panic_text(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic inside cudarc".to_string()
    }
}

fn driver_error(what: &str, e: DriverError) -> Error {
    use sys::CUresult as R;
    let kind = match e.0 {
        R::CUDA_ERROR_NO_DEVICE | R::CUDA_ERROR_INVALID_DEVICE => ErrorKind::NoDevice,
        R::CUDA_ERROR_INVALID_VALUE => ErrorKind::InvalidInput,
        _ => ErrorKind::Device,
    };
    let hint = match e.0 {
        R::CUDA_ERROR_NO_DEVICE => " (the driver is installed but sees no CUDA device)",
        _ => "",
    };
    Error::new(kind, format!("CUDA: {what}: {e}{hint}"))
}

/// Run driver calls: checks for the library first and turns a panic inside cudarc (a missing
/// library or symbol) into an error.
fn cu<T>(what: &str, f: impl FnOnce() -> std::result::Result<T, DriverError>) -> Result<T> {
    if !driver_present() {
        return Err(no_driver());
    }
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(driver_error(what, e)),
        Err(p) => Err(Error::new(
            ErrorKind::NoDevice,
            format!("CUDA: {what}: the CUDA library failed: {}", panic_text(&*p)),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Small kernels (PTX, JIT-compiled by the driver: no toolkit needed): compare two buffers on
// the device, and keep the GPU busy for a while (tests and benchmarks).
// ---------------------------------------------------------------------------------------------

const KERNELS_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry ckpt_count_diff(
    .param .u64 p_a,
    .param .u64 p_b,
    .param .u64 p_n,
    .param .u64 p_out
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_a];
    ld.param.u64 %rd2, [p_b];
    ld.param.u64 %rd3, [p_n];
    ld.param.u64 %rd4, [p_out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    cvta.to.global.u64 %rd4, %rd4;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd5, %r1, %r2;
    cvt.u64.u32 %rd6, %r3;
    add.u64 %rd5, %rd5, %rd6;
    mul.wide.u32 %rd7, %r4, %r2;
    mov.u64 %rd8, 0;
$L_loop:
    setp.ge.u64 %p1, %rd5, %rd3;
    @%p1 bra $L_done;
    add.u64 %rd9, %rd1, %rd5;
    add.u64 %rd10, %rd2, %rd5;
    ld.global.u8 %r5, [%rd9];
    ld.global.u8 %r6, [%rd10];
    setp.ne.u32 %p2, %r5, %r6;
    @%p2 add.u64 %rd8, %rd8, 1;
    add.u64 %rd5, %rd5, %rd7;
    bra.uni $L_loop;
$L_done:
    setp.eq.u64 %p1, %rd8, 0;
    @%p1 bra $L_end;
    atom.global.add.u64 %rd11, [%rd4], %rd8;
$L_end:
    ret;
}

.visible .entry ckpt_spin(
    .param .u64 p_ns
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [p_ns];
    mov.u64 %rd2, %globaltimer;
$L_spin:
    mov.u64 %rd3, %globaltimer;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra.uni $L_spin;
    ret;
}
"#;

struct Kernels {
    module: sys::CUmodule,
    count_diff: sys::CUfunction,
    spin: sys::CUfunction,
}

// SAFETY: module and function handles are plain driver handles, usable from any thread.
unsafe impl Send for Kernels {}
// SAFETY: as above; launching does not mutate the handles.
unsafe impl Sync for Kernels {}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>) -> Result<Kernels> {
        let src = CString::new(KERNELS_PTX).expect("no NUL in the PTX");
        cu("loading the ckpt kernels (PTX)", || {
            ctx.bind_to_thread()?;
            // SAFETY: a NUL-terminated PTX image; the module lives as long as the Gpu.
            unsafe {
                let module = result::module::load_data(src.as_ptr() as *const c_void)?;
                let count_diff =
                    result::module::get_function(module, CString::new("ckpt_count_diff").unwrap())?;
                let spin =
                    result::module::get_function(module, CString::new("ckpt_spin").unwrap())?;
                Ok(Kernels {
                    module,
                    count_diff,
                    spin,
                })
            }
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The GPU: context, copy streams, pinned bounce buffers
// ---------------------------------------------------------------------------------------------

/// Settings of a [`Gpu`].
#[derive(Debug, Clone, Copy)]
pub struct GpuOptions {
    /// Bytes per pinned bounce buffer used by restores (default 32 MiB).
    pub bounce_bytes: usize,
    /// Most bounce buffers (default 8); each restore writer uses two at a time.
    pub bounce_buffers: usize,
    /// Page-lock the staging slabs of pools created from now on (default on).
    pub pin_staging: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            bounce_bytes: 32 << 20,
            bounce_buffers: 8,
            pin_staging: true,
        }
    }
}

struct Bounce {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: page-locked host memory owned by the pool, handed to one user at a time.
unsafe impl Send for Bounce {}

struct BouncePool {
    size: usize,
    max: usize,
    state: Mutex<(Vec<Bounce>, usize)>,
    freed: Condvar,
}

/// One GPU: a context, a stream for snapshot copies (device to host), one for restore copies
/// (host to device) and pinned bounce buffers for restores. [`Gpu::open`] returns the same
/// handle for the same ordinal while one is alive.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    d2h: Arc<CudaStream>,
    h2d: Arc<CudaStream>,
    compute: Arc<CudaStream>,
    bounce: BouncePool,
    kernels: OnceLock<std::result::Result<Kernels, String>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({})", self.ctx.ordinal())
    }
}

static GPUS: Mutex<Vec<(usize, Weak<Gpu>)>> = Mutex::new(Vec::new());

impl Gpu {
    /// The number of CUDA devices (an error without a driver).
    pub fn count() -> Result<usize> {
        cu("counting devices", CudaContext::device_count).map(|n| n.max(0) as usize)
    }

    /// Open GPU `ordinal` with default options (see [`Gpu::open_with`]).
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        Self::open_with(ordinal, GpuOptions::default())
    }

    /// Open GPU `ordinal` (its primary context). Returns the handle already open for this
    /// ordinal, if any (the options are then those it was opened with). Without a driver or a
    /// device, a [`ErrorKind::NoDevice`] error.
    pub fn open_with(ordinal: usize, opts: GpuOptions) -> Result<Arc<Gpu>> {
        if !driver_present() {
            return Err(no_driver());
        }
        let mut reg = GPUS.lock();
        reg.retain(|(_, w)| w.strong_count() > 0);
        if let Some(g) = reg
            .iter()
            .find(|(o, _)| *o == ordinal)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(g);
        }
        let ctx = cu(&format!("opening GPU {ordinal}"), || {
            CudaContext::new(ordinal)
        })?;
        let d2h = cu("creating the snapshot copy stream", || ctx.new_stream())?;
        let h2d = cu("creating the restore copy stream", || ctx.new_stream())?;
        let compute = ctx.default_stream();
        let gpu = Arc::new(Gpu {
            ctx: ctx.clone(),
            d2h,
            h2d,
            compute,
            bounce: BouncePool {
                size: opts.bounce_bytes.max(1 << 16),
                max: opts.bounce_buffers.max(2),
                state: Mutex::new((Vec::new(), 0)),
                freed: Condvar::new(),
            },
            kernels: OnceLock::new(),
        });
        if opts.pin_staging {
            set_slab_hook(Some(Arc::new(PinSlabs {
                ctx,
                registered: Mutex::new(HashSet::new()),
                warned: AtomicBool::new(false),
            })));
        }
        reg.push((ordinal, Arc::downgrade(&gpu)));
        Ok(gpu)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name.
    pub fn name(&self) -> Result<String> {
        cu("reading the device name", || self.ctx.name())
    }

    /// The `cudarc` context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream tensors made by [`DeviceTensor::alloc`] are written on (the context's
    /// default stream).
    pub fn default_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The stream snapshot copies run on.
    pub fn snapshot_stream(&self) -> &Arc<CudaStream> {
        &self.d2h
    }

    /// Wait for all work on the device.
    pub fn synchronize(&self) -> Result<()> {
        cu("synchronizing the device", || self.ctx.synchronize())
    }

    fn kernels(&self) -> Result<&Kernels> {
        match self
            .kernels
            .get_or_init(|| Kernels::load(&self.ctx).map_err(|e| e.message().to_string()))
        {
            Ok(k) => Ok(k),
            Err(e) => Err(Error::new(ErrorKind::Device, e.clone())),
        }
    }

    /// Keep the GPU busy on `stream` for `d` (a one-thread kernel spinning on the global
    /// timer): stands for compute in tests and benchmarks.
    pub fn busy(&self, stream: &CudaStream, d: Duration) -> Result<()> {
        let k = self.kernels()?;
        let mut ns = d.as_nanos().min(u64::MAX as u128) as u64;
        cu("launching the busy kernel", || {
            self.ctx.bind_to_thread()?;
            let mut params = [&mut ns as *mut u64 as *mut c_void];
            // SAFETY: the kernel takes one u64 by value.
            unsafe {
                result::launch_kernel(
                    k.spin,
                    (1, 1, 1),
                    (1, 1, 1),
                    0,
                    stream.cu_stream(),
                    &mut params,
                )
            }
        })
    }

    /// Whether host memory at `ptr` is page-locked for CUDA (registered, as staging slabs
    /// are, or allocated by CUDA): the pointer attribute query knows it, pageable memory is
    /// unknown to it.
    pub fn is_page_locked(&self, ptr: *const u8) -> Result<bool> {
        let mut ty: u32 = 0;
        let r = cu("querying a host pointer", || {
            self.ctx.bind_to_thread()?;
            // SAFETY: a query writing one enum value (32 bits).
            Ok(unsafe {
                sys::cuPointerGetAttribute(
                    &mut ty as *mut u32 as *mut c_void,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    ptr as sys::CUdeviceptr,
                )
            })
        })?;
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(ty == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32),
            sys::CUresult::CUDA_ERROR_INVALID_VALUE => Ok(false),
            e => Err(driver_error("querying a host pointer", DriverError(e))),
        }
    }

    /// A bounce buffer; when none is free and the pool is full, waits if `wait`, else `None`.
    fn take_bounce(&self, wait: bool) -> Result<Option<Bounce>> {
        let p = &self.bounce;
        let mut st = p.state.lock();
        loop {
            if let Some(b) = st.0.pop() {
                return Ok(Some(b));
            }
            if st.1 < p.max {
                st.1 += 1;
                drop(st);
                let r = cu("allocating a pinned bounce buffer", || {
                    self.ctx.bind_to_thread()?;
                    // SAFETY: a fresh page-locked allocation, freed in Drop.
                    unsafe { result::malloc_host(p.size, sys::CU_MEMHOSTALLOC_PORTABLE) }
                });
                return match r {
                    Ok(ptr) => Ok(Some(Bounce {
                        ptr: ptr as *mut u8,
                        len: p.size,
                    })),
                    Err(e) => {
                        p.state.lock().1 -= 1;
                        p.freed.notify_one();
                        Err(e)
                    }
                };
            }
            if !wait {
                return Ok(None);
            }
            p.freed.wait(&mut st);
        }
    }

    fn give_bounce(&self, b: Bounce) {
        self.bounce.state.lock().0.push(b);
        self.bounce.freed.notify_one();
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for b in self.bounce.state.get_mut().0.drain(..) {
            // SAFETY: allocated by malloc_host, no copy in flight (returned after its event).
            let _ = unsafe { result::free_host(b.ptr as *mut c_void) };
        }
        if let Some(Ok(k)) = self.kernels.get() {
            // Launches may still be queued: let them finish before unloading their module.
            let _ = self.ctx.synchronize();
            // SAFETY: loaded by Kernels::load, nothing uses it any more.
            let _ = unsafe { result::module::unload(k.module) };
        }
    }
}

/// The staging slab hook: page-lock each slab with `cuMemHostRegister`.
struct PinSlabs {
    ctx: Arc<CudaContext>,
    registered: Mutex<HashSet<usize>>,
    warned: AtomicBool,
}

impl SlabHook for PinSlabs {
    fn on_alloc(&self, ptr: *mut u8, len: usize) {
        let r = cu("page-locking a staging slab", || {
            self.ctx.bind_to_thread()?;
            // SAFETY: ptr..ptr+len is a live allocation owned by the pool; unregistered in
            // on_free before it is freed.
            unsafe {
                sys::cuMemHostRegister_v2(ptr as *mut c_void, len, sys::CU_MEMHOSTREGISTER_PORTABLE)
            }
            .result()
        });
        match r {
            Ok(()) => {
                self.registered.lock().insert(ptr as usize);
            }
            Err(e) if !self.warned.swap(true, Ordering::Relaxed) => {
                warn!("staging memory stays pageable (device copies into it are synchronous): {e}")
            }
            Err(_) => {}
        }
    }

    fn on_free(&self, ptr: *mut u8, _len: usize) {
        if self.registered.lock().remove(&(ptr as usize)) {
            let _ = cu("unlocking a staging slab", || {
                self.ctx.bind_to_thread()?;
                // SAFETY: registered by on_alloc, still allocated.
                unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) }.result()
            });
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Copy planning: the contiguous runs of a sub-box, cut to a window, as 1-D and 2-D copies
// ---------------------------------------------------------------------------------------------

/// One copy between strided device memory and a dense buffer: `height` rows of `width` bytes,
/// rows `dev_pitch` apart at `dev` in the tensor, back to back at `dense` in the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Op {
    dev: usize,
    dense: usize,
    width: usize,
    height: usize,
    dev_pitch: usize,
}

/// The largest pitch `cuMemcpy2D` takes on every device.
const MAX_PITCH: usize = (1 << 31) - 1;
/// Rows per 2-D copy at most (a conservative bound; longer runs take several copies).
const MAX_HEIGHT: usize = 65535;

/// The copies for bytes `offset .. offset + len` of a region given as `runs` (`(offset in
/// tensor, offset in region, length)`, in region order, tiling the region): partial runs at
/// both ends, whole runs of equal width and constant stride merged into 2-D copies.
fn plan_window(runs: &[(usize, usize, usize)], offset: usize, len: usize) -> Vec<Op> {
    let end = offset + len;
    let mut ops: Vec<Op> = Vec::new();
    let first = runs.partition_point(|r| r.1 + r.2 <= offset);
    for &(dev, at, rlen) in &runs[first..] {
        if at >= end {
            break;
        }
        let a = offset.max(at);
        let b = end.min(at + rlen);
        if a >= b {
            continue;
        }
        let piece = Op {
            dev: dev + (a - at),
            dense: a - offset,
            width: b - a,
            height: 1,
            dev_pitch: b - a,
        };
        if let Some(last) = ops.last_mut()
            && extend(last, &piece)
        {
            continue;
        }
        ops.push(piece);
    }
    ops
}

fn extend(last: &mut Op, p: &Op) -> bool {
    if p.width != last.width || p.dense != last.dense + last.width * last.height {
        return false;
    }
    if last.height == 1 {
        let Some(pitch) = p.dev.checked_sub(last.dev) else {
            return false;
        };
        if pitch < last.width || pitch > MAX_PITCH {
            return false;
        }
        if pitch == last.width {
            // Contiguous on both sides: one wider row.
            last.width += p.width;
            last.dev_pitch = last.width;
            return true;
        }
        last.dev_pitch = pitch;
        last.height = 2;
        true
    } else if p.dev == last.dev + last.dev_pitch * last.height && last.height < MAX_HEIGHT {
        last.height += 1;
        true
    } else {
        false
    }
}

/// Where the dense side of a copy is.
#[derive(Clone, Copy)]
enum Dense {
    Host(*mut u8),
    Device(sys::CUdeviceptr),
}

/// Enqueue `op` between device memory at `dev` (strided side) and `dense`, on `stream`:
/// device to dense when `to_dense`, else dense to device. The context must be current.
///
/// # Safety
/// Both sides must be valid for the op's extent until the stream has run the copy.
unsafe fn enqueue(
    op: &Op,
    dev: sys::CUdeviceptr,
    dense: Dense,
    to_dense: bool,
    stream: sys::CUstream,
) -> std::result::Result<(), DriverError> {
    let d = dev + op.dev as u64;
    if op.height == 1 {
        // SAFETY: the caller guarantees both ranges.
        unsafe {
            return match (dense, to_dense) {
                (Dense::Host(h), true) => {
                    sys::cuMemcpyDtoHAsync_v2(h.add(op.dense) as *mut c_void, d, op.width, stream)
                }
                (Dense::Host(h), false) => {
                    sys::cuMemcpyHtoDAsync_v2(d, h.add(op.dense) as *const c_void, op.width, stream)
                }
                (Dense::Device(x), true) => {
                    sys::cuMemcpyDtoDAsync_v2(x + op.dense as u64, d, op.width, stream)
                }
                (Dense::Device(x), false) => {
                    sys::cuMemcpyDtoDAsync_v2(d, x + op.dense as u64, op.width, stream)
                }
            }
            .result();
        }
    }
    use sys::CUmemorytype as M;
    let (dense_type, dense_host, dense_dev) = match dense {
        // SAFETY: within the caller's buffer.
        Dense::Host(h) => (M::CU_MEMORYTYPE_HOST, unsafe { h.add(op.dense) }, 0),
        Dense::Device(x) => (
            M::CU_MEMORYTYPE_DEVICE,
            std::ptr::null_mut(),
            x + op.dense as u64,
        ),
    };
    let (strided_type, strided_dev) = (M::CU_MEMORYTYPE_DEVICE, d);
    let p = if to_dense {
        sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: strided_type,
            srcHost: std::ptr::null(),
            srcDevice: strided_dev,
            srcArray: std::ptr::null_mut(),
            srcPitch: op.dev_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: dense_type,
            dstHost: dense_host as *mut c_void,
            dstDevice: dense_dev,
            dstArray: std::ptr::null_mut(),
            dstPitch: op.width,
            WidthInBytes: op.width,
            Height: op.height,
        }
    } else {
        sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: dense_type,
            srcHost: dense_host as *const c_void,
            srcDevice: dense_dev,
            srcArray: std::ptr::null_mut(),
            srcPitch: op.width,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: strided_type,
            dstHost: std::ptr::null_mut(),
            dstDevice: strided_dev,
            dstArray: std::ptr::null_mut(),
            dstPitch: op.dev_pitch,
            WidthInBytes: op.width,
            Height: op.height,
        }
    };
    // SAFETY: the descriptor is complete; the caller guarantees both ranges.
    unsafe { sys::cuMemcpy2DAsync_v2(&p, stream) }.result()
}

// ---------------------------------------------------------------------------------------------
// Device tensors
// ---------------------------------------------------------------------------------------------

struct DevInner {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    // The cudarc slice this tensor owns (a `std::sync::Mutex<CudaSlice<T>>`), if any.
    owner: Option<Box<dyn Any + Send + Sync>>,
}

/// A shard in device memory, shareable between the training loop and the checkpointer (a
/// cheap handle: clones share the memory). Implements [`MemorySource`], [`MemorySink`] and
/// [`TensorMemory`], so it registers with [`crate::CheckpointManager`] like a
/// [`crate::HostTensor`].
///
/// Writes to it must be ordered on its compute stream (the slice's stream, or the one given
/// to [`DeviceTensor::from_raw`]): the snapshot is ordered after them by an event on that
/// stream.
#[derive(Clone)]
pub struct DeviceTensor {
    inner: Arc<DevInner>,
}

impl std::fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceTensor(gpu {}, {:#x}, {} bytes)",
            self.inner.gpu.ordinal(),
            self.inner.ptr,
            self.inner.len
        )
    }
}

impl DeviceTensor {
    /// `len` zeroed bytes on `gpu`, written on its default stream.
    pub fn alloc(gpu: &Arc<Gpu>, len: usize) -> Result<Self> {
        let s = cu("allocating device memory", || {
            gpu.compute.alloc_zeros::<u8>(len.max(1))
        })?;
        let t = Self::from_slice(gpu, s)?;
        // A 0-byte tensor still owns one byte (cudarc cannot allocate none).
        Ok(if len == 0 {
            DeviceTensor {
                inner: Arc::new(DevInner {
                    gpu: t.inner.gpu.clone(),
                    ptr: t.inner.ptr,
                    len: 0,
                    stream: t.inner.stream.clone(),
                    owner: Some(Box::new(t)),
                }),
            }
        } else {
            t
        })
    }

    /// A tensor that owns a `cudarc` slice on `gpu`; its compute stream is the slice's stream.
    /// Reach the slice again with [`DeviceTensor::with_slice`].
    pub fn from_slice<T: DeviceRepr + 'static>(
        gpu: &Arc<Gpu>,
        slice: CudaSlice<T>,
    ) -> Result<Self> {
        if slice.ordinal() != gpu.ordinal() {
            return Err(Error::invalid(format!(
                "the slice lives on GPU {}, not on GPU {}",
                slice.ordinal(),
                gpu.ordinal()
            )));
        }
        let stream = slice.stream().clone();
        let len = slice.num_bytes();
        let ptr = cu("reading a slice's device pointer", || {
            stream.context().bind_to_thread()?;
            let (p, _sync) = slice.device_ptr(&stream);
            Ok(p)
        })?;
        Ok(DeviceTensor {
            inner: Arc::new(DevInner {
                gpu: gpu.clone(),
                ptr,
                len,
                stream,
                owner: Some(Box::new(std::sync::Mutex::new(slice))),
            }),
        })
    }

    /// A tensor over device memory owned elsewhere (a framework's tensor): `len` bytes at
    /// `ptr` on `gpu`, written on `stream` (a raw `CUstream` of that device; `None` for the
    /// legacy default stream). The pointer is checked to be device memory of this GPU with
    /// `len` bytes after it.
    ///
    /// # Safety
    /// The memory (and the stream) must stay valid while this tensor, its clones or a
    /// snapshot that pinned it are alive.
    pub unsafe fn from_raw(
        gpu: &Arc<Gpu>,
        ptr: u64,
        len: usize,
        stream: Option<sys::CUstream>,
    ) -> Result<Self> {
        let ctx = &gpu.ctx;
        let (ordinal, start, size) = cu("checking a device pointer", || {
            ctx.bind_to_thread()?;
            let mut ordinal: i32 = -1;
            let mut start: sys::CUdeviceptr = 0;
            let mut size: usize = 0;
            use sys::CUpointer_attribute as A;
            // SAFETY: queries write plain values of the documented types.
            unsafe {
                sys::cuPointerGetAttribute(
                    &mut ordinal as *mut i32 as *mut c_void,
                    A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    ptr,
                )
                .result()?;
                sys::cuPointerGetAttribute(
                    &mut start as *mut sys::CUdeviceptr as *mut c_void,
                    A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                    ptr,
                )
                .result()?;
                sys::cuPointerGetAttribute(
                    &mut size as *mut usize as *mut c_void,
                    A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                    ptr,
                )
                .result()?;
            }
            Ok((ordinal, start, size))
        })
        .map_err(|e| {
            Error::invalid(format!(
                "{ptr:#x} is not device memory CUDA knows: {}",
                e.message()
            ))
        })?;
        if ordinal as usize != gpu.ordinal() {
            return Err(Error::invalid(format!(
                "{ptr:#x} is memory of GPU {ordinal}, not of GPU {}",
                gpu.ordinal()
            )));
        }
        if ptr + len as u64 > start + size as u64 {
            return Err(Error::invalid(format!(
                "{len} bytes at {ptr:#x} run past the end of its allocation ({size} bytes at \
                 {start:#x})"
            )));
        }
        let stream = match stream {
            // SAFETY: the caller guarantees the stream belongs to this device and outlives us.
            Some(s) => unsafe { ctx.wrap_borrowed_stream(s) },
            None => ctx.default_stream(),
        };
        Ok(DeviceTensor {
            inner: Arc::new(DevInner {
                gpu: gpu.clone(),
                ptr,
                len,
                stream,
                owner: None,
            }),
        })
    }

    /// Run `f` on the owned slice (an error if this tensor owns no `CudaSlice<T>`).
    pub fn with_slice<T: 'static, R>(&self, f: impl FnOnce(&mut CudaSlice<T>) -> R) -> Result<R> {
        let m = self
            .inner
            .owner
            .as_ref()
            .and_then(|o| o.downcast_ref::<std::sync::Mutex<CudaSlice<T>>>())
            .ok_or_else(|| Error::invalid("this device tensor owns no slice of that type"))?;
        let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
        Ok(f(&mut g))
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.inner.gpu
    }

    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        self.inner.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The compute stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    fn whole(&self) -> DeviceRegion {
        DeviceRegion {
            tensor: self.clone(),
            runs: Arc::new(vec![(0, 0, self.inner.len)]),
            len: self.inner.len,
        }
    }

    /// Write `src` at `offset` (through pinned bounce buffers, after the work enqueued on the
    /// compute stream); returns when the bytes are on the device.
    pub fn upload(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.whole().write_at(offset, src)
    }

    /// The bytes, copied to the host after the work enqueued on the compute stream.
    pub fn download(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.inner.len];
        let pin = self.whole().pin_now()?;
        pin.copy_to(0, &mut out)?;
        pin.fence()?;
        Ok(out)
    }

    /// Enqueue a fill of every byte with `value` on the compute stream (a device-side write,
    /// asynchronous like a kernel).
    pub fn fill(&self, value: u8) -> Result<()> {
        let i = &self.inner;
        cu("filling device memory", || {
            i.gpu.ctx.bind_to_thread()?;
            // SAFETY: the range is this tensor's memory.
            unsafe { result::memset_d8_async(i.ptr, value, i.len, i.stream.cu_stream()) }
        })
    }

    /// Bytes that differ from `other`'s, counted on the device (a small kernel), after the
    /// work enqueued on both compute streams.
    pub fn count_diff(&self, other: &DeviceTensor) -> Result<u64> {
        let (a, b) = (&self.inner, &other.inner);
        if a.gpu.ordinal() != b.gpu.ordinal() {
            return Err(Error::invalid("the tensors live on different GPUs"));
        }
        if a.len != b.len {
            return Err(Error::invalid(format!(
                "the tensors differ in length ({} and {} bytes)",
                a.len, b.len
            )));
        }
        let k = a.gpu.kernels()?;
        let stream = &a.stream;
        cu("comparing on the device", || {
            a.gpu.ctx.bind_to_thread()?;
            stream.join(&b.stream)?;
            // SAFETY: an 8-byte counter, freed below after the stream is synchronized.
            unsafe {
                let counter = result::malloc_sync(8)?;
                let run = (|| {
                    result::memset_d8_async(counter, 0, 8, stream.cu_stream())?;
                    let (mut pa, mut pb, mut n, mut pc) = (a.ptr, b.ptr, a.len as u64, counter);
                    let mut params = [
                        &mut pa as *mut u64 as *mut c_void,
                        &mut pb as *mut u64 as *mut c_void,
                        &mut n as *mut u64 as *mut c_void,
                        &mut pc as *mut u64 as *mut c_void,
                    ];
                    let blocks = (a.len.div_ceil(256 * 8)).clamp(1, 4096) as u32;
                    result::launch_kernel(
                        k.count_diff,
                        (blocks, 1, 1),
                        (256, 1, 1),
                        0,
                        stream.cu_stream(),
                        &mut params,
                    )?;
                    let mut out = [0u64; 1];
                    result::memcpy_dtoh_async(&mut out, counter, stream.cu_stream())?;
                    stream.synchronize()?;
                    Ok(out[0])
                })();
                let _ = result::free_sync(counter);
                run
            }
        })
    }
}

/// A box of a [`DeviceTensor`] that holds a larger box (a ZeRO partition or any sub-box of
/// what a rank holds), as a source (gathering its rows with 2-D copies) and a sink.
#[derive(Clone)]
pub struct DeviceRegion {
    tensor: DeviceTensor,
    runs: Arc<Vec<(usize, usize, usize)>>,
    len: usize,
}

impl std::fmt::Debug for DeviceRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceRegion({:?}, {} runs)",
            self.tensor,
            self.runs.len()
        )
    }
}

impl DeviceRegion {
    /// The part `sub` of `tensor`, which holds the box `held` with `elem`-byte elements.
    pub fn new(tensor: DeviceTensor, held: &NdBox, sub: &NdBox, elem: usize) -> Result<Self> {
        if !held.contains(sub) {
            return Err(Error::invalid(format!(
                "box {sub} is not inside the held box {held}"
            )));
        }
        let want = held.numel() as usize * elem;
        if want != tensor.len() {
            return Err(Error::invalid(format!(
                "held box {held} needs {want} bytes, the device tensor has {}",
                tensor.len()
            )));
        }
        let mut runs = Vec::new();
        ckpt_store::model::copy_runs(held, sub, sub, elem, |s, d, l| {
            runs.push((s as usize, d as usize, l as usize))
        });
        Ok(DeviceRegion {
            tensor,
            runs: Arc::new(runs),
            len: sub.numel() as usize * elem,
        })
    }

    /// Order the snapshot copy stream after the work enqueued on the compute stream.
    fn pin_now(&self) -> Result<DevicePin> {
        let i = &self.tensor.inner;
        cu("ordering the snapshot after the compute stream", || {
            let ev = i.stream.record_event(None)?;
            i.gpu.d2h.wait(&ev)
        })?;
        Ok(DevicePin {
            region: self.clone(),
        })
    }
}

struct DevicePin {
    region: DeviceRegion,
}

impl PinnedSource for DevicePin {
    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let r = &self.region;
        if offset + dst.len() > r.len {
            return Err(Error::internal(
                "snapshot copy past the end of a device tensor",
            ));
        }
        let i = &r.tensor.inner;
        let ops = plan_window(&r.runs, offset, dst.len());
        let host = dst.as_mut_ptr();
        cu("enqueueing a device-to-host copy", || {
            i.gpu.ctx.bind_to_thread()?;
            for op in &ops {
                // SAFETY: the op lies inside the tensor and inside dst, which stays valid until
                // fence returns (the PinnedSource contract).
                unsafe { enqueue(op, i.ptr, Dense::Host(host), true, i.gpu.d2h.cu_stream())? };
            }
            Ok(())
        })
    }

    fn fence(&self) -> Result<()> {
        cu("waiting for device-to-host copies", || {
            self.region.tensor.inner.gpu.d2h.synchronize()
        })
    }

    fn complete(self: Box<Self>) -> Result<()> {
        self.fence()
    }
}

impl MemorySource for DeviceRegion {
    fn len(&self) -> usize {
        self.len
    }

    fn pin(&self) -> Result<Box<dyn PinnedSource>> {
        Ok(Box::new(self.pin_now()?))
    }
}

/// Bounce buffers in use by one writer; on drop (also on errors) waits for their copies and
/// returns them to the pool.
struct InFlight<'a> {
    gpu: &'a Gpu,
    slots: [Option<(Bounce, Option<cudarc::driver::CudaEvent>)>; 2],
    done: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            // An error may have left copies queued without an event: drain the stream before
            // the buffers can be reused.
            let _ = cu("draining the restore stream", || self.gpu.h2d.synchronize());
        }
        for s in &mut self.slots {
            if let Some((b, ev)) = s.take() {
                if let Some(ev) = ev {
                    let _ = cu("waiting for a host-to-device copy", || ev.synchronize());
                }
                self.gpu.give_bounce(b);
            }
        }
    }
}

impl MemorySink for DeviceRegion {
    fn len(&self) -> usize {
        self.len
    }

    fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        if offset + src.len() > self.len {
            return Err(Error::invalid(
                "restore write past the end of a device tensor",
            ));
        }
        let i = &self.tensor.inner;
        let gpu = &*i.gpu;
        // After whatever the compute stream has queued for this tensor (a zero fill, say).
        cu("ordering the restore after the compute stream", || {
            let ev = i.stream.record_event(None)?;
            gpu.h2d.wait(&ev)
        })?;
        let mut fl = InFlight {
            gpu,
            slots: [None, None],
            done: false,
        };
        let size = gpu.bounce.size;
        // One buffer (waiting for the pool), and a second for double-buffering only if one is
        // free: a writer never waits for the pool while it holds a buffer.
        fl.slots[0] = Some((gpu.take_bounce(true)?.expect("blocking take"), None));
        if src.len() > size
            && let Some(b) = gpu.take_bounce(false)?
        {
            fl.slots[1] = Some((b, None));
        }
        let nslots = if fl.slots[1].is_some() { 2 } else { 1 };
        for (k, part) in src.chunks(size).enumerate() {
            let slot = &mut fl.slots[k % nslots];
            let (b, ev) = slot.as_mut().expect("a bounce buffer");
            if let Some(e) = ev.take() {
                cu("waiting for a host-to-device copy", || e.synchronize())?;
            }
            debug_assert!(part.len() <= b.len);
            // SAFETY: the buffer holds `size` bytes and no copy reads it (its event is done).
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), b.ptr, part.len()) };
            let ops = plan_window(&self.runs, offset + k * size, part.len());
            let host = b.ptr;
            *ev = Some(cu("enqueueing a host-to-device copy", || {
                gpu.ctx.bind_to_thread()?;
                for op in &ops {
                    // SAFETY: the op lies inside the tensor and the bounce buffer, which is
                    // not reused before the event recorded next has completed.
                    unsafe { enqueue(op, i.ptr, Dense::Host(host), false, gpu.h2d.cu_stream())? };
                }
                gpu.h2d.record_event(None)
            })?);
        }
        // Wait for the last copies (InFlight's drop), then report errors from them.
        for s in &mut fl.slots {
            if let Some((_, ev)) = s
                && let Some(e) = ev.take()
            {
                cu("waiting for a host-to-device copy", || e.synchronize())?;
            }
        }
        fl.done = true;
        Ok(())
    }
}

impl MemorySource for DeviceTensor {
    fn len(&self) -> usize {
        self.inner.len
    }

    fn pin(&self) -> Result<Box<dyn PinnedSource>> {
        Ok(Box::new(self.whole().pin_now()?))
    }
}

impl MemorySink for DeviceTensor {
    fn len(&self) -> usize {
        self.inner.len
    }

    fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.whole().write_at(offset, src)
    }
}

impl TensorMemory for DeviceTensor {
    fn source(&self, held: &NdBox, sub: &NdBox, elem: usize) -> Result<Arc<dyn MemorySource>> {
        Ok(Arc::new(DeviceRegion::new(self.clone(), held, sub, elem)?))
    }

    fn sink(&self, held: &NdBox, elem: usize) -> Result<Arc<dyn MemorySink>> {
        let want = held.numel() as usize * elem;
        if want != self.inner.len {
            return Err(Error::invalid(format!(
                "held box {held} needs {want} bytes, the device tensor has {}",
                self.inner.len
            )));
        }
        Ok(Arc::new(self.clone()))
    }
}

// ---------------------------------------------------------------------------------------------
// Recovery from peers' GPU memory over NCCL
// ---------------------------------------------------------------------------------------------

pub mod peer {
    //! Recovery from survivors' GPU memory over NCCL, instead of the store.
    //!
    //! After a failure, the ranks of the new layout need boxes of every tensor. Where a
    //! survivor still holds a needed region **in device memory, with the contents of the step
    //! being restored**, it can send it over NCCL (NVLink or InfiniBand, tens of GB/s per rank)
    //! instead of the receiver fetching, hash-checking and decompressing it from the store.
    //!
    //! - [`plan`] (pure, in [`crate::peer_plan`] and re-exported here) matches each needed box
    //!   against the holdings, cutting it into regions sent by survivors and regions left to
    //!   the store, and estimates both ways with [`PeerCost`].
    //! - [`PeerExchange`] executes a plan on one rank: pack each region into a contiguous device
    //!   buffer, `ncclSend`/`ncclRecv` in one NCCL group per round of bounded memory, unpack
    //!   into the destination; [`store_targets`] gives the restore targets for the rest, and
    //!   [`restore_with_peers`] does both.
    //!
    //! **When it is chosen.** The peer path is used only when all of these hold, otherwise
    //! everything comes from the store:
    //!
    //! 1. the survivors kept their processes and device memory (an in-process re-layout, not a
    //!    relaunch, which loses device memory), and every rank of the new layout joins one
    //!    NCCL communicator ([`PeerExchange::new`]; the unique id travels out of band, e.g.
    //!    through the supervisor);
    //! 2. the holdings are of exactly the step being restored ([`Holding::step`]): survivors
    //!    whose tensors moved past the checkpoint (an optimizer step after it) are ignored, as
    //!    mixing steps would break bit-identical resumption;
    //! 3. the estimate says it is faster: `setup_s + busiest rank's sent or received bytes /
    //!    link_bytes_per_s` is below `the busiest receiver's bytes / store_bytes_per_s`
    //!    (measured figures should replace [`PeerCost::default`]).
    //!
    //! Destinations must be buffers separate from the sources (sources are freed afterwards).

    use std::ffi::c_void;
    use std::sync::Arc;
    use std::time::Instant;

    use ckpt_store::{DType, Error, ErrorKind, NdBox, ReadStats, Result, StepReader};
    use cudarc::nccl::{result as nccl, sys as nsys};

    use super::{Dense, DeviceRegion, DeviceTensor, Gpu, cu, enqueue, nccl_present, plan_window};
    pub use crate::peer_plan::{
        Holding, Need, PeerCost, PeerPlan, StoreRead, Transfer, plan, rounds, subtract,
    };
    use crate::restore::{RestoreTarget, restore_targets};

    /// A tensor's memory on this rank, as a source (what a survivor holds now) or a
    /// destination (what this rank holds under the new layout).
    #[derive(Debug, Clone)]
    pub struct PeerTensor {
        /// Tensor name.
        pub name: String,
        /// Element type.
        pub dtype: DType,
        /// Global shape.
        pub shape: Vec<u64>,
        /// The box the memory holds, row-major.
        pub held: NdBox,
        /// The memory.
        pub memory: DeviceTensor,
    }

    fn find<'a>(
        ts: &'a [PeerTensor],
        name: &str,
        region: &NdBox,
        what: &str,
    ) -> Result<&'a PeerTensor> {
        let t = ts
            .iter()
            .find(|t| t.name == name && t.held.contains(region))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "no {what} tensor {name:?} on this rank holds the region {region}"
                ))
            })?;
        let want = t.held.numel() as usize * t.dtype.size();
        if t.memory.len() != want {
            return Err(Error::invalid(format!(
                "{what} tensor {name:?}: held box {} needs {want} bytes, its memory has {}",
                t.held,
                t.memory.len()
            )));
        }
        Ok(t)
    }

    /// What one rank moved.
    #[derive(Debug, Clone, Copy, Default, PartialEq)]
    pub struct PeerStats {
        /// Bytes sent to other ranks.
        pub bytes_sent: u64,
        /// Bytes received from other ranks.
        pub bytes_received: u64,
        /// Bytes copied within this rank.
        pub bytes_local: u64,
        /// Seconds.
        pub seconds: f64,
    }

    fn nc<T>(what: &str, f: impl FnOnce() -> std::result::Result<T, nccl::NcclError>) -> Result<T> {
        if !nccl_present() {
            return Err(Error::new(
                ErrorKind::NoDevice,
                format!(
                    "NCCL: {what}: libnccl.so could not be loaded (install NCCL, or link \
                     libnccl.so.2 as libnccl.so on the library path)"
                ),
            ));
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Error::new(
                ErrorKind::Device,
                format!("NCCL: {what}: {:?}", e.0),
            )),
            Err(p) => Err(Error::new(
                ErrorKind::NoDevice,
                format!("NCCL: {what}: {}", super::panic_text(&*p)),
            )),
        }
    }

    /// One rank's end of an NCCL communicator over the ranks of the new layout.
    pub struct PeerExchange {
        gpu: Arc<Gpu>,
        comm: Option<nsys::ncclComm_t>,
        stream: Arc<cudarc::driver::CudaStream>,
        rank: u32,
        world: u32,
        /// Bytes of temporary device buffers per rank and round (default 1 GiB).
        pub round_bytes: u64,
        /// Send regions a rank copies to itself through NCCL too (default off: a device copy).
        pub local_via_nccl: bool,
    }

    // SAFETY: the communicator is used by one thread at a time (&mut-free API, but PeerExchange
    // is not Sync).
    unsafe impl Send for PeerExchange {}

    impl std::fmt::Debug for PeerExchange {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(
                f,
                "PeerExchange(rank {} of {}, {:?})",
                self.rank, self.world, self.gpu
            )
        }
    }

    impl PeerExchange {
        /// A new communicator id: made on one rank, given to every other out of band.
        pub fn unique_id() -> Result<[u8; 128]> {
            let id = nc("making a unique id", nccl::get_uniqueid)?;
            Ok(id.internal.map(|c| c as u8))
        }

        /// Join the communicator `id` as `rank` of `world` (every rank calls this; it returns
        /// when all have joined).
        pub fn new(gpu: &Arc<Gpu>, rank: u32, world: u32, id: &[u8; 128]) -> Result<Self> {
            if rank >= world {
                return Err(Error::invalid(format!(
                    "rank {rank} is not below world size {world}"
                )));
            }
            let stream = cu("creating the exchange stream", || gpu.ctx.new_stream())?;
            cu("binding the context", || gpu.ctx.bind_to_thread())?;
            let id = nsys::ncclUniqueId {
                internal: id.map(|b| b as std::ffi::c_char),
            };
            let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
            nc("joining the communicator", || {
                // SAFETY: comm is written by NCCL on success.
                unsafe { nccl::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
            })?;
            Ok(PeerExchange {
                gpu: gpu.clone(),
                comm: Some(comm),
                stream,
                rank,
                world,
                round_bytes: 1 << 30,
                local_via_nccl: false,
            })
        }

        /// Rank 0 of a world of one, without NCCL: executes plans whose transfers are all
        /// local (a re-layout within one process and GPU) with device copies.
        pub fn local(gpu: &Arc<Gpu>) -> Result<Self> {
            let stream = cu("creating the exchange stream", || gpu.ctx.new_stream())?;
            Ok(PeerExchange {
                gpu: gpu.clone(),
                comm: None,
                stream,
                rank: 0,
                world: 1,
                round_bytes: 1 << 30,
                local_via_nccl: false,
            })
        }

        /// This rank.
        pub fn rank(&self) -> u32 {
            self.rank
        }

        fn buf(&self, len: u64) -> Result<DevBuf> {
            let ptr = cu("allocating an exchange buffer", || {
                self.gpu.ctx.bind_to_thread()?;
                // SAFETY: freed in DevBuf's drop.
                unsafe { cudarc::driver::result::malloc_sync((len as usize).max(1)) }
            })?;
            Ok(DevBuf {
                gpu: self.gpu.clone(),
                stream: self.stream.clone(),
                ptr,
            })
        }

        /// Run this rank's part of `plan`: send what it holds in `sources` to the ranks that
        /// need it and receive what it needs into `dests` (every rank calls this with the same
        /// plan). Returns when the bytes are in place.
        pub fn execute(
            &self,
            plan: &PeerPlan,
            sources: &[PeerTensor],
            dests: &[PeerTensor],
        ) -> Result<PeerStats> {
            let t0 = Instant::now();
            let mut stats = PeerStats::default();
            if !plan.use_peers {
                return Ok(stats);
            }
            let me = self.rank;
            let ctx = &self.gpu.ctx;
            let s = self.stream.cu_stream();
            // After the work queued on every involved tensor's compute stream.
            cu("ordering the exchange after the compute streams", || {
                for t in sources.iter().chain(dests) {
                    self.stream.join(t.memory.stream())?;
                }
                Ok(())
            })?;
            for round in rounds(&plan.transfers, self.round_bytes) {
                let ts = &plan.transfers[round];
                // (transfer, source or destination tensor, temporary buffer)
                let mut packs: Vec<(&Transfer, &PeerTensor, DevBuf)> = Vec::new();
                let mut unpacks: Vec<(&Transfer, &PeerTensor, DevBuf)> = Vec::new();
                let mut locals: Vec<(&PeerTensor, &PeerTensor, &Transfer, DevBuf)> = Vec::new();
                for t in ts {
                    if t.from != me && t.to != me {
                        continue;
                    }
                    if t.from == me && t.to == me && !self.local_via_nccl {
                        let src = find(sources, &t.tensor, &t.region, "source")?;
                        let dst = find(dests, &t.tensor, &t.region, "destination")?;
                        locals.push((src, dst, t, self.buf(t.bytes)?));
                        continue;
                    }
                    if t.from == me {
                        let src = find(sources, &t.tensor, &t.region, "source")?;
                        packs.push((t, src, self.buf(t.bytes)?));
                    }
                    if t.to == me {
                        let dst = find(dests, &t.tensor, &t.region, "destination")?;
                        unpacks.push((t, dst, self.buf(t.bytes)?));
                    }
                }
                // Pack (and local copies).
                for (t, src, buf) in &packs {
                    copy_region(ctx, src, &t.region, buf.ptr, true, s)?;
                }
                for (src, dst, t, buf) in &locals {
                    copy_region(ctx, src, &t.region, buf.ptr, true, s)?;
                    copy_region(ctx, dst, &t.region, buf.ptr, false, s)?;
                    stats.bytes_local += t.bytes;
                }
                // Exchange, in plan order on both sides of every pair, in one group.
                if !packs.is_empty() || !unpacks.is_empty() {
                    let comm = self.comm.ok_or_else(|| {
                        Error::invalid(
                            "the plan sends between ranks but this exchange has no NCCL \
                             communicator (PeerExchange::local)",
                        )
                    })?;
                    let sends = packs.iter().map(|(t, _, b)| (*t, b.ptr, true));
                    let recvs = unpacks.iter().map(|(t, _, b)| (*t, b.ptr, false));
                    // Within a group NCCL matches the sends from one rank to another with that
                    // rank's receives in the order issued: both follow the plan's order.
                    let ops: Vec<(&Transfer, u64, bool)> = sends.chain(recvs).collect();
                    cu("binding the context", || ctx.bind_to_thread())?;
                    nc("starting a group", nccl::group_start)?;
                    let mut res = Ok(());
                    for (t, ptr, is_send) in ops {
                        let n = t.bytes as usize;
                        let dt = nsys::ncclDataType_t::ncclUint8;
                        let st = s as nsys::cudaStream_t;
                        res = if is_send {
                            stats.bytes_sent += t.bytes;
                            // SAFETY: the buffer holds the packed region until the stream ran.
                            nc("sending", || unsafe {
                                nccl::send(ptr as *const c_void, n, dt, t.to as i32, comm, st)
                            })
                        } else {
                            stats.bytes_received += t.bytes;
                            // SAFETY: the buffer has room for the region.
                            nc("receiving", || unsafe {
                                nccl::recv(ptr as *mut c_void, n, dt, t.from as i32, comm, st)
                            })
                        }
                        .map(|_| ());
                        if res.is_err() {
                            break;
                        }
                    }
                    let end = nc("ending a group", nccl::group_end).map(|_| ());
                    res.and(end)?;
                }
                for (t, dst, buf) in &unpacks {
                    copy_region(ctx, dst, &t.region, buf.ptr, false, s)?;
                }
                cu("waiting for the exchange", || self.stream.synchronize())?;
            }
            stats.seconds = t0.elapsed().as_secs_f64();
            Ok(stats)
        }
    }

    /// Copy `region` between tensor `t` (strided) and the dense device buffer at `buf`.
    fn copy_region(
        ctx: &Arc<cudarc::driver::CudaContext>,
        t: &PeerTensor,
        region: &NdBox,
        buf: u64,
        to_buf: bool,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let elem = t.dtype.size();
        let mut runs = Vec::new();
        ckpt_store::model::copy_runs(&t.held, region, region, elem, |a, b, l| {
            runs.push((a as usize, b as usize, l as usize))
        });
        let len = region.numel() as usize * elem;
        let ops = plan_window(&runs, 0, len);
        let dev = t.memory.device_ptr();
        cu("copying a region on the device", || {
            ctx.bind_to_thread()?;
            for op in &ops {
                // SAFETY: the runs lie in the tensor's held box and in the buffer of `len`
                // bytes, which lives until the stream is synchronized.
                unsafe { enqueue(op, dev, Dense::Device(buf), to_buf, stream)? };
            }
            Ok(())
        })
    }

    /// A temporary device buffer used on the exchange stream, freed on drop once that stream
    /// has run everything queued (also on error paths).
    struct DevBuf {
        gpu: Arc<Gpu>,
        stream: Arc<cudarc::driver::CudaStream>,
        ptr: u64,
    }

    impl Drop for DevBuf {
        fn drop(&mut self) {
            let _ = cu("freeing an exchange buffer", || {
                self.gpu.ctx.bind_to_thread()?;
                self.stream.synchronize()?;
                // SAFETY: allocated by PeerExchange::buf; the stream that used it is idle.
                unsafe { cudarc::driver::result::free_sync(self.ptr) }
            });
        }
    }

    impl Drop for PeerExchange {
        fn drop(&mut self) {
            let Some(comm) = self.comm else { return };
            let _ = nc("destroying the communicator", || {
                // SAFETY: created in new, used by no one else.
                unsafe { nccl::comm_destroy(comm) }
            });
        }
    }

    /// The restore targets of `rank`'s store reads in `plan`, writing into `dests`.
    pub fn store_targets(
        plan: &PeerPlan,
        rank: u32,
        dests: &[PeerTensor],
    ) -> Result<Vec<RestoreTarget>> {
        let mut out = Vec::new();
        for r in plan.store_reads.iter().filter(|r| r.rank == rank) {
            let d = find(dests, &r.tensor, &r.region, "destination")?;
            out.push(RestoreTarget {
                name: d.name.clone(),
                dtype: d.dtype,
                shape: d.shape.clone(),
                bbox: r.region.clone(),
                sink: Arc::new(DeviceRegion::new(
                    d.memory.clone(),
                    &d.held,
                    &r.region,
                    d.dtype.size(),
                )?),
            });
        }
        Ok(out)
    }

    /// What a restore with peers moved.
    #[derive(Debug, Clone, Default)]
    pub struct PeerRestoreStats {
        /// From peers.
        pub peers: PeerStats,
        /// From the store.
        pub store: ReadStats,
    }

    /// Restore `rank`'s `dests` for `plan`: the peer transfers first (when the plan takes the
    /// peer path; then `exchange` is required), then the rest from the store through `reader`
    /// with at most `budget` bytes in flight.
    pub fn restore_with_peers(
        reader: &StepReader,
        exchange: Option<&PeerExchange>,
        plan: &PeerPlan,
        rank: u32,
        sources: &[PeerTensor],
        dests: &[PeerTensor],
        budget: usize,
    ) -> Result<PeerRestoreStats> {
        let peers = if plan.use_peers {
            let ex = exchange.ok_or_else(|| {
                Error::invalid("the plan takes the peer path but no NCCL communicator was given")
            })?;
            ex.execute(plan, sources, dests)?
        } else {
            PeerStats::default()
        };
        let targets = store_targets(plan, rank, dests)?;
        let store = crate::save::runtime().block_on(restore_targets(reader, &targets, budget))?;
        Ok(PeerRestoreStats { peers, store })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Apply ops as the driver would: strided tensor bytes -> dense window.
    fn gather(ops: &[Op], tensor: &[u8], out: &mut [u8]) {
        for op in ops {
            for r in 0..op.height {
                let s = op.dev + r * op.dev_pitch;
                let d = op.dense + r * op.width;
                out[d..d + op.width].copy_from_slice(&tensor[s..s + op.width]);
            }
        }
    }

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    #[test]
    fn windows_of_sub_boxes_become_few_copies_with_the_right_bytes() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        for case in 0..300 {
            let nd = 1 + (rng(&mut seed) % 3) as usize;
            let shape: Vec<u64> = (0..nd).map(|_| 1 + rng(&mut seed) % 9).collect();
            let held = NdBox::full(&shape);
            let mut off = Vec::new();
            let mut len = Vec::new();
            for &s in &shape {
                let o = rng(&mut seed) % s;
                let l = 1 + rng(&mut seed) % (s - o);
                off.push(o);
                len.push(l);
            }
            let sub = NdBox::new(off, len).unwrap();
            let elem = [1usize, 2, 4][(rng(&mut seed) % 3) as usize];
            let tensor: Vec<u8> = (0..held.numel() as usize * elem)
                .map(|i| (i * 31 + case) as u8)
                .collect();
            let mut runs = Vec::new();
            ckpt_store::model::copy_runs(&held, &sub, &sub, elem, |s, d, l| {
                runs.push((s as usize, d as usize, l as usize))
            });
            let total = sub.numel() as usize * elem;
            let mut want = vec![0u8; total];
            for &(s, d, l) in &runs {
                want[d..d + l].copy_from_slice(&tensor[s..s + l]);
            }
            // Whole, and random windows.
            for _ in 0..5 {
                let a = (rng(&mut seed) as usize) % total;
                let b = a + 1 + (rng(&mut seed) as usize) % (total - a);
                let ops = plan_window(&runs, a, b - a);
                let mut got = vec![0u8; b - a];
                gather(&ops, &tensor, &mut got);
                assert_eq!(got, want[a..b], "case {case} window {a}..{b} ops {ops:?}");
                let covered: usize = ops.iter().map(|o| o.width * o.height).sum();
                assert_eq!(covered, b - a, "ops cover the window exactly once");
                assert!(ops.iter().all(|o| o.dev_pitch >= o.width));
            }
            let ops = plan_window(&runs, 0, total);
            assert!(ops.len() <= 3 * sub.numel().max(1) as usize);
        }
    }

    #[test]
    fn a_column_block_is_one_2d_copy() {
        // [1000, 64] f32, columns 16..48: 1000 rows of 128 bytes, 256 bytes apart.
        let held = NdBox::full(&[1000, 64]);
        let sub = NdBox::new(vec![0, 16], vec![1000, 32]).unwrap();
        let mut runs = Vec::new();
        ckpt_store::model::copy_runs(&held, &sub, &sub, 4, |s, d, l| {
            runs.push((s as usize, d as usize, l as usize))
        });
        assert_eq!(runs.len(), 1000);
        let ops = plan_window(&runs, 0, 1000 * 128);
        assert_eq!(
            ops,
            vec![Op {
                dev: 64,
                dense: 0,
                width: 128,
                height: 1000,
                dev_pitch: 256
            }]
        );
        // A window cutting rows: head, body, tail.
        let ops = plan_window(&runs, 100, 128 * 10);
        assert_eq!(ops.len(), 3, "{ops:?}");
        assert_eq!(ops[1].height, 9);
    }

    #[test]
    fn without_a_driver_every_entry_point_is_an_error() {
        if driver_present() {
            eprintln!("a CUDA driver is present: the no-driver errors are not reachable here");
            return;
        }
        let e = Gpu::open(0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoDevice);
        assert!(e.to_string().contains("no CUDA driver was found"), "{e}");
        assert!(Gpu::count().is_err());
    }
}
