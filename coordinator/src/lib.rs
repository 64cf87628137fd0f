//! The `ringllm` library side of the coordinator: tokenizer, chat templates and sampler.

pub mod sampler;
pub mod template;
pub mod tokenizer;
