//! The persist-and-commit task of one save: take a writer lease and the dedup base, stream the
//! snapshot's chunks into the store (and to a replica agent), write the rank manifest, and
//! (on the committer) commit the step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ckpt_recovery::peer::{Handed, PeerUpload};
use ckpt_store::{
    BlobIn, ChunkId, DedupBase, DedupIndex, Error, ErrorKind, Hash, RankManifest, RankWrite,
    Result, ShardMeta, Store, WriterLease,
};
use parking_lot::Mutex;
use tracing::{debug, info, warn};

use super::config::CheckpointerConfig;
use super::handle::{SaveFailure, ShardDigest, Shared, Stage};
use super::rate::{Pacer, PersistRate};
use super::versions::{ShardKey, StepVersions, VersionBook};
use crate::memory::SourceVersion;
use crate::staging::StagingPool;

/// Everything the persist task of one save needs; [`PersistJob::run`] runs it.
pub(super) struct PersistJob {
    pub store: Store,
    pub cfg: CheckpointerConfig,
    pub dedup: Arc<Mutex<DedupBase>>,
    pub versions: Arc<Mutex<VersionBook>>,
    /// Per shard of `metas`: its version in this save.
    pub shard_versions: Vec<Option<SourceVersion>>,
    /// The committed step whose chunks the shards with `reuse` reference.
    pub reuse_from: Option<u64>,
    pub writer: String,
    pub pool: Arc<StagingPool>,
    pub fenced: Arc<Mutex<Option<String>>>,
    pub shared: Arc<Shared>,
    pub step: u64,
    pub t0: Instant,
    pub metas: Vec<ShardMeta>,
    pub blobs: Vec<BlobIn>,
    /// The snapshot's chunks, in order.
    pub rx: tokio::sync::mpsc::UnboundedReceiver<Result<Bytes>>,
    /// Fires once the snapshot is done or must wait for staging; the persist starts only then
    /// (`None`: at once).
    pub start_after: Option<tokio::sync::oneshot::Receiver<()>>,
    /// The rate limit the chunks are paced by (none while the snapshot is still copying and
    /// the loop may wait for it: `Shared::unpaced`).
    pub rate: Arc<PersistRate>,
}

impl PersistJob {
    /// Persist, then commit (committer only); the outcome goes to the save's stage.
    pub async fn run(self) {
        let step = self.step;
        let rank = self.cfg.rank;
        let shared = self.shared.clone();
        let fenced = self.fenced.clone();
        let committer = self.cfg.committer;
        let store = self.store.clone();
        let cfg = self.cfg.clone();
        let fail = |e: Error| {
            note_fenced(&fenced, &e);
            shared.set(Stage::Failed(SaveFailure::from(&e)), |_| {});
        };
        match self.persist().await {
            Err(e) => {
                warn!(step, rank, "checkpoint failed: {e}");
                fail(e);
            }
            Ok(()) if committer => {
                if let Err(e) = commit(&store, &cfg, step, &shared).await {
                    warn!(step, "commit failed: {e}");
                    fail(e);
                }
            }
            Ok(()) => {}
        }
    }

    /// Chunks and the rank manifest into the store; the stage becomes `Persisted`.
    async fn persist(mut self) -> Result<()> {
        if let Some(go) = self.start_after.take() {
            let _ = go.await;
        }
        let (store, cfg, step) = (&self.store, &self.cfg, self.step);
        // The node commit is keyed by the node's lowest rank.
        let node_first = cfg
            .node_ranks
            .as_ref()
            .and_then(|r| r.iter().min().copied());
        let (index, lease) =
            prepare_index(store, &cfg.run, &self.writer, node_first, &self.dedup).await?;
        if let Err(e) = check_reuse(
            store,
            &cfg.run,
            &mut self.metas,
            &index,
            &lease,
            self.reuse_from,
        )
        .await
        {
            let _ = store.gc().release_lease(lease).await;
            // Start afresh: the next save copies every shard.
            self.versions.lock().clear();
            return Err(e);
        }
        // Every chunk goes to the replica agent too, as the store takes it.
        let upload = cfg
            .peer
            .as_ref()
            .map(|l| Arc::new(PeerUpload::start(l, cfg.generation, cfg.rank, step, 8)));
        let shared = self.shared.clone();
        let pacer = Pacer::new(self.rate.clone(), Box::new(move || shared.unpaced()));
        let hashed_only = replica_checks(store, &self.metas);
        let chunks = chunk_stream(
            self.rx,
            upload.clone(),
            hashed_only,
            store.config().pack_threshold,
            pacer,
        );
        // Which shards are taken unchanged (their chunks are not in the stream: the agent
        // takes them from the snapshot before, which it holds).
        let reused: Vec<(String, bool)> = self
            .metas
            .iter()
            .map(|m| (m.shard.name.clone(), m.reuse.is_some()))
            .collect();
        let w = RankWrite {
            run: cfg.run.clone(),
            step,
            rank: cfg.rank,
            layout: cfg.layout,
            generation: cfg.generation,
            node: cfg.node,
        };
        let res = store
            .write_rank_stream(&w, self.metas, self.blobs, chunks, &index)
            .await;
        // Written (the manifest now protects what it references) or failed: no lease
        // needed any more.
        if let Err(e) = store.gc().release_lease(lease).await {
            debug!(step, "dedup lease not released (GC lets it lapse): {e}");
        }
        let (manifest, _entry, stats) = res?;
        let persisted = self.t0.elapsed().as_secs_f64();
        let peak = self.pool.stats().peak_in_use;
        let (ids, held) = match upload {
            Some(_) => replica_ids(&manifest, &reused),
            None => Default::default(),
        };
        self.dedup.lock().persisted_manifest(&manifest);
        self.versions
            .lock()
            .persisted(record_versions(step, &manifest, &self.shard_versions));
        let written = Arc::new(shard_digests(&manifest));
        self.shared.set(Stage::Persisted, |r| {
            r.persist_s = persisted;
            r.bytes_written = stats.bytes_written;
            r.bytes_skipped = stats.bytes_skipped;
            r.staging_peak = peak;
            r.written = written;
        });
        if let Some(u) = upload {
            match u.finish(ids, held).await {
                Ok(Handed { bytes, missing: 0 }) => {
                    debug!(step, bytes, "snapshot handed to the replica agent");
                }
                Ok(Handed { missing, .. }) => {
                    warn!(
                        step,
                        missing,
                        "the replica agent lacks chunks of unchanged shards (it restarted?): \
                         its copy is partial, and the next save sends every shard"
                    );
                    self.versions.lock().clear();
                }
                Err(e) => warn!(step, "peer replica not made (the store has it): {e}"),
            }
        }
        Ok(())
    }
}

/// Under the writer lease, before the manifest references them: the chunks of every shard
/// taken unchanged (`reuse`) must be protected by a committed step, the lease's dedup base (the
/// refs are then taken from it) or the step they were found in, `from`, whose commit must
/// still exist. Otherwise (retention dropped `from` since `save` was called) the save fails
/// with [`ErrorKind::Conflict`] naming the shard and the step: its bytes were not copied.
async fn check_reuse(
    store: &Store,
    run: &str,
    metas: &mut [ShardMeta],
    index: &DedupIndex,
    lease: &WriterLease,
    from: Option<u64>,
) -> Result<()> {
    let mut missing = None;
    for m in metas.iter_mut() {
        for r in m.reuse.iter_mut().flatten() {
            match index.get(&r.id) {
                Some(known) => *r = known,
                None => missing = missing.or(Some(m.shard.name.clone())),
            }
        }
    }
    let (Some(name), Some(from)) = (missing, from) else {
        return Ok(());
    };
    if lease.base() != Some(from)
        && store
            .objects()
            .exists(&store.keys().commit(run, from))
            .await?
    {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Conflict,
        format!(
            "tensor {name:?} is unchanged since step {from}, whose chunks this save was to \
             reference, but step {from} is no longer committed (retention or `ckpt gc` dropped \
             it as the save started); the next save copies every tensor"
        ),
    ))
}

/// Every shard `manifest` wrote, with the digest of its chunk ids.
fn shard_digests(manifest: &RankManifest) -> Vec<ShardDigest> {
    manifest
        .tensors
        .iter()
        .filter(|t| t.replica_of.is_none())
        .map(|t| {
            let mut h = blake3::Hasher::new();
            for c in &t.chunks {
                h.update(&c.id.0.0);
            }
            ShardDigest {
                name: t.name.clone(),
                bbox: t.bbox.clone(),
                bytes: t.byte_len(),
                digest: Hash(*h.finalize().as_bytes()),
            }
        })
        .collect()
}

/// The version and chunks of every shard of `manifest` that has a version.
fn record_versions(
    step: u64,
    manifest: &RankManifest,
    versions: &[Option<SourceVersion>],
) -> StepVersions {
    let shards = manifest
        .tensors
        .iter()
        .zip(versions)
        .filter(|(t, _)| t.replica_of.is_none())
        .filter_map(|(t, v)| {
            let key = ShardKey::new(&t.name, t.dtype, &t.shape, &t.bbox);
            Some((key, ((*v)?, t.chunks.clone())))
        })
        .collect();
    StepVersions { step, shards }
}

/// The snapshot's chunks as the store takes them, each handed to the replica agent too, at
/// the pace of `pacer` (the persist's rate limit).
///
/// A chunk small enough to go into a pack is copied out of its slab: a pack is written only
/// once it is full, and a slab pinned by a pack that waits for more chunks would wait for the
/// snapshot that waits for the slab.
fn chunk_stream(
    rx: tokio::sync::mpsc::UnboundedReceiver<Result<Bytes>>,
    upload: Option<Arc<PeerUpload>>,
    hashed_only: std::collections::BTreeSet<usize>,
    small: usize,
    pacer: Pacer,
) -> impl futures::Stream<Item = Result<Bytes>> + Send {
    futures::stream::unfold(
        (rx, upload, pacer, 0usize),
        move |(mut rx, up, mut pacer, k)| {
            let written = !hashed_only.contains(&k);
            async move {
                let x = rx.recv().await?;
                if let Ok(b) = &x {
                    pacer.admit(b.len()).await;
                }
                let x = match x {
                    Ok(b) if b.len() < small => Ok(Bytes::copy_from_slice(&b)),
                    x => x,
                };
                // A replica's chunk hashed for the sentinel is not the rank's to keep.
                if let (Some(u), Ok(b), true) = (&up, &x, written) {
                    u.chunk(b.clone()).await;
                }
                Some((x, (rx, up, pacer, k + 1)))
            }
        },
    )
}

/// The ids a replica agent is given of a save's manifest: those of the chunks the stream
/// brought, in order, and those of shards taken unchanged (`reused`, per shard in the
/// manifest's order), which the agent holds from the snapshot before.
fn replica_ids(manifest: &RankManifest, reused: &[(String, bool)]) -> (Vec<ChunkId>, Vec<ChunkId>) {
    let (mut sent, mut held) = (Vec::new(), Vec::new());
    let lined_up = manifest.tensors.len() == reused.len()
        && manifest
            .tensors
            .iter()
            .zip(reused)
            .all(|(t, (n, _))| &t.name == n);
    for (k, t) in manifest.tensors.iter().enumerate() {
        let to = if lined_up && reused[k].1 {
            &mut held
        } else {
            &mut sent
        };
        to.extend(t.chunks.iter().map(|r| r.id));
    }
    (sent, held)
}

/// The places in a save's chunk stream of the replica chunks it brings to be hashed (the
/// sentinel), not written: every shard's chunks come in order, a replica's checked ones at its
/// place.
fn replica_checks(store: &Store, metas: &[ShardMeta]) -> std::collections::BTreeSet<usize> {
    let mut out = std::collections::BTreeSet::new();
    let mut k = 0usize;
    for m in metas {
        if m.reuse.is_some() {
            continue;
        }
        if m.shard.replica_of.is_none() {
            k += store.chunk_spans(m.byte_len()).count();
        } else {
            for _ in &m.check {
                out.insert(k);
                k += 1;
            }
        }
    }
    out
}

/// How often a committer waiting for the manifests of `ranks` ranks looks for them, at most.
/// A local store of a node's few ranks answers a poll (a listing, a read of one manifest and
/// of the fence) from its own disk in a fraction of a millisecond, so it looks often and the
/// commit follows the last manifest closely (at 50 ms the wait after the last manifest was a
/// twentieth of a local tier's whole save). An object store, or a local path with many ranks
/// (a shared file system mounted on every node, whose listing of the step grows with them),
/// is asked less often.
fn commit_poll(store: &Store, ranks: usize) -> Duration {
    if store.local_root().is_some() && ranks <= 64 {
        Duration::from_millis(10)
    } else {
        Duration::from_millis(50)
    }
}

/// Wait for every rank's manifest of `step` and create the commit record; the stage becomes
/// `Committed`.
async fn commit(store: &Store, cfg: &CheckpointerConfig, step: u64, shared: &Shared) -> Result<()> {
    let t1 = Instant::now();
    if let Some(ranks) = &cfg.node_ranks {
        // One node of several: its ranks commit on the node; the drains commit the step.
        let c = store
            .log()
            .commit_node(
                &cfg.run,
                step,
                cfg.generation,
                ranks,
                (commit_poll(store, ranks.len()), cfg.commit_timeout),
            )
            .await?;
        let secs = t1.elapsed().as_secs_f64();
        info!(run = %cfg.run, step, ranks = ?c.rank_numbers(), "checkpoint committed on this node");
        shared.set(Stage::Committed, |r| r.commit_s = secs);
        return Ok(());
    }
    let o = store
        .log()
        .wait_and_commit_as(
            &cfg.run,
            step,
            Some(cfg.generation),
            commit_poll(store, cfg.layout.world() as usize),
            cfg.commit_timeout,
        )
        .await?;
    let c = t1.elapsed().as_secs_f64();
    info!(
        run = %cfg.run,
        step,
        bytes = o.record().logical_bytes(),
        "checkpoint committed"
    );
    let replicas = o.record().replicas.clone();
    shared.set(Stage::Committed, |r| {
        r.commit_s = c;
        r.replicas = replicas;
    });
    Ok(())
}

/// Remember `e` if it is a fence (the first one wins).
pub(super) fn note_fenced(fenced: &Mutex<Option<String>>, e: &Error) {
    if e.kind() == ErrorKind::Fenced {
        fenced.lock().get_or_insert_with(|| e.to_string());
    }
}

/// Before a persist: take a writer lease (no GC sweep runs until this save's manifest is
/// written) and pick the step this save deduplicates against (see [`ckpt_store::lease`]). The
/// previous save becomes the base only once its commit record is found; until then (or if that
/// commit failed) the base stays the older committed step, and with neither committed the save
/// skips nothing. A step whose commit failed is never a base: GC may sweep it with its chunks.
/// One node of several (`node_first`, its first rank) saves into its local tier, where the
/// step's record is the node's commit.
async fn prepare_index(
    store: &Store,
    run: &str,
    writer: &str,
    node_first: Option<u32>,
    dedup: &Mutex<DedupBase>,
) -> Result<(DedupIndex, WriterLease)> {
    let candidates = dedup.lock().candidates();
    let gc = store.gc();
    let lease = match node_first {
        Some(first) => {
            gc.lease_node_dedup_base(run, writer, first, &candidates)
                .await?
        }
        None => gc.lease_dedup_base(run, writer, &candidates).await?,
    };
    let index = dedup.lock().pinned(lease.base());
    Ok((index, lease))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_committer_polls_a_local_store_of_few_ranks_often_and_anything_else_less() {
        let dir = tempfile::tempdir().unwrap();
        let local = ckpt_store::open(dir.path().to_str().unwrap()).unwrap();
        let memory = ckpt_store::open("memory://").unwrap();
        assert!(local.local_root().is_some() && memory.local_root().is_none());
        assert_eq!(commit_poll(&local, 2), Duration::from_millis(10));
        assert_eq!(commit_poll(&local, 64), Duration::from_millis(10));
        // A local path many nodes share: its listing grows with the ranks.
        assert_eq!(commit_poll(&local, 65), Duration::from_millis(50));
        assert_eq!(commit_poll(&memory, 2), Duration::from_millis(50));
    }
}
