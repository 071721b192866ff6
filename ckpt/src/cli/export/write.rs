//! Writing one file of an export: atomically (a fresh `.NAME.partial`, synced and renamed),
//! through `O_DIRECT` where the file system allows it, from a pipeline of blocks read within
//! the memory budget (each chunk read once: a range's boxes are planned together).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use ckpt_store::direct::AlignedBuf;
use ckpt_store::outfile::Replacing;
use ckpt_store::placement::flat_range_boxes;
use ckpt_store::{CommitRecord, DType, NdBox, ReadStats, SafetensorsView, StepReader};
use futures::StreamExt;
use futures::stream::FuturesOrdered;
use indicatif::ProgressBar;
use tokio::sync::OwnedSemaphorePermit;

use super::plan::Pipeline;
use crate::cli::shared::output;
use crate::cli::shared::values::convert;
use crate::cli::{CliError, Result};

/// Progress of the bytes written: the bar, and `progress N` lines on stdout for a parent.
pub(super) struct Progress {
    pub(super) bar: ProgressBar,
    pub(super) lines: bool,
}

impl Progress {
    fn inc(&self, n: u64) {
        self.bar.inc(n);
        if self.lines {
            // A parent that stopped reading is not this part's failure.
            let _ = output::line(format_args!("progress {n}"));
        }
    }
}

pub(super) fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Write `path` through `.NAME.partial` beside it, created afresh without following links
/// ([`Replacing`]; `O_DIRECT` with a staging buffer of `stage` bytes when `direct` and the file
/// system allows it): `write` fills the temporary file and hands it back, it is then synced
/// and renamed; on failure (or a crash) it is removed or left under the temporary name, and
/// `path` is untouched.
pub(super) async fn write_atomically<T, F, Fut>(
    path: &Path,
    direct: bool,
    stage: usize,
    write: F,
) -> Result<T>
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
pub(super) async fn write_view(
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
                pool.lock().push(block);
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
                let buf = pool.lock().pop().unwrap_or_default();
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
const ALIGN: usize = super::plan::ALIGN as usize;

/// The file an export writes: through `O_DIRECT` with an aligned staging buffer where the
/// file system allows it (buffered writes of gigabytes spend most of their time growing and
/// flushing the page cache), buffered otherwise (tmpfs).
pub(super) struct OutFile {
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
    pub(super) fn into_file(self) -> std::fs::File {
        self.f
    }

    pub(super) fn write(&mut self, mut data: &[u8]) -> std::io::Result<()> {
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
    pub(super) fn finish(&mut self) -> std::io::Result<u64> {
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
