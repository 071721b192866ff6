//! What the two supervising commands (`ckpt resume` on one machine, `ckpt agent` across
//! machines) share: the failure detection and restart flags, and the report they print.

use std::io::Write;
use std::time::Duration;

use ckpt_recovery::records::{Event, LogRecord, parse_records};
use ckpt_recovery::{Config, Topology};
use serde::Serialize;

use super::error::{CliError, Result};
use super::output::Report;
use super::parse::duration;

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

impl RestartArgs {
    /// The coordinator's settings for `nodes` of `ranks_per_node` ranks and `spares`, starting
    /// with `layout` (default: dp over
    /// every rank).
    pub fn config(
        &self,
        nodes: u32,
        ranks_per_node: u32,
        spares: u32,
        layout: Option<&str>,
    ) -> Result<Config> {
        let topology = Topology {
            nodes,
            ranks_per_node: ranks_per_node.max(1),
            spares,
        };
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
                    "resumed: step {} done {:.2} s after the failure{}",
                    r.step,
                    r.since_failure_s,
                    r.restored_s.map_or(String::new(), |s| format!(
                        " (every rank restored by {s:.2} s)"
                    ))
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
                 {} read from the local tier, {} from the store), slowest rank {:.2} s",
                r.generation,
                r.ranks,
                super::fmt::bytes(r.bytes),
                r.step,
                super::fmt::bytes(r.bytes_from_peers),
                super::fmt::bytes(r.bytes_from_local),
                super::fmt::bytes(r.bytes_from_store),
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

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_recovery::records::{Failure, Recovery, Started};

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
