"""The ring across three Linux network namespaces joined by veth pairs (one per host, the
coordinator in its own), created and removed by the test: output identical to the single
process, and a pulled cable detected within seconds, naming the node."""

import json
import subprocess
import time

import pytest

from support.netns import Netns, netns_available, wait_port
from support.paths import GEMMA, KEY, MODELS, ROOT, model_path, ringllm_bin

pytestmark = [pytest.mark.netns, pytest.mark.root]

GEN = ["--temp", "0", "-n", "10", "--threads", "1", "-c", "256"]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def net():
    ok, why = netns_available()
    if not ok:
        pytest.fail(f"network namespaces are needed for this test and unavailable: {why}")
    with Netns(["coord", "host1", "host2"]) as n:
        yield n


def start_nodes(net):
    procs = []
    for host in ("host1", "host2"):
        p = net.popen(host, [str(ringllm_bin()), "-v", "node", "--listen", f"{net.addr(host)}:7701", "--key", str(KEY),
                             "--models", str(MODELS), "--name", host, "--threads", "1"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(p)
    for host in ("host1", "host2"):
        wait_port(net, "coord", net.addr(host), 7701, timeout=20)
    return procs


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


@pytest.mark.slow
def test_netns_ring_equals_single_process(net, tmp_path):
    model = model_path(GEMMA.name)
    cfg_text = (ROOT / "cluster-configs" / "netns-3.toml").read_text()
    assert net.addr("host1") in cfg_text and net.addr("host2") in cfg_text
    single = subprocess.run([str(ringllm_bin()), "run", "-m", model, "-p", PROMPT, *GEN, "--json",
                             "--logits-out", tmp_path / "single.f32"], capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    procs = start_nodes(net)
    try:
        r = net.run("coord", [str(ringllm_bin()), "up", str(ROOT / "cluster-configs" / "netns-3.toml"), "-p", PROMPT, *GEN,
                              "--json", "--logits-out", str(tmp_path / "ring.f32")], timeout=300)
        assert r.returncode == 0, r.stderr
        got, want = json.loads(r.stdout), json.loads(single.stdout)
        assert got["token_ids"] == want["token_ids"]
        assert got["text"] == want["text"]
        assert (tmp_path / "ring.f32").read_bytes() == (tmp_path / "single.f32").read_bytes()
    finally:
        stop(procs)


def test_netns_pulled_cable_fails_within_seconds_naming_the_node(net, tmp_path):
    model_path(GEMMA.name)
    procs = start_nodes(net)
    try:
        p = net.popen("coord", [str(ringllm_bin()), "up", str(ROOT / "cluster-configs" / "netns-3.toml"),
                                "-p", "Write a long story about a dragon.", "--temp", "0", "-n", "-1",
                                "--threads", "1", "-c", "4096", "--resume-retries", "0"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            if p.stdout.read(1):
                break
        time.sleep(0.5)
        assert p.poll() is None, p.stderr.read()
        t0 = time.monotonic()
        net.link_down("host2")
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail("the coordinator did not give up within 20 s of the cable pull")
        took = time.monotonic() - t0
        err = p.stderr.read()
        assert p.returncode != 0
        assert "host2" in err and net.addr("host2") in err, err
        assert took < 12, f"{took:.1f} s"
    finally:
        net.link_up("host2")
        stop(procs)
