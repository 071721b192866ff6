//! `ckpt plot RUN --out FILE.png|svg`: a run's loss (and gradient norm) on one wall-clock time
//! axis, with checkpoints, failures, recoveries, rollbacks, loss spikes and monitor stops
//! marked, from the run's metrics and events logs ([`ckpt_store::logs`]).
//!
//! On a linear axis the steps of a spike are left out of the axis range (a spike is often a
//! thousand times the loss and would flatten the rest): their curve is clipped at the top of
//! the panel and the spike's marker there is labelled with its value.
//!
//! Records read ([`ckpt_recovery::records`]; others are ignored): metrics `step` (`loss`,
//! `grad_norm`, of the lowest rank that logs them) and `checkpoint`; events `failure`,
//! `recovery`, `rollback`, `spike` and `stop` (the monitor stopped the run).

use std::io::Write;
use std::path::PathBuf;

use ckpt_recovery::records::{Event, Metric, parse_records};
use ckpt_store::logs::{EVENTS, METRICS, read_log};
use ckpt_store::{Store, validate_run};
use serde::Serialize;
use serde_json::Value;

use super::fmt;
use super::render::{Anchor, Canvas, Color, Pen, Png, Svg, text_width};
use super::{CliError, Report, Result, Ui};

/// Arguments of `ckpt plot`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlotArgs {
    /// The run.
    pub run: String,
    /// The image to write: .png or .svg (written beside it as .NAME.partial, then renamed; a
    /// symbolic link or special file at either name is refused).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Width in pixels.
    #[arg(long, default_value_t = 1200)]
    pub width: u32,
    /// Height in pixels.
    #[arg(long, default_value_t = 720)]
    pub height: u32,
    /// Logarithmic loss axis.
    #[arg(long)]
    pub log_y: bool,
}

impl PlotArgs {
    /// Plot `run` into `out` with defaults.
    pub fn new(run: &str, out: impl Into<PathBuf>) -> Self {
        PlotArgs {
            run: run.into(),
            out: out.into(),
            width: 1200,
            height: 720,
            log_y: false,
        }
    }
}

/// What `ckpt plot` drew.
#[derive(Debug, Clone, Serialize)]
pub struct PlotReport {
    /// Run.
    pub run: String,
    /// The file written.
    pub out: String,
    /// `png` or `svg`.
    pub format: String,
    /// Loss points.
    pub points: usize,
    /// First and last step plotted.
    pub steps: Option<(u64, u64)>,
    /// Checkpoints marked.
    pub checkpoints: usize,
    /// Failures marked.
    pub failures: usize,
    /// Recoveries marked.
    pub recoveries: usize,
    /// Rollbacks marked.
    pub rollbacks: usize,
    /// Loss spikes marked.
    pub spikes: usize,
    /// Monitor stops marked.
    pub stops: usize,
    /// Seconds from the first record to the last.
    pub span_s: f64,
    /// Bytes of the file.
    pub bytes: u64,
}

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
        let t = rel(e.t_ms);
        match &e.record {
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
    for p in [&mut s.loss, &mut s.grad_norm] {
        p.sort_by(|a, b| a.t.total_cmp(&b.t));
    }
    s
}

/// Read the run's logs and draw them.
pub async fn plot(store: &Store, args: &PlotArgs, ui: &Ui) -> Result<PlotReport> {
    validate_run(&args.run).map_err(|e| CliError::usage(e.to_string()))?;
    let ext = args
        .out
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let format = match ext.as_deref() {
        Some("png") => "png",
        Some("svg") => "svg",
        _ => {
            return Err(CliError::usage(format!(
                "--out {}: the file name must end in .png or .svg",
                args.out.display()
            )));
        }
    };
    if !(200..=10000).contains(&args.width) || !(150..=10000).contains(&args.height) {
        return Err(CliError::usage(
            "--width must be 200..10000 and --height 150..10000 pixels",
        ));
    }
    let pb = ui.spinner(format!("reading the logs of {}", args.run));
    let metrics = read_log(store, &args.run, METRICS).await?;
    let events = read_log(store, &args.run, EVENTS).await?;
    pb.finish_and_clear();
    let s = series(&metrics, &events);
    if s.loss.is_empty() && s.grad_norm.is_empty() {
        let has_run = store.list_runs().await?.iter().any(|r| r == &args.run);
        let why = if !has_run {
            return Err(super::parse::no_such_run(store, &args.run).await);
        } else if metrics.is_empty() {
            format!(
                "run {} has no metrics log (the trainer writes runs/{}/{METRICS}/)",
                args.run, args.run
            )
        } else {
            format!(
                "the metrics log of run {} has {} records but none of kind \"step\" with a finite loss",
                args.run,
                metrics.len()
            )
        };
        return Err(CliError::error(format!("nothing to plot: {why}")));
    }
    let bytes = match format {
        "svg" => {
            let mut c = Svg::new(args.width as f32, args.height as f32);
            draw(&mut c, &args.run, &s, args.log_y);
            c.finish().into_bytes()
        }
        _ => {
            let mut c = Png::new(args.width, args.height);
            draw(&mut c, &args.run, &s, args.log_y);
            c.finish()
                .map_err(|e| CliError::error(format!("encoding the PNG: {e}")))?
        }
    };
    // Through a fresh `.NAME.partial`, renamed over NAME: never through a link planted at
    // either name (refused, naming it).
    ckpt_store::outfile::write_replacing(&args.out, &bytes)
        .map_err(|e| CliError::error(format!("writing {}: {e}", args.out.display())))?;
    Ok(PlotReport {
        run: args.run.clone(),
        out: args.out.display().to_string(),
        format: format.into(),
        points: s.loss.len(),
        steps: match (
            s.loss.iter().map(|p| p.step).min(),
            s.loss.iter().map(|p| p.step).max(),
        ) {
            (Some(a), Some(b)) => Some((a, b)),
            _ => None,
        },
        checkpoints: s.checkpoints.len(),
        failures: s.failures.len(),
        recoveries: s.recoveries.len(),
        rollbacks: s.rollbacks.len(),
        spikes: s.spikes.len(),
        stops: s.stops.len(),
        span_s: s.span,
        bytes: bytes.len() as u64,
    })
}

// ----- drawing --------------------------------------------------------------------------------

const INK: Color = Color::rgb(40, 40, 48);
const MUTED: Color = Color::rgb(110, 110, 120);
const GRID: Color = Color::rgb(228, 228, 234);
const LOSS: Color = Color::rgb(31, 119, 180);
const GRAD: Color = Color::rgb(120, 81, 169);
const CKPT: Color = Color::rgb(44, 160, 44);
const FAIL: Color = Color::rgb(214, 39, 40);
const RECOVER: Color = Color::rgb(23, 190, 207);
const ROLLBACK: Color = Color::rgb(255, 127, 14);
const SPIKE: Color = Color::rgb(255, 127, 14);
const STOP: Color = Color::rgb(150, 20, 20);

/// A y axis: maps values to pixels.
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
    top: f32,
    bottom: f32,
}

impl Axis {
    fn new(vals: impl Iterator<Item = f64>, log: bool, top: f32, bottom: f32) -> Axis {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in vals.filter(|v| v.is_finite() && (!log || *v > 0.0)) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if !lo.is_finite() {
            (lo, hi) = if log { (0.1, 10.0) } else { (0.0, 1.0) };
        }
        if log {
            let (a, b) = (lo.log10().floor(), hi.log10().ceil());
            (lo, hi) = (10f64.powf(a), 10f64.powf(if b > a { b } else { a + 1.0 }));
        } else {
            if hi - lo < 1e-12 * hi.abs().max(1.0) {
                (lo, hi) = (lo - 0.5 * lo.abs().max(1.0), hi + 0.5 * hi.abs().max(1.0));
            }
            let pad = (hi - lo) * 0.06;
            (lo, hi) = (lo - pad, hi + pad);
        }
        Axis {
            lo,
            hi,
            log,
            top,
            bottom,
        }
    }
    fn y(&self, v: f64) -> f32 {
        let f = if self.log {
            (v.max(1e-300).log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        };
        self.bottom - (f as f32) * (self.bottom - self.top)
    }
    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let (a, b) = (
                self.lo.log10().round() as i32,
                self.hi.log10().round() as i32,
            );
            let mut t: Vec<f64> = (a..=b).map(|e| 10f64.powi(e)).collect();
            if b - a <= 1 {
                let extra: Vec<f64> = t.iter().flat_map(|x| [2.0 * x, 5.0 * x]).collect();
                t.extend(extra.into_iter().filter(|x| *x <= self.hi));
                t.sort_by(f64::total_cmp);
            }
            t
        } else {
            nice_ticks(self.lo, self.hi, 5)
        }
    }
}

/// About `n` round tick values covering `lo..hi` (1, 2, 2.5, 5 times a power of ten).
pub fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater)
        || !lo.is_finite()
        || !hi.is_finite()
    {
        return vec![];
    }
    let raw = (hi - lo) / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = Vec::new();
    // k * step, rounded to the step's decimals so labels read 2.3, not 2.3000000000000003.
    let decimals = (-(step.log10().floor()) as i32 + 1).max(0);
    let scale = 10f64.powi(decimals);
    let (k0, k1) = ((lo / step).ceil() as i64, (hi / step + 1e-9).floor() as i64);
    for k in k0..=k1 {
        let v = ((k as f64 * step) * scale).round() / scale;
        t.push(if v == 0.0 { 0.0 } else { v });
    }
    t
}

/// Round steps for a time axis spanning `span` seconds, about `n` ticks.
pub fn time_step(span: f64, n: usize) -> f64 {
    const STEPS: [f64; 20] = [
        1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0,
        10800.0, 21600.0, 43200.0, 86400.0, 172800.0, 604800.0,
    ];
    let raw = span / n.max(1) as f64;
    STEPS
        .iter()
        .copied()
        .find(|s| *s >= raw)
        .unwrap_or_else(|| (raw / 604800.0).ceil() * 604800.0)
}

/// `0`, `45s`, `2m`, `1m30s`, `2h`, `1h30m`, `3d`, `1d12h`.
pub fn elapsed_label(secs: f64) -> String {
    let s = secs.round() as u64;
    if s == 0 {
        return "0".into();
    }
    let (d, h, m, sec) = (s / 86400, (s % 86400) / 3600, (s % 3600) / 60, s % 60);
    match (d, h, m, sec) {
        (0, 0, 0, sec) => format!("{sec}s"),
        (0, 0, m, 0) => format!("{m}m"),
        (0, 0, m, sec) => format!("{m}m{sec:02}s"),
        (0, h, 0, _) => format!("{h}h"),
        (0, h, m, _) => format!("{h}h{m:02}m"),
        (d, 0, _, _) => format!("{d}d"),
        (d, h, _, _) => format!("{d}d{h}h"),
    }
}

fn value_label(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let a = v.abs();
    if !(1e-3..1e5).contains(&a) {
        // Three significant digits: 2.5e-4 must not read 3e-4.
        let e = format!("{v:.2e}");
        return match e.split_once('e') {
            Some((m, x)) if m.contains('.') => {
                format!("{}e{x}", m.trim_end_matches('0').trim_end_matches('.'))
            }
            _ => e,
        };
    }
    let s = format!("{v:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// Keep at most a few points per pixel column (first, min, max, last), so a million steps
/// draw as fast as a thousand and look the same.
fn decimate(pts: &[(f32, f32)]) -> Vec<(f32, f32)> {
    if pts.len() < 4000 {
        return pts.to_vec();
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < pts.len() {
        let col = pts[i].0.floor();
        let mut j = i;
        let (mut lo, mut hi) = (i, i);
        while j < pts.len() && pts[j].0.floor() == col {
            if pts[j].1 < pts[lo].1 {
                lo = j;
            }
            if pts[j].1 > pts[hi].1 {
                hi = j;
            }
            j += 1;
        }
        let mut idx = vec![i, lo, hi, j - 1];
        idx.sort_unstable();
        idx.dedup();
        out.extend(idx.into_iter().map(|k| pts[k]));
        i = j;
    }
    out
}

/// The loss (and grad-norm) points of spike steps, as (step, time bits): for each spike, the
/// newest point of its step at or before the spike's record whose loss is the spike's (the
/// monitor logs the same number), or, for a NaN, none (it is not drawn anyway).
fn spike_points(s: &Series) -> std::collections::HashSet<(u64, u64)> {
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
fn segments(pts: &[Point]) -> Vec<&[Point]> {
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

/// Where everything goes on a canvas: the plot area, its two panels (loss above, gradient
/// norm below when there is one) and the time scale.
struct Frame {
    h: f32,
    left: f32,
    right: f32,
    plot_bottom: f32,
    loss_top: f32,
    loss_bottom: f32,
    grad_top: f32,
    grad_bottom: f32,
    has_grad: bool,
    /// Seconds shown (at least 1).
    span: f64,
    /// Seconds between time ticks.
    tstep: f64,
}

impl Frame {
    fn new((w, h): (f32, f32), s: &Series) -> Frame {
        let left = 74.0f32;
        let right = w - 24.0;
        let title_h = 54.0;
        let bottom_axis = 46.0;
        let has_grad = !s.grad_norm.is_empty();
        let plot_top = title_h + 8.0;
        let plot_bottom = h - bottom_axis;
        let gap = 18.0;
        let avail = plot_bottom - plot_top;
        let (loss_top, loss_bottom, grad_top, grad_bottom) = if has_grad {
            let lh = (avail - gap) * 0.7;
            (plot_top, plot_top + lh, plot_top + lh + gap, plot_bottom)
        } else {
            (plot_top, plot_bottom, plot_bottom, plot_bottom)
        };
        let span = s.span.max(1.0);
        let tstep = time_step(span, ((right - left) / 110.0).max(2.0) as usize);
        Frame {
            h,
            left,
            right,
            plot_bottom,
            loss_top,
            loss_bottom,
            grad_top,
            grad_bottom,
            has_grad,
            span,
            tstep,
        }
    }

    /// The x of `t` seconds after the start.
    fn x_of(&self, t: f64) -> f32 {
        self.left + ((t / self.span) as f32) * (self.right - self.left)
    }

    /// The times of the time ticks.
    fn time_ticks(&self) -> Vec<f64> {
        let mut out = Vec::new();
        let mut t = 0.0;
        while t <= self.span + 1e-9 {
            out.push(t);
            t += self.tstep;
        }
        out
    }
}

/// Draw the chart of `s` on `c`.
pub fn draw(c: &mut dyn Canvas, run: &str, s: &Series, log_y: bool) {
    let f = Frame::new(c.size(), s);
    draw_title(c, &f, run, s);
    let (loss_axis, grad_axis) = axes(&f, s, log_y);
    draw_panels(c, &f, &loss_axis, &grad_axis);
    draw_time_axis(c, &f, s);
    draw_events(c, &f, s);
    draw_curves(c, &f, s, &loss_axis, &grad_axis);
    draw_markers(c, &f, s, &loss_axis);
    draw_legend(c, &f, run, s);
}

/// The title and the summary line under it.
fn draw_title(c: &mut dyn Canvas, f: &Frame, run: &str, s: &Series) {
    c.text(
        f.left,
        26.0,
        &format!("run {run}"),
        19.0,
        INK,
        Anchor::Start,
        false,
    );
    let first = s.loss.first().map(|p| p.v);
    let last = s.loss.last().map(|p| p.v);
    let mut summary = vec![];
    if let (Some(a), Some(b)) = (first, last) {
        summary.push(format!(
            "{} loss points, {} → {}",
            s.loss.len(),
            value_label(a),
            value_label(b)
        ));
    }
    for (n, one, many) in [
        (s.checkpoints.len(), "checkpoint", "checkpoints"),
        (s.failures.len(), "failure", "failures"),
        (s.recoveries.len(), "recovery", "recoveries"),
        (s.rollbacks.len(), "rollback", "rollbacks"),
        (s.spikes.len(), "loss spike", "loss spikes"),
        (s.stops.len(), "stop", "stops"),
    ] {
        if n == 0 && one == "stop" {
            continue;
        }
        summary.push(format!("{n} {}", if n == 1 { one } else { many }));
    }
    summary.push(format!("over {}", fmt::duration(s.span)));
    c.text(
        f.left,
        46.0,
        &summary.join(" · "),
        12.5,
        MUTED,
        Anchor::Start,
        false,
    );
}

/// The y axes of the loss and gradient-norm panels. On a linear axis, spike steps stay out of
/// the range.
fn axes(f: &Frame, s: &Series, log_y: bool) -> (Axis, Axis) {
    let spiky = spike_points(s);
    let in_range = |p: &&Point, log: bool| log || !spiky.contains(&(p.step, p.t.to_bits()));
    let loss_axis = Axis::new(
        s.loss
            .iter()
            .filter(|p| in_range(p, log_y))
            .map(|p| p.v)
            .chain(s.spikes.iter().filter_map(|m| m.v).filter(|_| log_y)),
        log_y,
        f.loss_top,
        f.loss_bottom,
    );
    let grad_axis = Axis::new(
        s.grad_norm
            .iter()
            .filter(|p| in_range(p, false))
            .map(|p| p.v),
        false,
        f.grad_top,
        f.grad_bottom,
    );
    (loss_axis, grad_axis)
}

/// Each panel's background, value grid and labels, time grid, name and border.
fn draw_panels(c: &mut dyn Canvas, f: &Frame, loss_axis: &Axis, grad_axis: &Axis) {
    let (left, right) = (f.left, f.right);
    let mut panels: Vec<(&Axis, &str)> = vec![(loss_axis, "loss")];
    if f.has_grad {
        panels.push((grad_axis, "grad norm"));
    }
    for (axis, name) in &panels {
        c.rect(
            left,
            axis.top,
            right - left,
            axis.bottom - axis.top,
            Some(Color::rgb(251, 251, 253)),
            None,
        );
        for v in axis.ticks() {
            let y = axis.y(v);
            if y < axis.top - 0.5 || y > axis.bottom + 0.5 {
                continue;
            }
            c.line(&[(left, y), (right, y)], &Pen::solid(GRID, 1.0));
            c.text(
                left - 8.0,
                y + 4.0,
                &value_label(v),
                11.0,
                MUTED,
                Anchor::End,
                false,
            );
        }
        for t in f.time_ticks() {
            let x = f.x_of(t);
            c.line(&[(x, axis.top), (x, axis.bottom)], &Pen::solid(GRID, 1.0));
        }
        c.text(
            18.0,
            (axis.top + axis.bottom) / 2.0,
            name,
            12.5,
            INK,
            Anchor::Middle,
            true,
        );
        c.rect(
            left,
            axis.top,
            right - left,
            axis.bottom - axis.top,
            None,
            Some(&Pen::solid(Color::rgb(190, 190, 200), 1.0)),
        );
    }
}

/// The time axis under the panels: ticks, elapsed-time labels and the start time.
fn draw_time_axis(c: &mut dyn Canvas, f: &Frame, s: &Series) {
    let plot_bottom = f.plot_bottom;
    for t in f.time_ticks() {
        let x = f.x_of(t);
        c.line(
            &[(x, plot_bottom), (x, plot_bottom + 5.0)],
            &Pen::solid(MUTED, 1.0),
        );
        c.text(
            x,
            plot_bottom + 18.0,
            &elapsed_label(t),
            11.0,
            MUTED,
            Anchor::Middle,
            false,
        );
    }
    let start = super::fmt::time_ms(s.t0_ms)
        .replace('T', " ")
        .replace('Z', " UTC");
    c.text(
        (f.left + f.right) / 2.0,
        f.h - 8.0,
        &format!("wall-clock time since {start}"),
        12.0,
        INK,
        Anchor::Middle,
        false,
    );
}

/// Events: vertical lines through both panels, labels at the top of the loss panel (spikes
/// get a label and no line: their marker sits on the curve).
fn draw_events(c: &mut dyn Canvas, f: &Frame, s: &Series) {
    let spike_labels: Vec<Mark> = s
        .spikes
        .iter()
        .map(|m| Mark {
            label: match m.v {
                Some(v) => format!("{} ({})", m.label, value_label(v)),
                None => m.label.clone(),
            },
            ..m.clone()
        })
        .collect();
    let mut events: Vec<(&Mark, Option<Pen>, Color)> = Vec::new();
    for m in &s.failures {
        events.push((m, Some(Pen::dashed(FAIL, 1.6, &[5.0, 4.0])), FAIL));
    }
    for m in &s.recoveries {
        events.push((m, Some(Pen::solid(RECOVER, 1.6)), Color::rgb(14, 130, 145)));
    }
    for m in &s.rollbacks {
        events.push((
            m,
            Some(Pen::dashed(ROLLBACK, 1.6, &[8.0, 3.0, 2.0, 3.0])),
            Color::rgb(200, 95, 0),
        ));
    }
    for m in &s.stops {
        events.push((m, Some(Pen::solid(STOP, 2.2)), STOP));
    }
    for m in &spike_labels {
        events.push((m, None, Color::rgb(200, 95, 0)));
    }
    events.sort_by(|a, b| a.0.t.total_cmp(&b.0.t));
    // Labels go in rows at the top of the loss panel: each in the first row where it does not
    // overlap the previous label, right of its line (left of it near the right edge).
    let mut row_end: Vec<f32> = Vec::new();
    for (m, pen, tc) in &events {
        let x = f.x_of(m.t);
        if let Some(pen) = pen {
            c.line(
                &[(x, f.loss_top), (x, f.grad_bottom.max(f.loss_bottom))],
                pen,
            );
        }
        let tw = text_width(&m.label, 11.0);
        let (x0, anchor) = if x + 3.0 + tw > f.right {
            (x - 3.0 - tw, Anchor::End)
        } else {
            (x + 3.0, Anchor::Start)
        };
        let row = match row_end.iter().position(|&e| e + 6.0 < x0) {
            Some(r) => r,
            None if row_end.len() < 6 => {
                row_end.push(f32::MIN);
                row_end.len() - 1
            }
            None => row_end.len() - 1,
        };
        row_end[row] = x0 + tw;
        let y = f.loss_top + 15.0 + 15.0 * row as f32;
        c.rect(
            x0 - 2.0,
            y - 10.5,
            tw + 4.0,
            13.5,
            Some(Color(255, 255, 255, 225)),
            None,
        );
        let tx = if anchor == Anchor::End { x0 + tw } else { x0 };
        c.text(tx, y, &m.label, 11.0, *tc, anchor, false);
    }
}

/// The loss and gradient-norm curves, one line per uninterrupted segment.
fn draw_curves(c: &mut dyn Canvas, f: &Frame, s: &Series, loss_axis: &Axis, grad_axis: &Axis) {
    for (pts, axis, color) in [(&s.loss, loss_axis, LOSS), (&s.grad_norm, grad_axis, GRAD)] {
        for seg in segments(pts) {
            // Clipped to the panel: spikes left out of the range run off its top.
            let px: Vec<(f32, f32)> = seg
                .iter()
                .filter(|p| !axis.log || p.v > 0.0)
                .map(|p| (f.x_of(p.t), axis.y(p.v).clamp(axis.top, axis.bottom)))
                .collect();
            let px = decimate(&px);
            if px.len() == 1 {
                c.circle(px[0].0, px[0].1, 2.0, color, None);
            }
            c.line(&px, &Pen::solid(color, 1.6));
        }
    }
}

/// Spikes as rings on the loss curve, checkpoints as triangles on the bottom edge of the loss
/// panel.
fn draw_markers(c: &mut dyn Canvas, f: &Frame, s: &Series, loss_axis: &Axis) {
    for m in &s.spikes {
        let x = f.x_of(m.t);
        let y = m.v.map_or(f.loss_top + 6.0, |v| {
            loss_axis.y(v).clamp(f.loss_top, f.loss_bottom)
        });
        c.circle(
            x,
            y,
            5.0,
            Color(255, 255, 255, 255),
            Some(&Pen::solid(SPIKE, 2.0)),
        );
    }
    for m in &s.checkpoints {
        let x = f.x_of(m.t);
        let y = f.loss_bottom;
        c.polygon(
            &[(x, y - 9.0), (x - 5.0, y), (x + 5.0, y)],
            CKPT,
            Some(&Pen::solid(Color::rgb(255, 255, 255), 0.8)),
        );
    }
}

/// The legend, top right (boxed inside the loss panel when the title leaves no room), only for
/// what is present.
fn draw_legend(c: &mut dyn Canvas, f: &Frame, run: &str, s: &Series) {
    let (left, right) = (f.left, f.right);
    let mut legend: Vec<(&str, u8, Color)> = vec![("loss", 0, LOSS)];
    if f.has_grad {
        legend.push(("grad norm", 0, GRAD));
    }
    if !s.checkpoints.is_empty() {
        legend.push(("checkpoint", 1, CKPT));
    }
    if !s.failures.is_empty() {
        legend.push(("failure", 2, FAIL));
    }
    if !s.recoveries.is_empty() {
        legend.push(("recovery", 0, RECOVER));
    }
    if !s.rollbacks.is_empty() {
        legend.push(("rollback", 3, ROLLBACK));
    }
    if !s.spikes.is_empty() {
        legend.push(("loss spike", 4, SPIKE));
    }
    if !s.stops.is_empty() {
        legend.push(("stop", 5, STOP));
    }
    let title_end = left + text_width(&format!("run {run}"), 19.0) + 24.0;
    let item_w = |n: &str| 30.0 + text_width(n, 11.5) + 16.0;
    let total: f32 = legend.iter().map(|(n, _, _)| item_w(n)).sum();
    let boxed = title_end + total > right;
    let (mut lx, ly) = if boxed {
        (right - total.min(right - left) - 6.0, f.loss_top + 6.0)
    } else {
        (right - total, 10.0)
    };
    if boxed {
        c.rect(
            lx - 6.0,
            ly,
            total + 6.0,
            22.0,
            Some(Color(255, 255, 255, 230)),
            Some(&Pen::solid(Color::rgb(210, 210, 218), 1.0)),
        );
    }
    for (name, kind, color) in &legend {
        let y = ly + 16.0;
        let (x0, x1) = (lx, lx + 24.0);
        let mid = (x0 + x1) / 2.0;
        match kind {
            0 => c.line(&[(x0, y - 4.0), (x1, y - 4.0)], &Pen::solid(*color, 2.0)),
            1 => c.polygon(
                &[(mid, y - 9.0), (mid - 5.0, y), (mid + 5.0, y)],
                *color,
                None,
            ),
            2 => c.line(
                &[(x0, y - 4.0), (x1, y - 4.0)],
                &Pen::dashed(*color, 2.0, &[5.0, 4.0]),
            ),
            3 => c.line(
                &[(x0, y - 4.0), (x1, y - 4.0)],
                &Pen::dashed(*color, 2.0, &[8.0, 3.0, 2.0, 3.0]),
            ),
            5 => c.line(&[(x0, y - 4.0), (x1, y - 4.0)], &Pen::solid(*color, 2.2)),
            _ => c.circle(
                mid,
                y - 4.0,
                4.5,
                Color::rgb(255, 255, 255),
                Some(&Pen::solid(*color, 2.0)),
            ),
        }
        c.text(x1 + 6.0, y, name, 11.5, INK, Anchor::Start, false);
        lx += item_w(name);
    }
}

impl Report for PlotReport {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            w,
            "wrote {} ({}, {}): {} loss points{}, {} checkpoints, {} failures, {} recoveries, {} rollbacks, {} spikes, {} stops over {}",
            self.out,
            self.format,
            fmt::bytes(self.bytes),
            self.points,
            self.steps
                .map_or(String::new(), |(a, b)| format!(" (steps {a}-{b})")),
            self.checkpoints,
            self.failures,
            self.recoveries,
            self.rollbacks,
            self.spikes,
            self.stops,
            fmt::duration(self.span_s)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
