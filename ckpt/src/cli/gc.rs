//! `ckpt gc [--keep-last N] [--keep-every K] [--grace DURATION] [--dry-run]`: delete committed
//! steps that retention does not keep, abandoned incomplete steps older than the grace period,
//! and chunk and pack objects nothing references any more.
//!
//! What a save in progress needs survives, whatever the grace: its writer lease defers the
//! sweep while it is younger than `--lease-lapse` (an hour), and its incomplete step and
//! temporary files are kept while younger than the lease lapse and the grace (a save may be
//! committing). So a short grace beside a running job costs a sweep's deferral, never a save.
//! `--protect RUN@STEP` keeps a step a pending save builds on whatever retention says. On a
//! local directory, temporary files that interrupted writes left are deleted once older than
//! both.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ckpt_store::{GcOptions, GcReport, Store, validate_run};
use serde::Serialize;

use super::shared::fmt;
use super::shared::parse::{CkptRef, ckpt_ref, duration};
use super::{CliError, Report, Result, Ui};

/// Shortest grace period accepted without `--force`.
pub const MIN_GRACE: Duration = Duration::from_secs(60);

/// Arguments of `ckpt gc`: what a person types (durations as text, `--protect RUN@STEP`
/// resolved against the store, `--force`, `--no-sweep`), turned into the store's
/// [`GcOptions`] with `From`; the defaults are read from those options, not written twice.
#[derive(Debug, Clone, clap::Args)]
pub struct GcArgs {
    /// Keep the newest N committed steps of each run (the newest is always kept).
    #[arg(long, value_name = "N")]
    pub keep_last: Option<usize>,
    /// Keep committed steps whose number is a multiple of K.
    #[arg(long, value_name = "K")]
    pub keep_every: Option<u64>,
    /// Never delete unreferenced objects younger than this.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = duration)]
    pub grace: Duration,
    /// Count a save as in flight this long after its last write, whatever the grace: its
    /// writer lease defers the sweep, its incomplete step and temporary files are kept.
    /// Shorten only when no job saves (a killed job's leases then stop deferring sweeps).
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = duration)]
    pub lease_lapse: Duration,
    /// Print what would be deleted; delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Apply retention only to these runs (default: every run). The sweep of unreferenced
    /// objects always considers the whole store.
    #[arg(long = "run", value_name = "RUN")]
    pub runs: Vec<String>,
    /// Keep this step whatever retention says (a pending save builds on it). Repeatable.
    #[arg(long, value_name = "RUN@STEP", value_parser = ckpt_ref)]
    pub protect: Vec<CkptRef>,
    /// Accept a grace period or lease lapse under a minute (a short grace defers sweeps
    /// beside a running job; a short lease lapse is only for a store no job saves to).
    #[arg(long)]
    pub force: bool,
    /// Apply retention only: leave unreferenced chunks for a later gc.
    #[arg(long)]
    pub no_sweep: bool,
}

impl Default for GcArgs {
    /// The store's defaults ([`GcOptions::default`]), no run named, nothing protected.
    fn default() -> Self {
        let o = GcOptions::default();
        GcArgs {
            keep_last: o.keep_last,
            keep_every: o.keep_every,
            grace: o.grace,
            lease_lapse: o.lease_lapse,
            dry_run: o.dry_run,
            runs: o.runs,
            protect: Vec::new(),
            force: false,
            no_sweep: !o.sweep,
        }
    }
}

impl From<&GcArgs> for GcOptions {
    /// The store's options for these flags, protecting nothing yet: `--protect` names steps
    /// that are resolved against the store first.
    fn from(a: &GcArgs) -> Self {
        GcOptions {
            keep_last: a.keep_last,
            keep_every: a.keep_every,
            grace: a.grace,
            lease_lapse: a.lease_lapse,
            dry_run: a.dry_run,
            runs: a.runs.clone(),
            protect: Vec::new(),
            sweep: !a.no_sweep,
        }
    }
}

/// What `ckpt gc` did or would do.
#[derive(Debug, Clone, Serialize)]
pub struct GcOutput {
    /// The store's URL.
    pub store: String,
    /// The retention rule, in words.
    pub retention: String,
    /// Grace period in seconds.
    pub grace_s: f64,
    /// Lease lapse in seconds: how long a save counts as in flight after its last write.
    pub lease_lapse_s: f64,
    /// The store's report.
    #[serde(flatten)]
    pub report: GcReport,
}

/// Run retention and sweep. `now` is the time GC compares object ages with.
pub async fn gc(store: &Store, args: &GcArgs, now: DateTime<Utc>, ui: &Ui) -> Result<GcOutput> {
    if args.keep_every == Some(0) {
        return Err(CliError::usage("--keep-every must be at least 1"));
    }
    if args.grace < MIN_GRACE && !args.force {
        return Err(CliError::usage(format!(
            "a grace period of {} deletes unreferenced chunks as soon as no save holds a lease \
             (saves in flight only defer the sweep); pass --force to confirm",
            fmt::duration(args.grace.as_secs_f64())
        )));
    }
    if args.lease_lapse < MIN_GRACE && !args.force {
        return Err(CliError::usage(format!(
            "a lease lapse of {} takes a save in flight for a dead one and can delete what it \
             writes; pass --force if no job saves to this store",
            fmt::duration(args.lease_lapse.as_secs_f64())
        )));
    }
    for r in &args.runs {
        validate_run(r).map_err(|e| CliError::usage(e.to_string()))?;
        if store.log().list_steps(r).await?.is_empty() {
            return Err(super::shared::no_such_run(store, r).await);
        }
    }
    let mut opts = GcOptions::from(args);
    for p in &args.protect {
        opts.protect
            .push((p.run.clone(), super::shared::resolve(store, p).await?));
    }
    let pb = ui.spinner(if args.dry_run {
        "collecting garbage (dry run)"
    } else {
        "collecting garbage"
    });
    let report = store.gc().run(&opts, now).await?;
    pb.finish_and_clear();
    let mut rules = Vec::new();
    if let Some(n) = args.keep_last {
        rules.push(format!("the newest {n}"));
    }
    if let Some(k) = args.keep_every {
        rules.push(format!("every step divisible by {k}"));
    }
    let scope = if args.runs.is_empty() {
        "every run".to_string()
    } else {
        format!("run(s) {}", args.runs.join(", "))
    };
    let retention = if rules.is_empty() {
        "keep every committed step (no --keep-last or --keep-every)".to_string()
    } else {
        format!(
            "keep {} and the newest committed step of {scope}",
            rules.join(" and ")
        )
    };
    Ok(GcOutput {
        store: store.url().to_string(),
        retention,
        grace_s: args.grace.as_secs_f64(),
        lease_lapse_s: args.lease_lapse.as_secs_f64(),
        report,
    })
}

fn grouped(steps: &[(String, u64)]) -> String {
    let mut by: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for (r, s) in steps {
        by.entry(r.as_str()).or_default().push(*s);
    }
    by.into_iter()
        .map(|(r, s)| format!("{r}@{{{}}}", fmt::ranges(&s)))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Report for GcOutput {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        let r = &self.report;
        let (del, deletes) = if r.dry_run {
            ("would delete", "would free")
        } else {
            ("deleted", "freed")
        };
        writeln!(
            w,
            "gc of {}{}",
            self.store,
            if r.dry_run {
                " (dry run: nothing deleted)"
            } else {
                ""
            }
        )?;
        writeln!(
            w,
            "  retention  {}; grace {}; saves in flight for {}",
            self.retention,
            fmt::duration(self.grace_s),
            fmt::duration(self.lease_lapse_s)
        )?;
        if r.steps_deleted.is_empty() {
            writeln!(w, "  steps      none to delete")?;
        } else {
            writeln!(
                w,
                "  steps      {del} {} committed: {}",
                r.steps_deleted.len(),
                grouped(&r.steps_deleted)
            )?;
        }
        if !r.incomplete_deleted.is_empty() {
            writeln!(
                w,
                "  abandoned  {del} {} incomplete: {}",
                r.incomplete_deleted.len(),
                grouped(&r.incomplete_deleted)
            )?;
        }
        if !r.incomplete_in_flight.is_empty() {
            writeln!(
                w,
                "  in flight  kept {} incomplete (a save may still commit them): {}",
                r.incomplete_in_flight.len(),
                grouped(&r.incomplete_in_flight)
            )?;
        }
        writeln!(w, "  kept       {} committed step(s)", r.steps_kept.len())?;
        writeln!(
            w,
            "  objects    {del} {}, {deletes} {}; kept {} ({}), {} of them unreferenced but in the grace period",
            r.objects_deleted,
            fmt::bytes(r.bytes_freed),
            r.objects_kept,
            fmt::bytes(r.bytes_kept),
            r.objects_in_grace
        )?;
        if r.objects_kept_as_bases > 0 {
            writeln!(
                w,
                "  bases      kept {} object(s) ({}) only as the delta bases of kept chunks",
                r.objects_kept_as_bases,
                fmt::bytes(r.bytes_kept_as_bases)
            )?;
        }
        if let Some(why) = &r.sweep_deferred {
            writeln!(w, "  sweep      deferred: {why}")?;
            if why.contains("writer lease") && self.lease_lapse_s > 0.0 {
                writeln!(
                    w,
                    "  hint       if no job saves to this store (the leases are a killed job's), \
                     `ckpt gc --lease-lapse 0s --force` sweeps now"
                )?;
            }
        }
        if r.temp_files_deleted + r.temp_files_in_grace > 0 {
            writeln!(
                w,
                "  temporary  {del} {} file(s) interrupted writes left, {deletes} {}; kept {} in the grace period",
                r.temp_files_deleted,
                fmt::bytes(r.temp_bytes_freed),
                r.temp_files_in_grace
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Line {
        #[command(flatten)]
        gc: GcArgs,
    }

    /// `ckpt gc` without flags, and `GcArgs::default()`, ask the store for its own defaults.
    #[test]
    fn no_flags_are_the_stores_defaults() {
        let store = format!("{:?}", GcOptions::default());
        let parsed = Line::parse_from(["gc"]).gc;
        assert_eq!(format!("{:?}", GcOptions::from(&parsed)), store);
        assert_eq!(format!("{:?}", GcOptions::from(&GcArgs::default())), store);
    }
}
