//! `ckpt export RUN@STEP --out DIR [--max-shard-size SIZE] [--dtype bf16|f16|f32]`: a step's
//! consolidated tensors as safetensors: one `model.safetensors`, or shards
//! `model-00001-of-0000N.safetensors` with a `model.safetensors.index.json` laid out the way
//! Hugging Face does.
//!
//! Without `--dtype` the bytes written are exactly those of [`SafetensorsView`](ckpt_store::SafetensorsView), the view the
//! FUSE mount serves as `model.safetensors`, so both are byte-identical. Files appear
//! atomically (written under a hidden name, synced, renamed); only generated names are ever
//! created, inside `--out`, whatever the tensors are called.
//!
//! A sharded export splits across processes or machines ([`plan`]): every process computes
//! the same plan from the step's metadata, `--part I/N` writes the files of part I only
//! (reading only the chunks of their tensors), and `--write-index` checks every planned
//! file's header and size and writes the index. `--jobs N` does both on this machine with N
//! child processes ([`jobs`]). Memory per process is bounded by `--memory-budget` (a tensor
//! larger than it streams through in blocks), never by the model.
//!
//! `--out` may be a directory other users can write to: every file is created afresh with
//! `O_EXCL | O_NOFOLLOW` under `.NAME.partial` (a leftover regular one is replaced) and renamed
//! over `NAME`; a symbolic link, directory or other non-regular file at either name is an
//! error naming it (even with `--force`), so nothing outside `--out` is ever written through
//! a link planted there ([`ckpt_store::outfile`]).
//!
//! The files of this folder: `mod.rs` the flags, the report and the steps of one export;
//! `plan.rs` the plan from the commit record and flags alone; `jobs.rs` the parts as child
//! processes; `write.rs` one file written through the block pipeline; `index.rs` the index
//! of a sharded export.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use ckpt_store::outfile::{self, Replacing};
use ckpt_store::{CommitRecord, NdBox, ReadStats, StepReader, Store};
use serde::Serialize;

mod index;
pub mod jobs;
pub mod plan;
mod write;

use self::index::write_index;
use self::plan::{
    DEFAULT_BUDGET, ExportPlan, OnDisk, PartSpec, Pipeline, PlanFlags, PlannedFile, check_file,
    part_spec,
};
pub use self::plan::{INDEX_FILE, SINGLE_FILE, shard_names};
use self::write::{Progress, sync_dir, write_atomically, write_view};
use super::{CliError, Report, Result, Ui};
use crate::cli::shared::fmt;
use crate::cli::shared::parse::{CkptRef, ckpt_ref, size};
use crate::cli::shared::values::FloatDType;

/// Arguments of `ckpt export`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExportArgs {
    /// The checkpoint: RUN@STEP, RUN@latest or RUN.
    #[arg(value_parser = ckpt_ref)]
    pub ckpt: CkptRef,
    /// The directory to write into (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Split into files of at most this size (a larger tensor gets a file of its own), with
    /// a model.safetensors.index.json.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub max_shard_size: Option<u64>,
    /// Convert floating-point tensors to this dtype; integers and booleans are kept.
    #[arg(long, value_enum)]
    pub dtype: Option<FloatDType>,
    /// Export only tensors matching this pattern (`*` and `?` wildcards). Repeatable.
    #[arg(long, value_name = "PATTERN")]
    pub include: Vec<String>,
    /// Leave out tensors matching this pattern (e.g. 'optim.*'). Repeatable.
    #[arg(long, value_name = "PATTERN")]
    pub exclude: Vec<String>,
    /// Overwrite files of the same names in --out.
    #[arg(long)]
    pub force: bool,
    /// Write only the files of part I of N (counted from 0), for an export split across
    /// processes or machines; needs --max-shard-size, the same in every part. Files of the
    /// part already complete in --out are kept. Then run --write-index once.
    #[arg(long, value_name = "I/N", value_parser = part_spec, conflicts_with_all = ["jobs", "write_index"])]
    pub part: Option<PartSpec>,
    /// Check that every file of the sharded export is in --out, complete and as planned
    /// (same flags as the parts), and write model.safetensors.index.json.
    #[arg(long, conflicts_with = "jobs")]
    pub write_index: bool,
    /// Run the export as N processes on this machine (each with --memory-budget), then
    /// write the index; needs --max-shard-size.
    #[arg(long, value_name = "N")]
    pub jobs: Option<usize>,
    /// Memory for the buffers of this process (blocks in flight, chunks being fetched, the
    /// write buffer); tensors larger than it stream through in blocks.
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "256MiB")]
    pub memory_budget: u64,
    /// Print `progress BYTES` lines on stdout as data is written (for `--jobs`' parent).
    #[arg(long, hide = true)]
    pub progress_lines: bool,
    /// How to start the processes of `--jobs` (set by the `ckpt` binary).
    #[arg(skip)]
    pub spawn: Option<jobs::Spawn>,
}

impl ExportArgs {
    /// Export `ckpt` into `out` with defaults.
    pub fn new(ckpt: CkptRef, out: impl Into<PathBuf>) -> Self {
        ExportArgs {
            ckpt,
            out: out.into(),
            max_shard_size: None,
            dtype: None,
            include: Vec::new(),
            exclude: Vec::new(),
            force: false,
            part: None,
            write_index: false,
            jobs: None,
            memory_budget: DEFAULT_BUDGET,
            progress_lines: false,
            spawn: None,
        }
    }

    /// The command line of part `part` of `count` of this export, for a child `ckpt export`
    /// started by `--jobs` (`what` is `RUN@STEP`): the same plan flags, JSON report and
    /// progress lines on stdout.
    fn part_args(&self, what: &str, part: usize, count: usize) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec!["export".into(), what.into(), "--out".into()];
        a.push(self.out.clone().into_os_string());
        a.extend(["--part".into(), format!("{part}/{count}").into()]);
        a.extend([
            "--memory-budget".into(),
            self.memory_budget.to_string().into(),
        ]);
        a.extend(["--json", "--no-progress", "--progress-lines"].map(OsString::from));
        if let Some(m) = self.max_shard_size {
            a.extend(["--max-shard-size".into(), m.to_string().into()]);
        }
        if let Some(d) = self.dtype {
            let v = clap::ValueEnum::to_possible_value(&d).expect("no skipped variants");
            a.extend(["--dtype".into(), v.get_name().into()]);
        }
        for p in &self.include {
            a.extend(["--include".into(), p.into()]);
        }
        for p in &self.exclude {
            a.extend(["--exclude".into(), p.into()]);
        }
        if self.force {
            a.push("--force".into());
        }
        a
    }

    fn plan_flags(&self) -> PlanFlags<'_> {
        PlanFlags {
            max_shard_size: self.max_shard_size,
            dtype: self.dtype,
            include: &self.include,
            exclude: &self.exclude,
        }
    }
}

/// One file written.
#[derive(Debug, Clone, Serialize)]
pub struct ExportedFile {
    /// File name inside `out`.
    pub file: String,
    /// Its size.
    pub bytes: u64,
    /// Tensors in it.
    pub tensors: usize,
}

/// What `ckpt export` wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ExportReport {
    /// Run.
    pub run: String,
    /// Step.
    pub step: u64,
    /// The directory written into.
    pub out: String,
    /// The part this process wrote (`I/N`), for `--part`.
    pub part: Option<String>,
    /// The safetensors files written, in order.
    pub files: Vec<ExportedFile>,
    /// Files of this part found complete in `out` and kept (a part run again).
    pub kept: Vec<String>,
    /// The index file, when this process wrote it.
    pub index: Option<String>,
    /// Tensors exported (by the whole export).
    pub tensors: usize,
    /// Bytes of tensor data of the whole export (the index's `total_size`).
    pub tensor_bytes: u64,
    /// Bytes written, headers included.
    pub bytes_written: u64,
    /// The dtype floating-point tensors were converted to.
    pub dtype: Option<String>,
    /// What this process read from the store.
    pub read: ReadStats,
    /// `--memory-budget`, per process.
    pub memory_budget: u64,
    /// How the budget was used: block size, blocks and fetches in flight, write buffer.
    pub pipeline: Option<Pipeline>,
    /// This process's peak resident memory (Linux: VmHWM), bytes.
    pub peak_rss_bytes: Option<u64>,
    /// `--jobs`: each part's own report, as it printed it.
    pub parts: Vec<serde_json::Value>,
    /// Seconds it took.
    pub seconds: f64,
}

/// Export a step (or one part of it, or only its index: see the module docs).
pub async fn export(store: &Store, args: &ExportArgs, ui: &Ui) -> Result<ExportReport> {
    let t0 = Instant::now();
    let parts = check_flags(args)?;
    let step = super::shared::resolve(store, &args.ckpt).await?;
    let reader = StepReader::open(store, &args.ckpt.run, step).await?;
    let original = reader.commit().clone();
    let plan = ExportPlan::new(&original, &args.plan_flags(), parts)?;
    let what = format!("{}@{}", original.run, original.step);

    if args.out.exists() && !args.out.is_dir() {
        return Err(CliError::usage(format!(
            "--out {} exists and is not a directory",
            args.out.display()
        )));
    }
    let mut report = ExportReport::begin(args, &original, &plan);
    if args.write_index {
        if !plan.sharded() {
            return Err(CliError::usage(format!(
                "--max-shard-size {} puts all of {what} in one file: there is no index to write",
                fmt::bytes(args.max_shard_size.unwrap_or_default())
            )));
        }
        report.index = Some(write_index(&plan, &original, &args.out).await?);
        return Ok(finish(report, t0));
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| CliError::error(format!("creating {}: {e}", args.out.display())))?;

    if parts > 1 && args.part.is_none() && plan.sharded() {
        // --jobs N: the parts as child processes, then the index.
        run_jobs(args, &what, &plan, &mut report, ui).await?;
        report.index = Some(write_index(&plan, &original, &args.out).await?);
        return Ok(finish(report, t0));
    }

    let part = args.part.unwrap_or(PartSpec { index: 0, count: 1 });
    let mine: Vec<&PlannedFile> = plan.files_of(part.index).collect();
    let with_index = args.part.is_none() && plan.sharded();
    let todo = files_to_write(args, &mine, with_index, &mut report)?;
    if mine.is_empty() {
        tracing::info!(part = %part, files = plan.files.len(), "this part has no file to write");
    }
    if !todo.is_empty() {
        write_files(store, reader, &todo, args, &what, &mut report, ui).await?;
    }
    report.bytes_written = report.files.iter().map(|f| f.bytes).sum();
    if with_index {
        report.index = Some(write_index(&plan, &original, &args.out).await?);
    }
    sync_dir(&args.out);
    Ok(finish(report, t0))
}

/// The flags that do not go together; returns the number of parts the plan is split into.
fn check_flags(args: &ExportArgs) -> Result<usize> {
    if args.part.is_some() && args.jobs.is_some() {
        return Err(CliError::usage("--part and --jobs do not go together"));
    }
    if args.write_index && (args.part.is_some() || args.jobs.is_some()) {
        return Err(CliError::usage(
            "--write-index writes only the index: leave out --part and --jobs",
        ));
    }
    if args.jobs == Some(0) {
        return Err(CliError::usage("--jobs must be at least 1"));
    }
    let parts = args.part.map_or(args.jobs.unwrap_or(1), |p| p.count);
    if parts > 1 && args.max_shard_size.is_none() {
        return Err(CliError::usage(format!(
            "--{} splits the files of a sharded export among processes: give --max-shard-size",
            if args.part.is_some() { "part" } else { "jobs" }
        ))
        .hint("e.g. --max-shard-size 5GB (Hugging Face's default), the same in every part"));
    }
    if args.write_index && args.max_shard_size.is_none() {
        return Err(CliError::usage(
            "--write-index writes the index of a sharded export: give the --max-shard-size \
             (and --dtype, --include, --exclude) the parts ran with",
        ));
    }
    Ok(parts)
}

/// `--jobs N`: every part as a child process, their files and reports gathered into `report`.
async fn run_jobs(
    args: &ExportArgs,
    what: &str,
    plan: &ExportPlan,
    report: &mut ExportReport,
    ui: &Ui,
) -> Result<()> {
    let spawn = args.spawn.as_ref().ok_or_else(|| {
        CliError::usage("--jobs starts `ckpt` processes: run it through the ckpt binary")
    })?;
    let total: u64 = plan.files.iter().map(|f| f.view.len()).sum();
    let pb = ui.bytes(
        total,
        format!("exporting {what} ({} processes)", plan.parts),
    );
    let part_args = |part, count| args.part_args(what, part, count);
    let reports = jobs::run_parts(spawn, what, plan, part_args, &pb).await?;
    pb.finish_and_clear();
    for r in &reports {
        for f in r["files"].as_array().into_iter().flatten() {
            report.files.push(ExportedFile {
                file: f["file"].as_str().unwrap_or_default().to_string(),
                bytes: f["bytes"].as_u64().unwrap_or_default(),
                tensors: f["tensors"].as_u64().unwrap_or_default() as usize,
            });
        }
        for k in r["kept"].as_array().into_iter().flatten() {
            report.kept.push(k.as_str().unwrap_or_default().to_string());
        }
    }
    report.files.sort_by(|a, b| a.file.cmp(&b.file));
    report.kept.sort();
    report.parts = reports;
    report.bytes_written = report.files.iter().map(|f| f.bytes).sum();
    Ok(())
}

/// Which of this part's files (`mine`) to write. A link or special file at a name the export
/// writes is refused even with `--force`; a part keeps its files that are complete and as
/// planned (it is being run again, recorded in `report.kept`); anything else at a name it
/// writes needs `--force`.
fn files_to_write<'a>(
    args: &ExportArgs,
    mine: &[&'a PlannedFile],
    with_index: bool,
    report: &mut ExportReport,
) -> Result<Vec<&'a PlannedFile>> {
    let mut targets: Vec<&str> = mine.iter().map(|f| f.name.as_str()).collect();
    if with_index {
        targets.push(INDEX_FILE);
    }
    // Not this export's to replace: a planted link would send the bytes outside --out.
    for f in &targets {
        let p = args.out.join(f);
        for q in [
            p.clone(),
            Replacing::temp_name(&p).unwrap_or_else(|_| p.clone()),
        ] {
            outfile::check_replaceable(&q).map_err(|e| {
                CliError::error(e.to_string()).hint("remove it, or choose another --out")
            })?;
        }
    }
    if args.force {
        return Ok(mine.to_vec());
    }
    if args.part.is_none() {
        let present: Vec<&str> = targets
            .iter()
            .copied()
            .filter(|f| std::fs::symlink_metadata(args.out.join(f)).is_ok())
            .collect();
        if !present.is_empty() {
            return Err(CliError::error(format!(
                "{} already holds {}",
                args.out.display(),
                present.join(", ")
            ))
            .hint("pass --force to overwrite, or choose another --out"));
        }
        return Ok(mine.to_vec());
    }
    let mut todo = Vec::new();
    for f in mine {
        match check_file(&args.out.join(&f.name), &f.view) {
            OnDisk::Missing => todo.push(*f),
            OnDisk::Matches => report.kept.push(f.name.clone()),
            OnDisk::Differs(why) => {
                return Err(CliError::error(format!(
                    "{} in {} is not the file this part would write: {why}",
                    f.name,
                    args.out.display()
                ))
                .hint(
                    "were the parts run with different --max-shard-size, --dtype, \
                     --include or --exclude, or for another step? pass --force to \
                     overwrite it",
                ));
            }
        }
    }
    Ok(todo)
}

/// Write the files `todo` through the pipeline sized for `--memory-budget`.
async fn write_files(
    store: &Store,
    reader: StepReader,
    todo: &[&PlannedFile],
    args: &ExportArgs,
    what: &str,
    report: &mut ExportReport,
    ui: &Ui,
) -> Result<()> {
    let original = reader.commit().clone();
    // The pipeline for the budget, from the largest chunk the files' tensors are stored in.
    let names: Vec<&str> = todo
        .iter()
        .flat_map(|f| f.view.entries().iter().map(|e| e.name.as_str()))
        .collect();
    let chunk = largest_chunk(&reader, &names).await?;
    let rc = store.config().read_concurrency;
    let converting = args.dtype.is_some();
    let pipe =
        Pipeline::for_budget(args.memory_budget, chunk, rc, converting).map_err(CliError::usage)?;
    report.pipeline = Some(pipe);
    tracing::info!(?pipe, chunk, "export pipeline");
    // The read engine fetches `fetch` chunks at a time per block.
    let reader = if pipe.fetch == rc {
        reader
    } else {
        let mut cfg = store.config().clone();
        cfg.read_concurrency = pipe.fetch;
        let narrow = store.clone().with_config(cfg)?;
        StepReader::open(&narrow, &original.run, original.step).await?
    };
    let total: u64 = todo.iter().map(|f| f.view.len()).sum();
    let progress = Progress {
        bar: ui.bytes(total, format!("exporting {what}")),
        lines: args.progress_lines,
    };
    for f in todo {
        let path = args.out.join(&f.name);
        let view = &f.view;
        let (bytes, stats) = write_atomically(&path, true, pipe.stage as usize, |file, tmp| {
            write_view(
                &reader, &original, view, converting, &pipe, file, tmp, &progress,
            )
        })
        .await
        .map_err(|e| e.context(format!("exporting {what} to {}", path.display())))?;
        report.read.add(&stats);
        report.files.push(ExportedFile {
            file: f.name.clone(),
            bytes,
            tensors: view.entries().len(),
        });
    }
    progress.bar.finish_and_clear();
    Ok(())
}

impl ExportReport {
    /// The report of an export of `original` by `plan` before anything is written.
    fn begin(args: &ExportArgs, original: &CommitRecord, plan: &ExportPlan) -> Self {
        ExportReport {
            run: original.run.clone(),
            step: original.step,
            out: args.out.display().to_string(),
            part: args.part.map(|p| p.to_string()),
            files: Vec::new(),
            kept: Vec::new(),
            index: None,
            tensors: plan.tensors,
            tensor_bytes: plan.tensor_bytes,
            bytes_written: 0,
            dtype: args.dtype.map(|d| d.dtype().to_string()),
            read: ReadStats::default(),
            memory_budget: args.memory_budget,
            pipeline: None,
            peak_rss_bytes: None,
            parts: Vec::new(),
            seconds: 0.0,
        }
    }
}

fn finish(mut r: ExportReport, t0: Instant) -> ExportReport {
    r.seconds = t0.elapsed().as_secs_f64();
    r.peak_rss_bytes = peak_rss();
    r
}

/// This process's peak resident set (`VmHWM` of `/proc/self/status`), where there is one.
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// The largest raw chunk the named tensors are stored in (the read engine's plans say).
async fn largest_chunk(reader: &StepReader, names: &[&str]) -> Result<u64> {
    let mut max = 0u64;
    for n in names {
        let t = reader.commit().tensor(n).ok_or_else(|| {
            CliError::error(format!("no tensor named {n:?} in the step (a bug in ckpt)"))
        })?;
        let plan = reader.plan(n, &NdBox::full(&t.shape)).await?;
        for c in &plan.chunks {
            max = max.max(c.chunk.len as u64);
        }
    }
    Ok(max.max(1))
}

impl Report for ExportReport {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        if let Some(p) = &self.part {
            write!(w, "part {p}: ")?;
        }
        writeln!(
            w,
            "exported {} tensors of {}@{}{} to {}: {} in {} file(s), {} ({})",
            self.tensors,
            self.run,
            self.step,
            self.dtype
                .as_ref()
                .map_or(String::new(), |d| format!(" as {d}")),
            self.out,
            fmt::bytes(self.bytes_written),
            self.files.len(),
            fmt::duration(self.seconds),
            fmt::rate(self.bytes_written, self.seconds)
        )?;
        for f in &self.files {
            writeln!(
                w,
                "  {}  {} tensors, {}",
                f.file,
                f.tensors,
                fmt::bytes(f.bytes)
            )?;
        }
        for k in &self.kept {
            writeln!(w, "  {k}  complete already, kept")?;
        }
        if let Some(i) = &self.index {
            writeln!(w, "  {i}")?;
        }
        Ok(())
    }
}
