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

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ckpt_recovery::heartbeat::{Figure, Workload};
use ckpt_recovery::{RankEnv, rank_env};
use ckpt_store::logs::{LogWriter, METRICS};
use ckpt_store::records::{self, Curve, Metric, StepMetrics};
use ckpt_store::{Error, ErrorKind, Failpoints, Layout, Result, StepReader, Store};
use clap::Parser;
use parking_lot::{Condvar, Mutex};
use tracing::{info, warn};

use ckpt_trainer::manager::{CheckpointManager, ManagerConfig, Scope};
use ckpt_trainer::monitor::{
    DEFAULT_GRAD_FACTOR, DEFAULT_LOSS_K, DEFAULT_LOSS_MIN_RISE, DEFAULT_MAX_ROLLBACKS,
    DEFAULT_WARMUP, DEFAULT_WINDOW, Decision, MonitorConfig, Observation, RollbackEntry, Spike,
    SpikeAction, host_memory_bytes,
};
use ckpt_trainer::save::{BackPressure, CheckpointerConfig, SaveHandle, runtime};
use ckpt_trainer::staging::{PoolConfig, StagingPool};
use ckpt_trainer::workload::{
    LOSS_SCALE, ModelConfig, Partial, Progress, RankState, TrainConfig, step_digest,
};

/// Parse sizes and counts with suffixes: `16M`, `2G`, `512K`, `4MiB`, `1e6`.
pub fn parse_count(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t
        .char_indices()
        .find(|(_, c)| c.is_ascii_alphabetic() && *c != 'e')
    {
        Some((i, _)) => {
            let unit = t[i..].to_ascii_lowercase();
            let m: u64 = match unit.as_str() {
                "k" | "kb" => 1_000,
                "m" | "mb" => 1_000_000,
                "g" | "gb" => 1_000_000_000,
                "t" | "tb" => 1_000_000_000_000,
                "kib" => 1 << 10,
                "mib" => 1 << 20,
                "gib" => 1 << 30,
                "tib" => 1 << 40,
                _ => return Err(format!("unknown suffix {:?} in {s:?}", &t[i..])),
            };
            (&t[..i], m)
        }
        None => (t, 1),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number with an optional K/M/G suffix"))?;
    if v < 0.0 || !v.is_finite() {
        return Err(format!("{s:?} must be positive"));
    }
    Ok((v * mult as f64).round() as u64)
}

/// Factor on the targets of a batch named by `--inject-spike-at`.
pub const SPIKE_SCALE: f32 = 1000.0;

/// `A-B` (or `A`): an inclusive range of data batches.
pub fn parse_batch_range(s: &str) -> std::result::Result<(u64, u64), String> {
    let num = |x: &str| {
        x.trim()
            .parse::<u64>()
            .map_err(|_| format!("{s:?} is not a batch range like 11-15"))
    };
    let (a, b) = match s.split_once('-') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => (num(s)?, num(s)?),
    };
    if a == 0 || b < a {
        return Err(format!(
            "batch range {s:?} must be A-B with 1 <= A <= B (batches count from 1)"
        ));
    }
    Ok((a, b))
}

/// The first batch at or after `pos` that no range in `skips` covers.
pub fn next_batch(skips: &[(u64, u64)], mut pos: u64) -> u64 {
    while let Some(&(_, b)) = skips.iter().find(|(a, b)| (*a..=*b).contains(&pos)) {
        pos = b + 1;
    }
    pos
}

/// Arguments of `ckpt-train`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "ckpt-train",
    version,
    about = "The ckpt reference workload: a deterministic sharded training job"
)]
pub struct TrainArgs {
    /// Store URL (directory, s3://bucket/prefix, ...).
    #[arg(long, env = rank_env::STORE)]
    pub store: String,
    /// Run name.
    #[arg(long, env = rank_env::RUN)]
    pub run: String,
    /// Layout, e.g. dp=2,tp=2,pp=1.
    #[arg(long, env = rank_env::LAYOUT, default_value = "dp=1,tp=1,pp=1")]
    pub layout: String,
    /// ZeRO stage (0-3); overrides zero= in --layout.
    #[arg(long)]
    pub zero: Option<u8>,
    /// Train until this step.
    #[arg(long)]
    pub steps: u64,
    /// Checkpoint every K steps (and always at the last step), or `auto`: the interval that
    /// fits the measured cost of a save and the failures in the run's recovery log
    /// (Young/Daly: sqrt(2 x cost x MTBF), in steps, within --ckpt-every-min and
    /// --ckpt-every-max; each change is a `checkpoint_interval` event). All ranks in this
    /// process: rank 0 re-decides after each save it measured. One rank per process (--rank,
    /// CKPT_RANK) in a larger world: the interval is fixed for each generation of the job,
    /// from the failures and the save cost (logged by rank 0 as `save_cost`) in the run's log
    /// before the generation started, the same on every rank; the first generation takes
    /// --ckpt-every-min.
    #[arg(long, default_value = "10", value_parser = parse_ckpt_every)]
    pub ckpt_every: CkptEvery,
    /// With --ckpt-every auto: the fewest steps between checkpoints (also the interval until
    /// the first save is measured, and of a job's first generation with one rank per process).
    #[arg(long, default_value_t = ckpt_trainer::interval::DEFAULT_MIN_STEPS)]
    pub ckpt_every_min: u64,
    /// With --ckpt-every auto: the most steps between checkpoints.
    #[arg(long, default_value_t = ckpt_trainer::interval::DEFAULT_MAX_STEPS)]
    pub ckpt_every_max: u64,
    /// With --ckpt-every auto: the mean time between failures, in seconds, assumed while the
    /// run's recovery log holds no failure (default one day).
    #[arg(long, default_value_t = ckpt_trainer::interval::DEFAULT_MTBF_PRIOR.as_secs())]
    pub mtbf_prior: u64,
    /// Number of parameters (suffixes K, M, G).
    #[arg(long, default_value = "1M", value_parser = parse_count)]
    pub params: u64,
    /// Model width, instead of deriving it from --params (a multiple of tp; e.g. 8 for a
    /// model of a few thousand parameters that trains 10,000 steps in seconds).
    #[arg(long)]
    pub d_model: Option<u64>,
    /// Transformer layers.
    #[arg(long, default_value_t = 4)]
    pub layers: u32,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Adam learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f32,
    /// Run only this rank (one rank per process); all ranks as threads otherwise.
    #[arg(long, env = rank_env::RANK)]
    pub rank: Option<u32>,
    /// Job generation (set by the supervisor; otherwise 0 for a new run and, on --resume,
    /// one more than any generation that saved in this run).
    #[arg(long, env = rank_env::GENERATION)]
    pub generation: Option<u64>,
    /// Resume from the newest committed checkpoint of the run.
    #[arg(long, env = rank_env::RESUME)]
    pub resume: bool,
    /// Resume from exactly this committed step, not the newest (implies --resume). `ckpt
    /// resume` sets it to the step its coordinator chose. If the step cannot be read because
    /// of its data (an object missing or damaged), ckpt-train exits with code 65
    /// (`ckpt_recovery::DATA_FAILURE_EXIT`) so the supervisor does not blame the node.
    #[arg(long, env = rank_env::RESUME_STEP)]
    pub resume_step: Option<u64>,
    /// Write per-step and per-checkpoint metrics as JSON lines here.
    #[arg(long)]
    pub metrics_out: Option<PathBuf>,
    /// The nice value of the background persist threads (0: the training loop's priority).
    #[arg(
        long,
        env = "CKPT_IO_NICE",
        default_value_t = 10,
        allow_negative_numbers = true
    )]
    pub io_nice: i32,
    /// The persist governor's budget: how much slower a step may be while a checkpoint
    /// persists (`0.1` or `10%`); above it the persist's rate is lowered (down to
    /// --persist-min-rate), well below it raised again. `off`: persists run at full speed.
    /// The final checkpoint always runs at full speed.
    #[arg(long, default_value = "0.1", value_parser = parse_budget)]
    pub persist_budget: Budget,
    /// The lowest rate the persist governor sets, raw bytes per second per rank (suffixes K,
    /// M, G): a rank's persist of B bytes is durable within about B / this.
    #[arg(long, default_value = "16MiB", value_parser = parse_count)]
    pub persist_min_rate: u64,
    /// Freeze this fraction of the layers (fine-tuning).
    #[arg(long, default_value_t = 0.0)]
    pub frozen: f64,
    /// Staging memory bound per rank (default: the rank's state, so the snapshot never waits
    /// for the persist). Any bound works, down to one chunk: a smaller one makes the snapshot
    /// wait for the persist of earlier chunks. Ranks running as threads share one pool of
    /// ranks x this bound.
    #[arg(long, value_parser = parse_count)]
    pub staging: Option<u64>,
    /// Allocate and touch staging memory at start.
    #[arg(long)]
    pub prefault: bool,
    /// Without --prefault, staging memory is allocated and touched from start on a background
    /// thread of the lowest CPU priority (so the first checkpoint stalls like the others);
    /// this turns that off (the first checkpoint then allocates its staging itself).
    #[arg(long)]
    pub no_background_prefault: bool,
    /// What to do when a checkpoint is due while the previous one persists.
    #[arg(long, value_enum, default_value = "wait")]
    pub back_pressure: BackPressureArg,
    /// Wait for each snapshot right after saving, instead of overlapping the copy with the
    /// next forward pass.
    #[arg(long)]
    pub no_overlap: bool,
    /// Keep the newest N committed checkpoints (retention).
    #[arg(long)]
    pub keep_last: Option<usize>,
    /// Keep checkpoints at steps that are multiples of K.
    #[arg(long)]
    pub keep_every: Option<u64>,
    /// Chunk size of the store (suffixes K, M; default 4 MiB).
    #[arg(long, value_parser = parse_count)]
    pub chunk_size: Option<u64>,
    /// The longest chain of delta chunks (issue 16; e.g. 8: a restore reads at most N + 1
    /// objects a chunk). Default 0: no deltas.
    #[arg(long)]
    pub delta_chain: Option<usize>,
    /// Memory for the plain bytes of written float chunks, the next save's delta bases
    /// (suffixes K, M, G; default 0: bases are read back from the store).
    #[arg(long, value_parser = parse_count)]
    pub delta_cache: Option<u64>,
    /// Make every step take at least this long (tests that kill ranks mid-run).
    #[arg(long, default_value_t = 0)]
    pub step_time_ms: u64,
    /// Failpoints, e.g. after_chunks=kill (also from CKPT_FAILPOINTS).
    #[arg(long, env = "CKPT_FAILPOINTS")]
    pub failpoints: Option<String>,
    /// Retries of store requests, `attempts=6,min_ms=50,max_ms=5000,timeout_ms=120000`.
    #[arg(long, hide = true, env = ckpt_store::url::RETRY_ENV)]
    pub store_retry: Option<String>,
    /// Random failures injected into store requests (tests and measurements):
    /// `rate=0.05,seed=7,outage_s=10+5`.
    #[arg(long, hide = true, env = ckpt_store::url::FAULTS_ENV)]
    pub store_faults: Option<String>,
    /// What a loss spike, gradient-norm blow-up or NaN does: off; alert (a warning and a
    /// `spike` event; a NaN stops the run, since it poisons every later step); rollback
    /// (restore the newest checkpoint before the spike, skip the batches from it through the
    /// spike, go on; at most --max-rollbacks times, then stop).
    #[arg(long, env = "CKPT_ON_SPIKE", default_value_t = SpikeAction::Alert, value_parser = parse_spike_action)]
    pub on_spike: SpikeAction,
    /// Healthy steps whose losses form the spike baseline.
    #[arg(long, default_value_t = DEFAULT_WINDOW)]
    pub spike_window: usize,
    /// Healthy steps before loss and gradient thresholds apply (NaN is caught at once).
    #[arg(long, default_value_t = DEFAULT_WARMUP)]
    pub spike_warmup: usize,
    /// A loss above median + K x 1.4826 x MAD of the window is a spike.
    #[arg(long, default_value_t = DEFAULT_LOSS_K)]
    pub spike_k: f64,
    /// ... and above the median by at least this fraction of it.
    #[arg(long, default_value_t = DEFAULT_LOSS_MIN_RISE)]
    pub spike_min_rise: f64,
    /// A gradient norm above F x the window's median is a blow-up (0: off).
    #[arg(long, default_value_t = DEFAULT_GRAD_FACTOR)]
    pub grad_blowup: f64,
    /// Rollbacks allowed in the run; the next spike stops it with the history.
    #[arg(long, default_value_t = DEFAULT_MAX_ROLLBACKS)]
    pub max_rollbacks: usize,
    /// Corrupt these data batches: targets scaled by 1000 (a loss spike). Batch N is read at
    /// step N unless batches were skipped.
    #[arg(long, value_delimiter = ',', value_name = "BATCH")]
    pub inject_spike_at: Vec<u64>,
    /// Corrupt these data batches with NaN targets.
    #[arg(long, value_delimiter = ',', value_name = "BATCH")]
    pub inject_nan_at: Vec<u64>,
    /// Never read these data batches, e.g. 31-35,60-61 (the run a rollback should equal).
    #[arg(long, value_delimiter = ',', value_name = "A-B", value_parser = parse_batch_range)]
    pub skip_batches: Vec<(u64, u64)>,
}

impl TrainArgs {
    /// The monitor settings these arguments give.
    pub fn monitor_config(&self) -> MonitorConfig {
        MonitorConfig {
            action: self.on_spike,
            window: self.spike_window,
            warmup: self.spike_warmup,
            loss_k: self.spike_k,
            loss_min_rise: self.spike_min_rise,
            grad_factor: self.grad_blowup,
            max_rollbacks: self.max_rollbacks,
        }
    }

    /// The factor on the targets of data batch `batch` (1 unless injected).
    pub fn target_scale(&self, batch: u64) -> f32 {
        if self.inject_nan_at.contains(&batch) {
            f32::NAN
        } else if self.inject_spike_at.contains(&batch) {
            SPIKE_SCALE
        } else {
            1.0
        }
    }
}

/// `--back-pressure`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum BackPressureArg {
    /// Wait for the previous checkpoint.
    Wait,
    /// Skip this checkpoint.
    Skip,
}

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

struct Shared {
    generation: u64,
    /// What the driver that launched this process handed it (`None`: run by hand).
    launched: Option<RankEnv>,
    /// `--ckpt-every auto`: one schedule that every rank thread's manager follows.
    auto_interval: Option<ckpt_trainer::AutoInterval>,
    args: TrainArgs,
    store: Store,
    layout: Layout,
    model: ModelConfig,
    world_threads: u32,
    barrier: Option<Lockstep>,
    /// The staging pool the rank threads share (with --staging).
    pool: Option<Arc<StagingPool>>,
    board: Mutex<std::collections::BTreeMap<u64, (Partial, u32)>>,
    /// Rank 0's monitor decision for the current step (threads mode).
    decision: Mutex<Decision>,
    /// A rank failed to roll back (threads mode: all then stop).
    rollback_failed: AtomicBool,
    /// Threads: why a newer generation fenced this job out, as any rank's checkpointer found
    /// it, and rank 0's copy of it for the current step (read by every rank after the second
    /// barrier, so all stop at the same step).
    fenced: Mutex<Option<String>>,
    fence_now: Mutex<Option<String>>,
    stop_now: AtomicBool,
    sigterm: Arc<AtomicBool>,
    metrics: Mutex<Option<std::fs::File>>,
    log: Mutex<Option<LogWriter>>,
    outcome: Mutex<Outcome>,
}

impl Shared {
    fn emit(&self, v: &Metric) {
        if let Some(f) = self.metrics.lock().as_mut()
            && let Ok(line) = serde_json::to_string(v)
        {
            let _ = writeln!(f, "{line}");
        }
        if let Some(l) = self.log.lock().as_mut() {
            let _ = l.append(v);
        }
    }

    fn flush_log(&self) {
        let taken = self.log.lock().take();
        if let Some(mut l) = taken {
            if let Err(e) = runtime().block_on(l.flush()) {
                warn!("writing metrics to the store: {e}");
            }
            *self.log.lock() = Some(l);
        }
    }
}

/// `--ckpt-every`: a number of steps, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CkptEvery {
    /// Every this many steps.
    Steps(u64),
    /// Chosen from the cost of a save and the failure rate.
    Auto,
}

/// `N` (at least 1) or `auto`.
pub fn parse_ckpt_every(s: &str) -> std::result::Result<CkptEvery, String> {
    if s.trim() == "auto" {
        return Ok(CkptEvery::Auto);
    }
    match s.trim().parse::<u64>() {
        Ok(n) if n > 0 => Ok(CkptEvery::Steps(n)),
        _ => Err(format!(
            "{s:?} is neither a number of steps (at least 1) nor `auto`"
        )),
    }
}

/// `--persist-budget`: a fraction, or off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// Steps may be this fraction slower while a persist runs.
    Fraction(f64),
    /// No governor: persists run at full speed.
    Off,
}

/// `0.1`, `10%` or `off`.
pub fn parse_budget(s: &str) -> std::result::Result<Budget, String> {
    let t = s.trim();
    if t == "off" {
        return Ok(Budget::Off);
    }
    let (num, scale) = match t.strip_suffix('%') {
        Some(p) => (p, 100.0),
        None => (t, 1.0),
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(Budget::Fraction(v / scale)),
        _ => Err(format!(
            "{s:?} is not a slowdown budget: a positive fraction (0.1), a percentage (10%) or `off`"
        )),
    }
}

/// `off`, `alert` or `rollback`.
fn parse_spike_action(s: &str) -> std::result::Result<SpikeAction, String> {
    [SpikeAction::Off, SpikeAction::Alert, SpikeAction::Rollback]
        .into_iter()
        .find(|a| a.to_string() == s)
        .ok_or_else(|| format!("{s:?} is not one of off, alert, rollback"))
}

/// Run the workload (see the module docs).
pub fn run(args: TrainArgs) -> Result<Outcome> {
    let mut layout: Layout = args.layout.parse()?;
    if let Some(z) = args.zero {
        layout.zero = z;
        layout.validate()?;
    }
    ckpt_trainer::save::set_io_nice(args.io_nice);
    // Launched by a driver (`ckpt resume`, `ckpt agent`): its environment, read once.
    let launched = RankEnv::from_env()?;
    if let Some(w) = launched.as_ref().map(|e| e.world_size)
        && w != layout.world()
    {
        return Err(Error::invalid(format!(
            "the supervisor runs {w} ranks but the layout {layout} has {}: under `ckpt resume` leave --layout out (the supervisor sets CKPT_LAYOUT)",
            layout.world()
        )));
    }
    let open = ckpt_store::OpenOptions::from_values(
        args.store_retry.as_deref(),
        args.store_faults.as_deref(),
    )?;
    let mut store = ckpt_store::open_with(&args.store, &open)?;
    if let Some(cs) = args.chunk_size {
        let mut cfg = store.config().clone();
        cfg.chunk_size = cs as usize;
        cfg.pack_threshold = cfg.pack_threshold.min(cfg.chunk_size);
        cfg.inflight_bytes = cfg.inflight_bytes.max(cfg.pack_target + cfg.chunk_size);
        store = store.with_config(cfg)?;
    }
    if args.delta_chain.is_some() || args.delta_cache.is_some() {
        let mut cfg = store.config().clone();
        cfg.delta_chain = args.delta_chain.unwrap_or(cfg.delta_chain);
        cfg.delta_cache_bytes = args.delta_cache.unwrap_or(cfg.delta_cache_bytes);
        store = store.with_config(cfg)?;
    }
    if let Some(fp) = &args.failpoints {
        store = store.with_failpoints(Failpoints::parse(fp)?);
    }
    let model = match args.d_model {
        None => ModelConfig::for_params(args.params, args.layers),
        Some(d) if d == 0 || !d.is_multiple_of(layout.tp as u64) => {
            return Err(Error::invalid(format!(
                "--d-model {d} must be a positive multiple of tp={}",
                layout.tp
            )));
        }
        Some(d) => ModelConfig {
            vocab: 8 * d,
            d_model: d,
            ffn: 4 * d,
            layers: args.layers.max(1),
        },
    };
    args.monitor_config()
        .validate()
        .map_err(|e| Error::invalid(format!("spike monitor: {e}")))?;
    if args.on_spike == SpikeAction::Rollback && args.rank.is_some() && layout.world() > 1 {
        return Err(Error::invalid(format!(
            "--on-spike rollback needs the exact global loss, and with one rank per process (--rank or CKPT_RANK) over the {} ranks of {layout} each rank knows only its partial sums: run all ranks in one process (leave out --rank), or use --on-spike alert, which watches each rank's share of the loss",
            layout.world()
        )));
    }
    let auto_interval = (args.ckpt_every == CkptEvery::Auto).then(|| {
        let a = ckpt_trainer::AutoInterval::new(
            args.ckpt_every_min,
            args.ckpt_every_max,
            Duration::from_secs(args.mtbf_prior),
        );
        // One rank per process in a larger world: the ranks cannot follow a schedule rank 0
        // changes as it goes, so each generation fixes one they all derive and agree on.
        if args.rank.is_some() && layout.world() > 1 {
            a.fixed_per_generation()
        } else {
            a
        }
    });
    if let Some(a) = &auto_interval {
        a.validate()
            .map_err(|e| Error::invalid(format!("--ckpt-every auto: {e}")))?;
    }
    if let Some(r) = args.rank
        && r >= layout.world()
    {
        return Err(Error::invalid(format!(
            "rank {r} is outside the layout {layout} ({} ranks)",
            layout.world()
        )));
    }
    let generation = runtime().block_on(choose_generation(&store, &args))?;
    if args.rank.is_none() {
        // All ranks here: the process joins the generation once, before any rank thread
        // starts, so that the threads cannot disagree about it (a thread leaving alone would
        // leave the others waiting at the barrier).
        runtime().block_on(store.join_generation(&args.run, generation))?;
    }
    let ranks: Vec<u32> = match args.rank {
        Some(r) => vec![r],
        None => (0..layout.world()).collect(),
    };
    let threads = ranks.len() as u32;
    let committer_here = ranks.contains(&0);
    let metrics = match &args.metrics_out {
        Some(p) => Some(
            // Appended to, never through a link planted at the name.
            ckpt_store::outfile::open_regular(p, true)
                .map_err(|e| Error::io("opening the metrics file", &p.display(), e))?,
        ),
        None => None,
    };
    let writer_name = match args.rank {
        Some(r) => format!("rank-{r}"),
        None => "ranks".to_string(),
    };
    let log = LogWriter::new(&store, &args.run, METRICS, &writer_name)?;
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
    let pool = args.staging.filter(|_| threads > 1).map(|s| {
        let slab = store.config().chunk_size;
        let per_rank = (s as usize).max(slab);
        let pool = StagingPool::new(
            PoolConfig {
                capacity: per_rank * threads as usize,
                slab,
            },
            args.prefault,
        );
        if !args.prefault && !args.no_background_prefault {
            pool.prefault_in_background();
        }
        pool
    });
    let shared = Arc::new(Shared {
        generation,
        launched,
        auto_interval,
        args: args.clone(),
        store,
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
    let mut handles = Vec::new();
    for r in ranks {
        let sh = shared.clone();
        handles.push(
            std::thread::Builder::new()
                .name(format!("rank-{r}"))
                .spawn(move || {
                    let res = rank_main(&sh, r);
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
        let reader = runtime().block_on(StepReader::open(&shared.store, &args.run, step))?;
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

fn rank_main(sh: &Shared, rank: u32) -> Result<()> {
    let a = &sh.args;
    let train = TrainConfig {
        seed: a.seed,
        lr: a.lr,
        frozen: a.frozen,
    };
    let state = RankState::new(sh.model, train, sh.layout, rank)?;
    let mut ck = CheckpointerConfig::new(&a.run, rank, sh.layout);
    ck.generation = sh.generation;
    ck.staging_bytes = a
        .staging
        .map(|s| s as usize)
        .unwrap_or_else(|| state.held_bytes() as usize + sh.store.config().chunk_size);
    ck.prefault = a.prefault;
    ck.background_prefault = !a.no_background_prefault;
    ck.pool = sh.pool.clone();
    ck.peer = sh.launched.as_ref().and_then(RankEnv::peer_link);
    ck.copy_threads = (std::thread::available_parallelism().map_or(2, |n| n.get())
        / sh.world_threads as usize)
        .max(1);
    ck.back_pressure = match a.back_pressure {
        BackPressureArg::Wait => BackPressure::Wait,
        BackPressureArg::Skip => BackPressure::Skip,
    };
    let mut mc = ManagerConfig::new(ck);
    match a.ckpt_every {
        CkptEvery::Steps(n) => mc.every_steps = Some(n.max(1)),
        CkptEvery::Auto => mc.auto_interval = sh.auto_interval.clone(),
    }
    // The ranks of a node restore through one cache: each chunk read from the store once.
    mc.node_cache = sh.launched.as_ref().and_then(|e| e.node_cache.clone());
    mc.keep_last = a.keep_last;
    mc.keep_every = a.keep_every;
    mc.monitor = a.monitor_config();
    // One rank per process: the manager takes the final checkpoint on SIGTERM, unless the
    // supervisor says the job is being stopped after a failure (no commit is possible then).
    mc.final_on_sigterm =
        a.rank.is_some() && sh.launched.as_ref().is_none_or(|e| e.final_on_sigterm);
    mc.resume_step = a.resume_step;
    mc.persist_governor = match a.persist_budget {
        Budget::Off => None,
        Budget::Fraction(budget) => Some(ckpt_trainer::GovernorConfig {
            budget,
            min_rate: a.persist_min_rate.max(1),
            ..Default::default()
        }),
    };
    let mut mgr = CheckpointManager::new(sh.store.clone(), mc)?;
    state.register(&mut mgr)?;
    let progress = Arc::new(Mutex::new(Progress {
        step: 0,
        data_pos: 1,
        seed: a.seed,
    }));
    mgr.register_stateful("progress", Scope::Global, progress.clone())?;

    // Join this job's generation before choosing the step: from here on no older job of the
    // run commits anything. (Threads: the process joined it.)
    if a.rank.is_some() {
        mgr.checkpointer().join_generation()?;
    } else {
        mgr.checkpointer().assume_joined();
    }
    let resume = a.resume || a.resume_step.is_some();
    let target = if resume {
        mgr.resume_target()
    } else {
        runtime().block_on(sh.store.latest_committed(&a.run))
    };
    let target = target.inspect_err(|e| note_resume_failure(resume, e))?;
    let mut resumed = None;
    match (resume, target) {
        (true, Some(s)) => {
            mgr.restore(s).map_err(|e| {
                note_resume_failure(true, &e);
                e.context(format!("restoring step {s} of run {} to resume it", a.run))
            })?;
            let p = *progress.lock();
            if p.step != s {
                return Err(Error::corrupt(format!(
                    "step {s} of run {} holds training progress for step {}",
                    a.run, p.step
                )));
            }
            if p.seed != a.seed {
                return Err(Error::invalid(format!(
                    "run {} was started with --seed {}; resuming with --seed {} would change every number",
                    a.run, p.seed, a.seed
                )));
            }
            resumed = Some(s);
        }
        (true, None) => info!(rank, "nothing to resume from: starting at step 0"),
        (false, Some(s)) => {
            return Err(Error::invalid(format!(
                "run {} already has a committed checkpoint (step {s}); pass --resume to continue it or choose another --run",
                a.run
            )));
        }
        (false, None) => {}
    }
    if rank == 0 || sh.world_threads == 1 {
        sh.outcome.lock().resumed_from = resumed;
    }

    // Supervised (ckpt resume): beat after every step and in between.
    let heartbeat = match &sh.launched {
        Some(e) => Some(
            ckpt_recovery::HeartbeatClient::from_rank_env(e).map_err(|err| {
                Error::io(
                    "connecting to the driver's heartbeat socket",
                    &e.heartbeat.socket.display(),
                    err,
                )
            })?,
        ),
        None => None,
    };
    if let Some(hb) = &heartbeat {
        hb.step(progress.lock().step, None);
    }
    let start = progress.lock().step + 1;
    let mut pending: Option<(SaveHandle, Instant, f64)> = None;
    let mut saves: Vec<(SaveHandle, f64)> = Vec::new();
    let mut last = start.saturating_sub(1);
    let mut stopped: Option<Error> = None;
    let mut step = start;
    while step <= a.steps {
        let t_step = Instant::now();
        let batch = {
            let mut p = progress.lock();
            p.data_pos = next_batch(&a.skip_batches, p.data_pos);
            p.data_pos
        };
        let scale = a.target_scale(batch);
        // Forward and backward read the weights: they overlap with a pending snapshot copy.
        let part = state.partial_loss(batch, scale);
        if let Some((h, t0, call_s)) = pending.take() {
            let tw = Instant::now();
            h.wait_snapshot()?;
            let stall = call_s + tw.elapsed().as_secs_f64();
            let _ = t0;
            saves.push((h, stall));
        }
        // The optimizer step mutates the state.
        state.update(step, batch, scale);
        {
            let mut p = progress.lock();
            p.step = step;
            p.data_pos = batch + 1;
        }
        if let Some(hb) = &heartbeat {
            hb.step(step, Some(heartbeat_workload(&part)));
        }
        if let Some(ms) = Some(a.step_time_ms).filter(|&m| m > 0) {
            let left = Duration::from_millis(ms).saturating_sub(t_step.elapsed());
            std::thread::sleep(left);
        }
        // Lockstep with the other rank threads: rank 0 logs the global loss and decides about
        // spikes and SIGTERM for all, before anything of this step is saved.
        let decision = decide(sh, &mut mgr, rank, step, batch, part, t_step)?;
        // A newer generation owns the run (a job resumed while this one runs): stop at once,
        // no retries; nothing this job saves can commit any more.
        if let Some(why) = fence_of(sh, &mgr) {
            warn!(rank, step, "stopping: {why}");
            stopped = Some(Error::new(ErrorKind::Fenced, why));
            break;
        }
        match decision {
            Decision::Continue | Decision::Alert(_) => {}
            Decision::Rollback(spike) => {
                if let Some((h, t0, _)) = pending.take() {
                    h.wait_snapshot()?;
                    saves.push((h, t0.elapsed().as_secs_f64()));
                }
                let r = mgr.rollback(&spike, |_| {
                    let mut p = progress.lock();
                    let first = p.data_pos;
                    let through = spike.batch?;
                    p.data_pos = p.data_pos.max(through + 1);
                    (through >= first).then_some((first, through))
                });
                let r = agree(sh, r)?;
                if let Some(hb) = &heartbeat {
                    hb.step(r.to_step, None);
                }
                emit_finished(sh, rank, &mut saves, false)?;
                last = r.to_step;
                step = r.to_step + 1;
                continue;
            }
            Decision::Stop(st) => {
                stopped = Some(Error::new(
                    ErrorKind::InvalidInput,
                    format!("run {}: {st}", a.run),
                ));
                break;
            }
        }
        let stop = sh.stop_now.load(Ordering::SeqCst);
        if stop {
            // The final checkpoint gets the manager's final deadline.
            mgr.request_stop();
        }
        last = step;
        let t_save = Instant::now();
        let h = if step == a.steps || stop {
            mgr.save_now(step).map(Some)
        } else {
            mgr.maybe_save(step)
        };
        let h = match h {
            // Threads: the ranks stop together at the next step's decision (a rank leaving
            // alone would leave the others waiting at the barrier).
            Err(e) if e.kind() == ErrorKind::Fenced && sh.args.rank.is_none() && step < a.steps => {
                warn!(rank, step, "checkpoint refused: {e}");
                None
            }
            h => h?,
        };
        if let Some(h) = h {
            let call_s = t_save.elapsed().as_secs_f64();
            if a.no_overlap || step == a.steps || stop {
                h.wait_snapshot()?;
                saves.push((h, t_save.elapsed().as_secs_f64()));
            } else {
                pending = Some((h, t_save, call_s));
            }
        }
        emit_finished(sh, rank, &mut saves, false)?;
        emit_persists(sh, &mut mgr);
        if stop || mgr.should_stop() {
            info!(rank, step, "stopping after the final checkpoint (SIGTERM)");
            break;
        }
        step += 1;
    }
    if let Some(e) = stopped.take_if(|e| e.kind() == ErrorKind::Fenced) {
        // Its pending save cannot commit; waiting for it would only delay the stop.
        return Err(e);
    }
    if let Some((h, t0, _)) = pending.take() {
        h.wait_snapshot()?;
        saves.push((h, t0.elapsed().as_secs_f64()));
    }
    mgr.finish()?;
    emit_finished(sh, rank, &mut saves, true)?;
    emit_persists(sh, &mut mgr);
    let health = mgr.store_health();
    if health != Default::default() {
        sh.emit(&Metric::StoreHealth(records::StoreHealth {
            rank,
            failed: health.failed,
            skipped: health.skipped,
            resumed: health.resumed,
            down: health.down,
        }));
    }
    if rank == 0 || sh.world_threads == 1 {
        let mut out = sh.outcome.lock();
        out.last_step = last;
        out.rollbacks = mgr.monitor().history().to_vec();
    }
    match stopped {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

static RESUME_DATA_FAILURE: AtomicBool = AtomicBool::new(false);

/// Remember that the step to resume from could not be read because of its data.
fn note_resume_failure(resume: bool, e: &Error) {
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

/// This job's generation. Set (`--generation`, `CKPT_GENERATION` from a supervisor): every
/// rank joins it. All ranks in this process: a new generation claimed in the store (above
/// every started one and every one that saved), so this job fences any older job of the run,
/// and two jobs started at once get different numbers. One rank per process without a
/// supervisor: the ranks cannot agree on a fresh number without talking, so each takes the
/// larger of what the saved steps call for and the newest started generation (the one a
/// sibling rank of this job may have just marked); pass `--generation` to be explicit.
async fn choose_generation(store: &Store, args: &TrainArgs) -> Result<u64> {
    if let Some(g) = args.generation {
        return Ok(g);
    }
    let resume = args.resume || args.resume_step.is_some();
    let floor = if resume {
        next_generation(store, &args.run).await?
    } else {
        0
    };
    if args.rank.is_none() {
        return store.claim_generation(&args.run, floor).await;
    }
    if !resume {
        return Ok(floor);
    }
    Ok(floor.max(store.newest_generation(&args.run).await?.unwrap_or(0)))
}

/// Why a newer generation fenced this job out, if it did. One rank per process: this rank's
/// checkpointer; threads: what rank 0 saw for this step (the same for every rank).
fn fence_of(sh: &Shared, mgr: &CheckpointManager) -> Option<String> {
    if sh.args.rank.is_some() {
        mgr.checkpointer().fenced().map(|e| e.to_string())
    } else {
        sh.fence_now.lock().clone()
    }
}

/// One more than any generation that saved in `run`: the newest commit's, and those of
/// manifests left by attempts that died before committing.
async fn next_generation(store: &Store, run: &str) -> Result<u64> {
    let mut g = 0;
    let latest = store.latest_committed(run).await?;
    if let Some(s) = latest {
        g = store.read_commit_root(run, s).await?.0.generation + 1;
    }
    for st in store.list_steps(run).await? {
        if st.committed || latest.is_some_and(|l| st.step < l) {
            continue;
        }
        for r in st.ranks {
            if let Ok((m, _, _)) = store.get_rank_manifest(run, st.step, r).await {
                g = g.max(m.generation + 1);
            }
        }
    }
    Ok(g)
}

/// This step's observation, logged and judged; returns what every rank does next.
///
/// One rank per process: the rank's own partial sums (the global loss when the world is 1).
/// Threads: every rank adds its partial to the board; after a barrier rank 0 logs the exact
/// global loss, asks its manager's monitor and checks SIGTERM; after a second barrier every
/// rank reads the same decision.
fn decide(
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

/// The rank threads' per-step barrier, which a failing rank breaks: the others then fail
/// too instead of waiting for it forever.
struct Lockstep {
    n: usize,
    /// (arrived in this round, round, why it was broken)
    state: Mutex<(usize, u64, Option<String>)>,
    cond: Condvar,
}

impl Lockstep {
    const ABORT: &'static str = "stopped because another rank failed";

    fn new(n: usize) -> Self {
        Lockstep {
            n,
            state: Mutex::new((0, 0, None)),
            cond: Condvar::new(),
        }
    }

    fn wait(&self) -> Result<()> {
        let mut g = self.state.lock();
        if let Some(why) = &g.2 {
            return Err(Error::internal(format!("{} ({why})", Self::ABORT)));
        }
        let round = g.1;
        g.0 += 1;
        if g.0 == self.n {
            g.0 = 0;
            g.1 += 1;
            self.cond.notify_all();
        }
        while g.1 == round && g.2.is_none() {
            self.cond.wait(&mut g);
        }
        match &g.2 {
            Some(why) if g.1 == round => Err(Error::internal(format!("{} ({why})", Self::ABORT))),
            _ => Ok(()),
        }
    }

    fn abort(&self, why: &str) {
        let mut g = self.state.lock();
        g.2.get_or_insert_with(|| why.to_string());
        self.cond.notify_all();
    }

    fn is_abort(e: &Error) -> bool {
        e.to_string().contains(Self::ABORT)
    }
}

/// Step time (so far) and memory of a step record. The reference workload keeps its state in
/// host memory (no `device_mem_bytes`).
fn step_figures(t_step: Instant) -> StepMetrics {
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
fn heartbeat_workload(part: &Partial) -> Workload {
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

fn note_spike(sh: &Shared, d: &Decision) {
    let spike = match d {
        Decision::Continue => return,
        Decision::Alert(s) | Decision::Rollback(s) => *s,
        Decision::Stop(st) => st.spike,
    };
    sh.outcome.lock().spikes.push(spike);
}

/// Threads mode: every rank rolled back, or all fail (the ranks must stay in lockstep).
fn agree(
    sh: &Shared,
    r: Result<ckpt_trainer::manager::Rollback>,
) -> Result<ckpt_trainer::manager::Rollback> {
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

/// The persist governor's figures of the persists that ended (`persist` records).
fn emit_persists(sh: &Shared, mgr: &mut CheckpointManager) {
    for f in mgr.take_persist_figures() {
        sh.emit(&Metric::Persist(f));
    }
}

fn emit_finished(
    sh: &Shared,
    rank: u32,
    saves: &mut Vec<(SaveHandle, f64)>,
    all: bool,
) -> Result<()> {
    let mut keep = Vec::new();
    let mut any = false;
    for (h, stall) in saves.drain(..) {
        use ckpt_trainer::save::Stage;
        let done = match h.stage() {
            Stage::Committed => true,
            Stage::Persisted => rank != 0 || all,
            Stage::Failed(e) => {
                warn!(rank, step = h.step(), "checkpoint failed: {e}");
                sh.emit(&Metric::CheckpointFailed(records::CheckpointFailed {
                    step: h.step(),
                    rank: Some(rank),
                    error: e.message.clone(),
                    error_kind: Some(e.kind.as_str().to_string()),
                }));
                // A newer generation owns the run: this job must stop, not go on training
                // without checkpoints. Other failures skip one checkpoint.
                if e.kind == ErrorKind::Fenced {
                    return Err(Error::new(
                        ErrorKind::Fenced,
                        format!("checkpoint of step {} failed: {}", h.step(), e.message),
                    ));
                }
                continue;
            }
            Stage::Skipped(why) => {
                sh.emit(&Metric::CheckpointSkipped(records::CheckpointSkipped {
                    step: h.step(),
                    rank: Some(rank),
                    reason: why.to_string(),
                }));
                continue;
            }
            _ => all,
        };
        if !done {
            keep.push((h, stall));
            continue;
        }
        let r = if all && rank == 0 {
            h.wait_committed(Duration::from_secs(600))?
        } else if all {
            h.wait_persisted()?
        } else {
            h.report()
        };
        let v = records::CheckpointMetrics {
            rank: Some(rank),
            stall_s: stall,
            ..records::CheckpointMetrics::from(&r)
        };
        sh.outcome.lock().checkpoints.push(v.clone());
        sh.emit(&Metric::Checkpoint(v));
        any = true;
    }
    *saves = keep;
    if any {
        sh.flush_log();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_ranges_parse_and_skip() {
        assert_eq!(parse_batch_range("11-15"), Ok((11, 15)));
        assert_eq!(parse_batch_range(" 7 "), Ok((7, 7)));
        for bad in ["0-3", "5-4", "a-b", "3-", ""] {
            assert!(parse_batch_range(bad).is_err(), "{bad:?}");
        }
        let skips = [(3, 4), (5, 6), (10, 10)];
        let cases = [(1, 1), (3, 7), (4, 7), (7, 7), (10, 11), (12, 12)];
        for (pos, want) in cases {
            assert_eq!(next_batch(&skips, pos), want, "from {pos}");
        }
        assert_eq!(next_batch(&[], 9), 9);
    }

    #[test]
    fn persist_budget_is_a_fraction_a_percentage_or_off() {
        assert_eq!(parse_budget("0.1"), Ok(Budget::Fraction(0.1)));
        assert_eq!(parse_budget("25%"), Ok(Budget::Fraction(0.25)));
        assert_eq!(parse_budget(" off "), Ok(Budget::Off));
        for bad in ["0", "-0.1", "nan", "ten", "%"] {
            assert!(parse_budget(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ckpt_every_is_steps_or_auto() {
        assert_eq!(parse_ckpt_every("25"), Ok(CkptEvery::Steps(25)));
        assert_eq!(parse_ckpt_every("auto"), Ok(CkptEvery::Auto));
        for bad in ["0", "-3", "often", ""] {
            let e = parse_ckpt_every(bad).unwrap_err();
            assert!(e.contains("auto"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn injection_scales_targets() {
        let a = TrainArgs::parse_from([
            "ckpt-train",
            "--store",
            "/tmp/x",
            "--run",
            "r",
            "--steps",
            "9",
            "--inject-spike-at",
            "3,5",
            "--inject-nan-at",
            "4",
            "--skip-batches",
            "6-7,9",
        ]);
        assert_eq!(a.target_scale(3), SPIKE_SCALE);
        assert_eq!(a.target_scale(5), SPIKE_SCALE);
        assert!(a.target_scale(4).is_nan());
        assert_eq!(a.target_scale(2), 1.0);
        assert_eq!(a.skip_batches, vec![(6, 7), (9, 9)]);
        assert_eq!(a.on_spike, SpikeAction::Alert);
        assert_eq!(a.monitor_config().window, DEFAULT_WINDOW);
    }
}
