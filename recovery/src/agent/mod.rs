//! The driver across machines behind `ckpt agent`: one agent per machine (node), membership
//! through etcd, one elected coordinator.
//!
//! Every agent registers its node under a lease it keeps alive; a node whose lease expires
//! (the machine, its network or the agent died) is dead. The agents campaign to be the one
//! coordinator by creating the `leader` key under their lease; the winner runs the same
//! [`Coordinator`](crate::Coordinator) as the local supervisor, fed with etcd events, and publishes what it
//! decides. Every agent (the coordinator's too) watches the prefix, starts and stops its own
//! ranks as the plans and signals say (with the same environment as `ckpt resume`), relays
//! their heartbeats from its local socket, and reports their exits. When the coordinator's
//! node dies, another agent wins the election and carries on (see
//! [`Coordinator::take_over`](crate::Coordinator::take_over)): the old coordinator's node is failed like any other, and the
//! job restarts from the newest committed checkpoint on a new generation.
//!
//! # Key layout
//!
//! Under the prefix (`--prefix`, default `/ckpt/<run>`), all values JSON:
//!
//! | key | written by | lease | value |
//! |---|---|---|---|
//! | `job` | the first agent, once | no | [`JobMsg`]: run, nodes, ranks per node, spares, layout; every agent checks its own settings against it |
//! | `nodes/<node>` | each agent, created once | agent's | [`NodeMsg`]: address, a free port, pid. Deleted when the lease expires: the node is dead |
//! | `leader` | the coordinator, created only if absent (the election) | coordinator's | its node id |
//! | `plan` | the coordinator | no | [`PlanMsg`] of the current generation: generation, layout, rank -> node assignments, resume_from, `MASTER_ADDR`/`MASTER_PORT`, excluded nodes, restarts |
//! | `plans/<gen>` | the coordinator, created once per generation | no | the same plan, kept as history |
//! | `signals/<gen>` | the coordinator | no | [`SignalMsg`]: ranks of that generation to stop, SIGTERM or SIGKILL |
//! | `beats/<node>` | each agent, every heartbeat interval | agent's | [`BeatsMsg`]: steps its ranks reported since the last relay, with their partial loss sums |
//! | `exits/<gen>/<rank>` | the rank's agent | no | [`ExitMsg`]: exit code or signal |
//! | `done` | the coordinator | no | [`DoneMsg`]: ok, reason, last generation and layout, restarts |
//!
//! Every coordinator write is one transaction guarded by the `leader` key's create revision,
//! so a coordinator that lost its role (its lease expired) writes nothing more; `plans/<gen>`
//! is created only if absent, so each generation has exactly one plan. Generations are the
//! store's numbers (generation markers, commit fencing), continuing across supervisions.
//!
//! An agent starts ranks only for plans published after it registered, so an agent restarted
//! on a node the coordinator gave up on does not start stale ranks.

mod etcd;
pub mod keys;
mod leader;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use ckpt_store::{Error, ErrorKind, Result};
use etcd_client::{EventType, KeyValue};
use serde::Serialize;
use tokio::net::UnixDatagram;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use crate::coordinator::ExitStatus;
use crate::driver::{
    JobOptions, Launch, RankExit, free_port, private_dir, process_stopped, remove_private_dir,
    signal_rank,
};
use crate::heartbeat::Beat;
pub use keys::{
    BeatsMsg, DoneMsg, DrainedMsg, ExitMsg, JobMsg, Key, Keys, NodeMsg, Partial, PlanMsg, SignalMsg,
};
use leader::Leader;

/// What `ckpt agent` asks for.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// etcd endpoints, comma-separated (`http://10.0.0.5:2379,...`).
    pub etcd: String,
    /// Key prefix of the job (default `/ckpt/<run>`).
    pub prefix: Option<String>,
    /// This agent's node id: `0..nodes + spares`.
    pub node: u32,
    /// The job: store, run, coordinator settings (the coordinating agent's apply), command,
    /// this node's rank logs, heartbeats (relayed as often as ranks beat), how the agent and
    /// its coordinator open the store.
    pub job: JobOptions,
    /// The agent's lease: a node silent for this long is dead.
    pub lease_ttl: Duration,
    /// How long a new coordinator waits for the first `nodes` nodes to join before it starts
    /// without the missing ones (whose ranks then fail at once).
    pub join_timeout: Duration,
    /// The address other machines reach this one at (`MASTER_ADDR` when it runs rank 0);
    /// default: the host name.
    pub addr: Option<String>,
    /// Keep peer replicas: this agent also serves as the node's replica agent (see
    /// `crate::peer`), registered with the node so every agent's ranks find it. It
    /// listens on `addr` exactly (loopback without one), serves only clients proving the
    /// job's secret ([`AgentOptions::peer_secret`], else the one the first coordinator put in
    /// the plan), and holds at most [`AgentOptions::peer_memory_limit`] bytes.
    pub peer_replicas: bool,
    /// The job's replica secret, where the agent's launcher has one (`ckpt agent` reads
    /// `CKPT_PEER_SECRET`); `None`: the one the first coordinator puts in the plan.
    pub peer_secret: Option<crate::peer::PeerSecret>,
    /// The most bytes of snapshots the replica agent holds (`None`: a quarter of the
    /// machine's memory, [`crate::peer::default_memory_limit`]).
    pub peer_memory_limit: Option<u64>,
    /// With a local tier per machine: when a generation is stopped, each node drains its
    /// ranks of the generation's newest step it committed (the coordinator chooses the step
    /// to resume from once every live node did), for at most this long.
    pub drain_wait: Duration,
}

impl AgentOptions {
    /// The key prefix.
    pub fn prefix(&self) -> String {
        self.prefix
            .clone()
            .unwrap_or_else(|| format!("/ckpt/{}", self.job.run))
    }
}

/// A generation this node took part in.
#[derive(Debug, Clone, Serialize)]
pub struct GenerationRun {
    /// Generation.
    pub generation: u64,
    /// Its layout.
    pub layout: String,
    /// Ranks it started here.
    pub ranks: Vec<u32>,
    /// The coordinator's node.
    pub leader: u32,
}

/// What one agent saw of the job.
#[derive(Debug, Clone, Serialize)]
pub struct AgentReport {
    /// This node.
    pub node: u32,
    /// Whether the job completed.
    pub ok: bool,
    /// Why it ended.
    pub reason: String,
    /// Restarts the coordinator made.
    pub restarts: u32,
    /// The final layout.
    pub layout: String,
    /// Whether this agent was the coordinator at some point.
    pub coordinated: bool,
    /// The plans this node acted on, in order.
    pub generations: Vec<GenerationRun>,
    /// The recovery log records this agent wrote as the coordinator.
    pub records: Vec<serde_json::Value>,
}

/// The state of a job under its prefix, as read from etcd.
#[derive(Debug, Clone, Default, Serialize)]
pub struct JobState {
    /// The job's settings.
    pub job: Option<JobMsg>,
    /// Live nodes.
    pub nodes: BTreeMap<u32, NodeMsg>,
    /// The coordinator's node.
    pub leader: Option<u32>,
    /// The current plan.
    pub plan: Option<PlanMsg>,
    /// Revision at which the current plan was written.
    pub plan_rev: i64,
    /// Every generation's plan, with the number of times its key was written (1).
    pub plans: BTreeMap<u64, (PlanMsg, i64)>,
    /// Signals per generation.
    pub signals: BTreeMap<u64, SignalMsg>,
    /// Latest relayed heartbeats per node.
    pub beats: BTreeMap<u32, BeatsMsg>,
    /// Rank exits per (generation, rank).
    pub exits: BTreeMap<(u64, u32), ExitStatus>,
    /// With a local tier per machine: each node's drain of a stopped generation, per
    /// (generation, node).
    pub drained: BTreeMap<(u64, u32), DrainedMsg>,
    /// The end of the job.
    pub done: Option<DoneMsg>,
}

impl JobState {
    fn from_kvs(keys: &Keys, kvs: &[KeyValue]) -> Self {
        let mut s = JobState::default();
        for kv in kvs {
            let Some(k) = keys.parse(kv.key()) else {
                continue;
            };
            let v = kv.value();
            fn de<T: serde::de::DeserializeOwned>(k: &KeyValue) -> Option<T> {
                match serde_json::from_slice(k.value()) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        warn!("ignoring {}: {e}", String::from_utf8_lossy(k.key()));
                        None
                    }
                }
            }
            match k {
                Key::Job => s.job = de(kv),
                Key::Node(n) => {
                    if let Some(m) = de(kv) {
                        s.nodes.insert(n, m);
                    }
                }
                Key::Leader => s.leader = serde_json::from_slice(v).ok(),
                Key::Plan => {
                    s.plan = de(kv);
                    s.plan_rev = kv.mod_revision();
                }
                Key::Plans(g) => {
                    if let Some(p) = de(kv) {
                        s.plans.insert(g, (p, kv.version()));
                    }
                }
                Key::Signals(g) => {
                    if let Some(m) = de(kv) {
                        s.signals.insert(g, m);
                    }
                }
                Key::Beats(n) => {
                    if let Some(m) = de(kv) {
                        s.beats.insert(n, m);
                    }
                }
                Key::Exit(g, r) => {
                    if let Some(m) = de::<ExitMsg>(kv) {
                        s.exits.insert((g, r), m.status);
                    }
                }
                Key::Drained(g, n) => {
                    if let Some(m) = de(kv) {
                        s.drained.insert((g, n), m);
                    }
                }
                Key::Done => s.done = de(kv),
            }
        }
        s
    }
}

/// Read the state of the job under `prefix` (for tools and tests).
pub async fn job_state(etcd: &str, prefix: &str) -> Result<JobState> {
    let client = etcd::connect(etcd).await?;
    let mut sess = etcd::Session {
        client,
        endpoints: etcd.to_string(),
        lease: 0,
    };
    let keys = Keys::new(prefix);
    let (_, kvs) = sess.get_prefix(&keys.root()).await?;
    Ok(JobState::from_kvs(&keys, &kvs))
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "127.0.0.1".to_string())
}

/// Run this node's agent (see the module docs) until the job is over. The report says
/// whether the job completed; an `Err` means this agent could not go on (etcd unreachable
/// for longer than its lease, lost the coordinator role, stopped by a signal, bad settings).
pub async fn run(opts: AgentOptions) -> Result<AgentReport> {
    let t = opts.job.config.topology;
    if opts.job.command.is_empty() {
        return Err(Error::invalid("no command to run: pass it after --"));
    }
    ckpt_store::validate_run(&opts.job.run)?;
    if opts.node >= t.nodes + t.spares {
        return Err(Error::invalid(format!(
            "--node {} is out of range: the job has nodes 0..{} ({} nodes + {} spares)",
            opts.node,
            t.nodes + t.spares,
            t.nodes,
            t.spares
        )));
    }
    let client = etcd::connect(&opts.etcd).await?;
    let sess = etcd::Session::open(client, &opts.etcd, opts.lease_ttl).await?;
    let sock_dir = private_dir(&format!("agent-{}", opts.node))?;
    let sock_path = sock_dir.join("heartbeat.sock");
    let sock = UnixDatagram::bind(&sock_path)
        .map_err(|e| Error::io("binding the heartbeat socket", &sock_path.display(), e))?;
    let (exit_tx, exit_rx) = mpsc::unbounded_channel::<RankExit>();
    let mut launch = Launch::new(&opts.job, sock_path, sock_dir.join("node-cache"), None);
    // Several machines: each node's local tier holds its own ranks, committed there together.
    launch.local_tier_per_node = t.nodes + t.spares > 1;
    let mut agent = Agent {
        keys: Keys::new(&opts.prefix()),
        launch,
        opts,
        sess,
        exit_tx,
        children: HashMap::new(),
        reg_rev: 0,
        current: None,
        fresh: BTreeMap::new(),
        starting: BTreeSet::new(),
        partials: Vec::new(),
        stopped: BTreeSet::new(),
        last_leader: None,
        leader: None,
        campaign: false,
        done: None,
        drained: BTreeSet::new(),
        report: Vec::new(),
        coordinated: false,
        replicas: None,
    };
    let r = agent.run(sock, exit_rx).await;
    agent.cleanup().await;
    remove_private_dir(&sock_dir);
    match &r {
        Ok(rep) => info!(node = rep.node, ok = rep.ok, "agent done: {}", rep.reason),
        Err(e) => error!(node = agent.opts.node, "agent stopped: {e}"),
    }
    r
}

struct Agent {
    opts: AgentOptions,
    keys: Keys,
    sess: etcd::Session,
    launch: Launch,
    exit_tx: mpsc::UnboundedSender<RankExit>,
    /// Local ranks: (generation, rank) -> pid.
    children: HashMap<(u64, u32), u32>,
    /// Revision at which this agent registered.
    reg_rev: i64,
    /// The plan this node acts on.
    current: Option<PlanMsg>,
    /// Steps local ranks reported since the last relay.
    fresh: BTreeMap<u32, u64>,
    /// Local ranks that beat while starting since the last relay (no step yet).
    starting: BTreeSet<u32>,
    partials: Vec<Partial>,
    /// Local ranks of the current generation whose processes were stopped at the last relay.
    stopped: BTreeSet<u32>,
    last_leader: Option<u32>,
    leader: Option<Leader>,
    campaign: bool,
    done: Option<DoneMsg>,
    /// Stopped generations this node drained (with a local tier per machine).
    drained: BTreeSet<u64>,
    report: Vec<GenerationRun>,
    coordinated: bool,
    /// This node's replica agent, with peer replicas.
    replicas: Option<Arc<crate::peer::AgentState>>,
}

impl Agent {
    fn key(&self, k: Key) -> String {
        self.keys.key(k)
    }

    async fn run(
        &mut self,
        sock: UnixDatagram,
        mut exit_rx: mpsc::UnboundedReceiver<RankExit>,
    ) -> Result<AgentReport> {
        let ttl = self.opts.lease_ttl;
        let mut lease_lost = self.sess.keep_alive(ttl);
        self.join().await?;
        let (rev, kvs) = self.sess.get_prefix(&self.keys.root()).await?;
        let view = JobState::from_kvs(&self.keys, &kvs);
        if let Some(d) = &view.done {
            return Err(Error::invalid(format!(
                "the job under {} is already over ({}: {}); pick another --prefix, or delete \
                 this one with `etcdctl del --prefix {}`",
                self.keys.prefix(),
                if d.ok { "completed" } else { "failed" },
                d.reason,
                self.keys.root()
            )));
        }
        let mut watch = self.sess.watch(&self.keys.root(), rev + 1).await?;
        if let Some(p) = view.plan.clone()
            && view.plan_rev > self.reg_rev
            && !view.signals.contains_key(&p.generation)
        {
            self.on_plan(p).await?;
        }
        self.last_leader = view.leader;
        self.campaign = view.leader.is_none();
        let mut sigterm = signal(SignalKind::terminate())
            .map_err(|e| Error::io("installing a signal handler", &"SIGTERM", e))?;
        let mut sigint = signal(SignalKind::interrupt())
            .map_err(|e| Error::io("installing a signal handler", &"SIGINT", e))?;
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        let mut relay = tokio::time::interval(self.opts.job.heartbeat_interval);
        let mut buf = vec![0u8; 4096];
        loop {
            if let Some(d) = self.done.take() {
                return Ok(self.finish(d).await);
            }
            if self.campaign {
                self.campaign = false;
                self.campaign().await?;
            }
            if let Some(l) = self.leader.as_mut() {
                l.drive(&mut self.sess).await?;
            }
            tokio::select! {
                m = watch.message() => {
                    let resp = m
                        .map_err(|e| etcd::etcd_error(&self.opts.etcd, "watching the job", e))?
                        .ok_or_else(|| Error::new(ErrorKind::Backend, format!("etcd at {}: the watch of {} ended", self.opts.etcd, self.keys.root())))?;
                    if resp.canceled() {
                        return Err(Error::new(ErrorKind::Backend, format!(
                            "etcd at {}: the watch of {} was canceled: {}",
                            self.opts.etcd, self.keys.root(), resp.cancel_reason()
                        )));
                    }
                    for ev in resp.events() {
                        if let Some(kv) = ev.kv() {
                            self.on_event(ev.event_type(), kv).await?;
                        }
                    }
                }
                r = sock.recv(&mut buf) => {
                    if let Ok(n) = r
                        && let Ok(b) = serde_json::from_slice::<Beat>(&buf[..n])
                    {
                        self.on_beat(b);
                    }
                }
                Some((g, rank, status)) = exit_rx.recv() => {
                    self.on_exit(g, rank, status).await?;
                }
                _ = relay.tick() => self.relay().await?,
                _ = tick.tick() => {
                    if let Some(l) = self.leader.as_mut() {
                        l.tick();
                        l.poll_commits().await;
                    }
                }
                why = &mut lease_lost => {
                    let why = why.unwrap_or_else(|_| "the keep-alive task ended".into());
                    return Err(Error::new(ErrorKind::Fenced, format!(
                        "node {} lost its etcd lease ({why}): it is out of the job, its ranks are stopped",
                        self.opts.node
                    )));
                }
                _ = sigterm.recv() => return Err(self.stopped("SIGTERM")),
                _ = sigint.recv() => return Err(self.stopped("SIGINT")),
            }
        }
    }

    fn stopped(&self, sig: &str) -> Error {
        Error::new(
            ErrorKind::Io,
            format!(
                "agent of node {} stopped by {sig}: its ranks are stopped and the node leaves the job",
                self.opts.node
            ),
        )
    }

    /// Check the job's settings, and register this node.
    async fn join(&mut self) -> Result<()> {
        let c = &self.opts.job.config;
        let job = JobMsg {
            run: self.opts.job.run.clone(),
            nodes: c.topology.nodes,
            ranks_per_node: c.topology.ranks_per_node,
            spares: c.topology.spares,
            layout: c.layout.to_string(),
        };
        let job_key = self.key(Key::Job);
        if self.sess.create(&job_key, &job, false).await?.is_none() {
            let theirs: Option<JobMsg> = self
                .sess
                .get(&job_key)
                .await?
                .and_then(|v| serde_json::from_slice(&v).ok());
            if let Some(theirs) = theirs
                && theirs != job
            {
                return Err(Error::invalid(format!(
                    "node {} was started with {} but the job under {} has {}: start every \
                     agent of a job with the same settings",
                    self.opts.node,
                    job.flags(),
                    self.keys.prefix(),
                    theirs.flags()
                )));
            }
        }
        let host = self.opts.addr.clone().unwrap_or_else(host_name);
        let replica = match self.opts.peer_replicas {
            // Exactly the address given, never the host name by default.
            true => {
                let bind = self.opts.addr.clone().unwrap_or_else(|| "127.0.0.1".into());
                Some(self.serve_replicas(&bind).await?)
            }
            false => None,
        };
        let me = NodeMsg {
            node: self.opts.node,
            addr: host,
            port: free_port(),
            pid: std::process::id(),
            replica,
        };
        let key = self.key(Key::Node(self.opts.node));
        // A restarted agent waits for its predecessor's lease to expire.
        let deadline = tokio::time::Instant::now() + self.opts.lease_ttl * 2;
        loop {
            if let Some(rev) = self.sess.create(&key, &me, true).await? {
                self.reg_rev = rev;
                info!(
                    node = self.opts.node,
                    prefix = self.keys.prefix(),
                    "registered"
                );
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorKind::Conflict,
                    format!(
                        "node {} is already registered at {key}: another `ckpt agent --node {}` \
                         is running for this job",
                        self.opts.node, self.opts.node
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Serve this node's peer replicas from this process (they live as long as the agent, so
    /// a lost machine loses its replica with its ranks); returns the address to publish.
    async fn serve_replicas(&mut self, host: &str) -> Result<String> {
        let l = tokio::net::TcpListener::bind((host, 0))
            .await
            .map_err(|e| Error::io("listening for peer replicas on", &host, e))?;
        let port = l
            .local_addr()
            .map_err(|e| Error::io("listening for peer replicas on", &host, e))?
            .port();
        let limit = self
            .opts
            .peer_memory_limit
            .unwrap_or_else(crate::peer::default_memory_limit);
        let state =
            crate::peer::AgentState::new(self.opts.node, self.opts.peer_secret.clone(), limit);
        self.replicas = Some(state.clone());
        tokio::spawn(async move {
            if let Err(e) = crate::peer::serve(l, state).await {
                warn!("the replica agent stopped: {e}");
            }
        });
        let addr = format!("{host}:{port}");
        info!(node = self.opts.node, addr, "serving peer replicas");
        Ok(addr)
    }

    /// The replica agents of the registered (live) nodes, for the ranks' environment.
    async fn peer_agents(&mut self) -> Result<Vec<(u32, String)>> {
        if !self.opts.peer_replicas {
            return Ok(Vec::new());
        }
        let prefix = format!("{}/nodes/", self.keys.prefix());
        let (_, kvs) = self.sess.get_prefix(&prefix).await?;
        let mut out: Vec<(u32, String)> = kvs
            .iter()
            .filter_map(|kv| serde_json::from_slice::<NodeMsg>(kv.value()).ok())
            .filter_map(|n| n.replica.map(|r| (n.node, r)))
            .collect();
        out.sort();
        Ok(out)
    }

    /// Try to become the coordinator.
    async fn campaign(&mut self) -> Result<()> {
        let key = self.key(Key::Leader);
        let Some(rev) = self.sess.create(&key, &self.opts.node, true).await? else {
            self.last_leader = self
                .sess
                .get(&key)
                .await?
                .and_then(|v| serde_json::from_slice(&v).ok());
            return Ok(());
        };
        info!(node = self.opts.node, "elected coordinator");
        self.coordinated = true;
        let (snap, kvs) = self.sess.get_prefix(&self.keys.root()).await?;
        let view = JobState::from_kvs(&self.keys, &kvs);
        let previous = self.last_leader.filter(|p| *p != self.opts.node);
        let (mut l, actions) = Leader::new(&self.opts, rev, snap, &view, previous).await?;
        l.act(&mut self.sess, actions).await?;
        self.last_leader = Some(self.opts.node);
        self.leader = Some(l);
        Ok(())
    }

    async fn on_event(&mut self, kind: EventType, kv: &KeyValue) -> Result<()> {
        let Some(key) = self.keys.parse(kv.key()) else {
            return Ok(());
        };
        let value = kv.value();
        if let Some(l) = self.leader.as_mut() {
            l.on_watch(key, kind, value, kv.mod_revision()).await?;
        }
        match (key, kind) {
            (Key::Plan, EventType::Put) if kv.mod_revision() > self.reg_rev => {
                match serde_json::from_slice::<PlanMsg>(value) {
                    Ok(p) => self.on_plan(p).await?,
                    Err(e) => warn!("ignoring a plan that does not parse: {e}"),
                }
            }
            (Key::Signals(g), EventType::Put) => {
                if let Ok(s) = serde_json::from_slice::<SignalMsg>(value) {
                    for r in &s.ranks {
                        if let Some(&pid) = self.children.get(&(g, *r)) {
                            signal_rank(pid, s.kill);
                        }
                    }
                }
                self.drain_stopped(g).await?;
            }
            (Key::Done, EventType::Put) => {
                if let Ok(d) = serde_json::from_slice::<DoneMsg>(value) {
                    self.done = Some(d);
                }
            }
            (Key::Leader, EventType::Put) => {
                self.last_leader = serde_json::from_slice(value).ok();
            }
            (Key::Leader, EventType::Delete) => {
                if self.leader.as_ref().is_some_and(|l| !l.finished()) {
                    return Err(Error::new(
                        ErrorKind::Fenced,
                        format!(
                            "node {} lost the coordinator role (its lease expired)",
                            self.opts.node
                        ),
                    ));
                }
                if self.leader.is_none() {
                    self.campaign = true;
                }
            }
            (Key::Node(n), EventType::Delete) if n == self.opts.node => {
                return Err(Error::new(
                    ErrorKind::Fenced,
                    format!(
                        "node {} was removed from the job (its lease expired)",
                        self.opts.node
                    ),
                ));
            }
            _ => {}
        }
        Ok(())
    }

    /// A new generation: stop what is left of older ones here, start this node's ranks.
    async fn on_plan(&mut self, p: PlanMsg) -> Result<()> {
        if self
            .current
            .as_ref()
            .is_some_and(|c| c.generation >= p.generation)
        {
            return Ok(());
        }
        for (&(g, _), &pid) in &self.children {
            if g < p.generation {
                signal_rank(pid, true);
            }
        }
        self.fresh.clear();
        self.starting.clear();
        self.partials.clear();
        self.stopped.clear();
        let layout = p.layout()?;
        let mine: Vec<_> = p
            .assignments
            .iter()
            .filter(|a| a.node == self.opts.node)
            .copied()
            .collect();
        info!(
            node = self.opts.node,
            generation = p.generation,
            %layout,
            ranks = ?mine.iter().map(|a| a.rank).collect::<Vec<_>>(),
            "plan"
        );
        self.report.push(GenerationRun {
            generation: p.generation,
            layout: layout.to_string(),
            ranks: mine.iter().map(|a| a.rank).collect(),
            leader: p.leader,
        });
        let g = p.generation;
        self.current = Some(p.clone());
        if self.opts.peer_replicas {
            self.launch.peer_agents = self.peer_agents().await?;
            // The secret and membership of the replica agent come from the plan and the
            // registered nodes, never from what a client sends it.
            let secret = match &self.opts.peer_secret {
                Some(s) => Some(s.clone()),
                None => p.peer_secret.clone(),
            };
            if let Some(st) = &self.replicas {
                if let Some(s) = &secret {
                    st.set_secret(s.clone());
                }
                st.set_membership(crate::peer::Membership::of(
                    self.opts.node,
                    g,
                    &self.launch.peer_agents,
                ));
            }
            self.launch.peer_secret = secret;
        }
        self.launch.prune_node_caches(g);
        let node_ranks: Vec<u32> = mine.iter().map(|a| a.rank).collect();
        for a in mine {
            match self.launch.spawn(
                g,
                &layout,
                p.resume_from,
                (&a, &node_ranks),
                (&p.master_addr, p.master_port),
                g,
                &self.exit_tx,
            ) {
                Ok(pid) => {
                    self.children.insert((g, a.rank), pid);
                }
                Err(e) => {
                    error!(rank = a.rank, "cannot start the rank: {e}");
                    self.report_exit(g, a.rank, ExitStatus::Code(127)).await?;
                }
            }
        }
        Ok(())
    }

    fn on_beat(&mut self, b: Beat) {
        let Some(p) = &self.current else { return };
        if b.generation != p.generation || !self.children.contains_key(&(b.generation, b.rank)) {
            return;
        }
        if b.starting {
            if !self.fresh.contains_key(&b.rank) {
                self.starting.insert(b.rank);
            }
            return;
        }
        self.starting.remove(&b.rank);
        let e = self.fresh.entry(b.rank).or_insert(b.step);
        *e = (*e).max(b.step);
        if let Some(workload) = b.workload {
            self.partials.push(Partial {
                rank: b.rank,
                step: b.step,
                workload,
            });
        }
    }

    /// Relay the beats since the last relay (a rank that sent none is not reported: the
    /// coordinator sees it fall silent), and which ranks' processes are stopped (sent when
    /// that changed too: before its first beat, only this tells a stopped rank from a slow
    /// start).
    async fn relay(&mut self) -> Result<()> {
        let Some(p) = &self.current else {
            return Ok(());
        };
        let stopped: BTreeSet<u32> = self
            .children
            .iter()
            .filter(|((g, _), pid)| *g == p.generation && process_stopped(**pid))
            .map(|((_, r), _)| *r)
            .collect();
        if self.fresh.is_empty()
            && self.partials.is_empty()
            && self.starting.is_empty()
            && stopped == self.stopped
        {
            return Ok(());
        }
        let msg = BeatsMsg {
            generation: p.generation,
            steps: std::mem::take(&mut self.fresh).into_iter().collect(),
            starting: std::mem::take(&mut self.starting).into_iter().collect(),
            partials: std::mem::take(&mut self.partials),
            stopped: stopped.iter().copied().collect(),
        };
        self.stopped = stopped;
        let key = self.key(Key::Beats(self.opts.node));
        // Liveness is the lease's business: a lost relay only delays the beats.
        if let Err(e) = self.sess.put(&key, &msg, true).await {
            warn!("relaying heartbeats: {e}");
        }
        Ok(())
    }

    /// Report how a rank ended, retrying for as long as the lease lasts (the coordinator must
    /// hear of it).
    async fn report_exit(&mut self, g: u64, rank: u32, status: ExitStatus) -> Result<()> {
        let key = self.key(Key::Exit(g, rank));
        let deadline = tokio::time::Instant::now() + self.opts.lease_ttl;
        loop {
            match self.sess.put(&key, &ExitMsg { status }, false).await {
                Ok(()) => return Ok(()),
                Err(e) if tokio::time::Instant::now() < deadline => {
                    warn!("reporting the exit of rank {rank}: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Generation `g` is being stopped: with a local tier per machine, drain this node's
    /// ranks of the newest step they committed in its tier in `g` (if the store lacks it),
    /// within [`AgentOptions::drain_wait`], and say so under `drained/<g>/<node>`. Every live
    /// node of the generation does, and the coordinator chooses the step to resume from
    /// once they all said: a step every node committed locally is then on the store (the
    /// last node's drain committed it), and the job resumes from it rather than an older one.
    async fn drain_stopped(&mut self, g: u64) -> Result<()> {
        let Some(tier) = self.opts.job.local_tier.clone() else {
            return Ok(());
        };
        let ran = self.current.as_ref().is_some_and(|p| {
            p.generation == g && p.assignments.iter().any(|a| a.node == self.opts.node)
        });
        if !self.launch.local_tier_per_node
            || self.opts.drain_wait.is_zero()
            || !ran
            || !self.drained.insert(g)
        {
            return Ok(());
        }
        // In a task of its own: this agent (and the coordinator, on its node) goes on handling
        // events, its ranks' exits among them, while the drain runs.
        let (job, node, wait) = (self.opts.job.clone(), self.opts.node, self.opts.drain_wait);
        let key = self.key(Key::Drained(g, node));
        let mut sess = self.sess.clone();
        tokio::spawn(async move {
            let t0 = std::time::Instant::now();
            let drained = tokio::time::timeout(wait, drain_generation(&job, &tier, g, node)).await;
            let msg = match drained {
                Ok(Ok(m)) => {
                    info!(
                        generation = g,
                        steps = ?m.steps,
                        committed = ?m.committed,
                        seconds = t0.elapsed().as_secs_f64(),
                        "drained this node's ranks of the stopped generation"
                    );
                    m
                }
                Ok(Err(e)) => {
                    warn!(
                        generation = g,
                        "draining the stopped generation's newest step: {e}"
                    );
                    DrainedMsg {
                        steps: Vec::new(),
                        committed: None,
                        error: Some(e.to_string()),
                    }
                }
                Err(_) => {
                    warn!(
                        generation = g,
                        "the drain of the stopped generation was cut short after {wait:?}"
                    );
                    DrainedMsg {
                        steps: Vec::new(),
                        committed: None,
                        error: Some(format!("cut short after {} s", wait.as_secs_f64())),
                    }
                }
            };
            // Unsaid, the coordinator chooses once the drain wait passed.
            if let Err(e) = sess.put(&key, &msg, false).await {
                warn!(generation = g, "saying this node drained: {e}");
            }
        });
        Ok(())
    }

    async fn on_exit(&mut self, g: u64, rank: u32, status: ExitStatus) -> Result<()> {
        self.children.remove(&(g, rank));
        if status.success() {
            info!(generation = g, rank, "rank finished");
        } else {
            warn!(generation = g, rank, %status, "rank ended");
        }
        // Beats still buffered for the rank go first, so its last step is known.
        self.relay().await?;
        self.report_exit(g, rank, status).await
    }

    async fn finish(&mut self, d: DoneMsg) -> AgentReport {
        info!(node = self.opts.node, ok = d.ok, "job over: {}", d.reason);
        let records = self
            .leader
            .as_ref()
            .map(|l| l.records().to_vec())
            .unwrap_or_default();
        AgentReport {
            node: self.opts.node,
            ok: d.ok,
            reason: d.reason,
            restarts: d.restarts,
            layout: d.layout,
            coordinated: self.coordinated,
            generations: self.report.clone(),
            records,
        }
    }

    /// Stop what runs here and leave: ranks killed, the lease revoked (the node key, and the
    /// leader key if held, go with it).
    async fn cleanup(&mut self) {
        for &pid in self.children.values() {
            signal_rank(pid, true);
        }
        self.children.clear();
        self.sess.revoke().await;
    }
}

/// Drain node `node`'s ranks of the steps they committed in `tier` in generation `g` that the
/// store lacks, newest first, until one is committed on the store (by this drain or another
/// node's): the nodes of a generation may have got to different steps, and the newest step
/// every one of them committed is the one that lands (local retention keeps only a few).
async fn drain_generation(job: &JobOptions, tier: &str, g: u64, node: u32) -> Result<DrainedMsg> {
    let local = ckpt_store::open(tier)?;
    let remote = ckpt_store::open_with(&job.store_url, &job.open)?;
    let steps = local.log().node_committed_steps(&job.run).await?;
    let mut out = DrainedMsg {
        steps: Vec::new(),
        committed: None,
        error: None,
    };
    for &s in steps.iter().rev() {
        let newest_remote = remote.log().latest_committed(&job.run).await?;
        if newest_remote.is_some_and(|r| s <= r) {
            break;
        }
        let commits = match local.log().read_node_commits(&job.run, s).await {
            Ok(c) => c,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if !commits.iter().any(|c| c.generation == g) {
            continue;
        }
        let opts = ckpt_store::DrainOptions {
            writer: format!("agent-drain-{node}"),
            ..ckpt_store::DrainOptions::default()
        };
        let r = ckpt_store::drain_node(&local, &remote, &job.run, s, &opts).await?;
        out.steps.push(s);
        if r.remote_committed {
            out.committed = Some(s);
            break;
        }
    }
    Ok(out)
}
