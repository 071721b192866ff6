//! What one rank saved for a step: [`RankManifest`] with its tensor shards, blobs, chunk
//! references and write statistics, and the checks a reader relies on.

use serde::{Deserialize, Serialize};

use super::{DELTA_FORMAT_VERSION, DType, HashedChunk, Layout, NdBox, Placement, numel};
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::id::{ChunkId, PackId};

/// The longest tensor or blob name accepted (bytes).
pub const MAX_NAME_LEN: usize = 4096;

/// Where one chunk of a shard or blob is stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// blake3 of the raw bytes.
    pub id: ChunkId,
    /// Raw (decoded) length.
    pub len: u32,
    /// Length of the stored chunk object (header + payload).
    pub stored: u32,
    /// How the payload is encoded.
    pub codec: Codec,
    /// The pack holding the chunk, if it is packed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pack: Option<PackId>,
    /// Offset of the chunk object inside the pack.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offset: u64,
    /// For a delta (`codec` is `delta`): the chain of base chunks, nearest first; the last is
    /// stored whole. Each is the chunk at the same region of an earlier committed step, of the
    /// same length, never packed. Empty for any other codec.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bases: Vec<ChunkId>,
    /// For a delta: the step whose manifest the nearest base was taken from (for messages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_step: Option<u64>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// The longest delta chain a reader follows (writers stop far below: `delta_chain`, 8 by
/// default); a manifest naming a longer one is damaged.
pub const MAX_DELTA_CHAIN: usize = 64;

impl ChunkRef {
    /// A short description of where the chunk lives, for messages.
    pub fn location(&self) -> String {
        match (&self.pack, self.bases.first()) {
            (Some(p), _) => format!("{} (in {} at offset {})", self.id, p, self.offset),
            (None, Some(b)) => match self.base_step {
                Some(s) => format!("{} (a delta on {} of step {s})", self.id, b),
                None => format!("{} (a delta on {})", self.id, b),
            },
            (None, None) => format!("{}", self.id),
        }
    }

    /// A reference to the chunk stored whole (no pack, no base).
    pub fn plain(id: ChunkId, len: u32, stored: u32, codec: Codec) -> Self {
        ChunkRef {
            id,
            len,
            stored,
            codec,
            pack: None,
            offset: 0,
            bases: Vec::new(),
            base_step: None,
        }
    }

    /// Whether the chunk is stored as a delta on a base chunk.
    pub fn is_delta(&self) -> bool {
        !self.bases.is_empty()
    }

    /// The memory reading this chunk may hold at once, at most: its stored object, and for a
    /// chunk stored encoded its decoded bytes and the decoder's planes; for a delta also every
    /// object of its chain (their stored sizes are not recorded: each counted at the plain
    /// length) and each level's planes. What a reader charges a chunk in flight against its
    /// budget of bytes.
    pub fn read_bytes_bound(&self) -> usize {
        let (len, stored) = (self.len as usize, self.stored as usize);
        match self.codec {
            Codec::Raw if !self.is_delta() => stored.max(len),
            _ => stored + len * (2 * self.bases.len() + 1),
        }
    }

    /// The reference of the nearest base (a delta itself when the chain goes on), as far as
    /// a manifest knows it: its stored size and codec are not recorded.
    pub fn base_ref(&self) -> Option<ChunkRef> {
        let (first, rest) = self.bases.split_first()?;
        Some(ChunkRef {
            id: *first,
            len: self.len,
            stored: 0,
            codec: if rest.is_empty() {
                Codec::Raw
            } else {
                Codec::Delta
            },
            pack: None,
            offset: 0,
            bases: rest.to_vec(),
            base_step: None,
        })
    }

    /// Check what a reader relies on of a delta reference (`Err` is the problem).
    pub fn check_chain(&self) -> std::result::Result<(), String> {
        let delta = self.codec == Codec::Delta;
        if delta != self.is_delta() {
            return Err(format!(
                "chunk {}: codec {} with {} base chunk(s)",
                self.id.short(),
                self.codec.name(),
                self.bases.len()
            ));
        }
        if self.bases.len() > MAX_DELTA_CHAIN {
            return Err(format!(
                "chunk {}: a delta chain of {} base chunks is longer than any ckpt writes ({MAX_DELTA_CHAIN})",
                self.id.short(),
                self.bases.len()
            ));
        }
        if delta && self.pack.is_some() {
            return Err(format!(
                "chunk {}: a delta is never packed",
                self.id.short()
            ));
        }
        if self.bases.contains(&self.id) {
            return Err(format!("chunk {}: a delta on itself", self.id.short()));
        }
        Ok(())
    }
}

/// One shard of a tensor saved by a rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorShard {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape of the tensor.
    pub shape: Vec<u64>,
    /// The part of the global tensor this shard holds.
    #[serde(rename = "box")]
    pub bbox: NdBox,
    /// The chunks of the shard's row-major bytes, in order. Empty for a replica.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<ChunkRef>,
    /// For a replica: the rank that wrote these bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_of: Option<u32>,
    /// How the tensor is placed across ranks, so other layouts can be planned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
    /// For a replica this rank checked (the sentinel, `model/replicas.rs`): the chunks of its
    /// own copy it hashed, cut as the writer cuts the box, by index (ascending). The
    /// committer compares them with the writer's chunk ids. Empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hashed: Vec<HashedChunk>,
}

impl TensorShard {
    /// Byte length of the shard.
    pub fn byte_len(&self) -> u64 {
        self.bbox.numel() * self.dtype.size() as u64
    }
}

/// Opaque bytes saved by one rank (RNG state, data position, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobEntry {
    /// Blob name.
    pub name: String,
    /// Length in bytes.
    pub len: u64,
    /// The chunks of the blob, in order.
    pub chunks: Vec<ChunkRef>,
}

/// What a rank's save cost.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteStats {
    /// Bytes of tensors and blobs this rank was responsible for.
    pub logical_bytes: u64,
    /// Chunks of those bytes.
    pub chunks: u64,
    /// Chunks already in the store (not written again).
    pub chunks_skipped: u64,
    /// Raw bytes of the skipped chunks.
    pub bytes_skipped: u64,
    /// Objects written (chunks and packs).
    pub objects_written: u64,
    /// Bytes written to the store (after compression, with headers).
    pub bytes_written: u64,
}

impl WriteStats {
    /// Add another rank's figures.
    pub fn add(&mut self, o: &WriteStats) {
        self.logical_bytes += o.logical_bytes;
        self.chunks += o.chunks;
        self.chunks_skipped += o.chunks_skipped;
        self.bytes_skipped += o.bytes_skipped;
        self.objects_written += o.objects_written;
        self.bytes_written += o.bytes_written;
    }
}

/// Everything one rank saved for a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankManifest {
    /// [`FORMAT_VERSION`](crate::FORMAT_VERSION) of the writer.
    pub format: u32,
    /// Run name.
    pub run: String,
    /// Step number.
    pub step: u64,
    /// This rank.
    pub rank: u32,
    /// The node the rank ran on, when a driver said (`ckpt resume`, `ckpt agent`): the
    /// sentinel names nodes with ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    /// The layout at save time.
    pub layout: Layout,
    /// The job generation (bumped by every restart), for fencing.
    #[serde(default)]
    pub generation: u64,
    /// When the manifest was made (Unix milliseconds).
    pub created_ms: i64,
    /// The tensor shards this rank holds.
    pub tensors: Vec<TensorShard>,
    /// The rank's blobs.
    #[serde(default)]
    pub blobs: Vec<BlobEntry>,
    /// What the save cost.
    #[serde(default)]
    pub stats: WriteStats,
}

impl RankManifest {
    /// Every chunk reference of this rank: its tensor shards' (in order), then its blobs'.
    pub fn chunk_refs(&self) -> impl Iterator<Item = &ChunkRef> {
        self.tensors
            .iter()
            .flat_map(|t| &t.chunks)
            .chain(self.blobs.iter().flat_map(|b| &b.chunks))
    }

    /// Check everything a reader relies on; `what` names the object in messages.
    pub fn validate(&self, what: &str) -> Result<()> {
        let bad = |m: String| Err(Error::corrupt(format!("{what}: {m}")));
        if self.format > DELTA_FORMAT_VERSION {
            return Err(Error::invalid(format!(
                "{what}: written in format {} by a newer ckpt; this build reads up to {DELTA_FORMAT_VERSION}",
                self.format
            )));
        }
        if self.format < DELTA_FORMAT_VERSION && self.has_deltas() {
            return bad(format!(
                "format {} manifest references delta chunks (format {DELTA_FORMAT_VERSION})",
                self.format
            ));
        }
        self.layout.validate().map_err(|e| e.context(what))?;
        if self.rank >= self.layout.world() {
            return bad(format!(
                "rank {} is outside the layout {} ({} ranks)",
                self.rank,
                self.layout,
                self.layout.world()
            ));
        }
        for t in &self.tensors {
            validate_name(&t.name).map_err(|e| e.context(what))?;
            let n =
                numel(&t.shape).map_err(|e| e.context(format!("{what}: tensor {:?}", t.name)))?;
            if n.checked_mul(t.dtype.size() as u64).is_none() {
                return bad(format!(
                    "tensor {:?}: shape {:?} is too large",
                    t.name, t.shape
                ));
            }
            if !t.bbox.within(&t.shape) {
                return bad(format!(
                    "tensor {:?}: shard box {} lies outside the shape {:?}",
                    t.name, t.bbox, t.shape
                ));
            }
            if t.replica_of.is_none() {
                check_chunk_lens(&t.chunks, t.byte_len())
                    .or_else(|m| bad(format!("tensor {:?} box {}: {m}", t.name, t.bbox)))?;
            } else if !t.chunks.is_empty() {
                return bad(format!(
                    "tensor {:?}: a replica must not list chunks",
                    t.name
                ));
            }
            check_hashed(t).or_else(|m| bad(format!("tensor {:?} box {}: {m}", t.name, t.bbox)))?;
        }
        for b in &self.blobs {
            validate_name(&b.name).map_err(|e| e.context(what))?;
            check_chunk_lens(&b.chunks, b.len)
                .or_else(|m| bad(format!("blob {:?}: {m}", b.name)))?;
        }
        Ok(())
    }

    /// Whether any chunk reference is a delta (the manifest is then of
    /// [`DELTA_FORMAT_VERSION`]).
    pub fn has_deltas(&self) -> bool {
        self.chunk_refs()
            .any(|c| c.is_delta() || c.codec == Codec::Delta)
    }

    /// The shard of `name` this rank wrote (not a replica reference).
    pub fn written_shard(&self, name: &str, bbox: &NdBox) -> Option<&TensorShard> {
        self.tensors
            .iter()
            .find(|t| t.name == name && &t.bbox == bbox && t.replica_of.is_none())
    }
}

/// A shard's hashed replica chunks: only on a replica, ascending, each within the box.
fn check_hashed(t: &TensorShard) -> std::result::Result<(), String> {
    if t.hashed.is_empty() {
        return Ok(());
    }
    if t.replica_of.is_none() {
        return Err("only a replica lists hashed chunks".into());
    }
    let len = t.byte_len();
    let mut prev: Option<u32> = None;
    for h in &t.hashed {
        if prev.is_some_and(|p| p >= h.index) {
            return Err(format!("hashed chunk {} is out of order", h.index));
        }
        prev = Some(h.index);
        if h.len == 0 || u64::from(h.index) * u64::from(h.len) >= len {
            return Err(format!(
                "hashed chunk {} of {} bytes lies outside the box's {len} bytes",
                h.index, h.len
            ));
        }
    }
    Ok(())
}

fn check_chunk_lens(chunks: &[ChunkRef], want: u64) -> std::result::Result<(), String> {
    for c in chunks {
        c.check_chain()?;
    }
    if let Some(c) = chunks
        .iter()
        .find(|c| c.len as u64 > crate::codec::MAX_CHUNK_LEN)
    {
        return Err(format!("chunk {} claims {} bytes", c.id, c.len));
    }
    if let Some(c) = chunks
        .iter()
        .find(|c| c.offset.checked_add(c.stored as u64).is_none())
    {
        return Err(format!(
            "chunk {} at offset {} of {} stored bytes ends past any object",
            c.id, c.offset, c.stored
        ));
    }
    let total = chunks
        .iter()
        .try_fold(0u64, |acc, c| acc.checked_add(c.len as u64));
    if total != Some(want) {
        return Err(format!(
            "chunks hold {} bytes, expected {want}",
            total.map_or("more than 2^64".to_string(), |t| t.to_string())
        ));
    }
    Ok(())
}

/// Check a tensor or blob name: non-empty, at most [`MAX_NAME_LEN`] bytes, no NUL.
///
/// Names may hold `/`, `..` and other characters; whoever turns them into file names (the
/// FUSE view, export) maps them to safe names.
pub fn validate_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
        return Err(Error::invalid(format!(
            "name {:?} is not allowed: 1 to {MAX_NAME_LEN} bytes, no NUL",
            truncate(name, 80)
        )));
    }
    Ok(())
}

fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}
