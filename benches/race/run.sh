#!/usr/bin/env bash
# The race against llama.cpp, end to end on a fresh machine:
#   LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin benches/race/run.sh [race.py flags]
# Sets up the Python venv and the three real models (scripts/setup-test-env.sh),
# adds matplotlib for the chart, builds flatrun in release mode, writes the
# synthetic size ladder, then runs the race (resident + capped) and the
# stream-mode memory ladder. Results land in benches/race/results/.
# Needs a writable memory cgroup (v1 or v2) for the capped contest; pass
# `--skip capped` where there is none.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
: "${LLAMA_CPP_BIN:?set LLAMA_CPP_BIN to a llama.cpp build/bin directory containing llama-bench}"
eval "$("$here/scripts/setup-test-env.sh")"
"$FLATRUN_PYTHON" -m pip install -q --disable-pip-version-check "matplotlib==3.11.2" >&2 \
  || echo "race: matplotlib unavailable, the chart will be skipped" >&2
(cd "$here" && cargo build --release -p flatrun-cli >&2)
ladder=${FLATRUN_LADDER:-$HOME/.cache/flatrun/ladder}
"$FLATRUN_PYTHON" "$here/benches/race/gen_ladder.py" --out "$ladder" \
  --tokenizer-from "$FLATRUN_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" >&2
"$FLATRUN_PYTHON" "$here/benches/race/race.py" --models "$FLATRUN_MODELS" "$@"
"$FLATRUN_PYTHON" "$here/benches/race/ladder.py" --dir "$ladder"
