//! From a checked request to the backend and back: tokenizing the prompt, submitting it
//! (with the guard that cancels it when the client goes away), and answering whole or as
//! server-sent events.

use super::openai::{self, Params};
use super::{ApiError, AppState, Shared};
use crate::serve::{GenEvent, GenRequest};
use crate::text::tokenizer::Piece;
use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub(super) enum Prompt {
    /// Messages for the chat template, with its variables.
    Chat(
        Vec<crate::text::template::Message>,
        crate::text::template::TemplateVars,
    ),
    /// Messages for the chat template, and the start of the assistant's answer (Anthropic's
    /// prefill: a conversation ending with an assistant turn), written as plain text after the
    /// template's generation prompt; the model continues from it.
    Prefilled(
        Vec<crate::text::template::Message>,
        crate::text::template::TemplateVars,
        String,
    ),
    /// A raw prompt; `special`: its special-token texts are control tokens (`parse_special`).
    Text {
        text: String,
        special: bool,
    },
    Tokens(Vec<u32>),
}

/// Renders and tokenizes off the async workers (a long prompt takes milliseconds).
pub(super) async fn tokenize(s: &Shared, prompt: Prompt) -> Result<Vec<u32>, ApiError> {
    let s = Arc::clone(s);
    let ids = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
        let b = &s.backend;
        let tok = b.tokenizer();
        let encode = |pieces: &[Piece<'_>], bos: bool| {
            tok.encode_pieces(pieces, bos)
                .map_err(|e| ApiError::server(format!("cannot tokenize the prompt: {e}")))
        };
        match prompt {
            Prompt::Chat(messages, vars) => chat_prompt(&s, &messages, &vars, ""),
            Prompt::Prefilled(messages, vars, prefill) => {
                chat_prompt(&s, &messages, &vars, &prefill)
            }
            Prompt::Text { text, special } => {
                let piece = if special {
                    Piece::special(&text)
                } else {
                    Piece::text(&text)
                };
                encode(&[piece], b.add_bos())
            }
            Prompt::Tokens(ids) => {
                let vocab = tok.vocab_size();
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(ApiError::invalid(format!(
                        "token id {bad} is outside the vocabulary (0..{vocab})"
                    ))
                    .param("prompt"));
                }
                Ok(ids)
            }
        }
    })
    .await
    .map_err(|e| ApiError::server(format!("tokenizing failed: {e}")))??;
    if ids.is_empty() {
        return Err(ApiError::invalid("the prompt is empty").param("prompt"));
    }
    Ok(ids)
}

/// A conversation through the model's chat template, then `prefill` as plain text.
fn chat_prompt(
    s: &AppState,
    messages: &[crate::text::template::Message],
    vars: &crate::text::template::TemplateVars,
    prefill: &str,
) -> Result<Vec<u32>, ApiError> {
    let b = &s.backend;
    let tok = b.tokenizer();
    let Some(t) = b.template() else {
        return Err(ApiError::invalid(format!(
            "the model `{}` has no chat template: use /v1/completions, or start \
             the server with --template NAME (built-in: {})",
            b.model_id(),
            crate::text::template::builtin_names().join(", ")
        ))
        .param("messages")
        .code("no_chat_template"));
    };
    // Message contents are text: only the template's markup yields control tokens.
    let r = t
        .render_pieces_with(messages, true, vars, &|c| tok.control_spans(c))
        .map_err(|e| ApiError::invalid(e.to_string()).param("messages"))?;
    let mut pieces = r.pieces();
    if !prefill.is_empty() {
        pieces.push(Piece::text(prefill));
    }
    // Templates write BOS themselves.
    tok.encode_pieces(&pieces, false)
        .map_err(|e| ApiError::server(format!("cannot tokenize the prompt: {e}")))
}

/// Sets the request's cancel flag when dropped before `disarm`: the client went away.
pub(crate) struct CancelOnDrop {
    flag: Arc<AtomicBool>,
    armed: bool,
}

impl CancelOnDrop {
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Ordering::SeqCst);
        }
    }
}

/// A request handed to the backend: its events, and the guard that cancels it when dropped.
pub(super) struct Submitted {
    pub(super) rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    pub(super) guard: CancelOnDrop,
}

impl Submitted {
    /// The first event of a streamed request: the status waits for it, so a request that
    /// fails before its first token gets a real error status, not a 200 with an error inside.
    pub(super) async fn first(&mut self) -> Result<GenEvent, ApiError> {
        match self.rx.recv().await {
            Some(GenEvent::Error {
                message,
                retry_after_s,
            }) => {
                self.guard.disarm();
                Err(ApiError::engine(message, retry_after_s))
            }
            None => {
                self.guard.disarm();
                Err(stopped())
            }
            Some(e) => Ok(e),
        }
    }
}

/// Compiles the request's grammar, if any, off the async workers (the first one builds the
/// model's grammar vocabulary); one that cannot be compiled is a 400 naming what.
pub(super) async fn constraint(
    s: &Shared,
    p: &Params,
) -> Result<Option<Box<crate::text::grammar::Constraint>>, ApiError> {
    let Some((mut spec, param)) = p.grammar.clone() else {
        return Ok(None);
    };
    // Tool grammars are written for the model's format already (harmony's included).
    if param != "tools" && crate::text::harmony::is_harmony(s.backend.tokenizer()) {
        spec = spec.after_harmony_analysis();
    }
    let st = Arc::clone(s);
    let r = tokio::task::spawn_blocking(move || {
        st.backend
            .grammars()
            .map_err(ApiError::server)?
            .compile(&spec)
            .map(Box::new)
            .map_err(|e| {
                ApiError::invalid(format!("`{param}` cannot be used: {e}"))
                    .param(param)
                    .code("invalid_grammar")
            })
    })
    .await
    .map_err(|e| ApiError::server(format!("compiling the grammar failed: {e}")))?;
    r.map(Some)
}

/// Checks the prompt against the context and submits it (with its compiled grammar).
pub(super) fn submit(
    s: &AppState,
    p: &Params,
    prompt: Vec<u32>,
    constraint: Option<Box<crate::text::grammar::Constraint>>,
) -> Result<Submitted, ApiError> {
    let ctx = s.backend.ctx();
    if prompt.len() >= ctx {
        return Err(ApiError::invalid(format!(
            "this model's context holds {ctx} tokens, but the prompt has {} tokens \
             (and at least one must be left to generate)",
            prompt.len()
        ))
        .param(p.kind.prompt_param())
        .code("context_length_exceeded"));
    }
    let room = ctx - prompt.len();
    let max_tokens = p.max_tokens.map_or(room, |m| m.min(room as u64) as usize);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let req = GenRequest {
        prompt,
        max_tokens,
        sampling: p.sampling.clone(),
        stop: p.stop.clone(),
        logprobs: p.logprobs,
        events: tx,
        cancel: Arc::clone(&cancel),
        constraint,
    };
    s.backend.submit(req)?;
    Ok(Submitted {
        rx,
        guard: CancelOnDrop {
            flag: cancel,
            armed: true,
        },
    })
}

/// Submits and answers in OpenAI's shape (whole or streamed).
pub(super) async fn generate(
    s: &Shared,
    p: Params,
    prompt: Vec<u32>,
    tools: Option<crate::text::tools::ToolFormat>,
) -> Result<Response, ApiError> {
    let constraint = constraint(s, &p).await?;
    let mut sub = submit(s, &p, prompt, constraint)?;
    let reply = openai::Reply::new(&p, s.backend.model_id())
        .harmony(crate::text::harmony::is_harmony(s.backend.tokenizer()))
        .tools(tools);
    if p.stream {
        let first = sub.first().await?;
        let body = Body::from_stream(openai::sse(reply, Some(first), sub.rx, sub.guard));
        let headers = [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ];
        return Ok((headers, body).into_response());
    }
    let done = collect(sub.rx, sub.guard).await?;
    Ok(Json(reply.whole(&done)).into_response())
}

/// A finished request, gathered from its events.
pub(crate) struct Collected {
    pub text: String,
    /// Each token's log-probabilities with the character offset of its text.
    pub logprobs: Vec<(crate::serve::TokenLogprob, usize)>,
    pub finish: crate::serve::Finish,
    /// The stop string that ended the text, if one did.
    pub stop_sequence: Option<String>,
    pub usage: openai::Usage,
    /// When the first token arrived (Ollama's `prompt_eval_duration` ends there).
    pub first_token: Option<std::time::Instant>,
}

/// Waits for the end of a non-streamed request. Dropping this future (the client went away)
/// drops `guard`, which cancels the request.
pub(super) async fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    mut guard: CancelOnDrop,
) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut chars = 0;
    let mut logprobs = Vec::new();
    let mut first_token = None;
    loop {
        match rx.recv().await {
            Some(GenEvent::Token {
                text: t, logprob, ..
            }) => {
                first_token.get_or_insert_with(std::time::Instant::now);
                if let Some(lp) = logprob {
                    logprobs.push((lp, chars));
                }
                chars += t.chars().count();
                text.push_str(&t);
            }
            Some(GenEvent::Done {
                finish,
                text: t,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                resume,
                stop_sequence,
            }) => {
                guard.disarm();
                text.push_str(&t);
                return Ok(Collected {
                    text,
                    logprobs,
                    finish,
                    stop_sequence,
                    usage: openai::Usage {
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                        resume,
                    },
                    first_token,
                });
            }
            Some(GenEvent::Error {
                message,
                retry_after_s,
            }) => {
                guard.disarm();
                return Err(ApiError::engine(message, retry_after_s));
            }
            None => {
                guard.disarm();
                return Err(stopped());
            }
        }
    }
}

pub(super) fn stopped() -> ApiError {
    ApiError::server("the engine stopped before finishing the request")
}
