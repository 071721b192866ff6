//! Loss spikes and rollback: [`Spikes`] owns the spike [`Monitor`], logs what it decides
//! (`spike`, `stop`, `rollback` events), picks the step a rollback restores
//! ([`rollback_target`]) and keeps the rollback history across the restore; [`settle`] waits
//! for the save in flight before one. [`super::CheckpointManager::rollback`] strings them
//! together around a restore.

use std::time::{Duration, Instant};

use ckpt_recovery::records::{self, Event};
use ckpt_store::{Error, Store};
use tracing::{info, warn};

use super::events::EventLog;
use crate::monitor::{
    Decision, Monitor, MonitorConfig, Observation, RollbackEntry, Spike, StopReason,
};
use crate::save::{SaveHandle, Stage, runtime};

/// A rollback carried out by [`super::CheckpointManager::rollback`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rollback {
    /// The step of the spike.
    pub from_step: u64,
    /// The checkpoint restored: the loop goes on with step `to_step + 1`.
    pub to_step: u64,
    /// The data batches skipped (first, last), as the loop's closure said.
    pub skipped: Option<(u64, u64)>,
    /// Rollbacks of the run so far, this one included.
    pub count: usize,
}

/// The spike monitor and what this manager decided with it.
pub(crate) struct Spikes {
    pub(crate) monitor: Monitor,
    /// The step of the last spike this manager decided about (it logs that rollback).
    decided: Option<u64>,
}

/// The newest committed step before `spike_step` of `steps` (step, committed): what a
/// rollback restores.
pub(crate) fn rollback_target(
    steps: impl IntoIterator<Item = (u64, bool)>,
    spike_step: u64,
) -> Option<u64> {
    steps
        .into_iter()
        .filter(|&(step, committed)| committed && step < spike_step)
        .map(|(step, _)| step)
        .max()
}

impl Spikes {
    /// A monitor with `cfg` (validated by the manager).
    pub(crate) fn new(cfg: MonitorConfig) -> Self {
        Spikes {
            monitor: Monitor::new(cfg),
            decided: None,
        }
    }

    /// Judge a step and log a spike (a tracing warning and a `spike` record), and a stop's
    /// `stop` record with the rollback history.
    pub(crate) fn observe(
        &mut self,
        o: &Observation,
        run: &str,
        events: &mut EventLog,
    ) -> Decision {
        let d = self.monitor.observe(o);
        let (spike, action) = match &d {
            Decision::Continue => return d,
            Decision::Alert(s) => (s, "alert"),
            Decision::Rollback(s) => (s, "rollback"),
            Decision::Stop(st) => (&st.spike, "stop"),
        };
        self.decided = Some(spike.step);
        warn!(
            run = %run,
            step = spike.step,
            batch = ?spike.batch,
            loss = spike.loss,
            action,
            "{spike}"
        );
        events.log(Event::Spike(records::Spike {
            step: spike.step,
            batch: spike.batch,
            what: spike.kind.as_str().to_string(),
            loss: finite(spike.loss),
            grad_norm: spike.grad_norm.and_then(finite),
            threshold: spike.threshold,
            median: spike.median,
            action: action.to_string(),
            rank: o.partial_of_rank,
        }));
        if let Decision::Stop(st) = &d {
            warn!(run = %run, "{st}");
            log_stop(events, st.spike.step, &st.reason, &st.history);
        }
        d
    }

    /// Whether this manager decided about `spike` (then it logs the rollback or stop).
    pub(crate) fn decided(&self, spike: &Spike) -> bool {
        self.decided == Some(spike.step)
    }

    /// No committed step before `spike`: a `stop` (logged if this manager decided) and the
    /// error the rollback fails with.
    pub(crate) fn no_checkpoint(
        &mut self,
        spike: &Spike,
        run: &str,
        events: &mut EventLog,
    ) -> Error {
        let reason = StopReason::NoCheckpoint;
        if self.decided(spike) {
            let history = self.monitor.history().to_vec();
            log_stop(events, spike.step, &reason, &history);
        }
        let Decision::Stop(st) = self.monitor.stop(*spike, reason) else {
            unreachable!("stop() makes a stop")
        };
        Error::not_found(format!("run {run}: {st}"))
    }

    /// After a restore to `to` (which loaded the monitor's window of that step): put back the
    /// rollback `history` from before the restore.
    pub(crate) fn keep_history(&mut self, history: Vec<RollbackEntry>) {
        let mut state = self.monitor.state();
        state.rollbacks = history;
        self.monitor.load_state(state);
    }

    /// Record the rollback from `spike` to `to` that skipped `skipped` (a `rollback` record
    /// if this manager decided it).
    pub(crate) fn rolled_back(
        &mut self,
        spike: &Spike,
        to: u64,
        skipped: Option<(u64, u64)>,
        logs: bool,
        events: &mut EventLog,
    ) -> Rollback {
        let entry = RollbackEntry {
            from_step: spike.step,
            to_step: to,
            reason: spike.reason(),
            skipped,
        };
        self.monitor.record_rollback(entry.clone());
        let count = self.monitor.history().len();
        info!(
            to_step = to,
            ?skipped,
            count,
            "rolled back to the newest checkpoint before the spike"
        );
        if logs {
            events.log(Event::Rollback(records::Rollback {
                from_step: entry.from_step,
                to_step: to,
                reason: entry.reason.clone(),
                skipped,
                count: count as u64,
                max: self.monitor.config().max_rollbacks as u64,
            }));
        }
        Rollback {
            from_step: spike.step,
            to_step: to,
            skipped,
            count,
        }
    }
}

fn log_stop(events: &mut EventLog, step: u64, reason: &StopReason, history: &[RollbackEntry]) {
    events.log(Event::Stop(records::Stop {
        step,
        reason: reason.to_string(),
        why: Some(reason.clone()),
        rollbacks: history.to_vec(),
    }));
}

/// Wait until `h` committed, failed or was skipped (or `commit_timeout` passed).
/// `SaveHandle::wait_committed` would keep polling for the commit record after a commit
/// that failed once the rank had persisted (a fenced committer), until the timeout; a
/// rollback must not sit out ten minutes for a step it will not use.
pub(crate) fn settle(h: &SaveHandle, store: &Store, run: &str, commit_timeout: Duration) {
    let key = store.keys().commit(run, h.step());
    let t0 = Instant::now();
    let mut pause = Duration::from_millis(10);
    loop {
        let why = match h.stage() {
            Stage::Committed => return,
            Stage::Failed(e) => e.message,
            Stage::Skipped(e) => e,
            Stage::Snapshotting | Stage::Snapshotted => match h.wait_persisted() {
                Ok(_) => continue,
                Err(e) => e.to_string(),
            },
            Stage::Persisted => match runtime().block_on(store.objects().exists(&key)) {
                Ok(true) => return,
                Ok(false) if t0.elapsed() < commit_timeout => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(200));
                    continue;
                }
                Ok(false) => format!("not committed within {commit_timeout:?}"),
                Err(e) => e.to_string(),
            },
        };
        warn!(
            step = h.step(),
            "rolling back past a checkpoint that did not commit: {why}"
        );
        return;
    }
}

/// `x` if finite (JSON has no NaN), else `None`.
fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rollback_restores_the_newest_committed_step_before_the_spike() {
        let steps = [(10, true), (20, true), (30, false), (40, true)];
        assert_eq!(rollback_target(steps, 35), Some(20));
        assert_eq!(rollback_target(steps, 41), Some(40));
        assert_eq!(rollback_target(steps, 40), Some(20));
        assert_eq!(rollback_target(steps, 10), None);
        assert_eq!(rollback_target([], 10), None);
    }

    #[test]
    fn json_gets_no_nan() {
        assert_eq!(finite(1.5), Some(1.5));
        assert_eq!(finite(f64::NAN), None);
        assert_eq!(finite(f64::INFINITY), None);
    }

    #[test]
    fn with_the_monitor_off_nothing_is_decided_or_logged() {
        let store = Store::memory();
        let mut events = EventLog::new(store.clone(), "r", 0);
        let mut s = Spikes::new(MonitorConfig::default());
        for i in 1..50 {
            let loss = if i == 40 { 1e9 } else { 1.0 };
            assert!(matches!(
                s.observe(&Observation::new(i, loss), "r", &mut events),
                Decision::Continue
            ));
        }
        let logged = runtime()
            .block_on(records::read_records::<Event>(&store, "r"))
            .unwrap();
        assert!(logged.is_empty());
    }
}
