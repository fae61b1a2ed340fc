//! Row decoding (through flatrun-dequant's bit-exact reference decoders) and
//! the small block-layout helpers the fused kernels share. Layouts follow
//! ggml's `ggml-common.h`.

use flatrun_dequant::{DequantError, MlxAffine, ScaleType};
use flatrun_format::GgmlType;
use half::f16;

use crate::weight::{Weight, WeightFormat};
use crate::KernelError;

/// The 16 non-linear levels of IQ4_NL and IQ4_XS.
pub(crate) const IQ4NL_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Little-endian f16 at `b[i..i+2]` as f32.
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The 6-bit scale and min `j` (0..8) of a Q4_K/Q5_K block's 12 packed scale bytes.
#[inline(always)]
pub(crate) fn k4_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The 16 signed 6-bit scales of a Q3_K block (stored as 12 bytes), without the −32 offset removed.
#[inline(always)]
pub(crate) fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        // Low 4 bits: nibble of byte j%8 (low nibble for j<8, high for j>=8);
        // high 2 bits: 2-bit field j/4.. of bytes 8..12.
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// Decode row `r` of `w` into `out` (`w.cols` values) with flatrun-dequant's
/// reference decoders (bit-exact against ggml).
pub(crate) fn decode_row(w: &Weight, r: usize, out: &mut [f32]) -> Result<(), KernelError> {
    let wrap = |source| KernelError::Dequant {
        format: w.format.to_string(),
        row: r,
        source,
    };
    match w.format {
        WeightFormat::Ggml(t) => {
            flatrun_dequant::dequantize_row(t, w.data, w.cols, r, out).map_err(wrap)
        }
        WeightFormat::MlxAffine { .. } => {
            let params = mlx_params(w.format).map_err(wrap)?;
            let (rb, sb) = (w.row_bytes(), w.scale_row_bytes());
            fn span(b: Option<&[u8]>, r: usize, n: usize) -> &[u8] {
                b.and_then(|b| b.get(r * n..(r + 1) * n)).unwrap_or(&[])
            }
            let (data, scales, biases) = (
                span(Some(w.data), r, rb),
                span(w.scales, r, sb),
                span(w.biases, r, sb),
            );
            params.dequantize(data, scales, biases, out).map_err(wrap)
        }
    }
}

/// flatrun-dequant's description of an MLX format.
pub(crate) fn mlx_params(format: WeightFormat) -> Result<MlxAffine, DequantError> {
    match format {
        WeightFormat::MlxAffine {
            bits,
            group_size,
            scale_dtype,
        } => MlxAffine::new(
            bits,
            group_size as usize,
            ScaleType::from_dtype(scale_dtype)?,
        ),
        WeightFormat::Ggml(t) => Err(DequantError::MlxParams(format!(
            "{t:?} is not an MLX format"
        ))),
    }
}

/// Whether rows of this GGML type can be decoded (and so multiplied).
pub(crate) fn is_supported(t: GgmlType) -> bool {
    flatrun_dequant::is_supported(t)
}
