//! The error type of this crate.

use flatrun_format::GgmlType;

/// Why a tensor could not be decoded (or encoded).
#[derive(Debug, thiserror::Error)]
pub enum DequantError {
    /// The byte length is not a whole number of blocks of the type.
    #[error("{ty}: {len} bytes is not a whole number of {block_bytes}-byte blocks")]
    PartialBlock {
        ty: GgmlType,
        len: usize,
        block_bytes: usize,
    },
    /// The element count (a row length, an output buffer) is not a whole
    /// number of blocks.
    #[error("{ty}: {elems} elements is not a whole number of {block_elems}-element blocks")]
    PartialBlockElements {
        ty: GgmlType,
        elems: usize,
        block_elems: usize,
    },
    /// The output buffer does not match the number of decoded values.
    #[error("{what}: output buffer holds {got} values, {expected} needed")]
    OutputSize {
        what: String,
        expected: usize,
        got: usize,
    },
    /// An input buffer has the wrong size.
    #[error("{what}: {got} bytes, {expected} expected")]
    InputSize {
        what: String,
        expected: usize,
        got: usize,
    },
    /// A row range reaches past the tensor.
    #[error("{ty}: rows {start}..{end} out of range for a tensor of {rows} rows")]
    RowRange {
        ty: GgmlType,
        start: usize,
        end: usize,
        rows: usize,
    },
    /// This type is not decoded by this crate.
    #[error("unsupported type {0}")]
    Unsupported(String),
    /// A block's scale is NaN or infinite.
    #[error("{ty}: block {block} (byte offset {offset}) has a non-finite scale {value}")]
    NonFiniteScale {
        ty: GgmlType,
        block: usize,
        offset: usize,
        value: f32,
    },
    /// An MLX affine quantization with parameters this crate does not know.
    #[error("MLX affine: {0}")]
    MlxParams(String),
    /// A tensor handle lacks a companion array.
    #[error("tensor `{tensor}`: missing `{part}` array")]
    MissingPart { tensor: String, part: &'static str },
    /// A tensor handle's error, with its name.
    #[error("tensor `{tensor}`: {source}")]
    Tensor {
        tensor: String,
        #[source]
        source: Box<DequantError>,
    },
    /// Writing a `.npy` file failed.
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Result with [`DequantError`].
pub type Result<T, E = DequantError> = std::result::Result<T, E>;
