//! The sentinel's findings through the real `ckpt` binary (issue 29): a step whose
//! data-parallel replicas disagreed shows in `ckpt ls` (text and `--json`), `ckpt inspect`
//! names the tensor, chunk, ranks and nodes, and `ckpt verify` reports it (exit code 3 when
//! the stored bytes are the suspect side); `ckpt stats` shows per step how much of each
//! tensor group and kind changed, so a frozen layer stands out.

mod common;

use std::sync::Arc;
use std::time::Duration;

use ckpt_store::placement::TensorSpec;
use ckpt_store::testing::det_bytes;
use ckpt_store::{DType, Layout, NdBox, SdcCheck, Store};
use ckpt_trainer::{CheckpointManager, CheckpointerConfig, HostTensor, ManagerConfig};
use common::local;

const N: u64 = 4096;

/// `run` of dp=3 saved at step 1, replicated `w` (and `b`), rank `bad`'s copy of `w` with a
/// flipped bit; the replicas hashed in full.
fn save_with_a_flip(store: &Store, run: &str, bad: u32) {
    let data = det_bytes(3, (N * 4) as usize);
    std::thread::scope(|s| {
        for rank in 0..3u32 {
            let data = &data;
            s.spawn(move || {
                let layout = Layout::new(3, 1, 1, 0).unwrap();
                let mut ck = CheckpointerConfig::new(run, rank, layout);
                ck.sdc_check = SdcCheck::Full;
                ck.node = Some(10 + rank);
                let mut c = ManagerConfig::new(ck);
                c.final_on_sigterm = false;
                c.every_steps = Some(1);
                let mut m = CheckpointManager::new(store.clone(), c).unwrap();
                let w = HostTensor::from_vec(data.clone());
                if rank == bad {
                    w.write()[100] ^= 0x01;
                }
                let b = HostTensor::from_vec(data.clone());
                for (name, t, order) in [("w", w, 0), ("b", b, 1)] {
                    let spec = TensorSpec::first_stage(name, DType::F32, &[N]).with_order(order);
                    m.register(spec, NdBox::full(&[N]), Arc::new(t)).unwrap();
                }
                let h = m.maybe_save(1).unwrap().unwrap();
                if rank == 0 {
                    h.wait_committed(Duration::from_secs(60)).unwrap();
                } else {
                    h.wait_persisted().unwrap();
                }
            });
        }
    });
}

#[test]
fn a_replica_mismatch_shows_in_ls_inspect_and_verify() {
    let env = local();
    save_with_a_flip(&env.store, "sdc", 2);
    let ls = env.ckpt(&["ls", "sdc"]).code(0);
    assert!(ls.out.contains("REPLICAS"), "{}", ls.out);
    assert!(ls.out.contains("MISMATCH 1 (suspect rank 2)"), "{}", ls.out);
    assert!(ls.out.contains("replicas disagree"), "{}", ls.out);
    let j = env.ckpt(&["--json", "ls", "sdc"]).code(0).json();
    let r = &j["steps"][0]["replicas"];
    assert_eq!(r["mismatched_chunks"], 1, "{j}");
    assert_eq!(r["suspects"], serde_json::json!([2]));
    assert!(r["chunks_compared"].as_u64().unwrap() > 1);

    let inspect = env.ckpt(&["inspect", "sdc@1"]).code(0);
    assert!(inspect.out.contains("MISMATCH"), "{}", inspect.out);
    assert!(
        inspect.out.contains("tensor \"w\"") && inspect.out.contains("rank 2 (node 12)"),
        "{}",
        inspect.out
    );
    let j = env.ckpt(&["--json", "inspect", "sdc@1"]).code(0).json();
    assert_eq!(
        j["replicas"]["mismatches"][0]["suspects"],
        serde_json::json!([2])
    );

    // The stored bytes are the majority's (unless rank 2 wrote `w`): a note, exit 0; when
    // the writer is the suspect, the step counts as damaged: exit 3.
    let j = env.ckpt(&["--json", "verify", "sdc"]).json();
    let f = &j["replica_mismatches"][0];
    assert_eq!(f["step"], "sdc@1", "{j}");
    let stored_suspect = f["stored_suspect"].as_bool().unwrap();
    let v = env
        .ckpt(&["verify", "sdc"])
        .code(if stored_suspect { 3 } else { 0 });
    assert!(v.out.contains("replicas disagreed"), "{}", v.out);
    assert_eq!(j["clean"], !stored_suspect);
}

#[test]
fn the_writer_as_the_suspect_makes_verify_fail() {
    // Whoever writes `w` under the placement rules: flip that rank's copy.
    let env = local();
    // The tensors `save_with_a_flip` registers: the writers balance them, so the writer of
    // `w` depends on `b` too.
    let layout = Layout::new(3, 1, 1, 0).unwrap();
    let specs: Vec<TensorSpec> = [("w", 0), ("b", 1)]
        .into_iter()
        .map(|(name, order)| TensorSpec::first_stage(name, DType::F32, &[N]).with_order(order))
        .collect();
    let writer = (0..3u32)
        .find(|&r| {
            ckpt_store::placement::place_rank(&layout, r, &specs)
                .unwrap()
                .iter()
                .any(|p| specs[p.spec].name == "w" && p.replica_of.is_none())
        })
        .unwrap();
    save_with_a_flip(&env.store, "sdcw", writer);
    let v = env.ckpt(&["verify", "sdcw"]).code(3);
    assert!(v.out.contains("SUSPECT"), "{}", v.out);
    assert!(
        v.out.contains(&format!("suspect: rank {writer}")),
        "{}",
        v.out
    );
}

#[test]
fn stats_shows_a_frozen_group_and_a_stuck_kind() {
    let env = local();
    let run = "st";
    let mut c = ManagerConfig::new(CheckpointerConfig::new(run, 0, Layout::SINGLE));
    c.final_on_sigterm = false;
    c.every_steps = Some(10);
    let mut m = CheckpointManager::new(env.store.clone(), c).unwrap();
    // layers.0 trains; layers.1 is frozen; the optimizer's exp_avg of layers.0 is stuck.
    let names = [
        "layers.0.w.master",
        "layers.0.w.exp_avg",
        "layers.1.w.master",
    ];
    let ts: Vec<HostTensor> = (0..3)
        .map(|i| HostTensor::from_vec(det_bytes(i, (N * 4) as usize)))
        .collect();
    for (i, (n, t)) in names.iter().zip(&ts).enumerate() {
        let spec = TensorSpec::first_stage(*n, DType::F32, &[N]).with_order(i as u32);
        m.register(spec, NdBox::full(&[N]), Arc::new(t.clone()))
            .unwrap();
    }
    for step in 1..=30u64 {
        // Every chunk of layers.0's master changes each step.
        for b in ts[0].write().iter_mut().step_by(512) {
            *b = b.wrapping_add(1);
        }
        if let Some(h) = m.maybe_save(step).unwrap() {
            h.wait_committed(Duration::from_secs(60)).unwrap();
        }
    }
    m.finish().unwrap();
    let out = env.ckpt(&["stats", run]).code(0);
    assert!(out.out.contains("layers.1 (0.0%)"), "{}", out.out);
    assert!(!out.out.contains("layers.0 ("), "{}", out.out);
    assert!(out.out.contains("EXP_AVG"), "{}", out.out);
    let j = env.ckpt(&["--json", "stats", run]).code(0).json();
    let steps = j["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 3);
    assert!(steps[0]["since"].is_null());
    let s = &steps[2];
    assert_eq!(s["since"], 20);
    assert_eq!(s["groups"]["layers.1"]["changed_bytes"], 0);
    assert_eq!(s["groups"]["layers.0"]["changed_bytes"], N * 4);
    assert_eq!(s["kinds"]["exp_avg"]["changed_bytes"], 0);
    assert_eq!(s["kinds"]["master"]["changed_bytes"], N * 4);
    assert_eq!(s["total"]["bytes"], 3 * N * 4);
    // A run that does not exist is named.
    let e = env.ckpt(&["stats", "nope"]);
    assert_ne!(e.code, 0);
    assert!(e.err.contains("nope"), "{}", e.err);
}
