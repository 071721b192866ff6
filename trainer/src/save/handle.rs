//! Where a save is: [`Stage`], its figures ([`SaveReport`]), why it failed ([`SaveFailure`]),
//! and the [`SaveHandle`] a caller waits on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_recovery::records::CheckpointMetrics;
use ckpt_store::{Error, ErrorKind, Hash, NdBox, ReplicaReport, Result, Store};
use parking_lot::{Condvar, Mutex};
use serde::Serialize;

use super::rate::PersistRate;
use super::runtime::runtime;

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

impl Stage {
    /// Whether the save's persist has ended: persisted (or committed), failed or skipped;
    /// only a save still snapshotting or persisting has not.
    pub fn persist_ended(&self) -> bool {
        !matches!(self, Stage::Snapshotting | Stage::Snapshotted)
    }
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

/// Figures of one save, as the saving process sees them. Its log record is
/// [`CheckpointMetrics`] (converted with `From`): two types because the record is a stable
/// file format read by other versions and tools (`ckpt plot`, the supervisor), while this
/// report also carries what only the process has (the replica comparison, the shards'
/// digests, the bytes checked) and may grow with the API.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SaveReport {
    /// Step.
    pub step: u64,
    /// Bytes of the shards this rank saves: copied into staging, plus `bytes_reused`.
    pub bytes: u64,
    /// Seconds from `save` to the snapshot being complete (the most a loop waits).
    pub snapshot_s: f64,
    /// Seconds from `save` to this rank's manifest in the store.
    pub persist_s: f64,
    /// Whether the persist started with the snapshot's copy ([`SnapshotOverlap`]): it then
    /// ran for all of `persist_s`, not only after `snapshot_s`.
    ///
    /// [`SnapshotOverlap`]: crate::SnapshotOverlap
    pub overlapped: bool,
    /// Seconds from this rank's manifest to the commit record (committer only).
    pub commit_s: f64,
    /// Bytes written to the store (stored, after compression).
    pub bytes_written: u64,
    /// Raw bytes skipped because the store had them (reused shards included).
    pub bytes_skipped: u64,
    /// Raw bytes of shards unchanged since the last committed save (same source version):
    /// neither copied nor hashed, their chunks referenced again. Part of `bytes`.
    pub bytes_reused: u64,
    /// Staging in use at its peak during this save.
    pub staging_peak: usize,
    /// Bytes of replicas copied and hashed for the sentinel (not written).
    pub bytes_checked: u64,
    /// The committer's comparison of the step's replicas (committer only; `None`: none was
    /// hashed).
    pub replicas: Option<ReplicaReport>,
    /// What each shard this rank wrote held, as the hash of its chunk ids (the sentinel's
    /// stale-state check compares them from save to save).
    #[serde(skip)]
    pub written: Arc<Vec<ShardDigest>>,
}

/// A shard a save wrote, and the blake3 of its chunk ids in order: equal digests, equal bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardDigest {
    /// The tensor.
    pub name: String,
    /// The box.
    pub bbox: NdBox,
    /// The shard's bytes.
    pub bytes: u64,
    /// blake3 over the chunk ids.
    pub digest: Hash,
}

/// A save's figures as the `checkpoint` record of the metrics log, without what only the loop
/// knows (`rank`, `stall_s`: set them with struct update syntax).
impl From<&SaveReport> for CheckpointMetrics {
    fn from(r: &SaveReport) -> Self {
        CheckpointMetrics {
            step: r.step,
            rank: None,
            bytes: r.bytes,
            stall_s: 0.0,
            snapshot_s: r.snapshot_s,
            persist_s: r.persist_s,
            commit_s: r.commit_s,
            bytes_written: r.bytes_written,
            bytes_skipped: r.bytes_skipped,
            staging_peak: r.staging_peak as u64,
        }
    }
}

#[derive(Debug)]
pub(super) struct Shared {
    step: u64,
    stage: Mutex<(Stage, SaveReport)>,
    cond: Condvar,
    /// Whether the stage reached `Persisted` (a commit that fails later turns the stage into
    /// `Failed`, but this rank's manifest is in the store all the same).
    persisted: std::sync::atomic::AtomicBool,
    /// Whether the snapshot had to wait for staging space (only the persist frees it).
    staging_waited: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// A save of `step` at `stage`, with its first figures.
    pub(super) fn new(step: u64, stage: Stage, report: SaveReport) -> Arc<Self> {
        Arc::new(Shared {
            step,
            persisted: Default::default(),
            staging_waited: Default::default(),
            stage: Mutex::new((stage, report)),
            cond: Condvar::new(),
        })
    }

    pub(super) fn set(&self, stage: Stage, f: impl FnOnce(&mut SaveReport)) {
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

    /// The snapshot waits for staging space.
    pub(super) fn note_staging_wait(&self) {
        self.staging_waited
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the persist goes at full speed, whatever the rate limit: while the snapshot
    /// copies, the loop may be waiting for it, and it may be waiting for staging space that
    /// only the persist frees. A persist that overlaps the copy ([`SnapshotOverlap`]) is
    /// paced until the copy first waits for staging.
    ///
    /// [`SnapshotOverlap`]: crate::SnapshotOverlap
    pub(super) fn unpaced(&self) -> bool {
        let g = self.stage.lock();
        matches!(g.0, Stage::Snapshotting)
            && (!g.1.overlapped
                || self
                    .staging_waited
                    .load(std::sync::atomic::Ordering::SeqCst))
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
    pub(super) shared: Arc<Shared>,
    pub(super) store: Store,
    pub(super) run: String,
    /// This rank creates the commit record: its own persist task says when the step is
    /// committed (and with what figures), so it never looks for the record in the store.
    pub(super) committer: bool,
    /// The persist's rate limit: lifted while someone waits for the persist.
    pub(super) rate: Arc<PersistRate>,
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

    /// Block until this rank's chunks and manifest are in the store. The persist runs at full
    /// speed meanwhile (whatever rate the governor set: someone waits for it).
    pub fn wait_persisted(&self) -> Result<SaveReport> {
        let _fast = self.rate.full_speed();
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

    /// Block until this rank's chunks and manifest are in the store, or `timeout` (at full
    /// speed, as [`SaveHandle::wait_persisted`]).
    pub fn wait_persisted_within(&self, timeout: Duration) -> Result<SaveReport> {
        let _fast = self.rate.full_speed();
        self.shared.wait_until(
            |s| matches!(s, Stage::Persisted | Stage::Committed),
            Some((Instant::now() + timeout, timeout)),
        )
    }

    /// Block until the step is committed (by whichever rank commits), or `timeout` (which
    /// covers the persist too; at full speed, as [`SaveHandle::wait_persisted`]).
    pub fn wait_committed(&self, timeout: Duration) -> Result<SaveReport> {
        let _fast = self.rate.full_speed();
        let t0 = Instant::now();
        self.wait_persisted_within(timeout)?;
        if self.stage() == Stage::Committed {
            return self.shared.wait_for(|s| matches!(s, Stage::Committed));
        }
        if self.committer {
            // The record appears in the store a moment before the persist task records
            // `commit_s`: answering from the store would report a commit without its figures.
            return self.shared.wait_until(
                |s| matches!(s, Stage::Committed),
                Some((t0 + timeout, timeout)),
            );
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
            if runtime().block_on(self.store.objects().exists(&key))? {
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
