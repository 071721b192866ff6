//! The commit record of a step ([`CommitRecord`]): its entries, the only encoder and decoder
//! of its bytes (with the checksum), its checks, and [`collect_tensors`], which builds its
//! tensor list from the rank manifests.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{
    DType, FIRST_CHECKSUMMED_FORMAT, Layout, NdBox, Placement, RECORD_FORMAT_VERSION, RankManifest,
    ReplicaReport, SPLIT_RECORD_FORMAT, TensorSpec, WriteStats, check_coverage, numel,
};
use crate::error::{Error, Result};
use crate::id::Hash;

/// A rank manifest as listed in the commit record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankEntry {
    /// The rank.
    pub rank: u32,
    /// blake3 of the manifest object's bytes.
    pub hash: Hash,
    /// Size of the manifest object.
    pub size: u64,
}

/// Where a written shard of a tensor lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardLoc {
    /// The rank whose manifest lists the shard's chunks.
    pub rank: u32,
    /// The part of the tensor.
    #[serde(rename = "box")]
    pub bbox: NdBox,
}

/// A tensor as listed in the commit record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The written shards; together they cover the shape exactly once.
    pub shards: Vec<ShardLoc>,
    /// How the tensor is placed across ranks, if the writer said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
}

impl TensorEntry {
    /// The tensor's spec, if its placement is known.
    pub fn spec(&self) -> Option<TensorSpec> {
        self.placement.as_ref().map(|p| TensorSpec {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            placement: p.clone(),
        })
    }
}

impl TensorEntry {
    /// Byte length of the whole tensor.
    pub fn byte_len(&self) -> u64 {
        NdBox::full(&self.shape).numel() * self.dtype.size() as u64
    }
}

/// A blob as listed in the commit record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobLoc {
    /// The rank that saved it.
    pub rank: u32,
    /// Name.
    pub name: String,
    /// Length.
    pub len: u64,
}

/// The global manifest of a committed step. Its existence makes the step complete.
///
/// Its bytes are built by [`CommitRecord::seal`] and read by [`CommitRecord::from_bytes`],
/// which checks the checksum: nothing else encodes or decodes a commit record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommitRecord {
    /// blake3 of the record's bytes with this field's 64 hex digits written as `0`s (the first
    /// field, from format 2 on; `None` only in format 1 records). Set by [`CommitRecord::seal`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<Hash>,
    /// [`RECORD_FORMAT_VERSION`] of the writer (2 and 3: manifests at their old place).
    pub format: u32,
    /// Run name.
    pub run: String,
    /// Step number.
    pub step: u64,
    /// The layout at save time.
    pub layout: Layout,
    /// The job generation that committed.
    #[serde(default)]
    pub generation: u64,
    /// When the step was committed (Unix milliseconds).
    pub committed_ms: i64,
    /// Every rank's manifest.
    pub ranks: Vec<RankEntry>,
    /// Every tensor, sorted by name.
    pub tensors: Vec<TensorEntry>,
    /// Every blob.
    #[serde(default)]
    pub blobs: Vec<BlobLoc>,
    /// Sum of the ranks' write statistics.
    #[serde(default)]
    pub stats: WriteStats,
    /// Format 5, a record too large for one object: where its rank entries, tensors and blobs
    /// live ([`RecordIndex`]). The stored root has `ranks`, `tensors` and `blobs` empty; a
    /// record read whole has them filled from the parts (and keeps the index).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<RecordIndex>,
    /// The sentinel's comparison of the step's replicas (kept in the root of a split record):
    /// `None` when no rank hashed a replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<ReplicaReport>,
}

/// The parts of a split commit record (format 5), in order: every tensor in exactly one
/// tensors part (by name, the parts' ranges ascending), every rank entry and blob in exactly
/// one ranks part (by rank, ascending). Each part is pinned by the blake3 of its bytes, which
/// is also its key ([`crate::Keys::record_part`]), and the root's checksum covers the pins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordIndex {
    /// The parts.
    pub parts: Vec<PartRef>,
}

/// One part of a split commit record, as the root lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PartRef {
    /// Tensors `first..=last` by name, with the rank entries of every rank their shards name
    /// (copies of those in the ranks parts): a reader of these tensors needs nothing else to
    /// find and check their manifests.
    Tensors {
        /// The first tensor's name.
        first: String,
        /// The last tensor's name.
        last: String,
        /// How many tensors.
        count: u32,
        /// blake3 of the part's bytes.
        hash: Hash,
        /// Size of the part's bytes.
        size: u64,
    },
    /// The rank entries of ranks `first..=last` and their blobs.
    Ranks {
        /// The first rank.
        first: u32,
        /// The last rank.
        last: u32,
        /// How many rank entries.
        count: u32,
        /// blake3 of the part's bytes.
        hash: Hash,
        /// Size of the part's bytes.
        size: u64,
    },
}

impl PartRef {
    /// The blake3 of the part's bytes (its name).
    pub fn hash(&self) -> Hash {
        match self {
            PartRef::Tensors { hash, .. } | PartRef::Ranks { hash, .. } => *hash,
        }
    }

    /// The size of the part's bytes.
    pub fn size(&self) -> u64 {
        match self {
            PartRef::Tensors { size, .. } | PartRef::Ranks { size, .. } => *size,
        }
    }
}

/// The bytes of one part of a split commit record (format 5): compact JSON, built only by
/// [`CommitRecord::split`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordPart {
    /// Run name (the root's).
    pub run: String,
    /// Step number (the root's).
    pub step: u64,
    /// Tensors, sorted by name.
    #[serde(default)]
    pub tensors: Vec<TensorEntry>,
    /// Rank entries, ascending.
    #[serde(default)]
    pub ranks: Vec<RankEntry>,
    /// Blobs of the part's ranks.
    #[serde(default)]
    pub blobs: Vec<BlobLoc>,
}

/// A part's name (the blake3 of its bytes) and its bytes, as [`CommitRecord::split`] makes it.
pub type PartBytes = (Hash, Vec<u8>);

/// Rank entries a ranks part holds, at most: about 25 KB of JSON.
pub const RANKS_PER_PART: usize = 256;

impl CommitRecord {
    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }

    /// Bytes of all tensors and blobs.
    pub fn logical_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.byte_len()).sum::<u64>()
            + self.blobs.iter().map(|b| b.len).sum::<u64>()
    }

    /// Split a whole record into a root (format 5, no rank entries, tensors or blobs; not yet
    /// sealed) and its parts' bytes: tensors grouped in name order into parts of about
    /// `part_bytes` of JSON, each with the rank entries its shards name, and rank entries with
    /// their blobs in parts of [`RANKS_PER_PART`]. The same record always gives the same
    /// bytes, so every committer of a step writes the same parts.
    pub fn split(&self, part_bytes: usize) -> Result<(CommitRecord, Vec<PartBytes>)> {
        let encode = |p: &RecordPart| {
            serde_json::to_vec(p)
                .map_err(|e| Error::internal(format!("serializing a commit record part: {e}")))
        };
        let part =
            |tensors: Vec<TensorEntry>, ranks: Vec<RankEntry>, blobs: Vec<BlobLoc>| RecordPart {
                run: self.run.clone(),
                step: self.step,
                tensors,
                ranks,
                blobs,
            };
        let mut refs = Vec::new();
        let mut out = Vec::new();
        let mut group: Vec<TensorEntry> = Vec::new();
        let mut group_bytes = 0usize;
        let mut flush = |group: &mut Vec<TensorEntry>| -> Result<()> {
            let (Some(first), Some(last)) = (group.first(), group.last()) else {
                return Ok(());
            };
            let (first, last) = (first.name.clone(), last.name.clone());
            let named: std::collections::BTreeSet<u32> = group
                .iter()
                .flat_map(|t| t.shards.iter().map(|s| s.rank))
                .collect();
            let ranks: Vec<RankEntry> = self
                .ranks
                .iter()
                .filter(|e| named.contains(&e.rank))
                .cloned()
                .collect();
            let count = group.len() as u32;
            let bytes = encode(&part(std::mem::take(group), ranks, Vec::new()))?;
            let hash = Hash::of(&bytes);
            refs.push(PartRef::Tensors {
                first,
                last,
                count,
                hash,
                size: bytes.len() as u64,
            });
            out.push((hash, bytes));
            Ok(())
        };
        for t in &self.tensors {
            let len = serde_json::to_vec(t)
                .map_err(|e| Error::internal(format!("serializing a tensor entry: {e}")))?
                .len();
            if !group.is_empty() && group_bytes + len > part_bytes {
                flush(&mut group)?;
                group_bytes = 0;
            }
            group_bytes += len;
            group.push(t.clone());
        }
        flush(&mut group)?;
        for ranks in self.ranks.chunks(RANKS_PER_PART) {
            let (first, last) = (ranks[0].rank, ranks[ranks.len() - 1].rank);
            let blobs: Vec<BlobLoc> = self
                .blobs
                .iter()
                .filter(|b| (first..=last).contains(&b.rank))
                .cloned()
                .collect();
            let bytes = encode(&part(Vec::new(), ranks.to_vec(), blobs))?;
            let hash = Hash::of(&bytes);
            refs.push(PartRef::Ranks {
                first,
                last,
                count: ranks.len() as u32,
                hash,
                size: bytes.len() as u64,
            });
            out.push((hash, bytes));
        }
        let root = CommitRecord {
            checksum: None,
            format: SPLIT_RECORD_FORMAT,
            ranks: Vec::new(),
            tensors: Vec::new(),
            blobs: Vec::new(),
            index: Some(RecordIndex { parts: refs }),
            ..self.clone()
        };
        Ok((root, out))
    }

    /// Fill a split record's root with the parts read (`parts[i]` is the part the index lists
    /// `i`th, or `None` for one not read): its tensors, rank entries and blobs. With every
    /// part read, the record is whole as it was before the split; with some, it holds those
    /// parts' tensors and the rank entries they name (checked as a whole record is). A part
    /// that does not belong here (another run or step, a tensor outside its range) is damage.
    pub fn fill(&mut self, parts: Vec<Option<RecordPart>>, what: &str) -> Result<()> {
        let index = self.index.clone().ok_or_else(|| {
            Error::internal(format!("{what}: filling a record that is not split"))
        })?;
        let whole = parts.iter().all(Option::is_some);
        let mut ranks: BTreeMap<u32, RankEntry> = BTreeMap::new();
        let mut pins: Vec<RankEntry> = Vec::new();
        for (r, p) in index.parts.iter().zip(parts) {
            let Some(p) = p else { continue };
            let name = format!("{what}: record part {}", r.hash().short());
            if p.run != self.run || p.step != self.step {
                return Err(Error::corrupt(format!(
                    "{name} belongs to step {} of run {}",
                    p.step, p.run
                )));
            }
            match r {
                PartRef::Tensors {
                    first, last, count, ..
                } => {
                    if p.tensors.len() != *count as usize
                        || p.tensors.iter().any(|t| t.name < *first || t.name > *last)
                    {
                        return Err(Error::corrupt(format!(
                            "{name} does not hold the tensors {first:?}..={last:?} the index lists"
                        )));
                    }
                    self.tensors.extend(p.tensors);
                    pins.extend(p.ranks);
                }
                PartRef::Ranks {
                    first, last, count, ..
                } => {
                    if p.ranks.len() != *count as usize
                        || p.ranks.iter().any(|e| e.rank < *first || e.rank > *last)
                    {
                        return Err(Error::corrupt(format!(
                            "{name} does not hold the ranks {first}..={last} the index lists"
                        )));
                    }
                    ranks.extend(p.ranks.into_iter().map(|e| (e.rank, e)));
                    self.blobs.extend(p.blobs);
                }
            }
        }
        for e in pins {
            match ranks.get(&e.rank) {
                Some(have) if *have != e => {
                    return Err(Error::corrupt(format!(
                        "{what}: the record's parts disagree about the manifest of rank {}",
                        e.rank
                    )));
                }
                Some(_) if whole => {}
                _ if whole => {
                    return Err(Error::corrupt(format!(
                        "{what}: a tensor's shard names rank {}, which no ranks part lists",
                        e.rank
                    )));
                }
                _ => {
                    ranks.insert(e.rank, e);
                }
            }
        }
        self.ranks = ranks.into_values().collect();
        self.validate(what)
    }

    /// Set [`CommitRecord::checksum`] and return the record's bytes (compact JSON: at
    /// thousands of ranks whitespace tripled its size), the only
    /// way a commit record is encoded. Every committer of a step gets the same bytes.
    pub fn seal(&mut self) -> Result<Vec<u8>> {
        self.checksum = Some(Hash([0; 32]));
        let mut bytes = serde_json::to_vec(self)
            .map_err(|e| Error::internal(format!("serializing a commit record: {e}")))?;
        let span = checksum_span(&bytes)
            .ok_or_else(|| Error::internal("a sealed commit record has no checksum field"))?;
        let sum = Hash::of(&bytes);
        bytes[span].copy_from_slice(sum.to_hex().as_bytes());
        self.checksum = Some(sum);
        Ok(bytes)
    }

    /// Decode a commit record's bytes, the only way one is decoded: parse, check the checksum
    /// (required from format 2 on; a format 1 record has none), then [`CommitRecord::validate`].
    /// `what` names the record (its step) in messages; damage is [`ErrorKind::Corrupt`].
    ///
    /// [`ErrorKind::Corrupt`]: crate::ErrorKind::Corrupt
    pub fn from_bytes(bytes: &[u8], what: &str) -> Result<CommitRecord> {
        let c: CommitRecord = serde_json::from_slice(bytes).map_err(|e| {
            Error::corrupt(format!(
                "{what}: not a valid commit record ({e}; {} bytes, damaged or truncated)",
                bytes.len()
            ))
        })?;
        match c.checksum {
            Some(want) => {
                let got = checksum_span(bytes).and_then(|span| {
                    (bytes[span.clone()] == *want.to_hex().as_bytes()).then(|| {
                        let mut zeroed = bytes.to_vec();
                        zeroed[span].fill(b'0');
                        Hash::of(&zeroed)
                    })
                });
                if got != Some(want) {
                    let newer = if c.format > RECORD_FORMAT_VERSION {
                        format!(
                            " (or written in format {} by a newer ckpt; this build reads up to {RECORD_FORMAT_VERSION})",
                            c.format
                        )
                    } else {
                        String::new()
                    };
                    return Err(Error::corrupt(format!(
                        "{what}: the record's bytes do not match its checksum {}: it is damaged{newer}; \
                         do not use this step (`ckpt verify` lists what else is damaged)",
                        want.short()
                    )));
                }
            }
            None if c.format < FIRST_CHECKSUMMED_FORMAT && c.format >= 1 => {}
            None => {
                return Err(Error::corrupt(format!(
                    "{what}: a format {} record without a checksum (every record since format {FIRST_CHECKSUMMED_FORMAT} has one): it is damaged",
                    c.format
                )));
            }
        }
        c.validate(what)?;
        Ok(c)
    }

    /// Check what a reader relies on.
    pub fn validate(&self, what: &str) -> Result<()> {
        let bad = |m: String| Err(Error::corrupt(format!("{what}: {m}")));
        if self.format > RECORD_FORMAT_VERSION {
            return Err(Error::invalid(format!(
                "{what}: written in format {} by a newer ckpt; this build reads up to {RECORD_FORMAT_VERSION}",
                self.format
            )));
        }
        if self.format == 0 {
            return bad("format 0 does not exist (damaged)".into());
        }
        if (self.format >= SPLIT_RECORD_FORMAT) != self.index.is_some() {
            return bad(format!(
                "a format {} record {} an index of parts (damaged)",
                self.format,
                if self.index.is_some() {
                    "with"
                } else {
                    "without"
                }
            ));
        }
        self.layout.validate().map_err(|e| e.context(what))?;
        let world = self.layout.world();
        if !self.ranks.windows(2).all(|w| w[0].rank < w[1].rank)
            || self.ranks.iter().any(|e| e.rank >= world)
        {
            return bad(format!(
                "its rank manifests are not ranks 0..{world} of the layout {}, each once",
                self.layout
            ));
        }
        let listed = |r: u32| self.ranks.binary_search_by_key(&r, |e| e.rank).is_ok();
        if !self.tensors.windows(2).all(|w| w[0].name < w[1].name) {
            return bad("tensors are not sorted by name or appear twice".into());
        }
        for t in &self.tensors {
            let n = numel(&t.shape).map_err(|e| e.context(what))?;
            if n.checked_mul(t.dtype.size() as u64).is_none() {
                return bad(format!(
                    "tensor {:?} shape {:?} is too large",
                    t.name, t.shape
                ));
            }
            for s in &t.shards {
                if !s.bbox.within(&t.shape) {
                    return bad(format!(
                        "tensor {:?} shard {} lies outside the shape {:?}",
                        t.name, s.bbox, t.shape
                    ));
                }
                if !listed(s.rank) {
                    return bad(format!(
                        "tensor {:?} shard {} is placed on rank {}, which has no manifest in the record",
                        t.name, s.bbox, s.rank
                    ));
                }
            }
            // Readers fill the tensor's bytes from its shards: shards that do not cover the
            // shape exactly once would leave bytes unwritten (or written twice).
            check_coverage(&t.name, &t.shape, &t.shards)
                .or_else(|e| bad(format!("{} (the record is damaged)", e.message())))?;
        }
        // Readers add these up (the safetensors view's offsets, statistics).
        let total = self
            .tensors
            .iter()
            .map(TensorEntry::byte_len)
            .chain(self.blobs.iter().map(|b| b.len))
            .try_fold(0u64, u64::checked_add);
        if total.is_none() {
            return bad("its tensors and blobs hold more than 2^64 bytes".into());
        }
        if let Some(b) = self.blobs.iter().find(|b| !listed(b.rank)) {
            return bad(format!(
                "blob {:?} is placed on rank {}, which has no manifest in the record",
                b.name, b.rank
            ));
        }
        Ok(())
    }
}

/// Where the 64 hex digits of a commit record's `checksum` lie: after the first `"checksum"`
/// key (the record's first field), a colon and a quote.
fn checksum_span(bytes: &[u8]) -> Option<std::ops::Range<usize>> {
    const KEY: &[u8] = b"\"checksum\"";
    let mut i = bytes.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    let skip_ws = |i: &mut usize| {
        while bytes.get(*i).is_some_and(u8::is_ascii_whitespace) {
            *i += 1;
        }
    };
    skip_ws(&mut i);
    (bytes.get(i) == Some(&b':')).then_some(())?;
    i += 1;
    skip_ws(&mut i);
    (bytes.get(i) == Some(&b'"')).then_some(())?;
    i += 1;
    let end = i.checked_add(64)?;
    (bytes.get(end) == Some(&b'"')).then_some(i..end)
}

/// Group the written shards of many rank manifests into commit-record tensor entries, checking
/// that ranks agree on dtype and shape.
pub fn collect_tensors(manifests: &[RankManifest]) -> Result<Vec<TensorEntry>> {
    let mut map: BTreeMap<&str, TensorEntry> = BTreeMap::new();
    for m in manifests {
        for t in &m.tensors {
            let e = map.entry(&t.name).or_insert_with(|| TensorEntry {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                shards: Vec::new(),
                placement: t.placement.clone(),
            });
            if e.placement.is_none() {
                e.placement = t.placement.clone();
            }
            if e.dtype != t.dtype || e.shape != t.shape {
                return Err(Error::invalid(format!(
                    "tensor {:?}: rank {} saved it as {} {:?} but another rank as {} {:?}",
                    t.name, m.rank, t.dtype, t.shape, e.dtype, e.shape
                )));
            }
            if t.replica_of.is_none() {
                e.shards.push(ShardLoc {
                    rank: m.rank,
                    bbox: t.bbox.clone(),
                });
            }
        }
    }
    // Replicas must point at a shard that was written.
    for m in manifests {
        for t in m.tensors.iter().filter(|t| t.replica_of.is_some()) {
            let w = t.replica_of.unwrap_or_default();
            let e = &map[t.name.as_str()];
            if !e.shards.iter().any(|s| s.rank == w && s.bbox == t.bbox) {
                return Err(Error::invalid(format!(
                    "tensor {:?}: rank {} records box {} as a replica of rank {w}, which did not save it",
                    t.name, m.rank, t.bbox
                )));
            }
        }
    }
    Ok(map.into_values().collect())
}
