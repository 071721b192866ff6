//! Node commits: in a job of several machines each node's local tier holds the manifests of
//! that node's ranks only, so no node can commit a step there. A node commits its ranks
//! instead: once every rank of the node has written its manifest of a generation, the node's
//! first rank creates `steps/<step>/nodes/rank-<first>.commit` ([`NodeCommit`]), which pins
//! them by hash (one per node: nodes that share a tier keep theirs apart).
//! The step is then local-durable on that node; each node drains its own ranks to the remote
//! store, and the drain that brings the last rank's manifest commits the step there
//! ([`crate::tier::drain_node`]).
//!
//! A node commit is a root for retention and GC like a commit record (its manifests and
//! chunks are kept; `keep_last` counts it), but never a restorable step: a restore reads the
//! remote commit, taking from the local tier the chunks it holds.

use std::time::{Duration, Instant};

use object_store::PutMode;
use serde::{Deserialize, Serialize};

use object_store::path::Path;

use super::CommitLog;
use crate::error::{Error, ErrorKind, Result};
use crate::keys::{StepObject, validate_run};
use crate::model::{RankEntry, RankManifest};

/// A node's commit of its ranks of a step in its local tier (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeCommit {
    /// Run.
    pub run: String,
    /// Step.
    pub step: u64,
    /// The generation whose manifests it pins.
    pub generation: u64,
    /// The job's world size at save time (the remote commit needs every rank).
    pub world: u32,
    /// The node, when a driver said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    /// The node's ranks, each manifest pinned by hash.
    pub ranks: Vec<RankEntry>,
    /// When it was created (Unix milliseconds).
    pub committed_ms: i64,
}

impl NodeCommit {
    /// The ranks, in order.
    pub fn rank_numbers(&self) -> Vec<u32> {
        self.ranks.iter().map(|e| e.rank).collect()
    }
}

/// Reads and conditional writes of a node commit before giving up on other committers.
const NODE_COMMIT_TRIES: usize = 8;

impl CommitLog {
    /// Commit `ranks` of `step` on this node (see the module docs): wait until each has
    /// written its manifest of `generation` (polling every `poll`, until `timeout`), then
    /// create the node commit. An existing node commit of the same generation is returned
    /// (a second committer); one of an older generation (a dead attempt) is replaced, only
    /// as it was read (a conditional update), so a stale committer never replaces a newer
    /// generation's commit that appeared meanwhile ([`ErrorKind::Fenced`]).
    pub async fn commit_node(
        &self,
        run: &str,
        step: u64,
        generation: u64,
        ranks: &[u32],
        (poll, timeout): (Duration, Duration),
    ) -> Result<NodeCommit> {
        validate_run(run)?;
        if ranks.is_empty() {
            return Err(Error::invalid(format!(
                "step {step} of run {run}: a node commit needs at least one rank"
            )));
        }
        self.join_generation(run, generation).await?;
        let deadline = Instant::now() + timeout;
        let manifests = loop {
            match self.node_manifests(run, step, generation, ranks).await {
                Ok(m) => break m,
                Err(e) if e.kind() == ErrorKind::Incomplete && Instant::now() < deadline => {
                    tokio::time::sleep(poll).await;
                }
                Err(e) => return Err(e),
            }
        };
        let world = manifests[0].0.layout.world();
        let node = manifests[0].0.node;
        let rec = NodeCommit {
            run: run.to_string(),
            step,
            generation,
            world,
            node,
            ranks: manifests
                .iter()
                .map(|(m, hash, size)| RankEntry {
                    rank: m.rank,
                    hash: *hash,
                    size: *size,
                })
                .collect(),
            committed_ms: self.objects.now().timestamp_millis(),
        };
        let first = ranks.iter().copied().min().unwrap_or_default();
        let key = self.objects.keys().node_commit(run, step, first);
        // Read, decide, and write only over what was read (a conditional update): a newer
        // generation's committer that wrote in between makes the write fail, and the next
        // read fences this one, where an overwrite would have replaced its record.
        for _ in 0..NODE_COMMIT_TRIES {
            let (old, mode) = match self.objects.get_versioned(&key).await {
                Ok((body, v)) => {
                    let mode = if v.e_tag.is_some() || v.version.is_some() {
                        PutMode::Update(v)
                    } else {
                        PutMode::Overwrite
                    };
                    // An unreadable record (a torn write of a build without fsync) is replaced.
                    (serde_json::from_slice::<NodeCommit>(&body).ok(), mode)
                }
                Err(e) if e.kind() == ErrorKind::NotFound => (None, PutMode::Create),
                Err(e) => {
                    return Err(
                        e.context(format!("committing step {step} of run {run} on this node"))
                    );
                }
            };
            match old {
                Some(old)
                    if old.generation == generation && old.rank_numbers() == rec.rank_numbers() =>
                {
                    return Ok(old);
                }
                Some(old) if old.generation > generation => {
                    return Err(Error::new(
                        ErrorKind::Fenced,
                        format!(
                            "step {step} of run {run}: generation {} committed it on this node; \
                             generation {generation} is stale",
                            old.generation
                        ),
                    ));
                }
                _ => {}
            }
            self.objects.failpoints().hit("before_node_commit").await?;
            let conditional = matches!(mode, PutMode::Update(_));
            match self.objects.put_json(&key, &rec, mode).await {
                Ok(_) => return Ok(rec),
                // Another committer of this node wrote it since: read it again.
                Err(e) if e.kind() == ErrorKind::Conflict => continue,
                // A tier without conditional updates: the last writer wins, as it must there.
                Err(e) if conditional && e.kind() == ErrorKind::InvalidInput => {
                    tracing::debug!(%key, "no conditional update on this tier: {e}");
                    self.objects
                        .put_json(&key, &rec, PutMode::Overwrite)
                        .await
                        .map_err(|e| {
                            e.context(format!("committing step {step} of run {run} on this node"))
                        })?;
                    return Ok(rec);
                }
                Err(e) => {
                    return Err(
                        e.context(format!("committing step {step} of run {run} on this node"))
                    );
                }
            }
        }
        Err(Error::new(
            ErrorKind::Conflict,
            format!(
                "step {step} of run {run}: its node commit at {key} changed under each of \
                 {NODE_COMMIT_TRIES} tries to commit it"
            ),
        ))
    }

    /// The manifests of `ranks` of `generation`, each with its hash and size; `Incomplete`
    /// names the ranks not there yet.
    async fn node_manifests(
        &self,
        run: &str,
        step: u64,
        generation: u64,
        ranks: &[u32],
    ) -> Result<Vec<(RankManifest, crate::id::Hash, u64)>> {
        let found: Vec<Option<(RankManifest, crate::id::Hash, u64)>> =
            futures::future::try_join_all(
                ranks
                    .iter()
                    .map(|&r| self.node_manifest(run, step, generation, r)),
            )
            .await?;
        let missing: Vec<u32> = ranks
            .iter()
            .zip(&found)
            .filter(|(_, f)| f.is_none())
            .map(|(&r, _)| r)
            .collect();
        if !missing.is_empty() {
            return Err(Error::incomplete(format!(
                "step {step} of run {run}: the manifests of ranks {missing:?} (generation \
                 {generation}) are not in this node's tier yet"
            )));
        }
        Ok(found.into_iter().flatten().collect())
    }

    /// Rank `r`'s manifest of `step` if it is of `generation` (an older one: not yet).
    async fn node_manifest(
        &self,
        run: &str,
        step: u64,
        generation: u64,
        r: u32,
    ) -> Result<Option<(RankManifest, crate::id::Hash, u64)>> {
        match self.get_rank_manifest(run, step, r).await {
            Ok(m) if m.0.generation == generation => Ok(Some(m)),
            Ok(m) if m.0.generation > generation => Err(Error::new(
                ErrorKind::Fenced,
                format!(
                    "step {step} of run {run}: rank {r} saved it as generation {}; \
                     generation {generation} is stale",
                    m.0.generation
                ),
            )),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The keys of `step`'s node commits in this (local) tier.
    pub async fn node_commit_keys(&self, run: &str, step: u64) -> Result<Vec<Path>> {
        validate_run(run)?;
        let dir = self.objects.keys().node_commits_dir(run, step);
        let mut keys: Vec<Path> = self
            .objects
            .list_all(&dir)
            .await?
            .into_iter()
            .map(|m| m.location)
            .filter(|p| {
                matches!(
                    self.objects.keys().parse_step_object(p),
                    Some((_, _, StepObject::NodeCommit(_)))
                )
            })
            .collect();
        keys.sort();
        Ok(keys)
    }

    /// `step`'s node commits in this (local) tier, by first rank: one on a node's own disk,
    /// one per node where nodes share the tier. `NotFound` when there is none.
    pub async fn read_node_commits(&self, run: &str, step: u64) -> Result<Vec<NodeCommit>> {
        let keys = self.node_commit_keys(run, step).await?;
        if keys.is_empty() {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("step {step} of run {run} has no node commit in this tier"),
            ));
        }
        let mut out = Vec::new();
        for k in keys {
            match self.objects.get_json::<NodeCommit>(&k).await {
                Ok((c, _, _)) => out.push(c),
                // Retired since the listing.
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(e.context(format!("reading the node commit {k}"))),
            }
        }
        Ok(out)
    }

    /// The steps of `run` with a node commit in this (local) tier, oldest first.
    pub async fn node_committed_steps(&self, run: &str) -> Result<Vec<u64>> {
        Ok(self
            .list_steps(run)
            .await?
            .into_iter()
            .filter(|s| s.node_commit)
            .map(|s| s.step)
            .collect())
    }

    /// The manifests `c` pins, each checked against its hash.
    pub async fn node_commit_manifests(&self, c: &NodeCommit) -> Result<Vec<RankManifest>> {
        futures::future::try_join_all(
            c.ranks
                .iter()
                .map(|e| self.read_rank_manifest(&c.run, c.step, e.rank, Some(e))),
        )
        .await
    }
}
