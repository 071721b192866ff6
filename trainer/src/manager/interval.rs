//! When a checkpoint is due: [`Interval`] holds the fixed policy (every N steps, every so
//! long) and the automatic interval's glue: it times the steps and the saves for the pure
//! [`crate::interval`] (cost meter, Young/Daly), reads the run's failure rate in the
//! background, re-decides on the deciding rank (`checkpoint_interval` events), and with one
//! interval per generation agrees on it in the store and logs what a save costs
//! (`save_cost`).

use std::time::{Duration, Instant};

use ckpt_recovery::records::{self, Event};
use ckpt_store::{Result, Store};
use tracing::{info, warn};

use super::ManagerConfig;
use super::events::EventLog;
use crate::interval::{
    AutoInterval, CostMeter, Decided, FailureRate, Why, choose_steps, failure_rate,
    generation_choice,
};
use crate::save::{CheckpointerConfig, SaveHandle, Stage, runtime};

/// The interval policy and what the automatic interval measures.
pub(crate) struct Interval {
    every_steps: Option<u64>,
    every: Option<Duration>,
    /// The automatic interval ([`ManagerConfig::auto_interval`]); replaces the fixed policy.
    auto: Option<AutoInterval>,
    /// This manager decides the automatic interval (rank 0's; the others follow its schedule).
    decides: bool,
    /// When the last save was taken.
    last_save: Instant,
    st: AutoState,
}

/// What the manager measures for the automatic interval.
#[derive(Default)]
struct AutoState {
    meter: CostMeter,
    /// The last `maybe_save` call: the end of the step interval measured next.
    last_tick: Option<Instant>,
    /// A save was in flight during the interval being measured.
    busy: bool,
    /// The newest save being measured.
    tracking: Option<SaveHandle>,
    /// The last step a checkpoint was due at (taken or skipped).
    last_due: Option<u64>,
    /// The run's recovery log, being read in the background.
    reading: Option<tokio::task::JoinHandle<Result<Vec<records::Logged<Event>>>>>,
    /// The failure rate last read.
    rate: Option<FailureRate>,
    /// Whether the interval was evaluated once (the first decision is logged even when it
    /// keeps the lower bound the run started with).
    evaluated: bool,
    /// One interval per generation: the one agreed for this generation, once it is.
    fixed: Option<records::CheckpointInterval>,
    /// One interval per generation: the step checkpoints are counted from (the step restored;
    /// 0 for a fresh run).
    anchor: Option<u64>,
    /// One interval per generation: agreeing failed (the store); try again after this.
    retry_at: Option<Instant>,
    /// One interval per generation: the last `save_cost` record logged (cost, step time,
    /// next interval).
    cost_logged: Option<(Option<f64>, Option<f64>, u64)>,
}

impl Interval {
    /// The policy of `cfg`.
    pub(crate) fn new(cfg: &ManagerConfig) -> Self {
        Interval {
            every_steps: cfg.every_steps,
            every: cfg.every,
            auto: cfg.auto_interval.clone(),
            decides: cfg.auto_interval.is_some() && cfg.ckpt.rank == 0,
            last_save: Instant::now(),
            st: AutoState::default(),
        }
    }

    /// Whether a checkpoint can ever be due: a fixed interval in steps or time, or the
    /// automatic one.
    pub(crate) fn any(&self) -> bool {
        self.auto.is_some() || self.every_steps.is_some_and(|n| n > 0) || self.every.is_some()
    }

    /// Whether a checkpoint is due at `step` (called once a step). `last_saved`: the step
    /// saved or restored last.
    pub(crate) fn due(
        &mut self,
        step: u64,
        last_saved: Option<u64>,
        store: &Store,
        cfg: &CheckpointerConfig,
        events: &mut EventLog,
    ) -> bool {
        match self.auto.clone() {
            Some(auto) => self.auto_due(&auto, step, last_saved, store, cfg, events),
            None => {
                let due_steps = self
                    .every_steps
                    .is_some_and(|n| n > 0 && step.is_multiple_of(n));
                let due_time = self.every.is_some_and(|d| self.last_save.elapsed() >= d);
                due_steps || due_time
            }
        }
    }

    /// A checkpoint was due at `step` (taken or skipped).
    pub(crate) fn note_due(&mut self, step: u64) {
        self.st.last_due = Some(step);
    }

    /// `h` saves `step`; `t0` is when the save began (its state not yet gathered). The
    /// deciding rank measures the save.
    pub(crate) fn saved(
        &mut self,
        step: u64,
        h: &SaveHandle,
        t0: Instant,
        store: &Store,
        cfg: &CheckpointerConfig,
        events: &mut EventLog,
    ) {
        self.last_save = Instant::now();
        self.st.last_due = Some(step);
        if !self.decides {
            return;
        }
        // The measured save may have been in flight at every `maybe_save` since it started
        // (persists slower than the interval, as on a loaded machine): if it has ended by
        // now it is measured here, before the new one replaces it (else no cost was ever
        // taken and the interval never re-evaluated). A save skipped by back-pressure
        // leaves the one in flight measured.
        let prev_ended = self.st.tracking.as_ref().map(|p| p.stage().persist_ended());
        if let Some(auto) = self.auto.clone()
            && prev_ended == Some(true)
        {
            self.tracked_save_done(&auto, step, store, cfg, events);
        }
        if !(prev_ended == Some(false) && matches!(h.stage(), Stage::Skipped(_))) {
            self.st.meter.save_started(t0.elapsed().as_secs_f64());
            self.st.tracking = Some(h.clone());
        }
        self.st.busy = true;
        if self.auto.as_ref().is_some_and(|a| !a.per_generation) {
            self.read_failures(store, &cfg.run);
        }
    }

    /// `step` was restored: checkpoints are counted from it, and the restore's time is not a
    /// step (a save measured before it is abandoned).
    pub(crate) fn restored(&mut self, step: u64) {
        self.st.last_due = Some(step);
        self.st.anchor = Some(step);
        self.st.last_tick = None;
        self.st.tracking = None;
        self.st.busy = false;
        self.st.meter.save_done();
    }

    /// The automatic interval at `step`: measure the step interval that ended, evaluate the
    /// interval when the save being measured is done (the decider), and say whether a
    /// checkpoint is due (the interval in force has passed since the last due one).
    fn auto_due(
        &mut self,
        auto: &AutoInterval,
        step: u64,
        last_saved: Option<u64>,
        store: &Store,
        cfg: &CheckpointerConfig,
        events: &mut EventLog,
    ) -> bool {
        if auto.per_generation && self.st.fixed.is_none() {
            self.fix_generation_interval(auto, last_saved, store, cfg, events);
        }
        if self.decides {
            let now = Instant::now();
            if let Some(prev) = self.st.last_tick {
                let busy = self.st.busy && self.st.meter.measuring();
                self.st
                    .meter
                    .step(now.duration_since(prev).as_secs_f64(), busy);
            }
            self.st.last_tick = Some(now);
            let done = self.st.tracking.as_ref().map(|h| h.stage().persist_ended());
            if done == Some(true) {
                self.tracked_save_done(auto, step, store, cfg, events);
            }
            self.st.busy = self.st.tracking.is_some();
        }
        if auto.per_generation {
            // Counted from the step the generation resumed from, which every rank restored:
            // no rank's history (a skipped checkpoint, a late agreement) shifts its steps.
            let Some(n) = self.st.fixed.as_ref().map(|c| c.to_steps.max(1)) else {
                return false;
            };
            let anchor = self.st.anchor.unwrap_or(0);
            return step > anchor && (step - anchor).is_multiple_of(n);
        }
        let base = self.st.last_due.or(last_saved).unwrap_or(0);
        step >= base.saturating_add(auto.at(step))
    }

    /// One interval per generation: derive this generation's interval from the run's log as it
    /// stood at the generation's start ([`generation_choice`]), propose it, and take the one
    /// agreed in the store (the first proposal of any rank of the generation). The rank whose
    /// proposal was stored logs it (`checkpoint_interval`). If the store fails, no checkpoint
    /// is due until a later try (a second on) agrees.
    fn fix_generation_interval(
        &mut self,
        auto: &AutoInterval,
        last_saved: Option<u64>,
        store: &Store,
        cfg: &CheckpointerConfig,
        events: &mut EventLog,
    ) {
        if self.st.retry_at.is_some_and(|t| Instant::now() < t) {
            return;
        }
        let run = &cfg.run;
        let generation = cfg.generation;
        let anchor = *self.st.anchor.get_or_insert(last_saved.unwrap_or(0));
        let r = runtime().block_on(async {
            let start_ms = match store.log().generation_started_ms(run, generation).await? {
                Some(t) => t,
                None => store.now().timestamp_millis(),
            };
            let events = records::read_records::<Event>(store, run).await?;
            let mut proposal = generation_choice(&events, generation, start_ms, auto);
            proposal.step = anchor;
            store
                .log()
                .agree_generation_interval(run, generation, &proposal)
                .await
        });
        let (agreed, proposed) = match r {
            Ok(x) => x,
            Err(e) => {
                warn!(
                    generation,
                    "agreeing on the checkpoint interval of this generation: {e}; no checkpoint until it is agreed"
                );
                self.st.retry_at = Some(Instant::now() + Duration::from_secs(1));
                return;
            }
        };
        auto.schedule.set(0, agreed.to_steps);
        info!(
            generation,
            from_step = agreed.step,
            steps = agreed.to_steps,
            reason = agreed.reason.as_str(),
            cost_s = agreed.cost_s,
            step_s = agreed.step_s,
            mtbf_s = agreed.mtbf_s,
            failures = agreed.failures,
            proposed,
            "checkpoint interval of this generation"
        );
        if proposed {
            events.log(Event::CheckpointInterval(agreed.clone()));
        }
        self.st.fixed = Some(agreed);
    }

    /// The save the automatic interval measures has ended: take its cost, then log it (one
    /// rank per process) or evaluate the interval (ranks in one process).
    fn tracked_save_done(
        &mut self,
        auto: &AutoInterval,
        step: u64,
        store: &Store,
        cfg: &CheckpointerConfig,
        events: &mut EventLog,
    ) {
        self.st.tracking = None;
        let measured = self.st.meter.save_done();
        if auto.per_generation {
            self.log_save_cost(auto, step, cfg, events);
        } else {
            self.evaluate_interval(auto, step, measured.is_some(), store, events);
        }
    }

    /// One interval per generation, on the deciding rank: log what a save costs
    /// (`save_cost`) for the next generation, when it is the first measurement or the figures
    /// moved by a tenth or more (or the interval they call for changed).
    fn log_save_cost(
        &mut self,
        auto: &AutoInterval,
        step: u64,
        cfg: &CheckpointerConfig,
        events: &mut EventLog,
    ) {
        let Some(fixed) = self.st.fixed.clone() else {
            return;
        };
        let cost_s = self.st.meter.cost_s();
        let step_s = self.st.meter.step_s();
        let next_steps = match (cost_s, step_s) {
            (Some(c), Some(s)) => {
                choose_steps(c, fixed.mtbf_s, s, auto.min_steps, auto.max_steps).steps
            }
            _ => fixed
                .to_steps
                .saturating_mul(2)
                .clamp(auto.min_steps, auto.max_steps),
        };
        let moved = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => (a - b).abs() * 10.0 >= b.abs(),
            (a, b) => a.is_some() != b.is_some(),
        };
        if let Some((c0, s0, n0)) = self.st.cost_logged
            && !moved(cost_s, c0)
            && !moved(step_s, s0)
            && n0 == next_steps
        {
            return;
        }
        self.st.cost_logged = Some((cost_s, step_s, next_steps));
        events.log(Event::SaveCost(records::SaveCost {
            generation: cfg.generation,
            rank: cfg.rank,
            step,
            cost_s,
            step_s,
            steps: fixed.to_steps,
            next_steps,
        }));
    }

    /// Read the run's recovery log in the background (one read at a time): the failure rate
    /// for the next evaluation.
    fn read_failures(&mut self, store: &Store, run: &str) {
        if self.st.reading.is_some() {
            return;
        }
        let store = store.clone();
        let run = run.to_string();
        self.st.reading = Some(
            runtime().spawn(async move { records::read_records::<Event>(&store, &run).await }),
        );
    }

    /// The failure rate: the newest read of the recovery log (waited for only when none
    /// finished yet).
    fn failure_rate(&mut self, auto: &AutoInterval, store: &Store) -> FailureRate {
        let ready =
            self.st.rate.is_none() || self.st.reading.as_ref().is_some_and(|r| r.is_finished());
        if ready && let Some(r) = self.st.reading.take() {
            match runtime().block_on(r) {
                Ok(Ok(events)) => {
                    let now = store.now().timestamp_millis();
                    self.st.rate = Some(failure_rate(&events, now, auto.mtbf_prior));
                }
                Ok(Err(e)) => warn!("reading the recovery log for the checkpoint interval: {e}"),
                Err(e) => warn!("reading the recovery log for the checkpoint interval: {e}"),
            }
        }
        self.st
            .rate
            .unwrap_or_else(|| FailureRate::prior(auto.mtbf_prior))
    }

    /// Choose the interval after `step` from the cost of a save and the failure rate; log the
    /// first decision and every change (`checkpoint_interval`) and put it in force from the
    /// next step.
    fn evaluate_interval(
        &mut self,
        auto: &AutoInterval,
        step: u64,
        measured: bool,
        store: &Store,
        events: &mut EventLog,
    ) {
        let rate = self.failure_rate(auto, store);
        let current = auto.at(step);
        let cost_s = self.st.meter.cost_s();
        let step_s = self.st.meter.step_s();
        let (steps, target_s, why) = match (cost_s, step_s) {
            (Some(c), Some(s)) => {
                let ch = choose_steps(c, rate.mtbf_s, s, auto.min_steps, auto.max_steps);
                (ch.steps, Some(ch.target_s), ch.why)
            }
            _ if !measured => (
                current
                    .saturating_mul(2)
                    .clamp(auto.min_steps, auto.max_steps),
                None,
                Why::NoBaseline,
            ),
            _ => return,
        };
        let decided = Decided {
            steps,
            why,
            cost_s,
            step_s,
            target_s,
        };
        // Once decided, a change of under a tenth within the bounds is noise, not news.
        let small = why == Why::YoungDaly && steps.abs_diff(current) * 10 < current;
        if self.st.evaluated && (steps == current || small) {
            return;
        }
        self.st.evaluated = true;
        auto.schedule.set(step + 1, steps);
        info!(
            step,
            from_steps = current,
            to_steps = steps,
            reason = why.as_str(),
            cost_s,
            step_s,
            mtbf_s = rate.mtbf_s,
            failures = rate.failures,
            "checkpoint interval changed"
        );
        events.log(Event::CheckpointInterval(
            decided.record(step, current, &rate, None),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(
        rank: u32,
        f: impl FnOnce(&mut ManagerConfig),
    ) -> (Interval, Store, CheckpointerConfig, EventLog) {
        let ck = CheckpointerConfig::new("r", rank, "dp=2,tp=1,pp=1".parse().unwrap());
        let mut c = ManagerConfig::new(ck.clone());
        f(&mut c);
        let store = Store::memory();
        let events = EventLog::new(store.clone(), "r", rank);
        (Interval::new(&c), store, ck, events)
    }

    #[test]
    fn every_n_steps() {
        let (mut i, store, ck, mut ev) = setup(0, |c| c.every_steps = Some(5));
        let due: Vec<u64> = (1..=20)
            .filter(|&s| i.due(s, None, &store, &ck, &mut ev))
            .collect();
        assert_eq!(due, vec![5, 10, 15, 20]);
        let (mut never, store, ck, mut ev) = setup(0, |_| {});
        assert!(!(1..=20).any(|s| never.due(s, None, &store, &ck, &mut ev)));
    }

    #[test]
    fn every_so_long() {
        // Long enough that a loaded machine does not pass it between the set-up and step 1.
        let (mut i, store, ck, mut ev) = setup(0, |c| c.every = Some(Duration::from_millis(500)));
        assert!(!i.due(1, None, &store, &ck, &mut ev));
        std::thread::sleep(Duration::from_millis(600));
        assert!(i.due(2, None, &store, &ck, &mut ev));
    }

    #[test]
    fn a_follower_counts_the_schedule_from_the_last_due_step() {
        let auto = AutoInterval::new(4, 100, Duration::from_secs(86_400));
        let (mut i, store, ck, mut ev) = setup(1, |c| c.auto_interval = Some(auto.clone()));
        assert!(!i.decides);
        let due: Vec<u64> = (1..=12)
            .filter(|&s| {
                let d = i.due(s, None, &store, &ck, &mut ev);
                if d {
                    i.note_due(s);
                }
                d
            })
            .collect();
        assert_eq!(due, vec![4, 8, 12]);
        // A restore counts from the step restored.
        i.restored(30);
        assert!(!i.due(33, Some(30), &store, &ck, &mut ev));
        assert!(i.due(34, Some(30), &store, &ck, &mut ev));
    }
}
