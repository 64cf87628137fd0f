//! `ringllm`: the command-line front end (run, chat, info, bench, perplexity).
//! Results go to stdout, logs and statistics to stderr.

mod actbench;
mod bench;
mod cli;
mod cluster;
mod debug;
mod engine;
mod info;
mod loadgen;
mod netbench;
mod perplexity;
mod planner;
mod proxy;
mod ring;
mod run;
mod serve;
mod up;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    init_logging(args.verbose);
    let result = match args.command {
        cli::Command::Run(a) => run::run(a),
        cli::Command::Info(a) => info::info(a),
        cli::Command::Bench(a) => bench::bench(a),
        cli::Command::Perplexity(a) => perplexity::perplexity(a),
        cli::Command::Node(a) => up::node(a),
        cli::Command::Up(a) => up::up(a),
        cli::Command::Plan(a) => up::plan(a),
        cli::Command::Keygen(a) => up::keygen(a),
        cli::Command::Debug(a) => debug::debug(a),
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
    use tracing_subscriber::EnvFilter;
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
