#!/usr/bin/env python3
"""Independent NumPy reference forward pass for GGUF models: the oracle for ringllm.

Reads a GGUF file with PyPI's `gguf` (GGUFReader), dequantizes every tensor with
`gguf.quants.dequantize` and runs a full causal forward pass over a token sequence from
position 0. Everything is computed in float64 (weights are dequantized to float32 exactly as
stored, then widened once to float64 and cached per Model); results are handed back as
float32.

Architectures:
  llama / mistral  RMSNorm, GQA, SwiGLU, interleaved ("normal") RoPE on pairs (2i, 2i+1)
                   (llama.cpp's converter permutes Q/K rows so that this applies in the GGUF
                   layout), optional `rope_freqs.weight` frequency factors, optional biases.
  mistral3         as llama (Mistral Small 3.x as llama.cpp converts it). For llama, mistral and
                   mistral3 files that set `attention.sliding_window` (HF MistralConfig's
                   sliding_window, Mistral 7B v0.1), every layer attends to the last `window`
                   positions (key allowed iff q - k < window).
  qwen2            as llama but NeoX RoPE (pairs (i, i + n_rot/2)) and Q/K/V biases.
  gemma3           x*sqrt(d) embedding scale, sandwich norms (post-attention / post-FFN
                   RMSNorms), per-head QK RMSNorm, NeoX RoPE, GeGLU with tanh GELU, 5:1
                   local:global layers (layer i is global iff i % 6 == 5) where local layers use
                   RoPE base 10000 and a sliding window (key allowed iff q - k < window) and
                   global layers use `gemma3.rope.freq_base` (+ optional linear rope scaling),
                   query scale 1/sqrt(key_length) (1/sqrt(d/n_head) for the 62-layer 27B),
                   tied output embedding, optional final logit soft-capping (absent in Gemma 3
                   files). The norm weights are used as stored: llama.cpp's converter has
                   already added Gemma's +1 offset.
  qwen3            as llama with NeoX RoPE, no biases, and an RMSNorm over every head of Q and
                   K (`attn_q_norm`, `attn_k_norm`, HF Qwen3Attention's q_norm/k_norm) before
                   RoPE; head size `attention.key_length` (128, not d/n_head); tied head on the
                   small sizes.
  qwen3moe         (Qwen3-30B-A3B, Qwen3-235B-A22B) the qwen3 layer whose FFN is the
                   mixture of experts below.
  gemma4           the dense Gemma 4 sizes: reference_gemma4.py (per-layer head sizes, shared-KV
                   layers, V-norm and V from K, proportional RoPE, per-layer embeddings, layer
                   output scale, attention scale 1, final logit soft-capping).
  phi3             Hugging Face's Phi3ForCausalLM: the llama block with Q, K, V in one matrix
                   (`attn_qkv`, output rows [q | k | v]) and gate and up in one (`ffn_up`,
                   rows [gate | up], SwiGLU: silu(gate) * up), NeoX RoPE. LongRoPE (the 128k
                   models): inverse frequencies divided by `rope_factors_long` when the context
                   is longer than `rope.scaling.original_context_length`, else by
                   `rope_factors_short` (llama.cpp decides by the context size, Hugging Face by
                   the sequence length: the same thing for a context sized to the prompt), and
                   cos and sin multiplied by `rope.scaling.attn_factor`. A sliding window on
                   every layer (key allowed iff q - k < window) when
                   `attention.sliding_window` is below the training context.
  gemma2           (HF Gemma2Model) x*sqrt(d) embedding scale, sandwich norms, NeoX RoPE with one
                   base for all layers, GeGLU with tanh GELU, no QK-norm; even layers local
                   (sliding window, `attention.sliding_window`, default 4096), odd layers global
                   (`attention.sliding_window_pattern` when present, as for gemma3); attention
                   scores (q.k scaled by 1/sqrt(head_dim), 1/sqrt(d/n_head) for the 46-layer
                   27B) soft-capped as c*tanh(s/c) before the mask and softmax with c =
                   `attn_logit_softcapping` (default 50), logits soft-capped by
                   `final_logit_softcapping` (default 30); tied output embedding.
  gpt-oss          (OpenAI gpt-oss-20b/120b, llama.cpp's LLM_ARCH_OPENAI_MOE) RMSNorm `attn_norm`
                   before attention, Q/K/V/O with biases, NeoX RoPE with YaRN (below), head size
                   `attention.key_length`, query scale 1/sqrt(n_rot), a learned per-head sink
                   logit in every attention softmax (`attn_sinks`, below), layers alternating
                   sliding-window / full (even layers i % 2 == 0 local with key allowed iff
                   q - k < `attention.sliding_window`, odd layers global; an
                   `attention.sliding_window_pattern` key overrides as for gemma3), the RMSNorm
                   `post_attention_norm` as the FFN's input norm (no sandwich: gpt-oss has no
                   ffn_norm), the mixture-of-experts FFN below in its gpt-oss form, untied head.
                   Sinks: for query head h with scaled, masked scores s_j (q.k/sqrt(n_rot)) and
                   the unscaled sink logit z = attn_sinks[h], p_j = exp(s_j - M) / (Σ_i exp(s_i -
                   M) + exp(z - M)), M = max(max_j s_j, z): the sink takes probability mass but
                   contributes no value.
                   YaRN (`rope.scaling.type` = "yarn", as llama.cpp's ggml rope_yarn): with
                   s = 1/`rope.scaling.factor`, pair i's angle is θ = p·b^(-2i/n_rot) blended
                   between interpolation s·θ and extrapolation θ: (1 - r_i)·s·θ + r_i·θ, r_i =
                   1 - clamp((i - lo)/max(0.001, hi - lo), 0, 1), lo = max(0, floor(c(32))), hi =
                   min(n_rot - 1, ceil(c(1))), c(β) = n_rot·ln(n_orig/(2πβ))/(2 ln b), n_orig =
                   `rope.scaling.original_context_length` (default `context_length`); cos and sin
                   are multiplied by (1 + 0.1 ln(1/s))·`rope.scaling.attn_factor` (llama.cpp's
                   context first divides its yarn_attn_factor by that same 1 + 0.1 ln(1/s) for
                   s < 1 and ggml multiplies it back). Local layers use `rope.freq_base_swa`
                   (default `rope.freq_base`) and the file's scale s even when the type is "none".

Mixture of experts (qwen3moe; `llama` files with `llama.expert_count` > 0: Mixtral), as
llama.cpp's build_moe_ffn runs it for these two architectures. Per token, on the FFN input xn:
router logits W_router·xn (`ffn_gate_inp`, E = `expert_count` rows), p = softmax(logits), the k =
`expert_used_count` experts of largest p (ties: the lower expert index first; llama.cpp's
std::sort leaves ties unspecified), weights w = p[picked] / max(Σ p[picked], 2^-14) (both
architectures renormalize: llama.cpp passes norm_w = true and reads neither
`expert_weights_norm` nor `expert_weights_scale` for them, so neither key is applied), and the
output Σ_j w_j · W_down[e_j]·(silu(W_gate[e_j]·xn) ⊙ W_up[e_j]·xn) with the stacked
`ffn_{gate,up,down}_exps` tensors (numpy shapes [E, n_out, n_in], each expert a contiguous
matrix). No shared expert, no biases. Every expert matmul rounds its input rows like any
other matmul with act_quant (the format of the stacked tensor's type).

gpt-oss's mixture of experts (build_moe_ffn with LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT,
norm_w = false, LLM_FFN_SWIGLU_OAI_MOE): router logits W_router·xn + b_router, the k experts of
largest logit (ties: lower index first), weights w = softmax over the k picked logits only (no
renormalization; `expert_weights_scale` is never loaded for gpt-oss, so no scale), and the output
Σ_j w_j · (W_down[e_j]·swiglu_oai(W_gate[e_j]·xn + b_gate[e_j], W_up[e_j]·xn + b_up[e_j]) +
b_down[e_j]) with swiglu_oai(g, u) = g'·sigmoid(α·g')·(u' + 1), g' = min(g, 7), u' = clamp(u, -7,
7), α = 1.702 (as the f32 constant 1.70200002193450927734375). The expert biases
`ffn_{gate,up,down}_exps.bias` are [E, n_out] (numpy order).

CLI:
  reference.py MODEL --tokens 2,818,5279 [--dump DIR] [--greedy N]
  reference.py MODEL --perplexity TOKENS.json --ctx N [--chunks N]
"""

import argparse
import json
import math
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

import reference_gemma4

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "gemma3", "qwen3", "gemma4", "phi3", "gemma2", "mistral3",
                   "qwen3moe", "gpt-oss")
# Architectures whose FFN may be a mixture of experts (see the module docstring).
MOE_ARCHS = ("qwen3moe", "llama", "gpt-oss")
# llama.cpp clamps the sum of the picked experts' probabilities to the smallest normal f16.
MOE_WEIGHTS_SUM_MIN = 6.103515625e-5
# gpt-oss's clamped SwiGLU (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE): the f32 constants it passes.
SWIGLU_OAI_ALPHA = float(np.float32(1.702))
SWIGLU_OAI_LIMIT = 7.0
# ggml's YaRN defaults (llama_hparams yarn_beta_fast / yarn_beta_slow; gpt-oss reads no key).
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


# --------------------------------------------------------------------------------------------
# Loading


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # pragma: no cover - unusual field layouts
        return None


def _dequantize_rows(data, ttype, name, shape):
    """Dequantizes `data` (a GGUFReader tensor's bytes or values, any number of leading axes)
    row by row over its flattened rows to float32 of `shape` (numpy order)."""
    data = np.asarray(data)
    rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data
    d = np.asarray(dequantize(rows, ttype), dtype=np.float32)
    if d.size != int(np.prod(shape)):
        raise ValueError(f"{name}: dequantized {d.size} values, expected shape {shape}")
    return d.reshape(shape)


def dequantize_tensor(t):
    """Dequantized float32 array of a GGUFReader tensor, in row-major [n_rows, row_len]
    (more generally the reverse of the ggml shape: [n_expert, n_out, n_in] for a stacked expert
    tensor; 1-D tensors stay 1-D)."""
    shape = tuple(int(x) for x in reversed([int(s) for s in t.shape]))
    return _dequantize_rows(t.data, t.tensor_type, t.name, shape)


class Model:
    """Metadata and lazily dequantized weights of one GGUF model."""

    def __init__(self, path):
        self.path = str(path)
        self.reader = GGUFReader(self.path)
        self.meta = {}
        for name, field in self.reader.fields.items():
            if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                        "tokenizer.ggml.merges"):
                continue  # big arrays: read on demand
            self.meta[name] = _field_value(field)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._cache = {}
        self._vocab_tokens = None

        arch = self.meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        self.arch = arch
        g = lambda key, default=None: self.meta.get(f"{arch}.{key}", default)  # noqa: E731

        self.n_expert = int(g("expert_count", 0) or 0)
        if self.n_expert and arch not in MOE_ARCHS:
            raise ValueError(f"mixture-of-experts {arch} models are not supported by the reference")
        if arch in ("qwen3moe", "gpt-oss") and not self.n_expert:
            raise ValueError(f"a {arch} file without {arch}.expert_count")

        self.n_embd = int(g("embedding_length"))
        self.n_layer = int(g("block_count"))
        self.n_ff = g("feed_forward_length")
        self.n_head = int(g("attention.head_count"))
        kv = g("attention.head_count_kv", self.n_head)
        self.n_head_kv = int(kv[0] if isinstance(kv, (list, tuple)) else kv)  # gemma4: per layer
        self.head_dim = int(g("attention.key_length", self.n_embd // self.n_head))
        self.head_dim_v = int(g("attention.value_length", self.n_embd // self.n_head))
        self.n_rot = int(g("rope.dimension_count", self.head_dim))
        self.eps = float(g("attention.layer_norm_rms_epsilon", 1e-5))
        self.rope_base = float(g("rope.freq_base", 10000.0))
        scaling_type = g("rope.scaling.type")
        factor = g("rope.scaling.factor") or g("rope.scale_linear") or 0.0
        # YaRN only where verified against llama.cpp (other archs may read more yarn keys).
        known_scaling = (None, "none", "linear") + (("yarn",) if arch == "gpt-oss" else ())
        if scaling_type not in known_scaling and float(factor) not in (0.0, 1.0):
            raise ValueError(f"rope scaling type {scaling_type!r} is not supported by the reference")
        self.rope_scale = 1.0 / float(factor) if float(factor) != 0.0 else 1.0
        self.rope_neox = arch in ("qwen2", "gemma3", "qwen3", "qwen3moe", "phi3", "gemma2", "gpt-oss")
        self.gemma = arch in ("gemma3", "gemma2")
        self.ctx_train = int(g("context_length", 4096))
        # LongRoPE (phi3): the original context and the cos/sin multiplier.
        self.rope_orig_ctx = int(g("rope.scaling.original_context_length", self.ctx_train) or self.ctx_train)
        self.rope_attn_factor = float(g("rope.scaling.attn_factor", 1.0) or 1.0)
        # YaRN (gpt-oss): ggml's ext_factor (1 for "yarn", else 0) and beta_fast / beta_slow.
        self.yarn = None
        if arch == "gpt-oss":
            train_scale = self.rope_scale
            if scaling_type == "none":
                self.rope_scale = 1.0  # llama.cpp: "never scale if scaling type is none"
            if scaling_type == "yarn":
                self.yarn = (1.0, self.rope_orig_ctx, YARN_BETA_FAST, YARN_BETA_SLOW)
                # llama_context: yarn_attn_factor = mscale(f) / (1 + 0.1 ln f), f = 1/scale, then
                # times rope.scaling.attn_factor; ggml's rope_yarn multiplies (1 + 0.1 ln f) back.
                f = 1.0 / self.rope_scale
                mscale = 1.0 + 0.1 * math.log(f) if f > 1.0 else 1.0
                self.rope_attn_factor *= mscale / (1.0 + 0.1 * math.log(f))
        self.final_softcap = float(g("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0) or 0.0)
        self.attn_softcap = float(g("attn_logit_softcapping", 50.0) or 0.0) if arch == "gemma2" else 0.0

        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")

        # Mixture of experts: k per layer (llama.cpp reads expert_used_count as a scalar or a
        # per-layer array, though its qwen3moe and llama graphs abort on an uneven one). Both architectures renormalize the picked weights and scale them by
        # nothing: llama.cpp hard-codes norm_w = true and never loads expert_weights_scale (nor
        # expert_weights_norm) for qwen3moe and llama, so a file's value of either is ignored.
        self.n_expert_used = [0] * self.n_layer
        self.moe_norm = True
        self.moe_scale = 0.0
        self.moe_gating = "softmax"
        if arch == "gpt-oss":
            # build_moe_ffn(..., LLM_FFN_SWIGLU_OAI_MOE, norm_w = false, expert_weights_scale
            # (never loaded: 0), LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT).
            self.moe_norm = False
            self.moe_gating = "softmax_weight"
        if self.n_expert:
            used = g("expert_used_count", 0)
            used = list(used) if isinstance(used, (list, tuple)) else [used] * self.n_layer
            self.n_expert_used = [int(u) for u in used][: self.n_layer]
            if len(self.n_expert_used) != self.n_layer or not all(0 < u <= self.n_expert for u in self.n_expert_used):
                raise ValueError(f"{arch}.expert_used_count {used} for {self.n_expert} experts")

        # Per-layer attention kind: (is_local_sliding_window, rope_base, rope_scale).
        self.window = 0
        self.is_swa = [False] * self.n_layer
        self.rope_base_swa = self.rope_base
        self.rope_scale_swa = self.rope_scale
        if arch == "gemma2":
            self.window = int(g("attention.sliding_window", 4096) or 0)
            if self.window > 0:
                p = int(g("attention.sliding_window_pattern", 2))
                self.is_swa = [p == 0 or (i % p) < (p - 1) for i in range(self.n_layer)]
            # gemma_pytorch / llama.cpp: the 27B (46 layers) scales queries by 1/sqrt(d/n_head).
            if self.n_layer == 46:
                self.q_scale = 1.0 / math.sqrt(self.n_embd // self.n_head)
            else:
                self.q_scale = 1.0 / math.sqrt(self.head_dim)
        elif arch in ("llama", "mistral", "mistral3"):
            self.window = int(g("attention.sliding_window", 0) or 0)
            if self.window > 0:
                self.is_swa = [True] * self.n_layer
            self.q_scale = float(g("attention.scale", 0.0) or 0.0) or 1.0 / math.sqrt(self.head_dim)
        elif arch == "gemma3":
            self.window = int(g("attention.sliding_window", 0) or 0)
            if self.window > 0:
                pattern = g("attention.sliding_window_pattern", 6)
                if isinstance(pattern, (list, tuple)):
                    self.is_swa = [bool(p) for p in pattern][: self.n_layer]
                else:
                    p = int(pattern)
                    self.is_swa = [p == 0 or (i % p) < (p - 1) for i in range(self.n_layer)]
                self.rope_base_swa = 10000.0
                self.rope_scale_swa = 1.0
            # gemma_pytorch / llama.cpp: the 27B (62 layers) scales queries by 1/sqrt(d/n_head).
            if self.n_layer == 62:
                self.q_scale = 1.0 / math.sqrt(self.n_embd // self.n_head)
            else:
                self.q_scale = 1.0 / math.sqrt(self.head_dim)
        elif arch == "gpt-oss":
            # llama.cpp: n_swa is required; load_swa_pattern(ml, 2): layer i is local iff
            # i % p < p - 1 (even layers), unless attention.sliding_window_pattern says otherwise.
            self.window = int(g("attention.sliding_window"))
            pattern = g("attention.sliding_window_pattern", 2)
            if isinstance(pattern, (list, tuple)):
                self.is_swa = [bool(p) for p in pattern][: self.n_layer]
            else:
                p = int(pattern)
                self.is_swa = [p == 0 or (i % p) < (p - 1) for i in range(self.n_layer)]
            self.rope_base_swa = float(g("rope.freq_base_swa", self.rope_base))
            self.rope_scale_swa = train_scale  # hparams.rope_freq_scale_train_swa
            self.q_scale = 1.0 / math.sqrt(self.n_rot)
        else:
            self.q_scale = float(g("attention.scale", 0.0) or 0.0) or 1.0 / math.sqrt(self.head_dim)
        if arch == "gemma4":
            reference_gemma4.setup(self, g)
        if arch == "phi3":
            w = int(g("attention.sliding_window", 0) or 0)
            if 0 < w < self.ctx_train:
                self.window = w
                self.is_swa = [True] * self.n_layer

        tokenizer_model = self.meta.get("tokenizer.ggml.model")
        self.add_bos = bool(self.meta.get("tokenizer.ggml.add_bos_token", tokenizer_model == "llama"))
        self.bos_id = self.meta.get("tokenizer.ggml.bos_token_id")
        self.eos_id = self.meta.get("tokenizer.ggml.eos_token_id")

        emb = self.tensors["token_embd.weight"]
        self.vocab = int(emb.shape[1])
        self.tied = "output.weight" not in self.tensors

    # -- weights -------------------------------------------------------------------------

    def has(self, name):
        return name in self.tensors

    def f32(self, name):
        """Dequantized float32 weight (not cached)."""
        return dequantize_tensor(self.tensors[name])

    def w(self, name):
        """Dequantized weight widened to float64, cached for the life of the Model."""
        a = self._cache.get(name)
        if a is None:
            a = self.f32(name).astype(np.float64)
            self._cache[name] = a
        return a

    def wopt(self, name):
        return self.w(name) if name in self.tensors else None

    def expert_w(self, name, e):
        """Expert e's matrix [n_out, n_in] of a stacked expert tensor (numpy shape
        [n_expert, n_out, n_in]), dequantized alone and widened to float64, cached per expert
        (only the experts the router picks are ever dequantized)."""
        key = (name, int(e))
        a = self._cache.get(key)
        if a is None:
            t = self.tensors[name]
            if len(t.shape) != 3:
                raise ValueError(f"{name}: expected a 3-D expert tensor, got ggml shape {list(t.shape)}")
            n_in, n_out = int(t.shape[0]), int(t.shape[1])
            a = _dequantize_rows(t.data[int(e)], t.tensor_type, f"{name}[{e}]", (n_out, n_in)).astype(np.float64)
            self._cache[key] = a
        return a

    def layer_rope(self, il):
        if self.is_swa[il]:
            return self.rope_base_swa, self.rope_scale_swa
        return self.rope_base, self.rope_scale

    # -- vocabulary (for printing only) ---------------------------------------------------

    def vocab_tokens(self):
        if self._vocab_tokens is None:
            f = self.reader.fields.get("tokenizer.ggml.tokens")
            self._vocab_tokens = _field_value(f) if f is not None else []
        return self._vocab_tokens

    def decode(self, ids):
        """Best-effort detokenization for display (SPM and GPT-2 byte-level vocabularies)."""
        toks = self.vocab_tokens()
        if not toks:
            return " ".join(map(str, ids))
        out = bytearray()
        if self.meta.get("tokenizer.ggml.model") == "gpt2":
            inv = _gpt2_unicode_to_byte()
            for i in ids:
                s = toks[i]
                if all(ch in inv for ch in s):
                    out += bytes(inv[ch] for ch in s)
                else:
                    out += s.encode()
        else:
            for i in ids:
                s = toks[i]
                if len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
                    out.append(int(s[3:5], 16))
                else:
                    out += s.replace("\u2581", " ").encode()
        return out.decode("utf-8", errors="replace")


def _gpt2_unicode_to_byte():
    # GPT-2 byte-level BPE maps every byte to a printable code point: printable Latin-1 bytes
    # map to themselves, the others to 256, 257, ... in byte order.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping = {}
    extra = 0
    for b in range(256):
        if b in keep:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def load(path):
    """Reads a GGUF model; weights are dequantized on first use and cached in the Model."""
    return Model(path)


# --------------------------------------------------------------------------------------------
# Building blocks (float64)


def rmsnorm(x, weight, eps):
    """RMSNorm over the last axis, times `weight` (used as stored)."""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * weight


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def yarn_corr_dims(n_rot, n_ctx_orig, base, beta_fast=YARN_BETA_FAST, beta_slow=YARN_BETA_SLOW):
    """ggml_rope_yarn_corr_dims: (lo, hi), the pair indices where YaRN's ramp starts and ends.
    c(β) = n_rot·ln(n_ctx_orig / (2π·β)) / (2·ln base); lo = max(0, floor(c(beta_fast))),
    hi = min(n_rot - 1, ceil(c(beta_slow)))."""
    def corr(beta):
        return n_rot * math.log(n_ctx_orig / (beta * 2.0 * math.pi)) / (2.0 * math.log(base))
    return max(0.0, math.floor(corr(beta_fast))), min(n_rot - 1.0, math.ceil(corr(beta_slow)))


def rope(x, pos, n_rot, base, scale=1.0, neox=False, freq_factors=None, attn_factor=1.0, yarn=None):
    """Rotary embedding of x [n_tok, n_heads, head_dim] at positions pos [n_tok].

    Pair i (i < n_rot/2) is rotated by angle pos * scale * base^(-2i/n_rot) / freq_factors[i].
    normal (llama): pairs are (2i, 2i+1); neox: pairs are (i, i + n_rot/2). Dimensions from
    n_rot on are left untouched. cos and sin are multiplied by `attn_factor` (LongRoPE).
    `yarn` = (ext_factor, n_ctx_orig, beta_fast, beta_slow), ggml's rope_yarn when ext_factor is
    not 0: with θ = pos·base^(-2i/n_rot)/freq_factors[i], the angle is
    θ·scale·(1 - r) + θ·r, r = ext_factor·(1 - clamp((i - lo)/max(0.001, hi - lo), 0, 1)) with
    (lo, hi) = yarn_corr_dims, and cos and sin are further multiplied by 1 + 0.1·ln(1/scale)."""
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    inv_freq = base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)[:half]
    theta = (np.asarray(pos, dtype=np.float64)[:, None] * scale) * inv_freq[None, :]
    if yarn is not None and yarn[0] != 0.0:
        ext_factor, n_ctx_orig, beta_fast, beta_slow = yarn
        lo, hi = yarn_corr_dims(n_rot, n_ctx_orig, base, beta_fast, beta_slow)
        ramp = (1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)) * ext_factor
        extrap = np.asarray(pos, dtype=np.float64)[:, None] * inv_freq[None, :]
        theta = theta * (1.0 - ramp)[None, :] + extrap * ramp[None, :]
        attn_factor = attn_factor * (1.0 + 0.1 * math.log(1.0 / scale))
    cos = np.cos(theta)[:, None, :] * attn_factor
    sin = np.sin(theta)[:, None, :] * attn_factor
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def attention_mask(n_tok, window=0):
    """Boolean [q, k] mask of allowed keys: causal, and within the last `window` positions
    (q - k < window) when window > 0."""
    q = np.arange(n_tok)[:, None]
    k = np.arange(n_tok)[None, :]
    allowed = k <= q
    if window > 0:
        allowed &= (q - k) < window
    return allowed


def attention(q, k, v, scale, allowed, softcap=0.0, sinks=None):
    """q [n, H, d], k [n, Hkv, d], v [n, Hkv, dv]; query head h uses kv head h // (H/Hkv).
    With softcap c > 0 the scaled scores s become c * tanh(s / c) before the mask.
    `sinks` [H] (gpt-oss): one more logit per query head in the softmax's denominator only
    (ggml_soft_max_add_sinks): p_j = exp(s_j - M) / (Σ_i exp(s_i - M) + exp(sink - M)),
    M = max(max_i s_i, sink); the sink is not scaled and has no value."""
    n, H, _ = q.shape
    Hkv = k.shape[1]
    kv_of = np.arange(H) // (H // Hkv)
    qh = np.ascontiguousarray(q.transpose(1, 0, 2))  # [H, n, d]
    kh = np.ascontiguousarray(k[:, kv_of, :].transpose(1, 2, 0))  # [H, d, n]
    vh = np.ascontiguousarray(v[:, kv_of, :].transpose(1, 0, 2))  # [H, n, dv]
    s = np.matmul(qh, kh) * scale  # [H, q, k]
    if softcap > 0:
        s = np.tanh(s / softcap) * softcap
    s = np.where(allowed[None, :, :], s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sk = np.asarray(sinks, dtype=np.float64).reshape(H, 1, 1)
        mx = np.maximum(mx, sk)
    p = np.exp(s - mx)
    denom = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(sk - mx)
    p /= denom
    o = np.matmul(p, vh)  # [H, q, dv]
    return o.transpose(1, 0, 2).reshape(n, H * vh.shape[-1])


# --------------------------------------------------------------------------------------------
# Optional activation quantization. llama.cpp (and ringllm) quantize a matmul's input rows on
# the fly to 8 bits in the format the weight type's dot product takes; with act_quant=True the
# reference rounds its inputs the same way (stated rules below, written from the format
# definitions), so engine and reference differ only by float summation order.

_ACT_FORMAT = {
    "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0",
    "Q4_1": "Q8_1", "Q5_1": "Q8_1",
    "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K",
    "Q2_K": "Q8_K", "Q3_K": "Q8_K",
    "IQ4_NL": "Q8_0", "IQ4_XS": "Q8_K", "MXFP4": "Q8_0",
}

ACT_QUANT = False


def _q8_1_sum_delta(x):
    """Q8_1 also stores s = d·Σq per block as f16: s16 − f16(d)·Σq, per row and block."""
    x32 = np.asarray(x, dtype=np.float32)
    n, k = x32.shape
    b = x32.reshape(n, k // 32, 32)
    d = (np.abs(b).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = b * inv[..., None]
    qsum = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).sum(axis=-1).astype(np.float32)
    s16 = (qsum * d).astype(np.float16).astype(np.float64)
    return s16 - d.astype(np.float16).astype(np.float64) * qsum


def _block_mins(t):
    """Per-block minimum m (f16 at bytes 2..4) of a Q4_1/Q5_1 tensor: [rows, blocks], the rows
    of every expert one after the other for a stacked expert tensor."""
    size = {"Q4_1": 20, "Q5_1": 24}[t.tensor_type.name]
    raw = np.asarray(t.data, dtype=np.uint8).reshape(-1, size)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float64)
    rows = int(np.prod([int(s) for s in t.shape[1:]])) if len(t.shape) > 1 else 1
    return m.reshape(rows, -1)


def quantize_act(x, fmt):
    """x [n, k] float -> the values its 8-bit quantization in `fmt` stands for."""
    x32 = np.asarray(x, dtype=np.float32)
    n, k = x32.shape
    if fmt in ("Q8_0", "Q8_1"):
        b = x32.reshape(n, k // 32, 32)
        amax = np.abs(b).max(axis=-1, keepdims=True)
        d = (amax / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        v = b * inv
        q = np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))  # round half away from zero
        d16 = d.astype(np.float16).astype(np.float64)
        return (q.astype(np.float64) * d16).reshape(n, k)
    if fmt == "Q8_K":
        b = x32.reshape(n, k // 256, 256)
        idx = np.abs(b).argmax(axis=-1)[..., None]
        mx = np.take_along_axis(b, idx, axis=-1)
        with np.errstate(divide="ignore"):
            iscale = np.where(mx != 0, np.float32(-128) / mx, np.float32(0)).astype(np.float32)
        q = np.minimum(np.rint(iscale * b), 127)  # np.rint: round half to even
        d = np.where(iscale != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
        return (q.astype(np.float64) * d.astype(np.float64)).reshape(n, k)
    raise ValueError(f"unknown activation format {fmt}")


def _act(x, m, name):
    if not ACT_QUANT:
        return x
    fmt = _ACT_FORMAT.get(m.tensors[name].tensor_type.name)
    return x if fmt is None else quantize_act(x, fmt)


def _q8_1_correction(x, m, name, expert=None):
    """The part of a Q4_1/Q5_1 dot product that comes from the f16 block sum of Q8_1 (of
    expert `expert`'s rows for a stacked expert tensor)."""
    t = m.tensors[name]
    if not ACT_QUANT or t.tensor_type.name not in ("Q4_1", "Q5_1"):
        return 0.0
    key = "mins:" + name
    if key not in m._cache:
        m._cache[key] = _block_mins(t)
    mins = m._cache[key]
    if expert is not None:
        n_out = int(t.shape[1])
        mins = mins[int(expert) * n_out:(int(expert) + 1) * n_out]
    return _q8_1_sum_delta(x) @ mins.T


def _linear(x, m, name):
    y = _act(x, m, name + ".weight") @ m.w(name + ".weight").T + _q8_1_correction(x, m, name + ".weight")
    b = m.wopt(name + ".bias")
    if b is not None:
        y = y + b
    return y


def _expert_linear(x, m, name, e):
    """x @ expert e's matrix of the stacked tensor `name`.weight: `_linear` for one expert (its
    input rounded in the activation format of the stacked tensor's type with act_quant)."""
    wname = name + ".weight"
    return _act(x, m, wname) @ m.expert_w(wname, e).T + _q8_1_correction(x, m, wname, expert=e)


# --------------------------------------------------------------------------------------------
# Mixture of experts


def _softmax(z):
    z = np.asarray(z, dtype=np.float64)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def moe_weights(logits, ids, norm=True, scale=0.0, gating="softmax"):
    """The weights [n, k] of the picked experts `ids` [n, k] given the router logits [n, E]:
    "softmax": softmax(logits)[ids]; "softmax_weight" (gpt-oss): softmax(logits[ids]) over the
    k picked logits only. Then with `norm` w /= max(Σ w, MOE_WEIGHTS_SUM_MIN) and, unless scale
    is 0 or 1, w *= scale."""
    z = np.asarray(logits, dtype=np.float64)
    if gating == "softmax":
        w = np.take_along_axis(_softmax(z), ids, axis=-1)
    elif gating == "softmax_weight":
        w = _softmax(np.take_along_axis(z, ids, axis=-1))
    else:
        raise ValueError(f"unknown expert gating {gating!r}")
    if norm:
        w = w / np.maximum(w.sum(axis=-1, keepdims=True), MOE_WEIGHTS_SUM_MIN)
    if scale not in (0.0, 1.0):
        w = w * scale
    return w


def moe_route(logits, k, norm=True, scale=0.0, gating="softmax"):
    """Router logits [n, E] -> (ids [n, k] int64, weights [n, k] float64), llama.cpp's
    gating: the k experts of largest softmax probability ("softmax") or largest logit
    ("softmax_weight"), in decreasing order (ties: the lower index first, a stable sort),
    weighted by moe_weights:
    "softmax": p = softmax(logits), w = p[ids] (then `norm`, `scale`); "softmax_weight"
    (gpt-oss): w = softmax(logits[ids])."""
    z = np.asarray(logits, dtype=np.float64)
    key = _softmax(z) if gating == "softmax" else z  # llama.cpp sorts what it gates on
    ids = np.argsort(-key, axis=-1, kind="stable")[:, :k]
    return ids, moe_weights(z, ids, norm, scale, gating)


def swiglu_oai(gate, up, alpha=SWIGLU_OAI_ALPHA, limit=SWIGLU_OAI_LIMIT):
    """ggml_swiglu_oai: g = min(gate, limit), u = clamp(up, -limit, limit),
    g·sigmoid(alpha·g)·(u + 1)."""
    g = np.minimum(gate, limit)
    u = np.clip(up, -limit, limit)
    return g / (1.0 + np.exp(-alpha * g)) * (u + 1.0)


def _moe_ffn(h, m, p, il, seen):
    """The mixture-of-experts FFN of layer il (prefix p) on the normed rows h [n, d]."""
    # The router (F32: its input stays f32), plus its bias when present (gpt-oss).
    logits = _linear(h, m, p + "ffn_gate_inp")
    ids, w = moe_route(logits, m.n_expert_used[il], m.moe_norm, m.moe_scale, m.moe_gating)
    forced = getattr(m, "forced_routes", None)
    if forced is not None:
        # The picks of another run (`forward(routes=...)`), weighted by this run's logits.
        ids = np.asarray(forced[il], dtype=np.int64)
        w = moe_weights(logits, ids, m.moe_norm, m.moe_scale, m.moe_gating)
    seen(il, "router", "ids", ids)
    seen(il, "router", "weights", w)
    has_gate = m.has(p + "ffn_gate_exps.weight")  # llama.cpp: optional for llama
    oai = m.arch == "gpt-oss"

    def expert(x, name, e):
        y = _expert_linear(x, m, p + name, e)
        b = m.wopt(p + name + ".bias")  # gpt-oss: [E, n_out], added after the matmul
        return y if b is None else y + b[int(e)]

    o = np.zeros_like(h)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)  # a row picks an expert at most once
        xe = h[rows]
        up = expert(xe, "ffn_up_exps", e)
        if oai:
            act = swiglu_oai(expert(xe, "ffn_gate_exps", e), up)
        else:
            act = silu(expert(xe, "ffn_gate_exps", e)) * up if has_gate else silu(up)
        o[rows] += w[rows, slot][:, None] * expert(act, "ffn_down_exps", e)
    return o


# --------------------------------------------------------------------------------------------
# Forward pass


def forward(model, token_ids, logit_rows=None, act_quant=False, steps=None, ctx=None, routes=None):
    """With act_quant=True, matmul inputs are rounded as 8-bit activations (see quantize_act).
    `ctx`: the context size the model is run with (default: the number of tokens), which
    picks LongRoPE's long or short factors.
    `routes`: {layer: ids [n, k]}, the experts every mixture-of-experts layer takes instead of
    its own picks (weighted by its own probabilities): a float run routed as an 8-bit one was.
    `steps`: a dict to fill with the output of every layer step the engine also names
    (`debug forward --steps`): "layer.{i}.{step}.{buffer}" -> float32 [n, width]. A mixture-of-
    experts FFN names "router.ids" and "router.weights" (the k picked experts of each row and
    their final weights, [n, k]; the engine's router step shows no buffer) and "moe.o" (the
    weighted expert sum, [n, d]; also as "experts.o", the engine's name for that step) in place
    of gate_up, glu and ffn_down.
    """
    global ACT_QUANT
    saved, ACT_QUANT = ACT_QUANT, act_quant
    model.forced_routes = routes
    try:
        return _forward(model, token_ids, logit_rows, steps, ctx)
    finally:
        ACT_QUANT = saved
        model.forced_routes = None


def _forward(model, token_ids, logit_rows=None, steps=None, ctx=None):
    """Full causal forward over `token_ids` at positions 0..n-1, in float64.

    Returns (logits float32 [n_rows, vocab], hidden) where hidden (float32 arrays [n_tok, d])
    has "embd" (scaled input embeddings), "layer.{i}" (residual stream after layer i) and
    "final_norm". `logit_rows`: positions to compute logits for (default: all; [] for none)."""
    m = model
    toks = np.asarray(token_ids, dtype=np.int64)
    if toks.ndim != 1 or len(toks) == 0:
        raise ValueError("token_ids must be a non-empty 1-D sequence")
    if toks.min() < 0 or toks.max() >= m.vocab:
        raise ValueError(f"token id out of range [0, {m.vocab})")
    n = len(toks)
    pos = np.arange(n)
    gemma = m.arch in ("gemma3", "gemma2")
    hidden = {}
    if m.arch == "gemma4":
        x, hidden = reference_gemma4.forward(m, toks, logit_rows, steps, sys.modules[__name__])
        return _output(m, x, logit_rows, hidden)

    x = m.w("token_embd.weight")[toks].copy()
    if gemma:
        x *= math.sqrt(m.n_embd)
    hidden["embd"] = x.astype(np.float32)

    freq_factors = m.wopt("rope_freqs.weight")
    if freq_factors is None and m.has("rope_factors_long.weight"):
        long_ctx = (n if ctx is None else ctx) > m.rope_orig_ctx
        freq_factors = m.w("rope_factors_long.weight" if long_ctx else "rope_factors_short.weight")
    masks = {}

    def seen(il, step, buf, a):
        if steps is not None:
            steps[f"layer.{il}.{step}.{buf}"] = np.asarray(a, dtype=np.float64).reshape(n, -1).astype(np.float32)

    for il in range(m.n_layer):
        p = f"blk.{il}."
        window = m.window if m.is_swa[il] else 0
        if window not in masks:
            masks[window] = attention_mask(n, window)
        base, scale = m.layer_rope(il)

        h = rmsnorm(x, m.w(p + "attn_norm.weight"), m.eps)
        seen(il, "attn_norm", "xn", h)
        if m.has(p + "attn_qkv.weight"):
            qkv = _linear(h, m, p + "attn_qkv")
            nq, nk = m.n_head * m.head_dim, m.n_head_kv * m.head_dim
            q = qkv[:, :nq].reshape(n, m.n_head, m.head_dim)
            k = qkv[:, nq:nq + nk].reshape(n, m.n_head_kv, m.head_dim)
            v = qkv[:, nq + nk:].reshape(n, m.n_head_kv, m.head_dim_v)
        else:
            q = _linear(h, m, p + "attn_q").reshape(n, m.n_head, m.head_dim)
            k = _linear(h, m, p + "attn_k").reshape(n, m.n_head_kv, m.head_dim)
            v = _linear(h, m, p + "attn_v").reshape(n, m.n_head_kv, m.head_dim_v)
        # _linear adds the biases: the projections' outputs are these less the biases (the
        # engine's `qkv` step), the biased ones its `qkv_bias` step.
        biased = m.has(p + "attn_q.bias")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if biased:
                b = np.asarray(m.w(p + f"attn_{name}.bias")).reshape(t.shape[1:])
                seen(il, "qkv", name, t - b)
            seen(il, "qkv_bias" if biased else "qkv", name, t)
        if m.has(p + "attn_q_norm.weight"):
            q = rmsnorm(q, m.w(p + "attn_q_norm.weight"), m.eps)
        if m.has(p + "attn_k_norm.weight"):
            k = rmsnorm(k, m.w(p + "attn_k_norm.weight"), m.eps)
        if m.has(p + "attn_q_norm.weight"):
            seen(il, "qk_norm", "q", q)
            seen(il, "qk_norm", "k", k)
        # (A model read from a Hugging Face checkpoint, hf_reference.HfModel, has neither YaRN
        # nor experts.)
        yarn = getattr(m, "yarn", None)
        q = rope(q, pos, m.n_rot, base, scale, m.rope_neox, freq_factors, m.rope_attn_factor, yarn)
        k = rope(k, pos, m.n_rot, base, scale, m.rope_neox, freq_factors, m.rope_attn_factor, yarn)
        seen(il, "rope", "q", q)
        seen(il, "rope", "k", k)
        a = attention(q, k, v, m.q_scale, masks[window], m.attn_softcap, m.wopt(p + "attn_sinks.weight"))
        seen(il, "attention", "att", a)
        a = _linear(a, m, p + "attn_output")
        if m.has(p + "attn_output.bias"):
            # The engine adds the output bias as a step of its own.
            seen(il, "attn_out", "o", a - np.asarray(m.w(p + "attn_output.bias")))
            seen(il, "attn_out_bias", "o", a)
        else:
            seen(il, "attn_out", "o", a)
        # gpt-oss's post_attention_norm is its FFN input norm (below), not a sandwich norm.
        if m.has(p + "post_attention_norm.weight") and m.arch != "gpt-oss":
            a = rmsnorm(a, m.w(p + "post_attention_norm.weight"), m.eps)
        x = x + a
        seen(il, "attn_residual", "x", x)

        ffn_norm = "post_attention_norm" if m.arch == "gpt-oss" else "ffn_norm"
        h = rmsnorm(x, m.w(p + ffn_norm + ".weight"), m.eps)
        seen(il, "ffn_norm", "xn", h)
        if getattr(m, "n_expert", 0):
            f = _moe_ffn(h, m, p, il, seen)
            seen(il, "moe", "o", f)
            seen(il, "experts", "o", f)  # the engine's name for the same step
        else:
            if m.has(p + "ffn_gate.weight"):
                gate = _linear(h, m, p + "ffn_gate")
                up = _linear(h, m, p + "ffn_up")
            else:  # phi3: one matrix, rows [gate | up]
                gu = _linear(h, m, p + "ffn_up")
                gate, up = gu[:, :gu.shape[1] // 2], gu[:, gu.shape[1] // 2:]
            seen(il, "gate_up", "gate", gate)
            seen(il, "gate_up", "up", up)
            act = gelu_tanh(gate) if gemma else silu(gate)
            seen(il, "glu", "gate", act * up)
            f = _linear(act * up, m, p + "ffn_down")
            seen(il, "ffn_down", "o", f)
        if m.has(p + "post_ffw_norm.weight"):
            f = rmsnorm(f, m.w(p + "post_ffw_norm.weight"), m.eps)
        x = x + f
        seen(il, "ffn_residual", "x", x)
        hidden[f"layer.{il}"] = x.astype(np.float32)
    return _output(m, x, logit_rows, hidden)


def _output(m, x, logit_rows, hidden):
    """Final norm and logits of the rows `logit_rows` (all: None) of the last layer's `x`."""
    n = len(x)
    x = rmsnorm(x, m.w("output_norm.weight"), m.eps)
    hidden["final_norm"] = x.astype(np.float32)

    rows = np.arange(n) if logit_rows is None else np.asarray(logit_rows, dtype=np.int64).reshape(-1)
    out_name = "token_embd.weight" if m.tied else "output.weight"
    out_w = m.w(out_name)
    logits = np.empty((len(rows), out_w.shape[0]), dtype=np.float32)
    for s in range(0, len(rows), 64):  # bounded float64 temporaries for big vocabularies
        xr = x[rows[s:s + 64]]
        blk = _act(xr, m, out_name) @ out_w.T + _q8_1_correction(xr, m, out_name)
        if m.final_softcap > 0:
            blk = np.tanh(blk / m.final_softcap) * m.final_softcap
        logits[s:s + 64] = blk
    return logits, hidden


def greedy(model, token_ids, n):
    """n greedy steps, recomputing the full forward each step; returns the generated ids."""
    seq = list(token_ids)
    out = []
    for _ in range(n):
        logits, _ = forward(model, seq, logit_rows=[len(seq) - 1])
        t = int(np.argmax(logits[0]))
        out.append(t)
        seq.append(t)
        if model.eos_id is not None and t == model.eos_id:
            break
    return out


# --------------------------------------------------------------------------------------------
# Perplexity, as llama.cpp's perplexity tool computes it


def perplexity(model, tokens, ctx, n_chunks=None, add_bos=None, verbose=False):
    """llama.cpp `llama-perplexity` convention.

    `tokens` is the whole tokenized text as llama.cpp tokenizes it (with a leading BOS when
    the model adds one). It is cut into n_chunk = len(tokens)//ctx consecutive chunks of ctx
    tokens (at most n_chunks); at least 2*ctx tokens are required. Each chunk is evaluated
    from position 0 with its first token replaced by BOS when the model adds BOS. With
    first = ctx//2, the logits at positions first..ctx-2 score the chunk's (original) tokens
    first+1..ctx-1: ctx - first - 1 tokens per chunk. Returns (ppl, stderr) with
    ppl = exp(mean NLL) and stderr = ppl * sqrt((mean(NLL^2) - mean(NLL)^2) / (count - 1))."""
    tokens = [int(t) for t in tokens]
    if add_bos is None:
        add_bos = model.add_bos
    if len(tokens) < 2 * ctx:
        raise ValueError(f"need at least {2 * ctx} tokens for a context of {ctx}, got {len(tokens)}")
    n_chunk = len(tokens) // ctx
    if n_chunks is not None and n_chunks >= 0:
        n_chunk = min(n_chunk, n_chunks)
    first = ctx // 2
    nll = 0.0
    nll2 = 0.0
    count = 0
    for i in range(n_chunk):
        chunk = tokens[i * ctx:(i + 1) * ctx]
        inp = list(chunk)
        if add_bos:
            inp[0] = int(model.bos_id)
        rows = np.arange(first, ctx - 1)
        logits, _ = forward(model, inp, logit_rows=rows)
        lg = logits.astype(np.float64)
        mx = lg.max(axis=1, keepdims=True)
        lse = np.log(np.exp(lg - mx).sum(axis=1)) + mx[:, 0]
        target = np.asarray(chunk[first + 1:ctx])
        v = lse - lg[np.arange(len(rows)), target]
        nll += float(v.sum())
        nll2 += float((v * v).sum())
        count += len(v)
        if verbose:
            print(f"[{i + 1}]{math.exp(nll / count):.4f}", end=",", flush=True, file=sys.stderr)
    if verbose:
        print(file=sys.stderr)
    mean = nll / count
    mean2 = nll2 / count
    ppl = math.exp(mean)
    var = mean2 - mean * mean
    err = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else float("nan")
    return ppl, err


# --------------------------------------------------------------------------------------------
# CLI


def _read_tokens_json(path):
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        for key in ("tokens", "token_ids", "ids"):
            if key in data:
                data = data[key]
                break
        else:
            raise ValueError(f"{path}: expected a JSON list of token ids or an object with 'tokens'")
    return [int(t) for t in data]


def main(argv=None):
    ap = argparse.ArgumentParser(description="NumPy reference forward pass for GGUF models (float64).")
    ap.add_argument("model")
    ap.add_argument("--tokens", help="comma-separated token ids")
    ap.add_argument("--dump", metavar="DIR", help="write logits.npy, embd.npy, layer.{i}.npy, final_norm.npy")
    ap.add_argument("--greedy", type=int, metavar="N", default=0, help="generate N tokens greedily")
    ap.add_argument("--perplexity", metavar="TOKENS_JSON", help="JSON list of token ids (or {'tokens': [...]})")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=None)
    args = ap.parse_args(argv)

    m = load(args.model)
    if args.perplexity:
        toks = _read_tokens_json(args.perplexity)
        ppl, err = perplexity(m, toks, args.ctx, args.chunks, verbose=True)
        print(f"PPL = {ppl:.4f} +/- {err:.5f}")
        return 0
    if not args.tokens:
        ap.error("--tokens or --perplexity is required")
    toks = [int(t) for t in args.tokens.split(",") if t.strip()]
    logits, hidden = forward(m, toks)
    am = logits.argmax(axis=1)
    print("argmax:", ",".join(str(int(t)) for t in am))
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        np.save(os.path.join(args.dump, "logits.npy"), logits)
        for k, v in hidden.items():
            np.save(os.path.join(args.dump, f"{k}.npy"), v)
    if args.greedy:
        gen = greedy(m, toks, args.greedy)
        print("generated:", ",".join(map(str, gen)))
        print("text:", repr(m.decode(toks) + "|" + m.decode(gen)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
