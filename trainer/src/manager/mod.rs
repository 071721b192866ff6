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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use ckpt_recovery::peer::PeerSource;
use ckpt_store::logs::{EVENTS, LogWriter};
use ckpt_store::placement::place_rank;
use ckpt_store::records::{self, Event};
use ckpt_store::{
    ChunkCache, Error, ErrorKind, GcOptions, NdBox, Result, StepReader, Store, TensorSpec,
};
use parking_lot::Mutex;
use tracing::{info, instrument, warn};

use crate::governor::{Change, Governor, GovernorConfig};
use crate::interval::{
    AutoInterval, CostMeter, Decided, FailureRate, Why, choose_steps, failure_rate,
    generation_choice,
};
use crate::memory::{HostTensor, HostView, MemorySink, MemorySource};
use crate::monitor::{
    Decision, Monitor, MonitorConfig, MonitorState, Observation, RollbackEntry, Spike, StopReason,
};
use crate::restore::{RestoreTarget, restore_targets};
use crate::save::{
    Checkpointer, CheckpointerConfig, SaveHandle, SaveState, SaveTensor, Stage, runtime,
};

/// The chunk cache that every restore running in this process at the same time shares.
///
/// Ranks run as threads of one process (one process per node, or the reference workload)
/// restore at about the same time; after a reshard their boxes cut the same chunks (a
/// tensor-parallel split along columns needs a part of every row, so every chunk of the old
/// shard), and each chunk is then fetched and decoded once instead of once per rank. Chunks
/// are content-addressed, so sharing across stores and runs is sound. The cache lives while
/// some restore holds it and is freed when the last one ends; `cap` sizes a new one. A caller
/// that restores ranks one after another holds the returned cache across them.
pub fn shared_restore_cache(cap: usize) -> Arc<ChunkCache> {
    static CACHE: Mutex<Weak<ChunkCache>> = Mutex::new(Weak::new());
    let mut slot = CACHE.lock();
    if let Some(c) = slot.upgrade() {
        return c;
    }
    let c = ChunkCache::new(cap as u64);
    *slot = Arc::downgrade(&c);
    c
}

/// State that is not a tensor: RNG, data-loader position, LR schedule.
pub trait Stateful: Send {
    /// Serialize the state.
    fn state_dict(&self) -> Vec<u8>;
    /// Restore the state.
    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<()>;
}

/// Who saves a [`Stateful`] item and where a restore reads it from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The same on every rank (data position, step): saved by rank 0, restored by all.
    Global,
    /// Each rank's own (a per-rank RNG): restored from the same rank when the layout is
    /// unchanged; left as it is (with a warning) when the job was resharded.
    PerRank,
}

/// Memory of a tensor a rank holds, from which the boxes placement assigns can be cut.
pub trait TensorMemory: Send + Sync {
    /// A source for the part `sub` of the held box `held`.
    fn source(&self, held: &NdBox, sub: &NdBox, elem: usize) -> Result<Arc<dyn MemorySource>>;
    /// A sink for the whole held box.
    fn sink(&self, held: &NdBox, elem: usize) -> Result<Arc<dyn MemorySink>>;
}

impl TensorMemory for HostTensor {
    fn source(&self, held: &NdBox, sub: &NdBox, elem: usize) -> Result<Arc<dyn MemorySource>> {
        if held == sub {
            return Ok(Arc::new(self.clone()));
        }
        Ok(Arc::new(HostView::new(
            self.clone(),
            held.clone(),
            sub.clone(),
            elem,
        )?))
    }
    fn sink(&self, held: &NdBox, elem: usize) -> Result<Arc<dyn MemorySink>> {
        let have = MemorySink::len(self);
        let want = held.numel() as usize * elem;
        if have != want {
            return Err(Error::invalid(format!(
                "held box {held} needs {want} bytes, the tensor has {have}"
            )));
        }
        Ok(Arc::new(self.clone()))
    }
}

/// Settings of a [`CheckpointManager`].
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// The checkpointer's settings (run, rank, layout, staging, back-pressure).
    pub ckpt: CheckpointerConfig,
    /// Save every N steps.
    pub every_steps: Option<u64>,
    /// Save when this much time passed since the last save.
    pub every: Option<Duration>,
    /// Choose the interval from the measured cost of a save and the run's failure rate
    /// (Young/Daly, within bounds; [`crate::interval`]); replaces `every_steps` and `every`.
    pub auto_interval: Option<AutoInterval>,
    /// Keep the newest N committed steps.
    pub keep_last: Option<usize>,
    /// Keep steps that are multiples of K.
    pub keep_every: Option<u64>,
    /// Objects younger than this are never deleted by retention's sweep.
    pub retention_grace: Duration,
    /// Save a final checkpoint when SIGTERM arrives (preemption). A second SIGTERM ends the
    /// process at once (exit status 143) whatever the final checkpoint is doing.
    pub final_on_sigterm: bool,
    /// The most the final checkpoint (after SIGTERM) may take, persist and commit together;
    /// past it the save fails with an error naming what it waits for.
    pub final_deadline: Duration,
    /// Bytes in flight during a restore; also the size of the chunk cache that the ranks of
    /// one process share while they restore (see [`shared_restore_cache`]).
    pub restore_budget: usize,
    /// A directory the ranks of this node share while they restore (see
    /// [`ckpt_store::NodeCache`]): each chunk is read from the store once per node. `None`:
    /// each rank reads the store itself.
    pub node_cache: Option<std::path::PathBuf>,
    /// Loss-spike monitoring and its action (default: off). The manager sees a loss only
    /// through [`CheckpointManager::observe`].
    pub monitor: MonitorConfig,
    /// The step to resume from, exactly: what a supervisor chose (`ckpt resume` passes it to
    /// the ranks as `CKPT_RESUME_STEP`; the program's entry point reads it into this field).
    /// [`CheckpointManager::restore_latest`] restores it instead of the newest committed step,
    /// which may be one the supervisor found damaged. `None`: the newest committed step.
    pub resume_step: Option<u64>,
    /// The persist governor (see [`crate::governor`]): when the steps that run beside a
    /// persist are slower than its budget (default 10 %) than steps without one, it lowers
    /// the persist's rate (down to a floor, so time to durable stays bounded), and raises it
    /// again when they are not. The final checkpoint and every wait for a persist run at full
    /// speed. `None`: persists always run at full speed.
    pub persist_governor: Option<GovernorConfig>,
}

impl ManagerConfig {
    /// Defaults around a checkpointer config.
    pub fn new(ckpt: CheckpointerConfig) -> Self {
        ManagerConfig {
            ckpt,
            every_steps: None,
            every: None,
            auto_interval: None,
            keep_last: None,
            keep_every: None,
            retention_grace: Duration::from_secs(3600),
            final_on_sigterm: true,
            final_deadline: Duration::from_secs(300),
            restore_budget: 256 << 20,
            node_cache: None,
            monitor: MonitorConfig::default(),
            resume_step: None,
            persist_governor: Some(GovernorConfig::default()),
        }
    }
}

type StatefulItem = (String, Scope, Arc<Mutex<dyn Stateful>>);

/// Kinds of the records the manager writes to the run's events log (`kind` field) when the
/// store fails: a checkpoint that failed in the store, one skipped while the store is down,
/// and checkpointing coming back.
pub mod events {
    /// The persist governor changed the persist rate: `{"kind", "step", "rank", "from_bps",
    /// "to_bps", "reason", "slowdown", "budget", "baseline_s", "at_floor"}`.
    pub const PERSIST_RATE: &str = "persist_rate";
    /// The automatic checkpoint interval changed: `{"kind", "step", "from_steps",
    /// "to_steps", "reason", "cost_s", "mtbf_s", ...}`.
    pub const CHECKPOINT_INTERVAL: &str = "checkpoint_interval";
    /// A save failed in the store (its error kind was a backend or I/O failure, after the
    /// store's retries): `{"kind", "step", "error"}`.
    pub const CHECKPOINT_FAILED: &str = "checkpoint_failed";
    /// A due checkpoint was not taken because the store is down: `{"kind", "step", "reason"}`.
    pub const CHECKPOINT_SKIPPED: &str = "checkpoint_skipped";
    /// The store answers again; the next due checkpoint is taken: `{"kind", "step",
    /// "skipped", "down_since_step"}`.
    pub const CHECKPOINTS_RESUMED: &str = "checkpoints_resumed";
}

/// How checkpointing fared against a failing store ([`CheckpointManager::store_health`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StoreHealth {
    /// Saves that failed in the store.
    pub failed: u64,
    /// Due checkpoints skipped while the store was down.
    pub skipped: u64,
    /// Times checkpointing resumed after the store came back.
    pub resumed: u64,
    /// Whether the store is down now (the last save failed and no probe answered since).
    pub down: bool,
}

/// The store is down: since which step, and the probe that checks whether it is back.
struct Down {
    since_step: u64,
    probe: Option<tokio::task::JoinHandle<bool>>,
}

/// Errors of a store that may come back: worth skipping a checkpoint for, not stopping.
fn store_failure(kind: ErrorKind) -> bool {
    matches!(kind, ErrorKind::Backend | ErrorKind::Io)
}

/// The blob (`rank/<name>`) that keeps the monitor's window and rollback history with each
/// checkpoint; reserved.
pub const MONITOR_BLOB: &str = "ckpt-monitor";

/// A rollback carried out by [`CheckpointManager::rollback`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rollback {
    /// The step of the spike.
    pub from_step: u64,
    /// The checkpoint restored: the loop goes on with step `to_step + 1`.
    pub to_step: u64,
    /// The data batches skipped (first, last), as the loop's closure said.
    pub skipped: Option<(u64, u64)>,
    /// Rollbacks of the run so far, this one included.
    pub count: usize,
}

struct Registered {
    spec: TensorSpec,
    held: NdBox,
    memory: Arc<dyn TensorMemory>,
    saves: Saves,
}

/// Which boxes of a registered tensor a save writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Saves {
    /// The boxes the placement rules assign to this rank under the layout.
    Placed,
    /// Exactly the held box: written by this rank (`None`) or by the given rank, of which this
    /// rank holds a replica ([`CheckpointManager::register_held`]).
    Held(Option<u32>),
}

/// The training loop's checkpoint manager (see the module docs).
pub struct CheckpointManager {
    ckpt: Checkpointer,
    cfg: ManagerConfig,
    tensors: Vec<Registered>,
    stateful: Vec<StatefulItem>,
    last_save: Instant,
    last_saved_step: Option<u64>,
    sigterm: Arc<AtomicBool>,
    /// The stop decision the ranks agreed on for the current `maybe_save` (see
    /// [`CheckpointManager::set_agreed_stop`]); `None`: this rank's own SIGTERM flag decides.
    agreed_stop: Option<bool>,
    stop: bool,
    retention: Option<tokio::task::JoinHandle<()>>,
    retained_step: Option<u64>,
    monitor: Monitor,
    events: Option<LogWriter>,
    /// The step of the last spike this manager decided about (it logs that rollback).
    decided: Option<u64>,
    /// Set while the store is down (see [`CheckpointManager::maybe_save`]).
    down: Option<Down>,
    /// Saves of `maybe_save` not yet committed or failed (a failure in the store is reported).
    watch: Vec<SaveHandle>,
    /// The store's give-ups when the last save was due.
    give_ups_seen: u64,
    health: StoreHealth,
    /// The automatic interval's measurements (with [`ManagerConfig::auto_interval`]).
    auto: AutoState,
    /// The persist governor (with [`ManagerConfig::persist_governor`]).
    gov: Option<GovState>,
}

/// One persist as the persist governor saw it ([`CheckpointManager::take_persist_figures`];
/// `ckpt-train` writes each as a `persist` metrics record).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PersistFigures {
    /// The step saved.
    pub step: u64,
    /// The rank.
    pub rank: u32,
    /// Raw bytes the persist handled (copied into staging; unchanged shards excluded).
    pub bytes: u64,
    /// How much slower the steps beside the persist were than the baseline (overlap-weighted);
    /// `None`: none was measured (no baseline yet, or no step ran beside it).
    pub slowdown: Option<f64>,
    /// Seconds of step time that ran beside the persist.
    pub overlap_s: f64,
    /// Seconds from the save to this rank's chunks and manifest in the store: time to durable.
    pub durable_s: f64,
    /// The rate the governor settled at by the end of it, raw bytes/s (`None`: no limit).
    pub rate_bps: Option<u64>,
    /// The budget (a fraction).
    pub budget: f64,
    /// The baseline step time, seconds.
    pub baseline_s: Option<f64>,
}

/// What the manager measures for the persist governor.
struct GovState {
    gov: Governor,
    /// When `maybe_save` last returned: the start of the step interval measured next.
    last_exit: Option<Instant>,
    /// The save whose persist is governed.
    tracked: Option<Tracked>,
    /// Figures of the persists that ended, not yet taken.
    done: Vec<PersistFigures>,
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

/// The seconds `[a0, a1]` and `[b0, b1]` share.
fn overlap_s(a0: Instant, a1: Instant, b0: Instant, b1: Instant) -> f64 {
    let start = a0.max(b0);
    let end = a1.min(b1);
    end.saturating_duration_since(start).as_secs_f64()
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

impl std::fmt::Debug for CheckpointManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CheckpointManager({:?})", self.ckpt)
    }
}

impl CheckpointManager {
    /// A manager for one rank.
    pub fn new(store: Store, cfg: ManagerConfig) -> Result<Self> {
        cfg.monitor
            .validate()
            .map_err(|e| Error::invalid(format!("monitor settings: {e}")))?;
        if let Some(a) = &cfg.auto_interval {
            a.validate()
                .map_err(|e| Error::invalid(format!("automatic checkpoint interval: {e}")))?;
        }
        if let Some(g) = &cfg.persist_governor {
            g.validate()
                .map_err(|e| Error::invalid(format!("persist governor: {e}")))?;
        }
        let ckpt = Checkpointer::new(store, cfg.ckpt.clone())?;
        let sigterm = Arc::new(AtomicBool::new(false));
        if cfg.final_on_sigterm {
            on_sigterm(&sigterm)?;
        }
        Ok(CheckpointManager {
            ckpt,
            monitor: Monitor::new(cfg.monitor.clone()),
            events: None,
            decided: None,
            down: None,
            watch: Vec::new(),
            give_ups_seen: 0,
            health: StoreHealth::default(),
            auto: AutoState::default(),
            gov: cfg.persist_governor.clone().map(|c| GovState {
                gov: Governor::new(c),
                last_exit: None,
                tracked: None,
                done: Vec::new(),
            }),
            cfg,
            tensors: Vec::new(),
            stateful: Vec::new(),
            last_save: Instant::now(),
            last_saved_step: None,
            sigterm,
            agreed_stop: None,
            stop: false,
            retention: None,
            retained_step: None,
        })
    }

    /// The checkpointer underneath.
    pub fn checkpointer(&self) -> &Checkpointer {
        &self.ckpt
    }

    /// The store.
    pub fn store(&self) -> &Store {
        self.ckpt.store()
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
        if !held.within(&spec.shape) {
            return Err(Error::invalid(format!(
                "tensor {:?}: held box {held} does not fit the shape {:?}",
                spec.name, spec.shape
            )));
        }
        if self.tensors.iter().any(|t| t.spec.name == spec.name) {
            return Err(Error::invalid(format!(
                "tensor {:?} is registered twice",
                spec.name
            )));
        }
        self.tensors.push(Registered {
            spec,
            held,
            memory,
            saves: Saves::Placed,
        });
        Ok(())
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
        let cfg = &self.cfg.ckpt;
        if let Some(w) = replica_of
            && (w >= cfg.layout.world() || w == cfg.rank)
        {
            return Err(Error::invalid(format!(
                "tensor {:?}: rank {} cannot hold a replica of rank {w}'s box in a world of {} ranks",
                spec.name,
                cfg.rank,
                cfg.layout.world()
            )));
        }
        self.register(spec, held, memory)?;
        if let Some(r) = self.tensors.last_mut() {
            r.saves = Saves::Held(replica_of);
        }
        Ok(())
    }

    /// Forget every registered tensor: a loop whose tensors were replaced (new memory, other
    /// boxes) registers them again before its next save or restore.
    pub fn clear_tensors(&mut self) {
        self.tensors.clear();
    }

    /// The number of registered tensors.
    pub fn registered(&self) -> usize {
        self.tensors.len()
    }

    /// Register non-tensor state.
    pub fn register_stateful(
        &mut self,
        name: &str,
        scope: Scope,
        item: Arc<Mutex<dyn Stateful>>,
    ) -> Result<()> {
        ckpt_store::model::validate_name(name)?;
        if name == MONITOR_BLOB || self.stateful.iter().any(|(n, _, _)| n == name) {
            return Err(Error::invalid(format!(
                "stateful item {name:?} is registered twice or reserved"
            )));
        }
        self.stateful.push((name.to_string(), scope, item));
        Ok(())
    }

    /// Whether a SIGTERM asked the job to stop (after its final checkpoint).
    pub fn should_stop(&self) -> bool {
        self.stop
    }

    /// Ask for a stop as if SIGTERM had arrived.
    pub fn request_stop(&self) {
        self.sigterm.store(true, Ordering::SeqCst);
    }

    /// For ranks that agree on stopping among themselves (each reads
    /// [`CheckpointManager::sigterm_received`], then they reduce it): the agreed decision, which
    /// the next `maybe_save` follows instead of this rank's own flag, so a SIGTERM arriving
    /// between the agreement and the save cannot make one rank stop alone. `None` goes back to
    /// the flag. Taken by the next `maybe_save`.
    pub fn set_agreed_stop(&mut self, stop: Option<bool>) {
        self.agreed_stop = stop;
    }

    /// Whether SIGTERM has arrived.
    pub fn sigterm_received(&self) -> bool {
        self.sigterm.load(Ordering::SeqCst)
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
        self.govern(step);
        let r = self.maybe_save_inner(step, prepare);
        if let Some(g) = self.gov.as_mut() {
            g.last_exit = Some(Instant::now());
        }
        r
    }

    fn maybe_save_inner(
        &mut self,
        step: u64,
        prepare: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<Option<SaveHandle>> {
        let term = self
            .agreed_stop
            .take()
            .unwrap_or_else(|| self.sigterm.load(Ordering::SeqCst));
        if self.cfg.final_on_sigterm && term && !self.stop {
            info!(step, "SIGTERM: taking a final checkpoint");
            // The final checkpoint, and the persist it may wait for, run at full speed.
            let _fast = self.ckpt.persist_rate().full_speed();
            prepare(self)?;
            let h = self.save_now(step)?;
            self.stop = true;
            h.wait_committed(self.final_wait())?;
            return Ok(Some(h));
        }
        let due = match self.cfg.auto_interval.clone() {
            Some(auto) => self.auto_due(&auto, step),
            None => {
                let due_steps = self
                    .cfg
                    .every_steps
                    .is_some_and(|n| n > 0 && step.is_multiple_of(n));
                let due_time = self
                    .cfg
                    .every
                    .is_some_and(|d| self.last_save.elapsed() >= d);
                due_steps || due_time
            }
        };
        if due && self.last_saved_step != Some(step) {
            self.auto.last_due = Some(step);
            // A store that fails (after its retries) does not stop training: the failed save
            // is reported, due checkpoints are skipped while a probe finds the store down, and
            // the first due checkpoint after the store answers again is taken.
            self.report_failed_save(step);
            // The save in flight is still retrying and the store already gave up on a request
            // since it started: do not wait for it to fail.
            let gave_up = self.store_give_ups();
            if self.watch.iter().any(|h| !h.stage().persist_ended()) && gave_up > self.give_ups_seen
            {
                self.mark_down(step);
            }
            self.give_ups_seen = gave_up;
            if let Some(why) = self.store_down(step) {
                self.skip_checkpoint(step, &why);
                return Ok(None);
            }
            prepare(self)?;
            return match self.save_now(step) {
                Ok(h) => {
                    // The save may have waited for the one before it to fail.
                    self.report_failed_save(step);
                    self.watch.push(h.clone());
                    Ok(Some(h))
                }
                Err(e) if store_failure(e.kind()) => {
                    self.mark_down(step);
                    self.skip_checkpoint(step, &e.to_string());
                    Ok(None)
                }
                Err(e) => Err(e),
            };
        }
        Ok(None)
    }

    /// Whether this manager decides the automatic interval (rank 0's; the others follow its
    /// schedule).
    fn auto_decides(&self) -> bool {
        self.cfg.auto_interval.is_some() && self.cfg.ckpt.rank == 0
    }

    /// The automatic interval at `step`: measure the step interval that ended, evaluate the
    /// interval when the save being measured is done (the decider), and say whether a
    /// checkpoint is due (the interval in force has passed since the last due one).
    fn auto_due(&mut self, auto: &AutoInterval, step: u64) -> bool {
        if auto.per_generation && self.auto.fixed.is_none() {
            self.fix_generation_interval(auto);
        }
        if self.auto_decides() {
            let now = Instant::now();
            if let Some(prev) = self.auto.last_tick {
                let busy = self.auto.busy && self.auto.meter.measuring();
                self.auto
                    .meter
                    .step(now.duration_since(prev).as_secs_f64(), busy);
            }
            self.auto.last_tick = Some(now);
            let done = self
                .auto
                .tracking
                .as_ref()
                .map(|h| h.stage().persist_ended());
            if done == Some(true) {
                self.tracked_save_done(auto, step);
            }
            self.auto.busy = self.auto.tracking.is_some();
        }
        if auto.per_generation {
            // Counted from the step the generation resumed from, which every rank restored:
            // no rank's history (a skipped checkpoint, a late agreement) shifts its steps.
            let Some(n) = self.auto.fixed.as_ref().map(|c| c.to_steps.max(1)) else {
                return false;
            };
            let anchor = self.auto.anchor.unwrap_or(0);
            return step > anchor && (step - anchor).is_multiple_of(n);
        }
        let base = self.auto.last_due.or(self.last_saved_step).unwrap_or(0);
        step >= base.saturating_add(auto.at(step))
    }

    /// One interval per generation: derive this generation's interval from the run's log as it
    /// stood at the generation's start ([`generation_choice`]), propose it, and take the one
    /// agreed in the store (the first proposal of any rank of the generation). The rank whose
    /// proposal was stored logs it (`checkpoint_interval`). If the store fails, no checkpoint
    /// is due until a later try (a second on) agrees.
    fn fix_generation_interval(&mut self, auto: &AutoInterval) {
        if self.auto.retry_at.is_some_and(|t| Instant::now() < t) {
            return;
        }
        let store = self.ckpt.store().clone();
        let run = self.cfg.ckpt.run.clone();
        let generation = self.cfg.ckpt.generation;
        let anchor = *self
            .auto
            .anchor
            .get_or_insert(self.last_saved_step.unwrap_or(0));
        let r = runtime().block_on(async {
            let start_ms = match store.generation_started_ms(&run, generation).await? {
                Some(t) => t,
                None => store.now().timestamp_millis(),
            };
            let events = records::read_records::<Event>(&store, &run).await?;
            let mut proposal = generation_choice(&events, generation, start_ms, auto);
            proposal.step = anchor;
            store
                .agree_generation_interval(&run, generation, &proposal)
                .await
        });
        let (agreed, proposed) = match r {
            Ok(x) => x,
            Err(e) => {
                warn!(
                    generation,
                    "agreeing on the checkpoint interval of this generation: {e}; no checkpoint until it is agreed"
                );
                self.auto.retry_at = Some(Instant::now() + Duration::from_secs(1));
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
            self.log_event(Event::CheckpointInterval(agreed.clone()));
        }
        self.auto.fixed = Some(agreed);
    }

    /// One interval per generation, on the deciding rank: log what a save costs
    /// (`save_cost`) for the next generation, when it is the first measurement or the figures
    /// moved by a tenth or more (or the interval they call for changed).
    /// The save the automatic interval measures has ended: take its cost, then log it (one
    /// rank per process) or evaluate the interval (ranks in one process).
    fn tracked_save_done(&mut self, auto: &AutoInterval, step: u64) {
        self.auto.tracking = None;
        let measured = self.auto.meter.save_done();
        if auto.per_generation {
            self.log_save_cost(auto, step);
        } else {
            self.evaluate_interval(auto, step, measured.is_some());
        }
    }

    fn log_save_cost(&mut self, auto: &AutoInterval, step: u64) {
        let Some(fixed) = self.auto.fixed.clone() else {
            return;
        };
        let cost_s = self.auto.meter.cost_s();
        let step_s = self.auto.meter.step_s();
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
        if let Some((c0, s0, n0)) = self.auto.cost_logged
            && !moved(cost_s, c0)
            && !moved(step_s, s0)
            && n0 == next_steps
        {
            return;
        }
        self.auto.cost_logged = Some((cost_s, step_s, next_steps));
        self.log_event(Event::SaveCost(records::SaveCost {
            generation: self.cfg.ckpt.generation,
            rank: self.cfg.ckpt.rank,
            step,
            cost_s,
            step_s,
            steps: fixed.to_steps,
            next_steps,
        }));
    }

    /// Read the run's recovery log in the background (one read at a time): the failure rate
    /// for the next evaluation.
    fn read_failures(&mut self) {
        if self.auto.reading.is_some() {
            return;
        }
        let store = self.ckpt.store().clone();
        let run = self.cfg.ckpt.run.clone();
        self.auto.reading = Some(
            runtime().spawn(async move { records::read_records::<Event>(&store, &run).await }),
        );
    }

    /// The failure rate: the newest read of the recovery log (waited for only when none
    /// finished yet).
    fn failure_rate(&mut self, auto: &AutoInterval) -> FailureRate {
        let ready =
            self.auto.rate.is_none() || self.auto.reading.as_ref().is_some_and(|r| r.is_finished());
        if ready && let Some(r) = self.auto.reading.take() {
            match runtime().block_on(r) {
                Ok(Ok(events)) => {
                    let now = self.ckpt.store().now().timestamp_millis();
                    self.auto.rate = Some(failure_rate(&events, now, auto.mtbf_prior));
                }
                Ok(Err(e)) => warn!("reading the recovery log for the checkpoint interval: {e}"),
                Err(e) => warn!("reading the recovery log for the checkpoint interval: {e}"),
            }
        }
        self.auto
            .rate
            .unwrap_or_else(|| FailureRate::prior(auto.mtbf_prior))
    }

    /// Choose the interval after `step` from the cost of a save and the failure rate; log the
    /// first decision and every change (`checkpoint_interval`) and put it in force from the
    /// next step.
    fn evaluate_interval(&mut self, auto: &AutoInterval, step: u64, measured: bool) {
        let rate = self.failure_rate(auto);
        let current = auto.at(step);
        let cost_s = self.auto.meter.cost_s();
        let step_s = self.auto.meter.step_s();
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
        if self.auto.evaluated && (steps == current || small) {
            return;
        }
        self.auto.evaluated = true;
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
        self.log_event(Event::CheckpointInterval(
            decided.record(step, current, &rate, None),
        ));
    }

    /// The persist governor at the start of `maybe_save(step)`: measure the step interval that
    /// ended (from the last `maybe_save`'s return to now), feed it to the governor, apply and
    /// log a change of the rate, and sum up the governed persist once it ended.
    fn govern(&mut self, step: u64) {
        let now = Instant::now();
        let rate = self.ckpt.persist_rate().clone();
        let Some(g) = self.gov.as_mut() else { return };
        let prev = g.last_exit.take();
        let Some(t) = g.tracked.as_mut() else {
            if let Some(prev) = prev {
                g.gov.clean_step(now.duration_since(prev).as_secs_f64());
            }
            return;
        };
        let stage = t.handle.stage();
        let r = t.handle.report();
        let done = stage.persist_ended();
        let snap_end = match stage {
            Stage::Snapshotting => now,
            _ => t.at + Duration::from_secs_f64(r.snapshot_s),
        };
        let persist_end = if done && r.persist_s > 0.0 {
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
            let el = now.saturating_duration_since(snap_end).as_secs_f64();
            let throughput = (moved > 0.0 && el > 0.0).then_some(moved / el);
            // A save that failed (or was skipped) before it persisted tells nothing.
            let failed =
                matches!(stage, Stage::Failed(_) | Stage::Skipped(_)) && r.persist_s == 0.0;
            if o > 0.0 && !failed {
                change = g.gov.busy_step(loop_s, o, throughput);
            }
        }
        if let Some(c) = change {
            self.apply_rate(step, c);
        }
        if done {
            self.govern_ended(step);
        }
    }

    /// A save started (`h`): the persist governed from now on. The one before it ended (a
    /// save waits for its predecessor's persist) and is summed up.
    fn govern_started(&mut self, h: &SaveHandle) {
        // Skipped (back-pressure): the persist in flight goes on being governed.
        if h.is_skipped() {
            return;
        }
        if self.gov.as_ref().is_some_and(|g| g.tracked.is_some()) {
            self.govern_ended(h.step());
        }
        let rate = self.ckpt.persist_rate().clone();
        let Some(g) = self.gov.as_mut() else { return };
        g.tracked = Some(Tracked {
            handle: h.clone(),
            at: Instant::now(),
            released0: rate.released(),
            limited: rate.limit().is_some(),
        });
    }

    /// The governed persist ended (at `step`'s `maybe_save`): its figures, a last decision.
    fn govern_ended(&mut self, step: u64) {
        let rank = self.cfg.ckpt.rank;
        let Some(g) = self.gov.as_mut() else { return };
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
        let (summary, change) =
            g.gov
                .persist_done(bytes, (r.persist_s - r.snapshot_s).max(0.0), t.limited);
        let figures = PersistFigures {
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
            self.apply_rate(step, c);
        }
        // The rate changes of this persist, written once it ended (one write, not one per
        // change).
        if let Some(w) = self.events.as_mut()
            && w.pending() > 0
            && self.down.is_none()
            && let Err(e) = runtime().block_on(w.flush())
        {
            warn!("writing the events log: {e}");
        }
    }

    /// Put the governor's change in force and record it (a `persist_rate` event, written with
    /// the persist's end).
    fn apply_rate(&mut self, step: u64, c: Change) {
        self.ckpt.persist_rate().set(c.to);
        let budget = self.gov.as_ref().map_or(0.0, |g| g.gov.config().budget);
        info!(
            step,
            from_bps = c.from,
            to_bps = c.to,
            reason = c.reason.as_str(),
            slowdown = c.slowdown,
            budget,
            "persist rate changed"
        );
        self.append_event(Event::PersistRate(records::PersistRate {
            step,
            rank: self.cfg.ckpt.rank,
            from_bps: c.from,
            to_bps: c.to,
            reason: c.reason.as_str().to_string(),
            slowdown: c.slowdown,
            budget,
            baseline_s: c.baseline_s,
            at_floor: c.at_floor,
        }));
    }

    /// The figures of the persists the governor saw end since the last call (oldest first).
    pub fn take_persist_figures(&mut self) -> Vec<PersistFigures> {
        self.gov
            .as_mut()
            .map(|g| std::mem::take(&mut g.done))
            .unwrap_or_default()
    }

    /// The persist governor's current rate, raw bytes/s (`None`: no limit, or no governor).
    pub fn persist_rate(&self) -> Option<u64> {
        self.ckpt.persist_rate().get()
    }

    fn store_give_ups(&self) -> u64 {
        self.ckpt
            .store()
            .metrics()
            .map_or(0, |m| m.snapshot().give_ups)
    }

    /// How checkpointing fared against a failing store.
    pub fn store_health(&self) -> StoreHealth {
        StoreHealth {
            down: self.down.is_some(),
            ..self.health
        }
    }

    /// Report the saves that failed in the store since the last look (a warning and a
    /// `checkpoint_failed` event each) and take the store as down.
    fn report_failed_save(&mut self, now: u64) {
        let mut failed = Vec::new();
        self.watch.retain(|h| match h.stage() {
            Stage::Failed(f) => {
                if store_failure(f.kind) {
                    failed.push((h.step(), f.message));
                }
                false
            }
            Stage::Committed | Stage::Skipped(_) => false,
            _ => true,
        });
        for (step, message) in failed {
            self.health.failed += 1;
            warn!(
                step,
                "checkpoint failed in the store; training goes on: {message}"
            );
            self.mark_down(now);
            self.log_event(Event::CheckpointFailed(records::CheckpointFailed {
                step,
                error: message,
                ..Default::default()
            }));
        }
    }

    fn mark_down(&mut self, step: u64) {
        if self.down.is_none() {
            self.down = Some(Down {
                since_step: step,
                probe: None,
            });
        }
    }

    /// While the store is down: why this checkpoint is skipped, or `None` once a probe (one
    /// request in the background, so the loop never waits for the store's retries) found the
    /// store answering again.
    fn store_down(&mut self, step: u64) -> Option<String> {
        let down = self.down.as_mut()?;
        match down.probe.as_ref().map(|p| p.is_finished()) {
            Some(false) => {
                return Some(format!(
                    "the store is down since step {} (checking whether it is back)",
                    down.since_step
                ));
            }
            Some(true) => {
                let back = down
                    .probe
                    .take()
                    .is_some_and(|p| runtime().block_on(p).unwrap_or(false));
                if back {
                    let since = down.since_step;
                    self.down = None;
                    self.health.resumed += 1;
                    info!(step, since, "the store answers again: checkpoints resume");
                    self.log_event(Event::CheckpointsResumed(records::CheckpointsResumed {
                        step,
                        skipped: self.health.skipped,
                        down_since_step: since,
                    }));
                    return None;
                }
            }
            None => {}
        }
        let store = self.ckpt.store().clone();
        let key = store.keys().commit(&self.cfg.ckpt.run, 0);
        down.probe = Some(runtime().spawn(async move { store.exists(&key).await.is_ok() }));
        Some(format!(
            "the store is down since step {} (checking whether it is back)",
            down.since_step
        ))
    }

    fn skip_checkpoint(&mut self, step: u64, why: &str) {
        self.health.skipped += 1;
        warn!(step, "checkpoint skipped: {why}");
        self.log_event(Event::CheckpointSkipped(records::CheckpointSkipped {
            step,
            reason: why.to_string(),
            ..Default::default()
        }));
    }

    /// The boxes this rank saves under the current layout.
    pub fn save_state(&self) -> Result<SaveState> {
        let cfg = &self.cfg.ckpt;
        // The placement rules place the tensors registered with `register`; the others save
        // their held box as registered.
        let placed_idx: Vec<usize> = (0..self.tensors.len())
            .filter(|&i| self.tensors[i].saves == Saves::Placed)
            .collect();
        let specs: Vec<TensorSpec> = placed_idx
            .iter()
            .map(|&i| self.tensors[i].spec.clone())
            .collect();
        let placed = place_rank(&cfg.layout, cfg.rank, &specs)?;
        let mut by_spec: HashMap<usize, Vec<&ckpt_store::Placed>> = HashMap::new();
        for p in &placed {
            by_spec.entry(placed_idx[p.spec]).or_default().push(p);
        }
        let mut tensors = Vec::new();
        for (i, r) in self.tensors.iter().enumerate() {
            let elem = r.spec.dtype.size();
            if let Saves::Held(replica_of) = r.saves {
                let source = match replica_of {
                    None => Some(r.memory.source(&r.held, &r.held, elem)?),
                    Some(_) => None,
                };
                tensors.push(SaveTensor {
                    name: r.spec.name.clone(),
                    dtype: r.spec.dtype,
                    shape: r.spec.shape.clone(),
                    bbox: r.held.clone(),
                    placement: None,
                    source,
                    replica_of,
                });
                continue;
            }
            for p in by_spec.get(&i).map(Vec::as_slice).unwrap_or(&[]) {
                if !r.held.contains(&p.bbox) {
                    return Err(Error::invalid(format!(
                        "tensor {:?}: rank {} must save box {} under {} but holds only {}",
                        r.spec.name, cfg.rank, p.bbox, cfg.layout, r.held
                    )));
                }
                let source = match p.replica_of {
                    None => Some(r.memory.source(&r.held, &p.bbox, elem)?),
                    Some(_) => None,
                };
                tensors.push(SaveTensor {
                    name: r.spec.name.clone(),
                    dtype: r.spec.dtype,
                    shape: r.spec.shape.clone(),
                    bbox: p.bbox.clone(),
                    placement: Some(r.spec.placement.clone()),
                    source,
                    replica_of: p.replica_of,
                });
            }
        }
        let mut blobs = Vec::new();
        for (name, scope, item) in &self.stateful {
            match scope {
                Scope::Global if cfg.rank == 0 => {
                    blobs.push((format!("global/{name}"), item.lock().state_dict()))
                }
                Scope::Global => {}
                Scope::PerRank => blobs.push((format!("rank/{name}"), item.lock().state_dict())),
            }
        }
        if self.monitor.enabled() {
            let state = serde_json::to_vec(&self.monitor.state())
                .map_err(|e| Error::internal(format!("monitor state: {e}")))?;
            blobs.push((format!("rank/{MONITOR_BLOB}"), state));
        }
        Ok(SaveState { tensors, blobs })
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
        self.apply_retention();
        let t0 = Instant::now();
        let state = self.save_state()?;
        let h = self.ckpt.save(step, state)?;
        self.govern_started(&h);
        self.last_save = Instant::now();
        self.last_saved_step = Some(step);
        self.auto.last_due = Some(step);
        if self.auto_decides() {
            // The measured save may have been in flight at every `maybe_save` since it started
            // (persists slower than the interval, as on a loaded machine): if it has ended by
            // now it is measured here, before the new one replaces it (else no cost was ever
            // taken and the interval never re-evaluated). A save skipped by back-pressure
            // leaves the one in flight measured.
            let prev_ended = self
                .auto
                .tracking
                .as_ref()
                .map(|p| p.stage().persist_ended());
            if let Some(auto) = self.cfg.auto_interval.clone()
                && prev_ended == Some(true)
            {
                self.tracked_save_done(&auto, step);
            }
            if !(prev_ended == Some(false) && matches!(h.stage(), Stage::Skipped(_))) {
                self.auto.meter.save_started(t0.elapsed().as_secs_f64());
                self.auto.tracking = Some(h.clone());
            }
            self.auto.busy = true;
            if self
                .cfg
                .auto_interval
                .as_ref()
                .is_some_and(|a| !a.per_generation)
            {
                self.read_failures();
            }
        }
        Ok(h)
    }

    /// Delete old steps by the retention rules, in the background, on the committer, once the
    /// newest save committed. Never deletes the newest committed step, nor the step the next
    /// save dedups against.
    fn apply_retention(&mut self) {
        if !self.cfg.ckpt.committer
            || (self.cfg.keep_last.is_none() && self.cfg.keep_every.is_none())
        {
            return;
        }
        if self.retention.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        let Some(last) = self.ckpt.last() else { return };
        if last.stage() != Stage::Committed || self.retained_step == Some(last.step()) {
            return;
        }
        self.retained_step = Some(last.step());
        let run = self.cfg.ckpt.run.clone();
        let mut protect = vec![(run.clone(), last.step())];
        if let Some(b) = self.ckpt.dedup_base() {
            protect.push((run.clone(), b));
        }
        let opts = GcOptions {
            keep_last: self.cfg.keep_last,
            keep_every: self.cfg.keep_every,
            grace: self.cfg.retention_grace,
            dry_run: false,
            runs: vec![run],
            protect,
            sweep: true,
        };
        let store = self.ckpt.store().clone();
        self.retention = Some(runtime().spawn(async move {
            match store.gc(&opts, store.now()).await {
                Ok(r) if !r.steps_deleted.is_empty() => info!(
                    deleted = ?r.steps_deleted,
                    freed = r.bytes_freed,
                    "retention deleted old checkpoints"
                ),
                Ok(_) => {}
                Err(e) => warn!("retention failed: {e}"),
            }
        }));
    }

    /// The step a resume restores: [`ManagerConfig::resume_step`] when set (it must be
    /// committed), else the newest committed step, if any.
    pub fn resume_target(&self) -> Result<Option<u64>> {
        let store = self.ckpt.store();
        let run = &self.cfg.ckpt.run;
        match self.cfg.resume_step {
            Some(step) => {
                if !runtime().block_on(store.exists(&store.keys().commit(run, step)))? {
                    return Err(Error::not_found(format!(
                        "the resume step {step} of run {run} is not committed (CKPT_RESUME_STEP or ManagerConfig::resume_step)"
                    )));
                }
                Ok(Some(step))
            }
            None => runtime().block_on(store.latest_committed(run)),
        }
    }

    /// Restore the step to resume from ([`CheckpointManager::resume_target`]: the configured
    /// resume step, else the newest committed one), if any; returns its number.
    /// This rank's generation is joined first (see [`Checkpointer::join_generation`]), so a
    /// job resumed while an older one still runs fences the older one before it chooses.
    pub fn restore_latest(&mut self) -> Result<Option<u64>> {
        self.ckpt.join_generation()?;
        match self.resume_target()? {
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
            self.log_event(rec);
        }
        r
    }

    fn restore_inner(&mut self, step: u64) -> Result<()> {
        let t0 = Instant::now();
        let store = self.ckpt.store().clone();
        let cfg = self.cfg.ckpt.clone();
        let cache = shared_restore_cache(self.cfg.restore_budget);
        let mut reader = runtime()
            // Only the record's parts that hold this rank's tensors (format 5): the metadata a
            // rank reads does not grow with the world.
            .block_on(StepReader::open_tensors(
                &store,
                &cfg.run,
                step,
                self.tensors.iter().map(|r| r.spec.name.clone()),
            ))?
            .with_cache(cache.clone());
        if let Some(dir) = &self.cfg.node_cache {
            match ckpt_store::NodeCache::open(dir) {
                Ok(n) => reader = reader.with_node_cache(Arc::new(n)),
                Err(e) => warn!("restoring without the node's shared cache: {e}"),
            }
        }
        // Replica agents first (memory of the surviving nodes), the store for the rest.
        if let Some(link) = cfg.peer.as_ref().filter(|l| !l.peers.is_empty()) {
            reader = reader.with_source(PeerSource::new(&link.peers, &link.secret));
        }
        let mut targets = Vec::with_capacity(self.tensors.len());
        for r in &self.tensors {
            let elem = r.spec.dtype.size();
            targets.push(RestoreTarget {
                name: r.spec.name.clone(),
                dtype: r.spec.dtype,
                shape: r.spec.shape.clone(),
                bbox: r.held.clone(),
                sink: r.memory.sink(&r.held, elem)?,
            });
        }
        let stats =
            runtime().block_on(restore_targets(&reader, &targets, self.cfg.restore_budget))?;
        let same_layout = reader.commit().layout == cfg.layout;
        for (name, scope, item) in &self.stateful {
            let (rank, blob) = match scope {
                Scope::Global => (0, format!("global/{name}")),
                Scope::PerRank if same_layout => (cfg.rank, format!("rank/{name}")),
                Scope::PerRank => {
                    warn!(
                        name,
                        "per-rank state not restored: the job was resharded from {} to {}",
                        reader.commit().layout,
                        cfg.layout
                    );
                    continue;
                }
            };
            let bytes = runtime().block_on(reader.read_blob(rank, &blob))?;
            item.lock().load_state_dict(&bytes).map_err(|e| {
                e.context(format!(
                    "restoring {name:?} from step {step} of run {}",
                    cfg.run
                ))
            })?;
        }
        if self.monitor.enabled() {
            self.restore_monitor(&reader, same_layout)?;
        }
        if same_layout {
            let m = runtime().block_on(reader.manifest(cfg.rank))?;
            self.ckpt.seed_dedup(&m);
        }
        self.last_saved_step = Some(step);
        self.auto.last_due = Some(step);
        self.auto.anchor = Some(step);
        // The restore's time is not a step; a save measured before it is abandoned.
        self.auto.last_tick = None;
        self.auto.tracking = None;
        self.auto.busy = false;
        self.auto.meter.save_done();
        if let Some(g) = self.gov.as_mut() {
            g.last_exit = None;
            g.tracked = None;
        }
        let (hits, misses) = cache.counts();
        let seconds = t0.elapsed().as_secs_f64();
        self.log_event(Event::Restore(records::Restore {
            step,
            rank: cfg.rank,
            generation: cfg.generation,
            from_layout: reader.commit().layout.to_string(),
            to_layout: cfg.layout.to_string(),
            bytes: stats.bytes_copied,
            bytes_from_peers: stats.source_bytes,
            bytes_from_store: stats.stored_bytes,
            bytes_from_node: stats.node_bytes,
            seconds,
        }));
        info!(
            step,
            bytes = stats.bytes_copied,
            from_peers = stats.source_bytes,
            from_store = stats.stored_bytes,
            from_node = stats.node_bytes,
            chunks = stats.chunks,
            cache_hits = hits,
            cache_misses = misses,
            seconds,
            from = %reader.commit().layout,
            to = %cfg.layout,
            "restored"
        );
        Ok(())
    }

    /// The monitor's window and history from `reader`: this rank's when the layout is the same,
    /// rank 0's otherwise; a fresh window (a new warm-up) when the step has none.
    fn restore_monitor(&mut self, reader: &StepReader, same_layout: bool) -> Result<()> {
        let blob = format!("rank/{MONITOR_BLOB}");
        let rank = if same_layout { self.cfg.ckpt.rank } else { 0 };
        let m = runtime().block_on(reader.manifest(rank))?;
        if !m.blobs.iter().any(|b| b.name == blob) {
            info!(
                step = reader.commit().step,
                "the checkpoint has no monitor state: the spike monitor warms up again"
            );
            self.monitor.reset_window();
            return Ok(());
        }
        let bytes = runtime().block_on(reader.read_blob(rank, &blob))?;
        let state: MonitorState = serde_json::from_slice(&bytes).map_err(|e| {
            Error::corrupt(format!(
                "monitor state of rank {rank} at step {} of run {}: {e}",
                reader.commit().step,
                self.cfg.ckpt.run
            ))
        })?;
        self.monitor.load_state(state);
        Ok(())
    }

    /// The spike monitor.
    pub fn monitor(&self) -> &Monitor {
        &self.monitor
    }

    /// Report a step's loss (and batch, gradient norm) to the monitor and get what to do. A
    /// spike is logged (a tracing warning and a `spike` record in the run's events log), and a
    /// stop also gets a `stop` record with the rollback history. Call it before saving the
    /// step: a spike's state must not be checkpointed. Does nothing with the action `off`.
    pub fn observe(&mut self, o: &Observation) -> Decision {
        let d = self.monitor.observe(o);
        let (spike, action) = match &d {
            Decision::Continue => return d,
            Decision::Alert(s) => (s, "alert"),
            Decision::Rollback(s) => (s, "rollback"),
            Decision::Stop(st) => (&st.spike, "stop"),
        };
        self.decided = Some(spike.step);
        warn!(
            run = %self.cfg.ckpt.run,
            step = spike.step,
            batch = ?spike.batch,
            loss = spike.loss,
            action,
            "{spike}"
        );
        self.log_event(Event::Spike(records::Spike {
            step: spike.step,
            batch: spike.batch,
            what: spike.kind.as_str().to_string(),
            loss: finite(spike.loss),
            grad_norm: spike.grad_norm.and_then(finite),
            threshold: spike.threshold,
            median: spike.median,
            action: action.to_string(),
            rank: o.partial_of_rank,
        }));
        if let Decision::Stop(st) = &d {
            warn!(run = %self.cfg.ckpt.run, "{st}");
            self.log_stop(st.spike.step, &st.reason, &st.history);
        }
        d
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
        if let Some(h) = self.ckpt.last() {
            self.settle(&h);
        }
        let store = self.ckpt.store().clone();
        let run = self.cfg.ckpt.run.clone();
        let target = runtime()
            .block_on(store.list_steps(&run))?
            .into_iter()
            .filter(|s| s.committed && s.step < spike.step)
            .map(|s| s.step)
            .max();
        let logs = self.decided == Some(spike.step);
        let Some(to) = target else {
            let reason = StopReason::NoCheckpoint;
            let history = self.monitor.history().to_vec();
            if logs {
                self.log_stop(spike.step, &reason, &history);
            }
            let Decision::Stop(st) = self.monitor.stop(*spike, reason) else {
                unreachable!("stop() makes a stop")
            };
            return Err(Error::not_found(format!("run {run}: {st}")));
        };
        let history = self.monitor.history().to_vec();
        self.restore(to)?;
        let mut monitor_state = self.monitor.state();
        monitor_state.rollbacks = history;
        self.monitor.load_state(monitor_state);
        let skipped = skip_data(to);
        let entry = RollbackEntry {
            from_step: spike.step,
            to_step: to,
            reason: spike.reason(),
            skipped,
        };
        self.monitor.record_rollback(entry.clone());
        let count = self.monitor.history().len();
        info!(
            to_step = to,
            ?skipped,
            count,
            "rolled back to the newest checkpoint before the spike"
        );
        if logs {
            self.log_event(Event::Rollback(records::Rollback {
                from_step: entry.from_step,
                to_step: to,
                reason: entry.reason.clone(),
                skipped,
                count: count as u64,
                max: self.cfg.monitor.max_rollbacks as u64,
            }));
        }
        Ok(Rollback {
            from_step: spike.step,
            to_step: to,
            skipped,
            count,
        })
    }

    /// Wait until `h` committed, failed or was skipped (or the commit timeout passed).
    /// `SaveHandle::wait_committed` would keep polling for the commit record after a commit
    /// that failed once the rank had persisted (a fenced committer), until the timeout; a
    /// rollback must not sit out ten minutes for a step it will not use.
    fn settle(&self, h: &SaveHandle) {
        let key = self.store().keys().commit(&self.cfg.ckpt.run, h.step());
        let t0 = Instant::now();
        let mut pause = Duration::from_millis(10);
        loop {
            let why = match h.stage() {
                Stage::Committed => return,
                Stage::Failed(e) => e.message,
                Stage::Skipped(e) => e,
                Stage::Snapshotting | Stage::Snapshotted => match h.wait_persisted() {
                    Ok(_) => continue,
                    Err(e) => e.to_string(),
                },
                Stage::Persisted => match runtime().block_on(self.store().exists(&key)) {
                    Ok(true) => return,
                    Ok(false) if t0.elapsed() < self.cfg.ckpt.commit_timeout => {
                        std::thread::sleep(pause);
                        pause = (pause * 2).min(Duration::from_millis(200));
                        continue;
                    }
                    Ok(false) => format!("not committed within {:?}", self.cfg.ckpt.commit_timeout),
                    Err(e) => e.to_string(),
                },
            };
            warn!(
                step = h.step(),
                "rolling back past a checkpoint that did not commit: {why}"
            );
            return;
        }
    }

    fn log_stop(&mut self, step: u64, reason: &StopReason, history: &[RollbackEntry]) {
        self.log_event(Event::Stop(records::Stop {
            step,
            reason: reason.to_string(),
            why: Some(reason.clone()),
            rollbacks: history.to_vec(),
        }));
    }

    /// Append a record to the run's events log and write it out at once (events are rare and
    /// should be readable while the run goes on). Failures are warnings: a log must not stop
    /// training.
    fn log_event(&mut self, rec: Event) {
        if !self.append_event(rec) {
            return;
        }
        // While the store is down the record waits in the writer (the loop must not wait for
        // the store's retries); the first record after it came back writes them all.
        if self.down.is_some() {
            return;
        }
        if let Some(w) = self.events.as_mut()
            && let Err(e) = runtime().block_on(w.flush())
        {
            warn!("writing the events log: {e}");
        }
    }

    /// Append a record to the run's events log without writing it out yet; whether it was
    /// appended.
    fn append_event(&mut self, rec: Event) -> bool {
        if self.events.is_none() {
            let name = format!("monitor-rank-{}", self.cfg.ckpt.rank);
            match LogWriter::new(self.ckpt.store(), &self.cfg.ckpt.run, EVENTS, &name) {
                Ok(w) => self.events = Some(w),
                Err(e) => {
                    warn!("opening the events log: {e}");
                    return false;
                }
            }
        }
        let Some(w) = self.events.as_mut() else {
            return false;
        };
        if let Err(e) = w.append(&rec) {
            warn!("events log record: {e}");
            return false;
        }
        true
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
    /// figures are then ready ([`CheckpointManager::take_persist_figures`]).
    pub fn finish(&mut self) -> Result<()> {
        if let Some(h) = self.ckpt.last() {
            // At full speed (the handle's waits lift the governor's limit).
            let within = self.final_wait();
            if self.cfg.ckpt.committer {
                h.wait_committed(within)?;
            } else {
                h.wait_persisted_within(within)?;
            }
            let step = h.step();
            self.govern_ended(step);
        }
        if let Some(r) = self.retention.take() {
            let _ = runtime().block_on(r);
        }
        // Events that waited while the store was down.
        if let Some(w) = self.events.as_mut()
            && w.pending() > 0
            && let Err(e) = runtime().block_on(w.flush())
        {
            warn!("writing the events log: {e}");
        }
        Ok(())
    }
}

/// On SIGTERM set `flag` (a training loop that owns its own signal handling, such as
/// `ckpt-train` with its ranks as threads, installs it); on a SIGTERM that finds `flag` already set, say so on stderr and
/// end the process at once with status 143 (128 + SIGTERM): the first asks for a final
/// checkpoint, the second means "now", whatever that checkpoint is waiting for.
pub fn on_sigterm(flag: &Arc<AtomicBool>) -> Result<()> {
    let f = flag.clone();
    let action = move || {
        if f.swap(true, Ordering::SeqCst) {
            const MSG: &[u8] =
                b"ckpt: second SIGTERM: exiting without waiting for the final checkpoint\n";
            // SAFETY: write(2) and _exit(2) are async-signal-safe.
            unsafe {
                libc::write(2, MSG.as_ptr().cast(), MSG.len());
                libc::_exit(143);
            }
        }
    };
    // SAFETY: the action only does async-signal-safe things (an atomic swap, write, _exit).
    unsafe { signal_hook::low_level::register(signal_hook::consts::SIGTERM, action) }
        .map(|_| ())
        .map_err(|e| Error::internal(format!("installing the SIGTERM handler: {e}")))
}

/// `x` if finite (JSON has no NaN), else `None`.
fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}
