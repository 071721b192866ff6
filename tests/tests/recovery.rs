//! Recovery with real processes: `ckpt-train` under the local supervisor, ranks killed with
//! SIGKILL at random moments (during steps, saves and restores), stopped with SIGSTOP, and
//! too few survivors; the job finishes bit-identical to an uninterrupted run or stops with a
//! reason.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ckpt_recovery::Topology;
use ckpt_tests::{
    agent_held, bin, digest_in, env_of, final_digest, find_processes, logging_agent_command,
    reference_digest, signal, spawn_supervisor, supervised,
};

const PARAMS: &str = "40K";

fn train_cmd(steps: u64, every: u64, step_ms: u64) -> Vec<String> {
    let b = bin("ckpt-train", "ckpt-train");
    vec![
        b.to_string_lossy().to_string(),
        "--steps".into(),
        steps.to_string(),
        "--ckpt-every".into(),
        every.to_string(),
        "--params".into(),
        PARAMS.into(),
        "--seed".into(),
        "5".into(),
        "--step-time-ms".into(),
        step_ms.to_string(),
    ]
}

/// [`train_cmd`] with the automatic interval (2 to 40 steps, a 10-hour MTBF before any failure
/// is logged).
fn auto_train_cmd(steps: u64, step_ms: u64) -> Vec<String> {
    let mut cmd = train_cmd(steps, 1, step_ms);
    let at = cmd.iter().position(|a| a == "--ckpt-every").unwrap();
    cmd[at + 1] = "auto".into();
    cmd.extend(
        [
            "--ckpt-every-min",
            "2",
            "--ckpt-every-max",
            "40",
            "--mtbf-prior",
            "36000",
        ]
        .map(String::from),
    );
    cmd
}

/// Live rank processes of `run`: (pid, rank, generation).
fn ranks_of(run: &str) -> Vec<(u32, u32, u64)> {
    find_processes(&[("CKPT_RUN", run)])
        .into_iter()
        .filter_map(|(pid, env)| {
            let r = env_of(&env, "CKPT_RANK")?.parse().ok()?;
            let g = env_of(&env, "CKPT_GENERATION")?.parse().ok()?;
            // Zombies keep their environment; skip processes that are gone.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            if stat.split_whitespace().nth(2) == Some("Z") {
                return None;
            }
            Some((pid, r, g))
        })
        .collect()
}

/// A tiny deterministic RNG so a failing schedule can be replayed from its seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}

#[test]
#[allow(
    clippy::disallowed_methods,
    reason = "a test reads its knobs and tools from the environment"
)]
fn random_sigkills_during_steps_saves_and_restores() {
    let seed: u64 = std::env::var("CKPT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::from(ckpt_store::clock::system_now())
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("random schedule seed {seed} (replay with CKPT_TEST_SEED={seed})");
    let mut rng = Rng(seed);
    let mut dir = tempfile::tempdir().unwrap();
    if std::env::var_os("CKPT_TEST_KEEP").is_some() {
        eprintln!("keeping {}", dir.path().display());
        dir.disable_cleanup(true);
    }
    let steps = 30;
    let want = reference_digest(dir.path(), steps, PARAMS);
    let store = dir.path().join("store");
    let run = format!("chaos{}", seed % 100_000);
    // 4 nodes x 2 ranks; the job uses 2 of them (dp=2,tp=2), so failed nodes are replaced
    // until only one node is left, which still holds dp=1,tp=2.
    let topo = Topology {
        nodes: 4,
        ranks_per_node: 2,
        spares: 0,
    };
    let cmd = train_cmd(steps, 4, 60);
    let opts = supervised(
        &store,
        &run,
        topo,
        "dp=2,tp=2",
        cmd,
        dir.path().join("logs"),
    );
    // Saves take a while (a failpoint sleeps after the chunks), so kills land inside them.
    // SAFETY: set before any thread of this test reads the environment.
    unsafe { std::env::set_var("CKPT_FAILPOINTS", "after_chunks=sleep(150)") };
    let sup = spawn_supervisor(opts);
    let mut kills = Vec::new();
    let mut last_gen = u64::MAX;
    let t0 = Instant::now();
    // Three kills: one a short random time into a generation (restoring or early steps), one
    // later (steps and saves), one right when a generation starts (restore).
    let plan = [rng.range(300, 900), rng.range(900, 2500), rng.range(0, 150)];
    for delay in plan {
        // Wait for a new generation's ranks to appear.
        let (g, started) = loop {
            let live = ranks_of(&run);
            if let Some(g) = live.iter().map(|x| x.2).max()
                && (last_gen == u64::MAX || g > last_gen)
                && live.iter().filter(|x| x.2 == g).count() == 4
            {
                break (g, Instant::now());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(240),
                "no new generation appeared; kills so far {kills:?}"
            );
            if sup.is_finished() {
                break (u64::MAX, Instant::now());
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        if g == u64::MAX {
            break;
        }
        last_gen = g;
        std::thread::sleep(Duration::from_millis(delay).saturating_sub(started.elapsed()));
        let live: Vec<_> = ranks_of(&run).into_iter().filter(|x| x.2 == g).collect();
        if live.is_empty() {
            break;
        }
        let (pid, rank, _) = live[rng.range(0, live.len() as u64) as usize];
        signal(pid, libc::SIGKILL);
        kills.push((g, rank, delay));
    }
    let report = sup.join().unwrap();
    // SAFETY: the supervisor's thread is joined; no other thread of this test reads the
    // environment (the ranks are child processes).
    unsafe { std::env::remove_var("CKPT_FAILPOINTS") };
    eprintln!("kills {kills:?}; report {:#?}", report.records);
    assert!(
        report.ok,
        "the job did not finish: {} (seed {seed})",
        report.reason
    );
    assert!(
        report.restarts as usize >= kills.len().min(3),
        "restarts {} for kills {kills:?}",
        report.restarts
    );
    let failures = report
        .records
        .iter()
        .filter(|r| r["kind"] == "failure")
        .count();
    assert!(
        failures >= kills.len(),
        "{failures} failures logged for {} kills",
        kills.len()
    );
    let got = final_digest(&dir.path().join("logs")).expect("rank 0 printed a digest");
    assert_eq!(
        got, want,
        "seed {seed}: the recovered job's final state differs from an uninterrupted run"
    );
    // The recovery log is in the store, with detection, decision and plan (a restart from
    // scratch, when a kill landed before the first commit, has no step and no plan).
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let log = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(ckpt_store::logs::read_log(
            &st,
            &run,
            ckpt_store::logs::EVENTS,
        ))
        .unwrap();
    let decisions: Vec<&serde_json::Value> =
        log.iter().filter(|r| r["kind"] == "recovery").collect();
    assert!(decisions.len() >= kills.len().min(1), "{log:#?}");
    for d in &decisions {
        assert!(
            d["step"].is_null() || d["plan"].is_array(),
            "a restart from step {} without a restore plan: {d}",
            d["step"]
        );
    }
    assert_eq!(
        log.iter().filter(|r| r["kind"] == "failure").count(),
        failures,
        "the store's log and the supervisor's report differ: {log:#?}"
    );
}

#[test]
fn a_hang_is_detected_within_the_timeout_plus_one_heartbeat() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 14;
    let want = reference_digest(dir.path(), steps, PARAMS);
    let store = dir.path().join("store");
    let run = "hang";
    let topo = Topology {
        nodes: 3,
        ranks_per_node: 1,
        spares: 1,
    };
    let cmd = train_cmd(steps, 3, 100);
    let opts = supervised(&store, run, topo, "dp=3", cmd, dir.path().join("logs"));
    let timeout = opts.job.config.heartbeat_timeout;
    let interval = opts.job.heartbeat_interval;
    let sup_start = Instant::now();
    let sup = spawn_supervisor(opts);
    let t0 = Instant::now();
    let victim = loop {
        let live = ranks_of(run);
        if live.len() == 3 {
            std::thread::sleep(Duration::from_millis(800));
            break live[1].0;
        }
        assert!(t0.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(10));
    };
    signal(victim, libc::SIGSTOP);
    let stopped_at = sup_start.elapsed();
    let report = sup.join().unwrap();
    assert!(report.ok, "{}", report.reason);
    let f = report
        .records
        .iter()
        .find(|r| r["kind"] == "failure")
        .expect("a failure record");
    assert_eq!(f["how"], "heartbeat", "{f}");
    let detection = f["detection_s"].as_f64().unwrap();
    assert!(
        detection >= timeout.as_secs_f64(),
        "failed after only {detection} s without beats"
    );
    // From the SIGSTOP to the detection: the timeout, plus at most one heartbeat interval
    // (the last beat may have come just before the stop), plus a 50 ms tick and scheduling
    // slack on a loaded 2-core machine.
    let latency = Duration::from_millis(f["at_ms"].as_u64().unwrap()).saturating_sub(stopped_at);
    let limit = timeout + interval + Duration::from_millis(500);
    assert!(
        latency <= limit,
        "detected {latency:?} after the SIGSTOP, limit {limit:?}"
    );
    // The spare replaced the stopped node: the layout is unchanged.
    assert_eq!(report.layout, "dp=3,tp=1,pp=1");
    assert_eq!(final_digest(&dir.path().join("logs")).unwrap(), want);
}

/// A run committed at step 4 (of 8, dp=2) to resume on two nodes and a spare: the digest the
/// job must end with, the store, the topology.
fn two_nodes_and_a_spare_resuming(dir: &Path, run: &str) -> (String, PathBuf, Topology) {
    let want = reference_digest(dir, 8, PARAMS);
    let store = dir.join("store");
    committed_run(&store, run, 4, 4);
    let topo = Topology {
        nodes: 2,
        ranks_per_node: 1,
        spares: 1,
    };
    (want, store, topo)
}

#[test]
fn a_rank_stopped_while_it_restores_is_found_by_its_missed_beats() {
    let dir = tempfile::tempdir().unwrap();
    let run = "restoring";
    let (want, store, topo) = two_nodes_and_a_spare_resuming(dir.path(), run);
    // Every rank waits 6 s before it reads anything of the step it resumes: long enough to
    // stop one in its restore. The start-up timeout is 60 s.
    let mut cmd = train_cmd(8, 4, 20);
    cmd.extend(["--failpoints".into(), "before_restore=sleep(6000)".into()]);
    let opts = supervised(&store, run, topo, "dp=2", cmd, dir.path().join("logs"));
    let timeout = opts.job.config.heartbeat_timeout;
    let interval = opts.job.heartbeat_interval;
    let sup_start = Instant::now();
    let sup = spawn_supervisor(opts);
    let t0 = Instant::now();
    let victim = loop {
        let live = ranks_of(run);
        if live.len() == 2 {
            // Started, connected and in the restore's wait.
            std::thread::sleep(Duration::from_millis(1500));
            break live.iter().find(|r| r.1 == 1).unwrap().0;
        }
        assert!(t0.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(10));
    };
    signal(victim, libc::SIGSTOP);
    let stopped_at = sup_start.elapsed();
    let report = sup.join().unwrap();
    assert!(report.ok, "{}", report.reason);
    let f = report
        .records
        .iter()
        .find(|r| r["kind"] == "failure")
        .expect("a failure record");
    assert_eq!(
        (f["rank"].as_u64(), f["how"].as_str()),
        (Some(1), Some("heartbeat")),
        "{f}"
    );
    assert!(
        f["detail"].as_str().unwrap().contains("while starting"),
        "{f}"
    );
    // Found by its missed beats: the timeout plus one interval and slack after the stop, not
    // the start-up timeout (nor the end of its restore's wait).
    let latency = Duration::from_millis(f["at_ms"].as_u64().unwrap()).saturating_sub(stopped_at);
    let limit = timeout + interval + Duration::from_millis(500);
    assert!(
        latency <= limit,
        "detected {latency:?} after the SIGSTOP, limit {limit:?}"
    );
    // The job resumed step 4 again on the spare and finished bit-identical.
    assert_eq!(final_digest(&dir.path().join("logs")).unwrap(), want);
}

#[test]
fn a_rank_stopped_before_its_first_beat_is_found_within_the_heartbeat_timeout() {
    // The goodput soak's SIGSTOP once landed between a rank's start and its first beat: with
    // no beat to miss, the job waited for the start-up timeout. Rank 1 of the first
    // generation stops itself before it execs `ckpt-train` (a marker directory says it did).
    let dir = tempfile::tempdir().unwrap();
    let run = "stopped-early";
    let (want, store, topo) = two_nodes_and_a_spare_resuming(dir.path(), run);
    let mark = dir.path().join("stopped-once");
    let mut cmd: Vec<String> = vec![
        "sh".into(),
        "-c".into(),
        format!(
            "if [ \"$CKPT_RANK\" = 1 ] && mkdir '{}' 2>/dev/null; then kill -STOP $$; fi; exec \"$@\"",
            mark.display()
        ),
        "sh".into(),
    ];
    cmd.extend(train_cmd(8, 4, 20));
    let opts = supervised(&store, run, topo, "dp=2", cmd, dir.path().join("logs"));
    let timeout = opts.job.config.heartbeat_timeout;
    let startup = opts.job.config.startup_timeout;
    let report = spawn_supervisor(opts).join().unwrap();
    assert!(report.ok, "{}", report.reason);
    assert!(mark.exists(), "rank 1 never stopped itself");
    let started = report
        .records
        .iter()
        .find(|r| r["kind"] == "started")
        .expect("a started record");
    let f = report
        .records
        .iter()
        .find(|r| r["kind"] == "failure")
        .expect("a failure record");
    assert_eq!(
        (f["rank"].as_u64(), f["how"].as_str()),
        (Some(1), Some("heartbeat")),
        "{f}"
    );
    let detail = f["detail"].as_str().unwrap();
    assert!(
        detail.contains("stopped") && detail.contains("before its first heartbeat"),
        "{f}"
    );
    // Found within the heartbeat timeout of the start (plus the time to start a process and
    // slack), far from the start-up timeout.
    let after =
        Duration::from_millis(f["at_ms"].as_u64().unwrap() - started["at_ms"].as_u64().unwrap());
    let limit = timeout + Duration::from_millis(2_500);
    assert!(
        after <= limit && limit < startup,
        "detected {after:?} after the generation started, limit {limit:?}"
    );
    // The job resumed step 4 again on the spare and finished bit-identical.
    assert_eq!(final_digest(&dir.path().join("logs")).unwrap(), want);
}

#[test]
fn too_few_survivors_for_tp_x_pp_stop_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let run = "few";
    let topo = Topology {
        nodes: 2,
        ranks_per_node: 1,
        spares: 0,
    };
    let cmd = train_cmd(200, 5, 50);
    let opts = supervised(
        &dir.path().join("store"),
        run,
        topo,
        "tp=2",
        cmd,
        dir.path().join("logs"),
    );
    let sup = spawn_supervisor(opts);
    let t0 = Instant::now();
    loop {
        let live = ranks_of(run);
        if live.len() == 2 {
            std::thread::sleep(Duration::from_millis(500));
            signal(live[0].0, libc::SIGKILL);
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(10));
    }
    let report = sup.join().unwrap();
    assert!(!report.ok);
    assert!(
        report.reason.contains("tp x pp = 2 x 1 = 2") && report.reason.contains("add nodes"),
        "{}",
        report.reason
    );
    assert!(ranks_of(run).is_empty(), "ranks were left running");
}

#[test]
fn a_stale_generation_cannot_commit() {
    // Generation 1 has started (a supervisor marked it); a rank process of generation 0 saves
    // and tries to commit: refused, and the step stays invisible.
    let dir = tempfile::tempdir().unwrap();
    let store_path = dir.path().join("store");
    let store = ckpt_store::open(store_path.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(store.log().start_generation("stale", 1))
        .unwrap();
    // A save of step 2 as a rank of `generation`.
    let save_as = |generation: &str| {
        std::process::Command::new(bin("ckpt-train", "ckpt-train"))
            .arg("--store")
            .arg(&store_path)
            .args(["--run", "stale", "--steps", "2", "--ckpt-every", "2"])
            .args(["--params", PARAMS, "--generation", generation])
            .env("CKPT_LOG", "warn")
            .output()
            .unwrap()
    };
    let out = save_as("0");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("generation 1 has started") && err.contains("stale"),
        "{err}"
    );
    assert!(
        rt.block_on(store.log().committed_steps("stale"))
            .unwrap()
            .is_empty()
    );
    // The same save from generation 1 commits.
    let out = save_as("1");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        rt.block_on(store.log().committed_steps("stale")).unwrap(),
        vec![2]
    );
}

/// Processes whose command line has all of `words`.
fn processes_with_args(words: &[&str]) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmd
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).to_string())
            .collect();
        if words.iter().all(|w| args.iter().any(|a| a == w)) {
            out.push(pid);
        }
    }
    out
}

#[test]
fn a_lost_node_is_restored_from_peer_replicas() {
    // 3 nodes x 2 ranks (dp=3,tp=2: one data-parallel replica per node), one replica agent
    // per node. Right after a checkpoint commits, node 1 dies (its agent and both its ranks,
    // SIGKILL). The job goes on with dp=2 on nodes 0 and 2, and every byte of the restore
    // comes from the agents' memory, including the shards node 1 wrote (node 2 holds its copy).
    let dir = tempfile::tempdir().unwrap();
    let steps = 24;
    let want = reference_digest(dir.path(), steps, PARAMS);
    let store = dir.path().join("store");
    let run = "peers";
    let topo = Topology {
        nodes: 3,
        ranks_per_node: 2,
        spares: 0,
    };
    let mut opts = supervised(
        &store,
        run,
        topo,
        "dp=3,tp=2",
        train_cmd(steps, 8, 150),
        dir.path().join("logs"),
    );
    // The agents log each snapshot they take ("snapshot held", at info; no colour codes).
    opts.replica_agent = Some(logging_agent_command());
    let sup = spawn_supervisor(opts);
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let t0 = Instant::now();
    // The first commit (step 8); the next save is 8 steps of 150 ms away.
    let step = loop {
        if let Some(s) = rt.block_on(st.log().latest_committed(run)).unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint");
        std::thread::sleep(Duration::from_millis(5));
    };
    // The buddy copies follow each rank's persist asynchronously (a rank hands its last chunks
    // to its agent after its manifest, and the agent copies to its buddy after that): wait
    // until the agents of nodes 0 and 2, which survive, hold every rank's snapshot of the step
    // (node 1's ranks through node 2's agent, its buddy).
    let logs = dir.path().join("logs");
    let agent_log = |node: u32| {
        std::fs::read_to_string(logs.join(format!("agent-{node}.err"))).unwrap_or_default()
    };
    let held = [
        (0, 0, 0),
        (0, 0, 1),
        (2, 1, 2),
        (2, 1, 3),
        (2, 2, 4),
        (2, 2, 5),
    ];
    while let Some((agent, node, rank)) = held
        .iter()
        .copied()
        .find(|&(agent, node, rank)| !agent_held(&agent_log(agent), node, rank, step))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "node {node} rank {rank}'s snapshot of step {step} never reached agent {agent}:\n{}",
            agent_log(agent)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let agent = processes_with_args(&["replica-agent", "--node", "1"]);
    assert_eq!(agent.len(), 1, "one agent for node 1");
    let node1 = find_processes(&[("CKPT_RUN", run), ("CKPT_NODE", "1")]);
    assert_eq!(node1.len(), 2, "two ranks on node 1");
    signal(agent[0], libc::SIGKILL);
    for (pid, _) in &node1 {
        signal(*pid, libc::SIGKILL);
    }
    let report = sup.join().unwrap();
    assert!(report.ok, "the job did not finish: {}", report.reason);
    assert_eq!(report.layout, "dp=2,tp=2,pp=1");
    let got = final_digest(&dir.path().join("logs")).expect("rank 0 printed a digest");
    assert_eq!(
        got, want,
        "the recovered job differs from an uninterrupted run"
    );

    // Node 1's ranks (2 and 3) wrote shards of the restored step.
    let (commit, _) = rt.block_on(st.log().read_commit(run, step)).unwrap();
    let by_node1: usize = commit
        .tensors
        .iter()
        .flat_map(|t| &t.shards)
        .filter(|s| s.rank == 2 || s.rank == 3)
        .count();
    assert!(by_node1 > 0, "node 1 wrote nothing of step {step}");
    let events = rt
        .block_on(ckpt_store::logs::read_log(
            &st,
            run,
            ckpt_store::logs::EVENTS,
        ))
        .unwrap();
    let restores: Vec<_> = events
        .iter()
        .filter(|e| e["kind"] == "restore" && e["step"] == step)
        .collect();
    assert_eq!(
        restores.len(),
        4,
        "four restarted ranks restored: {events:#?}"
    );
    for r in &restores {
        assert!(
            r["bytes_from_peers"].as_u64().unwrap() > 0,
            "nothing came from the agents: {r}"
        );
        // The agents run on this machine: the ranks mapped their memory, no socket copies.
        assert_eq!(
            r["bytes_from_peers_mapped"], r["bytes_from_peers"],
            "not all read out of the agents' mapped memory: {r}"
        );
        assert_eq!(
            r["bytes_from_store"], 0,
            "the agents held the whole step, yet the store was read: {r}"
        );
    }
    // The supervisor's report sums them per generation.
    assert_eq!(report.restores.len(), 1, "{:?}", report.restores);
    let sum = &report.restores[0];
    assert_eq!((sum.ranks, sum.step, sum.bytes_from_store), (4, step, 0));
    assert_eq!(
        sum.bytes_from_peers,
        restores
            .iter()
            .map(|r| r["bytes_from_peers"].as_u64().unwrap())
            .sum::<u64>()
    );
    let t1 = Instant::now();
    while !processes_with_args(&["replica-agent"]).is_empty() {
        assert!(
            t1.elapsed() < Duration::from_secs(5),
            "agents outlived the supervision"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_rank_killed_during_a_save_resumes_from_the_step_before_out_of_the_agents() {
    // 2 nodes x 1 rank (dp=2), one replica agent per node, a checkpoint every 8 steps. At the
    // second save (step 16) rank 1 stalls after writing its chunks, before its manifest; rank
    // 0 persists its part and hands its snapshot of step 16 to the agents. Then rank 1 is
    // SIGKILLed: step 16 never commits and the job resumes from step 8. The agents still hold
    // rank 0's snapshot of step 8 next to its newer one, so the restarted ranks restore every
    // byte from memory, none from the store.
    let dir = tempfile::tempdir().unwrap();
    let steps = 24;
    let want = reference_digest(dir.path(), steps, PARAMS);
    let store = dir.path().join("store");
    let logs = dir.path().join("logs");
    let run = "peers-mid-save";
    let topo = Topology {
        nodes: 2,
        ranks_per_node: 1,
        spares: 0,
    };
    // Rank 1 of the first generation stalls in its second save (a restarted one does not).
    let mut cmd: Vec<String> = vec![
        "sh".into(),
        "-c".into(),
        r#"if [ "$CKPT_RANK" = 1 ] && [ "$CKPT_GENERATION" = 0 ]; then
             exec "$0" "$@" --failpoints 'after_chunks=sleep(60000)@2'
           fi
           exec "$0" "$@""#
            .into(),
    ];
    cmd.extend(train_cmd(steps, 8, 150));
    let mut opts = supervised(&store, run, topo, "dp=2", cmd, logs.clone());
    // The agents log each snapshot they take ("snapshot held", at info; no colour codes).
    opts.replica_agent = Some(logging_agent_command());
    let sup = spawn_supervisor(opts);
    // Rank 0's snapshot of step 16 held by its node's agent.
    let held = |log: &str| agent_held(log, 0, 0, 16);
    let t0 = Instant::now();
    while !held(&std::fs::read_to_string(logs.join("agent-0.err")).unwrap_or_default()) {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "rank 0's snapshot of step 16 never reached its agent:\n{}",
            std::fs::read_to_string(logs.join("agent-0.err")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let rank1: Vec<u32> = find_processes(&[("CKPT_RUN", run), ("CKPT_RANK", "1")])
        .into_iter()
        .filter(|(_, env)| env_of(env, "CKPT_GENERATION") == Some("0"))
        .map(|(pid, _)| pid)
        .collect();
    assert_eq!(rank1.len(), 1, "rank 1 of generation 0: {rank1:?}");
    signal(rank1[0], libc::SIGKILL);
    let report = sup.join().unwrap();
    assert!(report.ok, "the job did not finish: {}", report.reason);
    assert_eq!(final_digest(&logs).as_deref(), Some(want.as_str()));
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let events = rt
        .block_on(ckpt_store::logs::read_log(
            &st,
            run,
            ckpt_store::logs::EVENTS,
        ))
        .unwrap();
    let restores: Vec<_> = events.iter().filter(|e| e["kind"] == "restore").collect();
    // (The job may go on without node 1: its rank failed there.)
    assert!(!restores.is_empty(), "no rank restored: {events:#?}");
    for r in &restores {
        assert_eq!(
            r["step"], 8,
            "resumed from the step before the one in flight: {r}"
        );
        assert!(
            r["bytes_from_peers"].as_u64().unwrap() > 0,
            "nothing came from the agents: {r}"
        );
        assert_eq!(
            r["bytes_from_store"], 0,
            "the agents held step 8 whole (rank 0's beside its step 16), yet the store was read: {r}"
        );
    }
}

/// Steps `every`, `2 * every`, ... `steps` of `run` committed by an uninterrupted job of two
/// data-parallel ranks (seed 5, as the reference).
fn committed_run(store: &Path, run: &str, steps: u64, every: u64) {
    let out = std::process::Command::new(bin("ckpt-train", "ckpt-train"))
        .arg("--store")
        .arg(store)
        .args([
            "--run", run, "--layout", "dp=2", "--params", PARAMS, "--seed", "5",
        ])
        .args([
            "--steps",
            &steps.to_string(),
            "--ckpt-every",
            &every.to_string(),
        ])
        .env("CKPT_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The file of a chunk or pack object that `step` of `run` references and `older` does not.
fn object_only_in(store: &Path, run: &str, step: u64, older: u64) -> PathBuf {
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let objects = |s: u64| {
        rt.block_on(st.log().step_chunk_refs(run, s))
            .unwrap()
            .iter()
            .map(|c| st.keys().object_of(c).to_string())
            .collect::<std::collections::BTreeSet<_>>()
    };
    let old = objects(older);
    let key = objects(step)
        .into_iter()
        .find(|k| !old.contains(k))
        .expect("an object of the newer step only");
    let p = store.join(key);
    assert!(p.is_file(), "{} is not a file", p.display());
    p
}

/// What `damaged_resume` saw.
struct Resumed {
    report: ckpt_recovery::Report,
    /// The run's events log.
    log: Vec<serde_json::Value>,
    /// `CKPT_RESUME_STEP` of the rank processes seen, by generation.
    resume_env: std::collections::BTreeMap<u64, Option<String>>,
}

/// Supervise `run` (2 nodes and a spare, dp=2, 12 steps, a checkpoint every 4) after its
/// step 8 was damaged by `damage`.
fn resume_damaged(dir: &Path, run: &str, max_restarts: u32, damage: impl FnOnce(&Path)) -> Resumed {
    let store = dir.join("store");
    committed_run(&store, run, 8, 4);
    damage(&object_only_in(&store, run, 8, 4));
    let topo = Topology {
        nodes: 2,
        ranks_per_node: 1,
        spares: 1,
    };
    let mut opts = supervised(
        &store,
        run,
        topo,
        "dp=2",
        train_cmd(12, 4, 20),
        dir.join("logs"),
    );
    opts.job.config.max_restarts = max_restarts;
    let sup = spawn_supervisor(opts);
    let mut resume_env = std::collections::BTreeMap::new();
    while !sup.is_finished() {
        for (_, env) in find_processes(&[("CKPT_RUN", run)]) {
            if let Some(g) = env_of(&env, "CKPT_GENERATION").and_then(|g| g.parse().ok()) {
                resume_env.insert(g, env_of(&env, "CKPT_RESUME_STEP").map(str::to_string));
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let report = sup.join().unwrap();
    eprintln!("{:#?}", report.records);
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let log = rt
        .block_on(ckpt_store::logs::read_log(
            &st,
            run,
            ckpt_store::logs::EVENTS,
        ))
        .unwrap();
    // Whatever happened, every committed step restores: the damaged one was re-saved.
    assert_eq!(
        rt.block_on(st.log().committed_steps(run)).unwrap(),
        vec![4, 8, 12]
    );
    let v = rt
        .block_on(st.verify(&ckpt_store::VerifyScope::Run(run.into()), None))
        .unwrap();
    assert!(v.is_clean(), "{:#?}", v.damaged);
    Resumed {
        report,
        log,
        resume_env,
    }
}

fn of_kind<'a>(records: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    records.iter().filter(|r| r["kind"] == kind).collect()
}

#[test]
fn a_newest_step_with_a_missing_object_is_skipped_and_the_job_resumes_from_the_older_one() {
    let dir = tempfile::tempdir().unwrap();
    let want = reference_digest(dir.path(), 12, PARAMS);
    let r = resume_damaged(dir.path(), "missing", 6, |obj| {
        std::fs::remove_file(obj).unwrap()
    });
    let (report, log) = (r.report, r.log);
    // The ranks were told the step.
    assert!(!r.resume_env.is_empty(), "no rank process seen");
    for (g, step) in &r.resume_env {
        assert_eq!(step.as_deref(), Some("4"), "generation {g}");
    }
    assert!(report.ok, "{}", report.reason);
    let recs = &report.records;
    assert!(of_kind(recs, "failure").is_empty(), "a node was blamed");
    assert_eq!(report.restarts, 0, "{recs:#?}");
    // Choosing found step 8 incomplete: the log says so, and the first generation restored 4.
    let unusable = of_kind(recs, "step_unusable");
    assert_eq!(unusable.len(), 1, "{recs:#?}");
    assert_eq!(unusable[0]["step"], 8);
    assert!(unusable[0]["rank"].is_null());
    let why = unusable[0]["why"].as_str().unwrap();
    assert!(why.contains("missing"), "{why}");
    let started = of_kind(recs, "started");
    assert_eq!(started.len(), 1);
    assert_eq!(started[0]["resume_from"], 4, "{recs:#?}");
    assert_eq!(started[0]["nodes"], serde_json::json!([0, 1]));
    // Every rank restored step 4, none step 8.
    let restores = of_kind(&log, "restore");
    assert_eq!(restores.len(), 2, "{log:#?}");
    assert!(restores.iter().all(|r| r["step"] == 4), "{restores:#?}");
    assert_eq!(of_kind(&log, "step_unusable").len(), 1, "{log:#?}");
    assert_eq!(
        final_digest(&dir.path().join("logs")).expect("rank 0 printed a digest"),
        want,
        "the job resumed from step 4 differs from an uninterrupted run"
    );
}

#[test]
fn a_step_found_damaged_only_by_the_restore_is_marked_unusable_and_no_node_is_blamed() {
    // One object of step 8 has flipped bytes: it exists, so step 8 is chosen and the ranks
    // fail to restore it. That is the data's fault: no node is excluded, no restart of the
    // budget (0 here) is spent, step 8 is verified and marked unusable, the job restarts from
    // step 4 and saves step 8 again.
    let dir = tempfile::tempdir().unwrap();
    let want = reference_digest(dir.path(), 12, PARAMS);
    let r = resume_damaged(dir.path(), "flipped", 0, |obj| {
        let mut b = std::fs::read(obj).unwrap();
        let mid = b.len() / 2;
        for x in &mut b[mid..mid + 16] {
            *x ^= 0xff;
        }
        std::fs::write(obj, b).unwrap();
    });
    let (report, log) = (r.report, r.log);
    let (g, step) = r.resume_env.last_key_value().expect("a rank process seen");
    assert_eq!(step.as_deref(), Some("4"), "generation {g}");
    assert!(report.ok, "{}", report.reason);
    let recs = &report.records;
    assert!(of_kind(recs, "failure").is_empty(), "a node was blamed");
    let unusable = of_kind(recs, "step_unusable");
    assert_eq!(unusable.len(), 1, "{recs:#?}");
    assert_eq!(unusable[0]["step"], 8);
    assert!(unusable[0]["rank"].is_u64(), "{:?}", unusable[0]);
    let why = unusable[0]["why"].as_str().unwrap();
    assert!(why.contains("damaged object"), "{why}");
    let decisions = of_kind(recs, "recovery");
    assert_eq!(decisions.len(), 1, "{recs:#?}");
    assert_eq!(decisions[0]["step"], 4);
    let started = of_kind(recs, "started");
    let from: Vec<_> = started.iter().map(|s| s["resume_from"].clone()).collect();
    assert_eq!(from, [serde_json::json!(8), serde_json::json!(4)]);
    for s in &started {
        assert_eq!(s["nodes"], serde_json::json!([0, 1]), "{s}");
    }
    // The ranks said why they stopped.
    let failed = of_kind(&log, "restore_failed");
    assert!(!failed.is_empty(), "{log:#?}");
    assert!(
        failed
            .iter()
            .all(|r| r["step"] == 8 && r["error_kind"] == "damaged data")
    );
    assert_eq!(
        final_digest(&dir.path().join("logs")).expect("rank 0 printed a digest"),
        want,
        "the job resumed from step 4 differs from an uninterrupted run"
    );
}

#[test]
fn ckpt_train_resumes_from_exactly_the_step_it_is_given() {
    // Steps 4 and 8 are committed; CKPT_RESUME_STEP=4 restores 4 (not the newest, 8) and the
    // run to step 6 equals an uninterrupted one. A step that is not committed is a data
    // failure: exit code 65.
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let run = "exact";
    committed_run(&store, run, 8, 4);
    let resume = |step: &str| {
        std::process::Command::new(bin("ckpt-train", "ckpt-train"))
            .arg("--store")
            .arg(&store)
            .args([
                "--run", run, "--layout", "dp=2", "--params", PARAMS, "--seed", "5",
            ])
            .args(["--steps", "6", "--ckpt-every", "100"])
            .env("CKPT_RESUME", "true")
            .env("CKPT_RESUME_STEP", step)
            .env("CKPT_LOG", "warn")
            .output()
            .unwrap()
    };
    let out = resume("4");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = digest_in(&String::from_utf8_lossy(&out.stdout)).expect("a digest");
    assert_eq!(got, reference_digest(dir.path(), 6, PARAMS));
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let log = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(ckpt_store::logs::read_log(
            &st,
            run,
            ckpt_store::logs::EVENTS,
        ))
        .unwrap();
    let restored: Vec<_> = of_kind(&log, "restore")
        .iter()
        .map(|r| r["step"].clone())
        .collect();
    assert_eq!(restored, [serde_json::json!(4), serde_json::json!(4)]);

    let out = resume("5");
    assert_eq!(out.status.code(), Some(ckpt_recovery::DATA_FAILURE_EXIT));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("step 5") && err.contains("not committed"),
        "{err}"
    );
}

/// `ckpt` (the real binary) with the store in the environment.
fn ckpt_cli(store: &Path) -> std::process::Command {
    let mut c = std::process::Command::new(bin("ckpt", "ckpt"));
    c.env("CKPT_STORE", store).env("CKPT_LOG", "warn");
    c
}

/// `ckpt verify RUN` exits 0 (every committed step intact).
fn assert_verifies(store: &Path, run: &str) {
    let out = ckpt_cli(store).args(["verify", run]).output().unwrap();
    assert!(
        out.status.success(),
        "ckpt verify {run}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_job_resumed_by_hand_fences_the_job_still_running() {
    // Job A trains; job B (`ckpt-train --resume`, by hand, no supervisor) is started on the
    // same run while A still runs. From B's start on, A commits nothing (its saves are fenced
    // and it stops by itself), B commits every step it saves and ends where an uninterrupted
    // run ends.
    let dir = tempfile::tempdir().unwrap();
    let steps: u64 = 30;
    let want = reference_digest(dir.path(), steps, PARAMS);
    let store = dir.path().join("store");
    let run = "twojobs";
    let job = |resume: bool, out: &str| {
        let mut c = std::process::Command::new(bin("ckpt-train", "ckpt-train"));
        c.arg("--store")
            .arg(&store)
            .args([
                "--run",
                run,
                "--steps",
                &steps.to_string(),
                "--ckpt-every",
                "2",
            ])
            .args(["--params", PARAMS, "--seed", "5", "--step-time-ms", "100"])
            .env("CKPT_LOG", "warn")
            .stdout(std::fs::File::create(dir.path().join(format!("{out}.out"))).unwrap())
            .stderr(std::fs::File::create(dir.path().join(format!("{out}.err"))).unwrap());
        if resume {
            c.arg("--resume");
        }
        c.spawn().unwrap()
    };
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut a = job(false, "a");
    let t0 = Instant::now();
    while rt
        .block_on(st.log().latest_committed(run))
        .unwrap()
        .is_none_or(|s| s < 6)
    {
        assert!(a.try_wait().unwrap().is_none(), "job A ended early");
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "job A commits nothing"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let gen_a = rt
        .block_on(st.log().newest_generation(run))
        .unwrap()
        .unwrap();
    let mut b = job(true, "b");
    let b_status = b.wait().unwrap();
    let read = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap();
    assert!(b_status.success(), "job B failed: {}", read("b.err"));
    // A stopped by itself, long before its 30 steps of 100 ms were done, fenced.
    let t1 = Instant::now();
    let a_status = loop {
        if let Some(s) = a.try_wait().unwrap() {
            break s;
        }
        if t1.elapsed() > Duration::from_secs(10) {
            let _ = a.kill();
            panic!("job A still runs after job B finished: it was not fenced");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!a_status.success(), "job A ran to its end");
    let a_err = read("a.err");
    let gen_b = rt
        .block_on(st.log().newest_generation(run))
        .unwrap()
        .unwrap();
    assert!(gen_b > gen_a, "job B started no newer generation");
    assert!(
        a_err.contains(&format!("fenced by generation {gen_b}")),
        "job A's error does not say it was fenced: {a_err}"
    );
    assert_eq!(digest_in(&read("b.out")), Some(want), "job B's final state");
    // The step B resumed from, from its restore event.
    let events = rt
        .block_on(ckpt_store::logs::read_log(
            &st,
            run,
            ckpt_store::logs::EVENTS,
        ))
        .unwrap();
    let from = events
        .iter()
        .find(|e| e["kind"] == "restore" && e["generation"] == gen_b)
        .and_then(|e| e["step"].as_u64())
        .expect("job B restored a step");
    let committed = rt.block_on(st.log().committed_steps(run)).unwrap();
    for s in &committed {
        let g = rt
            .block_on(st.log().read_commit(run, *s))
            .unwrap()
            .0
            .generation;
        if *s > from {
            assert_eq!(
                g, gen_b,
                "step {s} was committed by job A after job B started"
            );
        }
    }
    let after: Vec<u64> = committed.iter().copied().filter(|s| *s > from).collect();
    let every: Vec<u64> = (from + 1..=steps).filter(|s| s % 2 == 0).collect();
    assert_eq!(after, every, "job B did not commit every step it saved");
    assert_verifies(&store, run);
}

#[test]
fn ranks_and_agents_die_with_a_killed_ckpt_resume() {
    // SIGKILL the real `ckpt resume` mid-run: within seconds none of its ranks or replica
    // agents is left; a new `ckpt resume` of the run finishes bit-identical to an
    // uninterrupted run.
    let dir = tempfile::tempdir().unwrap();
    let steps: u64 = 40;
    let want = reference_digest(dir.path(), steps, PARAMS);
    let store = dir.path().join("store");
    let run = format!("orphans{}", std::process::id());
    let logs = dir.path().join("logs");
    // The first supervision's ranks take 300 ms a step, so on their own they would train
    // for 10 s more after the kill: long past the few seconds they are given to die.
    let resume = |tag: &str, step_ms: u64| {
        let mut c = ckpt_cli(&store);
        c.args(["resume", "--run", &run, "--nodes", "2", "--layout", "dp=2"])
            .args([
                "--peer-replicas",
                "--heartbeat-timeout",
                "2s",
                "--backoff",
                "100ms",
            ])
            .arg("--logs")
            .arg(&logs)
            .arg("--")
            .args(train_cmd(steps, 4, step_ms))
            // Every process of this supervision inherits the tag: found by it below.
            .env("CKPT_TEST_TAG", tag)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join(format!("{tag}.err"))).unwrap());
        c
    };
    let tag = format!("{run}-first");
    let mut sup = resume(&tag, 300).spawn().unwrap();
    let alive = |tag: &str| -> Vec<u32> {
        find_processes(&[("CKPT_TEST_TAG", tag)])
            .into_iter()
            .map(|(pid, _)| pid)
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.split_whitespace().nth(2) != Some("Z"))
            })
            .collect()
    };
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let t0 = Instant::now();
    while rt
        .block_on(st.log().latest_committed(&run))
        .unwrap()
        .is_none()
    {
        assert!(sup.try_wait().unwrap().is_none(), "ckpt resume ended early");
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint");
        std::thread::sleep(Duration::from_millis(20));
    }
    let ranks = ranks_of(&run);
    assert_eq!(ranks.len(), 2, "two ranks run: {ranks:?}");
    // The supervisor, two agents and two ranks.
    assert_eq!(alive(&tag).len(), 5, "{:?}", alive(&tag));
    signal(sup.id(), libc::SIGKILL);
    sup.wait().unwrap();
    let t1 = Instant::now();
    loop {
        let left = alive(&tag);
        if left.is_empty() {
            break;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(4),
            "processes of the killed ckpt resume are still alive: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = resume(&format!("{run}-second"), 0).output().unwrap();
    assert!(
        out.status.success(),
        "the second ckpt resume failed: {}",
        std::fs::read_to_string(dir.path().join(format!("{run}-second.err"))).unwrap_or_default()
    );
    assert_eq!(
        final_digest(&logs).as_deref(),
        Some(want.as_str()),
        "the resumed job differs from an uninterrupted run"
    );
    assert_verifies(&store, &run);
}

/// The driver's loss curve, summed from the heartbeat payloads of ranks in separate processes
/// (sums and scale the supervisor never names), is the curve of the same job run as threads of
/// one process, bit for bit.
#[test]
fn the_supervisors_loss_curve_equals_the_one_process_run_bit_for_bit() {
    use ckpt_recovery::records::{Metric, read_records};
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let steps = 6;
    let topo = Topology {
        nodes: 2,
        ranks_per_node: 1,
        spares: 0,
    };
    let opts = supervised(
        &store,
        "supervised",
        topo,
        "dp=2",
        train_cmd(steps, 100, 0),
        dir.path().join("logs"),
    );
    let report = spawn_supervisor(opts).join().unwrap();
    assert!(report.ok, "{}", report.reason);
    committed_run(&store, "threads", steps, 100);
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // (step, loss bits, grad norm bits) of the job-wide records (no rank).
    let curve = |run: &str, driver: bool| -> Vec<(u64, u64, u64)> {
        let mut c: Vec<_> = rt
            .block_on(read_records::<Metric>(&st, run))
            .unwrap()
            .into_iter()
            .filter_map(|m| match m.record {
                Metric::Step(s) if s.rank.is_none() && s.generation.is_some() == driver => Some((
                    s.step,
                    s.loss.expect("a loss").to_bits(),
                    s.grad_norm.expect("a gradient norm").to_bits(),
                )),
                _ => None,
            })
            .collect();
        c.sort();
        c
    };
    let supervised = curve("supervised", true);
    assert_eq!(
        supervised.iter().map(|c| c.0).collect::<Vec<_>>(),
        (1..=steps).collect::<Vec<_>>(),
        "one record per step from the driver"
    );
    assert_eq!(supervised, curve("threads", false));
}

/// `ckpt-train --ckpt-every auto` (issue 19.2) under the supervisor, its rank killed with
/// SIGKILL three times: each generation reads the failures the supervisor logged, the first
/// (none yet) keeps the upper bound, the last chooses a shorter interval from them; the job
/// ends bit-identical to an uninterrupted run with a fixed interval.
#[test]
fn the_automatic_interval_counts_the_failures_the_supervisor_logs() {
    use ckpt_recovery::records::{Event, read_records};
    let dir = tempfile::tempdir().unwrap();
    let steps = 90;
    let want = reference_digest(dir.path(), steps, PARAMS);
    let store = dir.path().join("store");
    let run = "auto-interval";
    let topo = Topology {
        nodes: 4,
        ranks_per_node: 1,
        spares: 0,
    };
    let cmd = auto_train_cmd(steps, 30);
    let opts = supervised(&store, run, topo, "dp=1", cmd, dir.path().join("logs"));
    let sup = spawn_supervisor(opts);
    let t0 = Instant::now();
    let mut kills = Vec::new();
    let mut last_gen = None;
    while kills.len() < 3 {
        let live = ranks_of(run);
        match live.iter().max_by_key(|x| x.2) {
            Some(&(pid, _, g)) if last_gen.is_none_or(|l| g > l) => {
                // Past start-up and the first saves, well before the 90 steps of 30 ms end.
                std::thread::sleep(Duration::from_millis(700));
                signal(pid, libc::SIGKILL);
                kills.push(g);
                last_gen = Some(g);
            }
            _ => {
                assert!(
                    !sup.is_finished(),
                    "the job ended before 3 kills: {kills:?}"
                );
                assert!(t0.elapsed() < Duration::from_secs(120), "kills {kills:?}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    let report = sup.join().unwrap();
    assert!(report.ok, "{}", report.reason);
    assert_eq!(report.restarts, 3, "kills {kills:?}");
    let got = final_digest(&dir.path().join("logs")).expect("rank 0 printed a digest");
    assert_eq!(got, want, "checkpoint timing changed the training result");

    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let decisions: Vec<_> = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(read_records::<Event>(&st, run))
        .unwrap()
        .into_iter()
        .filter_map(|l| match l.record {
            Event::CheckpointInterval(c) => Some(c),
            _ => None,
        })
        .collect();
    let first = decisions.first().expect("no checkpoint_interval event");
    assert!(first.mtbf_prior && first.failures == 0, "{decisions:#?}");
    assert_eq!((first.to_steps, first.reason.as_str()), (40, "max"));
    // The last generation's decisions: the three failures over a few seconds of run.
    let last = decisions.last().unwrap();
    assert_eq!(last.failures, 3, "{decisions:#?}");
    assert!(!last.mtbf_prior && last.mtbf_s < 60.0, "{decisions:#?}");
    assert!(last.to_steps < 40, "{decisions:#?}");
}

/// `--ckpt-every auto` with one rank per process (issue 19.2), two ranks under the supervisor:
/// the interval is fixed per generation, every rank derives the same one from the log before
/// the generation started (agreed through the store). A first supervision trains 30 steps at
/// the lower bound (nothing measured yet); a second resumes the run to 150 steps: its first
/// generation, with rank 0's measured cost and no failure, takes the upper bound; a rank of
/// it and of the next generation is SIGKILLed once the generation committed, and the
/// intervals after the failures are shorter. Every commit lies on its generation's schedule
/// (ranks that disagreed would never commit a step before the last), and the job ends
/// bit-identical to an uninterrupted run with a fixed interval.
#[test]
fn rank_processes_agree_on_an_automatic_interval_per_generation_that_shrinks_after_failures() {
    use ckpt_recovery::records::{Event, read_records};
    let dir = tempfile::tempdir().unwrap();
    let steps = 150;
    let want = reference_digest(dir.path(), steps, PARAMS);
    let store = dir.path().join("store");
    let run = "auto-procs";
    let topo = Topology {
        nodes: 2,
        ranks_per_node: 1,
        spares: 2,
    };
    let first = spawn_supervisor(supervised(
        &store,
        run,
        topo,
        "dp=2",
        auto_train_cmd(30, 30),
        dir.path().join("logs-1"),
    ))
    .join()
    .unwrap();
    assert!(first.ok, "{}", first.reason);
    assert_eq!(first.restarts, 0);

    let logs = dir.path().join("logs-2");
    let sup = spawn_supervisor(supervised(
        &store,
        run,
        topo,
        "dp=2",
        auto_train_cmd(steps, 30),
        logs.clone(),
    ));
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let committed_by = |g: u64| {
        rt.block_on(async {
            let Some(s) = st.log().latest_committed(run).await.ok().flatten() else {
                return false;
            };
            st.log()
                .read_commit(run, s)
                .await
                .is_ok_and(|(c, _)| c.generation == g)
        })
    };
    let t0 = Instant::now();
    let mut kills: Vec<(u64, u32)> = Vec::new();
    while kills.len() < 2 {
        assert!(
            !sup.is_finished(),
            "the job ended before 2 kills: {kills:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(120), "kills {kills:?}");
        let live = ranks_of(run);
        let newest = live.iter().map(|x| x.2).max();
        if let Some(g) = newest
            && kills.last().is_none_or(|k| g > k.0)
            && committed_by(g)
        {
            // Rank 1 of the first generation, rank 0 (the one that measures) of the next.
            let victim = if kills.is_empty() { 1 } else { 0 };
            if let Some(&(pid, _, _)) = live.iter().find(|x| x.1 == victim && x.2 == g) {
                signal(pid, libc::SIGKILL);
                kills.push((g, victim));
                continue;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let report = sup.join().unwrap();
    assert!(report.ok, "{}", report.reason);
    assert_eq!(report.restarts, 2, "kills {kills:?}");
    let got = final_digest(&logs).expect("rank 0 printed a digest");
    assert_eq!(got, want, "checkpoint timing changed the training result");

    // One decision per generation, agreed by both ranks.
    let mut decisions: Vec<_> = rt
        .block_on(read_records::<Event>(&st, run))
        .unwrap()
        .into_iter()
        .filter_map(|l| match l.record {
            Event::CheckpointInterval(c) => Some(c),
            _ => None,
        })
        .collect();
    decisions.sort_by_key(|c| c.generation);
    let gens: Vec<u64> = decisions.iter().filter_map(|c| c.generation).collect();
    assert_eq!(gens.len(), 4, "{decisions:#?}");
    assert!(gens.windows(2).all(|w| w[0] < w[1]), "{decisions:#?}");
    for d in &decisions {
        eprintln!(
            "generation {:?}: {} steps from step {} ({}; cost {:?} s, step {:?} s, {} failures, MTBF {:.1} s)",
            d.generation, d.to_steps, d.step, d.reason, d.cost_s, d.step_s, d.failures, d.mtbf_s
        );
    }
    let [g0, g1, g2, g3] = [0, 1, 2, 3].map(|i| &decisions[i]);
    assert_eq!((g0.to_steps, g0.reason.as_str()), (2, "no_cost"), "{g0:#?}");
    assert!(g1.mtbf_prior && g1.failures == 0, "{g1:#?}");
    assert!(g1.cost_s.is_some_and(|c| c > 0.0), "{g1:#?}");
    assert_eq!((g1.to_steps, g1.reason.as_str(), g1.step), (40, "max", 30));
    assert_eq!((g2.failures, g3.failures), (1, 2), "{decisions:#?}");
    assert!(!g2.mtbf_prior && g2.mtbf_s < 120.0, "{g2:#?}");
    assert!(
        g2.to_steps < g1.to_steps && g3.to_steps < g1.to_steps,
        "the interval did not shrink after failures: {decisions:#?}"
    );
    // Every commit on its generation's steps (S + k x N), or a job's last step.
    let steps_committed = rt.block_on(st.log().committed_steps(run)).unwrap();
    for s in &steps_committed {
        let c = rt.block_on(st.log().read_commit(run, *s)).unwrap().0;
        assert_eq!(c.ranks.len(), 2, "step {s} was not saved by both ranks");
        let d = decisions
            .iter()
            .find(|d| d.generation == Some(c.generation))
            .unwrap_or_else(|| panic!("step {s}: no decision for generation {}", c.generation));
        assert!(
            *s == 30 || *s == steps || (*s > d.step && (s - d.step) % d.to_steps == 0),
            "step {s} of generation {} is off its schedule ({} + k x {}): {steps_committed:?}",
            c.generation,
            d.step,
            d.to_steps
        );
    }
    for (g, _) in &kills {
        assert!(
            steps_committed.iter().any(|s| *s != 30
                && rt
                    .block_on(st.log().read_commit(run, *s))
                    .unwrap()
                    .0
                    .generation
                    == *g),
            "generation {g} committed nothing before its last step: {steps_committed:?}"
        );
    }
}

#[test]
fn a_repaired_node_comes_back_and_the_job_grows_back_to_its_layout() {
    // `ckpt resume` on 2 nodes (no spare), dp=2, peer replicas on, nodes repaired after 1 s
    // (with a fresh replica agent). Right after the
    // first commit rank 1 (node 1) is killed: the job shrinks to dp=1 on node 0; node 1 comes
    // back, and at the next commit the job stops and grows back to dp=2 on both nodes from
    // that step. It ends bit-identical to an uninterrupted run, and the log says so.
    let dir = tempfile::tempdir().unwrap();
    let steps: u64 = 40;
    let every: u64 = 4;
    let want = reference_digest(dir.path(), steps, PARAMS);
    let store = dir.path().join("store");
    let run = "grow";
    let logs = dir.path().join("logs");
    let mut sup = ckpt_cli(&store)
        .args(["resume", "--run", run, "--nodes", "2", "--layout", "dp=2"])
        .args([
            "--repair-after",
            "1",
            "--heartbeat-timeout",
            "2s",
            "--peer-replicas",
        ])
        .args(["--backoff", "100ms", "--stop-grace", "2s"])
        .arg("--logs")
        .arg(&logs)
        .arg("--")
        .args(train_cmd(steps, every, 60))
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("resume.err")).unwrap())
        .spawn()
        .unwrap();
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let t0 = Instant::now();
    while rt
        .block_on(st.log().latest_committed(run))
        .unwrap()
        .is_none()
    {
        assert!(sup.try_wait().unwrap().is_none(), "ckpt resume ended early");
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint");
        std::thread::sleep(Duration::from_millis(5));
    }
    let victim = ranks_of(run)
        .into_iter()
        .find(|r| r.1 == 1)
        .expect("rank 1 runs");
    signal(victim.0, libc::SIGKILL);
    let out = sup.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let err = std::fs::read_to_string(dir.path().join("resume.err")).unwrap_or_default();
    assert!(out.status.success(), "ckpt resume failed:\n{stdout}\n{err}");
    let log = rt
        .block_on(ckpt_store::logs::read_log(
            &st,
            run,
            ckpt_store::logs::EVENTS,
        ))
        .unwrap();
    eprintln!("{stdout}");
    // Shrunk to node 0 after the kill ...
    let failures = of_kind(&log, "failure");
    assert_eq!(failures.len(), 1, "{log:#?}");
    assert_eq!(failures[0]["node"], 1);
    let recovery = of_kind(&log, "recovery");
    assert_eq!(recovery.len(), 1, "{log:#?}");
    assert_eq!(recovery[0]["layout"], "dp=1,tp=1,pp=1");
    // ... node 1 came back about a second after its failure ...
    let back = of_kind(&log, "node_returned");
    assert_eq!(back.len(), 1, "{log:#?}");
    assert_eq!(
        (&back[0]["node"], &back[0]["usable"]),
        (&1.into(), &true.into())
    );
    let repair_ms = back[0]["at_ms"].as_u64().unwrap() - failures[0]["at_ms"].as_u64().unwrap();
    assert!(
        (1000..3000).contains(&repair_ms),
        "back {repair_ms} ms after its failure"
    );
    // ... and the job grew back at the first commit after that, from the step committed.
    let grow = of_kind(&log, "grow");
    assert_eq!(grow.len(), 1, "{log:#?}");
    let g = grow[0];
    assert_eq!(g["from_layout"], "dp=1,tp=1,pp=1", "{g}");
    assert_eq!(g["layout"], "dp=2,tp=1,pp=1", "{g}");
    assert_eq!(g["nodes"], serde_json::json!([0, 1]), "{g}");
    assert_eq!(g["returned"], serde_json::json!([1]), "{g}");
    let grow_step = g["step"].as_u64().expect("a step");
    assert!(
        grow_step > recovery[0]["step"].as_u64().unwrap_or(0) && grow_step.is_multiple_of(every),
        "{g}"
    );
    assert!(g["at_ms"].as_u64() > back[0]["at_ms"].as_u64(), "{g}");
    assert!(
        rt.block_on(st.log().committed_steps(run))
            .unwrap()
            .contains(&grow_step)
    );
    // The last generation ran the full layout on both nodes, restored from the grow's step.
    let started = of_kind(&log, "started");
    let last = started.last().unwrap();
    assert_eq!(last["layout"], "dp=2,tp=1,pp=1", "{log:#?}");
    assert_eq!(last["nodes"], serde_json::json!([0, 1]));
    assert_eq!(last["resume_from"], grow_step);
    let restores: Vec<_> = of_kind(&log, "restore")
        .into_iter()
        .filter(|r| r["generation"] == last["generation"])
        .collect();
    assert_eq!(restores.len(), 2, "{log:#?}");
    assert!(restores.iter().all(|r| r["step"] == grow_step));
    assert!(
        stdout.contains("decision: grow from dp=1,tp=1,pp=1 to dp=2,tp=1,pp=1"),
        "{stdout}"
    );
    // The repaired node's fresh replica agent started.
    assert!(!err.contains("did not start"), "{err}");
    assert_eq!(
        final_digest(&logs).as_deref(),
        Some(want.as_str()),
        "the job that shrank and grew back differs from an uninterrupted run"
    );
    assert_verifies(&store, run);
}
