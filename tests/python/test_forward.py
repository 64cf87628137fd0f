"""Our engine's forward pass against the independent NumPy reference (reference.py, which reads
and dequantizes with PyPI's gguf): per-layer hidden states and final logits, on the real models
and on synthetic random-weight models in every weight type.

Error budget (stated once, used everywhere): our matmuls quantize activations to 8 bits on the
fly (as llama.cpp does), the reference does not; so each layer's residual stream may differ by
HIDDEN_REL (relative L2 norm) and the logits by LOGIT_REL (max abs difference relative to the
largest logit magnitude), and the argmax must agree at every position.
"""

import numpy as np
import pytest

import reference
from conftest import GEMMA, SMOL, forward_dump, model_path, run

HIDDEN_REL = 0.05
LOGIT_REL = 0.08

# Token ids used as inputs (any ids are valid forward-pass inputs). The first list of each
# model is "The capital of France is" as llama.cpp tokenizes it (tests/fixtures).
PROMPTS = {
    GEMMA.name: [
        [2, 818, 5279, 529, 7001, 563],
        [2, 2094, 24778, 236769, 236749, 1473, 107, 140, 584, 538, 655, 236743, 236778, 236787],
        [2, 12055, 3324, 496, 990, 236764, 528, 496, 1944, 10280, 236764],
    ],
    SMOL.name: [
        [504, 3575, 282, 4649, 314],
        [1, 4093, 198, 6121, 314, 216, 34, 50, 34, 47, 2, 198, 1, 520, 9531, 198],
        [9700, 2030, 253, 655, 28, 281, 253, 1165, 5960, 28],
    ],
}

_cache = {}


def ref_model(path):
    key = str(path)
    if key not in _cache:
        _cache.clear()  # one big model in memory at a time
        _cache[key] = reference.load(str(path))
    return _cache[key]


def compare(ours, ref_logits, ref_hidden, n_layer, what):
    for il in range(n_layer):
        a = ours[f"layer.{il}"]
        b = ref_hidden[f"layer.{il}"]
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < HIDDEN_REL, f"{what}: layer {il} hidden state relative error {rel:.4f}"
    lo = ours["logits"]
    assert lo.shape == ref_logits.shape, f"{what}: logits shape {lo.shape} vs {ref_logits.shape}"
    err = np.abs(lo - ref_logits).max() / np.abs(ref_logits).max()
    assert err < LOGIT_REL, f"{what}: logits max relative error {err:.4f}"
    ours_arg = lo.argmax(axis=1)
    ref_arg = ref_logits.argmax(axis=1)
    for pos, (a, b) in enumerate(zip(ours_arg, ref_arg)):
        if a != b:
            # Only a genuine near-tie in the reference may flip the argmax.
            gap = ref_logits[pos, b] - ref_logits[pos, a]
            assert gap < 1e-3 * np.abs(ref_logits[pos]).max(), f"{what}: argmax differs at position {pos}: {a} vs {b} (reference gap {gap:.4f})"
    return err


@pytest.mark.parametrize("name", [GEMMA.name, SMOL.name])
def test_real_model_matches_reference(name, tmp_path):
    path = model_path(name)
    m = ref_model(path)
    for i, toks in enumerate(PROMPTS[name]):
        ours = forward_dump(path, toks, tmp_path / f"p{i}", "--threads", "2")
        logits, hidden = reference.forward(m, toks)
        compare(ours, logits, hidden, m.n_layer, f"{name} prompt {i}")


@pytest.mark.parametrize("name", [GEMMA.name, SMOL.name])
def test_batch_size_does_not_change_the_answer(name, tmp_path):
    """Prefill in one batch, in batches of 3 and token by token: same argmax everywhere,
    logits within a tight budget (only the order of float sums may differ)."""
    path = model_path(name)
    toks = PROMPTS[name][1]
    base = forward_dump(path, toks, tmp_path / "b512", "--batch", "512")
    for b in ["3", "1"]:
        other = forward_dump(path, toks, tmp_path / f"b{b}", "--batch", b)
        err = np.abs(other["logits"] - base["logits"]).max() / np.abs(base["logits"]).max()
        assert err < 1e-3, f"batch {b}: logits relative error {err}"
        assert (other["logits"].argmax(1) == base["logits"].argmax(1)).all()


WEIGHT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("ty", WEIGHT_TYPES)
def test_synthetic_model_matches_reference(arch, ty, tmp_path):
    f = tmp_path / f"{arch}-{ty}.gguf"
    run(["debug", "synth", "--arch", arch, "--type", ty, "--seed", "3", "-o", f])
    m = reference.load(str(f))
    rng = np.random.default_rng(5)
    toks = [1] + [int(t) for t in rng.integers(3, m.vocab, size=23)]  # longer than gemma's window
    ours = forward_dump(f, toks, tmp_path / "dump", "--threads", "2", "--batch", "7")
    logits, hidden = reference.forward(m, toks)
    compare(ours, logits, hidden, m.n_layer, f"synthetic {arch} {ty}")
