//! The snapshot: copying pinned sources into staging slabs with several threads, in batches
//! that never take more slabs than the pool holds, and handing each chunk on in order.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ckpt_store::{Error, Result};

use crate::memory::PinnedSource;
use crate::staging::StagingPool;

struct Job {
    tensor: usize,
    offset: usize,
    len: usize,
}

/// A shard's pinned source and the byte spans of it to copy (the whole box, or the sampled
/// chunks of a replica the sentinel hashes), by its index among the save's shards.
pub(super) type Pin = (usize, Box<dyn PinnedSource>, Vec<(usize, usize)>);

/// Copy the spans of every pinned source into slabs with `threads` threads, sending chunks in
/// order (each span cut into slab-sized chunks from its start).
/// Small shards share slabs (each chunk is a slice of a slab), so a thousand biases do not
/// take a thousand slabs. Releases each pin as soon as its tensor is copied. On error returns
/// the tensor index.
///
/// Each batch takes its slabs all at once ([`StagingPool::acquire_many`]); `start_persist`
/// runs before the first wait for staging space and when the copy is done.
pub(super) fn snapshot(
    pool: &Arc<StagingPool>,
    pins: Vec<Pin>,
    threads: usize,
    stall: Duration,
    mut start_persist: impl FnMut(),
    tx: &tokio::sync::mpsc::UnboundedSender<Result<Bytes>>,
) -> std::result::Result<(), (usize, Error)> {
    let slab = pool.slab_size();
    let spans: Vec<Vec<(usize, usize)>> = pins.iter().map(|(_, _, s)| s.clone()).collect();
    let jobs = jobs_of(&spans, slab);
    let mut remaining: Vec<usize> = vec![0; pins.len()];
    for j in &jobs {
        remaining[j.tensor] += 1;
    }
    let mut pins: Vec<Option<(usize, Box<dyn PinnedSource>)>> =
        pins.into_iter().map(|(i, p, _)| Some((i, p))).collect();
    // Zero-length tensors have nothing to copy: release their pins at once.
    for (k, r) in remaining.iter().enumerate() {
        if *r == 0
            && let Some((i, p)) = pins[k].take()
        {
            p.complete().map_err(|e| (i, e))?;
        }
    }
    // Batches of whole slabs, never more than the pool holds, so a batch can always start
    // once earlier batches are persisted.
    let cap_slabs = (pool.stats().capacity / slab).max(1);
    let per_batch = (threads * 4).clamp(1, cap_slabs);
    let lens: Vec<usize> = jobs.iter().map(|j| j.len).collect();
    for b in carve(&lens, slab, per_batch) {
        let group = &jobs[b.jobs.clone()];
        let places = &b.place;
        let first = pins[group[0].tensor].as_ref().map_or(0, |(i, _)| *i);
        let mut slabs = pool
            .acquire_many(b.fills.len(), stall, &mut start_persist)
            .map_err(|e| (first, e))?;
        let dsts = destinations(group, places, &mut slabs);
        copy_all(group.iter().zip(dsts).collect(), &pins, threads)?;
        // Device copies complete asynchronously: wait for this batch before handing it on.
        let mut touched: Vec<usize> = group.iter().map(|j| j.tensor).collect();
        touched.dedup();
        for &k in &touched {
            if let Some((i, p)) = pins[k].as_ref() {
                p.fence().map_err(|e| (*i, e))?;
            }
        }
        let frozen: Vec<Bytes> = slabs
            .into_iter()
            .zip(&b.fills)
            .map(|(s, &f)| s.freeze(f))
            .collect();
        for (j, (si, at)) in group.iter().zip(places) {
            let chunk = frozen[*si].slice(*at..at + j.len);
            if tx.send(Ok(chunk)).is_err() {
                // The persist ended (it failed and reported why); stop copying.
                return Ok(());
            }
            remaining[j.tensor] -= 1;
            if remaining[j.tensor] == 0
                && let Some((i, p)) = pins[j.tensor].take()
            {
                p.complete().map_err(|e| (i, e))?;
            }
        }
    }
    Ok(())
}

/// The bytes `pins` copy, and of those the bytes copied by DMA (out of device memory).
pub(super) fn dma_share(pins: &[Pin]) -> (u64, u64) {
    pins.iter().fold((0, 0), |(dma, all), (_, p, spans)| {
        let n: u64 = spans.iter().map(|&(_, l)| l as u64).sum();
        (if p.copies_by_dma() { dma + n } else { dma }, all + n)
    })
}

/// The copy jobs of tensors' byte `spans` (offset, length): slab-sized pieces of each span
/// from its start, in order.
fn jobs_of(spans: &[Vec<(usize, usize)>], slab: usize) -> Vec<Job> {
    let mut jobs: Vec<Job> = Vec::new();
    for (k, spans) in spans.iter().enumerate() {
        for &(start, len) in spans {
            let mut off = 0;
            while off < len {
                let l = slab.min(len - off);
                jobs.push(Job {
                    tensor: k,
                    offset: start + off,
                    len: l,
                });
                off += l;
            }
        }
    }
    jobs
}

/// Disjoint destination slices of `slabs`, one per job of `group` at its place (slab, byte),
/// cut in slab order within each slab.
fn destinations<'a>(
    group: &[Job],
    places: &[(usize, usize)],
    slabs: &'a mut [crate::staging::Slab],
) -> Vec<&'a mut [u8]> {
    let mut order: Vec<usize> = (0..group.len()).collect();
    order.sort_by_key(|&k| places[k]);
    let mut dsts: Vec<Option<&mut [u8]>> = (0..group.len()).map(|_| None).collect();
    let mut rest: Vec<&mut [u8]> = slabs.iter_mut().map(|s| s.bytes_mut()).collect();
    let mut cut: Vec<usize> = vec![0; rest.len()];
    for k in order {
        let (si, at) = places[k];
        let len = group[k].len;
        let buf = std::mem::take(&mut rest[si]);
        let (_, tail) = buf.split_at_mut(at - cut[si]);
        let (dst, tail) = tail.split_at_mut(len);
        rest[si] = tail;
        cut[si] = at + len;
        dsts[k] = Some(dst);
    }
    dsts.into_iter()
        .map(|d| d.expect("every job has a destination"))
        .collect()
}

/// Copy each job's bytes of its pinned source into its destination with up to `threads`
/// threads. The threads take jobs one at a time (not a fixed share each): a thread the
/// scheduler set aside (other ranks' copies, the persist of another save) does not leave its
/// share for the others to wait on at the batch's end. On error, the tensor index.
fn copy_all(
    work: Vec<(&Job, &mut [u8])>,
    pins: &[Option<(usize, Box<dyn PinnedSource>)>],
    threads: usize,
) -> std::result::Result<(), (usize, Error)> {
    let work: Vec<Slot<'_>> = work
        .into_iter()
        .map(|w| parking_lot::Mutex::new(Some(w)))
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let res: Vec<std::result::Result<(), (usize, Error)>> = std::thread::scope(|s| {
        let (work, next) = (&work, &next);
        let handles: Vec<_> = (0..threads.min(work.len()).max(1))
            .map(|_| {
                s.spawn(move || {
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(slot) = work.get(k) else {
                            return Ok(());
                        };
                        let (j, dst) = slot.lock().take().expect("each job taken once");
                        let (i, p) = pins[j.tensor].as_ref().expect("pinned until copied");
                        p.copy_to(j.offset, dst).map_err(|e| (*i, e))?;
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err((0, Error::internal("a copy thread panicked"))))
            })
            .collect()
    });
    res.into_iter().collect()
}

/// A copy job and its destination, taken once by whichever copy thread gets to it first.
type Slot<'a> = parking_lot::Mutex<Option<(&'a Job, &'a mut [u8])>>;

/// One batch of a snapshot: consecutive jobs and the slabs they are copied into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Batch {
    /// The jobs (indices into the job list).
    pub jobs: std::ops::Range<usize>,
    /// Per job: (slab within the batch, byte offset in it).
    pub place: Vec<(usize, usize)>,
    /// Bytes used in each slab.
    pub fills: Vec<usize>,
}

/// Place jobs of `lens` bytes (each at most `slab`) into batches of at most `per_batch` slabs,
/// first fit within the batch, 64-byte aligned, so shards smaller than a slab share slabs and
/// little is wasted.
pub(crate) fn carve(lens: &[usize], slab: usize, per_batch: usize) -> Vec<Batch> {
    let mut out: Vec<Batch> = Vec::new();
    let mut cur = Batch {
        jobs: 0..0,
        place: Vec::new(),
        fills: Vec::new(),
    };
    for (j, &len) in lens.iter().enumerate() {
        let fit = cur
            .fills
            .iter()
            .position(|f| f.next_multiple_of(64) + len <= slab);
        let (si, at) = match fit {
            Some(si) => (si, cur.fills[si].next_multiple_of(64)),
            None if cur.fills.len() < per_batch => {
                cur.fills.push(0);
                (cur.fills.len() - 1, 0)
            }
            None => {
                let next = Batch {
                    jobs: j..j,
                    place: Vec::new(),
                    fills: vec![0],
                };
                out.push(std::mem::replace(&mut cur, next));
                (0, 0)
            }
        };
        cur.fills[si] = at + len;
        cur.place.push((si, at));
        cur.jobs.end = j + 1;
    }
    if !cur.place.is_empty() {
        out.push(cur);
    }
    out
}

/// Slabs a snapshot of shards of `lens` bytes needs at once (chunked by `slab`).
pub(crate) fn slabs_needed(lens: &[usize], slab: usize, per_batch: usize) -> usize {
    let mut jobs = Vec::new();
    for &len in lens {
        let mut off = 0;
        while off < len {
            jobs.push(slab.min(len - off));
            off += slab;
        }
    }
    carve(&jobs, slab, per_batch)
        .iter()
        .map(|b| b.fills.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carving_packs_small_jobs_and_keeps_batches_bounded() {
        // 1.5 MiB jobs: first fit puts two per 4 MiB slab, and a 1 MiB job fills a gap.
        let m = 1 << 20;
        let lens = [3 * m / 2, 3 * m / 2, 3 * m / 2, m, 4 * m, 100];
        let b = carve(&lens, 4 * m, 8);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].fills.len(), 3, "{:?}", b[0]);
        assert_eq!(
            b[0].place[3].0, 0,
            "the 1 MiB job goes into the first slab's gap"
        );
        // Batches never exceed their slab count, and jobs stay in order across batches.
        let many = vec![4 * m; 20];
        let bs = carve(&many, 4 * m, 8);
        assert_eq!(
            bs.iter().map(|b| b.fills.len()).collect::<Vec<_>>(),
            vec![8, 8, 4]
        );
        assert_eq!(bs[1].jobs, 8..16);
        // Every placement lies inside its slab and never overlaps another.
        for b in carve(&[m, 3 * m, 2 * m, 2 * m, 1, 4 * m - 64], 4 * m, 4) {
            let mut spans: Vec<(usize, usize, usize)> = b
                .place
                .iter()
                .zip(b.jobs.clone())
                .map(|(&(s, a), j)| (s, a, a + [m, 3 * m, 2 * m, 2 * m, 1, 4 * m - 64][j]))
                .collect();
            spans.sort();
            for w in spans.windows(2) {
                assert!(w[0].0 != w[1].0 || w[0].2 <= w[1].1, "{spans:?}");
            }
            assert!(spans.iter().all(|s| s.2 <= 4 * m));
        }
        assert_eq!(slabs_needed(&[10 * m], 4 * m, 8), 3);
    }
}
