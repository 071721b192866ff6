//! One conformance suite, every backend: each case below runs on the in-memory store, a local
//! directory and a real S3-compatible server (`s3s-fs`) on loopback, with the same code.

use ckpt_store::model::cut_box as cut;
use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;
use ckpt_store::testing::{
    ClockStore, Need, S3Server, TestClock, det_bytes, local_store, memory_store, tiny_config,
};
use ckpt_store::writer::{BlobIn, RankWrite, ShardDesc, ShardIn};
use ckpt_store::{
    ChunkRef, CommitOutcome, DType, DedupBase, DedupIndex, ErrorKind, FailAction, GcOptions,
    Layout, NdBox, ObjectStoreExt as _, StepReader, Store, StoreConfig, VerifyScope, writer_id,
};

/// A backend under test, with whatever keeps it alive.
enum Backend {
    Memory(Store),
    Local(Store, #[allow(dead_code)] tempfile::TempDir),
    S3(Store, #[allow(dead_code)] S3Server),
}

impl Backend {
    /// Whether the backend's conditional create is atomic. `s3s-fs` checks for the object and
    /// then writes it (a race real S3 does not have); deterministic commit records keep the
    /// outcome consistent there anyway, which the test checks.
    fn atomic_create(&self) -> bool {
        !matches!(self, Backend::S3(..))
    }

    fn store(&self) -> &Store {
        match self {
            Backend::Memory(s) | Backend::Local(s, _) | Backend::S3(s, _) => s,
        }
    }
}

fn memory(cfg: StoreConfig) -> Backend {
    Backend::Memory(memory_store(cfg))
}
fn local(cfg: StoreConfig) -> Backend {
    let (s, d) = local_store(cfg);
    Backend::Local(s, d)
}
fn s3(cfg: StoreConfig) -> Backend {
    let server = S3Server::start();
    let s = server.store("conformance", cfg);
    Backend::S3(s, server)
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod on_memory { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { super::$case(memory(tiny_config())).await } )* }
        mod on_local { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { super::$case(local(tiny_config())).await } )* }
        mod on_s3 { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { ckpt_store::require!(Need::S3Server, concat!(stringify!($case), " on S3")); super::$case(s3(tiny_config())).await } )* }
    };
}

conformance!(
    round_trip_every_dtype_and_odd_shape,
    incremental_save_writes_nothing_new,
    small_tensors_are_packed,
    sharded_reads_fetch_only_what_they_need,
    concurrent_committers_one_wins,
    missing_rank_is_never_committed,
    coverage_errors_name_tensor_and_region,
    damage_is_named_and_isolated,
    verify_reports_damaged_tensors,
    gc_keeps_retained_and_in_flight,
    listing_runs_and_steps,
    multipart_large_objects,
    failed_commit_is_never_a_dedup_base,
    gc_never_sweeps_under_a_save_in_flight,
    a_short_grace_only_defers_the_sweep,
    a_step_another_gc_drops_mid_mark_is_not_an_error,
    a_killed_gcs_sweep_lock_holds_saves_back_only_for_its_lapse,
    a_sweep_lock_of_a_gone_process_of_this_machine_holds_nothing_back,
    a_live_sweep_is_never_taken_for_a_killed_one,
    gc_racing_saves_never_breaks_a_commit,
    a_started_generation_fences_older_writers,
    a_generations_interval_is_agreed_once,
    replacing_a_manifest_never_breaks_a_racing_commit,
    delta_chains_restore_bit_exact_and_gc_keeps_their_bases,
    a_damaged_delta_base_fails_verify_naming_both_steps,
    replicas_are_compared_at_commit_and_a_flipped_bit_is_recorded,
);

fn shard(name: &str, dtype: DType, shape: &[u64], bbox: NdBox, data: Vec<u8>) -> ShardIn {
    ShardIn {
        shard: ShardDesc {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            bbox,
            replica_of: None,
            placement: None,
        },
        data: Some(Bytes::from(data)),
    }
}

async fn save_single(
    store: &Store,
    run: &str,
    step: u64,
    tensors: &[(&str, DType, Vec<u64>, Vec<u8>)],
    index: &DedupIndex,
) -> ckpt_store::PutStats {
    let shards = tensors
        .iter()
        .map(|(n, d, s, data)| shard(n, *d, s, NdBox::full(s), data.clone()))
        .collect();
    let blobs = vec![BlobIn {
        name: "rng".into(),
        data: Bytes::from(det_bytes(step, 100)),
    }];
    let (_, _, stats) = store
        .write_rank(
            &RankWrite::new(run, step, 0, Layout::SINGLE),
            shards,
            blobs,
            index,
        )
        .await
        .unwrap();
    store.log().commit_step(run, step).await.unwrap();
    stats
}

async fn round_trip_every_dtype_and_odd_shape(b: Backend) {
    let store = b.store();
    let shapes: &[&[u64]] = &[
        &[],
        &[0],
        &[3, 0, 2],
        &[1],
        &[7],
        &[13, 17],
        &[5, 4, 3],
        &[2049],
    ];
    let mut tensors = Vec::new();
    for (i, dt) in DType::ALL.iter().enumerate() {
        for (j, shape) in shapes.iter().enumerate() {
            let n = NdBox::full(shape).numel() as usize * dt.size();
            tensors.push((
                format!("{dt}/{j}"),
                *dt,
                shape.to_vec(),
                det_bytes((i * 100 + j) as u64, n),
            ));
        }
    }
    let refs: Vec<(&str, DType, Vec<u64>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), b.clone()))
        .collect();
    save_single(store, "dtypes", 1, &refs, &DedupIndex::new()).await;
    let r = StepReader::open(store, "dtypes", 1).await.unwrap();
    assert_eq!(r.commit().tensors.len(), tensors.len());
    for (name, dt, shape, data) in &tensors {
        let got = r.read_tensor(name).await.unwrap();
        assert!(got == *data, "{name} differs after a round trip");
        let t = r.commit().tensor(name).unwrap();
        assert_eq!((t.dtype, &t.shape), (*dt, shape));
        // A box crossing chunk boundaries.
        if shape.len() == 2 {
            let bx = NdBox::new(vec![3, 5], vec![9, 7]).unwrap();
            assert_eq!(
                r.read(name, &bx).await.unwrap(),
                cut(data, shape, &bx, dt.size())
            );
        }
    }
    assert_eq!(r.read_blob(0, "rng").await.unwrap(), det_bytes(1, 100));
}

async fn incremental_save_writes_nothing_new(b: Backend) {
    let store = b.store();
    let big = det_bytes(1, 10 * 4096 + 100); // 11 chunks of 4 KiB
    let mut t = vec![(
        "w",
        DType::F32,
        vec![(big.len() / 4) as u64],
        big[..big.len() / 4 * 4].to_vec(),
    )];
    let index = DedupIndex::new();
    let first = save_single(store, "inc", 1, &t, &index).await;
    assert!(first.bytes_written > 40_000, "{first:?}");
    let second = save_single(store, "inc", 2, &t, &index).await;
    // The blob changes every step (one small chunk); the tensor costs nothing.
    assert_eq!(second.chunks_skipped, second.chunks - 1, "{second:?}");
    assert!(
        second.bytes_written < 1000,
        "second save wrote {} bytes",
        second.bytes_written
    );
    // One element changed: one chunk of the tensor is rewritten.
    t[0].3[5000] ^= 0xff;
    let third = save_single(store, "inc", 3, &t, &index).await;
    assert_eq!(third.chunks - third.chunks_skipped, 2, "{third:?}");
    let r = StepReader::open(store, "inc", 3).await.unwrap();
    assert_eq!(r.read_tensor("w").await.unwrap(), t[0].3);
    let r2 = StepReader::open(store, "inc", 2).await.unwrap();
    assert_ne!(r2.read_tensor("w").await.unwrap(), t[0].3);
    // A fresh index seeded from the committed manifest dedups just as well.
    let seeded = DedupIndex::new();
    let m = r.manifest(0).await.unwrap();
    seeded.extend(m.tensors.iter().flat_map(|t| &t.chunks));
    let fourth = save_single(store, "inc", 4, &t, &seeded).await;
    assert_eq!(fourth.chunks - fourth.chunks_skipped, 1, "{fourth:?}");
}

async fn small_tensors_are_packed(b: Backend) {
    let store = b.store();
    let tensors: Vec<(String, DType, Vec<u64>, Vec<u8>)> = (0..40)
        .map(|i| (format!("norm.{i}"), DType::F32, vec![50], det_bytes(i, 200)))
        .collect();
    let refs: Vec<(&str, DType, Vec<u64>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), b.clone()))
        .collect();
    let stats = save_single(store, "packs", 1, &refs, &DedupIndex::new()).await;
    assert_eq!(stats.chunks, 41);
    // 41 chunks of ~216 bytes with an 8 KiB pack target: two packs, not 41 objects.
    assert!(stats.objects_written <= 2, "{stats:?}");
    let r = StepReader::open(store, "packs", 1).await.unwrap();
    for (n, _, _, d) in &tensors {
        assert_eq!(&r.read_tensor(n).await.unwrap(), d);
    }
    let m = r.manifest(0).await.unwrap();
    assert!(m.tensors.iter().all(|t| t.chunks[0].pack.is_some()));
}

/// 4 ranks: a [16, 24] f32 matrix split 2 x 2 (rows by dp, columns by tp) and a replicated
/// bias written by one rank.
async fn save_sharded(store: &Store, run: &str, step: u64, whole: &[u8], bias: &[u8]) {
    let layout = Layout::new(2, 2, 1, 0).unwrap();
    let shape = [16u64, 24];
    let mut handles = Vec::new();
    for rank in 0..4u32 {
        let c = layout.coords(rank);
        let bx = NdBox::new(vec![c.dp as u64 * 8, c.tp as u64 * 12], vec![8, 12]).unwrap();
        let mut shards = vec![shard(
            "w",
            DType::F32,
            &shape,
            bx.clone(),
            cut(whole, &shape, &bx, 4),
        )];
        shards.push(if rank == 0 {
            shard("b", DType::Bf16, &[24], NdBox::full(&[24]), bias.to_vec())
        } else {
            ShardIn {
                shard: ShardDesc {
                    name: "b".into(),
                    dtype: DType::Bf16,
                    shape: vec![24],
                    bbox: NdBox::full(&[24]),
                    replica_of: Some(0),
                    placement: None,
                },
                data: None,
            }
        });
        let store = store.clone();
        let wr = RankWrite::new(run, step, rank, layout);
        handles.push(tokio::spawn(async move {
            store
                .write_rank(&wr, shards, vec![], &DedupIndex::new())
                .await
                .unwrap();
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
}

async fn sharded_reads_fetch_only_what_they_need(b: Backend) {
    let store = b.store();
    let whole = det_bytes(7, 16 * 24 * 4);
    let bias = det_bytes(8, 48);
    save_sharded(store, "tp", 1, &whole, &bias).await;
    let out = store.log().commit_step("tp", 1).await.unwrap();
    assert!(matches!(out, CommitOutcome::Committed(..)));
    let r = StepReader::open(store, "tp", 1).await.unwrap();
    assert_eq!(r.commit().tensor("w").unwrap().shards.len(), 4);
    assert_eq!(
        r.commit().tensor("b").unwrap().shards.len(),
        1,
        "replicas are not written twice"
    );
    assert_eq!(r.read_tensor("w").await.unwrap(), whole);
    assert_eq!(r.read_tensor("b").await.unwrap(), bias);
    // A box across all four shards.
    let bx = NdBox::new(vec![5, 9], vec![6, 7]).unwrap();
    assert_eq!(
        r.read("w", &bx).await.unwrap(),
        cut(&whole, &[16, 24], &bx, 4)
    );
    // A box inside one shard touches only that shard's chunks.
    let inner = NdBox::new(vec![0, 0], vec![2, 12]).unwrap();
    let plan = r.plan("w", &inner).await.unwrap();
    assert!(plan.chunks.iter().all(|c| c.rank == 0), "{plan:?}");
    assert!(plan.raw_bytes_fetched() <= 8 * 12 * 4);
    // Every element of every box, compared with the reference.
    for (o0, o1, l0, l1) in [
        (0, 0, 16, 24),
        (15, 23, 1, 1),
        (7, 11, 2, 2),
        (0, 12, 16, 1),
    ] {
        let bx = NdBox::new(vec![o0, o1], vec![l0, l1]).unwrap();
        assert_eq!(
            r.read("w", &bx).await.unwrap(),
            cut(&whole, &[16, 24], &bx, 4),
            "{bx}"
        );
    }
    let e = r
        .read("w", &NdBox::new(vec![10, 0], vec![7, 1]).unwrap())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    let e = r.read_tensor("nope").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(
        e.to_string().contains("\"nope\"") && e.to_string().contains("step 1 of run tp"),
        "{e}"
    );
}

async fn concurrent_committers_one_wins(b: Backend) {
    let store = b.store();
    save_sharded(
        store,
        "race",
        3,
        &det_bytes(1, 16 * 24 * 4),
        &det_bytes(2, 48),
    )
    .await;
    let mut hs = Vec::new();
    for _ in 0..6 {
        let s = store.clone();
        hs.push(tokio::spawn(async move {
            s.log().commit_step("race", 3).await.unwrap()
        }));
    }
    let mut won = 0;
    let mut ids = HashSet::new();
    for h in hs {
        let o = h.await.unwrap();
        if matches!(o, CommitOutcome::Committed(..)) {
            won += 1;
        }
        ids.insert(o.id());
    }
    if b.atomic_create() {
        assert_eq!(won, 1, "exactly one committer creates the record");
    } else {
        assert!(won >= 1, "someone commits");
    }
    assert_eq!(ids.len(), 1, "every committer sees the same record");
    let (_, id) = store.log().read_commit("race", 3).await.unwrap();
    assert!(ids.contains(&id));
}

async fn missing_rank_is_never_committed(b: Backend) {
    let store = b.store();
    let layout = Layout::new(4, 1, 1, 0).unwrap();
    let shape = [8u64];
    for rank in 0..3u32 {
        let bx = NdBox::new(vec![rank as u64 * 2], vec![2]).unwrap();
        store
            .write_rank(
                &RankWrite::new("miss", 5, rank, layout),
                vec![shard(
                    "x",
                    DType::I64,
                    &shape,
                    bx,
                    det_bytes(rank as u64, 16),
                )],
                vec![],
                &DedupIndex::new(),
            )
            .await
            .unwrap();
    }
    let e = store.log().commit_step("miss", 5).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Incomplete);
    assert!(
        e.to_string().contains("ranks 3") && e.to_string().contains("step 5 of run miss"),
        "{e}"
    );
    let steps = store.log().list_steps("miss").await.unwrap();
    assert_eq!(steps.len(), 1);
    assert!(!steps[0].committed);
    assert_eq!(steps[0].ranks, vec![0, 1, 2]);
    assert_eq!(store.log().latest_committed("miss").await.unwrap(), None);
    assert_eq!(
        StepReader::open(store, "miss", 5).await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // A waiting committer gives up at its timeout with the same error.
    let e = store
        .log()
        .wait_and_commit(
            "miss",
            5,
            Duration::from_millis(20),
            Duration::from_millis(100),
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Incomplete);
    // The last rank arrives while a committer waits: it commits.
    let s2 = store.clone();
    let waiter = tokio::spawn(async move {
        s2.log()
            .wait_and_commit(
                "miss",
                5,
                Duration::from_millis(20),
                Duration::from_secs(30),
            )
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let bx = NdBox::new(vec![6], vec![2]).unwrap();
    store
        .write_rank(
            &RankWrite::new("miss", 5, 3, layout),
            vec![shard("x", DType::I64, &shape, bx, det_bytes(3, 16))],
            vec![],
            &DedupIndex::new(),
        )
        .await
        .unwrap();
    waiter.await.unwrap().unwrap();
    assert_eq!(store.log().latest_committed("miss").await.unwrap(), Some(5));
}

async fn coverage_errors_name_tensor_and_region(b: Backend) {
    let store = b.store();
    let layout = Layout::new(2, 1, 1, 0).unwrap();
    // Both ranks claim rows 0..3 of a [4, 2] tensor: rows 0..2 doubled, row 3 missing.
    for rank in 0..2u32 {
        let bx = NdBox::new(vec![rank as u64, 0], vec![3, 2]).unwrap();
        store
            .write_rank(
                &RankWrite::new("cov", 1, rank, layout),
                vec![shard("emb", DType::F32, &[4, 2], bx, det_bytes(0, 24))],
                vec![],
                &DedupIndex::new(),
            )
            .await
            .unwrap();
    }
    let e = store.log().commit_step("cov", 1).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let m = e.to_string();
    assert!(
        m.contains("\"emb\"") && m.contains("saved twice") && m.contains("[1..3, 0..2]"),
        "{m}"
    );
    assert!(
        !store
            .objects()
            .exists(&store.keys().commit("cov", 1))
            .await
            .unwrap()
    );
}

async fn damage_is_named_and_isolated(b: Backend) {
    let store = b.store();
    // Step 1 and step 2 share no tensor chunks (different data); damage step 2 in every way.
    let t1 = vec![("a", DType::F32, vec![3000u64], det_bytes(1, 12_000))];
    let index = DedupIndex::new();
    save_single(store, "dmg", 1, &t1, &index).await;
    let t2 = vec![
        ("a", DType::F32, vec![3000u64], det_bytes(2, 12_000)),
        ("small", DType::F32, vec![10u64], det_bytes(3, 40)),
    ];
    save_single(store, "dmg", 2, &t2, &DedupIndex::new()).await;
    let r2 = StepReader::open(store, "dmg", 2).await.unwrap();
    let m = r2.manifest(0).await.unwrap();
    let a = m.tensors.iter().find(|t| t.name == "a").unwrap();
    let os = store.object_store();

    // Flipped byte.
    let key = store.keys().object_of(&a.chunks[1]);
    let orig = store.objects().get_object(&key).await.unwrap();
    let mut bad = orig.to_vec();
    bad[100] ^= 0x01;
    os.put(&key, Bytes::from(bad).into()).await.unwrap();
    let e = r2.read_tensor("a").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    let msg = e.to_string();
    assert!(
        msg.contains("step 2 of run dmg")
            && msg.contains("\"a\"")
            && msg.contains(&a.chunks[1].id.to_hex()),
        "{msg}"
    );
    // Step 1 does not depend on it.
    let r1 = StepReader::open(store, "dmg", 1).await.unwrap();
    assert_eq!(r1.read_tensor("a").await.unwrap(), t1[0].3);
    // Other tensors of step 2 stay readable; so do boxes of "a" that avoid the chunk.
    assert_eq!(r2.read_tensor("small").await.unwrap(), t2[1].3);
    let first_chunk = NdBox::new(vec![0], vec![1024]).unwrap();
    assert_eq!(r2.read("a", &first_chunk).await.unwrap(), t2[0].3[..4096]);

    // Truncated object.
    os.put(&key, orig.slice(..orig.len() / 2).into())
        .await
        .unwrap();
    let e = r2.read_tensor("a").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    // Missing chunk.
    os.delete(&key).await.unwrap();
    let e = r2.read_tensor("a").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.to_string().contains("missing"), "{e}");
    // A header claiming a terabyte.
    let mut tb = orig.to_vec();
    tb[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    os.put(&key, Bytes::from(tb).into()).await.unwrap();
    let e = r2.read_tensor("a").await.unwrap_err();
    assert!(e.to_string().contains("claims 1099511627776 bytes"), "{e}");
    os.put(&key, orig.clone().into()).await.unwrap();
    assert_eq!(r2.read_tensor("a").await.unwrap(), t2[0].3);

    // Garbage manifest: the step fails with the manifest named; step 1 stays readable.
    let mkey = store.keys().rank_manifest("dmg", 2, 0);
    os.put(
        &mkey,
        Bytes::from_static(b"{\"not\": \"a manifest\"").into(),
    )
    .await
    .unwrap();
    let fresh = StepReader::open(store, "dmg", 2).await.unwrap();
    let e = fresh.read_tensor("a").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.to_string().contains(mkey.as_ref()), "{e}");
    assert_eq!(
        StepReader::open(store, "dmg", 1)
            .await
            .unwrap()
            .read_tensor("a")
            .await
            .unwrap(),
        t1[0].3
    );
    // Truncated commit record.
    let ckey = store.keys().commit("dmg", 2);
    let c = store.objects().get_object(&ckey).await.unwrap();
    os.put(&ckey, c.slice(..c.len() / 3).into()).await.unwrap();
    let e = StepReader::open(store, "dmg", 2).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.to_string().contains(ckey.as_ref()), "{e}");
}

async fn verify_reports_damaged_tensors(b: Backend) {
    let store = b.store();
    let shared = det_bytes(9, 8192);
    let t1 = vec![
        ("shared", DType::Bf16, vec![4096u64], shared.clone()),
        ("only1", DType::F32, vec![2048u64], det_bytes(10, 8192)),
    ];
    let t2 = vec![
        ("shared", DType::Bf16, vec![4096u64], shared.clone()),
        ("only2", DType::F32, vec![2048u64], det_bytes(11, 8192)),
        ("tiny", DType::U8, vec![10u64], det_bytes(12, 10)),
    ];
    let index = DedupIndex::new();
    save_single(store, "ver", 1, &t1, &index).await;
    save_single(store, "ver", 2, &t2, &index).await;
    let clean = store.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(clean.is_clean(), "{:?}", clean.damaged);
    assert!(clean.bytes >= 8192 * 3 + 10);
    let r = StepReader::open(store, "ver", 2).await.unwrap();
    let m = r.manifest(0).await.unwrap();
    let chunk = &m
        .tensors
        .iter()
        .find(|t| t.name == "shared")
        .unwrap()
        .chunks[0];
    let key = store.keys().object_of(chunk);
    let mut bad = store.objects().get_object(&key).await.unwrap().to_vec();
    let last = bad.len() - 1;
    bad[last] ^= 0x80;
    store
        .object_store()
        .put(&key, Bytes::from(bad).into())
        .await
        .unwrap();
    // Damage inside a pack: the tiny tensor's chunk.
    let tiny = &m.tensors.iter().find(|t| t.name == "tiny").unwrap().chunks[0];
    let pkey = store.keys().object_of(tiny);
    let mut p = store.objects().get_object(&pkey).await.unwrap().to_vec();
    p[tiny.offset as usize + 20] ^= 0x01;
    store
        .object_store()
        .put(&pkey, Bytes::from(p).into())
        .await
        .unwrap();

    let rep = store
        .verify(&VerifyScope::Run("ver".into()), None)
        .await
        .unwrap();
    assert_eq!(rep.damaged.len(), 2, "{:#?}", rep.damaged);
    let shared_d = rep
        .damaged
        .iter()
        .find(|d| d.object == key.to_string())
        .unwrap();
    let items: Vec<(u64, &str)> = shared_d
        .affects
        .iter()
        .map(|a| (a.step, a.item.as_str()))
        .collect();
    assert_eq!(items, vec![(1, "tensor shared"), (2, "tensor shared")]);
    let tiny_d = rep
        .damaged
        .iter()
        .find(|d| d.object == pkey.to_string())
        .unwrap();
    assert_eq!(tiny_d.affects.len(), 1);
    assert_eq!(tiny_d.affects[0].item, "tensor tiny");
    assert!(
        tiny_d.problem.contains(&tiny.id.short()),
        "{}",
        tiny_d.problem
    );
    // Scoped to step 1, only the shared chunk is damaged.
    let rep1 = store
        .verify(&VerifyScope::Step("ver".into(), 1), None)
        .await
        .unwrap();
    assert_eq!(rep1.damaged.len(), 1);
}

async fn gc_keeps_retained_and_in_flight(b: Backend) {
    let store = b.store();
    let index = DedupIndex::new();
    for step in 1..=5u64 {
        let t = vec![("w", DType::F32, vec![2048u64], det_bytes(100 + step, 8192))];
        save_single(store, "gc", step, &t, &index).await;
    }
    // An in-flight save of step 6: chunks and a manifest for rank 0 of 2, no commit.
    let layout = Layout::new(2, 1, 1, 0).unwrap();
    let inflight = det_bytes(200, 4096);
    store
        .write_rank(
            &RankWrite::new("gc", 6, 0, layout),
            vec![shard(
                "w",
                DType::F32,
                &[2048],
                NdBox::new(vec![0], vec![1024]).unwrap(),
                inflight.clone(),
            )],
            vec![],
            &DedupIndex::new(),
        )
        .await
        .unwrap();
    // Objects written by a save whose manifest is not there yet: only the grace period
    // protects them. A chunk written directly stands for one.
    let orphan_young = ckpt_store::ChunkIn {
        data: Bytes::from(det_bytes(300, 4096)),
        elem: 1,
        base: None,
    };
    let put = store
        .chunks()
        .put_chunks(
            futures::stream::iter(vec![orphan_young]),
            &DedupIndex::new(),
        )
        .await
        .unwrap();
    let young_key = store.keys().object_of(&put.refs[0]);

    // Dry run with grace: nothing is deleted.
    let now = ckpt_store::clock::system_now();
    let opts = GcOptions {
        keep_last: Some(2),
        keep_every: Some(2),
        grace: Duration::from_secs(3600),
        dry_run: true,
        ..Default::default()
    };
    let dry = store.gc().run(&opts, now).await.unwrap();
    assert_eq!(
        dry.steps_deleted,
        vec![("gc".to_string(), 1), ("gc".to_string(), 3)]
    );
    assert_eq!(
        store.log().committed_steps("gc").await.unwrap(),
        vec![1, 2, 3, 4, 5]
    );

    // Real run, with "now" two hours ahead: every unreferenced object is past the grace.
    let later = now + chrono::Duration::hours(2);
    let real = store
        .gc()
        .run(
            &GcOptions {
                dry_run: false,
                ..opts.clone()
            },
            later,
        )
        .await
        .unwrap();
    assert_eq!(real.steps_deleted, dry.steps_deleted);
    assert_eq!(
        store.log().committed_steps("gc").await.unwrap(),
        vec![2, 4, 5]
    );
    assert!(real.objects_deleted >= 2, "{real:?}");
    assert!(
        !store.objects().exists(&young_key).await.unwrap(),
        "the old orphan is swept"
    );
    // The in-flight rank's manifest is younger than... no: it is two "hours" old too, so the
    // abandoned incomplete step is deleted with its chunks.
    assert_eq!(real.incomplete_deleted, vec![("gc".to_string(), 6)]);
    for step in [2u64, 4, 5] {
        let r = StepReader::open(store, "gc", step).await.unwrap();
        assert_eq!(
            r.read_tensor("w").await.unwrap(),
            det_bytes(100 + step, 8192),
            "step {step}"
        );
    }

    // Within the grace period an in-flight save loses nothing: write step 7's first rank and a
    // stray chunk, gc at the real time, then finish the save and read it.
    store
        .write_rank(
            &RankWrite::new("gc", 7, 0, layout),
            vec![shard(
                "w",
                DType::F32,
                &[2048],
                NdBox::new(vec![0], vec![1024]).unwrap(),
                inflight.clone(),
            )],
            vec![],
            &DedupIndex::new(),
        )
        .await
        .unwrap();
    let rest = det_bytes(201, 4096);
    let pre = store
        .chunks()
        .put_chunks(
            futures::stream::iter(vec![ckpt_store::ChunkIn {
                data: Bytes::from(rest.clone()),
                elem: 4,
                base: None,
            }]),
            &DedupIndex::new(),
        )
        .await
        .unwrap();
    let g = store
        .gc()
        .run(
            &GcOptions {
                keep_last: Some(1),
                grace: Duration::from_secs(3600),
                ..Default::default()
            },
            ckpt_store::clock::system_now(),
        )
        .await
        .unwrap();
    assert!(g.objects_in_grace >= 1, "{g:?}");
    assert!(
        store
            .objects()
            .exists(&store.keys().object_of(&pre.refs[0]))
            .await
            .unwrap()
    );
    store
        .write_rank(
            &RankWrite::new("gc", 7, 1, layout),
            vec![shard(
                "w",
                DType::F32,
                &[2048],
                NdBox::new(vec![1024], vec![1024]).unwrap(),
                rest.clone(),
            )],
            vec![],
            &DedupIndex::new(),
        )
        .await
        .unwrap();
    store.log().commit_step("gc", 7).await.unwrap();
    let r = StepReader::open(store, "gc", 7).await.unwrap();
    assert_eq!(r.read_tensor("w").await.unwrap(), [inflight, rest].concat());
    assert!(
        store
            .verify(&VerifyScope::Store, None)
            .await
            .unwrap()
            .is_clean()
    );
}

async fn listing_runs_and_steps(b: Backend) {
    let store = b.store();
    assert!(store.log().list_runs().await.unwrap().is_empty());
    let e = store.log().require_latest("ghost").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    for (run, step) in [("b", 10u64), ("a", 3), ("a", 12), ("a", 7)] {
        let t = vec![("t", DType::U8, vec![4u64], vec![1, 2, 3, step as u8])];
        save_single(store, run, step, &t, &DedupIndex::new()).await;
    }
    assert_eq!(store.log().list_runs().await.unwrap(), vec!["a", "b"]);
    assert_eq!(
        store.log().committed_steps("a").await.unwrap(),
        vec![3, 7, 12]
    );
    assert_eq!(store.log().latest_committed("a").await.unwrap(), Some(12));
    let e = store.log().require_latest("zzz").await.unwrap_err();
    assert!(e.to_string().contains("known runs: a, b"), "{e}");
    assert!(store.log().list_steps("../etc").await.is_err());
}

async fn multipart_large_objects(b: Backend) {
    // Chunks of 12 MiB with a 6 MiB multipart threshold: every chunk is a multipart upload
    // (on stores that have them).
    let cfg = StoreConfig {
        chunk_size: 12 << 20,
        pack_threshold: 1 << 20,
        pack_target: 4 << 20,
        inflight_bytes: 64 << 20,
        multipart_threshold: 6 << 20,
        multipart_part: 5 << 20,
        ..StoreConfig::default()
    };
    let store = b.store().clone().with_config(cfg).unwrap();
    let data = det_bytes(42, 25 << 20);
    let t = vec![("big", DType::U8, vec![data.len() as u64], data.clone())];
    save_single(&store, "mp", 1, &t, &DedupIndex::new()).await;
    let r = StepReader::open(&store, "mp", 1).await.unwrap();
    assert!(r.read_tensor("big").await.unwrap() == data);
    let bx = NdBox::new(vec![(12 << 20) - 10], vec![20]).unwrap();
    assert_eq!(
        r.read("big", &bx).await.unwrap(),
        data[(12 << 20) - 10..(12 << 20) + 10]
    );
}

// ----- GC never removes what a committed step references (FORMAT.md, "What GC may delete") --

/// One rank's save the way `Checkpointer` does it: take a writer lease (which waits for any GC
/// sweep), skip only what a step found committed after that references, write, release. Returns the chunks the manifest
/// references (for the next save's base).
async fn leased_save(
    store: &Store,
    run: &str,
    wr: &RankWrite,
    shards: Vec<ShardIn>,
    base: &mut DedupBase,
    writer: &str,
) -> ckpt_store::Result<Vec<ChunkRef>> {
    let lease = store
        .gc()
        .lease_dedup_base(run, writer, &base.candidates())
        .await?;
    let index = base.pinned(lease.base());
    let res = store.write_rank(wr, shards, vec![], &index).await;
    store.gc().release_lease(lease).await?;
    let (m, _, _) = res?;
    let refs: Vec<ChunkRef> = m.tensors.iter().flat_map(|t| t.chunks.clone()).collect();
    base.persisted(wr.step, refs.clone());
    Ok(refs)
}

fn hours(h: i64) -> Duration {
    Duration::from_secs(h as u64 * 3600)
}

/// A save whose commit failed left chunks and a manifest; GC later sweeps that abandoned step
/// with its chunks. The next save must not skip those chunks: it commits and verifies clean,
/// and the older committed step still restores.
async fn failed_commit_is_never_a_dedup_base(b: Backend) {
    let clock = TestClock::starting_now();
    let store = &ClockStore::wrap(b.store(), &clock);
    let run = "failed";
    let writer = writer_id(0, 0);
    let mut base = DedupBase::new();
    let frozen = det_bytes(1, 8192);
    let t = |w: &[u8]| {
        vec![
            shard(
                "frozen",
                DType::F32,
                &[2048],
                NdBox::full(&[2048]),
                frozen.clone(),
            ),
            shard("w", DType::F32, &[2048], NdBox::full(&[2048]), w.to_vec()),
        ]
    };
    let (w1, w2) = (det_bytes(10, 8192), det_bytes(20, 8192));
    leased_save(
        store,
        run,
        &RankWrite::new(run, 1, 0, Layout::SINGLE),
        t(&w1),
        &mut base,
        &writer,
    )
    .await
    .unwrap();
    store.log().commit_step(run, 1).await.unwrap();

    // Step 2: chunks and manifest written, the commit fails (a transient error, a timeout).
    leased_save(
        store,
        run,
        &RankWrite::new(run, 2, 0, Layout::SINGLE),
        t(&w2),
        &mut base,
        &writer,
    )
    .await
    .unwrap();
    store.failpoints().set("before_commit", FailAction::Error);
    let e = store.log().commit_step(run, 2).await.unwrap_err();
    assert!(e.to_string().contains("before_commit"), "{e}");
    store.failpoints().clear();

    // Two hours later GC sweeps the abandoned step 2 and the chunks only it referenced.
    clock.advance(hours(2));
    let g = store
        .gc()
        .run(
            &GcOptions {
                grace: hours(1),
                ..Default::default()
            },
            clock.now(),
        )
        .await
        .unwrap();
    assert_eq!(g.incomplete_deleted, vec![(run.to_string(), 2)], "{g:?}");
    assert!(g.objects_deleted >= 1, "{g:?}");

    // Step 3 holds the same bytes step 2 did: a save that dedups against step 2 would point at
    // the swept chunks.
    let refs = leased_save(
        store,
        run,
        &RankWrite::new(run, 3, 0, Layout::SINGLE),
        t(&w2),
        &mut base,
        &writer,
    )
    .await
    .unwrap();
    for r in &refs {
        assert!(
            store
                .objects()
                .exists(&store.keys().object_of(r))
                .await
                .unwrap(),
            "step 3 references {} which is not in the store",
            r.location()
        );
    }
    assert_eq!(
        base.base_step(),
        Some(1),
        "the failed step 2 is never the base"
    );
    store.log().commit_step(run, 3).await.unwrap();
    let v = store.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(v.is_clean(), "{v:?}");
    let r3 = StepReader::open(store, run, 3).await.unwrap();
    assert_eq!(r3.read_tensor("w").await.unwrap(), w2);
    assert_eq!(r3.read_tensor("frozen").await.unwrap(), frozen);
    let r1 = StepReader::open(store, run, 1).await.unwrap();
    assert_eq!(r1.read_tensor("w").await.unwrap(), w1);
}

/// Retention drops the step a writer dedups against while that writer's save is in flight: its
/// writer lease defers the sweep, so the chunks the save skips survive; once the save's
/// manifest is written, GC sweeps again and the new step still verifies. A save waits for a
/// sweep in progress, and a lease left by a dead writer lapses after the grace period.
async fn gc_never_sweeps_under_a_save_in_flight(b: Backend) {
    let clock = TestClock::starting_now();
    let store = &ClockStore::wrap(b.store(), &clock);
    let run = "leased";
    let (x, y) = (det_bytes(1, 8192), det_bytes(2, 8192));
    let save = |data: &[u8]| {
        vec![shard(
            "w",
            DType::F32,
            &[2048],
            NdBox::full(&[2048]),
            data.to_vec(),
        )]
    };
    // Steps 1 (x) and 2 (y), committed two hours ago.
    let mut other = DedupBase::new();
    let refs1 = leased_save(
        store,
        run,
        &RankWrite::new(run, 1, 0, Layout::SINGLE),
        save(&x),
        &mut other,
        "o",
    )
    .await
    .unwrap();
    store.log().commit_step(run, 1).await.unwrap();
    leased_save(
        store,
        run,
        &RankWrite::new(run, 2, 0, Layout::SINGLE),
        save(&y),
        &mut other,
        "o",
    )
    .await
    .unwrap();
    store.log().commit_step(run, 2).await.unwrap();
    clock.advance(hours(2));

    // A writer restored step 1 (its base) and saves x again as step 3: it takes its lease ...
    let mut base = DedupBase::new();
    base.seed(1, refs1.clone());
    let lease = store
        .gc()
        .lease_dedup_base(run, &writer_id(0, 1), &base.candidates())
        .await
        .unwrap();
    assert_eq!(lease.base(), Some(1));
    let index = base.pinned(lease.base());
    // ... and GC with keep_last = 1 runs before its manifest is written.
    let opts = GcOptions {
        keep_last: Some(1),
        grace: hours(1),
        ..Default::default()
    };
    let g = store.gc().run(&opts, clock.now()).await.unwrap();
    assert_eq!(g.steps_deleted, vec![(run.to_string(), 1)], "{g:?}");
    assert!(g.sweep_deferred.is_some(), "{g:?}");
    assert_eq!(g.objects_deleted, 0, "{g:?}");
    assert_eq!(store.log().committed_steps(run).await.unwrap(), vec![2]);
    for r in &refs1 {
        assert!(
            store
                .objects()
                .exists(&store.keys().object_of(r))
                .await
                .unwrap(),
            "GC swept {} under a save in flight",
            r.location()
        );
    }
    let (_, _, st) = store
        .write_rank(
            &RankWrite::new(run, 3, 0, Layout::SINGLE),
            save(&x),
            vec![],
            &index,
        )
        .await
        .unwrap();
    assert_eq!(
        st.objects_written, 0,
        "the save skips step 1's chunks: {st:?}"
    );
    store.gc().release_lease(lease).await.unwrap();
    store.log().commit_step(run, 3).await.unwrap();

    // The next GC sweeps; step 3 (which references x) still verifies.
    clock.advance(hours(2));
    let g = store.gc().run(&opts, clock.now()).await.unwrap();
    assert_eq!(g.sweep_deferred, None, "{g:?}");
    assert!(g.objects_deleted >= 1, "y is swept: {g:?}");
    let left: Vec<u64> = store
        .log()
        .list_steps(run)
        .await
        .unwrap()
        .iter()
        .map(|s| s.step)
        .collect();
    assert_eq!(left, vec![3]);
    let v = store.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(v.is_clean(), "{v:?}");
    let r3 = StepReader::open(store, run, 3).await.unwrap();
    assert_eq!(r3.read_tensor("w").await.unwrap(), x);

    // A writer whose base is gone skips nothing.
    let mut stale = DedupBase::new();
    stale.seed(2, vec![]);
    let l = store
        .gc()
        .lease_dedup_base(run, &writer_id(0, 2), &stale.candidates())
        .await
        .unwrap();
    assert_eq!(l.base(), None);
    assert!(stale.pinned(l.base()).is_empty());
    store.gc().release_lease(l).await.unwrap();

    // A save waits while a sweep holds its lock.
    let sweep = store.keys().sweep_lock("test");
    store
        .objects()
        .put_object(
            &sweep,
            vec![Bytes::from_static(b"{}")],
            ckpt_store::object_store::PutMode::Create,
        )
        .await
        .unwrap();
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move { store.gc().lease_dedup_base("leased", "waiter", &[3]).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "a save went on during a sweep");
    store.objects().delete_all(vec![sweep]).await.unwrap();
    let l = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the save goes on once the sweep ends")
        .unwrap()
        .unwrap();
    assert_eq!(l.base(), Some(3));

    // That lease is never released (the writer died): it lapses after the grace period.
    clock.advance(hours(2));
    let g = store.gc().run(&opts, clock.now()).await.unwrap();
    assert_eq!(g.sweep_deferred, None, "{g:?}");
    let locks = store.gc().list_locks(clock.now(), hours(1)).await.unwrap();
    assert!(
        locks.writers.is_empty() && locks.lapsed.is_empty(),
        "{locks:?}"
    );

    // A GC that crashed mid-sweep left its lock: saves wait for it until it lapses by the
    // store's clock (the same clock that stamps the objects), not by the wall clock.
    let crashed = store.keys().sweep_lock("crashed");
    store
        .objects()
        .put_object(
            &crashed,
            vec![Bytes::from_static(b"{}")],
            ckpt_store::object_store::PutMode::Create,
        )
        .await
        .unwrap();
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .gc()
                .lease_dedup_base("leased", "after-crash", &[])
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "a save went on under a fresh sweep lock"
    );
    clock.advance(hours(2));
    let l = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the save goes on once the crashed sweep's lock lapsed by the store's clock")
        .unwrap()
        .unwrap();
    store.gc().release_lease(l).await.unwrap();
}

/// GC with no grace at all beside a save in flight (issue 28: two `ckpt gc --grace 0s` loops
/// beside a job deleted the manifest of the step it was committing): the writer's lease defers
/// the sweep and the step still committing is kept, whatever the grace; only the lease lapse
/// (an hour) makes a save's leftovers abandoned.
async fn a_short_grace_only_defers_the_sweep(b: Backend) {
    let clock = TestClock::starting_now();
    let store = &ClockStore::wrap(b.store(), &clock);
    let run = "short";
    let layout = Layout::new(2, 1, 1, 0).unwrap();
    let half = |rank: u32, seed: u64| {
        vec![shard(
            "w",
            DType::F32,
            &[4096],
            NdBox::new(vec![u64::from(rank) * 2048], vec![2048]).unwrap(),
            det_bytes(seed, 8192),
        )]
    };
    let no_grace = GcOptions {
        keep_last: Some(1),
        grace: Duration::ZERO,
        ..Default::default()
    };
    // Step 1, committed; then step 2: rank 0's manifest is written (its lease ended), rank 1
    // holds its lease and has not written its manifest yet.
    let mut bases = [DedupBase::new(), DedupBase::new()];
    for rank in 0..2u32 {
        let b = &mut bases[rank as usize];
        leased_save(
            store,
            run,
            &RankWrite::new(run, 1, rank, layout),
            half(rank, u64::from(rank)),
            b,
            "a",
        )
        .await
        .unwrap();
    }
    store.log().commit_step(run, 1).await.unwrap();
    clock.advance(Duration::from_secs(1));
    let refs0 = leased_save(
        store,
        run,
        &RankWrite::new(run, 2, 0, layout),
        half(0, 10),
        &mut bases[0],
        "a",
    )
    .await
    .unwrap();
    let lease = store
        .gc()
        .lease_dedup_base(run, &writer_id(1, 0), &bases[1].candidates())
        .await
        .unwrap();
    clock.advance(Duration::from_secs(1));
    let g = store.gc().run(&no_grace, clock.now()).await.unwrap();
    let why = g.sweep_deferred.as_deref().unwrap_or_default();
    assert!(
        why.contains("lapses 3600 s"),
        "the live lease defers the sweep: {g:?}"
    );
    assert_eq!(g.incomplete_deleted, vec![], "{g:?}");
    assert_eq!(g.incomplete_in_flight, vec![(run.to_string(), 2)], "{g:?}");
    assert_eq!(g.objects_deleted, 0, "{g:?}");
    for r in &refs0 {
        assert!(
            store
                .objects()
                .exists(&store.keys().object_of(r))
                .await
                .unwrap(),
            "{}",
            r.location()
        );
    }
    // Rank 1 writes its manifest and ends its lease; before the commit, no lease covers step
    // 2: GC sweeps (no writer), but keeps step 2 and what its manifests reference.
    let index = bases[1].pinned(lease.base());
    store
        .write_rank(
            &RankWrite::new(run, 2, 1, layout),
            half(1, 11),
            vec![],
            &index,
        )
        .await
        .unwrap();
    store.gc().release_lease(lease).await.unwrap();
    clock.advance(Duration::from_secs(1));
    let g = store.gc().run(&no_grace, clock.now()).await.unwrap();
    assert_eq!(g.sweep_deferred, None, "{g:?}");
    assert_eq!(g.incomplete_in_flight, vec![(run.to_string(), 2)], "{g:?}");
    store.log().commit_step(run, 2).await.unwrap();
    let r = StepReader::open(store, run, 2).await.unwrap();
    let want = [det_bytes(10, 8192), det_bytes(11, 8192)].concat();
    assert_eq!(r.read_tensor("w").await.unwrap(), want);
    // Retention drops step 1 now, and the sweep deletes what only step 1 referenced.
    let g = store.gc().run(&no_grace, clock.now()).await.unwrap();
    assert_eq!(g.steps_deleted, vec![(run.to_string(), 1)], "{g:?}");
    assert!(g.objects_deleted >= 2, "{g:?}");

    // A rank of step 3 killed after its manifest: its step is kept for the lease lapse, then
    // abandoned and deleted, at no grace as at the default.
    leased_save(
        store,
        run,
        &RankWrite::new(run, 3, 0, layout),
        half(0, 20),
        &mut bases[0],
        "a",
    )
    .await
    .unwrap();
    clock.advance(Duration::from_secs(30 * 60));
    let g = store.gc().run(&no_grace, clock.now()).await.unwrap();
    assert_eq!(g.incomplete_in_flight, vec![(run.to_string(), 3)], "{g:?}");
    clock.advance(Duration::from_secs(31 * 60));
    let g = store.gc().run(&no_grace, clock.now()).await.unwrap();
    assert_eq!(g.incomplete_deleted, vec![(run.to_string(), 3)], "{g:?}");
    assert_eq!(store.log().committed_steps(run).await.unwrap(), vec![2]);
    let r = StepReader::open(store, run, 2).await.unwrap();
    assert_eq!(r.read_tensor("w").await.unwrap(), want);
    let v = store.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(v.is_clean(), "{v:?}");
}

/// Two GCs at once: while one marks the steps it listed, the other's retention drops some of
/// them (commit record, then manifests). The first finds those manifests gone with their
/// commit records: not live any more, not an error, and the kept step stays whole.
async fn a_step_another_gc_drops_mid_mark_is_not_an_error(b: Backend) {
    let store = b.store();
    let run = "twogc";
    let mut base = DedupBase::new();
    for step in 1..=3u64 {
        let data = det_bytes(step, 8192);
        let s = vec![shard("w", DType::F32, &[2048], NdBox::full(&[2048]), data)];
        leased_save(
            store,
            run,
            &RankWrite::new(run, step, 0, Layout::SINGLE),
            s,
            &mut base,
            "a",
        )
        .await
        .unwrap();
        store.log().commit_step(run, step).await.unwrap();
    }
    // The first GC (no retention: every step is live) pauses after listing, before its mark.
    store.failpoints().set_nth(
        "before_mark",
        FailAction::Sleep(Duration::from_millis(800)),
        Some(1),
    );
    let first = {
        let store = store.clone();
        tokio::spawn(async move {
            let opts = GcOptions {
                grace: Duration::ZERO,
                ..Default::default()
            };
            store.gc().run(&opts, ckpt_store::clock::system_now()).await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = GcOptions {
        keep_last: Some(1),
        grace: Duration::ZERO,
        ..Default::default()
    };
    let g = store
        .gc()
        .run(&second, ckpt_store::clock::system_now())
        .await
        .unwrap();
    assert_eq!(
        g.steps_deleted,
        vec![(run.to_string(), 1), (run.to_string(), 2)],
        "{g:?}"
    );
    let g = first.await.unwrap().unwrap_or_else(|e| {
        panic!("a GC failed on the steps another GC dropped while it marked: {e}")
    });
    assert!(g.steps_deleted.is_empty(), "{g:?}");
    store.failpoints().clear();
    assert_eq!(store.log().committed_steps(run).await.unwrap(), vec![3]);
    let r = StepReader::open(store, run, 3).await.unwrap();
    assert_eq!(r.read_tensor("w").await.unwrap(), det_bytes(3, 8192));
    let v = store.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(v.is_clean(), "{v:?}");
}

/// `store` with a short sweep-lock lapse, so that the tests below take seconds.
fn short_lapse(store: &Store, lapse: Duration) -> Store {
    store
        .clone()
        .with_config(StoreConfig {
            sweep_lapse: lapse,
            ..store.config().clone()
        })
        .unwrap()
}

/// `ckpt gc` killed mid-sweep leaves its sweep lock, which nobody refreshes: a save watches it
/// for the lapse, takes it for a dead GC's, deletes it and goes on (and the next save does not
/// wait at all); not [`ckpt_store::lease::LOCK_LAPSE`] (an hour) later.
async fn a_killed_gcs_sweep_lock_holds_saves_back_only_for_its_lapse(b: Backend) {
    let lapse = Duration::from_millis(600);
    let store = &short_lapse(b.store(), lapse);
    let lock = store.keys().sweep_lock("killed-gc");
    store
        .objects()
        .put_object(
            &lock,
            vec![Bytes::from_static(b"{}")],
            ckpt_store::object_store::PutMode::Create,
        )
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    let l = tokio::time::timeout(
        Duration::from_secs(20),
        store.gc().lease_dedup_base("killed", &writer_id(0, 0), &[]),
    )
    .await
    .expect("a dead GC's lock holds a save back for its lapse, not longer")
    .unwrap();
    let waited = t0.elapsed();
    assert!(
        waited >= lapse,
        "the save took a fresh sweep lock for dead after {waited:?}"
    );
    store.gc().release_lease(l).await.unwrap();
    assert!(
        !store.objects().exists(&lock).await.unwrap(),
        "the dead GC's lock is deleted"
    );
    let t1 = std::time::Instant::now();
    let l = store
        .gc()
        .lease_dedup_base("killed", &writer_id(0, 0), &[])
        .await
        .unwrap();
    store.gc().release_lease(l).await.unwrap();
    assert!(
        t1.elapsed() < lapse,
        "the next save waited {:?}",
        t1.elapsed()
    );
}

/// A rank killed mid-retention on this machine leaves its sweep lock: a save on the same
/// machine sees that the process named in it is gone and goes on at once (a job restarted
/// again and again must not wait a lapse each time); a lock of a process that is alive is
/// waited for as before (a live GC of this process: `a_live_sweep_is_never_taken_for_a_killed_one`).
async fn a_sweep_lock_of_a_gone_process_of_this_machine_holds_nothing_back(b: Backend) {
    let Some(host) = ckpt_store::lease::host_tag() else {
        eprintln!("no /proc here: the machine check is off");
        return;
    };
    let lapse = Duration::from_secs(3);
    let store = &short_lapse(b.store(), lapse);
    let put = |name: String| async move {
        let lock = store.keys().sweep_lock(&name);
        store
            .objects()
            .put_object(
                &lock,
                vec![Bytes::from_static(b"{}")],
                ckpt_store::object_store::PutMode::Create,
            )
            .await
            .unwrap();
        lock
    };
    // A save's wait for the sweep locks.
    let save = || async move {
        let t0 = std::time::Instant::now();
        let l = store
            .gc()
            .lease_dedup_base("gone", &writer_id(0, 0), &[])
            .await
            .unwrap();
        store.gc().release_lease(l).await.unwrap();
        t0.elapsed()
    };
    // A process that ended (reaped): its pid names nobody now.
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    let lock = put(format!("h{host}-rank-000000-g0-p{pid}-1-0-0")).await;
    let waited = save().await;
    assert!(
        waited < lapse,
        "a save waited {waited:?} for the lock of a process that is gone"
    );
    assert!(
        !store.objects().exists(&lock).await.unwrap(),
        "the orphaned lock is deleted"
    );
    // A lock of this very process that none of its GCs holds: a GC whose delete of its lock
    // failed on a flaky store (the writers of the same process must not wait the lapse).
    let lock = put(format!(
        "h{host}-rank-000000-g0-p{}-1-0-0",
        std::process::id()
    ))
    .await;
    let waited = save().await;
    assert!(
        waited < lapse,
        "a save waited {waited:?} for a lock this process no longer holds"
    );
    assert!(!store.objects().exists(&lock).await.unwrap());
    // A live process of this machine (a child sleeping), or one of another machine: waited for
    // the lapse.
    let mut alive = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    for name in [
        format!("h{host}-rank-000000-g0-p{}-1-0-0", alive.id()),
        format!("h000000000000{}-rank-000000-g0-p{pid}-1-0-0", 1),
    ] {
        let lock = put(name).await;
        let waited = save().await;
        assert!(waited >= lapse, "{lock}: waited only {waited:?}");
    }
    let _ = alive.kill();
    let _ = alive.wait();
}

/// A GC that sweeps for several lapses (here held at its first delete batch by a failpoint)
/// keeps its lock fresh: a save that starts meanwhile waits for it instead of taking it for a
/// killed GC's, and the GC, seeing the save's lease, leaves the rest of its sweep for later.
async fn a_live_sweep_is_never_taken_for_a_killed_one(b: Backend) {
    // The GC refreshes its lock every sixth of the lapse, and a save takes a lock unchanged
    // for a lapse for dead: the store must answer a refresh well within the lapse. `s3s-fs`,
    // niced on a loaded 2-core machine, has taken 0.7 s (1.3 s with a build running), so on
    // S3 the lapse is longer.
    let lapse = if matches!(b, Backend::S3(..)) {
        Duration::from_secs(2)
    } else {
        Duration::from_millis(600)
    };
    // The sweep holds its lock this long at its first delete batch: four lapses.
    let hold = 4 * lapse;
    let clock = TestClock::starting_now();
    let store = &ClockStore::wrap(&short_lapse(b.store(), lapse), &clock);
    let run = "live";
    // An abandoned step (never committed) and its chunks, old enough to sweep.
    let data = det_bytes(7, 8192);
    let t = vec![shard("w", DType::U8, &[8192], NdBox::full(&[8192]), data)];
    store
        .write_rank(
            &RankWrite::new(run, 1, 0, Layout::SINGLE),
            t,
            vec![],
            &DedupIndex::new(),
        )
        .await
        .unwrap();
    clock.advance(hours(2));
    // The store's clock runs (a refreshed lock gets a new modification time: `s3s-fs` lists no
    // e-tags).
    let ticking = {
        let clock = clock.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
                clock.advance(Duration::from_millis(10));
            }
        })
    };
    store
        .failpoints()
        .set("before_sweep_delete", FailAction::Sleep(hold));
    let gc = {
        let store = store.clone();
        let now = clock.now();
        tokio::spawn(async move {
            store
                .gc()
                .run(
                    &GcOptions {
                        grace: hours(1),
                        ..Default::default()
                    },
                    now,
                )
                .await
        })
    };
    // Wait until the sweep is past its check for writer leases (at its first delete batch),
    // then save. (Seeing its lock is not enough: a lease put before the sweep's listing of
    // `locks/` makes the sweep give way, rightly, and the save go on.)
    let t0 = std::time::Instant::now();
    while store.failpoints().hits("before_sweep_delete") == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "gc never reached its sweep"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !store
            .gc()
            .list_locks(clock.now(), hours(1))
            .await
            .unwrap()
            .sweeps
            .is_empty(),
        "the sweep holds its lock"
    );
    let l = store
        .gc()
        .lease_dedup_base(run, &writer_id(0, 0), &[])
        .await
        .unwrap();
    let waited = t0.elapsed();
    let g = gc.await.unwrap().unwrap();
    store.gc().release_lease(l).await.unwrap();
    // The sweep holds its lock for `hold` after t0; a save that took it for dead would have
    // gone on after about one lapse.
    assert!(
        waited >= hold * 2 / 3,
        "the save went on after {waited:?}, under a live sweep: it took the lock for a killed \
         GC's, or the GC gave the sweep up ({g:?})"
    );
    ticking.abort();
    // After the hold, the GC sees the save's lease and leaves the sweep. Or, where a refresh
    // was slow (`s3s-fs` under load has taken over half a lapse to answer one), it stops first
    // because its lock may look dead: also right, and the save above waited all the same.
    let why = g.sweep_deferred.as_deref().unwrap_or_default();
    assert!(
        why.contains("a save started") || why.contains("the sweep lock was last refreshed"),
        "{g:?}"
    );
    assert_eq!(g.objects_deleted, 0, "{g:?}");
}

/// Two ranks save 50 steps, each save racing the commit of the previous step, while GC with
/// keep_last = 1 runs in a loop; tensors revert to earlier contents (so saves skip chunks only
/// an older step references), every fifth step is never committed (abandoned), and after some
/// of those time jumps past the grace period. Every committed step reads back exactly, and at the end the
/// whole store verifies clean.
async fn gc_racing_saves_never_breaks_a_commit(b: Backend) {
    let clock = TestClock::starting_now();
    let store = ClockStore::wrap(b.store(), &clock);
    let run = "race";
    let layout = Layout::new(2, 1, 1, 0).unwrap();
    // A tick is 10 minutes; a save spans at most one tick and a commit two, well within the
    // grace period (the assumption FORMAT.md states).
    let tick = Duration::from_secs(600);
    let grace = hours(1);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Stops the GC loop however this test ends (a failed assertion included).
    struct StopOnDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);
    impl Drop for StopOnDrop {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let _stop_gc = StopOnDrop(stop.clone());
    let passes = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let gc_task = {
        let (store, clock, stop, passes) =
            (store.clone(), clock.clone(), stop.clone(), passes.clone());
        tokio::spawn(async move {
            let opts = GcOptions {
                keep_last: Some(1),
                grace,
                ..Default::default()
            };
            let mut swept = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let g = store.gc().run(&opts, clock.now()).await.expect("gc");
                swept += g.objects_deleted;
                passes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            swept
        })
    };
    // Rank r's half of tensor "a" in version v (a few versions, so contents come back).
    let half = |name: u64, r: u32, v: u64| det_bytes(name * 1000 + u64::from(r) * 100 + v, 4096);
    let version = |k: u64, t: u64| match t {
        0 => 0,     // never changes
        1 => k % 2, // x y x y ...: a save may skip chunks only the step before last holds
        _ => k / 2, // changes every other step: the step after an abandoned one repeats it
    };
    let mut bases = [DedupBase::new(), DedupBase::new()];
    let writers = [writer_id(0, 0), writer_id(1, 0)];
    let mut commit: Option<(
        u64,
        tokio::task::JoinHandle<ckpt_store::Result<CommitOutcome>>,
    )> = None;
    let mut committed = Vec::new();
    let check = |store: Store, step: u64| async move {
        let r = StepReader::open(&store, run, step).await.unwrap();
        for t in 0..3u64 {
            let want = [half(t, 0, version(step, t)), half(t, 1, version(step, t))].concat();
            assert_eq!(
                r.read_tensor(&format!("t{t}"))
                    .await
                    .unwrap_or_else(|e| panic!("step {step}: {e}")),
                want,
                "step {step} tensor t{t}"
            );
        }
    };
    for k in 1..=50u64 {
        clock.advance(tick);
        if k % 15 == 9 {
            // After an abandoned step, the job pauses for longer than the grace period; GC
            // passes over everything (and sweeps the abandoned step).
            if let Some((s, h)) = commit.take()
                && h.await.unwrap().is_ok()
            {
                check(store.clone(), s).await;
                committed.push(s);
            }
            clock.advance(grace * 2);
            let p = passes.load(std::sync::atomic::Ordering::SeqCst);
            while passes.load(std::sync::atomic::Ordering::SeqCst) < p + 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        // Both ranks save step k at once, racing GC and the commit of step k - 1.
        let saves = (0..2u32).zip(bases.iter_mut()).map(|(r, base)| {
            let store = store.clone();
            let writer = writers[r as usize].clone();
            async move {
                let shards = (0..3u64)
                    .map(|t| {
                        shard(
                            &format!("t{t}"),
                            DType::F32,
                            &[2048],
                            NdBox::new(vec![u64::from(r) * 1024], vec![1024]).unwrap(),
                            half(t, r, version(k, t)),
                        )
                    })
                    .collect();
                leased_save(
                    &store,
                    run,
                    &RankWrite::new(run, k, r, layout),
                    shards,
                    base,
                    &writer,
                )
                .await
            }
        });
        for res in futures::future::join_all(saves).await {
            res.unwrap();
        }
        if let Some((s, h)) = commit.take()
            && h.await.unwrap().is_ok()
        {
            check(store.clone(), s).await;
            committed.push(s);
        }
        // Every fifth step is abandoned: its commit never happens.
        if k % 5 != 3 {
            let store = store.clone();
            commit = Some((
                k,
                tokio::spawn(async move { store.log().commit_step(run, k).await }),
            ));
        }
    }
    if let Some((s, h)) = commit.take() {
        h.await.unwrap().unwrap();
        check(store.clone(), s).await;
        committed.push(s);
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let swept = gc_task.await.unwrap();
    assert_eq!(committed.len(), 40, "{committed:?}");
    assert!(swept > 0, "GC swept nothing: the race was not exercised");
    clock.advance(grace * 2);
    store
        .gc()
        .run(
            &GcOptions {
                keep_last: Some(1),
                grace,
                ..Default::default()
            },
            clock.now(),
        )
        .await
        .unwrap();
    let v = store.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(v.is_clean(), "{v:?}");
    assert_eq!(store.log().committed_steps(run).await.unwrap(), vec![50]);
    check(store.clone(), 50).await;
}

async fn a_started_generation_fences_older_writers(b: Backend) {
    // Job A (generation 0) commits step 1; then two jobs resume the run at once, each
    // claiming a generation: they get different numbers, and from then on only the newest
    // may write. Older writers and committers are refused with a fence naming it.
    let store = b.store();
    let run = "fence";
    save_as(store, run, 1, 0).await.unwrap();
    store.log().commit_step_as(run, 1, Some(0)).await.unwrap();
    let first = store.log().claim_generation(run, 1).await.unwrap();
    let second = store.log().claim_generation(run, 1).await.unwrap();
    assert_eq!((first, second), (1, 2), "two claims, two generations");
    assert_eq!(store.log().newest_generation(run).await.unwrap(), Some(2));
    for old in [0, 1] {
        let e = save_as(store, run, 2, old).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
        assert!(e.to_string().contains("fenced by generation 2"), "{e}");
        let e = store.log().join_generation(run, old).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    }
    // The newest generation joins (its marker exists) and writes; an older committer of the
    // same step is refused, the newest commits.
    store.log().join_generation(run, 2).await.unwrap();
    save_as(store, run, 2, 2).await.unwrap();
    let e = store
        .log()
        .commit_step_as(run, 2, Some(1))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    let o = store.log().commit_step_as(run, 2, Some(2)).await.unwrap();
    assert!(matches!(o, CommitOutcome::Committed(..)));
    assert_eq!(store.log().committed_steps(run).await.unwrap(), vec![1, 2]);
    // A committer of an older generation whose manifests are complete (saved before the newer
    // job started) is refused at the commit: it must not commit any step after that.
    save_as(store, "fence2", 1, 4).await.unwrap();
    store.log().start_generation("fence2", 5).await.unwrap();
    let e = store.log().commit_step_as("fence2", 1, Some(4)).await;
    let e = e.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    assert!(e.to_string().contains("fenced by generation 5"), "{e}");
    assert!(
        store
            .log()
            .committed_steps("fence2")
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .verify(&VerifyScope::Store, None)
            .await
            .unwrap()
            .is_clean()
    );
}

async fn a_generations_interval_is_agreed_once(b: Backend) {
    // Ranks in separate processes propose the interval each derived for their generation;
    // the first proposal stored is the one every rank uses, also when they race. Another
    // generation (a zombie of an older one, or the next) has an object of its own.
    let store = b.store();
    let run = "agree";
    store.log().start_generation(run, 3).await.unwrap();
    let t = store.log().generation_started_ms(run, 3).await.unwrap();
    assert!(t.is_some_and(|t| t > 0), "{t:?}");
    assert_eq!(
        store.log().generation_started_ms(run, 4).await.unwrap(),
        None
    );
    let proposal = |g: u64, steps: u64| Interval {
        to_steps: steps,
        reason: "young_daly".into(),
        generation: Some(g),
    };
    let (a, b1) = (proposal(3, 7), proposal(3, 9));
    // Racing proposals only where the conditional create is atomic (real S3's is; `s3s-fs`
    // checks and then writes, so two truly simultaneous creates of different bodies can both
    // succeed there): on the S3 test server the second proposal comes after the first.
    let (ra, rb) = if b.atomic_create() {
        tokio::join!(
            store.log().agree_generation_interval(run, 3, &a),
            store.log().agree_generation_interval(run, 3, &b1)
        )
    } else {
        let ra = store.log().agree_generation_interval(run, 3, &a).await;
        (ra, store.log().agree_generation_interval(run, 3, &b1).await)
    };
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.0, rb.0, "two ranks of one generation disagree");
    assert!(
        ra.1 != rb.1,
        "exactly one proposal is stored: {ra:?} {rb:?}"
    );
    let agreed = ra.0.to_steps;
    assert!(agreed == 7 || agreed == 9);
    // A late proposal gets the stored one.
    let (late, created) = store
        .log()
        .agree_generation_interval(run, 3, &proposal(3, 40))
        .await
        .unwrap();
    assert_eq!((late.to_steps, created), (agreed, false));
    // An older generation's writer cannot reach generation 3's interval.
    let (old, created) = store
        .log()
        .agree_generation_interval(run, 2, &proposal(2, 40))
        .await
        .unwrap();
    assert_eq!((old.to_steps, created), (40, true));
    let (again, _) = store
        .log()
        .agree_generation_interval(run, 3, &proposal(3, 11))
        .await
        .unwrap();
    assert_eq!(again.to_steps, agreed);
    // A stored value its type refuses is damaged data, named by its object.
    store
        .log()
        .agree_generation_interval(run, 5, &proposal(5, 0))
        .await
        .unwrap();
    let e = store
        .log()
        .agree_generation_interval(run, 5, &proposal(5, 8))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("is 0 steps"), "{e}");
}

/// What the store's tests agree on per generation: the store keeps any JSON value and asks
/// its type whether a stored one can be used (the real one is `ckpt-recovery`'s
/// `CheckpointInterval` record).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Interval {
    to_steps: u64,
    reason: String,
    generation: Option<u64>,
}

impl ckpt_store::Agreement for Interval {
    fn check(&self, _run: &str, _generation: u64) -> Result<(), String> {
        if self.to_steps == 0 {
            return Err("the interval is 0 steps".into());
        }
        Ok(())
    }
}

/// Save a one-tensor step as rank 0 of `generation` (the bytes depend on the generation, so
/// two generations' manifests differ).
async fn save_as(store: &Store, run: &str, step: u64, generation: u64) -> ckpt_store::Result<()> {
    let mut rw = RankWrite::new(run, step, 0, Layout::SINGLE);
    rw.generation = generation;
    let data = det_bytes(generation + 11, 64);
    let sh = vec![shard("t", DType::U8, &[64], NdBox::full(&[64]), data)];
    store
        .write_rank(&rw, sh, Vec::new(), &DedupIndex::new())
        .await
        .map(|_| ())
}

fn with_fp(store: &Store, spec: &str) -> Store {
    store
        .clone()
        .with_failpoints(ckpt_store::Failpoints::parse(spec).unwrap())
}

async fn replacing_a_manifest_never_breaks_a_racing_commit(b: Backend) {
    // A writer of a newer generation replaces a manifest an older generation left in an
    // uncommitted step, while a committer of that older generation commits the step: whatever
    // the interleaving, no commit record ends up pinned to manifest bytes that are gone.
    let store = b.store();
    let ms = std::time::Duration::from_millis;

    // 1. The committer has passed its generation check and creates its record only after
    //    the manifest was replaced: it withdraws the record, and the newer generation commits.
    //    (The sleeps leave room for an S3 server that takes a second a request on a loaded
    //    machine; each side waits until the other is inside its window.)
    let inside = |s: &Store, fp: &'static str| {
        let fps = s.failpoints().clone();
        async move {
            let t0 = std::time::Instant::now();
            while fps.hits(fp) == 0 {
                assert!(t0.elapsed() < Duration::from_secs(60), "{fp} never reached");
                tokio::time::sleep(ms(10)).await;
            }
        }
    };
    save_as(store, "race1", 1, 0).await.unwrap();
    let slow = with_fp(store, "before_commit_create=sleep(5000)");
    let at = inside(&slow, "before_commit_create");
    let c = tokio::spawn(async move { slow.log().commit_step_as("race1", 1, Some(0)).await });
    at.await;
    save_as(store, "race1", 1, 1).await.unwrap();
    let e = c.await.unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    assert!(e.to_string().contains("withdrawn"), "{e}");
    let e = store.log().read_commit("race1", 1).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let o = store
        .log()
        .commit_step_as("race1", 1, Some(1))
        .await
        .unwrap();
    assert_eq!(o.record().generation, 1);

    // 2. The committer creates its record between the writer's "not committed" check and its
    //    overwrite: the writer puts the committed manifest back and is refused.
    save_as(store, "race2", 1, 0).await.unwrap();
    let slow_c = with_fp(store, "before_commit_create=sleep(4000)");
    let at = inside(&slow_c, "before_commit_create");
    let c = tokio::spawn(async move { slow_c.log().commit_step_as("race2", 1, Some(0)).await });
    at.await;
    let slow_w = with_fp(store, "before_manifest_replace=sleep(8000)");
    let wr = tokio::spawn(async move { save_as(&slow_w, "race2", 1, 1).await });
    let ce = c.await.unwrap().unwrap_err();
    assert_eq!(
        ce.kind(),
        ErrorKind::Fenced,
        "the committer learns it is stale: {ce}"
    );
    let we = wr.await.unwrap().unwrap_err();
    assert_eq!(we.kind(), ErrorKind::Conflict, "{we}");
    assert!(we.to_string().contains("already committed"), "{we}");
    let (rec, _) = store.log().read_commit("race2", 1).await.unwrap();
    assert_eq!(rec.generation, 0);
    let m = store
        .log()
        .read_rank_manifest("race2", 1, 0, Some(&rec.ranks[0]))
        .await
        .unwrap();
    assert_eq!(m.generation, 0);
    let r = StepReader::open(store, "race2", 1).await.unwrap();
    assert_eq!(r.read_tensor("t").await.unwrap(), det_bytes(11, 64));
    assert!(
        store
            .verify(&VerifyScope::Store, None)
            .await
            .unwrap()
            .is_clean()
    );
}

// ----- Delta chunks (issue 16): chains bounded, bit-exact, bases kept by GC -------------------

/// Compress always (no governor) and chain deltas up to `k` bases.
fn delta_config(k: usize) -> StoreConfig {
    StoreConfig {
        adaptive_codec: false,
        delta_chain: k,
        ..ckpt_store::testing::tiny_config()
    }
}

/// fp32 "weights" after `step` small updates: every element changes every step, in its low
/// mantissa bits only (what an optimizer step does), so a delta on the previous step pays.
fn drifting_f32(step: u64, n: usize) -> Vec<u8> {
    let r = det_bytes(7, n * 8);
    let d = det_bytes(8, n * 8);
    (0..n)
        .flat_map(|i| {
            let u = u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().unwrap());
            let v = u64::from_le_bytes(d[i * 8..i * 8 + 8].try_into().unwrap());
            let x = ((u >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 0.04;
            let drift = ((v >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 2e-4;
            ((x * (1.0 + drift * step as f64)) as f32).to_le_bytes()
        })
        .collect()
}

/// One rank's save as `Checkpointer` makes it: lease, the committed base's chunks (and regions)
/// as the index, write, release, remember the manifest, commit.
async fn delta_save(
    store: &Store,
    run: &str,
    step: u64,
    tensors: &[(&str, DType, Vec<u64>, Vec<u8>)],
    base: &mut DedupBase,
) -> ckpt_store::RankManifest {
    let lease = store
        .gc()
        .lease_dedup_base(run, "delta-writer", &base.candidates())
        .await
        .unwrap();
    let index = base.pinned(lease.base());
    let shards = tensors
        .iter()
        .map(|(n, d, s, data)| shard(n, *d, s, NdBox::full(s), data.clone()))
        .collect();
    let res = store
        .write_rank(
            &RankWrite::new(run, step, 0, Layout::SINGLE),
            shards,
            vec![],
            &index,
        )
        .await;
    store.gc().release_lease(lease).await.unwrap();
    let (m, _, _) = res.unwrap();
    base.persisted_manifest(&m);
    store.log().commit_step(run, step).await.unwrap();
    m
}

fn gets(store: &Store) -> u64 {
    store
        .metrics()
        .expect("opened with metrics")
        .snapshot()
        .gets
}

async fn delta_chains_restore_bit_exact_and_gc_keeps_their_bases(b: Backend) {
    const K: usize = 3;
    let store = b.store().clone().with_config(delta_config(K)).unwrap();
    let run = "delta";
    let shape = vec![64u64, 256];
    let ints = det_bytes(5, 64 * 256 * 4);
    let mut base = DedupBase::new();
    let mut want = Vec::new();
    let mut manifests = Vec::new();
    for step in 1..=7u64 {
        let wbytes = drifting_f32(step, 64 * 256);
        let mut ints = ints.clone();
        ints[..8].copy_from_slice(&step.to_le_bytes());
        let t = vec![
            ("w", DType::F32, shape.clone(), wbytes.clone()),
            ("i", DType::I32, shape.clone(), ints),
        ];
        let m = delta_save(&store, run, step, &t, &mut base).await;
        want.push(wbytes);
        manifests.push(m);
    }
    // The chain grows by one a save up to K bases, then a whole chunk starts it again.
    let chains: Vec<Vec<usize>> = manifests
        .iter()
        .map(|m| m.tensors[0].chunks.iter().map(|c| c.bases.len()).collect())
        .collect();
    for (s, c) in chains.iter().enumerate() {
        assert!(
            c.iter().all(|&n| n <= K),
            "step {}: chain {c:?} longer than {K}",
            s + 1
        );
    }
    assert!(
        chains[0].iter().all(|&n| n == 0),
        "step 1 has no base: {chains:?}"
    );
    let deltas = chains[1].iter().filter(|&&n| n == 1).count();
    assert!(
        deltas * 4 >= chains[1].len() * 3,
        "most float chunks of step 2 are deltas on step 1: {chains:?}"
    );
    for (s, c) in chains.iter().enumerate().skip(1) {
        for (k, &n) in c.iter().enumerate() {
            let prev = chains[s - 1][k];
            assert!(
                n == 0 || n == prev + 1,
                "step {} chunk {k}: chain {n} after {prev}",
                s + 1
            );
            if prev == K {
                assert_eq!(
                    n,
                    0,
                    "step {} chunk {k}: a whole chunk after a full chain",
                    s + 1
                );
            }
        }
    }
    assert!(
        chains.iter().flatten().any(|&n| n == K),
        "some chain reaches K: {chains:?}"
    );
    for m in &manifests {
        assert!(
            m.tensors[1].chunks.iter().all(|c| !c.is_delta()),
            "integers never delta"
        );
        for c in m.tensors[0].chunks.iter().filter(|c| c.is_delta()) {
            assert_eq!(
                c.base_step,
                Some(m.step - 1),
                "the base is the previous committed step"
            );
        }
    }
    // A delta is smaller than the same region stored whole one step earlier.
    let (mut delta_stored, mut whole_stored) = (0u64, 0u64);
    for (d, p) in manifests[1].tensors[0]
        .chunks
        .iter()
        .zip(&manifests[0].tensors[0].chunks)
    {
        if d.is_delta() {
            delta_stored += d.stored as u64;
            whole_stored += p.stored as u64;
        }
    }
    assert!(
        delta_stored * 10 < whole_stored * 9,
        "deltas pay: {delta_stored} vs {whole_stored}"
    );

    // Every step restores bit for bit: whole, resharded (a box cutting chunks), and as the
    // consolidated safetensors file.
    let sub = NdBox::new(vec![10, 32], vec![30, 160]).unwrap();
    for (s, bytes) in want.iter().enumerate() {
        let step = s as u64 + 1;
        let r = StepReader::open(&store, run, step).await.unwrap();
        assert_eq!(&r.read_tensor("w").await.unwrap(), bytes, "step {step}");
        assert_eq!(
            r.read("w", &sub).await.unwrap(),
            cut(bytes, &shape, &sub, 4),
            "step {step}, box {sub}"
        );
        let view = ckpt_store::SafetensorsView::new(r.commit(), None).unwrap();
        let mut file = vec![0u8; view.len() as usize];
        view.read_at(&r, 0, &mut file).await.unwrap();
        let e = view.entries().iter().find(|e| e.name == "w").unwrap();
        assert_eq!(
            &file[e.start as usize..(e.start + e.len) as usize],
            &bytes[..],
            "export of step {step}"
        );
    }
    // A restore reads at most K + 1 objects a chunk.
    for m in &manifests {
        for c in &m.tensors[0].chunks {
            let before = gets(&store);
            store.chunks().get_chunk(c).await.unwrap();
            let n = gets(&store) - before;
            assert_eq!(
                n,
                c.bases.len() as u64 + 1,
                "objects read for {}",
                c.location()
            );
            assert!(n <= K as u64 + 1);
        }
    }

    // Retention drops every step but the newest: its chains' bases (written by dropped steps)
    // stay, and are reported as kept only as bases.
    let now = ckpt_store::clock::system_now();
    let opts = GcOptions {
        keep_last: Some(1),
        grace: Duration::ZERO,
        ..Default::default()
    };
    let g = store.gc().run(&opts, now).await.unwrap();
    assert_eq!(g.steps_kept, vec![(run.to_string(), 7)]);
    let newest = &manifests[6].tensors[0].chunks;
    let depth = newest.iter().map(|c| c.bases.len()).max().unwrap();
    assert!(depth >= 1, "step 7 holds deltas: {chains:?}");
    assert!(
        g.objects_kept_as_bases > 0 && g.bytes_kept_as_bases > 0,
        "{g:?}"
    );
    assert!(
        g.objects_deleted > 0,
        "older whole chunks no chain needs are swept: {g:?}"
    );
    for c in newest {
        for p in store.keys().chain_objects(c) {
            assert!(
                store.objects().exists(&p).await.unwrap(),
                "{p} (chain of {}) kept",
                c.location()
            );
        }
    }
    let r = StepReader::open(&store, run, 7).await.unwrap();
    assert_eq!(r.read_tensor("w").await.unwrap(), want[6]);
    let v = store.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(v.is_clean(), "{:?}", v.damaged);
    // The next save builds on step 7 (its chain may be at K: a whole chunk then) and restores.
    let wbytes = drifting_f32(8, 64 * 256);
    let t = vec![("w", DType::F32, shape.clone(), wbytes.clone())];
    let m8 = delta_save(&store, run, 8, &t, &mut base).await;
    assert!(m8.tensors[0].chunks.iter().all(|c| c.bases.len() <= K));
    let r = StepReader::open(&store, run, 8).await.unwrap();
    assert_eq!(r.read_tensor("w").await.unwrap(), wbytes);
}

async fn a_damaged_delta_base_fails_verify_naming_both_steps(b: Backend) {
    let store = b.store().clone().with_config(delta_config(4)).unwrap();
    let run = "dbase";
    let shape = vec![16u64, 256];
    let mut base = DedupBase::new();
    let mut ms = Vec::new();
    for step in 1..=2u64 {
        let t = vec![("w", DType::F32, shape.clone(), drifting_f32(step, 16 * 256))];
        ms.push(delta_save(&store, run, step, &t, &mut base).await);
    }
    let delta = ms[1].tensors[0]
        .chunks
        .iter()
        .find(|c| c.is_delta())
        .expect("step 2 holds a delta")
        .clone();
    let base_key = store.keys().chunk(&delta.bases[0]);
    let mut obj = store
        .objects()
        .get_object(&base_key)
        .await
        .unwrap()
        .to_vec();
    let last = obj.len() - 1;
    obj[last] ^= 0x5a;
    store
        .object_store()
        .put(&base_key, Bytes::from(obj).into())
        .await
        .unwrap();

    // Verifying step 2 alone reads the base through the chain and names both steps.
    let v = store
        .verify(&VerifyScope::Step(run.into(), 2), None)
        .await
        .unwrap();
    assert!(!v.is_clean());
    let d = v
        .damaged
        .iter()
        .find(|d| d.object == store.keys().object_of(&delta).to_string())
        .unwrap_or_else(|| panic!("the delta object is reported: {:?}", v.damaged));
    assert!(
        d.problem.contains(&delta.bases[0].to_string()),
        "names the base chunk: {}",
        d.problem
    );
    assert!(
        d.problem.contains("step 1"),
        "names the base's step: {}",
        d.problem
    );
    assert!(d.affects.iter().any(|a| a.step == 2), "{d:?}");
    let db = v
        .damaged
        .iter()
        .find(|d| d.object == base_key.to_string())
        .expect("the base object is reported");
    assert!(db.affects.iter().any(|a| a.step == 2), "{db:?}");
    // The whole run: the base object breaks both steps.
    let v = store
        .verify(&VerifyScope::Run(run.into()), None)
        .await
        .unwrap();
    let db = v
        .damaged
        .iter()
        .find(|d| d.object == base_key.to_string())
        .unwrap();
    let steps: HashSet<u64> = db.affects.iter().map(|a| a.step).collect();
    assert_eq!(steps, HashSet::from([1, 2]), "{db:?}");
    // A restore of step 2 fails as damaged, naming the chunk, its base and the base's step.
    let r = StepReader::open(&store, run, 2).await.unwrap();
    let e = r.read_tensor("w").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains(&delta.bases[0].to_string()) && msg.contains("step 1"),
        "{msg}"
    );

    // A missing base is named the same way.
    store.object_store().delete(&base_key).await.unwrap();
    let e = store.chunks().get_chunk(&delta).await.unwrap_err();
    assert!(
        e.to_string().contains("missing") && e.to_string().contains("step 1"),
        "{e}"
    );
}

/// The sentinel (issue 29): ranks 1 and 2 hash their replicas of rank 0's tensor; rank 2's
/// copy has one bit flipped. The committer compares the chunk ids before it commits: the
/// record names the chunk, both sides with their nodes, and rank 2 as the suspect (two of
/// three agree); the stored bytes are the writer's, and the record reads back the same.
async fn replicas_are_compared_at_commit_and_a_flipped_bit_is_recorded(b: Backend) {
    let store = b.store();
    let run = "sdc";
    let layout = Layout::new(3, 1, 1, 0).unwrap();
    let len = 20_000u64;
    let good = det_bytes(9, len as usize);
    let mut bad = good.clone();
    let flip = 13_001usize;
    bad[flip] ^= 0x04;
    let chunk_of_flip = store
        .chunk_spans(len)
        .position(|r| r.contains(&(flip as u64)))
        .unwrap() as u32;
    for (rank, data) in [(0u32, &good), (1, &good), (2, &bad)] {
        let mut s = shard("w", DType::U8, &[len], NdBox::full(&[len]), data.clone());
        if rank > 0 {
            s.shard.replica_of = Some(0);
        }
        let mut wr = RankWrite::new(run, 1, rank, layout);
        wr.node = Some(10 + rank);
        store
            .write_rank(&wr, vec![s], vec![], &DedupIndex::new())
            .await
            .unwrap();
    }
    let out = store.log().commit_step(run, 1).await.unwrap();
    let rep = out.record().replicas.clone().expect("a replica report");
    let chunks = store.chunk_spans(len).count() as u64;
    assert_eq!(rep.chunks_compared, 2 * chunks);
    assert_eq!(rep.bytes_compared, 2 * len);
    assert_eq!(rep.mismatched_chunks, 1, "{rep:?}");
    let m = &rep.mismatches[0];
    assert_eq!(
        (m.tensor.as_str(), m.chunk, m.writer),
        ("w", chunk_of_flip, 0)
    );
    assert_eq!(m.suspects, vec![2]);
    assert_eq!(m.sides[0].ranks, vec![0, 1]);
    assert_eq!(m.sides[0].nodes, vec![Some(10), Some(11)]);
    assert_eq!(m.sides[1].nodes, vec![Some(12)]);
    assert!(!m.stored_suspect());
    // The record as stored says the same, and the tensor reads as the writer saved it.
    let (rec, _) = store.log().read_commit(run, 1).await.unwrap();
    assert_eq!(rec.replicas.as_ref(), Some(&rep));
    let reader = StepReader::open(store, run, 1).await.unwrap();
    assert_eq!(reader.read("w", &NdBox::full(&[len])).await.unwrap(), good);
    // Replicas that agree: compared, nothing recorded as a mismatch.
    for rank in 0..3u32 {
        let mut s = shard("w", DType::U8, &[len], NdBox::full(&[len]), good.clone());
        if rank > 0 {
            s.shard.replica_of = Some(0);
        }
        store
            .write_rank(
                &RankWrite::new(run, 2, rank, layout),
                vec![s],
                vec![],
                &DedupIndex::new(),
            )
            .await
            .unwrap();
    }
    let rep = store
        .log()
        .commit_step(run, 2)
        .await
        .unwrap()
        .record()
        .replicas
        .clone()
        .unwrap();
    assert_eq!(
        (rep.chunks_compared, rep.mismatched_chunks),
        (2 * chunks, 0)
    );
}
