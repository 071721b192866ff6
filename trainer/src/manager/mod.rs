//! [`CheckpointManager`]: what a training loop talks to.
//!
//! ```text
//! let mut mgr = CheckpointManager::new(store, cfg)?;
//! mgr.register(spec, held_box, memory)?;            // every tensor this rank holds
//! mgr.register_stateful("data", Scope::Global, loader)?;
//! let start = mgr.restore_latest()?.map_or(0, |s| s + 1);
//! for step in start..steps {
//!     forward_backward();
//!     mgr.maybe_save(step)?;                        // interval policy; SIGTERM -> final save
//!     optimizer_step();                             // waits only for tensors not yet copied
//!     if mgr.should_stop() { break }
//! }
//! mgr.finish()?;
//! ```
//!
//! With a monitor ([`ManagerConfig::monitor`], see [`crate::monitor`]), the loop reports each
//! step's loss and acts on the decision:
//!
//! ```text
//! match mgr.observe(&Observation::new(step, loss).batch(batch).grad_norm(g)) {
//!     Decision::Continue | Decision::Alert(_) => {}
//!     Decision::Rollback(spike) => {
//!         // Restores the newest committed step before the spike (tensors, Stateful items
//!         // and the monitor's window); the closure moves the data position past the spike.
//!         let rb = mgr.rollback(&spike, |_| loader.skip_through(spike.batch))?;
//!         next_step = rb.to_step + 1; // nothing of the spike's step is saved
//!         continue;
//!     }
//!     Decision::Stop(stop) => return Err(stop.to_string()),
//! }
//! ```
//!
//! The manager is a handle over its parts, each in its own module:
//!
//! | module | owns |
//! |---|---|
//! | `config` | [`ManagerConfig`] and its checks |
//! | `registry` | the registered tensors and [`Stateful`] items; what a save writes, what a restore fills |
//! | `interval` | when a checkpoint is due: every N steps / so long, or the automatic interval's glue |
//! | `health` | a failing store: failed saves reported, checkpoints skipped while it is down ([`StoreHealth`]) |
//! | `pacing` | the persist governor's glue: step times in, rate changes and persist figures out |
//! | `retention` | deleting old steps in the background after a commit |
//! | `restore` | the step to resume from and reading a step into the registry ([`shared_restore_cache`]) |
//! | `rollback` | the spike monitor, its records, and what a rollback restores ([`Rollback`]) |
//! | `events` | the event kinds the manager writes and the writer of the run's events log |
//! | `sentinel` | replicas that disagree at a commit, trainable state that stopped changing ([`ManagerConfig::on_replica_mismatch`], [`ManagerConfig::stale_after`]) |
//! | `agree` | the step a job of several machines resumes from without a driver, agreed through the job's all-gather ([`AllGather`]) |
//! | `tier` | a local tier under the remote store: saves commit locally, the drain copies them to the remote store ([`LocalTier`]) |
//! | `sigterm` | the SIGTERM handler ([`on_sigterm`]) and the stop flag |

mod agree;
mod config;
pub mod events;
mod health;
mod interval;
mod pacing;
mod registry;
mod restore;
mod retention;
mod rollback;
mod sentinel;
mod sigterm;
mod tier;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_recovery::records::{self, Event};
use ckpt_store::{Error, ErrorKind, NdBox, Result, Store, TensorSpec};
use parking_lot::Mutex;
use tracing::{debug, info, instrument};

use crate::monitor::{Decision, Monitor, Observation, Spike};
use crate::save::{Checkpointer, SaveHandle, SaveState, Stage, runtime};

pub use agree::AllGather;
pub use config::ManagerConfig;
pub use health::StoreHealth;
pub use registry::{MONITOR_BLOB, Scope, Stateful, TensorMemory};
pub use restore::shared_restore_cache;
pub use rollback::Rollback;
pub use sigterm::on_sigterm;
pub use tier::LocalTier;

use events::EventLog;
use health::{Health, no_space, store_failure};
use interval::Interval;
use pacing::Pacing;
use registry::Registry;
use restore::Restorer;
use retention::Retention;
use rollback::Spikes;
use sentinel::Sentinel;
use sigterm::StopFlag;
use tier::{Drainer, DrainerConfig};

/// The training loop's checkpoint manager (see the module docs).
pub struct CheckpointManager {
    ckpt: Checkpointer,
    /// The run's store: the remote one under a local tier (logs, agreements, what recovery
    /// reads), else the one saves go to.
    main: Store,
    /// With a local tier, on the committing rank: the drain to the remote store.
    drainer: Option<Drainer>,
    /// The figures of the drains that ended, not yet taken.
    drains: Vec<records::DrainMetrics>,
    cfg: ManagerConfig,
    registry: Registry,
    /// The step saved or restored last.
    last_saved_step: Option<u64>,
    /// The automatic staging pool was sized for the registered state ahead of the first save
    /// (or a save sized it).
    staged: bool,
    stop: StopFlag,
    interval: Interval,
    health: Health,
    pacing: Pacing,
    retention: Retention,
    restorer: Restorer,
    spikes: Spikes,
    sentinel: Sentinel,
    events: EventLog,
}

impl std::fmt::Debug for CheckpointManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CheckpointManager({:?})", self.ckpt)
    }
}

impl CheckpointManager {
    /// A manager for one rank of a run in `store`. With [`ManagerConfig::local_tier`], saves
    /// persist and commit there and `store` is the remote store they drain to (see `tier`).
    pub fn new(store: Store, cfg: ManagerConfig) -> Result<Self> {
        cfg.validate()?;
        let save_store = match &cfg.local_tier {
            Some(t) => t.store.clone(),
            None => store.clone(),
        };
        let ckpt = Checkpointer::new(save_store, cfg.ckpt.clone())?;
        let drainer = match &cfg.local_tier {
            Some(tier) if cfg.ckpt.committer => Some(Drainer::start(DrainerConfig {
                tier,
                remote: &store,
                run: &cfg.ckpt.run,
                rank: cfg.ckpt.rank,
                generation: cfg.ckpt.generation,
                keep_last: cfg.keep_last,
                keep_every: cfg.keep_every,
                grace: cfg.retention_grace,
                rate: ckpt.persist_rate().clone(),
                node: cfg.ckpt.node_ranks.is_some(),
            })?),
            _ => None,
        };
        Ok(CheckpointManager {
            ckpt,
            main: store.clone(),
            drainer,
            drains: Vec::new(),
            registry: Registry::default(),
            last_saved_step: None,
            staged: false,
            stop: StopFlag::new(cfg.final_on_sigterm)?,
            interval: Interval::new(&cfg),
            health: Health::default(),
            pacing: Pacing::new(cfg.persist_governor.clone(), cfg.ckpt.rank),
            retention: Retention::new(&cfg),
            restorer: Restorer::new(&cfg),
            spikes: Spikes::new(cfg.monitor.clone()),
            sentinel: Sentinel::new(
                cfg.on_replica_mismatch,
                cfg.stale_after,
                cfg.ckpt.rank,
                cfg.ckpt.generation,
                cfg.ckpt.committer,
            ),
            events: EventLog::new(store, &cfg.ckpt.run, cfg.ckpt.rank),
            cfg,
        })
    }

    /// The checkpointer underneath.
    pub fn checkpointer(&self) -> &Checkpointer {
        &self.ckpt
    }

    /// The run's store: under a local tier the remote one (where steps become durable and
    /// the logs live), else the one saves go to.
    pub fn store(&self) -> &Store {
        &self.main
    }

    /// The local tier saves commit to first, if any.
    pub fn local_tier(&self) -> Option<&Store> {
        self.cfg.local_tier.as_ref().map(|t| &t.store)
    }

    /// The figures of the drains to the remote store that ended since the last call (the
    /// `drain` records of the metrics log), oldest first.
    pub fn take_drain_figures(&mut self) -> Vec<records::DrainMetrics> {
        self.poll_drain();
        std::mem::take(&mut self.drains)
    }

    /// The drainer's news: events logged, figures kept for the caller.
    fn poll_drain(&mut self) {
        if let Some(d) = self.drainer.as_mut() {
            let p = d.poll();
            for e in p.events {
                self.events.log(e);
            }
            self.drains.extend(p.metrics);
            // One machine of several: the sentinel's comparison came with the remote commit.
            for (step, r) in p.replicas {
                self.sentinel.compared(step, &r, &mut self.events);
            }
        }
    }

    /// Register a tensor: its spec (with its placement), the box this rank holds in memory,
    /// and that memory. A save writes the boxes placement assigns to this rank under the
    /// current layout (cut out of the held box); a restore fills the whole held box.
    pub fn register(
        &mut self,
        spec: TensorSpec,
        held: NdBox,
        memory: Arc<dyn TensorMemory>,
    ) -> Result<()> {
        self.registry.register(spec, held, memory)
    }

    /// Register a tensor whose shards were placed by the caller, outside the placement rules
    /// (PyTorch's DTensor: the framework decided who holds which box): a save writes exactly
    /// the held box, by this rank, or by rank `replica_of` when this rank holds a replica of
    /// that rank's box (every holder must name the same writer). A restore fills the held box
    /// from whatever boxes the step was saved in, as for [`CheckpointManager::register`].
    pub fn register_held(
        &mut self,
        spec: TensorSpec,
        held: NdBox,
        memory: Arc<dyn TensorMemory>,
        replica_of: Option<u32>,
    ) -> Result<()> {
        self.registry
            .register_held(&self.cfg.ckpt, spec, held, memory, replica_of)
    }

    /// Mark a registered tensor as one training changes (weights, their optimizer state), or
    /// not (the default): the sentinel reports a trainable tensor whose bytes stay the same
    /// over [`ManagerConfig::stale_after`] checkpoints (`state_unchanged`).
    pub fn set_trainable(&mut self, name: &str, trainable: bool) -> Result<()> {
        self.registry.set_trainable(name, trainable)
    }

    /// Forget every registered tensor: a loop whose tensors were replaced (new memory, other
    /// boxes) registers them again before its next save or restore.
    pub fn clear_tensors(&mut self) {
        self.registry.clear_tensors();
    }

    /// The number of registered tensors.
    pub fn registered(&self) -> usize {
        self.registry.tensor_count()
    }

    /// Register non-tensor state.
    pub fn register_stateful(
        &mut self,
        name: &str,
        scope: Scope,
        item: Arc<Mutex<dyn Stateful>>,
    ) -> Result<()> {
        self.registry.register_stateful(name, scope, item)
    }

    /// Whether a SIGTERM asked the job to stop (after its final checkpoint).
    pub fn should_stop(&self) -> bool {
        self.stop.stopped()
    }

    /// Ask for a stop as if SIGTERM had arrived.
    pub fn request_stop(&self) {
        self.stop.request();
    }

    /// For ranks that agree on stopping among themselves (each reads
    /// [`CheckpointManager::sigterm_received`], then they reduce it): the agreed decision, which
    /// the next `maybe_save` follows instead of this rank's own flag, so a SIGTERM arriving
    /// between the agreement and the save cannot make one rank stop alone. `None` goes back to
    /// the flag. Taken by the next `maybe_save`.
    pub fn set_agreed_stop(&mut self, stop: Option<bool>) {
        self.stop.agree(stop);
    }

    /// Whether SIGTERM has arrived.
    pub fn sigterm_received(&self) -> bool {
        self.stop.received()
    }

    /// Save if the interval policy says so, or a final checkpoint if SIGTERM arrived (then
    /// wait for it, at full speed, and make [`CheckpointManager::should_stop`] true). Called
    /// once a step, it also times the steps for the persist governor.
    pub fn maybe_save(&mut self, step: u64) -> Result<Option<SaveHandle>> {
        self.maybe_save_with(step, |_| Ok(()))
    }

    /// [`CheckpointManager::maybe_save`] that calls `prepare` right before a checkpoint is
    /// taken, and only then: a loop whose state is not registered once for the whole run (a
    /// PyTorch state dict, handed over every step) registers it there
    /// ([`CheckpointManager::clear_tensors`], [`CheckpointManager::register_held`]) and sets
    /// its [`Stateful`] items, so a step without a checkpoint costs nothing of that. An error
    /// of `prepare` is the call's.
    pub fn maybe_save_with(
        &mut self,
        step: u64,
        prepare: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<Option<SaveHandle>> {
        self.poll_drain();
        let draining = self.drainer.as_ref().is_some_and(Drainer::busy);
        self.pacing
            .step_began(step, self.ckpt.persist_rate(), draining, &mut self.events);
        // What the sentinel found in the saves that ended (a mismatch under `stop` fails).
        self.sentinel.poll(&mut self.events)?;
        self.stage_ahead();
        let r = self.decide_and_save(step, prepare);
        self.pacing.step_ended();
        r
    }

    /// Once, at the first step with tensors registered and no save yet: size the automatic
    /// staging pool for them and fill it on a background thread at the lowest CPU priority
    /// (with [`CheckpointerConfig::prefault`](crate::CheckpointerConfig::prefault), now;
    /// [`Checkpointer::prepare_staging`]), so that the first checkpoint copies into memory
    /// already touched, as later ones do, rather than faulting fresh pages in while the
    /// training loop waits. A pool with a bound of its own fills from its creation, a shared
    /// one is its owner's; a loop that registers its state only in `prepare` hands it over
    /// through [`CheckpointManager::stage_ahead_with`].
    fn stage_ahead(&mut self) {
        if self.registry.tensor_count() > 0 && self.stages_ahead() {
            self.fill_ahead();
        }
    }

    /// Size the staging pool for the registered state and start its fill; once a manager.
    fn fill_ahead(&mut self) {
        self.staged = true;
        let now = self.cfg.ckpt.prefault;
        match self.save_state() {
            Ok(state) => self.ckpt.prepare_staging(&state, now),
            Err(e) => debug!(error = %e, "staging not sized ahead of the first save"),
        }
    }

    /// Whether the staging pool is still to be sized and filled ahead of the first save: not
    /// done yet, no save taken, a pool of the manager's own with the automatic bound, a fill
    /// asked for, and a manager that can save at all (an interval, or a final checkpoint on
    /// SIGTERM: a job that only restores keeps no copy of the state).
    fn stages_ahead(&self) -> bool {
        let ck = &self.cfg.ckpt;
        let may_save = self.interval.any() || self.cfg.final_on_sigterm;
        !self.staged
            && may_save
            && self.ckpt.last().is_none()
            && ck.staging_bytes == 0
            && ck.pool.is_none()
            && (ck.prefault || ck.background_prefault)
    }

    /// For a loop that registers its state only in `maybe_save_with`'s `prepare` (a PyTorch
    /// state dict handed over at each checkpoint): after a step that took no checkpoint, call
    /// `prepare` once more to register the state, then size and fill the staging pool for it
    /// as a manager with its state registered does at its first step. Only while
    /// the pool is still to be filled ahead of the first save, so `prepare` runs at most once
    /// a manager this way, failed or not; returns whether it ran. The caller clears the
    /// tensors afterwards as after a save. An error of `prepare` is the call's.
    pub fn stage_ahead_with(
        &mut self,
        prepare: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<bool> {
        if !self.stages_ahead() {
            return Ok(false);
        }
        // Once asked, never again: a `prepare` that fails is not called at every step.
        self.staged = true;
        if self.registry.tensor_count() == 0 {
            prepare(self)?;
        }
        if self.registry.tensor_count() > 0 {
            self.fill_ahead();
        }
        Ok(true)
    }

    /// `maybe_save`'s decisions in order: the final checkpoint after SIGTERM; whether one is
    /// due; whether the store is down; then the save.
    fn decide_and_save(
        &mut self,
        step: u64,
        prepare: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<Option<SaveHandle>> {
        let term = self.stop.take_due();
        if self.cfg.final_on_sigterm && term {
            return self.final_checkpoint(step, prepare).map(Some);
        }
        let due = self.interval.due(
            step,
            self.last_saved_step,
            &self.main,
            &self.cfg.ckpt,
            &mut self.events,
        );
        if !due || self.last_saved_step == Some(step) {
            return Ok(None);
        }
        self.interval.note_due(step);
        let run = &self.cfg.ckpt.run;
        let skip = self
            .health
            .skip_reason(step, self.ckpt.store(), run, &mut self.events);
        self.make_room();
        if let Some(why) = skip {
            self.health.skip(step, &why, &mut self.events);
            return Ok(None);
        }
        prepare(self)?;
        self.save_watched(step)
    }

    /// The final checkpoint after SIGTERM, waited for at full speed; the loop stops after it.
    fn final_checkpoint(
        &mut self,
        step: u64,
        prepare: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<SaveHandle> {
        info!(step, "SIGTERM: taking a final checkpoint");
        // The final checkpoint, and the persist it may wait for, run at full speed.
        let _fast = self.ckpt.persist_rate().full_speed();
        prepare(self)?;
        let h = self.save_now(step)?;
        self.stop.set_stopped();
        h.wait_committed(self.final_wait())?;
        Ok(h)
    }

    /// A due checkpoint: saved and watched for a failure in the store; one that fails in the
    /// store at once is skipped (the store is taken as down), not the loop's error.
    fn save_watched(&mut self, step: u64) -> Result<Option<SaveHandle>> {
        match self.save_now(step) {
            Ok(h) => {
                // The save may have waited for the one before it to fail.
                self.health.report_failed(step, &mut self.events);
                self.health.watch(h.clone());
                Ok(Some(h))
            }
            Err(e) if store_failure(e.kind()) => {
                self.health.mark_down(step, &mut self.events);
                self.health.skip(step, &e.to_string(), &mut self.events);
                Ok(None)
            }
            Err(e) if no_space(e.kind()) => {
                self.health
                    .failed_full(step, &e.to_string(), &mut self.events);
                self.make_room();
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// After a save failed on a full file system: under a local tier, the tier keeps only its
    /// newest step and what still drains (the store holds the rest), so the next save fits.
    fn make_room(&mut self) {
        if self.health.take_full()
            && let Some(d) = self.drainer.as_ref()
        {
            d.make_room();
        }
    }

    /// The figures of the persists the governor saw end since the last call (oldest first),
    /// as the `persist` records of the metrics log.
    pub fn take_persist_figures(&mut self) -> Vec<records::PersistMetrics> {
        self.pacing.take_figures()
    }

    /// The persist governor's current rate, raw bytes/s (`None`: no limit, or no governor).
    pub fn persist_rate(&self) -> Option<u64> {
        self.ckpt.persist_rate().get()
    }

    /// How checkpointing fared against a failing store.
    pub fn store_health(&self) -> StoreHealth {
        self.health.snapshot()
    }

    /// The boxes this rank saves under the current layout.
    pub fn save_state(&self) -> Result<SaveState> {
        self.registry
            .save_state(&self.cfg.ckpt, &self.spikes.monitor)
    }

    /// Save `step` now. After a save of this writer was fenced (a newer generation of the run
    /// took over), every later save fails with that error at once: a fenced writer stops.
    pub fn save_now(&mut self, step: u64) -> Result<SaveHandle> {
        if let Some(Stage::Failed(f)) = self.ckpt.last().map(|h| h.stage())
            && f.kind == ErrorKind::Fenced
        {
            return Err(Error::new(
                ErrorKind::Fenced,
                format!("not saving step {step}: {}", f.message),
            ));
        }
        // Under a local tier the drainer applies retention on both tiers after each drain.
        if self.cfg.local_tier.is_none() {
            self.retention.apply(&self.ckpt);
        }
        let t0 = Instant::now();
        let state = self.save_state()?;
        let h = self.ckpt.save(step, state)?;
        self.sentinel.watch(&h, self.registry.trainable_names());
        if let Some(d) = self.drainer.as_mut() {
            d.watch(&h);
        }
        self.pacing
            .save_started(&h, self.ckpt.persist_rate(), &mut self.events);
        self.last_saved_step = Some(step);
        self.interval
            .saved(step, &h, t0, &self.main, &self.cfg.ckpt, &mut self.events);
        Ok(h)
    }

    /// The step a resume restores: [`ManagerConfig::resume_step`] when set (it must be
    /// committed), else the newest committed step, if any. It asks nothing of the other
    /// ranks: one machine of several (`node_ranks`) finds the store's newest step here, and
    /// [`CheckpointManager::restore_latest`] agrees on a newer one through
    /// [`ManagerConfig::all_gather`].
    pub fn resume_target(&self) -> Result<Option<u64>> {
        self.restorer
            .resume_target(&self.tiers(), &self.cfg.ckpt.run)
    }

    /// Restore the step to resume from ([`CheckpointManager::resume_target`]: the configured
    /// resume step, else the newest committed one), if any; returns its number.
    /// This rank's generation is joined first (see [`Checkpointer::join_generation`]), so a
    /// job resumed while an older one still runs fences the older one before it chooses.
    ///
    /// One machine of several (`node_ranks`) with [`ManagerConfig::all_gather`] and no resume
    /// step agrees with every other rank on the newest step committed on the store or on every
    /// machine's tier (draining first one the tiers only hold): every rank of the job calls
    /// it. Without the all-gather it resumes from the store's newest step (a warning names a
    /// newer one this machine's tier holds).
    pub fn restore_latest(&mut self) -> Result<Option<u64>> {
        let joined = self.ckpt.join_generation();
        // One machine of several: the tier holds node commits that only an agreement takes.
        let node_tier = self
            .local_tier()
            .filter(|_| self.cfg.ckpt.node_ranks.is_some());
        let target = match (node_tier, &self.cfg.all_gather) {
            (Some(local), Some(all)) if self.cfg.resume_step.is_none() => {
                // A rank fenced here still takes part in the gathers, so that every rank
                // fails alike rather than the others waiting for it.
                agree::agreed_step(all, &self.main, local, &self.cfg.ckpt, joined)?
            }
            _ => {
                joined?;
                let target = self.resume_target()?;
                if let (Some(local), None) = (node_tier, &self.cfg.all_gather) {
                    agree::warn_unagreed(local, &self.cfg.ckpt.run, target);
                }
                target
            }
        };
        match target {
            None => Ok(None),
            Some(step) => self.restore(step).map(|_| Some(step)),
        }
    }

    /// Restore `step` onto the held boxes of every registered tensor and the stateful items,
    /// whatever layout saved it. A failure because of the data (an object missing or
    /// damaged: `NotFound`, `Corrupt`) is also logged as a `restore_failed` event.
    pub fn restore(&mut self, step: u64) -> Result<()> {
        // A restore starts (or joins) this rank's generation before anything of it is saved.
        self.ckpt.join_generation()?;
        let r = self.restore_inner(step);
        if let Err(e) = &r
            && matches!(e.kind(), ErrorKind::NotFound | ErrorKind::Corrupt)
        {
            let cfg = &self.cfg.ckpt;
            let rec = Event::RestoreFailed(records::RestoreFailed {
                step,
                rank: cfg.rank,
                generation: cfg.generation,
                error_kind: e.kind().as_str().to_string(),
                error: e.to_string(),
            });
            self.events.log(rec);
        }
        r
    }

    /// Read `step`, then re-base the parts on it: the dedup base, the interval's count, the
    /// governor's step timing.
    fn restore_inner(&mut self, step: u64) -> Result<()> {
        let (main, local) = (self.main.clone(), self.local_tier().cloned());
        let tiers = restore::Tiers {
            main: &main,
            local: local.as_ref(),
        };
        let mut r = self.restorer.restore(
            &tiers,
            &self.cfg.ckpt,
            step,
            &self.registry,
            &mut self.spikes.monitor,
        )?;
        if let Some(m) = &r.manifest {
            self.ckpt.seed_dedup(m);
        }
        self.last_saved_step = Some(step);
        self.sentinel.restored();
        self.interval.restored(step);
        self.pacing.restored();
        r.finish();
        if let Some(d) = r.local_damaged.take() {
            self.events.log(Event::LocalTierDamaged(d));
        }
        self.events.log(Event::Restore(r.record.clone()));
        r.trace();
        Ok(())
    }

    /// The spike monitor.
    pub fn monitor(&self) -> &Monitor {
        &self.spikes.monitor
    }

    /// Report a step's loss (and batch, gradient norm) to the monitor and get what to do. A
    /// spike is logged (a tracing warning and a `spike` record in the run's events log), and a
    /// stop also gets a `stop` record with the rollback history. Call it before saving the
    /// step: a spike's state must not be checkpointed. Does nothing with the action `off`.
    pub fn observe(&mut self, o: &Observation) -> Decision {
        self.spikes.observe(o, &self.cfg.ckpt.run, &mut self.events)
    }

    /// Roll back after `spike`: wait for the save in flight, restore the newest committed step
    /// before the spike (tensors, [`Stateful`] items, the monitor's window; the rollback
    /// history is kept), then call `skip_data(restored_step)`, which moves the loop's data
    /// position past the spike's batch and returns the batches it skipped. Logs a `rollback`
    /// record when this manager decided the rollback. Every rank of the job calls it for the
    /// same spike. Without a committed step before the spike, logs a `stop` and fails.
    #[instrument(skip_all, fields(run = %self.cfg.ckpt.run, from_step = spike.step))]
    pub fn rollback(
        &mut self,
        spike: &Spike,
        skip_data: impl FnOnce(u64) -> Option<(u64, u64)>,
    ) -> Result<Rollback> {
        let run = self.cfg.ckpt.run.clone();
        if let Some(h) = self.ckpt.last() {
            rollback::settle(&h, self.ckpt.store(), &run, self.cfg.ckpt.commit_timeout);
        }
        let steps = match self.local_tier() {
            Some(local) => tier::committed_in_either(local, &self.main, &run)?,
            None => runtime().block_on(self.main.log().committed_steps(&run))?,
        };
        let target = rollback::rollback_target(steps.iter().map(|&s| (s, true)), spike.step);
        let logs = self.spikes.decided(spike);
        let Some(to) = target else {
            return Err(self.spikes.no_checkpoint(spike, &run, &mut self.events));
        };
        let history = self.spikes.monitor.history().to_vec();
        self.restore(to)?;
        self.spikes.keep_history(history);
        let skipped = skip_data(to);
        Ok(self
            .spikes
            .rolled_back(spike, to, skipped, logs, &mut self.events))
    }

    /// How long a save may still take: the commit timeout, or the final deadline once SIGTERM
    /// has arrived.
    fn final_wait(&self) -> Duration {
        if self.sigterm_received() {
            self.cfg.final_deadline.min(self.cfg.ckpt.commit_timeout)
        } else {
            self.cfg.ckpt.commit_timeout
        }
    }

    /// Wait for the save in flight to commit (or fail), at full speed, and for retention;
    /// within the commit timeout (the final deadline after SIGTERM). The governed persist's
    /// figures are then ready ([`CheckpointManager::take_persist_figures`]). The staging
    /// memory no save holds is then freed (the manager's own pool; a shared one is its
    /// owner's): a save after `finish` allocates it again.
    pub fn finish(&mut self) -> Result<()> {
        // What ended before the last wait (a mismatch of a step committed earlier) is logged
        // even if the last save then fails or the process is killed while it waits.
        let early = self.sentinel.poll(&mut self.events);
        let saved = self.wait_last_save();
        if saved.is_err() {
            // The events of what did end, written before the error goes up.
            self.abandon();
        }
        saved?;
        self.retention.wait();
        // Under a local tier the job ends remote-durable: its newest step drained (and, for
        // one machine of several, committed on the store by the last machine's drain; not when
        // the job is being stopped: its agent drains what the stopped generation left).
        let within = self.final_wait();
        let wait_commit = !self.sigterm_received();
        let drained = match self.drainer.as_mut() {
            Some(d) => d.wait_drained(within, wait_commit),
            None => Ok(()),
        };
        self.poll_drain();
        let sentinel = self.sentinel.poll(&mut self.events);
        // Events that waited while the store was down.
        self.events.flush();
        // Done saving: the staging copy is not kept for a next save (a process that goes on to
        // restore into new tensors, or to evaluate, holds the state once, as after DCP's
        // `async_save`). A save after this allocates it again.
        let freed = self.ckpt.release_staging();
        if freed > 0 {
            debug!(bytes = freed, "staging memory released");
        }
        drained.and(early).and(sentinel)
    }

    /// [`CheckpointManager::finish`]'s wait for the save in flight, at full speed (the
    /// handle's waits lift the governor's limit).
    fn wait_last_save(&mut self) -> Result<()> {
        if let Some(h) = self.ckpt.last() {
            let within = self.final_wait();
            if self.cfg.ckpt.committer {
                h.wait_committed(within)?;
            } else {
                h.wait_persisted_within(within)?;
            }
            self.pacing
                .persist_ended(h.step(), self.ckpt.persist_rate(), &mut self.events);
        }
        Ok(())
    }

    /// What a rank that stops on an error (fenced, a failed step) still owes the run's
    /// events log, without waiting for anything: the sentinel's findings in the saves that
    /// ended, and the records held while the store was down.
    pub fn abandon(&mut self) {
        // A mismatch under `stop` was logged as it was found; the error goes up already.
        let _ = self.sentinel.poll(&mut self.events);
        self.events.flush();
    }

    /// The stores a restore reads: the run's store and the local tier.
    fn tiers(&self) -> restore::Tiers<'_> {
        restore::Tiers {
            main: &self.main,
            local: self.local_tier(),
        }
    }
}
