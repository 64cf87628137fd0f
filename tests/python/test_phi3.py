"""Phi-3 end to end on the small synthetic model of its real structure (`debug synth --arch phi3`:
fused Q/K/V and gate/up matrices, LongRoPE factors, a window on every layer, Phi-3's chat tokens
and its published chat template): the `--chat` REPL and the OpenAI server send the model exactly
the Phi-3 prompt text (each reply equals the raw completion of that text), and the ring over it
is bit-identical to the single process, past the window and with the long RoPE factors."""

import json
import subprocess

import pytest

from support.cli import generation, run
from support.nodes import Nodes
from support.paths import KEY, ringllm_bin
from support.server import Server

N = "8"
CTX = ["-c", "256"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("phi3")
    f = d / "phi3-tiny.gguf"
    run(["debug", "synth", "--arch", "phi3", "--type", "q8_0", "--seed", "7", "-o", f])
    return f


def phi3_prompt(system, turns, question):
    """What Phi-3's template renders for a conversation (see the Rust test of the template)."""
    s = f"<|system|>\n{system}<|end|>\n" if system else ""
    for q, a in turns:
        s += f"<|user|>\n{q}<|end|>\n<|assistant|>\n{a}<|end|>\n"
    return s + f"<|user|>\n{question}<|end|>\n<|assistant|>\n"


def complete(model, prompt, n=N):
    r = run(["run", "-m", model, "-p", prompt, "--temp", "0", "-n", n, "--threads", "1", *CTX, "--json"])
    return json.loads(r.stdout)


def test_chat_repl_sends_the_phi3_prompt(model):
    q1, q2 = "what is the time", "and the day"
    r = subprocess.run([str(ringllm_bin()), "run", "-m", str(model), "--chat", "--temp", "0", "-n", N,
                        "--threads", "1", *CTX, "--system", "be brief"],
                       input=f"{q1}\n{q2}\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "has no chat template" not in r.stderr  # the file's own template
    first = complete(model, phi3_prompt("be brief", [], q1))
    # The raw prompt's markup came out as Phi-3's control tokens, not as characters, without
    # the newlines after them (Phi-3's special tokens strip the whitespace that follows, as in
    # llama.cpp) and without BOS (Phi-3's files do not add it).
    ids = first["prompt_token_ids"]
    assert ids[0] == 509 and ids.count(510) == 2 and ids[-1] == 508, ids  # <|system|> <|end|> <|assistant|>
    assert 13 not in ids, ids  # <0x0A>
    second = complete(model, phi3_prompt("be brief", [(q1, first["text"].strip())], q2))
    assert r.stdout == first["text"] + "\n" + second["text"] + "\n", (r.stdout, first, second)


def test_server_chat_sends_the_phi3_prompt(model):
    s = Server(["run", "-m", model, "--threads", "1", *CTX])
    try:
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a color"}]
        ids = s.client().models.list().data
        r = s.client().chat.completions.create(model=ids[0].id, messages=msgs, temperature=0, max_tokens=int(N))
        want = complete(model, phi3_prompt("be brief", [], "name a color"))
        assert r.choices[0].message.content.strip() == want["text"].strip()
        assert r.usage.prompt_tokens == len(want["prompt_token_ids"])
        assert r.usage.completion_tokens == len(want["token_ids"])
    finally:
        s.stop()


def test_ring_over_phi3_is_bit_identical_to_the_single_process(model, tmp_path):
    # More than the window (32) of prompt and reply, in a context past the original one (16):
    # the window layers' KV ring and the long LongRoPE factors run on every node.
    prompt = "the people of the world had made a long day of water and time, " * 2
    gen = ["--temp", "0", "-n", "12", "--threads", "1", *CTX]
    want, want_logits, _ = generation(["run", "-m", model, "-p", prompt, *gen], tmp_path / "s.f32")
    assert len(want["prompt_token_ids"]) + len(want["token_ids"]) > 32, want
    for n in (1, 2):  # the small model has 2 layers
        with Nodes(n, models=model.parent) as nodes:
            got, logits, _ = generation(["up", "-m", model, "--key", KEY, *nodes.node_flags(), "-p", prompt, *gen],
                                        tmp_path / f"r{n}.f32")
        assert got["token_ids"] == want["token_ids"], f"{n} nodes"
        assert logits == want_logits, f"{n} nodes: logits differ"
