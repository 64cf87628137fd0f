//! `ringllm up`: the coordinator of a ring: completes a prompt, chats, or serves the API
//! with the nodes running the layers.

use crate::cli::UpArgs;
use anyhow::Result;
use ringllm::cluster;
use ringllm::engine::{Engine, ModelOptions};
use std::process::ExitCode;

pub fn up(args: UpArgs) -> Result<ExitCode> {
    let mut s = cluster::setup(&cluster::Source::from(&args.source))?;
    let model = ModelOptions {
        model: s.model.clone(),
        threads: args.threads.or(s.threads),
        ctx: args.source.ctx.or(s.ctx),
        batch: args.batch,
        kv: args.kv.or(s.kv).unwrap_or_default(),
        repack: !args.layout.no_repack,
        memory: None,
        stream: args.layout.stream.settings(),
        backend: args.layout.backend,
    };
    if !(args.wait >= 0.0 && args.wait <= 86_400.0) {
        anyhow::bail!("--wait {}: give seconds from 0 to 86400", args.wait);
    }
    s.spec.wait = std::time::Duration::from_secs_f64(args.wait);
    s.spec.send_slices = !args.no_send;
    // The predictor is checked here against the whole model and sent to every node.
    let skip = ringllm::skip::SkipOptions::from(&args.skip);
    if skip.setting != ringllm::skip::SkipSetting::Off {
        let file = ringllm::engine::open_gguf(&model.model)?;
        let full = ringllm_model::Model::load(file, &Default::default())?;
        if let Some(p) = ringllm::skip::load_policy(&skip, &model.model, &full)? {
            s.spec.skip = Some((
                std::sync::Arc::new(p.predictor.to_bytes()),
                p.confidence,
                p.max_skip,
            ));
        }
    }
    let missing = cluster::wait_for_nodes(&s.spec, s.spec.wait);
    if !missing.is_empty() {
        eprintln!("{} not answering after {} s", missing.join(", "), args.wait);
    }
    if let Some(mut cfg) = args.gen.serve_config() {
        cfg.resume_retries = args.resume_retries;
        ringllm::serve::serve_ring(&model, s.spec.clone(), &cfg)?;
        return Ok(ExitCode::SUCCESS);
    }
    let spec = s.spec.clone();
    let retries = args.resume_retries;
    super::run::session(
        &|| {
            let mut e = Engine::load_ring(&model, spec.clone())?;
            e.resume_retries = retries;
            Ok(e)
        },
        &model.model,
        &args.sampling,
        &args.gen,
    )
}
