#!/usr/bin/env python3
"""Upcycle a dense llama GGUF (SmolLM2) into a Mixtral-style one that routes.

Each layer's FFN (`ffn_gate`, `ffn_up`, `ffn_down`, bytes as stored) is
copied into `--experts` identical experts (`ffn_*_exps`) and a router
(`ffn_gate_inp`, f32, seeded Gaussian rows) picks `--used` of them per token,
with Mixtral's gating (softmax over the chosen logits, so the weights sum to
one). Identical experts make the output the dense model's (to float
rounding), so the model writes the dense model's text while its router
makes real choices: a top-k of fixed random projections of the real hidden
states of real text. That routing trace is what `benches/moe/cache_policy.py`
compares expert-cache policies on.

What the trace has of a trained router's: the temporal structure of real
hidden states (similar states choose similar experts). What it lacks: the
specialization and load balancing that training gives a router.

Usage: gen_routed_upcycle.py SRC.gguf OUT.gguf [--experts 32] [--used 4]
"""

import argparse
import sys

import numpy as np
import gguf
from gguf import GGUFValueType as VT


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    r = gguf.GGUFReader(a.src)
    arch = r.fields["general.architecture"].contents()
    if arch != "llama":
        print(f"expected a llama GGUF, got {arch}", file=sys.stderr)
        return 1
    w = gguf.GGUFWriter(a.out, "llama")
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == VT.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    n_embd = int(r.fields["llama.embedding_length"].contents())
    ne = a.experts
    w.add_expert_count(ne)
    w.add_expert_used_count(a.used)
    rng = np.random.default_rng(a.seed)
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
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
