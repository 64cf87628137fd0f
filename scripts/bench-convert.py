#!/usr/bin/env python3
"""`ringllm convert` speed against the disk's sequential write rate.

Writes a random Llama-layout BF16 checkpoint of about 1 GB (--gb; two shards and an index, as
`transformers` saves one) into DIR, measures the disk with `dd ... conv=fdatasync` (1 GiB), then
converts the checkpoint to f16, q8_0 and q4_k_m (each output written and fsync'ed into DIR),
printing each rate beside the disk's and the CPU's name. Needs numpy (tests/requirements.txt).

    target/test-venv/bin/python scripts/bench-convert.py --dir /tmp/bench-convert [--gb 1]
"""

import argparse
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
import hf_reference  # noqa: E402


def cpu_name():
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = re.search(r"Model name:\s*(.*)", out)
    l3 = re.search(r"L3 cache:\s*(.*)", out)
    return f"{name.group(1).strip() if name else '?'} (L3 {l3.group(1).strip() if l3 else '?'})"


def write_bf16_checkpoint(path, gb, seed=1):
    """A Llama-layout checkpoint of about `gb` GB of BF16 weights in two shards."""
    d, ff = 2048, 5632
    per_layer = 2 * (2 * d * d + 2 * d * 512 + 3 * d * ff)
    embd = 2 * 2 * 32000 * d
    n_layer = max(1, round((gb * 1e9 - embd) / per_layer))
    dims = dict(hidden_size=d, intermediate_size=ff, num_attention_heads=16, num_key_value_heads=4, head_dim=128)
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tj, n_tokens = hf_reference.bpe_tokenizer(hf_reference.LLAMA3_RE, specials)
    (path / "tokenizer.json").write_text(json.dumps(tj))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": specials[0], "eos_token": specials[2]}))
    cfg = hf_reference.config("llama", 32000, n_layer, dims)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    shapes = list(hf_reference.hf_tensor_shapes("llama", cfg).items())
    rng = np.random.default_rng(seed)
    half = len(shapes) // 2
    weight_map = {}
    for s, part in enumerate([shapes[:half], shapes[half:]]):
        fname = f"model-{s + 1:05d}-of-00002.safetensors"
        header, off = {}, 0
        for name, shape in part:
            n = math.prod(shape) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        with open(path / fname, "wb") as f:
            f.write(len(h).to_bytes(8, "little") + h)
            for name, shape in part:
                scale = 1.0 / math.sqrt(shape[-1]) if len(shape) == 2 else 0.1
                base = 0.0 if len(shape) == 2 else 1.0
                v = (base + scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
                f.write((v.view(np.uint32) >> 16).astype("<u2").tobytes())
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sum((path / f).stat().st_size for f in set(weight_map.values()))


def dd_rate(path):
    f = path / "dd.bin"
    r = subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=1M", "count=1024", "conv=fdatasync"],
                       capture_output=True, text=True)
    f.unlink()
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", r.stderr)
    return int(m.group(1)) / float(m.group(2)) / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, type=pathlib.Path)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--bin", default=os.environ.get("RINGLLM_BIN", ROOT / "target" / "release" / "ringllm"))
    ap.add_argument("--types", default="f16,q8_0,q4_k_m")
    a = ap.parse_args()
    src = a.dir / "hf"
    if not (src / "config.json").exists():
        t = time.time()
        size = write_bf16_checkpoint(src, a.gb)
        print(f"checkpoint: {size / 1e9:.2f} GB of BF16 in {time.time() - t:.0f} s", flush=True)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"CPU: {cpu_name()}")
    disk = dd_rate(a.dir)
    print(f"disk (dd bs=1M count=1024 conv=fdatasync): {disk:.0f} MB/s")
    for ty in a.types.split(","):
        out = a.dir / f"out-{ty}.gguf"
        subprocess.run(["sync"])
        t = time.time()
        subprocess.run([str(a.bin), "convert", src, "-o", out, "--type", ty], check=True, capture_output=True)
        secs = time.time() - t
        written = out.stat().st_size
        print(f"convert --type {ty}: {size / 1e9:.2f} GB read, {written / 1e9:.2f} GB written in {secs:.1f} s: "
              f"{written / 1e6 / secs:.0f} MB/s written ({written / 1e6 / secs / disk:.2f}x the disk), "
              f"{size / 1e6 / secs:.0f} MB/s read", flush=True)
        out.unlink()
    disk = dd_rate(a.dir)
    print(f"disk again: {disk:.0f} MB/s")


if __name__ == "__main__":
    main()
