//! `ckpt-recovery`: the recovery coordinator.
//!
//! - [`coordinator`]: the decision logic as a state machine with no I/O (events in, actions
//!   out), tested with decision tables;
//! - [`heartbeat`]: the rank side and the supervisor side of heartbeats over a local socket;
//! - [`supervisor`]: the local driver behind `ckpt resume`: launches ranks, supervises,
//!   relaunches survivors on a new layout after a failure, keeps the recovery log;
//! - `agent` (feature `etcd`): the driver across machines behind `ckpt agent`: one agent
//!   per machine, membership through etcd leases, one elected coordinator;
//! - [`peer`]: peer replicas: the per-node agent keeping ranks' newest snapshots in memory,
//!   the upload that feeds it from a save, the chunk source a restore asks first;
//! - [`rank_env`]: the environment a driver hands each rank it launches, as one type;
//! - [`records`]: every record of a run's `metrics` and `events` logs as a serde type, shared
//!   by the processes that write them and the ones that read them back;
//! - [`driver`]: what both drivers share (the job's options, launching ranks, the recovery
//!   log, choosing the step to restore);
//! - `executor`: the one executor of the coordinator's actions that both drivers run, each
//!   with its own effects (processes on this machine, or keys on etcd).

#![warn(missing_docs)]

#[cfg(feature = "etcd")]
pub mod agent;
pub mod coordinator;
pub mod driver;
mod executor;
pub mod heartbeat;
pub mod peer;
pub mod rank_env;
pub mod records;
pub mod supervisor;

pub use coordinator::{
    Action, Config, Coordinator, DATA_FAILURE_EXIT, Event, ExitStatus, Record, Topology,
};
pub use driver::JobOptions;
pub use heartbeat::HeartbeatClient;
pub use peer::{PeerLink, PeerSecret, PeerSource, PeerUpload};
pub use rank_env::RankEnv;
pub use supervisor::{Report, RestoreSummary, SupervisorOptions, choose_step, restore_plan, run};
