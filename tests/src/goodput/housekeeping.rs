//! The operator's `ckpt gc` beside a policy's job.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Options, RUN};
use crate::bin;

/// The operator's `ckpt gc` beside a policy's job, one at a time, every
/// [`Options::gc_every`]; each run's output appended to `gc.log` in the policy's directory.
pub(super) struct Housekeeping {
    every: Option<Duration>,
    cmd: Vec<String>,
    log: PathBuf,
    running: Option<Child>,
    last: Instant,
    started: u32,
    failed: u32,
}

impl Housekeeping {
    pub(super) fn new(opts: &Options, store: &Path, dir: &Path) -> Housekeeping {
        let keep = opts.keep_last.unwrap_or(0);
        Housekeeping {
            every: opts.gc_every.filter(|_| opts.keep_last.is_some()),
            cmd: vec![
                "--store".into(),
                store.display().to_string(),
                "--json".into(),
                "gc".into(),
                "--run".into(),
                RUN.into(),
                "--keep-last".into(),
                keep.to_string(),
                "--grace".into(),
                "60s".into(),
                // A killed rank's lease stops deferring sweeps after a minute (its saves take
                // seconds), as the grace did before the two were told apart.
                "--lease-lapse".into(),
                "60s".into(),
                "--no-progress".into(),
            ],
            log: dir.join("gc.log"),
            running: None,
            last: Instant::now(),
            started: 0,
            failed: 0,
        }
    }

    /// Reap a finished run; start the next one when due.
    pub(super) fn poll(&mut self) {
        if let Some(c) = self.running.as_mut()
            && let Ok(Some(st)) = c.try_wait()
        {
            self.failed += u32::from(!st.success());
            self.running = None;
        }
        let Some(every) = self.every else { return };
        if self.running.is_some() || self.last.elapsed() < every {
            return;
        }
        self.last = Instant::now();
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log);
        let Ok(out) = out else {
            self.failed += 1;
            return;
        };
        let err = out.try_clone();
        let mut c = Command::new(bin("ckpt", "ckpt"));
        c.args(&self.cmd)
            .env("CKPT_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(out);
        if let Ok(e) = err {
            c.stderr(e);
        }
        match c.spawn() {
            Ok(child) => {
                self.started += 1;
                self.running = Some(child);
            }
            Err(_) => self.failed += 1,
        }
    }

    /// Wait for the run in flight (a sweep between its delete batches stops within seconds
    /// of a kill) and return (started, failed).
    pub(super) fn finish(mut self) -> (u32, u32) {
        if let Some(mut c) = self.running.take() {
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(30) {
                if let Ok(Some(st)) = c.try_wait() {
                    self.failed += u32::from(!st.success());
                    return (self.started, self.failed);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = c.kill();
            let _ = c.wait();
            self.failed += 1;
        }
        (self.started, self.failed)
    }
}
