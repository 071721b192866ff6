//! Progress bars with rate and time left, drawn on stderr only for a person watching.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How a command talks to the person running it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ui {
    /// JSON on stdout instead of text.
    pub json: bool,
    /// Draw progress bars.
    pub progress: bool,
}

impl Ui {
    /// Progress bars when stderr is a terminal, `--json` is off and `--no-progress` is not
    /// given.
    pub fn new(json: bool, no_progress: bool) -> Self {
        Ui {
            json,
            progress: !json && !no_progress && std::io::stderr().is_terminal(),
        }
    }

    /// No bars, text output (tests and library callers).
    pub fn quiet() -> Self {
        Ui::default()
    }

    /// A bar over `total` bytes: `msg [=====>    ] 1.2 GiB/2.0 GiB 512 MiB/s 2s left`.
    pub fn bytes(&self, total: u64, msg: impl Into<String>) -> ProgressBar {
        if !self.progress {
            return ProgressBar::hidden();
        }
        let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        pb.set_style(
            ProgressStyle::with_template(
                "{msg:.bold} [{bar:30.cyan/blue}] {binary_bytes}/{binary_total_bytes} \
                 {binary_bytes_per_sec} {eta} left",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        pb.set_message(msg.into());
        pb.enable_steady_tick(Duration::from_millis(200));
        pb
    }

    /// A bar over `total` items.
    pub fn items(&self, total: u64, msg: impl Into<String>) -> ProgressBar {
        if !self.progress {
            return ProgressBar::hidden();
        }
        let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        pb.set_style(
            ProgressStyle::with_template(
                "{msg:.bold} [{bar:30.cyan/blue}] {pos}/{len} {per_sec} {eta} left",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        pb.set_message(msg.into());
        pb.enable_steady_tick(Duration::from_millis(200));
        pb
    }

    /// A spinner for work of unknown size.
    pub fn spinner(&self, msg: impl Into<String>) -> ProgressBar {
        if !self.progress {
            return ProgressBar::hidden();
        }
        let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        pb.set_style(ProgressStyle::with_template("{spinner} {msg}").expect("valid template"));
        pb.set_message(msg.into());
        pb.enable_steady_tick(Duration::from_millis(120));
        pb
    }
}
