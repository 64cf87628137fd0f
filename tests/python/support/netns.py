"""Linux network namespaces for multi-host tests: one namespace per host on a shared bridge.

Layout of `Netns(["coord", "host1", "host2"])`:

    coord ns            host1 ns            host2 ns
    eth0 10.77.0.1/24   eth0 10.77.0.2/24   eth0 10.77.0.3/24
       |                   |                   |
       p0 ---------------- p1 ---------------- p2   br0 in the switch ns

The veth pairs are created inside the switch namespace with their host ends moved straight
into the host namespaces, so no interface ever appears in the root namespace and interface
names cannot collide with other runs. Namespace names carry our PID, so `stale_cleanup` can
remove what a killed run left behind. Everything here needs root (see `netns_available`).

This module holds helpers only; tests import it (`from support.netns import Netns, ...`).
"""

import atexit
import ctypes
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

# /run/netns/NAME: far below NAME_MAX, short enough to read in `ip netns list`.
_NS_NAME_MAX = 40
_HOST_RE = re.compile(r"^[A-Za-z0-9_]+$")
_instances = itertools.count()
_CLONE_NEWNET = 0x40000000


def _ns_name(prefix, pid, k, suffix):
    return f"{prefix}{pid}x{k}{suffix}"[:_NS_NAME_MAX]


def _stale_re(prefix):
    # The switch namespace ends in ".sw", hosts in "-NAME"; both start with PREFIX PID x K.
    return re.compile(rf"^{re.escape(prefix)}(\d+)x(\d+)[-.]")


def _ip(args, input=None):
    """Runs `ip ARGS...` (with `-batch -` when `input` is given); raises with ip's stderr."""
    r = subprocess.run(["ip", *args], input=input, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        what = " ".join(args) + (f" <<{input!r}" if input else "")
        raise RuntimeError(f"ip {what} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def _ns_inode(name):
    """(st_dev, st_ino) of a named namespace, or None if it is gone."""
    try:
        st = os.stat(f"/run/netns/{name}")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _pids_in(inodes):
    """PIDs of every process whose network namespace is one of `inodes` (scans /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in inodes:
            found.append(int(entry))
    return found


def _kill_all_in(names):
    """SIGKILLs every process still inside the named namespaces; waits until they are gone."""
    inodes = {i for i in map(_ns_inode, names) if i is not None}
    if not inodes:
        return
    deadline = time.monotonic() + 5.0
    while True:
        pids = [p for p in _pids_in(inodes) if p != os.getpid()]
        if not pids or time.monotonic() > deadline:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _delete_namespaces(names):
    """Deletes namespaces (all attempted even if one fails); deleting one removes its veths."""
    names = [n for n in names if _ns_inode(n) is not None]
    if names:
        subprocess.run(["ip", "-force", "-batch", "-"], input="".join(f"netns del {n}\n" for n in names),
                       capture_output=True, text=True, timeout=30)


_libc = None


def _setns(fd):
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def in_namespace(ns_name, fn):
    """Calls `fn()` in a fresh thread that has joined network namespace `ns_name`; returns its
    result or raises its exception. Sockets made inside keep working from any thread afterwards.
    The calling thread never changes namespace (setns acts on one thread only)."""
    result = {}

    def body():
        try:
            fd = os.open(f"/run/netns/{ns_name}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            result["value"] = fn()
        except BaseException as e:  # handed to the caller below
            result["error"] = e

    t = threading.Thread(target=body, name=f"netns-{ns_name}", daemon=True)
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


class Netns:
    """Context manager: `with Netns(["coord", "host1", "host2"]) as net:` creates one network
    namespace per host plus one 'switch' namespace holding a Linux bridge; each host gets a veth
    pair with one end in its namespace (named eth0, address {subnet}.{i+1}/24 in list order, so
    coord=10.77.0.1, host1=10.77.0.2, host2=10.77.0.3) and the other end on the bridge; lo is up
    everywhere. Namespace names are unique per process and instance (rl{pid}x{k}-{host}, the
    switch rl{pid}x{k}.sw). On exit (also on exceptions and KeyboardInterrupt) it kills every
    process it started, then any other process left inside its namespaces, and deletes every
    namespace it created (deleting a namespace removes its veths).

    Impaired wire: with `delay_ms` > 0 or `loss` > 0 the bridge is replaced by a user-space L2
    switch in the switch namespace (support/wire.py, one AF_PACKET socket per port) that
    forwards each frame `delay_ms` after it arrived (so a round trip between two hosts grows by
    2 * delay_ms) and drops IP frames with probability `loss`; `wire_stats()` returns its
    counters. Offloads (checksum, TSO/GSO/GRO) are then off on every veth, as with
    `offload=False`, so every packet on the wire is at most one MTU (and a packet-level firewall
    rule sees real packets)."""

    def __init__(self, hosts, subnet="10.77.0", prefix="rl", delay_ms=0.0, loss=0.0, offload=True):
        hosts = list(hosts)
        if not hosts:
            raise ValueError("Netns needs at least one host")
        if len(hosts) > 253:
            raise ValueError(f"{len(hosts)} hosts do not fit in {subnet}.0/24")
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"duplicate host names in {hosts}")
        for h in hosts:
            if not _HOST_RE.match(h):
                raise ValueError(f"host name {h!r} must match {_HOST_RE.pattern}")
        if not re.match(r"^\d{1,3}\.\d{1,3}\.\d{1,3}$", subnet):
            raise ValueError(f"subnet {subnet!r} must be three octets, e.g. 10.77.0")
        k = next(_instances)
        pid = os.getpid()
        self.hosts = hosts
        self.subnet = subnet
        self.switch = _ns_name(prefix, pid, k, ".sw")
        self.ns = {h: _ns_name(prefix, pid, k, f"-{h}") for h in hosts}
        if len(set(self.ns.values()) | {self.switch}) != len(hosts) + 1:
            raise ValueError(f"host names {hosts} collide once cut to {_NS_NAME_MAX} characters")
        self._addr = {h: f"{subnet}.{i + 1}" for i, h in enumerate(hosts)}
        self._procs = []
        self._created = []
        self._closed = False
        if delay_ms < 0 or not 0.0 <= loss < 1.0:
            raise ValueError(f"need delay_ms >= 0 and 0 <= loss < 1 (got {delay_ms}, {loss})")
        self.delay_ms = float(delay_ms)
        self.loss = float(loss)
        self._switched = self.delay_ms > 0 or self.loss > 0
        self.offload = offload and not self._switched
        self._switch_proc = None

    # -- life cycle ----------------------------------------------------------------------

    def __enter__(self):
        atexit.register(self.close)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _setup(self):
        names = [self.switch, *self.ns.values()]
        # Recorded before creation: close() deletes whichever of them exist.
        self._created = names
        _ip(["-batch", "-"], input="".join(f"netns add {n}\n" for n in names))
        sw = ["link set lo up"]
        if not self._switched:
            sw += ["link add br0 type bridge", "link set br0 up"]
        for i, h in enumerate(self.hosts):
            sw += [f"link add p{i} type veth peer name eth0 netns {self.ns[h]}"]
            sw += [f"link set p{i} master br0"] if not self._switched else [f"link set p{i} promisc on"]
            sw += [f"link set p{i} up"]
        _ip(["-n", self.switch, "-batch", "-"], input="".join(c + "\n" for c in sw))
        for h in self.hosts:
            cmds = ["link set lo up", f"addr add {self._addr[h]}/24 dev eth0", "link set eth0 up"]
            _ip(["-n", self.ns[h], "-batch", "-"], input="".join(c + "\n" for c in cmds))
        if not self.offload:
            from . import wire
            for i, h in enumerate(self.hosts):
                wire.set_offloads(self.ns[h], "eth0", False)
                wire.set_offloads(self.switch, f"p{i}", False)
        if self._switched:
            self._start_switch()

    def _start_switch(self):
        import select as _select
        import sys
        wire_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wire.py")
        argv = ["ip", "netns", "exec", self.switch, sys.executable, wire_py, "switch",
                *[f"p{i}" for i in range(len(self.hosts))], "--delay-ms", str(self.delay_ms), "--loss", str(self.loss)]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._procs.append(p)
        self._switch_proc = p
        ready, _, _ = _select.select([p.stdout], [], [], 20)
        line = p.stdout.readline() if ready else ""
        if line.strip() != "ready":
            p.kill()
            raise RuntimeError(f"the wire switch did not start: {line!r} {p.stderr.read() if p.poll() is not None else ''}")

    def wire_stats(self, timeout=5.0) -> dict:
        """Counters of the user-space switch (frames received, forwarded, dropped, the largest
        frame in bytes, send errors, oversize frames); only with delay_ms or loss."""
        import select as _select
        p = self._switch_proc
        if p is None:
            raise RuntimeError("no user-space switch: this Netns has neither delay_ms nor loss")
        if p.poll() is not None:
            raise RuntimeError(f"the wire switch exited ({p.returncode}): {p.stderr.read()}")
        p.send_signal(signal.SIGUSR1)
        ready, _, _ = _select.select([p.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("the wire switch did not report its counters")
        return json.loads(p.stdout.readline())

    def close(self):
        """Kills our processes and deletes our namespaces; safe to call twice. Keeps going when
        interrupted (a second Ctrl-C during cleanup would otherwise leak namespaces)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        old = None
        if threading.current_thread() is threading.main_thread():
            old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self._stop_procs()
            _kill_all_in(self._created)
            _delete_namespaces(self._created)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)

    def _stop_procs(self):
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in live:
            # Also the process group: a process may have left children behind after exiting.
            _signal_group(p, signal.SIGKILL)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    # -- queries and actions -------------------------------------------------------------

    def addr(self, host) -> str:
        """The host's eth0 address, e.g. '10.77.0.2'."""
        return self._addr[self._known(host)]

    def name(self, host) -> str:
        """The namespace name of `host` (for `ip netns exec` in hand-written commands)."""
        return self.ns[self._known(host)]

    def popen(self, host, argv, **kw) -> subprocess.Popen:
        """Starts `ip netns exec NS argv...` (ip execs argv, so the Popen pid is the program's)
        in a new session, so cleanup can signal the program's whole process group."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[self._known(host)], *map(str, argv)], **kw)
        self._procs.append(p)
        return p

    def popen_net_only(self, host, argv, **kw) -> subprocess.Popen:
        """As `popen`, but through `nsenter --net`: only the network namespace changes.
        `ip netns exec` also remounts /sys in a mount namespace of its own, which hides the
        cgroup hierarchy (a node under a memory cap could not read its limit)."""
        kw.setdefault("start_new_session", True)
        ns = f"/run/netns/{self.ns[self._known(host)]}"
        p = subprocess.Popen(["nsenter", f"--net={ns}", "--", *map(str, argv)], **kw)
        self._procs.append(p)
        return p

    def run(self, host, argv, **kw) -> subprocess.CompletedProcess:
        """Runs argv inside the host's namespace: check=False, capture_output=True, text=True,
        timeout=120 unless given (on timeout subprocess kills the child and raises)."""
        kw.setdefault("check", False)
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 120)
        return subprocess.run(["ip", "netns", "exec", self.ns[self._known(host)], *map(str, argv)], **kw)

    def connect(self, host, ip, port, timeout=5.0) -> socket.socket:
        """A TCP connection to ip:port made from inside `host`'s namespace (usable from here)."""
        ns = self.ns[self._known(host)]
        return in_namespace(ns, lambda: socket.create_connection((ip, port), timeout=timeout))

    def link_down(self, host):
        """Sets the host's eth0 down (a pulled cable): its packets go nowhere, nothing reaches it."""
        _ip(["-n", self.ns[self._known(host)], "link", "set", "eth0", "down"])

    def link_up(self, host):
        """Brings the host's eth0 back up (address and subnet route return with it)."""
        _ip(["-n", self.ns[self._known(host)], "link", "set", "eth0", "up"])

    def _known(self, host):
        if host not in self.ns:
            raise KeyError(f"unknown host {host!r}; hosts are {self.hosts}")
        return host


def _signal_group(p, sig):
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


def netns_available() -> tuple[bool, str]:
    """(True, "") if we are root and `ip netns add` works (a probe namespace is created and
    deleted); else (False, reason) — for `pytest.skip`."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    probe = f"rlprobe{os.getpid()}x{next(_instances)}"
    try:
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return False, "the `ip` command (iproute2) is not installed"
    except subprocess.TimeoutExpired:
        return False, "`ip netns add` timed out"
    if r.returncode != 0:
        return False, f"`ip netns add` failed: {r.stderr.strip()}"
    d = subprocess.run(["ip", "netns", "del", probe], capture_output=True, text=True, timeout=30)
    if d.returncode != 0:
        return False, f"`ip netns del {probe}` failed: {d.stderr.strip()}"
    return True, ""


def wait_port(netns, host, ip, port, timeout=10.0):
    """Polls until a TCP connect from inside `host`'s namespace to ip:port succeeds; raises
    TimeoutError naming host, ip and port (and the last connect error) otherwise."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        left = deadline - time.monotonic()
        try:
            netns.connect(host, ip, port, timeout=max(0.05, min(1.0, left))).close()
            return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{host}: nothing accepts TCP on {ip}:{port} after {timeout}s (last error: {last})")
        time.sleep(0.05)


def stale_cleanup(prefix="rl"):
    """Deletes namespaces this harness left behind in an earlier run that crashed: names
    `{prefix}{pid}x{k}...` whose PID no longer exists. Processes still inside them are killed
    first. Returns the names deleted."""
    try:
        out = _ip(["netns", "list"])
    except (RuntimeError, FileNotFoundError):
        return []
    pat = _stale_re(prefix)
    stale = []
    for line in out.splitlines():
        name = line.split(" ", 1)[0].strip()  # lines look like "NAME (id: 3)"
        m = pat.match(name)
        if m and not _pid_alive(int(m.group(1))):
            stale.append(name)
    if stale:
        _kill_all_in(stale)
        _delete_namespaces(stale)
    return stale


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
