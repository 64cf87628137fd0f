//! `ringllm bench activations -m MODEL`: what compressing hidden states on the wire does to
//! the model's output. The ring is emulated in one process with the very code a ring runs:
//! the model is cut into stages at `--split`, and at every wire crossing (coordinator → first
//! node, node → node, last node → coordinator) the hidden states are encoded and decoded with
//! `ringllm_protocol::activations`. Every position of every prompt is scored (teacher forcing)
//! against the f32 run: largest logit error, mean error, argmax agreement, and the greedy
//! continuation's agreement.

use anyhow::{bail, Context, Result};
use clap::Args;
use ringllm::engine::{open_gguf, Engine, ModelOptions};
use ringllm_model::gguf::GgufFile;
use ringllm_model::{KvCache, KvType, LoadOptions, Model, Runner};
use ringllm_protocol::{activations, Dtype, HEADER_LEN};
use serde::Serialize;
use std::ops::Range;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// Prompts of different kinds when no `--prompts` file is given.
const PROMPTS: &[&str] = &[
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Photosynthesis is the process by which plants",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Water boils at a temperature of",
    "In 1969, the first humans landed on",
];

#[derive(Serialize)]
struct Row {
    activations: String,
    bytes_per_token: usize,
    /// Largest |logit - f32 logit| over every position and vocabulary entry.
    max_abs_err: f32,
    /// Mean over positions of the largest error at that position.
    mean_max_err: f32,
    /// Positions whose argmax matches the f32 run.
    argmax_agree: f64,
    /// Greedy continuations: tokens equal to the f32 run's before the first difference,
    /// summed over prompts, out of `greedy_total`.
    greedy_agree: usize,
    greedy_total: usize,
}

struct Stages {
    runners: Vec<Runner>,
    caches: Vec<KvCache>,
    vocab: usize,
    d: usize,
}

impl Stages {
    fn new(file: &Arc<GgufFile>, cuts: &[Range<usize>], ctx: usize) -> Result<Self> {
        let mut runners = Vec::new();
        let mut caches = Vec::new();
        for (i, r) in cuts.iter().enumerate() {
            let m = Model::load(
                Arc::clone(file),
                &LoadOptions {
                    layers: Some(r.clone()),
                    embedding: i == 0,
                    head: i + 1 == cuts.len(),
                    repack: false,
                    stream: None,
                    experts: None,
                },
            )?;
            let runner = Runner::new(Arc::new(m), 1, 512, ctx);
            caches.push(runner.new_cache(ctx, KvType::F32));
            runners.push(runner);
        }
        let hp = &runners[0].model.hp;
        Ok(Stages {
            vocab: hp.vocab,
            d: hp.d_model,
            runners,
            caches,
        })
    }

    fn reset(&mut self) {
        for c in &mut self.caches {
            c.truncate(0);
        }
    }

    /// Runs `tokens`, crossing the wire in `dtype` between stages and at both ends; returns
    /// the logits of the last `keep` rows.
    fn forward(&mut self, tokens: &[u32], dtype: Dtype, keep: usize) -> Result<Vec<f32>> {
        let (n, d) = (tokens.len(), self.d);
        let mut x = vec![0f32; n * d];
        let mut scratch = Vec::new();
        self.runners[0].embed(tokens, &mut x)?;
        for (r, kv) in self.runners.iter_mut().zip(&mut self.caches) {
            activations::round_trip(dtype, &mut x, &mut scratch)?;
            r.layers(&mut x, n, kv, None)?;
        }
        activations::round_trip(dtype, &mut x, &mut scratch)?;
        let last = self.runners.len() - 1;
        let rows = &mut x[(n - keep) * d..];
        self.runners[last].final_norm(rows, keep)?;
        let mut logits = vec![0f32; keep * self.vocab];
        self.runners[last].logits(rows, keep, &mut logits)?;
        Ok(logits)
    }
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// `ringllm bench activations`.
#[derive(Args, Debug, Clone)]
pub struct ActivationsBenchArgs {
    /// GGUF model file.
    #[arg(short, long)]
    pub model: PathBuf,
    /// Length of the greedy continuation compared.
    #[arg(short = 'n', long = "gen", default_value_t = 64)]
    pub gen: usize,
    /// Stage boundaries (layer numbers; default: the middle layer).
    #[arg(long, value_delimiter = ',')]
    pub split: Vec<usize>,
    /// Prompts, one per line (\\n for newlines; default: a built-in set).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Print results as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `ringllm bench activations -m MODEL`: see the module.
pub fn bench_activations(args: &ActivationsBenchArgs) -> Result<ExitCode> {
    let path = args.model.clone();
    let prompts: Vec<String> = match &args.prompts {
        Some(f) => std::fs::read_to_string(f)
            .with_context(|| format!("reading {}", f.display()))?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.replace("\\n", "\n"))
            .collect(),
        None => PROMPTS.iter().map(|s| s.to_string()).collect(),
    };
    if prompts.is_empty() {
        bail!("no prompts");
    }
    let engine = Engine::load(&ModelOptions {
        model: path.clone(),
        ctx: Some(64),
        threads: Some(1),
        batch: 512,
        kv: KvType::F32,
        repack: false,
        memory: None,
        stream: Default::default(),
        backend: ringllm_model::BackendChoice::Cpu,
    })?;
    let file = open_gguf(&path)?;
    let n_layer = engine.runner.model.hp.n_layer;
    let mut splits = args.split.clone();
    if splits.is_empty() {
        splits.push(n_layer / 2);
    }
    splits.sort_unstable();
    splits.dedup();
    if splits.iter().any(|&s| s == 0 || s >= n_layer) {
        bail!("--split points must be between 1 and {}", n_layer - 1);
    }
    let mut cuts = Vec::new();
    let mut start = 0;
    for &s in splits.iter().chain(std::iter::once(&n_layer)) {
        cuts.push(start..s);
        start = s;
    }
    let gen = args.gen;
    let add_bos = engine.tokenizer.add_bos_default();
    let encoded: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| engine.tokenizer.encode(p, add_bos))
        .collect::<Result<_, _>>()?;
    let ctx = encoded.iter().map(|t| t.len()).max().unwrap_or(1) + gen + 1;
    let mut st = Stages::new(&file, &cuts, ctx)?;
    let (d, vocab) = (st.d, st.vocab);
    eprintln!(
        "model {} | stages {:?} | {} prompts, every position scored, greedy {gen} tokens",
        path.display(),
        cuts,
        prompts.len()
    );

    // Reference: f32 on the wire (bit-identical to one process).
    let mut reference = Vec::new();
    let mut ref_greedy = Vec::new();
    for t in &encoded {
        st.reset();
        reference.push(st.forward(t, Dtype::F32, t.len())?);
        ref_greedy.push(greedy(&mut st, t, Dtype::F32, gen)?);
    }
    let mut rows = Vec::new();
    for dt in [Dtype::F32, Dtype::F16, Dtype::Bf16, Dtype::Q8] {
        let (mut max_err, mut sum_pos_err, mut agree, mut total) = (0f32, 0f64, 0usize, 0usize);
        let (mut g_agree, mut g_total) = (0usize, 0usize);
        for (i, t) in encoded.iter().enumerate() {
            st.reset();
            let l = st.forward(t, dt, t.len())?;
            for (a, b) in l.chunks(vocab).zip(reference[i].chunks(vocab)) {
                let e = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                max_err = max_err.max(e);
                sum_pos_err += e as f64;
                agree += (argmax(a) == argmax(b)) as usize;
                total += 1;
            }
            let g = greedy(&mut st, t, dt, gen)?;
            g_agree += g
                .iter()
                .zip(&ref_greedy[i])
                .take_while(|(a, b)| a == b)
                .count();
            g_total += ref_greedy[i].len();
        }
        let bytes = dt.bytes_for(d).unwrap_or(0) + HEADER_LEN + ringllm_protocol::seal::SEAL_LEN;
        rows.push(Row {
            activations: dt.name().to_string(),
            bytes_per_token: bytes,
            max_abs_err: max_err,
            mean_max_err: (sum_pos_err / total.max(1) as f64) as f32,
            argmax_agree: agree as f64 / total.max(1) as f64,
            greedy_agree: g_agree,
            greedy_total: g_total,
        });
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        outln!(
            "| activations | bytes/token on a link | max logit error | mean of max error | argmax agreement | greedy tokens equal |"
        );
        outln!("|---|---|---|---|---|---|");
        for r in &rows {
            outln!(
                "| {} | {} | {:.4} | {:.4} | {:.2}% | {}/{} |",
                r.activations,
                r.bytes_per_token,
                r.max_abs_err,
                r.mean_max_err,
                100.0 * r.argmax_agree,
                r.greedy_agree,
                r.greedy_total
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Greedy continuation of `prompt` for `n` tokens with `dtype` on the wire.
fn greedy(st: &mut Stages, prompt: &[u32], dtype: Dtype, n: usize) -> Result<Vec<u32>> {
    st.reset();
    let vocab = st.vocab;
    let mut l = st.forward(prompt, dtype, 1)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = argmax(&l[..vocab]) as u32;
        out.push(t);
        l = st.forward(&[t], dtype, 1)?;
    }
    Ok(out)
}
