#!/usr/bin/env python3
"""Upcycle a dense Qwen2 GGUF into a `qwen2moe` one whose output equals it.

Every layer's FFN (`ffn_gate`, `ffn_up`, `ffn_down`, bytes as stored) is
copied into each of `--experts` experts (`ffn_*_exps`); the router
(`ffn_gate_inp`, f32) gets seeded random weights and every token uses all
experts, so the softmax weights sum to one whatever the router says and the
weighted sum of identical experts is the dense FFN. The shared expert that
`qwen2moe` requires is a small f32 FFN whose down projection
is zero, so it adds nothing. Attention, norms, embeddings, head and
tokenizer are copied unchanged; metadata keys move from `qwen2.*` to
`qwen2moe.*`.

What a match with the dense model's greedy text proves: the stacked-expert
layout and row ranges, the expert GEMVs/GEMMs on real quantized weights
(Q4_K/Q6_K/Q5_0 as the source file has them), the weighted sum and the shared
expert path, through a real tokenizer. What it does not: the choice among
experts that differ (routing with top-k < n_expert is covered by the
synthetic fidelity tests against llama.cpp).

Usage: gen_upcycled_moe.py SRC.gguf OUT.gguf [--experts N]
"""

import argparse
import sys

import numpy as np
import gguf
from gguf import GGUFValueType as VT

SHARED_FF = 32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--experts", type=int, default=2)
    a = ap.parse_args()
    r = gguf.GGUFReader(a.src)
    src_arch = r.fields["general.architecture"].contents()
    if src_arch != "qwen2":
        print(f"expected a qwen2 GGUF, got {src_arch}", file=sys.stderr)
        return 1
    w = gguf.GGUFWriter(a.out, "qwen2moe")
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name.startswith("qwen2."):
            name = "qwen2moe." + name[len("qwen2."):]
        vtype = field.types[0]
        value = field.contents()
        if vtype == VT.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    n_embd = int(r.fields["qwen2.embedding_length"].contents())
    n_ff = int(r.fields["qwen2.feed_forward_length"].contents())
    ne = a.experts
    w.add_expert_count(ne)
    w.add_expert_used_count(ne)
    w.add_expert_feed_forward_length(n_ff)
    w.add_expert_shared_feed_forward_length(SHARED_FF)
    rng = np.random.default_rng(20)
    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            if parts[2] == "ffn_down":
                continue  # written with the gate, in llama.cpp's tensor order
            blk = f"blk.{parts[1]}"
            if parts[2] == "ffn_gate":
                w.add_tensor(f"{blk}.ffn_gate_inp.weight", rng.standard_normal((ne, n_embd), dtype=np.float32))
                for stem in ("ffn_gate", "ffn_up", "ffn_down"):
                    src = tensors[f"{blk}.{stem}.weight"]
                    data = np.stack([np.asarray(src.data)] * ne)
                    w.add_tensor(f"{blk}.{stem}_exps.weight", data, raw_dtype=src.tensor_type)
                # Not zero: llama.cpp's qwen2moe computes the sigmoid as silu(x) / x.
                w.add_tensor(f"{blk}.ffn_gate_inp_shexp.weight",
                             rng.standard_normal(n_embd, dtype=np.float32) * 0.01)
                w.add_tensor(f"{blk}.ffn_gate_shexp.weight",
                             rng.standard_normal((SHARED_FF, n_embd), dtype=np.float32) * 0.03)
                w.add_tensor(f"{blk}.ffn_up_shexp.weight",
                             rng.standard_normal((SHARED_FF, n_embd), dtype=np.float32) * 0.03)
                w.add_tensor(f"{blk}.ffn_down_shexp.weight", np.zeros((n_embd, SHARED_FF), dtype=np.float32))
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
