//! ringllm node daemon (`daemon`): serves a slice of a model to a coordinator. The model
//! runtime it drives (GGUF, architectures, forward pass, KV cache, streaming, skip) is the
//! `ringllm-model` crate.

pub mod daemon;

pub mod test_util;
