//! The CLI's error: what went wrong (naming the run, step, tensor or object), what to do about
//! it, and which exit code it gets.

use std::fmt;

use ckpt_store::ErrorKind;

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

/// Which exit code an error gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Exit 1: the command could not do its work.
    Error,
    /// Exit 2: the command line asks for something impossible.
    Usage,
    /// Exit 3: stored data is damaged.
    Damage,
}

/// An error of a `ckpt` subcommand.
#[derive(Debug)]
pub struct CliError {
    failure: Failure,
    kind: Option<ErrorKind>,
    msg: String,
    hint: Option<String>,
}

impl CliError {
    /// Exit 1.
    pub fn error(msg: impl Into<String>) -> Self {
        CliError {
            failure: Failure::Error,
            kind: None,
            msg: msg.into(),
            hint: None,
        }
    }

    /// Exit 2.
    pub fn usage(msg: impl Into<String>) -> Self {
        CliError {
            failure: Failure::Usage,
            ..Self::error(msg)
        }
    }

    /// Exit 3.
    pub fn damage(msg: impl Into<String>) -> Self {
        CliError {
            failure: Failure::Damage,
            ..Self::error(msg)
        }
    }

    /// Replace the advice printed after the message.
    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// Prefix the message with what was being done.
    pub fn context(mut self, ctx: impl fmt::Display) -> Self {
        self.msg = format!("{ctx}: {}", self.msg);
        self
    }

    /// Which exit code.
    pub fn failure(&self) -> Failure {
        self.failure
    }

    /// The store's error kind, when the error came from the store.
    pub fn store_kind(&self) -> Option<ErrorKind> {
        self.kind
    }

    /// The message, without advice.
    pub fn message(&self) -> &str {
        &self.msg
    }

    /// The process exit code.
    pub fn exit_code(&self) -> u8 {
        match self.failure {
            Failure::Error => EXIT_ERROR,
            Failure::Usage => EXIT_USAGE,
            Failure::Damage => EXIT_DAMAGE,
        }
    }
}

impl From<ckpt_store::Error> for CliError {
    fn from(e: ckpt_store::Error) -> Self {
        let kind = e.kind();
        let (failure, hint) = match kind {
            ErrorKind::NotFound => (
                Failure::Error,
                Some("`ckpt ls` lists runs, `ckpt ls RUN` the steps of one"),
            ),
            ErrorKind::InvalidInput => (Failure::Usage, None),
            ErrorKind::Corrupt => (
                Failure::Damage,
                Some(
                    "`ckpt verify RUN` lists everything damaged; older steps that verify clean \
                     can still be restored or exported",
                ),
            ),
            ErrorKind::Incomplete => (
                Failure::Error,
                Some(
                    "the step is not complete: wait for the save to finish, or pick a committed step (`ckpt ls RUN`)",
                ),
            ),
            ErrorKind::Conflict => (Failure::Error, None),
            ErrorKind::Fenced => (
                Failure::Error,
                Some("a newer generation of the job owns this run"),
            ),
            ErrorKind::Backend => (
                Failure::Error,
                Some(
                    "check the store URL, the network and the credentials (AWS_* variables for \
                     s3://); retrying may help",
                ),
            ),
            ErrorKind::Io => (Failure::Error, None),
            // The message says which file system is full and what to do.
            ErrorKind::NoSpace => (Failure::Error, None),
            ErrorKind::NoDevice => (
                Failure::Error,
                Some(
                    "device tensors need an NVIDIA GPU with its driver (and NCCL for transfers between GPUs)",
                ),
            ),
            ErrorKind::Device => (
                Failure::Error,
                Some(
                    "a GPU or a collective failed: check the device (nvidia-smi) and the other ranks",
                ),
            ),
            _ => (
                Failure::Error,
                Some(
                    "this is a bug in ckpt; please report it with the command line and -vv output",
                ),
            ),
        };
        let mut msg = e.to_string();
        if let Some(src) = std::error::Error::source(&e) {
            let s = src.to_string();
            if !msg.contains(&s) && kind == ErrorKind::Backend {
                msg = format!("{msg} ({s})");
            }
        }
        CliError {
            failure,
            kind: Some(kind),
            msg,
            hint: hint.map(String::from),
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)?;
        if let Some(h) = &self.hint {
            write!(f, "\n  hint: {h}")?;
        }
        Ok(())
    }
}

impl std::error::Error for CliError {}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError::error(e.to_string())
    }
}
