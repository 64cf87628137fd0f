//! The coordinator's domain, as a library: the single-process engine (`engine`), text in and
//! out (`text`: tokenizer, chat templates, sampler), the ring (`cluster`: cluster files and
//! their diagnostics, the planner, the coordinator's side of the ring) and the
//! OpenAI-compatible server (`serve`). The `ringllm` binary (`main.rs`, `cli.rs`,
//! `commands/`, `bench/`) parses arguments into the option structs these modules take; no
//! module here depends on clap.

pub mod cluster;
pub mod engine;
pub mod serve;
pub mod skip;
pub mod text;
