//! Growing back: a failed node returns, the job waits for the next commit, then stops and
//! restarts resharded on more nodes.

use std::time::Duration;

use crate::records;

use super::{Action, Coordinator, Phase, Record, ms};

impl Coordinator {
    /// A failed node is back: usable again unless it is kept out; a running job then waits for
    /// the next commit to grow at, when the usable nodes hold more than it runs.
    pub(super) fn on_node_back(&mut self, node: u32, now: Duration) -> Vec<Action> {
        if self.phase == Phase::Done || !self.excluded.contains(&node) {
            return vec![];
        }
        let usable = !self.kept_out.contains(&node);
        if usable {
            self.excluded.remove(&node);
            self.returned.insert(node);
            self.maybe_wait_to_grow();
        }
        vec![Action::Record(Record::NodeReturned(
            records::NodeReturned {
                node,
                usable,
                at_ms: ms(now),
            },
        ))]
    }

    /// While running, wait for a commit to grow at if the usable nodes hold a larger layout.
    pub(super) fn maybe_wait_to_grow(&mut self) {
        if self.phase == Phase::Running
            && self.grow_wait.is_none()
            && self
                .next_layout()
                .is_ok_and(|l| l.world() > self.layout.world())
        {
            self.grow_wait = Some(None);
        }
    }

    /// The driver says the newest committed step is `step`: the first answer is where things
    /// stand; a newer step is the boundary to grow at.
    pub(super) fn on_committed(&mut self, step: Option<u64>, now: Duration) -> Vec<Action> {
        match self.grow_wait {
            Some(None) => {
                self.grow_wait = Some(Some(step));
                vec![]
            }
            Some(Some(seen)) if step > seen => self.stop_for_grow(now),
            _ => vec![],
        }
    }

    /// A step was committed after nodes came back: stop the ranks, to restart on more nodes
    /// from the newest committed step.
    fn stop_for_grow(&mut self, now: Duration) -> Vec<Action> {
        self.grow_wait = None;
        self.growing = true;
        self.failed_at = Some(now);
        self.stop_live(now)
    }

    /// Restart after a grow's stop, on the larger layout, at once.
    pub(super) fn grow(&mut self, step: Option<u64>, now: Duration) -> Vec<Action> {
        let from = self.layout;
        let layout = match self.next_layout() {
            Ok(l) => l,
            Err(why) => return self.finish(now, false, format!("cannot restart: {why}")),
        };
        self.layout = layout;
        let returned: Vec<u32> = std::mem::take(&mut self.returned).into_iter().collect();
        let rpn = self.cfg.topology.ranks_per_node;
        let nodes: Vec<u32> = self
            .usable_nodes()
            .into_iter()
            .take(layout.world().div_ceil(rpn) as usize)
            .collect();
        let steps_lost = step.map_or(self.max_step, |s| self.max_step.saturating_sub(s));
        let mut out = vec![Action::Record(Record::Grow(records::Grow {
            generation: self.generation,
            from_layout: from.to_string(),
            layout: layout.to_string(),
            nodes,
            returned: returned.clone(),
            step,
            steps_lost,
            reason: format!(
                "node(s) {returned:?} came back: dp {} -> {} (configured {}), restarting from {} \
                 committed after their return",
                from.dp,
                layout.dp,
                self.cfg.layout.dp,
                step.map_or("scratch".to_string(), |s| format!("step {s}"))
            ),
            at_ms: ms(now),
        }))];
        self.generation += 1;
        self.resumed_reported = false;
        out.extend(self.start_generation(now, step));
        out
    }
}
