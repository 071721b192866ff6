//! The coordinator's settings: the nodes and ranks of a job and the timeouts, restarts and
//! failure limits it decides by.

use std::time::Duration;

use ckpt_store::{Layout, MismatchPolicy};
use serde::Serialize;

/// Nodes and ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// Nodes that run ranks at the start.
    pub nodes: u32,
    /// Ranks per node.
    pub ranks_per_node: u32,
    /// Spare nodes, used first to replace failed ones.
    pub spares: u32,
}

/// Settings of the coordinator.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    /// Nodes.
    pub topology: Topology,
    /// The layout to start with.
    pub layout: Layout,
    /// Restarts before giving up.
    pub max_restarts: u32,
    /// A rank with no heartbeat for this long is failed.
    pub heartbeat_timeout: Duration,
    /// A rank whose step has not advanced for this long is hung.
    pub hang_timeout: Duration,
    /// Time a rank has to send its first heartbeat (start-up and restore).
    pub startup_timeout: Duration,
    /// SIGTERM, then SIGKILL after this long.
    pub stop_grace: Duration,
    /// First restart delay; doubles with every restart in a row whose generation failed
    /// within `backoff_max` of its start (a crash loop). A generation that ran at least
    /// `backoff_max` before failing was healthy: the next delay is `backoff` again.
    pub backoff: Duration,
    /// Longest restart delay.
    pub backoff_max: Duration,
    /// A node that fails this many times within `node_failure_window` is kept out for good,
    /// even when it comes back (at least 1).
    pub max_node_failures: u32,
    /// The window of `max_node_failures`.
    pub node_failure_window: Duration,
    /// What the job does when a committed step's replicas disagree (the sentinel): nothing
    /// but the ranks' warning ([`MismatchPolicy::Warn`]), end the job, or roll back keeping
    /// the suspect nodes out.
    pub on_replica_mismatch: MismatchPolicy,
}

impl Config {
    /// Defaults for `topology` and `layout`.
    pub fn new(topology: Topology, layout: Layout) -> Self {
        Config {
            topology,
            layout,
            max_restarts: 3,
            heartbeat_timeout: Duration::from_secs(10),
            hang_timeout: Duration::from_secs(60),
            startup_timeout: Duration::from_secs(120),
            stop_grace: Duration::from_secs(5),
            backoff: Duration::from_millis(200),
            backoff_max: Duration::from_secs(30),
            max_node_failures: 3,
            node_failure_window: Duration::from_secs(600),
            on_replica_mismatch: MismatchPolicy::Warn,
        }
    }
}
