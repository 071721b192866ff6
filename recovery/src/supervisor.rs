//! The local supervisor behind `ckpt resume`: the coordinator's driver on one machine.
//!
//! It launches the ranks of a command (any program embedding `CheckpointManager`, such as
//! `ckpt-train`) grouped into simulated nodes, with the rank, world, layout and generation in
//! the environment (`CKPT_*`, and torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`); receives heartbeats on a Unix socket;
//! feeds exits, heartbeats and ticks to the [`Coordinator`]; and carries out its actions:
//! signals, the choice of the newest committed step whose objects are all present (passed to
//! every rank as `CKPT_RESUME_STEP`), the verification of a step a rank could not restore,
//! the retirement of unusable steps, the restore plan, relaunches, and the recovery log (JSON
//! lines in the run's `events` log).
//!
//! With `repair_after`, a failed node is repaired: that long after its failure it comes back
//! ([`Event::NodeBack`]; with peer replicas, with a fresh, empty agent), unless the coordinator
//! keeps it out. While the coordinator waits for a commit to grow back at
//! ([`Coordinator::watching_commits`]), the supervisor polls the newest committed step of the
//! run every [`COMMIT_POLL`] and tells it ([`Event::Committed`]).
//!
//! The loop is short: events in (heartbeats, exits, ticks, repaired nodes), actions out
//! through the executor both drivers share (`executor`); what is this driver's own (rank
//! processes and replica agents on this machine, the store's generation numbers from the
//! first free one, the repair schedule, the end of the job) is its `Local` effects.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use crate::records::{Event as LogEvent, Logged, read_records};
use ckpt_store::{Error, Result};
use serde::Serialize;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixDatagram;
use tokio::sync::mpsc;
use tracing::info;

use crate::coordinator::{Coordinator, Event, Record};
use crate::driver::{
    JobOptions, Launch, LossBoard, RankExit, RecoveryLog, first_free_generation, free_port,
    private_dir, process_stopped, remove_private_dir, signal_rank,
};
pub use crate::driver::{RankPlan, choose_step, restore_plan};
pub use crate::executor::COMMIT_POLL;
use crate::executor::{Effects, Executor, Order, Start};
use crate::heartbeat::Beat;
use crate::peer::{Membership, PeerSecret};

/// What `ckpt resume` asks for: the job, and what only the local supervisor does.
#[derive(Debug, Clone)]
pub struct SupervisorOptions {
    /// The job: store, run, coordinator settings, command, logs, heartbeats.
    pub job: JobOptions,
    /// Peer replicas: the command that starts one node's replica agent (such as
    /// `ckpt replica-agent`; `--listen 127.0.0.1:0 --node N --watch-stdin` is appended, and the
    /// agent prints `listening ADDR` first). The agents listen on loopback only; a secret made
    /// for this supervision reaches them and the ranks in `CKPT_PEER_SECRET`, and each
    /// generation's live agents reach every agent as a `members` line on its standard input. One agent runs per node for the whole supervision; a failed
    /// node's agent is killed with its ranks.
    pub replica_agent: Option<Vec<String>>,
    /// A failed node is repaired and comes back this long after its failure (`None`: never).
    pub repair_after: Option<Duration>,
}

/// The outcome of a supervised job.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Whether the job completed.
    pub ok: bool,
    /// Why it ended.
    pub reason: String,
    /// Restarts made.
    pub restarts: u32,
    /// The recovery log of this supervision.
    pub records: Vec<serde_json::Value>,
    /// The final layout.
    pub layout: String,
    /// How each restarted generation's ranks restored (from their `restore` events).
    pub restores: Vec<RestoreSummary>,
}

/// The restores of one generation's ranks, summed.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct RestoreSummary {
    /// Generation.
    pub generation: u64,
    /// The step restored.
    pub step: u64,
    /// Ranks that restored.
    pub ranks: u32,
    /// Bytes the ranks restored.
    pub bytes: u64,
    /// Raw bytes served by peer replicas.
    pub bytes_from_peers: u64,
    /// Stored bytes read from the store.
    pub bytes_from_store: u64,
    /// Stored bytes read from the job's local tier.
    pub bytes_from_local: u64,
    /// Seconds of the slowest rank.
    pub slowest_s: f64,
}

/// Sum the `restore` events of generations after `base` (the first of this supervision
/// restores nothing it caused).
pub fn restore_summaries(events: &[Logged<LogEvent>], base: u64) -> Vec<RestoreSummary> {
    let mut by: BTreeMap<u64, RestoreSummary> = BTreeMap::new();
    for e in events {
        let LogEvent::Restore(e) = &e.record else {
            continue;
        };
        if e.generation <= base {
            continue;
        }
        let s = by.entry(e.generation).or_insert_with(|| RestoreSummary {
            generation: e.generation,
            ..RestoreSummary::default()
        });
        s.step = e.step;
        s.ranks += 1;
        s.bytes += e.bytes;
        s.bytes_from_peers += e.bytes_from_peers;
        s.bytes_from_store += e.bytes_from_store;
        s.bytes_from_local += e.bytes_from_local;
        s.slowest_s = s.slowest_s.max(e.seconds);
    }
    by.into_values().collect()
}

/// Supervise the job (see the module docs) until it completes or recovery gives up.
pub async fn run(opts: SupervisorOptions) -> Result<Report> {
    let job = &opts.job;
    if job.command.is_empty() {
        return Err(Error::invalid("no command to run: pass it after --"));
    }
    let store = ckpt_store::open_with(&job.store_url, &job.open)?;
    ckpt_store::validate_run(&job.run)?;
    let local = job
        .local_tier
        .as_deref()
        .map(ckpt_store::open)
        .transpose()?;
    // Generations continue from any earlier supervision of this run (in either tier).
    let mut base = first_free_generation(&store, &job.run).await?;
    if let Some(l) = &local {
        base = base.max(first_free_generation(l, &job.run).await?);
    }
    let sock_dir = private_dir("supervisor")?;
    let sock_path = sock_dir.join("heartbeat.sock");
    let sock = UnixDatagram::bind(&sock_path)
        .map_err(|e| Error::io("binding the heartbeat socket", &sock_path.display(), e))?;
    let peer_secret = match &opts.replica_agent {
        Some(_) => Some(PeerSecret::generate()?),
        None => None,
    };
    let agents = start_agents(&opts, peer_secret.as_ref()).await?;
    let launch = Launch::new(job, sock_path, sock_dir.join("node-cache"), peer_secret);
    let (exit_tx, mut exit_rx) = mpsc::unbounded_channel::<RankExit>();
    let log = RecoveryLog::new(&store, &job.run, "supervisor")?;
    let mut losses = LossBoard::new(&store, &job.run, "supervisor")?;
    let coord = Coordinator::new(job.config.clone());
    let mut ex = Executor::new(coord, store, &job.run, log, Order::NewestFirst).with_local(local);
    ex.push(Event::Start { now: ex.now() });
    let mut local = Local {
        base,
        launch,
        agents,
        exit_tx,
        children: HashMap::new(),
        stopped: HashSet::new(),
        repairs: BTreeMap::new(),
        outcome: None,
        opts,
    };
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut buf = vec![0u8; 4096];
    loop {
        ex.drive(&mut local).await?;
        if let Some((ok, reason)) = local.outcome.take() {
            losses.flush().await;
            let report = local.finish(ex, ok, reason).await;
            remove_private_dir(&sock_dir);
            return Ok(report);
        }
        tokio::select! {
            r = sock.recv(&mut buf) => {
                if let Ok(n) = r
                    && let Ok(b) = serde_json::from_slice::<Beat>(&buf[..n])
                {
                    on_beat(&mut ex, &mut losses, base, b).await?;
                }
            }
            Some((generation, rank, status)) = exit_rx.recv() => {
                let now = ex.now();
                ex.push(Event::Exited { generation, rank, status, now });
            }
            _ = tick.tick() => {
                let now = ex.now();
                local.watch_stops(&mut ex, now);
                ex.push(Event::Tick { now });
                local.repair_due(&mut ex, now).await;
                ex.poll_commits().await;
                ex.poll_replicas().await;
            }
        }
    }
}

/// A rank's heartbeat: its workload's sums to the loss board, its step to the coordinator
/// (beats of generations before this supervision's are ignored).
async fn on_beat(ex: &mut Executor, losses: &mut LossBoard, base: u64, b: Beat) -> Result<()> {
    if b.generation < base {
        return Ok(());
    }
    let g = b.generation - base;
    if let Some(w) = &b.workload {
        let world = ex.coord.layout().world();
        losses.add(b.generation, b.step, w, world).await?;
    }
    let now = ex.now();
    ex.push(if b.starting {
        Event::Alive {
            generation: g,
            rank: b.rank,
            now,
        }
    } else {
        Event::Heartbeat {
            generation: g,
            rank: b.rank,
            step: b.step,
            now,
        }
    });
    Ok(())
}

/// Start every node's replica agent, with peer replicas.
async fn start_agents(
    opts: &SupervisorOptions,
    secret: Option<&PeerSecret>,
) -> Result<BTreeMap<u32, AgentProc>> {
    let mut agents = BTreeMap::new();
    if let (Some(cmd), Some(secret)) = (&opts.replica_agent, secret) {
        let t = &opts.job.config.topology;
        for node in 0..t.nodes + t.spares {
            let a = start_agent(cmd, node, opts.job.logs_dir.as_deref(), secret, false).await?;
            agents.insert(node, a);
        }
    }
    Ok(agents)
}

/// The local supervisor's [`Effects`]: rank processes and replica agents on this machine.
struct Local {
    opts: SupervisorOptions,
    /// The store's number of the coordinator's generation 0.
    base: u64,
    launch: Launch,
    /// The replica agents, per node.
    agents: BTreeMap<u32, AgentProc>,
    exit_tx: mpsc::UnboundedSender<RankExit>,
    /// Rank processes: (coordinator generation, rank) -> pid.
    children: HashMap<(u64, u32), u32>,
    /// The live ranks of the running generation last seen stopped.
    stopped: HashSet<(u64, u32)>,
    /// Failed nodes being repaired: when each comes back.
    repairs: BTreeMap<u32, Duration>,
    /// The end of the job, once the coordinator says so.
    outcome: Option<(bool, String)>,
}

impl Effects for Local {
    fn generation(&self, g: u64) -> u64 {
        self.base + g
    }

    async fn start(&mut self, ex: &mut Executor, s: Start) -> Result<()> {
        let g = self.base + s.generation;
        ex.store.log().start_generation(&ex.run, g).await?;
        // The local tier fences older writers of the run too.
        if let Some(l) = &ex.local {
            match l.log().start_generation(&ex.run, g).await {
                Err(e) if e.kind() != ckpt_store::ErrorKind::Conflict => return Err(e),
                _ => {}
            }
        }
        self.tell_agents(&ex.coord.excluded(), g).await;
        self.launch.prune_node_caches(g);
        let port = free_port();
        for a in &s.assignments {
            let pid = self.launch.spawn(
                g,
                &s.layout,
                s.resume_from,
                (a, &[]),
                ("127.0.0.1", port),
                s.generation,
                &self.exit_tx,
            )?;
            self.children.insert((s.generation, a.rank), pid);
        }
        info!(generation = g, layout = %s.layout, "ranks started");
        Ok(())
    }

    async fn signal(
        &mut self,
        _ex: &mut Executor,
        generation: u64,
        ranks: Vec<u32>,
        kill: bool,
    ) -> Result<()> {
        for r in ranks {
            if let Some(&pid) = self.children.get(&(generation, r)) {
                signal_rank(pid, kill);
            }
        }
        Ok(())
    }

    fn recording(&mut self, ex: &Executor, rec: &Record) {
        if let (LogEvent::Failure(f), Some(d)) = (rec, self.opts.repair_after) {
            self.repairs.entry(f.node).or_insert(ex.now() + d);
        }
    }

    async fn done(&mut self, _ex: &mut Executor, ok: bool, reason: String) -> Result<()> {
        self.outcome = Some((ok, reason));
        Ok(())
    }
}

impl Local {
    /// Generation `g` starts: the agents of failed (`excluded`) nodes go with them, and every
    /// live agent learns the generation and its buddy from us, not from the frames it is sent.
    async fn tell_agents(&mut self, excluded: &[u32], g: u64) {
        for n in excluded {
            if let Some(mut a) = self.agents.remove(n) {
                let _ = a.child.start_kill();
                info!(node = n, "replica agent of the failed node stopped");
            }
        }
        self.launch.peer_agents = self
            .agents
            .iter()
            .map(|(n, a)| (*n, a.addr.clone()))
            .collect();
        let line = Membership::line(g, &self.launch.peer_agents);
        for (n, a) in self.agents.iter_mut() {
            if let Some(stdin) = a.child.stdin.as_mut()
                && let Err(e) = stdin.write_all(line.as_bytes()).await
            {
                tracing::warn!(node = n, "telling the replica agent its members: {e}");
            }
        }
    }

    /// Tell the coordinator which live ranks' processes stopped or run again since the last
    /// look (a stopped rank beats no more; before its first beat only this tells).
    fn watch_stops(&mut self, ex: &mut Executor, now: Duration) {
        let generation = ex.coord.generation();
        self.stopped.retain(|(g, _)| *g == generation);
        for rank in ex.coord.live_ranks() {
            let Some(&pid) = self.children.get(&(generation, rank)) else {
                continue;
            };
            let stopped = process_stopped(pid);
            let changed = if stopped {
                self.stopped.insert((generation, rank))
            } else {
                self.stopped.remove(&(generation, rank))
            };
            if changed {
                ex.push(Event::Stopped {
                    generation,
                    rank,
                    stopped,
                    now,
                });
            }
        }
    }

    /// Failed nodes whose repair time came (`now`) are back: with peer replicas, with a fresh
    /// agent (one that does not start leaves the node out, not the job stopped).
    async fn repair_due(&mut self, ex: &mut Executor, now: Duration) {
        let due: Vec<u32> = self
            .repairs
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(n, _)| *n)
            .collect();
        for node in due {
            self.repairs.remove(&node);
            if !ex.coord.is_kept_out(node)
                && let (Some(cmd), Some(secret)) =
                    (&self.opts.replica_agent, &self.launch.peer_secret)
            {
                // A repaired node starts empty: a fresh agent.
                if let Some(mut old) = self.agents.remove(&node) {
                    let _ = old.child.start_kill();
                }
                let logs = self.opts.job.logs_dir.as_deref();
                match start_agent(cmd, node, logs, secret, true).await {
                    Ok(a) => {
                        self.agents.insert(node, a);
                    }
                    Err(e) => {
                        tracing::warn!(
                            node,
                            "the repaired node's replica agent did not start, so it stays out: {e}"
                        );
                        continue;
                    }
                }
            }
            info!(node, "failed node repaired");
            ex.push(Event::NodeBack { node, now });
        }
    }

    /// The job is over: the agents stopped, and the report (with how each generation's ranks
    /// restored, from the run's events).
    async fn finish(&mut self, ex: Executor, ok: bool, reason: String) -> Report {
        for a in self.agents.values_mut() {
            let _ = a.child.start_kill();
        }
        let restores = match read_records::<LogEvent>(&ex.store, &ex.run).await {
            Ok(ev) => restore_summaries(&ev, self.base),
            Err(e) => {
                tracing::warn!("reading the restore events: {e}");
                Vec::new()
            }
        };
        Report {
            ok,
            reason,
            restarts: ex.coord.restarts(),
            records: ex.log.records,
            layout: ex.coord.layout().to_string(),
            restores,
        }
    }
}

/// A node's replica agent.
struct AgentProc {
    child: tokio::process::Child,
    addr: String,
}

/// Start node `node`'s replica agent and learn its address (its log appended to when
/// `append`: a repaired node's).
async fn start_agent(
    cmd: &[String],
    node: u32,
    logs: Option<&Path>,
    secret: &PeerSecret,
    append: bool,
) -> Result<AgentProc> {
    use tokio::io::AsyncBufReadExt;
    let Some(prog) = cmd.first() else {
        return Err(Error::invalid("an empty replica agent command"));
    };
    let mut c = tokio::process::Command::new(prog);
    c.args(&cmd[1..])
        .args([
            "--listen",
            "127.0.0.1:0",
            "--node",
            &node.to_string(),
            "--watch-stdin",
        ])
        .env(crate::peer::SECRET_ENV, secret.to_hex())
        .stdin(std::process::Stdio::piped()) // the agent ends when this closes
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    crate::driver::die_with_parent(&mut c);
    if let Some(dir) = logs {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", &dir.display(), e))?;
        let p = dir.join(format!("agent-{node}.err"));
        let f = ckpt_store::outfile::open_regular(&p, append)
            .map_err(|e| Error::io("creating an agent log", &p.display(), e))?;
        c.stderr(f);
    }
    let mut child = c
        .spawn()
        .map_err(|e| Error::io("starting the replica agent", prog, e))?;
    let stdout = child.stdout.take().expect("piped");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .map_err(|_| Error::internal(format!("replica agent of node {node} did not start")))?
        .map_err(|e| Error::io("reading the replica agent's address", prog, e))?
        .unwrap_or_default();
    let Some(addr) = line.strip_prefix("listening ") else {
        return Err(Error::internal(format!(
            "replica agent of node {node} printed {line:?} instead of its address"
        )));
    };
    info!(node, addr, "replica agent started");
    Ok(AgentProc {
        child,
        addr: addr.trim().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::parse_records;
    use serde_json::json;

    #[test]
    fn restore_events_are_summed_per_generation_after_the_first() {
        let ev = vec![
            json!({"kind": "restore", "generation": 3, "step": 4, "bytes": 9, "bytes_from_peers": 9, "bytes_from_store": 0, "seconds": 0.5}),
            json!({"kind": "restore", "generation": 4, "step": 8, "bytes": 10, "bytes_from_peers": 6, "bytes_from_store": 5, "seconds": 0.25}),
            json!({"kind": "restore", "generation": 4, "step": 8, "bytes": 10, "bytes_from_peers": 0, "bytes_from_store": 11, "bytes_from_local": 7, "seconds": 1.5}),
            json!({"kind": "spike", "generation": 4}),
            json!({"kind": "restore", "generation": 5, "step": 12, "bytes": 1}),
        ];
        let s = restore_summaries(&parse_records(&ev), 3);
        assert_eq!(s.len(), 2);
        assert_eq!(
            s[0],
            RestoreSummary {
                generation: 4,
                step: 8,
                ranks: 2,
                bytes: 20,
                bytes_from_peers: 6,
                bytes_from_store: 16,
                bytes_from_local: 7,
                slowest_s: 1.5,
            }
        );
        assert_eq!((s[1].generation, s[1].ranks, s[1].bytes), (5, 1, 1));
    }
}
