//! The read engine: any n-d box of any tensor of a committed step, fetching only the chunks
//! that intersect it, in parallel, with bounded memory. Resharding restore, the FUSE view and
//! export all read through [`StepReader`].
//!
//! A read is planned first ([`StepReader::plan`]: which chunks, which byte runs go where, no
//! I/O beyond manifests), then executed: chunks are fetched `read_concurrency` at a time
//! (from a [`ChunkSource`] such as a peer's memory or a cache first, the store otherwise),
//! checked against their hash, and scattered into the destination.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{StreamExt, stream};
use parking_lot::Mutex;
use serde::Serialize;
use tracing::{instrument, warn};

use crate::error::{Error, ErrorKind, Result};
use crate::id::{ChunkId, StepId};
use crate::model::{ChunkRef, CommitRecord, DType, NdBox, RankManifest, copy_runs};
use crate::store::{Store, StoredChunk};

/// Somewhere chunks may be found before the object store: a peer's memory, a local tier.
/// What it returns need not be checked: the reader checks it against the chunk's hash (as it
/// copies it out, where it can), and a mismatch falls back to the store.
#[async_trait]
pub trait ChunkSource: Send + Sync {
    /// The raw bytes of `r`, if this source has them.
    async fn fetch(&self, r: &ChunkRef) -> Option<Bytes>;

    /// The bytes this source returned for `r` failed their hash, and the reader reads the
    /// store instead: a source that counts what it served takes them back (and says where the
    /// damage is) here.
    fn refused(&self, _r: &ChunkRef) {}
}

/// A chunk fetched for a copy ([`StepReader::fetch_for_copy`]).
#[derive(Debug)]
pub struct Fetched {
    /// The chunk's raw bytes, or its stored objects for the caller to decode where it wants
    /// the bytes.
    pub bytes: FetchedBytes,
    /// What fetching it cost (`bytes_copied` is the caller's).
    pub stats: ReadStats,
    /// Whether they were hash-checked already; if not, the caller hashes them (an encoded
    /// chunk is checked as it is decoded: [`StoredChunk::decode_into`]).
    pub checked: bool,
    /// Whether they came from the chunk source.
    pub from_source: bool,
}

/// What [`StepReader::fetch_for_copy`] fetched.
#[derive(Debug)]
pub enum FetchedBytes {
    /// The chunk's raw bytes.
    Plain(Bytes),
    /// A chunk stored encoded (compressed, byte planes, a delta chain), as stored: decoding it
    /// straight into the destination writes each byte once.
    Encoded(StoredChunk),
}

/// One byte run to copy out of a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CopyOp {
    /// Offset in the chunk's raw bytes.
    pub src: u64,
    /// Offset in the destination buffer.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// A chunk a read needs and what to copy out of it.
#[derive(Debug, Clone, Serialize)]
pub struct PlannedChunk {
    /// The chunk.
    pub chunk: ChunkRef,
    /// The rank whose manifest lists it.
    pub rank: u32,
    /// The runs to copy.
    pub copies: Vec<CopyOp>,
}

impl PlannedChunk {
    /// Whether the read needs only part of the chunk: the rest is another box's (another rank
    /// of a resharded restore reads it too), so the chunk is read through the page cache
    /// ([`crate::shared_reads`]) and the node's disk serves it once.
    pub fn is_partial(&self) -> bool {
        self.copies.iter().map(|c| c.len).sum::<u64>() < u64::from(self.chunk.len)
    }
}

/// What reading a box of a tensor costs, before reading it.
#[derive(Debug, Clone, Serialize)]
pub struct ReadPlan {
    /// Tensor name.
    pub tensor: String,
    /// Element type.
    pub dtype: DType,
    /// The box read.
    pub bbox: NdBox,
    /// Chunks to fetch.
    pub chunks: Vec<PlannedChunk>,
}

impl ReadPlan {
    /// Bytes of the destination.
    pub fn bytes_needed(&self) -> u64 {
        self.bbox.numel() * self.dtype.size() as u64
    }
    /// Raw bytes of the chunks fetched.
    pub fn raw_bytes_fetched(&self) -> u64 {
        self.chunks.iter().map(|c| c.chunk.len as u64).sum()
    }
    /// Stored bytes of the chunks fetched (what crosses the wire).
    pub fn stored_bytes_fetched(&self) -> u64 {
        self.chunks.iter().map(|c| c.chunk.stored as u64).sum()
    }
}

/// Figures of one read.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ReadStats {
    /// Chunks fetched.
    pub chunks: u64,
    /// Raw bytes decoded.
    pub raw_bytes: u64,
    /// Stored bytes fetched from the store.
    pub stored_bytes: u64,
    /// Raw bytes served by a [`ChunkSource`].
    pub source_bytes: u64,
    /// Raw bytes another process of this node fetched from the store (a
    /// [`NodeCache`](crate::NodeCache)).
    pub node_bytes: u64,
    /// Bytes written to the destination.
    pub bytes_copied: u64,
    /// Stored bytes read from the fallback store ([`StepReader::with_fallback`]: a local
    /// tier's remote store), for chunks the reader's own store could not serve.
    pub fallback_bytes: u64,
    /// Chunks the reader's own store could not serve (missing, or damaged: read again from the
    /// fallback store).
    pub fallback_chunks: u64,
}

impl ReadStats {
    /// Add another read's figures.
    pub fn add(&mut self, o: &ReadStats) {
        self.chunks += o.chunks;
        self.raw_bytes += o.raw_bytes;
        self.stored_bytes += o.stored_bytes;
        self.source_bytes += o.source_bytes;
        self.node_bytes += o.node_bytes;
        self.bytes_copied += o.bytes_copied;
        self.fallback_bytes += o.fallback_bytes;
        self.fallback_chunks += o.fallback_chunks;
    }
}

/// Reads a committed step.
#[derive(Clone)]
pub struct StepReader {
    store: Store,
    commit: Arc<CommitRecord>,
    id: StepId,
    manifests: Arc<Mutex<HashMap<u32, Arc<RankManifest>>>>,
    source: Option<Arc<dyn ChunkSource>>,
    node: Option<Arc<crate::NodeCache>>,
    cache: Option<Arc<crate::cache::ChunkCache>>,
    fallback: Option<Store>,
    /// Every read through the page cache, not only partial ones ([`StepReader::shared`]).
    shared: bool,
    /// What the blob reads fetched, and from where ([`StepReader::blob_stats`]).
    blob_stats: Arc<Mutex<ReadStats>>,
}

/// Where a chunk the store served came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// This process read the reader's store.
    Store,
    /// Another process of the node read it (the node cache).
    Node,
    /// The reader's store could not serve it: the fallback store did.
    Fallback,
}

impl std::fmt::Debug for StepReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StepReader({}@{})", self.commit.run, self.commit.step)
    }
}

impl StepReader {
    /// Open a committed step.
    pub async fn open(store: &Store, run: &str, step: u64) -> Result<Self> {
        let (commit, id) = store.log().read_commit(run, step).await?;
        Ok(Self::of_record(store, commit, id))
    }

    fn of_record(store: &Store, commit: CommitRecord, id: StepId) -> Self {
        StepReader {
            store: store.clone(),
            commit: Arc::new(commit),
            id,
            manifests: Arc::default(),
            source: None,
            node: None,
            cache: None,
            fallback: None,
            shared: false,
            blob_stats: Arc::default(),
        }
    }

    /// Open a committed step to read only the tensors `names` (a restoring rank's own): of a
    /// split commit record (format 5) it reads the root and the parts that hold those tensors,
    /// so the metadata a rank reads does not grow with the world size; a record written whole
    /// is read whole. [`StepReader::commit`] then lists only those parts' tensors (a tensor not
    /// among them is not found), and [`StepReader::manifest`] finds any rank's manifest (the
    /// entry of a rank those parts do not name is read from its ranks part).
    pub async fn open_tensors(
        store: &Store,
        run: &str,
        step: u64,
        names: impl IntoIterator<Item = impl Into<String>>,
    ) -> Result<Self> {
        let names: std::collections::BTreeSet<String> = names.into_iter().map(Into::into).collect();
        let (commit, id) = store.log().read_commit_for(run, step, &names).await?;
        Ok(Self::of_record(store, commit, id))
    }

    /// Open the newest committed step of `run`.
    pub async fn open_latest(store: &Store, run: &str) -> Result<Self> {
        let step = store.log().require_latest(run).await?;
        Self::open(store, run, step).await
    }

    /// Fetch each chunk the store must serve through `node`, the node's shared cache: once per
    /// node rather than once per rank.
    pub fn with_node_cache(mut self, node: Arc<crate::NodeCache>) -> Self {
        self.node = Some(node);
        self
    }

    /// Read every chunk through the page cache ([`crate::shared_reads`]), not only those a
    /// read needs part of: for a caller that knows other processes of the node read the same
    /// chunks whole (data-parallel replicas loaded by every rank), so the disk serves them
    /// once. Without it a chunk read whole goes around the page cache (`O_DIRECT`).
    pub fn shared(mut self, shared: bool) -> Self {
        self.shared = shared;
        self
    }

    /// Read a chunk that the store cannot serve (missing, or damaged: its bytes do not hash to
    /// its id) from `fallback` instead, which holds the same objects (a local tier's remote
    /// store): counted in [`ReadStats::fallback_chunks`] and logged, never an error unless the
    /// fallback fails too.
    pub fn with_fallback(mut self, fallback: Store) -> Self {
        self.fallback = Some(fallback);
        self
    }

    /// Consult `source` before the store for every chunk.
    pub fn with_source(mut self, source: Arc<dyn ChunkSource>) -> Self {
        self.source = Some(source);
        self
    }

    /// Share decoded chunks through `cache` (readers of one process restoring onto a new
    /// layout then fetch each chunk once).
    pub fn with_cache(mut self, cache: Arc<crate::cache::ChunkCache>) -> Self {
        self.cache = Some(cache);
        self
    }

    /// The commit record.
    pub fn commit(&self) -> &CommitRecord {
        &self.commit
    }

    /// The step's id (blake3 of its commit record).
    pub fn id(&self) -> StepId {
        self.id
    }

    /// The store read from.
    pub fn store(&self) -> &Store {
        &self.store
    }

    fn what(&self) -> String {
        format!("step {} of run {}", self.commit.step, self.commit.run)
    }

    /// A rank's manifest (cached), checked against the hash in the commit record.
    pub async fn manifest(&self, rank: u32) -> Result<Arc<RankManifest>> {
        if let Some(m) = self.manifests.lock().get(&rank) {
            return Ok(m.clone());
        }
        let listed = self.commit.ranks.iter().find(|e| e.rank == rank).cloned();
        // A reader opened for some tensors of a split record holds the rank entries those
        // tensors name; another rank's is in its ranks part.
        let entry = match listed {
            Some(e) => Some(e),
            None if rank < self.commit.layout.world() => {
                self.store.log().read_rank_entry(&self.commit, rank).await?
            }
            None => None,
        };
        let entry = entry.ok_or_else(|| {
            Error::not_found(format!("{}: rank {rank} is not part of it", self.what()))
        })?;
        let m = Arc::new(
            self.store
                .log()
                .read_rank_manifest(&self.commit.run, self.commit.step, rank, Some(&entry))
                .await?,
        );
        self.manifests.lock().insert(rank, m.clone());
        Ok(m)
    }

    /// Plan reading `bbox` of `tensor`: the chunks that intersect it and the runs to copy.
    pub async fn plan(&self, tensor: &str, bbox: &NdBox) -> Result<ReadPlan> {
        let t = self.commit.tensor(tensor).ok_or_else(|| {
            Error::not_found(format!("{}: no tensor named {tensor:?}", self.what()))
        })?;
        if !bbox.within(&t.shape) {
            return Err(Error::invalid(format!(
                "{}: box {bbox} does not fit tensor {tensor:?} of shape {:?}",
                self.what(),
                t.shape
            )));
        }
        let elem = t.dtype.size();
        let mut by_chunk: HashMap<ChunkId, PlannedChunk> = HashMap::new();
        let mut order: Vec<ChunkId> = Vec::new();
        for s in &t.shards {
            let Some(region) = s.bbox.intersect(bbox) else {
                continue;
            };
            let m = self.manifest(s.rank).await?;
            let shard = m.written_shard(tensor, &s.bbox).ok_or_else(|| {
                Error::corrupt(format!(
                    "{}: the commit record places tensor {tensor:?} box {} on rank {}, whose manifest does not hold it",
                    self.what(),
                    s.bbox,
                    s.rank
                ))
            })?;
            if (shard.dtype, &shard.shape) != (t.dtype, &t.shape) {
                return Err(Error::corrupt(format!(
                    "{}: the commit record says tensor {tensor:?} is {} {:?}, rank {}'s manifest {} {:?} (damaged)",
                    self.what(),
                    t.dtype,
                    t.shape,
                    s.rank,
                    shard.dtype,
                    shard.shape
                )));
            }
            // Start offset of every chunk in the shard's bytes.
            let mut starts = Vec::with_capacity(shard.chunks.len());
            let mut acc = 0u64;
            for c in &shard.chunks {
                starts.push(acc);
                acc += c.len as u64;
            }
            copy_runs(&s.bbox, bbox, &region, elem, |src, dst, len| {
                let (mut src, mut dst, mut len) = (src, dst, len);
                let mut k = starts.partition_point(|&st| st <= src) - 1;
                while len > 0 {
                    let c = &shard.chunks[k];
                    let in_chunk = src - starts[k];
                    let take = (c.len as u64 - in_chunk).min(len);
                    let pc = by_chunk.entry(c.id).or_insert_with(|| {
                        order.push(c.id);
                        PlannedChunk {
                            chunk: c.clone(),
                            rank: s.rank,
                            copies: Vec::new(),
                        }
                    });
                    pc.copies.push(CopyOp {
                        src: in_chunk,
                        dst,
                        len: take,
                    });
                    src += take;
                    dst += take;
                    len -= take;
                    k += 1;
                }
            });
        }
        let chunks = order
            .into_iter()
            .map(|id| by_chunk.remove(&id).expect("planned"))
            .collect();
        Ok(ReadPlan {
            tensor: tensor.to_string(),
            dtype: t.dtype,
            bbox: bbox.clone(),
            chunks,
        })
    }

    async fn fetch(&self, r: &ChunkRef, stats: &mut ReadStats, ask_source: bool) -> Result<Bytes> {
        if let Some(src) = self.source.as_ref().filter(|_| ask_source)
            && let Some(b) = src.fetch(r).await
        {
            let (b, ok) = tokio::task::spawn_blocking({
                let id = r.id;
                move || {
                    let ok = ChunkId::of(&b) == id;
                    (b, ok)
                }
            })
            .await?;
            if ok && b.len() == r.len as usize {
                stats.source_bytes += r.len as u64;
                return Ok(b);
            }
            warn!(chunk = %r.id, "a chunk source returned damaged bytes; reading the store");
            src.refused(r);
        }
        // Where the chunk came from (`None`: the chunk cache had it).
        let mut origin = None;
        let b = match &self.cache {
            Some(c) => {
                c.get_or_fetch(r.id, || async {
                    let (b, o) = self.fetch_stored(r).await?;
                    origin = Some(o);
                    Ok(b)
                })
                .await?
            }
            None => {
                let (b, o) = self.fetch_stored(r).await?;
                origin = Some(o);
                b
            }
        };
        match origin {
            Some(Origin::Store) => stats.stored_bytes += r.stored as u64,
            Some(Origin::Node) => stats.node_bytes += r.len as u64,
            Some(Origin::Fallback) => {
                stats.fallback_bytes += r.stored as u64;
                stats.fallback_chunks += 1;
            }
            None => {}
        }
        Ok(b)
    }

    /// A chunk from the store, through the node cache when there is one; from the fallback
    /// store when the store cannot serve it.
    async fn fetch_stored(&self, r: &ChunkRef) -> Result<(Bytes, Origin)> {
        let got = match &self.node {
            Some(n) => n
                .get_or_fetch(r, || self.store.chunks().get_chunk(r))
                .await
                .map(|(b, mine)| (b, if mine { Origin::Store } else { Origin::Node })),
            None => self
                .store
                .chunks()
                .get_chunk(r)
                .await
                .map(|b| (b, Origin::Store)),
        };
        match (got, &self.fallback) {
            (Err(e), Some(fb)) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::Corrupt) => {
                warn!(chunk = %r.id, "{}: {e}; reading it from {}", self.what(), fb.url());
                let b = fb
                    .chunks()
                    .get_chunk(r)
                    .await
                    .map_err(|e2| e2.context(format!("{e}; and from {} too", fb.url())))?;
                Ok((b, Origin::Fallback))
            }
            (got, _) => got,
        }
    }

    /// The checked bytes of a planned chunk from the fallback store, for a caller whose copy
    /// from the store failed its hash ([`StepReader::check_fetched`]); `None` without a
    /// fallback.
    pub async fn fetch_fallback(
        &self,
        pc: &PlannedChunk,
        tensor: &str,
    ) -> Result<Option<(Bytes, ReadStats)>> {
        let Some(fb) = &self.fallback else {
            return Ok(None);
        };
        warn!(chunk = %pc.chunk.id, "{}: damaged in {}; reading it from {}", self.what(), self.store.url(), fb.url());
        let b = fb
            .chunks()
            .get_chunk(&pc.chunk)
            .await
            .map_err(|e| e.context(self.chunk_context(pc, tensor)))?;
        let st = ReadStats {
            chunks: 1,
            raw_bytes: b.len() as u64,
            fallback_bytes: pc.chunk.stored as u64,
            fallback_chunks: 1,
            ..ReadStats::default()
        };
        Ok(Some((b, st)))
    }

    /// The plain, hash-checked bytes of a planned chunk of `tensor` (from the chunk source, the
    /// caches or the store), and what fetching it cost (`chunks` and `raw_bytes` counted; not
    /// `bytes_copied`, which is the caller's). An error names the step, the tensor and the rank
    /// whose shard holds the chunk. The engine behind [`StepReader::execute`], for callers that
    /// scatter a chunk's runs themselves (a restore writing straight into its sinks).
    pub async fn fetch_planned(
        &self,
        pc: &PlannedChunk,
        tensor: &str,
    ) -> Result<(Bytes, ReadStats)> {
        self.fetch_checked(pc, tensor, true).await
    }

    /// [`StepReader::fetch_planned`] without asking the chunk source: for a caller whose copy
    /// from the source failed its hash.
    pub async fn fetch_planned_stored(
        &self,
        pc: &PlannedChunk,
        tensor: &str,
    ) -> Result<(Bytes, ReadStats)> {
        warn!(chunk = %pc.chunk.id, "a chunk source returned damaged bytes; reading the store");
        if let Some(src) = &self.source {
            src.refused(&pc.chunk);
        }
        self.fetch_checked(pc, tensor, false).await
    }

    async fn fetch_checked(
        &self,
        pc: &PlannedChunk,
        tensor: &str,
        ask_source: bool,
    ) -> Result<(Bytes, ReadStats)> {
        let mut st = ReadStats::default();
        let fetch = self.fetch(&pc.chunk, &mut st, ask_source);
        let got = if pc.is_partial() || self.shared {
            crate::shared_reads(fetch).await
        } else {
            fetch.await
        };
        let b = got.map_err(|e| e.context(self.chunk_context(pc, tensor)))?;
        st.chunks += 1;
        st.raw_bytes += b.len() as u64;
        Ok((b, st))
    }

    /// The raw bytes of a planned chunk of `tensor` for a caller that copies them out, **not
    /// always hash-checked yet** ([`Fetched::checked`]): what the chunk source has (a peer's
    /// memory, a local tier), or a chunk stored raw with nothing in front of the store, arrive
    /// unchecked, for the caller to hash while it copies (one pass over memory instead of
    /// two) and to refuse with [`StepReader::check_fetched`] (a source's copy: to read again
    /// with [`StepReader::fetch_planned_stored`]); a chunk stored encoded with nothing in
    /// front of the store arrives as stored ([`FetchedBytes::Encoded`]), for the caller to
    /// decode where it wants the bytes; anything else arrives checked, as from
    /// [`StepReader::fetch_planned`]. The source is asked once.
    pub async fn fetch_for_copy(&self, pc: &PlannedChunk, tensor: &str) -> Result<Fetched> {
        if let Some(src) = &self.source
            && let Some(b) = src.fetch(&pc.chunk).await
            && b.len() == pc.chunk.len as usize
        {
            let stats = ReadStats {
                chunks: 1,
                raw_bytes: b.len() as u64,
                source_bytes: b.len() as u64,
                ..ReadStats::default()
            };
            return Ok(Fetched {
                bytes: FetchedBytes::Plain(b),
                stats,
                checked: false,
                from_source: true,
            });
        }
        if let Some((bytes, stats)) = self.fetch_unchecked(pc, tensor).await? {
            return Ok(Fetched {
                bytes,
                stats,
                checked: false,
                from_source: false,
            });
        }
        let (b, stats) = self.fetch_checked(pc, tensor, false).await?;
        Ok(Fetched {
            bytes: FetchedBytes::Plain(b),
            stats,
            checked: true,
            from_source: false,
        })
    }

    /// A chunk not yet checked, straight from the store: a raw one's payload, or an encoded
    /// one's objects; `None` with a node cache or a chunk cache in front of the store (they
    /// serve checked bytes).
    async fn fetch_unchecked(
        &self,
        pc: &PlannedChunk,
        tensor: &str,
    ) -> Result<Option<(FetchedBytes, ReadStats)>> {
        let cached = self.cache.as_ref().is_some_and(|c| c.capacity() > 0);
        if self.node.is_some() || cached {
            return Ok(None);
        }
        let chunks = self.store.chunks();
        let fetch = chunks.get_stored(&pc.chunk);
        let got = if pc.is_partial() || self.shared {
            crate::shared_reads(fetch).await
        } else {
            fetch.await
        };
        let stored = match (got, &self.fallback) {
            // Missing or damaged here: read through the fallback (a local tier's remote).
            (Err(e), Some(_)) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::Corrupt) => {
                return Ok(None);
            }
            (got, _) => got.map_err(|e| self.chunk_error(pc, tensor, e))?,
        };
        let bytes = match stored
            .raw_unchecked()
            .map_err(|e| self.chunk_error(pc, tensor, e))?
        {
            Some(b) => FetchedBytes::Plain(b),
            None => FetchedBytes::Encoded(stored),
        };
        let st = ReadStats {
            chunks: 1,
            raw_bytes: pc.chunk.len as u64,
            stored_bytes: pc.chunk.stored as u64,
            ..ReadStats::default()
        };
        Ok(Some((bytes, st)))
    }

    /// Refuse a chunk fetched by [`StepReader::fetch_for_copy`] whose bytes hash to `got`
    /// rather than to its id, with the words of every other read's refusal.
    pub fn check_fetched(&self, pc: &PlannedChunk, tensor: &str, got: ChunkId) -> Result<()> {
        crate::codec::check_id_of(got, &pc.chunk.id, &pc.chunk.location())
            .map_err(|e| self.chunk_error(pc, tensor, e))
    }

    /// `e`, about a planned chunk of `tensor`, with where the chunk is: the step, the tensor
    /// and the rank whose shard holds it.
    pub fn chunk_error(&self, pc: &PlannedChunk, tensor: &str, e: Error) -> Error {
        e.context(self.chunk_context(pc, tensor))
    }

    fn chunk_context(&self, pc: &PlannedChunk, tensor: &str) -> String {
        format!(
            "{}: tensor {tensor:?} (shard of rank {})",
            self.what(),
            pc.rank
        )
    }

    /// Execute a plan into `out` (which must be the plan's box, row-major): `read_concurrency`
    /// chunks in flight (on a local disk at most two more than `cpu_threads`, see
    /// [`StepReader::call_concurrency`]), within twice their bytes stored raw (a delta chain
    /// holds more: fewer of them are in flight).
    pub async fn execute(&self, plan: &ReadPlan, out: &mut [u8]) -> Result<ReadStats> {
        if out.len() as u64 != plan.bytes_needed() {
            return Err(Error::invalid(format!(
                "destination of {} bytes for {} bytes of tensor {:?}",
                out.len(),
                plan.bytes_needed(),
                plan.tensor
            )));
        }
        // At most `read_concurrency` chunks in flight, and about twice their bytes when they
        // are stored raw: a chunk holds its share of that from its fetch until it is copied
        // out (`ChunkRef::read_bytes_bound`: a delta chain's objects and planes weigh several
        // chunks; one larger than the whole budget takes all of it).
        let cfg = self.store.config();
        let n = self.call_concurrency();
        let budget_kib = ((2 * n * cfg.chunk_size) >> 10).clamp(1, u32::MAX as usize);
        let held = &tokio::sync::Semaphore::new(budget_kib);
        let mut fetched = stream::iter(plan.chunks.iter())
            .map(|pc| async move {
                let need = (pc.chunk.read_bytes_bound() >> 10).clamp(1, budget_kib) as u32;
                let share = held
                    .acquire_many(need)
                    .await
                    .map_err(|_| Error::internal("the read's budget closed"))?;
                let (b, st) = self.fetch_planned(pc, &plan.tensor).await?;
                Ok::<_, Error>((pc, b, st, share))
            })
            .buffer_unordered(n);
        let mut stats = ReadStats::default();
        while let Some(r) = fetched.next().await {
            let (pc, b, st, _share) = r?;
            stats.add(&st);
            for c in &pc.copies {
                let (s, d, l) = (c.src as usize, c.dst as usize, c.len as usize);
                out[d..d + l].copy_from_slice(&b[s..s + l]);
                stats.bytes_copied += c.len;
            }
        }
        Ok(stats)
    }

    /// Chunks one call of [`StepReader::execute`] keeps in flight. A call's chunks land
    /// together at its end, and its task checks and copies them one after another: from a
    /// local disk, more of them than the cores check as they land leave the disk idle at the
    /// end of every call, which a caller reading one tensor a call (Python's
    /// `Reader.read_into` over a state dict) pays once a tensor. So a local store's calls keep
    /// at most `cpu_threads + 2` in flight: enough for the disk's bandwidth on a tensor of any
    /// size (BENCHMARKS.md, "One call's reads from a local disk"). A remote store's keep
    /// `read_concurrency`: its latency needs them.
    pub fn call_concurrency(&self) -> usize {
        let cfg = self.store.config();
        match self.store.local_root() {
            Some(_) => cfg.read_concurrency.min(cfg.cpu_threads + 2),
            None => cfg.read_concurrency,
        }
        .max(1)
    }

    /// Read `bbox` of `tensor` into `out` (row-major bytes of the box).
    #[instrument(skip_all, fields(tensor, bbox = %bbox))]
    pub async fn read_into(&self, tensor: &str, bbox: &NdBox, out: &mut [u8]) -> Result<ReadStats> {
        let plan = self.plan(tensor, bbox).await?;
        self.execute(&plan, out).await
    }

    /// Read `bbox` of `tensor` into a new buffer.
    pub async fn read(&self, tensor: &str, bbox: &NdBox) -> Result<Vec<u8>> {
        let plan = self.plan(tensor, bbox).await?;
        let mut out = vec![0u8; plan.bytes_needed() as usize];
        self.execute(&plan, &mut out).await?;
        Ok(out)
    }

    /// Read a whole tensor.
    pub async fn read_tensor(&self, tensor: &str) -> Result<Vec<u8>> {
        let t = self.commit.tensor(tensor).ok_or_else(|| {
            Error::not_found(format!("{}: no tensor named {tensor:?}", self.what()))
        })?;
        self.read(tensor, &NdBox::full(&t.shape)).await
    }

    /// What this reader's blob reads ([`StepReader::read_blob`]) fetched so far, and from
    /// where: a restore counts a blob chunk its fallback served as it counts a tensor's.
    pub fn blob_stats(&self) -> ReadStats {
        self.blob_stats.lock().clone()
    }

    /// Read a blob saved by `rank`.
    pub async fn read_blob(&self, rank: u32, name: &str) -> Result<Vec<u8>> {
        let m = self.manifest(rank).await?;
        let b = m.blobs.iter().find(|b| b.name == name).ok_or_else(|| {
            Error::not_found(format!(
                "{}: rank {rank} saved no blob named {name:?}",
                self.what()
            ))
        })?;
        let mut out = vec![0u8; b.len as usize];
        let mut at = Vec::with_capacity(b.chunks.len());
        let mut acc = 0usize;
        for c in &b.chunks {
            at.push(acc);
            acc += c.len as usize;
        }
        // Each chunk as a tensor's: from the chunk source first (a machine's local tier),
        // hash-checked, then the store, then the fallback store.
        let mut s = stream::iter(b.chunks.clone().into_iter().enumerate())
            .map(|(i, c)| async move {
                let mut stats = ReadStats::default();
                let b = self.fetch(&c, &mut stats, true).await;
                self.blob_stats.lock().add(&stats);
                b.map(|b| (i, b))
            })
            .buffer_unordered(8);
        while let Some(r) = s.next().await {
            let (i, bytes) =
                r.map_err(|e| e.context(format!("{}: blob {name:?} of rank {rank}", self.what())))?;
            out[at[i]..at[i] + bytes.len()].copy_from_slice(&bytes);
        }
        Ok(out)
    }
}
