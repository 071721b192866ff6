//! The records of the `metrics` log ([`super::Metric`]): training steps, a rank's figures of a
//! checkpoint and of its persist, the store's counters and health, the final digest; and the
//! failed and skipped saves, which the `events` log records too.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use super::read::lenient_f64;

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
    /// What its checkpoints met.
    #[serde(flatten)]
    pub counts: StoreHealthCounts,
}

/// How checkpointing fared against a failing store (a manager's `store_health()`, and the
/// figures of the `store_health` record).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StoreHealthCounts {
    /// Saves that failed in the store.
    pub failed: u64,
    /// Due checkpoints skipped while the store was down.
    pub skipped: u64,
    /// Times checkpointing resumed after the store came back.
    pub resumed: u64,
    /// Whether the store is down (now; in the record, at the end).
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
