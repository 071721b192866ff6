//! Writing one rank's part of a step: shards and blobs in, chunks and a rank manifest out.

use bytes::Bytes;
use futures::stream::{self, Stream, StreamExt};
use tracing::instrument;

use crate::clock::now_ms;
use crate::error::{Error, Result};
use crate::id::ChunkId;
use crate::keys::validate_run;
use crate::model::{
    BlobEntry, ChunkRef, DELTA_FORMAT_VERSION, DType, FORMAT_VERSION, HashedChunk, Layout, NdBox,
    RankEntry, RankManifest, TensorShard, TensorSpec, WriteStats, validate_name,
};
use crate::store::{BaseChunk, ChunkIn, DedupIndex, PutStats, Store};

/// A shard described without its bytes: the tensor, the box this rank holds, who writes its
/// bytes and how the tensor is placed. [`ShardIn`] adds the bytes, [`ShardMeta`] the chunks
/// an unchanged shard reuses; its manifest entry is [`ShardDesc::into_tensor`].
#[derive(Debug, Clone)]
pub struct ShardDesc {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// This rank's box.
    pub bbox: NdBox,
    /// For a replica: the rank that writes the bytes (none come from this one).
    pub replica_of: Option<u32>,
    /// How the tensor is placed across ranks (recorded so other layouts can be planned).
    pub placement: Option<crate::placement::Placement>,
}

impl ShardDesc {
    /// The box `bbox` of `spec` that a placement gives a rank (`replica_of`: the rank that
    /// writes it, when this one holds a replica), with the placement recorded.
    pub fn placed(spec: &TensorSpec, bbox: NdBox, replica_of: Option<u32>) -> ShardDesc {
        ShardDesc {
            name: spec.name.clone(),
            dtype: spec.dtype,
            shape: spec.shape.clone(),
            bbox,
            replica_of,
            placement: Some(spec.placement.clone()),
        }
    }

    /// The box `bbox` of a tensor this rank writes, without a placement.
    pub fn boxed(name: impl Into<String>, dtype: DType, shape: Vec<u64>, bbox: NdBox) -> ShardDesc {
        ShardDesc {
            name: name.into(),
            dtype,
            shape,
            bbox,
            replica_of: None,
            placement: None,
        }
    }

    /// Bytes of the box.
    pub fn byte_len(&self) -> u64 {
        self.bbox.numel() * self.dtype.size() as u64
    }

    /// The box's bytes, or an error naming the tensor when `given` bytes are not that.
    pub fn check_len(&self, given: usize) -> Result<u64> {
        let want = self.byte_len();
        if given as u64 != want {
            return Err(Error::invalid(format!(
                "tensor {:?} box {}: {given} bytes given, {want} expected ({} x {})",
                self.name,
                self.bbox,
                self.bbox.numel(),
                self.dtype
            )));
        }
        Ok(want)
    }

    /// The shard's entry in a rank manifest, with its chunks.
    pub fn into_tensor(self, chunks: Vec<ChunkRef>) -> TensorShard {
        TensorShard {
            name: self.name,
            dtype: self.dtype,
            shape: self.shape,
            bbox: self.bbox,
            chunks,
            replica_of: self.replica_of,
            placement: self.placement,
            hashed: Vec::new(),
        }
    }
}

/// One shard to save: what it is and its row-major bytes. A shard whose bytes another rank
/// writes (a data-parallel replica) has `data: None` and names that rank in `replica_of`.
#[derive(Debug, Clone)]
pub struct ShardIn {
    /// The tensor and box.
    pub shard: ShardDesc,
    /// The box's bytes, or `None` for a replica.
    pub data: Option<Bytes>,
}

/// One blob to save.
#[derive(Debug, Clone)]
pub struct BlobIn {
    /// Name.
    pub name: String,
    /// Bytes.
    pub data: Bytes,
}

/// Who and what a rank write is for.
#[derive(Debug, Clone)]
pub struct RankWrite {
    /// Run name.
    pub run: String,
    /// Step.
    pub step: u64,
    /// This rank.
    pub rank: u32,
    /// The layout saved under.
    pub layout: Layout,
    /// The job generation.
    pub generation: u64,
    /// The node the rank runs on, when a driver said (recorded in the manifest).
    pub node: Option<u32>,
}

impl RankWrite {
    /// Rank `rank`'s write of `step` of `run` under `layout`, generation 0, no node: a job
    /// outside a driver. A rank under `ckpt resume` sets `generation` and `node` too.
    pub fn new(run: impl Into<String>, step: u64, rank: u32, layout: Layout) -> Self {
        Self {
            run: run.into(),
            step,
            rank,
            layout,
            generation: 0,
            node: None,
        }
    }
}

/// A shard as [`Store::write_rank_stream`] needs it up front (its bytes come in the stream).
#[derive(Debug, Clone)]
pub struct ShardMeta {
    /// The tensor and box.
    pub shard: ShardDesc,
    /// The shard's chunks already in the store (an unchanged tensor whose chunks a committed
    /// step references): no chunks come for it in the stream, the manifest takes these. The
    /// caller must hold a writer lease under which a step referencing them was found
    /// committed (FORMAT.md, "What GC may delete"). `None`: the stream brings its chunks.
    pub reuse: Option<Vec<ChunkRef>>,
    /// For a replica (the sentinel): the chunks of this rank's copy (indices in the writer's
    /// cut of the box, ascending) that the stream brings to be hashed, not written; the
    /// manifest lists their ids in [`TensorShard::hashed`]. Empty: nothing comes for it.
    pub check: Vec<u32>,
}

impl ShardMeta {
    /// Bytes of the box.
    pub fn byte_len(&self) -> u64 {
        self.shard.byte_len()
    }
}

impl Store {
    /// Write a rank's chunks and then its manifest (see [`Chunks::put_chunks`](crate::Chunks::put_chunks) and
    /// [`CommitLog::write_rank_manifest`](crate::CommitLog::write_rank_manifest)). Returns the manifest, its entry for the commit
    /// record, and what the chunk writes cost.
    pub async fn write_rank(
        &self,
        w: &RankWrite,
        shards: Vec<ShardIn>,
        blobs: Vec<BlobIn>,
        index: &DedupIndex,
    ) -> Result<(RankManifest, RankEntry, PutStats)> {
        let mut metas = Vec::with_capacity(shards.len());
        let mut chunks: Vec<Result<Bytes>> = Vec::new();
        for s in shards {
            let mut check = Vec::new();
            match (&s.data, s.shard.replica_of) {
                (Some(d), replica_of) => {
                    let want = s.shard.check_len(d.len())?;
                    for (k, r) in self.chunk_spans(want).enumerate() {
                        chunks.push(Ok(d.slice(r.start as usize..r.end as usize)));
                        // A replica given its bytes is checked in full (the sentinel).
                        if replica_of.is_some() {
                            check.push(k as u32);
                        }
                    }
                }
                (None, Some(_)) => {}
                (None, None) => {
                    return Err(Error::invalid(format!(
                        "tensor {:?}: a shard needs its bytes or replica_of (the rank that writes them)",
                        s.shard.name
                    )));
                }
            }
            metas.push(ShardMeta {
                shard: s.shard,
                reuse: None,
                check,
            });
        }
        self.write_rank_stream(w, metas, blobs, stream::iter(chunks), index)
            .await
    }

    /// Write a rank's part of a step from a stream of chunk buffers: `chunks` yields, in
    /// order, the chunks of every written shard of `shards` (cut by [`Store::chunk_spans`]).
    /// The stream is consumed as the store takes the bytes, so a snapshot can still be
    /// filling staging buffers while earlier chunks are written. A stream that ends early,
    /// runs long, fails, or yields a chunk of the wrong size ends the write with an error
    /// naming the shard; no manifest is written then.
    #[instrument(skip_all, fields(run = %w.run, step = w.step, rank = w.rank))]
    pub async fn write_rank_stream<S>(
        &self,
        w: &RankWrite,
        shards: Vec<ShardMeta>,
        blobs: Vec<BlobIn>,
        chunks: S,
        index: &DedupIndex,
    ) -> Result<(RankManifest, RankEntry, PutStats)>
    where
        S: Stream<Item = Result<Bytes>> + Send,
    {
        validate_run(&w.run)?;
        w.layout.validate()?;
        let WritePlan {
            expect,
            mut spans,
            checks,
            mut logical,
            reused,
        } = self.plan_rank_write(&shards, index)?;
        let shard_chunks = expect.len();
        let mut blob_chunks: Vec<ChunkIn> = Vec::new();
        for b in &blobs {
            validate_name(&b.name)?;
            let start = shard_chunks + blob_chunks.len();
            logical += b.data.len() as u64;
            for r in self.chunk_spans(b.data.len() as u64) {
                blob_chunks.push(ChunkIn {
                    data: b.data.slice(r.start as usize..r.end as usize),
                    elem: 1,
                    base: None,
                });
            }
            spans.push((start, shard_chunks + blob_chunks.len() - start));
        }
        let names: Vec<String> = shards.iter().map(|s| s.shard.name.clone()).collect();
        let hashed = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let checked = hash_replicas(
            check_chunks(chunks, expect, names),
            checks,
            hashed.clone(),
            self.config().cpu_threads * 2,
        )
        .chain(stream::iter(blob_chunks.into_iter().map(Ok)));
        let mut put = self.chunks().try_put_chunks(checked, index).await?;
        let mut hashed = std::mem::take(&mut *hashed.lock());
        hashed.sort_by_key(|(i, h): &(usize, HashedChunk)| (*i, h.index));
        put.stats.chunks += reused.0;
        put.stats.bytes += reused.1;
        put.stats.chunks_skipped += reused.0;
        put.stats.bytes_skipped += reused.1;
        let mut tensors: Vec<(TensorShard, usize)> = shards
            .into_iter()
            .zip(&spans)
            .map(|(s, &(_, n))| (s.shard.into_tensor(s.reuse.unwrap_or_default()), n))
            .collect();
        for (i, h) in hashed {
            tensors[i].0.hashed.push(h);
        }
        let n_shards = tensors.len();
        let blobs: Vec<(String, u64, usize)> = blobs
            .into_iter()
            .zip(&spans[n_shards..])
            .map(|(b, &(_, n))| (b.name, b.data.len() as u64, n))
            .collect();
        let manifest = assemble_manifest(w, tensors, blobs, &put.refs, logical, &put.stats)?;
        self.failpoints().hit("after_chunks").await?;
        let entry = self.log().write_rank_manifest(&manifest).await?;
        Ok((manifest, entry, put.stats))
    }

    /// What a rank write's stream must yield, checked before any byte is taken: each shard
    /// validated, its chunks cut (with their delta base candidates), reused shards counted,
    /// and the replica chunks the sentinel hashes placed.
    fn plan_rank_write(&self, shards: &[ShardMeta], index: &DedupIndex) -> Result<WritePlan> {
        let mut expect: Vec<Expected> = Vec::new();
        // The committed base step's chunks by region: each float chunk's delta base candidate.
        let regions = index.base_regions();
        // (first chunk index, chunk count written) per shard, then per blob.
        let mut spans: Vec<(usize, usize)> = Vec::with_capacity(shards.len());
        // The stream's chunks that are a replica's, to hash (the sentinel): by their place in
        // `expect`, the shard and the chunk's index in it.
        let mut checks: std::collections::BTreeMap<usize, (usize, u32)> = Default::default();
        let mut logical = 0u64;
        // Chunks and raw bytes of shards whose chunks are reused.
        let mut reused = (0u64, 0u64);
        for (i, s) in shards.iter().enumerate() {
            validate_name(&s.shard.name)?;
            if !s.shard.bbox.within(&s.shard.shape) {
                return Err(Error::invalid(format!(
                    "tensor {:?}: box {} does not fit the shape {:?}",
                    s.shard.name, s.shard.bbox, s.shard.shape
                )));
            }
            let start = expect.len();
            if let Some(refs) = &s.reuse {
                check_reuse(self, s, refs)?;
                logical += s.byte_len();
                reused.0 += refs.len() as u64;
                reused.1 += s.byte_len();
            } else if s.shard.replica_of.is_none() {
                let want = s.byte_len();
                logical += want;
                let elem = if s.shard.dtype.is_float() {
                    s.shard.dtype.size() as u8
                } else {
                    1
                };
                let bases = regions
                    .as_ref()
                    .and_then(|(step, reg)| {
                        let refs =
                            reg.get(&s.shard.name, s.shard.dtype, &s.shard.shape, &s.shard.bbox)?;
                        Some((*step, refs))
                    })
                    .filter(|(_, refs)| refs.len() as u64 == self.chunk_spans(want).count() as u64);
                for (k, r) in self.chunk_spans(want).enumerate() {
                    let base = bases.as_ref().and_then(|(step, refs)| {
                        let c = &refs[k];
                        (c.len as u64 == r.end - r.start).then(|| BaseChunk {
                            step: *step,
                            chunk: c.clone(),
                        })
                    });
                    expect.push((i, r.end - r.start, elem, base));
                }
            } else if !s.check.is_empty() {
                let cut: Vec<std::ops::Range<u64>> = self.chunk_spans(s.byte_len()).collect();
                let mut prev: Option<u32> = None;
                for &k in &s.check {
                    let r = cut.get(k as usize).filter(|_| prev.is_none_or(|p| p < k));
                    let Some(r) = r else {
                        return Err(Error::invalid(format!(
                            "tensor {:?} box {}: replica chunk {k} to check is out of order or past the box's {} chunks",
                            s.shard.name,
                            s.shard.bbox,
                            cut.len()
                        )));
                    };
                    prev = Some(k);
                    checks.insert(expect.len(), (i, k));
                    expect.push((i, r.end - r.start, 1, None));
                }
                // Hashed, not written: no chunk of the put is the shard's.
                spans.push((start, 0));
                continue;
            }
            spans.push((start, expect.len() - start));
        }
        Ok(WritePlan {
            expect,
            spans,
            checks,
            logical,
            reused,
        })
    }
}

/// What the stream of a rank write must yield, per chunk: the shard's index, the chunk's
/// length, its element size and its delta base candidate.
type Expected = (usize, u64, u8, Option<BaseChunk>);

/// A rank write planned ([`Store::plan_rank_write`]).
struct WritePlan {
    /// What the stream must yield, chunk by chunk.
    expect: Vec<Expected>,
    /// (first chunk index, chunk count written) per shard (the blobs' follow).
    spans: Vec<(usize, usize)>,
    /// The stream's chunks that are a replica's, to hash (the sentinel): by their place in
    /// `expect`, the shard and the chunk's index in it.
    checks: std::collections::BTreeMap<usize, (usize, u32)>,
    /// The logical bytes of the shards.
    logical: u64,
    /// Chunks and raw bytes of shards whose chunks are reused.
    reused: (u64, u64),
}

/// The checked chunks of a rank write with the replicas' chunks (`checks`: by their place in
/// the stream, the shard and the chunk's index) taken out: each hashed on the blocking pool
/// (`ahead` at a time, in order) into `out`, never written. The sentinel's check of a
/// replica's own copy.
fn hash_replicas<S>(
    chunks: S,
    checks: std::collections::BTreeMap<usize, (usize, u32)>,
    out: std::sync::Arc<parking_lot::Mutex<Vec<(usize, HashedChunk)>>>,
    ahead: usize,
) -> impl Stream<Item = Result<ChunkIn>>
where
    S: Stream<Item = Result<ChunkIn>>,
{
    chunks
        .enumerate()
        .map(move |(k, c)| {
            let at = checks.get(&k).copied();
            let out = out.clone();
            async move {
                let c = c?;
                let Some((shard, index)) = at else {
                    return Ok(Some(c));
                };
                let data = c.data;
                let len = data.len() as u32;
                let id = tokio::task::spawn_blocking(move || ChunkId::of(&data)).await?;
                out.lock().push((shard, HashedChunk { index, len, id }));
                Ok(None)
            }
        })
        .buffered(ahead.max(1))
        .filter_map(|r: Result<Option<ChunkIn>>| futures::future::ready(r.transpose()))
}

/// The chunk buffers of a rank write's stream as [`ChunkIn`]s, checked against what its shards
/// expect: a chunk of the wrong size, a failing stream, one that ends early or runs long ends
/// the write with an error naming the tensor (`names`, by shard index).
fn check_chunks<S>(
    chunks: S,
    expect: Vec<Expected>,
    names: Vec<String>,
) -> impl Stream<Item = Result<ChunkIn>>
where
    S: Stream<Item = Result<Bytes>>,
{
    let mut exp = expect.into_iter();
    chunks
        .map(Some)
        .chain(stream::once(async { None }))
        .map(move |item| match (item, exp.next()) {
            (Some(Ok(data)), Some((_, len, elem, base))) if data.len() as u64 == len => {
                Some(Ok(ChunkIn { data, elem, base }))
            }
            (Some(Ok(data)), Some((i, len, _, _))) => Some(Err(Error::invalid(format!(
                "tensor {:?}: a chunk of {} bytes arrived where {len} were expected",
                names[i],
                data.len()
            )))),
            (Some(Err(e)), Some((i, _, _, _))) => {
                Some(Err(e.context(format!("snapshot of tensor {:?}", names[i]))))
            }
            (Some(Err(e)), None) => Some(Err(e)),
            (Some(Ok(_)), None) => Some(Err(Error::invalid(
                "the snapshot yielded more chunks than its shards hold",
            ))),
            (None, Some((i, _, _, _))) => Some(Err(Error::invalid(format!(
                "the snapshot ended before tensor {:?} was complete",
                names[i]
            )))),
            (None, None) => None,
        })
        .take_while(|x| futures::future::ready(x.is_some()))
        .map(|x| x.expect("taken while some"))
}

/// A rank's part of a step written in batches ([`Store::put_rank_part`]) before its manifest
/// ([`Store::write_rank_parts`]): for writers that get their items a few at a time (PyTorch's
/// distributed checkpoint hands a rank's items to `write_data`, and its coordinator adds the
/// step's metadata later, in `finish`). Every batch is checked like [`Store::write_rank`]'s
/// input; nothing is visible until the manifest is written.
#[derive(Debug)]
pub struct RankParts {
    w: RankWrite,
    tensors: Vec<(TensorShard, usize)>,
    blobs: Vec<(String, u64, usize)>,
    blob_refs: Vec<ChunkRef>,
    logical: u64,
    stats: PutStats,
}

impl RankParts {
    /// An empty part of `w`'s step.
    pub fn new(w: RankWrite) -> Result<Self> {
        validate_run(&w.run)?;
        w.layout.validate()?;
        if w.rank >= w.layout.world() {
            return Err(Error::invalid(format!(
                "rank {} of run {} step {}: the layout {} has {} ranks",
                w.rank,
                w.run,
                w.step,
                w.layout,
                w.layout.world()
            )));
        }
        Ok(RankParts {
            w,
            tensors: Vec::new(),
            blobs: Vec::new(),
            blob_refs: Vec::new(),
            logical: 0,
            stats: PutStats::default(),
        })
    }

    /// Who and what the part is for.
    pub fn write(&self) -> &RankWrite {
        &self.w
    }

    /// What the batches so far cost.
    pub fn stats(&self) -> &PutStats {
        &self.stats
    }
}

fn add_stats(to: &mut PutStats, o: &PutStats) {
    to.chunks += o.chunks;
    to.bytes += o.bytes;
    to.chunks_skipped += o.chunks_skipped;
    to.bytes_skipped += o.bytes_skipped;
    to.objects_written += o.objects_written;
    to.bytes_written += o.bytes_written;
    to.delta_tried += o.delta_tried;
    to.delta_stored += o.delta_stored;
    for (k, v) in &o.raw_by_codec {
        *to.raw_by_codec.entry(k.clone()).or_default() += v;
    }
    for (k, v) in &o.stored_by_codec {
        *to.stored_by_codec.entry(k.clone()).or_default() += v;
    }
    to.seconds += o.seconds;
}

impl Store {
    /// Write the chunks of a batch of `part`'s shards and blobs (one [`Chunks::put_chunks`](crate::Chunks::put_chunks), so
    /// small chunks of the batch share packs) and remember their references for the manifest.
    /// A shard whose bytes do not fill its box, whose box does not fit its shape, or whose name
    /// is not allowed is refused, naming it, before anything is written. Returns what this
    /// batch cost.
    pub async fn put_rank_part(
        &self,
        part: &mut RankParts,
        shards: Vec<ShardIn>,
        blobs: Vec<BlobIn>,
        index: &DedupIndex,
    ) -> Result<PutStats> {
        let mut chunks: Vec<ChunkIn> = Vec::new();
        let mut counts = Vec::with_capacity(shards.len());
        let mut logical = 0u64;
        for s in &shards {
            validate_name(&s.shard.name)?;
            if !s.shard.bbox.within(&s.shard.shape) {
                return Err(Error::invalid(format!(
                    "tensor {:?}: box {} does not fit the shape {:?}",
                    s.shard.name, s.shard.bbox, s.shard.shape
                )));
            }
            let start = chunks.len();
            match (&s.data, s.shard.replica_of) {
                (Some(d), None) => {
                    let want = s.shard.check_len(d.len())?;
                    logical += want;
                    let elem = if s.shard.dtype.is_float() {
                        s.shard.dtype.size() as u8
                    } else {
                        1
                    };
                    for r in self.chunk_spans(want) {
                        chunks.push(ChunkIn {
                            data: d.slice(r.start as usize..r.end as usize),
                            elem,
                            base: None,
                        });
                    }
                }
                (None, Some(_)) => {}
                _ => {
                    return Err(Error::invalid(format!(
                        "tensor {:?}: a shard needs either bytes or replica_of, not both or neither",
                        s.shard.name
                    )));
                }
            }
            counts.push(chunks.len() - start);
        }
        let shard_chunks = chunks.len();
        for b in &blobs {
            validate_name(&b.name)?;
            logical += b.data.len() as u64;
            for r in self.chunk_spans(b.data.len() as u64) {
                chunks.push(ChunkIn {
                    data: b.data.slice(r.start as usize..r.end as usize),
                    elem: 1,
                    base: None,
                });
            }
        }
        let put = self
            .chunks()
            .put_chunks(stream::iter(chunks), index)
            .await?;
        let mut at = 0usize;
        for (s, n) in shards.into_iter().zip(counts) {
            part.tensors
                .push((s.shard.into_tensor(put.refs[at..at + n].to_vec()), 0));
            at += n;
        }
        debug_assert_eq!(at, shard_chunks);
        for b in blobs {
            let n = self.chunk_spans(b.data.len() as u64).count();
            part.blobs.push((b.name, b.data.len() as u64, n));
            part.blob_refs.extend_from_slice(&put.refs[at..at + n]);
            at += n;
        }
        part.logical += logical;
        add_stats(&mut part.stats, &put.stats);
        Ok(put.stats)
    }

    /// Write the manifest of `part` (after all its batches): from then on the rank's part of
    /// the step is complete, and a committer can count it. Returns the manifest, its entry for
    /// the commit record, and what all batches cost.
    pub async fn write_rank_parts(
        &self,
        part: RankParts,
    ) -> Result<(RankManifest, RankEntry, PutStats)> {
        let manifest = assemble_manifest(
            &part.w,
            part.tensors,
            part.blobs,
            &part.blob_refs,
            part.logical,
            &part.stats,
        )?;
        self.failpoints().hit("after_chunks").await?;
        let entry = self.log().write_rank_manifest(&manifest).await?;
        Ok((manifest, entry, part.stats))
    }
}

/// Reused chunks must be what [`Store::chunk_spans`] cuts the shard into: as many, each as
/// long, and never for a replica.
fn check_reuse(store: &Store, s: &ShardMeta, refs: &[ChunkRef]) -> Result<()> {
    if s.shard.replica_of.is_some() {
        return Err(Error::invalid(format!(
            "tensor {:?}: a replica has no chunks to reuse",
            s.shard.name
        )));
    }
    let spans: Vec<_> = store.chunk_spans(s.byte_len()).collect();
    let fits = spans.len() == refs.len()
        && spans
            .iter()
            .zip(refs)
            .all(|(r, c)| r.end - r.start == c.len as u64);
    if !fits {
        return Err(Error::invalid(format!(
            "tensor {:?} box {}: {} reused chunks of {} bytes do not cut its {} bytes into \
             chunks of {}",
            s.shard.name,
            s.shard.bbox,
            refs.len(),
            refs.iter().map(|c| c.len as u64).sum::<u64>(),
            s.byte_len(),
            store.config().chunk_size
        )));
    }
    Ok(())
}

/// A rank's manifest from the refs one put returned, in order: each tensor (its `chunks`
/// empty, or the reused chunks of an unchanged shard with a count of 0) and then each blob
/// `(name, length, chunk count)` takes the next refs. The
/// streaming writer and `ckpt import` both build their manifests here, so there is one way a
/// manifest's chunk lists and statistics come to be; a count that does not add up to `refs`
/// is an internal error, not a manifest.
pub fn assemble_manifest(
    w: &RankWrite,
    tensors: Vec<(TensorShard, usize)>,
    blobs: Vec<(String, u64, usize)>,
    refs: &[ChunkRef],
    logical_bytes: u64,
    put: &PutStats,
) -> Result<RankManifest> {
    let want: usize =
        tensors.iter().map(|t| t.1).sum::<usize>() + blobs.iter().map(|b| b.2).sum::<usize>();
    if want != refs.len() {
        return Err(Error::internal(format!(
            "{} chunks written for rank {} of {}@{}, {want} expected",
            refs.len(),
            w.rank,
            w.run,
            w.step
        )));
    }
    let mut at = 0usize;
    let mut take = |n: usize| {
        let r = refs[at..at + n].to_vec();
        at += n;
        r
    };
    let tensors: Vec<TensorShard> = tensors
        .into_iter()
        .map(|(mut t, n)| {
            t.chunks.extend(take(n));
            t
        })
        .collect();
    let blobs = blobs
        .into_iter()
        .map(|(name, len, n)| BlobEntry {
            name,
            len,
            chunks: take(n),
        })
        .collect();
    let deltas = refs.iter().any(ChunkRef::is_delta) || tensors_have_deltas(&tensors);
    Ok(RankManifest {
        format: if deltas {
            DELTA_FORMAT_VERSION
        } else {
            FORMAT_VERSION
        },
        run: w.run.clone(),
        step: w.step,
        rank: w.rank,
        node: w.node,
        layout: w.layout,
        generation: w.generation,
        created_ms: now_ms(),
        tensors,
        blobs,
        stats: WriteStats {
            logical_bytes,
            chunks: put.chunks,
            chunks_skipped: put.chunks_skipped,
            bytes_skipped: put.bytes_skipped,
            objects_written: put.objects_written,
            bytes_written: put.bytes_written,
        },
    })
}

fn tensors_have_deltas(tensors: &[TensorShard]) -> bool {
    tensors
        .iter()
        .flat_map(|t| &t.chunks)
        .any(ChunkRef::is_delta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{det_bytes, memory_store, tiny_config};

    fn meta(name: &str, len: u64, reuse: Option<Vec<ChunkRef>>) -> ShardMeta {
        ShardMeta {
            shard: ShardDesc {
                name: name.into(),
                dtype: DType::U8,
                shape: vec![len],
                bbox: NdBox::full(&[len]),
                replica_of: None,
                placement: None,
            },
            reuse,
            check: Vec::new(),
        }
    }

    /// A replica's chunks to check come in the stream among the written ones: they are
    /// hashed into the manifest's `hashed` (ids as a writer of the same bytes gets), never
    /// written; a check past the box is refused naming the tensor.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replicas_checked_chunks_are_hashed_not_written() {
        let store = memory_store(tiny_config());
        let w = RankWrite {
            node: Some(7),
            ..RankWrite::new("r", 1, 1, Layout::new(2, 1, 1, 0).unwrap())
        };
        let (a, b) = (det_bytes(1, 10_000), det_bytes(2, 10_000));
        let spans: Vec<std::ops::Range<u64>> = store.chunk_spans(10_000).collect();
        assert!(spans.len() >= 3, "tiny chunks");
        let mut replica = meta("b", 10_000, None);
        replica.shard.replica_of = Some(0);
        replica.check = vec![0, 2];
        // The stream: a's chunks, then b's chunks 0 and 2.
        let mut chunks: Vec<Result<Bytes>> = spans
            .iter()
            .map(|r| Ok(Bytes::from(a[r.start as usize..r.end as usize].to_vec())))
            .collect();
        for k in [0usize, 2] {
            let r = &spans[k];
            chunks.push(Ok(Bytes::from(
                b[r.start as usize..r.end as usize].to_vec(),
            )));
        }
        let (m, _, stats) = store
            .write_rank_stream(
                &w,
                vec![meta("a", 10_000, None), replica.clone()],
                vec![],
                stream::iter(chunks),
                &DedupIndex::new(),
            )
            .await
            .unwrap();
        assert_eq!(m.node, Some(7));
        assert_eq!(m.tensors[0].chunks.len(), spans.len());
        let r = &m.tensors[1];
        assert!(r.chunks.is_empty(), "a replica lists no chunks");
        let want: Vec<HashedChunk> = [0usize, 2]
            .iter()
            .map(|&k| {
                let sp = &spans[k];
                HashedChunk {
                    index: k as u32,
                    len: (sp.end - sp.start) as u32,
                    id: ChunkId::of(&b[sp.start as usize..sp.end as usize]),
                }
            })
            .collect();
        assert_eq!(r.hashed, want);
        assert_eq!(stats.bytes, 10_000, "only a's bytes went to the put");
        m.validate("test").unwrap();
        assert_eq!(stats.chunks, spans.len() as u64, "b's chunks were put");
        // A check past the box.
        replica.check = vec![spans.len() as u32];
        let e = store
            .write_rank_stream(
                &RankWrite { step: 2, ..w },
                vec![replica],
                vec![],
                stream::iter(Vec::<Result<Bytes>>::new()),
                &DedupIndex::new(),
            )
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("\"b\"") && e.to_string().contains("past the box"),
            "{e}"
        );
    }

    /// A reused shard takes the given references, in its place among the streamed shards, and
    /// counts as skipped; references that do not cut the shard's bytes are refused, naming it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reused_shards_take_their_references_and_bad_ones_are_refused() {
        let store = memory_store(tiny_config());
        let w = |step| RankWrite::new("r", step, 0, Layout::SINGLE);
        let (a, b) = (det_bytes(1, 10_000), det_bytes(2, 5_000));
        let idx = DedupIndex::new();
        let first = store
            .write_rank(
                &w(1),
                vec![ShardIn {
                    shard: ShardDesc {
                        name: "a".into(),
                        dtype: DType::U8,
                        shape: vec![10_000],
                        bbox: NdBox::full(&[10_000]),
                        replica_of: None,
                        placement: None,
                    },
                    data: Some(Bytes::from(a.clone())),
                }],
                vec![],
                &idx,
            )
            .await
            .unwrap()
            .0;
        let refs = first.tensors[0].chunks.clone();
        let chunks: Vec<Result<Bytes>> = store
            .chunk_spans(5_000)
            .map(|r| Ok(Bytes::from(b[r.start as usize..r.end as usize].to_vec())))
            .collect();
        let (m, _, stats) = store
            .write_rank_stream(
                &w(2),
                vec![
                    meta("b", 5_000, None),
                    meta("a", 10_000, Some(refs.clone())),
                ],
                vec![],
                stream::iter(chunks),
                &DedupIndex::new(),
            )
            .await
            .unwrap();
        assert_eq!(m.tensors[1].chunks, refs);
        assert_eq!(m.stats.logical_bytes, 15_000);
        assert_eq!(stats.bytes_skipped, 10_000);
        assert_eq!(stats.chunks_skipped, refs.len() as u64);
        // One chunk short: refused before anything is written.
        let e = store
            .write_rank_stream(
                &w(3),
                vec![meta("a", 10_000, Some(refs[1..].to_vec()))],
                vec![],
                stream::iter(Vec::<Result<Bytes>>::new()),
                &DedupIndex::new(),
            )
            .await
            .unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::InvalidInput, "{e}");
        assert!(e.to_string().contains("tensor \"a\""), "{e}");
    }

    /// A rank written in batches reads back like one written at once: tensors of both batches,
    /// and the blob added last; a bad shard in a later batch is refused naming it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rank_written_in_batches_reads_back() {
        let store = memory_store(tiny_config());
        let w = RankWrite::new("r", 1, 0, Layout::SINGLE);
        let shard = |name: &str, data: &[u8]| ShardIn {
            shard: ShardDesc {
                name: name.into(),
                dtype: DType::U8,
                shape: vec![data.len() as u64],
                bbox: NdBox::full(&[data.len() as u64]),
                replica_of: None,
                placement: None,
            },
            data: Some(Bytes::from(data.to_vec())),
        };
        let (a, b) = (det_bytes(1, 10_000), det_bytes(2, 300));
        let idx = DedupIndex::new();
        let mut part = RankParts::new(w).unwrap();
        store
            .put_rank_part(&mut part, vec![shard("a", &a)], vec![], &idx)
            .await
            .unwrap();
        let mut bad = shard("bad", &b);
        bad.shard.shape = vec![10];
        let e = store
            .put_rank_part(&mut part, vec![bad], vec![], &idx)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("\"bad\""), "{e}");
        store
            .put_rank_part(
                &mut part,
                vec![shard("b", &b)],
                vec![BlobIn {
                    name: "meta".into(),
                    data: Bytes::from_static(b"hello"),
                }],
                &idx,
            )
            .await
            .unwrap();
        store.write_rank_parts(part).await.unwrap();
        store.log().commit_step("r", 1).await.unwrap();
        let reader = crate::read::StepReader::open(&store, "r", 1).await.unwrap();
        assert_eq!(reader.read_tensor("a").await.unwrap(), a);
        assert_eq!(reader.read_tensor("b").await.unwrap(), b);
        assert_eq!(reader.read_blob(0, "meta").await.unwrap(), b"hello");
    }
}
