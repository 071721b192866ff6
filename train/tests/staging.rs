//! A bounded staging pool never hangs a save: any bound down to one chunk commits and restores
//! bit-identical (real `ckpt-train` processes, one rank and several ranks as threads sharing a
//! pool), checkpointers sharing a one-chunk pool all commit, a save that cannot progress fails
//! naming what it waits for, and a process stuck in its final save exits on a second SIGTERM.

mod common;
use common::*;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_store::testing::{det_bytes, local_store, tiny_config};
use ckpt_store::{DType, Failpoints, Layout, NdBox, StepReader, Store};
use ckpt_trainer::{
    CheckpointManager, Checkpointer, CheckpointerConfig, HostTensor, ManagerConfig, PoolConfig,
    SaveState, SaveTensor, StagingPool, runtime,
};

const CHUNK: u64 = 16 << 10;

/// Run `ckpt-train` and return its digest; fails (and kills it) if it does not end in time.
fn train_within(store: &Path, run: &str, extra: &[&str], limit: Duration) -> String {
    let mut child = cmd(store, run, extra).spawn().expect("spawn ckpt-train");
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "ckpt-train {extra:?} did not finish within {limit:?} (a save hung):\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    digest_of(&check(
        child.wait_with_output().unwrap(),
        &format!("{extra:?}"),
    ))
}

fn checkpoints(path: &Path) -> Vec<serde_json::Value> {
    metrics(path)
        .into_iter()
        .filter(|v| v["kind"] == "checkpoint")
        .collect()
}

#[test]
fn any_staging_bound_commits_and_restores_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let chunk = CHUNK.to_string();
    // `cmd` runs the 60K-parameter model with 4 layers (d_model 64).
    let common = ["--layers", "4", "--chunk-size", chunk.as_str()];
    let model = ckpt_trainer::workload::ModelConfig::for_params(60_000, 4);
    // fp32 master weights and moments of the largest parameter (the embeddings).
    let largest = model
        .params()
        .iter()
        .map(|p| p.shape.iter().product::<u64>() * 4)
        .max()
        .unwrap();
    let mut reference: Option<String> = None;
    for (layout, tp, ranks) in [("dp=1", 1, 1u64), ("dp=2,tp=2", 2, 4)] {
        let name = layout.replace([',', '='], "");
        // Unbounded staging, uninterrupted, four steps: the digest every run must end with
        // (the same on every layout), and this layout's state per rank.
        let ref_metrics = dir.path().join(format!("ref-{name}.jsonl"));
        let digest = train_within(
            &dir.path().join(format!("ref-{name}")),
            "r",
            &[
                &common[..],
                &["--layout", layout, "--steps", "4", "--ckpt-every", "2"],
                &["--metrics-out", ref_metrics.to_str().unwrap()],
            ]
            .concat(),
            Duration::from_secs(120),
        );
        assert_eq!(reference.get_or_insert(digest.clone()), &digest, "{layout}");
        let state: u64 = checkpoints(&ref_metrics)
            .iter()
            .map(|v| v["bytes"].as_u64().unwrap())
            .max()
            .unwrap();
        // The rank's share of the largest tensor, halved, in whole chunks: more than one chunk
        // and less than the tensor, so the tensor is copied in pieces.
        let below = (largest / tp / 2) / CHUNK * CHUNK;
        assert!(CHUNK < below && below < largest / tp);
        assert!(state / 2 > largest / tp, "{layout}: state {state}");
        let bounds = [
            ("one chunk", CHUNK),
            ("below the largest tensor", below),
            ("half the state", state / 2),
        ];
        for (what, bound) in bounds {
            let tag = format!("{layout} {what} ({bound} bytes)");
            let store = dir.path().join(format!("s-{name}-{bound}"));
            let m = dir.path().join(format!("s-{name}-{bound}.jsonl"));
            let b = bound.to_string();
            let run = |steps: &str, resume: bool| {
                let mut a: Vec<&str> = [
                    &common[..],
                    &["--layout", layout, "--staging", &b],
                    &["--steps", steps, "--ckpt-every", "2"],
                    &["--metrics-out", m.to_str().unwrap()],
                ]
                .concat();
                if resume {
                    a.push("--resume");
                }
                train_within(&store, "r", &a, Duration::from_secs(120))
            };
            // Saves step 2 through the bounded pool, then a new process restores it and saves
            // step 4: the same bytes as the unbounded, uninterrupted run.
            run("2", false);
            assert_eq!(&run("4", true), &digest, "{tag}: digest differs");
            let cps = checkpoints(&m);
            assert_eq!(cps.len() as u64, 2 * ranks, "{tag}: {cps:?}");
            for c in &cps {
                let peak = c["staging_peak"].as_u64().unwrap();
                assert!(peak <= bound * ranks, "{tag}: staging peak {peak}");
            }
            let s = ckpt_store::open(store.to_str().unwrap()).unwrap();
            let committed = runtime().block_on(s.log().committed_steps("r")).unwrap();
            assert_eq!(committed, vec![2, 4], "{tag}");
        }
    }
}

fn read_all(store: &Store, run: &str, step: u64, name: &str) -> Vec<u8> {
    runtime().block_on(async {
        let r = StepReader::open(store, run, step).await.unwrap();
        r.read_tensor(name).await.unwrap()
    })
}

#[test]
fn ranks_sharing_a_small_pool_all_commit() {
    // Four ranks of one process share one pool; each saves a tensor of 12 chunks and small
    // tensors that go into packs (incompressible bytes stay raw). A pool of one chunk, and one
    // that holds one rank's snapshot but not two (each rank would wait for the copy to end
    // before persisting if its snapshot fits, while the others hold the rest of the pool).
    let slab = tiny_config().chunk_size;
    for (case, slabs) in [(1, 1usize), (2, 14)] {
        let (store, _d) = local_store(tiny_config());
        let pool = StagingPool::new(
            PoolConfig {
                capacity: slabs * slab,
                slab,
            },
            false,
        );
        let layout: Layout = "dp=4".parse().unwrap();
        let run = format!("shared{case}");
        let mut data = Vec::new();
        let mut cks = Vec::new();
        for r in 0..4u32 {
            let mut cfg = CheckpointerConfig::new(&run, r, layout);
            cfg.pool = Some(pool.clone());
            cfg.copy_threads = 1;
            cfg.commit_timeout = Duration::from_secs(60);
            cfg.stall_timeout = Duration::from_secs(20);
            cks.push(Checkpointer::new(store.clone(), cfg).unwrap());
            let big = det_bytes(100 + r as u64, 12 * slab + 700);
            let small: Vec<Vec<u8>> = (0..6)
                .map(|k| det_bytes(200 + 10 * r as u64 + k, 300 + 50 * k as usize))
                .collect();
            data.push((big, small));
        }
        let t0 = Instant::now();
        let handles: Vec<_> = cks
            .iter()
            .zip(&data)
            .enumerate()
            .map(|(r, (ck, (big, small)))| {
                // Small tensors first: their slab must not stay pinned by a pack while the
                // big tensor needs the pool.
                let mut tensors: Vec<SaveTensor> = small
                    .iter()
                    .enumerate()
                    .map(|(k, s)| {
                        SaveTensor::bytes(
                            &format!("small{r}.{k}"),
                            &HostTensor::from_vec(s.clone()),
                            s.len() as u64,
                        )
                    })
                    .collect();
                tensors.push(SaveTensor::bytes(
                    &format!("big{r}"),
                    &HostTensor::from_vec(big.clone()),
                    big.len() as u64,
                ));
                ck.save(
                    1,
                    SaveState {
                        tensors,
                        blobs: vec![],
                    },
                )
                .unwrap()
            })
            .collect();
        for (r, h) in handles.iter().enumerate() {
            if r == 0 {
                h.wait_committed(Duration::from_secs(60))
                    .unwrap_or_else(|e| panic!("case {case}: {e}"));
            } else {
                h.wait_persisted_within(Duration::from_secs(60))
                    .unwrap_or_else(|e| panic!("case {case} rank {r}: {e}"));
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "case {case}");
        let st = pool.stats();
        assert!(st.peak_in_use <= slabs * slab, "case {case}: {st:?}");
        for (r, (big, small)) in data.iter().enumerate() {
            assert_eq!(&read_all(&store, &run, 1, &format!("big{r}")), big);
            for (k, s) in small.iter().enumerate() {
                assert_eq!(&read_all(&store, &run, 1, &format!("small{r}.{k}")), s);
            }
        }
    }
}

#[test]
fn a_save_whose_persist_is_stuck_fails_naming_the_wait() {
    // Every chunk write hangs: the one-chunk pool never gets a slab back.
    let fs = ckpt_store::FaultyStore::new(ckpt_store::object_store::memory::InMemory::new());
    fs.handle().add(ckpt_store::Fault {
        op: ckpt_store::FaultOp::Put,
        key_contains: Some("chunks/".into()),
        nth: 0,
        action: ckpt_store::FaultAction::Delay(Duration::from_secs(3600)),
    });
    let store = Store::new(Arc::new(fs), Default::default(), "faulty://")
        .with_config(tiny_config())
        .unwrap();
    let mut cfg = CheckpointerConfig::new("stuck", 0, Layout::SINGLE);
    cfg.staging_bytes = tiny_config().chunk_size;
    cfg.stall_timeout = Duration::from_millis(500);
    let ck = Checkpointer::new(store, cfg).unwrap();
    let n = 16 * tiny_config().chunk_size as u64;
    let t = HostTensor::from_vec(det_bytes(9, n as usize));
    let t0 = Instant::now();
    let h = ck
        .save(
            1,
            SaveState {
                tensors: vec![SaveTensor::bytes("w", &t, n)],
                blobs: vec![],
            },
        )
        .unwrap();
    let e = h.wait_snapshot().unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let msg = e.to_string();
    for want in ["staging", "no progress", "\"w\"", "step 1"] {
        assert!(msg.contains(want), "{want:?} missing from: {msg}");
    }
    // The tensor is released: the loop may write it.
    t.write()[0] ^= 1;
}

#[test]
fn the_final_checkpoint_has_a_deadline() {
    let (store, _d) = local_store(tiny_config());
    let store = store.with_failpoints(Failpoints::parse("after_chunks=sleep(60000)").unwrap());
    let mut mc = ManagerConfig::new(CheckpointerConfig::new("final", 0, Layout::SINGLE));
    mc.final_deadline = Duration::from_millis(700);
    mc.final_on_sigterm = true;
    let mut m = CheckpointManager::new(store, mc).unwrap();
    let spec = ckpt_store::TensorSpec {
        name: "w".into(),
        dtype: DType::F32,
        shape: vec![4096],
        placement: ckpt_store::placement::Placement {
            order: 0,
            tp_dim: None,
            stage: ckpt_store::placement::Stage::First,
            zero: None,
        },
    };
    m.register(
        spec,
        NdBox::full(&[4096]),
        Arc::new(HostTensor::from_vec(det_bytes(3, 4096 * 4))),
    )
    .unwrap();
    m.request_stop();
    let t0 = Instant::now();
    let e = m.maybe_save(5).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(
        e.to_string().contains("step 5") && e.to_string().contains("not done within"),
        "{e}"
    );
    assert!(m.should_stop());
}

/// Start `ckpt-train` whose final checkpoint never completes (the persist sleeps at a
/// failpoint), SIGTERM it, wait until the final save is stuck, SIGTERM again: it must exit.
fn second_sigterm_ends(extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cmd(&dir.path().join("store"), "term", extra);
    c.args([
        "--steps",
        "100000",
        "--ckpt-every",
        "100000",
        "--step-time-ms",
        "20",
    ])
    .args(["--failpoints", "after_chunks=sleep(600000)"])
    .arg("--metrics-out")
    .arg(dir.path().join("metrics.jsonl"))
    .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let pid = child.id() as i32;
    let err = BufReader::new(child.stderr.take().unwrap());
    // Training (its first step's metrics written): the SIGTERM handlers are in place.
    let t0 = Instant::now();
    while !std::fs::read_to_string(dir.path().join("metrics.jsonl"))
        .unwrap_or_default()
        .contains("\"kind\":\"step\"")
    {
        if t0.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("{extra:?}: no step within 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: plain libc call on a child we spawned.
    // SAFETY: kill(2) takes plain integers and touches no memory of this process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in err.lines() {
            let line = line.unwrap_or_default();
            let _ = tx.send(line);
        }
    });
    let t0 = Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(l) if l.contains("ckpt failpoint after_chunks: sleeping") => break,
            Ok(_) => {}
            Err(e) => {
                let _ = child.kill();
                panic!("{extra:?}: the final checkpoint never reached the failpoint: {e}");
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(60));
    }
    // Stuck in the final save now: the first SIGTERM alone would wait for it.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "{extra:?}: exited early"
    );
    // SAFETY: kill(2) takes plain integers and touches no memory of this process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let t1 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t1.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{extra:?}: a second SIGTERM did not end the process");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(143), "{extra:?}");
    // Everything it said, to its stderr's end (the reader thread may still be behind).
    let said: Vec<String> =
        std::iter::from_fn(|| rx.recv_timeout(Duration::from_secs(30)).ok()).collect();
    assert!(
        said.iter().any(|l| l.contains("second SIGTERM")),
        "{extra:?}: {said:?}"
    );
}

#[test]
fn a_second_sigterm_ends_a_process_stuck_in_its_final_save() {
    // Ranks as threads (ckpt-train's own handler) and one rank per process (the manager's).
    second_sigterm_ends(&["--layout", "dp=2"]);
    second_sigterm_ends(&["--rank", "0"]);
}
