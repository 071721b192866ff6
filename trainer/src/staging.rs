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
//! Without a synchronous prefault, [`StagingPool::prefault_in_background`] allocates and
//! touches the slabs up to the bound from start-up on a thread of the lowest CPU priority
//! (nice 19), one slab at a time, so the first save finds them faulted in while the training
//! steps before it keep their cores. It never holds the pool's lock while touching memory: it
//! reserves a slab in `allocated` under the lock, touches it outside, then puts it in the free
//! list. A snapshot that starts before the fill is done takes the slabs already made and
//! allocates the rest itself, never waiting for the thread: if it needs the slab the thread
//! is touching, it takes over that slab's place in `allocated` and the thread frees its slab
//! (for that moment the process holds one slab more than the bound). The thread holds the
//! pool weakly and stops when the pool is dropped.
//!
//! A [`SlabHook`] installed with [`set_slab_hook`] sees every slab that pools created after it
//! allocate and free: the CUDA path (feature `cuda`) uses it to page-lock slabs once, so
//! device-to-host copies land in them by DMA. Without a hook nothing changes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
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
    /// A background fill thread runs ([`StagingPool::prefault_in_background`]).
    bg_running: bool,
    /// Slabs counted in `allocated` that the background thread is touching (0 or 1).
    bg_pending: usize,
    /// Of those, taken over by a caller that allocated its own: the thread frees its slab.
    bg_taken: usize,
    /// The free slabs were released ([`StagingPool::release_free`]): the background fill
    /// stops until it is started again.
    released: bool,
}

/// A bounded pool of page-aligned slabs.
#[derive(Debug)]
pub struct StagingPool {
    cfg: PoolConfig,
    state: Mutex<PoolState>,
    freed: Condvar,
    hook: HookSlot,
    /// Set when a caller took over the slab the background thread is touching: stop touching.
    hurry: Arc<AtomicBool>,
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
    touch_until(buf, &AtomicBool::new(false));
}

/// Fault every page in now (alloc_zeroed may hand out untouched zero pages), stopping early
/// when `stop` is set (checked every 16 pages).
fn touch_until(buf: &mut AlignedBuf, stop: &AtomicBool) {
    let b = buf.full_mut();
    let mut i = 0;
    let mut pages = 0u32;
    while i < b.len() {
        // SAFETY: i < len; a volatile write so the compiler keeps it.
        unsafe { std::ptr::write_volatile(b.as_mut_ptr().add(i), 0) };
        i += 4096;
        pages += 1;
        if pages.is_multiple_of(16) && stop.load(Ordering::Relaxed) {
            return;
        }
    }
}

/// The nice value of the background fill thread: the lowest priority, so it takes only cores
/// the training loop leaves idle.
const BACKGROUND_NICE: i32 = 19;

/// The background fill (see the module docs): one slab at a time up to the bound, holding
/// the pool only weakly while touching.
fn background_fill(pool: Weak<StagingPool>, slab: usize, hurry: Arc<AtomicBool>) {
    // SAFETY: plain libc calls on the calling thread (Linux: a thread id is a process id
    // for setpriority, so this lowers this thread only).
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, BACKGROUND_NICE);
    }
    loop {
        let Some(p) = pool.upgrade() else { return };
        let hook = p.hook.0.clone();
        {
            let mut st = p.state.lock();
            if st.released || st.allocated + slab > st.capacity {
                st.bg_running = false;
                return;
            }
            st.allocated += slab;
            st.bg_pending += 1;
        }
        drop(p);
        // A slab is mapped for huge pages (`AlignedBuf`): one fault fills 2 MiB where the
        // kernel has them, so the fill needs far less of the little CPU time it gets.
        let mut b = AlignedBuf::zeroed(slab + LEAD);
        touch_until(&mut b, &hurry);
        let full = b.full_mut();
        if let Some(h) = &hook {
            h.on_alloc(full.as_mut_ptr(), full.len());
        }
        let Some(p) = pool.upgrade() else {
            // The pool is gone: free the slab through the hook that saw it allocated.
            if let Some(h) = &hook {
                h.on_free(full.as_mut_ptr(), full.len());
            }
            return;
        };
        let mut st = p.state.lock();
        hurry.store(false, Ordering::Relaxed);
        if st.bg_taken > 0 {
            // A caller allocated this slab's place itself meanwhile.
            st.bg_taken -= 1;
            st.bg_pending -= 1;
            drop(st);
            if let Some(h) = &hook {
                let full = b.full_mut();
                h.on_free(full.as_mut_ptr(), full.len());
            }
            continue;
        }
        if st.released {
            // Released while touching it: it goes too, and the fill ends.
            st.bg_pending -= 1;
            st.allocated -= slab;
            st.bg_running = false;
            drop(st);
            if let Some(h) = &hook {
                let full = b.full_mut();
                h.on_free(full.as_mut_ptr(), full.len());
            }
            return;
        }
        st.bg_pending -= 1;
        st.free.push(b);
        st.returned += 1;
        drop(st);
        p.freed.notify_all();
    }
}

impl StagingPool {
    /// A pool; with `prefault`, every slab is allocated and touched now.
    pub fn new(cfg: PoolConfig, prefault: bool) -> Arc<Self> {
        Self::with_hook(cfg, prefault, SLAB_HOOK.read().clone())
    }

    fn with_hook(cfg: PoolConfig, prefault: bool, hook: Option<Arc<dyn SlabHook>>) -> Arc<Self> {
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
            hook: HookSlot(hook),
            hurry: Arc::default(),
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

    /// Allocate and touch slabs up to the bound on a background thread of the lowest CPU
    /// priority (see the module docs); the bound may still rise while it runs. Returns the
    /// thread, or `None` when one already runs or the pool is full. The thread ends when the
    /// pool reaches its bound or is dropped.
    pub fn prefault_in_background(self: &Arc<Self>) -> Option<JoinHandle<()>> {
        {
            let mut st = self.state.lock();
            if st.bg_running || st.allocated + self.cfg.slab > st.capacity {
                return None;
            }
            st.bg_running = true;
            st.released = false;
        }
        let (pool, slab, hurry) = (Arc::downgrade(self), self.cfg.slab, self.hurry.clone());
        match std::thread::Builder::new()
            .name("ckpt-prefault".into())
            .spawn(move || background_fill(pool, slab, hurry))
        {
            Ok(h) => Some(h),
            Err(e) => {
                // Not fatal: the first save allocates its slabs itself.
                tracing::warn!(error = %e, "could not start the staging prefault thread");
                self.state.lock().bg_running = false;
                None
            }
        }
    }

    /// Slabs a caller may allocate now: room under the bound, plus the places of the slabs
    /// the background thread is touching (see [`Self::reserve_fresh`]).
    fn can_alloc(&self, st: &PoolState) -> usize {
        st.capacity.saturating_sub(st.allocated) / self.cfg.slab + (st.bg_pending - st.bg_taken)
    }

    /// Count `n` slabs the caller allocates itself in `allocated`: room under the bound first,
    /// then the places of slabs the background thread is touching (it frees those).
    fn reserve_fresh(&self, st: &mut PoolState, n: usize) {
        let room = (st.capacity.saturating_sub(st.allocated) / self.cfg.slab).min(n);
        st.allocated += room * self.cfg.slab;
        let take = n - room;
        if take > 0 {
            debug_assert!(take <= st.bg_pending - st.bg_taken);
            st.bg_taken += take;
            self.hurry.store(true, Ordering::Relaxed);
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
        let mut b = AlignedBuf::zeroed(self.cfg.slab + LEAD);
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
            if self.can_alloc(&st) >= 1 {
                self.reserve_fresh(&mut st, 1);
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
            let can_alloc = self.can_alloc(&st);
            if st.free.len() + can_alloc >= n {
                let from_free = n.min(st.free.len());
                let keep = st.free.len() - from_free;
                let mut bufs: Vec<Option<AlignedBuf>> = st.free.drain(keep..).map(Some).collect();
                let fresh = n - from_free;
                self.reserve_fresh(&mut st, fresh);
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
                tracing::debug!(
                    n,
                    free = st.free.len(),
                    can_alloc,
                    in_use = st.in_use,
                    capacity = st.capacity,
                    "waiting for staging slabs"
                );
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

    /// Free every slab that is not in use and stop the background fill: the memory of a
    /// pool whose owner is done saving (a job's last checkpoint committed). Slabs in use come
    /// back to the free list as usual. The bound stays; a later save allocates again (the stall
    /// of a first save), and [`StagingPool::prefault_in_background`] fills it again. Returns
    /// the bytes freed.
    pub fn release_free(&self) -> usize {
        let mut st = self.state.lock();
        let free = std::mem::take(&mut st.free);
        st.allocated -= free.len() * self.cfg.slab;
        st.released = true;
        if st.bg_pending > st.bg_taken {
            // The slab the background fill is touching goes: stop touching it.
            self.hurry.store(true, Ordering::Relaxed);
        }
        drop(st);
        let bytes = free.len() * self.cfg.slab;
        for mut b in free {
            if let Some(h) = &self.hook.0 {
                let full = b.full_mut();
                h.on_free(full.as_mut_ptr(), full.len());
            }
        }
        bytes
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

/// Where a slab's bytes start in its buffer: a chunk's header is this long
/// ([`ckpt_store::codec::HEADER_LEN`]), so a chunk at the start of a slab, written to a local
/// store with `O_DIRECT` after its header, is at an aligned address from the first block
/// boundary of the file on, and goes to the disk without a copy (`ckpt_store::DirectFs`).
pub const LEAD: usize = ckpt_store::codec::HEADER_LEN;

/// One slab, returned to its pool when dropped (or when the last `Bytes` made from it is).
#[derive(Debug)]
pub struct Slab {
    buf: Option<AlignedBuf>,
    pool: Arc<StagingPool>,
}

impl Slab {
    /// The whole slab (its size, from [`LEAD`] bytes into its buffer), writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let slab = self.pool.cfg.slab;
        &mut self.buf.as_mut().expect("slab present").full_mut()[LEAD..LEAD + slab]
    }

    /// The first `len` bytes as shared `Bytes`; the slab returns to the pool when the last
    /// clone is dropped.
    pub fn freeze(mut self, len: usize) -> Bytes {
        let mut b = self.buf.take().expect("slab present");
        b.set_len(LEAD + len);
        Bytes::from_owner(Frozen {
            buf: Some(b),
            pool: self.pool.clone(),
        })
        .slice(LEAD..)
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
    fn a_slab_starts_a_chunk_header_past_an_aligned_address() {
        let pool = StagingPool::new(
            PoolConfig {
                capacity: 2 << 20,
                slab: 1 << 20,
            },
            false,
        );
        let mut s = pool.acquire();
        let b = s.bytes_mut();
        assert_eq!(b.len(), 1 << 20);
        assert_eq!(b.as_ptr() as usize % 4096, LEAD);
        b[..3].copy_from_slice(b"abc");
        b[(1 << 20) - 1] = 9;
        let frozen = s.freeze(1 << 20);
        assert_eq!(&frozen[..3], b"abc");
        assert_eq!(frozen[(1 << 20) - 1], 9);
        assert_eq!(frozen.as_ptr() as usize % 4096, LEAD);
        drop(frozen);
        assert_eq!(pool.stats().in_use, 0);
    }

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
        let t0 = std::time::Instant::now();
        while !waited.load(std::sync::atomic::Ordering::SeqCst) {
            assert!(t0.elapsed() < long, "the waiter never said it waits");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!waiter.is_finished());
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
                // The slab and its lead, a page more.
                assert_eq!(len, 2 * 4096);
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
        // The hook sees each buffer from its start, LEAD bytes before the slab's.
        let ptrs = [
            a.bytes_mut().as_ptr() as usize - LEAD,
            b.bytes_mut().as_ptr() as usize - LEAD,
        ];
        drop((a, b));
        let again = pool.acquire();
        drop(again);
        assert!(ptrs.iter().all(|p| rec.0.lock().contains(p)));
        drop(pool);
        assert!(ptrs.iter().all(|p| !rec.0.lock().contains(p)));
    }

    /// Records the slabs a pool's hook sees; sleeps `slow` in `on_alloc` on the background
    /// fill thread only (a slow first touch, as on these machines).
    #[derive(Default)]
    struct Slow {
        live: Mutex<std::collections::HashSet<usize>>,
        bg_allocs: std::sync::atomic::AtomicUsize,
        slow: Duration,
    }
    impl SlabHook for Slow {
        fn on_alloc(&self, ptr: *mut u8, _len: usize) {
            assert!(self.live.lock().insert(ptr as usize), "allocated twice");
            if std::thread::current().name() == Some("ckpt-prefault") {
                self.bg_allocs.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(self.slow);
            }
        }
        fn on_free(&self, ptr: *mut u8, _len: usize) {
            assert!(self.live.lock().remove(&(ptr as usize)), "freed unseen");
        }
    }

    fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < limit, "waited {limit:?} for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A pool of `slabs` slabs of 64 KiB whose hook is a [`Slow`] of `slow`.
    fn slow_pool(slabs: usize, slow_ms: u64) -> (Arc<StagingPool>, Arc<Slow>) {
        let hook = Arc::new(Slow {
            slow: Duration::from_millis(slow_ms),
            ..Slow::default()
        });
        let pool = StagingPool::with_hook(
            PoolConfig {
                capacity: slabs * (64 << 10),
                slab: 64 << 10,
            },
            false,
            Some(hook.clone()),
        );
        (pool, hook)
    }

    #[test]
    fn the_background_fill_reaches_the_bound_and_never_blocks_a_snapshot() {
        const SLAB: usize = 64 << 10;
        const N: usize = 8;
        let (pool, hook) = slow_pool(N, 1000);
        let bg = pool.prefault_in_background().expect("a fill thread");
        assert!(pool.prefault_in_background().is_none(), "one thread a pool");
        wait_until("two slabs filled", Duration::from_secs(30), || {
            pool.stats().allocated >= 2 * SLAB && !pool.state.lock().free.is_empty()
        });
        // The fill takes N x 1 s; a slab is taken from what it made at once...
        let t = Instant::now();
        let one = pool.acquire();
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
        let st = pool.stats();
        assert_eq!((st.in_use, st.peak_in_use), (SLAB, SLAB), "{st:?}");
        assert!(st.allocated <= st.capacity, "{st:?}");
        // ...and a snapshot wanting the whole rest allocates what is not made yet itself,
        // the place of the slab the thread is touching included: it never waits for the
        // thread (which takes 1 s a slab).
        let made = hook.bg_allocs.load(Ordering::SeqCst);
        let t = Instant::now();
        let rest = pool
            .acquire_many(N - 1, Duration::from_secs(60), || {})
            .unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
        assert!(
            made < N - 2,
            "the fill finished before the snapshot: the test proves nothing"
        );
        let st = pool.stats();
        assert_eq!(rest.len(), N - 1);
        assert_eq!(
            st,
            PoolStats {
                allocated: N * SLAB,
                in_use: N * SLAB,
                peak_in_use: N * SLAB,
                capacity: N * SLAB
            }
        );
        // The pool is full: the thread ends by itself.
        wait_until("the fill thread to end", Duration::from_secs(10), || {
            bg.is_finished()
        });
        drop((one, rest));
        let st = pool.stats();
        assert_eq!((st.allocated, st.in_use), (N * SLAB, 0), "{st:?}");
        assert_eq!(pool.state.lock().free.len(), N);
        assert_eq!(hook.live.lock().len(), N, "the slab taken over is freed");
        // A raised bound is filled by a new thread, and the books stay right.
        pool.ensure_capacity((N + 2) * SLAB);
        let bg = pool.prefault_in_background().expect("a fill thread");
        bg.join().unwrap();
        let st = pool.stats();
        assert_eq!((st.allocated, st.in_use), ((N + 2) * SLAB, 0), "{st:?}");
        assert_eq!(pool.state.lock().free.len(), N + 2);
        assert!(
            pool.prefault_in_background().is_none(),
            "nothing left to fill"
        );
        drop(pool);
        assert!(hook.live.lock().is_empty(), "every slab freed");
    }

    #[test]
    fn releasing_frees_the_free_slabs_stops_the_fill_and_a_later_save_allocates_again() {
        const SLAB: usize = 64 << 10;
        const N: usize = 200;
        let (pool, hook) = slow_pool(N, 20);
        let bg = pool.prefault_in_background().expect("a fill thread");
        wait_until("four slabs filled", Duration::from_secs(30), || {
            pool.state.lock().free.len() >= 4
        });
        let held = pool.acquire();
        let freed = pool.release_free();
        assert!(freed >= 3 * SLAB, "{freed}");
        // The fill stops (the slab it was touching goes too) long before the bound.
        wait_until("the fill thread to stop", Duration::from_secs(10), || {
            bg.is_finished()
        });
        bg.join().unwrap();
        let st = pool.stats();
        assert_eq!(
            (st.allocated, st.in_use),
            (SLAB, SLAB),
            "only the held slab: {st:?}"
        );
        assert_eq!(hook.live.lock().len(), 1, "every other slab freed");
        // The held slab comes back as usual; a later save allocates what it needs.
        drop(held);
        let again = pool
            .acquire_many(3, Duration::from_secs(10), || {})
            .unwrap();
        assert_eq!(pool.stats().allocated, 3 * SLAB);
        drop(again);
        // A fill started again runs to the bound.
        let bg = pool.prefault_in_background().expect("a fill thread");
        wait_until("more slabs filled", Duration::from_secs(30), || {
            pool.stats().allocated >= 5 * SLAB
        });
        drop(pool);
        bg.join().unwrap();
        assert!(hook.live.lock().is_empty(), "every slab freed");
    }

    #[test]
    fn dropping_the_pool_stops_the_background_fill() {
        let (pool, hook) = slow_pool(1000, 100);
        let bg = pool.prefault_in_background().expect("a fill thread");
        wait_until("a slab filled", Duration::from_secs(30), || {
            hook.bg_allocs.load(Ordering::SeqCst) >= 2
        });
        drop(pool);
        wait_until("the fill thread to stop", Duration::from_secs(5), || {
            bg.is_finished()
        });
        bg.join().unwrap();
        let made = hook.bg_allocs.load(Ordering::SeqCst);
        assert!(
            made < 100,
            "{made} slabs: the thread did not stop with the pool"
        );
        // The slab it was touching when the pool went is freed too.
        assert!(
            hook.live.lock().is_empty(),
            "{} slabs leaked",
            hook.live.lock().len()
        );
    }
}
