#!/usr/bin/env bash
# Runs every cargo-fuzz target for SECONDS each (default 600), one after the
# other, at low priority, then minimizes each corpus in place and prints a
# summary line per target (executions, coverage, corpus size, crashes).
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Needs the nightly toolchain (sanitizers) and cargo-fuzz, which it installs
# from crates.io when missing. Logs go to fuzz/logs/TARGET.log; crashing
# inputs to fuzz/artifacts/TARGET/ (copy one to fuzz/regressions/TARGET/ with
# its fix: `cargo test --release -p flatrun-server --test fuzz_corpus`
# replays those and the corpus on stable Rust).
set -euo pipefail

seconds="${1:-600}"
shift || true
cd "$(dirname "$0")/../fuzz"

if ! rustup toolchain list | grep -q '^nightly'; then
    rustup toolchain install nightly --profile minimal
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi

targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
    mapfile -t targets < <(cargo +nightly fuzz list)
fi

nice -n 19 cargo +nightly fuzz build -O 2>&1 | tail -n 3 || {
    echo "fuzz build failed" >&2
    exit 1
}

mkdir -p logs
summary=()
for target in "${targets[@]}"; do
    mkdir -p "corpus/$target" "artifacts/$target"
    echo "== $target: ${seconds}s"
    status=0
    nice -n 19 cargo +nightly fuzz run -O "$target" "corpus/$target" -- \
        -max_total_time="$seconds" -timeout=20 -rss_limit_mb=3072 \
        -print_final_stats=1 >"logs/$target.log" 2>&1 || status=$?
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "logs/$target.log" | grep -o '[0-9]*$' | tail -n 1)
    cov=$(grep -oE '(#[0-9]+).*cov: [0-9]+ ft: [0-9]+' "logs/$target.log" | tail -n 1 | grep -oE 'cov: [0-9]+ ft: [0-9]+')
    crashes=$(find "artifacts/$target" -type f | wc -l)
    # Keep only the inputs that add coverage.
    nice -n 19 cargo +nightly fuzz cmin -O "$target" "corpus/$target" >"logs/$target.cmin.log" 2>&1 || true
    corpus=$(find "corpus/$target" -type f | wc -l)
    line="$target: exit $status, ${execs:-?} executions in ${seconds}s, ${cov:-cov ?}, corpus $corpus files, $crashes crash artifacts"
    echo "$line"
    summary+=("$line")
done
echo
printf '%s\n' "${summary[@]}" | tee logs/summary.txt
