//! [`Store`]: chunks in, chunks out, over any [`ObjectStore`].
//!
//! The handle holds the object store, the key layout and the settings; each concern of it
//! lives in a file of its own:
//!
//! | file | owns |
//! |---|---|
//! | `config.rs` | [`StoreConfig`]: the settings and their checks |
//! | `objects.rs` | plain objects: writes (multipart), reads, JSON documents, listings |
//! | `put.rs` | the write path, [`Store::put_chunks`] in named steps; [`ChunkIn`], [`PutReport`] |
//! | `dedup.rs` | [`DedupIndex`]: chunks the store is known to hold; [`BaseRegions`] |
//! | `governor.rs` | whether compressing pays, from what the current write measured |
//! | `verdicts.rs` | which regions rest from delta tries after a delta that did not pay |
//! | `fetch.rs` | reading chunks back: object keys of a reference, fetch, decode, verify |
//!
//! The write path ([`Store::put_chunks`]) hashes chunks on several threads, skips chunks the
//! [`DedupIndex`] already knows, encodes the rest (codec chosen by measuring), packs the small
//! ones, and writes with bounded concurrency and a bounded number of bytes in flight. The read
//! path ([`Store::get_chunk`]) fetches chunk objects (whole, or a range of a pack), decodes
//! them and checks their hash.

use std::sync::Arc;

use object_store::ObjectStore;
use object_store::path::Path;

use crate::error::{Error, Result};
use crate::keys::Keys;

mod config;
mod dedup;
mod fetch;
mod governor;
mod objects;
mod put;
mod verdicts;

pub use config::StoreConfig;
pub use dedup::{BaseRegions, DedupIndex};
pub use put::{BaseChunk, ChunkIn, PutReport, PutStats};
use verdicts::DeltaVerdicts;

/// A content-addressed checkpoint store over an [`ObjectStore`].
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    keys: Keys,
    cfg: Arc<StoreConfig>,
    url: Arc<str>,
    failpoints: crate::failpoint::Failpoints,
    metrics: Option<Arc<crate::wrap::StoreMetrics>>,
    local_root: Option<Arc<std::path::Path>>,
    clock: Arc<dyn crate::clock::Clock>,
    delta_cache: Arc<crate::cache::ChunkCache>,
    delta_verdicts: Arc<DeltaVerdicts>,
}

impl Store {
    /// A store over `inner`, with keys below `prefix`. `url` names it in messages.
    pub fn new(inner: Arc<dyn ObjectStore>, prefix: Path, url: impl Into<String>) -> Self {
        Store {
            inner,
            keys: Keys::new(prefix),
            cfg: Arc::new(StoreConfig::default()),
            url: url.into().into(),
            failpoints: Default::default(),
            metrics: None,
            local_root: None,
            clock: Arc::new(crate::clock::SystemClock),
            delta_cache: crate::cache::ChunkCache::new(0),
            delta_verdicts: Default::default(),
        }
    }

    /// Use `clock` for every wall-clock decision (lock lapses, record timestamps); the
    /// system's clock by default.
    pub fn with_clock(mut self, clock: Arc<dyn crate::clock::Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Now, by this store's clock.
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.clock.now()
    }

    /// Say that the store is a local directory (a [`crate::DirectFs`] at `root`, no prefix),
    /// so that GC and verify also look for temporary files interrupted writes left there.
    pub fn with_local_root(mut self, root: impl Into<std::path::PathBuf>) -> Self {
        self.local_root = Some(Arc::from(root.into()));
        self
    }

    /// The directory of a local store opened with [`Store::with_local_root`].
    pub fn local_root(&self) -> Option<&std::path::Path> {
        self.local_root.as_deref()
    }

    /// Temporary files that interrupted writes left in a local store (none elsewhere: object
    /// stores publish an object whole or not at all).
    pub async fn temp_files(&self) -> Result<Vec<crate::direct::TempFile>> {
        let Some(root) = self.local_root.clone() else {
            return Ok(Vec::new());
        };
        tokio::task::spawn_blocking(move || {
            crate::direct::temp_files(&root)
                .map_err(|e| Error::io("looking for temporary files in", &root.display(), e))
        })
        .await
        .map_err(|e| Error::internal(format!("listing temporary files: {e}")))?
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
    pub fn with_config(mut self, cfg: StoreConfig) -> Result<Self> {
        cfg.validate()?;
        self.delta_cache = crate::cache::ChunkCache::new(cfg.delta_cache_bytes);
        self.cfg = Arc::new(cfg);
        Ok(self)
    }

    /// Arm failpoints on this store (and its clones).
    pub fn with_failpoints(mut self, fp: crate::failpoint::Failpoints) -> Self {
        self.failpoints = fp;
        self
    }

    /// Attach the counters of the [`crate::wrap::MetricsStore`] this store runs over.
    pub fn with_metrics(mut self, m: Arc<crate::wrap::StoreMetrics>) -> Self {
        self.metrics = Some(m);
        self
    }

    /// Request and byte counters, if the store was opened with them ([`crate::open`] does).
    pub fn metrics(&self) -> Option<&Arc<crate::wrap::StoreMetrics>> {
        self.metrics.as_ref()
    }

    /// The failpoints of this store.
    pub fn failpoints(&self) -> &crate::failpoint::Failpoints {
        &self.failpoints
    }

    /// The settings.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// The key layout.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The underlying object store.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// The URL the store was opened from.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Byte ranges of the chunks of a buffer of `len` bytes ([`StoreConfig::chunk_spans`]).
    pub fn chunk_spans(&self, len: u64) -> impl Iterator<Item = std::ops::Range<u64>> + use<> {
        self.cfg.chunk_spans(len)
    }
}
