"""cgroup memory caps for the processes a test starts (`MemoryCap`): a cgroup v1 memory group
when this kernel mounts the v1 controller, else a v2 group, made below the test process's own
group and removed afterwards. Needs root; skips the test otherwise."""

import os
import pathlib
import time

import pytest

MIB = 1 << 20


def _v1_mount():
    for line in open("/proc/self/mountinfo"):
        pre, _, post = line.partition(" - ")
        fstype, _, opts = (post.split() + ["", "", ""])[:3]
        if fstype == "cgroup" and "memory" in opts.split(","):
            return pathlib.Path(pre.split()[4])
    return None


def _v2_mount():
    for line in open("/proc/self/mountinfo"):
        pre, _, post = line.partition(" - ")
        if post.split()[:1] == ["cgroup2"]:
            mount = pathlib.Path(pre.split()[4])
            if "memory" in (mount / "cgroup.controllers").read_text().split():
                return mount
    return None


def _own_group(v1):
    for line in open("/proc/self/cgroup"):
        hid, controllers, path = line.rstrip("\n").split(":", 2)
        if (v1 and "memory" in controllers.split(",")) or (not v1 and hid == "0"):
            return path.lstrip("/")
    return ""


class MemoryCap:
    """A cgroup memory group capped at `limit` bytes, below this process's own group; processes
    enter it through `preexec()`. Removed on exit (after its processes are gone)."""

    def __init__(self, name, limit):
        v1 = _v1_mount()
        self.v1 = v1 is not None
        mount = v1 if self.v1 else _v2_mount()
        if mount is None or os.geteuid() != 0:
            pytest.skip("needs root and a cgroup memory controller (v1 or v2)")
        self.dir = mount / _own_group(self.v1) / f"ringllm-test-{name}-{os.getpid()}"
        self.limit = limit

    def __enter__(self):
        self.dir.mkdir()
        self._write("memory.limit_in_bytes" if self.v1 else "memory.max", self.limit)
        return self

    def _write(self, f, value):
        (self.dir / f).write_text(f"{value}\n")

    def read(self, f):
        return (self.dir / f).read_text()

    def preexec(self):
        procs = str(self.dir / "cgroup.procs")

        def enter():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return enter

    def oom_kills(self):
        text = self.read("memory.oom_control" if self.v1 else "memory.events")
        fields = dict(line.split() for line in text.splitlines() if line.strip())
        return int(fields.get("oom_kill", 0))

    def peak(self):
        f = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        return int(self.read(f)) if (self.dir / f).exists() else 0

    def __exit__(self, *exc):
        deadline = time.monotonic() + 10
        while self.dir.exists():
            try:
                self.dir.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
