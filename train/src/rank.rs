//! One rank of the run ([`rank_main`]): its manager set up, the resume, the training loop
//! with its checkpoints, rollbacks and stops ([`RankLoop`]), and what the rank reports at the
//! end.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ckpt_recovery::records::{self, Metric};
use ckpt_recovery::{HeartbeatClient, RankEnv};
use ckpt_store::{Error, ErrorKind, Result};
use parking_lot::Mutex;
use tracing::{info, warn};

use ckpt_trainer::manager::{CheckpointManager, ManagerConfig, Scope};
use ckpt_trainer::monitor::{Decision, Spike};
use ckpt_trainer::save::{BackPressure, CheckpointerConfig, SaveHandle};
use ckpt_trainer::workload::{Partial, Progress, RankState, TrainConfig};

use crate::report::{emit_finished, emit_persists};
use crate::shared::Shared;
use crate::step::{agree, decide, fence_of, heartbeat_workload};
use crate::{BackPressureArg, Budget, CkptEvery, next_batch, note_resume_failure};

/// Run rank `rank`: set up its manager, resume, train to `--steps` (or a stop), finish.
pub(crate) fn rank_main(sh: &Shared, rank: u32) -> Result<()> {
    let a = &sh.args;
    let train = TrainConfig {
        seed: a.seed,
        lr: a.lr,
        frozen: a.frozen,
    };
    // Zeroed: a resumed rank's restore fills every tensor, so the initial weights are
    // computed (0.5 s at 100 M parameters) only when there is nothing to restore.
    let state = RankState::zeroed(sh.model, train, sh.layout, rank)?;
    let mut mgr = CheckpointManager::new(sh.store.clone(), manager_config(sh, rank, &state))?;
    state.register(&mut mgr)?;
    let progress = Arc::new(Mutex::new(Progress {
        step: 0,
        data_pos: 1,
        seed: a.seed,
    }));
    mgr.register_stateful("progress", Scope::Global, progress.clone())?;
    let resumed = resume(sh, rank, &mut mgr, &progress)?;
    if resumed.is_none() {
        state.init();
    }
    if rank == 0 || sh.world_threads == 1 {
        sh.outcome.lock().resumed_from = resumed;
    }
    // Supervised (ckpt resume): beating since the process started (as `starting`), from here
    // on the resumed step, then after every step and in between.
    let heartbeat = sh.heartbeat.lock().take();
    if let Some(hb) = &heartbeat {
        hb.step(progress.lock().step, None);
    }
    let start = progress.lock().step + 1;
    RankLoop {
        sh,
        rank,
        mgr,
        state,
        progress,
        heartbeat,
        pending: None,
        saves: Vec::new(),
        last: start.saturating_sub(1),
    }
    .run(start)
}

/// The manager's settings from the arguments.
fn manager_config(sh: &Shared, rank: u32, state: &RankState) -> ManagerConfig {
    let a = &sh.args;
    let mut ck = CheckpointerConfig::new(&a.run, rank, sh.layout);
    ck.generation = sh.generation;
    ck.staging_bytes = a
        .staging
        .map(|s| s as usize)
        .unwrap_or_else(|| state.held_bytes() as usize + sh.store.config().chunk_size);
    ck.prefault = a.prefault;
    ck.background_prefault = !a.no_background_prefault;
    ck.pool = sh.pool.clone();
    ck.peer = sh.launched.as_ref().and_then(RankEnv::peer_link);
    ck.copy_threads = (std::thread::available_parallelism().map_or(2, |n| n.get())
        / sh.world_threads as usize)
        .max(1);
    ck.back_pressure = match a.back_pressure {
        BackPressureArg::Wait => BackPressure::Wait,
        BackPressureArg::Skip => BackPressure::Skip,
    };
    let mut mc = ManagerConfig::new(ck);
    match a.ckpt_every {
        CkptEvery::Steps(n) => mc.every_steps = Some(n.max(1)),
        CkptEvery::Auto => mc.auto_interval = sh.auto_interval.clone(),
    }
    // The ranks of a node restore through one cache: each chunk read from the store once.
    mc.node_cache = sh.launched.as_ref().and_then(|e| e.node_cache.clone());
    // Under a launcher, its count of this machine's rank processes (replicas they all restore
    // are read through the page cache, once for the node); ranks as threads of this process
    // share a chunk cache instead, and no other process reads what they read.
    mc.node_processes = match &sh.launched {
        Some(e) => Some(e.local_world_size),
        None if a.rank.is_none() => Some(1),
        None => None,
    };
    mc.keep_last = a.keep_last;
    mc.keep_every = a.keep_every;
    mc.monitor = a.monitor_config();
    // One rank per process: the manager takes the final checkpoint on SIGTERM, unless the
    // supervisor says the job is being stopped after a failure (no commit is possible then).
    mc.final_on_sigterm =
        a.rank.is_some() && sh.launched.as_ref().is_none_or(|e| e.final_on_sigterm);
    mc.resume_step = a.resume_step;
    // The sentinel: the ranks hash what the driver says (or their own setting); rolling back
    // is the driver's, so a rank warns under it.
    mc.ckpt.sdc_check = a
        .sdc_check
        .or(sh.launched.as_ref().and_then(|e| e.sdc_check))
        .unwrap_or_default();
    mc.ckpt.node = sh.launched.as_ref().map(|e| e.node);
    mc.on_replica_mismatch = match a.on_replica_mismatch {
        ckpt_store::MismatchPolicy::Rollback => ckpt_store::MismatchPolicy::Warn,
        p => p,
    };
    mc.stale_after = a.stale_after;
    mc.local_tier = sh.local_tier.clone().map(|store| ckpt_trainer::LocalTier {
        store,
        keep_last: a.keep_local as usize,
    });
    // One machine of several, each with its own tier: the node's first rank commits the
    // node's ranks there (and drains them); the drains commit the step on the store.
    if let (Some(_), Some(ranks)) = (
        &mc.local_tier,
        sh.launched
            .as_ref()
            .and_then(|e| e.local_tier_ranks.clone()),
    ) {
        mc.ckpt.committer = ranks.iter().min() == Some(&rank);
        mc.ckpt.node_ranks = Some(ranks);
    }
    mc.persist_governor = match a.persist_budget {
        Budget::Off => None,
        Budget::Fraction(budget) => Some(ckpt_trainer::GovernorConfig {
            budget,
            min_rate: a.persist_min_rate.max(1),
            ..Default::default()
        }),
    };
    mc
}

/// Join this job's generation, then restore the step to resume from (with `--resume`), or
/// refuse a run that already has a committed step (without); the step resumed from.
fn resume(
    sh: &Shared,
    rank: u32,
    mgr: &mut CheckpointManager,
    progress: &Mutex<Progress>,
) -> Result<Option<u64>> {
    let a = &sh.args;
    // Join this job's generation before choosing the step: from here on no older job of the
    // run commits anything. (Threads: the process joined it.)
    if a.rank.is_some() {
        mgr.checkpointer().join_generation()?;
    } else {
        mgr.checkpointer().assume_joined();
    }
    let resume = a.resume || a.resume_step.is_some();
    // Either way, both tiers: a step only in the local tier counts.
    let target = mgr.resume_target();
    let target = target.inspect_err(|e| note_resume_failure(resume, e))?;
    match (resume, target) {
        (true, Some(s)) => {
            mgr.restore(s).map_err(|e| {
                note_resume_failure(true, &e);
                e.context(format!("restoring step {s} of run {} to resume it", a.run))
            })?;
            let p = *progress.lock();
            if p.step != s {
                return Err(Error::corrupt(format!(
                    "step {s} of run {} holds training progress for step {}",
                    a.run, p.step
                )));
            }
            if p.seed != a.seed {
                return Err(Error::invalid(format!(
                    "run {} was started with --seed {}; resuming with --seed {} would change every number",
                    a.run, p.seed, a.seed
                )));
            }
            Ok(Some(s))
        }
        (true, None) => {
            info!(rank, "nothing to resume from: starting at step 0");
            Ok(None)
        }
        (false, Some(s)) => Err(Error::invalid(format!(
            "run {} already has a committed checkpoint (step {s}); pass --resume to continue it or choose another --run",
            a.run
        ))),
        (false, None) => Ok(None),
    }
}

/// What the loop does after a step.
enum Flow {
    /// Go on with this step.
    Next(u64),
    /// Leave the loop, with the error the rank stops with, if any.
    Break(Option<Error>),
}

/// A rank's training loop and the saves it has in flight.
struct RankLoop<'a> {
    sh: &'a Shared,
    rank: u32,
    mgr: CheckpointManager,
    state: RankState,
    progress: Arc<Mutex<Progress>>,
    heartbeat: Option<HeartbeatClient>,
    /// The save whose snapshot the next step waits for: (handle, when `save` was called, the
    /// seconds the call took).
    pending: Option<(SaveHandle, Instant, f64)>,
    /// Saves whose snapshot is taken, with the loop's stall, not yet reported.
    saves: Vec<(SaveHandle, f64)>,
    /// The last step trained.
    last: u64,
}

impl RankLoop<'_> {
    /// Train from `start` to `--steps` (or a stop), then wait for the saves and report.
    fn run(mut self, start: u64) -> Result<()> {
        let mut stopped: Option<Error> = None;
        let mut step = start;
        while step <= self.sh.args.steps {
            match self.step(step) {
                Ok(Flow::Next(next)) => step = next,
                Ok(Flow::Break(e)) => {
                    stopped = e;
                    break;
                }
                Err(e) => {
                    // What the saves that ended found still reaches the events log.
                    self.mgr.abandon();
                    return Err(e);
                }
            }
        }
        if let Some(e) = stopped.take_if(|e| e.kind() == ErrorKind::Fenced) {
            // Its pending save cannot commit; waiting for it would only delay the stop.
            self.mgr.abandon();
            return Err(e);
        }
        self.finish()?;
        match stopped {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// One step: train, judge (with the other ranks), then roll back, stop or maybe save.
    fn step(&mut self, step: u64) -> Result<Flow> {
        let (sh, rank) = (self.sh, self.rank);
        let t_step = Instant::now();
        let (batch, part) = self.train(step, t_step)?;
        // Lockstep with the other rank threads: rank 0 logs the global loss and decides about
        // spikes and SIGTERM for all, before anything of this step is saved.
        let decision = decide(sh, &mut self.mgr, rank, step, batch, part, t_step)?;
        // A newer generation owns the run (a job resumed while this one runs): stop at once,
        // no retries; nothing this job saves can commit any more.
        if let Some(why) = fence_of(sh, &self.mgr) {
            warn!(rank, step, "stopping: {why}");
            return Ok(Flow::Break(Some(Error::new(ErrorKind::Fenced, why))));
        }
        match decision {
            Decision::Continue | Decision::Alert(_) => {}
            Decision::Rollback(spike) => return self.roll_back(&spike).map(Flow::Next),
            Decision::Stop(st) => {
                return Ok(Flow::Break(Some(Error::new(
                    ErrorKind::InvalidInput,
                    format!("run {}: {st}", sh.args.run),
                ))));
            }
        }
        let stop = sh.stop_now.load(Ordering::SeqCst);
        if stop {
            // The final checkpoint gets the manager's final deadline.
            self.mgr.request_stop();
        }
        self.last = step;
        self.save(step, stop)?;
        emit_finished(sh, rank, &mut self.saves, false)?;
        emit_persists(sh, &mut self.mgr);
        if stop || self.mgr.should_stop() {
            info!(rank, step, "stopping after the final checkpoint (SIGTERM)");
            return Ok(Flow::Break(None));
        }
        Ok(Flow::Next(step + 1))
    }

    /// The forward and backward pass and the optimizer step of `step` on the next data batch
    /// (waiting for the pending snapshot before the state changes); the batch and this rank's
    /// partial sums.
    fn train(&mut self, step: u64, t_step: Instant) -> Result<(u64, Partial)> {
        let sh = self.sh;
        let a = &sh.args;
        let batch = {
            let mut p = self.progress.lock();
            p.data_pos = next_batch(&a.skip_batches, p.data_pos);
            p.data_pos
        };
        let scale = a.target_scale(batch);
        // Forward and backward read the weights: they overlap with a pending snapshot copy.
        let part = self.state.partial_loss(batch, scale);
        if let Some((h, _, call_s)) = self.pending.take() {
            let tw = Instant::now();
            h.wait_snapshot()?;
            let stall = call_s + tw.elapsed().as_secs_f64();
            self.saves.push((h, stall));
        }
        // The optimizer step mutates the state.
        self.state.update(step, batch, scale);
        self.maybe_flip_bit(step);
        {
            let mut p = self.progress.lock();
            p.step = step;
            p.data_pos = batch + 1;
        }
        if let Some(hb) = &self.heartbeat {
            hb.step(step, Some(heartbeat_workload(&part)));
        }
        if let Some(ms) = Some(a.step_time_ms).filter(|&m| m > 0) {
            let left = Duration::from_millis(ms).saturating_sub(t_step.elapsed());
            std::thread::sleep(left);
        }
        Ok((batch, part))
    }

    /// `--inject-bitflip NODE@STEP`: after `step`'s update on the rank of that node (without a
    /// driver, of that rank), flip one bit of a replicated tensor (silent data corruption).
    fn maybe_flip_bit(&self, step: u64) {
        let Some((node, at)) = self.sh.args.inject_bitflip else {
            return;
        };
        let here = self.sh.launched.as_ref().map_or(self.rank, |e| e.node);
        if at == step
            && here == node
            && let Some(what) = self.state.flip_bit()
        {
            warn!(rank = self.rank, node, step, "injected a bit flip: {what}");
        }
    }

    /// Roll back past `spike` (every rank, or all fail); the step to go on with.
    fn roll_back(&mut self, spike: &Spike) -> Result<u64> {
        self.wait_pending()?;
        let progress = &self.progress;
        let r = self.mgr.rollback(spike, |_| {
            let mut p = progress.lock();
            let first = p.data_pos;
            let through = spike.batch?;
            p.data_pos = p.data_pos.max(through + 1);
            (through >= first).then_some((first, through))
        });
        let r = agree(self.sh, r)?;
        if let Some(hb) = &self.heartbeat {
            hb.step(r.to_step, None);
        }
        emit_finished(self.sh, self.rank, &mut self.saves, false)?;
        self.last = r.to_step;
        Ok(r.to_step + 1)
    }

    /// Save `step` if it is the last, a stop's, or the interval's; its snapshot overlaps the
    /// next step unless `--no-overlap` (or the last step, or a stop).
    fn save(&mut self, step: u64, stop: bool) -> Result<()> {
        let sh = self.sh;
        let a = &sh.args;
        let t_save = Instant::now();
        let h = if step == a.steps || stop {
            self.mgr.save_now(step).map(Some)
        } else {
            self.mgr.maybe_save(step)
        };
        let h = match h {
            // Threads: the ranks stop together at the next step's decision (a rank leaving
            // alone would leave the others waiting at the barrier).
            Err(e) if e.kind() == ErrorKind::Fenced && sh.args.rank.is_none() && step < a.steps => {
                warn!(rank = self.rank, step, "checkpoint refused: {e}");
                None
            }
            h => h?,
        };
        if let Some(h) = h {
            let call_s = t_save.elapsed().as_secs_f64();
            if a.no_overlap || step == a.steps || stop {
                h.wait_snapshot()?;
                self.saves.push((h, t_save.elapsed().as_secs_f64()));
            } else {
                self.pending = Some((h, t_save, call_s));
            }
        }
        Ok(())
    }

    /// Wait for the pending snapshot; the loop's stall counts from the `save` call.
    fn wait_pending(&mut self) -> Result<()> {
        if let Some((h, t0, _)) = self.pending.take() {
            h.wait_snapshot()?;
            self.saves.push((h, t0.elapsed().as_secs_f64()));
        }
        Ok(())
    }

    /// After the loop: wait for the saves, report them, the store's health and the outcome.
    fn finish(mut self) -> Result<()> {
        let (sh, rank) = (self.sh, self.rank);
        self.wait_pending()?;
        self.mgr.finish()?;
        emit_finished(sh, rank, &mut self.saves, true)?;
        emit_persists(sh, &mut self.mgr);
        let health = self.mgr.store_health();
        if health != Default::default() {
            sh.emit(&Metric::StoreHealth(records::StoreHealth {
                rank,
                counts: health,
            }));
        }
        if rank == 0 || sh.world_threads == 1 {
            let mut out = sh.outcome.lock();
            out.last_step = self.last;
            out.rollbacks = self.mgr.monitor().history().to_vec();
        }
        // Beating on until the process ends: what follows (the final digest, the logs)
        // reads and writes the store, which may be slow.
        if let Some(hb) = self.heartbeat.take() {
            *sh.heartbeat.lock() = Some(hb);
        }
        Ok(())
    }
}
