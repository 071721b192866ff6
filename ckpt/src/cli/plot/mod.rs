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
//!
//! The files of this folder:
//!
//! - `mod.rs`: the flags, reading the logs, writing the file, the report;
//! - `series.rs`: the series and marks taken from the log records ([`Series`]), and where a
//!   curve is interrupted or spikes;
//! - `scale.rs`: a value axis (`Axis`), round ticks and labels;
//! - `frame.rs`: where everything goes on the canvas (`Frame`) and the two y axes;
//! - `draw.rs`: the chart drawn part by part (title, panels, time axis, events, curves,
//!   markers, legend);
//! - `render.rs`: the canvases (PNG through tiny-skia, SVG by hand) behind one trait.

use std::io::Write;
use std::path::PathBuf;

use ckpt_store::logs::{EVENTS, METRICS, read_log};
use ckpt_store::{Store, validate_run};
use serde::Serialize;

use super::{CliError, Report, Result, Ui};
use crate::cli::shared::fmt;

mod draw;
mod frame;
pub mod render;
mod scale;
mod series;
#[cfg(test)]
mod tests;

pub use draw::draw;
pub use scale::{elapsed_label, nice_ticks, time_step};
pub use series::{Mark, Point, Series, series};

use render::{Png, Svg};

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
        let has_run = store
            .log()
            .list_runs()
            .await?
            .iter()
            .any(|r| r == &args.run);
        let why = if !has_run {
            return Err(crate::cli::shared::no_such_run(store, &args.run).await);
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
