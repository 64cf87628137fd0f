//! Cluster files: which model to run, which machines hold which layers, in TOML.
//!
//! ```toml
//! model = "../models/smollm2-135m-instruct-q4_1.gguf"  # required; relative to this file's folder
//! key = "cluster.key"          # required: the cluster key file, relative to this file's folder
//! ctx = 2048                   # optional: context size in tokens (default: the model's, capped)
//! activations = "f32"          # optional: hidden states on the wire: f32 (default), f16,
//!                              #   bf16 or q8 (blocks of 32 int8 with an f16 scale; also
//!                              #   q8_0)
//! transport = "tcp"            # optional: data links' transport: tcp (default), udp, quic
//!                              #   or uring; each node must run with the same --transport
//! kv = "f32"                   # optional: KV cache type, "f32" (default) or "f16"
//! discover = true              # optional: also find the nodes of this key's cluster on the
//!                              #   LAN by mDNS (`node --advertise`); [[node]] tables may
//!                              #   then be left out
//! discover_wait = 3            # optional: seconds to listen for them (default 3)
//!
//! [coordinator]                # optional table: the machine that runs `ringllm`
//! threads = 2                  # optional, at least 1
//! memory = "4GiB"              # optional budget for embedding + head + the local stage's layers
//!
//! [[node]]                     # one table per stage, in ring order (at least one)
//! name = "a"                   # required, unique
//! address = "127.0.0.1:7701"   # required unless local = true: host:port, port 1-65535
//! layers = "0-14"              # optional manual split, inclusive: "0-14" is layers 0 to 14
//! memory = "2GiB"              # optional cap on what the node may use
//! threads = 1                  # optional, at least 1
//! transport = "quic"           # optional: this node's links (overrides the top-level one)
//!
//! [[node]]
//! name = "master"
//! local = true                 # runs inside the coordinator process (at most one; no address)
//! ```
//!
//! Sizes are a string with a unit (`"4GiB"`, `"512 MiB"`, `"2GB"`, `"1.5G"`) or a whole number
//! of bytes; see [`parse_size`]. Top-level keys must come before the first `[table]`, as TOML
//! puts every key after a header into that table.
//!
//! Every error names the file, the line, the field and the fix, e.g.
//! `cluster.toml:7: node "b": field `address` "10.0.0.2" has no port — write it as host:port,
//! e.g. "10.0.0.2:7701"`. TOML syntax and type errors keep the line `toml` reports; a misspelled
//! field is refused by name, with the closest known field suggested.
//!
//! Pinned `layers` are checked here as far as they can be without the model: in ring order,
//! non-overlapping, contiguous where no unpinned node sits between two pins, starting at 0 when
//! no unpinned node comes first, and with at least one free layer for each unpinned node in
//! between. Whether the pins reach the model's last layer is the planner's check.

use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use ringllm_model::limits;
use ringllm_protocol::control::KvType;
use ringllm_protocol::{Dtype, TransportKind};
use serde::Deserialize;
use toml::Spanned;

use super::diagnostics::{a_type, node_header_lines, Source};

/// Hidden states on the wire when neither the file nor `--activations` says: f32, exact. A
/// decode step moves d × 4 bytes per hop (2.6 KB for Gemma 3 270M, 21 µs on 1 GbE), and
/// compressing them changed up to 60% of greedy tokens of the test models (`ringllm bench
/// activations`, docs/speed.md "Activations on the wire"); f16/bf16/q8 are for slow links and long
/// prefills.
pub const DEFAULT_ACTIVATIONS: Activations = Activations::F32;

/// The type of the hidden states on the wire: a cluster file's `activations` and the
/// `--activations` flag. Its variants (with their aliases) are the one table both read:
/// names are case-insensitive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Activations {
    F32,
    F16,
    Bf16,
    /// Blocks of 32 int8 values with an f16 scale.
    #[value(alias = "q8_0")]
    Q8,
}

impl Default for Activations {
    fn default() -> Activations {
        DEFAULT_ACTIVATIONS
    }
}

impl Activations {
    /// The type's name, as written in files and flags.
    pub fn name(self) -> &'static str {
        self.dtype().name()
    }

    /// The wire type.
    pub fn dtype(self) -> Dtype {
        match self {
            Activations::F32 => Dtype::F32,
            Activations::F16 => Dtype::F16,
            Activations::Bf16 => Dtype::Bf16,
            Activations::Q8 => Dtype::Q8,
        }
    }

    /// `"f32" (the default), "f16", "bf16" or "q8"`, for messages.
    fn choices() -> String {
        let names: Vec<String> = <Activations as clap::ValueEnum>::value_variants()
            .iter()
            .map(|a| {
                if *a == DEFAULT_ACTIVATIONS {
                    format!("\"{}\" (the default)", a.name())
                } else {
                    format!("\"{}\"", a.name())
                }
            })
            .collect();
        match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => names.join(""),
        }
    }
}

impl std::str::FromStr for Activations {
    type Err = String;

    fn from_str(s: &str) -> Result<Activations, String> {
        <Activations as clap::ValueEnum>::from_str(s.trim(), true).map_err(|_| {
            format!(
                "\"{s}\" is not an activation type — write activations = {}",
                Activations::choices()
            )
        })
    }
}

impl<'de> Deserialize<'de> for Activations {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Activations, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A parsed and checked cluster file.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterConfig {
    /// The cluster file itself, as given.
    pub path: PathBuf,
    /// The GGUF model, resolved relative to the cluster file's folder.
    pub model: PathBuf,
    /// The cluster key file, resolved relative to the cluster file's folder.
    pub key_file: PathBuf,
    /// Context size in tokens; `None`: the engine's default.
    pub ctx: Option<usize>,
    /// Activation type on the wire.
    pub activations: Activations,
    /// Every data link's transport unless a node says otherwise; `None`: each node's own.
    pub transport: Option<TransportKind>,
    /// KV cache type.
    pub kv: KvType,
    /// The coordinator's own threads.
    pub threads: Option<usize>,
    /// The coordinator's memory budget in bytes (embedding, head and the local stage's layers).
    pub memory: Option<u64>,
    /// The stages in ring order.
    pub stages: Vec<StageConfig>,
    /// Also find this cluster's nodes by mDNS (`discover = true`).
    pub discover: bool,
    /// How long to listen for them (`discover_wait`, seconds).
    pub discover_wait: Option<std::time::Duration>,
}

/// One `[[node]]` table: a stage of the ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageConfig {
    pub name: String,
    /// `host:port`; `None` for the local stage.
    pub address: Option<String>,
    /// The layers run inside the coordinator process.
    pub local: bool,
    /// Manual split; the file's inclusive `"0-8"` is `0..9` here.
    pub layers: Option<Range<usize>>,
    /// Cap on the memory this node may use, in bytes.
    pub memory: Option<u64>,
    pub threads: Option<usize>,
    /// The transport of this node's data links.
    pub transport: Option<TransportKind>,
    /// 1-based line of the `[[node]]` header, for messages.
    pub line: usize,
}

pub(super) const TOP_FIELDS: &[&str] = &[
    "model",
    "key",
    "ctx",
    "activations",
    "transport",
    "kv",
    "coordinator",
    "node",
    "discover",
    "discover_wait",
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    model: Option<Spanned<String>>,
    key: Option<Spanned<String>>,
    ctx: Option<Spanned<i64>>,
    activations: Option<Activations>,
    transport: Option<Spanned<String>>,
    kv: Option<Spanned<String>>,
    coordinator: Option<RawCoordinator>,
    #[serde(default)]
    node: Vec<Spanned<RawNode>>,
    discover: Option<bool>,
    discover_wait: Option<Spanned<toml::Value>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCoordinator {
    threads: Option<Spanned<i64>>,
    memory: Option<Spanned<toml::Value>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    name: Option<Spanned<String>>,
    address: Option<Spanned<String>>,
    local: Option<Spanned<bool>>,
    layers: Option<Spanned<toml::Value>>,
    memory: Option<Spanned<toml::Value>>,
    threads: Option<Spanned<i64>>,
    transport: Option<Spanned<String>>,
}

/// Largest cluster file read. A file of hundreds of nodes is a few tens of KiB; a larger one
/// is the wrong file (a model, a log), which would take seconds and hundreds of MiB to parse
/// before its error.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// Reads and checks a cluster file (at most `MAX_FILE_BYTES`: checked from its size before it
/// is read, and while it is read for files whose size says nothing, such as pipes).
pub fn load(path: &Path) -> Result<ClusterConfig> {
    use std::io::Read as _;
    let cannot = || format!("cannot read cluster file {}", path.display());
    let file = std::fs::File::open(path).with_context(cannot)?;
    let size = file.metadata().with_context(cannot)?.len();
    let too_big = |size: &dyn std::fmt::Display| {
        anyhow::anyhow!(
            "cluster file {} is {size} bytes; a cluster file may be at most {MAX_FILE_BYTES} \
             bytes (1 MiB): is it the right file?",
            path.display()
        )
    };
    if size > MAX_FILE_BYTES {
        return Err(too_big(&size));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(cannot)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_big(&format!("over {MAX_FILE_BYTES}")));
    }
    let text = String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("cluster file {} is not UTF-8 text", path.display()))?;
    parse_str(&text, path)
}

/// Parses and checks cluster file text; `path` names the file in messages and is the base for
/// the relative `model` and `key` paths.
pub fn parse_str(text: &str, path: &Path) -> Result<ClusterConfig> {
    let src = Source {
        text,
        file: path.display().to_string(),
    };
    let raw: RawCluster = toml::from_str(text).map_err(|e| src.toml_error(&e))?;
    let base = path.parent().unwrap_or_else(|| Path::new(""));

    let model = required_path(&src, raw.model, "model", "\"models/my-model.gguf\"", base)?;
    let key_file = required_path(&src, raw.key, "key", "\"cluster.key\"", base)?;
    let ctx = match raw.ctx {
        None => None,
        Some(v) => Some(positive(
            &src,
            &v,
            "",
            "ctx",
            "ctx = 2048",
            limits::MAX_CTX,
        )?),
    };
    let activations = raw.activations.unwrap_or_default();
    let transport = match &raw.transport {
        None => None,
        Some(t) => Some(transport_field(&src, t, "")?),
    };
    let kv = match raw.kv {
        None => KvType::default(),
        Some(v) => {
            let Some(k) = KvType::from_name(v.get_ref()) else {
                return Err(src.err(
                    &v,
                    format!(
                        "field `kv` \"{}\" is not a KV cache type — write kv = \"f32\" (the \
                         default) or kv = \"f16\"",
                        v.get_ref()
                    ),
                ));
            };
            k
        }
    };
    let (threads, memory) = match raw.coordinator {
        None => (None, None),
        Some(c) => {
            let what = "[coordinator]: ";
            let threads = match c.threads {
                None => None,
                Some(t) => Some(positive(
                    &src,
                    &t,
                    what,
                    "threads",
                    "threads = 2",
                    limits::MAX_THREADS,
                )?),
            };
            let memory = match c.memory {
                None => None,
                Some(m) => Some(size_field(&src, &m, what)?),
            };
            (threads, memory)
        }
    };

    let discover = raw.discover.unwrap_or(false);
    let discover_wait = match &raw.discover_wait {
        None => None,
        Some(v) => {
            let secs = match v.get_ref() {
                toml::Value::Integer(n) => Some(*n as f64),
                toml::Value::Float(f) => Some(*f),
                _ => None,
            };
            match secs {
                Some(t) if (0.1..=60.0).contains(&t) => {
                    Some(std::time::Duration::from_secs_f64(t))
                }
                _ => {
                    return Err(src.err(
                        v,
                        format!(
                            "field `discover_wait` {} is not a number of seconds from 0.1 to 60                              — write e.g. discover_wait = 3",
                            v.get_ref()
                        ),
                    ))
                }
            }
        }
    };
    if raw.node.is_empty() && !discover {
        return Err(anyhow::anyhow!(
            "{}: no [[node]] tables — add one per stage of the ring, e.g.\n[[node]]\nname = \"a\"\n\
             address = \"192.168.1.20:7701\"\n(or discover = true at the top to find them by mDNS)",
            src.file
        ));
    }
    let headers = node_header_lines(text);
    let mut stages = Vec::with_capacity(raw.node.len());
    for (i, spanned) in raw.node.iter().enumerate() {
        // The scan finds the headers of `[[node]]` tables; a file that spells the array another
        // way (`node = [{ ... }]`) falls back to where toml says the table is.
        let line = if headers.len() == raw.node.len() {
            headers[i]
        } else {
            src.line_of(spanned.span().start)
        };
        stages.push(node(&src, spanned.get_ref(), i, line)?);
    }
    check_stages(&src, &stages)?;

    Ok(ClusterConfig {
        path: path.to_path_buf(),
        model,
        key_file,
        ctx,
        activations,
        transport,
        kv,
        threads,
        memory,
        stages,
        discover,
        discover_wait,
    })
}

/// Parses an inclusive layer range as written in cluster files: `"0-8"` is `0..9`, `"5"` is
/// `5..6`.
pub fn parse_layers(s: &str) -> Result<Range<usize>, String> {
    let t = s.trim();
    let hint = "write first-last with layer numbers, inclusive, e.g. \"0-8\"";
    if t.is_empty() {
        return Err(format!("empty layer range — {hint}"));
    }
    let (a, b) = match t.split_once('-') {
        Some((a, b)) => (a.trim(), b.trim()),
        None => (t, t),
    };
    let number = |x: &str| -> Result<usize, String> {
        x.parse::<usize>()
            .map_err(|_| format!("\"{t}\" is not a layer range — {hint}"))
    };
    let first = number(a)?;
    let last = number(b)?;
    if last < first {
        return Err(format!(
            "layer range \"{t}\" ends before it starts — write the lower layer first, e.g. \
             \"{last}-{first}\""
        ));
    }
    let end = last
        .checked_add(1)
        .ok_or_else(|| format!("layer range \"{t}\" is too large"))?;
    Ok(first..end)
}

/// Parses a size: a number with an optional unit, case-insensitive. `B` bytes; `KiB`, `MiB`,
/// `GiB`, `TiB` and the bare `K`, `M`, `G`, `T` are powers of 1024; `KB`, `MB`, `GB`, `TB` are
/// powers of 1000. Fractions are allowed with a unit larger than a byte (`"1.5G"`) and rounded to
/// whole bytes; no unit means bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let hint = "write e.g. \"4GiB\", \"512 MiB\", \"2GB\" or a number of bytes";
    if t.is_empty() {
        return Err(format!("empty size — {hint}"));
    }
    if t.starts_with('-') {
        return Err(format!("size \"{t}\" is negative — {hint}"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    if num.is_empty() {
        return Err(format!("size \"{t}\" has no number — {hint}"));
    }
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(format!(
                "size \"{t}\" has an unknown unit \"{unit}\" — use B, KiB, MiB, GiB, TiB (or K, \
                 M, G, T; powers of 1024) or KB, MB, GB, TB (powers of 1000)"
            ))
        }
    };
    if num.contains('.') {
        if mult == 1 {
            return Err(format!("size \"{t}\" is a fraction of a byte — {hint}"));
        }
        let v: f64 = num
            .parse()
            .map_err(|_| format!("size \"{t}\" is not a number — {hint}"))?;
        let bytes = (v * mult as f64).round();
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(format!("size \"{t}\" is too large"));
        }
        return Ok(bytes as u64);
    }
    let v: u64 = num
        .parse()
        .map_err(|_| format!("size \"{t}\" is not a number — {hint}"))?;
    v.checked_mul(mult)
        .ok_or_else(|| format!("size \"{t}\" is too large"))
}

/// Inclusive `first-last` text of a range, as cluster files write it.
fn layers_text(r: &Range<usize>) -> String {
    format!("{}-{}", r.start, r.end.saturating_sub(1))
}
fn required_path(
    src: &Source,
    v: Option<Spanned<String>>,
    field: &str,
    example: &str,
    base: &Path,
) -> Result<PathBuf> {
    let Some(v) = v else {
        return Err(anyhow::anyhow!(
            "{}: missing required field `{field}` — add {field} = {example} at the top of the \
             file, before any [table]",
            src.file
        ));
    };
    let p = v.get_ref().trim();
    if p.is_empty() {
        return Err(src.err(
            &v,
            format!("field `{field}` is empty — write e.g. {field} = {example}"),
        ));
    }
    Ok(base.join(p))
}

/// A whole number field that must be at least 1.
fn positive(
    src: &Source,
    v: &Spanned<i64>,
    what: &str,
    field: &str,
    example: &str,
    max: usize,
) -> Result<usize> {
    let n = *v.get_ref();
    match usize::try_from(n) {
        Ok(n) if n > max => Err(src.err(
            v,
            format!("{what}field `{field}` is {n} — ringllm accepts at most {max}, e.g. {example}"),
        )),
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(src.err(
            v,
            format!("{what}field `{field}` is {n} — it must be at least 1, e.g. {example}"),
        )),
    }
}

/// A `memory` field: a size string or a whole number of bytes, more than 0.
fn size_field(src: &Source, v: &Spanned<toml::Value>, what: &str) -> Result<u64> {
    let bytes = match v.get_ref() {
        toml::Value::Integer(n) => u64::try_from(*n).map_err(|_| {
            let msg = format!(
                "{what}field `memory` is {n} — it must be a positive size, e.g. \
                 memory = \"4GiB\""
            );
            src.err(v, msg)
        })?,
        toml::Value::String(s) => {
            parse_size(s).map_err(|e| src.err(v, format!("{what}field `memory`: {e}")))?
        }
        other => {
            return Err(src.err(
                v,
                format!(
                    "{what}field `memory` is {} — write a size such as memory = \"4GiB\" or a \
                     whole number of bytes",
                    a_type(other)
                ),
            ))
        }
    };
    if bytes == 0 {
        let msg = format!(
            "{what}field `memory` is 0 — give a size such as memory = \"4GiB\", or remove the \
             line for no cap"
        );
        return Err(src.err(v, msg));
    }
    Ok(bytes)
}

fn node(src: &Source, raw: &RawNode, index: usize, line: usize) -> Result<StageConfig> {
    let name = match &raw.name {
        None => {
            return Err(src.at(
                line,
                format!(
                    "node #{}: missing required field `name` — add e.g. name = \"node{}\"",
                    index + 1,
                    index + 1
                ),
            ))
        }
        Some(n) if n.get_ref().trim().is_empty() => {
            let msg = format!(
                "node #{}: field `name` is empty — give the node a name, e.g. name = \"node{}\"",
                index + 1,
                index + 1
            );
            return Err(src.err(n, msg));
        }
        Some(n) => n.get_ref().trim().to_string(),
    };
    let what = format!("node \"{name}\": ");
    let local = raw.local.as_ref().is_some_and(|l| *l.get_ref());
    let address = match (&raw.address, local) {
        (Some(a), true) => {
            return Err(src.err(
                a,
                format!(
                    "{what}field `address` is set on a local node — a node with local = true runs \
                     inside the coordinator; remove `address` or `local`"
                ),
            ))
        }
        (None, true) => None,
        (None, false) => {
            return Err(src.at(
                line,
                format!(
                    "{what}missing field `address` — write it as host:port, e.g. address = \
                     \"192.168.1.20:7701\", or set local = true to run these layers in the \
                     coordinator"
                ),
            ))
        }
        (Some(a), false) => {
            let text = a.get_ref().trim();
            check_address(text)
                .map_err(|e| src.err(a, format!("{what}field `address` \"{text}\" {e}")))?;
            Some(text.to_string())
        }
    };
    let layers = match &raw.layers {
        None => None,
        Some(v) => Some(match v.get_ref() {
            toml::Value::String(s) => {
                parse_layers(s).map_err(|e| src.err(v, format!("{what}field `layers`: {e}")))?
            }
            toml::Value::Integer(n) => {
                let l = usize::try_from(*n).map_err(|_| {
                    let msg = format!(
                        "{what}field `layers` is {n} — layer numbers start at 0; write e.g. \
                         layers = \"0-8\""
                    );
                    src.err(v, msg)
                })?;
                l..l.saturating_add(1)
            }
            other => {
                return Err(src.err(
                    v,
                    format!(
                        "{what}field `layers` is {} — write an inclusive range as a string, e.g. \
                         layers = \"0-8\"",
                        a_type(other)
                    ),
                ))
            }
        }),
    };
    let memory = match &raw.memory {
        None => None,
        Some(m) => Some(size_field(src, m, &what)?),
    };
    let threads = match &raw.threads {
        None => None,
        Some(t) => Some(positive(
            src,
            t,
            &what,
            "threads",
            "threads = 1",
            limits::MAX_THREADS,
        )?),
    };
    let transport = match &raw.transport {
        None => None,
        Some(t) if local => {
            return Err(src.err(
                t,
                format!(
                    "{what}field `transport` on a local stage — it runs inside the coordinator, \
                     with no link of its own; remove the line"
                ),
            ))
        }
        Some(t) => Some(transport_field(src, t, &what)?),
    };
    Ok(StageConfig {
        name,
        address,
        local,
        layers,
        memory,
        threads,
        transport,
        line,
    })
}

fn transport_field(src: &Source, t: &Spanned<String>, what: &str) -> Result<TransportKind> {
    TransportKind::from_name(t.get_ref()).ok_or_else(|| {
        src.err(
            t,
            format!(
                "{what}field `transport` \"{}\" is not a transport — write transport = \"tcp\", \
                 \"udp\", \"quic\" or \"uring\"",
                t.get_ref()
            ),
        )
    })
}

/// Checks a `host:port` address; the error completes `field `address` "..." `.
fn check_address(a: &str) -> Result<(), String> {
    let example = "e.g. \"192.168.1.20:7701\"";
    if a.is_empty() {
        return Err(format!("is empty — write it as host:port, {example}"));
    }
    if a.chars().any(char::is_whitespace) {
        return Err(format!(
            "contains spaces — write it as host:port, {example}"
        ));
    }
    if let Some((_, rest)) = a.split_once("://") {
        return Err(format!(
            "has a scheme — write only host:port, e.g. \"{rest}\""
        ));
    }
    let (host, port) = if let Some(inner) = a.strip_prefix('[') {
        let Some((host, rest)) = inner.split_once(']') else {
            return Err("has no closing ] — write an IPv6 address as \"[::1]:7701\"".to_string());
        };
        match rest.strip_prefix(':') {
            Some(p) => (host, p),
            None => {
                return Err(format!(
                    "has no port — write it as host:port, e.g. \"[{host}]:7701\""
                ))
            }
        }
    } else {
        match a.rsplit_once(':') {
            None => {
                return Err(format!(
                    "has no port — write it as host:port, e.g. \"{a}:7701\""
                ))
            }
            Some((h, _)) if h.contains(':') => {
                return Err(format!(
                    "looks like an IPv6 address — put it in brackets before the port, e.g. \
                     \"[{a}]:7701\""
                ))
            }
            Some(hp) => hp,
        }
    };
    if host.is_empty() {
        return Err(format!("has no host — write it as host:port, {example}"));
    }
    match port.parse::<u16>() {
        Ok(p) if p >= 1 => Ok(()),
        _ if port.is_empty() => Err(format!(
            "has no port — write it as host:port, e.g. \"{host}:7701\""
        )),
        _ => Err(format!(
            "has port \"{port}\", which is not a number from 1 to 65535"
        )),
    }
}

/// Checks across stages: unique names and addresses, one local stage, pins in order.
fn check_stages(src: &Source, stages: &[StageConfig]) -> Result<()> {
    for (i, s) in stages.iter().enumerate() {
        for prev in &stages[..i] {
            if prev.name == s.name {
                return Err(src.at(
                    s.line,
                    format!(
                        "node \"{}\": field `name` is also used by the node at line {} — node \
                         names must be unique",
                        s.name, prev.line
                    ),
                ));
            }
            if let (Some(a), Some(b)) = (&prev.address, &s.address) {
                if a.eq_ignore_ascii_case(b) {
                    return Err(src.at(
                        s.line,
                        format!(
                            "node \"{}\": field `address` \"{b}\" is also node \"{}\"'s (line \
                             {}) — each node needs its own host:port",
                            s.name, prev.name, prev.line
                        ),
                    ));
                }
            }
            if prev.local && s.local {
                return Err(src.at(
                    s.line,
                    format!(
                        "node \"{}\": field `local` — node \"{}\" (line {}) is already the \
                         local stage; at most one node may have local = true",
                        s.name, prev.name, prev.line
                    ),
                ));
            }
        }
    }

    // Pins, in ring order: `prev` is the last pinned stage seen, `free` the unpinned stages since.
    let mut prev: Option<&StageConfig> = None;
    let mut free = 0usize;
    for s in stages {
        let Some(r) = &s.layers else {
            free += 1;
            continue;
        };
        let what = format!("node \"{}\": field `layers` \"{}\"", s.name, layers_text(r));
        let start_at = match prev {
            None => 0,
            Some(p) => p.layers.as_ref().map_or(0, |pr| pr.end),
        };
        let after = match prev {
            None => "the start of the ring".to_string(),
            Some(p) => format!(
                "node \"{}\" (line {}, layers \"{}\")",
                p.name,
                p.line,
                p.layers.as_ref().map_or_else(String::new, layers_text)
            ),
        };
        if let Some(p) = prev.filter(|_| r.start < start_at) {
            let fix = if r.end <= p.layers.as_ref().map_or(0, |pr| pr.start) {
                "the [[node]] tables are the ring order; list the nodes in layer order"
            } else {
                "each layer belongs to exactly one node"
            };
            return Err(src.at(
                s.line,
                format!("{what} overlaps or comes before {after} — {fix}"),
            ));
        }
        let gap = r.start - start_at;
        if free == 0 && gap > 0 && prev.is_none() {
            return Err(src.at(
                s.line,
                format!(
                    "{what} leaves layers {}-{} to no node — the first pinned node must start at \
                     layer 0, or put a node without `layers` before it",
                    start_at,
                    r.start - 1
                ),
            ));
        }
        if free == 0 && gap > 0 {
            return Err(src.at(
                s.line,
                format!(
                    "{what} leaves layers {}-{} after {after} to no node — start at layer \
                     {start_at}, or add a node without `layers` in between",
                    start_at,
                    r.start - 1
                ),
            ));
        }
        if gap < free {
            return Err(src.at(
                s.line,
                format!(
                    "{what} leaves {gap} layer(s) after {after} for the {free} node(s) without \
                     `layers` in between — each node needs at least one layer; move the pins apart \
                     or pin those nodes too"
                ),
            ));
        }
        prev = Some(s);
        free = 0;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
