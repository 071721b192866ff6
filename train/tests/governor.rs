//! `ckpt-train --persist-budget`: every persist of every rank gets a `persist` metrics record
//! (slowdown, time to durable, the rate it settled at); `off` writes none; a bad budget is
//! refused naming the flag.

mod common;
use common::*;

use std::collections::BTreeSet;

#[test]
fn every_persist_is_reported_and_off_reports_none() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("store");
    let m = d.path().join("on.jsonl");
    let extra = [
        "--layout",
        "dp=2",
        "--steps",
        "40",
        "--ckpt-every",
        "10",
        "--step-time-ms",
        "5",
        "--persist-budget",
        "10%",
    ];
    let mut a: Vec<&str> = extra.to_vec();
    a.extend(["--metrics-out", m.to_str().unwrap()]);
    let on = train(&store, "on", &a);
    let persists: Vec<serde_json::Value> = metrics(&m)
        .into_iter()
        .filter(|v| v["kind"] == "persist")
        .collect();
    for rank in 0..2u64 {
        let steps: BTreeSet<u64> = persists
            .iter()
            .filter(|v| v["rank"] == rank)
            .map(|v| v["step"].as_u64().unwrap())
            .collect();
        assert_eq!(
            steps,
            BTreeSet::from([10, 20, 30, 40]),
            "rank {rank}: {persists:?}"
        );
    }
    for v in &persists {
        assert!(v["durable_s"].as_f64().unwrap() > 0.0, "{v}");
        assert_eq!(v["budget"].as_f64(), Some(0.1), "{v}");
        assert!(v["bytes"].as_u64().unwrap() > 0, "{v}");
        assert!(v.get("rate_bps").is_some(), "{v}");
    }

    // Off: no governor, no records; the same training result (pacing never changes data).
    let m2 = d.path().join("off.jsonl");
    let mut b: Vec<&str> = extra[..extra.len() - 1].to_vec();
    b.extend(["off", "--metrics-out", m2.to_str().unwrap()]);
    let off = train(&store, "off", &b);
    assert_eq!(on, off);
    assert!(
        !metrics(&m2).iter().any(|v| v["kind"] == "persist"),
        "a governor that is off reports nothing"
    );
}

#[test]
fn a_bad_budget_is_refused_naming_the_flag() {
    let d = tempfile::tempdir().unwrap();
    let out = cmd(
        d.path(),
        "bad",
        &["--steps", "1", "--persist-budget", "lots"],
    )
    .output()
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--persist-budget") && err.contains("lots"),
        "{err}"
    );
}
