//! `ckpt export RUN@STEP --out DIR [--max-shard-size SIZE] [--dtype bf16|f16|f32]`: a step's
//! consolidated tensors as safetensors: one `model.safetensors`, or shards
//! `model-00001-of-0000N.safetensors` with a `model.safetensors.index.json` laid out the way
//! Hugging Face does.
//!
//! Without `--dtype` the bytes written are exactly those of [`SafetensorsView`], the view the
//! FUSE mount serves as `model.safetensors`, so both are byte-identical. Files appear
//! atomically (written under a hidden name, synced, renamed); only generated names are ever
//! created, inside `--out`, whatever the tensors are called.
//!
//! A sharded export splits across processes or machines ([`super::export_plan`]): every
//! process computes the same plan from the step's metadata, `--part I/N` writes the files of
//! part I only (reading only the chunks of their tensors), and `--write-index` checks every
//! planned file's header and size and writes the index. `--jobs N` does both on this machine
//! with N child processes ([`super::export_jobs`]). Memory per process is bounded by
//! `--memory-budget` (a tensor larger than it streams through in blocks), never by the model.
//!
//! `--out` may be a directory other users can write to: every file is created afresh with
//! `O_EXCL | O_NOFOLLOW` under `.NAME.partial` (a leftover regular one is replaced) and renamed
//! over `NAME`; a symbolic link, directory or other non-regular file at either name is an
//! error naming it (even with `--force`), so nothing outside `--out` is ever written through
//! a link planted there ([`ckpt_store::outfile`]).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ckpt_store::direct::AlignedBuf;
use ckpt_store::outfile::{self, Replacing};
use ckpt_store::placement::flat_range_boxes;
use ckpt_store::{CommitRecord, DType, NdBox, ReadStats, SafetensorsView, StepReader, Store};
use futures::StreamExt;
use futures::stream::FuturesOrdered;
use indicatif::ProgressBar;
use serde::Serialize;
use tokio::sync::OwnedSemaphorePermit;

use super::export_plan::{
    DEFAULT_BUDGET, ExportPlan, OnDisk, PartSpec, Pipeline, PlanFlags, PlannedFile, check_file,
    part_spec,
};
pub use super::export_plan::{INDEX_FILE, SINGLE_FILE, shard_names};
use super::fmt;
use super::parse::{CkptRef, ckpt_ref, size};
use super::stats::{FloatDType, convert};
use super::{CliError, Report, Result, Ui};

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
    pub spawn: Option<super::export_jobs::Spawn>,
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
    let step = args.ckpt.resolve(store).await?;
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
    let mut report = ExportReport {
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
    };
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
        let spawn = args.spawn.as_ref().ok_or_else(|| {
            CliError::usage("--jobs starts `ckpt` processes: run it through the ckpt binary")
        })?;
        let total: u64 = plan.files.iter().map(|f| f.view.len()).sum();
        let pb = ui.bytes(total, format!("exporting {what} ({parts} processes)"));
        let reports = super::export_jobs::run_parts(spawn, args, &what, &plan, &pb).await?;
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
        report.index = Some(write_index(&plan, &original, &args.out).await?);
        return Ok(finish(report, t0));
    }

    let part = args.part.unwrap_or(PartSpec { index: 0, count: 1 });
    let mine: Vec<&PlannedFile> = plan.files_of(part.index).collect();
    let with_index = args.part.is_none() && plan.sharded();
    let mut targets: Vec<&str> = mine.iter().map(|f| f.name.as_str()).collect();
    if with_index {
        targets.push(INDEX_FILE);
    }
    // A link or special file at a name the export writes is refused even with --force: it is
    // not this export's to replace (a planted link would send the bytes outside --out).
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
    // What is there already: a part keeps its files that are complete and as planned (it is
    // being run again); anything else at a name it writes needs --force.
    let mut todo: Vec<&PlannedFile> = Vec::new();
    if args.force {
        todo = mine.clone();
    } else if args.part.is_some() {
        for f in &mine {
            match check_file(&args.out.join(&f.name), &f.view) {
                OnDisk::Missing => todo.push(f),
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
    } else {
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
        todo = mine.clone();
    }
    if mine.is_empty() {
        tracing::info!(part = %part, files = plan.files.len(), "this part has no file to write");
    }

    if !todo.is_empty() {
        // The pipeline for the budget, from the largest chunk the files' tensors are stored in.
        let names: Vec<&str> = todo
            .iter()
            .flat_map(|f| f.view.entries().iter().map(|e| e.name.as_str()))
            .collect();
        let chunk = largest_chunk(&reader, &names).await?;
        let rc = store.config().read_concurrency;
        let converting = args.dtype.is_some();
        let pipe = Pipeline::for_budget(args.memory_budget, chunk, rc, converting)
            .map_err(CliError::usage)?;
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
        for f in &todo {
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
    }
    report.bytes_written = report.files.iter().map(|f| f.bytes).sum();
    if with_index {
        report.index = Some(write_index(&plan, &original, &args.out).await?);
    }
    sync_dir(&args.out);
    Ok(finish(report, t0))
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

/// Check every planned file in `out` (present, regular, the planned size and header) and
/// write the index over them; returns its name. Errors name what is missing or differs.
async fn write_index(plan: &ExportPlan, commit: &CommitRecord, out: &Path) -> Result<String> {
    let mut missing = Vec::new();
    let mut differ = Vec::new();
    for f in &plan.files {
        match check_file(&out.join(&f.name), &f.view) {
            OnDisk::Matches => {}
            OnDisk::Missing => missing.push(f.name.clone()),
            OnDisk::Differs(why) => differ.push(format!("{}: {why}", f.name)),
        }
    }
    // Shards of another plan (another --max-shard-size, so another count) lying in `out`.
    let planned: std::collections::HashSet<&str> =
        plan.files.iter().map(|f| f.name.as_str()).collect();
    let mut foreign: Vec<String> = std::fs::read_dir(out)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| is_shard_name(n) && !planned.contains(n.as_str()))
                .collect()
        })
        .unwrap_or_default();
    foreign.sort();
    let n = plan.files.len();
    if !missing.is_empty() || !differ.is_empty() {
        let mut msg = format!("cannot write {INDEX_FILE} in {}: ", out.display());
        if !missing.is_empty() {
            msg.push_str(&format!(
                "{} of {n} files missing ({})",
                missing.len(),
                list(&missing)
            ));
        }
        if !differ.is_empty() {
            if !missing.is_empty() {
                msg.push_str("; ");
            }
            msg.push_str(&format!(
                "{} of {n} files differ from the plan ({})",
                differ.len(),
                list(&differ)
            ));
        }
        let mut hint = String::from(
            "run every part (ckpt export ... --part I/N) to the end with the same \
             --max-shard-size, --dtype, --include and --exclude as this command",
        );
        if !foreign.is_empty() {
            hint.push_str(&format!(
                "; {} holds shards of another plan ({}): a part run with another \
                 --max-shard-size?",
                out.display(),
                list(&foreign)
            ));
        }
        return Err(CliError::error(msg).hint(hint));
    }
    if !foreign.is_empty() {
        tracing::warn!(files = %list(&foreign), "shards of another export are in the directory; the index does not name them");
    }
    let text = plan.index_json(&commit.run, commit.step)?;
    let path = out.join(INDEX_FILE);
    outfile::check_replaceable(&path)
        .map_err(|e| CliError::error(e.to_string()).hint("remove it, or choose another --out"))?;
    write_atomically(&path, false, 0, |mut file, tmp| async move {
        file.write(&text)
            .and_then(|()| file.finish())
            .map_err(|e| CliError::error(format!("writing {}: {e}", tmp.display())))?;
        Ok(((text.len() as u64, ReadStats::default()), file.into_file()))
    })
    .await?;
    sync_dir(out);
    Ok(INDEX_FILE.to_string())
}

/// `model-NNNNN-of-MMMMM.safetensors`.
fn is_shard_name(n: &str) -> bool {
    let Some(rest) = n
        .strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let b = rest.as_bytes();
    b.len() == 14 && &rest[5..9] == "-of-" && b[..5].iter().chain(&b[9..]).all(u8::is_ascii_digit)
}

/// The first few of `items`, and how many more.
fn list(items: &[String]) -> String {
    const SHOWN: usize = 4;
    let mut s = items
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > SHOWN {
        s.push_str(&format!(" and {} more", items.len() - SHOWN));
    }
    s
}

/// Progress of the bytes written: the bar, and `progress N` lines on stdout for a parent.
struct Progress {
    bar: ProgressBar,
    lines: bool,
}

impl Progress {
    fn inc(&self, n: u64) {
        self.bar.inc(n);
        if self.lines {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "progress {n}").and_then(|()| out.flush());
        }
    }
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Write `path` through `.NAME.partial` beside it, created afresh without following links
/// ([`Replacing`]; `O_DIRECT` with a staging buffer of `stage` bytes when `direct` and the file
/// system allows it): `write` fills the temporary file and hands it back, it is then synced
/// and renamed; on failure (or a crash) it is removed or left under the temporary name, and
/// `path` is untouched.
async fn write_atomically<T, F, Fut>(path: &Path, direct: bool, stage: usize, write: F) -> Result<T>
where
    F: FnOnce(OutFile, PathBuf) -> Fut,
    Fut: std::future::Future<Output = Result<(T, std::fs::File)>>,
{
    let (replacing, file) = OutFile::create(path, direct, stage)
        .map_err(|e| CliError::error(format!("creating a file for {}: {e}", path.display())))?;
    let tmp = replacing.temp_path().to_path_buf();
    // On an error the temporary file is removed when `replacing` drops.
    let (n, f) = write(file, tmp).await?;
    replacing
        .commit(f)
        .map_err(|e| CliError::error(format!("finishing {}: {e}", path.display())))?;
    Ok(n)
}

/// Stream a view into `path`. Up to `pipe.depth` blocks are read at once, and reading goes on
/// while the writer thread writes; buffers go back to a pool after writing, so a 100 GB
/// export allocates (and page-faults) a few blocks, not 100 GB. Returns the bytes written and
/// what was read.
#[allow(
    clippy::too_many_arguments,
    reason = "one call site; the pieces of one export"
)]
async fn write_view(
    reader: &StepReader,
    original: &CommitRecord,
    view: &SafetensorsView,
    converting: bool,
    pipe: &Pipeline,
    file: OutFile,
    path: PathBuf,
    progress: &Progress,
) -> Result<((u64, ReadStats), std::fs::File)> {
    let pool: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    // A permit per block outstanding (being read, or queued for the writer): bounds memory.
    let permits = Arc::new(tokio::sync::Semaphore::new(pipe.depth));
    let (tx, rx) = std::sync::mpsc::channel::<(Vec<u8>, OwnedSemaphorePermit)>();
    let writer = {
        let pool = pool.clone();
        tokio::task::spawn_blocking(move || -> std::io::Result<(u64, std::fs::File)> {
            let mut f = file;
            for (block, permit) in rx {
                f.write(&block)?;
                pool.lock().expect("buffer pool").push(block);
                drop(permit);
            }
            let n = f.finish()?;
            Ok((n, f.into_file()))
        })
    };

    let mut jobs = plan_blocks(view, original, converting, pipe.block)
        .into_iter()
        .peekable();
    let mut reads = FuturesOrdered::new();
    let mut sent = 0u64;
    let mut stats = ReadStats::default();
    let mut failure = None;
    loop {
        // Start blocks while permits last; otherwise collect finished blocks in order. Both
        // at once: waiting for the writer never stops the reads in flight.
        tokio::select! {
            permit = permits.clone().acquire_owned(), if jobs.peek().is_some() => {
                let permit = permit.map_err(|_| CliError::error("export pipeline closed"))?;
                let job = jobs.next().expect("peeked");
                let buf = pool.lock().expect("buffer pool").pop().unwrap_or_default();
                reads.push_back(async move { (read_block(reader, view, job, buf).await, permit) });
            }
            Some((res, permit)) = reads.next(), if !reads.is_empty() => {
                let (block, st) = match res {
                    Ok(b) => b,
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                };
                stats.add(&st);
                let len = block.len() as u64;
                if tx.send((block, permit)).is_err() {
                    break; // the writer failed; its error is reported below
                }
                sent += len;
                progress.inc(len);
            }
            else => break,
        }
    }
    drop(reads);
    drop(tx);
    let (written, out) = writer
        .await
        .map_err(|_| CliError::error("the writer thread panicked"))?
        .map_err(|e| {
            let hint = match e.raw_os_error() {
                Some(28) => " (the disk is full: free space or choose another --out)",
                _ => "",
            };
            CliError::error(format!("writing {}: {e}{hint}", path.display()))
        })?;
    if let Some(e) = failure {
        return Err(e);
    }
    if written != view.len() || sent != written {
        return Err(CliError::error(format!(
            "{}: wrote {written} bytes, the file should have {} (a bug in ckpt)",
            path.display(),
            view.len()
        )));
    }
    Ok(((written, stats), out))
}

/// `O_DIRECT` alignment.
const ALIGN: usize = super::export_plan::ALIGN as usize;

/// The file an export writes: through `O_DIRECT` with an aligned staging buffer where the
/// file system allows it (buffered writes of gigabytes spend most of their time growing and
/// flushing the page cache), buffered otherwise (tmpfs).
struct OutFile {
    f: std::fs::File,
    stage: Option<AlignedBuf>,
    stage_len: usize,
    fill: usize,
    at: u64,
}

impl OutFile {
    /// Start replacing `path` ([`Replacing`]): the temporary file, with `O_DIRECT` if `direct`
    /// and the file system takes it.
    fn create(path: &Path, direct: bool, stage: usize) -> std::io::Result<(Replacing, Self)> {
        let stage = stage.max(ALIGN) / ALIGN * ALIGN;
        let buffered = |(r, f)| {
            (
                r,
                OutFile {
                    f,
                    stage: None,
                    stage_len: 0,
                    fill: 0,
                    at: 0,
                },
            )
        };
        if !direct {
            return Replacing::start(path, 0).map(buffered);
        }
        match Replacing::start(path, libc::O_DIRECT) {
            Ok((r, f)) => Ok((
                r,
                OutFile {
                    f,
                    stage: Some(AlignedBuf::zeroed(stage)),
                    stage_len: stage,
                    fill: 0,
                    at: 0,
                },
            )),
            // tmpfs refuses O_DIRECT (after creating the file, which `start` replaces).
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                Replacing::start(path, 0).map(buffered)
            }
            Err(e) => Err(e),
        }
    }

    /// The file, once [`OutFile::finish`]ed.
    fn into_file(self) -> std::fs::File {
        self.f
    }

    fn write(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let Some(stage) = self.stage.as_mut() else {
            self.at += data.len() as u64;
            return self.f.write_all(data);
        };
        let full = self.stage_len;
        while !data.is_empty() {
            let take = (full - self.fill).min(data.len());
            stage.full_mut()[self.fill..self.fill + take].copy_from_slice(&data[..take]);
            self.fill += take;
            data = &data[take..];
            if self.fill == full {
                self.f.write_all_at(&stage.full_mut()[..full], self.at)?;
                self.at += full as u64;
                self.fill = 0;
            }
        }
        Ok(())
    }

    /// Write what is staged (padded to the alignment, then truncated back); returns the size.
    fn finish(&mut self) -> std::io::Result<u64> {
        use std::os::unix::fs::FileExt;
        match self.stage.as_mut() {
            None => self.f.flush()?,
            Some(stage) if self.fill > 0 => {
                let padded = self.fill.div_ceil(ALIGN) * ALIGN;
                stage.full_mut()[self.fill..padded].fill(0);
                self.f.write_all_at(&stage.full_mut()[..padded], self.at)?;
                self.at += self.fill as u64;
                self.f.set_len(self.at)?;
                self.fill = 0;
            }
            Some(_) => {}
        }
        Ok(self.at)
    }
}

/// A piece of an exported file.
#[derive(Debug, Clone)]
enum Block {
    /// Bytes `start..end` of the view, as it serves them.
    Raw { start: u64, end: u64 },
    /// The header.
    Header,
    /// Elements `lo..hi` of a tensor, converted from `from` to `to`.
    Convert {
        name: String,
        shape: Vec<u64>,
        from: DType,
        to: DType,
        lo: u64,
        hi: u64,
    },
}

/// The blocks of a view, each at most `block` bytes. Small tensors share a block; a tensor
/// larger than `block` is cut at multiples of `block` from its own start, so where `block`
/// holds whole chunks and the tensor was saved as one shard, no chunk is split between two
/// blocks (and fetched twice).
fn plan_blocks(
    view: &SafetensorsView,
    original: &CommitRecord,
    converting: bool,
    block: u64,
) -> Vec<Block> {
    let block = block.max(1);
    if !converting {
        let mut out = Vec::new();
        let mut start = 0u64;
        for e in view.entries() {
            let end = e.start + e.len;
            if e.len > block {
                if e.start > start {
                    out.push(Block::Raw {
                        start,
                        end: e.start,
                    });
                }
                let mut a = e.start;
                while a < end {
                    let b = (a + block).min(end);
                    out.push(Block::Raw { start: a, end: b });
                    a = b;
                }
                start = end;
            } else if end - start > block {
                if e.start > start {
                    out.push(Block::Raw {
                        start,
                        end: e.start,
                    });
                }
                start = e.start;
            }
        }
        if view.len() > start {
            out.push(Block::Raw {
                start,
                end: view.len(),
            });
        }
        return out;
    }
    let mut out = vec![Block::Header];
    for e in view.entries() {
        let from = original.tensor(&e.name).map_or(e.dtype, |t| t.dtype);
        let n = e.len / e.dtype.size() as u64;
        let per = (block / from.size().max(e.dtype.size()) as u64).max(1);
        for i in 0..n.div_ceil(per) {
            out.push(Block::Convert {
                name: e.name.clone(),
                shape: e.shape.clone(),
                from,
                to: e.dtype,
                lo: i * per,
                hi: ((i + 1) * per).min(n),
            });
        }
    }
    out
}

/// Read one block, into `buf` where the block is raw view bytes (every byte of the range is
/// overwritten, so a reused buffer needs no clearing).
async fn read_block(
    reader: &StepReader,
    view: &SafetensorsView,
    job: Block,
    mut buf: Vec<u8>,
) -> Result<(Vec<u8>, ReadStats)> {
    match job {
        Block::Raw { start, end } => {
            buf.resize((end - start) as usize, 0);
            let st = read_range(reader, view, start, &mut buf).await?;
            Ok((buf, st))
        }
        Block::Header => Ok((view.header().to_vec(), ReadStats::default())),
        Block::Convert {
            name,
            shape,
            from,
            to,
            lo,
            hi,
        } => {
            let elem = from.size() as u64;
            let mut src = vec![0u8; ((hi - lo) * elem) as usize];
            let stats = read_flat(reader, &name, from, &shape, lo, hi, &mut src).await?;
            if from == to {
                return Ok((src, stats));
            }
            let out = tokio::task::spawn_blocking(move || convert(from, to, &src))
                .await
                .map_err(|e| CliError::from(ckpt_store::Error::from(e)))?;
            Ok((out, stats))
        }
    }
}

/// Bytes `start..start + buf.len()` of `view` into `buf`: the header's bytes, and each
/// tensor's elements under the range read with [`read_flat`]. Falls back to the view's own
/// reader for a range that cuts an element (blocks never do).
async fn read_range(
    reader: &StepReader,
    view: &SafetensorsView,
    start: u64,
    buf: &mut [u8],
) -> Result<ReadStats> {
    let end = start + buf.len() as u64;
    let cuts = view.entries().iter().any(|e| {
        let elem = e.dtype.size() as u64;
        let inside = |x: u64| x > e.start && x < e.start + e.len;
        (inside(start) && !(start - e.start).is_multiple_of(elem))
            || (inside(end) && !(end - e.start).is_multiple_of(elem))
    });
    if cuts {
        let (_, st) = view.read_at(reader, start, buf).await?;
        return Ok(st);
    }
    let header = view.header();
    let hl = header.len() as u64;
    if start < hl {
        let h_end = end.min(hl);
        buf[..(h_end - start) as usize].copy_from_slice(&header[start as usize..h_end as usize]);
    }
    let mut stats = ReadStats::default();
    for e in view.entries() {
        let (a, b) = (start.max(e.start), end.min(e.start + e.len));
        if a >= b {
            continue;
        }
        let elem = e.dtype.size() as u64;
        let out = &mut buf[(a - start) as usize..(b - start) as usize];
        let st = read_flat(
            reader,
            &e.name,
            e.dtype,
            &e.shape,
            (a - e.start) / elem,
            (b - e.start) / elem,
            out,
        )
        .await?;
        stats.add(&st);
    }
    Ok(stats)
}

/// Elements `lo..hi` (row-major) of `tensor` into `out`, fetching each chunk under them once:
/// the range is up to `2 * ndim - 1` boxes, whose plans are merged by chunk before one
/// execution (box by box, a chunk under two boxes would be fetched twice).
async fn read_flat(
    reader: &StepReader,
    tensor: &str,
    dtype: DType,
    shape: &[u64],
    lo: u64,
    hi: u64,
    out: &mut [u8],
) -> Result<ReadStats> {
    let elem = dtype.size() as u64;
    let mut chunks: Vec<ckpt_store::read::PlannedChunk> = Vec::new();
    let mut at: std::collections::HashMap<ckpt_store::ChunkId, usize> = Default::default();
    let mut dst = 0u64;
    for bx in flat_range_boxes(shape, lo, hi) {
        let plan = reader.plan(tensor, &bx).await?;
        for mut pc in plan.chunks {
            for c in &mut pc.copies {
                c.dst += dst;
            }
            match at.get(&pc.chunk.id) {
                Some(&i) => chunks[i].copies.extend(pc.copies),
                None => {
                    at.insert(pc.chunk.id, chunks.len());
                    chunks.push(pc);
                }
            }
        }
        dst += bx.numel() * elem;
    }
    let merged = ckpt_store::ReadPlan {
        tensor: tensor.to_string(),
        dtype,
        bbox: NdBox::new(vec![lo], vec![hi - lo])?,
        chunks,
    };
    Ok(reader.execute(&merged, out).await?)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_are_recognized() {
        assert!(is_shard_name("model-00001-of-00004.safetensors"));
        assert!(!is_shard_name("model.safetensors"));
        assert!(!is_shard_name("model-0001-of-00004.safetensors"));
        assert!(!is_shard_name("model-0000a-of-00004.safetensors"));
        assert!(!is_shard_name(".model-00001-of-00004.safetensors.partial"));
    }
}
