//! `ckpt-train`, the reference workload, as a library function ([`run`]) that tests call
//! directly and the binary wraps.
//!
//! All ranks run as threads of one process (a barrier per step stands in for the collectives
//! of real training), or one rank per process with `--rank` (or `CKPT_RANK`, as the
//! supervisor sets it).

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use ckpt_store::logs::{LogWriter, METRICS};
use ckpt_store::{Error, Failpoints, Layout, Result, StepReader, Store};
use clap::Parser;
use parking_lot::Mutex;
use serde_json::json;
use tracing::{info, warn};

use crate::manager::{CheckpointManager, ManagerConfig, Scope};
use crate::save::{BackPressure, CheckpointerConfig, SaveHandle, runtime};
use crate::workload::{ModelConfig, Partial, Progress, RankState, TrainConfig, step_digest};

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

/// Arguments of `ckpt-train`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "ckpt-train",
    version,
    about = "The ckpt reference workload: a deterministic sharded training job"
)]
pub struct TrainArgs {
    /// Store URL (directory, s3://bucket/prefix, ...).
    #[arg(long, env = "CKPT_STORE")]
    pub store: String,
    /// Run name.
    #[arg(long, env = "CKPT_RUN")]
    pub run: String,
    /// Layout, e.g. dp=2,tp=2,pp=1.
    #[arg(long, env = "CKPT_LAYOUT", default_value = "dp=1,tp=1,pp=1")]
    pub layout: String,
    /// ZeRO stage (0-3); overrides zero= in --layout.
    #[arg(long)]
    pub zero: Option<u8>,
    /// Train until this step.
    #[arg(long)]
    pub steps: u64,
    /// Checkpoint every K steps (and always at the last step).
    #[arg(long, default_value_t = 10)]
    pub ckpt_every: u64,
    /// Number of parameters (suffixes K, M, G).
    #[arg(long, default_value = "1M", value_parser = parse_count)]
    pub params: u64,
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
    #[arg(long, env = "CKPT_RANK")]
    pub rank: Option<u32>,
    /// Job generation (set by the supervisor; otherwise 0 for a new run and, on --resume,
    /// one more than any generation that saved in this run).
    #[arg(long, env = "CKPT_GENERATION")]
    pub generation: Option<u64>,
    /// Resume from the newest committed checkpoint of the run.
    #[arg(long, env = "CKPT_RESUME")]
    pub resume: bool,
    /// Write per-step and per-checkpoint metrics as JSON lines here.
    #[arg(long)]
    pub metrics_out: Option<PathBuf>,
    /// Freeze this fraction of the layers (fine-tuning).
    #[arg(long, default_value_t = 0.0)]
    pub frozen: f64,
    /// Staging memory bound per rank (default: the rank's state, so the snapshot never waits
    /// for the persist).
    #[arg(long, value_parser = parse_count)]
    pub staging: Option<u64>,
    /// Allocate and touch staging memory at start.
    #[arg(long)]
    pub prefault: bool,
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
    /// Make every step take at least this long (tests that kill ranks mid-run).
    #[arg(long, default_value_t = 0)]
    pub step_time_ms: u64,
    /// Failpoints, e.g. after_chunks=kill (also from CKPT_FAILPOINTS).
    #[arg(long, env = "CKPT_FAILPOINTS")]
    pub failpoints: Option<String>,
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
    pub checkpoints: Vec<serde_json::Value>,
}

struct Shared {
    generation: u64,
    args: TrainArgs,
    store: Store,
    layout: Layout,
    model: ModelConfig,
    world_threads: u32,
    barrier: Option<Barrier>,
    board: Mutex<std::collections::BTreeMap<u64, (Partial, u32)>>,
    stop_now: AtomicBool,
    sigterm: Arc<AtomicBool>,
    metrics: Mutex<Option<std::fs::File>>,
    log: Mutex<Option<LogWriter>>,
    outcome: Mutex<Outcome>,
}

impl Shared {
    fn emit(&self, v: serde_json::Value) {
        if let Some(f) = self.metrics.lock().as_mut() {
            let _ = writeln!(f, "{v}");
        }
        if let Some(l) = self.log.lock().as_mut() {
            let _ = l.append(&v);
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

/// Run the workload (see the module docs).
pub fn run(args: TrainArgs) -> Result<Outcome> {
    let mut layout: Layout = args.layout.parse()?;
    if let Some(z) = args.zero {
        layout.zero = z;
        layout.validate()?;
    }
    if let Some(w) = std::env::var("CKPT_WORLD_SIZE")
        .ok()
        .and_then(|w| w.parse::<u32>().ok())
        && w != layout.world()
    {
        return Err(Error::invalid(format!(
            "the supervisor runs {w} ranks but the layout {layout} has {}: under `ckpt resume` leave --layout out (the supervisor sets CKPT_LAYOUT)",
            layout.world()
        )));
    }
    let mut store = ckpt_store::open(&args.store)?;
    if let Some(cs) = args.chunk_size {
        let mut cfg = store.config().clone();
        cfg.chunk_size = cs as usize;
        cfg.pack_threshold = cfg.pack_threshold.min(cfg.chunk_size);
        cfg.inflight_bytes = cfg.inflight_bytes.max(cfg.pack_target + cfg.chunk_size);
        store = store.with_config(cfg)?;
    }
    if let Some(fp) = &args.failpoints {
        store = store.with_failpoints(Failpoints::parse(fp)?);
    }
    let model = ModelConfig::for_params(args.params, args.layers);
    if let Some(r) = args.rank
        && r >= layout.world()
    {
        return Err(Error::invalid(format!(
            "rank {r} is outside the layout {layout} ({} ranks)",
            layout.world()
        )));
    }
    let generation = match args.generation {
        Some(g) => g,
        None if args.resume => runtime().block_on(next_generation(&store, &args.run))?,
        None => 0,
    };
    let ranks: Vec<u32> = match args.rank {
        Some(r) => vec![r],
        None => (0..layout.world()).collect(),
    };
    let threads = ranks.len() as u32;
    let committer_here = ranks.contains(&0);
    let metrics = match &args.metrics_out {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
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
        signal_hook::flag::register(signal_hook::consts::SIGTERM, sigterm.clone())
            .map_err(|e| Error::internal(format!("installing the SIGTERM handler: {e}")))?;
    }
    info!(
        run = %args.run,
        layout = %layout,
        params = model.param_count(),
        state_bytes = model.state_bytes(),
        "training"
    );
    let shared = Arc::new(Shared {
        generation,
        args: args.clone(),
        store,
        layout,
        model,
        world_threads: threads,
        barrier: (threads > 1).then(|| Barrier::new(threads as usize)),
        board: Mutex::default(),
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
                .spawn(move || rank_main(&sh, r))
                .map_err(|e| Error::internal(format!("starting rank {r}: {e}")))?,
        );
    }
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert(Error::internal("a rank thread panicked"));
            }
        }
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
        shared.emit(json!({"kind": "final", "step": step, "digest": digest}));
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
    ck.copy_threads = (std::thread::available_parallelism().map_or(2, |n| n.get())
        / sh.world_threads as usize)
        .max(1);
    ck.back_pressure = match a.back_pressure {
        BackPressureArg::Wait => BackPressure::Wait,
        BackPressureArg::Skip => BackPressure::Skip,
    };
    let mut mc = ManagerConfig::new(ck);
    mc.every_steps = Some(a.ckpt_every.max(1));
    mc.keep_last = a.keep_last;
    mc.keep_every = a.keep_every;
    // One rank per process: the manager takes the final checkpoint on SIGTERM, unless the
    // supervisor says the job is being stopped after a failure (no commit is possible then).
    mc.final_on_sigterm =
        a.rank.is_some() && std::env::var("CKPT_FINAL_ON_SIGTERM").map_or(true, |v| v != "0");
    let mut mgr = CheckpointManager::new(sh.store.clone(), mc)?;
    state.register(&mut mgr)?;
    let progress = Arc::new(Mutex::new(Progress {
        step: 0,
        data_pos: 1,
        seed: a.seed,
    }));
    mgr.register_stateful("progress", Scope::Global, progress.clone())?;

    let latest = runtime().block_on(sh.store.latest_committed(&a.run))?;
    let mut resumed = None;
    match (a.resume, latest) {
        (true, Some(s)) => {
            mgr.restore(s)?;
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
    let heartbeat = ckpt_recovery::HeartbeatClient::from_env();
    if let Some(hb) = &heartbeat {
        hb.step(progress.lock().step, None);
    }
    let start = progress.lock().step + 1;
    let mut pending: Option<(SaveHandle, Instant, f64)> = None;
    let mut saves: Vec<(SaveHandle, f64)> = Vec::new();
    let mut last = start.saturating_sub(1);
    for step in start..=a.steps {
        let t_step = Instant::now();
        let batch = progress.lock().data_pos;
        // Forward and backward read the weights: they overlap with a pending snapshot copy.
        let part = state.partial_loss(batch, 1.0);
        if let Some((h, t0, call_s)) = pending.take() {
            let tw = Instant::now();
            h.wait_snapshot()?;
            let stall = call_s + tw.elapsed().as_secs_f64();
            let _ = t0;
            saves.push((h, stall));
        }
        // The optimizer step mutates the state.
        state.update(step, batch, 1.0);
        {
            let mut p = progress.lock();
            p.step = step;
            p.data_pos += 1;
        }
        record_loss(sh, rank, step, part);
        if let Some(hb) = &heartbeat {
            hb.step(step, Some((part.sse, part.gsq, part.n)));
        }
        if let Some(ms) = Some(a.step_time_ms).filter(|&m| m > 0) {
            let left = Duration::from_millis(ms).saturating_sub(t_step.elapsed());
            std::thread::sleep(left);
        }
        // Lockstep with the other rank threads; rank 0 decides about SIGTERM for all.
        if let Some(b) = &sh.barrier {
            b.wait();
            if rank == 0 && sh.sigterm.load(Ordering::SeqCst) {
                sh.stop_now.store(true, Ordering::SeqCst);
            }
            b.wait();
        } else if sh.sigterm.load(Ordering::SeqCst) {
            sh.stop_now.store(true, Ordering::SeqCst);
        }
        let stop = sh.stop_now.load(Ordering::SeqCst);
        last = step;
        let t_save = Instant::now();
        let h = if step == a.steps || stop {
            Some(mgr.save_now(step)?)
        } else {
            mgr.maybe_save(step)?
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
        if stop || mgr.should_stop() {
            info!(rank, step, "stopping after the final checkpoint (SIGTERM)");
            break;
        }
    }
    if let Some((h, t0, _)) = pending.take() {
        h.wait_snapshot()?;
        saves.push((h, t0.elapsed().as_secs_f64()));
    }
    mgr.finish()?;
    emit_finished(sh, rank, &mut saves, true)?;
    if rank == 0 || sh.world_threads == 1 {
        sh.outcome.lock().last_step = last;
    }
    Ok(())
}

/// One more than any generation that saved in `run`: the newest commit's, and those of
/// manifests left by attempts that died before committing.
async fn next_generation(store: &Store, run: &str) -> Result<u64> {
    let mut g = 0;
    let latest = store.latest_committed(run).await?;
    if let Some(s) = latest {
        g = store.read_commit(run, s).await?.0.generation + 1;
    }
    for st in store.list_steps(run).await? {
        if st.committed || latest.is_some_and(|l| st.step < l) {
            continue;
        }
        for r in st.ranks {
            let path = store.keys().rank_manifest(run, st.step, r);
            if let Ok((m, _, _)) = store.get_json::<ckpt_store::RankManifest>(&path).await {
                g = g.max(m.generation + 1);
            }
        }
    }
    Ok(g)
}

fn record_loss(sh: &Shared, rank: u32, step: u64, part: Partial) {
    if sh.args.rank.is_some() {
        // One rank per process: only partial sums are known here.
        let mut v = json!({
            "kind": "step", "step": step, "rank": rank,
            "sse": part.sse.to_string(), "gsq": part.gsq.to_string(), "n": part.n,
        });
        if sh.layout.world() == 1 {
            v["loss"] = json!(part.loss());
            v["grad_norm"] = json!(part.grad_norm());
            sh.outcome.lock().losses.push((step, part.loss()));
        }
        sh.emit(v);
        return;
    }
    let done = {
        let mut b = sh.board.lock();
        let e = b.entry(step).or_default();
        e.0.add(&part);
        e.1 += 1;
        if e.1 == sh.world_threads {
            b.remove(&step).map(|x| x.0)
        } else {
            None
        }
    };
    if let Some(tot) = done {
        sh.outcome.lock().losses.push((step, tot.loss()));
        sh.emit(json!({
            "kind": "step", "step": step, "loss": tot.loss(), "grad_norm": tot.grad_norm(),
        }));
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
        use crate::save::Stage;
        let done = match h.stage() {
            Stage::Committed => true,
            Stage::Persisted => rank != 0 || all,
            Stage::Failed(e) => {
                warn!(rank, step = h.step(), "checkpoint failed: {e}");
                sh.emit(json!({"kind": "checkpoint_failed", "step": h.step(), "rank": rank, "error": e}));
                continue;
            }
            Stage::Skipped(why) => {
                sh.emit(json!({"kind": "checkpoint_skipped", "step": h.step(), "rank": rank, "reason": why}));
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
        let v = json!({
            "kind": "checkpoint", "step": r.step, "rank": rank, "bytes": r.bytes,
            "stall_s": stall, "snapshot_s": r.snapshot_s, "persist_s": r.persist_s,
            "commit_s": r.commit_s, "bytes_written": r.bytes_written,
            "bytes_skipped": r.bytes_skipped, "staging_peak": r.staging_peak,
        });
        sh.outcome.lock().checkpoints.push(v.clone());
        sh.emit(v);
        any = true;
    }
    *saves = keep;
    if any {
        sh.flush_log();
    }
    Ok(())
}
