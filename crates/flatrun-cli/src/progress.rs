//! Progress on stderr for what takes more than a moment (loading and
//! dequantizing, a long prefill, a bench run) — only when stderr is a
//! terminal; in a pipe or a log nothing is drawn.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::Duration;

/// A progress bar or spinner that does nothing when not shown.
pub struct Progress(Option<ProgressBar>);

/// Whether progress may be drawn: stderr is a terminal and the user did not
/// ask for quiet output.
pub fn on_terminal(quiet: bool) -> bool {
    !quiet && std::io::stderr().is_terminal()
}

impl Progress {
    /// A bar of `total` steps labelled `what`, drawn when `show`.
    pub fn bar(show: bool, total: u64, what: &str) -> Progress {
        if !show {
            return Progress(None);
        }
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        if let Ok(style) =
            ProgressStyle::with_template("{msg:>9} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(what.to_string());
        Progress(Some(bar))
    }

    /// A bar of `total` bytes labelled `what` with the rate and the time
    /// left, drawn when `show`.
    #[cfg(feature = "hub")]
    pub fn bytes(show: bool, total: u64, what: &str) -> Progress {
        if !show {
            return Progress(None);
        }
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(
            "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(what.to_string());
        Progress(Some(bar))
    }

    /// Start measuring the rate and time left again from here (after a
    /// jump such as resuming a download).
    #[cfg(feature = "hub")]
    pub fn restart_rate(&self) {
        if let Some(bar) = &self.0 {
            bar.reset_eta();
        }
    }

    /// A spinner with elapsed time labelled `what`, drawn when `show`.
    pub fn spinner(show: bool, what: &str) -> Progress {
        if !show {
            return Progress(None);
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} {elapsed}") {
            bar.set_style(style);
        }
        bar.set_message(what.to_string());
        bar.enable_steady_tick(Duration::from_millis(100));
        Progress(Some(bar))
    }

    /// Steps done so far.
    pub fn set(&self, done: u64) {
        if let Some(bar) = &self.0 {
            bar.set_position(done);
        }
    }

    /// Advance by one step.
    pub fn inc(&self) {
        if let Some(bar) = &self.0 {
            bar.inc(1);
        }
    }

    /// Run `f` (which prints) with the bar hidden, so the two do not mix.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.0 {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }

    /// Remove the bar from the terminal.
    pub fn finish(&self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
