//! A bounded cache of decoded, hash-verified chunks, with concurrent requests for one chunk
//! merged into one fetch: the one cache of the workspace (restores of several ranks in one
//! process share it through [`StepReader::with_cache`](crate::StepReader::with_cache); the FUSE
//! mount serves every file from one).
//!
//! Chunks are content-addressed, so one cache serves all runs and steps (a chunk shared by
//! two steps is fetched once). When several ranks of one process restore onto a new layout,
//! their boxes often cut the same chunks (a tensor-parallel split along columns needs part of
//! every row, so every chunk of the old shard); each is read from the store once. Eviction is
//! least-recently-used by decoded bytes; a chunk larger than the whole cache is served but not
//! kept (capacity 0 turns caching off; merging concurrent fetches stays on). Failures are not
//! cached: the next read of a damaged chunk tries the store again.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::OnceCell;

use crate::error::{Error, ErrorKind, Result};
use crate::id::ChunkId;
use crate::model::ChunkRef;
use crate::store::Store;

/// What the cache did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Requests served from memory.
    pub hits: u64,
    /// Chunks fetched.
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

/// One fetch in flight: its result, shared by every caller that asked meanwhile.
type Fetch = OnceCell<std::result::Result<Bytes, (ErrorKind, String)>>;

#[derive(Default)]
struct State {
    map: HashMap<ChunkId, (Bytes, u64)>,
    lru: BTreeMap<u64, ChunkId>,
    tick: u64,
    bytes: u64,
    inflight: HashMap<ChunkId, Arc<Fetch>>,
}

impl State {
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

/// The cache (see the module docs).
pub struct ChunkCache {
    cap: u64,
    state: Mutex<State>,
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
    /// A cache holding at most `cap` decoded bytes of chunks.
    pub fn new(cap: u64) -> Arc<Self> {
        Arc::new(ChunkCache {
            cap,
            state: Mutex::new(State::default()),
            hits: AtomicU64::new(0),
            fetches: AtomicU64::new(0),
            coalesced: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        })
    }

    /// The bound on decoded bytes held.
    pub fn capacity(&self) -> u64 {
        self.cap
    }

    /// Whether the chunk is held now (no fetch, no recency update).
    pub fn contains(&self, id: &ChunkId) -> bool {
        self.state.lock().map.contains_key(id)
    }

    /// (hits, misses) so far: a miss is a request that waited for a fetch, its own or one
    /// already in flight.
    pub fn counts(&self) -> (u64, u64) {
        let s = self.stats();
        (s.hits, s.fetches + s.coalesced)
    }

    /// Figures so far.
    pub fn stats(&self) -> CacheStats {
        let st = self.state.lock();
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            fetches: self.fetches.load(Ordering::Relaxed),
            coalesced: self.coalesced.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            bytes: st.bytes,
            chunks: st.map.len() as u64,
            capacity: self.cap,
        }
    }

    /// The decoded bytes of `r`: from memory, from a fetch in flight, or fetched (and
    /// verified) from `store` now.
    pub async fn get(&self, store: &Store, r: &ChunkRef) -> Result<Bytes> {
        self.get_or_fetch(r.id, || store.chunks().get_chunk(r))
            .await
    }

    /// The chunk `id`, from the cache or from `fetch` (which must return verified bytes);
    /// concurrent callers for the same chunk share one fetch.
    pub async fn get_or_fetch<F, Fut>(&self, id: ChunkId, fetch: F) -> Result<Bytes>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Bytes>>,
    {
        let cell = {
            let mut st = self.state.lock();
            if let Some(b) = st.touch(&id) {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(b);
            }
            match st.inflight.get(&id) {
                Some(c) => {
                    self.coalesced.fetch_add(1, Ordering::Relaxed);
                    c.clone()
                }
                None => {
                    let c = Arc::new(OnceCell::new());
                    st.inflight.insert(id, c.clone());
                    c
                }
            }
        };
        let res = cell
            .get_or_init(|| async {
                self.fetches.fetch_add(1, Ordering::Relaxed);
                fetch().await.map_err(|e| {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    (e.kind(), e.to_string())
                })
            })
            .await
            .clone();
        {
            let mut st = self.state.lock();
            // Only the fetch this call waited for is retired: a later one for the same id
            // (after a failure) is left alone.
            if st.inflight.get(&id).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                st.inflight.remove(&id);
                if let Ok(b) = &res {
                    self.insert(&mut st, id, b.clone());
                }
            }
        }
        res.map_err(|(kind, msg)| Error::new(kind, msg))
    }

    /// Keep `b` as the verified bytes of `id` (a writer that just hashed them: the delta
    /// bases of its next save).
    pub fn put(&self, id: ChunkId, b: Bytes) {
        let mut st = self.state.lock();
        self.insert(&mut st, id, b);
    }

    fn insert(&self, st: &mut State, id: ChunkId, b: Bytes) {
        let len = b.len() as u64;
        if len > self.cap || st.map.contains_key(&id) {
            return;
        }
        while st.bytes + len > self.cap {
            let Some((_, old)) = st.lru.pop_first() else {
                break;
            };
            if let Some((ob, _)) = st.map.remove(&old) {
                st.bytes -= ob.len() as u64;
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        st.tick += 1;
        let tick = st.tick;
        st.lru.insert(tick, id);
        st.map.insert(id, (b, tick));
        st.bytes += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_requests_share_one_fetch_and_the_bound_holds() {
        let c = ChunkCache::new(250);
        let fetches = Arc::new(AtomicU32::new(0));
        let id = ChunkId::of(b"a");
        let mut hs = Vec::new();
        for _ in 0..8 {
            let (c, f) = (c.clone(), fetches.clone());
            hs.push(tokio::spawn(async move {
                c.get_or_fetch(id, || async move {
                    f.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    Ok(Bytes::from(vec![1u8; 100]))
                })
                .await
                .unwrap()
            }));
        }
        for h in hs {
            assert_eq!(h.await.unwrap().len(), 100);
        }
        assert_eq!(fetches.load(Ordering::SeqCst), 1);
        // Two more 100-byte chunks: the least recently used one is evicted.
        for k in [b"b", b"c"] {
            c.get_or_fetch(ChunkId::of(k), || async { Ok(Bytes::from(vec![2u8; 100])) })
                .await
                .unwrap();
        }
        assert!(c.stats().bytes <= 250);
        assert!(!c.contains(&id));
        // Errors are not cached.
        let e = c
            .get_or_fetch(ChunkId::of(b"d"), || async { Err(Error::corrupt("bad")) })
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        let ok = c
            .get_or_fetch(ChunkId::of(b"d"), || async { Ok(Bytes::from_static(b"x")) })
            .await
            .unwrap();
        assert_eq!(&ok[..], b"x");
    }
}
