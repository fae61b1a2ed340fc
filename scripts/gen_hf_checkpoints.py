#!/usr/bin/env python3
"""Write Hugging Face SafeTensors checkpoints of the three real GGUF models
and of the synthetic Qwen3.

For each real GGUF in $FLATRUN_MODELS, and for the synthetic Qwen3 of
`gen_synthetic_models.py` (qwen3-synth-f16.gguf in $FLATRUN_SYNTHETIC, written
there by that script when missing), this writes an HF directory under
${FLATRUN_HF_CKPT:-~/.cache/flatrun/hf-ckpt}/<variant>/ holding:
  * model.safetensors (or model-0000N-of-0000M.safetensors + model.safetensors.index.json):
    every weight dequantized (ggml's decoders as the `gguf` package implements them) and
    stored under its Hugging Face name and [out, in] layout, in f16, bf16 or f32
    (round-to-nearest-even, as torch casts). What llama.cpp's converter did is undone:
      - llama-family Q/K rows: the converter permuted them for llama.cpp's adjacent-pair
        RoPE; HF uses rotate-half, so the permutation is inverted (qwen2 and gemma3
        are converted unpermuted);
      - Gemma: the converter adds 1 to every `*norm.weight`; HF stores the weight
        without it (Gemma3RMSNorm multiplies by 1 + w), so 1 is subtracted (in f32);
      - tied embeddings stay tied (no lm_head.weight) when the GGUF has no output.weight;
  * config.json with the real HF keys of LlamaForCausalLM / Qwen2ForCausalLM /
    Qwen3ForCausalLM / Gemma3ForCausalLM, generation_config.json;
  * tokenizer.json exported from the GGUF vocabulary (gpt2 byte-level BPE with the
    GGUF's merges and the pre-tokenizer of its `tokenizer.ggml.pre`; SentencePiece
    vocabularies as a byte-fallback BPE whose merges are ranked by the merged piece's
    score, which is how SentencePiece BPE picks its merges), tokenizer_config.json
    with bos/eos, add_bos_token and the GGUF's chat template (when it has one).

Reading the GGUF, the names, the Q/K un-permutation and the Gemma norm offset come
from `hf_layout.py`, shared with the MLX generator.

Deterministic (sorted JSON, fixed tensor order) and idempotent: a variant is skipped
when its `.flatrun-hf-stamp` matches (the sha256 of this script and `hf_layout.py`, the
source file's size and the variant), so a rerun costs a second. Needs only numpy and
the `gguf` package.

Usage: scripts/gen_hf_checkpoints.py [--models DIR] [--synthetic DIR] [--vocab DIR] [--out DIR]
                                     [--only NAME] [--force]
"""
import argparse, hashlib, json, os, shutil, struct, subprocess, sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_layout  # noqa: E402  (GGUF reading, names, Q/K un-permutation, Gemma norms)

# variant name -> (source GGUF, dtype, number of shards (1 = single file));
# a source under "synthetic/" is a file of gen_synthetic_models.py.
VARIANTS = {
    "smollm2-135m-f16": ("SmolLM2-135M-Instruct.Q4_1.gguf", "f16", 1),
    "smollm2-135m-bf16": ("SmolLM2-135M-Instruct.Q4_1.gguf", "bf16", 1),
    "smollm2-135m-f32": ("SmolLM2-135M-Instruct.Q4_1.gguf", "f32", 1),
    "smollm2-135m-f16-sharded": ("SmolLM2-135M-Instruct.Q4_1.gguf", "f16", 3),
    "qwen2.5-coder-0.5b-f16": ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "f16", 1),
    "gemma-3-270m-f16": ("gemma-3-270m-q4_k_m.gguf", "f16", 1),
    "qwen3-synth-f16": ("synthetic/qwen3-synth-f16.gguf", "f16", 1),
}
SYNTHETIC = "synthetic/"

# ------------------------------------------------------------ weights

def hf_tensors(src):
    """(HF name, f32 array) for every weight, in HF layout, sorted by name."""
    arch = src.meta["general.architecture"]
    n_head = src.arch_key("attention.head_count")
    n_kv = src.arch_key("attention.head_count_kv", n_head)
    out = []
    for name in src.tensors:
        target = hf_layout.hf_name(name, arch)
        if target is None:
            continue  # rope_freqs and the like: not an HF weight
        w = src.tensor_f32(name)
        if hf_layout.needs_unpermute(name, arch):
            w = hf_layout.unpermute_rows(w, n_head if ".attn_q." in name else n_kv)
        offset = hf_layout.gemma_norm_offset(name, arch)
        if offset:
            w = w - np.float32(offset)
        out.append((target, w))
    out.sort(key=lambda t: t[0])
    return out


# ------------------------------------------------------------ safetensors

def to_dtype(w, dtype):
    """(raw little-endian bytes, safetensors dtype name) of f32 array `w`."""
    if dtype == "f32":
        return w.astype("<f4").tobytes(), "F32"
    if dtype == "f16":
        return w.astype("<f2").tobytes(), "F16"
    # bf16, round to nearest even (NaN-free weights).
    u = w.astype("<f4").view(np.uint32)
    u = (u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16
    return u.astype("<u2").tobytes(), "BF16"


def write_safetensors(path, items):
    """Write [(name, shape, dtype, bytes)] as one safetensors file."""
    header, offset = {}, 0
    for name, shape, dt, data in items:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in items:
            f.write(data)


def write_weights(out, tensors, dtype, shards):
    items = []
    for name, w in tensors:
        data, dt = to_dtype(w, dtype)
        items.append((name, w.shape, dt, data))
    if shards == 1:
        write_safetensors(os.path.join(out, "model.safetensors"), items)
        return
    total = sum(len(i[3]) for i in items)
    per_shard = -(-total // shards)
    groups, current, size = [], [], 0
    for item in items:
        if current and size + len(item[3]) > per_shard and len(groups) < shards - 1:
            groups.append(current)
            current, size = [], 0
        current.append(item)
        size += len(item[3])
    groups.append(current)
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(os.path.join(out, fname), group)
        for item in group:
            weight_map[item[0]] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    dump_json(os.path.join(out, "model.safetensors.index.json"), index)


def dump_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, sort_keys=False)
        f.write("\n")


# ------------------------------------------------------------ config.json

TORCH_DTYPE = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}


def config_json(src, dtype, tied):
    arch = src.meta["general.architecture"]
    n_embd = src.arch_key("embedding_length")
    n_head = src.arch_key("attention.head_count")
    vocab = src.tensors["token_embd.weight"][1][1]
    common = {
        "hidden_size": n_embd,
        "intermediate_size": src.arch_key("feed_forward_length"),
        "num_hidden_layers": src.arch_key("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": src.arch_key("attention.head_count_kv", n_head),
        "rms_norm_eps": src.arch_key("attention.layer_norm_rms_epsilon"),
        "rope_theta": src.arch_key("rope.freq_base"),
        "max_position_embeddings": src.arch_key("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "bos_token_id": src.meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": src.meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": TORCH_DTYPE[dtype],
        "initializer_range": 0.02,
        "use_cache": True,
        "transformers_version": "4.56.0",
    }
    if arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "hidden_act": "silu", "head_dim": n_embd // n_head, "attention_bias": False,
                "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1, "rope_scaling": None}
    if arch == "qwen2":
        n_layer = src.arch_key("block_count")
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common,
                "hidden_act": "silu", "attention_dropout": 0.0, "use_sliding_window": False,
                "sliding_window": src.arch_key("context_length"), "max_window_layers": n_layer,
                "rope_scaling": None}
    if arch == "qwen3":
        n_layer = src.arch_key("block_count")
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common,
                "hidden_act": "silu", "head_dim": src.arch_key("attention.key_length"),
                "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": n_layer, "rope_scaling": None}
    if arch == "gemma3":
        n_layer = src.arch_key("block_count")
        pattern = 6  # llama.cpp's gemma3 rule: every sixth layer is global
        head_dim = src.arch_key("attention.key_length")
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layer)]
        return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **common,
                "head_dim": head_dim, "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": head_dim, "sliding_window": src.arch_key("attention.sliding_window"),
                "layer_types": layer_types, "_sliding_window_pattern": pattern,
                "rope_local_base_freq": 10000.0, "rope_scaling": None, "final_logit_softcapping": None,
                "attn_logit_softcapping": None, "attention_bias": False, "attention_dropout": 0.0,
                "pad_token_id": src.meta.get("tokenizer.ggml.padding_token_id", 0)}
    raise ValueError(f"no HF config for architecture {arch}")


# ------------------------------------------------------------ tokenizer.json

# llama.cpp's token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def added_tokens(tokens, types):
    out = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (CONTROL, USER_DEFINED, UNKNOWN):
            out.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": ty == USER_DEFINED, "special": ty != USER_DEFINED})
    return out


def byte_level_tokenizer(src, tokens, types):
    pre = src.meta.get("tokenizer.ggml.pre", "default")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre == "smollm":
        # SmolLM2's own tokenizer.json: single digits, then GPT-2's split.
        pre_tokenizer = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]}
        normalizer = None
    elif pre == "qwen2":
        pre_tokenizer = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {**byte_level, "trim_offsets": False, "use_regex": False}]}
        normalizer = {"type": "NFC"}
    else:
        raise ValueError(f"no tokenizer.json pre-tokenizer for tokenizer.ggml.pre={pre}")
    merges = src.meta["tokenizer.ggml.merges"]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added_tokens(tokens, types),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }


def sentencepiece_tokenizer(src, tokens, types):
    scores = src.meta["tokenizer.ggml.scores"]
    ids = {t: i for i, t in enumerate(tokens)}
    # Merges: every split of a normal piece into two pieces of the vocabulary,
    # ranked by the merged piece's score (SentencePiece BPE merges the pair
    # whose result scores highest), then by the pieces' ids.
    merges = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty != NORMAL or len(t) < 2:
            continue
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            li, ri = ids.get(left), ids.get(right)
            if li is not None and ri is not None and types[li] == NORMAL and types[ri] == NORMAL:
                merges.append((-scores[i], i, li, ri, left, right))
    merges.sort()
    bos = src.meta.get("tokenizer.ggml.bos_token_id")
    add_bos = src.meta.get("tokenizer.ggml.add_bos_token", True)
    if add_bos and bos is not None:
        b = tokens[bos]
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {b: {"id": b, "ids": [bos], "tokens": [b]}}}
    else:
        post = None
    normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    if src.meta.get("tokenizer.ggml.add_space_prefix", False):
        normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, normalizer]}
    unk = src.meta.get("tokenizer.ggml.unknown_token_id")
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added_tokens(tokens, types),
        "normalizer": normalizer,
        "pre_tokenizer": None,
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[unk] if unk is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False,
                  "vocab": ids, "merges": [[m[4], m[5]] for m in merges]},
    }


def tokenizer_files(src):
    tokens = src.meta["tokenizer.ggml.tokens"]
    types = src.meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    model = src.meta["tokenizer.ggml.model"]
    if model == "gpt2":
        tok = byte_level_tokenizer(src, tokens, types)
    elif model == "llama":
        tok = sentencepiece_tokenizer(src, tokens, types)
    else:
        raise ValueError(f"no tokenizer.json export for tokenizer.ggml.model={model}")

    def text(key):
        i = src.meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and i < len(tokens) else None

    config = {
        "add_bos_token": bool(src.meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        "add_eos_token": bool(src.meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": text("bos_token_id"),
        "eos_token": text("eos_token_id"),
        "unk_token": text("unknown_token_id"),
        "pad_token": text("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": src.arch_key("context_length"),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = src.meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tok, config


# ------------------------------------------------------------ driver

def stamp_of(variant, source_path):
    script = hashlib.sha256()
    for path in (os.path.abspath(__file__), os.path.join(HERE, "hf_layout.py")):
        with open(path, "rb") as f:
            script.update(f.read())
    script = script.hexdigest()
    return json.dumps({"generator": script, "variant": variant, "source": os.path.basename(source_path),
                       "source_size": os.path.getsize(source_path)}, sort_keys=True)


def write_variant(variant, source_path, dtype, shards, out_root, force):
    out = os.path.join(out_root, variant)
    stamp = stamp_of(variant, source_path)
    stamp_path = os.path.join(out, ".flatrun-hf-stamp")
    if not force and os.path.exists(stamp_path) and open(stamp_path).read() == stamp:
        print(f"{variant}: up to date", file=sys.stderr)
        return
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    src = hf_layout.Gguf(source_path)
    tensors = hf_tensors(src)
    tied = "output.weight" not in src.tensors
    write_weights(tmp, tensors, dtype, shards)
    dump_json(os.path.join(tmp, "config.json"), config_json(src, dtype, tied))
    gen = {"bos_token_id": src.meta.get("tokenizer.ggml.bos_token_id"),
           "eos_token_id": src.meta.get("tokenizer.ggml.eos_token_id"), "transformers_version": "4.56.0"}
    dump_json(os.path.join(tmp, "generation_config.json"), gen)
    tok, tok_config = tokenizer_files(src)
    with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, separators=(",", ":"))
    dump_json(os.path.join(tmp, "tokenizer_config.json"), tok_config)
    with open(os.path.join(tmp, ".flatrun-hf-stamp"), "w") as f:
        f.write(stamp)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    print(f"{variant}: wrote {len(tensors)} tensors ({dtype}, {shards} file(s)) to {out}", file=sys.stderr)


def synthetic_source(name, synthetic_dir, vocab_dir):
    """The synthetic GGUF `name`, written by gen_synthetic_models.py when
    missing (the same bytes tests/families.rs checks); None without a vocabulary."""
    path = os.path.join(synthetic_dir, name)
    if os.path.exists(path):
        return path
    if not os.path.isdir(vocab_dir):
        print(f"{name}: no vocabulary directory {vocab_dir}", file=sys.stderr)
        return None
    subprocess.run([sys.executable, os.path.join(HERE, "gen_synthetic_models.py"), "--out", synthetic_dir,
                    "--vocab", vocab_dir, "--only", name], check=True, stdout=sys.stderr)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=os.environ.get("FLATRUN_MODELS", os.path.expanduser("~/.cache/flatrun/models")))
    ap.add_argument("--synthetic", default=os.environ.get("FLATRUN_SYNTHETIC", os.path.expanduser("~/.cache/flatrun/synthetic")))
    ap.add_argument("--vocab", default=os.environ.get("FLATRUN_VOCAB", os.path.expanduser("~/.cache/flatrun/vocab")),
                    help="vocab-only GGUFs, to write a missing synthetic source")
    ap.add_argument("--out", default=os.environ.get("FLATRUN_HF_CKPT", os.path.expanduser("~/.cache/flatrun/hf-ckpt")))
    ap.add_argument("--only", help="write only this variant (exact name), or those whose name contains it")
    ap.add_argument("--force", action="store_true", help="rewrite even when the stamp matches")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for variant, (source, dtype, shards) in VARIANTS.items():
        if a.only and (variant != a.only if a.only in VARIANTS else a.only not in variant):
            continue
        if source.startswith(SYNTHETIC):
            path = synthetic_source(source[len(SYNTHETIC):], a.synthetic, a.vocab)
        else:
            path = os.path.join(a.models, source)
        if path is None or not os.path.exists(path):
            print(f"{variant}: skipped, {path} is missing", file=sys.stderr)
            continue
        write_variant(variant, path, dtype, shards, a.out, a.force)


if __name__ == "__main__":
    main()
