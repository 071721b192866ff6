//! Tiered checkpoints end to end (issue 28): `ckpt-train` with `--local-tier` over the real
//! S3-compatible server on loopback, real processes. Saves commit to the local tier and drain
//! to S3 behind the training; the faults: SIGKILL during a drain (the restarted job finishes
//! it, nothing dangles, both tiers verify), the remote down for seconds (saves go on locally,
//! the drain catches up), a share of remote requests failing, a chunk damaged on the local
//! tier (read from the remote, with an event), the machine lost with its tier while the
//! newest steps were local only (`ckpt resume` restarts from the newest remote step), and two
//! jobs on one run (the older one is fenced on both tiers). Every job ends with the digest
//! of an uninterrupted run.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ckpt_recovery::Topology;
use ckpt_recovery::records::{Event, read_records};
use ckpt_store::testing::{Need, S3Server};
use ckpt_tests::{
    bin, digest_in, env_of, final_digest, find_processes, reference_digest, signal,
    spawn_supervisor, supervised,
};

const PARAMS: &str = "200K";

/// A remote store on the S3 server and a local tier directory.
struct Tiers {
    server: S3Server,
    dir: tempfile::TempDir,
    url: String,
    prefix: String,
}

impl Tiers {
    fn new(prefix: &str) -> Option<Tiers> {
        if !ckpt_store::testing::available(Need::S3Server, prefix) {
            return None;
        }
        let server = S3Server::start();
        let url = format!("s3://{}/{prefix}", server.bucket);
        Some(Tiers {
            server,
            dir: tempfile::tempdir().unwrap(),
            url,
            prefix: prefix.to_string(),
        })
    }

    fn local(&self) -> PathBuf {
        self.dir.path().join("nvme")
    }

    fn remote(&self) -> ckpt_store::Store {
        self.server
            .store(&self.prefix, ckpt_store::StoreConfig::default())
    }

    /// `ckpt-train` of `run` for `steps` steps, a checkpoint every `every`, with the tier.
    fn train(&self, run: &str, steps: u64, every: u64, extra: &[&str]) -> Command {
        let mut c = self.train_remote_only(run, steps, every, extra);
        c.arg("--local-tier").arg(self.local());
        c
    }

    /// [`Tiers::train`] on the remote store alone.
    fn train_remote_only(&self, run: &str, steps: u64, every: u64, extra: &[&str]) -> Command {
        let mut c = Command::new(bin("ckpt-train", "ckpt-train"));
        c.args(["--store", &self.url, "--run", run, "--layout", "dp=2"])
            .args(["--params", PARAMS, "--seed", "5"])
            .args([
                "--steps",
                &steps.to_string(),
                "--ckpt-every",
                &every.to_string(),
            ])
            .args(extra)
            .envs(self.server.env())
            .env("CKPT_LOG", "warn")
            .env_remove("CKPT_FAULTS")
            .stdin(Stdio::null());
        c
    }

    /// `ckpt ARGS` on `store` (the remote URL or the local tier).
    fn ckpt(&self, store: &str, args: &[&str]) -> Output {
        Command::new(bin("ckpt", "ckpt"))
            .arg("--store")
            .arg(store)
            .args(args)
            .envs(self.server.env())
            .env_remove("CKPT_FAULTS")
            .output()
            .unwrap()
    }

    fn committed(&self, store: &ckpt_store::Store, run: &str) -> Vec<u64> {
        rt().block_on(store.log().committed_steps(run)).unwrap()
    }

    fn local_store(&self) -> ckpt_store::Store {
        ckpt_store::open(self.local().to_str().unwrap()).unwrap()
    }

    /// Both tiers verify clean, and no drain marker is left.
    fn verify_both(&self, run: &str) {
        for s in [self.url.clone(), self.local().display().to_string()] {
            let out = self.ckpt(&s, &["verify", run]);
            assert!(
                out.status.success(),
                "verify {s}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let pending = rt()
            .block_on(self.local_store().log().pending_drains(run))
            .unwrap();
        assert!(pending.is_empty(), "drain markers left: {pending:?}");
    }
}

impl Tiers {
    /// A job of 40 steps on `run`, SIGKILLed while a drain is under way (the remote is slow:
    /// every request takes 100 ms more): its newest local steps are not remote. The steps
    /// committed locally and remotely.
    fn kill_while_draining(&self, run: &str) -> (Vec<u64>, Vec<u64>) {
        let mut job = self
            .train(run, 40, 5, &["--step-time-ms", "40"])
            .env("CKPT_FAULTS", "rate=1,seed=1,mix=0:0:1,slow_ms=100")
            .spawn()
            .unwrap();
        let drains = self.local().join("runs").join(run).join("drain");
        wait_for("a drain under way", Duration::from_secs(60), || {
            std::fs::read_dir(&drains).is_ok_and(|d| d.count() > 0)
        });
        signal(job.id(), libc::SIGKILL);
        let _ = job.wait();
        let (l, r) = (
            self.committed(&self.local_store(), run),
            self.committed(&self.remote(), run),
        );
        assert!(
            l.last() > r.last(),
            "the newest local step is not remote yet: local {l:?}, remote {r:?}"
        );
        (l, r)
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Runtime::new().unwrap()
}

fn ok(out: &Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    text
}

fn events(store: &ckpt_store::Store, run: &str) -> Vec<Event> {
    rt().block_on(read_records::<Event>(store, run))
        .unwrap()
        .into_iter()
        .map(|l| l.record)
        .collect()
}

/// The newest restore record of `run`.
fn last_restore(store: &ckpt_store::Store, run: &str) -> ckpt_recovery::records::Restore {
    events(store, run)
        .into_iter()
        .filter_map(|e| match e {
            Event::Restore(r) => Some(r),
            _ => None,
        })
        .next_back()
        .expect("a restore")
}

fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < within, "waited {within:?} for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_job_killed_while_it_drains_is_finished_by_the_next_and_nothing_dangles() {
    let Some(t) = Tiers::new("killed") else {
        return;
    };
    let run = "k";
    let want = reference_digest(t.dir.path(), 40, PARAMS);
    let (l, r) = t.kill_while_draining(run);
    let remote = t.remote();
    // `ckpt ls --local-tier` says where each step is durable.
    let tier = t.local().display().to_string();
    let out = t.ckpt(&t.url, &["--json", "ls", "--local-tier", &tier, run]);
    ok(&out);
    let ls = String::from_utf8_lossy(&out.stdout).to_string();
    let v: serde_json::Value = serde_json::from_str(&ls).unwrap_or_else(|e| panic!("{e}: {ls}"));
    let rows = v["steps"].as_array().expect("steps");
    let row = |step: u64| {
        rows.iter()
            .find(|x| x["step"] == step)
            .unwrap_or_else(|| panic!("step {step} not listed: {ls}"))
    };
    let newest = row(*l.last().unwrap());
    assert_eq!(
        (&newest["tier"]["local"], &newest["tier"]["remote"]),
        (&serde_json::json!(true), &serde_json::json!(false)),
        "{ls}"
    );
    for s in &r {
        assert_eq!(row(*s)["tier"]["remote"], serde_json::json!(true), "{ls}");
    }
    let text = ok(&t.ckpt(&t.url, &["ls", "--local-tier", &tier, run]));
    assert!(
        (r.is_empty() || text.contains("remote"))
            && (text.contains(" local") || text.contains("draining")),
        "{text}"
    );
    // The next job resumes (from the local tier, the newest step) and drains what was left.
    let out = t.train(run, 40, 5, &["--resume"]).output().unwrap();
    let text = ok(&out);
    assert_eq!(digest_in(&text).as_deref(), Some(want.as_str()));
    assert!(t.committed(&remote, run).contains(&40));
    // Nothing dangles: what the killed drain sent and no step references is garbage that gc
    // collects, then both tiers verify clean.
    let gc = t.ckpt(
        &t.url,
        &["gc", "--grace", "0s", "--lease-lapse", "0s", "--force"],
    );
    ok(&gc);
    t.verify_both(run);
    let restore = last_restore(&remote, run);
    assert_eq!(restore.tier, "local", "{restore:?}");
}

#[test]
fn ckpt_drain_finishes_what_a_killed_job_left_local_only_and_says_why_it_cannot_while_the_store_is_down()
 {
    let Some(t) = Tiers::new("cli-drain") else {
        return;
    };
    let run = "d";
    let want = reference_digest(t.dir.path(), 40, PARAMS);
    let (l, r) = t.kill_while_draining(run);
    let newest = *l.last().unwrap();
    let older: Vec<u64> = l
        .iter()
        .copied()
        .filter(|&s| s < newest && r.last().is_none_or(|&x| s > x))
        .collect();
    let tier = t.local().display().to_string();
    let remote = t.remote();
    // The store down: the drain fails, says what and where, and the step stays local.
    let down = Command::new(bin("ckpt", "ckpt"))
        .args(["--store", &t.url, "drain", "--local-tier", &tier, run])
        .envs(t.server.env())
        .env("CKPT_FAULTS", "outage_s=0+600")
        .env(
            "CKPT_STORE_RETRY",
            "attempts=2,min_ms=10,max_ms=20,timeout_ms=500",
        )
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&down.stderr);
    assert_eq!(down.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("run {run}")) && err.contains("local tier"),
        "{err}"
    );
    assert_eq!(t.committed(&remote, run), r, "nothing committed while down");
    assert_eq!(
        t.committed(&t.local_store(), run),
        l,
        "the tier keeps its steps"
    );
    // The store back: the newest local step is drained and committed there; the older ones
    // it supersedes are named, and `--all` is not needed for the newest.
    let out = t.ckpt(&t.url, &["--json", "drain", "--local-tier", &tier, run]);
    let text = ok(&out);
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {text}"));
    let drained = v["drained"].as_array().expect("drained");
    assert_eq!(drained.len(), 1, "{text}");
    assert_eq!(drained[0]["step"], newest, "{text}");
    assert!(
        drained[0]["manifests"] == 2 || drained[0]["already_remote"] == true,
        "{text}"
    );
    if older.is_empty() {
        assert_eq!(v["superseded"], serde_json::json!([]), "{text}");
    } else {
        assert_eq!(
            v["superseded"][0]["steps"],
            serde_json::json!(older),
            "{text}"
        );
        assert_eq!(v["superseded"][0]["by"], newest, "{text}");
    }
    assert_eq!(t.committed(&remote, run).last(), Some(&newest));
    // Again: nothing to do.
    let again = ok(&t.ckpt(&t.url, &["drain", "--local-tier", &tier, run]));
    assert!(again.contains("nothing to drain"), "{again}");
    t.verify_both(run);
    // The drained step restores from the store alone, bit-exact: a job without the tier
    // resumes from it and ends with the digest of an uninterrupted run.
    let out = t
        .train_remote_only(run, 40, 5, &["--resume"])
        .output()
        .unwrap();
    assert_eq!(digest_in(&ok(&out)).as_deref(), Some(want.as_str()));
    let restore = last_restore(&remote, run);
    assert_eq!(
        (restore.step, restore.bytes_from_local),
        (newest, 0),
        "{restore:?}"
    );
}

#[test]
fn the_remote_down_for_seconds_saves_go_on_locally_and_the_drain_catches_up() {
    let Some(t) = Tiers::new("outage") else {
        return;
    };
    let run = "o";
    let want = reference_digest(t.dir.path(), 60, PARAMS);
    let t0 = Instant::now();
    let out = t
        .train(run, 60, 3, &["--step-time-ms", "60"])
        .env("CKPT_FAULTS", "outage_s=1+3")
        .env(
            "CKPT_STORE_RETRY",
            "attempts=2,min_ms=10,max_ms=20,timeout_ms=500",
        )
        .output()
        .unwrap();
    let text = ok(&out);
    assert_eq!(digest_in(&text).as_deref(), Some(want.as_str()));
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "{:?}",
        t0.elapsed()
    );
    let remote = t.remote();
    assert!(t.committed(&remote, run).contains(&60), "caught up");
    assert!(
        events(&remote, run)
            .iter()
            .any(|e| matches!(e, Event::DrainFailed(_))),
        "no drain_failed event"
    );
    t.verify_both(run);
}

#[test]
fn a_share_of_remote_requests_failing_costs_retries_not_checkpoints() {
    let Some(t) = Tiers::new("flaky") else { return };
    let run = "f";
    let want = reference_digest(t.dir.path(), 30, PARAMS);
    let out = t
        .train(run, 30, 5, &[])
        .env("CKPT_FAULTS", "rate=0.05,seed=11,mix=1:0:0")
        .output()
        .unwrap();
    let text = ok(&out);
    assert_eq!(digest_in(&text).as_deref(), Some(want.as_str()));
    let remote = t.remote();
    assert!(t.committed(&remote, run).contains(&30));
    t.verify_both(run);
}

#[test]
fn a_chunk_damaged_on_the_local_tier_is_read_from_the_remote_with_an_event() {
    let Some(t) = Tiers::new("damaged") else {
        return;
    };
    let run = "d";
    let want = reference_digest(t.dir.path(), 15, PARAMS);
    ok(&t.train(run, 10, 5, &[]).output().unwrap());
    let local = t.local_store();
    assert_eq!(t.committed(&local, run).last(), Some(&10));
    // Flip a byte of a chunk step 10 holds (in its own object, or its part of a pack).
    let refs = rt().block_on(local.log().step_chunk_refs(run, 10)).unwrap();
    let c = refs.iter().max_by_key(|c| c.len).expect("a chunk");
    let file = t.local().join(local.keys().object_of(c).as_ref());
    let mut b = std::fs::read(&file).unwrap();
    let at = (c.offset + u64::from(c.stored)) as usize - 7;
    b[at] ^= 0x21;
    std::fs::write(&file, b).unwrap();
    let text = ok(&t.train(run, 15, 5, &["--resume"]).output().unwrap());
    assert_eq!(digest_in(&text).as_deref(), Some(want.as_str()));
    let damaged: Vec<_> = events(&t.remote(), run)
        .into_iter()
        .filter_map(|e| match e {
            Event::LocalTierDamaged(d) => Some(d),
            _ => None,
        })
        .collect();
    assert!(!damaged.is_empty(), "no local_tier_damaged event");
    assert_eq!(damaged[0].step, 10);
}

#[test]
fn the_machine_lost_with_its_tier_restarts_from_the_newest_remote_step_bit_exact() {
    let Some(t) = Tiers::new("lost") else { return };
    let run = "l";
    let want = reference_digest(t.dir.path(), 60, PARAMS);
    // A remote slow enough that the newest steps are local only when the machine goes.
    let cmd: Vec<String> = vec![
        bin("ckpt-train", "ckpt-train").display().to_string(),
        "--params".into(),
        PARAMS.into(),
        "--seed".into(),
        "5".into(),
        "--steps".into(),
        "60".into(),
        "--ckpt-every".into(),
        "2".into(),
        "--step-time-ms".into(),
        "40".into(),
    ];
    let topo = Topology {
        nodes: 2,
        ranks_per_node: 1,
        spares: 1,
    };
    let mut opts = supervised(
        &t.dir.path().join("unused"),
        run,
        topo,
        "dp=2",
        cmd,
        t.dir.path().join("logs"),
    );
    opts.job.store_url = t.url.clone();
    opts.job.local_tier = Some(t.local().display().to_string());
    // The supervisor and the ranks reach the S3 server through its variables.
    for (k, v) in t.server.env() {
        // SAFETY: set before the supervisor thread starts; the test's other threads do
        // not read the environment.
        unsafe { std::env::set_var(k, v) };
    }
    // SAFETY: as above.
    unsafe { std::env::set_var("CKPT_FAULTS", "rate=1,seed=1,mix=0:0:1,slow_ms=60") };
    let sup = spawn_supervisor(opts);
    let local = t.local_store();
    let remote = t.remote();
    wait_for(
        "a local step newer than the remote's",
        Duration::from_secs(90),
        || {
            let l = rt()
                .block_on(local.log().committed_steps(run))
                .unwrap_or_default();
            let r = rt()
                .block_on(remote.log().committed_steps(run))
                .unwrap_or_default();
            !r.is_empty() && l.last() > r.last()
        },
    );
    // The machine goes: every rank frozen, the tier deleted, node 1's rank killed.
    let ranks: Vec<(u32, u32)> = find_processes(&[("CKPT_RUN", run)])
        .into_iter()
        .filter_map(|(pid, env)| Some((pid, env_of(&env, "CKPT_NODE")?.parse().ok()?)))
        .collect();
    for (pid, _) in &ranks {
        signal(*pid, libc::SIGSTOP);
    }
    let newest_remote = t.committed(&remote, run).last().copied();
    std::fs::remove_dir_all(t.local()).unwrap();
    for (pid, node) in &ranks {
        signal(
            *pid,
            if *node == 1 {
                libc::SIGKILL
            } else {
                libc::SIGCONT
            },
        );
    }
    let report = sup.join().unwrap();
    // SAFETY: the supervisor is done.
    unsafe { std::env::remove_var("CKPT_FAULTS") };
    if !report.ok {
        for e in std::fs::read_dir(t.dir.path().join("logs"))
            .unwrap()
            .flatten()
        {
            eprintln!("== {}", e.path().display());
            eprintln!("{}", std::fs::read_to_string(e.path()).unwrap_or_default());
        }
    }
    assert!(report.ok, "{}: {:#?}", report.reason, report.records);
    let recovery = report
        .records
        .iter()
        .find(|r| r["kind"] == "recovery")
        .expect("a recovery");
    let from = recovery["step"].as_u64().expect("restarted from a step");
    assert!(
        Some(from) <= newest_remote,
        "restarted from {from} though the newest remote step was {newest_remote:?}"
    );
    assert_eq!(final_digest(&t.dir.path().join("logs")).unwrap(), want);
}

#[test]
fn a_second_job_on_the_run_fences_the_first_on_both_tiers() {
    let Some(t) = Tiers::new("two") else { return };
    let run = "two";
    let want = reference_digest(t.dir.path(), 60, PARAMS);
    let first = t
        .train(run, 400, 2, &["--step-time-ms", "200"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let local = t.local_store();
    wait_for(
        "the first job's checkpoints",
        Duration::from_secs(60),
        || {
            rt().block_on(local.log().committed_steps(run))
                .is_ok_and(|s| s.len() >= 2)
        },
    );
    // The second job resumes the same run on the same tiers and trains to step 60.
    let second = t.train(run, 60, 2, &["--resume"]).output().unwrap();
    let text = ok(&second);
    assert_eq!(digest_in(&text).as_deref(), Some(want.as_str()));
    let out = first.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the first job went on: {err}");
    assert!(
        err.to_lowercase().contains("fenced") || err.contains("generation"),
        "{err}"
    );
    // The newest step of each tier is the second job's.
    for s in [&local, &t.remote()] {
        let newest = t.committed(s, run).last().copied().unwrap();
        assert_eq!(newest, 60, "{}", s.url());
    }
}
