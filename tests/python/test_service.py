"""`ringllm node` as a service manager runs it: SIGTERM while idle and during a generation
(it tells its coordinator, finishes the step under way, closes its links, exits 0), logs a
service can keep (plain text, no colours; no timestamps of its own under journald)."""

import os
import re
import signal
import subprocess
import time

import openai
import pytest

from support.cli import run
from support.nodes import Nodes, free_port
from support.paths import KEY, SMOL, model_path, ringllm_bin
from support.server import Server

# What a coordinator says when a node went away without a word (a crash, a cut link).
UNCLEAN = ["closed the data link", "stopped answering", "closed the connection (process stopped?)",
           "sending the hidden state failed"]
MODEL = "smollm2-135m-instruct-q4_1"
ANSI = re.compile(r"\x1b\[")


class RingServer(Server):
    """`ringllm up --serve` over `nodes`, its stderr in a file (read while it runs)."""

    def __init__(self, nodes, log_path):
        self.log_path = log_path
        self.port = free_port()
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen(
            [str(ringllm_bin()), "up", "-m",
             model_path(SMOL.name), "--key", KEY, *nodes.node_flags(), "--threads", "1", "-c", "512",
             "--parallel", "1", "--serve", f"127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited: {self.text()}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the coordinator did not come up: {self.text()}")

    def text(self):
        self.log.flush()
        return open(self.log_path).read()

    def wait_log(self, needle, timeout=30):
        """Waits for `needle` in the coordinator's log (a hang guard, not a speed limit)."""
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            assert time.monotonic() < deadline, f"no {needle!r} in the coordinator's log:\n{self.text()}"
            time.sleep(0.1)


def stop_node(nodes, i, sig=signal.SIGTERM, timeout=30):
    nodes.procs[i].send_signal(sig)
    rc = nodes.procs[i].wait(timeout=timeout)
    return rc, nodes.log(i)


def frames(log):
    """The compute thread's closing counts: (frames in, frames out, not started)."""
    m = re.findall(r"compute ends: (\d+) frames in, (\d+) frames out, (\d+) not started", log)
    assert m, f"no closing counts in the node's log:\n{log}"
    return tuple(map(int, m[-1]))


@pytest.mark.parametrize("sig,said", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C (SIGINT)")])
def test_sigterm_while_idle_is_a_clean_close(tmp_path, sig, said):
    with Nodes(2, log_dir=tmp_path) as nodes:
        s = RingServer(nodes, tmp_path / "coordinator.log")
        try:
            c = s.client().completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                              max_tokens=4)
            assert c.choices[0].text
            rc, log = stop_node(nodes, 1, sig)
            assert rc == 0, log
            assert f"{said}: finishing the step under way, closing links" in log
            assert "stopped cleanly" in log
            assert not ANSI.search(log), repr(log[:300])
            # Both steps of the request were finished, none cut.
            fin, fout, skipped = frames(log)
            assert fin == fout and skipped == 0 and fin > 0
            # The coordinator heard the node say so, not a dead link.
            s.wait_log("is shutting down")
            text = s.text()
            assert "node2" in text and not any(u in text for u in UNCLEAN), text
        finally:
            s.stop()
            s.log.close()


@pytest.mark.slow
def test_sigterm_during_a_generation_finishes_the_step(tmp_path):
    prompt = "1, 2, 3, 4, 5,"
    with Nodes(2, log_dir=tmp_path) as nodes:
        s = RingServer(nodes, tmp_path / "coordinator.log")
        try:
            got = []
            stream = s.client().completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=400,
                                                   stream=True)
            rc = None
            try:
                for chunk in stream:
                    got.append(chunk.choices[0].text if chunk.choices else "")
                    # A few tokens in: the generation is under way (it runs to 400 tokens).
                    if len(got) == 3:
                        nodes.procs[0].send_signal(signal.SIGTERM)
            except (openai.APIError, openai.APIConnectionError):
                pass  # the request fails (resuming it is another feature)
            rc = nodes.procs[0].wait(timeout=30)
            log = nodes.log(0)
            assert rc == 0, log
            assert "SIGTERM: finishing the step under way" in log and "stopped cleanly" in log
            assert not ANSI.search(log)
            # Every step the node took in was finished and sent on: no half-done step.
            fin, fout, not_started = frames(log)
            assert fin == fout + not_started and fout > 0, (fin, fout, not_started)
            # The coordinator names the node's shutdown, not a broken link or a timeout.
            s.wait_log("is shutting down")
            text = s.text()
            assert "node1" in text and not any(u in text for u in UNCLEAN), text
            # What was streamed before is the greedy answer's beginning.
            text_got = "".join(got)
            assert len(got) >= 3, len(got)
            oracle = run(["run", "-m", model_path(SMOL.name), "-p", prompt, "--temp", "0", "-n", str(len(got) + 2),
                          "--threads", "1", "-c", "512"]).stdout
            assert oracle.startswith(text_got), (text_got, oracle)
        finally:
            s.stop()
            s.log.close()


@pytest.mark.parametrize("journal", [False, True])
def test_logs_under_journald_have_no_timestamps_of_their_own(tmp_path, journal):
    log = tmp_path / "stderr"
    with open(log, "w") as f:
        env = dict(os.environ)
        env.pop("JOURNAL_STREAM", None)
        if journal:
            st = os.fstat(f.fileno())
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        subprocess.run([str(ringllm_bin()), "-v", "run", "-m", model_path(SMOL.name), "-p", "Hi",
                        "-n", "1", "--threads", "1"], stdout=subprocess.DEVNULL, stderr=f, env=env, check=True,
                       timeout=120)
    lines = [l for l in log.read_text().splitlines() if "INFO" in l]
    assert lines and not any(ANSI.search(l) for l in lines)
    stamped = [bool(re.match(r"\d{4}-\d\d-\d\dT", l.strip())) for l in lines]
    assert all(stamped) if not journal else not any(stamped), lines[:3]
