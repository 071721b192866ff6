//! [`ManagerConfig`]: the settings of a [`CheckpointManager`](super::CheckpointManager).

use std::time::Duration;

use ckpt_store::{Error, MismatchPolicy, Result};

use crate::governor::GovernorConfig;
use crate::interval::AutoInterval;
use crate::monitor::MonitorConfig;
use crate::save::CheckpointerConfig;

/// Settings of a [`CheckpointManager`](super::CheckpointManager).
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// The checkpointer's settings (run, rank, layout, staging, back-pressure).
    pub ckpt: CheckpointerConfig,
    /// Save every N steps.
    pub every_steps: Option<u64>,
    /// Save when this much time passed since the last save.
    pub every: Option<Duration>,
    /// Choose the interval from the measured cost of a save and the run's failure rate
    /// (Young/Daly, within bounds; [`crate::interval`]); replaces `every_steps` and `every`.
    pub auto_interval: Option<AutoInterval>,
    /// Keep the newest N committed steps.
    pub keep_last: Option<usize>,
    /// Keep steps that are multiples of K.
    pub keep_every: Option<u64>,
    /// Objects younger than this are never deleted by retention's sweep.
    pub retention_grace: Duration,
    /// Save a final checkpoint when SIGTERM arrives (preemption). A second SIGTERM ends the
    /// process at once (exit status 143) whatever the final checkpoint is doing.
    pub final_on_sigterm: bool,
    /// The most the final checkpoint (after SIGTERM) may take, persist and commit together;
    /// past it the save fails with an error naming what it waits for.
    pub final_deadline: Duration,
    /// Bytes in flight during a restore; also the size of the chunk cache that the ranks of
    /// one process share while they restore (see [`shared_restore_cache`](super::shared_restore_cache)).
    pub restore_budget: usize,
    /// A directory the ranks of this node share while they restore (see
    /// [`ckpt_store::NodeCache`]): each chunk is read from the store once per node. `None`:
    /// each rank reads the store itself.
    pub node_cache: Option<std::path::PathBuf>,
    /// How many of the job's rank processes run on this machine (a launcher's
    /// `LOCAL_WORLD_SIZE`). In a data-parallel layout without a node cache, the tensors every
    /// rank restores whole are read through the page cache, so that the node's other rank
    /// processes find them there and the disk serves them once. With `Some(1)` no other
    /// process will read them: they are read around the page cache (`O_DIRECT`) like the
    /// rest, which is faster for a rank alone (a cold local-tier restore measured 1.36-1.42x
    /// the disk's read through the page cache, 0.95-1.06x around it). `None`: unknown, read
    /// through it.
    pub node_processes: Option<u32>,
    /// Loss-spike monitoring and its action (default: off). The manager sees a loss only
    /// through [`CheckpointManager::observe`](super::CheckpointManager::observe).
    pub monitor: MonitorConfig,
    /// The step to resume from, exactly: what a supervisor chose (`ckpt resume` passes it to
    /// the ranks as `CKPT_RESUME_STEP`; the program's entry point reads it into this field).
    /// [`CheckpointManager::restore_latest`](super::CheckpointManager::restore_latest) restores it instead of the newest committed step,
    /// which may be one the supervisor found damaged. `None`: the newest committed step.
    pub resume_step: Option<u64>,
    /// The persist governor (see [`crate::governor`]): when the steps that run beside a
    /// persist are slower than its budget (default 10 %) than steps without one, it lowers
    /// the persist's rate (down to a floor, so time to durable stays bounded), and raises it
    /// again when they are not. The final checkpoint and every wait for a persist run at full
    /// speed. `None`: persists always run at full speed.
    pub persist_governor: Option<GovernorConfig>,
    /// What the committing rank does when a step's replicas disagree (the sentinel; how much
    /// of them each rank hashes is [`CheckpointerConfig::sdc_check`]): log a
    /// `replica_mismatch` event ([`MismatchPolicy::Warn`], the default) or also fail the
    /// next call ([`MismatchPolicy::Stop`]). [`MismatchPolicy::Rollback`] is a driver's
    /// (`ckpt resume`); a rank under it warns.
    pub on_replica_mismatch: MismatchPolicy,
    /// The sentinel's stale-state check: a trainable tensor
    /// ([`CheckpointManager::set_trainable`](super::CheckpointManager::set_trainable)) whose
    /// bytes stay the same over this many consecutive checkpoints is reported
    /// (`state_unchanged`). 2 by default; 0 or 1: off.
    pub stale_after: u32,
    /// A local tier (issue 28): saves persist and commit there at the node disk's speed, and
    /// the committing rank drains each step to the manager's store (the remote one) behind
    /// the training. `keep_last` and `keep_every` then apply to the remote store, the tier's
    /// own `keep_last` to the tier. `None` (the default): saves go to the store.
    pub local_tier: Option<super::LocalTier>,
    /// The job's all-gather, for a job of several machines (`node_ranks`, each with its own
    /// tier) that no driver resumes: [`CheckpointManager::restore_latest`](super::CheckpointManager::restore_latest)
    /// agrees through it with every other rank on the newest step that the store or every
    /// machine's tier holds, draining first a step a killed job left in the tiers only (see
    /// [`AllGather`](super::AllGather)). Every rank of the job then calls `restore_latest`.
    /// `None`: such a job resumes from the store's newest step.
    pub all_gather: Option<super::AllGather>,
}

impl ManagerConfig {
    /// Defaults around a checkpointer config.
    pub fn new(ckpt: CheckpointerConfig) -> Self {
        ManagerConfig {
            ckpt,
            every_steps: None,
            every: None,
            auto_interval: None,
            keep_last: None,
            keep_every: None,
            retention_grace: Duration::from_secs(3600),
            final_on_sigterm: true,
            final_deadline: Duration::from_secs(300),
            restore_budget: 256 << 20,
            node_cache: None,
            node_processes: None,
            monitor: MonitorConfig::default(),
            resume_step: None,
            persist_governor: Some(GovernorConfig::default()),
            on_replica_mismatch: MismatchPolicy::Warn,
            stale_after: 2,
            local_tier: None,
            all_gather: None,
        }
    }
}

impl ManagerConfig {
    /// Check the settings of the parts that have their own (monitor, automatic interval,
    /// persist governor).
    pub(crate) fn validate(&self) -> Result<()> {
        self.monitor
            .validate()
            .map_err(|e| Error::invalid(format!("monitor settings: {e}")))?;
        if let Some(a) = &self.auto_interval {
            a.validate()
                .map_err(|e| Error::invalid(format!("automatic checkpoint interval: {e}")))?;
        }
        if let Some(g) = &self.persist_governor {
            g.validate()
                .map_err(|e| Error::invalid(format!("persist governor: {e}")))?;
        }
        if let Some(r) = &self.ckpt.node_ranks {
            if self.local_tier.is_none() {
                return Err(Error::invalid(format!(
                    "node_ranks {r:?} names the ranks of one machine that commit in its own local \
                     tier, but no local tier is set: set one, or leave node_ranks out (every \
                     rank then commits on the store)"
                )));
            }
            if !r.contains(&self.ckpt.rank) {
                return Err(Error::invalid(format!(
                    "node_ranks {r:?} must list this rank ({}): the ranks of its machine",
                    self.ckpt.rank
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ManagerConfig {
        ManagerConfig::new(CheckpointerConfig::new(
            "r",
            0,
            "dp=1,tp=1,pp=1".parse().unwrap(),
        ))
    }

    #[test]
    fn defaults_are_valid() {
        let c = cfg();
        c.validate().unwrap();
        assert!(c.final_on_sigterm && c.persist_governor.is_some());
        assert_eq!(c.retention_grace, Duration::from_secs(3600));
    }

    #[test]
    fn each_part_checks_its_settings() {
        let mut c = cfg();
        c.auto_interval = Some(AutoInterval::new(0, 10, Duration::from_secs(1)));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("automatic checkpoint interval"), "{e}");
        let mut c = cfg();
        c.persist_governor = Some(GovernorConfig {
            budget: -1.0,
            ..Default::default()
        });
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("persist governor"), "{e}");
        let mut c = cfg();
        c.monitor.window = 0;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("monitor settings"), "{e}");
        let mut c = cfg();
        c.ckpt.node_ranks = Some(vec![0, 1]);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("no local tier is set"), "{e}");
        c.local_tier = Some(crate::LocalTier::new(ckpt_store::testing::memory_store(
            ckpt_store::testing::tiny_config(),
        )));
        c.validate().unwrap();
        c.ckpt.node_ranks = Some(vec![2, 3]);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("must list this rank (0)"), "{e}");
    }
}
