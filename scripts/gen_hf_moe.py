#!/usr/bin/env python3
"""Write Hugging Face SafeTensors directories of the synthetic mixture-of-experts
checkpoints, each next to a GGUF holding the same weights.

Per variant, into ${FLATRUN_HF_CKPT:-~/.cache/flatrun/hf-ckpt}:
  <variant>/       the Hugging Face directory, as transformers' Qwen3MoeForCausalLM /
                   Qwen2MoeForCausalLM / OlmoeForCausalLM / MixtralForCausalLM save it: one
                   tensor per expert and projection (`model.layers.N.mlp.experts.E.{gate,up,
                   down}_proj.weight`, Mixtral `block_sparse_moe.experts.E.{w1,w3,w2}.weight`,
                   `[rows, cols]`), the router `mlp.gate.weight` (Mixtral
                   `block_sparse_moe.gate.weight`, `[n_expert, n_embd]`), Mixtral's Q/K rows
                   back in rotate-half order (`hf_layout.unpermute_rows`),
                   Qwen2-MoE's shared expert (`mlp.shared_expert.*`, `mlp.shared_expert_gate`),
                   `config.json` with the real keys (num_experts, num_experts_per_tok,
                   moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
                   mlp_only_layers, …), tokenizer.json / tokenizer_config.json exported
                   from the GGUF vocabulary (`gen_hf_checkpoints.tokenizer_files`);
  <variant>.gguf   for the bf16 and f32 variants: the same weights as a GGUF of the same
                   tensor types (written by `gen_synthetic_moe.write_decoder`, same seeds).
                   The f16 variants are made from `gen_synthetic_moe.py`'s
                   `<family>-synth-f16.gguf` itself (in $FLATRUN_SYNTHETIC), the file
                   `tests/moe.rs` checks against llama.cpp's logits.

Every tensor keeps its GGUF type (F16 or BF16 matrices, F32 norms and router; all F32
for f32), so a Hugging Face directory and its GGUF hold the same values bit for bit.
Tensors are stored sorted by name, so one projection's experts are neither adjacent
nor in order in the file (`experts.10` comes before `experts.2`, and every expert's
down, gate and up projections are interleaved); `-sharded` splits them over three
files with a `model.safetensors.index.json`.

Deterministic and idempotent: a variant is skipped when its `.flatrun-hf-stamp` (the
sha256 of this script, of `gen_hf_checkpoints.py` and `hf_layout.py`, and the source's
size) matches. Needs only numpy and the `gguf` package.

Usage: scripts/gen_hf_moe.py [--synthetic DIR] [--vocab DIR] [--out DIR] [--only NAME] [--force]
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_hf_checkpoints as hf  # noqa: E402  (safetensors writer, tokenizer export)
import hf_layout  # noqa: E402  (GGUF reader, dense tensor names)

# variant -> (family of gen_synthetic_moe.py, dtype, shards)
VARIANTS = {
    "qwen3moe-synth-f16": ("qwen3moe", "f16", 1),
    "qwen3moe-synth-f16-sharded": ("qwen3moe", "f16", 3),
    "qwen3moe-synth-bf16": ("qwen3moe", "bf16", 1),
    "qwen3moe-synth-f32": ("qwen3moe", "f32", 1),
    "qwen2moe-synth-f16": ("qwen2moe", "f16", 1),
    "olmoe-synth-f16": ("olmoe", "f16", 1),
    "mixtral-synth-f16": ("mixtral", "f16", 1),
}

# GGUF stacked experts -> the Hugging Face module of expert E's projection.
EXPERTS = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
           "ffn_down_exps": "mlp.experts.{e}.down_proj"}
# Other MoE tensors -> Hugging Face module under `model.layers.N.`.
MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Mixtral (GGUF `llama` with experts): `block_sparse_moe`, w1 / w3 / w2.
MIXTRAL_EXPERTS = {"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                   "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                   "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"}
MIXTRAL_NAMES = {"ffn_gate_inp": "block_sparse_moe.gate"}
GGML_DTYPE = {0: "f32", 1: "f16", 30: "bf16"}


def reference_gguf(family, dtype, synthetic_dir, vocab_dir, out_root):
    """The GGUF holding the variant's weights, written when missing."""
    if dtype == "f16":
        path = os.path.join(synthetic_dir, f"{family}-synth-f16.gguf")
        if not os.path.exists(path):
            subprocess.run([sys.executable, os.path.join(HERE, "gen_synthetic_moe.py"), "--out", synthetic_dir,
                            "--vocab", vocab_dir, "--only", os.path.basename(path)], check=True, stdout=sys.stderr)
        return path
    import gguf
    from gguf import GGMLQuantizationType as QT
    from pathlib import Path
    import gen_synthetic_moe as moe

    qtype = {"f32": QT.F32, "bf16": QT.BF16}[dtype]
    plain_store = moe.store

    def store(writer, name, w, qt):
        # BF16 matrices, f32 vectors (as the f16 files keep their norms).
        if qt == QT.BF16 and w.ndim > 1:
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), QT.BF16), raw_dtype=QT.BF16)
        else:
            plain_store(writer, name, w, QT.F32 if qt == QT.BF16 else qt)

    path = os.path.join(out_root, f"{family}-synth-{dtype}.gguf")
    tmp = path + ".tmp"
    moe.store = store
    try:
        moe.write_decoder(Path(tmp), family, moe.FAMILIES[family], Path(vocab_dir), qtype)
    finally:
        moe.store = plain_store
    os.replace(tmp, path)
    return path


def hf_tensors(src):
    """(HF name, f32 array, dtype) of every tensor of the GGUF, experts split, sorted by name."""
    arch = src.meta["general.architecture"]
    experts, moe_names = (MIXTRAL_EXPERTS, MIXTRAL_NAMES) if arch == "llama" else (EXPERTS, MOE_NAMES)
    n_head = src.arch_key("attention.head_count")
    n_kv = src.arch_key("attention.head_count_kv", n_head)
    out = []
    for name in src.tensors:
        dtype = GGML_DTYPE[src.tensors[name][0]]
        w = src.tensor_f32(name)
        stem, _, suffix = name.rpartition(".")
        part = stem.split(".", 2)[2] if stem.startswith("blk.") else None
        if part in experts:
            layer = stem.split(".")[1]
            for e in range(w.shape[0]):
                out.append((f"model.layers.{layer}.{experts[part].format(e=e)}.{suffix}", w[e], dtype))
            continue
        if part in moe_names:
            layer = stem.split(".")[1]
            if part == "ffn_gate_inp_shexp":
                w = w.reshape(1, -1)  # nn.Linear(hidden, 1)
            out.append((f"model.layers.{layer}.{moe_names[part]}.{suffix}", w, dtype))
            continue
        target = hf_layout.hf_name(name, arch)
        if target is None:
            raise ValueError(f"no Hugging Face name for {name}")
        if hf_layout.needs_unpermute(name, arch):
            # llama's Q/K rows back to Hugging Face's rotate-half order.
            w = hf_layout.unpermute_rows(w, n_head if ".attn_q." in name else n_kv)
        out.append((target, w, dtype))
    out.sort(key=lambda t: t[0])
    return out


def write_weights(out, tensors, shards):
    """`gen_hf_checkpoints.write_weights`, each tensor in its own dtype."""
    items = []
    for name, w, dtype in tensors:
        data, dt = hf.to_dtype(w, dtype)
        items.append((name, w.shape, dt, data))
    if shards == 1:
        hf.write_safetensors(os.path.join(out, "model.safetensors"), items)
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
        hf.write_safetensors(os.path.join(out, fname), group)
        for item in group:
            weight_map[item[0]] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    hf.dump_json(os.path.join(out, "model.safetensors.index.json"), index)


def config_json(src, dtype):
    arch = src.meta["general.architecture"]
    n_embd = src.arch_key("embedding_length")
    n_head = src.arch_key("attention.head_count")
    n_layer = src.arch_key("block_count")
    n_ff_exp = src.arch_key("expert_feed_forward_length")
    common = {
        "hidden_size": n_embd,
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": src.arch_key("attention.head_count_kv", n_head),
        "head_dim": src.arch_key("attention.key_length"),
        "rms_norm_eps": src.arch_key("attention.layer_norm_rms_epsilon"),
        "rope_theta": src.arch_key("rope.freq_base"),
        "rope_scaling": None,
        "max_position_embeddings": src.arch_key("context_length"),
        "vocab_size": src.tensors["token_embd.weight"][1][1],
        "tie_word_embeddings": "output.weight" not in src.tensors,
        "bos_token_id": src.meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": src.meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "num_experts": src.arch_key("expert_count"),
        "num_experts_per_tok": src.arch_key("expert_used_count"),
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "torch_dtype": hf.TORCH_DTYPE[dtype],
        "initializer_range": 0.02,
        "use_cache": True,
        "transformers_version": "4.56.0",
    }
    sparse = {"decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
              "sliding_window": None, "max_window_layers": n_layer}
    if arch == "qwen3moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common, **sparse,
                "intermediate_size": 6 * n_ff_exp, "moe_intermediate_size": n_ff_exp, "norm_topk_prob": True,
                "attention_bias": False}
    if arch == "qwen2moe":
        return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **common, **sparse,
                "intermediate_size": 6 * n_ff_exp, "moe_intermediate_size": n_ff_exp,
                "shared_expert_intermediate_size": src.arch_key("expert_shared_feed_forward_length"),
                "norm_topk_prob": False, "qkv_bias": True}
    if arch == "llama":
        mixtral = {k: v for k, v in common.items() if k != "num_experts"}
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **mixtral,
                "intermediate_size": n_ff_exp, "num_local_experts": common["num_experts"],
                "sliding_window": None, "attention_bias": False}
    if arch == "olmoe":
        return {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", **common,
                "intermediate_size": n_ff_exp, "norm_topk_prob": False, "clip_qkv": None,
                "attention_bias": False, "pad_token_id": 1}
    raise ValueError(f"no HF config for architecture {arch}")


def tokenizer_files(src):
    """`gen_hf_checkpoints.tokenizer_files`, plus GPT-2's own split for the
    vocabularies llama.cpp pre-tokenizes with it (`tokenizer.ggml.pre` absent)."""
    if src.meta.get("tokenizer.ggml.pre", "default") != "default":
        return hf.tokenizer_files(src)
    src.meta["tokenizer.ggml.pre"] = "qwen2"
    try:
        tok, config = hf.tokenizer_files(src)
    finally:
        del src.meta["tokenizer.ggml.pre"]
    tok["normalizer"] = None
    tok["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return tok, config


def stamp_of(variant, source_path):
    """What a variant is made from: the generators and, for the f16 variants,
    the source GGUF's size (the bf16 and f32 GGUFs are written with the variant)."""
    script = hashlib.sha256()
    for name in ("gen_hf_moe.py", "gen_hf_checkpoints.py", "hf_layout.py", "gen_synthetic_moe.py",
                 "gen_synthetic_models.py"):
        with open(os.path.join(HERE, name), "rb") as f:
            script.update(f.read())
    size = os.path.getsize(source_path) if os.path.exists(source_path) else None
    return json.dumps({"generator": script.hexdigest(), "variant": variant,
                       "source": os.path.basename(source_path), "source_size": size}, sort_keys=True)


def write_variant(variant, family, dtype, shards, a):
    out = os.path.join(a.out, variant)
    stamp_path = os.path.join(out, ".flatrun-hf-stamp")
    planned = (os.path.join(a.synthetic, f"{family}-synth-f16.gguf") if dtype == "f16"
               else os.path.join(a.out, f"{family}-synth-{dtype}.gguf"))
    if (not a.force and os.path.exists(planned) and os.path.exists(stamp_path)
            and open(stamp_path).read() == stamp_of(variant, planned)):
        print(f"{variant}: up to date", file=sys.stderr)
        return
    source_path = reference_gguf(family, dtype, a.synthetic, a.vocab, a.out)
    stamp = stamp_of(variant, source_path)
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    src = hf_layout.Gguf(source_path)
    tensors = hf_tensors(src)
    write_weights(tmp, tensors, shards)
    hf.dump_json(os.path.join(tmp, "config.json"), config_json(src, dtype))
    gen = {"bos_token_id": src.meta.get("tokenizer.ggml.bos_token_id"),
           "eos_token_id": src.meta.get("tokenizer.ggml.eos_token_id"), "transformers_version": "4.56.0"}
    hf.dump_json(os.path.join(tmp, "generation_config.json"), gen)
    tok, tok_config = tokenizer_files(src)
    with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, separators=(",", ":"))
    hf.dump_json(os.path.join(tmp, "tokenizer_config.json"), tok_config)
    with open(stamp_path.replace(out, tmp), "w") as f:
        f.write(stamp)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    print(f"{variant}: wrote {len(tensors)} tensors ({dtype}, {shards} file(s)) to {out}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic",
                    default=os.environ.get("FLATRUN_SYNTHETIC", os.path.expanduser("~/.cache/flatrun/synthetic")))
    ap.add_argument("--vocab", default=os.environ.get("FLATRUN_VOCAB", os.path.expanduser("~/.cache/flatrun/vocab")))
    ap.add_argument("--out", default=os.environ.get("FLATRUN_HF_CKPT", os.path.expanduser("~/.cache/flatrun/hf-ckpt")))
    ap.add_argument("--only", help="write only this variant (exact name), or those whose name contains it")
    ap.add_argument("--force", action="store_true", help="rewrite even when the stamp matches")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for variant, (family, dtype, shards) in VARIANTS.items():
        if a.only and (variant != a.only if a.only in VARIANTS else a.only not in variant):
            continue
        write_variant(variant, family, dtype, shards, a)


if __name__ == "__main__":
    main()
