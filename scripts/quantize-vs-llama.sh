#!/usr/bin/env bash
# `flatrun quantize` against `llama-quantize`, every type, on one F16 GGUF:
# both quantize it, then scripts/compare_gguf_tensors.py compares each
# tensor's type and bytes. Prints one summary line per type.
#
# Usage: LLAMA_BIN=/path/to/llama.cpp/build/bin scripts/quantize-vs-llama.sh MODEL-F16.gguf [TYPE...]
# (make the F16 input with `llama-quantize --allow-requantize MODEL.gguf MODEL-F16.gguf F16`).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${LLAMA_BIN:?set LLAMA_BIN to the build/bin of llama.cpp}"
PY="${FLATRUN_PYTHON:-$HOME/.cache/flatrun/venv/bin/python}"
FLATRUN="${FLATRUN:-$ROOT/target/release/flatrun}"
IN="$1"
shift
TYPES=("$@")
if [ ${#TYPES[@]} -eq 0 ]; then
  TYPES=(Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K IQ4_NL Q1_0)
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
for t in "${TYPES[@]}"; do
  "$BIN/llama-quantize" "$IN" "$WORK/ll.gguf" "$t" 2 >"$WORK/ll.log" 2>&1 || { echo "$t: llama-quantize failed"; tail -3 "$WORK/ll.log"; continue; }
  "$FLATRUN" quantize --quiet --threads 2 "$IN" "$WORK/fr.gguf" "$t"
  printf '%-7s ' "$t"
  "$PY" "$ROOT/scripts/compare_gguf_tensors.py" "$WORK/ll.gguf" "$WORK/fr.gguf" | tail -12 | paste -sd ' ' || true
  rm -f "$WORK/ll.gguf" "$WORK/fr.gguf"
done
