//! [`DedupIndex`]: the chunks a writer knows the store holds, and the delta bases by region
//! ([`BaseRegions`]).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::id::ChunkId;
use crate::model::{ChunkRef, DType, NdBox, RankManifest};

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
    map: HashMap<(String, DType, Vec<u64>, NdBox), Vec<ChunkRef>>,
}

impl BaseRegions {
    /// The written shards of `m`.
    pub fn of(m: &RankManifest) -> Self {
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
        dtype: DType,
        shape: &[u64],
        bbox: &NdBox,
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
        self.map.lock().get(id).cloned()
    }

    /// Record chunks the store holds.
    pub fn extend<'a>(&self, refs: impl IntoIterator<Item = &'a ChunkRef>) {
        let mut m = self.map.lock();
        for r in refs {
            m.entry(r.id).or_insert_with(|| r.clone());
        }
    }

    /// The committed step this index was seeded from, by region (delta bases), if known.
    pub fn base_regions(&self) -> Option<(u64, Arc<BaseRegions>)> {
        self.regions.lock().clone()
    }

    /// Say that the chunks of committed step `step` are known by region (`regions`): a save
    /// may store its chunks as deltas on them. Only a step whose commit the save's lease found
    /// may be given (FORMAT.md, "What GC may delete").
    pub fn set_base_regions(&self, step: u64, regions: Arc<BaseRegions>) {
        *self.regions.lock() = Some((step, regions));
    }

    /// Replace the contents with `refs`.
    pub fn reset<'a>(&self, refs: impl IntoIterator<Item = &'a ChunkRef>) {
        let mut m = self.map.lock();
        m.clear();
        for r in refs {
            m.entry(r.id).or_insert_with(|| r.clone());
        }
    }

    /// Number of chunks known.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// Nothing known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
