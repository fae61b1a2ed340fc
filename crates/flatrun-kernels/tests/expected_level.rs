//! Guards against testing less than intended: when a test run says which SIMD
//! level it expects (`FLATRUN_EXPECT_SIMD`, set by `scripts/test-aarch64.sh`
//! next to `FLATRUN_SIMD`), the level actually picked must be that one. Without
//! it, a CPU model (or an emulator) that stopped reporting a feature would
//! silently run the parity tests at fewer levels and still pass.

use flatrun_kernels::{NativeKernels, SimdLevel, simd_level, supported_levels};

#[test]
fn the_expected_level_is_the_one_in_use() {
    let Some(want) = std::env::var("FLATRUN_EXPECT_SIMD")
        .ok()
        .filter(|s| !s.is_empty())
    else {
        println!("FLATRUN_EXPECT_SIMD not set: nothing to check");
        return;
    };
    let want: SimdLevel = want
        .parse()
        .expect("FLATRUN_EXPECT_SIMD names a SIMD level");
    assert!(
        supported_levels().contains(&want),
        "expected level {want} is not supported here (supported: {:?})",
        supported_levels()
    );
    assert_eq!(
        simd_level(),
        want,
        "FLATRUN_SIMD / detection picked another level"
    );
    assert_eq!(NativeKernels::new(want).level(), want);
}

#[cfg(target_arch = "aarch64")]
#[test]
fn every_aarch64_cpu_has_neon() {
    // NEON is part of the aarch64 baseline: the NEON kernels must always be tested.
    assert!(supported_levels().contains(&SimdLevel::Neon));
}
