//! `DirectFs`: the local-directory backend, an [`ObjectStore`](object_store::ObjectStore) over `object_store`'s
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
//! A conditional update (`PutMode::Update`, which [`LocalFileSystem`] lacks) replaces an object
//! only while its entity tag is the one the caller read, under an exclusive `flock` of its
//! directory, so that of two processes of a machine updating the same object from the same
//! version, one fails with `Precondition` and reads again (a node commit of the local tier).
//!
//! Staging files (`<key>#<n>`, here and in [`LocalFileSystem`]) that a crash leaves behind are
//! never listed; [`temp_files`] finds them for `ckpt verify` and `ckpt gc`.
//!
//! Reads inside [`shared_reads`] go through the page cache instead of around it: bytes that
//! other processes of this machine are about to read too (the chunks a resharded restore needs
//! only part of, whose other parts the node's other ranks read) then come from the disk once
//! for all of them, as the same buffered reads of shared files give DCP.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind as IoKind;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path as FsPath, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use futures::StreamExt;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    GetOptions, GetRange, GetResult, GetResultPayload, ObjectMeta, PutMode, PutOptions, PutPayload,
    PutResult, Result as OsResult,
};
use parking_lot::Mutex;

use crate::layer::object_store_wrapper;

mod buf;
mod read;
#[cfg(test)]
mod tests;

pub use buf::AlignedBuf;
use buf::{ALIGN, round_up};
use read::read_range;

tokio::task_local! {
    /// Set over a future whose reads go through the page cache ([`shared_reads`]).
    static SHARED_READS: ();
}

/// Run `f` with its reads of a [`DirectFs`] through the page cache (buffered) rather than with
/// `O_DIRECT`: for bytes other processes on this machine are likely to read too, so the node
/// reads them from the disk once. The hint follows `f` through every layer above the backend
/// (retries, metrics, faults) and means nothing to other backends.
pub async fn shared_reads<F: std::future::Future>(f: F) -> F::Output {
    SHARED_READS.scope((), f).await
}

/// Whether this task runs inside [`shared_reads`].
fn in_shared_reads() -> bool {
    SHARED_READS.try_with(|_| ()).is_ok()
}

/// Objects at least this large use `O_DIRECT`.
pub const DIRECT_MIN: usize = 256 << 10;
/// Largest single `pwrite`/`pread`.
const IO_PIECE: usize = 8 << 20;

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

    /// A conditional update ([`update_file`]).
    async fn put_update(
        &self,
        location: &Path,
        payload: PutPayload,
        want: Option<String>,
    ) -> OsResult<PutResult> {
        let dest = self.fs_path(location);
        let direct = self.direct.clone();
        let dirs = self.dirs.clone();
        tokio::task::spawn_blocking(move || {
            update_file(&dest, &payload, want.as_deref(), (&direct, &dirs))
        })
        .await
        .map_err(|e| object_store::Error::Generic {
            store: "DirectFs",
            source: Box::new(e),
        })?
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

/// Write `payload` to `file`; the file ends up exactly its length. With `O_DIRECT`, every
/// piece of a part that lies at an address and a file offset the file system takes as they
/// are goes to the disk straight from the caller's memory; only the rest (a chunk's 16-byte
/// header with the first bytes of its payload, a tail shorter than a block, a part that never
/// lines up) is copied through an aligned buffer. A staging slab that starts its chunk 16 bytes
/// past an aligned address (`ckpt_train`'s staging pool) lines up after one block: the chunk's
/// payload is written without a copy.
fn write_aligned(file: &File, payload: &PutPayload) -> std::io::Result<()> {
    let Some((mem, off)) = dio_alignment(file) else {
        // Buffered: any piece goes as it is.
        let mut at = 0u64;
        for part in payload.iter() {
            file.write_all_at(part, at)?;
            at += part.len() as u64;
        }
        return file.sync_data();
    };
    let total = payload.content_length();
    let need = IO_PIECE.min(round_up(total.max(1), ALIGN));
    let mut buf = take_buf(need);
    let res = write_with(file, payload, (mem, off), &mut buf);
    give_back(buf);
    res.and_then(|()| {
        if round_up(total, off) != total {
            file.set_len(total as u64)?;
        }
        #[cfg(test)]
        tests::before_sync();
        file.sync_data()
    })
}

/// An aligned buffer of at least `need` bytes from [`WRITE_BUFS`], or a new one of
/// [`IO_PIECE`] (mapped outside the pool's lock).
fn take_buf(need: usize) -> AlignedBuf {
    let kept = {
        let mut pool = WRITE_BUFS.lock();
        let i = pool.iter().position(|b| b.capacity() >= need);
        i.map(|i| pool.swap_remove(i))
    };
    kept.unwrap_or_else(|| AlignedBuf::zeroed(IO_PIECE.max(need)))
}

/// `buf` back to [`WRITE_BUFS`], or unmapped outside its lock when the pool is full. The lock
/// is held for the list alone, never across I/O: held across a write's truncate and fsync, it
/// made every writer of the process wait for each other's fsyncs in turn.
fn give_back(buf: AlignedBuf) {
    let spare = {
        let mut pool = WRITE_BUFS.lock();
        if pool.len() < KEEP_BUFS {
            pool.push(buf);
            None
        } else {
            Some(buf)
        }
    };
    drop(spare);
}

/// Direct I/O's alignment of memory and of file offsets for `file` (`statx`'s
/// `STATX_DIOALIGN`, Linux 6.1 and later; [`ALIGN`] for both where the kernel does not say), or
/// `None` if `file` is not open with `O_DIRECT`.
fn dio_alignment(file: &File) -> Option<(usize, usize)> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor `file` owns.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || flags & libc::O_DIRECT == 0 {
        return None;
    }
    // SAFETY: statx fills the zeroed struct it is given; an empty path names `fd` itself.
    let said = unsafe {
        let mut st: libc::statx = std::mem::zeroed();
        let r = libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut st,
        );
        (r == 0 && st.stx_mask & libc::STATX_DIOALIGN != 0).then_some((
            st.stx_dio_mem_align as usize,
            st.stx_dio_offset_align as usize,
        ))
    };
    let fits = |a: usize| a.is_power_of_two() && a <= ALIGN;
    Some(match said {
        Some((mem, off)) if fits(mem) && fits(off) => (mem, off),
        _ => (ALIGN, ALIGN),
    })
}

/// The writes of [`write_aligned`] with `O_DIRECT` (memory alignment `mem`, offsets `off`),
/// `buf` the bounce buffer.
fn write_with(
    file: &File,
    payload: &PutPayload,
    (mem, off): (usize, usize),
    buf: &mut AlignedBuf,
) -> std::io::Result<()> {
    let cap = buf.capacity().min(IO_PIECE);
    // Written so far (a multiple of `off`), and bytes waiting in `buf`.
    let mut at = 0u64;
    let mut fill = 0usize;
    for part in payload.iter() {
        let mut p: &[u8] = part;
        while !p.is_empty() {
            if fill == 0 && (p.as_ptr() as usize).is_multiple_of(mem) && p.len() >= off {
                let n = p.len().min(IO_PIECE) / off * off;
                file.write_all_at(&p[..n], at)?;
                at += n as u64;
                p = &p[n..];
                continue;
            }
            // Copy up to the next block boundary when the rest of the part lines up there;
            // otherwise as much as the buffer takes.
            let to_boundary = off - fill % off;
            let lines_up =
                p.len() > to_boundary && (p.as_ptr() as usize + to_boundary).is_multiple_of(mem);
            let take = if lines_up { to_boundary } else { cap - fill }.min(p.len());
            buf.full_mut()[fill..fill + take].copy_from_slice(&p[..take]);
            #[cfg(test)]
            tests::BOUNCED.with(|b| b.set(b.get() + take as u64));
            fill += take;
            p = &p[take..];
            if fill == cap || (lines_up && fill.is_multiple_of(off)) {
                file.write_all_at(&buf.full_mut()[..fill], at)?;
                at += fill as u64;
                fill = 0;
            }
        }
    }
    if fill > 0 {
        // The tail: whole blocks, zero-padded (the file is cut to its length after).
        let n = round_up(fill, off);
        let slice = &mut buf.full_mut()[..n];
        slice[fill..].fill(0);
        file.write_all_at(slice, at)?;
    }
    Ok(())
}

/// A file's entity tag, as [`LocalFileSystem`] gives it (inode, modification time in
/// microseconds, size): what a conditional update compares.
fn file_etag(meta: &std::fs::Metadata) -> String {
    use std::os::unix::fs::MetadataExt;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::SystemTime::UNIX_EPOCH).ok())
        .unwrap_or_default()
        .as_micros();
    format!("\"{:x}-{mtime:x}-{:x}\"", meta.ino(), meta.len())
}

/// Replace `dest` with `payload` if its entity tag is still `want` (a conditional update),
/// under an exclusive `flock` of its directory: two updaters of one object, in any processes
/// of this machine, go one at a time, and the second finds the tag changed. Anything the new
/// version references is made durable first, and the rename after it (as for a create).
fn update_file(
    dest: &FsPath,
    payload: &PutPayload,
    want: Option<&str>,
    (direct, dirs): (&AtomicBool, &DirSync),
) -> OsResult<PutResult> {
    let precondition = |why: String| object_store::Error::Precondition {
        path: dest.display().to_string(),
        source: why.into(),
    };
    let Some(want) = want else {
        return Err(precondition(
            "a conditional update needs an entity tag".into(),
        ));
    };
    let dir = dest.parent().unwrap_or(FsPath::new("/"));
    let lock = match File::open(dir) {
        Ok(f) => f,
        Err(e) if e.kind() == IoKind::NotFound => {
            return Err(precondition("the object does not exist".into()));
        }
        Err(e) => return Err(os_err(dir, e)),
    };
    // SAFETY: flock on a descriptor this function owns; released when `lock` closes.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } != 0 {
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            // A file system without locks (some network ones): the tag is still compared,
            // only not under a lock.
            Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::EINVAL) => {
                tracing::debug!(dir = %dir.display(), "no flock here ({e}): updating unlocked");
            }
            _ => return Err(os_err(dir, e)),
        }
    }
    let now = match std::fs::symlink_metadata(dest) {
        Ok(m) if m.is_file() => file_etag(&m),
        Ok(_) => return Err(precondition("not a file".into())),
        Err(e) if e.kind() == IoKind::NotFound => {
            return Err(precondition("the object does not exist".into()));
        }
        Err(e) => return Err(os_err(dest, e)),
    };
    if now != want {
        return Err(precondition(format!(
            "it changed: entity tag {now}, expected {want}"
        )));
    }
    let (file, staging) = new_staging(dest, direct, dirs).map_err(|e| os_err(dest, e))?;
    let res = write_aligned(&file, payload).and_then(|()| {
        drop(file);
        dirs.flush()?;
        std::fs::rename(&staging, dest)?;
        sync_dir(dest)?;
        std::fs::metadata(dest)
    });
    match res {
        Ok(m) => Ok(PutResult {
            e_tag: Some(file_etag(&m)),
            version: None,
            extensions: Default::default(),
        }),
        Err(e) => {
            let _ = std::fs::remove_file(&staging);
            Err(os_err(dest, e))
        }
    }
}

fn sync_dir(path: &FsPath) -> std::io::Result<()> {
    match path.parent() {
        Some(p) => File::open(p)?.sync_all(),
        None => Ok(()),
    }
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
        if let PutMode::Update(v) = &opts.mode
            && opts.attributes.is_empty()
        {
            return self.put_update(location, payload, v.e_tag.clone()).await;
        }
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
                // No stat per chunk for a tag nobody asks of a plain put (a read gives it).
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
        let buffered = in_shared_reads();
        let (bytes, r, meta) = tokio::task::spawn_blocking(move || {
            read_range(&path, range, (&direct, buffered), &reads).map_err(|e| os_err(&path, e))
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
                e_tag: Some(file_etag(&meta)),
                version: None,
            },
            range: r,
            attributes: Default::default(),
            extensions: Default::default(),
        })
    }
}
