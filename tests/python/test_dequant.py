"""Dequantization of the real models' tensors (every type they hold), and of synthetic models in
the types the real ones lack, equals PyPI gguf's `gguf.quants.dequantize` exactly."""

import pytest
from gguf import GGUFReader

import dequant_check
from support.cli import run
from support.compare import ref_model
from support.paths import GEMMA, SMOL, model_path


@pytest.mark.parametrize("name", [pytest.param(GEMMA.name, marks=pytest.mark.slow), SMOL.name])
def test_dequantize_equals_gguf_py(name, ringllm):
    path = model_path(name)
    # gguf's reader of the model, parsed once for the session (support/compare.py).
    mismatches = dequant_check.check(str(path), str(ringllm), reader=ref_model(path).reader)
    assert mismatches == [], "\n".join(mismatches)


@pytest.mark.parametrize("mix", ["q2_k", "q3_k_m"])
def test_low_bit_k_quant_mixes_equal_gguf_py(mix, ringllm, tmp_path):
    """Q2_K and Q3_K (with the Q4_K, Q5_K and Q6_K tensors llama.cpp's Q2_K and Q3_K_M mixes
    put beside them) written by our quantizer and read back by gguf-py: every type the file
    holds dequantizes to gguf's bits, the low-bit matrices among them."""
    f = tmp_path / f"tiny-{mix}.gguf"
    run(["debug", "synth", "--shape", "tiny", "--type", mix, "--seed", "4", "-o", f])
    types = {t.tensor_type.name for t in GGUFReader(str(f)).tensors}
    want = {"q2_k": "Q2_K", "q3_k_m": "Q3_K"}[mix]
    assert want in types, f"{mix}: no {want} tensor in {sorted(types)}"
    mismatches = dequant_check.check(str(f), str(ringllm))
    assert mismatches == [], "\n".join(mismatches)


@pytest.mark.parametrize("ty", ["IQ4_NL", "IQ4_XS"])
def test_synthetic_dequantize_equals_gguf_py(ty, ringllm, tmp_path):
    """A tiny synthetic model written in `ty` by our reference quantizer: every tensor of that
    type (first and last) and the embedding decode as gguf decodes them."""
    f = tmp_path / f"{ty}.gguf"
    run(["debug", "synth", "--arch", "llama", "--type", ty, "--seed", "4", "-o", f])
    types = {t.tensor_type.name for t in GGUFReader(str(f)).tensors}
    assert ty in types, f"the synthetic model holds no {ty} tensor: {types}"
    mismatches = dequant_check.check(str(f), str(ringllm))
    assert mismatches == [], "\n".join(mismatches)
