//! The run's events log as the manager writes it: the kinds of the records it adds when the
//! store fails or its policies change something, and [`EventLog`], the writer those records
//! go through (opened on the first record, written out at once unless the store is down).

use ckpt_recovery::records::Event;
use ckpt_store::Store;
use ckpt_store::logs::{EVENTS, LogWriter};
use tracing::warn;

use crate::save::runtime;

/// The persist governor changed the persist rate: `{"kind", "step", "rank", "from_bps",
/// "to_bps", "reason", "slowdown", "budget", "baseline_s", "at_floor"}`.
pub const PERSIST_RATE: &str = "persist_rate";
/// The automatic checkpoint interval changed: `{"kind", "step", "from_steps",
/// "to_steps", "reason", "cost_s", "mtbf_s", ...}`.
pub const CHECKPOINT_INTERVAL: &str = "checkpoint_interval";
/// A save failed in the store (its error kind was a backend or I/O failure, after the
/// store's retries): `{"kind", "step", "error"}`.
pub const CHECKPOINT_FAILED: &str = "checkpoint_failed";
/// A due checkpoint was not taken because the store is down: `{"kind", "step", "reason"}`.
pub const CHECKPOINT_SKIPPED: &str = "checkpoint_skipped";
/// The store answers again; the next due checkpoint is taken: `{"kind", "step",
/// "skipped", "down_since_step"}`.
pub const CHECKPOINTS_RESUMED: &str = "checkpoints_resumed";

/// One rank's writer of the run's events log (`monitor-rank-<rank>`). Failures are warnings:
/// a log must not stop training. While the store is down ([`EventLog::hold`]) records wait in
/// the writer, so the loop never waits for the store's retries; the first record written
/// after it came back writes them all.
pub(crate) struct EventLog {
    store: Store,
    run: String,
    rank: u32,
    writer: Option<LogWriter>,
    held: bool,
}

impl EventLog {
    /// The log of `run` for `rank`; nothing is opened before the first record.
    pub(crate) fn new(store: Store, run: &str, rank: u32) -> Self {
        EventLog {
            store,
            run: run.to_string(),
            rank,
            writer: None,
            held: false,
        }
    }

    /// Keep records in the writer (the store is down) or write them again.
    pub(crate) fn hold(&mut self, held: bool) {
        self.held = held;
    }

    /// Append a record and write it out at once, unless held (events are rare and should be
    /// readable while the run goes on).
    pub(crate) fn log(&mut self, rec: Event) {
        if self.append(rec) {
            self.flush_unless_held();
        }
    }

    /// Append a record without writing it out yet; whether it was appended.
    pub(crate) fn append(&mut self, rec: Event) -> bool {
        if self.writer.is_none() {
            let name = format!("monitor-rank-{}", self.rank);
            match LogWriter::new(&self.store, &self.run, EVENTS, &name) {
                Ok(w) => self.writer = Some(w),
                Err(e) => {
                    warn!("opening the events log: {e}");
                    return false;
                }
            }
        }
        let Some(w) = self.writer.as_mut() else {
            return false;
        };
        if let Err(e) = w.append(&rec) {
            warn!("events log record: {e}");
            return false;
        }
        true
    }

    /// Write out what waits in the writer, unless held.
    pub(crate) fn flush_unless_held(&mut self) {
        if !self.held {
            self.flush();
        }
    }

    /// Write out what waits in the writer, held or not (the end of a run).
    pub(crate) fn flush(&mut self) {
        if let Some(w) = self.writer.as_mut()
            && w.pending() > 0
            && let Err(e) = runtime().block_on(w.flush())
        {
            warn!("writing the events log: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_recovery::records::{self, CheckpointSkipped};

    fn read(store: &Store) -> Vec<Event> {
        runtime()
            .block_on(records::read_records::<Event>(store, "r"))
            .unwrap()
            .into_iter()
            .map(|l| l.record)
            .collect()
    }

    fn skipped(step: u64) -> Event {
        Event::CheckpointSkipped(CheckpointSkipped {
            step,
            ..Default::default()
        })
    }

    #[test]
    fn records_are_written_at_once_unless_held() {
        let store = Store::memory();
        let mut log = EventLog::new(store.clone(), "r", 3);
        log.log(skipped(1));
        assert_eq!(read(&store), vec![skipped(1)]);
        log.hold(true);
        log.log(skipped(2));
        log.flush_unless_held();
        assert_eq!(read(&store).len(), 1, "held while the store is down");
        log.hold(false);
        log.log(skipped(3));
        assert_eq!(read(&store), vec![skipped(1), skipped(2), skipped(3)]);
    }

    #[test]
    fn appended_records_wait_for_a_flush() {
        let store = Store::memory();
        let mut log = EventLog::new(store.clone(), "r", 0);
        assert!(log.append(skipped(5)));
        assert!(read(&store).is_empty());
        log.hold(true);
        log.flush();
        assert_eq!(read(&store), vec![skipped(5)]);
    }
}
