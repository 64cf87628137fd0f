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
    typ = [] if "--type" in extra else ["--type", ty]
    run(["debug", "synth", "--shape", shape, *typ, "-o", f, *extra])
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
    # Gemma 4 E2B's real layer dimensions, with its per-layer embeddings (2 sliding layers).
    ("gemma4-e2b", ["--layers", "2", "--vocab", "4096"]),
    # Phi-3 mini's real layer (fused Q/K/V and gate/up, window 2047): one layer, its float64
    # reference weights near 1 GB.
    pytest.param("phi3-mini", ["--layers", "1", "--vocab", "4096"], marks=pytest.mark.slow, id="phi3-mini"),
    # A mixture-of-experts shape's real layer (one: the reference widens every expert a token
    # picks to float64, up to 4 GB for a layer). gpt-oss-20b's 2-layer cut is not here: its
    # second layer's residual sits 6% (relative L2) from the 8-bit reference's, over the 5%
    # budget, though ours and the reference's logits are both within 1.5% of llama.cpp's on it
    # (12 positions, 2026-12-07): a routing near-tie among its 32 experts, to be pinned down.
    pytest.param("qwen3-30b-a3b", ["--layers", "1", "--vocab", "4096"], marks=pytest.mark.slow,
                 id="qwen3-30b-a3b"),
]


@pytest.mark.parametrize("shape,extra", CUTS, ids=[getattr(c, "id", None) or c[0] for c in CUTS])
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


def test_ring_over_gemma4_keeps_shared_kv_layers_with_their_source(tmp_path):
    """gemma4-tiny: layers 3, 4 and 5 read the KV caches of layers 1, 1 and 2, so of two nodes
    the first takes layer 0 and the second 1..6 (the planner cuts nowhere between a shared-KV
    layer and its source); the ring's tokens and logits equal the single process's
    bit for bit. A Gemma 4 E-model (per-layer embeddings, made from the token embedding on the
    coordinator) is refused by the ring with a reason, and still runs in one process."""
    models = tmp_path / "models"
    models.mkdir()
    f = synth(models, "gemma4-tiny")
    gen = ["--temp", "0", "-n", "12", "--threads", "1", "-c", "128"]
    want, want_logits, _ = generation(["run", "-m", f, "-p", "Hello world, the model", *gen], tmp_path / "s.f32")
    with Nodes(2, models=models) as nodes:
        got, logits, err = generation(["up", "-m", f, "--key", KEY, *nodes.node_flags(), "-p",
                                       "Hello world, the model", *gen], tmp_path / "r.f32")
    assert got["token_ids"] == want["token_ids"]
    assert logits == want_logits
    import re

    assert re.search(r"layers\s+0(-0)?\s", err) and re.search(r"layers\s+1-5\b", err), err

    e = models / "e.gguf"
    run(["debug", "synth", "--arch", "gemma4", "--type", "q8_0", "-o", e])
    assert len(run_json(e, "Hello")["token_ids"]) >= 1
    with Nodes(2, models=models) as nodes:
        r = subprocess.run([str(ringllm_bin()), "up", "-m", e, "--key", KEY, *nodes.node_flags(), "-p", "Hello",
                            "-n", "2"], capture_output=True, text=True)
    assert r.returncode != 0 and "per-layer embedding" in r.stderr, r.stderr
