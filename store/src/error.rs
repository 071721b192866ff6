//! The store's error: a small kind that tells the caller what to do, and a message that names
//! the object, step or tensor it is about.

use std::fmt;

/// What the caller should do about an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The thing asked for does not exist (run, step, tensor, object).
    NotFound,
    /// The input or request is wrong; fix it (bad URL, impossible layout, unknown dtype).
    InvalidInput,
    /// Stored data is damaged: a hash mismatch, a truncated or garbage object.
    Corrupt,
    /// Someone else got there first (an object already exists with other content).
    Conflict,
    /// A writer from an older generation was fenced out by a newer one.
    Fenced,
    /// The step is not complete (a rank manifest is missing, coverage has holes or overlaps).
    Incomplete,
    /// The backend failed, possibly transiently; retrying may help.
    Backend,
    /// Local I/O failed (permissions, a read-only file system).
    Io,
    /// The store's file system (or a local output directory's) is full (`ENOSPC`): free
    /// space, run `ckpt gc`, or point the store elsewhere. Retrying at once does not help.
    NoSpace,
    /// A bug: an invariant of ckpt itself did not hold.
    Internal,
    /// No usable accelerator here: no CUDA driver, no such device, no NCCL library.
    NoDevice,
    /// A CUDA or NCCL call failed on a device that is there (a device error, a failed
    /// collective): the device or its peers are in trouble, not the store.
    Device,
}

impl ErrorKind {
    /// A short lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not found",
            ErrorKind::InvalidInput => "invalid input",
            ErrorKind::Corrupt => "damaged data",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Fenced => "fenced",
            ErrorKind::Incomplete => "incomplete",
            ErrorKind::Backend => "storage backend",
            ErrorKind::Io => "i/o",
            ErrorKind::NoSpace => "no space",
            ErrorKind::Internal => "internal",
            ErrorKind::NoDevice => "no device",
            ErrorKind::Device => "device",
        }
    }
}

/// The error of every fallible store operation.
pub struct Error {
    kind: ErrorKind,
    msg: String,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

/// `Result` with the store's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind`.
    pub fn new(kind: ErrorKind, msg: impl Into<String>) -> Self {
        Error {
            kind,
            msg: msg.into(),
            source: None,
        }
    }
    /// [`ErrorKind::InvalidInput`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, msg)
    }
    /// [`ErrorKind::Corrupt`].
    pub fn corrupt(msg: impl Into<String>) -> Self {
        Self::new(ErrorKind::Corrupt, msg)
    }
    /// [`ErrorKind::NotFound`].
    pub fn not_found(msg: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, msg)
    }
    /// [`ErrorKind::Internal`].
    pub fn internal(msg: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, msg)
    }
    /// [`ErrorKind::Incomplete`].
    pub fn incomplete(msg: impl Into<String>) -> Self {
        Self::new(ErrorKind::Incomplete, msg)
    }

    /// Attach an underlying cause.
    pub fn with_source(mut self, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(e));
        self
    }

    /// Prefix the message with what was being done (`"reading step 7 of run a: ..."`).
    pub fn context(mut self, ctx: impl fmt::Display) -> Self {
        self.msg = format!("{ctx}: {}", self.msg);
        self
    }

    /// What the caller should do.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message without the cause chain.
    pub fn message(&self) -> &str {
        &self.msg
    }

    /// An error from the object store about `path` during `op`.
    /// A full local file system is [`ErrorKind::NoSpace`]; [`crate::Store`] adds where it is.
    pub fn backend(op: &str, path: &impl fmt::Display, e: object_store::Error) -> Self {
        use object_store::Error as E;
        let kind = match &e {
            E::NotFound { .. } => ErrorKind::NotFound,
            E::AlreadyExists { .. } | E::Precondition { .. } => ErrorKind::Conflict,
            E::InvalidPath { .. } | E::NotSupported { .. } | E::NotImplemented { .. } => {
                ErrorKind::InvalidInput
            }
            _ if is_no_space(&e) => ErrorKind::NoSpace,
            _ => ErrorKind::Backend,
        };
        let what = match kind {
            ErrorKind::NotFound => "object not found".to_string(),
            ErrorKind::Conflict => "object already exists".to_string(),
            ErrorKind::NoSpace => "no space left on the store's file system".to_string(),
            _ => short_backend_message(&e),
        };
        Error::new(kind, format!("{op} {path}: {what}")).with_source(e)
    }

    /// Say where the full file system of a [`ErrorKind::NoSpace`] error is (other errors are
    /// returned as they are).
    pub fn no_space_at(mut self, location: impl fmt::Display) -> Self {
        if self.kind == ErrorKind::NoSpace {
            self.msg = format!(
                "{} at {location} (free space there: `ckpt gc` deletes old steps and \
                 unreferenced chunks, and runs on a full disk)",
                self.msg
            );
        }
        self
    }

    /// Local I/O on `path` failed.
    pub fn io(op: &str, path: &impl fmt::Display, e: std::io::Error) -> Self {
        let hint = match e.raw_os_error() {
            Some(libc::ENOSPC) => " (the disk is full: free space or point --store elsewhere)",
            Some(libc::EACCES) | Some(libc::EPERM) => " (permission denied)",
            Some(libc::EROFS) => " (read-only file system)",
            _ => "",
        };
        let kind = if is_no_space(&e) {
            ErrorKind::NoSpace
        } else {
            ErrorKind::Io
        };
        Error::new(kind, format!("{op} {path}: {e}{hint}")).with_source(e)
    }
}

/// Whether `e` or any error in its cause chain is `ENOSPC` (or `EDQUOT`, a full quota).
pub fn is_no_space(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    // Bounded: a cause chain is short; never loop on a cyclic one.
    for _ in 0..32 {
        let Some(x) = cur else { break };
        if let Some(io) = x.downcast_ref::<std::io::Error>() {
            if matches!(io.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
                || matches!(
                    io.kind(),
                    std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
                )
            {
                return true;
            }
            // `io::Error::source` skips a custom error's own value: look at it too.
            if let Some(inner) = io.get_ref() {
                cur = Some(inner);
                continue;
            }
        }
        cur = x.source();
    }
    false
}

fn short_backend_message(e: &object_store::Error) -> String {
    let s = e.to_string();
    // The generic error chains of HTTP clients are long; keep the first line.
    s.lines().next().unwrap_or("").to_string()
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} error: {}", self.kind.as_str(), self.msg)?;
        if let Some(s) = &self.source {
            write!(f, " (caused by: {s})")?;
        }
        Ok(())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|b| b.as_ref() as &(dyn std::error::Error + 'static))
    }
}

impl From<tokio::task::JoinError> for Error {
    fn from(e: tokio::task::JoinError) -> Self {
        if e.is_panic() {
            Error::internal(format!("a worker task panicked: {e}"))
        } else {
            Error::internal(format!("a worker task was cancelled: {e}"))
        }
    }
}
