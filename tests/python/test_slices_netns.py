"""A model bigger than any one node (issue 13 parts 2 and 4): a llama3-1b-shaped model (8 of
its 16 layers, so CI stays small) across three network-namespace hosts, each node in a cgroup
memory group whose cap forces a three-way split; none of the hosts has the model file.

- the coordinator sends every node its slice; output bit-identical to the single process;
  the slices are cached, and the next start sends nothing;
- a byte flipped in a cached slice is refused (that tensor alone is sent again);
- a transfer cut mid-way (the host's cable pulled) resumes once it is back, re-sending at most
  the tensor that was arriving;
- no node is OOM-killed at any point.

The namespaces, groups and caches are made and removed by the test. Needs root."""

import contextlib
import json
import re
import subprocess
import threading
import time

import pytest

from support.cgroup import MIB, MemoryCap
from support.netns import Netns, netns_available, wait_port
from support.paths import KEY, ringllm_bin

pytestmark = [pytest.mark.netns, pytest.mark.root]

HOSTS = ("host1", "host2", "host3")
PORT = 7701
# 8 layers of 35 MiB (Q4_K / Q6_K), a tied head of 52 MiB on the coordinator. At context 256
# and batches of 512 a node needs 66 MiB of scratch; under a 250 MiB cap (48 MiB headroom, ~8
# MiB of process) three layers fit and four do not, so two nodes cannot hold eight layers.
CAP = 250 * MIB
GEN = ["--temp", "0", "-n", "8", "--threads", "1", "-c", "256"]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "llama3-1b-8l.gguf"
    r = subprocess.run([str(ringllm_bin()), "debug", "synth", "--shape", "llama3-1b", "--layers", "8",
                        "--vocab", "32000", "-o", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return path


@pytest.fixture(scope="module")
def net():
    ok, why = netns_available()
    if not ok:
        pytest.fail(f"network namespaces are needed for this test and unavailable: {why}")
    with Netns(["coord", *HOSTS]) as n:
        yield n


class Cluster:
    """Three capped nodes, one per host, with empty model directories and their own caches."""

    def __init__(self, net, tmp):
        self.net, self.tmp = net, tmp
        self.caps = [MemoryCap(h, CAP) for h in HOSTS]
        self.procs = {}
        self.logs = {}

    def cache(self, host):
        return self.tmp / f"cache-{host}"

    def start(self, host):
        i = HOSTS.index(host)
        (self.tmp / "empty").mkdir(exist_ok=True)
        log = open(self.tmp / f"{host}.log", "a")
        self.logs[host] = log
        self.procs[host] = self.net.popen_net_only(
            host, [str(ringllm_bin()), "-v", "node", "--listen", f"{self.net.addr(host)}:{PORT}", "--key", str(KEY),
                   "--models", str(self.tmp / "empty"), "--cache", str(self.cache(host)), "--name", host,
                   "--threads", "1"],
            stdout=subprocess.DEVNULL, stderr=log, text=True, preexec_fn=self.caps[i].preexec())

    def log(self, host):
        self.logs[host].flush()
        return (self.tmp / f"{host}.log").read_text()

    def __enter__(self):
        # Should a start fail, what was made so far (groups, processes) goes at once.
        with contextlib.ExitStack() as stack:
            for c in self.caps:
                stack.enter_context(c)
            stack.callback(self.stop)
            for h in HOSTS:
                self.start(h)
            for h in HOSTS:
                wait_port(self.net, "coord", self.net.addr(h), PORT, timeout=20)
            self._stack = stack.pop_all()
        return self

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)

    def __exit__(self, *exc):
        self._stack.__exit__(*exc)

    def node_flags(self):
        return [a for h in HOSTS for a in ("--node", f"{self.net.addr(h)}:{PORT}")]

    def up(self, model, tmp_name, *extra, timeout=300):
        r = self.net.run("coord", [str(ringllm_bin()), "up", "-m", str(model), "--key", str(KEY), *self.node_flags(),
                                   "-p", PROMPT, *GEN, "--json", "--logits-out", str(self.tmp / tmp_name), *extra],
                         timeout=timeout)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout), (self.tmp / tmp_name).read_bytes(), r.stderr

    def no_oom(self):
        for h, c in zip(HOSTS, self.caps):
            assert c.oom_kills() == 0, f"{h} was OOM-killed"
            assert self.procs[h].poll() is None, f"{h} exited:\n{self.log(h)}"


def slices_in(cache):
    return sorted(cache.rglob("*.gguf"))


def single(model, tmp):
    r = subprocess.run([str(ringllm_bin()), "run", "-m", str(model), "-p", PROMPT, *GEN, "--json", "--logits-out",
                        str(tmp / "single.f32")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), (tmp / "single.f32").read_bytes()


@pytest.mark.slow
def test_slices_are_sent_cached_reused_and_a_flipped_byte_is_refused(net, model, tmp_path):
    want, want_logits = single(model, tmp_path)
    with Cluster(net, tmp_path) as c:
        got, logits, err = c.up(model, "first.f32")
        assert got["token_ids"] == want["token_ids"] and logits == want_logits, err
        # Three stages of consecutive layers: the caps force the three-way split. The planner
        # saw each cap (its budget is below it) and every stage's need fits its budget.
        layers = re.findall(r"layers\s+(\d+)-(\d+)\s+weights", err)
        assert len(layers) == 3, err
        rows = re.findall(r"^(host\d)\s+\S+\s+(\d+)-(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)",
                          err, re.M)
        assert len(rows) == 3, err
        for host, a, b, w, kv, scratch, budget in rows:
            assert float(budget) < CAP / MIB and float(w) + float(kv) + float(scratch) <= float(budget), err
            assert int(b) - int(a) + 1 <= 3, err
        for h in HOSTS:
            assert f"{h}: sent layers" in err, err
            assert len(slices_in(c.cache(h))) == 1, list(c.cache(h).rglob("*"))
            assert "every piece checked" in c.log(h)
        c.no_oom()

        # Second start: every slice comes from the caches.
        got, logits, err = c.up(model, "second.f32")
        assert got["token_ids"] == want["token_ids"] and logits == want_logits
        assert "sent layers" not in err and err.count("cached (") == 3, err

        # A flipped byte in host2's cached slice: refused, that tensor alone sent again.
        f = slices_in(c.cache("host2"))[0]
        b = bytearray(f.read_bytes())
        b[len(b) * 2 // 3] ^= 0x10
        f.write_bytes(b)
        got, logits, err = c.up(model, "third.f32")
        assert got["token_ids"] == want["token_ids"] and logits == want_logits
        assert "host2: resuming" in err and "(1 piece(s)) to send" in err, err
        assert "host2: sent layers" in err and "host1: sent" not in err and "host3: sent" not in err, err
        assert "do not match their hash" in c.log("host2")
        c.no_oom()


@pytest.mark.slow
def test_a_cut_transfer_resumes_re_sending_at_most_one_tensor(net, model, tmp_path):
    want, want_logits = single(model, tmp_path)
    # host2's side of the switch at 100 Mbit/s: its 103 MiB slice takes ~9 s, long enough to
    # pull the cable mid-way.
    sw = net.switch
    port = f"p{1 + HOSTS.index('host2')}"
    subprocess.run(["tc", "-n", sw, "qdisc", "add", "dev", port, "root", "tbf", "rate", "100mbit",
                    "burst", "64kb", "latency", "100ms"], check=True)
    try:
        with Cluster(net, tmp_path) as c:
            part = None
            result = {}

            def run_up():
                result["r"] = net.run("coord", [str(ringllm_bin()), "up", "-m", str(model), "--key", str(KEY),
                                                *c.node_flags(), "-p", PROMPT, *GEN, "--json", "--logits-out",
                                                str(tmp_path / "ring.f32"), "--wait", "60"], timeout=300)

            t = threading.Thread(target=run_up)
            t.start()
            # Pull the cable once a quarter of host2's slice has reached its disk (the part
            # file is sparse: its allocated blocks are what arrived).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                parts = list(c.cache("host2").rglob("*.part"))
                if parts and parts[0].stat().st_blocks * 512 > 25 * MIB:
                    part = parts[0]
                    break
                time.sleep(0.1)
            assert part is not None, c.log("host2")
            net.link_down("host2")
            time.sleep(12)  # past the coordinator's 10 s stall limit and the node's 5 s
            net.link_up("host2")
            t.join(timeout=240)
            r = result["r"]
            assert r.returncode == 0, r.stderr
            got = json.loads(r.stdout)
            assert got["token_ids"] == want["token_ids"]
            assert (tmp_path / "ring.f32").read_bytes() == want_logits
            err, log = r.stderr, c.log("host2")
            assert "stalled" in err or "during its slice transfer" in err, err
            cut = re.search(r"transfer cut after (\d+) of (\d+) bytes", log)
            assert cut, log
            received = int(cut.group(1))
            resumed = re.search(r"host2: resuming: ([\d.]+) MiB of the slice cached and checked", err)
            assert resumed, err
            kept = float(resumed.group(1)) * MIB
            # What arrived but was not kept: the piece that was arriving when the cable went
            # (the header piece aside, at most one tensor; the largest here is 35 MiB / 3).
            largest = max_tensor_bytes(model)
            assert 0 < received and received - kept <= largest + 0.1 * MIB, (received, kept, largest)
            c.no_oom()
    finally:
        subprocess.run(["tc", "-n", sw, "qdisc", "del", "dev", port, "root"], check=False)


def max_tensor_bytes(model):
    import gguf
    r = gguf.GGUFReader(str(model))
    return max(int(t.n_bytes) for t in r.tensors)
