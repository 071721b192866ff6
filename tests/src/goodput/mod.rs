//! The goodput soak (`ckpt-bench goodput`, issue 19 §3): the reference workload (`ckpt-train`)
//! under the real `ckpt resume` (simulated nodes and spares, repaired nodes coming back),
//! failures injected at seeded random times, and the same job run failure-free as the
//! baseline. One [`PolicyResult`] per policy:
//!
//! - `baseline`: no failures, everything on (peer replicas, automatic interval);
//! - `all_on` (a): peer replicas and `--ckpt-every auto`;
//! - `store_fixed` (b): no peer replicas (every restore reads the store), a fixed interval;
//! - `peers_fixed` (c): peer replicas with a fixed interval;
//! - `tiered` (d): a local tier (`--local-tier`, issue 28) and the automatic interval, no peer
//!   replicas: saves commit on the machine's disk and drain to the store behind, restores read
//!   the tier first; a damaged disk is the local tier's.
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
//! damaged disk also a `step_unusable` record of the damaged step (with a local tier, whose
//! damage the remote store mends, a rank's `local_tier_damaged` event of that step does as
//! well: the restore read the damaged chunks from the remote and said so); recovered means a later
//! generation started and the job completed (the supervisor's report says ok and the last
//! generation's rank 0 printed the digest of step N).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::{bin, digest_in};

mod failures;
mod housekeeping;
mod procs;
mod run;
#[cfg(test)]
mod tests;

pub use failures::Rng;

/// The environment variable every process of one supervision inherits (the run's marker:
/// how ranks, agents and leftovers are found).
pub const TAG_ENV: &str = "CKPT_BENCH_TAG";

/// The run name inside each policy's store.
pub(crate) const RUN: &str = "goodput";

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
    /// (d) A local tier drained to the store, the automatic interval, no peer replicas.
    Tiered,
}

impl Policy {
    /// Every policy, the baseline first.
    pub const ALL: [Policy; 5] = [
        Policy::Baseline,
        Policy::AllOn,
        Policy::StoreFixed,
        Policy::PeersFixed,
        Policy::Tiered,
    ];

    /// Its name in the JSON lines.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Baseline => "baseline",
            Policy::AllOn => "all_on",
            Policy::StoreFixed => "store_fixed",
            Policy::PeersFixed => "peers_fixed",
            Policy::Tiered => "tiered",
        }
    }

    /// The policy named `s` (its name, or a, b, c).
    pub fn parse(s: &str) -> Result<Policy, String> {
        match s {
            "baseline" => Ok(Policy::Baseline),
            "all_on" | "a" => Ok(Policy::AllOn),
            "store_fixed" | "b" => Ok(Policy::StoreFixed),
            "peers_fixed" | "c" => Ok(Policy::PeersFixed),
            "tiered" | "d" => Ok(Policy::Tiered),
            _ => Err(format!(
                "unknown policy {s:?}: baseline, all_on (a), store_fixed (b), peers_fixed (c) \
                 or tiered (d)"
            )),
        }
    }

    pub(crate) fn peers(self) -> bool {
        !matches!(self, Policy::StoreFixed | Policy::Tiered)
    }

    pub(crate) fn auto_interval(self) -> bool {
        matches!(self, Policy::Baseline | Policy::AllOn | Policy::Tiered)
    }

    /// Whether the job has a local tier (`<policy dir>/tier`).
    pub(crate) fn local_tier(self) -> bool {
        self == Policy::Tiered
    }

    pub(crate) fn failures(self) -> bool {
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
    pub(crate) const ALL: [FailureKind; 4] = [
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
    /// Bytes the restores read from the local tier (the `tiered` policy).
    pub bytes_from_local: u64,
    /// The supervisor's restore records, one per generation that restored: its `step`, and
    /// its bytes by where they came from (`bytes_from_local`, `bytes_from_store`, ...).
    pub restores: Vec<Value>,
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
            "bytes_from_local": self.bytes_from_local,
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
        let mut r = run::run_policy(opts, policy, &want)?;
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
pub(crate) fn train_command(opts: &Options, policy: Policy) -> Vec<String> {
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

pub(crate) fn ms(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}
