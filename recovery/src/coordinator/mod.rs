//! The recovery coordinator as a state machine with no I/O: events in, actions out.
//!
//! ```text
//!        start     step chosen          failure detected               all stopped
//!   Idle -----> Choosing ---> Running -------------------> Stopping ------------> Choosing
//!                              ^   |  all ranks exited 0       |  after a data failure |
//!                              |   +----------> Done(ok)       +--> Checking ----------+
//!                              |                                    (step verified)    |
//!                              |                                                       v
//!                              +------------------------ Backoff <-------- decide layout, or
//!                                 backoff elapsed: start generation + 1    Done(failed) when
//!                                                                           the survivors cannot
//!                                                                           hold the model or
//!                                                                           restarts are exhausted
//! ```
//!
//! Every generation, the first included, restores the step the coordinator chose
//! ([`Action::Start`]'s `resume_from`, which the driver passes to the ranks as
//! `CKPT_RESUME_STEP`): the newest committed step whose objects are all present and that no
//! rank has found damaged.
//!
//! A rank is failed when it exits abnormally, sends no heartbeat for `heartbeat_timeout`
//! (a stopped or dead process), or makes no step progress for `hang_timeout` (a hang), and
//! its node is excluded. The remaining ranks get SIGTERM, then SIGKILL after `stop_grace`.
//! The new layout keeps tp x pp and uses spare nodes first; otherwise it shrinks dp to what
//! the surviving nodes hold. Restarts back off exponentially.
//!
//! A rank that exits with [`DATA_FAILURE_EXIT`] before its first heartbeat could not restore
//! the chosen step because of the data (an object missing or damaged). That is not a node
//! failure: the job is stopped, the driver verifies the step ([`Action::CheckStep`]), and when
//! the store's copy is damaged the step is marked unusable (a `step_unusable` record), no node
//! is excluded, and the next older intact step is chosen; such restarts do not count against
//! `max_restarts` (each marks one more step unusable, so they end). When the step verifies
//! clean the rank's node is suspect and fails as usual (`how` = `restore`). Steps the driver
//! finds with objects missing while choosing are marked unusable too. Once an older step is
//! chosen, the unusable steps after it are retired ([`Action::RetireStep`]): their commit
//! records go, so the job can save those step numbers again.
//!
//! Nodes come back ([`Event::NodeBack`]: the local supervisor's `--repair-after`): a returned
//! node is usable again, and when the usable nodes hold more data parallelism than the job
//! runs (never more than the configured layout; spares are used first as before), the job
//! grows back at the next checkpoint boundary: the coordinator asks to be told the newest
//! committed step ([`Coordinator::watching_commits`], answered with [`Event::Committed`]),
//! takes the first answer as where things stand, and once a newer step is committed it stops
//! the ranks (SIGTERM, SIGKILL after `stop_grace`), chooses the step as after a failure (the
//! one just committed, so no committed work is lost and no save is cut short) and restarts
//! resharded on more nodes at once, with a `grow` record. A grow is not a restart: no backoff,
//! and it does not count against `max_restarts`. A failure while waiting to grow is recovered
//! as usual, and that restart already uses the returned nodes.
//!
//! A node that fails `max_node_failures` times within `node_failure_window` is kept out for
//! good (a `node_kept_out` record naming it and its failure times): it is never used again,
//! even when it comes back.
//!
//! Time is a `Duration` since the supervisor started, passed in with every event, so tests
//! replay any schedule exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use ckpt_store::Layout;
use ckpt_store::records;
use serde::{Deserialize, Serialize};

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
        }
    }
}

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
/// [`ckpt_store::records`] that the drivers write and the CLI reads back.
pub type Record = ckpt_store::records::Event;

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

/// What a coordinator taking over from a lost one knows about the generation it inherits (an
/// agent elected after the previous coordinator's node died; see `agent`). See
/// [`Coordinator::take_over`].
#[derive(Debug, Clone)]
pub struct TakeOver {
    /// The generation running (or being stopped).
    pub generation: u64,
    /// Its layout.
    pub layout: Layout,
    /// Where its ranks run.
    pub assignments: Vec<Assignment>,
    /// Nodes the previous coordinator had excluded.
    pub excluded: BTreeSet<u32>,
    /// Restarts the previous coordinator had made.
    pub restarts: u32,
    /// The highest step any rank reported (for the steps lost).
    pub max_step: u64,
    /// The previous coordinator had begun stopping the generation (after a failure it
    /// recorded, or at the end).
    pub stopping: bool,
    /// ... and had already sent SIGKILL.
    pub killed: bool,
    /// Ranks of the generation known to have ended, and how.
    pub exited: BTreeMap<u32, ExitStatus>,
    /// Nodes found lost (their agent is gone), with why; their ranks are gone too.
    pub lost_nodes: BTreeMap<u32, String>,
}

#[derive(Debug, Clone)]
struct RankState {
    node: u32,
    started: Duration,
    last_beat: Option<Duration>,
    last_step: Option<u64>,
    last_progress: Duration,
    exited: Option<ExitStatus>,
}

impl RankState {
    /// A rank started on `node` at `now`, with no beat yet.
    fn started(node: u32, now: Duration, exited: Option<ExitStatus>) -> Self {
        RankState {
            node,
            started: now,
            last_beat: None,
            last_step: None,
            last_progress: now,
            exited,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    Idle,
    Running,
    Stopping {
        kill_at: Duration,
        killed: bool,
    },
    /// Waiting for [`Event::StepChosen`]; `first`: for the first generation.
    Choosing {
        first: bool,
    },
    /// Waiting for [`Event::StepChecked`].
    Checking,
    Backoff {
        until: Duration,
        step: Option<u64>,
    },
    Done,
}

/// The coordinator (see the module docs).
#[derive(Debug)]
pub struct Coordinator {
    cfg: Config,
    phase: Phase,
    generation: u64,
    layout: Layout,
    ranks: BTreeMap<u32, RankState>,
    excluded: BTreeSet<u32>,
    restarts: u32,
    max_step: u64,
    failed_at: Option<Duration>,
    resume_from: Option<u64>,
    resumed_reported: bool,
    /// Restarts after node failures (what `max_restarts` bounds).
    node_restarts: u32,
    /// Restarts in a row whose generation failed within `backoff_max` of its start (the
    /// backoff's exponent).
    backoff_streak: u32,
    /// When the running generation started.
    generation_started: Duration,
    /// The stop under way is for a data failure: (rank, step it could not restore).
    data_failure: Option<(u32, u64)>,
    /// The stop under way also saw a node failure.
    node_failed: bool,
    /// Steps marked unusable.
    unusable: BTreeSet<u64>,
    /// Unusable steps already retired.
    retired: BTreeSet<u64>,
    /// When each node failed, within `node_failure_window` of its latest failure.
    node_failures: BTreeMap<u32, Vec<Duration>>,
    /// Nodes kept out for good (they failed too often).
    kept_out: BTreeSet<u32>,
    /// Nodes that came back since the last layout decision.
    returned: BTreeSet<u32>,
    /// Waiting for a commit to grow at: `Some(None)` before the driver's first answer,
    /// `Some(Some(c))` once it said the newest committed step is `c` (`None` inside: no step).
    grow_wait: Option<Option<Option<u64>>>,
    /// The stop under way is a grow's.
    growing: bool,
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

impl Coordinator {
    /// A coordinator that has not started.
    pub fn new(cfg: Config) -> Self {
        Coordinator {
            layout: cfg.layout,
            cfg,
            phase: Phase::Idle,
            generation: 0,
            ranks: BTreeMap::new(),
            excluded: BTreeSet::new(),
            restarts: 0,
            max_step: 0,
            failed_at: None,
            resume_from: None,
            resumed_reported: true,
            node_restarts: 0,
            backoff_streak: 0,
            generation_started: Duration::ZERO,
            data_failure: None,
            node_failed: false,
            unusable: BTreeSet::new(),
            retired: BTreeSet::new(),
            node_failures: BTreeMap::new(),
            kept_out: BTreeSet::new(),
            returned: BTreeSet::new(),
            grow_wait: None,
            growing: false,
        }
    }

    /// The current generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The current layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Restarts so far.
    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    /// Whether the job is over.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// Ranks of the current generation that have not exited.
    pub fn live_ranks(&self) -> Vec<u32> {
        self.ranks
            .iter()
            .filter(|(_, r)| r.exited.is_none())
            .map(|(k, _)| *k)
            .collect()
    }

    /// Nodes excluded after failures, in order.
    pub fn excluded(&self) -> Vec<u32> {
        self.excluded.iter().copied().collect()
    }

    /// Whether `node` failed too often and is kept out for good.
    pub fn is_kept_out(&self, node: u32) -> bool {
        self.kept_out.contains(&node)
    }

    /// The generation waiting for a commit to grow at: the driver should send
    /// [`Event::Committed`] with the newest committed step now, and again whenever it changes.
    pub fn watching_commits(&self) -> Option<u64> {
        (self.grow_wait.is_some() && self.phase == Phase::Running).then_some(self.generation)
    }

    /// A coordinator that carries on from a lost one, at the generation it ran (see
    /// [`TakeOver`]), with the actions to take now:
    ///
    /// - every rank of the generation ended with success: the job is done;
    /// - a lost node ran ranks of the generation, or a rank ended abnormally and the previous
    ///   coordinator had not begun stopping: each such node is failed (a `failure` record with
    ///   `how` = `node`, or `exit`/`signal`) and excluded, and the job stops and restarts from
    ///   the newest committed step on a new generation, as after any failure;
    /// - the previous coordinator had begun stopping: stopping goes on (SIGTERM again, SIGKILL
    ///   after the grace period), then the step is chosen and the job restarts;
    /// - otherwise nothing is lost: the ranks keep running under the new coordinator.
    ///
    /// Lost nodes that ran no rank of the generation are excluded without a record.
    pub fn take_over(cfg: Config, t: TakeOver, now: Duration) -> (Self, Vec<Action>) {
        let mut c = Coordinator::new(cfg);
        c.generation = t.generation;
        c.layout = t.layout;
        c.excluded = t.excluded;
        c.restarts = t.restarts;
        c.node_restarts = t.restarts;
        c.backoff_streak = t.restarts;
        c.generation_started = now;
        c.max_step = t.max_step;
        c.phase = Phase::Running;
        c.ranks = t
            .assignments
            .iter()
            .map(|a| {
                (
                    a.rank,
                    RankState::started(a.node, now, t.exited.get(&a.rank).copied()),
                )
            })
            .collect();
        if !t.stopping
            && !c.ranks.is_empty()
            && c.ranks
                .values()
                .all(|r| r.exited.is_some_and(|s| s.success()))
        {
            let out = c.finish(now, true, "every rank finished".into());
            return (c, out);
        }
        // One failure per node: the first rank found on it.
        let mut failed: BTreeMap<u32, (u32, &'static str, String)> = BTreeMap::new();
        for (&rank, r) in c.ranks.iter_mut() {
            if let Some(why) = t.lost_nodes.get(&r.node) {
                if r.exited.is_none() {
                    r.exited = Some(ExitStatus::Signal(9));
                    failed.entry(r.node).or_insert((
                        rank,
                        "node",
                        format!("node {} was lost: {why}", r.node),
                    ));
                }
            } else if !t.stopping
                && let Some(st) = r.exited.filter(|s| !s.success())
            {
                let how = match st {
                    ExitStatus::Signal(_) => "signal",
                    ExitStatus::Code(_) => "exit",
                };
                failed
                    .entry(r.node)
                    .or_insert((rank, how, format!("rank {rank} ended with {st}")));
            }
        }
        c.excluded.extend(t.lost_nodes.keys().copied());
        if failed.is_empty() && !t.stopping {
            return (c, vec![]);
        }
        let mut out = Vec::new();
        for (node, (rank, how, detail)) in failed {
            out.push(Action::Record(Record::Failure(records::Failure {
                generation: c.generation,
                rank,
                node,
                how: how.into(),
                detail,
                last_step: None,
                detection_s: 0.0,
                at_ms: ms(now),
            })));
            out.extend(c.node_failed_at(node, now));
        }
        c.failed_at = Some(now);
        c.node_failed = true;
        c.phase = Phase::Stopping {
            kill_at: now + c.cfg.stop_grace,
            killed: t.killed,
        };
        let live = c.live_ranks();
        if !live.is_empty() {
            out.push(Action::Signal {
                generation: c.generation,
                ranks: live,
                kill: t.killed,
            });
        }
        out.extend(c.maybe_all_stopped(now));
        (c, out)
    }

    /// Nodes not excluded, in order (spares last).
    fn usable_nodes(&self) -> Vec<u32> {
        let t = self.cfg.topology;
        (0..t.nodes + t.spares)
            .filter(|n| !self.excluded.contains(n) && !self.kept_out.contains(n))
            .collect()
    }

    /// `node` failed at `now`: it is excluded, and kept out for good (with a `node_kept_out`
    /// record) once it has failed `max_node_failures` times within `node_failure_window`.
    fn node_failed_at(&mut self, node: u32, now: Duration) -> Vec<Action> {
        self.excluded.insert(node);
        self.returned.remove(&node);
        let window = self.cfg.node_failure_window;
        let times = self.node_failures.entry(node).or_default();
        times.push(now);
        times.retain(|t| now.saturating_sub(*t) <= window);
        let n = times.len() as u32;
        if n < self.cfg.max_node_failures.max(1) || !self.kept_out.insert(node) {
            return vec![];
        }
        let failures_ms: Vec<u64> = times.iter().map(|t| ms(*t)).collect();
        vec![Action::Record(Record::NodeKeptOut(records::NodeKeptOut {
            node,
            reason: format!(
                "node {node} failed {n} times within {} s (at {} ms): it is kept out for good, \
                 even when it comes back",
                window.as_secs_f64(),
                failures_ms
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            failures_ms,
            window_s: window.as_secs_f64(),
            at_ms: ms(now),
        }))]
    }

    /// A failed node is back: usable again unless it is kept out; a running job then waits for
    /// the next commit to grow at, when the usable nodes hold more than it runs.
    fn on_node_back(&mut self, node: u32, now: Duration) -> Vec<Action> {
        if self.phase == Phase::Done || !self.excluded.contains(&node) {
            return vec![];
        }
        let usable = !self.kept_out.contains(&node);
        if usable {
            self.excluded.remove(&node);
            self.returned.insert(node);
            self.maybe_wait_to_grow();
        }
        vec![Action::Record(Record::NodeReturned(
            records::NodeReturned {
                node,
                usable,
                at_ms: ms(now),
            },
        ))]
    }

    /// While running, wait for a commit to grow at if the usable nodes hold a larger layout.
    fn maybe_wait_to_grow(&mut self) {
        if self.phase == Phase::Running
            && self.grow_wait.is_none()
            && self
                .next_layout()
                .is_ok_and(|l| l.world() > self.layout.world())
        {
            self.grow_wait = Some(None);
        }
    }

    /// The driver says the newest committed step is `step`: the first answer is where things
    /// stand; a newer step is the boundary to grow at.
    fn on_committed(&mut self, step: Option<u64>, now: Duration) -> Vec<Action> {
        match self.grow_wait {
            Some(None) => {
                self.grow_wait = Some(Some(step));
                vec![]
            }
            Some(Some(seen)) if step > seen => self.stop_for_grow(now),
            _ => vec![],
        }
    }

    /// A step was committed after nodes came back: stop the ranks, to restart on more nodes
    /// from the newest committed step.
    fn stop_for_grow(&mut self, now: Duration) -> Vec<Action> {
        self.grow_wait = None;
        self.growing = true;
        self.failed_at = Some(now);
        let live = self.live_ranks();
        self.phase = Phase::Stopping {
            kill_at: now + self.cfg.stop_grace,
            killed: false,
        };
        let mut out = Vec::new();
        if !live.is_empty() {
            out.push(Action::Signal {
                generation: self.generation,
                ranks: live,
                kill: false,
            });
        }
        out.extend(self.maybe_all_stopped(now));
        out
    }

    /// Restart after a grow's stop, on the larger layout, at once.
    fn grow(&mut self, step: Option<u64>, now: Duration) -> Vec<Action> {
        let from = self.layout;
        let layout = match self.next_layout() {
            Ok(l) => l,
            Err(why) => return self.finish(now, false, format!("cannot restart: {why}")),
        };
        self.layout = layout;
        let returned: Vec<u32> = std::mem::take(&mut self.returned).into_iter().collect();
        let rpn = self.cfg.topology.ranks_per_node;
        let nodes: Vec<u32> = self
            .usable_nodes()
            .into_iter()
            .take(layout.world().div_ceil(rpn) as usize)
            .collect();
        let steps_lost = step.map_or(self.max_step, |s| self.max_step.saturating_sub(s));
        let mut out = vec![Action::Record(Record::Grow(records::Grow {
            generation: self.generation,
            from_layout: from.to_string(),
            layout: layout.to_string(),
            nodes,
            returned: returned.clone(),
            step,
            steps_lost,
            reason: format!(
                "node(s) {returned:?} came back: dp {} -> {} (configured {}), restarting from {} \
                 committed after their return",
                from.dp,
                layout.dp,
                self.cfg.layout.dp,
                step.map_or("scratch".to_string(), |s| format!("step {s}"))
            ),
            at_ms: ms(now),
        }))];
        self.generation += 1;
        self.resumed_reported = false;
        out.extend(self.start_generation(now, step));
        out
    }

    fn assign(&self, layout: &Layout, nodes: &[u32]) -> Vec<Assignment> {
        let rpn = self.cfg.topology.ranks_per_node;
        (0..layout.world())
            .map(|rank| Assignment {
                rank,
                node: nodes[(rank / rpn) as usize],
                local_rank: rank % rpn,
            })
            .collect()
    }

    fn start_generation(&mut self, now: Duration, resume_from: Option<u64>) -> Vec<Action> {
        let rpn = self.cfg.topology.ranks_per_node;
        let needed = self.layout.world().div_ceil(rpn) as usize;
        let nodes: Vec<u32> = self.usable_nodes().into_iter().take(needed).collect();
        let assignments = self.assign(&self.layout, &nodes);
        self.ranks = assignments
            .iter()
            .map(|a| (a.rank, RankState::started(a.node, now, None)))
            .collect();
        self.phase = Phase::Running;
        self.generation_started = now;
        self.resume_from = resume_from;
        self.grow_wait = None;
        self.maybe_wait_to_grow();
        vec![
            Action::Record(Record::Started(records::Started {
                generation: self.generation,
                layout: self.layout.to_string(),
                nodes: nodes.clone(),
                resume_from,
                at_ms: ms(now),
            })),
            Action::Start {
                generation: self.generation,
                layout: self.layout,
                assignments,
                resume_from,
            },
        ]
    }

    /// Feed one event; returns what to do.
    pub fn on_event(&mut self, ev: Event) -> Vec<Action> {
        match ev {
            Event::Start { now } => {
                if self.phase != Phase::Idle {
                    return vec![];
                }
                let t = self.cfg.topology;
                if self.layout.world() > t.nodes * t.ranks_per_node {
                    return self.finish(
                        now,
                        false,
                        format!(
                            "the layout {} needs {} ranks but {} nodes x {} ranks per node give {}",
                            self.layout,
                            self.layout.world(),
                            t.nodes,
                            t.ranks_per_node,
                            t.nodes * t.ranks_per_node
                        ),
                    );
                }
                // The first generation restores what the driver chooses, like every other.
                self.phase = Phase::Choosing { first: true };
                vec![Action::ChooseStep {
                    generation: self.generation,
                    skip: vec![],
                }]
            }
            Event::Heartbeat {
                generation,
                rank,
                step,
                now,
            } => {
                if generation != self.generation {
                    return vec![];
                }
                let mut out = vec![];
                if let Some(r) = self.ranks.get_mut(&rank) {
                    r.last_beat = Some(now);
                    if r.last_step.is_none_or(|s| step > s) {
                        r.last_step = Some(step);
                        r.last_progress = now;
                    }
                    self.max_step = self.max_step.max(step);
                    if !self.resumed_reported && self.resume_from.is_none_or(|s| step > s) {
                        self.resumed_reported = true;
                        out.push(Action::Record(Record::Resumed(records::Resumed {
                            generation,
                            step,
                            since_failure_s: self
                                .failed_at
                                .map_or(0.0, |f| (now.saturating_sub(f)).as_secs_f64()),
                            at_ms: ms(now),
                        })));
                    }
                }
                out
            }
            Event::Exited {
                generation,
                rank,
                status,
                now,
            } => self.on_exit(generation, rank, status, now),
            Event::Tick { now } => self.on_tick(now),
            Event::StepChosen {
                generation,
                step,
                damaged,
                now,
            } => {
                let Phase::Choosing { first } = self.phase else {
                    return vec![];
                };
                if generation != self.generation {
                    return vec![];
                }
                self.on_chosen(first, step, damaged, now)
            }
            Event::StepChecked {
                generation,
                step,
                damage,
                now,
            } => {
                if generation != self.generation || self.phase != Phase::Checking {
                    return vec![];
                }
                self.on_checked(step, damage, now)
            }
            Event::NodeBack { node, now } => self.on_node_back(node, now),
            Event::Committed {
                generation,
                step,
                now,
            } => {
                if generation != self.generation || self.phase != Phase::Running {
                    return vec![];
                }
                self.on_committed(step, now)
            }
        }
    }

    /// The driver chose `step`: mark the damaged steps it found unusable, retire those after
    /// the chosen step, and start (the first generation) or restart.
    fn on_chosen(
        &mut self,
        first: bool,
        step: Option<u64>,
        damaged: Vec<(u64, String)>,
        now: Duration,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        for (s, why) in damaged {
            if self.unusable.insert(s) {
                out.push(Action::Record(Record::StepUnusable(
                    records::StepUnusable {
                        generation: self.generation,
                        step: s,
                        rank: None,
                        why,
                        at_ms: ms(now),
                    },
                )));
            }
        }
        match step {
            None if !self.unusable.is_empty() => {
                let steps: Vec<String> = self.unusable.iter().map(u64::to_string).collect();
                out.extend(self.finish(
                    now,
                    false,
                    format!(
                        "no intact checkpoint to resume from: step(s) {} are damaged (see the step_unusable records) \
                         and no older committed step is intact; `ckpt verify` shows what is damaged",
                        steps.join(", ")
                    ),
                ));
                return out;
            }
            None => {}
            Some(s) => {
                let newer: Vec<u64> = self
                    .unusable
                    .range(s + 1..)
                    .filter(|u| !self.retired.contains(u))
                    .copied()
                    .collect();
                for u in newer {
                    self.retired.insert(u);
                    out.push(Action::RetireStep { step: u });
                }
            }
        }
        if first {
            out.extend(self.start_generation(now, step));
        } else {
            out.extend(self.decide(step, now));
        }
        out
    }

    /// The driver verified the step a rank could not restore.
    fn on_checked(&mut self, step: u64, damage: Option<String>, now: Duration) -> Vec<Action> {
        let rank = self.data_failure.take().map(|(r, _)| r);
        let mut out = Vec::new();
        match damage {
            Some(why) => {
                self.unusable.insert(step);
                out.push(Action::Record(Record::StepUnusable(
                    records::StepUnusable {
                        generation: self.generation,
                        step,
                        rank,
                        why,
                        at_ms: ms(now),
                    },
                )));
            }
            None => {
                // The store's copy is intact: what the rank read was not. Its node is suspect.
                if let Some(rank) = rank
                    && let Some(r) = self.ranks.get(&rank)
                {
                    let node = r.node;
                    self.node_failed = true;
                    out.push(Action::Record(Record::Failure(records::Failure {
                        generation: self.generation,
                        rank,
                        node,
                        how: "restore".into(),
                        detail: format!(
                            "rank {rank} could not restore step {step} (exit code {DATA_FAILURE_EXIT}: data missing or damaged), \
                             but the store's copy of step {step} verifies clean: node {node} is suspect"
                        ),
                        last_step: None,
                        detection_s: 0.0,
                        at_ms: ms(now),
                    })));
                    out.extend(self.node_failed_at(node, now));
                }
            }
        }
        out.extend(self.choose());
        out
    }

    /// Ask the driver for the step to restore, skipping the unusable ones.
    fn choose(&mut self) -> Vec<Action> {
        self.phase = Phase::Choosing { first: false };
        vec![Action::ChooseStep {
            generation: self.generation,
            skip: self.unusable.iter().copied().collect(),
        }]
    }

    fn on_exit(
        &mut self,
        generation: u64,
        rank: u32,
        status: ExitStatus,
        now: Duration,
    ) -> Vec<Action> {
        if generation != self.generation {
            return vec![];
        }
        let Some(r) = self.ranks.get_mut(&rank) else {
            return vec![];
        };
        if r.exited.is_some() {
            return vec![];
        }
        r.exited = Some(status);
        match self.phase.clone() {
            Phase::Running => {
                if status.success() {
                    if self
                        .ranks
                        .values()
                        .all(|r| r.exited.is_some_and(|s| s.success()))
                    {
                        return self.finish(now, true, "every rank finished".into());
                    }
                    return vec![];
                }
                // Before its first heartbeat the rank was restoring: a data failure is about
                // the step it was given, not its node.
                if status == ExitStatus::Code(DATA_FAILURE_EXIT)
                    && self.ranks[&rank].last_beat.is_none()
                    && let Some(step) = self.resume_from
                {
                    return self.stop_for_data(rank, step, now);
                }
                let how = match status {
                    ExitStatus::Signal(_) => "signal",
                    ExitStatus::Code(_) => "exit",
                };
                self.fail(
                    rank,
                    how,
                    format!("rank {rank} ended with {status}"),
                    0.0,
                    now,
                )
            }
            Phase::Stopping { killed, .. } => {
                // SIGKILL we did not send is a second failure (its node died too).
                if status == ExitStatus::Signal(9) && !killed {
                    let node = self.ranks[&rank].node;
                    self.node_failed = true;
                    let mut out = vec![Action::Record(Record::Failure(records::Failure {
                        generation,
                        rank,
                        node,
                        how: "signal".into(),
                        detail: format!("rank {rank} was killed while the job was stopping"),
                        last_step: self.ranks[&rank].last_step,
                        detection_s: 0.0,
                        at_ms: ms(now),
                    }))];
                    out.extend(self.node_failed_at(node, now));
                    out.extend(self.maybe_all_stopped(now));
                    return out;
                }
                self.maybe_all_stopped(now)
            }
            _ => vec![],
        }
    }

    fn on_tick(&mut self, now: Duration) -> Vec<Action> {
        match self.phase.clone() {
            Phase::Running => {
                let cfg = &self.cfg;
                let mut found: Option<(u32, &'static str, String, f64)> = None;
                for (&rank, r) in &self.ranks {
                    if r.exited.is_some() {
                        continue;
                    }
                    match r.last_beat {
                        None if now.saturating_sub(r.started) > cfg.startup_timeout => {
                            found = Some((
                                rank,
                                "startup",
                                format!(
                                    "rank {rank} sent no heartbeat within {:?} of starting",
                                    cfg.startup_timeout
                                ),
                                now.saturating_sub(r.started).as_secs_f64(),
                            ));
                        }
                        Some(b) if now.saturating_sub(b) > cfg.heartbeat_timeout => {
                            found = Some((
                                rank,
                                "heartbeat",
                                format!(
                                    "rank {rank} missed its heartbeats for {:.1} s (stopped or unreachable)",
                                    now.saturating_sub(b).as_secs_f64()
                                ),
                                now.saturating_sub(b).as_secs_f64(),
                            ));
                        }
                        Some(_) if now.saturating_sub(r.last_progress) > cfg.hang_timeout => {
                            found = Some((
                                rank,
                                "hang",
                                format!(
                                    "rank {rank} made no step progress for {:.1} s (last step {:?})",
                                    now.saturating_sub(r.last_progress).as_secs_f64(),
                                    r.last_step
                                ),
                                now.saturating_sub(r.last_progress).as_secs_f64(),
                            ));
                        }
                        _ => {}
                    }
                    if found.is_some() {
                        break;
                    }
                }
                match found {
                    Some((rank, how, detail, since)) => self.fail(rank, how, detail, since, now),
                    None => vec![],
                }
            }
            Phase::Stopping { kill_at, killed } if !killed && now >= kill_at => {
                self.phase = Phase::Stopping {
                    kill_at,
                    killed: true,
                };
                let live = self.live_ranks();
                if live.is_empty() {
                    return self.maybe_all_stopped(now);
                }
                vec![Action::Signal {
                    generation: self.generation,
                    ranks: live,
                    kill: true,
                }]
            }
            Phase::Backoff { until, step } if now >= until => {
                self.generation += 1;
                self.resumed_reported = false;
                self.start_generation(now, step)
            }
            _ => vec![],
        }
    }

    /// Rank `rank` could not restore `step` because of the data: stop the others, excluding
    /// no node; the step is verified once all have stopped.
    fn stop_for_data(&mut self, rank: u32, step: u64, now: Duration) -> Vec<Action> {
        self.grow_wait = None;
        self.data_failure = Some((rank, step));
        self.failed_at = Some(now);
        let live = self.live_ranks();
        self.phase = Phase::Stopping {
            kill_at: now + self.cfg.stop_grace,
            killed: false,
        };
        let mut out = Vec::new();
        if !live.is_empty() {
            out.push(Action::Signal {
                generation: self.generation,
                ranks: live,
                kill: false,
            });
        }
        out.extend(self.maybe_all_stopped(now));
        out
    }

    fn fail(
        &mut self,
        rank: u32,
        how: &str,
        detail: String,
        detection_s: f64,
        now: Duration,
    ) -> Vec<Action> {
        let node = self.ranks[&rank].node;
        self.grow_wait = None;
        self.failed_at = Some(now);
        self.node_failed = true;
        let mut out = vec![Action::Record(Record::Failure(records::Failure {
            generation: self.generation,
            rank,
            node,
            how: how.into(),
            detail,
            last_step: self.ranks[&rank].last_step,
            detection_s,
            at_ms: ms(now),
        }))];
        out.extend(self.node_failed_at(node, now));
        // A hung or silent rank is still alive: it is stopped with the others.
        let live = self.live_ranks();
        self.phase = Phase::Stopping {
            kill_at: now + self.cfg.stop_grace,
            killed: false,
        };
        if !live.is_empty() {
            out.push(Action::Signal {
                generation: self.generation,
                ranks: live,
                kill: false,
            });
        }
        out.extend(self.maybe_all_stopped(now));
        out
    }

    fn maybe_all_stopped(&mut self, _now: Duration) -> Vec<Action> {
        if !matches!(self.phase, Phase::Stopping { .. }) || !self.live_ranks().is_empty() {
            return vec![];
        }
        if let Some((_, step)) = self.data_failure {
            self.phase = Phase::Checking;
            return vec![Action::CheckStep {
                generation: self.generation,
                step,
            }];
        }
        self.choose()
    }

    /// The layout to restart with: the configured data parallelism when the usable nodes hold
    /// it (spares first), else as much of it as they hold (dp shrunk after failures, grown back
    /// when nodes return, never past the configured layout); `Err` says why none works.
    pub fn next_layout(&self) -> Result<Layout, String> {
        let t = self.cfg.topology;
        let usable = self.usable_nodes().len() as u32;
        let capacity = usable * t.ranks_per_node;
        let cur = self.layout;
        let mp = cur.tp * cur.pp;
        let dp = (capacity / mp).min(self.cfg.layout.dp.max(cur.dp));
        if dp == 0 {
            return Err(format!(
                "the {usable} usable nodes hold {capacity} ranks but one model replica needs tp x pp = {} x {} = {mp}; \
                 add nodes (--spares), or restart with a smaller tp or pp (e.g. --layout dp=1,tp={},pp=1 if the model fits)",
                cur.tp,
                cur.pp,
                capacity.max(1).min(cur.tp)
            ));
        }
        Ok(Layout { dp, ..cur })
    }

    fn decide(&mut self, step: Option<u64>, now: Duration) -> Vec<Action> {
        let node_failed = std::mem::take(&mut self.node_failed);
        if std::mem::take(&mut self.growing) && !node_failed {
            return self.grow(step, now);
        }
        self.returned.clear();
        self.restarts += 1;
        // A restart after a data failure alone marked one more step unusable: it does not
        // count against the budget (there are only so many steps).
        if node_failed {
            self.node_restarts += 1;
        }
        if self.node_restarts > self.cfg.max_restarts {
            return self.finish(
                now,
                false,
                format!(
                    "gave up after {} restarts (--max-restarts {})",
                    self.cfg.max_restarts, self.cfg.max_restarts
                ),
            );
        }
        let layout = match self.next_layout() {
            Ok(l) => l,
            Err(why) => return self.finish(now, false, format!("cannot restart: {why}")),
        };
        self.layout = layout;
        // A long job's occasional failure does not pay for every earlier one: only a crash
        // loop (generations failing within the longest delay of their start) keeps doubling.
        let ran = self
            .failed_at
            .unwrap_or(now)
            .saturating_sub(self.generation_started);
        if ran >= self.cfg.backoff_max {
            self.backoff_streak = 0;
        }
        self.backoff_streak += 1;
        let exp = self.backoff_streak.saturating_sub(1).min(16);
        let backoff = (self.cfg.backoff * 2u32.pow(exp)).min(self.cfg.backoff_max);
        let steps_lost = step.map_or(self.max_step, |s| self.max_step.saturating_sub(s));
        self.phase = Phase::Backoff {
            until: now + backoff,
            step,
        };
        vec![Action::Record(Record::Recovery(records::Recovery {
            generation: self.generation,
            nodes: self.usable_nodes(),
            layout: layout.to_string(),
            step,
            steps_lost,
            backoff_s: backoff.as_secs_f64(),
            at_ms: ms(now),
            plan: None,
        }))]
    }

    fn finish(&mut self, now: Duration, ok: bool, reason: String) -> Vec<Action> {
        self.phase = Phase::Done;
        let mut out = vec![Action::Record(Record::Finished(records::Finished {
            ok,
            reason: reason.clone(),
            restarts: self.restarts,
            at_ms: ms(now),
        }))];
        let live = self.live_ranks();
        if !live.is_empty() {
            out.push(Action::Signal {
                generation: self.generation,
                ranks: live,
                kill: true,
            });
        }
        out.push(Action::Done { ok, reason });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(nodes: u32, spares: u32, layout: &str) -> Config {
        let mut c = Config::new(
            Topology {
                nodes,
                ranks_per_node: 1,
                spares,
            },
            layout.parse().unwrap(),
        );
        c.stop_grace = Duration::from_millis(500);
        c.backoff = Duration::from_millis(100);
        c
    }

    fn inherited(layout: &str, nodes: &[u32]) -> TakeOver {
        TakeOver {
            generation: 5,
            layout: layout.parse().unwrap(),
            assignments: nodes
                .iter()
                .enumerate()
                .map(|(r, &node)| Assignment {
                    rank: r as u32,
                    node,
                    local_rank: 0,
                })
                .collect(),
            excluded: BTreeSet::new(),
            restarts: 1,
            max_step: 12,
            stopping: false,
            killed: false,
            exited: BTreeMap::new(),
            lost_nodes: BTreeMap::new(),
        }
    }

    fn ms(t: u64) -> Duration {
        Duration::from_millis(t)
    }

    #[test]
    fn the_lost_coordinators_node_is_failed_and_the_job_restarts_without_it() {
        let mut t = inherited("dp=3", &[0, 1, 2]);
        t.lost_nodes.insert(1, "it ran the coordinator".into());
        let (mut c, out) = Coordinator::take_over(cfg(3, 0, "dp=3"), t, ms(0));
        assert!(matches!(
            &out[0],
            Action::Record(Record::Failure(records::Failure { generation: 5, rank: 1, node: 1, how, .. })) if how == "node"
        ));
        assert_eq!(
            out[1],
            Action::Signal {
                generation: 5,
                ranks: vec![0, 2],
                kill: false
            }
        );
        assert_eq!(out.len(), 2);
        assert!(
            c.on_event(Event::Exited {
                generation: 5,
                rank: 0,
                status: ExitStatus::Signal(15),
                now: ms(10)
            })
            .is_empty()
        );
        let out = c.on_event(Event::Exited {
            generation: 5,
            rank: 2,
            status: ExitStatus::Signal(15),
            now: ms(20),
        });
        assert_eq!(
            out,
            vec![Action::ChooseStep {
                generation: 5,
                skip: vec![]
            }]
        );
        let out = c.on_event(Event::StepChosen {
            generation: 5,
            step: Some(8),
            damaged: vec![],
            now: ms(30),
        });
        assert!(matches!(
            &out[0],
            Action::Record(Record::Recovery(records::Recovery { layout, step: Some(8), steps_lost: 4, .. }))
                if layout == "dp=2,tp=1,pp=1"
        ));
        assert_eq!(c.restarts(), 2);
        let out = c.on_event(Event::Tick { now: ms(300) });
        assert!(matches!(
            &out[1],
            Action::Start { generation: 6, assignments, resume_from: Some(8), .. }
                if assignments.iter().map(|a| a.node).collect::<Vec<_>>() == [0, 2]
        ));
        assert_eq!(c.excluded(), vec![1]);
    }

    #[test]
    fn a_coordinator_lost_on_a_node_without_ranks_changes_nothing() {
        let mut t = inherited("dp=2", &[0, 1]);
        t.lost_nodes.insert(2, "it ran the coordinator".into());
        let (mut c, out) = Coordinator::take_over(cfg(2, 1, "dp=2"), t, ms(0));
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(c.excluded(), vec![2]);
        assert_eq!(c.live_ranks(), vec![0, 1]);
        // The ranks carry on and finish under the new coordinator.
        for r in 0..2 {
            let out = c.on_event(Event::Exited {
                generation: 5,
                rank: r,
                status: ExitStatus::Code(0),
                now: ms(100),
            });
            if r == 1 {
                assert_eq!(
                    out.last(),
                    Some(&Action::Done {
                        ok: true,
                        reason: "every rank finished".into()
                    })
                );
            }
        }
    }

    #[test]
    fn stopping_goes_on_where_the_previous_coordinator_left_it() {
        // It had sent SIGKILL: exits with signal 9 are not new failures.
        let mut t = inherited("dp=3", &[0, 1, 2]);
        t.stopping = true;
        t.killed = true;
        t.excluded.insert(2);
        t.exited.insert(2, ExitStatus::Signal(9));
        let (mut c, out) = Coordinator::take_over(cfg(3, 0, "dp=3"), t, ms(0));
        assert_eq!(
            out,
            vec![Action::Signal {
                generation: 5,
                ranks: vec![0, 1],
                kill: true
            }]
        );
        assert!(
            c.on_event(Event::Exited {
                generation: 5,
                rank: 0,
                status: ExitStatus::Signal(9),
                now: ms(5)
            })
            .is_empty()
        );
        let out = c.on_event(Event::Exited {
            generation: 5,
            rank: 1,
            status: ExitStatus::Signal(9),
            now: ms(6),
        });
        assert_eq!(
            out,
            vec![Action::ChooseStep {
                generation: 5,
                skip: vec![]
            }]
        );
        assert_eq!(c.excluded(), vec![2]);
    }

    #[test]
    fn an_unrecorded_abnormal_exit_is_a_failure_and_a_finished_job_is_done() {
        let mut t = inherited("dp=2", &[0, 1]);
        t.exited.insert(1, ExitStatus::Code(3));
        let (_, out) = Coordinator::take_over(cfg(2, 1, "dp=2"), t, ms(0));
        assert!(matches!(
            &out[0],
            Action::Record(Record::Failure(records::Failure { rank: 1, node: 1, how, .. })) if how == "exit"
        ));
        let mut t = inherited("dp=2", &[0, 1]);
        t.exited.insert(0, ExitStatus::Code(0));
        t.exited.insert(1, ExitStatus::Code(0));
        let (c, out) = Coordinator::take_over(cfg(2, 0, "dp=2"), t, ms(0));
        assert!(c.is_done());
        assert_eq!(
            out.last(),
            Some(&Action::Done {
                ok: true,
                reason: "every rank finished".into()
            })
        );
    }

    /// The first generation, started from `step`.
    fn started(c: &mut Coordinator, step: Option<u64>) -> Vec<Action> {
        assert_eq!(
            c.on_event(Event::Start { now: ms(0) }),
            vec![Action::ChooseStep {
                generation: 0,
                skip: vec![]
            }]
        );
        c.on_event(Event::StepChosen {
            generation: 0,
            step,
            damaged: vec![],
            now: ms(0),
        })
    }

    /// `rank` of the running generation is killed at `now` (ms), the others stop, `step` is
    /// chosen: every action until the next generation starts (after its backoff).
    fn killed(c: &mut Coordinator, rank: u32, step: Option<u64>, now: u64) -> Vec<Action> {
        let g = c.generation();
        let mut out = c.on_event(Event::Exited {
            generation: g,
            rank,
            status: ExitStatus::Signal(9),
            now: ms(now),
        });
        for r in c.live_ranks() {
            out.extend(c.on_event(Event::Exited {
                generation: g,
                rank: r,
                status: ExitStatus::Signal(15),
                now: ms(now + 10),
            }));
        }
        out.extend(c.on_event(Event::StepChosen {
            generation: g,
            step,
            damaged: vec![],
            now: ms(now + 20),
        }));
        let mut t = now + 20;
        while c.generation() == g && !c.is_done() {
            t += 50;
            out.extend(c.on_event(Event::Tick { now: ms(t) }));
        }
        out
    }

    /// The nodes of the generation an action list starts.
    fn started_on(out: &[Action]) -> Option<(Layout, Vec<u32>, Option<u64>)> {
        out.iter().find_map(|a| match a {
            Action::Start {
                layout,
                assignments,
                resume_from,
                ..
            } => Some((
                *layout,
                assignments.iter().map(|a| a.node).collect(),
                *resume_from,
            )),
            _ => None,
        })
    }

    fn kept_out_records(out: &[Action]) -> Vec<&records::NodeKeptOut> {
        out.iter()
            .filter_map(|a| match a {
                Action::Record(Record::NodeKeptOut(k)) => Some(k),
                _ => None,
            })
            .collect()
    }

    fn committed(c: &mut Coordinator, step: u64, now: u64) -> Vec<Action> {
        c.on_event(Event::Committed {
            generation: c.generation(),
            step: Some(step),
            now: ms(now),
        })
    }

    /// Node `node` comes back at `now` and the job grows at the next commit (`step`, after a
    /// first answer of `step - 1`): the actions of the grow.
    fn back_and_grown(c: &mut Coordinator, node: u32, step: u64, now: u64) -> Vec<Action> {
        c.on_event(Event::NodeBack { node, now: ms(now) });
        assert_eq!(c.watching_commits(), Some(c.generation()));
        assert!(committed(c, step - 1, now + 10).is_empty());
        let g = c.generation();
        let mut out = committed(c, step, now + 20);
        for r in c.live_ranks() {
            out.extend(c.on_event(Event::Exited {
                generation: g,
                rank: r,
                status: ExitStatus::Signal(15),
                now: ms(now + 30),
            }));
        }
        out.extend(c.on_event(Event::StepChosen {
            generation: g,
            step: Some(step),
            damaged: vec![],
            now: ms(now + 40),
        }));
        assert_eq!(c.generation(), g + 1, "{out:?}");
        out
    }

    #[test]
    fn a_repaired_node_grows_the_job_back_at_the_next_commit_not_before_and_not_mid_save() {
        let mut c = Coordinator::new(cfg(2, 0, "dp=2"));
        started(&mut c, None);
        let out = killed(&mut c, 1, Some(4), 1_000);
        assert_eq!(
            started_on(&out),
            Some(("dp=1".parse().unwrap(), vec![0], Some(4)))
        );
        assert_eq!(c.watching_commits(), None, "nothing to grow onto");
        assert_eq!(c.restarts(), 1);
        let out = c.on_event(Event::Heartbeat {
            generation: 1,
            rank: 0,
            step: 5,
            now: ms(2_000),
        });
        assert!(matches!(&out[..], [Action::Record(Record::Resumed(_))]));
        // Node 1 is repaired at 3 s.
        let out = c.on_event(Event::NodeBack {
            node: 1,
            now: ms(3_000),
        });
        assert_eq!(
            out,
            vec![Action::Record(Record::NodeReturned(
                records::NodeReturned {
                    node: 1,
                    usable: true,
                    at_ms: 3_000
                }
            ))]
        );
        assert_eq!(c.excluded(), Vec::<u32>::new());
        assert_eq!(c.watching_commits(), Some(1));
        // Steps go on; the driver's first answer is where things stand (step 4): no grow.
        let mut t = 3_000;
        for step in 6..=8 {
            t += 50;
            assert!(
                c.on_event(Event::Heartbeat {
                    generation: 1,
                    rank: 0,
                    step,
                    now: ms(t)
                })
                .is_empty()
            );
            assert!(c.on_event(Event::Tick { now: ms(t) }).is_empty());
            if step == 6 {
                assert!(committed(&mut c, 4, t).is_empty(), "grew at an old commit");
            }
        }
        // Step 8 is done and being saved, but not committed: nothing yet.
        assert!(committed(&mut c, 4, t + 10).is_empty(), "grew mid-save");
        assert!(c.on_event(Event::Tick { now: ms(t + 20) }).is_empty());
        // A commit seen for an older generation is not this one's.
        assert!(
            c.on_event(Event::Committed {
                generation: 0,
                step: Some(8),
                now: ms(t + 30)
            })
            .is_empty()
        );
        // Step 8 committed: stop the ranks.
        let out = committed(&mut c, 8, t + 40);
        assert_eq!(
            out,
            vec![Action::Signal {
                generation: 1,
                ranks: vec![0],
                kill: false
            }]
        );
        assert_eq!(c.watching_commits(), None);
        // Further commit answers while stopping change nothing.
        assert!(committed(&mut c, 12, t + 45).is_empty());
        let out = c.on_event(Event::Exited {
            generation: 1,
            rank: 0,
            status: ExitStatus::Signal(15),
            now: ms(t + 50),
        });
        assert_eq!(
            out,
            vec![Action::ChooseStep {
                generation: 1,
                skip: vec![]
            }]
        );
        // The step just committed is chosen, and the job restarts at once on both nodes.
        let out = c.on_event(Event::StepChosen {
            generation: 1,
            step: Some(8),
            damaged: vec![],
            now: ms(t + 60),
        });
        let Action::Record(Record::Grow(g)) = &out[0] else {
            panic!("{out:?}")
        };
        assert_eq!(
            (
                g.generation,
                g.from_layout.as_str(),
                g.layout.as_str(),
                &g.nodes[..],
                &g.returned[..],
                g.step,
                g.steps_lost
            ),
            (
                1,
                "dp=1,tp=1,pp=1",
                "dp=2,tp=1,pp=1",
                &[0, 1][..],
                &[1][..],
                Some(8),
                0
            )
        );
        assert!(g.reason.contains("came back"), "{}", g.reason);
        assert_eq!(
            started_on(&out),
            Some(("dp=2".parse().unwrap(), vec![0, 1], Some(8)))
        );
        assert_eq!(c.generation(), 2);
        assert!(
            !out.iter()
                .any(|a| matches!(a, Action::Record(Record::Recovery(_)))),
            "a grow is not a recovery: {out:?}"
        );
        // A grow is not a restart (no backoff, no budget spent), and there is nothing more to
        // grow onto.
        assert_eq!(c.restarts(), 1);
        assert_eq!(c.watching_commits(), None);
        let out = c.on_event(Event::Heartbeat {
            generation: 2,
            rank: 1,
            step: 9,
            now: ms(t + 500),
        });
        assert!(
            matches!(&out[..], [Action::Record(Record::Resumed(r))] if r.step == 9),
            "{out:?}"
        );
    }

    #[test]
    fn growth_never_exceeds_the_configured_layout() {
        // Four nodes, a layout of two: the other two are spares in all but name.
        let mut c = Coordinator::new(cfg(4, 0, "dp=2"));
        assert_eq!(c.next_layout().unwrap(), "dp=2".parse().unwrap());
        started(&mut c, Some(2));
        // Failures are replaced while nodes remain, so nothing ever shrinks...
        let out = killed(&mut c, 0, Some(4), 1_000);
        assert_eq!(
            started_on(&out),
            Some(("dp=2".parse().unwrap(), vec![1, 2], Some(4)))
        );
        // ... and a returned node never makes the job larger than configured.
        c.on_event(Event::NodeBack {
            node: 0,
            now: ms(2_000),
        });
        assert_eq!(c.watching_commits(), None);
        assert_eq!(c.next_layout().unwrap(), "dp=2".parse().unwrap());
        // tp x pp stays; dp grows back only up to its configured 2, with room for 5.
        let mut c = Coordinator::new(Config::new(
            Topology {
                nodes: 4,
                ranks_per_node: 2,
                spares: 1,
            },
            "dp=2,tp=2".parse().unwrap(),
        ));
        c.cfg.backoff = Duration::from_millis(100);
        started(&mut c, None);
        // Only the spare left: one replica; every node back: two, not five.
        c.excluded.extend(0..4);
        assert_eq!(c.next_layout().unwrap(), "dp=1,tp=2".parse().unwrap());
        c.excluded.clear();
        assert_eq!(c.next_layout().unwrap(), "dp=2,tp=2".parse().unwrap());
    }

    #[test]
    fn a_failure_while_waiting_to_grow_restarts_on_the_returned_node_at_once() {
        let mut c = Coordinator::new(cfg(3, 0, "dp=3"));
        started(&mut c, None);
        let out = killed(&mut c, 2, Some(4), 1_000);
        assert_eq!(
            started_on(&out),
            Some(("dp=2".parse().unwrap(), vec![0, 1], Some(4)))
        );
        c.on_event(Event::NodeBack {
            node: 2,
            now: ms(2_000),
        });
        assert_eq!(c.watching_commits(), Some(1));
        let out = killed(&mut c, 1, Some(4), 3_000);
        assert!(
            out.iter().any(|a| matches!(a,
                Action::Record(Record::Recovery(r)) if r.layout == "dp=2,tp=1,pp=1")),
            "{out:?}"
        );
        assert_eq!(
            started_on(&out),
            Some(("dp=2".parse().unwrap(), vec![0, 2], Some(4)))
        );
        assert_eq!(c.watching_commits(), None, "nothing left to grow onto");
        assert_eq!(c.restarts(), 2);
    }

    #[test]
    fn a_node_failing_three_times_in_ten_minutes_is_kept_out_and_named() {
        let mut c = Coordinator::new(cfg(2, 0, "dp=2"));
        started(&mut c, None);
        c.cfg.max_restarts = 10;
        // Node 1 fails at 10 s, 100 s and 300 s, and comes back after the first two.
        let mut all = Vec::new();
        for (i, at) in [10_000, 100_000].into_iter().enumerate() {
            let out = killed(&mut c, 1, Some(4), at);
            assert!(kept_out_records(&out).is_empty(), "failure {i}: {out:?}");
            all.extend(out);
            let out = back_and_grown(&mut c, 1, 8, at + 1_000);
            assert_eq!(started_on(&out).unwrap().1, vec![0, 1]);
        }
        let out = killed(&mut c, 1, Some(8), 300_000);
        assert_eq!(
            kept_out_records(&out),
            vec![&records::NodeKeptOut {
                node: 1,
                failures_ms: vec![10_000, 100_000, 300_000],
                window_s: 600.0,
                reason: "node 1 failed 3 times within 600 s (at 10000, 100000, 300000 ms): it is \
                         kept out for good, even when it comes back"
                    .into(),
                at_ms: 300_000,
            }]
        );
        assert!(c.is_kept_out(1));
        // It comes back: refused, and the job does not grow onto it.
        let out = c.on_event(Event::NodeBack {
            node: 1,
            now: ms(301_000),
        });
        assert_eq!(
            out,
            vec![Action::Record(Record::NodeReturned(
                records::NodeReturned {
                    node: 1,
                    usable: false,
                    at_ms: 301_000
                }
            ))]
        );
        assert_eq!(c.watching_commits(), None);
        assert_eq!(c.excluded(), vec![1]);
        assert_eq!(c.next_layout().unwrap(), "dp=1".parse().unwrap());
    }

    /// The `backoff_s` of the recovery decision in `out`.
    fn backoff_of(out: &[Action]) -> f64 {
        out.iter()
            .find_map(|a| match a {
                Action::Record(Record::Recovery(r)) => Some(r.backoff_s),
                _ => None,
            })
            .expect("a recovery decision")
    }

    #[test]
    fn the_backoff_doubles_in_a_crash_loop_and_starts_over_after_a_healthy_generation() {
        // 6 nodes, dp=1: every failure moves the job to the next node. backoff 100 ms,
        // backoff_max 30 s.
        let mut c = Coordinator::new(cfg(6, 0, "dp=1"));
        c.cfg.max_restarts = 10;
        started(&mut c, Some(4));
        // A crash loop: each generation fails a second after it starts.
        let mut at = 1_000;
        let mut seen = Vec::new();
        for _ in 0..3 {
            let out = killed(&mut c, 0, Some(4), at);
            seen.push(backoff_of(&out));
            at += 2_000;
        }
        assert_eq!(seen, [0.1, 0.2, 0.4]);
        // The next generation runs 40 s (past backoff_max) before failing: healthy, so the
        // delay starts over ...
        at += 40_000;
        assert_eq!(backoff_of(&killed(&mut c, 0, Some(8), at)), 0.1);
        // ... and doubles again if the one after fails quickly.
        at += 1_000;
        assert_eq!(backoff_of(&killed(&mut c, 0, Some(8), at)), 0.2);
        assert_eq!(c.restarts(), 5);
    }

    #[test]
    fn failures_spread_over_more_than_ten_minutes_do_not_keep_a_node_out() {
        let mut c = Coordinator::new(cfg(2, 0, "dp=2"));
        c.cfg.max_restarts = 10;
        started(&mut c, None);
        // 0 s, 400 s, 700 s: never three within 600 s.
        for at in [1, 400_000, 700_000] {
            let out = killed(&mut c, 1, Some(4), at);
            assert!(kept_out_records(&out).is_empty(), "at {at}: {out:?}");
            back_and_grown(&mut c, 1, 8, at + 1_000);
        }
        assert!(!c.is_kept_out(1));
        // Two failures (flag: 2) more than ten minutes apart neither.
        let mut c = Coordinator::new(cfg(2, 0, "dp=2"));
        c.cfg.max_node_failures = 2;
        started(&mut c, None);
        killed(&mut c, 1, Some(4), 1_000);
        back_and_grown(&mut c, 1, 8, 2_000);
        let out = killed(&mut c, 1, Some(8), 602_000);
        assert!(kept_out_records(&out).is_empty(), "{out:?}");
        back_and_grown(&mut c, 1, 12, 603_000);
        // ... but two within it do.
        let out = killed(&mut c, 1, Some(12), 700_000);
        assert_eq!(
            kept_out_records(&out)[0].failures_ms,
            vec![602_000, 700_000]
        );
    }
}
