//! Writer leases and sweep locks: what keeps GC from deleting an object a save is about to
//! reference (FORMAT.md, "What GC may delete, and when").
//!
//! GC deletes chunk and pack objects only in a *sweep*, and a sweep never overlaps a save that
//! may reference objects no manifest records yet. The exclusion needs only plain puts, lists
//! and deletes with read-after-write consistency, so it holds on a local directory and on S3:
//!
//! - **Writer**: put `locks/writers/<2 hex>/writer-<id>`, *then* list `locks/` with a
//!   delimiter (the objects directly under it: every `sweep-*` lock, in one page; the other
//!   writers' leases come back as at most 256 common prefixes, not paged through) and wait
//!   while a live sweep lock exists; only then check that its dedup base is still committed,
//!   and write chunks and its rank manifest; then delete the lease.
//! - **Sweep**: put `locks/sweep-<id>`, *then* list all of `locks/` (recursively, every writer
//!   lease); with a live writer lease there, delete the lock and leave the sweep for later.
//!   Otherwise list the steps, mark, and delete; between delete batches, yield to any writer
//!   that has appeared since.
//!
//! Either the writer's listing sees the sweep lock (it waits until that sweep is over), or the
//! sweep's listing sees the writer's lease (it does not sweep): the sweep lock is an object
//! directly under `locks/`, which the delimited listing returns as surely as a full one, and
//! the lease is under `locks/`, which the sweep lists whole. A sweep that runs while no
//! save is in flight marks every manifest written before it started, and a step whose commit
//! record exists keeps its manifests, so a base found committed after the sweeps it waited for
//! has all its objects until the save's own manifest protects them.
//!
//! Leases and locks count for the lease lapse ([`GcOptions::lease_lapse`](crate::GcOptions),
//! [`LOCK_LAPSE`] by default) from their write, whatever the GC's grace period; a dead
//! writer's or GC's lapses then (and GC deletes it).
//!
//! A sweep lock is *kept fresh*: the GC holding it writes it again every
//! [`StoreConfig::sweep_lapse`](crate::StoreConfig::sweep_lapse) / 6 while it marks and sweeps,
//! and before each delete batch checks that its last refresh is younger than half the lapse
//! (else it stops sweeping). A writer that watches the same sweep lock unchanged (same
//! modification time and e-tag in its listings) for the lapse, by its own monotonic clock (so
//! clock skew with the store does not matter), or sees one older than four lapses by its
//! clock, takes it for a killed GC's, deletes it and goes on:
//! a `ckpt gc` killed mid-sweep holds saves back for seconds, not for [`LOCK_LAPSE`]. A sweep
//! lock's name says where its GC runs (`h<boot id><pid namespace>-...-p<pid>-...`,
//! [`host_tag`]): a writer on the same machine whose listing shows a lock of a process that is
//! gone (a rank killed during its retention) deletes it at once ([`sweep_lock_orphaned`]), so
//! a job restarted again and again on one machine does not wait a lapse at every start. A
//! lock of this very process that none of its GCs holds any more (its delete failed on a
//! flaky store) is deleted at once as well.
//!
//! "Unchanged for the lapse" is counted only over what the writer watched: from the *end* of
//! the listing that first returned a write to the *start* of the latest one (a listing shows
//! the store at some moment between its start and its end), and only while the writer wakes
//! from its pauses and gets its listings back within a third of the lapse (the GC refreshes
//! every sixth). A longer gap (this process paused or starved of CPU, or a store so slow that
//! a refresh may be queued behind the listing) restarts the count: a gap says nothing about
//! whether the GC refreshed, and a GC paused with the writer (one machine under load) must
//! not come back to find its lock deleted. A writer that waits through such gaps still gives
//! up after [`SWEEP_WAIT`], or takes a lock older than four lapses by the store's clock for
//! dead.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use object_store::path::Path;
use object_store::{ObjectMeta, PutMode};
use tracing::{debug, info, warn};

use crate::chunks::{BaseRegions, DedupIndex};
use crate::error::{Error, ErrorKind, Result};
use crate::keys::validate_run;
use crate::model::{ChunkRef, RankManifest};

/// How long a writer waits for a GC sweep to end before its save fails.
pub const SWEEP_WAIT: Duration = Duration::from_secs(120);

/// The default lease lapse, after which a lease or lock left behind lapses.
pub const LOCK_LAPSE: Duration = Duration::from_secs(3600);

/// How long a save waits for the commit record of the previous save (its newest dedup base
/// candidate) before it falls back to an older committed step: saves taken back to back
/// would otherwise find the previous commit not yet written and deduplicate nothing.
pub const PENDING_BASE_WAIT: Duration = Duration::from_secs(1);

/// A save in flight: while it exists, no GC sweeps. Release it with [`Gc::release_lease`](crate::Gc::release_lease)
/// once the save's rank manifest is written (or the save failed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriterLease {
    path: Path,
    base: Option<u64>,
}

impl WriterLease {
    /// The committed step the save may skip chunks of, if any.
    pub fn base(&self) -> Option<u64> {
        self.base
    }
}

/// A name for a writer's leases, unique across processes and restarts: rank, generation,
/// process and a per-process counter.
pub fn writer_id(rank: u32, generation: u64) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let nanos = crate::clock::system_now()
        .timestamp_nanos_opt()
        .unwrap_or_default();
    format!(
        "rank-{rank:06}-g{generation}-p{}-{nanos:x}-{seq}",
        std::process::id()
    )
}

/// Fresh key names: a lease or lock key is never written twice, so deleting a lapsed one never
/// deletes a live one.
/// This machine and pid namespace, as a sweep lock names the one its GC runs in: the kernel's
/// boot id and the pid namespace's inode (a pid names the same process only within both).
/// `None` where `/proc` does not tell.
pub fn host_tag() -> Option<&'static str> {
    static TAG: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    TAG.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let boot: String = boot
            .chars()
            .filter(char::is_ascii_hexdigit)
            .take(12)
            .collect();
        let ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
        let ns: String = ns
            .to_string_lossy()
            .chars()
            .filter(char::is_ascii_digit)
            .collect();
        (boot.len() == 12 && !ns.is_empty()).then(|| format!("{boot}{ns}"))
    })
    .as_deref()
}

/// The name of a new sweep lock of this process: `h<host tag>-` (see [`host_tag`]) before
/// its writer id (which holds `p<pid>`), so that a writer on the same machine can tell a GC
/// that is gone at once.
fn sweep_lock_name() -> String {
    match host_tag() {
        Some(h) => fresh(&format!("h{h}-{}", writer_id(0, 0))),
        None => fresh(&writer_id(0, 0)),
    }
}

/// Whether the sweep lock at `path` was taken by a process of this machine (and pid
/// namespace) that is gone: its GC was killed, and nobody will refresh or delete the lock.
pub fn sweep_lock_orphaned(path: &Path) -> bool {
    let Some(name) = path.filename().and_then(|n| n.strip_prefix("sweep-")) else {
        return false;
    };
    let mut parts = name.split('-');
    let Some(host) = parts.next().and_then(|h| h.strip_prefix('h')) else {
        return false;
    };
    if Some(host) != host_tag() {
        return false;
    }
    let Some(pid) = parts.find_map(|p| p.strip_prefix('p').and_then(|n| n.parse::<i32>().ok()))
    else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    if pid == std::process::id() as i32 {
        // This process's own lock: gone when no GC of this process holds it any more (its
        // release failed: the store refused the delete, or the GC was cancelled).
        return !held_sweep_locks().contains(path.as_ref());
    }
    // SAFETY: signal 0 only checks that the process exists; nothing is sent.
    let gone = unsafe { libc::kill(pid, 0) } != 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    // A killed process its parent has not reaped yet is a zombie: gone as well.
    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false);
    gone || zombie
}

/// The sweep locks the GCs of this process hold now, by path.
fn held_sweep_locks() -> parking_lot::MutexGuard<'static, std::collections::HashSet<String>> {
    static HELD: std::sync::OnceLock<parking_lot::Mutex<std::collections::HashSet<String>>> =
        std::sync::OnceLock::new();
    HELD.get_or_init(Default::default).lock()
}

/// A sweep lock a GC of this process holds: listed as held from before its object is written
/// until this is dropped, so that a writer of this process deletes at once a lock whose
/// release failed (a store that refused the delete) instead of waiting the lapse.
#[derive(Debug)]
pub(crate) struct SweepLock {
    pub(crate) path: Path,
}

impl SweepLock {
    fn new(path: Path) -> Self {
        held_sweep_locks().insert(path.to_string());
        Self { path }
    }
}

impl Drop for SweepLock {
    fn drop(&mut self) {
        held_sweep_locks().remove(self.path.as_ref());
    }
}

fn fresh(name: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    format!("{name}-{}", SEQ.fetch_add(1, Ordering::Relaxed))
}

/// The leases and locks under `locks/` as one listing saw them.
#[derive(Debug, Default, Clone)]
pub struct LockListing {
    /// Live writer leases.
    pub writers: Vec<Path>,
    /// Live sweep locks, as listed (a refresh changes the modification time and the e-tag).
    pub sweeps: Vec<ObjectMeta>,
    /// Leases and locks older than the lapse time.
    pub lapsed: Vec<Path>,
}

impl crate::gc::Gc {
    /// List `locks/`: what is live at `now` (younger than `lapse`) and what lapsed.
    pub async fn list_locks(&self, now: DateTime<Utc>, lapse: Duration) -> Result<LockListing> {
        let lapse = chrono::Duration::from_std(lapse)
            .map_err(|_| Error::invalid("grace period is too long"))?;
        let dir = self.objects.keys().locks_dir();
        let metas = self.objects.list_all(&dir).await?;
        Ok(self.sort_locks(metas, now, lapse))
    }

    /// List what a writer must see before it saves: the objects directly under `locks/`, with
    /// a delimiter. That is every sweep lock (and any writer lease a build before the leases were
    /// spread put there) in one page, whatever the number of writers: the leases under
    /// `locks/writers/<2 hex>/` come back as at most 256 common prefixes, which are dropped.
    /// (A full listing reads every other writer's lease: five pages a rank at 4,096 ranks, all
    /// on the prefix `locks/`, past S3's read rate for one prefix.)
    pub async fn list_sweep_locks(&self, now: DateTime<Utc>) -> Result<LockListing> {
        let lapse = chrono::Duration::from_std(LOCK_LAPSE)
            .map_err(|_| Error::invalid("grace period is too long"))?;
        let dir = self.objects.keys().locks_dir();
        let listed = self.objects.list_level(&dir).await?;
        Ok(self.sort_locks(listed.objects, now, lapse))
    }

    fn sort_locks(
        &self,
        metas: Vec<ObjectMeta>,
        now: DateTime<Utc>,
        lapse: chrono::Duration,
    ) -> LockListing {
        let mut out = LockListing::default();
        for m in metas {
            let Some(writer) = self.objects.keys().parse_lock(&m.location) else {
                continue;
            };
            if now - m.last_modified > lapse {
                out.lapsed.push(m.location);
            } else if writer {
                out.writers.push(m.location);
            } else {
                out.sweeps.push(m);
            }
        }
        out
    }

    pub(crate) async fn put_lock(&self, path: &Path, what: &str) -> Result<()> {
        // `n` makes every write's body differ, so that a refreshed lock's e-tag changes even
        // where modification times are coarse (whole seconds on S3).
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let mut body = serde_json::to_vec(&serde_json::json!({
            "what": what,
            "t_ms": self.objects.now().timestamp_millis(),
            "n": WRITES.fetch_add(1, Ordering::Relaxed),
        }))
        .map_err(|e| Error::internal(e.to_string()))?;
        // On a local directory, deleting the last lock removes the empty `locks/` directory
        // (automatic cleanup) and can pull it from under a put of another lock: the put is
        // an overwrite of a fresh key, so trying again is safe. That race passes at once: a put
        // that failed after the store's own retries (seconds) is not tried again.
        let mut attempt = 0;
        let t0 = Instant::now();
        loop {
            match self
                .objects
                .put_object(path, vec![body.clone().into()], PutMode::Overwrite)
                .await
            {
                Err(e)
                    if attempt < 4
                        && t0.elapsed() < Duration::from_millis(500)
                        && matches!(e.kind(), ErrorKind::Backend | ErrorKind::Io) =>
                {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(5 << attempt)).await;
                }
                // A full disk: a lock is its key and its modification time (the body only
                // tells a person what took it), and an empty file needs no data block, so GC
                // can still lock out saves and sweep (FORMAT.md, "A full disk").
                Err(e) if e.kind() == ErrorKind::NoSpace && !body.is_empty() => {
                    debug!(%path, "no space for the lock's body: writing it empty");
                    body.clear();
                }
                r => return r,
            }
        }
    }

    /// Start a save by `writer` of `run`: take a writer lease, wait for any GC sweep to end
    /// (at most [`SWEEP_WAIT`]), then pick the first of `candidates` whose commit record exists
    /// as the dedup base (see the module docs). With no base the save must skip no chunk it
    /// did not write itself.
    pub async fn lease_dedup_base(
        &self,
        run: &str,
        writer: &str,
        candidates: &[u64],
    ) -> Result<WriterLease> {
        self.lease_base(run, writer, candidates, None).await
    }

    /// [`Gc::lease_dedup_base`] for a save of one node of several into its local tier: a
    /// candidate is also the base once the node commit of the node whose first rank is
    /// `node_first` exists (`steps/<s>/nodes/rank-<first>.commit`). A tier holds the step's
    /// commit record only where it is the store itself; GC keeps what a node commit pins.
    pub async fn lease_node_dedup_base(
        &self,
        run: &str,
        writer: &str,
        node_first: u32,
        candidates: &[u64],
    ) -> Result<WriterLease> {
        self.lease_base(run, writer, candidates, Some(node_first))
            .await
    }

    /// Whether `step` may be a dedup base: committed, or (`node_first`) node-committed.
    async fn base_committed(&self, run: &str, step: u64, node_first: Option<u32>) -> Result<bool> {
        let keys = self.objects.keys();
        if self.objects.exists(&keys.commit(run, step)).await? {
            return Ok(true);
        }
        match node_first {
            Some(first) => {
                self.objects
                    .exists(&keys.node_commit(run, step, first))
                    .await
            }
            None => Ok(false),
        }
    }

    async fn lease_base(
        &self,
        run: &str,
        writer: &str,
        candidates: &[u64],
        node_first: Option<u32>,
    ) -> Result<WriterLease> {
        validate_run(run)?;
        let path = self.objects.keys().writer_lock(&fresh(writer));
        self.put_lock(&path, &format!("save of run {run}"))
            .await
            .map_err(|e| e.context("taking a writer lease"))?;
        let lease = WriterLease { path, base: None };
        if let Err(e) = self.wait_for_sweeps(run).await {
            let _ = self.release_lease(lease).await;
            return Err(e);
        }
        for (i, &step) in candidates.iter().enumerate() {
            // The newest candidate is usually the previous save, whose commit may still be on
            // its way (saves back to back): give it a moment rather than lose its dedup.
            let until = Instant::now()
                + if i == 0 {
                    PENDING_BASE_WAIT
                } else {
                    Duration::ZERO
                };
            let mut pause = Duration::from_millis(10);
            loop {
                match self.base_committed(run, step, node_first).await {
                    Ok(true) => {
                        return Ok(WriterLease {
                            base: Some(step),
                            ..lease
                        });
                    }
                    Ok(false) if Instant::now() < until => {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(200));
                    }
                    Ok(false) => {
                        debug!(run, step, "not committed (or deleted): not a dedup base");
                        break;
                    }
                    Err(e) => {
                        let _ = self.release_lease(lease).await;
                        return Err(e);
                    }
                }
            }
        }
        Ok(lease)
    }

    /// Wait while a live GC sweep holds a sweep lock (at most [`SWEEP_WAIT`]); delete a lock
    /// its GC stopped refreshing (see the module docs) and go on.
    async fn wait_for_sweeps(&self, run: &str) -> Result<()> {
        let lapse = self.objects.config().sweep_lapse;
        // A pause of this writer, or a listing, longer than this restarts the watch.
        let watch = lapse / 3;
        let t0 = Instant::now();
        let mut pause = Duration::from_millis(5);
        // Each sweep lock seen: its last write as listed (time, e-tag) and the end of the
        // listing that first returned that write.
        type Write = (DateTime<Utc>, Option<String>);
        let mut seen: HashMap<Path, (Write, Instant)> = HashMap::new();
        // When this listing was due: the last one's end plus the pause slept since.
        let mut due: Option<Instant> = None;
        loop {
            let now = self.objects.now();
            let start = Instant::now();
            let locks = self.list_sweep_locks(now).await?;
            let end = Instant::now();
            // This writer woke up late (paused, or starved of CPU along with the GC), or the
            // listing was slow (a refresh may wait behind it): what it saw says nothing about
            // whether the GC refreshed meanwhile. Watch each lock afresh.
            let late = due.map_or(Duration::ZERO, |d| start.saturating_duration_since(d));
            if late > watch || end - start > watch {
                debug!(
                    late_ms = late.as_millis() as u64,
                    listing_ms = (end - start).as_millis() as u64,
                    "a gap in watching the sweep locks: watching afresh"
                );
                seen.clear();
            }
            let mut live = None;
            let mut dead = Vec::new();
            for m in locks.sweeps {
                let write = (m.last_modified, m.e_tag.clone());
                let first = match seen.get(&m.location) {
                    Some((w, at)) if *w == write => *at,
                    _ => {
                        seen.insert(m.location.clone(), (write, end));
                        end
                    }
                };
                let unchanged = start.saturating_duration_since(first);
                let age = (now - m.last_modified).to_std().unwrap_or_default();
                if sweep_lock_orphaned(&m.location) {
                    warn!(
                        lock = %m.location,
                        "the GC that holds this sweep lock ran on this machine and is gone (killed)"
                    );
                    dead.push(m.location);
                } else if unchanged >= lapse || age >= 4 * lapse {
                    dead.push(m.location);
                } else {
                    live.get_or_insert(m.location);
                }
            }
            if !dead.is_empty() {
                warn!(
                    lock = %dead[0],
                    n = dead.len(),
                    lapse_s = lapse.as_secs_f64(),
                    "a GC sweep lock was not refreshed within its lapse: its GC is gone; \
                     deleting the lock"
                );
                self.objects.delete_all(dead).await?;
            }
            let Some(sweep) = live else {
                return Ok(());
            };
            if t0.elapsed() > SWEEP_WAIT {
                return Err(Error::new(
                    ErrorKind::Conflict,
                    format!(
                        "a GC sweep ({sweep}) has been running for over {} s; this save of run \
                         {run} waits for it and gave up (a killed GC's lock is taken as dead \
                         once it is not refreshed for {} s)",
                        SWEEP_WAIT.as_secs(),
                        lapse.as_secs_f64()
                    ),
                ));
            }
            debug!(%sweep, "waiting for a GC sweep to end");
            due = Some(Instant::now() + pause);
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// End a save's lease (its manifest is written, or it failed).
    pub async fn release_lease(&self, lease: WriterLease) -> Result<()> {
        self.objects.delete_all(vec![lease.path]).await
    }

    /// Take a sweep lock for a GC at `now`: `Ok(Some(lock))` when no writer holds a live lease
    /// (the sweep may go on), `Ok(None)` when one does (the lock is given back at once).
    pub(crate) async fn take_sweep_lock(
        &self,
        now: DateTime<Utc>,
        lapse: Duration,
    ) -> Result<std::result::Result<SweepLock, Vec<Path>>> {
        let path = self.objects.keys().sweep_lock(&sweep_lock_name());
        let lock = SweepLock::new(path.clone());
        self.put_lock(&path, "gc sweep").await?;
        let locks = self.list_locks(now, lapse).await?;
        if !locks.lapsed.is_empty() {
            info!(n = locks.lapsed.len(), "deleting lapsed leases and locks");
            self.objects.delete_all(locks.lapsed).await?;
        }
        if locks.writers.is_empty() {
            Ok(Ok(lock))
        } else {
            self.objects.delete_all(vec![path]).await?;
            Ok(Err(locks.writers))
        }
    }
}

/// What a rank's next save may skip: the chunks of the committed step it last saved or
/// restored. The chunks of a save whose commit is not yet known stay *pending* until a lease
/// finds that step committed; a step whose commit failed never becomes the base.
///
/// Use: [`DedupBase::candidates`], then [`Gc::lease_dedup_base`](crate::Gc::lease_dedup_base), then
/// [`DedupBase::pinned`] for the index; release the lease when the save's manifest is written.
#[derive(Debug, Default, Clone)]
pub struct DedupBase {
    base: Option<(u64, Vec<ChunkRef>)>,
    pending: Option<(u64, Vec<ChunkRef>)>,
    /// The same steps' chunks by region (delta bases), when the manifest was given.
    base_regions: Option<(u64, Arc<BaseRegions>)>,
    pending_regions: Option<(u64, Arc<BaseRegions>)>,
}

impl DedupBase {
    /// Nothing known.
    pub fn new() -> Self {
        Self::default()
    }

    /// `step` is committed (restored from it, say) and this rank's part references `refs`.
    pub fn seed(&mut self, step: u64, refs: Vec<ChunkRef>) {
        self.base = Some((step, refs));
        self.pending = None;
        self.base_regions = None;
        self.pending_regions = None;
    }

    /// This rank's manifest of `step` is written; whether the step commits is not known yet.
    pub fn persisted(&mut self, step: u64, refs: Vec<ChunkRef>) {
        self.pending = Some((step, refs));
        self.pending_regions = None;
    }

    /// [`DedupBase::seed`] from this rank's manifest of committed step `m.step`: its chunks
    /// also become the delta bases of the next save (by region).
    pub fn seed_manifest(&mut self, m: &RankManifest) {
        self.seed(m.step, manifest_refs(m));
        self.base_regions = Some((m.step, Arc::new(BaseRegions::of(m))));
    }

    /// [`DedupBase::persisted`] from the manifest written, so that the step, once found
    /// committed, also gives the next save its delta bases.
    pub fn persisted_manifest(&mut self, m: &RankManifest) {
        self.persisted(m.step, manifest_refs(m));
        self.pending_regions = Some((m.step, Arc::new(BaseRegions::of(m))));
    }

    /// The committed step the last pinned save built on.
    pub fn base_step(&self) -> Option<u64> {
        self.base.as_ref().map(|(s, _)| *s)
    }

    /// The steps to try as the base, best first: the pending save, then the base.
    pub fn candidates(&self) -> Vec<u64> {
        let mut c: Vec<u64> = self.pending.iter().map(|(s, _)| *s).collect();
        if let Some(b) = self.base_step()
            && !c.contains(&b)
        {
            c.push(b);
        }
        c
    }

    /// The index for a save whose lease found `base` committed
    /// ([`WriterLease::base`] over [`DedupBase::candidates`]): that step's chunks, or nothing.
    pub fn pinned(&mut self, base: Option<u64>) -> DedupIndex {
        let index = DedupIndex::new();
        let Some(step) = base else {
            // Neither step is committed any more (or ever was): skip nothing.
            self.base = None;
            return index;
        };
        if self.pending.as_ref().is_some_and(|(s, _)| *s == step) {
            self.base = self.pending.take();
            self.base_regions = self.pending_regions.take();
        }
        match &self.base {
            Some((s, refs)) if *s == step => index.extend(refs.iter()),
            _ => self.base = None,
        }
        match &self.base_regions {
            Some((s, r)) if *s == step && self.base.is_some() => {
                index.set_base_regions(step, r.clone())
            }
            _ => self.base_regions = None,
        }
        index
    }
}

/// Every chunk reference of a rank manifest (tensors, then blobs).
fn manifest_refs(m: &RankManifest) -> Vec<ChunkRef> {
    m.tensors
        .iter()
        .flat_map(|t| t.chunks.iter())
        .chain(m.blobs.iter().flat_map(|b| b.chunks.iter()))
        .cloned()
        .collect()
}
