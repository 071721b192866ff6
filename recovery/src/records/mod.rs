//! The records of a run's logs ([`ckpt_store::logs`]): one serde type per record, shared by the
//! processes that write them (`ckpt-train`, the `CheckpointManager`, the recovery drivers) and
//! the ones that read them back (`ckpt plot`, `ckpt resume`, `ckpt agent`, the supervisor's
//! report). One enum per log, tagged by `kind`: [`Metric`] for `metrics`, [`Event`] for
//! `events`. FORMAT.md ("Logs") documents every kind; a test checks both lists agree.
//!
//! Readers tolerate what they do not know: [`parse_records`] skips records of an unknown kind
//! (a newer writer's) and ignores unknown fields; every field a reader may miss in an old log
//! has a default. A record whose known fields have the wrong type is skipped with a warning
//! rather than hiding the rest of the log.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use ckpt_store::{Result, Store};

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
    }
}

/// A record read back from a log, with its time.
#[derive(Debug, Clone, PartialEq)]
pub struct Logged<T> {
    /// Unix milliseconds when it was written (`t_ms`; 0 if absent).
    pub t_ms: i64,
    /// The record.
    pub record: T,
}

/// The records of `values` (JSON lines of a log, as [`ckpt_store::logs::read_log`] returns them)
/// that `T` reads, in their order. Records of an unknown kind are skipped silently (a newer
/// writer's); a known kind whose fields do not read is skipped with a warning.
pub fn parse_records<T: LogRecord>(values: &[Value]) -> Vec<Logged<T>> {
    let mut out = Vec::with_capacity(values.len());
    for v in values {
        let Some(obj) = v.as_object() else { continue };
        let Some(kind) = obj.get("kind").and_then(Value::as_str) else {
            continue;
        };
        if !T::KINDS.contains(&kind) {
            continue;
        }
        let t_ms = obj.get("t_ms").and_then(Value::as_i64).unwrap_or(0);
        let mut body = obj.clone();
        body.remove("t_ms");
        match T::deserialize(Value::Object(body)) {
            Ok(record) => out.push(Logged { t_ms, record }),
            Err(e) => tracing::warn!(log = T::LOG, kind, "skipping a log record: {e}"),
        }
    }
    out
}

/// Every record of `run`'s log of `T` that `T` reads, in time order ([`parse_records`]).
pub async fn read_records<T: LogRecord>(store: &Store, run: &str) -> Result<Vec<Logged<T>>> {
    let values = ckpt_store::logs::read_log(store, run, T::LOG).await?;
    Ok(parse_records(&values))
}

/// A number, or `None` for anything else (`null` for NaN, or a string an old writer used).
fn lenient_f64<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<f64>, D::Error> {
    Ok(Option::<Value>::deserialize(d)?.and_then(|v| v.as_f64()))
}

// ---------------------------------------------------------------------------------------------
// metrics

/// The curves a `step` record carries (what `ckpt plot` draws).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Curve {
    /// The training loss.
    Loss,
    /// The gradient norm.
    GradNorm,
}

/// `{"kind":"step"}`: a training step. The job's loss and gradient norm (`ckpt-train` with all
/// ranks in one process, a driver summing its ranks' heartbeats, or a job of one rank), or
/// one rank's partial sums (`ckpt-train --rank`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepMetrics {
    /// The step.
    pub step: u64,
    /// The generation that trained it (written by a driver).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// The data batch it read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<u64>,
    /// The rank, when the record is one rank's part.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    /// The loss (`null`: NaN or infinite).
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_f64"
    )]
    pub loss: Option<f64>,
    /// The gradient norm (`null`: NaN or infinite).
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_f64"
    )]
    pub grad_norm: Option<f64>,
    /// The reference workload's partial sum of squared errors (fixed point, decimal).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sse: Option<String>,
    /// The reference workload's partial sum of squared gradients (fixed point, decimal).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gsq: Option<String>,
    /// Elements in the partial sums.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n: Option<u64>,
    /// A NaN or infinity was seen in the partial sums.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nonfinite: Option<bool>,
    /// Seconds the step took.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_time_s: Option<f64>,
    /// Resident host memory of the process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_mem_bytes: Option<u64>,
    /// Device memory in use (absent: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_mem_bytes: Option<u64>,
}

impl StepMetrics {
    /// Set one of the curves.
    pub fn set(&mut self, curve: Curve, v: f64) {
        match curve {
            Curve::Loss => self.loss = Some(v),
            Curve::GradNorm => self.grad_norm = Some(v),
        }
    }
}

/// `{"kind":"checkpoint"}`: one rank's figures of a checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CheckpointMetrics {
    /// The step saved.
    pub step: u64,
    /// The rank.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    /// Bytes of the rank's state.
    pub bytes: u64,
    /// Seconds the training loop waited for the snapshot.
    pub stall_s: f64,
    /// Seconds of the snapshot copy.
    pub snapshot_s: f64,
    /// Seconds of the persist.
    pub persist_s: f64,
    /// Seconds from persisted to committed.
    pub commit_s: f64,
    /// Stored bytes written.
    pub bytes_written: u64,
    /// Raw bytes skipped as unchanged (dedup).
    pub bytes_skipped: u64,
    /// The most staging memory in use.
    pub staging_peak: u64,
}

/// `{"kind":"final"}`: the digest of the last committed state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Final {
    /// The step.
    pub step: u64,
    /// Its digest.
    pub digest: String,
}

/// `{"kind":"store"}`: a process's store request counters (names in
/// [`ckpt_store::wrap::names`], such as `store.puts`, `store.retries`, `store.give_ups`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StoreCounters {
    /// Counter name to value (fields that are not counters are skipped).
    #[serde(flatten, deserialize_with = "counters_only")]
    pub counters: BTreeMap<String, u64>,
}

fn counters_only<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<BTreeMap<String, u64>, D::Error> {
    let all = BTreeMap::<String, Value>::deserialize(d)?;
    Ok(all
        .into_iter()
        .filter_map(|(k, v)| Some((k, v.as_u64()?)))
        .collect())
}

/// `{"kind":"store_health"}`: a rank's checkpoints lost to a failing store.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StoreHealth {
    /// The rank.
    pub rank: u32,
    /// Saves that failed in the store.
    pub failed: u64,
    /// Due checkpoints skipped while it was down.
    pub skipped: u64,
    /// Times checkpoints resumed after it came back.
    pub resumed: u64,
    /// Whether it was down at the end.
    pub down: bool,
}

/// `{"kind":"checkpoint_failed"}` (both logs): a save failed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CheckpointFailed {
    /// The step.
    pub step: u64,
    /// The rank (metrics).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    /// The error.
    pub error: String,
    /// The error's kind (metrics; [`ckpt_store::ErrorKind::as_str`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_kind: Option<String>,
}

/// `{"kind":"checkpoint_skipped"}` (both logs): a due checkpoint was not taken.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CheckpointSkipped {
    /// The step.
    pub step: u64,
    /// The rank (metrics).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    /// Why.
    pub reason: String,
}

/// `{"kind":"persist"}`: one rank's persist as the persist governor saw it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PersistMetrics {
    /// The step saved.
    pub step: u64,
    /// The rank.
    pub rank: u32,
    /// Raw bytes the persist handled.
    pub bytes: u64,
    /// Step time beside the persist over the baseline (`null`: not measured).
    #[serde(deserialize_with = "lenient_f64")]
    pub slowdown: Option<f64>,
    /// Seconds of step time that ran beside it.
    pub overlap_s: f64,
    /// Seconds from the save to the rank's chunks and manifest in the store.
    pub durable_s: f64,
    /// The rate the governor settled at, raw bytes/s (`null`: no limit).
    pub rate_bps: Option<u64>,
    /// The slowdown budget, a fraction.
    pub budget: f64,
    /// The baseline step time, seconds (`null`: not measured yet).
    #[serde(deserialize_with = "lenient_f64")]
    pub baseline_s: Option<f64>,
}

// ---------------------------------------------------------------------------------------------
// events: the recovery log (the coordinator's records, `ckpt_recovery::Record`)

/// `{"kind":"started"}`: a generation started.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Started {
    /// Generation.
    pub generation: u64,
    /// Layout.
    pub layout: String,
    /// Nodes in use.
    pub nodes: Vec<u32>,
    /// The step restored from.
    pub resume_from: Option<u64>,
    /// Milliseconds since the supervisor started.
    pub at_ms: u64,
}

/// `{"kind":"failure"}`: a rank failed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Failure {
    /// Generation.
    pub generation: u64,
    /// Rank.
    pub rank: u32,
    /// Its node (excluded from now on).
    pub node: u32,
    /// `exit`, `signal`, `heartbeat`, `hang`, `startup`, `restore`, or `node` (found lost
    /// when a coordinator took over, or its agent's lease expired).
    pub how: String,
    /// Details.
    pub detail: String,
    /// The last step the rank reported.
    pub last_step: Option<u64>,
    /// Seconds from the failure's evidence (last heartbeat or progress) to detection; 0 for
    /// exits, which are seen at once.
    pub detection_s: f64,
    /// Milliseconds since the supervisor started.
    pub at_ms: u64,
}

/// `{"kind":"step_unusable"}`: a committed step cannot be restored (an object missing or
/// damaged). It is never chosen again, and is retired once an older step is chosen.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepUnusable {
    /// Generation that found it.
    pub generation: u64,
    /// The step.
    pub step: u64,
    /// The rank whose restore failed, or `None` when the driver found it while choosing.
    pub rank: Option<u32>,
    /// What is missing or damaged.
    pub why: String,
    /// Milliseconds since the supervisor started.
    pub at_ms: u64,
}

/// Bytes one rank of a new layout reads to restore.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RankPlan {
    /// Rank.
    pub rank: u32,
    /// Bytes of the boxes it holds.
    pub bytes_needed: u64,
    /// Stored bytes of the chunks it fetches.
    pub bytes_fetched: u64,
    /// Chunks it fetches.
    pub chunks: u64,
}

/// `{"kind":"recovery"}`: what recovery decided.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Recovery {
    /// Generation that failed.
    pub generation: u64,
    /// Surviving usable nodes.
    pub nodes: Vec<u32>,
    /// The new layout.
    pub layout: String,
    /// The step to restore.
    pub step: Option<u64>,
    /// Steps trained past that step and lost.
    pub steps_lost: u64,
    /// The restart delay.
    pub backoff_s: f64,
    /// Milliseconds since the supervisor started.
    pub at_ms: u64,
    /// What each rank of the new layout reads (added by the driver).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<Vec<RankPlan>>,
}

/// `{"kind":"resumed"}`: the first step after a restart completed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Resumed {
    /// Generation.
    pub generation: u64,
    /// The step completed.
    pub step: u64,
    /// Seconds from the failure's detection to this step.
    pub since_failure_s: f64,
    /// Milliseconds since the supervisor started.
    pub at_ms: u64,
}

/// `{"kind":"finished"}`: the job ended.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Finished {
    /// Whether it completed.
    pub ok: bool,
    /// Why it ended.
    pub reason: String,
    /// Restarts made.
    pub restarts: u32,
    /// Milliseconds since the supervisor started.
    pub at_ms: u64,
}

/// `{"kind":"node_returned"}`: a failed node was repaired and came back.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeReturned {
    /// The node.
    pub node: u32,
    /// Whether it is usable again (`false`: it is kept out, see `node_kept_out`).
    pub usable: bool,
    /// Milliseconds since the supervisor started.
    pub at_ms: u64,
}

/// `{"kind":"node_kept_out"}`: a node failed `failures_ms.len()` times within `window_s`: it is
/// never used again by this supervision, even when it comes back.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeKeptOut {
    /// The node.
    pub node: u32,
    /// When it failed (milliseconds since the supervisor started), oldest first: the failures
    /// within the window.
    pub failures_ms: Vec<u64>,
    /// The window (seconds).
    pub window_s: f64,
    /// Why, in words.
    pub reason: String,
    /// Milliseconds since the supervisor started.
    pub at_ms: u64,
}

/// `{"kind":"grow"}`: nodes came back, and the job was stopped after a commit and restarted
/// on more nodes (more data parallelism, at most the configured layout) from the newest
/// committed step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Grow {
    /// Generation that was stopped.
    pub generation: u64,
    /// Its layout.
    pub from_layout: String,
    /// The new layout.
    pub layout: String,
    /// The nodes the new layout runs on.
    pub nodes: Vec<u32>,
    /// The nodes that came back since the last layout decision.
    pub returned: Vec<u32>,
    /// The step restored (the newest committed).
    pub step: Option<u64>,
    /// Steps trained past that step and done again.
    pub steps_lost: u64,
    /// Why, in words.
    pub reason: String,
    /// Milliseconds since the supervisor started.
    pub at_ms: u64,
}

/// `{"kind":"takeover"}`: an etcd coordinator took over the job.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Takeover {
    /// The generation it carries on.
    pub generation: u64,
    /// The node of the new coordinator.
    pub node: u32,
    /// The node of the previous one.
    pub previous: Option<u32>,
    /// Nodes found lost.
    pub lost_nodes: Vec<u32>,
    /// Milliseconds since this coordinator started.
    pub at_ms: u64,
}

impl Event {
    /// Milliseconds since the driver started, of a recovery-log record.
    pub fn at_ms(&self) -> Option<u64> {
        match self {
            Event::Started(r) => Some(r.at_ms),
            Event::Failure(r) => Some(r.at_ms),
            Event::StepUnusable(r) => Some(r.at_ms),
            Event::Recovery(r) => Some(r.at_ms),
            Event::Resumed(r) => Some(r.at_ms),
            Event::Finished(r) => Some(r.at_ms),
            Event::Takeover(r) => Some(r.at_ms),
            Event::NodeReturned(r) => Some(r.at_ms),
            Event::NodeKeptOut(r) => Some(r.at_ms),
            Event::Grow(r) => Some(r.at_ms),
            _ => None,
        }
    }

    /// The generation of a recovery-log record, for a driver to renumber.
    pub fn generation_mut(&mut self) -> Option<&mut u64> {
        match self {
            Event::Started(r) => Some(&mut r.generation),
            Event::Failure(r) => Some(&mut r.generation),
            Event::StepUnusable(r) => Some(&mut r.generation),
            Event::Recovery(r) => Some(&mut r.generation),
            Event::Resumed(r) => Some(&mut r.generation),
            Event::Takeover(r) => Some(&mut r.generation),
            Event::Restore(r) => Some(&mut r.generation),
            Event::RestoreFailed(r) => Some(&mut r.generation),
            Event::Grow(r) => Some(&mut r.generation),
            Event::Finished(_)
            | Event::NodeReturned(_)
            | Event::NodeKeptOut(_)
            | Event::Spike(_)
            | Event::Rollback(_)
            | Event::Stop(_)
            | Event::CheckpointFailed(_)
            | Event::CheckpointSkipped(_)
            | Event::CheckpointsResumed(_)
            | Event::CheckpointInterval(_)
            | Event::SaveCost(_)
            | Event::PersistRate(_) => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// events: a rank's (`CheckpointManager`)

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
    /// Stored bytes read from the store.
    pub bytes_from_store: u64,
    /// Raw bytes another rank of the node read from the store for this one (the node's
    /// shared cache).
    pub bytes_from_node: u64,
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The record names FORMAT.md lists under a `<!-- records: LOG -->` marker: the first
    /// backticked word of each row of the table that follows.
    fn documented(log: &str) -> Vec<String> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../FORMAT.md");
        let doc = std::fs::read_to_string(path).expect("FORMAT.md");
        let marker = format!("<!-- records: {log} -->");
        let start = doc
            .find(&marker)
            .unwrap_or_else(|| panic!("FORMAT.md has no {marker}"));
        let mut out = Vec::new();
        let mut in_table = false;
        for line in doc[start + marker.len()..].lines() {
            let line = line.trim();
            if !line.starts_with('|') {
                if in_table {
                    break;
                }
                continue;
            }
            in_table = true;
            let first = line.trim_start_matches('|').split('|').next().unwrap_or("");
            if let Some(name) = first
                .trim()
                .strip_prefix('`')
                .and_then(|s| s.split('`').next())
            {
                out.push(name.to_string());
            }
        }
        out
    }

    fn check_documented<T: LogRecord>() {
        let doc = documented(T::LOG);
        assert!(!doc.is_empty(), "FORMAT.md lists no {} records", T::LOG);
        for k in T::KINDS {
            assert!(
                doc.iter().any(|d| d == k),
                "the {} record {k:?} is not documented in FORMAT.md (\"Logs\")",
                T::LOG
            );
        }
        for d in &doc {
            assert!(
                T::KINDS.contains(&d.as_str()),
                "FORMAT.md documents a {} record {d:?} that no type has",
                T::LOG
            );
        }
    }

    #[test]
    fn format_md_lists_every_record_and_only_those() {
        check_documented::<Metric>();
        check_documented::<Event>();
    }

    fn round_trip<T: LogRecord + PartialEq + fmt::Debug>(all: Vec<T>) {
        assert_eq!(all.len(), T::KINDS.len());
        for (r, k) in all.into_iter().zip(T::KINDS) {
            assert_eq!(r.kind(), *k);
            let mut v = serde_json::to_value(&r).unwrap();
            assert_eq!(v["kind"], *k);
            v["t_ms"] = json!(5);
            v["a_future_field"] = json!([1, 2]);
            let back = parse_records::<T>(&[v]);
            assert_eq!(back, vec![Logged { t_ms: 5, record: r }]);
        }
    }

    #[test]
    fn every_kind_round_trips_with_unknown_fields() {
        round_trip(Metric::one_of_each());
        round_trip(Event::one_of_each());
    }

    #[test]
    fn readers_skip_unknown_kinds_and_read_old_records() {
        let lines = vec![
            json!({"kind": "a_future_record", "t_ms": 1}),
            json!("not an object"),
            json!({"step": 3}),
            // An old writer's NaN as a string; a record without most fields.
            json!({"kind": "step", "step": 3, "loss": "nan", "grad_norm": 2.0, "t_ms": 2}),
            json!({"kind": "checkpoint", "step": 2, "t_ms": 3}),
            json!({"kind": "store", "store.puts": 4, "store.retries": 1, "t_ms": 4}),
            // A known kind whose fields do not read: skipped, not fatal.
            json!({"kind": "final", "step": "three", "t_ms": 5}),
        ];
        let m = parse_records::<Metric>(&lines);
        assert_eq!(m.len(), 3);
        let Metric::Step(s) = &m[0].record else {
            panic!("{m:?}")
        };
        assert_eq!(
            (s.step, s.loss, s.grad_norm, m[0].t_ms),
            (3, None, Some(2.0), 2)
        );
        let Metric::Store(c) = &m[2].record else {
            panic!("{m:?}")
        };
        assert_eq!(c.counters.len(), 2, "t_ms is not a counter: {c:?}");
        assert!(parse_records::<Event>(&lines).is_empty());
    }

    #[test]
    fn the_on_disk_shape_is_unchanged() {
        let r = Event::Recovery(Recovery {
            generation: 2,
            nodes: vec![0, 2],
            layout: "dp=2".into(),
            step: None,
            steps_lost: 3,
            backoff_s: 0.5,
            at_ms: 9,
            plan: None,
        });
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({"kind": "recovery", "generation": 2, "nodes": [0, 2], "layout": "dp=2",
                   "step": null, "steps_lost": 3, "backoff_s": 0.5, "at_ms": 9})
        );
        let s = Metric::Step(StepMetrics {
            step: 4,
            generation: Some(1),
            loss: Some(f64::NAN),
            grad_norm: Some(1.5),
            ..Default::default()
        });
        assert_eq!(
            serde_json::to_value(&s).unwrap(),
            json!({"kind": "step", "step": 4, "generation": 1, "loss": null, "grad_norm": 1.5})
        );
    }
}
