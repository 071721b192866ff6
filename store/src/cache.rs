//! A bounded cache of decoded, verified chunks shared by readers, with concurrent requests for
//! one chunk merged into one fetch.
//!
//! When several ranks of one process restore onto a new layout, their boxes often cut the
//! same chunks (a tensor-parallel split along columns needs part of every row, so every chunk
//! of the old shard); with a shared cache each chunk is read from the store once.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::OnceCell;

use crate::error::{Error, ErrorKind, Result};
use crate::id::ChunkId;

/// One fetch in flight: its result, shared by every caller that asked meanwhile.
type Fetch = OnceCell<std::result::Result<Bytes, (ErrorKind, String)>>;

#[derive(Default)]
struct State {
    map: HashMap<ChunkId, (Bytes, u64)>,
    lru: BTreeMap<u64, ChunkId>,
    tick: u64,
    bytes: usize,
    inflight: HashMap<ChunkId, Arc<Fetch>>,
    hits: u64,
    misses: u64,
}

/// The cache (see the module docs).
pub struct ChunkCache {
    cap: usize,
    state: Mutex<State>,
}

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.state.lock().expect("cache");
        write!(f, "ChunkCache({} of {} bytes)", st.bytes, self.cap)
    }
}

impl ChunkCache {
    /// A cache holding at most `cap` bytes of chunks.
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(ChunkCache {
            cap,
            state: Mutex::new(State::default()),
        })
    }

    /// (hits, misses) so far.
    pub fn counts(&self) -> (u64, u64) {
        let st = self.state.lock().expect("cache");
        (st.hits, st.misses)
    }

    /// The chunk `id`, from the cache or from `fetch` (which must return verified bytes);
    /// concurrent callers for the same chunk share one fetch.
    pub async fn get_or_fetch<F, Fut>(&self, id: ChunkId, fetch: F) -> Result<Bytes>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Bytes>>,
    {
        let cell = {
            let mut st = self.state.lock().expect("cache");
            st.tick += 1;
            let tick = st.tick;
            if let Some((b, old)) = st.map.get_mut(&id) {
                let b = b.clone();
                let old = std::mem::replace(old, tick);
                st.lru.remove(&old);
                st.lru.insert(tick, id);
                st.hits += 1;
                return Ok(b);
            }
            st.misses += 1;
            st.inflight.entry(id).or_default().clone()
        };
        let res = cell
            .get_or_init(|| async { fetch().await.map_err(|e| (e.kind(), e.to_string())) })
            .await
            .clone();
        let mut st = self.state.lock().expect("cache");
        st.inflight.remove(&id);
        match res {
            Ok(b) => {
                if b.len() <= self.cap && !st.map.contains_key(&id) {
                    st.tick += 1;
                    let tick = st.tick;
                    st.bytes += b.len();
                    st.map.insert(id, (b.clone(), tick));
                    st.lru.insert(tick, id);
                    while st.bytes > self.cap {
                        let Some((_, victim)) = st.lru.pop_first() else {
                            break;
                        };
                        if let Some((v, _)) = st.map.remove(&victim) {
                            st.bytes -= v.len();
                        }
                    }
                }
                Ok(b)
            }
            Err((kind, msg)) => Err(Error::new(kind, msg)),
        }
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
        {
            let st = c.state.lock().unwrap();
            assert!(st.bytes <= 250);
            assert!(!st.map.contains_key(&id));
        }
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
