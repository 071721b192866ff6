//! The `events` log's records of the sentinel (issue 29): replicas that disagree at a commit
//! ([`ReplicaMismatchEvent`], written by the committing rank; the drivers add the recovery
//! records of what they did about it) and trainable state that stopped changing
//! ([`StateUnchanged`], written by each rank for what it saved).

use ckpt_store::ReplicaMismatch;
use serde::{Deserialize, Serialize};

/// `{"kind":"replica_mismatch"}`: the committer of `step` found data-parallel replicas whose
/// bytes differ (silent corruption on one side).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReplicaMismatchEvent {
    /// The step.
    pub step: u64,
    /// Its generation.
    pub generation: u64,
    /// The committing rank.
    pub rank: u32,
    /// Replica chunks compared.
    pub chunks_compared: u64,
    /// Chunks that differ.
    pub mismatched_chunks: u64,
    /// The ranks in a minority (suspect), over every mismatch listed.
    pub suspects: Vec<u32>,
    /// The nodes of the suspects, where known.
    pub suspect_nodes: Vec<u32>,
    /// The mismatches (at most 64): tensor, box, chunk, the sides with ranks and nodes.
    pub mismatches: Vec<ReplicaMismatch>,
    /// What the job does: `warn`, `stop` or `rollback`.
    pub policy: String,
    /// One line for people.
    pub detail: String,
}

/// `{"kind":"state_unchanged"}`: trainable tensors a rank saved kept the same bytes (chunk
/// ids) over `checkpoints` consecutive checkpoints while steps advanced: a save path that hands
/// over stale buffers, or a layer that does not train.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StateUnchanged {
    /// The checkpoint that found it.
    pub step: u64,
    /// The rank.
    pub rank: u32,
    /// The steps whose checkpoints held the same bytes, oldest first.
    pub steps: Vec<u64>,
    /// The tensors found unchanged at this checkpoint (newly; at most 64 listed).
    pub tensors: Vec<String>,
    /// How many tensors that is in all.
    pub count: u64,
    /// Trainable tensors this rank saved.
    pub trainable: u64,
    /// Every trainable tensor of the rank is unchanged (an error, not a warning).
    pub all: bool,
    /// One line for people.
    pub detail: String,
}
