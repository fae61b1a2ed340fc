//! Scalar reference decoders for every GGML block format and for MLX affine
//! quantization, bit-exact with the reference implementation.
//!
//! Quantized weights are why a model fits on a small machine, and a wrong
//! decoder produces fluent nonsense that no shape check catches. This crate
//! turns any tensor the storage layer hands out into f32 (or f16/bf16)
//! exactly as ggml's `dequantize_row_*` (and MLX's `dequantize`) do. It is the
//! readable reference; fused, vectorised kernels live in `flatrun-kernels`
//! and are tested against it.
//!
//! - [`blocks`]: one `#[repr(C)]` struct per GGML block format, each a
//!   [`BlockFormat`] (size, type id, dot-product partner, block decoder).
//! - [`decode`]: whole tensors, rows and row ranges into caller buffers
//!   ([`dequantize`], [`dequantize_rows`], [`dequantize_to_f16`], …) and
//!   [`validate`] for data read from a file.
//! - [`handle`]: decode a storage [`flatrun_format::TensorHandle`].
//! - [`mlx`]: MLX affine quantization ([`MlxAffine`]).
//! - [`mod@quantize`] and [`mod@quantize_k`]: reference quantizers (Q8_0, Q8_1, Q8_K
//!   for activations; Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q1_0, Q2_0,
//!   MXFP4, TQ1_0, TQ2_0), byte-exact with ggml's `quantize_row_*_ref`.
//! - [`inspect`]: statistics and `.npy` output for `flatrun inspect`.
//!
//! See `docs/quantization.md` for the table of formats.
//!
//! # Example
//!
//! ```
//! use flatrun_dequant::{dequantize, dequantize_rows, quantize_to_vec, stats, GgmlType};
//!
//! // Quantize two rows of 64 values to Q4_0 and decode them back.
//! let values: Vec<f32> = (0..128).map(|i| (i as f32 - 64.0) / 16.0).collect();
//! let bytes = quantize_to_vec(GgmlType::Q4_0, &values)?;
//! assert_eq!(bytes.len(), 4 * 18); // four 32-weight blocks of 18 bytes
//!
//! let mut decoded = vec![0f32; 128];
//! dequantize(GgmlType::Q4_0, &bytes, &mut decoded)?;
//! assert!(values.iter().zip(&decoded).all(|(a, b)| (a - b).abs() <= 0.5));
//!
//! // Only the second row, into a buffer of one row.
//! let mut row = vec![0f32; 64];
//! dequantize_rows(GgmlType::Q4_0, &bytes, 64, 1..2, &mut row)?;
//! assert_eq!(row[..], decoded[64..]);
//! println!("{}", stats(&row));
//! # Ok::<(), flatrun_dequant::DequantError>(())
//! ```

// Block structs are read straight from file bytes: their multi-byte fields
// are little-endian on disk, so the host must be too.
#[cfg(target_endian = "big")]
compile_error!(
    "flatrun-dequant reads little-endian GGML/MLX data in place: big-endian hosts are not supported"
);

pub mod blocks;
pub mod decode;
pub mod error;
pub mod handle;
pub mod inspect;
#[rustfmt::skip]
pub mod iq_grids;
pub mod mlx;
pub mod quantize;
pub mod quantize_k;

pub use blocks::*;
pub use decode::*;
pub use error::{DequantError, Result};
pub use flatrun_format::GgmlType;
pub use handle::{dequantize_handle, dequantize_handle_rows, dequantize_handle_to_vec};
pub use inspect::{NpyWriter, Stats, stats, write_npy_f32};
pub use mlx::{MlxAffine, ScaleType};
pub use quantize::*;
