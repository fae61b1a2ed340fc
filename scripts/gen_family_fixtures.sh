#!/usr/bin/env bash
# Reference fixtures for the synthetic model families (tests/families.rs).
#
# Regenerates the synthetic GGUFs (scripts/gen_synthetic_models.py), runs the
# reference llama.cpp CLI `oracle logits FILE --prompt P --top 10` on each file
# and prompt, and writes one compact JSON per file to
# crates/flatrun-runtime/tests/fixtures/families/<file>.logits.json:
#   { "file", "sha256", "generator", "command", "teacher_forced": [
#       { "prompt", "tokens", "top_ids": [[10 ids] per position], "top_logits": [[10 values]...] } ] }
# plus manifest.json (file -> sha256) that the test checks the regenerated files against.
#
# Usage: ORACLE=/path/to/oracle scripts/gen_family_fixtures.sh
# (a development tool: the oracle is not available in CI; the fixtures are committed).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${FLATRUN_PYTHON:-$HOME/.cache/flatrun/venv/bin/python}"
ORACLE="${ORACLE:?set ORACLE to the reference oracle CLI}"
SYN="${FLATRUN_SYNTHETIC:-$HOME/.cache/flatrun/synthetic}"
OUT="$ROOT/crates/flatrun-runtime/tests/fixtures/families"
mkdir -p "$OUT"

if [ "${SKIP_GENERATE:-0}" != 1 ]; then
  "$PY" "$ROOT/scripts/gen_synthetic_models.py" --out "$SYN"
fi

PROMPTS=(
  "The quick brown fox jumps over the lazy dog. Meanwhile, in a distant galaxy, astronomers measured the rotation curve of 42 spiral arms and found it flat."
  "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(10)])"
  "Bonjour! 你好，世界。 Привет, мир! 1234567890 + 9876543210 = ? The answer: 11111111100 — verified."
)

for f in llama3-synth-f16 llama3-synth-q8_0 qwen3-synth-f16 qwen3-synth-q8_0 bonsai-synth-f16 bonsai-synth-q1_0; do
  model="$SYN/$f.gguf"
  tmp="$(mktemp -d)"
  for i in "${!PROMPTS[@]}"; do
    printf '%b' "${PROMPTS[$i]}" > "$tmp/prompt$i.txt"
    "$ORACLE" logits "$model" --prompt "$(cat "$tmp/prompt$i.txt")" --top 10 > "$tmp/out$i.json" 2>/dev/null
  done
  "$PY" - "$model" "$OUT/$f.logits.json" "$tmp" "${#PROMPTS[@]}" <<'PYEOF'
import hashlib, json, sys
model, out, tmp, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
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
name = model.rsplit("/", 1)[-1]
doc = {
    "file": name,
    "sha256": hashlib.sha256(open(model, "rb").read()).hexdigest(),
    "generator": "scripts/gen_synthetic_models.py",
    "command": "scripts/gen_family_fixtures.sh: oracle logits " + name + " --prompt <prompt> --top 10 (llama-cpp-python 0.3.36 vendored llama.cpp)",
    "teacher_forced": cases,
}
with open(out, "w") as fh:
    json.dump(doc, fh, separators=(",", ":"))
    fh.write("\n")
print(out, sum(len(c["tokens"]) for c in cases), "positions")
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
