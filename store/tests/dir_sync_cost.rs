//! What the batched directory fsyncs cost a save on a local directory (ignored: a measurement,
//! not a check). Run with
//! `cargo nextest run -p ckpt-store --test dir_sync_cost --run-ignored only --no-capture`
//! (`CKPT_BENCH_MIB` sets the state per save, default 1024; `CKPT_BENCH_DIR` the directory).
//!
//! Each round saves fresh data (nothing deduplicates), then times `DirectFs::sync_dirs` (the
//! batch a conditional create runs first) separately from the rest of the save, so the same
//! run gives the save without the directory fsyncs ("before") and with them ("after").

use std::sync::Arc;
use std::time::Instant;

use ckpt_store::testing::det_bytes;
use ckpt_store::{ChunkIn, DType, DedupIndex, DirectFs, Layout, NdBox, RankManifest, Store};
use ckpt_store::{StoreConfig, TensorShard};
use futures::stream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run it on purpose"]
#[allow(
    clippy::disallowed_methods,
    reason = "a test reads its knobs and tools from the environment"
)]
async fn directory_fsyncs_cost_per_save() {
    let mib: usize = std::env::var("CKPT_BENCH_MIB").map_or(1024, |v| v.parse().unwrap());
    let base = std::env::var("CKPT_BENCH_DIR").map_or_else(|_| std::env::temp_dir(), Into::into);
    let dir = tempfile::tempdir_in(base).unwrap();
    let fs = Arc::new(DirectFs::new(dir.path()).unwrap());
    let store = Store::new(fs.clone(), Default::default(), "bench")
        .with_config(StoreConfig::default())
        .unwrap();
    let len = mib << 20;
    for round in 1..=3u64 {
        let data = bytes::Bytes::from(det_bytes(round, len));
        let t0 = Instant::now();
        let chunks: Vec<ChunkIn> = store
            .chunk_spans(len as u64)
            .map(|r| ChunkIn {
                data: data.slice(r.start as usize..r.end as usize),
                elem: 1,
                base: None,
            })
            .collect();
        let n_chunks = chunks.len();
        let put = store
            .chunks()
            .put_chunks(stream::iter(chunks), &DedupIndex::new())
            .await
            .unwrap();
        let t_put = t0.elapsed().as_secs_f64();
        let syncs0 = fs.dir_syncs();
        let t1 = Instant::now();
        fs.sync_dirs().await.unwrap();
        let t_sync = t1.elapsed().as_secs_f64();
        let syncs = fs.dir_syncs() - syncs0;
        let t2 = Instant::now();
        let m = RankManifest {
            format: ckpt_store::FORMAT_VERSION,
            run: "b".into(),
            step: round,
            rank: 0,
            node: None,
            layout: Layout::SINGLE,
            generation: 0,
            created_ms: 0,
            tensors: vec![TensorShard {
                name: "w".into(),
                dtype: DType::U8,
                shape: vec![len as u64],
                bbox: NdBox::full(&[len as u64]),
                chunks: put.refs,
                replica_of: None,
                placement: None,
                hashed: Vec::new(),
            }],
            blobs: vec![],
            stats: Default::default(),
        };
        store.log().write_rank_manifest(&m).await.unwrap();
        store.log().commit_step("b", round).await.unwrap();
        let t_commit = t2.elapsed().as_secs_f64();
        let before = t_put + t_commit;
        let after = before + t_sync;
        println!(
            "{{\"bench\":\"dir_fsync\",\"round\":{round},\"mib\":{mib},\"chunks\":{n_chunks},\
             \"dir_syncs\":{syncs},\"sync_s\":{t_sync:.4},\"save_without_s\":{before:.3},\
             \"save_with_s\":{after:.3},\"overhead_pct\":{:.2}}}",
            100.0 * t_sync / before
        );
    }
}
