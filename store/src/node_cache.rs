//! A node's shared chunk cache: the ranks of one machine that restore the same chunks
//! (replicated data-parallel state, embeddings shared by pipeline stages) fetch each from the
//! store once per node instead of once per rank.
//!
//! The cache is a directory on the node (the supervisor gives each node and generation one
//! under `/dev/shm`), shared by the rank processes. For each chunk a process needs it
//! 1. reads `<dir>/<chunk id>` if it is there;
//! 2. otherwise takes an exclusive `flock` on `<dir>/<chunk id>.lock` (the ranks that need the
//!    same chunk queue there; the kernel releases the lock of a killed process), looks again,
//!    and if still absent fetches the chunk from the store (decoded and hash-checked), writes
//!    it to a fresh temporary file in the directory and renames it into place, then unlocks.
//!
//! Every chunk read from the directory is hash-checked again (the directory is memory any
//! process of the user can write): a damaged one is removed and fetched from the store. The
//! directory must be this user's own (created mode 0700, not a link): anything else is an
//! error and the restore reads the store directly.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind as IoKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tracing::warn;

use crate::error::{Error, Result};
use crate::id::ChunkId;
use crate::model::ChunkRef;

/// What one process's use of a node cache did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeCacheStats {
    /// Chunks this process fetched from the store (and left for the node's other ranks).
    pub fetched: u64,
    /// Raw bytes of those chunks.
    pub fetched_bytes: u64,
    /// Chunks another rank of the node had fetched.
    pub shared: u64,
    /// Raw bytes of those chunks.
    pub shared_bytes: u64,
    /// Damaged cache files found (and replaced from the store).
    pub damaged: u64,
}

/// A node's shared chunk cache (see the module docs).
#[derive(Debug)]
pub struct NodeCache {
    dir: PathBuf,
    fetched: AtomicU64,
    fetched_bytes: AtomicU64,
    shared: AtomicU64,
    shared_bytes: AtomicU64,
    damaged: AtomicU64,
}

impl NodeCache {
    /// Open (creating it and its parents, mode 0700) the cache directory `dir`; an error if
    /// it is a link, not a directory, not this user's, or open to others.
    pub fn open(dir: &Path) -> Result<Self> {
        match std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
        {
            Ok(()) => {}
            Err(e) if e.kind() == IoKind::AlreadyExists => {}
            Err(e) => return Err(Error::io("creating node cache", &dir.display(), e)),
        }
        let meta = std::fs::symlink_metadata(dir)
            .map_err(|e| Error::io("node cache", &dir.display(), e))?;
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let why = if meta.file_type().is_symlink() {
            Some("is a symbolic link")
        } else if !meta.is_dir() {
            Some("is not a directory")
        } else if meta.uid() != uid {
            Some("belongs to another user")
        } else if meta.mode() & 0o077 != 0 {
            Some("is open to other users (mode is not 0700)")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(Error::invalid(format!(
                "node cache {} {why}: refusing to share chunks through it",
                dir.display()
            )));
        }
        Ok(NodeCache {
            dir: dir.to_path_buf(),
            fetched: AtomicU64::new(0),
            fetched_bytes: AtomicU64::new(0),
            shared: AtomicU64::new(0),
            shared_bytes: AtomicU64::new(0),
            damaged: AtomicU64::new(0),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What this process did so far.
    pub fn stats(&self) -> NodeCacheStats {
        NodeCacheStats {
            fetched: self.fetched.load(Ordering::Relaxed),
            fetched_bytes: self.fetched_bytes.load(Ordering::Relaxed),
            shared: self.shared.load(Ordering::Relaxed),
            shared_bytes: self.shared_bytes.load(Ordering::Relaxed),
            damaged: self.damaged.load(Ordering::Relaxed),
        }
    }

    /// The decoded bytes of `r`: from the node's directory, or from `fetch` (the store; it must
    /// return verified bytes), left there for the node's other ranks. `true` when this call
    /// fetched.
    pub async fn get_or_fetch<F, Fut>(&self, r: &ChunkRef, fetch: F) -> Result<(Bytes, bool)>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Bytes>>,
    {
        let name = r.id.to_hex();
        let data = self.dir.join(&name);
        if let Some(b) = self.read_checked(&data, r).await? {
            return Ok((b, false));
        }
        let lock_path = self.dir.join(format!("{name}.lock"));
        let lock = tokio::task::spawn_blocking(move || lock_exclusive(&lock_path)).await??;
        // Another rank may have fetched it while this one waited.
        if let Some(b) = self.read_checked(&data, r).await? {
            drop(lock);
            return Ok((b, false));
        }
        let b = fetch().await?;
        let (dir, bytes) = (self.dir.clone(), b.clone());
        let put = tokio::task::spawn_blocking(move || put_file(&dir, &data, &bytes)).await?;
        drop(lock);
        if let Err(e) = put {
            // The restore goes on; the node's other ranks fetch it themselves.
            warn!(chunk = %r.id, dir = %self.dir.display(), "node cache: {e}");
        }
        self.fetched.fetch_add(1, Ordering::Relaxed);
        self.fetched_bytes
            .fetch_add(u64::from(r.len), Ordering::Relaxed);
        Ok((b, true))
    }

    /// The chunk file at `path` if it is there and holds `r`'s bytes; a damaged one is removed.
    async fn read_checked(&self, path: &Path, r: &ChunkRef) -> Result<Option<Bytes>> {
        let (path, id, len) = (path.to_path_buf(), r.id, r.len as usize);
        let got = tokio::task::spawn_blocking(move || -> Result<Option<(Bytes, bool)>> {
            let mut f = match OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
            {
                Ok(f) => f,
                Err(e) if e.kind() == IoKind::NotFound => return Ok(None),
                Err(e) => return Err(Error::io("reading node cache file", &path.display(), e)),
            };
            let mut buf = Vec::with_capacity(len);
            f.read_to_end(&mut buf)
                .map_err(|e| Error::io("reading node cache file", &path.display(), e))?;
            let ok = buf.len() == len && ChunkId::of(&buf) == id;
            if !ok {
                let _ = std::fs::remove_file(&path);
            }
            Ok(Some((Bytes::from(buf), ok)))
        })
        .await??;
        match got {
            None => Ok(None),
            Some((b, true)) => {
                self.shared.fetch_add(1, Ordering::Relaxed);
                self.shared_bytes
                    .fetch_add(b.len() as u64, Ordering::Relaxed);
                Ok(Some(b))
            }
            Some((_, false)) => {
                self.damaged.fetch_add(1, Ordering::Relaxed);
                warn!(chunk = %id, dir = %self.dir.display(), "node cache: a damaged chunk file was removed");
                Ok(None)
            }
        }
    }
}

/// Open (creating) `path` and take an exclusive `flock` on it, waiting for it.
fn lock_exclusive(path: &Path) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io("opening node cache lock", &path.display(), e))?;
    loop {
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(f);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != IoKind::Interrupted {
            return Err(Error::io("locking node cache lock", &path.display(), e));
        }
    }
}

/// Write `bytes` to a new temporary file in `dir` and rename it to `target`.
fn put_file(dir: &Path, target: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let (mut f, tmp) = crate::outfile::create_unique(dir, ".partial", "")?;
    let res = f.write_all(bytes).and_then(|()| {
        drop(f);
        std::fs::rename(&tmp, target)
    });
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Codec;

    fn chunk(data: &[u8]) -> ChunkRef {
        ChunkRef {
            id: ChunkId::of(data),
            len: data.len() as u32,
            stored: data.len() as u32,
            codec: Codec::Raw,
            pack: None,
            offset: 0,
            bases: Vec::new(),
            base_step: None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_fetch_per_chunk_and_damaged_files_are_refetched() {
        let dir = tempfile::tempdir().unwrap();
        let data = Bytes::from(vec![7u8; 100_000]);
        let r = chunk(&data);
        let fetches = std::sync::Arc::new(AtomicU64::new(0));
        // Two "ranks" (two caches on one directory, as two processes would open it) ask for
        // the same chunk at once: the store is read once.
        let a = NodeCache::open(&dir.path().join("node")).unwrap();
        let b = NodeCache::open(&dir.path().join("node")).unwrap();
        let fetch = || {
            let (d, f) = (data.clone(), fetches.clone());
            async move {
                f.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                Ok(d)
            }
        };
        let (x, y) = tokio::join!(a.get_or_fetch(&r, fetch), b.get_or_fetch(&r, fetch));
        let (x, y) = (x.unwrap(), y.unwrap());
        assert_eq!((x.0.clone(), y.0.clone()), (data.clone(), data.clone()));
        assert_eq!(fetches.load(Ordering::SeqCst), 1, "one fetch for the node");
        assert!(x.1 != y.1, "exactly one of them fetched");
        // A damaged file (another process of the user wrote it) is removed and fetched again.
        std::fs::write(dir.path().join("node").join(r.id.to_hex()), b"not it").unwrap();
        let (got, fetched) = a.get_or_fetch(&r, fetch).await.unwrap();
        assert_eq!(got, data);
        assert!(fetched);
        assert_eq!(a.stats().damaged, 1);
        assert_eq!(fetches.load(Ordering::SeqCst), 2);
        // Now it is there for everyone.
        let (_, fetched) = b.get_or_fetch(&r, fetch).await.unwrap();
        assert!(!fetched);
    }
}
