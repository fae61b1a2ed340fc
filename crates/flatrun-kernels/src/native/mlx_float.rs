//! Fused kernels for MLX affine weights with the format's own numerics.
//!
//! MLX defines a quantized matmul as dequantized weights times unquantized
//! activations: `y = Σ (s·q + b)·x`, every term in float. These kernels do
//! exactly that, without a decoded copy of the row: eight packed values at a
//! time are unpacked into a SIMD register, turned into weights by one
//! `fmadd(q, s, b)` with their group's scale and bias, and multiplied into f32
//! accumulators against the f32 activations of every token of the tile (1..=4
//! tokens share each unpacked register). Two accumulators per token (even and
//! odd 8-value chunks) keep the FMA chains short; one horizontal sum per row.
//!
//! Every layout mlx-lm writes: 1, 2, 3, 4, 5, 6 and 8 bits, groups of 32, 64
//! and 128 (any multiple of 16), f16/bf16/f32 scales. MLX packs each run of
//! eight `bits`-bit values into `bits` bytes, value `k` at bit `bits·k` of the
//! little-endian window, so one shuffle puts the two bytes holding value `k`
//! into 32-bit lane `k`, a variable shift and a mask isolate it (8-bit values
//! are widened directly). x86: AVX2 + FMA (also what the AVX-512 levels run);
//! aarch64: NEON (`tbl`, `ushl`, `fmla`); elsewhere the portable loop.
//!
//! Against mlx-lm's own f32 evaluation the sums differ only in their order.
//! The Q8-activation kernels of `mlx_affine` (ggml's numerics) stay available
//! behind [`crate::MlxActivations::Q8`].

use super::NativeKernels;
use super::mlx_affine::{MlxLayout, MlxRowsData, ScaleKind};
use crate::weight::WeightFormat;
use crate::{KernelError, SimdLevel, Weight};
use flatrun_format::{DType, GgmlType};

/// Bit widths with a fused float kernel (7 is not an MLX width).
const BITS: [u32; 7] = [1, 2, 3, 4, 5, 6, 8];

/// The float-activation layout of `format`, or `None` when it has no fused
/// kernel (unknown width, a group that is not a multiple of 16, odd scales).
pub(crate) fn supports(format: WeightFormat) -> Option<MlxLayout> {
    let WeightFormat::MlxAffine {
        bits,
        group_size,
        scale_dtype,
    } = format
    else {
        return None;
    };
    let scales = match scale_dtype {
        DType::Ggml(GgmlType::F16) => ScaleKind::F16,
        DType::Ggml(GgmlType::BF16) => ScaleKind::BF16,
        DType::Ggml(GgmlType::F32) => ScaleKind::F32,
        _ => return None,
    };
    let group = group_size as usize;
    let ok = BITS.contains(&(bits as u32)) && group > 0 && group.is_multiple_of(16);
    ok.then_some(MlxLayout {
        bits: bits as u32,
        group,
        scales,
    })
}

/// Weight rows × a tile of 1..=4 f32 token rows; writes `out[r * acts.len() + t]`.
pub(crate) type MlxF32Rows = fn(MlxLayout, &MlxRowsData, &[&[f32]], &mut [f32]);

/// The kernel for `level` (which the caller has checked the host supports).
pub(crate) fn rows_for_level(level: SimdLevel) -> MlxF32Rows {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 | SimdLevel::Avx512 | SimdLevel::Avx512Vnni => x86::rows,
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon | SimdLevel::NeonDot => arm::rows,
        _ => rows_scalar,
    }
}

/// Whether a SIMD kernel may index this call without checks: whole groups per
/// row with a scale and a bias each, 1..=4 activation rows of at least a row's
/// values, and a value of `out` per row and token.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
fn fits(layout: MlxLayout, rows: &MlxRowsData, acts: &[&[f32]], out: &[f32]) -> bool {
    let bits = layout.bits as usize;
    let group_bytes = layout.group * bits / 8;
    let n_groups = rows.row_bytes / group_bytes.max(1);
    let cols = rows.row_bytes * 8 / bits.max(1);
    group_bytes > 0
        && layout.group.is_multiple_of(16)
        && rows.row_bytes.is_multiple_of(group_bytes)
        && rows.scale_row_bytes >= n_groups * layout.scales.size()
        && (1..=4).contains(&acts.len())
        && out.len() >= rows.n_rows() * acts.len()
        && acts.iter().all(|a| a.len() >= cols)
}

/// Portable kernel: each value dequantized as `s·q + b`, then multiplied into
/// one f32 sum per token.
pub(crate) fn rows_scalar(layout: MlxLayout, rows: &MlxRowsData, acts: &[&[f32]], out: &mut [f32]) {
    let n = acts.len().max(1);
    let bits = layout.bits as usize;
    let mask = (1u64 << bits) - 1;
    let group_bytes = layout.group * bits / 8;
    for (r, o) in (0..rows.n_rows()).zip(out.chunks_exact_mut(n)) {
        let (data, scales, biases) = rows.row(r);
        let mut acc = [0f32; 4];
        for (g, raw) in data.chunks_exact(group_bytes.max(1)).enumerate() {
            let (s, b) = (layout.scales.read(scales, g), layout.scales.read(biases, g));
            for (c, bytes) in raw.chunks_exact(bits).enumerate() {
                let mut window = [0u8; 8];
                window[..bits].copy_from_slice(bytes);
                let word = u64::from_le_bytes(window);
                let col = g * layout.group + c * 8;
                for k in 0..8 {
                    let w = s * ((word >> (k * bits)) & mask) as f32 + b;
                    for (a, x) in acc.iter_mut().zip(acts) {
                        *a += w * x.get(col + k).copied().unwrap_or(0.0);
                    }
                }
            }
        }
        o.copy_from_slice(&acc[..n]);
    }
}

/// Per width: for each of the eight 32-bit lanes (value `k`), the two bytes of
/// the window holding value `k` (byte index, or 0x80 for a zero byte) and the
/// shift that brings the value down to bit 0.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
struct Unpack<const BITS: u32>;

#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
impl<const BITS: u32> Unpack<BITS> {
    /// Byte picks, four per lane: `[off, off + 1, zero, zero]` (`off = bits·k / 8`).
    const PICK: [u8; 32] = {
        let mut t = [0x80u8; 32];
        let mut k = 0;
        while k < 8 {
            let off = (BITS as usize * k) / 8;
            t[4 * k] = off as u8;
            // The second byte is needed only when the value crosses a byte (never at 8 bits).
            if off + 1 < 8 {
                t[4 * k + 1] = (off + 1) as u8;
            }
            k += 1;
        }
        t
    };
    /// Right shift of each lane.
    const SHIFT: [i32; 8] = {
        let mut t = [0i32; 8];
        let mut k = 0;
        while k < 8 {
            t[k] = ((BITS as usize * k) % 8) as i32;
            k += 1;
        }
        t
    };
    /// The value mask.
    const MASK: u32 = (1u32 << BITS) - 1;
}

/// `$kernel::<BITS, N>(layout, rows, acts, out)` for the layout's width and the
/// tile's size (1..=4 tokens), inside the caller's `unsafe` block.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(unused_macros)
)]
macro_rules! by_bits_and_tile {
    ($kernel:ident; $layout:expr, $rows:expr, $acts:expr, $out:expr) => {{
        macro_rules! tiles {
            ($b:literal) => {
                match $acts.len() {
                    1 => $kernel::<$b, 1>($layout, $rows, $acts, $out),
                    2 => $kernel::<$b, 2>($layout, $rows, $acts, $out),
                    3 => $kernel::<$b, 3>($layout, $rows, $acts, $out),
                    _ => $kernel::<$b, 4>($layout, $rows, $acts, $out),
                }
            };
        }
        match $layout.bits {
            1 => tiles!(1),
            2 => tiles!(2),
            3 => tiles!(3),
            4 => tiles!(4),
            5 => tiles!(5),
            6 => tiles!(6),
            8 => tiles!(8),
            _ => rows_scalar($layout, $rows, $acts, $out),
        }
    }};
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 + FMA + F16C.
    //!
    //! # Safety (every `unsafe fn` below)
    //! The caller must run on a CPU with AVX2, FMA and F16C and pass arguments
    //! that [`super::fits`] accepted.

    use std::arch::x86_64::*;

    use super::{MlxLayout, MlxRowsData, ScaleKind, Unpack, fits, rows_scalar};
    use crate::native::x86::hsum;

    /// Value `g` of a row's scale (or bias) array at `p`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_at(kind: ScaleKind, p: *const u8, g: usize) -> f32 {
        // SAFETY: `fits` checked that the row holds a scale and a bias per group.
        unsafe {
            match kind {
                ScaleKind::F16 => {
                    let h = p.add(2 * g).cast::<u16>().read_unaligned();
                    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
                }
                ScaleKind::BF16 => {
                    f32::from_bits((p.add(2 * g).cast::<u16>().read_unaligned() as u32) << 16)
                }
                ScaleKind::F32 => p.add(4 * g).cast::<f32>().read_unaligned(),
            }
        }
    }

    /// The eight values of the `BITS`-byte chunk at byte `off` of `data` (of which
    /// `avail` bytes are readable) as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values8<const BITS: u32>(data: *const u8, avail: usize, off: usize) -> __m256 {
        // SAFETY: the 8-byte load stays inside `avail` (near the end the chunk is
        // copied into a local window first); the tables are 32 bytes.
        unsafe {
            let mut window = [0u8; 8];
            let p = if off + 8 <= avail {
                data.add(off)
            } else {
                std::ptr::copy_nonoverlapping(data.add(off), window.as_mut_ptr(), BITS as usize);
                window.as_ptr()
            };
            let bytes = _mm_loadl_epi64(p as *const __m128i);
            let q = if BITS == 8 {
                _mm256_cvtepu8_epi32(bytes)
            } else {
                // Both 128-bit halves hold the window; lane k gets its two bytes,
                // shifted down and masked.
                let both = _mm256_broadcastq_epi64(bytes);
                let pick = _mm256_loadu_si256(Unpack::<BITS>::PICK.as_ptr() as *const __m256i);
                let shift = _mm256_loadu_si256(Unpack::<BITS>::SHIFT.as_ptr() as *const __m256i);
                let v = _mm256_srlv_epi32(_mm256_shuffle_epi8(both, pick), shift);
                _mm256_and_si256(v, _mm256_set1_epi32(Unpack::<BITS>::MASK as i32))
            };
            _mm256_cvtepi32_ps(q)
        }
    }

    /// Every row of `rows` × the tile of `N` tokens, `BITS` fixed.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_n<const BITS: u32, const N: usize>(
        layout: MlxLayout,
        rows: &MlxRowsData,
        acts: &[&[f32]],
        out: &mut [f32],
    ) {
        // SAFETY: `fits` proved every row holds whole groups with their scales and
        // biases, every activation row a value per column, and `out` a value per
        // row and token; `values8` keeps its loads inside `rows.data`.
        unsafe {
            let (rb, sb) = (rows.row_bytes, rows.scale_row_bytes);
            let chunks_per_group = layout.group / 8;
            let n_groups = rb / (BITS as usize * chunks_per_group);
            let avail = rows.data.len();
            let data = rows.data.as_ptr();
            let x: [*const f32; N] = std::array::from_fn(|t| acts.get_unchecked(t).as_ptr());
            for r in 0..rows.n_rows() {
                let (sp, bp) = (
                    rows.scales.as_ptr().add(r * sb),
                    rows.biases.as_ptr().add(r * sb),
                );
                let mut even = [_mm256_setzero_ps(); N];
                let mut odd = [_mm256_setzero_ps(); N];
                for g in 0..n_groups {
                    let s = _mm256_set1_ps(scale_at(layout.scales, sp, g));
                    let b = _mm256_set1_ps(scale_at(layout.scales, bp, g));
                    for k in (0..chunks_per_group).step_by(2) {
                        let i = g * chunks_per_group + k;
                        let off = r * rb + i * BITS as usize;
                        // The weights themselves: s·q + b.
                        let w0 = _mm256_fmadd_ps(values8::<BITS>(data, avail, off), s, b);
                        let w1 = _mm256_fmadd_ps(
                            values8::<BITS>(data, avail, off + BITS as usize),
                            s,
                            b,
                        );
                        for t in 0..N {
                            let xt = x[t].add(8 * i);
                            even[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt), even[t]);
                            odd[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt.add(8)), odd[t]);
                        }
                    }
                }
                for t in 0..N {
                    *out.get_unchecked_mut(r * N + t) = hsum(_mm256_add_ps(even[t], odd[t]));
                }
            }
        }
    }

    /// Rows × a tile of 1..=4 f32 token rows (the portable kernel on a call it
    /// cannot prove in bounds).
    pub(crate) fn rows(layout: MlxLayout, rows: &MlxRowsData, acts: &[&[f32]], out: &mut [f32]) {
        if !fits(layout, rows, acts, out) {
            return rows_scalar(layout, rows, acts, out);
        }
        // SAFETY: the dispatch hands this function out only on hosts with AVX2, FMA
        // and F16C, and `fits` accepted the arguments.
        unsafe { by_bits_and_tile!(rows_n; layout, rows, acts, out) }
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    //! NEON (base aarch64).
    //!
    //! # Safety (every `unsafe fn` below)
    //! The caller passes arguments that [`super::fits`] accepted.

    use std::arch::aarch64::*;

    use super::{MlxLayout, MlxRowsData, ScaleKind, Unpack, fits, rows_scalar};

    /// Value `g` of a row's scale (or bias) array at `p`.
    #[inline(always)]
    unsafe fn scale_at(kind: ScaleKind, p: *const u8, g: usize) -> f32 {
        // SAFETY: `fits` checked that the row holds a scale and a bias per group.
        unsafe {
            match kind {
                ScaleKind::F16 => {
                    half::f16::from_bits(p.add(2 * g).cast::<u16>().read_unaligned()).to_f32()
                }
                ScaleKind::BF16 => {
                    f32::from_bits((p.add(2 * g).cast::<u16>().read_unaligned() as u32) << 16)
                }
                ScaleKind::F32 => p.add(4 * g).cast::<f32>().read_unaligned(),
            }
        }
    }

    /// The eight values of the chunk at byte `off` of `data` (`avail` bytes
    /// readable) as two f32 vectors (values 0..4, 4..8).
    #[inline(always)]
    unsafe fn values8<const BITS: u32>(
        data: *const u8,
        avail: usize,
        off: usize,
    ) -> (float32x4_t, float32x4_t) {
        // SAFETY: the 8-byte load stays inside `avail` (near the end the chunk is
        // copied into a local window first); the tables are 32 bytes.
        unsafe {
            let mut window = [0u8; 8];
            let p = if off + 8 <= avail {
                data.add(off)
            } else {
                std::ptr::copy_nonoverlapping(data.add(off), window.as_mut_ptr(), BITS as usize);
                window.as_ptr()
            };
            let bytes = vcombine_u8(vld1_u8(p), vdup_n_u8(0));
            let pick = Unpack::<BITS>::PICK.as_ptr();
            let shift = Unpack::<BITS>::SHIFT.as_ptr();
            let mask = vdupq_n_u32(Unpack::<BITS>::MASK);
            let lane = |h: usize| {
                // Lanes 4h..4h+4: their bytes, shifted right (a negative left shift), masked.
                let v = vreinterpretq_u32_u8(vqtbl1q_u8(bytes, vld1q_u8(pick.add(16 * h))));
                let neg = vnegq_s32(vld1q_s32(shift.add(4 * h)));
                vcvtq_f32_u32(vandq_u32(vshlq_u32(v, neg), mask))
            };
            (lane(0), lane(1))
        }
    }

    /// Every row of `rows` × the tile of `N` tokens, `BITS` fixed.
    #[inline(always)]
    unsafe fn rows_n<const BITS: u32, const N: usize>(
        layout: MlxLayout,
        rows: &MlxRowsData,
        acts: &[&[f32]],
        out: &mut [f32],
    ) {
        // SAFETY: `fits` proved every row holds whole groups with their scales and
        // biases, every activation row a value per column, and `out` a value per
        // row and token; `values8` keeps its loads inside `rows.data`.
        unsafe {
            let (rb, sb) = (rows.row_bytes, rows.scale_row_bytes);
            let chunks_per_group = layout.group / 8;
            let n_groups = rb / (BITS as usize * chunks_per_group);
            let avail = rows.data.len();
            let data = rows.data.as_ptr();
            let x: [*const f32; N] = std::array::from_fn(|t| acts.get_unchecked(t).as_ptr());
            for r in 0..rows.n_rows() {
                let (sp, bp) = (
                    rows.scales.as_ptr().add(r * sb),
                    rows.biases.as_ptr().add(r * sb),
                );
                let mut lo = [vdupq_n_f32(0.0); N];
                let mut hi = [vdupq_n_f32(0.0); N];
                for g in 0..n_groups {
                    let s = vdupq_n_f32(scale_at(layout.scales, sp, g));
                    let b = vdupq_n_f32(scale_at(layout.scales, bp, g));
                    for k in 0..chunks_per_group {
                        let i = g * chunks_per_group + k;
                        let (q0, q1) = values8::<BITS>(data, avail, r * rb + i * BITS as usize);
                        // The weights themselves: s·q + b.
                        let (w0, w1) = (vfmaq_f32(b, q0, s), vfmaq_f32(b, q1, s));
                        for t in 0..N {
                            let xt = x[t].add(8 * i);
                            lo[t] = vfmaq_f32(lo[t], w0, vld1q_f32(xt));
                            hi[t] = vfmaq_f32(hi[t], w1, vld1q_f32(xt.add(4)));
                        }
                    }
                }
                for t in 0..N {
                    *out.get_unchecked_mut(r * N + t) = vaddvq_f32(vaddq_f32(lo[t], hi[t]));
                }
            }
        }
    }

    /// Rows × a tile of 1..=4 f32 token rows (the portable kernel on a call it
    /// cannot prove in bounds).
    pub(crate) fn rows(layout: MlxLayout, rows: &MlxRowsData, acts: &[&[f32]], out: &mut [f32]) {
        if !fits(layout, rows, acts, out) {
            return rows_scalar(layout, rows, acts, out);
        }
        // SAFETY: NEON is part of every aarch64 CPU, and `fits` accepted the arguments.
        unsafe { by_bits_and_tile!(rows_n; layout, rows, acts, out) }
    }
}

impl NativeKernels {
    /// `out = W·x` for an MLX weight with the format's numerics: fused
    /// dequantize×dot against the f32 activations, rows split across the pool.
    pub(super) fn matmul_mlx_f32(
        &self,
        w: &Weight,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let Some(layout) = supports(w.format) else {
            return Err(KernelError::UnsupportedFormat {
                tensor: String::new(),
                format: w.format.to_string(),
            });
        };
        let (Some(scales), Some(biases)) = (w.scales, w.biases) else {
            return Err(KernelError::UnsupportedFormat {
                tensor: String::new(),
                format: format!("{} without scales and biases", w.format),
            });
        };
        let (rb, sb) = (w.row_bytes(), w.scale_row_bytes());
        let kernel = rows_for_level(self.level());
        // Each call gets whole rows of the packed data, and finds their scales and
        // biases from the rows' position.
        let base = w.data.as_ptr() as usize;
        self.for_rows(w, x, w.cols, n_tokens, out, |rows, tile, o| {
            let r0 = (rows.as_ptr() as usize - base) / rb.max(1);
            let n = rows.len() / rb.max(1);
            let span = r0 * sb..(r0 + n) * sb;
            let data = MlxRowsData {
                data: rows,
                scales: scales.get(span.clone()).unwrap_or(&[]),
                biases: biases.get(span).unwrap_or(&[]),
                row_bytes: rb,
                scale_row_bytes: sb,
            };
            kernel(layout, &data, tile, o)
        });
        Ok(())
    }
}
