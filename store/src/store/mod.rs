//! [`Store`]: the handle over a content-addressed checkpoint store, and the parts it owns.
//!
//! `Store` holds four parts, each a type with its own `impl` in its own module; a caller
//! reaches a part through the handle (`store.log().commit_step(..)`):
//!
//! | part | module | owns |
//! |---|---|---|
//! | [`Objects`] | `store/objects.rs` (here) | the object store, key layout, settings, clock; plain objects: writes (multipart), reads, JSON documents, listings, deletes |
//! | [`Chunks`] | `chunks/` (`put.rs`, `fetch.rs`, `dedup.rs`, `governor.rs`, `verdicts.rs`) | chunks and packs: the write path ([`Chunks::put_chunks`]), fetch, decode and verify, the dedup index, the codec governor, the delta cache and verdicts |
//! | [`CommitLog`] | `commit/` | rank manifests, commit records, generations and fences, listings of runs and steps, drain markers |
//! | [`Gc`] | `gc/` (`mod.rs`, `lease.rs`) | writer leases, sweep locks, retention and the sweep |
//!
//! The read engine is [`crate::read::StepReader`]; writing a rank (chunks, then its manifest,
//! `writer.rs`) and verifying a store (`verify.rs`) are the two operations of the handle itself,
//! because each uses several parts.
//!
//! Also here: `config.rs` ([`StoreConfig`]: the settings and their checks).

use std::sync::Arc;

use object_store::ObjectStore;
use object_store::path::Path;

use crate::commit::CommitLog;
use crate::error::Result;
use crate::gc::Gc;
use crate::keys::Keys;

mod config;
mod objects;

pub use crate::chunks::{
    BaseChunk, BaseRegions, ChunkIn, Chunks, DedupIndex, PutReport, PutStats, StoredChunk,
};
pub use config::StoreConfig;
pub use objects::Objects;

/// A content-addressed checkpoint store over an [`ObjectStore`]: a handle over its parts.
#[derive(Debug, Clone)]
pub struct Store {
    objects: Objects,
    chunks: Chunks,
    log: CommitLog,
    gc: Gc,
}

impl Store {
    /// A store over `inner`, with keys below `prefix`. `url` names it in messages.
    pub fn new(inner: Arc<dyn ObjectStore>, prefix: Path, url: impl Into<String>) -> Self {
        let objects = Objects::new(inner, Keys::new(prefix), url.into());
        let chunks = Chunks::new(objects.clone(), crate::cache::ChunkCache::new(0));
        Self::assemble(objects, chunks)
    }

    /// The handle over `objects` and `chunks`, with the parts that hold no state of their own.
    fn assemble(objects: Objects, chunks: Chunks) -> Self {
        let log = CommitLog::new(objects.clone());
        let gc = Gc::new(objects.clone(), log.clone());
        Store {
            objects,
            chunks,
            log,
            gc,
        }
    }

    /// The parts again after the objects' settings changed (construction only); the chunks
    /// keep their state.
    fn with_objects(self, objects: Objects) -> Self {
        let chunks = self.chunks.with_objects(objects.clone());
        Self::assemble(objects, chunks)
    }

    /// Plain objects: reads, writes, listings, deletes.
    pub fn objects(&self) -> &Objects {
        &self.objects
    }

    /// Chunks and packs: write, fetch, verify.
    pub fn chunks(&self) -> &Chunks {
        &self.chunks
    }

    /// Rank manifests, commit records, generations, listings of runs and steps.
    pub fn log(&self) -> &CommitLog {
        &self.log
    }

    /// Writer leases, sweep locks, retention and the sweep.
    pub fn gc(&self) -> &Gc {
        &self.gc
    }

    /// Use `clock` for every wall-clock decision (lock lapses, record timestamps); the
    /// system's clock by default.
    pub fn with_clock(self, clock: Arc<dyn crate::clock::Clock>) -> Self {
        let objects = Objects {
            clock,
            ..self.objects.clone()
        };
        self.with_objects(objects)
    }

    /// Now, by this store's clock.
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.objects.now()
    }

    /// Say that the store is a local directory (a [`crate::DirectFs`] at `root`, no prefix),
    /// so that GC and verify also look for temporary files interrupted writes left there.
    pub fn with_local_root(self, root: impl Into<std::path::PathBuf>) -> Self {
        let objects = Objects {
            local_root: Some(Arc::from(root.into())),
            ..self.objects.clone()
        };
        self.with_objects(objects)
    }

    /// The directory of a local store opened with [`Store::with_local_root`].
    pub fn local_root(&self) -> Option<&std::path::Path> {
        self.objects.local_root.as_deref()
    }

    /// An in-memory store (unit tests).
    pub fn memory() -> Self {
        Store::new(
            Arc::new(object_store::memory::InMemory::new()),
            Path::default(),
            "memory://",
        )
    }

    /// Replace the settings.
    pub fn with_config(self, cfg: StoreConfig) -> Result<Self> {
        cfg.validate()?;
        let cache = crate::cache::ChunkCache::new(cfg.delta_cache_bytes);
        let objects = Objects {
            cfg: Arc::new(cfg),
            ..self.objects.clone()
        };
        let mut store = self.with_objects(objects);
        store.chunks = store.chunks.with_delta_cache(cache);
        Ok(store)
    }

    /// Arm failpoints on this store (and its clones).
    pub fn with_failpoints(self, fp: crate::failpoint::Failpoints) -> Self {
        let objects = Objects {
            failpoints: fp,
            ..self.objects.clone()
        };
        self.with_objects(objects)
    }

    /// Attach the counters of the [`crate::wrap::MetricsStore`] this store runs over.
    pub fn with_metrics(self, m: Arc<crate::wrap::StoreMetrics>) -> Self {
        let objects = Objects {
            metrics: Some(m),
            ..self.objects.clone()
        };
        self.with_objects(objects)
    }

    /// Request and byte counters, if the store was opened with them ([`crate::open`] does).
    pub fn metrics(&self) -> Option<&Arc<crate::wrap::StoreMetrics>> {
        self.objects.metrics.as_ref()
    }

    /// The failpoints of this store.
    pub fn failpoints(&self) -> &crate::failpoint::Failpoints {
        &self.objects.failpoints
    }

    /// The settings.
    pub fn config(&self) -> &StoreConfig {
        &self.objects.cfg
    }

    /// The key layout.
    pub fn keys(&self) -> &Keys {
        &self.objects.keys
    }

    /// The underlying object store.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.objects.inner
    }

    /// The URL the store was opened from.
    pub fn url(&self) -> &str {
        &self.objects.url
    }

    /// Byte ranges of the chunks of a buffer of `len` bytes ([`StoreConfig::chunk_spans`]).
    pub fn chunk_spans(&self, len: u64) -> impl Iterator<Item = std::ops::Range<u64>> + use<> {
        self.objects.cfg.chunk_spans(len)
    }
}
