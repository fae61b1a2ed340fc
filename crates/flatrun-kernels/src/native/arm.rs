//! aarch64 kernels: plain NEON (`smull` + `sadalp` integer dots) and NEON with
//! the dot-product extension (`sdot`), f32 accumulation in both.
//!
//! The kernels have the shape of `native/x86.rs`'s: `fn(row, acts, out)` over one
//! weight row and a tile of 1..=4 tokens (`acts[t]`, `out[t]`); each weight block
//! is loaded and unpacked into registers once, then multiplied with every token
//! of the tile. They live by concept in `arm_legacy.rs` (32-value blocks against
//! Q8), `arm_kquants.rs` (256-value super-blocks against Q8_K), `arm_mlx.rs`
//! (MLX affine 4/8-bit against Q8) and `arm_float.rs` (F32/F16/BF16), each written once, generic over `const DOT: bool` (which
//! integer dot [`dot16`] uses) and `const N: usize` (the tile size), and marked
//! `#[inline(always)]`. The two levels below instantiate them:
//!
//! - [`neon`]: `DOT = false`, compiled for the baseline target (every aarch64
//!   CPU has NEON);
//! - [`dotprod`]: `DOT = true`, inlined into functions compiled with
//!   `#[target_feature(enable = "neon,dotprod")]`, so the `sdot` of [`dot16`]
//!   is inlined and the rest is scheduled for that CPU.
//!
//! (`levels!` at the end writes both modules' entry points from one list.)
//!
//! The entry points are safe: they check every slice length the kernels rely
//! on (a malformed call goes to the portable kernels), and the dotprod ones
//! check the CPU feature themselves (a cached load) before entering code that
//! uses it.
//!
//! # Safety (every `unsafe fn` in these files)
//! The caller must pass a row of whole blocks, `N` activation rows each
//! holding at least the matching number of activation blocks, and `N` outputs
//! (what [`checked`] and the tiling in `tile!` guarantee; for MLX rows,
//! `MlxRowsData::fits`); the kernels index with `get_unchecked` and raw
//! pointers inside those bounds only. `DOT = true` additionally needs a CPU
//! with the dot-product extension.

use std::arch::aarch64::*;
use std::arch::asm;

use flatrun_format::GgmlType;

use super::mlx_affine::{MlxLayout, MlxRowsData};
use super::quantize::{BlockQ8, BlockQ8K};

/// `acc` plus the sum of the 16 products `a[i] · b[i]` (i8 × i8), spread over
/// the four i32 lanes (how it is spread differs by level; only the lanes' total
/// is meaningful).
#[inline(always)]
unsafe fn dot16<const DOT: bool>(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        if DOT {
            sdot(acc, a, b)
        } else {
            // Widen the products to i16 (|a·b| ≤ 128·128 fits), then add adjacent
            // pairs into the i32 lanes: no i16 sum can overflow.
            let acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
            vpadalq_s16(acc, vmull_high_s8(a, b))
        }
    }
}

/// One `sdot`: each i32 lane of `acc` gains the dot of its four byte pairs.
/// (`vdotq_s32` is still unstable in Rust, hence the asm.)
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: `sdot` only reads and writes the three vector registers; this
    // function is compiled (and, by its callers' contract, run) with dotprod.
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// `acc + Σ` of 32 products: a 32-value block (`lo` = values 0..16, `hi` = 16..32)
/// against 32 activations at `a`.
#[inline(always)]
unsafe fn dot32<const DOT: bool>(
    acc: int32x4_t,
    lo: int8x16_t,
    hi: int8x16_t,
    a: *const i8,
) -> int32x4_t {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let acc = dot16::<DOT>(acc, lo, vld1q_s8(a));
        dot16::<DOT>(acc, hi, vld1q_s8(a.add(16)))
    }
}

/// An IEEE half (as its bits) converted to f32 with one `fcvt`.
#[inline(always)]
fn f16_to_f32(bits: u16) -> f32 {
    let out: f32;
    // SAFETY: `fcvt` (half → single) is part of the base aarch64 FP unit, which
    // every aarch64 Linux target has; it touches registers only.
    unsafe {
        asm!(
            "fcvt {out:s}, {bits:h}",
            out = lateout(vreg) out,
            bits = in(vreg) bits,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    out
}

/// The little-endian f16 at `p` as f32 (reads 2 bytes).
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe { f16_to_f32(u16::from_le_bytes([*p, *p.add(1)])) }
}

/// Four IEEE halves (as bits) converted to f32 with one `fcvtl`.
#[inline(always)]
fn f16x4_to_f32(bits: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: `fcvtl` (half → single, vector) is base AdvSIMD, present on every
    // aarch64 CPU (the half-precision *arithmetic* extension is not needed);
    // registers only. (`vcvt_f32_f16` needs Rust's unstable f16 types.)
    unsafe {
        asm!(
            "fcvtl {out:v}.4s, {bits:v}.4h",
            out = lateout(vreg) out,
            bits = in(vreg) bits,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    out
}

/// The little-endian u32 at `p` (reads 4 bytes, any alignment).
#[inline(always)]
unsafe fn u32_at(p: *const u8) -> u32 {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe { u32::from_le_bytes(p.cast::<[u8; 4]>().read()) }
}

/// 32 bits → two byte masks, 0xFF where the bit is set: bits 0..16 (bit `j` →
/// byte `j`) and bits 16..32.
#[inline(always)]
unsafe fn bits_to_masks(bits: u32) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        const PICK_LO: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
        const PICK_HI: [u8; 16] = [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3];
        const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
        // Every byte of the word in every lane, then byte j/8 in lane j, then its bit j%8.
        let bytes = vreinterpretq_u8_u32(vdupq_n_u32(bits));
        let bit = vld1q_u8(BIT.as_ptr());
        let lo = vtstq_u8(vqtbl1q_u8(bytes, vld1q_u8(PICK_LO.as_ptr())), bit);
        let hi = vtstq_u8(vqtbl1q_u8(bytes, vld1q_u8(PICK_HI.as_ptr())), bit);
        (lo, hi)
    }
}

/// Whether a call is well formed: whole rows of whole blocks, 1..=4 tokens, room
/// for every output, every activation row long enough.
#[inline(always)]
fn checked<A>(
    rows: &[u8],
    rb: usize,
    ts: usize,
    acts_per_block: usize,
    acts: &[&[A]],
    out: &[f32],
) -> bool {
    let need = rb / ts.max(1) * acts_per_block;
    rb > 0
        && rb.is_multiple_of(ts.max(1))
        && rows.len().is_multiple_of(rb)
        && (1..=4).contains(&acts.len())
        && out.len() >= rows.len() / rb * acts.len()
        && acts.iter().all(|a| a.len() >= need)
}

/// Run `$kernel::<.., N>` (N = the tile size, 1..=4) on every row of a group.
macro_rules! tile {
    ($($kernel:ident)::+ $(, $c:expr)*; $rows:expr, $rb:expr, $acts:expr, $out:expr) => {{
        let (rows, rb, acts, out) = ($rows, $rb, $acts, $out);
        // SAFETY: `checked` verified every slice the kernel indexes, and a
        // `DOT = true` instantiation is only reached from `dotprod`'s
        // target-feature functions, whose callers checked the CPU feature.
        unsafe {
            match acts.len() {
                1 => for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(1)) {
                    $($kernel)::+::<$($c,)* 1>(row, acts, o)
                },
                2 => for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(2)) {
                    $($kernel)::+::<$($c,)* 2>(row, acts, o)
                },
                3 => for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(3)) {
                    $($kernel)::+::<$($c,)* 3>(row, acts, o)
                },
                _ => for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(4)) {
                    $($kernel)::+::<$($c,)* 4>(row, acts, o)
                },
            }
        }
    }};
}

// The families (declared after `tile!`, which their `rows_*` use).
#[path = "arm_float.rs"]
mod float;
#[path = "arm_kquants.rs"]
mod kquants;
#[path = "arm_legacy.rs"]
mod legacy;
#[path = "arm_mlx.rs"]
mod mlx;

/// The safe entry points of both levels, one per kernel family `$kernel::<DOT>`:
/// `neon::$name` runs it with `DOT = false`; `dotprod::$name` checks the CPU
/// feature (a cached load) and runs it with `DOT = true` inside a function
/// compiled with `#[target_feature(enable = "neon,dotprod")]`, or falls back to
/// `neon::$name` without the feature.
macro_rules! levels {
    ($($(#[doc = $doc:literal])* fn $name:ident($($arg:ident: $ty:ty),*) = $($kernel:ident)::+;)*) => {
        /// Kernels for NEON without the dot-product extension (`SimdLevel::Neon`):
        /// integer dots by `smull`/`smull2` + `sadalp`.
        pub(crate) mod neon {
            use super::{BlockQ8, BlockQ8K, GgmlType, MlxLayout, MlxRowsData};
            $(
                $(#[doc = $doc])*
                pub(crate) fn $name($($arg: $ty),*) {
                    // SAFETY: `DOT = false` needs only NEON, which every aarch64 CPU has.
                    unsafe { super::$($kernel)::+::<false>($($arg),*) }
                }
            )*

            /// Rows × f32 tile.
            pub(crate) fn rows_f32(
                t: GgmlType,
                rows: &[u8],
                rb: usize,
                acts: &[&[f32]],
                out: &mut [f32],
            ) {
                super::float::rows_f32(t, rows, rb, acts, out)
            }
        }

        /// Kernels for NEON with the dot-product extension (`SimdLevel::NeonDot`):
        /// integer dots by `sdot`. Each entry checks the feature and falls back to
        /// [`neon`] without it, so it is safe to call anywhere.
        pub(crate) mod dotprod {
            use super::{BlockQ8, BlockQ8K, GgmlType, MlxLayout, MlxRowsData};

            fn has_dotprod() -> bool {
                std::arch::is_aarch64_feature_detected!("dotprod")
            }
            $(
                $(#[doc = $doc])*
                pub(crate) fn $name($($arg: $ty),*) {
                    /// # Safety
                    /// The CPU must support the dot-product extension.
                    #[target_feature(enable = "neon,dotprod")]
                    unsafe fn with_sdot($($arg: $ty),*) {
                        // SAFETY: the caller upholds this function's safety contract (its
                        // `# Safety` section or the module's), which every unsafe operation
                        // below relies on.
                        unsafe {
                            super::$($kernel)::+::<true>($($arg),*)
                        }
                    }
                    if !has_dotprod() {
                        return super::neon::$name($($arg),*);
                    }
                    // SAFETY: the CPU has dotprod (checked just above).
                    unsafe { with_sdot($($arg),*) }
                }
            )*

            /// Rows × f32 tile (no integer dots: the NEON kernels).
            pub(crate) fn rows_f32(
                t: GgmlType,
                rows: &[u8],
                rb: usize,
                acts: &[&[f32]],
                out: &mut [f32],
            ) {
                super::neon::rows_f32(t, rows, rb, acts, out)
            }
        }
    };
}

levels! {
    /// Rows × Q8 tile (legacy formats, Q1_0, IQ4_NL).
    fn rows_q8(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8]], out: &mut [f32]) = legacy::rows_q8;
    /// Rows × Q8_K tile (K-quants, IQ4_XS).
    fn rows_q8k(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8K]], out: &mut [f32]) = kquants::rows_q8k;
    /// MLX affine 4/8-bit rows × Q8 tile.
    fn rows_mlx(layout: MlxLayout, rows: &MlxRowsData, acts: &[&[BlockQ8]], out: &mut [f32]) = mlx::rows_mlx;
}
