//! The persist governor ([`Governor`], [`GovernorConfig`]): keeps the training step's speed
//! while a checkpoint persists, by lowering the persist's rate when the steps beside it slow
//! by more than a budget, and raising it again when they do not. Pure: step times enter as
//! values; the [`CheckpointManager`](crate::CheckpointManager) measures them, applies the rate
//! to its checkpointer ([`crate::save::PersistRate`]) and logs each change.
//!
//! - **Baseline**: the median of the newest [`BASELINE_WINDOW`] step intervals with no save in
//!   flight (*clean*). Without [`MIN_BASELINE`] of them the governor does nothing.
//! - **Slowdown**: a step interval of `loop_s` seconds (the copy into staging taken out) of
//!   which the persist ran `overlap_s` did the work of `overlap_s - (loop_s - baseline)`
//!   undisturbed seconds in those `overlap_s`; the slowdown is their ratio. Intervals add up
//!   until [`GovernorConfig::decide_every`] of persist time is seen (many short steps make one
//!   decision; the scheduler's noise averages out), or the persist ends.
//! - **Control**: over budget, the rate becomes the rate in force (or, at full speed, the
//!   persist's throughput so far) times `0.75 * budget / excess` (aiming a quarter inside the
//!   budget, not at its edge), within `[0.25, 0.8]`, never below
//!   [`GovernorConfig::min_rate`] (so a persist always ends: time to durable is at most its
//!   bytes over the floor). Under half the budget, the rate rises by half; once it reaches
//!   the throughput of an unlimited persist (the *ceiling*, measured), the limit is lifted.
//!   Between the two it holds. The rate carries over from one persist to the next.

use std::collections::VecDeque;
use std::time::Duration;

/// The default budget: steps may be 10 % slower while a persist runs.
pub const DEFAULT_BUDGET: f64 = 0.10;
/// The default floor of the rate, raw bytes per second per rank.
pub const DEFAULT_MIN_RATE: u64 = 16 << 20;
/// The default persist time a decision averages over.
pub const DEFAULT_DECIDE_EVERY: Duration = Duration::from_secs(1);
/// The clean step intervals whose median is the baseline.
pub const BASELINE_WINDOW: usize = 32;
/// Clean step intervals needed before the governor acts.
pub const MIN_BASELINE: usize = 3;
/// Where a lowered rate aims, as a fraction of the budget: the rate that made the steps
/// `excess` slower is scaled to make them `AIM * budget` slower. Aimed at the budget itself,
/// the steps sat at its edge, and the noise of the next decisions put half of them over it.
const AIM: f64 = 0.75;
/// A rate this high without a measured ceiling is no limit at all.
const NO_LIMIT_ABOVE: f64 = 64e9;

/// Settings of the persist governor ([`ManagerConfig::persist_governor`](
/// crate::ManagerConfig::persist_governor); `ckpt-train --persist-budget`).
#[derive(Debug, Clone, PartialEq)]
pub struct GovernorConfig {
    /// How much slower a step may be while a persist runs, as a fraction (0.10: 10 %).
    pub budget: f64,
    /// The lowest rate the governor sets, raw bytes per second: the bound on time to durable
    /// (a persist of `B` bytes takes at most about `B / min_rate`).
    pub min_rate: u64,
    /// The persist time one decision averages over.
    pub decide_every: Duration,
}

impl Default for GovernorConfig {
    fn default() -> Self {
        GovernorConfig {
            budget: DEFAULT_BUDGET,
            min_rate: DEFAULT_MIN_RATE,
            decide_every: DEFAULT_DECIDE_EVERY,
        }
    }
}

impl GovernorConfig {
    /// A governor with `budget` and the other settings' defaults.
    pub fn with_budget(budget: f64) -> Self {
        GovernorConfig {
            budget,
            ..Default::default()
        }
    }

    /// Whether the settings make sense; the error says which does not.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if !(self.budget.is_finite() && self.budget > 0.0) {
            return Err(format!(
                "the slowdown budget must be a positive fraction (0.1 = 10 %), not {}",
                self.budget
            ));
        }
        if self.min_rate == 0 {
            return Err("the lowest persist rate must be above 0 bytes/s".into());
        }
        if self.decide_every.is_zero() {
            return Err("decide_every must be longer than 0".into());
        }
        Ok(())
    }
}

/// Why the rate changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Steps beside the persist were slower than the budget allows: lowered.
    OverBudget,
    /// Steps beside the persist were well within the budget: raised (or lifted).
    UnderBudget,
}

impl Reason {
    /// The name in the `persist_rate` record.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::OverBudget => "over_budget",
            Reason::UnderBudget => "under_budget",
        }
    }
}

/// A change of the rate, with the figures it was decided on.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    /// The rate before, raw bytes/s (`None`: no limit).
    pub from: Option<u64>,
    /// The rate from now on (`None`: no limit).
    pub to: Option<u64>,
    /// Why.
    pub reason: Reason,
    /// The slowdown observed (step time beside the persist over the baseline).
    pub slowdown: f64,
    /// The baseline step time, seconds.
    pub baseline_s: f64,
    /// The new rate is the floor ([`GovernorConfig::min_rate`]).
    pub at_floor: bool,
}

/// What the governor saw of one persist ([`Governor::persist_done`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PersistSummary {
    /// The slowdown of the steps beside it (overlap-weighted); `None`: no step was measured
    /// beside it (or no baseline yet).
    pub slowdown: Option<f64>,
    /// Seconds of step time that overlapped it.
    pub overlap_s: f64,
    /// The rate in force when it ended (`None`: no limit).
    pub rate: Option<u64>,
}

/// Overlap seconds and the undisturbed seconds the same work would have taken.
#[derive(Debug, Clone, Copy, Default)]
struct Sum {
    overlap: f64,
    undisturbed: f64,
}

impl Sum {
    fn slowdown(&self) -> Option<f64> {
        (self.overlap > 0.0 && self.undisturbed > 0.0).then_some(self.overlap / self.undisturbed)
    }
}

/// The persist governor's state (see the module docs).
#[derive(Debug, Clone)]
pub struct Governor {
    cfg: GovernorConfig,
    clean: VecDeque<f64>,
    rate: Option<f64>,
    ceiling: Option<f64>,
    /// Since the last decision.
    window: Sum,
    /// Since the persist started.
    persist: Sum,
}

impl Governor {
    /// A governor with no limit set yet.
    pub fn new(cfg: GovernorConfig) -> Self {
        Governor {
            cfg,
            clean: VecDeque::new(),
            rate: None,
            ceiling: None,
            window: Sum::default(),
            persist: Sum::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &GovernorConfig {
        &self.cfg
    }

    /// The rate in force, raw bytes/s (`None`: no limit).
    pub fn rate(&self) -> Option<u64> {
        self.rate.map(|r| r as u64)
    }

    /// The measured throughput of an unlimited persist, raw bytes/s.
    pub fn ceiling(&self) -> Option<f64> {
        self.ceiling
    }

    /// The baseline step time (median of the clean intervals), once there are enough.
    pub fn baseline(&self) -> Option<f64> {
        if self.clean.len() < MIN_BASELINE {
            return None;
        }
        let mut v: Vec<f64> = self.clean.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }

    /// A step interval of `secs` with no save in flight.
    pub fn clean_step(&mut self, secs: f64) {
        if !secs.is_finite() || secs <= 0.0 {
            return;
        }
        if self.clean.len() == BASELINE_WINDOW {
            self.clean.pop_front();
        }
        self.clean.push_back(secs);
    }

    /// A step interval of `loop_s` seconds (the copy into staging taken out), `overlap_s` of
    /// which a persist ran beside; `throughput`: the persist's raw bytes/s so far. Returns the
    /// change of the rate it leads to, if any.
    pub fn busy_step(
        &mut self,
        loop_s: f64,
        overlap_s: f64,
        throughput: Option<f64>,
    ) -> Option<Change> {
        let base = self.baseline()?;
        if !(loop_s.is_finite() && overlap_s.is_finite()) || overlap_s <= 0.0 || loop_s <= 0.0 {
            return None;
        }
        let o = overlap_s.min(loop_s);
        // The work done in the overlap would have taken `o - excess` undisturbed; bounded so a
        // single odd interval cannot claim a slowdown beyond 10x or a speed-up beyond 2x.
        let u = (o - (loop_s - base)).clamp(o / 10.0, o * 2.0);
        for s in [&mut self.window, &mut self.persist] {
            s.overlap += o;
            s.undisturbed += u;
        }
        if self.window.overlap >= self.cfg.decide_every.as_secs_f64() {
            return self.decide(throughput);
        }
        None
    }

    /// The persist ended after `persist_s` seconds of persisting `bytes` raw bytes (the copy
    /// into staging excluded), `limited`: a rate limit applied at some time during it.
    /// Decides on what was seen since the last decision (when it is at least a fifth of a
    /// decision's worth), learns the ceiling from an unlimited persist, and sums it up.
    pub fn persist_done(
        &mut self,
        bytes: u64,
        persist_s: f64,
        limited: bool,
    ) -> (PersistSummary, Option<Change>) {
        let change = if self.window.overlap >= self.cfg.decide_every.as_secs_f64() / 5.0 {
            let t = (persist_s > 0.0).then_some(bytes as f64 / persist_s);
            self.decide(t)
        } else {
            None
        };
        self.window = Sum::default();
        if !limited && persist_s > 0.0 && bytes > 0 {
            self.ceiling = Some(bytes as f64 / persist_s);
        }
        let summary = PersistSummary {
            slowdown: self.persist.slowdown(),
            overlap_s: self.persist.overlap,
            rate: self.rate(),
        };
        self.persist = Sum::default();
        (summary, change)
    }

    fn decide(&mut self, throughput: Option<f64>) -> Option<Change> {
        let w = std::mem::take(&mut self.window);
        let ratio = w.slowdown()?;
        let base = self.baseline()?;
        let excess = ratio - 1.0;
        let budget = self.cfg.budget;
        let floor = self.cfg.min_rate as f64;
        let (to, reason) = if excess > budget {
            let current = self
                .rate
                .or(throughput.filter(|t| *t > 0.0))
                .or(self.ceiling)?;
            let to = (current * (AIM * budget / excess).clamp(0.25, 0.8)).max(floor);
            if self.rate.is_some_and(|r| r <= to) || self.ceiling.is_some_and(|c| to >= c) {
                // Already at the floor (or the floor is above what a persist does anyway).
                return None;
            }
            (Some(to), Reason::OverBudget)
        } else if excess < budget / 2.0 {
            let r = self.rate?;
            let to = r * 1.5;
            let lift = self.ceiling.map_or(to >= NO_LIMIT_ABOVE, |c| to >= c);
            (if lift { None } else { Some(to) }, Reason::UnderBudget)
        } else {
            return None;
        };
        let from = self.rate();
        self.rate = to;
        Some(Change {
            from,
            to: self.rate(),
            reason,
            slowdown: ratio,
            baseline_s: base,
            at_floor: to.is_some_and(|t| t <= floor),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: f64 = 1e6;

    fn governor(budget: f64) -> Governor {
        let mut g = Governor::new(GovernorConfig {
            budget,
            min_rate: 10_000_000,
            decide_every: Duration::from_secs(1),
        });
        for s in [1.0, 1.02, 0.98, 1.0, 5.0] {
            g.clean_step(s);
        }
        g
    }

    #[test]
    fn the_baseline_is_the_median_of_clean_steps_and_needs_a_few() {
        let mut g = Governor::new(GovernorConfig::default());
        g.clean_step(1.0);
        g.clean_step(1.0);
        assert_eq!(g.baseline(), None);
        assert_eq!(
            g.busy_step(2.0, 2.0, Some(100.0 * MB)),
            None,
            "no baseline: no action"
        );
        g.clean_step(9.0); // an outlier does not move the median
        assert_eq!(g.baseline(), Some(1.0));
        g.clean_step(f64::NAN);
        g.clean_step(-1.0);
        assert_eq!(g.clean.len(), 3, "nonsense is not a step");
    }

    #[test]
    fn over_budget_lowers_from_the_persists_throughput() {
        let mut g = governor(0.10);
        // 1.4x slower beside an unlimited persist doing 200 MB/s: excess 0.4, budget 0.1 ->
        // a quarter of the throughput.
        let c = g.busy_step(1.4, 1.4, Some(200.0 * MB)).expect("a change");
        assert_eq!(c.reason, Reason::OverBudget);
        assert_eq!((c.from, c.to), (None, Some(50_000_000)));
        assert!((c.slowdown - 1.4).abs() < 1e-9, "{c:?}");
        assert_eq!(c.baseline_s, 1.0);
        assert!(!c.at_floor);
        // Still 1.2x: from the rate in force, aiming at 3/4 of the budget: by 0.075/0.2.
        let c = g.busy_step(1.2, 1.2, Some(50.0 * MB)).expect("a change");
        assert_eq!((c.from, c.to), (Some(50_000_000), Some(18_750_000)));
        assert_eq!(g.rate(), Some(18_750_000));
        // Where that rate aimed (1.075x, within the budget): held.
        assert_eq!(g.busy_step(1.075, 1.075, None), None);
    }

    #[test]
    fn the_floor_bounds_the_rate_and_reports_it() {
        let mut g = governor(0.05);
        let c = g.busy_step(3.0, 3.0, Some(20.0 * MB)).expect("a change");
        assert_eq!(c.to, Some(10_000_000));
        assert!(c.at_floor);
        // At the floor: over budget again changes nothing.
        assert_eq!(g.busy_step(3.0, 3.0, Some(10.0 * MB)), None);
        assert_eq!(g.rate(), Some(10_000_000));
    }

    #[test]
    fn under_budget_raises_and_lifts_at_the_ceiling() {
        let mut g = governor(0.10);
        // An unlimited persist of 400 MB in 2 s: the ceiling is 200 MB/s.
        let (s, _) = g.persist_done(400_000_000, 2.0, false);
        assert_eq!(s.rate, None);
        assert_eq!(g.ceiling(), Some(200.0 * MB));
        g.busy_step(1.5, 1.5, Some(200.0 * MB)).expect("lowered");
        assert_eq!(g.rate(), Some(50_000_000));
        // Within half the budget: up by half, each decision.
        let c = g.busy_step(1.01, 1.01, None).expect("raised");
        assert_eq!((c.reason, c.to), (Reason::UnderBudget, Some(75_000_000)));
        let c = g.busy_step(1.0, 1.0, None).expect("raised");
        assert_eq!(c.to, Some(112_500_000));
        let c = g.busy_step(1.0, 1.0, None).expect("raised");
        assert_eq!(c.to, Some(168_750_000));
        // The next step up passes the ceiling: no limit.
        let c = g.busy_step(1.0, 1.0, None).expect("lifted");
        assert_eq!((c.from, c.to), (Some(168_750_000), None));
        // Unlimited and within budget: nothing to do.
        assert_eq!(g.busy_step(1.0, 1.0, None), None);
    }

    #[test]
    fn between_half_and_the_whole_budget_holds() {
        let mut g = governor(0.10);
        g.busy_step(1.5, 1.5, Some(100.0 * MB)).expect("lowered");
        let r = g.rate();
        assert_eq!(g.busy_step(1.08, 1.08, None), None);
        assert_eq!(g.rate(), r);
    }

    #[test]
    fn short_steps_add_up_to_one_decision() {
        let mut g = Governor::new(GovernorConfig::default());
        for _ in 0..10 {
            g.clean_step(0.01);
        }
        // 1.5x slower steps of 15 ms: no decision before a second of persist time.
        let mut changes = Vec::new();
        for _ in 0..100 {
            changes.extend(g.busy_step(0.015, 0.015, Some(100.0 * MB)));
        }
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert!((changes[0].slowdown - 1.5).abs() < 1e-6, "{changes:?}");
    }

    #[test]
    fn a_partial_overlap_counts_only_its_part() {
        let mut g = governor(0.10);
        // A 1.2 s step of which the persist ran 0.4 s: the 0.2 s extra happened in those
        // 0.4 s, which did 0.2 s of work: 2x, not 1.2x.
        g.busy_step(1.2, 0.4, Some(100.0 * MB));
        let (s, c) = g.persist_done(40_000_000, 0.4, false);
        assert!((s.slowdown.unwrap() - 2.0).abs() < 1e-9, "{s:?}");
        assert_eq!(s.overlap_s, 0.4);
        // 0.4 s is over a fifth of a decision: decided at the end of the persist.
        let c = c.expect("lowered");
        assert_eq!(c.reason, Reason::OverBudget);
    }

    #[test]
    fn a_summary_per_persist_and_the_rate_carries_over() {
        let mut g = governor(0.25);
        g.busy_step(1.1, 1.1, Some(100.0 * MB));
        let (s, c) = g.persist_done(100_000_000, 1.0, false);
        assert_eq!(c, None, "within budget and unlimited");
        assert!((s.slowdown.unwrap() - 1.1).abs() < 1e-9);
        g.busy_step(2.0, 2.0, Some(100.0 * MB)).expect("lowered");
        let (s, _) = g.persist_done(100_000_000, 4.0, true);
        assert_eq!(s.rate, Some(25_000_000));
        assert_eq!(
            g.ceiling(),
            Some(100.0 * MB),
            "a limited persist is no ceiling"
        );
        // The next persist starts at the rate the last one settled at.
        assert_eq!(g.rate(), Some(25_000_000));
        let (s, c) = g.persist_done(0, 0.0, true);
        assert_eq!((s.slowdown, c), (None, None), "nothing measured beside it");
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(GovernorConfig::default().validate().is_ok());
        assert!(GovernorConfig::with_budget(0.0).validate().is_err());
        assert!(GovernorConfig::with_budget(f64::NAN).validate().is_err());
        let c = GovernorConfig {
            min_rate: 0,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().contains("rate"));
    }
}
