//! How many chunks one call of `StepReader::execute` keeps in flight: on a local disk no more
//! than the cores check as they land, plus two (a call's chunks land together at its end);
//! on a remote store the store's `read_concurrency`, which its latency needs. Both read the
//! same bytes. Each store is counted ([`CountingStore`], every get held 20 ms), so the most
//! gets one call had in flight at once is what the test sees.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ckpt_store::counting::{Counting, CountingStore, SimConfig};
use ckpt_store::object_store::memory::InMemory;
use ckpt_store::object_store::path::Path;
use ckpt_store::testing::{det_bytes, local_store, tiny_config};
use ckpt_store::writer::{RankWrite, ShardDesc, ShardIn};
use ckpt_store::{
    DType, DedupIndex, DirectFs, Layout, NdBox, ObjectStore, StepReader, Store, StoreConfig,
};

fn config() -> StoreConfig {
    StoreConfig {
        read_concurrency: 8,
        cpu_threads: 2,
        ..tiny_config()
    }
}

/// Step 1 of one rank: a tensor `w` of 64 KiB (16 chunks), committed; its bytes.
async fn save(store: &Store) -> Vec<u8> {
    let w = det_bytes(5, 64 << 10);
    let shape = vec![w.len() as u64];
    let wr = RankWrite::new("r", 1, 0, Layout::new(1, 1, 1, 0).unwrap());
    let shard = ShardIn {
        shard: ShardDesc::boxed("w", DType::U8, shape.clone(), NdBox::full(&shape)),
        data: Some(Bytes::from(w.clone())),
    };
    store.log().join_generation("r", 0).await.unwrap();
    store
        .write_rank(&wr, vec![shard], vec![], &DedupIndex::new())
        .await
        .unwrap();
    store.log().commit_step_as("r", 1, Some(0)).await.unwrap();
    w
}

/// `inner` counted, every request held 20 ms, under `config()`.
fn counted(inner: impl ObjectStore, url: &str) -> (Store, Arc<Counting>) {
    let sim = SimConfig {
        latency: Duration::from_millis(20),
        limits: None,
        list_page: 1000,
    };
    let c = CountingStore::new(inner, sim);
    let counting = c.counting();
    let store = Store::new(Arc::new(c), Path::default(), url)
        .with_config(config())
        .unwrap();
    (store, counting)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_stores_calls_keep_cores_plus_two_in_flight_a_remote_ones_its_concurrency() {
    let dir = tempfile::tempdir().unwrap();
    let (local, local_gets) = counted(DirectFs::new(dir.path()).unwrap(), "local");
    let local = local.with_local_root(dir.path());
    let (remote, remote_gets) = counted(InMemory::new(), "memory://");
    for (store, gets, want) in [(&local, &local_gets, 4), (&remote, &remote_gets, 8)] {
        let w = save(store).await;
        let r = StepReader::open(store, "r", 1).await.unwrap();
        assert_eq!(r.call_concurrency(), want, "{}", store.url());
        let mut got = vec![0u8; w.len()];
        gets.take_most_gets_in_flight();
        let st = r
            .read_into("w", &NdBox::full(&[w.len() as u64]), &mut got)
            .await
            .unwrap();
        // 16 chunks, each a get of 20 ms: the call starts as many as it may at once.
        let most = gets.take_most_gets_in_flight();
        assert_eq!(most, want, "{}: gets in flight at once", store.url());
        assert!(got == w, "{}: wrong bytes", store.url());
        assert_eq!(st.chunks, 16, "{st:?}");
    }
    // Never more than the store's own concurrency, and never none.
    let (few, _d) = local_store(StoreConfig {
        read_concurrency: 1,
        cpu_threads: 64,
        ..tiny_config()
    });
    save(&few).await;
    let r = StepReader::open(&few, "r", 1).await.unwrap();
    assert_eq!(r.call_concurrency(), 1);
}
