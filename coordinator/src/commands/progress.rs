//! The terminal's side of [`ringllm::progress::Progress`]: a progress bar on stderr (hidden
//! when stderr is not a terminal, where `line`s are printed alone).

use indicatif::{ProgressBar, ProgressStyle};
use ringllm::progress::Progress;

/// A progress bar: `{prefix} [bar] pos/len message (elapsed)`.
pub struct Bar(ProgressBar);

impl Default for Bar {
    /// Hidden until [`Progress::start`].
    fn default() -> Bar {
        Bar(ProgressBar::hidden())
    }
}

impl Progress for Bar {
    fn start(&self, what: &str, total: Option<u64>) {
        let b = &self.0;
        b.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        b.set_length(total.unwrap_or(0));
        b.set_style(
            ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_prefix(what.to_string());
    }

    fn advance(&self, steps: u64) {
        self.0.inc(steps);
    }

    fn message(&self, msg: &str) {
        self.0.set_message(msg.to_string());
    }

    fn line(&self, line: &str) {
        if self.0.is_hidden() {
            eprintln!("{line}");
        } else {
            self.0.println(line);
        }
    }

    fn finish(&self) {
        self.0.set_position(self.0.length().unwrap_or(0));
        self.0.finish_and_clear();
    }
}
