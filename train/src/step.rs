//! Each step's judgement: its figures logged, the spike monitor asked (by the rank, or by
//! rank 0 for all rank threads), a fence noticed, a rollback agreed, and the heartbeat's view
//! of the step.

use std::sync::atomic::Ordering;
use std::time::Instant;

use ckpt_recovery::heartbeat::{Figure, Workload};
use ckpt_recovery::records::{Curve, Metric, StepMetrics};
use ckpt_store::{Error, Result};

use ckpt_trainer::manager::{CheckpointManager, Rollback};
use ckpt_trainer::monitor::{Decision, Observation, host_memory_bytes};
use ckpt_trainer::workload::{LOSS_SCALE, Partial};

use crate::shared::Shared;

/// Why a newer generation fenced this job out, if it did. One rank per process: this rank's
/// checkpointer; threads: what rank 0 saw for this step (the same for every rank).
pub(crate) fn fence_of(sh: &Shared, mgr: &CheckpointManager) -> Option<String> {
    if sh.args.rank.is_some() {
        mgr.checkpointer().fenced().map(|e| e.to_string())
    } else {
        sh.fence_now.lock().clone()
    }
}

/// This step's observation, logged and judged; returns what every rank does next.
///
/// One rank per process: the rank's own partial sums (the global loss when the world is 1).
/// Threads: every rank adds its partial to the board; after a barrier rank 0 logs the exact
/// global loss, asks its manager's monitor and checks SIGTERM; after a second barrier every
/// rank reads the same decision.
pub(crate) fn decide(
    sh: &Shared,
    mgr: &mut CheckpointManager,
    rank: u32,
    step: u64,
    batch: u64,
    part: Partial,
    t_step: Instant,
) -> Result<Decision> {
    if sh.args.rank.is_some() {
        // One rank per process: only partial sums are known here.
        let whole = sh.layout.world() == 1;
        let mut v = StepMetrics {
            step,
            batch: Some(batch),
            rank: Some(rank),
            sse: Some(part.sse.to_string()),
            gsq: Some(part.gsq.to_string()),
            n: Some(part.n),
            nonfinite: Some(part.nonfinite),
            ..step_figures(t_step)
        };
        if whole {
            v.loss = Some(part.loss());
            v.grad_norm = Some(part.grad_norm());
            sh.outcome.lock().losses.push((step, part.loss()));
        }
        sh.emit(&Metric::Step(v));
        if sh.sigterm.load(Ordering::SeqCst) {
            sh.stop_now.store(true, Ordering::SeqCst);
        }
        if part.n == 0 && !part.nonfinite {
            // This rank owns no elements (a replica): nothing of its own to watch.
            return Ok(Decision::Continue);
        }
        let mut o = Observation::new(step, part.loss())
            .batch(batch)
            .grad_norm(part.grad_norm());
        if !whole {
            o.partial_of_rank = Some(rank);
        }
        let d = mgr.observe(&o);
        note_spike(sh, &d);
        return Ok(d);
    }
    sh.board.lock().entry(step).or_default().0.add(&part);
    if let Some(e) = mgr.checkpointer().fenced() {
        sh.fenced.lock().get_or_insert_with(|| e.to_string());
    }
    if let Some(b) = &sh.barrier {
        b.wait()?;
    }
    if rank == 0 {
        let f = sh.fenced.lock().clone();
        *sh.fence_now.lock() = f;
        let tot = sh.board.lock().remove(&step).unwrap_or_default().0;
        sh.outcome.lock().losses.push((step, tot.loss()));
        sh.emit(&Metric::Step(StepMetrics {
            step,
            batch: Some(batch),
            loss: Some(tot.loss()),
            grad_norm: Some(tot.grad_norm()),
            ..step_figures(t_step)
        }));
        let o = Observation::new(step, tot.loss())
            .batch(batch)
            .grad_norm(tot.grad_norm());
        let d = mgr.observe(&o);
        note_spike(sh, &d);
        *sh.decision.lock() = d;
        if sh.sigterm.load(Ordering::SeqCst) {
            sh.stop_now.store(true, Ordering::SeqCst);
        }
    }
    if let Some(b) = &sh.barrier {
        b.wait()?;
    }
    Ok(sh.decision.lock().clone())
}

/// Step time (so far) and memory of a step record. The reference workload keeps its state in
/// host memory (no `device_mem_bytes`).
pub(crate) fn step_figures(t_step: Instant) -> StepMetrics {
    StepMetrics {
        step_time_s: Some(t_step.elapsed().as_secs_f64()),
        host_mem_bytes: host_memory_bytes(),
        ..StepMetrics::default()
    }
}

/// What a rank reports of a step with its heartbeat: its partial sums, and how the driver
/// derives the job's loss and gradient norm from their totals (the same arithmetic as
/// [`Partial::loss`] and [`Partial::grad_norm`], so the driver's curve is the threads mode's
/// bit for bit).
pub(crate) fn heartbeat_workload(part: &Partial) -> Workload {
    let figure = |curve, sum: &str, per: Option<&str>, sqrt| Figure {
        curve,
        sum: sum.to_string(),
        per: per.map(str::to_string),
        scale: LOSS_SCALE,
        sqrt,
    };
    Workload {
        sums: [
            ("sse".to_string(), part.sse.to_string()),
            ("gsq".to_string(), part.gsq.to_string()),
            ("n".to_string(), part.n.to_string()),
        ]
        .into(),
        figures: vec![
            figure(Curve::Loss, "sse", Some("n"), false),
            figure(Curve::GradNorm, "gsq", None, true),
        ],
    }
}

pub(crate) fn note_spike(sh: &Shared, d: &Decision) {
    let spike = match d {
        Decision::Continue => return,
        Decision::Alert(s) | Decision::Rollback(s) => *s,
        Decision::Stop(st) => st.spike,
    };
    sh.outcome.lock().spikes.push(spike);
}

/// Threads mode: every rank rolled back, or all fail (the ranks must stay in lockstep).
pub(crate) fn agree(sh: &Shared, r: Result<Rollback>) -> Result<Rollback> {
    let Some(b) = &sh.barrier else { return r };
    if r.is_err() {
        sh.rollback_failed.store(true, Ordering::SeqCst);
    }
    b.wait()?;
    let failed = sh.rollback_failed.load(Ordering::SeqCst);
    match r {
        Ok(_) if failed => Err(Error::internal(
            "another rank failed to roll back; stopping every rank",
        )),
        r => r,
    }
}
