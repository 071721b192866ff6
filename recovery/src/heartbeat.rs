//! Heartbeats from ranks to the supervisor over a Unix datagram socket.
//!
//! A rank sends a beat after every step (its step and what its workload reports of it, such as
//! the partial sums of its loss, so the driver can log the exact global loss) and, from a background thread, every
//! `interval` in between, so a long step is not mistaken for a dead rank. A process stopped
//! with SIGSTOP sends nothing (its threads are stopped too): a missed heartbeat. A training
//! loop that hangs keeps beating without progress: a hang.
//!
//! A rank can connect before it has a step to report ([`HeartbeatClient::starting_from_rank_env`]):
//! until its first [`HeartbeatClient::step`] its thread's beats say `starting` (alive, still
//! opening the store and restoring). The driver then tells a rank stopped or gone during its
//! restore by its missed beats within the heartbeat timeout, and one that beats but never
//! reports a step by its start-up timeout.

use std::collections::BTreeMap;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::records::Curve;
use serde::{Deserialize, Serialize};

use crate::rank_env::RankEnv;

/// One heartbeat: a rank's progress, and with a completed step what its workload reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Beat {
    /// Generation.
    pub generation: u64,
    /// Rank.
    pub rank: u32,
    /// Last step completed (0 before the first).
    pub step: u64,
    /// What the workload reports with step `step` (a beat after a step, not one in between).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<Workload>,
    /// The rank is alive but has no step to report yet (starting, restoring): `step` means
    /// nothing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub starting: bool,
}

/// Sums a [`Workload`] carries at most (more: the payload is ignored).
pub const MAX_SUMS: usize = 16;
/// Figures a [`Workload`] carries at most.
pub const MAX_FIGURES: usize = 8;

/// What a workload reports with a completed step, opaque to the driver: named integer sums of
/// this rank's part, which the driver totals over the ranks of the step exactly (integers, so
/// the total does not depend on the order the beats arrive in), and the figures the driver
/// derives from the totals for the step's `metrics` record. The driver knows neither the sums'
/// names nor their scale; the reference workload sends `sse`, `gsq`, `n` with scale 2^40.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// Name to value: non-negative integers as decimal strings (a `u128` is not a JSON
    /// number every reader takes).
    pub sums: BTreeMap<String, String>,
    /// What to derive from the totals.
    pub figures: Vec<Figure>,
}

/// A figure of a step's record derived from the job's totals:
/// `total[sum] / scale / max(total[per], 1)`, then its square root if `sqrt`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figure {
    /// The curve of the step record it fills.
    pub curve: Curve,
    /// The sum divided.
    pub sum: String,
    /// The sum it is divided by (a count), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per: Option<String>,
    /// The fixed-point scale of `sum`.
    pub scale: f64,
    /// Take the square root.
    #[serde(default)]
    pub sqrt: bool,
}

impl Figure {
    /// The figure's value over `totals`, or `None` when its sums are missing or its scale is
    /// not a positive number.
    pub fn value(&self, totals: &BTreeMap<String, u128>) -> Option<f64> {
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return None;
        }
        let mut v = *totals.get(&self.sum)? as f64 / self.scale;
        if let Some(p) = &self.per {
            v /= (*totals.get(p)?).max(1) as f64;
        }
        if self.sqrt {
            v = v.sqrt();
        }
        Some(v)
    }
}

/// The fixed-point scale of the loss sum [`Workload::loss`] reports (as `ckpt-train`'s).
pub const LOSS_SUM_SCALE: f64 = (1u64 << 40) as f64;

impl Workload {
    /// What a rank reports of a step whose loss summed over its `samples` samples is `sum`:
    /// the driver logs the job's mean loss (the sums' total over the samples' total) once
    /// every rank's part of the step has arrived. For workloads that know only their loss
    /// (such as a PyTorch script beating through `ckpt.Heartbeat`). `None` when `sum` is
    /// negative, not finite, or beyond the fixed-point range (the beat then goes without it).
    pub fn loss(sum: f64, samples: u64) -> Option<Workload> {
        let fixed = sum * LOSS_SUM_SCALE;
        if !(fixed.is_finite() && fixed >= 0.0 && fixed < u128::MAX as f64) {
            return None;
        }
        Some(Workload {
            sums: [
                ("loss_sum".to_string(), (fixed.round() as u128).to_string()),
                ("samples".to_string(), samples.to_string()),
            ]
            .into(),
            figures: vec![Figure {
                curve: Curve::Loss,
                sum: "loss_sum".into(),
                per: Some("samples".into()),
                scale: LOSS_SUM_SCALE,
                sqrt: false,
            }],
        })
    }

    /// The sums as integers; `None` when the payload is over the bounds ([`MAX_SUMS`],
    /// [`MAX_FIGURES`]) or a sum is not a non-negative integer.
    pub fn parsed_sums(&self) -> Option<BTreeMap<String, u128>> {
        if self.sums.len() > MAX_SUMS || self.figures.len() > MAX_FIGURES {
            return None;
        }
        self.sums
            .iter()
            .map(|(k, v)| Some((k.clone(), v.parse::<u128>().ok()?)))
            .collect()
    }
}

/// The rank side.
#[derive(Debug)]
pub struct HeartbeatClient {
    sock: Arc<UnixDatagram>,
    path: PathBuf,
    generation: u64,
    rank: u32,
    step: Arc<AtomicU64>,
    /// Whether a step was reported (before it, the thread's beats are `starting`).
    started: Arc<AtomicBool>,
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
        Self::spawn(path, generation, rank, interval, supervisor, true)
    }

    fn spawn(
        path: &Path,
        generation: u64,
        rank: u32,
        interval: Duration,
        supervisor: Option<u32>,
        started: bool,
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
            started: Arc::new(AtomicBool::new(started)),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let (sock, path, step, started, stop) = (
            c.sock.clone(),
            c.path.clone(),
            c.step.clone(),
            c.started.clone(),
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
                        generation,
                        rank,
                        step: step.load(Ordering::Relaxed),
                        workload: None,
                        starting: !started.load(Ordering::Acquire),
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

    /// [`HeartbeatClient::from_rank_env`] for a rank that connects first thing, before it
    /// opens the store and restores: its beats say `starting` until its first
    /// [`HeartbeatClient::step`] (the step it resumed from), so the driver detects a rank
    /// stopped or killed during its restore within the heartbeat timeout, not the start-up
    /// timeout.
    pub fn starting_from_rank_env(env: &RankEnv) -> std::io::Result<Self> {
        Self::spawn(
            &env.heartbeat.socket,
            env.generation,
            env.rank,
            env.heartbeat.interval,
            Some(env.supervisor_pid),
            false,
        )
    }

    /// Report that `step` is complete, with what the workload reports of it, if anything.
    pub fn step(&self, step: u64, workload: Option<Workload>) {
        self.step.store(step, Ordering::Relaxed);
        self.started.store(true, Ordering::Release);
        let b = Beat {
            generation: self.generation,
            rank: self.rank,
            step,
            workload,
            starting: false,
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
    fn a_loss_report_totals_to_the_mean_over_every_ranks_samples() {
        let a = Workload::loss(2.5 * 3.0, 3).unwrap();
        let b = Workload::loss(1.5 * 5.0, 5).unwrap();
        let mut totals: BTreeMap<String, u128> = BTreeMap::new();
        for w in [&a, &b] {
            for (k, v) in w.parsed_sums().unwrap() {
                *totals.entry(k).or_default() += v;
            }
        }
        let v = a.figures[0].value(&totals).unwrap();
        assert_eq!(v, (2.5 * 3.0 + 1.5 * 5.0) / 8.0);
        assert_eq!(a.figures[0].curve, Curve::Loss);
        for bad in [-1.0, f64::NAN, f64::INFINITY, 1e300] {
            assert_eq!(Workload::loss(bad, 1), None, "{bad}");
        }
        // A beat carrying it stays within a datagram and reads back.
        let beat = Beat {
            generation: 1,
            rank: 0,
            step: 9,
            workload: Some(a.clone()),
            starting: false,
        };
        let back: Beat = serde_json::from_slice(&serde_json::to_vec(&beat).unwrap()).unwrap();
        assert_eq!(back.workload, Some(a));
    }

    /// A driver's socket at `hb.sock` in a fresh folder (kept while the folder lives).
    fn listening() -> (tempfile::TempDir, UnixDatagram) {
        let dir = tempfile::tempdir().unwrap();
        let server = UnixDatagram::bind(dir.path().join("hb.sock")).unwrap();
        server
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        (dir, server)
    }

    #[test]
    fn beats_arrive_from_steps_and_the_thread() {
        let (dir, server) = listening();
        let path = dir.path().join("hb.sock");
        let c = HeartbeatClient::connect(&path, 3, 7, Duration::from_millis(20)).unwrap();
        let w = Workload {
            sums: [("a".to_string(), "10".to_string())].into(),
            figures: Vec::new(),
        };
        c.step(5, Some(w.clone()));
        let mut buf = [0u8; 512];
        let mut saw_partial = false;
        let mut saw_periodic = 0;
        for _ in 0..20 {
            let n = server.recv(&mut buf).unwrap();
            let b: Beat = serde_json::from_slice(&buf[..n]).unwrap();
            assert_eq!((b.generation, b.rank), (3, 7));
            if b.workload.as_ref() == Some(&w) {
                saw_partial = true;
                assert_eq!(b.step, 5);
            } else {
                saw_periodic += 1;
            }
            if saw_partial && saw_periodic > 2 {
                break;
            }
        }
        assert!(saw_partial && saw_periodic > 2);
    }

    #[test]
    fn a_starting_client_beats_starting_until_its_first_step() {
        let (dir, server) = listening();
        let path = dir.path().join("hb.sock");
        let c =
            HeartbeatClient::spawn(&path, 2, 1, Duration::from_millis(10), None, false).unwrap();
        let mut buf = [0u8; 512];
        let mut recv = || -> Beat {
            let n = server.recv(&mut buf).unwrap();
            serde_json::from_slice(&buf[..n]).unwrap()
        };
        for _ in 0..3 {
            let b = recv();
            assert!(b.starting, "{b:?}");
            assert_eq!((b.generation, b.rank), (2, 1));
        }
        c.step(40, None);
        // Beats already in flight may still say starting; the step's beat and every one the
        // thread sends after it do not. (The thread may have read its state just before the
        // step and send that one beat after the step's own: one, never more.)
        let mut after = 0;
        let mut saw_step = false;
        let mut late = 0;
        for _ in 0..50 {
            let b = recv();
            if !saw_step {
                saw_step = !b.starting && b.step == 40;
                continue;
            }
            if after == 0 && late == 0 && (b.starting || b.step != 40) {
                late += 1;
                continue;
            }
            assert!(
                !b.starting,
                "a beat after the first step says starting: {b:?}"
            );
            assert_eq!(b.step, 40);
            after += 1;
            if after == 3 {
                break;
            }
        }
        assert_eq!(after, 3, "the thread kept beating after the step");
        // An old beat (no field) reads as not starting.
        let old: Beat = serde_json::from_str(r#"{"generation":1,"rank":0,"step":3}"#).unwrap();
        assert!(!old.starting);
    }
}
