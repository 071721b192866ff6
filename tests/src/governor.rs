//! `ckpt-bench governor`: the persist governor's trade-off (issue 16, "Training keeps its speed
//! while a checkpoint persists"): for each budget (5 %, 10 %, 25 %, off by default), the
//! reference workload (ranks as threads) trains through `--saves` governed checkpoints, one
//! every `--every` steps, calling `maybe_save` each step as a training loop does. Part of the
//! `ckpt-bench` binary (`#[path]` module): it uses the binary's helpers.
//!
//! Per budget: the step time without a persist (median), the mean step time while one runs
//! (slowdown = their ratio), the extra training seconds per checkpoint (the sum of the busy
//! steps' excess, the stall included), the time from `save` to committed (nobody waits for
//! it, so the governor's rate applies throughout unless the next save must wait for it), the
//! loop's waits for a previous persist, and the rate each rank settled at. The first save of
//! each run is the governor's first look (at full speed) and is reported apart. The machine's
//! limits (memcpy, blake3, zstd, `O_DIRECT` write) are measured in the same run.

use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ckpt_store::{CodecPolicy, Layout};
use ckpt_trainer::workload::RankState;
use ckpt_trainer::{CheckpointManager, CheckpointerConfig, GovernorConfig, ManagerConfig, Stage};
use serde_json::{Value, json};

use super::{bench_job, blake3_raw, emit, gbps, median, memcpy_warm, odirect_write, step_time};

/// The machine's limits beside the figures, measured now.
fn limits(dir: &Path, state: u64) -> Value {
    let data = ckpt_store::testing::det_bytes(5, 256 << 20);
    // zstd over byte planes (the codec the store picks when it compresses) on fp32 values
    // like the workload's: the sign/exponent byte compresses, the mantissa does not.
    let floats: Vec<u8> = (0..(64 << 20) / 4)
        .flat_map(|i: u32| ((i as f32 * 1e-4).sin() * 0.02).to_le_bytes())
        .collect();
    let floats = Bytes::from(floats);
    let t = Instant::now();
    for i in (0..floats.len()).step_by(4 << 20) {
        let c = floats.slice(i..(i + (4 << 20)).min(floats.len()));
        std::hint::black_box(ckpt_store::codec::encode(&c, 4, CodecPolicy::FAST));
    }
    let zstd = gbps(floats.len() as u64, t.elapsed().as_secs_f64());
    let f = dir.join("governor-limit.bin");
    let bytes = (state as usize).min(1 << 30) / (8 << 20) * (8 << 20);
    let disk = odirect_write(&f, bytes.max(8 << 20), 8, 4 << 20);
    let _ = std::fs::remove_file(&f);
    json!({
        "bench": "governor_limits", "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "memcpy_warm_1t_gbps": memcpy_warm(256 << 20, 1),
        "blake3_1t_gbps": blake3_raw(&data, 1), "blake3_2t_gbps": blake3_raw(&data, 2),
        "zstd1_planes_1t_gbps": zstd, "disk_odirect_write_gbps": disk,
    })
}

fn managers(
    store: &ckpt_store::Store,
    run: &str,
    layout: Layout,
    ranks: &[RankState],
    every: u64,
    gov: Option<GovernorConfig>,
) -> Vec<CheckpointManager> {
    ranks
        .iter()
        .map(|r| {
            let mut c = CheckpointerConfig::new(run, r.rank, layout);
            c.copy_threads = 2;
            let mut mc = ManagerConfig::new(c);
            mc.final_on_sigterm = false;
            mc.every_steps = Some(every);
            mc.persist_governor = gov.clone();
            let mut m = CheckpointManager::new(store.clone(), mc).unwrap();
            r.register(&mut m).unwrap();
            // Staging touched up front, as a long-running job's is after its first save.
            let st = m.save_state().unwrap();
            m.checkpointer().prepare_staging(&st, true);
            m
        })
        .collect()
}

fn in_flight(mgrs: &[CheckpointManager]) -> bool {
    mgrs.iter().any(|m| {
        m.checkpointer()
            .last()
            .is_some_and(|h| matches!(h.stage(), Stage::Snapshotting | Stage::Snapshotted))
    })
}

/// One budget's run: one JSON line.
fn run(dir: &Path, params: u64, budget: Option<f64>, every: u64, saves: u64) -> Value {
    let layout: Layout = "dp=1,tp=2,pp=2".parse().unwrap();
    let label = budget.map_or_else(|| "off".to_string(), |b| b.to_string());
    let (_, _, ranks, state, store) =
        bench_job(dir, &format!("governor-{label}"), params, layout, 3);
    let gov = budget.map(GovernorConfig::with_budget);
    let mut mgrs = managers(&store, "g", layout, &ranks, every, gov);
    // Per step: seconds (the training step, the `maybe_save` calls and the wait for the
    // snapshot: what the loop spends), whether a persist ran during it, the save it follows.
    let mut steps: Vec<(u64, f64, bool)> = Vec::new();
    let mut handles = Vec::new();
    let mut waits = Vec::new();
    let last_save = every * saves;
    let mut s = 1u64;
    // After the last save, steps go on (without saving) until its persist is committed.
    while s <= last_save || (in_flight(&mgrs) && s <= last_save + 8 * every) {
        let busy = in_flight(&mgrs);
        let t = Instant::now();
        step_time(&ranks, s);
        let mut hs = Vec::new();
        if s <= last_save {
            let tw = Instant::now();
            for m in mgrs.iter_mut() {
                hs.extend(m.maybe_save(s).unwrap());
            }
            if !hs.is_empty() {
                // Blocked in `maybe_save`: waiting for the previous persist (back-pressure).
                waits.push(tw.elapsed().as_secs_f64());
            }
            // The copy out of the state (the only part a loop must wait for).
            for h in &hs {
                h.wait_snapshot().unwrap();
            }
        } else {
            for m in mgrs.iter_mut() {
                // Not due (steps past the last save are no multiple of `every`)...
                if !s.is_multiple_of(every) {
                    m.maybe_save(s).unwrap();
                }
            }
        }
        steps.push((s, t.elapsed().as_secs_f64(), busy || in_flight(&mgrs)));
        if !hs.is_empty() {
            handles.push(hs);
        }
        s += 1;
        // ... and a multiple is skipped over rather than saved.
        if s > last_save && s.is_multiple_of(every) {
            s += 1;
        }
    }
    for m in mgrs.iter_mut() {
        m.finish().unwrap();
    }
    let clean: Vec<f64> = steps.iter().filter(|x| !x.2).map(|x| x.1).collect();
    let base = median(clean.clone());
    // Governed saves: all but the first (the governor's first look, at full speed).
    let busy_after = |from: u64| -> Vec<f64> {
        steps
            .iter()
            .filter(|x| x.2 && x.0 > from)
            .map(|x| x.1)
            .collect()
    };
    let first_busy: Vec<f64> = steps
        .iter()
        .filter(|x| x.2 && x.0 >= every && x.0 < 2 * every)
        .map(|x| x.1)
        .collect();
    let governed = busy_after(2 * every - 1);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let excess = |v: &[f64]| v.iter().map(|x| (x - base).max(0.0)).sum::<f64>();
    let durable: Vec<f64> = handles
        .iter()
        .map(|hs| {
            let r = hs[0].report();
            r.persist_s + r.commit_s
        })
        .collect();
    let rates: Vec<Option<u64>> = mgrs.iter().map(|m| m.persist_rate()).collect();
    let figures: Vec<Value> = mgrs
        .iter_mut()
        .flat_map(|m| m.take_persist_figures())
        .map(|f| json!(f))
        .collect();
    let n_gov = (saves - 1).max(1) as f64;
    let _ = std::fs::remove_dir_all(dir.join(format!("governor-{label}")));
    json!({
        "bench": "governor", "budget": budget, "state_bytes": state, "params": params,
        "layout": layout.to_string(), "every_steps": every, "saves": saves,
        "step_clean_median_s": base, "clean_steps": clean.len(),
        "first_save_step_mean_s": mean(&first_busy), "first_save_slowdown": mean(&first_busy) / base,
        "first_save_extra_s": excess(&first_busy), "first_save_durable_s": durable.first(),
        "governed_busy_steps": governed.len(), "governed_step_mean_s": mean(&governed),
        "slowdown": mean(&governed) / base,
        "extra_s_per_save": excess(&governed) / n_gov,
        "durable_s": durable.iter().skip(1).copied().collect::<Vec<f64>>(),
        "durable_mean_s": durable.iter().skip(1).sum::<f64>() / n_gov,
        "waits_s": waits, "rates_settled_bps": rates, "persists": figures,
        "step_times_s": steps.iter().map(|x| json!([x.0, x.1, x.2])).collect::<Vec<_>>(),
    })
}

/// `ckpt-bench governor`: the limits, then one line per budget.
pub fn governor_bench(dir: &Path, params: u64, budgets: &str, every: u64, saves: u64) {
    let budgets: Vec<Option<f64>> = budgets
        .split(',')
        .map(|b| match b.trim() {
            "off" => None,
            x => Some(x.parse::<f64>().expect("--budgets: fractions or off")),
        })
        .collect();
    let layout: Layout = "dp=1,tp=2,pp=2".parse().unwrap();
    let model = ckpt_trainer::workload::ModelConfig::for_params(params, layout.world());
    emit(limits(dir, model.param_count() * 14));
    for b in budgets {
        let t = Instant::now();
        let mut v = run(dir, params, b, every, saves.max(2));
        v["wall_s"] = json!(t.elapsed().as_secs_f64());
        emit(v);
        std::thread::sleep(Duration::from_millis(500));
    }
}
