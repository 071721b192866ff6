//! The save pipeline: snapshot -> persist -> commit.
//!
//! [`Checkpointer::save`] pins every tensor (see [`crate::memory`]), starts the snapshot on a
//! background thread and returns a [`SaveHandle`] at once. The snapshot copies each shard into
//! staging slabs with several threads and hands every filled chunk to the persist task, which
//! streams them into the store ([`ckpt_store::Store::write_rank_stream`]) while the copy goes
//! on, then writes the rank manifest. The committer (rank 0 by default) waits for every rank's
//! manifest and creates the commit record.
//!
//! The training loop only has to wait for the snapshot before it mutates tensors; with host
//! tensors even that is automatic (a write waits for the copy of that tensor).
//!
//! Files, one subject each:
//! - `runtime`: the process-wide I/O runtime and the persist threads' priority;
//! - `config`: [`CheckpointerConfig`], [`BackPressure`] and [`SnapshotOverlap`];
//! - `state`: what a save is given ([`SaveTensor`], [`SaveState`]) and its plan (checks, pins);
//! - `handle`: where a save is ([`Stage`], [`SaveReport`], [`SaveFailure`], [`SaveHandle`]);
//! - `checkpointer`: [`Checkpointer`] and `save`, step by step;
//! - `snapshot`: copying pinned sources into staging slabs (batches, carving);
//! - `persist`: the persist-and-commit task (lease, dedup base, streaming write, commit);
//! - `rate`: the persist's rate limit ([`PersistRate`]), which the governor sets and waiting
//!   callers lift ([`FullSpeed`]);
//! - `versions`: which shards a save takes unchanged from the last committed save.

mod checkpointer;
mod config;
mod handle;
mod persist;
mod rate;
mod runtime;
mod snapshot;
mod state;
mod versions;

pub use checkpointer::Checkpointer;
pub use config::{BackPressure, CheckpointerConfig, SnapshotOverlap};
pub use handle::{SaveFailure, SaveHandle, SaveReport, Stage};
pub(crate) use rate::Pacer;
pub use rate::{FullSpeed, PersistRate};
pub use runtime::{runtime, set_io_nice};
pub use state::{SaveState, SaveTensor};
