//! [`Chunks`]: the part of a [`Store`](crate::Store) that owns chunks and packs. Its write
//! path ([`Chunks::put_chunks`]) hashes chunks on several threads, skips chunks the
//! [`DedupIndex`] already knows, encodes the rest (codec chosen by
//! measuring), packs the small ones and writes with bounded concurrency and bytes in flight
//! (`put.rs`); its read path ([`Chunks::get_chunk`]) fetches a chunk object (whole, or a range
//! of a pack), decodes it through its delta chain and checks its hash (`fetch.rs`).

use std::sync::Arc;

use crate::cache::ChunkCache;
use crate::store::Objects;
use verdicts::DeltaVerdicts;

mod dedup;
mod fetch;
mod governor;
mod put;
mod verdicts;

pub use dedup::{BaseRegions, DedupIndex};
pub use fetch::StoredChunk;
pub use put::{BaseChunk, ChunkIn, PutReport, PutStats};

/// Chunks and packs of a store: writing, fetching, decoding, verifying. It owns the writer's
/// cache of delta bases it wrote last and the verdicts on regions where deltas did not pay.
#[derive(Debug, Clone)]
pub struct Chunks {
    objects: Objects,
    delta_cache: Arc<ChunkCache>,
    delta_verdicts: Arc<DeltaVerdicts>,
}

impl Chunks {
    pub(crate) fn new(objects: Objects, delta_cache: Arc<ChunkCache>) -> Self {
        Chunks {
            objects,
            delta_cache,
            delta_verdicts: Default::default(),
        }
    }

    /// The same chunk state over changed object settings.
    pub(crate) fn with_objects(self, objects: Objects) -> Self {
        Chunks { objects, ..self }
    }

    /// A new delta-base cache (its size is a setting).
    pub(crate) fn with_delta_cache(self, delta_cache: Arc<ChunkCache>) -> Self {
        Chunks {
            delta_cache,
            ..self
        }
    }

    /// The plain objects below.
    pub fn objects(&self) -> &Objects {
        &self.objects
    }
}
