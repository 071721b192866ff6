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
//! `--out` may be a directory other users can write to: every file is created afresh with
//! `O_EXCL | O_NOFOLLOW` under `.NAME.partial` (a leftover regular one is replaced) and renamed
//! over `NAME`; a symbolic link, directory or other non-regular file at either name is an
//! error naming it (even with `--force`), so nothing outside `--out` is ever written through
//! a link planted there ([`ckpt_store::outfile`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ckpt_store::direct::AlignedBuf;
use ckpt_store::outfile::{self, Replacing};
use ckpt_store::placement::flat_range_boxes;
use ckpt_store::{CommitRecord, DType, SafetensorsView, StepReader, Store};
use futures::StreamExt;
use futures::stream::FuturesOrdered;
use indicatif::ProgressBar;
use serde::Serialize;
use tokio::sync::OwnedSemaphorePermit;

use super::fmt;
use super::parse::{CkptRef, ckpt_ref, selected, size};
use super::stats::{FloatDType, convert, converted_dtype};
use super::{CliError, Report, Result, Ui};

/// Bytes read and written per block; `PIPELINE` blocks are read at once.
const BLOCK: u64 = 16 << 20;
const PIPELINE: usize = 8;

/// The file name of a single-file export, and of the shard index.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded export.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

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
    /// The safetensors files, in order.
    pub files: Vec<ExportedFile>,
    /// The index file, for a sharded export.
    pub index: Option<String>,
    /// Tensors exported.
    pub tensors: usize,
    /// Bytes of tensor data (the index's `total_size`).
    pub tensor_bytes: u64,
    /// Bytes written, headers included.
    pub bytes_written: u64,
    /// The dtype floating-point tensors were converted to.
    pub dtype: Option<String>,
    /// Seconds it took.
    pub seconds: f64,
}

/// Split names (in name order) into shards of at most `max` bytes; a tensor larger than `max`
/// gets a shard of its own.
pub fn shard_names(sizes: &[(String, u64)], max: Option<u64>) -> Vec<Vec<String>> {
    let Some(max) = max else {
        return vec![sizes.iter().map(|(n, _)| n.clone()).collect()];
    };
    let mut out: Vec<Vec<String>> = Vec::new();
    let mut cur: Vec<String> = Vec::new();
    let mut cur_len = 0u64;
    for (n, len) in sizes {
        if !cur.is_empty() && cur_len + len > max {
            out.push(std::mem::take(&mut cur));
            cur_len = 0;
        }
        cur.push(n.clone());
        cur_len += len;
    }
    if !cur.is_empty() || out.is_empty() {
        out.push(cur);
    }
    out
}

/// Export a step.
pub async fn export(store: &Store, args: &ExportArgs, ui: &Ui) -> Result<ExportReport> {
    let t0 = Instant::now();
    if args.max_shard_size == Some(0) {
        return Err(CliError::usage("--max-shard-size must be larger than 0"));
    }
    let step = args.ckpt.resolve(store).await?;
    let reader = StepReader::open(store, &args.ckpt.run, step).await?;
    let original = reader.commit().clone();

    // The record the view is built from: converted dtypes where --dtype asks.
    let mut target = original.clone();
    for t in &mut target.tensors {
        t.dtype = converted_dtype(t.dtype, args.dtype);
    }
    let sizes: Vec<(String, u64)> = target
        .tensors
        .iter()
        .filter(|t| selected(&t.name, &args.include, &args.exclude))
        .map(|t| (t.name.clone(), t.byte_len()))
        .collect();
    if sizes.is_empty() {
        return Err(CliError::usage(format!(
            "no tensor of {}@{} matches --include/--exclude ({} tensors in the step)",
            original.run,
            original.step,
            original.tensors.len()
        )));
    }
    let groups = shard_names(&sizes, args.max_shard_size);
    let n = groups.len();
    let file_names: Vec<String> = if n == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=n)
            .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
            .collect()
    };
    let views: Vec<SafetensorsView> = groups
        .iter()
        .map(|names| {
            SafetensorsView::new(&target, Some(names)).map_err(|e| {
                CliError::error(format!(
                    "cannot export {}@{}: {}",
                    original.run,
                    original.step,
                    e.message()
                ))
                .hint("leave the tensor out with --exclude NAME")
            })
        })
        .collect::<Result<_>>()?;

    // Where to write, and nothing there already unless --force.
    if args.out.exists() && !args.out.is_dir() {
        return Err(CliError::usage(format!(
            "--out {} exists and is not a directory",
            args.out.display()
        )));
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| CliError::error(format!("creating {}: {e}", args.out.display())))?;
    let mut targets: Vec<&str> = file_names.iter().map(String::as_str).collect();
    if n > 1 {
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
    if !args.force {
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
    }

    let total: u64 = views.iter().map(SafetensorsView::len).sum();
    let pb = ui.bytes(
        total,
        format!("exporting {}@{}", original.run, original.step),
    );
    let mut files = Vec::with_capacity(n);
    for (view, file) in views.iter().zip(&file_names) {
        let path = args.out.join(file);
        let bytes = write_atomically(&path, true, |file, tmp| {
            write_view(
                &reader,
                &original,
                view,
                args.dtype.is_some(),
                file,
                tmp,
                &pb,
            )
        })
        .await
        .map_err(|e| {
            e.context(format!(
                "exporting {}@{} to {}",
                original.run,
                original.step,
                path.display()
            ))
        })?;
        files.push(ExportedFile {
            file: file.clone(),
            bytes,
            tensors: view.entries().len(),
        });
    }
    pb.finish_and_clear();

    let tensor_bytes: u64 = sizes.iter().map(|(_, s)| s).sum();
    let mut index = None;
    if n > 1 {
        let mut weight_map = BTreeMap::new();
        for (names, file) in groups.iter().zip(&file_names) {
            for name in names {
                weight_map.insert(name.clone(), file.clone());
            }
        }
        let doc = serde_json::json!({
            "metadata": {
                "total_size": tensor_bytes,
                "format": "pt",
                "ckpt.run": original.run,
                "ckpt.step": original.step.to_string(),
            },
            "weight_map": weight_map,
        });
        let mut text = serde_json::to_vec_pretty(&doc)
            .map_err(|e| CliError::error(format!("index json: {e}")))?;
        text.push(b'\n');
        let path = args.out.join(INDEX_FILE);
        write_atomically(&path, false, |mut file, tmp| async move {
            file.write(&text)
                .and_then(|()| file.finish())
                .map_err(|e| CliError::error(format!("writing {}: {e}", tmp.display())))?;
            Ok((text.len() as u64, file.into_file()))
        })
        .await?;
        index = Some(INDEX_FILE.to_string());
    }
    sync_dir(&args.out);
    Ok(ExportReport {
        run: original.run.clone(),
        step: original.step,
        out: args.out.display().to_string(),
        bytes_written: files.iter().map(|f| f.bytes).sum(),
        tensors: sizes.len(),
        files,
        index,
        tensor_bytes,
        dtype: args.dtype.map(|d| d.dtype().to_string()),
        seconds: t0.elapsed().as_secs_f64(),
    })
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Write `path` through `.NAME.partial` beside it, created afresh without following links
/// ([`Replacing`]; `O_DIRECT` when `direct` and the file system allows it): `write` fills the
/// temporary file and hands it back, it is then synced and renamed; on failure it is removed
/// and `path` is untouched.
async fn write_atomically<F, Fut>(path: &Path, direct: bool, write: F) -> Result<u64>
where
    F: FnOnce(OutFile, PathBuf) -> Fut,
    Fut: std::future::Future<Output = Result<(u64, std::fs::File)>>,
{
    let (replacing, file) = OutFile::create(path, direct)
        .map_err(|e| CliError::error(format!("creating a file for {}: {e}", path.display())))?;
    let tmp = replacing.temp_path().to_path_buf();
    // On an error the temporary file is removed when `replacing` drops.
    let (n, f) = write(file, tmp).await?;
    replacing
        .commit(f)
        .map_err(|e| CliError::error(format!("finishing {}: {e}", path.display())))?;
    Ok(n)
}

/// Stream a view into `path`. Up to `PIPELINE` blocks are read at once, and reading goes on
/// while the writer thread writes; buffers go back to a pool after writing, so a 100 GB
/// export allocates (and page-faults) a few blocks, not 100 GB.
async fn write_view(
    reader: &StepReader,
    original: &CommitRecord,
    view: &SafetensorsView,
    converting: bool,
    file: OutFile,
    path: PathBuf,
    pb: &ProgressBar,
) -> Result<(u64, std::fs::File)> {
    let pool: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    // A permit per block outstanding (being read, or queued for the writer): bounds memory.
    let permits = Arc::new(tokio::sync::Semaphore::new(PIPELINE));
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

    let mut jobs = plan_blocks(view, original, converting)
        .into_iter()
        .peekable();
    let mut reads = FuturesOrdered::new();
    let mut sent = 0u64;
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
                let block = match res {
                    Ok(b) => b,
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                };
                let len = block.len() as u64;
                if tx.send((block, permit)).is_err() {
                    break; // the writer failed; its error is reported below
                }
                sent += len;
                pb.inc(len);
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
    Ok((written, out))
}

/// Bytes staged per `O_DIRECT` write.
const STAGE: usize = 16 << 20;
const ALIGN: usize = 4096;

/// The file an export writes: through `O_DIRECT` with an aligned staging buffer where the
/// file system allows it (buffered writes of gigabytes spend most of their time growing and
/// flushing the page cache), buffered otherwise (tmpfs).
struct OutFile {
    f: std::fs::File,
    stage: Option<AlignedBuf>,
    fill: usize,
    at: u64,
}

impl OutFile {
    /// Start replacing `path` ([`Replacing`]): the temporary file, with `O_DIRECT` if `direct`
    /// and the file system takes it.
    fn create(path: &Path, direct: bool) -> std::io::Result<(Replacing, Self)> {
        let buffered = |(r, f)| {
            (
                r,
                OutFile {
                    f,
                    stage: None,
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
                    stage: Some(AlignedBuf::zeroed(STAGE)),
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
        while !data.is_empty() {
            let take = (STAGE - self.fill).min(data.len());
            stage.full_mut()[self.fill..self.fill + take].copy_from_slice(&data[..take]);
            self.fill += take;
            data = &data[take..];
            if self.fill == STAGE {
                self.f.write_all_at(&stage.full_mut()[..STAGE], self.at)?;
                self.at += STAGE as u64;
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

fn plan_blocks(view: &SafetensorsView, original: &CommitRecord, converting: bool) -> Vec<Block> {
    if !converting {
        return (0..view.len().div_ceil(BLOCK))
            .map(|i| Block::Raw {
                start: i * BLOCK,
                end: ((i + 1) * BLOCK).min(view.len()),
            })
            .collect();
    }
    let mut out = vec![Block::Header];
    for e in view.entries() {
        let from = original.tensor(&e.name).map_or(e.dtype, |t| t.dtype);
        let n = e.len / e.dtype.size() as u64;
        let per = (BLOCK / from.size().max(e.dtype.size()) as u64).max(1);
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
) -> Result<Vec<u8>> {
    match job {
        Block::Raw { start, end } => {
            buf.resize((end - start) as usize, 0);
            let (n, _) = view.read_at(reader, start, &mut buf).await?;
            buf.truncate(n);
            Ok(buf)
        }
        Block::Header => Ok(view.header().to_vec()),
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
            let mut at = 0usize;
            for bx in flat_range_boxes(&shape, lo, hi) {
                let len = (bx.numel() * elem) as usize;
                reader.read_into(&name, &bx, &mut src[at..at + len]).await?;
                at += len;
            }
            if from == to {
                return Ok(src);
            }
            tokio::task::spawn_blocking(move || convert(from, to, &src))
                .await
                .map_err(|e| CliError::from(ckpt_store::Error::from(e)))
        }
    }
}

impl Report for ExportReport {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
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
    fn shards_fill_greedily_and_big_tensors_stand_alone() {
        let s = |v: &[(&str, u64)]| -> Vec<(String, u64)> {
            v.iter().map(|(n, l)| (n.to_string(), *l)).collect()
        };
        let sizes = s(&[("a", 40), ("b", 40), ("c", 30), ("d", 200), ("e", 10)]);
        assert_eq!(
            shard_names(&sizes, Some(100)),
            vec![vec!["a", "b"], vec!["c"], vec!["d"], vec!["e"]]
        );
        assert_eq!(shard_names(&sizes, None).len(), 1);
        assert_eq!(shard_names(&sizes, Some(1000)).len(), 1);
    }
}
