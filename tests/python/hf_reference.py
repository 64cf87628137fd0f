"""Tiny random Hugging Face checkpoints, and the NumPy reference forward pass run on them directly.

`write_checkpoint` writes a folder as `transformers` would save one: config.json,
tokenizer_config.json, the tokenizer (a byte-level BPE tokenizer.json for llama/qwen2, a
SentencePiece tokenizer.model for gemma3) and model.safetensors (or two shards and
model.safetensors.index.json), random weights written with `safetensors`.

`HfModel` reads such a folder with `safetensors` and presents it as reference.py's model object
(the attributes and `w`/`wopt`/`has` that `reference.forward` uses), applying the Hugging Face
modelling code's semantics itself — not the converter's: Q/K stay in Hugging Face's layout and
RoPE rotates half-split pairs (`rotate_half`, NeoX order) for every architecture; Gemma's norms
compute x·(1 + w); Gemma 3's layer kinds come from `layer_types`, its local RoPE base from
`rope_local_base_freq` and its query scale from `query_pre_attn_scalar`. So a converted file that
permutes, shifts or names anything wrong gives different logits.
"""

import json
import math
import pathlib
import struct

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

import reference

# llama.cpp/transformers split expressions, as tokenizer.json files spell them.
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")

WORDS = ["the", "and", "hello", "world", "model", "token", "of", "to", "in", "is", "capital", "France",
         "Paris", "one", "two", "three"]

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# Hyper-parameters of the tiny models: rows of 64 values (whole Q8_0 / Q5_0 blocks).
DIMS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)

CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM",
           "mistral3": "Mistral3ForConditionalGeneration"}
# Architectures whose checkpoints HfModel runs (the ones reference.py knows); the others are
# written for the converter and llama.cpp only.
RUNNABLE = ("llama", "qwen2", "gemma3", "qwen3")
TEKKEN_RE = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
             r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+")


def _byte_to_unicode():
    return {b: ch for ch, b in reference._gpt2_unicode_to_byte().items()}


def bpe_tokenizer(pattern, specials):
    """A byte-level BPE tokenizer.json: the 256 byte symbols, merges spelling WORDS (with and
    without a leading space), then `specials` as added tokens. Returns (json, n_tokens)."""
    b2u = _byte_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    merges = []
    for w in WORDS:
        for text in (w, " " + w):
            sym = [b2u[b] for b in text.encode()]
            cur = sym[0]
            for s in sym[1:]:
                new = cur + s
                if new not in vocab:
                    merges.append([cur, s])
                    vocab[new] = len(vocab)
                cur = new
    added = []
    for s in specials:
        added.append(dict(id=len(vocab) + len(added), content=s, single_word=False, lstrip=False, rstrip=False,
                          normalized=False, special=True))
    tj = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    return tj, len(vocab) + len(added)


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num, wire, payload):
    key = _varint((num << 3) | wire)
    if wire == 2:
        return key + _varint(len(payload)) + payload
    return key + payload


GEMMA_SPECIALS = [("<pad>", 0.0, 3), ("<eos>", 0.0, 3), ("<bos>", 0.0, 3), ("<unk>", 0.0, 2)]
LLAMA2_SPECIALS = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]


def spm_model(specials=GEMMA_SPECIALS, add_dummy_prefix=False):
    """A SentencePiece ModelProto: `specials` (Gemma's <pad> <eos> <bos> <unk> by default), byte
    pieces, then scored pieces. Returns (bytes, pieces)."""
    pieces = list(specials)
    pieces += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    normal = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    normal += ["\u2581" + w for w in WORDS] + WORDS + ["th", "he", "an", "\u2581t", "\u2581a"]
    seen = set()
    for i, p in enumerate(normal):
        if p not in seen:
            seen.add(p)
            pieces.append((p, -float(i), 1))
    body = b""
    for text, score, ty in pieces:
        msg = _field(1, 2, text.encode()) + _field(2, 5, struct.pack("<f", score)) + _field(3, 0, _varint(ty))
        body += _field(1, 2, msg)
    body += _field(3, 2, _field(3, 0, _varint(int(add_dummy_prefix))))  # normalizer_spec.add_dummy_prefix
    return body, [p[0] for p in pieces]


def config(arch, vocab_size, n_layer, dims=None):
    c = dict(architectures=[CLASSES[arch]], _name_or_path=f"tiny-random-{arch}", num_hidden_layers=n_layer,
             vocab_size=vocab_size,
             max_position_embeddings=256, torch_dtype="float32", **(dims or DIMS))
    if arch == "llama":
        c.update(model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                 bos_token_id=None, eos_token_id=None, attention_bias=False)
    elif arch in ("qwen2", "qwen3"):
        c.update(model_type=arch, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                 use_sliding_window=False)
    elif arch == "gemma2":
        c.update(model_type="gemma2", rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4,
                 query_pre_attn_scalar=(dims or DIMS)["head_dim"], final_logit_softcapping=30.0,
                 attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
    elif arch == "phi3":
        c.update(model_type="phi3", rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                 original_max_position_embeddings=256, sliding_window=255, rope_scaling=None)
        c.pop("head_dim", None)
    elif arch == "mistral3":
        text = dict(c, model_type="mistral", rms_norm_eps=1e-5, rope_theta=1000000000.0, sliding_window=None,
                    tie_word_embeddings=False)
        del text["architectures"], text["_name_or_path"]
        return dict(architectures=c["architectures"], _name_or_path=c["_name_or_path"], model_type="mistral3",
                    text_config=text, vision_config=dict(hidden_size=32, model_type="pixtral"),
                    torch_dtype="float32")
    else:
        c.update(model_type="gemma3_text", rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                 sliding_window=4, sliding_window_pattern=6, query_pre_attn_scalar=(dims or DIMS)["head_dim"],
                 layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layer)],
                 final_logit_softcapping=None, attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh",
                 tie_word_embeddings=True)
    return c


def hf_tensor_shapes(arch, cfg):
    """Every tensor of the model: Hugging Face name -> shape."""
    top = cfg
    cfg = cfg.get("text_config", cfg)
    d, ff = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim", d // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    m = "language_model.model." if arch == "mistral3" else "model."
    out = {m + "embed_tokens.weight": (cfg["vocab_size"], d)}
    for il in range(cfg["num_hidden_layers"]):
        p = f"{m}layers.{il}."
        out[p + "input_layernorm.weight"] = (d,)
        if arch == "phi3":
            out[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, d)
        else:
            out[p + "self_attn.q_proj.weight"] = (q, d)
            out[p + "self_attn.k_proj.weight"] = (kv, d)
            out[p + "self_attn.v_proj.weight"] = (kv, d)
        out[p + "self_attn.o_proj.weight"] = (d, q)
        if arch == "qwen2":
            out[p + "self_attn.q_proj.bias"] = (q,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if arch in ("gemma3", "qwen3"):
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        if arch in ("gemma2", "gemma3"):
            out[p + "pre_feedforward_layernorm.weight"] = (d,)
            out[p + "post_feedforward_layernorm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
        if arch == "phi3":
            out[p + "mlp.gate_up_proj.weight"] = (2 * ff, d)
        else:
            out[p + "mlp.gate_proj.weight"] = (ff, d)
            out[p + "mlp.up_proj.weight"] = (ff, d)
        out[p + "mlp.down_proj.weight"] = (d, ff)
    out[m + "norm.weight"] = (d,)
    if not cfg.get("tie_word_embeddings"):
        out[("language_model." if arch == "mistral3" else "") + "lm_head.weight"] = (cfg["vocab_size"], d)
    if arch == "mistral3":  # a vision tower and projector the converter leaves out
        vd = top["vision_config"]["hidden_size"]
        out["vision_tower.transformer.layers.0.attention.q_proj.weight"] = (vd, vd)
        out["multi_modal_projector.linear_1.weight"] = (d, vd)
    return out


def random_weights(arch, cfg, seed):
    rng = np.random.default_rng(seed)
    gemma = arch in ("gemma2", "gemma3")
    w = {}
    for name, shape in hf_tensor_shapes(arch, cfg).items():
        if len(shape) == 2:
            w[name] = (rng.standard_normal(shape) / math.sqrt(shape[1])).astype(np.float32)
        elif name.endswith(".bias"):
            w[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:  # norms: near 1 as used (Gemma stores w and uses 1 + w)
            w[name] = ((0.0 if gemma else 1.0) + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return w


def write_checkpoint(path, arch, seed=1, n_layer=2, shards=1, dtype=np.float32, dims=None, extra=None):
    """Writes a tiny random checkpoint of `arch` into folder `path` (`dims`: hidden_size,
    intermediate_size, heads and head_dim other than DIMS; `extra`: config.json keys to set);
    returns (config, tokenizer size)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tc = {"chat_template": TEMPLATE, "clean_up_tokenization_spaces": False}
    if arch in ("gemma2", "gemma3"):
        model, pieces = spm_model()
        (path / "tokenizer.model").write_bytes(model)
        n_tokens = len(pieces)
        rows = n_tokens + 6  # Gemma pads its embedding past the vocabulary
        tc.update(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", add_bos_token=True,
                  add_eos_token=False)
    elif arch == "phi3":
        model, pieces = spm_model(LLAMA2_SPECIALS, add_dummy_prefix=True)
        (path / "tokenizer.model").write_bytes(model)
        # Phi-3's chat tokens come as added tokens after the SentencePiece pieces.
        added = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]
        tc["added_tokens_decoder"] = {str(len(pieces) + i): {"content": t, "special": True}
                                      for i, t in enumerate(added)}
        n_tokens = len(pieces) + len(added)
        rows = n_tokens + 5
        tc.update(bos_token="<s>", eos_token="<|end|>", unk_token="<unk>", add_bos_token=False, add_eos_token=False)
    else:
        specials = {"llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
                    "mistral3": ["<unk>", "<s>", "</s>"]}.get(arch, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        pattern = {"llama": LLAMA3_RE, "mistral3": TEKKEN_RE}.get(arch, QWEN2_RE)
        tj, n_tokens = bpe_tokenizer(pattern, specials)
        (path / "tokenizer.json").write_text(json.dumps(tj))
        rows = n_tokens + 13  # padded ids past the tokenizer
        if arch == "llama":
            tc.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", add_bos_token=True)
        elif arch == "mistral3":
            tc.update(bos_token="<s>", eos_token="</s>", unk_token="<unk>", add_bos_token=True)
        else:
            tc.update(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, add_bos_token=False)
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    cfg = config(arch, rows, n_layer, dims)
    cfg.update(extra or {})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    w = {k: v.astype(dtype) for k, v in random_weights(arch, cfg, seed).items()}
    names = list(w)
    if shards == 1:
        save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        per = math.ceil(len(names) / shards)
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: w[n] for n in names[s * per:(s + 1) * per]}
            save_file(part, str(path / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(a.nbytes for a in w.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return cfg, n_tokens


def load_safetensors(path):
    """Every tensor of a checkpoint folder (one file or shards), as float64 arrays."""
    path = pathlib.Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    out = {}
    for f in files:
        with safe_open(str(path / f), framework="numpy") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k).astype(np.float64)
    return out


class HfModel:
    """A checkpoint folder as reference.py's model object (see the module docstring)."""

    def __init__(self, path):
        path = pathlib.Path(path)
        cfg = json.loads((path / "config.json").read_text())
        self.arch = {v: k for k, v in CLASSES.items()}[cfg["architectures"][0]]
        if self.arch not in RUNNABLE:
            raise ValueError(f"the reference does not run {self.arch} checkpoints yet")
        hf = load_safetensors(path)
        gemma = self.arch == "gemma3"
        self.n_embd = cfg["hidden_size"]
        self.n_layer = cfg["num_hidden_layers"]
        self.n_head = cfg["num_attention_heads"]
        self.n_head_kv = cfg.get("num_key_value_heads", self.n_head)
        self.head_dim = self.head_dim_v = cfg.get("head_dim", self.n_embd // self.n_head)
        self.n_rot = self.head_dim
        self.eps = cfg["rms_norm_eps"]
        self.rope_base = cfg.get("rope_theta", 10000.0)
        self.rope_scale = 1.0
        self.rope_neox = True  # transformers' rotate_half on the checkpoint's own Q/K layout
        self.final_softcap = float(cfg.get("final_logit_softcapping") or 0.0)
        self.window = 0
        self.is_swa = [False] * self.n_layer
        self.rope_base_swa, self.rope_scale_swa = self.rope_base, 1.0
        self.q_scale = 1.0 / math.sqrt(self.head_dim)
        if gemma:
            self.window = cfg["sliding_window"]
            self.is_swa = [t == "sliding_attention" for t in cfg["layer_types"]]
            self.rope_base_swa = cfg["rope_local_base_freq"]
            self.q_scale = cfg["query_pre_attn_scalar"] ** -0.5
        self.tied = bool(cfg.get("tie_word_embeddings")) or "lm_head.weight" not in hf

        def norm(name):  # Gemma's RMSNorm multiplies by (1 + w)
            return hf[name] + 1.0 if gemma else hf[name]

        w = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": norm("model.norm.weight")}
        if not self.tied:
            w["output.weight"] = hf["lm_head.weight"]
        for il in range(self.n_layer):
            s, g = f"model.layers.{il}.", f"blk.{il}."
            w[g + "attn_norm.weight"] = norm(s + "input_layernorm.weight")
            for x in "qkv":
                w[g + f"attn_{x}.weight"] = hf[s + f"self_attn.{x}_proj.weight"]
                if s + f"self_attn.{x}_proj.bias" in hf:
                    w[g + f"attn_{x}.bias"] = hf[s + f"self_attn.{x}_proj.bias"]
            w[g + "attn_output.weight"] = hf[s + "self_attn.o_proj.weight"]
            if self.arch == "qwen3":  # Qwen3RMSNorm: x·w, over each head of Q and K
                w[g + "attn_q_norm.weight"] = hf[s + "self_attn.q_norm.weight"]
                w[g + "attn_k_norm.weight"] = hf[s + "self_attn.k_norm.weight"]
            if gemma:
                w[g + "attn_q_norm.weight"] = norm(s + "self_attn.q_norm.weight")
                w[g + "attn_k_norm.weight"] = norm(s + "self_attn.k_norm.weight")
                w[g + "post_attention_norm.weight"] = norm(s + "post_attention_layernorm.weight")
                w[g + "ffn_norm.weight"] = norm(s + "pre_feedforward_layernorm.weight")
                w[g + "post_ffw_norm.weight"] = norm(s + "post_feedforward_layernorm.weight")
            else:
                w[g + "ffn_norm.weight"] = hf[s + "post_attention_layernorm.weight"]
            for x in ("gate", "up", "down"):
                w[g + f"ffn_{x}.weight"] = hf[s + f"mlp.{x}_proj.weight"]
        self.tensors = w
        self.vocab = w["token_embd.weight"].shape[0]

    def has(self, name):
        return name in self.tensors

    def w(self, name):
        return self.tensors[name]

    def wopt(self, name):
        return self.tensors.get(name)

    def layer_rope(self, il):
        if self.is_swa[il]:
            return self.rope_base_swa, self.rope_scale_swa
        return self.rope_base, self.rope_scale


def forward(path, tokens):
    """Logits [n, vocab] of the checkpoint at `path` for `tokens`, in float64."""
    logits, _ = reference.forward(HfModel(path), tokens)
    return logits
