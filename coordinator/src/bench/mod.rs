//! Benchmark and test equipment behind `ringllm bench` and `ringllm debug`, one file per
//! tool, each with its arguments: prefill/decode speed of a model (`model`) and of a ring next
//! to the single process (`ring`), transport latency and throughput next to raw sockets
//! (`transports`), a load generator for a running server (`serve`), what compressing
//! activations does to the output (`activations`), and a TCP delay proxy for tests (`proxy`).

pub mod activations;
pub mod model;
pub mod proxy;
pub mod ring;
pub mod serve;
pub mod transports;

use clap::{Args, Subcommand};

/// `ringllm bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

#[derive(Subcommand, Debug, Clone)]
pub enum BenchCommand {
    /// Prefill and decode speed of a model at several thread counts, next to the
    /// memory-bandwidth roofline.
    Model(model::ModelBenchArgs),
    /// A ring (cluster file) next to the single process, measured in turns in one run.
    Ring(ring::RingBenchArgs),
    /// Latency and throughput of every transport next to raw sockets (see --peer).
    Transports(transports::TransportsBenchArgs),
    /// Load-test a running server: streaming completions at each --concurrency.
    Serve(serve::ServeBenchArgs),
    /// What f16, bf16 and q8 hidden states on the wire do to the output, against f32: logit
    /// error and argmax agreement over a prompt set.
    Activations(activations::ActivationsBenchArgs),
}
