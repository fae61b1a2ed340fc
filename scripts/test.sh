#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs the test tools and
# models (idempotent), then runs every crate's tests in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-test-env.sh)"
export FLATRUN_REQUIRE_MODELS=1
cargo test --release --workspace "$@"
