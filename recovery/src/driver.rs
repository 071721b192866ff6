//! What every driver of the [`Coordinator`](crate::Coordinator) does the same way, whether it
//! runs on one machine (`supervisor`) or on many through etcd (`agent`): launch a
//! rank with its environment, signal it, choose the step to restore and plan the restore,
//! number generations, and write the recovery log and the loss metrics into the run's logs.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::records::{Event, Metric, StepMetrics};
use ckpt_store::logs::{EVENTS, LogWriter, METRICS};
use ckpt_store::placement::restore_boxes;
use ckpt_store::{Error, ErrorKind, Layout, Result, StepReader, Store, VerifyScope};
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use crate::coordinator::{Assignment, Config, ExitStatus, Record};
use crate::heartbeat::Workload;
use crate::rank_env::{HeartbeatEnv, PeerEnv, RankEnv};

pub use crate::records::RankPlan;

/// What each rank of `layout` reads to restore `step`: the boxes the placement rules give it
/// ([`ckpt_store::placement::restore_boxes`], the same answer as `ckpt plan`'s, ZeRO
/// partitions included).
pub async fn restore_plan(
    store: &Store,
    run: &str,
    step: u64,
    layout: &Layout,
) -> Result<Vec<RankPlan>> {
    let reader = StepReader::open(store, run, step).await?;
    let mut out = Vec::new();
    for rank in 0..layout.world() {
        let mut p = RankPlan {
            rank,
            bytes_needed: 0,
            bytes_fetched: 0,
            chunks: 0,
        };
        for w in restore_boxes(&reader.commit().tensors, layout, rank)? {
            let plan = reader.plan(&w.name, &w.bbox).await?;
            p.bytes_needed += plan.bytes_needed();
            p.bytes_fetched += plan.stored_bytes_fetched();
            p.chunks += plan.chunks.len() as u64;
        }
        out.push(p);
    }
    Ok(out)
}

/// What [`choose_step`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chosen {
    /// The newest committed step whose objects are all present and that is not skipped.
    pub step: Option<u64>,
    /// Newer steps found damaged (an object missing, a manifest or commit record unreadable
    /// as data), with why: never restorable.
    pub damaged: Vec<(u64, String)>,
    /// Newer steps passed over for other reasons (skipped on request, or the store failed
    /// while checking them), with why.
    pub passed: Vec<(u64, String)>,
}

/// The newest step of `run` committed in one of `tiers` (a local tier first, then the store)
/// whose chunk and pack objects are all present there (one HEAD per distinct object), not
/// counting the steps in `skip`, with the newer steps passed over and why. With `below`, the
/// steps from it on are never candidates: they come back as damaged (their replicas
/// disagreed, or they came after a step whose replicas did).
pub async fn choose_step(
    tiers: &[&Store],
    run: &str,
    skip: &[u64],
    below: Option<u64>,
) -> Result<Chosen> {
    let mut out = Chosen::default();
    let mut committed: Vec<(u64, usize)> = Vec::new();
    for (i, t) in tiers.iter().enumerate() {
        committed.extend(
            t.log()
                .committed_steps(run)
                .await?
                .into_iter()
                .map(|s| (s, i)),
        );
    }
    let mut steps: Vec<u64> = committed.iter().map(|c| c.0).collect();
    steps.sort_unstable();
    steps.dedup();
    steps.reverse();
    'steps: for s in steps {
        if let Some(b) = below
            && s >= b
        {
            out.damaged.push((
                s,
                format!(
                    "at or after step {b}, whose data-parallel replicas disagreed (silent data corruption)"
                ),
            ));
            continue;
        }
        if skip.contains(&s) {
            out.passed.push((s, "marked unusable".into()));
            continue;
        }
        // Every tier that committed it, in order: the first intact copy is restored.
        let mut why = Vec::new();
        let mut data = true;
        for &(_, i) in committed.iter().filter(|c| c.0 == s) {
            let store = tiers[i];
            match step_objects_missing(store, run, s).await {
                Ok(missing) if missing.is_empty() => {
                    out.step = Some(s);
                    return Ok(out);
                }
                Ok(missing) => why.push(format!(
                    "{} objects missing in {} (first: {})",
                    missing.len(),
                    store.url(),
                    missing[0]
                )),
                Err(e) if is_data_error(&e) => why.push(e.to_string()),
                Err(e) => {
                    data = false;
                    why.push(e.to_string());
                }
            }
        }
        let why = why.join("; ");
        if data {
            out.damaged.push((s, why));
        } else {
            out.passed.push((s, why));
        }
        continue 'steps;
    }
    Ok(out)
}

/// Whether `e` says stored data is missing or damaged (as opposed to the store failing).
pub fn is_data_error(e: &Error) -> bool {
    matches!(e.kind(), ErrorKind::NotFound | ErrorKind::Corrupt)
}

/// Verify every object of committed `step` (re-hash its chunks): what is damaged, or `None`
/// when it verifies clean. A step that is no longer committed is damage too.
pub async fn check_step(store: &Store, run: &str, step: u64) -> Result<Option<String>> {
    let scope = VerifyScope::Step(run.to_string(), step);
    let report = match store.verify(&scope, None).await {
        Ok(r) => r,
        Err(e) if is_data_error(&e) => return Ok(Some(e.to_string())),
        Err(e) => return Err(e),
    };
    let Some(first) = report.damaged.first() else {
        return Ok(None);
    };
    let affects: Vec<&str> = first.affects.iter().map(|a| a.item.as_str()).collect();
    Ok(Some(format!(
        "{} damaged object(s); first: {}: {} (affects {})",
        report.damaged.len(),
        first.object,
        first.problem,
        if affects.is_empty() {
            "nothing".to_string()
        } else {
            affects.join(", ")
        }
    )))
}

/// Retire an unusable step: delete its commit record, so it is no longer committed and the
/// job can save that step again. Its manifests stay (gc sweeps them after its grace period).
pub async fn retire_step(store: &Store, run: &str, step: u64) -> Result<()> {
    store
        .objects()
        .delete_all(vec![store.keys().commit(run, step)])
        .await?;
    warn!(
        run,
        step, "retired unusable step: its commit record is deleted"
    );
    Ok(())
}

/// The objects committed `step` needs (its chunks' and packs', delta chains included) that
/// are not in the store.
async fn step_objects_missing(store: &Store, run: &str, step: u64) -> Result<Vec<String>> {
    let objects: HashSet<_> = store
        .log()
        .step_chunk_refs(run, step)
        .await?
        .iter()
        .flat_map(|c| store.keys().chain_objects(c))
        .collect();
    let mut missing = Vec::new();
    let checks = futures::future::join_all(objects.iter().map(|p| store.objects().exists(p))).await;
    for (p, ok) in objects.iter().zip(checks) {
        if !ok? {
            missing.push(p.to_string());
        }
    }
    missing.sort();
    Ok(missing)
}

/// The first generation number no earlier supervision of `run` used: one past the newest
/// generation marker and the newest generation that committed a step.
pub async fn first_free_generation(store: &Store, run: &str) -> Result<u64> {
    let marked = store
        .log()
        .newest_generation(run)
        .await?
        .map_or(0, |g| g + 1);
    let committed = match store.log().latest_committed(run).await? {
        Some(s) => store.log().read_commit_root(run, s).await?.0.generation + 1,
        None => 0,
    };
    Ok(marked.max(committed))
}

/// The choose-step answer, with the steps passed over logged.
pub async fn choose_step_logged(
    tiers: &[&Store],
    run: &str,
    skip: &[u64],
    below: Option<u64>,
) -> Result<Chosen> {
    let chosen = choose_step(tiers, run, skip, below).await?;
    for (s, why) in chosen.damaged.iter().chain(&chosen.passed) {
        warn!("not restoring step {s}: {why}");
    }
    Ok(chosen)
}

/// What every driver is asked to run, on one machine or many: `ckpt resume`'s
/// [`SupervisorOptions`](crate::SupervisorOptions) and `ckpt agent`'s `AgentOptions` embed it
/// as `job`.
#[derive(Debug, Clone)]
pub struct JobOptions {
    /// Store URL, passed to the ranks as `CKPT_STORE` (the driver, or the etcd agent's
    /// coordinator, opens it too).
    pub store_url: String,
    /// Run name, passed as `CKPT_RUN`.
    pub run: String,
    /// Coordinator settings (topology, layout, timeouts, restarts); under etcd, those of the
    /// agent that coordinates apply.
    pub config: Config,
    /// The command to launch per rank, program first.
    pub command: Vec<String>,
    /// Where rank stdout/stderr go (`rank-R.gen-G.{out,err}`); inherited when `None`.
    pub logs_dir: Option<PathBuf>,
    /// How often ranks beat between steps (and how often an etcd agent relays their beats).
    pub heartbeat_interval: Duration,
    /// How the driver opens the store (its binary reads them from the environment; the ranks
    /// read their own).
    pub open: ckpt_store::OpenOptions,
    /// How much of their replicas the ranks hash for the sentinel (`CKPT_SDC_CHECK`; `None`:
    /// their own default). What the job does about a mismatch is the coordinator's
    /// `on_replica_mismatch`.
    pub sdc_check: Option<ckpt_store::SdcCheck>,
    /// The job's local tier (`CKPT_LOCAL_TIER`): the ranks commit there first and drain to
    /// `store_url`; the driver chooses steps from both (issue 28). Every rank of the job
    /// shares it (one machine).
    pub local_tier: Option<String>,
}

/// How ranks are launched: the same for every rank of a job.
#[derive(Debug, Clone)]
pub struct Launch {
    /// Store URL (`CKPT_STORE`).
    pub store_url: String,
    /// Run name (`CKPT_RUN`).
    pub run: String,
    /// The command, program first.
    pub command: Vec<String>,
    /// Where rank stdout/stderr go (`rank-R.gen-G.{out,err}`); inherited when `None`.
    pub logs_dir: Option<PathBuf>,
    /// The heartbeat socket the ranks beat to (`CKPT_HEARTBEAT`).
    pub heartbeat_socket: PathBuf,
    /// How often ranks beat between steps (`CKPT_HEARTBEAT_MS`).
    pub heartbeat_interval: Duration,
    /// Ranks per node (`LOCAL_WORLD_SIZE`).
    pub ranks_per_node: u32,
    /// Kill the ranks when the launching process dies (an agent whose machine is gone must not
    /// leave ranks behind).
    pub die_with_parent: bool,
    /// The live replica agents, (node, address) in node order; empty without peer replicas.
    /// A rank gets its node's agent (`CKPT_PEER_AGENT`) and all of them, its own first
    /// (`CKPT_PEERS`); where the copy goes is the agents' business (their membership).
    pub peer_agents: Vec<(u32, String)>,
    /// The job's replica secret (`CKPT_PEER_SECRET`), proven to every agent.
    pub peer_secret: Option<crate::peer::PeerSecret>,
    /// Where the nodes' shared restore caches go (`CKPT_NODE_CACHE`: `ROOT/n<node>-g<gen>`,
    /// see [`ckpt_store::NodeCache`]); `None`: each rank reads the store itself.
    pub node_cache_root: Option<PathBuf>,
    /// How much of their replicas the ranks hash (`CKPT_SDC_CHECK`).
    pub sdc_check: Option<ckpt_store::SdcCheck>,
    /// The job's local tier (`CKPT_LOCAL_TIER`).
    pub local_tier: Option<String>,
    /// The job has several machines, each with its own local tier: every rank is told the
    /// ranks of its node (`CKPT_LOCAL_TIER_RANKS`), which commit there together.
    pub local_tier_per_node: bool,
}

/// Make the child die (SIGKILL) when this process dies: `PR_SET_PDEATHSIG`, and a check that
/// the parent did not die before the child set it (then the signal would never come).
///
/// The kernel sends the signal when the *thread* that forked the child exits, not the
/// process: spawn from a thread that lives as long as the supervision (the supervisors spawn
/// from the thread that drives their loop). Ranks also watch their parent from the heartbeat
/// thread ([`crate::heartbeat`]), and the generation fence stops whatever slips through.
pub fn die_with_parent(cmd: &mut tokio::process::Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: prctl and getppid are async-signal-safe; nothing else runs between fork and
    // exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::other("the launching process died"));
            }
            Ok(())
        });
    }
}

impl Launch {
    /// How the driver `job` launches its ranks: they beat to `heartbeat_socket`, share restore
    /// caches under `node_cache_root`, die with the driver, and prove `peer_secret` to the
    /// replica agents (none known yet: the driver sets them per generation).
    pub fn new(
        job: &JobOptions,
        heartbeat_socket: PathBuf,
        node_cache_root: PathBuf,
        peer_secret: Option<crate::peer::PeerSecret>,
    ) -> Self {
        Launch {
            store_url: job.store_url.clone(),
            run: job.run.clone(),
            command: job.command.clone(),
            logs_dir: job.logs_dir.clone(),
            heartbeat_socket,
            heartbeat_interval: job.heartbeat_interval,
            ranks_per_node: job.config.topology.ranks_per_node,
            // Ranks never outlive their driver: if it is killed, they die with it rather than
            // train on as orphans next to the job a new driver would start.
            die_with_parent: true,
            peer_agents: Vec::new(),
            peer_secret,
            // The ranks of a node restore through one shared cache (removed with the
            // directory).
            node_cache_root: Some(node_cache_root),
            sdc_check: job.sdc_check,
            local_tier: job.local_tier.clone(),
            local_tier_per_node: false,
        }
    }

    /// Remove the node caches of generations before `generation` (their restores are over).
    pub fn prune_node_caches(&self, generation: u64) {
        let Some(root) = &self.node_cache_root else {
            return;
        };
        let Ok(dir) = std::fs::read_dir(root) else {
            return;
        };
        let keep = format!("-g{generation}");
        for e in dir.flatten() {
            if !e.file_name().to_string_lossy().ends_with(&keep) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// A rank exit: the tag given at launch, the rank, and how it ended.
pub type RankExit = (u64, u32, ExitStatus);

impl Launch {
    /// Start rank `a` of generation `generation` under `layout`, restoring `resume_from`
    /// (`CKPT_RESUME_STEP`, absent when `None`); its exit is sent on `exits` with `tag`.
    /// `node_ranks`: the ranks of `a`'s node (told to the rank when each node has its own
    /// local tier). Returns its process id.
    #[allow(clippy::too_many_arguments)]
    pub fn spawn(
        &self,
        generation: u64,
        layout: &Layout,
        resume_from: Option<u64>,
        (a, node_ranks): (&Assignment, &[u32]),
        master: (&str, u16),
        tag: u64,
        exits: &mpsc::UnboundedSender<RankExit>,
    ) -> Result<u32> {
        let peer = peer_env(&self.peer_agents, a.node, self.peer_secret.as_ref());
        let env = RankEnv {
            store: self.store_url.clone(),
            run: self.run.clone(),
            rank: a.rank,
            world_size: layout.world(),
            layout: layout.to_string(),
            generation,
            resume: true,
            resume_step: resume_from,
            node: a.node,
            local_rank: a.local_rank,
            local_world_size: self.ranks_per_node,
            // Stopped after a failure: no commit is possible, so no final checkpoint.
            final_on_sigterm: false,
            supervisor_pid: std::process::id(),
            heartbeat: HeartbeatEnv {
                socket: self.heartbeat_socket.clone(),
                interval: self.heartbeat_interval,
            },
            peer,
            master: (master.0.to_string(), master.1),
            node_cache: self
                .node_cache_root
                .as_ref()
                .map(|r| r.join(format!("n{}-g{generation}", a.node))),
            sdc_check: self.sdc_check,
            local_tier: self.local_tier.clone(),
            local_tier_ranks: (self.local_tier.is_some() && self.local_tier_per_node)
                .then(|| node_ranks.to_vec()),
        };
        let mut cmd = tokio::process::Command::new(&self.command[0]);
        cmd.args(&self.command[1..])
            .envs(env.to_env())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        for k in env.unset() {
            cmd.env_remove(k);
        }
        if self.die_with_parent {
            die_with_parent(&mut cmd);
        }
        if let Some(dir) = &self.logs_dir {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", &dir.display(), e))?;
            let f = |ext: &str| {
                let p = dir.join(format!("rank-{}.gen-{generation}.{ext}", a.rank));
                // Never through a link planted in the log directory.
                ckpt_store::outfile::open_regular(&p, false)
                    .map_err(|e| Error::io("creating a rank log", &p.display(), e))
            };
            cmd.stdout(f("out")?);
            cmd.stderr(f("err")?);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| Error::io("starting", &self.command[0], e))?;
        let pid = child.id().unwrap_or(0);
        let tx = exits.clone();
        let rank = a.rank;
        tokio::spawn(async move {
            let status = match child.wait().await {
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
            let _ = tx.send((tag, rank, status));
        });
        Ok(pid)
    }
}

/// The replica environment of a rank on `node`: its agent and every agent, its own first, and
/// the job's secret; none without a secret (an agent serves nobody who cannot prove it).
fn peer_env(
    agents: &[(u32, String)],
    node: u32,
    secret: Option<&crate::peer::PeerSecret>,
) -> Option<PeerEnv> {
    let secret = secret?.clone();
    let i = agents.iter().position(|(n, _)| *n == node)?;
    let own = agents[i].1.clone();
    let mut all = vec![own.clone()];
    all.extend(
        agents
            .iter()
            .filter(|(n, _)| *n != node)
            .map(|(_, a)| a.clone()),
    );
    Some(PeerEnv {
        agent: own,
        peers: all,
        timeout: None,
        secret,
    })
}

/// SIGTERM (with SIGCONT, so a stopped process handles it) or SIGKILL to a rank we started.
pub fn signal_rank(pid: u32, kill: bool) {
    if pid == 0 {
        return;
    }
    let pid = pid as i32;
    // SAFETY: plain signals to a child process we started.
    unsafe {
        if kill {
            libc::kill(pid, libc::SIGKILL);
        } else {
            libc::kill(pid, libc::SIGTERM);
            // A stopped (SIGSTOP) process handles SIGTERM only once continued.
            libc::kill(pid, libc::SIGCONT);
        }
    }
}

/// Whether process `pid` is stopped (state `T`, or `t` under a tracer: SIGSTOP, a terminal's
/// stop, a debugger), read from `/proc`; false when that cannot be read (the process is gone).
/// A stopped rank sends no beats, and before its first beat the coordinator could not tell it
/// from a slow start without this.
pub fn process_stopped(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state is the first field after the command name, which is in parentheses and may
    // itself hold spaces and parentheses.
    stat.rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next())
        .is_some_and(|state| state == "T" || state == "t")
}

/// A free TCP port on this machine for `MASTER_PORT` (29500 if none can be found).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind(("0.0.0.0", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(29500)
}

/// A new private directory under the system's temporary directory (for a heartbeat socket).
pub fn private_dir(what: &str) -> Result<PathBuf> {
    let base = std::env::temp_dir();
    for i in 0..1000u32 {
        let p = base.join(format!("ckpt-{what}-{}-{i}", std::process::id()));
        match std::fs::create_dir(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io("creating", &p.display(), e)),
        }
    }
    Err(Error::internal(format!(
        "no temporary directory for the {what} socket"
    )))
}

/// Remove a directory from [`private_dir`], ignoring errors.
pub fn remove_private_dir(p: &Path) {
    let _ = std::fs::remove_dir_all(p);
}

/// The recovery log of a run (JSON lines in the run's `events` log), kept also in memory for
/// the driver's report.
#[derive(Debug)]
pub struct RecoveryLog {
    store: Store,
    run: String,
    events: LogWriter,
    /// The records written, in order.
    pub records: Vec<serde_json::Value>,
}

impl RecoveryLog {
    /// A log written by `writer` (unique per process: a name such as `supervisor` or
    /// `leader-3`).
    pub fn new(store: &Store, run: &str, writer: &str) -> Result<Self> {
        Ok(RecoveryLog {
            store: store.clone(),
            run: run.to_string(),
            events: LogWriter::new(store, run, EVENTS, writer)?,
            records: Vec::new(),
        })
    }

    /// A coordinator record as it is logged: its generation renumbered by `generation` (the
    /// coordinator may count from 0; the store's generations go on across supervisions), and
    /// the restore plan added to a decision. Also logged through `tracing`.
    pub async fn render(&self, rec: &Record, generation: impl Fn(u64) -> u64) -> Event {
        let mut v = rec.clone();
        if let Some(g) = v.generation_mut() {
            *g = generation(*g);
        }
        log_record(rec);
        if let Event::Recovery(r) = &mut v
            && let Some(s) = r.step
            && let Ok(l) = r.layout.parse::<Layout>()
        {
            match restore_plan(&self.store, &self.run, s, &l).await {
                Ok(plan) => r.plan = Some(plan),
                Err(e) => warn!("restore plan: {e}"),
            }
        }
        v
    }

    /// Append a record to the log and write it out (a failed write is logged, not fatal: the
    /// job matters more than its log).
    pub async fn write(&mut self, v: Event) -> Result<()> {
        self.events.append(&v)?;
        if let Err(e) = self.events.flush().await {
            warn!("writing the recovery log: {e}");
        }
        self.records
            .push(serde_json::to_value(&v).map_err(|e| Error::internal(format!("{e}")))?);
        Ok(())
    }
}

/// Partial steps a [`LossBoard`] keeps at most.
pub const MAX_PARTIAL_STEPS: usize = 4096;

/// What the ranks of one step reported so far.
#[derive(Debug, Default)]
struct StepTotals {
    sums: BTreeMap<String, u128>,
    figures: Vec<crate::heartbeat::Figure>,
    ranks: u32,
}

/// Per-step figures of the whole job (the loss and gradient norm of the reference workload),
/// from the [`Workload`] payload every rank sends with its step heartbeat: the driver totals
/// the named sums over the ranks and, once all reported, logs the figures the payload
/// declares in the run's `metrics` log. It knows neither the sums' names nor their scale.
#[derive(Debug)]
pub struct LossBoard {
    metrics: LogWriter,
    partial: BTreeMap<(u64, u64), StepTotals>,
}

impl LossBoard {
    /// A board writing as `writer`.
    pub fn new(store: &Store, run: &str, writer: &str) -> Result<Self> {
        Ok(LossBoard {
            metrics: LogWriter::new(store, run, METRICS, writer)?,
            partial: BTreeMap::new(),
        })
    }

    /// Add one rank's report of `step` in `generation`; once all `world` ranks have reported
    /// the step, its metrics record is logged. A payload over the bounds or with a sum that is
    /// not a non-negative integer counts its rank and adds nothing.
    pub async fn add(
        &mut self,
        generation: u64,
        step: u64,
        workload: &Workload,
        world: u32,
    ) -> Result<()> {
        // Steps that never complete (a rank died, or a stranger's datagrams) are dropped
        // oldest first: the board holds a bounded number of partial steps.
        while self.partial.len() >= MAX_PARTIAL_STEPS
            && !self.partial.contains_key(&(generation, step))
        {
            self.partial.pop_first();
        }
        let e = self.partial.entry((generation, step)).or_default();
        // Heartbeats come from a socket any local process can write to: hostile sums and
        // counts saturate rather than overflow (a panic would take the supervisor down), and
        // the names a step holds are bounded.
        if let Some(sums) = workload.parsed_sums() {
            for (k, v) in sums {
                if e.sums.len() < crate::heartbeat::MAX_SUMS || e.sums.contains_key(&k) {
                    let t = e.sums.entry(k).or_default();
                    *t = t.saturating_add(v);
                }
            }
            if e.figures.is_empty() {
                e.figures = workload.figures.clone();
            }
        }
        e.ranks = e.ranks.saturating_add(1);
        if e.ranks >= world {
            let t = self.partial.remove(&(generation, step)).unwrap_or_default();
            let mut rec = StepMetrics {
                step,
                generation: Some(generation),
                ..StepMetrics::default()
            };
            for f in &t.figures {
                if let Some(v) = f.value(&t.sums) {
                    rec.set(f.curve, v);
                }
            }
            self.metrics.append(&Metric::Step(rec))?;
            if self.metrics.pending() >= 50 {
                let _ = self.metrics.flush().await;
            }
        }
        Ok(())
    }

    /// Write what is buffered.
    pub async fn flush(&mut self) {
        let _ = self.metrics.flush().await;
    }
}

fn log_record(rec: &Record) {
    match rec {
        Event::Failure(f) => {
            error!(rank = f.rank, node = f.node, how = %f.how, "rank failed: {}", f.detail)
        }
        Event::Recovery(r) => {
            warn!(layout = %r.layout, step = ?r.step, steps_lost = r.steps_lost, "recovering")
        }
        Event::Started(s) => {
            info!(generation = s.generation, layout = %s.layout, "generation started")
        }
        Event::Resumed(r) => {
            info!(
                step = r.step,
                since_failure_s = r.since_failure_s,
                restored_s = ?r.restored_s,
                "training resumed"
            )
        }
        Event::StepUnusable(u) => warn!(step = u.step, rank = ?u.rank, "step unusable: {}", u.why),
        Event::Finished(f) => info!(ok = f.ok, "job finished: {}", f.reason),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::process_stopped;
    use std::time::{Duration, Instant};

    fn wait_for(pid: u32, want: bool) -> bool {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if process_stopped(pid) == want {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn a_stopped_process_reads_as_stopped_and_a_continued_one_does_not() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(!process_stopped(pid), "a running process read as stopped");
        // SAFETY: signals to the child this test started.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        assert!(wait_for(pid, true), "SIGSTOP not seen");
        // SAFETY: as above.
        unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        assert!(wait_for(pid, false), "SIGCONT not seen");
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!process_stopped(pid), "a reaped process read as stopped");
    }
}
