"""The `ringllm` command line as a user meets it: JSON output, greedy determinism across
thread counts, the context limit, stop strings, and one clear line for bad input."""

import json
import os
import subprocess
import time

import gguf
import numpy as np
import pytest

from support.cli import run
from support.paths import GEMMA, ROOT, SMOL, model_path


def run_json(model, prompt, *extra):
    r = run(["run", "-m", model, "-p", prompt, "--json", "--temp", "0", *extra])
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    assert len(lines) == 1, f"--json must print exactly one JSON object, got: {r.stdout!r}"
    return json.loads(lines[0])


@pytest.mark.parametrize("name", [GEMMA.name, SMOL.name])
def test_json_output_and_thread_count_invariance(name):
    path = model_path(name)
    a = run_json(path, "The capital of France is", "-n", "24", "--threads", "1")
    for key in ["prompt_token_ids", "token_ids", "text", "finish_reason", "prefill_tokens_per_s", "decode_tokens_per_s"]:
        assert key in a, key
    assert a["finish_reason"] in ("stop", "length")
    assert len(a["token_ids"]) <= 24 and len(a["token_ids"]) > 0
    assert a["prefill_tokens_per_s"] > 0 and a["decode_tokens_per_s"] > 0
    b = run_json(path, "The capital of France is", "-n", "24", "--threads", "2")
    assert a["token_ids"] == b["token_ids"], "greedy output differs between 1 and 2 threads"
    assert a["text"] == b["text"]


def test_text_streams_to_stdout_and_stats_to_stderr():
    r = run(["run", "-m", model_path(SMOL.name), "-p", "The capital of France is", "-n", "8", "--temp", "0"])
    assert r.stdout.strip(), "no completion on stdout"
    assert "tok/s" in r.stderr and "tok/s" not in r.stdout


def test_prompt_from_stdin_equals_prompt_flag():
    path = model_path(SMOL.name)
    a = run_json(path, "Once upon a time", "-n", "8")
    r = run(["run", "-m", path, "--json", "--temp", "0", "-n", "8"], input="Once upon a time")
    b = json.loads(r.stdout)
    assert a["prompt_token_ids"] == b["prompt_token_ids"]
    assert a["token_ids"] == b["token_ids"]


def test_context_limit_stops_with_length():
    path = model_path(SMOL.name)
    out = run_json(path, "The capital of France is", "-n", "100", "--ctx", "12")
    assert out["finish_reason"] == "length"
    assert len(out["prompt_token_ids"]) + len(out["token_ids"]) <= 12


def test_stop_string_is_not_printed():
    path = model_path(SMOL.name)
    free = run_json(path, "The capital of France is", "-n", "16")
    text = free["text"]
    assert len(text) > 4
    stop = text[2:5]
    stopped = run_json(path, "The capital of France is", "-n", "16", "--stop", stop)
    assert stopped["finish_reason"] == "stop"
    assert stop not in stopped["text"]
    assert text.startswith(stopped["text"])


def _fails(args, needle):
    r = subprocess.run([*args], capture_output=True, text=True)
    assert r.returncode != 0, f"expected failure: {args}"
    err = r.stderr.strip().splitlines()
    assert err and needle in r.stderr, f"stderr lacks {needle!r}: {r.stderr!r}"
    assert "panicked" not in r.stderr
    return r


def test_bad_input_gives_one_clear_line(ringllm, tmp_path):
    _fails([ringllm, "run", "-m", tmp_path / "nope.gguf", "-p", "x"], "does not exist")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all")
    _fails([ringllm, "run", "-m", junk, "-p", "x"], "magic")
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(model_path(SMOL.name).read_bytes()[:100000])
    _fails([ringllm, "run", "-m", trunc, "-p", "x"], "trunc")
    # An architecture we do not run, written with gguf-py's writer.
    other = tmp_path / "neox.gguf"
    w = gguf.GGUFWriter(str(other), "gptneox")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _fails([ringllm, "info", other], "unsupported architecture 'gptneox'")


def test_model_paths_that_are_not_files_are_refused_by_kind(ringllm, tmp_path):
    """A FIFO once hung `run` (open blocks until a writer comes); a folder and /dev/zero gave
    doubled or misleading messages. Each is now one line naming the path and what it is."""
    import os
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    for path, kind in [(fifo, "a FIFO"), (tmp_path, "a directory"), ("/dev/zero", "a device")]:
        r = subprocess.run([ringllm, "run", "-m", path, "-p", "x"], capture_output=True, text=True, timeout=30)
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{path} is not a regular file ({kind})" in lines[0], r.stderr
        r = subprocess.run([ringllm, "info", path], capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and f"is not a regular file ({kind})" in r.stderr, r.stderr


def test_oversized_settings_are_refused_before_allocation(ringllm, tmp_path):
    """Sizes far beyond the machine are a clear one-line error, not an abort in the allocator
    (`-b 100000000` once asked for 614 GB and died with a backtrace)."""
    smol = model_path(SMOL.name)
    base = [ringllm, "run", "-m", smol, "-p", "x", "-n", "1"]
    for extra, needle in [
        (["-b", "100000000"], "batch size 100000000 is more than ringllm accepts"),
        (["-t", "4294967295"], "threads 4294967295 is more than ringllm accepts"),
        (["-c", "100000000000"], "context size 100000000000 is more than ringllm accepts"),
        # Within the limits, beyond this machine's memory: refused by the memory check.
        (["-c", "2000000", "-b", "65536"], "but only"),
    ]:
        r = _fails([*base, *extra], needle)
        assert "memory allocation" not in r.stderr and "backtrace" not in r.stderr
    _fails([ringllm, "run", "-m", smol, "--serve", "127.0.0.1:0", "--prefill-chunk", "18446744073709551615"],
           "batch size")
    cluster = tmp_path / "c.toml"
    cluster.write_text(f'model = "{smol}"\nkey = "k"\n[[node]]\nname = "n1"\naddress = "127.0.0.1:1"\nthreads = 4294967295\n')
    _fails([ringllm, "plan", cluster], "at most 1024")


def test_info_describes_the_model(ringllm):
    r = run(["info", model_path(GEMMA.name)])
    assert "gemma3" in r.stdout
    assert "layers:        18" in r.stdout
    assert "Q4_K" in r.stdout and "Q6_K" in r.stdout and "Q8_0" in r.stdout
    assert "window 512 on 15 of 18 layers" in r.stdout


SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_chat_renders_the_models_template_and_keeps_the_conversation():
    path = model_path(SMOL.name)
    r = run(["run", "-m", path, "--chat", "--temp", "0", "-n", "12"], input="What is 2+2?\nAnd 3+3?\n")
    replies = [l for l in r.stdout.split("\n") if l.strip()]
    assert len(replies) >= 2, r.stdout
    # Turn 1 equals a raw completion of the ChatML text the template should produce.
    first = SMOL_SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    raw = run_json(path, first, "-n", "12")
    assert r.stdout.startswith(raw["text"].strip().split("\n")[0])
    # Turn 2 sees turn 1: the same as a raw completion of the whole conversation.
    second = first + raw["text"].strip() + "<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    raw2 = run_json(path, second, "-n", "12")
    assert raw2["text"].strip().split("\n")[0] in r.stdout


def test_chat_template_by_name_and_an_unknown_name(ringllm):
    # A model without a template gets its family's (tests/python/test_chat_repl.py); a name
    # that is no built-in template is refused, naming the built-in ones.
    r = subprocess.run([ringllm, "run", "-m", model_path(GEMMA.name), "--chat", "--template", "nosuch"],
                       input="hi\n", capture_output=True, text=True)
    assert r.returncode != 0 and "unknown template 'nosuch'" in r.stderr and "gemma" in r.stderr
    ok = run(["run", "-m", model_path(GEMMA.name), "--chat", "--template", "gemma", "--temp", "0", "-n", "8"],
             input="Hello\n")
    assert ok.stdout.strip()


def _closed_stdout(ringllm, args, **kw):
    """Runs ringllm with stdout a pipe nobody reads (its reader closed first): every write
    fails with EPIPE at once, as for `ringllm … | head -1` once head has exited."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([str(ringllm), *map(str, args)], stdout=w, stderr=subprocess.PIPE, text=True,
                           timeout=120, **kw)
    finally:
        os.close(w)
    return p


@pytest.mark.parametrize("args", [
    ["info", SMOL, "--tensors"],
    ["run", "-m", SMOL, "-p", "Once upon a time", "-n", "64", "--temp", "0"],
    ["run", "-m", SMOL, "-p", "Once upon a time", "-n", "4", "--temp", "0", "--json"],
    ["debug", "tokenize", "-m", SMOL, "-p", "hello"],
], ids=["info", "run-stream", "run-json", "tokenize"])
def test_a_closed_stdout_ends_quietly(ringllm, args):
    p = _closed_stdout(ringllm, args)
    assert p.returncode == 0, p.stderr
    assert "panicked" not in p.stderr and "Broken pipe" not in p.stderr and "backtrace" not in p.stderr, p.stderr


def test_a_closed_stdout_stops_the_chat_and_head_works(ringllm):
    p = _closed_stdout(ringllm, ["run", "-m", SMOL, "--chat", "--temp", "0", "-n", "8"], input="Hi\nAgain\n")
    assert p.returncode == 0 and "panicked" not in p.stderr, p.stderr
    # The shell pipeline of the issue.
    sh = subprocess.run(["bash", "-o", "pipefail", "-c", f"'{ringllm}' info '{SMOL}' --tensors | head -1"],
                        capture_output=True, text=True, timeout=60)
    assert sh.returncode == 0 and sh.stdout.startswith("file:") and sh.stderr == "", sh.stderr


def _on_a_terminal(ringllm, args, then):
    """Runs ringllm with a terminal on stdin; returns its stderr once `then` was typed."""
    import pty

    master, slave = pty.openpty()
    p = subprocess.Popen([str(ringllm), *map(str, args)], stdin=slave, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    os.close(slave)
    try:
        time.sleep(2)
        os.write(master, then)
        out, err = p.communicate(timeout=120)
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
    return p.returncode, err


def test_reading_stdin_on_a_terminal_says_so(ringllm):
    # Without -p the prompt comes from stdin: on a terminal a hint says so (Ctrl-D ends it).
    rc, err = _on_a_terminal(ringllm, ["run", "-m", SMOL, "-n", "2", "--temp", "0"], b"Hello\n\x04")
    assert rc == 0 and "reading the prompt from stdin until Ctrl-D" in err and "--chat" in err, err
    rc, err = _on_a_terminal(ringllm, ["run", "-m", SMOL, "--chat", "-n", "2", "--temp", "0"], b"Hi\n\x04")
    assert rc == 0 and "Ctrl-D ends" in err, err
    # Not on a terminal (a pipe, a file): no hint.
    r = run(["run", "-m", SMOL, "-n", "2", "--temp", "0"], input="Hello")
    assert "Ctrl-D" not in r.stderr


def test_logs_have_no_colours_when_not_on_a_terminal():
    r = run(["run", "-m", SMOL, "-p", "Hi", "-n", "2", "--temp", "0", "-v"])
    assert "INFO" in r.stderr and "\x1b[" not in r.stderr, repr(r.stderr[:300])


def test_info_shows_the_tokenizer_and_chat_template():
    r = run(["info", SMOL])
    assert "tokenizer:     gpt2 (byte-level BPE), pre-tokenizer 'smollm', 49152 tokens" in r.stdout
    assert 'bos:           1 "<|im_start|>" (not added)' in r.stdout
    assert 'eos:           2 "<|im_end|>"' in r.stdout
    assert "chat template: the model's own, ChatML" in r.stdout
    assert "{% for message in messages %}" in run(["info", SMOL, "--chat-template"]).stdout
    g = run(["info", model_path(GEMMA.name)]).stdout
    assert "llama (SentencePiece)" in g and '2 "<bos>" (added to prompts)' in g
    assert "chat template: none (chat with --template" in g


def test_help_and_example_configs_say_what_is_true():
    help_text = run(["perplexity", "--help"]).stdout
    assert "default: 512" in help_text and "capped at 4096" not in help_text
    configs = ROOT / "cluster-configs"
    homelab = (configs / "homelab.example.toml").read_text()
    assert "only choice" not in homelab and all(t in homelab for t in ['"f16"', '"bf16"', '"q8"'])
    assert "homelab.example.toml --chat" in homelab
    for f in configs.glob("*.toml"):
        text = f.read_text()
        if "test-cluster.key" in text.split("\nkey =", 1)[-1].split("\n", 1)[0]:
            assert "TEST key" in text and "never on a network" in text, f.name


def test_bench_table_columns_line_up():
    r = run(["bench", "-m", SMOL, "-p", "8,64", "-n", "4", "-r", "2", "-t", "1"], timeout=300)
    table = [l for l in r.stdout.splitlines() if l.startswith("|")]
    assert len(table) == 2 + 3, r.stdout
    bars = {tuple(i for i, c in enumerate(l) if c == "|") for l in table}
    assert len(bars) == 1, "\n".join(table)


def test_info_describes_a_model_whose_vocabulary_cannot_be_built(tmp_path):
    """`info` describes the network even when the tokenizer metadata is unusable."""
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    src = gguf.GGUFReader(str(model_path(SMOL.name)))
    out = tmp_path / "odd-vocab.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    copy_with_new_metadata(src, w, {"tokenizer.ggml.model": MetadataDetails(gguf.GGUFValueType.STRING, "rwkv")}, [])
    r = run(["info", out])
    assert "layers:        30" in r.stdout and "tokenizer:     none usable" in r.stdout and "rwkv" in r.stdout, r.stdout


def test_node_and_up_with_kmod_and_no_module_stop_at_start_and_say_what_to_do(tmp_path):
    """No silent fallback: without /dev/ringllm, `--transport kmod` stops a node at start-up
    with how to load the module (kmod/test-qemu checks the same inside a QEMU guest, and the
    ring over the module there)."""
    from support.cli import ringllm
    from support.paths import KEY
    if os.path.exists("/dev/ringllm"):
        pytest.skip("the ringllm module is loaded on this machine")
    r = ringllm(["node", "--listen", "127.0.0.1:0", "--key", KEY, "--models", tmp_path,
                 "--transport", "kmod"], check=False, timeout=30)
    assert r.returncode != 0
    assert "--transport kmod" in r.stderr and "insmod kmod/ringllm.ko" in r.stderr, r.stderr
    assert "kmod/README.md" in r.stderr
