//! The data model: dtypes, n-d boxes, layouts, chunk references, rank manifests and the
//! commit record (see FORMAT.md for the serialized forms).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::id::{ChunkId, Hash, PackId};

/// The version of manifests and commit records this build writes.
///
/// Format 2 added the commit record's `checksum`; readers accept a record without one only if
/// it is of format 1 (written before checksums existed).
pub const FORMAT_VERSION: u32 = 2;

/// The first format whose commit records carry a `checksum`.
pub const FIRST_CHECKSUMMED_FORMAT: u32 = 2;

/// The longest tensor or blob name accepted (bytes).
pub const MAX_NAME_LEN: usize = 4096;

/// Element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// IEEE binary64.
    F64,
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
    /// FP8 E4M3 (OCP, finite-only).
    F8E4m3,
    /// FP8 E5M2.
    F8E5m2,
    /// Signed integers.
    I64,
    /// Signed integers.
    I32,
    /// Signed integers.
    I16,
    /// Signed integers.
    I8,
    /// Unsigned integers.
    U64,
    /// Unsigned integers.
    U32,
    /// Unsigned integers.
    U16,
    /// Unsigned integers.
    U8,
    /// One byte, 0 or 1.
    Bool,
}

impl DType {
    /// All dtypes.
    pub const ALL: [DType; 15] = [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::F8E4m3,
        DType::F8E5m2,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U64,
        DType::U32,
        DType::U16,
        DType::U8,
        DType::Bool,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::Bf16 | DType::I16 | DType::U16 => 2,
            DType::F8E4m3 | DType::F8E5m2 | DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Floating point (the byte-plane codec is meant for these).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F64 | DType::F32 | DType::F16 | DType::Bf16 | DType::F8E4m3 | DType::F8E5m2
        )
    }

    /// The name ckpt uses (`bf16`, `f8_e4m3`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F8E4m3 => "f8_e4m3",
            DType::F8E5m2 => "f8_e5m2",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I16 => "i16",
            DType::I8 => "i8",
            DType::U64 => "u64",
            DType::U32 => "u32",
            DType::U16 => "u16",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }

    /// The safetensors dtype string (`BF16`, `F8_E4M3`, ...).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F64 => "F64",
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::Bf16 => "BF16",
            DType::F8E4m3 => "F8_E4M3",
            DType::F8E5m2 => "F8_E5M2",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::I16 => "I16",
            DType::I8 => "I8",
            DType::U64 => "U64",
            DType::U32 => "U32",
            DType::U16 => "U16",
            DType::U8 => "U8",
            DType::Bool => "BOOL",
        }
    }

    /// The dtype of a safetensors dtype string.
    pub fn from_safetensors_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.safetensors_name() == s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        DType::ALL
            .into_iter()
            .find(|d| d.name() == lower || d.safetensors_name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "unknown dtype {s:?}: expected one of {}",
                    DType::ALL.map(|d| d.name()).join(", ")
                ))
            })
    }
}

/// The number of elements of a shape, or an error if it overflows.
pub fn numel(shape: &[u64]) -> Result<u64> {
    shape.iter().try_fold(1u64, |acc, &d| {
        acc.checked_mul(d)
            .ok_or_else(|| Error::invalid(format!("shape {shape:?} has too many elements")))
    })
}

/// An n-d box of a tensor: `offsets[d] .. offsets[d] + lengths[d]` in every dimension.
///
/// A 0-d box (no dimensions) holds one element, like a scalar tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NdBox {
    /// Start in each dimension.
    pub offsets: Vec<u64>,
    /// Extent in each dimension.
    pub lengths: Vec<u64>,
}

impl NdBox {
    /// A box from offsets and lengths.
    pub fn new(offsets: Vec<u64>, lengths: Vec<u64>) -> Result<Self> {
        if offsets.len() != lengths.len() {
            return Err(Error::invalid(format!(
                "box offsets {offsets:?} and lengths {lengths:?} have different ranks"
            )));
        }
        for (o, l) in offsets.iter().zip(&lengths) {
            if o.checked_add(*l).is_none() {
                return Err(Error::invalid(format!(
                    "box offsets {offsets:?} lengths {lengths:?} overflow"
                )));
            }
        }
        Ok(NdBox { offsets, lengths })
    }

    /// The whole of a tensor of `shape`.
    pub fn full(shape: &[u64]) -> Self {
        NdBox {
            offsets: vec![0; shape.len()],
            lengths: shape.to_vec(),
        }
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.lengths.len()
    }

    /// Number of elements (saturating; validated boxes never saturate).
    pub fn numel(&self) -> u64 {
        self.lengths
            .iter()
            .fold(1u64, |acc, &l| acc.saturating_mul(l))
    }

    /// No elements.
    pub fn is_empty(&self) -> bool {
        self.lengths.contains(&0)
    }

    /// Whether this box lies inside a tensor of `shape`.
    pub fn within(&self, shape: &[u64]) -> bool {
        self.ndim() == shape.len()
            && self.offsets.len() == shape.len()
            && self
                .offsets
                .iter()
                .zip(&self.lengths)
                .zip(shape)
                .all(|((o, l), s)| o.checked_add(*l).is_some_and(|e| e <= *s))
    }

    /// The common part of two boxes, `None` if they do not overlap (or differ in rank).
    pub fn intersect(&self, other: &NdBox) -> Option<NdBox> {
        if self.ndim() != other.ndim() {
            return None;
        }
        let mut offsets = Vec::with_capacity(self.ndim());
        let mut lengths = Vec::with_capacity(self.ndim());
        for d in 0..self.ndim() {
            let lo = self.offsets[d].max(other.offsets[d]);
            let hi = (self.offsets[d] + self.lengths[d]).min(other.offsets[d] + other.lengths[d]);
            if hi <= lo {
                return None;
            }
            offsets.push(lo);
            lengths.push(hi - lo);
        }
        Some(NdBox { offsets, lengths })
    }

    /// Whether `other` lies entirely inside this box.
    pub fn contains(&self, other: &NdBox) -> bool {
        self.ndim() == other.ndim()
            && (0..self.ndim()).all(|d| {
                other.offsets[d] >= self.offsets[d]
                    && other.offsets[d] + other.lengths[d] <= self.offsets[d] + self.lengths[d]
            })
    }
}

impl fmt::Display for NdBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ndim() == 0 {
            return f.write_str("[scalar]");
        }
        if self.offsets.len() != self.lengths.len() {
            // Only a damaged box read from the store: show it as it is.
            return write!(
                f,
                "[offsets {:?}, lengths {:?}]",
                self.offsets, self.lengths
            );
        }
        f.write_str("[")?;
        for (d, (o, l)) in self.offsets.iter().zip(&self.lengths).enumerate() {
            if d > 0 {
                f.write_str(", ")?;
            }
            match o.checked_add(*l) {
                Some(end) => write!(f, "{o}..{end}")?,
                None => write!(f, "{o}..{o}+{l}")?,
            }
        }
        f.write_str("]")
    }
}

/// Calls `f(src_byte, dst_byte, len)` for every contiguous run of `region`, where `src` and
/// `dst` are boxes stored row-major and `region` lies inside both.
///
/// Trailing dimensions that `region` spans fully in both boxes are merged into one run, so a
/// row split copies whole rows and an identical layout copies one run.
pub fn copy_runs(
    src: &NdBox,
    dst: &NdBox,
    region: &NdBox,
    elem: usize,
    mut f: impl FnMut(u64, u64, u64),
) {
    debug_assert!(src.contains(region) && dst.contains(region));
    let n = region.ndim();
    if region.is_empty() {
        return;
    }
    if n == 0 {
        f(0, 0, elem as u64);
        return;
    }
    let elem = elem as u64;
    // Row-major strides in bytes.
    let strides = |b: &NdBox| {
        let mut s = vec![0u64; n];
        let mut acc = elem;
        for d in (0..n).rev() {
            s[d] = acc;
            acc *= b.lengths[d];
        }
        s
    };
    let ss = strides(src);
    let ds = strides(dst);
    // The run covers dims j..n: every dim after j is spanned fully in src, dst and region.
    let mut j = n - 1;
    while j > 0 && region.lengths[j] == src.lengths[j] && region.lengths[j] == dst.lengths[j] {
        j -= 1;
    }
    let run = region.lengths[j..].iter().product::<u64>() * elem;
    let base_src: u64 = (0..n)
        .map(|d| (region.offsets[d] - src.offsets[d]) * ss[d])
        .sum();
    let base_dst: u64 = (0..n)
        .map(|d| (region.offsets[d] - dst.offsets[d]) * ds[d])
        .sum();
    // Odometer over dims 0..j.
    let mut idx = vec![0u64; j];
    loop {
        let so: u64 = base_src + (0..j).map(|d| idx[d] * ss[d]).sum::<u64>();
        let dof: u64 = base_dst + (0..j).map(|d| idx[d] * ds[d]).sum::<u64>();
        f(so, dof, run);
        let mut d = j;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < region.lengths[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The parallel layout of a job: data, tensor and pipeline parallel degrees and the ZeRO
/// stage. Ranks are ordered tensor-parallel fastest, then data-parallel, then pipeline
/// (`rank = (pp_idx * dp + dp_idx) * tp + tp_idx`), as Megatron orders them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    /// Data-parallel degree.
    pub dp: u32,
    /// Tensor-parallel degree.
    pub tp: u32,
    /// Pipeline-parallel degree.
    pub pp: u32,
    /// ZeRO stage (0 = none, 1-3).
    #[serde(default)]
    pub zero: u8,
}

/// A rank's place in a [`Layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    /// Data-parallel index.
    pub dp: u32,
    /// Tensor-parallel index.
    pub tp: u32,
    /// Pipeline stage.
    pub pp: u32,
}

impl Layout {
    /// A single process holding everything.
    pub const SINGLE: Layout = Layout {
        dp: 1,
        tp: 1,
        pp: 1,
        zero: 0,
    };

    /// A layout, checked.
    pub fn new(dp: u32, tp: u32, pp: u32, zero: u8) -> Result<Self> {
        let l = Layout { dp, tp, pp, zero };
        l.validate()?;
        Ok(l)
    }

    /// Check degrees and stage.
    pub fn validate(&self) -> Result<()> {
        if self.dp == 0 || self.tp == 0 || self.pp == 0 {
            return Err(Error::invalid(format!(
                "layout {self}: every degree must be at least 1"
            )));
        }
        if self.zero > 3 {
            return Err(Error::invalid(format!(
                "layout {self}: ZeRO stage must be 0, 1, 2 or 3"
            )));
        }
        if (self.dp as u64) * (self.tp as u64) * (self.pp as u64) > 1 << 24 {
            return Err(Error::invalid(format!(
                "layout {self}: more than 16M ranks"
            )));
        }
        Ok(())
    }

    /// Number of ranks.
    pub fn world(&self) -> u32 {
        self.dp * self.tp * self.pp
    }

    /// The coordinates of `rank`.
    pub fn coords(&self, rank: u32) -> Coords {
        Coords {
            tp: rank % self.tp,
            dp: (rank / self.tp) % self.dp,
            pp: rank / (self.tp * self.dp),
        }
    }

    /// The rank at `coords`.
    pub fn rank(&self, c: Coords) -> u32 {
        (c.pp * self.dp + c.dp) * self.tp + c.tp
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp={},tp={},pp={}", self.dp, self.tp, self.pp)?;
        if self.zero > 0 {
            write!(f, ",zero={}", self.zero)?;
        }
        Ok(())
    }
}

impl FromStr for Layout {
    type Err = Error;
    /// `dp=2,tp=2,pp=1[,zero=1]`; missing degrees default to 1.
    fn from_str(s: &str) -> Result<Self> {
        let mut l = Layout::SINGLE;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                Error::invalid(format!(
                    "layout {s:?}: expected key=value pairs like dp=2,tp=2,pp=1"
                ))
            })?;
            let v: u32 = v.trim().parse().map_err(|_| {
                Error::invalid(format!("layout {s:?}: {k} must be a positive integer"))
            })?;
            match k.trim() {
                "dp" => l.dp = v,
                "tp" => l.tp = v,
                "pp" => l.pp = v,
                "zero" => {
                    l.zero = u8::try_from(v)
                        .map_err(|_| Error::invalid(format!("layout {s:?}: bad zero stage")))?
                }
                other => {
                    return Err(Error::invalid(format!(
                        "layout {s:?}: unknown dimension {other:?} (known: dp, tp, pp, zero)"
                    )));
                }
            }
        }
        l.validate()?;
        Ok(l)
    }
}

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
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl ChunkRef {
    /// A short description of where the chunk lives, for messages.
    pub fn location(&self) -> String {
        match &self.pack {
            Some(p) => format!("{} (in {} at offset {})", self.id, p, self.offset),
            None => format!("{}", self.id),
        }
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
    pub placement: Option<crate::placement::Placement>,
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
    /// [`FORMAT_VERSION`] of the writer.
    pub format: u32,
    /// Run name.
    pub run: String,
    /// Step number.
    pub step: u64,
    /// This rank.
    pub rank: u32,
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
    /// Check everything a reader relies on; `what` names the object in messages.
    pub fn validate(&self, what: &str) -> Result<()> {
        let bad = |m: String| Err(Error::corrupt(format!("{what}: {m}")));
        if self.format > FORMAT_VERSION {
            return Err(Error::invalid(format!(
                "{what}: written in format {} by a newer ckpt; this build reads up to {FORMAT_VERSION}",
                self.format
            )));
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
        }
        for b in &self.blobs {
            validate_name(&b.name).map_err(|e| e.context(what))?;
            check_chunk_lens(&b.chunks, b.len)
                .or_else(|m| bad(format!("blob {:?}: {m}", b.name)))?;
        }
        Ok(())
    }

    /// The shard of `name` this rank wrote (not a replica reference).
    pub fn written_shard(&self, name: &str, bbox: &NdBox) -> Option<&TensorShard> {
        self.tensors
            .iter()
            .find(|t| t.name == name && &t.bbox == bbox && t.replica_of.is_none())
    }
}

fn check_chunk_lens(chunks: &[ChunkRef], want: u64) -> std::result::Result<(), String> {
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
    pub placement: Option<crate::placement::Placement>,
}

impl TensorEntry {
    /// The tensor's spec, if its placement is known.
    pub fn spec(&self) -> Option<crate::placement::TensorSpec> {
        self.placement
            .as_ref()
            .map(|p| crate::placement::TensorSpec {
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
    /// [`FORMAT_VERSION`] of the writer.
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
}

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

    /// Set [`CommitRecord::checksum`] and return the record's bytes (pretty JSON), the only
    /// way a commit record is encoded. Every committer of a step gets the same bytes.
    pub fn seal(&mut self) -> Result<Vec<u8>> {
        self.checksum = Some(Hash([0; 32]));
        let mut bytes = serde_json::to_vec_pretty(self)
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
                    let newer = if c.format > FORMAT_VERSION {
                        format!(
                            " (or written in format {} by a newer ckpt; this build reads up to {FORMAT_VERSION})",
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
        if self.format > FORMAT_VERSION {
            return Err(Error::invalid(format!(
                "{what}: written in format {} by a newer ckpt; this build reads up to {FORMAT_VERSION}",
                self.format
            )));
        }
        if self.format == 0 {
            return bad("format 0 does not exist (damaged)".into());
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

/// Check that `shards` cover a tensor of `shape` exactly once.
///
/// The error names the tensor and a region that is missing or doubled (with the ranks that
/// both hold it).
pub fn check_coverage(name: &str, shape: &[u64], shards: &[ShardLoc]) -> Result<()> {
    for s in shards {
        if !s.bbox.within(shape) {
            return Err(Error::invalid(format!(
                "tensor {name:?}: rank {} holds box {} outside the shape {shape:?}",
                s.rank, s.bbox
            )));
        }
    }
    let shards: Vec<&ShardLoc> = shards.iter().filter(|s| !s.bbox.is_empty()).collect();
    let total = NdBox::full(shape).numel();
    if total == 0 {
        return Ok(());
    }
    // Coordinate compression: the boundaries of all shards cut the tensor into cells; each
    // cell is covered by the same set of shards everywhere inside it.
    let n = shape.len();
    let mut cuts: Vec<Vec<u64>> = (0..n).map(|d| vec![0, shape[d]]).collect();
    for s in &shards {
        for (d, c) in cuts.iter_mut().enumerate() {
            c.push(s.bbox.offsets[d]);
            c.push(s.bbox.offsets[d] + s.bbox.lengths[d]);
        }
    }
    for c in &mut cuts {
        c.sort_unstable();
        c.dedup();
    }
    let cells: u128 = cuts.iter().map(|c| (c.len() - 1) as u128).product();
    if cells > 4_000_000 {
        return coverage_by_volume(name, shape, &shards);
    }
    // Count coverage per cell.
    let dims: Vec<usize> = cuts.iter().map(|c| c.len() - 1).collect();
    let mut count = vec![0u32; cells as usize];
    let mut first = vec![u32::MAX; cells as usize];
    let mut doubled: Option<(usize, u32, u32)> = None;
    for s in &shards {
        let lo: Vec<usize> = (0..n)
            .map(|d| cuts[d].binary_search(&s.bbox.offsets[d]).unwrap_or(0))
            .collect();
        let hi: Vec<usize> = (0..n)
            .map(|d| {
                cuts[d]
                    .binary_search(&(s.bbox.offsets[d] + s.bbox.lengths[d]))
                    .unwrap_or(0)
            })
            .collect();
        for_each_cell(&lo, &hi, &dims, |cell| {
            count[cell] += 1;
            if first[cell] == u32::MAX {
                first[cell] = s.rank;
            } else if doubled.is_none() {
                doubled = Some((cell, first[cell], s.rank));
            }
        });
    }
    let cell_box = |cell: usize| {
        let mut rem = cell;
        let mut idx = vec![0usize; n];
        for d in (0..n).rev() {
            idx[d] = rem % dims[d];
            rem /= dims[d];
        }
        NdBox {
            offsets: (0..n).map(|d| cuts[d][idx[d]]).collect(),
            lengths: (0..n)
                .map(|d| cuts[d][idx[d] + 1] - cuts[d][idx[d]])
                .collect(),
        }
    };
    if let Some((cell, a, b)) = doubled {
        return Err(Error::invalid(format!(
            "tensor {name:?}: region {} is saved twice (by rank {a} and rank {b})",
            cell_box(cell)
        )));
    }
    if let Some(cell) = count.iter().position(|&c| c == 0) {
        return Err(Error::invalid(format!(
            "tensor {name:?}: region {} of shape {shape:?} is not saved by any rank",
            cell_box(cell)
        )));
    }
    Ok(())
}

fn for_each_cell(lo: &[usize], hi: &[usize], dims: &[usize], mut f: impl FnMut(usize)) {
    let n = lo.len();
    if n == 0 {
        f(0);
        return;
    }
    if (0..n).any(|d| lo[d] >= hi[d]) {
        return;
    }
    let mut idx = lo.to_vec();
    loop {
        let mut cell = 0usize;
        for d in 0..n {
            cell = cell * dims[d] + idx[d];
        }
        f(cell);
        let mut d = n;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}

/// Fallback for shard sets too fragmented for the cell grid: volumes must add up and no two
/// shards may overlap (sweep over the first dimension).
fn coverage_by_volume(name: &str, shape: &[u64], shards: &[&ShardLoc]) -> Result<()> {
    let mut sorted: Vec<&ShardLoc> = shards.to_vec();
    sorted.sort_by_key(|s| s.bbox.offsets[0]);
    let mut active: Vec<&ShardLoc> = Vec::new();
    for s in &sorted {
        active.retain(|a| a.bbox.offsets[0] + a.bbox.lengths[0] > s.bbox.offsets[0]);
        for a in &active {
            if let Some(i) = a.bbox.intersect(&s.bbox) {
                return Err(Error::invalid(format!(
                    "tensor {name:?}: region {i} is saved twice (by rank {} and rank {})",
                    a.rank, s.rank
                )));
            }
        }
        active.push(s);
    }
    let sum: u128 = shards.iter().map(|s| s.bbox.numel() as u128).sum();
    let total = NdBox::full(shape).numel() as u128;
    if sum != total {
        return Err(Error::invalid(format!(
            "tensor {name:?}: shards hold {sum} of {total} elements of shape {shape:?}; part is not saved by any rank"
        )));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn b(o: &[u64], l: &[u64]) -> NdBox {
        NdBox::new(o.to_vec(), l.to_vec()).unwrap()
    }

    fn loc(rank: u32, o: &[u64], l: &[u64]) -> ShardLoc {
        ShardLoc {
            rank,
            bbox: b(o, l),
        }
    }

    #[test]
    fn intersection() {
        let a = b(&[0, 0], &[4, 4]);
        let c = b(&[2, 3], &[4, 4]);
        assert_eq!(a.intersect(&c), Some(b(&[2, 3], &[2, 1])));
        assert_eq!(a.intersect(&b(&[4, 0], &[1, 1])), None);
        assert_eq!(
            NdBox::full(&[]).intersect(&NdBox::full(&[])),
            Some(NdBox::full(&[]))
        );
        assert_eq!(NdBox::full(&[]).numel(), 1);
        assert!(b(&[0], &[0]).is_empty());
    }

    #[test]
    fn copy_runs_merges_full_trailing_dims() {
        let src = b(&[0, 0], &[4, 8]);
        let mut runs = vec![];
        copy_runs(&src, &src, &src, 2, |s, d, l| runs.push((s, d, l)));
        assert_eq!(runs, vec![(0, 0, 64)]);
        // Column half: one run per row.
        let dst = b(&[0, 4], &[4, 4]);
        let mut runs = vec![];
        copy_runs(&src, &dst, &dst, 1, |s, d, l| runs.push((s, d, l)));
        assert_eq!(runs, vec![(4, 0, 4), (12, 4, 4), (20, 8, 4), (28, 12, 4)]);
    }

    #[test]
    fn copy_runs_matches_elementwise_reference() {
        // 3-d src/dst boxes, region = intersection; compare with per-element copy.
        let src = b(&[1, 0, 2], &[3, 4, 5]);
        let dst = b(&[0, 1, 0], &[3, 3, 6]);
        let region = src.intersect(&dst).unwrap();
        let elem = 2usize;
        let sbytes: Vec<u8> = (0..src.numel() as usize * elem).map(|i| i as u8).collect();
        let mut fast = vec![0u8; dst.numel() as usize * elem];
        copy_runs(&src, &dst, &region, elem, |s, d, l| {
            let (s, d, l) = (s as usize, d as usize, l as usize);
            fast[d..d + l].copy_from_slice(&sbytes[s..s + l]);
        });
        let mut slow = vec![0u8; fast.len()];
        for i in 0..region.lengths[0] {
            for j in 0..region.lengths[1] {
                for k in 0..region.lengths[2] {
                    let g = [
                        region.offsets[0] + i,
                        region.offsets[1] + j,
                        region.offsets[2] + k,
                    ];
                    let so = (((g[0] - src.offsets[0]) * src.lengths[1] + (g[1] - src.offsets[1]))
                        * src.lengths[2]
                        + (g[2] - src.offsets[2])) as usize
                        * elem;
                    let dof = (((g[0] - dst.offsets[0]) * dst.lengths[1] + (g[1] - dst.offsets[1]))
                        * dst.lengths[2]
                        + (g[2] - dst.offsets[2])) as usize
                        * elem;
                    slow[dof..dof + elem].copy_from_slice(&sbytes[so..so + elem]);
                }
            }
        }
        assert_eq!(fast, slow);
    }

    #[test]
    fn layout_parse_and_coords() {
        let l: Layout = "dp=2,tp=2,pp=3,zero=1".parse().unwrap();
        assert_eq!(l.world(), 12);
        for r in 0..12 {
            assert_eq!(l.rank(l.coords(r)), r);
        }
        assert_eq!(
            l.coords(5),
            Coords {
                dp: 0,
                tp: 1,
                pp: 1
            }
        );
        assert_eq!(l.to_string(), "dp=2,tp=2,pp=3,zero=1");
        assert!("dp=0".parse::<Layout>().is_err());
        assert!(
            "xp=2"
                .parse::<Layout>()
                .unwrap_err()
                .to_string()
                .contains("unknown dimension")
        );
        assert!("zero=5".parse::<Layout>().is_err());
    }

    #[test]
    fn coverage_exact_gap_and_overlap() {
        let shape = [4, 6];
        // tp column split x dp row split.
        let ok = vec![
            loc(0, &[0, 0], &[2, 3]),
            loc(1, &[0, 3], &[2, 3]),
            loc(2, &[2, 0], &[2, 3]),
            loc(3, &[2, 3], &[2, 3]),
        ];
        check_coverage("w", &shape, &ok).unwrap();

        let gap = &ok[..3];
        let e = check_coverage("w", &shape, gap).unwrap_err().to_string();
        assert!(
            e.contains("\"w\"") && e.contains("[2..4, 3..6]") && e.contains("not saved"),
            "{e}"
        );

        let mut dup = ok.clone();
        dup.push(loc(7, &[1, 1], &[1, 1]));
        let e = check_coverage("w", &shape, &dup).unwrap_err().to_string();
        assert!(
            e.contains("[1..2, 1..2]") && e.contains("rank 0") && e.contains("rank 7"),
            "{e}"
        );

        let out = vec![loc(0, &[0, 0], &[5, 6])];
        assert!(
            check_coverage("w", &shape, &out)
                .unwrap_err()
                .to_string()
                .contains("outside")
        );
    }

    #[test]
    fn coverage_scalar_and_empty() {
        check_coverage("s", &[], &[loc(0, &[], &[])]).unwrap();
        assert!(check_coverage("s", &[], &[]).is_err());
        check_coverage("e", &[0, 3], &[]).unwrap();
    }

    #[test]
    fn coverage_fallback_for_fragmented_sets() {
        // 3000 x 3000 single-element shards along a diagonal band would make 9M cells.
        let n = 2100u64;
        let mut shards: Vec<ShardLoc> = (0..n).map(|i| loc(i as u32, &[i, 0], &[1, n])).collect();
        shards.push(loc(9999, &[0, 0], &[1, 1])); // forces many column cuts
        for i in 1..n {
            shards[i as usize] = loc(i as u32, &[i, 0], &[1, n]);
        }
        let cols: Vec<ShardLoc> = (0..n).map(|j| loc(j as u32, &[0, j], &[1, 1])).collect();
        let mut all: Vec<ShardLoc> = shards[1..n as usize].to_vec();
        all.extend(cols);
        check_coverage("big", &[n, n], &all).unwrap();
        all.pop();
        assert!(check_coverage("big", &[n, n], &all).is_err());
    }

    #[test]
    fn dtype_names() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(DType::from_safetensors_name(d.safetensors_name()), Some(d));
        }
        assert_eq!("BF16".parse::<DType>().unwrap(), DType::Bf16);
        assert!("f128".parse::<DType>().is_err());
    }
}
