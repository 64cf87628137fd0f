"""Impaired links for the namespace tests: delay and loss on the wire, packet loss at a host,
and measuring the round trip time between namespaces. This kernel has no netem (and no fq for
EDT pacing), so delay comes from a user-space L2 switch instead of the kernel bridge.

The switch (`python3 support/wire.py switch ...`, started by `Netns(hosts, delay_ms=D, loss=P)`
in its switch namespace) opens one AF_PACKET socket per switch-side veth end (p0, p1, ...), learns
source MAC addresses, and sends every frame it receives out of the port that leads to its
destination (all other ports for broadcast, multicast and unknown destinations) D ms after it
arrived; with probability P it drops an IP frame instead (ARP is never dropped, so neighbour
resolution stays prompt). Frames keep their order. Segmentation and checksum offloads are off
on both ends of every veth (`set_offloads`), so each frame the switch sees is a real wire frame
(<= MTU) with its checksums filled in; `Netns.wire_stats()` reports the largest frame seen.

Loss at a host is an iptables rule in the host's namespace (`drop_incoming`): the `statistic`
match drops incoming packets on eth0 at random; `drop_counts` reads the rule's counters.

This module holds helpers only; tests import it (`from support import wire`). Run as a script
it is the switch process.
"""

import collections
import json
import random
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
# Offloads that would let frames bigger than the MTU, or frames with checksums left for the
# hardware to fill in, cross a veth. Features a kernel does not know are skipped.
OFFLOADS = ["tx", "sg", "tso", "gso", "gro", "tx-udp-segmentation", "rx-gro-list", "rx-udp-gro-forwarding"]
_LOSS_COMMENT = "ringllm-test-loss"


# -- host-side helpers ------------------------------------------------------------------------

def set_offloads(ns, dev, on):
    """Turns the segmentation/checksum offloads of `dev` in namespace `ns` on or off (ethtool)."""
    state = "on" if on else "off"
    for feature in OFFLOADS:
        # One feature per call: ethtool refuses the whole list when one is fixed or unknown.
        subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-K", dev, feature, state],
                       capture_output=True, text=True, timeout=30)
    r = subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-k", dev], capture_output=True, text=True,
                       timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ethtool -k {dev} in {ns} failed: {r.stderr.strip()}")
    if not on:
        feats = dict(re.findall(r"^\s*([\w-]+):\s+(on|off)", r.stdout, re.M))
        still = [f for f in ("tx-checksumming", "tcp-segmentation-offload", "generic-segmentation-offload",
                             "generic-receive-offload") if feats.get(f) == "on"]
        if still:
            raise RuntimeError(f"{dev} in {ns}: could not turn off {still}")


def _iptables(ns, args):
    r = subprocess.run(["ip", "netns", "exec", ns, "iptables", "-w", *args], capture_output=True, text=True,
                       timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"iptables {' '.join(args)} in {ns} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def drop_incoming(net, host, probability, spare_handshakes=False):
    """Drops packets arriving on `host`'s eth0 at random with `probability` (an iptables
    `statistic` rule at the top of INPUT, replacing any earlier one from here) and zeroes its
    counters. Every IP packet counts: TCP, UDP, QUIC, in both directions of each exchange when
    both ends have a rule. With `spare_handshakes`, TCP packets with SYN set (SYN, SYN-ACK) are
    never dropped: a lost one costs the connect 1 s, two 3 s (the kernel's SYN retransmits)."""
    clear_loss(net, host)
    ns = net.name(host)
    rules = []
    if spare_handshakes:
        rules.append(["-p", "tcp", "--tcp-flags", "SYN", "SYN", "-m", "comment", "--comment",
                      _LOSS_COMMENT + "-spared", "-j", "ACCEPT"])
    rules.append(["-m", "statistic", "--mode", "random", "--probability", f"{probability:.6f}",
                  "-m", "comment", "--comment", _LOSS_COMMENT, "-j", "DROP"])
    # A counting rule (no target) after them: the packets that got through.
    rules.append(["-m", "comment", "--comment", _LOSS_COMMENT + "-pass"])
    for k, rule in enumerate(rules):
        _iptables(ns, ["-I", "INPUT", str(k + 1), "-i", "eth0", *rule])


def drop_counts(net, host):
    """(dropped, passed) packet counts of the rules `drop_incoming` put in `host`'s INPUT
    (spared handshake packets count as passed)."""
    out = _iptables(net.name(host), ["-nvxL", "INPUT"])
    counts = {}
    for line in out.splitlines():
        cols = line.split()
        if not cols or not cols[0].isdigit():
            continue
        for tag in ("", "-pass", "-spared"):
            if f"/* {_LOSS_COMMENT}{tag} */" in line:
                counts[tag] = int(cols[0])
    if "" not in counts or "-pass" not in counts:
        raise RuntimeError(f"{host}: no loss rule in INPUT:\n{out}")
    return counts[""], counts["-pass"] + counts.get("-spared", 0)


def drop_syns(net, host, src_ip, port, count, skip=1):
    """Drops, at `host`, TCP SYNs from src_ip to `port`: after letting `skip` through, the next
    `count` (the first connection gets through, the second then waits 1 s for one drop, 3 s for
    two: the kernel's SYN retransmits). `clear_loss` removes these rules too."""
    # iptables `nth` counts the packets that reach the rule: each rule drops one SYN, the ones
    # after it see the SYNs it let through.
    for _ in range(count):
        _iptables(net.name(host), ["-A", "INPUT", "-i", "eth0", "-p", "tcp", "--syn", "-s", src_ip, "--dport",
                                   str(port), "-m", "statistic", "--mode", "nth", "--every", "1000000",
                                   "--packet", str(skip), "-m", "comment", "--comment", _LOSS_COMMENT + "-syn",
                                   "-j", "DROP"])


def syn_drops(net, host):
    """How many SYNs the `drop_syns` rules of `host` dropped."""
    out = _iptables(net.name(host), ["-nvxL", "INPUT"])
    return sum(int(l.split()[0]) for l in out.splitlines() if f"/* {_LOSS_COMMENT}-syn */" in l)


def clear_loss(net, host):
    """Removes the rules `drop_incoming` added (if any) from `host`'s INPUT chain."""
    out = _iptables(net.name(host), ["-S", "INPUT"])
    for line in out.splitlines():
        if _LOSS_COMMENT in line and line.startswith("-A "):
            _iptables(net.name(host), ["-D", *_split_rule(line[3:])])


def _split_rule(spec):
    # `iptables -S` quotes nothing in our rules (the comments have no spaces).
    return spec.split()


def tcp_rtt(net, src, dst_ip, port=9, samples=21):
    """Median time (seconds) of a TCP connect from `src`'s namespace to a closed port on dst_ip:
    the SYN goes out and the RST comes back, one round trip. Warms up the neighbour cache first."""
    from .netns import in_namespace

    def once():
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(5)
        t0 = time.perf_counter()
        try:
            s.connect((dst_ip, port))
        except ConnectionRefusedError:
            pass
        else:
            raise RuntimeError(f"{dst_ip}:{port} accepted; tcp_rtt wants a closed port")
        finally:
            s.close()
        return time.perf_counter() - t0

    def body():
        for _ in range(3):
            once()
        return [once() for _ in range(samples)]

    return statistics.median(in_namespace(net.name(src), body))


# -- the switch process -----------------------------------------------------------------------

class _Switch:
    def __init__(self, ports, delay_s, loss, seed):
        self.delay = delay_s
        self.loss = loss
        self.rng = random.Random(seed)
        self.socks = []
        for name in ports:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            s.bind((name, 0))
            s.setblocking(False)
            self.socks.append(s)
        self.ports = list(ports)
        self.fd_port = {s.fileno(): i for i, s in enumerate(self.socks)}
        self.mac = {}
        self.queue = collections.deque()  # (due, out port, frame), due times ascending
        self.stats = {"frames": 0, "forwarded": 0, "dropped": 0, "max_frame": 0, "send_errors": 0,
                      "oversize": 0}

    def _receive(self, i, now):
        s = self.socks[i]
        while True:
            try:
                frame, addr = s.recvfrom(65536)
            except BlockingIOError:
                return
            if addr[2] == PACKET_OUTGOING:  # our own sends, seen by the tap on the way out
                continue
            st = self.stats
            st["frames"] += 1
            st["max_frame"] = max(st["max_frame"], len(frame))
            if len(frame) < 14:
                continue
            src, dst, ethertype = frame[6:12], frame[0:6], frame[12:14]
            if not src[0] & 1:
                self.mac[src] = i
            if self.loss and ethertype in (b"\x08\x00", b"\x86\xdd") and self.rng.random() < self.loss:
                st["dropped"] += 1
                continue
            out = self.mac.get(dst) if not dst[0] & 1 else None
            targets = [out] if out is not None else [j for j in range(len(self.socks)) if j != i]
            due = now + self.delay
            for j in targets:
                if j != i:
                    self.queue.append((due, j, frame))

    def _send(self, j, frame):
        try:
            self.socks[j].send(frame)
            self.stats["forwarded"] += 1
        except OSError as e:
            self.stats["send_errors"] += 1
            if e.errno == 90:  # EMSGSIZE: a frame above the MTU (an offload left on)
                self.stats["oversize"] += 1

    def run(self):
        # Reports from the handler: it runs in the main thread between two bytecodes, and an idle
        # switch sits in select, which Python resumes after a handler without looping here.
        signal.signal(signal.SIGUSR1, lambda *_: print(json.dumps(self.stats), flush=True))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print("ready", flush=True)
        fds = list(self.fd_port)
        while True:
            now = time.monotonic()
            while self.queue and self.queue[0][0] <= now:
                _, j, frame = self.queue.popleft()
                self._send(j, frame)
            timeout = None if not self.queue else max(0.0, self.queue[0][0] - now)
            try:
                ready, _, _ = select.select(fds, [], [], timeout)
            except InterruptedError:
                continue
            now = time.monotonic()
            for fd in ready:
                self._receive(self.fd_port[fd], now)


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="wire.py switch", description="L2 switch with delay and loss")
    ap.add_argument("mode", choices=["switch"])
    ap.add_argument("ports", nargs="+", help="interfaces to switch between (e.g. p0 p1 p2)")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to every frame")
    ap.add_argument("--loss", type=float, default=0.0, help="probability of dropping an IP frame")
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    if not 0.0 <= a.loss < 1.0 or a.delay_ms < 0:
        ap.error("need 0 <= loss < 1 and delay >= 0")
    _Switch(a.ports, a.delay_ms / 1000.0, a.loss, a.seed).run()


if __name__ == "__main__":
    main(sys.argv[1:])
