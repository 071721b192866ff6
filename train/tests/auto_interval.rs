//! `ckpt-train --ckpt-every auto`: a run whose recovery log holds failures checkpoints more
//! often than the same run without, says why in `checkpoint_interval` events, and trains
//! to the same final state as a run with a fixed interval.

mod common;
use common::*;

use std::path::Path;

use ckpt_recovery::records::{self, Event, read_records};
use ckpt_store::logs::{EVENTS, LogWriter};
use ckpt_trainer::runtime;

const STEPS: u64 = 120;

/// Write a recovery log the way the supervisor does (`started`, then a `failure` per
/// generation), dated over the `span_s` seconds before now.
fn write_failures(store: &Path, run: &str, failures: u64, span_s: u64) {
    let s = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let mut log = LogWriter::new(&s, run, EVENTS, "supervisor").unwrap();
    let now = ckpt_store::now_ms();
    let start = now - span_s as i64 * 1000;
    let mut put = |t_ms: i64, e: Event| {
        let mut v = serde_json::to_value(&e).unwrap();
        v["t_ms"] = t_ms.into();
        log.append(&v).unwrap();
    };
    put(
        start,
        Event::Started(records::Started {
            generation: 0,
            layout: "dp=2".into(),
            nodes: vec![0, 1],
            ..Default::default()
        }),
    );
    for g in 0..failures {
        let t = start + ((g + 1) * span_s * 1000 / (failures + 1)) as i64;
        put(
            t,
            Event::Failure(records::Failure {
                generation: g,
                rank: 1,
                node: 1,
                how: "signal".into(),
                detail: "killed by SIGKILL".into(),
                ..Default::default()
            }),
        );
        put(
            t + 1,
            Event::Started(records::Started {
                generation: g + 1,
                layout: "dp=2".into(),
                nodes: vec![0, 1],
                ..Default::default()
            }),
        );
    }
    runtime().block_on(log.flush()).unwrap();
}

/// The committed steps of `run`; every step that has a manifest must be committed (the
/// rank threads agreed on every step they saved).
fn committed(store: &Path, run: &str) -> Vec<u64> {
    let s = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let steps = runtime().block_on(s.log().list_steps(run)).unwrap();
    for st in &steps {
        assert!(
            st.committed,
            "step {} of {run} has manifests of ranks {:?} but no commit: the ranks disagreed about when to checkpoint",
            st.step, st.ranks
        );
    }
    steps.iter().map(|s| s.step).collect()
}

fn intervals(store: &Path, run: &str) -> Vec<records::CheckpointInterval> {
    let s = ckpt_store::open(store.to_str().unwrap()).unwrap();
    runtime()
        .block_on(read_records::<Event>(&s, run))
        .unwrap()
        .into_iter()
        .filter_map(|l| match l.record {
            Event::CheckpointInterval(c) => Some(c),
            _ => None,
        })
        .collect()
}

fn auto_args() -> Vec<&'static str> {
    vec![
        "--layout",
        "dp=2",
        "--steps",
        "120",
        "--step-time-ms",
        "20",
        "--ckpt-every",
        "auto",
        "--ckpt-every-min",
        "2",
        "--ckpt-every-max",
        "40",
        "--mtbf-prior",
        "36000",
    ]
}

#[test]
fn failures_in_the_recovery_log_shorten_the_interval_and_never_change_the_result() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");

    // Thirty failures over the last 3 s: an MTBF of well under a second.
    write_failures(&store, "failing", 30, 3);
    let d_failing = train(&store, "failing", &auto_args());
    let d_calm = train(&store, "calm", &auto_args());
    let d_fixed = train(
        &store,
        "fixed",
        &["--layout", "dp=2", "--steps", "120", "--ckpt-every", "10"],
    );

    // Checkpoint timing never changes the training result.
    assert_eq!(d_failing, d_fixed, "auto interval with failures vs fixed");
    assert_eq!(d_calm, d_fixed, "auto interval without failures vs fixed");

    let failing = committed(&store, "failing");
    let calm = committed(&store, "calm");
    assert_eq!(failing.last(), Some(&STEPS));
    assert_eq!(calm.last(), Some(&STEPS));
    // No failure, prior MTBF 10 h: Young/Daly's interval is far above 40 steps of 20 ms, so
    // once the first save is measured (the run starts at the lower bound, 2 steps) it
    // checkpoints every 40 steps, and at the end.
    let calm_first = intervals(&store, "calm").first().map_or(0, |e| e.step);
    let late: Vec<u64> = calm.iter().copied().filter(|&s| s > calm_first).collect();
    assert!(
        late.windows(2).all(|w| w[1] - w[0] >= 40 || w[1] == STEPS) && late.len() <= 4,
        "a run without failures checkpointed at {calm:?} (interval 40 from step {calm_first})"
    );
    eprintln!("checkpoints with failures: {failing:?}; without: {calm:?}");
    assert!(
        failing.len() >= 2 * calm.len(),
        "a run with failures checkpointed {} times ({failing:?}), one without {} times ({calm:?})",
        failing.len(),
        calm.len()
    );

    // The decisions, with their reasons, in the run's events log.
    let ev = intervals(&store, "failing");
    let first = ev
        .first()
        .expect("the run with failures logged no checkpoint_interval");
    assert_eq!(first.failures, 30, "{first:?}");
    assert!(!first.mtbf_prior, "{first:?}");
    assert!(first.mtbf_s > 0.0 && first.mtbf_s < 10.0, "{first:?}");
    assert!(first.cost_s.is_some_and(|c| c > 0.0), "{first:?}");
    assert!(first.step_s.is_some_and(|s| s > 0.0), "{first:?}");
    assert_eq!(first.from_steps, 2, "{first:?}");
    assert!(
        ev.iter().all(|e| e.to_steps < 40 && !e.reason.is_empty()),
        "{ev:?}"
    );

    let ev = intervals(&store, "calm");
    let first = ev
        .first()
        .expect("the run without failures logged no checkpoint_interval");
    assert!(first.mtbf_prior && first.failures == 0, "{first:?}");
    assert_eq!(first.mtbf_s, 36000.0, "{first:?}");
    assert_eq!(
        (first.from_steps, first.to_steps, first.reason.as_str()),
        (2, 40, "max"),
        "{first:?}"
    );
    assert!(
        first
            .target_s
            .zip(first.step_s)
            .is_some_and(|(t, s)| t / s > 40.0),
        "{first:?}"
    );
}

/// One rank per process (`--rank`, as under `ckpt resume`): the interval is fixed for the
/// generation, derived by both ranks from the log before it started (30 failures in 3 s, and
/// the save cost rank 0 of the previous generation logged) and agreed through the store: both
/// ranks checkpoint the same steps (every step with a manifest is committed), one decision is
/// logged, rank 0 logs its cost for the next generation, and the result is the fixed run's.
#[test]
fn one_rank_per_process_fixes_the_interval_for_the_generation() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let run = "procs";
    write_failures(&store, run, 30, 3);
    {
        let s = ckpt_store::open(store.to_str().unwrap()).unwrap();
        let mut log = LogWriter::new(&s, run, EVENTS, "monitor-rank-0").unwrap();
        log.append(&Event::SaveCost(records::SaveCost {
            generation: 29,
            rank: 0,
            step: 50,
            cost_s: Some(0.05),
            step_s: Some(0.02),
            steps: 2,
            next_steps: 5,
        }))
        .unwrap();
        runtime().block_on(log.flush()).unwrap();
    }
    let mut args = auto_args();
    args.extend(["--generation", "30"]);
    let d = train_procs(&store, run, 2, &args);
    let d_fixed = train(
        &store,
        "fixed",
        &["--layout", "dp=2", "--steps", "120", "--ckpt-every", "10"],
    );
    assert_eq!(d, d_fixed, "auto interval over processes vs fixed");

    let ev = intervals(&store, run);
    assert_eq!(ev.len(), 1, "one decision for the generation: {ev:?}");
    let c = &ev[0];
    assert_eq!(
        (c.generation, c.failures, c.step),
        (Some(30), 30, 0),
        "{c:?}"
    );
    assert_eq!((c.cost_s, c.step_s), (Some(0.05), Some(0.02)), "{c:?}");
    // An MTBF of about 0.1 s: sqrt(2 x 0.05 x 0.1) = 0.1 s, about 5 steps of 20 ms.
    assert!(!c.mtbf_prior && c.mtbf_s < 1.0, "{c:?}");
    assert_eq!(c.reason, "young_daly", "{c:?}");
    assert!((3..=12).contains(&c.to_steps), "{c:?}");
    let n = c.to_steps;
    let steps = committed(&store, run);
    assert_eq!(
        steps,
        (1..=STEPS)
            .filter(|s| s % n == 0 || *s == STEPS)
            .collect::<Vec<_>>(),
        "every {n} steps and at the end"
    );
    // Rank 0 kept measuring for the next generation.
    let s = ckpt_store::open(store.to_str().unwrap()).unwrap();
    let costs: Vec<_> = runtime()
        .block_on(read_records::<Event>(&s, run))
        .unwrap()
        .into_iter()
        .filter_map(|l| match l.record {
            Event::SaveCost(c) if c.generation == 30 => Some(c),
            _ => None,
        })
        .collect();
    assert!(
        costs
            .iter()
            .any(|c| c.cost_s.is_some_and(|x| x > 0.0) && c.steps == n),
        "{costs:?}"
    );
}

#[test]
fn bad_bounds_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = cmd(
        dir.path(),
        "r",
        &[
            "--steps",
            "4",
            "--ckpt-every",
            "auto",
            "--ckpt-every-min",
            "0",
        ],
    )
    .output()
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lower bound"), "{err}");
}
