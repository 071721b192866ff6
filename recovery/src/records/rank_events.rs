//! The records of the `events` log a rank's `CheckpointManager` writes ([`super::Event`]):
//! restores, spikes and rollbacks, checkpoints resumed after the store came back, the automatic
//! checkpoint interval (also the value a generation agrees on in the store), the cost of a
//! save, the persist rate.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::read::lenient_f64;

/// `{"kind":"restore"}`: a rank restored a step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Restore {
    /// The step.
    pub step: u64,
    /// The rank.
    pub rank: u32,
    /// Its generation.
    pub generation: u64,
    /// The layout that saved the step.
    pub from_layout: String,
    /// The rank's layout.
    pub to_layout: String,
    /// Bytes restored.
    pub bytes: u64,
    /// Raw bytes served by peer replica agents.
    pub bytes_from_peers: u64,
    /// Of those, the bytes read straight out of the memory of an agent on the rank's own
    /// machine (mapped, not through its socket).
    pub bytes_from_peers_mapped: u64,
    /// Stored bytes read from the store.
    pub bytes_from_store: u64,
    /// Raw bytes another rank of the node read from the store for this one (the node's
    /// shared cache).
    pub bytes_from_node: u64,
    /// With a local tier: stored bytes read from it.
    pub bytes_from_local: u64,
    /// With a local tier: the tier whose commit record the step was read by (`local`, or
    /// `remote` when the step was no longer, or not yet, in the local tier).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub tier: String,
    /// Seconds the restore took.
    pub seconds: f64,
}

/// `{"kind":"restore_failed"}`: a rank could not restore a step because of its data.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RestoreFailed {
    /// The step.
    pub step: u64,
    /// The rank.
    pub rank: u32,
    /// Its generation.
    pub generation: u64,
    /// `not found` or `damaged data`.
    pub error_kind: String,
    /// The error.
    pub error: String,
}

/// `{"kind":"spike"}`: the monitor found a spike.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Spike {
    /// The step.
    pub step: u64,
    /// The data batch it read.
    pub batch: Option<u64>,
    /// `loss`, `grad_norm` or `nonfinite`.
    pub what: String,
    /// The loss (`null`: NaN or infinite).
    #[serde(deserialize_with = "lenient_f64")]
    pub loss: Option<f64>,
    /// The gradient norm.
    #[serde(deserialize_with = "lenient_f64")]
    pub grad_norm: Option<f64>,
    /// The threshold crossed.
    #[serde(deserialize_with = "lenient_f64")]
    pub threshold: Option<f64>,
    /// The window's median of the offending quantity.
    #[serde(deserialize_with = "lenient_f64")]
    pub median: Option<f64>,
    /// `alert`, `rollback` or `stop`.
    pub action: String,
    /// The rank whose partial loss spiked (a rank per process).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
}

/// `{"kind":"rollback"}`: the run rolled back past a spike.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Rollback {
    /// The step of the spike.
    pub from_step: u64,
    /// The checkpoint restored.
    pub to_step: u64,
    /// Why.
    pub reason: String,
    /// The data batches skipped, first and last.
    pub skipped: Option<(u64, u64)>,
    /// Rollbacks of the run so far.
    pub count: u64,
    /// The bound on rollbacks.
    pub max: u64,
}

/// One rollback of a run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollbackEntry {
    /// The step of the spike.
    pub from_step: u64,
    /// The checkpoint restored.
    pub to_step: u64,
    /// Why (`loss spike`, `NaN loss`, ...).
    pub reason: String,
    /// The data batches skipped, first and last (inclusive), if the loop said.
    pub skipped: Option<(u64, u64)>,
}

/// Why the monitor stops a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A NaN or infinity under `alert`.
    NonFinite,
    /// The bound on rollbacks is reached.
    RollbacksExhausted {
        /// The bound.
        max: usize,
    },
    /// No committed checkpoint from before the spike to roll back to.
    NoCheckpoint,
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::NonFinite => f.write_str(
                "NaN/infinity under --on-spike alert: the state is poisoned, so the run stops instead of training on (no checkpoint of it was saved)",
            ),
            StopReason::RollbacksExhausted { max } => {
                write!(f, "the run already rolled back {max} times (the bound)")
            }
            StopReason::NoCheckpoint => {
                f.write_str("there is no committed checkpoint from before the spike")
            }
        }
    }
}

/// `{"kind":"stop"}`: the monitor stopped the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stop {
    /// The step of the spike.
    pub step: u64,
    /// Why, in words.
    pub reason: String,
    /// Why.
    pub why: Option<StopReason>,
    /// The run's rollbacks, oldest first.
    pub rollbacks: Vec<RollbackEntry>,
}

/// `{"kind":"checkpoints_resumed"}`: the store answers again.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CheckpointsResumed {
    /// The step.
    pub step: u64,
    /// Checkpoints skipped in all while it was down.
    pub skipped: u64,
    /// The step it was found down at.
    pub down_since_step: u64,
}

/// `{"kind":"checkpoint_interval"}`: the automatic checkpoint interval was decided (the first
/// time, and each time it changes; Young/Daly:
/// `target_s = sqrt(2 x cost_s x mtbf_s)`, in steps `target_s / step_s`, clamped to the bounds).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CheckpointInterval {
    /// The step after which it was decided; the new interval is in force from the next one.
    pub step: u64,
    /// The interval before, in steps.
    pub from_steps: u64,
    /// The interval from now on, in steps.
    pub to_steps: u64,
    /// Why this value: `young_daly` (the formula), `min` or `max` (clamped to a bound), or
    /// `no_baseline` (no step without a save in flight measured yet: the interval doubles).
    pub reason: String,
    /// The measured cost of one save, seconds (loop stall plus slowdown while it persisted).
    #[serde(deserialize_with = "lenient_f64")]
    pub cost_s: Option<f64>,
    /// The time of a step without a save in flight (median), seconds.
    #[serde(deserialize_with = "lenient_f64")]
    pub step_s: Option<f64>,
    /// Young/Daly's interval in seconds.
    #[serde(deserialize_with = "lenient_f64")]
    pub target_s: Option<f64>,
    /// The mean time between failures used, seconds.
    pub mtbf_s: f64,
    /// Failures counted in the run's recovery log.
    pub failures: u64,
    /// Seconds of the run they were counted over (its first logged event to now).
    pub observed_s: f64,
    /// Whether `mtbf_s` is the prior (no failure logged yet).
    pub mtbf_prior: bool,
    /// Ranks in separate processes: the generation this interval is fixed for (from its
    /// first step to its end; `step` is the step it resumed from). Absent when the ranks of
    /// one process share rank 0's schedule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
}

impl ckpt_store::Agreement for CheckpointInterval {
    /// An interval of 0 steps cannot be used.
    fn check(&self, run: &str, generation: u64) -> std::result::Result<(), String> {
        if self.to_steps == 0 {
            return Err(format!(
                "the checkpoint interval of generation {generation} of run {run} is 0 steps"
            ));
        }
        Ok(())
    }
}

/// `{"kind":"save_cost"}`: the cost of a save as the deciding rank (rank 0) of a generation
/// measured it, after each save it measured. With ranks in separate processes the interval is
/// fixed per generation, and the next generation derives it from the newest of these
/// records (ARCHITECTURE.md, "The automatic checkpoint interval").
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SaveCost {
    /// The generation that measured it.
    pub generation: u64,
    /// The rank that measured it (0).
    pub rank: u32,
    /// The step whose save completed the measurement.
    pub step: u64,
    /// The mean cost of the newest saves measured, seconds (`null`: none measured yet, no
    /// step without a save in flight to compare against).
    #[serde(deserialize_with = "lenient_f64")]
    pub cost_s: Option<f64>,
    /// The time of a step without a save in flight (median), seconds.
    #[serde(deserialize_with = "lenient_f64")]
    pub step_s: Option<f64>,
    /// The interval in force in this generation, steps.
    pub steps: u64,
    /// The interval these figures and this generation's failure rate call for, steps (what the
    /// next generation would take if no failure came in between).
    pub next_steps: u64,
}

/// `{"kind":"persist_rate"}`: the persist governor changed a rank's persist rate.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PersistRate {
    /// The step at whose `maybe_save` it was decided.
    pub step: u64,
    /// The rank.
    pub rank: u32,
    /// The rate before, raw bytes/s (`null`: no limit).
    pub from_bps: Option<u64>,
    /// The rate from now on (`null`: no limit).
    pub to_bps: Option<u64>,
    /// `over_budget` (lowered) or `under_budget` (raised, or lifted).
    pub reason: String,
    /// The slowdown it was decided on (step time beside the persist over the baseline).
    pub slowdown: f64,
    /// The budget, a fraction.
    pub budget: f64,
    /// The baseline step time, seconds.
    pub baseline_s: f64,
    /// The new rate is the governor's floor.
    pub at_floor: bool,
}
