//! The `ckpt` subcommands, one library function each, and the dispatcher.
//!
//! Every subcommand is `async fn NAME(store, &Args, ..., &Ui) -> Result<Report>`: it does the
//! work and returns a report that serializes to the `--json` output and prints as text.
//! [`main`] parses nothing: it opens the store, dispatches, prints and maps errors to exit
//! codes ([`EXIT_OK`], [`EXIT_ERROR`], [`EXIT_USAGE`], [`EXIT_DAMAGE`]).
//!
//! This file is only the dispatcher; one file (or folder: `export/`, `plot/`) per subcommand;
//! what they share (errors, parsing, the store's lookups, values, text, progress, stdout) is
//! in [`shared`], which depends on no subcommand.

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[cfg(feature = "etcd")]
pub mod agent;
pub mod diff;
pub mod drain;
pub mod export;
pub mod gc;
pub mod import;
pub mod inspect;
pub mod ls;
pub mod mount;
pub mod plan;
pub mod plot;
pub mod replica;
pub mod resume;
pub mod shared;
pub mod stats;
pub mod verify;

pub use shared::error::{CliError, EXIT_DAMAGE, EXIT_ERROR, EXIT_OK, EXIT_USAGE, Failure, Result};
pub use shared::open_store;
pub use shared::output::{Report, emit, to_text};
pub use shared::parse::{CkptRef, StepSel};
pub use shared::progress::Ui;

/// Look into checkpoint stores: list, inspect, compare, verify, collect garbage, export to and
/// import from safetensors, plan resharding, plot training runs, mount.
#[derive(Debug, Parser)]
#[command(name = "ckpt", version, long_about = None, propagate_version = true)]
#[command(
    after_help = "A checkpoint is named RUN@STEP; RUN alone or RUN@latest means the newest \
committed step.\nExit codes: 0 ok, 1 error, 2 usage, 3 damaged data found."
)]
pub struct Cli {
    /// The store: a directory, file:///dir, s3://bucket/prefix (AWS_* variables), memory://
    #[arg(long, global = true, env = "CKPT_STORE", value_name = "URL")]
    pub store: Option<String>,
    /// Machine-readable JSON on stdout instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// More log output on stderr (-v info, -vv debug, -vvv trace; RUST_LOG overrides).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Never draw progress bars (they are hidden anyway when stderr is not a terminal).
    #[arg(long, global = true)]
    pub no_progress: bool,
    /// Retries of store requests, `attempts=6,min_ms=50,max_ms=5000,timeout_ms=120000` (every
    /// field optional).
    #[arg(long, global = true, hide = true, env = ckpt_store::url::RETRY_ENV, value_name = "SPEC")]
    pub store_retry: Option<String>,
    /// Random failures injected into store requests below the retries, for tests and
    /// measurements: `rate=0.05,seed=7,outage_s=10+5`.
    #[arg(long, global = true, hide = true, env = ckpt_store::url::FAULTS_ENV, value_name = "SPEC")]
    pub store_faults: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List runs, or the steps of a run with their sizes.
    Ls(ls::LsArgs),
    /// Show a step's layout, tensors and blobs; with --tensor, statistics of its values.
    Inspect(inspect::InspectArgs),
    /// Compare two checkpoints: tensors added, removed and changed.
    Diff(diff::DiffArgs),
    /// Per step, how much of the state changed, per tensor group and kind (a stuck layer or
    /// optimizer shows); replicas that disagreed are marked.
    Stats(stats::StatsArgs),
    /// Re-hash everything reachable; exit code 3 and a list of what is damaged.
    Verify(verify::VerifyArgs),
    /// Delete steps retention does not keep, then unreferenced chunks.
    Gc(gc::GcArgs),
    /// Copy to the store what a local tier committed and the store lacks, and commit it there
    /// (what a job left local only).
    Drain(drain::DrainArgs),
    /// Write a step's consolidated tensors as safetensors.
    Export(export::ExportArgs),
    /// Read safetensors files (or an index json) into a new checkpoint.
    Import(import::ImportArgs),
    /// What each rank of another layout would read, without reading it.
    Plan(plan::PlanArgs),
    /// Plot a run's loss with checkpoints, failures, recoveries and rollbacks marked.
    Plot(plot::PlotArgs),
    /// Mount the store read-only: every checkpoint as directories and files.
    Mount(mount::MountArgs),
    /// Run a training command under the supervisor: detect failures, restart resharded.
    Resume(resume::ResumeArgs),
    /// One machine's agent of a job across machines: membership and coordination through
    /// etcd, this machine's ranks started and stopped as the coordinator decides.
    #[cfg(feature = "etcd")]
    Agent(agent::AgentArgs),
    /// One machine's agent of a job across machines (needs a build with the `etcd` feature:
    /// `cargo build --release -p ckpt --features etcd`, which needs `protoc`).
    #[cfg(not(feature = "etcd"))]
    Agent(NoEtcdArgs),
    /// One node's keeper of peer replicas: holds its ranks' newest snapshots in memory, copies
    /// them to another node's agent, serves chunks to restores (started by `resume
    /// --peer-replicas`).
    ReplicaAgent(replica::ReplicaArgs),
}

/// The arguments of `ckpt agent` in a build without the `etcd` feature: anything, since the
/// command only explains how to get a build that has it.
#[cfg(not(feature = "etcd"))]
#[derive(Debug, Clone, clap::Args)]
pub struct NoEtcdArgs {
    /// Ignored.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    pub args: Vec<String>,
}

/// How a command ended when it did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// All good.
    Ok,
    /// It ran, and found damaged data.
    Damage,
}

impl Outcome {
    /// The process exit code.
    pub fn code(self) -> u8 {
        match self {
            Outcome::Ok => EXIT_OK,
            Outcome::Damage => EXIT_DAMAGE,
        }
    }
}

/// Run the parsed command line; returns the process exit code. Errors are printed to stderr.
pub fn main(cli: Cli) -> ExitCode {
    let code = match execute(cli) {
        Ok(o) => o.code(),
        Err(e) => {
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err, "error: {e}");
            e.exit_code()
        }
    };
    ExitCode::from(code)
}

/// Run the parsed command line.
pub fn execute(cli: Cli) -> Result<Outcome> {
    let ui = Ui::new(cli.json, cli.no_progress);
    let open = cli.open_options()?;
    if let Command::Mount(args) = &cli.command {
        // Blocks until unmounted; the FUSE layer runs its own threads.
        let store = open_store(cli.store.as_deref(), &open)?;
        return mount::mount(store, cli.store.as_deref(), args, &ui).map(|()| Outcome::Ok);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::error(format!("cannot start the async runtime: {e}")))?;
    if let Command::ReplicaAgent(a) = &cli.command {
        return rt.block_on(replica::replica_agent(a)).map(|()| Outcome::Ok);
    }
    let mut command = cli.command;
    if let Command::Export(a) = &mut command
        && a.jobs.is_some()
    {
        // `--jobs` starts this binary again, with the same store settings.
        let exe = std::env::current_exe()
            .map_err(|e| CliError::error(format!("finding the ckpt executable: {e}")))?;
        let mut global = Vec::new();
        for (flag, v) in [
            ("--store", &cli.store),
            ("--store-retry", &cli.store_retry),
            ("--store-faults", &cli.store_faults),
        ] {
            if let Some(v) = v {
                global.extend([flag.to_string(), v.clone()]);
            }
        }
        a.spawn = Some(export::jobs::Spawn { exe, global });
    }
    rt.block_on(run(cli.store.as_deref(), &open, command, &ui))
}

impl Cli {
    /// How the store is opened (`--store-retry`/`CKPT_STORE_RETRY`,
    /// `--store-faults`/`CKPT_FAULTS`).
    pub fn open_options(&self) -> Result<ckpt_store::OpenOptions> {
        ckpt_store::OpenOptions::from_values(
            self.store_retry.as_deref(),
            self.store_faults.as_deref(),
        )
        .map_err(CliError::from)
    }
}

/// Run one command against the store at `url`, printing its report to stdout.
pub async fn run(
    url: Option<&str>,
    open: &ckpt_store::OpenOptions,
    command: Command,
    ui: &Ui,
) -> Result<Outcome> {
    let store = open_store(url, open)?;
    let now = ckpt_store::clock::system_now();
    match command {
        Command::Ls(a) => emit(ui, &ls::ls(&store, &a, now, ui).await?),
        Command::Inspect(a) if a.raw => emit(ui, &inspect::raw(&store, &a).await?),
        Command::Inspect(a) => emit(ui, &inspect::inspect(&store, &a, ui).await?),
        Command::Diff(a) => emit(ui, &diff::diff(&store, &a, ui).await?),
        Command::Stats(a) => emit(ui, &stats::stats(&store, &a, ui).await?),
        Command::Verify(a) => {
            let r = verify::verify(&store, &a, ui).await?;
            emit(ui, &r)?;
            return Ok(if r.clean {
                Outcome::Ok
            } else {
                Outcome::Damage
            });
        }
        Command::Gc(a) => emit(ui, &gc::gc(&store, &a, now, ui).await?),
        Command::Drain(a) => emit(ui, &drain::drain(&store, &a, ui).await?),
        Command::Export(a) => emit(ui, &export::export(&store, &a, ui).await?),
        Command::Import(a) => emit(ui, &import::import(&store, &a, ui).await?),
        Command::Plan(a) => emit(ui, &plan::plan(&store, &a, ui).await?),
        Command::Plot(a) => emit(ui, &plot::plot(&store, &a, ui).await?),
        Command::Mount(_) => unreachable!("mount is dispatched before the runtime starts"),
        Command::ReplicaAgent(_) => unreachable!("replica-agent needs no store"),
        Command::Resume(a) => {
            let r = resume::resume(store.url(), open, &a, ui).await?;
            emit(ui, &r)?;
            finished(&a.run, r.report.ok, &r.report.reason)
        }
        #[cfg(feature = "etcd")]
        Command::Agent(a) => {
            let r = agent::agent(store.url(), open, &a, ui).await?;
            emit(ui, &r)?;
            finished(&a.run, r.report.ok, &r.report.reason)
        }
        #[cfg(not(feature = "etcd"))]
        Command::Agent(_) => Err(CliError::usage(
            "this ckpt was built without the etcd feature, which `ckpt agent` needs",
        )
        .hint(
            "build it with `cargo build --release -p ckpt --features etcd` \
             (the etcd client's build needs protoc: apt-get install protobuf-compiler)",
        )),
    }?;
    Ok(Outcome::Ok)
}

/// A supervised job's end: an error when the run did not finish.
fn finished(run: &str, ok: bool, reason: &str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(CliError::error(format!(
            "run {run} did not finish: {reason}"
        )))
    }
}
