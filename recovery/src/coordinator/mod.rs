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
//!
//! The files: this one holds the state machine (start, heartbeats, exits, ticks, failures,
//! the layout decision); `config.rs` its settings; `events.rs` what goes in and out
//! ([`Event`], [`Action`]); `grow.rs` nodes coming back and growing at a commit;
//! `sentinel.rs` replicas that disagree at a commit (stop, or roll back keeping the suspect
//! nodes out);
//! `take_over.rs` carrying on from a lost coordinator; `tests.rs` its own cases (the decision
//! tables are `recovery/tests/decisions.rs`).

mod config;
mod events;
mod grow;
mod sentinel;
mod take_over;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::records;
use ckpt_store::Layout;

pub use config::{Config, Topology};
pub use events::{Action, Assignment, DATA_FAILURE_EXIT, Event, ExitStatus, Record};
pub use take_over::TakeOver;

#[derive(Debug, Clone)]
struct RankState {
    node: u32,
    started: Duration,
    /// The last beat of any kind (a step's, or an `Alive` one while starting).
    last_beat: Option<Duration>,
    /// The last step reported (`None`: still starting).
    last_step: Option<u64>,
    last_progress: Duration,
    exited: Option<ExitStatus>,
    /// Since when the driver has seen the rank's process stopped (`None`: running).
    stopped_since: Option<Duration>,
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
            stopped_since: None,
        }
    }

    /// Why this running rank has failed by `now`, if it has: its beats stopped (a process
    /// stopped or gone, also while it restores), its process stopped with no beat since for the
    /// heartbeat timeout (also before its first beat), no step reported within the start-up
    /// timeout (beating or not), or no step progress within the hang timeout. (How, detail,
    /// seconds since the last sign.)
    fn overdue(
        &self,
        rank: u32,
        cfg: &Config,
        now: Duration,
    ) -> Option<(&'static str, String, f64)> {
        let since = |t: Duration| now.saturating_sub(t);
        if let Some(b) = self.last_beat
            && since(b) > cfg.heartbeat_timeout
        {
            let s = since(b).as_secs_f64();
            let what = if self.last_step.is_some() {
                ""
            } else {
                " while starting"
            };
            let detail = format!(
                "rank {rank} missed its heartbeats for {s:.1} s{what} (stopped or unreachable)"
            );
            return Some(("heartbeat", detail, s));
        }
        if let Some(stopped) = self.stopped_since {
            // No beat can come from a stopped process: the heartbeat timeout runs from the stop
            // (or the last beat after it), also for a rank that has not beaten yet.
            let sign = self.last_beat.map_or(stopped, |b| b.max(stopped));
            if since(sign) > cfg.heartbeat_timeout {
                let s = since(stopped).as_secs_f64();
                let what = if self.last_beat.is_some() {
                    ""
                } else {
                    " before its first heartbeat"
                };
                let detail = format!(
                    "rank {rank}'s process has been stopped for {s:.1} s{what} (SIGSTOP, a \
                     terminal stop or a tracer)"
                );
                return Some(("heartbeat", detail, since(sign).as_secs_f64()));
            }
        }
        match self.last_step {
            None if since(self.started) > cfg.startup_timeout => {
                let detail = if self.last_beat.is_none() {
                    format!(
                        "rank {rank} sent no heartbeat within {:?} of starting",
                        cfg.startup_timeout
                    )
                } else {
                    format!(
                        "rank {rank} reported no step within {:?} of starting (alive, still starting or restoring)",
                        cfg.startup_timeout
                    )
                };
                Some(("startup", detail, since(self.started).as_secs_f64()))
            }
            Some(_) if since(self.last_progress) > cfg.hang_timeout => {
                let s = since(self.last_progress).as_secs_f64();
                let detail = format!(
                    "rank {rank} made no step progress for {s:.1} s (last step {:?})",
                    self.last_step
                );
                Some(("hang", detail, s))
            }
            _ => None,
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
    /// When every rank of the running generation had reported a step (restored, or started
    /// from scratch): training began.
    all_reported_at: Option<Duration>,
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
    /// Steps from this one on are never restored: their replicas disagreed (or came after).
    unusable_from: Option<u64>,
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
            all_reported_at: None,
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
            unusable_from: None,
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
        self.all_reported_at = None;
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

    /// Feed one event; returns what to do. (Over 100 lines on purpose: one short arm per
    /// kind of event, the dispatch read as the table it is; the longer answers are methods.)
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
                    below: None,
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
                    if self.all_reported_at.is_none()
                        && self.ranks.values().all(|r| r.last_step.is_some())
                    {
                        self.all_reported_at = Some(now);
                    }
                    if !self.resumed_reported && self.resume_from.is_none_or(|s| step > s) {
                        self.resumed_reported = true;
                        let since = |t: Duration| {
                            self.failed_at
                                .map_or(0.0, |f| t.saturating_sub(f).as_secs_f64())
                        };
                        out.push(Action::Record(Record::Resumed(records::Resumed {
                            generation,
                            step,
                            since_failure_s: since(now),
                            restored_s: self.all_reported_at.map(since),
                            at_ms: ms(now),
                        })));
                    }
                }
                out
            }
            Event::Alive {
                generation,
                rank,
                now,
            } => {
                if generation == self.generation
                    && let Some(r) = self.ranks.get_mut(&rank)
                {
                    r.last_beat = Some(now);
                }
                vec![]
            }
            Event::Stopped {
                generation,
                rank,
                stopped,
                now,
            } => {
                if generation == self.generation
                    && let Some(r) = self.ranks.get_mut(&rank)
                {
                    r.stopped_since = match (stopped, r.stopped_since) {
                        (true, Some(t)) => Some(t),
                        (true, None) => Some(now),
                        (false, _) => None,
                    };
                }
                vec![]
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
            Event::ReplicaMismatch {
                generation,
                step,
                suspects,
                detail,
                now,
            } if generation == self.generation => {
                self.on_replica_mismatch(step, suspects, detail, now)
            }
            Event::ReplicaMismatch { .. } => vec![],
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
            below: self.unusable_from,
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
                // Before its first step report the rank was restoring: a data failure is about
                // the step it was given, not its node.
                if status == ExitStatus::Code(DATA_FAILURE_EXIT)
                    && self.ranks[&rank].last_step.is_none()
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
                let found = self
                    .ranks
                    .iter()
                    .filter(|(_, r)| r.exited.is_none())
                    .find_map(|(&rank, r)| {
                        let (how, detail, since) = r.overdue(rank, &self.cfg, now)?;
                        Some((rank, how, detail, since))
                    });
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
        self.stop_live(now)
    }

    /// Stop every live rank of the generation (SIGTERM now, SIGKILL after the grace), and go
    /// on at once if none is left.
    fn stop_live(&mut self, now: Duration) -> Vec<Action> {
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
        out.extend(self.stop_live(now));
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
mod tests;
