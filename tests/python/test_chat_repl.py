"""The `--chat` REPL fed through a pipe, as a script would: its commands (/help, /system,
/clear, /bye, an unknown one), dropping the oldest turns when the context fills, and the
family template for a model whose file has none. Every reply is checked against a raw
completion (`run -p`) of the ChatML text the conversation should be at that turn."""

from support.cli import run
from support.paths import GEMMA, SMOL, model_path

SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
N = "16"


def chatml(system, turns, question):
    """The ChatML prompt for `turns` ((question, reply) pairs) and a new question."""
    s = f"<|im_start|>system\n{system}<|im_end|>\n"
    for q, a in turns:
        s += f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"
    return s + f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def complete(prompt, *extra):
    """The greedy raw completion of `prompt` (its special-token texts are control tokens)."""
    r = run(["run", "-m", model_path(SMOL.name), "-p", prompt, "--temp", "0", "-n", N, "--threads", "1", *extra])
    assert r.stdout.endswith("\n")
    return r.stdout[:-1]


def chat(lines, *extra, model=SMOL, n=N):
    r = run(["run", "-m", model_path(model.name), "--chat", "--temp", "0", "-n", n, "--threads", "1", *extra],
            input="".join(l + "\n" for l in lines))
    return r.stdout, r.stderr


def test_commands_system_clear_and_bye():
    q1, q2 = "What is 2+2?", "What is the capital of France?"
    out, err = chat(["/help", "/system You are a pirate.", "/system", q1, "/clear", q2, "/frobnicate", "/bye",
                     "this line is never read"])
    # Only replies on stdout: the answer under the new system prompt, then (after /clear) the
    # answer of a fresh conversation; nothing after /bye.
    under_system = complete(chatml("You are a pirate.", [], q1))
    fresh = complete(chatml("You are a pirate.", [], q2))
    assert out == under_system + "\n" + fresh + "\n", (out, err)
    # A fresh session with the same system prompt answers q2 the same.
    alone, _ = chat([q2], "--system", "You are a pirate.")
    assert alone == fresh + "\n"
    assert "/system TEXT" in err and "/clear" in err and "/bye" in err  # /help
    assert "[system prompt: You are a pirate.]" in err
    assert "conversation cleared" in err
    assert "unknown command /frobnicate" in err and "/help" in err
    assert "this line" not in out


def test_clear_forgets_the_conversation():
    q1, q2 = "Name a color.", "What did I ask you?"
    out, _ = chat([q1, "/clear", q2])
    a1 = complete(chatml(SMOL_DEFAULT_SYSTEM, [], q1))
    a2 = complete(chatml(SMOL_DEFAULT_SYSTEM, [], q2))
    assert out == a1 + "\n" + a2 + "\n"
    # Without /clear the second answer sees the first turn (a different prompt).
    kept, _ = chat([q1, q2])
    assert kept == a1 + "\n" + complete(chatml(SMOL_DEFAULT_SYSTEM, [(q1, a1.strip())], q2)) + "\n"


def test_a_full_context_drops_the_oldest_turns_and_goes_on():
    questions = ["What is 2+2?", "Name a color.", "What is the capital of France?", "Name a fruit."]
    out, err = chat(questions, "--ctx", "96")
    replies = out.split("\n")
    assert replies[-1] == "" and len(replies) == len(questions) + 1, out
    replies = replies[:-1]
    notes = [l for l in err.splitlines() if l.startswith("[context full: dropped the oldest")]
    assert notes, err
    dropped = sum(int(l.split("dropped the oldest ")[1].split(" ")[0]) for l in notes)
    assert 1 <= dropped < len(questions) - 1
    # Turns go from the front only: the last prompt is the default system prompt, the turns
    # left, and the last question.
    turns = list(zip(questions, (r.strip() for r in replies)))
    kept = turns[dropped:len(questions) - 1]
    assert replies[-1] == complete(chatml(SMOL_DEFAULT_SYSTEM, kept, questions[-1]), "--ctx", "96")


def test_a_model_without_template_gets_its_familys():
    out, err = chat(["Hello"], model=GEMMA, n="8")
    assert "has no chat template; using the built-in 'gemma' template" in err
    explicit, _ = chat(["Hello"], "--template", "gemma", model=GEMMA, n="8")
    assert out == explicit and out.strip()
    # The file adds BOS to a raw prompt, as the template writes it.
    raw = run(["run", "-m", model_path(GEMMA.name), "-p",
               "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n", "--temp", "0", "-n", "8",
               "--threads", "1"])
    assert out == raw.stdout


def test_line_editing_and_history_on_a_terminal(ringllm, tmp_path):
    """On a terminal (stdin and stdout), lines are edited (a backspace takes back a character)
    and kept in $XDG_STATE_HOME/ringllm/history; the reply is the one a pipe gets; Ctrl-C at
    the prompt gives a hint, Ctrl-D leaves."""
    import os
    import pty
    import subprocess

    master, slave = pty.openpty()
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path), "TERM": "xterm"}
    p = subprocess.Popen([str(ringllm), "run", "-m", model_path(SMOL.name), "--chat", "--temp", "0", "-n", "8",
                          "--threads", "1"], stdin=slave, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    seen = b""
    try:
        def read_until(prompts, limit=120):
            """Reads the terminal until it has shown the prompt `prompts` times."""
            nonlocal seen
            import select
            import time
            deadline = time.monotonic() + limit
            while seen.count(b"> ") < prompts:
                assert time.monotonic() < deadline, f"not {prompts} prompts on the terminal: {seen!r}"
                r, _, _ = select.select([master], [], [], 1)
                if r:
                    try:
                        seen += os.read(master, 4096)
                    except OSError:
                        break
        read_until(1)
        os.write(master, b"Hx\x7fi there\r")
        read_until(2)
        os.write(master, b"\x03")  # Ctrl-C at the prompt: a hint, and a new prompt
        read_until(3)
        os.write(master, b"\x04")  # Ctrl-D at an empty prompt
        _, err = p.communicate(timeout=60)
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert b"Ctrl-C again" in err, err
    history = (tmp_path / "ringllm" / "history").read_text()
    assert "Hi there" in history and "Hx" not in history, history
    piped, _ = chat(["Hi there"], n="8")
    assert piped.strip() and piped.strip().encode() in seen.replace(b"\r\n", b"\n"), (seen, piped)
