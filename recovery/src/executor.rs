//! The one executor of the [`Coordinator`]'s actions, for every driver: events in, actions
//! out, as raft-rs's `Ready` loop.
//!
//! A driver queues what it learns ([`Executor::push`]: exits, heartbeats, ticks, nodes back)
//! and calls [`Executor::drive`], which feeds the queue to the coordinator and carries out the
//! actions it answers with, in order. What every driver does alike is done here: choosing the
//! step to restore and verifying a step (their answers queued as events), retiring a step,
//! the recovery log, and the newest commit while the coordinator waits to grow
//! ([`Executor::poll_commits`]). What differs is the driver's [`Effects`]: how a generation's
//! ranks are started and signalled (processes on this machine for the local supervisor, a
//! plan and signals published on etcd for the agents' coordinator), the store's number of a
//! generation, what a driver adds to a record, and the end of the job.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ckpt_store::{Layout, ReplicaReport, Result, Store};
use tracing::warn;

use crate::coordinator::{Action, Assignment, Coordinator, Event, Record};
use crate::driver::{RecoveryLog, check_step, choose_step_logged, retire_step};
use crate::records::{Event as LogEvent, ReplicaMismatchEvent, read_records};

/// How often a driver looks for a new commit while the coordinator waits for one to grow the
/// job back at (one listing of the run's steps a time).
pub const COMMIT_POLL: Duration = Duration::from_millis(100);

/// How often a driver looks for new commits whose replicas disagree, while the job's policy
/// acts on them (one listing of the run's steps, and one read of each new commit record).
pub const REPLICA_POLL: Duration = Duration::from_millis(250);

/// Which queued event the coordinator is told next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// The newest first (the local supervisor): an answer the actions queue (the step chosen,
    /// the step checked) is told before older events, and a tick's events in reverse.
    NewestFirst,
    /// The oldest first (the etcd coordinator): in the order they were learned.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    OldestFirst,
}

/// A generation to start: [`Action::Start`]'s orders.
#[derive(Debug, Clone)]
pub(crate) struct Start {
    /// The coordinator's generation.
    pub(crate) generation: u64,
    /// Its layout.
    pub(crate) layout: Layout,
    /// Where each rank runs.
    pub(crate) assignments: Vec<Assignment>,
    /// The step its ranks restore (`None`: from scratch).
    pub(crate) resume_from: Option<u64>,
}

/// What a driver does its own way (see the module docs). Every method gets the executor, for
/// the coordinator's state, the store, the clock and the queue.
pub(crate) trait Effects {
    /// The store's number of the coordinator's generation `g` (the store's generations go on
    /// across supervisions and coordinators).
    fn generation(&self, g: u64) -> u64;

    /// Before the actions of one event are carried out.
    async fn prepare(&mut self, ex: &mut Executor, actions: &[Action]) -> Result<()> {
        let _ = (ex, actions);
        Ok(())
    }

    /// [`Action::Start`]: start generation `generation`'s ranks.
    async fn start(&mut self, ex: &mut Executor, s: Start) -> Result<()>;

    /// [`Action::Signal`]: SIGTERM (or SIGKILL) to ranks of `generation`.
    async fn signal(
        &mut self,
        ex: &mut Executor,
        generation: u64,
        ranks: Vec<u32>,
        kill: bool,
    ) -> Result<()>;

    /// A record is about to be logged, as the coordinator made it.
    fn recording(&mut self, ex: &Executor, rec: &Record) {
        let _ = (ex, rec);
    }

    /// What the driver knows that the coordinator does not, added to a record as logged.
    fn amend(&mut self, ex: &Executor, logged: &mut Record) {
        let _ = (ex, logged);
    }

    /// [`Action::Done`]: the job is over.
    async fn done(&mut self, ex: &mut Executor, ok: bool, reason: String) -> Result<()>;
}

/// The coordinator with what it has still to be told, the store it acts on, the recovery log
/// and the driver's clock (see the module docs).
#[derive(Debug)]
pub(crate) struct Executor {
    /// The coordinator.
    pub(crate) coord: Coordinator,
    /// The store of the run.
    pub(crate) store: Store,
    /// The job's local tier, if any: its steps count as much as the store's (issue 28).
    pub(crate) local: Option<Store>,
    /// The run.
    pub(crate) run: String,
    /// The recovery log this driver writes.
    pub(crate) log: RecoveryLog,
    /// Time zero of the coordinator's clock.
    t0: Instant,
    queue: VecDeque<Event>,
    order: Order,
    /// While the coordinator waits for a commit to grow the job back at: the generation, when
    /// the store was last asked, and the newest committed step it said.
    commit_watch: Option<(u64, Instant, Option<u64>)>,
    /// While the coordinator watches the replicas: the generation, when the store was last
    /// asked, and the newest step looked at.
    replica_watch: Option<(u64, Instant, Option<u64>)>,
    /// The replicas found to disagree that the committer may not have logged yet: the
    /// coordinator's generation, the step, and the comparison.
    mismatch_found: Option<(u64, u64, ReplicaReport)>,
}

impl Executor {
    /// An executor of `coord`'s actions on `run`; its clock starts now.
    pub(crate) fn new(
        coord: Coordinator,
        store: Store,
        run: &str,
        log: RecoveryLog,
        order: Order,
    ) -> Self {
        Executor {
            coord,
            store,
            local: None,
            run: run.to_string(),
            log,
            t0: Instant::now(),
            queue: VecDeque::new(),
            order,
            commit_watch: None,
            replica_watch: None,
            mismatch_found: None,
        }
    }

    /// The job's local tier (its steps are chosen from, checked and retired as the store's).
    pub(crate) fn with_local(mut self, local: Option<Store>) -> Self {
        self.local = local;
        self
    }

    /// The tiers a step may be committed in: the local tier first, then the store.
    pub(crate) fn tiers(&self) -> Vec<&Store> {
        self.local
            .iter()
            .chain(std::iter::once(&self.store))
            .collect()
    }

    /// The tier whose copy of committed `step` counts: the local tier's when it committed it.
    async fn home_of(&self, step: u64) -> Result<&Store> {
        if let Some(l) = &self.local
            && l.objects()
                .exists(&l.keys().commit(&self.run, step))
                .await?
        {
            return Ok(l);
        }
        Ok(&self.store)
    }

    /// The steps committed in either tier, ascending.
    async fn committed_steps(&self) -> Result<Vec<u64>> {
        let mut all = std::collections::BTreeSet::new();
        for t in self.tiers() {
            all.extend(t.log().committed_steps(&self.run).await?);
        }
        Ok(all.into_iter().collect())
    }

    /// When the clock started.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn started(&self) -> Instant {
        self.t0
    }

    /// The coordinator's time.
    pub(crate) fn now(&self) -> Duration {
        self.t0.elapsed()
    }

    /// Queue an event for the coordinator.
    pub(crate) fn push(&mut self, ev: Event) {
        self.queue.push_back(ev);
    }

    fn next(&mut self) -> Option<Event> {
        match self.order {
            Order::NewestFirst => self.queue.pop_back(),
            Order::OldestFirst => self.queue.pop_front(),
        }
    }

    /// Feed the queued events to the coordinator, and carry out its actions, until none is
    /// left (actions may queue more).
    pub(crate) async fn drive(&mut self, fx: &mut impl Effects) -> Result<()> {
        while let Some(ev) = self.next() {
            let actions = self.coord.on_event(ev);
            self.execute(fx, actions).await?;
        }
        Ok(())
    }

    /// Carry out `actions`, in order.
    pub(crate) async fn execute(
        &mut self,
        fx: &mut impl Effects,
        actions: Vec<Action>,
    ) -> Result<()> {
        fx.prepare(self, &actions).await?;
        for act in actions {
            match act {
                Action::Start {
                    generation,
                    layout,
                    assignments,
                    resume_from,
                } => {
                    self.log_mismatch_found(fx).await;
                    let s = Start {
                        generation,
                        layout,
                        assignments,
                        resume_from,
                    };
                    fx.start(self, s).await?
                }
                Action::Signal {
                    generation,
                    ranks,
                    kill,
                } => fx.signal(self, generation, ranks, kill).await?,
                Action::ChooseStep {
                    generation,
                    skip,
                    below,
                } => {
                    let c = choose_step_logged(&self.tiers(), &self.run, &skip, below).await?;
                    let now = self.now();
                    self.push(Event::StepChosen {
                        generation,
                        step: c.step,
                        damaged: c.damaged,
                        now,
                    });
                }
                Action::CheckStep { generation, step } => {
                    let home = self.home_of(step).await?;
                    let damage = check_step(home, &self.run, step).await?;
                    let now = self.now();
                    self.push(Event::StepChecked {
                        generation,
                        step,
                        damage,
                        now,
                    });
                }
                Action::RetireStep { step } => {
                    for t in self.tiers() {
                        retire_step(t, &self.run, step).await?;
                    }
                }
                Action::Record(rec) => self.record(fx, rec).await?,
                Action::Done { ok, reason } => {
                    self.log_mismatch_found(fx).await;
                    fx.done(self, ok, reason).await?
                }
            }
        }
        Ok(())
    }

    /// Log a record: renumbered to the store's generations, the restore plan added to a
    /// decision, and what the driver adds.
    async fn record(&mut self, fx: &mut impl Effects, rec: Record) -> Result<()> {
        fx.recording(self, &rec);
        let mut logged = self.log.render(&rec, |g| fx.generation(g)).await;
        fx.amend(self, &mut logged);
        self.log.write(logged).await
    }

    /// While the coordinator waits to grow the job back onto returned nodes, tell it the
    /// newest committed step: at once, then whenever it changes (the store asked every
    /// [`COMMIT_POLL`]).
    pub(crate) async fn poll_commits(&mut self) {
        let Some(g) = self.coord.watching_commits() else {
            self.commit_watch = None;
            return;
        };
        let fresh = self.commit_watch.is_none_or(|(wg, _, _)| wg != g);
        let due = self
            .commit_watch
            .is_some_and(|(_, at, _)| at.elapsed() >= COMMIT_POLL);
        if !fresh && !due {
            return;
        }
        match self.committed_steps().await.map(|s| s.last().copied()) {
            Ok(step) => {
                if fresh || self.commit_watch.is_some_and(|(_, _, last)| last != step) {
                    let now = self.now();
                    self.push(Event::Committed {
                        generation: g,
                        step,
                        now,
                    });
                }
                self.commit_watch = Some((g, Instant::now(), step));
            }
            Err(e) => warn!("looking for a new commit to grow at: {e}"),
        }
    }

    /// While the job's policy acts on replicas that disagree: every [`REPLICA_POLL`], read the
    /// record of each step the running generation committed since the last look, and tell
    /// the coordinator of the first whose replicas disagree.
    pub(crate) async fn poll_replicas(&mut self) {
        let Some((g, from)) = self.coord.watching_replicas() else {
            self.replica_watch = None;
            return;
        };
        let last = match self.replica_watch {
            Some((wg, at, last)) if wg == g => {
                if at.elapsed() < REPLICA_POLL {
                    return;
                }
                last
            }
            _ => from,
        };
        let steps = match self.committed_steps().await {
            Ok(s) => s,
            Err(e) => {
                warn!("looking for commits whose replicas disagree: {e}");
                return;
            }
        };
        let mut seen = last;
        for step in steps.into_iter().filter(|s| last.is_none_or(|l| *s > l)) {
            let home = match self.home_of(step).await {
                Ok(h) => h,
                Err(e) => {
                    warn!("finding the commit record of step {step}: {e}");
                    break;
                }
            };
            let root = match home.log().read_commit_root(&self.run, step).await {
                Ok((r, _, _)) => r,
                Err(e) => {
                    warn!("reading the commit record of step {step}: {e}");
                    break;
                }
            };
            seen = Some(step);
            let Some(rep) = root.replicas.filter(|r| r.mismatched()) else {
                continue;
            };
            let detail = rep
                .mismatches
                .first()
                .map(|m| m.describe())
                .unwrap_or_default();
            warn!(step, "the replicas of step {step} disagree: {detail}");
            self.mismatch_found = Some((g, step, rep.clone()));
            let now = self.now();
            self.push(Event::ReplicaMismatch {
                generation: g,
                step,
                suspects: rep.suspects(),
                detail,
                now,
            });
            break;
        }
        self.replica_watch = Some((g, Instant::now(), seen));
    }

    /// The stopped generation's ranks are gone: the `replica_mismatch` event the driver acted
    /// on is in the run's events log, the committer's or, where it was stopped before it
    /// logged it (killed at the stop's grace, or failed on the way), the driver's copy from
    /// the commit record (rank 0, the committer of the drivers' jobs).
    async fn log_mismatch_found(&mut self, fx: &mut impl Effects) {
        let Some((g, step, rep)) = self.mismatch_found.take() else {
            return;
        };
        let generation = fx.generation(g);
        let logged = match read_records::<LogEvent>(&self.store, &self.run).await {
            Ok(ev) => ev.iter().any(|l| {
                matches!(&l.record, LogEvent::ReplicaMismatch(m)
                    if m.step == step && m.generation == generation)
            }),
            Err(e) => {
                warn!("reading the events log for the mismatch of step {step}: {e}");
                false
            }
        };
        if logged {
            return;
        }
        let policy = self.coord.mismatch_policy();
        let ev = ReplicaMismatchEvent::of(step, generation, 0, policy, &rep);
        if let Err(e) = self.log.write(LogEvent::ReplicaMismatch(ev)).await {
            warn!("logging the replica mismatch of step {step}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use ckpt_store::testing::{memory_store, tiny_config};

    use super::*;
    use crate::Topology;
    use crate::coordinator::Config;
    use crate::records::sentinel::tests::one_of_three_differs;
    use ckpt_store::MismatchPolicy;

    /// A driver that only numbers generations (the store's are the coordinator's plus 4).
    struct Numbered;

    impl Effects for Numbered {
        fn generation(&self, g: u64) -> u64 {
            g + 4
        }
        async fn start(&mut self, _: &mut Executor, _: Start) -> Result<()> {
            Ok(())
        }
        async fn signal(&mut self, _: &mut Executor, _: u64, _: Vec<u32>, _: bool) -> Result<()> {
            Ok(())
        }
        async fn done(&mut self, _: &mut Executor, _: bool, _: String) -> Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn the_driver_logs_the_mismatch_it_acted_on_once_when_the_committer_did_not() {
        let store = memory_store(tiny_config());
        let mut cfg = Config::new(
            Topology {
                nodes: 3,
                ranks_per_node: 1,
                spares: 0,
            },
            "dp=3".parse().unwrap(),
        );
        cfg.on_replica_mismatch = MismatchPolicy::Rollback;
        let log = RecoveryLog::new(&store, "r", "supervisor").unwrap();
        let mut ex = Executor::new(
            Coordinator::new(cfg),
            store.clone(),
            "r",
            log,
            Order::NewestFirst,
        );
        let read = || async {
            read_records::<LogEvent>(&store, "r")
                .await
                .unwrap()
                .into_iter()
                .filter_map(|l| match l.record {
                    LogEvent::ReplicaMismatch(m) => Some(m),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        // The committer was killed before it logged the mismatch of step 15: the driver does.
        ex.mismatch_found = Some((1, 15, one_of_three_differs()));
        ex.log_mismatch_found(&mut Numbered).await;
        let m = read().await;
        assert_eq!(m.len(), 1, "{m:?}");
        assert_eq!((m[0].step, m[0].generation), (15, 5));
        assert_eq!(
            (m[0].suspects.clone(), m[0].suspect_nodes.clone()),
            (vec![1], vec![1])
        );
        assert_eq!(m[0].policy, "rollback");
        assert!(ex.mismatch_found.is_none());
        // Logged already (by the committer, or the driver before): not twice.
        ex.mismatch_found = Some((1, 15, one_of_three_differs()));
        ex.log_mismatch_found(&mut Numbered).await;
        assert_eq!(read().await.len(), 1);
        // The same step committed again in a later generation, and found to disagree again:
        // its own record.
        ex.mismatch_found = Some((2, 15, one_of_three_differs()));
        ex.log_mismatch_found(&mut Numbered).await;
        assert_eq!(
            read()
                .await
                .iter()
                .map(|m| m.generation)
                .collect::<Vec<_>>(),
            vec![5, 6]
        );
    }
}
