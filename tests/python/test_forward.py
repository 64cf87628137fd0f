"""Our engine's forward pass against the independent NumPy reference (reference.py, which reads
and dequantizes with PyPI's gguf): per-layer hidden states and final logits, on the real models
and on synthetic random-weight models in every weight type. The two comparisons and their
budgets are stated in support/compare.py.
"""

import os

import numpy as np
import pytest

import reference
from support.cli import forward_dump, run
from support.compare import compare, ref_model, rel_l2
from support.paths import GEMMA, SMOL, model_path

# Token ids used as inputs (any ids are valid forward-pass inputs). The first list of each
# model is "The capital of France is" as llama.cpp tokenizes it (tests/fixtures).
PROMPTS = {
    GEMMA.name: [
        [2, 818, 5279, 529, 7001, 563],
        [2, 2094, 24778, 236769, 236749, 1473, 107, 140, 584, 538, 655, 236743, 236778, 236787],
        [2, 12055, 3324, 496, 990, 236764, 528, 496, 1944, 10280, 236764],
    ],
    SMOL.name: [
        [504, 3575, 282, 4649, 314],
        [1, 4093, 198, 6121, 314, 216, 34, 50, 34, 47, 2, 198, 1, 520, 9531, 198],
        [9700, 2030, 253, 655, 28, 281, 253, 1165, 5960, 28],
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [GEMMA.name, SMOL.name])
def test_real_model_matches_reference(name, tmp_path):
    path = model_path(name)
    m = ref_model(path)
    for i, toks in enumerate(PROMPTS[name]):
        ours = forward_dump(path, toks, tmp_path / f"p{i}", "--threads", "2")
        compare(ours, m, toks, f"{name} prompt {i}")


@pytest.mark.parametrize("name", [GEMMA.name, SMOL.name])
def test_batch_size_does_not_change_the_answer(name, tmp_path):
    """Prefill in one batch, in batches of 3 and token by token: same argmax everywhere,
    logits within a tight budget (only the order of float sums may differ)."""
    path = model_path(name)
    toks = PROMPTS[name][1]
    base = forward_dump(path, toks, tmp_path / "b512", "--batch", "512")
    for b in ["3", "1"]:
        other = forward_dump(path, toks, tmp_path / f"b{b}", "--batch", b)
        err = np.abs(other["logits"] - base["logits"]).max() / np.abs(base["logits"]).max()
        assert err < 1e-3, f"batch {b}: logits relative error {err}"
        assert (other["logits"].argmax(1) == base["logits"].argmax(1)).all()


WEIGHT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"]


# The small synthetic models (`debug synth --arch`), each of the real structure of its family.
SYNTH_ARCHS = ["llama", "gemma3", "qwen3", "gemma4", "phi3", "gemma2", "mistral3", "qwen3moe", "mixtral", "gpt-oss"]


@pytest.mark.parametrize("arch", SYNTH_ARCHS)
@pytest.mark.parametrize("ty", WEIGHT_TYPES)
def test_synthetic_model_matches_reference(arch, ty, tmp_path):
    f = tmp_path / f"{arch}-{ty}.gguf"
    run(["debug", "synth", "--arch", arch, "--type", ty, "--seed", "3", "-o", f])
    m = reference.load(str(f))
    rng = np.random.default_rng(5)
    toks = [1] + [int(t) for t in rng.integers(3, m.vocab, size=23)]  # longer than gemma's window
    ours = forward_dump(f, toks, tmp_path / "dump", "--threads", "2", "--batch", "7")
    compare(ours, m, toks, f"synthetic {arch} {ty}")


def cpu_flags():
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# Each kernel level and the CPU flags it needs (kernels/src/dispatch.rs).
ISA_LEVELS = {
    "scalar": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "vnni": {"avx2", "fma", "f16c", "avx_vnni"},  # or AVX-512 VNNI with VL, below
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
}


def level_available(level):
    f = cpu_flags()
    if level == "vnni" and {"avx2", "fma", "f16c", "avx512_vnni", "avx512vl"} <= f:
        return True
    return ISA_LEVELS[level] <= f


@pytest.mark.slow
@pytest.mark.parametrize("level", list(ISA_LEVELS))
def test_every_kernel_level_matches_reference(level, tmp_path):
    """Every kernel level this CPU has, forced with RINGLLM_ISA, passes the same comparisons
    with prompts long enough for the prefill kernels (more than 8 rows: the GEMM kernels at
    the avx512 level) on SmolLM2 and on synthetic models in the legacy formats and the K-quants
    Gemma 3 270M's file holds (Q4_K, Q6_K; Gemma 3 itself runs at the best level in the other
    tests: at the scalar level its 262k-row head alone took most of a minute of CI)."""
    if not level_available(level):
        pytest.skip(f"this CPU lacks the {level} level")
    best = next(lv for lv in ["avx512", "vnni", "avx2", "scalar"] if level_available(lv))
    if level == best and "RINGLLM_ISA" not in os.environ:
        pytest.skip(f"{level} is this CPU's best level: the other tests of this file run at it")
    env = dict(os.environ, RINGLLM_ISA=level)
    path = model_path(SMOL.name)
    toks = PROMPTS[SMOL.name][1]
    assert len(toks) > 8
    ours = forward_dump(path, toks, tmp_path / SMOL.name, "--threads", "2", env=env)
    compare(ours, ref_model(path), toks, f"{SMOL.name} at {level}")
    for arch, ty in [("llama", "Q4_1"), ("gemma3", "Q5_0"), ("llama", "Q8_0"), ("gemma3", "Q4_K"),
                     ("llama", "Q6_K")]:
        f = tmp_path / f"{arch}-{ty}.gguf"
        run(["debug", "synth", "--arch", arch, "--type", ty, "--seed", "3", "-o", f])
        m = reference.load(str(f))
        rng = np.random.default_rng(6)
        toks = [1] + [int(t) for t in rng.integers(3, m.vocab, size=23)]
        ours = forward_dump(f, toks, tmp_path / f"{arch}-{ty}", "--threads", "2", env=env)
        compare(ours, m, toks, f"synthetic {arch} {ty} at {level}")


@pytest.mark.parametrize("name", [GEMMA.name, SMOL.name])
def test_repacked_weights_give_the_same_bits(name, tmp_path):
    """Weights repacked into panels at load (the default where the avx512 level reads them)
    give every hidden state and logit bit for bit as the file's layout (--no-repack), in one
    prefill batch and token by token; the log says how much was repacked."""
    path = model_path(name)
    toks = PROMPTS[name][1]
    if not level_available("avx512"):
        pytest.skip("this CPU has no kernel that reads panels (avx512 level)")
    r = run(["debug", "forward", "-v", "-m", path, "--tokens", ",".join(map(str, toks)), "--dump", tmp_path / "log"])
    assert "weights repacked into panels" in r.stderr, r.stderr[-2000:]
    for batch in ["512", "1"]:
        packed = forward_dump(path, toks, tmp_path / f"p{batch}", "--batch", batch)
        mapped = forward_dump(path, toks, tmp_path / f"m{batch}", "--batch", batch, "--no-repack")
        assert packed.keys() == mapped.keys()
        for k in packed:
            assert np.array_equal(packed[k], mapped[k]), f"{name} batch {batch}: {k} differs with --no-repack"


# Gemma 4's recipe differs by layer: test_gemma4_every_step_matches_reference_on_f32_weights.
@pytest.mark.parametrize("arch", [a for a in SYNTH_ARCHS if a != "gemma4"])
def test_every_step_matches_reference_on_f32_weights(arch, tmp_path):
    """`debug forward --steps` on a synthetic F32 model (no 8-bit activations on this path):
    every step of every layer the reference also names within STEP_REL of the float64
    reference, in the order the recipe ran them; a failure names the first step to part. The
    dumped steps are the recipe's (the same names and order in every layer of a kind) and the
    layer outputs are the last step's residual stream."""
    STEP_REL = 1e-4
    f = tmp_path / f"{arch}.gguf"
    run(["debug", "synth", "--arch", arch, "--type", "F32", "--seed", "3", "-o", f])
    m = reference.load(str(f))
    # Longer than the windows (gemma3 8, phi3 32).
    toks = [1] + list(range(5, 25 if arch != "phi3" else 45))
    ref_steps = {}
    reference.forward(m, toks, logit_rows=[], steps=ref_steps)
    out = tmp_path / "dump"
    forward_dump(f, toks, out, "--threads", "2", "--batch", "7", "--steps")
    import json

    order = json.loads((out / "steps.json").read_text())
    per_layer = {}
    for key in order:
        il = int(key.split(".")[1])
        per_layer.setdefault(il, []).append(".".join(key.split(".")[2:]))
        if key in ref_steps:
            e = rel_l2(np.load(out / f"{key}.npy"), ref_steps[key])
            assert e < STEP_REL, f"synthetic {arch}: first step to part from the reference: {key} ({e:.2e})"
    assert sorted(per_layer) == list(range(m.n_layer))
    assert all(v == per_layer[0] for v in per_layer.values()), per_layer
    want = ["attn_norm.xn", "qkv.q", "qkv.k", "qkv.v"]  # phi3: from its fused matrix
    if arch == "gpt-oss":
        want += ["qkv_bias.q", "qkv_bias.k", "qkv_bias.v"]
    if arch in ("gemma3", "qwen3", "qwen3moe"):
        want += ["qk_norm.q", "qk_norm.k"]
    want += ["rope.q", "rope.k", "attention.att", "attn_out.o"]
    if arch == "gpt-oss":
        want += ["attn_out_bias.o"]
    want += ["attn_residual.x", "ffn_norm.xn"]
    if arch in ("qwen3moe", "mixtral", "gpt-oss"):
        # The router's picks are no buffer of the engine's; the experts' weighted sum is `o`.
        want += ["experts.o", "ffn_residual.x"]
    else:
        want += ["gate_up.gate", "gate_up.up", "glu.gate", "ffn_down.o", "ffn_residual.x"]
    assert per_layer[0] == want
    assert all(f"layer.{il}.{s}" in ref_steps for il in per_layer for s in want), "the reference names fewer steps"
    for il in range(m.n_layer):
        assert np.array_equal(np.load(out / f"layer.{il}.npy"), np.load(out / f"layer.{il}.ffn_residual.x.npy"))


def test_gemma4_every_step_matches_reference_on_f32_weights(tmp_path):
    """Gemma 4's recipe differs by layer: sliding and full layers (head sizes 32 and 64), a
    full layer without a V projection (V from K), three shared-KV layers that compute only Q and
    attend over an earlier layer's cache, per-layer embedding inputs and the output scale. Every
    step of every layer within STEP_REL of the float64 reference, each layer's steps as its
    kind asks, in order."""
    STEP_REL = 1e-4
    f = tmp_path / "gemma4.gguf"
    run(["debug", "synth", "--arch", "gemma4", "--type", "F32", "--seed", "3", "-o", f])
    m = reference.load(str(f))
    assert m.is_swa == [True, True, False, True, True, False]
    assert m.kv_source == [None, None, None, 1, 1, 2]
    toks = [1] + list(range(5, 25))  # longer than the window of 8
    ref_steps = {}
    ref_logits, _ = reference.forward(m, toks, steps=ref_steps)
    out = tmp_path / "dump"
    ours = forward_dump(f, toks, out, "--threads", "2", "--batch", "7", "--steps")
    import json

    order = json.loads((out / "steps.json").read_text())
    per_layer = {}
    for key in order:
        il = int(key.split(".")[1])
        per_layer.setdefault(il, []).append(".".join(key.split(".")[2:]))
        assert key in ref_steps, f"the reference does not name {key}"
        e = rel_l2(np.load(out / f"{key}.npy"), ref_steps[key])
        assert e < STEP_REL, f"synthetic gemma4: first step to part from the reference: {key} ({e:.2e})"
    tail = ["attn_out.o", "attn_residual.x", "ffn_norm.xn", "gate_up.gate", "gate_up.up", "glu.gate",
            "ffn_down.o", "ffn_residual.x", "per_layer_input.x", "out_scale.x"]
    own = ["attn_norm.xn", "qkv.q", "qkv.k", "qkv.v", "qk_norm.q", "qk_norm.k", "v_norm.v", "rope.q", "rope.k",
           "attention.att"] + tail
    v_from_k = ["attn_norm.xn", "qk_proj.q", "qk_proj.k", "v_from_k.v", "qk_norm.q", "qk_norm.k", "v_norm.v",
                "rope.q", "rope.k", "attention.att"] + tail
    shared = ["attn_norm.xn", "q_proj.q", "q_norm.q", "rope_q.q", "shared_attention.att"] + tail
    assert per_layer == {0: own, 1: own, 2: v_from_k, 3: shared, 4: shared, 5: shared}, per_layer
    e = np.abs(ours["logits"] - ref_logits).max() / np.abs(ref_logits).max()
    assert e < STEP_REL, f"logits differ from the reference by {e:.2e}"


@pytest.mark.parametrize("ctx", [16, 64])
def test_phi3_longrope_factors_follow_the_context(ctx, tmp_path):
    """Phi-3's LongRoPE: a runner whose context fits the original one (16 in the small model)
    rotates with the short factors, a longer one with the long factors (as llama.cpp picks
    them); each against the reference told the same context. The two runs' logits differ, so
    the choice is seen."""
    f = tmp_path / "phi3.gguf"
    run(["debug", "synth", "--arch", "phi3", "--type", "F32", "--seed", "5", "-o", f])
    m = reference.load(str(f))
    assert m.rope_orig_ctx == 16 and abs(m.rope_attn_factor - 2 ** 0.5) < 1e-6
    toks = [1] + list(range(40, 52))
    ours = forward_dump(f, toks, tmp_path / "dump", "--threads", "2", "--ctx", str(ctx))
    compare(ours, m, toks, f"phi3 ctx {ctx}", ctx=ctx)
    other, _ = reference.forward(m, toks, ctx=80 - ctx)
    assert np.abs(other - ours["logits"]).max() > 1e-2 * np.abs(other).max()
