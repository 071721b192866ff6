//! The automatic checkpoint interval ([`AutoInterval`], `ckpt-train --ckpt-every auto`):
//! Young/Daly's interval from the measured cost of a save and the run's failure rate, in
//! steps, within the user's bounds. The arithmetic is pure (time enters as values); the
//! [`CheckpointManager`](crate::CheckpointManager) feeds it and logs each change.
//!
//! - **Cost of a save** ([`CostMeter`]): the training loop's time between two `maybe_save`
//!   calls is a step interval. An interval with a save in flight (its `save` call, waiting
//!   for its snapshot, and the steps that ran while it persisted) is *busy*, any other is
//!   *clean*. A save's cost is the sum over its busy intervals of their excess over the
//!   median clean interval: the stall plus the slowdown of the steps that ran beside the
//!   persist. It is at least the time its `save` call blocked the loop (a noisy baseline
//!   must not make a save look free). The cost used is the mean of the last
//!   [`COST_WINDOW`] saves.
//! - **Failure rate** ([`failure_rate`]): failures in the run's recovery log (`failure`
//!   records; several ranks failing in one generation count once, as one restart) over the
//!   run's wall time so far (its first logged event to now). With no failure logged, the
//!   MTBF is the prior the user gives ([`DEFAULT_MTBF_PRIOR`] by default).
//! - **Interval** ([`choose_steps`]): `sqrt(2 x cost x MTBF)` seconds, divided by the clean
//!   step time and rounded, clamped to `[min, max]` steps. Steps, not seconds, because every
//!   rank must checkpoint the same steps.
//! - **Ranks in separate processes** ([`generation_choice`]): the interval is fixed per
//!   generation and derived by every rank from the same inputs, the run's recovery log as it
//!   stood when the generation started (its marker's time): the failures of earlier
//!   generations over the run's time up to that start, and the newest `save_cost` record
//!   rank 0 of an earlier generation logged. Every rank proposes its result and all use the
//!   first one stored for the generation (`CommitLog::agree_generation_interval`), so a log record
//!   that lands while they read cannot split them.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use ckpt_recovery::records::{CheckpointInterval, Event, Logged};
use parking_lot::Mutex;

/// The MTBF assumed while the run's recovery log holds no failure: one day.
pub const DEFAULT_MTBF_PRIOR: Duration = Duration::from_secs(24 * 3600);
/// The default bounds of `ckpt-train --ckpt-every auto`, in steps.
pub const DEFAULT_MIN_STEPS: u64 = 5;
/// See [`DEFAULT_MIN_STEPS`].
pub const DEFAULT_MAX_STEPS: u64 = 1000;
/// The saves whose costs are averaged.
pub const COST_WINDOW: usize = 8;
/// The clean step intervals whose median is the baseline.
pub const STEP_WINDOW: usize = 64;

/// Young/Daly's optimal checkpoint interval, seconds: `sqrt(2 x cost x mtbf)` (negative inputs
/// count as 0).
pub fn young_daly_s(cost_s: f64, mtbf_s: f64) -> f64 {
    (2.0 * cost_s.max(0.0) * mtbf_s.max(0.0)).sqrt()
}

/// Why an interval has its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// Young/Daly's interval, within the bounds.
    YoungDaly,
    /// Clamped up to the lower bound.
    Min,
    /// Clamped down to the upper bound.
    Max,
    /// No clean step measured yet to compare against: the interval doubles (within the
    /// bounds), so that steps without a save in flight appear.
    NoBaseline,
    /// Ranks in separate processes: no earlier generation measured a save (the first one):
    /// the lower bound.
    NoCost,
}

impl Why {
    /// The name in the `checkpoint_interval` record.
    pub fn as_str(self) -> &'static str {
        match self {
            Why::YoungDaly => "young_daly",
            Why::Min => "min",
            Why::Max => "max",
            Why::NoBaseline => "no_baseline",
            Why::NoCost => "no_cost",
        }
    }
}

/// An interval chosen by [`choose_steps`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// Steps between checkpoints.
    pub steps: u64,
    /// Young/Daly's interval in seconds.
    pub target_s: f64,
    /// Why.
    pub why: Why,
}

/// The interval in steps: Young/Daly's seconds over the time of a step, rounded, clamped to
/// `[min, max]` (`min` at least 1).
pub fn choose_steps(cost_s: f64, mtbf_s: f64, step_s: f64, min: u64, max: u64) -> Choice {
    let min = min.max(1);
    let max = max.max(min);
    let target_s = young_daly_s(cost_s, mtbf_s);
    let steps = if step_s > 0.0 {
        (target_s / step_s).round()
    } else {
        f64::INFINITY
    };
    let (steps, why) = if steps.is_nan() || steps < min as f64 {
        (min, Why::Min)
    } else if steps > max as f64 {
        (max, Why::Max)
    } else {
        (steps as u64, Why::YoungDaly)
    };
    Choice {
        steps,
        target_s,
        why,
    }
}

/// The failure rate of a run, from its recovery log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FailureRate {
    /// Failures counted (distinct generations with a `failure` record).
    pub failures: u64,
    /// Seconds they were counted over: the run's first logged event to now.
    pub observed_s: f64,
    /// The mean time between failures: `observed_s / failures`, or the prior.
    pub mtbf_s: f64,
    /// Whether `mtbf_s` is the prior (no failure yet).
    pub prior: bool,
}

impl FailureRate {
    /// No failure counted over no time: the MTBF is `prior`.
    pub fn prior(prior: Duration) -> FailureRate {
        FailureRate {
            failures: 0,
            observed_s: 0.0,
            mtbf_s: prior.as_secs_f64(),
            prior: true,
        }
    }
}

/// An interval decided, with the figures it came from: what a `checkpoint_interval` record
/// says besides the failure rate ([`Decided::record`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decided {
    /// Steps between checkpoints.
    pub steps: u64,
    /// Why.
    pub why: Why,
    /// The measured cost of a save, seconds.
    pub cost_s: Option<f64>,
    /// The time of a clean step, seconds.
    pub step_s: Option<f64>,
    /// Young/Daly's interval, seconds (when it was computed).
    pub target_s: Option<f64>,
}

impl Decided {
    /// The `checkpoint_interval` record: decided after `step`, changing the interval from
    /// `from_steps`, under the failure rate `rate`, for `generation` (ranks in separate
    /// processes) or for the ranks of one process (`None`).
    pub fn record(
        &self,
        step: u64,
        from_steps: u64,
        rate: &FailureRate,
        generation: Option<u64>,
    ) -> CheckpointInterval {
        CheckpointInterval {
            step,
            from_steps,
            to_steps: self.steps,
            reason: self.why.as_str().to_string(),
            cost_s: self.cost_s,
            step_s: self.step_s,
            target_s: self.target_s,
            mtbf_s: rate.mtbf_s,
            failures: rate.failures,
            observed_s: rate.observed_s,
            mtbf_prior: rate.prior,
            generation,
        }
    }
}

/// The failure rate that `events` (the run's events log,
/// [`ckpt_recovery::records::read_records`]) show at `now_ms` (Unix milliseconds), with `prior`
/// as the MTBF while none is logged.
pub fn failure_rate(events: &[Logged<Event>], now_ms: i64, prior: Duration) -> FailureRate {
    let mut generations: Vec<u64> = events
        .iter()
        .filter_map(|e| match &e.record {
            Event::Failure(f) => Some(f.generation),
            _ => None,
        })
        .collect();
    generations.sort_unstable();
    generations.dedup();
    let failures = generations.len() as u64;
    let since = events.iter().map(|e| e.t_ms).filter(|&t| t > 0).min();
    let observed_s = since.map_or(0.0, |t| (now_ms - t).max(0) as f64 / 1000.0);
    if failures == 0 {
        return FailureRate {
            observed_s,
            ..FailureRate::prior(prior)
        };
    }
    FailureRate {
        failures,
        observed_s,
        // A run whose failures all came at once has no time between them: the lower bound
        // of the interval applies then.
        mtbf_s: observed_s / failures as f64,
        prior: false,
    }
}

/// The interval of `generation`, derived from the run's events log (`events`) as it stood when
/// the generation started (`start_ms`, its marker's time): the same records give the same
/// answer on every rank. Only records written at or before `start_ms` count, and of those only
/// `failure` and `save_cost` records of older generations (a zombie of an old generation, or
/// this generation's own rank 0, cannot change it):
///
/// - the failure rate: [`failure_rate`] at `start_ms` (failures over the run's time up to this
///   generation's start; the prior while none is logged);
/// - the cost: the newest `save_cost` record (by generation, then step), whose `cost_s` and
///   `step_s` go to [`choose_steps`]; one without a cost (no clean step measured) doubles
///   the previous generation's interval; none at all (the first generation): the lower bound.
///
/// The result is the `checkpoint_interval` record to log, with `generation` set; `from_steps`
/// is the newest earlier generation's interval (the lower bound if none).
pub fn generation_choice(
    events: &[Logged<Event>],
    generation: u64,
    start_ms: i64,
    auto: &AutoInterval,
) -> CheckpointInterval {
    let before: Vec<Logged<Event>> = events
        .iter()
        .filter(|e| e.t_ms <= start_ms)
        .filter(|e| match &e.record {
            Event::Failure(f) => f.generation < generation,
            Event::SaveCost(c) => c.generation < generation,
            Event::CheckpointInterval(c) => c.generation.is_some_and(|g| g < generation),
            _ => true,
        })
        .cloned()
        .collect();
    let rate = failure_rate(&before, start_ms, auto.mtbf_prior);
    let cost = before
        .iter()
        .filter_map(|e| match &e.record {
            Event::SaveCost(c) => Some((c.generation, c.step, e.t_ms, c)),
            _ => None,
        })
        .max_by_key(|x| (x.0, x.1, x.2))
        .map(|x| x.3);
    let previous = before
        .iter()
        .filter_map(|e| match &e.record {
            Event::CheckpointInterval(c) => Some((c.generation, e.t_ms, c.to_steps)),
            _ => None,
        })
        .max_by_key(|x| (x.0, x.1))
        .map(|x| x.2)
        .filter(|&s| s > 0);
    let min = auto.min_steps.max(1);
    let max = auto.max_steps.max(min);
    let from_steps = previous.unwrap_or(min).clamp(min, max);
    let decided = match cost {
        Some(c) => match (c.cost_s, c.step_s) {
            (Some(cost_s), Some(step_s)) => {
                let ch = choose_steps(cost_s, rate.mtbf_s, step_s, min, max);
                Decided {
                    steps: ch.steps,
                    why: ch.why,
                    cost_s: Some(cost_s),
                    step_s: Some(step_s),
                    target_s: Some(ch.target_s),
                }
            }
            _ => Decided {
                steps: from_steps.saturating_mul(2).clamp(min, max),
                why: Why::NoBaseline,
                cost_s: c.cost_s,
                step_s: c.step_s,
                target_s: None,
            },
        },
        None => Decided {
            steps: min,
            why: Why::NoCost,
            cost_s: None,
            step_s: None,
            target_s: None,
        },
    };
    decided.record(0, from_steps, &rate, Some(generation))
}

/// Measures what a save costs the training loop (see the module docs). Time enters as values.
#[derive(Debug, Clone, Default)]
pub struct CostMeter {
    /// The newest clean step intervals, seconds.
    clean: VecDeque<f64>,
    /// The newest per-save costs, seconds.
    costs: VecDeque<f64>,
    /// The saves being measured: their busy intervals, the largest `save` call stall, and how
    /// many saves (a save started while the previous one persists joins its measurement).
    open: Option<Open>,
}

#[derive(Debug, Clone, Default)]
struct Open {
    busy: Vec<f64>,
    stall_s: f64,
    saves: u32,
}

impl CostMeter {
    /// A step interval of `secs`; `busy`: a save was in flight during it.
    pub fn step(&mut self, secs: f64, busy: bool) {
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        match (&mut self.open, busy) {
            (Some(o), true) => o.busy.push(secs),
            _ => {
                if self.clean.len() == STEP_WINDOW {
                    self.clean.pop_front();
                }
                self.clean.push_back(secs);
            }
        }
    }

    /// A save started; its `save` call blocked the loop `stall_s`.
    pub fn save_started(&mut self, stall_s: f64) {
        let o = self.open.get_or_insert_with(Open::default);
        o.saves += 1;
        o.stall_s = o.stall_s.max(stall_s);
    }

    /// Whether a save is being measured.
    pub fn measuring(&self) -> bool {
        self.open.is_some()
    }

    /// The saves being measured are done (persisted or failed): their cost per save, once a
    /// clean baseline exists (`None` otherwise; the measurement is dropped).
    pub fn save_done(&mut self) -> Option<f64> {
        let o = self.open.take()?;
        let base = self.step_s()?;
        let excess: f64 = o.busy.iter().map(|t| t - base).sum();
        let cost = (excess / o.saves.max(1) as f64).max(o.stall_s);
        if self.costs.len() == COST_WINDOW {
            self.costs.pop_front();
        }
        self.costs.push_back(cost);
        Some(cost)
    }

    /// The time of a step without a save in flight: the median of the newest clean intervals.
    pub fn step_s(&self) -> Option<f64> {
        if self.clean.is_empty() {
            return None;
        }
        let mut v: Vec<f64> = self.clean.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        Some(if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        })
    }

    /// The cost of a save: the mean of the newest measured ones.
    pub fn cost_s(&self) -> Option<f64> {
        (!self.costs.is_empty()).then(|| self.costs.iter().sum::<f64>() / self.costs.len() as f64)
    }
}

/// The automatic interval of a [`ManagerConfig`](crate::ManagerConfig) (`auto_interval`).
///
/// Every rank of a job must checkpoint the same steps. With the ranks of one process
/// (`per_generation` false), rank 0's manager decides during the run and the others follow
/// its [`IntervalSchedule`], which clones of this value share: give the managers of the ranks
/// of one process clones of one `AutoInterval`. With ranks in separate processes
/// (`per_generation` true) the interval is fixed for each generation of the job
/// ([`generation_choice`], agreed through the store), counted from the step the generation
/// resumed from; rank 0 keeps measuring and logs `save_cost` records for the next generation.
#[derive(Debug, Clone)]
pub struct AutoInterval {
    /// The fewest steps between checkpoints (also the interval until the first evaluation).
    pub min_steps: u64,
    /// The most steps between checkpoints.
    pub max_steps: u64,
    /// The MTBF assumed while the run's recovery log holds no failure.
    pub mtbf_prior: Duration,
    /// The interval in force from each step on (shared by clones).
    pub schedule: IntervalSchedule,
    /// Ranks in separate processes: one interval per generation, derived from the run's log
    /// at the generation's start and agreed through the store (see the type's docs).
    pub per_generation: bool,
}

impl AutoInterval {
    /// Bounds in steps and the prior MTBF, with a fresh schedule.
    pub fn new(min_steps: u64, max_steps: u64, mtbf_prior: Duration) -> Self {
        AutoInterval {
            min_steps,
            max_steps,
            mtbf_prior,
            schedule: IntervalSchedule::default(),
            per_generation: false,
        }
    }

    /// The same bounds, one interval per generation (ranks in separate processes).
    pub fn fixed_per_generation(mut self) -> Self {
        self.per_generation = true;
        self
    }

    /// Whether the bounds make sense.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_steps == 0 {
            return Err("the lower bound of the interval must be at least 1 step".into());
        }
        if self.max_steps < self.min_steps {
            return Err(format!(
                "the upper bound of the interval ({} steps) is below the lower bound ({} steps)",
                self.max_steps, self.min_steps
            ));
        }
        if self.mtbf_prior.is_zero() {
            return Err("the prior MTBF must be above 0 seconds".into());
        }
        Ok(())
    }

    /// The interval in force at `step`.
    pub fn at(&self, step: u64) -> u64 {
        self.schedule.at(step).unwrap_or(self.min_steps)
    }
}

/// The intervals decided so far: `(from_step, steps)`, in order.
#[derive(Debug, Clone, Default)]
pub struct IntervalSchedule(Arc<Mutex<Vec<(u64, u64)>>>);

impl IntervalSchedule {
    /// The interval in force at `step`, if one was decided at or before it.
    pub fn at(&self, step: u64) -> Option<u64> {
        let g = self.0.lock();
        g.iter().rev().find(|(from, _)| *from <= step).map(|e| e.1)
    }

    /// `steps` is in force from `from_step` on (replacing any decision for later steps: a
    /// rollback or restore goes back in steps).
    pub fn set(&self, from_step: u64, steps: u64) {
        let mut g = self.0.lock();
        g.retain(|(from, _)| *from < from_step);
        g.push((from_step, steps));
    }

    /// Every decision so far.
    pub fn entries(&self) -> Vec<(u64, u64)> {
        self.0.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_recovery::records::{Failure, SaveCost, Started};

    #[test]
    fn young_daly_by_hand() {
        // sqrt(2 * 2 s * 3600 s) = sqrt(14400) = 120 s.
        assert_eq!(young_daly_s(2.0, 3600.0), 120.0);
        // sqrt(2 * 0.5 * 100) = 10.
        assert_eq!(young_daly_s(0.5, 100.0), 10.0);
        assert_eq!(young_daly_s(-1.0, 100.0), 0.0);
    }

    #[test]
    fn steps_are_clamped_to_the_bounds() {
        // 120 s at 2 s a step: 60 steps, inside [5, 100].
        let c = choose_steps(2.0, 3600.0, 2.0, 5, 100);
        assert_eq!((c.steps, c.why, c.target_s), (60, Why::YoungDaly, 120.0));
        // 120 s at 0.5 s a step: 240 steps, above 100.
        assert_eq!(
            choose_steps(2.0, 3600.0, 0.5, 5, 100).steps_why(),
            (100, Why::Max)
        );
        // 10 s at 4 s a step: 2.5 rounds to 3, below 5.
        assert_eq!(
            choose_steps(0.5, 100.0, 4.0, 5, 100).steps_why(),
            (5, Why::Min)
        );
        // 10 s at 4 s, bounds [2, 100]: 3 (2.5 rounds away from zero).
        assert_eq!(
            choose_steps(0.5, 100.0, 4.0, 2, 100).steps_why(),
            (3, Why::YoungDaly)
        );
        // A free save (cost 0): the lower bound; an unknown step time: the upper one.
        assert_eq!(
            choose_steps(0.0, 3600.0, 1.0, 5, 100).steps_why(),
            (5, Why::Min)
        );
        assert_eq!(
            choose_steps(1.0, 3600.0, 0.0, 5, 100).steps_why(),
            (100, Why::Max)
        );
        // Bounds out of order or zero: min at least 1, max at least min.
        assert_eq!(choose_steps(0.0, 1.0, 1.0, 0, 0).steps_why(), (1, Why::Min));
    }

    impl Choice {
        fn steps_why(self) -> (u64, Why) {
            (self.steps, self.why)
        }
    }

    fn at(t_ms: i64, record: Event) -> Logged<Event> {
        Logged { t_ms, record }
    }

    fn failure(generation: u64, rank: u32) -> Event {
        Event::Failure(Failure {
            generation,
            rank,
            how: "signal".into(),
            ..Default::default()
        })
    }

    #[test]
    fn failures_over_the_runs_wall_time() {
        let prior = Duration::from_secs(7200);
        // Nothing logged: the prior.
        let r = failure_rate(&[], 1_000_000, prior);
        assert_eq!((r.failures, r.mtbf_s, r.prior), (0, 7200.0, true));
        let log = vec![
            at(100_000, Event::Started(Started::default())),
            at(160_000, failure(0, 1)),
            // A second rank of the same generation: the same failure (one restart).
            at(160_500, failure(0, 3)),
            at(170_000, Event::Started(Started::default())),
            at(250_000, failure(1, 0)),
            at(260_000, Event::Started(Started::default())),
        ];
        // Two failures in 400 s (100 s to 500 s): MTBF 200 s.
        let r = failure_rate(&log, 500_000, prior);
        assert_eq!(
            (r.failures, r.observed_s, r.mtbf_s, r.prior),
            (2, 400.0, 200.0, false)
        );
        // Only starts: the prior, with the time observed.
        let r = failure_rate(&log[..1], 500_000, prior);
        assert_eq!((r.failures, r.observed_s, r.mtbf_s), (0, 400.0, 7200.0));
    }

    fn cost(generation: u64, step: u64, cost_s: Option<f64>, step_s: Option<f64>) -> Event {
        Event::SaveCost(SaveCost {
            generation,
            rank: 0,
            step,
            cost_s,
            step_s,
            steps: 5,
            next_steps: 5,
        })
    }

    #[test]
    fn a_generations_interval_comes_from_the_log_before_its_start_only() {
        let auto = AutoInterval::new(2, 100, Duration::from_secs(7200)).fixed_per_generation();
        // The first generation: nothing measured yet, the lower bound.
        let c = generation_choice(&[], 0, 1_000_000, &auto);
        assert_eq!(
            (c.to_steps, c.reason.as_str(), c.from_steps, c.generation),
            (2, "no_cost", 2, Some(0))
        );
        assert!(
            c.mtbf_prior && c.failures == 0 && c.cost_s.is_none(),
            "{c:?}"
        );

        // Generation 2 starts at 500 s. Before it: the run started at 100 s, generations 0
        // and 1 failed, rank 0 of each logged its cost (generation 1's is the newest).
        let start = 500_000;
        let log = vec![
            at(100_000, Event::Started(Started::default())),
            at(150_000, cost(0, 10, Some(4.0), Some(1.0))),
            at(160_000, failure(0, 1)),
            at(170_000, Event::Started(Started::default())),
            at(200_000, cost(1, 30, Some(0.5), Some(0.5))),
            at(210_000, cost(1, 25, Some(9.0), Some(9.0))),
            at(250_000, failure(1, 0)),
        ];
        // Two failures in 400 s: MTBF 200 s; cost 0.5 s: sqrt(2 x 0.5 x 200) = 14.1 s, at
        // 0.5 s a step 28 steps.
        let c = generation_choice(&log, 2, start, &auto);
        assert_eq!(
            (c.failures, c.mtbf_s, c.observed_s),
            (2, 200.0, 400.0),
            "{c:?}"
        );
        assert_eq!((c.cost_s, c.step_s), (Some(0.5), Some(0.5)), "{c:?}");
        assert_eq!((c.to_steps, c.reason.as_str()), (28, "young_daly"), "{c:?}");
        assert_eq!(
            c,
            generation_choice(&log, 2, start, &auto),
            "not deterministic"
        );

        // Records that reach the log after the start (a zombie of an old generation writing
        // late, this generation's own rank 0, a later failure) or that belong to this or a
        // newer generation change nothing, whatever their order in the log.
        let mut late = log.clone();
        late.push(at(start + 1, cost(1, 99, Some(50.0), Some(0.01))));
        late.push(at(start + 5, failure(1, 3)));
        late.push(at(start + 9, failure(2, 0)));
        late.insert(3, at(300_000, cost(2, 40, Some(50.0), Some(0.01))));
        late.insert(4, at(310_000, failure(2, 1)));
        late.insert(0, at(320_000, cost(7, 1, None, None)));
        assert_eq!(generation_choice(&late, 2, start, &auto), c);
        // Yet the same failures do count for the next generation.
        let next = generation_choice(&late, 3, start + 10, &auto);
        assert_eq!(next.failures, 3, "{next:?}");

        // The interval before: the newest earlier generation's decision.
        let mut with_prev = log.clone();
        let mut prev = c.clone();
        prev.generation = Some(1);
        prev.to_steps = 16;
        with_prev.push(at(260_000, Event::CheckpointInterval(prev)));
        assert_eq!(
            generation_choice(&with_prev, 2, start, &auto).from_steps,
            16
        );
        // The newest cost lacks a baseline (every step had a save in flight): the interval
        // before, doubled.
        with_prev.push(at(270_000, cost(1, 40, None, None)));
        let d = generation_choice(&with_prev, 2, start, &auto);
        assert_eq!(
            (d.to_steps, d.reason.as_str()),
            (32, "no_baseline"),
            "{d:?}"
        );
    }

    #[test]
    fn cost_is_the_stall_plus_the_slowdown_beside_the_persist() {
        let mut m = CostMeter::default();
        // Clean steps of 1.0 s (one outlier of 5 s: the median ignores it).
        for t in [1.0, 1.0, 5.0, 1.0, 1.0] {
            m.step(t, false);
        }
        assert_eq!(m.step_s(), Some(1.0));
        assert_eq!(m.cost_s(), None);
        // A save: its call blocks 0.25 s, the interval holding it takes 1.5 s, then two
        // steps run beside the persist at 1.25 s and 1.0 s. Cost: 0.5 + 0.25 + 0 = 0.75 s.
        m.save_started(0.25);
        for t in [1.5, 1.25, 1.0] {
            m.step(t, true);
        }
        assert!(m.measuring());
        assert_eq!(m.save_done(), Some(0.75));
        assert!(!m.measuring());
        // Busy intervals did not enter the baseline.
        assert_eq!(m.step_s(), Some(1.0));
        // A second save: steps no slower than the baseline, but its call blocked 0.125 s:
        // its cost is at least that. The mean of both: (0.75 + 0.125) / 2.
        m.save_started(0.125);
        m.step(0.9, true);
        assert_eq!(m.save_done(), Some(0.125));
        assert_eq!(m.cost_s(), Some(0.4375));
        // Two saves in one measurement (the second started while the first persisted):
        // 2 s of excess over 4 busy steps, 1 s per save.
        m.save_started(0.0);
        m.step(1.5, true);
        m.save_started(0.0);
        for t in [1.5, 1.5, 1.5] {
            m.step(t, true);
        }
        assert_eq!(m.save_done(), Some(1.0));
        // The window keeps the newest COST_WINDOW costs.
        for _ in 0..COST_WINDOW {
            m.save_started(2.0);
            m.step(1.0, true);
            m.save_done();
        }
        assert_eq!(m.cost_s(), Some(2.0));
    }

    #[test]
    fn no_baseline_no_cost() {
        let mut m = CostMeter::default();
        m.save_started(0.5);
        m.step(3.0, true);
        assert_eq!(m.save_done(), None);
        assert_eq!(m.cost_s(), None);
        // Intervals outside a measurement are clean.
        m.step(2.0, true);
        assert_eq!(m.step_s(), Some(2.0));
    }

    #[test]
    fn the_schedule_is_shared_and_goes_back_with_the_steps() {
        let a = AutoInterval::new(5, 100, DEFAULT_MTBF_PRIOR);
        let b = a.clone();
        assert_eq!(b.at(1), 5);
        a.schedule.set(11, 40);
        a.schedule.set(51, 20);
        assert_eq!(
            (b.at(10), b.at(11), b.at(50), b.at(51), b.at(999)),
            (5, 40, 40, 20, 20)
        );
        // Back to step 30 (a rollback): later decisions are replaced.
        a.schedule.set(31, 8);
        assert_eq!(b.schedule.entries(), vec![(11, 40), (31, 8)]);
        assert!(
            AutoInterval::new(0, 5, DEFAULT_MTBF_PRIOR)
                .validate()
                .is_err()
        );
        assert!(
            AutoInterval::new(6, 5, DEFAULT_MTBF_PRIOR)
                .validate()
                .is_err()
        );
        assert!(AutoInterval::new(5, 5, Duration::ZERO).validate().is_err());
        assert!(a.validate().is_ok());
    }
}
