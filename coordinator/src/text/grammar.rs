//! Constrained decoding: a JSON schema, a regular expression or a Lark grammar compiled by
//! llguidance into a matcher that gives, at every step, the set of tokens that keep the
//! output inside the grammar (a mask over the vocabulary).
//!
//! [`Grammars`] is built once per model from its tokenizer: every token's bytes go into
//! llguidance's token trie, control tokens (`<|im_end|>`) as their marked names so that no
//! grammar text can produce them, and the end-of-generation tokens as the trie's EOS set (a
//! finished grammar allows exactly those). [`Grammars::compile`] turns a request's
//! [`GrammarSpec`] into a [`Constraint`]; a schema or grammar llguidance cannot take is an
//! error whose text names what (the HTTP layer answers 400 with it).
//!
//! A [`Constraint`] is advanced one sampled token at a time and computes the next mask; the
//! scheduler does that on its own thread while the forward pass runs (see
//! `serve::scheduler::masks`), so a grammar costs no step time when the mask is ready first.

use crate::text::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI's `json_object`, Ollama's `"json"`).
    JsonObject,
    /// A value valid against this JSON schema.
    JsonSchema(Value),
    /// Text matching this regular expression (whole output).
    Regex(String),
    /// A Lark grammar in llguidance's dialect (which also takes `%json{...}` rules).
    Lark(String),
}

impl GrammarSpec {
    /// The grammar llguidance compiles. JSON is compact (`", "` and `": "` between items, no
    /// free whitespace): a small model given room for whitespace can fill its whole answer
    /// with it.
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

impl GrammarSpec {
    /// For a harmony model (gpt-oss), whose reply opens with its analysis channel: the
    /// reasoning is left free and the grammar applies to the final channel's message, so the
    /// answer (`content`) is what the client asked for. A Lark grammar is the client's own and
    /// stays as given.
    pub fn after_harmony_analysis(self) -> GrammarSpec {
        let body = match &self {
            GrammarSpec::JsonObject => {
                format!("%json {}", compact(serde_json::json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(schema) => format!("%json {}", compact(schema.clone())),
            GrammarSpec::Regex(rx) => format!("/{}/", rx.replace('/', "\\/")),
            GrammarSpec::Lark(_) => return self,
        };
        GrammarSpec::Lark(format!(
            "start: analysis? <|channel|> \"final\" <|message|> body\n\
             analysis: <|channel|> \"analysis\" <|message|> ANALYSIS <|end|> <|start|> \"assistant\"\n\
             ANALYSIS: /(.|\\n)*/\n\
             body: {body}\n"
        ))
    }
}

/// The JSON options llguidance reads from `x-guidance` in the schema (an `x-guidance` the
/// client sent wins).
fn compact(mut schema: Value) -> Value {
    let opts = serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    });
    match &mut schema {
        Value::Object(m) => {
            m.entry("x-guidance").or_insert(opts);
            schema
        }
        // `true`/`false` schemas: llguidance wants an object to hold the options.
        Value::Bool(true) => serde_json::json!({"x-guidance": opts}),
        other => other.clone(),
    }
}

/// llguidance's view of our tokenizer.
struct Env {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tok
            .encode_text(&String::from_utf8_lossy(s), false)
            .unwrap_or_else(|_| self.trie.greedy_tokenize(s))
    }

    /// Not claimed: a SentencePiece vocabulary's text in the middle of a sequence is not
    /// always what encoding it alone gives, and we never use forced-token shortcuts.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// A model's grammar compiler: built once (the trie of a 262k vocabulary takes a moment).
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grammars(vocab {})", self.vocab)
    }
}

impl Grammars {
    /// For a model whose logits have `vocab` rows (at least the tokenizer's vocabulary; rows
    /// past it are never allowed).
    pub fn new(tok: &Arc<Tokenizer>, vocab: usize) -> anyhow::Result<Grammars> {
        let vocab = vocab.max(tok.vocab_size());
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                if id as usize >= tok.vocab_size() {
                    Vec::new()
                } else if tok.is_control(id) || tok.is_eog(id) {
                    // Marked as special: reachable only by a grammar naming it.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tok.id_to_piece(id).unwrap_or_default().as_bytes());
                    w
                } else {
                    tok.token_bytes(id, false)
                }
            })
            .collect();
        let eog = tok.eog_ids();
        let eos = eog.first().copied().or(tok.eos()).unwrap_or(0);
        let info = TokRxInfo::new(vocab as u32, eos);
        // The trie asserts what it takes (a token over its length limit, say): a vocabulary
        // it refuses is an error for the constrained request, not a panic in the server.
        let trie = std::panic::catch_unwind(|| {
            let trie = TokTrie::from(&info, &words);
            if eog.is_empty() {
                trie
            } else {
                trie.with_eos_tokens(&eog)
            }
        })
        .map_err(|_| anyhow::anyhow!("the grammar library refused this vocabulary"))?;
        let env: TokEnv = Arc::new(Env {
            trie,
            tok: Arc::clone(tok),
        });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Grammars { factory, vocab })
    }

    /// Compiles a request's grammar; the error names what llguidance could not take.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, String> {
        let parser = self
            .factory
            .create_parser(spec.top_level())
            .map_err(|e| first_line(&e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(first_line(&e));
        }
        Ok(Constraint {
            matcher,
            mask: None,
            mask_time: Duration::ZERO,
            masks: 0,
        })
    }
}

fn first_line(e: &str) -> String {
    let e = e.trim();
    e.lines().next().unwrap_or(e).to_string()
}

/// One sequence's grammar state and its mask for the next token.
pub struct Constraint {
    matcher: Matcher,
    mask: Option<SimpleVob>,
    /// Time spent computing masks (and advancing), and how many.
    pub mask_time: Duration,
    pub masks: u64,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraint({} masks)", self.masks)
    }
}

impl Constraint {
    /// Takes the sampled token `token` (if any) and computes the mask for the next one.
    pub fn advance(&mut self, token: Option<u32>) -> Result<(), String> {
        let t0 = Instant::now();
        self.mask = None;
        if let Some(t) = token {
            self.matcher.consume_token(t).map_err(|e| {
                format!(
                    "the grammar refused token {t}: {}",
                    first_line(&e.to_string())
                )
            })?;
        }
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| format!("the grammar failed: {}", first_line(&e.to_string())))?;
        self.mask = Some(mask);
        self.mask_time += t0.elapsed();
        self.masks += 1;
        Ok(())
    }

    /// Whether the mask for the next token is computed.
    pub fn ready(&self) -> bool {
        self.mask.is_some()
    }

    /// Sets every logit the grammar does not allow to −∞. False when the mask allows nothing
    /// (the grammar is stuck) or was not computed.
    pub fn apply(&self, logits: &mut [f32]) -> bool {
        let Some(mask) = &self.mask else {
            return false;
        };
        let mut any = false;
        let n = mask.len();
        for (i, l) in logits.iter_mut().enumerate() {
            if i < n && mask.is_allowed(i as u32) {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        any
    }

    /// Whether the grammar is complete (nothing more may follow).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests;
