//! `ckpt-train`'s arguments ([`TrainArgs`]) and the parsers of their values (sizes, batch
//! ranges, `--ckpt-every`, `--persist-budget`, `--on-spike`).

use std::path::PathBuf;

use ckpt_recovery::rank_env;
use clap::Parser;

use ckpt_trainer::monitor::{
    DEFAULT_GRAD_FACTOR, DEFAULT_LOSS_K, DEFAULT_LOSS_MIN_RISE, DEFAULT_MAX_ROLLBACKS,
    DEFAULT_WARMUP, DEFAULT_WINDOW, MonitorConfig, SpikeAction,
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
    /// Keep the newest N committed checkpoints (retention; of the store, under a local tier).
    #[arg(long)]
    pub keep_last: Option<usize>,
    /// A local tier (a directory on this machine's disk, or a URL): saves persist and commit
    /// there at its speed, and rank 0 drains each step to --store behind the training (only
    /// new chunks; issue 28). `ckpt resume --local-tier` passes it as CKPT_LOCAL_TIER.
    #[arg(long, env = rank_env::LOCAL_TIER, value_name = "DIR")]
    pub local_tier: Option<String>,
    /// With --local-tier: keep the newest N committed steps in it (a step still draining is
    /// kept too).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    pub keep_local: u64,
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
    /// The sentinel: how much of the data-parallel replicas it holds a rank hashes at each
    /// checkpoint, for the committer to compare with the stored bytes: `full`, `sample=F` (a
    /// rotating fraction F of their chunks) or `off`. Default: what `ckpt resume --sdc-check`
    /// says (CKPT_SDC_CHECK), else sample=0.05.
    #[arg(long, value_name = "full|sample=F|off", value_parser = parse_sdc)]
    pub sdc_check: Option<ckpt_store::SdcCheck>,
    /// What the committing rank does when a step's replicas disagree: `warn` (a
    /// replica_mismatch event) or `stop` (the run fails, naming the mismatch). `rollback` is
    /// `ckpt resume`'s (`--on-replica-mismatch rollback` there); given here, a rank warns.
    #[arg(long, default_value = "warn", value_parser = parse_policy)]
    pub on_replica_mismatch: ckpt_store::MismatchPolicy,
    /// Report (a state_unchanged event) trainable tensors whose bytes stay the same over this
    /// many consecutive checkpoints while steps advance (0: off).
    #[arg(long, default_value_t = 2)]
    pub stale_after: u32,
    /// Test flag (silent data corruption): flip one bit of a replicated tensor (the first
    /// parameter's master weight and its bf16 copy) in the live state of the rank running on
    /// node NODE, right after step STEP's update. Without a driver NODE names the rank.
    #[arg(long, value_name = "NODE@STEP", value_parser = parse_node_at)]
    pub inject_bitflip: Option<(u32, u64)>,
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

fn parse_sdc(s: &str) -> std::result::Result<ckpt_store::SdcCheck, String> {
    s.parse().map_err(|e: ckpt_store::Error| e.to_string())
}

fn parse_policy(s: &str) -> std::result::Result<ckpt_store::MismatchPolicy, String> {
    s.parse().map_err(|e: ckpt_store::Error| e.to_string())
}

/// `NODE@STEP`.
pub fn parse_node_at(s: &str) -> std::result::Result<(u32, u64), String> {
    let bad = || format!("{s:?} is not NODE@STEP (e.g. 1@40)");
    let (n, st) = s.split_once('@').ok_or_else(bad)?;
    Ok((
        n.trim().parse().map_err(|_| bad())?,
        st.trim().parse().map_err(|_| bad())?,
    ))
}

/// `off`, `alert` or `rollback`.
fn parse_spike_action(s: &str) -> std::result::Result<SpikeAction, String> {
    [SpikeAction::Off, SpikeAction::Alert, SpikeAction::Rollback]
        .into_iter()
        .find(|a| a.to_string() == s)
        .ok_or_else(|| format!("{s:?} is not one of off, alert, rollback"))
}

#[cfg(test)]
mod tests;
