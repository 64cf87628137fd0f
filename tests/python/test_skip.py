"""Predictive layer skip from the command line: `calibrate` writes a predictor that `run`,
`perplexity` and `bench` load with --skip; a predictor for another model, or a damaged one,
is refused with a message naming the file. Calibration text (tests/fixtures/texts/
calibration.txt, the README of 2026-11-27: a fixed text, so the predictor does not change with
the docs) and scored text (tests/fixtures/texts/perplexity.txt) differ."""

import re
import shutil
import subprocess

import pytest

from support.cli import run
from support.paths import GEMMA, ROOT, SMOL, model_path, ringllm_bin

SCORE_TEXT = ROOT / "tests" / "fixtures" / "texts" / "perplexity.txt"


@pytest.fixture(scope="module")
def smol_predictor(smol_calibration):
    """SmolLM2's predictor (the session's, made by conftest.py), its calibration run checked here."""
    out, r = smol_calibration
    assert out.exists() and out.stat().st_size > 0
    assert f"wrote {out}" in r.stdout
    # The summary: one line per layer and the held-out result.
    assert "held-out chunk: PPL" in r.stderr, r.stderr
    assert len(re.findall(r"^\s+\d+\s+[-0-9.]+\s+[0-9.]+%\s+[0-9.]+%$", r.stderr, re.M)) == 30
    return out


def _fails(args, *needles):
    r = subprocess.run([str(ringllm_bin()), *map(str, args)], capture_output=True, text=True)
    assert r.returncode != 0, f"expected failure: {args}"
    for n in needles:
        assert n in r.stderr, f"stderr lacks {n!r}: {r.stderr!r}"
    assert "panicked" not in r.stderr
    return r


def _ppl(stdout):
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", stdout)
    assert m, stdout
    return float(m.group(1))


def test_run_and_perplexity_use_the_predictor(smol_predictor):
    smol = model_path(SMOL.name)
    r = run(["run", "-m", smol, "-p", "The capital of France is", "-n", "8", "--temp", "0",
             "--skip", f"auto:{smol_predictor}"])
    assert r.stdout.strip()
    assert "skipped:" in r.stderr and "of layer evaluations" in r.stderr
    common = ["perplexity", "-m", smol, "-f", SCORE_TEXT, "--ctx", "128", "--chunks", "2", "-t", "2"]
    plain = run(common)
    assert "skipped:" not in plain.stdout
    skipped = run([*common, "--skip", f"auto:{smol_predictor}"])
    lines = skipped.stdout.splitlines()
    at = [i for i, l in enumerate(lines) if l.startswith("skipped:")]
    final = [i for i, l in enumerate(lines) if l.startswith("Final estimate")]
    assert len(at) == 1 and len(final) == 1 and at[0] < final[0], skipped.stdout
    frac = float(re.match(r"skipped: ([0-9.]+)% of layer evaluations", lines[at[0]]).group(1))
    evals = int(re.search(r"\((\d+) of (\d+);", lines[at[0]]).group(2))
    assert evals == 2 * 128 * 30  # every token of both chunks through every layer
    # Nothing skipped must mean the very same figure; anything skipped moves it.
    if frac == 0.0:
        assert _ppl(skipped.stdout) == _ppl(plain.stdout)
    else:
        assert _ppl(skipped.stdout) != _ppl(plain.stdout)


def test_a_predictor_for_another_model_is_refused(smol_predictor):
    _fails(["run", "-m", model_path(GEMMA.name), "-p", "Hi", "-n", "1", "--skip", f"auto:{smol_predictor}"],
           str(smol_predictor), "made for another model")


def test_a_damaged_predictor_is_refused(smol_predictor, tmp_path):
    bad = tmp_path / "bad.skip"
    b = bytearray(smol_predictor.read_bytes())
    b[len(b) // 2] ^= 0x40
    bad.write_bytes(bytes(b))
    _fails(["perplexity", "-m", model_path(SMOL.name), "-f", SCORE_TEXT, "--ctx", "128", "--chunks", "2",
            "--skip", f"auto:{bad}"], str(bad), "checksum mismatch")
    short = tmp_path / "short.skip"
    short.write_bytes(smol_predictor.read_bytes()[:100])
    _fails(["run", "-m", model_path(SMOL.name), "-p", "Hi", "-n", "1", "--skip", f"auto:{short}"],
           str(short), "truncated")


def test_skip_auto_looks_beside_the_model(smol_predictor, tmp_path):
    m = tmp_path / SMOL.name
    m.symlink_to(model_path(SMOL.name))
    _fails(["run", "-m", m, "-p", "Hi", "-n", "1", "--skip", "auto"], f"{m}.skip", "ringllm calibrate")
    shutil.copy(smol_predictor, f"{m}.skip")
    r = run(["bench", "-m", m, "-p", "8", "-n", "4", "-t", "1", "-r", "1", "--skip", "auto"])
    assert "tg4" in r.stdout and "skipped:" in r.stderr
    _fails(["run", "-m", m, "-p", "Hi", "--skip", "maybe"], "expected `auto`")
