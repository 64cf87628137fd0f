"""Self-test of the NumPy reference (reference.py) on its own, without our engine.

Token ids below were obtained by tokenizing the prompts with transformers' tokenizer built from
each GGUF's own vocabulary (transformers.integrations.gguf convert_gguf_tokenizer, no torch) and
agree with llama.cpp's ids for "The capital of France is" in test_forward.py; Gemma's BOS (2) is
prepended because its file sets add_bos_token, SmolLM2's file does not. Decoded through the GGUF
vocabularies: gemma 9079 = "▁Paris", smollm2 7042 = "ĠParis".
"""

import math
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import reference  # noqa: E402
from support.compare import ref_model  # noqa: E402

MODELS = pathlib.Path(__file__).resolve().parents[2] / "models"
GEMMA = MODELS / "gemma-3-270m-q4_k_m.gguf"
SMOL = MODELS / "smollm2-135m-instruct-q4_1.gguf"

GEMMA_FRANCE = [2, 818, 5279, 529, 7001, 563]  # "The capital of France is"
GEMMA_QA = [2, 236935, 236787, 2900, 563, 506, 5279, 529, 7001, 236881, 107, 236776, 236787]  # "Q: What is the capital of France?\nA:"
GEMMA_EIFFEL = [2, 818, 94648, 25822, 563, 5628, 528, 506, 3207, 529]  # "The Eiffel Tower is located in the city of"
GEMMA_PARIS = 9079
SMOL_FRANCE = [504, 3575, 282, 4649, 314]  # "The capital of France is"
SMOL_PARIS = 7042


def _load(p):
    if not p.exists():
        pytest.fail(f"{p} is missing: run scripts/fetch-models")
    return ref_model(p)  # shared with the other files that read the two models


@pytest.fixture(scope="module")
def gemma():
    return _load(GEMMA)


@pytest.fixture(scope="module")
def smol():
    return _load(SMOL)


@pytest.mark.slow
def test_metadata_conventions(gemma, smol):
    assert gemma.arch == "gemma3" and gemma.rope_neox
    assert [i for i in range(gemma.n_layer) if not gemma.is_swa[i]] == [5, 11, 17]
    assert gemma.window == 512 and gemma.rope_base == 1e6 and gemma.rope_base_swa == 1e4
    assert gemma.head_dim == 256 and gemma.q_scale == 1 / 16
    assert gemma.final_softcap == 0 and gemma.tied and gemma.add_bos
    assert smol.arch == "llama" and not smol.rope_neox and smol.rope_base == 1e5
    assert smol.n_rot == smol.head_dim == 64 and smol.n_head_kv == 3 and not smol.add_bos


def test_rope_pairs_and_relative_positions():
    rng = np.random.default_rng(0)
    d = 8
    for neox in (False, True):
        e = np.zeros((1, 1, d))
        e[0, 0, 0] = 1.0
        r = reference.rope(e, [3], d, 10000.0, neox=neox)
        partner = d // 2 if neox else 1  # pair of dimension 0
        assert np.isclose(r[0, 0, 0], math.cos(3)) and np.isclose(r[0, 0, partner], math.sin(3))
        # <rope(q, p), rope(k, p')> depends only on p - p'
        q, k = rng.standard_normal((2, 1, 1, d))
        dots = [np.sum(reference.rope(q, [p + 5], d, 100.0, neox=neox) * reference.rope(k, [p], d, 100.0, neox=neox))
                for p in (0, 7, 30)]
        assert np.allclose(dots, dots[0])


@pytest.mark.slow
def test_causal_masking(smol):
    a = SMOL_FRANCE + [7042, 30, 198]
    b = SMOL_FRANCE[:3] + [100, 200, 300, 400, 500]  # differs from position 3 on
    la, ha = reference.forward(smol, a)
    lb, hb = reference.forward(smol, b)
    assert la.shape == (len(a), smol.vocab) and la.dtype == np.float32
    assert set(ha) == {"embd", "final_norm", *(f"layer.{i}" for i in range(smol.n_layer))}
    np.testing.assert_allclose(la[:3], lb[:3], rtol=1e-5, atol=1e-5)
    for k in ha:
        np.testing.assert_allclose(ha[k][:3], hb[k][:3], rtol=1e-5, atol=1e-6)
    assert np.abs(la[3:] - lb[3:]).max() > 1e-2


@pytest.mark.slow
def test_sliding_window(gemma):
    """Local layers see keys with q - k < window; global layers see everything."""
    saved = gemma.window
    try:
        gemma.window = 3
        a = [2, 818, 5279, 529, 7001, 563, 506, 5279]
        b = [2, 100, 5279, 529, 7001, 563, 506, 5279]  # differs at position 1 only
        _, ha = reference.forward(gemma, a, logit_rows=[])
        _, hb = reference.forward(gemma, b, logit_rows=[])
    finally:
        gemma.window = saved
    diff = np.abs(ha["layer.0"] - hb["layer.0"]).max(axis=1)  # layer 0 is local
    assert (diff[1:4] > 1e-3).all() and (diff[4:] < 1e-9).all() and diff[0] < 1e-9
    assert np.abs(ha["layer.5"][-1] - hb["layer.5"][-1]).max() > 1e-3  # layer 5 is global


@pytest.mark.slow
def test_gemma_knows_paris(gemma):
    logits, hidden = reference.forward(gemma, GEMMA_FRANCE)
    assert hidden["embd"].shape == (len(GEMMA_FRANCE), gemma.n_embd)
    np.testing.assert_allclose(hidden["embd"][1] / math.sqrt(640), gemma.f32("token_embd.weight")[818], rtol=1e-6)
    top3 = np.argsort(-logits[-1])[:3]
    assert GEMMA_PARIS in top3  # the 270M model ranks " the", " a", " Paris"
    assert reference.greedy(gemma, GEMMA_EIFFEL, 1) == [GEMMA_PARIS]
    # greedy: " The capital of France is Paris."
    assert GEMMA_PARIS in reference.greedy(gemma, GEMMA_QA, 7)


def test_smol_knows_paris(smol):
    assert reference.greedy(smol, SMOL_FRANCE, 2) == [SMOL_PARIS, 30]  # " Paris."


@pytest.mark.slow
def test_perplexity_convention(smol):
    rng = np.random.default_rng(1)
    toks = [int(t) for t in rng.integers(100, 5000, size=21)]
    ctx = 8
    for add_bos in (False, True):
        ppl, err = reference.perplexity(smol, toks, ctx, add_bos=add_bos)
        # by hand: 2 chunks of 8 (the 21st token is dropped); logits at 4..6 score tokens 5..7
        nll = []
        for c in range(2):
            chunk = toks[c * ctx:(c + 1) * ctx]
            inp = ([smol.bos_id] + chunk[1:]) if add_bos else chunk
            lg, _ = reference.forward(smol, inp)
            for j in range(ctx // 2, ctx - 1):
                x = lg[j].astype(np.float64)
                nll.append(np.log(np.sum(np.exp(x - x.max()))) + x.max() - x[chunk[j + 1]])
        nll = np.array(nll)
        assert len(nll) == 6
        assert math.isclose(ppl, math.exp(nll.mean()), rel_tol=1e-9)
        assert math.isclose(err, ppl * math.sqrt(nll.var() / (len(nll) - 1)), rel_tol=1e-6)
    assert reference.perplexity(smol, toks, ctx, n_chunks=1)[0] != ppl
    with pytest.raises(ValueError):
        reference.perplexity(smol, toks[:15], ctx)


def test_moe_routing_matches_direct_computation():
    """moe_route: softmax, the k largest (ties: lower index first), renormalized to sum to one,
    optionally scaled; against a direct float64 computation by hand. (llama.cpp's clamp of the
    sum to 2^-14 cannot act after a softmax: the k largest of E probabilities sum to >= k/E.)"""
    logits = np.array([[0.5, 2.0, -1.0, 2.0, 1.0, 0.0],  # a tie for first place: 1 before 3
                       [3.0, -2.0, 0.25, 0.25, 0.25, 1.5]])  # a tie for the last pick: 2, not 3 or 4
    ids, w = reference.moe_route(logits, 3)
    assert ids.tolist() == [[1, 3, 4], [0, 5, 2]]
    for r in range(2):
        p = [math.exp(v) for v in logits[r]]
        p = [v / sum(p) for v in p]
        picked = [p[i] for i in ids[r]]
        np.testing.assert_allclose(w[r], [v / sum(picked) for v in picked], rtol=1e-14)
    # without renormalization: the softmax probabilities themselves, then the scale (0 and 1: none)
    _, raw = reference.moe_route(logits, 3, norm=False)
    np.testing.assert_allclose(raw[0], np.exp([2.0, 2.0, 1.0]) / np.exp(logits[0]).sum(), rtol=1e-14)
    for scale, factor in ((0.0, 1.0), (1.0, 1.0), (2.5, 2.5)):
        np.testing.assert_allclose(reference.moe_route(logits, 3, scale=scale)[1], w * factor, rtol=1e-14)


def test_moe_ffn_matches_per_token_loop(tmp_path):
    """The grouped-by-expert MoE FFN against a token-by-token loop over the whole dequantized
    3-D expert tensors, on a gguf-py file with Q8_0 experts (each expert's slab dequantized alone
    must equal its slice of the whole tensor)."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(5)
    d, ff, n_exp, k, n = 64, 32, 6, 2, 9
    f = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(f), "qwen3moe")
    for key, val in (("embedding_length", d), ("block_count", 1), ("attention.head_count", 4),
                     ("expert_count", n_exp), ("expert_used_count", k)):
        w.add_uint32(f"qwen3moe.{key}", val)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, d)).astype(np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((n_exp, d)).astype(np.float32))
    for name, shape in (("gate", (n_exp, ff, d)), ("up", (n_exp, ff, d)), ("down", (n_exp, d, ff))):
        a = (rng.standard_normal(shape) / 8).astype(np.float32)
        w.add_tensor(f"blk.0.ffn_{name}_exps.weight", quantize(a, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    m = reference.Model(f)
    assert m.n_expert == n_exp and m.n_expert_used == [k] and m.moe_norm and m.moe_scale == 0
    full = {s: reference.dequantize_tensor(m.tensors[f"blk.0.ffn_{s}_exps.weight"]).astype(np.float64)
            for s in ("gate", "up", "down")}
    assert full["down"].shape == (n_exp, d, ff)
    for e in range(n_exp):
        assert np.array_equal(m.expert_w("blk.0.ffn_down_exps.weight", e), full["down"][e])
    h = rng.standard_normal((n, d))
    seen = {}
    o = reference._moe_ffn(h, m, "blk.0.", 0, lambda il, step, buf, a: seen.setdefault(f"{step}.{buf}", a))
    router = m.w("blk.0.ffn_gate_inp.weight")
    for t in range(n):
        p = np.exp(router @ h[t] - (router @ h[t]).max())
        p /= p.sum()
        top = sorted(range(n_exp), key=lambda e: -p[e])[:k]
        glu = {e: reference.silu(full["gate"][e] @ h[t]) * (full["up"][e] @ h[t]) for e in top}
        want = sum(p[e] / sum(p[top]) * (full["down"][e] @ glu[e]) for e in top)
        np.testing.assert_allclose(o[t], want, rtol=1e-10, atol=1e-12)
        assert seen["router.ids"][t].tolist() == top


def test_swiglu_oai_matches_direct_formula():
    """gpt-oss's clamped SwiGLU (ggml_swiglu_oai, alpha 1.702, limit 7): the gate clamped from
    above only, the up value on both sides and shifted by one; element by element by hand."""
    gate = np.array([-50.0, -7.5, -1.0, 0.0, 0.3, 6.9, 7.0, 7.5, 30.0])
    up = np.array([-9.0, -7.0, -1.0, 0.5, 2.0, 6.9, 8.0, -8.0, 3.0])
    got = reference.swiglu_oai(gate[:, None], up[None, :])
    alpha = float(np.float32(1.702))
    for i, g in enumerate(gate):
        for j, u in enumerate(up):
            gc, uc = min(g, 7.0), max(-7.0, min(u, 7.0))
            want = gc / (1.0 + math.exp(-alpha * gc)) * (uc + 1.0)
            assert math.isclose(got[i, j], want, rel_tol=1e-14, abs_tol=1e-300)
    assert reference.swiglu_oai(np.array([9.0]), np.array([-1.0]))[0] == 0.0  # up -1 zeroes


def test_attention_sinks_match_direct_softmax():
    """A per-head sink logit joins every softmax's denominator (unscaled, no value), with the
    causal and sliding-window mask; by hand, per head and query, against the formula."""
    rng = np.random.default_rng(11)
    n, H, Hkv, d, scale, window = 7, 4, 2, 8, 0.35, 3
    q, k, v = rng.standard_normal((n, H, d)), rng.standard_normal((n, Hkv, d)), rng.standard_normal((n, Hkv, d))
    sinks = np.array([-1.0, 0.0, 2.5, 40.0])  # the last one dominates: output near zero
    allowed = reference.attention_mask(n, window)
    got = reference.attention(q, k, v, scale, allowed, sinks=sinks).reshape(n, H, d)
    for h in range(H):
        kv = h // (H // Hkv)
        for t in range(n):
            keys = [j for j in range(n) if j <= t and t - j < window]
            s = {j: scale * float(q[t, h] @ k[j, kv]) for j in keys}
            denom = sum(math.exp(x) for x in s.values()) + math.exp(sinks[h])
            want = sum(math.exp(s[j]) / denom * v[j, kv] for j in keys)
            np.testing.assert_allclose(got[t, h], want, rtol=1e-11, atol=1e-300)
    assert np.abs(got[:, 3]).max() < 1e-12
    # without sinks: the plain softmax
    plain = reference.attention(q, k, v, scale, allowed)
    np.testing.assert_allclose(reference.attention(q, k, v, scale, allowed, sinks=np.full(H, -np.inf)), plain, rtol=1e-14)


def test_moe_route_softmax_weight():
    """gpt-oss's gating: the k largest logits, weighted by a softmax over those k logits only
    (mathematically softmax-then-renormalize); forced picks are weighted the same way."""
    logits = np.array([[0.5, 2.0, -1.0, 2.0, 1.0, 0.0],
                       [3.0, -2.0, 0.25, 0.25, 0.25, 1.5]])
    ids, w = reference.moe_route(logits, 3, norm=False, gating="softmax_weight")
    assert ids.tolist() == [[1, 3, 4], [0, 5, 2]]
    for r in range(2):
        e = [math.exp(logits[r, i]) for i in ids[r]]
        np.testing.assert_allclose(w[r], [x / sum(e) for x in e], rtol=1e-14)
    np.testing.assert_allclose(w, reference.moe_route(logits, 3)[1], rtol=1e-13)
    forced = np.array([[5, 2, 0], [1, 3, 4]])
    wf = reference.moe_weights(logits, forced, norm=False, gating="softmax_weight")
    z = np.take_along_axis(logits, forced, axis=1)
    np.testing.assert_allclose(wf, np.exp(z) / np.exp(z).sum(1, keepdims=True), rtol=1e-14)


def test_yarn_rope_matches_direct_formula():
    """ggml's rope_yarn: per pair i, the angle blends interpolation (scale·θ) and extrapolation
    (θ) by a ramp over the correction dims, and cos/sin carry 1 + 0.1·ln(1/scale)."""
    n_rot, base, n_orig, scale = 16, 10000.0, 4096, 0.25
    lo, hi = reference.yarn_corr_dims(n_rot, n_orig, base, 32.0, 1.0)
    c = lambda beta: n_rot * math.log(n_orig / (2 * math.pi * beta)) / (2 * math.log(base))  # noqa: E731
    assert (lo, hi) == (max(0, math.floor(c(32))), min(n_rot - 1, math.ceil(c(1)))) == (2, 6)
    x = np.zeros((1, n_rot // 2, n_rot))
    for i in range(n_rot // 2):
        x[0, i, i] = 1.0  # "head" i holds a unit vector on the first member of pair i (neox)
    p = 13
    r = reference.rope(x, [p], n_rot, base, scale, neox=True, attn_factor=1.0, yarn=(1.0, n_orig, 32.0, 1.0))
    mscale = 1 + 0.1 * math.log(1 / scale)
    for i in range(n_rot // 2):
        theta = p * base ** (-2 * i / n_rot)
        ramp = 1 - min(1, max(0, (i - lo) / max(0.001, hi - lo)))
        ang = theta * scale * (1 - ramp) + theta * ramp
        assert math.isclose(r[0, i, i], math.cos(ang) * mscale, rel_tol=1e-12, abs_tol=1e-15)
        assert math.isclose(r[0, i, i + n_rot // 2], math.sin(ang) * mscale, rel_tol=1e-12, abs_tol=1e-15)
    # ext_factor 0 (or no yarn): plain linear scaling
    np.testing.assert_allclose(reference.rope(x, [p], n_rot, base, scale, True, yarn=(0.0, n_orig, 32.0, 1.0)),
                               reference.rope(x, [p], n_rot, base, scale, True), rtol=1e-15)


def test_gpt_oss_metadata_conventions(tmp_path):
    """What reference.Model reads from a gpt-oss file: even layers sliding-window, NeoX RoPE,
    query scale 1/sqrt(key_length), YaRN's magnitude factor and the gpt-oss MoE gating."""
    import gguf

    f = tmp_path / "gptoss.gguf"
    w = gguf.GGUFWriter(str(f), "gpt-oss")
    for key, val in (("context_length", 256), ("embedding_length", 64), ("block_count", 5),
                     ("attention.head_count", 4), ("attention.head_count_kv", 2), ("attention.key_length", 24),
                     ("attention.value_length", 24), ("attention.sliding_window", 8),
                     ("rope.scaling.original_context_length", 16), ("expert_count", 8), ("expert_used_count", 4)):
        w.add_uint32(f"gpt-oss.{key}", val)
    w.add_float32("gpt-oss.rope.freq_base", 150000.0)
    w.add_string("gpt-oss.rope.scaling.type", "yarn")
    w.add_float32("gpt-oss.rope.scaling.factor", 32.0)
    w.add_float32("gpt-oss.expert_weights_scale", 2.5)  # never read by llama.cpp for gpt-oss
    w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = reference.Model(f)
    assert m.is_swa == [True, False, True, False, True] and m.window == 8
    assert m.rope_neox and m.n_rot == m.head_dim == 24 and m.q_scale == 1 / math.sqrt(24)
    assert m.rope_scale == m.rope_scale_swa == 1 / 32 and m.rope_base == m.rope_base_swa == 150000.0
    assert m.yarn == (1.0, 16, 32.0, 1.0) and math.isclose(m.rope_attn_factor, 1.0, rel_tol=1e-15)
    assert m.n_expert_used == [4] * 5 and not m.moe_norm and m.moe_scale == 0 and m.moe_gating == "softmax_weight"
