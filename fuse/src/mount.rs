//! Mounting: checks that say what is wrong before the kernel is asked, the `fuser` session on
//! its own thread, the mount's tokio runtime, and unmounting (on request, on SIGINT/SIGTERM,
//! when the handle is dropped, and — through `fusermount3`'s auto-unmount, when installed —
//! when the process dies).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use ckpt_store::{Error, ErrorKind, Result, Store};
use fuser::{Config, MountOption, SessionACL};
use tracing::{info, warn};

use crate::MountOptions;
use crate::fs::{CkptFs, FsOptions};
use crate::fuse::FuseAdapter;

const DEV_FUSE: &str = "/dev/fuse";

enum Event {
    Ended(io::Result<()>),
    Signal(&'static str),
}

/// A mounted store, served by a background thread until [`MountHandle::unmount`] or drop.
pub struct MountHandle {
    mountpoint: PathBuf,
    fs: Arc<CkptFs>,
    events: parking_lot::Mutex<Receiver<Event>>,
    tx: Sender<Event>,
    thread: Option<JoinHandle<()>>,
    runtime: Option<tokio::runtime::Runtime>,
    conn: Option<u32>,
    auto_unmount: bool,
    ended: bool,
}

impl std::fmt::Debug for MountHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MountHandle({})", self.mountpoint.display())
    }
}

/// Where `fusermount3` is, if installed (`$FUSERMOUNT_PATH` first, as `fuser` does).
#[allow(
    clippy::disallowed_methods,
    reason = "finding a program on PATH is how a mount finds its helper, as fuser does"
)]
pub fn find_fusermount3() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FUSERMOUNT_PATH") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/bin")])
        .map(|d| d.join("fusermount3"))
        .find(|p| p.is_file())
}

/// Whether /etc/fuse.conf lets users other than root mount with allow_other.
fn user_allow_other() -> bool {
    std::fs::read_to_string("/etc/fuse.conf").is_ok_and(|c| {
        c.lines()
            .any(|l| l.split('#').next().unwrap_or("").trim() == "user_allow_other")
    })
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

fn unescape_mountinfo(s: &str) -> String {
    // Spaces, tabs, newlines and backslashes are written as \ooo.
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The filesystem type and source mounted exactly at `path`, if any (from
/// `/proc/self/mountinfo`).
pub fn mounted_at(path: &Path) -> Option<(String, String)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = path.to_string_lossy();
    let mut found = None;
    for line in info.lines() {
        let (pre, post) = line.split_once(" - ")?;
        let mp = pre.split(' ').nth(4)?;
        if unescape_mountinfo(mp) == want {
            let mut p = post.split(' ');
            let fstype = p.next().unwrap_or("").to_string();
            let source = p.next().unwrap_or("").to_string();
            // The last one listed is the one on top.
            found = Some((fstype, source));
        }
    }
    found
}

/// Check the mountpoint and `/dev/fuse`; returns the canonical mountpoint.
fn preflight(mountpoint: &Path) -> Result<PathBuf> {
    let shown = mountpoint.display();
    match std::fs::metadata(mountpoint) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "mountpoint {shown} is busy: a dead FUSE mount is still there (a `ckpt mount` \
                     that was killed?). Clear it with `umount {shown}` (or `fusermount3 -u {shown}`) \
                     and mount again"
                ),
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(Error::invalid(format!(
                "mountpoint {shown} does not exist: create it first (`mkdir -p {shown}`)"
            )));
        }
        Err(e) => return Err(Error::io("checking mountpoint", &shown, e)),
        Ok(m) if !m.is_dir() => {
            return Err(Error::invalid(format!(
                "mountpoint {shown} is not a directory"
            )));
        }
        Ok(_) => {}
    }
    let canon = mountpoint
        .canonicalize()
        .map_err(|e| Error::io("resolving mountpoint", &shown, e))?;
    if let Some((fstype, source)) = mounted_at(&canon) {
        return Err(Error::new(
            ErrorKind::Conflict,
            format!(
                "mountpoint {shown} is busy: {source} ({fstype}) is already mounted there. \
                 Unmount it first (`umount {shown}`) or choose another directory"
            ),
        ));
    }
    let mut entries =
        std::fs::read_dir(&canon).map_err(|e| Error::io("listing mountpoint", &shown, e))?;
    if entries.next().is_some() {
        return Err(Error::new(
            ErrorKind::Conflict,
            format!(
                "mountpoint {shown} is not empty: mounting would hide its files. \
                 Choose an empty directory"
            ),
        ));
    }
    check_dev_fuse(Path::new(DEV_FUSE))?;
    Ok(canon)
}

/// Whether FUSE can be used here, with what to do when it cannot.
pub(crate) fn check_dev_fuse(dev: &Path) -> Result<()> {
    let unavailable = |why: String| Error::new(ErrorKind::Io, why);
    match std::fs::OpenOptions::new().read(true).write(true).open(dev) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(unavailable(format!(
            "FUSE is unavailable: {} does not exist. Load the kernel module (`modprobe fuse`); \
             in a container, start it with `--device /dev/fuse --cap-add SYS_ADMIN`. The \
             userspace tools come with the `fuse3` package (`apt-get install fuse3`, \
             `dnf install fuse3`)",
            dev.display()
        ))),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            if !is_root() && find_fusermount3().is_some() {
                // fusermount3 is setuid root and opens the device itself.
                return Ok(());
            }
            Err(unavailable(format!(
                "FUSE is unavailable: permission denied opening {}. Mount as root, or install \
                 the `fuse3` package (`apt-get install fuse3`), whose setuid `fusermount3` \
                 mounts for other users",
                dev.display()
            )))
        }
        Err(e) => Err(unavailable(format!(
            "FUSE is unavailable: opening {}: {e}",
            dev.display()
        ))),
    }
}

fn mount_error(mountpoint: &Path, e: io::Error) -> Error {
    let shown = mountpoint.display();
    let hint = match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => {
            " (permission denied: mount as root, or install `fuse3` so that `fusermount3` can \
             mount for you)"
        }
        Some(libc::ENODEV) => " (the kernel has no FUSE support: `modprobe fuse`)",
        Some(libc::EBUSY) => " (the mountpoint is busy)",
        _ if e.kind() == io::ErrorKind::NotFound => {
            " (a FUSE helper is missing: install the `fuse3` package, `apt-get install fuse3`)"
        }
        _ => "",
    };
    Error::new(
        ErrorKind::Io,
        format!("mounting the checkpoint store at {shown} failed: {e}{hint}"),
    )
    .with_source(e)
}

/// `umount` of `path`; `lazy` detaches it now and lets it go when its last user does.
fn umount_path(path: &Path, lazy: bool) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    let rc = unsafe { libc::umount2(c.as_ptr(), flags) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EPERM)
        && let Some(fm) = find_fusermount3()
    {
        let mut cmd = std::process::Command::new(fm);
        cmd.arg("-u").arg("-q");
        if lazy {
            cmd.arg("-z");
        }
        let out = cmd.arg(path).output()?;
        if out.status.success() {
            return Ok(());
        }
        let msg = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if msg.contains("busy") {
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        }
        return Err(io::Error::other(msg));
    }
    Err(err)
}

/// The FUSE connection number of the mount at `path` (the minor of its anonymous device,
/// read from `/proc/self/mountinfo`: a `stat` would ask the filesystem itself), for
/// `/sys/fs/fuse/connections/<n>/abort`.
fn connection_of(path: &Path) -> Option<u32> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = path.to_string_lossy();
    info.lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let dev = f.nth(2)?;
            let mp = f.nth(1)?;
            (unescape_mountinfo(mp) == want).then_some(dev)
        })
        .next_back()
        .and_then(|dev| dev.split_once(':')?.1.parse().ok())
}

/// Mount `store` at `opts.mountpoint` and serve it from background threads until the handle
/// is unmounted or dropped.
pub fn spawn_mount(store: Store, opts: &MountOptions) -> Result<MountHandle> {
    let mountpoint = preflight(&opts.mountpoint)?;
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().max(2));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("ckpt-fuse")
        .enable_all()
        .build()
        .map_err(|e| Error::io("starting the mount's runtime", &"tokio", e))?;
    let url = store.url().to_string();
    // A store that cannot be listed would only show up as EIO on `ls`: say so now. (On a
    // thread of its own, so that a caller inside an async runtime may mount too.)
    std::thread::scope(|s| {
        s.spawn(|| runtime.block_on(store.log().list_runs()))
            .join()
            .unwrap_or_else(|_| Err(Error::internal("listing the store panicked")))
    })
    .map_err(|e| e.context(format!("cannot mount {url}: listing its runs failed")))?;
    let fs = Arc::new(CkptFs::new(
        store,
        FsOptions {
            cache_bytes: opts.cache_bytes,
            ..FsOptions::default()
        },
    ));
    let adapter = FuseAdapter::new(fs.clone(), runtime.handle().clone());

    let (cfg, auto_unmount) = session_config(&url, opts, &mountpoint);

    let session =
        fuser::Session::new(adapter, &mountpoint, &cfg).map_err(|e| mount_error(&mountpoint, e))?;
    // The device fd fusermount3 passes over has no close-on-exec flag: a process this one
    // starts later would inherit it and keep a dead mount's connection alive.
    {
        use std::os::fd::{AsFd, AsRawFd};
        let fd = session.as_fd().as_raw_fd();
        // SAFETY: fcntl on a descriptor the session owns, which stays open during the call.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
    let conn = connection_of(&mountpoint);
    let (tx, events) = channel();
    let done = tx.clone();
    let thread = std::thread::Builder::new()
        .name("ckpt-fuse-session".into())
        .spawn(move || {
            let r = session.run();
            if let Err(e) = &r {
                tracing::error!(error = %e, "the FUSE session ended with an error: {e}");
            }
            let _ = done.send(Event::Ended(r));
        })
        .map_err(|e| Error::io("starting the FUSE session thread", &"thread", e))?;
    info!(store = %url, mountpoint = %mountpoint.display(), auto_unmount,
        "mounted {url} at {}", mountpoint.display());
    Ok(MountHandle {
        mountpoint,
        fs,
        events: parking_lot::Mutex::new(events),
        tx,
        thread: Some(thread),
        runtime: Some(runtime),
        conn,
        auto_unmount,
        ended: false,
    })
}

/// The FUSE session's settings: read-only and safe options, who may enter, and whether the
/// mount goes away with this process (auto-unmount, when fusermount3 can).
fn session_config(url: &str, opts: &MountOptions, mountpoint: &Path) -> (Config, bool) {
    let mut cfg = Config::default();
    let fsname: String = format!("ckpt:{url}")
        .chars()
        .map(|c| {
            if c == ',' || c.is_whitespace() {
                '_'
            } else {
                c
            }
        })
        .collect();
    cfg.mount_options.extend([
        MountOption::RO,
        MountOption::NoSuid,
        MountOption::NoDev,
        MountOption::NoExec,
        MountOption::NoAtime,
        MountOption::DefaultPermissions,
        MountOption::FSName(fsname),
        MountOption::Subtype("ckpt".into()),
    ]);
    cfg.acl = if opts.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    // With fusermount3 installed, the mount does not outlive this process even when it is
    // killed: fusermount3 unmounts. `fuser` then needs the mount to admit root besides the
    // owner (the kernel's allow_other), which users other than root may only ask for when
    // /etc/fuse.conf says user_allow_other.
    let auto_unmount =
        find_fusermount3().is_some() && (is_root() || opts.allow_other || user_allow_other());
    if auto_unmount {
        cfg.mount_options.push(MountOption::AutoUnmount);
        if cfg.acl == SessionACL::Owner {
            cfg.acl = SessionACL::RootAndOwner;
        }
    } else {
        warn!(
            "no auto-unmount (fusermount3 missing, or user_allow_other not set in \
             /etc/fuse.conf): if this process is killed, the mount stays until `umount {}`",
            mountpoint.display()
        );
    }
    cfg.n_threads = Some(2);
    cfg.clone_fd = true;
    (cfg, auto_unmount)
}

impl MountHandle {
    /// The (canonical) mountpoint.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The filesystem model behind the mount (cache figures, open handles).
    pub fn fs(&self) -> &Arc<CkptFs> {
        &self.fs
    }

    /// Whether `fusermount3` will unmount if this process dies.
    pub fn auto_unmount(&self) -> bool {
        self.auto_unmount
    }

    fn finish(&mut self, r: io::Result<()>) -> Result<()> {
        self.ended = true;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        r.map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!(
                    "the FUSE session at {} failed: {e}",
                    self.mountpoint.display()
                ),
            )
        })
    }

    fn wait_ended(&mut self, timeout: Duration) -> Result<bool> {
        loop {
            let ev = self.events.lock().recv_timeout(timeout);
            match ev {
                Ok(Event::Ended(r)) => return self.finish(r).map(|_| true),
                Ok(Event::Signal(_)) => continue,
                Err(RecvTimeoutError::Timeout) => return Ok(false),
                Err(RecvTimeoutError::Disconnected) => return self.finish(Ok(())).map(|_| true),
            }
        }
    }

    /// Unmount and wait for the session to end. While a process has a file open or its
    /// working directory inside, this fails with [`ErrorKind::Conflict`] and the mount stays
    /// served; try again once they let go (dropping the handle detaches it lazily instead).
    pub fn unmount(&mut self) -> Result<()> {
        if self.ended {
            return Ok(());
        }
        if let Err(e) = umount_path(&self.mountpoint, false) {
            // EINVAL: already unmounted from outside; the session ends by itself.
            if e.raw_os_error() != Some(libc::EINVAL) {
                let shown = self.mountpoint.display().to_string();
                return Err(if e.raw_os_error() == Some(libc::EBUSY) {
                    Error::new(
                        ErrorKind::Conflict,
                        format!(
                            "cannot unmount {shown}: it is busy (a process has a file open or \
                             its working directory inside); close them and try again, or \
                             detach it with `umount -l {shown}`"
                        ),
                    )
                } else {
                    Error::io("unmounting", &shown, e)
                });
            }
        }
        if !self.wait_ended(Duration::from_secs(30))? {
            return Err(Error::new(
                ErrorKind::Io,
                format!(
                    "unmounted {} but the FUSE session did not end within 30 s",
                    self.mountpoint.display()
                ),
            ));
        }
        info!(mountpoint = %self.mountpoint.display(), "unmounted");
        Ok(())
    }

    /// Wait until the mount is unmounted from outside (`umount`, `fusermount3 -u`).
    pub fn wait(mut self) -> Result<()> {
        while !self.wait_ended(Duration::from_secs(3600))? {}
        Ok(())
    }

    /// Serve until unmounted from outside (`umount`), or until SIGINT or SIGTERM, which
    /// unmount (lazily if busy: the mount then goes when its last user lets go). A second
    /// signal stops serving at once.
    pub fn serve_until_signal(mut self) -> Result<()> {
        use tokio::signal::unix::{SignalKind, signal};
        let rt = self.runtime.as_ref().expect("runtime").handle().clone();
        let (mut int, mut term) = {
            let _g = rt.enter();
            let int = signal(SignalKind::interrupt())
                .map_err(|e| Error::io("listening for", &"SIGINT", e))?;
            let term = signal(SignalKind::terminate())
                .map_err(|e| Error::io("listening for", &"SIGTERM", e))?;
            (int, term)
        };
        let tx = self.tx.clone();
        rt.spawn(async move {
            loop {
                let sig = tokio::select! {
                    _ = int.recv() => "SIGINT",
                    _ = term.recv() => "SIGTERM",
                };
                if tx.send(Event::Signal(sig)).is_err() {
                    break;
                }
            }
        });
        let mut signals = 0;
        loop {
            let ev = self.events.lock().recv();
            match ev {
                Ok(Event::Ended(r)) => {
                    info!(mountpoint = %self.mountpoint.display(), "unmounted");
                    return self.finish(r);
                }
                Ok(Event::Signal(sig)) => {
                    signals += 1;
                    let shown = self.mountpoint.display().to_string();
                    if signals == 1 {
                        info!("{sig}: unmounting {shown}");
                        match umount_path(&self.mountpoint, false) {
                            Ok(()) => {}
                            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                            Err(e) => {
                                warn!(
                                    "{shown} is busy ({e}): detached it; it goes away when the \
                                     last process using it lets go. Signal again to stop serving now"
                                );
                                let _ = umount_path(&self.mountpoint, true);
                            }
                        }
                    } else {
                        warn!("{sig} again: stopping the FUSE session at {shown} now");
                        self.abort();
                        let _ = self.wait_ended(Duration::from_secs(5));
                        return Ok(());
                    }
                }
                Err(_) => return self.finish(Ok(())),
            }
        }
    }

    /// Abort the FUSE connection (processes still using the mount get ENOTCONN).
    fn abort(&self) {
        if let Some(c) = self.conn {
            let p = format!("/sys/fs/fuse/connections/{c}/abort");
            if let Err(e) = std::fs::write(&p, b"1") {
                warn!("could not abort the FUSE connection through {p}: {e}");
            }
        }
    }
}

impl Drop for MountHandle {
    fn drop(&mut self) {
        if !self.ended {
            if let Err(e) = umount_path(&self.mountpoint, false)
                && e.raw_os_error() != Some(libc::EINVAL)
            {
                warn!(
                    "unmounting {}: {e}; detaching it lazily",
                    self.mountpoint.display()
                );
                let _ = umount_path(&self.mountpoint, true);
            }
            let _ = self.wait_ended(Duration::from_secs(10));
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mountinfo(r"/tmp/a\040b"), "/tmp/a b");
        assert_eq!(unescape_mountinfo(r"/x\134y"), r"/x\y");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert!(mounted_at(Path::new("/")).is_some());
        assert!(connection_of(Path::new("/")).is_some());
    }

    #[test]
    fn missing_dev_fuse_says_what_to_install() {
        let e = check_dev_fuse(Path::new("/nonexistent/fuse"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("modprobe fuse") && e.contains("fuse3"), "{e}");
    }

    #[test]
    fn mountpoint_problems_are_named() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("nope");
        let e = preflight(&missing).unwrap_err().to_string();
        assert!(
            e.contains("does not exist") && e.contains("mkdir -p"),
            "{e}"
        );
        let file = d.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = preflight(&file).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
        let e = preflight(d.path()).unwrap_err().to_string();
        assert!(e.contains("not empty"), "{e}");
        let e = preflight(Path::new("/proc")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Conflict);
        assert!(e.to_string().contains("already mounted"), "{e}");
    }
}
