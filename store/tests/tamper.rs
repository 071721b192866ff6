//! A damaged commit record or rank manifest on a real local store: every reader refuses it
//! with an error naming the step, `verify` reports it, and nothing returns wrong bytes.

use bytes::Bytes;
use ckpt_store::testing::{det_bytes, local_store, tiny_config};
use ckpt_store::writer::{BlobIn, RankWrite, ShardDesc, ShardIn};
use ckpt_store::{
    CommitRecord, DType, DedupIndex, ErrorKind, Layout, NdBox, SafetensorsView, StepReader, Store,
    VerifyScope,
};
use object_store::PutMode;
use object_store::path::Path;

const RUN: &str = "tamper";

/// Step 1 of [`RUN`]: tensor `w` bf16 [512] split over two tensor-parallel ranks, a small
/// tensor `b` on rank 0 and a blob per rank. Returns the bytes of `w` and `b`.
async fn save(store: &Store) -> (Vec<u8>, Vec<u8>) {
    let layout = Layout::new(1, 2, 1, 0).unwrap();
    let w = det_bytes(1, 1024);
    let b = det_bytes(2, 64);
    let index = DedupIndex::new();
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
                data: Some(Bytes::from(b.clone())),
            });
        }
        let blobs = vec![BlobIn {
            name: format!("rank/rng{rank}"),
            data: Bytes::from(det_bytes(10 + rank as u64, 40)),
        }];
        let rw = RankWrite::new(RUN, 1, rank, layout);
        store.write_rank(&rw, shards, blobs, &index).await.unwrap();
    }
    store.log().commit_step(RUN, 1).await.unwrap();
    (w, b)
}

async fn put(store: &Store, path: &Path, bytes: Vec<u8>) {
    store
        .objects()
        .put_object(path, vec![Bytes::from(bytes)], PutMode::Overwrite)
        .await
        .unwrap();
}

/// Every way a reader gets at step 1 fails with a damaged-data error naming the step or the
/// object, and `verify` reports step 1 as damaged.
async fn assert_refused(store: &Store, what: &str) {
    let reading = async {
        let r = StepReader::open(store, RUN, 1).await?;
        SafetensorsView::new(r.commit(), None)?;
        let w = r.read_tensor("w").await?;
        let b = r.read_tensor("b").await?;
        Ok::<_, ckpt_store::Error>((w, b))
    };
    match reading.await {
        Ok((w, _)) => panic!("{what}: a damaged step was read ({} bytes of w)", w.len()),
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{what}: {e}");
            let msg = e.to_string();
            assert!(
                msg.contains("step 1 of run tamper") || msg.contains("runs/tamper/steps/"),
                "{what}: the error does not name the step: {msg}"
            );
        }
    }
    let report = store
        .verify(&VerifyScope::Step(RUN.into(), 1), None)
        .await
        .unwrap();
    assert!(!report.is_clean(), "{what}: verify found nothing");
    assert!(
        report
            .damaged
            .iter()
            .any(|d| d.affects.iter().any(|a| a.run == RUN && a.step == 1)),
        "{what}: verify does not name step 1: {:?}",
        report.damaged
    );
}

/// Offsets spread over the whole object, plus the ones that matter most.
fn offsets(bytes: &[u8], extra: &[&str]) -> Vec<usize> {
    let mut v: Vec<usize> = (0..24).map(|i| i * bytes.len() / 24).collect();
    v.push(bytes.len() - 1);
    for needle in extra {
        let n = needle.as_bytes();
        let at = bytes
            .windows(n.len())
            .position(|w| w == n)
            .unwrap_or_else(|| panic!("{needle} not in the object"));
        v.extend(at..at + n.len());
    }
    v.sort_unstable();
    v.dedup();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bit_flip_in_a_commit_record_is_refused_everywhere() {
    let (store, _dir) = local_store(tiny_config());
    let (w, b) = save(&store).await;
    let key = store.keys().commit(RUN, 1);
    let orig = store.objects().get_object(&key).await.unwrap().to_vec();
    // The shape, the format, the checksum and the layout, besides offsets everywhere.
    let at = offsets(
        &orig,
        &["512", "\"format\":4", "\"checksum\":\"", "\"tp\":2"],
    );
    for (i, &o) in at.iter().enumerate() {
        let mut bad = orig.clone();
        bad[o] ^= 1 << (i % 8);
        put(&store, &key, bad).await;
        assert_refused(&store, &format!("bit {} of byte {o} of COMMIT", i % 8)).await;
    }
    // The shape [512] becoming [513] (the case): refused, not served with stale bytes.
    let text = String::from_utf8(orig.clone()).unwrap();
    put(&store, &key, text.replacen("512", "513", 1).into_bytes()).await;
    assert_refused(&store, "shape 512 -> 513").await;

    put(&store, &key, orig).await;
    let r = StepReader::open(&store, RUN, 1).await.unwrap();
    assert_eq!(r.read_tensor("w").await.unwrap(), w);
    assert_eq!(r.read_tensor("b").await.unwrap(), b);
    assert!(
        store
            .verify(&VerifyScope::Step(RUN.into(), 1), None)
            .await
            .unwrap()
            .is_clean()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bit_flip_in_a_rank_manifest_is_refused_everywhere() {
    let (store, _dir) = local_store(tiny_config());
    let (w, _) = save(&store).await;
    for rank in 0..2 {
        let key = store.keys().rank_manifest(RUN, 1, rank);
        let orig = store.objects().get_object(&key).await.unwrap().to_vec();
        let at = offsets(&orig, &["\"lengths\":[", "\"len\":"]);
        for (i, &o) in at.iter().enumerate() {
            let mut bad = orig.clone();
            bad[o] ^= 1 << (i % 8);
            put(&store, &key, bad).await;
            assert_refused(
                &store,
                &format!("bit {} of byte {o} of rank {rank}'s manifest", i % 8),
            )
            .await;
        }
        put(&store, &key, orig).await;
    }
    let r = StepReader::open(&store, RUN, 1).await.unwrap();
    assert_eq!(r.read_tensor("w").await.unwrap(), w);
}

/// A record whose checksum holds but which disagrees with the manifests it pins (a writer bug,
/// or a format 1 record, which has no checksum): verify rebuilds the tensor table from the
/// manifests and names the tensor; readers refuse it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_rebuilds_the_record_from_the_manifests() {
    let (store, _dir) = local_store(tiny_config());
    save(&store).await;
    let key = store.keys().commit(RUN, 1);
    let orig = store.objects().get_object(&key).await.unwrap().to_vec();
    let what = "test";
    let good = CommitRecord::from_bytes(&orig, what).unwrap();
    assert_eq!(good.format, ckpt_store::WHOLE_RECORD_FORMAT);
    assert!(good.checksum.is_some());

    let verify = || async {
        store
            .verify(&VerifyScope::Step(RUN.into(), 1), None)
            .await
            .unwrap()
    };
    // Same size, other dtype; resealed, so the checksum holds.
    let mut forged = good.clone();
    forged
        .tensors
        .iter_mut()
        .find(|t| t.name == "w")
        .unwrap()
        .dtype = DType::F16;
    put(&store, &key, forged.seal().unwrap()).await;
    let report = verify().await;
    let d = report
        .damaged
        .iter()
        .find(|d| {
            d.affects
                .iter()
                .any(|a| a.item == "tensor w" && a.step == 1)
        })
        .unwrap_or_else(|| panic!("verify does not name tensor w: {:?}", report.damaged));
    assert!(
        d.problem.contains("f16") && d.problem.contains("bf16"),
        "{}",
        d.problem
    );
    let e = StepReader::open(&store, RUN, 1)
        .await
        .unwrap()
        .read_tensor("w")
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");

    // A blob the manifests do not hold, and a tensor listed twice by shards of another rank.
    let mut forged = good.clone();
    forged.blobs[0].len += 1;
    put(&store, &key, forged.seal().unwrap()).await;
    let report = verify().await;
    assert!(
        report.damaged.iter().any(|d| d
            .affects
            .iter()
            .any(|a| a.item.starts_with("blob rank/rng"))),
        "{:?}",
        report.damaged
    );

    // Format 1 (no checksum) is still read...
    let mut old = good.clone();
    old.checksum = None;
    old.format = 1;
    put(&store, &key, serde_json::to_vec_pretty(&old).unwrap()).await;
    StepReader::open(&store, RUN, 1)
        .await
        .unwrap()
        .read_tensor("w")
        .await
        .unwrap();
    assert!(verify().await.is_clean());
    // ...but its shape flipped to [513] leaves a region no shard covers: refused, and verify
    // names it.
    old.tensors
        .iter_mut()
        .find(|t| t.name == "w")
        .unwrap()
        .shape = vec![513];
    put(&store, &key, serde_json::to_vec_pretty(&old).unwrap()).await;
    assert_refused(&store, "format 1 record with shape 513").await;
    // A format 2 record without its checksum is damaged, not old.
    let mut stripped = good.clone();
    stripped.checksum = None;
    put(&store, &key, serde_json::to_vec_pretty(&stripped).unwrap()).await;
    assert_refused(&store, "format 2 record without a checksum").await;

    put(&store, &key, orig).await;
    assert!(verify().await.is_clean());
}

/// Records and manifests are written compact now; those an earlier build wrote pretty (with
/// their hashes and the record's checksum over the pretty bytes) still read, bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_written_pretty_by_an_earlier_build_still_reads() {
    let (store, _dir) = local_store(tiny_config());
    let (w, b) = save(&store).await;
    let key = store.keys().commit(RUN, 1);
    let orig = store.objects().get_object(&key).await.unwrap().to_vec();
    assert!(
        !orig.contains(&b'\n') && !orig.windows(2).any(|p| p == b": "),
        "the record is written compact"
    );
    let mut record: serde_json::Value = serde_json::from_slice(&orig).unwrap();
    for rank in 0..2u32 {
        let mkey = store.keys().rank_manifest(RUN, 1, rank);
        let m: serde_json::Value =
            serde_json::from_slice(&store.objects().get_object(&mkey).await.unwrap()).unwrap();
        let pretty = serde_json::to_vec_pretty(&m).unwrap();
        let entry = &mut record["ranks"][rank as usize];
        entry["hash"] = blake3::hash(&pretty).to_hex().to_string().into();
        entry["size"] = (pretty.len() as u64).into();
        put(&store, &mkey, pretty).await;
    }
    // The record sealed as the earlier build did: checksum over the pretty text with its
    // digits zeroed, then written in.
    record["checksum"] = "0".repeat(64).into();
    let mut text = serde_json::to_vec_pretty(&record).unwrap();
    let sum = blake3::hash(&text).to_hex().to_string();
    let at = text
        .windows(64)
        .position(|p| p == "0".repeat(64).as_bytes())
        .unwrap();
    text[at..at + 64].copy_from_slice(sum.as_bytes());
    assert!(text.contains(&b'\n'));
    put(&store, &key, text).await;

    let r = StepReader::open(&store, RUN, 1).await.unwrap();
    assert_eq!(r.read_tensor("w").await.unwrap(), w);
    assert_eq!(r.read_tensor("b").await.unwrap(), b);
    assert!(
        store
            .verify(&VerifyScope::Step(RUN.into(), 1), None)
            .await
            .unwrap()
            .is_clean()
    );
}

/// Step `step` of run `split`: `per_rank` f32 tensors `t<rank>_<i>` of 64 bytes on each of
/// `world` ranks and a blob per rank, committed with parts of at most 512 bytes, so the
/// record splits (format 5). Returns each tensor's bytes by name.
async fn save_split(
    store: &Store,
    step: u64,
    world: u32,
    per_rank: u32,
) -> std::collections::BTreeMap<String, Vec<u8>> {
    let layout = Layout::new(world, 1, 1, 0).unwrap();
    let index = DedupIndex::new();
    let mut want = std::collections::BTreeMap::new();
    for rank in 0..world {
        let mut shards = Vec::new();
        for i in 0..per_rank {
            let name = format!("t{rank}_{i:02}");
            let data = det_bytes(step * 1000 + u64::from(rank * 100 + i), 64);
            want.insert(name.clone(), data.clone());
            shards.push(ShardIn {
                shard: ShardDesc {
                    name,
                    dtype: DType::F32,
                    shape: vec![16],
                    bbox: NdBox::full(&[16]),
                    replica_of: None,
                    placement: None,
                },
                data: Some(Bytes::from(data)),
            });
        }
        let blobs = vec![BlobIn {
            name: format!("rank/rng{rank}"),
            data: Bytes::from(det_bytes(10 + u64::from(rank), 40)),
        }];
        let rw = RankWrite::new("split", step, rank, layout);
        store.write_rank(&rw, shards, blobs, &index).await.unwrap();
    }
    want
}

fn split_config() -> ckpt_store::StoreConfig {
    ckpt_store::StoreConfig {
        record_part_bytes: 512,
        ..tiny_config()
    }
}

/// Keys of the parts of step `step`'s split record, as listed.
async fn part_keys(store: &Store, step: u64) -> Vec<Path> {
    use futures::TryStreamExt;
    let dir = store.keys().step_dir("split", step).join("index");
    store
        .object_store()
        .list(Some(&dir))
        .map_ok(|m| m.location)
        .try_collect()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_commit_record_reads_whole_and_a_rank_reads_only_its_parts() {
    let (store, _dir) = local_store(split_config());
    let want = save_split(&store, 1, 4, 12).await;
    let outcome = store.log().commit_step("split", 1).await.unwrap();
    // The root is small and pins its parts; the record reads back whole, as committed.
    let (root, id, root_len) = store.log().read_commit_root("split", 1).await.unwrap();
    assert_eq!(root.format, ckpt_store::SPLIT_RECORD_FORMAT);
    assert!(root.tensors.is_empty() && root.ranks.is_empty() && root.blobs.is_empty());
    let index = root.index.clone().expect("split");
    let tensor_parts: Vec<&ckpt_store::PartRef> = index
        .parts
        .iter()
        .filter(|p| matches!(p, ckpt_store::PartRef::Tensors { .. }))
        .collect();
    assert!(tensor_parts.len() >= 4, "{index:?}");
    assert_eq!(part_keys(&store, 1).await.len(), index.parts.len());
    let whole_len = serde_json::to_vec(outcome.record()).unwrap().len() as u64;
    assert!(root_len < whole_len / 2, "root {root_len} of {whole_len}");
    let (whole, id2) = store.log().read_commit("split", 1).await.unwrap();
    assert_eq!(id, id2);
    assert_eq!(&whole, outcome.record());
    assert_eq!(
        (whole.tensors.len(), whole.ranks.len(), whole.blobs.len()),
        (48, 4, 4)
    );
    let r = StepReader::open(&store, "split", 1).await.unwrap();
    for (name, bytes) in &want {
        assert_eq!(&r.read_tensor(name).await.unwrap(), bytes, "{name}");
    }
    // A second committer gets the same record.
    let again = store.log().commit_step("split", 1).await.unwrap();
    assert_eq!(again.id(), outcome.id());
    assert_eq!(again.record(), outcome.record());
    assert!(
        store
            .verify(&VerifyScope::Step("split".into(), 1), None)
            .await
            .unwrap()
            .is_clean()
    );

    // A rank that restores two tensors reads the root and the parts that hold them: with
    // every other tensors part deleted, it still restores them (and the rank manifests they
    // name, and another rank's through the ranks parts), where opening the whole record fails.
    let mine = ["t2_03".to_string(), "t2_04".to_string()];
    let (keep, drop): (Vec<&ckpt_store::PartRef>, Vec<_>) =
        tensor_parts.iter().partition(|p| match p {
            ckpt_store::PartRef::Tensors { first, last, .. } => {
                mine.iter().any(|n| first <= n && n <= last)
            }
            _ => false,
        });
    assert!(!keep.is_empty() && keep.len() < tensor_parts.len());
    for p in &drop {
        store
            .objects()
            .delete_all(vec![store.keys().record_part("split", 1, &p.hash())])
            .await
            .unwrap();
    }
    let r = StepReader::open_tensors(&store, "split", 1, mine.clone())
        .await
        .unwrap();
    assert!(
        r.commit().tensors.len() < 48,
        "{}",
        r.commit().tensors.len()
    );
    for n in &mine {
        assert_eq!(&r.read_tensor(n).await.unwrap(), &want[n], "{n}");
    }
    let absent = r.read_tensor("t0_00").await.unwrap_err();
    assert_eq!(absent.kind(), ErrorKind::NotFound, "{absent}");
    // Rank 3 saved neither tensor: its entry comes from its ranks part, checked.
    let m3 = r.manifest(3).await.unwrap();
    assert_eq!(m3.blobs[0].name, "rank/rng3");
    assert!(r.manifest(4).await.is_err(), "rank 4 is outside the world");
    // The whole record is gone with those parts: refused, naming the missing part.
    let e = StepReader::open(&store, "split", 1).await.unwrap_err();
    assert!(e.to_string().contains("/index/"), "{e}");
    assert!(
        !store
            .verify(&VerifyScope::Step("split".into(), 1), None)
            .await
            .unwrap()
            .is_clean()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_record_part_is_refused_and_gc_deletes_the_parts() {
    let (store, _dir) = local_store(split_config());
    let want = save_split(&store, 1, 2, 10).await;
    store.log().commit_step("split", 1).await.unwrap();
    let (root, _, _) = store.log().read_commit_root("split", 1).await.unwrap();
    let first = root.index.unwrap().parts[0].clone();
    let key = store.keys().record_part("split", 1, &first.hash());
    let orig = store.objects().get_object(&key).await.unwrap().to_vec();
    // A flipped bit anywhere in a part: refused as damage naming the part, by every reader.
    for o in offsets(&orig, &["\"t0_0"]) {
        let mut bad = orig.clone();
        bad[o] ^= 4;
        put(&store, &key, bad).await;
        let e = StepReader::open(&store, "split", 1).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(e.to_string().contains(key.as_ref()), "{e}");
        let e = StepReader::open_tensors(&store, "split", 1, ["t0_00"])
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    }
    put(&store, &key, orig).await;
    assert_eq!(
        StepReader::open_tensors(&store, "split", 1, ["t0_00"])
            .await
            .unwrap()
            .read_tensor("t0_00")
            .await
            .unwrap(),
        want["t0_00"]
    );

    // A committer that dies between its parts and its root leaves no step: the parts are
    // there, no record names them; a second committer commits; GC of the abandoned step 2
    // (past its grace) deletes its parts with its manifests.
    save_split(&store, 2, 2, 10).await;
    store.failpoints().set(
        "after_record_parts",
        ckpt_store::failpoint::FailAction::Error,
    );
    assert!(store.log().commit_step("split", 2).await.is_err());
    store.failpoints().clear();
    assert!(!part_keys(&store, 2).await.is_empty());
    assert_eq!(store.log().committed_steps("split").await.unwrap(), vec![1]);
    save_split(&store, 3, 2, 10).await;
    store.failpoints().set(
        "after_record_parts",
        ckpt_store::failpoint::FailAction::Error,
    );
    assert!(store.log().commit_step("split", 3).await.is_err());
    store.failpoints().clear();
    store.log().commit_step("split", 3).await.unwrap();
    assert_eq!(
        store.log().committed_steps("split").await.unwrap(),
        vec![1, 3]
    );
    let later = ckpt_store::clock::system_now() + chrono::Duration::hours(2);
    let opts = ckpt_store::GcOptions {
        keep_last: Some(1),
        grace: std::time::Duration::from_secs(60),
        ..Default::default()
    };
    let report = store.gc().run(&opts, later).await.unwrap();
    assert_eq!(report.incomplete_deleted, vec![("split".to_string(), 2)]);
    assert_eq!(store.log().committed_steps("split").await.unwrap(), vec![3]);
    assert!(
        part_keys(&store, 1).await.is_empty(),
        "dropped step 1's parts"
    );
    assert!(
        part_keys(&store, 2).await.is_empty(),
        "abandoned step 2's parts"
    );
    assert!(!part_keys(&store, 3).await.is_empty());
    let r = StepReader::open(&store, "split", 3).await.unwrap();
    assert_eq!(r.commit().tensors.len(), 20);
    assert!(
        store
            .verify(&VerifyScope::Run("split".into()), None)
            .await
            .unwrap()
            .is_clean()
    );
}
