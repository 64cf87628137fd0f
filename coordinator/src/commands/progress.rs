//! The terminal's side of [`ringllm::progress`]: every task is a progress bar on stderr, all
//! of them in one [`MultiProgress`] (several node transfers show at once). When stderr is not
//! a terminal the bars are hidden and only the `line`s (and the library's notices) print.

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressStyle};
use ringllm::progress::{Kind, Progress, ProgressSink};
use std::sync::OnceLock;
use std::time::Duration;

/// The bars of the process, drawn together on stderr.
fn multi() -> &'static MultiProgress {
    static MULTI: OnceLock<MultiProgress> = OnceLock::new();
    MULTI.get_or_init(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()))
}

/// Prints `line` on stderr, above any bars being drawn.
pub fn print_line(line: &str) {
    multi().suspend(|| eprintln!("{line}"));
}

/// The sink the binary installs: a [`Bar`] per task.
pub struct Terminal;

impl ProgressSink for Terminal {
    fn task(&self, kind: Kind) -> Box<dyn Progress> {
        Box::new(Bar::new(kind))
    }
}

/// A progress bar, drawn from `start` on, cleared at `finish` or when dropped.
pub struct Bar {
    bar: ProgressBar,
    kind: Kind,
}

impl Default for Bar {
    /// A bar counting steps: `{prefix} [bar] pos/len message (elapsed)`.
    fn default() -> Bar {
        Bar::new(Kind::Steps)
    }
}

impl Bar {
    /// Hidden until [`Progress::start`].
    pub fn new(kind: Kind) -> Bar {
        Bar {
            bar: ProgressBar::hidden().with_finish(ProgressFinish::AndClear),
            kind,
        }
    }

    fn style(&self) -> ProgressStyle {
        let style = match self.kind {
            Kind::Steps => {
                ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
            }
            Kind::Bytes => ProgressStyle::with_template(
                "  {prefix:<14} [{bar:28}] {binary_bytes:>10}/{binary_total_bytes:<10} \
                 {binary_bytes_per_sec:>12} ETA {eta}",
            )
            .map(|s| s.progress_chars("=> ")),
            Kind::Spinner => return ProgressStyle::default_spinner(),
        };
        style.unwrap_or_else(|_| ProgressStyle::default_bar())
    }
}

impl Progress for Bar {
    fn start(&self, what: &str, total: Option<u64>) {
        let b = &self.bar;
        b.set_style(self.style());
        if self.kind == Kind::Spinner {
            b.set_message(what.to_string());
        } else {
            b.set_length(total.unwrap_or(0));
            b.set_prefix(what.to_string());
        }
        multi().add(b.clone());
        if self.kind == Kind::Spinner {
            b.enable_steady_tick(Duration::from_millis(120));
        }
    }

    fn advance(&self, steps: u64) {
        self.bar.inc(steps);
    }

    fn set_position(&self, pos: u64) {
        self.bar.set_position(pos);
    }

    fn inc_length(&self, more: u64) {
        self.bar.inc_length(more);
    }

    fn message(&self, msg: &str) {
        self.bar.set_message(msg.to_string());
    }

    fn line(&self, line: &str) {
        print_line(line);
    }

    fn finish(&self) {
        if let Some(len) = self.bar.length() {
            self.bar.set_position(len);
        }
        self.bar.finish_and_clear();
    }
}
