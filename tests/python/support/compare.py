"""Our engine's forward pass against the NumPy reference (tests/python/reference.py), for
test_forward.py and test_synth_shapes.py.

Two comparisons, each with its budget stated here (`compare`):
- Against the reference with the same on-the-fly 8-bit activation rounding llama.cpp uses
  (reference.forward(act_quant=True)). Engine and reference then differ by float summation
  order and by the rare activation that sits on a rounding boundary and rounds the other way
  (the f32 engine and the f64 reference see inputs ~1e-7 apart); on real models, whose layer
  outputs are small differences of large terms, one such flip moves an output by up to ~1%.
  Budget: every layer's residual stream within QUANT_HIDDEN_REL (relative L2), logits within
  QUANT_LOGIT_REL (max abs difference over the largest logit magnitude), and the argmax the
  same at every position except where the reference's own top-2 margin is within the
  measured logit deviation at that position (a genuine near-tie) — reported when it happens.
- Against the plain float64 reference: the total cost of 8-bit activations. Each layer
  within HIDDEN_REL, logits within LOGIT_REL. A mixture of experts's float run takes the
  experts the 8-bit run picked: routing is a discontinuous choice, and 8-bit rounding may swap
  a near-tied last pick (the 8-bit comparison above holds the engine to the picks themselves).
"""

import os

import numpy as np

import reference

QUANT_HIDDEN_REL = 0.05
QUANT_LOGIT_REL = 0.08
HIDDEN_REL = 0.05
LOGIT_REL = 0.08
# Where the reference's own 8-bit run is further from its float run (the budget measures the
# model, not the engine): the small gpt-oss (sinks, clamped SwiGLU, YaRN's 1.35 on q and k)
# moves its logits by 0.037 (Q4_0, MXFP4) to 0.120 (Q2_K) between the two reference runs,
# seed 3, 2026-12-07; the engine sits within 0.03 of the 8-bit run for every type.
LOGIT_REL_BY_ARCH = {"gpt-oss": 0.15}

_models = {}


def ref_model(path):
    """The reference's Model of one of the two test models in models/ (not of a synthetic
    model in a temporary directory), loaded once for the whole session and shared by every test
    that reads it (test_dequant, test_forward, test_gpu, test_llamacpp, test_reference_selftest).
    Loading is slow: gguf's GGUFReader takes about 10 s to parse Gemma's 262k-token vocabulary
    and 3 s SmolLM2's, and the first forward pass widens the weights to float64 (8 s and 3 s),
    which each of those files did again. The Model keeps its float64 weights: both models'
    together are 3.0 GiB (4.2 GiB of RSS with the parsed files), what test_reference_selftest
    held at once before anyway. A test that changes an attribute of the Model puts it back
    (test_sliding_window)."""
    key = os.path.realpath(path)
    if key not in _models:
        _models[key] = reference.load(key)
    return _models[key]


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def compare(ours, model, toks, what, ctx=None):
    """Both comparisons of the module docstring for one input (`ctx`: the context our engine
    ran with, when not the prompt's length; it picks LongRoPE's factors)."""
    steps = {} if getattr(model, "n_expert", 0) else None
    ref_q, hid_q = reference.forward(model, toks, act_quant=True, ctx=ctx, steps=steps)
    routes = None
    if steps is not None:
        routes = {il: np.asarray(steps[f"layer.{il}.router.ids"]).astype(np.int64) for il in range(model.n_layer)}
    ref_f, hid_f = reference.forward(model, toks, ctx=ctx, routes=routes)
    lo = ours["logits"]
    assert lo.shape == ref_q.shape, f"{what}: logits shape {lo.shape} vs {ref_q.shape}"
    for il in range(model.n_layer):
        a = ours[f"layer.{il}"]
        e = rel_l2(a, hid_q[f"layer.{il}"])
        assert e < QUANT_HIDDEN_REL, f"{what}: layer {il} differs from the 8-bit-activation reference by {e:.2e}"
        e = rel_l2(a, hid_f[f"layer.{il}"])
        assert e < HIDDEN_REL, f"{what}: layer {il} differs from the float reference by {e:.4f}"
    e = np.abs(lo - ref_q).max() / np.abs(ref_q).max()
    assert e < QUANT_LOGIT_REL, f"{what}: logits differ from the 8-bit-activation reference by {e:.2e}"
    e = np.abs(lo - ref_f).max() / np.abs(ref_f).max()
    budget = LOGIT_REL_BY_ARCH.get(model.arch, LOGIT_REL)
    assert e < budget, f"{what}: logits differ from the float reference by {e:.4f}"
    ours_arg, ref_arg = lo.argmax(1), ref_q.argmax(1)
    for pos in np.nonzero(ours_arg != ref_arg)[0]:
        margin = ref_q[pos, ref_arg[pos]] - ref_q[pos, ours_arg[pos]]
        deviation = np.abs(lo[pos] - ref_q[pos]).max()
        assert margin <= deviation, (
            f"{what}: argmax differs at position {pos} ({ours_arg[pos]} vs {ref_arg[pos]}) although the "
            f"reference's margin {margin:.4f} exceeds our deviation {deviation:.4f}"
        )
        print(f"{what}: near-tie at position {pos}: margin {margin:.4f} <= deviation {deviation:.4f}")
