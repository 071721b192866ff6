//! The records of a run's logs ([`ckpt_store::logs`]): one serde type per record, the
//! contract between the processes that write them (`ckpt-train`, the `CheckpointManager`, the
//! recovery drivers) and the ones that read them back (`ckpt plot`, `ckpt resume`,
//! `ckpt agent`, the supervisor's report). One enum per log, tagged by `kind`: [`Metric`] for
//! `metrics`, [`Event`] for `events`. FORMAT.md ("Logs") documents every kind; a test checks
//! both lists agree. The store keeps the logs and knows none of these types.
//!
//! Readers tolerate what they do not know: [`parse_records`] skips records of an unknown kind
//! (a newer writer's) and ignores unknown fields; every field a reader may miss in an old log
//! has a default. A record whose known fields have the wrong type is skipped with a warning
//! rather than hiding the rest of the log.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`LogRecord`], the two enums ([`Metric`], [`Event`]) and the re-exports (every `ckpt_recovery::records::*` path) |
//! | `read.rs` | reading them back: [`Logged`], [`parse_records`], [`read_records`], the lenient number |
//! | `metrics.rs` | the `metrics` log's records (steps, checkpoints, the store's counters and health, persists), and the failed and skipped saves both logs share |
//! | `recovery_log.rs` | the `events` log's recovery records, written by the drivers and the coordinator |
//! | `rank_events.rs` | the `events` log's records of a rank's `CheckpointManager` (restores, spikes and rollbacks, checkpoints resumed, the checkpoint interval and a save's cost, the persist rate) |
//! | `sentinel.rs` | the sentinel's records: replicas that disagree at a commit, trainable state that stopped changing |
//! | `tiers.rs` | tiered checkpoints: steps drained to the remote store, skipped, failed drains, damaged local chunks |

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

mod metrics;
mod rank_events;
mod read;
mod recovery_log;
pub(crate) mod sentinel;
#[cfg(test)]
mod tests;
mod tiers;

pub use metrics::{
    CheckpointFailed, CheckpointMetrics, CheckpointSkipped, Curve, Final, PersistMetrics,
    StepMetrics, StoreCounters, StoreHealth, StoreHealthCounts,
};
pub use rank_events::{
    CheckpointInterval, CheckpointsResumed, PersistRate, Restore, RestoreFailed, Rollback,
    RollbackEntry, SaveCost, Spike, Stop, StopReason,
};
pub use read::{Logged, parse_records, read_records};
pub use recovery_log::{
    Failure, Finished, Grow, NodeKeptOut, NodeReturned, RankPlan, Recovery, Resumed, Started,
    StepUnusable, Takeover,
};
pub use sentinel::{ReplicaMismatchEvent, StateUnchanged};
pub use tiers::{DrainFailed, DrainMetrics, DrainSkipped, LocalTierDamaged};

/// A record type of one log: its kinds, derived from the enum.
pub trait LogRecord: Serialize + DeserializeOwned {
    /// The log it is written to ([`ckpt_store::logs::METRICS`] or
    /// [`ckpt_store::logs::EVENTS`]).
    const LOG: &'static str;
    /// Every `kind` of the enum, in declaration order.
    const KINDS: &'static [&'static str];
    /// This record's `kind`.
    fn kind(&self) -> &'static str;
}

/// Defines a log's record enum, internally tagged by `kind`, and its [`LogRecord`] impl, from
/// one list: a variant cannot be added without its kind appearing in `KINDS`.
macro_rules! log_records {
    (
        $(#[$m:meta])*
        pub enum $name:ident in $log:path; {
            $( $(#[$vm:meta])* $kind:literal => $var:ident($ty:ty), )*
        }
    ) => {
        $(#[$m])*
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "kind")]
        pub enum $name {
            $( $(#[$vm])* #[serde(rename = $kind)] $var($ty), )*
        }

        impl LogRecord for $name {
            const LOG: &'static str = $log;
            const KINDS: &'static [&'static str] = &[$($kind),*];
            fn kind(&self) -> &'static str {
                match self {
                    $( $name::$var(_) => $kind, )*
                }
            }
        }

        impl $name {
            /// One record of every kind, each with default fields (for tests of the list).
            pub fn one_of_each() -> Vec<$name> {
                vec![$( $name::$var(<$ty>::default()), )*]
            }
        }
    };
}

log_records! {
    /// A record of the `metrics` log.
    pub enum Metric in ckpt_store::logs::METRICS; {
        /// A training step: the job's loss and gradient norm, or one rank's part of it.
        "step" => Step(StepMetrics),
        /// One rank's part of a checkpoint, once it is persisted (committed on the committer).
        "checkpoint" => Checkpoint(CheckpointMetrics),
        /// The digest of the last committed state (`ckpt-train`'s committer).
        "final" => Final(Final),
        /// The store's request counters of a process, once per run.
        "store" => Store(StoreCounters),
        /// A rank's count of checkpoints lost to a failing store (only when one was).
        "store_health" => StoreHealth(StoreHealth),
        /// A save that failed (`ckpt-train`'s copy, with the rank and the error's kind).
        "checkpoint_failed" => CheckpointFailed(CheckpointFailed),
        /// A save that was not taken (`ckpt-train`'s copy, with the rank).
        "checkpoint_skipped" => CheckpointSkipped(CheckpointSkipped),
        /// One rank's persist as the persist governor saw it: the slowdown of the steps
        /// beside it, the time to durable, the rate it settled at.
        "persist" => Persist(PersistMetrics),
        /// A step drained from the local tier to the remote store, and how far behind it is.
        "drain" => Drain(DrainMetrics),
    }
}

log_records! {
    /// A record of the `events` log.
    pub enum Event in ckpt_store::logs::EVENTS; {
        /// A generation of a supervised job started.
        "started" => Started(Started),
        /// A rank failed.
        "failure" => Failure(Failure),
        /// A committed step cannot be restored (FORMAT.md, "Recovery: which step the ranks
        /// restore").
        "step_unusable" => StepUnusable(StepUnusable),
        /// What recovery decided after a failure.
        "recovery" => Recovery(Recovery),
        /// The first step after a restart completed.
        "resumed" => Resumed(Resumed),
        /// A supervised job ended.
        "finished" => Finished(Finished),
        /// A repaired node came back (or was refused: kept out).
        "node_returned" => NodeReturned(NodeReturned),
        /// A node failed too often: kept out of the job for good.
        "node_kept_out" => NodeKeptOut(NodeKeptOut),
        /// The job grew back onto returned nodes at a checkpoint boundary.
        "grow" => Grow(Grow),
        /// An etcd coordinator took over the job.
        "takeover" => Takeover(Takeover),
        /// A rank restored a step.
        "restore" => Restore(Restore),
        /// A rank could not restore a step because of its data.
        "restore_failed" => RestoreFailed(RestoreFailed),
        /// The spike monitor found a spike.
        "spike" => Spike(Spike),
        /// The run rolled back past a spike.
        "rollback" => Rollback(Rollback),
        /// The spike monitor stopped the run.
        "stop" => Stop(Stop),
        /// A save failed in the store after its retries; training goes on.
        "checkpoint_failed" => CheckpointFailed(CheckpointFailed),
        /// A due checkpoint was not taken while the store is down.
        "checkpoint_skipped" => CheckpointSkipped(CheckpointSkipped),
        /// The store answers again; checkpoints resume.
        "checkpoints_resumed" => CheckpointsResumed(CheckpointsResumed),
        /// The automatic checkpoint interval changed, with the figures it was chosen from.
        "checkpoint_interval" => CheckpointInterval(CheckpointInterval),
        /// What a save costs, as the deciding rank measured it (ranks in separate processes:
        /// the next generation's interval is derived from it).
        "save_cost" => SaveCost(SaveCost),
        /// The persist governor changed a rank's persist rate, with the reason.
        "persist_rate" => PersistRate(PersistRate),
        /// The committer found data-parallel replicas whose bytes differ (the sentinel).
        "replica_mismatch" => ReplicaMismatch(ReplicaMismatchEvent),
        /// Trainable tensors kept the same bytes over consecutive checkpoints (the sentinel).
        "state_unchanged" => StateUnchanged(StateUnchanged),
        /// The drain to the remote store skipped a step to keep up.
        "drain_skipped" => DrainSkipped(DrainSkipped),
        /// A drain to the remote store failed; it is tried again.
        "drain_failed" => DrainFailed(DrainFailed),
        /// A restore read local chunks that were missing or damaged from the remote store.
        "local_tier_damaged" => LocalTierDamaged(LocalTierDamaged),
    }
}
