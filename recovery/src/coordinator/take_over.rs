//! Taking over from a lost coordinator (an agent elected after the previous coordinator's
//! node died): what the new one knows of the generation it inherits, and how it carries on.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::records;
use ckpt_store::Layout;

use super::{Action, Assignment, Config, Coordinator, ExitStatus, Phase, RankState, Record, ms};

/// What a coordinator taking over from a lost one knows about the generation it inherits (an
/// agent elected after the previous coordinator's node died; see `agent`). See
/// [`Coordinator::take_over`].
#[derive(Debug, Clone)]
pub struct TakeOver {
    /// The generation running (or being stopped).
    pub generation: u64,
    /// Its layout.
    pub layout: Layout,
    /// Where its ranks run.
    pub assignments: Vec<Assignment>,
    /// Nodes the previous coordinator had excluded.
    pub excluded: BTreeSet<u32>,
    /// Restarts the previous coordinator had made.
    pub restarts: u32,
    /// The highest step any rank reported (for the steps lost).
    pub max_step: u64,
    /// The previous coordinator had begun stopping the generation (after a failure it
    /// recorded, or at the end).
    pub stopping: bool,
    /// ... and had already sent SIGKILL.
    pub killed: bool,
    /// Ranks of the generation known to have ended, and how.
    pub exited: BTreeMap<u32, ExitStatus>,
    /// Nodes found lost (their agent is gone), with why; their ranks are gone too.
    pub lost_nodes: BTreeMap<u32, String>,
}

impl Coordinator {
    /// A coordinator that carries on from a lost one, at the generation it ran (see
    /// [`TakeOver`]), with the actions to take now:
    ///
    /// - every rank of the generation ended with success: the job is done;
    /// - a lost node ran ranks of the generation, or a rank ended abnormally and the previous
    ///   coordinator had not begun stopping: each such node is failed (a `failure` record with
    ///   `how` = `node`, or `exit`/`signal`) and excluded, and the job stops and restarts from
    ///   the newest committed step on a new generation, as after any failure;
    /// - the previous coordinator had begun stopping: stopping goes on (SIGTERM again, SIGKILL
    ///   after the grace period), then the step is chosen and the job restarts;
    /// - otherwise nothing is lost: the ranks keep running under the new coordinator.
    ///
    /// Lost nodes that ran no rank of the generation are excluded without a record.
    pub fn take_over(cfg: Config, t: TakeOver, now: Duration) -> (Self, Vec<Action>) {
        let mut c = Coordinator::new(cfg);
        c.generation = t.generation;
        c.layout = t.layout;
        c.excluded = t.excluded;
        c.restarts = t.restarts;
        c.node_restarts = t.restarts;
        c.backoff_streak = t.restarts;
        c.generation_started = now;
        c.max_step = t.max_step;
        c.phase = Phase::Running;
        c.ranks = t
            .assignments
            .iter()
            .map(|a| {
                (
                    a.rank,
                    RankState::started(a.node, now, t.exited.get(&a.rank).copied()),
                )
            })
            .collect();
        if !t.stopping
            && !c.ranks.is_empty()
            && c.ranks
                .values()
                .all(|r| r.exited.is_some_and(|s| s.success()))
        {
            let out = c.finish(now, true, "every rank finished".into());
            return (c, out);
        }
        // One failure per node: the first rank found on it.
        let mut failed: BTreeMap<u32, (u32, &'static str, String)> = BTreeMap::new();
        for (&rank, r) in c.ranks.iter_mut() {
            if let Some(why) = t.lost_nodes.get(&r.node) {
                if r.exited.is_none() {
                    r.exited = Some(ExitStatus::Signal(9));
                    failed.entry(r.node).or_insert((
                        rank,
                        "node",
                        format!("node {} was lost: {why}", r.node),
                    ));
                }
            } else if !t.stopping
                && let Some(st) = r.exited.filter(|s| !s.success())
            {
                let how = match st {
                    ExitStatus::Signal(_) => "signal",
                    ExitStatus::Code(_) => "exit",
                };
                failed
                    .entry(r.node)
                    .or_insert((rank, how, format!("rank {rank} ended with {st}")));
            }
        }
        c.excluded.extend(t.lost_nodes.keys().copied());
        if failed.is_empty() && !t.stopping {
            return (c, vec![]);
        }
        let mut out = Vec::new();
        for (node, (rank, how, detail)) in failed {
            out.push(Action::Record(Record::Failure(records::Failure {
                generation: c.generation,
                rank,
                node,
                how: how.into(),
                detail,
                last_step: None,
                detection_s: 0.0,
                at_ms: ms(now),
            })));
            out.extend(c.node_failed_at(node, now));
        }
        c.failed_at = Some(now);
        c.node_failed = true;
        c.phase = Phase::Stopping {
            kill_at: now + c.cfg.stop_grace,
            killed: t.killed,
        };
        let live = c.live_ranks();
        if !live.is_empty() {
            out.push(Action::Signal {
                generation: c.generation,
                ranks: live,
                kill: t.killed,
            });
        }
        out.extend(c.maybe_all_stopped(now));
        (c, out)
    }
}
