//! The `fuser` adapter: every request is handed to the model ([`CkptFs`]) on the mount's
//! tokio runtime and answered from there, so a slow chunk fetch never holds up the kernel's
//! other requests. Errors become errno values in one table, [`errno`].

use std::ffi::OsStr;
use std::sync::Arc;

use ckpt_store::ErrorKind;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, Request,
};
use tokio::runtime::Handle;
use tracing::{debug, warn};

use crate::fs::{Attr, CkptFs, FsError, Kind};

/// The errno of every error the model returns.
pub fn errno(e: &FsError) -> Errno {
    match e {
        FsError::NotFound(_) => Errno::ENOENT,
        FsError::NotDir(_) => Errno::ENOTDIR,
        FsError::IsDir(_) => Errno::EISDIR,
        FsError::NotSymlink(_) => Errno::EINVAL,
        FsError::ReadOnly(_) => Errno::EROFS,
        FsError::BadHandle(_) => Errno::EBADF,
        FsError::Store(s) => match s.kind() {
            ErrorKind::NotFound => Errno::ENOENT,
            ErrorKind::InvalidInput => Errno::EINVAL,
            // Damaged data, backend and local I/O failures, incomplete steps, bugs.
            _ => Errno::EIO,
        },
    }
}

/// The kernel's read-ahead ceiling (it refuses more).
const MAX_READAHEAD: u32 = 128 << 10;

pub(crate) struct FuseAdapter {
    fs: Arc<CkptFs>,
    rt: Handle,
    uid: u32,
    gid: u32,
}

impl FuseAdapter {
    pub(crate) fn new(fs: Arc<CkptFs>, rt: Handle) -> Self {
        // SAFETY: getuid and getgid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        FuseAdapter { fs, rt, uid, gid }
    }

    /// Run a request's future: polled once here (with the runtime entered), which finishes
    /// most requests that need no I/O — metadata of an open step, reads served by the chunk
    /// cache — without a hop to another thread; whatever is still pending moves to the
    /// runtime and replies from there, so the kernel's other requests never wait on it.
    fn spawn<F>(&self, op: &'static str, f: impl FnOnce(Arc<CkptFs>) -> F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        debug!(op, "fuse request");
        let _entered = self.rt.enter();
        let mut fut = Box::pin(f(self.fs.clone()));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if fut.as_mut().poll(&mut cx).is_pending() {
            self.rt.spawn(fut);
        }
    }
}

fn file_attr(a: &Attr, uid: u32, gid: u32) -> FileAttr {
    let (kind, perm, nlink) = match a.kind {
        Kind::Dir => (FileType::Directory, 0o555, 2),
        Kind::File => (FileType::RegularFile, 0o444, 1),
        Kind::Symlink => (FileType::Symlink, 0o777, 1),
    };
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind,
        perm,
        nlink,
        uid,
        gid,
        rdev: 0,
        blksize: MAX_READAHEAD,
        flags: 0,
    }
}

fn file_type(k: Kind) -> FileType {
    match k {
        Kind::Dir => FileType::Directory,
        Kind::File => FileType::RegularFile,
        Kind::Symlink => FileType::Symlink,
    }
}

fn log_error(op: &str, ino: u64, e: &FsError) {
    if e.is_routine() {
        debug!(op, ino, error = %e, "fuse request failed");
    } else {
        warn!(op, ino, error = %e, "{op} failed: {e}");
    }
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(max) = config.set_max_readahead(MAX_READAHEAD) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(64);
        // Symlinks never change their target within a step; `latest` is short-lived anyway.
        // Readdirplus when the kernel sees lookups following a listing (`ls -l`).
        let want = InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_CACHE_SYMLINKS
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO;
        let _ = config.add_capabilities(want & config.capabilities());
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = name.to_owned();
        let (uid, gid) = (self.uid, self.gid);
        self.spawn("lookup", move |fs| async move {
            match fs.lookup(parent.0, &name).await {
                Ok(a) => reply.entry(&a.ttl, &file_attr(&a, uid, gid), Generation(0)),
                Err(e) => {
                    log_error("lookup", parent.0, &e);
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let (uid, gid) = (self.uid, self.gid);
        self.spawn("getattr", move |fs| async move {
            match fs.getattr(ino.0).await {
                Ok(a) => reply.attr(&a.ttl, &file_attr(&a, uid, gid)),
                Err(e) => {
                    log_error("getattr", ino.0, &e);
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        self.spawn("readlink", move |fs| async move {
            match fs.readlink(ino.0).await {
                Ok(t) => reply.data(t.as_bytes()),
                Err(e) => {
                    log_error("readlink", ino.0, &e);
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let write = flags.acc_mode() != OpenAccMode::O_RDONLY;
        self.spawn("open", move |fs| async move {
            match fs.open(ino.0, write).await {
                // Files of a committed step never change: keep the page cache across opens.
                Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
                Err(e) => {
                    log_error("open", ino.0, &e);
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.spawn("read", move |fs| async move {
            match fs.read(ino.0, Some(fh.0), offset, size).await {
                Ok(d) => reply.data(&d),
                Err(e) => {
                    log_error("read", ino.0, &e);
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.fs.release(fh.0);
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.spawn("opendir", move |fs| async move {
            match fs.opendir(ino.0).await {
                Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
                Err(e) => {
                    log_error("opendir", ino.0, &e);
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        match self.fs.dir_entries(fh.0) {
            Ok(entries) => {
                for (i, e) in entries.iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(e.ino), (i + 1) as u64, file_type(e.kind), &e.name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => {
                log_error("readdir", ino.0, &e);
                reply.error(errno(&e))
            }
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let (uid, gid) = (self.uid, self.gid);
        self.spawn("readdirplus", move |fs| async move {
            match fs.dir_entries_plus(fh.0).await {
                Ok((entries, attrs)) => {
                    for (i, (e, a)) in entries
                        .iter()
                        .zip(attrs.iter())
                        .enumerate()
                        .skip(offset as usize)
                    {
                        let fa = file_attr(a, uid, gid);
                        if reply.add(
                            INodeNo(e.ino),
                            (i + 1) as u64,
                            &e.name,
                            &a.ttl,
                            &fa,
                            Generation(0),
                        ) {
                            break;
                        }
                    }
                    reply.ok();
                }
                Err(e) => {
                    log_error("readdirplus", ino.0, &e);
                    reply.error(errno(&e))
                }
            }
        });
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.fs.release(fh.0);
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        reply.statfs(0, 0, 0, 0, 0, 4096, crate::names::NAME_MAX as u32, 4096);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, mask: fuser::AccessFlags, reply: ReplyEmpty) {
        if mask.contains(fuser::AccessFlags::W_OK) {
            reply.error(Errno::EROFS);
        } else {
            reply.ok();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_table() {
        use ckpt_store::Error;
        let cases = [
            (FsError::NotFound("x".into()), Errno::ENOENT),
            (FsError::NotDir("x".into()), Errno::ENOTDIR),
            (FsError::IsDir("x".into()), Errno::EISDIR),
            (FsError::NotSymlink("x".into()), Errno::EINVAL),
            (FsError::ReadOnly("x".into()), Errno::EROFS),
            (FsError::BadHandle("x".into()), Errno::EBADF),
            (FsError::Store(Error::corrupt("x")), Errno::EIO),
            (FsError::Store(Error::not_found("x")), Errno::ENOENT),
            (
                FsError::Store(Error::new(ErrorKind::Backend, "x")),
                Errno::EIO,
            ),
            (FsError::Store(Error::invalid("x")), Errno::EINVAL),
        ];
        for (e, want) in cases {
            assert_eq!(errno(&e), want, "{e:?}");
        }
    }
}
