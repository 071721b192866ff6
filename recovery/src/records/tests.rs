//! The records' list against FORMAT.md, their round trips, old and unknown records.

use std::fmt;

use serde_json::json;

use super::*;

/// The record names FORMAT.md lists under a `<!-- records: LOG -->` marker: the first
/// backticked word of each row of the table that follows.
fn documented(log: &str) -> Vec<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../FORMAT.md");
    let doc = std::fs::read_to_string(path).expect("FORMAT.md");
    let marker = format!("<!-- records: {log} -->");
    let start = doc
        .find(&marker)
        .unwrap_or_else(|| panic!("FORMAT.md has no {marker}"));
    let mut out = Vec::new();
    let mut in_table = false;
    for line in doc[start + marker.len()..].lines() {
        let line = line.trim();
        if !line.starts_with('|') {
            if in_table {
                break;
            }
            continue;
        }
        in_table = true;
        let first = line.trim_start_matches('|').split('|').next().unwrap_or("");
        if let Some(name) = first
            .trim()
            .strip_prefix('`')
            .and_then(|s| s.split('`').next())
        {
            out.push(name.to_string());
        }
    }
    out
}

fn check_documented<T: LogRecord>() {
    let doc = documented(T::LOG);
    assert!(!doc.is_empty(), "FORMAT.md lists no {} records", T::LOG);
    for k in T::KINDS {
        assert!(
            doc.iter().any(|d| d == k),
            "the {} record {k:?} is not documented in FORMAT.md (\"Logs\")",
            T::LOG
        );
    }
    for d in &doc {
        assert!(
            T::KINDS.contains(&d.as_str()),
            "FORMAT.md documents a {} record {d:?} that no type has",
            T::LOG
        );
    }
}

#[test]
fn format_md_lists_every_record_and_only_those() {
    check_documented::<Metric>();
    check_documented::<Event>();
}

fn round_trip<T: LogRecord + PartialEq + fmt::Debug>(all: Vec<T>) {
    assert_eq!(all.len(), T::KINDS.len());
    for (r, k) in all.into_iter().zip(T::KINDS) {
        assert_eq!(r.kind(), *k);
        let mut v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["kind"], *k);
        v["t_ms"] = json!(5);
        v["a_future_field"] = json!([1, 2]);
        let back = parse_records::<T>(&[v]);
        assert_eq!(back, vec![Logged { t_ms: 5, record: r }]);
    }
}

#[test]
fn every_kind_round_trips_with_unknown_fields() {
    round_trip(Metric::one_of_each());
    round_trip(Event::one_of_each());
}

#[test]
fn readers_skip_unknown_kinds_and_read_old_records() {
    let lines = vec![
        json!({"kind": "a_future_record", "t_ms": 1}),
        json!("not an object"),
        json!({"step": 3}),
        // An old writer's NaN as a string; a record without most fields.
        json!({"kind": "step", "step": 3, "loss": "nan", "grad_norm": 2.0, "t_ms": 2}),
        json!({"kind": "checkpoint", "step": 2, "t_ms": 3}),
        json!({"kind": "store", "store.puts": 4, "store.retries": 1, "t_ms": 4}),
        // A known kind whose fields do not read: skipped, not fatal.
        json!({"kind": "final", "step": "three", "t_ms": 5}),
    ];
    let m = parse_records::<Metric>(&lines);
    assert_eq!(m.len(), 3);
    let Metric::Step(s) = &m[0].record else {
        panic!("{m:?}")
    };
    assert_eq!(
        (s.step, s.loss, s.grad_norm, m[0].t_ms),
        (3, None, Some(2.0), 2)
    );
    let Metric::Store(c) = &m[2].record else {
        panic!("{m:?}")
    };
    assert_eq!(c.counters.len(), 2, "t_ms is not a counter: {c:?}");
    assert!(parse_records::<Event>(&lines).is_empty());
}

#[test]
fn the_on_disk_shape_is_unchanged() {
    let r = Event::Recovery(Recovery {
        generation: 2,
        nodes: vec![0, 2],
        layout: "dp=2".into(),
        step: None,
        steps_lost: 3,
        backoff_s: 0.5,
        at_ms: 9,
        plan: None,
    });
    assert_eq!(
        serde_json::to_value(&r).unwrap(),
        json!({"kind": "recovery", "generation": 2, "nodes": [0, 2], "layout": "dp=2",
               "step": null, "steps_lost": 3, "backoff_s": 0.5, "at_ms": 9})
    );
    let s = Metric::Step(StepMetrics {
        step: 4,
        generation: Some(1),
        loss: Some(f64::NAN),
        grad_norm: Some(1.5),
        ..Default::default()
    });
    assert_eq!(
        serde_json::to_value(&s).unwrap(),
        json!({"kind": "step", "step": 4, "generation": 1, "loss": null, "grad_norm": 1.5})
    );
}
