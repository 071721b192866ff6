//! Device tensors: [`DeviceTensor`] (a span of device memory and its compute stream) and
//! [`DeviceRegion`] (a sub-box of one), as memory sources (snapshot) and sinks (restore).

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

use ckpt_store::{Error, NdBox, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, result, sys};

use super::copy::{Dense, enqueue, plan_window};
use super::pinned::Bounce;
use super::{Gpu, cu};
use crate::manager::TensorMemory;
use crate::memory::{MemorySink, MemorySource, PinnedSource};

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

    fn copies_by_dma(&self) -> bool {
        true
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
