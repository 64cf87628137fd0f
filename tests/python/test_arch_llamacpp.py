"""Every architecture against llama.cpp itself: tiny synthetic models of each architecture's real
structure, and llama.cpp's logits on them at every position of a fixed token sequence
(tests/fixtures/arch/*.json, made by tests/fixtures/make_arch_fixtures.py). Each architecture so
has two oracles: llama.cpp and the float64 NumPy reference (reference.py).

Budget. The fixtures' weights are F32 (or one 8-bit type), llama.cpp's KV cache f32: what
separates llama.cpp from float64 math is its float32 arithmetic, which we measure here on each
case (`ll_err`: max |llama.cpp - reference| over the largest reference logit). Our engine must be
no further from llama.cpp than twice that (ours = reference + our own float32 error, which must
be no larger than llama.cpp's), and the reference itself must agree with llama.cpp to
REF_REL: a misreading of the architecture shared by the engine and the reference (a wrong RoPE
layout, a missing norm, a soft-cap) moves logits by far more than float32 rounding does.
"""

import hashlib
import json

import numpy as np
import pytest

import reference
from support.cli import forward_dump, run
from support.paths import FIXTURES

CASES = sorted(p.stem for p in (FIXTURES / "arch").glob("*.json"))
# The reference and llama.cpp: float32 against float64 on tiny models (d <= 256, 2 layers).
REF_REL = 1e-3
# A floor for the engine's budget when llama.cpp happens to sit almost on the float64 answer.
FLOOR_REL = 2e-5
# Quantized-weight cases: both engines round activations to 8 bits, which the float64 reference
# does not; the reference is then compared with its own 8-bit activation rounding and the
# budget is the one test_forward uses for it (support/compare.py).
QUANT_REL = 0.08
# Architecture names that are another's GGUF spelling (the same code path and fixture).
ALIASES = {"mistral": "llama"}


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_architecture_has_a_llamacpp_case():
    """An architecture the engine runs without a llama.cpp case would pass this file silently."""
    archs = {json.loads((FIXTURES / "arch" / f"{c}.json").read_text())["synth_args"][1] for c in CASES}
    missing = {ALIASES.get(a, a) for a in reference.SUPPORTED_ARCHS} - archs
    assert not missing, f"no llama.cpp fixture for {sorted(missing)}: add a case to make_arch_fixtures.py"


@pytest.mark.parametrize("case", CASES)
def test_logits_match_llamacpp(case, tmp_path):
    fx = json.loads((FIXTURES / "arch" / f"{case}.json").read_text())
    model = tmp_path / f"{case}.gguf"
    run(["debug", "synth", *fx["synth_args"], "-o", model])
    assert _sha256(model) == fx["sha256"], (
        f"{case}: `debug synth {' '.join(fx['synth_args'])}` no longer writes the file the fixture was made "
        "on; regenerate it with tests/fixtures/make_arch_fixtures.py"
    )
    toks = fx["tokens"]
    ll = np.asarray(fx["logits"], dtype=np.float64)
    m = reference.load(str(model))
    assert ll.shape == (len(toks), m.vocab), f"{case}: fixture shape {ll.shape}"
    quantized = fx["synth_args"][fx["synth_args"].index("--type") + 1].lower() not in ("f32", "f16", "bf16")
    ref, _ = reference.forward(m, toks, act_quant=quantized)
    ours = forward_dump(model, toks, tmp_path / "dump", "--threads", "2")["logits"].astype(np.float64)
    scale = np.abs(ref).max()
    ll_err = np.abs(ll - ref).max() / scale
    ours_ll = np.abs(ours - ll).max() / scale
    ours_ref = np.abs(ours - ref).max() / scale
    print(f"{case}: llama.cpp-reference {ll_err:.2e}, ours-llama.cpp {ours_ll:.2e}, ours-reference {ours_ref:.2e}")
    if quantized:
        assert ll_err < QUANT_REL, f"{case}: llama.cpp and the 8-bit reference differ by {ll_err:.2e}"
        assert ours_ll < QUANT_REL, f"{case}: ours and llama.cpp differ by {ours_ll:.2e}"
    else:
        assert ll_err < REF_REL, f"{case}: the NumPy reference and llama.cpp differ by {ll_err:.2e}"
        assert ours_ll <= max(2 * ll_err, FLOOR_REL), (
            f"{case}: ours is {ours_ll:.2e} from llama.cpp, more than twice llama.cpp's own distance from "
            f"float64 ({ll_err:.2e})"
        )
    # The greedy choice at every position: the same unless llama.cpp's own top-2 margin is within
    # the measured deviation there (a genuine near-tie).
    for pos in np.nonzero(ours.argmax(1) != ll.argmax(1))[0]:
        a, b = ll.argmax(1)[pos], ours.argmax(1)[pos]
        margin, dev = ll[pos, a] - ll[pos, b], np.abs(ours[pos] - ll[pos]).max()
        assert margin <= dev, f"{case}: argmax differs at position {pos} ({b} vs llama.cpp {a}), margin {margin:.2e}"
