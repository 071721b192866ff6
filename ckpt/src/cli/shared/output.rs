//! Everything the CLI writes on stdout goes through here: a command's report ([`emit`]) and
//! the lines a command prints for a parent process ([`line`]). A reader that closed the pipe
//! (`ckpt inspect r --raw | head -c 10`) is not an error, as for any Unix tool: the command
//! ends quietly with exit 0.

use std::io::{ErrorKind, Write};

use serde::Serialize;

use super::error::{CliError, Result};
use super::progress::Ui;

/// A report every command returns: JSON for `--json`, text otherwise.
pub trait Report: Serialize {
    /// Print the text form.
    fn print(&self, w: &mut dyn Write) -> std::io::Result<()>;
}

/// Print `r` as JSON or text on stdout.
pub fn emit<R: Report>(ui: &Ui, r: &R) -> Result<()> {
    write_stdout(|out| {
        if ui.json {
            let s = serde_json::to_string_pretty(r).map_err(std::io::Error::other)?;
            writeln!(out, "{s}")
        } else {
            r.print(out)
        }
    })
}

/// Print one line on stdout at once (`progress N` for `export --jobs`' parent, `listening
/// ADDR`, where a mount went).
pub fn line(text: std::fmt::Arguments<'_>) -> Result<()> {
    write_stdout(|out| writeln!(out, "{text}"))
}

/// Text of a report (tests and callers that want a string).
pub fn to_text<R: Report>(r: &R) -> String {
    let mut v = Vec::new();
    r.print(&mut v).expect("writing to a Vec cannot fail");
    String::from_utf8_lossy(&v).into_owned()
}

/// Run `write` on the locked stdout and flush it; a closed pipe is success.
fn write_stdout(write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match write(&mut out).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(CliError::error(format!("writing the output: {e}"))),
    }
}
