"""Dequantization of the real models' tensors (every type they hold) equals PyPI gguf's
`gguf.quants.dequantize` exactly."""

import pytest

import dequant_check
from support.paths import GEMMA, SMOL, model_path


@pytest.mark.parametrize("name", [pytest.param(GEMMA.name, marks=pytest.mark.slow), SMOL.name])
def test_dequantize_equals_gguf_py(name, ringllm):
    mismatches = dequant_check.check(str(model_path(name)), str(ringllm))
    assert mismatches == [], "\n".join(mismatches)
