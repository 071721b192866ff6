//! A bounded cache of decoded, hash-verified chunks, shared by every file of the mount.
//!
//! Chunks are content-addressed, so one cache serves all runs and steps (a chunk shared by
//! two steps is fetched once). Concurrent requests for the same chunk are coalesced: one
//! fetch runs, the others wait for it (a second reader and the read-ahead of the first never
//! fetch the same chunk twice). Eviction is least-recently-used by decoded bytes; a chunk
//! larger than the whole cache is served but not kept. Failures are not cached: the next read
//! of a damaged chunk tries the store again (and fails again, with the same error).
//!
//! Why a cache in the filesystem and not a [`ckpt_store::ChunkSource`]: a source's bytes are
//! re-hashed by the read engine on every hit, and the FUSE kernel module reads 128 KiB at a
//! time, so a 4 MiB chunk would be hashed 32 times per sequential pass. Here a chunk is
//! verified once, by [`Store::get_chunk`], when it enters the cache.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use ckpt_store::{ChunkId, ChunkRef, Error, ErrorKind, Result, Store};
use tokio::sync::OnceCell;

/// What the cache did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Requests served from memory.
    pub hits: u64,
    /// Chunks fetched from the store.
    pub fetches: u64,
    /// Requests that waited for a fetch another request had started.
    pub coalesced: u64,
    /// Fetches that failed.
    pub errors: u64,
    /// Chunks evicted to stay within the capacity.
    pub evictions: u64,
    /// Decoded bytes held now.
    pub bytes: u64,
    /// Chunks held now.
    pub chunks: u64,
    /// The bound on `bytes`.
    pub capacity: u64,
}

type Shared = std::result::Result<Bytes, (ErrorKind, String)>;

#[derive(Default)]
struct Inner {
    map: HashMap<ChunkId, (Bytes, u64)>,
    lru: BTreeMap<u64, ChunkId>,
    tick: u64,
    bytes: u64,
    pending: HashMap<ChunkId, Arc<OnceCell<Shared>>>,
}

impl Inner {
    fn touch(&mut self, id: &ChunkId) -> Option<Bytes> {
        self.tick += 1;
        let tick = self.tick;
        let (b, t) = self.map.get_mut(id)?;
        self.lru.remove(t);
        *t = tick;
        self.lru.insert(tick, *id);
        Some(b.clone())
    }
}

/// The chunk cache (see the module docs).
pub struct ChunkCache {
    capacity: u64,
    inner: Mutex<Inner>,
    hits: AtomicU64,
    fetches: AtomicU64,
    coalesced: AtomicU64,
    errors: AtomicU64,
    evictions: AtomicU64,
}

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChunkCache({:?})", self.stats())
    }
}

impl ChunkCache {
    /// A cache holding at most `capacity` decoded bytes (0 turns caching off; coalescing of
    /// concurrent fetches stays on).
    pub fn new(capacity: u64) -> Self {
        ChunkCache {
            capacity,
            inner: Mutex::default(),
            hits: AtomicU64::new(0),
            fetches: AtomicU64::new(0),
            coalesced: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// The bound on decoded bytes held.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Whether the chunk is held now (no fetch, no recency update).
    pub fn contains(&self, id: &ChunkId) -> bool {
        self.inner.lock().expect("chunk cache").map.contains_key(id)
    }

    /// The decoded bytes of `r`: from memory, from a fetch in flight, or fetched (and verified)
    /// from `store` now.
    pub async fn get(&self, store: &Store, r: &ChunkRef) -> Result<Bytes> {
        let cell = {
            let mut g = self.inner.lock().expect("chunk cache");
            if let Some(b) = g.touch(&r.id) {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(b);
            }
            match g.pending.get(&r.id) {
                Some(c) => {
                    self.coalesced.fetch_add(1, Ordering::Relaxed);
                    c.clone()
                }
                None => {
                    let c = Arc::new(OnceCell::new());
                    g.pending.insert(r.id, c.clone());
                    c
                }
            }
        };
        let res = cell
            .get_or_init(|| async {
                self.fetches.fetch_add(1, Ordering::Relaxed);
                store.get_chunk(r).await.map_err(|e| {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    (e.kind(), e.to_string())
                })
            })
            .await
            .clone();
        {
            let mut g = self.inner.lock().expect("chunk cache");
            if g.pending.get(&r.id).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                g.pending.remove(&r.id);
                if let Ok(b) = &res {
                    self.insert(&mut g, r.id, b.clone());
                }
            }
        }
        res.map_err(|(kind, msg)| Error::new(kind, msg))
    }

    fn insert(&self, g: &mut Inner, id: ChunkId, b: Bytes) {
        let len = b.len() as u64;
        if len > self.capacity || g.map.contains_key(&id) {
            return;
        }
        while g.bytes + len > self.capacity {
            let Some((_, old)) = g.lru.pop_first() else {
                break;
            };
            if let Some((ob, _)) = g.map.remove(&old) {
                g.bytes -= ob.len() as u64;
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        g.tick += 1;
        let tick = g.tick;
        g.lru.insert(tick, id);
        g.map.insert(id, (b, tick));
        g.bytes += len;
    }

    /// Figures so far.
    pub fn stats(&self) -> CacheStats {
        let g = self.inner.lock().expect("chunk cache");
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            fetches: self.fetches.load(Ordering::Relaxed),
            coalesced: self.coalesced.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            bytes: g.bytes,
            chunks: g.map.len() as u64,
            capacity: self.capacity,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_store::testing::{det_bytes, memory_store, tiny_config};
    use ckpt_store::{ChunkIn, DedupIndex};
    use futures::stream;

    async fn put(store: &Store, n: usize) -> Vec<ChunkRef> {
        let data = det_bytes(7, n * 4096);
        let chunks: Vec<ChunkIn> = store
            .chunk_spans(data.len() as u64)
            .map(|r| ChunkIn {
                data: Bytes::copy_from_slice(&data[r.start as usize..r.end as usize]),
                elem: 1,
            })
            .collect();
        store
            .put_chunks(stream::iter(chunks), &DedupIndex::new())
            .await
            .unwrap()
            .refs
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bounded_lru_and_coalesced() {
        let store = memory_store(tiny_config());
        let refs = put(&store, 6).await;
        let cache = ChunkCache::new(3 * 4096);
        for r in &refs[..3] {
            cache.get(&store, r).await.unwrap();
        }
        // Touch the first so the second is the least recently used.
        cache.get(&store, &refs[0]).await.unwrap();
        cache.get(&store, &refs[3]).await.unwrap();
        assert!(cache.contains(&refs[0].id) && !cache.contains(&refs[1].id));
        let s = cache.stats();
        assert_eq!((s.hits, s.fetches, s.evictions), (1, 4, 1));
        assert_eq!(s.bytes, 3 * 4096);
        // Many concurrent readers of one chunk: one fetch.
        let before = cache.stats().fetches;
        let got = futures::future::join_all((0..8).map(|_| cache.get(&store, &refs[5]))).await;
        assert!(
            got.iter()
                .all(|g| g.as_ref().unwrap()[..] == det_bytes(7, 6 * 4096)[5 * 4096..])
        );
        assert_eq!(cache.stats().fetches, before + 1);
        // A chunk larger than the cache is served, not kept.
        let tiny = ChunkCache::new(100);
        assert_eq!(tiny.get(&store, &refs[0]).await.unwrap().len(), 4096);
        assert_eq!(tiny.stats().bytes, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failures_are_not_cached() {
        let store = memory_store(tiny_config());
        let refs = put(&store, 1).await;
        let key = store.object_of(&refs[0]);
        let good = store.get_object(&key).await.unwrap();
        let mut bad = good.to_vec();
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        use ckpt_store::ObjectStoreExt;
        store
            .object_store()
            .put(&key, Bytes::from(bad).into())
            .await
            .unwrap();
        let cache = ChunkCache::new(1 << 20);
        let e = cache.get(&store, &refs[0]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert!(e.to_string().contains(&refs[0].id.short()), "{e}");
        store
            .object_store()
            .put(&key, good.clone().into())
            .await
            .unwrap();
        assert_eq!(cache.get(&store, &refs[0]).await.unwrap().len(), 4096);
        assert_eq!(cache.stats().errors, 1);
    }
}
