//! The recovery records of the `events` log ([`super::Event`]; the coordinator's
//! [`crate::Record`]): generations started, failures, unusable steps, recovery decisions,
//! resumes, nodes returned and kept out, growth, takeovers, the end of a job.

use serde::{Deserialize, Serialize};

use super::Event;

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
    /// Seconds from the failure's detection to the moment every rank had restored and
    /// reported the step it resumed from: training began. `since_failure_s` adds the first
    /// step's own time. Absent in logs written before it was recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restored_s: Option<f64>,
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
            Event::ReplicaMismatch(r) => Some(&mut r.generation),
            Event::Finished(_)
            | Event::StateUnchanged(_)
            | Event::DrainSkipped(_)
            | Event::DrainFailed(_)
            | Event::LocalTierDamaged(_)
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
