//! Retention: [`Retention`] deletes old steps by the `keep_last` / `keep_every` rules in the
//! background, on the committer, once the newest save committed, never the newest committed
//! step nor the step the next save dedups against.

use std::sync::Arc;
use std::time::Duration;

use ckpt_store::GcOptions;
use parking_lot::Mutex;
use tracing::{info, warn};

use super::ManagerConfig;
use crate::save::{Checkpointer, Stage, runtime};

/// The retention rules and the sweep in flight.
pub(crate) struct Retention {
    keep_last: Option<usize>,
    keep_every: Option<u64>,
    grace: Duration,
    /// The sweeps in flight (or done, not yet waited for).
    task: Option<tokio::task::JoinHandle<()>>,
    /// What the task and [`Retention::apply`] share: whether the task sweeps, and the sweep
    /// asked for meanwhile.
    queue: Arc<Mutex<Queue>>,
    /// The newest committed step a sweep was started or queued for.
    retained_step: Option<u64>,
}

/// A sweep asked for while one runs waits here for it; the task runs the newest one asked
/// for before it ends, so none is lost.
#[derive(Default)]
struct Queue {
    running: bool,
    next: Option<GcOptions>,
}

impl Retention {
    /// The rules of `cfg`.
    pub(crate) fn new(cfg: &ManagerConfig) -> Self {
        Retention {
            keep_last: cfg.keep_last,
            keep_every: cfg.keep_every,
            grace: cfg.retention_grace,
            task: None,
            queue: Arc::default(),
            retained_step: None,
        }
    }

    /// Whether any rule is set.
    fn enabled(&self) -> bool {
        self.keep_last.is_some() || self.keep_every.is_some()
    }

    /// Sweep if this rank commits, a rule is set and the newest save committed since the
    /// last sweep: at once, or, while a sweep runs, right after it (the newest asked for
    /// replaces one still waiting: it protects the newer steps and deletes the same or
    /// more). A sweep that waited is safe though the run moved on: the newest committed step
    /// is always kept, and it is what a save started since builds on.
    pub(crate) fn apply(&mut self, ckpt: &Checkpointer) {
        if !ckpt.config().committer || !self.enabled() {
            return;
        }
        let Some(last) = ckpt.last() else { return };
        if last.stage() != Stage::Committed || self.retained_step == Some(last.step()) {
            return;
        }
        self.retained_step = Some(last.step());
        let opts = self.options(&ckpt.config().run, last.step(), ckpt.dedup_base());
        {
            let mut q = self.queue.lock();
            // A task that ended without clearing `running` (it panicked) takes nothing more.
            let died = self.task.as_ref().is_some_and(|h| h.is_finished());
            if q.running && !died {
                q.next = Some(opts);
                return;
            }
            q.running = true;
            q.next = None;
        }
        let store = ckpt.store().clone();
        let queue = self.queue.clone();
        self.task = Some(runtime().spawn(async move {
            let mut opts = opts;
            loop {
                match store.gc().run(&opts, store.now()).await {
                    Ok(r) if !r.steps_deleted.is_empty() => info!(
                        deleted = ?r.steps_deleted,
                        freed = r.bytes_freed,
                        "retention deleted old checkpoints"
                    ),
                    Ok(_) => {}
                    Err(e) => warn!("retention failed: {e}"),
                }
                let mut q = queue.lock();
                match q.next.take() {
                    Some(next) => opts = next,
                    None => {
                        q.running = false;
                        return;
                    }
                }
            }
        }));
    }

    /// The sweep of `run` after `last` committed, protecting it and the dedup base.
    fn options(&self, run: &str, last: u64, dedup_base: Option<u64>) -> GcOptions {
        let mut protect = vec![(run.to_string(), last)];
        if let Some(b) = dedup_base {
            protect.push((run.to_string(), b));
        }
        GcOptions {
            keep_last: self.keep_last,
            keep_every: self.keep_every,
            grace: self.grace,
            lease_lapse: ckpt_store::lease::LOCK_LAPSE,
            dry_run: false,
            runs: vec![run.to_string()],
            protect,
            sweep: true,
        }
    }

    /// Wait for the sweep in flight, if any.
    pub(crate) fn wait(&mut self) {
        if let Some(r) = self.task.take() {
            let _ = runtime().block_on(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::save::CheckpointerConfig;

    fn cfg(keep_last: Option<usize>, keep_every: Option<u64>) -> ManagerConfig {
        let mut c = ManagerConfig::new(CheckpointerConfig::new(
            "r",
            0,
            "dp=1,tp=1,pp=1".parse().unwrap(),
        ));
        c.keep_last = keep_last;
        c.keep_every = keep_every;
        c
    }

    #[test]
    fn a_sweep_protects_the_newest_step_and_the_dedup_base() {
        let r = Retention::new(&cfg(Some(2), Some(100)));
        assert!(r.enabled());
        let o = r.options("run", 40, Some(30));
        assert_eq!(o.keep_last, Some(2));
        assert_eq!(o.keep_every, Some(100));
        assert_eq!(o.grace, Duration::from_secs(3600));
        assert_eq!(o.runs, vec!["run".to_string()]);
        assert_eq!(
            o.protect,
            vec![("run".to_string(), 40), ("run".to_string(), 30)]
        );
        assert!(o.sweep && !o.dry_run);
        assert_eq!(r.options("run", 40, None).protect.len(), 1);
    }

    #[test]
    fn without_rules_nothing_is_swept() {
        let r = Retention::new(&cfg(None, None));
        assert!(!r.enabled());
        assert!(Retention::new(&cfg(None, Some(5))).enabled());
    }
}
