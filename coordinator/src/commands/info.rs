//! `ringllm info MODEL`.

use crate::cli::InfoArgs;
use anyhow::Result;
use ringllm::engine::open_gguf;
use ringllm::text::template::builtin_names;
use ringllm::text::tokenizer::{Tokenizer, TokenizerSpec};
use ringllm_model::{KvCache, KvType, LoadOptions, Model};
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
    outln!("file:          {}", args.model.display());
    outln!("name:          {name}");
    outln!("gguf version:  {}", file.version());
    outln!("architecture:  {}", hp.arch.name());
    outln!("layers:        {}", hp.n_layer);
    outln!("d_model:       {}", hp.d_model);
    outln!(
        "heads:         {} (kv {}), head dim {}",
        hp.n_head,
        hp.n_head_kv,
        hp.head_dim
    );
    match hp.moe {
        Some(m) => outln!(
            "ffn:           mixture of {} experts, {} per token, each {} wide ({:?})",
            m.n_expert,
            m.n_used,
            m.d_ff_exp,
            hp.ffn_act
        ),
        None => outln!("ffn:           {} ({:?})", hp.d_ff, hp.ffn_act),
    }
    outln!("vocab:         {}", hp.vocab);
    outln!("context:       {} (trained)", hp.ctx_train);
    outln!(
        "rope:          {:?}, dim {}, base {} (local {})",
        hp.rope_style,
        hp.rope_dim,
        hp.rope_base,
        hp.rope_base_local
    );
    if hp.sliding_window > 0 {
        let n_local = hp.sliding.iter().filter(|s| **s).count();
        outln!(
            "sliding:       window {} on {n_local} of {} layers",
            hp.sliding_window,
            hp.n_layer
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
    outln!(
        "tensors:       {} ({:.1} MiB)",
        file.tensors().len(),
        mib(total)
    );
    for (ty, (n, bytes)) in &types {
        outln!("  {ty:<6} {n:>4} tensors {:>9.1} MiB", mib(*bytes));
    }
    let ctx = hp.ctx_train.min(4096);
    let kv = KvCache::bytes_for(hp, 0..hp.n_layer, ctx, 512, KvType::F32);
    outln!(
        "memory:        weights {:.1} MiB + KV {:.1} MiB (f32, ctx {ctx}) = {:.1} MiB",
        mib(total),
        mib(kv as u64),
        mib(total + kv as u64)
    );
    outln!(
        "read/token:    {:.1} MiB",
        mib(model.weight_bytes_per_token() as u64)
    );
    // A model without a usable vocabulary is still described.
    if let Err(e) = text_facts(md, args.chat_template) {
        outln!("tokenizer:     none usable ({e:#})");
    }
    if args.tensors {
        for t in file.tensors() {
            outln!("  {:<40} {:<6} {:?}", t.name, t.ty.name(), t.dims);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The tokenizer, its BOS/EOS and the chat template (and the template's text when asked).
fn text_facts(md: &ringllm_model::gguf::Metadata, print_template: bool) -> Result<()> {
    let spec = TokenizerSpec::from_gguf(md)?;
    let tok = Tokenizer::new(&spec)?;
    // The pre-tokenizer matters to byte-level BPE only.
    let pre = match (spec.model.as_str(), spec.pre.as_deref()) {
        ("gpt2", Some(p)) => format!(", pre-tokenizer '{p}'"),
        _ => String::new(),
    };
    outln!(
        "tokenizer:     {}{pre}, {} tokens",
        tok.kind_name(),
        tok.vocab_size()
    );
    let token = |id: Option<u32>| match id {
        Some(id) => format!("{id} {:?}", tok.id_to_piece(id).unwrap_or("")),
        None => "none".to_string(),
    };
    let added = |yes: bool| if yes { "added to prompts" } else { "not added" };
    outln!(
        "bos:           {} ({})",
        token(tok.bos()),
        added(tok.add_bos_default())
    );
    outln!(
        "eos:           {} ({})",
        token(tok.eos()),
        added(tok.add_eos_default())
    );
    let eog: Vec<String> = tok.eog_ids().iter().map(|&id| token(Some(id))).collect();
    outln!("end of turn:   {}", eog.join(", "));
    match &spec.chat_template {
        Some(t) => {
            outln!(
                "chat template: the model's own, {} ({} lines{})",
                template_family(t),
                t.lines().count(),
                if print_template {
                    ""
                } else {
                    "; --chat-template prints it"
                }
            );
            if print_template {
                outln!("{}", t.trim_end());
            }
        }
        None => outln!(
            "chat template: none (chat with --template {})",
            builtin_names().join("|")
        ),
    }
    Ok(())
}

/// The chat format a template writes, by its markup.
fn template_family(t: &str) -> &'static str {
    if t.contains("<|im_start|>") {
        "ChatML"
    } else if t.contains("<start_of_turn>") {
        "Gemma turns"
    } else if t.contains("<|start_header_id|>") {
        "Llama 3 headers"
    } else if t.contains("[INST]") {
        "Mistral/Llama 2 [INST]"
    } else {
        "custom"
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}
