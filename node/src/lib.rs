//! ringllm model slice: GGUF reading and writing, architectures as data, KV cache and the
//! forward pass over a contiguous range of layers.
