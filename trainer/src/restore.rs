//! Restore onto this rank's boxes under the current layout, whatever layout saved them.
//!
//! Each target box is read through the store's read engine (only the chunks that intersect
//! it, every chunk hash-checked), in pieces of bounded size, and written into its sink.

use std::sync::Arc;

use parking_lot::Mutex;

use ckpt_store::placement::flat_range_boxes;
use ckpt_store::{
    ChunkId, CopyOp, DType, Error, ErrorKind, FetchedBytes, NdBox, PlannedChunk, ReadStats, Result,
    StepReader,
};
use futures::{StreamExt, TryStreamExt, stream};

use crate::memory::MemorySink;

/// A box to restore and the memory it goes to.
#[derive(Clone)]
pub struct RestoreTarget {
    /// Tensor name.
    pub name: String,
    /// Element type the caller expects.
    pub dtype: DType,
    /// Global shape the caller expects.
    pub shape: Vec<u64>,
    /// The box.
    pub bbox: NdBox,
    /// Where its bytes go.
    pub sink: Arc<dyn MemorySink>,
}

impl std::fmt::Debug for RestoreTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RestoreTarget({} {})", self.name, self.bbox)
    }
}

/// Check `targets` against the step before reading anything; errors name the tensor.
pub fn check_targets(reader: &StepReader, targets: &[RestoreTarget]) -> Result<()> {
    let c = reader.commit();
    for t in targets {
        let e = c.tensor(&t.name).ok_or_else(|| {
            // A reader opened for some tensors of a split record knows only those.
            let has = match c.index {
                None => format!("it has {} tensors; ", c.tensors.len()),
                Some(_) => String::new(),
            };
            Error::not_found(format!(
                "step {} of run {} has no tensor {:?} ({has}was the model changed?)",
                c.step, c.run, t.name,
            ))
        })?;
        if e.dtype != t.dtype || e.shape != t.shape {
            return Err(Error::invalid(format!(
                "tensor {:?}: saved as {} {:?} at step {} of run {}, but this job expects {} {:?}",
                t.name, e.dtype, e.shape, c.step, c.run, t.dtype, t.shape
            )));
        }
        if !t.bbox.within(&t.shape) {
            return Err(Error::invalid(format!(
                "tensor {:?}: box {} does not fit the shape {:?}",
                t.name, t.bbox, t.shape
            )));
        }
        let want = t.bbox.numel() as usize * t.dtype.size();
        if t.sink.len() != want {
            return Err(Error::invalid(format!(
                "tensor {:?} box {}: the destination holds {} bytes, the box {want}",
                t.name,
                t.bbox,
                t.sink.len()
            )));
        }
    }
    Ok(())
}

/// Restore every target, at most about `budget` bytes in flight.
///
/// A target whose chunks each land in one contiguous range of its memory (a restore onto the
/// saved layout, a split along the first dimension, a ZeRO partition: nearly every restore), or
/// in a few long ranges (a chunk stored once for several places that hold the same bytes: the
/// zeros of a frozen layer's optimizer moments), or whose sink is plain host memory
/// ([`MemorySink::short_writes_cheap`]) whatever its runs, is planned whole and each chunk,
/// fetched once, is written straight into the sink as it is hash-checked: one copy of each
/// byte. A target whose chunks scatter into many short runs (a split along another dimension,
/// so a chunk holds part of every row) in a sink that pays per write (a device) is read in
/// pieces gathered in a buffer first, so the sink is written in few large writes.
pub async fn restore_targets(
    reader: &StepReader,
    targets: &[RestoreTarget],
    budget: usize,
) -> Result<ReadStats> {
    check_targets(reader, targets)?;
    let mut direct: Vec<(usize, PlannedChunk)> = Vec::new();
    let mut gathered: Vec<usize> = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        let plan = reader.plan(&t.name, &t.bbox).await?;
        let direct_ok = plan.chunks.iter().all(|c| written_direct(&c.copies))
            || (t.sink.short_writes_cheap() && runs_long_enough(&plan.chunks));
        if direct_ok {
            direct.extend(plan.chunks.into_iter().map(|c| (i, c)));
        } else {
            gathered.push(i);
        }
    }
    let mut total = restore_direct(reader, targets, direct, budget).await?;
    if !gathered.is_empty() {
        let picked: Vec<RestoreTarget> = gathered.iter().map(|&i| targets[i].clone()).collect();
        total.add(&restore_pieces(reader, &picked, budget).await?);
    }
    let want: u64 = targets.iter().map(|t| t.sink.len() as u64).sum();
    if total.bytes_copied != want {
        return Err(Error::internal(format!(
            "step {} of run {}: the restore wrote {} bytes into sinks of {want}",
            reader.commit().step,
            reader.commit().run,
            total.bytes_copied
        )));
    }
    Ok(total)
}

/// `copies` merged into runs each contiguous in the chunk and in the destination, in order.
fn runs(copies: &[CopyOp]) -> Vec<CopyOp> {
    let mut out: Vec<CopyOp> = Vec::new();
    for c in copies {
        match out.last_mut() {
            Some(r) if r.src + r.len == c.src && r.dst + r.len == c.dst => r.len += c.len,
            _ => out.push(*c),
        }
    }
    out
}

/// A run this long or longer is worth a write into the sink of its own.
const DIRECT_RUN: u64 = 1 << 20;

/// A target in host memory is written straight from its chunks when its runs average at least
/// this many bytes. Its plan (24 bytes a run) is held whole until its chunks are read, so this
/// keeps the plan under a tenth of the bytes it restores; a box of shorter runs (a few elements
/// wide) is gathered in pieces, each planned when it is read.
const SCATTER_RUN_MIN: u64 = 256;

/// Whether the runs of `chunks` average [`SCATTER_RUN_MIN`] bytes or more.
fn runs_long_enough(chunks: &[PlannedChunk]) -> bool {
    let (n, bytes) = chunks
        .iter()
        .flat_map(|c| &c.copies)
        .fold((0u64, 0u64), |(n, b), c| (n + 1, b + c.len));
    bytes >= n * SCATTER_RUN_MIN
}

/// Whether a chunk with `copies` is written straight into its sink: it lands in one run of
/// the destination, or in runs each at least [`DIRECT_RUN`] long (a chunk that several places
/// share). A chunk cut into many short runs (a box cut from a wider shard: a piece of every
/// row) is gathered first, so the sink gets few large writes.
fn written_direct(copies: &[CopyOp]) -> bool {
    let r = runs(copies);
    r.len() == 1 || r.iter().all(|r| r.len >= DIRECT_RUN)
}

/// The chunks of targets planned whole, each written straight into its sink as it arrives:
/// `budget` bounds the chunks in flight (and a chunk's bytes are dropped once written, so the
/// read buffers go back to their pool warm).
async fn restore_direct(
    reader: &StepReader,
    targets: &[RestoreTarget],
    work: Vec<(usize, PlannedChunk)>,
    budget: usize,
) -> Result<ReadStats> {
    let chunk = reader.store().config().chunk_size.max(1);
    // Enough chunks in flight to keep the disk's queue full (8 reach its O_DIRECT limit here;
    // twice the store's read concurrency leaves room for the hashing between reads), within
    // the budget: each chunk holds its share of it, what it may need, from its fetch until
    // it is written.
    let inflight = (budget / chunk).clamp(1, 2 * reader.store().config().read_concurrency);
    let budget_kib = (budget >> 10).clamp(1, u32::MAX as usize);
    let held = &tokio::sync::Semaphore::new(budget_kib);
    stream::iter(work)
        .map(|(i, pc)| async move {
            let need = (pc.chunk.read_bytes_bound() >> 10).clamp(1, budget_kib) as u32;
            let _share = held
                .acquire_many(need)
                .await
                .map_err(|_| Error::internal("the restore's budget closed"))?;
            let t = &targets[i];
            // The chunk source's copy (a peer's memory), or a chunk stored raw with nothing in
            // front of the store, arrives unchecked and is hashed as it is copied; a chunk
            // stored encoded is decoded where it goes and checked by the decode; anything
            // else arrives checked.
            let f = reader.fetch_for_copy(&pc, &t.name).await?;
            let (checked, from_source, mut st) = (f.checked, f.from_source, f.stats);
            let encoded = matches!(f.bytes, FetchedBytes::Encoded(_));
            let sink = t.sink.clone();
            let ((wrote, got), pc) = tokio::task::spawn_blocking(move || {
                (write_fetched(&*sink, &pc, f.bytes, checked), pc)
            })
            .await?;
            // Damaged here: what was copied does not hash to the chunk's id, or the encoded
            // chunk did not decode to it.
            let checked = match (wrote, got) {
                (Ok(n), None) => Ok(n),
                (Ok(n), Some(got)) => reader.check_fetched(&pc, &t.name, got).map(|()| n),
                (Err(e), _) if encoded && e.kind() == ErrorKind::Corrupt => {
                    Err(reader.chunk_error(&pc, &t.name, e))
                }
                (Err(e), _) => return Err(e),
            };
            let copied = match checked {
                Ok(n) => n,
                Err(e) => {
                    // The source's copy: the store's checked bytes overwrite what the sink
                    // got. The store's: the reader's fallback store (a local tier's remote)
                    // holds the same chunk.
                    let again = if from_source {
                        st.source_bytes = 0;
                        let (b, fst) = reader.fetch_planned_stored(&pc, &t.name).await?;
                        Some((b, fst))
                    } else {
                        reader.fetch_fallback(&pc, &t.name).await?
                    };
                    let Some((b, fst)) = again else {
                        return Err(e);
                    };
                    st.stored_bytes += fst.stored_bytes;
                    st.node_bytes += fst.node_bytes;
                    let sink = t.sink.clone();
                    let (again, _) =
                        tokio::task::spawn_blocking(move || write_chunk(&*sink, &pc, &b, true))
                            .await?;
                    st.fallback_bytes += fst.fallback_bytes;
                    st.fallback_chunks += fst.fallback_chunks;
                    again?
                }
            };
            st.bytes_copied += copied;
            Ok::<_, Error>(st)
        })
        .buffer_unordered(inflight)
        .try_fold(ReadStats::default(), |mut acc, st| async move {
            acc.add(&st);
            Ok(acc)
        })
        .await
}

/// Write a fetched chunk into `sink`: raw bytes as [`write_chunk`] does; a chunk stored
/// encoded decoded straight into the sink's memory when its one run is the whole chunk and
/// the sink is host memory (each byte written once and hashed as it is written; the chunk is
/// checked by the decode), else decoded into a buffer of its own, checked, and written.
/// (Bytes written, the hash still to check.)
fn write_fetched(
    sink: &dyn MemorySink,
    pc: &PlannedChunk,
    bytes: FetchedBytes,
    checked: bool,
) -> (Result<u64>, Option<ChunkId>) {
    let stored = match bytes {
        FetchedBytes::Plain(b) => return write_chunk(sink, pc, &b, checked),
        FetchedBytes::Encoded(s) => s,
    };
    if let [r] = runs(&pc.copies).as_slice()
        && r.src == 0
        && r.len as usize == stored.len()
        && let Some(wrote) = sink.with_memory(r.dst as usize, r.len as usize, &mut |out| {
            stored.decode_into(out)
        })
    {
        return (wrote.map(|()| r.len), None);
    }
    match stored.decode() {
        Ok(b) => write_chunk(sink, pc, &b, true),
        Err(e) => (Err(e), None),
    }
}

/// Bytes of a chunk copied and hashed a block at a time: the hash reads each block while the
/// copy left it in the core's cache.
const HASH_BLOCK: usize = 256 << 10;

/// Write the runs `pc` plans out of `bytes` (the whole chunk) into `sink`; when the bytes are
/// not `checked` yet, hash the whole chunk on the way and return the hash for the caller to
/// check. (Bytes written, the hash.) The hash is fused with the copy where the sink is host
/// memory: with the copy of the one run (each block hashed from the core's cache right after
/// the copy wrote it), or, for many runs into a sink whose short writes are cheap (a box cut
/// across the saved rows), each block of the chunk hashed and then its runs copied out of the
/// cache. The sink holds the bytes before they are checked: a refused chunk fails the
/// restore, whose caller then uses nothing of it.
fn write_chunk(
    sink: &dyn MemorySink,
    pc: &PlannedChunk,
    bytes: &[u8],
    checked: bool,
) -> (Result<u64>, Option<ChunkId>) {
    let runs = runs(&pc.copies);
    if runs.iter().any(|r| bytes.len() < (r.src + r.len) as usize) {
        let e = Error::internal(format!(
            "a planned run past the end of chunk {}",
            pc.chunk.id
        ));
        return (Err(e), None);
    }
    let (first, rest) = runs.split_first().expect("a planned chunk has a copy");
    let written: u64 = runs.iter().map(|r| r.len).sum();
    // The runs after the first: plain writes of bytes already in memory.
    let write_rest = || -> Result<()> {
        for r in rest {
            sink.write_at(
                r.dst as usize,
                &bytes[r.src as usize..(r.src + r.len) as usize],
            )?;
        }
        Ok(())
    };
    let (src, len, dst) = (first.src as usize, first.len as usize, first.dst as usize);
    if !rest.is_empty() && sink.short_writes_cheap() {
        if checked {
            let writes: Vec<(usize, &[u8])> = runs
                .iter()
                .map(|r| {
                    (
                        r.dst as usize,
                        &bytes[r.src as usize..(r.src + r.len) as usize],
                    )
                })
                .collect();
            return (sink.write_many(&writes).map(|()| written), None);
        }
        let (wrote, got) = hash_then_scatter(sink, &runs, bytes);
        return (wrote.map(|()| written), Some(got));
    }
    if checked {
        let wrote = sink
            .write_at(dst, &bytes[src..src + len])
            .and_then(|()| write_rest());
        return (wrote.map(|()| written), None);
    }
    let mut hasher = blake3::Hasher::new();
    let fused = sink.with_memory(dst, len, &mut |out| {
        // The chunk's bytes before the run, the run (copied, then hashed from the cache), and
        // the bytes after it.
        hasher.update(&bytes[..src]);
        for (o, i) in out
            .chunks_mut(HASH_BLOCK)
            .zip(bytes[src..src + len].chunks(HASH_BLOCK))
        {
            o.copy_from_slice(i);
            hasher.update(o);
        }
        hasher.update(&bytes[src + len..]);
        Ok(())
    });
    let wrote = match fused {
        Some(r) => r,
        None => {
            hasher.update(bytes);
            sink.write_at(dst, &bytes[src..src + len])
        }
    };
    let got = ChunkId(ckpt_store::Hash(*hasher.finalize().as_bytes()));
    (
        wrote.and_then(|()| write_rest()).map(|()| written),
        Some(got),
    )
}

/// Hash `bytes` (a whole chunk) a block at a time and, right after each block, write the parts
/// of `runs` that lie in it into `sink` (one [`MemorySink::write_many`] a block) while the
/// block is in the core's cache: one pass over the chunk for both, whatever order the runs
/// come in. The hash of the whole chunk.
fn hash_then_scatter(
    sink: &dyn MemorySink,
    runs: &[CopyOp],
    bytes: &[u8],
) -> (Result<()>, ChunkId) {
    // Sorted by where they start in the chunk, a block's runs are found from where the last
    // block's left off: the cost is the runs and the blocks, not their product.
    let mut order: Vec<&CopyOp> = runs.iter().collect();
    order.sort_unstable_by_key(|r| r.src);
    let mut hasher = blake3::Hasher::new();
    let mut wrote = Ok(());
    let mut first = 0usize;
    let mut writes: Vec<(usize, &[u8])> = Vec::new();
    for (i, block) in bytes.chunks(HASH_BLOCK).enumerate() {
        hasher.update(block);
        if wrote.is_err() {
            continue;
        }
        let (b0, b1) = (i * HASH_BLOCK, i * HASH_BLOCK + block.len());
        // Runs that ended before this block are done for good.
        while first < order.len() && (order[first].src + order[first].len) as usize <= b0 {
            first += 1;
        }
        writes.clear();
        for r in &order[first..] {
            let (s, e) = (r.src as usize, (r.src + r.len) as usize);
            if s >= b1 {
                break;
            }
            let (a, b) = (s.max(b0), e.min(b1));
            if a < b {
                writes.push((r.dst as usize + (a - s), &bytes[a..b]));
            }
        }
        if !writes.is_empty() {
            wrote = sink.write_many(&writes);
        }
    }
    (
        wrote,
        ChunkId(ckpt_store::Hash(*hasher.finalize().as_bytes())),
    )
}

/// Restore `targets` in pieces of bounded size, each gathered in a reused buffer and written
/// into its sink with one write.
async fn restore_pieces(
    reader: &StepReader,
    targets: &[RestoreTarget],
    budget: usize,
) -> Result<ReadStats> {
    // Pieces in flight: enough to keep the disk's queue full when most tensors are smaller
    // than a piece (4 left a restore at 1.4-1.9x the read limit); memory stays `budget`.
    let parallel = 16usize;
    let piece_bytes = (budget / parallel).max(1 << 16);
    // (target, first element, end element) pieces.
    let mut pieces: Vec<(usize, u64, u64)> = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        let n = t.bbox.numel();
        let per = (piece_bytes / t.dtype.size()).max(1) as u64;
        let mut a = 0;
        while a < n {
            let b = (a + per).min(n);
            pieces.push((i, a, b));
            a = b;
        }
    }
    // Piece buffers are reused: memory touched for the first time fills several times slower
    // than memory reused, and a restore moves the whole state through these buffers. Each
    // piece overwrites all of its buffer (checked below), so stale bytes never leak.
    let bufs: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());
    let bufs = &bufs;
    let results: Vec<ReadStats> = stream::iter(pieces)
        .map(|(i, a, b)| async move {
            let t = &targets[i];
            let elem = t.dtype.size() as u64;
            let want = ((b - a) * elem) as usize;
            let mut buf = bufs.lock().pop().unwrap_or_default();
            buf.resize(want, 0);
            let mut at = 0usize;
            let mut stats = ReadStats::default();
            for bx in flat_range_boxes(&t.bbox.lengths, a, b) {
                let global = NdBox {
                    offsets: bx
                        .offsets
                        .iter()
                        .zip(&t.bbox.offsets)
                        .map(|(o, base)| o + base)
                        .collect(),
                    lengths: bx.lengths,
                };
                let len = (global.numel() * elem) as usize;
                let st = reader
                    .read_into(&t.name, &global, &mut buf[at..at + len])
                    .await?;
                stats.add(&st);
                at += len;
            }
            if stats.bytes_copied != want as u64 {
                return Err(Error::internal(format!(
                    "tensor {:?}: a piece of {want} bytes received {} bytes",
                    t.name, stats.bytes_copied
                )));
            }
            let sink = t.sink.clone();
            let off = (a * elem) as usize;
            let (res, buf) = tokio::task::spawn_blocking(move || {
                let r = sink.write_at(off, &buf);
                (r, buf)
            })
            .await?;
            res?;
            bufs.lock().push(buf);
            Ok::<_, Error>(stats)
        })
        .buffer_unordered(parallel)
        .try_collect()
        .await?;
    let mut total = ReadStats::default();
    for s in &results {
        total.add(s);
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostTensor;

    /// Runs in any order, across block boundaries, shorter than a block and reading the same
    /// bytes as another, land where they are planned, the bytes between them are left alone,
    /// and the hash is the whole chunk's.
    #[test]
    fn many_runs_are_written_as_each_block_is_hashed() {
        let chunk: Vec<u8> = (0..3 * HASH_BLOCK + 1000)
            .map(|i| (i % 253) as u8)
            .collect();
        let runs = [
            CopyOp {
                src: (2 * HASH_BLOCK - 10) as u64,
                dst: 0,
                len: 30,
            },
            CopyOp {
                src: 5,
                dst: 100,
                len: 4096,
            },
            CopyOp {
                src: (3 * HASH_BLOCK) as u64,
                dst: 5000,
                len: 1000,
            },
            CopyOp {
                src: 70_000,
                dst: 7000,
                len: (HASH_BLOCK + 123) as u64,
            },
            CopyOp {
                src: 10,
                dst: 4200,
                len: 500,
            },
        ];
        let len = 7000 + HASH_BLOCK + 123;
        let sink = HostTensor::from_vec(vec![0xAB; len]);
        let (wrote, got) = hash_then_scatter(&sink, &runs, &chunk);
        wrote.unwrap();
        assert_eq!(got.0.0, *blake3::hash(&chunk).as_bytes());
        let mut want = vec![0xABu8; len];
        for r in &runs {
            let (s, d, n) = (r.src as usize, r.dst as usize, r.len as usize);
            want[d..d + n].copy_from_slice(&chunk[s..s + n]);
        }
        assert!(
            *sink.read() == want,
            "the runs, and nothing else, were written"
        );
    }

    /// A sink that fails its second write of many runs.
    struct FailsSecond(HostTensor, std::sync::atomic::AtomicUsize);

    impl MemorySink for FailsSecond {
        fn len(&self) -> usize {
            MemorySink::len(&self.0)
        }
        fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
            self.0.write_at(offset, src)
        }
        fn write_many(&self, writes: &[(usize, &[u8])]) -> Result<()> {
            if self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1 {
                return Err(Error::internal("the device went away"));
            }
            self.0.write_many(writes)
        }
        fn short_writes_cheap(&self) -> bool {
            true
        }
    }

    /// A write that fails part-way is the result, and the hash still covers the whole chunk
    /// (so a caller that checks it first sees the damage, not the write).
    #[test]
    fn a_write_failing_part_way_is_the_error_and_the_hash_is_whole() {
        let chunk: Vec<u8> = (0..3 * HASH_BLOCK).map(|i| (i % 251) as u8).collect();
        let runs: Vec<CopyOp> = (0..3)
            .map(|b| CopyOp {
                src: (b * HASH_BLOCK) as u64,
                dst: (b * 64) as u64,
                len: 64,
            })
            .collect();
        let sink = FailsSecond(
            HostTensor::from_vec(vec![0; 3 * 64]),
            std::sync::atomic::AtomicUsize::new(0),
        );
        let (wrote, got) = hash_then_scatter(&sink, &runs, &chunk);
        assert!(wrote.unwrap_err().to_string().contains("went away"));
        assert_eq!(got.0.0, *blake3::hash(&chunk).as_bytes());
        assert_eq!(
            sink.1.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "no write after the failed one"
        );
    }
}
