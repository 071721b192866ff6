//! Committing a step (see the module docs of [`crate::commit`]): list the step, read its rank
//! manifests, keep those of the committer's generation, check them, and create the commit
//! record (split into parts first when it is large), each phase a function of its own.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use object_store::PutMode;
use object_store::path::Path;
use tracing::{info, instrument};

use super::CommitLog;
use super::CommitOutcome;
use crate::error::{Error, ErrorKind, Result};
use crate::id::StepId;
use crate::keys::{StepObject, validate_run};
use crate::model::{
    BlobLoc, CommitRecord, RankEntry, RankManifest, WHOLE_RECORD_FORMAT, WriteStats,
    check_coverage, collect_tensors, compare_replicas,
};

/// A rank manifest read, with its entry in the record.
type Present = (RankManifest, RankEntry);

impl CommitLog {
    /// Commit a step if every rank's manifest is present and coverage holds (see the module
    /// docs). A step with missing rank manifests gets [`ErrorKind::Incomplete`] naming them (wait
    /// and retry); shards that do not cover a tensor exactly once, or ranks that disagree on
    /// the layout, get [`ErrorKind::InvalidInput`] naming the tensor and region.
    pub async fn commit_step(&self, run: &str, step: u64) -> Result<CommitOutcome> {
        self.commit_step_as(run, step, None).await
    }

    /// [`CommitLog::commit_step`] by a committer of `generation`: manifests of older generations
    /// (left by a dead attempt) count as missing, and manifests of a newer one mean this
    /// committer is stale ([`ErrorKind::Fenced`]).
    #[instrument(skip_all, fields(run, step, generation))]
    pub async fn commit_step_as(
        &self,
        run: &str,
        step: u64,
        generation: Option<u64>,
    ) -> Result<CommitOutcome> {
        self.commit_step_fenced(run, step, generation, None).await
    }

    /// [`CommitLog::commit_step_as`] of `generation`'s manifests by a committer of generation
    /// `fence` (at least `generation`): a newer generation than `fence` fences it. A drain of
    /// a local tier commits a step an earlier generation of the job saved on behalf of the
    /// job that runs now ([`crate::tier`]): the step is older than anything the running
    /// generation saves, so committing it cannot race a writer of that generation.
    pub async fn commit_step_fenced(
        &self,
        run: &str,
        step: u64,
        generation: Option<u64>,
        fence: Option<u64>,
    ) -> Result<CommitOutcome> {
        validate_run(run)?;
        let Some(ranks) = self.listed_manifests(run, step).await? else {
            let (c, id) = self.read_commit(run, step).await?;
            return already_committed(c, id, generation);
        };
        if let Some(g) = generation {
            self.check_listed(run, step, g, &ranks).await?;
        }
        // Read every manifest present (O(ranks) requests): a restarted job may have left
        // manifests of an older generation and another layout next to the current ones.
        let present: Vec<Present> = stream::iter(ranks)
            .map(|(r, path)| async move {
                let (m, hash, size) = self.objects.get_json::<RankManifest>(&path).await?;
                m.validate(path.as_ref())?;
                Ok::<_, Error>((
                    m,
                    RankEntry {
                        rank: r,
                        hash,
                        size,
                    },
                ))
            })
            .buffered(32)
            .try_collect()
            .await?;
        let (generation, manifests) = of_generation(run, step, generation, present)?;
        let mut record = record_of(run, step, generation, manifests)?;
        self.objects.failpoints().hit("before_commit").await?;
        // Epoch fencing: once a newer generation has started (a supervisor, an agent or a job
        // resumed by hand marked it), this one's committer is stale.
        let who = "this committer";
        let fence = fence.unwrap_or(generation).max(generation);
        self.check_generation(run, fence, who)
            .await
            .map_err(|e| e.context(format!("step {step} of run {run}")))?;
        let path = self.objects.keys().commit(run, step);
        self.objects
            .failpoints()
            .hit("before_commit_create")
            .await?;
        let bytes = self.sealed_record(run, step, &mut record).await?;
        let hash = crate::id::Hash::of(&bytes);
        match self
            .objects
            .put_object(&path, vec![bytes.into()], PutMode::Create)
            .await
        {
            Ok(()) => {
                info!(run, step, ranks = record.ranks.len(), "committed");
                // A generation started between the check and the create (one request's
                // window) did not stop this commit, but it does stop this writer; and a writer
                // of it may have replaced a manifest this record pins (it found no record yet):
                // then no one could ever restore the record, so it is withdrawn.
                if let Err(e) = self.check_generation(run, fence, who).await {
                    if e.kind() == ErrorKind::Fenced && !self.pins_hold(&record).await? {
                        self.objects.delete_all(vec![path.clone()]).await?;
                        return Err(e.context(format!(
                            "step {step} of run {run}: the commit record was withdrawn (a newer generation replaced a manifest it pinned)"
                        )));
                    }
                    return Err(e.context(format!(
                        "step {step} of run {run} was committed as a newer generation started"
                    )));
                }
                Ok(CommitOutcome::Committed(record, StepId(hash)))
            }
            Err(e) if e.kind() == ErrorKind::Conflict => {
                let (c, id) = self.read_commit(run, step).await?;
                already_committed(c, id, Some(generation))
            }
            Err(e) => Err(e),
        }
    }

    /// The rank manifests listed in `step`, each at the key it was found at (this build's
    /// place, else the one of a build before format 4); `None` when the step is committed.
    async fn listed_manifests(&self, run: &str, step: u64) -> Result<Option<BTreeMap<u32, Path>>> {
        let dir = self.objects.keys().step_dir(run, step);
        let metas = self.objects.list_all(&dir).await?;
        let mut ranks: BTreeMap<u32, Path> = BTreeMap::new();
        for m in &metas {
            match self.objects.keys().parse_step_object(&m.location) {
                Some((_, _, StepObject::RankManifest(r)))
                    if !ranks.contains_key(&r)
                        || m.location == self.objects.keys().rank_manifest(run, step, r) =>
                {
                    ranks.insert(r, m.location.clone());
                }
                Some((
                    _,
                    _,
                    StepObject::RankManifest(_)
                    | StepObject::RecordPart(_)
                    | StepObject::NodeCommit(_),
                )) => {}
                Some((_, _, StepObject::Commit)) => return Ok(None),
                None => {}
            }
        }
        if ranks.is_empty() {
            return Err(Error::incomplete(format!(
                "step {step} of run {run}: no rank has written its manifest yet"
            )));
        }
        Ok(Some(ranks))
    }

    /// A committer of `generation` polling while ranks still write learns the world size from
    /// one manifest of its own generation, and while the listing lacks a rank of it, reads no
    /// other: polls then cost a listing, one get and the fence check, not a get per manifest.
    async fn check_listed(
        &self,
        run: &str,
        step: u64,
        generation: u64,
        ranks: &BTreeMap<u32, Path>,
    ) -> Result<()> {
        let Some(path) = ranks.values().next() else {
            return Ok(());
        };
        let (m, _, _) = self.objects.get_json::<RankManifest>(path).await?;
        let world = m.layout.world();
        let unlisted: Vec<u32> = (0..world).filter(|r| !ranks.contains_key(r)).collect();
        if m.generation != generation || unlisted.is_empty() {
            return Ok(());
        }
        self.check_generation(run, generation, "this committer")
            .await
            .map_err(|e| e.context(format!("step {step} of run {run}")))?;
        Err(missing_ranks(run, step, generation, world, &unlisted))
    }

    /// The record's bytes, sealed. A record larger than the store's part size is split
    /// (format 5): the parts are put first, then the root that pins them is returned, and
    /// `record` takes the root's format, checksum and index (a crash between leaves parts no
    /// record names, which GC deletes with the uncommitted step).
    async fn sealed_record(
        &self,
        run: &str,
        step: u64,
        record: &mut CommitRecord,
    ) -> Result<Vec<u8>> {
        let bytes = record.seal()?;
        let part_bytes = self.objects.config().record_part_bytes;
        if bytes.len() <= part_bytes {
            return Ok(bytes);
        }
        let (mut root, parts) = record.split(part_bytes)?;
        let n = parts.len();
        stream::iter(parts)
            .map(|(hash, b)| {
                let path = self.objects.keys().record_part(run, step, &hash);
                async move {
                    self.objects
                        .put_object(&path, vec![b.into()], PutMode::Overwrite)
                        .await
                }
            })
            // One wave for up to 64 parts (4 MB of record), on as many prefixes.
            .buffer_unordered(64)
            .try_collect::<Vec<()>>()
            .await?;
        self.objects.failpoints().hit("after_record_parts").await?;
        let bytes = root.seal()?;
        info!(
            run,
            step,
            parts = n,
            root_bytes = bytes.len(),
            "commit record split"
        );
        record.format = root.format;
        record.checksum = root.checksum;
        record.index = root.index;
        Ok(bytes)
    }

    /// Commit a step once every rank's manifest is there, polling every `poll` until
    /// `timeout`. Errors other than "incomplete because a manifest is missing" end the wait.
    pub async fn wait_and_commit(
        &self,
        run: &str,
        step: u64,
        poll: Duration,
        timeout: Duration,
    ) -> Result<CommitOutcome> {
        self.wait_and_commit_as(run, step, None, poll, timeout)
            .await
    }

    /// [`CommitLog::wait_and_commit`] by a committer of `generation` (see
    /// [`CommitLog::commit_step_as`]).
    pub async fn wait_and_commit_as(
        &self,
        run: &str,
        step: u64,
        generation: Option<u64>,
        poll: Duration,
        timeout: Duration,
    ) -> Result<CommitOutcome> {
        let t0 = Instant::now();
        // Start polling fast (ranks of one job finish within milliseconds of each other on
        // one machine) and back off to `poll`.
        let mut pause = poll.min(Duration::from_millis(5));
        loop {
            match self.commit_step_as(run, step, generation).await {
                Ok(o) => return Ok(o),
                Err(e) if e.kind() == ErrorKind::Incomplete && t0.elapsed() < timeout => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(poll);
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The generation the step is committed as (the committer's, or the newest present) and its
/// manifests: every rank of its layout, none beyond. A manifest of a newer generation means
/// the committer is stale; stale manifests of ranks beyond the world are left for GC.
fn of_generation(
    run: &str,
    step: u64,
    generation: Option<u64>,
    present: Vec<Present>,
) -> Result<(u64, Vec<Present>)> {
    let newest = present.iter().map(|(m, _)| m.generation).max().unwrap_or(0);
    let generation = generation.unwrap_or(newest);
    if let Some((newer, _)) = present.iter().find(|(m, _)| m.generation > generation) {
        return Err(Error::new(
            ErrorKind::Fenced,
            format!(
                "step {step} of run {run}: rank {} saved it in generation {}, newer than this committer's {generation}; a stale committer must not commit",
                newer.rank, newer.generation
            ),
        ));
    }
    let Some((first, _)) = present.iter().find(|(m, _)| m.generation == generation) else {
        return Err(Error::incomplete(format!(
            "step {step} of run {run}: no rank of generation {generation} has written its manifest yet"
        )));
    };
    let layout = first.layout;
    let world = layout.world();
    let current: Vec<u32> = present
        .iter()
        .filter(|(m, _)| m.generation == generation)
        .map(|(m, _)| m.rank)
        .collect();
    let missing: Vec<u32> = (0..world).filter(|r| !current.contains(r)).collect();
    if !missing.is_empty() {
        return Err(missing_ranks(run, step, generation, world, &missing));
    }
    if let Some(&extra) = current.iter().find(|&&r| r >= world) {
        return Err(Error::invalid(format!(
            "step {step} of run {run}: rank {extra} wrote a manifest but the layout {layout} has {world} ranks"
        )));
    }
    let manifests = present
        .into_iter()
        .filter(|(m, _)| m.generation == generation && m.rank < world)
        .collect();
    Ok((generation, manifests))
}

/// The commit record of `manifests` (one generation's, every rank): they must agree on the
/// layout and name this step, and the shards of every tensor must cover it exactly once.
fn record_of(
    run: &str,
    step: u64,
    generation: u64,
    manifests: Vec<Present>,
) -> Result<CommitRecord> {
    let (first, _) = &manifests[0];
    let (layout, first_rank) = (first.layout, first.rank);
    let mut stats = WriteStats::default();
    let mut blobs = Vec::new();
    for (m, _) in &manifests {
        if m.layout != layout {
            return Err(Error::invalid(format!(
                "step {step} of run {run}: rank {} saved with layout {}, rank {} with {layout} (same generation {generation})",
                m.rank, m.layout, first_rank
            )));
        }
        if m.run != run || m.step != step {
            return Err(Error::corrupt(format!(
                "the manifest of rank {} lives at step {step} of run {run} but names step {} of run {}",
                m.rank, m.step, m.run
            )));
        }
        stats.add(&m.stats);
        blobs.extend(m.blobs.iter().map(|b| BlobLoc {
            rank: m.rank,
            name: b.name.clone(),
            len: b.len,
        }));
    }
    let ms: Vec<RankManifest> = manifests.iter().map(|(m, _)| m.clone()).collect();
    let tensors =
        collect_tensors(&ms).map_err(|e| e.context(format!("step {step} of run {run}")))?;
    for t in &tensors {
        check_coverage(&t.name, &t.shape, &t.shards)
            .map_err(|e| e.context(format!("step {step} of run {run}")))?;
    }
    Ok(CommitRecord {
        checksum: None,
        format: WHOLE_RECORD_FORMAT,
        run: run.to_string(),
        step,
        layout,
        generation,
        // Derived from the manifests, not the clock: every committer of a step builds the
        // same bytes, so even a backend whose conditional create is not atomic ends with one
        // consistent record (see FORMAT.md).
        committed_ms: manifests
            .iter()
            .map(|(m, _)| m.created_ms)
            .max()
            .unwrap_or(0),
        ranks: manifests.into_iter().map(|(_, e)| e).collect(),
        tensors,
        blobs,
        stats,
        index: None,
        // The sentinel: the replicas the ranks hashed against the writers' chunk ids.
        replicas: compare_replicas(&ms),
    })
}

/// Incomplete: the manifests of `missing` ranks of `generation` (of `world`) are not there.
fn missing_ranks(run: &str, step: u64, generation: u64, world: u32, missing: &[u32]) -> Error {
    let shown: Vec<String> = missing.iter().take(10).map(u32::to_string).collect();
    Error::incomplete(format!(
        "step {step} of run {run}: {} of {world} rank manifests of generation {generation} are missing (ranks {}{})",
        missing.len(),
        shown.join(", "),
        if missing.len() > 10 { ", ..." } else { "" }
    ))
}

/// A step someone else committed: theirs, unless a committer of a newer `generation` finds a
/// record of an older one (its ranks' saves are not in it: not a success).
fn already_committed(
    c: CommitRecord,
    id: StepId,
    generation: Option<u64>,
) -> Result<CommitOutcome> {
    match generation {
        Some(g) if c.generation < g => Err(Error::new(
            ErrorKind::Conflict,
            format!(
                "step {} of run {} is already committed by generation {}, older than this committer's {g}",
                c.step, c.run, c.generation
            ),
        )),
        _ => Ok(CommitOutcome::AlreadyCommitted(c, id)),
    }
}
