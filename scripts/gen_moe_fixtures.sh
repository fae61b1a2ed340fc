#!/usr/bin/env bash
# Reference fixtures for the synthetic mixture-of-experts checkpoints
# (crates/flatrun-runtime/tests/moe.rs): the checkpoints of
# scripts/gen_synthetic_moe.py, run through the reference llama.cpp exactly as
# scripts/gen_qwen35_fixtures.sh describes (teacher-forced top-10 logits of
# three prompts, a 24-token greedy continuation with its top-2 per step),
# into crates/flatrun-runtime/tests/fixtures/moe/.
#
# Usage: ORACLE=/path/to/oracle scripts/gen_moe_fixtures.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
files=""
for family in qwen3moe mixtral olmoe qwen2moe qwen35moe; do
  files+="$family-synth-f16 $family-synth-q8_0 "
done
FIXTURE_SCRIPT=gen_moe_fixtures.sh GENERATOR=gen_synthetic_moe.py FIXTURES=moe FILES="$files" exec "$here/gen_qwen35_fixtures.sh"
