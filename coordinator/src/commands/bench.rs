//! `ringllm bench`: runs the tool its subcommand names (`crate::bench` holds them), and
//! reads the flat spellings of the release before (`bench -m MODEL`, `bench --cluster FILE`,
//! `--transports`, `--serve URL`, `--activations`) as the subcommand they meant, with a
//! deprecation warning.

use crate::bench::{self, BenchArgs, BenchCommand};
use anyhow::Result;
use std::ffi::OsString;
use std::process::ExitCode;

pub fn bench(args: BenchArgs) -> Result<ExitCode> {
    match &args.command {
        BenchCommand::Model(a) => bench::model::bench_model(a),
        BenchCommand::Ring(a) => bench::ring::bench_ring(a),
        BenchCommand::Transports(a) => bench::transports::bench_transports(a),
        BenchCommand::Serve(a) => bench::serve::bench_serve(a),
        BenchCommand::Activations(a) => bench::activations::bench_activations(a),
    }
}

/// The flag of the old flat `bench` that chose each tool, in the order it was looked at,
/// whether it took a value (which becomes the subcommand's positional argument), and the
/// subcommand. No such flag: `model`.
const OLD_FLAGS: [(&str, bool, &str); 4] = [
    ("--cluster", true, "ring"),
    ("--transports", false, "transports"),
    ("--activations", false, "activations"),
    ("--serve", true, "serve"),
];

/// Rewrites a command line in the flat `bench` spelling into the subcommand it meant, and
/// the one-line warning to print; any other command line comes back as it was. Goes in the
/// next release, with the flat spellings.
pub fn legacy_argv(mut argv: Vec<OsString>) -> (Vec<OsString>, Option<String>) {
    let global = |a: &OsString| {
        a.to_str().is_some_and(|s| {
            s == "--verbose"
                || (s.len() > 1 && s[1..].bytes().all(|b| b == b'v') && s.starts_with('-'))
        })
    };
    let Some(at) = argv.iter().skip(1).position(|a| !global(a)).map(|i| i + 1) else {
        return (argv, None);
    };
    if argv[at] != "bench" {
        return (argv, None);
    }
    let first = argv.get(at + 1).and_then(|a| a.to_str());
    let subcommands = [
        "model",
        "ring",
        "transports",
        "serve",
        "activations",
        "help",
    ];
    match first {
        None | Some("-h" | "--help") => return (argv, None),
        Some(s) if subcommands.contains(&s) => return (argv, None),
        Some(_) => {}
    }
    let mut sub = "model";
    let mut old = String::from("-m MODEL");
    let mut new = String::from("model -m MODEL");
    'find: for (flag, takes_value, name) in OLD_FLAGS {
        for i in at + 1..argv.len() {
            let Some(a) = argv[i].to_str() else { continue };
            if a == "--" {
                break;
            }
            let with_value = takes_value
                .then(|| a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')))
                .flatten();
            if a == flag || with_value.is_some() {
                match with_value {
                    // `--cluster=FILE`: FILE stays where the flag was.
                    Some(v) => argv[i] = OsString::from(v.to_string()),
                    // `--cluster FILE` or `--transports`: the flag goes.
                    None => {
                        argv.remove(i);
                    }
                }
                let value = if takes_value { " VALUE" } else { "" };
                let value = match name {
                    "ring" => " FILE",
                    "serve" => " URL",
                    _ => value,
                };
                sub = name;
                old = format!("{flag}{value}");
                new = format!("{name}{value}");
                break 'find;
            }
        }
    }
    argv.insert(at + 1, OsString::from(sub));
    let warning = format!(
        "warning: `ringllm bench {old}` is deprecated and goes in the next release: \
         write `ringllm bench {new}`"
    );
    (argv, Some(warning))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn rewrite(line: &str) -> (String, Option<String>) {
        let argv = line.split(' ').map(OsString::from).collect();
        let (argv, warning) = legacy_argv(argv);
        let out: Vec<String> = argv
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        (out.join(" "), warning)
    }

    #[test]
    fn flat_bench_spellings_become_subcommands() {
        for (old, new) in [
            (
                "ringllm bench -m M -p 8,64 -n 4",
                "ringllm bench model -m M -p 8,64 -n 4",
            ),
            (
                "ringllm -v bench -m M --skip auto",
                "ringllm -v bench model -m M --skip auto",
            ),
            (
                "ringllm bench --cluster c.toml --cold -n 8",
                "ringllm bench ring c.toml --cold -n 8",
            ),
            (
                "ringllm bench -p 16 --cluster=c.toml --json",
                "ringllm bench ring -p 16 c.toml --json",
            ),
            (
                "ringllm bench --transports --peer h:1 --iterations 9",
                "ringllm bench transports --peer h:1 --iterations 9",
            ),
            (
                "ringllm bench --transports --echo-server h:1",
                "ringllm bench transports --echo-server h:1",
            ),
            (
                "ringllm bench -m M --activations -n 8",
                "ringllm bench activations -m M -n 8",
            ),
            (
                "ringllm bench --serve http://h:1 --concurrency 1,2 -n 64 -r 2",
                "ringllm bench serve http://h:1 --concurrency 1,2 -n 64 -r 2",
            ),
        ] {
            let (got, warning) = rewrite(old);
            assert_eq!(got, new);
            let w = warning.expect("a deprecation warning");
            assert!(
                w.starts_with("warning: `ringllm bench ") && !w.contains('\n'),
                "{w}"
            );
            // The rewritten line parses.
            let argv: Vec<&str> = got.split(' ').collect();
            crate::cli::Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{got}: {e}"));
        }
        let (_, w) = rewrite("ringllm bench --cluster c.toml");
        assert!(w.is_some_and(|w| w.contains("`ringllm bench ring FILE`")));
    }

    #[test]
    fn other_command_lines_stay() {
        for line in [
            "ringllm bench model -m M",
            "ringllm bench ring c.toml",
            "ringllm bench --help",
            "ringllm bench",
            "ringllm run -m bench",
            "ringllm up --cluster c.toml",
            "ringllm",
        ] {
            assert_eq!(rewrite(line), (line.to_string(), None));
        }
    }
}
