//! What goes into the coordinator and what comes out: the [`Event`]s a driver feeds it, the
//! [`Action`]s it answers with, and what they carry (how a rank ended, where it runs, the
//! recovery log's records).

use std::time::Duration;

use ckpt_store::Layout;
use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::Coordinator;

/// The exit code of a rank that could not restore the step it was given because of the data
/// (an object missing or damaged: `ErrorKind::NotFound` or `Corrupt`), not because of its
/// node. `ckpt-train` exits with it; other programs under `ckpt resume` may too (65 is
/// `EX_DATAERR` of sysexits.h).
pub const DATA_FAILURE_EXIT: i32 = 65;

/// How a rank process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitStatus {
    /// Exited with a code.
    Code(i32),
    /// Killed by a signal.
    Signal(i32),
}

impl ExitStatus {
    /// Exit code 0.
    pub fn success(&self) -> bool {
        matches!(self, ExitStatus::Code(0))
    }
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitStatus::Code(c) => write!(f, "exit code {c}"),
            ExitStatus::Signal(s) => write!(f, "signal {s}"),
        }
    }
}

/// Something the coordinator learns.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Begin (generation 0).
    Start {
        /// Time.
        now: Duration,
    },
    /// Time passes.
    Tick {
        /// Time.
        now: Duration,
    },
    /// A rank reports its progress.
    Heartbeat {
        /// Its generation.
        generation: u64,
        /// The rank.
        rank: u32,
        /// The last step it completed.
        step: u64,
        /// Time.
        now: Duration,
    },
    /// A rank is alive but has no step to report yet (starting, restoring): it beats, so a
    /// rank stopped or gone meanwhile is found by its missed beats; the start-up timeout still
    /// bounds the time to its first step report.
    Alive {
        /// Its generation.
        generation: u64,
        /// The rank.
        rank: u32,
        /// Time.
        now: Duration,
    },
    /// The driver saw a rank's process stopped (SIGSTOP, a terminal's stop, a tracer), or
    /// running again (`stopped: false`). A stopped process sends no beats: one stopped before
    /// its first beat is failed within the heartbeat timeout of the stop, not the start-up
    /// timeout.
    Stopped {
        /// Its generation.
        generation: u64,
        /// The rank.
        rank: u32,
        /// Stopped, or running again.
        stopped: bool,
        /// Time.
        now: Duration,
    },
    /// The driver found a committed step whose data-parallel replicas disagree (the
    /// sentinel; told while [`Coordinator::watching_replicas`] asks).
    ReplicaMismatch {
        /// The generation that committed it.
        generation: u64,
        /// The step.
        step: u64,
        /// The ranks outside a strict majority (empty: none holds one).
        suspects: Vec<u32>,
        /// The first mismatch, for the records.
        detail: String,
        /// Time.
        now: Duration,
    },
    /// A rank process ended.
    Exited {
        /// Its generation.
        generation: u64,
        /// The rank.
        rank: u32,
        /// How.
        status: ExitStatus,
        /// Time.
        now: Duration,
    },
    /// The driver found the newest committed step whose objects are all present.
    StepChosen {
        /// The generation that asked.
        generation: u64,
        /// The step, or `None` when the run has no usable checkpoint.
        step: Option<u64>,
        /// Newer committed steps the driver found damaged (objects missing), with why.
        damaged: Vec<(u64, String)>,
        /// Time.
        now: Duration,
    },
    /// The driver verified a step a rank could not restore ([`Action::CheckStep`]).
    StepChecked {
        /// The generation that asked.
        generation: u64,
        /// The step.
        step: u64,
        /// What is damaged, or `None` when the store's copy verifies clean.
        damage: Option<String>,
        /// Time.
        now: Duration,
    },
    /// A failed node was repaired and is back (the local supervisor's `--repair-after`).
    NodeBack {
        /// The node.
        node: u32,
        /// Time.
        now: Duration,
    },
    /// The newest committed step of the run, as the driver sees it while
    /// [`Coordinator::watching_commits`] asks for it (the first answer too, then whenever it
    /// changes).
    Committed {
        /// The generation that asked.
        generation: u64,
        /// The newest committed step (`None`: none yet).
        step: Option<u64>,
        /// Time.
        now: Duration,
    },
}

/// Where a rank runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// Rank.
    pub rank: u32,
    /// Node.
    pub node: u32,
    /// Rank within the node.
    pub local_rank: u32,
}

/// A record of the recovery log: the coordinator emits the `events` log's recovery records
/// (`started`, `failure`, `step_unusable`, `recovery`, `resumed`, `finished`, `node_returned`,
/// `node_kept_out`, `grow`), the types of
/// [`crate::records`] that the drivers write and the CLI reads back.
pub type Record = crate::records::Event;

/// What the driver must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Launch the ranks of a generation.
    Start {
        /// Generation.
        generation: u64,
        /// Layout.
        layout: Layout,
        /// Where each rank runs.
        assignments: Vec<Assignment>,
        /// The step the ranks restore, exactly (`CKPT_RESUME_STEP`); `None`: the run has no
        /// usable checkpoint.
        resume_from: Option<u64>,
    },
    /// Signal ranks of a generation: SIGTERM, or SIGKILL.
    Signal {
        /// Generation.
        generation: u64,
        /// Ranks.
        ranks: Vec<u32>,
        /// SIGKILL instead of SIGTERM.
        kill: bool,
    },
    /// Find the newest committed step whose chunks are all present, other than `skip`;
    /// answer with [`Event::StepChosen`].
    ChooseStep {
        /// Generation asking.
        generation: u64,
        /// Steps marked unusable: not candidates.
        skip: Vec<u64>,
        /// Only steps before this one are candidates (the later ones come back as damaged,
        /// with why): their replicas disagreed, or they came after such a step.
        below: Option<u64>,
    },
    /// Verify every object of `step` (a rank could not restore it); answer with
    /// [`Event::StepChecked`].
    CheckStep {
        /// Generation asking.
        generation: u64,
        /// The step.
        step: u64,
    },
    /// Take an unusable step out of the committed steps (delete its commit record; its
    /// manifests stay until gc's grace period), so that the job can save it again.
    RetireStep {
        /// The step.
        step: u64,
    },
    /// Append to the recovery log.
    Record(Record),
    /// The job is over.
    Done {
        /// Completed.
        ok: bool,
        /// Why.
        reason: String,
    },
}
