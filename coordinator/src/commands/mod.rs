//! One file per `ringllm` subcommand: each turns its parsed arguments into the library's
//! option structs, runs, and prints results to stdout (logs and errors go to stderr).

pub mod bench;
pub mod calibrate;
pub mod chat;
pub mod convert;
pub mod debug;
pub mod info;
pub mod keygen;
pub mod node;
pub mod nodes;
pub mod perplexity;
pub mod plan;
pub mod progress;
pub mod run;
pub mod status;
pub mod up;
