//! Steps in the layout of commit record formats 2 and 3 (rank manifests directly under
//! `steps/<step>/`, before format 4 spread them under `steps/<step>/ranks/<2 hex>/`) still
//! restore, list, verify, commit and are collected by GC, next to steps of this build.
//!
//! An old step is made the way an older build left it: saved, then its manifests moved to
//! their old keys and its record written again as format 2 (the same fields and bytes an
//! older build's committer wrote: the record format is the only difference).

use bytes::Bytes;
use chrono::Duration;
use ckpt_store::testing::{det_bytes, local_store, memory_store, tiny_config};
use ckpt_store::writer::{BlobIn, RankWrite, ShardDesc, ShardIn};
use ckpt_store::{
    CommitRecord, DType, DedupIndex, ErrorKind, GcOptions, Layout, NdBox, StepReader, Store,
    VerifyScope,
};
use object_store::PutMode;

const RUN: &str = "legacy";

/// Step `step`: tensor `w` bf16 [512] over two tensor-parallel ranks, seeded by `seed`, a
/// tensor `b` only rank 0 holds (the same every step) and a blob per rank. Returns `w`.
async fn save(store: &Store, step: u64, seed: u64) -> Vec<u8> {
    let layout = Layout::new(1, 2, 1, 0).unwrap();
    let w = det_bytes(seed, 1024);
    for rank in 0..2u32 {
        let half = NdBox::new(vec![rank as u64 * 256], vec![256]).unwrap();
        let mut shards = vec![ShardIn {
            shard: ShardDesc::boxed("w", DType::Bf16, vec![512], half),
            data: Some(Bytes::copy_from_slice(
                &w[rank as usize * 512..(rank as usize + 1) * 512],
            )),
        }];
        if rank == 0 {
            shards.push(ShardIn {
                shard: ShardDesc::boxed("b", DType::F32, vec![16], NdBox::full(&[16])),
                data: Some(Bytes::from(det_bytes(2, 64))),
            });
        }
        let blobs = vec![BlobIn {
            name: format!("rank/rng{rank}"),
            data: Bytes::from(det_bytes(10 + rank as u64 + step, 40)),
        }];
        let rw = RankWrite::new(RUN, step, rank, layout);
        store
            .write_rank(&rw, shards, blobs, &DedupIndex::new())
            .await
            .unwrap();
    }
    w
}

/// Move the manifests of `step` (ranks 0 and 1) to where builds before format 4 put them.
async fn move_manifests_to_the_old_place(store: &Store, step: u64) {
    let k = store.keys();
    for rank in 0..2 {
        let new = k.rank_manifest(RUN, step, rank);
        let bytes = store.objects().get_object(&new).await.unwrap();
        store
            .objects()
            .put_object(
                &k.legacy_rank_manifest(RUN, step, rank),
                vec![bytes],
                PutMode::Create,
            )
            .await
            .unwrap();
        store.objects().delete_all(vec![new]).await.unwrap();
    }
}

/// Make committed `step` an old build's step: manifests at the old place, record format 2.
async fn make_old(store: &Store, step: u64) {
    move_manifests_to_the_old_place(store, step).await;
    let key = store.keys().commit(RUN, step);
    let bytes = store.objects().get_object(&key).await.unwrap();
    let mut rec = CommitRecord::from_bytes(&bytes, "test").unwrap();
    assert_eq!(rec.format, ckpt_store::WHOLE_RECORD_FORMAT);
    rec.format = 2;
    let old = rec.seal().unwrap();
    store
        .objects()
        .put_object(&key, vec![old.into()], PutMode::Overwrite)
        .await
        .unwrap();
}

async fn old_steps_still_read_commit_and_collect(store: &Store) {
    let w1 = save(store, 1, 1).await;
    store.log().commit_step(RUN, 1).await.unwrap();
    make_old(store, 1).await;
    let w2 = save(store, 2, 2).await;
    store.log().commit_step(RUN, 2).await.unwrap();
    let k = store.keys();
    assert!(
        store
            .objects()
            .exists(&k.legacy_rank_manifest(RUN, 1, 1))
            .await
            .unwrap()
    );
    assert!(
        !store
            .objects()
            .exists(&k.rank_manifest(RUN, 1, 1))
            .await
            .unwrap()
    );
    assert!(
        store
            .objects()
            .exists(&k.rank_manifest(RUN, 2, 1))
            .await
            .unwrap()
    );
    assert!(
        !store
            .objects()
            .exists(&k.legacy_rank_manifest(RUN, 2, 1))
            .await
            .unwrap()
    );

    // Restore: the old step and the new one, whole and any box.
    for (step, w, format) in [(1, &w1, 2), (2, &w2, ckpt_store::WHOLE_RECORD_FORMAT)] {
        let r = StepReader::open(store, RUN, step).await.unwrap();
        assert_eq!(r.commit().format, format);
        assert_eq!(&r.read_tensor("w").await.unwrap(), w, "step {step}");
        let part = NdBox::new(vec![200], vec![112]).unwrap();
        assert_eq!(
            r.read("w", &part).await.unwrap(),
            w[400..624].to_vec(),
            "step {step}: a box across both ranks"
        );
        assert_eq!(r.read_tensor("b").await.unwrap(), det_bytes(2, 64));
        assert_eq!(r.manifest(1).await.unwrap().rank, 1);
    }

    // Listing: both steps, committed, with their ranks, in either listing.
    let steps = store.log().list_steps(RUN).await.unwrap();
    assert_eq!(
        steps
            .iter()
            .map(|s| (s.step, s.committed, s.ranks.clone()))
            .collect::<Vec<_>>(),
        vec![(1, true, vec![0, 1]), (2, true, vec![0, 1])]
    );
    let quick = store.log().list_steps_with_records(RUN).await.unwrap();
    assert_eq!(quick.len(), 2);
    assert!(quick.iter().all(|(_, r)| matches!(r, Some(Ok(_)))));
    assert_eq!(store.log().latest_committed(RUN).await.unwrap(), Some(2));

    // Verify: clean, and the damage of an old step's manifest is still found.
    let v = store.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(v.is_clean(), "{v:?}");
    let old_key = k.legacy_rank_manifest(RUN, 1, 0);
    let good = store.objects().get_object(&old_key).await.unwrap();
    let mut bad = good.to_vec();
    let at = bad.len() / 2;
    bad[at] ^= 0x01;
    store
        .objects()
        .put_object(&old_key, vec![bad.into()], PutMode::Overwrite)
        .await
        .unwrap();
    let v = store
        .verify(&VerifyScope::Step(RUN.into(), 1), None)
        .await
        .unwrap();
    assert!(!v.is_clean(), "a damaged old-place manifest went unnoticed");
    let e = StepReader::open(store, RUN, 1)
        .await
        .unwrap()
        .read_tensor("w")
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    store
        .objects()
        .put_object(&old_key, vec![good], PutMode::Overwrite)
        .await
        .unwrap();

    // A committer of this build commits a step whose manifests an older build wrote (at the
    // old place); readers find them.
    let w3 = save(store, 3, 3).await;
    move_manifests_to_the_old_place(store, 3).await;
    let o = store.log().commit_step(RUN, 3).await.unwrap();
    assert_eq!(o.record().ranks.len(), 2);
    let r = StepReader::open(store, RUN, 3).await.unwrap();
    assert_eq!(r.read_tensor("w").await.unwrap(), w3);

    // An uncommitted step an older build left (one manifest at the old place).
    save(store, 4, 4).await;
    move_manifests_to_the_old_place(store, 4).await;
    store
        .objects()
        .delete_all(vec![k.legacy_rank_manifest(RUN, 4, 1)])
        .await
        .unwrap();

    // GC keeps the newest step only: the old step's record and manifests go, with the
    // objects only it referenced; so does the uncommitted old step after its grace.
    let report = store
        .gc()
        .run(
            &GcOptions {
                keep_last: Some(1),
                ..GcOptions::default()
            },
            ckpt_store::clock::system_now() + Duration::hours(2),
        )
        .await
        .unwrap();
    assert_eq!(report.steps_deleted.len(), 2, "{report:?}");
    assert_eq!(report.incomplete_deleted, vec![(RUN.to_string(), 4)]);
    assert!(report.objects_deleted > 0, "{report:?}");
    assert_eq!(store.log().committed_steps(RUN).await.unwrap(), vec![3]);
    for step in [1, 2, 4] {
        for rank in 0..2 {
            assert!(
                !store
                    .objects()
                    .exists(&k.legacy_rank_manifest(RUN, step, rank))
                    .await
                    .unwrap(),
                "step {step} rank {rank}"
            );
            assert!(
                !store
                    .objects()
                    .exists(&k.rank_manifest(RUN, step, rank))
                    .await
                    .unwrap(),
                "step {step} rank {rank}"
            );
        }
    }
    assert!(
        store
            .log()
            .list_steps(RUN)
            .await
            .unwrap()
            .iter()
            .all(|s| s.step == 3)
    );
    let v = store.verify(&VerifyScope::Store, None).await.unwrap();
    assert!(v.is_clean(), "{v:?}");
    let r = StepReader::open(store, RUN, 3).await.unwrap();
    assert_eq!(r.read_tensor("w").await.unwrap(), w3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_layout_step_restores_lists_verifies_and_is_collected_on_a_local_store() {
    let (store, _dir) = local_store(tiny_config());
    old_steps_still_read_commit_and_collect(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_layout_step_restores_lists_verifies_and_is_collected_in_memory() {
    let store = memory_store(tiny_config());
    old_steps_still_read_commit_and_collect(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_layout_step_restores_lists_verifies_and_is_collected_on_s3() {
    ckpt_store::require!(ckpt_store::testing::Need::S3Server);
    let server = ckpt_store::testing::S3Server::start();
    let store = server.store("legacy", tiny_config());
    old_steps_still_read_commit_and_collect(&store).await;
}
