//! `ckpt agent --etcd URL --run RUN --node N --nodes TOTAL --ranks-per-node R [--spares S]
//! [--layout L] [--max-restarts K] -- COMMAND...`: one node of a job across machines (see
//! `ckpt_recovery::agent`): registers the node in etcd, campaigns to coordinate, starts and
//! stops this machine's ranks as the coordinator's plans say, and relays their heartbeats and
//! exits. Run one per machine, each with its own `--node`.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use ckpt_recovery::JobOptions;
use ckpt_recovery::agent::{AgentOptions, AgentReport};
use ckpt_recovery::records::{Event as LogEvent, parse_records};
use ckpt_store::ErrorKind;
use serde::Serialize;

use super::shared::parse::duration;
use super::shared::supervision::{RestartArgs, ResumeOutput};
use super::{CliError, Report, Result, Ui};

/// Arguments of `ckpt agent`.
#[derive(Debug, Clone, clap::Args)]
pub struct AgentArgs {
    /// etcd endpoints, comma-separated (e.g. http://10.0.0.5:2379).
    #[arg(long, env = "CKPT_ETCD", value_name = "URL")]
    pub etcd: String,
    /// Key prefix of the job in etcd (default /ckpt/RUN).
    #[arg(long)]
    pub prefix: Option<String>,
    /// Run name (passed to the ranks as CKPT_RUN).
    #[arg(long)]
    pub run: String,
    /// This machine's node id, 0..nodes+spares (unique per agent).
    #[arg(long)]
    pub node: u32,
    /// Nodes that run ranks at the start.
    #[arg(long)]
    pub nodes: u32,
    /// Ranks per node.
    #[arg(long, default_value_t = 1)]
    pub ranks_per_node: u32,
    /// Spare nodes (ids after the first --nodes), used first to replace failed ones.
    #[arg(long, default_value_t = 0)]
    pub spares: u32,
    /// Layout to start with (default: dp = nodes x ranks per node).
    #[arg(long)]
    pub layout: Option<String>,
    /// The agent's etcd lease: a node silent this long is dead (whole seconds).
    #[arg(long, default_value = "3s", value_parser = duration)]
    pub lease_ttl: Duration,
    /// How long the coordinator waits for the first --nodes nodes to join.
    #[arg(long, default_value = "60s", value_parser = duration)]
    pub join_timeout: Duration,
    /// With --local-tier and several nodes: when a generation stops, each node drains its
    /// ranks of the newest step it committed locally, and the coordinator waits at most this
    /// long for them before it chooses the step to resume from (0s: resume from the store's
    /// newest at once, losing what only the tiers held).
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub drain_wait: Duration,
    /// Failure detection and restarts.
    #[command(flatten)]
    pub restarts: RestartArgs,
    /// Address other machines reach this one at (MASTER_ADDR when it runs rank 0; default:
    /// the host name).
    #[arg(long)]
    pub addr: Option<String>,
    /// Keep peer replicas: this agent holds its node's newest snapshots in memory (with a copy
    /// on the next node's agent), and restores read lost shards from the agents first. The
    /// replica agent listens on --addr exactly (loopback without it: pass --addr, an address
    /// of the job's private network, to serve other machines) and serves only clients that
    /// prove the job's secret: CKPT_PEER_SECRET (64 hex digits) of the agents' environment, or
    /// else one the first coordinator makes and hands to the agents through etcd. This is
    /// authentication, not encryption (no TLS): keep the agents on a private network.
    /// --peer-memory-limit bounds what it holds.
    #[arg(long)]
    pub peer_replicas: bool,
    /// With --peer-replicas: the most bytes of snapshots the replica agent holds (arriving
    /// ones included). Default: a quarter of the machine's memory.
    #[arg(long, env = ckpt_recovery::peer::MEMORY_LIMIT_ENV, value_parser = super::shared::parse::size)]
    pub peer_memory_limit: Option<u64>,
    /// Write this node's rank stdout and stderr into this directory.
    #[arg(long)]
    pub logs: Option<PathBuf>,
    /// A local tier (a directory on this machine's disk): saves commit there and drain to the
    /// store behind the training. With one node it holds every rank's commits; with several,
    /// each node's tier holds its own ranks (committed there together: local-durable), each
    /// node drains its ranks, and the drain that lands the last ones commits the step on the
    /// store. Restores then read the store's newest step, each chunk from this tier where it
    /// has it; when a rank fails, the nodes drain what they committed before the coordinator
    /// chooses that step (--drain-wait).
    #[arg(long, env = ckpt_recovery::rank_env::LOCAL_TIER, value_name = "DIR")]
    pub local_tier: Option<String>,
    /// The command each rank runs, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// What `ckpt agent` prints.
#[derive(Debug, Serialize)]
pub struct AgentOutput {
    /// The agent's report.
    #[serde(flatten)]
    pub report: AgentReport,
}

impl Report for AgentOutput {
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()> {
        let r = &self.report;
        for g in &r.generations {
            writeln!(
                w,
                "node {}: generation {} as {} (coordinator node {}), ranks here {:?}",
                r.node, g.generation, g.layout, g.leader, g.ranks
            )?;
        }
        if r.records.is_empty() {
            return writeln!(
                w,
                "{}: {} ({} restarts, final layout {})",
                if r.ok { "OK" } else { "FAILED" },
                r.reason,
                r.restarts,
                r.layout
            );
        }
        writeln!(w, "as the coordinator:")?;
        let (takeovers, records): (Vec<_>, Vec<_>) = r.records.iter().cloned().partition(|v| {
            parse_records::<LogEvent>(std::slice::from_ref(v))
                .first()
                .is_some_and(|e| matches!(e.record, LogEvent::Takeover(_)))
        });
        for t in parse_records::<LogEvent>(&takeovers) {
            let LogEvent::Takeover(t) = t.record else {
                continue;
            };
            writeln!(
                w,
                "{:9.2}s  took over at generation {} from node {} (nodes lost: {})",
                t.at_ms as f64 / 1000.0,
                t.generation,
                t.previous.map_or("null".into(), |p| p.to_string()),
                serde_json::to_string(&t.lost_nodes).unwrap_or_default()
            )?;
        }
        ResumeOutput {
            report: ckpt_recovery::Report {
                ok: r.ok,
                reason: r.reason.clone(),
                restarts: r.restarts,
                records,
                layout: r.layout.clone(),
                restores: Vec::new(),
            },
        }
        .print(w)
    }
}

/// Run this node's agent (see the module docs).
pub async fn agent(
    url: &str,
    open: &ckpt_store::OpenOptions,
    args: &AgentArgs,
    _ui: &Ui,
) -> Result<AgentOutput> {
    let cfg = args.restarts.config(
        args.nodes,
        args.ranks_per_node,
        args.spares,
        args.layout.as_deref(),
    )?;
    let opts = AgentOptions {
        etcd: args.etcd.clone(),
        prefix: args.prefix.clone(),
        node: args.node,
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
        lease_ttl: args.lease_ttl,
        join_timeout: args.join_timeout,
        drain_wait: args.drain_wait,
        addr: args.addr.clone(),
        peer_replicas: args.peer_replicas,
        // The secret is read here, at the binary's edge (never from a command line, where
        // other users of the machine would see it).
        peer_secret: ckpt_recovery::rank_env::peer_secret_from_env()?,
        peer_memory_limit: args.peer_memory_limit,
    };
    let report = ckpt_recovery::agent::run(opts)
        .await
        .map_err(|e| match e.kind() {
            ErrorKind::Backend if e.message().starts_with("etcd at") => {
                CliError::error(e.to_string())
                    .hint("check that etcd runs at the --etcd URL and that this machine reaches it")
            }
            ErrorKind::Fenced => CliError::error(e.to_string()).hint(
                "this node has left the job and the coordinator carries on without it; \
                 an agent restarted with the same --node joins as a fresh node",
            ),
            _ => CliError::from(e),
        })?;
    Ok(AgentOutput { report })
}
