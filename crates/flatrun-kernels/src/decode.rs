//! Row decoding through flatrun-dequant's bit-exact reference decoders.

use flatrun_dequant::{DequantError, MlxAffine, ScaleType};
use flatrun_format::GgmlType;

use crate::KernelError;
use crate::weight::{Weight, WeightFormat};

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
