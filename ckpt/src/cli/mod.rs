//! The `ckpt` subcommands, one library function each.
//!
//! Every subcommand is `async fn NAME(store, &Args, ..., &Ui) -> Result<Report>`: it does the
//! work and returns a report that serializes to the `--json` output and prints as text.
//! [`main`] parses nothing: it opens the store, dispatches, prints and maps errors to exit
//! codes ([`EXIT_OK`], [`EXIT_ERROR`], [`EXIT_USAGE`], [`EXIT_DAMAGE`]).

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use serde::Serialize;

#[cfg(feature = "etcd")]
pub mod agent;
pub mod diff;
pub mod error;
pub mod export;
pub mod export_jobs;
pub mod export_plan;
pub mod fmt;
pub mod gc;
pub mod import;
pub mod inspect;
pub mod ls;
pub mod mount;
pub mod parse;
pub mod plan;
pub mod plot;
pub mod progress;
pub mod render;
pub mod replica;
pub mod resume;
pub mod stats;
pub mod verify;

pub use error::{CliError, Failure};
pub use parse::{CkptRef, StepSel};
pub use progress::Ui;

/// Exit code: success.
pub const EXIT_OK: u8 = 0;
/// Exit code: an error (store unreachable, not found, bad input file, ...).
pub const EXIT_ERROR: u8 = 1;
/// Exit code: bad usage (unknown flag, malformed `RUN@STEP`, impossible layout, ...).
pub const EXIT_USAGE: u8 = 2;
/// Exit code: damaged data found (`verify`, or a read that hit a bad chunk).
pub const EXIT_DAMAGE: u8 = 3;

/// `Result` of the CLI functions.
pub type Result<T, E = CliError> = std::result::Result<T, E>;

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
    /// Re-hash everything reachable; exit code 3 and a list of what is damaged.
    Verify(verify::VerifyArgs),
    /// Delete steps retention does not keep, then unreferenced chunks.
    Gc(gc::GcArgs),
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
        a.spawn = Some(export_jobs::Spawn { exe, global });
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

/// The rank manifests of committed `step` of `run` that read (none when its commit record
/// does not): for figures that are best effort (a progress bar's length, a dedup index).
pub(crate) async fn readable_manifests(
    store: &ckpt_store::Store,
    run: &str,
    step: u64,
) -> Vec<ckpt_store::RankManifest> {
    let Ok((c, _)) = store.read_commit(run, step).await else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in &c.ranks {
        if let Ok(m) = store.read_rank_manifest(run, step, e.rank, Some(e)).await {
            out.push(m);
        }
    }
    out
}

/// Open the store named by `--store` / `CKPT_STORE`.
pub fn open_store(url: Option<&str>, open: &ckpt_store::OpenOptions) -> Result<ckpt_store::Store> {
    let url = url.filter(|u| !u.trim().is_empty()).ok_or_else(|| {
        CliError::usage(
            "no store given: pass --store URL or set CKPT_STORE \
             (a directory, file:///dir, s3://bucket/prefix or memory://)",
        )
    })?;
    ckpt_store::open_with(url, open).map_err(CliError::from)
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
        Command::Verify(a) => {
            let r = verify::verify(&store, &a, ui).await?;
            emit(ui, &r)?;
            return Ok(if r.report.is_clean() {
                Outcome::Ok
            } else {
                Outcome::Damage
            });
        }
        Command::Gc(a) => emit(ui, &gc::gc(&store, &a, now, ui).await?),
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

/// A report every command returns: JSON for `--json`, text otherwise.
pub trait Report: Serialize {
    /// Print the text form.
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()>;
}

/// Print `r` as JSON or text on stdout.
pub fn emit<R: Report>(ui: &Ui, r: &R) -> Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let res = if ui.json {
        // Serialized first, so that a closed pipe is an I/O error of its own kind below
        // rather than a serde error wrapping it.
        serde_json::to_string_pretty(r)
            .map_err(std::io::Error::other)
            .and_then(|s| writeln!(out, "{s}"))
    } else {
        r.print(&mut out)
    }
    .and_then(|()| out.flush());
    match res {
        Ok(()) => Ok(()),
        // `ckpt ls --json | head` closes the pipe: not an error, as for any Unix tool.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(CliError::error(format!("writing the output: {e}"))),
    }
}

/// Text of a report (tests and callers that want a string).
pub fn to_text<R: Report>(r: &R) -> String {
    let mut v = Vec::new();
    r.print(&mut v).expect("writing to a Vec cannot fail");
    String::from_utf8_lossy(&v).into_owned()
}
