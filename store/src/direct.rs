//! `DirectFs`: the local-directory backend, an [`ObjectStore`] over `object_store`'s
//! [`LocalFileSystem`] that writes and reads large objects with `O_DIRECT`.
//!
//! On the machines ckpt was measured on, buffered writes reach 0.5-0.7 GB/s (the page cache
//! is slow to grow) and cold buffered reads 0.3 GB/s, while `O_DIRECT` with several requests in
//! flight reaches 1.5-1.9 GB/s both ways (BENCHMARKS.md). So objects of at least
//! [`DIRECT_MIN`] bytes go through aligned staging buffers with `O_DIRECT`; everything else
//! (small objects, listing, deletes, conditional gets) is delegated to [`LocalFileSystem`],
//! so the on-disk layout is exactly `object_store`'s.
//!
//! Durability: every object's data is on disk (`fdatasync`) before `put` returns. The
//! directories that large objects were renamed into, and the parents of directories created
//! for them, are remembered and fsynced, each once, before the next object written with
//! `PutMode::Create` (a rank manifest, a commit record) is published; that object's own
//! directory is fsynced after it. So when a manifest or commit record exists on disk after a
//! crash, so does every object this store wrote before it, on any file system, without relying
//! on a journal's ordering. Small objects go through [`LocalFileSystem`] with its fsync on,
//! which syncs each one's directory as it is written.
//!
//! Staging files (`<key>#<n>`, here and in [`LocalFileSystem`]) that a crash leaves behind are
//! never listed; [`temp_files`] finds them for `ckpt verify` and `ckpt gc`.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind as IoKind;
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path as FsPath, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use futures::StreamExt;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    GetOptions, GetRange, GetResult, GetResultPayload, ObjectMeta, PutMode, PutOptions, PutPayload,
    PutResult, Result as OsResult,
};
use parking_lot::Mutex;

use crate::layer::object_store_wrapper;

/// Objects at least this large use `O_DIRECT`.
pub const DIRECT_MIN: usize = 256 << 10;
const ALIGN: usize = 4096;
/// Largest single `pwrite`/`pread`.
const IO_PIECE: usize = 8 << 20;

/// A heap buffer aligned for `O_DIRECT`.
///
/// A buffer of [`HUGE_PAGE`] bytes or more is its own anonymous mapping, aligned to 2 MiB and
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
fn read_buf(need: usize) -> AlignedBuf {
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
struct PooledRead(Option<AlignedBuf>);

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

fn round_up(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

/// Aligned write buffers, reused across writes (touched once, not per object) and bounded by
/// the number of writes in flight rather than by the number of threads that ever wrote.
static WRITE_BUFS: Mutex<Vec<AlignedBuf>> = Mutex::new(Vec::new());
/// Buffers kept for reuse at most (more in flight are freed when they finish).
const KEEP_BUFS: usize = 16;

/// The local-directory store (see the module docs).
#[derive(Debug)]
pub struct DirectFs {
    root: PathBuf,
    inner: LocalFileSystem,
    direct: Arc<AtomicBool>,
    dirs: Arc<DirSync>,
    /// Large reads served by the page cache, and by the disk.
    reads: Arc<ReadCounts>,
}

/// How large reads were served.
#[derive(Debug, Default)]
struct ReadCounts {
    cached: AtomicU64,
    disk: AtomicU64,
}

/// Directory fsyncs of one batch in flight at most.
const SYNC_THREADS: usize = 32;

/// Called with every directory [`DirectFs`] fsyncs before a conditional create (tests).
pub type DirSyncHook = Arc<dyn Fn(&FsPath) + Send + Sync>;

/// Directories whose entries changed since they were last fsynced, synced in one batch
/// before the next conditional create.
#[derive(Default)]
struct DirSync {
    dirty: Mutex<BTreeSet<PathBuf>>,
    /// Held while a batch is synced: a second flush waits until the first one's directories
    /// are durable (it may depend on them) rather than seeing an empty set and going ahead.
    flushing: Mutex<()>,
    syncs: AtomicU64,
    hook: OnceLock<DirSyncHook>,
}

impl std::fmt::Debug for DirSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DirSync({} synced)", self.syncs.load(Ordering::Relaxed))
    }
}

impl DirSync {
    fn mark(&self, dir: &FsPath) {
        self.dirty.lock().insert(dir.to_path_buf());
    }

    /// fsync every dirty directory (blocking), [`SYNC_THREADS`] at a time: each directory
    /// fsync waits for a journal commit or a disk cache flush, which concurrent fsyncs share,
    /// so a batch of a few hundred costs about as much as a few sequential ones. A directory
    /// removed since (an emptied one, cleaned up after a delete) has nothing to make durable.
    fn flush(&self) -> std::io::Result<()> {
        let _one_at_a_time = self.flushing.lock();
        let dirs: Vec<PathBuf> = std::mem::take(&mut *self.dirty.lock())
            .into_iter()
            .collect();
        if dirs.is_empty() {
            return Ok(());
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let failed: Mutex<Vec<(PathBuf, std::io::Error)>> = Mutex::default();
        let work = || {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(d) = dirs.get(i) else { break };
                match File::open(d).and_then(|f| f.sync_all()) {
                    Ok(()) => {
                        self.syncs.fetch_add(1, Ordering::Relaxed);
                        if let Some(h) = self.hook.get() {
                            h(d);
                        }
                    }
                    Err(e) if e.kind() == IoKind::NotFound => {}
                    Err(e) => failed.lock().push((d.clone(), e)),
                }
            }
        };
        let threads = dirs.len().min(SYNC_THREADS);
        if threads == 1 {
            work();
        } else {
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(work);
                }
            });
        }
        let failed = failed.into_inner();
        let Some((d, e)) = failed.first() else {
            return Ok(());
        };
        let err = std::io::Error::new(e.kind(), format!("syncing directory {}: {e}", d.display()));
        let mut dirty = self.dirty.lock();
        dirty.extend(failed.into_iter().map(|(d, _)| d));
        Err(err)
    }
}

/// A temporary file an interrupted write left in a local store (see [`temp_files`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TempFile {
    /// Its path.
    pub path: PathBuf,
    /// Its path below the store's root, `/`-separated.
    pub key: String,
    /// Its size.
    pub bytes: u64,
    /// When it was last written.
    pub modified: chrono::DateTime<chrono::Utc>,
}

/// Whether a file name is a staging name (`<name>#<digits>`): what [`DirectFs`] and
/// [`LocalFileSystem`] write before renaming into place, never a key ckpt uses.
pub fn is_temp_name(name: &str) -> bool {
    match name.rsplit_once('#') {
        Some((_, n)) => !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()),
        None => false,
    }
}

/// Every staging file below `root` (a local store's directory), not following links. Each is
/// either being written right now or was left by a write a crash interrupted.
pub fn temp_files(root: &FsPath) -> std::io::Result<Vec<TempFile>> {
    let mut out = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            // Removed meanwhile (an emptied directory cleaned up by a delete).
            Err(e) if e.kind() == IoKind::NotFound && dir != root => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let t = entry.file_type()?;
            let path = entry.path();
            if t.is_dir() {
                todo.push(path);
            } else if t.is_file() && entry.file_name().to_str().is_some_and(is_temp_name) {
                let meta = match entry.metadata() {
                    Ok(m) => m,
                    Err(e) if e.kind() == IoKind::NotFound => continue, // renamed into place
                    Err(e) => return Err(e),
                };
                let key = path
                    .strip_prefix(root)
                    .unwrap_or(&path)
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy())
                    .collect::<Vec<_>>()
                    .join("/");
                out.push(TempFile {
                    key,
                    bytes: meta.len(),
                    modified: meta
                        .modified()
                        .map(chrono::DateTime::<chrono::Utc>::from)
                        .unwrap_or_default(),
                    path,
                });
            }
        }
    }
    out.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(out)
}

impl std::fmt::Display for DirectFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DirectFs({})", self.root.display())
    }
}

impl DirectFs {
    /// A store rooted at `root` (created if missing).
    pub fn new(root: impl AsRef<FsPath>) -> std::io::Result<Self> {
        std::fs::create_dir_all(root.as_ref())?;
        let root = std::fs::canonicalize(root.as_ref())?;
        let inner = LocalFileSystem::new_with_prefix(&root)
            .map_err(std::io::Error::other)?
            .with_fsync(true)
            .with_automatic_cleanup(true);
        Ok(DirectFs {
            root,
            inner,
            direct: Arc::new(AtomicBool::new(true)),
            dirs: Arc::default(),
            reads: Arc::default(),
        })
    }

    /// Call `hook` with every directory synced before a conditional create (tests; set once).
    pub fn with_dir_sync_hook(self, hook: DirSyncHook) -> Self {
        let _ = self.dirs.hook.set(hook);
        self
    }

    /// Directories fsynced so far before conditional creates (each once per batch).
    pub fn dir_syncs(&self) -> u64 {
        self.dirs.syncs.load(Ordering::Relaxed)
    }

    /// Make every rename and directory creation so far durable (what a conditional create
    /// does first).
    pub async fn sync_dirs(&self) -> std::io::Result<()> {
        let dirs = self.dirs.clone();
        tokio::task::spawn_blocking(move || dirs.flush())
            .await
            .map_err(std::io::Error::other)?
    }

    /// Turn `O_DIRECT` off (for benchmarks comparing with buffered I/O).
    pub fn with_direct_io(self, on: bool) -> Self {
        self.direct.store(on, Ordering::Relaxed);
        self
    }

    /// Large reads so far: (served by the page cache, read from the disk).
    pub fn read_counts(&self) -> (u64, u64) {
        (
            self.reads.cached.load(Ordering::Relaxed),
            self.reads.disk.load(Ordering::Relaxed),
        )
    }

    /// The root directory.
    pub fn root(&self) -> &FsPath {
        &self.root
    }

    fn fs_path(&self, location: &Path) -> PathBuf {
        let mut p = self.root.clone();
        for part in location.parts() {
            p.push(part.as_ref());
        }
        p
    }
}

fn os_err(path: &FsPath, e: std::io::Error) -> object_store::Error {
    match e.kind() {
        IoKind::NotFound => object_store::Error::NotFound {
            path: path.display().to_string(),
            source: Box::new(e),
        },
        IoKind::AlreadyExists => object_store::Error::AlreadyExists {
            path: path.display().to_string(),
            source: Box::new(e),
        },
        // The io error stays in the chain: the retry layer tells a full disk (never retried)
        // from a passing failure by its errno, and a full disk stays `ErrorKind::NoSpace`.
        _ => object_store::Error::Generic {
            store: "DirectFs",
            source: Box::new(PathIoError {
                path: path.display().to_string(),
                err: e,
            }),
        },
    }
}

/// An io error on a path (its message names the path; its source is the io error).
#[derive(Debug)]
struct PathIoError {
    path: String,
    err: std::io::Error,
}

impl std::fmt::Display for PathIoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.err)
    }
}

impl std::error::Error for PathIoError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.err)
    }
}

fn open_direct(path: &FsPath, write: bool, direct: &AtomicBool) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    if write {
        // O_EXCL never follows a link planted at the name; O_NOFOLLOW says so twice.
        o.write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW);
    } else {
        o.read(true);
    }
    if direct.load(Ordering::Relaxed) {
        let flags = if write {
            libc::O_DIRECT | libc::O_NOFOLLOW
        } else {
            libc::O_DIRECT
        };
        match o.clone().custom_flags(flags).open(path) {
            Ok(f) => return Ok(f),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // tmpfs and some network file systems refuse O_DIRECT.
                tracing::debug!(path = %path.display(), "O_DIRECT refused, using buffered I/O");
                direct.store(false, Ordering::Relaxed);
                if write {
                    let _ = std::fs::remove_file(path);
                }
            }
            Err(e) => return Err(e),
        }
    }
    o.open(path)
}

/// Create `dir` and any missing parents, remembering the parent of each directory created
/// (its new entry must be synced too).
fn create_dirs(dir: &FsPath, dirs: &DirSync) -> std::io::Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == IoKind::NotFound => {
            let parent = dir.parent().ok_or(e)?;
            create_dirs(parent, dirs)?;
            match std::fs::create_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == IoKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
        // Another writer just created it and may not have synced its parent yet.
        Err(e) if e.kind() == IoKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    if let Some(p) = dir.parent() {
        dirs.mark(p);
    }
    Ok(())
}

fn new_staging(
    dest: &FsPath,
    direct: &AtomicBool,
    dirs: &DirSync,
) -> std::io::Result<(File, PathBuf)> {
    let mut n = 1u64;
    loop {
        let mut s = dest.as_os_str().to_owned();
        s.push(format!("#{n}"));
        let staging = PathBuf::from(s);
        match open_direct(&staging, true, direct) {
            Ok(f) => return Ok((f, staging)),
            Err(e) if e.kind() == IoKind::AlreadyExists => n += 1,
            Err(e) if e.kind() == IoKind::NotFound => match dest.parent() {
                Some(parent) => create_dirs(parent, dirs)?,
                None => return Err(e),
            },
            Err(e) => return Err(e),
        }
    }
}

/// Write `payload` to `file` with aligned pieces; the file ends up exactly `len` bytes long.
fn write_aligned(file: &File, payload: &PutPayload) -> std::io::Result<()> {
    let total = payload.content_length();
    let need = IO_PIECE.min(round_up(total.max(1), ALIGN));
    let mut buf = {
        let mut pool = WRITE_BUFS.lock();
        match pool.iter().position(|b| b.capacity() >= need) {
            Some(i) => pool.swap_remove(i),
            None => AlignedBuf::zeroed(IO_PIECE.max(need)),
        }
    };
    let res = write_with(file, payload, total, &mut buf);
    let mut pool = WRITE_BUFS.lock();
    if pool.len() < KEEP_BUFS {
        pool.push(buf);
    }
    res
}

fn write_with(
    file: &File,
    payload: &PutPayload,
    total: usize,
    buf: &mut AlignedBuf,
) -> std::io::Result<()> {
    {
        let cap = buf.capacity().min(IO_PIECE);
        let mut file_off = 0u64;
        let mut fill = 0usize;
        let flush = |buf: &mut AlignedBuf, fill: usize, file_off: &mut u64| {
            let n = round_up(fill, ALIGN);
            let slice = &mut buf.full_mut()[..n];
            slice[fill..].fill(0);
            file.write_all_at(slice, *file_off)?;
            *file_off += fill as u64;
            std::io::Result::Ok(())
        };
        for part in payload.iter() {
            let mut p: &[u8] = part;
            while !p.is_empty() {
                let take = (cap - fill).min(p.len());
                buf.full_mut()[fill..fill + take].copy_from_slice(&p[..take]);
                fill += take;
                p = &p[take..];
                if fill == cap {
                    flush(buf, fill, &mut file_off)?;
                    fill = 0;
                }
            }
        }
        if fill > 0 {
            flush(buf, fill, &mut file_off)?;
        }
        if round_up(total, ALIGN) != total {
            file.set_len(total as u64)?;
        }
        file.sync_data()
    }
}

fn sync_dir(path: &FsPath) -> std::io::Result<()> {
    match path.parent() {
        Some(p) => File::open(p)?.sync_all(),
        None => Ok(()),
    }
}

/// Read `range` of the object at `path`: from the page cache when it holds all of it, else
/// from the disk (with `O_DIRECT` when on).
fn read_range(
    path: &FsPath,
    range: Option<GetRange>,
    direct: &AtomicBool,
    reads: &ReadCounts,
) -> std::io::Result<(Bytes, Range<u64>, std::fs::Metadata)> {
    // A plain descriptor first: the page cache may hold the range (read or written buffered by
    // someone else: a copy, another reader on this node), and then a read from it is a memory
    // copy where an O_DIRECT read would go to the disk again.
    let file = open_direct(path, false, &AtomicBool::new(false))?;
    let meta = file.metadata()?;
    let size = meta.len();
    let r = bounded(range, size)?;
    let start = r.start as usize & !(ALIGN - 1);
    let end = round_up(r.end as usize, ALIGN);
    let mut buf = read_buf(end - start);
    let want = (r.end as usize) - start;
    if read_cached(&file, &mut buf.full_mut()[..want], start as u64)? {
        reads.cached.fetch_add(1, Ordering::Relaxed);
    } else {
        let file = if direct.load(Ordering::Relaxed) {
            open_direct(path, false, direct)?
        } else {
            file
        };
        read_full(&file, buf.full_mut(), want, start, path)?;
        reads.disk.fetch_add(1, Ordering::Relaxed);
    }
    buf.set_len(want);
    let bytes = Bytes::from_owner(PooledRead(Some(buf))).slice(r.start as usize - start..);
    Ok((bytes, r, meta))
}

/// The bytes of `range` in an object of `size` bytes.
fn bounded(range: Option<GetRange>, size: u64) -> std::io::Result<Range<u64>> {
    Ok(match range {
        None => 0..size,
        Some(GetRange::Bounded(r)) => {
            if r.start > r.end || r.start > size {
                return Err(std::io::Error::new(
                    IoKind::InvalidInput,
                    format!("range {r:?} is outside an object of {size} bytes"),
                ));
            }
            r.start..r.end.min(size)
        }
        Some(GetRange::Offset(o)) => {
            if o > size {
                return Err(std::io::Error::new(
                    IoKind::InvalidInput,
                    format!("offset {o} is past an object of {size} bytes"),
                ));
            }
            o..size
        }
        Some(GetRange::Suffix(n)) => size.saturating_sub(n)..size,
    })
}

/// Fill `dst` from `file` at `at` if the page cache holds all of it. `false`: some of it is
/// not cached. Residency is asked of `mincore(2)` over a mapping of the range, which reads
/// nothing (a `preadv2` with `RWF_NOWAIT` says EAGAIN but starts the readahead of what it did
/// not find, so the disk would read the range twice); a page evicted between the question and
/// the read makes that read go to the disk, still correct.
fn read_cached(file: &File, dst: &mut [u8], at: u64) -> std::io::Result<bool> {
    if dst.is_empty() || !resident(file, at, dst.len()) {
        return Ok(false);
    }
    let mut got = 0usize;
    while got < dst.len() {
        let piece = (dst.len() - got).min(IO_PIECE);
        let n = file.read_at(&mut dst[got..got + piece], at + got as u64)?;
        if n == 0 {
            // The object shrank: let the disk read report it.
            return Ok(false);
        }
        got += n;
    }
    Ok(true)
}

/// Whether every page of `len` bytes of `file` from `at` (page-aligned) is in the page cache.
fn resident(file: &File, at: u64, len: usize) -> bool {
    use std::os::fd::AsRawFd;
    let page = ALIGN;
    let pages = len.div_ceil(page);
    // SAFETY: a private read-only mapping of the file's range, never dereferenced (mincore
    // only asks the kernel about its pages) and unmapped before returning; `at` is aligned.
    unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            pages * page,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            at as libc::off_t,
        );
        if map == libc::MAP_FAILED {
            return false;
        }
        let mut vec = vec![0u8; pages];
        let ok = libc::mincore(map, pages * page, vec.as_mut_ptr()) == 0;
        libc::munmap(map, pages * page);
        ok && vec.iter().all(|v| v & 1 == 1)
    }
}

/// Read `want` bytes of `file` from `start` into `full` (aligned, for `O_DIRECT`).
fn read_full(
    file: &File,
    full: &mut [u8],
    want: usize,
    start: usize,
    path: &FsPath,
) -> std::io::Result<()> {
    let mut got = 0usize;
    while got < want {
        let piece = (full.len() - got).min(IO_PIECE);
        let n = file.read_at(&mut full[got..got + piece], (start + got) as u64)?;
        if n == 0 {
            return Err(std::io::Error::new(
                IoKind::UnexpectedEof,
                format!("{} shrank while being read", path.display()),
            ));
        }
        got += n;
    }
    Ok(())
}

object_store_wrapper! {
    impl [] for DirectFs;
    pass [
        put_multipart_opts,
        delete_stream,
        list,
        list_with_offset,
        list_with_delimiter,
        copy_opts,
        rename_opts,
    ];

    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> OsResult<PutResult> {
        let large = payload.content_length() >= DIRECT_MIN;
        let plain = opts.attributes.is_empty() && !matches!(opts.mode, PutMode::Update(_));
        let create = matches!(opts.mode, PutMode::Create);
        if !large || !plain {
            if create {
                // What this object will reference must be durable before it exists.
                self.sync_dirs()
                    .await
                    .map_err(|e| os_err(&self.fs_path(location), e))?;
            }
            return self.inner.put_opts(location, payload, opts).await;
        }
        let dest = self.fs_path(location);
        let direct = self.direct.clone();
        let dirs = self.dirs.clone();
        tokio::task::spawn_blocking(move || {
            let (file, staging) =
                new_staging(&dest, &direct, &dirs).map_err(|e| os_err(&dest, e))?;
            let res = write_aligned(&file, &payload).and_then(|()| {
                drop(file);
                if create {
                    dirs.flush()?;
                    std::fs::hard_link(&staging, &dest)?;
                    let _ = std::fs::remove_file(&staging);
                    sync_dir(&dest)
                } else {
                    std::fs::rename(&staging, &dest)?;
                    if let Some(p) = dest.parent() {
                        dirs.mark(p);
                    }
                    Ok(())
                }
            });
            if let Err(e) = res {
                let _ = std::fs::remove_file(&staging);
                return Err(os_err(&dest, e));
            }
            Ok(PutResult {
                e_tag: None,
                version: None,
                extensions: Default::default(),
            })
        })
        .await
        .map_err(|e| object_store::Error::Generic {
            store: "DirectFs",
            source: Box::new(e),
        })?
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> OsResult<GetResult> {
        let conditional = options.if_match.is_some()
            || options.if_none_match.is_some()
            || options.if_modified_since.is_some()
            || options.if_unmodified_since.is_some()
            || options.version.is_some()
            || options.head;
        let small = match &options.range {
            Some(GetRange::Bounded(r)) => r.end.saturating_sub(r.start) < DIRECT_MIN as u64,
            Some(GetRange::Suffix(n)) => *n < DIRECT_MIN as u64,
            _ => false,
        };
        if conditional || small || !self.direct.load(Ordering::Relaxed) {
            return self.inner.get_opts(location, options).await;
        }
        let path = self.fs_path(location);
        let direct = self.direct.clone();
        let loc = location.clone();
        let range = options.range.clone();
        let reads = self.reads.clone();
        let (bytes, r, meta) = tokio::task::spawn_blocking(move || {
            read_range(&path, range, &direct, &reads).map_err(|e| os_err(&path, e))
        })
        .await
        .map_err(|e| object_store::Error::Generic {
            store: "DirectFs",
            source: Box::new(e),
        })??;
        let last_modified = meta
            .modified()
            .map(chrono::DateTime::<chrono::Utc>::from)
            .unwrap_or_default();
        Ok(GetResult {
            payload: GetResultPayload::Stream(
                futures::stream::once(async move { Ok(bytes) }).boxed(),
            ),
            meta: ObjectMeta {
                location: loc,
                last_modified,
                size: meta.len(),
                e_tag: None,
                version: None,
            },
            range: r,
            attributes: Default::default(),
            extensions: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::{ObjectStore, ObjectStoreExt};

    #[tokio::test]
    async fn a_read_the_page_cache_holds_is_served_from_it_and_one_it_lacks_from_the_disk() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let s = DirectFs::new(dir.path()).unwrap();
        let data: Vec<u8> = (0..(DIRECT_MIN * 3 + 123))
            .map(|i| (i * 7 % 253) as u8)
            .collect();
        let p = Path::from("chunks/ab/obj");
        s.put(&p, PutPayload::from(data.clone())).await.unwrap();
        let file = s.fs_path(&p);
        let evict = || {
            let f = File::open(&file).unwrap();
            // SAFETY: a plain advice call on an open descriptor.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        };
        // Written with O_DIRECT, or evicted: read from the disk.
        evict();
        let got = s.get(&p).await.unwrap().bytes().await.unwrap();
        assert_eq!(got.as_ref(), &data[..]);
        assert_eq!(s.read_counts(), (0, 1));
        // Read buffered by someone else (a copy): now served by the page cache, same bytes,
        // whole and by range.
        let _ = std::fs::read(&file).unwrap();
        let got = s.get(&p).await.unwrap().bytes().await.unwrap();
        assert_eq!(got.as_ref(), &data[..]);
        let r = DIRECT_MIN as u64 + 5..2 * DIRECT_MIN as u64 + 77;
        let part = s.get_range(&p, r.clone()).await.unwrap();
        assert_eq!(part.as_ref(), &data[r.start as usize..r.end as usize]);
        assert_eq!(s.read_counts(), (2, 1));
        // Evicted again: the disk.
        evict();
        let got = s.get(&p).await.unwrap().bytes().await.unwrap();
        assert_eq!(got.as_ref(), &data[..]);
        assert_eq!(s.read_counts(), (2, 2));
    }

    #[tokio::test]
    async fn large_and_small_objects_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let s = DirectFs::new(dir.path()).unwrap();
        for len in [
            0usize,
            10,
            DIRECT_MIN - 1,
            DIRECT_MIN,
            DIRECT_MIN + 4097,
            9 << 20,
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let p = Path::from(format!("a/b/obj-{len}"));
            // Two pieces, so the aligned copy crosses a payload boundary.
            let split = len / 3;
            let payload: PutPayload = [
                Bytes::copy_from_slice(&data[..split]),
                Bytes::copy_from_slice(&data[split..]),
            ]
            .into_iter()
            .collect();
            s.put(&p, payload).await.unwrap();
            let got = s.get(&p).await.unwrap().bytes().await.unwrap();
            assert_eq!(got.len(), len);
            assert!(got == data, "len {len}");
            assert_eq!(
                std::fs::metadata(dir.path().join(p.as_ref()))
                    .unwrap()
                    .len(),
                len as u64
            );
            if len > 5000 {
                let r = s.get_range(&p, 4000..len as u64 - 1).await.unwrap();
                assert_eq!(&r[..], &data[4000..len - 1]);
            }
        }
        // Staging files are never listed.
        let listed: Vec<_> = s.list(None).map(|m| m.unwrap().location).collect().await;
        assert_eq!(listed.len(), 6);
    }

    /// The directories large objects were renamed into (and the parents of the directories
    /// created for them) are synced once each, as a batch, before a conditional create
    /// publishes its object, and not before: a save pays one fsync per directory, not one per
    /// object.
    #[tokio::test]
    async fn directories_are_synced_once_before_a_conditional_create() {
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        let commit = root.join("runs/r/steps/1/COMMIT");
        let commit2 = root.join("runs/r/steps/2/COMMIT");
        // (directory, commit record 1 exists, commit record 2 exists) at each sync.
        let synced: Arc<Mutex<Vec<(PathBuf, bool, bool)>>> = Arc::default();
        let hook: DirSyncHook = {
            let synced = synced.clone();
            let (c1, c2) = (commit.clone(), commit2.clone());
            Arc::new(move |d: &FsPath| {
                synced
                    .lock()
                    .push((d.to_path_buf(), c1.exists(), c2.exists()))
            })
        };
        let s = DirectFs::new(&root).unwrap().with_dir_sync_hook(hook);
        let big = |b: u8| PutPayload::from(Bytes::from(vec![b; DIRECT_MIN + 1]));
        s.put(&Path::from("chunks/aa/one"), big(1)).await.unwrap();
        s.put(&Path::from("chunks/aa/two"), big(2)).await.unwrap();
        s.put(&Path::from("packs/bb/three"), big(3)).await.unwrap();
        assert!(synced.lock().is_empty(), "synced before any commit");

        // A small commit record (through LocalFileSystem).
        s.put_opts(
            &Path::from("runs/r/steps/1/COMMIT"),
            Bytes::from_static(b"{}").into(),
            PutMode::Create.into(),
        )
        .await
        .unwrap();
        let got = std::mem::take(&mut *synced.lock());
        let mut dirs: Vec<PathBuf> = got.iter().map(|(d, _, _)| d.clone()).collect();
        dirs.sort();
        let want: Vec<PathBuf> = ["", "chunks", "chunks/aa", "packs", "packs/bb"]
            .iter()
            .map(|d| {
                if d.is_empty() {
                    root.clone()
                } else {
                    root.join(d)
                }
            })
            .collect();
        assert_eq!(dirs, want, "each directory once");
        assert!(
            got.iter().all(|s| !s.1),
            "a sync came after the commit record"
        );
        assert!(commit.exists());
        assert_eq!(s.dir_syncs(), 5);

        // The next step: only the directories that changed (a chunk's, and the parent of the
        // step's new directory), before a large commit record.
        s.put(&Path::from("chunks/aa/four"), big(4)).await.unwrap();
        s.put_opts(
            &Path::from("runs/r/steps/2/COMMIT"),
            big(5),
            PutMode::Create.into(),
        )
        .await
        .unwrap();
        let mut got = std::mem::take(&mut *synced.lock());
        got.sort();
        assert_eq!(
            got,
            vec![
                (root.join("chunks/aa"), true, false),
                (root.join("runs/r/steps"), true, false)
            ]
        );
        assert!(commit2.exists());
        // Nothing dirty: a create syncs nothing more.
        s.put_opts(
            &Path::from("runs/r/steps/3/COMMIT"),
            Bytes::from_static(b"{}").into(),
            PutMode::Create.into(),
        )
        .await
        .unwrap();
        assert!(synced.lock().is_empty());
    }

    #[test]
    fn temp_files_are_found_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("chunks/aa")).unwrap();
        std::fs::create_dir_all(root.join("runs/r/steps/1")).unwrap();
        for (name, len) in [
            ("chunks/aa/abc", 3),
            ("chunks/aa/abc#1", 5),
            ("chunks/aa/abc#x", 1),
            ("runs/r/steps/1/COMMIT#12", 7),
            ("runs/r/steps/1/rank-000000.manifest", 2),
        ] {
            std::fs::write(root.join(name), vec![0u8; len]).unwrap();
        }
        // A link named like a temporary file is not followed into, nor reported.
        std::os::unix::fs::symlink("/etc/passwd", root.join("chunks/aa/x#3")).unwrap();
        let got: Vec<(String, u64)> = temp_files(root)
            .unwrap()
            .into_iter()
            .map(|t| (t.key, t.bytes))
            .collect();
        assert_eq!(
            got,
            vec![
                ("chunks/aa/abc#1".to_string(), 5),
                ("runs/r/steps/1/COMMIT#12".to_string(), 7)
            ]
        );
    }

    #[tokio::test]
    async fn create_mode_refuses_existing() {
        let dir = tempfile::tempdir().unwrap();
        let s = DirectFs::new(dir.path()).unwrap();
        let p = Path::from("x/COMMIT");
        let big = Bytes::from(vec![1u8; DIRECT_MIN + 10]);
        s.put_opts(&p, big.clone().into(), PutMode::Create.into())
            .await
            .unwrap();
        let e = s
            .put_opts(
                &p,
                Bytes::from(vec![2u8; DIRECT_MIN + 10]).into(),
                PutMode::Create.into(),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(e, object_store::Error::AlreadyExists { .. }),
            "{e}"
        );
        assert_eq!(s.get(&p).await.unwrap().bytes().await.unwrap(), big);
    }
}
