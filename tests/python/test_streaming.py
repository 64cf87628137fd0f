"""Models larger than the memory they run in (issue 15), with real processes under cgroup memory
caps: a single process whose layers do not fit streams the rest from disk and answers exactly as
the uncapped run, at every read-ahead depth; two capped nodes, which together cannot hold the
model, run it in the layout the planner picks (stream in place or several rounds) and in the
naive one, every time equal to the single process; `up --skip` sends the predictor to the nodes
and refuses one made for another model. Needs root (cgroups)."""

import json

import pytest

from support.cgroup import MIB, MemoryCap
from support.cli import ringllm
from support.nodes import Nodes
from support.paths import GEMMA, KEY, SMOL, model_path

GEN = ["-n", "12", "--temp", "0", "--json", "-c", "256"]
PROMPT = "The three primary colours are"


def tokens(r):
    return json.loads(r.stdout)["token_ids"]


def run_capped(cap, model, *extra):
    with MemoryCap("run", cap) as g:
        r = ringllm(["run", "-m", model, "-p", PROMPT, *GEN, "-t", "1", *extra], preexec_fn=g.preexec())
        assert g.oom_kills() == 0
        return r


@pytest.mark.root
@pytest.mark.parametrize("name", [SMOL.name, pytest.param(GEMMA.name, marks=pytest.mark.slow)])
def test_a_capped_process_streams_what_does_not_fit_and_answers_as_uncapped(name):
    model = model_path(name)
    want = tokens(ringllm(["run", "-m", model, "-p", PROMPT, *GEN, "-t", "1"]))
    # The cap leaves room for the output head, the runner and a few layers, not all of them.
    cap = {SMOL.name: 150 * MIB, GEMMA.name: 450 * MIB}[name]
    for depth in ["1", "2", "4"]:
        r = run_capped(cap, model, "--prefetch", depth)
        assert "streaming" in r.stderr and f"{depth} read ahead" in r.stderr, r.stderr
        assert "MiB read per forward pass" in r.stderr, r.stderr
        assert tokens(r) == want, f"depth {depth}: {r.stderr}"


def test_stream_all_reads_every_layer_each_token_and_off_streams_nothing():
    model = model_path(SMOL.name)
    want = tokens(ringllm(["run", "-m", model, "-p", PROMPT, *GEN, "-t", "1"]))
    r = ringllm(["run", "-m", model, "-p", PROMPT, *GEN, "-t", "1", "--stream", "all"])
    assert "streaming 30 of 30 layers" in r.stderr, r.stderr
    assert tokens(r) == want
    r = ringllm(["run", "-m", model, "-p", PROMPT, *GEN, "-t", "1", "--stream", "off",
                 "--memory", "150MiB"])
    assert "streaming" not in r.stderr and tokens(r) == want


def test_a_budget_too_small_even_to_stream_is_named():
    # Room for the runner (26 MiB at context 256) but not for the head and two layer buffers.
    r = ringllm(["run", "-m", model_path(SMOL.name), "-p", PROMPT, *GEN, "--memory", "100MiB"],
                check=False)
    assert r.returncode != 0
    assert "not even two layer buffers" in r.stderr and "budget" in r.stderr, r.stderr


@pytest.mark.root
@pytest.mark.slow
def test_two_capped_nodes_run_a_model_neither_holds_in_every_layout(tmp_path):
    model = model_path(SMOL.name)
    want = tokens(ringllm(["run", "-m", model, "-p", PROMPT, *GEN, "-t", "1"]))
    # 90 MiB each: with the 48 MiB headroom and 15 MiB of scratch, the two nodes hold about
    # half of the 63 MiB of layers; the coordinator keeps the embedding and the head.
    caps = [MemoryCap(f"node{i}", 90 * MIB) for i in (1, 2)]
    with caps[0], caps[1]:
        with Nodes(2, log_dir=tmp_path, preexec=lambda i: caps[i].preexec()) as nodes:
            flags = ["-m", model, "--key", KEY, *nodes.node_flags()]
            plan = json.loads(ringllm(["plan", *flags, "-c", "256", "--json"]).stdout)
            sp = plan["streaming"]
            assert sp is not None, plan
            names = [a["name"] for a in sp["alternatives"]]
            assert "stream in place" in names and any("naive" in n for n in names), names
            chosen = sp["alternatives"][sp["chosen"]]
            naive = next(a for a in sp["alternatives"] if a["naive"])
            assert chosen["predicted_tokens_per_s"] > naive["predicted_tokens_per_s"]
            for rounds in ["auto", "naive", "1", "3"]:
                r = ringllm(["up", *flags, "-p", PROMPT, *GEN, "--rounds", rounds])
                assert "<- chosen" in r.stderr, r.stderr
                assert tokens(r) == want, f"--rounds {rounds}: {r.stderr}"
            # Off: a model that does not fit is refused, as before streaming existed.
            r = ringllm(["up", *flags, "-p", PROMPT, *GEN, "--rounds", "off"], check=False)
            assert r.returncode != 0 and "does not fit" in r.stderr, r.stderr
        for c in caps:
            assert c.oom_kills() == 0


@pytest.mark.slow
def test_up_sends_the_skip_predictor_and_refuses_another_models(tmp_path, smol_calibration):
    smol, gemma = model_path(SMOL.name), model_path(GEMMA.name)
    pred = smol_calibration[0]  # calibrated on tests/fixtures/texts/calibration.txt (conftest.py)
    with Nodes(2, log_dir=tmp_path) as nodes:
        flags = ["--key", KEY, *nodes.node_flags()]
        r = ringllm(["up", "-m", smol, *flags, "-p", PROMPT, *GEN, "--skip", f"auto:{pred}"])
        assert len(tokens(r)) == 12
        for i in range(2):
            assert "layer skip on" in nodes.log(i), nodes.log(i)
        r = ringllm(["up", "-m", gemma, *flags, "-p", PROMPT, *GEN, "--skip", f"auto:{pred}"],
                    check=False)
        assert r.returncode != 0 and str(pred) in r.stderr and "another model" in r.stderr, r.stderr


def test_a_streamed_mixture_of_experts_equals_the_resident_one(tmp_path):
    """Qwen3-MoE layers read from disk each pass (their stacked experts sliced per expert from
    the streamed buffer) give the resident run's logits bit for bit, at two read-ahead depths,
    repacked Q4_K experts included."""
    import numpy as np
    from support.cli import forward_dump
    model = tmp_path / "moe.gguf"
    ringllm(["debug", "synth", "--arch", "qwen3moe", "--type", "q4_k", "--seed", "9", "-o", model])
    toks = [1, 40, 77, 300, 512, 9, 1000, 23]
    want = forward_dump(model, toks, tmp_path / "resident", "--threads", "2")["logits"]
    for depth in ["1", "2"]:
        got = forward_dump(model, toks, tmp_path / f"streamed{depth}", "--threads", "2", "--stream", "all",
                           "--prefetch", depth)["logits"]
        assert np.array_equal(got, want), f"prefetch {depth}: streamed logits differ"


def moe_cut(tmp_path):
    """Qwen3-30B-A3B's real layer shape cut to 2 layers and a small vocabulary: 0.78 GB, of which
    0.75 GB are the 2 x 128 experts."""
    model = tmp_path / "moe-cut.gguf"
    ringllm(["debug", "synth", "--shape", "qwen3-30b-a3b", "--layers", "2", "--vocab", "8192",
             "-o", model])
    return model


@pytest.mark.root
def test_a_capped_process_streams_a_mixtures_experts_and_answers_as_uncapped(tmp_path):
    model = moe_cut(tmp_path)
    want = tokens(ringllm(["run", "-m", model, "-p", PROMPT, *GEN, "-t", "1"]))
    # 400 MiB holds everything but the experts and about a third of them.
    for extra in [[], ["--no-expert-predict"]]:
        r = run_capped(400 * MIB, model, *extra)
        assert "streaming the experts from disk" in r.stderr, r.stderr
        assert "of 256 experts cached" in r.stderr, r.stderr
        assert "streamed experts:" in r.stderr and "hit rate" in r.stderr, r.stderr
        assert tokens(r) == want, f"{extra}: {r.stderr}"
    # Too little even for the layers without their experts and a few expert buffers: named.
    r = ringllm(["run", "-m", model, "-p", PROMPT, *GEN, "--memory", "130MiB"], check=False)
    assert r.returncode != 0 and "expert buffers" in r.stderr, r.stderr


@pytest.mark.root
@pytest.mark.slow
def test_two_capped_nodes_stream_their_experts_and_answer_as_the_single_process(tmp_path):
    model = moe_cut(tmp_path)
    want = tokens(ringllm(["run", "-m", model, "-p", PROMPT, *GEN, "-t", "1"]))
    # Each node gets one 380 MB layer and holds about half of its experts.
    caps = [MemoryCap(f"node{i}", 260 * MIB) for i in (1, 2)]
    with caps[0], caps[1]:
        with Nodes(2, log_dir=tmp_path, preexec=lambda i: caps[i].preexec()) as nodes:
            flags = ["-m", model, "--key", KEY, *nodes.node_flags()]
            r = ringllm(["up", *flags, "-p", PROMPT, *GEN])
            assert tokens(r) == want, r.stderr
            for i in range(2):
                assert "experts stream from disk" in nodes.log(i), nodes.log(i)
        for c in caps:
            assert c.oom_kills() == 0
