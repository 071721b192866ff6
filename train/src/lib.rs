//! `ckpt-train`, the reference workload, as a library function ([`run`]) that tests call
//! directly and the binary wraps.
//!
//! All ranks run as threads of one process (a barrier per step stands in for the collectives
//! of real training), or one rank per process with `--rank` (or `CKPT_RANK`, as the
//! supervisor sets it).
//!
//! # Monitors
//!
//! Every step logs its loss, gradient norm, data batch, step time and host memory (device
//! memory is `null`: the workload runs on the CPU) to the run's metrics log. The spike
//! monitor ([`ckpt_trainer::monitor`], `--on-spike`) judges each step before it may be saved:
//!
//! - all ranks as threads: rank 0 sums the exact global loss after a barrier, asks its
//!   manager's monitor, and every rank reads the decision after a second barrier, so all act
//!   at the same step (a rollback restores every rank to the same checkpoint and skips the
//!   same batches; a stop stops all);
//! - one rank per process with a world of 1: the rank's partial sums are the global loss;
//! - one rank per process with a world above 1: a rank knows only its partial sums and there
//!   is no collective to agree through, so `--on-spike rollback` is refused (ranks acting on
//!   different views would restore different steps). `alert` watches each rank's own share
//!   of the loss (the mean over the elements it owns; a corrupted batch raises every share),
//!   records carry the rank, and a NaN a rank sees stops that rank.
//!
//! `--inject-spike-at B` and `--inject-nan-at B` corrupt data batch `B` (targets ×1000, or
//! NaN) to test this end to end; `--skip-batches A-B` never reads batches A..=B, which is
//! what a rollback that skipped them should equal.

//!
//! | file | owns |
//! |---|---|
//! | `lib.rs` | [`run`]: the run's set-up, its rank threads, what it reports at the end |
//! | `args.rs` | [`TrainArgs`] and the parsers of its values |
//! | `setup.rs` | the layout, the store, the model, the checks of the arguments, the shared staging pool |
//! | `generation.rs` | which generation of the run this job is |
//! | `shared.rs` | what the rank threads share, and their per-step barrier |
//! | `rank.rs` | one rank: its manager, the resume, the training loop |
//! | `step.rs` | each step's judgement: figures, the spike monitor, a fence, a rollback agreed |
//! | `report.rs` | the records of a rank's saves once each is done |

mod args;
mod generation;
mod rank;
mod report;
mod setup;
mod shared;
mod step;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ckpt_recovery::RankEnv;
use ckpt_recovery::records::{self, Metric};
use ckpt_store::{Error, ErrorKind, Result, StepReader};
use parking_lot::Mutex;
use tracing::info;

use ckpt_trainer::monitor::{Decision, RollbackEntry, Spike};
use ckpt_trainer::save::runtime;
use ckpt_trainer::workload::step_digest;

pub use args::{
    BackPressureArg, Budget, CkptEvery, SPIKE_SCALE, TrainArgs, next_batch, parse_batch_range,
    parse_budget, parse_ckpt_every, parse_count,
};

use shared::{Lockstep, Shared};

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// The step the run resumed from, if it resumed.
    pub resumed_from: Option<u64>,
    /// The last step trained.
    pub last_step: u64,
    /// Digest of the final committed state (committer rank only).
    pub digest: Option<String>,
    /// Global loss per step (threads mode; one rank per process has partials only).
    pub losses: Vec<(u64, f64)>,
    /// Checkpoint figures.
    pub checkpoints: Vec<records::CheckpointMetrics>,
    /// Spikes the monitor reported (the deciding rank's).
    pub spikes: Vec<Spike>,
    /// Rollbacks carried out, oldest first.
    pub rollbacks: Vec<RollbackEntry>,
}

/// Run the workload (see the module docs).
pub fn run(args: TrainArgs) -> Result<Outcome> {
    let layout = setup::layout(&args)?;
    ckpt_trainer::save::set_io_nice(args.io_nice);
    // Launched by a driver (`ckpt resume`, `ckpt agent`): its environment, read once.
    let launched = RankEnv::from_env()?;
    setup::check_launched(launched.as_ref(), &layout)?;
    let heartbeat = setup::heartbeat(launched.as_ref())?;
    let store = setup::open_store(&args)?;
    let local_tier = setup::open_local_tier(&args, &store)?;
    let model = setup::model(&args, &layout)?;
    setup::check_monitor(&args, &layout)?;
    let auto_interval = setup::auto_interval(&args, &layout)?;
    setup::check_rank(&args, &layout)?;
    let generation = runtime().block_on(generation::choose_generation(
        &store,
        local_tier.as_ref(),
        &args,
    ))?;
    if args.rank.is_none() {
        // All ranks here: the process joins the generation once, before any rank thread
        // starts, so that the threads cannot disagree about it (a thread leaving alone would
        // leave the others waiting at the barrier); in the local tier too.
        runtime().block_on(store.log().join_generation(&args.run, generation))?;
        if let Some(l) = &local_tier {
            runtime().block_on(l.log().join_generation(&args.run, generation))?;
        }
    }
    let ranks: Vec<u32> = match args.rank {
        Some(r) => vec![r],
        None => (0..layout.world()).collect(),
    };
    let threads = ranks.len() as u32;
    let committer_here = ranks.contains(&0);
    let (metrics, log) = setup::metrics_outputs(&args, &store)?;
    let sigterm = Arc::new(AtomicBool::new(false));
    if args.rank.is_none() {
        ckpt_trainer::manager::on_sigterm(&sigterm)?;
    }
    info!(
        run = %args.run,
        layout = %layout,
        params = model.param_count(),
        state_bytes = model.state_bytes(),
        "training"
    );
    let pool = setup::staging_pool(&args, &store, threads);
    let shared = Arc::new(Shared {
        generation,
        launched,
        heartbeat: Mutex::new(heartbeat),
        auto_interval,
        args: args.clone(),
        store,
        local_tier,
        layout,
        model,
        world_threads: threads,
        barrier: (threads > 1).then(|| Lockstep::new(threads as usize)),
        pool,
        board: Mutex::default(),
        decision: Mutex::new(Decision::Continue),
        rollback_failed: AtomicBool::new(false),
        fenced: Mutex::default(),
        fence_now: Mutex::default(),
        stop_now: AtomicBool::new(false),
        sigterm,
        metrics: Mutex::new(metrics),
        log: Mutex::new(Some(log)),
        outcome: Mutex::default(),
    });
    let first_err = run_ranks(&shared, ranks)?;
    finish_run(&shared, first_err, committer_here)
}

/// Run each of `ranks` on a thread of its own; the error of the rank that failed first.
fn run_ranks(shared: &Arc<Shared>, ranks: Vec<u32>) -> Result<Option<Error>> {
    let mut handles = Vec::new();
    for r in ranks {
        let sh = shared.clone();
        handles.push(
            std::thread::Builder::new()
                .name(format!("rank-{r}"))
                .spawn(move || {
                    let res = rank::rank_main(&sh, r);
                    if let (Err(e), Some(b)) = (&res, &sh.barrier) {
                        // The other rank threads would wait for this one forever.
                        b.abort(&format!("rank {r} failed: {e}"));
                    }
                    res
                })
                .map_err(|e| Error::internal(format!("starting rank {r}: {e}")))?,
        );
    }
    let mut first_err: Option<Error> = None;
    for h in handles {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                // The rank that failed first, rather than the ranks it stopped.
                if first_err.as_ref().is_none_or(Lockstep::is_abort) {
                    first_err = Some(e);
                }
            }
            Err(_) => {
                first_err.get_or_insert(Error::internal("a rank thread panicked"));
            }
        }
    }
    Ok(first_err)
}

/// The store's counters, the run's error if a rank failed, else its outcome with the digest
/// of the final committed state (where rank 0 ran).
fn finish_run(shared: &Shared, first_err: Option<Error>, committer_here: bool) -> Result<Outcome> {
    // What the store's requests cost, retries included (a failing store shows here).
    if let Some(m) = shared.store.metrics() {
        let counters = m
            .snapshot()
            .pairs()
            .into_iter()
            .map(|(name, v)| (name.to_string(), v))
            .collect();
        shared.emit(&Metric::Store(records::StoreCounters { counters }));
    }
    shared.flush_log();
    if let Some(e) = first_err {
        return Err(e);
    }
    let mut out = shared.outcome.lock().clone();
    if committer_here {
        let step = out.last_step;
        let run = &shared.args.run;
        // Each machine drains its own ranks: the step commits on the store with the last (the
        // manager's finish waited for it), unless the job was stopped (its agents drain it).
        if node_tiers(shared)
            && !runtime().block_on(
                shared
                    .store
                    .objects()
                    .exists(&shared.store.keys().commit(run, step)),
            )?
        {
            info!(
                step,
                "no final digest: step {step} is not committed on the store yet (the job was \
                 stopped; the machines' agents drain it)"
            );
            return Ok(out);
        }
        // The local tier's copy when it has the step (the same bytes, read faster).
        let home = match &shared.local_tier {
            Some(l) if runtime().block_on(l.objects().exists(&l.keys().commit(run, step)))? => l,
            _ => &shared.store,
        };
        let reader = runtime().block_on(StepReader::open(home, run, step))?;
        let digest = runtime().block_on(step_digest(&reader))?;
        shared.emit(&Metric::Final(records::Final {
            step,
            digest: digest.clone(),
        }));
        shared.flush_log();
        out.digest = Some(digest);
    }
    Ok(out)
}

/// Whether each machine of the job has its own local tier (its driver said which ranks share
/// this one).
fn node_tiers(shared: &Shared) -> bool {
    shared.local_tier.is_some()
        && shared
            .launched
            .as_ref()
            .is_some_and(|e| e.local_tier_ranks.is_some())
}

static RESUME_DATA_FAILURE: AtomicBool = AtomicBool::new(false);

/// Remember that the step to resume from could not be read because of its data.
pub(crate) fn note_resume_failure(resume: bool, e: &Error) {
    if resume && matches!(e.kind(), ErrorKind::NotFound | ErrorKind::Corrupt) {
        RESUME_DATA_FAILURE.store(true, Ordering::SeqCst);
    }
}

/// Whether [`run`] failed because the step to resume from cannot be read (an object missing
/// or damaged), not because of this machine: the binary then exits with
/// `ckpt_recovery::DATA_FAILURE_EXIT`, which the supervisor reads as "that step is unusable".
pub fn failed_on_resume_data() -> bool {
    RESUME_DATA_FAILURE.load(Ordering::SeqCst)
}
