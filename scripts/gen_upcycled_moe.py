#!/usr/bin/env python3
"""Upcycle a dense GGUF into a mixture-of-experts one whose output equals it.

Every layer's FFN (`ffn_gate`, `ffn_up`, `ffn_down`, bytes as stored) is
copied into each of `--experts` identical experts (`ffn_*_exps`), and the
router (`ffn_gate_inp`, f32) gets seeded random weights. Attention, norms,
embeddings, head and tokenizer are copied unchanged.

  qwen2 -> qwen2moe   every token uses all experts (qwen2moe does not
                      renormalize the chosen experts' weights, so all of
                      them must be chosen for the weights to sum to one);
                      the shared expert `qwen2moe` requires is a small f32
                      FFN whose down projection is zero, so it adds nothing.
                      Metadata keys move from `qwen2.*` to `qwen2moe.*`.
  llama -> llama      Mixtral-style: `--used` of the experts per token, a
                      softmax over the chosen logits (weights sum to one).

Identical experts whose weights sum to one make the output the dense
model's (to float rounding). What a match with the dense model's greedy
text proves: the stacked-expert layout and row ranges, the expert
GEMVs/GEMMs on real quantized weights (Q4_K/Q6_K/Q5_0/Q4_1 as the source
file has them), the weighted sum and the shared expert path, through a real
tokenizer. What it does not: the choice among experts that differ (routing
with top-k < n_expert is covered by the synthetic fidelity tests against
llama.cpp).

With `--used` below `--experts` (llama) the router makes real choices: a
top-k of fixed random projections of the real hidden states of real text.
That routing trace is what `benches/moe/policy_traces.sh` compares
expert-cache policies on. It has the temporal structure of real hidden
states (similar states choose similar experts); it lacks the
specialization and load balancing that training gives a router.

Usage: gen_upcycled_moe.py SRC.gguf OUT.gguf [--experts N] [--used K] [--seed S]
"""

import argparse
import sys

import numpy as np
import gguf
from gguf import GGUFValueType as VT

SHARED_FF = 32
# Source architecture -> (written architecture, shared expert, default seed).
TARGETS = {"qwen2": ("qwen2moe", True, 20), "llama": ("llama", False, 7)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--used", type=int, help="experts per token (llama only; default all)")
    ap.add_argument("--seed", type=int)
    a = ap.parse_args()
    r = gguf.GGUFReader(a.src)
    src_arch = r.fields["general.architecture"].contents()
    if src_arch not in TARGETS:
        print(f"expected a qwen2 or llama GGUF, got {src_arch}", file=sys.stderr)
        return 1
    arch, shared, seed = TARGETS[src_arch]
    ne = a.experts
    used = ne if a.used is None else a.used
    if shared and used != ne:
        print("qwen2moe does not renormalize: every expert must be used", file=sys.stderr)
        return 1
    w = gguf.GGUFWriter(a.out, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name.startswith(src_arch + "."):
            name = arch + "." + name[len(src_arch) + 1:]
        vtype = field.types[0]
        value = field.contents()
        if vtype == VT.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    n_embd = int(r.fields[f"{src_arch}.embedding_length"].contents())
    n_ff = int(r.fields[f"{src_arch}.feed_forward_length"].contents())
    w.add_expert_count(ne)
    w.add_expert_used_count(used)
    if shared:
        w.add_expert_feed_forward_length(n_ff)
        w.add_expert_shared_feed_forward_length(SHARED_FF)
    rng = np.random.default_rng(seed if a.seed is None else a.seed)
    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            if parts[2] != "ffn_gate":
                continue  # written with the gate, in llama.cpp's tensor order
            blk = f"blk.{parts[1]}"
            w.add_tensor(f"{blk}.ffn_gate_inp.weight", rng.standard_normal((ne, n_embd), dtype=np.float32))
            for stem in ("ffn_gate", "ffn_up", "ffn_down"):
                src = tensors[f"{blk}.{stem}.weight"]
                data = np.stack([np.asarray(src.data)] * ne)
                w.add_tensor(f"{blk}.{stem}_exps.weight", data, raw_dtype=src.tensor_type)
            if shared:
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
