//! Run-time SIMD dispatch: one table of function pointers per level, chosen once.
//!
//! Every entry takes a group of whole weight rows (`rows`, `row_bytes` each) and a
//! tile of 1..=4 token rows (`acts`; `q8` also `q8_tile`), and writes `out[r * acts.len() + t]`. One
//! indirect call per row group keeps the dispatch cost off the per-row path: a
//! 576-wide row is only 18 blocks.

use flatrun_format::GgmlType;

use super::quantize::{BlockQ8, BlockQ8K};
use super::scalar;
use crate::SimdLevel;

/// Weight rows × a tile of 1..=4 Q8-quantized token rows.
pub(crate) type Q8Rows = fn(GgmlType, &[u8], usize, &[&[BlockQ8]], &mut [f32]);
/// Weight rows × a tile of 1..=4 Q8_K-quantized token rows.
pub(crate) type Q8KRows = fn(GgmlType, &[u8], usize, &[&[BlockQ8K]], &mut [f32]);
/// Plain-float weight rows × a tile of 1..=4 f32 token rows.
pub(crate) type F32Rows = fn(GgmlType, &[u8], usize, &[&[f32]], &mut [f32]);

/// The kernels of one SIMD level.
#[derive(Clone, Copy)]
pub(crate) struct Dispatch {
    pub q8: Q8Rows,
    pub q8k: Q8KRows,
    /// `q8k` for calls of [`WIDE_CALL_TOKENS`] tokens or more, in the float order ggml uses
    /// for them (its tiled K-quant matmul); the same function where no such order is kept.
    pub q8k_wide: Q8KRows,
    /// `q8k` in the one-token order for every tile (speculative verification, see
    /// `call_order`); the same function where every tile already keeps it.
    pub q8k_one: Q8KRows,
    pub f32: F32Rows,
    /// The Q4_K and Q6_K panel tiles (`super::panel`) where the level has them (AVX-512 VNNI).
    pub q4k_panel: Option<super::panel::PanelTile<BlockQ8K>>,
    pub q6k_panel: Option<super::panel::PanelTile<BlockQ8K>>,
    /// The legacy formats' panel tiles, `[signed values, unsigned with a min]`.
    pub q8_panel: Option<[super::panel::PanelTile<BlockQ8>; 2]>,
    /// The widest token tile `q8` takes: 4, or 8 where it has 8-token kernels (x86). Tiles
    /// are 1..=4 tokens or exactly this many.
    pub q8_tile: usize,
}

/// From this many tokens per call llama.cpp's CPU backend multiplies non-repacked K-quant
/// weights with its tiled kernels instead of `vec_dot` (`ggml_tiled_min_batch`).
pub(crate) const WIDE_CALL_TOKENS: usize = 8;

impl std::fmt::Debug for Dispatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dispatch")
    }
}

/// Apply a one-row kernel to every row of a group (for the kernels written per row).
#[inline]
pub(crate) fn each_row<A>(
    dot: impl Fn(GgmlType, &[u8], &[&[A]], &mut [f32]),
    t: GgmlType,
    rows: &[u8],
    row_bytes: usize,
    acts: &[&[A]],
    out: &mut [f32],
) {
    let n = acts.len().max(1);
    for (row, o) in rows
        .chunks_exact(row_bytes.max(1))
        .zip(out.chunks_exact_mut(n))
    {
        dot(t, row, acts, o);
    }
}

impl Dispatch {
    /// The table for `level` (which the caller has checked the host supports).
    pub(crate) fn for_level(level: SimdLevel) -> Dispatch {
        let scalar = Dispatch {
            q8: scalar::rows_q8,
            q8k: scalar::rows_q8k,
            q8k_wide: scalar::rows_q8k,
            q8k_one: scalar::rows_q8k,
            f32: scalar::rows_f32,
            q4k_panel: None,
            q6k_panel: None,
            q8_panel: None,
            q8_tile: 4,
        };
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => Dispatch {
                q8: super::x86::avx2::rows_q8,
                q8k: super::x86::avx2::rows_q8k,
                q8k_wide: super::x86::avx2::rows_q8k_wide,
                q8k_one: super::x86::avx2::rows_q8k_one_token,
                f32: super::x86::avx2::rows_f32,
                q4k_panel: None,
                q6k_panel: None,
                q8_panel: None,
                q8_tile: 8,
            },
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => Dispatch {
                q8: super::x86::avx512::rows_q8,
                q8k: super::x86::avx512::rows_q8k,
                q8k_wide: super::x86::avx512::rows_q8k_wide,
                q8k_one: super::x86::avx512::rows_q8k_one_token,
                f32: super::x86::avx512::rows_f32,
                q4k_panel: None,
                q6k_panel: None,
                q8_panel: None,
                q8_tile: 8,
            },
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Vnni => Dispatch {
                q8: super::x86::vnni::rows_q8,
                q8k: super::x86::vnni::rows_q8k,
                q8k_wide: super::x86::vnni::rows_q8k_wide,
                q8k_one: super::x86::vnni::rows_q8k_one_token,
                f32: super::x86::vnni::rows_f32,
                q4k_panel: Some(super::x86::q4k_panel_tile),
                q6k_panel: Some(super::x86::q6k_panel_tile),
                q8_panel: Some([
                    super::x86::legacy_panel_tile::<false>,
                    super::x86::legacy_panel_tile::<true>,
                ]),
                q8_tile: 8,
            },
            #[cfg(target_arch = "aarch64")]
            SimdLevel::Neon => Dispatch {
                q8: super::arm::neon::rows_q8,
                q8k: super::arm::neon::rows_q8k,
                q8k_wide: super::arm::neon::rows_q8k,
                q8k_one: super::arm::neon::rows_q8k,
                f32: super::arm::neon::rows_f32,
                q4k_panel: None,
                q6k_panel: None,
                q8_panel: None,
                q8_tile: 4,
            },
            #[cfg(target_arch = "aarch64")]
            SimdLevel::NeonDot => Dispatch {
                q8: super::arm::dotprod::rows_q8,
                q8k: super::arm::dotprod::rows_q8k,
                q8k_wide: super::arm::dotprod::rows_q8k,
                q8k_one: super::arm::dotprod::rows_q8k,
                f32: super::arm::dotprod::rows_f32,
                q4k_panel: None,
                q6k_panel: None,
                q8_panel: None,
                q8_tile: 4,
            },
            _ => scalar,
        }
    }
}
