//! The local supervisor behind `ckpt resume`: the coordinator's driver on one machine.
//!
//! It launches the ranks of a command (any program embedding `CheckpointManager`, such as
//! `ckpt-train`) grouped into simulated nodes, with the rank, world, layout and generation in
//! the environment (`CKPT_*`, and torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`); receives heartbeats on a Unix socket;
//! feeds exits, heartbeats and ticks to the [`Coordinator`]; and carries out its actions:
//! signals, the choice of the newest committed step whose objects are all present, the restore
//! plan, relaunches, and the recovery log (JSON lines in the run's `events` log).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use ckpt_store::logs::{EVENTS, LogWriter, METRICS};
use ckpt_store::placement::{stage_of, tp_box};
use ckpt_store::{Error, Layout, Result, StepReader, Store};
use serde::Serialize;
use serde_json::json;
use tokio::net::UnixDatagram;
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use crate::coordinator::{Action, Config, Coordinator, Event, ExitStatus, Record};
use crate::heartbeat::{Beat, ENV_INTERVAL, ENV_SOCKET};

/// What `ckpt resume` asks for.
#[derive(Debug, Clone)]
pub struct SupervisorOptions {
    /// Store URL, passed to the ranks as `CKPT_STORE`.
    pub store_url: String,
    /// Run name, passed as `CKPT_RUN`.
    pub run: String,
    /// Coordinator settings (topology, layout, timeouts, restarts).
    pub config: Config,
    /// The command to launch per rank.
    pub command: Vec<String>,
    /// Where rank stdout/stderr go (`rank-R.gen-G.{out,err}`); inherited when `None`.
    pub logs_dir: Option<PathBuf>,
    /// How often ranks beat between steps.
    pub heartbeat_interval: Duration,
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
}

/// Bytes one rank of a new layout reads to restore.
#[derive(Debug, Clone, Serialize)]
pub struct RankPlan {
    /// Rank.
    pub rank: u32,
    /// Bytes of the boxes it holds.
    pub bytes_needed: u64,
    /// Stored bytes of the chunks it fetches.
    pub bytes_fetched: u64,
    /// Chunks it fetches.
    pub chunks: u64,
}

/// What each rank of `layout` reads to restore `step`: the tensor-parallel shard of every
/// tensor on its pipeline stage (as the reference workload holds). Tensors saved without a
/// placement are read whole by every rank.
pub async fn restore_plan(
    store: &Store,
    run: &str,
    step: u64,
    layout: &Layout,
) -> Result<Vec<RankPlan>> {
    let reader = StepReader::open(store, run, step).await?;
    let mut out = Vec::new();
    for rank in 0..layout.world() {
        let c = layout.coords(rank);
        let mut p = RankPlan {
            rank,
            bytes_needed: 0,
            bytes_fetched: 0,
            chunks: 0,
        };
        for t in &reader.commit().tensors {
            let bbox = match t.spec() {
                Some(spec) => {
                    if stage_of(&spec.placement.stage, layout.pp) != c.pp {
                        continue;
                    }
                    tp_box(&spec, c.tp, layout.tp)?
                }
                None => ckpt_store::NdBox::full(&t.shape),
            };
            let plan = reader.plan(&t.name, &bbox).await?;
            p.bytes_needed += plan.bytes_needed();
            p.bytes_fetched += plan.stored_bytes_fetched();
            p.chunks += plan.chunks.len() as u64;
        }
        out.push(p);
    }
    Ok(out)
}

/// The newest committed step of `run` whose chunk and pack objects are all present (one HEAD
/// per distinct object), with the steps skipped and why.
pub async fn choose_step(store: &Store, run: &str) -> Result<(Option<u64>, Vec<String>)> {
    let mut skipped = Vec::new();
    let mut steps = store.committed_steps(run).await?;
    steps.reverse();
    for s in steps {
        match step_objects_missing(store, run, s).await {
            Ok(missing) if missing.is_empty() => return Ok((Some(s), skipped)),
            Ok(missing) => skipped.push(format!(
                "step {s}: {} objects missing (first: {})",
                missing.len(),
                missing[0]
            )),
            Err(e) => skipped.push(format!("step {s}: {e}")),
        }
    }
    Ok((None, skipped))
}

async fn step_objects_missing(store: &Store, run: &str, step: u64) -> Result<Vec<String>> {
    let reader = StepReader::open(store, run, step).await?;
    let mut objects = HashSet::new();
    for e in &reader.commit().ranks {
        let m = reader.manifest(e.rank).await?;
        for c in m
            .tensors
            .iter()
            .flat_map(|t| &t.chunks)
            .chain(m.blobs.iter().flat_map(|b| &b.chunks))
        {
            objects.insert(store.object_of(c));
        }
    }
    let mut missing = Vec::new();
    let checks = futures::future::join_all(objects.iter().map(|p| store.exists(p))).await;
    for (p, ok) in objects.iter().zip(checks) {
        if !ok? {
            missing.push(p.to_string());
        }
    }
    missing.sort();
    Ok(missing)
}

struct Child {
    pid: u32,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(29500)
}

/// Supervise the job (see the module docs) until it completes or recovery gives up.
pub async fn run(opts: SupervisorOptions) -> Result<Report> {
    if opts.command.is_empty() {
        return Err(Error::invalid("no command to run: pass it after --"));
    }
    let store = ckpt_store::open(&opts.store_url)?;
    ckpt_store::validate_run(&opts.run)?;
    // Generations continue from any earlier supervision of this run.
    let base = store
        .newest_generation(&opts.run)
        .await?
        .map_or(0, |g| g + 1)
        .max(
            newest_manifest_generation(&store, &opts.run)
                .await?
                .map_or(0, |g| g + 1),
        );
    let sock_dir = tempfile_dir()?;
    let sock_path = sock_dir.join("heartbeat.sock");
    let sock = UnixDatagram::bind(&sock_path)
        .map_err(|e| Error::io("binding the heartbeat socket", &sock_path.display(), e))?;
    let (exit_tx, mut exit_rx) = mpsc::unbounded_channel::<(u64, u32, ExitStatus)>();
    let mut events = LogWriter::new(&store, &opts.run, EVENTS, "supervisor")?;
    let mut metrics = LogWriter::new(&store, &opts.run, METRICS, "supervisor")?;
    let mut coord = Coordinator::new(opts.config.clone());
    let t0 = Instant::now();
    let mut children: HashMap<(u64, u32), Child> = HashMap::new();
    let mut records: Vec<serde_json::Value> = Vec::new();
    let mut losses: BTreeMap<(u64, u64), (u128, u128, u64, u32)> = BTreeMap::new();
    let mut pending: Vec<Event> = vec![Event::Start { now: t0.elapsed() }];
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut buf = vec![0u8; 4096];
    let mut outcome: Option<(bool, String)> = None;
    loop {
        while let Some(ev) = pending.pop() {
            for act in coord.on_event(ev) {
                match act {
                    Action::Start {
                        generation,
                        layout,
                        assignments,
                        resume_from: _,
                    } => {
                        let g = base + generation;
                        store.start_generation(&opts.run, g).await?;
                        let port = free_port();
                        let rpn = opts.config.topology.ranks_per_node;
                        for a in assignments {
                            let mut cmd = tokio::process::Command::new(&opts.command[0]);
                            cmd.args(&opts.command[1..])
                                .env("CKPT_STORE", &opts.store_url)
                                .env("CKPT_RUN", &opts.run)
                                .env("CKPT_RANK", a.rank.to_string())
                                .env("CKPT_WORLD_SIZE", layout.world().to_string())
                                .env("CKPT_LAYOUT", layout.to_string())
                                .env("CKPT_GENERATION", g.to_string())
                                .env("CKPT_RESUME", "true")
                                .env("CKPT_NODE", a.node.to_string())
                                .env("CKPT_LOCAL_RANK", a.local_rank.to_string())
                                .env("CKPT_FINAL_ON_SIGTERM", "0")
                                .env(ENV_SOCKET, &sock_path)
                                .env(
                                    ENV_INTERVAL,
                                    opts.heartbeat_interval.as_millis().to_string(),
                                )
                                .env("RANK", a.rank.to_string())
                                .env("WORLD_SIZE", layout.world().to_string())
                                .env("LOCAL_RANK", a.local_rank.to_string())
                                .env("LOCAL_WORLD_SIZE", rpn.to_string())
                                .env("MASTER_ADDR", "127.0.0.1")
                                .env("MASTER_PORT", port.to_string())
                                .stdin(Stdio::null())
                                .kill_on_drop(true);
                            if let Some(dir) = &opts.logs_dir {
                                std::fs::create_dir_all(dir)
                                    .map_err(|e| Error::io("creating", &dir.display(), e))?;
                                let f = |ext: &str| {
                                    std::fs::File::create(
                                        dir.join(format!("rank-{}.gen-{g}.{ext}", a.rank)),
                                    )
                                };
                                cmd.stdout(f("out").map_err(|e| {
                                    Error::io("creating a rank log in", &dir.display(), e)
                                })?);
                                cmd.stderr(f("err").map_err(|e| {
                                    Error::io("creating a rank log in", &dir.display(), e)
                                })?);
                            }
                            let mut child = cmd
                                .spawn()
                                .map_err(|e| Error::io("starting", &opts.command[0], e))?;
                            let pid = child.id().unwrap_or(0);
                            children.insert((generation, a.rank), Child { pid });
                            let tx = exit_tx.clone();
                            let rank = a.rank;
                            tokio::spawn(async move {
                                let st = child.wait().await;
                                let status = match st {
                                    Ok(s) => {
                                        use std::os::unix::process::ExitStatusExt;
                                        match (s.code(), s.signal()) {
                                            (Some(c), _) => ExitStatus::Code(c),
                                            (None, Some(sig)) => ExitStatus::Signal(sig),
                                            _ => ExitStatus::Code(-1),
                                        }
                                    }
                                    Err(_) => ExitStatus::Code(-1),
                                };
                                let _ = tx.send((generation, rank, status));
                            });
                        }
                        info!(generation = g, %layout, "ranks started");
                    }
                    Action::Signal {
                        generation,
                        ranks,
                        kill,
                    } => {
                        for r in ranks {
                            if let Some(c) = children.get(&(generation, r)) {
                                let pid = c.pid as i32;
                                // SAFETY: signals to children we started.
                                unsafe {
                                    if kill {
                                        libc::kill(pid, libc::SIGKILL);
                                    } else {
                                        libc::kill(pid, libc::SIGTERM);
                                        // A stopped (SIGSTOP) process handles SIGTERM only
                                        // once continued.
                                        libc::kill(pid, libc::SIGCONT);
                                    }
                                }
                            }
                        }
                    }
                    Action::ChooseStep { generation } => {
                        let (step, skipped) = choose_step(&store, &opts.run).await?;
                        for s in &skipped {
                            warn!("not restoring {s}");
                        }
                        pending.push(Event::StepChosen {
                            generation,
                            step,
                            now: t0.elapsed(),
                        });
                    }
                    Action::Record(rec) => {
                        let mut v = serde_json::to_value(&rec).unwrap_or_default();
                        if let Some(g) = v.get("generation").and_then(|g| g.as_u64()) {
                            v["generation"] = json!(base + g);
                        }
                        log_record(&rec);
                        if let Record::Decision {
                            step: Some(s),
                            layout,
                            ..
                        } = &rec
                            && let Ok(l) = layout.parse::<Layout>()
                        {
                            match restore_plan(&store, &opts.run, *s, &l).await {
                                Ok(plan) => {
                                    v["plan"] = json!(plan);
                                }
                                Err(e) => warn!("restore plan: {e}"),
                            }
                        }
                        events.append(&v)?;
                        if let Err(e) = events.flush().await {
                            warn!("writing the recovery log: {e}");
                        }
                        records.push(v);
                    }
                    Action::Done { ok, reason } => outcome = Some((ok, reason)),
                }
            }
        }
        if let Some((ok, reason)) = outcome.take() {
            let _ = metrics.flush().await;
            let _ = std::fs::remove_dir_all(&sock_dir);
            return Ok(Report {
                ok,
                reason,
                restarts: coord.restarts(),
                records,
                layout: coord.layout().to_string(),
            });
        }
        tokio::select! {
            r = sock.recv(&mut buf) => {
                if let Ok(n) = r
                    && let Ok(b) = serde_json::from_slice::<Beat>(&buf[..n])
                    && b.g >= base
                {
                    let g = b.g - base;
                    if let (Some(sse), Some(gsq), Some(n)) = (&b.sse, &b.gsq, b.n) {
                        let world = coord.layout().world();
                        let e = losses.entry((g, b.s)).or_default();
                        e.0 += sse.parse::<u128>().unwrap_or(0);
                        e.1 += gsq.parse::<u128>().unwrap_or(0);
                        e.2 += n;
                        e.3 += 1;
                        if e.3 == world {
                            let (sse, gsq, n, _) = losses.remove(&(g, b.s)).unwrap_or_default();
                            let scale = (1u64 << 40) as f64;
                            metrics.append(&json!({
                                "kind": "step", "step": b.s, "generation": base + g,
                                "loss": sse as f64 / scale / n.max(1) as f64,
                                "grad_norm": (gsq as f64 / scale).sqrt(),
                            }))?;
                            if metrics.pending() >= 50 {
                                let _ = metrics.flush().await;
                            }
                        }
                    }
                    pending.push(Event::Heartbeat { generation: g, rank: b.r, step: b.s, now: t0.elapsed() });
                }
            }
            Some((generation, rank, status)) = exit_rx.recv() => {
                pending.push(Event::Exited { generation, rank, status, now: t0.elapsed() });
            }
            _ = tick.tick() => {
                pending.push(Event::Tick { now: t0.elapsed() });
            }
        }
    }
}

fn log_record(rec: &Record) {
    match rec {
        Record::Failure {
            rank,
            node,
            how,
            detail,
            ..
        } => {
            error!(rank, node, how = %how, "rank failed: {detail}")
        }
        Record::Decision {
            layout,
            step,
            steps_lost,
            ..
        } => {
            warn!(layout = %layout, step = ?step, steps_lost, "recovering")
        }
        Record::Started {
            generation, layout, ..
        } => info!(generation, layout = %layout, "generation started"),
        Record::Resumed {
            step,
            since_failure_s,
            ..
        } => {
            info!(step, since_failure_s, "training resumed")
        }
        Record::Finished { ok, reason, .. } => info!(ok, "job finished: {reason}"),
    }
}

async fn newest_manifest_generation(store: &Store, run: &str) -> Result<Option<u64>> {
    let Some(s) = store.latest_committed(run).await? else {
        return Ok(None);
    };
    Ok(Some(store.read_commit(run, s).await?.0.generation))
}

fn tempfile_dir() -> Result<PathBuf> {
    let base = std::env::temp_dir();
    for i in 0..1000u32 {
        let p = base.join(format!("ckpt-supervisor-{}-{i}", std::process::id()));
        match std::fs::create_dir(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io("creating", &p.display(), e)),
        }
    }
    Err(Error::internal(
        "no temporary directory for the heartbeat socket",
    ))
}
