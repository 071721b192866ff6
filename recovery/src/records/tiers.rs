//! The records of tiered checkpoints (issue 28): a step drained from the local tier to the
//! remote store (the `metrics` log's `drain`, with how far the drain lags), steps the drain
//! skipped to keep up, drains that failed and will be tried again, and local chunks a restore
//! found damaged and read from the remote store instead (the `events` log).

use serde::{Deserialize, Serialize};

/// `{"kind":"drain"}` (metrics): a step drained to the remote store.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DrainMetrics {
    /// The step.
    pub step: u64,
    /// The draining rank.
    pub rank: u32,
    /// Objects sent.
    pub objects_sent: u64,
    /// Their stored bytes.
    pub bytes_sent: u64,
    /// Stored bytes the remote held already (not sent).
    pub bytes_present: u64,
    /// Seconds the drain took.
    pub seconds: f64,
    /// Seconds from the local commit to the remote one (how far behind the remote is).
    pub lag_s: f64,
    /// Steps committed locally meanwhile, not yet remote (the drain's backlog at its end).
    pub lag_steps: u64,
    /// Older steps this drain skipped (drained newest first when behind).
    pub skipped: Vec<u64>,
}

/// `{"kind":"drain_skipped"}` (events): the drain fell behind and skipped a step for a newer
/// one (it stays local-durable only until local retention drops it).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DrainSkipped {
    /// The step skipped.
    pub step: u64,
    /// The newer step drained instead.
    pub newer: u64,
    /// The draining rank.
    pub rank: u32,
}

/// `{"kind":"drain_failed"}` (events): a drain failed (the remote store down or failing); it is
/// tried again after `retry_in_s`, the newest local step first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DrainFailed {
    /// The step.
    pub step: u64,
    /// The draining rank.
    pub rank: u32,
    /// The error.
    pub error: String,
    /// The error's kind.
    pub error_kind: String,
    /// Seconds until the next try.
    pub retry_in_s: f64,
}

/// `{"kind":"local_tier_damaged"}` (events): a restore found chunks of the local tier missing
/// or damaged and read them from the remote store instead.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LocalTierDamaged {
    /// The step restored.
    pub step: u64,
    /// The rank.
    pub rank: u32,
    /// Chunks read from the remote store instead.
    pub chunks: u64,
    /// The local tier's URL.
    pub local: String,
}
