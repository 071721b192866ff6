//! Restoring a step onto what a rank registered: [`Restorer`] chooses the step to resume from
//! and reads a step into the registered tensors (through the process's shared chunk cache, the
//! node's cache and the peer replicas), the [`Stateful`](super::Stateful) items and the
//! monitor's window; the manager then re-bases its other parts on the step.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use ckpt_recovery::peer::PeerSource;
use ckpt_recovery::records;
use ckpt_store::{ChunkCache, Error, NdBox, RankManifest, ReadStats, Result, StepReader, Store};
use parking_lot::Mutex;
use tracing::{info, warn};

use super::ManagerConfig;
use super::registry::{MONITOR_BLOB, Registry};
use super::tier::TieredSource;
use crate::monitor::{Monitor, MonitorState};
use crate::restore::{RestoreTarget, restore_targets};
use crate::save::{CheckpointerConfig, runtime};

/// The chunk cache that every restore running in this process at the same time shares.
///
/// Ranks run as threads of one process (one process per node, or the reference workload)
/// restore at about the same time; after a reshard their boxes cut the same chunks (a
/// tensor-parallel split along columns needs a part of every row, so every chunk of the old
/// shard), and each chunk is then fetched and decoded once instead of once per rank. Chunks
/// are content-addressed, so sharing across stores and runs is sound. The cache lives while
/// some restore holds it and is freed when the last one ends; `cap` sizes a new one. A caller
/// that restores ranks one after another holds the returned cache across them.
pub fn shared_restore_cache(cap: usize) -> Arc<ChunkCache> {
    static CACHE: Mutex<Weak<ChunkCache>> = Mutex::new(Weak::new());
    let mut slot = CACHE.lock();
    if let Some(c) = slot.upgrade() {
        return c;
    }
    let c = ChunkCache::new(cap as u64);
    *slot = Arc::downgrade(&c);
    c
}

/// Managers alive in this process: more than one means ranks run as threads of it.
static LIVE_RESTORERS: AtomicUsize = AtomicUsize::new(0);

/// The stores a restore reads: the run's store (the remote one under a local tier), and the
/// local tier, if any.
pub(crate) struct Tiers<'a> {
    pub(crate) main: &'a Store,
    pub(crate) local: Option<&'a Store>,
}

impl Tiers<'_> {
    /// Whether `step` of `run` is committed in the local tier (`None`: no tier).
    fn in_local(&self, run: &str, step: u64) -> Result<Option<bool>> {
        match self.local {
            Some(l) => runtime()
                .block_on(l.objects().exists(&l.keys().commit(run, step)))
                .map(Some),
            None => Ok(None),
        }
    }
}

/// The restore settings of a manager.
pub(crate) struct Restorer {
    /// Bytes in flight; also the size of the chunk cache shared by ranks that run as threads of
    /// one process.
    budget: usize,
    /// The node's shared restore cache.
    node_cache: Option<PathBuf>,
    /// Whether other rank processes of this machine restore the replicated tensors too (see
    /// [`ManagerConfig::node_processes`]).
    node_shares: bool,
    /// The step to resume from, exactly.
    resume_step: Option<u64>,
}

/// A step restored: what the manager logs, and this rank's manifest when the layout is the
/// same (the next save's dedup base).
pub(crate) struct Restored {
    pub(crate) record: records::Restore,
    /// Local-tier chunks the restore read from the remote store instead (missing or damaged).
    pub(crate) local_damaged: Option<records::LocalTierDamaged>,
    pub(crate) manifest: Option<Arc<RankManifest>>,
    stats: ReadStats,
    cache: Arc<ChunkCache>,
    t0: Instant,
}

impl Restored {
    /// Stamp the restore's duration (taken once the manager re-based its parts on the step).
    pub(crate) fn finish(&mut self) {
        self.record.seconds = self.t0.elapsed().as_secs_f64();
    }

    /// The `restored` trace line.
    pub(crate) fn trace(&self) {
        let (hits, misses) = self.cache.counts();
        let (s, r) = (&self.stats, &self.record);
        info!(
            step = r.step,
            bytes = s.bytes_copied,
            from_peers = s.source_bytes,
            from_store = s.stored_bytes,
            from_node = s.node_bytes,
            chunks = s.chunks,
            cache_hits = hits,
            cache_misses = misses,
            seconds = r.seconds,
            from = %r.from_layout,
            to = %r.to_layout,
            "restored"
        );
    }
}

impl Drop for Restorer {
    fn drop(&mut self) {
        LIVE_RESTORERS.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Restorer {
    /// The settings of `cfg`.
    pub(crate) fn new(cfg: &ManagerConfig) -> Self {
        LIVE_RESTORERS.fetch_add(1, Ordering::Relaxed);
        Restorer {
            budget: cfg.restore_budget,
            node_cache: cfg.node_cache.clone(),
            node_shares: cfg.node_processes != Some(1),
            resume_step: cfg.resume_step,
        }
    }

    /// The step a resume restores: the resume step when set (it must be committed, in either
    /// tier), else the newest step of `run` committed in either tier, if any.
    pub(crate) fn resume_target(&self, tiers: &Tiers<'_>, run: &str) -> Result<Option<u64>> {
        let store = tiers.main;
        match self.resume_step {
            Some(step) => {
                let remote =
                    runtime().block_on(store.objects().exists(&store.keys().commit(run, step)))?;
                if !remote && tiers.in_local(run, step)? != Some(true) {
                    return Err(Error::not_found(format!(
                        "the resume step {step} of run {run} is not committed (CKPT_RESUME_STEP or ManagerConfig::resume_step)"
                    )));
                }
                Ok(Some(step))
            }
            None => {
                let remote = runtime().block_on(store.log().latest_committed(run))?;
                let local = match tiers.local {
                    Some(l) => runtime().block_on(l.log().latest_committed(run))?,
                    None => None,
                };
                Ok(remote.max(local))
            }
        }
    }

    /// Read `step` into `registry`'s tensors and items and `monitor` (when enabled), whatever
    /// layout saved it.
    pub(crate) fn restore(
        &self,
        tiers: &Tiers<'_>,
        cfg: &CheckpointerConfig,
        step: u64,
        registry: &Registry,
        monitor: &mut Monitor,
    ) -> Result<Restored> {
        let t0 = Instant::now();
        runtime().block_on(tiers.main.failpoints().hit("before_restore"))?;
        // Ranks as threads of this process restore together and share the cache; a process of
        // one rank reads each chunk once (a cache would only hold its read buffers away from
        // their pool, so each read would fill fresh memory), so its cache merges concurrent
        // fetches only.
        let cache = if LIVE_RESTORERS.load(Ordering::Relaxed) > 1 {
            shared_restore_cache(self.budget)
        } else {
            ChunkCache::new(0)
        };
        let (reader, source, from_local) = self.open(tiers, cfg, step, registry, &cache)?;
        let targets = registry.restore_targets()?;
        let stats = runtime().block_on(self.read(&reader, cfg, targets))?;
        let same_layout = reader.commit().layout == cfg.layout;
        registry.load_stateful(&reader, cfg, same_layout)?;
        if monitor.enabled() {
            restore_monitor(&reader, monitor, cfg, same_layout)?;
        }
        let manifest = if same_layout {
            Some(runtime().block_on(reader.manifest(cfg.rank))?)
        } else {
            None
        };
        let (local_bytes, local_raw, damaged) = source.local_served();
        let mut record = records::Restore {
            step,
            rank: cfg.rank,
            generation: cfg.generation,
            from_layout: reader.commit().layout.to_string(),
            to_layout: cfg.layout.to_string(),
            bytes: stats.bytes_copied,
            bytes_from_peers: stats.source_bytes.saturating_sub(local_raw),
            bytes_from_peers_mapped: source.peer_bytes_mapped(),
            bytes_from_store: stats.stored_bytes,
            bytes_from_node: stats.node_bytes,
            bytes_from_local: local_bytes,
            tier: String::new(),
            seconds: 0.0,
        };
        // Chunks the local tier could not serve (missing or damaged) came from the remote.
        let mut local_misses = damaged;
        let mut local_damaged = None;
        if let Some(local) = tiers.local {
            record.tier = if from_local { "local" } else { "remote" }.into();
            if from_local {
                // The reader read the local tier; what it could not serve came from the remote.
                record.bytes_from_local = stats.stored_bytes;
                record.bytes_from_store = stats.fallback_bytes;
                // The blobs' chunks too: one the local tier held damaged is named like a
                // tensor's.
                local_misses = stats.fallback_chunks + reader.blob_stats().fallback_chunks;
            }
            if local_misses > 0 {
                warn!(
                    step,
                    chunks = local_misses,
                    "local chunks were missing or damaged: read from the remote store"
                );
                local_damaged = Some(records::LocalTierDamaged {
                    step,
                    rank: cfg.rank,
                    chunks: local_misses,
                    local: local.url().to_string(),
                });
            }
        }
        Ok(Restored {
            record,
            local_damaged,
            manifest,
            stats,
            cache,
            t0,
        })
    }

    /// Read `targets`. Without a node cache, in a data-parallel layout, the tensors this rank
    /// restores whole are most likely the replicas every rank of the node restores whole
    /// (DDP under `torchrun`): they are read through the page cache ([`StepReader::shared`]),
    /// so the node's disk serves them once rather than once per rank with `O_DIRECT`. The
    /// rest (this rank's own shards, ZeRO partitions) goes around it, and so does everything
    /// when this rank's process is the only one of the job on its machine.
    async fn read(
        &self,
        reader: &StepReader,
        cfg: &CheckpointerConfig,
        targets: Vec<RestoreTarget>,
    ) -> Result<ReadStats> {
        let replicas = self.node_shares
            && self.node_cache.is_none()
            && cfg.layout.dp > 1
            && cfg.layout.zero < 3;
        let (whole, own): (Vec<_>, Vec<_>) = targets
            .into_iter()
            .partition(|t| replicas && t.bbox == NdBox::full(&t.shape));
        let mut stats = restore_targets(reader, &own, self.budget).await?;
        if !whole.is_empty() {
            let shared = reader.clone().shared(true);
            stats.add(&restore_targets(&shared, &whole, self.budget).await?);
        }
        Ok(stats)
    }

    /// A reader of `step` for the registered tensors, with the shared cache, the node's cache
    /// and the peer replicas in front of the store. Under a local tier: of the tier when the
    /// step is committed there (the remote store behind it for a chunk it cannot serve), else
    /// of the remote store with the tier's chunks in front. The reader, its chunk source, and
    /// whether it reads the local tier.
    fn open(
        &self,
        tiers: &Tiers<'_>,
        cfg: &CheckpointerConfig,
        step: u64,
        registry: &Registry,
        cache: &Arc<ChunkCache>,
    ) -> Result<(StepReader, Arc<TieredSource>, bool)> {
        let from_local = tiers.in_local(&cfg.run, step)? == Some(true);
        let store = match (from_local, tiers.local) {
            (true, Some(l)) => l,
            _ => tiers.main,
        };
        let mut reader = runtime()
            // Only the record's parts that hold this rank's tensors (format 5): the metadata a
            // rank reads does not grow with the world.
            .block_on(StepReader::open_tensors(
                store,
                &cfg.run,
                step,
                registry.tensor_names(),
            ))?
            .with_cache(cache.clone());
        if let Some(dir) = &self.node_cache {
            match ckpt_store::NodeCache::open(dir) {
                Ok(n) => reader = reader.with_node_cache(Arc::new(n)),
                Err(e) => warn!("restoring without the node's shared cache: {e}"),
            }
        }
        // The local tier (when the reader is the remote's), then replica agents (memory of the
        // surviving nodes), the store for the rest.
        let peers = cfg
            .peer
            .as_ref()
            .filter(|l| !l.peers.is_empty())
            .map(|link| PeerSource::new(&link.peers, &link.secret));
        let local = tiers.local.filter(|_| !from_local).cloned();
        let source = Arc::new(TieredSource::new(local, peers));
        if source.has_any() {
            reader = reader.with_source(source.clone());
        }
        if from_local {
            reader = reader.with_fallback(tiers.main.clone());
        }
        Ok((reader, source, from_local))
    }
}

/// The monitor's window and history from `reader`: this rank's when the layout is the same,
/// rank 0's otherwise; a fresh window (a new warm-up) when the step has none.
fn restore_monitor(
    reader: &StepReader,
    monitor: &mut Monitor,
    cfg: &CheckpointerConfig,
    same_layout: bool,
) -> Result<()> {
    let blob = format!("rank/{MONITOR_BLOB}");
    let rank = if same_layout { cfg.rank } else { 0 };
    let m = runtime().block_on(reader.manifest(rank))?;
    if !m.blobs.iter().any(|b| b.name == blob) {
        info!(
            step = reader.commit().step,
            "the checkpoint has no monitor state: the spike monitor warms up again"
        );
        monitor.reset_window();
        return Ok(());
    }
    let bytes = runtime().block_on(reader.read_blob(rank, &blob))?;
    let state: MonitorState = serde_json::from_slice(&bytes).map_err(|e| {
        Error::corrupt(format!(
            "monitor state of rank {rank} at step {} of run {}: {e}",
            reader.commit().step,
            cfg.run
        ))
    })?;
    monitor.load_state(state);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::MonitorConfig;

    fn one(store: &Store) -> Tiers<'_> {
        Tiers {
            main: store,
            local: None,
        }
    }

    #[test]
    fn restores_at_the_same_time_share_one_cache() {
        let a = shared_restore_cache(1 << 20);
        let b = shared_restore_cache(2 << 20);
        assert!(Arc::ptr_eq(&a, &b));
        drop((a, b));
    }

    #[test]
    fn a_resume_step_must_be_committed() {
        let store = Store::memory();
        let mut cfg = ManagerConfig::new(CheckpointerConfig::new(
            "r",
            0,
            "dp=1,tp=1,pp=1".parse().unwrap(),
        ));
        assert_eq!(
            Restorer::new(&cfg)
                .resume_target(&one(&store), "r")
                .unwrap(),
            None
        );
        cfg.resume_step = Some(7);
        let e = Restorer::new(&cfg)
            .resume_target(&one(&store), "r")
            .unwrap_err();
        assert_eq!(e.kind(), ckpt_store::ErrorKind::NotFound);
        assert!(e.to_string().contains("resume step 7"), "{e}");
    }

    #[test]
    fn nothing_registered_nothing_to_read() {
        let store = Store::memory();
        let cfg = CheckpointerConfig::new("r", 0, "dp=1,tp=1,pp=1".parse().unwrap());
        let mut monitor = Monitor::new(MonitorConfig::default());
        let r = Restorer::new(&ManagerConfig::new(cfg.clone()));
        let e = r.restore(&one(&store), &cfg, 3, &Registry::default(), &mut monitor);
        assert!(e.is_err(), "step 3 was never saved");
    }
}
