"""A `ringllm run|up ... --serve` process on a free loopback port (`Server`): started with the
given arguments, waited for until /health answers, spoken to over raw HTTP or the `openai`
client, stopped with SIGTERM."""

import http.client
import json
import signal
import subprocess
import time

import openai

from .nodes import free_port
from .paths import ringllm_bin

SMOL_ID = "smollm2-135m-instruct-q4_1"


class Server:
    def __init__(self, args, env=None, preexec_fn=None):
        self.port = free_port()
        self.proc = subprocess.Popen([str(ringllm_bin()), *map(str, args), "--serve", f"127.0.0.1:{self.port}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=preexec_fn)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError("server did not come up")

    def request(self, method, path, body=None, headers=None, timeout=120):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        h = {"Content-Type": "application/json", **(headers or {})}
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        out = r.status, dict(r.getheaders()), r.read()
        c.close()
        return out

    def get(self, path, headers=None):
        return self.request("GET", path, headers=headers)

    def client(self, key="none"):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0)

    def metrics(self):
        _, _, body = self.get("/metrics")
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def rss_kib(self):
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
