//! The `ckpt` binary: parse the command line, install the tracing subscriber, run.

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = ckpt::cli::Cli::parse();
    if let Err(e) = init_tracing(cli.verbose) {
        eprintln!("warning: no log output: {e:#}");
    }
    ckpt::cli::main(cli)
}

/// Logs to stderr: `-v` info, `-vv` debug, `-vvv` trace; `RUST_LOG` overrides; warnings only
/// otherwise.
#[allow(
    clippy::disallowed_methods,
    reason = "a binary reads RUST_LOG at start-up"
)]
fn init_tracing(verbose: u8) -> anyhow::Result<()> {
    let level = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = match std::env::var("RUST_LOG") {
        Ok(f) if !f.is_empty() => EnvFilter::try_new(f)?,
        _ => EnvFilter::try_new(level)?,
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(verbose >= 2)
        .try_init()
        .map_err(|e| anyhow::anyhow!(e))
}
