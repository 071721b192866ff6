//! Checkpointing against a store that fails: [`Health`] watches the saves in flight, takes the
//! store as down when one fails in it (or the store gave up on a request meanwhile), skips due
//! checkpoints while a background probe finds it down, and counts it all ([`StoreHealth`]).

use ckpt_recovery::records::{self, Event};
use ckpt_store::{ErrorKind, Store};
use tracing::{info, warn};

use super::events::EventLog;
use crate::save::{SaveHandle, Stage, runtime};

/// How checkpointing fared against a failing store ([`super::CheckpointManager::store_health`]);
/// the figures of the `store_health` record.
pub type StoreHealth = records::StoreHealthCounts;

/// Errors of a store that may come back: worth skipping a checkpoint for, not stopping.
pub(crate) fn store_failure(kind: ErrorKind) -> bool {
    matches!(kind, ErrorKind::Backend | ErrorKind::Io)
}

/// A full file system under the store: the checkpoint fails (reported, with where), training
/// goes on, the store is not taken as down (it answers), and the next due checkpoint tries
/// again; under a local tier the manager first makes room there.
pub(crate) fn no_space(kind: ErrorKind) -> bool {
    kind == ErrorKind::NoSpace
}

/// The store is down: since which step, and the probe that checks whether it is back.
struct Down {
    since_step: u64,
    probe: Option<tokio::task::JoinHandle<bool>>,
}

/// The manager's view of the store's health (see the module docs).
#[derive(Default)]
pub(crate) struct Health {
    /// Set while the store is down.
    down: Option<Down>,
    /// Saves not yet committed or failed (a failure in the store is reported).
    watch: Vec<SaveHandle>,
    /// The store's give-ups when the last save was due.
    give_ups_seen: u64,
    counts: StoreHealth,
    /// A save failed on a full file system since the last [`Health::take_full`].
    full: bool,
}

impl Health {
    /// The counts, and whether the store is down now.
    pub(crate) fn snapshot(&self) -> StoreHealth {
        StoreHealth {
            down: self.down.is_some(),
            ..self.counts
        }
    }

    /// Watch a save of `maybe_save` until it commits or fails.
    pub(crate) fn watch(&mut self, h: SaveHandle) {
        self.watch.push(h);
    }

    /// A checkpoint is due at `step`: why it is skipped because the store is down, or `None`
    /// to take it. A store that fails (after its retries) does not stop training: the failed
    /// save is reported, due checkpoints are skipped while a probe finds the store down, and
    /// the first due checkpoint after the store answers again is taken.
    pub(crate) fn skip_reason(
        &mut self,
        step: u64,
        store: &Store,
        run: &str,
        events: &mut EventLog,
    ) -> Option<String> {
        self.report_failed(step, events);
        // The save in flight is still retrying and the store already gave up on a request
        // since it started: do not wait for it to fail.
        let gave_up = store.metrics().map_or(0, |m| m.snapshot().give_ups);
        if self.watch.iter().any(|h| !h.stage().persist_ended()) && gave_up > self.give_ups_seen {
            self.mark_down(step, events);
        }
        self.give_ups_seen = gave_up;
        self.down_reason(step, store, run, events)
    }

    /// Report the saves that failed in the store since the last look (a warning and a
    /// `checkpoint_failed` event each) and take the store as down.
    pub(crate) fn report_failed(&mut self, now: u64, events: &mut EventLog) {
        let mut failed = Vec::new();
        let mut full = Vec::new();
        self.watch.retain(|h| match h.stage() {
            Stage::Failed(f) => {
                if store_failure(f.kind) {
                    failed.push((h.step(), f.message));
                } else if no_space(f.kind) {
                    full.push((h.step(), f.message));
                }
                false
            }
            Stage::Committed | Stage::Skipped(_) => false,
            _ => true,
        });
        for (step, message) in full {
            self.failed_full(step, &message, events);
        }
        for (step, message) in failed {
            self.counts.failed += 1;
            warn!(
                step,
                "checkpoint failed in the store; training goes on: {message}"
            );
            self.mark_down(now, events);
            events.log(Event::CheckpointFailed(records::CheckpointFailed {
                step,
                error: message,
                ..Default::default()
            }));
        }
    }

    /// Whether a save failed on a full file system since the last call.
    pub(crate) fn take_full(&mut self) -> bool {
        std::mem::take(&mut self.full)
    }

    /// A save failed on a full file system (at once, or later as [`Health::report_failed`] finds):
    /// a warning and a `checkpoint_failed` event; the store is not taken as down.
    pub(crate) fn failed_full(&mut self, step: u64, message: &str, events: &mut EventLog) {
        self.counts.failed += 1;
        self.full = true;
        warn!(
            step,
            "checkpoint failed, the store's file system is full; training goes on and the next checkpoint tries again: {message}"
        );
        events.log(Event::CheckpointFailed(records::CheckpointFailed {
            step,
            error: message.to_string(),
            ..Default::default()
        }));
    }

    /// Take the store as down from `step` on (records wait in the events log meanwhile).
    pub(crate) fn mark_down(&mut self, step: u64, events: &mut EventLog) {
        if self.down.is_none() {
            self.down = Some(Down {
                since_step: step,
                probe: None,
            });
            events.hold(true);
        }
    }

    /// While the store is down: why this checkpoint is skipped, or `None` once a probe (one
    /// request in the background, so the loop never waits for the store's retries) found the
    /// store answering again.
    fn down_reason(
        &mut self,
        step: u64,
        store: &Store,
        run: &str,
        events: &mut EventLog,
    ) -> Option<String> {
        let down = self.down.as_mut()?;
        let why = format!(
            "the store is down since step {} (checking whether it is back)",
            down.since_step
        );
        match down.probe.as_ref().map(|p| p.is_finished()) {
            Some(false) => return Some(why),
            Some(true) => {
                let back = down
                    .probe
                    .take()
                    .is_some_and(|p| runtime().block_on(p).unwrap_or(false));
                if back {
                    let since = down.since_step;
                    self.down = None;
                    events.hold(false);
                    self.counts.resumed += 1;
                    info!(step, since, "the store answers again: checkpoints resume");
                    events.log(Event::CheckpointsResumed(records::CheckpointsResumed {
                        step,
                        skipped: self.counts.skipped,
                        down_since_step: since,
                    }));
                    return None;
                }
            }
            None => {}
        }
        let store = store.clone();
        let key = store.keys().commit(run, 0);
        down.probe =
            Some(runtime().spawn(async move { store.objects().exists(&key).await.is_ok() }));
        Some(why)
    }

    /// A due checkpoint at `step` was not taken: a warning and a `checkpoint_skipped` event.
    pub(crate) fn skip(&mut self, step: u64, why: &str, events: &mut EventLog) {
        self.counts.skipped += 1;
        warn!(step, "checkpoint skipped: {why}");
        events.log(Event::CheckpointSkipped(records::CheckpointSkipped {
            step,
            reason: why.to_string(),
            ..Default::default()
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn only_backend_and_io_failures_skip_checkpoints() {
        assert!(no_space(ErrorKind::NoSpace) && !store_failure(ErrorKind::NoSpace));
        assert!(store_failure(ErrorKind::Backend));
        assert!(store_failure(ErrorKind::Io));
        for k in [
            ErrorKind::Fenced,
            ErrorKind::Corrupt,
            ErrorKind::NotFound,
            ErrorKind::InvalidInput,
        ] {
            assert!(!store_failure(k), "{k:?}");
        }
    }

    #[test]
    fn down_skips_until_a_probe_answers_then_resumes() {
        let store = Store::memory();
        let mut events = EventLog::new(store.clone(), "r", 0);
        let mut h = Health::default();
        assert_eq!(h.skip_reason(1, &store, "r", &mut events), None);
        h.mark_down(2, &mut events);
        assert!(h.snapshot().down);
        let why = h.skip_reason(3, &store, "r", &mut events).expect("down");
        assert!(why.contains("since step 2"), "{why}");
        h.skip(3, &why, &mut events);
        // The probe runs in the background: the memory store answers.
        let t0 = Instant::now();
        let mut step = 4;
        while h.skip_reason(step, &store, "r", &mut events).is_some() {
            assert!(t0.elapsed() < Duration::from_secs(10), "no probe answered");
            std::thread::sleep(Duration::from_millis(5));
            step += 1;
        }
        let s = h.snapshot();
        assert_eq!((s.skipped, s.resumed, s.down), (1, 1, false));
        // The record is flat, as it always was: the rank beside the counts.
        let r = serde_json::to_value(records::StoreHealth { rank: 4, counts: s }).unwrap();
        assert_eq!(
            r,
            serde_json::json!({"rank": 4, "failed": s.failed, "skipped": 1, "resumed": 1, "down": false})
        );
        let logged: Vec<_> = runtime()
            .block_on(records::read_records::<Event>(&store, "r"))
            .unwrap()
            .into_iter()
            .map(|l| l.record)
            .collect();
        assert!(
            matches!(
                logged.as_slice(),
                [Event::CheckpointSkipped(_), Event::CheckpointsResumed(r)] if r.down_since_step == 2
            ),
            "{logged:?}"
        );
    }
}
