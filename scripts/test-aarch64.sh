#!/usr/bin/env bash
# The aarch64 kernels under user-mode qemu: cross-builds the tests of
# flatrun-kernels and flatrun-dequant for aarch64-unknown-linux-gnu and runs
# them on two emulated CPUs, each with FLATRUN_SIMD forcing every level it has:
#
#   qemu -cpu max         NEON + dotprod: levels scalar, neon, neondot
#   qemu -cpu cortex-a72  NEON, no dotprod: levels scalar, neon
#
# (The parity tests, tests/parity.rs and tests/mlx_affine.rs, also walk every
# level the emulated CPU reports, so each run checks the NEON and dotprod
# kernels, GGML and MLX, against the reference whatever FLATRUN_SIMD says;
# the variable caps what `simd_level()` picks, which the rest of the tests use.) Installs the cross linker and qemu when missing
# (Debian/Ubuntu, apt-get). Timing under qemu means nothing; this is a
# correctness run. Extra arguments go to every `cargo test` (e.g. `-- --nocapture`).
#
#   ./scripts/test-aarch64.sh                   # everything (~1.5 min once built)
#   AARCH64_CPUS=max ./scripts/test-aarch64.sh  # one CPU model only
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=aarch64-unknown-linux-gnu
SYSROOT=/usr/aarch64-linux-gnu

# 1. Tools: the cross linker + libc, qemu-user, the Rust target.
need=()
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu)
[ -e "$SYSROOT/lib/libc.so.6" ] || need+=(libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
if [ ${#need[@]} -gt 0 ]; then
    echo "installing ${need[*]}" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
rustup target list --installed 2>/dev/null | grep -qx "$TARGET" || rustup target add "$TARGET"

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
# Missing models skip (the kernels' real-model test reads 48 rows per tensor type).
unset FLATRUN_REQUIRE_MODELS

# 2. Build the test binaries once (no qemu needed for that).
cargo test --target "$TARGET" -p flatrun-kernels -p flatrun-dequant --no-run "$@"

# 3. Run them on each CPU model, at each SIMD level that CPU has; keep going
#    after a failure and list every failing run at the end.
failed=()
run() {
    local what=$1
    shift
    echo "=== $what ===" >&2
    "$@" || failed+=("$what")
}
for cpu in ${AARCH64_CPUS:-max cortex-a72}; do
    case "$cpu" in
        max | cortex-a76 | neoverse-n1) levels="scalar neon neondot" ;;
        *) levels="scalar neon" ;;
    esac
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L $SYSROOT -cpu $cpu"
    # flatrun-dequant has no architecture-specific code and its real-model test
    # checksums whole tensors (~1 GB of weights, far too slow emulated): it runs
    # here on its synthetic and golden blocks only; the host run covers the models.
    run "qemu -cpu $cpu: flatrun-dequant" env FLATRUN_MODELS=/nonexistent FLATRUN_REQUANT=/nonexistent \
        cargo test --target "$TARGET" -p flatrun-dequant --no-fail-fast "$@"
    for level in $levels; do
        # FLATRUN_EXPECT_SIMD: tests/expected_level.rs fails if the level in use is
        # another one (say, qemu stopped reporting dotprod), rather than testing less.
        run "qemu -cpu $cpu: flatrun-kernels, FLATRUN_SIMD=$level" \
            env FLATRUN_SIMD=$level FLATRUN_EXPECT_SIMD=$level \
            cargo test --target "$TARGET" -p flatrun-kernels --no-fail-fast "$@"
    done
done
if [ ${#failed[@]} -gt 0 ]; then
    printf 'aarch64 FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "aarch64 tests passed on: ${AARCH64_CPUS:-max cortex-a72}" >&2
