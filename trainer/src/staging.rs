//! The staging pool: host buffers a snapshot copies into, allocated and touched once, reused
//! by every save, and bounded.
//!
//! Memory this VM has never touched fills at 0.3-3 GB/s; memory already faulted in at about
//! 11 GB/s (BENCHMARKS.md). So slabs are touched when allocated (optionally all up front) and
//! return to the pool when the store has written the chunk they hold. A snapshot that needs
//! more slabs than are free waits for the persist of earlier chunks: memory never exceeds the
//! bound.

use std::sync::Arc;

use bytes::Bytes;
use ckpt_store::direct::AlignedBuf;
use parking_lot::{Condvar, Mutex};

/// Settings of a pool.
#[derive(Debug, Clone, Copy)]
pub struct PoolConfig {
    /// Most bytes of slabs ever allocated.
    pub capacity: usize,
    /// Bytes per slab (the store's chunk size, so a chunk is a slab).
    pub slab: usize,
}

#[derive(Debug, Default)]
struct PoolState {
    free: Vec<AlignedBuf>,
    allocated: usize,
    in_use: usize,
    peak_in_use: usize,
}

/// A bounded pool of page-aligned slabs.
#[derive(Debug)]
pub struct StagingPool {
    cfg: PoolConfig,
    state: Mutex<PoolState>,
    freed: Condvar,
}

/// Figures of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PoolStats {
    /// Bytes of slabs allocated (never shrinks).
    pub allocated: usize,
    /// Bytes of slabs in use now.
    pub in_use: usize,
    /// Most bytes in use at once.
    pub peak_in_use: usize,
    /// The bound.
    pub capacity: usize,
}

fn touch(buf: &mut AlignedBuf) {
    // Fault every page in now (alloc_zeroed may hand out untouched zero pages).
    let b = buf.full_mut();
    let mut i = 0;
    while i < b.len() {
        // SAFETY: i < len; a volatile write so the compiler keeps it.
        unsafe { std::ptr::write_volatile(b.as_mut_ptr().add(i), 0) };
        i += 4096;
    }
}

impl StagingPool {
    /// A pool; with `prefault`, every slab is allocated and touched now.
    pub fn new(cfg: PoolConfig, prefault: bool) -> Arc<Self> {
        assert!(cfg.slab > 0, "slab size must be positive");
        let cap = cfg.capacity.max(cfg.slab);
        let pool = Arc::new(StagingPool {
            cfg: PoolConfig {
                capacity: cap,
                slab: cfg.slab,
            },
            state: Mutex::new(PoolState::default()),
            freed: Condvar::new(),
        });
        if prefault {
            let n = cap / cfg.slab;
            let mut st = pool.state.lock();
            for _ in 0..n {
                let mut b = AlignedBuf::zeroed(cfg.slab);
                touch(&mut b);
                st.free.push(b);
                st.allocated += cfg.slab;
            }
        }
        pool
    }

    /// Bytes per slab.
    pub fn slab_size(&self) -> usize {
        self.cfg.slab
    }

    /// Take a slab, waiting for one to be returned if the bound is reached.
    pub fn acquire(self: &Arc<Self>) -> Slab {
        let mut st = self.state.lock();
        loop {
            if let Some(b) = st.free.pop() {
                st.in_use += self.cfg.slab;
                st.peak_in_use = st.peak_in_use.max(st.in_use);
                return Slab {
                    buf: Some(b),
                    pool: self.clone(),
                };
            }
            if st.allocated + self.cfg.slab <= self.cfg.capacity {
                st.allocated += self.cfg.slab;
                st.in_use += self.cfg.slab;
                st.peak_in_use = st.peak_in_use.max(st.in_use);
                drop(st);
                let mut b = AlignedBuf::zeroed(self.cfg.slab);
                touch(&mut b);
                return Slab {
                    buf: Some(b),
                    pool: self.clone(),
                };
            }
            self.freed.wait(&mut st);
        }
    }

    /// Current figures.
    pub fn stats(&self) -> PoolStats {
        let st = self.state.lock();
        PoolStats {
            allocated: st.allocated,
            in_use: st.in_use,
            peak_in_use: st.peak_in_use,
            capacity: self.cfg.capacity,
        }
    }

    /// Forget the peak (to measure one save).
    pub fn reset_peak(&self) {
        let mut st = self.state.lock();
        st.peak_in_use = st.in_use;
    }

    fn give_back(&self, b: AlignedBuf) {
        let mut st = self.state.lock();
        st.in_use -= self.cfg.slab;
        st.free.push(b);
        drop(st);
        self.freed.notify_one();
    }
}

/// One slab, returned to its pool when dropped (or when the last `Bytes` made from it is).
#[derive(Debug)]
pub struct Slab {
    buf: Option<AlignedBuf>,
    pool: Arc<StagingPool>,
}

impl Slab {
    /// The whole slab, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.buf.as_mut().expect("slab present").full_mut()
    }

    /// The first `len` bytes as shared `Bytes`; the slab returns to the pool when the last
    /// clone is dropped.
    pub fn freeze(mut self, len: usize) -> Bytes {
        let mut b = self.buf.take().expect("slab present");
        b.set_len(len);
        Bytes::from_owner(Frozen {
            buf: Some(b),
            pool: self.pool.clone(),
        })
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give_back(b);
        }
    }
}

struct Frozen {
    buf: Option<AlignedBuf>,
    pool: Arc<StagingPool>,
}

impl AsRef<[u8]> for Frozen {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_deref().unwrap_or(&[])
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if let Some(mut b) = self.buf.take() {
            let cap = b.capacity();
            b.set_len(cap);
            self.pool.give_back(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn bounded_and_reused() {
        let pool = StagingPool::new(
            PoolConfig {
                capacity: 3 * 4096,
                slab: 4096,
            },
            false,
        );
        let a = pool.acquire();
        let b = pool.acquire();
        let c = pool.acquire();
        assert_eq!(pool.stats().in_use, 3 * 4096);
        let p2 = pool.clone();
        let waiter = std::thread::spawn(move || {
            let _d = p2.acquire();
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "a fourth slab must wait");
        let frozen = a.freeze(100);
        let piece = frozen.slice(10..20);
        drop(frozen);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished(), "a slice still holds the slab");
        drop(piece);
        waiter.join().unwrap();
        drop((b, c));
        let st = pool.stats();
        assert_eq!(st.allocated, 3 * 4096);
        assert_eq!(st.in_use, 0);
        assert_eq!(st.peak_in_use, 3 * 4096);
    }
}
