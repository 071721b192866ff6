//! The store as every subcommand sees it: opening it from `--store`, resolving a checkpoint
//! name against it with errors that say what exists instead (a run's committed steps, the
//! runs a store holds, why a run has no committed step yet), and reading a step's rank
//! manifests.

use std::sync::Arc;

use ckpt_recovery::records::{Event, Logged, Metric, read_records};
use ckpt_store::{ErrorKind, OpenOptions, RankManifest, StepReader, Store};
use futures::{StreamExt, TryStreamExt, stream};

use super::error::{CliError, Result};
use super::fmt::ranges;
use super::parse::{CkptRef, StepSel};

/// Open the store named by `--store` / `CKPT_STORE`.
pub fn open_store(url: Option<&str>, open: &OpenOptions) -> Result<Store> {
    let url = url.filter(|u| !u.trim().is_empty()).ok_or_else(|| {
        CliError::usage(
            "no store given: pass --store URL or set CKPT_STORE \
             (a directory, file:///dir, s3://bucket/prefix or memory://)",
        )
    })?;
    ckpt_store::open_with(url, open).map_err(CliError::from)
}

/// The committed step `ckpt` names, or an error that lists what exists.
pub async fn resolve(store: &Store, ckpt: &CkptRef) -> Result<u64> {
    match ckpt.step {
        StepSel::Latest => store.log().require_latest(&ckpt.run).await.map_err(|e| {
            if e.kind() == ErrorKind::NotFound {
                CliError::from(e).hint(format!(
                    "`ckpt ls` lists the runs of {}, `ckpt ls {}` the steps of this one",
                    store.url(),
                    ckpt.run
                ))
            } else {
                e.into()
            }
        }),
        StepSel::Step(s) => {
            if store
                .objects()
                .exists(&store.keys().commit(&ckpt.run, s))
                .await?
            {
                return Ok(s);
            }
            Err(not_committed(store, &ckpt.run, s).await)
        }
    }
}

/// The error for a run with no step in the store: one it does not hold at all (naming the
/// runs it does hold), or one that has logs and no step yet (saying why, when its logs do).
pub async fn no_such_run(store: &Store, run: &str) -> CliError {
    let runs = store.log().list_runs().await.unwrap_or_default();
    if runs.iter().any(|r| r == run) {
        return no_step_yet(store, run).await;
    }
    let known = if runs.is_empty() {
        format!("the store {} holds no runs", store.url())
    } else {
        format!("known runs: {}", runs.join(", "))
    };
    CliError::error(format!("no run named {run} ({known})"))
}

/// The error for a run the store holds only the logs of (its first checkpoint is being saved,
/// or failed): with the newest failed save's error, from the run's events log (or, from a
/// writer that logs it there, its metrics log).
async fn no_step_yet(store: &Store, run: &str) -> CliError {
    let events = read_records::<Event>(store, run).await.unwrap_or_default();
    let metrics = read_records::<Metric>(store, run).await.unwrap_or_default();
    let failed = events
        .into_iter()
        .filter_map(|Logged { t_ms, record }| match record {
            Event::CheckpointFailed(f) => Some((t_ms, f)),
            _ => None,
        })
        .chain(
            metrics
                .into_iter()
                .filter_map(|Logged { t_ms, record }| match record {
                    Metric::CheckpointFailed(f) => Some((t_ms, f)),
                    _ => None,
                }),
        )
        .max_by_key(|(t_ms, _)| *t_ms);
    match failed {
        Some((_, f)) => CliError::error(format!(
            "run {run} has no committed step yet: its newest save (step {}) failed: {}",
            f.step, f.error
        ))
        .hint(format!(
            "the run's events log says why saves fail; once the store takes them, \
             `ckpt ls {run}` lists its steps"
        )),
        None => CliError::error(format!(
            "run {run} has no committed step yet (the store holds only its logs)"
        ))
        .hint("its first checkpoint may still be saving; `ckpt ls` lists the runs"),
    }
}

/// The error for a step that is not committed, naming what the run does have.
async fn not_committed(store: &Store, run: &str, step: u64) -> CliError {
    let steps = match store.log().list_steps(run).await {
        Ok(s) => s,
        Err(e) => return e.into(),
    };
    if steps.is_empty() {
        return no_such_run(store, run).await;
    }
    let committed: Vec<u64> = steps
        .iter()
        .filter(|s| s.committed)
        .map(|s| s.step)
        .collect();
    let have = if committed.is_empty() {
        "it has no committed step".to_string()
    } else {
        format!("committed steps: {}", ranges(&committed))
    };
    match steps.iter().find(|s| s.step == step) {
        Some(s) => CliError::error(format!(
            "step {step} of run {run} is incomplete: only rank(s) {} wrote manifests and no \
             commit record exists ({have})",
            ranges(&s.ranks.iter().map(|&r| r as u64).collect::<Vec<_>>())
        ))
        .hint("a save may still be running; a crashed one is reclaimed by `ckpt gc`"),
        None => CliError::error(format!("run {run} has no step {step} ({have})"))
            .hint(format!("`ckpt ls {run}` lists its steps")),
    }
}

/// Every rank manifest of the reader's step, fetched in parallel.
pub async fn all_manifests(reader: &StepReader) -> Result<Vec<Arc<RankManifest>>> {
    let ranks: Vec<u32> = reader.commit().ranks.iter().map(|e| e.rank).collect();
    let ms: Vec<Arc<RankManifest>> = stream::iter(ranks)
        .map(|r| async move { reader.manifest(r).await })
        .buffered(16)
        .try_collect()
        .await?;
    Ok(ms)
}

/// The rank manifests of committed `step` of `run` that read (none when its commit record
/// does not): for figures that are best effort (a progress bar's length, a dedup index).
pub async fn readable_manifests(store: &Store, run: &str, step: u64) -> Vec<RankManifest> {
    let Ok((c, _)) = store.log().read_commit(run, step).await else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in &c.ranks {
        if let Ok(m) = store
            .log()
            .read_rank_manifest(run, step, e.rank, Some(e))
            .await
        {
            out.push(m);
        }
    }
    out
}
