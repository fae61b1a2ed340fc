#!/usr/bin/env python3
"""Golden fixtures for the flatrun-format tests, written with the `gguf` package.

    $FLATRUN_PYTHON scripts/gen_format_fixtures.py

1. For each real model in $FLATRUN_MODELS (default ~/.cache/flatrun/models),
   crates/flatrun-format/tests/fixtures/<model>.tensors.tsv lists every tensor
   as the `gguf` package reads it: name, GGML type name, row-major shape
   (comma-separated, slowest axis first), absolute data offset, byte size.
   A header line `# tensors=N alignment=A data_offset=D version=V` comes first.
2. crates/flatrun-format/tests/fixtures/synthetic.gguf: a small GGUF with
   every metadata value type (incl. nested arrays), a custom alignment and
   tensors of several types, written by gguf.GGUFWriter; its expected
   contents are in synthetic.expected.json.
"""
import json
import os
import sys
from pathlib import Path

import numpy as np
import gguf

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "crates" / "flatrun-format" / "tests" / "fixtures"
MODELS = Path(os.environ.get("FLATRUN_MODELS", Path.home() / ".cache/flatrun/models"))
REAL_MODELS = [
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
]


def tensor_listing(path: Path) -> str:
    reader = gguf.GGUFReader(str(path))
    align_field = reader.fields.get("general.alignment")
    alignment = int(align_field.parts[-1][0]) if align_field else 32
    version = int(reader.fields["GGUF.version"].parts[-1][0])
    lines = [
        f"# tensors={len(reader.tensors)} alignment={alignment} "
        f"data_offset={reader.data_offset} version={version}"
    ]
    for t in reader.tensors:
        # gguf stores ne[] fastest axis first; row-major is the reverse.
        shape = ",".join(str(int(d)) for d in reversed(list(t.shape)))
        lines.append(
            f"{t.name}\t{t.tensor_type.name}\t{shape}\t{int(t.data_offset)}\t{int(t.n_bytes)}"
        )
    return "\n".join(lines) + "\n"


def write_synthetic(path: Path) -> dict:
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_uint64("t.u64", 2**40 + 7)
    w.add_int64("t.i64", -(2**40))
    w.add_float32("t.f32", 1.5)
    w.add_float64("t.f64", -2.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.arr_str", ["a", "bc", ""])
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_f32", [0.5, 1.5])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_block_count(1)
    # Tensors: F32 [2,3] row-major, F16 [4], a Q8_0 row of 64 (raw bytes), I32 [5].
    f32 = np.arange(6, dtype=np.float32).reshape(2, 3)
    f16 = np.array([1.0, -2.0, 0.5, 4.0], dtype=np.float16)
    q8 = np.arange(2 * 34, dtype=np.uint8).reshape(1, 68)  # 2 blocks of 34 bytes = 64 values
    i32 = np.array([7, -8, 9, 10, 11], dtype=np.int32)
    w.add_tensor("token_embd.weight", f32)
    w.add_tensor("blk.0.attn_q.bias", f16)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("custom.thing", i32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {
        "tensors": [
            {"name": "embed", "original": "token_embd.weight", "type": "F32", "shape": [2, 3], "bytes": f32.tobytes().hex()},
            {"name": "layers.0.attn.q.bias", "original": "blk.0.attn_q.bias", "type": "F16", "shape": [4], "bytes": f16.tobytes().hex()},
            {"name": "layers.0.attn.q", "original": "blk.0.attn_q.weight", "type": "Q8_0", "shape": [1, 64], "bytes": q8.tobytes().hex()},
            {"name": "custom.thing", "original": "custom.thing", "type": "I32", "shape": [5], "bytes": i32.tobytes().hex()},
        ]
    }


def main() -> int:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in REAL_MODELS:
        path = MODELS / name
        if not path.exists():
            print(f"skip {name}: not in {MODELS}", file=sys.stderr)
            continue
        out = FIXTURES / (name.removesuffix(".gguf") + ".tensors.tsv")
        out.write_text(tensor_listing(path))
        print(f"wrote {out.relative_to(ROOT)}")
    synthetic = FIXTURES / "synthetic.gguf"
    expected = write_synthetic(synthetic)
    (FIXTURES / "synthetic.expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"wrote {synthetic.relative_to(ROOT)} ({synthetic.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
