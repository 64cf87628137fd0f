"""`ringllm convert`: tiny random Hugging Face checkpoints (written here with numpy + safetensors,
see hf_reference.py) converted to GGUF, run by ringllm, and compared with the NumPy reference
forward pass reading the safetensors directly with the Hugging Face modelling semantics.

Budgets: converted to F32, our engine computes in f32 without 8-bit activations, so its logits
are within F32_LOGIT_REL (max abs difference over the largest logit) of the float64 reference;
the GGUF itself, run by reference.py through PyPI's `gguf`, is within GGUF_LOGIT_REL (float64
on both sides: only the f32 rounding of the stored values). Quantized outputs (q8_0, the
q4_k_m mix) are held to support/compare.py's LOGIT_REL against the float reference.
"""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
from gguf import GGUFReader

import hf_reference
import reference
from support.cli import forward_dump, ringllm, run
from support.compare import compare
from support.paths import load_fixture

ARCHS = ["llama", "qwen2", "gemma3", "qwen3"]
F32_LOGIT_REL = 2e-5
GGUF_LOGIT_REL = 1e-6
# llama.cpp on the converted F32 file against the float64 reference over the safetensors: its
# float32 arithmetic (and its f16 GELU table) only, as test_arch_llamacpp.py budgets it; our
# engine no further from llama.cpp than twice that (or a floor when llama.cpp sits almost on the
# float64 answer).
LLAMACPP_REF_REL = 1e-3
LLAMACPP_FLOOR_REL = 2e-5


def convert(src, out, ty="f32"):
    return run(["convert", src, "-o", out, "--type", ty])


def tokens_for(n_tokens, n=21, seed=4):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, n_tokens, size=n)]


def max_rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def layers(arch):
    return 6 if arch == "gemma3" else 2  # gemma3: five local layers, then a global one


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_model_matches_the_checkpoint(arch, tmp_path):
    src = tmp_path / "hf"
    cfg, n_tokens = hf_reference.write_checkpoint(src, arch, seed=11, n_layer=layers(arch),
                                                  shards=2 if arch == "llama" else 1)
    out = tmp_path / "m.gguf"
    r = convert(src, out)
    assert "wrote" in r.stderr and out.exists() and not (tmp_path / "m.gguf.part").exists()
    toks = tokens_for(n_tokens)
    want = hf_reference.forward(src, toks)[:, :n_tokens]

    # The file itself, read by PyPI's gguf and run by reference.py.
    g = reference.load(str(out))
    assert g.arch == arch
    got_ref, _ = reference.forward(g, toks)
    e = max_rel(got_ref[:, :n_tokens], want)
    assert e < GGUF_LOGIT_REL, f"{arch}: the GGUF's reference logits differ from the checkpoint's by {e:.2e}"

    ours = forward_dump(out, toks, tmp_path / "dump", "--threads", "2", "--batch", "7")["logits"]
    e = max_rel(ours[:, :n_tokens], want)
    assert e < F32_LOGIT_REL, f"{arch}: our logits differ from the checkpoint's by {e:.2e}"
    assert (ours[:, :n_tokens].argmax(1) == want.argmax(1)).all()

    # Tokenizer and template came along: the model runs from text, and chats.
    res = json.loads(run(["run", "-m", out, "-p", "hello world", "--json", "--temp", "0", "-n", "3"]).stdout)
    assert res["prompt_token_ids"] and len(res["token_ids"]) >= 1
    f = GGUFReader(str(out))
    meta = {k: f.fields[k].contents() for k in ("tokenizer.chat_template", "tokenizer.ggml.model")}
    assert meta["tokenizer.chat_template"] == hf_reference.TEMPLATE
    assert meta["tokenizer.ggml.model"] == ("llama" if arch == "gemma3" else "gpt2")
    n_vocab = int(f.fields[f"{arch}.vocab_size"].contents()) if arch == "llama" else None
    if n_vocab is not None:
        assert n_vocab == cfg["vocab_size"]


# Relative L2 error of a random N(0, 1/n) matrix stored in each type (about twice what the
# formats give on such data).
TYPE_REL = {"F16": 1e-3, "Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.05, "Q5_0": 0.07, "Q4_K": 0.1}
BIG = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("arch,ty", [("llama", "q8_0"), ("qwen2", "q4_k_m"), ("gemma3", "q4_k_m"), ("gemma3", "f16")])
def test_quantized_conversion(arch, ty, tmp_path):
    """Each matrix in the type the mix gives it (q4_k_m: llama.cpp's Q4_K_M rules, on rows of
    256 so the K-quants apply), within its format's error of the F32 conversion; and our engine
    runs the file within support/compare.py's budgets of the reference reading that file."""
    src = tmp_path / "hf"
    dims = BIG if ty == "q4_k_m" else None
    _, n_tokens = hf_reference.write_checkpoint(src, arch, seed=12, n_layer=layers(arch), dims=dims)
    out, f32 = tmp_path / "m.gguf", tmp_path / "f32.gguf"
    convert(src, out, ty)
    convert(src, f32, "f32")
    q, ref = reference.load(str(out)), reference.load(str(f32))
    types = {n: t.tensor_type.name for n, t in q.tensors.items()}
    assert sorted(types) == sorted(ref.tensors)
    for name, t in types.items():
        if len(q.tensors[name].shape) == 1:
            assert t == "F32", name
            assert np.array_equal(q.f32(name), ref.f32(name)), name
            continue
        want = {"q8_0": "Q8_0", "f16": "F16"}.get(ty)
        if ty == "q4_k_m":
            # llama.cpp's Q4_K_M: Q6_K for the head (here the tied embedding) and for attn_v and
            # ffn_down in the first and last eighth of the layers and every third between.
            n = layers(arch)
            il = int(name.split(".")[1]) if name.startswith("blk.") else -1
            more = name.endswith(("attn_v.weight", "ffn_down.weight")) and (
                il < n // 8 or il >= 7 * n // 8 or (il - n // 8) % 3 == 2)
            head = name in ("output.weight", "token_embd.weight")
            want = "Q6_K" if more or head else "Q4_K"
        assert t == want, f"{name}: {t}, want {want}"
        e = np.linalg.norm(q.f32(name) - ref.f32(name)) / np.linalg.norm(ref.f32(name))
        assert e < TYPE_REL[t], f"{name} in {t}: relative error {e:.4f}"
    toks = tokens_for(n_tokens, seed=5)
    ours = forward_dump(out, toks, tmp_path / "dump", "--threads", "2")
    compare(ours, q, toks, f"converted {arch} {ty}")


def test_phi3_fused_matrices_in_the_q4_k_m_mix(tmp_path):
    """Phi-3's fused matrices stay fused (attn_qkv with Q, K and V rows, ffn_up with gate and
    up rows) and take llama.cpp's Q4_K_M types: Q5_K for attn_qkv; each within its format's
    error of the F32 conversion (read with PyPI gguf, whatever runs phi3)."""
    src = tmp_path / "hf"
    hf_reference.write_checkpoint(src, "phi3", seed=9, dims=dict(BIG, head_dim=None))
    out, f32 = tmp_path / "m.gguf", tmp_path / "f32.gguf"
    convert(src, out, "q4_k_m")
    convert(src, f32, "f32")
    q = {t.name: t for t in GGUFReader(str(out)).tensors}
    ref = {t.name: t for t in GGUFReader(str(f32)).tensors}
    d, ff = BIG["hidden_size"], BIG["intermediate_size"]
    assert [int(x) for x in q["blk.0.attn_qkv.weight"].shape] == [d, d + 2 * d // 2]
    assert [int(x) for x in q["blk.1.ffn_up.weight"].shape] == [d, 2 * ff]
    want = {"blk.0.attn_qkv.weight": "Q5_K", "blk.0.ffn_up.weight": "Q4_K", "blk.0.ffn_down.weight": "Q4_K",
            "blk.1.ffn_down.weight": "Q6_K", "output.weight": "Q6_K", "token_embd.weight": "Q4_K"}
    for name, ty in want.items():
        assert q[name].tensor_type.name == ty, f"{name}: {q[name].tensor_type.name}, want {ty}"
        a, b = reference.dequantize_tensor(q[name]), reference.dequantize_tensor(ref[name])
        e = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert e < TYPE_REL.get(ty, 0.05), f"{name} in {ty}: relative error {e:.4f}"


def test_bf16_and_f16_checkpoints_give_the_same_file_as_f32(tmp_path):
    """The same values stored as BF16, F16 and F32 convert to the same F32 GGUF bytes."""
    outs = []
    for name, dt in [("f16", np.float16), ("f32", np.float32)]:
        src = tmp_path / name
        hf_reference.write_checkpoint(src, "qwen2", seed=3, dtype=dt)
        if name == "f32":  # the f32 copy holds the f16-rounded values
            w = hf_reference.load_safetensors(tmp_path / "f16")
            hf_reference.save_file({k: v.astype(np.float32) for k, v in w.items()}, str(src / "model.safetensors"))
        out = tmp_path / f"{name}.gguf"
        convert(src, out)
        outs.append(out.read_bytes())
    # BF16: written by hand (numpy has no bfloat16): the top halves of the f32 values.
    src = tmp_path / "bf16"
    hf_reference.write_checkpoint(src, "qwen2", seed=3)
    w = hf_reference.load_safetensors(src)
    rounded = {k: (v.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32) for k, v in w.items()}
    write_raw_safetensors(src / "model.safetensors",
                          {k: ("BF16", v.shape, (v.view(np.uint32) >> 16).astype("<u2").tobytes())
                           for k, v in rounded.items()})
    ref = tmp_path / "bf16-as-f32"
    shutil.copytree(src, ref)
    hf_reference.save_file(rounded, str(ref / "model.safetensors"))
    convert(src, tmp_path / "bf16.gguf")
    convert(ref, tmp_path / "bf16-as-f32.gguf")
    assert (tmp_path / "bf16.gguf").read_bytes() == (tmp_path / "bf16-as-f32.gguf").read_bytes()
    assert outs[0] == outs[1]


def test_phi3_longrope_factors_are_written(tmp_path):
    """Phi-3 128k's LongRoPE: rope_scaling's long and short factors become the
    rope_factors_long/short tensors, and the attention factor sqrt(1 + ln(s) / ln(orig)) for a
    context extended s times."""
    half = hf_reference.DIMS["head_dim"] // 2
    long = [1.0 + 0.5 * i for i in range(half)]
    short = [1.0 + 0.01 * i for i in range(half)]
    extra = dict(max_position_embeddings=1024, original_max_position_embeddings=256,
                 rope_scaling={"type": "longrope", "long_factor": long, "short_factor": short})
    src = tmp_path / "hf"
    hf_reference.write_checkpoint(src, "phi3", seed=3, extra=extra)
    out = tmp_path / "m.gguf"
    convert(src, out)
    g = GGUFReader(str(out))
    t = {x.name: x for x in g.tensors}
    assert np.array_equal(np.asarray(t["rope_factors_long.weight"].data), np.float32(long))
    assert np.array_equal(np.asarray(t["rope_factors_short.weight"].data), np.float32(short))
    attn = g.fields["phi3.rope.scaling.attn_factor"].contents()
    assert abs(attn - np.sqrt(1 + np.log(4) / np.log(256))) < 1e-6
    assert g.fields["phi3.rope.scaling.original_context_length"].contents() == 256
    # A factor list of the wrong length is refused by its key.
    extra["rope_scaling"]["short_factor"] = short[:-1]
    (src / "config.json").write_text(json.dumps(dict(json.loads((src / "config.json").read_text()), **extra)))
    r = ringllm(["convert", src, "-o", out], check=False)
    assert r.returncode != 0 and "rope_scaling.short_factor" in r.stderr, r.stderr


def write_raw_safetensors(path, tensors):
    """A safetensors file written byte by byte: {name: (dtype, shape, bytes)}."""
    header, off, blobs = {}, 0, []
    for k, (dt, shape, b) in tensors.items():
        header[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def _break_missing(src):
    st = src / "model.safetensors"
    w = hf_reference.load_safetensors(src)
    del w["model.layers.1.mlp.up_proj.weight"]
    hf_reference.save_file({k: v.astype(np.float32) for k, v in w.items()}, str(st))


def _break_dtype(src):
    w = hf_reference.load_safetensors(src)
    w = {k: v.astype(np.float32) for k, v in w.items()}
    w["model.layers.0.self_attn.k_proj.weight"] = w["model.layers.0.self_attn.k_proj.weight"].astype(np.int32)
    hf_reference.save_file(w, str(src / "model.safetensors"))


def _break_truncate(src):
    st = src / "model.safetensors"
    b = st.read_bytes()
    st.write_bytes(b[:-100])
    header = json.loads(b[8:8 + int.from_bytes(b[:8], "little")])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    return [f"tensor '{last}'"]


def _break_shape(src):
    w = hf_reference.load_safetensors(src)
    w = {k: v.astype(np.float32) for k, v in w.items()}
    w["model.layers.0.mlp.down_proj.weight"] = w["model.layers.0.mlp.down_proj.weight"][:, :64].copy()
    hf_reference.save_file(w, str(src / "model.safetensors"))


def _break_arch(src):
    c = json.loads((src / "config.json").read_text())
    c["architectures"] = ["GPTNeoXForCausalLM"]
    (src / "config.json").write_text(json.dumps(c))


def _break_config_key(src):
    c = json.loads((src / "config.json").read_text())
    del c["intermediate_size"]
    (src / "config.json").write_text(json.dumps(c))


BREAKS = {
    "missing-tensor": (_break_missing, ["missing tensor 'model.layers.1.mlp.up_proj.weight'"]),
    "bad-dtype": (_break_dtype, ["model.layers.0.self_attn.k_proj.weight", "dtype I32"]),
    "truncated": (_break_truncate, ["truncated shard", "model.safetensors"]),
    "shape": (_break_shape, ["model.layers.0.mlp.down_proj.weight", "[64, 64]", "[64, 128]"]),
    "unknown-arch": (_break_arch, ["GPTNeoXForCausalLM", "LlamaForCausalLM"]),
    "config-key": (_break_config_key, ["config.json", "intermediate_size", "missing"]),
}


@pytest.mark.parametrize("what", list(BREAKS))
def test_bad_checkpoints_are_refused_by_name(what, tmp_path):
    src = tmp_path / "hf"
    hf_reference.write_checkpoint(src, "llama", seed=2)
    brk, wants = BREAKS[what]
    wants = wants + (brk(src) or [])
    out = tmp_path / "m.gguf"
    out.write_bytes(b"an older file")  # kept when the conversion fails
    r = ringllm(["convert", src, "-o", out], check=False)
    assert r.returncode != 0, r.stderr
    for w in wants:
        assert w in r.stderr, f"{what}: {w!r} not in the error:\n{r.stderr}"
    assert out.read_bytes() == b"an older file"
    assert not (tmp_path / "m.gguf.part").exists(), os.listdir(tmp_path)


@pytest.mark.parametrize("arch", list(hf_reference.CLASSES))
def test_llamacpp_runs_the_converted_file(arch, tmp_path):
    """tests/fixtures/convert/<arch>.json holds llama.cpp's logits on the file we make of a
    seeded checkpoint (made by tests/fixtures/make_convert_fixtures.py): that llama.cpp loaded
    and ran it is the check for the architectures nothing else here runs yet; where the NumPy
    reference (hf_reference.RUNNABLE) and our engine (ENGINE_ARCHS) run the architecture, both
    agree with llama.cpp."""
    fx = load_fixture(f"convert/{arch}.json")
    src = tmp_path / "hf"
    hf_reference.write_checkpoint(src, arch, seed=fx["seed"], n_layer=fx["n_layer"])
    out = tmp_path / "m.gguf"
    convert(src, out)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert digest == fx["sha256"], (
        f"{arch}: the converted file is not the one llama.cpp ran: regenerate the fixture "
        "(tests/fixtures/make_convert_fixtures.py) if the converter or the checkpoint writer changed")
    lc = np.asarray(fx["logits"], dtype=np.float64)
    toks = fx["tokens"]
    ll_err = None
    if arch in hf_reference.RUNNABLE:
        want = hf_reference.forward(src, toks)[:, :lc.shape[1]]
        ll_err = max_rel(lc, want)
        assert ll_err < LLAMACPP_REF_REL, f"{arch}: llama.cpp and the checkpoint's reference differ by {ll_err:.2e}"
    if arch in ENGINE_ARCHS:
        ours = forward_dump(out, toks, tmp_path / "dump", "--threads", "2")["logits"][:, :lc.shape[1]]
        e = max_rel(ours, lc)
        budget = max(2 * ll_err, LLAMACPP_FLOOR_REL) if ll_err is not None else LLAMACPP_REF_REL
        assert e <= budget, f"{arch}: our logits and llama.cpp's differ by {e:.2e} (budget {budget:.2e})"
        assert (ours.argmax(1) == lc.argmax(1)).all()


# The architectures our engine runs (the others are converted and checked against llama.cpp
# only, until the engine learns them).
ENGINE_ARCHS = ("llama", "qwen2", "gemma3", "qwen3")
