//! `ckpt resume --run NAME --nodes N --ranks-per-node R [--layout L] [--spares S]
//! [--max-restarts K] [--repair-after SECS] -- COMMAND...`: run a training command under the
//! local supervisor (see `ckpt-recovery`): launch its ranks on simulated nodes, detect a dead
//! or hung rank, stop the job, restart on the surviving nodes from the newest committed
//! checkpoint, resharded; with `--repair-after`, failed nodes come back and the job grows back
//! onto them at the next commit.

use std::path::PathBuf;
use std::time::Duration;

use ckpt_recovery::{JobOptions, SupervisorOptions};

use super::shared::parse::duration;
use super::shared::supervision::{RestartArgs, ResumeOutput};
use super::{CliError, Result, Ui};

/// Arguments of `ckpt resume`.
#[derive(Debug, Clone, clap::Args)]
pub struct ResumeArgs {
    /// Run name (passed to the ranks as CKPT_RUN).
    #[arg(long)]
    pub run: String,
    /// Nodes that run ranks.
    #[arg(long, default_value_t = 1)]
    pub nodes: u32,
    /// Ranks per node.
    #[arg(long, default_value_t = 1)]
    pub ranks_per_node: u32,
    /// Spare nodes, used first to replace failed ones.
    #[arg(long, default_value_t = 0)]
    pub spares: u32,
    /// Layout to start with (default: dp = nodes x ranks per node).
    #[arg(long)]
    pub layout: Option<String>,
    /// Failure detection and restarts.
    #[command(flatten)]
    pub restarts: RestartArgs,
    /// Write each rank's stdout and stderr into this directory.
    #[arg(long)]
    pub logs: Option<PathBuf>,
    /// Keep peer replicas: one `ckpt replica-agent` per node holds its ranks' newest snapshots
    /// in memory with a copy on the next node, and a restore after a failure reads the lost
    /// shards from there (every chunk verified) and only the rest from the store. Each agent
    /// holds about twice a node's state in host memory.
    #[arg(long)]
    pub peer_replicas: bool,
    /// Repair failed nodes: a failed node comes back this long after its failure (seconds, or
    /// a duration such as 500ms), and the job grows back onto it (more data parallelism, up to
    /// --layout) right after the next checkpoint commits: the ranks stop and restart
    /// resharded from that step. A node that fails --max-node-failures times within
    /// --node-failure-window is kept out for good. Default: failed nodes never come back.
    #[arg(long, value_name = "SECS", value_parser = secs_or_duration)]
    pub repair_after: Option<Duration>,
    /// A local tier (a directory on this machine's disk): the ranks save and commit there at
    /// its speed, the committing rank drains each step to the store behind the training, and
    /// a restart restores from it what is there (passed to the ranks as CKPT_LOCAL_TIER; its
    /// steps count when the supervisor chooses the step to restore).
    #[arg(long, env = ckpt_recovery::rank_env::LOCAL_TIER, value_name = "DIR")]
    pub local_tier: Option<String>,
    /// The command each rank runs, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// A bare number of seconds (`1`, `0.5`) or a duration (`500ms`, `2m`).
fn secs_or_duration(s: &str) -> std::result::Result<Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(v) => Duration::try_from_secs_f64(v)
            .map_err(|_| format!("{s:?} is not a number of seconds of 0 or more")),
        Err(_) => duration(s),
    }
}

/// Supervise the command (see the module docs).
pub async fn resume(
    url: &str,
    open: &ckpt_store::OpenOptions,
    args: &ResumeArgs,
    _ui: &Ui,
) -> Result<ResumeOutput> {
    let cfg = args.restarts.config(
        args.nodes,
        args.ranks_per_node,
        args.spares,
        args.layout.as_deref(),
    )?;
    let opts = SupervisorOptions {
        job: JobOptions {
            store_url: url.to_string(),
            run: args.run.clone(),
            config: cfg,
            command: args.command.clone(),
            logs_dir: args.logs.clone(),
            heartbeat_interval: args.restarts.heartbeat_interval(),
            open: open.clone(),
            sdc_check: args.restarts.sdc_check,
            local_tier: args.local_tier.clone(),
        },
        replica_agent: match args.peer_replicas {
            true => Some(vec![
                std::env::current_exe()
                    .map_err(|e| CliError::error(format!("cannot find the ckpt binary: {e}")))?
                    .display()
                    .to_string(),
                "replica-agent".into(),
            ]),
            false => None,
        },
        repair_after: args.repair_after,
    };
    let report = ckpt_recovery::run(opts).await.map_err(CliError::from)?;
    Ok(ResumeOutput { report })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repair_time_is_seconds_or_a_duration() {
        assert_eq!(secs_or_duration("1"), Ok(Duration::from_secs(1)));
        assert_eq!(secs_or_duration("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(secs_or_duration("2m"), Ok(Duration::from_secs(120)));
        let e = secs_or_duration("-1").unwrap_err();
        assert!(e.contains("\"-1\""), "{e}");
        assert!(secs_or_duration("soon").is_err());
        assert!(secs_or_duration("1e300").is_err());
    }
}
