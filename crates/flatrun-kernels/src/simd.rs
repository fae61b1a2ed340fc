//! Which SIMD instruction set the native kernels use, detected once at run time.

use std::str::FromStr;
use std::sync::OnceLock;

use crate::KernelError;

/// An instruction-set level, from plain scalar code up to the best the host has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable Rust, no intrinsics.
    Scalar,
    /// x86_64 AVX2 + FMA (+ F16C): `maddubs` integer dots.
    Avx2,
    /// x86_64 AVX-512 F/BW/VL (+ F16C) on 256-bit lanes, no VNNI.
    Avx512,
    /// AVX-512 with VNNI: `vpdpbusd` integer dots.
    Avx512Vnni,
    /// aarch64 NEON.
    Neon,
    /// aarch64 NEON with the dot-product extension (`sdot`).
    NeonDot,
}

impl SimdLevel {
    /// Name as accepted by `FLATRUN_SIMD` / [`FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Avx512Vnni => "avx512vnni",
            SimdLevel::Neon => "neon",
            SimdLevel::NeonDot => "neondot",
        }
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SimdLevel {
    type Err = KernelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "none" => SimdLevel::Scalar,
            "avx2" => SimdLevel::Avx2,
            "avx512" => SimdLevel::Avx512,
            "avx512vnni" | "vnni" => SimdLevel::Avx512Vnni,
            "neon" => SimdLevel::Neon,
            "neondot" | "dotprod" => SimdLevel::NeonDot,
            other => {
                return Err(KernelError::Parse {
                    what: "SIMD level",
                    got: other.to_string(),
                    expected: "scalar, avx2, avx512, avx512vnni, neon, neondot",
                });
            }
        })
    }
}

/// Every level this host can run, best last (always starts with `Scalar`).
pub fn supported_levels() -> Vec<SimdLevel> {
    let mut levels = vec![SimdLevel::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            levels.push(SimdLevel::Avx2);
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
            {
                levels.push(SimdLevel::Avx512);
                if is_x86_feature_detected!("avx512vnni") {
                    levels.push(SimdLevel::Avx512Vnni);
                }
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            levels.push(SimdLevel::Neon);
            if std::arch::is_aarch64_feature_detected!("dotprod") {
                levels.push(SimdLevel::NeonDot);
            }
        }
    }
    levels
}

/// The best level the host supports, capped by `FLATRUN_SIMD` when set
/// (`scalar`, `avx2`, `avx512`, …; a level the host lacks falls back to the best it has
/// below it). Detected once and cached.
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let levels = supported_levels();
        let best = *levels.last().unwrap_or(&SimdLevel::Scalar);
        match std::env::var("FLATRUN_SIMD")
            .ok()
            .and_then(|s| s.parse::<SimdLevel>().ok())
        {
            Some(cap) => clamp_to_host(cap, &levels),
            None => best,
        }
    })
}

/// The best supported level not above `want` ("avx512" on a host without it gives avx2).
pub fn clamp_to_host(want: SimdLevel, levels: &[SimdLevel]) -> SimdLevel {
    levels
        .iter()
        .copied()
        .filter(|&l| l <= want)
        .max()
        .unwrap_or(SimdLevel::Scalar)
}
