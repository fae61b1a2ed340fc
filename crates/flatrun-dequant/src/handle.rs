//! Decoding straight from a storage [`TensorHandle`], dispatching on its
//! [`QuantDescriptor`].

use std::ops::Range;

use flatrun_format::{DType, QuantDescriptor, TensorHandle};

use crate::decode::{dequantize, dequantize_rows};
use crate::error::{DequantError, Result};
use crate::mlx::{MlxAffine, ScaleType};

/// What a handle's bytes are, for decoding.
enum Encoding {
    /// A GGML type (plain or block-quantized).
    Ggml(flatrun_format::GgmlType),
    /// MLX affine quantization.
    Mlx(MlxAffine),
}

fn encoding(handle: &TensorHandle<'_>) -> Result<Encoding> {
    match handle.quant() {
        QuantDescriptor::Ggml(ty) => Ok(Encoding::Ggml(ty)),
        QuantDescriptor::None => match handle.dtype() {
            DType::Ggml(ty) => Ok(Encoding::Ggml(ty)),
            other => Err(DequantError::Unsupported(format!(
                "storage dtype {other:?}"
            ))),
        },
        QuantDescriptor::MlxAffine {
            bits,
            group_size,
            scale_dtype,
        } => Ok(Encoding::Mlx(MlxAffine::new(
            bits,
            group_size as usize,
            ScaleType::from_dtype(scale_dtype)?,
        )?)),
    }
}

fn with_name<T>(handle: &TensorHandle<'_>, r: Result<T>) -> Result<T> {
    r.map_err(|e| DequantError::Tensor {
        tensor: handle.name().to_owned(),
        source: Box::new(e),
    })
}

fn part<'a>(handle: &TensorHandle<'a>, name: &'static str) -> Result<&'a [u8]> {
    handle.part(name).ok_or_else(|| DequantError::MissingPart {
        tensor: handle.name().to_owned(),
        part: name,
    })
}

/// Decode a whole tensor into `out` (exactly `n_elements` values, row-major
/// in the handle's logical shape).
pub fn dequantize_handle(handle: &TensorHandle<'_>, out: &mut [f32]) -> Result<()> {
    let r = match encoding(handle) {
        Ok(Encoding::Ggml(ty)) => dequantize(ty, handle.bytes(), out),
        Ok(Encoding::Mlx(q)) => part(handle, "scales").and_then(|scales| {
            let biases = part(handle, "biases")?;
            q.dequantize(handle.bytes(), scales, biases, out)
        }),
        Err(e) => Err(e),
    };
    with_name(handle, r)
}

/// Decode rows `rows` of a tensor (rows along its last axis) into `out`
/// (exactly `rows.len() * row_len` values) — for streaming big tensors in
/// chunks.
pub fn dequantize_handle_rows(
    handle: &TensorHandle<'_>,
    rows: Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    let row_len = handle.shape().last().copied().unwrap_or(1);
    let r = match encoding(handle) {
        Ok(Encoding::Ggml(ty)) => dequantize_rows(ty, handle.bytes(), row_len, rows, out),
        Ok(Encoding::Mlx(q)) => (|| {
            let scales = part(handle, "scales")?;
            let biases = part(handle, "biases")?;
            let n_rows = q.value_count(handle.bytes().len())? / row_len.max(1);
            if rows.start > rows.end || rows.end > n_rows || row_len % q.group_size != 0 {
                return Err(DequantError::MlxParams(format!(
                    "rows {}..{} of {n_rows} rows of {row_len} (group size {})",
                    rows.start, rows.end, q.group_size
                )));
            }
            // Rows are whole groups: slice packed data, scales and biases.
            let packed_row = q.packed_bytes(row_len);
            let side_row = row_len / q.group_size * q.scale_type.size();
            for (what, arr) in [("scales", scales), ("biases", biases)] {
                if arr.len() != n_rows * side_row {
                    return Err(DequantError::InputSize {
                        what: format!("MLX {what} of {n_rows} rows of {row_len}"),
                        expected: n_rows * side_row,
                        got: arr.len(),
                    });
                }
            }
            q.dequantize(
                &handle.bytes()[rows.start * packed_row..rows.end * packed_row],
                &scales[rows.start * side_row..rows.end * side_row],
                &biases[rows.start * side_row..rows.end * side_row],
                out,
            )
        })(),
        Err(e) => Err(e),
    };
    with_name(handle, r)
}

/// Decode a whole tensor into a new vector.
pub fn dequantize_handle_to_vec(handle: &TensorHandle<'_>) -> Result<Vec<f32>> {
    let n = handle.info().n_elements() as usize;
    let mut out = vec![0f32; n];
    dequantize_handle(handle, &mut out)?;
    Ok(out)
}
