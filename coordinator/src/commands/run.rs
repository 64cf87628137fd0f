//! `ringllm run`: complete a prompt, or chat.

use crate::cli::{GenArgs, RunArgs, SamplingArgs};
use anyhow::{anyhow, bail, Context, Result};
use ringllm::engine::{generate, Engine, Generation, ModelOptions};
use ringllm::text::sampler::{Sampler, SamplerParams};
use std::io::{IsTerminal, Read};
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

pub fn run(args: RunArgs) -> Result<ExitCode> {
    let model = ModelOptions::from(&args.model);
    let skip = ringllm::skip::SkipOptions::from(&args.skip);
    if let Some(cfg) = args.gen.serve_config() {
        if skip.setting != ringllm::skip::SkipSetting::Off {
            bail!("--skip is not available with --serve yet");
        }
        ringllm::serve::serve_local(&model, &cfg)?;
        return Ok(ExitCode::SUCCESS);
    }
    session(
        &|| {
            let mut e = Engine::load(&model)?;
            ringllm::skip::apply(&mut e.runner, &skip, &model.model)?;
            Ok(e)
        },
        &model.model,
        &args.sampling,
        &args.gen,
    )
}

/// Runs a prompt or a chat on an engine built by `load` (one process, or a ring).
pub fn session(
    load: &dyn Fn() -> Result<Engine>,
    model: &Path,
    sampling: &SamplingArgs,
    gen: &GenArgs,
) -> Result<ExitCode> {
    let args = Args {
        model,
        sampling,
        gen,
    };
    if args.gen.chat {
        return super::chat::chat(args.model, args.sampling, args.gen, load);
    }
    if args.gen.serve.serve.is_some() {
        bail!("internal: --serve is handled before a session starts");
    }
    let prompt = match &args.gen.prompt {
        Some(p) => p.clone(),
        None => {
            if std::io::stdin().is_terminal() {
                eprintln!(
                    "[reading the prompt from stdin until Ctrl-D; give one with -p TEXT, or chat \
                     with --chat]"
                );
            }
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the prompt from stdin")?;
            s
        }
    };
    let mut engine = load()?;
    if args.gen.step_logits_out.is_some() {
        engine.step_logits = Some(Vec::new());
    }
    let add_bos = engine.tokenizer.add_bos_default();
    let ids = engine.tokenizer.encode(&prompt, add_bos)?;
    let mut sampler = Sampler::new(&SamplerParams::from(args.sampling));
    let cancel = Arc::new(AtomicBool::new(false));
    install_ctrlc(Arc::clone(&cancel), None)?;
    let json = args.gen.json;
    // A reader that goes away (`| head -c 100`) stops the generation.
    let closed = AtomicBool::new(false);
    let mut on_text = |t: &str| {
        if !json && !closed.load(Ordering::SeqCst) && !crate::out::stream(t) {
            closed.store(true, Ordering::SeqCst);
            cancel.store(true, Ordering::SeqCst);
        }
    };
    let g = generate(
        &mut engine,
        &ids,
        args.gen.n_predict,
        &mut sampler,
        &args.gen.stop,
        &cancel,
        &mut on_text,
    )?;
    if json {
        outln!("{}", serde_json::to_string(&g)?);
    } else if !closed.load(Ordering::SeqCst) {
        outln!();
    }
    report(&engine, &g);
    if let Some(path) = &args.gen.logits_out {
        write_logits(path, engine.logits())?;
    }
    if let (Some(path), Some(rows)) = (&args.gen.step_logits_out, &engine.step_logits) {
        write_logits(path, rows)?;
    }
    engine.close();
    Ok(ExitCode::SUCCESS)
}

/// What a session was asked for.
struct Args<'a> {
    model: &'a Path,
    sampling: &'a SamplingArgs,
    gen: &'a GenArgs,
}

fn write_logits(path: &std::path::Path, logits: &[f32]) -> Result<()> {
    let mut bytes = Vec::with_capacity(logits.len() * 4);
    for v in logits {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

fn report(engine: &Engine, g: &Generation) {
    if g.context_full {
        eprintln!(
            "[stopped: the context of {} tokens is full (finish reason \"length\"); raise --ctx]",
            engine.ctx
        );
    }
    eprintln!(
        "load {:.2} s | prompt {} tokens, {:.1} tok/s | generated {} tokens, {:.1} tok/s | finish: {:?}",
        engine.load_seconds,
        g.prefill_tokens,
        g.prefill_tokens_per_s,
        g.token_ids.len(),
        g.decode_tokens_per_s,
        g.finish_reason
    );
    if g.resumed > 0 {
        eprintln!(
            "resumed {} time(s) after a lost node: {:.0} ms of pause",
            g.resumed, g.resume_ms
        );
    }
    if let Some(st) = &engine.runner.model.streamer {
        let s = st.stats();
        let n = (g.prefill_tokens.min(1) + g.token_ids.len()).max(1) as f64;
        eprintln!(
            "streamed {} layers from disk: {:.1} MiB read per forward pass, {:.1} ms per pass stalled on \
             I/O, {} read-ahead restarts, {} layers skipped unread",
            st.layers().len(),
            s.bytes_read as f64 / n / 1048576.0,
            s.stall_s / n * 1e3,
            s.restarts,
            s.layers_skipped
        );
    }
    if let Some(st) = &engine.runner.model.experts {
        let s = st.stats();
        let n = (g.prefill_tokens.min(1) + g.token_ids.len()).max(1) as f64;
        eprintln!("{}", expert_line(&s, n));
    }
    if engine.runner.skip_policy().is_some() {
        eprintln!("{}", skip_line(&engine.runner.skip_stats()));
    }
}

/// `skipped: X% of layer evaluations …` for the commands that run with --skip.
pub fn skip_line(s: &ringllm_model::skip::SkipStats) -> String {
    format!(
        "skipped: {:.1}% of layer evaluations ({} of {}; {} whole layers not run, {:.2} MiB of \
         weights not read; {} computed although the predictor leaned to skipping)",
        100.0 * s.skip_fraction(),
        s.skipped,
        s.evaluations,
        s.layers_not_run,
        s.bytes_not_read as f64 / 1048576.0,
        s.doubted
    )
}

/// First Ctrl-C sets `cancel` (stop the current reply); a second one in a row exits, as
/// does one when `presses` is None.
pub(super) fn install_ctrlc(
    cancel: Arc<AtomicBool>,
    presses: Option<Arc<AtomicUsize>>,
) -> Result<()> {
    ctrlc::set_handler(move || {
        let n = presses
            .as_ref()
            .map_or(2, |p| p.fetch_add(1, Ordering::SeqCst) + 1);
        if n >= 2 || cancel.load(Ordering::SeqCst) {
            eprintln!();
            std::process::exit(130);
        }
        cancel.store(true, Ordering::SeqCst);
    })
    .map_err(|e| anyhow!("cannot install the Ctrl-C handler: {e}"))
}

/// What the expert store did over `passes` forward passes.
pub(crate) fn expert_line(s: &ringllm_model::stream::ExpertStats, passes: f64) -> String {
    format!(
        "streamed experts: {:.1} MiB read per forward pass, hit rate {:.1}% ({} of {} used experts \
         cached), {} read ahead by prediction (accuracy {:.1}%, {} reads wasted), {:.1} ms per pass \
         stalled on I/O",
        s.bytes_read as f64 / passes / 1048576.0,
        100.0 * s.hit_rate(),
        s.hits,
        s.used,
        s.prefetched,
        100.0 * s.prediction_accuracy(),
        s.wasted_reads,
        s.stall_s / passes * 1e3
    )
}
