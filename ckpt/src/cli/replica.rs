//! `ckpt replica-agent --listen ADDR [--node N] [--buddy ADDR] [--memory-limit SIZE]`: one
//! node's keeper of peer replicas (see `ckpt_recovery::peer`). `ckpt resume --peer-replicas`
//! starts one per node on loopback; across machines, run one per machine, listening on the
//! address of the job's private network, and point the ranks at it with `CKPT_PEER_AGENT`,
//! `CKPT_PEERS` and `CKPT_PEER_SECRET`.
//!
//! It serves only clients that prove the job's secret (`CKPT_PEER_SECRET`, 64 hex digits, in
//! its environment): authentication, not encryption; snapshots cross the network in the
//! clear, so keep the agents on the job's private network. It keeps its own node's ranks'
//! snapshots and copies of the nodes it is the buddy of, within its memory limit, in shared
//! memory: a rank on the same machine maps it read-only through the agent's abstract Unix
//! socket (after the same proof of the secret) instead of taking each chunk over TCP.
//!
//! It prints `listening ADDR` on stdout once it accepts connections, then logs on stderr
//! only; it ends on SIGTERM/SIGINT, or with `--watch-stdin` when its standard input closes
//! (the supervisor that started it is gone). With `--watch-stdin`, each line on standard
//! input `members GEN NODE=ADDR,...` tells it the job's generation and live agents: its buddy
//! is the next live node's agent, and it keeps copies of the previous one's.

use ckpt_recovery::peer::{
    AgentState, MEMORY_LIMIT_ENV, Membership, SECRET_ENV, default_memory_limit, serve,
};
use tracing::{info, warn};

use super::shared::parse::size;
use super::{CliError, Result};

/// Arguments of `ckpt replica-agent`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplicaArgs {
    /// Address to listen on, exactly (`127.0.0.1:0`: a free port on loopback; across machines,
    /// the address of the job's private network, e.g. `10.0.0.5:7300`).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// The node this agent serves: ranks of other nodes cannot hand it their snapshots.
    #[arg(long, default_value_t = 0)]
    pub node: u32,
    /// The agent that keeps copies of this node's snapshots (`host:port`), when no supervisor
    /// tells it (`--watch-stdin`).
    #[arg(long)]
    pub buddy: Option<String>,
    /// Most bytes of snapshots held (arriving ones included); beyond it, snapshots are
    /// refused. Default: a quarter of the machine's memory.
    #[arg(long, env = MEMORY_LIMIT_ENV, value_parser = size)]
    pub memory_limit: Option<u64>,
    /// End when standard input closes (a supervisor that started the agent holds it open, so
    /// the agent goes when the supervisor does), and read `members` lines from it.
    #[arg(long)]
    pub watch_stdin: bool,
}

/// Serve until stdin closes or a signal arrives.
pub async fn replica_agent(args: &ReplicaArgs) -> Result<()> {
    let secret = ckpt_recovery::rank_env::peer_secret_from_env()?.ok_or_else(|| {
        CliError::error(format!(
            "{SECRET_ENV} is not set: the agent serves only clients that prove the job's secret"
        ))
        .hint(format!(
            "`ckpt resume --peer-replicas` sets it; by hand, give every agent and rank the same \
             {SECRET_ENV}, e.g. from `head -c 32 /dev/urandom | xxd -p -c 64`"
        ))
    })?;
    let limit = args.memory_limit.unwrap_or_else(default_memory_limit);
    let l = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| CliError::error(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = l
        .local_addr()
        .map_err(|e| CliError::error(format!("no local address: {e}")))?;
    let _ = super::shared::output::line(format_args!("listening {addr}"));
    info!(node = args.node, %addr, memory_limit = limit, "replica agent listening");
    let state = AgentState::new(args.node, Some(secret), limit);
    if args.buddy.is_some() {
        state.set_membership(Membership {
            buddy: args.buddy.clone(),
            ..Membership::default()
        });
    }
    let watch = args.watch_stdin;
    let node = args.node;
    let st = state.clone();
    let stdin_closed = async move {
        if !watch {
            return std::future::pending().await;
        }
        let _ = tokio::task::spawn_blocking(move || {
            use std::io::BufRead;
            let stdin = std::io::stdin();
            let mut line = String::new();
            while matches!(stdin.lock().read_line(&mut line), Ok(n) if n > 0) {
                if !line.trim().is_empty() {
                    match Membership::parse_line(node, &line) {
                        Ok(m) => st.set_membership(m),
                        Err(e) => warn!("standard input: {e}"),
                    }
                }
                line.clear();
            }
        })
        .await;
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| CliError::error(format!("cannot handle SIGTERM: {e}")))?;
    tokio::select! {
        r = serve(l, state.clone()) => r.map_err(CliError::from)?,
        _ = stdin_closed => info!("standard input closed: stopping"),
        _ = term.recv() => info!("SIGTERM: stopping"),
        _ = tokio::signal::ctrl_c() => info!("SIGINT: stopping"),
    }
    let h = state.holdings();
    info!(
        snapshots = h.snapshots,
        chunks = h.chunks,
        bytes = h.bytes,
        "replica agent stopped"
    );
    Ok(())
}
