//! A rank's side of `ckpt resume` (and `ckpt agent`) for Python: the typed rank environment a
//! driver hands each rank it launches (`ckpt.resume_env()`, `ckpt.RankEnv`) and the heartbeat
//! client (`ckpt.Heartbeat`, `ckpt.beat`), thin layers over `ckpt_recovery`'s `RankEnv` and
//! `HeartbeatClient`. Outside a driver `resume_env()` is `None` and heartbeats cost nothing.

use std::sync::Arc;

use ckpt_recovery::heartbeat::Workload;
use ckpt_recovery::{HeartbeatClient, RankEnv};
use ckpt_store::Error;
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::err;

/// What a driver (`ckpt resume`, `ckpt agent`) handed this rank: the store and run, this rank
/// and the world, the generation, the step to restore, the rendezvous. `ckpt.resume_env()`
/// returns it (or None when no driver launched the process).
#[pyclass(module = "ckpt._native", name = "RankEnv", frozen)]
pub struct PyRankEnv {
    env: RankEnv,
}

#[pymethods]
impl PyRankEnv {
    /// The store's path or URL (`CKPT_STORE`).
    #[getter]
    fn store(&self) -> String {
        self.env.store.clone()
    }

    /// The run (`CKPT_RUN`).
    #[getter]
    fn run(&self) -> String {
        self.env.run.clone()
    }

    /// This rank (`RANK`).
    #[getter]
    fn rank(&self) -> u32 {
        self.env.rank
    }

    /// Ranks in the job (`WORLD_SIZE`).
    #[getter]
    fn world_size(&self) -> u32 {
        self.env.world_size
    }

    /// The rank on its node (`LOCAL_RANK`).
    #[getter]
    fn local_rank(&self) -> u32 {
        self.env.local_rank
    }

    /// Ranks per node (`LOCAL_WORLD_SIZE`).
    #[getter]
    fn local_world_size(&self) -> u32 {
        self.env.local_world_size
    }

    /// The node the rank runs on.
    #[getter]
    fn node(&self) -> u32 {
        self.env.node
    }

    /// How much of its replicas the rank hashes for the sentinel (`full`, `sample=F`, `off`),
    /// if the driver says (`ckpt resume --sdc-check`).
    #[getter]
    fn sdc_check(&self) -> Option<String> {
        self.env.sdc_check.map(|c| c.to_string())
    }

    /// The local tier under the store `ckpt resume --local-tier` gave (a directory or store
    /// URL), or `None`.
    #[getter]
    fn local_tier(&self) -> Option<String> {
        self.env.local_tier.clone()
    }

    /// The ranks of this machine, which share its local tier, when `ckpt agent --local-tier`
    /// runs the job on several machines (each has its own tier); else `None`.
    #[getter]
    fn local_tier_ranks(&self) -> Option<Vec<u32>> {
        self.env.local_tier_ranks.clone()
    }

    /// The layout, as `dp=..,tp=..,pp=..`.
    #[getter]
    fn layout(&self) -> String {
        self.env.layout.clone()
    }

    /// The generation this rank belongs to (a restart is a new one; older ones are fenced).
    #[getter]
    fn generation(&self) -> u64 {
        self.env.generation
    }

    /// Whether to resume from the store.
    #[getter]
    fn resume(&self) -> bool {
        self.env.resume
    }

    /// The committed step to restore, exactly, as the driver chose it (the newest whose
    /// objects are all present); None: start from scratch.
    #[getter]
    fn resume_step(&self) -> Option<u64> {
        self.env.resume_step
    }

    /// Whether the driver wants a final checkpoint on SIGTERM.
    #[getter]
    fn final_on_sigterm(&self) -> bool {
        self.env.final_on_sigterm
    }

    /// The launching driver's process id.
    #[getter]
    fn supervisor_pid(&self) -> u32 {
        self.env.supervisor_pid
    }

    /// The rendezvous host (`MASTER_ADDR`).
    #[getter]
    fn master_addr(&self) -> String {
        self.env.master.0.clone()
    }

    /// The rendezvous port (`MASTER_PORT`).
    #[getter]
    fn master_port(&self) -> u16 {
        self.env.master.1
    }

    /// The driver's heartbeat socket.
    #[getter]
    fn heartbeat_socket(&self) -> String {
        self.env.heartbeat.socket.display().to_string()
    }

    /// Seconds between the heartbeats the client sends on its own.
    #[getter]
    fn heartbeat_interval(&self) -> f64 {
        self.env.heartbeat.interval.as_secs_f64()
    }

    fn __repr__(&self) -> String {
        let e = &self.env;
        format!(
            "ckpt.RankEnv(store={:?}, run={:?}, rank={}, world_size={}, generation={}, resume_step={}, node={}, master={}:{})",
            e.store,
            e.run,
            e.rank,
            e.world_size,
            e.generation,
            e.resume_step.map_or("None".into(), |s| s.to_string()),
            e.node,
            e.master.0,
            e.master.1
        )
    }
}

/// The rank environment a driver (`ckpt resume`, `ckpt agent`) gave this process, or None
/// when none launched it. A variable missing or malformed raises `CkptError` naming it.
#[pyfunction]
pub fn resume_env() -> PyResult<Option<PyRankEnv>> {
    Ok(RankEnv::from_env()
        .map_err(err)?
        .map(|env| PyRankEnv { env }))
}

fn connect(py: Python<'_>, env: &RankEnv) -> PyResult<HeartbeatClient> {
    py.allow_threads(|| HeartbeatClient::from_rank_env(env))
        .map_err(|e| {
            Error::io(
                "connecting to the driver's heartbeat socket",
                &env.heartbeat.socket.display(),
                e,
            )
        })
        .map_err(err)
}

/// Beat `step` (with this rank's mean loss over `samples` samples, if given).
fn send(py: Python<'_>, client: &HeartbeatClient, step: u64, loss: Option<f64>, samples: u64) {
    let workload = loss.and_then(|l| Workload::loss(l * samples as f64, samples));
    py.allow_threads(|| client.step(step, workload));
}

/// The heartbeat of a rank under `ckpt resume`: from construction a thread beats every
/// interval the driver asked for (and ends the process if the driver is gone), and
/// `step(n, loss=...)` reports each completed step, so the driver sees progress (a rank whose
/// step stops advancing is hung) and logs the job's loss. Without a driver it does nothing.
/// Make it once training state is restored: the driver's start-up timeout covers the time
/// before it.
#[pyclass(module = "ckpt._native", frozen)]
pub struct Heartbeat {
    client: Option<HeartbeatClient>,
}

#[pymethods]
impl Heartbeat {
    /// A heartbeat for `env` (default: `resume_env()`; none: a heartbeat that does nothing).
    #[new]
    #[pyo3(signature = (env=None))]
    fn new(py: Python<'_>, env: Option<PyRef<'_, PyRankEnv>>) -> PyResult<Self> {
        let env = match env {
            Some(e) => Some(e.env.clone()),
            None => RankEnv::from_env().map_err(err)?,
        };
        let client = match env {
            Some(e) => Some(connect(py, &e)?),
            None => None,
        };
        Ok(Heartbeat { client })
    }

    /// Whether beats go to a driver (False: not launched by one, every call does nothing).
    #[getter]
    fn active(&self) -> bool {
        self.client.is_some()
    }

    /// Report that `step` is complete; with `loss`, this rank's mean loss over its `samples`
    /// samples of the step (non-negative; the driver logs the job's mean over every rank's
    /// samples once all ranks reported the step).
    #[pyo3(signature = (step, loss=None, samples=1))]
    fn step(&self, py: Python<'_>, step: u64, loss: Option<f64>, samples: u64) {
        if let Some(c) = &self.client {
            send(py, c, step, loss, samples);
        }
    }

    fn __repr__(&self) -> String {
        format!("ckpt.Heartbeat(active={})", self.client.is_some())
    }
}

/// The process's heartbeat, made by the first `beat`.
static PROCESS_BEAT: Mutex<Option<Arc<Option<HeartbeatClient>>>> = Mutex::new(None);

/// `Heartbeat.step` on the process's heartbeat, which the first call makes (from
/// `resume_env()`; a no-op without a driver).
#[pyfunction]
#[pyo3(signature = (step, loss=None, samples=1))]
pub fn beat(py: Python<'_>, step: u64, loss: Option<f64>, samples: u64) -> PyResult<()> {
    let existing = PROCESS_BEAT.lock().clone();
    let hb = match existing {
        Some(hb) => hb,
        None => {
            let client = match RankEnv::from_env().map_err(err)? {
                Some(e) => Some(connect(py, &e)?),
                None => None,
            };
            PROCESS_BEAT
                .lock()
                .get_or_insert_with(|| Arc::new(client))
                .clone()
        }
    };
    if let Some(c) = hb.as_ref() {
        send(py, c, step, loss, samples);
    }
    Ok(())
}
