//! Temporary files a crash leaves in a local store (`<key>#<n>`, never listed by the object
//! store): `verify` of the whole store reports them, `gc` deletes those older than the grace
//! period and keeps younger ones (a write in progress), and committed steps stay intact.

use std::time::{Duration, SystemTime};

use ckpt_store::testing::{det_bytes, local_store, tiny_config};
use ckpt_store::{
    ChunkIn, DType, DedupIndex, GcOptions, Layout, NdBox, RankManifest, StepReader, TensorShard,
    VerifyScope,
};
use futures::stream;

async fn save_one_step(store: &ckpt_store::Store) -> Vec<u8> {
    let data = det_bytes(7, 64 << 10);
    let index = DedupIndex::new();
    let chunks: Vec<ChunkIn> = store
        .chunk_spans(data.len() as u64)
        .map(|r| ChunkIn {
            data: bytes::Bytes::copy_from_slice(&data[r.start as usize..r.end as usize]),
            elem: 4,
            base: None,
        })
        .collect();
    let put = store
        .chunks()
        .put_chunks(stream::iter(chunks), &index)
        .await
        .unwrap();
    let m = RankManifest {
        format: ckpt_store::FORMAT_VERSION,
        run: "r".into(),
        step: 1,
        rank: 0,
        node: None,
        layout: Layout::SINGLE,
        generation: 0,
        created_ms: 0,
        tensors: vec![TensorShard {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![128, 128],
            bbox: NdBox::full(&[128, 128]),
            chunks: put.refs,
            replica_of: None,
            placement: None,
            hashed: Vec::new(),
        }],
        blobs: vec![],
        stats: Default::default(),
    };
    store.log().write_rank_manifest(&m).await.unwrap();
    store.log().commit_step("r", 1).await.unwrap();
    data
}

fn plant(path: &std::path::Path, len: usize, age: Duration) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let f = std::fs::File::create(path).unwrap();
    f.set_len(len as u64).unwrap();
    f.set_modified(SystemTime::from(ckpt_store::clock::system_now()) - age)
        .unwrap();
}

#[tokio::test]
async fn temp_files_are_reported_by_verify_and_collected_by_gc_after_the_grace_period() {
    let (store, dir) = local_store(tiny_config());
    let data = save_one_step(&store).await;
    let root = dir.path();
    let hour = Duration::from_secs(3600);
    let old_chunk = root.join("chunks/ab/".to_string() + &"ab".repeat(32) + "#1");
    let old_commit = root.join("runs/r/steps/00000000000000000002/COMMIT#4");
    let young = root.join("packs/cd/".to_string() + &"cd".repeat(32) + "#2");
    plant(&old_chunk, 5000, 2 * hour);
    plant(&old_commit, 300, 3 * hour);
    plant(&young, 700, Duration::from_secs(60));

    // verify of the whole store names all three, and they are not damage.
    let v = store.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(v.is_clean(), "{:?}", v.damaged);
    let mut files: Vec<(String, u64)> = v
        .temp_files
        .iter()
        .map(|t| (t.file.clone(), t.bytes))
        .collect();
    files.sort();
    assert_eq!(
        files,
        vec![
            (format!("chunks/ab/{}#1", "ab".repeat(32)), 5000),
            (format!("packs/cd/{}#2", "cd".repeat(32)), 700),
            (
                "runs/r/steps/00000000000000000002/COMMIT#4".to_string(),
                300
            ),
        ]
    );

    // A dry run deletes nothing; a real gc deletes the two old ones, keeps the young one.
    let now = ckpt_store::clock::system_now();
    let dry = GcOptions {
        dry_run: true,
        ..GcOptions::default()
    };
    let r = store.gc().run(&dry, now).await.unwrap();
    assert_eq!((r.temp_files_deleted, r.temp_files_in_grace), (2, 1));
    assert!(old_chunk.exists() && old_commit.exists());
    let r = store.gc().run(&GcOptions::default(), now).await.unwrap();
    assert_eq!(r.temp_files_deleted, 2);
    assert_eq!(r.temp_bytes_freed, 5300);
    assert_eq!(r.temp_files_in_grace, 1);
    assert!(!old_chunk.exists() && !old_commit.exists());
    assert!(young.exists());

    // The committed step is intact and restores.
    let v = store.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(v.is_clean());
    assert_eq!(v.temp_files.len(), 1);
    let reader = StepReader::open_latest(&store, "r").await.unwrap();
    let got = reader.read("w", &NdBox::full(&[128, 128])).await.unwrap();
    assert!(got == data);
}

/// A step verify does not walk the store for temporary files; a memory store has none.
#[tokio::test]
async fn only_a_whole_store_verify_of_a_local_store_lists_temp_files() {
    let (store, dir) = local_store(tiny_config());
    save_one_step(&store).await;
    plant(
        &dir.path().join("chunks/ab/x#1"),
        10,
        Duration::from_secs(7200),
    );
    let v = store
        .verify(&VerifyScope::Step("r".into(), 1), None)
        .await
        .unwrap();
    assert!(v.temp_files.is_empty());
    let mem = ckpt_store::testing::memory_store(tiny_config());
    save_one_step(&mem).await;
    let v = mem.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(v.temp_files.is_empty());
}
