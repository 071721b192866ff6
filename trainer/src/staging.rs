//! The staging pool: host buffers a snapshot copies into, allocated and touched once, reused
//! by every save, and bounded.
//!
//! Memory this VM has never touched fills at 0.3-3 GB/s; memory already faulted in at about
//! 11 GB/s (BENCHMARKS.md). So slabs are touched when allocated (optionally all up front) and
//! return to the pool when the store has written the chunk they hold. A snapshot that needs
//! more slabs than are free waits for the persist of earlier chunks: memory never exceeds the
//! bound.
//!
//! Any bound of at least one slab makes progress, also with several ranks sharing one pool:
//! a snapshot takes the slabs of a batch all at once or none ([`StagingPool::acquire_many`]),
//! so it never holds part of the pool while it waits for the rest; every slab it holds has
//! been handed to its persist, which frees it once the store has the chunk. A wait in which
//! no slab comes back for the stall timeout fails with an error naming the wait.
//!
//! A [`SlabHook`] installed with [`set_slab_hook`] sees every slab that pools created after it
//! allocate and free: the CUDA path (feature `cuda`) uses it to page-lock slabs once, so
//! device-to-host copies land in them by DMA. Without a hook nothing changes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ckpt_store::direct::AlignedBuf;
use ckpt_store::{Error, Result};
use parking_lot::{Condvar, Mutex, RwLock};

/// Sees each slab a pool allocates (after it is touched) and frees (before it is released).
pub trait SlabHook: Send + Sync {
    /// `len` bytes at `ptr` became a slab.
    fn on_alloc(&self, ptr: *mut u8, len: usize);
    /// The slab at `ptr` is about to be freed.
    fn on_free(&self, ptr: *mut u8, len: usize);
}

static SLAB_HOOK: RwLock<Option<Arc<dyn SlabHook>>> = RwLock::new(None);

/// Install the hook that pools created from now on use (`None` removes it). Pools keep the
/// hook they were created with, so each slab is freed through the hook that allocated it.
pub fn set_slab_hook(hook: Option<Arc<dyn SlabHook>>) {
    *SLAB_HOOK.write() = hook;
}

struct HookSlot(Option<Arc<dyn SlabHook>>);

impl std::fmt::Debug for HookSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "hook" } else { "no hook" })
    }
}

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
    capacity: usize,
    /// Slabs returned so far (progress, for the stall timeout).
    returned: u64,
}

/// A bounded pool of page-aligned slabs.
#[derive(Debug)]
pub struct StagingPool {
    cfg: PoolConfig,
    state: Mutex<PoolState>,
    freed: Condvar,
    hook: HookSlot,
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
            state: Mutex::new(PoolState {
                capacity: cap,
                ..PoolState::default()
            }),
            freed: Condvar::new(),
            hook: HookSlot(SLAB_HOOK.read().clone()),
        });
        if prefault {
            pool.prefault();
        }
        pool
    }

    /// Allocate and touch slabs up to the bound now (not during a snapshot).
    pub fn prefault(&self) {
        let mut st = self.state.lock();
        while st.allocated + self.cfg.slab <= st.capacity {
            let b = self.new_slab();
            st.free.push(b);
            st.allocated += self.cfg.slab;
        }
    }

    /// Raise the bound to at least `bytes` (never lowers it).
    pub fn ensure_capacity(&self, bytes: usize) {
        let mut st = self.state.lock();
        st.capacity = st.capacity.max(bytes.next_multiple_of(self.cfg.slab));
        drop(st);
        self.freed.notify_all();
    }

    fn new_slab(&self) -> AlignedBuf {
        let mut b = AlignedBuf::zeroed(self.cfg.slab);
        touch(&mut b);
        if let Some(h) = &self.hook.0 {
            let full = b.full_mut();
            h.on_alloc(full.as_mut_ptr(), full.len());
        }
        b
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
            if st.allocated + self.cfg.slab <= st.capacity {
                st.allocated += self.cfg.slab;
                st.in_use += self.cfg.slab;
                st.peak_in_use = st.peak_in_use.max(st.in_use);
                drop(st);
                let b = self.new_slab();
                return Slab {
                    buf: Some(b),
                    pool: self.clone(),
                };
            }
            self.freed.wait(&mut st);
        }
    }

    /// Take `n` slabs at once, or none: waits until `n` are free (or can be allocated), so a
    /// waiting caller never holds part of the pool that another waiter needs. `n` is clamped to
    /// the bound. `on_wait` runs once, before the first wait (a snapshot starts its persist
    /// then: only the persist frees slabs). Fails when no slab came back to the pool for
    /// `stall` while waiting: whoever holds them is not making progress.
    pub fn acquire_many(
        self: &Arc<Self>,
        n: usize,
        stall: Duration,
        mut on_wait: impl FnMut(),
    ) -> Result<Vec<Slab>> {
        let slab = self.cfg.slab;
        let mut st = self.state.lock();
        let n = n.clamp(1, (st.capacity / slab).max(1));
        let mut waited = false;
        let mut seen = st.returned;
        let mut since = Instant::now();
        loop {
            let can_alloc = (st.capacity.saturating_sub(st.allocated)) / slab;
            if st.free.len() + can_alloc >= n {
                let from_free = n.min(st.free.len());
                let keep = st.free.len() - from_free;
                let mut bufs: Vec<Option<AlignedBuf>> = st.free.drain(keep..).map(Some).collect();
                let fresh = n - from_free;
                st.allocated += fresh * slab;
                st.in_use += n * slab;
                st.peak_in_use = st.peak_in_use.max(st.in_use);
                drop(st);
                bufs.extend((0..fresh).map(|_| Some(self.new_slab())));
                return Ok(bufs
                    .into_iter()
                    .map(|buf| Slab {
                        buf,
                        pool: self.clone(),
                    })
                    .collect());
            }
            if !waited {
                waited = true;
                parking_lot::MutexGuard::unlocked(&mut st, &mut on_wait);
                continue;
            }
            if st.returned != seen {
                seen = st.returned;
                since = Instant::now();
            }
            let left = stall.saturating_sub(since.elapsed());
            if left.is_zero() {
                return Err(Error::new(
                    ckpt_store::ErrorKind::Backend,
                    format!(
                        "waited {stall:?} for {n} staging slab(s) of {slab} bytes and none came back: the staging pool (bound {} bytes) has {} bytes in use by chunks that are not written to the store yet, and their persist made no progress",
                        st.capacity, st.in_use
                    ),
                ));
            }
            self.freed.wait_for(&mut st, left);
        }
    }

    /// Current figures.
    pub fn stats(&self) -> PoolStats {
        let st = self.state.lock();
        PoolStats {
            allocated: st.allocated,
            in_use: st.in_use,
            peak_in_use: st.peak_in_use,
            capacity: st.capacity,
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
        st.returned += 1;
        st.free.push(b);
        drop(st);
        // Waiters want different numbers of slabs: wake all, each checks.
        self.freed.notify_all();
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        // Every slab is back in the free list: slabs out of the pool hold it alive.
        if let Some(h) = &self.hook.0 {
            for b in &mut self.state.get_mut().free {
                let full = b.full_mut();
                h.on_free(full.as_mut_ptr(), full.len());
            }
        }
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

    #[test]
    fn acquire_many_takes_all_or_none_and_fails_when_nothing_comes_back() {
        let pool = StagingPool::new(
            PoolConfig {
                capacity: 2 * 4096,
                slab: 4096,
            },
            false,
        );
        let long = Duration::from_secs(30);
        let one = pool.acquire_many(1, long, || panic!("no wait")).unwrap();
        // Two wanted, one free: the waiter holds nothing meanwhile, and says it waits.
        let p2 = pool.clone();
        let waited = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let w2 = waited.clone();
        let waiter = std::thread::spawn(move || {
            p2.acquire_many(2, long, || {
                w2.store(true, std::sync::atomic::Ordering::SeqCst)
            })
            .unwrap()
            .len()
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished());
        assert!(waited.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(pool.stats().in_use, 4096, "a waiter holds no slab");
        drop(one);
        assert_eq!(waiter.join().unwrap(), 2);
        // More than the bound is clamped to the bound.
        assert_eq!(pool.acquire_many(5, long, || {}).unwrap().len(), 2);
        // Nothing ever comes back: a clear error after the stall timeout.
        let held = pool.acquire_many(2, long, || {}).unwrap();
        let t = std::time::Instant::now();
        let e = pool
            .acquire_many(1, Duration::from_millis(200), || {})
            .unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(
            e.to_string().contains("staging") && e.to_string().contains("no progress"),
            "{e}"
        );
        drop(held);
    }

    #[test]
    fn a_hook_sees_every_slab_allocated_and_freed() {
        use std::collections::HashSet;
        #[derive(Default)]
        struct Record(Mutex<HashSet<usize>>);
        impl SlabHook for Record {
            fn on_alloc(&self, ptr: *mut u8, len: usize) {
                assert_eq!(len, 4096);
                assert!(self.0.lock().insert(ptr as usize), "allocated twice");
            }
            fn on_free(&self, ptr: *mut u8, _len: usize) {
                assert!(self.0.lock().remove(&(ptr as usize)), "freed unseen");
            }
        }
        let rec = Arc::new(Record::default());
        set_slab_hook(Some(rec.clone()));
        let pool = StagingPool::new(
            PoolConfig {
                capacity: 3 * 4096,
                slab: 4096,
            },
            false,
        );
        // Pools made from now on go without; this one keeps its hook.
        set_slab_hook(None);
        let mut a = pool.acquire();
        let mut b = pool.acquire();
        let ptrs = [
            a.bytes_mut().as_ptr() as usize,
            b.bytes_mut().as_ptr() as usize,
        ];
        drop((a, b));
        let again = pool.acquire();
        drop(again);
        assert!(ptrs.iter().all(|p| rec.0.lock().contains(p)));
        drop(pool);
        assert!(ptrs.iter().all(|p| !rec.0.lock().contains(p)));
    }
}
