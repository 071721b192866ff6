//! One committed step as files: what each file holds, how many bytes, and which chunk byte
//! runs make up any byte range of it.
//!
//! Every file is one of:
//!
//! - `COMMIT.json`: literal bytes made once from the commit record;
//! - `model.safetensors`: the header of [`SafetensorsView`] (the same bytes `ckpt export`
//!   writes) then every tensor's consolidated bytes at the view's offsets;
//! - `tensors/<name>`: one tensor's consolidated row-major bytes;
//! - `ranks/<r>/<name>`: the boxes rank `r` holds of a tensor, in the order of its manifest,
//!   each row-major, back to back (one box for tensor-parallel splits and replicas; for a ZeRO
//!   partition the boxes of its flat range, so the file is the rank's flat slice);
//! - `blobs/<r>/<name>`: a blob saved by rank `r`.
//!
//! A read is planned into chunk fetches with byte runs to copy (the read engine's
//! [`StepReader::plan`] does the geometry), then executed through the [`ChunkCache`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use ckpt_store::placement::flat_range_boxes;
use ckpt_store::{
    ChunkId, ChunkRef, CommitRecord, Error, NdBox, Result, SafetensorsView, StepReader, Store,
};
use futures::StreamExt;
use parking_lot::Mutex;
use serde_json::{Map, Value, json};
use tracing::warn;

use crate::names::NameMap;
use ckpt_store::cache::ChunkCache;

/// The blobs one rank saved.
#[derive(Debug)]
pub(crate) struct RankBlobs {
    /// Indices into the commit record's blobs, in name order.
    pub blobs: Vec<usize>,
    /// Their file names (same indices as `blobs`).
    pub names: NameMap,
}

/// The tensors one rank holds (from its manifest, loaded on first use).
#[derive(Debug)]
pub(crate) struct RankFiles {
    /// (tensor index in the commit record, its boxes in manifest order, byte length), in
    /// tensor order.
    pub tensors: Vec<(usize, Arc<[NdBox]>, u64)>,
    by_tensor: HashMap<usize, usize>,
}

impl RankFiles {
    /// The entry of tensor `t`, if this rank holds part of it.
    pub fn get(&self, t: usize) -> Option<&(usize, Arc<[NdBox]>, u64)> {
        self.by_tensor.get(&t).map(|&i| &self.tensors[i])
    }
}

/// What a file holds.
#[derive(Debug, Clone)]
pub(crate) enum Content {
    /// Fixed bytes.
    Literal(Bytes),
    /// `model.safetensors`.
    Model,
    /// `tensors/<name>`: tensor index.
    Tensor(usize),
    /// `ranks/<r>/<name>`.
    RankTensor { tensor: usize, boxes: Arc<[NdBox]> },
    /// `blobs/<r>/<name>`: index into the commit record's blobs.
    Blob(usize),
}

#[derive(Debug, Clone, Copy)]
enum What {
    Tensor(usize),
    Blob(usize),
}

/// One byte run out of a chunk into the destination; `dst` may start before the
/// destination (edges of partial elements) and is clipped when copied.
#[derive(Debug, Clone, Copy)]
struct Run {
    src: u64,
    dst: i64,
    len: u64,
}

#[derive(Debug)]
struct Fetch {
    chunk: ChunkRef,
    rank: u32,
    what: What,
    runs: Vec<Run>,
}

/// The chunks under a byte range of a file and what to copy out of each.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    len: usize,
    literal: Vec<(usize, Bytes)>,
    fetches: Vec<Fetch>,
    index: HashMap<ChunkId, usize>,
}

impl Plan {
    fn add(&mut self, chunk: &ChunkRef, rank: u32, what: What, run: Run) {
        let i = *self.index.entry(chunk.id).or_insert_with(|| {
            self.fetches.push(Fetch {
                chunk: chunk.clone(),
                rank,
                what,
                runs: Vec::new(),
            });
            self.fetches.len() - 1
        });
        self.fetches[i].runs.push(run);
    }
}

/// A committed step, opened.
pub(crate) struct StepState {
    pub reader: StepReader,
    pub mtime: SystemTime,
    /// `None` when the step cannot be one safetensors file (a tensor named `__metadata__`).
    pub view: Option<SafetensorsView>,
    pub tensors: NameMap,
    pub blob_ranks: BTreeMap<u32, RankBlobs>,
    pub ranks: Vec<u32>,
    pub commit_json: Bytes,
    rank_files: Mutex<HashMap<u32, Arc<RankFiles>>>,
}

impl std::fmt::Debug for StepState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StepState({})", self.what())
    }
}

/// Commit time as a file time.
pub(crate) fn commit_time(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

impl StepState {
    /// Open a committed step (one read of its commit record).
    pub async fn open(store: &Store, run: &str, step: u64) -> Result<StepState> {
        let reader = StepReader::open(store, run, step).await?;
        Ok(Self::from_reader(reader))
    }

    /// The files of an opened step.
    pub fn from_reader(reader: StepReader) -> StepState {
        let c = reader.commit();
        let view = match SafetensorsView::new(c, None) {
            Ok(v) => Some(v),
            Err(e) => {
                warn!(run = %c.run, step = c.step, error = %e,
                    "step {} of run {} has no model.safetensors: {e}", c.step, c.run);
                None
            }
        };
        let tensors = NameMap::build(c.tensors.iter().map(|t| t.name.as_str()));
        let mut by_rank: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, b) in c.blobs.iter().enumerate() {
            by_rank.entry(b.rank).or_default().push(i);
        }
        let blob_ranks = by_rank
            .into_iter()
            .map(|(r, mut idx)| {
                idx.sort_by(|&a, &b| c.blobs[a].name.cmp(&c.blobs[b].name).then(a.cmp(&b)));
                let names = NameMap::build(idx.iter().map(|&i| c.blobs[i].name.as_str()));
                (r, RankBlobs { blobs: idx, names })
            })
            .collect::<BTreeMap<_, _>>();
        let mut ranks: Vec<u32> = c.ranks.iter().map(|e| e.rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        let commit_json = Bytes::from(commit_json(c, &tensors, &blob_ranks, view.is_some()));
        StepState {
            mtime: commit_time(c.committed_ms),
            reader,
            view,
            tensors,
            blob_ranks,
            ranks,
            commit_json,
            rank_files: Mutex::default(),
        }
    }

    /// The commit record.
    pub fn commit(&self) -> &CommitRecord {
        self.reader.commit()
    }

    /// `step S of run R`, for messages.
    pub fn what(&self) -> String {
        let c = self.commit();
        format!("step {} of run {}", c.step, c.run)
    }

    /// The tensors rank `r` holds (reads its manifest once).
    pub async fn rank_files(&self, rank: u32) -> Result<Arc<RankFiles>> {
        if let Some(f) = self.rank_files.lock().get(&rank) {
            return Ok(f.clone());
        }
        let m = self.reader.manifest(rank).await?;
        let c = self.commit();
        let mut boxes: BTreeMap<usize, Vec<NdBox>> = BTreeMap::new();
        for t in &m.tensors {
            let Ok(i) = c.tensors.binary_search_by(|e| e.name.as_str().cmp(&t.name)) else {
                return Err(Error::corrupt(format!(
                    "{}: rank {rank} holds tensor {:?}, which the commit record does not list",
                    self.what(),
                    t.name
                )));
            };
            boxes.entry(i).or_default().push(t.bbox.clone());
        }
        let tensors: Vec<(usize, Arc<[NdBox]>, u64)> = boxes
            .into_iter()
            .map(|(i, b)| {
                let elem = c.tensors[i].dtype.size() as u64;
                let len = b.iter().map(|x| x.numel() * elem).sum();
                (i, Arc::from(b), len)
            })
            .collect();
        let by_tensor = tensors.iter().enumerate().map(|(k, t)| (t.0, k)).collect();
        let f = Arc::new(RankFiles { tensors, by_tensor });
        self.rank_files.lock().insert(rank, f.clone());
        Ok(f)
    }

    /// Byte length of a file.
    pub fn len(&self, c: &Content) -> u64 {
        match c {
            Content::Literal(b) => b.len() as u64,
            Content::Model => self.view.as_ref().map_or(0, |v| v.len()),
            Content::Tensor(i) => self.commit().tensors[*i].byte_len(),
            Content::RankTensor { tensor, boxes, .. } => {
                let elem = self.commit().tensors[*tensor].dtype.size() as u64;
                boxes.iter().map(|b| b.numel() * elem).sum()
            }
            Content::Blob(i) => self.commit().blobs[*i].len,
        }
    }

    /// Plan reading `len` bytes at `offset` of a file (the caller clips to the file size).
    pub async fn plan(&self, c: &Content, offset: u64, len: usize) -> Result<Plan> {
        let mut plan = Plan {
            len,
            ..Plan::default()
        };
        let end = offset + len as u64;
        match c {
            Content::Literal(b) => {
                let s = (offset as usize).min(b.len());
                let e = (end as usize).min(b.len());
                plan.literal.push((0, b.slice(s..e)));
            }
            Content::Model => {
                let view = self.view.as_ref().ok_or_else(|| {
                    Error::not_found(format!("{}: no model.safetensors", self.what()))
                })?;
                let h = view.header();
                if offset < h.len() as u64 {
                    let he = end.min(h.len() as u64) as usize;
                    plan.literal
                        .push((0, Bytes::copy_from_slice(&h[offset as usize..he])));
                }
                let entries = view.entries();
                let first = entries.partition_point(|e| e.start + e.len <= offset);
                for e in &entries[first..] {
                    if e.start >= end {
                        break;
                    }
                    let a = offset.max(e.start) - e.start;
                    let b = end.min(e.start + e.len) - e.start;
                    if a >= b {
                        continue;
                    }
                    let t = self
                        .commit()
                        .tensors
                        .binary_search_by(|x| x.name.as_str().cmp(&e.name))
                        .map_err(|_| {
                            Error::internal(format!(
                                "{}: the safetensors view lists tensor {:?} the commit record does not",
                                self.what(),
                                e.name
                            ))
                        })?;
                    let out_at = (e.start + a) as i64 - offset as i64;
                    let full = [NdBox::full(&e.shape)];
                    self.plan_boxes(t, &full, a, b, out_at, &mut plan).await?;
                }
            }
            Content::Tensor(t) => {
                let full = [NdBox::full(&self.commit().tensors[*t].shape)];
                self.plan_boxes(*t, &full, offset, end, 0, &mut plan)
                    .await?;
            }
            Content::RankTensor { tensor, boxes, .. } => {
                self.plan_boxes(*tensor, boxes, offset, end, 0, &mut plan)
                    .await?;
            }
            Content::Blob(i) => self.plan_blob(*i, offset, end, &mut plan).await?,
        }
        Ok(plan)
    }

    /// Bytes `a..b` of the concatenation of `parts` (boxes of tensor `t`, each row-major);
    /// byte `a` goes to `out_at` in the destination.
    async fn plan_boxes(
        &self,
        t: usize,
        parts: &[NdBox],
        a: u64,
        b: u64,
        out_at: i64,
        plan: &mut Plan,
    ) -> Result<()> {
        let entry = &self.commit().tensors[t];
        let elem = entry.dtype.size() as u64;
        let mut ps = 0u64;
        for part in parts {
            let plen = part.numel() * elem;
            let (pa, pb) = (a.max(ps), b.min(ps + plen));
            if pa < pb {
                // Whole elements covering the range; the edges are clipped when copying.
                let (ea, eb) = ((pa - ps) / elem, (pb - ps).div_ceil(elem));
                let mut v = ea * elem;
                for sub in flat_range_boxes(&part.lengths, ea, eb) {
                    let offsets = sub
                        .offsets
                        .iter()
                        .zip(&part.offsets)
                        .map(|(o, p)| o + p)
                        .collect();
                    let global = NdBox {
                        offsets,
                        lengths: sub.lengths,
                    };
                    let rp = self.reader.plan(&entry.name, &global).await?;
                    let base = out_at + (ps + v) as i64 - a as i64;
                    for pc in &rp.chunks {
                        for c in &pc.copies {
                            plan.add(
                                &pc.chunk,
                                pc.rank,
                                What::Tensor(t),
                                Run {
                                    src: c.src,
                                    dst: base + c.dst as i64,
                                    len: c.len,
                                },
                            );
                        }
                    }
                    v += global.numel() * elem;
                }
            }
            ps += plen;
            if ps >= b {
                break;
            }
        }
        Ok(())
    }

    async fn plan_blob(&self, i: usize, a: u64, b: u64, plan: &mut Plan) -> Result<()> {
        let loc = &self.commit().blobs[i];
        let m = self.reader.manifest(loc.rank).await?;
        let blob = m.blobs.iter().find(|x| x.name == loc.name).ok_or_else(|| {
            Error::corrupt(format!(
                "{}: the commit record lists blob {:?} of rank {}, whose manifest does not hold it",
                self.what(),
                loc.name,
                loc.rank
            ))
        })?;
        let mut at = 0u64;
        for c in &blob.chunks {
            let (s, e) = (at, at + c.len as u64);
            let (x, y) = (a.max(s), b.min(e));
            if x < y {
                plan.add(
                    c,
                    loc.rank,
                    What::Blob(i),
                    Run {
                        src: x - s,
                        dst: (x - a) as i64,
                        len: y - x,
                    },
                );
            }
            at = e;
            if at >= b {
                break;
            }
        }
        Ok(())
    }

    /// Run a plan: fetch its chunks (`concurrency` at a time) through `cache` and copy.
    pub async fn execute(
        &self,
        store: &Store,
        cache: &ChunkCache,
        plan: Plan,
        concurrency: usize,
    ) -> Result<Vec<u8>> {
        let mut out = vec![0u8; plan.len];
        for (dst, b) in &plan.literal {
            out[*dst..*dst + b.len()].copy_from_slice(b);
        }
        let mut fetched = futures::stream::iter(plan.fetches)
            .map(|f| fetch_one(store, cache, f))
            .buffer_unordered(concurrency.max(1));
        while let Some((f, r)) = fetched.next().await {
            let bytes = match r {
                Ok(b) => b,
                Err(e) => return Err(self.damaged(store, &f, e)),
            };
            let n = out.len() as i64;
            for r in &f.runs {
                let lo = r.dst.max(0);
                let hi = (r.dst + r.len as i64).min(n);
                if lo >= hi {
                    continue;
                }
                let s = (r.src as i64 + lo - r.dst) as usize;
                let l = (hi - lo) as usize;
                out[lo as usize..lo as usize + l].copy_from_slice(&bytes[s..s + l]);
            }
        }
        Ok(out)
    }

    /// Fetch the chunks of a plan into the cache (read-ahead); failures are left to the read
    /// that needs the bytes.
    pub async fn prefetch(&self, store: &Store, cache: &ChunkCache, plan: Plan, n: usize) {
        futures::stream::iter(plan.fetches)
            .map(|f| fetch_one(store, cache, f))
            .buffer_unordered(n.max(1))
            .for_each(|(f, r)| async move {
                if let Err(e) = r {
                    tracing::debug!(chunk = %f.chunk.id, error = %e, "read-ahead failed");
                }
            })
            .await;
    }

    fn damaged(&self, store: &Store, f: &Fetch, e: Error) -> Error {
        let c = self.commit();
        let object = store.keys().object_of(&f.chunk);
        let item = match f.what {
            What::Tensor(t) => format!("tensor {:?} (shard of rank {})", c.tensors[t].name, f.rank),
            What::Blob(b) => format!("blob {:?} of rank {}", c.blobs[b].name, f.rank),
        };
        warn!(
            run = %c.run,
            step = c.step,
            object = %object,
            chunk = %f.chunk.id,
            item = %item,
            error = %e,
            "read failed: {item} of {} needs chunk {} (object {object}): {e}",
            self.what(),
            f.chunk.id,
        );
        e.context(format!("{}: {item}, object {object}", self.what()))
    }
}

async fn fetch_one(store: &Store, cache: &ChunkCache, f: Fetch) -> (Fetch, Result<Bytes>) {
    let r = cache.get(store, &f.chunk).await;
    (f, r)
}

/// `COMMIT.json`: the commit record, plus `fs_names` listing every tensor and blob whose file
/// name differs from its name (`{"tensors": {name: file}, "blobs": {rank: {name: file}}}`).
fn commit_json(
    c: &CommitRecord,
    tensors: &NameMap,
    blob_ranks: &BTreeMap<u32, RankBlobs>,
    has_model: bool,
) -> Vec<u8> {
    let mut t = Map::new();
    for (i, e) in c.tensors.iter().enumerate() {
        if tensors.file(i) != e.name {
            t.insert(e.name.clone(), Value::String(tensors.file(i).to_string()));
        }
    }
    let mut b = Map::new();
    for (r, rb) in blob_ranks {
        let mut m = Map::new();
        for (k, &i) in rb.blobs.iter().enumerate() {
            if rb.names.file(k) != c.blobs[i].name {
                m.insert(
                    c.blobs[i].name.clone(),
                    Value::String(rb.names.file(k).to_string()),
                );
            }
        }
        if !m.is_empty() {
            b.insert(r.to_string(), Value::Object(m));
        }
    }
    // The record's own field order (format, run, step, layout, ...) reads better than the
    // sorted keys of a JSON map, so `fs_names` is appended to its pretty text.
    let names = json!({ "tensors": t, "blobs": b, "model_safetensors": has_model });
    let record = serde_json::to_string_pretty(c).unwrap_or_else(|e| {
        serde_json::to_string_pretty(&json!({ "error": e.to_string() })).unwrap_or_default()
    });
    let names = serde_json::to_string_pretty(&names)
        .unwrap_or_default()
        .replace('\n', "\n  ");
    let body = record
        .trim_end()
        .strip_suffix('}')
        .unwrap_or(&record)
        .trim_end();
    let mut out = format!("{body},\n  \"fs_names\": {names}\n}}").into_bytes();
    out.push(b'\n');
    out
}
