//! `ckpt verify [RUN[@STEP]]`: re-hash every chunk reachable from a step, a run or the whole
//! store; exit code 3 and a list of the damaged objects with the steps, tensors and blobs they
//! break.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use ckpt_store::verify::{Affected, Damage};
use ckpt_store::{ChunkId, Store, VerifyReport, VerifyScope};
use futures::{StreamExt, stream};
use serde::Serialize;

use super::shared::fmt;
use super::shared::parse::{CkptRef, StepSel};
use super::{Report, Result, Ui};

/// Arguments of `ckpt verify`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct VerifyArgs {
    /// What to verify: RUN@STEP (one step), RUN (every committed step of the run; RUN@latest
    /// for only the newest), or nothing (the whole store, unreferenced objects included).
    pub target: Option<String>,
}

/// What `ckpt verify` found.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyOutput {
    /// The store's URL.
    pub store: String,
    /// What was verified: `store`, `run NAME` or `step S of run NAME`.
    pub scope: String,
    /// Whether nothing is damaged.
    pub clean: bool,
    /// The store's report: steps, objects, chunks and bytes checked, and the damage.
    #[serde(flatten)]
    pub report: VerifyReport,
    /// Seconds it took.
    pub seconds: f64,
    /// Damaged steps, as `RUN@STEP`, each once.
    pub damaged_steps: Vec<String>,
    /// Committed steps whose data-parallel replicas disagreed at the commit (the sentinel's
    /// record): silent data corruption on one side.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replica_mismatches: Vec<ReplicaFinding>,
}

/// A committed step whose replicas disagreed.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaFinding {
    /// `RUN@STEP`.
    pub step: String,
    /// Chunks that differ.
    pub mismatched_chunks: u64,
    /// Ranks outside a strict majority.
    pub suspects: Vec<u32>,
    /// Whether the stored bytes are the suspect side, or no majority tells (then the step
    /// counts as damaged: its stored bytes may be the corrupt ones).
    pub stored_suspect: bool,
    /// The first mismatch, in words.
    pub first: String,
}

/// The recorded replica mismatches of the committed steps `scope` covers.
async fn replica_findings(store: &Store, scope: &VerifyScope) -> Result<Vec<ReplicaFinding>> {
    let mut steps: Vec<(String, u64)> = Vec::new();
    match scope {
        VerifyScope::Step(r, s) => steps.push((r.clone(), *s)),
        VerifyScope::Run(r) => {
            for s in store.log().committed_steps(r).await? {
                steps.push((r.clone(), s));
            }
        }
        VerifyScope::Store => {
            for r in store.log().list_runs().await? {
                for s in store.log().committed_steps(&r).await? {
                    steps.push((r.clone(), s));
                }
            }
        }
    }
    let roots: Vec<_> = stream::iter(steps)
        .map(|(run, step)| async move {
            let root = store.log().read_commit_root(&run, step).await;
            (run, step, root)
        })
        .buffered(16)
        .collect()
        .await;
    let mut out = Vec::new();
    for (run, step, root) in roots {
        // An unreadable record is the verify's own finding.
        let Ok((c, _, _)) = root else { continue };
        let Some(r) = c.replicas.filter(|r| r.mismatched()) else {
            continue;
        };
        out.push(ReplicaFinding {
            step: format!("{run}@{step}"),
            mismatched_chunks: r.mismatched_chunks,
            suspects: r.suspects(),
            stored_suspect: r.mismatches.iter().any(|m| m.stored_suspect()),
            first: r
                .mismatches
                .first()
                .map(|m| m.describe())
                .unwrap_or_default(),
        });
    }
    Ok(out)
}

/// Which scope a target names.
pub async fn scope_of(store: &Store, target: Option<&str>) -> Result<VerifyScope> {
    let Some(t) = target else {
        return Ok(VerifyScope::Store);
    };
    let r: CkptRef = t.parse()?;
    Ok(match (t.contains('@'), r.step) {
        (false, _) => {
            // A run: every committed step; say so when it has none.
            let steps = store.log().list_steps(&r.run).await?;
            if steps.is_empty() {
                return Err(super::shared::no_such_run(store, &r.run).await);
            }
            VerifyScope::Run(r.run)
        }
        (true, StepSel::Latest | StepSel::Step(_)) => {
            let s = super::shared::resolve(store, &r).await?;
            VerifyScope::Step(r.run, s)
        }
    })
}

/// Raw bytes of the distinct chunks reachable from `scope` (the progress bar's length; the
/// store's own hint counts a chunk once per step that references it).
async fn distinct_bytes(store: &Store, scope: &VerifyScope) -> u64 {
    // A step, or the committed steps of the runs named.
    let (mut steps, runs): (Vec<(String, u64)>, Vec<String>) = match scope {
        VerifyScope::Step(r, s) => (vec![(r.clone(), *s)], Vec::new()),
        VerifyScope::Run(r) => (Vec::new(), vec![r.clone()]),
        VerifyScope::Store => (
            Vec::new(),
            store.log().list_runs().await.unwrap_or_default(),
        ),
    };
    for r in runs {
        for s in store.log().committed_steps(&r).await.unwrap_or_default() {
            steps.push((r.clone(), s));
        }
    }
    let mut seen: HashMap<ChunkId, u64> = HashMap::new();
    let manifests: Vec<_> = stream::iter(steps)
        .map(
            |(run, step)| async move { super::shared::readable_manifests(store, &run, step).await },
        )
        .buffer_unordered(8)
        .collect()
        .await;
    for m in manifests.iter().flatten() {
        for c in m.chunk_refs() {
            seen.insert(c.id, c.len as u64);
        }
    }
    seen.values().sum()
}

/// Verify what `args.target` names. Damage is in the output, not an error; an error means the
/// verification itself could not run.
pub async fn verify(store: &Store, args: &VerifyArgs, ui: &Ui) -> Result<VerifyOutput> {
    let scope = scope_of(store, args.target.as_deref()).await?;
    let t0 = Instant::now();
    let total = if ui.progress {
        distinct_bytes(store, &scope).await
    } else {
        0
    };
    let pb = ui.bytes(total, "verifying");
    let progress: Arc<dyn Fn(u64) + Send + Sync> = {
        let pb = pb.clone();
        Arc::new(move |done: u64| {
            if pb.length().is_some_and(|l| done > l) {
                pb.set_length(done);
            }
            pb.set_position(done);
        })
    };
    let report = store.verify(&scope, Some(progress)).await?;
    pb.finish_and_clear();
    let replica_mismatches = replica_findings(store, &scope).await?;
    let mut damaged_steps: Vec<(String, u64)> = report
        .damaged
        .iter()
        .flat_map(|d| d.affects.iter().map(|a| (a.run.clone(), a.step)))
        .collect();
    damaged_steps.sort();
    damaged_steps.dedup();
    Ok(VerifyOutput {
        store: store.url().to_string(),
        scope: match &scope {
            VerifyScope::Store => "store".into(),
            VerifyScope::Run(r) => format!("run {r}"),
            VerifyScope::Step(r, s) => format!("step {s} of run {r}"),
        },
        clean: report.is_clean() && !replica_mismatches.iter().any(|f| f.stored_suspect),
        seconds: t0.elapsed().as_secs_f64(),
        damaged_steps: damaged_steps
            .into_iter()
            .map(|(r, s)| format!("{r}@{s}"))
            .collect(),
        report,
        replica_mismatches,
    })
}

impl Report for VerifyOutput {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        let r = &self.report;
        let scope = if self.scope == "store" {
            "the whole store"
        } else {
            self.scope.as_str()
        };
        writeln!(
            w,
            "verified {scope} in {}: {} steps, {} objects, {} chunks, {} in {} ({})",
            self.store,
            r.steps,
            r.objects,
            r.chunks,
            fmt::bytes(r.bytes),
            fmt::duration(self.seconds),
            fmt::rate(r.bytes, self.seconds)
        )?;
        if !r.temp_files.is_empty() {
            let bytes: u64 = r.temp_files.iter().map(|t| t.bytes).sum();
            let shown: Vec<&str> = r
                .temp_files
                .iter()
                .take(3)
                .map(|t| t.file.as_str())
                .collect();
            writeln!(
                w,
                "note: {} temporary file(s) ({}) that interrupted writes left: {}{}; not damage \
                 (nothing references them), `ckpt gc` deletes them once they are older than its \
                 grace period and lease lapse",
                r.temp_files.len(),
                fmt::bytes(bytes),
                shown.join(", "),
                if r.temp_files.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                }
            )?;
        }
        for f in &self.replica_mismatches {
            writeln!(
                w,
                "{}: {}'s data-parallel replicas disagreed at its commit ({} chunk(s)): {}{}",
                if f.stored_suspect { "SUSPECT" } else { "note" },
                f.step,
                f.mismatched_chunks,
                f.first,
                if f.stored_suspect {
                    "; the stored bytes may be the corrupt ones: restore an older step"
                } else {
                    "; the stored bytes are the majority's"
                }
            )?;
        }
        if self.clean {
            return writeln!(w, "OK: nothing is damaged");
        }
        if r.is_clean() {
            return writeln!(
                w,
                "DAMAGED: no object is damaged, but the stored bytes of the steps above may hold silent data corruption"
            );
        }
        writeln!(
            w,
            "DAMAGED: {} object(s); {} step(s) affected: {}",
            r.damaged.len(),
            self.damaged_steps.len(),
            if self.damaged_steps.is_empty() {
                "none (only unreferenced objects)".into()
            } else {
                self.damaged_steps.join(", ")
            }
        )?;
        print_damaged(w, &r.damaged)?;
        writeln!(w)?;
        writeln!(
            w,
            "what to do: steps not listed above are intact and can be restored or exported; \
             restore the damaged objects from a copy of the store if you have one, otherwise \
             resume from an intact step (`ckpt ls RUN`)"
        )
    }
}

/// Each damaged object: what is wrong with it and what it breaks, by step.
fn print_damaged(w: &mut dyn Write, damaged: &[Damage]) -> std::io::Result<()> {
    for d in damaged {
        writeln!(w)?;
        writeln!(w, "  object  {}", d.object)?;
        writeln!(w, "  problem {}", d.problem)?;
        if d.affects.is_empty() {
            writeln!(w, "  affects nothing any committed step references")?;
            continue;
        }
        let mut by_step: BTreeMap<(String, u64), Vec<&Affected>> = BTreeMap::new();
        for a in &d.affects {
            by_step.entry((a.run.clone(), a.step)).or_default().push(a);
        }
        for ((run, step), items) in by_step {
            let names: Vec<String> = items.iter().map(|a| fmt::name(&a.item)).collect();
            writeln!(w, "  breaks  {run}@{step}: {}", names.join(", "))?;
        }
    }
    Ok(())
}
