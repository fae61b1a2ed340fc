#!/usr/bin/env bash
# llama-quantize's output for the synthetic llama3 F16 GGUF, per mix: one
# line per tensor (name, type, a position-weighted sum of its bytes mod 2^64, size), for
# crates/flatrun-cli/tests/quantize.rs. The input comes from
# scripts/gen_synthetic_models.py (deterministic; setup-test-env.sh makes it).
#
# Usage: LLAMA_BIN=/path/to/llama.cpp/build/bin scripts/gen_quantize_golden.sh
# (a development tool: llama.cpp is not in CI; the lines are committed).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${LLAMA_BIN:?set LLAMA_BIN to the build/bin of llama.cpp}"
PY="${FLATRUN_PYTHON:-$HOME/.cache/flatrun/venv/bin/python}"
SYN="${FLATRUN_SYNTHETIC:-$HOME/.cache/flatrun/synthetic}"
OUT="$ROOT/crates/flatrun-cli/tests/golden/quantize/llama3-synth-f16.txt"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
{
  echo "# llama-quantize llama3-synth-f16.gguf OUT MIX 2  (MIX NAME TYPE CHECKSUM BYTES)"
  for mix in Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K IQ4_NL Q1_0; do
    if "$BIN/llama-quantize" "$SYN/llama3-synth-f16.gguf" "$WORK/q.gguf" "$mix" 2 >/dev/null 2>&1; then
      "$PY" - "$WORK/q.gguf" "$mix" <<'PY'
import sys
import numpy as np
from gguf import GGUFReader
path, mix = sys.argv[1], sys.argv[2]
for t in GGUFReader(path).tensors:
    b = np.asarray(t.data).view(np.uint8).ravel().astype(np.uint64)
    # Position-weighted byte sum, wrapping at 2^64.
    with np.errstate(over="ignore"):
        h = int(np.sum(b * (np.arange(b.size, dtype=np.uint64) * np.uint64(0x9E3779B1) + np.uint64(1)), dtype=np.uint64))
    print(mix, t.name, t.tensor_type.name, f"{h:016x}", b.size)
PY
    else
      echo "$mix - unsupported -"
    fi
  done
} >"$OUT"
wc -l "$OUT"
