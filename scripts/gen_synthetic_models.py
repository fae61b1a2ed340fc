#!/usr/bin/env python3
"""Write small synthetic GGUF checkpoints of model families with no real weights here.

Each file has the exact architecture of its family (metadata keys, tensor names
and shapes as llama.cpp's converter writes them), the family's real tokenizer
vocabulary (copied from a vocab-only GGUF of the llama-cpp-python sdist), and
seeded random weights scaled so activations stay sane. The output is
deterministic: the same script and `gguf`/numpy versions give byte-identical
files, whose sha256 the parity test (`crates/flatrun-runtime/tests/families.rs`)
checks against `crates/flatrun-runtime/tests/fixtures/families/manifest.json`.

Families and variants:
  llama3-synth-{f16,q8_0}.gguf   `llama` arch, llama3 RoPE scaling baked into a
                                 `rope_freqs` tensor, `llama-bpe` vocabulary
  qwen3-synth-{f16,q8_0}.gguf    `qwen3` arch: q/k RMS norms, no QKV bias,
                                 head_dim (key_length) != n_embd / n_head,
                                 `qwen2` vocabulary
  bonsai-synth-{f16,q1_0}.gguf   Qwen3 layout; the q1_0 variant stores every
                                 matrix (embedding included) as Q1_0, quantized
                                 here with ggml's exact `quantize_row_q1_0_ref`
                                 rule (f16 d = mean |x| per 128-block, 1 bit = sign)

Usage: gen_synthetic_models.py [--out DIR] [--vocab DIR] [--only NAME...]
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


# ---------------------------------------------------------------- vocabulary


def copy_tokenizer(writer: gguf.GGUFWriter, vocab_path: Path) -> int:
    """Copy every `tokenizer.*` key of a vocab-only GGUF; return the vocabulary size."""
    reader = gguf.GGUFReader(str(vocab_path))
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_string(name, value)
        elif vtype == gguf.GGUFValueType.BOOL:
            writer.add_bool(name, bool(value))
        elif vtype == gguf.GGUFValueType.UINT32:
            writer.add_uint32(name, int(value))
        elif vtype == gguf.GGUFValueType.INT32:
            writer.add_int32(name, int(value))
        elif vtype == gguf.GGUFValueType.FLOAT32:
            writer.add_float32(name, float(value))
        else:
            raise ValueError(f"{vocab_path}: unsupported key type {vtype} for {name}")
    if n_vocab == 0:
        raise ValueError(f"{vocab_path}: no tokenizer.ggml.tokens")
    return n_vocab


# ---------------------------------------------------------------- quantization


def quantize_q1_0(x: np.ndarray) -> np.ndarray:
    """ggml Q1_0: per 128 values an f16 scale d = mean |x| and one sign bit each (1 = x >= 0)."""
    rows, cols = x.shape
    if cols % 128 != 0:
        raise ValueError(f"Q1_0 needs rows of a multiple of 128 values, got {cols}")
    blocks = x.astype(np.float32).reshape(-1, 128)
    d = (np.abs(blocks).sum(axis=1, dtype=np.float32) / np.float32(128)).astype(np.float16)
    bits = np.packbits(blocks >= 0.0, axis=1, bitorder="little")
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), bits], axis=1)
    return out.reshape(rows, -1)


def store(writer, name: str, w: np.ndarray, qtype) -> None:
    """Add matrix/vector `w` (numpy row-major, ggml ne reversed) as `qtype`."""
    if w.ndim == 1 or qtype == QT.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == QT.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif qtype == QT.Q8_0:
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), QT.Q8_0), raw_dtype=QT.Q8_0)
    elif qtype == QT.Q1_0:
        writer.add_tensor(name, quantize_q1_0(w), raw_dtype=QT.Q1_0)
    else:
        raise ValueError(f"unsupported type {qtype}")


# ---------------------------------------------------------------- llama3 rope


def llama3_rope_freqs(head_dim: int, base: float, factor: float, low: float, high: float, orig_ctx: int) -> np.ndarray:
    """The `rope_freqs` factors llama.cpp's converter writes for llama3 RoPE scaling."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wavelen = orig_ctx / low
    high_wavelen = orig_ctx / high
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# ---------------------------------------------------------------- families


FAMILIES = {
    # name: (arch, vocab file, hyper-parameters)
    "llama3": dict(arch="llama", vocab="ggml-vocab-llama-bpe.gguf", n_embd=128, n_layer=3, n_head=4,
                   n_head_kv=2, head_dim=32, n_ff=384, rope_base=500000.0, eps=1e-5, qk_norm=False,
                   quant=QT.Q8_0, seed=3),
    "qwen3": dict(arch="qwen3", vocab="ggml-vocab-qwen2.gguf", n_embd=128, n_layer=3, n_head=4,
                  n_head_kv=2, head_dim=64, n_ff=384, rope_base=1000000.0, eps=1e-6, qk_norm=True,
                  quant=QT.Q8_0, seed=30),
    "bonsai": dict(arch="qwen3", vocab="ggml-vocab-qwen2.gguf", n_embd=128, n_layer=3, n_head=4,
                   n_head_kv=2, head_dim=64, n_ff=384, rope_base=1000000.0, eps=1e-6, qk_norm=True,
                   quant=QT.Q1_0, seed=100),
}


def write_model(path: Path, family: str, spec: dict, vocab_dir: Path, qtype) -> None:
    arch = spec["arch"]
    rng = np.random.default_rng(spec["seed"])
    n_embd, n_layer, n_ff = spec["n_embd"], spec["n_layer"], spec["n_ff"]
    n_head, n_head_kv, head_dim = spec["n_head"], spec["n_head_kv"], spec["head_dim"]

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"{family}-synthetic")
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(spec["rope_base"])
    writer.add_layer_norm_rms_eps(spec["eps"])
    writer.add_file_type({QT.F16: 1, QT.Q8_0: 7, QT.Q1_0: 40}.get(qtype, 0))
    n_vocab = copy_tokenizer(writer, vocab_dir / spec["vocab"])
    writer.add_vocab_size(n_vocab)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_weight(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    # Weights drawn in a fixed order, independent of the storage type, so the
    # f16 and quantized variants of one family hold the same model.
    # Tied output (no `output.weight`), as in Llama 3.2 1B and Qwen3 0.6B.
    store(writer, "token_embd.weight", normal((n_vocab, n_embd), 0.5), qtype)
    if family == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(head_dim, spec["rope_base"], 8.0, 1.0, 4.0, 8192))
    for il in range(n_layer):
        blk = f"blk.{il}"
        store(writer, f"{blk}.attn_norm.weight", norm_weight(n_embd), qtype)
        store(writer, f"{blk}.attn_q.weight", normal((n_head * head_dim, n_embd), 1 / math.sqrt(n_embd)), qtype)
        store(writer, f"{blk}.attn_k.weight", normal((n_head_kv * head_dim, n_embd), 1 / math.sqrt(n_embd)), qtype)
        store(writer, f"{blk}.attn_v.weight", normal((n_head_kv * head_dim, n_embd), 1 / math.sqrt(n_embd)), qtype)
        if spec["qk_norm"]:
            store(writer, f"{blk}.attn_q_norm.weight", norm_weight(head_dim), qtype)
            store(writer, f"{blk}.attn_k_norm.weight", norm_weight(head_dim), qtype)
        store(writer, f"{blk}.attn_output.weight",
              normal((n_embd, n_head * head_dim), 2.0 / math.sqrt(n_head * head_dim)), qtype)
        store(writer, f"{blk}.ffn_norm.weight", norm_weight(n_embd), qtype)
        store(writer, f"{blk}.ffn_gate.weight", normal((n_ff, n_embd), 1 / math.sqrt(n_embd)), qtype)
        store(writer, f"{blk}.ffn_up.weight", normal((n_ff, n_embd), 1 / math.sqrt(n_embd)), qtype)
        store(writer, f"{blk}.ffn_down.weight", normal((n_embd, n_ff), 2.0 / math.sqrt(n_ff)), qtype)
    store(writer, "output_norm.weight", norm_weight(n_embd), qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def variants():
    """(file name, family, storage type) of every synthetic file."""
    out = []
    for family, spec in FAMILIES.items():
        quant = spec["quant"]
        out.append((f"{family}-synth-f16.gguf", family, QT.F16))
        out.append((f"{family}-synth-{quant.name.lower()}.gguf", family, quant))
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
        write_model(tmp, family, FAMILIES[family], a.vocab, qtype)
        tmp.replace(path)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        print(f"{digest}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
