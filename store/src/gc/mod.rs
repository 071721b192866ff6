//! Retention and garbage collection.
//!
//! 1. **Retention**, per run: keep the newest committed step always, the last `keep_last`,
//!    every step that is a multiple of `keep_every`, and any step the caller protects (a
//!    pending save builds on it). Other committed steps are deleted, commit record first, so
//!    a step vanishes atomically. Incomplete steps whose objects are all older than the grace
//!    period and the lease lapse ([`GcOptions::lease_lapse`]), while no writer lease is live,
//!    are abandoned saves and are deleted too; younger ones may still be committing.
//!    Commit records go first, manifests after.
//! 2. **Sweep lock**: a sweep never overlaps a save in flight (see [`crate::lease`] and
//!    FORMAT.md, "What GC may delete, and when"); with a writer lease live, the sweep is left
//!    for a later run ([`GcReport::sweep_deferred`]).
//! 3. **Mark**: every chunk and pack referenced by a manifest that remains (committed or in
//!    flight), listed after the sweep lock is taken.
//! 4. **Sweep**: delete chunk and pack objects nobody references and older than the grace
//!    period, in batches, yielding to a save that starts meanwhile. On a local directory the
//!    sweep also deletes temporary files (`<key>#<n>`) that interrupted writes left, once they
//!    are older than the grace period and the lease lapse (a write in progress keeps its file
//!    younger than that).
//!
//! The grace governs unreferenced objects only: a writer lease, an incomplete step and a
//! temporary file count as a save in flight for the lease lapse whatever the grace, so a
//! short grace (`ckpt gc --grace 0s --force` beside a running job) costs at most a sweep's
//! deferral, never a save.
//!
//! With neither `keep_last` nor `keep_every`, retention keeps every committed step and GC only
//! sweeps. In a local tier ([`crate::tier`]) a step with a drain marker (local-durable, still
//! draining to the remote store) is kept whatever the rules say.

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::{StreamExt, TryStreamExt, stream};
use object_store::path::Path;
use parking_lot::Mutex;
use serde::Serialize;
use tracing::{debug, info, instrument, warn};

use crate::commit::CommitLog;
use crate::commit::catalog::StepListing;
use crate::error::{Error, ErrorKind, Result};
use crate::keys::StepObject;
use crate::model::RankManifest;
use crate::store::Objects;

pub mod lease;

/// What GC should keep and how careful to be.
#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Keep the newest N committed steps of each run.
    pub keep_last: Option<usize>,
    /// Keep committed steps whose number is a multiple of K.
    pub keep_every: Option<u64>,
    /// Never delete unreferenced objects younger than this.
    pub grace: Duration,
    /// How long a save counts as in flight after its last write, whatever the grace: a
    /// writer lease younger than this defers the sweep, and an incomplete step or a
    /// temporary file younger than this (or than the grace) is kept, because the save that
    /// wrote it may still be committing. A short grace therefore only ever costs a sweep's
    /// deferral; shorten this only when no job saves (a killed job's leases then stop
    /// deferring sweeps sooner).
    pub lease_lapse: Duration,
    /// Report what would be deleted, delete nothing.
    pub dry_run: bool,
    /// Only these runs (all if empty) for retention; the sweep always considers the whole store.
    pub runs: Vec<String>,
    /// Steps that must survive (a pending save builds on them).
    pub protect: Vec<(String, u64)>,
    /// Sweep unreferenced objects (lists the whole store); retention alone when false.
    pub sweep: bool,
}

impl Default for GcOptions {
    fn default() -> Self {
        GcOptions {
            keep_last: None,
            keep_every: None,
            grace: Duration::from_secs(3600),
            lease_lapse: crate::lease::LOCK_LAPSE,
            dry_run: false,
            runs: Vec::new(),
            protect: Vec::new(),
            sweep: true,
        }
    }
}

/// What GC did (or would do, in a dry run).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GcReport {
    /// Committed steps deleted by retention, as (run, step).
    pub steps_deleted: Vec<(String, u64)>,
    /// Abandoned incomplete steps deleted.
    pub incomplete_deleted: Vec<(String, u64)>,
    /// Incomplete steps kept because a save of them may be in flight (younger than the
    /// lease lapse or the grace, or a writer lease was live).
    #[serde(default)]
    pub incomplete_in_flight: Vec<(String, u64)>,
    /// Committed steps kept.
    pub steps_kept: Vec<(String, u64)>,
    /// Chunk and pack objects deleted.
    pub objects_deleted: u64,
    /// Bytes they held.
    pub bytes_freed: u64,
    /// Unreferenced objects kept because they are younger than the grace period.
    pub objects_in_grace: u64,
    /// Chunk and pack objects kept.
    pub objects_kept: u64,
    /// Bytes of the objects kept.
    pub bytes_kept: u64,
    /// Objects kept only because a kept delta chunk needs them as its base (no kept step
    /// references them directly; issue 16).
    #[serde(default)]
    pub objects_kept_as_bases: u64,
    /// Bytes of those objects.
    #[serde(default)]
    pub bytes_kept_as_bases: u64,
    /// Temporary files of interrupted writes deleted (local directory only).
    pub temp_files_deleted: u64,
    /// Bytes they held.
    pub temp_bytes_freed: u64,
    /// Temporary files kept because they are younger than the grace period (a write in
    /// progress, or a crash too recent to be sure).
    pub temp_files_in_grace: u64,
    /// Nothing was deleted.
    pub dry_run: bool,
    /// Why the sweep did not run, or stopped early (saves in flight hold writer leases).
    pub sweep_deferred: Option<String>,
}

/// When a sweep lock was last written (refreshed) by the GC holding it.
struct Fresh(Mutex<Instant>);

impl Fresh {
    fn mark(&self, at: Instant) {
        *self.0.lock() = at;
    }

    fn age(&self) -> Duration {
        self.0.lock().elapsed()
    }
}

/// `d` for comparisons with the store's clock.
fn chrono_of(d: Duration) -> Result<chrono::Duration> {
    chrono::Duration::from_std(d).map_err(|_| Error::invalid("grace period is too long"))
}

/// Objects deleted between two checks for saves that started meanwhile.
const SWEEP_BATCH: usize = 1000;

/// Per run: the steps as listed and those retention dropped.
type Dropped = Vec<(String, BTreeSet<u64>, Vec<StepListing>)>;

/// The steps of `run` the caller protects.
fn protected(opts: &GcOptions, run: &str) -> Vec<u64> {
    opts.protect
        .iter()
        .filter(|(r, _)| r == run)
        .map(|(_, s)| *s)
        .collect()
}

/// Which committed steps of one run retention keeps.
pub fn retained(
    committed: &[u64],
    keep_last: Option<usize>,
    keep_every: Option<u64>,
    protect: &[u64],
) -> BTreeSet<u64> {
    let mut keep: BTreeSet<u64> = BTreeSet::new();
    if keep_last.is_none() && keep_every.is_none() {
        keep.extend(committed.iter().copied());
        return keep;
    }
    let mut sorted = committed.to_vec();
    sorted.sort_unstable();
    if let Some(&newest) = sorted.last() {
        keep.insert(newest);
    }
    if let Some(n) = keep_last {
        keep.extend(sorted.iter().rev().take(n).copied());
    }
    if let Some(k) = keep_every.filter(|&k| k > 0) {
        keep.extend(sorted.iter().copied().filter(|s| s % k == 0));
    }
    keep.extend(protect.iter().copied().filter(|s| committed.contains(s)));
    keep
}

/// Leases and garbage collection of a store (see the module docs): writers' leases and the
/// sweep lock (`lease.rs`), retention and the sweep (here). A part of the
/// [`Store`](crate::Store) handle (`store.gc()`); cheap to clone.
#[derive(Debug, Clone)]
pub struct Gc {
    pub(crate) objects: Objects,
    pub(crate) log: CommitLog,
}

impl Gc {
    pub(crate) fn new(objects: Objects, log: CommitLog) -> Self {
        Gc { objects, log }
    }

    /// Run retention and sweep (see the module docs). `now` is injectable for tests.
    #[instrument(skip_all, fields(dry_run = opts.dry_run))]
    pub async fn run(&self, opts: &GcOptions, now: DateTime<Utc>) -> Result<GcReport> {
        let mut report = GcReport {
            dry_run: opts.dry_run,
            ..GcReport::default()
        };
        let grace = chrono_of(opts.grace)?;
        let dropped = self.retire_steps(opts, &mut report).await?;
        self.manifests_and_sweep_under_lock(opts, now, grace, dropped, &mut report)
            .await?;
        if opts.sweep {
            self.sweep_temp_files(opts, now, &mut report).await?;
        }
        info!(
            steps_deleted = report.steps_deleted.len(),
            objects_deleted = report.objects_deleted,
            bytes_freed = report.bytes_freed,
            "gc done"
        );
        Ok(report)
    }

    /// 1. Retention: drop the commit records of the committed steps it does not keep (the
    ///    step then vanishes at once); each run's steps as listed, with those dropped.
    async fn retire_steps(&self, opts: &GcOptions, report: &mut GcReport) -> Result<Dropped> {
        let runs = self.log.list_runs().await?;
        let mut dropped: Dropped = Vec::new();
        for run in &runs {
            let steps = self.log.list_steps(run).await?;
            // A node commit (a local tier of a job of several machines) is retained like a
            // commit record.
            let committed: Vec<u64> = steps
                .iter()
                .filter(|s| s.committed || s.node_commit)
                .map(|s| s.step)
                .collect();
            let in_scope = opts.runs.is_empty() || opts.runs.contains(run);
            let mut protect = protected(opts, run);
            // A local tier keeps what is still draining to its remote store (issue 28).
            protect.extend(self.log.pending_drains(run).await?.iter().map(|d| d.step));
            let keep = if in_scope {
                retained(&committed, opts.keep_last, opts.keep_every, &protect)
            } else {
                committed.iter().copied().collect()
            };
            let mut doomed = BTreeSet::new();
            for &s in &committed {
                if keep.contains(&s) {
                    report.steps_kept.push((run.clone(), s));
                } else {
                    report.steps_deleted.push((run.clone(), s));
                    doomed.insert(s);
                }
            }
            if !opts.dry_run && !doomed.is_empty() {
                let mut commits: Vec<Path> = doomed
                    .iter()
                    .map(|&s| self.objects.keys().commit(run, s))
                    .collect();
                for s in steps
                    .iter()
                    .filter(|s| s.node_commit && doomed.contains(&s.step))
                {
                    commits.extend(self.log.node_commit_keys(run, s.step).await?);
                }
                self.objects.delete_all(commits).await?;
            }
            dropped.push((run.clone(), doomed, steps));
        }
        Ok(dropped)
    }

    /// 2. The manifests of dropped and abandoned steps, then mark and sweep, under the sweep
    ///    lock: a sweep excludes saves in flight (FORMAT.md, "What GC may delete"), and with
    ///    a live writer lease it is left for a later run.
    async fn manifests_and_sweep_under_lock(
        &self,
        opts: &GcOptions,
        now: DateTime<Utc>,
        grace: chrono::Duration,
        dropped: Dropped,
        report: &mut GcReport,
    ) -> Result<()> {
        let fresh = Fresh(Mutex::new(Instant::now()));
        let lock = if opts.sweep && !opts.dry_run {
            match self.take_sweep_lock(now, opts.lease_lapse).await? {
                Ok(lock) => Some(lock),
                Err(writers) => {
                    report.sweep_deferred = Some(format!(
                        "{} save(s) in flight hold a writer lease ({}); nothing was swept (the \
                         lease of a save that was killed lapses {} s after it was taken)",
                        writers.len(),
                        writers[0],
                        opts.lease_lapse.as_secs()
                    ));
                    None
                }
            }
        } else {
            None
        };
        let work = self.gc_manifests_and_sweep(
            opts,
            now,
            grace,
            dropped,
            lock.as_ref().map(|_| &fresh),
            report,
        );
        let res = match &lock {
            // Keep the lock fresh while marking and sweeping, so that saves can tell a live
            // sweep from a killed one's lock (crate::lease).
            Some(lock) => {
                let keep = self.keep_sweep_lock_fresh(&lock.path, &fresh);
                futures::pin_mut!(work, keep);
                match futures::future::select(work, keep).await {
                    futures::future::Either::Left((r, _)) => r,
                    futures::future::Either::Right((never, _)) => match never {},
                }
            }
            None => work.await,
        };
        if let Some(lock) = lock {
            self.release_sweep_lock(lock).await;
        }
        res
    }

    /// Delete the sweep lock, best effort. A lock left behind holds the saves of other
    /// processes back for the lapse (this process's own writers see at once that no GC holds
    /// it once `lock` drops): try a few times more than the store's own retries first.
    async fn release_sweep_lock(&self, lock: crate::lease::SweepLock) {
        for pause_ms in [100, 400, 1600, 0] {
            match self.objects.delete_all(vec![lock.path.clone()]).await {
                Ok(()) => return,
                Err(e) if pause_ms == 0 => {
                    warn!(lock = %lock.path, error = %e, "could not delete the sweep lock");
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(pause_ms)).await,
            }
        }
    }

    /// GC after retention: delete the manifests of dropped and abandoned steps, then (when
    /// `sweep`, under the sweep lock) mark and sweep.
    async fn gc_manifests_and_sweep(
        &self,
        opts: &GcOptions,
        now: DateTime<Utc>,
        grace: chrono::Duration,
        dropped: Dropped,
        sweep: Option<&Fresh>,
        report: &mut GcReport,
    ) -> Result<()> {
        let live_manifests = self
            .drop_manifests(opts, now, grace, dropped, report)
            .await?;
        if !opts.sweep || (sweep.is_none() && !opts.dry_run) {
            return Ok(());
        }
        self.objects.failpoints().hit("before_mark").await?;
        let (live, bases) = self.marked(live_manifests).await?;
        let doomed = self.unreferenced(now, grace, &live, &bases, report).await?;
        if opts.dry_run {
            report.objects_deleted += doomed.len() as u64;
            report.bytes_freed += doomed.iter().map(|(_, n)| n).sum::<u64>();
            return Ok(());
        }
        self.delete_swept(opts, now, sweep, &doomed, report).await
    }

    /// List the steps again (after the sweep lock, so every manifest written by a save that
    /// ended before it is seen), delete the manifests of dropped and abandoned steps, and
    /// return every other one (run, step, rank).
    ///
    /// An incomplete step is abandoned only when its newest object is older than both the
    /// grace and the lease lapse and no writer lease is live: between a rank's manifest (when
    /// its lease ends) and the step's commit no lease covers the step, so its age alone must
    /// say that no save is still committing it.
    async fn drop_manifests(
        &self,
        opts: &GcOptions,
        now: DateTime<Utc>,
        grace: chrono::Duration,
        dropped: Dropped,
        report: &mut GcReport,
    ) -> Result<Vec<(String, u64, u32)>> {
        let in_flight = grace.max(chrono_of(opts.lease_lapse)?);
        // Listed once, when the first old incomplete step is found.
        let mut writers_live: Option<bool> = None;
        let mut live_manifests: Vec<(String, u64, u32)> = Vec::new();
        for (run, dropped, listed) in dropped {
            let steps = if opts.dry_run {
                listed
            } else {
                self.log.list_steps(&run).await?
            };
            let in_scope = opts.runs.is_empty() || opts.runs.contains(&run);
            let protect = protected(opts, &run);
            for s in &steps {
                let committed = (s.committed || s.node_commit) && !dropped.contains(&s.step);
                let incomplete = !committed && !dropped.contains(&s.step);
                let mut doomed = dropped.contains(&s.step);
                if incomplete && in_scope && !protect.contains(&s.step) {
                    let old = now - s.last_modified > in_flight;
                    if old && writers_live.is_none() {
                        let live = self.list_locks(now, opts.lease_lapse).await?.writers;
                        writers_live = Some(!live.is_empty());
                    }
                    if old && writers_live == Some(false) {
                        doomed = true;
                    } else {
                        report.incomplete_in_flight.push((run.clone(), s.step));
                    }
                }
                if !doomed {
                    live_manifests.extend(s.ranks.iter().map(|&r| (run.clone(), s.step, r)));
                    continue;
                }
                if incomplete {
                    report.incomplete_deleted.push((run.clone(), s.step));
                }
                if !opts.dry_run {
                    self.delete_step(&run, s.step, false).await?;
                }
            }
        }
        Ok(live_manifests)
    }

    /// Mark: the objects the live manifests reference, and (apart) the bases of their delta
    /// chunks that are not referenced themselves (a kept chunk keeps its whole chain).
    async fn marked(
        &self,
        live_manifests: Vec<(String, u64, u32)>,
    ) -> Result<(HashSet<Path>, HashSet<Path>)> {
        let manifests: Vec<Option<RankManifest>> = stream::iter(live_manifests)
            .map(|(run, step, rank)| async move {
                match self.log.get_rank_manifest(&run, step, rank).await {
                    Ok((m, _, _)) => Ok(Some(m)),
                    // Another GC dropped the step since it was listed (its commit record
                    // goes first): what it referenced is no longer live. A committed step
                    // without its manifest is damage: nothing is swept.
                    Err(e)
                        if e.kind() == ErrorKind::NotFound
                            && !self
                                .objects
                                .exists(&self.objects.keys().commit(&run, step))
                                .await? =>
                    {
                        debug!(run, step, rank, "manifest gone with its step: not marked");
                        Ok(None)
                    }
                    Err(e) => Err(e.context(
                        "gc cannot tell what this manifest references; nothing was swept",
                    )),
                }
            })
            .buffer_unordered(32)
            .try_collect()
            .await?;
        let manifests: Vec<RankManifest> = manifests.into_iter().flatten().collect();
        let mut live: HashSet<Path> = HashSet::new();
        let mut bases: HashSet<Path> = HashSet::new();
        for m in &manifests {
            for c in m.chunk_refs() {
                let mut chain = self.objects.keys.chain_objects(c).into_iter();
                live.extend(chain.next());
                bases.extend(chain);
            }
        }
        bases.retain(|p| !live.contains(p));
        Ok((live, bases))
    }

    /// Sweep: the chunk and pack objects neither `live` nor a base, and older than the grace
    /// period (with their sizes); what is kept is counted in `report`.
    async fn unreferenced(
        &self,
        now: DateTime<Utc>,
        grace: chrono::Duration,
        live: &HashSet<Path>,
        bases: &HashSet<Path>,
        report: &mut GcReport,
    ) -> Result<Vec<(Path, u64)>> {
        let mut doomed: Vec<(Path, u64)> = Vec::new();
        for dir in [
            self.objects.keys().chunks_dir(),
            self.objects.keys().packs_dir(),
        ] {
            let metas = self.objects.list_all(&dir).await?;
            for m in metas {
                let ours = self.objects.keys().parse_chunk(&m.location).is_some()
                    || self.objects.keys().parse_delta_chunk(&m.location).is_some()
                    || self.objects.keys().parse_pack(&m.location).is_some();
                if bases.contains(&m.location) {
                    report.objects_kept += 1;
                    report.bytes_kept += m.size;
                    report.objects_kept_as_bases += 1;
                    report.bytes_kept_as_bases += m.size;
                } else if !ours || live.contains(&m.location) {
                    report.objects_kept += 1;
                    report.bytes_kept += m.size;
                } else if now - m.last_modified <= grace {
                    report.objects_in_grace += 1;
                    report.objects_kept += 1;
                    report.bytes_kept += m.size;
                } else {
                    doomed.push((m.location, m.size));
                }
            }
        }
        Ok(doomed)
    }

    /// Delete `doomed` in batches; a save that started meanwhile waits for this sweep, so
    /// yield to it between batches (the rest waits for a later run), and stop when the sweep
    /// lock went stale.
    async fn delete_swept(
        &self,
        opts: &GcOptions,
        now: DateTime<Utc>,
        sweep: Option<&Fresh>,
        doomed: &[(Path, u64)],
        report: &mut GcReport,
    ) -> Result<()> {
        let mut rest = doomed;
        while !rest.is_empty() {
            self.objects.failpoints().hit("before_sweep_delete").await?;
            // A GC that could not refresh its lock for half the lapse (paused, or the store
            // refused the writes) may have been taken for dead by a save: stop.
            let stale = sweep.map_or(Duration::ZERO, |f| f.age());
            if stale >= self.objects.config().sweep_lapse / 2 {
                report.objects_kept += rest.len() as u64;
                report.bytes_kept += rest.iter().map(|(_, n)| n).sum::<u64>();
                report.sweep_deferred = Some(format!(
                    "the sweep lock was last refreshed {:.1} s ago (a save takes a lock older \
                     than {:.1} s for a killed GC's); {} unreferenced object(s) are left for a \
                     later sweep",
                    stale.as_secs_f64(),
                    self.objects.config().sweep_lapse.as_secs_f64(),
                    rest.len()
                ));
                break;
            }
            let writers = self.list_locks(now, opts.lease_lapse).await?.writers;
            if !writers.is_empty() {
                report.objects_kept += rest.len() as u64;
                report.bytes_kept += rest.iter().map(|(_, n)| n).sum::<u64>();
                report.sweep_deferred = Some(format!(
                    "a save started ({}); {} unreferenced object(s) are left for a later sweep",
                    writers[0],
                    rest.len()
                ));
                break;
            }
            let (batch, tail) = rest.split_at(rest.len().min(SWEEP_BATCH));
            self.objects
                .delete_all(batch.iter().map(|(p, _)| p.clone()).collect())
                .await?;
            report.objects_deleted += batch.len() as u64;
            report.bytes_freed += batch.iter().map(|(_, n)| n).sum::<u64>();
            rest = tail;
        }
        Ok(())
    }

    /// Write the sweep lock at `path` again every sixth of the lapse, forever (the caller
    /// drops this future when the sweep ends), recording each success in `fresh`.
    async fn keep_sweep_lock_fresh(&self, path: &Path, fresh: &Fresh) -> std::convert::Infallible {
        let every = self.objects.config().sweep_lapse / 6;
        loop {
            tokio::time::sleep(every).await;
            let t = Instant::now();
            match self.put_lock(path, "gc sweep").await {
                Ok(()) => {
                    debug!(%path, "sweep lock refreshed");
                    fresh.mark(t);
                }
                Err(e) => warn!(%path, error = %e, "could not refresh the sweep lock"),
            }
        }
    }

    /// Delete the temporary files of interrupted writes older than the grace period.
    async fn sweep_temp_files(
        &self,
        opts: &GcOptions,
        now: DateTime<Utc>,
        report: &mut GcReport,
    ) -> Result<()> {
        // A temporary file is a write in progress (a commit record's too, which no lease
        // covers) until it is older than the grace and the lease lapse.
        let in_flight = chrono_of(opts.grace)?.max(chrono_of(opts.lease_lapse)?);
        for t in self.objects.temp_files().await? {
            if now - t.modified <= in_flight {
                report.temp_files_in_grace += 1;
                continue;
            }
            if !opts.dry_run {
                match std::fs::remove_file(&t.path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        return Err(Error::io(
                            "deleting the temporary file",
                            &t.path.display(),
                            e,
                        ));
                    }
                }
            }
            report.temp_files_deleted += 1;
            report.temp_bytes_freed += t.bytes;
        }
        Ok(())
    }

    /// Delete a step: its commit record first (the step is then invisible), then manifests
    /// and record parts.
    pub async fn delete_step(&self, run: &str, step: u64, committed: bool) -> Result<()> {
        if committed {
            let c = self.objects.keys().commit(run, step);
            self.objects.delete_all(vec![c]).await?;
        }
        let dir = self.objects.keys().step_dir(run, step);
        let rest: Vec<Path> = (self.objects.list_all(&dir).await?.into_iter())
            .map(|m| m.location)
            .filter(|p| {
                // Its manifests and the parts of its split record (format 5).
                matches!(
                    self.objects.keys().parse_step_object(p),
                    Some((
                        _,
                        _,
                        StepObject::RankManifest(_)
                            | StepObject::RecordPart(_)
                            | StepObject::NodeCommit(_)
                    ))
                )
            })
            .collect();
        self.objects.delete_all(rest).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_table() {
        let c = [10, 20, 30, 40, 50, 60];
        let k = |l, e, p: &[u64]| retained(&c, l, e, p).into_iter().collect::<Vec<_>>();
        assert_eq!(k(None, None, &[]), c.to_vec());
        assert_eq!(k(Some(0), None, &[]), vec![60]);
        assert_eq!(k(Some(2), None, &[]), vec![50, 60]);
        assert_eq!(k(None, Some(20), &[]), vec![20, 40, 60]);
        assert_eq!(k(Some(1), Some(30), &[]), vec![30, 60]);
        assert_eq!(k(Some(1), None, &[10, 99]), vec![10, 60]);
        assert!(retained(&[], Some(1), None, &[]).is_empty());
    }
}
