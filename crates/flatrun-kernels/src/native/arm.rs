//! aarch64 kernels (NEON). Not yet specialised: they forward to the portable
//! kernels, which LLVM auto-vectorizes for NEON.

use flatrun_format::GgmlType;

use super::quantize::BlockQ8;
use super::scalar;

/// Row × Q8 tile.
pub(crate) fn dot_q8(t: GgmlType, row: &[u8], acts: &[&[BlockQ8]], out: &mut [f32]) {
    scalar::dot_q8(t, row, acts, out)
}

/// Row × f32 tile.
pub(crate) fn dot_f32(t: GgmlType, row: &[u8], acts: &[&[f32]], out: &mut [f32]) {
    scalar::dot_f32(t, row, acts, out)
}
