//! The save pipeline: snapshot -> persist -> commit.
//!
//! [`Checkpointer::save`] pins every tensor (see [`crate::memory`]), starts the snapshot on a
//! background thread and returns a [`SaveHandle`] at once. The snapshot copies each shard into
//! staging slabs with several threads and hands every filled chunk to the persist task, which
//! streams them into the store ([`ckpt_store::Store::write_rank_stream`]) while the copy goes
//! on, then writes the rank manifest. The committer (rank 0 by default) waits for every rank's
//! manifest and creates the commit record.
//!
//! The training loop only has to wait for the snapshot before it mutates tensors; with host
//! tensors even that is automatic (a write waits for the copy of that tensor).

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ckpt_recovery::peer::{PeerLink, PeerUpload};
use ckpt_store::{
    BlobIn, ChunkRef, DType, DedupBase, DedupIndex, Error, ErrorKind, Layout, NdBox, Placement,
    RankWrite, Result, ShardMeta, Store, WriterLease,
};
use parking_lot::{Condvar, Mutex};
use serde::Serialize;
use tracing::{debug, info, warn};

use crate::memory::{MemorySource, PinnedSource};
use crate::staging::{PoolConfig, PoolStats, StagingPool};

/// The process-wide runtime that runs persists and restores.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(32)
            .thread_name("ckpt-io")
            .on_thread_start(lower_io_priority)
            .enable_all()
            .build()
            .expect("tokio runtime")
    })
}

/// The nice value of the persist threads; see [`set_io_nice`].
static IO_NICE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(10);

/// Persisting runs at a lower CPU priority (nice 10 by default) than training: where the
/// training loop itself runs on the CPU, a background persist then slows its steps little and
/// takes the cores the loop leaves idle. (The snapshot copy threads keep normal priority: the
/// loop may be waiting for them.) Set before the first save: the persist threads take it when
/// they start (`ckpt-train --io-nice`, `CKPT_IO_NICE`).
pub fn set_io_nice(nice: i32) {
    IO_NICE.store(nice, std::sync::atomic::Ordering::Relaxed);
}

fn lower_io_priority() {
    let nice = IO_NICE.load(std::sync::atomic::Ordering::Relaxed);
    if nice != 0 {
        // SAFETY: plain libc calls on the calling thread.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, nice);
        }
    }
}

/// What to do when a save is asked for while the previous one is still persisting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackPressure {
    /// Wait for the previous save to be persisted, then snapshot.
    Wait,
    /// Skip this save (logged with the reason).
    Skip,
}

/// One shard to save.
#[derive(Clone)]
pub struct SaveTensor {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The box saved.
    pub bbox: NdBox,
    /// How the tensor is placed (recorded so other layouts can be planned).
    pub placement: Option<Placement>,
    /// The memory holding exactly the box's row-major bytes; `None` for a replica.
    pub source: Option<Arc<dyn MemorySource>>,
    /// For a replica: the rank that writes it.
    pub replica_of: Option<u32>,
}

impl SaveTensor {
    /// A whole one-dimensional tensor of `n` bytes (`u8` elements) held in `t`, written by
    /// this rank: raw state such as a data position or a test's payload.
    pub fn bytes(name: &str, t: &crate::memory::HostTensor, n: u64) -> SaveTensor {
        SaveTensor {
            name: name.into(),
            dtype: DType::U8,
            shape: vec![n],
            bbox: NdBox::full(&[n]),
            placement: None,
            source: Some(Arc::new(t.clone())),
            replica_of: None,
        }
    }
}

impl std::fmt::Debug for SaveTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SaveTensor({} {})", self.name, self.bbox)
    }
}

/// Everything one rank saves for a step.
#[derive(Debug, Default, Clone)]
pub struct SaveState {
    /// Shards.
    pub tensors: Vec<SaveTensor>,
    /// Named blobs.
    pub blobs: Vec<(String, Vec<u8>)>,
}

/// Settings of a [`Checkpointer`].
#[derive(Debug, Clone)]
pub struct CheckpointerConfig {
    /// Run name.
    pub run: String,
    /// This rank.
    pub rank: u32,
    /// The layout.
    pub layout: Layout,
    /// The job generation (bumped by every restart).
    pub generation: u64,
    /// Whether this rank commits (rank 0 by default).
    pub committer: bool,
    /// Bound on staging memory (bytes); 0 = as much as one snapshot needs (the pool grows to
    /// the size of the first snapshot and stays there). Any bound works, down to one chunk: a
    /// smaller pool makes the snapshot wait for the persist of earlier chunks.
    pub staging_bytes: usize,
    /// A staging pool shared with other checkpointers of this process (ranks as threads);
    /// its bound replaces `staging_bytes`. `None`: this checkpointer's own pool.
    pub pool: Option<Arc<StagingPool>>,
    /// How long a snapshot waits for staging space while no slab comes back to the pool
    /// before the save fails (the persist is stuck); see [`StagingPool::acquire_many`].
    pub stall_timeout: Duration,
    /// Allocate and touch all staging memory up front.
    pub prefault: bool,
    /// Threads copying into staging.
    pub copy_threads: usize,
    /// Policy for a save while the previous one persists.
    pub back_pressure: BackPressure,
    /// How long the committer waits for the other ranks' manifests.
    pub commit_timeout: Duration,
    /// Hand every snapshot to a replica agent as well (see [`ckpt_recovery::peer`]); `None` by
    /// default. A rank under `ckpt resume --peer-replicas` gets it from its driver:
    /// `ckpt_recovery::RankEnv::peer_link`.
    pub peer: Option<PeerLink>,
}

impl CheckpointerConfig {
    /// Defaults for `rank` of `layout` in `run`.
    pub fn new(run: &str, rank: u32, layout: Layout) -> Self {
        CheckpointerConfig {
            run: run.to_string(),
            rank,
            layout,
            generation: 0,
            committer: rank == 0,
            staging_bytes: 0,
            pool: None,
            stall_timeout: Duration::from_secs(300),
            prefault: false,
            copy_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            back_pressure: BackPressure::Wait,
            commit_timeout: Duration::from_secs(600),
            peer: None,
        }
    }
}

/// Where a save is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stage {
    /// Copying into staging.
    Snapshotting,
    /// The snapshot is taken; tensors may change.
    Snapshotted,
    /// Chunks and this rank's manifest are in the store.
    Persisted,
    /// The commit record exists.
    Committed,
    /// Not taken (back-pressure), with the reason.
    Skipped(String),
    /// Failed, with the error's kind and message, as the stage that failed reported it.
    Failed(SaveFailure),
}

/// Why a save failed: the kind of the error where it happened (a fenced writer stays
/// [`ErrorKind::Fenced`], damaged input [`ErrorKind::Corrupt`], a coverage hole
/// [`ErrorKind::Incomplete`], ...) and its message. The kind decides what the caller does:
/// only [`ErrorKind::Backend`] and [`ErrorKind::Io`] are worth another try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveFailure {
    /// The kind of the error at the stage that failed.
    pub kind: ErrorKind,
    /// Its message.
    pub message: String,
}

impl From<&Error> for SaveFailure {
    fn from(e: &Error) -> Self {
        SaveFailure {
            kind: e.kind(),
            message: e.to_string(),
        }
    }
}

impl std::fmt::Display for SaveFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Figures of one save.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SaveReport {
    /// Step.
    pub step: u64,
    /// Bytes this rank snapshotted.
    pub bytes: u64,
    /// Seconds from `save` to the snapshot being complete (the most a loop waits).
    pub snapshot_s: f64,
    /// Seconds from `save` to this rank's manifest in the store.
    pub persist_s: f64,
    /// Seconds from this rank's manifest to the commit record (committer only).
    pub commit_s: f64,
    /// Bytes written to the store (stored, after compression).
    pub bytes_written: u64,
    /// Raw bytes skipped because the store had them.
    pub bytes_skipped: u64,
    /// Staging in use at its peak during this save.
    pub staging_peak: usize,
}

#[derive(Debug)]
struct Shared {
    step: u64,
    stage: Mutex<(Stage, SaveReport)>,
    cond: Condvar,
    /// Whether the stage reached `Persisted` (a commit that fails later turns the stage into
    /// `Failed`, but this rank's manifest is in the store all the same).
    persisted: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn set(&self, stage: Stage, f: impl FnOnce(&mut SaveReport)) {
        let mut g = self.stage.lock();
        if stage == Stage::Persisted {
            self.persisted
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        // Never go back from a failure.
        if !matches!(g.0, Stage::Failed(_)) {
            g.0 = stage;
        }
        f(&mut g.1);
        drop(g);
        self.cond.notify_all();
    }

    fn wait_for(&self, done: impl Fn(&Stage) -> bool) -> Result<SaveReport> {
        self.wait_until(done, None)
    }

    /// [`Shared::wait_for`], failing at `deadline` with an error naming the stage it is in.
    fn wait_until(
        &self,
        done: impl Fn(&Stage) -> bool,
        deadline: Option<(Instant, Duration)>,
    ) -> Result<SaveReport> {
        let mut g = self.stage.lock();
        loop {
            match &g.0 {
                Stage::Failed(e) => {
                    return Err(Error::new(
                        e.kind,
                        format!("checkpoint of step {} failed: {}", self.step, e.message),
                    ));
                }
                Stage::Skipped(why) => {
                    return Err(Error::new(
                        ErrorKind::Conflict,
                        format!("checkpoint of step {} was skipped: {why}", self.step),
                    ));
                }
                s if done(s) => return Ok(g.1.clone()),
                s => match deadline {
                    None => self.cond.wait(&mut g),
                    Some((at, within)) => {
                        if Instant::now() >= at {
                            let what = match s {
                                Stage::Snapshotting => "still copying into staging",
                                _ => "still writing its chunks and manifest",
                            };
                            return Err(Error::incomplete(format!(
                                "checkpoint of step {} not done within {within:?}: {what}",
                                self.step
                            )));
                        }
                        self.cond.wait_until(&mut g, at);
                    }
                },
            }
        }
    }
}

/// A save in progress.
#[derive(Debug, Clone)]
pub struct SaveHandle {
    shared: Arc<Shared>,
    store: Store,
    run: String,
}

impl SaveHandle {
    /// The step saved.
    pub fn step(&self) -> u64 {
        self.shared.step
    }

    /// Where the save is now.
    pub fn stage(&self) -> Stage {
        self.shared.stage.lock().0.clone()
    }

    /// Figures so far.
    pub fn report(&self) -> SaveReport {
        self.shared.stage.lock().1.clone()
    }

    /// Whether it was skipped.
    pub fn is_skipped(&self) -> bool {
        matches!(self.stage(), Stage::Skipped(_))
    }

    /// Block until the snapshot is taken (then tensors may change).
    pub fn wait_snapshot(&self) -> Result<SaveReport> {
        self.shared
            .wait_for(|s| matches!(s, Stage::Snapshotted | Stage::Persisted | Stage::Committed))
    }

    /// Block until this rank's chunks and manifest are in the store.
    pub fn wait_persisted(&self) -> Result<SaveReport> {
        match self
            .shared
            .wait_for(|s| matches!(s, Stage::Persisted | Stage::Committed))
        {
            // Persisted, then the commit failed before this call looked: persisted all the
            // same (the commit's error is for `wait_committed`).
            Err(_)
                if self
                    .shared
                    .persisted
                    .load(std::sync::atomic::Ordering::SeqCst) =>
            {
                Ok(self.report())
            }
            r => r,
        }
    }

    /// Block until this rank's chunks and manifest are in the store, or `timeout`.
    pub fn wait_persisted_within(&self, timeout: Duration) -> Result<SaveReport> {
        self.shared.wait_until(
            |s| matches!(s, Stage::Persisted | Stage::Committed),
            Some((Instant::now() + timeout, timeout)),
        )
    }

    /// Block until the step is committed (by whichever rank commits), or `timeout` (which
    /// covers the persist too).
    pub fn wait_committed(&self, timeout: Duration) -> Result<SaveReport> {
        let t0 = Instant::now();
        self.wait_persisted_within(timeout)?;
        if self.stage() == Stage::Committed {
            return self.shared.wait_for(|s| matches!(s, Stage::Committed));
        }
        let key = self.store.keys().commit(&self.run, self.shared.step);
        let mut pause = Duration::from_millis(20);
        loop {
            match self.stage() {
                Stage::Committed => return Ok(self.report()),
                // This rank's own commit failed (stale generation, coverage, ...): that is
                // the answer; do not wait for the timeout.
                Stage::Failed(_) => {
                    return self.shared.wait_for(|s| matches!(s, Stage::Committed));
                }
                _ => {}
            }
            if runtime().block_on(self.store.exists(&key))? {
                self.shared.set(Stage::Committed, |_| {});
                return Ok(self.report());
            }
            if t0.elapsed() > timeout {
                return Err(Error::incomplete(format!(
                    "step {} of run {} was not committed within {:?}",
                    self.shared.step, self.run, timeout
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }
}

/// Saves one rank's state (see the module docs).
pub struct Checkpointer {
    store: Store,
    cfg: CheckpointerConfig,
    pool: Arc<StagingPool>,
    last: Mutex<Option<SaveHandle>>,
    dedup: Arc<Mutex<DedupBase>>,
    /// Names this checkpointer's dedup leases in the store.
    writer: String,
    /// Set once this rank's generation has been joined in the store (marker written, no
    /// newer generation seen).
    joined: AtomicBool,
    /// Why a newer generation fenced this writer out, once one did: every later save is
    /// refused at once.
    fenced: Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for Checkpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checkpointer({} rank {})", self.cfg.run, self.cfg.rank)
    }
}

struct Job {
    tensor: usize,
    offset: usize,
    len: usize,
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
        let writer = ckpt_store::writer_id(cfg.rank, cfg.generation);
        Ok(Checkpointer {
            store,
            cfg,
            pool,
            last: Mutex::new(None),
            dedup: Arc::default(),
            writer,
            joined: AtomicBool::new(false),
            fenced: Arc::default(),
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
        let r = runtime().block_on(
            self.store
                .join_generation(&self.cfg.run, self.cfg.generation),
        );
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

    /// The newest committed step this rank's next save dedups against.
    pub fn dedup_base(&self) -> Option<u64> {
        self.dedup.lock().base_step()
    }

    /// The save in flight, if any.
    pub fn last(&self) -> Option<SaveHandle> {
        self.last.lock().clone()
    }

    /// Size the staging pool for snapshots of `state` (when the bound is automatic) and, with
    /// `prefault`, allocate and touch it now, so the first save does not pay for fresh memory.
    pub fn prepare_staging(&self, state: &SaveState, prefault: bool) {
        let slab = self.pool.slab_size();
        if self.cfg.staging_bytes == 0 && self.cfg.pool.is_none() {
            let lens: Vec<usize> = state
                .tensors
                .iter()
                .filter(|t| t.source.is_some() && t.replica_of.is_none())
                .map(|t| (t.bbox.numel() * t.dtype.size() as u64) as usize)
                .collect();
            let per_batch = (self.cfg.copy_threads.max(1) * 4).max(1);
            self.pool
                .ensure_capacity(slabs_needed(&lens, slab, per_batch) * slab);
        }
        if prefault {
            self.pool.prefault();
        }
    }

    pub(crate) fn seed_dedup(&self, step: u64, refs: Vec<ChunkRef>) {
        self.dedup.lock().seed(step, refs);
    }

    /// Save `state` as `step` (see the module docs). Returns once every tensor is pinned and
    /// the copy has started.
    pub fn save(&self, step: u64, state: SaveState) -> Result<SaveHandle> {
        // A fenced writer stops: no retry of a save can succeed once a newer job owns the run.
        self.join_generation()?;
        let mut last = self.last.lock();
        if let Some(prev) = last.as_ref() {
            let busy = matches!(prev.stage(), Stage::Snapshotting | Stage::Snapshotted);
            if busy {
                match self.cfg.back_pressure {
                    BackPressure::Wait => {
                        if let Err(e) = prev.wait_persisted() {
                            warn!(step = prev.step(), "previous checkpoint failed: {e}");
                        }
                    }
                    BackPressure::Skip => {
                        let why = format!(
                            "the checkpoint of step {} is still being persisted (policy: skip)",
                            prev.step()
                        );
                        warn!(step, "skipping checkpoint: {why}");
                        return Ok(SaveHandle {
                            shared: Arc::new(Shared {
                                step,
                                persisted: Default::default(),
                                stage: Mutex::new((
                                    Stage::Skipped(why),
                                    SaveReport {
                                        step,
                                        ..Default::default()
                                    },
                                )),
                                cond: Condvar::new(),
                            }),
                            store: self.store.clone(),
                            run: self.cfg.run.clone(),
                        });
                    }
                }
            }
        }
        let t0 = Instant::now();
        // Pin everything now: the checkpoint holds the bytes of this moment.
        let mut metas = Vec::with_capacity(state.tensors.len());
        let mut pins: Vec<(usize, Box<dyn PinnedSource>, usize)> = Vec::new();
        let mut bytes = 0u64;
        for t in &state.tensors {
            let len = (t.bbox.numel() * t.dtype.size() as u64) as usize;
            match (&t.source, t.replica_of) {
                (Some(src), None) => {
                    if src.len() != len {
                        return Err(Error::invalid(format!(
                            "tensor {:?} box {}: its memory holds {} bytes, the box {len}",
                            t.name,
                            t.bbox,
                            src.len()
                        )));
                    }
                    pins.push((metas.len(), src.pin()?, len));
                    bytes += len as u64;
                }
                (None, Some(_)) => {}
                _ => {
                    return Err(Error::invalid(format!(
                        "tensor {:?}: give either memory or replica_of",
                        t.name
                    )));
                }
            }
            metas.push(ShardMeta {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                bbox: t.bbox.clone(),
                replica_of: t.replica_of,
                placement: t.placement.clone(),
            });
        }
        let blobs: Vec<BlobIn> = state
            .blobs
            .into_iter()
            .map(|(name, data)| BlobIn {
                name,
                data: Bytes::from(data),
            })
            .collect();
        let shared = Arc::new(Shared {
            step,
            persisted: Default::default(),
            stage: Mutex::new((
                Stage::Snapshotting,
                SaveReport {
                    step,
                    bytes,
                    ..Default::default()
                },
            )),
            cond: Condvar::new(),
        });
        let handle = SaveHandle {
            shared: shared.clone(),
            store: self.store.clone(),
            run: self.cfg.run.clone(),
        };
        *last = Some(handle.clone());
        drop(last);
        self.pool.reset_peak();

        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Result<Bytes>>();
        // When staging holds the whole snapshot, the persist starts after the copy: the copy
        // then has every core to itself and the loop waits least. A smaller pool streams: the
        // persist must free slabs while the copy goes on.
        let slab = self.pool.slab_size();
        let lens: Vec<usize> = pins.iter().map(|p| p.2).collect();
        if self.cfg.staging_bytes == 0 && self.cfg.pool.is_none() {
            let per_batch = (self.cfg.copy_threads.max(1) * 4).max(1);
            self.pool
                .ensure_capacity(slabs_needed(&lens, slab, per_batch) * slab);
        }
        let cap_slabs = (self.pool.stats().capacity / slab).max(1);
        let per_batch = (self.cfg.copy_threads.max(1) * 4).clamp(1, cap_slabs);
        let fits = slabs_needed(&lens, slab, per_batch) <= cap_slabs;
        // The persist starts when the snapshot is done or as soon as the snapshot has to wait
        // for staging space (the pool is shared, or still holds chunks of a previous save):
        // only the persist frees slabs, so a snapshot never waits on a persist that waits for it.
        let (snap_done_tx, snap_done_rx) = tokio::sync::oneshot::channel::<()>();
        // Snapshot thread.
        {
            let pool = self.pool.clone();
            let threads = self.cfg.copy_threads.max(1);
            let shared = shared.clone();
            let names: Vec<String> = metas.iter().map(|m| m.name.clone()).collect();
            let stall = self.cfg.stall_timeout;
            let rank = self.cfg.rank;
            std::thread::Builder::new()
                .name(format!("ckpt-snapshot-{}", self.cfg.rank))
                .spawn(move || {
                    let mut go = Some(snap_done_tx);
                    let start_persist = move || {
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
        }
        // Persist and commit task.
        {
            let store = self.store.clone();
            let cfg = self.cfg.clone();
            let dedup = self.dedup.clone();
            let writer = self.writer.clone();
            let pool = self.pool.clone();
            let fenced = self.fenced.clone();
            let w = RankWrite {
                run: cfg.run.clone(),
                step,
                rank: cfg.rank,
                layout: cfg.layout,
                generation: cfg.generation,
            };
            runtime().spawn(async move {
                if fits {
                    let _ = snap_done_rx.await;
                }
                let (index, lease) = match prepare_index(&store, &cfg.run, &writer, &dedup).await {
                    Ok(x) => x,
                    Err(e) => {
                        warn!(step, rank = cfg.rank, "checkpoint failed: {e}");
                        shared.set(Stage::Failed(SaveFailure::from(&e)), |_| {});
                        return;
                    }
                };
                // Every chunk goes to the replica agent too, as the store takes it.
                let upload = cfg
                    .peer
                    .as_ref()
                    .map(|l| Arc::new(PeerUpload::start(l, cfg.generation, cfg.rank, step, 8)));
                let up = upload.clone();
                // A chunk small enough to go into a pack is copied out of its slab: a pack is
                // written only once it is full, and a slab pinned by a pack that waits for
                // more chunks would wait for the snapshot that waits for the slab.
                let small = store.config().pack_threshold;
                let chunks = futures::stream::unfold((rx, up), move |(mut rx, up)| async move {
                    let x = match rx.recv().await? {
                        Ok(b) if b.len() < small => Ok(Bytes::copy_from_slice(&b)),
                        x => x,
                    };
                    if let (Some(u), Ok(b)) = (&up, &x) {
                        u.chunk(b.clone()).await;
                    }
                    Some((x, (rx, up)))
                });
                let res = store
                    .write_rank_stream(&w, metas, blobs, chunks, &index)
                    .await;
                // Written (the manifest now protects what it references) or failed: no lease
                // needed any more.
                if let Err(e) = store.release_lease(lease).await {
                    debug!(step, "dedup lease not released (GC lets it lapse): {e}");
                }
                let (manifest, _entry, stats) = match res {
                    Ok(x) => x,
                    Err(e) => {
                        warn!(step, rank = cfg.rank, "checkpoint failed: {e}");
                        note_fenced(&fenced, &e);
                        shared.set(Stage::Failed(SaveFailure::from(&e)), |_| {});
                        return;
                    }
                };
                let persisted = t0.elapsed().as_secs_f64();
                let peak = pool.stats().peak_in_use;
                let refs: Vec<ChunkRef> = manifest
                    .tensors
                    .iter()
                    .flat_map(|t| t.chunks.iter().cloned())
                    .collect();
                let ids: Vec<_> = match upload {
                    Some(_) => refs.iter().map(|r| r.id).collect(),
                    None => Vec::new(),
                };
                dedup.lock().persisted(step, refs);
                shared.set(Stage::Persisted, |r| {
                    r.persist_s = persisted;
                    r.bytes_written = stats.bytes_written;
                    r.bytes_skipped = stats.bytes_skipped;
                    r.staging_peak = peak;
                });
                if let Some(u) = upload {
                    match u.finish(ids).await {
                        Ok(bytes) => debug!(step, bytes, "snapshot handed to the replica agent"),
                        Err(e) => warn!(step, "peer replica not made (the store has it): {e}"),
                    }
                }
                if !cfg.committer {
                    return;
                }
                let t1 = Instant::now();
                match store
                    .wait_and_commit_as(
                        &cfg.run,
                        step,
                        Some(cfg.generation),
                        Duration::from_millis(50),
                        cfg.commit_timeout,
                    )
                    .await
                {
                    Ok(o) => {
                        let c = t1.elapsed().as_secs_f64();
                        info!(
                            run = %cfg.run,
                            step,
                            bytes = o.record().logical_bytes(),
                            "checkpoint committed"
                        );
                        shared.set(Stage::Committed, |r| r.commit_s = c);
                    }
                    Err(e) => {
                        warn!(step, "commit failed: {e}");
                        note_fenced(&fenced, &e);
                        shared.set(Stage::Failed(SaveFailure::from(&e)), |_| {});
                    }
                }
            });
        }
        Ok(handle)
    }
}

/// Remember `e` if it is a fence (the first one wins).
fn note_fenced(fenced: &Mutex<Option<String>>, e: &Error) {
    if e.kind() == ErrorKind::Fenced {
        fenced.lock().get_or_insert_with(|| e.to_string());
    }
}

/// Before a persist: take a writer lease (no GC sweep runs until this save's manifest is
/// written) and pick the step this save deduplicates against (see [`ckpt_store::lease`]). The
/// previous save becomes the base only once its commit record is found; until then (or if that
/// commit failed) the base stays the older committed step, and with neither committed the save
/// skips nothing. A step whose commit failed is never a base: GC may sweep it with its chunks.
async fn prepare_index(
    store: &Store,
    run: &str,
    writer: &str,
    dedup: &Mutex<DedupBase>,
) -> Result<(DedupIndex, WriterLease)> {
    let candidates = dedup.lock().candidates();
    let lease = store.lease_dedup_base(run, writer, &candidates).await?;
    let index = dedup.lock().pinned(lease.base());
    Ok((index, lease))
}

/// Copy every pinned source into slabs with `threads` threads, sending chunks in order.
/// Small shards share slabs (each chunk is a slice of a slab), so a thousand biases do not
/// take a thousand slabs. Releases each pin as soon as its tensor is copied. On error returns
/// the tensor index.
///
/// Each batch takes its slabs all at once ([`StagingPool::acquire_many`]); `start_persist`
/// runs before the first wait for staging space and when the copy is done.
fn snapshot(
    pool: &Arc<StagingPool>,
    pins: Vec<(usize, Box<dyn PinnedSource>, usize)>,
    threads: usize,
    stall: Duration,
    mut start_persist: impl FnMut(),
    tx: &tokio::sync::mpsc::UnboundedSender<Result<Bytes>>,
) -> std::result::Result<(), (usize, Error)> {
    let slab = pool.slab_size();
    let mut jobs: Vec<Job> = Vec::new();
    for (k, (_, _, len)) in pins.iter().enumerate() {
        let mut off = 0;
        while off < *len {
            let l = slab.min(len - off);
            jobs.push(Job {
                tensor: k,
                offset: off,
                len: l,
            });
            off += l;
        }
    }
    let mut remaining: Vec<usize> = vec![0; pins.len()];
    for j in &jobs {
        remaining[j.tensor] += 1;
    }
    let mut pins: Vec<Option<(usize, Box<dyn PinnedSource>)>> =
        pins.into_iter().map(|(i, p, _)| Some((i, p))).collect();
    // Zero-length tensors have nothing to copy: release their pins at once.
    for (k, r) in remaining.iter().enumerate() {
        if *r == 0
            && let Some((i, p)) = pins[k].take()
        {
            p.complete().map_err(|e| (i, e))?;
        }
    }
    // Batches of whole slabs, never more than the pool holds, so a batch can always start
    // once earlier batches are persisted.
    let cap_slabs = (pool.stats().capacity / slab).max(1);
    let per_batch = (threads * 4).clamp(1, cap_slabs);
    let lens: Vec<usize> = jobs.iter().map(|j| j.len).collect();
    for b in carve(&lens, slab, per_batch) {
        let group = &jobs[b.jobs.clone()];
        let places = &b.place;
        let first = pins[group[0].tensor].as_ref().map_or(0, |(i, _)| *i);
        let mut slabs = pool
            .acquire_many(b.fills.len(), stall, &mut start_persist)
            .map_err(|e| (first, e))?;
        {
            // Disjoint destination slices, one per job, in slab order within each slab.
            let mut order: Vec<usize> = (0..group.len()).collect();
            order.sort_by_key(|&k| places[k]);
            let mut dsts: Vec<Option<&mut [u8]>> = (0..group.len()).map(|_| None).collect();
            let mut rest: Vec<&mut [u8]> = slabs.iter_mut().map(|s| s.bytes_mut()).collect();
            let mut cut: Vec<usize> = vec![0; rest.len()];
            for k in order {
                let (si, at) = places[k];
                let len = group[k].len;
                let buf = std::mem::take(&mut rest[si]);
                let (_, tail) = buf.split_at_mut(at - cut[si]);
                let (dst, tail) = tail.split_at_mut(len);
                rest[si] = tail;
                cut[si] = at + len;
                dsts[k] = Some(dst);
            }
            let pins_ref = &pins;
            let work: Vec<(&Job, &mut [u8])> = group
                .iter()
                .zip(dsts)
                .map(|(j, d)| (j, d.expect("every job has a destination")))
                .collect();
            let per = work.len().div_ceil(threads).max(1);
            let res: Vec<std::result::Result<(), (usize, Error)>> = std::thread::scope(|s| {
                let mut handles = Vec::new();
                let mut work = work;
                while !work.is_empty() {
                    let take = per.min(work.len());
                    let mine: Vec<(&Job, &mut [u8])> = work.drain(..take).collect();
                    handles.push(s.spawn(move || {
                        for (j, dst) in mine {
                            let (i, p) = pins_ref[j.tensor].as_ref().expect("pinned until copied");
                            p.copy_to(j.offset, dst).map_err(|e| (*i, e))?;
                        }
                        Ok(())
                    }));
                }
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err((0, Error::internal("a copy thread panicked"))))
                    })
                    .collect()
            });
            for r in res {
                r?;
            }
        }
        // Device copies complete asynchronously: wait for this batch before handing it on.
        let mut touched: Vec<usize> = group.iter().map(|j| j.tensor).collect();
        touched.dedup();
        for &k in &touched {
            if let Some((i, p)) = pins[k].as_ref() {
                p.fence().map_err(|e| (*i, e))?;
            }
        }
        let frozen: Vec<Bytes> = slabs
            .into_iter()
            .zip(&b.fills)
            .map(|(s, &f)| s.freeze(f))
            .collect();
        for (j, (si, at)) in group.iter().zip(places) {
            let chunk = frozen[*si].slice(*at..at + j.len);
            if tx.send(Ok(chunk)).is_err() {
                // The persist ended (it failed and reported why); stop copying.
                return Ok(());
            }
            remaining[j.tensor] -= 1;
            if remaining[j.tensor] == 0
                && let Some((i, p)) = pins[j.tensor].take()
            {
                p.complete().map_err(|e| (i, e))?;
            }
        }
    }
    Ok(())
}

/// One batch of a snapshot: consecutive jobs and the slabs they are copied into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Batch {
    /// The jobs (indices into the job list).
    pub jobs: std::ops::Range<usize>,
    /// Per job: (slab within the batch, byte offset in it).
    pub place: Vec<(usize, usize)>,
    /// Bytes used in each slab.
    pub fills: Vec<usize>,
}

/// Place jobs of `lens` bytes (each at most `slab`) into batches of at most `per_batch` slabs,
/// first fit within the batch, 64-byte aligned, so shards smaller than a slab share slabs and
/// little is wasted.
pub(crate) fn carve(lens: &[usize], slab: usize, per_batch: usize) -> Vec<Batch> {
    let mut out: Vec<Batch> = Vec::new();
    let mut cur = Batch {
        jobs: 0..0,
        place: Vec::new(),
        fills: Vec::new(),
    };
    for (j, &len) in lens.iter().enumerate() {
        let fit = cur
            .fills
            .iter()
            .position(|f| f.next_multiple_of(64) + len <= slab);
        let (si, at) = match fit {
            Some(si) => (si, cur.fills[si].next_multiple_of(64)),
            None if cur.fills.len() < per_batch => {
                cur.fills.push(0);
                (cur.fills.len() - 1, 0)
            }
            None => {
                let next = Batch {
                    jobs: j..j,
                    place: Vec::new(),
                    fills: vec![0],
                };
                out.push(std::mem::replace(&mut cur, next));
                (0, 0)
            }
        };
        cur.fills[si] = at + len;
        cur.place.push((si, at));
        cur.jobs.end = j + 1;
    }
    if !cur.place.is_empty() {
        out.push(cur);
    }
    out
}

/// Slabs a snapshot of shards of `lens` bytes needs at once (chunked by `slab`).
pub(crate) fn slabs_needed(lens: &[usize], slab: usize, per_batch: usize) -> usize {
    let mut jobs = Vec::new();
    for &len in lens {
        let mut off = 0;
        while off < len {
            jobs.push(slab.min(len - off));
            off += slab;
        }
    }
    carve(&jobs, slab, per_batch)
        .iter()
        .map(|b| b.fills.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carving_packs_small_jobs_and_keeps_batches_bounded() {
        // 1.5 MiB jobs: first fit puts two per 4 MiB slab, and a 1 MiB job fills a gap.
        let m = 1 << 20;
        let lens = [3 * m / 2, 3 * m / 2, 3 * m / 2, m, 4 * m, 100];
        let b = carve(&lens, 4 * m, 8);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].fills.len(), 3, "{:?}", b[0]);
        assert_eq!(
            b[0].place[3].0, 0,
            "the 1 MiB job goes into the first slab's gap"
        );
        // Batches never exceed their slab count, and jobs stay in order across batches.
        let many = vec![4 * m; 20];
        let bs = carve(&many, 4 * m, 8);
        assert_eq!(
            bs.iter().map(|b| b.fills.len()).collect::<Vec<_>>(),
            vec![8, 8, 4]
        );
        assert_eq!(bs[1].jobs, 8..16);
        // Every placement lies inside its slab and never overlaps another.
        for b in carve(&[m, 3 * m, 2 * m, 2 * m, 1, 4 * m - 64], 4 * m, 4) {
            let mut spans: Vec<(usize, usize, usize)> = b
                .place
                .iter()
                .zip(b.jobs.clone())
                .map(|(&(s, a), j)| (s, a, a + [m, 3 * m, 2 * m, 2 * m, 1, 4 * m - 64][j]))
                .collect();
            spans.sort();
            for w in spans.windows(2) {
                assert!(w[0].0 != w[1].0 || w[0].2 <= w[1].1, "{spans:?}");
            }
            assert!(spans.iter().all(|s| s.2 <= 4 * m));
        }
        assert_eq!(slabs_needed(&[10 * m], 4 * m, 8), 3);
    }
}
