//! `ckpt-store`: the content-addressed checkpoint store at the bottom of ckpt.
//!
//! A checkpoint step is a set of **rank manifests** (each rank's tensor shards and blobs, cut
//! into chunks) and one **commit record** whose existence makes the step complete. Chunks are
//! addressed by the blake3 hash of their raw bytes, encoded raw, zstd or as zstd byte planes
//! (chosen by measuring), and small ones are packed together. Everything goes through
//! [`object_store::ObjectStore`]: a local directory ([`DirectFs`], `O_DIRECT` for large
//! objects), memory, S3, GCS or Azure.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> ckpt_store::Result<()> {
//! use ckpt_store::{ChunkIn, DType, DedupIndex, Layout, NdBox, RankManifest, Store, StepReader, TensorShard};
//! use futures::stream;
//!
//! let store = Store::memory();
//! let data: Vec<u8> = (0..4096u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
//! let index = DedupIndex::new();
//! let chunks = store.chunk_spans(data.len() as u64).map(|r| ChunkIn {
//!     data: bytes::Bytes::copy_from_slice(&data[r.start as usize..r.end as usize]),
//!     elem: 4,
//!     base: None,
//! });
//! let put = store.chunks().put_chunks(stream::iter(chunks.collect::<Vec<_>>()), &index).await?;
//! let manifest = RankManifest {
//!     format: ckpt_store::FORMAT_VERSION, run: "demo".into(), step: 1, rank: 0,
//!     node: None, layout: Layout::SINGLE, generation: 0, created_ms: 0,
//!     tensors: vec![TensorShard {
//!         name: "w".into(), dtype: DType::F32, shape: vec![64, 64],
//!         bbox: NdBox::full(&[64, 64]), chunks: put.refs, replica_of: None, placement: None,
//!         hashed: vec![],
//!     }],
//!     blobs: vec![], stats: Default::default(),
//! };
//! store.log().write_rank_manifest(&manifest).await?;
//! store.log().commit_step("demo", 1).await?;
//!
//! let reader = StepReader::open_latest(&store, "demo").await?;
//! let rows = reader.read("w", &NdBox::new(vec![10, 0], vec![2, 64])?).await?;
//! assert_eq!(rows, data[10 * 256..12 * 256]);
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

// The handle and how it is opened: `Store` (over its parts: `Objects`, `Chunks`, `CommitLog`,
// `Gc`) and its settings, URLs, time, errors, failpoints.
pub mod clock;
pub mod error;
pub mod failpoint;
pub mod store;
pub mod url;

// Ids, the one key layout, the data model and the placement rules.
pub mod id;
pub mod keys;
pub mod model;
pub mod placement;

// Chunk objects and packs: the store's `Chunks` part, the codecs, packing.
mod chunks;
pub mod codec;
pub mod pack;

// Saving a step: rank writes, the commit protocol (the store's `CommitLog` part), draining a
// local tier.
pub mod commit;
pub mod tier;
pub mod writer;

// Reading a step: the read engine, its caches, listings, the safetensors view, files out.
pub mod cache;
pub mod node_cache;
pub mod outfile;
pub mod read;
pub mod st_view;

// Housekeeping: leases and GC (the store's `Gc` part; `lease` is `gc::lease`), verify.
pub mod gc;
pub use gc::lease;
pub mod verify;

// The logs of a run (their records are `ckpt_recovery::records`).
pub mod logs;

// `ObjectStore` wrappers (what they share: `layer`), and test helpers.
#[cfg(feature = "testing")]
pub mod counting;
pub mod direct;
mod layer;
pub mod retry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod wrap;

pub use bytes;
pub use object_store;
pub use object_store::{ObjectStore, ObjectStoreExt};

pub use cache::{CacheStats, ChunkCache};
pub use clock::{Clock, ManualClock, SystemClock, now_ms};
pub use codec::{Codec, CodecPolicy};
pub use commit::catalog::StepListing;
pub use commit::node::NodeCommit;
pub use commit::{Agreement, CommitLog, CommitOutcome};
pub use direct::{DirectFs, shared_reads};
pub use error::{Error, ErrorKind, Result};
pub use failpoint::{FailAction, Failpoints};
pub use gc::{Gc, GcOptions, GcReport};
pub use id::{ChunkId, Hash, PackId, StepId};
pub use keys::{FENCE_SHARDS, Keys, validate_run};
pub use lease::{DedupBase, LockListing, WriterLease, writer_id};
pub use model::{
    BlobEntry, BlobLoc, ChunkRef, CommitRecord, Coords, DELTA_FORMAT_VERSION, DType,
    FORMAT_VERSION, HashedChunk, Layout, MismatchPolicy, NdBox, PartRef, RECORD_FORMAT_VERSION,
    RankEntry, RankManifest, RecordIndex, RecordPart, ReplicaMismatch, ReplicaReport, ReplicaSide,
    SPLIT_RECORD_FORMAT, SdcCheck, ShardLoc, TensorEntry, TensorShard, WHOLE_RECORD_FORMAT,
    WriteStats, compare_replicas, most_sampled, sampled_chunks,
};
pub use node_cache::{NodeCache, NodeCacheStats};
pub use placement::{Placed, Placement, Stage, TensorSpec, ZeroGroup};
pub use read::{
    ChunkSource, CopyOp, Fetched, FetchedBytes, PlannedChunk, ReadPlan, ReadStats, StepReader,
};
pub use retry::{RetryConfig, RetryStore};
pub use st_view::SafetensorsView;
pub use store::{
    BaseChunk, BaseRegions, ChunkIn, Chunks, DedupIndex, Objects, PutReport, PutStats, Store,
    StoreConfig, StoredChunk,
};
pub use tier::{
    DrainMarker, DrainOptions, DrainPace, DrainProgress, DrainReport, TierSource, drain_node,
    drain_step, node_step_to_follow, rate_pace, steps_to_follow,
};
pub use url::{OpenOptions, StoreUrl, open, open_with};
pub use verify::{Damage, VerifyReport, VerifyScope};
pub use wrap::{
    Fault, FaultAction, FaultHandle, FaultOp, FaultyStore, MetricsSnapshot, MetricsStore,
    RandomFaultStats, RandomFaults, StoreMetrics,
};
pub use writer::{BlobIn, RankParts, RankWrite, ShardDesc, ShardIn, ShardMeta, assemble_manifest};
