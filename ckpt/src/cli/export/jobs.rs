//! `ckpt export --jobs N`: the parts of a split export as N child `ckpt export --part I/N`
//! processes on this machine, exactly as separate machines would run them, with one progress
//! bar (each child prints `progress BYTES` lines, then its JSON report). The first part that
//! fails stops the others (they are killed; what they finished stays, complete, for a rerun)
//! and its error is this command's.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;

use indicatif::ProgressBar;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::Command;
use tokio::task::JoinSet;

use super::plan::ExportPlan;
use crate::cli::{CliError, Result};

/// How to start a part: the `ckpt` executable and the global flags it needs.
#[derive(Debug, Clone, Default)]
pub struct Spawn {
    /// The `ckpt` binary.
    pub exe: PathBuf,
    /// Global arguments before the subcommand (`--store URL`, retry and fault settings).
    pub global: Vec<String>,
}

/// Run the parts of `plan` that have files as child processes, part `I` of `N` with the
/// arguments `part_args(I, N)` after the global ones (`what` is `RUN@STEP`, for messages);
/// returns their JSON reports in part order.
pub async fn run_parts(
    spawn: &Spawn,
    what: &str,
    plan: &ExportPlan,
    part_args: impl Fn(usize, usize) -> Vec<OsString>,
    pb: &ProgressBar,
) -> Result<Vec<serde_json::Value>> {
    let n = plan.parts;
    let mut set = JoinSet::new();
    for part in 0..n {
        if plan.files_of(part).next().is_none() {
            continue; // more parts than files
        }
        let mut c = Command::new(&spawn.exe);
        c.args(&spawn.global).args(part_args(part, n));
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let child = c.spawn().map_err(|e| {
            CliError::error(format!(
                "starting part {part}/{n} ({}): {e}",
                spawn.exe.display()
            ))
        })?;
        tracing::info!(part, pid = child.id(), "export part started");
        let pb = pb.clone();
        set.spawn(async move { (part, watch(child, pb).await) });
    }
    let mut reports = vec![serde_json::Value::Null; n];
    // The first failure returns, dropping the set: the other children are killed.
    while let Some(joined) = set.join_next().await {
        let (part, res) = joined.map_err(|e| CliError::error(format!("an export part: {e}")))?;
        match res {
            Ok(r) => reports[part] = r,
            Err(why) => {
                return Err(CliError::error(format!(
                    "part {part}/{n} of the export failed: {why}"
                ))
                .hint(format!(
                    "files the parts finished are kept; run the command again (or only \
                         `ckpt export {what} --part {part}/{n} ...`) to complete the export"
                )));
            }
        }
    }
    Ok(reports.into_iter().filter(|r| !r.is_null()).collect())
}

/// Follow one child: its progress into the bar, its report, its error.
async fn watch(
    mut child: tokio::process::Child,
    pb: ProgressBar,
) -> Result<serde_json::Value, String> {
    let stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let errors = tokio::spawn(async move {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s).await;
        s
    });
    let mut lines = BufReader::new(stdout).lines();
    let mut json = String::new();
    while let Ok(Some(l)) = lines.next_line().await {
        match l.strip_prefix("progress ") {
            Some(n) => pb.inc(n.trim().parse().unwrap_or(0)),
            None => {
                json.push_str(&l);
                json.push('\n');
            }
        }
    }
    let status = child.wait().await.map_err(|e| e.to_string())?;
    let err = errors.await.unwrap_or_default();
    if !status.success() {
        let said = err
            .lines()
            .filter(|l| !l.trim().is_empty())
            .collect::<Vec<_>>()
            .join(" / ");
        return Err(format!(
            "{status}{}",
            if said.is_empty() {
                String::new()
            } else {
                format!(": {said}")
            }
        ));
    }
    serde_json::from_str(&json).map_err(|e| format!("its report is not JSON ({e}): {json}"))
}
