#!/usr/bin/env bash
# MLX speed: Flatrun's native MLX kernels (the format's numerics, f32
# activations, and ggml's behind --mlx-activations q8) beside Flatrun's own
# GGUF of the same bits, and beside mlx-lm's own CPU speed, on the same model.
#
#   benches/mlx/speed.sh [MODEL]      # MODEL: smollm2-135m (default) or qwen2.5-0.5b
#
# Needs scripts/setup-test-env.sh (the mlx-lm directories and the venv).
# Environment: P (prompt tokens, 128), N (generated, 64), R (repetitions, 3),
# THREADS (default: physical cores). Prints a markdown table per engine:
# prefill (pp) and decode (tg) tokens/s, median, min, max over R runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(scripts/setup-test-env.sh 2>/dev/null)"
model=${1:-smollm2-135m}
P=${P:-128} N=${N:-64} R=${R:-3}
threads=${THREADS:+--threads $THREADS}
lm=$FLATRUN_MLX_CKPT/lm
out=${TMPDIR:-/tmp}/flatrun-mlx-bench
mkdir -p "$out"
cargo build --release -q -p flatrun-cli
flatrun=target/release/flatrun

case $model in
  smollm2-135m) src=$FLATRUN_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf ;;
  qwen2.5-0.5b) src=$FLATRUN_MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf ;;
  *) echo "unknown model $model" >&2; exit 2 ;;
esac
# Flatrun's own GGUFs of the same bits (requantized from the real file).
for t in Q4_0 Q8_0; do
  [ -f "$out/$model-$t.gguf" ] ||
    $flatrun quantize --allow-requantize -q "$src" "$out/$model-$t.gguf" "$t"
done

bench() {  # label, model path, extra flags
  local label=$1 path=$2; shift 2
  nice -n 10 $flatrun bench -m "$path" -p "$P" -n "$N" -r "$R" --residency resident $threads "$@" |
    sed -n "s/^| [^|]* | [^|]* |/| $label |/p" | grep -E "pp|tg"
}
echo "| engine | test | tok/s (median) | min | max | peak RSS |"
echo "|---|---|---:|---:|---:|---:|"
bench "flatrun MLX 4-bit g64 (f32 activations)" "$lm/$model-q4g64"
bench "flatrun MLX 4-bit g64 (--mlx-activations q8)" "$lm/$model-q4g64" --mlx-activations q8
bench "flatrun MLX 8-bit g32 (f32 activations)" "$lm/$model-q8g32"
bench "flatrun MLX 8-bit g32 (--mlx-activations q8)" "$lm/$model-q8g32" --mlx-activations q8
bench "flatrun MLX 3-bit g64" "$lm/$model-q3g64"
bench "flatrun GGUF Q4_0" "$out/$model-Q4_0.gguf"
bench "flatrun GGUF $(basename "$src" .gguf | sed 's/.*[.-]//')" "$src"
bench "flatrun GGUF Q8_0" "$out/$model-Q8_0.gguf"
for d in q4g64 q8g32; do
  nice -n 10 "$FLATRUN_PYTHON" benches/mlx/mlx_lm_speed.py "$lm/$model-$d" -p "$P" -n "$N" -r "$R" \
    --label "mlx-lm $d (as loaded)"
done
