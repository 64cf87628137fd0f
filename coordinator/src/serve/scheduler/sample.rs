//! Sampling one sequence's next token and its log-probabilities.

use super::masks::Grammar;
use super::step::Active;
use crate::serve::{Finish, GenEvent, TokenLogprob, TopLogprob};
use crate::text::tokenizer::Tokenizer;

/// Samples the next token of `a` from `logits` (modified in place by penalties and its
/// grammar's mask), streams it, and returns why the sequence ends, if it does; an error when
/// its grammar failed or allows nothing.
pub(super) fn sample_one(
    a: &mut Active,
    logits: &mut [f32],
    tok: &Tokenizer,
    eog: &[u32],
    cache_len: usize,
    ctx: usize,
) -> Result<Option<Finish>, String> {
    // Log-probabilities are the model's own, before the grammar's mask.
    let logprob_info = a.req.logprobs.map(|k| log_softmax_top(logits, k));
    match &a.grammar {
        Grammar::None => {}
        Grammar::Here(c) => {
            if !c.apply(logits) {
                return Err("the grammar allows no token the model can give here".into());
            }
        }
        Grammar::Failed(m) => return Err(m.clone()),
        Grammar::Away => return Err("internal error: sampling before the grammar's mask".into()),
    }
    let s = &a.req.sampling;
    if s.frequency_penalty != 0.0 || s.presence_penalty != 0.0 {
        for (&t, &c) in &a.counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= s.frequency_penalty * c as f32 + s.presence_penalty;
            }
        }
    }
    let id = a.sampler.sample(logits, &a.history);
    if eog.contains(&id) {
        return Ok(Some(Finish::Stop));
    }
    // The chosen token's raw logit: undo the penalty subtracted above.
    let raw_chosen =
        logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |l| match a.counts.get(&id) {
                Some(&c) => l + s.frequency_penalty * c as f32 + s.presence_penalty,
                None => *l,
            });
    a.generated += 1;
    a.history.push(id);
    *a.counts.entry(id).or_insert(0) += 1;
    let piece = a.decoder.push(tok, id);
    let (text, matched) = a.stop.push(&piece);
    let logprob = logprob_info.map(|(lse, top)| {
        let bytes = tok.token_bytes(id, false);
        TokenLogprob {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            logprob: raw_chosen - lse,
            bytes,
            top: top
                .into_iter()
                .map(|(t, l)| {
                    let b = tok.token_bytes(t, false);
                    TopLogprob {
                        token: String::from_utf8_lossy(&b).into_owned(),
                        logprob: l,
                        bytes: b,
                    }
                })
                .collect(),
        }
    });
    let _ = a.req.events.send(GenEvent::Token { id, text, logprob });
    if matched {
        return Ok(Some(Finish::Stop));
    }
    if a.generated >= a.req.max_tokens || cache_len + 1 >= ctx {
        return Ok(Some(Finish::Length));
    }
    a.pending.push(id);
    Ok(None)
}

/// The raw logits' log-sum-exp and the top `k` ids with their log-probabilities (before any
/// penalty or temperature: the model's own distribution).
fn log_softmax_top(logits: &[f32], k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .partial_cmp(&logits[*a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
    };
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(logits.len());
    if k > 0 {
        idx.select_nth_unstable_by(k - 1, by_logit);
        idx.truncate(k);
        idx.sort_by(by_logit);
    } else {
        idx.clear();
    }
    let top = idx
        .into_iter()
        .map(|i| (i, logits[i as usize] - lse))
        .collect();
    (lse, top)
}
