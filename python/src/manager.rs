//! `ckpt._native.Manager`: the Rust [`CheckpointManager`] for a PyTorch loop (the native class
//! under `ckpt.CheckpointManager`).
//!
//! Everything a save does is the Rust manager's: the interval policy, the staging pool and the
//! snapshot, the persist (chunks, hashes, codecs, dedup) and its governor, the commit, retention
//! (`keep_last`, `keep_every`) and the final checkpoint on SIGTERM. The binding only lends the
//! tensors' memory: the state dict is handed over as a callable that the manager calls only
//! when a checkpoint is due ([`CheckpointManager::maybe_save_with`]); each tensor becomes a
//! [`CheckpointManager::register_held`] tensor (its box as PyTorch placed it) whose memory is
//! the tensor's own, read by the snapshot's copy threads without a copy on the Python side;
//! the non-tensor values arrive pickled, as one [`Stateful`] blob. `maybe_save` returns once
//! the snapshot is taken (the tensors may change from then on); the persist goes on in the
//! background. The GIL is released for the snapshot, the persist and the restore.

use std::sync::Arc;
use std::time::Duration;

use ckpt_store::placement::TensorSpec;
use ckpt_store::{Error, Layout, NdBox};
use ckpt_trainer::{
    CheckpointManager, CheckpointerConfig, LocalTier, ManagerConfig, MemorySink, MemorySource,
    PinnedSource, SaveHandle, SaveReport, Scope, Stage, Stateful, TensorMemory,
};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tracing::debug;

use crate::{CkptError, Lent, Store, dtype, err, nd_box};

/// The blob (`global/<name>`) that holds the pickled non-tensor values of the state dict.
pub const PY_STATE_BLOB: &str = "torch.non_tensor";

/// A tensor's memory, lent by Python for as long as it is registered.
struct PyMemory(Arc<Lent>);

struct PySource(Arc<Lent>);

impl MemorySource for PySource {
    fn len(&self) -> usize {
        self.0.len
    }

    /// No pin can stop Python from writing: `Manager.maybe_save` returns only once the
    /// snapshot is taken, and the loop runs no step meanwhile.
    fn pin(&self) -> ckpt_store::Result<Box<dyn PinnedSource>> {
        Ok(Box::new(PySource(self.0.clone())))
    }
}

impl PinnedSource for PySource {
    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> ckpt_store::Result<()> {
        let lent: &[u8] = (*self.0).as_ref();
        let src = lent
            .get(offset..offset + dst.len())
            .ok_or_else(|| Error::internal("snapshot copy past the end of a Python tensor"))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn complete(self: Box<Self>) -> ckpt_store::Result<()> {
        Ok(())
    }
}

/// Memory lent by Python that a restore writes into.
pub(crate) struct PySink(pub(crate) Arc<Lent>);

impl MemorySink for PySink {
    fn len(&self) -> usize {
        self.0.len
    }

    fn write_at(&self, offset: usize, src: &[u8]) -> ckpt_store::Result<()> {
        self.in_place(offset, src.len(), &mut |dst| {
            dst.copy_from_slice(src);
            Ok(())
        })
    }

    fn with_memory(
        &self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> ckpt_store::Result<()>,
    ) -> Option<ckpt_store::Result<()>> {
        Some(self.in_place(offset, len, fill))
    }

    fn short_writes_cheap(&self) -> bool {
        true
    }
}

impl PySink {
    /// `fill` the lent bytes `offset .. offset + len` in place: what both of the sink's writes
    /// do.
    fn in_place(
        &self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> ckpt_store::Result<()>,
    ) -> ckpt_store::Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.0.len) {
            return Err(Error::internal(
                "restore write past the end of a Python tensor",
            ));
        }
        if len == 0 {
            return fill(&mut []);
        }
        // SAFETY: the memory is writable (checked when lent), `len` bytes from `offset` lie
        // within it (checked above), and it is kept alive by the `Lent`; restores write
        // disjoint ranges, and Python waits in `restore_latest`.
        let dst =
            unsafe { std::slice::from_raw_parts_mut((self.0.ptr as *mut u8).add(offset), len) };
        fill(dst)
    }
}

impl TensorMemory for PyMemory {
    fn source(
        &self,
        held: &NdBox,
        sub: &NdBox,
        _elem: usize,
    ) -> ckpt_store::Result<Arc<dyn MemorySource>> {
        if held != sub {
            return Err(Error::internal(format!(
                "box {sub} of a Python tensor that holds {held}: a Python tensor saves its whole box"
            )));
        }
        Ok(Arc::new(PySource(self.0.clone())))
    }

    fn sink(&self, held: &NdBox, elem: usize) -> ckpt_store::Result<Arc<dyn MemorySink>> {
        let want = held.numel() as usize * elem;
        if self.0.len != want {
            return Err(Error::invalid(format!(
                "held box {held} needs {want} bytes, the tensor has {}",
                self.0.len
            )));
        }
        Ok(Arc::new(PySink(self.0.clone())))
    }
}

/// The pickled non-tensor values: set before each save, read after a restore.
#[derive(Default)]
struct Blob(Vec<u8>);

impl Stateful for Blob {
    fn state_dict(&self) -> Vec<u8> {
        self.0.clone()
    }
    fn load_state_dict(&mut self, bytes: &[u8]) -> ckpt_store::Result<()> {
        self.0 = bytes.to_vec();
        Ok(())
    }
}

/// One tensor as Python hands it: `(name, dtype, shape, offsets, sizes, buffer, replica_of,
/// trainable)`.
type Entry<'py> = (
    String,
    String,
    Vec<u64>,
    Vec<u64>,
    Vec<u64>,
    Bound<'py, PyAny>,
    Option<u32>,
    bool,
);

/// Register `entries` (replacing what was registered) with memory lent from their buffers.
fn register(m: &mut CheckpointManager, entries: Vec<Entry<'_>>, writable: bool) -> PyResult<()> {
    m.clear_tensors();
    for (order, (name, dt, shape, offsets, sizes, buf, replica_of, trainable)) in
        entries.into_iter().enumerate()
    {
        let what = format!("tensor {name:?}");
        let lent = Lent::of(&buf, &what, writable)?;
        let spec = TensorSpec::first_stage(name, dtype(&dt)?, &shape).with_order(order as u32);
        let held = nd_box(offsets, sizes)?;
        let want = held.numel() as usize * spec.dtype.size();
        if lent.len != want {
            return Err(CkptError::new_err(format!(
                "{what}: box {held} of {} needs {want} bytes, the buffer holds {}",
                spec.dtype, lent.len
            )));
        }
        let name = spec.name.clone();
        m.register_held(spec, held, Arc::new(PyMemory(Arc::new(lent))), replica_of)
            .map_err(err)?;
        m.set_trainable(&name, trainable).map_err(err)?;
    }
    Ok(())
}

fn report_dict<'py>(
    py: Python<'py>,
    r: &SaveReport,
    stage: &Stage,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", r.step)?;
    d.set_item("stage", stage_name(stage))?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("snapshot_s", r.snapshot_s)?;
    d.set_item("persist_s", r.persist_s)?;
    d.set_item("commit_s", r.commit_s)?;
    d.set_item("bytes_written", r.bytes_written)?;
    d.set_item("bytes_skipped", r.bytes_skipped)?;
    d.set_item("bytes_reused", r.bytes_reused)?;
    d.set_item("staging_peak", r.staging_peak)?;
    d.set_item("bytes_checked", r.bytes_checked)?;
    if let Some(rep) = &r.replicas {
        d.set_item("replicas_compared", rep.chunks_compared)?;
        d.set_item("replicas_mismatched", rep.mismatched_chunks)?;
        d.set_item("replica_suspects", rep.suspects())?;
    }
    Ok(d)
}

fn stage_name(s: &Stage) -> &'static str {
    match s {
        Stage::Snapshotting => "snapshotting",
        Stage::Snapshotted => "snapshotted",
        Stage::Persisted => "persisted",
        Stage::Committed => "committed",
        Stage::Failed(_) => "failed",
        Stage::Skipped(_) => "skipped",
    }
}

/// One rank's checkpoint manager (see the module docs); `ckpt.CheckpointManager` wraps it.
#[pyclass(module = "ckpt._native", frozen)]
pub struct Manager {
    inner: Mutex<CheckpointManager>,
    blob: Arc<Mutex<Blob>>,
    last: Mutex<Option<SaveHandle>>,
}

#[pymethods]
impl Manager {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (store, run, rank=0, world=1, generation=0, every_steps=None,
        every_s=None, keep_last=None, keep_every=None, final_on_sigterm=true,
        resume_step=None, staging_bytes=0, governor=true, sdc_check=None,
        on_replica_mismatch="warn", stale_after=2, node=None, local_tier=None, keep_local=2,
        node_processes=None, node_ranks=None))]
    fn new(
        py: Python<'_>,
        store: &Store,
        run: &str,
        rank: u32,
        world: u32,
        generation: u64,
        every_steps: Option<u64>,
        every_s: Option<f64>,
        keep_last: Option<usize>,
        keep_every: Option<u64>,
        final_on_sigterm: bool,
        resume_step: Option<u64>,
        staging_bytes: usize,
        governor: bool,
        sdc_check: Option<&str>,
        on_replica_mismatch: &str,
        stale_after: u32,
        node: Option<u32>,
        local_tier: Option<&Store>,
        keep_local: usize,
        node_processes: Option<u32>,
        node_ranks: Option<Vec<u32>>,
    ) -> PyResult<Self> {
        let layout = Layout::new(world, 1, 1, 0).map_err(err)?;
        let mut ck = CheckpointerConfig::new(run, rank, layout);
        ck.generation = generation;
        ck.staging_bytes = staging_bytes;
        if let Some(c) = sdc_check {
            ck.sdc_check = c.parse().map_err(err)?;
        }
        ck.node = node;
        let mut cfg = ManagerConfig::new(ck);
        cfg.every_steps = every_steps;
        cfg.every = match every_s {
            Some(s) if !(s.is_finite() && s > 0.0) => {
                return Err(CkptError::new_err(format!(
                    "every_seconds must be a positive number of seconds, not {s}"
                )));
            }
            s => s.map(Duration::from_secs_f64),
        };
        cfg.keep_last = keep_last;
        cfg.keep_every = keep_every;
        cfg.final_on_sigterm = final_on_sigterm;
        cfg.resume_step = resume_step;
        // Rolling back is a driver's (`ckpt resume --on-replica-mismatch rollback`): a rank
        // under it warns.
        cfg.on_replica_mismatch = match on_replica_mismatch.parse().map_err(err)? {
            ckpt_store::MismatchPolicy::Rollback => ckpt_store::MismatchPolicy::Warn,
            p => p,
        };
        cfg.stale_after = stale_after;
        cfg.node_processes = node_processes;
        if !governor {
            cfg.persist_governor = None;
        }
        if let Some(t) = local_tier {
            if keep_local == 0 {
                return Err(CkptError::new_err(
                    "keep_local must keep at least 1 step in the local tier",
                ));
            }
            let mut tier = LocalTier::new(t.store.clone());
            tier.keep_last = keep_local;
            cfg.local_tier = Some(tier);
        }
        // One machine of several, each with its own tier: its lowest rank commits its ranks
        // there and drains them; the drains commit the step on the store. (The manager refuses
        // node_ranks without a local tier, or without this rank.)
        if let Some(r) = node_ranks {
            cfg.ckpt.committer = r.iter().min() == Some(&rank);
            cfg.ckpt.node_ranks = Some(r);
        }
        let s = store.store.clone();
        let mut m = py
            .allow_threads(move || CheckpointManager::new(s, cfg))
            .map_err(err)?;
        let blob = Arc::new(Mutex::new(Blob::default()));
        m.register_stateful(PY_STATE_BLOB, Scope::Global, blob.clone())
            .map_err(err)?;
        Ok(Manager {
            inner: Mutex::new(m),
            blob,
            last: Mutex::new(None),
        })
    }

    /// Save `step` if the interval policy says so, or a final checkpoint if SIGTERM arrived:
    /// then `prepare()` is called for the state, `(entries, pickled)` (`entries`:
    /// `(name, dtype, shape, offsets, sizes, buffer, replica_of)` per tensor), and the call
    /// returns once the snapshot is taken. Returns whether a checkpoint was taken.
    /// `agreed_stop`: the stop decision the ranks agreed on (see `set_agreed_stop` of the Rust
    /// manager); `None`: this rank's own SIGTERM flag decides.
    #[pyo3(signature = (step, prepare, agreed_stop=None))]
    fn maybe_save(
        &self,
        py: Python<'_>,
        step: u64,
        prepare: Py<PyAny>,
        agreed_stop: Option<bool>,
    ) -> PyResult<bool> {
        let mut guard = self.inner.lock();
        let m: &mut CheckpointManager = &mut guard;
        m.set_agreed_stop(agreed_stop);
        let blob = self.blob.clone();
        let mut failed: Option<PyErr> = None;
        // `prepare()` registers the state; `values`: whether the pickled values are the
        // checkpoint's (a save) or not (staging sized ahead of the first save).
        let mut hand_over = |mgr: &mut CheckpointManager, values: bool| {
            Python::with_gil(|py| -> PyResult<()> {
                let got = prepare.call0(py)?;
                let (entries, pickled): (Vec<Entry<'_>>, Vec<u8>) = got.extract(py)?;
                register(mgr, entries, false)?;
                if values {
                    blob.lock().0 = pickled;
                }
                Ok(())
            })
            .map_err(|e| {
                let what = format!("preparing the state of step {step}: {e}");
                // A state that cannot be saved fails the save that takes it, not a step
                // that only sized the staging ahead of it.
                if values {
                    failed = Some(e);
                }
                Error::invalid(what)
            })
        };
        let res = py.allow_threads(|| {
            let h = m.maybe_save_with(step, |mgr| hand_over(mgr, true))?;
            let snap = match &h {
                Some(h) => h.wait_snapshot().map(|_| ()),
                // No checkpoint at this step: before the first one, the state is handed over
                // once more so that the staging pool is sized for it and filled in the
                // background, not by the first save while the loop waits.
                None => {
                    if let Err(e) = m.stage_ahead_with(|mgr| hand_over(mgr, false)) {
                        debug!(error = %e, "staging not sized ahead of the first save");
                    }
                    Ok(())
                }
            };
            // The tensors are the loop's again once copied: lend nothing longer.
            m.clear_tensors();
            snap.map(|_| h)
        });
        if let Some(e) = failed {
            return Err(e);
        }
        let h = res.map_err(err)?;
        let taken = h.as_ref().is_some_and(|h| !h.is_skipped());
        if let Some(h) = h {
            *self.last.lock() = Some(h);
        }
        Ok(taken)
    }

    /// Restore the step to resume from (`step` when given, else the resume step `ckpt resume`
    /// chose, else the newest committed one) into `entries` (their buffers writable); returns
    /// `(step, pickled)`, or None when there is nothing to restore.
    #[pyo3(signature = (entries, step=None))]
    fn restore_latest<'py>(
        &self,
        py: Python<'py>,
        entries: Vec<Entry<'py>>,
        step: Option<u64>,
    ) -> PyResult<Option<(u64, Bound<'py, PyBytes>)>> {
        let mut guard = self.inner.lock();
        let m: &mut CheckpointManager = &mut guard;
        register(m, entries, true)?;
        let r = py.allow_threads(|| match step {
            Some(s) => m.restore(s).map(|_| Some(s)),
            None => m.restore_latest(),
        });
        // The buffers are the caller's again.
        m.clear_tensors();
        let Some(step) = r.map_err(err)? else {
            return Ok(None);
        };
        let bytes = std::mem::take(&mut self.blob.lock().0);
        Ok(Some((step, PyBytes::new(py, &bytes))))
    }

    /// Wait until the last checkpoint taken is committed (rank 0) or persisted (the others);
    /// its figures.
    #[pyo3(signature = (timeout_s=600.0))]
    fn wait<'py>(&self, py: Python<'py>, timeout_s: f64) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(h) = self.last.lock().clone() else {
            return Ok(None);
        };
        let committer = self.is_committer();
        let within = Duration::from_secs_f64(timeout_s.max(0.0));
        let r = py
            .allow_threads(|| {
                if committer {
                    h.wait_committed(within)
                } else {
                    h.wait_persisted_within(within)
                }
            })
            .map_err(err)?;
        report_dict(py, &r, &h.stage()).map(Some)
    }

    /// The staging pool's bytes: `allocated` (faulted in, kept between saves), `in_use` (held
    /// by the save in flight), `peak_in_use` and `capacity` (the bound; 0 before it is sized).
    fn staging<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.lock().checkpointer().staging();
        let d = PyDict::new(py);
        d.set_item("allocated", s.allocated)?;
        d.set_item("in_use", s.in_use)?;
        d.set_item("peak_in_use", s.peak_in_use)?;
        d.set_item("capacity", s.capacity)?;
        Ok(d)
    }

    /// The figures of the last checkpoint taken so far (None before the first).
    fn last_report<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.last.lock().as_ref() {
            Some(h) => report_dict(py, &h.report(), &h.stage()).map(Some),
            None => Ok(None),
        }
    }

    /// With a local tier, on the committing rank: the drains to the remote store that ended
    /// since the last call, oldest first, one dict each (`step`, `objects_sent`,
    /// `bytes_sent`, `bytes_present`, `seconds`, `lag_s`, `lag_steps`, `skipped`).
    fn drains<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let figures = self.inner.lock().take_drain_figures();
        figures
            .into_iter()
            .map(|f| {
                let d = PyDict::new(py);
                d.set_item("step", f.step)?;
                d.set_item("objects_sent", f.objects_sent)?;
                d.set_item("bytes_sent", f.bytes_sent)?;
                d.set_item("bytes_present", f.bytes_present)?;
                d.set_item("seconds", f.seconds)?;
                d.set_item("lag_s", f.lag_s)?;
                d.set_item("lag_steps", f.lag_steps)?;
                d.set_item("skipped", f.skipped)?;
                Ok(d)
            })
            .collect()
    }

    /// Whether SIGTERM (or `request_stop`) asked for a stop and the final checkpoint was taken.
    #[getter]
    fn should_stop(&self) -> bool {
        self.inner.lock().should_stop()
    }

    /// Whether SIGTERM arrived (or `request_stop` was called).
    #[getter]
    fn sigterm_received(&self) -> bool {
        self.inner.lock().sigterm_received()
    }

    /// Ask for a final checkpoint at the next `maybe_save`, as SIGTERM does.
    fn request_stop(&self) {
        self.inner.lock().request_stop();
    }

    /// Wait for the checkpoint in flight to commit (or persist, on a rank that does not
    /// commit) and for retention.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let mut guard = self.inner.lock();
        let m: &mut CheckpointManager = &mut guard;
        py.allow_threads(|| m.finish()).map_err(err)
    }
}

impl Manager {
    fn is_committer(&self) -> bool {
        self.inner.lock().checkpointer().config().committer
    }
}
