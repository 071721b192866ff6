//! `ckpt replica-agent --listen ADDR [--node N]`: one node's keeper of peer replicas (see
//! `ckpt_store::peer`). `ckpt resume --peer-replicas` starts one per node; across machines,
//! run one per machine and point the ranks at it with `CKPT_PEER_AGENT`, `CKPT_PEER_BUDDY`
//! and `CKPT_PEERS`.
//!
//! It prints `listening ADDR` on stdout once it accepts connections, then logs on stderr
//! only; it ends on SIGTERM/SIGINT, or with `--watch-stdin` when its standard input closes
//! (the supervisor that started it is gone).

use ckpt_store::peer::{AgentState, serve};
use tracing::info;

use super::{CliError, Result};

/// Arguments of `ckpt replica-agent`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplicaArgs {
    /// Address to listen on (`127.0.0.1:0` picks a free port on loopback).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// The node this agent serves (for its logs).
    #[arg(long, default_value_t = 0)]
    pub node: u32,
    /// End when standard input closes (a supervisor that started the agent holds it open, so
    /// the agent goes when the supervisor does).
    #[arg(long)]
    pub watch_stdin: bool,
}

/// Serve until stdin closes or a signal arrives.
pub async fn replica_agent(args: &ReplicaArgs) -> Result<()> {
    let l = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| CliError::error(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = l
        .local_addr()
        .map_err(|e| CliError::error(format!("no local address: {e}")))?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening {addr}");
        let _ = out.flush();
    }
    info!(node = args.node, %addr, "replica agent listening");
    let state = AgentState::new();
    let watch = args.watch_stdin;
    let stdin_closed = async move {
        if !watch {
            return std::future::pending().await;
        }
        let _ = tokio::task::spawn_blocking(|| {
            use std::io::Read;
            let mut buf = [0u8; 256];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
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
