//! The data model: dtypes, n-d boxes, layouts, tensor specs, chunk references, rank manifests
//! and the commit record (see FORMAT.md for the serialized forms), one subject a file:
//!
//! - `dtype`: element types;
//! - `geometry`: n-d boxes of tensors, shapes, and the contiguous byte runs between boxes;
//! - `layout`: the parallel layout of a job and a rank's place in it;
//! - `spec`: a tensor's spec and how it is placed (the rules that place it are
//!   [`crate::placement`]);
//! - `manifest`: what one rank saved for a step (chunk references, shards, blobs, statistics);
//! - `commit_record`: the commit record of a step, its checksum, and building its tensor list;
//! - `coverage`: checking that shards cover a tensor exactly once;
//! - `replicas`: the sentinel: which replica chunks a rank hashes, and comparing them with the
//!   writer's at commit.
//!
//! Nothing here depends on the placement rules: placement builds on these types.

mod commit_record;
mod coverage;
mod dtype;
mod geometry;
mod layout;
mod manifest;
mod replicas;
mod spec;

pub use commit_record::{
    BlobLoc, CommitRecord, PartRef, RANKS_PER_PART, RankEntry, RecordIndex, RecordPart, ShardLoc,
    TensorEntry, collect_tensors,
};
pub use coverage::check_coverage;
pub use dtype::DType;
pub use geometry::{NdBox, copy_runs, cut_box, numel};
pub use layout::{Coords, Layout};
pub use manifest::{
    BlobEntry, ChunkRef, MAX_DELTA_CHAIN, MAX_NAME_LEN, RankManifest, TensorShard, WriteStats,
    validate_name,
};
pub use replicas::{
    HashedChunk, MAX_MISMATCHES_LISTED, MismatchPolicy, ReplicaMismatch, ReplicaReport,
    ReplicaSide, SdcCheck, compare_replicas, most_sampled, sampled_chunks,
};
pub use spec::{Placement, Stage, TensorSpec, ZeroGroup};

/// The version of manifests and commit records this build writes.
///
/// Format 2 added the commit record's `checksum`; readers accept a record without one only if
/// it is of format 1 (written before checksums existed).
pub const FORMAT_VERSION: u32 = 2;

/// The format of a rank manifest that references delta chunks (a chunk reference's `bases`
/// and `base_step`, delta chunk objects under their own keys; issue 16), and the newest rank
/// manifest format this build reads. Manifests without deltas are still written as
/// [`FORMAT_VERSION`], so stores without deltas stay readable by older builds.
pub const DELTA_FORMAT_VERSION: u32 = 3;

/// The newest format of commit records this build reads (and writes, for a record too large
/// for one object: [`SPLIT_RECORD_FORMAT`]).
///
/// Format 5 splits a commit record larger than [`crate::StoreConfig::record_part_bytes`] into
/// a small root (the `COMMIT` object: the step's summary and an index) and content-addressed
/// parts under `steps/<step>/index/`, so that a restoring rank reads the parts of its own
/// tensors, not a record that grows with the world. Records that fit in one object are still
/// written as format 4, readable by builds that read up to 4.
///
/// Format 4 moved the rank manifests of a step to `steps/<step>/ranks/<2 hex>/` (spread over
/// 256 prefixes) and added the writers' fence shards; readers find the manifests of older
/// steps at their old place. A build that reads up to format 2 or 3 refuses a format 4
/// record as newer rather than report its manifests missing.
pub const RECORD_FORMAT_VERSION: u32 = 5;

/// The format of a commit record split into a root and parts (see [`RECORD_FORMAT_VERSION`]).
pub const SPLIT_RECORD_FORMAT: u32 = 5;

/// The format of a commit record written whole.
pub const WHOLE_RECORD_FORMAT: u32 = 4;

/// The first format whose commit records carry a `checksum`.
pub const FIRST_CHECKSUMMED_FORMAT: u32 = 2;
