//! The `checkpoint`, `checkpoint_failed`, `checkpoint_skipped` and `persist` records of a
//! rank's saves, once each is done.

use std::time::Duration;

use ckpt_recovery::records::{self, Metric};
use ckpt_store::{Error, ErrorKind, Result};
use tracing::warn;

use ckpt_trainer::manager::CheckpointManager;
use ckpt_trainer::save::{SaveHandle, Stage};

use crate::shared::Shared;

/// The persist governor's figures of the persists that ended (`persist` records).
pub(crate) fn emit_persists(sh: &Shared, mgr: &mut CheckpointManager) {
    for f in mgr.take_persist_figures() {
        sh.emit(&Metric::Persist(f));
    }
    for f in mgr.take_drain_figures() {
        sh.emit(&Metric::Drain(f));
    }
}

pub(crate) fn emit_finished(
    sh: &Shared,
    rank: u32,
    saves: &mut Vec<(SaveHandle, f64)>,
    all: bool,
) -> Result<()> {
    let mut keep = Vec::new();
    let mut any = false;
    for (h, stall) in saves.drain(..) {
        let done = match h.stage() {
            Stage::Committed => true,
            Stage::Persisted => rank != 0 || all,
            Stage::Failed(e) => {
                warn!(rank, step = h.step(), "checkpoint failed: {e}");
                sh.emit(&Metric::CheckpointFailed(records::CheckpointFailed {
                    step: h.step(),
                    rank: Some(rank),
                    error: e.message.clone(),
                    error_kind: Some(e.kind.as_str().to_string()),
                }));
                // A newer generation owns the run: this job must stop, not go on training
                // without checkpoints. Other failures skip one checkpoint.
                if e.kind == ErrorKind::Fenced {
                    return Err(Error::new(
                        ErrorKind::Fenced,
                        format!("checkpoint of step {} failed: {}", h.step(), e.message),
                    ));
                }
                continue;
            }
            Stage::Skipped(why) => {
                sh.emit(&Metric::CheckpointSkipped(records::CheckpointSkipped {
                    step: h.step(),
                    rank: Some(rank),
                    reason: why.to_string(),
                }));
                continue;
            }
            _ => all,
        };
        if !done {
            keep.push((h, stall));
            continue;
        }
        let r = if all && rank == 0 {
            h.wait_committed(Duration::from_secs(600))?
        } else if all {
            h.wait_persisted()?
        } else {
            h.report()
        };
        let v = records::CheckpointMetrics {
            rank: Some(rank),
            stall_s: stall,
            ..records::CheckpointMetrics::from(&r)
        };
        sh.outcome.lock().checkpoints.push(v.clone());
        sh.emit(&Metric::Checkpoint(v));
        any = true;
    }
    *saves = keep;
    if any {
        sh.flush_log();
    }
    Ok(())
}
