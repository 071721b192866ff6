//! Training monitors: per-step observations (loss, gradient norm, step time, memory), loss-spike
//! and NaN detection, and the policy that turns a spike into an action.
//!
//! Everything here is pure: [`Detector`] takes observations and returns verdicts, [`Monitor`]
//! adds the configured action and the bound on rollbacks and returns decisions. No I/O, no
//! clock. The [`CheckpointManager`](crate::CheckpointManager) drives a [`Monitor`]
//! (`observe`, `rollback`), writes the events log, and saves the monitor's state with every
//! checkpoint, so that a resumed run keeps its window (no second warm-up) and its rollback
//! count.
//!
//! ```
//! use ckpt_trainer::monitor::{Decision, Monitor, MonitorConfig, Observation, SpikeAction};
//!
//! let mut m = Monitor::new(MonitorConfig {
//!     action: SpikeAction::Rollback,
//!     ..MonitorConfig::default()
//! });
//! for step in 1..=50 {
//!     let loss = 2.0 + 0.01 * (step % 3) as f64;
//!     assert_eq!(m.observe(&Observation::new(step, loss)), Decision::Continue);
//! }
//! assert!(matches!(m.observe(&Observation::new(51, 40.0)), Decision::Rollback(_)));
//! assert!(matches!(m.observe(&Observation::new(52, f64::NAN)), Decision::Rollback(_)));
//! ```
//!
//! # Detection
//!
//! - **Non-finite**: a NaN or infinite loss or gradient norm is a spike at once, warm-up or not.
//! - **Loss spike**: once `warmup` healthy steps were seen, a loss above
//!   `median + max(k × 1.4826 × MAD, min_rise × |median|)` over the last `window` healthy
//!   losses (MAD: the median absolute deviation; 1.4826 × MAD estimates the standard deviation
//!   of normal noise and ignores outliers). The `min_rise` floor keeps a flat, noiseless loss
//!   (MAD near 0) from alarming on rounding noise.
//! - **Gradient-norm blow-up**: after the warm-up, a gradient norm above `grad_factor` × the
//!   median of the window's gradient norms.
//!
//! A flagged step never enters the window: the baseline stays what healthy training looked
//! like, whatever the action.
//!
//! # Actions
//!
//! - `off`: nothing is checked.
//! - `alert`: a warning and a `spike` record in the run's events log; training goes on. A NaN or
//!   infinity under `alert` **stops** the run (a `stop` record, an error, no checkpoint of the
//!   poisoned state): NaN propagates through every later update, so going on would only burn
//!   compute and, worse, commit checkpoints of a dead model.
//! - `rollback`: restore the newest committed checkpoint from before the spike, skip the data
//!   batches from that checkpoint's data position through the spike's batch, and go on. After
//!   `max_rollbacks` rollbacks in a run, the next spike stops the run with the history.

use std::collections::VecDeque;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Default of [`MonitorConfig::window`].
pub const DEFAULT_WINDOW: usize = 100;
/// Default of [`MonitorConfig::warmup`].
pub const DEFAULT_WARMUP: usize = 20;
/// Default of [`MonitorConfig::loss_k`].
pub const DEFAULT_LOSS_K: f64 = 6.0;
/// Default of [`MonitorConfig::loss_min_rise`].
pub const DEFAULT_LOSS_MIN_RISE: f64 = 0.2;
/// Default of [`MonitorConfig::grad_factor`].
pub const DEFAULT_GRAD_FACTOR: f64 = 10.0;
/// Default of [`MonitorConfig::max_rollbacks`].
pub const DEFAULT_MAX_ROLLBACKS: usize = 3;

/// 1.4826 × MAD estimates the standard deviation of normally distributed values.
const MAD_TO_SIGMA: f64 = 1.4826;
/// Below this, a threshold is treated as this (a loss of exactly 0 with no noise).
const ABS_FLOOR: f64 = 1e-12;

/// What to do about a spike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpikeAction {
    /// Do not monitor.
    Off,
    /// Warn and log; a NaN or infinity stops the run.
    Alert,
    /// Roll back to the newest checkpoint before the spike and skip the batches up to it.
    Rollback,
}

impl fmt::Display for SpikeAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SpikeAction::Off => "off",
            SpikeAction::Alert => "alert",
            SpikeAction::Rollback => "rollback",
        })
    }
}

/// Monitor settings. The defaults (the `DEFAULT_*` constants) keep a healthy run quiet over
/// 10,000 steps of the reference workload and catch a batch whose targets are 1000× off.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MonitorConfig {
    /// What to do about a spike (the manager's default is `off`; `ckpt-train`'s is `alert`).
    pub action: SpikeAction,
    /// Healthy steps whose loss and gradient norm form the baseline (default 100).
    pub window: usize,
    /// Healthy steps to see before loss and gradient thresholds apply (default 20); NaN and
    /// infinity are caught from the first step.
    pub warmup: usize,
    /// Robust standard deviations above the median that make a loss spike (default 6).
    pub loss_k: f64,
    /// A spike must also exceed the median by this fraction of it (default 0.2, i.e. 20%).
    pub loss_min_rise: f64,
    /// A gradient norm above this many times the window's median is a blow-up (default 10;
    /// 0 or infinity disables the check).
    pub grad_factor: f64,
    /// Rollbacks allowed per run; the next spike stops the run (default 3).
    pub max_rollbacks: usize,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        MonitorConfig {
            action: SpikeAction::Off,
            window: DEFAULT_WINDOW,
            warmup: DEFAULT_WARMUP,
            loss_k: DEFAULT_LOSS_K,
            loss_min_rise: DEFAULT_LOSS_MIN_RISE,
            grad_factor: DEFAULT_GRAD_FACTOR,
            max_rollbacks: DEFAULT_MAX_ROLLBACKS,
        }
    }
}

impl MonitorConfig {
    /// Check the settings; the message names the setting that is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if self.window == 0 {
            return Err("the spike window must hold at least 1 step".into());
        }
        if !(self.loss_k.is_finite() && self.loss_k > 0.0) {
            return Err(format!(
                "the spike threshold k must be a positive number, not {}",
                self.loss_k
            ));
        }
        if !(self.loss_min_rise.is_finite() && self.loss_min_rise >= 0.0) {
            return Err(format!(
                "the minimum rise of a spike must be 0 or more, not {}",
                self.loss_min_rise
            ));
        }
        if self.grad_factor.is_nan() || self.grad_factor < 0.0 {
            return Err(format!(
                "the gradient blow-up factor must be 0 (off) or more, not {}",
                self.grad_factor
            ));
        }
        Ok(())
    }
}

/// What one step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// The optimizer step.
    pub step: u64,
    /// The data batch the step read, if the loop tracks one.
    pub batch: Option<u64>,
    /// The loss.
    pub loss: f64,
    /// The gradient norm, if known.
    pub grad_norm: Option<f64>,
    /// Set when the loss is one rank's share only (one rank per process).
    pub partial_of_rank: Option<u32>,
}

impl Observation {
    /// A step's loss, nothing else.
    pub fn new(step: u64, loss: f64) -> Self {
        Observation {
            step,
            batch: None,
            loss,
            grad_norm: None,
            partial_of_rank: None,
        }
    }

    /// With the data batch.
    pub fn batch(mut self, batch: u64) -> Self {
        self.batch = Some(batch);
        self
    }

    /// With the gradient norm.
    pub fn grad_norm(mut self, g: f64) -> Self {
        self.grad_norm = Some(g);
        self
    }
}

/// What made a step a spike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpikeKind {
    /// The loss or the gradient norm is NaN or infinite.
    NonFinite,
    /// The loss is above the robust threshold.
    Loss,
    /// The gradient norm is above `grad_factor` × its median.
    GradNorm,
}

impl SpikeKind {
    /// A short name (`nonfinite`, `loss`, `grad_norm`) for records.
    pub fn as_str(self) -> &'static str {
        match self {
            SpikeKind::NonFinite => "nonfinite",
            SpikeKind::Loss => "loss",
            SpikeKind::GradNorm => "grad_norm",
        }
    }
}

/// A detected spike.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spike {
    /// The step.
    pub step: u64,
    /// The data batch it read, if known.
    pub batch: Option<u64>,
    /// What was wrong.
    pub kind: SpikeKind,
    /// The loss at the step.
    pub loss: f64,
    /// The gradient norm at the step, if known.
    pub grad_norm: Option<f64>,
    /// The threshold the offending value crossed (none for NaN and infinity).
    pub threshold: Option<f64>,
    /// The window's median of the offending quantity (none before the warm-up).
    pub median: Option<f64>,
}

impl Spike {
    /// Why, in a few words (`loss spike`, `gradient-norm blow-up`, `NaN loss`).
    pub fn reason(&self) -> String {
        match self.kind {
            SpikeKind::Loss => "loss spike".into(),
            SpikeKind::GradNorm => "gradient-norm blow-up".into(),
            SpikeKind::NonFinite if !self.loss.is_finite() => format!("{} loss", self.loss),
            SpikeKind::NonFinite => format!("{} gradient norm", self.grad_norm.unwrap_or(f64::NAN)),
        }
    }
}

impl fmt::Display for Spike {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = match self.batch {
            Some(b) => format!("step {} (data batch {b})", self.step),
            None => format!("step {}", self.step),
        };
        match self.kind {
            SpikeKind::NonFinite => write!(f, "{} at {at}", self.reason()),
            SpikeKind::Loss => write!(
                f,
                "loss spike at {at}: loss {:.6e} is above {:.6e} (window median {:.6e})",
                self.loss,
                self.threshold.unwrap_or(f64::NAN),
                self.median.unwrap_or(f64::NAN)
            ),
            SpikeKind::GradNorm => write!(
                f,
                "gradient-norm blow-up at {at}: {:.6e} is above {:.6e} (window median {:.6e})",
                self.grad_norm.unwrap_or(f64::NAN),
                self.threshold.unwrap_or(f64::NAN),
                self.median.unwrap_or(f64::NAN)
            ),
        }
    }
}

/// The detector's answer for one observation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Finite, and too few healthy steps seen to judge more.
    WarmingUp,
    /// Within the thresholds.
    Healthy,
    /// A spike.
    Spike(Spike),
}

/// The median of `v` (sorted in place); `None` when empty.
fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Spike detection over a sliding window of healthy steps (see the module docs). Pure: feed
/// observations, get verdicts.
#[derive(Debug, Clone, PartialEq)]
pub struct Detector {
    cfg: MonitorConfig,
    losses: VecDeque<f64>,
    grads: VecDeque<f64>,
    seen: u64,
}

impl Detector {
    /// An empty detector.
    pub fn new(cfg: MonitorConfig) -> Self {
        Detector {
            cfg,
            losses: VecDeque::new(),
            grads: VecDeque::new(),
            seen: 0,
        }
    }

    /// Healthy steps seen (warm-up included).
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Whether the warm-up is over.
    pub fn armed(&self) -> bool {
        self.seen >= self.cfg.warmup as u64 && !self.losses.is_empty()
    }

    /// The loss above which a step is a spike now, and the window's median; `None` during the
    /// warm-up.
    pub fn loss_threshold(&self) -> Option<(f64, f64)> {
        if !self.armed() {
            return None;
        }
        let mut v: Vec<f64> = self.losses.iter().copied().collect();
        let med = median(&mut v)?;
        let mut dev: Vec<f64> = v.iter().map(|x| (x - med).abs()).collect();
        let mad = median(&mut dev)?;
        let margin = (self.cfg.loss_k * MAD_TO_SIGMA * mad)
            .max(self.cfg.loss_min_rise * med.abs())
            .max(ABS_FLOOR);
        Some((med + margin, med))
    }

    /// The gradient norm above which a step is a blow-up, and the window's median; `None`
    /// during the warm-up, when the check is off or no gradient norms were seen.
    pub fn grad_threshold(&self) -> Option<(f64, f64)> {
        let f = self.cfg.grad_factor;
        if !self.armed() || f == 0.0 || f.is_infinite() {
            return None;
        }
        let mut v: Vec<f64> = self.grads.iter().copied().collect();
        let med = median(&mut v)?;
        Some(((f * med).max(ABS_FLOOR), med))
    }

    /// Judge one step; a healthy (or warming-up) step joins the window.
    pub fn observe(&mut self, o: &Observation) -> Verdict {
        let spike = |kind, threshold, median| Spike {
            step: o.step,
            batch: o.batch,
            kind,
            loss: o.loss,
            grad_norm: o.grad_norm,
            threshold,
            median,
        };
        if !o.loss.is_finite() || o.grad_norm.is_some_and(|g| !g.is_finite()) {
            return Verdict::Spike(spike(SpikeKind::NonFinite, None, None));
        }
        if let Some((thr, med)) = self.loss_threshold()
            && o.loss > thr
        {
            return Verdict::Spike(spike(SpikeKind::Loss, Some(thr), Some(med)));
        }
        if let (Some(g), Some((thr, med))) = (o.grad_norm, self.grad_threshold())
            && g > thr
        {
            return Verdict::Spike(spike(SpikeKind::GradNorm, Some(thr), Some(med)));
        }
        let armed = self.armed();
        self.losses.push_back(o.loss);
        if let Some(g) = o.grad_norm {
            self.grads.push_back(g);
        }
        self.trim();
        self.seen += 1;
        if armed {
            Verdict::Healthy
        } else {
            Verdict::WarmingUp
        }
    }

    fn trim(&mut self) {
        while self.losses.len() > self.cfg.window {
            self.losses.pop_front();
        }
        while self.grads.len() > self.cfg.window {
            self.grads.pop_front();
        }
    }
}

// The rollback history and the stop reason are part of the `stop` event record: their types
// live with the log records (`ckpt_recovery::records`).
pub use ckpt_recovery::records::{RollbackEntry, StopReason};

/// A stop: the spike, why, and the run's rollbacks so far.
#[derive(Debug, Clone, PartialEq)]
pub struct Stop {
    /// The spike that stopped the run.
    pub spike: Spike,
    /// Why it stops rather than acting.
    pub reason: StopReason,
    /// Every rollback of the run, oldest first.
    pub history: Vec<RollbackEntry>,
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "training stopped: {}; {}", self.spike, self.reason)?;
        if self.history.is_empty() {
            write!(f, "; no rollbacks before")?;
        } else {
            write!(f, "; rollbacks:")?;
            for r in &self.history {
                write!(
                    f,
                    " [{} at step {} -> step {}",
                    r.reason, r.from_step, r.to_step
                )?;
                if let Some((a, b)) = r.skipped {
                    write!(f, ", skipped batches {a}-{b}")?;
                }
                write!(f, "]")?;
            }
        }
        write!(
            f,
            "; inspect the data around the spike, or restart from an earlier checkpoint with other settings"
        )
    }
}

/// What the training loop should do after a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Go on.
    Continue,
    /// A spike was reported; go on.
    Alert(Spike),
    /// Roll back to the newest checkpoint before the spike and skip its batches.
    Rollback(Spike),
    /// Stop the run.
    Stop(Stop),
}

/// The detector, the action and the rollback history: observations in, decisions out.
#[derive(Debug, Clone, PartialEq)]
pub struct Monitor {
    cfg: MonitorConfig,
    detector: Detector,
    history: Vec<RollbackEntry>,
}

/// What a checkpoint keeps of a [`Monitor`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MonitorState {
    /// The window's losses, oldest first.
    pub losses: Vec<f64>,
    /// The window's gradient norms, oldest first.
    pub grads: Vec<f64>,
    /// Healthy steps seen.
    pub seen: u64,
    /// The run's rollbacks.
    pub rollbacks: Vec<RollbackEntry>,
}

impl Monitor {
    /// A monitor with an empty window.
    pub fn new(cfg: MonitorConfig) -> Self {
        Monitor {
            detector: Detector::new(cfg.clone()),
            cfg,
            history: Vec::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &MonitorConfig {
        &self.cfg
    }

    /// Whether anything is checked.
    pub fn enabled(&self) -> bool {
        self.cfg.action != SpikeAction::Off
    }

    /// The detector.
    pub fn detector(&self) -> &Detector {
        &self.detector
    }

    /// The run's rollbacks, oldest first.
    pub fn history(&self) -> &[RollbackEntry] {
        &self.history
    }

    /// Judge a step and apply the action.
    pub fn observe(&mut self, o: &Observation) -> Decision {
        if !self.enabled() {
            return Decision::Continue;
        }
        let spike = match self.detector.observe(o) {
            Verdict::WarmingUp | Verdict::Healthy => return Decision::Continue,
            Verdict::Spike(s) => s,
        };
        match self.cfg.action {
            SpikeAction::Off => Decision::Continue,
            SpikeAction::Alert if spike.kind == SpikeKind::NonFinite => {
                self.stop(spike, StopReason::NonFinite)
            }
            SpikeAction::Alert => Decision::Alert(spike),
            SpikeAction::Rollback if self.history.len() >= self.cfg.max_rollbacks => self.stop(
                spike,
                StopReason::RollbacksExhausted {
                    max: self.cfg.max_rollbacks,
                },
            ),
            SpikeAction::Rollback => Decision::Rollback(spike),
        }
    }

    /// A stop decision with the history.
    pub fn stop(&self, spike: Spike, reason: StopReason) -> Decision {
        Decision::Stop(Stop {
            spike,
            reason,
            history: self.history.clone(),
        })
    }

    /// Record a rollback that was carried out.
    pub fn record_rollback(&mut self, r: RollbackEntry) {
        self.history.push(r);
    }

    /// The state to save with a checkpoint.
    pub fn state(&self) -> MonitorState {
        MonitorState {
            losses: self.detector.losses.iter().copied().collect(),
            grads: self.detector.grads.iter().copied().collect(),
            seen: self.detector.seen,
            rollbacks: self.history.clone(),
        }
    }

    /// Take the window and the history from a checkpoint (trimmed to this window's size).
    pub fn load_state(&mut self, s: MonitorState) {
        self.detector.losses = s.losses.into_iter().filter(|x| x.is_finite()).collect();
        self.detector.grads = s.grads.into_iter().filter(|x| x.is_finite()).collect();
        self.detector.seen = s.seen;
        self.detector.trim();
        self.history = s.rollbacks;
    }

    /// Forget the window (a fresh start; the history stays).
    pub fn reset_window(&mut self) {
        self.detector = Detector::new(self.cfg.clone());
    }
}

/// Resident memory of this process in bytes (from `/proc/self/statm`; `None` elsewhere).
pub fn host_memory_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    (page > 0).then(|| pages * page as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(action: SpikeAction) -> MonitorConfig {
        MonitorConfig {
            action,
            window: 10,
            warmup: 5,
            loss_k: 6.0,
            loss_min_rise: 0.2,
            grad_factor: 10.0,
            max_rollbacks: 2,
        }
    }

    /// Short names for the verdicts in the tables.
    fn v(x: Verdict) -> &'static str {
        match x {
            Verdict::WarmingUp => "warm",
            Verdict::Healthy => "ok",
            Verdict::Spike(s) => s.kind.as_str(),
        }
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&mut []), None);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    /// Tables: a loss series (and gradient norms) in, the verdict per step out.
    #[test]
    fn detector_tables() {
        let nan = f64::NAN;
        let inf = f64::INFINITY;
        #[allow(clippy::type_complexity)]
        let cases: &[(&str, &[f64], Option<&[f64]>, &[&str])] = &[
            (
                "warm-up ignores a high loss but not a NaN",
                &[1.0, 50.0, nan, 1.0, 1.0, 1.0, 1.0],
                None,
                &["warm", "warm", "nonfinite", "warm", "warm", "warm", "ok"],
            ),
            (
                "infinity is non-finite",
                &[1.0, inf, -inf],
                None,
                &["warm", "nonfinite", "nonfinite"],
            ),
            (
                "a decreasing loss never alarms",
                &[10.0, 8.0, 6.0, 5.0, 4.0, 3.5, 3.0, 2.6, 2.3, 2.1, 2.0, 1.9],
                None,
                &[
                    "warm", "warm", "warm", "warm", "warm", "ok", "ok", "ok", "ok", "ok", "ok",
                    "ok",
                ],
            ),
            (
                "a spike after the warm-up, and the baseline is unchanged by it",
                &[1.0, 1.01, 0.99, 1.0, 1.02, 5.0, 1.0, 5.0, 1.01],
                None,
                &[
                    "warm", "warm", "warm", "warm", "warm", "loss", "ok", "loss", "ok",
                ],
            ),
            (
                // Noise of +-0.01 around 1: 6 sigma is ~0.06, but the 20% floor rules.
                "under the min-rise floor is not a spike",
                &[1.0, 1.01, 0.99, 1.0, 1.01, 1.15, 1.19, 1.3],
                None,
                &["warm", "warm", "warm", "warm", "warm", "ok", "ok", "loss"],
            ),
            (
                // Noise of +-0.5 around 10: MAD is 0.5 so 6 x 1.4826 x 0.5 = 4.45 rules.
                "a noisy loss needs k robust sigmas",
                &[10.0, 10.5, 9.5, 10.0, 10.5, 9.5, 14.0, 14.6],
                None,
                &["warm", "warm", "warm", "warm", "warm", "ok", "ok", "loss"],
            ),
            (
                "a flat zero loss does not alarm on zero",
                &[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-9],
                None,
                &["warm", "warm", "warm", "warm", "warm", "ok", "loss"],
            ),
            (
                "a gradient-norm blow-up with a calm loss",
                &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                Some(&[2.0, 2.1, 1.9, 2.0, 2.0, 19.0, 21.0, nan]),
                &[
                    "warm",
                    "warm",
                    "warm",
                    "warm",
                    "warm",
                    "ok",
                    "grad_norm",
                    "nonfinite",
                ],
            ),
        ];
        for (name, losses, grads, want) in cases {
            let mut d = Detector::new(cfg(SpikeAction::Alert));
            let got: Vec<&str> = losses
                .iter()
                .enumerate()
                .map(|(i, &l)| {
                    let mut o = Observation::new(i as u64 + 1, l).batch(i as u64 + 1);
                    o.grad_norm = grads.map(|g| g[i]);
                    v(d.observe(&o))
                })
                .collect();
            assert_eq!(&got, want, "{name}");
        }
    }

    #[test]
    fn window_slides_and_threshold_follows() {
        let mut d = Detector::new(cfg(SpikeAction::Alert));
        for s in 1..=10 {
            d.observe(&Observation::new(s, 100.0));
        }
        // A slow drift (1% a step) is followed, not flagged: the median moves with it.
        let mut l = 100.0;
        for s in 11..=60 {
            l *= 1.01;
            assert_eq!(v(d.observe(&Observation::new(s, l))), "ok", "step {s}");
        }
        let (thr, med) = d.loss_threshold().unwrap();
        assert!(med > 100.0 * 1.01f64.powi(44), "{med}");
        assert!(thr >= med * 1.2 && thr < med * 1.5, "{thr} {med}");
        // A sudden doubling is not.
        assert_eq!(v(d.observe(&Observation::new(61, 2.0 * l))), "loss");
    }

    #[test]
    fn spike_carries_what_crossed_what() {
        let mut d = Detector::new(cfg(SpikeAction::Alert));
        for s in 1..=6 {
            d.observe(&Observation::new(s, 2.0).grad_norm(1.0));
        }
        let Verdict::Spike(s) = d.observe(&Observation::new(7, 30.0).batch(9).grad_norm(1.5))
        else {
            panic!("no spike")
        };
        assert_eq!((s.step, s.batch, s.kind), (7, Some(9), SpikeKind::Loss));
        assert_eq!(s.median, Some(2.0));
        assert_eq!(s.threshold, Some(2.4));
        let text = s.to_string();
        assert!(text.contains("step 7 (data batch 9)"), "{text}");
        assert!(text.contains("3.000000e1"), "{text}");
    }

    /// Actions: a table of (action, rollbacks already done, what is seen) -> decision.
    #[test]
    fn decisions_by_action() {
        let cases = [
            (SpikeAction::Off, 0, f64::NAN, "continue"),
            (SpikeAction::Off, 0, 1e6, "continue"),
            (SpikeAction::Alert, 0, 1e6, "alert"),
            (SpikeAction::Alert, 0, f64::NAN, "stop:nonfinite"),
            (SpikeAction::Alert, 0, 1.0, "continue"),
            (SpikeAction::Rollback, 0, 1e6, "rollback"),
            (SpikeAction::Rollback, 1, f64::NAN, "rollback"),
            (SpikeAction::Rollback, 2, 1e6, "stop:exhausted"),
            (SpikeAction::Rollback, 2, 1.0, "continue"),
        ];
        for (action, done, x, want) in cases {
            let mut m = Monitor::new(cfg(action));
            for s in 1..=8 {
                assert_eq!(m.observe(&Observation::new(s, 1.0)), Decision::Continue);
            }
            for i in 0..done {
                m.record_rollback(RollbackEntry {
                    from_step: 20 + i,
                    to_step: 10,
                    reason: "loss spike".into(),
                    skipped: Some((11, 20 + i)),
                });
            }
            let got = match m.observe(&Observation::new(9, x)) {
                Decision::Continue => "continue",
                Decision::Alert(_) => "alert",
                Decision::Rollback(_) => "rollback",
                Decision::Stop(s) => {
                    assert_eq!(s.history.len(), done as usize);
                    match s.reason {
                        StopReason::NonFinite => "stop:nonfinite",
                        StopReason::RollbacksExhausted { max } => {
                            assert_eq!(max, 2);
                            assert!(s.to_string().contains("skipped batches 11-21"), "{s}");
                            "stop:exhausted"
                        }
                        StopReason::NoCheckpoint => "stop:nockpt",
                    }
                }
            };
            assert_eq!(got, want, "{action} after {done} rollbacks, value {x}");
        }
    }

    #[test]
    fn state_round_trips_and_keeps_the_window() {
        let mut a = Monitor::new(cfg(SpikeAction::Rollback));
        for s in 1..=7 {
            a.observe(&Observation::new(s, 1.0 + s as f64 * 0.01).grad_norm(2.0));
        }
        a.record_rollback(RollbackEntry {
            from_step: 40,
            to_step: 30,
            reason: "NaN loss".into(),
            skipped: None,
        });
        let bytes = serde_json::to_vec(&a.state()).unwrap();
        let mut b = Monitor::new(cfg(SpikeAction::Rollback));
        b.load_state(serde_json::from_slice(&bytes).unwrap());
        assert_eq!(a, b);
        // The restored monitor is armed: no second warm-up.
        assert!(matches!(
            b.observe(&Observation::new(8, 50.0)),
            Decision::Rollback(_)
        ));
        // A smaller window keeps the newest values.
        let mut c = Monitor::new(MonitorConfig {
            window: 3,
            ..cfg(SpikeAction::Alert)
        });
        c.load_state(a.state());
        assert_eq!(c.state().losses, a.state().losses[4..].to_vec());
    }

    #[test]
    fn settings_are_checked() {
        assert!(MonitorConfig::default().validate().is_ok());
        for bad in [
            MonitorConfig {
                window: 0,
                ..Default::default()
            },
            MonitorConfig {
                loss_k: 0.0,
                ..Default::default()
            },
            MonitorConfig {
                loss_min_rise: f64::NAN,
                ..Default::default()
            },
            MonitorConfig {
                grad_factor: -1.0,
                ..Default::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn host_memory_is_read() {
        if cfg!(target_os = "linux") {
            assert!(host_memory_bytes().unwrap() > 1 << 20);
        }
    }
}
