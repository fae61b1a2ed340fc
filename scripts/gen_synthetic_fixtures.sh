#!/usr/bin/env bash
# Reference fixtures for the synthetic checkpoints of a family
# (qwen35: tests/qwen35.rs; gptoss: tests/gptoss.rs, both in flatrun-runtime).
#
# Regenerates the family's synthetic GGUFs (scripts/gen_synthetic_<family>.py),
# then with the reference llama.cpp CLI:
#   * `oracle logits FILE --prompt P --top 10` for each prompt: teacher-forced
#     top-10 logits at every position;
#   * `oracle generate FILE --prompt P --n 24`: a greedy continuation, and
#     `oracle logits FILE --tokens <prompt + continuation> --top 2`: the
#     reference's top-2 at each greedy step (to tell a near-tie from an error).
# and writes one compact JSON per file to
# crates/flatrun-runtime/tests/fixtures/<family>/<file>.logits.json:
#   { "file", "sha256", "generator", "command",
#     "teacher_forced": [ { "prompt", "tokens", "top_ids": [[10 ids]...], "top_logits": [[10]...] } ],
#     "greedy": { "prompt", "prompt_tokens", "tokens", "top2_ids": [[2 ids] per step], "top2_logits": [[2]...] } }
# plus manifest.json (file -> sha256) that the test checks the regenerated files against.
#
# Usage: ORACLE=/path/to/oracle scripts/gen_synthetic_fixtures.sh qwen35|gptoss|moe
# (a development tool: the oracle is not available in CI; the fixtures are committed).
# `moe` is every family of scripts/gen_synthetic_moe.py, into tests/fixtures/moe.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${FLATRUN_PYTHON:-$HOME/.cache/flatrun/venv/bin/python}"
ORACLE="${ORACLE:?set ORACLE to the reference oracle CLI}"
SYN="${FLATRUN_SYNTHETIC:-$HOME/.cache/flatrun/synthetic}"
FAMILY="${1:?usage: gen_synthetic_fixtures.sh qwen35|gptoss|moe}"
case "$FAMILY" in
  qwen35) FILES=(qwen35-synth-f16 qwen35-synth-q8_0) ;;
  gptoss) FILES=(gptoss-synth-mxfp4) ;;
  moe)
    FILES=()
    for family in qwen3moe mixtral olmoe qwen2moe qwen35moe; do
      FILES+=("$family-synth-f16" "$family-synth-q8_0")
    done
    ;;
  *) echo "unknown family $FAMILY (qwen35, gptoss, moe)" >&2; exit 2 ;;
esac
GENERATOR="scripts/gen_synthetic_$FAMILY.py"
OUT="$ROOT/crates/flatrun-runtime/tests/fixtures/$FAMILY"
mkdir -p "$OUT"

if [ "${SKIP_GENERATE:-0}" != 1 ]; then
  "$PY" "$ROOT/$GENERATOR" --out "$SYN"
fi

PROMPTS=(
  "The quick brown fox jumps over the lazy dog. Meanwhile, in a distant galaxy, astronomers measured the rotation curve of 42 spiral arms and found it flat."
  "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(10)])"
  "Bonjour! 你好，世界。 Привет, мир! 1234567890 + 9876543210 = ? The answer: 11111111100 — verified."
)
GREEDY_PROMPT="Once upon a time, in a small village by the sea, there lived"
GREEDY_N=24

for f in "${FILES[@]}"; do
  model="$SYN/$f.gguf"
  tmp="$(mktemp -d)"
  for i in "${!PROMPTS[@]}"; do
    printf '%b' "${PROMPTS[$i]}" > "$tmp/prompt$i.txt"
    "$ORACLE" logits "$model" --prompt "$(cat "$tmp/prompt$i.txt")" --top 10 > "$tmp/out$i.json" 2>/dev/null
  done
  printf '%s' "$GREEDY_PROMPT" > "$tmp/greedy_prompt.txt"
  "$ORACLE" generate "$model" --prompt "$GREEDY_PROMPT" --n "$GREEDY_N" > "$tmp/greedy.json" 2>/dev/null
  all_ids="$("$PY" -c 'import json,sys; g=json.load(open(sys.argv[1])); print(",".join(map(str, g["prompt_tokens"] + g["tokens"])))' "$tmp/greedy.json")"
  "$ORACLE" logits "$model" --tokens "$all_ids" --top 2 > "$tmp/greedy_top2.json" 2>/dev/null
  "$PY" - "$model" "$OUT/$f.logits.json" "$tmp" "${#PROMPTS[@]}" "$GREEDY_N" "$GENERATOR" "$FAMILY" <<'PYEOF'
import hashlib, json, sys
model, out, tmp, n, greedy_n, generator = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
cases = []
for i in range(n):
    prompt = open(f"{tmp}/prompt{i}.txt").read()
    r = json.load(open(f"{tmp}/out{i}.json"))
    cases.append({
        "prompt": prompt,
        "tokens": r["tokens"],
        "top_ids": [[t[0] for t in pos] for pos in r["top"]],
        "top_logits": [[round(t[1], 5) for t in pos] for pos in r["top"]],
    })
g = json.load(open(f"{tmp}/greedy.json"))
top2 = json.load(open(f"{tmp}/greedy_top2.json"))["top"]
steps = top2[len(g["prompt_tokens"]) - 1: len(g["prompt_tokens"]) - 1 + len(g["tokens"])]
name = model.rsplit("/", 1)[-1]
doc = {
    "file": name,
    "sha256": hashlib.sha256(open(model, "rb").read()).hexdigest(),
    "generator": generator,
    "command": "scripts/gen_synthetic_fixtures.sh " + sys.argv[7] + ": oracle logits " + name + " --prompt <prompt> --top 10; oracle generate "
               + name + f" --prompt <greedy prompt> --n {greedy_n} (llama-cpp-python 0.3.36 vendored llama.cpp)",
    "teacher_forced": cases,
    "greedy": {"prompt": open(f"{tmp}/greedy_prompt.txt").read(), "prompt_tokens": g["prompt_tokens"], "tokens": g["tokens"],
               "top2_ids": [[t[0] for t in s] for s in steps],
               "top2_logits": [[round(t[1], 5) for t in s] for s in steps]},
}
with open(out, "w") as fh:
    json.dump(doc, fh, separators=(",", ":"))
    fh.write("\n")
print(out, sum(len(c["tokens"]) for c in cases), "positions,", len(g["tokens"]), "greedy tokens")
PYEOF
  rm -rf "$tmp"
done

"$PY" - "$OUT" <<'PYEOF'
import glob, json, os, sys
out = sys.argv[1]
manifest = {}
for p in sorted(glob.glob(f"{out}/*.logits.json")):
    d = json.load(open(p))
    manifest[d["file"]] = d["sha256"]
json.dump(manifest, open(f"{out}/manifest.json", "w"), indent=1, sort_keys=True)
open(f"{out}/manifest.json", "a").write("\n")
PYEOF
