#!/usr/bin/env bash
# Runs the official openai/anthropic SDK tests
# (crates/flatrun-server/tests/sdk/test_sdk.py) against a server that is
# already running, e.g. `flatrun serve --model SmolLM2-135M-Instruct.Q4_1.gguf`.
#
# Usage: scripts/server-sdk-test.sh BASE_URL MODEL [API_KEY]
#   extra settings by environment: FLATRUN_SDK_CONTEXT, FLATRUN_SDK_MAX_BODY,
#   FLATRUN_SDK_GREEDY_PROMPT / FLATRUN_SDK_GREEDY_EXPECTED (see the test file).
# (cargo test -p flatrun-server runs the same tests against the mock model.)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -lt 2 ]; then
  echo "usage: $0 BASE_URL MODEL [API_KEY]" >&2
  exit 2
fi
python=${FLATRUN_PYTHON:-$HOME/.cache/flatrun/venv/bin/python}
FLATRUN_BASE_URL=$1 FLATRUN_SDK_MODEL=$2 FLATRUN_SDK_API_KEY=${3:-} \
  exec "$python" "$here/crates/flatrun-server/tests/sdk/test_sdk.py" -v
