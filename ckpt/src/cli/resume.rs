//! `ckpt resume --run NAME --nodes N --ranks-per-node R [--layout L] [--spares S]
//! [--max-restarts K] [--repair-after SECS] -- COMMAND...`: run a training command under the
//! local supervisor (see `ckpt-recovery`): launch its ranks on simulated nodes, detect a dead
//! or hung rank, stop the job, restart on the surviving nodes from the newest committed
//! checkpoint, resharded; with `--repair-after`, failed nodes come back and the job grows back
//! onto them at the next commit.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use ckpt_recovery::records::{Event, LogRecord, parse_records};
use ckpt_recovery::{Config, JobOptions, SupervisorOptions, Topology};
use serde::Serialize;

use super::shared::parse::duration;
use super::{CliError, Report, Result, Ui};

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

/// Failure detection and restart flags, shared by `ckpt resume` and `ckpt agent`.
#[derive(Debug, Clone, clap::Args)]
pub struct RestartArgs {
    /// Restarts before giving up.
    #[arg(long, default_value_t = 3)]
    pub max_restarts: u32,
    /// A rank with no heartbeat for this long has failed.
    #[arg(long, default_value = "10s", value_parser = duration)]
    pub heartbeat_timeout: Duration,
    /// A rank whose step has not advanced for this long is hung.
    #[arg(long, default_value = "5m", value_parser = duration)]
    pub hang_timeout: Duration,
    /// Time a rank has to send its first heartbeat (start-up and restore).
    #[arg(long, default_value = "5m", value_parser = duration)]
    pub startup_timeout: Duration,
    /// SIGTERM, then SIGKILL after this long.
    #[arg(long, default_value = "10s", value_parser = duration)]
    pub stop_grace: Duration,
    /// First restart delay (doubles with every restart in a row whose generation failed
    /// within 30 s of its start; a generation that ran longer resets it).
    #[arg(long, default_value = "1s", value_parser = duration)]
    pub backoff: Duration,
    /// A node that fails this many times within --node-failure-window is kept out for good,
    /// even when it comes back (named in the recovery log: a node_kept_out record).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_node_failures: u32,
    /// The window of --max-node-failures.
    #[arg(long, default_value = "10m", value_parser = duration)]
    pub node_failure_window: Duration,
    /// The sentinel: how much of their data-parallel replicas the ranks hash at each
    /// checkpoint for the committer to compare with the stored bytes: `full`, `sample=F` (a
    /// rotating fraction F of the chunks) or `off` (passed to the ranks as CKPT_SDC_CHECK;
    /// default: the ranks' own, a sample of 5 %).
    #[arg(long, value_name = "full|sample=F|off", value_parser = parse_sdc)]
    pub sdc_check: Option<ckpt_store::SdcCheck>,
    /// What the job does when a committed step's replicas disagree (silent data corruption):
    /// `warn` (the committing rank logs a replica_mismatch event), `stop` (the job ends), or
    /// `rollback` (the suspect nodes, outside a strict majority, are kept out for good, and
    /// the job restarts from the newest step whose replicas agreed).
    #[arg(long, default_value = "warn", value_parser = parse_policy)]
    pub on_replica_mismatch: ckpt_store::MismatchPolicy,
}

fn parse_sdc(s: &str) -> std::result::Result<ckpt_store::SdcCheck, String> {
    s.parse().map_err(|e: ckpt_store::Error| e.to_string())
}

fn parse_policy(s: &str) -> std::result::Result<ckpt_store::MismatchPolicy, String> {
    s.parse().map_err(|e: ckpt_store::Error| e.to_string())
}

/// A bare number of seconds (`1`, `0.5`) or a duration (`500ms`, `2m`).
fn secs_or_duration(s: &str) -> std::result::Result<Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(v) => Duration::try_from_secs_f64(v)
            .map_err(|_| format!("{s:?} is not a number of seconds of 0 or more")),
        Err(_) => duration(s),
    }
}

impl RestartArgs {
    /// The coordinator's settings for `topology`, starting with `layout` (default: dp over
    /// every rank).
    pub fn config(&self, topology: Topology, layout: Option<&str>) -> Result<Config> {
        let layout = match layout {
            Some(l) => l
                .parse()
                .map_err(|e: ckpt_store::Error| CliError::usage(e.to_string()))?,
            None => {
                let world = topology.nodes * topology.ranks_per_node;
                ckpt_store::Layout::new(world.max(1), 1, 1, 0).map_err(CliError::from)?
            }
        };
        let mut cfg = Config::new(topology, layout);
        cfg.max_restarts = self.max_restarts;
        cfg.heartbeat_timeout = self.heartbeat_timeout;
        cfg.hang_timeout = self.hang_timeout;
        cfg.startup_timeout = self.startup_timeout;
        cfg.stop_grace = self.stop_grace;
        cfg.backoff = self.backoff;
        cfg.max_node_failures = self.max_node_failures;
        cfg.node_failure_window = self.node_failure_window;
        cfg.on_replica_mismatch = self.on_replica_mismatch;
        Ok(cfg)
    }

    /// How often ranks beat: a tenth of the heartbeat timeout, 50 ms to 1 s.
    pub fn heartbeat_interval(&self) -> Duration {
        (self.heartbeat_timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(1))
    }
}

/// What `ckpt resume` prints.
#[derive(Debug, Serialize)]
pub struct ResumeOutput {
    /// The supervisor's report.
    #[serde(flatten)]
    pub report: ckpt_recovery::Report,
}

impl Report for ResumeOutput {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        for r in parse_records::<Event>(&self.report.records) {
            let line = match &r.record {
                Event::Started(r) => format!(
                    "generation {} started: {} on nodes {}{}",
                    r.generation,
                    r.layout,
                    serde_json::to_string(&r.nodes).unwrap_or_default(),
                    r.resume_from
                        .map_or(String::new(), |s| format!(", resuming from step {s}"))
                ),
                Event::Failure(r) => format!(
                    "FAILURE rank {} (node {}): {} [{}; detected after {:.2} s]",
                    r.rank, r.node, r.detail, r.how, r.detection_s
                ),
                Event::Recovery(r) => format!(
                    "decision: restart as {} from step {}, {} steps lost, in {:.1} s",
                    r.layout,
                    r.step
                        .map_or("none (from scratch)".into(), |s| s.to_string()),
                    r.steps_lost,
                    r.backoff_s
                ),
                Event::Resumed(r) => format!(
                    "resumed: step {} done {:.2} s after the failure",
                    r.step, r.since_failure_s
                ),
                Event::Finished(r) => format!("finished: {} ({} restarts)", r.reason, r.restarts),
                Event::NodeReturned(r) => format!(
                    "node {} is back{}",
                    r.node,
                    if r.usable { "" } else { ", but kept out" }
                ),
                Event::NodeKeptOut(r) => format!("KEPT OUT: {}", r.reason),
                Event::Grow(r) => format!(
                    "decision: grow from {} to {} on nodes {} from step {}, {} steps lost ({})",
                    r.from_layout,
                    r.layout,
                    serde_json::to_string(&r.nodes).unwrap_or_default(),
                    r.step
                        .map_or("none (from scratch)".into(), |s| s.to_string()),
                    r.steps_lost,
                    r.reason
                ),
                other => format!(
                    "{}: {}",
                    other.kind(),
                    serde_json::to_string(other).unwrap_or_default()
                ),
            };
            let at = r.record.at_ms().unwrap_or(0) as f64 / 1000.0;
            writeln!(w, "{at:9.2}s  {line}")?;
        }
        for r in &self.report.restores {
            writeln!(
                w,
                "restore of generation {}: {} ranks restored {} of step {} ({} from peer replicas, \
                 {} read from the store), slowest rank {:.2} s",
                r.generation,
                r.ranks,
                super::shared::fmt::bytes(r.bytes),
                r.step,
                super::shared::fmt::bytes(r.bytes_from_peers),
                super::shared::fmt::bytes(r.bytes_from_store),
                r.slowest_s
            )?;
        }
        writeln!(
            w,
            "{}: {}",
            if self.report.ok { "OK" } else { "FAILED" },
            self.report.reason
        )
    }
}

/// Supervise the command (see the module docs).
pub async fn resume(
    url: &str,
    open: &ckpt_store::OpenOptions,
    args: &ResumeArgs,
    _ui: &Ui,
) -> Result<ResumeOutput> {
    let topology = Topology {
        nodes: args.nodes,
        ranks_per_node: args.ranks_per_node.max(1),
        spares: args.spares,
    };
    let cfg = args.restarts.config(topology, args.layout.as_deref())?;
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
    use ckpt_recovery::records::{Failure, Recovery, Started};

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

    #[test]
    fn the_recovery_log_prints_from_its_typed_records() {
        let recs = [
            Event::Started(Started {
                generation: 3,
                layout: "dp=2".into(),
                nodes: vec![0, 1],
                resume_from: Some(4),
                at_ms: 1500,
            }),
            Event::Failure(Failure {
                generation: 3,
                rank: 1,
                node: 1,
                how: "signal".into(),
                detail: "killed".into(),
                detection_s: 0.25,
                at_ms: 2000,
                ..Default::default()
            }),
            Event::Recovery(Recovery {
                layout: "dp=1".into(),
                step: None,
                steps_lost: 2,
                backoff_s: 0.5,
                at_ms: 2500,
                ..Default::default()
            }),
        ];
        let mut records: Vec<serde_json::Value> = recs
            .iter()
            .map(|r| serde_json::to_value(r).unwrap())
            .collect();
        // A record of a kind this version does not know is left out, not an error.
        records.push(serde_json::json!({"kind": "from_the_future", "at_ms": 1}));
        let out = ResumeOutput {
            report: ckpt_recovery::Report {
                ok: true,
                reason: "done".into(),
                restarts: 1,
                records,
                layout: "dp=1".into(),
                restores: Vec::new(),
            },
        };
        let mut buf = Vec::new();
        out.print(&mut buf).unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert_eq!(
            text,
            "     1.50s  generation 3 started: dp=2 on nodes [0,1], resuming from step 4\n     \
             2.00s  FAILURE rank 1 (node 1): killed [signal; detected after 0.25 s]\n     \
             2.50s  decision: restart as dp=1 from step none (from scratch), 2 steps lost, in 0.5 s\n\
             OK: done\n"
        );
    }
}
