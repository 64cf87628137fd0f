"""A spoofer of ringllm's mDNS announcements, for discovery tests: what any host on a LAN can
send without the cluster key (the cluster hash is public: every node announces it). It builds
DNS-SD responses by hand (PTR, SRV, TXT and A records, RFC 6762/6763) and multicasts them from
inside a test's network namespace; it can also hold a TCP port that accepts connections and
never says a word (a "tarpit"), so a probe there only ends at its deadline.

This module holds helpers only; tests import it (`from support.mdns_spoof import ...`)."""

import socket
import struct
import threading

from .netns import in_namespace

MDNS_GROUP = ("224.0.0.251", 5353)
SERVICE = ("_ringllm", "_tcp", "local")
TTL = 120
FLUSH = 0x8001  # class IN with the cache-flush bit: "this replaces what you had"


def _name(*labels) -> bytes:
    out = b""
    for label in labels:
        b = label if isinstance(label, bytes) else label.encode()
        assert 0 < len(b) < 64, label
        out += bytes([len(b)]) + b
    return out + b"\0"


def _rr(name: bytes, rtype: int, rclass: int, rdata: bytes, ttl=TTL) -> bytes:
    return name + struct.pack(">HHIH", rtype, rclass, ttl, len(rdata)) + rdata


def announcement(instance, host, ips, port, txt) -> bytes:
    """One unsolicited mDNS response announcing service `instance` (its DNS-SD instance name,
    e.g. "a1 7701") on `host`.local. at `ips` (IPv4, any, also 0.0.0.0 or multicast) and
    `port`, with TXT `txt` (a dict of str to bytes or str)."""
    inst = _name(instance, *SERVICE)
    target = _name(host, "local")
    pairs = []
    for k, v in txt.items():
        item = k.encode() + b"=" + (v if isinstance(v, bytes) else v.encode())
        assert len(item) < 256, item
        pairs.append(bytes([len(item)]) + item)
    records = [
        _rr(_name(*SERVICE), 12, 1, inst),
        _rr(inst, 33, FLUSH, struct.pack(">HHH", 0, 0, port) + target),
        _rr(inst, 16, FLUSH, b"".join(pairs)),
        *[_rr(target, 1, FLUSH, socket.inet_aton(ip)) for ip in ips],
    ]
    return struct.pack(">HHHHHH", 0, 0x8400, 0, len(records), 0, 0) + b"".join(records)


def node_txt(name, cluster, **extra):
    """The TXT properties a ringllm node announces (see coordinator/src/cluster/discovery.rs)."""
    txt = {"name": name, "cluster": cluster, "threads": "1", "memory": str(1 << 30), "backend": "scalar",
           "transport": "tcp", "version": "0.1.0", "proto": "1"}
    txt.update(extra)
    return txt


class Spoofer:
    """`with Spoofer(net, "evil", packets):` multicasts every packet of `packets` from host
    `evil`'s eth0 every `interval` seconds until the block ends. With `tarpit_port`, also
    listens on that TCP port of the host and never accepts: connections complete (the kernel
    answers the SYN) and then hear nothing."""

    def __init__(self, net, host, packets, interval=0.25, tarpit_port=None):
        self.net, self.host, self.packets, self.interval = net, host, list(packets), interval
        self.tarpit_port = tarpit_port
        self.sent = 0
        self._stop = threading.Event()
        self._socks = []
        self._thread = None

    def __enter__(self):
        addr = self.net.addr(self.host)

        def make():
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
            u.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            u.bind(("0.0.0.0", 5353))
            u.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(addr))
            u.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)
            socks = [u]
            if self.tarpit_port:
                t = socket.socket()
                t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                t.bind((addr, self.tarpit_port))
                t.listen(1024)
                socks.append(t)
            return socks

        self._socks = in_namespace(self.net.name(self.host), make)
        self._thread = threading.Thread(target=self._run, name="mdns-spoofer", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        u = self._socks[0]
        while not self._stop.is_set():
            for p in self.packets:
                try:
                    u.sendto(p, MDNS_GROUP)
                    self.sent += 1
                except OSError:
                    pass  # a full socket buffer: the next round sends it again
            self._stop.wait(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for s in self._socks:
            s.close()
        return False
