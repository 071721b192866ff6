//! Stopping on SIGTERM: [`on_sigterm`] installs the handler (a second SIGTERM ends the process
//! at once), and [`StopFlag`] is what a manager knows of it: the flag, the decision the ranks
//! agreed on for the next `maybe_save`, and whether the final checkpoint was taken.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ckpt_store::{Error, Result};

/// On SIGTERM set `flag` (a training loop that owns its own signal handling, such as
/// `ckpt-train` with its ranks as threads, installs it); on a SIGTERM that finds `flag` already
/// set, say so on stderr and end the process at once with status 143 (128 + SIGTERM): the
/// first asks for a final checkpoint, the second means "now", whatever that checkpoint is
/// waiting for.
pub fn on_sigterm(flag: &Arc<AtomicBool>) -> Result<()> {
    let f = flag.clone();
    let action = move || {
        if f.swap(true, Ordering::SeqCst) {
            const MSG: &[u8] =
                b"ckpt: second SIGTERM: exiting without waiting for the final checkpoint\n";
            // SAFETY: write(2) and _exit(2) are async-signal-safe.
            unsafe {
                libc::write(2, MSG.as_ptr().cast(), MSG.len());
                libc::_exit(143);
            }
        }
    };
    // SAFETY: the action only does async-signal-safe things (an atomic swap, write, _exit).
    unsafe { signal_hook::low_level::register(signal_hook::consts::SIGTERM, action) }
        .map(|_| ())
        .map_err(|e| Error::internal(format!("installing the SIGTERM handler: {e}")))
}

/// What a manager knows of a stop.
pub(crate) struct StopFlag {
    sigterm: Arc<AtomicBool>,
    /// The stop decision the ranks agreed on for the current `maybe_save`; `None`: this rank's
    /// own SIGTERM flag decides.
    agreed: Option<bool>,
    /// The final checkpoint was taken: the loop stops.
    stopped: bool,
}

impl StopFlag {
    /// A flag, set by SIGTERM when `handle` (the handler is installed for the process).
    pub(crate) fn new(handle: bool) -> Result<Self> {
        let sigterm = Arc::new(AtomicBool::new(false));
        if handle {
            on_sigterm(&sigterm)?;
        }
        Ok(StopFlag {
            sigterm,
            agreed: None,
            stopped: false,
        })
    }

    /// Whether SIGTERM has arrived (or a stop was requested).
    pub(crate) fn received(&self) -> bool {
        self.sigterm.load(Ordering::SeqCst)
    }

    /// Ask for a stop as if SIGTERM had arrived.
    pub(crate) fn request(&self) {
        self.sigterm.store(true, Ordering::SeqCst);
    }

    /// The decision the ranks agreed on, for the next [`StopFlag::take_due`].
    pub(crate) fn agree(&mut self, stop: Option<bool>) {
        self.agreed = stop;
    }

    /// Whether this `maybe_save` takes the final checkpoint: the agreed decision (taken), else
    /// the flag, and not taken yet.
    pub(crate) fn take_due(&mut self) -> bool {
        let term = self.agreed.take().unwrap_or_else(|| self.received());
        term && !self.stopped
    }

    /// The final checkpoint was taken.
    pub(crate) fn set_stopped(&mut self) {
        self.stopped = true;
    }

    /// Whether the final checkpoint was taken.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agreed_decision_wins_once() {
        let mut f = StopFlag::new(false).unwrap();
        assert!(!f.take_due());
        f.request();
        assert!(f.received());
        f.agree(Some(false));
        assert!(!f.take_due(), "the ranks agreed not to stop yet");
        assert!(f.take_due(), "then the flag decides");
        f.set_stopped();
        assert!(f.stopped() && !f.take_due());
        let mut g = StopFlag::new(false).unwrap();
        g.agree(Some(true));
        assert!(g.take_due() && !g.received());
    }
}
