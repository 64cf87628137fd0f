//! The coordinator's domain, as a library: the single-process engine (`engine`), text in and
//! out (`text`: tokenizer, chat templates, sampler), the ring (`cluster`: cluster files and
//! their diagnostics, the planner, the coordinator's side of the ring) and the
//! OpenAI-compatible server (`serve`). The `ringllm` binary (`main.rs`, `cli.rs`,
//! `commands/`, `bench/`) parses arguments into the option structs these modules take; no
//! module here depends on clap.
//!
//! Nothing here writes to the terminal or picks an exit code: that is the binary's. What a
//! person at the terminal should read (a warning, `serving … on http://…`, a ring rebuilt) is
//! a `tracing` event with the target [`NOTICE_TARGET`] (the `notice!` macro), which the
//! binary prints as a plain line on stderr whatever the log level; long tasks report through
//! [`progress::Progress`], which the binary draws as a progress bar.

/// The `tracing` target of the events meant for the person at the terminal (see the crate
/// docs): the binary prints their message as is, one line on stderr, at any log level. The
/// ring's progress lines (slices sent and loaded) use the same target.
pub const NOTICE_TARGET: &str = "ringllm::progress";

/// A line for the person at the terminal: a `tracing` event with the target
/// [`NOTICE_TARGET`], at info level, or at warn level with `notice!(warn: ...)`.
macro_rules! notice {
    (warn: $($arg:tt)*) => {
        tracing::warn!(target: $crate::NOTICE_TARGET, $($arg)*)
    };
    ($($arg:tt)*) => {
        tracing::info!(target: $crate::NOTICE_TARGET, $($arg)*)
    };
}

pub mod cluster;
pub mod convert;
pub mod engine;
pub mod progress;
pub mod serve;
pub mod skip;
pub mod text;
