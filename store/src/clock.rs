//! Wall-clock time, injectable: library code asks the [`Store`](crate::Store)'s clock (or takes
//! the time as a value), never `Utc::now()` or `SystemTime::now()` directly (clippy.toml
//! forbids both outside this module), so that a test can move time: lapse a lock, age a
//! temporary file, without sleeping. Binaries and the CLI take the time at their edge with
//! [`system_now`]. Monotonic `Instant`s, used only to measure durations, stay as they are.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A source of wall-clock time.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Now.
    fn now(&self) -> DateTime<Utc>;
}

/// The system's clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)]
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that moves only when told to (tests); clones share the time.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// A clock standing at `t` (millisecond resolution).
    pub fn at(t: DateTime<Utc>) -> Self {
        ManualClock(Arc::new(AtomicI64::new(t.timestamp_millis())))
    }

    /// A clock standing at the system's now.
    pub fn starting_now() -> Self {
        Self::at(system_now())
    }

    /// The clock's time.
    pub fn now(&self) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(self.0.load(Ordering::SeqCst)).expect("clock in range")
    }

    /// Move the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.0.fetch_add(d.as_millis() as i64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        ManualClock::now(self)
    }
}

/// The system's now: for binaries and the CLI, which take the time at their edge.
pub fn system_now() -> DateTime<Utc> {
    SystemClock.now()
}

/// The system's now in Unix milliseconds (timestamps written into records).
pub fn now_ms() -> i64 {
    system_now().timestamp_millis()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let c = ManualClock::starting_now();
        let t0 = c.now();
        assert_eq!(c.now(), t0);
        let shared = c.clone();
        shared.advance(Duration::from_secs(7200));
        assert_eq!(c.now() - t0, chrono::Duration::hours(2));
    }
}
