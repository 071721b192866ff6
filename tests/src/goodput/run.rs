//! One policy's run: `ckpt resume` started, watched (failures injected on schedule, committed
//! steps and memory sampled, the operator's GC beside it), and its outcome collected.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckpt_store::VerifyScope;
use serde_json::Value;

use super::failures::{Schedule, inject, match_injections, of_kind};
use super::housekeeping::Housekeeping;
use super::procs::{RankProc, agents, ranks, rss_kib, tagged};
use super::{Injection, Options, Policy, PolicyResult, RUN, RssSample, TAG_ENV, ms, train_command};
use crate::final_digest;
use crate::{bin, signal};

/// Run `policy` (see the module docs of [`super`]) and collect its [`PolicyResult`].
pub(super) fn run_policy(
    opts: &Options,
    policy: Policy,
    want: &str,
) -> Result<PolicyResult, String> {
    let dir = opts.dir.join(policy.name());
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let store = dir.join("store");
    let tag = format!("goodput-{}-{}", std::process::id(), policy.name());
    let mut cmd = resume_command(opts, policy, &dir, &tag)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("a runtime: {e}"))?;
    let st = ckpt_store::open(&store.display().to_string()).map_err(|e| e.to_string())?;
    // The disk a damaged-disk failure damages: the local tier where the job has one.
    let disk = match policy.local_tier() {
        true => {
            ckpt_store::open(&dir.join("tier").display().to_string()).map_err(|e| e.to_string())?
        }
        false => st.clone(),
    };
    let t0 = Instant::now();
    let mut child: Child = cmd
        .spawn()
        .map_err(|e| format!("starting ckpt resume: {e}"))?;
    let mut watch = Watch::new(opts, policy, &tag, child.id(), t0);
    let mut gc = Housekeeping::new(opts, &store, &dir);
    let mut timed_out = false;
    loop {
        gc.poll();
        if child.try_wait().map_err(|e| e.to_string())?.is_some() {
            break;
        }
        if t0.elapsed() > opts.timeout {
            signal(watch.sup, libc::SIGKILL);
            let _ = child.wait();
            timed_out = true;
            break;
        }
        watch.poll(&rt, &st, &disk);
        std::thread::sleep(Duration::from_millis(50));
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let gc_runs = gc.finish();
    let leftover = kill_leftovers(&tag);
    let ran = Ran {
        policy,
        dir,
        wall_s,
        timed_out,
        leftover,
        gc_runs,
    };
    let tiers: Vec<&ckpt_store::Store> = match policy.local_tier() {
        true => vec![&st, &disk],
        false => vec![&st],
    };
    outcome(opts, want, &rt, &tiers, watch, ran)
}

/// `ckpt resume` of the policy's job, its report to `resume.json`, its errors to `resume.err`.
fn resume_command(
    opts: &Options,
    policy: Policy,
    dir: &Path,
    tag: &str,
) -> Result<Command, String> {
    let file = |name: &str| {
        std::fs::File::create(dir.join(name)).map_err(|e| format!("creating {name}: {e}"))
    };
    let mut cmd = Command::new(bin("ckpt", "ckpt"));
    cmd.arg("--store")
        .arg(dir.join("store"))
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
    if policy.local_tier() {
        cmd.arg("--local-tier").arg(dir.join("tier"));
    }
    cmd.arg("--logs")
        .arg(dir.join("logs"))
        .arg("--")
        .args(train_command(opts, policy))
        .env(TAG_ENV, tag)
        .stdin(Stdio::null())
        .stdout(file("resume.json")?)
        .stderr(file("resume.err")?);
    Ok(cmd)
}

/// What the soak sees of a running supervision: the steps seen committed, memory, and the
/// failures it injected on schedule.
struct Watch {
    policy: Policy,
    tag: String,
    /// The supervisor's pid.
    sup: u32,
    t0: Instant,
    mtbf: Duration,
    max_gap: Option<Duration>,
    schedule: Schedule,
    next: Option<Duration>,
    injections: Vec<Injection>,
    seen: BTreeSet<u64>,
    last_poll: Instant,
    first_rank: Option<Instant>,
    rss_first: Option<RssSample>,
    rss_last: Option<RssSample>,
    /// The highest supervisor figure and the highest single agent's (in `agents_kib`).
    rss_peak: RssSample,
    last_rss: Instant,
}

impl Watch {
    fn new(opts: &Options, policy: Policy, tag: &str, sup: u32, t0: Instant) -> Watch {
        let mut schedule = Schedule::new(opts.seed);
        let next = policy
            .failures()
            .then(|| schedule.gap(opts.mtbf, opts.max_gap));
        Watch {
            policy,
            tag: tag.to_string(),
            sup,
            t0,
            mtbf: opts.mtbf,
            max_gap: opts.max_gap,
            schedule,
            next,
            injections: Vec::new(),
            seen: BTreeSet::new(),
            last_poll: Instant::now(),
            first_rank: None,
            rss_first: None,
            rss_last: None,
            rss_peak: RssSample::default(),
            last_rss: Instant::now(),
        }
    }

    /// One look: the committed steps (every 500 ms; the store's: remote-durable under a local
    /// tier), memory (every second), a failure when due (a damaged disk is `disk`).
    fn poll(
        &mut self,
        rt: &tokio::runtime::Runtime,
        st: &ckpt_store::Store,
        disk: &ckpt_store::Store,
    ) {
        if self.last_poll.elapsed() >= Duration::from_millis(500) {
            self.last_poll = Instant::now();
            if let Ok(s) = rt.block_on(st.log().committed_steps(RUN)) {
                self.seen.extend(s);
            }
        }
        // Memory: once a second, from the first committed step on (before it the agents
        // hold no snapshot yet, so a start sample would show their growth to steady state).
        if !self.seen.is_empty() && self.last_rss.elapsed() >= Duration::from_secs(1) {
            self.last_rss = Instant::now();
            self.sample_rss();
        }
        let due = self.next.is_some_and(|n| self.t0.elapsed() >= n);
        if self.first_rank.is_none() || due {
            let live = ranks(&self.tag);
            if self.first_rank.is_none() && !live.is_empty() {
                self.first_rank = Some(Instant::now());
            }
            if due {
                self.inject_due(rt, disk, live);
            }
        }
    }

    fn sample_rss(&mut self) {
        let a = agents(&self.tag);
        let each: Vec<u64> = a.iter().map(|(p, _)| rss_kib(*p)).collect();
        let s = RssSample {
            at_s: self.t0.elapsed().as_secs_f64(),
            supervisor_kib: rss_kib(self.sup),
            agents_kib: each.iter().sum(),
            agents: a.len(),
        };
        if s.supervisor_kib > 0 {
            self.rss_first.get_or_insert(s);
            self.rss_last = Some(s);
            self.rss_peak.supervisor_kib = self.rss_peak.supervisor_kib.max(s.supervisor_kib);
            self.rss_peak.agents_kib = self
                .rss_peak
                .agents_kib
                .max(each.iter().copied().max().unwrap_or(0));
        }
    }

    /// Inject the scheduled failure into the newest generation, one per generation (a
    /// damaged disk damages `disk`).
    fn inject_due(
        &mut self,
        rt: &tokio::runtime::Runtime,
        disk: &ckpt_store::Store,
        live: Vec<RankProc>,
    ) {
        let newest = live.iter().map(|r| r.generation).max();
        let Some(g) = newest else { return };
        if self.injections.last().is_some_and(|i| i.generation >= g) {
            return;
        }
        let gen_live: Vec<RankProc> = live.into_iter().filter(|r| r.generation == g).collect();
        let kind = self.schedule.kind();
        let at_s = self.t0.elapsed().as_secs_f64();
        let inj = inject(
            rt,
            disk,
            &self.tag,
            kind,
            &gen_live,
            &mut self.schedule.rng,
            at_s,
        );
        eprintln!(
            "goodput {}: {:.1} s: {} on node {} (generation {}){}",
            self.policy.name(),
            at_s,
            kind.name(),
            inj.node,
            inj.generation,
            inj.damaged_step
                .map_or(String::new(), |s| format!(", step {s} damaged"))
        );
        self.injections.push(inj);
        self.next = Some(self.t0.elapsed() + self.schedule.gap(self.mtbf, self.max_gap));
    }
}

/// Nothing of a supervision may outlive it (a few seconds to die): what does is killed and
/// returned.
fn kill_leftovers(tag: &str) -> Vec<u32> {
    let t1 = Instant::now();
    let mut leftover = tagged(tag);
    while !leftover.is_empty() && t1.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(100));
        leftover = tagged(tag);
    }
    let leftover: Vec<u32> = leftover.into_iter().map(|(p, _)| p).collect();
    for p in &leftover {
        signal(*p, libc::SIGKILL);
    }
    leftover
}

/// How a policy's `ckpt resume` ended.
struct Ran {
    policy: Policy,
    dir: std::path::PathBuf,
    wall_s: f64,
    timed_out: bool,
    leftover: Vec<u32>,
    gc_runs: (u32, u32),
}

/// The report, the recovery log and the store after the run, made into the policy's result.
/// `tiers`: the store, then the local tier if the job has one (both must verify clean).
fn outcome(
    opts: &Options,
    want: &str,
    rt: &tokio::runtime::Runtime,
    tiers: &[&ckpt_store::Store],
    watch: Watch,
    ran: Ran,
) -> Result<PolicyResult, String> {
    let st = tiers[0];
    let Watch {
        mut injections,
        seen,
        rss_first,
        rss_last,
        rss_peak,
        ..
    } = watch;
    let text = std::fs::read_to_string(ran.dir.join("resume.json")).unwrap_or_default();
    let report: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let mut records: Vec<Value> = match report["records"].as_array() {
        Some(r) => r.clone(),
        None => rt
            .block_on(ckpt_store::logs::read_log(
                st,
                RUN,
                ckpt_store::logs::EVENTS,
            ))
            .unwrap_or_default(),
    };
    // With a local tier, the ranks' word that a restore read a chunk damaged there from the
    // remote store: how damage on the local disk is detected when the remote holds the step.
    if tiers.len() > 1 && report["records"].is_array() {
        for t in tiers {
            let events = rt
                .block_on(ckpt_store::logs::read_log(t, RUN, ckpt_store::logs::EVENTS))
                .unwrap_or_default();
            records.extend(
                events
                    .into_iter()
                    .filter(|e| e["kind"] == "local_tier_damaged"),
            );
        }
    }
    let ok = report["ok"].as_bool() == Some(true) && !ran.timed_out;
    let reason = if ran.timed_out {
        format!("timed out after {} s", opts.timeout.as_secs())
    } else {
        report["reason"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| "ckpt resume printed no report (see resume.err)".into())
    };
    let digest = final_digest(&ran.dir.join("logs"));
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
    let committed_lost = committed_lost(opts, rt, st, &seen, &injections, &unusable)?;
    let verify_clean = tiers.iter().all(|t| {
        rt.block_on(t.verify(&VerifyScope::Run(RUN.into()), None))
            .is_ok_and(|v| v.is_clean())
    });
    let plot = plot(opts, &ran.dir);
    Ok(PolicyResult {
        policy: ran.policy,
        steps: opts.steps,
        ok,
        reason,
        wall_s: ran.wall_s,
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
        bytes_from_local: sum("bytes_from_local"),
        restores,
        committed_lost,
        unusable,
        verify_clean,
        leftover: ran.leftover,
        rss: rss_first.zip(rss_last).map(|(a, b)| (a, b, rss_peak)),
        plot,
        dir: ran.dir,
        gc_runs: ran.gc_runs,
    })
}

/// Steps seen committed during the run that are gone at the end for no good reason.
fn committed_lost(
    opts: &Options,
    rt: &tokio::runtime::Runtime,
    st: &ckpt_store::Store,
    seen: &BTreeSet<u64>,
    injections: &[Injection],
    unusable: &[u64],
) -> Result<Vec<u64>, String> {
    let damaged: BTreeSet<u64> = injections.iter().filter_map(|i| i.damaged_step).collect();
    let now: BTreeSet<u64> = rt
        .block_on(st.log().committed_steps(RUN))
        .map_err(|e| format!("listing the committed steps: {e}"))?
        .into_iter()
        .collect();
    let retired: BTreeSet<u64> = damaged
        .iter()
        .filter(|s| unusable.contains(s))
        .copied()
        .collect();
    Ok(lost_steps(seen, &now, &retired, opts.keep_last))
}

/// The steps of `seen` gone from `now` for no good reason: not damaged by an injection and
/// retired by recovery (`retired`), and not older than the steps retention keeps. Retention
/// may delete a step only when at least `keep_last` newer ones are committed at the end (a step
/// gone below that line is lost, whatever deleted it); a newer step damaged and retired after
/// retention ran counts among them, since retention kept it then.
pub(super) fn lost_steps(
    seen: &BTreeSet<u64>,
    now: &BTreeSet<u64>,
    retired: &BTreeSet<u64>,
    keep_last: Option<usize>,
) -> Vec<u64> {
    let kept: BTreeSet<u64> = now.union(retired).copied().collect();
    let line = keep_last.and_then(|k| kept.iter().rev().nth(k.saturating_sub(1)).copied());
    seen.iter()
        .filter(|s| !(now.contains(s) || retired.contains(s) || line.is_some_and(|l| **s < l)))
        .copied()
        .collect()
}

/// The run's plot (`ckpt plot`), when asked for and drawn.
fn plot(opts: &Options, dir: &Path) -> Option<std::path::PathBuf> {
    opts.plot.then(|| dir.join("plot.png")).filter(|p| {
        Command::new(bin("ckpt", "ckpt"))
            .arg("--store")
            .arg(dir.join("store"))
            .args(["plot", RUN, "--out"])
            .arg(p)
            .env("CKPT_LOG", "warn")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}
