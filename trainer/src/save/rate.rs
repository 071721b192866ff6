//! The rate a persist feeds the store at ([`PersistRate`]): set by the persist governor
//! ([`crate::governor`]), obeyed by every persist of one checkpointer, lifted while someone
//! waits for a persist ([`PersistRate::full_speed`]).
//!
//! The limit is on the raw bytes the snapshot hands to the store (`Pacer`, in the persist
//! task): everything the persist does on the training loop's cores (hashing, the codec, the
//! reads of staging, the writes) runs downstream of that stream, so pacing it paces all of
//! them. While the snapshot is still copying nothing is paced: the loop may be waiting for
//! staging that only the persist frees.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// The longest a paced persist sleeps before it looks at the rate again (a lifted limit takes
/// effect within this).
const RECHECK: Duration = Duration::from_millis(50);

/// The rate limit of a checkpointer's persists, in raw bytes per second, shared by the
/// governor that sets it and the persist tasks that obey it.
#[derive(Debug, Default)]
pub struct PersistRate {
    /// Bytes per second; 0: no limit.
    bps: AtomicU64,
    /// Holders of [`FullSpeed`]: while any, no limit applies.
    boost: AtomicUsize,
    /// Raw bytes let through by every persist so far.
    released: AtomicU64,
}

impl PersistRate {
    /// No limit.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Limit persists to `bps` raw bytes per second (at least 1), or lift the limit (`None`).
    /// A persist in flight takes the new rate at its next chunk.
    pub fn set(&self, bps: Option<u64>) {
        self.bps
            .store(bps.map_or(0, |b| b.max(1)), Ordering::SeqCst);
    }

    /// The rate set (`None`: no limit), whatever [`PersistRate::full_speed`] says.
    pub fn get(&self) -> Option<u64> {
        Some(self.bps.load(Ordering::SeqCst)).filter(|&b| b > 0)
    }

    /// The limit in force now: the rate set, unless someone holds [`FullSpeed`].
    pub fn limit(&self) -> Option<u64> {
        if self.boost.load(Ordering::SeqCst) > 0 {
            return None;
        }
        self.get()
    }

    /// Lift the limit until the guard drops (a caller waits for a persist: the final
    /// checkpoint, `finish`, a save waiting for the previous one, a rollback). The rate set
    /// stays and applies again afterwards.
    pub fn full_speed(self: &Arc<Self>) -> FullSpeed {
        self.boost.fetch_add(1, Ordering::SeqCst);
        FullSpeed(self.clone())
    }

    /// Raw bytes every persist of this rate let through so far.
    pub fn released(&self) -> u64 {
        self.released.load(Ordering::SeqCst)
    }
}

/// Persists run unlimited while this lives ([`PersistRate::full_speed`]).
#[derive(Debug)]
pub struct FullSpeed(Arc<PersistRate>);

impl Drop for FullSpeed {
    fn drop(&mut self) {
        self.0.boost.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Paces one persist's chunks by a [`PersistRate`]: a chunk may go once the one before it,
/// of `n` bytes, is `n / rate` seconds old, by the rate in force while it waits (a changed rate
/// applies at once); no credit builds up while idle.
pub(crate) struct Pacer {
    rate: Arc<PersistRate>,
    /// Whether pacing is off for now (the snapshot is still copying).
    hold_off: Box<dyn Fn() -> bool + Send + Sync>,
    /// When the last chunk went, and its length.
    last: Option<(tokio::time::Instant, usize)>,
}

impl Pacer {
    /// Pacing by `rate`, off while `hold_off` says so.
    pub(crate) fn new(
        rate: Arc<PersistRate>,
        hold_off: Box<dyn Fn() -> bool + Send + Sync>,
    ) -> Self {
        Pacer {
            rate,
            hold_off,
            last: None,
        }
    }

    /// Wait until `len` more bytes may go, by the limit in force (looked at again at least
    /// every [`RECHECK`]), then count them.
    pub(crate) async fn admit(&mut self, len: usize) {
        loop {
            let now = tokio::time::Instant::now();
            let limit = self.rate.limit().filter(|_| !(self.hold_off)());
            let at = match (limit, self.last) {
                (Some(bps), Some((t, n))) => t + Duration::from_secs_f64(n as f64 / bps as f64),
                _ => now,
            };
            if at <= now {
                break;
            }
            tokio::time::sleep_until(at.min(now + RECHECK)).await;
        }
        self.last = Some((tokio::time::Instant::now(), len));
        self.rate.released.fetch_add(len as u64, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    #[test]
    fn full_speed_lifts_the_limit_while_held() {
        let r = PersistRate::new();
        assert_eq!(r.limit(), None);
        r.set(Some(1000));
        assert_eq!((r.get(), r.limit()), (Some(1000), Some(1000)));
        let a = r.full_speed();
        let b = r.full_speed();
        assert_eq!((r.get(), r.limit()), (Some(1000), None));
        drop(a);
        assert_eq!(r.limit(), None);
        drop(b);
        assert_eq!(r.limit(), Some(1000));
        r.set(Some(0));
        assert_eq!(r.get(), Some(1), "a rate of 0 would never finish");
        r.set(None);
        assert_eq!(r.limit(), None);
    }

    #[test]
    fn pacing_spaces_chunks_by_the_rate() {
        rt().block_on(async {
            let r = PersistRate::new();
            r.set(Some(1 << 20));
            let mut p = Pacer::new(r.clone(), Box::new(|| false));
            let t0 = std::time::Instant::now();
            for _ in 0..5 {
                p.admit(64 << 10).await;
            }
            // The first chunk goes at once, each later one 62.5 ms after the one before.
            let took = t0.elapsed();
            assert!(took >= Duration::from_millis(245), "{took:?}");
            assert!(took < Duration::from_secs(5), "{took:?}");
            assert_eq!(r.released(), 5 * (64 << 10));
            // Lifted: no waiting.
            r.set(None);
            let t1 = std::time::Instant::now();
            for _ in 0..50 {
                p.admit(64 << 10).await;
            }
            assert!(
                t1.elapsed() < Duration::from_millis(200),
                "{:?}",
                t1.elapsed()
            );
        });
    }

    #[test]
    fn a_full_speed_holder_ends_a_wait_early() {
        rt().block_on(async {
            let r = PersistRate::new();
            r.set(Some(1));
            let mut p = Pacer::new(r.clone(), Box::new(|| false));
            p.admit(1 << 20).await; // the next chunk may go only in ~12 days
            let r2 = r.clone();
            let fast = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                // Held until the waiter is through (the guard leaks into the thread's end).
                let g = r2.full_speed();
                std::thread::sleep(Duration::from_millis(500));
                drop(g);
            });
            let t = std::time::Instant::now();
            p.admit(1).await;
            let waited = t.elapsed();
            assert!(waited < Duration::from_millis(450), "{waited:?}");
            fast.join().unwrap();
        });
    }

    #[test]
    fn nothing_is_paced_while_held_off() {
        rt().block_on(async {
            let r = PersistRate::new();
            r.set(Some(1));
            let mut p = Pacer::new(r.clone(), Box::new(|| true));
            let t = std::time::Instant::now();
            for _ in 0..3 {
                p.admit(1 << 20).await;
            }
            assert!(t.elapsed() < Duration::from_millis(100));
        });
    }
}
