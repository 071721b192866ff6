//! Everything the CLI writes on stdout goes through here: a command's report ([`emit`]) and
//! the lines a command prints for a parent process ([`line()`]). A reader that closed the pipe
//! (`ckpt inspect r --raw | head -c 10`) is not an error, as for any Unix tool: the command
//! ends quietly with exit 0, whatever layer of the output the closed pipe surfaced in
//! ([`closed_pipe`]).

use std::error::Error as StdError;
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
        Err(e) if closed_pipe(&e) => Ok(()),
        Err(e) => Err(CliError::error(format!("writing the output: {e}"))),
    }
}

/// Whether `e` is, or wraps at any depth, a write to a pipe whose reader is gone: an
/// [`std::io::Error`] of kind `BrokenPipe`, inside another I/O error (`io::Error::other`) or a
/// serde_json error (a report serialized straight into the pipe), or anywhere in the chain of
/// sources.
pub fn closed_pipe(e: &(dyn StdError + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(err) = at {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.kind() == ErrorKind::BrokenPipe {
                return true;
            }
            // `io::Error::source` skips the error it wraps: look at that one too.
            if let Some(inner) = io.get_ref()
                && closed_pipe(inner)
            {
                return true;
            }
        }
        if let Some(j) = err.downcast_ref::<serde_json::Error>()
            && j.io_error_kind() == Some(ErrorKind::BrokenPipe)
        {
            return true;
        }
        at = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pipe whose reader is gone.
    struct Closed;

    impl Write for Closed {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The error of serializing straight into a closed pipe.
    fn json_into_pipe() -> serde_json::Error {
        serde_json::to_writer(Closed, &[1, 2, 3]).unwrap_err()
    }

    #[test]
    fn a_closed_pipe_is_found_at_any_depth() {
        let pipe = || std::io::Error::from(ErrorKind::BrokenPipe);
        assert!(closed_pipe(&pipe()));
        assert!(closed_pipe(&std::io::Error::other(pipe())));
        assert!(closed_pipe(&json_into_pipe()));
        assert!(closed_pipe(&std::io::Error::other(json_into_pipe())));
        assert!(closed_pipe(&std::io::Error::other(std::io::Error::other(
            json_into_pipe()
        ))));
        assert!(!closed_pipe(&std::io::Error::from(ErrorKind::WriteZero)));
        let other = serde_json::from_str::<u32>("x").unwrap_err();
        assert!(!closed_pipe(&std::io::Error::other(other)));
    }
}
