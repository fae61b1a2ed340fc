#!/usr/bin/env bash
# The long server soak: `flatrun serve` on MODEL (default SmolLM2 from
# $FLATRUN_MODELS) on a free loopback port, then scripts/soak.py with 16
# clients x 200 requests each for at most SECONDS (default 1800), 10% of the
# requests disconnecting mid-stream and 5% malformed or oversized. Prints the
# JSON summary (also written to soak-result.json) and exits 1 on any failure.
#
#   scripts/soak.sh [SECONDS] [MODEL] [-- extra flatrun serve flags]
set -euo pipefail

seconds="${1:-1800}"
model="${2:-${FLATRUN_MODELS:-$HOME/.cache/flatrun/models}/SmolLM2-135M-Instruct.Q4_1.gguf}"
shift $(( $# > 2 ? 2 : $# )) || true
[ "${1:-}" = "--" ] && shift
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${FLATRUN_PYTHON:-python3}"

cargo build --release -p flatrun-cli >&2
key="soak-$RANDOM$RANDOM"
log="$(mktemp)"
"$root/target/release/flatrun" serve --model "$model" --port 0 --ctx 1024 -q \
    --max-seqs 16 --max-queue 64 --max-body 256K --api-key "$key" "$@" 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 600); do
    address=$(grep -o 'http://[0-9.:]*' "$log" | head -n 1 || true)
    if [ -n "$address" ] && curl -fs "$address/health" >/dev/null 2>&1; then
        break
    fi
    sleep 0.2
done
[ -n "$address" ] || { cat "$log" >&2; exit 1; }
nice -n 5 "$python" "$root/scripts/soak.py" --url "$address" --pid "$pid" --api-key "$key" \
    --max-body 262144 --clients 16 --requests 200 --duration "$seconds" \
    --json-out soak-result.json
