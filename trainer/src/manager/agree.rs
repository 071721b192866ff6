//! The step a job of several machines resumes from when no driver chose it (issue 28).
//!
//! Each machine's local tier holds node commits of that machine's ranks only
//! ([`ckpt_store::NodeCommit`]), so a step that a killed job committed on every machine's tier
//! and did not drain is whole nowhere, and a rank alone cannot tell that the other machines
//! hold it. Under `ckpt resume` the node agents agree and drain before the ranks start; a job
//! started another way (its own launcher) gives the manager the job's all-gather
//! ([`AllGather`], [`ManagerConfig::all_gather`](super::ManagerConfig::all_gather)) and
//! [`CheckpointManager::restore_latest`](super::CheckpointManager::restore_latest) agrees
//! through it, as `ckpt.dcp` does through `torch.distributed`:
//!
//! 1. each machine's first rank lists its tier's node commits, rank 0 the store's newest
//!    committed step, and every rank gathers what all found;
//! 2. the newest step committed on every machine's tier and newer than the store's is wanted;
//!    each machine's first rank drains its ranks of it ([`ckpt_store::drain_node`]), and the
//!    last drain commits it on the store;
//! 3. every rank gathers the outcomes: the wanted step if a drain committed it and none
//!    failed, else the store's newest (a warning says why).
//!
//! Every rank reaches every gather, whatever failed before it, so the ranks fail or succeed
//! alike and none waits for a rank that gave up.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_store::{DrainOptions, Error, ErrorKind, Result, Store};
use parking_lot::{Condvar, Mutex};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::save::{CheckpointerConfig, runtime};

/// The job's all-gather, in the job's own channel (NCCL, MPI, a TCP rendezvous): every rank of
/// the job calls it with its bytes, as many times and in the same order as every other rank,
/// and it returns every rank's bytes, indexed by rank. [`AllGather::in_process`] is one for
/// ranks that run as threads of one process.
#[derive(Clone)]
pub struct AllGather(Arc<GatherFn>);

type GatherFn = dyn Fn(Vec<u8>) -> Result<Vec<Vec<u8>>> + Send + Sync;

impl std::fmt::Debug for AllGather {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AllGather(..)")
    }
}

impl AllGather {
    /// An all-gather that calls `f` (this rank's bytes in, every rank's out, by rank).
    pub fn new(f: impl Fn(Vec<u8>) -> Result<Vec<Vec<u8>>> + Send + Sync + 'static) -> Self {
        AllGather(Arc::new(f))
    }

    /// One all-gather for each of `world` ranks that run as threads of this process (index
    /// `r` is rank `r`'s). A call waits at most `timeout` for the other ranks, then fails
    /// naming the ranks that did not come.
    pub fn in_process(world: u32, timeout: Duration) -> Vec<AllGather> {
        let shared = Arc::new(Rendezvous {
            world: world as usize,
            state: Mutex::new(Round::default()),
            cv: Condvar::new(),
        });
        (0..world as usize)
            .map(|rank| {
                let s = shared.clone();
                AllGather::new(move |mine| s.gather(rank, mine, timeout))
            })
            .collect()
    }

    /// Gather `mine` from every rank, as JSON.
    fn gather<T: Serialize + DeserializeOwned>(&self, mine: &T) -> Result<Vec<T>> {
        let bytes = serde_json::to_vec(mine)
            .map_err(|e| Error::internal(format!("encoding what this rank found: {e}")))?;
        (self.0)(bytes)?
            .iter()
            .enumerate()
            .map(|(r, b)| {
                serde_json::from_slice(b).map_err(|e| {
                    Error::invalid(format!(
                        "the all-gather returned for rank {r} what no rank sent ({e}): every rank must call it with its own bytes, in the same order"
                    ))
                })
            })
            .collect()
    }
}

/// The meeting point of [`AllGather::in_process`].
struct Rendezvous {
    world: usize,
    state: Mutex<Round>,
    cv: Condvar,
}

#[derive(Default)]
struct Round {
    /// Rounds completed.
    done: u64,
    slots: Vec<Option<Vec<u8>>>,
    /// The last round's result, until every rank took it.
    result: Option<Arc<Vec<Vec<u8>>>>,
    /// Ranks that have not taken the last round's result yet.
    left: usize,
}

impl Rendezvous {
    fn gather(&self, rank: usize, mine: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock();
        let late = |st: &Round| {
            let missing: Vec<usize> = (0..self.world)
                .filter(|r| st.slots.get(*r).is_none_or(Option::is_none))
                .collect();
            Error::new(
                ErrorKind::Incomplete,
                format!(
                    "all-gather of {} ranks: rank(s) {missing:?} did not come within {timeout:?}",
                    self.world
                ),
            )
        };
        // The last round is still being taken by slower ranks.
        while st.result.is_some() {
            if self.cv.wait_until(&mut st, deadline).timed_out() {
                return Err(late(&st));
            }
        }
        if st.slots.len() != self.world {
            st.slots = vec![None; self.world];
        }
        st.slots[rank] = Some(mine);
        let round = st.done;
        if st.slots.iter().all(Option::is_some) {
            let all = st.slots.iter_mut().map(|s| s.take().unwrap()).collect();
            st.result = Some(Arc::new(all));
            st.left = self.world;
            st.done += 1;
            self.cv.notify_all();
        }
        while st.done == round {
            if self.cv.wait_until(&mut st, deadline).timed_out() {
                let e = late(&st);
                st.slots[rank] = None;
                return Err(e);
            }
        }
        let out = st.result.as_ref().map(|r| r.as_ref().clone());
        st.left -= 1;
        if st.left == 0 {
            st.result = None;
            self.cv.notify_all();
        }
        out.ok_or_else(|| Error::internal("all-gather round ended without a result"))
    }
}

/// What a rank found: its machine's node commits (the machine's first rank), the store's
/// newest step (rank 0), or the error it met.
#[derive(Serialize, Deserialize)]
struct Found {
    steps: Option<Vec<u64>>,
    latest: Option<u64>,
    error: Option<(String, String)>,
}

/// How a machine's drain of the wanted step went (its first rank).
#[derive(Serialize, Deserialize, Default)]
struct Drained {
    committed: bool,
    error: Option<String>,
}

/// The step every rank of a job of several machines (`cfg.node_ranks`, each with its tier
/// `local` over `remote`) resumes from, agreed through `all` (see the module docs). `None`:
/// nothing committed on the store or on every machine's tier. `before`: how what this rank
/// did before failed, if it did (its generation fenced): it is gathered like an error of the
/// agreement's own, and every rank fails with it.
pub(crate) fn agreed_step(
    all: &AllGather,
    remote: &Store,
    local: &Store,
    cfg: &CheckpointerConfig,
    before: Result<()>,
) -> Result<Option<u64>> {
    let run = &cfg.run;
    let node = cfg.node_ranks.as_deref().unwrap_or(&[]);
    let first = node.iter().min().copied() == Some(cfg.rank);
    let rt = runtime();
    let mine = rt.block_on(async {
        before?;
        let steps = if first {
            Some(local.log().node_committed_steps(run).await?)
        } else {
            None
        };
        let latest = if cfg.rank == 0 {
            remote.log().latest_committed(run).await?
        } else {
            None
        };
        Ok::<_, Error>(Found {
            steps,
            latest,
            error: None,
        })
    });
    let mine = mine.unwrap_or_else(|e| Found {
        steps: None,
        latest: None,
        error: Some((e.kind().as_str().to_string(), e.to_string())),
    });
    let everyone = all.gather(&mine)?;
    if let Some((r, (kind, msg))) = everyone
        .iter()
        .enumerate()
        .find_map(|(r, f)| f.error.as_ref().map(|e| (r, e)))
    {
        return Err(Error::new(
            kind_named(kind),
            format!("choosing the step of run {run} to resume from, rank {r}: {msg}"),
        ));
    }
    let latest = everyone.first().and_then(|f| f.latest);
    let tiers: Vec<BTreeSet<u64>> = everyone
        .iter()
        .filter_map(|f| f.steps.as_ref())
        .map(|s| s.iter().copied().collect())
        .collect();
    let wanted = tiers
        .split_first()
        .and_then(|(head, rest)| {
            head.iter()
                .copied()
                .filter(|s| rest.iter().all(|t| t.contains(s)))
                .max()
        })
        .filter(|&s| latest.is_none_or(|l| s > l));
    let Some(wanted) = wanted else {
        return Ok(latest);
    };
    let outcome = if first {
        info!(
            step = wanted,
            "every machine's tier holds a step the store lacks: draining this machine's part"
        );
        let opts = DrainOptions {
            writer: format!("resume-drain-{}", cfg.rank),
            generation: Some(cfg.generation),
            ..DrainOptions::default()
        };
        let drained = rt.block_on(async {
            tokio::time::timeout(
                cfg.commit_timeout,
                ckpt_store::drain_node(local, remote, run, wanted, &opts),
            )
            .await
        });
        match drained {
            Ok(Ok(r)) => Drained {
                committed: r.remote_committed,
                error: None,
            },
            Ok(Err(e)) => Drained {
                committed: false,
                error: Some(e.to_string()),
            },
            Err(_) => Drained {
                committed: false,
                error: Some(format!(
                    "not done after {:?} (the commit timeout)",
                    cfg.commit_timeout
                )),
            },
        }
    } else {
        Drained::default()
    };
    let outcomes = all.gather(&outcome)?;
    let failed = outcomes
        .iter()
        .enumerate()
        .find_map(|(r, o)| o.error.as_ref().map(|e| (r, e)));
    if failed.is_none() && outcomes.iter().any(|o| o.committed) {
        return Ok(Some(wanted));
    }
    let why = match failed {
        Some((r, e)) => format!("rank {r}'s drain failed: {e}"),
        None => "the drains did not commit it on the store".to_string(),
    };
    let newest = latest.map_or("none".to_string(), |l| l.to_string());
    warn!(
        step = wanted,
        "run {run}: step {wanted} is committed in every machine's tier but not on {}, and bringing it there failed ({why}); resuming from the store's newest step ({newest})",
        remote.url()
    );
    Ok(latest)
}

/// One machine of several resuming without an all-gather from `target`, the store's newest
/// step: a warning if its tier holds a newer node commit, which only an agreement could bring.
pub(crate) fn warn_unagreed(local: &Store, run: &str, target: Option<u64>) {
    match runtime().block_on(local.log().node_committed_steps(run)) {
        Ok(steps) => {
            if let Some(&newest) = steps.last()
                && target.is_none_or(|t| newest > t)
            {
                let from = target.map_or("the start".to_string(), |t| format!("step {t}"));
                warn!(
                    step = newest,
                    "run {run}: this machine's tier holds step {newest}, newer than the store's; \
                     resuming from {from}, since without ManagerConfig::all_gather the machines \
                     cannot agree that every one of them holds it"
                );
            }
        }
        Err(e) => warn!("listing this machine's tier for steps the store lacks: {e}"),
    }
}

/// The kind an error gathered from another rank had.
fn kind_named(name: &str) -> ErrorKind {
    [
        ErrorKind::NotFound,
        ErrorKind::InvalidInput,
        ErrorKind::Corrupt,
        ErrorKind::Conflict,
        ErrorKind::Fenced,
        ErrorKind::Incomplete,
        ErrorKind::Backend,
        ErrorKind::Io,
        ErrorKind::NoSpace,
        ErrorKind::NoDevice,
        ErrorKind::Device,
    ]
    .into_iter()
    .find(|k| k.as_str() == name)
    .unwrap_or(ErrorKind::Internal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_process_gathers_every_rank_in_order_round_after_round() {
        let g = AllGather::in_process(3, Duration::from_secs(30));
        let hs: Vec<_> = g
            .into_iter()
            .enumerate()
            .map(|(r, g)| {
                std::thread::spawn(move || {
                    (0..50u64)
                        .map(|round| g.gather(&(r as u64 * 1000 + round)).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in hs {
            let rounds = h.join().unwrap();
            for (round, got) in rounds.iter().enumerate() {
                let want: Vec<u64> = (0..3).map(|r| r * 1000 + round as u64).collect();
                assert_eq!(got, &want);
            }
        }
    }

    #[test]
    fn a_rank_that_never_comes_is_named_after_the_timeout() {
        let g = AllGather::in_process(2, Duration::from_millis(200));
        let e = g[0].gather(&1u32).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Incomplete);
        assert!(e.to_string().contains("rank(s) [1] did not come"), "{e}");
    }

    #[test]
    fn an_error_kind_survives_the_gather() {
        for k in [ErrorKind::NotFound, ErrorKind::Corrupt, ErrorKind::Backend] {
            assert_eq!(kind_named(k.as_str()), k);
        }
        assert_eq!(kind_named("no such kind"), ErrorKind::Internal);
    }
}
