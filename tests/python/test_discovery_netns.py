"""Discovery on a LAN (issue 19, part 1): five network-namespace hosts on one Linux bridge,
multicast enabled only inside them. Three nodes advertise with key A, one with key B;
`up --discover` on the master must hear the three of its cluster (the time it took is printed),
leave the B node out, form the ring and generate the tokens `ringllm run` gives in one process.
`nodes --json` must list all four with the right cluster hash (computed here with Python's hmac,
independently of ringllm) and capabilities."""

import hashlib
import hmac
import json
import pathlib
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from support.netns import Netns, netns_available, wait_port
from support.paths import KEY, MODELS, SMOL, model_path, ringllm_bin

pytestmark = [pytest.mark.netns, pytest.mark.root]

PORT = 7701
A_NODES = ("a1", "a2", "a3")
PROMPT = "The three primary colors are"
GEN = ["--temp", "0", "-n", "12", "--threads", "1", "-c", "256"]


def discovery_hash(key_path):
    """HMAC-SHA256(key, label), first 8 bytes in hex: the key file's bytes with trailing
    whitespace dropped, as ringllm reads it."""
    key = key_path.read_bytes().rstrip(b" \t\r\n\x0b\x0c")
    return hmac.new(key, b"ringllm mdns cluster hash v1\0", hashlib.sha256).hexdigest()[:16]


def enable_multicast(net, hosts):
    """Multicast inside the test's namespaces only: on every host's eth0 (with a route for
    224.0.0.0/4) and on the bridge, with snooping off so mDNS floods to every port."""
    for h in hosts:
        for cmd in (["link", "set", "eth0", "multicast", "on"],
                    ["route", "add", "224.0.0.0/4", "dev", "eth0"]):
            subprocess.run(["ip", "-n", net.name(h), *cmd], check=True, capture_output=True, text=True)
    subprocess.run(["ip", "-n", net.switch, "link", "set", "br0", "type", "bridge", "mcast_snooping", "0"],
                   check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def lan():
    ok, why = netns_available()
    if not ok:
        pytest.fail(f"network namespaces are needed for this test and unavailable: {why}")
    model_path(SMOL.name)
    tmp = tempfile.mkdtemp(prefix="ringllm-disco-")
    key_b = f"{tmp}/b.key"
    subprocess.run([str(ringllm_bin()), "keygen", key_b], check=True, capture_output=True)
    hosts = ["master", *A_NODES, "b1"]
    with Netns(hosts, subnet="10.78.0") as net:
        enable_multicast(net, hosts)
        procs = {}
        for h in (*A_NODES, "b1"):
            key = KEY if h != "b1" else key_b
            # a1 listens on its address (advertises exactly it); the others on every address.
            listen = f"{net.addr(h)}:{PORT}" if h == "a1" else f"0.0.0.0:{PORT}"
            # a2 restricts mDNS to its eth0 (the others use every interface).
            only = ["--mdns-interface", "eth0"] if h == "a2" else []
            procs[h] = net.popen(h, [ringllm_bin(), "-v", "node", "--listen", listen, "--key", key, "--models", MODELS,
                                     "--name", h, "--threads", "1", "--cache", f"{tmp}/cache-{h}", "--advertise",
                                     *only],
                                 stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/{h}.log", "w"), text=True)
        for h in procs:
            wait_port(net, "master", net.addr(h), PORT, timeout=20)
        try:
            # Every node has probed its name and announced itself (under a second each).
            heard = wait_all_heard(net)
            assert sorted(f["name"] for f in heard) == ["a1", "a2", "a3", "b1"], heard
            yield net, procs, key_b, tmp
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=10)
            shutil.rmtree(tmp, ignore_errors=True)


# A responder multicasts the same record at most once a second (RFC 6762 section 6), so a browse
# started within a second of the previous one is answered only at its second query, about 1 s in.
# The test leaves that second between its browses, as between two people's commands on a LAN.
_last_browse = [0.0]


def browsing(net, argv, timeout=300):
    """Runs a command that browses mDNS on the master, at least 1.5 s after the previous one."""
    time.sleep(max(0.0, _last_browse[0] + 1.5 - time.monotonic()))
    try:
        return net.run("master", argv, timeout=timeout)
    finally:
        _last_browse[0] = time.monotonic()


def nodes_json(net, *extra):
    r = browsing(net, [ringllm_bin(), "nodes", "--json", *extra], timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_all_heard(net, want=4, timeout=20):
    """Polls `nodes` until every node's announcement (after its mDNS name probe) is heard."""
    deadline = time.monotonic() + timeout
    while True:
        found = nodes_json(net)
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_nodes_json_lists_every_node_with_its_cluster_hash(lan):
    net, procs, key_b, tmp = lan
    found = nodes_json(net, "--key", KEY, "--mdns-interface", "eth0")
    by_name = {f["name"]: f for f in found}
    assert sorted(by_name) == ["a1", "a2", "a3", "b1"], found
    hash_a = discovery_hash(KEY)
    hash_b = discovery_hash(pathlib.Path(key_b))
    assert hash_a != hash_b
    key_text = KEY.read_text().strip()
    for name, f in by_name.items():
        mine = name != "b1"
        assert f["same_cluster"] is mine, f
        assert f["cluster"] == (hash_a if mine else hash_b), f
        assert key_text not in json.dumps(f)
        assert f["address"] == f"{net.addr(name)}:{PORT}", f
        assert f["port"] == PORT
        assert f["threads"] == 1 and f["transport"] == "tcp" and f["memory_budget"] > 0, f
        assert f["backend"] and f["version"], f
    # a1 listens on one address and advertises exactly it; a2, restricted to eth0, only eth0's
    # addresses (its IPv4 one, and an IPv6 link-local one, which is never dialled).
    assert by_name["a1"]["addresses"] == [net.addr("a1")], by_name["a1"]
    a2_v4 = [a for a in by_name["a2"]["addresses"] if ":" not in a]
    assert a2_v4 == [net.addr("a2")], by_name["a2"]
    # An interface that does not exist hears nothing.
    assert nodes_json(net, "--wait", "1", "--mdns-interface", "nosuch0") == []
    # Without a key nothing is judged.
    assert all(f["same_cluster"] is None for f in nodes_json(net))


@pytest.mark.slow
def test_up_discover_finds_its_three_nodes_and_equals_the_single_process(lan):
    net, procs, key_b, tmp = lan
    single = subprocess.run([str(ringllm_bin()), "run", "-m", SMOL, "-p", PROMPT, *GEN, "--json"],
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    t0 = time.monotonic()
    r = browsing(net, [ringllm_bin(), "up", "-m", SMOL, "--key", KEY, "--discover", "-p", PROMPT, *GEN, "--json"])
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    m = re.search(r"discovered (\d+) nodes of cluster ([0-9a-f]{16}) in ([0-9.]+) s: (.*)", r.stderr)
    assert m, r.stderr
    count, cid, took, which = int(m.group(1)), m.group(2), float(m.group(3)), m.group(4)
    print(f"\nup --discover heard its 3 nodes {took:.2f} s into a 3 s browse (whole run {wall:.1f} s)")
    assert count == 3 and cid == discovery_hash(KEY), r.stderr
    assert took <= 3.0
    for h in A_NODES:
        assert f"'{h}' ({net.addr(h)}:{PORT})" in which, which
    assert "b1" not in which
    ignored = re.search(r"ignored 1 of another cluster: '(\w+)' \(([\d.]+):\d+\)", r.stderr)
    assert ignored and ignored.group(1) == "b1" and ignored.group(2) == net.addr("b1"), r.stderr
    # The plan's table: one row per stage, the three A nodes and not b1.
    stages = re.findall(r"^(a\d|b1)\s+([\d.]+):\d+\s+\d+-\d+", r.stderr, re.M)
    assert sorted(s[0] for s in stages) == list(A_NODES), r.stderr
    got, want = json.loads(r.stdout), json.loads(single.stdout)
    assert got["token_ids"] == want["token_ids"]
    assert got["text"] == want["text"]
    # b1 was never asked to join: its log shows no coordinator.
    assert procs["b1"].poll() is None
    assert "serving coordinator" not in open(f"{tmp}/b1.log").read()


def test_cluster_file_with_discover_plans_and_reports_over_the_heard_nodes(lan, tmp_path):
    net, procs, key_b, tmp = lan
    cfg = tmp_path / "disco.toml"
    cfg.write_text(f'model = "{SMOL}"\nkey = "{KEY}"\ndiscover = true\ndiscover_wait = 3\n')
    r = browsing(net, [ringllm_bin(), "plan", cfg], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "discovered 3 nodes" in r.stderr and "'b1'" in r.stderr, r.stderr
    rows = re.findall(r"^(a\d|b1)\s+([\d.]+):\d+\s+\d+-\d+", r.stdout + r.stderr, re.M)
    assert sorted(n for n, _ in rows) == list(A_NODES), r.stdout + r.stderr
    # `status` over the same file asks the three nodes of its cluster directly.
    r = browsing(net, [ringllm_bin(), "status", cfg, "--json"], timeout=60)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert sorted(n["name"] for n in rep["nodes"]) == list(A_NODES)
    assert all(n["health"] == "idle" and n["coordinator"] is None for n in rep["nodes"]), rep
