"""`ringllm status` and `GET /v1/cluster` (issue 19, part 2): a 2-node ring on loopback served
by `up --serve`; the nodes answer status queries while the coordinator holds them, name it, and
the coordinator keeps serving (its answers stay equal to the single process's); the
coordinator's /v1/cluster returns the same fields; a status query with another key is refused
and changes nothing."""

import http.client
import json
import re
import signal
import subprocess
import time

import pytest

from support.cli import ringllm
from support.nodes import Nodes, free_port
from support.paths import KEY, SMOL, model_path, ringllm_bin

PROMPT = "The three primary colors are"
N = 8
# The documented fields of a node's entry (docs/cluster.md "Status"); both sources give them all.
NODE_FIELDS = {
    "address", "name", "health", "error", "version", "transport", "threads", "isa", "layers", "head", "model",
    "memory_total", "memory_budget", "memory_used", "weight_bytes", "kv_bytes", "matvec_bytes_per_s",
    "tokens_per_s", "rtt_ms", "coordinator", "bytes_in_per_s", "bytes_out_per_s", "bytes_in", "bytes_out",
    "tokens", "uptime_s",
}


def http_get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path)
    r = c.getresponse()
    out = r.status, r.read()
    c.close()
    return out


def complete(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"prompt": PROMPT, "max_tokens": N, "temperature": 0})
    c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    assert r.status == 200, data
    return json.loads(data)["choices"][0]["text"]


@pytest.fixture(scope="module")
def ring():
    model = model_path(SMOL.name)
    with Nodes(2) as nodes:
        port = free_port()
        p = subprocess.Popen([str(ringllm_bin()), "up", "-m", model, "--key", KEY, *nodes.node_flags(), "--threads", "1",
                              "-c", "512", "--parallel", "2", "--serve", f"127.0.0.1:{port}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert p.poll() is None, p.stderr.read()
                try:
                    if http_get(port, "/health")[0] == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "the coordinator did not come up"
                time.sleep(0.1)
            yield nodes, port
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def status_json(*args):
    r = ringllm(["status", *args, "--json"], timeout=60)
    return json.loads(r.stdout)


def test_status_from_the_nodes_while_the_coordinator_holds_them(ring):
    nodes, port = ring
    single = ringllm(["run", "-m", SMOL, "-p", PROMPT, "--temp", "0", "-n", str(N), "--threads", "1", "--json"])
    want = json.loads(single.stdout)["text"]
    assert complete(port) == want
    rep = status_json("--key", KEY, "--nodes", ",".join(nodes.addrs()))
    assert rep["coordinator"] is None
    assert [n["address"] for n in rep["nodes"]] == nodes.addrs()
    assert [n["name"] for n in rep["nodes"]] == nodes.names
    spans = []
    for n in rep["nodes"]:
        assert set(n) == NODE_FIELDS, set(n) ^ NODE_FIELDS
        assert n["health"] == "serving" and n["error"] is None, n
        assert n["coordinator"]["name"] == "coordinator" and n["coordinator"]["address"].startswith("127.0.0.1:")
        assert n["transport"] == "tcp" and n["threads"] == 1 and n["model"] == SMOL.name
        assert 0 < n["memory_used"] and 0 < n["memory_budget"] and n["weight_bytes"] > 0 and n["kv_bytes"] > 0
        assert n["matvec_bytes_per_s"] > 0 and n["rtt_ms"] > 0
        # The completion above went through both stages.
        assert n["bytes_in"] > 0 and n["bytes_out"] > 0 and n["tokens"] >= N
        a, b = map(int, n["layers"].split("-"))
        spans.append((a, b))
    assert spans[0][0] == 0 and spans[1][0] == spans[0][1] + 1 and spans[1][1] == 29, spans
    assert rep["nodes"][1]["head"] is False
    # The table names every node, its health and the coordinator.
    table = ringllm(["status", "--key", KEY, "--nodes", ",".join(nodes.addrs())]).stdout
    for name in nodes.names:
        assert re.search(rf"^{name}\s+127\.0\.0\.1:\d+\s+serving\s+tcp", table, re.M), table
    # The coordinator kept the nodes and serves on, with the same answer.
    assert complete(port) == want


def test_v1_cluster_returns_the_same_fields(ring):
    nodes, port = ring
    status, body = http_get(port, "/v1/cluster")
    assert status == 200, body
    api = json.loads(body)
    direct = status_json("--key", KEY, "--nodes", ",".join(nodes.addrs()))
    assert api["coordinator"]["status"] == "ok" and api["coordinator"]["missing"] == []
    assert api["coordinator"]["model"] == "smollm2-135m-instruct-q4_1"
    assert len(api["coordinator"]["ring"]) == 2
    assert len(api["nodes"]) == 2
    stable = ("address", "name", "health", "transport", "layers", "head", "model", "memory_budget", "threads")
    for a, d in zip(api["nodes"], direct["nodes"]):
        assert set(a) == NODE_FIELDS
        assert {k: a[k] for k in stable} == {k: d[k] for k in stable}
        assert a["coordinator"]["address"] == d["coordinator"]["address"]
    # `status --url` reads it and prints the same JSON shape.
    via = status_json("--url", f"http://127.0.0.1:{port}")
    assert via["coordinator"]["status"] == "ok"
    assert [n["name"] for n in via["nodes"]] == nodes.names
    assert complete(port)


def test_a_status_query_with_another_key_is_refused_and_changes_nothing(ring, tmp_path):
    nodes, port = ring
    other = tmp_path / "other.key"
    ringllm(["keygen", other])
    rep = status_json("--key", other, "--nodes", nodes.addrs()[0])
    n = rep["nodes"][0]
    assert n["health"] == "error" and "cluster" in n["error"], n
    assert n["coordinator"] is None and n["layers"] is None
    again = status_json("--key", KEY, "--nodes", nodes.addrs()[0])["nodes"][0]
    assert again["health"] == "serving"
    assert complete(port)


def test_watch_repeats_without_clearing_a_pipe(ring):
    nodes, port = ring
    p = subprocess.Popen([str(ringllm_bin()), "status", "--key", KEY, "--nodes", ",".join(nodes.addrs()), "--watch",
                          "0.3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2.0)
    finally:
        # SIGTERM, not SIGINT: a shell running the suite in the background starts its
        # children with SIGINT ignored (seen in CI: the watch never stopped).
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=10)
    assert out.count("HEALTH") >= 2, (out, err)
    assert "\x1b[2J" not in out
