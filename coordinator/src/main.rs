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
    let (argv, deprecated) = commands::bench::legacy_argv(std::env::args_os().collect());
    let args = cli::Cli::parse_from(argv);
    init_logging(args.verbose);
    ringllm::progress::set_sink(Box::new(commands::progress::Terminal));
    if let Some(warning) = deprecated {
        eprintln!("{warning}");
    }
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
        cli::Command::Revoke(a) => commands::keygen::revoke(a),
        cli::Command::Nodes(a) => commands::nodes::nodes(a),
        cli::Command::Status(a) => commands::status::status(a),
        cli::Command::Debug(a) => commands::debug::debug(a),
        cli::Command::Convert(a) => commands::convert::convert(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs on stderr as `-v` and `RUST_LOG` ask; the library's notices (target
/// [`ringllm::NOTICE_TARGET`]) as plain lines on stderr whatever the log level.
fn init_logging(verbose: u8) {
    use tracing_subscriber::filter::filter_fn;
    use tracing_subscriber::prelude::*;
    use tracing_subscriber::EnvFilter;
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // Colours only on a terminal: not in a pipe, a file or journald. Under journald, which
    // stamps every line itself, no timestamps of our own either.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let fmt = if stderr_is_journal() {
        fmt.without_time().boxed()
    } else {
        fmt.boxed()
    };
    let logs = fmt
        .with_filter(filter)
        .with_filter(filter_fn(|m| m.target() != ringllm::NOTICE_TARGET));
    let notices = Notices.with_filter(filter_fn(|m| m.target() == ringllm::NOTICE_TARGET));
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(notices)
        .try_init();
}

/// Prints the message of each notice the library sends, as is, on a line of stderr (above any
/// progress bars).
struct Notices;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Notices {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "message" {
                    self.0 = value.to_string();
                }
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut m = Message(String::new());
        event.record(&mut m);
        commands::progress::print_line(&m.0);
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
