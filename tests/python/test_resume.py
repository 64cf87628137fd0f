"""Resume after a node loss: a node SIGKILLed mid-answer (after the Nth streamed chunk) and
the answers in flight go on on the ring rebuilt over the nodes left, replaying their prompt
and generated tokens: no error event, nothing sent twice, the same text as the
uninterrupted run (greedy, and seeded sampling), the pause reported in `usage`. With every
node gone: a clean error, not a hang. The same for `up -p`."""

import os
import subprocess
import threading
import time

import openai

from support.nodes import Nodes
from support.paths import KEY, SMOL, model_path, ringllm_bin
from support.server import SMOL_ID, Server

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]
COUNT = "1, 2, 3, 4, 5,"
N = 48  # tokens per answer
KILL_AFTER = 4  # streamed chunks before the kill


def server(nodes, *extra):
    return Server(["up", "-m", model_path(SMOL.name), "--key", KEY, *nodes.node_flags(), "--threads", "1",
                   "-c", "512", "--parallel", "2", *extra])


def extra(usage, key):
    return (usage.model_extra or {}).get(key)


def stream_until(stream, chunks, out, times):
    """Reads `stream` until `chunks` chunks with content have come, into `out` / `times`."""
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            out.append(ch.choices[0].delta.content)
            times.append(time.monotonic())
            if len(out) >= chunks:
                return
    raise AssertionError(f"the stream ended after {len(out)} chunks")


def busy(s):
    return s.metrics().get("ringllm_slots_busy", 0)


def test_a_node_killed_mid_answer_is_resumed_and_the_text_is_unchanged(tmp_path):
    with Nodes(3, log_dir=tmp_path) as nodes:
        s = server(nodes)
        try:
            c = s.client()
            c = c.with_options(timeout=120)
            # The uninterrupted answers, on the same ring before the kill.
            want_a = c.chat.completions.create(model=SMOL_ID, messages=CHAT, temperature=0, max_tokens=N)
            assert want_a.choices[0].finish_reason == "length", "the oracle must run the whole N tokens"
            want_b = c.completions.create(model=SMOL_ID, prompt=COUNT, temperature=0.8, seed=2, max_tokens=N)
            assert want_b.choices[0].finish_reason == "length"
            # A streams; B (seeded sampling, not streamed) joins it in the batch.
            stream = c.chat.completions.create(model=SMOL_ID, messages=CHAT, temperature=0, max_tokens=N,
                                               stream=True, stream_options={"include_usage": True})
            it = iter(stream)
            got, times = [], []
            stream_until(it, 1, got, times)
            b = {}
            tb = threading.Thread(target=lambda: b.update(r=c.completions.create(
                model=SMOL_ID, prompt=COUNT, temperature=0.8, seed=2, max_tokens=N)))
            tb.start()
            deadline = time.monotonic() + 60
            while busy(s) < 2:  # B admitted: both are generating (B behind A)
                assert time.monotonic() < deadline, "the second request was never admitted"
                time.sleep(0.01)
            stream_until(it, KILL_AFTER, got, times)
            nodes.kill(1)  # node2 carries both answers' layers
            killed_at = time.monotonic()
            before = len(got)
            usage, finish = None, None
            for ch in it:  # raises on an error event
                if ch.usage is not None:
                    usage = ch.usage
                for choice in ch.choices:
                    if choice.delta.content:
                        got.append(choice.delta.content)
                        times.append(time.monotonic())
                    finish = choice.finish_reason or finish
            tb.join(timeout=120)
            assert "r" in b, "the non-streamed request did not finish"
            text = "".join(got)
            assert text == want_a.choices[0].message.content
            assert finish == "length"
            assert usage is not None and usage.completion_tokens == N
            assert extra(usage, "resumed") == 1, usage
            assert b["r"].choices[0].text == want_b.choices[0].text
            assert extra(b["r"].usage, "resumed") == 1, b["r"].usage
            # The pause: the server's own figure, and the client's gap around the kill
            # against the median gap between chunks.
            gaps = sorted(t1 - t0 for t0, t1 in zip(times, times[1:]))
            pause = times[before] - times[before - 1] if len(times) > before else float("nan")
            print(f"\nresume: usage.resume_ms A {extra(usage, 'resume_ms')} B {extra(b['r'].usage, 'resume_ms')}; "
                  f"client: gap around the kill {pause * 1e3:.0f} ms (kill to next chunk "
                  f"{(times[before] - killed_at) * 1e3:.0f} ms), median gap {gaps[len(gaps) // 2] * 1e3:.1f} ms")
            # The ring runs without node2 now, and says so.
            health = s.get("/health")
            assert health[0] == 200 and b"node2" in health[2], health
            assert busy(s) == 0
        finally:
            s.stop()
        err = s.proc.stderr.read()
    assert "resuming 2 request(s)" in err, err
    assert "[resumed a request after" in err, err


def test_with_every_node_gone_the_answers_in_flight_end_with_a_clean_error(tmp_path):
    with Nodes(2, log_dir=tmp_path) as nodes:
        s = server(nodes)
        try:
            c = s.client().with_options(timeout=120)
            stream = c.chat.completions.create(model=SMOL_ID, messages=CHAT, temperature=0, max_tokens=N,
                                               stream=True)
            it = iter(stream)
            got, times = [], []
            stream_until(it, 1, got, times)
            b = {}

            def other():
                try:
                    b["r"] = c.completions.create(model=SMOL_ID, prompt=COUNT, temperature=0, max_tokens=N)
                except openai.APIError as e:
                    b["e"] = e

            tb = threading.Thread(target=other)
            tb.start()
            deadline = time.monotonic() + 60
            while busy(s) < 2:
                assert time.monotonic() < deadline, "the second request was never admitted"
                time.sleep(0.01)
            stream_until(it, KILL_AFTER, got, times)
            nodes.kill(0)
            nodes.kill(1)
            error = None
            try:
                for _ in it:
                    pass
            except openai.APIError as e:
                error = e
            tb.join(timeout=120)
            # An error event from the server, not a client timeout or a cut connection.
            assert error is not None, "the stream ended without an error"
            assert not isinstance(error, openai.APIConnectionError), error
            assert "do not answer" in str(error) and "resumed 2 time(s)" in str(error), error
            assert isinstance(b.get("e"), openai.APIStatusError) and b["e"].status_code == 503, b
            assert busy(s) == 0
            assert s.get("/health")[0] == 503
        finally:
            s.stop()


def test_up_prompt_resumes_after_a_node_is_killed(tmp_path):
    smol = model_path(SMOL.name)
    flags = ["-p", COUNT, "--temp", "0", "-n", str(N), "--threads", "1", "-c", "512"]
    want = subprocess.run([str(ringllm_bin()), "run", "-m", smol, *flags], capture_output=True, timeout=120)
    assert want.returncode == 0, want.stderr
    with Nodes(3, log_dir=tmp_path) as nodes:
        p = subprocess.Popen([str(ringllm_bin()), "up", "-m", smol, "--key", KEY, *nodes.node_flags(), *flags],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out = b""
            while out.count(b",") < KILL_AFTER:  # a few numbers written
                chunk = os.read(p.stdout.fileno(), 256)
                assert chunk, f"up ended early: {p.stderr.read().decode()}"
                out += chunk
            nodes.kill(1)
            rest, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    err = err.decode()
    assert p.returncode == 0, err
    assert out + rest == want.stdout
    assert "rebuilding the ring" in err and "node2" in err, err
    line = next(l for l in err.splitlines() if l.startswith("resumed 1 time"))
    print(f"\nup -p: {line}")
