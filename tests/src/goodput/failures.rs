//! The failures of the soak: the seeded schedule ([`Rng`], [`Schedule`]), injecting one into a
//! running generation ([`inject`], with the damage of the newest step), and matching what was
//! injected to the recovery log's records ([`match_injections`]).

use std::collections::BTreeMap;
use std::time::Duration;

use ckpt_store::Store;
use ckpt_store::object_store::path::Path as ObjectPath;
use serde_json::Value;

use super::procs::{RankProc, agents};
use super::{FailureKind, Injection, RUN};
use crate::signal;

/// A small seeded RNG (splitmix64, [`ckpt_store::testing::Rng`]): a schedule is replayed from
/// its seed.
#[derive(Debug, Clone)]
pub struct Rng(ckpt_store::testing::Rng);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Rng {
        Rng(ckpt_store::testing::Rng(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Exponentially distributed with mean `mean`.
    pub fn exp(&mut self, mean: Duration) -> Duration {
        Duration::from_secs_f64(-mean.as_secs_f64() * (1.0 - self.unit()).ln())
    }
}

/// The failure schedule: exponential gaps, kinds in shuffled rounds of all four.
pub(super) struct Schedule {
    pub(super) rng: Rng,
    round: Vec<FailureKind>,
}

impl Schedule {
    pub(super) fn new(seed: u64) -> Schedule {
        Schedule {
            rng: Rng::new(seed),
            round: Vec::new(),
        }
    }

    pub(super) fn gap(&mut self, mean: Duration, max: Option<Duration>) -> Duration {
        let g = self.rng.exp(mean);
        max.map_or(g, |m| g.min(m))
    }

    pub(super) fn kind(&mut self) -> FailureKind {
        if self.round.is_empty() {
            self.round = FailureKind::ALL.to_vec();
            // Fisher-Yates.
            for i in (1..self.round.len()).rev() {
                let j = self.rng.below(i + 1);
                self.round.swap(i, j);
            }
        }
        self.round.pop().expect("a kind")
    }
}

/// The chunk and pack objects of `step` (each chunk's own, not its delta bases), by key.
pub(super) async fn step_objects(
    st: &Store,
    step: u64,
) -> ckpt_store::Result<BTreeMap<String, ObjectPath>> {
    Ok(st
        .log()
        .step_chunk_refs(RUN, step)
        .await?
        .iter()
        .map(|c| {
            let p = st.keys().object_of(c);
            (p.to_string(), p)
        })
        .collect())
}

/// Delete an object of the newest committed step that the step before it does not reference:
/// the step and the object, or `None` when there is no such object (fewer than two committed
/// steps, or the newest holds nothing of its own). A disk failure damages one step and leaves
/// the older ones to recover from; one that destroyed every committed step would leave the
/// job nothing to resume (recovery then stops, by design, rather than start over silently).
pub(super) async fn damage_newest(st: &Store) -> Result<Option<(u64, String)>, String> {
    let steps = st
        .log()
        .committed_steps(RUN)
        .await
        .map_err(|e| e.to_string())?;
    let [.., older_step, newest] = steps[..] else {
        return Ok(None);
    };
    let mine = step_objects(st, newest).await.map_err(|e| e.to_string())?;
    let older = step_objects(st, older_step)
        .await
        .map_err(|e| e.to_string())?;
    let Some((key, path)) = mine
        .iter()
        .find(|(k, _)| !older.contains_key(*k))
        .map(|(k, p)| (k.clone(), p.clone()))
    else {
        return Ok(None);
    };
    st.objects()
        .delete_all(vec![path])
        .await
        .map_err(|e| format!("deleting {key}: {e}"))?;
    Ok(Some((newest, key)))
}

/// Inject `kind` into generation `g` (its running ranks `live`), choosing the victim with
/// `rng`.
pub(super) fn inject(
    rt: &tokio::runtime::Runtime,
    st: &Store,
    tag: &str,
    kind: FailureKind,
    live: &[RankProc],
    rng: &mut Rng,
    at_s: f64,
) -> Injection {
    let victim = live[rng.below(live.len())];
    let node_ranks: Vec<u32> = live
        .iter()
        .filter(|r| r.node == victim.node)
        .map(|r| r.pid)
        .collect();
    let mut inj = Injection {
        at_s,
        kind,
        generation: victim.generation,
        node: victim.node,
        pids: vec![victim.pid],
        damaged_step: None,
        damaged_object: None,
        detected: false,
        recovered: false,
        failure_to_step_s: None,
    };
    match kind {
        FailureKind::RankKilled => signal(victim.pid, libc::SIGKILL),
        FailureKind::RankHung => signal(victim.pid, libc::SIGSTOP),
        FailureKind::NodeLost => {
            let agent: Vec<u32> = agents(tag)
                .into_iter()
                .filter(|(_, n)| *n == victim.node)
                .map(|(p, _)| p)
                .collect();
            inj.pids = node_ranks.iter().chain(&agent).copied().collect();
            for p in &inj.pids {
                signal(*p, libc::SIGKILL);
            }
        }
        FailureKind::DiskDamaged => {
            // Freeze the generation so no newer step commits between the damage and the kill.
            for r in live {
                signal(r.pid, libc::SIGSTOP);
            }
            match rt.block_on(damage_newest(st)) {
                Ok(Some((step, key))) => {
                    inj.damaged_step = Some(step);
                    inj.damaged_object = Some(key);
                }
                Ok(None) => {}
                Err(e) => eprintln!("goodput: damaging the newest step: {e}"),
            }
            inj.pids = node_ranks.clone();
            for p in &node_ranks {
                signal(*p, libc::SIGKILL);
            }
            for r in live.iter().filter(|r| r.node != victim.node) {
                signal(r.pid, libc::SIGCONT);
            }
        }
    }
    inj
}

pub(super) fn of_kind<'a>(records: &'a [Value], kind: &str) -> Vec<&'a Value> {
    records.iter().filter(|r| r["kind"] == kind).collect()
}

/// Mark what of each injection the recovery log shows (see the module docs); returns the
/// failure records no injection matched.
pub(super) fn match_injections(
    injections: &mut [Injection],
    records: &[Value],
    completed: bool,
) -> usize {
    let failures = of_kind(records, "failure");
    let mut used = vec![false; failures.len()];
    let unusable = of_kind(records, "step_unusable");
    let local_damage = of_kind(records, "local_tier_damaged");
    let started = of_kind(records, "started");
    let resumed = of_kind(records, "resumed");
    let u = |v: &Value, k: &str| v[k].as_u64();
    for inj in injections.iter_mut() {
        let Some(i) = (0..failures.len()).find(|&i| {
            !used[i]
                && u(failures[i], "generation") == Some(inj.generation)
                && u(failures[i], "node") == Some(u64::from(inj.node))
        }) else {
            continue;
        };
        used[i] = true;
        let f = failures[i];
        // The damaged step found unusable, or (a local tier's damage, the remote holding the
        // step) restored with the damaged chunks read from the remote, and said so.
        let step_found = inj.damaged_step.is_none_or(|s| {
            unusable.iter().any(|r| {
                u(r, "step") == Some(s) && u(r, "generation").is_some_and(|g| g >= inj.generation)
            }) || local_damage.iter().any(|r| u(r, "step") == Some(s))
        });
        inj.detected = step_found;
        let later = |r: &&&Value| u(r, "generation").is_some_and(|g| g > inj.generation);
        inj.recovered = completed && started.iter().any(|r| later(&r));
        let evidence_ms =
            f["at_ms"].as_f64().unwrap_or(0.0) - f["detection_s"].as_f64().unwrap_or(0.0) * 1e3;
        inj.failure_to_step_s = resumed
            .iter()
            .find(|r| later(r))
            .and_then(|r| r["at_ms"].as_f64())
            .map(|at| (at - evidence_ms) / 1e3);
    }
    used.iter().filter(|u| !**u).count()
}
