//! The coordinator role of an agent: the [`Coordinator`] fed with etcd events through the
//! [`Executor`], its actions carried out on etcd ([`Published`]: plan, signals, done) and on
//! the store (generation markers, the recovery log, the step to restore).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::records::{Event as LogEvent, Takeover};
use ckpt_store::{ErrorKind, Layout, Result, Store};
use etcd_client::EventType;
use tracing::{info, warn};

use super::AgentOptions;
use super::JobState;
use super::etcd::Session;
use super::keys::{BeatsMsg, DoneMsg, ExitMsg, Key, Keys, NodeMsg, PlanMsg, SignalMsg};
use crate::coordinator::{Action, Assignment, Coordinator, Event, ExitStatus, Record, TakeOver};
use crate::driver::{LossBoard, RecoveryLog, first_free_generation, free_port};
use crate::executor::{Effects, Executor, Order, Start};

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
            match store.log().start_generation(run, g).await {
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
    ex: Executor,
    cluster: Cluster,
    /// Watch events at or before this revision were in the snapshot this role started from.
    snapshot_rev: i64,
    /// Nodes that run ranks at the start.
    nodes: u32,
    join_deadline: Option<Instant>,
}

/// What the role knows of the nodes and publishes to them.
#[derive(Debug)]
struct Cluster {
    node: u32,
    keys: Keys,
    /// Create revision of the leader key: every write is guarded by it.
    rev: i64,
    gens: Generations,
    losses: LossBoard,
    alive: BTreeMap<u32, NodeMsg>,
    lost: BTreeSet<u32>,
    /// When each node's beats last arrived (for the detection latency of a lost node).
    last_seen: BTreeMap<u32, Duration>,
    running: Option<Running>,
    finished: bool,
    /// The replica secret every plan carries (with peer replicas and no `CKPT_PEER_SECRET`).
    peer_secret: Option<crate::peer::PeerSecret>,
    /// A local tier per machine: before choosing the step to resume from, wait (at most
    /// this long) for every live node of the stopped generation to drain its newest step
    /// ([`super::Agent`]'s `drain_stopped`).
    drain_wait: Option<Duration>,
}

/// The etcd coordinator's [`Effects`]: a generation is a plan published for every node's
/// agent to act on, signals and the end of the job are keys too; every write is guarded by
/// the leader key.
struct Published<'a> {
    c: &'a mut Cluster,
    sess: &'a mut Session,
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
        let job = &opts.job;
        let store = ckpt_store::open_with(&job.store_url, &job.open)?;
        let writer = format!("leader-{}", opts.node);
        let log = RecoveryLog::new(&store, &job.run, &writer)?;
        let losses = LossBoard::new(&store, &job.run, &writer)?;
        let local = job
            .local_tier
            .as_deref()
            .map(ckpt_store::open)
            .transpose()?;
        let mut floor = first_free_generation(&store, &job.run).await?;
        if let Some(l) = &local {
            floor = floor.max(first_free_generation(l, &job.run).await?);
        }
        let coord = Coordinator::new(job.config.clone());
        // One machine's tier holds every rank's commits; with several, each node's tier holds
        // node commits only, and steps are chosen from the store (each node's tier still
        // serves its chunks to its ranks' restores).
        let t = job.config.topology;
        let local = local.filter(|_| t.nodes + t.spares == 1);
        let ex = Executor::new(coord, store, &job.run, log, Order::OldestFirst).with_local(local);
        // The previous coordinator's secret, so the agents and ranks keep theirs; a new
        // job's first coordinator makes one.
        let peer_secret = match view.plan.as_ref().and_then(|p| p.peer_secret.clone()) {
            Some(s) => Some(s),
            None if opts.peer_replicas && opts.peer_secret.is_none() => {
                Some(crate::peer::PeerSecret::generate()?)
            }
            None => None,
        };
        let mut l = Leader {
            join_deadline: Some(ex.started() + opts.join_timeout),
            ex,
            cluster: Cluster {
                node: opts.node,
                keys: Keys::new(&opts.prefix()),
                rev,
                gens: Generations {
                    internal: 0,
                    global: floor,
                    floor,
                },
                losses,
                alive: view.nodes.clone(),
                lost: BTreeSet::new(),
                last_seen: BTreeMap::new(),
                running: None,
                finished: false,
                peer_secret,
                drain_wait: (job.local_tier.is_some()
                    && t.nodes + t.spares > 1
                    && !opts.drain_wait.is_zero())
                .then_some(opts.drain_wait),
            },
            snapshot_rev,
            nodes: job.config.topology.nodes,
        };
        let Some(plan) = view.plan.clone() else {
            info!(node = opts.node, "coordinating a new job");
            return Ok((l, vec![]));
        };
        let actions = l.take_over(opts, &plan, view, previous, floor).await?;
        Ok((l, actions))
    }

    /// Carry on from the previous coordinator, at the generation of `plan`: the coordinator
    /// that inherits it, and the `takeover` record; returns what to do now.
    async fn take_over(
        &mut self,
        opts: &AgentOptions,
        plan: &PlanMsg,
        view: &JobState,
        previous: Option<u32>,
        floor: u64,
    ) -> Result<Vec<Action>> {
        self.join_deadline = None;
        let g = plan.generation;
        let layout = plan.layout()?;
        let t = inherited(opts.node, plan, layout, view, previous);
        warn!(
            node = opts.node,
            generation = g,
            previous = ?previous,
            lost = ?t.lost_nodes.keys().collect::<Vec<_>>(),
            "taking over as the coordinator"
        );
        let mut gone: BTreeSet<u32> = t.exited.keys().copied().collect();
        gone.extend(
            plan.assignments
                .iter()
                .filter(|a| t.lost_nodes.contains_key(&a.node))
                .map(|a| a.rank),
        );
        let lost: Vec<u32> = t.lost_nodes.keys().copied().collect();
        let (coord, actions) = Coordinator::take_over(opts.job.config.clone(), t, Duration::ZERO);
        self.ex.coord = coord;
        let c = &mut self.cluster;
        c.gens = Generations {
            internal: g,
            global: g,
            floor: floor.max(g + 1),
        };
        c.running = Some(Running {
            internal: g,
            global: g,
            world: layout.world(),
            assignments: plan.assignments.clone(),
            exited: gone,
        });
        c.lost.extend(lost.iter().copied());
        let v = LogEvent::Takeover(Takeover {
            generation: g,
            node: opts.node,
            previous,
            lost_nodes: lost,
            at_ms: 0,
        });
        self.ex.log.write(v).await?;
        Ok(actions)
    }

    /// Whether the job's end is published.
    pub(super) fn finished(&self) -> bool {
        self.cluster.finished
    }

    /// The recovery log records this role wrote.
    pub(super) fn records(&self) -> &[serde_json::Value] {
        &self.ex.log.records
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
        let now = self.ex.now();
        match (key, kind) {
            (Key::Node(n), EventType::Put) => {
                if let Ok(m) = serde_json::from_slice::<NodeMsg>(value) {
                    self.node_joined(n, m, now);
                }
            }
            (Key::Node(n), EventType::Delete) => self.node_left(n, now),
            (Key::Beats(n), EventType::Put) => {
                if let Ok(b) = serde_json::from_slice::<BeatsMsg>(value) {
                    self.beats(n, b, now).await?;
                }
            }
            (Key::Exit(g, rank), EventType::Put) => {
                if let Ok(e) = serde_json::from_slice::<ExitMsg>(value) {
                    self.exited(g, rank, e.status, now);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Node `n` registered.
    fn node_joined(&mut self, n: u32, m: NodeMsg, now: Duration) {
        self.cluster.alive.insert(n, m);
        // A lost node's agent registered again (the machine was repaired): the job may grow
        // back onto it at the next commit.
        if self.cluster.lost.remove(&n) {
            info!(node = n, "a lost node's agent registered again");
            self.ex.push(Event::NodeBack { node: n, now });
        }
    }

    /// Node `n`'s lease is gone: its ranks are gone too.
    fn node_left(&mut self, n: u32, now: Duration) {
        let c = &mut self.cluster;
        c.alive.remove(&n);
        c.lost.insert(n);
        warn!(node = n, "node left: its agent's etcd lease is gone");
        if let Some(r) = c.running.as_mut() {
            for a in r.assignments.iter().filter(|a| a.node == n) {
                if r.exited.insert(a.rank) {
                    self.ex.push(Event::Exited {
                        generation: r.internal,
                        rank: a.rank,
                        status: ExitStatus::Signal(9),
                        now,
                    });
                }
            }
        }
    }

    /// Node `n` relayed its ranks' beats.
    async fn beats(&mut self, n: u32, b: BeatsMsg, now: Duration) -> Result<()> {
        let c = &mut self.cluster;
        c.last_seen.insert(n, now);
        let Some(r) = c.running.as_ref() else {
            return Ok(());
        };
        if b.generation != r.global {
            return Ok(());
        }
        let (internal, world) = (r.internal, r.world);
        let on_node: Vec<u32> = r
            .assignments
            .iter()
            .filter(|a| a.node == n)
            .map(|a| a.rank)
            .collect();
        for p in &b.partials {
            c.losses
                .add(b.generation, p.step, &p.workload, world)
                .await?;
        }
        for rank in b.starting {
            self.ex.push(Event::Alive {
                generation: internal,
                rank,
                now,
            });
        }
        for (rank, step) in b.steps {
            self.ex.push(Event::Heartbeat {
                generation: internal,
                rank,
                step,
                now,
            });
        }
        for rank in on_node {
            self.ex.push(Event::Stopped {
                generation: internal,
                rank,
                stopped: b.stopped.contains(&rank),
                now,
            });
        }
        Ok(())
    }

    /// A rank of store generation `g` ended.
    fn exited(&mut self, g: u64, rank: u32, status: ExitStatus, now: Duration) {
        if let Some(r) = self.cluster.running.as_mut()
            && r.global == g
            && r.exited.insert(rank)
        {
            self.ex.push(Event::Exited {
                generation: r.internal,
                rank,
                status,
                now,
            });
        }
    }

    /// Time passes: a tick for the coordinator, and the start of the job once every node
    /// that runs ranks at the start has joined (or the join timeout passed).
    pub(super) fn tick(&mut self) {
        let now = self.ex.now();
        if let Some(deadline) = self.join_deadline {
            let alive = &self.cluster.alive;
            let joined = (0..self.nodes).all(|n| alive.contains_key(&n));
            if joined || Instant::now() >= deadline {
                if !joined {
                    let missing: Vec<u32> =
                        (0..self.nodes).filter(|n| !alive.contains_key(n)).collect();
                    warn!(?missing, "starting without nodes that did not join in time");
                }
                self.join_deadline = None;
                self.ex.push(Event::Start { now });
            }
            return;
        }
        self.ex.push(Event::Tick { now });
    }

    /// While the coordinator waits to grow the job back onto returned nodes, tell it the newest
    /// committed step, as the local supervisor does ([`Executor::poll_commits`]); while it
    /// watches the replicas, the new commits whose replicas disagree
    /// ([`Executor::poll_replicas`]).
    pub(super) async fn poll_commits(&mut self) {
        self.ex.poll_commits().await;
        self.ex.poll_replicas().await;
    }

    /// Feed the pending events to the coordinator and carry out its actions.
    pub(super) async fn drive(&mut self, sess: &mut Session) -> Result<()> {
        let mut fx = Published {
            c: &mut self.cluster,
            sess,
        };
        self.ex.drive(&mut fx).await
    }

    /// Carry out the coordinator's actions.
    pub(super) async fn act(&mut self, sess: &mut Session, actions: Vec<Action>) -> Result<()> {
        let mut fx = Published {
            c: &mut self.cluster,
            sess,
        };
        self.ex.execute(&mut fx, actions).await
    }
}

/// What the coordinator taking over on `node` inherits of `plan`'s generation (laid out as
/// `layout`): the ranks known to have ended, the nodes whose agents are gone (and the previous
/// coordinator's), the highest step reported, whether stopping had begun.
fn inherited(
    node: u32,
    plan: &PlanMsg,
    layout: Layout,
    view: &JobState,
    previous: Option<u32>,
) -> TakeOver {
    let g = plan.generation;
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
    if let Some(p) = previous.filter(|p| *p != node) {
        lost_nodes.insert(
            p,
            format!("it ran the coordinator, whose etcd lease expired; node {node} took over"),
        );
    }
    let max_step = view
        .beats
        .values()
        .filter(|b| b.generation == g)
        .flat_map(|b| b.steps.iter().map(|s| s.1))
        .max()
        .unwrap_or(0);
    TakeOver {
        generation: g,
        layout,
        assignments: plan.assignments.clone(),
        excluded,
        restarts: plan.restarts,
        max_step,
        stopping: signal.is_some(),
        killed: signal.is_some_and(|s| s.kill),
        exited,
        lost_nodes,
    }
}

impl Published<'_> {
    /// With a local tier per machine, once the running generation is stopped: wait until
    /// every live node that ran its ranks has drained its newest step (`drained/<g>/<node>`),
    /// or the drain wait (and a second) passed, so that the step chosen next counts the
    /// steps those drains commit on the store.
    ///
    /// When every rank of the generation exited before the coordinator signalled any (a crash
    /// of them all at once), no stop signal exists and no node would drain: the coordinator
    /// publishes one that signals no rank, so the nodes drain all the same.
    async fn wait_for_drains(&mut self, excluded: Vec<u32>) -> Result<()> {
        let (Some(wait), Some(r)) = (self.c.drain_wait, self.c.running.as_ref()) else {
            return Ok(());
        };
        let g = r.global;
        let mut waiting: BTreeSet<u32> = r
            .assignments
            .iter()
            .map(|a| a.node)
            .filter(|n| !self.c.lost.contains(n))
            .collect();
        let deadline = Instant::now() + wait + Duration::from_secs(1);
        let root = self.c.keys.root();
        let t0 = Instant::now();
        let mut excluded = Some(excluded);
        loop {
            let (_, kvs) = self.sess.get_prefix(&root).await?;
            let mut alive = BTreeSet::new();
            let mut signalled = false;
            for kv in &kvs {
                match self.c.keys.parse(kv.key()) {
                    Some(Key::Node(n)) => {
                        alive.insert(n);
                    }
                    Some(Key::Drained(dg, n)) if dg == g => {
                        waiting.remove(&n);
                    }
                    Some(Key::Signals(sg)) if sg == g => signalled = true,
                    _ => {}
                }
            }
            // A node that died meanwhile drains nothing more.
            waiting.retain(|n| alive.contains(n));
            let past = Instant::now() >= deadline;
            match drain_wait_step(signalled, excluded.is_some(), &waiting, past) {
                DrainWait::AskToDrain => {
                    info!(
                        generation = g,
                        "no rank was left to stop: asking the nodes to drain all the same"
                    );
                    let msg = SignalMsg {
                        ranks: Vec::new(),
                        kill: false,
                        excluded: excluded.take().unwrap_or_default(),
                    };
                    let body = serde_json::to_vec(&msg).expect("signals serialize");
                    let key = self.c.keys.key(Key::Signals(g));
                    self.publish(vec![(key, body)], None).await?;
                }
                DrainWait::Wait => {}
                DrainWait::Drained => {
                    info!(
                        generation = g,
                        seconds = t0.elapsed().as_secs_f64(),
                        "every live node drained its newest step of the stopped generation"
                    );
                    return Ok(());
                }
                DrainWait::TimedOut => {
                    warn!(
                        generation = g,
                        nodes = ?waiting,
                        "choosing the step to resume from without these nodes' drains"
                    );
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn guard(&self) -> String {
        self.c.keys.key(Key::Leader)
    }

    /// Write `puts` in one transaction guarded by the leader key (`once`: a key among them
    /// created only if absent).
    async fn publish(&mut self, puts: Vec<(String, Vec<u8>)>, once: Option<&str>) -> Result<()> {
        let guard = self.guard();
        self.sess.put_guarded(&guard, self.c.rev, puts, once).await
    }

    /// The plan of generation `global` (`generation` to the coordinator), with the master
    /// address of rank 0's node.
    fn plan(
        &self,
        ex: &Executor,
        global: u64,
        layout: &Layout,
        assignments: &[Assignment],
        resume_from: Option<u64>,
    ) -> PlanMsg {
        let rank0 = assignments.iter().find(|a| a.rank == 0).map(|a| a.node);
        let (master_addr, master_port) = match rank0.and_then(|n| self.c.alive.get(&n)) {
            Some(m) => (m.addr.clone(), m.port),
            None => ("127.0.0.1".to_string(), free_port()),
        };
        PlanMsg {
            generation: global,
            layout: layout.to_string(),
            assignments: assignments.to_vec(),
            resume_from,
            master_addr,
            master_port,
            leader: self.c.node,
            excluded: ex.coord.excluded(),
            restarts: ex.coord.restarts(),
            peer_secret: self.c.peer_secret.clone(),
        }
    }
}

/// What the coordinator does next while it waits for the drains of a stopped generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DrainWait {
    /// Publish a stop signal for no rank: every rank exited before one was sent, and the
    /// nodes drain on the signal.
    AskToDrain,
    /// Look again shortly.
    Wait,
    /// Every live node said it drained.
    Drained,
    /// The drain wait passed.
    TimedOut,
}

/// The next move of [`Published::wait_for_drains`]: whether the generation's stop signal
/// exists, whether the coordinator may still publish one (it does once), the live nodes that
/// have not said they drained, and whether the drain wait has passed.
fn drain_wait_step(
    signalled: bool,
    may_ask: bool,
    waiting: &BTreeSet<u32>,
    past_deadline: bool,
) -> DrainWait {
    if !signalled && may_ask {
        DrainWait::AskToDrain
    } else if signalled && waiting.is_empty() {
        DrainWait::Drained
    } else if past_deadline {
        DrainWait::TimedOut
    } else {
        DrainWait::Wait
    }
}

impl Effects for Published<'_> {
    fn generation(&self, g: u64) -> u64 {
        self.c.gens.global(g)
    }

    /// A generation's store number is fixed (its marker written) before its `started`
    /// record, which comes first.
    async fn prepare(&mut self, ex: &mut Executor, actions: &[Action]) -> Result<()> {
        if actions
            .iter()
            .any(|a| matches!(a, Action::ChooseStep { .. }))
        {
            self.wait_for_drains(ex.coord.excluded()).await?;
        }
        for a in actions {
            if let Action::Start { generation, .. } = a {
                self.c
                    .gens
                    .allocate(*generation, &ex.store, &ex.run)
                    .await?;
            }
        }
        Ok(())
    }

    async fn start(&mut self, ex: &mut Executor, s: Start) -> Result<()> {
        let Start {
            generation,
            layout,
            assignments,
            resume_from,
        } = s;
        let global = self.c.gens.global(generation);
        let plan = self.plan(ex, global, &layout, &assignments, resume_from);
        let body = serde_json::to_vec(&plan).expect("plans serialize");
        let once = self.c.keys.key(Key::Plans(global));
        let plan_key = self.c.keys.key(Key::Plan);
        self.publish(
            vec![(plan_key, body.clone()), (once.clone(), body)],
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
        let now = ex.now();
        for a in &r.assignments {
            if !self.c.alive.contains_key(&a.node) && r.exited.insert(a.rank) {
                warn!(
                    node = a.node,
                    rank = a.rank,
                    "rank placed on a node that is not alive"
                );
                self.c.lost.insert(a.node);
                ex.push(Event::Exited {
                    generation,
                    rank: a.rank,
                    status: ExitStatus::Signal(9),
                    now,
                });
            }
        }
        self.c.running = Some(r);
        Ok(())
    }

    async fn signal(
        &mut self,
        ex: &mut Executor,
        generation: u64,
        ranks: Vec<u32>,
        kill: bool,
    ) -> Result<()> {
        let global = self.c.gens.global(generation);
        let msg = SignalMsg {
            ranks,
            kill,
            excluded: ex.coord.excluded(),
        };
        let body = serde_json::to_vec(&msg).expect("signals serialize");
        let key = self.c.keys.key(Key::Signals(global));
        self.publish(vec![(key, body)], None).await
    }

    /// A node whose lease expired shows up as SIGKILLed ranks; say so, and count the
    /// detection from the node's last heartbeats.
    fn amend(&mut self, ex: &Executor, logged: &mut Record) {
        if let LogEvent::Failure(f) = logged
            && f.how == "signal"
            && self.c.lost.contains(&f.node)
        {
            let n = f.node;
            if let Some(seen) = self.c.last_seen.get(&n) {
                f.detection_s = ex.now().saturating_sub(*seen).as_secs_f64();
            }
            f.how = "node".into();
            f.detail = format!(
                "node {n} left: its agent's etcd lease expired (the machine or the agent died); {}",
                f.detail
            );
        }
    }

    async fn done(&mut self, ex: &mut Executor, ok: bool, reason: String) -> Result<()> {
        self.c.losses.flush().await;
        let msg = DoneMsg {
            ok,
            reason,
            generation: self.c.running.as_ref().map(|r| r.global),
            layout: ex.coord.layout().to_string(),
            restarts: ex.coord.restarts(),
        };
        let body = serde_json::to_vec(&msg).expect("done serializes");
        let key = self.c.keys.key(Key::Done);
        self.publish(vec![(key, body)], None).await?;
        self.c.finished = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gone_before_a_stop_signal_still_sets_the_nodes_draining() {
        let two: BTreeSet<u32> = [0, 1].into();
        let none = BTreeSet::new();
        // No signal yet (every rank exited first): publish one, once, then wait for it and
        // for the drains; the nodes that drained are waited for like after any stop.
        assert_eq!(
            drain_wait_step(false, true, &two, false),
            DrainWait::AskToDrain
        );
        assert_eq!(
            drain_wait_step(false, true, &none, true),
            DrainWait::AskToDrain
        );
        assert_eq!(drain_wait_step(false, false, &two, false), DrainWait::Wait);
        assert_eq!(drain_wait_step(true, false, &two, false), DrainWait::Wait);
        assert_eq!(
            drain_wait_step(true, false, &none, false),
            DrainWait::Drained
        );
        // A signal the coordinator sent when it stopped the ranks: no second one.
        assert_eq!(drain_wait_step(true, true, &two, false), DrainWait::Wait);
        assert_eq!(
            drain_wait_step(true, true, &none, false),
            DrainWait::Drained
        );
        // The wait is bounded either way.
        assert_eq!(drain_wait_step(true, true, &two, true), DrainWait::TimedOut);
        assert_eq!(
            drain_wait_step(false, false, &two, true),
            DrainWait::TimedOut
        );
    }
}
