//! Aligned buffers for `O_DIRECT`: [`AlignedBuf`], mapped for huge pages when large, and the
//! pool of read buffers a restore's reads reuse.

use std::ptr::NonNull;

use parking_lot::Mutex;

/// `O_DIRECT`'s alignment of buffers, offsets and lengths.
pub(super) const ALIGN: usize = 4096;

/// A heap buffer aligned for `O_DIRECT`.
///
/// A buffer of `HUGE_PAGE` bytes or more is its own anonymous mapping, aligned to 2 MiB and
/// advised `MADV_HUGEPAGE` before anything touches it: where the kernel gives transparent
/// huge pages for the asking (`madvise` mode, the default of most distributions), its first
/// touch faults 2 MiB at a time, not 4 KiB. Memory touched for the first time is what made a
/// first save and a restore's fresh buffers slow on these machines (4 KiB pages: 0.15-0.6
/// GB/s; huge pages: 1.1-1.5 GB/s, `BENCHMARKS.md`); the allocator's zeroed allocation for an
/// alignment above its own writes every page itself, too early for the advice.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    /// Its own mapping (unmapped on drop), else the global allocator's.
    mapped: bool,
}

/// The size of a transparent huge page on x86-64 and most arm64 kernels; buffers this large or
/// larger are mapped for huge pages.
pub const HUGE_PAGE: usize = 2 << 20;

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only read the bytes.
unsafe impl Sync for AlignedBuf {}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf(len {}, capacity {})", self.len, self.cap)
    }
}

/// A zeroed, untouched anonymous mapping of `cap` bytes aligned to [`HUGE_PAGE`] and advised
/// for huge pages; `None` where the kernel refuses the mapping.
fn map_huge(cap: usize) -> Option<NonNull<u8>> {
    let over = cap + HUGE_PAGE;
    // SAFETY: an anonymous private mapping (no file, zero-filled); its unaligned head and
    // tail are unmapped at once, leaving `cap` bytes from an aligned start, owned by the
    // caller. The advice is only advice.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            over,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return None;
        }
        let base = p as usize;
        let start = round_up(base, HUGE_PAGE);
        if start > base {
            libc::munmap(p, start - base);
        }
        let tail = base + over - (start + cap);
        if tail > 0 {
            libc::munmap((start + cap) as *mut libc::c_void, tail);
        }
        libc::madvise(start as *mut libc::c_void, cap, libc::MADV_HUGEPAGE);
        NonNull::new(start as *mut u8)
    }
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes, capacity rounded up to the alignment.
    pub fn zeroed(len: usize) -> Self {
        let cap = round_up(len.max(1), ALIGN);
        if cap >= HUGE_PAGE
            && let Some(ptr) = map_huge(cap)
        {
            return AlignedBuf {
                ptr,
                len,
                cap,
                mapped: true,
            };
        }
        let layout = std::alloc::Layout::from_size_align(cap, ALIGN).expect("layout");
        // SAFETY: layout has non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf {
            ptr,
            len,
            cap,
            mapped: false,
        }
    }

    /// Capacity (a multiple of the alignment).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Set the length (must not exceed the capacity).
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.cap);
        self.len = len;
    }

    /// The whole capacity, writable.
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap bytes, initialized (zeroed at allocation).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len <= cap initialized bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: the mapping of `cap` bytes made by `map_huge`, unmapped once.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
            return;
        }
        let layout = std::alloc::Layout::from_size_align(self.cap, ALIGN).expect("layout");
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// Aligned read buffers, reused: a restore reads gigabytes in chunk-sized objects, and memory
/// touched for the first time fills several times slower than memory reused on these
/// machines. A buffer returns here when the last `Bytes` over it is dropped.
///
/// One of three buffer pools, kept apart on purpose: these are 4 KiB-aligned for `O_DIRECT`;
/// the peer source's (`ckpt_recovery::peer::PeerSource`) are plain `Vec`s a socket fills, owned per source so
/// a restore's buffers go with it; the CUDA bounce buffers are page-locked memory, slow to
/// allocate and registered with the driver. One shared pool would hand out the wrong kind.
static READ_BUFS: Mutex<Vec<AlignedBuf>> = Mutex::new(Vec::new());
/// Read buffers kept for reuse at most.
const KEEP_READ_BUFS: usize = 16;

/// A buffer of at least `need` bytes from the pool (one not more than twice as large), or a
/// new one.
pub(super) fn read_buf(need: usize) -> AlignedBuf {
    let mut pool = READ_BUFS.lock();
    match pool
        .iter()
        .position(|b| b.capacity() >= need && b.capacity() <= 2 * need.max(ALIGN))
    {
        Some(i) => pool.swap_remove(i),
        None => AlignedBuf::zeroed(need),
    }
}

/// The owner of a read's `Bytes`: gives its buffer back to [`READ_BUFS`] when dropped.
pub(super) struct PooledRead(pub(super) Option<AlignedBuf>);

impl AsRef<[u8]> for PooledRead {
    fn as_ref(&self) -> &[u8] {
        self.0.as_deref().unwrap_or(&[])
    }
}

impl Drop for PooledRead {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            let mut pool = READ_BUFS.lock();
            if pool.len() < KEEP_READ_BUFS {
                pool.push(b);
            }
        }
    }
}

pub(super) fn round_up(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}
