//! `ckpt._native`: the thin Python layer over `ckpt-store` that `ckpt.dcp` (PyTorch's
//! distributed checkpoint backend) is built on.
//!
//! It opens a store by path or URL as the CLI does, writes a rank's items of a step as ckpt
//! chunks in batches ([`ckpt_store::RankParts`]) and then the rank's manifest, commits a step,
//! lists committed steps, and reads any box of a committed tensor into a caller's writable
//! buffer, and blobs. Tensor bytes come in and go out through the buffer protocol without a
//! copy on the Python side; hashing, compression and I/O run with the GIL released. Every
//! error is a `ckpt.CkptError` whose message is ckpt's (it names the tensor or object) and
//! whose `kind` is the `ErrorKind` (`"not found"`, `"damaged data"`, ...).
//!
//! For a script launched by `ckpt resume` it also gives the rank environment and the
//! heartbeat client (`launched`).

mod launched;
mod manager;

use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use ckpt_store::{
    BlobIn, DType, DedupIndex, Error, Layout, NdBox, RankParts, RankWrite, ShardDesc, ShardIn,
    WriterLease, writer_id,
};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

create_exception!(
    ckpt._native,
    CkptError,
    PyException,
    "An error of ckpt: the message names what is wrong and where; `kind` is its kind."
);

/// The process's runtime for the store's I/O (created on first use).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("ckpt-io")
            .build()
            .expect("starting ckpt's I/O runtime")
    })
}

fn err(e: Error) -> PyErr {
    let kind = e.kind().as_str();
    Python::with_gil(|py| {
        let exc = CkptError::new_err(e.to_string());
        let _ = exc.value(py).setattr("kind", kind);
        exc
    })
}

/// Run `f` on the runtime with the GIL released.
fn block<T: Send>(
    py: Python<'_>,
    f: impl std::future::Future<Output = ckpt_store::Result<T>> + Send,
) -> PyResult<T> {
    py.allow_threads(|| runtime().block_on(f)).map_err(err)
}

/// [`block`] for a future that is built on the calling thread once the GIL is released and
/// never leaves it (no `Send` needed of the future).
fn block_on<T, F: std::future::Future<Output = ckpt_store::Result<T>>>(
    py: Python<'_>,
    make: impl FnOnce() -> F + Send,
) -> PyResult<T>
where
    T: Send,
{
    py.allow_threads(|| runtime().block_on(make())).map_err(err)
}

fn dtype(name: &str) -> PyResult<DType> {
    name.parse::<DType>().map_err(err)
}

fn nd_box(offsets: Vec<u64>, sizes: Vec<u64>) -> PyResult<NdBox> {
    NdBox::new(offsets, sizes).map_err(err)
}

/// The bytes of a Python object, lent to Rust while the call that took them runs: a `bytes`,
/// or a C-contiguous array of bytes that describes itself with numpy's `__array_interface__`
/// (`ckpt.dcp` hands a tensor's memory as `tensor.view(torch.uint8).numpy()`, no copy).
/// The buffer protocol would be the natural way, but it is not in Python's limited API before
/// 3.11, and the module is built once for every CPython >= 3.9 (abi3).
struct Lent {
    ptr: *const u8,
    len: usize,
    /// The object, kept alive (and so its memory) while the bytes are lent.
    _owner: Py<PyAny>,
}

// SAFETY: the memory belongs to `_owner`, which the `Lent` keeps alive; the owners of the
// objects lent (numpy arrays over tensors, `bytes`) do not move or free their memory while
// referenced. Python code may write into it meanwhile (a training loop that does not wait for
// its save), which is the caller's race, as with any buffer.
unsafe impl Send for Lent {}
// SAFETY: as for `Send`: `Lent` only hands out shared reads of memory its owner keeps alive.
unsafe impl Sync for Lent {}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: see `Lent`; `_owner` keeps `len` bytes at `ptr` alive and in place.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Lent {
    /// Lend `obj`'s bytes; `writable`: refuse read-only memory.
    fn of(obj: &Bound<'_, PyAny>, what: &str, writable: bool) -> PyResult<Lent> {
        if let Ok(b) = obj.downcast::<PyBytes>() {
            if writable {
                return Err(CkptError::new_err(format!("{what}: bytes are read-only")));
            }
            let data = b.as_bytes();
            return Ok(Lent {
                ptr: data.as_ptr(),
                len: data.len(),
                _owner: obj.clone().unbind(),
            });
        }
        let bad = |why: String| CkptError::new_err(format!("{what}: {why}"));
        let ai = obj.getattr("__array_interface__").map_err(|_| {
            bad(format!(
                "a {} is neither bytes nor an array of bytes (numpy's __array_interface__)",
                obj.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        let ai = ai
            .downcast::<PyDict>()
            .map_err(|_| bad("__array_interface__ is not a dict".into()))?;
        let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
            ai.get_item(k)?
                .ok_or_else(|| bad(format!("__array_interface__ has no {k:?}")))
        };
        let typestr: String = get("typestr")?.extract()?;
        if typestr != "|u1" {
            return Err(bad(format!(
                "an array of {typestr}, not of bytes (|u1): view the tensor as torch.uint8"
            )));
        }
        if let Some(strides) = ai.get_item("strides")?
            && !strides.is_none()
        {
            return Err(bad("the array is not C-contiguous".into()));
        }
        let shape = get("shape")?;
        let shape = shape
            .downcast::<PyTuple>()
            .map_err(|_| bad("its shape is not a tuple".into()))?;
        let mut len = 1usize;
        for d in shape.iter() {
            len = len
                .checked_mul(d.extract::<usize>()?)
                .ok_or_else(|| bad("its size overflows".into()))?;
        }
        let (ptr, readonly): (usize, bool) = get("data")?.extract()?;
        if writable && readonly {
            return Err(bad("the array is read-only".into()));
        }
        if ptr == 0 && len != 0 {
            return Err(bad("the array has no data".into()));
        }
        Ok(Lent {
            ptr: ptr as *const u8,
            len,
            _owner: obj.clone().unbind(),
        })
    }
}

/// A store, opened by path or URL as `ckpt` takes it (`/data/ckpts`, `s3://bucket/prefix`),
/// with the request retries of `CKPT_STORE_RETRY` as the binaries read it (and `CKPT_FAULTS`,
/// the faults tests inject).
#[pyclass(module = "ckpt._native", frozen)]
struct Store {
    store: ckpt_store::Store,
    url: String,
}

#[pymethods]
impl Store {
    #[new]
    fn new(py: Python<'_>, url: &str) -> PyResult<Self> {
        let u = url.to_string();
        // The interpreter is this library's binary: its edge reads the environment, as the
        // `ckpt` and `ckpt-train` binaries do at start-up.
        #[expect(
            clippy::disallowed_methods,
            reason = "the Python module is the process's edge: it reads the store settings of the environment as the binaries do"
        )]
        let var = |name: &str| std::env::var(name).ok();
        let open = ckpt_store::OpenOptions::from_values(
            var(ckpt_store::url::RETRY_ENV).as_deref(),
            var(ckpt_store::url::FAULTS_ENV).as_deref(),
        )
        .map_err(err)?;
        let store = block(py, async move { ckpt_store::open_with(&u, &open) })?;
        Ok(Store {
            store,
            url: url.to_string(),
        })
    }

    /// The URL the store was opened with.
    #[getter]
    fn url(&self) -> String {
        self.url.clone()
    }

    fn __repr__(&self) -> String {
        format!("ckpt._native.Store({:?})", self.url)
    }

    /// The committed steps of `run`, oldest first.
    fn committed_steps(&self, py: Python<'_>, run: &str) -> PyResult<Vec<u64>> {
        block(py, self.store.log().committed_steps(run))
    }

    /// The newest committed step of `run`, or None.
    fn latest_committed(&self, py: Python<'_>, run: &str) -> PyResult<Option<u64>> {
        block(py, self.store.log().latest_committed(run))
    }

    /// The newest generation started for `run` (0 when none was).
    fn generation(&self, py: Python<'_>, run: &str) -> PyResult<u64> {
        Ok(block(py, self.store.log().newest_generation(run))?.unwrap_or(0))
    }

    /// Start `rank`'s part of `step` of `run` in a world of `world` ranks. Takes a writer
    /// lease and, when `run` has a committed step before `step`, skips the chunks this rank
    /// wrote there (dedup). `node_first`: this store is the local tier of one machine of
    /// several, whose first rank is `node_first`: the dedup base is a step its node commit
    /// holds ([`Store::commit_node`]).
    #[pyo3(signature = (run, step, rank, world, generation=0, node_first=None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn rank_writer(
        &self,
        py: Python<'_>,
        run: &str,
        step: u64,
        rank: u32,
        world: u32,
        generation: u64,
        node_first: Option<u32>,
    ) -> PyResult<RankWriter> {
        let layout = Layout::new(world, 1, 1, 0).map_err(err)?;
        let parts = RankParts::new(RankWrite {
            generation,
            ..RankWrite::new(run, step, rank, layout)
        })
        .map_err(err)?;
        let store = self.store.clone();
        let run = run.to_string();
        let (lease, index) = block(py, async move {
            let log = store.log();
            let steps = match node_first {
                Some(_) => log.node_committed_steps(&run).await?,
                None => log.committed_steps(&run).await?,
            };
            let candidates: Vec<u64> = steps.into_iter().rfind(|&s| s < step).into_iter().collect();
            let writer = writer_id(rank, generation);
            let gc = store.gc();
            let lease = match node_first {
                Some(first) => {
                    gc.lease_node_dedup_base(&run, &writer, first, &candidates)
                        .await?
                }
                None => gc.lease_dedup_base(&run, &writer, &candidates).await?,
            };
            let index = DedupIndex::new();
            if let Some(b) = lease.base() {
                let seeded = async {
                    // This rank's entry in the base's commit (the node's, on one machine of
                    // several), and its manifest checked against it.
                    let entry = match node_first {
                        Some(_) => log
                            .read_node_commits(&run, b)
                            .await?
                            .into_iter()
                            .flat_map(|c| c.ranks)
                            .find(|e| e.rank == rank),
                        None => ckpt_store::StepReader::open(&store, &run, b)
                            .await?
                            .commit()
                            .ranks
                            .iter()
                            .find(|e| e.rank == rank)
                            .cloned(),
                    };
                    if let Some(e) = entry {
                        let m = log.read_rank_manifest(&run, b, rank, Some(&e)).await?;
                        index.extend(m.tensors.iter().flat_map(|t| t.chunks.iter()));
                        index.extend(m.blobs.iter().flat_map(|b| b.chunks.iter()));
                    }
                    Ok::<_, Error>(())
                }
                .await;
                if let Err(e) = seeded {
                    let _ = store.gc().release_lease(lease).await;
                    return Err(e);
                }
            }
            Ok((lease, index))
        })?;
        Ok(RankWriter {
            store: self.store.clone(),
            parts: parking_lot::Mutex::new(Some(parts)),
            lease: parking_lot::Mutex::new(Some(lease)),
            index,
        })
    }

    /// Commit `step` of `run` once every rank's manifest is written (the coordinator's
    /// `finish`): checks coverage and writes the commit record. Returns the step's id.
    #[pyo3(signature = (run, step, generation=None))]
    fn commit(
        &self,
        py: Python<'_>,
        run: &str,
        step: u64,
        generation: Option<u64>,
    ) -> PyResult<String> {
        let outcome = block(py, self.store.log().commit_step_as(run, step, generation))?;
        Ok(match outcome {
            ckpt_store::CommitOutcome::Committed(_, id) => id.to_string(),
            ckpt_store::CommitOutcome::AlreadyCommitted(_, id) => id.to_string(),
        })
    }

    /// One machine of several, this store its local tier: wait until `ranks` (the machine's
    /// ranks) wrote their manifests of `step` under `generation`, then commit them here (a
    /// node commit; the drains of every machine commit the step on the remote store, see
    /// `drain_to(node=True)`). Waits up to `timeout` seconds. Returns the ranks committed.
    #[pyo3(signature = (run, step, generation, ranks, timeout=600.0))]
    fn commit_node(
        &self,
        py: Python<'_>,
        run: &str,
        step: u64,
        generation: u64,
        ranks: Vec<u32>,
        timeout: f64,
    ) -> PyResult<Vec<u32>> {
        if !(timeout.is_finite() && timeout >= 0.0) {
            return Err(err(Error::invalid(format!(
                "a commit timeout must be a number of seconds, not {timeout}"
            ))));
        }
        let within = (
            std::time::Duration::from_millis(50),
            std::time::Duration::from_secs_f64(timeout),
        );
        let c = block(
            py,
            self.store
                .log()
                .commit_node(run, step, generation, &ranks, within),
        )?;
        Ok(c.rank_numbers())
    }

    /// The steps of `run` with a node commit here (one machine's local tier of several),
    /// oldest first.
    fn node_committed_steps(&self, py: Python<'_>, run: &str) -> PyResult<Vec<u64>> {
        block(py, self.store.log().node_committed_steps(run))
    }

    /// This store a machine's local tier of several, `rank` one of its ranks, about to drain
    /// `newest`: the newest older step another machine already drained to `remote` and this
    /// machine committed in `generation` here, which it drains first (else machines that skip
    /// steps by their own timing may drain disjoint steps, and `remote` gets none whole).
    #[pyo3(signature = (remote, run, newest, rank, generation, drained=None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn step_to_follow(
        &self,
        py: Python<'_>,
        remote: &Store,
        run: &str,
        newest: u64,
        rank: u32,
        generation: u64,
        drained: Option<u64>,
    ) -> PyResult<Option<u64>> {
        block(
            py,
            ckpt_store::node_step_to_follow(
                &self.store,
                &remote.store,
                run,
                (newest, drained),
                rank,
                generation,
            ),
        )
    }

    /// Open committed `step` of `run` for reading (the newest committed step when None).
    /// `fallback`: a store that holds the same step (the remote store under a local tier):
    /// a chunk missing or damaged here is read from it. `source`: a store whose chunks are
    /// read first, each hash-checked (a machine's local tier under this remote store); what it
    /// lacks or holds damaged is read here.
    #[pyo3(signature = (run, step=None, fallback=None, source=None))]
    fn open_step(
        &self,
        py: Python<'_>,
        run: &str,
        step: Option<u64>,
        fallback: Option<&Store>,
        source: Option<&Store>,
    ) -> PyResult<StepReader> {
        let store = self.store.clone();
        let run = run.to_string();
        let reader = block(py, async move {
            match step {
                Some(s) => ckpt_store::StepReader::open(&store, &run, s).await,
                None => ckpt_store::StepReader::open_latest(&store, &run).await,
            }
        })?;
        let reader = match fallback {
            Some(f) => reader.with_fallback(f.store.clone()),
            None => reader,
        };
        let reader = match source {
            Some(s) => reader.with_source(Arc::new(ckpt_store::TierSource::new(s.store.clone()))),
            None => reader,
        };
        Ok(StepReader {
            reader: Arc::new(reader),
        })
    }

    /// This store as a local tier: copy committed `step` of `run` to `remote` (only the
    /// objects it lacks, hash-checked) and commit it there, fenced by `generation` (the
    /// writer's; a newer generation on `remote` refuses it); then keep the newest
    /// `keep_local` committed steps here. `rate`: send at most this many stored bytes a
    /// second. Returns the drain's figures (`objects_sent`, `bytes_sent`, `objects_present`,
    /// `bytes_present`, `seconds`).
    ///
    /// `node`: this store is one machine's local tier of several, `node` one of its ranks:
    /// drain the machine's ranks of `step` (its node commit) and commit the step on `remote`
    /// when every other machine's ranks are there already (`remote_committed` says whether
    /// this drain did or found it so); the local retention keeps the steps other machines
    /// drained that this one may still follow (`step_to_follow`).
    #[pyo3(signature = (remote, run, step, generation=None, keep_local=None, rate=None, node=None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn drain_to<'py>(
        &self,
        py: Python<'py>,
        remote: &Store,
        run: &str,
        step: u64,
        generation: Option<u64>,
        keep_local: Option<usize>,
        rate: Option<f64>,
        node: Option<u32>,
    ) -> PyResult<Bound<'py, PyDict>> {
        if let Some(r) = rate
            && !(r.is_finite() && r > 0.0)
        {
            return Err(err(Error::invalid(format!(
                "a drain rate must be a positive number of bytes a second, not {r}"
            ))));
        }
        let (local, remote) = (self.store.clone(), remote.store.clone());
        let run_s = run.to_string();
        let r = block(py, async move {
            let opts = ckpt_store::DrainOptions {
                writer: format!("dcp-drain-{run_s}"),
                generation,
                pace: rate.map(ckpt_store::rate_pace),
                ..Default::default()
            };
            let r = match node {
                Some(_) => ckpt_store::drain_node(&local, &remote, &run_s, step, &opts).await?,
                None => ckpt_store::drain_step(&local, &remote, &run_s, step, &opts).await?,
            };
            if let Some(k) = keep_local {
                let mut protect = vec![(run_s.clone(), step)];
                if let Some(rank) = node {
                    let listing = remote.log().list_steps(&run_s).await?;
                    protect.extend(
                        ckpt_store::steps_to_follow(u64::MAX, None, &listing, rank)
                            .into_iter()
                            .map(|s| (run_s.clone(), s)),
                    );
                }
                let gc = ckpt_store::GcOptions {
                    keep_last: Some(k.max(1)),
                    runs: vec![run_s.clone()],
                    protect,
                    ..Default::default()
                };
                local.gc().run(&gc, local.now()).await?;
            }
            Ok::<_, Error>(r)
        })?;
        let d = PyDict::new(py);
        d.set_item("step", r.step)?;
        d.set_item("objects_sent", r.objects_sent)?;
        d.set_item("bytes_sent", r.bytes_sent)?;
        d.set_item("objects_present", r.objects_present)?;
        d.set_item("bytes_present", r.bytes_present)?;
        d.set_item("seconds", r.seconds)?;
        d.set_item("remote_committed", r.remote_committed)?;
        Ok(d)
    }

    /// The steps of `run` this store (a local tier) holds drain markers for: committed here,
    /// not yet (known to be) committed on the remote store.
    fn pending_drains(&self, py: Python<'_>, run: &str) -> PyResult<Vec<u64>> {
        let m = block(py, self.store.log().pending_drains(run))?;
        Ok(m.into_iter().map(|m| m.step).collect())
    }
}

/// One box to read: (tensor name, offsets, sizes, the writable buffer it goes into).
type ReadItem<'py> = (String, Vec<u64>, Vec<u64>, Bound<'py, PyAny>);

/// One rank's part of a step: `put` batches of tensors and blobs, then `finish` (the manifest).
#[pyclass(module = "ckpt._native", frozen)]
struct RankWriter {
    store: ckpt_store::Store,
    parts: parking_lot::Mutex<Option<RankParts>>,
    lease: parking_lot::Mutex<Option<WriterLease>>,
    index: DedupIndex,
}

fn stats_dict<'py>(py: Python<'py>, s: &ckpt_store::PutStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("chunks", s.chunks)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("chunks_skipped", s.chunks_skipped)?;
    d.set_item("bytes_skipped", s.bytes_skipped)?;
    d.set_item("chunks_written", s.chunks - s.chunks_skipped)?;
    d.set_item("objects_written", s.objects_written)?;
    d.set_item("bytes_written", s.bytes_written)?;
    Ok(d)
}

#[pymethods]
impl RankWriter {
    /// Write a batch: `tensors` is a list of `(name, dtype, shape, offsets, sizes, buffer)`
    /// (ckpt's dtype name, the global shape, this item's box, and the box's bytes in row-major
    /// order as any C-contiguous buffer), `blobs` a list of `(name, buffer)`. Returns what the
    /// batch wrote.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (tensors, blobs=Vec::new()))]
    fn put<'py>(
        &self,
        py: Python<'py>,
        tensors: Vec<(
            String,
            String,
            Vec<u64>,
            Vec<u64>,
            Vec<u64>,
            Bound<'py, PyAny>,
        )>,
        blobs: Vec<(String, Bound<'py, PyAny>)>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let lend = |obj: &Bound<'py, PyAny>, what: &str| -> PyResult<Bytes> {
            Ok(Bytes::from_owner(Lent::of(obj, what, false)?))
        };
        let mut shards = Vec::with_capacity(tensors.len());
        for (name, dt, shape, offsets, sizes, data) in &tensors {
            let what = format!("tensor {name:?}");
            shards.push(ShardIn {
                shard: ShardDesc::boxed(
                    name.clone(),
                    dtype(dt)?,
                    shape.clone(),
                    nd_box(offsets.clone(), sizes.clone())?,
                ),
                data: Some(lend(data, &what)?),
            });
        }
        let mut blob_ins = Vec::with_capacity(blobs.len());
        for (name, data) in &blobs {
            let what = format!("blob {name:?}");
            blob_ins.push(BlobIn {
                name: name.clone(),
                data: lend(data, &what)?,
            });
        }
        let mut parts = self
            .parts
            .lock()
            .take()
            .ok_or_else(|| CkptError::new_err("this rank writer has finished"))?;
        let res = block(py, async {
            self.store
                .put_rank_part(&mut parts, shards, blob_ins, &self.index)
                .await
        });
        *self.parts.lock() = Some(parts);
        stats_dict(py, &res?)
    }

    /// Write the rank's manifest (its part of the step is then complete) and end the lease.
    /// Returns what all batches wrote.
    fn finish<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let parts = self
            .parts
            .lock()
            .take()
            .ok_or_else(|| CkptError::new_err("this rank writer has finished"))?;
        let lease = self.lease.lock().take();
        let store = self.store.clone();
        let stats = block(py, async move {
            let res = store.write_rank_parts(parts).await;
            if let Some(l) = lease {
                store.gc().release_lease(l).await?;
            }
            res.map(|(_, _, s)| s)
        })?;
        stats_dict(py, &stats)
    }
}

impl Drop for RankWriter {
    fn drop(&mut self) {
        // A writer dropped without `finish` (a failed save) gives its lease back now rather
        // than when it lapses.
        if let Some(l) = self.lease.lock().take() {
            let store = self.store.clone();
            runtime().spawn(async move {
                let _ = store.gc().release_lease(l).await;
            });
        }
    }
}

/// A committed step, open for reading.
#[pyclass(module = "ckpt._native", frozen)]
struct StepReader {
    reader: Arc<ckpt_store::StepReader>,
}

#[pymethods]
impl StepReader {
    /// The step number.
    #[getter]
    fn step(&self) -> u64 {
        self.reader.commit().step
    }

    /// The number of ranks that saved the step.
    #[getter]
    fn world(&self) -> u32 {
        self.reader.commit().layout.world()
    }

    /// Every tensor of the step: `(name, dtype, shape)`.
    fn tensors(&self) -> Vec<(String, String, Vec<u64>)> {
        self.reader
            .commit()
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.dtype.name().to_string(), t.shape.clone()))
            .collect()
    }

    /// Every blob of the step: `(rank, name, length)`.
    fn blobs(&self) -> Vec<(u32, String, u64)> {
        self.reader
            .commit()
            .blobs
            .iter()
            .map(|b| (b.rank, b.name.clone(), b.len))
            .collect()
    }

    /// Read the box (`offsets`, `sizes`) of tensor `name` into `out`, a writable C-contiguous
    /// buffer of exactly the box's bytes. Every chunk's hash is checked.
    fn read_into(
        &self,
        py: Python<'_>,
        name: &str,
        offsets: Vec<u64>,
        sizes: Vec<u64>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let what = format!("tensor {name:?}");
        let buf = Lent::of(out, &what, true)?;
        let bbox = nd_box(offsets, sizes)?;
        let ptr = buf.ptr as usize;
        let len = buf.len;
        let reader = self.reader.clone();
        let name = name.to_string();
        block_on(py, move || async move {
            let out: &mut [u8] = if len == 0 {
                &mut []
            } else {
                // SAFETY: `buf` (writable, contiguous, `len` bytes) keeps its owner alive
                // until this call returns.
                unsafe { std::slice::from_raw_parts_mut(ptr as *mut c_void as *mut u8, len) }
            };
            reader.read_into(&name, &bbox, out).await.map(|_| ())
        })?;
        drop(buf);
        Ok(())
    }

    /// Read many boxes at once: `items` of `(name, offsets, sizes, out)`, each `out` a
    /// writable C-contiguous buffer of exactly its box's bytes. The chunks of every item are
    /// in flight together (about `budget` bytes at most), each hash-checked and then written
    /// straight into its buffer: a DCP load plan read as one pipelined read rather than one
    /// read after another. An error names the tensor (and the chunk and rank where it is
    /// about one); the buffers are then partly written. `shared`: other processes of this
    /// machine read the same chunks (replicas every rank loads): they are read through the
    /// page cache, so the disk serves them once, rather than around it.
    #[pyo3(signature = (items, budget=256 << 20, shared=false))]
    fn read_many(
        &self,
        py: Python<'_>,
        items: Vec<ReadItem<'_>>,
        budget: usize,
        shared: bool,
    ) -> PyResult<()> {
        let commit = self.reader.commit();
        let mut targets = Vec::with_capacity(items.len());
        for (name, offsets, sizes, out) in items {
            // A tensor the step lacks is refused, by name, before anything is read.
            let (dtype, shape) = commit
                .tensor(&name)
                .map_or((DType::U8, Vec::new()), |t| (t.dtype, t.shape.clone()));
            let lent = Lent::of(&out, &format!("tensor {name:?}"), true)?;
            targets.push(ckpt_trainer::RestoreTarget {
                name,
                dtype,
                shape,
                bbox: nd_box(offsets, sizes)?,
                sink: Arc::new(manager::PySink(Arc::new(lent))),
            });
        }
        let reader = match shared {
            true => Arc::new(ckpt_store::StepReader::clone(&self.reader).shared(true)),
            false => self.reader.clone(),
        };
        block_on(py, move || async move {
            ckpt_trainer::restore_targets(&reader, &targets, budget.max(1))
                .await
                .map(|_| ())
        })
    }

    /// The bytes of blob `name` saved by `rank`.
    fn read_blob<'py>(
        &self,
        py: Python<'py>,
        rank: u32,
        name: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let reader = self.reader.clone();
        let name = name.to_string();
        let data = block(py, async move { reader.read_blob(rank, &name).await })?;
        Ok(PyBytes::new(py, &data))
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add("CkptError", m.py().get_type::<CkptError>())?;
    m.add_class::<Store>()?;
    m.add_class::<RankWriter>()?;
    m.add_class::<StepReader>()?;
    m.add_class::<manager::Manager>()?;
    m.add_class::<launched::PyRankEnv>()?;
    m.add_class::<launched::Heartbeat>()?;
    m.add_function(wrap_pyfunction!(launched::resume_env, m)?)?;
    m.add_function(wrap_pyfunction!(launched::beat, m)?)?;
    // A rank that cannot restore the step it was given because of the data (an object
    // missing or damaged) exits with this status: the driver then checks that step rather
    // than blame the rank's node.
    m.add("DATA_FAILURE_EXIT", ckpt_recovery::DATA_FAILURE_EXIT)?;
    Ok(())
}

/// `CKPT_LOG` (a `tracing` env filter such as `info` or `ckpt_trainer=debug`): the Rust side's
/// events on stderr, as the CLI's `RUST_LOG`; unset, nothing is printed. Read once, when the
/// module is imported (a binding reads its environment as a binary does).
#[allow(
    clippy::disallowed_methods,
    reason = "the extension module is an edge, as a binary is: its log filter comes from the environment of the Python process"
)]
fn init_logging() {
    let Ok(filter) = std::env::var("CKPT_LOG") else {
        return;
    };
    match tracing_subscriber::EnvFilter::try_new(&filter) {
        Ok(f) => {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(f)
                .with_writer(std::io::stderr)
                .try_init();
        }
        Err(e) => eprintln!("ckpt: ignoring CKPT_LOG={filter:?}: {e}"),
    }
}
