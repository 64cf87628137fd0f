//! `--chat` on `run` and `up`: the conversation REPL. On a terminal, lines are edited and
//! remembered with rustyline (history in `$XDG_STATE_HOME/ringllm/history`, else
//! `~/.local/state/ringllm/history`); otherwise plain lines are read from stdin, so a script
//! can pipe a conversation in. Replies go to stdout, one line break after each; notes and the
//! `/help` text go to stderr.

mod view;

use super::run::install_ctrlc;
use crate::cli::{GenArgs, SamplingArgs};
use anyhow::{anyhow, Context, Result};
use ringllm::engine::{generate, Engine, FinishReason};
use ringllm::text::chat::{fit_context, parse_input, reply_reserve, Input, HELP};
use ringllm::text::harmony::is_harmony;
use ringllm::text::resolve_chat_template;
use ringllm::text::sampler::{Sampler, SamplerParams};
use ringllm::text::template::{ChatTemplate, Message, TemplateVars};
use std::io::{BufRead, IsTerminal};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Where lines come from.
enum Lines {
    /// A terminal on stdin and stdout: rustyline, with history when it has a file.
    Editor {
        ed: Box<rustyline::DefaultEditor>,
        history: Option<PathBuf>,
        /// The last read ended with Ctrl-C.
        interrupted: bool,
    },
    /// Plain lines; `prompt` when stdin is a terminal (the prompt then goes to stderr).
    Plain {
        lines: std::io::Lines<std::io::StdinLock<'static>>,
        prompt: bool,
    },
}

enum Read {
    Line(String),
    /// Ctrl-C at the prompt (the editor only).
    Interrupted,
    End,
}

/// The history file: `$XDG_STATE_HOME/ringllm/history`, else `~/.local/state/ringllm/history`.
fn history_path() -> Option<PathBuf> {
    let base = match std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(std::env::var_os("HOME").filter(|v| !v.is_empty())?).join(".local/state")
        }
    };
    Some(base.join("ringllm").join("history"))
}

impl Lines {
    fn open() -> Lines {
        let plain = |prompt| Lines::Plain {
            lines: std::io::stdin().lock().lines(),
            prompt,
        };
        let stdin_tty = std::io::stdin().is_terminal();
        if !(stdin_tty && std::io::stdout().is_terminal()) {
            return plain(stdin_tty);
        }
        let config = rustyline::Config::builder()
            .auto_add_history(true)
            .history_ignore_space(true);
        let config = match config.max_history_size(1000) {
            Ok(c) => c.history_ignore_dups(true).map(|c| c.build()),
            Err(e) => Err(e),
        };
        let ed = config.and_then(rustyline::DefaultEditor::with_config);
        let mut ed = match ed {
            Ok(ed) => ed,
            Err(e) => {
                eprintln!("[no line editing: {e}]");
                return plain(true);
            }
        };
        let history = history_path().filter(|p| {
            let dir_ok = p
                .parent()
                .is_some_and(|d| std::fs::create_dir_all(d).is_ok());
            if !dir_ok {
                tracing::warn!(
                    "no chat history: cannot create the directory of {}",
                    p.display()
                );
            }
            dir_ok
        });
        if let Some(p) = &history {
            if p.exists() {
                if let Err(e) = ed.load_history(p) {
                    eprintln!("[cannot read the history {}: {e}]", p.display());
                }
            }
        }
        Lines::Editor {
            ed: Box::new(ed),
            history,
            interrupted: false,
        }
    }

    fn interactive(&self) -> bool {
        match self {
            Lines::Editor { .. } => true,
            Lines::Plain { prompt, .. } => *prompt,
        }
    }

    fn read(&mut self) -> Result<Read> {
        match self {
            Lines::Plain { lines, prompt } => {
                if *prompt {
                    eprint!("> ");
                }
                match lines.next() {
                    Some(l) => Ok(Read::Line(l.context("reading stdin")?)),
                    None => Ok(Read::End),
                }
            }
            Lines::Editor {
                ed,
                history,
                interrupted,
            } => match ed.readline("> ") {
                Ok(l) => {
                    *interrupted = false;
                    if let Some(p) = history.as_ref() {
                        // Each line is kept as it is typed: a crash loses none.
                        if let Err(e) = ed.append_history(p) {
                            tracing::warn!("cannot write the history {}: {e}", p.display());
                            *history = None;
                        }
                    }
                    Ok(Read::Line(l))
                }
                Err(rustyline::error::ReadlineError::Interrupted) => {
                    if std::mem::replace(interrupted, true) {
                        Ok(Read::End)
                    } else {
                        Ok(Read::Interrupted)
                    }
                }
                Err(rustyline::error::ReadlineError::Eof) => Ok(Read::End),
                Err(e) => Err(anyhow!("reading the terminal: {e}")),
            },
        }
    }
}

/// The conversation's start: the system prompt alone, or nothing.
fn fresh(system: &Option<String>) -> Vec<Message> {
    system
        .iter()
        .map(|s| Message::new("system", s.clone()))
        .collect()
}

/// The prompt tokens of `messages`. Messages are text: `<|im_start|>` typed in one stays
/// characters; only the template's markup yields control tokens. The template writes BOS
/// itself where the model wants one.
fn encode(
    engine: &Engine,
    template: &ChatTemplate,
    vars: &TemplateVars,
    messages: &[Message],
) -> Result<Vec<u32>> {
    let tok = &engine.tokenizer;
    let rendered = template.render_pieces_with(messages, true, vars, &|c| tok.control_spans(c))?;
    Ok(tok.encode_pieces(&rendered.pieces(), false)?)
}

/// The chat template's variables from the command line.
fn vars(gen: &GenArgs) -> TemplateVars {
    TemplateVars {
        reasoning_effort: gen.reasoning_effort.clone(),
        ..TemplateVars::default()
    }
}

/// Chats on an engine built by `load` (one process, or a ring).
pub fn chat(
    model: &Path,
    sampling: &SamplingArgs,
    gen: &GenArgs,
    load: &dyn Fn() -> Result<Engine>,
) -> Result<ExitCode> {
    let mut engine = load()?;
    let template = chat_template(model, gen, &engine)?;
    let mut sampler = Sampler::new(&SamplerParams::from(sampling));
    let cancel = Arc::new(AtomicBool::new(false));
    let presses = Arc::new(AtomicUsize::new(0));
    install_ctrlc(Arc::clone(&cancel), Some(Arc::clone(&presses)))?;
    let mut system = gen.system.clone();
    let mut messages = fresh(&system);
    let mut lines = Lines::open();
    if lines.interactive() {
        eprintln!(
            "[chat: type a message and Enter; /help lists the commands; Ctrl-C stops a reply, \
             Ctrl-D ends (or /bye)]"
        );
    }
    let closed = AtomicBool::new(false);
    loop {
        presses.store(0, Ordering::SeqCst);
        let line = match lines.read()? {
            Read::Line(l) => l,
            Read::Interrupted => {
                eprintln!("[Ctrl-C again, Ctrl-D or /bye leaves]");
                continue;
            }
            Read::End => break,
        };
        let text = match command(parse_input(&line), &mut system, &mut messages, &mut engine) {
            Next::Send(t) => t,
            Next::Read => continue,
            Next::Leave => break,
        };
        if !add_user_message(&engine, &template, gen, &mut messages, text) {
            continue;
        }
        let ids = encode(&engine, &template, &vars(gen), &messages)?;
        tracing::info!("chat prompt: {} tokens", ids.len());
        cancel.store(false, Ordering::SeqCst);
        let mut view = view::ReplyView::new(is_harmony(&engine.tokenizer));
        let mut on_text = |t: &str| {
            if !view.show(t) {
                closed.store(true, Ordering::SeqCst);
                cancel.store(true, Ordering::SeqCst);
            }
        };
        if !ring_ready(&mut engine) {
            messages.pop();
            continue;
        }
        let g = match generate(
            &mut engine,
            &ids,
            gen.n_predict,
            &mut sampler,
            &gen.stop,
            &cancel,
            &mut on_text,
        ) {
            Ok(g) => g,
            Err(e) if engine.ring.is_some() => {
                outln!();
                eprintln!("error: {e:#}");
                messages.pop();
                eprintln!("[rebuilding the ring over the nodes still there]");
                if let Err(e) = engine.recover() {
                    eprintln!("error: {e:#}");
                    eprintln!("[the ring is down; send the message again to retry]");
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        if !view.end() || closed.load(Ordering::SeqCst) {
            break; // the reader of our output went away
        }
        outln!();
        if g.finish_reason == FinishReason::Cancelled {
            eprintln!("[reply stopped]");
        }
        if g.context_full {
            eprintln!(
                "[the reply filled the context of {} tokens; the oldest turns make room for the \
                 next message]",
                engine.ctx
            );
        }
        messages.push(Message::new(
            "assistant",
            view.answer().unwrap_or(&g.text).trim().to_string(),
        ));
    }
    engine.close();
    Ok(ExitCode::SUCCESS)
}

/// The chat template: `--template`, else the model's own; a note on the choice goes to
/// stderr.
fn chat_template(model: &Path, gen: &GenArgs, engine: &Engine) -> Result<ChatTemplate> {
    let (template, note) = resolve_chat_template(
        gen.template.as_deref(),
        &engine.spec,
        &engine.tokenizer,
        model,
        engine.runner.model.hp.arch,
    )?
    .ok_or_else(|| {
        anyhow!(
            "{} has no chat template; pick one with --template ({})",
            model.display(),
            ringllm::text::template::builtin_names().join(", ")
        )
    })?;
    if let Some(note) = note {
        eprintln!("[{note}]");
    }
    Ok(template)
}

/// What the chat loop does after a line.
enum Next {
    /// Send this message.
    Send(String),
    /// Read the next line (a command was handled, or the line was empty).
    Read,
    /// End the chat.
    Leave,
}

/// Carries out a command (`/help`, `/clear`, `/system`, …); a message is passed on to send.
fn command(
    input: Input,
    system: &mut Option<String>,
    messages: &mut Vec<Message>,
    engine: &mut Engine,
) -> Next {
    match input {
        Input::Message(t) => return Next::Send(t),
        Input::Nothing => {}
        Input::Help => eprintln!("{HELP}"),
        Input::Clear => {
            *messages = fresh(system);
            engine.reset();
            eprintln!("[conversation cleared]");
        }
        Input::System(None) => match system {
            Some(s) => eprintln!("[system prompt: {s}]"),
            None => eprintln!("[no system prompt of our own (the template's default)]"),
        },
        Input::System(Some(s)) => {
            *system = Some(s);
            *messages = fresh(system);
            engine.reset();
            eprintln!("[system prompt set; conversation cleared]");
        }
        Input::Bye => return Next::Leave,
        Input::Unknown(w) => eprintln!(
            "[unknown command {w}: /help lists the commands; //text sends a message starting \
             with '/']"
        ),
    }
    Next::Read
}

/// Appends the user's message, dropping the oldest turns so that the prompt leaves room for
/// the reply. False (the conversation as it was, the error reported) when it cannot fit.
fn add_user_message(
    engine: &Engine,
    template: &ChatTemplate,
    gen: &GenArgs,
    messages: &mut Vec<Message>,
    text: String,
) -> bool {
    let before = messages.clone();
    messages.push(Message::new("user", text));
    // Room for the prompt: the context less the reply's share; the oldest turns go first.
    let budget = engine
        .ctx
        .saturating_sub(reply_reserve(engine.ctx, gen.n_predict));
    let fitted = fit_context(messages, budget, &mut |ms| {
        encode(engine, template, &vars(gen), ms).map(|ids| ids.len())
    });
    match fitted {
        Ok(Ok(fit)) if fit.turns_dropped > 0 => eprintln!(
            "[context full: dropped the oldest {} turn(s) ({} messages) to fit {} of {} \
             tokens with room for the reply]",
            fit.turns_dropped, fit.messages_dropped, fit.tokens, engine.ctx
        ),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            eprintln!("error: {e}");
            *messages = before;
            return false;
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            *messages = before;
            return false;
        }
    }
    true
}

/// Rebuilds the ring if it went down since the last reply. False when it is still down
/// (reported).
fn ring_ready(engine: &mut Engine) -> bool {
    if engine.ring_down() {
        eprintln!("[rebuilding the ring]");
        if let Err(e) = engine.recover() {
            eprintln!("error: {e:#}");
            eprintln!("[the ring is still down; send the message again to retry]");
            return false;
        }
    }
    true
}
