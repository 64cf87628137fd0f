"""Discovery on a spoofed LAN (issue 29, parts 3 and 4). A host with no key (`evil`) announces
ringllm services carrying the cluster's public hash while two real nodes (a1, a2) advertise;
the master browses. Discovery is a hint: each service that claims the cluster must answer the
handshake within a short deadline, addresses no node can be at are dropped, a name announced
twice keeps both addresses, and a flood cannot crowd the real nodes out. Under each attack
`up --discover` must find exactly a1 and a2, within 3 s of starting to listen, and run on them. Names from the LAN carrying
ANSI escapes, CR, LF or BEL must reach the terminal escaped."""

import json
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from support.mdns_spoof import Spoofer, announcement, node_txt
from support.netns import Netns, netns_available, wait_port
from support.paths import KEY, MODELS, SMOL, model_path, ringllm_bin
from test_discovery_netns import discovery_hash, enable_multicast, wait_all_heard

pytestmark = [pytest.mark.netns, pytest.mark.root]

PORT = 7701
SUBNET = "10.79.0"
REAL = ("a1", "a2")
DEAD = f"{SUBNET}.250"  # on the LAN's subnet, no host: ARP never answers
OFF_LAN = "10.0.0.1"  # no route to it from the master
EVIL_NAME = b"evil\x1b[2J\x1b[31m\x07\r\n2026-01-01T00:00:00Z  INFO forged line"
# Namespace names start with this (helpers running side by side give their own).
PREFIX = os.environ.get("RINGLLM_NETNS_PREFIX", "rl")


@pytest.fixture(scope="module")
def lan():
    ok, why = netns_available()
    if not ok:
        pytest.fail(f"network namespaces are needed for this test and unavailable: {why}")
    model_path(SMOL.name)
    tmp = tempfile.mkdtemp(prefix="ringllm-spoof-")
    hosts = ["master", *REAL, "evil"]
    with Netns(hosts, subnet=SUBNET, prefix=PREFIX) as net:
        enable_multicast(net, hosts)
        procs = []
        for h in REAL:
            procs.append(net.popen(h, [ringllm_bin(), "-v", "node", "--listen", f"0.0.0.0:{PORT}", "--key", KEY,
                                       "--models", MODELS, "--name", h, "--threads", "1", "--cache",
                                       f"{tmp}/cache-{h}", "--advertise", "--mdns-interface", "eth0"],
                                 stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/{h}.log", "w")))
        try:
            for h in REAL:
                wait_port(net, "master", net.addr(h), PORT, timeout=20)
            # Both nodes have probed their names and announce themselves (a second or so).
            wait_all_heard(net, want=len(REAL))
            yield net, discovery_hash(KEY)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=10)
            shutil.rmtree(tmp, ignore_errors=True)


def discover(net, what):
    """`up --discover` on the master, one token; returns (its stderr, seconds until the last
    real node answered, as it reports it)."""
    time.sleep(1.2)  # a responder answers the same query at most once a second (RFC 6762)
    t0 = time.monotonic()
    r = net.run("master", [ringllm_bin(), "-v", "up", "-m", SMOL, "--key", KEY, "--discover", "-p", "Hi", "-n", "1",
                           "--temp", "0", "--threads", "1", "-c", "64", "--json"], timeout=120)
    wall = time.monotonic() - t0
    out = r.stderr
    assert r.returncode == 0, f"{what}: {out}"
    assert len(json.loads(r.stdout)["token_ids"]) == 1, r.stdout
    m = re.search(r"discovered (\d+) nodes? of cluster [0-9a-f]{16} in ([0-9.]+) s: (.*)", out)
    assert m, out
    found = re.findall(r"'(\w+)' \(([\d.]+):(\d+)\)", m.group(3))
    assert sorted(found) == [(h, net.addr(h), str(PORT)) for h in REAL], f"{what}: {m.group(0)}"
    # The ring is made of exactly the real nodes.
    rows = re.findall(r"^(\S+)\s+([\d.]+):\d+\s+\d+-\d+", out, re.M)
    assert sorted(n for n, _ in rows) == list(REAL), out
    took = float(m.group(2))
    print(f"\n{what}: up --discover heard the real nodes answer {took:.2f} s into its browse "
          f"(whole run {wall:.1f} s)")
    assert took <= 3.0, out
    return out, took


def test_services_at_dead_or_impossible_addresses_are_dropped_and_names_are_escaped(lan):
    net, ours = lan
    evil = net.addr("evil")
    fakes = [
        ("dead 7701", "dead-7701", [DEAD], PORT),
        ("port0 7701", "port0-7701", [evil], 0),
        ("zero 7701", "zero-7701", ["0.0.0.0"], PORT),
        ("mcast 7701", "mcast-7701", ["224.0.0.1"], PORT),
        ("bcast 7701", "bcast-7701", ["255.255.255.255"], PORT),
        ("subnetbcast 7701", "sbcast-7701", [f"{SUBNET}.255"], PORT),
        ("tarpit 7701", "tarpit-7701", [evil], PORT),
        ("closed 7702", "closed-7702", [evil], PORT + 1),
    ]
    packets = [announcement(i, h, ips, port, node_txt(i.split()[0], ours)) for i, h, ips, port in fakes]
    # A name full of terminal controls, claiming our cluster (at the tarpit) and another one.
    packets.append(announcement("ansi 7701", "ansi-7701", [evil], PORT, node_txt(EVIL_NAME, ours)))
    packets.append(announcement("ansi2 7701", "ansi2-7701", [evil], PORT, node_txt(EVIL_NAME, "00" * 8)))
    with Spoofer(net, "evil", packets, tarpit_port=PORT) as spoof:
        out, took = discover(net, "dead addresses")
        time.sleep(1.2)
        table = net.run("master", [ringllm_bin(), "nodes", "--key", KEY, "--wait", "2"], timeout=30)
    assert spoof.sent > 0
    for text in (out, table.stdout, table.stderr):
        for bad in ("\x1b", "\x07", "\r"):
            assert bad not in text, repr(text)
        assert not any(line.startswith("2026-01-01") for line in text.splitlines()), text
    # Each impossible address is dropped with a line saying why; the others after their probe.
    for why in ("port 0", "an unspecified address", "a multicast address", "the broadcast address"):
        assert why in out, out
    assert "claimed cluster" in out and "did not answer its key" in out, out
    # `nodes --key` lists the real nodes as ours and the impostors as claiming it.
    assert re.search(r"^a1\s.*\(ours\)", table.stdout, re.M), table.stdout
    assert "(claimed, no answer)" in table.stdout, table.stdout
    assert "evil\\u{1b}[2J" in table.stdout, table.stdout


def test_a_real_nodes_name_announced_elsewhere_does_not_hide_it(lan):
    net, ours = lan
    packets = [
        # a1's instance name on a1's own host name, at an address off the LAN that sorts
        # before a1's (records with the cache-flush bit: "this replaces what you had").
        announcement(f"a1 {PORT}", f"a1-{PORT}", [OFF_LAN], PORT, node_txt("a1", ours)),
        # a2's instance name on another host, at a dead address of the LAN.
        announcement(f"a2 {PORT}", "evil-a2", [DEAD], PORT, node_txt("a2", ours)),
    ]
    with Spoofer(net, "evil", packets, interval=0.1):
        out, _ = discover(net, "hijacked names")
    # Both addresses heard for each name were tried; the spoofed ones dropped.
    assert f"dropping address {OFF_LAN}:{PORT} of 'a1'" in out, out
    assert f"dropping address {DEAD}:{PORT} of 'a2'" in out, out


def test_three_hundred_fake_services_do_not_crowd_out_the_real_nodes(lan):
    net, ours = lan
    evil = net.addr("evil")
    # 300 fakes claiming our cluster, sorting before the real nodes, at dead addresses of the
    # subnet and at the tarpit, so that every probe runs to its deadline.
    packets = [announcement(f"0fake{i:03d} {PORT}", f"fake{i:03d}", [f"{SUBNET}.{100 + i % 140}" if i % 2 else evil],
                            PORT, node_txt(f"0fake{i:03d}", ours)) for i in range(300)]
    with Spoofer(net, "evil", packets, interval=0.5, tarpit_port=PORT) as spoof:
        out, took = discover(net, "300 fake services")
    assert spoof.sent >= 300
    # All 302 were tracked and probed; the list keeps the 256 that answered first (the real
    # nodes) and the rest in the order heard.
    # Every fake claiming the cluster that was heard was probed and left out. Multicast on a
    # loaded machine loses some of the 300 announcements within the 3 s browse: when more
    # than 256 were heard the list keeps the 256 that answered first (the real nodes) and the
    # rest in the order heard; either way most of the fakes must have been heard, or this
    # run did not test the crowding.
    left = re.search(r"left out (\d+) that claimed cluster", out)
    assert left and int(left.group(1)) >= 150, out
    capped = re.search(r"(\d+) ringllm services heard; listing 256", out)
    if capped:
        # Past the cap the count is whatever multicast delivered (285 in one loaded CI run).
        assert 256 < int(capped.group(1)) <= 302, out
        assert int(left.group(1)) == 254, out
    print(f"fakes heard and left out: {left.group(1)}")
