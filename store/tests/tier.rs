//! Draining a local tier to a remote store (issue 28), on a local directory under the memory
//! store, the real S3-compatible server and another directory: only what the remote lacks is
//! sent, the remote commit restores bit-exact, a damaged local chunk is never sent, a newer
//! generation on the remote fences the drain, and the drain marker keeps the step from the
//! local tier's GC until the drain is done.

use bytes::Bytes;
use ckpt_store::testing::{S3Server, det_bytes, local_store, memory_store, tiny_config};
use ckpt_store::writer::{BlobIn, RankWrite, ShardDesc, ShardIn};
use ckpt_store::{
    DType, DedupIndex, DrainOptions, ErrorKind, GcOptions, Layout, NdBox, StepReader, Store,
    TierSource, drain_node, drain_step,
};

enum Remote {
    Memory(Store),
    Dir(Store, #[allow(dead_code)] tempfile::TempDir),
    S3(Store, #[allow(dead_code)] S3Server),
}

impl Remote {
    fn store(&self) -> &Store {
        match self {
            Remote::Memory(s) | Remote::Dir(s, _) | Remote::S3(s, _) => s,
        }
    }
}

macro_rules! on_remotes {
    ($($case:ident),* $(,)?) => {
        mod to_memory { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { super::$case(super::Remote::Memory(ckpt_store::testing::memory_store(ckpt_store::testing::tiny_config()))).await } )* }
        mod to_dir { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { let (s, d) = ckpt_store::testing::local_store(ckpt_store::testing::tiny_config()); super::$case(super::Remote::Dir(s, d)).await } )* }
        mod to_s3 { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { ckpt_store::require!(ckpt_store::testing::Need::S3Server, concat!(stringify!($case), " to S3")); let srv = ckpt_store::testing::S3Server::start(); let s = srv.store("tier", ckpt_store::testing::tiny_config()); super::$case(super::Remote::S3(s, srv)).await } )* }
    };
}

on_remotes!(
    a_drain_sends_only_what_the_remote_lacks_and_the_remote_restores_bit_exact,
    a_damaged_local_chunk_is_never_sent,
    a_newer_generation_on_the_remote_fences_the_drain,
    a_step_still_draining_is_kept_by_the_local_tiers_gc,
    two_machines_commit_their_ranks_locally_and_the_last_drain_commits_the_step,
);

const RUN: &str = "t";

/// Save `step` of two ranks into `local` (`w` changes with the step, `b` does not) and
/// commit it as `generation`; the bytes of `w`.
async fn save(local: &Store, step: u64, generation: u64) -> Vec<u8> {
    let w = write_ranks(local, step, generation, &[0, 1]).await;
    local
        .log()
        .commit_step_as(RUN, step, Some(generation))
        .await
        .unwrap();
    w
}

/// Write `ranks` (of two) of `step` into `local` as `generation`, uncommitted; the bytes of
/// the whole `w`.
async fn write_ranks(local: &Store, step: u64, generation: u64, ranks: &[u32]) -> Vec<u8> {
    let layout = Layout::new(2, 1, 1, 0).unwrap();
    let w = det_bytes(step, 40_000);
    let b = det_bytes(999, 40_000);
    local.log().join_generation(RUN, generation).await.unwrap();
    for &rank in ranks {
        let half = NdBox::new(vec![u64::from(rank) * 20_000], vec![20_000]).unwrap();
        let shard = |name: &str, data: &[u8]| ShardIn {
            shard: ShardDesc::boxed(name, DType::U8, vec![40_000], half.clone()),
            data: Some(Bytes::copy_from_slice(
                &data[rank as usize * 20_000..(rank as usize + 1) * 20_000],
            )),
        };
        let wr = RankWrite {
            generation,
            ..RankWrite::new(RUN, step, rank, layout)
        };
        local
            .write_rank(
                &wr,
                vec![shard("w", &w), shard("b", &b)],
                vec![],
                &DedupIndex::new(),
            )
            .await
            .unwrap();
    }
    w
}

async fn a_drain_sends_only_what_the_remote_lacks_and_the_remote_restores_bit_exact(r: Remote) {
    let remote = r.store();
    let (local, _d) = local_store(tiny_config());
    let w1 = save(&local, 1, 0).await;
    let rep = drain_step(&local, remote, RUN, 1, &DrainOptions::default())
        .await
        .unwrap();
    assert!(!rep.already_remote);
    assert_eq!(rep.manifests, 2);
    assert!(rep.objects_sent > 0 && rep.objects_present == 0, "{rep:?}");
    let first_sent = rep.bytes_sent;
    assert!(
        local.log().pending_drains(RUN).await.unwrap().is_empty(),
        "marker left"
    );
    let reader = StepReader::open(remote, RUN, 1).await.unwrap();
    assert_eq!(reader.read("w", &NdBox::full(&[40_000])).await.unwrap(), w1);
    // Step 2 changed `w` only: `b`'s chunks are on the remote already.
    let w2 = save(&local, 2, 0).await;
    let rep = drain_step(&local, remote, RUN, 2, &DrainOptions::default())
        .await
        .unwrap();
    assert!(rep.objects_present > 0, "{rep:?}");
    assert!(
        rep.bytes_sent < first_sent * 3 / 4,
        "sent {} of a first drain's {first_sent}",
        rep.bytes_sent
    );
    let reader = StepReader::open(remote, RUN, 2).await.unwrap();
    assert_eq!(reader.read("w", &NdBox::full(&[40_000])).await.unwrap(), w2);
    // The remote commit is the same record as the local one (same manifests, same bytes).
    let (lr, _) = local.log().read_commit(RUN, 2).await.unwrap();
    let (rr, _) = remote.log().read_commit(RUN, 2).await.unwrap();
    assert_eq!(lr.ranks, rr.ranks);
    // Again: nothing to do.
    let again = drain_step(&local, remote, RUN, 2, &DrainOptions::default())
        .await
        .unwrap();
    assert!(again.already_remote && again.bytes_sent == 0);
    // Verify is clean on both tiers.
    for s in [&local, remote] {
        let v = s
            .verify(&ckpt_store::VerifyScope::Run(RUN.into()), None)
            .await
            .unwrap();
        assert!(v.is_clean(), "{v:?}");
    }
}

async fn a_damaged_local_chunk_is_never_sent(r: Remote) {
    let remote = r.store();
    let (local, dir) = local_store(tiny_config());
    save(&local, 1, 0).await;
    // Damage one chunk object of the local tier (a byte of its payload).
    let refs = local.log().step_chunk_refs(RUN, 1).await.unwrap();
    let c = refs
        .iter()
        .find(|c| local.keys().object_of(c).as_ref().starts_with("chunks/"))
        .expect("a chunk object");
    let obj = remote.keys().object_of(c);
    let file = dir.path().join(local.keys().object_of(c).as_ref());
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0xff;
    std::fs::write(&file, bytes).unwrap();
    let e = drain_step(&local, remote, RUN, 1, &DrainOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("not sent"), "{e}");
    assert!(
        !remote
            .objects()
            .exists(&remote.keys().commit(RUN, 1))
            .await
            .unwrap()
    );
    assert!(
        !remote.objects().exists(&obj).await.unwrap(),
        "the damaged object was sent"
    );
    // The marker stays: the step is still to drain (from a repaired copy).
    assert_eq!(local.log().pending_drains(RUN).await.unwrap()[0].step, 1);
}

async fn a_newer_generation_on_the_remote_fences_the_drain(r: Remote) {
    let remote = r.store();
    let local = memory_store(tiny_config());
    save(&local, 1, 3).await;
    // Another job took the run over on the remote.
    remote.log().start_generation(RUN, 5).await.unwrap();
    let e = drain_step(&local, remote, RUN, 1, &DrainOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    assert!(
        !remote
            .objects()
            .exists(&remote.keys().commit(RUN, 1))
            .await
            .unwrap()
    );
}

async fn a_step_still_draining_is_kept_by_the_local_tiers_gc(r: Remote) {
    let remote = r.store();
    let local = memory_store(tiny_config());
    for s in 1..=3 {
        save(&local, s, 0).await;
    }
    // Step 1 is draining (its marker), 2 and 3 not yet: keep-last 1 keeps 3, and 1 for its
    // drain.
    let marker = ckpt_store::DrainMarker {
        run: RUN.into(),
        step: 1,
        remote: remote.url().into(),
        ..Default::default()
    };
    local.log().put_drain_marker(&marker).await.unwrap();
    let opts = GcOptions {
        keep_last: Some(1),
        grace: std::time::Duration::ZERO,
        lease_lapse: std::time::Duration::ZERO,
        ..GcOptions::default()
    };
    let rep = local.gc().run(&opts, local.now()).await.unwrap();
    assert_eq!(rep.steps_deleted, vec![(RUN.to_string(), 2)], "{rep:?}");
    drain_step(&local, remote, RUN, 1, &DrainOptions::default())
        .await
        .unwrap();
    let rep = local.gc().run(&opts, local.now()).await.unwrap();
    assert_eq!(rep.steps_deleted, vec![(RUN.to_string(), 1)], "{rep:?}");
    // Drained: it restores from the remote.
    StepReader::open(remote, RUN, 1).await.unwrap();
}

/// A job of two machines, each with its own local tier holding one rank: each node commits
/// its rank there (local-durable, not a restorable step), drains it, and the drain that lands
/// the last rank commits the step on the remote, which restores bit-exact. The node commit
/// keeps the rank's manifest and chunks from the tier's GC, and retention counts it.
async fn two_machines_commit_their_ranks_locally_and_the_last_drain_commits_the_step(r: Remote) {
    let remote = r.store();
    let (a, _da) = local_store(tiny_config());
    let (b, _db) = local_store(tiny_config());
    let wait = (
        std::time::Duration::from_millis(10),
        std::time::Duration::from_millis(200),
    );
    let w1 = write_ranks(&a, 1, 2, &[0]).await;
    write_ranks(&b, 1, 2, &[1]).await;
    // A node commit waits for its own ranks only; a rank not in its tier times it out.
    let e = a
        .log()
        .commit_node(RUN, 1, 2, &[0, 1], wait)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Incomplete, "{e}");
    assert!(e.to_string().contains("[1]"), "{e}");
    let ca = a.log().commit_node(RUN, 1, 2, &[0], wait).await.unwrap();
    assert_eq!(
        (ca.rank_numbers(), ca.world, ca.generation),
        (vec![0], 2, 2)
    );
    b.log().commit_node(RUN, 1, 2, &[1], wait).await.unwrap();
    // Local-durable on each node, yet no tier can commit the step or open it.
    for t in [&a, &b] {
        assert_eq!(t.log().node_committed_steps(RUN).await.unwrap(), vec![1]);
        assert!(t.log().committed_steps(RUN).await.unwrap().is_empty());
        assert!(t.log().commit_step_as(RUN, 1, Some(2)).await.is_err());
    }
    // Nothing ages a node commit out: a sweep with no grace keeps its manifest and chunks.
    let sweep = GcOptions {
        grace: std::time::Duration::ZERO,
        lease_lapse: std::time::Duration::ZERO,
        ..GcOptions::default()
    };
    let rep = a
        .gc()
        .run(&sweep, a.now() + chrono::Duration::hours(1))
        .await
        .unwrap();
    assert!(
        rep.incomplete_deleted.is_empty() && rep.objects_deleted == 0,
        "{rep:?}"
    );
    // The first node drains: its rank is on the remote, the step is not committed there.
    let ra = drain_node(&a, remote, RUN, 1, &DrainOptions::default())
        .await
        .unwrap();
    assert!(
        !ra.remote_committed && ra.manifests == 1 && ra.objects_sent > 0,
        "{ra:?}"
    );
    assert!(
        a.log().pending_drains(RUN).await.unwrap().is_empty(),
        "marker left"
    );
    assert!(StepReader::open(remote, RUN, 1).await.is_err());
    // The second lands the last rank and commits the step.
    let rb = drain_node(&b, remote, RUN, 1, &DrainOptions::default())
        .await
        .unwrap();
    assert!(rb.remote_committed && rb.manifests == 1, "{rb:?}");
    let reader = StepReader::open(remote, RUN, 1).await.unwrap();
    assert_eq!(reader.read("w", &NdBox::full(&[40_000])).await.unwrap(), w1);
    let (rec, _) = remote.log().read_commit(RUN, 1).await.unwrap();
    assert_eq!(rec.generation, 2);
    let v = remote
        .verify(&ckpt_store::VerifyScope::Run(RUN.into()), None)
        .await
        .unwrap();
    assert!(v.is_clean(), "{v:?}");
    // Draining again: nothing to do.
    let again = drain_node(&a, remote, RUN, 1, &DrainOptions::default())
        .await
        .unwrap();
    assert!(again.already_remote && again.bytes_sent == 0, "{again:?}");
    // Step 2 changed `w` only: node A sends just its new chunks.
    write_ranks(&a, 2, 2, &[0]).await;
    a.log().commit_node(RUN, 2, 2, &[0], wait).await.unwrap();
    let ra2 = drain_node(&a, remote, RUN, 2, &DrainOptions::default())
        .await
        .unwrap();
    assert!(
        ra2.objects_present > 0 && ra2.bytes_sent < ra.bytes_sent,
        "{ra2:?} after {ra:?}"
    );
    // Retention counts node commits: keep-last 1 retires step 1 from A's tier, and the GC
    // then deletes its manifest; step 2's stays.
    let keep1 = GcOptions {
        keep_last: Some(1),
        ..sweep
    };
    let rep = a.gc().run(&keep1, a.now()).await.unwrap();
    assert_eq!(rep.steps_deleted, vec![(RUN.to_string(), 1)], "{rep:?}");
    assert_eq!(a.log().node_committed_steps(RUN).await.unwrap(), vec![2]);
    let steps = a.log().list_steps(RUN).await.unwrap();
    assert_eq!(
        steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        vec![2],
        "{steps:?}"
    );
    // A stale generation cannot commit over a newer one's node commit.
    write_ranks(&b, 2, 3, &[1]).await;
    b.log().commit_node(RUN, 2, 3, &[1], wait).await.unwrap();
    let e = b
        .log()
        .commit_node(RUN, 2, 2, &[1], wait)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    // Nodes that share a tier (a shared file system) keep their node commits apart, and a
    // drain of that tier sends both: the step commits at once.
    let (c, dc) = local_store(tiny_config());
    let w3 = write_ranks(&c, 3, 3, &[0, 1]).await;
    c.log().commit_node(RUN, 3, 3, &[0], wait).await.unwrap();
    c.log().commit_node(RUN, 3, 3, &[1], wait).await.unwrap();
    let both = c.log().read_node_commits(RUN, 3).await.unwrap();
    let ranks: Vec<Vec<u32>> = both.iter().map(|c| c.rank_numbers()).collect();
    assert_eq!(ranks, vec![vec![0], vec![1]]);
    let rc = drain_node(&c, remote, RUN, 3, &DrainOptions::default())
        .await
        .unwrap();
    assert!(rc.remote_committed && rc.manifests == 2, "{rc:?}");
    let reader = StepReader::open(remote, RUN, 3).await.unwrap();
    assert_eq!(reader.read("w", &NdBox::full(&[40_000])).await.unwrap(), w3);
    // `verify` checks what a node's tier holds: its node commits, their manifests and chunks.
    let scope = ckpt_store::VerifyScope::Run(RUN.into());
    let v = c.verify(&scope, None).await.unwrap();
    assert!(v.is_clean() && v.steps == 1 && v.chunks > 0, "{v:?}");
    let m = c.log().node_commit_manifests(&both[1]).await.unwrap();
    let chunk = m[0].chunk_refs().next().unwrap().clone();
    let file = dc.path().join(c.keys().object_of(&chunk).as_ref());
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let v = c.verify(&scope, None).await.unwrap();
    assert!(
        !v.is_clean(),
        "a damaged chunk of a node-committed step went unseen"
    );
    let hit = &v.damaged[0];
    assert!(
        hit.affects
            .iter()
            .any(|a| a.step == 3 && a.item.starts_with("tensor ")),
        "{hit:?}"
    );
}

/// Two committers of one node's ranks of a step, of generations 2 (stale: it read the node
/// commit, then stalled) and 3 (it ran meanwhile), and again 4 and 5: the stale one's write, made only over what
/// it read, fails, and the read after it fences it. The newer generation's node commit stays,
/// whether the stale one read an older record (a dead attempt's) or none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_node_commit_never_replaces_a_newer_generations() {
    let (fresh, dir) = local_store(tiny_config());
    let fp = ckpt_store::Failpoints::new();
    let stalls = std::time::Duration::from_millis(3000);
    fp.set("before_node_commit", ckpt_store::FailAction::Sleep(stalls));
    let stale = ckpt_store::url::open(dir.path().to_str().unwrap())
        .unwrap()
        .with_config(tiny_config())
        .unwrap()
        .with_failpoints(fp.clone());
    let wait = (
        std::time::Duration::from_millis(10),
        std::time::Duration::from_millis(500),
    );
    // Step 5 has a dead attempt's node commit (generation 1) that both committers read;
    // step 6 has none (generations 4 and 5 race there).
    write_ranks(&fresh, 5, 1, &[0]).await;
    fresh
        .log()
        .commit_node(RUN, 5, 1, &[0], wait)
        .await
        .unwrap();
    for (step, old, new) in [(5, 2, 3), (6, 4, 5)] {
        write_ranks(&fresh, step, old, &[0]).await;
        let hits = fp.hits("before_node_commit");
        let s = stale.clone();
        let late =
            tokio::spawn(async move { s.log().commit_node(RUN, step, old, &[0], wait).await });
        while fp.hits("before_node_commit") == hits {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // The newer generation saves and commits the step on this node while the old stalls.
        write_ranks(&fresh, step, new, &[0]).await;
        let newer = fresh
            .log()
            .commit_node(RUN, step, new, &[0], wait)
            .await
            .unwrap();
        assert_eq!(newer.generation, new);
        let e = late.await.unwrap().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Fenced, "step {step}: {e}");
        let held = fresh.log().read_node_commits(RUN, step).await.unwrap();
        assert_eq!(
            held,
            vec![newer],
            "step {step}: the stale commit replaced the newer one"
        );
        // What it pins is what the tier holds: the drain can send it.
        fresh.log().node_commit_manifests(&held[0]).await.unwrap();
    }
}

/// A blob reads as a tensor does under a local tier: from the machine's tier first (a
/// [`TierSource`] in front of the remote store), from the remote where the tier holds it
/// damaged (the source, or the local reader's fallback). `ckpt.dcp` keeps DCP's metadata in a
/// blob; before, a blob was read from the reader's own store only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_is_read_from_the_tier_first_and_from_the_remote_where_it_is_damaged() {
    let (local, dir) = local_store(tiny_config());
    let (remote, rdir) = local_store(tiny_config());
    let meta = det_bytes(7, 9_000); // chunk objects, not packed
    let layout = Layout::new(1, 1, 1, 0).unwrap();
    let wr = RankWrite::new(RUN, 1, 0, layout);
    let blob = BlobIn {
        name: "meta".into(),
        data: Bytes::from(meta.clone()),
    };
    local
        .write_rank(&wr, vec![], vec![blob], &DedupIndex::new())
        .await
        .unwrap();
    local.log().commit_step_as(RUN, 1, Some(0)).await.unwrap();
    drain_step(&local, &remote, RUN, 1, &DrainOptions::default())
        .await
        .unwrap();
    let refs = local.log().step_chunk_refs(RUN, 1).await.unwrap();
    let files: Vec<_> = refs
        .iter()
        .map(|c| local.keys().object_of(c))
        .filter(|o| o.as_ref().starts_with("chunks/"))
        .collect();
    assert!(files.len() >= 2, "{files:?}");
    // The remote's copy of one chunk gone: the tier serves it through the source.
    std::fs::remove_file(rdir.path().join(files[0].as_ref())).unwrap();
    let through_tier = StepReader::open(&remote, RUN, 1)
        .await
        .unwrap()
        .with_source(std::sync::Arc::new(TierSource::new(local.clone())));
    assert_eq!(through_tier.read_blob(0, "meta").await.unwrap(), meta);
    let plain = StepReader::open(&remote, RUN, 1).await.unwrap();
    plain.read_blob(0, "meta").await.unwrap_err();
    // The tier's copy of another chunk damaged: the local reader reads it from its fallback.
    let file = dir.path().join(files[1].as_ref());
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0xff;
    std::fs::write(&file, bytes).unwrap();
    let local_first = StepReader::open(&local, RUN, 1)
        .await
        .unwrap()
        .with_fallback(remote.clone());
    assert_eq!(local_first.read_blob(0, "meta").await.unwrap(), meta);
    // Counted as the fallback's, as a tensor's chunk is: a restore's event names the damage.
    assert_eq!(local_first.blob_stats().fallback_chunks, 1);
    let alone = StepReader::open(&local, RUN, 1).await.unwrap();
    let e = alone.read_blob(0, "meta").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
}
