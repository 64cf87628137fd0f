//! What the planner is told about a Phi-3 model (issue 28, part 5): each layer's weight bytes
//! are its fused matrices' (the loader's row views add up to them, nothing counted twice or
//! left out) and its KV bytes hold only the window on every layer. (The runner's scratch is
//! the unfused layer's by construction: the views write the same q, k, v, gate and up
//! buffers, which `Runner::scratch_bytes` counts.)

use ringllm::cluster::ring::model_cost;
use ringllm_kernels::GgmlType;
use ringllm_model::gguf::GgufFile;
use ringllm_model::synth::{synth_model, SynthArch, SynthSpec};
use ringllm_model::KvType;
use ringllm_protocol::Dtype;
use std::sync::Arc;

#[test]
fn phi3_layer_weight_kv_and_scratch_bytes() {
    let spec = SynthSpec::new(SynthArch::Phi3, GgmlType::Q8_0, 2);
    let file = Arc::new(GgufFile::from_bytes(synth_model(&spec).unwrap()).unwrap());
    let (ctx, max_batch) = (256, 8);
    let (cost, hp) = model_cost(&file, ctx, max_batch, KvType::F16, Dtype::F32).unwrap();
    assert_eq!(cost.n_layer, spec.n_layer as usize);
    for il in 0..cost.n_layer {
        // Every matrix of the layer in the file: the two fused ones, attn_output, ffn_down.
        let matrices: u64 = file
            .tensors()
            .iter()
            .filter(|t| t.name.starts_with(&format!("blk.{il}.")) && t.dims.len() == 2)
            .map(|t| t.size)
            .sum();
        let fused = |n: &str| file.tensor(&format!("blk.{il}.{n}.weight")).unwrap().size;
        assert!(fused("attn_qkv") > 0 && fused("ffn_up") > fused("ffn_down"));
        assert_eq!(cost.layer_weight_bytes[il], matrices, "layer {il}");
        // The window (32) plus a batch's worth of rows, not the whole context, of K and V in
        // f16.
        let window = hp.sliding_window as u64;
        assert_eq!(window, 32);
        let kv_dim = hp.kv_dim() as u64;
        assert_eq!(
            cost.layer_kv_bytes[il],
            2 * (window + max_batch as u64 - 1) * kv_dim * 2,
            "layer {il}"
        );
        assert!(cost.layer_kv_bytes[il] < 2 * ctx as u64 * kv_dim * 2);
    }
}
