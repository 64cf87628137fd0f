"""Running the ringllm binary: `run` fails the test with its stderr, `ringllm` raises (or, with
check=False, returns the failed result), `generation` reads `--json` and `--logits-out`,
`forward_dump` reads `debug forward --dump`."""

import json
import pathlib
import subprocess

import numpy as np
import pytest

from .paths import ringllm_bin


def run(args, **kw):
    """Runs the ringllm binary; fails the test with its stderr on a non-zero exit."""
    r = subprocess.run([str(ringllm_bin()), *map(str, args)], capture_output=True, text=True, **kw)
    if r.returncode != 0:
        pytest.fail(f"ringllm {' '.join(map(str, args))} exited {r.returncode}:\n{r.stderr}")
    return r


def ringllm(args, timeout=300, check=True, **kw):
    r = subprocess.run([str(ringllm_bin()), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"ringllm {' '.join(map(str, args))} exited {r.returncode}:\n{r.stderr}")
    return r


def generation(args, logits_path):
    """Runs `run`/`up` with --json and --logits-out; returns (json, logits bytes)."""
    r = ringllm([*args, "--json", "--logits-out", logits_path])
    return json.loads(r.stdout), pathlib.Path(logits_path).read_bytes(), r.stderr


def forward_dump(model, tokens, tmp, *extra, env=None):
    """Our engine's embeddings, per-layer hidden states and logits for `tokens` (`env`: the
    process environment, e.g. to force a kernel level with RINGLLM_ISA)."""
    out = pathlib.Path(tmp)
    run(["debug", "forward", "-m", model, "--tokens", ",".join(map(str, tokens)), "--dump", out, *extra], env=env)
    d = {p.stem: np.load(p) for p in out.glob("*.npy")}
    return d
