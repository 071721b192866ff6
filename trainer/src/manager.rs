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

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ckpt_store::placement::place_rank;
use ckpt_store::{Error, GcOptions, NdBox, Result, StepReader, Store, TensorSpec};
use parking_lot::Mutex;
use tracing::{info, warn};

use crate::memory::{HostTensor, HostView, MemorySink, MemorySource};
use crate::restore::{RestoreTarget, restore_targets};
use crate::save::{
    Checkpointer, CheckpointerConfig, SaveHandle, SaveState, SaveTensor, Stage, runtime,
};

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
    /// Keep the newest N committed steps.
    pub keep_last: Option<usize>,
    /// Keep steps that are multiples of K.
    pub keep_every: Option<u64>,
    /// Objects younger than this are never deleted by retention's sweep.
    pub retention_grace: Duration,
    /// Save a final checkpoint when SIGTERM arrives (preemption).
    pub final_on_sigterm: bool,
    /// Bytes in flight during a restore.
    pub restore_budget: usize,
}

impl ManagerConfig {
    /// Defaults around a checkpointer config.
    pub fn new(ckpt: CheckpointerConfig) -> Self {
        ManagerConfig {
            ckpt,
            every_steps: None,
            every: None,
            keep_last: None,
            keep_every: None,
            retention_grace: Duration::from_secs(3600),
            final_on_sigterm: true,
            restore_budget: 256 << 20,
        }
    }
}

type StatefulItem = (String, Scope, Arc<Mutex<dyn Stateful>>);

struct Registered {
    spec: TensorSpec,
    held: NdBox,
    memory: Arc<dyn TensorMemory>,
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
    stop: bool,
    retention: Option<tokio::task::JoinHandle<()>>,
    retained_step: Option<u64>,
}

impl std::fmt::Debug for CheckpointManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CheckpointManager({:?})", self.ckpt)
    }
}

impl CheckpointManager {
    /// A manager for one rank.
    pub fn new(store: Store, cfg: ManagerConfig) -> Result<Self> {
        let ckpt = Checkpointer::new(store, cfg.ckpt.clone())?;
        let sigterm = Arc::new(AtomicBool::new(false));
        if cfg.final_on_sigterm {
            signal_hook::flag::register(signal_hook::consts::SIGTERM, sigterm.clone())
                .map_err(|e| Error::internal(format!("installing the SIGTERM handler: {e}")))?;
        }
        Ok(CheckpointManager {
            ckpt,
            cfg,
            tensors: Vec::new(),
            stateful: Vec::new(),
            last_save: Instant::now(),
            last_saved_step: None,
            sigterm,
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
        self.tensors.push(Registered { spec, held, memory });
        Ok(())
    }

    /// Register non-tensor state.
    pub fn register_stateful(
        &mut self,
        name: &str,
        scope: Scope,
        item: Arc<Mutex<dyn Stateful>>,
    ) -> Result<()> {
        ckpt_store::model::validate_name(name)?;
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

    /// Whether SIGTERM has arrived.
    pub fn sigterm_received(&self) -> bool {
        self.sigterm.load(Ordering::SeqCst)
    }

    /// Save if the interval policy says so, or a final checkpoint if SIGTERM arrived (then
    /// wait for it and make [`CheckpointManager::should_stop`] true).
    pub fn maybe_save(&mut self, step: u64) -> Result<Option<SaveHandle>> {
        if self.cfg.final_on_sigterm && self.sigterm.load(Ordering::SeqCst) && !self.stop {
            info!(step, "SIGTERM: taking a final checkpoint");
            let h = self.save_now(step)?;
            self.stop = true;
            h.wait_committed(self.cfg.ckpt.commit_timeout)?;
            return Ok(Some(h));
        }
        let due_steps = self
            .cfg
            .every_steps
            .is_some_and(|n| n > 0 && step.is_multiple_of(n));
        let due_time = self
            .cfg
            .every
            .is_some_and(|d| self.last_save.elapsed() >= d);
        if (due_steps || due_time) && self.last_saved_step != Some(step) {
            return self.save_now(step).map(Some);
        }
        Ok(None)
    }

    /// The boxes this rank saves under the current layout.
    pub fn save_state(&self) -> Result<SaveState> {
        let cfg = &self.cfg.ckpt;
        let specs: Vec<TensorSpec> = self.tensors.iter().map(|t| t.spec.clone()).collect();
        let placed = place_rank(&cfg.layout, cfg.rank, &specs)?;
        let mut by_spec: HashMap<usize, Vec<&ckpt_store::Placed>> = HashMap::new();
        for p in &placed {
            by_spec.entry(p.spec).or_default().push(p);
        }
        let mut tensors = Vec::new();
        for (i, r) in self.tensors.iter().enumerate() {
            let elem = r.spec.dtype.size();
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
        Ok(SaveState { tensors, blobs })
    }

    /// Save `step` now.
    pub fn save_now(&mut self, step: u64) -> Result<SaveHandle> {
        self.apply_retention();
        let state = self.save_state()?;
        let h = self.ckpt.save(step, state)?;
        self.last_save = Instant::now();
        self.last_saved_step = Some(step);
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
            match store.gc(&opts, chrono::Utc::now()).await {
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

    /// Restore the newest committed step, if any; returns its number.
    pub fn restore_latest(&mut self) -> Result<Option<u64>> {
        let store = self.ckpt.store().clone();
        let run = self.cfg.ckpt.run.clone();
        match runtime().block_on(store.latest_committed(&run))? {
            None => Ok(None),
            Some(step) => self.restore(step).map(|_| Some(step)),
        }
    }

    /// Restore `step` onto the held boxes of every registered tensor and the stateful items,
    /// whatever layout saved it.
    pub fn restore(&mut self, step: u64) -> Result<()> {
        let t0 = Instant::now();
        let store = self.ckpt.store().clone();
        let cfg = self.cfg.ckpt.clone();
        let reader = runtime().block_on(StepReader::open(&store, &cfg.run, step))?;
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
        if same_layout {
            let m = runtime().block_on(reader.manifest(cfg.rank))?;
            let refs = m
                .tensors
                .iter()
                .flat_map(|t| t.chunks.iter().cloned())
                .collect();
            self.ckpt.seed_dedup(step, refs);
        }
        self.last_saved_step = Some(step);
        info!(
            step,
            bytes = stats.bytes_copied,
            chunks = stats.chunks,
            seconds = t0.elapsed().as_secs_f64(),
            from = %reader.commit().layout,
            to = %cfg.layout,
            "restored"
        );
        Ok(())
    }

    /// Wait for the save in flight to commit (or fail), and for retention.
    pub fn finish(&mut self) -> Result<()> {
        if let Some(h) = self.ckpt.last() {
            if self.cfg.ckpt.committer {
                h.wait_committed(self.cfg.ckpt.commit_timeout)?;
            } else {
                h.wait_persisted()?;
            }
        }
        if let Some(r) = self.retention.take() {
            let _ = runtime().block_on(r);
        }
        Ok(())
    }
}
