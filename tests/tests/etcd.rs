#![cfg(feature = "etcd")]
//! Recovery across machines: a real etcd server on loopback, one `ckpt agent` process per
//! node (each in its own process group, as if on its own machine), `ckpt-train` as the job.
//! A whole node (agent and ranks) is killed with SIGKILL; the other agents agree on one new
//! plan, the job resumes from the newest committed checkpoint and finishes bit-identical to an
//! uninterrupted run. Then the same with the coordinator's node, and with a rank stopped
//! (SIGSTOP) on a live node, found by the heartbeats its agent no longer relays.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckpt_recovery::agent::{JobState, job_state};
use ckpt_tests::{
    Etcd, bin, env_of, find_processes, newest_digest, reference_digest, signal, signal_group,
};
use serde_json::Value;

const PARAMS: &str = "40K";
// Long enough that the survivors are still training when the loss is detected (a 2 s lease),
// so they are stopped and restarted rather than finishing on their own.
const STEPS: u64 = 50;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// One node: its agent process (leader of its own process group) and where its output goes.
struct Node {
    id: u32,
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

struct Job {
    dir: tempfile::TempDir,
    etcd: Etcd,
    run: String,
    nodes: Vec<Node>,
    /// How every agent is started (for [`Job::restart_node`]).
    spec: AgentSpec,
}

/// The flags every agent of a job gets.
#[derive(Clone)]
struct AgentSpec {
    nodes: u32,
    spares: u32,
    layout: String,
    extra: Vec<String>,
    step_ms: u64,
    /// Each agent gets a local tier of its own (`tier-<node>`), as each machine has its disk.
    local_tiers: bool,
    /// More flags for every rank (`rank:FLAG` among the extras).
    rank_extra: Vec<String>,
}

impl Job {
    /// Start `nodes + spares` agents of a job with layout `layout`.
    fn start(run: &str, nodes: u32, spares: u32, layout: &str) -> Job {
        Job::start_with(run, nodes, spares, layout, &[])
    }

    /// The same, with `extra` flags for every agent.
    #[allow(
        clippy::disallowed_methods,
        reason = "a test reads its knobs and tools from the environment"
    )]
    fn start_with(run: &str, nodes: u32, spares: u32, layout: &str, extra: &[&str]) -> Job {
        let mut dir = tempfile::tempdir().unwrap();
        if std::env::var_os("CKPT_TEST_KEEP").is_some() {
            eprintln!("keeping {}", dir.path().display());
            dir.disable_cleanup(true);
        }
        let etcd = Etcd::start();
        let mut job = Job {
            dir,
            etcd,
            run: run.to_string(),
            nodes: Vec::new(),
            spec: AgentSpec {
                nodes,
                spares,
                layout: layout.to_string(),
                extra: extra.iter().map(|s| s.to_string()).collect(),
                step_ms: 120,
                local_tiers: false,
                rank_extra: Vec::new(),
            },
        };
        if let Some(ms) = extra.iter().find_map(|e| e.strip_prefix("step-ms=")) {
            job.spec.step_ms = ms.parse().unwrap();
            job.spec.extra.retain(|e| !e.starts_with("step-ms="));
        }
        job.spec.rank_extra = extra
            .iter()
            .filter_map(|e| e.strip_prefix("rank:").map(str::to_string))
            .collect();
        job.spec.extra.retain(|e| !e.starts_with("rank:"));
        if extra.contains(&"local-tiers") {
            job.spec.local_tiers = true;
            job.spec.extra.retain(|e| e != "local-tiers");
        }
        for id in 0..nodes + spares {
            if id == nodes && spares > 0 {
                // Spares join once a coordinator is elected among the nodes that run ranks:
                // a spare can coordinate too, but then killing the coordinator loses no rank
                // and the tests of a lost coordinator's ranks would test nothing.
                let t0 = Instant::now();
                while rt()
                    .block_on(job_state(&job.etcd.url, &format!("/ckpt/{run}")))
                    .map_or(true, |s| s.leader.is_none())
                {
                    assert!(t0.elapsed() < Duration::from_secs(30), "no coordinator");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            let node = job.spawn_agent(id, "");
            job.nodes.push(node);
        }
        job
    }

    /// Start the agent of node `id` (its output files named with `tag`).
    fn spawn_agent(&self, id: u32, tag: &str) -> Node {
        let (dir, spec) = (&self.dir, &self.spec);
        let out = dir.path().join(format!("agent-{id}{tag}.json"));
        let err = dir.path().join(format!("agent-{id}{tag}.err"));
        let child = Command::new(bin("ckpt", "ckpt"))
            .arg("--store")
            .arg(dir.path().join("store"))
            .args([
                "--json",
                "-v",
                "agent",
                "--etcd",
                &self.etcd.url,
                "--run",
                &self.run,
            ])
            .args([
                "--node",
                &id.to_string(),
                "--nodes",
                &spec.nodes.to_string(),
            ])
            .args([
                "--spares",
                &spec.spares.to_string(),
                "--layout",
                &spec.layout,
            ])
            .args(["--lease-ttl", "2s", "--heartbeat-timeout", "3s"])
            .args([
                "--stop-grace",
                "2s",
                "--backoff",
                "100ms",
                "--max-restarts",
                "4",
            ])
            .args(["--join-timeout", "30s", "--addr", "127.0.0.1"])
            .args(&spec.extra)
            .args(
                spec.local_tiers
                    .then(|| ["--local-tier".into(), self.tier(id).into_os_string()])
                    .into_iter()
                    .flatten(),
            )
            .arg("--logs")
            .arg(dir.path().join(format!("logs/node-{id}")))
            .arg("--")
            .arg(bin("ckpt-train", "ckpt-train"))
            .args(["--steps", &STEPS.to_string(), "--ckpt-every", "4"])
            // 50 steps of at least 120 ms: the kill after step 8 lands well before the end
            // even when the machine is busy (a job that finished first has nothing to
            // recover).
            .args(["--params", PARAMS, "--seed", "5"])
            .args(["--step-time-ms", &spec.step_ms.to_string()])
            .args(&spec.rank_extra)
            .env("CKPT_LOG", "warn")
            // Plain log lines (tests read the replica agents' "snapshot held").
            .env("NO_COLOR", "1")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            // Its own process group: a machine of its own, killed as a whole.
            .process_group(0)
            .spawn()
            .unwrap();
        Node {
            id,
            child,
            out,
            err,
        }
    }

    /// Start node `id`'s agent again (the machine was repaired), in place of the killed one.
    fn restart_node(&mut self, id: u32) {
        let node = self.spawn_agent(id, "-again");
        let i = self.nodes.iter().position(|n| n.id == id).unwrap();
        self.nodes[i] = node;
    }

    /// Node `id`'s local tier (with `local-tiers`).
    fn tier(&self, id: u32) -> PathBuf {
        self.dir.path().join(format!("tier-{id}"))
    }

    fn prefix(&self) -> String {
        format!("/ckpt/{}", self.run)
    }

    fn state(&self) -> JobState {
        rt().block_on(job_state(&self.etcd.url, &self.prefix()))
            .unwrap()
    }

    fn committed(&self) -> Vec<u64> {
        let store = ckpt_store::open(self.dir.path().join("store").to_str().unwrap()).unwrap();
        rt().block_on(store.log().committed_steps(&self.run))
            .unwrap_or_default()
    }

    fn logs(&self) -> String {
        let mut s = String::new();
        for n in &self.nodes {
            s += &format!(
                "--- agent {} stderr:\n{}\n",
                n.id,
                std::fs::read_to_string(&n.err).unwrap_or_default()
            );
        }
        s
    }

    /// Wait until generation 0 runs on every node and has committed step `step`.
    fn wait_for_step(&self, step: u64) -> JobState {
        let t0 = Instant::now();
        loop {
            let st = self.state();
            if st.plan.is_some() && self.committed().iter().any(|&s| s >= step) {
                assert!(
                    st.done.is_none(),
                    "the job finished before the test could interrupt it\n{}",
                    self.logs()
                );
                return st;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(45),
                "step {step} was not committed in time\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL a node's whole process group: its agent and its ranks.
    fn kill_node(&mut self, id: u32) {
        let n = self.nodes.iter_mut().find(|n| n.id == id).unwrap();
        signal_group(n.child.id(), libc::SIGKILL);
        let st = n.child.wait().unwrap();
        assert!(!st.success());
    }

    /// Wait for every agent but `killed` to exit; their reports.
    fn reports(&mut self, killed: u32) -> Vec<Value> {
        let t0 = Instant::now();
        let mut out = Vec::new();
        for i in 0..self.nodes.len() {
            if self.nodes[i].id == killed {
                continue;
            }
            let status = loop {
                if let Some(s) = self.nodes[i].child.try_wait().unwrap() {
                    break s;
                }
                // The job is killed by `Drop` on the way out.
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "agent {} did not finish in time\n{}",
                    self.nodes[i].id,
                    self.logs()
                );
                std::thread::sleep(Duration::from_millis(20));
            };
            let n = &self.nodes[i];
            let text = std::fs::read_to_string(&n.out).unwrap();
            let err = std::fs::read_to_string(&n.err).unwrap_or_default();
            assert!(status.success(), "agent {} failed: {text}\n{err}", n.id);
            let v: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("agent {} printed no report ({e}): {text}", n.id));
            out.push(v);
        }
        out
    }

    /// Rank 0's digest in the newest generation that printed one.
    fn final_digest(&self) -> Option<String> {
        newest_digest(
            self.nodes
                .iter()
                .map(|n| self.dir.path().join(format!("logs/node-{}", n.id))),
        )
    }

    fn recovery_log(&self) -> Vec<Value> {
        let store = ckpt_store::open(self.dir.path().join("store").to_str().unwrap()).unwrap();
        rt().block_on(ckpt_store::logs::read_log(
            &store,
            &self.run,
            ckpt_store::logs::EVENTS,
        ))
        .unwrap()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Ok(None) = n.child.try_wait() {
                signal_group(n.child.id(), libc::SIGKILL);
                let _ = n.child.wait();
            }
        }
    }
}

/// What every test checks after the kill: one plan per generation, survivors that agree on
/// the last one, the killed node out of it, and the reference digest.
fn check_agreement(job: &Job, reports: &[Value], killed: u32, want: &str) -> JobState {
    let st = job.state();
    let done = st.done.as_ref().expect("a done record");
    assert!(done.ok, "{done:?}");
    // One plan per generation, each written once; the current plan is the newest.
    assert!(st.plans.len() >= 2, "plans {:?}", st.plans.keys());
    for (g, (p, version)) in &st.plans {
        assert_eq!(
            *version, 1,
            "plan of generation {g} was written {version} times"
        );
        assert_eq!(p.generation, *g);
    }
    let (last_gen, (last, _)) = st.plans.iter().next_back().unwrap();
    assert_eq!(st.plan.as_ref(), Some(last));
    assert!(
        last.assignments.iter().all(|a| a.node != killed),
        "the killed node {killed} is still in {last:?}"
    );
    assert!(last.excluded.contains(&killed), "{last:?}");
    // The survivors were stopped (SIGTERM) and restarted from a checkpoint before the end.
    let (first_gen, _) = st.plans.iter().next().unwrap();
    assert!(
        st.signals
            .get(first_gen)
            .is_some_and(|s| !s.ranks.is_empty()),
        "generation {first_gen} was not stopped: {:?}",
        st.signals
    );
    assert!(
        last.resume_from.is_some_and(|s| s < STEPS),
        "resumed from {:?}",
        last.resume_from
    );
    // Every survivor acted on the same plans, in the same order, ending with the newest (a
    // spare that joined late saw only the newer ones).
    let history: Vec<(u64, String)> = st
        .plans
        .iter()
        .map(|(g, (p, _))| (*g, p.layout.clone()))
        .collect();
    let seen = |r: &Value| -> Vec<(u64, String)> {
        r["generations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                (
                    g["generation"].as_u64().unwrap(),
                    g["layout"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    for r in reports {
        assert_eq!(
            seen(r).last(),
            Some(&(*last_gen, last.layout.clone())),
            "node {} ended on another plan: {r}",
            r["node"]
        );
        assert_eq!(r["layout"], last.layout.as_str());
        assert!(
            !seen(r).is_empty() && history.ends_with(&seen(r)),
            "node {} saw plans {:?}, the job had {history:?}",
            r["node"],
            seen(r)
        );
    }
    let got = job.final_digest().expect("rank 0 printed a digest");
    assert_eq!(
        got, want,
        "the recovered job's final state differs from an uninterrupted run"
    );
    st
}

#[test]
fn a_killed_node_is_replaced_by_a_smaller_layout_and_the_job_finishes() {
    ckpt_store::require!(
        ckpt_store::testing::Need::Etcd,
        "a_killed_node_is_replaced_by_a_smaller_layout_and_the_job_finishes"
    );
    let dir = tempfile::tempdir().unwrap();
    let want = reference_digest(dir.path(), STEPS, PARAMS);
    let t0 = Instant::now();
    // Steps of 300 ms: the kill lands between two checkpoints (step 8 committed, step 12's
    // snapshot not yet taken). An agent keeps one snapshot a rank, the newest: with 120 ms
    // steps a loaded machine let step 12's snapshots reach the agents before the kill, step
    // 12 never committed, and the restore of step 8 found nothing of it in their memory.
    let mut job = Job::start_with(
        "etcd-node",
        3,
        0,
        "dp=3",
        &["--peer-replicas", "step-ms=300"],
    );
    let st = job.wait_for_step(8);
    let leader = st.leader.expect("a coordinator");
    let victim = (0..3).rev().find(|&n| n != leader).unwrap();
    // The buddy copy follows the victim's persist asynchronously (its rank hands the last
    // chunks to its agent after the manifest, and the agent copies after that): wait until
    // another node's agent holds the victim's snapshot of the committed step.
    let newest = job.committed().into_iter().max().unwrap();
    let copied = || {
        job.nodes.iter().filter(|n| n.id != victim).any(|n| {
            let log = std::fs::read_to_string(&n.err).unwrap_or_default();
            ckpt_tests::agent_held(&log, victim, victim, newest)
        })
    };
    while !copied() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no agent holds node {victim}'s snapshot of step {newest}\n{}",
            job.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let killed_at = Instant::now();
    job.kill_node(victim);
    let reports = job.reports(victim);
    let recovered = killed_at.elapsed();
    let st = check_agreement(&job, &reports, victim, &want);
    // Two generations: dp=3 on 3 nodes, then dp=2 on the two survivors.
    let layouts: Vec<&str> = st.plans.values().map(|(p, _)| p.layout.as_str()).collect();
    assert_eq!(layouts, ["dp=3,tp=1,pp=1", "dp=2,tp=1,pp=1"]);
    // One coordinator throughout, and it was a survivor.
    let coordinators: Vec<&Value> = reports
        .iter()
        .filter(|r| r["coordinated"] == true)
        .collect();
    assert_eq!(coordinators.len(), 1, "{reports:?}");
    assert_eq!(coordinators[0]["node"], leader);
    assert!(st.plans.values().all(|(p, _)| p.leader == leader));
    // The recovery log says which node was lost, how, and what was decided.
    let log = job.recovery_log();
    let failure = log
        .iter()
        .find(|r| r["kind"] == "failure")
        .expect("a failure record");
    assert_eq!(failure["node"], victim, "{failure}");
    assert_eq!(failure["how"], "node", "{failure}");
    let detection = failure["detection_s"].as_f64().unwrap();
    assert!(
        (0.5..=6.0).contains(&detection),
        "node loss detected {detection} s after its last heartbeats (lease 2 s)"
    );
    assert!(
        log.iter()
            .any(|r| r["kind"] == "recovery" && r["layout"] == "dp=2,tp=1,pp=1"),
        "{log:#?}"
    );
    // Peer replicas: the restarted ranks read from the surviving agents' memory, including
    // the shards the lost node wrote (its copy lives on the next node's agent); what the
    // survivors overwrote with newer snapshots while the loss went undetected comes from the
    // store.
    let from = st.plan.as_ref().unwrap().resume_from;
    let restores: Vec<&Value> = log
        .iter()
        .filter(|r| r["kind"] == "restore" && r["step"].as_u64() == from)
        .collect();
    assert_eq!(restores.len(), 2, "{log:#?}");
    let store = ckpt_store::open(job.dir.path().join("store").to_str().unwrap()).unwrap();
    let (commit, _) = rt()
        .block_on(store.log().read_commit(&job.run, from.unwrap()))
        .unwrap();
    let lost: u64 = commit
        .tensors
        .iter()
        .flat_map(|t| t.shards.iter().map(move |s| (t, s)))
        .filter(|(_, s)| s.rank == victim)
        .map(|(t, s)| s.bbox.numel() * t.dtype.size() as u64)
        .sum();
    assert!(lost > 0, "the lost node wrote nothing of step {from:?}");
    for r in &restores {
        let peers = r["bytes_from_peers"].as_u64().unwrap();
        assert!(
            peers >= lost,
            "{peers} bytes from peers, but the lost node's {lost} bytes alone are held by its \
             buddy: {r}"
        );
        // Every agent runs on this machine: the ranks mapped their memory.
        assert_eq!(
            r["bytes_from_peers_mapped"], r["bytes_from_peers"],
            "not all read out of the agents' mapped memory: {r}"
        );
    }
    eprintln!(
        "killed node {victim} (coordinator {leader}); detected after {detection:.2} s; \
         resumed from step {:?}; survivors finished {:.2} s after the kill; test {:.1} s",
        st.plan.as_ref().unwrap().resume_from,
        recovered.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn a_killed_coordinator_is_succeeded_and_a_spare_takes_its_place() {
    ckpt_store::require!(
        ckpt_store::testing::Need::Etcd,
        "a_killed_coordinator_is_succeeded_and_a_spare_takes_its_place"
    );
    let dir = tempfile::tempdir().unwrap();
    let want = reference_digest(dir.path(), STEPS, PARAMS);
    let t0 = Instant::now();
    // 3 nodes run dp=3; node 3 is a spare.
    let mut job = Job::start("etcd-leader", 3, 1, "dp=3");
    let st = job.wait_for_step(8);
    let leader = st.leader.expect("a coordinator");
    let killed_at = Instant::now();
    job.kill_node(leader);
    let reports = job.reports(leader);
    let recovered = killed_at.elapsed();
    let st = check_agreement(&job, &reports, leader, &want);
    // The spare replaced the lost node: the layout is kept.
    let (_, (last, _)) = st.plans.iter().next_back().unwrap();
    assert_eq!(last.layout, "dp=3,tp=1,pp=1");
    assert!(last.assignments.iter().any(|a| a.node == 3), "{last:?}");
    // Exactly one survivor took over, and it published the new plan.
    let successors: Vec<u64> = reports
        .iter()
        .filter(|r| r["coordinated"] == true)
        .map(|r| r["node"].as_u64().unwrap())
        .collect();
    assert_eq!(successors.len(), 1, "{reports:?}");
    assert_eq!(last.leader as u64, successors[0]);
    assert_eq!(st.plans.values().next().unwrap().0.leader, leader);
    let log = job.recovery_log();
    let takeover = log
        .iter()
        .find(|r| r["kind"] == "takeover")
        .expect("a takeover record");
    assert_eq!(takeover["previous"], leader, "{takeover}");
    assert_eq!(takeover["node"], successors[0]);
    assert!(
        log.iter()
            .any(|r| r["kind"] == "failure" && r["node"] == leader && r["how"] == "node"),
        "{log:#?}"
    );
    eprintln!(
        "killed the coordinator's node {leader}; node {} took over; resumed from step {:?}; \
         survivors finished {:.2} s after the kill; test {:.1} s",
        successors[0],
        last.resume_from,
        recovered.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn a_stopped_rank_is_found_by_the_heartbeats_its_agent_no_longer_relays() {
    ckpt_store::require!(
        ckpt_store::testing::Need::Etcd,
        "a_stopped_rank_is_found_by_the_heartbeats_its_agent_no_longer_relays"
    );
    let dir = tempfile::tempdir().unwrap();
    let want = reference_digest(dir.path(), STEPS, PARAMS);
    let mut job = Job::start("etcd-hang", 3, 0, "dp=3");
    let st = job.wait_for_step(8);
    let leader = st.leader.expect("a coordinator");
    let victim = (0..3).rev().find(|&n| n != leader).unwrap();
    let node = victim.to_string();
    let ranks: Vec<u32> = find_processes(&[("CKPT_RUN", "etcd-hang"), ("CKPT_NODE", &node)])
        .into_iter()
        .filter(|(_, env)| env_of(env, "CKPT_GENERATION") == Some("0"))
        .map(|(pid, _)| pid)
        .collect();
    assert_eq!(ranks.len(), 1, "rank processes of node {victim}: {ranks:?}");
    let stopped_at = Instant::now();
    signal(ranks[0], libc::SIGSTOP);
    // The agent is alive: it takes part to the end, with no ranks in the new plan.
    let reports = job.reports(u32::MAX);
    let st = check_agreement(&job, &reports, victim, &want);
    let log = job.recovery_log();
    let failure = log
        .iter()
        .find(|r| r["kind"] == "failure")
        .expect("a failure record");
    assert_eq!(failure["how"], "heartbeat", "{failure}");
    assert_eq!(failure["node"], victim, "{failure}");
    // Detected within the timeout (3 s), plus a beat interval and a relay interval (0.3 s
    // each), plus slack for a loaded 2-core machine.
    let detection = failure["detection_s"].as_f64().unwrap();
    assert!(
        (3.0..=4.6).contains(&detection),
        "detected {detection} s after the last relayed heartbeat"
    );
    let stopped_node = reports
        .iter()
        .find(|r| r["node"] == victim)
        .expect("the stopped rank's agent reported");
    assert_eq!(stopped_node["generations"].as_array().unwrap().len(), 2);
    eprintln!(
        "stopped rank on node {victim}; detected after {detection:.2} s without heartbeats; \
         resumed from step {:?}; finished {:.2} s after the SIGSTOP",
        st.plan.as_ref().unwrap().resume_from,
        stopped_at.elapsed().as_secs_f64()
    );
}

/// Issue 19 §1 across machines: a killed node's agent registers again (the machine was
/// repaired); the coordinator grows the job back onto it at the next commit, and the job ends
/// bit-identical to an uninterrupted run.
#[test]
fn a_lost_node_that_registers_again_grows_the_job_back() {
    ckpt_store::require!(
        ckpt_store::testing::Need::Etcd,
        "a_lost_node_that_registers_again_grows_the_job_back"
    );
    let dir = tempfile::tempdir().unwrap();
    let want = reference_digest(dir.path(), STEPS, PARAMS);
    // Steps of 250 ms: the job is still running when the node comes back.
    let mut job = Job::start_with("etcd-grow", 2, 0, "dp=2", &["step-ms=250"]);
    let st = job.wait_for_step(8);
    let leader = st.leader.expect("a coordinator");
    let victim = 1 - leader;
    job.kill_node(victim);
    // The job shrinks onto the survivor ...
    let t0 = Instant::now();
    while job
        .state()
        .plan
        .is_none_or(|p| p.layout != "dp=1,tp=1,pp=1")
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the job did not shrink\n{}",
            job.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // ... and its node comes back.
    job.restart_node(victim);
    let reports = job.reports(u32::MAX);
    assert_eq!(reports.len(), 2, "{reports:?}");
    let st = job.state();
    let done = st.done.as_ref().expect("a done record");
    assert!(done.ok, "{done:?}");
    let layouts: Vec<&str> = st.plans.values().map(|(p, _)| p.layout.as_str()).collect();
    assert_eq!(
        layouts,
        ["dp=2,tp=1,pp=1", "dp=1,tp=1,pp=1", "dp=2,tp=1,pp=1"],
        "{}",
        job.logs()
    );
    let last = st.plan.as_ref().unwrap();
    assert!(
        last.assignments.iter().any(|a| a.node == victim),
        "the returned node {victim} runs no rank: {last:?}"
    );
    let log = job.recovery_log();
    let grow = log
        .iter()
        .find(|r| r["kind"] == "grow")
        .unwrap_or_else(|| panic!("no grow record: {log:#?}"));
    assert_eq!(grow["layout"], "dp=2,tp=1,pp=1", "{grow}");
    assert!(
        grow["returned"]
            .as_array()
            .is_some_and(|r| r.contains(&victim.into())),
        "{grow}"
    );
    assert_eq!(
        job.final_digest().as_deref(),
        Some(want.as_str()),
        "the job that shrank and grew back differs from an uninterrupted run"
    );
}

/// Issue 28 across machines: each node has its own local tier. Its first rank commits the
/// node's ranks there (a node commit: no tier ever holds a step's commit), each node drains its
/// ranks to the store, and the drain that lands the last node's ranks commits the step there.
/// A node is killed with its tier: the survivors resume from the store's newest step, their
/// tiers serving their chunks, and finish bit-identical to an uninterrupted run.
#[test]
fn machines_with_local_tiers_commit_their_ranks_there_and_a_lost_one_loses_only_its_tier() {
    ckpt_store::require!(
        ckpt_store::testing::Need::Etcd,
        "machines_with_local_tiers_commit_their_ranks_there_and_a_lost_one_loses_only_its_tier"
    );
    let dir = tempfile::tempdir().unwrap();
    let want = reference_digest(dir.path(), STEPS, PARAMS);
    let mut job = Job::start_with("etcd-tiers", 3, 0, "dp=3", &["local-tiers", "step-ms=300"]);
    let st = job.wait_for_step(8);
    let leader = st.leader.expect("a coordinator");
    let victim = (0..3).rev().find(|&n| n != leader).unwrap();
    job.kill_node(victim);
    let reports = job.reports(victim);
    let st = check_agreement(&job, &reports, victim, &want);
    let store = ckpt_store::open(job.dir.path().join("store").to_str().unwrap()).unwrap();
    let committed = job.committed();
    let newest = *committed.last().expect("steps committed on the store");
    let last = st.plan.as_ref().unwrap();
    for id in 0..3u32 {
        let tier = ckpt_store::open(job.tier(id).to_str().unwrap()).unwrap();
        // A node's tier holds its own ranks' commits, never a step's.
        assert!(
            rt().block_on(tier.log().committed_steps(&job.run))
                .unwrap()
                .is_empty(),
            "node {id}'s tier committed a whole step"
        );
        let here = rt()
            .block_on(tier.log().node_committed_steps(&job.run))
            .unwrap();
        assert!(!here.is_empty(), "node {id}'s tier committed nothing");
        if id == victim {
            continue;
        }
        // A survivor's tier holds the final step, committed for the ranks it ran last.
        let cs = rt()
            .block_on(tier.log().read_node_commits(&job.run, newest))
            .unwrap_or_else(|e| panic!("node {id} has no node commit of step {newest}: {e}"));
        assert_eq!(cs.len(), 1, "node {id}: {cs:?}");
        let c = &cs[0];
        let mine: Vec<u32> = last
            .assignments
            .iter()
            .filter(|a| a.node == id)
            .map(|a| a.rank)
            .collect();
        assert_eq!(c.rank_numbers(), mine, "node {id}");
        assert_eq!(c.generation, last.generation);
        // Retention: the tier keeps its newest 2 (the default).
        assert!(here.len() <= 3, "node {id} keeps {here:?}");
    }
    // Every step on the store is whole: its manifests from every node, its chunks there.
    let v = rt()
        .block_on(store.verify(&ckpt_store::VerifyScope::Run(job.run.clone()), None))
        .unwrap();
    assert!(v.is_clean(), "{v:?}");
    // The survivors' restores took what their tiers held from there.
    let from = last.resume_from;
    let log = job.recovery_log();
    let restores: Vec<&Value> = log
        .iter()
        .filter(|r| r["kind"] == "restore" && r["step"].as_u64() == from)
        .collect();
    assert_eq!(restores.len(), 2, "{log:#?}");
    let local: u64 = restores
        .iter()
        .map(|r| r["bytes_from_local"].as_u64().unwrap_or(0))
        .sum();
    assert!(local > 0, "no restore read its node's tier: {restores:#?}");
    // `ckpt ls --local-tier` says which ranks a node's tier holds.
    let out = Command::new(bin("ckpt", "ckpt"))
        .arg("--store")
        .arg(job.dir.path().join("store"))
        .args(["--json", "ls", &job.run, "--local-tier"])
        .arg(job.tier(leader))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["step"].as_u64() == Some(newest))
        .unwrap_or_else(|| panic!("no row of step {newest}: {v}"));
    assert_eq!(row["tier"]["local"], true, "{row}");
    assert_eq!(row["tier"]["remote"], true, "{row}");
    assert!(row["tier"]["node_ranks"].is_array(), "{row}");
}

/// The steps node `id`'s tier committed for its ranks in generation `g`.
fn node_steps(job: &Job, id: u32, g: u64) -> Vec<u64> {
    let tier = ckpt_store::open(job.tier(id).to_str().unwrap()).unwrap();
    let steps = rt()
        .block_on(tier.log().node_committed_steps(&job.run))
        .unwrap_or_default();
    steps
        .into_iter()
        .filter(|&s| {
            rt().block_on(tier.log().read_node_commits(&job.run, s))
                .is_ok_and(|cs| cs.iter().any(|c| c.generation == g))
        })
        .collect()
}

/// A rank process killed on a job of two machines with their own tiers, while no step has
/// reached the store yet (the ranks' remote commits hang): when the generation is stopped,
/// each node drains its ranks of the newest steps it committed locally, the last one's drain
/// commits the newest step both had, and the coordinator resumes from it (not from scratch),
/// finishing bit-identical to an uninterrupted run. (With `--drain-wait 0s` it resumes from
/// scratch: checked by hand.)
#[test]
fn a_rank_killed_on_machines_with_local_tiers_resumes_from_what_every_tier_committed() {
    ckpt_store::require!(
        ckpt_store::testing::Need::Etcd,
        "a_rank_killed_on_machines_with_local_tiers_resumes_from_what_every_tier_committed"
    );
    let dir = tempfile::tempdir().unwrap();
    let want = reference_digest(dir.path(), STEPS, PARAMS);
    // Each rank process's first commit on the store hangs 12 s: the ranks' own drains land
    // nothing before the crash.
    let mut job = Job::start_with(
        "etcd-tier-crash",
        2,
        0,
        "dp=2",
        &[
            "local-tiers",
            "step-ms=300",
            "rank:--failpoints=before_commit=sleep(12000)@1",
        ],
    );
    let t0 = Instant::now();
    let (a, b) = loop {
        let (a, b) = (node_steps(&job, 0, 0), node_steps(&job, 1, 0));
        if a.last().is_some_and(|&s| s >= 8) && b.last().is_some_and(|&s| s >= 8) {
            break (a, b);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(45),
            "the tiers did not commit step 8 in time: {a:?} {b:?}\n{}",
            job.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        job.committed().is_empty(),
        "a step reached the store on its own; the test would test nothing"
    );
    let victim = 1u32;
    let ranks: Vec<u32> = find_processes(&[("CKPT_RUN", "etcd-tier-crash"), ("CKPT_NODE", "1")])
        .into_iter()
        .filter(|(_, env)| env_of(env, "CKPT_GENERATION") == Some("0"))
        .map(|(pid, _)| pid)
        .collect();
    assert_eq!(ranks.len(), 1, "rank processes of node 1: {ranks:?}");
    signal(ranks[0], libc::SIGKILL);
    let reports = job.reports(u32::MAX);
    let st = check_agreement(&job, &reports, victim, &want);
    // Resumed from a step both tiers held when the rank died (newer ones node 0 committed
    // alone may not land), which got to the store only through the drains of the stop.
    let from = st
        .plan
        .as_ref()
        .unwrap()
        .resume_from
        .expect("resumed from a step");
    let both = a.iter().filter(|s| b.contains(s)).max().copied().unwrap();
    assert!(
        from >= both,
        "resumed from {from}; both tiers had {both} ({a:?}, {b:?})"
    );
    let drained: Vec<(u32, &ckpt_recovery::agent::DrainedMsg)> = st
        .drained
        .iter()
        .filter(|((g, _), _)| *g == 0)
        .map(|((_, n), m)| (*n, m))
        .collect();
    assert_eq!(
        drained.len(),
        2,
        "both nodes drained generation 0: {:?}",
        st.drained
    );
    assert!(
        drained.iter().any(|(_, m)| m.committed == Some(from)),
        "no node's drain committed step {from}: {drained:?}"
    );
    let store = ckpt_store::open(job.dir.path().join("store").to_str().unwrap()).unwrap();
    let (rec, _) = rt()
        .block_on(store.log().read_commit(&job.run, from))
        .unwrap();
    assert_eq!(rec.generation, 0, "step {from} is generation 0's");
    assert_eq!(rec.layout.world(), 2);
}
