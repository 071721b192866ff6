//! `ckpt mount MOUNTPOINT [--cache-size SIZE] [--foreground]`: the store read-only through
//! FUSE (see `ckpt-fuse`). Without `--foreground`, `ckpt` starts itself again in the
//! background with `--foreground`, waits until the mount is there (or the child failed) and
//! returns.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ckpt_store::Store;

use super::shared::parse::size;
use super::{CliError, Result, Ui};

/// Arguments of `ckpt mount`.
#[derive(Debug, Clone, clap::Args)]
pub struct MountArgs {
    /// An empty directory to mount on.
    pub mountpoint: PathBuf,
    /// Bytes of decoded chunks to keep in memory.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = size)]
    pub cache_size: u64,
    /// Stay in the foreground until unmounted (Ctrl-C or `fusermount3 -u` unmounts).
    #[arg(long)]
    pub foreground: bool,
    /// Let other users read the mount (needs user_allow_other in /etc/fuse.conf).
    #[arg(long)]
    pub allow_other: bool,
}

/// How long a background mount may take to appear.
const MOUNT_WAIT: Duration = Duration::from_secs(20);

/// Mount the store (blocking in the foreground, or detached in the background).
pub fn mount(store: Store, url: Option<&str>, args: &MountArgs, ui: &Ui) -> Result<()> {
    if !args.mountpoint.is_dir() {
        return Err(CliError::usage(format!(
            "mount point {} is not a directory",
            args.mountpoint.display()
        )));
    }
    if args.foreground {
        let opts = ckpt_fuse::MountOptions {
            mountpoint: args.mountpoint.clone(),
            cache_bytes: args.cache_size,
            allow_other: args.allow_other,
        };
        return ckpt_fuse::mount_blocking(store, &opts).map_err(CliError::from);
    }
    drop(store);
    background(url, args, ui)
}

fn background(url: Option<&str>, args: &MountArgs, ui: &Ui) -> Result<()> {
    let exe = std::env::current_exe()
        .map_err(|e| CliError::error(format!("cannot find the ckpt binary to restart: {e}")))?;
    // The child's log goes to a file: it outlives this process, so a pipe would break.
    // A new file under a free name: the temporary directory is shared, and a link planted at
    // the name must not send the log anywhere else.
    let (log, log_path) = ckpt_store::outfile::create_unique(
        &std::env::temp_dir(),
        &format!("ckpt-mount-{}", std::process::id()),
        ".log",
    )
    .map_err(|e| {
        CliError::error(format!(
            "creating a log file in {}: {e}",
            std::env::temp_dir().display()
        ))
    })?;
    let mut cmd = Command::new(exe);
    cmd.arg("mount")
        .arg(&args.mountpoint)
        .arg("--foreground")
        .arg("--cache-size")
        .arg(args.cache_size.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        // Its own process group: Ctrl-C in this shell later does not unmount it.
        .process_group(0);
    if let Some(u) = url {
        cmd.arg("--store").arg(u);
    }
    if args.allow_other {
        cmd.arg("--allow-other");
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| CliError::error(format!("starting the background mount: {e}")))?;
    let pb = ui.spinner(format!("mounting at {}", args.mountpoint.display()));
    let t0 = Instant::now();
    while t0.elapsed() < MOUNT_WAIT {
        if let Ok(Some(status)) = child.try_wait() {
            pb.finish_and_clear();
            let err = std::fs::read_to_string(&log_path).unwrap_or_default();
            let _ = std::fs::remove_file(&log_path);
            let err = err.trim().trim_start_matches("error: ");
            return Err(CliError::error(format!(
                "mounting at {} failed ({status}): {err}",
                args.mountpoint.display()
            )));
        }
        if is_mounted(&args.mountpoint) {
            pb.finish_and_clear();
            return super::shared::output::line(format_args!(
                "mounted at {} (pid {}, log {}); unmount with `fusermount3 -u {}`",
                args.mountpoint.display(),
                child.id(),
                log_path.display(),
                args.mountpoint.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    pb.finish_and_clear();
    let _ = child.kill();
    let _ = child.wait();
    Err(CliError::error(format!(
        "the mount at {} did not appear within {} s; stopped it (its log: {}; try --foreground -v)",
        args.mountpoint.display(),
        MOUNT_WAIT.as_secs(),
        log_path.display()
    )))
}

/// Whether `dir` is a mount point (listed in /proc/self/mountinfo).
fn is_mounted(dir: &Path) -> bool {
    let Ok(canon) = dir.canonicalize() else {
        return false;
    };
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = canon.to_string_lossy();
    info.lines().any(|l| {
        l.split(' ')
            .nth(4)
            .is_some_and(|m| unescape_mount(m) == want)
    })
}

/// Mount points in mountinfo escape space, tab, newline and backslash as octal.
fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = b[i + 1..i + 4]
                .iter()
                .fold(0u32, |a, c| a * 8 + (c - b'0') as u32);
            out.push(v as u8);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mount("/mnt/a\\040b"), "/mnt/a b");
        assert_eq!(unescape_mount("/plain"), "/plain");
        assert!(is_mounted(Path::new("/")) || !Path::new("/proc/self/mountinfo").exists());
    }
}
