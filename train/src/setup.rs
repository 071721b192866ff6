//! What a run sets up before its ranks start: the layout, the store with the arguments'
//! settings, the model, the checks of arguments that conflict, the automatic interval, the
//! shared staging pool and the metrics outputs.

use std::sync::Arc;
use std::time::Duration;

use ckpt_recovery::{HeartbeatClient, RankEnv};
use ckpt_store::logs::{LogWriter, METRICS};
use ckpt_store::{Error, Failpoints, Layout, Result, Store};

use ckpt_trainer::AutoInterval;
use ckpt_trainer::monitor::SpikeAction;
use ckpt_trainer::staging::{PoolConfig, StagingPool};
use ckpt_trainer::workload::ModelConfig;

use crate::{CkptEvery, TrainArgs};

/// `--layout`, with `--zero` over it.
pub(crate) fn layout(args: &TrainArgs) -> Result<Layout> {
    let mut layout: Layout = args.layout.parse()?;
    if let Some(z) = args.zero {
        layout.zero = z;
        layout.validate()?;
    }
    Ok(layout)
}

/// A driver that launched this process runs as many ranks as the layout has.
pub(crate) fn check_launched(launched: Option<&RankEnv>, layout: &Layout) -> Result<()> {
    if let Some(w) = launched.map(|e| e.world_size)
        && w != layout.world()
    {
        return Err(Error::invalid(format!(
            "the supervisor runs {w} ranks but the layout {layout} has {}: under `ckpt resume` leave --layout out (the supervisor sets CKPT_LAYOUT)",
            layout.world()
        )));
    }
    Ok(())
}

/// Under a driver, the heartbeat, connected first thing: the driver sees the rank alive while
/// it opens the store and restores (its beats say `starting` until the rank reports the step
/// it resumed from), so a rank stopped or killed meanwhile is found within the heartbeat
/// timeout, not the start-up timeout.
pub(crate) fn heartbeat(launched: Option<&RankEnv>) -> Result<Option<HeartbeatClient>> {
    launched
        .map(|e| {
            HeartbeatClient::starting_from_rank_env(e).map_err(|err| {
                Error::io(
                    "connecting to the driver's heartbeat socket",
                    &e.heartbeat.socket.display(),
                    err,
                )
            })
        })
        .transpose()
}

/// The store, with the request layers, chunk size, deltas and failpoints the arguments set.
pub(crate) fn open_store(args: &TrainArgs) -> Result<Store> {
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
    Ok(store)
}

/// The local tier of `--local-tier`, if any (no request layers: the faults and retries of
/// `--store-faults` and `--store-retry` are the remote store's).
pub(crate) fn open_local_tier(args: &TrainArgs, store: &Store) -> Result<Option<Store>> {
    let Some(url) = &args.local_tier else {
        return Ok(None);
    };
    let local = ckpt_store::open(url)?.with_config(store.config().clone())?;
    Ok(Some(local))
}

/// The model: from `--params`, or `--d-model` (a multiple of tp).
pub(crate) fn model(args: &TrainArgs, layout: &Layout) -> Result<ModelConfig> {
    match args.d_model {
        None => Ok(ModelConfig::for_params(args.params, args.layers)),
        Some(d) if d == 0 || !d.is_multiple_of(layout.tp as u64) => Err(Error::invalid(format!(
            "--d-model {d} must be a positive multiple of tp={}",
            layout.tp
        ))),
        Some(d) => Ok(ModelConfig {
            vocab: 8 * d,
            d_model: d,
            ffn: 4 * d,
            layers: args.layers.max(1),
        }),
    }
}

/// The spike monitor's settings, and a rollback only where the exact global loss is known.
pub(crate) fn check_monitor(args: &TrainArgs, layout: &Layout) -> Result<()> {
    args.monitor_config()
        .validate()
        .map_err(|e| Error::invalid(format!("spike monitor: {e}")))?;
    if args.on_spike == SpikeAction::Rollback && args.rank.is_some() && layout.world() > 1 {
        return Err(Error::invalid(format!(
            "--on-spike rollback needs the exact global loss, and with one rank per process (--rank or CKPT_RANK) over the {} ranks of {layout} each rank knows only its partial sums: run all ranks in one process (leave out --rank), or use --on-spike alert, which watches each rank's share of the loss",
            layout.world()
        )));
    }
    Ok(())
}

/// `--ckpt-every auto`: one schedule for every rank thread, or one interval per generation
/// for ranks in separate processes.
pub(crate) fn auto_interval(args: &TrainArgs, layout: &Layout) -> Result<Option<AutoInterval>> {
    let auto_interval = (args.ckpt_every == CkptEvery::Auto).then(|| {
        let a = AutoInterval::new(
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
    Ok(auto_interval)
}

/// `--rank` is one of the layout's.
pub(crate) fn check_rank(args: &TrainArgs, layout: &Layout) -> Result<()> {
    if let Some(r) = args.rank
        && r >= layout.world()
    {
        return Err(Error::invalid(format!(
            "rank {r} is outside the layout {layout} ({} ranks)",
            layout.world()
        )));
    }
    Ok(())
}

/// `--metrics-out`, appended to (never through a link planted at the name), and the run's
/// metrics log in the store.
pub(crate) fn metrics_outputs(
    args: &TrainArgs,
    store: &Store,
) -> Result<(Option<std::fs::File>, LogWriter)> {
    let metrics = match &args.metrics_out {
        Some(p) => Some(
            ckpt_store::outfile::open_regular(p, true)
                .map_err(|e| Error::io("opening the metrics file", &p.display(), e))?,
        ),
        None => None,
    };
    let writer_name = match args.rank {
        Some(r) => format!("rank-{r}"),
        None => "ranks".to_string(),
    };
    let log = LogWriter::new(store, &args.run, METRICS, &writer_name)?;
    Ok((metrics, log))
}

/// With `--staging` and rank threads: the pool they share (ranks x the bound).
pub(crate) fn staging_pool(
    args: &TrainArgs,
    store: &Store,
    threads: u32,
) -> Option<Arc<StagingPool>> {
    args.staging.filter(|_| threads > 1).map(|s| {
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
    })
}
