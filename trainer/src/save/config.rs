//! The settings of a [`Checkpointer`](super::Checkpointer): [`CheckpointerConfig`], the
//! [`BackPressure`] policy and [`SnapshotOverlap`].

use std::sync::Arc;
use std::time::Duration;

use ckpt_recovery::peer::PeerLink;
use ckpt_store::{Layout, SdcCheck};
use serde::Serialize;

use crate::staging::StagingPool;

/// What to do when a save is asked for while the previous one is still persisting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackPressure {
    /// Wait for the previous save to be persisted, then snapshot.
    Wait,
    /// Skip this save (logged with the reason).
    Skip,
}
/// When a save's persist (hashing, encoding, writing) starts: after its snapshot has copied
/// everything into staging, or with the copy, taking each chunk as it lands.
///
/// Overlapping them makes a step durable sooner by up to the copy's time, and costs the copy
/// whatever CPU the persist's hashing takes from it. A copy out of GPU memory is a DMA the
/// cores only wait for, so the overlap is free there; a copy out of host memory is the
/// cores' own work, and on a machine with few of them a persist beside it lengthens the
/// stall the training loop waits for (measured on 2 cores: about twice as long).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotOverlap {
    /// Overlap when nearly all (nine tenths) of the snapshot's bytes are copied by DMA
    /// (device tensors), else start the persist after the copy: a host part of any size
    /// (optimizer state offloaded to the CPU) is the cores' own copy. The default.
    #[default]
    Auto,
    /// Always start the persist with the copy.
    Always,
    /// Start the persist when the copy is done (or when it must wait for staging space).
    Never,
}

impl SnapshotOverlap {
    /// Whether a snapshot of `dma_bytes` copied by DMA out of `bytes` overlaps its persist.
    pub fn overlaps(self, dma_bytes: u64, bytes: u64) -> bool {
        match self {
            SnapshotOverlap::Always => true,
            SnapshotOverlap::Never => false,
            SnapshotOverlap::Auto => dma_bytes > 0 && 10 * dma_bytes >= 9 * bytes,
        }
    }
}

impl std::str::FromStr for SnapshotOverlap {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "auto" => Ok(SnapshotOverlap::Auto),
            "always" => Ok(SnapshotOverlap::Always),
            "never" => Ok(SnapshotOverlap::Never),
            _ => Err(format!(
                "snapshot overlap {s:?}: expected auto, always or never"
            )),
        }
    }
}

/// Settings of a [`Checkpointer`].
#[derive(Debug, Clone)]
pub struct CheckpointerConfig {
    /// Run name.
    pub run: String,
    /// This rank.
    pub rank: u32,
    /// The layout.
    pub layout: Layout,
    /// The job generation (bumped by every restart).
    pub generation: u64,
    /// Whether this rank commits (rank 0 by default).
    pub committer: bool,
    /// Bound on staging memory (bytes); 0 = as much as one snapshot needs (the pool grows to
    /// the size of the first snapshot and stays there). Any bound works, down to one chunk: a
    /// smaller pool makes the snapshot wait for the persist of earlier chunks.
    pub staging_bytes: usize,
    /// A staging pool shared with other checkpointers of this process (ranks as threads);
    /// its bound replaces `staging_bytes`. `None`: this checkpointer's own pool.
    pub pool: Option<Arc<StagingPool>>,
    /// How long a snapshot waits for staging space while no slab comes back to the pool
    /// before the save fails (the persist is stuck); see [`StagingPool::acquire_many`].
    pub stall_timeout: Duration,
    /// Allocate and touch all staging memory up front.
    pub prefault: bool,
    /// Without `prefault`: allocate and touch the staging memory on a background thread of
    /// the lowest CPU priority from the moment its size is known (a `staging_bytes` bound at
    /// creation, or [`Checkpointer::prepare_staging`](super::Checkpointer::prepare_staging)),
    /// so the first save does not pay for fresh memory. On by default.
    pub background_prefault: bool,
    /// Threads copying into staging.
    pub copy_threads: usize,
    /// When the persist starts: with the snapshot's copy or after it ([`SnapshotOverlap`];
    /// `Auto` by default: with it when the copy is out of GPU memory).
    pub snapshot_overlap: SnapshotOverlap,
    /// Policy for a save while the previous one persists.
    pub back_pressure: BackPressure,
    /// How long the committer waits for the other ranks' manifests.
    pub commit_timeout: Duration,
    /// Hand every snapshot to a replica agent as well (see [`ckpt_recovery::peer`]); `None` by
    /// default. A rank under `ckpt resume --peer-replicas` gets it from its driver:
    /// `ckpt_recovery::RankEnv::peer_link`.
    pub peer: Option<PeerLink>,
    /// The sentinel (issue 29): how much of the replicas this rank holds it hashes at each save
    /// for the committer to compare with the writer's bytes ([`SdcCheck::DEFAULT`]: a rotating
    /// sample of 5 % of their chunks). Replicas are hashed only when their memory is given.
    pub sdc_check: SdcCheck,
    /// The node this rank runs on, when a driver said (recorded in its manifests: the
    /// sentinel names nodes).
    pub node: Option<u32>,
    /// In a job of several machines saving to each node's local tier: the ranks of this
    /// node, which share its tier. The committer (the node's first rank) then commits them
    /// on the node ([`ckpt_store::NodeCommit`]) instead of the step, which the drains commit
    /// on the remote store. `None`: the store holds every rank's manifest (one machine, or
    /// no local tier), and the committer commits the step.
    pub node_ranks: Option<Vec<u32>>,
}

impl CheckpointerConfig {
    /// Defaults for `rank` of `layout` in `run`.
    pub fn new(run: &str, rank: u32, layout: Layout) -> Self {
        CheckpointerConfig {
            run: run.to_string(),
            rank,
            layout,
            generation: 0,
            committer: rank == 0,
            staging_bytes: 0,
            pool: None,
            stall_timeout: Duration::from_secs(300),
            prefault: false,
            background_prefault: true,
            copy_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            snapshot_overlap: SnapshotOverlap::Auto,
            back_pressure: BackPressure::Wait,
            commit_timeout: Duration::from_secs(600),
            peer: None,
            sdc_check: SdcCheck::DEFAULT,
            node: None,
            node_ranks: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SnapshotOverlap;

    #[test]
    fn auto_overlaps_when_nine_tenths_are_copied_by_dma() {
        let auto = SnapshotOverlap::Auto;
        assert!(auto.overlaps(100, 100));
        assert!(auto.overlaps(90, 100), "nine tenths by DMA");
        assert!(!auto.overlaps(89, 100), "a tenth and more from host memory");
        assert!(
            !auto.overlaps(50, 100),
            "half from host memory (CPU-offloaded state)"
        );
        assert!(!auto.overlaps(0, 0), "nothing to copy by DMA");
        assert!(SnapshotOverlap::Always.overlaps(0, 100));
        assert!(!SnapshotOverlap::Never.overlaps(100, 100));
        assert_eq!("always".parse(), Ok(SnapshotOverlap::Always));
        let e = "sometimes".parse::<SnapshotOverlap>().unwrap_err();
        assert!(e.contains("auto, always or never"), "{e}");
    }
}
