//! `ckpt drain --local-tier DIR [RUN[@STEP]]`: copy to the store (`--store`, the remote)
//! what a local tier committed and the store does not hold yet, and commit it there (issue
//! 28). A job drains its own steps behind the training; this finishes what a job left local
//! only: it ended while the store was down, it was killed and not restarted, or its machine
//! is being retired. The drain is [`ckpt_store::drain_step`]: only the chunks the store lacks
//! move, each hash-checked before it leaves the tier, and the step is committed with the same
//! protocol and fencing as a save (a newer job on the run refuses it).

use std::io::Write;
use std::time::Instant;

use ckpt_store::{DrainOptions, DrainReport, ErrorKind, Store};
use serde::Serialize;

use super::shared::parse::{CkptRef, StepSel};
use super::shared::{fmt, parse};
use super::{CliError, Report, Result, Ui};

/// Arguments of `ckpt drain`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DrainArgs {
    /// The local tier to drain from (a directory, as the job's `--local-tier`); `--store` is
    /// the remote store it drains to.
    #[arg(long, env = ckpt_recovery::rank_env::LOCAL_TIER, value_name = "DIR")]
    pub local_tier: Option<String>,
    /// What to drain: RUN@STEP (that step), RUN (the run's newest local step the store lacks),
    /// or nothing (every run of the tier).
    pub target: Option<String>,
    /// Drain every local step newer than the store's newest, oldest first, not only the
    /// newest (older ones are otherwise superseded by it).
    #[arg(long)]
    pub all: bool,
    /// Cap the drain at this many stored bytes a second (`100MB`, `1GiB`): a store shared
    /// with running jobs.
    #[arg(long, value_parser = parse::size, value_name = "BYTES")]
    pub rate: Option<u64>,
    /// Objects copied at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
}

/// What `ckpt drain` did.
#[derive(Debug, Clone, Serialize)]
pub struct DrainOutput {
    /// The local tier.
    pub local_tier: String,
    /// The remote store.
    pub store: String,
    /// The steps drained (or found committed on the store already), oldest first.
    pub drained: Vec<DrainReport>,
    /// Per run, the local steps newer than the store's newest that were not drained: the
    /// newest drained step supersedes them (`--all` drains them too).
    pub superseded: Vec<Superseded>,
    /// Runs of the tier with nothing to drain: their newest local step is on the store.
    pub up_to_date: Vec<String>,
    /// Seconds it took.
    pub seconds: f64,
}

/// Local steps a newer drained step supersedes.
#[derive(Debug, Clone, Serialize)]
pub struct Superseded {
    /// Run.
    pub run: String,
    /// The steps left local only.
    pub steps: Vec<u64>,
    /// The step that supersedes them.
    pub by: u64,
}

impl Report for DrainOutput {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        for d in &self.drained {
            if d.already_remote {
                writeln!(w, "{}@{}: already on the store", d.run, d.step)?;
                continue;
            }
            writeln!(
                w,
                "{}@{}: drained, {} sent in {} objects ({}), {} already on the store, {} manifests",
                d.run,
                d.step,
                fmt::bytes(d.bytes_sent),
                d.objects_sent,
                fmt::rate(d.bytes_sent, d.seconds),
                fmt::bytes(d.bytes_present),
                d.manifests
            )?;
            if !d.remote_committed {
                writeln!(
                    w,
                    "  this node's ranks are on the store; the step commits there once the \
                     other machines' ranks are drained"
                )?;
            }
        }
        for s in &self.superseded {
            writeln!(
                w,
                "{}: step{} {} left local only, superseded by step {} (--all drains them)",
                s.run,
                if s.steps.len() == 1 { "" } else { "s" },
                fmt::ranges(&s.steps),
                s.by
            )?;
        }
        for r in &self.up_to_date {
            writeln!(
                w,
                "{r}: nothing to drain (no committed local step newer than the store's newest)"
            )?;
        }
        if self.drained.is_empty() && self.up_to_date.is_empty() {
            writeln!(
                w,
                "the local tier {} has no committed step",
                self.local_tier
            )?;
        }
        Ok(())
    }
}

/// Drain what `args` names from the local tier to `remote` (see the module docs).
pub async fn drain(remote: &Store, args: &DrainArgs, ui: &Ui) -> Result<DrainOutput> {
    let Some(tier) = &args.local_tier else {
        return Err(CliError::usage(
            "ckpt drain needs the local tier to drain from: --local-tier DIR (or CKPT_LOCAL_TIER)",
        ));
    };
    let local = ckpt_store::open(tier).map_err(|e| CliError::from(e).context("the local tier"))?;
    if local.url() == remote.url() {
        return Err(CliError::usage(format!(
            "the local tier and the store are the same ({}): --store names the remote store to drain to",
            remote.url()
        )));
    }
    let t0 = Instant::now();
    let (runs, step) = match &args.target {
        None => (local.log().list_runs().await?, None),
        Some(t) => {
            let r: CkptRef = t.parse()?;
            let step = match (t.contains('@'), r.step) {
                (true, StepSel::Step(s)) => Some(s),
                (true, StepSel::Latest) => None,
                (false, _) => None,
            };
            if local.log().list_steps(&r.run).await?.is_empty() {
                return Err(super::shared::no_such_run(&local, &r.run)
                    .await
                    .context(format!("the local tier {tier}")));
            }
            (vec![r.run], step)
        }
    };
    let mut out = DrainOutput {
        local_tier: local.url().to_string(),
        store: remote.url().to_string(),
        drained: Vec::new(),
        superseded: Vec::new(),
        up_to_date: Vec::new(),
        seconds: 0.0,
    };
    for run in runs {
        drain_run(&local, remote, &run, step, args, ui, &mut out)
            .await
            .map_err(|e| {
                e.context(format!(
                    "draining run {run} from the local tier {tier} to {} (what the tier \
                     committed stays there)",
                    remote.url()
                ))
            })?;
    }
    out.seconds = t0.elapsed().as_secs_f64();
    Ok(out)
}

/// Drain `run`: step `step`, or what [`DrainArgs::all`] says of the local steps newer than
/// the store's newest; into `out`.
async fn drain_run(
    local: &Store,
    remote: &Store,
    run: &str,
    step: Option<u64>,
    args: &DrainArgs,
    ui: &Ui,
    out: &mut DrainOutput,
) -> Result<()> {
    let todo = match step {
        Some(s) => {
            // A step named is drained whatever the store's newest is (history kept).
            if let Err(e) = local.log().read_commit(run, s).await {
                // The tier of one machine of several: its node commit.
                if local.log().read_node_commits(run, s).await.is_err() {
                    return Err(e.into());
                }
            }
            vec![s]
        }
        None => {
            let mut here = local.log().committed_steps(run).await?;
            // The tier of one machine of several holds node commits (its ranks of each step).
            here.extend(local.log().node_committed_steps(run).await?);
            here.sort_unstable();
            here.dedup();
            let newest_remote = remote.log().latest_committed(run).await?;
            let pending: Vec<u64> = here
                .into_iter()
                .filter(|&s| newest_remote.is_none_or(|r| s > r))
                .collect();
            match pending.split_last() {
                None => {
                    out.up_to_date.push(run.to_string());
                    return Ok(());
                }
                Some((&newest, older)) if !args.all && !older.is_empty() => {
                    out.superseded.push(Superseded {
                        run: run.to_string(),
                        steps: older.to_vec(),
                        by: newest,
                    });
                    vec![newest]
                }
                Some(_) if args.all => pending,
                Some((&newest, _)) => vec![newest],
            }
        }
    };
    for s in todo {
        out.drained
            .push(drain_one(local, remote, run, s, args, ui).await?);
    }
    Ok(())
}

/// Drain step `step` of `run`, with a bar.
async fn drain_one(
    local: &Store,
    remote: &Store,
    run: &str,
    step: u64,
    args: &DrainArgs,
    ui: &Ui,
) -> Result<DrainReport> {
    let bar = ui.bytes(0, format!("draining {run}@{step}"));
    let progress = {
        let bar = bar.clone();
        std::sync::Arc::new(move |done: u64, total: u64| {
            bar.set_length(total);
            bar.set_position(done);
        })
    };
    let opts = DrainOptions {
        concurrency: args.concurrency.max(1),
        pace: args.rate.map(|r| ckpt_store::rate_pace(r as f64)),
        writer: format!("ckpt-drain-{}", std::process::id()),
        progress: Some(progress),
        ..DrainOptions::default()
    };
    let node = !local
        .objects()
        .exists(&local.keys().commit(run, step))
        .await?
        && !local.log().node_commit_keys(run, step).await?.is_empty();
    let r = if node {
        ckpt_store::drain_node(local, remote, run, step, &opts).await
    } else {
        ckpt_store::drain_step(local, remote, run, step, &opts).await
    };
    bar.finish_and_clear();
    r.map_err(|e| {
        let fenced = e.kind() == ErrorKind::Fenced;
        let err = CliError::from(e).context(format!("step {step}"));
        if fenced {
            err.hint(
                "a newer job has started on the run in the store: its own steps supersede this one",
            )
        } else {
            err.hint("run `ckpt drain` again once the store answers: only what is missing is sent")
        }
    })
}
