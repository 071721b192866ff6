use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};

use super::failures::{Rng, Schedule, match_injections};
use super::run::lost_steps;
use super::{FailureKind, Injection};

#[test]
fn a_schedule_replays_from_its_seed_and_uses_every_kind_each_round() {
    let draw = |seed| {
        let mut s = Schedule::new(seed);
        (0..8)
            .map(|_| (s.gap(Duration::from_secs(10), None), s.kind()))
            .collect::<Vec<_>>()
    };
    assert_eq!(draw(7), draw(7));
    assert_ne!(draw(7), draw(8));
    for round in draw(7).chunks(4) {
        let kinds: BTreeSet<&str> = round.iter().map(|(_, k)| k.name()).collect();
        assert_eq!(kinds.len(), 4, "{round:?}");
    }
    // The mean gap is about the mean asked for.
    let mut r = Rng::new(1);
    let n = 20_000;
    let mean: f64 = (0..n)
        .map(|_| r.exp(Duration::from_secs(15)).as_secs_f64())
        .sum::<f64>()
        / n as f64;
    assert!((mean - 15.0).abs() < 0.5, "{mean}");
}

#[test]
fn injections_match_failure_records_of_their_generation_and_node() {
    let inj = |kind, generation, node, damaged_step| Injection {
        at_s: 1.0,
        kind,
        generation,
        node,
        pids: vec![],
        damaged_step,
        damaged_object: None,
        detected: false,
        recovered: false,
        failure_to_step_s: None,
    };
    let mut injections = vec![
        inj(FailureKind::RankKilled, 0, 0, None),
        inj(FailureKind::DiskDamaged, 1, 4, Some(20)),
        inj(FailureKind::RankHung, 2, 5, None),
    ];
    let records = vec![
        json!({"kind": "started", "generation": 0}),
        json!({"kind": "failure", "generation": 0, "node": 0, "at_ms": 5000, "detection_s": 0.0}),
        json!({"kind": "started", "generation": 1}),
        json!({"kind": "resumed", "generation": 1, "at_ms": 6500}),
        json!({"kind": "failure", "generation": 1, "node": 4, "at_ms": 9000, "detection_s": 0.0}),
        // The damage was found while choosing: the step_unusable record is the next
        // generation's.
        json!({"kind": "step_unusable", "generation": 2, "step": 20}),
        json!({"kind": "started", "generation": 2}),
        json!({"kind": "resumed", "generation": 2, "at_ms": 10000}),
        // The hang: detected on another node than the one stopped (no match), and an
        // extra failure.
        json!({"kind": "failure", "generation": 2, "node": 3, "at_ms": 12000, "detection_s": 2.0}),
        json!({"kind": "started", "generation": 3}),
    ];
    let extra = match_injections(&mut injections, &records, true);
    assert_eq!(extra, 1);
    assert!(injections[0].detected && injections[0].recovered);
    assert_eq!(injections[0].failure_to_step_s, Some(1.5));
    assert!(injections[1].detected && injections[1].recovered);
    assert_eq!(injections[1].failure_to_step_s, Some(1.0));
    assert!(!injections[2].detected && !injections[2].recovered);
    // Without the step_unusable record the damage was not detected.
    let mut again = vec![inj(FailureKind::DiskDamaged, 1, 4, Some(20))];
    let no_unusable: Vec<Value> = records
        .iter()
        .filter(|r| r["kind"] != "step_unusable")
        .cloned()
        .collect();
    match_injections(&mut again, &no_unusable, true);
    assert!(!again[0].detected);
    // A job that did not complete recovered from nothing.
    let mut third = vec![inj(FailureKind::RankKilled, 0, 0, None)];
    match_injections(&mut third, &records, false);
    assert!(third[0].detected && !third[0].recovered);
}

#[test]
fn steps_retention_deleted_below_newer_ones_retired_after_it_are_not_lost() {
    let set = |v: &[u64]| v.iter().copied().collect::<BTreeSet<u64>>();
    // The CI run of seed 584642: steps 5, 45..285 seen; at the end 250..275 committed, 280 and
    // 285 damaged and retired; retention keeps 8.
    let seen: BTreeSet<u64> = std::iter::once(5).chain((45..=285).step_by(5)).collect();
    let now: BTreeSet<u64> = (250..=275).step_by(5).collect();
    assert_eq!(
        lost_steps(&seen, &now, &set(&[280, 285]), Some(8)),
        Vec::<u64>::new()
    );
    // Had 280 and 285 gone for no reason, six committed steps would be fewer than retention
    // keeps: every step gone is lost (the 42 older ones the CI run reported, and those two).
    assert_eq!(lost_steps(&seen, &now, &set(&[]), Some(8)).len(), 44);
    // A step gone above the line is lost, whatever the retired ones (seven kept, retention
    // of seven: the line is 250).
    let mut gapped = now.clone();
    gapped.remove(&270);
    assert_eq!(
        lost_steps(&seen, &gapped, &set(&[280, 285]), Some(7)),
        vec![270]
    );
    // Without retention, every step gone is lost but the retired ones.
    assert_eq!(
        lost_steps(&set(&[5, 10, 280]), &set(&[10]), &set(&[280]), None),
        vec![5]
    );
}
