//! `ringllm convert HF_DIR -o OUT.gguf [--type q4_k_m|q8_0|f16|...]`.

use crate::cli::ConvertArgs;
use anyhow::{anyhow, Result};
use ringllm::convert::{convert as run_convert, ConvertOptions};
use ringllm_model::synth::WeightMix;
use std::process::ExitCode;

pub fn convert(args: ConvertArgs) -> Result<ExitCode> {
    let mix = WeightMix::from_name(&args.ty).ok_or_else(|| {
        anyhow!(
            "unknown weight type '{}' (q4_k_m, or a type such as f16, bf16, f32, q8_0, q6_k)",
            args.ty
        )
    })?;
    let r = run_convert(&ConvertOptions {
        dir: args.dir.clone(),
        output: args.output.clone(),
        mix,
        threads: args
            .threads
            .unwrap_or_else(ringllm::engine::default_threads),
    })?;
    eprintln!(
        "wrote {} ({}, {} tensors, {}): {:.3} GB in {:.1} s ({:.0} MB/s written, {:.0} MB/s read)",
        args.output.display(),
        r.arch,
        r.n_tensors,
        mix.name(),
        r.bytes as f64 / 1e9,
        r.seconds,
        r.bytes as f64 / 1e6 / r.seconds.max(1e-9),
        r.read as f64 / 1e6 / r.seconds.max(1e-9),
    );
    Ok(ExitCode::SUCCESS)
}
