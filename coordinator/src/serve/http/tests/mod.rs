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

mod anthropic;
mod harmony;
mod ollama;
mod openai;
mod server;
