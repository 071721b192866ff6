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

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use ckpt_store::records::{Event as LogEvent, Logged, read_records};
use ckpt_store::{Error, Result};
use serde::Serialize;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixDatagram;
use tokio::sync::mpsc;
use tracing::info;

use crate::coordinator::{Action, Coordinator, Event};
use crate::driver::{
    JobOptions, Launch, LossBoard, RankExit, RecoveryLog, check_step, choose_step_logged,
    first_free_generation, free_port, private_dir, remove_private_dir, retire_step, signal_rank,
};
pub use crate::driver::{RankPlan, choose_step, restore_plan};
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

/// How often the supervisor looks for a new commit while the coordinator waits for one to grow
/// the job back at (one listing of the run's steps a time).
pub const COMMIT_POLL: Duration = Duration::from_millis(100);

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
        s.slowest_s = s.slowest_s.max(e.seconds);
    }
    by.into_values().collect()
}

/// Supervise the job (see the module docs) until it completes or recovery gives up.
pub async fn run(opts: SupervisorOptions) -> Result<Report> {
    if opts.job.command.is_empty() {
        return Err(Error::invalid("no command to run: pass it after --"));
    }
    let store = ckpt_store::open_with(&opts.job.store_url, &opts.job.open)?;
    ckpt_store::validate_run(&opts.job.run)?;
    // Generations continue from any earlier supervision of this run.
    let base = first_free_generation(&store, &opts.job.run).await?;
    let sock_dir = private_dir("supervisor")?;
    let sock_path = sock_dir.join("heartbeat.sock");
    let sock = UnixDatagram::bind(&sock_path)
        .map_err(|e| Error::io("binding the heartbeat socket", &sock_path.display(), e))?;
    let peer_secret = match &opts.replica_agent {
        Some(_) => Some(PeerSecret::generate()?),
        None => None,
    };
    let mut agents = match (&opts.replica_agent, &peer_secret) {
        (Some(cmd), Some(secret)) => {
            let t = &opts.job.config.topology;
            let mut agents = BTreeMap::new();
            for node in 0..t.nodes + t.spares {
                let a = start_agent(cmd, node, opts.job.logs_dir.as_deref(), secret, false).await?;
                agents.insert(node, a);
            }
            agents
        }
        _ => BTreeMap::new(),
    };
    let mut launch = Launch::new(
        &opts.job,
        sock_path.clone(),
        sock_dir.join("node-cache"),
        peer_secret,
    );
    let (exit_tx, mut exit_rx) = mpsc::unbounded_channel::<RankExit>();
    let mut log = RecoveryLog::new(&store, &opts.job.run, "supervisor")?;
    let mut losses = LossBoard::new(&store, &opts.job.run, "supervisor")?;
    let mut coord = Coordinator::new(opts.job.config.clone());
    let t0 = Instant::now();
    let mut children: HashMap<(u64, u32), u32> = HashMap::new();
    let mut pending: Vec<Event> = vec![Event::Start { now: t0.elapsed() }];
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut buf = vec![0u8; 4096];
    let mut outcome: Option<(bool, String)> = None;
    // Failed nodes being repaired: when each comes back.
    let mut repairs: BTreeMap<u32, Duration> = BTreeMap::new();
    // The commit watch: (generation, when last polled, the last answer sent).
    let mut watch: Option<(u64, Instant, Option<u64>)> = None;
    loop {
        while let Some(ev) = pending.pop() {
            for act in coord.on_event(ev) {
                match act {
                    Action::Start {
                        generation,
                        layout,
                        assignments,
                        resume_from,
                    } => {
                        let g = base + generation;
                        store.start_generation(&opts.job.run, g).await?;
                        // A failed node's agent goes with it.
                        for n in coord.excluded() {
                            if let Some(mut a) = agents.remove(&n) {
                                let _ = a.child.start_kill();
                                info!(node = n, "replica agent of the failed node stopped");
                            }
                        }
                        launch.peer_agents =
                            agents.iter().map(|(n, a)| (*n, a.addr.clone())).collect();
                        // Each agent learns the generation and its buddy from us, not from
                        // the frames it is sent.
                        let line = Membership::line(g, &launch.peer_agents);
                        for (n, a) in agents.iter_mut() {
                            if let Some(stdin) = a.child.stdin.as_mut()
                                && let Err(e) = stdin.write_all(line.as_bytes()).await
                            {
                                tracing::warn!(
                                    node = n,
                                    "telling the replica agent its members: {e}"
                                );
                            }
                        }
                        launch.prune_node_caches(g);
                        let port = free_port();
                        for a in assignments {
                            let pid = launch.spawn(
                                g,
                                &layout,
                                resume_from,
                                &a,
                                ("127.0.0.1", port),
                                generation,
                                &exit_tx,
                            )?;
                            children.insert((generation, a.rank), pid);
                        }
                        info!(generation = g, %layout, "ranks started");
                    }
                    Action::Signal {
                        generation,
                        ranks,
                        kill,
                    } => {
                        for r in ranks {
                            if let Some(&pid) = children.get(&(generation, r)) {
                                signal_rank(pid, kill);
                            }
                        }
                    }
                    Action::ChooseStep { generation, skip } => {
                        let c = choose_step_logged(&store, &opts.job.run, &skip).await?;
                        pending.push(Event::StepChosen {
                            generation,
                            step: c.step,
                            damaged: c.damaged,
                            now: t0.elapsed(),
                        });
                    }
                    Action::CheckStep { generation, step } => {
                        let damage = check_step(&store, &opts.job.run, step).await?;
                        pending.push(Event::StepChecked {
                            generation,
                            step,
                            damage,
                            now: t0.elapsed(),
                        });
                    }
                    Action::RetireStep { step } => retire_step(&store, &opts.job.run, step).await?,
                    Action::Record(rec) => {
                        if let (ckpt_store::records::Event::Failure(f), Some(d)) =
                            (&rec, opts.repair_after)
                        {
                            repairs.entry(f.node).or_insert(t0.elapsed() + d);
                        }
                        let v = log.render(&rec, |g| base + g).await;
                        log.write(v).await?;
                    }
                    Action::Done { ok, reason } => outcome = Some((ok, reason)),
                }
            }
        }
        if let Some((ok, reason)) = outcome.take() {
            losses.flush().await;
            for a in agents.values_mut() {
                let _ = a.child.start_kill();
            }
            let restores = match read_records::<LogEvent>(&store, &opts.job.run).await {
                Ok(ev) => restore_summaries(&ev, base),
                Err(e) => {
                    tracing::warn!("reading the restore events: {e}");
                    Vec::new()
                }
            };
            remove_private_dir(&sock_dir);
            return Ok(Report {
                ok,
                reason,
                restarts: coord.restarts(),
                records: log.records,
                layout: coord.layout().to_string(),
                restores,
            });
        }
        tokio::select! {
            r = sock.recv(&mut buf) => {
                if let Ok(n) = r
                    && let Ok(b) = serde_json::from_slice::<Beat>(&buf[..n])
                    && b.generation >= base
                {
                    let g = b.generation - base;
                    if let Some(w) = &b.workload {
                        let world = coord.layout().world();
                        losses.add(b.generation, b.step, w, world).await?;
                    }
                    pending.push(Event::Heartbeat { generation: g, rank: b.rank, step: b.step, now: t0.elapsed() });
                }
            }
            Some((generation, rank, status)) = exit_rx.recv() => {
                pending.push(Event::Exited { generation, rank, status, now: t0.elapsed() });
            }
            _ = tick.tick() => {
                let now = t0.elapsed();
                pending.push(Event::Tick { now });
                let due: Vec<u32> = repairs
                    .iter()
                    .filter(|(_, at)| **at <= now)
                    .map(|(n, _)| *n)
                    .collect();
                for node in due {
                    repairs.remove(&node);
                    if !coord.is_kept_out(node)
                        && let (Some(cmd), Some(secret)) = (&opts.replica_agent, &launch.peer_secret)
                    {
                        // A repaired node starts empty: a fresh agent. One that does not
                        // start leaves the node out, not the job stopped.
                        if let Some(mut old) = agents.remove(&node) {
                            let _ = old.child.start_kill();
                        }
                        match start_agent(cmd, node, opts.job.logs_dir.as_deref(), secret, true).await {
                            Ok(a) => {
                                agents.insert(node, a);
                            }
                            Err(e) => {
                                tracing::warn!(node, "the repaired node's replica agent did not start, so it stays out: {e}");
                                continue;
                            }
                        }
                    }
                    info!(node, "failed node repaired");
                    pending.push(Event::NodeBack { node, now });
                }
                match coord.watching_commits() {
                    Some(g) => {
                        let fresh = watch.is_none_or(|(wg, _, _)| wg != g);
                        if fresh || watch.is_some_and(|(_, at, _)| at.elapsed() >= COMMIT_POLL) {
                            match store.latest_committed(&opts.job.run).await {
                                Ok(step) => {
                                    if fresh || watch.is_some_and(|(_, _, last)| last != step) {
                                        pending.push(Event::Committed { generation: g, step, now: t0.elapsed() });
                                    }
                                    watch = Some((g, Instant::now(), step));
                                }
                                Err(e) => tracing::warn!("looking for a new commit to grow at: {e}"),
                            }
                        }
                    }
                    None => watch = None,
                }
            }
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
    use ckpt_store::records::parse_records;
    use serde_json::json;

    #[test]
    fn restore_events_are_summed_per_generation_after_the_first() {
        let ev = vec![
            json!({"kind": "restore", "generation": 3, "step": 4, "bytes": 9, "bytes_from_peers": 9, "bytes_from_store": 0, "seconds": 0.5}),
            json!({"kind": "restore", "generation": 4, "step": 8, "bytes": 10, "bytes_from_peers": 6, "bytes_from_store": 5, "seconds": 0.25}),
            json!({"kind": "restore", "generation": 4, "step": 8, "bytes": 10, "bytes_from_peers": 0, "bytes_from_store": 11, "seconds": 1.5}),
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
                slowest_s: 1.5,
            }
        );
        assert_eq!((s[1].generation, s[1].ranks, s[1].bytes), (5, 1, 1));
    }
}
