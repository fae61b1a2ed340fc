#!/usr/bin/env python3
"""Write synthetic random-weight Llama GGUFs of growing size (Q4_K).

The ladder shows that Flatrun's stream-mode peak memory stays flat as the
model grows: every model has the same architecture, only wider and deeper.
Weights are random Q4_K blocks (random 4-bit values and 6-bit scales, f16
super-block scales chosen so each weight has mean ~0 and std ~0.02), the
norms are ones, and the tokenizer is copied from a real GGUF (SmolLM2's by
default) so `flatrun` can tokenize a prompt. The text they generate is noise;
only their shapes and bytes matter.

Tensors are generated and written one at a time, so writing the 4B model
needs little RAM.

    python benches/race/gen_ladder.py --out ~/.cache/flatrun/ladder \
        --tokenizer-from ~/.cache/flatrun/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

# name: (n_embd, n_layer, n_ff, n_head, n_head_kv); params ~ the name.
LADDER = {
    "0.1b": (768, 12, 2048, 12, 4),
    "0.5b": (1024, 24, 4096, 16, 4),
    "1.5b": (2048, 28, 5632, 16, 4),
    "4b": (3072, 36, 8192, 24, 8),
}
QK_K = 256
Q4_K_BYTES = 144  # d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles


def random_q4_k(rng: np.random.Generator, rows: int, cols: int, std: float = 0.02) -> np.ndarray:
    """`rows × cols` random Q4_K weights as raw bytes, shape (rows, cols/256*144)."""
    assert cols % QK_K == 0
    nblocks = rows * cols // QK_K
    blocks = rng.integers(0, 256, size=(nblocks, Q4_K_BYTES), dtype=np.uint8)
    # w = d·sc·q − dmin·m with q ∈ [0,15], sc, m ∈ [0,63] uniform: mean d·31.5·7.5 − dmin·31.5,
    # std ≈ d·31.5·7.5·~0.8. Pick d for the std and dmin for zero mean.
    d = std / (31.5 * 7.5 * 0.8)
    dmin = d * 7.5
    blocks[:, 0:2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    blocks[:, 2:4] = np.frombuffer(np.float16(dmin).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, cols // QK_K * Q4_K_BYTES)


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copy `tokenizer.*` keys from `source`; returns the vocabulary size."""
    reader = gguf.GGUFReader(source)
    n_vocab = 0
    for name, f in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == gguf.GGUFValueType.STRING:
                items = [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
            else:
                items = [f.parts[i].tolist()[0] for i in f.data]
            writer.add_array(name, items)
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(items)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_string(name, bytes(f.parts[f.data[0]]).decode("utf-8"))
        else:
            val = f.parts[f.data[0]].tolist()[0]
            {
                gguf.GGUFValueType.UINT32: writer.add_uint32,
                gguf.GGUFValueType.INT32: writer.add_int32,
                gguf.GGUFValueType.BOOL: writer.add_bool,
                gguf.GGUFValueType.FLOAT32: writer.add_float32,
            }.get(vtype, writer.add_uint32)(name, val)
    return n_vocab


def write_model(path: Path, size: str, tokenizer_from: Path, seed: int) -> None:
    d, n_layer, n_ff, n_head, n_kv = LADDER[size]
    head_dim = d // n_head
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"flatrun-ladder-{size}")
    writer.add_context_length(4096)
    writer.add_embedding_length(d)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(15)  # MOSTLY_Q4_K_M, as llama.cpp labels such files
    n_vocab = copy_tokenizer(writer, tokenizer_from)

    # (name, rows, cols) in file order; rows = output features.
    plan: list[tuple[str, int, int, bool]] = [("token_embd.weight", n_vocab, d, True)]
    for i in range(n_layer):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", 1, d, False),
            (p + "attn_q.weight", d, d, True),
            (p + "attn_k.weight", n_kv * head_dim, d, True),
            (p + "attn_v.weight", n_kv * head_dim, d, True),
            (p + "attn_output.weight", d, d, True),
            (p + "ffn_norm.weight", 1, d, False),
            (p + "ffn_gate.weight", n_ff, d, True),
            (p + "ffn_up.weight", n_ff, d, True),
            (p + "ffn_down.weight", d, n_ff, True),
        ]
    plan += [("output_norm.weight", 1, d, False), ("output.weight", n_vocab, d, True)]

    for name, rows, cols, quant in plan:
        if quant:
            nbytes = rows * cols // QK_K * Q4_K_BYTES
            writer.add_tensor_info(name, (rows, cols // QK_K * Q4_K_BYTES), np.dtype(np.uint8), nbytes, raw_dtype=T.Q4_K)
        else:
            writer.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, rows, cols, quant in plan:
        data = random_q4_k(rng, rows, cols) if quant else np.ones(cols, dtype=np.float32)
        writer.write_tensor_data(data)
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/flatrun/ladder")
    ap.add_argument("--tokenizer-from", type=Path,
                    default=Path.home() / ".cache/flatrun/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--sizes", nargs="+", default=list(LADDER), choices=list(LADDER))
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for size in args.sizes:
        path = args.out / f"ladder-{size}-q4_k.gguf"
        if path.exists():
            print(f"{path} exists")
            continue
        tmp = path.with_suffix(".part")
        write_model(tmp, size, args.tokenizer_from, args.seed)
        tmp.rename(path)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
