//! `ringllm info MODEL`.

use crate::cli::InfoArgs;
use anyhow::Result;
use ringllm::engine::open_gguf;
use ringllm_node::{KvCache, KvType, LoadOptions, Model};
use std::collections::BTreeMap;
use std::process::ExitCode;

pub fn info(args: InfoArgs) -> Result<ExitCode> {
    let file = open_gguf(&args.model)?;
    let md = file.metadata();
    let name = md
        .opt_str("general.name")?
        .unwrap_or("(unnamed)")
        .to_string();
    let model = Model::load(file.clone(), &LoadOptions::default())?;
    let hp = &model.hp;
    println!("file:          {}", args.model.display());
    println!("name:          {name}");
    println!("gguf version:  {}", file.version());
    println!("architecture:  {}", hp.arch.name());
    println!("layers:        {}", hp.n_layer);
    println!("d_model:       {}", hp.d_model);
    println!(
        "heads:         {} (kv {}), head dim {}",
        hp.n_head, hp.n_head_kv, hp.head_dim
    );
    println!("ffn:           {} ({:?})", hp.d_ff, hp.ffn_act);
    println!("vocab:         {}", hp.vocab);
    println!("context:       {} (trained)", hp.ctx_train);
    println!(
        "rope:          {:?}, dim {}, base {} (local {})",
        hp.rope_style, hp.rope_dim, hp.rope_base, hp.rope_base_local
    );
    if hp.sliding_window > 0 {
        let n_local = hp.sliding.iter().filter(|s| **s).count();
        println!(
            "sliding:       window {} on {n_local} of {} layers",
            hp.sliding_window, hp.n_layer
        );
    }
    let mut types: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    let mut total = 0u64;
    for t in file.tensors() {
        let e = types.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.size;
        total += t.size;
    }
    println!(
        "tensors:       {} ({:.1} MiB)",
        file.tensors().len(),
        mib(total)
    );
    for (ty, (n, bytes)) in &types {
        println!("  {ty:<6} {n:>4} tensors {:>9.1} MiB", mib(*bytes));
    }
    let ctx = hp.ctx_train.min(4096);
    let kv = KvCache::bytes_for(hp, 0..hp.n_layer, ctx, 512, KvType::F32);
    println!(
        "memory:        weights {:.1} MiB + KV {:.1} MiB (f32, ctx {ctx}) = {:.1} MiB",
        mib(total),
        mib(kv as u64),
        mib(total + kv as u64)
    );
    println!(
        "read/token:    {:.1} MiB",
        mib(model.weight_bytes_per_token() as u64)
    );
    if args.tensors {
        for t in file.tensors() {
            println!("  {:<40} {:<6} {:?}", t.name, t.ty.name(), t.dims);
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}
