#!/usr/bin/env python3
"""Write a small synthetic gpt-oss (`gpt-oss`) GGUF checkpoint.

gpt-oss is a mixture-of-experts decoder: attention with Q/K/V/O biases,
learned per-head attention sinks, sliding-window attention on every other
layer (even layers windowed), YaRN RoPE (NeoX layout); a routed FFN behind
`post_attention_norm`: a router with a bias, top-k over the raw logits and a
softmax over the selected ones, experts stored in MXFP4 with biases on the
gate, up and down projections, and the clamped SwiGLU
`min(g, 7)·σ(1.702·min(g, 7))·(clamp(u, ±7) + 1)`.

The file has the exact layout llama.cpp loads (metadata keys, tensor names
and shapes as `convert_hf_to_gguf.py` writes them for gpt-oss: experts
MXFP4, the other matrices Q8_0, router, biases, sinks and norms f32), the
chat template of the real model (`openai-gpt-oss-120b.jinja` of the
llama-cpp-python sdist) and seeded random weights scaled so activations stay
sane. The vocabulary is Qwen2's (`ggml-vocab-qwen2.gguf`): gpt-oss's own
o200k_harmony vocabulary is not shipped by any package the test setup can
fetch. The output is deterministic; `crates/flatrun-runtime/tests/gptoss.rs`
checks its sha256 against `crates/flatrun-runtime/tests/fixtures/gptoss/manifest.json`.

Usage: gen_synthetic_gptoss.py [--out DIR] [--vocab DIR]
  DIR defaults to $FLATRUN_SYNTHETIC or ~/.cache/flatrun/synthetic,
  the vocabulary directory to $FLATRUN_VOCAB or ~/.cache/flatrun/vocab
  (which also holds the chat template, see scripts/setup-test-env.sh).
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

ARCH = "gpt-oss"
FILE = "gptoss-synth-mxfp4.gguf"
TEMPLATE = "openai-gpt-oss-120b.jinja"

SPEC = dict(
    vocab="ggml-vocab-qwen2.gguf",
    n_embd=128,
    n_layer=4,  # layers 0 and 2 windowed
    n_head=4,
    n_head_kv=2,
    head_dim=64,
    n_expert=8,
    n_expert_used=4,
    n_ff_exp=128,
    sliding_window=16,  # small, so the test prompts cross it
    rope_base=150_000.0,
    yarn_factor=32.0,
    yarn_orig_ctx=4096,
    eps=1e-5,
    seed=20,
)


def write_model(path: Path, spec: dict, vocab_dir: Path) -> None:
    rng = np.random.default_rng(spec["seed"])
    n_embd, n_layer = spec["n_embd"], spec["n_layer"]
    n_head, n_head_kv, hd = spec["n_head"], spec["n_head_kv"], spec["head_dim"]
    n_exp, n_ff = spec["n_expert"], spec["n_ff_exp"]

    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_name("gpt-oss-synthetic")
    writer.add_context_length(spec["yarn_orig_ctx"] * int(spec["yarn_factor"]))
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_dimension_count(hd)
    writer.add_rope_freq_base(spec["rope_base"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(spec["yarn_factor"])
    writer.add_rope_scaling_orig_ctx_len(spec["yarn_orig_ctx"])
    writer.add_layer_norm_rms_eps(spec["eps"])
    writer.add_sliding_window(spec["sliding_window"])
    writer.add_expert_count(n_exp)
    writer.add_expert_used_count(spec["n_expert_used"])
    writer.add_expert_feed_forward_length(n_ff)
    writer.add_file_type(38)  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    n_vocab = copy_tokenizer(writer, vocab_dir / spec["vocab"])
    writer.add_vocab_size(n_vocab)
    writer.add_chat_template((vocab_dir / TEMPLATE).read_text())

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_weight(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    def mxfp4(name, w):
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), QT.MXFP4), raw_dtype=QT.MXFP4)

    store(writer, "token_embd.weight", normal((n_vocab, n_embd), 0.5), QT.Q8_0)
    for il in range(n_layer):
        blk = f"blk.{il}"
        q_dim, kv_dim = n_head * hd, n_head_kv * hd
        store(writer, f"{blk}.attn_norm.weight", norm_weight(n_embd), QT.F32)
        store(writer, f"{blk}.attn_q.weight", normal((q_dim, n_embd), 1 / math.sqrt(n_embd)), QT.Q8_0)
        store(writer, f"{blk}.attn_k.weight", normal((kv_dim, n_embd), 1 / math.sqrt(n_embd)), QT.Q8_0)
        store(writer, f"{blk}.attn_v.weight", normal((kv_dim, n_embd), 1 / math.sqrt(n_embd)), QT.Q8_0)
        store(writer, f"{blk}.attn_q.bias", normal((q_dim,), 0.1), QT.F32)
        store(writer, f"{blk}.attn_k.bias", normal((kv_dim,), 0.1), QT.F32)
        store(writer, f"{blk}.attn_v.bias", normal((kv_dim,), 0.1), QT.F32)
        store(writer, f"{blk}.attn_output.weight", normal((n_embd, q_dim), 1.0 / math.sqrt(q_dim)), QT.Q8_0)
        store(writer, f"{blk}.attn_output.bias", normal((n_embd,), 0.1), QT.F32)
        # Sinks near the scores' scale, so they take a real share of the softmax.
        store(writer, f"{blk}.attn_sinks.weight", normal((n_head,), 1.0), QT.F32)
        store(writer, f"{blk}.post_attention_norm.weight", norm_weight(n_embd), QT.F32)
        store(writer, f"{blk}.ffn_gate_inp.weight", normal((n_exp, n_embd), 1 / math.sqrt(n_embd)), QT.F32)
        store(writer, f"{blk}.ffn_gate_inp.bias", normal((n_exp,), 0.2), QT.F32)
        # Gate and up pre-activations reach past the clamp (±7) now and then.
        mxfp4(f"{blk}.ffn_gate_exps.weight", normal((n_exp, n_ff, n_embd), 3.0 / math.sqrt(n_embd)))
        mxfp4(f"{blk}.ffn_up_exps.weight", normal((n_exp, n_ff, n_embd), 3.0 / math.sqrt(n_embd)))
        mxfp4(f"{blk}.ffn_down_exps.weight", normal((n_exp, n_embd, n_ff), 0.5 / math.sqrt(n_ff)))
        store(writer, f"{blk}.ffn_gate_exps.bias", normal((n_exp, n_ff), 0.5), QT.F32)
        store(writer, f"{blk}.ffn_up_exps.bias", normal((n_exp, n_ff), 0.5), QT.F32)
        store(writer, f"{blk}.ffn_down_exps.bias", normal((n_exp, n_embd), 0.1), QT.F32)
    store(writer, "output_norm.weight", norm_weight(n_embd), QT.F32)
    store(writer, "output.weight", normal((n_vocab, n_embd), 1 / math.sqrt(n_embd)), QT.Q8_0)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> int:
    home = Path(os.path.expanduser("~"))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path,
                    default=Path(os.environ.get("FLATRUN_SYNTHETIC", home / ".cache/flatrun/synthetic")))
    ap.add_argument("--vocab", type=Path,
                    default=Path(os.environ.get("FLATRUN_VOCAB", home / ".cache/flatrun/vocab")))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / FILE
    tmp = path.with_suffix(".gguf.tmp")
    write_model(tmp, SPEC, a.vocab)
    tmp.replace(path)
    print(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
