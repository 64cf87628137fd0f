#!/usr/bin/env python3
"""Regenerates tests/fixtures/tokens-transformers.json: token ids of varied texts as HF
transformers tokenizes them, with the tokenizer transformers builds from each GGUF's own
metadata (its GGUF integration, written independently of ours and of llama.cpp's).

Run by hand, never in CI (needs `pip install transformers sentencepiece protobuf`, no torch):

    python3 tests/python/make_token_fixtures.py [--llamacpp]

Output shape: {model_file: {"bos_prefix": [ids transformers puts first with
add_special_tokens=True], "cases": [{"text": ..., "ids": [...]}]}}, with `ids` the raw ids
(add_special_tokens=False). Special tokens written in the text (ChatML's <|im_start|>, Gemma's
<start_of_turn>) are parsed as their ids, as llama.cpp does with parse_special.

With --llamacpp, every text is also tokenized by llama.cpp (llama-server's /tokenize with
parse_special, from $LLAMACPP_BIN, default ~/.cache/ringllm/llama.cpp/build/bin). "cases" then
holds only texts where llama.cpp and transformers agree; texts where they disagree go to
"llamacpp_differs" with both "ids" (transformers) and "llamacpp_ids" — ringllm follows llama.cpp
there. DIVERGENT below lists the known disagreements (written only with --llamacpp):
- SmolLM2 ("smollm" pre-tokenizer): llama.cpp isolates digits before GPT-2's expression, so a
  run of two or more spaces before a digit stays one piece ("  5" -> "  " "5"); transformers
  splits it GPT-2's way (" " " 5").
- Gemma 3: its GGUF spells runs of spaces with real spaces (user-defined tokens, matched whole
  in the text) where transformers respells them with U+2581; text holding a literal U+2581 next
  to spaces therefore tokenizes differently.

transformers' GGUF reader imports torch at module level but needs it only to load tensors; we
read no tensors, so a stand-in module takes torch's place for the import.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import types
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
OUT = ROOT / "tests" / "fixtures" / "tokens-transformers.json"
LLAMACPP_BIN = pathlib.Path(os.environ.get("LLAMACPP_BIN", pathlib.Path.home() / ".cache/ringllm/llama.cpp/build/bin"))

# The same texts for every model; a model's own chat markup is added per model below.
TEXTS = [
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "  two leading spaces",
    "two  spaces and   three and    four",
    "trailing whitespace   ",
    "   ",
    " ",
    "a",
    "tab\tseparated\tvalues",
    "\ttab first, tab tab\t\tthen text",
    "line one\nline two\n\nafter a blank line\n",
    "\n\n\nthree newlines first",
    "windows\r\nline\r\nendings",
    "mixed \t \n whitespace \n\t run",
    "café naïve résumé",
    "Straße und Fußgänger, Æsir, Øresund, Ångström",
    "e\u0301 (decomposed) vs \u00e9 (composed)",
    "Καλημέρα κόσμε",
    "Привет, мир! Как дела?",
    "中文分词测试",
    "日本語のテキスト、カタカナとひらがな。",
    "한국어 문장입니다",
    "Tiếng Việt có dấu",
    "עברית וערבית: العربية",
    "हिन्दी पाठ",
    "emoji 👍🏽 and family 👨‍👩‍👧 and 🦀",
    "flags 🇫🇷🇯🇵 and ✨🎉🔥",
    "1234567",
    "1234567890 and 3.14159 and 1,000,000",
    "Date: 2026-11-23, time 06:15",
    "x=1+2*3/4-5%6",
    "don't it's we're they'll I'd you've I'm",
    "DON'T IT'S WE'RE",
    "MiXeD CaSe WoRdS",
    "!!!???...",
    "https://example.org/path?query=1&x=y#frag",
    "user@example.com",
    "def add(a, b):\n    return a + b\n",
    "fn main() {\n    let v: Vec<u32> = std::iter::once(1).collect();\n}\n",
    "if (x) {\n\tif (y) {\n\t\treturn 0;\n\t}\n}\n",
    '{"key": "value", "list": [1, 2, 3]}',
    "<html><body>text</body></html>",
    "The quick brown fox jumps over the lazy dog.",
    "antidisestablishmentarianism supercalifragilisticexpialidocious",
    "\u00a0non-breaking\u00a0space and zero\u200bwidth",
    "\u2581literal lower one eighth block",
    "ÿ þ ð ¿ ¡ « » € £ ¥",
    # The texts of tests/fixtures/tokens-llamacpp.json, so the two oracles can be compared.
    "two  spaces and   three",
    "Straße und Fußgänger",
    "Привет, мир!",
    "日本語のテキスト",
    "한국어 문장",
    "1234567890",
    "pi is 3.14159, e is 2.71828",
    "don't it's we're they'll I'd",
]

# Where transformers and llama.cpp disagree (see the docstring).
DIVERGENT = [
    "  5 two spaces before a digit",
    "tab\t\t42 and newline\n\n 7 and   99",
    "\u2581 \u2581\u2581  \u2581x literal blocks next to spaces",
]

CHAT = {
    "smollm2-135m-instruct-q4_1.gguf": [
        "<|im_start|>user\nHi<|im_end|>",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "text<|endoftext|>more",
        "<|im_start|><|im_end|>",
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    ],
    "gemma-3-270m-q4_k_m.gguf": [
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "<bos><start_of_turn>user\nHello<end_of_turn>",
        "text<eos>more",
        "<start_of_turn>user\nHi<end_of_turn>\n",
    ],
}


def stub_torch():
    class _Anything:
        def __getattr__(self, name):
            return _Anything()

        def __call__(self, *args, **kwargs):
            return _Anything()

        def __getitem__(self, key):
            return _Anything()

        def __or__(self, other):
            return _Anything()

        __ror__ = __or__

    stub = types.ModuleType("torch")
    stub.__getattr__ = lambda name: _Anything()
    sys.modules.setdefault("torch", stub)


class LlamaServer:
    """llama-server on a free port, for its /tokenize endpoint."""

    def __init__(self, model):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        env = dict(os.environ, LD_LIBRARY_PATH=str(LLAMACPP_BIN))
        self.proc = subprocess.Popen(
            [str(LLAMACPP_BIN / "llama-server"), "-m", str(MODELS / model), "--port", str(self.port),
             "-c", "256", "-t", "1", "--log-disable"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError("llama-server did not come up")

    def tokenize(self, text):
        body = json.dumps({"content": text, "add_special": False, "parse_special": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/tokenize", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["tokens"]

    def close(self):
        self.proc.terminate()
        self.proc.wait()


def main():
    use_llamacpp = "--llamacpp" in sys.argv[1:]
    import transformers  # noqa: F401  (decides torch is absent before the stand-in exists)

    stub_torch()
    from transformers import PreTrainedTokenizerFast

    out = {}
    for name in sorted(CHAT):
        path = MODELS / name
        if not path.exists():
            sys.exit(f"{path} is missing: run scripts/fetch-models")
        tok = PreTrainedTokenizerFast.from_pretrained(str(MODELS), gguf_file=name)
        empty_with_special = tok.encode("", add_special_tokens=True)
        server = LlamaServer(name) if use_llamacpp else None
        cases, differs = [], []
        try:
            for text in TEXTS + CHAT[name] + (DIVERGENT if server else []):
                ids = tok.encode(text, add_special_tokens=False)
                case = {"text": text, "ids": ids}
                theirs = server.tokenize(text) if server else ids
                if theirs == ids:
                    cases.append(case)
                else:
                    case["llamacpp_ids"] = theirs
                    differs.append(case)
                    if text not in DIVERGENT:
                        print(f"{name}: llama.cpp and transformers disagree on {text!r}", file=sys.stderr)
        finally:
            if server:
                server.close()
        out[name] = {
            "transformers": transformers.__version__,
            "llamacpp_checked": bool(server),
            "bos_prefix": empty_with_special,
            "cases": cases,
            "llamacpp_differs": differs,
        }
        note = f", llama.cpp differs on {len(differs)}" if server else ""
        print(f"{name}: {len(cases)} texts, bos_prefix {empty_with_special}{note}", file=sys.stderr)
    OUT.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
