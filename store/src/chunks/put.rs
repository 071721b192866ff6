//! The write path, [`Chunks::put_chunks`]: hash chunks on several threads, skip chunks the
//! [`DedupIndex`] knows (and repeats within the stream), encode the rest (the codec chosen by
//! the [`Governor`], a delta on a base where it pays), pack the small ones, and write with
//! bounded concurrency and a bounded number of bytes in flight. One call is a [`PutRun`]: each
//! step of it is a method.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use bytes::Bytes;
use futures::stream::{Stream, StreamExt};
use object_store::PutMode;
use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit};
use tokio::task::JoinSet;
use tracing::{debug, instrument};

use super::governor::Governor;
use super::verdicts::DeltaVerdicts;
use super::{Chunks, DedupIndex};
use crate::codec::{self, CodecPolicy, Encoded, MAX_CHUNK_LEN};
use crate::error::{Error, Result};
use crate::id::ChunkId;
use crate::model::ChunkRef;
use crate::pack::PackBuilder;
use crate::store::StoreConfig;

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

/// What [`Chunks::put_chunks`] did.
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

/// The result of [`Chunks::put_chunks`]: a reference for every chunk given, in order.
#[derive(Debug, Clone)]
pub struct PutReport {
    /// One per input chunk, in input order.
    pub refs: Vec<ChunkRef>,
    /// Figures.
    pub stats: PutStats,
}

impl Chunks {
    /// Write a stream of chunks; returns a reference for each, in order (see the module docs).
    ///
    /// Chunks the index knows, and chunks repeated within the stream, are not written again.
    /// Memory stays within `inflight_bytes` plus one pack, whatever the stream's length; the
    /// stream is pulled only as fast as the store takes the bytes.
    #[instrument(skip_all, fields(store = %self.objects.url))]
    pub async fn put_chunks<S>(&self, input: S, index: &DedupIndex) -> Result<PutReport>
    where
        S: Stream<Item = ChunkIn> + Send,
    {
        self.try_put_chunks(input.map(Ok), index).await
    }

    /// [`Chunks::put_chunks`] over a stream that may fail (a snapshot that breaks off); the
    /// first error ends the write.
    pub async fn try_put_chunks<S>(&self, input: S, index: &DedupIndex) -> Result<PutReport>
    where
        S: Stream<Item = Result<ChunkIn>> + Send,
    {
        let mut run = PutRun::new(self, index);
        let res = run.run(input).await;
        // On an error, stop the writes not yet started and wait for those in flight before
        // returning: each removes its own staging file on failure, so a failed save leaves no
        // partial file behind (once it returns) and writes nothing more.
        if res.is_err() {
            run.abort().await;
        }
        res
    }
}

/// What a write task hands back: the slots it wrote, with their references.
type Written = Vec<(usize, ChunkRef)>;

/// Where the reference of one input chunk stands.
enum Slot {
    Done(ChunkRef),
    /// A repeat of the chunk in this slot.
    SameAs(usize),
    Pending,
}

/// The pack being filled: its builder, its chunks' slots and their share of the budget.
struct OpenPack {
    builder: PackBuilder,
    slots: Written,
    permits: Vec<OwnedSemaphorePermit>,
}

impl OpenPack {
    fn new() -> Self {
        OpenPack {
            builder: PackBuilder::new(),
            slots: Vec::new(),
            permits: Vec::new(),
        }
    }
}

/// One call of [`Chunks::try_put_chunks`]: the state its steps share.
struct PutRun<'a> {
    store: &'a Chunks,
    index: &'a DedupIndex,
    cfg: Arc<StoreConfig>,
    t0: Instant,
    /// Bytes of chunks taken and not yet written.
    budget: Arc<Semaphore>,
    governor: Arc<Governor>,
    writers: Arc<Semaphore>,
    /// Set on an error: writes not yet started do not start.
    cancel: Arc<AtomicBool>,
    stats: PutStats,
    /// One per input chunk, in input order.
    slots: Vec<Slot>,
    /// The slot of each chunk's first occurrence in the stream.
    first: HashMap<ChunkId, usize>,
    tasks: JoinSet<Result<Written>>,
    pack: OpenPack,
}

impl<'a> PutRun<'a> {
    fn new(store: &'a Chunks, index: &'a DedupIndex) -> Self {
        let t0 = Instant::now();
        let cfg = store.objects.cfg.clone();
        PutRun {
            store,
            index,
            t0,
            budget: Arc::new(Semaphore::new(cfg.inflight_bytes)),
            governor: Arc::new(Governor::new(cfg.cpu_threads)),
            writers: Arc::new(Semaphore::new(cfg.write_concurrency)),
            cancel: Arc::new(AtomicBool::new(false)),
            stats: PutStats::default(),
            slots: Vec::new(),
            first: HashMap::new(),
            tasks: JoinSet::new(),
            pack: OpenPack::new(),
            cfg,
        }
    }

    /// Every chunk of `input` taken, every write finished, the references collected.
    async fn run<S>(&mut self, input: S) -> Result<PutReport>
    where
        S: Stream<Item = Result<ChunkIn>> + Send,
    {
        let hashed = hash_chunks(input, self.cfg.cpu_threads * 2);
        futures::pin_mut!(hashed);
        while let Some(item) = hashed.next().await {
            let (id, c) = item?;
            self.take(id, c).await?;
        }
        self.seal_pack().await?;
        while let Some(done) = self.tasks.join_next().await {
            self.fill(done??);
        }
        let refs = self.refs()?;
        self.tally(&refs);
        self.index.extend(refs.iter());
        self.stats.seconds = self.t0.elapsed().as_secs_f64();
        debug!(
            chunks = self.stats.chunks,
            skipped = self.stats.chunks_skipped,
            objects = self.stats.objects_written,
            bytes_written = self.stats.bytes_written,
            "put_chunks done"
        );
        Ok(PutReport {
            refs,
            stats: std::mem::take(&mut self.stats),
        })
    }

    /// Stop the writes not yet started and wait for those in flight.
    async fn abort(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        while self.tasks.join_next().await.is_some() {}
    }

    /// The next chunk of the stream: skipped if known, else packed or written on its own.
    async fn take(&mut self, id: ChunkId, c: ChunkIn) -> Result<()> {
        let i = self.slots.len();
        let len = c.data.len();
        self.stats.chunks += 1;
        self.stats.bytes += len as u64;
        if let Some(slot) = self.known(&id) {
            self.stats.chunks_skipped += 1;
            self.stats.bytes_skipped += len as u64;
            self.slots.push(slot);
            return Ok(());
        }
        self.first.insert(id, i);
        self.slots.push(Slot::Pending);
        // Collect finished writes without blocking, to surface errors early.
        while let Some(done) = self.tasks.try_join_next() {
            self.fill(done??);
        }
        let permit = self
            .budget
            .clone()
            .acquire_many_owned(len.max(1) as u32)
            .await
            .map_err(|_| Error::internal("in-flight budget closed"))?;
        let policy = self
            .governor
            .policy(&self.cfg, self.writers.available_permits() == 0);
        if len < self.cfg.pack_threshold {
            self.add_to_pack(i, id, c, policy, permit).await
        } else {
            self.spawn_chunk_write(i, id, c, policy, permit);
            Ok(())
        }
    }

    /// A chunk the store holds (the index knows it) or an earlier slot of the stream has.
    fn known(&self, id: &ChunkId) -> Option<Slot> {
        if let Some(r) = self.index.get(id) {
            return Some(Slot::Done(r));
        }
        self.first.get(id).map(|&j| Slot::SameAs(j))
    }

    /// Record finished writes.
    fn fill(&mut self, done: Written) {
        for (slot, r) in done {
            self.slots[slot] = Slot::Done(r);
        }
    }

    /// Encode a small chunk into the open pack; write the pack once it is full.
    async fn add_to_pack(
        &mut self,
        i: usize,
        id: ChunkId,
        c: ChunkIn,
        policy: CodecPolicy,
        permit: OwnedSemaphorePermit,
    ) -> Result<()> {
        let len = c.data.len();
        let (data, elem) = (c.data, c.elem as usize);
        let enc = tokio::task::spawn_blocking(move || codec::encode(&data, elem, policy)).await?;
        let r = ChunkRef::plain(id, len as u32, enc.len() as u32, enc.codec);
        let off = self.pack.builder.add(id, len as u32, enc);
        self.pack.slots.push((i, ChunkRef { offset: off, ..r }));
        self.pack.permits.push(permit);
        if self.pack.builder.len() >= self.cfg.pack_target as u64 {
            self.seal_pack().await?;
        }
        Ok(())
    }

    /// Seal the open pack and spawn its write (nothing to do when it is empty).
    async fn seal_pack(&mut self) -> Result<()> {
        if self.pack.builder.is_empty() {
            return Ok(());
        }
        let OpenPack {
            builder,
            slots,
            permits,
        } = std::mem::replace(&mut self.pack, OpenPack::new());
        let (id, _entries, parts) = tokio::task::spawn_blocking(move || builder.seal()).await?;
        let len: usize = parts.iter().map(Bytes::len).sum();
        self.stats.objects_written += 1;
        self.stats.bytes_written += len as u64;
        let store = self.store.clone();
        let writers = self.writers.clone();
        let cancel = self.cancel.clone();
        self.tasks.spawn(async move {
            let path = store.objects.keys.pack(&id);
            let _w = acquire_writer(&writers, &cancel).await?;
            store
                .objects
                .put_object(&path, parts, PutMode::Overwrite)
                .await?;
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

    /// Spawn the write of a chunk too large for a pack ([`ChunkWrite`]).
    fn spawn_chunk_write(
        &mut self,
        slot: usize,
        id: ChunkId,
        chunk: ChunkIn,
        policy: CodecPolicy,
        permit: OwnedSemaphorePermit,
    ) {
        let base = self.delta_candidate(&id, &chunk, policy);
        if base.is_some() {
            self.stats.delta_tried += 1;
        }
        let job = ChunkWrite {
            store: self.store.clone(),
            writers: self.writers.clone(),
            governor: self.governor.clone(),
            cancel: self.cancel.clone(),
            slot,
            id,
            chunk,
            base,
            policy,
            permit,
        };
        self.tasks.spawn(job.run());
        self.stats.objects_written += 1;
    }

    /// The base a chunk tries a delta on, if any: a float chunk of the same length stored
    /// whole at the base step, in a chain shorter than `delta_chain`, where the governor
    /// compresses and the region does not rest ([`DeltaVerdicts`]).
    fn delta_candidate(&self, id: &ChunkId, c: &ChunkIn, policy: CodecPolicy) -> Option<BaseChunk> {
        let cfg = &self.cfg;
        let len = c.data.len();
        c.base.clone().filter(|b| {
            policy != CodecPolicy::Raw
                && cfg.delta_chain > 0
                && matches!(c.elem, 2 | 4 | 8)
                && len.is_multiple_of(c.elem as usize)
                && b.chunk.len as usize == len
                && b.chunk.pack.is_none()
                && b.chunk.bases.len() < cfg.delta_chain
                && b.chunk.id != *id
                // A region whose last try did not pay rests for a few saves.
                && self.store.delta_verdicts.try_on(&b.chunk.id, id)
        })
    }

    /// Every slot's reference, in input order (a repeat takes its first occurrence's).
    fn refs(&self) -> Result<Vec<ChunkRef>> {
        let slots = &self.slots;
        let mut refs: Vec<ChunkRef> = Vec::with_capacity(slots.len());
        for s in slots {
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
        Ok(refs)
    }

    /// Count what was written, once per chunk: stored bytes of chunk objects (packs were
    /// counted when sealed), deltas, bytes by codec.
    fn tally(&mut self, refs: &[ChunkRef]) {
        let stats = &mut self.stats;
        for (i, r) in refs.iter().enumerate() {
            if self.first.get(&r.id) == Some(&i) {
                if r.pack.is_none() {
                    stats.bytes_written += r.stored as u64;
                }
                if r.is_delta() {
                    stats.delta_stored += 1;
                }
                let name = r.codec.name();
                *stats.raw_by_codec.entry(name.to_string()).or_default() += r.len as u64;
                *stats.stored_by_codec.entry(name.to_string()).or_default() += r.stored as u64;
            }
        }
    }
}

/// Stage 1, in order with read-ahead: each chunk checked and hashed on the blocking pool.
fn hash_chunks<S>(input: S, ahead: usize) -> impl Stream<Item = Result<(ChunkId, ChunkIn)>>
where
    S: Stream<Item = Result<ChunkIn>>,
{
    input
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
        .buffered(ahead)
}

/// A writer's slot, unless the save failed meanwhile.
async fn acquire_writer<'s>(
    writers: &'s Semaphore,
    cancel: &AtomicBool,
) -> Result<SemaphorePermit<'s>> {
    let w = writers
        .acquire()
        .await
        .map_err(|_| Error::internal("writer pool closed"))?;
    if cancel.load(Ordering::Relaxed) {
        return Err(Error::internal("the save failed: write not started"));
    }
    Ok(w)
}

/// The write of one chunk too large for a pack, on its own task: read its delta base (if it
/// has a candidate), encode, keep the plain bytes as the next save's base, write.
struct ChunkWrite {
    store: Chunks,
    writers: Arc<Semaphore>,
    governor: Arc<Governor>,
    cancel: Arc<AtomicBool>,
    slot: usize,
    id: ChunkId,
    chunk: ChunkIn,
    base: Option<BaseChunk>,
    policy: CodecPolicy,
    /// Its share of the in-flight budget, given back once written.
    permit: OwnedSemaphorePermit,
}

impl ChunkWrite {
    async fn run(self) -> Result<Written> {
        let ChunkWrite {
            store,
            writers,
            governor,
            cancel,
            slot,
            id,
            chunk,
            base,
            policy,
            permit,
        } = self;
        let data = chunk.data;
        let len = data.len();
        let elem = chunk.elem as usize;
        let verdicts = store.delta_verdicts.clone();
        let base = match base {
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
        let (enc, delta) = {
            let (data, gov, verdicts) = (data.clone(), governor.clone(), verdicts.clone());
            tokio::task::spawn_blocking(move || {
                encode_chunk(&data, base, elem, policy, &id, &gov, &verdicts)
            })
            .await?
        };
        // Keep the plain bytes as the next save's base, unless that save will not try a
        // delta on them.
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
                store.objects.keys.delta_chunk(&id, &b.chunk.id)
            }
            None => store.objects.keys.chunk(&id),
        };
        let _w = acquire_writer(&writers, &cancel).await?;
        let stored = enc.len();
        let started = Instant::now();
        store
            .objects
            .put_object(&path, enc.parts, PutMode::Overwrite)
            .await?;
        governor.record_write(stored, started.elapsed());
        drop(permit);
        Ok(vec![(slot, r)])
    }
}

/// Encode a chunk (on the blocking pool): as a delta on `base` where a sample says it pays
/// and it comes out smaller than the chunk, else with `policy`. A delta tried that did not pay
/// rests its region ([`DeltaVerdicts`]).
fn encode_chunk(
    data: &Bytes,
    base: Option<(BaseChunk, Bytes)>,
    elem: usize,
    policy: CodecPolicy,
    id: &ChunkId,
    gov: &Governor,
    verdicts: &DeltaVerdicts,
) -> (Encoded, Option<BaseChunk>) {
    let t = Instant::now();
    let mut out = None;
    if let (Some((b, plain)), CodecPolicy::Compress { level, .. }) = (&base, policy) {
        // Estimate both on a sample and encode only the smaller: trying a delta costs 3 % of
        // encoding the chunk, not a second encoding.
        if codec::estimate_delta(data, plain, elem, level).pays() {
            let d = codec::encode_delta(data, plain, &b.chunk.id, elem, level);
            if d.len() < data.len() {
                out = Some((d, Some(b.clone())));
            }
        }
        if out.is_none() {
            verdicts.did_not_pay(id);
        }
    }
    let out = out.unwrap_or_else(|| (codec::encode(data, elem, policy), None));
    if policy != CodecPolicy::Raw {
        gov.record_compress(data.len(), t.elapsed());
    }
    out
}
