//! Device memory through `cudarc` (feature `cuda`): snapshot from GPU memory, restore to it,
//! and an optional NCCL path that serves a recovery from survivors' GPU memory.
//!
//! # Snapshot
//!
//! A [`DeviceTensor`] is a span of device memory (a `cudarc` slice it owns, or a raw pointer
//! owned elsewhere, such as a framework's tensor) plus the **compute stream** the training loop
//! writes it on. [`MemorySource::pin`](crate::MemorySource::pin), called inside `save` on the
//! training thread, records an event on the compute stream and makes the GPU's dedicated copy
//! stream wait for it: every write enqueued before `save` lands in the checkpoint. `copy_to` enqueues
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
//! [`MemorySink::write_at`](crate::MemorySink::write_at) copies the bytes into pinned bounce
//! buffers (allocated once per GPU, reused) and enqueues `cuMemcpyHtoDAsync` from them, double-buffered, on the GPU's
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
//!
//! # Files
//!
//! - `mod.rs`: whether the driver and NCCL can be loaded, and driver errors as [`Error`]s;
//! - `gpu`: [`Gpu`] (context, copy streams) and [`GpuOptions`];
//! - `kernels`: the small PTX kernels (device compare, busy wait);
//! - `pinned`: page-locked host memory: restore bounce buffers and the staging slab hook;
//! - `copy`: a sub-box window as 1-D and 2-D copies, and enqueueing them;
//! - `tensor`: [`DeviceTensor`] and [`DeviceRegion`] as memory sources and sinks;
//! - [`peer`]: recovery from survivors' GPU memory over NCCL.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use ckpt_store::{Error, ErrorKind, Result};
use cudarc::driver::{DriverError, sys};

mod copy;
mod gpu;
mod kernels;
pub mod peer;
mod pinned;
mod tensor;

pub use gpu::{Gpu, GpuOptions};
pub use tensor::{DeviceRegion, DeviceTensor};

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

#[cfg(test)]
mod tests {
    use super::*;

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
