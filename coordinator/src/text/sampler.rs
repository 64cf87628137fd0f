//! The sampler chain: repetition penalty → (greedy at temperature 0) → top-k → temperature →
//! softmax → top-p → min-p → a draw from a seeded RNG. Each stage is small and tested on
//! distributions; the chain itself is a stage.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling parameters with llama.cpp's defaults.
#[derive(Clone, Debug)]
pub struct SamplerParams {
    /// 0 (or less) = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off.
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

/// From this many candidates the softmax takes the vector exp (a few, after top-k, keep the
/// exact f64 one).
const FAST_SOFTMAX_MIN: usize = 1024;

/// Candidate tokens with logits (and, after softmax, probabilities), kept sorted by logit
/// descending once a stage needs it, plus the recent tokens the penalty stage looks at.
#[derive(Debug, Default)]
pub struct Candidates {
    pub ids: Vec<u32>,
    pub logits: Vec<f32>,
    pub probs: Vec<f32>,
    /// Sorted by logit, descending (ties: lower id first).
    pub sorted: bool,
    /// The most recent tokens (oldest first), for the repetition penalty.
    pub recent: Vec<u32>,
    /// `ids[i] == i` for every i (just filled, nothing removed or reordered yet).
    identity: bool,
    /// Scratch reused across tokens so sampling does not allocate once warmed up.
    order: Vec<usize>,
    ids_tmp: Vec<u32>,
    logits_tmp: Vec<f32>,
    seen: Vec<u32>,
}

impl Candidates {
    /// Loads every token of `logits`, reusing the buffers.
    pub fn fill(&mut self, logits: &[f32]) {
        self.ids.clear();
        self.ids.extend(0..logits.len() as u32);
        self.logits.clear();
        self.logits.extend_from_slice(logits);
        self.probs.clear();
        self.sorted = false;
        self.identity = true;
    }

    /// Sets the recent tokens: the last `last_n` of `history`.
    pub fn set_recent(&mut self, history: &[u32], last_n: usize) {
        self.recent.clear();
        self.recent
            .extend_from_slice(&history[history.len().saturating_sub(last_n)..]);
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Keeps the `k` highest logits, sorted descending (ties: lower id first).
    pub fn keep_top(&mut self, k: usize) {
        let k = k.min(self.len()).max(1);
        if self.is_empty() {
            return;
        }
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.extend(0..self.len());
        let (ids, logits) = (&self.ids, &self.logits);
        let cmp = |a: &usize, b: &usize| {
            logits[*b]
                .total_cmp(&logits[*a])
                .then(ids[*a].cmp(&ids[*b]))
        };
        if k < order.len() {
            order.select_nth_unstable_by(k - 1, cmp);
            order.truncate(k);
        }
        order.sort_unstable_by(cmp);
        self.ids_tmp.clear();
        self.ids_tmp.extend(order.iter().map(|&i| self.ids[i]));
        self.logits_tmp.clear();
        self.logits_tmp
            .extend(order.iter().map(|&i| self.logits[i]));
        std::mem::swap(&mut self.ids, &mut self.ids_tmp);
        std::mem::swap(&mut self.logits, &mut self.logits_tmp);
        self.order = order;
        self.probs.clear();
        self.sorted = true;
        self.identity = false;
    }

    fn sort(&mut self) {
        if !self.sorted {
            self.keep_top(self.len());
        }
    }

    /// Probabilities from the logits (numerically stable softmax).
    pub fn softmax(&mut self) {
        let max = self
            .logits
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        self.probs.clear();
        if max == f32::INFINITY {
            // Infinitely likely tokens share all the probability.
            self.probs
                .extend(self.logits.iter().map(|&l| f32::from(l == max)));
        } else if max.is_finite() && self.logits.len() >= FAST_SOFTMAX_MIN {
            // A whole vocabulary (no top-k before the temperature, as an OpenAI request):
            // the vector exp, ~20x the f64 one, which made sampling a serial tenth of a
            // 4-stream decode step. Tokens at -inf keep probability 0.
            self.probs.extend_from_slice(&self.logits);
            ringllm_kernels::ops::softmax_fast(&mut self.probs);
            for (p, l) in self.probs.iter_mut().zip(&self.logits) {
                if *l == f32::NEG_INFINITY {
                    *p = 0.0;
                }
            }
            return;
        } else {
            self.probs
                .extend(self.logits.iter().map(|l| ((l - max) as f64).exp() as f32));
        }
        let sum: f32 = self.probs.iter().sum();
        if sum > 0.0 && sum.is_finite() {
            for p in self.probs.iter_mut() {
                *p /= sum;
            }
        }
    }

    /// Keeps the first `n` candidates (at least one).
    fn truncate(&mut self, n: usize) {
        let n = n.max(1);
        if n < self.ids.len() {
            self.identity = false;
        }
        self.ids.truncate(n);
        self.logits.truncate(n);
        self.probs.truncate(n);
    }
}

/// One step of the chain.
pub trait Stage: Send {
    fn apply(&mut self, c: &mut Candidates);
}

/// llama.cpp's repetition penalty: the logit of a token among the last `last_n` tokens
/// (`Candidates::recent`) is divided by `penalty` when positive and multiplied when negative,
/// once however often it occurred.
pub struct RepeatPenalty {
    pub penalty: f32,
    pub last_n: usize,
}

impl Stage for RepeatPenalty {
    fn apply(&mut self, c: &mut Candidates) {
        if self.penalty == 1.0 || self.last_n == 0 || c.recent.is_empty() {
            return;
        }
        let from = c.recent.len().saturating_sub(self.last_n);
        let mut seen = std::mem::take(&mut c.seen);
        seen.clear();
        seen.extend_from_slice(&c.recent[from..]);
        seen.sort_unstable();
        seen.dedup();
        let penalize = |l: &mut f32| {
            *l = if *l > 0.0 {
                *l / self.penalty
            } else {
                *l * self.penalty
            };
        };
        if c.identity {
            // Straight from the logits: a token's id is its index.
            for &id in &seen {
                if let Some(l) = c.logits.get_mut(id as usize) {
                    penalize(l);
                }
            }
        } else {
            for (id, l) in c.ids.iter().zip(c.logits.iter_mut()) {
                if seen.binary_search(id).is_ok() {
                    penalize(l);
                }
            }
        }
        c.seen = seen;
        c.probs.clear();
        c.sorted = false;
    }
}

/// Keeps the `k` most likely tokens (0 = all).
pub struct TopK(pub usize);

impl Stage for TopK {
    fn apply(&mut self, c: &mut Candidates) {
        if self.0 > 0 && self.0 < c.len() {
            c.keep_top(self.0);
        }
    }
}

/// Divides the logits by the temperature and computes probabilities.
pub struct Temperature(pub f32);

impl Stage for Temperature {
    fn apply(&mut self, c: &mut Candidates) {
        for l in c.logits.iter_mut() {
            *l /= self.0;
        }
        c.softmax();
    }
}

/// Keeps the smallest set of most likely tokens whose probability reaches `p` (1 = all).
pub struct TopP(pub f32);

impl Stage for TopP {
    fn apply(&mut self, c: &mut Candidates) {
        if self.0 >= 1.0 {
            return;
        }
        c.sort();
        c.softmax();
        let mut cum = 0.0;
        let mut keep = c.len();
        for (i, p) in c.probs.iter().enumerate() {
            cum += p;
            if cum >= self.0 {
                keep = i + 1;
                break;
            }
        }
        c.truncate(keep);
    }
}

/// Drops tokens less likely than `p` times the most likely one (0 = none).
pub struct MinP(pub f32);

impl Stage for MinP {
    fn apply(&mut self, c: &mut Candidates) {
        if self.0 <= 0.0 || c.is_empty() {
            return;
        }
        c.sort();
        c.softmax();
        let cut = c.probs[0] * self.0;
        let keep = c.probs.iter().take_while(|p| **p >= cut).count();
        c.truncate(keep);
    }
}

/// Stages run in order.
pub struct Chain(pub Vec<Box<dyn Stage>>);

impl Stage for Chain {
    fn apply(&mut self, c: &mut Candidates) {
        for s in self.0.iter_mut() {
            s.apply(c);
        }
    }
}

/// The full sampler: the chain, then greedy or a seeded draw.
pub struct Sampler {
    chain: Chain,
    greedy: bool,
    last_n: usize,
    rng: StdRng,
    c: Candidates,
}

impl Sampler {
    pub fn new(p: &SamplerParams) -> Sampler {
        let greedy = p.temperature <= 0.0 || p.temperature.is_nan();
        let mut stages: Vec<Box<dyn Stage>> = vec![Box::new(RepeatPenalty {
            penalty: p.repeat_penalty,
            last_n: p.repeat_last_n,
        })];
        if !greedy {
            stages.push(Box::new(TopK(p.top_k)));
            stages.push(Box::new(Temperature(p.temperature)));
            stages.push(Box::new(TopP(p.top_p)));
            stages.push(Box::new(MinP(p.min_p)));
        }
        Sampler {
            chain: Chain(stages),
            greedy,
            last_n: p.repeat_last_n,
            rng: StdRng::seed_from_u64(p.seed),
            c: Candidates::default(),
        }
    }

    /// The next token given `logits` and the tokens so far (prompt and generated).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        self.c.fill(logits);
        self.c.set_recent(history, self.last_n);
        self.chain.apply(&mut self.c);
        if self.greedy {
            return argmax(&self.c.ids, &self.c.logits);
        }
        if self.c.probs.len() != self.c.len() {
            self.c.softmax();
        }
        let total: f32 = self.c.probs.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (id, p) in self.c.ids.iter().zip(&self.c.probs) {
            if r < *p {
                return *id;
            }
            r -= p;
        }
        // Rounding left r at the very top: the last candidate with any probability.
        self.c
            .ids
            .iter()
            .zip(&self.c.probs)
            .rev()
            .find(|(_, p)| **p > 0.0)
            .or_else(|| self.c.ids.iter().zip(&self.c.probs).next())
            .map(|(id, _)| *id)
            .unwrap_or(0)
    }
}

/// Highest logit; ties go to the lowest id.
fn argmax(ids: &[u32], logits: &[f32]) -> u32 {
    let mut best = 0;
    for i in 1..ids.len() {
        if logits[i] > logits[best] || (logits[i] == logits[best] && ids[i] < ids[best]) {
            best = i;
        }
    }
    ids.get(best).copied().unwrap_or(0)
}

/// Holds back streamed text that could be the start of a stop string, so stop strings are
/// never printed and are found across chunk boundaries.
#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
    /// The stop string that ended the text, once one has.
    matched: Option<String>,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> StopStrings {
        StopStrings {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            matched: None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Adds `text`; returns what is safe to print and whether a stop string was found (the
    /// text before it is returned, the stop string and anything after are dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (text.to_string(), false);
        }
        self.pending.push_str(text);
        // The earliest stop string; of two at the same place, the one listed first.
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|pos| (pos, s)))
            .min_by_key(|(pos, _)| *pos);
        if let Some((pos, stop)) = found {
            self.matched = Some(stop.clone());
            let out = self.pending[..pos].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// The stop string that ended the text (Anthropic's `stop_sequence`), if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Everything held back (at the end of generation).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplerParams {
        SamplerParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 1,
        }
    }

    fn histogram(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<f64> {
        let mut h = vec![0f64; logits.len()];
        for _ in 0..n {
            h[s.sample(logits, &[]) as usize] += 1.0;
        }
        h.iter().map(|c| c / n as f64).collect()
    }

    fn softmax(l: &[f32], t: f32) -> Vec<f64> {
        let e: Vec<f64> = l.iter().map(|v| ((*v / t) as f64).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    const LOGITS: [f32; 5] = [2.0, 1.0, 0.5, 0.0, -1.0];

    #[test]
    fn greedy_takes_the_argmax_with_ties_to_the_lowest_id() {
        let mut s = Sampler::new(&params(0.0));
        assert_eq!(s.sample(&LOGITS, &[]), 0);
        assert_eq!(s.sample(&[1.0, 3.0, 3.0], &[]), 1);
    }

    #[test]
    fn draws_follow_the_tempered_softmax() {
        for t in [0.5f32, 1.0, 1.5] {
            let mut s = Sampler::new(&params(t));
            let h = histogram(&mut s, &LOGITS, 40_000);
            for (got, want) in h.iter().zip(softmax(&LOGITS, t)) {
                assert!((got - want).abs() < 0.01, "T={t}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn top_k_never_draws_outside_the_k_best() {
        let mut p = params(1.0);
        p.top_k = 2;
        let mut s = Sampler::new(&p);
        let h = histogram(&mut s, &LOGITS, 20_000);
        assert!(h[2..].iter().all(|v| *v == 0.0));
        let want = softmax(&LOGITS[..2], 1.0);
        assert!((h[0] - want[0]).abs() < 0.015, "{} vs {}", h[0], want[0]);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Probabilities of LOGITS: .53 .20 .12 .07 .03 (approximately).
        let probs = softmax(&LOGITS, 1.0);
        let mut c = Candidates::default();
        c.fill(&LOGITS);
        TopP(0.7).apply(&mut c);
        assert!(probs[0] + probs[1] >= 0.7 && probs[0] < 0.7);
        assert_eq!(c.ids, vec![0, 1]);
        let mut p = params(1.0);
        p.top_p = 0.7;
        let h = histogram(&mut Sampler::new(&p), &LOGITS, 20_000);
        let z = probs[0] + probs[1];
        assert!((h[0] - probs[0] / z).abs() < 0.015);
        assert!(h[2..].iter().all(|v| *v == 0.0));
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let probs = softmax(&LOGITS, 1.0);
        let mut c = Candidates::default();
        c.fill(&LOGITS);
        MinP(0.2).apply(&mut c);
        let want: Vec<u32> = (0..5)
            .filter(|&i| probs[i as usize] >= 0.2 * probs[0])
            .collect();
        assert_eq!(c.ids, want);
        assert_eq!(want, vec![0, 1, 2]);
    }

    #[test]
    fn repetition_penalty_changes_the_greedy_choice() {
        let mut p = params(0.0);
        p.repeat_penalty = 2.0;
        let mut s = Sampler::new(&p);
        // Token 0 (logit 2.0) was just produced: 2.0/2 = 1.0 < 1.5.
        assert_eq!(s.sample(&[2.0, 1.5, -1.0], &[0]), 1);
        // Negative logits get more negative.
        let mut c = Candidates::default();
        c.fill(&[2.0, 1.5, -1.0]);
        c.set_recent(&[2, 2, 2], 8);
        RepeatPenalty {
            penalty: 2.0,
            last_n: 8,
        }
        .apply(&mut c);
        assert_eq!(
            c.logits,
            vec![2.0, 1.5, -2.0],
            "once, however often it occurred"
        );
        // The same on candidates no longer in id order.
        let mut c = Candidates::default();
        c.fill(&[2.0, 1.5, -1.0]);
        c.keep_top(3);
        c.set_recent(&[0, 2], 8);
        RepeatPenalty {
            penalty: 2.0,
            last_n: 8,
        }
        .apply(&mut c);
        assert_eq!(c.ids, vec![0, 1, 2]);
        assert_eq!(c.logits, vec![1.0, 1.5, -2.0]);
        // Outside the window: no effect.
        let mut s = Sampler::new(&SamplerParams {
            repeat_last_n: 1,
            ..p
        });
        assert_eq!(s.sample(&[2.0, 1.5, -1.0], &[0, 2]), 0);
    }

    #[test]
    fn seeds_reproduce_and_differ() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(&SamplerParams {
                seed,
                ..params(1.0)
            });
            (0..64).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn a_whole_vocabulary_softmax_matches_the_f64_one() {
        // Past FAST_SOFTMAX_MIN candidates the vector exp runs: every probability within
        // 1e-5 relative (plus a tiny absolute floor) of the f64 softmax, -inf tokens at 0.
        let n = 4 * FAST_SOFTMAX_MIN + 3;
        let mut rng = StdRng::seed_from_u64(5);
        let mut logits: Vec<f32> = (0..n).map(|_| rng.random_range(-30.0f32..30.0)).collect();
        logits[17] = f32::NEG_INFINITY;
        logits[n - 1] = f32::NEG_INFINITY;
        let mut c = Candidates::default();
        c.fill(&logits);
        c.softmax();
        let want = softmax(&logits, 1.0);
        let total: f64 = c.probs.iter().map(|&p| f64::from(p)).sum();
        assert!((total - 1.0).abs() < 1e-5, "sum {total}");
        for (i, (&got, want)) in c.probs.iter().zip(&want).enumerate() {
            let err = (f64::from(got) - want).abs();
            assert!(err <= 1e-5 * want + 1e-30, "token {i}: {got} vs {want}");
        }
        assert_eq!((c.probs[17], c.probs[n - 1]), (0.0, 0.0));
    }

    #[test]
    fn degenerate_logits_do_not_panic() {
        for logits in [
            vec![f32::NEG_INFINITY; 4],
            vec![f32::NAN; 4],
            vec![0.0, f32::INFINITY, 1.0],
            vec![],
        ] {
            for t in [0.0, 0.8] {
                let mut s = Sampler::new(&SamplerParams {
                    temperature: t,
                    ..SamplerParams::default()
                });
                let id = s.sample(&logits, &[0, 1]);
                assert!(id as usize <= logits.len(), "{logits:?} -> {id}");
            }
        }
        let mut s = Sampler::new(&params(1.0));
        assert_eq!(s.sample(&[0.0, f32::INFINITY, 1.0], &[]), 1);
    }

    #[test]
    fn buffers_are_reused_across_tokens() {
        let logits: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
            .collect();
        let mut s = Sampler::new(&SamplerParams {
            repeat_penalty: 1.1,
            top_k: 0,
            ..SamplerParams::default()
        });
        let history: Vec<u32> = (0..200).collect();
        s.sample(&logits, &history);
        let caps = |c: &Candidates| {
            [
                c.ids.as_ptr() as usize,
                c.logits.as_ptr() as usize,
                c.ids.capacity(),
                c.logits.capacity(),
                c.probs.capacity(),
                c.order.capacity(),
                c.recent.capacity(),
            ]
        };
        s.sample(&logits, &history);
        let before = caps(&s.c);
        for _ in 0..20 {
            s.sample(&logits, &history);
        }
        // The two id/logit buffers swap places each token: compare as sets.
        let mut a = before;
        let mut b = caps(&s.c);
        a[..2].sort_unstable();
        b[..2].sort_unstable();
        assert_eq!(a[2..], b[2..]);
    }

    #[test]
    fn stop_strings_across_chunks() {
        let mut s = StopStrings::new(vec!["STOP".into()]);
        assert_eq!(s.push("hello S"), ("hello ".to_string(), false));
        assert_eq!(s.push("T"), (String::new(), false));
        assert_eq!(s.push("OP and more"), (String::new(), true));
        let mut s = StopStrings::new(vec!["STOP".into()]);
        assert_eq!(s.push("a ST"), ("a ".to_string(), false));
        assert_eq!(s.push("ay"), ("STay".to_string(), false));
        assert_eq!(s.push(" S"), (" ".to_string(), false));
        assert_eq!(s.flush(), "S");
        let mut none = StopStrings::new(vec![]);
        assert_eq!(none.push("x"), ("x".to_string(), false));
    }

    #[test]
    fn stop_strings_with_multibyte_text() {
        let mut s = StopStrings::new(vec!["é!".into()]);
        assert_eq!(s.push("café"), ("caf".to_string(), false));
        assert_eq!(s.push("!x"), (String::new(), true));
    }

    #[test]
    fn the_stop_string_found_first_is_the_one_named() {
        let mut s = StopStrings::new(vec!["END".into(), "ab".into(), "b".into()]);
        assert_eq!(s.matched(), None);
        assert_eq!(s.push("xx a"), ("xx ".to_string(), false));
        assert_eq!(s.matched(), None);
        // "ab" and "b" both occur; "ab" starts first.
        assert_eq!(s.push("b END"), (String::new(), true));
        assert_eq!(s.matched(), Some("ab"));
        let mut tie = StopStrings::new(vec!["b".into(), "bc".into()]);
        assert_eq!(tie.push("abc"), ("a".to_string(), true));
        assert_eq!(
            tie.matched(),
            Some("b"),
            "of two at one place, the one listed first"
        );
    }
}
