"""Ollama's API (`/api/*`) of `ringllm run --serve`, spoken through the official `ollama`
Python client: list, show, ps, chat (streamed and whole) and generate (templated and raw).
The oracle is the OpenAI endpoint of the same server, asked the same thing greedily (and, for
Ollama's default repeat_penalty, with the same penalty): the texts must be equal. Also: errors
in Ollama's shape, the API key, and lenient model names on both APIs (one warning per name)."""

import json
import os

import ollama
import pytest

from support.paths import SMOL, model_path
from support.server import SMOL_ID, Server

KEY = "ollama-test-key"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def srv():
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "1024", "--parallel", "4"])
    yield s
    s.stop()


def client(s, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return ollama.Client(host=f"http://127.0.0.1:{s.port}", headers=headers, timeout=120)


GREEDY = {"temperature": 0, "num_predict": 16, "repeat_penalty": 1.0}


def openai_chat(s, messages, **kw):
    r = s.client().chat.completions.create(model=SMOL_ID, messages=messages, temperature=0, max_tokens=16, **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def test_list_show_ps_and_version_describe_the_model(srv):
    c = client(srv)
    models = c.list().models
    assert [m.model for m in models] == [f"{SMOL_ID}:latest"]
    m = models[0]
    assert m.size == os.path.getsize(model_path(SMOL.name))
    assert m.details.format == "gguf" and m.details.family == "llama"
    assert m.details.quantization_level == "Q4_1"
    assert m.details.parameter_size == "134.52M"
    assert m.modified_at is not None and m.digest
    info = c.show(SMOL_ID)
    assert info.details.family == "llama"
    assert info.modelinfo["general.architecture"] == "llama"
    assert info.modelinfo["general.parameter_count"] == 134_515_008
    assert info.modelinfo["llama.context_length"] == 8192
    assert "<|im_start|>" in info.template
    assert info.capabilities == ["completion", "tools"]
    ps = c.ps().models
    assert [p.model for p in ps] == [f"{SMOL_ID}:latest"] and ps[0].context_length == 1024
    status, headers, body = srv.get("/api/version")
    assert status == 200 and headers["content-type"] == "application/json"
    assert json.loads(body)["version"]


def test_chat_whole_equals_the_openai_endpoint(srv):
    msgs = [{"role": "user", "content": QUESTION}]
    text, finish, usage = openai_chat(srv, msgs)
    r = client(srv).chat(model=SMOL_ID, messages=msgs, options=GREEDY, stream=False)
    assert r.message.role == "assistant"
    assert r.message.content == text
    assert r.done and r.done_reason == finish
    assert r.eval_count == usage.completion_tokens
    assert r.prompt_eval_count == usage.prompt_tokens
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0
    assert r.model == SMOL_ID


def test_chat_streamed_equals_the_openai_endpoint_with_a_system_prompt(srv):
    msgs = [{"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "Name a large animal."}]
    text, finish, usage = openai_chat(srv, msgs)
    parts = list(client(srv).chat(model=SMOL_ID, messages=msgs, options=GREEDY, stream=True))
    assert len(parts) > 2, "streamed in pieces"
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == text
    assert parts[-1].message.content == ""
    assert parts[-1].done_reason == finish
    assert parts[-1].eval_count == usage.completion_tokens


def test_ollamas_default_repeat_penalty_is_applied(srv):
    # Only the temperature given: Ollama's repeat_penalty of 1.1 applies (top_k/top_p do not
    # matter greedily); the OpenAI endpoint with the same penalty is the oracle.
    msgs = [{"role": "user", "content": "List the days of the week."}]
    text, _, _ = openai_chat(srv, msgs, extra_body={"repeat_penalty": 1.1})
    r = client(srv).chat(model=SMOL_ID, messages=msgs, options={"temperature": 0, "num_predict": 16}, stream=False)
    assert r.message.content == text
    # Without `stream` (the client above always sends it): NDJSON lines, Ollama's default.
    status, headers, body = srv.request("POST", "/api/chat", {
        "model": SMOL_ID, "messages": msgs, "options": {"temperature": 0, "num_predict": 16}})
    assert status == 200 and headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in body.decode().splitlines()]
    assert len(lines) > 2 and lines[-1]["done"] and not any(x["done"] for x in lines[:-1])
    assert "".join(x["message"]["content"] for x in lines) == text
    plain, _, _ = openai_chat(srv, msgs)
    assert plain != text, "the penalty changes this answer, so the check above means something"


def test_generate_streamed_templated_and_raw(srv):
    c = client(srv)
    # Templated: one user turn (with `system`) in the chat template, as /api/chat.
    text, finish, usage = openai_chat(srv, [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": QUESTION}])
    parts = list(c.generate(model=SMOL_ID, prompt=QUESTION, system="Be brief.", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == text
    assert parts[-1].done and parts[-1].done_reason == finish
    assert parts[-1].eval_count == usage.completion_tokens
    assert parts[-1].prompt_eval_count == usage.prompt_tokens
    # Raw: the client's own format, special tokens included, as /v1/completions with
    # parse_special.
    raw = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    oc = srv.client().completions.create(model=SMOL_ID, prompt=raw, temperature=0, max_tokens=16,
                                         extra_body={"parse_special": True})
    r = c.generate(model=SMOL_ID, prompt=raw, raw=True, options=GREEDY, stream=False)
    assert r.response == oc.choices[0].text
    assert r.prompt_eval_count == oc.usage.prompt_tokens
    # A stop string ends the answer before it.
    cut = text.split()[1]
    r = c.generate(model=SMOL_ID, prompt=QUESTION, system="Be brief.", stream=False,
                   options={**GREEDY, "stop": [cut]})
    assert r.response == text[:text.index(cut)] and r.done_reason == "stop"


def test_errors_have_ollamas_shape(srv):
    c = client(srv)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model=SMOL_ID, messages=[{"role": "user", "content": "x"}], options={"temperature": 9})
    assert e.value.status_code == 400 and "options.temperature" in e.value.error
    status, _, body = srv.request("POST", "/api/chat", {"model": SMOL_ID, "messages": [{"role": "user", "content": "x"}],
                                                        "tools": [{"type": "function"}]})
    assert status == 400 and "tools[0]" in json.loads(body)["error"]
    status, headers, body = srv.request("POST", "/api/generate", b"{oops")
    assert status == 400 and list(json.loads(body)) == ["error"]
    status, _, body = srv.request("DELETE", "/api/delete", {"model": SMOL_ID})
    assert status == 404 and "/api/delete" in json.loads(body)["error"]
    # A context that cannot hold the prompt.
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model=SMOL_ID, prompt="word " * 1200, raw=True, stream=False)
    assert e.value.status_code == 400 and "1024" in e.value.error


def test_key_and_lenient_names_on_both_apis():
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "512", "--api-key", KEY])
    try:
        with pytest.raises(ollama.ResponseError) as e:
            client(s).list()
        assert e.value.status_code == 401 and "API key" in e.value.error
        with pytest.raises(ollama.ResponseError) as e:
            client(s, "wrong").chat(model=SMOL_ID, messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 401
        c = client(s, KEY)
        msgs = [{"role": "user", "content": QUESTION}]
        # Names of other models get the one served, on both APIs, the same answer.
        a = c.chat(model="llama3.2:latest", messages=msgs, options=GREEDY, stream=False)
        b = c.chat(model="llama3.2:latest", messages=msgs, options=GREEDY, stream=False)
        o = s.client(KEY).chat.completions.create(model="gpt-4o", messages=msgs, temperature=0, max_tokens=16)
        assert a.model == SMOL_ID
        assert a.message.content == b.message.content == o.choices[0].message.content
        assert o.model == SMOL_ID
    finally:
        s.stop()
    log = s.proc.stderr.read()
    warned = [line for line in log.splitlines() if "answering with" in line]
    assert len(warned) == 2, log  # one per distinct name, not one per request
    assert any('"llama3.2:latest"' in w for w in warned) and any('"gpt-4o"' in w for w in warned)
