//! [`Checkpointer`]: one rank's saves. `save` runs in named steps: back-pressure, the plan
//! (check and pin), staging, the snapshot thread, the persist task.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use bytes::Bytes;
use ckpt_store::{DedupBase, Error, ErrorKind, Result, Store};
use parking_lot::Mutex;
use tracing::warn;

use super::config::{BackPressure, CheckpointerConfig};
use super::handle::{SaveFailure, SaveHandle, SaveReport, Shared, Stage};
use super::persist::{PersistJob, note_fenced};
use super::rate::PersistRate;
use super::runtime::runtime;
use super::snapshot::{Pin, dma_share, slabs_needed, snapshot};
use super::state::{ReplicaCheck, SavePlan, SaveState};
use super::versions::{StepVersions, VersionBook};
use crate::staging::{PoolConfig, PoolStats, StagingPool};

/// Saves one rank's state (see the module docs).
pub struct Checkpointer {
    store: Store,
    cfg: CheckpointerConfig,
    pool: Arc<StagingPool>,
    last: Mutex<Option<SaveHandle>>,
    dedup: Arc<Mutex<DedupBase>>,
    /// The versions of the shards of the last saves: which shards the next save reuses.
    versions: Arc<Mutex<VersionBook>>,
    /// Names this checkpointer's dedup leases in the store.
    writer: String,
    /// Set once this rank's generation has been joined in the store (marker written, no
    /// newer generation seen).
    joined: AtomicBool,
    /// Why a newer generation fenced this writer out, once one did: every later save is
    /// refused at once.
    fenced: Arc<Mutex<Option<String>>>,
    /// The rate limit every persist of this checkpointer obeys (the governor sets it).
    rate: Arc<PersistRate>,
}

impl std::fmt::Debug for Checkpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checkpointer({} rank {})", self.cfg.run, self.cfg.rank)
    }
}
impl Checkpointer {
    /// A checkpointer for one rank.
    pub fn new(store: Store, cfg: CheckpointerConfig) -> Result<Self> {
        ckpt_store::validate_run(&cfg.run)?;
        cfg.layout.validate()?;
        if cfg.rank >= cfg.layout.world() {
            return Err(Error::invalid(format!(
                "rank {} is outside the layout {} ({} ranks)",
                cfg.rank,
                cfg.layout,
                cfg.layout.world()
            )));
        }
        let slab = store.config().chunk_size;
        let pool = match &cfg.pool {
            Some(p) if p.slab_size() != slab => {
                return Err(Error::invalid(format!(
                    "the shared staging pool has slabs of {} bytes but the store's chunks are {slab} bytes",
                    p.slab_size()
                )));
            }
            Some(p) => p.clone(),
            None => StagingPool::new(
                PoolConfig {
                    capacity: cfg.staging_bytes.max(slab),
                    slab,
                },
                cfg.prefault && cfg.staging_bytes > 0,
            ),
        };
        // A shared pool is its owner's to fill; an automatic bound is known only once the
        // state is (`prepare_staging`).
        if cfg.pool.is_none() && cfg.staging_bytes > 0 && !cfg.prefault && cfg.background_prefault {
            pool.prefault_in_background();
        }
        let writer = ckpt_store::writer_id(cfg.rank, cfg.generation);
        Ok(Checkpointer {
            store,
            cfg,
            pool,
            last: Mutex::new(None),
            dedup: Arc::default(),
            versions: Arc::default(),
            writer,
            joined: AtomicBool::new(false),
            fenced: Arc::default(),
            rate: PersistRate::new(),
        })
    }

    /// Join this rank's generation in the store, once: mark it started unless someone did,
    /// and check that no newer generation has started. A job that resumes a run thereby fences
    /// every older writer of it before its own first save; a newer generation found here
    /// fences this one ([`ErrorKind::Fenced`]).
    pub fn join_generation(&self) -> Result<()> {
        self.check_fenced()?;
        if self.joined.load(Ordering::SeqCst) {
            return Ok(());
        }
        let r = runtime().block_on(self.store.log().join_generation_as(
            &self.cfg.run,
            self.cfg.generation,
            self.cfg.rank,
        ));
        match r {
            Ok(()) => {
                self.joined.store(true, Ordering::SeqCst);
                Ok(())
            }
            Err(e) => {
                note_fenced(&self.fenced, &e);
                Err(e)
            }
        }
    }

    /// Take this rank's generation as joined: the caller joined it for every rank of the
    /// process at once (see `ckpt-train`). A newer generation is then found by the saves.
    pub fn assume_joined(&self) {
        self.joined.store(true, Ordering::SeqCst);
    }

    /// The error that fenced this writer out, if a newer generation did.
    pub fn fenced(&self) -> Option<Error> {
        self.fenced
            .lock()
            .as_ref()
            .map(|m| Error::new(ErrorKind::Fenced, m.clone()))
    }

    fn check_fenced(&self) -> Result<()> {
        match self.fenced() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The settings.
    pub fn config(&self) -> &CheckpointerConfig {
        &self.cfg
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Staging figures.
    pub fn staging(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Free the staging memory no save holds (its own pool only: a shared pool is its
    /// owner's); the next save allocates it again. Returns the bytes freed.
    pub fn release_staging(&self) -> usize {
        if self.cfg.pool.is_some() {
            return 0;
        }
        self.pool.release_free()
    }

    /// The newest committed step this rank's next save dedups against.
    pub fn dedup_base(&self) -> Option<u64> {
        self.dedup.lock().base_step()
    }

    /// The rate limit of this checkpointer's persists (none by default; the
    /// [`CheckpointManager`](crate::CheckpointManager)'s persist governor sets it).
    pub fn persist_rate(&self) -> &Arc<PersistRate> {
        &self.rate
    }

    /// The save in flight, if any.
    pub fn last(&self) -> Option<SaveHandle> {
        self.last.lock().clone()
    }

    /// Size the staging pool for snapshots of `state` (when the bound is automatic) and, with
    /// `prefault`, allocate and touch it now, so the first save does not pay for fresh memory
    /// (without it, and with `background_prefault`, on a background thread).
    pub fn prepare_staging(&self, state: &SaveState, prefault: bool) {
        self.size_staging(&state.most_copied(self.cfg.sdc_check, self.store.config().chunk_size));
        if prefault {
            self.pool.prefault();
        } else if self.cfg.background_prefault {
            self.pool.prefault_in_background();
        }
    }

    /// The restored step `m.step` (committed) is this rank's dedup and delta base.
    pub(crate) fn seed_dedup(&self, m: &ckpt_store::RankManifest) {
        self.dedup.lock().seed_manifest(m);
    }

    /// Save `state` as `step` (see the module docs). Returns once every tensor is pinned and
    /// the copy has started.
    pub fn save(&self, step: u64, state: SaveState) -> Result<SaveHandle> {
        // A fenced writer stops: no retry of a save can succeed once a newer job owns the run.
        self.join_generation()?;
        let mut last = self.last.lock();
        if let Some(skipped) = self.back_pressure(last.as_ref(), step) {
            return Ok(skipped);
        }
        let t0 = Instant::now();
        let base = self.reuse_base();
        let check = ReplicaCheck {
            check: self.cfg.sdc_check,
            step,
            chunk_size: self.store.config().chunk_size,
        };
        let plan = SavePlan::pin(state, base.as_deref(), check)?;
        let (dma_bytes, pinned_bytes) = dma_share(&plan.pins);
        let overlap = self.cfg.snapshot_overlap.overlaps(dma_bytes, pinned_bytes);
        let shared = Shared::new(
            step,
            Stage::Snapshotting,
            SaveReport {
                step,
                bytes: plan.bytes + plan.reused,
                bytes_reused: plan.reused,
                bytes_checked: plan.checked,
                overlapped: overlap,
                ..Default::default()
            },
        );
        let handle = self.handle(shared.clone());
        *last = Some(handle.clone());
        drop(last);
        self.pool.reset_peak();
        let fits = self.size_staging(&plan.lens());
        tracing::debug!(
            step,
            fits,
            capacity = self.pool.stats().capacity,
            in_use = self.pool.stats().in_use,
            shards = plan.lens().len(),
            bytes = plan.bytes,
            dma_bytes,
            overlap,
            "snapshot planned"
        );
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Result<Bytes>>();
        // Without overlap the persist starts when the snapshot is done or as soon as the
        // snapshot has to wait for staging space (the pool is smaller than the snapshot,
        // shared, or still holds chunks of a previous save): only the persist frees slabs, so a
        // snapshot never waits on a persist that waits for it. Until then a copy out of host
        // memory has every core to itself: a persist started with it (hashing beside it)
        // doubled the stall on 2 cores, and a pool much smaller than the snapshot only gains
        // the copy time of one pool's worth by starting earlier. A copy out of GPU memory is a
        // DMA, and the persist takes each chunk as it lands (`SnapshotOverlap::Auto`).
        let (snap_done_tx, snap_done_rx) = tokio::sync::oneshot::channel::<()>();
        let names: Vec<String> = plan.metas.iter().map(|m| m.shard.name.clone()).collect();
        self.start_snapshot(step, t0, plan.pins, names, &shared, tx, snap_done_tx)?;
        let job = PersistJob {
            store: self.store.clone(),
            cfg: self.cfg.clone(),
            dedup: self.dedup.clone(),
            versions: self.versions.clone(),
            shard_versions: plan.versions,
            reuse_from: plan.reuse_from,
            writer: self.writer.clone(),
            pool: self.pool.clone(),
            fenced: self.fenced.clone(),
            shared,
            step,
            t0,
            metas: plan.metas,
            blobs: plan.blobs,
            rx,
            start_after: (!overlap).then_some(snap_done_rx),
            rate: self.rate.clone(),
        };
        runtime().spawn(job.run());
        Ok(handle)
    }

    /// The committed step whose chunks unchanged shards of this save may reference: the last
    /// persisted save once its commit record is seen, else the committed step before, while
    /// its record exists. None when nothing is known committed. With a replica agent the
    /// unchanged shards' chunks are named to it, not sent: it holds them from the snapshot
    /// before (and says when it does not: the next save then copies every shard).
    fn reuse_base(&self) -> Option<Arc<StepVersions>> {
        let (pending, committed) = {
            let b = self.versions.lock();
            (b.pending_step(), b.committed_step())
        };
        // Asked of the store even when this rank committed the step: retention or `ckpt gc`
        // may have dropped it since (one head request per save).
        let is_committed = |step: u64| {
            let key = self.store.keys().commit(&self.cfg.run, step);
            runtime()
                .block_on(self.store.objects().exists(&key))
                .unwrap_or(false)
        };
        let mut book = self.versions.lock();
        match (pending, committed) {
            (Some(p), _) if is_committed(p) => book.commit_seen(),
            (_, Some(c)) if !is_committed(c) => book.committed_gone(),
            _ => {}
        }
        book.base()
    }

    /// A handle on the save `shared`.
    fn handle(&self, shared: Arc<Shared>) -> SaveHandle {
        SaveHandle {
            shared,
            store: self.store.clone(),
            run: self.cfg.run.clone(),
            committer: self.cfg.committer,
            rate: self.rate.clone(),
        }
    }

    /// The previous save `prev` is still snapshotting or persisting: wait for its persist
    /// ([`BackPressure::Wait`]; its failure is only logged) and return `None`, or return the
    /// handle of `step` skipped ([`BackPressure::Skip`]).
    fn back_pressure(&self, prev: Option<&SaveHandle>, step: u64) -> Option<SaveHandle> {
        let prev = prev?;
        if !matches!(prev.stage(), Stage::Snapshotting | Stage::Snapshotted) {
            return None;
        }
        match self.cfg.back_pressure {
            BackPressure::Wait => {
                if let Err(e) = prev.wait_persisted() {
                    warn!(step = prev.step(), "previous checkpoint failed: {e}");
                }
                None
            }
            BackPressure::Skip => {
                let why = format!(
                    "the checkpoint of step {} is still being persisted (policy: skip)",
                    prev.step()
                );
                warn!(step, "skipping checkpoint: {why}");
                Some(self.handle(Shared::new(
                    step,
                    Stage::Skipped(why),
                    SaveReport {
                        step,
                        ..Default::default()
                    },
                )))
            }
        }
    }

    /// Grow an automatic pool to what shards of `lens` bytes need, and say whether the whole
    /// snapshot fits the pool (a figure for the log: the persist starts when the copy is done
    /// or first waits for staging either way, see [`Checkpointer::save`]).
    fn size_staging(&self, lens: &[usize]) -> bool {
        let slab = self.pool.slab_size();
        if self.cfg.staging_bytes == 0 && self.cfg.pool.is_none() {
            let per_batch = (self.cfg.copy_threads.max(1) * 4).max(1);
            self.pool
                .ensure_capacity(slabs_needed(lens, slab, per_batch) * slab);
        }
        let cap_slabs = (self.pool.stats().capacity / slab).max(1);
        let per_batch = (self.cfg.copy_threads.max(1) * 4).clamp(1, cap_slabs);
        slabs_needed(lens, slab, per_batch) <= cap_slabs
    }

    /// Start the snapshot thread: copy `pins` into staging, sending chunks to `tx`, firing
    /// `snap_done` when done or when it must wait for staging; the stage becomes
    /// `Snapshotted`, or `Failed` naming the tensor (`names` by shard index).
    #[allow(clippy::too_many_arguments)]
    fn start_snapshot(
        &self,
        step: u64,
        t0: Instant,
        pins: Vec<Pin>,
        names: Vec<String>,
        shared: &Arc<Shared>,
        tx: tokio::sync::mpsc::UnboundedSender<Result<Bytes>>,
        snap_done: tokio::sync::oneshot::Sender<()>,
    ) -> Result<()> {
        let pool = self.pool.clone();
        let threads = self.cfg.copy_threads.max(1);
        let shared = shared.clone();
        let stall = self.cfg.stall_timeout;
        let rank = self.cfg.rank;
        std::thread::Builder::new()
            .name(format!("ckpt-snapshot-{}", self.cfg.rank))
            .spawn(move || {
                let mut go = Some(snap_done);
                let waits = shared.clone();
                let start_persist = move || {
                    waits.note_staging_wait();
                    if let Some(t) = go.take() {
                        let _ = t.send(());
                    }
                };
                match snapshot(&pool, pins, threads, stall, start_persist, &tx) {
                    Ok(()) => {
                        let s = t0.elapsed().as_secs_f64();
                        shared.set(Stage::Snapshotted, |r| r.snapshot_s = s);
                    }
                    Err((i, e)) => {
                        let e = e.context(format!(
                            "snapshot of tensor {:?} (step {step}, rank {rank})",
                            names[i]
                        ));
                        let _ = tx.send(Err(Error::new(e.kind(), e.to_string())));
                        shared.set(Stage::Failed(SaveFailure::from(&e)), |_| {});
                    }
                }
            })
            .map_err(|e| Error::internal(format!("starting the snapshot thread: {e}")))?;
        Ok(())
    }
}
