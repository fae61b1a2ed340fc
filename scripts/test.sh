#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs the test tools and
# models (idempotent), then runs every crate's tests in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-test-env.sh)"
export FLATRUN_REQUIRE_MODELS=1
# The aarch64 kernels (NEON, sdot; flatrun-kernels has no C dependency, so no
# cross compiler is needed) must at least compile: checked when the
# target's standard library is installed (`rustup target add aarch64-unknown-linux-gnu`);
# scripts/test-aarch64.sh runs their tests under qemu.
installed_targets=$(rustup target list --installed 2>/dev/null || true)
if grep -qx aarch64-unknown-linux-gnu <<<"$installed_targets"; then
  cargo check --target aarch64-unknown-linux-gnu -p flatrun-kernels --all-targets
else
  echo "test.sh: aarch64 target not installed, skipping its cargo check" >&2
fi
# The workspace also builds for Apple Silicon: checked where the target's
# standard library is installed (`rustup target add aarch64-apple-darwin`),
# clippy included. The one C dependency, ring (TLS of the hub client behind
# flatrun-cli's `hub` feature), needs the macOS SDK to build, so flatrun-cli
# is checked there without that feature.
if grep -qx aarch64-apple-darwin <<<"$installed_targets"; then
  cargo clippy --workspace --exclude flatrun-cli --all-targets --target aarch64-apple-darwin -- -D warnings
  cargo clippy -p flatrun-cli --no-default-features --all-targets --target aarch64-apple-darwin -- -D warnings
else
  echo "test.sh: aarch64-apple-darwin target not installed, skipping its check" >&2
fi
# Lints: the workspace's own table (unsafe hygiene) and clippy's defaults.
if cargo clippy --version >/dev/null 2>&1; then
  cargo clippy --workspace --all-targets -- -D warnings
else
  echo "test.sh: clippy not installed, skipping the lint check" >&2
fi
# Formatting as rustfmt leaves it (code inside macros is the author's); rustfmt
# comes with the toolchain (rust-toolchain.toml lists it).
if cargo fmt --version >/dev/null 2>&1; then
  cargo fmt --all --check
else
  echo "test.sh: rustfmt not installed, skipping the format check" >&2
fi
# The API docs build without a warning (broken or private intra-doc links).
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
cargo test --release --workspace "$@"
