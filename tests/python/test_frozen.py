"""A node that is there to TCP but not to the ring: frozen (SIGSTOP: a closed laptop lid, a
paused VM), or an address squatted by another program or by a node with another key. The
kernel of a frozen process and any squatter still take a TCP connection; only a live node
with the cluster key finishes the handshake. So: a node frozen mid-answer is left out and the
answer resumes within about the pause a SIGKILL costs (both measured here, in the same run),
and it is taken back after SIGCONT; a squatter on a lost node's port never makes the server
drop its working degraded ring; a node that vanishes while it loads its slice is noticed
within seconds (not after the 300 s load timeout) and the ring is built without it."""

import json
import signal
import socket
import subprocess
import threading
import time

from support.nodes import Nodes
from support.paths import KEY, SMOL, model_path, ringllm_bin
from support.server import SMOL_ID, Server

COUNT = "1, 2, 3, 4, 5,"
N = 40  # tokens per answer
STOP_AFTER = 4  # streamed chunks before the node is frozen or killed


def server(nodes, *extra):
    return Server(["up", "-m", model_path(SMOL.name), "--key", KEY, *nodes.node_flags(), "--threads", "1",
                   "-c", "512", "--parallel", "1", *extra])


def health(s):
    status, _, body = s.get("/health")
    return status, json.loads(body)


def wait_health(s, ok, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        status, h = health(s)
        if ok(status, h):
            return time.monotonic()
        assert time.monotonic() < deadline, f"{what}: /health is still {status} {h}"
        time.sleep(0.1)


def pause_around(s, signal_node):
    """Streams an answer, calls `signal_node()` after STOP_AFTER chunks, and returns the
    resume pause in seconds: the server's own figure (`usage.resume_ms`: from the last token
    before the failure to the next), which chunks buffered on the way cannot hide."""
    stream = s.client().with_options(timeout=120).completions.create(
        model=SMOL_ID, prompt=COUNT, temperature=0, max_tokens=N, stream=True,
        stream_options={"include_usage": True})
    usage, got = None, 0
    for ch in stream:  # raises on an error event
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices and ch.choices[0].text:
            got += 1
            if got == STOP_AFTER:
                signal_node()
    assert got == N, f"the answer ended after {got} chunks"
    extra = usage.model_extra or {}
    assert extra.get("resumed") == 1, usage
    return extra["resume_ms"] / 1e3


def test_a_frozen_node_is_left_out_as_fast_as_a_killed_one_and_taken_back_after_sigcont(tmp_path):
    with Nodes(3, log_dir=tmp_path) as nodes:
        s = server(nodes)
        try:
            frozen = pause_around(s, lambda: nodes.procs[1].send_signal(signal.SIGSTOP))
            status, h = health(s)
            assert status == 200 and any("node2" in m for m in h["missing"]), h
            nodes.procs[1].send_signal(signal.SIGCONT)
            t = time.monotonic()
            wait_health(s, lambda st, h: st == 200 and h["missing"] == [], 20, "node2 taken back")
            back = time.monotonic() - t
            killed = pause_around(s, lambda: nodes.kill(1))
            print(f"\nresume pause: SIGSTOP {frozen * 1e3:.0f} ms, SIGKILL {killed * 1e3:.0f} ms; "
                  f"taken back {back:.1f} s after SIGCONT")
        finally:
            s.stop()
        err = s.proc.stderr.read()
    assert frozen <= killed + 2.0, (frozen, killed)
    assert "no handshake within" in err, err
    assert "node2 back: taking it into the ring" in err, err


class Squatter:
    """A plain TCP listener that takes connections and never says a word; counts them."""

    def __init__(self, port):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.accepted, self.conns = 0, []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(c)

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()
        self.thread.join(timeout=5)


def answer_until(s, tried, what, timeout=15):
    """Asks for a short answer again and again until `tried()` (the server has probed the
    squatter), then for as long again as a take-back would need to tear the ring down; every
    answer must come (no 503). Returns how many came."""
    c = s.client().with_options(timeout=60)
    deadline = time.monotonic() + timeout
    n, after = 0, None
    while after is None or time.monotonic() < after:
        r = c.completions.create(model=SMOL_ID, prompt=COUNT, temperature=0, max_tokens=4)
        assert r.choices[0].text, r
        assert health(s)[0] == 200
        n += 1
        if after is None and tried():
            after = time.monotonic() + 1.5  # the probe's deadline (1 s) and a rebuild's start
        assert after is not None or time.monotonic() < deadline, f"the server never tried {what}"
        time.sleep(0.4)  # an idle server probes the missing nodes; a busy one does not
    return n


def test_a_squatter_on_a_lost_nodes_port_never_takes_the_degraded_ring_down(tmp_path):
    other_key = tmp_path / "other.key"
    subprocess.run([str(ringllm_bin()), "keygen", str(other_key)], check=True, capture_output=True)
    with Nodes(2, log_dir=tmp_path) as nodes:
        s = server(nodes)
        squatter = None
        try:
            nodes.kill(1)
            wait_health(s, lambda st, h: st == 200 and any("node2" in m for m in h["missing"]), 15,
                        "the ring rebuilt without node2")
            # Another program on node2's port: the server tries it (it takes connections)
            # and keeps its ring.
            squatter = Squatter(nodes.ports[1])
            n = answer_until(s, lambda: squatter.accepted >= 1, "the squatter")
            squatter.close()
            squatter = None
            # node2 back with another cluster key: refused by the handshake, and the ring
            # is kept.
            nodes.key = other_key
            nodes.restart(1)
            n += answer_until(s, lambda: "refused connection" in nodes.log(1), "the node with another key")
            status, h = health(s)
            assert status == 200 and any("node2" in m for m in h["missing"]), h
            print(f"\n{n} answers while node2's port was squatted")
        finally:
            if squatter:
                squatter.close()
            s.stop()
        err = s.proc.stderr.read()
    assert "node2 back" not in err, err


def test_a_node_that_vanishes_while_loading_is_noticed_in_seconds(tmp_path):
    """node3's slice loads slowly (RINGLLM_NODE_LOAD_DELAY_MS); it is frozen while it loads.
    The server must notice within seconds and come up over node1 and node2."""
    slow = {"RINGLLM_NODE_LOAD_DELAY_MS": "60000"}
    with Nodes(3, log_dir=tmp_path, env=lambda i: slow if i == 2 else {}) as nodes:
        started = {}

        def start():
            try:
                started["s"] = server(nodes)
            except Exception as e:  # noqa: BLE001 (reported below)
                started["e"] = e

        t = threading.Thread(target=start)
        t.start()
        deadline = time.monotonic() + 30
        while "loading waits" not in nodes.log(2):
            assert time.monotonic() < deadline and t.is_alive(), f"node3 never loaded: {started}"
            time.sleep(0.05)
        nodes.procs[2].send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        t.join(timeout=90)
        assert "s" in started, started
        s = started["s"]
        try:
            up = time.monotonic() - frozen_at
            print(f"\nthe ring came up {up:.1f} s after node3 froze while loading")
            assert up < 20, up
            status, h = health(s)
            assert status == 200 and any("node3" in m for m in h["missing"]), h
            r = s.client().completions.create(model=SMOL_ID, prompt=COUNT, temperature=0, max_tokens=4)
            assert r.choices[0].text
        finally:
            s.stop()
        err = s.proc.stderr.read()
    assert "while loading its slice" in err, err
