//! Each byte read once per node (issue 17 §2): the ranks of a node that restore the same
//! replicated state share one fetch of each chunk through the node's cache
//! (`ckpt_store::NodeCache`), so the bytes the node reads from the store stay within 1.05× of
//! the distinct bytes it needs. Real rank processes under the local supervisor.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use ckpt_recovery::records::{Event, Logged};
use ckpt_recovery::{Config, JobOptions, SupervisorOptions, Topology};
use ckpt_tests::{bin, spawn_supervisor};

const PARAMS: &str = "400K";
const LAYOUT: &str = "dp=8";

/// `ckpt-train` as the supervisor launches it.
fn train_cmd(steps: u64) -> Vec<String> {
    [
        bin("ckpt-train", "ckpt-train").to_string_lossy().as_ref(),
        "--steps",
        &steps.to_string(),
        "--ckpt-every",
        "1000",
        "--params",
        PARAMS,
        "--seed",
        "9",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Stored bytes of the distinct chunks `step` of `run` references: about what one node
/// restoring the whole replicated state needs to read.
fn distinct_stored(store: &ckpt_store::Store, run: &str, step: u64) -> u64 {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let r = ckpt_store::StepReader::open(store, run, step)
            .await
            .unwrap();
        let mut seen = HashMap::new();
        for rank in 0..r.commit().layout.world() {
            let m = r.manifest(rank).await.unwrap();
            for c in m.chunk_refs() {
                seen.insert(c.id, u64::from(c.stored));
            }
        }
        seen.values().sum()
    })
}

/// Save step 4 of an 8-way replicated run, then restore it under the supervisor on `nodes`
/// nodes of `8 / nodes` rank processes; per node: (bytes read from the store, bytes served by
/// the node's cache), and the distinct stored bytes of the step.
fn restore_on(nodes: u32) -> (BTreeMap<u32, (u64, u64)>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let store_path = dir.path().join("store");
    let run = "shared";
    let out = std::process::Command::new(bin("ckpt-train", "ckpt-train"))
        .arg("--store")
        .arg(&store_path)
        .args(["--run", run, "--layout", LAYOUT, "--params", PARAMS])
        .args(["--seed", "9", "--steps", "4", "--ckpt-every", "4"])
        .env("CKPT_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let per_node = 8 / nodes;
    let topo = Topology {
        nodes,
        ranks_per_node: per_node,
        spares: 0,
    };
    let mut cfg = Config::new(topo, LAYOUT.parse().unwrap());
    cfg.max_restarts = 0;
    cfg.heartbeat_timeout = Duration::from_secs(20);
    cfg.startup_timeout = Duration::from_secs(120);
    let report = spawn_supervisor(SupervisorOptions {
        job: JobOptions {
            store_url: store_path.to_string_lossy().to_string(),
            run: run.into(),
            config: cfg,
            command: train_cmd(5),
            logs_dir: Some(dir.path().join("logs")),
            heartbeat_interval: Duration::from_millis(100),
            open: Default::default(),
            sdc_check: None,
            local_tier: None,
        },
        replica_agent: None,
        repair_after: None,
    })
    .join()
    .unwrap();
    assert!(report.ok, "{}: {:#?}", report.reason, report.records);

    let store = ckpt_store::open(store_path.to_str().unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let events: Vec<Logged<Event>> = rt
        .block_on(ckpt_recovery::records::read_records(&store, run))
        .unwrap();
    let mut by_node: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    let mut ranks = 0;
    for e in &events {
        if let Event::Restore(r) = &e.record {
            assert_eq!(r.step, 4, "{r:?}");
            let n = by_node.entry(r.rank / per_node).or_default();
            n.0 += r.bytes_from_store;
            n.1 += r.bytes_from_node;
            ranks += 1;
        }
    }
    assert_eq!(ranks, 8, "every rank restores once: {events:#?}");
    (by_node, distinct_stored(&store, run, 4))
}

fn check(nodes: u32) {
    let (by_node, distinct) = restore_on(nodes);
    assert_eq!(by_node.len(), nodes as usize, "{by_node:?}");
    for (node, (from_store, from_node)) in &by_node {
        let ratio = *from_store as f64 / distinct as f64;
        eprintln!(
            "{nodes} node(s) x {} ranks: node {node} read {from_store} bytes from the store for \
             {distinct} distinct ({ratio:.3}x); {from_node} bytes came from the node's cache",
            8 / nodes
        );
        assert!(
            ratio <= 1.05,
            "node {node} read {ratio:.2}x the distinct bytes it needs from the store"
        );
        // (Not exactly 1: per-rank blobs of other ranks are never read.)
        assert!(
            ratio >= 0.9,
            "node {node} read {ratio:.2}x what the step holds"
        );
        assert!(
            *from_node > 0,
            "no rank of node {node} was served by the node's cache"
        );
    }
}

#[test]
fn eight_ranks_of_one_node_read_each_byte_from_the_store_once() {
    check(1);
}

#[test]
fn two_nodes_of_four_ranks_read_each_byte_once_per_node() {
    check(2);
}

/// A node cache directory planted by someone else (another user's, a link, open to all) is
/// refused; the restore reads the store itself.
#[test]
fn a_planted_cache_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("elsewhere");
    std::fs::create_dir(&target).unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let e = ckpt_store::NodeCache::open(&link).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = ckpt_store::NodeCache::open(&open).unwrap_err();
    assert!(e.to_string().contains("open to other users"), "{e}");
    let ok = dir.path().join("mine");
    assert!(ckpt_store::NodeCache::open(&ok).is_ok());
    assert!(Path::new(&ok).is_dir());
}
