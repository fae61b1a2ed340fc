//! Backend and SIMD-level selection.

use flatrun_kernels::{
    BackendKind, NativeKernels, SimdLevel, backend, clamp_to_host, supported_levels,
};

#[test]
fn names_parse() {
    assert_eq!(
        "reference".parse::<BackendKind>().unwrap(),
        BackendKind::Reference
    );
    assert_eq!(
        "native".parse::<BackendKind>().unwrap(),
        BackendKind::Native
    );
    assert!("fast".parse::<BackendKind>().is_err());
    for l in [
        SimdLevel::Scalar,
        SimdLevel::Avx2,
        SimdLevel::Avx512,
        SimdLevel::Avx512Vnni,
        SimdLevel::Neon,
        SimdLevel::NeonDot,
    ] {
        assert_eq!(l.name().parse::<SimdLevel>().unwrap(), l);
    }
    assert!("sse9".parse::<SimdLevel>().is_err());
    assert_eq!(backend(BackendKind::Reference).name(), "reference");
    assert_eq!(backend(BackendKind::Native).name(), "native");
}

#[test]
fn levels_are_clamped_to_the_host() {
    let levels = supported_levels();
    assert_eq!(levels[0], SimdLevel::Scalar);
    assert_eq!(clamp_to_host(SimdLevel::Scalar, &levels), SimdLevel::Scalar);
    // Asking for more than the host has gives the best it has below it.
    assert_eq!(
        clamp_to_host(SimdLevel::Avx512Vnni, &[SimdLevel::Scalar, SimdLevel::Avx2]),
        SimdLevel::Avx2
    );
    for &l in &levels {
        assert_eq!(NativeKernels::new(l).level(), l);
    }
    // FLATRUN_SIMD, when set for this process, caps the detected level.
    if let Some(cap) = std::env::var("FLATRUN_SIMD")
        .ok()
        .and_then(|s| s.parse::<SimdLevel>().ok())
    {
        assert!(flatrun_kernels::simd_level() <= cap);
    }
}
