//! Unit tests of the HTTP layer alone: a scripted stand-in `Backend` answers every request
//! with fixed events, and a plain HTTP/1.1 client over `TcpStream` talks to a real listener on
//! 127.0.0.1:0. The real scheduler and engine behind this API are tested end to end in
//! tests/python/test_serve.py (with the `openai` client).

use super::{router, run, ServeOptions};
use crate::cluster::status::ClusterView;
use crate::serve::{
    Backend, Finish, GenEvent, GenRequest, Health, Metrics, Sampling, SubmitError, TokenLogprob,
    TopLogprob,
};
use crate::text::template::{ChatTemplate, Message};
use crate::text::tokenizer::{Tokenizer, TokenizerSpec};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

const MODEL_ID: &str = "smollm2-135m-instruct-q4_1";

struct Vocab {
    tok: Arc<Tokenizer>,
    template: ChatTemplate,
    /// The grammar compiler over `tok`, built by the first constrained request.
    grammars: OnceLock<Result<crate::text::grammar::Grammars, String>>,
}

/// The tokenizer and chat template of a real model file (read once per test binary).
fn vocab() -> &'static Vocab {
    static V: OnceLock<Vocab> = OnceLock::new();
    V.get_or_init(|| {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/smollm2-135m-instruct-q4_1.gguf");
        let file = ringllm_model::gguf::GgufFile::open(&path)
            .unwrap_or_else(|e| panic!("{} (scripts/fetch-models): {e}", path.display()));
        let spec = TokenizerSpec::from_gguf(file.metadata()).expect("tokenizer metadata");
        let tok = Tokenizer::new(&spec).expect("tokenizer");
        let piece = |id: Option<u32>| {
            id.and_then(|i| tok.id_to_piece(i))
                .unwrap_or("")
                .to_string()
        };
        let source = spec
            .chat_template
            .as_deref()
            .expect("SmolLM2 has a chat template");
        let template =
            ChatTemplate::new(source, &piece(tok.bos()), &piece(spec.eos)).expect("template");
        Vocab {
            tok: Arc::new(tok),
            template,
            grammars: OnceLock::new(),
        }
    })
}

/// The date gpt-oss's template is rendered with (2026-03-09, as in the harmony fixture).
const PINNED_TIME: i64 = 1_773_068_645;

/// The synthetic gpt-oss vocabulary (o200k-shaped, harmony specials) with gpt-oss's own chat
/// template, the date pinned.
fn gpt_oss_vocab() -> &'static Vocab {
    static V: OnceLock<Vocab> = OnceLock::new();
    V.get_or_init(|| {
        use ringllm_model::synth::{tokenizer_gguf, SynthArch};
        let (kind, n) = SynthArch::GptOss.small_vocab();
        let file = ringllm_model::gguf::GgufFile::from_bytes(tokenizer_gguf(kind, n))
            .expect("synthetic GGUF");
        let spec = TokenizerSpec::from_gguf(file.metadata()).expect("tokenizer metadata");
        let tok = Tokenizer::new(&spec).expect("tokenizer");
        let source = spec.chat_template.as_deref().expect("gpt-oss's template");
        let mut template =
            ChatTemplate::new(source, "<|startoftext|>", "<|return|>").expect("template");
        template.pin_time(PINNED_TIME);
        Vocab {
            tok: Arc::new(tok),
            template,
            grammars: OnceLock::new(),
        }
    })
}

/// What the stand-in backend does with a request.
#[derive(Clone)]
enum Script {
    /// Sends these events at once (a `Done` with `prompt_tokens` 0 gets the prompt's length).
    Events(Vec<GenEvent>),
    /// A token every 10 ms until cancelled; on shutdown, `Done` with `Cancelled`.
    Trickle,
    /// Never answers (until shutdown).
    Silent,
    /// Refuses: every slot busy.
    Full,
}

/// A request as the backend saw it.
struct Seen {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: Sampling,
    stop: Vec<String>,
    logprobs: Option<usize>,
    /// Whether the request came with a compiled grammar.
    constrained: bool,
    cancel: Arc<AtomicBool>,
}

struct Scripted {
    script: Script,
    ctx: usize,
    has_template: bool,
    seen: Mutex<Vec<Seen>>,
    /// Senders of `Silent` requests, kept open.
    open: Mutex<Vec<UnboundedSender<GenEvent>>>,
    shut: Arc<AtomicBool>,
    /// What `health` answers (`None`: the trait's default).
    health: Option<Health>,
    /// What `cluster` answers (`None`: one machine).
    cluster: Option<ClusterView>,
    /// The model's tokenizer and template.
    vocab: fn() -> &'static Vocab,
}

impl Scripted {
    fn new(script: Script) -> Scripted {
        Scripted {
            script,
            ctx: 256,
            has_template: true,
            seen: Mutex::new(Vec::new()),
            open: Mutex::new(Vec::new()),
            shut: Arc::new(AtomicBool::new(false)),
            health: None,
            cluster: None,
            vocab,
        }
    }

    /// A gpt-oss model (its vocabulary and template) instead of SmolLM2.
    fn gpt_oss(mut self) -> Scripted {
        self.vocab = gpt_oss_vocab;
        self
    }

    fn cluster(mut self, c: ClusterView) -> Scripted {
        self.cluster = Some(c);
        self
    }

    fn health(mut self, h: Health) -> Scripted {
        self.health = Some(h);
        self
    }

    fn ctx(mut self, ctx: usize) -> Scripted {
        self.ctx = ctx;
        self
    }

    fn seen<R>(&self, f: impl FnOnce(&[Seen]) -> R) -> R {
        f(&self.seen.lock().unwrap())
    }

    /// Waits until the `i`th request's cancel flag is set.
    fn wait_cancelled(&self, i: usize) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let set = self.seen(|s| s.get(i).is_some_and(|r| r.cancel.load(Ordering::SeqCst)));
            if set {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }
}

fn cancelled_done() -> GenEvent {
    GenEvent::Done {
        finish: Finish::Cancelled,
        text: String::new(),
        prompt_tokens: 1,
        completion_tokens: 1,
        cached_tokens: 0,
        resume: Default::default(),
        stop_sequence: None,
    }
}

impl Backend for Scripted {
    fn grammars(&self) -> Result<&crate::text::grammar::Grammars, String> {
        let v = (self.vocab)();
        v.grammars
            .get_or_init(|| {
                crate::text::grammar::Grammars::new(&v.tok, v.tok.vocab_size())
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    fn submit(&self, req: GenRequest) -> Result<(), SubmitError> {
        if self.shut.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        if let Script::Full = self.script {
            return Err(SubmitError::QueueFull { retry_after_s: 3 });
        }
        self.seen.lock().unwrap().push(Seen {
            prompt: req.prompt.clone(),
            max_tokens: req.max_tokens,
            sampling: req.sampling.clone(),
            stop: req.stop.clone(),
            logprobs: req.logprobs,
            constrained: req.constraint.is_some(),
            cancel: Arc::clone(&req.cancel),
        });
        match &self.script {
            Script::Events(events) => {
                for e in events {
                    let e = match e.clone() {
                        GenEvent::Done {
                            finish,
                            text,
                            prompt_tokens: 0,
                            completion_tokens,
                            cached_tokens,
                            resume,
                            stop_sequence,
                        } => GenEvent::Done {
                            finish,
                            text,
                            prompt_tokens: req.prompt.len(),
                            completion_tokens,
                            cached_tokens,
                            resume,
                            stop_sequence,
                        },
                        e => e,
                    };
                    let _ = req.events.send(e);
                }
            }
            Script::Trickle => {
                let shut = Arc::clone(&self.shut);
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        if req.cancel.load(Ordering::SeqCst) {
                            return;
                        }
                        if shut.load(Ordering::SeqCst) {
                            let _ = req.events.send(cancelled_done());
                            return;
                        }
                        let _ = req.events.send(token("x"));
                        std::thread::sleep(Duration::from_millis(10));
                    }
                });
            }
            Script::Silent => self.open.lock().unwrap().push(req.events),
            Script::Full => unreachable!(),
        }
        Ok(())
    }

    fn model_id(&self) -> String {
        MODEL_ID.into()
    }

    fn tokenizer(&self) -> &Tokenizer {
        &(self.vocab)().tok
    }

    fn template(&self) -> Option<&ChatTemplate> {
        self.has_template.then(|| &(self.vocab)().template)
    }

    fn add_bos(&self) -> bool {
        (self.vocab)().tok.add_bos_default()
    }

    fn ctx(&self) -> usize {
        self.ctx
    }

    fn metrics(&self) -> Metrics {
        Metrics {
            requests_total: 7,
            requests_failed: 1,
            prompt_tokens_total: 70,
            completion_tokens_total: 35,
            queue_depth: 2,
            slots_total: 4,
            slots_busy: 3,
            decode_tokens_per_s: 12.5,
            node_latency_ms: vec![("node-a".into(), 1.5), ("b\"1".into(), 0.25)],
            ..Default::default()
        }
    }

    fn health(&self) -> Health {
        self.health.clone().unwrap_or_else(Health::ready)
    }

    fn cluster(&self) -> Option<ClusterView> {
        self.cluster.clone()
    }

    fn shutdown(&self) {
        self.shut.store(true, Ordering::SeqCst);
        for tx in self.open.lock().unwrap().drain(..) {
            let _ = tx.send(cancelled_done());
        }
    }
}

fn token(text: &str) -> GenEvent {
    GenEvent::Token {
        id: 1,
        text: text.into(),
        logprob: None,
    }
}

fn done(finish: Finish, completion_tokens: usize) -> GenEvent {
    GenEvent::Done {
        finish,
        text: String::new(),
        prompt_tokens: 0,
        completion_tokens,
        cached_tokens: 0,
        resume: Default::default(),
        stop_sequence: None,
    }
}

/// A server on 127.0.0.1:0 in its own runtime.
struct Server {
    addr: SocketAddr,
    backend: Arc<Scripted>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    rt: Option<tokio::runtime::Runtime>,
}

fn start(backend: Scripted, api_key: Option<&str>) -> Server {
    let opts = ServeOptions {
        api_key: api_key.map(str::to_string),
        ..ServeOptions::default()
    };
    start_with(backend, opts)
}

fn start_with(backend: Scripted, opts: ServeOptions) -> Server {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let backend = Arc::new(backend);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let dyn_backend: Arc<dyn Backend> = backend.clone();
    let task = rt.spawn(run(listener, dyn_backend, opts, async move {
        let _ = stopped.await;
    }));
    Server {
        addr,
        backend,
        stop: Some(stop),
        task: Some(task),
        rt: Some(rt),
    }
}

impl Server {
    /// Signals shutdown and waits for `run` to return.
    fn shutdown(&mut self) -> anyhow::Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let task = self.task.take().expect("running");
        let rt = self.rt.as_ref().expect("runtime");
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(15), task).await })
            .expect("run returns within the drain bound")
            .expect("no panic")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// The SSE events' data, checking the framing.
    fn events(&self) -> Vec<String> {
        assert!(self.body.ends_with("\n\n"), "{:?}", self.body);
        self.body
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                e.strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("not an SSE data line: {e:?}"))
                    .to_string()
            })
            .collect()
    }

    /// The JSON chunks before `[DONE]` (which must be last).
    fn chunks(&self) -> Vec<Value> {
        let mut events = self.events();
        assert_eq!(events.pop().as_deref(), Some("[DONE]"), "{:?}", self.body);
        events
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    }

    /// An OpenAI-style error with this status; its `error` object.
    fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", self.body);
        let v = self.json();
        let e = v["error"].clone();
        assert!(e["message"].is_string(), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
        e
    }
}

/// The request's bytes, without a body framing of its own.
fn raw_request(method: &str, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req += "Host: 127.0.0.1\r\n";
    }
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    if let Some(b) = body {
        req += &format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        );
    }
    req += "\r\n";
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body.unwrap_or_default());
    bytes
}

fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(&raw_request(method, path, headers, body))
        .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    parse(&raw)
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    send(addr, "POST", path, &[], Some(body.to_string().as_bytes()))
}

fn get(addr: SocketAddr, path: &str) -> Resp {
    send(addr, "GET", path, &[], None)
}

fn parse(raw: &[u8]) -> Resp {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of headers");
    let head = std::str::from_utf8(&raw[..split]).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_ascii_lowercase(), v.trim().to_string())
        })
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Resp {
        status,
        headers,
        body: String::from_utf8(body).unwrap(),
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size line");
        let size_text = std::str::from_utf8(&b[..eol]).unwrap();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        b = &b[eol + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

fn hello() -> Vec<GenEvent> {
    vec![
        token("Hel"),
        token(""),
        token("lo"),
        GenEvent::Done {
            finish: Finish::Stop,
            text: "!".into(),
            prompt_tokens: 0,
            completion_tokens: 4,
            cached_tokens: 3,
            resume: Default::default(),
            stop_sequence: None,
        },
    ]
}

fn chat_body(extra: Value) -> Value {
    let mut b = json!({
        "model": MODEL_ID,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello."},
        ],
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[test]
fn chat_answers_with_the_text_usage_and_the_templated_prompt() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let r = post(s.addr, "/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], MODEL_ID);
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(
        c["message"],
        json!({"role": "assistant", "content": "Hello!"})
    );
    assert_eq!(c["finish_reason"], "stop");
    assert!(c["logprobs"].is_null());
    // The prompt is the template's rendering, tokenized without an extra BOS.
    let v2 = vocab();
    let text = v2
        .template
        .render(
            &[
                Message::new("system", "Be brief."),
                Message::new("user", "Say hello."),
            ],
            true,
        )
        .unwrap();
    let want = v2.tok.encode(&text, false).unwrap();
    let (prompt, max_tokens, temperature) = s.backend.seen(|r| {
        (
            r[0].prompt.clone(),
            r[0].max_tokens,
            r[0].sampling.temperature,
        )
    });
    assert_eq!(prompt, want);
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], want.len());
    assert_eq!(u["completion_tokens"], 4);
    assert_eq!(u["total_tokens"], want.len() + 4);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 3);
    assert!(u.get("resumed").is_none() && u.get("resume_ms").is_none());
    // No max_tokens: what the context leaves; OpenAI's default temperature.
    assert_eq!(max_tokens, 256 - want.len());
    assert_eq!(temperature, 1.0);
}

#[test]
fn request_fields_reach_the_backend() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let body = json!({
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
        "max_tokens": 50,
        "max_completion_tokens": 9,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.1,
        "repeat_penalty": 1.2,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "seed": 42,
        "stop": ["\n\n", "END", ""],
        "logprobs": true,
        "top_logprobs": 4,
        "user": "ignored",
        "tools": [],
    });
    let r = post(s.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let msg = [Message::new("user", "one\ntwo")];
    let want = vocab()
        .tok
        .encode(&vocab().template.render(&msg, true).unwrap(), false)
        .unwrap();
    s.backend.seen(|seen| {
        let r = &seen[0];
        assert_eq!(r.prompt, want);
        assert_eq!(r.max_tokens, 9);
        let p = &r.sampling;
        assert_eq!(
            (
                p.temperature,
                p.top_p,
                p.top_k,
                p.min_p,
                p.repetition_penalty
            ),
            (0.0, 0.5, 7, 0.1, 1.2)
        );
        assert_eq!(
            (p.frequency_penalty, p.presence_penalty, p.seed),
            (0.5, -0.5, Some(42))
        );
        assert_eq!(r.stop, ["\n\n", "END"]);
        assert_eq!(r.logprobs, Some(4));
    });
    // Completions: a string prompt gets the model's BOS choice; token ids go as they are.
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Once upon", "max_tokens": 1000, "logprobs": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": [[5, 6, 7]], "stop": "x"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    s.backend.seen(|seen| {
        let want = vocab()
            .tok
            .encode("Once upon", vocab().tok.add_bos_default())
            .unwrap();
        assert_eq!(seen[1].prompt, want);
        assert_eq!(
            seen[1].max_tokens,
            256 - want.len(),
            "clamped to the context"
        );
        assert_eq!(seen[1].logprobs, Some(2));
        assert_eq!(seen[2].prompt, [5, 6, 7]);
        assert_eq!(seen[2].stop, ["x"]);
        assert_eq!(seen[2].logprobs, None);
    });
}

#[test]
fn completion_answers_with_text_and_finish_reasons() {
    let events = vec![token("Hi"), token(" there"), done(Finish::Length, 2)];
    let s = start(Scripted::new(Script::Events(events)), None);
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Say", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["choices"][0]["text"], "Hi there");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 2);

    // A stop string ends the text: finish_reason "stop".
    let events = vec![token("Hi"), done(Finish::Stop, 2)];
    let s = start(Scripted::new(Script::Events(events)), None);
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Say", "stop": ["!"]}),
    );
    assert_eq!(r.json()["choices"][0]["finish_reason"], "stop");
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Say", "stop": ["!"], "stream": true}),
    );
    let chunks = r.chunks();
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
}

#[test]
fn chat_streams_sse_chunks_ending_with_done() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"stream": true})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(r.header("cache-control"), Some("no-cache"));
    let chunks = r.chunks();
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert!(c.get("usage").is_none(), "no usage unless asked: {c}");
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    // The empty token is not sent; the text released at the end is.
    let deltas: Vec<&str> = chunks[1..chunks.len() - 1]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, ["Hel", "lo", "!"]);
    for c in &chunks[..chunks.len() - 1] {
        assert!(c["choices"][0]["finish_reason"].is_null());
    }
    let last = &chunks[chunks.len() - 1]["choices"][0];
    assert_eq!(last["delta"], json!({}));
    assert_eq!(last["finish_reason"], "stop");
}

/// A request resumed after a node loss says so in `usage`, streamed or not.
#[test]
fn a_resumed_request_reports_it_in_usage() {
    let mut events = hello();
    if let Some(GenEvent::Done { resume, .. }) = events.last_mut() {
        *resume = crate::serve::ResumeStats {
            resumed: 1,
            resume_ms: 812.345,
        };
    }
    let s = start(Scripted::new(Script::Events(events)), None);
    let r = post(s.addr, "/v1/chat/completions", &chat_body(json!({})));
    let u = &r.json()["usage"];
    assert_eq!(u["resumed"], 1);
    assert_eq!(u["resume_ms"], 812.3);
    let body = chat_body(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let chunks = post(s.addr, "/v1/chat/completions", &body).chunks();
    let u = &chunks[chunks.len() - 1]["usage"];
    assert_eq!(
        (u["resumed"].clone(), u["resume_ms"].clone()),
        (json!(1), json!(812.3))
    );
}

#[test]
fn include_usage_adds_a_usage_chunk_before_done() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let body = chat_body(json!({
            "prompt": "Hi", "stream": true, "stream_options": {"include_usage": true}}));
        let r = post(s.addr, path, &body);
        let chunks = r.chunks();
        let (usage, rest) = chunks.split_last().unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], 4);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
        let n = usage["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(usage["usage"]["total_tokens"], n + 4);
        for c in rest {
            assert!(
                c["usage"].is_null(),
                "usage is null before the last chunk: {c}"
            );
        }
        assert_eq!(rest.last().unwrap()["choices"][0]["finish_reason"], "stop");
        if path == "/v1/completions" {
            assert_eq!(rest[0]["object"], "text_completion");
            let text: String = rest
                .iter()
                .map(|c| c["choices"][0]["text"].as_str().unwrap())
                .collect();
            assert_eq!(text, "Hello!");
        }
    }
}

fn lp(token: &str, logprob: f32, top: &[(&str, f32)]) -> TokenLogprob {
    TokenLogprob {
        token: token.into(),
        logprob,
        bytes: token.as_bytes().to_vec(),
        top: top
            .iter()
            .map(|&(t, l)| TopLogprob {
                token: t.into(),
                logprob: l,
                bytes: t.as_bytes().to_vec(),
            })
            .collect(),
    }
}

fn scored() -> Vec<GenEvent> {
    vec![
        GenEvent::Token {
            id: 10,
            text: "Hé".into(),
            logprob: Some(lp("Hé", -0.5, &[("Hé", -0.5), ("Ho", -1.5)])),
        },
        // Text held back (a possible stop string) still carries its log-probability.
        GenEvent::Token {
            id: 11,
            text: String::new(),
            logprob: Some(lp(" w", -0.25, &[(" w", -0.25), (" x", -2.0)])),
        },
        GenEvent::Token {
            id: 12,
            text: " wo".into(),
            logprob: Some(lp("o", -0.125, &[("o", -0.125), ("a", -3.0)])),
        },
        done(Finish::Length, 3),
    ]
}

#[test]
fn logprobs_have_openai_shapes() {
    let s = start(Scripted::new(Script::Events(scored())), None);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"logprobs": true, "top_logprobs": 2})),
    );
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), 3);
    assert_eq!(
        content[0],
        json!({"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169],
               "top_logprobs": [{"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]},
                                {"token": "Ho", "logprob": -1.5, "bytes": [72, 111]}]})
    );
    // Streamed: one entry per chunk, also for a chunk whose text is held back.
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"logprobs": true, "top_logprobs": 2, "stream": true})),
    );
    let chunks = r.chunks();
    let per_chunk: Vec<Value> = chunks[1..4]
        .iter()
        .map(|c| c["choices"][0]["logprobs"]["content"][0].clone())
        .collect();
    assert_eq!(per_chunk, content);
    assert_eq!(chunks[2]["choices"][0]["delta"]["content"], "");

    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "logprobs": 2}),
    );
    let v = r.json();
    let l = &v["choices"][0]["logprobs"];
    assert_eq!(l["tokens"], json!(["Hé", " w", "o"]));
    assert_eq!(l["token_logprobs"], json!([-0.5, -0.25, -0.125]));
    assert_eq!(l["top_logprobs"][0], json!({"Hé": -0.5, "Ho": -1.5}));
    assert_eq!(l["text_offset"], json!([0, 2, 2]));
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "logprobs": 2, "stream": true}),
    );
    let chunks = r.chunks();
    assert_eq!(chunks[1]["choices"][0]["logprobs"]["tokens"], json!([" w"]));
    assert_eq!(
        chunks[1]["choices"][0]["logprobs"]["text_offset"],
        json!([2])
    );
}

#[test]
fn an_engine_error_is_a_500_or_an_error_chunk() {
    let events = vec![
        token("Hi"),
        GenEvent::Error {
            message: "node 2 is gone".into(),
            retry_after_s: None,
        },
    ];
    let s = start(Scripted::new(Script::Events(events)), None);
    let r = post(s.addr, "/v1/completions", &json!({"prompt": "x"}));
    let e = r.error(500);
    assert_eq!(e["message"], "node 2 is gone");
    assert_eq!(e["type"], "server_error");
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "stream": true}),
    );
    let chunks = r.chunks();
    assert_eq!(chunks[0]["choices"][0]["text"], "Hi");
    assert_eq!(chunks[1]["error"]["message"], "node 2 is gone");
}

#[test]
fn malformed_and_invalid_bodies_are_openai_400s() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    let chat = "/v1/chat/completions";
    let r = send(s.addr, "POST", chat, &[], Some(b"{not json"));
    let e = r.error(400);
    assert_eq!(e["type"], "invalid_request_error");
    let r = send(s.addr, "POST", chat, &[], Some(b""));
    r.error(400);
    let r = post(s.addr, chat, &json!({"model": MODEL_ID}));
    assert_eq!(r.error(400)["param"], "messages");
    let r = post(s.addr, chat, &json!({"messages": "hi"}));
    r.error(400);
    let r = post(s.addr, "/v1/completions", &json!({"max_tokens": 3}));
    assert_eq!(r.error(400)["param"], "prompt");
    let cases = [
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"top_p": -0.1}), "top_p"),
        (json!({"presence_penalty": 3}), "presence_penalty"),
        (json!({"frequency_penalty": -2.5}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"n": 2}), "n"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (
            json!({"top_logprobs": 21, "logprobs": true}),
            "top_logprobs",
        ),
        (json!({"stop": vec!["a"; 17]}), "stop"),
        (json!({"stop": 5}), "stop"),
        (
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            "messages",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
            "messages",
        ),
    ];
    for (extra, param) in cases {
        let r = post(s.addr, chat, &chat_body(extra.clone()));
        assert_eq!(r.error(400)["param"], param, "{extra}");
    }
    for (body, param) in [
        (json!({"prompt": "x", "echo": true}), "echo"),
        (json!({"prompt": "x", "logprobs": 6}), "logprobs"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"prompt": [1, "b"]}), "prompt"),
        (json!({"prompt": [99_999_999]}), "prompt"),
        (json!({"prompt": ""}), "prompt"),
    ] {
        let r = post(s.addr, "/v1/completions", &body);
        assert_eq!(r.error(400)["param"], param, "{body}");
    }
    assert!(
        s.backend.seen(|r| r.is_empty()),
        "nothing invalid was submitted"
    );
}

#[test]
fn an_unknown_model_name_gets_the_served_model() {
    let s = start(Scripted::new(Script::Events(hello())), None);
    // As llama-server does: any name is the one model served (with a warning in the log).
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"model": "gpt-4o"})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], MODEL_ID);
    assert_eq!(r.json()["choices"][0]["message"]["content"], "Hello!");
    // Absent or empty: the served model.
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "model": ""}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(s.backend.seen(|r| r.len()), 2);
    // Looking a model up by name is not a request to run one: an unknown name is an error.
    let r = get(s.addr, "/v1/models/other");
    assert_eq!(r.error(400)["code"], "model_not_found");
}

#[test]
fn a_prompt_that_fills_the_context_is_a_400_with_both_numbers() {
    let s = start(Scripted::new(Script::Events(hello())).ctx(16), None);
    let long = "word ".repeat(40);
    let n = vocab()
        .tok
        .encode(&long, vocab().tok.add_bos_default())
        .unwrap()
        .len();
    let r = post(s.addr, "/v1/completions", &json!({"prompt": long}));
    let e = r.error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    let m = e["message"].as_str().unwrap();
    assert!(m.contains("16") && m.contains(&n.to_string()), "{m}");
    // A prompt of ctx - 1 tokens leaves room for one.
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": (0..15).collect::<Vec<u32>>()}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(s.backend.seen(|r| r[0].max_tokens), 1);
}

#[test]
fn no_template_is_a_400_that_says_so() {
    let mut b = Scripted::new(Script::Events(hello()));
    b.has_template = false;
    let s = start(b, None);
    let r = post(s.addr, "/v1/chat/completions", &chat_body(json!({})));
    assert!(r.error(400)["message"]
        .as_str()
        .unwrap()
        .contains("template"));
}

mod anthropic;
mod harmony;
mod ollama;
mod server;
