//! Page-locked host memory: the pinned bounce buffers restores copy through (a pool per
//! [`Gpu`]) and the staging slab hook that page-locks every slab of the staging pools.

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ckpt_store::Result;
use cudarc::driver::{CudaContext, result, sys};
use parking_lot::{Condvar, Mutex};
use tracing::warn;

use super::{Gpu, cu};
use crate::staging::SlabHook;

pub(super) struct Bounce {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: page-locked host memory owned by the pool, handed to one user at a time.
unsafe impl Send for Bounce {}

/// Page-locked restore buffers, a fixed few reused for the job's life (pinning is slow). Not
/// shared with the store's read buffer pool: see `ckpt_store::direct`'s `READ_BUFS`.
pub(super) struct BouncePool {
    pub(super) size: usize,
    pub(super) max: usize,
    pub(super) state: Mutex<(Vec<Bounce>, usize)>,
    pub(super) freed: Condvar,
}

impl Gpu {
    /// A bounce buffer; when none is free and the pool is full, waits if `wait`, else `None`.
    pub(super) fn take_bounce(&self, wait: bool) -> Result<Option<Bounce>> {
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

    pub(super) fn give_bounce(&self, b: Bounce) {
        self.bounce.state.lock().0.push(b);
        self.bounce.freed.notify_one();
    }
}

/// The staging slab hook: page-lock each slab with `cuMemHostRegister`.
pub(super) struct PinSlabs {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) registered: Mutex<HashSet<usize>>,
    pub(super) warned: AtomicBool,
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
