//! The tokenizer of a checkpoint as GGUF `tokenizer.*` metadata:
//!
//! - `tokenizer.model` (a SentencePiece model, protobuf): `tokenizer.ggml.model = "llama"`
//!   with the pieces, their scores and types (Llama 2, Gemma 2/3, Phi-3);
//! - else `tokenizer.json` with a byte-level BPE model: `"gpt2"` with its vocabulary, merges
//!   and the pre-tokenizer named after its split expression (Llama 3, Qwen 2/3, Mistral);
//!   an expression we do not know is refused by name, never guessed.
//!
//! Added tokens (`tokenizer.json` `added_tokens`, `tokenizer_config.json`
//! `added_tokens_decoder`) are control tokens when special, user-defined otherwise; ids the
//! vocabulary lacks up to the embedding's row count become `[PAD{id}]` unused tokens. The
//! special ids, `add_bos_token` / `add_eos_token` and the chat template come from
//! `tokenizer_config.json` (`chat_template.jinja` when present), then `config.json`.

use super::config::HfConfig;
use super::ConvertError;
use ringllm_model::gguf::{Array, Value};
use serde_json::{Map, Value as Json};
use std::path::Path;

const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// The most tokens a vocabulary may have.
const MAX_TOKENS: usize = 1 << 22;

/// The GGUF tokenizer metadata and the vocabulary size.
pub struct Vocab {
    pub kv: Vec<(String, Value)>,
    pub n_tokens: usize,
}

#[derive(Debug)]
pub(super) struct Tokens {
    pub(super) text: Vec<String>,
    pub(super) scores: Option<Vec<f32>>,
    pub(super) types: Vec<i32>,
}

impl Tokens {
    fn set(&mut self, id: usize, text: &str, ty: i32) {
        if id >= self.text.len() {
            self.text.resize_with(id + 1, String::new);
            self.types.resize(id + 1, UNUSED);
            if let Some(s) = &mut self.scores {
                s.resize(id + 1, -10_000.0);
            }
        }
        self.text[id] = text.to_string();
        self.types[id] = ty;
        if let Some(s) = &mut self.scores {
            s[id] = -1000.0;
        }
    }

    fn id_of(&self, text: &str) -> Option<u32> {
        self.text.iter().position(|t| t == text).map(|i| i as u32)
    }
}

fn read_json(path: &Path) -> Result<Json, ConvertError> {
    let text = super::read_text(path)?;
    serde_json::from_str(&text).map_err(|e| ConvertError::Config {
        file: path.to_path_buf(),
        key: String::new(),
        why: format!("not JSON: {e}"),
    })
}

fn tok_err(file: &Path, key: &str, why: impl Into<String>) -> ConvertError {
    ConvertError::Config {
        file: file.to_path_buf(),
        key: key.to_string(),
        why: why.into(),
    }
}

/// Reads the tokenizer of `dir`. `rows`: the embedding's row count (the vocabulary is padded
/// to it); `gemma`: Gemma's files say `add_space_prefix = false`.
pub fn read(dir: &Path, cfg: &HfConfig, rows: usize, gemma: bool) -> Result<Vocab, ConvertError> {
    let tc_path = dir.join("tokenizer_config.json");
    let tc: Map<String, Json> = if tc_path.is_file() {
        match read_json(&tc_path)? {
            Json::Object(m) => m,
            _ => return Err(tok_err(&tc_path, "", "not a JSON object")),
        }
    } else {
        Map::new()
    };
    let tj_path = dir.join("tokenizer.json");
    let tj = if tj_path.is_file() {
        Some(read_json(&tj_path)?)
    } else {
        None
    };
    let spm_path = dir.join("tokenizer.model");
    let mut kv: Vec<(String, Value)> = Vec::new();
    let mut toks = if spm_path.is_file() {
        let bytes = std::fs::read(&spm_path).map_err(|e| ConvertError::io(&spm_path, e))?;
        let (toks, add_prefix) = parse_spm(&bytes).map_err(|why| tok_err(&spm_path, "", why))?;
        kv.push(("tokenizer.ggml.model".into(), Value::Str("llama".into())));
        kv.push(("tokenizer.ggml.pre".into(), Value::Str("default".into())));
        kv.push((
            "tokenizer.ggml.add_space_prefix".into(),
            Value::Bool(add_prefix && !gemma),
        ));
        toks
    } else if let Some(tj) = &tj {
        let (toks, merges, pre) = bpe_from_json(&tj_path, tj)?;
        kv.push(("tokenizer.ggml.model".into(), Value::Str("gpt2".into())));
        kv.push(("tokenizer.ggml.pre".into(), Value::Str(pre.into())));
        kv.push((
            "tokenizer.ggml.merges".into(),
            Value::Array(Array::Str(merges)),
        ));
        toks
    } else {
        return Err(ConvertError::Missing(format!(
            "{} has no tokenizer.model or tokenizer.json",
            dir.display()
        )));
    };
    // Added tokens, over the model's own.
    if let Some(added) = tj
        .as_ref()
        .and_then(|t| t.get("added_tokens"))
        .and_then(Json::as_array)
    {
        for (i, a) in added.iter().enumerate() {
            let key = format!("added_tokens[{i}]");
            let id = a
                .get("id")
                .and_then(Json::as_u64)
                .ok_or_else(|| tok_err(&tj_path, &key, "no integer \"id\""))?
                as usize;
            let content = a
                .get("content")
                .and_then(Json::as_str)
                .ok_or_else(|| tok_err(&tj_path, &key, "no \"content\""))?;
            if id >= MAX_TOKENS {
                return Err(tok_err(&tj_path, &key, format!("id {id} is too large")));
            }
            let special = a.get("special").and_then(Json::as_bool).unwrap_or(false);
            toks.set(id, content, if special { CONTROL } else { USER_DEFINED });
        }
    }
    if let Some(dec) = tc.get("added_tokens_decoder").and_then(Json::as_object) {
        for (id, a) in dec {
            let key = format!("added_tokens_decoder[\"{id}\"]");
            let id: usize = id
                .parse()
                .ok()
                .filter(|&i| i < MAX_TOKENS)
                .ok_or_else(|| tok_err(&tc_path, &key, "not a token id"))?;
            let content = a
                .get("content")
                .and_then(Json::as_str)
                .ok_or_else(|| tok_err(&tc_path, &key, "no \"content\""))?;
            let special = a.get("special").and_then(Json::as_bool).unwrap_or(false);
            toks.set(id, content, if special { CONTROL } else { USER_DEFINED });
        }
    }
    if toks.text.len() > rows {
        return Err(ConvertError::Config {
            file: if tj.is_some() {
                tj_path.clone()
            } else {
                spm_path.clone()
            },
            key: String::new(),
            why: format!(
                "the tokenizer has {} tokens but the embedding only {rows} rows",
                toks.text.len()
            ),
        });
    }
    let n_real = toks.text.len();
    if !gemma {
        // Ids without a token up to the embedding's size: padding.
        for id in n_real..rows {
            toks.set(id, &format!("[PAD{id}]"), UNUSED);
            if let Some(s) = &mut toks.scores {
                s[id] = -10_000.0;
            }
        }
    }
    for (id, t) in toks.text.iter_mut().enumerate() {
        if t.is_empty() {
            *t = format!("[PAD{id}]");
        }
    }
    specials(&mut kv, &toks, &tc, &tc_path, tj.as_ref(), cfg, dir)?;
    let n_tokens = toks.text.len();
    kv.push((
        "tokenizer.ggml.tokens".into(),
        Value::Array(Array::Str(toks.text)),
    ));
    if let Some(s) = toks.scores {
        kv.push(("tokenizer.ggml.scores".into(), Value::Array(Array::F32(s))));
    }
    kv.push((
        "tokenizer.ggml.token_type".into(),
        Value::Array(Array::I32(toks.types)),
    ));
    Ok(Vocab { kv, n_tokens })
}

/// The token text of a `tokenizer_config.json` special-token entry: a string, or an object
/// with `content`.
fn token_text(v: &Json) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(Json::as_str))
}

/// Special ids, flags and the chat template.
fn specials(
    kv: &mut Vec<(String, Value)>,
    toks: &Tokens,
    tc: &Map<String, Json>,
    tc_path: &Path,
    tj: Option<&Json>,
    cfg: &HfConfig,
    dir: &Path,
) -> Result<(), ConvertError> {
    for (name, gguf) in [
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"),
    ] {
        let key = format!("{name}_token");
        let from_tc = match tc.get(&key).filter(|v| !v.is_null()) {
            Some(v) => {
                let text = token_text(v)
                    .ok_or_else(|| tok_err(tc_path, &key, "neither a string nor {content}"))?;
                Some(toks.id_of(text).ok_or_else(|| {
                    tok_err(tc_path, &key, format!("'{text}' is not in the vocabulary"))
                })?)
            }
            None => None,
        };
        let cfg_key = format!("{name}_token_id");
        let id = match from_tc {
            Some(id) => Some(id),
            None => match cfg.get(&cfg_key) {
                // eos_token_id may be a list: the first is the one GGUF holds.
                Some(Json::Array(a)) => a.first().and_then(Json::as_u64).map(|x| x as u32),
                Some(v) => v.as_u64().map(|x| x as u32),
                None => None,
            },
        };
        if let Some(id) = id {
            if id as usize >= toks.text.len() {
                return Err(cfg.error(
                    &cfg_key,
                    format!("{id} is past the {} tokens", toks.text.len()),
                ));
            }
            kv.push((format!("tokenizer.ggml.{gguf}"), Value::U32(id)));
        }
    }
    let add_bos = match tc.get("add_bos_token").and_then(Json::as_bool) {
        Some(b) => Some(b),
        None => tj.and_then(post_processor_adds_bos),
    };
    if let Some(b) = add_bos {
        kv.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(b)));
    }
    if let Some(b) = tc.get("add_eos_token").and_then(Json::as_bool) {
        kv.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(b)));
    }
    if let Some(t) = chat_template(tc, tc_path, dir)? {
        kv.push(("tokenizer.chat_template".into(), Value::Str(t)));
    }
    Ok(())
}

/// Whether `tokenizer.json`'s post-processor puts a special token before the text
/// (`TemplateProcessing` whose single template starts with one).
fn post_processor_adds_bos(tj: &Json) -> Option<bool> {
    let pp = tj.get("post_processor")?;
    let tp = match pp.get("type").and_then(Json::as_str)? {
        "TemplateProcessing" => pp,
        "Sequence" => pp
            .get("processors")?
            .as_array()?
            .iter()
            .find(|p| p.get("type").and_then(Json::as_str) == Some("TemplateProcessing"))?,
        _ => return None,
    };
    let first = tp.get("single")?.as_array()?.first()?;
    Some(first.get("SpecialToken").is_some())
}

/// `tokenizer_config.json`'s `chat_template` (a string, or named templates of which the
/// `default` one), else `chat_template.jinja`, else `chat_template.json`.
fn chat_template(
    tc: &Map<String, Json>,
    tc_path: &Path,
    dir: &Path,
) -> Result<Option<String>, ConvertError> {
    match tc.get("chat_template") {
        Some(Json::String(s)) => return Ok(Some(s.clone())),
        Some(Json::Array(list)) => {
            let t = list
                .iter()
                .find(|e| e.get("name").and_then(Json::as_str) == Some("default"))
                .or_else(|| list.first())
                .and_then(|e| e.get("template"))
                .and_then(Json::as_str)
                .ok_or_else(|| tok_err(tc_path, "chat_template", "a list without a template"))?;
            return Ok(Some(t.to_string()));
        }
        Some(Json::Null) | None => {}
        Some(_) => {
            return Err(tok_err(
                tc_path,
                "chat_template",
                "neither a string nor a list",
            ))
        }
    }
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return super::read_text(&jinja).map(Some);
    }
    let json = dir.join("chat_template.json");
    if json.is_file() {
        let v = read_json(&json)?;
        return Ok(v
            .get("chat_template")
            .and_then(Json::as_str)
            .map(str::to_string));
    }
    Ok(None)
}

/// Split expressions of byte-level BPE tokenizers as `tokenizer.json` spells them, and the
/// `tokenizer.ggml.pre` name llama.cpp gives each.
const PRE_PATTERNS: &[(&str, &str)] = &[
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "llama-bpe",
    ),
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen2",
    ),
    (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen35",
    ),
    (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "tekken",
    ),
];

/// The `tokenizer.ggml.pre` name of a `tokenizer.json` pre-tokenizer.
pub(super) fn pre_name(file: &Path, pre: Option<&Json>) -> Result<&'static str, ConvertError> {
    let bad = |why: String| tok_err(file, "pre_tokenizer", why);
    let Some(pre) = pre.filter(|p| !p.is_null()) else {
        return Err(bad("missing: a byte-level BPE needs one".into()));
    };
    let ty = pre.get("type").and_then(Json::as_str).unwrap_or("");
    let list: Vec<&Json> = match ty {
        "Sequence" => pre
            .get("pretokenizers")
            .and_then(Json::as_array)
            .map(|a| a.iter().collect())
            .unwrap_or_default(),
        _ => vec![pre],
    };
    let kinds: Vec<&str> = list
        .iter()
        .map(|p| p.get("type").and_then(Json::as_str).unwrap_or(""))
        .collect();
    let byte_level_regex = |p: &Json| p.get("use_regex").and_then(Json::as_bool).unwrap_or(true);
    match kinds.as_slice() {
        ["ByteLevel"] if byte_level_regex(list[0]) => Ok("gpt-2"),
        ["Digits", "ByteLevel"] if byte_level_regex(list[1]) => Ok("smollm"),
        ["Split", "ByteLevel"] => {
            let pattern = list[0]
                .get("pattern")
                .and_then(|p| p.get("Regex"))
                .and_then(Json::as_str)
                .ok_or_else(|| bad("a Split without a Regex pattern".into()))?;
            PRE_PATTERNS
                .iter()
                .find(|(p, _)| *p == pattern)
                .map(|(_, name)| *name)
                .ok_or_else(|| bad(format!("unknown split expression {pattern:?}")))
        }
        _ => Err(bad(format!("unknown pre-tokenizer sequence {kinds:?}"))),
    }
}

/// A byte-level BPE `tokenizer.json`: tokens by id, merges, pre-tokenizer name.
fn bpe_from_json(
    file: &Path,
    tj: &Json,
) -> Result<(Tokens, Vec<String>, &'static str), ConvertError> {
    let bad = |key: &str, why: String| tok_err(file, key, why);
    let model = tj
        .get("model")
        .ok_or_else(|| bad("model", "missing".into()))?;
    let ty = model.get("type").and_then(Json::as_str).unwrap_or("");
    if ty != "BPE" {
        return Err(bad(
            "model.type",
            format!("'{ty}': without tokenizer.model we convert byte-level BPE tokenizers only"),
        ));
    }
    if model.get("byte_fallback").and_then(Json::as_bool) == Some(true) {
        return Err(bad(
            "model.byte_fallback",
            "a SentencePiece-style BPE: put its tokenizer.model beside it".into(),
        ));
    }
    let pre = pre_name(file, tj.get("pre_tokenizer"))?;
    let vocab = model
        .get("vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| bad("model.vocab", "missing".into()))?;
    if vocab.len() > MAX_TOKENS {
        return Err(bad("model.vocab", format!("{} tokens", vocab.len())));
    }
    let mut toks = Tokens {
        text: Vec::new(),
        scores: None,
        types: Vec::new(),
    };
    for (text, id) in vocab {
        let id = id
            .as_u64()
            .filter(|&i| (i as usize) < MAX_TOKENS)
            .ok_or_else(|| bad("model.vocab", format!("{text:?}: bad id {id}")))?;
        toks.set(id as usize, text, NORMAL);
    }
    let merges_json = model
        .get("merges")
        .and_then(Json::as_array)
        .ok_or_else(|| bad("model.merges", "missing".into()))?;
    let mut merges = Vec::with_capacity(merges_json.len());
    for (i, m) in merges_json.iter().enumerate() {
        let s = match m {
            Json::String(s) => s.clone(),
            Json::Array(p) => match p.as_slice() {
                [Json::String(a), Json::String(b)] => format!("{a} {b}"),
                _ => return Err(bad("model.merges", format!("entry {i} is not a pair"))),
            },
            _ => return Err(bad("model.merges", format!("entry {i} is not a pair"))),
        };
        merges.push(s);
    }
    Ok((toks, merges, pre))
}

/// Reads a protobuf varint at `*at`.
fn varint(b: &[u8], at: &mut usize) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at).ok_or("truncated varint")?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("varint longer than 10 bytes".into())
}

/// A protobuf field: number, wire type, payload.
type Field<'a> = (u64, u8, &'a [u8]);

/// The fields of one protobuf message: (field number, wire type, payload; a varint's own
/// bytes for wire type 0).
fn fields(b: &[u8]) -> Result<Vec<Field<'_>>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        let key = varint(b, &mut at)?;
        let (field, wire) = (key >> 3, (key & 7) as u8);
        let start = at;
        let len = match wire {
            0 => {
                varint(b, &mut at)?;
                out.push((field, wire, &b[start..at]));
                continue;
            }
            1 => 8,
            5 => 4,
            2 => usize::try_from(varint(b, &mut at)?).map_err(|_| "length overflows")?,
            w => return Err(format!("unsupported wire type {w} (field {field})")),
        };
        let end = at
            .checked_add(len)
            .filter(|&e| e <= b.len())
            .ok_or_else(|| format!("field {field} runs past the end (truncated file)"))?;
        out.push((field, wire, &b[at..end]));
        at = end;
    }
    Ok(out)
}

/// A SentencePiece `ModelProto`: the pieces (text, score, type) and `add_dummy_prefix`.
pub(super) fn parse_spm(b: &[u8]) -> Result<(Tokens, bool), String> {
    let mut toks = Tokens {
        text: Vec::new(),
        scores: Some(Vec::new()),
        types: Vec::new(),
    };
    let mut add_prefix = true;
    for (field, wire, payload) in fields(b)? {
        match (field, wire) {
            (1, 2) => {
                let (mut text, mut score, mut ty) = (String::new(), 0f32, NORMAL);
                for (f, w, p) in fields(payload)? {
                    match (f, w) {
                        (1, 2) => {
                            text = std::str::from_utf8(p)
                                .map_err(|_| format!("piece {} is not UTF-8", toks.text.len()))?
                                .to_string();
                        }
                        (2, 5) => score = f32::from_le_bytes([p[0], p[1], p[2], p[3]]),
                        (3, 0) => {
                            let mut at = 0;
                            ty = match varint(p, &mut at)? {
                                1 => NORMAL,
                                2 => UNKNOWN,
                                3 => CONTROL,
                                4 => USER_DEFINED,
                                5 => UNUSED,
                                6 => BYTE,
                                t => return Err(format!("piece {text:?}: unknown type {t}")),
                            };
                        }
                        _ => {}
                    }
                }
                if toks.text.len() >= MAX_TOKENS {
                    return Err(format!("more than {MAX_TOKENS} pieces"));
                }
                toks.text.push(text);
                toks.types.push(ty);
                if let Some(s) = &mut toks.scores {
                    s.push(score);
                }
            }
            (3, 2) => {
                for (f, w, p) in fields(payload)? {
                    if (f, w) == (3, 0) {
                        let mut at = 0;
                        add_prefix = varint(p, &mut at)? != 0;
                    }
                }
            }
            _ => {}
        }
    }
    if toks.text.is_empty() {
        return Err("no pieces: not a SentencePiece model".into());
    }
    Ok((toks, add_prefix))
}
