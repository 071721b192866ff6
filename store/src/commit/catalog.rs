//! Listing runs and steps: the [`CommitLog`] read as a catalog.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use futures::{StreamExt, TryStreamExt, stream};
use serde::Serialize;

use super::CommitLog;
use crate::error::{Error, ErrorKind, Result};
use crate::keys::{StepObject, validate_run};
use crate::model::{ChunkRef, CommitRecord};

/// One step of a run as the store lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepListing {
    /// Step number.
    pub step: u64,
    /// Whether its commit record exists.
    pub committed: bool,
    /// Whether a node commit exists (a local tier of a job of several machines: the node's
    /// ranks are local-durable, [`crate::NodeCommit`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub node_commit: bool,
    /// Ranks whose manifests exist.
    pub ranks: Vec<u32>,
    /// Newest modification of any of its objects.
    pub last_modified: DateTime<Utc>,
    /// Bytes of its manifests and commit record.
    pub meta_bytes: u64,
}

impl CommitLog {
    /// The runs in the store, sorted.
    pub async fn list_runs(&self) -> Result<Vec<String>> {
        let dir = self.objects.keys().runs_dir();
        let res = self.objects.list_level(&dir).await?;
        let mut runs: Vec<String> = res
            .common_prefixes
            .iter()
            .filter_map(|p| self.objects.keys().parse_run_dir(p))
            .collect();
        runs.sort();
        Ok(runs)
    }

    /// Every step of `run` with any object, committed or not, sorted by step.
    pub async fn list_steps(&self, run: &str) -> Result<Vec<StepListing>> {
        validate_run(run)?;
        let dir = self.objects.keys().steps_dir(run);
        self.list_step_objects(&dir).await
    }

    /// The steps with objects below `dir` (a run's steps, or one step), listed object by object.
    async fn list_step_objects(&self, dir: &object_store::path::Path) -> Result<Vec<StepListing>> {
        let metas = self.objects.list_all(dir).await?;
        let mut steps: BTreeMap<u64, StepListing> = BTreeMap::new();
        for m in metas {
            let Some((_, step, what)) = self.objects.keys().parse_step_object(&m.location) else {
                continue;
            };
            let e = steps.entry(step).or_insert_with(|| StepListing {
                step,
                committed: false,
                node_commit: false,
                ranks: Vec::new(),
                last_modified: m.last_modified,
                meta_bytes: 0,
            });
            e.last_modified = e.last_modified.max(m.last_modified);
            e.meta_bytes += m.size;
            match what {
                StepObject::Commit => e.committed = true,
                StepObject::RankManifest(r) => e.ranks.push(r),
                StepObject::RecordPart(_) => {}
                StepObject::NodeCommit(_) => e.node_commit = true,
            }
        }
        let mut out: Vec<StepListing> = steps.into_values().collect();
        for s in &mut out {
            s.ranks.sort_unstable();
        }
        Ok(out)
    }

    /// The steps of `run` as `ckpt ls RUN` shows them, each committed one with its record: one
    /// listing page per thousand steps and one get per step, whatever the world size. Only a
    /// step whose record is missing or unreadable is listed object by object (its ranks, and
    /// whether `COMMIT` exists; the record's error comes back with it). [`CommitLog::list_steps`]
    /// lists every object of every step instead: thousands of pages for a long run of thousands
    /// of ranks. For a committed step, `last_modified` is the record's `committed_ms`.
    pub async fn list_steps_with_records(
        &self,
        run: &str,
    ) -> Result<Vec<(StepListing, Option<Result<CommitRecord>>)>> {
        let steps = self.step_numbers(run).await?;
        let found: Vec<Option<(StepListing, Option<Result<CommitRecord>>)>> = stream::iter(steps)
            .map(|step| async move {
                match self.read_commit_sized(run, step).await {
                    Ok((c, _, size)) => Ok(Some((
                        StepListing {
                            step,
                            committed: true,
                            node_commit: false,
                            ranks: c.ranks.iter().map(|e| e.rank).collect(),
                            last_modified: DateTime::from_timestamp_millis(c.committed_ms)
                                .unwrap_or_default(),
                            meta_bytes: size + c.ranks.iter().map(|e| e.size).sum::<u64>(),
                        },
                        Some(Ok(c)),
                    ))),
                    Err(e) => {
                        let dir = self.objects.keys().step_dir(run, step);
                        let listed = self.list_step_objects(&dir).await?;
                        Ok::<_, Error>(listed.into_iter().next().map(|l| {
                            let record = l.committed.then_some(Err(e));
                            (l, record)
                        }))
                    }
                }
            })
            .buffered(16)
            .try_collect()
            .await?;
        Ok(found.into_iter().flatten().collect())
    }

    /// The step numbers of `run` that have a folder, ascending: one listing request per
    /// thousand steps, whatever the number of ranks.
    async fn step_numbers(&self, run: &str) -> Result<Vec<u64>> {
        validate_run(run)?;
        let dir = self.objects.keys().steps_dir(run);
        let res = self.objects.list_level(&dir).await?;
        let mut steps: Vec<u64> = res
            .common_prefixes
            .iter()
            .filter_map(|p| self.objects.keys().parse_step_dir(p))
            .collect();
        steps.sort_unstable();
        Ok(steps)
    }

    /// Committed step numbers of `run`, ascending.
    pub async fn committed_steps(&self, run: &str) -> Result<Vec<u64>> {
        Ok(self
            .list_steps(run)
            .await?
            .into_iter()
            .filter(|s| s.committed)
            .map(|s| s.step)
            .collect())
    }

    /// The newest committed step of `run`, if any. Lists step directories (one request per
    /// thousand steps) and checks commit records from the newest down, so it stays cheap
    /// however many ranks a step has.
    pub async fn latest_committed(&self, run: &str) -> Result<Option<u64>> {
        for s in self.step_numbers(run).await?.into_iter().rev() {
            if self
                .objects
                .exists(&self.objects.keys().commit(run, s))
                .await?
            {
                return Ok(Some(s));
            }
        }
        Ok(None)
    }

    /// The newest committed step of `run`, or a `NotFound` error that says so.
    pub async fn require_latest(&self, run: &str) -> Result<u64> {
        match self.latest_committed(run).await? {
            Some(s) => Ok(s),
            None => {
                let runs = self.list_runs().await.unwrap_or_default();
                let hint = if runs.iter().any(|r| r == run) {
                    "it has no committed step yet".to_string()
                } else if runs.is_empty() {
                    format!("the store {} holds no runs", self.objects.url())
                } else {
                    format!("known runs: {}", runs.join(", "))
                };
                Err(Error::new(
                    ErrorKind::NotFound,
                    format!("run {run} has no committed checkpoint ({hint})"),
                ))
            }
        }
    }

    /// Every chunk reference of committed `step` of `run`: each rank's in the commit record's
    /// order ([`RankManifest::chunk_refs`](crate::RankManifest::chunk_refs); a chunk that
    /// several ranks or shards share is listed each time). The objects they name are what the
    /// step needs ([`Keys::object_of`](crate::Keys::object_of), [`Keys::chain_objects`](crate::Keys::chain_objects)).
    pub async fn step_chunk_refs(&self, run: &str, step: u64) -> Result<Vec<ChunkRef>> {
        let (commit, _) = self.read_commit(run, step).await?;
        let mut out = Vec::new();
        for e in &commit.ranks {
            let m = self.read_rank_manifest(run, step, e.rank, Some(e)).await?;
            out.extend(m.chunk_refs().cloned());
        }
        Ok(out)
    }
}
