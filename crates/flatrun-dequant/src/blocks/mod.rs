//! The GGML block formats: one `#[repr(C)]` struct per on-disk block, laid out
//! exactly as ggml's `ggml-common.h`, and the [`BlockFormat`] trait that ties a
//! struct to its [`GgmlType`], its size and its scalar reference decoder.
//!
//! Every struct is `bytemuck::Pod`, so a byte slice of whole blocks can be
//! viewed as `&[BlockX]` (when aligned) or read block by block with
//! [`bytemuck::pod_read_unaligned`]. Each file holds one family:
//!
//! | file | formats |
//! |---|---|
//! | [`legacy`] | Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 (32 weights per block) |
//! | [`k_quants`] | Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K (256-weight super-blocks) |
//! | [`low_bit`] | Q1_0, Q2_0, TQ1_0, TQ2_0 (1-bit, 2-bit and ternary) |
//! | [`iq`] | IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS |
//! | [`fp4`] | MXFP4, NVFP4 (E2M1 values with E8M0 / UE4M3 scales) |

pub mod fp4;
pub mod iq;
pub mod k_quants;
pub mod legacy;
pub mod low_bit;

pub use fp4::{BlockMxfp4, BlockNvfp4};
pub use iq::{
    BlockIq1M, BlockIq1S, BlockIq2S, BlockIq2Xs, BlockIq2Xxs, BlockIq3S, BlockIq3Xxs, BlockIq4Nl,
    BlockIq4Xs,
};
pub use k_quants::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};
pub use legacy::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1};
pub use low_bit::{BlockQ1_0, BlockQ2_0, BlockTq1_0, BlockTq2_0};

use flatrun_format::GgmlType;

/// Weights per K-quant super-block (`QK_K`).
pub const QK_K: usize = 256;

/// One GGML block format.
///
/// Implemented by every block struct of this module. The constants agree with
/// the [`GgmlType`] table of `flatrun-format` (a test checks it).
pub trait BlockFormat: bytemuck::Pod + Send + Sync + 'static {
    /// Weights per block.
    const BLOCK_ELEMS: usize;
    /// Bytes per block (`size_of::<Self>()`).
    const BLOCK_BYTES: usize;
    /// The GGML type id of this format.
    const TYPE: GgmlType;
    /// The activation block type a dot product with this format uses
    /// (ggml's `vec_dot_type`): [`BlockQ8_0`] for Q4_0, Q5_0, Q8_0, IQ4_NL,
    /// Q1_0, Q2_0, MXFP4, NVFP4; [`BlockQ8_1`] for Q4_1, Q5_1, Q8_1; [`BlockQ8K`]
    /// for the K-quants, IQ4_XS, the other IQ types and TQ1_0/TQ2_0.
    type DotPartner: BlockFormat;

    /// Decode this block into `out[..Self::BLOCK_ELEMS]`, bit-exact with
    /// ggml's `dequantize_row_*`.
    ///
    /// # Panics
    /// If `out` is shorter than [`Self::BLOCK_ELEMS`] (a caller bug: the
    /// row-level functions of this crate check lengths and return errors).
    fn dequantize(&self, out: &mut [f32]);

    /// The block's scale fields as f32 (for validation: a NaN or infinite
    /// scale read from a file is an error). Formats whose scales cannot be
    /// non-finite return an empty list.
    fn scales(&self) -> ScaleList;
}

/// Up to four scale values of one block, without allocating.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScaleList {
    values: [f32; 4],
    len: usize,
}

impl ScaleList {
    /// No scales.
    pub const EMPTY: ScaleList = ScaleList {
        values: [0.0; 4],
        len: 0,
    };

    /// The given scales (at most four are kept).
    pub fn of(values: &[f32]) -> ScaleList {
        let mut list = ScaleList::EMPTY;
        for &v in values.iter().take(4) {
            list.values[list.len] = v;
            list.len += 1;
        }
        list
    }

    /// The scales as a slice.
    pub fn as_slice(&self) -> &[f32] {
        &self.values[..self.len]
    }

    /// Whether every scale is finite.
    pub fn all_finite(&self) -> bool {
        self.as_slice().iter().all(|v| v.is_finite())
    }
}

/// Implements [`BlockFormat`]'s constants and the compile-time size check.
macro_rules! block_format {
    ($block:ty, $ty:ident, elems = $elems:expr, bytes = $bytes:expr, partner = $partner:ty) => {
        const _: () = assert!(::core::mem::size_of::<$block>() == $bytes);
        const _: () = assert!(
            ::flatrun_format::GgmlType::$ty.type_size() == $bytes
                && ::flatrun_format::GgmlType::$ty.block_size() == $elems
        );
        impl $crate::blocks::BlockFormat for $block {
            const BLOCK_ELEMS: usize = $elems;
            const BLOCK_BYTES: usize = $bytes;
            const TYPE: ::flatrun_format::GgmlType = ::flatrun_format::GgmlType::$ty;
            type DotPartner = $partner;
            fn dequantize(&self, out: &mut [f32]) {
                // Slicing to exactly BLOCK_ELEMS makes the conversion infallible.
                let out: &mut [f32; $elems] = (&mut out[..$elems])
                    .try_into()
                    .expect("slice of exactly BLOCK_ELEMS");
                self.decode(out)
            }
            fn scales(&self) -> $crate::blocks::ScaleList {
                self.scale_values()
            }
        }
    };
}
pub(crate) use block_format;

/// Byte offsets of a block's fields as associated `const`s
/// (`BlockQ4_1::QS_OFFSET`, …), for kernels that read blocks in place through
/// pointers: derived from the `#[repr(C)]` struct with `offset_of!`, so they
/// compile to the same immediate offsets as hand-written numbers.
macro_rules! byte_offsets {
    ($block:ty { $($field:ident => $name:ident),* $(,)? }) => {
        impl $block {
            $(
                #[doc = concat!("Byte offset of `", stringify!($field), "` in the block.")]
                pub const $name: usize = ::core::mem::offset_of!($block, $field);
            )*
        }
    };
}
pub(crate) use byte_offsets;

/// f16 → f32 (exact).
#[inline(always)]
pub(crate) fn f16_to_f32(h: half::f16) -> f32 {
    h.to_f32()
}
