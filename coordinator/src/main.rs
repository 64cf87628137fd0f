//! `ringllm`: the command-line front end. `cli` parses, `commands` runs each subcommand on the
//! `ringllm` library; `bench` holds the benchmark and test equipment. Results go to stdout,
//! logs and statistics to stderr.

/// `println!` for results: a closed stdout ends the process quietly (see `out`).
macro_rules! outln {
    () => {
        $crate::out::write(format_args!(""), true)
    };
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*), true)
    };
}

/// `print!` for results: a closed stdout ends the process quietly (see `out`).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*), false)
    };
}

mod bench;
mod cli;
mod commands;
mod out;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    init_logging(args.verbose);
    let result = match args.command {
        cli::Command::Run(a) => commands::run::run(a),
        cli::Command::Info(a) => commands::info::info(a),
        cli::Command::Bench(a) => commands::bench::bench(a),
        cli::Command::Perplexity(a) => commands::perplexity::perplexity(a),
        cli::Command::Calibrate(a) => commands::calibrate::calibrate(a),
        cli::Command::Node(a) => commands::node::node(a),
        cli::Command::Up(a) => commands::up::up(a),
        cli::Command::Plan(a) => commands::plan::plan(a),
        cli::Command::Keygen(a) => commands::keygen::keygen(a),
        cli::Command::Nodes(a) => commands::nodes::nodes(a),
        cli::Command::Status(a) => commands::status::status(a),
        cli::Command::Debug(a) => commands::debug::debug(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(verbose: u8) {
    use tracing_subscriber::filter::{filter_fn, EnvFilter, FilterExt};
    use tracing_subscriber::prelude::*;
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let progress = |m: &tracing::Metadata<'_>| m.target() == ringllm::cluster::PROGRESS;
    // Colours only on a terminal: not in a pipe, a file or journald. Under journald, which
    // stamps every line itself, no timestamps of our own either.
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let logs = if stderr_is_journal() {
        logs.without_time().boxed()
    } else {
        logs.boxed()
    };
    // The library's progress lines, as they are, whatever the verbosity.
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .event_format(MessageOnly);
    let _ = tracing_subscriber::registry()
        .with(logs.with_filter(filter.and(filter_fn(move |m| !progress(m)))))
        .with(lines.with_filter(filter_fn(progress)))
        .try_init();
}

/// An event's message (and any fields) alone on its line: no time, level, target or spans.
struct MessageOnly;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for MessageOnly
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut w: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// True when stderr is the journal stream systemd connected (`JOURNAL_STREAM` names its
/// device and inode, as `DEVICE:INODE`; a child whose stderr was redirected no longer
/// matches).
fn stderr_is_journal() -> bool {
    #[cfg(unix)]
    {
        use std::os::fd::AsFd;
        use std::os::unix::fs::MetadataExt;
        let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
            return false;
        };
        let Some((dev, ino)) = v.to_str().and_then(|v| v.split_once(':')) else {
            return false;
        };
        let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else {
            return false;
        };
        let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() else {
            return false;
        };
        std::fs::File::from(fd)
            .metadata()
            .is_ok_and(|m| m.dev() == dev && m.ino() == ino)
    }
    #[cfg(not(unix))]
    false
}
