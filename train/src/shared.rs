//! What the rank threads of a run share ([`Shared`]: settings, the store, the metrics
//! outputs, the per-step board and decisions) and their per-step barrier ([`Lockstep`]).

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use ckpt_recovery::records::Metric;
use ckpt_recovery::{HeartbeatClient, RankEnv};
use ckpt_store::logs::LogWriter;
use ckpt_store::{Error, Layout, Result, Store};
use parking_lot::{Condvar, Mutex};
use tracing::warn;

use ckpt_trainer::monitor::Decision;
use ckpt_trainer::save::runtime;
use ckpt_trainer::staging::StagingPool;
use ckpt_trainer::workload::{ModelConfig, Partial};

use crate::{Outcome, TrainArgs};

pub(crate) struct Shared {
    pub(crate) generation: u64,
    /// What the driver that launched this process handed it (`None`: run by hand).
    pub(crate) launched: Option<RankEnv>,
    /// Under a driver, the heartbeat connected at start (its one rank takes it).
    pub(crate) heartbeat: Mutex<Option<HeartbeatClient>>,
    /// `--ckpt-every auto`: one schedule that every rank thread's manager follows.
    pub(crate) auto_interval: Option<ckpt_trainer::AutoInterval>,
    pub(crate) args: TrainArgs,
    pub(crate) store: Store,
    /// `--local-tier`: saves commit there and drain to `store`.
    pub(crate) local_tier: Option<Store>,
    pub(crate) layout: Layout,
    pub(crate) model: ModelConfig,
    pub(crate) world_threads: u32,
    pub(crate) barrier: Option<Lockstep>,
    /// The staging pool the rank threads share (with --staging).
    pub(crate) pool: Option<Arc<StagingPool>>,
    pub(crate) board: Mutex<std::collections::BTreeMap<u64, (Partial, u32)>>,
    /// Rank 0's monitor decision for the current step (threads mode).
    pub(crate) decision: Mutex<Decision>,
    /// A rank failed to roll back (threads mode: all then stop).
    pub(crate) rollback_failed: AtomicBool,
    /// Threads: why a newer generation fenced this job out, as any rank's checkpointer found
    /// it, and rank 0's copy of it for the current step (read by every rank after the second
    /// barrier, so all stop at the same step).
    pub(crate) fenced: Mutex<Option<String>>,
    pub(crate) fence_now: Mutex<Option<String>>,
    pub(crate) stop_now: AtomicBool,
    pub(crate) sigterm: Arc<AtomicBool>,
    pub(crate) metrics: Mutex<Option<std::fs::File>>,
    pub(crate) log: Mutex<Option<LogWriter>>,
    pub(crate) outcome: Mutex<Outcome>,
}

impl Shared {
    pub(crate) fn emit(&self, v: &Metric) {
        if let Some(f) = self.metrics.lock().as_mut()
            && let Ok(line) = serde_json::to_string(v)
        {
            let _ = writeln!(f, "{line}");
        }
        if let Some(l) = self.log.lock().as_mut() {
            let _ = l.append(v);
        }
    }

    pub(crate) fn flush_log(&self) {
        let taken = self.log.lock().take();
        if let Some(mut l) = taken {
            if let Err(e) = runtime().block_on(l.flush()) {
                warn!("writing metrics to the store: {e}");
            }
            *self.log.lock() = Some(l);
        }
    }
}

/// The rank threads' per-step barrier, which a failing rank breaks: the others then fail
/// too instead of waiting for it forever.
pub(crate) struct Lockstep {
    n: usize,
    /// (arrived in this round, round, why it was broken)
    state: Mutex<(usize, u64, Option<String>)>,
    cond: Condvar,
}

impl Lockstep {
    const ABORT: &'static str = "stopped because another rank failed";

    pub(crate) fn new(n: usize) -> Self {
        Lockstep {
            n,
            state: Mutex::new((0, 0, None)),
            cond: Condvar::new(),
        }
    }

    pub(crate) fn wait(&self) -> Result<()> {
        let mut g = self.state.lock();
        if let Some(why) = &g.2 {
            return Err(Error::internal(format!("{} ({why})", Self::ABORT)));
        }
        let round = g.1;
        g.0 += 1;
        if g.0 == self.n {
            g.0 = 0;
            g.1 += 1;
            self.cond.notify_all();
        }
        while g.1 == round && g.2.is_none() {
            self.cond.wait(&mut g);
        }
        match &g.2 {
            Some(why) if g.1 == round => Err(Error::internal(format!("{} ({why})", Self::ABORT))),
            _ => Ok(()),
        }
    }

    pub(crate) fn abort(&self, why: &str) {
        let mut g = self.state.lock();
        g.2.get_or_insert_with(|| why.to_string());
        self.cond.notify_all();
    }

    pub(crate) fn is_abort(e: &Error) -> bool {
        e.to_string().contains(Self::ABORT)
    }
}
