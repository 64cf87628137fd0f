"""Real `ringllm node` processes on loopback for ring tests (`Nodes`), free ports, waiting for
a port to listen."""

import os
import pathlib
import signal
import socket
import shutil
import subprocess
import tempfile
import time

from .paths import KEY, MODELS, ringllm_bin


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(host, port, proc=None, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"node on {host}:{port} exited early ({proc.returncode}):\n{proc.stderr.read()}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return time.monotonic()
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


class Nodes:
    """Starts `ringllm node` processes on loopback; kills them on exit."""

    def __init__(self, count, key=KEY, threads=1, models=MODELS, log_dir=None, transport="tcp",
                 extra_args=None, preexec=None, env=None):
        """`extra_args(i)`: more flags for node i; `preexec(i)`: a preexec_fn for node i (e.g. to
        enter a cgroup); `env(i)`: more environment variables for node i."""
        self.env = env or (lambda i: {})
        self.transport = transport
        self.extra_args = extra_args or (lambda i: [])
        self.preexec = preexec or (lambda i: None)
        self.procs = []
        self.ports = []
        self.names = []
        self.logs = []
        self.count = count
        self.key = key
        self.threads = threads
        self.models = models
        self.log_dir = pathlib.Path(log_dir) if log_dir else None
        # Slices the coordinator sends land here, never in the user's ~/.cache.
        self.cache = pathlib.Path(tempfile.mkdtemp(prefix="ringllm-test-slices-"))

    def start_one(self, i, port=None):
        port = port or free_port()
        name = f"node{i + 1}"
        log = open(self.log_dir / f"{name}.log", "w+") if self.log_dir else subprocess.DEVNULL
        p = subprocess.Popen(
            [str(ringllm_bin()), "-v", "node", "--listen", f"127.0.0.1:{port}", "--key", str(self.key),
             "--models", str(self.models), "--name", name, "--threads", str(self.threads),
             "--transport", self.transport, "--cache", str(self.cache / name), *map(str, self.extra_args(i))],
            stdout=subprocess.DEVNULL, stderr=log, text=True, preexec_fn=self.preexec(i),
            env={**os.environ, **self.env(i)})
        wait_port("127.0.0.1", port, timeout=15)
        time.sleep(0.05)
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited at start ({p.returncode}); is port {port} taken by another process?")
        return p, port, name, log

    def __enter__(self):
        for i in range(self.count):
            p, port, name, log = self.start_one(i)
            self.procs.append(p)
            self.ports.append(port)
            self.names.append(name)
            self.logs.append(log)
        return self

    def addrs(self):
        return [f"127.0.0.1:{p}" for p in self.ports]

    def node_flags(self):
        out = []
        for a in self.addrs():
            out += ["--node", a]
        return out

    def log(self, i):
        f = self.logs[i]
        if f is subprocess.DEVNULL:
            return ""
        f.flush()
        return pathlib.Path(f.name).read_text()

    def alive(self, i):
        return self.procs[i].poll() is None

    def kill(self, i):
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(timeout=10)

    def restart(self, i):
        p, port, name, log = self.start_one(i, port=self.ports[i])
        self.procs[i] = p
        self.logs[i] = log

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.cache, ignore_errors=True)
