use super::*;

use super::render::Svg;
use super::scale::value_label;
use super::series::{segments, spike_points};

#[test]
fn ticks_and_labels() {
    assert_eq!(
        nice_ticks(0.0, 10.0, 5),
        vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    );
    assert_eq!(nice_ticks(2.13, 2.61, 5), vec![2.2, 2.3, 2.4, 2.5, 2.6]);
    assert!(nice_ticks(1.0, 1.0, 5).is_empty());
    assert_eq!(time_step(3600.0, 8), 600.0);
    assert_eq!(time_step(50.0, 10), 5.0);
    assert_eq!(elapsed_label(0.0), "0");
    assert_eq!(elapsed_label(90.0), "1m30s");
    assert_eq!(elapsed_label(7200.0), "2h");
    assert_eq!(elapsed_label(5400.0), "1h30m");
    assert_eq!(elapsed_label(129600.0), "1d12h");
    assert_eq!(value_label(2.5), "2.5");
    assert_eq!(value_label(1e-5), "1e-5");
    assert_eq!(value_label(2.5e-4), "2.5e-4");
    assert_eq!(value_label(-7.5e-4), "-7.5e-4");
    assert_eq!(value_label(1.234e6), "1.23e6");
}

#[test]
fn series_picks_one_rank_and_splits_at_interruptions() {
    let rec = |v: serde_json::Value| v;
    let metrics = vec![
        rec(
            serde_json::json!({"kind":"step","step":1,"loss":3.0,"grad_norm":1.0,"rank":0,"t_ms":1000}),
        ),
        rec(serde_json::json!({"kind":"step","step":1,"loss":3.0,"rank":1,"t_ms":1001})),
        rec(serde_json::json!({"kind":"step","step":2,"loss":2.5,"rank":0,"t_ms":2000})),
        rec(serde_json::json!({"kind":"step","step":3,"loss":"nan","rank":0,"t_ms":3000})),
        rec(serde_json::json!({"kind":"checkpoint","step":2,"t_ms":2500})),
        rec(serde_json::json!({"kind":"checkpoint","step":3,"rank":0,"t_ms":3100})),
        rec(serde_json::json!({"kind":"checkpoint","step":3,"rank":1,"t_ms":3101})),
        rec(serde_json::json!({"kind":"step","step":2,"loss":2.6,"rank":0,"t_ms":90000})),
    ];
    let events = vec![
        rec(serde_json::json!({"kind":"failure","rank":1,"how":"signal","t_ms":3500})),
        rec(
            serde_json::json!({"kind":"recovery","layout":"dp=1","step":2,"steps_lost":1,"t_ms":80000}),
        ),
    ];
    let s = series(&metrics, &events);
    assert_eq!(s.loss.len(), 3);
    assert_eq!(s.grad_norm.len(), 1);
    assert_eq!(
        s.checkpoints.len(),
        2,
        "one mark per checkpoint, not per rank"
    );
    assert_eq!(s.failures[0].label, "✕ rank 1 signal");
    assert!(s.recoveries[0].label.contains("−1 steps"));
    assert_eq!(s.span, 89.0);
    assert_eq!(
        segments(&s.loss).len(),
        2,
        "the resume from step 2 starts a new segment"
    );
}

/// A spike a thousand times the loss stays out of a linear axis' range (the rest of the
/// curve stays readable), is labelled with its value, and a monitor stop is marked.
#[test]
fn spikes_stay_out_of_the_range_and_stops_are_marked() {
    let mut metrics = Vec::new();
    for step in 1..=50u64 {
        let loss = if step == 30 {
            1000.0
        } else {
            1.5 - step as f64 * 0.01
        };
        metrics.push(serde_json::json!({"kind":"step","step":step,"loss":loss,"grad_norm":2.0,"t_ms":1000 * step}));
    }
    // After the rollback to 25, step 30 comes again, healthy.
    for step in 26..=35u64 {
        metrics.push(serde_json::json!({"kind":"step","step":step,"loss":1.2,"grad_norm":2.0,"t_ms":60_000 + 1000 * step}));
    }
    let events = vec![
        serde_json::json!({"kind":"spike","step":30,"what":"loss","loss":1000.0,"action":"rollback","t_ms":30_010}),
        serde_json::json!({"kind":"rollback","from_step":30,"to_step":25,"t_ms":30_050}),
        serde_json::json!({"kind":"spike","step":35,"what":"nonfinite","loss":null,"action":"stop","t_ms":95_010}),
        serde_json::json!({"kind":"stop","step":35,"reason":"NaN","t_ms":95_020}),
    ];
    let s = series(&metrics, &events);
    assert_eq!(
        (s.spikes.len(), s.rollbacks.len(), s.stops.len()),
        (2, 1, 1)
    );
    assert_eq!(s.spikes[1].label, "NaN @35");
    let spiky = spike_points(&s);
    assert_eq!(spiky.len(), 1, "only the first step 30 is the spike's");
    assert!(spiky.contains(&(30, 29.0f64.to_bits())));
    let mut c = Svg::new(1200.0, 720.0);
    draw(&mut c, "r", &s, false);
    let svg = c.finish();
    for want in [
        "spike @30 (1000)",
        "stopped @35",
        "rollback 30→25",
        "1 stop",
    ] {
        assert!(svg.contains(want), "the SVG shows {want:?}");
    }
    assert!(svg.contains(">1.2</text>"), "ticks follow the healthy loss");
    assert!(!svg.contains(">200</text>"), "no tick scaled to the spike");
    // On a log axis everything fits: the spike is in the range.
    let mut c = Svg::new(1200.0, 720.0);
    draw(&mut c, "r", &s, true);
    assert!(c.finish().contains(">1000</text>"));
}
