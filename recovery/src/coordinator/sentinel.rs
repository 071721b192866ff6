//! Replicas that disagree (the sentinel, issue 29): what the coordinator does when the driver
//! finds a committed step whose data-parallel replicas differ ([`Event::ReplicaMismatch`]),
//! by the job's [`MismatchPolicy`]. Under `stop` the job ends with the reason. Under
//! `rollback` the nodes of the suspect ranks (outside a strict majority) are failed and kept
//! out for good (a node that computes or stores wrong bits without an error is not used
//! again), the live ranks are stopped, the step and every later one are marked unusable and
//! retired, and the job restarts from the newest step before it, whose replicas agreed. With
//! no majority (two replicas) no node can be named: the job rolls back keeping every node.

use std::time::Duration;

use ckpt_store::MismatchPolicy;

use crate::records;

use super::{Action, Coordinator, Phase, Record, ms};

impl Coordinator {
    /// Whether the driver should look at each new commit of the running generation for
    /// replicas that disagree: the generation and the step it resumed from (older steps were
    /// looked at before), while the policy acts on them.
    pub fn watching_replicas(&self) -> Option<(u64, Option<u64>)> {
        (self.cfg.on_replica_mismatch != MismatchPolicy::Warn && self.phase == Phase::Running)
            .then_some((self.generation, self.resume_from))
    }

    /// What the job does when a step's replicas disagree.
    pub fn mismatch_policy(&self) -> MismatchPolicy {
        self.cfg.on_replica_mismatch
    }

    /// The steps from this one on are never restored (their replicas disagreed, or they came
    /// after such a step).
    pub fn unusable_from(&self) -> Option<u64> {
        self.unusable_from
    }

    /// The driver found that step `step`'s replicas disagree (`suspects`: the ranks outside a
    /// strict majority, empty when there is none; `detail`: the first mismatch).
    pub(super) fn on_replica_mismatch(
        &mut self,
        step: u64,
        suspects: Vec<u32>,
        detail: String,
        now: Duration,
    ) -> Vec<Action> {
        if self.phase != Phase::Running {
            return vec![];
        }
        match self.cfg.on_replica_mismatch {
            MismatchPolicy::Warn => vec![],
            MismatchPolicy::Stop => self.finish(
                now,
                false,
                format!(
                    "the replicas of step {step} disagree (silent data corruption; --on-replica-mismatch stop): {detail}"
                ),
            ),
            MismatchPolicy::Rollback => self.roll_back_from(step, suspects, detail, now),
        }
    }

    fn roll_back_from(
        &mut self,
        step: u64,
        suspects: Vec<u32>,
        detail: String,
        now: Duration,
    ) -> Vec<Action> {
        self.grow_wait = None;
        self.failed_at = Some(now);
        self.unusable_from = Some(self.unusable_from.map_or(step, |u| u.min(step)));
        let mut out = Vec::new();
        let named: Vec<(u32, u32)> = suspects
            .iter()
            .filter_map(|r| self.ranks.get(r).map(|s| (*r, s.node)))
            .collect();
        let why = if named.is_empty() {
            format!(
                "its replicas disagree and no majority names a suspect (rolled back, no node kept out): {detail}"
            )
        } else {
            format!("its replicas disagree (silent data corruption): {detail}")
        };
        if self.unusable.insert(step) {
            out.push(Action::Record(Record::StepUnusable(
                records::StepUnusable {
                    generation: self.generation,
                    step,
                    rank: named.first().map(|n| n.0),
                    why,
                    at_ms: ms(now),
                },
            )));
        }
        for (rank, node) in named {
            self.node_failed = true;
            out.push(Action::Record(Record::Failure(records::Failure {
                generation: self.generation,
                rank,
                node,
                how: "replica_mismatch".into(),
                detail: format!(
                    "rank {rank} on node {node} holds replica bytes of step {step} that the majority does not: {detail}"
                ),
                last_step: self.ranks.get(&rank).and_then(|r| r.last_step),
                detection_s: 0.0,
                at_ms: ms(now),
            })));
            self.excluded.insert(node);
            self.returned.remove(&node);
            if self.kept_out.insert(node) {
                out.push(Action::Record(Record::NodeKeptOut(records::NodeKeptOut {
                    node,
                    failures_ms: vec![ms(now)],
                    window_s: 0.0,
                    reason: format!(
                        "node {node} is suspected of silent data corruption (its replica of step {step} differs from the majority's): kept out for good"
                    ),
                    at_ms: ms(now),
                })));
            }
        }
        out.extend(self.stop_live(now));
        out
    }
}
