"""pytest's entry point for tests/python: the shared fixtures. The helpers the tests import
(paths, running the binary, nodes, the server, cgroup caps, comparisons, namespaces) are in
support/; markers and options are in pytest.ini at the repository's root."""

import os

# NumPy's OpenBLAS on one thread, set before anything imports NumPy. The reference's products
# are small (a few to a few hundred rows), and on a 2-core machine that is busy with something
# else (CI builds the aarch64 cross binary and runs the QEMU guests beside pytest) OpenBLAS's
# second thread spins waiting for a core: test_reference_selftest.py took 41-70 s with two
# threads and 25 s with one, its Gemma greedy test 10-18 s and 3 s (2026-12-06, Zen 4, one
# core busy). The results are the same bits (checked: SmolLM2's logits and hidden states over
# 65 tokens, with and without 8-bit activations, at one and two threads).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402

from support.cli import run  # noqa: E402
from support.paths import FIXTURES, SMOL, model_path, ringllm_bin  # noqa: E402


@pytest.fixture(scope="session")
def ringllm():
    """The ringllm binary under test (RINGLLM_BIN, else target/ci/ringllm)."""
    return ringllm_bin()


@pytest.fixture(scope="session")
def smol_calibration(tmp_path_factory):
    """`ringllm calibrate` of SmolLM2 on tests/fixtures/texts/calibration.txt (context 128, 4
    chunks), run once for the session: (the predictor's path, the finished process). test_skip
    checks the run's output and reads the predictor, test_streaming sends it to nodes; each
    calibrated its own (13 s on 2 cores; the same bytes at 1 and 2 threads). Read-only: a test
    that damages a predictor damages a copy."""
    out = tmp_path_factory.mktemp("skip") / "smol.skip"
    r = run(["calibrate", "-m", model_path(SMOL.name), "-f", FIXTURES / "texts" / "calibration.txt", "-o", out,
             "--ctx", "128", "--chunks", "4", "-t", "2"])
    return out, r
