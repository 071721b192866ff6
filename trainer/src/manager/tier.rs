//! A local tier under the remote store (issue 28): saves persist and commit to the node's disk
//! at its speed ([`LocalTier`]); on the committing rank a [`Drainer`] copies each step
//! committed there to the remote store behind the training ([`ckpt_store::drain_step`]: new
//! chunks only, the same commit protocol, fencing and leases), paced by the persist governor's
//! rate. The drainer runs on its own thread: a step committed while it drains waits, newest
//! first (older waiting steps are skipped, with a `drain_skipped` event, rather than fall
//! further behind); a failed drain (the remote down or failing) is tried again with a backoff;
//! a job restarted after a crash finds the local steps not yet remote and drains the newest.
//! One node of several ([`ckpt_store::drain_node`]) does not choose alone what to skip: a step
//! commits on the store only once every node drained its ranks, so before its newest step a
//! node drains an older one that another node already drained (it *follows*), and keeps such
//! steps from its local retention until then.
//! After each drain it applies the retention rules: the remote's (`keep_last`,
//! `keep_every`), and the local tier's (keep the newest [`LocalTier::keep_last`], never a step
//! still draining).
//!
//! Restores read each chunk from the fastest place that holds it ([`TieredSource`]): the
//! local tier (hash-checked; a damaged or missing chunk is read from the remote store and a
//! `local_tier_damaged` event says so), then peer replicas, then the remote store.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use ckpt_recovery::peer::PeerSource;
use ckpt_recovery::records::{self, DrainMetrics, Event};
use ckpt_store::{
    ChunkRef, ChunkSource, DrainOptions, ErrorKind, GcOptions, ReplicaReport, Store, TierSource,
    drain_node, drain_step, node_step_to_follow, steps_to_follow,
};
use parking_lot::{Condvar, Mutex};
use tracing::{debug, info, warn};

use crate::save::{Pacer, PersistRate, SaveHandle, Stage, runtime};

/// A node's local tier: where saves persist and commit first.
#[derive(Debug, Clone)]
pub struct LocalTier {
    /// The tier (a directory on the node's disk, in the store format).
    pub store: Store,
    /// Keep the newest N committed steps locally (at least 1; 2 by default); a step still
    /// draining is kept whatever N says.
    pub keep_last: usize,
}

impl LocalTier {
    /// A tier at `store`, keeping the newest 2 steps.
    pub fn new(store: Store) -> Self {
        LocalTier {
            store,
            keep_last: 2,
        }
    }
}

/// The longest pause between tries of a failing drain.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// What the drainer thread and the manager share.
struct Shared {
    local: Store,
    remote: Store,
    run: String,
    rank: u32,
    /// The job's generation: it drains what earlier generations left local only, fenced by
    /// its own.
    generation: u64,
    keep_local: usize,
    keep_last: Option<usize>,
    keep_every: Option<u64>,
    grace: Duration,
    /// One node of a job of several machines: the local tier holds node commits of this
    /// node's ranks ([`ckpt_store::NodeCommit`]), drained with [`drain_node`].
    node: bool,
    state: Mutex<State>,
    wake: Condvar,
    rate: Arc<PersistRate>,
}

#[derive(Default)]
struct State {
    /// The newest locally committed step waiting for its drain, and when it committed.
    pending: Option<(u64, Instant)>,
    /// The step being drained.
    draining: Option<u64>,
    /// The newest step drained (or found remote).
    drained: Option<u64>,
    /// Steps skipped since the last drain ended.
    skipped: Vec<u64>,
    /// Records for the manager to log.
    events: Vec<Event>,
    metrics: Vec<DrainMetrics>,
    /// Replicas compared by a remote commit this node's drain made (one node of several:
    /// the sentinel's comparison happens there), for the manager's sentinel.
    replicas: Vec<(u64, ReplicaReport)>,
    stop: bool,
    /// A newer job owns the run on the remote store: the drainer stopped, with why.
    fenced: Option<String>,
}

/// What the drainer has for the manager.
pub(crate) struct Polled {
    /// Records to log.
    pub events: Vec<Event>,
    /// The drains' figures.
    pub metrics: Vec<DrainMetrics>,
    /// Replicas the remote commits of this node's drains compared, by step.
    pub replicas: Vec<(u64, ReplicaReport)>,
}

/// The drainer of a committing rank (see the module docs).
pub(crate) struct Drainer {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The save whose local commit is awaited, to queue it.
    watched: Option<SaveHandle>,
}

/// The settings a drainer takes from the manager.
pub(crate) struct DrainerConfig<'a> {
    pub tier: &'a LocalTier,
    pub remote: &'a Store,
    pub run: &'a str,
    pub rank: u32,
    pub generation: u64,
    pub keep_last: Option<usize>,
    pub keep_every: Option<u64>,
    pub grace: Duration,
    pub rate: Arc<PersistRate>,
    /// The tier holds node commits (see [`Shared::node`]).
    pub node: bool,
}

impl Drainer {
    /// Start the drainer thread; it first looks for local steps not yet remote (a restarted
    /// job finishes their drain).
    pub(crate) fn start(c: DrainerConfig<'_>) -> ckpt_store::Result<Drainer> {
        let shared = Arc::new(Shared {
            local: c.tier.store.clone(),
            remote: c.remote.clone(),
            run: c.run.to_string(),
            rank: c.rank,
            generation: c.generation,
            keep_local: c.tier.keep_last.max(1),
            keep_last: c.keep_last,
            keep_every: c.keep_every,
            grace: c.grace,
            node: c.node,
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            rate: c.rate,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ckpt-drain-{}", c.rank))
            .spawn(move || {
                s.recover();
                s.run_loop();
            })
            .map_err(|e| ckpt_store::Error::internal(format!("starting the drain thread: {e}")))?;
        Ok(Drainer {
            shared,
            thread: Some(thread),
            watched: None,
        })
    }

    /// A save started: its step is queued for the drain once it commits locally.
    pub(crate) fn watch(&mut self, h: &SaveHandle) {
        if !h.is_skipped() {
            self.watched = Some(h.clone());
        }
    }

    /// Queue the watched save once committed; take what the drainer has to log.
    pub(crate) fn poll(&mut self) -> Polled {
        self.queue_committed();
        let mut st = self.shared.state.lock();
        Polled {
            events: std::mem::take(&mut st.events),
            metrics: std::mem::take(&mut st.metrics),
            replicas: std::mem::take(&mut st.replicas),
        }
    }

    /// Queue the watched save for the drain once it committed locally (its events and
    /// figures stay for [`Drainer::poll`]).
    fn queue_committed(&mut self) {
        if let Some(h) = &self.watched {
            match h.stage() {
                Stage::Committed => {
                    self.shared.enqueue(h.step());
                    self.watched = None;
                }
                Stage::Failed(_) | Stage::Skipped(_) => self.watched = None,
                _ => {}
            }
        }
    }

    /// The local tier is full (a save failed there): drop every local step but the newest and
    /// what still drains (the remote store holds them), freeing their chunks.
    pub(crate) fn make_room(&self) {
        let s = &self.shared;
        // No grace: a save in flight defers the sweep by its writer lease, whatever the grace.
        let opts = GcOptions {
            keep_last: Some(1),
            grace: Duration::ZERO,
            runs: vec![s.run.clone()],
            ..GcOptions::default()
        };
        match runtime().block_on(s.local.gc().run(&opts, s.local.now())) {
            Ok(r) => warn!(
                tier = %s.local.url(),
                deleted = ?r.steps_deleted,
                freed = r.bytes_freed,
                "the local tier is full: it keeps only its newest step (and what still drains) until the next save fits"
            ),
            Err(e) => {
                warn!(tier = %s.local.url(), "making room in the full local tier failed: {e}")
            }
        }
    }

    /// Whether a drain is running or waiting (the persist governor counts it as a persist).
    pub(crate) fn busy(&self) -> bool {
        let st = self.shared.state.lock();
        st.draining.is_some() || st.pending.is_some()
    }

    /// Wait until the newest step queued (and `last`, the last save, once it commits) is
    /// drained, or `within` passes; `Err` says what is still local only. One node of several
    /// (with `wait_commit`) also waits for the step to commit on the store: the other nodes'
    /// drains land it.
    pub(crate) fn wait_drained(
        &mut self,
        within: Duration,
        wait_commit: bool,
    ) -> ckpt_store::Result<()> {
        let deadline = Instant::now() + within;
        if let Some(h) = self.watched.clone()
            && h.wait_committed(within).is_ok()
        {
            self.queue_committed();
        }
        let mut st = self.shared.state.lock();
        loop {
            if let Some(why) = &st.fenced {
                return Err(ckpt_store::Error::new(ErrorKind::Fenced, why.clone()));
            }
            if st.pending.is_none() && st.draining.is_none() {
                let drained = st.drained;
                drop(st);
                return match drained {
                    Some(step) if self.shared.node && wait_commit => {
                        self.shared.wait_remote_commit(step, deadline, within)
                    }
                    _ => Ok(()),
                };
            }
            let now = Instant::now();
            if now >= deadline {
                let step = st.draining.or(st.pending.map(|p| p.0));
                return Err(ckpt_store::Error::new(
                    ErrorKind::Incomplete,
                    format!(
                        "step {} of run {} is committed in the local tier {} but not yet drained to {} after {:.0} s; a job resumed on this node finishes the drain, or `ckpt drain --local-tier DIR` does",
                        step.map_or("?".into(), |s| s.to_string()),
                        self.shared.run,
                        self.shared.local.url(),
                        self.shared.remote.url(),
                        within.as_secs_f64()
                    ),
                ));
            }
            self.shared.wake.wait_for(&mut st, deadline - now);
        }
    }
}

impl Drop for Drainer {
    fn drop(&mut self) {
        self.shared.state.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Shared {
    /// A step committed locally: it waits for the drain, replacing (skipping) an older one
    /// that waits.
    fn enqueue(&self, step: u64) {
        let mut st = self.state.lock();
        if st.drained.is_some_and(|d| d >= step) || st.draining == Some(step) {
            return;
        }
        if let Some((old, _)) = st.pending
            && old < step
        {
            warn!(
                skipped = old,
                newer = step,
                "the drain to the remote store is behind: step {old} is skipped for step {step}"
            );
            st.skipped.push(old);
            st.events.push(Event::DrainSkipped(records::DrainSkipped {
                step: old,
                newer: step,
                rank: self.rank,
            }));
        }
        if st.pending.is_none_or(|(old, _)| old < step) {
            st.pending = Some((step, Instant::now()));
        }
        drop(st);
        self.wake.notify_all();
    }

    /// At start: the newest local step that is not committed remotely waits for its drain
    /// (what a killed job left local only).
    fn recover(&self) {
        let found = runtime().block_on(async {
            let local = self.local_steps().await?;
            let remote_newest = self.remote.log().latest_committed(&self.run).await?;
            Ok::<_, ckpt_store::Error>((local, remote_newest))
        });
        match found {
            Ok((local, remote_newest)) => {
                self.state.lock().drained = remote_newest;
                // One node of several: what an earlier generation committed on this node
                // commits on the store only once every node of that generation drained it,
                // and a lost node never will; the restarted job resumed from the store's
                // newest step and saves these steps again, so they are left to retention.
                if self.node {
                    self.clear_stale_markers(remote_newest);
                    if let Some(&newest) = local.last()
                        && remote_newest.is_none_or(|r| newest > r)
                    {
                        info!(
                            step = newest,
                            "this node committed steps the store lacks; an earlier generation \
                             saved them and the job resumed from the store: not drained"
                        );
                    }
                    return;
                }
                if let Some(&newest) = local.last()
                    && remote_newest.is_none_or(|r| newest > r)
                {
                    info!(
                        step = newest,
                        "a local step is not on the remote store yet: draining it"
                    );
                    self.enqueue(newest);
                }
            }
            Err(e) => warn!("looking for local steps to drain: {e}"),
        }
    }

    /// The steps committed in the local tier (node commits, for one node of several).
    async fn local_steps(&self) -> ckpt_store::Result<Vec<u64>> {
        if self.node {
            self.local.log().node_committed_steps(&self.run).await
        } else {
            self.local.log().committed_steps(&self.run).await
        }
    }

    fn run_loop(&self) {
        let mut backoff = Duration::from_secs(1);
        loop {
            let (mut step, committed_at) = {
                let mut st = self.state.lock();
                loop {
                    if st.stop {
                        return;
                    }
                    if let Some(p) = st.pending.take() {
                        st.draining = Some(p.0);
                        break p;
                    }
                    self.wake.wait(&mut st);
                }
            };
            if let Some(older) = self.node.then(|| self.follow(step)).flatten() {
                // The newest waits again, behind the step another node drained.
                let mut st = self.state.lock();
                match st.pending {
                    Some((newer, _)) if newer > step => {
                        st.skipped.push(step);
                        st.events.push(Event::DrainSkipped(records::DrainSkipped {
                            step,
                            newer,
                            rank: self.rank,
                        }));
                    }
                    _ => st.pending = Some((step, committed_at)),
                }
                st.draining = Some(older);
                step = older;
            }
            match self.drain(step, committed_at) {
                Ok(()) => backoff = Duration::from_secs(1),
                Err(e) => {
                    warn!(
                        step,
                        "drain to the remote store failed (tried again in {backoff:?}): {e}"
                    );
                    let mut st = self.state.lock();
                    st.events.push(Event::DrainFailed(records::DrainFailed {
                        step,
                        rank: self.rank,
                        error: e.to_string(),
                        error_kind: e.kind().as_str().to_string(),
                        retry_in_s: backoff.as_secs_f64(),
                    }));
                    st.draining = None;
                    // A fenced drain stops: a newer job owns the run on the remote store.
                    if e.kind() == ErrorKind::Fenced {
                        st.pending = None;
                        st.fenced = Some(e.to_string());
                        self.wake.notify_all();
                        return;
                    }
                    if st.pending.is_none_or(|(p, _)| p < step) {
                        st.pending = Some((step, committed_at));
                    }
                    self.wake.notify_all();
                    let _ = self.wake.wait_for(&mut st, backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// One node of several, about to drain `newest`: the newest older step that another
    /// node's drain already brought to the store (its ranks' manifests are there, the commit
    /// waits for this node's) and that this node committed in this generation. Nodes that
    /// skip steps by their own timing could otherwise drain disjoint steps, and the store
    /// would get none whole.
    fn follow(&self, newest: u64) -> Option<u64> {
        let drained = self.state.lock().drained;
        let found = runtime().block_on(node_step_to_follow(
            &self.local,
            &self.remote,
            &self.run,
            (newest, drained),
            self.rank,
            self.generation,
        ));
        match found {
            Ok(Some(s)) => {
                info!(
                    step = s,
                    newest,
                    "another node drained step {s}: this node drains its ranks of it before step {newest}"
                );
                Some(s)
            }
            Ok(None) => None,
            Err(e) => {
                debug!("looking for a step another node drained: {e}");
                None
            }
        }
    }

    /// One node of several, at start: delete the drain markers a killed or failed drain left
    /// (steps the store's newest commit supersedes, or of an earlier generation), which would
    /// keep their steps from retention for good.
    fn clear_stale_markers(&self, remote_newest: Option<u64>) {
        let cleared = runtime().block_on(async {
            let mut n = Vec::new();
            for d in self.local.log().pending_drains(&self.run).await? {
                if d.generation < self.generation || remote_newest.is_some_and(|r| d.step <= r) {
                    self.local
                        .log()
                        .delete_drain_marker(&self.run, d.step)
                        .await?;
                    n.push(d.step);
                }
            }
            Ok::<_, ckpt_store::Error>(n)
        });
        match cleared {
            Ok(n) if !n.is_empty() => {
                info!(steps = ?n, "deleted drain markers left by earlier drains")
            }
            Ok(_) => {}
            Err(e) => warn!("deleting stale drain markers: {e}"),
        }
    }

    /// One node of several: wait until `step` is committed on the store (the other nodes'
    /// drains land it), until `deadline`.
    fn wait_remote_commit(
        &self,
        step: u64,
        deadline: Instant,
        within: Duration,
    ) -> ckpt_store::Result<()> {
        let key = self.remote.keys().commit(&self.run, step);
        let mut pause = Duration::from_millis(20);
        loop {
            if runtime().block_on(self.remote.objects().exists(&key))? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(ckpt_store::Error::new(
                    ErrorKind::Incomplete,
                    format!(
                        "step {step} of run {run}: this node's ranks are on {remote}, but the step \
                         is not committed there after {secs:.0} s: another machine's ranks have \
                         not been drained yet (each machine's job, or `ckpt drain --local-tier \
                         DIR` there, drains them)",
                        run = self.run,
                        remote = self.remote.url(),
                        secs = within.as_secs_f64()
                    ),
                ));
            }
            std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }

    /// Drain `step`, then apply retention on both tiers.
    fn drain(&self, step: u64, committed_at: Instant) -> ckpt_store::Result<()> {
        let pacer = Arc::new(tokio::sync::Mutex::new(Pacer::new(
            self.rate.clone(),
            Box::new(|| false),
        )));
        let opts = DrainOptions {
            pace: Some(Arc::new(move |n| {
                let pacer = pacer.clone();
                Box::pin(async move { pacer.lock().await.admit(n as usize).await })
            })),
            writer: format!("drain-{}-{}", self.run, self.rank),
            generation: Some(self.generation),
            ..DrainOptions::default()
        };
        let (local, remote, run) = (&self.local, &self.remote, self.run.as_str());
        let r = if self.node {
            runtime().block_on(drain_node(local, remote, run, step, &opts))?
        } else {
            runtime().block_on(drain_step(local, remote, run, step, &opts))?
        };
        let lag_steps = runtime()
            .block_on(self.local_steps())
            .map(|s| s.iter().filter(|&&x| x > step).count() as u64)
            .unwrap_or(0);
        // Retention before the step counts as drained: `finish` waits for both. The remote
        // store's runs where the step committed (for one node of several, the drain of the
        // node whose ranks landed last).
        self.retention(step, r.remote_committed);
        {
            let mut st = self.state.lock();
            st.draining = None;
            st.drained = Some(st.drained.map_or(step, |d| d.max(step)));
            let skipped = std::mem::take(&mut st.skipped);
            if self.node
                && let Some(rep) = r.replicas.clone()
            {
                st.replicas.push((step, rep));
            }
            st.metrics.push(DrainMetrics {
                step,
                rank: self.rank,
                objects_sent: r.objects_sent,
                bytes_sent: r.bytes_sent,
                bytes_present: r.bytes_present,
                seconds: r.seconds,
                lag_s: committed_at.elapsed().as_secs_f64(),
                lag_steps,
                skipped,
            });
        }
        self.wake.notify_all();
        Ok(())
    }

    /// Retention after `step` drained: the remote's rules on the remote store, and the newest
    /// `keep_local` on the local tier (what still drains is kept by its marker).
    fn retention(&self, step: u64, remote_committed: bool) {
        let run = self.run.clone();
        let protect = vec![(run.clone(), step)];
        let mut local_protect = protect.clone();
        if self.node {
            // Steps another node drained that this one may still follow.
            match runtime().block_on(self.remote.log().list_steps(&run)) {
                Ok(remote) => local_protect.extend(
                    steps_to_follow(u64::MAX, None, &remote, self.rank)
                        .into_iter()
                        .map(|s| (run.clone(), s)),
                ),
                Err(e) => {
                    warn!("listing the store's steps (local retention skipped this time): {e}");
                    return;
                }
            }
        }
        let remote = GcOptions {
            keep_last: self.keep_last,
            keep_every: self.keep_every,
            grace: self.grace,
            runs: vec![run.clone()],
            protect: protect.clone(),
            ..GcOptions::default()
        };
        let local = GcOptions {
            keep_last: Some(self.keep_local),
            grace: self.grace,
            runs: vec![run],
            protect: local_protect,
            ..GcOptions::default()
        };
        for (store, opts, which) in [
            (&self.remote, remote, "remote"),
            (&self.local, local, "local"),
        ] {
            if opts.keep_last.is_none() && opts.keep_every.is_none()
                || which == "remote" && !remote_committed
            {
                continue;
            }
            match runtime().block_on(store.gc().run(&opts, store.now())) {
                Ok(r) if !r.steps_deleted.is_empty() => info!(
                    tier = which,
                    deleted = ?r.steps_deleted,
                    "retention deleted old checkpoints"
                ),
                Ok(_) => {}
                Err(e) => warn!(tier = which, "retention failed: {e}"),
            }
        }
    }
}

/// A restore's chunk source with a local tier: the local tier first (hash-checked by the
/// reader), then peer replicas; what neither has comes from the remote store.
pub(crate) struct TieredSource {
    local: Option<TierSource>,
    peers: Option<Arc<PeerSource>>,
}

impl TieredSource {
    pub(crate) fn new(local: Option<Store>, peers: Option<Arc<PeerSource>>) -> Self {
        TieredSource {
            local: local.map(TierSource::new),
            peers,
        }
    }

    /// Of the raw bytes the peers served, those read straight out of the memory of an agent on
    /// this machine.
    pub(crate) fn peer_bytes_mapped(&self) -> u64 {
        self.peers.as_ref().map_or(0, |p| p.mapped_bytes())
    }

    /// Whether it has anything to serve.
    pub(crate) fn has_any(&self) -> bool {
        self.local.is_some() || self.peers.is_some()
    }

    /// The local tier's figures: stored bytes and raw bytes it served, chunks damaged there.
    pub(crate) fn local_served(&self) -> (u64, u64, u64) {
        self.local.as_ref().map_or((0, 0, 0), |l| {
            (
                l.stored_bytes.load(Ordering::Relaxed),
                l.raw_bytes.load(Ordering::Relaxed),
                l.damaged.load(Ordering::Relaxed),
            )
        })
    }
}

#[async_trait]
impl ChunkSource for TieredSource {
    async fn fetch(&self, r: &ChunkRef) -> Option<Bytes> {
        if let Some(l) = &self.local
            && let Some(b) = l.fetch(r).await
        {
            return Some(b);
        }
        match &self.peers {
            Some(p) => p.fetch(r).await,
            None => None,
        }
    }

    /// The local tier's chunks are checked here, so a refused chunk came from the peers.
    fn refused(&self, r: &ChunkRef) {
        if let Some(p) = &self.peers {
            p.refused(r);
        }
    }
}

/// The steps of `run` committed in either tier, newest last.
pub(crate) fn committed_in_either(
    local: &Store,
    remote: &Store,
    run: &str,
) -> ckpt_store::Result<Vec<u64>> {
    runtime().block_on(async {
        let mut all: BTreeSet<u64> = local
            .log()
            .committed_steps(run)
            .await?
            .into_iter()
            .collect();
        all.extend(remote.log().committed_steps(run).await?);
        Ok(all.into_iter().collect())
    })
}
