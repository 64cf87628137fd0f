//! Benchmark and test equipment behind `ringllm bench` and `ringllm debug`: prefill/decode
//! speed of a model and of a ring (`model`), transport latency and throughput next to raw
//! sockets (`transports`), a load generator for a running server (`serve`), what compressing
//! activations does to the output (`activations`), and a TCP delay proxy for tests (`proxy`).

pub mod activations;
pub mod model;
pub mod proxy;
pub mod serve;
pub mod transports;
