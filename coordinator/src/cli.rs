//! Command-line arguments, and their conversion (`From`) into the option structs the
//! library's domain functions take, so nothing outside `main.rs`, `commands/` and `bench/`
//! sees a clap type.

use clap::{Args, Parser, Subcommand};
use ringllm::cluster;
use ringllm::engine::ModelOptions;
use ringllm::text::sampler::SamplerParams;
use ringllm_protocol::control::KvType;
use ringllm_protocol::TransportKind;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "ringllm",
    version,
    about = "Run one LLM across the machines of a home LAN (or on this one)"
)]
pub struct Cli {
    /// More logging on stderr (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a model on this machine: complete a prompt, or chat with --chat.
    Run(RunArgs),
    /// Describe a GGUF model: architecture, hyper-parameters, tensor types, memory needed.
    Info(InfoArgs),
    /// Measure: a model's speed and roofline, a ring, the transports, a server, compressed
    /// activations.
    Bench(crate::bench::BenchArgs),
    /// Score a text file the way llama.cpp's perplexity tool does.
    Perplexity(PerplexityArgs),
    /// Train a layer-skip predictor for a model on a text (for --skip auto).
    Calibrate(CalibrateArgs),
    /// Serve a slice of a model to a coordinator (the worker daemon of a ring).
    Node(NodeArgs),
    /// Coordinate a ring of nodes: complete a prompt, or chat, like `run`.
    Up(UpArgs),
    /// Show how a cluster would split a model, and its predicted speed, without loading it.
    Plan(PlanArgs),
    /// Write a new random cluster key file, or (--node NAME) a node key certified by one.
    Keygen(KeygenArgs),
    /// Revoke a node key by its name: every coordinator using the cluster key refuses it and
    /// tells its nodes to refuse it too.
    Revoke(RevokeArgs),
    /// List the ringllm nodes heard on the LAN (mDNS; `node --advertise`).
    Nodes(NodesArgs),
    /// What every node of a cluster is doing: layers, memory, speed, links, coordinator.
    Status(StatusArgs),
    /// Developer tools: dump dequantized tensors and hidden states.
    #[command(hide = true)]
    Debug(DebugArgs),
    /// Convert a Hugging Face checkpoint folder (config.json, tokenizer, .safetensors) to GGUF.
    Convert(ConvertArgs),
}

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file.
    #[arg(short, long)]
    pub model: PathBuf,
    /// Worker threads (default: physical cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Context size in tokens (default: the model's, capped at 4096).
    #[arg(short = 'c', long)]
    pub ctx: Option<usize>,
    /// Tokens per prefill batch.
    #[arg(short, long, default_value_t = 512)]
    pub batch: usize,
    /// KV cache element type: f32 or f16.
    #[arg(long, default_value = "f32")]
    pub kv: KvType,
    /// The most memory this process may use, e.g. "2GiB" (default: what the machine and its
    /// cgroup leave): layers beyond it are streamed from disk.
    #[arg(long, value_parser = parse_memory)]
    pub memory: Option<u64>,
    #[command(flatten)]
    pub layout: LayoutArgs,
}

/// How the weights this process loads are laid out (`run`, `up`, `node`, `debug forward`).
#[derive(Args, Debug, Clone)]
pub struct LayoutArgs {
    /// Keep the weights in the file's layout instead of repacking the formats that have a
    /// panel layout into owned memory at load (repacking is on by default where this CPU's
    /// kernels read panels; it costs no extra memory and a moment at start-up).
    #[arg(long)]
    pub no_repack: bool,
    #[command(flatten)]
    pub stream: StreamArgs,
    /// What runs the layers: cpu; gpu (a wgpu adapter, a software one such as lavapipe
    /// included; fails when none opens); auto (a GPU that is not a software rasterizer, else
    /// the CPU).
    #[arg(long, default_value = "cpu")]
    pub backend: ringllm_model::BackendChoice,
}

/// Layers streamed from disk when they do not fit the memory budget.
#[derive(Args, Debug, Clone, Default)]
pub struct StreamArgs {
    /// auto: stream what does not fit the memory budget (a mixture of experts's experts, as
    /// the router picks them; other models' layers), the rest resident; experts: stream a
    /// mixture of experts's experts whatever the memory; all: stream every layer (the naive
    /// baseline); off: map everything and let the kernel page.
    #[arg(long = "stream", default_value = "auto")]
    pub mode: ringllm_model::stream::StreamMode,
    /// Layers read ahead of the compute when streaming, 1-16 (default: chosen from the
    /// measured disk read rate and compute speed).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub prefetch: Option<u32>,
    /// Expert buffers when experts stream (default: as many as the memory budget holds).
    #[arg(long, value_parser = clap::value_parser!(u32).range(6..=1_000_000))]
    pub expert_cache: Option<u32>,
    /// Read each streamed expert only once the router picks it (no prediction of the next
    /// layer's experts).
    #[arg(long)]
    pub no_expert_predict: bool,
}

impl StreamArgs {
    pub fn settings(&self) -> ringllm_model::stream::StreamSettings {
        ringllm_model::stream::StreamSettings {
            mode: self.mode,
            prefetch: self.prefetch.map(|p| p as usize),
            expert_slots: self.expert_cache.map(|p| p as usize),
            no_expert_predict: self.no_expert_predict,
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature (0 = greedy).
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0 = off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// RNG seed (default: random).
    #[arg(long)]
    pub seed: Option<u64>,
}

/// Predictive layer skip (`run`, `bench`, `perplexity`, `up`).
#[derive(Args, Debug, Clone, Default)]
pub struct SkipArgs {
    /// Skip layers a predictor expects to barely change a token: `auto` uses MODEL.skip
    /// beside the model, `auto:FILE` another file (both made by `ringllm calibrate`).
    /// Default: off.
    #[arg(long, value_name = "auto[:PREDICTOR]")]
    pub skip: Option<ringllm::skip::SkipSetting>,
    /// With --skip: most layers one token may skip in a row.
    #[arg(long, value_name = "N", default_value_t = ringllm_model::skip::DEFAULT_MAX_SKIP)]
    pub max_skip: usize,
}

impl From<&SkipArgs> for ringllm::skip::SkipOptions {
    fn from(a: &SkipArgs) -> ringllm::skip::SkipOptions {
        ringllm::skip::SkipOptions {
            setting: a.skip.clone().unwrap_or_default(),
            max_skip: a.max_skip,
            ..Default::default()
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub skip: SkipArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub gen: GenArgs,
}

/// What to generate: shared by `run` and `up`.
#[derive(Args, Debug, Clone)]
pub struct GenArgs {
    /// Prompt, completed as raw text (no chat template; special-token texts such as
    /// <|im_start|> are the tokens). Read from stdin when absent.
    #[arg(short, long)]
    pub prompt: Option<String>,
    /// Tokens to generate (-1 = until the end of generation or the context is full).
    #[arg(
        short = 'n',
        long = "n-predict",
        default_value_t = 256,
        allow_negative_numbers = true
    )]
    pub n_predict: i64,
    /// Stop when the output contains this text (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print exactly one JSON object with the ids, text and speeds.
    #[arg(long)]
    pub json: bool,
    /// Interactive chat using the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Built-in chat template to use when the model has none (chatml, gemma, llama3, phi3, harmony).
    #[arg(long)]
    pub template: Option<String>,
    /// System prompt for --chat.
    #[arg(long)]
    pub system: Option<String>,
    /// How hard a reasoning model (gpt-oss) thinks in --chat: low, medium or high (its
    /// template's default, medium, when not given).
    #[arg(long, value_parser = ["low", "medium", "high"])]
    pub reasoning_effort: Option<String>,
    /// Write the logits of the last token fed (raw little-endian f32) to this file.
    #[arg(long, hide = true)]
    pub logits_out: Option<PathBuf>,
    /// Write the logits every generated token was sampled from, one row of the vocabulary's
    /// size per token (raw little-endian f32).
    #[arg(long, hide = true)]
    pub step_logits_out: Option<PathBuf>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// `--serve`: an OpenAI- and Ollama-compatible HTTP API (and a chat page) instead of one prompt.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Serve the OpenAI-compatible API on HOST:PORT (e.g. 127.0.0.1:8080), with Ollama's
    /// API on /api and a chat page on /.
    #[arg(long)]
    pub serve: Option<String>,
    /// Sequences decoded at once (KV slots).
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// Requests that may wait for a slot before new ones get 429.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Most prompt tokens fed in one step, so a long prompt does not stall other streams.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Require `Authorization: Bearer KEY` (do set one when binding beyond loopback).
    #[arg(long, env = "RINGLLM_API_KEY")]
    pub api_key: Option<String>,
    /// Let web pages from ORIGIN (e.g. http://localhost:3000; `*`: any) call the API
    /// (repeatable). Default: any origin when --api-key is set, none otherwise.
    #[arg(long, value_name = "ORIGIN")]
    pub cors: Vec<String>,
    /// Without --api-key the server answers only requests sent to its own address (and to
    /// localhost when it listens on loopback), against DNS rebinding: let it answer to NAME
    /// too (repeatable; e.g. gpu-box.local; `*`: any name).
    #[arg(long, value_name = "NAME")]
    pub allow_host: Vec<String>,
    /// Seconds a connection may take to send a request's headers before it is closed.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    pub header_timeout: f64,
    /// Seconds a request body may take to arrive (then: 408).
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    pub body_timeout: f64,
    /// Most connections open at once (lowered to fit the open-file limit); at the cap the
    /// oldest idle connection is closed for a new one.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
}

/// Where a ring is described: a cluster file, or flags.
#[derive(Args, Debug, Clone)]
pub struct ClusterSource {
    /// Cluster file (TOML); see cluster-configs/homelab.example.toml.
    pub cluster: Option<PathBuf>,
    /// GGUF model file (without a cluster file, or to override its `model`).
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// Cluster key file (without a cluster file, or to override its `key`).
    #[arg(long)]
    pub key: Option<PathBuf>,
    /// A node's HOST:PORT, in ring order (repeatable; without a cluster file).
    #[arg(long = "node")]
    pub nodes: Vec<String>,
    /// Context size in tokens (default: the cluster file's, else the model's capped at 4096).
    #[arg(short = 'c', long)]
    pub ctx: Option<usize>,
    /// Transport of every data link (overrides the cluster file); each node must have been
    /// started with the same --transport.
    #[arg(long)]
    pub transport: Option<TransportKind>,
    /// Hidden states on the wire (overrides the cluster file's `activations`; without
    /// either: f32).
    #[arg(long, ignore_case = true)]
    pub activations: Option<cluster::file::Activations>,
    /// When the model does not fit the ring's memory, layers are streamed from disk: auto
    /// (the layout the planner predicts fastest: stream in place or 2-4 rounds per token),
    /// 1-4 (that many rounds, even if the model fits), naive (every node streams its whole
    /// slice: the baseline), off (refuse a model that does not fit).
    #[arg(long, default_value = "auto", value_parser = parse_rounds)]
    pub rounds: ringllm::cluster::StreamPolicy,
    #[command(flatten)]
    pub discovery: DiscoverArgs,
}

/// Finding nodes on the LAN by mDNS (`up`, `plan`, `status`).
#[derive(Args, Debug, Clone, Default)]
pub struct DiscoverArgs {
    /// Find the nodes of this key's cluster on the LAN by mDNS (`node --advertise`) and
    /// plan over them as if listed (after any --node or [[node]] given).
    #[arg(long)]
    pub discover: bool,
    /// With --discover: seconds to listen (default: the cluster file's `discover_wait`, else 3).
    #[arg(long, value_name = "SECONDS", value_parser = parse_discover_wait)]
    pub discover_wait: Option<std::time::Duration>,
    #[command(flatten)]
    pub mdns: MdnsArgs,
}

/// Which interfaces mDNS uses.
#[derive(Args, Debug, Clone, Default)]
pub struct MdnsArgs {
    /// Use only this network interface for mDNS (repeatable; default: every interface).
    #[arg(long = "mdns-interface", value_name = "NAME")]
    pub mdns_interfaces: Vec<String>,
}

fn parse_discover_wait(s: &str) -> Result<std::time::Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(t) if (0.1..=60.0).contains(&t) => Ok(std::time::Duration::from_secs_f64(t)),
        _ => Err(format!("'{s}': give seconds from 0.1 to 60")),
    }
}

/// `ringllm nodes`.
#[derive(Args, Debug, Clone)]
pub struct NodesArgs {
    /// Cluster key file: marks which nodes are of its cluster (others are listed as such).
    #[arg(long)]
    pub key: Option<PathBuf>,
    /// Seconds to listen.
    #[arg(long, value_name = "SECONDS", default_value = "3", value_parser = parse_discover_wait)]
    pub wait: std::time::Duration,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub mdns: MdnsArgs,
}

/// `ringllm status`.
#[derive(Args, Debug, Clone)]
pub struct StatusArgs {
    /// Cluster file: its key and nodes (and `discover = true`).
    pub cluster: Option<PathBuf>,
    /// Cluster key file (without a cluster file, or to override its `key`).
    #[arg(long)]
    pub key: Option<PathBuf>,
    /// Nodes to ask, HOST:PORT, comma-separated (repeatable).
    #[arg(long, value_delimiter = ',')]
    pub nodes: Vec<String>,
    /// A serving coordinator (http://HOST:PORT): read its GET /v1/cluster.
    #[arg(long)]
    pub url: Option<String>,
    /// API key of the coordinator at --url.
    #[arg(long, env = "RINGLLM_API_KEY")]
    pub api_key: Option<String>,
    /// Print the JSON (the same as GET /v1/cluster) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Ask again every SECS seconds (default 2) until Ctrl-C; the screen is cleared between
    /// reports when stdout is a terminal.
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
    pub watch: Option<f64>,
    /// Also ask the nodes of the key's cluster heard on the LAN by mDNS (`node --advertise`).
    #[arg(long)]
    pub discover: bool,
    /// With --discover: seconds to listen.
    #[arg(long, value_name = "SECONDS", value_parser = parse_discover_wait)]
    pub discover_wait: Option<std::time::Duration>,
    #[command(flatten)]
    pub mdns: MdnsArgs,
}

fn parse_rounds(s: &str) -> Result<ringllm::cluster::StreamPolicy, String> {
    use ringllm::cluster::streaming::{Choice, MAX_ROUNDS};
    use ringllm::cluster::StreamPolicy;
    let choice = match s {
        "auto" => Choice::Auto,
        "naive" => Choice::Naive,
        "off" => {
            return Ok(StreamPolicy {
                off: true,
                choice: Choice::Auto,
            })
        }
        k => match k.parse::<usize>() {
            Ok(k) if (1..=MAX_ROUNDS).contains(&k) => Choice::Rounds(k),
            _ => {
                return Err(format!(
                    "'{s}': give auto, naive, off or a number of rounds from 1 to {MAX_ROUNDS}"
                ))
            }
        },
    };
    Ok(StreamPolicy { off: false, choice })
}

/// `ringllm up`: the coordinator of a ring.
#[derive(Args, Debug, Clone)]
pub struct UpArgs {
    #[command(flatten)]
    pub source: ClusterSource,
    #[command(flatten)]
    pub skip: SkipArgs,
    /// Threads for the coordinator's own work (embedding, output head, local layers).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Tokens per prefill batch (one frame per hop).
    #[arg(short, long, default_value_t = 512)]
    pub batch: usize,
    /// KV cache element type on every node: f32 or f16.
    #[arg(long)]
    pub kv: Option<KvType>,
    /// Seconds to wait at start-up for nodes that do not listen yet (machines still booting).
    /// With --serve, nodes still missing then are left out and taken into the ring when
    /// they come.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub wait: f64,
    /// Do not send nodes the slices of the model they lack (each node then needs the model
    /// file, or a slice already in its cache).
    #[arg(long)]
    pub no_send: bool,
    /// When a node dies mid-answer, the answer goes on on the ring rebuilt over the nodes
    /// left (its prompt and the tokens already generated are replayed): at most this many
    /// times per request (or per `-p` generation), then it fails. 0: fail at once.
    #[arg(long, default_value_t = ringllm::serve::scheduler::DEFAULT_RESUME_RETRIES, value_name = "N")]
    pub resume_retries: usize,
    #[command(flatten)]
    pub layout: LayoutArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub gen: GenArgs,
}

#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    #[command(flatten)]
    pub source: ClusterSource,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
    /// Plan for serving this many sequences at once, as `up --serve --parallel N` does: KV
    /// caches for N slots on every stage and batches of --prefill-chunk + N tokens (default:
    /// one conversation, as `up` without --serve).
    #[arg(long)]
    pub parallel: Option<usize>,
    /// With --parallel: the serving prefill chunk (`up --serve --prefill-chunk`).
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
}

#[derive(Args, Debug, Clone)]
pub struct NodeArgs {
    /// Address to listen on (HOST:PORT).
    #[arg(short, long)]
    pub listen: String,
    /// Cluster key file (the same file on every machine; `ringllm keygen FILE` makes one).
    #[arg(long)]
    pub key: PathBuf,
    /// Worker threads (default: physical cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Directory holding the model files.
    #[arg(long, default_value = "models")]
    pub models: PathBuf,
    /// Name shown in logs and errors (default: host name and port; with --node-key, the
    /// name its certificate gives).
    #[arg(long)]
    pub name: Option<String>,
    /// A node key file (`ringllm keygen --node NAME --key KEYFILE FILE`): the node proves its
    /// certified name in every handshake, and can be revoked by it (`ringllm revoke`).
    #[arg(long, value_name = "FILE")]
    pub node_key: Option<PathBuf>,
    /// Transport for data links: tcp, udp (reliable UDP), quic (TLS 1.3) or uring (TCP on
    /// io_uring). udp and quic use the UDP port of the same number as --listen.
    #[arg(long, default_value = "tcp")]
    pub transport: TransportKind,
    /// The most memory this node may use, e.g. "2GiB" or "512MiB" (default: what the machine
    /// and its cgroup leave; the smaller of the two applies when given).
    #[arg(long, value_parser = parse_memory)]
    pub memory: Option<u64>,
    /// Where slices of models this node lacks are kept when a coordinator sends them
    /// (default: ~/.cache/ringllm/slices); reused on the next start.
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Announce this node on the LAN by mDNS (port, name, a hash of the cluster, threads,
    /// memory budget, kernels, transport, version; never the key), for `up --discover`.
    #[arg(long)]
    pub advertise: bool,
    #[command(flatten)]
    pub mdns: MdnsArgs,
    #[command(flatten)]
    pub layout: LayoutArgs,
}

impl NodeArgs {
    /// `--cache`, else `$XDG_CACHE_HOME/ringllm/slices`, else `~/.cache/ringllm/slices`.
    pub fn cache_dir(&self) -> PathBuf {
        if let Some(c) = &self.cache {
            return c.clone();
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"));
        base.join("ringllm").join("slices")
    }
}

pub(crate) fn parse_memory(s: &str) -> Result<u64, String> {
    match ringllm::cluster::file::parse_size(s)? {
        0 => {
            Err("a node needs some memory: give a size such as 2GiB, or leave --memory out".into())
        }
        n => Ok(n),
    }
}

#[derive(Args, Debug, Clone)]
pub struct ConvertArgs {
    /// The checkpoint folder: config.json, tokenizer.json or tokenizer.model,
    /// model.safetensors or model.safetensors.index.json and its shards.
    pub dir: PathBuf,
    /// The GGUF file to write (replaced when it exists, only once the new one is complete).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Weight type of the matrices: q4_k_m (llama.cpp's mix), or one type such as f16, bf16,
    /// f32, q8_0, q6_k, q5_k, q4_k, q5_0, q4_0. Norms and biases are always f32.
    #[arg(long = "type", default_value = "f16")]
    pub ty: String,
    /// Threads quantizing (default: physical cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
}

#[derive(Args, Debug, Clone)]
pub struct KeygenArgs {
    /// Where to write the key.
    pub file: PathBuf,
    /// Replace an existing file.
    #[arg(long)]
    pub force: bool,
    /// Write a node key for the node NAME instead: its own key pair and a certificate signed
    /// with the cluster key (--key), for `ringllm node --node-key FILE`. Names: letters,
    /// digits and . _ : - (at most 64).
    #[arg(long, value_name = "NAME", requires = "key")]
    pub node: Option<String>,
    /// With --node: the cluster key file that certifies the node key.
    #[arg(long, requires = "node")]
    pub key: Option<PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct RevokeArgs {
    /// The node name to refuse (as given to `keygen --node`).
    pub name: String,
    /// The cluster key file; the list is kept beside it, in KEYFILE.revoked.
    #[arg(long)]
    pub key: PathBuf,
}

#[derive(Args, Debug, Clone)]
pub struct InfoArgs {
    /// GGUF model file.
    pub model: PathBuf,
    /// Also list every tensor.
    #[arg(long)]
    pub tensors: bool,
    /// Also print the model's chat template.
    #[arg(long)]
    pub chat_template: bool,
}

#[derive(Args, Debug, Clone)]
#[command(mut_arg("ctx", |a| a.help(
    "Tokens per scored chunk [default: 512, as llama.cpp's perplexity tool]"
)))]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score.
    #[arg(short, long)]
    pub file: PathBuf,
    /// Score at most this many chunks.
    #[arg(long)]
    pub chunks: Option<usize>,
    #[command(flatten)]
    pub skip: SkipArgs,
}

#[derive(Args, Debug, Clone)]
#[command(mut_arg("ctx", |a| a.help(
    "Tokens per calibration chunk [default: 512]"
)))]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Calibration text (the last chunk is held out to choose the threshold).
    #[arg(short, long)]
    pub file: PathBuf,
    /// Where to write the predictor (default: MODEL.skip beside the model, where --skip
    /// auto looks).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Use at most this many chunks of the text (at least 2).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Features per token (the projection's rank).
    #[arg(long, default_value_t = 32)]
    pub rank: usize,
    /// Most perplexity increase on the held-out chunk the chosen threshold may cost, in %.
    #[arg(long, default_value_t = 3.0)]
    pub budget: f64,
}

#[derive(Args, Debug, Clone)]
pub struct DebugArgs {
    #[command(subcommand)]
    pub command: DebugCommand,
}

#[derive(Subcommand, Debug, Clone)]
pub enum DebugCommand {
    /// Write one tensor dequantized to raw little-endian f32.
    Dequant {
        #[arg(short, long)]
        model: PathBuf,
        #[arg(long)]
        tensor: String,
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Run token ids through the model and dump embeddings, per-layer hidden states and
    /// logits of every position as .npy files.
    Forward {
        #[command(flatten)]
        model: ModelArgs,
        /// Comma-separated token ids.
        #[arg(long, value_delimiter = ',')]
        tokens: Vec<u32>,
        /// Output directory.
        #[arg(long)]
        dump: PathBuf,
        /// Also dump every step of every layer (`layer.{i}.{step}.{buffer}.npy`, the steps
        /// of the layer's recipe in order; `steps.json` lists them), to find the first step
        /// where two backends or the reference part.
        #[arg(long)]
        steps: bool,
    },
    /// Tokenize text and print the ids as JSON (with --texts: a JSON list of strings in, a
    /// JSON list of id lists out).
    Tokenize {
        #[arg(short, long)]
        model: PathBuf,
        #[arg(short, long, required_unless_present = "texts")]
        prompt: Option<String>,
        /// JSON file holding a list of strings.
        #[arg(long)]
        texts: Option<PathBuf>,
        /// Add BOS as the model's metadata says.
        #[arg(long)]
        bos: bool,
    },
    /// Write a synthetic random-weight model, streamed to the file: a small one of an
    /// architecture (--arch) or a published model's real-size shape (--shape).
    Synth(SynthArgs),
    /// A TCP proxy that delays every chunk by a fixed time (tests add link latency with it).
    DelayProxy {
        #[arg(long)]
        listen: String,
        #[arg(long)]
        to: String,
        #[arg(long)]
        delay_ms: f64,
    },
    /// Hold a kernel-module context (`/dev/ringllm`) on a UDP port and wait for data in it,
    /// printing the module's counters when data arrives or after --seconds (kmod/test-qemu:
    /// unloading the module while a reader is blocked).
    KmodHold {
        #[arg(long)]
        port: u16,
        #[arg(long, default_value_t = 0)]
        tag: u32,
        #[arg(long, default_value_t = 60)]
        seconds: u64,
    },
    /// Send small UDP datagrams carrying the kernel module's magic and --tag, with a header
    /// the module refuses, to --to for --seconds (kmod/test-qemu: traffic through the hook
    /// while the module unloads).
    UdpFlood {
        #[arg(long)]
        to: std::net::SocketAddr,
        #[arg(long, default_value_t = 0)]
        tag: u32,
        #[arg(long, default_value_t = 60)]
        seconds: u64,
    },
}

/// `debug synth`.
#[derive(Args, Debug, Clone)]
pub struct SynthArgs {
    /// Small model architecture (llama, gemma3, qwen2, qwen3...): few layers, small dims,
    /// every tensor kind of the family.
    #[arg(long, required_unless_present = "shape", conflicts_with = "shape")]
    pub arch: Option<String>,
    /// Real-size shape (the published model's hyper-parameters), e.g. qwen3-8b; an unknown
    /// name is refused with the list of known ones.
    #[arg(long)]
    pub shape: Option<String>,
    /// Weight type: one type (q8_0, q4_k, q3_k, iq4_nl, f16...) or, with --shape, one of
    /// llama.cpp's mixes: q4_k_m (the default there), q3_k_m, q2_k or iq4_xs (with --shape,
    /// q2_k is llama.cpp's Q2_K mix, not Q2_K everywhere).
    #[arg(long = "type")]
    pub ty: Option<String>,
    /// With --shape: keep only this many layers (tests of a big shape's layers).
    #[arg(long)]
    pub layers: Option<u32>,
    /// With --shape: a smaller vocabulary (embedding, head and tokenizer).
    #[arg(long)]
    pub vocab: Option<u32>,
    /// With a mixture-of-experts --shape: router rows scaled by (1 + rank)^-S, the experts
    /// ranked in a different order in each layer, so that some experts are picked far more
    /// often than others as in trained models (0: the near-uniform picks of random weights).
    #[arg(long, default_value_t = 0.0)]
    pub router_skew: f32,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(short, long)]
    pub output: PathBuf,
}

impl From<&ModelArgs> for ModelOptions {
    fn from(a: &ModelArgs) -> ModelOptions {
        ModelOptions {
            model: a.model.clone(),
            threads: a.threads,
            ctx: a.ctx,
            batch: a.batch,
            kv: a.kv,
            repack: !a.layout.no_repack,
            memory: a.memory,
            stream: a.layout.stream.settings(),
            backend: a.layout.backend,
        }
    }
}

impl From<&SamplingArgs> for SamplerParams {
    /// Without `--seed`, a seed from the clock and the process id.
    fn from(s: &SamplingArgs) -> SamplerParams {
        let seed = s.seed.unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            t ^ (std::process::id() as u64) << 32
        });
        SamplerParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repeat_penalty: s.repeat_penalty,
            repeat_last_n: s.repeat_last_n,
            seed,
        }
    }
}

impl From<&ClusterSource> for cluster::Source {
    fn from(a: &ClusterSource) -> cluster::Source {
        cluster::Source {
            cluster: a.cluster.clone(),
            model: a.model.clone(),
            key: a.key.clone(),
            nodes: a.nodes.clone(),
            transport: a.transport,
            activations: a.activations,
            stream: a.rounds,
            discover: a.discovery.discover,
            discover_wait: a.discovery.discover_wait,
            mdns_interfaces: a.discovery.mdns.mdns_interfaces.clone(),
        }
    }
}

impl GenArgs {
    /// `--serve` and its settings, when given.
    pub fn serve_config(&self) -> Option<ringllm::serve::ServeConfig> {
        let s = &self.serve;
        Some(ringllm::serve::ServeConfig {
            addr: s.serve.clone()?,
            parallel: s.parallel,
            queue: s.queue,
            prefill_chunk: s.prefill_chunk,
            api_key: s.api_key.clone(),
            template: self.template.clone(),
            cors: s.cors.clone(),
            allow_hosts: s.allow_host.clone(),
            header_timeout: seconds(s.header_timeout),
            body_timeout: seconds(s.body_timeout),
            max_connections: s.max_connections,
            resume_retries: ringllm::serve::scheduler::DEFAULT_RESUME_RETRIES,
        })
    }
}

/// A timeout flag in seconds (negative or not a number: the shortest, 1 ms).
fn seconds(s: f64) -> std::time::Duration {
    std::time::Duration::try_from_secs_f64(s)
        .unwrap_or_default()
        .max(std::time::Duration::from_millis(1))
}
