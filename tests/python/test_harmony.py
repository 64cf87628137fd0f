"""gpt-oss's text side through the real engine, on a synthetic gpt-oss model (its o200k-shaped
vocabulary and gpt-oss's own chat template): the server renders the harmony prompt (with
`reasoning_effort`), answers in `content` (and `reasoning_content` when the model reasons) with
no harmony markup in either, streamed as whole, and the terminal chat answers what the API
answers. A random-weight model does not write harmony's channels, so the split itself is
tested over the HTTP layer with scripted replies (coordinator/src/serve/http/tests/harmony.rs)
and in the parser's tests; here the real path around it."""

import json
import re

import pytest

from support.cli import ringllm
from support.server import Server

MARKUP = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
ARGS = ["--threads", "1", "-c", "512"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gptoss") / "gpt-oss-synth.gguf"
    ringllm(["debug", "synth", "--arch", "gpt-oss", "--type", "q8_0", "--seed", "3", "-o", path])
    return path


@pytest.fixture(scope="module")
def server(model):
    s = Server(["run", "-m", model, *ARGS])
    yield s
    s.stop()


def chat(server, **extra):
    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hello there"}],
            "temperature": 0, "max_tokens": 24, **extra}
    status, _, raw = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, raw
    return json.loads(raw)


def test_chat_renders_harmony_and_answers_without_markup(server):
    low = chat(server, reasoning_effort="low")
    high = chat(server, reasoning_effort="high")
    for r in (low, high):
        m = r["choices"][0]["message"]
        assert isinstance(m["content"], str)
        for field in ("content", "reasoning_content"):
            assert not any(t in (m.get(field) or "") for t in MARKUP), m
        # gpt-oss's system message (identity, date, effort, channels) makes a long prompt.
        assert r["usage"]["prompt_tokens"] > 150
    status, _, raw = server.request("POST", "/v1/chat/completions",
                                    {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                     "reasoning_effort": "max"})
    assert status == 400 and b"reasoning_effort" in raw


def test_streamed_deltas_add_up_to_the_whole_answer(server):
    whole = chat(server)["choices"][0]["message"]
    stream = server.client().chat.completions.create(
        model="m", messages=[{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hello there"}],
        temperature=0, max_tokens=24, stream=True)
    content, reasoning = "", ""
    for chunk in stream:
        if chunk.choices:
            d = chunk.choices[0].delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
    assert content == whole["content"]
    assert reasoning == whole.get("reasoning_content", "")


def test_terminal_chat_answers_what_the_api_answers(server, model):
    api = chat(server)["choices"][0]["message"]["content"]
    r = ringllm(["run", "-m", model, *ARGS, "--chat", "--system", "Be brief.", "--temp", "0", "-n", "24"],
                input="Hello there\n")
    # The reply's line on stdout is the answer alone (reasoning goes to stderr off a terminal).
    assert r.stdout.strip() == api.strip()
    assert not any(t in r.stdout for t in MARKUP), r.stdout


def test_ollama_think_is_accepted_for_gpt_oss(server):
    status, _, raw = server.request("POST", "/api/chat", {
        "model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": False,
        "think": "high", "options": {"temperature": 0, "num_predict": 8}})
    assert status == 200, raw
    msg = json.loads(raw)["message"]
    assert not any(t in msg["content"] for t in MARKUP), msg


def test_terminal_chat_takes_the_reasoning_effort(model):
    # --reasoning-effort reaches the template's "Reasoning:" line: the three levels tokenize to
    # prompts of different lengths on this vocabulary, and no flag is medium.
    def prompt_tokens(*flag):
        r = ringllm(["run", "-m", model, *ARGS, "--chat", *flag, "--temp", "0", "-n", "2", "-v"], input="Hi\n")
        m = re.search(r"chat prompt: (\d+) tokens", r.stderr)
        assert m, r.stderr
        return int(m.group(1))

    counts = {e: prompt_tokens("--reasoning-effort", e) for e in ("low", "medium", "high")}
    assert len(set(counts.values())) == 3, counts
    assert prompt_tokens() == counts["medium"]
    bad = ringllm(["run", "-m", model, *ARGS, "--chat", "--reasoning-effort", "max"], input="Hi\n", check=False)
    assert bad.returncode != 0 and "reasoning-effort" in bad.stderr
