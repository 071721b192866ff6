//! Tiers (issue 28): a **local tier** (the node's disk) that saves commit to at its speed, and
//! the **remote** store (an object store on a cluster) that a drain copies committed steps to
//! behind the training. Both are ordinary stores in the same content-addressed format: a
//! drain copies the objects a step references that the remote does not hold yet (content
//! addressing makes every drain incremental: only new chunks move), then the step's rank
//! manifests, then commits the step there with the same protocol, fencing and leases as a
//! save ([`CommitLog::commit_step_as`](crate::CommitLog::commit_step_as)).
//!
//! While a step drains, the local tier holds a **drain marker** for it
//! (`runs/<run>/drain/<step>.json`, [`DrainMarker`]): what is being copied where and how far
//! it got. It says "local-durable, not yet remote" to `ckpt ls` and keeps the step from the
//! local tier's retention and `ckpt gc` ([`CommitLog::pending_drains`](crate::CommitLog::pending_drains)); the drain deletes it once
//! the remote commit exists. A marker without a running drain (the process died) is finished
//! by the next drain of the run.
//!
//! [`drain_step`] is the one function that moves a step between tiers; who calls it when is
//! the trainer's business (`ckpt_trainer::manager`).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{StreamExt, TryStreamExt, stream};
use object_store::PutMode;
use object_store::path::Path;
use serde::{Deserialize, Serialize};
use tracing::{debug, info, instrument, warn};

use crate::commit::catalog::StepListing;
use crate::error::{Error, ErrorKind, Result};
use crate::model::{ChunkRef, RankManifest};
use crate::read::ChunkSource;
use crate::store::Store;

/// A step being drained from a local tier to a remote store (its marker in the local tier).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DrainMarker {
    /// Run.
    pub run: String,
    /// Step.
    pub step: u64,
    /// The generation that committed it locally (and commits it remotely).
    pub generation: u64,
    /// The remote store's URL.
    pub remote: String,
    /// Stored bytes of the objects the step references (what a drain from nothing sends).
    pub bytes_total: u64,
    /// Of them, copied or found on the remote already.
    pub bytes_done: u64,
    /// When the drain started (Unix milliseconds).
    pub started_ms: i64,
    /// When this marker was written last.
    pub updated_ms: i64,
}

impl DrainMarker {
    /// The share done, 0 to 1.
    pub fn progress(&self) -> f64 {
        if self.bytes_total == 0 {
            return 0.0;
        }
        (self.bytes_done as f64 / self.bytes_total as f64).min(1.0)
    }
}

/// Paces a drain: awaited with the stored bytes of each object before it is sent (the persist
/// governor's rate, a test's throttle).
pub type DrainPace = Arc<dyn Fn(u64) -> BoxFuture<'static, ()> + Send + Sync>;

/// A pace of at most `bytes_per_s` stored bytes a second, for a drain with no step times to
/// be governed by (`ckpt.dcp`'s, whose writer DCP tells nothing of the training): each object
/// starts once the objects admitted before it have had their time at that rate, so the drain's
/// average stays at the rate whatever its concurrency.
pub fn rate_pace(bytes_per_s: f64) -> DrainPace {
    let next: Arc<parking_lot::Mutex<Option<tokio::time::Instant>>> = Arc::default();
    Arc::new(move |n| {
        let next = next.clone();
        Box::pin(async move {
            let at = {
                let mut g = next.lock();
                let now = tokio::time::Instant::now();
                let start = g.map_or(now, |t| t.max(now));
                *g = Some(start + std::time::Duration::from_secs_f64(n as f64 / bytes_per_s));
                start
            };
            tokio::time::sleep_until(at).await;
        })
    })
}

/// Told a drain's progress after each object: stored bytes done (copied or found on the remote
/// already) and the step's total.
pub type DrainProgress = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// How a drain runs.
#[derive(Clone)]
pub struct DrainOptions {
    /// Objects copied at once.
    pub concurrency: usize,
    /// Awaited before each object is sent, with its stored size.
    pub pace: Option<DrainPace>,
    /// The writer name its remote lease is taken under (one per drainer).
    pub writer: String,
    /// Update the marker's progress every this many bytes.
    pub marker_every: u64,
    /// The drainer's own generation (the job that runs now), if newer than the step's: a
    /// restarted job drains what an earlier generation left local only, fenced by its own
    /// generation, not the step's.
    pub generation: Option<u64>,
    /// Told the progress after each object (`ckpt drain`'s bar).
    pub progress: Option<DrainProgress>,
}

impl Default for DrainOptions {
    fn default() -> Self {
        DrainOptions {
            concurrency: 8,
            pace: None,
            writer: "drain".into(),
            marker_every: 64 << 20,
            generation: None,
            progress: None,
        }
    }
}

impl std::fmt::Debug for DrainOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainOptions")
            .field("concurrency", &self.concurrency)
            .field("writer", &self.writer)
            .finish()
    }
}

/// What a drain did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DrainReport {
    /// Run.
    pub run: String,
    /// Step.
    pub step: u64,
    /// Objects sent to the remote store.
    pub objects_sent: u64,
    /// Their stored bytes.
    pub bytes_sent: u64,
    /// Objects the remote store held already (not sent).
    pub objects_present: u64,
    /// Their stored bytes.
    pub bytes_present: u64,
    /// Rank manifests written remotely.
    pub manifests: u64,
    /// Seconds from start to the remote commit.
    pub seconds: f64,
    /// The step was committed remotely before this drain (nothing to do).
    pub already_remote: bool,
    /// The step is committed remotely now. A node's drain ([`drain_node`]) leaves it false
    /// while other nodes' ranks are not drained yet.
    pub remote_committed: bool,
    /// The sentinel's comparison of the step's replicas, when this drain committed the step
    /// (a node's drain: no node commit compares them, the remote commit does).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<crate::model::ReplicaReport>,
}

/// Check an object's bytes against its key before they leave the local tier: a pack against
/// its hash, a chunk decoded against its id, a delta's structure (its base is another object).
fn check_object(store: &Store, path: &Path, bytes: &[u8]) -> Result<()> {
    let keys = store.keys();
    if let Some(p) = keys.parse_pack(path) {
        let got = crate::id::PackId::of(bytes);
        if got != p {
            return Err(Error::corrupt(format!(
                "{path}: its bytes hash to {}, not {} (damaged)",
                got.short(),
                p.short()
            )));
        }
        return Ok(());
    }
    if keys.parse_delta_chunk(path).is_some() {
        return crate::codec::check_delta_structure(bytes, path).map(|_| ());
    }
    if let Some(id) = keys.parse_chunk(path) {
        return crate::codec::decode_verify(bytes, &id, path).map(|_| ());
    }
    Err(Error::internal(format!(
        "{path} is neither a chunk nor a pack object"
    )))
}

/// The objects (chunks, packs, delta chains) the manifests reference, each once, in order: the
/// key in `local` and in `remote` (the stores may have other prefixes).
fn referenced_objects(
    local: &Store,
    remote: &Store,
    manifests: &[RankManifest],
) -> Vec<(Path, Path)> {
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut out = Vec::new();
    for m in manifests {
        for c in m.chunk_refs() {
            for (l, r) in local
                .keys()
                .chain_objects(c)
                .into_iter()
                .zip(remote.keys().chain_objects(c))
            {
                if seen.insert(l.to_string()) {
                    out.push((l, r));
                }
            }
        }
    }
    out
}

/// Copy committed step `step` of `run` from `local` to `remote` and commit it there (see the
/// module docs): the objects the remote lacks, then the rank manifests, then the commit, under
/// a writer lease on the remote (no remote GC sweep runs meanwhile) and the step's generation
/// (a newer generation on the remote fences the drain: [`ErrorKind::Fenced`](crate::ErrorKind::Fenced)). The drain
/// marker in `local` tracks it and is deleted once the remote commit exists. A step already
/// committed on the remote returns at once. Every local object is checked against its id on
/// the way (a damaged local chunk is an error naming it, never sent).
#[instrument(skip_all, fields(run, step))]
pub async fn drain_step(
    local: &Store,
    remote: &Store,
    run: &str,
    step: u64,
    opts: &DrainOptions,
) -> Result<DrainReport> {
    let (record, _) = local.log().read_commit(run, step).await.map_err(|e| {
        e.context(format!(
            "draining step {step} of run {run} from the local tier"
        ))
    })?;
    let generation = record.generation;
    let read = |_: ()| async move {
        stream::iter(record.ranks.clone())
            .map(|e| async move {
                local
                    .log()
                    .read_rank_manifest(run, step, e.rank, Some(&e))
                    .await
            })
            .buffered(16)
            .try_collect::<Vec<RankManifest>>()
            .await
    };
    drain(local, remote, (run, step, generation), read, opts, false).await
}

/// Copy one node's ranks of `step` (its node commit in `local`, [`crate::NodeCommit`]; every
/// node's, where nodes share the tier) to `remote`, as [`drain_step`] does a whole step, then
/// commit the step there if every other rank's manifest is there already: the drain of the
/// node whose ranks land last commits it (each drain writes its manifests before it looks, so
/// the last one sees them all). A drain that finds ranks missing ends with
/// [`DrainReport::remote_committed`] false: the step waits for the other nodes' drains.
#[instrument(skip_all, fields(run, step))]
pub async fn drain_node(
    local: &Store,
    remote: &Store,
    run: &str,
    step: u64,
    opts: &DrainOptions,
) -> Result<DrainReport> {
    let commits = local
        .log()
        .read_node_commits(run, step)
        .await
        .map_err(|e| {
            e.context(format!(
                "draining this node's ranks of step {step} of run {run} from the local tier"
            ))
        })?;
    // Nodes that share a tier: each one's commit of the same generation (the newest).
    let generation = commits
        .iter()
        .map(|c| c.generation)
        .max()
        .unwrap_or_default();
    let read = |_: ()| async move {
        let mut all = Vec::new();
        for c in commits.iter().filter(|c| c.generation == generation) {
            all.extend(local.log().node_commit_manifests(c).await?);
        }
        Ok(all)
    };
    drain(local, remote, (run, step, generation), read, opts, true).await
}

/// The drain of [`drain_step`] and [`drain_node`]: `manifests` reads what to copy.
async fn drain<F, Fut>(
    local: &Store,
    remote: &Store,
    (run, step, generation): (&str, u64, u64),
    manifests: F,
    opts: &DrainOptions,
    node: bool,
) -> Result<DrainReport>
where
    F: FnOnce(()) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<RankManifest>>>,
{
    let t0 = Instant::now();
    let mut report = DrainReport {
        run: run.to_string(),
        step,
        ..DrainReport::default()
    };
    if remote
        .objects()
        .exists(&remote.keys().commit(run, step))
        .await?
    {
        report.already_remote = true;
        report.remote_committed = true;
        superseded(local, run, step).await?;
        return Ok(report);
    }
    let fence = opts.generation.unwrap_or(generation).max(generation);
    // The remote joins the drainer's generation (a newer one there fences this drain).
    remote
        .log()
        .join_generation(run, fence)
        .await
        .map_err(|e| e.context(format!("draining step {step} of run {run}")))?;
    let manifests = manifests(()).await?;
    let objects = referenced_objects(local, remote, &manifests);
    let mut marker = DrainMarker {
        run: run.to_string(),
        step,
        generation,
        remote: remote.url().to_string(),
        bytes_total: 0,
        bytes_done: 0,
        started_ms: local.now().timestamp_millis(),
        updated_ms: local.now().timestamp_millis(),
    };
    // Sizes for the progress (one listing-free HEAD per object would cost as much as the
    // copy's own; the manifests' stored sizes count a packed chunk's share of its pack).
    marker.bytes_total = manifests
        .iter()
        .flat_map(|m| m.chunk_refs())
        .map(|c| u64::from(c.stored))
        .sum();
    local.log().put_drain_marker(&marker).await?;
    let lease = remote
        .gc()
        .lease_dedup_base(run, &opts.writer, &[])
        .await
        .map_err(|e| e.context(format!("draining step {step} of run {run}")))?;
    let res = copy_and_commit(
        local,
        remote,
        &manifests,
        objects,
        (opts, fence, node),
        &mut marker,
        &mut report,
    )
    .await;
    if let Err(e) = remote.gc().release_lease(lease).await {
        debug!(step, "drain lease not released (GC lets it lapse): {e}");
    }
    res?;
    // Its marker and older ones go (a failed or killed drain's would keep their steps from
    // retention for good). Not committed: this node's part is remote; the step commits with
    // the last node's drain.
    superseded(local, run, step).await?;
    report.seconds = t0.elapsed().as_secs_f64();
    info!(
        run,
        step,
        sent = report.bytes_sent,
        present = report.bytes_present,
        seconds = report.seconds,
        committed = report.remote_committed,
        "step drained to the remote store"
    );
    Ok(report)
}

/// `step` is remote-durable: its drain marker goes, and those of older steps whose drains
/// failed or were skipped (a newer remote step supersedes them; their markers would keep
/// them from the local tier's retention for good).
async fn superseded(local: &Store, run: &str, step: u64) -> Result<()> {
    for d in local.log().pending_drains(run).await? {
        if d.step <= step {
            local.log().delete_drain_marker(run, d.step).await?;
        }
    }
    Ok(())
}

/// The drain's copy: objects, then manifests, then the commit.
async fn copy_and_commit(
    local: &Store,
    remote: &Store,
    manifests: &[RankManifest],
    objects: Vec<(Path, Path)>,
    (opts, fence, node): (&DrainOptions, u64, bool),
    marker: &mut DrainMarker,
    report: &mut DrainReport,
) -> Result<()> {
    let (run, step, generation) = (marker.run.clone(), marker.step, marker.generation);
    let done = AtomicU64::new(0);
    let last_mark = AtomicU64::new(0);
    let results: Vec<(bool, u64)> = stream::iter(objects)
        .map(|(path, there)| {
            let (done, run) = (&done, &run);
            async move {
                if let Some(size) = remote.objects().object_size(&there).await? {
                    done.fetch_add(size, Ordering::Relaxed);
                    return Ok::<_, Error>((false, size));
                }
                let bytes = local.objects().get_object(&path).await.map_err(|e| {
                    e.context(format!(
                        "draining step {step} of run {run}: reading {path} from the local tier"
                    ))
                })?;
                check_object(local, &path, &bytes).map_err(|e| {
                    e.context(format!(
                        "draining step {step} of run {run}: the local tier's copy is damaged (not sent)"
                    ))
                })?;
                let size = bytes.len() as u64;
                if let Some(p) = &opts.pace {
                    p(size).await;
                }
                remote
                    .objects().put_object(&there, vec![bytes], PutMode::Overwrite)
                    .await
                    .map_err(|e| e.context(format!("draining step {step} of run {run}")))?;
                done.fetch_add(size, Ordering::Relaxed);
                Ok((true, size))
            }
        })
        .buffer_unordered(opts.concurrency.max(1))
        .and_then(|r| {
            let last_mark = &last_mark;
            // Progress into the marker now and then (a failed update only costs a stale bar).
            let d = done.load(Ordering::Relaxed);
            if let Some(p) = &opts.progress {
                p(d.min(marker.bytes_total), marker.bytes_total);
            }
            let due = d.saturating_sub(last_mark.load(Ordering::Relaxed)) >= opts.marker_every;
            let mut m = marker.clone();
            async move {
                if due {
                    last_mark.store(d, Ordering::Relaxed);
                    m.bytes_done = d.min(m.bytes_total);
                    m.updated_ms = local.now().timestamp_millis();
                    let _ = local.log().put_drain_marker(&m).await;
                }
                Ok(r)
            }
        })
        .try_collect()
        .await?;
    for (sent, size) in results {
        if sent {
            report.objects_sent += 1;
            report.bytes_sent += size;
        } else {
            report.objects_present += 1;
            report.bytes_present += size;
        }
    }
    marker.bytes_done = marker.bytes_total;
    marker.updated_ms = local.now().timestamp_millis();
    let _ = local.log().put_drain_marker(marker).await;
    for m in manifests {
        remote
            .log()
            .write_rank_manifest_fenced(m, fence)
            .await
            .map_err(|e| e.context(format!("draining step {step} of run {run}")))?;
        report.manifests += 1;
    }
    match remote
        .log()
        .commit_step_fenced(&run, step, Some(generation), Some(fence))
        .await
    {
        Ok(o) => {
            report.remote_committed = true;
            // Only the drain that created the record reports its comparison (two nodes whose
            // drains both saw every manifest both commit; one finds the other's record).
            if let crate::commit::CommitOutcome::Committed(r, _) = o {
                report.replicas = r.replicas;
            }
        }
        // Another node's ranks are not drained yet: their drain commits the step.
        Err(e) if node && e.kind() == ErrorKind::Incomplete => {
            debug!(
                step,
                "this node's ranks are remote; the step waits for the others: {e}"
            );
        }
        Err(e) => {
            return Err(e.context(format!(
                "draining step {step} of run {run}: the remote commit"
            )));
        }
    }
    Ok(())
}

/// A restore's chunk source for the local tier under a remote store: each chunk from the tier
/// when it holds it (the reader checks its hash; a chunk that fails goes back through
/// [`ChunkSource::refused`]); what it lacks or holds damaged is left to the reader's store.
/// It counts what it served and what it could not.
#[derive(Debug)]
pub struct TierSource {
    store: Store,
    /// Stored bytes served.
    pub stored_bytes: AtomicU64,
    /// Raw bytes served.
    pub raw_bytes: AtomicU64,
    /// Chunks missing or damaged here (read elsewhere).
    pub misses: AtomicU64,
    /// Chunks damaged here (a subset of the misses).
    pub damaged: AtomicU64,
}

impl TierSource {
    /// A source reading `store` (the local tier).
    pub fn new(store: Store) -> Self {
        TierSource {
            store,
            stored_bytes: AtomicU64::new(0),
            raw_bytes: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            damaged: AtomicU64::new(0),
        }
    }
}

#[async_trait::async_trait]
impl ChunkSource for TierSource {
    async fn fetch(&self, r: &ChunkRef) -> Option<Bytes> {
        match self.store.chunks().get_chunk(r).await {
            Ok(b) => {
                self.stored_bytes
                    .fetch_add(u64::from(r.stored), Ordering::Relaxed);
                self.raw_bytes
                    .fetch_add(u64::from(r.len), Ordering::Relaxed);
                Some(b)
            }
            Err(e) => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                if e.kind() == ErrorKind::Corrupt {
                    self.damaged.fetch_add(1, Ordering::Relaxed);
                    warn!(chunk = %r.id, "damaged in the local tier: reading it elsewhere: {e}");
                } else {
                    debug!(chunk = %r.id, "not in the local tier: reading it elsewhere: {e}");
                }
                None
            }
        }
    }
}

/// Of the store's listing, the steps another node drained its ranks of (manifests there, no
/// commit yet) and `rank`'s node did not: older than `newest`, newer than `drained` and than
/// the store's newest commit. Newest first. A node's local retention keeps these steps: it
/// may still follow them ([`node_step_to_follow`]).
pub fn steps_to_follow(
    newest: u64,
    drained: Option<u64>,
    remote: &[StepListing],
    rank: u32,
) -> Vec<u64> {
    let committed = remote.iter().filter(|s| s.committed).map(|s| s.step).max();
    let mut out: Vec<u64> = remote
        .iter()
        .filter(|s| {
            !s.committed
                && !s.ranks.is_empty()
                && !s.ranks.contains(&rank)
                && s.step < newest
                && drained.is_none_or(|d| s.step > d)
                && committed.is_none_or(|c| s.step > c)
        })
        .map(|s| s.step)
        .collect();
    out.sort_unstable_by(|a, b| b.cmp(a));
    out
}

/// One node of several (`rank` one of its ranks), about to drain `newest` having drained
/// `drained`: the newest older step that another node's drain already brought to `remote`
/// (its ranks' manifests are there, the commit waits for this node's) and that this node
/// committed in `generation` in `local`. Nodes that skip steps by their own timing could
/// otherwise drain disjoint steps, and the store would get none whole.
pub async fn node_step_to_follow(
    local: &Store,
    remote: &Store,
    run: &str,
    (newest, drained): (u64, Option<u64>),
    rank: u32,
    generation: u64,
) -> Result<Option<u64>> {
    let listing = remote.log().list_steps(run).await?;
    for s in steps_to_follow(newest, drained, &listing, rank) {
        let mine = match local.log().read_node_commits(run, s).await {
            Ok(c) => c,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if mine
            .iter()
            .any(|c| c.generation == generation && c.ranks.iter().any(|e| e.rank == rank))
        {
            return Ok(Some(s));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{StepListing, rate_pace, steps_to_follow};

    fn listed(step: u64, committed: bool, ranks: &[u32]) -> StepListing {
        StepListing {
            step,
            committed,
            node_commit: false,
            ranks: ranks.to_vec(),
            last_modified: chrono::DateTime::UNIX_EPOCH,
            meta_bytes: 0,
        }
    }

    #[test]
    fn a_node_follows_only_steps_other_nodes_drained_past_the_stores_newest_commit() {
        let remote = [
            listed(1, true, &[0, 1, 2]),
            listed(2, false, &[0]),
            listed(3, false, &[0, 2]),
            listed(4, false, &[1]),
            listed(5, true, &[0, 1, 2]),
            listed(6, false, &[0, 2]),
            listed(7, false, &[]),
            listed(8, false, &[2]),
            listed(9, false, &[0]),
        ];
        // Rank 1's node, about to drain 9: 6 and 8 (not 7, nothing there; not 4, its own; not
        // 2 or 3, older than the commit of 5), newest first.
        assert_eq!(steps_to_follow(9, None, &remote, 1), vec![8, 6]);
        // Only older than the step it is about to drain, newer than what it drained.
        assert_eq!(steps_to_follow(8, None, &remote, 1), vec![6]);
        assert_eq!(steps_to_follow(9, Some(6), &remote, 1), vec![8]);
        // Rank 0's node drained 6 and 9 already.
        assert_eq!(steps_to_follow(10, None, &remote, 0), vec![8]);
        assert!(steps_to_follow(10, None, &[], 0).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_rate_pace_spaces_objects_by_their_bytes() {
        let pace = rate_pace(1000.0);
        let t0 = tokio::time::Instant::now();
        // The first object goes at once; each later one after its predecessors' time.
        pace(500).await;
        assert_eq!(t0.elapsed(), Duration::ZERO);
        pace(2000).await;
        assert_eq!(t0.elapsed(), Duration::from_millis(500));
        // Objects admitted together (a drain's concurrency) are spread out, not sent at once.
        let (a, b) = (pace(1000), pace(1000));
        let ((), ()) = tokio::join!(a, b);
        assert_eq!(t0.elapsed(), Duration::from_millis(3500));
        // Time spent idle is not saved up for a burst later.
        tokio::time::sleep(Duration::from_secs(10)).await;
        let t1 = tokio::time::Instant::now();
        pace(1000).await;
        assert_eq!(t1.elapsed(), Duration::ZERO);
        pace(1).await;
        assert_eq!(t1.elapsed(), Duration::from_secs(1));
    }
}
