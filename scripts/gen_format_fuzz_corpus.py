#!/usr/bin/env python3
"""Seed corpora for the flatrun-format fuzz targets.

    python3 scripts/gen_format_fuzz_corpus.py

fuzz/corpus/gguf_header/real-<model>: the first 384 KiB of each real model in
$FLATRUN_MODELS (headers; not committed, see .gitignore).
fuzz/corpus/gguf_header/seed-synthetic: the committed synthetic GGUF fixture.
fuzz/corpus/safetensors_mlx/seed-*: small safetensors files (an MLX triple,
a plain F32/F16/BF16 file) with a leading selector byte; committed.
"""
import json
import os
import shutil
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
MODELS = Path(os.environ.get("FLATRUN_MODELS", Path.home() / ".cache/flatrun/models"))
HEADER_BYTES = 384 * 1024


def safetensors(tensors):
    header, data = {}, b""
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    text = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + data


def main():
    gguf_dir = CORPUS / "gguf_header"
    st_dir = CORPUS / "safetensors_mlx"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    st_dir.mkdir(parents=True, exist_ok=True)
    for model in sorted(MODELS.glob("*.gguf")):
        with open(model, "rb") as f:
            (gguf_dir / f"real-{model.stem}").write_bytes(f.read(HEADER_BYTES))
        print(f"wrote real-{model.stem}")
    shutil.copy(ROOT / "crates/flatrun-format/tests/fixtures/synthetic.gguf", gguf_dir / "seed-synthetic")
    mlx = safetensors([
        ("model.layers.0.self_attn.q_proj.weight", "U32", [2, 4], bytes(range(32))),
        ("model.layers.0.self_attn.q_proj.scales", "F16", [2, 1], b"\x00\x3c" * 2),
        ("model.layers.0.self_attn.q_proj.biases", "F16", [2, 1], b"\x00\xbc" * 2),
        ("model.norm.weight", "F16", [2], b"\x00\x3c" * 2),
    ])
    (st_dir / "seed-mlx-4bit").write_bytes(bytes([0x02]) + mlx)
    plain = safetensors([
        ("model.embed_tokens.weight", "F32", [2, 2], bytes(16)),
        ("model.layers.0.mlp.up_proj.weight", "BF16", [2], bytes(4)),
        ("lm_head.weight", "F16", [1, 2], bytes(4)),
    ])
    (st_dir / "seed-plain").write_bytes(bytes([0x00]) + plain)
    print("wrote seeds")


if __name__ == "__main__":
    main()
