//! `ckpt-trainer`: what a training process embeds.
//!
//! - [`memory`]: memory sources and sinks (host tensors; device tensors behind `cuda`);
//! - [`staging`]: the bounded, reused staging pool snapshots copy into;
//! - [`save`]: [`Checkpointer`], the snapshot -> persist -> commit pipeline;
//! - [`restore`]: restore onto this rank's boxes under the current layout;
//! - [`manager`]: [`CheckpointManager`] (interval policy, retention, auto-resume, final
//!   checkpoint on SIGTERM, [`Stateful`] items, loss-spike monitoring and rollback);
//! - [`governor`]: the persist governor (lowers a persist's rate while the steps beside it are
//!   slower than a budget), pure;
//! - [`interval`]: the automatic checkpoint interval (Young/Daly from the measured cost of a
//!   save and the run's failure rate), pure;
//! - [`monitor`]: spike detection and the alert/rollback policy, pure;
//! - [`peer_plan`]: which regions of a restore survivors send from device memory and which come
//!   from the store, pure (the NCCL exchange that runs a plan is `cuda::peer`);
//! - [`workload`]: the reference workload's model and state (the `ckpt-train` crate runs it);
//! - `cuda` (feature `cuda`): device tensors, pinned staging, restore to the device, and
//!   recovery from peers' GPU memory over NCCL.

#![warn(missing_docs)]

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod governor;
pub mod interval;
pub mod manager;
pub mod memory;
pub mod monitor;
pub mod peer_plan;
pub mod restore;
pub mod save;
pub mod staging;
pub mod workload;

pub use governor::GovernorConfig;
pub use interval::AutoInterval;
pub use manager::{
    AllGather, CheckpointManager, LocalTier, ManagerConfig, Rollback, Scope, Stateful, StoreHealth,
    TensorMemory, events,
};
pub use memory::{HostTensor, HostView, MemorySink, MemorySource, PinnedSource, SourceVersion};
pub use monitor::{Decision, Monitor, MonitorConfig, Observation, Spike, SpikeAction};
pub use restore::{RestoreTarget, restore_targets};
pub use save::{
    BackPressure, Checkpointer, CheckpointerConfig, PersistRate, SaveFailure, SaveHandle,
    SaveReport, SaveState, SaveTensor, SnapshotOverlap, Stage, runtime,
};
pub use staging::{PoolConfig, PoolStats, StagingPool};

#[cfg(feature = "cuda")]
pub use cuda::{DeviceRegion, DeviceTensor, Gpu, GpuOptions};
