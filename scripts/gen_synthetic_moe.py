#!/usr/bin/env python3
"""Write small synthetic mixture-of-experts GGUF checkpoints.

One file per family and storage type, with the exact architecture llama.cpp
loads (metadata keys, tensor names and shapes as `convert_hf_to_gguf.py`
writes them: experts stacked as `ffn_{gate,up,down}_exps` of ggml shape
`[cols, rows, n_expert]`), a real tokenizer vocabulary and seeded random
weights. The router (`ffn_gate_inp`) and the shared expert's gate stay f32,
as `llama-quantize` leaves them. Deterministic: same script, `gguf` and numpy
versions give byte-identical files; `crates/flatrun-runtime/tests/moe.rs`
checks their sha256 against `crates/flatrun-runtime/tests/fixtures/moe/manifest.json`.

Families (see docs/families.md):
  qwen3moe   Qwen3 attention (per-head q/k norms), 16 experts, top-4, renormalized
  mixtral    `llama` with 8 experts, top-2 (Mixtral)
  olmoe      q/k norms over the whole q and k, 8 experts, top-2
  qwen2moe   Qwen2 attention (Q/K/V biases), 8 experts, top-2, a gated shared expert
  qwen35moe  the Qwen3.5 hybrid stack (gen_synthetic_qwen35.py) with 8 experts,
             top-2, renormalized, and a gated shared expert

Usage: gen_synthetic_moe.py [--out DIR] [--vocab DIR] [--only NAME...]
"""

import argparse
import hashlib
import math
import os
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_synthetic_models import copy_tokenizer, store  # noqa: E402
import gen_synthetic_qwen35  # noqa: E402

FAMILIES = {
    "qwen3moe": dict(arch="qwen3moe", vocab="ggml-vocab-qwen2.gguf", n_embd=128, n_layer=3, n_head=4,
                     n_head_kv=2, head_dim=64, rope_base=1000000.0, eps=1e-6, qk_norm="head",
                     qkv_bias=False, n_expert=16, n_expert_used=4, n_ff_exp=64, n_ff_shexp=0, seed=301),
    "mixtral": dict(arch="llama", vocab="ggml-vocab-llama-spm.gguf", n_embd=128, n_layer=2, n_head=4,
                    n_head_kv=2, head_dim=32, rope_base=1000000.0, eps=1e-5, qk_norm=None,
                    qkv_bias=False, n_expert=8, n_expert_used=2, n_ff_exp=128, n_ff_shexp=0, seed=87),
    "olmoe": dict(arch="olmoe", vocab="ggml-vocab-gpt-neox.gguf", n_embd=128, n_layer=2, n_head=4,
                  n_head_kv=4, head_dim=32, rope_base=10000.0, eps=1e-5, qk_norm="full",
                  qkv_bias=False, n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=0, seed=77),
    "qwen2moe": dict(arch="qwen2moe", vocab="ggml-vocab-qwen2.gguf", n_embd=128, n_layer=2, n_head=4,
                     n_head_kv=2, head_dim=32, rope_base=1000000.0, eps=1e-6, qk_norm=None,
                     qkv_bias=True, n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=128, seed=257),
}

# A wider router spread: the delta-net layers carry Q8_0 activation rounding
# along the prompt, and a near-tie between two experts would turn it into a
# different expert.
QWEN35MOE = dict(gen_synthetic_qwen35.SPEC, n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=128,
                 router_spread=6.0, seed=353)


def add_expert_kv(writer, spec: dict) -> None:
    writer.add_expert_count(spec["n_expert"])
    writer.add_expert_used_count(spec["n_expert_used"])
    writer.add_expert_feed_forward_length(spec["n_ff_exp"])
    if spec["n_ff_shexp"]:
        writer.add_expert_shared_feed_forward_length(spec["n_ff_shexp"])


def moe_ffn(writer, blk: str, spec: dict, normal, qtype) -> None:
    """A layer's router, stacked experts and (when the spec has one) gated shared expert."""
    d, ne, ff = spec["n_embd"], spec["n_expert"], spec["n_ff_exp"]
    # Router logits with a spread of a few units: the top-k is rarely a near-tie.
    writer.add_tensor(f"{blk}.ffn_gate_inp.weight", normal((ne, d), spec.get("router_spread", 2.0) / math.sqrt(d)))
    store(writer, f"{blk}.ffn_gate_exps.weight", normal((ne, ff, d), 1 / math.sqrt(d)), qtype)
    store(writer, f"{blk}.ffn_up_exps.weight", normal((ne, ff, d), 1 / math.sqrt(d)), qtype)
    store(writer, f"{blk}.ffn_down_exps.weight", normal((ne, d, ff), 2.0 / math.sqrt(ff)), qtype)
    sff = spec["n_ff_shexp"]
    if sff:
        writer.add_tensor(f"{blk}.ffn_gate_inp_shexp.weight", normal((d,), 1 / math.sqrt(d)))
        store(writer, f"{blk}.ffn_gate_shexp.weight", normal((sff, d), 1 / math.sqrt(d)), qtype)
        store(writer, f"{blk}.ffn_up_shexp.weight", normal((sff, d), 1 / math.sqrt(d)), qtype)
        store(writer, f"{blk}.ffn_down_shexp.weight", normal((d, sff), 2.0 / math.sqrt(sff)), qtype)


def write_decoder(path: Path, family: str, spec: dict, vocab_dir: Path, qtype) -> None:
    """An attention-only MoE decoder of `spec`."""
    arch = spec["arch"]
    rng = np.random.default_rng(spec["seed"])
    d, n_layer = spec["n_embd"], spec["n_layer"]
    n_head, n_head_kv, hd = spec["n_head"], spec["n_head_kv"], spec["head_dim"]

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{family}-synthetic")
    writer.add_context_length(4096)
    writer.add_embedding_length(d)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(spec["n_ff_exp"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_dimension_count(hd)
    writer.add_rope_freq_base(spec["rope_base"])
    writer.add_layer_norm_rms_eps(spec["eps"])
    writer.add_file_type({QT.F16: 1, QT.Q8_0: 7}.get(qtype, 0))
    add_expert_kv(writer, spec)
    n_vocab = copy_tokenizer(writer, vocab_dir / spec["vocab"])
    writer.add_vocab_size(n_vocab)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_weight(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    qd, kvd = n_head * hd, n_head_kv * hd
    store(writer, "token_embd.weight", normal((n_vocab, d), 0.5), qtype)
    for il in range(n_layer):
        blk = f"blk.{il}"
        store(writer, f"{blk}.attn_norm.weight", norm_weight(d), qtype)
        store(writer, f"{blk}.attn_q.weight", normal((qd, d), 1 / math.sqrt(d)), qtype)
        store(writer, f"{blk}.attn_k.weight", normal((kvd, d), 1 / math.sqrt(d)), qtype)
        store(writer, f"{blk}.attn_v.weight", normal((kvd, d), 1 / math.sqrt(d)), qtype)
        if spec["qkv_bias"]:
            writer.add_tensor(f"{blk}.attn_q.bias", normal((qd,), 0.1))
            writer.add_tensor(f"{blk}.attn_k.bias", normal((kvd,), 0.1))
            writer.add_tensor(f"{blk}.attn_v.bias", normal((kvd,), 0.1))
        if spec["qk_norm"] == "head":
            store(writer, f"{blk}.attn_q_norm.weight", norm_weight(hd), qtype)
            store(writer, f"{blk}.attn_k_norm.weight", norm_weight(hd), qtype)
        elif spec["qk_norm"] == "full":
            store(writer, f"{blk}.attn_q_norm.weight", norm_weight(qd), qtype)
            store(writer, f"{blk}.attn_k_norm.weight", norm_weight(kvd), qtype)
        store(writer, f"{blk}.attn_output.weight", normal((d, qd), 2.0 / math.sqrt(qd)), qtype)
        store(writer, f"{blk}.ffn_norm.weight", norm_weight(d), qtype)
        moe_ffn(writer, blk, spec, normal, qtype)
    store(writer, "output_norm.weight", norm_weight(d), qtype)
    store(writer, "output.weight", normal((n_vocab, d), 0.5), qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write(name: str, path: Path, vocab_dir: Path, qtype) -> None:
    if name == "qwen35moe":
        gen_synthetic_qwen35.write_model(path, QWEN35MOE, vocab_dir, qtype, arch="qwen35moe",
                                         extra_kv=lambda w: add_expert_kv(w, QWEN35MOE), store_ffn=moe_ffn)
    else:
        write_decoder(path, name, FAMILIES[name], vocab_dir, qtype)


def variants():
    """(file name, family, storage type) of every synthetic file."""
    out = []
    for family in [*FAMILIES, "qwen35moe"]:
        for tag, qtype in (("f16", QT.F16), ("q8_0", QT.Q8_0)):
            out.append((f"{family}-synth-{tag}.gguf", family, qtype))
    return out


def main() -> int:
    home = Path(os.path.expanduser("~"))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path,
                    default=Path(os.environ.get("FLATRUN_SYNTHETIC", home / ".cache/flatrun/synthetic")))
    ap.add_argument("--vocab", type=Path,
                    default=Path(os.environ.get("FLATRUN_VOCAB", home / ".cache/flatrun/vocab")))
    ap.add_argument("--only", nargs="*", help="file names to (re)write")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for name, family, qtype in variants():
        if a.only and name not in a.only:
            continue
        path = a.out / name
        tmp = path.with_suffix(".gguf.tmp")
        write(family, tmp, a.vocab, qtype)
        tmp.replace(path)
        print(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
