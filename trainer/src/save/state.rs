//! What a save is given ([`SaveTensor`], [`SaveState`]) and its plan once checked and pinned.

use std::sync::Arc;

use bytes::Bytes;
use ckpt_store::{
    BlobIn, DType, Error, NdBox, Placement, Result, SdcCheck, ShardDesc, ShardMeta, most_sampled,
    sampled_chunks,
};

use super::snapshot::Pin;
use super::versions::{ShardKey, StepVersions};
use crate::memory::{MemorySource, SourceVersion};

/// One shard to save.
#[derive(Clone)]
pub struct SaveTensor {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The box saved.
    pub bbox: NdBox,
    /// How the tensor is placed (recorded so other layouts can be planned).
    pub placement: Option<Placement>,
    /// The memory holding exactly the box's row-major bytes. A replica's (optional) is hashed
    /// by the sentinel when the check is on ([`super::CheckpointerConfig::sdc_check`]), never
    /// written.
    pub source: Option<Arc<dyn MemorySource>>,
    /// For a replica: the rank that writes it.
    pub replica_of: Option<u32>,
}

impl SaveTensor {
    /// A whole one-dimensional tensor of `n` bytes (`u8` elements) held in `t`, written by
    /// this rank: raw state such as a data position or a test's payload.
    pub fn bytes(name: &str, t: &crate::memory::HostTensor, n: u64) -> SaveTensor {
        SaveTensor {
            name: name.into(),
            dtype: DType::U8,
            shape: vec![n],
            bbox: NdBox::full(&[n]),
            placement: None,
            source: Some(Arc::new(t.clone())),
            replica_of: None,
        }
    }

    /// Bytes of the box saved.
    fn byte_len(&self) -> usize {
        (self.bbox.numel() * self.dtype.size() as u64) as usize
    }
}

impl std::fmt::Debug for SaveTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SaveTensor({} {})", self.name, self.bbox)
    }
}

/// Everything one rank saves for a step.
#[derive(Debug, Default, Clone)]
pub struct SaveState {
    /// Shards.
    pub tensors: Vec<SaveTensor>,
    /// Named blobs.
    pub blobs: Vec<(String, Vec<u8>)>,
}

impl SaveState {
    /// The length of every span a save of this state may copy into staging, at most: each
    /// shard this rank writes whole, and for each replica the sentinel checks (`check`, the
    /// store's `chunk_size`), as many whole chunks as it samples at the busiest step. What an
    /// automatic staging pool is sized to before the first save, so that the first snapshot
    /// takes no slab it must allocate and touch while the training loop waits.
    pub(super) fn most_copied(&self, check: SdcCheck, chunk_size: usize) -> Vec<usize> {
        let cs = chunk_size.max(1);
        let mut lens = Vec::new();
        for t in self.tensors.iter().filter(|t| t.source.is_some()) {
            let len = t.byte_len();
            match t.replica_of {
                None => lens.push(len),
                Some(_) if check.is_on() && len > 0 => {
                    let n = len.div_ceil(cs) as u32;
                    let k = most_sampled(check, &t.name, &t.bbox, n) as usize;
                    lens.extend(std::iter::repeat_n(cs.min(len), k));
                }
                Some(_) => {}
            }
        }
        lens
    }
}

/// A save's state checked and pinned: the shards' descriptions for the manifest, a pin per
/// shard this rank copies, and the blobs. A shard unchanged since the base (same version) is
/// not pinned: its meta carries the base's chunks (`reuse`).
pub(super) struct SavePlan {
    /// Every shard, in the order given (replicas too).
    pub metas: Vec<ShardMeta>,
    /// Per shard: its version when pinned (or found unchanged), if its source has one.
    pub versions: Vec<Option<SourceVersion>>,
    /// (index into `metas`, the pinned source, the byte spans copied) of each shard this rank
    /// copies: a written shard whole, a checked replica's sampled chunks.
    pub pins: Vec<Pin>,
    /// Bytes the snapshot copies to write.
    pub bytes: u64,
    /// Bytes of replicas the snapshot copies to hash (the sentinel).
    pub checked: u64,
    /// Bytes of shards taken unchanged from the base.
    pub reused: u64,
    /// The step whose chunks the unchanged shards reference, if any shard is.
    pub reuse_from: Option<u64>,
    /// Named blobs.
    pub blobs: Vec<BlobIn>,
}

/// How a save hashes its replicas (the sentinel): the setting, the step (the sample rotates
/// with it) and the store's chunk size (the writer's cut of a box).
#[derive(Debug, Clone, Copy)]
pub(super) struct ReplicaCheck {
    pub check: SdcCheck,
    pub step: u64,
    pub chunk_size: usize,
}

impl ReplicaCheck {
    /// The chunk spans (offset, length) and indices of a replica of `len` bytes to hash.
    fn spans(&self, t: &SaveTensor, len: usize) -> (Vec<(usize, usize)>, Vec<u32>) {
        let cs = self.chunk_size.max(1);
        let n = len.div_ceil(cs) as u32;
        let idx = sampled_chunks(self.check, &t.name, &t.bbox, n, self.step);
        let spans = idx
            .iter()
            .map(|&i| {
                let at = i as usize * cs;
                (at, cs.min(len - at))
            })
            .collect();
        (spans, idx)
    }
}

impl SavePlan {
    /// Check every shard (memory of the box's size, or a replica) and pin its memory: the
    /// checkpoint holds the bytes of this moment. A shard whose version is the one it had in
    /// `base` (a committed step) is not pinned and references `base`'s chunks. A replica
    /// given its memory is pinned for the chunks `check` samples (hashed, not written).
    pub fn pin(
        state: SaveState,
        base: Option<&StepVersions>,
        check: ReplicaCheck,
    ) -> Result<SavePlan> {
        let n = state.tensors.len();
        let mut plan = SavePlan {
            metas: Vec::with_capacity(n),
            versions: Vec::with_capacity(n),
            pins: Vec::new(),
            bytes: 0,
            checked: 0,
            reused: 0,
            reuse_from: None,
            blobs: Vec::new(),
        };
        for t in &state.tensors {
            let len = t.byte_len();
            let mut reuse = None;
            let mut version = None;
            let mut sampled = Vec::new();
            if let Some(src) = &t.source
                && src.len() != len
            {
                return Err(Error::invalid(format!(
                    "tensor {:?} box {}: its memory holds {} bytes, the box {len}",
                    t.name,
                    t.bbox,
                    src.len()
                )));
            }
            match (&t.source, t.replica_of) {
                (Some(src), None) => {
                    let key = ShardKey::new(&t.name, t.dtype, &t.shape, &t.bbox);
                    let now = src.version();
                    let unchanged = match (base, now) {
                        (Some(b), Some(v)) => b.unchanged(&key, v).map(|r| (b.step, r.to_vec())),
                        _ => None,
                    };
                    if let Some((from, refs)) = unchanged {
                        reuse = Some(refs);
                        version = now;
                        plan.reused += len as u64;
                        plan.reuse_from = Some(from);
                    } else {
                        plan.pins
                            .push((plan.metas.len(), src.pin()?, vec![(0, len)]));
                        // Read while pinned: the version of the bytes the copy gets.
                        version = src.version();
                        plan.bytes += len as u64;
                    }
                }
                (Some(src), Some(_)) if check.check.is_on() && len > 0 => {
                    let (spans, idx) = check.spans(t, len);
                    if !spans.is_empty() {
                        plan.checked += spans.iter().map(|s| s.1 as u64).sum::<u64>();
                        plan.pins.push((plan.metas.len(), src.pin()?, spans));
                        sampled = idx;
                    }
                }
                (_, Some(_)) => {}
                (None, None) => {
                    return Err(Error::invalid(format!(
                        "tensor {:?}: give its memory or replica_of (the rank that writes it)",
                        t.name
                    )));
                }
            }
            plan.versions.push(version);
            plan.metas.push(ShardMeta {
                shard: ShardDesc {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    bbox: t.bbox.clone(),
                    replica_of: t.replica_of,
                    placement: t.placement.clone(),
                },
                reuse,
                check: sampled,
            });
        }
        plan.blobs = state
            .blobs
            .into_iter()
            .map(|(name, data)| BlobIn {
                name,
                data: Bytes::from(data),
            })
            .collect();
        Ok(plan)
    }

    /// Byte length of each span the snapshot copies, in order.
    pub fn lens(&self) -> Vec<usize> {
        self.pins
            .iter()
            .flat_map(|p| p.2.iter().map(|s| s.1))
            .collect()
    }
}
