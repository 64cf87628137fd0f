//! `ringllm run`: complete a prompt, or chat.

use crate::cli::RunArgs;
use crate::engine::{generate, sampler_params, Engine, FinishReason, Generation};
use anyhow::{anyhow, bail, Context, Result};
use ringllm::sampler::Sampler;
use ringllm::template::{builtin, ChatTemplate, Message};
use std::io::{BufRead, IsTerminal, Read, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

pub fn run(args: RunArgs) -> Result<ExitCode> {
    if args.chat {
        return chat(args);
    }
    let prompt = match &args.prompt {
        Some(p) => p.clone(),
        None => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the prompt from stdin")?;
            s
        }
    };
    let mut engine = Engine::load(&args.model)?;
    let add_bos = engine.tokenizer.add_bos_default();
    let ids = engine.tokenizer.encode(&prompt, add_bos)?;
    let mut sampler = Sampler::new(&sampler_params(&args.sampling));
    let cancel = Arc::new(AtomicBool::new(false));
    install_ctrlc(Arc::clone(&cancel), None)?;
    let stdout = std::io::stdout();
    let json = args.json;
    let mut on_text = |t: &str| {
        if !json {
            print_now(&stdout, t);
        }
    };
    let g = generate(
        &mut engine,
        &ids,
        args.n_predict,
        &mut sampler,
        &args.stop,
        &cancel,
        &mut on_text,
    )?;
    if json {
        println!("{}", serde_json::to_string(&g)?);
    } else {
        println!();
    }
    report(&engine, &g);
    Ok(ExitCode::SUCCESS)
}

/// Streams `t` to stdout at once (a closed pipe only ends the output, not the generation).
fn print_now(stdout: &std::io::Stdout, t: &str) {
    let mut o = stdout.lock();
    let _ = o.write_all(t.as_bytes());
    let _ = o.flush();
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
}

/// First Ctrl-C sets `cancel` (stop the current reply); a second one in a row exits, as
/// does one when `presses` is None.
fn install_ctrlc(cancel: Arc<AtomicBool>, presses: Option<Arc<AtomicUsize>>) -> Result<()> {
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

fn chat(args: RunArgs) -> Result<ExitCode> {
    let mut engine = Engine::load(&args.model)?;
    let source = match (&args.template, &engine.spec.chat_template) {
        (Some(name), _) => builtin(name)
            .ok_or_else(|| {
                anyhow!(
                    "unknown template '{name}' (built-in: {})",
                    ringllm::template::builtin_names().join(", ")
                )
            })?
            .to_string(),
        (None, Some(t)) => t.clone(),
        (None, None) => bail!(
            "{} has no chat template; pick one with --template ({})",
            args.model.model.display(),
            ringllm::template::builtin_names().join(", ")
        ),
    };
    let bos = engine
        .tokenizer
        .bos()
        .and_then(|id| engine.tokenizer.id_to_piece(id))
        .unwrap_or("")
        .to_string();
    let eos = engine
        .spec
        .eos
        .and_then(|id| engine.tokenizer.id_to_piece(id))
        .unwrap_or("")
        .to_string();
    let template = ChatTemplate::new(&source, &bos, &eos)?;
    let mut sampler = Sampler::new(&sampler_params(&args.sampling));
    let cancel = Arc::new(AtomicBool::new(false));
    let presses = Arc::new(AtomicUsize::new(0));
    install_ctrlc(Arc::clone(&cancel), Some(Arc::clone(&presses)))?;
    let mut messages: Vec<Message> = Vec::new();
    if let Some(s) = &args.system {
        messages.push(Message {
            role: "system".into(),
            content: s.clone(),
        });
    }
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    let mut lines = stdin.lock().lines();
    let stdout = std::io::stdout();
    loop {
        if interactive {
            eprint!("> ");
        }
        presses.store(0, Ordering::SeqCst);
        let Some(line) = lines.next() else { break }; // Ctrl-D
        let line = line.context("reading stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        messages.push(Message {
            role: "user".into(),
            content: line,
        });
        let text = template.render(&messages, true)?;
        // The template writes BOS itself where the model wants one.
        let ids = engine.tokenizer.encode(&text, false)?;
        cancel.store(false, Ordering::SeqCst);
        let mut on_text = |t: &str| print_now(&stdout, t);
        let g = generate(
            &mut engine,
            &ids,
            args.n_predict,
            &mut sampler,
            &args.stop,
            &cancel,
            &mut on_text,
        )?;
        println!();
        if g.finish_reason == FinishReason::Cancelled {
            eprintln!("[reply stopped]");
        }
        if g.context_full {
            eprintln!("[the context is full; starting over]");
            engine.reset();
            messages.clear();
            continue;
        }
        messages.push(Message {
            role: "assistant".into(),
            content: g.text.trim().to_string(),
        });
    }
    Ok(ExitCode::SUCCESS)
}
