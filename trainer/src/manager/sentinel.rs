//! The sentinel's checks of this rank's saves (issue 29), as the manager sees them end:
//!
//! - **Replicas that disagree.** Every holder of a data-parallel replica hashes (a rotating
//!   sample of, or all of) its own copy while it saves ([`ckpt_store::SdcCheck`]), and the
//!   committer compares those ids with the writer's chunk ids before it commits
//!   ([`ckpt_store::compare_replicas`]). On the committing rank, a committed step whose
//!   record holds a mismatch is logged as a `replica_mismatch` event (tensor, box, chunk,
//!   the ranks and nodes on each side, the suspects); under [`MismatchPolicy::Stop`] the
//!   manager's next call fails naming it. Rolling back is a driver's business (`ckpt resume`,
//!   `ckpt agent`): the ranks only warn.
//! - **Stale state.** A tensor marked trainable whose chunk ids stay the same over
//!   `stale_after` consecutive checkpoints while steps advance is logged as
//!   `state_unchanged` (an error-level record when every trainable tensor of the rank is).
//!   Bytes, not versions, decide: a version that moved over an update of zero is normal, and
//!   a save path that hands over a stale buffer keeps versions moving.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use ckpt_recovery::records::{self, Event};
use ckpt_store::{Error, ErrorKind, Hash, MismatchPolicy, NdBox, ReplicaReport, Result};
use tracing::{error, warn};

use super::events::EventLog;
use crate::save::{SaveHandle, SaveReport, Stage};

/// At most this many saves are watched at once (older ones are dropped unlooked-at).
const MAX_WATCHED: usize = 16;

/// The most tensor names a `state_unchanged` record lists.
const MAX_LISTED: usize = 64;

/// A save the sentinel has not finished looking at.
struct Watch {
    handle: SaveHandle,
    /// Its written shards were compared with the last save's.
    stale_done: bool,
    /// The tensors registered as trainable when it was taken.
    trainable: Arc<HashSet<String>>,
}

/// The bytes of a shard over the last saves: its digest and the steps it held it since.
struct Seen {
    digest: Hash,
    steps: Vec<u64>,
}

/// The sentinel of one manager (see the module docs).
pub(crate) struct Sentinel {
    policy: MismatchPolicy,
    stale_after: u32,
    rank: u32,
    generation: u64,
    committer: bool,
    watched: VecDeque<Watch>,
    seen: HashMap<(String, NdBox), Seen>,
    /// Shards already reported unchanged (until their bytes change).
    flagged: HashSet<(String, NdBox)>,
    /// A mismatch under [`MismatchPolicy::Stop`]: the error every later call returns.
    stopped: Option<String>,
}

impl Sentinel {
    /// The sentinel of a rank (`committer`: it commits, so it logs mismatches).
    pub(crate) fn new(
        policy: MismatchPolicy,
        stale_after: u32,
        rank: u32,
        generation: u64,
        committer: bool,
    ) -> Self {
        Sentinel {
            policy,
            stale_after,
            rank,
            generation,
            committer,
            watched: VecDeque::new(),
            seen: HashMap::new(),
            flagged: HashSet::new(),
            stopped: None,
        }
    }

    /// Watch a save just started, of which the tensors in `trainable` should change.
    pub(crate) fn watch(&mut self, h: &SaveHandle, trainable: HashSet<String>) {
        if h.is_skipped() {
            return;
        }
        if self.watched.len() >= MAX_WATCHED {
            self.watched.pop_front();
        }
        self.watched.push_back(Watch {
            handle: h.clone(),
            stale_done: false,
            trainable: Arc::new(trainable),
        });
    }

    /// Forget the bytes seen so far (a restore or rollback put other state in place).
    pub(crate) fn restored(&mut self) {
        self.seen.clear();
        self.flagged.clear();
    }

    /// Look at the watched saves that ended: stale state of those persisted (oldest first),
    /// mismatches of those committed. Fails while a mismatch under `stop` stands.
    pub(crate) fn poll(&mut self, events: &mut EventLog) -> Result<()> {
        while let Some(w) = self.watched.front_mut() {
            let stage = w.handle.stage();
            let report = w.handle.report();
            let trainable = w.trainable.clone();
            match stage {
                Stage::Snapshotting | Stage::Snapshotted => break,
                Stage::Persisted => {
                    if !w.stale_done {
                        w.stale_done = true;
                        self.check_stale(&report, &trainable, events);
                    }
                    if !self.committer {
                        self.watched.pop_front();
                        continue;
                    }
                    // The committer waits for the commit to see the replicas.
                    break;
                }
                Stage::Committed => {
                    if !w.stale_done {
                        self.check_stale(&report, &trainable, events);
                    }
                    self.watched.pop_front();
                    if let Some(r) = &report.replicas
                        && self.committer
                        && r.mismatched()
                    {
                        self.mismatch(report.step, r, events);
                    }
                }
                Stage::Failed(_) | Stage::Skipped(_) => {
                    self.watched.pop_front();
                }
            }
        }
        match &self.stopped {
            Some(m) => Err(Error::new(ErrorKind::Corrupt, m.clone())),
            None => Ok(()),
        }
    }

    /// The replicas of `step` as a remote commit compared them (the drain of one machine of
    /// several committed it there): a mismatch is reported as at a commit.
    pub(crate) fn compared(&mut self, step: u64, r: &ReplicaReport, events: &mut EventLog) {
        if r.mismatched() {
            self.mismatch(step, r, events);
        }
    }

    /// A committed step whose replicas disagree: the event, and the stop under `stop`.
    fn mismatch(&mut self, step: u64, r: &ReplicaReport, events: &mut EventLog) {
        let ev =
            records::ReplicaMismatchEvent::of(step, self.generation, self.rank, self.policy, r);
        let detail = ev.detail.clone();
        error!(step, policy = %self.policy, "replica mismatch: {detail}");
        events.log(Event::ReplicaMismatch(ev));
        if self.policy == MismatchPolicy::Stop && self.stopped.is_none() {
            self.stopped = Some(format!(
                "the replicas of step {step} disagree (policy stop): {detail}; `ckpt inspect` shows the record, `ckpt verify` the damage"
            ));
        }
    }

    /// Compare the trainable shards of a persisted save with what the saves before held.
    fn check_stale(&mut self, r: &SaveReport, trainable: &HashSet<String>, events: &mut EventLog) {
        if self.stale_after < 2 {
            return;
        }
        let mut newly: Vec<String> = Vec::new();
        let mut unchanged = 0u64;
        let mut total = 0u64;
        let mut steps: Vec<u64> = Vec::new();
        for d in r.written.iter().filter(|d| trainable.contains(&d.name)) {
            total += 1;
            let key = (d.name.clone(), d.bbox.clone());
            let e = self.seen.entry(key.clone()).or_insert_with(|| Seen {
                digest: d.digest,
                steps: Vec::new(),
            });
            if e.digest != d.digest || e.steps.last().is_some_and(|s| *s >= r.step) {
                e.digest = d.digest;
                e.steps.clear();
                self.flagged.remove(&key);
            }
            e.steps.push(r.step);
            let keep = self.stale_after as usize;
            if e.steps.len() > keep {
                e.steps.remove(0);
            }
            if e.steps.len() >= keep {
                unchanged += 1;
                if self.flagged.insert(key) {
                    newly.push(d.name.clone());
                    if steps.is_empty() {
                        steps = e.steps.clone();
                    }
                }
            }
        }
        if newly.is_empty() {
            return;
        }
        let all = unchanged == total;
        let count = newly.len() as u64;
        newly.sort();
        newly.dedup();
        let listed: Vec<String> = newly.iter().take(MAX_LISTED).cloned().collect();
        let detail = format!(
            "{count} trainable tensor(s) of rank {} kept the same bytes over the checkpoints of steps {steps:?}{} (first: {:?}): a save path handing over stale buffers, or a layer that does not train",
            self.rank,
            if all {
                ", every trainable tensor of the rank"
            } else {
                ""
            },
            listed.first().cloned().unwrap_or_default(),
        );
        if all {
            error!(step = r.step, rank = self.rank, "state unchanged: {detail}");
        } else {
            warn!(step = r.step, rank = self.rank, "state unchanged: {detail}");
        }
        events.log(Event::StateUnchanged(records::StateUnchanged {
            step: r.step,
            rank: self.rank,
            steps,
            tensors: listed,
            count,
            trainable: total,
            all,
            detail,
        }));
    }
}
