//! [`Store`]: chunks in, chunks out, over any [`ObjectStore`].
//!
//! The write path ([`Store::put_chunks`]) hashes chunks on several threads, skips chunks the
//! [`DedupIndex`] already knows, encodes the rest (codec chosen by measuring), packs the small
//! ones, and writes with bounded concurrency and a bounded number of bytes in flight. The read
//! path fetches chunk objects (whole, or a range of a pack), decodes them and checks their
//! hash.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::stream::{self, Stream, StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::{debug, instrument};

use crate::codec::{self, Codec, CodecPolicy, Encoded, MAX_CHUNK_LEN};
use crate::error::{Error, ErrorKind, Result};
use crate::id::{ChunkId, Hash};
use crate::keys::Keys;
use crate::model::ChunkRef;
use crate::pack::PackBuilder;

/// Settings of a [`Store`]. Defaults suit a local disk; [`StoreConfig::for_remote`] suits
/// object stores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StoreConfig {
    /// Chunk size for shards and blobs (default 4 MiB; at most 256 MiB).
    pub chunk_size: usize,
    /// Chunks smaller than this are packed (default 1 MiB).
    pub pack_threshold: usize,
    /// Packs are sealed when they reach this size (default 16 MiB).
    pub pack_target: usize,
    /// How hard to compress.
    pub codec: CodecPolicy,
    /// Decide per chunk from measured throughputs whether compressing pays (see `Governor`):
    /// on a sink faster than the compressor, chunks are stored raw (default on).
    pub adaptive_codec: bool,
    /// Object writes in flight (default 8).
    pub write_concurrency: usize,
    /// Object reads in flight (default 8).
    pub read_concurrency: usize,
    /// Threads hashing and encoding (default: the number of CPUs).
    pub cpu_threads: usize,
    /// Bytes of encoded chunks waiting to be written, at most (default 256 MiB).
    pub inflight_bytes: usize,
    /// Objects larger than this use multipart upload (default: never for local, 64 MiB remote).
    pub multipart_threshold: usize,
    /// Multipart part size (default 16 MiB).
    pub multipart_part: usize,
    /// A GC sweep lock not refreshed for this long is a killed GC's: a save deletes it and
    /// goes on (default 30 s; the GC refreshes its lock every sixth of it). See
    /// [`crate::lease`].
    pub sweep_lapse: Duration,
    /// The longest chain of delta chunks (issue 16): a float chunk whose region a committed
    /// base step holds may be stored as a delta on that step's chunk while the base's chain is
    /// shorter than this, so a restore reads at most `delta_chain + 1` objects per chunk and a
    /// whole chunk is stored at least every `delta_chain + 1` saves. 0 turns deltas off
    /// (the default: on the local disk the governor stores raw, and where deltas engage they
    /// cost restore time and a copy of the state, BENCHMARKS.md; `ckpt-train --delta-chain 8`
    /// turns them on). Deltas are tried only where the codec governor compresses, on a sample
    /// first (`codec::estimate_delta`).
    pub delta_chain: usize,
    /// Plain bytes of written float chunks kept in memory as the next save's delta bases, at
    /// most (default 0: a base is read back from the store, through its own chain).
    pub delta_cache_bytes: u64,
    /// A commit record larger than this is split into a root and parts of about this size
    /// (format 5, default 64 KiB): a restoring rank then reads the root and the parts of its
    /// own tensors, not the whole record (3.8 MB at 4,096 ranks of a 70B-like model).
    pub record_part_bytes: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            chunk_size: 4 << 20,
            pack_threshold: 1 << 20,
            pack_target: 16 << 20,
            codec: CodecPolicy::FAST,
            adaptive_codec: true,
            write_concurrency: 8,
            read_concurrency: 8,
            cpu_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            inflight_bytes: 256 << 20,
            multipart_threshold: usize::MAX,
            multipart_part: 16 << 20,
            sweep_lapse: Duration::from_secs(30),
            delta_chain: 0,
            delta_cache_bytes: 0,
            record_part_bytes: 64 << 10,
        }
    }
}

impl StoreConfig {
    /// Settings for object stores: compress thoroughly (the network is the bottleneck), more
    /// requests in flight, multipart above 64 MiB.
    pub fn for_remote() -> Self {
        StoreConfig {
            codec: CodecPolicy::MAX,
            write_concurrency: 16,
            read_concurrency: 16,
            multipart_threshold: 64 << 20,
            ..StoreConfig::default()
        }
    }

    /// Byte ranges of the chunks of a buffer of `len` bytes (aligned to its start): how
    /// every shard and blob is cut.
    pub fn chunk_spans(&self, len: u64) -> impl Iterator<Item = std::ops::Range<u64>> + use<> {
        let cs = self.chunk_size as u64;
        let n = if len == 0 { 0 } else { len.div_ceil(cs) };
        (0..n).map(move |i| i * cs..((i + 1) * cs).min(len))
    }

    /// Check the settings.
    pub fn validate(&self) -> Result<()> {
        if self.chunk_size == 0 || self.chunk_size as u64 > MAX_CHUNK_LEN {
            return Err(Error::invalid(format!(
                "chunk size {} must be between 1 byte and {} MiB",
                self.chunk_size,
                MAX_CHUNK_LEN >> 20
            )));
        }
        if self.write_concurrency == 0 || self.read_concurrency == 0 || self.cpu_threads == 0 {
            return Err(Error::invalid("concurrency settings must be at least 1"));
        }
        if self.inflight_bytes < self.chunk_size {
            return Err(Error::invalid(format!(
                "in-flight budget {} must hold at least one chunk ({})",
                self.inflight_bytes, self.chunk_size
            )));
        }
        if self.inflight_bytes < self.pack_target + self.chunk_size {
            return Err(Error::invalid(format!(
                "in-flight budget {} must hold a pack ({}) and a chunk ({})",
                self.inflight_bytes, self.pack_target, self.chunk_size
            )));
        }
        if self.multipart_part < (5 << 20) && self.multipart_threshold != usize::MAX {
            return Err(Error::invalid("multipart parts must be at least 5 MiB"));
        }
        if self.delta_chain > crate::model::MAX_DELTA_CHAIN {
            return Err(Error::invalid(format!(
                "a delta chain of {} is longer than readers follow ({})",
                self.delta_chain,
                crate::model::MAX_DELTA_CHAIN
            )));
        }
        if self.record_part_bytes < 256 {
            return Err(Error::invalid(format!(
                "commit record parts of {} bytes are too small (at least 256)",
                self.record_part_bytes
            )));
        }
        if self.sweep_lapse < Duration::from_millis(60) {
            return Err(Error::invalid(format!(
                "a sweep lock's lapse of {:?} is too short to refresh it",
                self.sweep_lapse
            )));
        }
        Ok(())
    }
}

/// One chunk to write: its raw bytes and the element size for byte planes (1 for anything
/// that is not floating point).
#[derive(Debug, Clone)]
pub struct ChunkIn {
    /// Raw bytes (a slice of a staging buffer; never copied for raw chunks on object stores).
    pub data: Bytes,
    /// Element size for the byte-plane codec (2, 4, 8), or 1.
    pub elem: u8,
    /// The chunk at the same region (same tensor, box and chunk) of a committed step, which
    /// this one may be stored as a delta on.
    pub base: Option<BaseChunk>,
}

impl ChunkIn {
    /// A chunk with no delta base.
    pub fn new(data: Bytes, elem: u8) -> Self {
        ChunkIn {
            data,
            elem,
            base: None,
        }
    }
}

/// A delta base candidate: a chunk of a committed step and that step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseChunk {
    /// The committed step whose manifest references `chunk`.
    pub step: u64,
    /// Its reference there.
    pub chunk: ChunkRef,
}

/// Saves for which a chunk whose delta did not pay is not tried again (its successors at the
/// same region are stored plain without reading a base), before the next try.
const DELTA_SKIP_SAVES: u8 = 3;

/// Verdicts carried from a chunk to the chunk that replaces it at the same region in the next
/// save: a chunk present here with `n` is the base of a region whose delta did not pay, and the
/// next `n` saves of that region do not try one. Keyed by the chunk id, so no region names are
/// needed: the next save finds its base's id in it. Bounded: cleared when it grows past
/// [`DELTA_VERDICTS_MAX`] (a forgotten verdict costs one try).
#[derive(Debug, Default)]
struct DeltaVerdicts(Mutex<HashMap<ChunkId, u8>>);

const DELTA_VERDICTS_MAX: usize = 1 << 20;

impl DeltaVerdicts {
    /// Whether a chunk on `base` should try a delta; `id` inherits the verdict.
    fn try_on(&self, base: &ChunkId, id: &ChunkId) -> bool {
        let mut m = self.0.lock().expect("delta verdicts");
        match m.remove(base) {
            Some(n) if n > 0 => {
                m.insert(*id, n - 1);
                false
            }
            _ => true,
        }
    }

    /// Whether the next save of `id`'s region will not try a delta.
    fn rests(&self, id: &ChunkId) -> bool {
        self.0
            .lock()
            .expect("delta verdicts")
            .get(id)
            .is_some_and(|n| *n > 0)
    }

    /// `id`'s delta was tried and did not pay (or its base could not be read).
    fn did_not_pay(&self, id: &ChunkId) {
        let mut m = self.0.lock().expect("delta verdicts");
        if m.len() >= DELTA_VERDICTS_MAX {
            m.clear();
        }
        m.insert(*id, DELTA_SKIP_SAVES);
    }
}

/// What [`Store::put_chunks`] did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PutStats {
    /// Chunks given.
    pub chunks: u64,
    /// Raw bytes given.
    pub bytes: u64,
    /// Chunks skipped because the store has them (or they appeared twice).
    pub chunks_skipped: u64,
    /// Raw bytes of skipped chunks.
    pub bytes_skipped: u64,
    /// Objects written (chunks and packs).
    pub objects_written: u64,
    /// Bytes written, as stored.
    pub bytes_written: u64,
    /// Chunks that had a delta base candidate, and of those, chunks stored as deltas.
    #[serde(default)]
    pub delta_tried: u64,
    /// Chunks stored as deltas.
    #[serde(default)]
    pub delta_stored: u64,
    /// Raw bytes of the chunks written, by codec.
    pub raw_by_codec: HashMap<String, u64>,
    /// Stored bytes of the chunks written, by codec.
    pub stored_by_codec: HashMap<String, u64>,
    /// Seconds from the first chunk to the last write.
    pub seconds: f64,
}

/// The result of [`Store::put_chunks`]: a reference for every chunk given, in order.
#[derive(Debug, Clone)]
pub struct PutReport {
    /// One per input chunk, in input order.
    pub refs: Vec<ChunkRef>,
    /// Figures.
    pub stats: PutStats,
}

/// Decides, chunk by chunk, whether compressing pays, from what the current write measured.
///
/// With compression the pipeline takes `max(S / (compress x cpus), S x ratio / sink)`
/// instead of `S / sink`, so compressing helps only when the compressor, on every CPU,
/// outruns the sink. On a local disk faster than the compressor chunks go raw; on a slow sink
/// (an object store) they are compressed. Only chunks that would wait for a busy writer are
/// candidates, and the first few writes go raw while the sink is measured.
#[derive(Debug)]
struct Governor {
    t0: std::sync::OnceLock<Instant>,
    cpus: usize,
    written: std::sync::atomic::AtomicU64,
    writes: std::sync::atomic::AtomicU64,
    comp_bytes: std::sync::atomic::AtomicU64,
    comp_ns: std::sync::atomic::AtomicU64,
}

impl Governor {
    fn new(cpus: usize) -> Self {
        Governor {
            t0: std::sync::OnceLock::new(),
            cpus: cpus.max(1),
            written: Default::default(),
            writes: Default::default(),
            comp_bytes: Default::default(),
            comp_ns: Default::default(),
        }
    }

    /// A write is about to start: the sink's clock starts with the first one.
    fn write_started(&self) {
        self.t0.get_or_init(Instant::now);
    }

    fn record_write(&self, bytes: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        self.written.fetch_add(bytes as u64, Relaxed);
        self.writes.fetch_add(1, Relaxed);
    }

    fn record_compress(&self, bytes: usize, took: std::time::Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        self.comp_bytes.fetch_add(bytes as u64, Relaxed);
        self.comp_ns.fetch_add(took.as_nanos() as u64, Relaxed);
    }

    fn policy(&self, cfg: &StoreConfig, writers_busy: bool) -> CodecPolicy {
        use std::sync::atomic::Ordering::Relaxed;
        if !cfg.adaptive_codec || cfg.codec == CodecPolicy::Raw {
            return cfg.codec;
        }
        if !writers_busy || self.writes.load(Relaxed) < 8 {
            return CodecPolicy::Raw;
        }
        let Some(t0) = self.t0.get() else {
            return CodecPolicy::Raw;
        };
        let secs = t0.elapsed().as_secs_f64().max(1e-6);
        let sink = self.written.load(Relaxed) as f64 / secs;
        let (cb, cn) = (self.comp_bytes.load(Relaxed), self.comp_ns.load(Relaxed));
        // zstd-1 on byte planes, per core, on the machines measured (BENCHMARKS.md).
        let comp = if cn == 0 {
            400e6
        } else {
            cb as f64 / (cn as f64 / 1e9)
        };
        // Hashing and copying need CPU too: ask for a clear margin.
        if comp * self.cpus as f64 > sink * 1.5 {
            cfg.codec
        } else {
            CodecPolicy::Raw
        }
    }
}

/// Which chunks the store is known to hold, and where.
///
/// A writer seeds it from the newest committed step it builds on (which GC never deletes) and
/// adds what it writes, so a second save of unchanged data costs a hash, not a write. See
/// ARCHITECTURE.md for why it is not seeded from a listing of the whole store.
#[derive(Debug, Default)]
pub struct DedupIndex {
    map: Mutex<HashMap<ChunkId, ChunkRef>>,
    regions: Mutex<Option<(u64, Arc<BaseRegions>)>>,
}

/// The chunks of a committed step's rank manifest by region (tensor, type, shape, box): where
/// a save finds the delta base of each chunk (the chunk at the same region).
#[derive(Debug, Default, Clone)]
pub struct BaseRegions {
    map: HashMap<(String, crate::model::DType, Vec<u64>, crate::model::NdBox), Vec<ChunkRef>>,
}

impl BaseRegions {
    /// The written shards of `m`.
    pub fn of(m: &crate::model::RankManifest) -> Self {
        let map = m
            .tensors
            .iter()
            .filter(|t| t.replica_of.is_none() && t.dtype.is_float())
            .map(|t| {
                (
                    (t.name.clone(), t.dtype, t.shape.clone(), t.bbox.clone()),
                    t.chunks.clone(),
                )
            })
            .collect();
        BaseRegions { map }
    }

    /// The chunks of the shard at exactly this region, if the step saved it.
    pub fn get(
        &self,
        name: &str,
        dtype: crate::model::DType,
        shape: &[u64],
        bbox: &crate::model::NdBox,
    ) -> Option<&[ChunkRef]> {
        self.map
            .get(&(name.to_string(), dtype, shape.to_vec(), bbox.clone()))
            .map(Vec::as_slice)
    }

    /// Shards known.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// No shard known.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

impl DedupIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Where the store holds `id`, if known.
    pub fn get(&self, id: &ChunkId) -> Option<ChunkRef> {
        self.map.lock().expect("dedup index").get(id).cloned()
    }

    /// Record chunks the store holds.
    pub fn extend<'a>(&self, refs: impl IntoIterator<Item = &'a ChunkRef>) {
        let mut m = self.map.lock().expect("dedup index");
        for r in refs {
            m.entry(r.id).or_insert_with(|| r.clone());
        }
    }

    /// The committed step this index was seeded from, by region (delta bases), if known.
    pub fn base_regions(&self) -> Option<(u64, Arc<BaseRegions>)> {
        self.regions.lock().expect("dedup index").clone()
    }

    /// Say that the chunks of committed step `step` are known by region (`regions`): a save
    /// may store its chunks as deltas on them. Only a step whose commit the save's lease found
    /// may be given (FORMAT.md, "What GC may delete").
    pub fn set_base_regions(&self, step: u64, regions: Arc<BaseRegions>) {
        *self.regions.lock().expect("dedup index") = Some((step, regions));
    }

    /// Replace the contents with `refs`.
    pub fn reset<'a>(&self, refs: impl IntoIterator<Item = &'a ChunkRef>) {
        let mut m = self.map.lock().expect("dedup index");
        m.clear();
        for r in refs {
            m.entry(r.id).or_insert_with(|| r.clone());
        }
    }

    /// Number of chunks known.
    pub fn len(&self) -> usize {
        self.map.lock().expect("dedup index").len()
    }

    /// Nothing known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A content-addressed checkpoint store over an [`ObjectStore`].
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    keys: Keys,
    cfg: Arc<StoreConfig>,
    url: Arc<str>,
    failpoints: crate::failpoint::Failpoints,
    metrics: Option<Arc<crate::wrap::StoreMetrics>>,
    local_root: Option<Arc<std::path::Path>>,
    clock: Arc<dyn crate::clock::Clock>,
    delta_cache: Arc<crate::cache::ChunkCache>,
    delta_verdicts: Arc<DeltaVerdicts>,
}

enum Slot {
    Done(ChunkRef),
    SameAs(usize),
    Pending,
}

impl Store {
    /// A store over `inner`, with keys below `prefix`. `url` names it in messages.
    pub fn new(inner: Arc<dyn ObjectStore>, prefix: Path, url: impl Into<String>) -> Self {
        Store {
            inner,
            keys: Keys::new(prefix),
            cfg: Arc::new(StoreConfig::default()),
            url: url.into().into(),
            failpoints: Default::default(),
            metrics: None,
            local_root: None,
            clock: Arc::new(crate::clock::SystemClock),
            delta_cache: crate::cache::ChunkCache::new(0),
            delta_verdicts: Default::default(),
        }
    }

    /// Use `clock` for every wall-clock decision (lock lapses, record timestamps); the
    /// system's clock by default.
    pub fn with_clock(mut self, clock: Arc<dyn crate::clock::Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Now, by this store's clock.
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.clock.now()
    }

    /// Say that the store is a local directory (a [`crate::DirectFs`] at `root`, no prefix),
    /// so that GC and verify also look for temporary files interrupted writes left there.
    pub fn with_local_root(mut self, root: impl Into<std::path::PathBuf>) -> Self {
        self.local_root = Some(Arc::from(root.into()));
        self
    }

    /// The directory of a local store opened with [`Store::with_local_root`].
    pub fn local_root(&self) -> Option<&std::path::Path> {
        self.local_root.as_deref()
    }

    /// Temporary files that interrupted writes left in a local store (none elsewhere: object
    /// stores publish an object whole or not at all).
    pub async fn temp_files(&self) -> Result<Vec<crate::direct::TempFile>> {
        let Some(root) = self.local_root.clone() else {
            return Ok(Vec::new());
        };
        tokio::task::spawn_blocking(move || {
            crate::direct::temp_files(&root)
                .map_err(|e| Error::io("looking for temporary files in", &root.display(), e))
        })
        .await
        .map_err(|e| Error::internal(format!("listing temporary files: {e}")))?
    }

    /// An in-memory store (unit tests).
    pub fn memory() -> Self {
        Store::new(
            Arc::new(object_store::memory::InMemory::new()),
            Path::default(),
            "memory://",
        )
    }

    /// Replace the settings.
    pub fn with_config(mut self, cfg: StoreConfig) -> Result<Self> {
        cfg.validate()?;
        self.delta_cache = crate::cache::ChunkCache::new(cfg.delta_cache_bytes);
        self.cfg = Arc::new(cfg);
        Ok(self)
    }

    /// Arm failpoints on this store (and its clones).
    pub fn with_failpoints(mut self, fp: crate::failpoint::Failpoints) -> Self {
        self.failpoints = fp;
        self
    }

    /// Attach the counters of the [`crate::wrap::MetricsStore`] this store runs over.
    pub fn with_metrics(mut self, m: Arc<crate::wrap::StoreMetrics>) -> Self {
        self.metrics = Some(m);
        self
    }

    /// Request and byte counters, if the store was opened with them ([`crate::open`] does).
    pub fn metrics(&self) -> Option<&Arc<crate::wrap::StoreMetrics>> {
        self.metrics.as_ref()
    }

    /// The failpoints of this store.
    pub fn failpoints(&self) -> &crate::failpoint::Failpoints {
        &self.failpoints
    }

    /// The settings.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// The key layout.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The underlying object store.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// The URL the store was opened from.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Byte ranges of the chunks of a buffer of `len` bytes ([`StoreConfig::chunk_spans`]).
    pub fn chunk_spans(&self, len: u64) -> impl Iterator<Item = std::ops::Range<u64>> + use<> {
        self.cfg.chunk_spans(len)
    }

    // ----- plain objects -------------------------------------------------------------------

    /// Write an object from pieces; multipart when it is larger than the threshold.
    pub async fn put_object(&self, path: &Path, parts: Vec<Bytes>, mode: PutMode) -> Result<()> {
        let len: usize = parts.iter().map(Bytes::len).sum();
        if len > self.cfg.multipart_threshold && matches!(mode, PutMode::Overwrite) {
            return self.put_multipart(path, parts).await;
        }
        let payload: PutPayload = parts.into_iter().collect();
        self.inner
            .put_opts(path, payload, PutOptions::from(mode))
            .await
            .map_err(|e| self.write_error("writing", path, e))?;
        Ok(())
    }

    /// An error of a write to `path`; a full file system says which one.
    fn write_error(&self, op: &str, path: &Path, e: object_store::Error) -> Error {
        let e = Error::backend(op, path, e);
        match &self.local_root {
            Some(root) => e.no_space_at(root.display()),
            None => e.no_space_at(&self.url),
        }
    }

    async fn put_multipart(&self, path: &Path, parts: Vec<Bytes>) -> Result<()> {
        let mut up = self
            .inner
            .put_multipart(path)
            .await
            .map_err(|e| self.write_error("starting multipart upload of", path, e))?;
        let part = self.cfg.multipart_part;
        let mut pending = Vec::new();
        let mut cur: Vec<Bytes> = Vec::new();
        let mut cur_len = 0usize;
        for mut b in parts {
            while !b.is_empty() {
                let take = (part - cur_len).min(b.len());
                cur.push(b.split_to(take));
                cur_len += take;
                if cur_len == part {
                    pending.push(up.put_part(std::mem::take(&mut cur).into_iter().collect()));
                    cur_len = 0;
                }
            }
        }
        if cur_len > 0 {
            pending.push(up.put_part(cur.into_iter().collect()));
        }
        let res = stream::iter(pending)
            .buffer_unordered(4)
            .try_collect::<Vec<_>>()
            .await;
        if let Err(e) = res {
            let _ = up.abort().await;
            return Err(self.write_error("uploading a part of", path, e));
        }
        if let Err(e) = up.complete().await {
            let _ = up.abort().await;
            return Err(self.write_error("completing multipart upload of", path, e));
        }
        Ok(())
    }

    /// Read a whole object.
    pub async fn get_object(&self, path: &Path) -> Result<Bytes> {
        let r = self
            .inner
            .get(path)
            .await
            .map_err(|e| Error::backend("reading", path, e))?;
        r.bytes()
            .await
            .map_err(|e| Error::backend("reading", path, e))
    }

    /// Read a byte range of an object.
    pub async fn get_range(&self, path: &Path, range: std::ops::Range<u64>) -> Result<Bytes> {
        let Some(want) = range.end.checked_sub(range.start) else {
            return Err(Error::invalid(format!(
                "{path}: byte range {}..{} ends before it starts",
                range.start, range.end
            )));
        };
        let b = self
            .inner
            .get_range(path, range.clone())
            .await
            .map_err(|e| Error::backend("reading", path, e))?;
        if b.len() as u64 != want {
            return Err(Error::corrupt(format!(
                "{path}: bytes {}..{} asked, {} returned (the object is truncated)",
                range.start,
                range.end,
                b.len()
            )));
        }
        Ok(b)
    }

    /// Whether an object exists.
    pub async fn exists(&self, path: &Path) -> Result<bool> {
        match self.inner.head(path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(Error::backend("checking", path, e)),
        }
    }

    /// Write a JSON document with `mode` (manifests, commit records).
    pub async fn put_json<T: Serialize>(&self, path: &Path, v: &T, mode: PutMode) -> Result<Hash> {
        let bytes = serde_json::to_vec(v)
            .map_err(|e| Error::internal(format!("serializing {path}: {e}")))?;
        let h = Hash::of(&bytes);
        self.put_object(path, vec![Bytes::from(bytes)], mode)
            .await?;
        Ok(h)
    }

    /// Read and parse a JSON document; returns it with the blake3 of its bytes.
    pub async fn get_json<T: for<'de> Deserialize<'de>>(
        &self,
        path: &Path,
    ) -> Result<(T, Hash, u64)> {
        let b = self.get_object(path).await?;
        let v = serde_json::from_slice(&b).map_err(|e| {
            Error::corrupt(format!(
                "{path}: not a valid {} ({e}; {} bytes, truncated or garbage?)",
                std::any::type_name::<T>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("document"),
                b.len()
            ))
        })?;
        Ok((v, Hash::of(&b), b.len() as u64))
    }

    // ----- chunks --------------------------------------------------------------------------

    /// Write a stream of chunks; returns a reference for each, in order (see the module docs).
    ///
    /// Chunks the index knows, and chunks repeated within the stream, are not written again.
    /// Memory stays within `inflight_bytes` plus one pack, whatever the stream's length; the
    /// stream is pulled only as fast as the store takes the bytes.
    #[instrument(skip_all, fields(store = %self.url))]
    pub async fn put_chunks<S>(&self, input: S, index: &DedupIndex) -> Result<PutReport>
    where
        S: Stream<Item = ChunkIn> + Send,
    {
        self.try_put_chunks(input.map(Ok), index).await
    }

    /// [`Store::put_chunks`] over a stream that may fail (a snapshot that breaks off); the
    /// first error ends the write.
    pub async fn try_put_chunks<S>(&self, input: S, index: &DedupIndex) -> Result<PutReport>
    where
        S: Stream<Item = Result<ChunkIn>> + Send,
    {
        let t0 = Instant::now();
        let cfg = self.cfg.clone();
        let budget = Arc::new(Semaphore::new(cfg.inflight_bytes));
        let governor = Arc::new(Governor::new(cfg.cpu_threads));
        let writers = Arc::new(Semaphore::new(cfg.write_concurrency));
        let mut stats = PutStats::default();
        let mut slots: Vec<Slot> = Vec::new();
        let mut first: HashMap<ChunkId, usize> = HashMap::new();
        let mut tasks: JoinSet<Result<Vec<(usize, ChunkRef)>>> = JoinSet::new();
        let cancel = Arc::new(AtomicBool::new(false));
        // On an error, stop the writes not yet started and wait for those in flight before
        // returning: each removes its own staging file on failure, so a failed save leaves no
        // partial file behind (once it returns) and writes nothing more.
        let res = async {
            let mut pack = PackBuilder::new();
            let mut pack_slots: Vec<(usize, ChunkRef)> = Vec::new();
            let mut pack_permits = Vec::new();

            // Stage 1, in order with read-ahead: hash on the blocking pool.
            let hashed = input
                .map(|c| async move {
                    let c = c?;
                    let len = c.data.len();
                    if len as u64 > MAX_CHUNK_LEN {
                        return Err(Error::invalid(format!(
                            "a chunk of {len} bytes is larger than the format allows ({MAX_CHUNK_LEN})"
                        )));
                    }
                    let data = c.data.clone();
                    let id = tokio::task::spawn_blocking(move || ChunkId::of(&data)).await?;
                    Ok((id, c))
                })
                .buffered(cfg.cpu_threads * 2);
            futures::pin_mut!(hashed);

            while let Some(item) = hashed.next().await {
                let (id, c) = item?;
                let i = slots.len();
                let len = c.data.len();
                stats.chunks += 1;
                stats.bytes += len as u64;
                if let Some(r) = index.get(&id) {
                    stats.chunks_skipped += 1;
                    stats.bytes_skipped += len as u64;
                    slots.push(Slot::Done(r));
                    continue;
                }
                if let Some(&j) = first.get(&id) {
                    stats.chunks_skipped += 1;
                    stats.bytes_skipped += len as u64;
                    slots.push(Slot::SameAs(j));
                    continue;
                }
                first.insert(id, i);
                slots.push(Slot::Pending);
                // Collect finished writes without blocking, to surface errors early.
                while let Some(done) = tasks.try_join_next() {
                    for (slot, r) in done?? {
                        slots[slot] = Slot::Done(r);
                    }
                }
                let permit = budget
                    .clone()
                    .acquire_many_owned(len.max(1) as u32)
                    .await
                    .map_err(|_| Error::internal("in-flight budget closed"))?;
                let policy = governor.policy(&cfg, writers.available_permits() == 0);
                if len < cfg.pack_threshold {
                    let data = c.data.clone();
                    let enc = tokio::task::spawn_blocking(move || {
                        codec::encode(&data, c.elem as usize, policy)
                    })
                    .await?;
                    let r = ChunkRef::plain(id, len as u32, enc.len() as u32, enc.codec);
                    let off = pack.add(id, len as u32, enc);
                    pack_slots.push((i, ChunkRef { offset: off, ..r }));
                    pack_permits.push(permit);
                    if pack.len() >= cfg.pack_target as u64 {
                        let full = std::mem::replace(&mut pack, PackBuilder::new());
                        let ps = std::mem::take(&mut pack_slots);
                        let permits = std::mem::take(&mut pack_permits);
                        self.spawn_pack_write(&mut tasks, &writers, &cancel, full, ps, permits, &mut stats)
                            .await?;
                    }
                    continue;
                }
                let store = self.clone();
                let writers = writers.clone();
                let gov = governor.clone();
                let cancel = cancel.clone();
                let delta_base = c.base.clone().filter(|b| {
                    policy != CodecPolicy::Raw
                        && cfg.delta_chain > 0
                        && matches!(c.elem, 2 | 4 | 8)
                        && len.is_multiple_of(c.elem as usize)
                        && b.chunk.len as usize == len
                        && b.chunk.pack.is_none()
                        && b.chunk.bases.len() < cfg.delta_chain
                        && b.chunk.id != id
                        // A region whose last try did not pay rests for a few saves.
                        && self.delta_verdicts.try_on(&b.chunk.id, &id)
                });
                if delta_base.is_some() {
                    stats.delta_tried += 1;
                }
                tasks.spawn(async move {
                    let data = c.data;
                    let elem = c.elem as usize;
                    let verdicts = store.delta_verdicts.clone();
                    let base = match delta_base {
                        Some(b) => match store.delta_base_plain(&b.chunk).await {
                            Ok(plain) => Some((b, plain)),
                            Err(e) => {
                                debug!(chunk = %id, base = %b.chunk.id, "no delta: base unreadable: {e}");
                                verdicts.did_not_pay(&id);
                                None
                            }
                        },
                        None => None,
                    };
                    let g2 = gov.clone();
                    let data2 = data.clone();
                    let v2 = verdicts.clone();
                    let (enc, delta): (Encoded, Option<BaseChunk>) = tokio::task::spawn_blocking(move || {
                        let t = Instant::now();
                        let data = data2;
                        let mut out = None;
                        if let (Some((b, plain)), CodecPolicy::Compress { level, .. }) = (&base, policy) {
                            // Estimate both on a sample and encode only the smaller: trying a
                            // delta costs 3 % of encoding the chunk, not a second encoding.
                            if codec::estimate_delta(&data, plain, elem, level).pays() {
                                let d = codec::encode_delta(&data, plain, &b.chunk.id, elem, level);
                                if d.len() < data.len() {
                                    out = Some((d, Some(b.clone())));
                                }
                            }
                            if out.is_none() {
                                v2.did_not_pay(&id);
                            }
                        }
                        let out = out.unwrap_or_else(|| (codec::encode(&data, elem, policy), None));
                        if policy != CodecPolicy::Raw {
                            g2.record_compress(data.len(), t.elapsed());
                        }
                        out
                    })
                    .await?;
                    // Keep the plain bytes as the next save's base, unless that save will not
                    // try a delta on them.
                    if store.delta_cache.capacity() >= len as u64
                        && matches!(elem, 2 | 4 | 8)
                        && !verdicts.rests(&id)
                    {
                        store.delta_cache.put(id, Bytes::copy_from_slice(&data));
                    }
                    let mut r = ChunkRef::plain(id, len as u32, enc.len() as u32, enc.codec);
                    let path = match &delta {
                        Some(b) => {
                            r.bases = std::iter::once(b.chunk.id)
                                .chain(b.chunk.bases.iter().copied())
                                .collect();
                            r.base_step = Some(b.step);
                            store.keys.delta_chunk(&id, &b.chunk.id)
                        }
                        None => store.keys.chunk(&id),
                    };
                    let _w = writers
                        .acquire()
                        .await
                        .map_err(|_| Error::internal("writer pool closed"))?;
                    if cancel.load(Ordering::Relaxed) {
                        return Err(Error::internal("the save failed: write not started"));
                    }
                    let stored = enc.len();
                    gov.write_started();
                    store
                        .put_object(&path, enc.parts, PutMode::Overwrite)
                        .await?;
                    gov.record_write(stored);
                    drop(permit);
                    Ok(vec![(i, r)])
                });
                stats.objects_written += 1;
            }
            if !pack.is_empty() {
                self.spawn_pack_write(
                    &mut tasks,
                    &writers,
                    &cancel,
                    pack,
                    pack_slots,
                    pack_permits,
                    &mut stats,
                )
                .await?;
            }
            while let Some(done) = tasks.join_next().await {
                for (slot, r) in done?? {
                    slots[slot] = Slot::Done(r);
                }
            }
            let mut refs: Vec<ChunkRef> = Vec::with_capacity(slots.len());
            for s in &slots {
                let r = match s {
                    Slot::Done(r) => r.clone(),
                    Slot::SameAs(j) => match &slots[*j] {
                        Slot::Done(r) => r.clone(),
                        _ => {
                            return Err(Error::internal(
                                "a duplicate chunk's original was not written",
                            ));
                        }
                    },
                    Slot::Pending => return Err(Error::internal("a chunk was never written")),
                };
                refs.push(r);
            }
            for (i, r) in refs.iter().enumerate() {
                if first.get(&r.id) == Some(&i) {
                    if r.pack.is_none() {
                        stats.bytes_written += r.stored as u64;
                    }
                    if r.is_delta() {
                        stats.delta_stored += 1;
                    }
                    count_codec(&mut stats, r);
                }
            }
            index.extend(refs.iter());
            stats.seconds = t0.elapsed().as_secs_f64();
            debug!(
                chunks = stats.chunks,
                skipped = stats.chunks_skipped,
                objects = stats.objects_written,
                bytes_written = stats.bytes_written,
                "put_chunks done"
            );
            Ok(PutReport { refs, stats })
        }
        .await;
        if res.is_err() {
            cancel.store(true, Ordering::Relaxed);
            while tasks.join_next().await.is_some() {}
        }
        res
    }
    async fn spawn_pack_write(
        &self,
        tasks: &mut JoinSet<Result<Vec<(usize, ChunkRef)>>>,
        writers: &Arc<Semaphore>,
        cancel: &Arc<AtomicBool>,
        pack: PackBuilder,
        slots: Vec<(usize, ChunkRef)>,
        permits: Vec<tokio::sync::OwnedSemaphorePermit>,
        stats: &mut PutStats,
    ) -> Result<()> {
        let (id, _entries, parts) = tokio::task::spawn_blocking(move || pack.seal()).await?;
        let len: usize = parts.iter().map(Bytes::len).sum();
        stats.objects_written += 1;
        stats.bytes_written += len as u64;
        let store = self.clone();
        let writers = writers.clone();
        let cancel = cancel.clone();
        tasks.spawn(async move {
            let path = store.keys.pack(&id);
            let _w = writers
                .acquire()
                .await
                .map_err(|_| Error::internal("writer pool closed"))?;
            if cancel.load(Ordering::Relaxed) {
                return Err(Error::internal("the save failed: write not started"));
            }
            store.put_object(&path, parts, PutMode::Overwrite).await?;
            drop(permits);
            Ok(slots
                .into_iter()
                .map(|(i, r)| {
                    (
                        i,
                        ChunkRef {
                            pack: Some(id),
                            ..r
                        },
                    )
                })
                .collect())
        });
        Ok(())
    }

    /// The object key a chunk reference points at (its chunk object or its pack).
    pub fn object_of(&self, r: &ChunkRef) -> Path {
        match (&r.pack, r.bases.first()) {
            (Some(p), _) => self.keys.pack(p),
            (None, Some(b)) => self.keys.delta_chunk(&r.id, b),
            (None, None) => self.keys.chunk(&r.id),
        }
    }

    /// Every object reading `r` needs: its own, then its delta bases' (nearest first; the
    /// last is stored whole). One object for a chunk that is not a delta.
    pub fn chain_objects(&self, r: &ChunkRef) -> Vec<Path> {
        let mut out = vec![self.object_of(r)];
        for (i, b) in r.bases.iter().enumerate() {
            out.push(match r.bases.get(i + 1) {
                Some(next) => self.keys.delta_chunk(b, next),
                None => self.keys.chunk(b),
            });
        }
        out
    }

    /// The plain bytes of a delta base for a write: from the writer's cache of what it wrote
    /// last (`delta_cache_bytes`), else read back (and verified) through its chain.
    async fn delta_base_plain(&self, r: &ChunkRef) -> Result<Bytes> {
        self.delta_cache
            .get_or_fetch(r.id, || self.get_chunk(r))
            .await
    }

    /// Fetch and decode a delta chunk: every object of its chain (at most `MAX_DELTA_CHAIN +
    /// 1`, fetched in parallel), decoded base-first, each level hash-checked. An error names
    /// the chunk, the base chunk at fault and (where the manifest says) the base's step.
    async fn get_delta_chunk(&self, r: &ChunkRef) -> Result<Bytes> {
        r.check_chain().map_err(Error::corrupt)?;
        let chain: Vec<ChunkId> = std::iter::once(r.id)
            .chain(r.bases.iter().copied())
            .collect();
        let paths = self.chain_objects(r);
        let top = r.location();
        let name = |i: usize| -> String {
            if i == 0 {
                top.clone()
            } else {
                format!(
                    "{top}: its base {} ({} of the chain{})",
                    chain[i],
                    i,
                    if i == 1 {
                        r.base_step
                            .map(|s| format!(", saved at step {s}"))
                            .unwrap_or_default()
                    } else {
                        String::new()
                    }
                )
            }
        };
        let objs = futures::future::try_join_all(paths.iter().enumerate().map(|(i, p)| {
            let name = name(i);
            async move {
                self.get_object(p).await.map_err(|e| {
                    if e.kind() == ErrorKind::NotFound {
                        Error::corrupt(format!("{name} is missing from the store ({p})"))
                    } else {
                        e.context(name)
                    }
                })
            }
        }))
        .await?;
        let names: Vec<String> = (0..chain.len()).map(name).collect();
        let len = r.len as u64;
        let out = tokio::task::spawn_blocking(move || {
            let objs: Vec<&[u8]> = objs.iter().map(|o| o.as_ref()).collect();
            codec::decode_chain(&objs, &chain, len, &names)
        })
        .await??;
        Ok(Bytes::from(out))
    }

    /// Fetch the stored bytes of a chunk object (not decoded).
    pub async fn get_chunk_object(&self, r: &ChunkRef) -> Result<Bytes> {
        let path = self.object_of(r);
        let b = match &r.pack {
            Some(_) => {
                let end = r.offset.checked_add(r.stored as u64).ok_or_else(|| {
                    Error::corrupt(format!(
                        "chunk {}: offset {} + {} stored bytes overflows",
                        r.location(),
                        r.offset,
                        r.stored
                    ))
                })?;
                self.get_range(&path, r.offset..end).await?
            }
            None => self.get_object(&path).await?,
        };
        Ok(b)
    }

    /// Fetch, decode and verify one chunk (a delta with its chain of bases): the one place
    /// every reader (restore, export, the mount, diff, verify) decodes chunks from the store.
    pub async fn get_chunk(&self, r: &ChunkRef) -> Result<Bytes> {
        if r.is_delta() || r.codec == Codec::Delta {
            return self.get_delta_chunk(r).await;
        }
        let obj = self.get_chunk_object(r).await.map_err(|e| {
            if e.kind() == ErrorKind::NotFound {
                Error::corrupt(format!(
                    "chunk {} is missing from the store ({e})",
                    r.location()
                ))
            } else {
                e
            }
        })?;
        let r = r.clone();
        let what = r.location();
        tokio::task::spawn_blocking(move || codec::decode_bytes(obj, &r.id, r.len as u64, &what))
            .await?
    }

    /// Fetch many chunks in parallel (bounded by `read_concurrency`); yields `(index, bytes)`
    /// as they arrive.
    pub fn get_chunks(
        &self,
        refs: Vec<ChunkRef>,
    ) -> impl Stream<Item = Result<(usize, Bytes)>> + Send + use<> {
        let store = self.clone();
        let n = self.cfg.read_concurrency;
        stream::iter(refs.into_iter().enumerate())
            .map(move |(i, r)| {
                let store = store.clone();
                async move { store.get_chunk(&r).await.map(|b| (i, b)) }
            })
            .buffer_unordered(n)
    }

    /// Whether the store holds the chunk object of `id` (one HEAD request). Packed chunks are
    /// found through manifests, not this.
    pub async fn has_chunk_object(&self, id: &ChunkId) -> Result<bool> {
        self.exists(&self.keys.chunk(id)).await
    }
}

fn count_codec(stats: &mut PutStats, r: &ChunkRef) {
    let name = match r.codec {
        Codec::Raw => "raw",
        Codec::Zstd => "zstd",
        Codec::Planes => "planes",
        Codec::Delta => "delta",
    };
    *stats.raw_by_codec.entry(name.to_string()).or_default() += r.len as u64;
    *stats.stored_by_codec.entry(name.to_string()).or_default() += r.stored as u64;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_whose_delta_did_not_pay_rests_then_tries_again() {
        let v = DeltaVerdicts::default();
        let id = |n: u8| ChunkId::of(&[n]);
        // Save 1: chunk 1 on base 0 is tried and does not pay.
        assert!(v.try_on(&id(0), &id(1)));
        v.did_not_pay(&id(1));
        assert!(v.rests(&id(1)));
        // The next DELTA_SKIP_SAVES saves of that region do not try (nor keep a base).
        let mut last = 1;
        for n in 2..2 + DELTA_SKIP_SAVES {
            assert!(!v.try_on(&id(last), &id(n)), "save {n}");
            last = n;
        }
        assert!(
            !v.rests(&id(last)),
            "the save after the rest needs this base"
        );
        // Then it tries again; a chunk that paid leaves nothing behind.
        assert!(v.try_on(&id(last), &id(100)));
        assert!(v.0.lock().unwrap().is_empty());
        // Other regions are not affected.
        v.did_not_pay(&id(1));
        assert!(v.try_on(&id(50), &id(51)));
    }
}
