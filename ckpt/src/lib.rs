//! `ckpt`: the command-line tool over checkpoint stores, and a facade that re-exports the
//! public API of the crates below it so that users depend on one crate.
//!
//! - [`store`] is `ckpt-store`: the content-addressed store, the commit protocol, the read
//!   engine, verify and GC;
//! - [`fuse`] is `ckpt-fuse`: checkpoints as directories and files;
//! - [`trainer`] is `ckpt-trainer`: the save pipeline, restore and `CheckpointManager`;
//! - [`recovery`] is `ckpt-recovery`: the recovery coordinator and the supervisor;
//! - [`cli`] holds one library function per `ckpt` subcommand; the `ckpt` binary only parses
//!   arguments, installs the tracing subscriber and calls [`cli::main`].
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use ckpt::cli::{self, Ui};
//!
//! let store = ckpt::store::open("memory://")?;
//! let listing = cli::ls::ls(&store, &cli::ls::LsArgs::default(), ckpt_store::clock::system_now(), &Ui::quiet()).await?;
//! assert!(matches!(listing, cli::ls::LsReport::Runs(r) if r.runs.is_empty()));
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub use ckpt_fuse as fuse;
pub use ckpt_recovery as recovery;
pub use ckpt_store as store;
pub use ckpt_trainer as trainer;

pub use ckpt_store::{
    CommitRecord, DType, Error, ErrorKind, GcOptions, GcReport, Layout, NdBox, Result,
    SafetensorsView, StepReader, Store, StoreConfig, VerifyReport, VerifyScope, open,
};

pub mod cli;
