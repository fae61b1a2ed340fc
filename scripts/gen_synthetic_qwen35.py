#!/usr/bin/env python3
"""Write small synthetic Qwen3.5 (`qwen35`) GGUF checkpoints.

Qwen3.5 is a hybrid stack: most layers are gated delta-net linear attention
(a fused QKV projection, a short causal conv1d, per-head decay and write
gates, a recurrent state per head), every `full_attention_interval`-th layer
is gated full attention (Q projection with an output gate, q/k RMS norms,
partial RoPE, a KV cache). Every layer has a SwiGLU FFN behind
`post_attention_norm`.

The files have the exact architecture llama.cpp loads (metadata keys, tensor
names and shapes as `convert_hf_to_gguf.py` writes them), the real Qwen3.5
tokenizer vocabulary (`ggml-vocab-qwen35.gguf` of the llama-cpp-python sdist)
and seeded random weights scaled so activations stay sane. The output is
deterministic (same script, `gguf` and numpy versions → byte-identical files);
`crates/flatrun-runtime/tests/qwen35.rs` checks the sha256 against
`crates/flatrun-runtime/tests/fixtures/qwen35/manifest.json`.

Variants:
  qwen35-synth-f16.gguf    matrices f16; norms, gates' constants and the conv
                           kernel f32 (as llama.cpp requires for ssm_conv1d)
  qwen35-synth-q8_0.gguf   every matrix (embedding included) Q8_0, quantized
                           with the gguf package's ggml-exact Q8_0 rule

Usage: gen_synthetic_qwen35.py [--out DIR] [--vocab DIR] [--only NAME...]
  DIR defaults to $FLATRUN_SYNTHETIC or ~/.cache/flatrun/synthetic,
  the vocabulary directory to $FLATRUN_VOCAB or ~/.cache/flatrun/vocab.
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

ARCH = "qwen35"

SPEC = dict(
    vocab="ggml-vocab-qwen35.gguf",
    n_embd=256,
    n_layer=6,
    full_attention_interval=3,  # layers 2 and 5 are full attention
    n_ff=512,
    # full attention
    n_head=4,
    n_head_kv=2,
    head_dim=64,
    n_rot=16,  # partial rotary factor 0.25
    rope_sections=[3, 3, 2, 0],
    rope_base=10_000_000.0,
    # gated delta net
    d_conv=4,
    d_state=32,  # head_k_dim = head_v_dim
    n_group=2,  # key heads
    dt_rank=4,  # value heads (tiled over the key heads)
    eps=1e-6,
    seed=35,
)


def is_recurrent(il: int, interval: int) -> bool:
    return (il + 1) % interval != 0


def dense_ffn(writer, blk: str, spec: dict, normal, qtype) -> None:
    """The SwiGLU FFN of a `qwen35` layer."""
    n_embd, n_ff = spec["n_embd"], spec["n_ff"]
    store(writer, f"{blk}.ffn_gate.weight", normal((n_ff, n_embd), 1 / math.sqrt(n_embd)), qtype)
    store(writer, f"{blk}.ffn_up.weight", normal((n_ff, n_embd), 1 / math.sqrt(n_embd)), qtype)
    store(writer, f"{blk}.ffn_down.weight", normal((n_embd, n_ff), 2.0 / math.sqrt(n_ff)), qtype)


def write_model(path: Path, spec: dict, vocab_dir: Path, qtype, arch: str = ARCH,
                extra_kv=None, store_ffn=dense_ffn) -> None:
    """Write a Qwen3.5-shaped hybrid stack of family `arch`; `extra_kv(writer)`
    adds metadata, `store_ffn(writer, blk, spec, normal, qtype)` each layer's FFN."""
    rng = np.random.default_rng(spec["seed"])
    n_embd, n_layer, n_ff = spec["n_embd"], spec["n_layer"], spec["n_ff"]
    n_head, n_head_kv, head_dim = spec["n_head"], spec["n_head_kv"], spec["head_dim"]
    d_conv, d_state = spec["d_conv"], spec["d_state"]
    n_k_heads, n_v_heads = spec["n_group"], spec["dt_rank"]
    key_dim = d_state * n_k_heads
    value_dim = d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    interval = spec["full_attention_interval"]

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("qwen35-synthetic")
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(spec["n_rot"])
    writer.add_rope_dimension_sections(spec["rope_sections"])
    writer.add_rope_freq_base(spec["rope_base"])
    writer.add_layer_norm_rms_eps(spec["eps"])
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_group_count(n_k_heads)
    writer.add_ssm_time_step_rank(n_v_heads)
    writer.add_ssm_inner_size(value_dim)
    writer.add_full_attention_interval(interval)
    writer.add_file_type({QT.F16: 1, QT.Q8_0: 7}.get(qtype, 0))
    n_vocab = copy_tokenizer(writer, vocab_dir / spec["vocab"])
    writer.add_vocab_size(n_vocab)
    if extra_kv is not None:
        extra_kv(writer)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_weight(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    def uniform(shape, lo, hi):
        return rng.uniform(lo, hi, size=shape).astype(np.float32)

    # Weights are drawn in a fixed order, independent of the storage type, so
    # the f16 and quantized variants hold the same model. Tied output head
    # (no `output.weight`), as in the small Qwen3.5 checkpoints.
    store(writer, "token_embd.weight", normal((n_vocab, n_embd), 0.5), qtype)
    for il in range(n_layer):
        blk = f"blk.{il}"
        store(writer, f"{blk}.attn_norm.weight", norm_weight(n_embd), qtype)
        if is_recurrent(il, interval):
            # Gated delta net. Rows of attn_qkv: q (key heads), k (key heads), v (value heads).
            store(writer, f"{blk}.attn_qkv.weight", normal((conv_dim, n_embd), 1 / math.sqrt(n_embd)), qtype)
            store(writer, f"{blk}.attn_gate.weight", normal((value_dim, n_embd), 1 / math.sqrt(n_embd)), qtype)
            # Causal depthwise conv kernel [channels, d_conv]; llama.cpp needs it in f32.
            writer.add_tensor(f"{blk}.ssm_conv1d.weight", normal((conv_dim, d_conv), 1 / math.sqrt(d_conv)))
            # dt bias and A = -exp(A_log): per-step decay exp(softplus(alpha + dt) * A) near 0.9.
            writer.add_tensor(f"{blk}.ssm_dt.bias", (normal((n_v_heads,), 0.3) - 1.0).astype(np.float32))
            a_log = uniform((n_v_heads,), math.log(0.02), math.log(0.3))
            writer.add_tensor(f"{blk}.ssm_a", (-np.exp(a_log)).astype(np.float32))
            store(writer, f"{blk}.ssm_beta.weight", normal((n_v_heads, n_embd), 1 / math.sqrt(n_embd)), qtype)
            store(writer, f"{blk}.ssm_alpha.weight", normal((n_v_heads, n_embd), 1 / math.sqrt(n_embd)), qtype)
            store(writer, f"{blk}.ssm_norm.weight", norm_weight(d_state), qtype)
            store(writer, f"{blk}.ssm_out.weight", normal((n_embd, value_dim), 2.0 / math.sqrt(value_dim)), qtype)
        else:
            # Gated attention: attn_q rows are [q (head_dim), gate (head_dim)] per head.
            store(writer, f"{blk}.attn_q.weight", normal((2 * n_head * head_dim, n_embd), 1 / math.sqrt(n_embd)), qtype)
            store(writer, f"{blk}.attn_k.weight", normal((n_head_kv * head_dim, n_embd), 1 / math.sqrt(n_embd)), qtype)
            store(writer, f"{blk}.attn_v.weight", normal((n_head_kv * head_dim, n_embd), 1 / math.sqrt(n_embd)), qtype)
            store(writer, f"{blk}.attn_q_norm.weight", norm_weight(head_dim), qtype)
            store(writer, f"{blk}.attn_k_norm.weight", norm_weight(head_dim), qtype)
            store(writer, f"{blk}.attn_output.weight",
                  normal((n_embd, n_head * head_dim), 2.0 / math.sqrt(n_head * head_dim)), qtype)
        store(writer, f"{blk}.post_attention_norm.weight", norm_weight(n_embd), qtype)
        store_ffn(writer, blk, spec, normal, qtype)
    store(writer, "output_norm.weight", norm_weight(n_embd), qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def variants():
    """(file name, storage type) of every synthetic file."""
    return [("qwen35-synth-f16.gguf", QT.F16), ("qwen35-synth-q8_0.gguf", QT.Q8_0)]


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
    for name, qtype in variants():
        if a.only and name not in a.only:
            continue
        path = a.out / name
        tmp = path.with_suffix(".gguf.tmp")
        write_model(tmp, SPEC, a.vocab, qtype)
        tmp.replace(path)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        print(f"{digest}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
