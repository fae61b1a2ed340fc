//! Run-time SIMD dispatch: one table of function pointers per level, chosen once.

use flatrun_format::GgmlType;

use super::quantize::{BlockQ8, BlockQ8K};
use super::scalar;
use crate::SimdLevel;

/// Weight row × a tile of 1..=4 Q8-quantized token rows.
pub(crate) type Q8Dot = fn(GgmlType, &[u8], &[&[BlockQ8]], &mut [f32]);
/// Weight row × a tile of 1..=4 Q8_K-quantized token rows.
pub(crate) type Q8KDot = fn(GgmlType, &[u8], &[&[BlockQ8K]], &mut [f32]);
/// Plain-float weight row × a tile of 1..=4 f32 token rows.
pub(crate) type F32Dot = fn(GgmlType, &[u8], &[&[f32]], &mut [f32]);

/// The kernels of one SIMD level.
#[derive(Clone, Copy)]
pub(crate) struct Dispatch {
    pub q8: Q8Dot,
    pub q8k: Q8KDot,
    pub f32: F32Dot,
}

impl std::fmt::Debug for Dispatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dispatch")
    }
}

impl Dispatch {
    /// The table for `level` (which the caller has checked the host supports).
    pub(crate) fn for_level(level: SimdLevel) -> Dispatch {
        let scalar = Dispatch {
            q8: scalar::dot_q8,
            q8k: scalar::dot_q8k,
            f32: scalar::dot_f32,
        };
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => Dispatch {
                q8: super::x86::avx2::dot_q8,
                q8k: super::x86::avx2::dot_q8k,
                f32: super::x86::avx2::dot_f32,
            },
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => Dispatch {
                q8: super::x86::avx512::dot_q8,
                q8k: super::x86::avx512::dot_q8k,
                f32: super::x86::avx512::dot_f32,
            },
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Vnni => Dispatch {
                q8: super::x86::vnni::dot_q8,
                q8k: super::x86::vnni::dot_q8k,
                f32: super::x86::vnni::dot_f32,
            },
            #[cfg(target_arch = "aarch64")]
            SimdLevel::Neon | SimdLevel::NeonDot => Dispatch {
                q8: super::arm::dot_q8,
                q8k: scalar::dot_q8k,
                f32: super::arm::dot_f32,
            },
            _ => scalar,
        }
    }
}
