//! `ckpt ls [RUN]`: the runs of a store, or the steps of a run with their sizes.

use std::collections::{HashMap, HashSet};
use std::io::Write;

use chrono::{DateTime, TimeZone, Utc};
use ckpt_store::{ChunkId, CommitRecord, RankManifest, StepListing, Store, validate_run};
use futures::{StreamExt, TryStreamExt, stream};
use serde::Serialize;

use super::shared::fmt::{self, Align, Table};
use super::{CliError, Report, Result, Ui};

/// Arguments of `ckpt ls`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LsArgs {
    /// List the steps of this run (default: list the runs).
    pub run: Option<String>,
    /// Do not read rank manifests: no stored or new sizes, but one request per step.
    #[arg(long)]
    pub quick: bool,
    /// A local tier under the store (issue 28): each step of RUN shows where it is durable,
    /// `local` (committed in the tier only), `draining` (with its progress) and `remote`
    /// (committed in the store); the steps only in the tier are listed too.
    #[arg(long, env = ckpt_recovery::rank_env::LOCAL_TIER, value_name = "DIR")]
    pub local_tier: Option<String>,
}

/// What `ckpt ls` lists.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum LsReport {
    /// `ckpt ls`
    Runs(RunsListing),
    /// `ckpt ls RUN`
    Steps(StepsListing),
}

/// The runs of a store.
#[derive(Debug, Clone, Serialize)]
pub struct RunsListing {
    /// The store's URL.
    pub store: String,
    /// One row per run, by name.
    pub runs: Vec<RunRow>,
}

/// One run.
#[derive(Debug, Clone, Serialize)]
pub struct RunRow {
    /// Run name.
    pub run: String,
    /// Committed steps.
    pub committed_steps: usize,
    /// Steps with manifests but no commit record (saves in progress or crashed).
    pub incomplete_steps: usize,
    /// The newest committed step.
    pub latest: Option<u64>,
    /// Its layout.
    pub layout: Option<String>,
    /// Its tensor and blob bytes.
    pub logical_bytes: Option<u64>,
    /// When it was committed (RFC 3339).
    pub latest_time: Option<String>,
    /// Seconds since then.
    pub age_s: Option<f64>,
}

/// The steps of a run.
#[derive(Debug, Clone, Serialize)]
pub struct StepsListing {
    /// The store's URL.
    pub store: String,
    /// Run name.
    pub run: String,
    /// One row per step, ascending.
    pub steps: Vec<StepRow>,
}

/// One step.
#[derive(Debug, Clone, Serialize)]
pub struct StepRow {
    /// Step number.
    pub step: u64,
    /// Whether its commit record exists.
    pub committed: bool,
    /// Rank manifests present.
    pub ranks: usize,
    /// Ranks of the layout (from the commit record or any manifest).
    pub world: Option<u32>,
    /// The layout saved under.
    pub layout: Option<String>,
    /// Job generation that saved it.
    pub generation: Option<u64>,
    /// Tensors.
    pub tensors: Option<usize>,
    /// Bytes of tensors and blobs, uncompressed.
    pub logical_bytes: Option<u64>,
    /// Bytes of the chunks it references, as stored (compressed, each chunk once).
    pub stored_bytes: Option<u64>,
    /// Stored bytes of chunks no earlier step of the run references: what this step added.
    pub new_bytes: Option<u64>,
    /// Bytes the save wrote, as its writers counted them.
    pub written_bytes: Option<u64>,
    /// Commit time (committed) or newest object time (incomplete), RFC 3339.
    pub time: String,
    /// Seconds since `time`.
    pub age_s: f64,
    /// Why some figures are missing (a damaged or unreadable manifest).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// The sentinel's comparison of the step's data-parallel replicas, when any was hashed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<ReplicasSummary>,
    /// With a local tier: where the step is durable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<TierState>,
}

/// Where a step is durable, with a local tier under the store.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TierState {
    /// Committed in the local tier.
    pub local: bool,
    /// Committed in the store (remote-durable).
    pub remote: bool,
    /// Being drained to the store: the share done (0 to 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draining: Option<f64>,
    /// The tier of one machine of several: the ranks of the step it holds, committed there
    /// together (a node commit); the step commits on the store once every machine drained.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_ranks: Option<Vec<u32>>,
}

impl TierState {
    fn cell(&self) -> String {
        match (self.local, self.remote, self.draining) {
            (_, true, _) if self.local => "local+remote".into(),
            (_, true, _) => "remote".into(),
            (true, false, Some(p)) => format!("draining {:.0}%", p * 100.0),
            (true, false, None) if self.node_ranks.is_some() => "local (this node's ranks)".into(),
            (true, false, None) => "local".into(),
            (false, false, _) => "-".into(),
        }
    }
}

/// What the committer found comparing a step's replicas (the sentinel).
#[derive(Debug, Clone, Serialize)]
pub struct ReplicasSummary {
    /// Replica chunks compared with the stored ones.
    pub chunks_compared: u64,
    /// Chunks whose replicas disagree (0: they agreed).
    pub mismatched_chunks: u64,
    /// Ranks outside a strict majority.
    pub suspects: Vec<u32>,
}

impl ReplicasSummary {
    fn of(r: &ckpt_store::ReplicaReport) -> Self {
        ReplicasSummary {
            chunks_compared: r.chunks_compared,
            mismatched_chunks: r.mismatched_chunks,
            suspects: r.suspects(),
        }
    }

    /// `ok 16`, or `MISMATCH 1 (suspect rank 2)`.
    fn cell(&self) -> String {
        if self.mismatched_chunks == 0 {
            return format!("ok {}", self.chunks_compared);
        }
        let who = match self.suspects.as_slice() {
            [] => "no majority".to_string(),
            s => format!(
                "suspect rank {}",
                s.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
            ),
        };
        format!("MISMATCH {} ({who})", self.mismatched_chunks)
    }
}

/// List runs, or the steps of `args.run`.
pub async fn ls(store: &Store, args: &LsArgs, now: DateTime<Utc>, ui: &Ui) -> Result<LsReport> {
    match (&args.run, &args.local_tier) {
        (None, _) => list_runs(store, now, ui).await.map(LsReport::Runs),
        (Some(run), None) => list_steps(store, run, args.quick, now, ui)
            .await
            .map(LsReport::Steps),
        (Some(run), Some(tier)) => {
            let local = ckpt_store::open(tier).map_err(CliError::from)?;
            list_tiers(store, &local, run, args.quick, now, ui)
                .await
                .map(LsReport::Steps)
        }
    }
}

/// The steps of `run` in the store and in the local tier `local`, each with where it is
/// durable (a step in both shows the store's figures).
async fn list_tiers(
    store: &Store,
    local: &Store,
    run: &str,
    quick: bool,
    now: DateTime<Utc>,
    ui: &Ui,
) -> Result<StepsListing> {
    validate_run(run).map_err(|e| CliError::usage(e.to_string()))?;
    let mut lists = Vec::new();
    for s in [store, local] {
        lists.push(match s.log().list_steps(run).await?.is_empty() {
            true => Vec::new(),
            false => list_steps(s, run, quick, now, ui).await?.steps,
        });
    }
    let here = lists.pop().unwrap_or_default();
    let remote = lists.pop().unwrap_or_default();
    if remote.is_empty() && here.is_empty() {
        return Err(super::shared::no_such_run(store, run).await);
    }
    let drains = local.log().pending_drains(run).await?;
    // A tier of one machine of several holds node commits (its ranks of each step).
    let mut nodes: std::collections::BTreeMap<u64, Vec<u32>> = std::collections::BTreeMap::new();
    for step in local.log().node_committed_steps(run).await? {
        match local.log().read_node_commits(run, step).await {
            Ok(cs) => {
                let mut ranks: Vec<u32> = cs.iter().flat_map(|c| c.rank_numbers()).collect();
                ranks.sort_unstable();
                nodes.insert(step, ranks);
            }
            // Retired since the listing.
            Err(e) if e.kind() == ckpt_store::ErrorKind::NotFound => {}
            Err(e) => return Err(e.context(format!("the local tier {}", local.url())).into()),
        }
    }
    let mut rows: std::collections::BTreeMap<u64, StepRow> = std::collections::BTreeMap::new();
    for mut r in here {
        let node_ranks = nodes.get(&r.step).cloned();
        r.tier = Some(TierState {
            local: r.committed || node_ranks.is_some(),
            remote: false,
            draining: drains
                .iter()
                .find(|d| d.step == r.step)
                .map(|d| d.progress()),
            node_ranks,
        });
        rows.insert(r.step, r);
    }
    for mut r in remote {
        let local_state = rows.remove(&r.step).and_then(|l| l.tier);
        r.tier = Some(TierState {
            local: local_state.as_ref().is_some_and(|t| t.local),
            remote: r.committed,
            draining: None,
            node_ranks: local_state.and_then(|t| t.node_ranks),
        });
        rows.insert(r.step, r);
    }
    Ok(StepsListing {
        store: format!("{} (local tier {})", store.url(), local.url()),
        run: run.to_string(),
        steps: rows.into_values().collect(),
    })
}

fn ms_time(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms).single().unwrap_or_default()
}

fn age(now: DateTime<Utc>, t: DateTime<Utc>) -> f64 {
    (now - t).num_milliseconds() as f64 / 1000.0
}

async fn list_runs(store: &Store, now: DateTime<Utc>, ui: &Ui) -> Result<RunsListing> {
    let runs = store.log().list_runs().await?;
    let pb = ui.items(runs.len() as u64, "listing runs");
    let rows: Vec<RunRow> = stream::iter(runs)
        .map(|run| {
            let pb = pb.clone();
            async move {
                let steps = store.log().list_steps(&run).await?;
                let committed: Vec<u64> = steps
                    .iter()
                    .filter(|s| s.committed)
                    .map(|s| s.step)
                    .collect();
                let latest = committed.last().copied();
                let commit = match latest {
                    Some(s) => store.log().read_commit(&run, s).await.ok().map(|(c, _)| c),
                    None => None,
                };
                pb.inc(1);
                Ok::<_, CliError>(RunRow {
                    committed_steps: committed.len(),
                    incomplete_steps: steps.len() - committed.len(),
                    latest,
                    layout: commit.as_ref().map(|c| c.layout.to_string()),
                    logical_bytes: commit.as_ref().map(CommitRecord::logical_bytes),
                    latest_time: commit
                        .as_ref()
                        .map(|c| ms_time(c.committed_ms).to_rfc3339()),
                    age_s: commit.as_ref().map(|c| age(now, ms_time(c.committed_ms))),
                    run,
                })
            }
        })
        .buffered(8)
        .try_collect()
        .await?;
    pb.finish_and_clear();
    Ok(RunsListing {
        store: store.url().to_string(),
        runs: rows,
    })
}

struct StepInfo {
    commit: Option<CommitRecord>,
    manifests: Vec<RankManifest>,
    problem: Option<String>,
}

async fn list_steps(
    store: &Store,
    run: &str,
    quick: bool,
    now: DateTime<Utc>,
    ui: &Ui,
) -> Result<StepsListing> {
    validate_run(run).map_err(|e| CliError::usage(e.to_string()))?;
    // One listing page per thousand steps and each step's record (not a listing of every
    // manifest of every step: thousands of pages for a long run of thousands of ranks).
    let (steps, records): (Vec<_>, Vec<_>) = store
        .log()
        .list_steps_with_records(run)
        .await?
        .into_iter()
        .unzip();
    if steps.is_empty() {
        return Err(super::shared::no_such_run(store, run).await);
    }
    let pb = ui.items(steps.len() as u64, format!("reading {run}"));
    let infos: Vec<StepInfo> = stream::iter(steps.iter().zip(records))
        .map(|(s, record)| {
            let pb = pb.clone();
            async move {
                let info = step_info(store, run, s, record, quick).await;
                pb.inc(1);
                info
            }
        })
        .buffered(4)
        .collect()
        .await;
    pb.finish_and_clear();

    // What each step adds: the stored bytes of chunks no earlier step references.
    let mut seen: HashSet<ChunkId> = HashSet::new();
    let rows = steps
        .iter()
        .zip(infos)
        .map(|(s, info)| step_row(s, info, &mut seen, quick, now))
        .collect();
    Ok(StepsListing {
        store: store.url().to_string(),
        run: run.to_string(),
        steps: rows,
    })
}

/// A step's commit record (read with the listing) and the manifests its row needs:
/// incomplete steps need one for their layout, sizes need them all.
async fn step_info(
    store: &Store,
    run: &str,
    s: &StepListing,
    record: Option<ckpt_store::Result<CommitRecord>>,
    quick: bool,
) -> StepInfo {
    let mut info = StepInfo {
        commit: None,
        manifests: Vec::new(),
        problem: None,
    };
    match record {
        Some(Ok(c)) => info.commit = Some(c),
        Some(Err(e)) => info.problem = Some(e.to_string()),
        None => {}
    }
    let wanted: Vec<(u32, Option<ckpt_store::RankEntry>)> = match &info.commit {
        Some(c) if !quick => c.ranks.iter().map(|e| (e.rank, Some(e.clone()))).collect(),
        Some(_) => Vec::new(),
        None if quick => s.ranks.iter().take(1).map(|&r| (r, None)).collect(),
        None => s.ranks.iter().map(|&r| (r, None)).collect(),
    };
    let got: Vec<_> = stream::iter(wanted)
        .map(|(r, e)| async move {
            store
                .log()
                .read_rank_manifest(run, s.step, r, e.as_ref())
                .await
        })
        .buffer_unordered(16)
        .collect()
        .await;
    for m in got {
        match m {
            Ok(m) => info.manifests.push(m),
            Err(e) => {
                info.problem.get_or_insert_with(|| e.to_string());
            }
        }
    }
    info.manifests.sort_by_key(|m| m.rank);
    info
}

/// The row of step `s`; `seen` holds the chunks of the steps before it, and gets its own.
fn step_row(
    s: &StepListing,
    info: StepInfo,
    seen: &mut HashSet<ChunkId>,
    quick: bool,
    now: DateTime<Utc>,
) -> StepRow {
    let sizes = (!quick && info.problem.is_none()).then(|| {
        let mut stored: HashMap<ChunkId, u64> = HashMap::new();
        for m in &info.manifests {
            for c in m.chunk_refs() {
                stored.insert(c.id, c.stored as u64);
            }
        }
        let total: u64 = stored.values().sum();
        let new: u64 = stored
            .iter()
            .filter(|(id, _)| !seen.contains(*id))
            .map(|(_, n)| n)
            .sum();
        seen.extend(stored.keys().copied());
        (total, new)
    });
    let first = info.manifests.first();
    let (layout, generation) = match (&info.commit, first) {
        (Some(c), _) => (Some(c.layout), Some(c.generation)),
        (None, Some(m)) => (Some(m.layout), Some(m.generation)),
        _ => (None, None),
    };
    let time = match &info.commit {
        Some(c) => ms_time(c.committed_ms),
        None => s.last_modified,
    };
    // Summed over the manifests of an incomplete step.
    let from_manifests = |f: fn(&RankManifest) -> u64| {
        (!info.manifests.is_empty()).then(|| info.manifests.iter().map(f).sum::<u64>())
    };
    let (logical, written) = match &info.commit {
        Some(c) => (Some(c.logical_bytes()), Some(c.stats.bytes_written)),
        None => (
            from_manifests(|m| m.stats.logical_bytes),
            from_manifests(|m| m.stats.bytes_written),
        ),
    };
    StepRow {
        step: s.step,
        committed: s.committed,
        ranks: s.ranks.len(),
        world: layout.map(|l| l.world()),
        layout: layout.map(|l| l.to_string()),
        generation,
        tensors: info.commit.as_ref().map(|c| c.tensors.len()),
        logical_bytes: logical,
        stored_bytes: sizes.map(|s| s.0),
        new_bytes: sizes.map(|s| s.1),
        written_bytes: written,
        time: time.to_rfc3339(),
        age_s: age(now, time),
        problem: info.problem,
        tier: None,
        replicas: info
            .commit
            .as_ref()
            .and_then(|c| c.replicas.as_ref())
            .map(ReplicasSummary::of),
    }
}

fn opt_bytes(v: Option<u64>) -> String {
    v.map_or_else(|| "-".into(), fmt::bytes)
}

impl Report for LsReport {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        match self {
            LsReport::Runs(r) => {
                if r.runs.is_empty() {
                    return writeln!(w, "no runs in {}", r.store);
                }
                let mut t = Table::new(&[
                    ("RUN", Align::Left),
                    ("STEPS", Align::Right),
                    ("INCOMPLETE", Align::Right),
                    ("LATEST", Align::Right),
                    ("LAYOUT", Align::Left),
                    ("SIZE", Align::Right),
                    ("AGE", Align::Left),
                ]);
                for row in &r.runs {
                    t.row(vec![
                        row.run.clone(),
                        row.committed_steps.to_string(),
                        row.incomplete_steps.to_string(),
                        row.latest.map_or("-".into(), |s| s.to_string()),
                        row.layout.clone().unwrap_or_else(|| "-".into()),
                        opt_bytes(row.logical_bytes),
                        row.age_s.map_or("-".into(), fmt::age),
                    ]);
                }
                write!(w, "{}", t.render())
            }
            LsReport::Steps(s) => {
                let committed = s.steps.iter().filter(|r| r.committed).count();
                writeln!(
                    w,
                    "run {} in {}: {} committed, {} incomplete",
                    s.run,
                    s.store,
                    committed,
                    s.steps.len() - committed
                )?;
                let mut t = Table::new(&[
                    ("STEP", Align::Right),
                    ("STATE", Align::Left),
                    ("RANKS", Align::Right),
                    ("LAYOUT", Align::Left),
                    ("LOGICAL", Align::Right),
                    ("STORED", Align::Right),
                    ("NEW", Align::Right),
                    ("REPLICAS", Align::Left),
                    ("AGE", Align::Left),
                ]);
                let mut problems = Vec::new();
                for r in &s.steps {
                    let ranks = match (r.committed, r.world) {
                        (false, Some(wd)) => format!("{}/{wd}", r.ranks),
                        _ => r.ranks.to_string(),
                    };
                    t.row(vec![
                        r.step.to_string(),
                        match (&r.tier, r.committed) {
                            (Some(t), _) if t.local || t.remote => t.cell(),
                            (_, true) => "committed".into(),
                            _ => "incomplete".into(),
                        },
                        ranks,
                        r.layout.clone().unwrap_or_else(|| "-".into()),
                        opt_bytes(r.logical_bytes),
                        opt_bytes(r.stored_bytes),
                        opt_bytes(r.new_bytes),
                        r.replicas
                            .as_ref()
                            .map_or_else(|| "-".into(), ReplicasSummary::cell),
                        fmt::age(r.age_s),
                    ]);
                    if let Some(p) = &r.problem {
                        problems.push(format!("step {}: {p}", r.step));
                    }
                    if r.replicas.as_ref().is_some_and(|x| x.mismatched_chunks > 0) {
                        problems.push(format!(
                            "step {}: its data-parallel replicas disagree (silent data corruption; `ckpt inspect {}@{}` names the tensors, ranks and nodes)",
                            r.step, s.run, r.step
                        ));
                    }
                }
                write!(w, "{}", t.render())?;
                for p in problems {
                    writeln!(w, "warning: {p} (run `ckpt verify {}`)", s.run)?;
                }
                Ok(())
            }
        }
    }
}
