//! Creating files in directories other users may write to (an export's `--out`, a log
//! directory, `/tmp`) without ever following a link planted there.
//!
//! - New files are created with `O_CREAT | O_EXCL | O_NOFOLLOW`: whatever already exists at
//!   the name (a symlink, even a dangling one, a FIFO, a file) makes the open fail instead of
//!   becoming the target.
//! - A file meant to replace another ([`Replacing`]) is written under `.NAME.partial` beside
//!   it, synced and renamed over `NAME`. A leftover regular `.NAME.partial` (an interrupted
//!   write) is removed first; an existing `NAME` or `.NAME.partial` that is not a regular file
//!   is an error naming it, never a target. `rename(2)` replaces a link itself, not what it
//!   points to, so even a link planted between the check and the rename is harmless.
//! - A file opened for appending or truncating ([`open_regular`]) is opened with `O_NOFOLLOW`
//!   and checked to be a regular file before anything is written or truncated.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind as IoKind;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// What is at `path`, in words, when it is not a regular file (`None`: absent or regular).
fn non_regular(path: &Path) -> std::io::Result<Option<&'static str>> {
    match std::fs::symlink_metadata(path) {
        Ok(m) => {
            let t = m.file_type();
            Ok(if t.is_file() {
                None
            } else if t.is_symlink() {
                Some("a symbolic link")
            } else if t.is_dir() {
                Some("a directory")
            } else if t.is_fifo() {
                Some("a named pipe")
            } else if t.is_socket() {
                Some("a socket")
            } else {
                Some("a device or other special file")
            })
        }
        Err(e) if e.kind() == IoKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// `Ok` when nothing or a regular file is at `path` (not following a link); an error naming
/// what is there otherwise.
pub fn check_replaceable(path: &Path) -> std::io::Result<()> {
    match non_regular(path)? {
        None => Ok(()),
        Some(what) => Err(std::io::Error::new(
            IoKind::AlreadyExists,
            format!(
                "{} is {what}, not a regular file: refusing to write through it or replace it \
                 (remove it if it is yours)",
                path.display()
            ),
        )),
    }
}

/// Create `path` as a new regular file (`O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0644 less the
/// umask), with `flags` added (e.g. `O_DIRECT`). Fails if anything exists at `path`.
pub fn create_new(path: &Path, flags: i32) -> std::io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | flags)
        .open(path)
}

/// Open `path` for writing without following a link: created if absent (mode 0644 less the
/// umask), appended to when `append`, otherwise truncated. An existing link, directory, pipe
/// or device at `path` is an error naming it (checked before anything is truncated; a pipe is
/// never opened, so this never blocks).
pub fn open_regular(path: &Path, append: bool) -> std::io::Result<File> {
    check_replaceable(path)?;
    let mut o = OpenOptions::new();
    o.write(true)
        .create(true)
        .mode(0o644)
        // O_NONBLOCK: a pipe swapped in after the check fails to open instead of blocking.
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK);
    if append {
        o.append(true);
    }
    let f = o.open(path).map_err(|e| explain(path, e))?;
    if !f.metadata()?.file_type().is_file() {
        return Err(std::io::Error::new(
            IoKind::AlreadyExists,
            format!(
                "{} is not a regular file: refusing to write to it",
                path.display()
            ),
        ));
    }
    clear_nonblock(&f)?;
    if !append {
        f.set_len(0)?;
    }
    Ok(f)
}

fn clear_nonblock(f: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    // SAFETY: fcntl on a file descriptor this function's caller owns.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `ELOOP` from `O_NOFOLLOW` says "too many levels of symbolic links"; say what happened.
fn explain(path: &Path, e: std::io::Error) -> std::io::Error {
    if e.raw_os_error() == Some(libc::ELOOP) {
        std::io::Error::new(
            IoKind::AlreadyExists,
            format!(
                "{} is a symbolic link: refusing to write through it",
                path.display()
            ),
        )
    } else {
        e
    }
}

/// Create a new file in `dir` named `PREFIX[-N]SUFFIX` (the first free `N`), never following
/// or reusing anything already there; for files in shared directories such as `/tmp`.
pub fn create_unique(dir: &Path, prefix: &str, suffix: &str) -> std::io::Result<(File, PathBuf)> {
    for n in 0..10_000u32 {
        let name = if n == 0 {
            format!("{prefix}{suffix}")
        } else {
            format!("{prefix}-{n}{suffix}")
        };
        let p = dir.join(name);
        match create_new(&p, 0) {
            Ok(f) => return Ok((f, p)),
            Err(e) if e.kind() == IoKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::new(
        IoKind::AlreadyExists,
        format!(
            "{}: no free name {prefix}-N{suffix} in 10000 tries",
            dir.display()
        ),
    ))
}

/// A file being written under `.NAME.partial` that replaces `NAME` when [`Replacing::commit`]
/// is called (see the module docs). Dropped without a commit, the temporary file is removed.
#[derive(Debug)]
pub struct Replacing {
    target: PathBuf,
    tmp: PathBuf,
    done: bool,
}

impl Replacing {
    /// The temporary name of `target`: `.NAME.partial` in the same directory.
    pub fn temp_name(target: &Path) -> std::io::Result<PathBuf> {
        let name = target.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
            std::io::Error::new(
                IoKind::InvalidInput,
                format!("{} does not name a file", target.display()),
            )
        })?;
        Ok(target
            .parent()
            .unwrap_or(Path::new("."))
            .join(format!(".{name}.partial")))
    }

    /// Start replacing `target`: refuse a non-regular file at `target` or at its temporary
    /// name, remove a leftover regular temporary file, and create the temporary file afresh
    /// (`O_EXCL | O_NOFOLLOW`, with `flags` added, e.g. `O_DIRECT`).
    pub fn start(target: &Path, flags: i32) -> std::io::Result<(Self, File)> {
        let tmp = Self::temp_name(target)?;
        check_replaceable(target)?;
        check_replaceable(&tmp)?;
        match std::fs::remove_file(&tmp) {
            Ok(()) => {}
            Err(e) if e.kind() == IoKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let f = create_new(&tmp, flags).map_err(|e| {
            if e.kind() == IoKind::AlreadyExists {
                std::io::Error::new(
                    IoKind::AlreadyExists,
                    format!(
                        "{} appeared while it was being created: another writer is in the same directory",
                        tmp.display()
                    ),
                )
            } else {
                e
            }
        })?;
        Ok((
            Replacing {
                target: target.to_path_buf(),
                tmp,
                done: false,
            },
            f,
        ))
    }

    /// The temporary file's path.
    pub fn temp_path(&self) -> &Path {
        &self.tmp
    }

    /// Sync `file` (the one [`Replacing::start`] returned, finished) and rename it over the
    /// target; a non-regular file that appeared at the target is refused.
    pub fn commit(mut self, file: File) -> std::io::Result<()> {
        file.sync_all()?;
        drop(file);
        check_replaceable(&self.target)?;
        std::fs::rename(&self.tmp, &self.target)?;
        self.done = true;
        Ok(())
    }
}

impl Drop for Replacing {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Write `bytes` to `target` through [`Replacing`] (a temporary file, synced and renamed).
pub fn write_replacing(target: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let (r, mut f) = Replacing::start(target, 0)?;
    f.write_all(bytes)?;
    r.commit(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn planted_links_are_refused_and_their_targets_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let out = dir.path().join("plot.png");

        // A link at the target name.
        symlink(&victim, &out).unwrap();
        let e = write_replacing(&out, b"new").unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(e.to_string().contains("plot.png"), "{e}");
        let e = open_regular(&out, true).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let e = open_regular(&out, false).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let e = create_new(&out, 0).unwrap_err();
        assert_eq!(e.kind(), IoKind::AlreadyExists);
        std::fs::remove_file(&out).unwrap();

        // A link (dangling, then live) at the temporary name.
        let tmp = Replacing::temp_name(&out).unwrap();
        symlink(outside.path().join("nothing-yet"), &tmp).unwrap();
        let e = write_replacing(&out, b"new").unwrap_err();
        assert!(e.to_string().contains(".plot.png.partial"), "{e}");
        assert!(!outside.path().join("nothing-yet").exists());
        std::fs::remove_file(&tmp).unwrap();
        symlink(&victim, &tmp).unwrap();
        assert!(write_replacing(&out, b"new").is_err());
        std::fs::remove_file(&tmp).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(!out.exists());

        // A named pipe is refused, without blocking.
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let e = open_regular(&fifo, false).unwrap_err();
        assert!(e.to_string().contains("named pipe"), "{e}");
        assert!(write_replacing(&fifo, b"x").is_err());

        // Regular files are written, replaced, appended to; a leftover temporary is replaced.
        std::fs::write(&tmp, b"leftover").unwrap();
        write_replacing(&out, b"one").unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"one");
        assert!(!tmp.exists());
        write_replacing(&out, b"two").unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"two");
        {
            use std::io::Write;
            open_regular(&out, true).unwrap().write_all(b"+").unwrap();
        }
        assert_eq!(std::fs::read(&out).unwrap(), b"two+");
        open_regular(&out, false).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"");
    }

    #[test]
    fn unique_names_skip_whatever_is_there() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        symlink(&victim, dir.path().join("ckpt-mount-7.log")).unwrap();
        let (_f, p) = create_unique(dir.path(), "ckpt-mount-7", ".log").unwrap();
        assert_eq!(p, dir.path().join("ckpt-mount-7-1.log"));
        assert!(std::fs::symlink_metadata(&p).unwrap().file_type().is_file());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }
}
