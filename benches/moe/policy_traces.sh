#!/usr/bin/env bash
# Routing traces of real text and the expert-cache policies replayed on them.
#
# SmolLM2-135M is upcycled into a Mixtral-style model of 32 identical experts,
# top-4, with a seeded random router (scripts/gen_upcycled_moe.py): it writes
# the dense model's text while its router makes real choices over the real
# hidden states of that text. Two texts (prose: the start of the GPL-3; code:
# benches/race/prompts/code_edit.txt), 256 greedy tokens each; then
# cache_policy.py replays each trace through lru, lfu and Belady's optimum at
# 5-75% of the experts, and one live run checks the runtime's own count
# against the replay.
#
# Usage: benches/moe/policy_traces.sh [OUT_DIR]   (needs scripts/setup-test-env.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(scripts/setup-test-env.sh)"
out=${1:-target/moe-policy}
mkdir -p "$out"
model="$out/smollm2-routed-32x4.gguf"
[ -f "$model" ] || "$FLATRUN_PYTHON" scripts/gen_upcycled_moe.py \
  "$FLATRUN_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" "$model" --experts 32 --used 4
cargo build --release -p flatrun-cli
head -c 3000 crates/flatrun-cli/tests/data/gpl-3.txt > "$out/prose.txt"
cp benches/race/prompts/code_edit.txt "$out/code.txt"
for text in prose code; do
  target/release/flatrun bench -m "$model" --prompt-file "$out/$text.txt" -n 256 -r 1 \
    --residency stream --expert-trace "$out/trace-$text.json" --json > "$out/bench-$text.json"
done
python3 benches/moe/cache_policy.py "$out/trace-prose.json" "$out/trace-code.json" \
  --json "$out/policies.json"
# Live: a cache of about a quarter of the experts, as the runtime counts it.
for policy in lfu lru; do
  target/release/flatrun bench -m "$model" --prompt-file "$out/code.txt" -n 256 -r 1 \
    --residency stream --expert-cache 404M --expert-policy "$policy" --json \
    > "$out/live-$policy.json"
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))[-1]; e=r["experts"]; print(sys.argv[2], r["test"], "hit rate %.1f%%" % (100*e["hit_rate"]), "%.1f tok/s" % r["median_tok_s"])' \
    "$out/live-$policy.json" "$policy"
done
