//! Heartbeats from ranks to the supervisor over a Unix datagram socket.
//!
//! A rank sends a beat after every step (its step and the partial sums of its loss, so the
//! supervisor can log the exact global loss) and, from a background thread, every
//! `interval` in between, so a long step is not mistaken for a dead rank. A process stopped
//! with SIGSTOP sends nothing (its threads are stopped too): a missed heartbeat. A training
//! loop that hangs keeps beating without progress: a hang.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::rank_env::RankEnv;

/// One heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Beat {
    /// Generation.
    pub g: u64,
    /// Rank.
    pub r: u32,
    /// Last step completed (0 before the first).
    pub s: u64,
    /// Partial sum of squared errors of step `s` (fixed point, decimal string).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sse: Option<String>,
    /// Partial sum of squared gradients (fixed point, decimal string).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gsq: Option<String>,
    /// Elements in the partial sums.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u64>,
}

/// The rank side.
#[derive(Debug)]
pub struct HeartbeatClient {
    sock: Arc<UnixDatagram>,
    path: PathBuf,
    generation: u64,
    rank: u32,
    step: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl HeartbeatClient {
    /// A client for the supervisor at `path`, beating every `interval` from a thread.
    pub fn connect(
        path: &Path,
        generation: u64,
        rank: u32,
        interval: Duration,
    ) -> std::io::Result<Self> {
        Self::connect_watching(path, generation, rank, interval, None)
    }

    /// [`HeartbeatClient::connect`], and with `supervisor`, end this process (exit status
    /// 137, as if killed) as soon as that process is gone or this one's parent changes (the
    /// parent died: a supervisor, or a wrapper between it and the rank): a rank never outlives
    /// its supervisor, even where the parent-death signal did not fire.
    pub fn connect_watching(
        path: &Path,
        generation: u64,
        rank: u32,
        interval: Duration,
        supervisor: Option<u32>,
    ) -> std::io::Result<Self> {
        let parent = std::os::unix::process::parent_id();
        let sock = Arc::new(UnixDatagram::unbound()?);
        sock.set_nonblocking(true)?;
        let c = HeartbeatClient {
            sock,
            path: path.to_path_buf(),
            generation,
            rank,
            step: Arc::new(AtomicU64::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let (sock, path, step, stop) = (
            c.sock.clone(),
            c.path.clone(),
            c.step.clone(),
            c.stop.clone(),
        );
        std::thread::Builder::new()
            .name("ckpt-heartbeat".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(p) = supervisor
                        && (std::os::unix::process::parent_id() != parent || !alive(p))
                    {
                        eprintln!(
                            "ckpt: rank {rank} of generation {generation}: its supervisor \
                             (pid {p}) is gone; stopping so that it does not train on as an orphan"
                        );
                        std::process::exit(137);
                    }
                    let b = Beat {
                        g: generation,
                        r: rank,
                        s: step.load(Ordering::Relaxed),
                        sse: None,
                        gsq: None,
                        n: None,
                    };
                    if let Ok(bytes) = serde_json::to_vec(&b) {
                        let _ = sock.send_to(&bytes, &path);
                    }
                    // Beat every `interval`, watch the parent at least every 100 ms.
                    let t = std::time::Instant::now();
                    while t.elapsed() < interval && !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(interval.min(Duration::from_millis(100)));
                    }
                }
            })?;
        Ok(c)
    }

    /// The client a launched rank runs: beating to its driver's socket, and watching the
    /// driver's process (see [`HeartbeatClient::connect_watching`]).
    pub fn from_rank_env(env: &RankEnv) -> std::io::Result<Self> {
        Self::connect_watching(
            &env.heartbeat.socket,
            env.generation,
            env.rank,
            env.heartbeat.interval,
            Some(env.supervisor_pid),
        )
    }

    /// Report that `step` is complete, with the step's partial loss sums if known.
    pub fn step(&self, step: u64, partial: Option<(u128, u128, u64)>) {
        self.step.store(step, Ordering::Relaxed);
        let b = Beat {
            g: self.generation,
            r: self.rank,
            s: step,
            sse: partial.map(|p| p.0.to_string()),
            gsq: partial.map(|p| p.1.to_string()),
            n: partial.map(|p| p.2),
        };
        if let Ok(bytes) = serde_json::to_vec(&b) {
            let _ = self.sock.send_to(&bytes, &self.path);
        }
    }
}

/// Whether process `pid` exists (a signal 0 reaches it, or it exists but is not ours).
fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

impl Drop for HeartbeatClient {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beats_arrive_from_steps_and_the_thread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb.sock");
        let server = UnixDatagram::bind(&path).unwrap();
        server
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let c = HeartbeatClient::connect(&path, 3, 7, Duration::from_millis(20)).unwrap();
        c.step(5, Some((10, 40, 2)));
        let mut buf = [0u8; 512];
        let mut saw_partial = false;
        let mut saw_periodic = 0;
        for _ in 0..20 {
            let n = server.recv(&mut buf).unwrap();
            let b: Beat = serde_json::from_slice(&buf[..n]).unwrap();
            assert_eq!((b.g, b.r), (3, 7));
            if b.sse.as_deref() == Some("10") {
                saw_partial = true;
                assert_eq!(b.s, 5);
            } else {
                saw_periodic += 1;
            }
            if saw_partial && saw_periodic > 2 {
                break;
            }
        }
        assert!(saw_partial && saw_periodic > 2);
    }
}
