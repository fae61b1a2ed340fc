//! The crate's error type.

use flatrun_format::{DType, GgmlType};

/// Why a kernel call was refused. Each variant names the weight (its format and
/// shape) and, where it applies, the offending sizes, so a caller can tell which
/// tensor of which layer was at fault.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The tensor's format has no kernel (neither fused nor dequantize-then-dot).
    #[error("tensor `{tensor}`: unsupported weight format {format}")]
    UnsupportedFormat { tensor: String, format: String },
    /// The tensor is not a matrix (or vector) this crate can multiply with.
    #[error("tensor `{tensor}`: unsupported shape {shape:?} (need [rows, cols] or [cols])")]
    BadShape { tensor: String, shape: Vec<usize> },
    /// The byte length of a weight does not match its format and shape.
    #[error("weight {format} [{rows} x {cols}]: {what}: expected {expected} bytes, got {got}")]
    ByteLength {
        format: String,
        rows: usize,
        cols: usize,
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// The row length is not a whole number of blocks of the format.
    #[error(
        "weight {format} [{rows} x {cols}]: {cols} columns is not a multiple of the block size {block}"
    )]
    RaggedRow {
        format: String,
        rows: usize,
        cols: usize,
        block: usize,
    },
    /// A row range outside the matrix.
    #[error("weight {format} [{rows} x {cols}]: row range {start}..{end} out of bounds")]
    RowRange {
        format: String,
        rows: usize,
        cols: usize,
        start: usize,
        end: usize,
    },
    /// An activation or output buffer of the wrong length.
    #[error("weight {format} [{rows} x {cols}]: {what} has {got} values, expected {expected}")]
    BufferLength {
        format: String,
        rows: usize,
        cols: usize,
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A weight row the reference decoder refused.
    #[error("weight {format}, row {row}: {source}")]
    Dequant {
        format: String,
        row: usize,
        #[source]
        source: flatrun_dequant::DequantError,
    },
    /// A string that names no backend or SIMD level.
    /// The weight's bytes could not be fetched (a streamed read failed).
    #[error("weights unavailable: {what}")]
    Unavailable { what: String },

    #[error("unknown {what} `{got}` (expected one of: {expected})")]
    Parse {
        what: &'static str,
        got: String,
        expected: &'static str,
    },
}

/// Printable name of a GGML type (for error messages).
pub(crate) fn ggml_name(t: GgmlType) -> String {
    t.traits().name.to_string()
}

/// Printable name of a storage dtype (for error messages).
pub(crate) fn dtype_name(d: DType) -> String {
    match d {
        DType::Ggml(t) => ggml_name(t),
        other => format!("{other:?}"),
    }
}
