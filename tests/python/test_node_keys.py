"""Per-node identity with real processes: `keygen --node` makes node keys that join a ring,
`revoke` refuses a node by name on both sides (at the coordinator, and at a node that learned
the list from its coordinator), a forged node key is refused, an older peer is told to upgrade
where node keys are used, and the shared-key cluster works as before."""

import json
import shutil
import socket
import struct

from support.cli import ringllm
from support.nodes import Nodes
from support.paths import KEY, SMOL, model_path

GEN = ["--temp", "0", "-n", "4", "--threads", "1", "-c", "128", "--json"]


def cluster(tmp_path, names):
    """A copy of the test key in tmp_path (its revocation list goes beside it) and a node key
    for each of `names`."""
    key = tmp_path / "cluster.key"
    shutil.copy(KEY, key)
    for n in names:
        r = ringllm(["keygen", "--node", n, "--key", key, tmp_path / f"{n}.key"])
        assert f'"{n}"' in r.stderr, r.stderr
    return key


def node_key_args(tmp_path):
    return lambda i: ["--node-key", tmp_path / f"node{i + 1}.key"]


def up(key, nodes, order=None, check=True):
    flags = []
    for a in order or nodes.addrs():
        flags += ["--node", a]
    return ringllm(["up", "-m", model_path(SMOL.name), "--key", key, *flags, "-p", "Hi", *GEN],
                   check=check, timeout=120)


def test_node_keys_join_and_a_revoked_node_is_refused_by_name_on_both_sides(tmp_path):
    key = cluster(tmp_path, ["node1", "node2"])
    with Nodes(2, key=key, log_dir=tmp_path, extra_args=node_key_args(tmp_path)) as nodes:
        ok = up(key, nodes)
        assert len(json.loads(ok.stdout)["token_ids"]) > 0

        r = ringllm(["revoke", "node2", "--key", key])
        assert "revoked" in r.stderr and (tmp_path / "cluster.key.revoked").exists()
        r = up(key, nodes, check=False)
        assert r.returncode != 0
        assert '"node2" is revoked' in r.stderr and nodes.addrs()[1] in r.stderr, r.stderr
        assert '"node2" is revoked' in nodes.log(1), nodes.log(1)
        assert nodes.alive(0) and nodes.alive(1)

        # node1 learned the list from that coordinator. A coordinator holding the same key
        # but no list orders node2 before node1: node2's data link to node1 is refused by name.
        bare = tmp_path / "bare"
        bare.mkdir()
        shutil.copy(key, bare / "cluster.key")
        r = up(bare / "cluster.key", nodes, order=[nodes.addrs()[1], nodes.addrs()[0]], check=False)
        assert r.returncode != 0, r.stdout
        assert "revoked" in r.stderr, r.stderr
        assert 'refused connection' in nodes.log(0) and '"node2" is revoked' in nodes.log(0), nodes.log(0)
        assert nodes.alive(0) and nodes.alive(1)


def test_a_forged_node_key_is_refused_and_an_old_peer_is_told_to_upgrade(tmp_path):
    key = cluster(tmp_path, ["node1"])
    # The certificate renamed (same length): the cluster's signature no longer holds.
    text = (tmp_path / "node1.key").read_text()
    cert = next(line.split()[1] for line in text.splitlines() if line.startswith("node-cert "))
    forged = cert.replace(b"node1".hex(), b"node9".hex())
    assert forged != cert
    (tmp_path / "forged.key").write_text(text.replace(cert, forged))
    r = ringllm(["node", "--listen", "127.0.0.1:0", "--key", key, "--node-key", tmp_path / "forged.key"],
                check=False, timeout=30)
    assert r.returncode != 0 and "not signed by this cluster's key" in r.stderr, r.stderr
    # A node key of another cluster.
    other = tmp_path / "other.key"
    ringllm(["keygen", other])
    ringllm(["keygen", "--node", "node1", "--key", other, tmp_path / "alien.key"])
    r = ringllm(["node", "--listen", "127.0.0.1:0", "--key", key, "--node-key", tmp_path / "alien.key"],
                check=False, timeout=30)
    assert r.returncode != 0 and "issued for cluster" in r.stderr, r.stderr

    with Nodes(1, key=key, log_dir=tmp_path, extra_args=node_key_args(tmp_path)) as nodes:
        # A hello of protocol 3.1 (no node identities), with the right cluster id: a reject
        # that names the reason, then the connection closes.
        cluster_id = read_cluster_id(nodes, key)
        body = struct.pack("<HHQB", 3, 1, 1, 1) + cluster_id + bytes(32) + bytes([3]) + b"old"
        with socket.create_connection(("127.0.0.1", nodes.ports[0]), timeout=5) as s:
            s.sendall(b"RLHS" + bytes([1]) + struct.pack("<H", len(body)) + body)
            s.settimeout(5)
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
        assert reply[:5] == b"RLHS\x04", reply
        assert b"without node identities" in reply and b"same ringllm release" in reply, reply
        assert nodes.alive(0)


def read_cluster_id(nodes, key):
    """The cluster id the node printed at start ("cluster 0123abcd...")."""
    log = nodes.log(0)
    at = log.index("(cluster ") + len("(cluster ")
    return bytes.fromhex(log[at:at + 16])


def test_a_shared_key_cluster_without_node_keys_still_works(tmp_path):
    key = cluster(tmp_path, [])
    with Nodes(2, key=key, log_dir=tmp_path) as nodes:
        ok = up(key, nodes)
        assert len(json.loads(ok.stdout)["token_ids"]) > 0
        assert "refused" not in nodes.log(0) + nodes.log(1)
