"""The chat page at `/` of `ringllm run --serve`, in a real headless Chromium driven over the
Chrome DevTools Protocol (a WebSocket, the `websockets` package): load the page, type, click
Send, see the streamed reply, which must equal the OpenAI endpoint's greedy answer for the
same conversation; a second turn; the conversation back after a reload; the Stop button (the
server must notice the closed connection and stop generating); the API-key prompt; no console
errors or CSP violations. Saves a screenshot to target/chat-page.png.

Chromium is Debian's `chromium` (scripts/test-setup installs it). Without it the tests fail,
unless RINGLLM_NO_BROWSER=1 says to skip them."""

import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from support.paths import SMOL, model_path
from support.server import SMOL_ID, Server

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
KEY = "page-test-key"
# Upper bounds for things that take well under a second here; only a broken page reaches them.
WAIT_S = 120


def chromium_path():
    for p in (os.environ.get("RINGLLM_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if p and os.path.exists(p):
            return p
    return None


if os.environ.get("RINGLLM_NO_BROWSER") == "1":
    pytest.skip("RINGLLM_NO_BROWSER=1: the chat page is not tested in a browser", allow_module_level=True)


class Tab:
    """One page target over CDP."""

    def __init__(self, ws_url):
        from websockets.sync.client import connect
        self.ws = connect(ws_url, max_size=None, open_timeout=30, legacy=True)
        self.ids = itertools.count(1)
        self.events = []
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Log.enable")
        # Log.enable replays what earlier tests' pages logged in this tab: start afresh.
        self.call("Log.clear")
        self.events = []

    def call(self, method, **params):
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=WAIT_S))
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            self.events.append(msg)

    def eval(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr, what):
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            v = self.eval(expr)
            if v:
                return v
            time.sleep(0.05)
        raise AssertionError(f"the page never got to: {what} ({expr})")

    def goto(self, url):
        self.call("Page.navigate", url=url)
        self.wait(f"location.href === {json.dumps(url)} && document.readyState === 'complete'", f"{url} loaded")

    def click(self, selector):
        box = self.eval(f"""(() => {{
            const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();
            return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def type_into(self, selector, text):
        """Focuses the field, selects what it holds, and types `text` over it."""
        self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.focus(); e.select(); }})()")
        self.call("Input.insertText", text=text)

    def text(self, selector):
        return self.eval(f"document.querySelector({json.dumps(selector)}).textContent")

    def problems(self):
        """Console errors, uncaught exceptions and CSP reports seen so far."""
        out = []
        for e in self.events:
            if e.get("method") == "Runtime.exceptionThrown":
                out.append(str(e["params"]["exceptionDetails"]))
            elif e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error":
                entry = e["params"]["entry"]
                # The 401s the key prompt is about, and the 404 of /v1/cluster on a server
                # without it, are expected network errors.
                if entry.get("source") == "network" and re.search(r"\b(401|404)\b", entry.get("text", "")):
                    continue
                out.append(entry.get("text", str(entry)))
        return out

    def close(self):
        self.ws.close()


class Browser:
    def __init__(self):
        exe = chromium_path()
        if exe is None:
            pytest.fail("no Chromium: install Debian's `chromium` (scripts/test-setup does), "
                        "or set RINGLLM_NO_BROWSER=1 to skip the browser tests")
        self.dir = tempfile.mkdtemp(prefix="ringllm-chromium-")
        self.log = open(os.path.join(self.dir, "chromium.log"), "w")
        self.proc = subprocess.Popen([
            exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={self.dir}/profile", "--remote-debugging-port=0", "--window-size=1200,800",
            "about:blank"], stdout=self.log, stderr=subprocess.STDOUT)
        port_file = Path(self.dir, "profile", "DevToolsActivePort")
        deadline = time.monotonic() + WAIT_S
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"Chromium did not start: {Path(self.dir, 'chromium.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.port = int(port_file.read_text().split("\n")[0])

    def tab(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=30) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        return Tab(pages[0]["webSocketDebuggerUrl"])

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        # Chromium's helper processes may still be writing into the profile as it exits.
        for _ in range(50):
            shutil.rmtree(self.dir, ignore_errors=True)
            if not os.path.exists(self.dir):
                break
            time.sleep(0.1)


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


@pytest.fixture(scope="module")
def srv():
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "1024", "--parallel", "2"])
    yield s
    s.stop()


def greedy(s, messages, max_tokens, key="none"):
    r = s.client(key).chat.completions.create(model=SMOL_ID, messages=messages, temperature=0,
                                              max_tokens=max_tokens)
    return r.choices[0].message.content, r.choices[0].finish_reason


LAST_REPLY = "document.querySelector('#log .msg.assistant:last-child')"


def settings(tab, temperature, max_tokens, system=""):
    tab.type_into("#temperature", str(temperature))
    tab.type_into("#max-tokens", str(max_tokens))
    tab.type_into("#system", system)
    if not system:
        tab.call("Input.dispatchKeyEvent", type="keyDown", key="Delete", code="Delete", windowsVirtualKeyCode=46)
        tab.call("Input.dispatchKeyEvent", type="keyUp", key="Delete", code="Delete", windowsVirtualKeyCode=46)
    got = tab.eval("['#temperature', '#max-tokens', '#system'].map(s => document.querySelector(s).value)")
    assert got == [str(temperature), str(max_tokens), system]


def say(tab, text):
    """Types `text`, clicks Send, waits for the reply to finish; returns (text, note)."""
    tab.type_into("#input", text)
    tab.click("#send")
    tab.wait(f"{LAST_REPLY} && {LAST_REPLY}.dataset.state !== 'streaming' "
             f"&& document.querySelector('#send').disabled === false", "a finished reply")
    assert tab.eval(f"{LAST_REPLY}.dataset.state") == "done", tab.text("#error")
    return tab.eval(f"{LAST_REPLY}.querySelector('.text').textContent"), tab.text("#log .msg.assistant:last-child .note")


def test_chat_streams_the_greedy_answer_and_keeps_the_conversation(browser, srv):
    tab = browser.tab()
    try:
        url = f"http://127.0.0.1:{srv.port}/"
        tab.goto(url)
        tab.wait(f"document.querySelector('#model').textContent === {json.dumps(SMOL_ID)}", "the model's name")
        tab.wait("document.querySelector('#status').dataset.state === 'ok'", "the server's status")
        # No /v1/cluster on this server: the page shows what /health says instead.
        tab.wait("document.querySelector('#cluster').textContent.includes('one machine')", "the cluster panel")
        tab.wait("document.querySelector('#load').textContent.includes('slots 0/2')", "the load line")
        settings(tab, 0, 16)

        q1 = "What is the capital of France?"
        reply, note = say(tab, q1)
        expected, finish = greedy(srv, [{"role": "user", "content": q1}], 16)
        assert reply == expected
        chunks = int(re.search(r"(\d+) chunks", note).group(1))
        assert chunks > 1, f"streamed in pieces: {note}"
        assert ("cut at max tokens" in note) == (finish == "length"), note

        q2 = "And of Italy?"
        reply2, _ = say(tab, q2)
        expected2, _ = greedy(srv, [{"role": "user", "content": q1}, {"role": "assistant", "content": expected},
                                    {"role": "user", "content": q2}], 16)
        assert reply2 == expected2

        # The system prompt field reaches the model.
        tab.click("#new-chat")
        settings(tab, 0, 16, system="You answer in French.")
        q3 = "Say hello."
        reply3, _ = say(tab, q3)
        expected3, _ = greedy(srv, [{"role": "system", "content": "You answer in French."},
                                    {"role": "user", "content": q3}], 16)
        assert reply3 == expected3

        # The conversation and the settings come back after a reload.
        tab.goto(url)
        texts = tab.eval("[...document.querySelectorAll('#log .msg .text')].map(e => e.textContent)")
        assert texts == [q3, reply3]
        assert tab.eval("document.querySelector('#system').value") == "You answer in French."
        assert tab.eval("document.querySelector('#max-tokens').value") == "16"
        tab.click("#new-chat")
        settings(tab, 0, 16)
        reply, _ = say(tab, q1)
        reply2, _ = say(tab, q2)
        assert [reply, reply2] == [expected, expected2]
        shot = tab.call("Page.captureScreenshot", format="png")
        out = ROOT / "target" / "chat-page.png"
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(base64.b64decode(shot["data"]))
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert tab.problems() == []
    finally:
        tab.close()


def test_stop_aborts_and_the_server_stops_generating(browser, srv):
    tab = browser.tab()
    try:
        tab.goto(f"http://127.0.0.1:{srv.port}/")
        tab.wait(f"document.querySelector('#model').textContent === {json.dumps(SMOL_ID)}", "the model's name")
        tab.click("#new-chat")
        most = 600
        settings(tab, 0, most)
        before = srv.metrics()["ringllm_completion_tokens_total"]
        q = "Write a long story about a dragon who learns to sing."
        tab.type_into("#input", q)
        tab.click("#send")
        tab.wait(f"{LAST_REPLY} && {LAST_REPLY}.querySelector('.text').textContent.length > 0", "the first words")
        # Freeze the server so that the reply cannot run to its end while the page stops it;
        # the browser closes the connection meanwhile.
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            assert tab.eval("document.querySelector('#stop').disabled") is False
            tab.click("#stop")
            tab.wait(f"{LAST_REPLY}.dataset.state === 'stopped'", "the reply marked stopped")
            assert tab.eval("document.querySelector('#send').disabled") is False
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        # The server notices the closed connection: the slot is freed...
        deadline = time.monotonic() + WAIT_S
        while srv.metrics()["ringllm_slots_busy"] != 0:
            assert time.monotonic() < deadline, "the stopped request still holds its slot"
            time.sleep(0.1)
        generated = int(srv.metrics()["ringllm_completion_tokens_total"] - before)
        # ...before the answer's end: fewer tokens than allowed, and the greedy answer does
        # not end there either (asked for one token more, it is cut by the length).
        print(f"stopped after {generated} of at most {most} tokens")
        assert 0 < generated < most
        _, finish = greedy(srv, [{"role": "user", "content": q}], generated + 1)
        assert finish == "length", f"the answer ended by itself after {generated} tokens"
        assert tab.problems() == []
    finally:
        tab.close()


def test_the_csp_blocks_what_the_page_does_not_serve(browser, srv):
    tab = browser.tab()
    try:
        tab.goto(f"http://127.0.0.1:{srv.port}/")
        tab.wait(f"document.querySelector('#model').textContent === {json.dumps(SMOL_ID)}", "the model's name")
        assert tab.problems() == []
        # An injected inline script does not run, and the browser reports why.
        tab.eval("""(() => { const s = document.createElement('script');
                     s.textContent = 'window.inlineRan = true'; document.body.append(s); })()""")
        assert tab.eval("window.inlineRan === true") is False
        tab.wait("new Promise(r => setTimeout(() => r(true), 50))", "a moment for the report")
        assert any("Content Security Policy" in p for p in tab.problems()), tab.problems()
    finally:
        tab.close()


def test_the_page_asks_for_the_api_key(browser):
    s = Server(["run", "-m", model_path(SMOL.name), "--threads", "1", "-c", "512", "--api-key", KEY])
    tab = browser.tab()
    try:
        url = f"http://127.0.0.1:{s.port}/"
        tab.goto(url)
        tab.wait("!document.querySelector('#key-form').hidden", "the key form")
        assert tab.text("#status") == "needs an API key"
        # A wrong key: asked again, with the server's reason.
        tab.type_into("#key", "wrong")
        tab.click("#key-save")
        tab.wait("document.querySelector('#key-error').textContent === 'incorrect API key'", "the wrong key refused")
        assert tab.eval("document.querySelector('#key-form').hidden") is False
        tab.type_into("#key", KEY)
        tab.click("#key-save")
        tab.wait(f"document.querySelector('#model').textContent === {json.dumps(SMOL_ID)}", "the model's name")
        assert tab.eval("document.querySelector('#key-form').hidden") is True
        assert json.loads(tab.eval("localStorage.getItem('ringllm.apiKey')")) == KEY
        settings(tab, 0, 8)
        reply, _ = say(tab, "Hi!")
        assert reply == greedy(s, [{"role": "user", "content": "Hi!"}], 8, key=KEY)[0]
        # Remembered across a reload.
        tab.goto(url)
        tab.wait(f"document.querySelector('#model').textContent === {json.dumps(SMOL_ID)}", "the model's name")
        assert tab.eval("document.querySelector('#key-form').hidden") is True
        assert tab.problems() == []
    finally:
        tab.close()
        s.stop()
