//! The coordinator role of an agent: the [`Coordinator`] fed with etcd events, its actions
//! carried out on etcd (plan, signals, done) and on the store (generation markers, the
//! recovery log, the step to restore).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use ckpt_store::records::{Event as LogEvent, Takeover};
use ckpt_store::{ErrorKind, Result, Store};
use etcd_client::EventType;
use tracing::{info, warn};

use super::AgentOptions;
use super::JobState;
use super::etcd::Session;
use super::keys::{BeatsMsg, DoneMsg, ExitMsg, Key, Keys, NodeMsg, PlanMsg, SignalMsg};
use crate::coordinator::{Action, Assignment, Coordinator, Event, ExitStatus, TakeOver};
use crate::driver::{
    LossBoard, RecoveryLog, check_step, choose_step_logged, first_free_generation, free_port,
    retire_step,
};

/// Maps the coordinator's generations to the store's: generation markers are created once,
/// so a generation some earlier coordinator marked is skipped.
#[derive(Debug)]
struct Generations {
    internal: u64,
    global: u64,
    floor: u64,
}

impl Generations {
    fn global(&self, internal: u64) -> u64 {
        if internal >= self.internal {
            self.global + (internal - self.internal)
        } else {
            self.global.saturating_sub(self.internal - internal)
        }
    }

    /// Mark the store generation of coordinator generation `internal` as started (fencing
    /// older generations' commits).
    async fn allocate(&mut self, internal: u64, store: &Store, run: &str) -> Result<u64> {
        let mut g = self.global(internal).max(self.floor);
        for _ in 0..64 {
            match store.start_generation(run, g).await {
                Ok(()) => {
                    self.internal = internal;
                    self.global = g;
                    self.floor = g + 1;
                    return Ok(g);
                }
                Err(e) if e.kind() == ErrorKind::Conflict => {
                    warn!(
                        "generation {g} of run {run} was marked by an earlier coordinator; using the next"
                    );
                    g += 1;
                }
                Err(e) => return Err(e),
            }
        }
        Err(ckpt_store::Error::new(
            ErrorKind::Conflict,
            format!(
                "generations up to {g} of run {run} are all marked: another coordinator is running"
            ),
        ))
    }
}

/// The generation the coordinator runs.
#[derive(Debug)]
struct Running {
    internal: u64,
    global: u64,
    world: u32,
    assignments: Vec<Assignment>,
    exited: BTreeSet<u32>,
}

/// The coordinator role.
#[derive(Debug)]
pub(super) struct Leader {
    node: u32,
    run: String,
    keys: Keys,
    /// Create revision of the leader key: every write is guarded by it.
    rev: i64,
    /// Watch events at or before this revision were in the snapshot this role started from.
    snapshot_rev: i64,
    store: Store,
    nodes: u32,
    coord: Coordinator,
    gens: Generations,
    pub(super) log: RecoveryLog,
    losses: LossBoard,
    alive: BTreeMap<u32, NodeMsg>,
    lost: BTreeSet<u32>,
    /// When each node's beats last arrived (for the detection latency of a lost node).
    last_seen: BTreeMap<u32, Duration>,
    running: Option<Running>,
    pending: VecDeque<Event>,
    t0: Instant,
    join_deadline: Option<Instant>,
    pub(super) finished: bool,
    /// The replica secret every plan carries (with peer replicas and no `CKPT_PEER_SECRET`).
    peer_secret: Option<crate::peer::PeerSecret>,
    /// While the coordinator waits for a commit to grow the job back at: the generation, when
    /// the store was last asked, and the newest committed step it said.
    commit_watch: Option<(u64, Instant, Option<u64>)>,
}

impl Leader {
    /// Take the role, from the state under the prefix at `snapshot_rev`: start the job if no
    /// plan exists, else carry on from the previous coordinator (see
    /// [`Coordinator::take_over`]).
    pub(super) async fn new(
        opts: &AgentOptions,
        rev: i64,
        snapshot_rev: i64,
        view: &JobState,
        previous: Option<u32>,
    ) -> Result<(Self, Vec<Action>)> {
        let store = ckpt_store::open_with(&opts.job.store_url, &opts.job.open)?;
        let writer = format!("leader-{}", opts.node);
        let log = RecoveryLog::new(&store, &opts.job.run, &writer)?;
        let losses = LossBoard::new(&store, &opts.job.run, &writer)?;
        let floor = first_free_generation(&store, &opts.job.run).await?;
        let t0 = Instant::now();
        let mut l = Leader {
            node: opts.node,
            run: opts.job.run.clone(),
            keys: Keys::new(&opts.prefix()),
            rev,
            snapshot_rev,
            store,
            nodes: opts.job.config.topology.nodes,
            coord: Coordinator::new(opts.job.config.clone()),
            gens: Generations {
                internal: 0,
                global: floor,
                floor,
            },
            log,
            losses,
            alive: view.nodes.clone(),
            lost: BTreeSet::new(),
            last_seen: BTreeMap::new(),
            running: None,
            pending: VecDeque::new(),
            t0,
            join_deadline: Some(t0 + opts.join_timeout),
            finished: false,
            commit_watch: None,
            // The previous coordinator's secret, so the agents and ranks keep theirs; a new
            // job's first coordinator makes one.
            peer_secret: match view.plan.as_ref().and_then(|p| p.peer_secret.clone()) {
                Some(s) => Some(s),
                None if opts.peer_replicas && opts.peer_secret.is_none() => {
                    Some(crate::peer::PeerSecret::generate()?)
                }
                None => None,
            },
        };
        let Some(plan) = view.plan.clone() else {
            info!(node = opts.node, "coordinating a new job");
            return Ok((l, vec![]));
        };
        // Carry on from the previous coordinator.
        l.join_deadline = None;
        let g = plan.generation;
        let layout = plan.layout()?;
        let signal = view.signals.get(&g);
        let mut excluded: BTreeSet<u32> = plan.excluded.iter().copied().collect();
        if let Some(s) = signal {
            excluded.extend(s.excluded.iter().copied());
        }
        let exited: BTreeMap<u32, ExitStatus> = view
            .exits
            .iter()
            .filter(|((eg, _), _)| *eg == g)
            .map(|((_, r), s)| (*r, *s))
            .collect();
        let mut lost_nodes = BTreeMap::new();
        for a in &plan.assignments {
            if !view.nodes.contains_key(&a.node) {
                lost_nodes.insert(
                    a.node,
                    "its agent's etcd lease is gone (the machine or the agent died)".to_string(),
                );
            }
        }
        if let Some(p) = previous.filter(|p| *p != opts.node) {
            lost_nodes.insert(
                p,
                format!(
                    "it ran the coordinator, whose etcd lease expired; node {} took over",
                    opts.node
                ),
            );
        }
        let max_step = view
            .beats
            .values()
            .filter(|b| b.generation == g)
            .flat_map(|b| b.steps.iter().map(|s| s.1))
            .max()
            .unwrap_or(0);
        let t = TakeOver {
            generation: g,
            layout,
            assignments: plan.assignments.clone(),
            excluded,
            restarts: plan.restarts,
            max_step,
            stopping: signal.is_some(),
            killed: signal.is_some_and(|s| s.kill),
            exited: exited.clone(),
            lost_nodes: lost_nodes.clone(),
        };
        warn!(
            node = opts.node,
            generation = g,
            previous = ?previous,
            lost = ?lost_nodes.keys().collect::<Vec<_>>(),
            "taking over as the coordinator"
        );
        let (coord, actions) = Coordinator::take_over(opts.job.config.clone(), t, Duration::ZERO);
        l.coord = coord;
        l.gens = Generations {
            internal: g,
            global: g,
            floor: floor.max(g + 1),
        };
        let mut gone: BTreeSet<u32> = exited.keys().copied().collect();
        gone.extend(
            plan.assignments
                .iter()
                .filter(|a| lost_nodes.contains_key(&a.node))
                .map(|a| a.rank),
        );
        l.running = Some(Running {
            internal: g,
            global: g,
            world: layout.world(),
            assignments: plan.assignments.clone(),
            exited: gone,
        });
        l.lost.extend(lost_nodes.keys().copied());
        let v = LogEvent::Takeover(Takeover {
            generation: g,
            node: opts.node,
            previous,
            lost_nodes: lost_nodes.keys().copied().collect(),
            at_ms: 0,
        });
        l.log.write(v).await?;
        Ok((l, actions))
    }

    fn now(&self) -> Duration {
        self.t0.elapsed()
    }

    fn guard(&self) -> String {
        self.keys.key(Key::Leader)
    }

    /// Learn from a watch event under the prefix.
    pub(super) async fn on_watch(
        &mut self,
        key: Key,
        kind: EventType,
        value: &[u8],
        mod_rev: i64,
    ) -> Result<()> {
        if mod_rev <= self.snapshot_rev {
            return Ok(());
        }
        let now = self.now();
        match (key, kind) {
            (Key::Node(n), EventType::Put) => {
                if let Ok(m) = serde_json::from_slice::<NodeMsg>(value) {
                    self.alive.insert(n, m);
                    // A lost node's agent registered again (the machine was repaired): the
                    // job may grow back onto it at the next commit.
                    if self.lost.remove(&n) {
                        info!(node = n, "a lost node's agent registered again");
                        self.pending.push_back(Event::NodeBack { node: n, now });
                    }
                }
            }
            (Key::Node(n), EventType::Delete) => {
                self.alive.remove(&n);
                self.lost.insert(n);
                warn!(node = n, "node left: its agent's etcd lease is gone");
                if let Some(r) = self.running.as_mut() {
                    for a in r.assignments.iter().filter(|a| a.node == n) {
                        if r.exited.insert(a.rank) {
                            self.pending.push_back(Event::Exited {
                                generation: r.internal,
                                rank: a.rank,
                                status: ExitStatus::Signal(9),
                                now,
                            });
                        }
                    }
                }
            }
            (Key::Beats(n), EventType::Put) => {
                let Ok(b) = serde_json::from_slice::<BeatsMsg>(value) else {
                    return Ok(());
                };
                self.last_seen.insert(n, now);
                let Some(r) = self.running.as_ref() else {
                    return Ok(());
                };
                if b.generation != r.global {
                    return Ok(());
                }
                let (internal, world) = (r.internal, r.world);
                for p in &b.partials {
                    self.losses
                        .add(b.generation, p.step, &p.workload, world)
                        .await?;
                }
                for (rank, step) in b.steps {
                    self.pending.push_back(Event::Heartbeat {
                        generation: internal,
                        rank,
                        step,
                        now,
                    });
                }
            }
            (Key::Exit(g, rank), EventType::Put) => {
                let Ok(e) = serde_json::from_slice::<ExitMsg>(value) else {
                    return Ok(());
                };
                if let Some(r) = self.running.as_mut()
                    && r.global == g
                    && r.exited.insert(rank)
                {
                    self.pending.push_back(Event::Exited {
                        generation: r.internal,
                        rank,
                        status: e.status,
                        now,
                    });
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Time passes: a tick for the coordinator, and the start of the job once every node
    /// that runs ranks at the start has joined (or the join timeout passed).
    pub(super) fn tick(&mut self) {
        let now = self.now();
        if let Some(deadline) = self.join_deadline {
            let joined = (0..self.nodes).all(|n| self.alive.contains_key(&n));
            if joined || Instant::now() >= deadline {
                if !joined {
                    let missing: Vec<u32> = (0..self.nodes)
                        .filter(|n| !self.alive.contains_key(n))
                        .collect();
                    warn!(?missing, "starting without nodes that did not join in time");
                }
                self.join_deadline = None;
                self.pending.push_back(Event::Start { now });
            }
            return;
        }
        self.pending.push_back(Event::Tick { now });
    }

    /// While the coordinator waits to grow the job back onto returned nodes, tell it the newest
    /// committed step (asked every [`crate::supervisor::COMMIT_POLL`]), as the local supervisor
    /// does.
    pub(super) async fn poll_commits(&mut self) {
        let Some(g) = self.coord.watching_commits() else {
            self.commit_watch = None;
            return;
        };
        let fresh = self.commit_watch.is_none_or(|(wg, _, _)| wg != g);
        let due = self
            .commit_watch
            .is_some_and(|(_, at, _)| at.elapsed() >= crate::supervisor::COMMIT_POLL);
        if !fresh && !due {
            return;
        }
        match self.store.latest_committed(&self.run).await {
            Ok(step) => {
                if fresh || self.commit_watch.is_some_and(|(_, _, last)| last != step) {
                    let now = self.now();
                    self.pending.push_back(Event::Committed {
                        generation: g,
                        step,
                        now,
                    });
                }
                self.commit_watch = Some((g, Instant::now(), step));
            }
            Err(e) => warn!("looking for a new commit to grow at: {e}"),
        }
    }

    /// Feed the pending events to the coordinator and carry out its actions.
    pub(super) async fn drive(&mut self, sess: &mut Session) -> Result<()> {
        while let Some(ev) = self.pending.pop_front() {
            let actions = self.coord.on_event(ev);
            self.act(sess, actions).await?;
        }
        Ok(())
    }

    /// Carry out the coordinator's actions.
    pub(super) async fn act(&mut self, sess: &mut Session, actions: Vec<Action>) -> Result<()> {
        // A generation's store number is fixed (its marker written) before its `started`
        // record, which comes first.
        for a in &actions {
            if let Action::Start { generation, .. } = a {
                self.gens
                    .allocate(*generation, &self.store, &self.run)
                    .await?;
            }
        }
        for act in actions {
            match act {
                Action::Start {
                    generation,
                    layout,
                    assignments,
                    resume_from,
                } => {
                    let global = self.gens.global(generation);
                    let rank0 = assignments.iter().find(|a| a.rank == 0).map(|a| a.node);
                    let (master_addr, master_port) = match rank0.and_then(|n| self.alive.get(&n)) {
                        Some(m) => (m.addr.clone(), m.port),
                        None => ("127.0.0.1".to_string(), free_port()),
                    };
                    let plan = PlanMsg {
                        generation: global,
                        layout: layout.to_string(),
                        assignments: assignments.clone(),
                        resume_from,
                        master_addr,
                        master_port,
                        leader: self.node,
                        excluded: self.coord.excluded(),
                        restarts: self.coord.restarts(),
                        peer_secret: self.peer_secret.clone(),
                    };
                    let body = serde_json::to_vec(&plan).expect("plans serialize");
                    let once = self.keys.key(Key::Plans(global));
                    sess.put_guarded(
                        &self.guard(),
                        self.rev,
                        vec![
                            (self.keys.key(Key::Plan), body.clone()),
                            (once.clone(), body),
                        ],
                        Some(&once),
                    )
                    .await?;
                    info!(generation = global, %layout, "plan published");
                    let mut r = Running {
                        internal: generation,
                        global,
                        world: layout.world(),
                        assignments,
                        exited: BTreeSet::new(),
                    };
                    // Ranks placed on nodes that are not (or no longer) alive are gone.
                    let now = self.now();
                    for a in &r.assignments {
                        if !self.alive.contains_key(&a.node) && r.exited.insert(a.rank) {
                            warn!(
                                node = a.node,
                                rank = a.rank,
                                "rank placed on a node that is not alive"
                            );
                            self.lost.insert(a.node);
                            self.pending.push_back(Event::Exited {
                                generation,
                                rank: a.rank,
                                status: ExitStatus::Signal(9),
                                now,
                            });
                        }
                    }
                    self.running = Some(r);
                }
                Action::Signal {
                    generation,
                    ranks,
                    kill,
                } => {
                    let global = self.gens.global(generation);
                    let msg = SignalMsg {
                        ranks,
                        kill,
                        excluded: self.coord.excluded(),
                    };
                    let body = serde_json::to_vec(&msg).expect("signals serialize");
                    sess.put_guarded(
                        &self.guard(),
                        self.rev,
                        vec![(self.keys.key(Key::Signals(global)), body)],
                        None,
                    )
                    .await?;
                }
                Action::ChooseStep { generation, skip } => {
                    let c = choose_step_logged(&self.store, &self.run, &skip).await?;
                    self.pending.push_back(Event::StepChosen {
                        generation,
                        step: c.step,
                        damaged: c.damaged,
                        now: self.now(),
                    });
                }
                Action::CheckStep { generation, step } => {
                    let damage = check_step(&self.store, &self.run, step).await?;
                    self.pending.push_back(Event::StepChecked {
                        generation,
                        step,
                        damage,
                        now: self.now(),
                    });
                }
                Action::RetireStep { step } => retire_step(&self.store, &self.run, step).await?,
                Action::Record(rec) => {
                    let gens = &self.gens;
                    let mut v = self.log.render(&rec, |g| gens.global(g)).await;
                    // A node whose lease expired shows up as SIGKILLed ranks; say so, and
                    // count the detection from the node's last heartbeats.
                    if let LogEvent::Failure(f) = &mut v
                        && f.how == "signal"
                        && self.lost.contains(&f.node)
                    {
                        let n = f.node;
                        if let Some(seen) = self.last_seen.get(&n) {
                            f.detection_s = self.now().saturating_sub(*seen).as_secs_f64();
                        }
                        f.how = "node".into();
                        f.detail = format!(
                            "node {n} left: its agent's etcd lease expired (the machine or the agent died); {}",
                            f.detail
                        );
                    }
                    self.log.write(v).await?;
                }
                Action::Done { ok, reason } => {
                    self.losses.flush().await;
                    let msg = DoneMsg {
                        ok,
                        reason,
                        generation: self.running.as_ref().map(|r| r.global),
                        layout: self.coord.layout().to_string(),
                        restarts: self.coord.restarts(),
                    };
                    let body = serde_json::to_vec(&msg).expect("done serializes");
                    sess.put_guarded(
                        &self.guard(),
                        self.rev,
                        vec![(self.keys.key(Key::Done), body)],
                        None,
                    )
                    .await?;
                    self.finished = true;
                }
            }
        }
        Ok(())
    }
}
