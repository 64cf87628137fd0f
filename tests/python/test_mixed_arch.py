"""A mixed-architecture ring on loopback: an x86_64 coordinator, one x86_64 node and one
aarch64 node (the cross-built binary under qemu-aarch64-static), SmolLM2 split between the
nodes, against the x86_64 single process (`ringllm run`).

Across instruction sets the logits are not bit-identical (the kernels sum in other orders), so
the test measures the cross-ISA logit budget — the largest |logit difference| between the
ring's and the single process's logits over every step — and requires the greedy ids to be
equal on every step whose top-2 margin (in the single process's logits) exceeds that budget.
The budget itself must stay within twice the gap between this machine's own kernel levels
(scalar against the best), so a node computing garbage fails. Needs target/aarch64-unknown-linux-gnu/ci/ringllm (scripts/cross-aarch64) and
qemu-aarch64-static; skipped, saying which is missing, without them."""

import json
import os
import pathlib
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from support.nodes import free_port, wait_port
from support.paths import KEY, MODELS, ROOT, SMOL, model_path, ringllm_bin

pytestmark = pytest.mark.qemu

ARM_BIN = pathlib.Path(os.environ.get(
    "RINGLLM_AARCH64_BIN", ROOT / "target" / "aarch64-unknown-linux-gnu" / "ci" / "ringllm"))
QEMU = ROOT / "scripts" / "qemu-aarch64"
PROMPT = "The three primary colors are"
STEPS = 12
GEN = ["-p", PROMPT, "--temp", "0", "-n", str(STEPS), "-c", "256", "--json"]
# SmolLM2-135M has 30 layers: the x86_64 node takes 0-14, the aarch64 node 15-29.
SPLIT = ("0-14", "15-29")
# The budget may be at most twice the gap between this x86_64 machine's own kernel levels
# (the single process at RINGLLM_ISA=scalar against its best level, measured by the test:
# ≈ 0.9 on SmolLM2, about 3% of the largest |logit|), or this share of the largest |logit|
# where that gap is smaller. A node computing garbage is off by more than the logits' scale.
MIN_RELATIVE_CAP = 0.05


def missing_arm():
    if shutil.which("qemu-aarch64-static") is None:
        return "qemu-aarch64-static is not installed (scripts/cross-aarch64 installs it)"
    if not ARM_BIN.exists():
        return f"{ARM_BIN} is missing (build it with scripts/cross-aarch64)"
    return None


def read_rows(path, vocab=None):
    a = np.frombuffer(pathlib.Path(path).read_bytes(), dtype="<f4")
    return a.reshape(STEPS if vocab is None else -1, -1 if vocab is None else vocab)


def start_node(cmd, port, log_path):
    log = open(log_path, "w+")
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        wait_port("127.0.0.1", port, timeout=90)
    except Exception:
        p.kill()
        p.wait(timeout=10)
        log.flush()
        raise AssertionError(f"{' '.join(map(str, cmd))} did not listen:\n{pathlib.Path(log_path).read_text()}")
    return p, log


def test_mixed_x86_aarch64_ring_matches_single_process(tmp_path):
    why = missing_arm()
    if why:
        pytest.skip(why)
    model = model_path(SMOL.name)
    x86 = ringllm_bin()

    single = subprocess.run(
        [str(x86), "run", "-m", model, *GEN, "--threads", "1", "--step-logits-out", tmp_path / "single.f32"],
        capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    want = json.loads(single.stdout)
    assert len(want["token_ids"]) == STEPS, want

    # The same machine's scalar level against its best: how far kernel levels alone move.
    scalar = subprocess.run(
        [str(x86), "run", "-m", model, *GEN, "--threads", "1", "--step-logits-out", tmp_path / "scalar.f32"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, RINGLLM_ISA="scalar"))
    assert scalar.returncode == 0, scalar.stderr
    scalar_ids = json.loads(scalar.stdout)["token_ids"]

    ports = [free_port(), free_port()]
    cache = pathlib.Path(tempfile.mkdtemp(prefix="ringllm-mixed-"))
    common = lambda port, name: ["-v", "node", "--listen", f"127.0.0.1:{port}", "--key", str(KEY),
                                 "--models", str(MODELS), "--name", name, "--threads", "1",
                                 "--cache", str(cache / name)]
    procs = []
    try:
        procs.append(start_node([str(x86), *common(ports[0], "x86")], ports[0], tmp_path / "x86.log"))
        procs.append(start_node([str(QEMU), str(ARM_BIN), *common(ports[1], "arm")], ports[1],
                                tmp_path / "arm.log"))
        cluster = tmp_path / "mixed.toml"
        cluster.write_text(
            f'model = "{model}"\nkey = "{KEY}"\n\n[coordinator]\nthreads = 1\n\n'
            f'[[node]]\nname = "x86"\naddress = "127.0.0.1:{ports[0]}"\nthreads = 1\nlayers = "{SPLIT[0]}"\n\n'
            f'[[node]]\nname = "arm"\naddress = "127.0.0.1:{ports[1]}"\nthreads = 1\nlayers = "{SPLIT[1]}"\n')
        ring = subprocess.run(
            [str(x86), "up", cluster, *GEN, "--step-logits-out", tmp_path / "ring.f32"],
            capture_output=True, text=True, timeout=600)
        logs = "\n".join(f"--- {n}\n{pathlib.Path(l.name).read_text()[-3000:]}"
                          for n, (_, l) in zip(["x86 node", "aarch64 node"], procs))
        assert ring.returncode == 0, f"{ring.stderr}\n{logs}"
        # Each node loaded the layers the cluster file gives it.
        for (_, log), layers in zip(procs, ["0..15", "15..30"]):
            text = pathlib.Path(log.name).read_text()
            assert "assignment loaded" in text and f"layers={layers}" in text, text[-3000:]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
        for p, log in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            log.close()
        shutil.rmtree(cache, ignore_errors=True)

    got = json.loads(ring.stdout)
    assert got["prompt_token_ids"] == want["prompt_token_ids"]
    a = read_rows(tmp_path / "single.f32")
    vocab = a.shape[1]
    b = read_rows(tmp_path / "ring.f32", vocab)
    n = len(got["token_ids"])
    assert n >= 1 and b.shape[0] == n, (b.shape, n)

    def comparable_steps(ids):
        """Logits of step k depend on the ids before k: comparable up to the first differing
        id, inclusive. Returns (steps, first differing step or None)."""
        first = next((k for k in range(min(len(ids), STEPS)) if ids[k] != want["token_ids"][k]), None)
        return ((first + 1) if first is not None else min(len(ids), STEPS)), first

    c = read_rows(tmp_path / "scalar.f32", vocab)
    level_steps, _ = comparable_steps(scalar_ids)
    level_gap = float(np.abs(a[:level_steps] - c[:level_steps]).max())
    comparable, first_diff = comparable_steps(got["token_ids"])
    diff = np.abs(a[:comparable] - b[:comparable])
    budget = float(diff.max())
    scale = float(np.abs(a[:comparable]).max())
    top2 = np.sort(a[:comparable], axis=1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    checked = [k for k in range(comparable) if margins[k] > budget]
    cap = max(2 * level_gap, MIN_RELATIVE_CAP * scale)
    report = {
        "budget_max_abs_logit_diff": budget,
        "x86_scalar_vs_best_gap": level_gap,
        "budget_cap": cap,
        "per_step_max_abs_diff": [round(float(d), 5) for d in diff.max(axis=1)],
        "max_abs_logit": scale,
        "margins": [round(float(m), 4) for m in margins],
        "checked_steps": checked,
        "first_differing_step": first_diff,
        "ring_ids": got["token_ids"],
        "single_ids": want["token_ids"],
        "ring_decode_tokens_per_s": got["decode_tokens_per_s"],
        "ring_prefill_tokens_per_s": got["prefill_tokens_per_s"],
        "single_decode_tokens_per_s": want["decode_tokens_per_s"],
    }
    print("mixed x86_64/aarch64 ring:", json.dumps(report))
    out = os.environ.get("RINGLLM_MIXED_REPORT")
    if out:
        pathlib.Path(out).write_text(json.dumps(report, indent=1) + "\n")
    assert budget <= cap, f"cross-ISA logit budget too large: {report}"
    assert checked, f"no step has a top-2 margin above the budget: nothing was compared: {report}"
    for k in checked:
        assert got["token_ids"][k] == want["token_ids"][k], f"step {k}: margin {margins[k]} > budget {budget}: {report}"
