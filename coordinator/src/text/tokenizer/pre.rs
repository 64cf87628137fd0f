//! The byte-level BPE pre-tokenizers, by the `tokenizer.ggml.pre` names llama.cpp gives them.

use super::{hf_err, TokenizerError};
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

// Split expressions. Contractions are spelled case by case ('[sS]), not with (?i:), so that
// Unicode case folding cannot make "'ſ" a contraction (llama.cpp spells them the same way).
const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
// Mistral's Tekken (Mistral Nemo, Small 3, Ministral): its tokenizer.json expression (an
// upper-case run may lead a lower-case one; digits one by one; `/` joins the punctuation run).
const TEKKEN_RE: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
// o200k (gpt-oss, GPT-4o; `tokenizer.ggml.pre = "gpt-4o"`): a word is a run of "upper" letters
// then "lower" ones (or the other way round) with an optional contraction, so "HTTPServer" is one
// piece, "camelCase" two; digits in threes; `/` joins a punctuation run's trailing newlines.
// tiktoken's expression says upper = Lu Lt Lm Lo M and lower = Ll Lm Lo M. llama.cpp cannot
// express those classes (its regex runs over text whose non-ASCII letters are all folded to one
// placeholder) and writes upper as "a letter but not a-z", lower as "a letter but not A-Z",
// without marks. We follow llama.cpp, the reference the GGUF files are made for: the two only
// differ where a non-ASCII cased letter or a combining mark meets case (llama.cpp splits
// "ÉCOLE" into "É" "COLE"; tiktoken keeps it whole).
const O200K_RE: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?(?:(?=\p{L})[^a-z])*(?:(?=\p{L})[^A-Z])+",
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?",
    r"|[^\r\n\p{L}\p{N}]?(?:(?=\p{L})[^a-z])+(?:(?=\p{L})[^A-Z])*",
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const QWEN35_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A byte-level BPE pre-tokenizer: regular expressions applied one after the other (each
/// splits the pieces the previous one left, matches and the text between them alike).
pub(super) struct PreTokenizerDef {
    /// `tokenizer.ggml.pre` values that mean this pre-tokenizer.
    pub(super) names: &'static [&'static str],
    pub(super) splits: &'static [&'static str],
    /// A whole piece that is a token is taken as is, without merging (Llama 3).
    pub(super) ignore_merges: bool,
    /// Whether prompts start with BOS when the GGUF does not say.
    pub(super) add_bos: bool,
}

/// The pre-tokenizers we build, by the names llama.cpp gives them. Each family was checked
/// against llama.cpp's tokenizer on a vocabulary of that family (see the tests).
pub(super) const PRE_TOKENIZERS: &[PreTokenizerDef] = &[
    PreTokenizerDef {
        names: &[
            "gpt-2",
            "gpt2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
            "trillion",
            "granite-docling",
            "gigachat",
            "a.x-4.0",
            "mellum",
        ],
        splits: &[GPT2_RE],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        // Also what a byte-level vocabulary without tokenizer.ggml.pre gets.
        names: &["default"],
        splits: &[
            r"[\p{P}\$\+<=>\^~\|]+",
            GPT2_RE,
            r"\p{N}+",
            "[0-9][0-9][0-9]",
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["falcon"],
        splits: &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2_RE, "[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        // Digits one by one, then GPT-2's expression.
        names: &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        splits: &[r"\p{N}", GPT2_RE],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        splits: &[LLAMA3_RE],
        ignore_merges: true,
        add_bos: true,
    },
    PreTokenizerDef {
        names: &["dbrx", "smaug-bpe"],
        splits: &[LLAMA3_RE],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        splits: &[QWEN2_RE],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        // llama.cpp: ignore_merges and BOS, as for Llama 3.
        names: &["tekken"],
        splits: &[TEKKEN_RE],
        ignore_merges: true,
        add_bos: true,
    },
    PreTokenizerDef {
        names: &["qwen35"],
        splits: &[QWEN35_RE],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        // The names llama.cpp gives the o200k expression (no BOS, merges applied as usual).
        names: &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        splits: &[O200K_RE],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["deepseek-coder"],
        splits: &[
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            "[一-龥ࠀ-一가-퟿]+",
            r"\p{N}",
        ],
        ignore_merges: false,
        add_bos: false,
    },
];

/// Every `tokenizer.ggml.pre` value we accept for byte-level BPE vocabularies.
pub fn pre_tokenizer_names() -> Vec<&'static str> {
    PRE_TOKENIZERS
        .iter()
        .flat_map(|d| d.names.iter().copied())
        .collect()
}

pub(super) fn pre_tokenizer(name: &str) -> Option<&'static PreTokenizerDef> {
    PRE_TOKENIZERS.iter().find(|d| d.names.contains(&name))
}

pub(super) fn split(re: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    Ok(Split::new(
        SplitPattern::Regex(re.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(hf_err)?
    .into())
}
