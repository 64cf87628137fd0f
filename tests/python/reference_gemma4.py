"""Gemma 4 (GGUF arch `gemma4`, the dense sizes) for the NumPy reference (reference.py),
written from the published model (Hugging Face's Gemma 4 text model and llama.cpp's GGUF
conventions for it), in float64:

- x = E[tok] * sqrt(d); layer i is sliding-window iff `attention.sliding_window_pattern[i]`;
  sliding layers have head size `attention.key_length_swa`, RoPE dims `rope.dimension_count_swa`
  and base `rope.freq_base_swa`; full layers head size `attention.key_length` and NeoX RoPE with
  base `rope.freq_base` whose frequencies are divided by `rope_freqs` (proportional RoPE: 1e30
  for the pairs that do not rotate). KV heads and feed-forward widths may be per-layer arrays.
- attention: q = q_norm(Wq h), k = k_norm(Wk h), v = rms_norm(Wv h) without weight, where a
  layer without `attn_v` uses Wk h as its V; RoPE on q and k; scale 1 (no 1/sqrt(head_dim)).
- the last `attention.shared_kv_layers` layers compute no K/V: they attend over the (normed,
  rotated) K and V of the last earlier layer of the same kind that has its own.
- sandwich norms around attention and the GeGLU feed-forward (tanh GELU), as Gemma 3.
- per-layer embeddings (`embedding_length_per_layer_input` = P > 0): for every token,
  inp[l] = (rms_norm(W_model_proj x0 / sqrt(d))[l] * proj_norm + E_ple[tok][l] * sqrt(P)) / sqrt(2);
  after layer l's feed-forward: x += post_norm(W_proj (gelu(W_gate x) * inp[l])).
- then x *= layer_output_scale; final norm, tied head, tanh soft-capping of the logits.
"""

import math

import numpy as np


def _per_layer(v, n_layer, what):
    if isinstance(v, (list, tuple)):
        if len(v) != n_layer:
            raise ValueError(f"{what}: {len(v)} values for {n_layer} layers")
        return [int(x) for x in v]
    return [int(v)] * n_layer


def setup(m, g):
    """Reads Gemma 4's hyper-parameters into the reference Model `m` (`g(key, default)`)."""
    L = m.n_layer
    pattern = g("attention.sliding_window_pattern")
    if not isinstance(pattern, (list, tuple)) or len(pattern) != L:
        raise ValueError("gemma4: attention.sliding_window_pattern must be one bool per layer")
    m.is_swa = [bool(p) for p in pattern]
    m.window = int(g("attention.sliding_window"))
    m.kv_heads = _per_layer(g("attention.head_count_kv", m.n_head), L, "head_count_kv")
    m.ff = _per_layer(g("feed_forward_length"), L, "feed_forward_length")
    full_hd = int(g("attention.key_length"))
    swa_hd = int(g("attention.key_length_swa", full_hd))
    m.head_dims = [swa_hd if s else full_hd for s in m.is_swa]
    full_rot = int(g("rope.dimension_count", full_hd))
    swa_rot = int(g("rope.dimension_count_swa", full_rot))
    m.n_rots = [swa_rot if s else full_rot for s in m.is_swa]
    m.rope_base_swa = float(g("rope.freq_base_swa", 10000.0))
    m.rope_scale_swa = 1.0
    m.q_scale = 1.0
    m.ple_dim = int(g("embedding_length_per_layer_input", 0) or 0)
    shared = int(g("attention.shared_kv_layers", 0) or 0)
    first = L - shared
    m.kv_source = []
    for il in range(L):
        if il < first:
            m.kv_source.append(None)
            continue
        src = [j for j in range(first) if m.is_swa[j] == m.is_swa[il]]
        if not src:
            raise ValueError(f"gemma4: shared-KV layer {il} has no earlier layer of its kind")
        m.kv_source.append(src[-1])


def forward(m, toks, logit_rows, steps, R):
    """The forward pass; `R` is the reference module (its building blocks)."""
    n = len(toks)
    pos = np.arange(n)
    d, H, eps = m.n_embd, m.n_head, m.eps
    hidden = {}

    def seen(il, step, buf, a):
        if steps is not None:
            steps[f"layer.{il}.{step}.{buf}"] = np.asarray(a, dtype=np.float64).reshape(n, -1).astype(np.float32)

    x = m.w("token_embd.weight")[toks].copy() * math.sqrt(d)
    hidden["embd"] = x.astype(np.float32)

    P = m.ple_dim
    if P > 0:
        L = m.n_layer
        sel = m.w("per_layer_token_embd.weight")[toks].reshape(n, L, P) * math.sqrt(P)
        proj = (R._linear(x, m, "per_layer_model_proj") / math.sqrt(d)).reshape(n, L, P)
        proj = R.rmsnorm(proj, m.w("per_layer_proj_norm.weight"), eps)
        ple_in = (proj + sel) / math.sqrt(2.0)

    rope_freqs = m.wopt("rope_freqs.weight")
    masks = {}
    cache = {}
    for il in range(m.n_layer):
        p = f"blk.{il}."
        swa = m.is_swa[il]
        window = m.window if swa else 0
        if window not in masks:
            masks[window] = R.attention_mask(n, window)
        hd, Hkv, n_rot = m.head_dims[il], m.kv_heads[il], m.n_rots[il]
        base = m.rope_base_swa if swa else m.rope_base
        factors = None if swa else rope_freqs
        src = m.kv_source[il]

        h = R.rmsnorm(x, m.w(p + "attn_norm.weight"), eps)
        seen(il, "attn_norm", "xn", h)
        q = R._linear(h, m, p + "attn_q").reshape(n, H, hd)
        if src is None:
            k = R._linear(h, m, p + "attn_k").reshape(n, Hkv, hd)
            if m.has(p + "attn_v.weight"):
                v = R._linear(h, m, p + "attn_v").reshape(n, Hkv, hd)
                for name, t in (("q", q), ("k", k), ("v", v)):
                    seen(il, "qkv", name, t)
            else:
                v = k.copy()
                seen(il, "qk_proj", "q", q)
                seen(il, "qk_proj", "k", k)
                seen(il, "v_from_k", "v", v)
            q = R.rmsnorm(q, m.w(p + "attn_q_norm.weight"), eps)
            k = R.rmsnorm(k, m.w(p + "attn_k_norm.weight"), eps)
            seen(il, "qk_norm", "q", q)
            seen(il, "qk_norm", "k", k)
            v = R.rmsnorm(v, 1.0, eps)
            seen(il, "v_norm", "v", v)
            q = R.rope(q, pos, n_rot, base, 1.0, True, factors)
            k = R.rope(k, pos, n_rot, base, 1.0, True, factors)
            seen(il, "rope", "q", q)
            seen(il, "rope", "k", k)
            cache[il] = (k, v)
            att_step = "attention"
        else:
            seen(il, "q_proj", "q", q)
            q = R.rmsnorm(q, m.w(p + "attn_q_norm.weight"), eps)
            seen(il, "q_norm", "q", q)
            q = R.rope(q, pos, n_rot, base, 1.0, True, factors)
            seen(il, "rope_q", "q", q)
            k, v = cache[src]
            att_step = "shared_attention"
        a = R.attention(q, k, v, m.q_scale, masks[window])
        seen(il, att_step, "att", a)
        a = R._linear(a, m, p + "attn_output")
        seen(il, "attn_out", "o", a)
        x = x + R.rmsnorm(a, m.w(p + "post_attention_norm.weight"), eps)
        seen(il, "attn_residual", "x", x)

        h = R.rmsnorm(x, m.w(p + "ffn_norm.weight"), eps)
        seen(il, "ffn_norm", "xn", h)
        gate = R._linear(h, m, p + "ffn_gate")
        up = R._linear(h, m, p + "ffn_up")
        seen(il, "gate_up", "gate", gate)
        seen(il, "gate_up", "up", up)
        f = R.gelu_tanh(gate) * up
        seen(il, "glu", "gate", f)
        f = R._linear(f, m, p + "ffn_down")
        seen(il, "ffn_down", "o", f)
        x = x + R.rmsnorm(f, m.w(p + "post_ffw_norm.weight"), eps)
        seen(il, "ffn_residual", "x", x)

        if P > 0:
            g = R.gelu_tanh(R._linear(x, m, p + "inp_gate")) * ple_in[:, il, :]
            y = R._linear(g, m, p + "proj")
            x = x + R.rmsnorm(y, m.w(p + "post_norm.weight"), eps)
            seen(il, "per_layer_input", "x", x)
        x = x * float(m.w(p + "layer_output_scale.weight").reshape(-1)[0])
        seen(il, "out_scale", "x", x)
        hidden[f"layer.{il}"] = x.astype(np.float32)
    return x, hidden
