//! Progress of a long task (sending slices to the nodes, a calibration), reported by the
//! library and drawn by whoever owns the terminal: the binary implements [`Progress`] with a
//! progress bar; [`NoProgress`] reports nothing (tests, and callers with no terminal).

/// Receives the progress of one task: `start`, any number of `advance` and `message`, then
/// `finish`. Implementations take `&self` (a task may report from several threads).
pub trait Progress: Send + Sync {
    /// The task `what` begins, with `total` steps (`None`: unknown).
    fn start(&self, what: &str, total: Option<u64>);
    /// `steps` more steps are done.
    fn advance(&self, steps: u64);
    /// What the task is doing now (shown beside the bar).
    fn message(&self, msg: &str);
    /// A line to keep above the bar (a finished sub-result).
    fn line(&self, line: &str) {
        let _ = line;
    }
    /// The task is over.
    fn finish(&self);
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
