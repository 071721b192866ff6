//! Memory sources and sinks: where a shard's bytes live while training.
//!
//! A snapshot **pins** every source when `save` is called: from then on the bytes the
//! checkpoint gets are the bytes at that moment. Host tensors enforce it with a lock (a writer,
//! the optimizer step, waits until that tensor has been copied, so tensors copied early can be
//! mutated early); device tensors (feature `cuda`) enqueue asynchronous copies whose
//! completion the pin reports, and the training loop waits for the snapshot before it mutates
//! them.
//!
//! A source may report a [`SourceVersion`]: which memory it is and how many writes that memory
//! has seen. A save skips the copy (and the hash) of a shard whose version is what it was at the
//! last committed save, and references that save's chunks instead. A [`HostTensor`] bumps its
//! version whenever it hands out mutable access ([`HostTensor::write`], a restore's
//! [`MemorySink::write_at`]), the only ways to change its bytes, so a changed tensor with an
//! unchanged version cannot happen through this API.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ckpt_store::{Error, NdBox, Result};
use parking_lot::RwLock;
use parking_lot::lock_api::ArcRwLockReadGuard;

/// Memory that holds one shard's row-major bytes and can be snapshotted.
pub trait MemorySource: Send + Sync {
    /// Byte length of the shard.
    fn len(&self) -> usize;

    /// Whether the shard is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pin the current contents for a snapshot (see the module docs). Called on the training
    /// thread inside `save`, so it must be quick.
    fn pin(&self) -> Result<Box<dyn PinnedSource>>;

    /// The version of the bytes (see the module docs), or `None` when the source does not
    /// track writes (every save copies it; the default). A source that reports a version
    /// promises: equal versions mean equal bytes. Read while pinned, it names the pinned
    /// bytes; read unpinned, the bytes of that moment.
    fn version(&self) -> Option<SourceVersion> {
        None
    }
}

/// Which memory a source is (`source`, unique in the process) and how many writes it has
/// seen (`writes`); see [`MemorySource::version`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SourceVersion {
    /// The memory: unique among the sources of this process.
    pub source: u64,
    /// Writes so far: bumped before every change of the bytes.
    pub writes: u64,
}

/// A fresh source identity.
fn next_source_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A source pinned for one snapshot. Several threads may copy different ranges at once.
pub trait PinnedSource: Send + Sync {
    /// Copy (or enqueue a copy of) bytes `offset .. offset + dst.len()` into `dst`, which stays
    /// valid until [`PinnedSource::fence`] returns.
    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Wait until every copy enqueued so far has landed (device copies are asynchronous;
    /// host copies are done when `copy_to` returns).
    fn fence(&self) -> Result<()> {
        Ok(())
    }

    /// Release the pin (after the last copy landed).
    fn complete(self: Box<Self>) -> Result<()>;

    /// Whether copies out of this source are DMA (device memory): the cores only enqueue and
    /// wait, so a persist hashing beside the copy does not slow it
    /// ([`SnapshotOverlap::Auto`](crate::SnapshotOverlap::Auto)). Host memory: `false`.
    fn copies_by_dma(&self) -> bool {
        false
    }
}

/// Memory a restore writes a shard's bytes into.
pub trait MemorySink: Send + Sync {
    /// Byte length of the shard.
    fn len(&self) -> usize;

    /// Whether the shard is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Write `src` at `offset`.
    fn write_at(&self, offset: usize, src: &[u8]) -> Result<()>;

    /// Write each `(offset, src)` of `writes`: a restore's runs of one block of a chunk, or of
    /// a whole checked chunk. The default writes them one by one; a sink behind a lock
    /// overrides it to take the lock once.
    fn write_many(&self, writes: &[(usize, &[u8])]) -> Result<()> {
        writes
            .iter()
            .try_for_each(|&(at, src)| self.write_at(at, src))
    }

    /// Hand `fill` the sink's own bytes `offset .. offset + len` to write in place, where the
    /// sink is plain host memory: a restore then hashes each block of a chunk right after
    /// copying it (one pass over memory, not two). `None`: the sink has no such memory (a
    /// device, or a box scattered over a larger one); the caller writes with `write_at`.
    fn with_memory(
        &self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Option<Result<()>> {
        let _ = (offset, len, fill);
        None
    }

    /// Whether a write costs about the bytes it copies however short it is (plain host memory
    /// with one bounds check a write). A restore then writes a chunk's many short runs (a box
    /// cut across the saved rows: a split along another dimension) straight into the sink, with
    /// no gather buffer. `false` (the default): a write has a fixed cost (a device's copy, a
    /// view that maps every write onto its runs), so short runs are gathered into long writes.
    fn short_writes_cheap(&self) -> bool {
        false
    }
}

/// A tensor shard in host memory, shareable between the training loop and the checkpointer.
///
/// The loop reads with [`HostTensor::read`] and mutates with [`HostTensor::write`]; a write
/// waits while a snapshot that pinned this tensor has not copied it yet. Clones share the
/// memory and its [`SourceVersion`]; every `write` (and every restore into it) bumps the version,
/// so a tensor the loop did not write since the last committed save is saved without a copy.
#[derive(Clone, Debug)]
pub struct HostTensor {
    data: Arc<RwLock<Vec<u8>>>,
    id: u64,
    writes: Arc<AtomicU64>,
}

impl HostTensor {
    /// A zeroed shard of `len` bytes.
    pub fn zeroed(len: usize) -> Self {
        Self::from_vec(vec![0u8; len])
    }

    /// A shard holding `bytes`.
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        HostTensor {
            data: Arc::new(RwLock::new(bytes)),
            id: next_source_id(),
            writes: Arc::default(),
        }
    }

    /// Read access.
    pub fn read(&self) -> parking_lot::RwLockReadGuard<'_, Vec<u8>> {
        self.data.read()
    }

    /// Write access (waits for a pending snapshot of this tensor). Bumps the version: take it
    /// only to change the bytes (a tensor written since the last save is copied again).
    pub fn write(&self) -> parking_lot::RwLockWriteGuard<'_, Vec<u8>> {
        let g = self.data.write();
        // Under the exclusive lock, before any change: a reader holding the lock (a pin)
        // sees the version of the bytes it reads.
        self.writes.fetch_add(1, Ordering::SeqCst);
        g
    }

    /// The version of the bytes (see [`MemorySource::version`]).
    pub fn version(&self) -> SourceVersion {
        SourceVersion {
            source: self.id,
            writes: self.writes.load(Ordering::SeqCst),
        }
    }
}

struct HostPin {
    guard: ArcRwLockReadGuard<parking_lot::RawRwLock, Vec<u8>>,
}

impl PinnedSource for HostPin {
    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self
            .guard
            .get(offset..offset + dst.len())
            .ok_or_else(|| Error::internal("snapshot copy past the end of a host tensor"))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn complete(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}

impl MemorySource for HostTensor {
    fn len(&self) -> usize {
        self.data.read().len()
    }

    fn pin(&self) -> Result<Box<dyn PinnedSource>> {
        Ok(Box::new(HostPin {
            guard: RwLock::read_arc(&self.data),
        }))
    }

    fn version(&self) -> Option<SourceVersion> {
        Some(HostTensor::version(self))
    }
}

impl MemorySink for HostTensor {
    fn len(&self) -> usize {
        self.data.read().len()
    }

    fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.in_place(offset, src.len(), &mut |dst| {
            dst.copy_from_slice(src);
            Ok(())
        })
    }

    fn with_memory(
        &self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Option<Result<()>> {
        Some(self.in_place(offset, len, fill))
    }

    fn write_many(&self, writes: &[(usize, &[u8])]) -> Result<()> {
        let mut g = self.write();
        for &(at, src) in writes {
            at.checked_add(src.len())
                .and_then(|end| g.get_mut(at..end))
                .ok_or_else(|| Error::invalid("restore write past the end of a host tensor"))?
                .copy_from_slice(src);
        }
        Ok(())
    }

    fn short_writes_cheap(&self) -> bool {
        true
    }
}

impl HostTensor {
    /// `fill` the bytes `offset .. offset + len` in place, under the write lock (which bumps
    /// the version): what both of the sink's writes do.
    fn in_place(
        &self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let mut g = self.write();
        let dst = offset
            .checked_add(len)
            .and_then(|end| g.get_mut(offset..end))
            .ok_or_else(|| Error::invalid("restore write past the end of a host tensor"))?;
        fill(dst)
    }
}

/// A box of a [`HostTensor`] that holds a larger box: a ZeRO partition or any sub-box of
/// what a rank keeps in memory, as a source (gathering its rows) and a sink (scattering them).
#[derive(Clone, Debug)]
pub struct HostView {
    tensor: HostTensor,
    held: NdBox,
    sub: NdBox,
    elem: usize,
}

impl HostView {
    /// The part `sub` of `tensor`, which holds the box `held` with `elem`-byte elements.
    pub fn new(tensor: HostTensor, held: NdBox, sub: NdBox, elem: usize) -> Result<Self> {
        if !held.contains(&sub) {
            return Err(Error::invalid(format!(
                "box {sub} is not inside the held box {held}"
            )));
        }
        let want = held.numel() as usize * elem;
        let have = tensor.read().len();
        if want != have {
            return Err(Error::invalid(format!(
                "held box {held} needs {want} bytes, the tensor has {have}"
            )));
        }
        Ok(HostView {
            tensor,
            held,
            sub,
            elem,
        })
    }

    /// Calls `f(src, view, len)` for each contiguous run: offsets in the tensor and in the view.
    fn runs(&self, mut f: impl FnMut(usize, usize, usize)) {
        ckpt_store::model::copy_runs(&self.held, &self.sub, &self.sub, self.elem, |s, d, l| {
            f(s as usize, d as usize, l as usize)
        });
    }
}

struct ViewPin {
    guard: ArcRwLockReadGuard<parking_lot::RawRwLock, Vec<u8>>,
    runs: Vec<(usize, usize, usize)>,
}

impl PinnedSource for ViewPin {
    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let end = offset + dst.len();
        let first = self.runs.partition_point(|r| r.1 + r.2 <= offset);
        for &(src, at, len) in &self.runs[first..] {
            if at >= end {
                break;
            }
            let a = offset.max(at);
            let b = end.min(at + len);
            dst[a - offset..b - offset]
                .copy_from_slice(&self.guard[src + (a - at)..src + (b - at)]);
        }
        Ok(())
    }

    fn complete(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}

impl MemorySource for HostView {
    fn len(&self) -> usize {
        self.sub.numel() as usize * self.elem
    }

    fn pin(&self) -> Result<Box<dyn PinnedSource>> {
        let mut runs = Vec::new();
        self.runs(|s, d, l| runs.push((s, d, l)));
        Ok(Box::new(ViewPin {
            guard: RwLock::read_arc(&self.tensor.data),
            runs,
        }))
    }

    /// The tensor's writes, and an identity of the tensor with this view's boxes (two views
    /// of one tensor are different sources).
    fn version(&self) -> Option<SourceVersion> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (self.tensor.id, &self.held, &self.sub, self.elem).hash(&mut h);
        Some(SourceVersion {
            source: h.finish(),
            writes: self.tensor.version().writes,
        })
    }
}

impl MemorySink for HostView {
    fn len(&self) -> usize {
        self.sub.numel() as usize * self.elem
    }

    fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        let end = offset + src.len();
        let mut g = self.tensor.write();
        let mut res = Ok(());
        self.runs(|s, at, len| {
            let a = offset.max(at);
            let b = end.min(at + len);
            if a < b {
                match g.get_mut(s + (a - at)..s + (b - at)) {
                    Some(d) => d.copy_from_slice(&src[a - offset..b - offset]),
                    None => res = Err(Error::internal("view write past the tensor")),
                }
            }
        });
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_writer_waits_for_the_pinned_copy() {
        let t = HostTensor::from_vec(vec![1u8; 16]);
        let pin = t.pin().unwrap();
        let t2 = t.clone();
        let writer = std::thread::spawn(move || {
            t2.write().fill(9);
        });
        std::thread::sleep(Duration::from_millis(50));
        // The writer cannot have run: the snapshot still sees the pinned bytes.
        let mut dst = [0u8; 16];
        pin.copy_to(0, &mut dst).unwrap();
        assert_eq!(dst, [1u8; 16]);
        pin.complete().unwrap();
        writer.join().unwrap();
        assert_eq!(*t.read(), vec![9u8; 16]);
    }

    #[test]
    fn views_gather_and_scatter_sub_boxes() {
        // A [4, 6] u8 tensor; the view is the [1..3, 2..5] block.
        let t = HostTensor::from_vec((0..24u8).collect());
        let v = HostView::new(
            t.clone(),
            NdBox::full(&[4, 6]),
            NdBox::new(vec![1, 2], vec![2, 3]).unwrap(),
            1,
        )
        .unwrap();
        let pin = MemorySource::pin(&v).unwrap();
        let mut out = [0u8; 6];
        pin.copy_to(0, &mut out).unwrap();
        assert_eq!(out, [8, 9, 10, 14, 15, 16]);
        let mut part = [0u8; 3];
        pin.copy_to(2, &mut part).unwrap();
        assert_eq!(part, [10, 14, 15]);
        drop(pin);
        v.write_at(1, &[100, 101, 102]).unwrap();
        assert_eq!(&t.read()[8..11], &[8, 100, 101]);
        assert_eq!(t.read()[14], 102);
    }
}
