//! The `events` log's records of the sentinel (issue 29): replicas that disagree at a commit
//! ([`ReplicaMismatchEvent`], written by the committing rank; the drivers add the recovery
//! records of what they did about it) and trainable state that stopped changing
//! ([`StateUnchanged`], written by each rank for what it saved).

use std::collections::BTreeSet;

use ckpt_store::{MismatchPolicy, ReplicaMismatch, ReplicaReport};
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

impl ReplicaMismatchEvent {
    /// The record of committed `step` whose replicas `r` disagree, as `rank` of `generation`
    /// logs it under `policy`: the suspects (outside a strict majority) and their nodes.
    pub fn of(
        step: u64,
        generation: u64,
        rank: u32,
        policy: MismatchPolicy,
        r: &ReplicaReport,
    ) -> Self {
        let suspects = r.suspects();
        let mut nodes: BTreeSet<u32> = BTreeSet::new();
        for s in r.mismatches.iter().flat_map(|m| &m.sides) {
            for (rank, node) in s.ranks.iter().zip(&s.nodes) {
                if let (true, Some(node)) = (suspects.contains(rank), node) {
                    nodes.insert(*node);
                }
            }
        }
        let first = r
            .mismatches
            .first()
            .map(|m| m.describe())
            .unwrap_or_default();
        ReplicaMismatchEvent {
            step,
            generation,
            rank,
            chunks_compared: r.chunks_compared,
            mismatched_chunks: r.mismatched_chunks,
            suspects,
            suspect_nodes: nodes.into_iter().collect(),
            mismatches: r.mismatches.clone(),
            policy: policy.name().to_string(),
            detail: format!(
                "step {step}: {} of {} replica chunks compared differ (silent data corruption on one side); first: {first}",
                r.mismatched_chunks, r.chunks_compared
            ),
        }
    }
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

#[cfg(test)]
pub(crate) mod tests {
    use ckpt_store::{ChunkId, NdBox, ReplicaSide};

    use super::*;

    /// Three holders of one chunk: ranks 0 and 2 (nodes 0 and 2) agree, rank 1 on node 1
    /// does not.
    pub(crate) fn one_of_three_differs() -> ReplicaReport {
        let side = |b: &[u8], ranks: Vec<u32>| ReplicaSide {
            id: ChunkId::of(b),
            nodes: ranks.iter().map(|r| Some(*r)).collect(),
            ranks,
        };
        ReplicaReport {
            chunks_compared: 8,
            bytes_compared: 8 << 10,
            mismatches: vec![ReplicaMismatch {
                tensor: "w".into(),
                bbox: NdBox::full(&[4096]),
                chunk: 3,
                offset: 3 << 10,
                len: 1 << 10,
                writer: 0,
                sides: vec![side(b"a", vec![0, 2]), side(b"b", vec![1])],
                suspects: vec![1],
            }],
            mismatched_chunks: 1,
        }
    }

    #[test]
    fn a_mismatch_record_names_the_minority_rank_its_node_and_the_policy() {
        let e =
            ReplicaMismatchEvent::of(15, 4, 0, MismatchPolicy::Rollback, &one_of_three_differs());
        assert_eq!((e.step, e.generation, e.rank), (15, 4, 0));
        assert_eq!((e.suspects, e.suspect_nodes), (vec![1], vec![1]));
        assert_eq!(e.policy, "rollback");
        assert!(
            e.detail.starts_with("step 15: 1 of 8 replica chunks"),
            "{}",
            e.detail
        );
        assert!(
            e.detail.contains("\"w\"") || e.detail.contains('w'),
            "{}",
            e.detail
        );
    }
}
