//! The chunk cache over a real store: LRU by decoded bytes, concurrent readers coalesced,
//! failures not cached.

use bytes::Bytes;
use ckpt_store::testing::{det_bytes, memory_store, tiny_config};
use ckpt_store::{ChunkCache, ChunkRef, ErrorKind, Store};
use ckpt_store::{ChunkIn, DedupIndex};
use futures::stream;

async fn put(store: &Store, n: usize) -> Vec<ChunkRef> {
    let data = det_bytes(7, n * 4096);
    let chunks: Vec<ChunkIn> = store
        .chunk_spans(data.len() as u64)
        .map(|r| ChunkIn {
            data: Bytes::copy_from_slice(&data[r.start as usize..r.end as usize]),
            elem: 1,
            base: None,
        })
        .collect();
    store
        .chunks()
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
    let key = store.keys().object_of(&refs[0]);
    let good = store.objects().get_object(&key).await.unwrap();
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
