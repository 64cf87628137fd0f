"""Every transport end to end on loopback with real node processes: a ring over tcp, udp, quic
and uring gives output bit-identical to the single process; a transport mismatch between the
cluster and a node is a clear error; compressed activations change the logits only a little."""

import struct

import pytest

from support.cli import generation, ringllm
from support.nodes import Nodes
from support.paths import GEMMA, KEY, SMOL, model_path

GEN = ["--temp", "0", "-n", "12", "--threads", "1", "-c", "256"]
PROMPT = "The three primary colors are"


_single = {}


def single(model, tmp_path, prompt=PROMPT):
    """The single process's (json, logits, stderr) for `prompt`: run once per model and prompt
    and shared by the transports' tests (it does not depend on the transport)."""
    key = (str(model), prompt)
    if key not in _single:
        _single[key] = generation(["run", "-m", model, "-p", prompt, *GEN], tmp_path / "single.f32")
    return _single[key]


@pytest.mark.parametrize("transport", ["tcp", "udp", "quic", "uring"])
@pytest.mark.parametrize("name,path", [("smollm", SMOL), ("gemma", GEMMA)])
def test_ring_over_each_transport_is_bit_identical(transport, name, path, tmp_path):
    model = model_path(path.name)
    want, want_logits, _ = single(model, tmp_path)
    with Nodes(2, transport=transport, log_dir=tmp_path) as nodes:
        got, logits, err = generation(
            ["up", "-m", model, "--key", KEY, *nodes.node_flags(), "--transport", transport,
             "-p", PROMPT, *GEN], tmp_path / "ring.f32")
        logs = [nodes.log(i) for i in range(2)]
    assert got["token_ids"] == want["token_ids"], transport
    assert got["text"] == want["text"]
    assert logits == want_logits, f"{transport}: logits differ"
    # The node really served its input over this transport (node2's input comes from node1,
    # node1's from the coordinator).
    for log in logs:
        assert f"over {transport}" in log, log[-2000:]


def test_a_transport_the_node_was_not_started_with_is_a_clear_error(tmp_path):
    model = model_path(SMOL.name)
    with Nodes(2, transport="tcp") as nodes:
        r = ringllm(["up", "-m", model, "--key", KEY, *nodes.node_flags(), "--transport", "quic",
                     "-p", PROMPT, *GEN], check=False)
    assert r.returncode != 0
    # Both nodes are named, in the cluster's order, whichever answered first.
    lines = [l for l in r.stderr.splitlines() if "--transport tcp" in l]
    assert len(lines) == 2, r.stderr
    assert "node1" in lines[0] and "node2" in lines[1] and all("quic" in l for l in lines), r.stderr


def floats(b):
    return struct.unpack(f"<{len(b) // 4}f", b)


@pytest.mark.parametrize("act", ["f16", "bf16", "q8"])
def test_compressed_activations_stay_close_to_f32(act, tmp_path):
    """The first step's logits (the prompt's last position) with hidden states compressed on
    every hop: not identical to f32, but close, and the same argmax."""
    model = model_path(SMOL.name)
    args = ["-p", PROMPT, "--temp", "0", "-n", "1", "--threads", "1", "-c", "256"]
    want, want_logits, _ = generation(["run", "-m", model, *args], tmp_path / "single.f32")
    with Nodes(2) as nodes:
        got, logits, _ = generation(
            ["up", "-m", model, "--key", KEY, *nodes.node_flags(), "--activations", act, *args],
            tmp_path / "ring.f32")
    a, b = floats(logits), floats(want_logits)
    assert len(a) == len(b)
    diff = max(abs(x - y) for x, y in zip(a, b))
    spread = max(b) - min(b)
    assert diff > 0, f"{act}: bit-identical to f32, so the compression was not applied"
    assert diff < 0.05 * spread, f"{act}: max logit error {diff} vs spread {spread}"
    assert got["token_ids"] == want["token_ids"]
