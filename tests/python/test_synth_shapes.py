"""Real-size synthetic shapes (`debug synth --shape`): the files run (`run -p`, `up -p`), their
logits are finite, and on cuts of the big shapes (their real layer dimensions, 2 layers, a small
vocabulary so CI stays small) our forward pass agrees with the NumPy reference within the
budgets of support/compare.py (test_forward.py's). A ring over a shape is bit-identical to the single process."""

import json
import pathlib
import subprocess

import numpy as np
import pytest

import reference
from support.cli import forward_dump, generation, run
from support.compare import compare
from support.nodes import Nodes
from support.paths import KEY, ringllm_bin


def synth(tmp_path, shape, *extra, ty="q4_k_m"):
    f = tmp_path / f"{shape}.gguf"
    run(["debug", "synth", "--shape", shape, "--type", ty, "-o", f, *extra])
    return f


def run_json(model, prompt, *extra):
    r = run(["run", "-m", model, "-p", prompt, "--json", "--temp", "0", "-n", "4", *extra])
    return json.loads(r.stdout)


# (shape, extra flags): the tiny shape whole, and 2-layer cuts of big shapes.
CUTS = [
    ("tiny", []),
    ("llama3-1b", ["--layers", "2", "--vocab", "4096"]),
    ("gemma3-1b", ["--layers", "2", "--vocab", "4096"]),
    ("qwen3-0.6b", ["--layers", "2", "--vocab", "4096"]),
]


@pytest.mark.parametrize("shape,extra", CUTS, ids=[c[0] for c in CUTS])
def test_shape_runs_and_matches_the_reference(shape, extra, tmp_path):
    f = synth(tmp_path, shape, *extra)
    out = run_json(f, "Hello world, the model", "--threads", "2")
    assert out["prompt_token_ids"], out
    assert 1 <= len(out["token_ids"]) <= 4 and out["finish_reason"] in ("length", "stop"), out

    m = reference.load(str(f))
    rng = np.random.default_rng(7)
    toks = [int(t) for t in rng.integers(0, min(m.vocab, 1000), size=12)]
    ours = forward_dump(f, toks, tmp_path / "dump", "--threads", "2", "--batch", "5")
    assert np.isfinite(ours["logits"]).all()
    compare(ours, m, toks, f"synthetic {shape} {' '.join(extra)}")


def test_qwen2_cut_has_finite_logits(tmp_path):
    """Qwen 2 7B's real layer (Q/K/V biases, NeoX RoPE): one layer, small vocabulary."""
    f = synth(tmp_path, "qwen2-7b", "--layers", "1", "--vocab", "2048")
    out = run_json(f, "Hello world")
    assert len(out["token_ids"]) == 4 or out["finish_reason"] == "stop", out
    ours = forward_dump(f, [5, 300, 1000, 17], tmp_path / "dump", "--threads", "2")
    assert np.isfinite(ours["logits"]).all()
    assert np.abs(ours["logits"]).max() > 0


def test_single_types_and_the_small_models_still_work(tmp_path):
    f = synth(tmp_path, "tiny", ty="q8_0")
    assert len(run_json(f, "Hello")["token_ids"]) >= 1
    # --arch still writes the small in-memory models; --layers needs --shape.
    run(["debug", "synth", "--arch", "llama", "--type", "q4_0", "-o", tmp_path / "small.gguf"])
    r = subprocess.run([str(ringllm_bin()), "debug", "synth", "--shape", "llama3-70b", "-o", tmp_path / "x.gguf"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "llama3-8b" in r.stderr, r.stderr
    r = subprocess.run([str(ringllm_bin()), "debug", "synth", "--arch", "llama", "--type", "q8_0", "--layers", "2",
                        "-o", tmp_path / "y.gguf"], capture_output=True, text=True)
    assert r.returncode != 0 and "--layers" in r.stderr, r.stderr
    # A refused request leaves no file behind.
    bad = tmp_path / "bad.gguf"
    r = subprocess.run([str(ringllm_bin()), "debug", "synth", "--shape", "llama3-8b", "--vocab", "100", "-o", bad],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "vocabulary 100" in r.stderr and not bad.exists(), r.stderr
    # A full disk is an error, not a short file.
    r = subprocess.run([str(ringllm_bin()), "debug", "synth", "--shape", "tiny", "-o", "/dev/full"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "No space left" in r.stderr, r.stderr
    assert pathlib.Path("/dev/full").exists()


def test_ring_over_a_shape_is_bit_identical_to_the_single_process(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    f = synth(models, "llama3-1b", "--layers", "3", "--vocab", "4096")
    gen = ["--temp", "0", "-n", "6", "--threads", "1", "-c", "128"]
    want, want_logits, _ = generation(["run", "-m", f, "-p", "Hello world", *gen], tmp_path / "s.f32")
    with Nodes(2, models=models) as nodes:
        got, logits, _ = generation(["up", "-m", f, "--key", KEY, *nodes.node_flags(), "-p", "Hello world", *gen],
                                    tmp_path / "r.f32")
    assert got["token_ids"] == want["token_ids"]
    assert logits == want_logits
    assert np.isfinite(np.frombuffer(logits, dtype="<f4")).all()
