#!/usr/bin/env bash
# The memory-pressure ladder: `flatrun run --residency cap=SIZE` inside its
# own memory cgroup (limit = SIZE + HEADROOM), for each model and each cap
# from the smallest feasible to half the file. Prints one line per run:
# cap, cgroup limit, exit status, OOM kills, peak cgroup usage, peak RSS,
# decode tokens/s; exits 1 if a run failed or was OOM-killed.
#
#   scripts/memory-ladder.sh [MODEL...]      (default: the real models)
#
# Needs a writable memory cgroup (v1 `memory.limit_in_bytes`, or v2
# `memory.max`) under this process's own group. Page cache is charged to
# the group, so a cap below the file behaves like a host with that much RAM.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
models_dir="${FLATRUN_MODELS:-$HOME/.cache/flatrun/models}"
headroom=$((${HEADROOM_MIB:-256} << 20))
tokens="${TOKENS:-32}"
if [ "$#" -eq 0 ]; then
    set -- "$models_dir"/SmolLM2-135M-Instruct.Q4_1.gguf "$models_dir"/gemma-3-270m-q4_k_m.gguf \
        "$models_dir"/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf "$models_dir"/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
fi
flatrun="$root/target/release/flatrun"
[ -x "$flatrun" ] || cargo build --release -p flatrun-cli >&2

if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    v=2; base="/sys/fs/cgroup$(awk -F: '$1=="0"{print $3}' /proc/self/cgroup)"
else
    v=1; base="/sys/fs/cgroup/memory$(awk -F: '$2=="memory"{print $3}' /proc/self/cgroup)"
fi

# One run in a fresh group: prints "status oom peak_bytes json".
run_capped() {
    local model="$1" cap="$2" limit="$3" group="$base/flatrun-ladder-$$"
    mkdir "$group"
    if [ "$v" = 1 ]; then
        echo "$limit" >"$group/memory.limit_in_bytes"
    else
        echo "$limit" >"$group/memory.max"
        echo 0 >"$group/memory.swap.max" 2>/dev/null || true
    fi
    # Drop the file's cached pages first: a cold start, as after a reboot.
    "${FLATRUN_PYTHON:-python3}" -c "import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)" "$model"
    local status=0 out
    out=$(sh -c 'echo $$ >"$1/cgroup.procs"; shift; exec "$@"' sh "$group" \
        nice -n 10 "$flatrun" run --model "$model" --residency "cap=$cap" --json -q --chat \
        --prompt "Write a short story about a lighthouse." -n "$tokens" 2>/tmp/flatrun-ladder-err) || status=$?
    local oom peak
    if [ "$v" = 1 ]; then
        oom=$(awk '$1=="oom_kill"{print $2}' "$group/memory.oom_control")
        peak=$(cat "$group/memory.max_usage_in_bytes")
    else
        oom=$(awk '$1=="oom_kill"{print $2}' "$group/memory.events")
        peak=$(cat "$group/memory.peak" 2>/dev/null || echo 0)
    fi
    rmdir "$group"
    echo "$status ${oom:-0} $peak ${out:-{\}}"
}

# A private copy of each model: pages of a file that other processes have
# mapped stay charged to their groups and would not count against ours.
scratch="$(mktemp -d "${TMPDIR:-/tmp}/flatrun-ladder.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT

failed=0
printf '%-40s %8s %8s %6s %4s %9s %9s %8s\n' model cap limit exit oom peak_MiB rss_MiB tok/s
for model in "$@"; do
    [ -f "$model" ] || { echo "missing $model" >&2; failed=1; continue; }
    cp "$model" "$scratch/" && model="$scratch/$(basename "$model")"
    size=$(stat -c %s "$model")
    mib=$((size >> 20))
    # Smallest feasible: 1/16 of the file (or the plan's own floor, which the
    # run reports if it raises the cap), then 1/8, 1/4, 1/2.
    for div in 16 8 4 2; do
        cap=$(( (size / div) >> 20 ))M
        limit=$(( (size / div) + headroom ))
        read -r status oom peak json <<<"$(run_capped "$model" "$cap" "$limit")"
        rss=$(echo "$json" | "${FLATRUN_PYTHON:-python3}" -c "import json,sys; d=json.loads(sys.stdin.read() or '{}'); print(round(d.get('peak_rss_bytes',0)/2**20), round(d.get('decode_tok_s', 0) or 0, 2))" 2>/dev/null || echo "? ?")
        printf '%-40s %8s %8s %6s %4s %9s %9s %8s\n' "$(basename "$model")" "$cap" "$((limit >> 20))M" \
            "$status" "$oom" "$((peak >> 20))" $rss
        if [ "$status" != 0 ] || [ "$oom" != 0 ]; then
            failed=1
            sed 's/^/    /' /tmp/flatrun-ladder-err | tail -n 3
        fi
    done
    echo "  ($(basename "$model"): $mib MiB file)"
    rm -f "$model"
done
exit "$failed"
