//! The sentinel (issue 29) end to end, real processes: `ckpt-train` ranks under the local
//! supervisor, one of them corrupted by `--inject-bitflip NODE@STEP` (one bit of a replicated
//! tensor in its live state, right after that step's update). With dp=3, `--sdc-check full`
//! and `--on-replica-mismatch rollback`, the next checkpoint's replicas disagree, the
//! committer names the rank and node, the supervisor keeps the node out, rolls back to the
//! newest step whose replicas agreed, and the job ends with the digest of an uninterrupted
//! run. With dp=2 and `warn`, the event names both sides and the run finishes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ckpt_recovery::records::{Event, read_records};
use ckpt_recovery::{SupervisorOptions, Topology};
use ckpt_store::{MismatchPolicy, SdcCheck};
use ckpt_tests::{bin, final_digest, reference_digest, spawn_supervisor, supervised};

const PARAMS: &str = "40K";

fn options(
    store: &Path,
    run: &str,
    nodes: u32,
    layout: &str,
    policy: MismatchPolicy,
    cmd: Vec<String>,
    logs: PathBuf,
) -> SupervisorOptions {
    let topo = Topology {
        nodes,
        ranks_per_node: 1,
        spares: 0,
    };
    let mut o = supervised(store, run, topo, layout, cmd, logs);
    o.job.config.max_restarts = 3;
    o.job.config.heartbeat_timeout = Duration::from_secs(5);
    o.job.config.on_replica_mismatch = policy;
    o.job.sdc_check = Some(SdcCheck::Full);
    o
}

/// `ckpt-train` for `steps` steps, a checkpoint every `every`, with a bit flipped on node
/// `node` after step `at`.
fn train_cmd(steps: u64, every: u64, node: u32, at: u64) -> Vec<String> {
    let b = bin("ckpt-train", "ckpt-train");
    [
        b.to_string_lossy().as_ref(),
        "--steps",
        &steps.to_string(),
        "--ckpt-every",
        &every.to_string(),
        "--params",
        PARAMS,
        "--seed",
        "5",
        "--step-time-ms",
        "30",
        "--inject-bitflip",
        &format!("{node}@{at}"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn events(store: &Path, run: &str) -> Vec<Event> {
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(read_records::<Event>(&st, run))
        .unwrap()
        .into_iter()
        .map(|l| l.record)
        .collect()
}

#[test]
fn a_bit_flipped_on_one_of_three_replicas_rolls_back_keeps_the_node_out_and_ends_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let want = reference_digest(dir.path(), 40, PARAMS);
    let store = dir.path().join("store");
    let run = "sdc3";
    // Rank 1 runs on node 1: its copy of the replicated weights goes wrong after step 12;
    // the checkpoint of step 15 finds it.
    let opts = options(
        &store,
        run,
        3,
        "dp=3",
        MismatchPolicy::Rollback,
        train_cmd(40, 5, 1, 12),
        dir.path().join("logs"),
    );
    let report = spawn_supervisor(opts).join().unwrap();
    assert!(report.ok, "{}", report.reason);
    let rec = |kind: &str| -> Vec<&serde_json::Value> {
        report
            .records
            .iter()
            .filter(|r| r["kind"] == kind)
            .collect()
    };
    let f = rec("failure");
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0]["how"], "replica_mismatch", "{}", f[0]);
    assert_eq!(
        (f[0]["rank"].as_u64(), f[0]["node"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(
        f[0]["detail"].as_str().unwrap().contains("step 15"),
        "{}",
        f[0]
    );
    let kept = rec("node_kept_out");
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0]["node"], 1);
    assert!(
        kept[0]["reason"]
            .as_str()
            .unwrap()
            .contains("silent data corruption")
    );
    assert!(
        rec("step_unusable").iter().any(|u| u["step"] == 15),
        "{:?}",
        rec("step_unusable")
    );
    let recovery = rec("recovery");
    assert_eq!(
        recovery[0]["step"], 10,
        "rolled back to the newest agreeing step"
    );
    assert_eq!(report.layout, "dp=2,tp=1,pp=1", "node 1 is out: dp shrank");
    // The committer's event names the suspect rank and node.
    let ev = events(&store, run);
    let m = ev
        .iter()
        .find_map(|e| match e {
            Event::ReplicaMismatch(m) => Some(m),
            _ => None,
        })
        .expect("a replica_mismatch event");
    assert_eq!(m.step, 15);
    assert_eq!(
        (m.suspects.clone(), m.suspect_nodes.clone()),
        (vec![1], vec![1])
    );
    assert!(!m.mismatches.is_empty() && m.mismatched_chunks >= 1);
    // The job ends as an uninterrupted run does.
    assert_eq!(final_digest(&dir.path().join("logs")).unwrap(), want);
    // What is committed now verifies, and no step's replicas disagree.
    let st = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for s in rt.block_on(st.log().committed_steps(run)).unwrap() {
        let (r, _) = rt.block_on(st.log().read_commit(run, s)).unwrap();
        assert!(
            r.replicas.as_ref().is_none_or(|r| !r.mismatched()),
            "step {s} still committed with a mismatch"
        );
    }
}

#[test]
fn a_bit_flipped_on_one_of_two_replicas_names_both_sides_and_warn_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let run = "sdc2";
    let opts = options(
        &store,
        run,
        2,
        "dp=2",
        MismatchPolicy::Warn,
        train_cmd(20, 5, 1, 7),
        dir.path().join("logs"),
    );
    let report = spawn_supervisor(opts).join().unwrap();
    assert!(report.ok, "{}", report.reason);
    assert_eq!(report.restarts, 0, "warn does not restart");
    let ev = events(&store, run);
    let mism: Vec<_> = ev
        .iter()
        .filter_map(|e| match e {
            Event::ReplicaMismatch(m) => Some(m),
            _ => None,
        })
        .collect();
    assert!(!mism.is_empty(), "no replica_mismatch event");
    let m = mism[0];
    assert_eq!((m.step, m.policy.as_str()), (10, "warn"));
    assert!(m.suspects.is_empty(), "two replicas: no majority");
    let sides = &m.mismatches[0].sides;
    assert_eq!(sides.len(), 2);
    let ranks: Vec<u32> = sides.iter().flat_map(|s| s.ranks.clone()).collect();
    let nodes: Vec<Option<u32>> = sides.iter().flat_map(|s| s.nodes.clone()).collect();
    assert_eq!(
        (ranks.len(), nodes.iter().flatten().count()),
        (2, 2),
        "{sides:?}"
    );
    assert!(m.detail.contains("no majority"), "{}", m.detail);
    // Every later checkpoint of the run still disagrees (the corruption stays in rank 1).
    assert!(mism.iter().any(|m| m.step == 20), "{mism:?}");
}
