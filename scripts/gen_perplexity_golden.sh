#!/usr/bin/env bash
# llama-perplexity's figures on the committed text, for tests/perplexity.rs
# and docs/cli.md. Writes crates/flatrun-cli/tests/golden/perplexity/
# <model>.c<ctx>.n<chunks>.txt: the command, the per-chunk line and the
# final estimate.
#
# The text is the GNU GPL v3 (tests/data/gpl-3.txt, as shipped by Debian's
# base-files in /usr/share/common-licenses/GPL-3), which no test tunes to.
#
# Usage: LLAMA_BIN=/path/to/llama.cpp/build/bin scripts/gen_perplexity_golden.sh
# (a development tool: llama.cpp is not in CI; the figures are committed).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${LLAMA_BIN:?set LLAMA_BIN to the build/bin of llama.cpp}"
MODELS="${FLATRUN_MODELS:-$HOME/.cache/flatrun/models}"
TEXT="$ROOT/crates/flatrun-cli/tests/data/gpl-3.txt"
OUT="$ROOT/crates/flatrun-cli/tests/golden/perplexity"
mkdir -p "$OUT"

# model, ctx, chunks
RUNS=(
  "SmolLM2-135M-Instruct.Q4_1.gguf 128 4"
  "SmolLM2-135M-Instruct.Q4_1.gguf 512 14"
  "gemma-3-270m-q4_k_m.gguf 512 6"
  "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 512 6"
)
for run in "${RUNS[@]}"; do
  read -r model ctx chunks <<<"$run"
  out="$OUT/${model%.gguf}.c$ctx.n$chunks.txt"
  cmd=(llama-perplexity -m "$model" -f tests/data/gpl-3.txt -c "$ctx" --chunks "$chunks" -t 2)
  log="$("$BIN/llama-perplexity" -m "$MODELS/$model" -f "$TEXT" -c "$ctx" --chunks "$chunks" -t 2 2>&1)"
  {
    echo "# ${cmd[*]}"
    grep -E '^\[1\]' <<<"$log"
    grep -oE 'Final estimate: PPL = [0-9.]+ \+/- [0-9.]+' <<<"$log"
  } >"$out"
  cat "$out"
done
