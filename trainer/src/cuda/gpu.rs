//! One GPU: [`Gpu`] (its context, the snapshot and restore copy streams, the kernels) and
//! [`GpuOptions`]; one handle per ordinal while one is alive.

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use ckpt_store::{Error, ErrorKind, Result};
use cudarc::driver::{CudaContext, CudaStream, DriverError, result, sys};
use parking_lot::{Condvar, Mutex};

use super::kernels::Kernels;
use super::pinned::{BouncePool, PinSlabs};
use super::{cu, driver_error, driver_present, no_driver};
use crate::staging::set_slab_hook;

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

/// One GPU: a context, a stream for snapshot copies (device to host), one for restore copies
/// (host to device) and pinned bounce buffers for restores. [`Gpu::open`] returns the same
/// handle for the same ordinal while one is alive.
pub struct Gpu {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) d2h: Arc<CudaStream>,
    pub(super) h2d: Arc<CudaStream>,
    pub(super) compute: Arc<CudaStream>,
    pub(super) bounce: BouncePool,
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

    /// The stream tensors made by [`DeviceTensor::alloc`](super::DeviceTensor::alloc) are written on (the context's
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

    pub(super) fn kernels(&self) -> Result<&Kernels> {
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
