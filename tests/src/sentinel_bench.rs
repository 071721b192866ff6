//! `ckpt-bench sentinel`: what the sentinel costs (issue 29) on the reference workload, and
//! how likely its default sample is to catch one flipped bit. Part of the `ckpt-bench` binary
//! (`#[path]` module): it uses the binary's helpers.
//!
//! The workload (ranks as threads, dp=2 with ZeRO 0, so every rank holds a replica of what
//! the other writes) saves in rounds, one checkpoint per mode a round (`off`, the default
//! `sample=0.05`, `full`), each mode into its own store, a training step before each save so
//! every save writes new bytes. Per save: the stall (until every snapshot is taken), the
//! persist time (the slowest rank's `save` to its manifest), the time to committed, the
//! replica bytes hashed, and the slowdown of a training step run while the persist goes on
//! (over a step right after it). The figures are medians over the rounds; the machine's
//! limits (memcpy, blake3) are measured in the same run.
//!
//! The detection figures are computed from the sampler itself (`sampled_chunks`, the same
//! code the ranks run): for chunks at random places of a large replica, the share of
//! checkpoints that hash a given chunk (the chance that one flipped bit is caught at the next
//! checkpoint), the chance that a flip that stays in the state (as one in a rank's weights
//! does) is caught within k checkpoints, and the longest run of checkpoints that miss a chunk.

use std::path::Path;
use std::time::{Duration, Instant};

use ckpt_store::{Layout, NdBox, SdcCheck, sampled_chunks};
use ckpt_trainer::workload::RankState;
use ckpt_trainer::{CheckpointManager, CheckpointerConfig, ManagerConfig, SaveReport};
use serde_json::{Value, json};

use super::{bench_job, blake3_raw, emit, median, memcpy_warm, step_time};

fn managers(
    store: &ckpt_store::Store,
    run: &str,
    layout: Layout,
    ranks: &[RankState],
    check: SdcCheck,
) -> Vec<CheckpointManager> {
    ranks
        .iter()
        .map(|r| {
            let mut c = CheckpointerConfig::new(run, r.rank, layout);
            c.copy_threads = 1;
            c.sdc_check = check;
            let mut mc = ManagerConfig::new(c);
            mc.final_on_sigterm = false;
            mc.persist_governor = None;
            let mut m = CheckpointManager::new(store.clone(), mc).unwrap();
            r.register(&mut m).unwrap();
            let st = m.save_state().unwrap();
            m.checkpointer().prepare_staging(&st, true);
            m
        })
        .collect()
}

/// Two saves of every rank (a training step before each, so each writes new bytes): one
/// alone (stall, persist of the slowest rank, committed, replica bytes hashed), one with a
/// training step while it persists (that step, and one right after it).
fn save(mgrs: &mut [CheckpointManager], ranks: &[RankState], step: u64) -> [f64; 6] {
    step_time(ranks, step * 10);
    let t = Instant::now();
    let hs: Vec<_> = mgrs
        .iter_mut()
        .map(|m| m.save_now(step * 10).unwrap())
        .collect();
    for h in &hs {
        h.wait_snapshot().unwrap();
    }
    let stall = t.elapsed().as_secs_f64();
    let reports: Vec<SaveReport> = hs.iter().map(|h| h.wait_persisted().unwrap()).collect();
    hs[0].wait_committed(Duration::from_secs(600)).unwrap();
    let committed = t.elapsed().as_secs_f64();
    let persist = reports.iter().map(|r| r.persist_s).fold(0.0, f64::max);
    let checked: u64 = reports.iter().map(|r| r.bytes_checked).sum();
    step_time(ranks, step * 10 + 1);
    let hs: Vec<_> = mgrs
        .iter_mut()
        .map(|m| m.save_now(step * 10 + 1).unwrap())
        .collect();
    for h in &hs {
        h.wait_snapshot().unwrap();
    }
    let during = step_time(ranks, step * 10 + 2);
    for h in &hs {
        h.wait_persisted().unwrap();
    }
    hs[0].wait_committed(Duration::from_secs(600)).unwrap();
    let after = step_time(ranks, step * 10 + 3);
    [stall, persist, committed, checked as f64, during, after]
}

/// The sampler's detection figures for `check` over `checkpoints` consecutive checkpoints
/// `every` steps apart, for `chunks` places in a replica of 4096 chunks.
pub fn detection(check: SdcCheck, checkpoints: u64, every: u64, chunks: usize) -> Value {
    let n = 4096u32;
    let b = NdBox::full(&[u64::from(n) << 20]);
    // Which checkpoints hash each chunk.
    let mut hit = vec![Vec::new(); n as usize];
    for k in 0..checkpoints {
        for i in sampled_chunks(check, "layers.0.w", &b, n, (k + 1) * every) {
            hit[i as usize].push(k);
        }
    }
    // Chunks at spread-out places (every n/chunks-th).
    let places: Vec<usize> = (0..chunks).map(|j| j * n as usize / chunks).collect();
    let per_checkpoint = places.iter().map(|&p| hit[p].len()).sum::<usize>() as f64
        / (chunks as u64 * checkpoints) as f64;
    // A flip in chunk p just before checkpoint s is caught at the first checkpoint >= s that
    // hashes p: the chance it is caught within k checkpoints, over every p and s.
    let within = |k: u64| {
        let mut caught = 0u64;
        let mut total = 0u64;
        for &p in &places {
            for s in 0..checkpoints.saturating_sub(k) {
                total += 1;
                if hit[p].iter().any(|&h| h >= s && h < s + k) {
                    caught += 1;
                }
            }
        }
        caught as f64 / total.max(1) as f64
    };
    let longest_miss = places
        .iter()
        .map(|&p| {
            let mut last: i64 = -1;
            let mut gap = 0i64;
            for &h in &hit[p] {
                gap = gap.max(h as i64 - last - 1);
                last = h as i64;
            }
            gap.max(checkpoints as i64 - 1 - last)
        })
        .max()
        .unwrap_or(0);
    json!({
        "bench": "sentinel_detection", "check": check.to_string(), "checkpoints": checkpoints,
        "every_steps": every, "places": chunks,
        "caught_at_the_next_checkpoint": per_checkpoint,
        "caught_within_5": within(5), "caught_within_20": within(20), "caught_within_50": within(50),
        "longest_run_of_checkpoints_missing_a_chunk": longest_miss,
    })
}

/// The bench (see the module docs).
pub fn sentinel_bench(dir: &Path, params: u64, rounds: usize) {
    let layout: Layout = "dp=2".parse().unwrap();
    let modes = [
        ("off", SdcCheck::Off),
        ("sample", SdcCheck::DEFAULT),
        ("full", SdcCheck::Full),
    ];
    let (model, _, ranks, state, _) = bench_job(dir, "sentinel-off", params, layout, 3);
    let data = ckpt_store::testing::det_bytes(5, 256 << 20);
    emit(json!({
        "bench": "sentinel_limits", "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "state_bytes": state, "params": model.param_count(), "layout": layout.to_string(),
        "memcpy_warm_1t_gbps": memcpy_warm(256 << 20, 1),
        "blake3_1t_gbps": blake3_raw(&data, 1), "blake3_2t_gbps": blake3_raw(&data, 2),
    }));
    let mut stores = Vec::new();
    let mut mgrs = Vec::new();
    for (name, check) in modes {
        let (_, _, _, _, store) = bench_job(dir, &format!("sentinel-{name}"), params, layout, 3);
        mgrs.push(managers(&store, name, layout, &ranks, check));
        stores.push(store);
    }
    // Rounds of one save per mode (a training step before each: new bytes every save).
    let mut figs: Vec<Vec<[f64; 6]>> = vec![Vec::new(); modes.len()];
    let mut step = 1;
    for round in 0..rounds + 1 {
        // Each round in another order: no mode is always first after the others' persists.
        for k in 0..mgrs.len() {
            let i = (k + round) % mgrs.len();
            figs[i].push(save(&mut mgrs[i], &ranks, step));
            step += 1;
        }
    }
    let col = |i: usize, k: usize| median(figs[i][1..].iter().map(|f| f[k]).collect());
    let off_persist = col(0, 1);
    let off_during = col(0, 4);
    for (i, (name, check)) in modes.iter().enumerate() {
        emit(json!({
            "bench": "sentinel_cost", "mode": name, "check": check.to_string(), "rounds": rounds,
            "stall_s": col(i, 0), "persist_s": col(i, 1), "committed_s": col(i, 2),
            "replica_bytes_hashed": col(i, 3), "step_during_persist_s": col(i, 4), "step_after_s": col(i, 5),
            "persist_over_off": col(i, 1) / off_persist,
            "slowdown_during_persist": col(i, 4) / col(i, 5),
            "step_during_persist_over_off": col(i, 4) / off_during,
            "note": "the first round (its first saves write everything) is left out",
        }));
    }
    drop(mgrs);
    drop(stores);
    // Each mode's store holds every save of the run: gigabytes.
    for (name, _) in modes {
        let _ = std::fs::remove_dir_all(dir.join(format!("sentinel-{name}")));
    }
    for check in [SdcCheck::DEFAULT, SdcCheck::Sample(0.2), SdcCheck::Full] {
        emit(detection(check, 400, 10, 512));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_sample_catches_about_its_fraction_and_full_catches_everything() {
        let d = detection(SdcCheck::DEFAULT, 200, 10, 256);
        let p = d["caught_at_the_next_checkpoint"].as_f64().unwrap();
        assert!((0.03..0.07).contains(&p), "{d}");
        assert!(d["caught_within_50"].as_f64().unwrap() > 0.9, "{d}");
        let f = detection(SdcCheck::Full, 20, 10, 64);
        assert_eq!(f["caught_at_the_next_checkpoint"], 1.0);
        assert_eq!(f["longest_run_of_checkpoints_missing_a_chunk"], 0);
    }
}
