//! `ckpt-bench versions`: what unchanged tensors cost (issue 16, "Unchanged tensors cost
//! nothing"). Part of the `ckpt-bench` binary (`#[path]` module): it uses the binary's helpers.
//!
//! 1. A save where nothing changed since the last committed save, against the first save and
//!    against a steady full save (every tensor written since the last save).
//! 2. A fine-tuning run with `--frozen 0.99` (99 % of the layers never written) of a deep model:
//!    its saves against a steady full save of the same model with every tensor trained.
//! 3. The same fine-tuning with a replica agent: the frozen layers are named to it, not copied
//!    or sent, and it holds every step whole.
//!
//! Time is from `save` until the step is committed; bytes are what the snapshot copied (and
//! hashed) and what was written to the store, summed over ranks.

use std::path::Path;
use std::time::{Duration, Instant};

use ckpt_store::Layout;
use ckpt_trainer::CheckpointManager;
use ckpt_trainer::workload::{ModelConfig, RankState, TrainConfig};
use serde_json::json;

use super::{bench_job, emit, fresh_ranks, managers};

/// One save of every rank (ranks as threads), until committed.
#[derive(Debug, Clone, Copy)]
struct Save {
    secs: f64,
    copied: u64,
    reused: u64,
    written: u64,
}

fn save(mgrs: &mut [CheckpointManager], step: u64) -> Save {
    let t = Instant::now();
    let hs: Vec<_> = mgrs.iter_mut().map(|m| m.save_now(step).unwrap()).collect();
    hs[0].wait_committed(Duration::from_secs(600)).unwrap();
    let secs = t.elapsed().as_secs_f64();
    let mut s = Save {
        secs,
        copied: 0,
        reused: 0,
        written: 0,
    };
    for h in &hs {
        let r = h.wait_committed(Duration::from_secs(600)).unwrap();
        s.copied += r.bytes - r.bytes_reused;
        s.reused += r.bytes_reused;
        s.written += r.bytes_written;
    }
    s
}

/// One optimizer step of every rank (writes only what the workload trains).
fn train_step(ranks: &[RankState], s: u64) {
    std::thread::scope(|sc| {
        for r in ranks {
            sc.spawn(move || r.update(s, s, 1.0));
        }
    });
}

/// Four steps of fine-tuning, each saved: the first save, and the three after it.
fn fine_tune(mgrs: &mut [CheckpointManager], ranks: &[RankState]) -> (Save, Vec<Save>) {
    train_step(ranks, 1);
    let first = save(mgrs, 1);
    let mut saves = Vec::new();
    for s in 2..=4u64 {
        train_step(ranks, s);
        saves.push(save(mgrs, s));
    }
    (first, saves)
}

pub fn versions_bench(dir: &Path, params: u64) {
    let layout: Layout = "dp=1,tp=2,pp=2".parse().unwrap();
    let (_, train, ranks, state, store) = bench_job(dir, "versions-store", params, layout, 5);
    let mut mgrs = managers(&store, "v", layout, &ranks, false, 0);
    train_step(&ranks, 1);
    let first = save(&mut mgrs, 1);
    let unchanged = save(&mut mgrs, 2);
    train_step(&ranks, 2);
    let full = save(&mut mgrs, 3);
    let unchanged2 = save(&mut mgrs, 4);
    emit(json!({
        "bench": "versions_unchanged", "state_bytes": state, "layout": layout.to_string(),
        "first_s": first.secs, "first_written": first.written,
        "full_s": full.secs, "full_copied": full.copied, "full_written": full.written,
        "unchanged_s": [unchanged.secs, unchanged2.secs],
        "unchanged_copied": unchanged.copied + unchanged2.copied,
        "unchanged_reused": unchanged.reused,
        "unchanged_written": unchanged.written + unchanged2.written,
        "unchanged_over_first": unchanged.secs.max(unchanged2.secs) / first.secs,
        "unchanged_over_full": unchanged.secs.max(unchanged2.secs) / full.secs,
    }));
    drop(mgrs);

    // Fine-tuning with `--frozen 0.99` (99 % of the layers frozen) on a deep model (32 layers:
    // embeddings and output are ~4 % of its parameters, as in large language models; they are
    // never frozen). The full save to compare with: a steady save of the same model with every
    // tensor trained.
    let model = ModelConfig::for_params(params, 32);
    let dense = fresh_ranks(model, train, layout);
    let mut mgrs = managers(&store, "v-dense", layout, &dense, false, 0);
    train_step(&dense, 1);
    save(&mut mgrs, 1);
    train_step(&dense, 2);
    let full = save(&mut mgrs, 2);
    drop(mgrs);
    drop(dense);
    let tf = TrainConfig {
        frozen: 0.99,
        ..train
    };
    let ranks = fresh_ranks(model, tf, layout);
    let state: u64 = ranks.iter().map(|r| r.held_bytes()).sum();
    let mut mgrs = managers(&store, "v-frozen", layout, &ranks, false, 0);
    let (f_first, saves) = fine_tune(&mut mgrs, &ranks);
    let worst = saves.iter().copied().fold(f64::MIN, |a, s| a.max(s.secs));
    let copied = saves.iter().map(|s| s.copied).max().unwrap_or(0);
    let written = saves.iter().map(|s| s.written).max().unwrap_or(0);
    let frozen_bytes: u64 = ranks
        .iter()
        .flat_map(|r| &r.params)
        .filter(|p| p.frozen)
        .map(|p| p.held.numel() * 14)
        .sum();
    emit(json!({
        "bench": "versions_frozen", "frozen": 0.99, "state_bytes": state, "layers": model.layers,
        "full_s": full.secs, "full_copied": full.copied, "full_written": full.written,
        "frozen_state_fraction": frozen_bytes as f64 / state as f64,
        "first_s": f_first.secs, "first_written": f_first.written,
        "save_s": saves.iter().map(|s| s.secs).collect::<Vec<_>>(),
        "save_copied_max": copied, "save_written_max": written,
        "time_over_full": worst / full.secs,
        "time_over_first": worst / f_first.secs,
        "copied_over_full": copied as f64 / full.copied as f64,
        "written_over_full": written as f64 / full.written as f64,
    }));
    drop(mgrs);
    drop(ranks);

    // The same fine-tuning with a replica agent (in this process, as the node's): the frozen
    // layers are named to it, not copied or sent (before, a save with an agent copied and sent
    // every tensor: the full save above).
    let secret = ckpt_recovery::peer::PeerSecret::from_bytes([5; 32]);
    let listener = ckpt_trainer::runtime()
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let agent = ckpt_recovery::peer::AgentState::new(0, Some(secret.clone()), u64::MAX);
    ckpt_trainer::runtime().spawn(ckpt_recovery::peer::serve(listener, agent.clone()));
    let link = |_: u32| {
        Some(ckpt_recovery::PeerLink {
            node: 0,
            agent: addr.clone(),
            peers: vec![addr.clone()],
            timeout: ckpt_recovery::peer::IO_TIMEOUT,
            secret: secret.clone(),
        })
    };
    let ranks = fresh_ranks(model, tf, layout);
    let mut mgrs = super::managers_with(&store, "v-frozen-peers", layout, &ranks, false, 0, &link);
    let (p_first, saves) = fine_tune(&mut mgrs, &ranks);
    let worst = saves.iter().copied().fold(f64::MIN, |a, s| a.max(s.secs));
    let copied = saves.iter().map(|s| s.copied).max().unwrap_or(0);
    let held = agent.holdings();
    // Every rank's step 4 is held whole.
    let whole = (0..layout.world()).all(|r| {
        let (m, _, _) = ckpt_trainer::runtime()
            .block_on(store.log().get_rank_manifest("v-frozen-peers", 4, r))
            .unwrap();
        m.tensors
            .iter()
            .flat_map(|t| &t.chunks)
            .all(|c| agent.get(&c.id).is_some())
    });
    emit(json!({
        "bench": "versions_frozen_peers", "frozen": 0.99, "state_bytes": state,
        "first_s": p_first.secs, "first_copied": p_first.copied,
        "save_s": saves.iter().map(|s| s.secs).collect::<Vec<_>>(),
        "save_copied_max": copied, "full_s": full.secs, "full_copied": full.copied,
        "time_over_full": worst / full.secs,
        "copied_over_full": copied as f64 / full.copied as f64,
        "agent_snapshots": held.snapshots, "agent_chunks": held.chunks,
        "agent_holds_step_4_whole": whole,
    }));
}
