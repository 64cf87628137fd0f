"""Shared pytest fixtures: the ringllm binary, the test models, the NumPy reference."""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
FIXTURES = ROOT / "tests" / "fixtures"
GEMMA = MODELS / "gemma-3-270m-q4_k_m.gguf"
SMOL = MODELS / "smollm2-135m-instruct-q4_1.gguf"


def _bin():
    p = pathlib.Path(os.environ.get("RINGLLM_BIN", ROOT / "target" / "ci" / "ringllm"))
    if not p.exists():
        pytest.fail(f"ringllm binary {p} not found: build it (cargo build --profile ci) or set RINGLLM_BIN")
    return p


@pytest.fixture(scope="session")
def ringllm():
    return _bin()


def model_path(name):
    p = MODELS / name
    if not p.exists():
        pytest.fail(f"{p} is missing: run scripts/fetch-models")
    return p


def run(args, **kw):
    """Runs the ringllm binary; fails the test with its stderr on a non-zero exit."""
    r = subprocess.run([str(_bin()), *map(str, args)], capture_output=True, text=True, **kw)
    if r.returncode != 0:
        pytest.fail(f"ringllm {' '.join(map(str, args))} exited {r.returncode}:\n{r.stderr}")
    return r


def forward_dump(model, tokens, tmp, *extra, env=None):
    """Our engine's embeddings, per-layer hidden states and logits for `tokens` (`env`: the
    process environment, e.g. to force a kernel level with RINGLLM_ISA)."""
    out = pathlib.Path(tmp)
    run(["debug", "forward", "-m", model, "--tokens", ",".join(map(str, tokens)), "--dump", out, *extra], env=env)
    d = {p.stem: np.load(p) for p in out.glob("*.npy")}
    return d


def load_fixture(name):
    p = FIXTURES / name
    if not p.exists():
        pytest.fail(f"fixture {p} is missing")
    return json.loads(p.read_text())
