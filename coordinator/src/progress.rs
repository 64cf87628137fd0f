//! Progress of a long task (sending slices to the nodes, a calibration), reported by the
//! library and drawn by whoever owns the terminal: the binary installs a [`ProgressSink`]
//! (with [`set_sink`]) that draws each task as a progress bar; without one, [`task`] gives
//! [`NoProgress`], which reports nothing (tests, and callers with no terminal).

use std::sync::OnceLock;

/// Receives the progress of one task: `start`, any number of `advance`, `set_position`,
/// `inc_length` and `message`, then `finish`. Implementations take `&self` (a task may report
/// from several threads). Dropping a task ends it too (its bar is cleared).
pub trait Progress: Send + Sync {
    /// The task `what` begins, with `total` steps (`None`: unknown).
    fn start(&self, what: &str, total: Option<u64>);
    /// `steps` more steps are done.
    fn advance(&self, steps: u64);
    /// `pos` steps are done in all.
    fn set_position(&self, pos: u64) {
        let _ = pos;
    }
    /// The task has `more` steps than it had.
    fn inc_length(&self, more: u64) {
        let _ = more;
    }
    /// What the task is doing now (shown beside the bar).
    fn message(&self, msg: &str);
    /// A line to keep above the bar (a finished sub-result).
    fn line(&self, line: &str) {
        let _ = line;
    }
    /// The task is over.
    fn finish(&self);
}

/// What a task counts, which decides how it is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Steps of a known total (`pos/len`).
    Steps,
    /// Bytes of a known total (sizes and a rate).
    Bytes,
    /// Something of unknown length: a spinner beside its message.
    Spinner,
}

/// Makes the [`Progress`] of each task: what owns the terminal installs one with
/// [`set_sink`].
pub trait ProgressSink: Send + Sync {
    /// A new task, of `kind`; nothing shows until its `start`.
    fn task(&self, kind: Kind) -> Box<dyn Progress>;
}

static SINK: OnceLock<Box<dyn ProgressSink>> = OnceLock::new();

/// Installs the process's progress sink; only the first call counts (`false` for the
/// others).
pub fn set_sink(sink: Box<dyn ProgressSink>) -> bool {
    SINK.set(sink).is_ok()
}

/// A new task of `kind`, from the installed sink ([`NoProgress`] when there is none).
pub fn task(kind: Kind) -> Box<dyn Progress> {
    match SINK.get() {
        Some(s) => s.task(kind),
        None => Box::new(NoProgress),
    }
}

/// Reports nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&self, _what: &str, _total: Option<u64>) {}
    fn advance(&self, _steps: u64) {}
    fn message(&self, _msg: &str) {}
    fn finish(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_sink_tasks_report_nothing() {
        // No test installs a sink: the library alone never draws.
        let t = task(Kind::Bytes);
        t.start("node", Some(10));
        t.set_position(5);
        t.inc_length(5);
        t.line("a line");
        t.finish();
    }
}
