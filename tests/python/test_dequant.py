"""Dequantization of the real models' tensors (every type they hold), and of synthetic models in
the types the real ones lack, equals PyPI gguf's `gguf.quants.dequantize` exactly."""

import pytest
from gguf import GGUFReader

import dequant_check
from support.cli import run
from support.paths import GEMMA, SMOL, model_path


@pytest.mark.parametrize("name", [pytest.param(GEMMA.name, marks=pytest.mark.slow), SMOL.name])
def test_dequantize_equals_gguf_py(name, ringllm):
    mismatches = dequant_check.check(str(model_path(name)), str(ringllm))
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
