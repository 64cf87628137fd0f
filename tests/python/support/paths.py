"""Where things are: the repository, the test models and fixtures, the ringllm binary under test
(RINGLLM_BIN, else target/ci/ringllm) and the test cluster's key."""

import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
MODELS = ROOT / "models"
FIXTURES = ROOT / "tests" / "fixtures"
GEMMA = MODELS / "gemma-3-270m-q4_k_m.gguf"
SMOL = MODELS / "smollm2-135m-instruct-q4_1.gguf"
KEY = FIXTURES / "test-cluster.key"


def ringllm_bin():
    p = pathlib.Path(os.environ.get("RINGLLM_BIN", ROOT / "target" / "ci" / "ringllm"))
    if not p.exists():
        pytest.fail(f"ringllm binary {p} not found: build it (cargo build --profile ci) or set RINGLLM_BIN")
    return p


def model_path(name):
    p = MODELS / name
    if not p.exists():
        pytest.fail(f"{p} is missing: run scripts/fetch-models")
    return p


def load_fixture(name):
    p = FIXTURES / name
    if not p.exists():
        pytest.fail(f"fixture {p} is missing")
    return json.loads(p.read_text())
