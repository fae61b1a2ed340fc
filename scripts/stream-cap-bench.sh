#!/usr/bin/env bash
# Capped decode bench: run `flatrun bench --residency cap=…`
# and, when LLAMA_CPP_BIN is set, llama.cpp's `llama-bench` (mmap, no repack)
# inside the same memory cgroup, interleaved, with the model's page cache dropped
# before every run. Prints decode tokens/s, time to first token (flatrun) and the
# cgroup's peak memory.
#
#   scripts/stream-cap-bench.sh MODEL.gguf LIMIT FLATRUN_CAP [ROUNDS]
#   e.g. scripts/stream-cap-bench.sh ~/.cache/flatrun/models/gemma-3-270m-q4_k_m.gguf 130M 40M 2
#
# Environment: FLATRUN (default ./target/release/flatrun), LLAMA_CPP_BIN (directory
# with llama-bench; unset = flatrun only), N_GEN (32), THREADS (2), PYTHON (python3).
# Needs a writable cgroup-v1 memory controller (cgroup v2: memory.max) under this
# shell's own group.
set -euo pipefail
MODEL=$1
LIMIT=$2
CAP=$3
ROUNDS=${4:-1}
FLATRUN=${FLATRUN:-./target/release/flatrun}
N_GEN=${N_GEN:-32}
THREADS=${THREADS:-2}
PYTHON=${PYTHON:-python3}

to_bytes() { numfmt --from=iec "$1"; }

rel=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)
if [ -n "$rel" ]; then
    dir=/sys/fs/cgroup/memory${rel%/}/flatrun-capbench-$$
    mkdir "$dir"
    echo "$(to_bytes "$LIMIT")" > "$dir/memory.limit_in_bytes"
    peak_file=$dir/memory.max_usage_in_bytes
else
    rel=$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)
    dir=/sys/fs/cgroup${rel%/}/flatrun-capbench-$$
    mkdir "$dir"
    echo "$(to_bytes "$LIMIT")" > "$dir/memory.max"
    peak_file=$dir/memory.peak
fi
trap 'rmdir "$dir" 2>/dev/null || true' EXIT

drop_cache() {
    "$PYTHON" -c 'import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)' "$MODEL"
}

# Run a command as a member of the cgroup (joined before exec).
in_cgroup() {
    echo 0 > "$peak_file" 2>/dev/null || true
    sh -c 'echo $$ > "$0/cgroup.procs" && shift && exec "$@"' "$dir" _ "$@"
}

for round in $(seq 1 "$ROUNDS"); do
    drop_cache
    echo "== round $round: flatrun --residency cap=$CAP under a $LIMIT cgroup"
    in_cgroup "$FLATRUN" bench -m "$MODEL" --residency "cap=$CAP" -p 16 -n "$N_GEN" -r 1 \
        --ctx 512 --threads "$THREADS" --profile 2>&1 |
        grep -E "tg|pp|I/O|io_wait|first|peak|RSS|decode|prefill" || true
    echo "cgroup peak: $(( $(cat "$peak_file") / 1000000 )) MB"
    if [ -n "${LLAMA_CPP_BIN:-}" ]; then
        drop_cache
        echo "== round $round: llama-bench -lm mmap --repack 0 under a $LIMIT cgroup"
        in_cgroup "$LLAMA_CPP_BIN/llama-bench" -m "$MODEL" -p 0 -n "$N_GEN" -r 1 -t "$THREADS" \
            -lm mmap --repack 0 2>&1 | grep -E "tg|model" || true
        echo "cgroup peak: $(( $(cat "$peak_file") / 1000000 )) MB"
    fi
done
