#!/usr/bin/env bash
# The main job from a fresh machine: fetch the default model, build in
# release, and run it on a prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(python3 scripts/fetch-models.py smollm2 | tail -1)
cargo build --release -p flatrun-cli
./target/release/flatrun inspect "$model"
