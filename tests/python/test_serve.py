"""The OpenAI-compatible server (`ringllm run --serve`, `ringllm up --serve`) with the real
`openai` client and raw HTTP: answers equal to the CLI's, streaming, logprobs against the
engine's logits, stop strings, many requests at once, errors, auth, disconnects, drain, and
the ring behind the API."""

import http.client
import json
import math
import re
import resource
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import openai
import pytest

from support.cli import ringllm
from support.nodes import Nodes, free_port
from support.paths import GEMMA, KEY, SMOL, model_path, ringllm_bin
from support.server import SMOL_ID, Server

@pytest.fixture(scope="module")
def smol():
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "1024", "--parallel", "8"])
    yield s
    s.stop()


def cli_chat(question, n):
    r = subprocess.run([str(ringllm_bin()), "run", "-m", model_path(SMOL.name), "--chat", "--temp", "0", "-n", str(n),
                        "--threads", "1", "-c", "1024"], input=question + "\n", capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_chat_equals_the_cli_and_reports_usage(smol):
    q = "What is the capital of France?"
    r = smol.client().chat.completions.create(model=SMOL_ID, messages=[{"role": "user", "content": q}],
                                              temperature=0, max_tokens=16)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.strip() == cli_chat(q, 16)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    models = smol.client().models.list()
    assert [m.id for m in models.data] == [SMOL_ID]


def test_streaming_equals_non_streaming_and_usage_chunk(smol):
    msgs = [{"role": "user", "content": "Name three fruits."}]
    full = smol.client().chat.completions.create(model=SMOL_ID, messages=msgs, temperature=0, max_tokens=20)
    stream = smol.client().chat.completions.create(model=SMOL_ID, messages=msgs, temperature=0, max_tokens=20,
                                                   stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    # Raw SSE framing ends with [DONE].
    status, headers, body = smol.request("POST", "/v1/chat/completions",
                                         {"model": SMOL_ID, "messages": msgs, "max_tokens": 3, "stream": True})
    assert status == 200 and "text/event-stream" in headers.get("content-type", "")
    events = [l for l in body.decode().split("\n\n") if l.strip()]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_completion_equals_run_and_logprobs_are_the_models(smol, tmp_path):
    prompt = "The three primary colors are"
    r = ringllm(["run", "-m", model_path(SMOL.name), "-p", prompt, "--temp", "0", "-n", "12", "--threads", "1",
                 "-c", "1024", "--json"])
    want = json.loads(r.stdout)
    c = smol.client().completions.create(model=SMOL_ID, prompt=prompt, temperature=0, max_tokens=12, logprobs=3)
    assert c.choices[0].text == want["text"]
    lp = c.choices[0].logprobs
    assert len(lp.token_logprobs) == 12
    # The first token's log-probability against the engine's own logits for that position.
    ringllm(["run", "-m", model_path(SMOL.name), "-p", prompt, "--temp", "0", "-n", "1", "--threads", "1",
             "-c", "1024", "--logits-out", tmp_path / "l.f32"])
    logits = np.fromfile(tmp_path / "l.f32", dtype="<f4").astype(np.float64)
    lse = logits.max() + math.log(np.exp(logits - logits.max()).sum())
    first = want["token_ids"][0]
    assert abs(lp.token_logprobs[0] - (logits[first] - lse)) < 1e-3
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs):
        assert len(top) == 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy: the best is chosen
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-5


def test_stop_string_across_chunks_is_not_returned(smol):
    prompt = "The three primary colors are"
    full = smol.client().completions.create(model=SMOL_ID, prompt=prompt, temperature=0, max_tokens=16)
    text = full.choices[0].text
    # A stop string spanning a token boundary in the middle of the output.
    mid = len(text) // 2
    stop = text[mid - 2:mid + 3]
    assert len(stop) == 5
    for stream in (False, True):
        r = smol.client().completions.create(model=SMOL_ID, prompt=prompt, temperature=0, max_tokens=16,
                                             stop=[stop], stream=stream)
        if stream:
            got, finish = "", None
            for ch in r:
                got += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
        else:
            got, finish = r.choices[0].text, r.choices[0].finish_reason
        assert got == text[:text.index(stop)]
        assert finish == "stop"


def test_concurrent_requests_each_equal_their_solo_answer(smol):
    prompts = [f"Write a short sentence about the number {i}." for i in range(8)]
    solo = [smol.client().completions.create(model=SMOL_ID, prompt=p, temperature=0, max_tokens=12)
            .choices[0].text for p in prompts]
    got = [None] * len(prompts)

    def one(i):
        got[i] = smol.client().completions.create(model=SMOL_ID, prompt=prompts[i], temperature=0,
                                                  max_tokens=12).choices[0].text

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert got == solo


def test_bad_requests_get_openai_errors(smol):
    status, _, body = smol.request("POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and "message" in json.loads(body)["error"]
    # Another model's name is not an error: the one served answers (as llama-server does).
    status, _, body = smol.request("POST", "/v1/chat/completions",
                                   {"model": "no-such-model", "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and json.loads(body)["model"] == SMOL_ID
    long_prompt = "word " * 3000
    status, _, body = smol.request("POST", "/v1/completions", {"model": SMOL_ID, "prompt": long_prompt})
    assert status == 400
    err = json.loads(body)["error"]
    assert "1024" in err["message"]
    status, _, body = smol.request("GET", "/v1/nothing-here")
    assert status == 404


def test_gemma_completions_and_chat_without_template():
    s = Server(["run", "-m", model_path(GEMMA.name), "--threads", "1", "-c", "512", "--parallel", "2"])
    try:
        prompt = "Once upon a time"
        r = ringllm(["run", "-m", model_path(GEMMA.name), "-p", prompt, "--temp", "0", "-n", "8", "--threads", "1",
                     "-c", "512", "--json"])
        c = s.client().completions.create(model="gemma-3-270m-q4_k_m", prompt=prompt, temperature=0, max_tokens=8)
        assert c.choices[0].text == json.loads(r.stdout)["text"]
        status, _, body = s.request("POST", "/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "template" in json.loads(body)["error"]["message"]
    finally:
        s.stop()


def test_queue_full_gives_429_with_retry_after():
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "512", "--parallel", "1",
                "--queue", "1"])
    try:
        results = []

        def one():
            results.append(s.request("POST", "/v1/completions",
                                     {"model": SMOL_ID, "prompt": "Count to one hundred:", "max_tokens": 60,
                                      "temperature": 0}))

        ts = [threading.Thread(target=one) for _ in range(5)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
        codes = sorted(r[0] for r in results)
        assert 200 in codes and 429 in codes, codes
        for status, headers, body in results:
            if status == 429:
                assert int(headers.get("retry-after", headers.get("Retry-After"))) >= 1
                assert "error" in json.loads(body)
    finally:
        s.stop()


def test_api_key_is_required_when_set():
    env = dict(__import__("os").environ, RINGLLM_API_KEY="sekrit")
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "256", "--parallel", "1"], env=env)
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert s.client("sekrit").models.list().data[0].id == SMOL_ID
        assert s.get("/health")[0] == 200
    finally:
        s.stop()


def test_disconnects_and_load_free_every_slot_and_keep_rss_steady(smol):
    c = smol.client()
    c.completions.create(model=SMOL_ID, prompt="Warm up", max_tokens=8)
    rss0 = smol.rss_kib()
    # Clients that go away mid-stream.
    for _ in range(4):
        conn = socket.create_connection(("127.0.0.1", smol.port))
        body = json.dumps({"model": SMOL_ID, "prompt": "Tell a long story.", "max_tokens": 200, "stream": True})
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        conn.recv(512)
        conn.close()
    # 32 clients at once, 2 requests each.
    errors = []

    def client():
        try:
            for _ in range(2):
                r = smol.client().completions.create(model=SMOL_ID, prompt="Hello", max_tokens=8, temperature=0.7)
                assert r.usage.completion_tokens >= 1
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(repr(e))

    ts = [threading.Thread(target=client) for _ in range(32)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not errors, errors[:3]
    deadline = time.monotonic() + 10
    m = smol.metrics()
    while m["ringllm_slots_busy"] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        m = smol.metrics()
    assert m["ringllm_slots_busy"] == 0 and m["ringllm_queue_depth"] == 0
    assert m["ringllm_requests_total"] >= 64
    assert smol.rss_kib() <= rss0 * 1.10, (rss0, smol.rss_kib())


def test_sigterm_drains_open_streams_and_exits_cleanly():
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "512", "--parallel", "2"])
    stream = s.client().completions.create(model=SMOL_ID, prompt="1, 2, 3, 4, 5,", max_tokens=400, temperature=0,
                                           stream=True)
    it = iter(stream)
    first = next(it)
    assert first.choices[0].finish_reason is None  # still generating
    s.proc.send_signal(signal.SIGTERM)
    finish = None
    for ch in it:  # the stream ends properly (finish reason, [DONE]) instead of breaking
        finish = ch.choices[0].finish_reason or finish
    assert finish is not None
    assert s.proc.wait(timeout=30) == 0


def test_ring_serves_the_api_and_recovers_from_a_lost_node(tmp_path):
    model = model_path(SMOL.name)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    with Nodes(2) as nodes:
        # Without resuming (`--resume-retries 0`; resuming is tested in test_resume.py).
        s = Server(["up", "-m", model, "--key", KEY, *nodes.node_flags(), "--threads", "1", "-c", "1024",
                    "--parallel", "4", "--resume-retries", "0"])
        try:
            r = s.client().chat.completions.create(model=SMOL_ID, messages=q, temperature=0, max_tokens=16)
            assert r.choices[0].message.content.strip() == cli_chat(q[0]["content"], 16)
            # Several at once through the ring.
            out = [None] * 4

            def one(i):
                out[i] = s.client().completions.create(model=SMOL_ID, prompt=f"Number {i} is", temperature=0,
                                                       max_tokens=8).choices[0].text

            ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(timeout=120)
            solo = [s.client().completions.create(model=SMOL_ID, prompt=f"Number {i} is", temperature=0,
                                                  max_tokens=8).choices[0].text for i in range(4)]
            assert out == solo
            # A node dies under load: the streams in flight fail cleanly, later requests succeed.
            streams = [s.client().completions.create(model=SMOL_ID, prompt="1, 2, 3, 4, 5,", temperature=0,
                                                     max_tokens=400, stream=True) for _ in range(2)]
            its = [iter(st) for st in streams]
            for it in its:
                next(it)  # both are generating
            nodes.kill(1)
            failures = []
            for it in its:
                try:
                    for _ in it:
                        pass
                except openai.APIError as e:
                    failures.append(e)
            assert len(failures) == 2, "streams in flight on a dead node must end with an error"
            assert "node2" in str(failures[0]), failures[0]
            r = s.client().chat.completions.create(model=SMOL_ID, messages=q, temperature=0, max_tokens=16)
            assert r.choices[0].message.content.strip() == cli_chat(q[0]["content"], 16)
            assert s.metrics()["ringllm_slots_busy"] == 0
        finally:
            s.stop()


def test_curl_streams_a_chat(smol):
    body = json.dumps({"model": SMOL_ID, "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 8, "temperature": 0, "stream": True})
    r = subprocess.run(["curl", "-sN", "--max-time", "60", f"http://127.0.0.1:{smol.port}/v1/chat/completions",
                        "-H", "Content-Type: application/json", "-d", body], capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == 0, r.stderr
    events = [e for e in r.stdout.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    full = smol.client().chat.completions.create(model=SMOL_ID, temperature=0, max_tokens=8,
                                                 messages=[{"role": "user", "content": "Say hello."}])
    assert text == full.choices[0].message.content


def test_slow_connections_do_not_starve_keyed_clients():
    """300 connections that never finish their headers, under a 256-descriptor limit: keyed
    clients are still served (idle connections give way at the cap), and the cap is logged."""
    def fd_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "256", "--parallel", "2",
                "--api-key", "sekrit"], preexec_fn=fd_limit)
    slow = []
    try:
        for _ in range(300):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            slow.append(c)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="sekrit", max_retries=0,
                               timeout=15)
        t0 = time.monotonic()
        assert client.models.list().data[0].id == SMOL_ID
        r = client.completions.create(model=SMOL_ID, prompt="Hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1
        assert time.monotonic() - t0 < 10
        # The oldest stalled connections were closed to make room.
        slow[0].settimeout(10)
        assert slow[0].recv(100) == b""
    finally:
        for c in slow:
            c.close()
        s.stop()
    err = s.proc.stderr.read()
    assert "the open-file limit is 256" in err, err
    assert "closed the oldest idle one" in err, err


def test_a_stalled_request_head_is_closed_after_the_header_timeout():
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "256", "--parallel", "1",
                "--header-timeout", "1"])
    try:
        c = socket.create_connection(("127.0.0.1", s.port), timeout=15)
        c.sendall(b"GET /health HTTP/1.1\r\n")
        t0 = time.monotonic()
        assert c.recv(100) == b""  # closed by the server, well before our 15 s timeout
        assert time.monotonic() - t0 < 10
        c.close()
    finally:
        s.stop()


def test_cors_only_with_a_key_or_a_named_origin(smol):
    pre = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    status, headers, _ = smol.request("OPTIONS", "/v1/completions", headers=pre)
    assert "access-control-allow-origin" not in {k.lower() for k in headers}
    status, _, body = smol.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                                   headers={"Origin": "http://evil.example"})
    assert status == 403 and "--cors" in json.loads(body)["error"]["message"]
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "256", "--parallel", "1",
                "--cors", "http://localhost:3000"])
    try:
        status, headers, _ = s.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                                       headers={"Origin": "http://localhost:3000"})
        assert status == 200
        assert {k.lower(): v for k, v in headers.items()}["access-control-allow-origin"] == "http://localhost:3000"
    finally:
        s.stop()


def test_a_keyless_server_answers_only_its_own_host_names(smol):
    # DNS rebinding: a page of evil.example pointed its name at this server; the browser sends
    # that name as Host.
    for path in ("/metrics", "/v1/models", "/api/tags", "/health"):
        status, _, body = smol.get(path, headers={"Host": f"evil.example:{smol.port}"})
        assert status == 403 and b"--allow-host evil.example" in body, (path, body)
    assert smol.get("/v1/models", headers={"Host": f"localhost:{smol.port}"})[0] == 200
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "256", "--parallel", "1",
                "--allow-host", "gpu-box.local"])
    try:
        assert s.get("/metrics", headers={"Host": "gpu-box.local:8080"})[0] == 200
        assert s.get("/metrics", headers={"Host": "other.local"})[0] == 403
    finally:
        s.stop()
    # A name that is no host name fails before the model is opened.
    r = ringllm(["run", "-m", "/nonexistent/model.gguf", "--serve", "127.0.0.1:0", "--allow-host",
                 "http://gpu-box/"], check=False, timeout=60)
    assert r.returncode != 0 and "--allow-host" in r.stderr and "nonexistent" not in r.stderr, r.stderr


def test_serve_binds_before_loading_and_says_where_after_binding():
    # A taken port fails before the model is even opened (the model path does not exist).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = ringllm(["run", "-m", "/nonexistent/model.gguf", "--serve", f"127.0.0.1:{port}"], check=False,
                    timeout=60)
        assert r.returncode != 0
        assert f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
        assert "nonexistent" not in r.stderr, r.stderr
    # Port 0: the line names the port actually bound, which answers.
    p = subprocess.Popen([str(ringllm_bin()), "run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "256",
                          "--parallel", "1", "--serve", "0.0.0.0:0"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = p.stderr.readline()
            assert line, f"exited: {''.join(lines)}"
            lines.append(line)
            m = re.search(r"serving .* on http://[0-9.]+:(\d+)/v1", line)
            if m:
                break
        assert m and int(m.group(1)) != 0, lines
        c = http.client.HTTPConnection("127.0.0.1", int(m.group(1)), timeout=30)
        c.request("GET", "/health")
        assert c.getresponse().status == 200
        # Beyond loopback without a key: a warning, before the serving line.
        assert any("without --api-key" in line for line in lines), lines
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


def test_a_context_beyond_the_trained_one_is_a_warning_in_run_up_and_serve():
    smol = model_path(SMOL.name)  # trained on 8192 tokens
    r = ringllm(["run", "-m", smol, "-c", "8300", "-p", "Hi", "-n", "1", "--threads", "1"])
    assert "--ctx 8300 is more than the 8192 tokens" in r.stderr, r.stderr
    r = ringllm(["run", "-m", smol, "-c", "8192", "-p", "Hi", "-n", "1", "--threads", "1"])
    assert "trained" not in r.stderr, r.stderr
    with Nodes(1) as nodes:
        r = ringllm(["up", "-m", smol, "--key", KEY, *nodes.node_flags(), "-c", "8300", "-p", "Hi", "-n", "1",
                     "--threads", "1"])
        assert "--ctx 8300 is more than the 8192 tokens" in r.stderr, r.stderr
    s = Server(["run", "-m", smol, "--threads", "1", "-c", "8300", "--parallel", "1"])
    s.stop()
    assert "--ctx 8300 is more than the 8192 tokens" in s.proc.stderr.read()


def test_ring_health_names_lost_nodes_and_failures_are_503_not_500():
    model = model_path(SMOL.name)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    with Nodes(2) as nodes:
        s = Server(["up", "-m", model, "--key", KEY, *nodes.node_flags(), "--threads", "1", "-c", "512",
                    "--parallel", "2"])
        try:
            status, _, body = s.get("/health")
            health = json.loads(body)
            assert status == 200 and health["status"] == "ok", health
            assert len(health["nodes"]) == 2 and health["missing"] == [], health
            # A node dies while the server is idle: the next request is still answered (on the
            # ring rebuilt over the node left), and /health says which node is missing.
            nodes.kill(1)
            r = s.client().chat.completions.create(model=SMOL_ID, messages=q, temperature=0, max_tokens=8)
            assert r.choices[0].message.content
            status, _, body = s.get("/health")
            health = json.loads(body)
            assert status == 200 and health["status"] == "degraded", health
            assert any("node2" in m for m in health["missing"]), health
            # Every node is gone: /health is a 503 naming them, requests are 503 + Retry-After.
            nodes.kill(0)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                status, headers, body = s.get("/health")
                if status == 503:
                    break
                time.sleep(0.2)
            health = json.loads(body)
            assert status == 503 and health["status"] == "unavailable", health
            assert any("node1" in m for m in health["missing"]), health
            assert int({k.lower(): v for k, v in headers.items()}["retry-after"]) >= 1
            for stream in (False, True):
                status, headers, body = s.request("POST", "/v1/completions",
                                                  {"prompt": "Hi", "max_tokens": 4, "stream": stream})
                assert status == 503, (status, body)
                assert int({k.lower(): v for k, v in headers.items()}["retry-after"]) >= 1
                assert "error" in json.loads(body)
        finally:
            s.stop()


def test_up_serve_starts_without_a_late_node_and_takes_it_in_when_it_comes():
    """Boot order in a home lab is anyone's: `up --serve` waits `--wait` seconds for nodes,
    starts with those that listen, and takes a node into the ring once it appears."""
    model = model_path(SMOL.name)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    nodes = Nodes(0)
    late_port = free_port()
    try:
        p, port, name, log = nodes.start_one(0)
        nodes.procs.append(p)
        nodes.ports.append(port)
        flags = ["--node", f"127.0.0.1:{port}", "--node", f"127.0.0.1:{late_port}"]
        s = Server(["up", "-m", model, "--key", KEY, *flags, "--wait", "1", "--threads", "1",
                    "-c", "512", "--parallel", "2"])
        try:
            health = json.loads(s.get("/health")[2])
            assert health["status"] == "degraded" and len(health["nodes"]) == 1, health
            assert any(str(late_port) in m for m in health["missing"]), health
            p2, _, _, _ = nodes.start_one(1, port=late_port)
            nodes.procs.append(p2)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                health = json.loads(s.get("/health")[2])
                if len(health["nodes"]) == 2:
                    break
                time.sleep(0.5)
            assert health["status"] == "ok" and health["missing"] == [], health
            r = s.client().chat.completions.create(model=SMOL_ID, messages=q, temperature=0, max_tokens=16)
            assert r.choices[0].message.content.strip() == cli_chat(q[0]["content"], 16)
        finally:
            s.stop()
        err = s.proc.stderr.read()
        # The late node is known by its address only until it answers (then by its own name).
        assert f"waiting up to 1 s for 127.0.0.1:{late_port} to answer" in err, err
        assert "back: taking it into the ring" in err, err
    finally:
        nodes.__exit__(None, None, None)
