#!/usr/bin/env bash
# llama.cpp's tools on a Hugging Face SafeTensors directory, for
# crates/flatrun-cli/tests/quantize_hf.rs: convert_hf_to_gguf.py --outtype f16
# (from the llama.cpp source tree), then llama-quantize Q4_K_M. Writes one line
# per tensor of the result (name, type, the position-weighted byte sum of
# scripts/gen_quantize_golden.sh, size) and, with FLATRUN set, the sha256 of
# the logits `flatrun run --dump-logits` gives on that file for a fixed prompt
# (the test compares its own conversion's logits with them), when the
# converter's tokenizer gives the prompt the ids the directory's own does.
#
# Usage: LLAMA_CPP=/path/to/llama.cpp [FLATRUN=target/release/flatrun] \
#   scripts/gen_hf_quantize_golden.sh VARIANT...   (e.g. smollm2-135m-f16)
# VARIANT is a directory under ${FLATRUN_HF_CKPT:-~/.cache/flatrun/hf-ckpt}
# (scripts/gen_hf_checkpoints.py). The converter needs a Python with torch,
# transformers, sentencepiece and llama.cpp's gguf-py (FLATRUN_CONVERT_PYTHON).
# QUANTIZE replaces llama-quantize (same arguments) when it is not built.
# A development tool: llama.cpp is not in CI; the files are committed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LLAMA="${LLAMA_CPP:?set LLAMA_CPP to a llama.cpp source tree with build/bin}"
PY="${FLATRUN_PYTHON:-$HOME/.cache/flatrun/venv/bin/python}"
CONVERT_PY="${FLATRUN_CONVERT_PYTHON:-$HOME/.cache/flatrun/convert-venv/bin/python}"
CKPT="${FLATRUN_HF_CKPT:-$HOME/.cache/flatrun/hf-ckpt}"
OUT_DIR="$ROOT/crates/flatrun-cli/tests/golden/quantize"
PROMPT="The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable metal type."
QUANTIZE="${QUANTIZE:-$LLAMA/build/bin/llama-quantize}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
for variant in "$@"; do
  "$CONVERT_PY" "$LLAMA/convert_hf_to_gguf.py" "$CKPT/$variant" --outtype f16 \
    --outfile "$WORK/f16.gguf" >"$WORK/convert.log" 2>&1 || { tail -5 "$WORK/convert.log"; exit 1; }
  $QUANTIZE "$WORK/f16.gguf" "$WORK/q.gguf" Q4_K_M 2 >"$WORK/quantize.log" 2>&1 \
    || { tail -5 "$WORK/quantize.log"; exit 1; }
  out="$OUT_DIR/$variant-Q4_K_M.txt"
  {
    echo "# convert_hf_to_gguf.py $variant --outtype f16; $(basename "${QUANTIZE%% *}") F16 OUT Q4_K_M 2  (NAME TYPE CHECKSUM BYTES)"
    "$PY" - "$WORK/q.gguf" <<'PY'
import sys
import numpy as np
from gguf import GGUFReader
for t in GGUFReader(sys.argv[1]).tensors:
    b = np.asarray(t.data).view(np.uint8).ravel().astype(np.uint64)
    with np.errstate(over="ignore"):
        h = int(np.sum(b * (np.arange(b.size, dtype=np.uint64) * np.uint64(0x9E3779B1) + np.uint64(1)), dtype=np.uint64))
    print(t.name, t.tensor_type.name, f"{h:016x}", b.size)
PY
    if [ -n "${FLATRUN:-}" ] && [ "$("$FLATRUN" tokenize --ids --model "$WORK/q.gguf" --text "$PROMPT")" \
      != "$("$FLATRUN" tokenize --ids --model "$CKPT/$variant" --text "$PROMPT")" ]; then
      echo "# logits not compared: the converter's tokenizer gives other ids than the directory's tokenizer.json"
    elif [ -n "${FLATRUN:-}" ]; then
      "$FLATRUN" run --quiet --model "$WORK/q.gguf" --prompt "$PROMPT" --max-new 0 \
        --threads 1 --dump-logits "$WORK/logits.npy" >/dev/null
      echo "logits-sha256 $(sha256sum "$WORK/logits.npy" | cut -d' ' -f1) prompt: $PROMPT"
    fi
  } >"$out"
  wc -l "$out"
done
