//! The persist governor's glue: [`Pacing`] times the loop's steps (from one `maybe_save`'s
//! return to the next call), tells the pure [`Governor`] which ran beside a persist and how
//! much of them it overlapped, puts its rate changes in force (`persist_rate` events), and sums
//! up each governed persist (a [`PersistMetrics`] record for the caller to log).

use std::time::{Duration, Instant};

use ckpt_recovery::records::{self, Event, PersistMetrics};
use tracing::info;

use super::events::EventLog;
use crate::governor::{Change, Governor, GovernorConfig};
use crate::save::{PersistRate, SaveHandle, SaveReport, Stage};

/// The persist governor with what it measures; a no-op without a governor.
pub(crate) struct Pacing {
    rank: u32,
    governed: Option<Governed>,
}

/// What the manager measures for the persist governor.
struct Governed {
    gov: Governor,
    /// When `maybe_save` last returned: the start of the step interval measured next.
    last_exit: Option<Instant>,
    /// The save whose persist is governed.
    tracked: Option<Tracked>,
    /// Figures of the persists that ended, not yet taken.
    done: Vec<PersistMetrics>,
}

struct Tracked {
    handle: SaveHandle,
    /// When its `save` returned (its snapshot started about then).
    at: Instant,
    /// The rate's released-bytes counter then.
    released0: u64,
    /// A limit applied at some time during it.
    limited: bool,
}

/// The seconds a save's persist ran: after the copy, or all of it when it overlapped the copy
/// ([`SnapshotOverlap`](crate::SnapshotOverlap)).
fn own_persist_s(r: &SaveReport) -> f64 {
    if r.overlapped {
        r.persist_s
    } else {
        (r.persist_s - r.snapshot_s).max(0.0)
    }
}

/// The seconds `[a0, a1]` and `[b0, b1]` share.
fn overlap_s(a0: Instant, a1: Instant, b0: Instant, b1: Instant) -> f64 {
    let start = a0.max(b0);
    let end = a1.min(b1);
    end.saturating_duration_since(start).as_secs_f64()
}

impl Pacing {
    /// Rank `rank`'s pacing under `cfg` (`None`: persists always run at full speed).
    pub(crate) fn new(cfg: Option<GovernorConfig>, rank: u32) -> Self {
        Pacing {
            rank,
            governed: cfg.map(|c| Governed {
                gov: Governor::new(c),
                last_exit: None,
                tracked: None,
                done: Vec::new(),
            }),
        }
    }

    /// `maybe_save` returns: the next step interval starts now.
    pub(crate) fn step_ended(&mut self) {
        if let Some(g) = self.governed.as_mut() {
            g.last_exit = Some(Instant::now());
        }
    }

    /// A restore ran: its time is not a step, and no persist is governed any more.
    pub(crate) fn restored(&mut self) {
        if let Some(g) = self.governed.as_mut() {
            g.last_exit = None;
            g.tracked = None;
        }
    }

    /// At the start of `maybe_save(step)`: measure the step interval that ended (from the last
    /// `maybe_save`'s return to now), feed it to the governor, apply and log a change of the
    /// rate, and sum up the governed persist once it ended. `draining`: a drain to the remote
    /// store runs (under a local tier): the persist counts as going on until it ends, so the
    /// governor paces the drain by the steps beside it as it paces a persist.
    pub(crate) fn step_began(
        &mut self,
        step: u64,
        rate: &PersistRate,
        draining: bool,
        events: &mut EventLog,
    ) {
        let now = Instant::now();
        let Some(g) = self.governed.as_mut() else {
            return;
        };
        let prev = g.last_exit.take();
        let Some(t) = g.tracked.as_mut() else {
            if let Some(prev) = prev {
                g.gov.clean_step(now.duration_since(prev).as_secs_f64());
            }
            return;
        };
        let stage = t.handle.stage();
        let r = t.handle.report();
        let done = stage.persist_ended() && !draining;
        let snap_end = match stage {
            Stage::Snapshotting => now,
            _ => t.at + Duration::from_secs_f64(r.snapshot_s),
        };
        let persist_end = if draining {
            now
        } else if done && r.persist_s > 0.0 {
            t.at + Duration::from_secs_f64(r.persist_s)
        } else {
            now
        };
        t.limited |= rate.limit().is_some();
        let mut change = None;
        if let Some(prev) = prev {
            let copy = overlap_s(prev, now, t.at, snap_end);
            let o = overlap_s(prev, now, snap_end, persist_end);
            let loop_s = now.duration_since(prev).as_secs_f64() - copy;
            let moved = rate.released().saturating_sub(t.released0) as f64;
            // A persist that overlapped the copy moved bytes from the save's start.
            let persist_from = if r.overlapped { t.at } else { snap_end };
            let el = now.saturating_duration_since(persist_from).as_secs_f64();
            let throughput = (moved > 0.0 && el > 0.0).then_some(moved / el);
            // A save that failed (or was skipped) before it persisted tells nothing.
            let failed =
                matches!(stage, Stage::Failed(_) | Stage::Skipped(_)) && r.persist_s == 0.0;
            if o > 0.0 && !failed {
                change = g.gov.busy_step(loop_s, o, throughput);
            }
        }
        if let Some(c) = change {
            self.apply(step, c, rate, events);
        }
        if done {
            self.persist_ended(step, rate, events);
        }
    }

    /// A save started (`h`): the persist governed from now on. The one before it ended (a
    /// save waits for its predecessor's persist) and is summed up.
    pub(crate) fn save_started(
        &mut self,
        h: &SaveHandle,
        rate: &PersistRate,
        events: &mut EventLog,
    ) {
        // Skipped (back-pressure): the persist in flight goes on being governed.
        if h.is_skipped() {
            return;
        }
        if self.governed.as_ref().is_some_and(|g| g.tracked.is_some()) {
            self.persist_ended(h.step(), rate, events);
        }
        let Some(g) = self.governed.as_mut() else {
            return;
        };
        g.tracked = Some(Tracked {
            handle: h.clone(),
            at: Instant::now(),
            released0: rate.released(),
            limited: rate.limit().is_some(),
        });
    }

    /// The governed persist ended (at `step`'s `maybe_save`): its figures, a last decision.
    pub(crate) fn persist_ended(&mut self, step: u64, rate: &PersistRate, events: &mut EventLog) {
        let rank = self.rank;
        let Some(g) = self.governed.as_mut() else {
            return;
        };
        let Some(t) = g.tracked.take() else { return };
        let r = t.handle.report();
        let persisted = matches!(t.handle.stage(), Stage::Persisted | Stage::Committed)
            || (r.persist_s > 0.0 && !t.handle.is_skipped());
        if !persisted {
            // Failed or skipped: nothing to sum up; start the next one afresh.
            let _ = g.gov.persist_done(0, 0.0, true);
            return;
        }
        let bytes = r.bytes.saturating_sub(r.bytes_reused);
        let (summary, change) = g.gov.persist_done(bytes, own_persist_s(&r), t.limited);
        let figures = PersistMetrics {
            step: t.handle.step(),
            rank,
            bytes,
            slowdown: summary.slowdown,
            overlap_s: summary.overlap_s,
            durable_s: r.persist_s,
            rate_bps: summary.rate,
            budget: g.gov.config().budget,
            baseline_s: g.gov.baseline(),
        };
        info!(
            step = figures.step,
            slowdown = figures.slowdown,
            durable_s = figures.durable_s,
            rate_bps = figures.rate_bps,
            "persist governed"
        );
        g.done.push(figures);
        if let Some(c) = change {
            self.apply(step, c, rate, events);
        }
        // The rate changes of this persist, written once it ended (one write, not one per
        // change).
        events.flush_unless_held();
    }

    /// Put the governor's change in force and record it (a `persist_rate` event, written with
    /// the persist's end).
    fn apply(&mut self, step: u64, c: Change, rate: &PersistRate, events: &mut EventLog) {
        rate.set(c.to);
        let budget = self
            .governed
            .as_ref()
            .map_or(0.0, |g| g.gov.config().budget);
        info!(
            step,
            from_bps = c.from,
            to_bps = c.to,
            reason = c.reason.as_str(),
            slowdown = c.slowdown,
            budget,
            "persist rate changed"
        );
        events.append(Event::PersistRate(records::PersistRate {
            step,
            rank: self.rank,
            from_bps: c.from,
            to_bps: c.to,
            reason: c.reason.as_str().to_string(),
            slowdown: c.slowdown,
            budget,
            baseline_s: c.baseline_s,
            at_floor: c.at_floor,
        }));
    }

    /// The figures of the persists that ended since the last call (oldest first).
    pub(crate) fn take_figures(&mut self) -> Vec<PersistMetrics> {
        self.governed
            .as_mut()
            .map(|g| std::mem::take(&mut g.done))
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_store::Store;

    #[test]
    fn overlap_is_the_shared_part_of_two_spans() {
        let t = Instant::now();
        let s = |x: u64| t + Duration::from_millis(x);
        assert_eq!(overlap_s(s(0), s(100), s(50), s(300)), 0.05);
        assert_eq!(overlap_s(s(0), s(100), s(0), s(100)), 0.1);
        assert_eq!(overlap_s(s(0), s(100), s(200), s(300)), 0.0);
        assert_eq!(overlap_s(s(200), s(300), s(0), s(100)), 0.0);
    }

    #[test]
    fn a_persist_that_overlapped_its_copy_ran_for_all_of_its_time() {
        let after = SaveReport {
            snapshot_s: 0.25,
            persist_s: 1.0,
            ..Default::default()
        };
        assert_eq!(own_persist_s(&after), 0.75);
        let with = SaveReport {
            overlapped: true,
            ..after
        };
        assert_eq!(own_persist_s(&with), 1.0);
    }

    #[test]
    fn clean_steps_change_no_rate_and_leave_no_figures() {
        let store = Store::memory();
        let mut events = EventLog::new(store, "r", 0);
        let rate = PersistRate::new();
        for cfg in [None, Some(GovernorConfig::default())] {
            let mut p = Pacing::new(cfg, 0);
            for step in 1..20 {
                p.step_began(step, &rate, false, &mut events);
                p.step_ended();
            }
            p.restored();
            p.persist_ended(20, &rate, &mut events);
            assert!(p.take_figures().is_empty());
            assert_eq!(rate.get(), None);
        }
    }
}
