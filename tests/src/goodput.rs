//! The goodput soak (`ckpt-bench goodput`, issue 19 §3): the reference workload (`ckpt-train`)
//! under the real `ckpt resume` (simulated nodes and spares, repaired nodes coming back),
//! failures injected at seeded random times, and the same job run failure-free as the
//! baseline. One [`PolicyResult`] per policy:
//!
//! - `baseline`: no failures, everything on (peer replicas, automatic interval);
//! - `all_on` (a): peer replicas and `--ckpt-every auto`;
//! - `store_fixed` (b): no peer replicas (every restore reads the store), a fixed interval;
//! - `peers_fixed` (c): peer replicas with a fixed interval.
//!
//! Failures ([`FailureKind`]) come at exponentially distributed intervals of mean `mtbf`,
//! kinds in a random order that uses each kind once per four failures (so a short run sees
//! every kind): a rank killed (SIGKILL), a rank hung (SIGSTOP), a whole node lost (its replica
//! agent and its ranks, SIGKILL), a node's disk damaging the newest committed step (the ranks
//! are frozen with SIGSTOP so nothing commits meanwhile, an object only that step references
//! is deleted from the store, and the node's ranks are killed: the node went down with its
//! disk). A failure is injected only into a running generation, one per generation: one due
//! while recovery is under way waits for the next generation's ranks. Every policy replays
//! the same schedule (the RNG is seeded afresh from `seed` per policy).
//!
//! How an injected failure is matched ("detected and recovered"): the recovery log must hold a
//! `failure` record of the generation the failure hit and of the victim's node (each record
//! matches one injection; failure records left over are counted as unexpected), and for a
//! damaged disk also a `step_unusable` record of the damaged step; recovered means a later
//! generation started and the job completed (the supervisor's report says ok and the last
//! generation's rank 0 printed the digest of step N).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckpt_store::object_store::path::Path as ObjectPath;
use ckpt_store::{Store, VerifyScope};
use serde_json::{Value, json};

use crate::{bin, digest_in, env_of, find_processes, signal};

/// The environment variable every process of one supervision inherits (the run's marker:
/// how ranks, agents and leftovers are found).
pub const TAG_ENV: &str = "CKPT_BENCH_TAG";

/// The run name inside each policy's store.
const RUN: &str = "goodput";

/// A configuration compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// No failures; peer replicas and the automatic interval (what goodput divides by).
    Baseline,
    /// (a) Peer replicas and the automatic interval.
    AllOn,
    /// (b) Restores from the store only, a fixed interval.
    StoreFixed,
    /// (c) Peer replicas, a fixed interval.
    PeersFixed,
}

impl Policy {
    /// Every policy, the baseline first.
    pub const ALL: [Policy; 4] = [
        Policy::Baseline,
        Policy::AllOn,
        Policy::StoreFixed,
        Policy::PeersFixed,
    ];

    /// Its name in the JSON lines.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Baseline => "baseline",
            Policy::AllOn => "all_on",
            Policy::StoreFixed => "store_fixed",
            Policy::PeersFixed => "peers_fixed",
        }
    }

    /// The policy named `s` (its name, or a, b, c).
    pub fn parse(s: &str) -> Result<Policy, String> {
        match s {
            "baseline" => Ok(Policy::Baseline),
            "all_on" | "a" => Ok(Policy::AllOn),
            "store_fixed" | "b" => Ok(Policy::StoreFixed),
            "peers_fixed" | "c" => Ok(Policy::PeersFixed),
            _ => Err(format!(
                "unknown policy {s:?}: baseline, all_on (a), store_fixed (b) or peers_fixed (c)"
            )),
        }
    }

    fn peers(self) -> bool {
        self != Policy::StoreFixed
    }

    fn auto_interval(self) -> bool {
        matches!(self, Policy::Baseline | Policy::AllOn)
    }

    fn failures(self) -> bool {
        self != Policy::Baseline
    }
}

/// A failure the soak injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// A rank killed with SIGKILL.
    RankKilled,
    /// A rank stopped with SIGSTOP (hung: no heartbeats, no progress).
    RankHung,
    /// A whole node lost: its replica agent and its ranks, SIGKILL.
    NodeLost,
    /// The newest committed step damaged (an object it alone references deleted) and the
    /// node's ranks killed.
    DiskDamaged,
}

impl FailureKind {
    const ALL: [FailureKind; 4] = [
        FailureKind::RankKilled,
        FailureKind::RankHung,
        FailureKind::NodeLost,
        FailureKind::DiskDamaged,
    ];

    /// Its name in the JSON lines.
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::RankKilled => "rank_killed",
            FailureKind::RankHung => "rank_hung",
            FailureKind::NodeLost => "node_lost",
            FailureKind::DiskDamaged => "disk_damaged",
        }
    }
}

/// The soak's settings. [`Options::new`] gives the defaults the bench uses.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where each policy's store, logs and plot go (`DIR/<policy>/`).
    pub dir: PathBuf,
    /// Steps to train (N).
    pub steps: u64,
    /// Milliseconds each step takes at least (`ckpt-train --step-time-ms`).
    pub step_ms: u64,
    /// Model size (`ckpt-train --params`).
    pub params: String,
    /// Mean time between injected failures.
    pub mtbf: Duration,
    /// No gap between failures longer than this (a short run that must see failures; `None`:
    /// the plain exponential distribution).
    pub max_gap: Option<Duration>,
    /// A failed node comes back this long after its failure (`ckpt resume --repair-after`).
    pub repair: Duration,
    /// Seed of the failure schedule.
    pub seed: u64,
    /// The policies to run after the baseline (which always runs first).
    pub policies: Vec<Policy>,
    /// Nodes that run ranks.
    pub nodes: u32,
    /// Spare nodes.
    pub spares: u32,
    /// The job's layout (one rank per node).
    pub layout: String,
    /// The fixed interval of (b) and (c), in steps.
    pub every: u64,
    /// Bounds of the automatic interval, in steps.
    pub auto_min: u64,
    /// See `auto_min`.
    pub auto_max: u64,
    /// Retention (`ckpt-train --keep-last`): the newest committed steps each run keeps, so a
    /// long soak's store stays bounded (a 20-minute run without it wrote 19 GB); `None`
    /// keeps every step.
    pub keep_last: Option<usize>,
    /// How often the soak's operator runs `ckpt gc` (retention plus the sweep of unreferenced
    /// chunks, grace one minute) beside the job, as a long run must: retention alone deletes
    /// steps, not their chunks, and a 20-minute run with checkpoints every few steps wrote
    /// 14 GB of packs and filled the disk. `None`: never (or without `keep_last`).
    pub gc_every: Option<Duration>,
    /// `ckpt resume --heartbeat-timeout`.
    pub heartbeat_timeout: Duration,
    /// `ckpt resume --stop-grace`.
    pub stop_grace: Duration,
    /// `ckpt resume --backoff`.
    pub backoff: Duration,
    /// `ckpt resume --max-node-failures` (within its default window of 10 minutes).
    pub max_node_failures: u32,
    /// A policy's run is stopped (and reported failed) after this long.
    pub timeout: Duration,
    /// Draw a plot of each run (`ckpt plot`).
    pub plot: bool,
}

impl Options {
    /// Defaults: 4 nodes and 2 spares, layout dp=1, 1M parameters, a fixed interval of 50
    /// steps, the automatic one within 5 to 200 steps, repaired nodes back after `mtbf`.
    pub fn new(dir: &Path, steps: u64, step_ms: u64, mtbf: Duration, seed: u64) -> Options {
        Options {
            dir: dir.to_path_buf(),
            steps,
            step_ms,
            params: "1M".into(),
            mtbf,
            max_gap: None,
            repair: mtbf,
            seed,
            policies: Policy::ALL.to_vec(),
            nodes: 4,
            spares: 2,
            layout: "dp=1".into(),
            every: 50,
            auto_min: 5,
            auto_max: 200,
            keep_last: Some(8),
            gc_every: Some(Duration::from_secs(60)),
            heartbeat_timeout: Duration::from_secs(2),
            stop_grace: Duration::from_secs(1),
            backoff: Duration::from_millis(100),
            max_node_failures: 1000,
            timeout: Duration::from_secs(steps * step_ms / 1000 * 5 + 300),
            plot: true,
        }
    }
}

/// The steps that take about `minutes` failure-free at `step_ms` a step.
pub fn steps_for(minutes: f64, step_ms: u64) -> u64 {
    ((minutes * 60_000.0) / step_ms.max(1) as f64)
        .round()
        .max(1.0) as u64
}

/// One injected failure and what became of it.
#[derive(Debug, Clone)]
pub struct Injection {
    /// Seconds after `ckpt resume` started.
    pub at_s: f64,
    /// What was done.
    pub kind: FailureKind,
    /// The generation hit.
    pub generation: u64,
    /// The victim's node.
    pub node: u32,
    /// Processes signalled.
    pub pids: Vec<u32>,
    /// The step damaged (disk failures with a committed step to damage).
    pub damaged_step: Option<u64>,
    /// The object deleted.
    pub damaged_object: Option<String>,
    /// A matching `failure` record (and `step_unusable` for a damaged step) is in the log.
    pub detected: bool,
    /// A later generation started and the job completed.
    pub recovered: bool,
    /// Seconds from the failure's evidence (the `failure` record's time less its detection
    /// latency) to the first step of the next generation.
    pub failure_to_step_s: Option<f64>,
}

/// Resident memory samples (KiB): the supervisor and the sum over its live replica agents.
#[derive(Debug, Clone, Copy, Default)]
pub struct RssSample {
    /// Seconds after start.
    pub at_s: f64,
    /// `ckpt resume`.
    pub supervisor_kib: u64,
    /// The live replica agents, summed.
    pub agents_kib: u64,
    /// How many agents.
    pub agents: usize,
}

impl RssSample {
    /// The mean resident memory of one live agent (the sum moves with how many are alive).
    pub fn per_agent_kib(&self) -> u64 {
        self.agents_kib / self.agents.max(1) as u64
    }
}

/// What one policy's run gave.
#[derive(Debug, Clone)]
pub struct PolicyResult {
    /// The policy.
    pub policy: Policy,
    /// Steps (N).
    pub steps: u64,
    /// The supervisor's report said the job completed.
    pub ok: bool,
    /// Why it ended.
    pub reason: String,
    /// Seconds from starting `ckpt resume` to its exit.
    pub wall_s: f64,
    /// The baseline's wall time / this one's.
    pub goodput: f64,
    /// The final digest of the last generation's rank 0.
    pub digest: Option<String>,
    /// It equals the uninterrupted run's.
    pub digest_equal: bool,
    /// The failures injected.
    pub injections: Vec<Injection>,
    /// `failure` records that match no injection.
    pub unexpected_failures: usize,
    /// Restarts the supervisor made.
    pub restarts: u64,
    /// Steps trained again (the `recovery` and `grow` records' `steps_lost`).
    pub steps_lost: u64,
    /// Mean of the injections' `failure_to_step_s`.
    pub mean_failure_to_step_s: Option<f64>,
    /// Restored bytes served by peer replicas.
    pub bytes_from_peers: u64,
    /// Restored bytes read from the store.
    pub bytes_from_store: u64,
    /// Steps seen committed during the run that are no longer committed at the end and were
    /// not retired as damaged by an injected failure: must be empty.
    pub committed_lost: Vec<u64>,
    /// Steps the supervisor found unusable (`step_unusable`).
    pub unusable: Vec<u64>,
    /// `verify` of the run found every committed step intact.
    pub verify_clean: bool,
    /// Processes with the run's marker alive after `ckpt resume` exited (then killed).
    pub leftover: Vec<u32>,
    /// Memory once the first step is committed (the agents then hold a snapshot), at the end
    /// (last sample), and the highest of each figure over the run.
    pub rss: Option<(RssSample, RssSample, RssSample)>,
    /// The plot drawn (`ckpt plot`).
    pub plot: Option<PathBuf>,
    /// The policy's directory (store, rank logs, `resume.json`, `resume.err`).
    pub dir: PathBuf,
    /// `ckpt gc` runs beside the job ([`Options::gc_every`]): (started, failed).
    pub gc_runs: (u32, u32),
}

impl PolicyResult {
    /// Every injected failure was detected and recovered from.
    pub fn all_recovered(&self) -> bool {
        self.injections.iter().all(|i| i.detected && i.recovered)
    }

    /// The JSON line of `ckpt-bench goodput`.
    pub fn json(&self, seed: u64) -> Value {
        let count = |k: FailureKind| self.injections.iter().filter(|i| i.kind == k).count();
        let by_kind: serde_json::Map<String, Value> = FailureKind::ALL
            .iter()
            .map(|k| (k.name().to_string(), json!(count(*k))))
            .collect();
        let rss = self.rss.map(|(a, b, peak)| {
            json!({
                "start_s": a.at_s, "end_s": b.at_s,
                "supervisor_start_kib": a.supervisor_kib, "supervisor_end_kib": b.supervisor_kib,
                "supervisor_peak_kib": peak.supervisor_kib,
                "agents_start_kib": a.agents_kib, "agents_end_kib": b.agents_kib,
                "agents_start": a.agents, "agents_end": b.agents,
                "agent_start_kib": a.per_agent_kib(), "agent_end_kib": b.per_agent_kib(),
                "agent_peak_kib": peak.agents_kib,
            })
        });
        json!({
            "bench": "goodput",
            "policy": self.policy.name(),
            "goodput": self.goodput,
            "failures": self.injections.len(),
            "steps_lost": self.steps_lost,
            "mean_failure_to_step_s": self.mean_failure_to_step_s,
            "bytes_from_peers": self.bytes_from_peers,
            "bytes_from_store": self.bytes_from_store,
            "final_digest_equal": self.digest_equal,
            "ok": self.ok,
            "reason": self.reason,
            "steps": self.steps,
            "wall_s": self.wall_s,
            "seed": seed,
            "failures_by_kind": by_kind,
            "detected": self.injections.iter().filter(|i| i.detected).count(),
            "recovered": self.injections.iter().filter(|i| i.recovered).count(),
            "unexpected_failures": self.unexpected_failures,
            "restarts": self.restarts,
            "committed_steps_lost": self.committed_lost,
            "unusable_steps": self.unusable,
            "verify_clean": self.verify_clean,
            "leftover_processes": self.leftover.len(),
            "gc_runs": self.gc_runs.0,
            "gc_failed": self.gc_runs.1,
            "rss": rss,
            "plot": self.plot.as_ref().map(|p| p.display().to_string()),
            "injections": self.injections.iter().map(|i| json!({
                "at_s": i.at_s, "kind": i.kind.name(), "generation": i.generation,
                "node": i.node, "damaged_step": i.damaged_step, "detected": i.detected,
                "recovered": i.recovered, "failure_to_step_s": i.failure_to_step_s,
            })).collect::<Vec<_>>(),
        })
    }
}

/// A small seeded RNG (splitmix64): a schedule is replayed from its seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Exponentially distributed with mean `mean`.
    pub fn exp(&mut self, mean: Duration) -> Duration {
        Duration::from_secs_f64(-mean.as_secs_f64() * (1.0 - self.unit()).ln())
    }
}

/// The failure schedule: exponential gaps, kinds in shuffled rounds of all four.
struct Schedule {
    rng: Rng,
    round: Vec<FailureKind>,
}

impl Schedule {
    fn new(seed: u64) -> Schedule {
        Schedule {
            rng: Rng::new(seed),
            round: Vec::new(),
        }
    }

    fn gap(&mut self, mean: Duration, max: Option<Duration>) -> Duration {
        let g = self.rng.exp(mean);
        max.map_or(g, |m| g.min(m))
    }

    fn kind(&mut self) -> FailureKind {
        if self.round.is_empty() {
            self.round = FailureKind::ALL.to_vec();
            // Fisher-Yates.
            for i in (1..self.round.len()).rev() {
                let j = self.rng.below(i + 1);
                self.round.swap(i, j);
            }
        }
        self.round.pop().expect("a kind")
    }
}

/// Run the baseline and then `opts.policies` (see the module docs), calling `each` with every
/// result as it is done.
pub fn run(
    opts: &Options,
    mut each: impl FnMut(&PolicyResult),
) -> Result<Vec<PolicyResult>, String> {
    std::fs::create_dir_all(&opts.dir)
        .map_err(|e| format!("creating {}: {e}", opts.dir.display()))?;
    let want = reference_digest(opts)?;
    let mut out = Vec::new();
    let mut baseline_s = None;
    let mut order = vec![Policy::Baseline];
    order.extend(opts.policies.iter().filter(|p| **p != Policy::Baseline));
    for policy in order {
        let mut r = run_policy(opts, policy, &want)?;
        let base = *baseline_s.get_or_insert(r.wall_s);
        r.goodput = base / r.wall_s;
        each(&r);
        out.push(r);
    }
    Ok(out)
}

/// The final digest of the same job run uninterrupted in one process (all ranks as threads).
fn reference_digest(opts: &Options) -> Result<String, String> {
    let store = opts.dir.join("reference");
    let _ = std::fs::remove_dir_all(&store);
    let out = Command::new(bin("ckpt-train", "ckpt-train"))
        .arg("--store")
        .arg(&store)
        .args(["--run", "reference", "--layout", &opts.layout])
        .args(["--steps", &opts.steps.to_string()])
        .args(["--ckpt-every", &opts.steps.to_string()])
        .args(["--params", &opts.params, "--seed", "5"])
        .env("CKPT_LOG", "warn")
        .output()
        .map_err(|e| format!("running ckpt-train: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let _ = std::fs::remove_dir_all(&store);
    match (out.status.success(), digest_in(&text)) {
        (true, Some(d)) => Ok(d),
        _ => Err(format!(
            "the uninterrupted reference run failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

/// The `ckpt-train` command of every rank.
fn train_command(opts: &Options, policy: Policy) -> Vec<String> {
    let mut c: Vec<String> = vec![
        bin("ckpt-train", "ckpt-train").display().to_string(),
        "--steps".into(),
        opts.steps.to_string(),
        "--params".into(),
        opts.params.clone(),
        "--seed".into(),
        "5".into(),
        "--step-time-ms".into(),
        opts.step_ms.to_string(),
        "--ckpt-every".into(),
    ];
    if policy.auto_interval() {
        c.extend([
            "auto".into(),
            "--ckpt-every-min".into(),
            opts.auto_min.to_string(),
            "--ckpt-every-max".into(),
            opts.auto_max.to_string(),
        ]);
    } else {
        c.push(opts.every.to_string());
    }
    if let Some(k) = opts.keep_last {
        c.extend(["--keep-last".into(), k.to_string()]);
    }
    c
}

fn ms(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

/// A live rank process of the supervision.
#[derive(Debug, Clone, Copy)]
struct RankProc {
    pid: u32,
    node: u32,
    generation: u64,
}

/// The process state letter of `pid` (`R`, `S`, `T`, `Z`, ...), `None` when it is gone.
fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may hold spaces: the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Processes carrying `tag`, not zombies.
fn tagged(tag: &str) -> Vec<(u32, Vec<(String, String)>)> {
    find_processes(&[(TAG_ENV, tag)])
        .into_iter()
        .filter(|(pid, _)| state(*pid).is_some_and(|s| s != 'Z' && s != 'X'))
        .collect()
}

/// The running (not stopped) ranks of the supervision.
fn ranks(tag: &str) -> Vec<RankProc> {
    tagged(tag)
        .into_iter()
        .filter_map(|(pid, env)| {
            env_of(&env, "CKPT_RANK")?;
            if state(pid) == Some('T') {
                return None;
            }
            Some(RankProc {
                pid,
                node: env_of(&env, "CKPT_NODE")?.parse().ok()?,
                generation: env_of(&env, "CKPT_GENERATION")?.parse().ok()?,
            })
        })
        .collect()
}

fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).to_string())
        .collect()
}

/// The live replica agents of the supervision: (pid, node).
fn agents(tag: &str) -> Vec<(u32, u32)> {
    tagged(tag)
        .into_iter()
        .filter_map(|(pid, _)| {
            let args = cmdline(pid);
            if !args.iter().any(|a| a == "replica-agent") {
                return None;
            }
            let at = args.iter().position(|a| a == "--node")?;
            Some((pid, args.get(at + 1)?.parse().ok()?))
        })
        .collect()
}

/// Resident memory of `pid`, KiB (0 when it is gone).
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// The chunk and pack objects of `step` (each chunk's own, not its delta bases), by key.
async fn step_objects(st: &Store, step: u64) -> ckpt_store::Result<BTreeMap<String, ObjectPath>> {
    Ok(st
        .step_chunk_refs(RUN, step)
        .await?
        .iter()
        .map(|c| {
            let p = st.object_of(c);
            (p.to_string(), p)
        })
        .collect())
}

/// Delete an object of the newest committed step that the step before it does not reference:
/// the step and the object, or `None` when there is no such object (fewer than two committed
/// steps, or the newest holds nothing of its own). A disk failure damages one step and leaves
/// the older ones to recover from; one that destroyed every committed step would leave the
/// job nothing to resume (recovery then stops, by design, rather than start over silently).
async fn damage_newest(st: &Store) -> Result<Option<(u64, String)>, String> {
    let steps = st.committed_steps(RUN).await.map_err(|e| e.to_string())?;
    let [.., older_step, newest] = steps[..] else {
        return Ok(None);
    };
    let mine = step_objects(st, newest).await.map_err(|e| e.to_string())?;
    let older = step_objects(st, older_step)
        .await
        .map_err(|e| e.to_string())?;
    let Some((key, path)) = mine
        .iter()
        .find(|(k, _)| !older.contains_key(*k))
        .map(|(k, p)| (k.clone(), p.clone()))
    else {
        return Ok(None);
    };
    st.delete_all(vec![path])
        .await
        .map_err(|e| format!("deleting {key}: {e}"))?;
    Ok(Some((newest, key)))
}

/// Inject `kind` into generation `g` (its running ranks `live`), choosing the victim with
/// `rng`.
fn inject(
    rt: &tokio::runtime::Runtime,
    st: &Store,
    tag: &str,
    kind: FailureKind,
    live: &[RankProc],
    rng: &mut Rng,
    at_s: f64,
) -> Injection {
    let victim = live[rng.below(live.len())];
    let node_ranks: Vec<u32> = live
        .iter()
        .filter(|r| r.node == victim.node)
        .map(|r| r.pid)
        .collect();
    let mut inj = Injection {
        at_s,
        kind,
        generation: victim.generation,
        node: victim.node,
        pids: vec![victim.pid],
        damaged_step: None,
        damaged_object: None,
        detected: false,
        recovered: false,
        failure_to_step_s: None,
    };
    match kind {
        FailureKind::RankKilled => signal(victim.pid, libc::SIGKILL),
        FailureKind::RankHung => signal(victim.pid, libc::SIGSTOP),
        FailureKind::NodeLost => {
            let agent: Vec<u32> = agents(tag)
                .into_iter()
                .filter(|(_, n)| *n == victim.node)
                .map(|(p, _)| p)
                .collect();
            inj.pids = node_ranks.iter().chain(&agent).copied().collect();
            for p in &inj.pids {
                signal(*p, libc::SIGKILL);
            }
        }
        FailureKind::DiskDamaged => {
            // Freeze the generation so no newer step commits between the damage and the kill.
            for r in live {
                signal(r.pid, libc::SIGSTOP);
            }
            match rt.block_on(damage_newest(st)) {
                Ok(Some((step, key))) => {
                    inj.damaged_step = Some(step);
                    inj.damaged_object = Some(key);
                }
                Ok(None) => {}
                Err(e) => eprintln!("goodput: damaging the newest step: {e}"),
            }
            inj.pids = node_ranks.clone();
            for p in &node_ranks {
                signal(*p, libc::SIGKILL);
            }
            for r in live.iter().filter(|r| r.node != victim.node) {
                signal(r.pid, libc::SIGCONT);
            }
        }
    }
    inj
}

/// The digest printed by the newest generation's rank 0 (`rank-0.gen-G.out`).
fn final_digest(logs: &Path) -> Option<String> {
    let mut best: Option<(u64, String)> = None;
    for e in std::fs::read_dir(logs).ok()?.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(g) = name
            .strip_prefix("rank-0.gen-")
            .and_then(|s| s.strip_suffix(".out"))
            .and_then(|g| g.parse::<u64>().ok())
            && let Some(d) = digest_in(&std::fs::read_to_string(e.path()).unwrap_or_default())
            && best.as_ref().is_none_or(|(bg, _)| g > *bg)
        {
            best = Some((g, d));
        }
    }
    best.map(|b| b.1)
}

fn of_kind<'a>(records: &'a [Value], kind: &str) -> Vec<&'a Value> {
    records.iter().filter(|r| r["kind"] == kind).collect()
}

/// Mark what of each injection the recovery log shows (see the module docs); returns the
/// failure records no injection matched.
fn match_injections(injections: &mut [Injection], records: &[Value], completed: bool) -> usize {
    let failures = of_kind(records, "failure");
    let mut used = vec![false; failures.len()];
    let unusable = of_kind(records, "step_unusable");
    let started = of_kind(records, "started");
    let resumed = of_kind(records, "resumed");
    let u = |v: &Value, k: &str| v[k].as_u64();
    for inj in injections.iter_mut() {
        let Some(i) = (0..failures.len()).find(|&i| {
            !used[i]
                && u(failures[i], "generation") == Some(inj.generation)
                && u(failures[i], "node") == Some(u64::from(inj.node))
        }) else {
            continue;
        };
        used[i] = true;
        let f = failures[i];
        let step_found = inj.damaged_step.is_none_or(|s| {
            unusable.iter().any(|r| {
                u(r, "step") == Some(s) && u(r, "generation").is_some_and(|g| g >= inj.generation)
            })
        });
        inj.detected = step_found;
        let later = |r: &&&Value| u(r, "generation").is_some_and(|g| g > inj.generation);
        inj.recovered = completed && started.iter().any(|r| later(&r));
        let evidence_ms =
            f["at_ms"].as_f64().unwrap_or(0.0) - f["detection_s"].as_f64().unwrap_or(0.0) * 1e3;
        inj.failure_to_step_s = resumed
            .iter()
            .find(|r| later(r))
            .and_then(|r| r["at_ms"].as_f64())
            .map(|at| (at - evidence_ms) / 1e3);
    }
    used.iter().filter(|u| !**u).count()
}

/// The operator's `ckpt gc` beside a policy's job, one at a time, every
/// [`Options::gc_every`]; each run's output appended to `gc.log` in the policy's directory.
struct Housekeeping {
    every: Option<Duration>,
    cmd: Vec<String>,
    log: PathBuf,
    running: Option<Child>,
    last: Instant,
    started: u32,
    failed: u32,
}

impl Housekeeping {
    fn new(opts: &Options, store: &Path, dir: &Path) -> Housekeeping {
        let keep = opts.keep_last.unwrap_or(0);
        Housekeeping {
            every: opts.gc_every.filter(|_| opts.keep_last.is_some()),
            cmd: vec![
                "--store".into(),
                store.display().to_string(),
                "--json".into(),
                "gc".into(),
                "--run".into(),
                RUN.into(),
                "--keep-last".into(),
                keep.to_string(),
                "--grace".into(),
                "60s".into(),
                "--no-progress".into(),
            ],
            log: dir.join("gc.log"),
            running: None,
            last: Instant::now(),
            started: 0,
            failed: 0,
        }
    }

    /// Reap a finished run; start the next one when due.
    fn poll(&mut self) {
        if let Some(c) = self.running.as_mut()
            && let Ok(Some(st)) = c.try_wait()
        {
            self.failed += u32::from(!st.success());
            self.running = None;
        }
        let Some(every) = self.every else { return };
        if self.running.is_some() || self.last.elapsed() < every {
            return;
        }
        self.last = Instant::now();
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log);
        let Ok(out) = out else {
            self.failed += 1;
            return;
        };
        let err = out.try_clone();
        let mut c = Command::new(bin("ckpt", "ckpt"));
        c.args(&self.cmd)
            .env("CKPT_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(out);
        if let Ok(e) = err {
            c.stderr(e);
        }
        match c.spawn() {
            Ok(child) => {
                self.started += 1;
                self.running = Some(child);
            }
            Err(_) => self.failed += 1,
        }
    }

    /// Wait for the run in flight (a sweep between its delete batches stops within seconds
    /// of a kill) and return (started, failed).
    fn finish(mut self) -> (u32, u32) {
        if let Some(mut c) = self.running.take() {
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(30) {
                if let Ok(Some(st)) = c.try_wait() {
                    self.failed += u32::from(!st.success());
                    return (self.started, self.failed);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = c.kill();
            let _ = c.wait();
            self.failed += 1;
        }
        (self.started, self.failed)
    }
}

fn run_policy(opts: &Options, policy: Policy, want: &str) -> Result<PolicyResult, String> {
    let dir = opts.dir.join(policy.name());
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let store = dir.join("store");
    let logs = dir.join("logs");
    let tag = format!("goodput-{}-{}", std::process::id(), policy.name());
    let file = |name: &str| {
        std::fs::File::create(dir.join(name)).map_err(|e| format!("creating {name}: {e}"))
    };
    let mut cmd = Command::new(bin("ckpt", "ckpt"));
    cmd.arg("--store")
        .arg(&store)
        .args(["--json", "resume", "--run", RUN])
        .args(["--nodes", &opts.nodes.to_string(), "--ranks-per-node", "1"])
        .args([
            "--spares",
            &opts.spares.to_string(),
            "--layout",
            &opts.layout,
        ])
        .args(["--max-restarts", "100000"])
        .args(["--max-node-failures", &opts.max_node_failures.to_string()])
        .args(["--heartbeat-timeout", &ms(opts.heartbeat_timeout)])
        .args(["--stop-grace", &ms(opts.stop_grace)])
        .args(["--backoff", &ms(opts.backoff)])
        .args(["--repair-after", &ms(opts.repair)]);
    if policy.peers() {
        cmd.arg("--peer-replicas");
    }
    cmd.arg("--logs")
        .arg(&logs)
        .arg("--")
        .args(train_command(opts, policy))
        .env(TAG_ENV, &tag)
        .stdin(Stdio::null())
        .stdout(file("resume.json")?)
        .stderr(file("resume.err")?);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("a runtime: {e}"))?;
    let st = ckpt_store::open(&store.display().to_string()).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let mut child: Child = cmd
        .spawn()
        .map_err(|e| format!("starting ckpt resume: {e}"))?;
    let sup = child.id();
    let mut schedule = Schedule::new(opts.seed);
    let mut next = policy
        .failures()
        .then(|| schedule.gap(opts.mtbf, opts.max_gap));
    let mut injections: Vec<Injection> = Vec::new();
    let mut seen = BTreeSet::new();
    let mut last_poll = Instant::now();
    let mut first_rank: Option<Instant> = None;
    let (mut rss_first, mut rss_last): (Option<RssSample>, Option<RssSample>) = (None, None);
    // The highest supervisor figure and the highest single agent's (in `agents_kib`).
    let mut rss_peak = RssSample::default();
    let mut last_rss = Instant::now();
    let mut timed_out = false;
    let mut gc = Housekeeping::new(opts, &store, &dir);
    loop {
        gc.poll();
        if child.try_wait().map_err(|e| e.to_string())?.is_some() {
            break;
        }
        if t0.elapsed() > opts.timeout {
            signal(sup, libc::SIGKILL);
            let _ = child.wait();
            timed_out = true;
            break;
        }
        if last_poll.elapsed() >= Duration::from_millis(500) {
            last_poll = Instant::now();
            if let Ok(s) = rt.block_on(st.committed_steps(RUN)) {
                seen.extend(s);
            }
        }
        // Memory: once a second, from the first committed step on (before it the agents
        // hold no snapshot yet, so a start sample would show their growth to steady state).
        if !seen.is_empty() && last_rss.elapsed() >= Duration::from_secs(1) {
            last_rss = Instant::now();
            let a = agents(&tag);
            let each: Vec<u64> = a.iter().map(|(p, _)| rss_kib(*p)).collect();
            let s = RssSample {
                at_s: t0.elapsed().as_secs_f64(),
                supervisor_kib: rss_kib(sup),
                agents_kib: each.iter().sum(),
                agents: a.len(),
            };
            if s.supervisor_kib > 0 {
                rss_first.get_or_insert(s);
                rss_last = Some(s);
                rss_peak.supervisor_kib = rss_peak.supervisor_kib.max(s.supervisor_kib);
                rss_peak.agents_kib = rss_peak
                    .agents_kib
                    .max(each.iter().copied().max().unwrap_or(0));
            }
        }
        let due = next.is_some_and(|n| t0.elapsed() >= n);
        if first_rank.is_none() || due {
            let live = ranks(&tag);
            if first_rank.is_none() && !live.is_empty() {
                first_rank = Some(Instant::now());
            }
            let newest = live.iter().map(|r| r.generation).max();
            if due
                && let Some(g) = newest
                && injections.last().is_none_or(|i| i.generation < g)
            {
                let gen_live: Vec<RankProc> =
                    live.into_iter().filter(|r| r.generation == g).collect();
                let kind = schedule.kind();
                let at_s = t0.elapsed().as_secs_f64();
                let inj = inject(&rt, &st, &tag, kind, &gen_live, &mut schedule.rng, at_s);
                eprintln!(
                    "goodput {}: {:.1} s: {} on node {} (generation {}){}",
                    policy.name(),
                    at_s,
                    kind.name(),
                    inj.node,
                    inj.generation,
                    inj.damaged_step
                        .map_or(String::new(), |s| format!(", step {s} damaged"))
                );
                injections.push(inj);
                next = Some(t0.elapsed() + schedule.gap(opts.mtbf, opts.max_gap));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let gc_runs = gc.finish();

    // Leftovers: nothing of this supervision may outlive it (a few seconds to die).
    let t1 = Instant::now();
    let mut leftover = tagged(&tag);
    while !leftover.is_empty() && t1.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(100));
        leftover = tagged(&tag);
    }
    let leftover: Vec<u32> = leftover.into_iter().map(|(p, _)| p).collect();
    for p in &leftover {
        signal(*p, libc::SIGKILL);
    }

    let text = std::fs::read_to_string(dir.join("resume.json")).unwrap_or_default();
    let report: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let records: Vec<Value> = match report["records"].as_array() {
        Some(r) => r.clone(),
        None => rt
            .block_on(ckpt_store::logs::read_log(
                &st,
                RUN,
                ckpt_store::logs::EVENTS,
            ))
            .unwrap_or_default(),
    };
    let ok = report["ok"].as_bool() == Some(true) && !timed_out;
    let reason = if timed_out {
        format!("timed out after {} s", opts.timeout.as_secs())
    } else {
        report["reason"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| "ckpt resume printed no report (see resume.err)".into())
    };
    let digest = final_digest(&logs);
    let digest_equal = digest.as_deref() == Some(want);
    let unexpected_failures = match_injections(&mut injections, &records, ok && digest.is_some());
    let times: Vec<f64> = injections
        .iter()
        .filter_map(|i| i.failure_to_step_s)
        .collect();
    let mean_failure_to_step_s =
        (!times.is_empty()).then(|| times.iter().sum::<f64>() / times.len() as f64);
    let steps_lost = records
        .iter()
        .filter(|r| r["kind"] == "recovery" || r["kind"] == "grow")
        .filter_map(|r| r["steps_lost"].as_u64())
        .sum();
    let restores = report["restores"].as_array().cloned().unwrap_or_default();
    let sum = |k: &str| restores.iter().filter_map(|r| r[k].as_u64()).sum::<u64>();
    let unusable: Vec<u64> = of_kind(&records, "step_unusable")
        .iter()
        .filter_map(|r| r["step"].as_u64())
        .collect();
    let damaged: BTreeSet<u64> = injections.iter().filter_map(|i| i.damaged_step).collect();
    let now: BTreeSet<u64> = rt
        .block_on(st.committed_steps(RUN))
        .map_err(|e| format!("listing the committed steps: {e}"))?
        .into_iter()
        .collect();
    // Retention may delete a step only when at least `keep_last` newer ones are committed at
    // the end: a step gone below that line is lost, whatever deleted it.
    let retention_line = opts
        .keep_last
        .and_then(|k| now.iter().rev().nth(k.saturating_sub(1)).copied());
    let committed_lost: Vec<u64> = seen
        .iter()
        // Still committed, damaged by an injection and retired by recovery, or older than the
        // steps retention keeps.
        .filter(|s| {
            !(now.contains(s)
                || (damaged.contains(s) && unusable.contains(s))
                || retention_line.is_some_and(|line| **s < line))
        })
        .copied()
        .collect();
    let verify_clean = rt
        .block_on(st.verify(&VerifyScope::Run(RUN.into()), None))
        .is_ok_and(|v| v.is_clean());
    let plot = opts.plot.then(|| dir.join("plot.png")).filter(|p| {
        Command::new(bin("ckpt", "ckpt"))
            .arg("--store")
            .arg(&store)
            .args(["plot", RUN, "--out"])
            .arg(p)
            .env("CKPT_LOG", "warn")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    Ok(PolicyResult {
        policy,
        steps: opts.steps,
        ok,
        reason,
        wall_s,
        goodput: 1.0,
        digest,
        digest_equal,
        injections,
        unexpected_failures,
        restarts: report["restarts"].as_u64().unwrap_or(0),
        steps_lost,
        mean_failure_to_step_s,
        bytes_from_peers: sum("bytes_from_peers"),
        bytes_from_store: sum("bytes_from_store"),
        committed_lost,
        unusable,
        verify_clean,
        leftover,
        rss: rss_first.zip(rss_last).map(|(a, b)| (a, b, rss_peak)),
        plot,
        dir,
        gc_runs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_replays_from_its_seed_and_uses_every_kind_each_round() {
        let draw = |seed| {
            let mut s = Schedule::new(seed);
            (0..8)
                .map(|_| (s.gap(Duration::from_secs(10), None), s.kind()))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        for round in draw(7).chunks(4) {
            let kinds: BTreeSet<&str> = round.iter().map(|(_, k)| k.name()).collect();
            assert_eq!(kinds.len(), 4, "{round:?}");
        }
        // The mean gap is about the mean asked for.
        let mut r = Rng::new(1);
        let n = 20_000;
        let mean: f64 = (0..n)
            .map(|_| r.exp(Duration::from_secs(15)).as_secs_f64())
            .sum::<f64>()
            / n as f64;
        assert!((mean - 15.0).abs() < 0.5, "{mean}");
    }

    #[test]
    fn injections_match_failure_records_of_their_generation_and_node() {
        let inj = |kind, generation, node, damaged_step| Injection {
            at_s: 1.0,
            kind,
            generation,
            node,
            pids: vec![],
            damaged_step,
            damaged_object: None,
            detected: false,
            recovered: false,
            failure_to_step_s: None,
        };
        let mut injections = vec![
            inj(FailureKind::RankKilled, 0, 0, None),
            inj(FailureKind::DiskDamaged, 1, 4, Some(20)),
            inj(FailureKind::RankHung, 2, 5, None),
        ];
        let records = vec![
            json!({"kind": "started", "generation": 0}),
            json!({"kind": "failure", "generation": 0, "node": 0, "at_ms": 5000, "detection_s": 0.0}),
            json!({"kind": "started", "generation": 1}),
            json!({"kind": "resumed", "generation": 1, "at_ms": 6500}),
            json!({"kind": "failure", "generation": 1, "node": 4, "at_ms": 9000, "detection_s": 0.0}),
            // The damage was found while choosing: the step_unusable record is the next
            // generation's.
            json!({"kind": "step_unusable", "generation": 2, "step": 20}),
            json!({"kind": "started", "generation": 2}),
            json!({"kind": "resumed", "generation": 2, "at_ms": 10000}),
            // The hang: detected on another node than the one stopped (no match), and an
            // extra failure.
            json!({"kind": "failure", "generation": 2, "node": 3, "at_ms": 12000, "detection_s": 2.0}),
            json!({"kind": "started", "generation": 3}),
        ];
        let extra = match_injections(&mut injections, &records, true);
        assert_eq!(extra, 1);
        assert!(injections[0].detected && injections[0].recovered);
        assert_eq!(injections[0].failure_to_step_s, Some(1.5));
        assert!(injections[1].detected && injections[1].recovered);
        assert_eq!(injections[1].failure_to_step_s, Some(1.0));
        assert!(!injections[2].detected && !injections[2].recovered);
        // Without the step_unusable record the damage was not detected.
        let mut again = vec![inj(FailureKind::DiskDamaged, 1, 4, Some(20))];
        let no_unusable: Vec<Value> = records
            .iter()
            .filter(|r| r["kind"] != "step_unusable")
            .cloned()
            .collect();
        match_injections(&mut again, &no_unusable, true);
        assert!(!again[0].detected);
        // A job that did not complete recovered from nothing.
        let mut third = vec![inj(FailureKind::RankKilled, 0, 0, None)];
        match_injections(&mut third, &records, false);
        assert!(third[0].detected && !third[0].recovered);
    }
}
