//! What the subcommands share, apart from any one of them:
//!
//! - `error.rs`: [`CliError`](error::CliError), what went wrong and what to do, mapped to the
//!   exit codes;
//! - `parse.rs`: what people type (`RUN@STEP`, sizes, durations, name patterns), parsed
//!   without I/O;
//! - `store.rs`: opening the store, resolving a checkpoint name against it with errors that
//!   say what exists instead, reading a step's rank manifests;
//! - `values.rs`: element values (decoding every dtype, converting between float dtypes,
//!   statistics);
//! - `fmt.rs`: sizes, times, names and tables as text;
//! - `progress.rs`: [`Ui`](progress::Ui), progress bars on stderr;
//! - `output.rs`: [`Report`](output::Report), the one way to stdout (a closed pipe ends a
//!   command quietly);
//! - `supervision.rs`: the restart flags and the report of `ckpt resume` and `ckpt agent`.

pub mod error;
pub mod fmt;
pub mod output;
pub mod parse;
pub mod progress;
pub mod store;
pub mod supervision;
pub mod values;

pub use store::{all_manifests, no_such_run, open_store, readable_manifests, resolve};
