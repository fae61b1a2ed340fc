//! aarch64 kernels (NEON). Not yet specialised: they forward to the portable
//! kernels, which LLVM auto-vectorizes for NEON.

use flatrun_format::GgmlType;

use super::dispatch::each_row;
use super::quantize::{BlockQ8, BlockQ8K};
use super::scalar;

/// Rows × Q8 tile.
pub(crate) fn rows_q8(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8]], out: &mut [f32]) {
    each_row(scalar::dot_q8, t, rows, rb, acts, out)
}

/// Rows × Q8_K tile.
pub(crate) fn rows_q8k(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8K]], out: &mut [f32]) {
    each_row(scalar::dot_q8k, t, rows, rb, acts, out)
}

/// Rows × f32 tile.
pub(crate) fn rows_f32(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[f32]], out: &mut [f32]) {
    each_row(scalar::dot_f32, t, rows, rb, acts, out)
}
