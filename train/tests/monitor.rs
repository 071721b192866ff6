//! Training monitors end to end, with the real `ckpt-train`: an injected loss spike rolls the
//! run back and skips the bad batches (and then equals a run that never read them, exactly), a
//! NaN rolls back or stops as configured, `alert` changes nothing but the events log, the
//! bound on rollbacks stops the run with its history (also after a resume), 10,000 healthy
//! steps raise no alarm, and `ckpt plot` draws a run with a rollback.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// A model of about 10,000 parameters: a few milliseconds a step.
const SMALL: [&str; 4] = ["--d-model", "16", "--layers", "2"];

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    SMALL.iter().copied().chain(extra.iter().copied()).collect()
}

/// Run to success; the final digest.
fn ok(store: &Path, run: &str, extra: &[&str]) -> String {
    train(store, run, &args(extra))
}

/// Run to failure; stderr.
fn fails(store: &Path, run: &str, extra: &[&str]) -> String {
    let out = cmd(store, run, &args(extra))
        .output()
        .expect("spawn ckpt-train");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success(),
        "ckpt-train {extra:?} should have failed:\n{stderr}"
    );
    stderr
}

/// Step records: (step, batch, loss, grad_norm).
fn steps(path: &Path) -> Vec<(u64, u64, Option<f64>, Option<f64>)> {
    metrics(path)
        .into_iter()
        .filter(|v| v["kind"] == "step")
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["batch"].as_u64().unwrap(),
                v["loss"].as_f64(),
                v["grad_norm"].as_f64(),
            )
        })
        .collect()
}

fn read_log(store: &Path, run: &str, log: &str) -> Vec<Value> {
    let s = ckpt_store::open(store.to_str().unwrap()).unwrap();
    ckpt_trainer::runtime()
        .block_on(ckpt_store::logs::read_log(&s, run, log))
        .unwrap()
}

fn events(store: &Path, run: &str) -> Vec<Value> {
    read_log(store, run, ckpt_store::logs::EVENTS)
}

fn kinds<'a>(ev: &'a [Value], kind: &str) -> Vec<&'a Value> {
    ev.iter().filter(|v| v["kind"] == kind).collect()
}

fn latest_committed(store: &Path, run: &str) -> Option<u64> {
    let s = ckpt_store::open(store.to_str().unwrap()).unwrap();
    ckpt_trainer::runtime()
        .block_on(s.log().latest_committed(run))
        .unwrap()
}

fn step_seq(s: &[(u64, u64, Option<f64>, Option<f64>)]) -> Vec<u64> {
    s.iter().map(|x| x.0).collect()
}

#[test]
fn rollback_skips_the_bad_batches_and_equals_a_run_that_never_saw_them() {
    let dir = tempfile::tempdir().unwrap();
    let (m1, m2) = (dir.path().join("spike.jsonl"), dir.path().join("ref.jsonl"));
    let store = dir.path().join("s");
    // Four rank threads: rank 0 decides on the global loss, all roll back together.
    let spiked = ok(
        &store,
        "spiked",
        &[
            "--layout",
            "dp=2,tp=2",
            "--steps",
            "60",
            "--ckpt-every",
            "10",
            "--inject-spike-at",
            "35",
            "--on-spike",
            "rollback",
            "--metrics-out",
            m1.to_str().unwrap(),
        ],
    );
    // The reference never reads batches 31-35, under another layout (the loss is exact and
    // layout-independent).
    let reference = ok(
        &store,
        "reference",
        &[
            "--steps",
            "60",
            "--ckpt-every",
            "10",
            "--skip-batches",
            "31-35",
            "--metrics-out",
            m2.to_str().unwrap(),
        ],
    );
    assert_eq!(
        spiked, reference,
        "the rolled-back run ends in another state"
    );

    let a = steps(&m1);
    let b = steps(&m2);
    let want: Vec<u64> = (1..=35).chain(31..=60).collect();
    assert_eq!(
        step_seq(&a),
        want,
        "detected at step 35, back to step 30, then on to 60"
    );
    // The spike: the loss of batch 35 is orders of magnitude above the step before.
    assert_eq!(a[34].1, 35);
    assert!(a[34].2.unwrap() > 1e4 * a[33].2.unwrap(), "{:?}", a[34]);
    // Before the spike and after the rollback: the reference's curve, exactly (step, batch,
    // loss, gradient norm).
    assert_eq!(a[..30], b[..30]);
    assert_eq!(
        a[35..],
        b[30..],
        "the loss curve after the rollback is not the reference's"
    );
    assert_eq!(a[35].1, 36, "step 31 reads batch 36: 31-35 are skipped");
    assert!(
        b.iter().all(|x| !(31..=35).contains(&x.1)),
        "the reference read a skipped batch"
    );

    let ev = events(&store, "spiked");
    let spikes = kinds(&ev, "spike");
    assert_eq!(spikes.len(), 1, "{ev:?}");
    let s = spikes[0];
    assert_eq!(
        (s["step"].as_u64(), s["batch"].as_u64()),
        (Some(35), Some(35))
    );
    assert_eq!(
        (s["what"].as_str(), s["action"].as_str()),
        (Some("loss"), Some("rollback"))
    );
    assert!(s["loss"].as_f64().unwrap() > s["threshold"].as_f64().unwrap());
    let rb = kinds(&ev, "rollback");
    assert_eq!(rb.len(), 1);
    assert_eq!(
        (rb[0]["from_step"].as_u64(), rb[0]["to_step"].as_u64()),
        (Some(35), Some(30))
    );
    assert_eq!(rb[0]["skipped"], serde_json::json!([31, 35]));
    assert!(rb[0]["t_ms"].as_i64().unwrap() >= s["t_ms"].as_i64().unwrap());
    assert!(kinds(&ev, "stop").is_empty());
    assert!(
        events(&store, "reference").is_empty(),
        "a healthy run logged events"
    );
}

#[test]
fn nan_rolls_back_or_stops_as_configured() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s");
    let m = dir.path().join("alert.jsonl");

    // Rollback, one rank per process (a world of 1: its partial sums are the global loss).
    let rolled = ok(
        &store,
        "nan-rollback",
        &[
            "--rank",
            "0",
            "--steps",
            "40",
            "--ckpt-every",
            "10",
            "--inject-nan-at",
            "25",
            "--on-spike",
            "rollback",
        ],
    );
    let reference = ok(
        &store,
        "nan-reference",
        &[
            "--steps",
            "40",
            "--ckpt-every",
            "10",
            "--skip-batches",
            "21-25",
        ],
    );
    assert_eq!(rolled, reference);
    let ev = events(&store, "nan-rollback");
    let s = kinds(&ev, "spike");
    assert_eq!(s.len(), 1);
    assert_eq!(
        (s[0]["step"].as_u64(), s[0]["what"].as_str()),
        (Some(25), Some("nonfinite"))
    );
    assert!(s[0]["loss"].is_null(), "NaN is logged as null");
    let rb = kinds(&ev, "rollback");
    assert_eq!(
        (rb[0]["to_step"].as_u64(), &rb[0]["skipped"]),
        (Some(20), &serde_json::json!([21, 25]))
    );

    // Alert: a NaN poisons every later step, so the run stops, without a checkpoint of it.
    let err = fails(
        &store,
        "nan-alert",
        &[
            "--steps",
            "40",
            "--ckpt-every",
            "5",
            "--inject-nan-at",
            "25",
            "--on-spike",
            "alert",
            "--metrics-out",
            m.to_str().unwrap(),
        ],
    );
    assert!(
        err.contains("NaN loss at step 25") && err.contains("the run stops"),
        "{err}"
    );
    assert_eq!(
        latest_committed(&store, "nan-alert"),
        Some(20),
        "the poisoned step 25 was checkpointed"
    );
    assert_eq!(steps(&m).last().map(|x| x.0), Some(25));
    let ev = events(&store, "nan-alert");
    let s = kinds(&ev, "spike");
    assert_eq!((s.len(), s[0]["action"].as_str()), (1, Some("stop")));
    let stop = kinds(&ev, "stop");
    assert_eq!(stop.len(), 1);
    assert_eq!(stop[0]["step"].as_u64(), Some(25));
    assert_eq!(stop[0]["rollbacks"], serde_json::json!([]));

    // Rollback with nothing committed before the spike: stop, and say why.
    let err = fails(
        &store,
        "nan-early",
        &[
            "--steps",
            "20",
            "--ckpt-every",
            "10",
            "--inject-nan-at",
            "5",
            "--on-spike",
            "rollback",
        ],
    );
    assert!(
        err.contains("no committed checkpoint from before the spike"),
        "{err}"
    );
    let ev = events(&store, "nan-early");
    assert_eq!(
        (kinds(&ev, "spike").len(), kinds(&ev, "stop").len()),
        (1, 1)
    );
    assert!(kinds(&ev, "rollback").is_empty());

    // Off: nothing is checked, the NaN trains on silently (what the monitor is for).
    ok(
        &store,
        "nan-off",
        &[
            "--steps",
            "30",
            "--inject-nan-at",
            "25",
            "--on-spike",
            "off",
        ],
    );
    assert!(events(&store, "nan-off").is_empty());
}

#[test]
fn alert_changes_nothing_but_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s");
    let (ma, mo) = (dir.path().join("alert.jsonl"), dir.path().join("off.jsonl"));
    let common = [
        "--layout",
        "dp=2",
        "--steps",
        "50",
        "--inject-spike-at",
        "35",
    ];
    let run = |name: &str, action: &str, m: &PathBuf| {
        let mut a: Vec<&str> = common.to_vec();
        a.extend(["--on-spike", action, "--metrics-out", m.to_str().unwrap()]);
        ok(&store, name, &a)
    };
    let alert = run("alert", "alert", &ma);
    let off = run("off", "off", &mo);
    assert_eq!(
        alert, off,
        "alert changed the training (same injection, monitor off)"
    );
    assert_eq!(steps(&ma), steps(&mo));
    let clean = ok(&store, "clean", &["--layout", "dp=2", "--steps", "50"]);
    assert_ne!(clean, alert, "the injected batch changed nothing");

    let ev = events(&store, "alert");
    let spikes = kinds(&ev, "spike");
    assert!(!spikes.is_empty());
    assert_eq!(spikes[0]["step"].as_u64(), Some(35));
    assert!(spikes.iter().all(|s| s["action"] == "alert"), "{spikes:?}");
    assert!(kinds(&ev, "rollback").is_empty() && kinds(&ev, "stop").is_empty());
    assert!(events(&store, "off").is_empty());
}

/// One rank per process over two ranks: each rank watches its own share of the loss (there is
/// no collective to agree through), alerts about the corrupted batch with its rank, and the
/// training is the same as all ranks in one process.
#[test]
fn one_rank_per_process_alerts_on_its_share() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s");
    let extra = [
        "--layout",
        "tp=2",
        "--steps",
        "40",
        "--inject-spike-at",
        "30",
        "--on-spike",
        "alert",
    ];
    let procs = train_procs(&store, "procs", 2, &args(&extra));
    let threads = ok(&store, "threads", &extra);
    assert_eq!(procs, threads);
    let ev = events(&store, "procs");
    let mut by_rank: Vec<(u64, u64)> = kinds(&ev, "spike")
        .iter()
        .map(|s| (s["rank"].as_u64().unwrap(), s["step"].as_u64().unwrap()))
        .collect();
    by_rank.sort();
    assert_eq!(by_rank, vec![(0, 30), (1, 30)], "{ev:?}");
}

#[test]
fn bounded_rollbacks_stop_with_the_history_even_after_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s");
    let run = [
        "--steps",
        "100",
        "--ckpt-every",
        "10",
        "--inject-spike-at",
        "35,60,80",
        "--on-spike",
        "rollback",
        "--max-rollbacks",
        "2",
    ];
    let err = fails(&store, "bounded", &run);
    // Batch 35 at step 35 -> back to 30; then step s reads batch s+5, so batch 60 comes at
    // step 55 -> back to 50; then s+10: batch 80 at step 70 is one spike too many.
    assert!(err.contains("rolled back 2 times"), "{err}");
    assert!(
        err.contains("skipped batches 31-35") && err.contains("skipped batches 56-60"),
        "{err}"
    );
    let ev = events(&store, "bounded");
    let spikes: Vec<(u64, u64, &str)> = kinds(&ev, "spike")
        .iter()
        .map(|s| {
            (
                s["step"].as_u64().unwrap(),
                s["batch"].as_u64().unwrap(),
                s["action"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        spikes,
        vec![(35, 35, "rollback"), (55, 60, "rollback"), (70, 80, "stop")]
    );
    let rb: Vec<(u64, u64)> = kinds(&ev, "rollback")
        .iter()
        .map(|r| {
            (
                r["from_step"].as_u64().unwrap(),
                r["to_step"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(rb, vec![(35, 30), (55, 50)]);
    let stop = kinds(&ev, "stop");
    assert_eq!(stop.len(), 1);
    assert_eq!(stop[0]["step"].as_u64(), Some(70));
    assert_eq!(stop[0]["rollbacks"].as_array().unwrap().len(), 2);
    assert_eq!(
        stop[0]["rollbacks"][1]["skipped"],
        serde_json::json!([56, 60])
    );
    assert_eq!(latest_committed(&store, "bounded"), Some(60));

    // Resumed from step 60, the run keeps its rollback count and its window: the spike 10
    // steps later (inside a fresh warm-up of 20) is caught and stops it again.
    let mut resume = run.to_vec();
    resume.push("--resume");
    let err = fails(&store, "bounded", &resume);
    assert!(
        err.contains("loss spike at step 70") && err.contains("rolled back 2 times"),
        "{err}"
    );
    assert_eq!(kinds(&events(&store, "bounded"), "stop").len(), 2);
}

#[test]
fn no_false_alarm_over_10000_healthy_steps() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s");
    let m = dir.path().join("m.jsonl");
    // About 1,800 parameters: noisier per-batch loss than any larger model, and 10,000 steps
    // in seconds. Rollback, so that a false alarm would also change the steps.
    train(
        &store,
        "healthy",
        &[
            "--d-model",
            "8",
            "--layers",
            "1",
            "--layout",
            "dp=2",
            "--steps",
            "10000",
            "--ckpt-every",
            "2500",
            "--on-spike",
            "rollback",
            "--metrics-out",
            m.to_str().unwrap(),
        ],
    );
    // The persist governor's pacing (`persist_rate`) is no alarm: on a busy machine a step of
    // a quarter of a millisecond beside a persist can run 1.2x its baseline, and the governor
    // then lowers the persist's rate, as it should (seen in CI, 2026-12-07).
    let ev: Vec<Value> = events(&store, "healthy")
        .into_iter()
        .filter(|v| v["kind"] != "persist_rate")
        .collect();
    assert!(ev.is_empty(), "false alarms: {ev:?}");
    let s = steps(&m);
    assert_eq!(step_seq(&s), (1..=10_000).collect::<Vec<_>>());
    let first = s[0].2.unwrap();
    let last = s[9_999].2.unwrap();
    assert!(
        last < first / 10.0,
        "the run did not train: {first} -> {last}"
    );
    // Every step record carries the monitors' figures.
    let rec = metrics(&m)
        .into_iter()
        .find(|v| v["kind"] == "step")
        .unwrap();
    assert!(rec["step_time_s"].as_f64().unwrap() >= 0.0);
    assert!(rec["host_mem_bytes"].as_u64().unwrap() > 1 << 20);
    assert!(rec["device_mem_bytes"].is_null());
    // ... and the run's metrics log in the store has them all, timed.
    let logged: Vec<Value> = read_log(&store, "healthy", ckpt_store::logs::METRICS)
        .into_iter()
        .filter(|v| v["kind"] == "step")
        .collect();
    assert_eq!(logged.len(), 10_000);
    assert!(
        logged
            .iter()
            .all(|v| v["t_ms"].is_i64() && v["loss"].is_f64())
    );
}

#[test]
fn rollback_needs_the_global_loss_with_one_rank_per_process() {
    let dir = tempfile::tempdir().unwrap();
    let err = fails(
        dir.path(),
        "r",
        &[
            "--layout",
            "dp=2",
            "--rank",
            "1",
            "--steps",
            "5",
            "--on-spike",
            "rollback",
        ],
    );
    assert!(
        err.contains("--on-spike rollback needs the exact global loss"),
        "{err}"
    );
}

/// `ckpt` from this workspace's target directory (built if missing or stale).
fn ckpt_bin() -> PathBuf {
    let dir = Path::new(BIN).parent().expect("the profile directory");
    ckpt_store::testing::workspace_bin(dir, "ckpt", "ckpt", &[])
}

#[test]
#[allow(
    clippy::disallowed_methods,
    reason = "a test reads its knobs and tools from the environment"
)]
fn plot_shows_the_spike_and_the_rollback() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s");
    ok(
        &store,
        "spiky",
        &[
            "--layout",
            "dp=2",
            "--steps",
            "80",
            "--ckpt-every",
            "10",
            "--inject-spike-at",
            "45",
            "--on-spike",
            "rollback",
            "--step-time-ms",
            "3",
        ],
    );
    let plot = |name: &str| {
        let out = dir.path().join(name);
        let o = Command::new(ckpt_bin())
            .arg("--store")
            .arg(&store)
            .args(["plot", "spiky", "--json", "--out"])
            .arg(&out)
            .output()
            .expect("spawn ckpt");
        assert!(
            o.status.success(),
            "ckpt plot: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let j: Value = serde_json::from_slice(&o.stdout).expect("plot --json");
        (out, j)
    };
    let (png, j) = plot("spiky.png");
    assert_eq!(
        (j["rollbacks"].as_u64(), j["spikes"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(j["points"].as_u64(), Some(80 + 5), "steps 41-45 twice");
    let b = std::fs::read(&png).unwrap();
    assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&b[12..16], b"IHDR");
    assert_eq!(u32::from_be_bytes(b[16..20].try_into().unwrap()), 1200);
    assert_eq!(u32::from_be_bytes(b[20..24].try_into().unwrap()), 720);
    assert!(
        b.len() > 20_000,
        "a {} byte PNG is too small to hold the chart",
        b.len()
    );
    assert_eq!(&b[b.len() - 8..b.len() - 4], b"IEND");

    let (svg, _) = plot("spiky.svg");
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<?xml") && s.trim_end().ends_with("</svg>"));
    assert!(s.len() > 5_000);
    for want in [
        "run spiky",
        "rollback 45→40",
        "spike @45",
        "1 rollback",
        "1 loss spike",
        "<polyline",
    ] {
        assert!(s.contains(want), "the SVG shows {want:?}");
    }
    if let Ok(d) = std::env::var("CKPT_PLOT_SAMPLE_DIR") {
        let _ = std::fs::copy(&png, Path::new(&d).join("rollback-sample.png"));
        let _ = std::fs::copy(&svg, Path::new(&d).join("rollback-sample.svg"));
    }
}
