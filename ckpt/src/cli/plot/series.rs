//! The series a plot shows, pulled out of the metrics and events records.

use ckpt_recovery::records::{Event, Metric, parse_records};
use serde_json::Value;

/// A loss or grad-norm point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// Seconds since the first record.
    pub t: f64,
    /// Step.
    pub step: u64,
    /// Value.
    pub v: f64,
}

/// A marked event.
#[derive(Debug, Clone, PartialEq)]
pub struct Mark {
    /// Seconds since the first record.
    pub t: f64,
    /// Short label.
    pub label: String,
    /// A value on the loss axis (spikes).
    pub v: Option<f64>,
}

/// Everything a plot shows, extracted from the logs.
#[derive(Debug, Clone, Default)]
pub struct Series {
    /// Unix ms of time 0.
    pub t0_ms: i64,
    /// Loss per step (one rank's).
    pub loss: Vec<Point>,
    /// Gradient norm per step.
    pub grad_norm: Vec<Point>,
    /// Checkpoints.
    pub checkpoints: Vec<Mark>,
    /// Failures.
    pub failures: Vec<Mark>,
    /// Recoveries.
    pub recoveries: Vec<Mark>,
    /// Rollbacks.
    pub rollbacks: Vec<Mark>,
    /// Loss spikes.
    pub spikes: Vec<Mark>,
    /// Runs stopped by the spike monitor.
    pub stops: Vec<Mark>,
    /// Seconds from the first record to the last.
    pub span: f64,
}

/// Pull the series out of log records (each with `t_ms`), read as [`Metric`]s and
/// [`Event`]s (records of other kinds are left out).
pub fn series(metrics: &[Value], events: &[Value]) -> Series {
    let metrics = parse_records::<Metric>(metrics);
    let events = parse_records::<Event>(events);
    let times = || {
        metrics
            .iter()
            .map(|m| m.t_ms)
            .chain(events.iter().map(|e| e.t_ms))
    };
    let t0 = times().min().unwrap_or(0);
    let t1 = times().max().unwrap_or(0);
    let rel = |t: i64| (t - t0) as f64 / 1000.0;
    // Loss is the same on every data-parallel rank; plot the lowest rank that logs it.
    let rank0 = metrics
        .iter()
        .filter_map(|m| match &m.record {
            Metric::Step(s) => s.rank,
            _ => None,
        })
        .min();
    let mut s = Series {
        t0_ms: t0,
        span: (t1 - t0) as f64 / 1000.0,
        ..Series::default()
    };
    for m in &metrics {
        let t = rel(m.t_ms);
        match &m.record {
            Metric::Step(r) => {
                if r.rank.is_some() && r.rank != rank0 {
                    continue;
                }
                let step = r.step;
                if let Some(l) = r.loss.filter(|x| x.is_finite()) {
                    s.loss.push(Point { t, step, v: l });
                }
                if let Some(g) = r.grad_norm.filter(|x| x.is_finite()) {
                    s.grad_norm.push(Point { t, step, v: g });
                }
            }
            // Every rank logs its part of a checkpoint; one mark per checkpoint.
            Metric::Checkpoint(c) if c.rank.is_none() || c.rank == rank0 => {
                s.checkpoints.push(Mark {
                    t,
                    label: format!("ckpt {}", c.step),
                    v: None,
                })
            }
            _ => {}
        }
    }
    for e in &events {
        mark_event(&mut s, rel(e.t_ms), &e.record);
    }
    for p in [&mut s.loss, &mut s.grad_norm] {
        p.sort_by(|a, b| a.t.total_cmp(&b.t));
    }
    s
}

/// The mark of event `e` at `t` seconds, in its list of `s` (events of other kinds are left
/// out).
fn mark_event(s: &mut Series, t: f64, e: &Event) {
    match e {
        Event::Failure(f) => s.failures.push(Mark {
            t,
            label: format!(
                "✕ rank {} {}",
                f.rank,
                if f.how.is_empty() { "failed" } else { &f.how }
            ),
            v: None,
        }),
        Event::Recovery(r) => s.recoveries.push(Mark {
            t,
            label: format!(
                "recovered {} @{} (−{} steps)",
                r.layout,
                r.step.map_or("?".into(), |x| x.to_string()),
                r.steps_lost
            ),
            v: None,
        }),
        Event::Rollback(r) => s.rollbacks.push(Mark {
            t,
            label: format!("rollback {}→{}", r.from_step, r.to_step),
            v: None,
        }),
        Event::Spike(p) => s.spikes.push(Mark {
            t,
            label: format!(
                "{} @{}",
                match p.what.as_str() {
                    "nonfinite" => "NaN",
                    "grad_norm" => "grad blow-up",
                    _ => "spike",
                },
                p.step
            ),
            v: p.loss.filter(|x| x.is_finite()),
        }),
        Event::Stop(p) => s.stops.push(Mark {
            t,
            label: format!("stopped @{}", p.step),
            v: None,
        }),
        _ => {}
    }
}

/// The loss (and grad-norm) points of spike steps, as (step, time bits): for each spike, the
/// newest point of its step at or before the spike's record whose loss is the spike's (the
/// monitor logs the same number), or, for a NaN, none (it is not drawn anyway).
pub(super) fn spike_points(s: &Series) -> std::collections::HashSet<(u64, u64)> {
    let mut out = std::collections::HashSet::new();
    for m in &s.spikes {
        let Some(v) = m.v else { continue };
        if let Some(p) = s
            .loss
            .iter()
            .filter(|p| p.v == v && p.t <= m.t + 1e-9)
            .max_by(|a, b| a.t.total_cmp(&b.t))
        {
            out.insert((p.step, p.t.to_bits()));
        }
    }
    out
}

/// Split a series where the run was interrupted: time gaps much longer than the usual step
/// interval, or the step going backwards (a resume or rollback from an older checkpoint).
pub(super) fn segments(pts: &[Point]) -> Vec<&[Point]> {
    if pts.len() < 2 {
        return vec![pts];
    }
    let mut dts: Vec<f64> = pts.windows(2).map(|w| w[1].t - w[0].t).collect();
    dts.sort_by(f64::total_cmp);
    let median = dts[dts.len() / 2];
    let gap = (median * 20.0).max(1.0);
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..pts.len() {
        if pts[i].t - pts[i - 1].t > gap || pts[i].step <= pts[i - 1].step {
            out.push(&pts[start..i]);
            start = i;
        }
    }
    out.push(&pts[start..]);
    out
}
