//! Fused kernels for MLX affine 4- and 8-bit weights (`w = s·q + b` per group).
//!
//! The activations are quantized once per call to Q8 blocks of 32 (`d·a`, with
//! `s_a = f16(d·Σa)` as ggml's Q8_1 stores it), so each 32-value block of a row is
//! one integer dot. With `q` the block's unsigned values and `(s, b)` its group's
//! scale and bias:
//!
//! ```text
//! Σ w·x ≈ s·d·Σ q·a + b·s_a                        (unsigned path)
//!       = s·d·Σ (q − 2^(bits−1))·a + (b + 2^(bits−1)·s)·s_a   (centred path)
//! ```
//!
//! The two are the same sum; each width takes the one that makes the kernel
//! compute exactly ggml's dot where the MLX layout *is* a GGML format (what
//! `mlx.core.load` makes of a GGUF):
//! - 4-bit, group 32 is Q4_1 (`d = s`, `m = b`): the unsigned path, `s·d·Σq·a`
//!   per block plus `m·s_a`, as `ggml_vec_dot_q4_1_q8_1`. (A Q4_0 copy has
//!   `b = −8·s` and gives the same sum up to the f16 rounding of `s_a`; a Q4_1
//!   group can have `b = −8·s` too, so the two cannot be told apart.)
//! - 8-bit, group 32 with `b = −128·s` is Q8_0: the centred path, whose leftover
//!   bias `b + 128·s` is then exactly 0, leaving `ggml_vec_dot_q8_0_q8_0`.
//!   8-bit weights always take the centred path (unsigned 8-bit values would
//!   overflow `maddubs`' 16-bit pair sums).
//!
//! The SIMD versions keep ggml's AVX2 lane structure (one 8-lane f32
//! accumulator, `fmadd` of the block's scale product, the bias terms summed
//! apart with an FMA each, one horizontal sum), so a converted Q4_1/Q8_0 row
//! gives llama.cpp's numbers bit for bit at every x86 level (the x86 one-token
//! kernels take two rows at a time, every row's lanes still the same sums in the
//! same order); the scalar version
//! sums block by block like ggml's generic code. Groups must be whole multiples
//! of 32 values (MLX's 32, 64 and 128); other widths and groups decode the row
//! instead (see [`supports`]).

use std::cell::RefCell;

use flatrun_format::{DType, GgmlType};
use half::{bf16, f16};

use super::NativeKernels;
use super::quantize::{BlockQ8, QK8, quantize_q8};
use crate::weight::WeightFormat;
use crate::{KernelError, SimdLevel, Weight};

/// How one MLX tensor is laid out, as the kernels need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MlxLayout {
    /// 4 or 8.
    pub bits: u32,
    /// Values per scale/bias pair, a multiple of 32.
    pub group: usize,
    /// Storage of the scales and biases.
    pub scales: ScaleKind,
}

/// Storage type of MLX scales and biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ScaleKind {
    F16,
    BF16,
    F32,
}

impl ScaleKind {
    /// Value `i` of a little-endian array of this type (`bytes` holds at least `i + 1`).
    #[inline(always)]
    pub(crate) fn read(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            ScaleKind::F16 => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            ScaleKind::BF16 => bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            ScaleKind::F32 => f32::from_le_bytes([
                bytes[4 * i],
                bytes[4 * i + 1],
                bytes[4 * i + 2],
                bytes[4 * i + 3],
            ]),
        }
    }
}

/// The fused layout of `format`, or `None` when it has no fused kernel
/// (other bit widths, groups that are not whole Q8 blocks, odd scale dtypes).
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
    let fused = matches!(bits, 4 | 8) && group > 0 && group.is_multiple_of(QK8);
    fused.then_some(MlxLayout {
        bits: bits as u32,
        group,
        scales,
    })
}

/// Weight rows (`rows.len() / row_bytes` of them, with their scales and biases)
/// × a tile of 1..=4 Q8 token rows; writes `out[r * acts.len() + t]`.
pub(crate) type MlxRows = fn(MlxLayout, &MlxRowsData, &[&[BlockQ8]], &mut [f32]);

/// A group of whole rows of one MLX weight.
pub(crate) struct MlxRowsData<'a> {
    /// Packed values, `row_bytes` per row.
    pub data: &'a [u8],
    /// Scales, `scale_row_bytes` per row.
    pub scales: &'a [u8],
    /// Biases, `scale_row_bytes` per row.
    pub biases: &'a [u8],
    pub row_bytes: usize,
    pub scale_row_bytes: usize,
}

impl MlxRowsData<'_> {
    /// Number of whole rows held (0 when a part is short).
    pub(crate) fn n_rows(&self) -> usize {
        if self.row_bytes == 0 || self.scale_row_bytes == 0 {
            return 0;
        }
        (self.data.len() / self.row_bytes)
            .min(self.scales.len() / self.scale_row_bytes)
            .min(self.biases.len() / self.scale_row_bytes)
    }

    /// Row `r`: its packed values, scales and biases.
    pub(crate) fn row(&self, r: usize) -> (&[u8], &[u8], &[u8]) {
        let (rb, sb) = (self.row_bytes, self.scale_row_bytes);
        (
            &self.data[r * rb..(r + 1) * rb],
            &self.scales[r * sb..(r + 1) * sb],
            &self.biases[r * sb..(r + 1) * sb],
        )
    }

    /// Whether a SIMD kernel may index this call without checks: every row is
    /// whole groups with a scale and a bias per group, 1..=4 activation rows
    /// each hold a Q8 block per 32 values of a row, and `out` has a value per
    /// row and token. (The SIMD kernels run the portable one otherwise.)
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(dead_code)
    )]
    pub(crate) fn fits(&self, layout: MlxLayout, acts: &[&[BlockQ8]], out: &[f32]) -> bool {
        let block_bytes = QK8 * layout.bits as usize / 8;
        let group_bytes = block_bytes * (layout.group / QK8);
        let n_groups = self.row_bytes / group_bytes.max(1);
        let need_blocks = self.row_bytes / block_bytes.max(1);
        group_bytes > 0
            && self.row_bytes.is_multiple_of(group_bytes)
            && self.scale_row_bytes >= n_groups * layout.scales.size()
            && (1..=4).contains(&acts.len())
            && out.len() >= self.n_rows() * acts.len()
            && acts.iter().all(|a| a.len() >= need_blocks)
    }
}

/// The kernel for `level` (which the caller has checked the host supports).
pub(crate) fn rows_for_level(level: SimdLevel) -> MlxRows {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 | SimdLevel::Avx512 => x86::avx2::rows,
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512Vnni => x86::vnni::rows,
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon => super::arm::neon::rows_mlx,
        #[cfg(target_arch = "aarch64")]
        SimdLevel::NeonDot => super::arm::dotprod::rows_mlx,
        _ => rows_scalar,
    }
}

thread_local! {
    /// Caller-side quantized activations, reused across calls.
    static ACTS: RefCell<Vec<BlockQ8>> = const { RefCell::new(Vec::new()) };
}

impl NativeKernels {
    /// `out = W·x` for an MLX 4/8-bit weight: quantize the activations once, then
    /// fused integer dots over rows split across the pool.
    pub(super) fn matmul_mlx(
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
        let (scales, biases) = match (w.scales, w.biases) {
            (Some(s), Some(b)) => (s, b),
            _ => {
                return Err(KernelError::UnsupportedFormat {
                    tensor: String::new(),
                    format: format!("{} without scales and biases", w.format),
                });
            }
        };
        let cols = w.cols;
        let (rb, sb) = (w.row_bytes(), w.scale_row_bytes());
        let kernel = rows_for_level(self.level());

        // Quantize every token's activations once, into the reused buffer.
        let mut acts = ACTS.with(|c| c.take());
        acts.clear();
        acts.resize(n_tokens * cols / QK8, BlockQ8::default());
        quantize_q8(x, &mut acts);

        // Rows split over the pool; each call gets whole rows of the packed data,
        // and finds their scales and biases from the rows' position.
        let base = w.data.as_ptr() as usize;
        self.for_rows(w, &acts, cols / QK8, n_tokens, out, |rows, tile, o| {
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
        ACTS.with(|c| c.replace(acts));
        Ok(())
    }
}

/// `2^(bits−1)`: the centre that makes the values signed.
#[inline(always)]
pub(crate) fn centre(bits: u32) -> i32 {
    1 << (bits - 1)
}

/// Value `j` (0..32) of the 32-value block at `blk` (4 bits: two per byte, low nibble first).
#[inline(always)]
fn value(bits: u32, blk: &[u8], j: usize) -> i32 {
    if bits == 4 {
        ((blk[j / 2] >> (4 * (j % 2))) & 0xF) as i32
    } else {
        blk[j] as i32
    }
}

/// Portable kernel: the same integer dots one value at a time, summed block by block.
pub(crate) fn rows_scalar(
    layout: MlxLayout,
    rows: &MlxRowsData,
    acts: &[&[BlockQ8]],
    out: &mut [f32],
) {
    let n = acts.len().max(1);
    let block_bytes = QK8 * layout.bits as usize / 8;
    let blocks_per_group = layout.group / QK8;
    let c = centre(layout.bits);
    for (r, o) in (0..rows.n_rows()).zip(out.chunks_exact_mut(n)) {
        let (data, scales, biases) = rows.row(r);
        for (a, o) in acts.iter().zip(o.iter_mut()) {
            let mut sum = 0f32;
            for (i, (blk, ab)) in data.chunks_exact(block_bytes).zip(a.iter()).enumerate() {
                let g = i / blocks_per_group;
                let (s, b) = (layout.scales.read(scales, g), layout.scales.read(biases, g));
                // 8-bit values are centred (Q8_0's dot), 4-bit ones used as they are (Q4_1's).
                let centred = layout.bits == 8;
                let shift = if centred { c } else { 0 };
                let sumi: i32 = (0..QK8)
                    .map(|j| (value(layout.bits, blk, j) - shift) * ab.qs[j] as i32)
                    .sum();
                // The bias left after centring (0 for a Q8_0 copy), times Σ of the activations.
                let rest = if centred { b + c as f32 * s } else { b };
                sum += s * ab.d * sumi as f32 + rest * ab.s;
            }
            *o = sum;
        }
    }
}

/// `$kernel::<BITS, $c…, N>(layout, rows, acts, out)` for the layout's width
/// (4 or 8) and the tile's size (1..=4 tokens): the SIMD kernels' const-generic
/// instantiations, or the portable kernel for another width. Expands to calls
/// of the `unsafe fn` `$kernel`, inside the caller's `unsafe` block.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(unused_macros)
)]
macro_rules! by_bits_and_tile {
    ($kernel:ident $(, $c:expr)*; $layout:expr, $rows:expr, $acts:expr, $out:expr) => {{
        let (layout, rows, acts, out) = ($layout, $rows, $acts, $out);
        match (layout.bits, acts.len()) {
            (4, 1) => $kernel::<4, $($c,)* 1>(layout, rows, acts, out),
            (4, 2) => $kernel::<4, $($c,)* 2>(layout, rows, acts, out),
            (4, 3) => $kernel::<4, $($c,)* 3>(layout, rows, acts, out),
            (4, _) => $kernel::<4, $($c,)* 4>(layout, rows, acts, out),
            (8, 1) => $kernel::<8, $($c,)* 1>(layout, rows, acts, out),
            (8, 2) => $kernel::<8, $($c,)* 2>(layout, rows, acts, out),
            (8, 3) => $kernel::<8, $($c,)* 3>(layout, rows, acts, out),
            (8, _) => $kernel::<8, $($c,)* 4>(layout, rows, acts, out),
            _ => $crate::native::mlx_affine::rows_scalar(layout, rows, acts, out),
        }
    }};
}
// (By path for `arm_mlx.rs`; the x86 kernels below see the macro in scope.)
#[cfg_attr(not(target_arch = "aarch64"), allow(unused_imports))]
pub(crate) use by_bits_and_tile;

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 (`maddubs`) and AVX-512 VNNI (`vpdpbusd`) versions.
    //!
    //! # Safety (every `unsafe fn` below)
    //! The caller must run on a CPU with the module's target features and pass a
    //! row of whole groups with its scales and biases, and 1..=4 activation rows
    //! holding at least one Q8 block per 32 values of the row (checked by `rows`).

    use std::arch::x86_64::*;

    /// `Σ` of 4-byte groups of `u8 × i8` products, AVX2: `maddubs` then `madd` with ones.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mul_sum_maddubs(ax: __m256i, sy: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
    }

    /// The same with one VNNI instruction.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn mul_sum_vnni(ax: __m256i, sy: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy)
    }

    thread_local! {
        /// Per thread: the one-token activations with each block's even values first
        /// (`gemv4_pairs`), reused across calls.
        pub(super) static SPLIT_ACTS: std::cell::RefCell<Vec<[u8; 64]>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }

    /// The one-token kernels prefetch the packed values of a row pair like the legacy
    /// formats' GEMV: one linear stream [`PREFETCH_AHEAD`] (4 KiB) ahead
    /// (`native/x86.rs`, where the distance was measured). The hardware prefetcher alone
    /// keeps too few lines in flight behind a kernel that spends several cycles per line.
    pub(super) use crate::native::x86::{PREFETCH_AHEAD, prefetch_linear};

    /// Prefetch (into L1) the line `ahead` bytes past `pos`. A hint only: it never faults,
    /// and changes no value.
    #[inline(always)]
    fn prefetch(pos: *const u8, ahead: usize) {
        // SAFETY: `prefetcht0` reads no architectural state and cannot fault, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(pos.wrapping_add(ahead) as *const i8) }
    }

    /// How far ahead of a row pair's scales (or biases) to prefetch them: as many rows ahead
    /// as [`prefetch`] runs ahead in the values (`row_bytes` of values, `scale_row_bytes` of
    /// scales per row).
    pub(super) fn scales_ahead(row_bytes: usize, scale_row_bytes: usize) -> usize {
        PREFETCH_AHEAD / row_bytes.max(1) * scale_row_bytes
    }

    /// Prefetch the scales and biases of the row pair starting at `scales`/`biases`
    /// (`pair_bytes` each), `ahead` bytes on ([`scales_ahead`]): one line per 64 bytes of the
    /// pair. Consecutive pairs' windows tile the arrays, so every line is asked for once.
    /// A hint only, as [`prefetch`].
    #[inline(always)]
    pub(super) fn prefetch_scales(
        scales: *const u8,
        biases: *const u8,
        pair_bytes: usize,
        ahead: usize,
    ) {
        for k in 0..pair_bytes.div_ceil(64) {
            prefetch(scales, ahead + 64 * k);
            prefetch(biases, ahead + 64 * k);
        }
    }

    macro_rules! mlx_kernels {
        ($level:ident, $features:literal, $mul_sum:path) => {
            pub(crate) mod $level {
                use std::arch::x86_64::*;

                use super::super::{centre, rows_scalar, MlxLayout, MlxRowsData, ScaleKind};
                use super::{prefetch_linear, prefetch_scales, scales_ahead, SPLIT_ACTS};
                use crate::native::x86::{high_nibbles, hsum, hsum128, pair_halves};
                use crate::native::quantize::{BlockQ8, QK8};

                /// The 32 values of a block as unsigned bytes, in value order.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn unpack<const BITS: u32>(p: *const u8) -> __m256i {
                    // SAFETY: the caller upholds this function's safety contract (its
                    // `# Safety` section or the module's), which every unsafe operation
                    // below relies on.
                    unsafe {
                        if BITS == 4 {
                            // Byte j holds values 2j (low nibble) and 2j+1: interleave the nibbles.
                            let b = _mm_loadu_si128(p as *const __m128i);
                            let m = _mm_set1_epi8(0x0F);
                            let lo = _mm_and_si128(b, m);
                            let hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
                            _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi))
                        } else {
                            _mm256_loadu_si256(p as *const __m256i)
                        }
                    }
                }

                /// Scale (or bias) `g` of a row's little-endian array.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn scale_at(kind: ScaleKind, p: *const u8, g: usize) -> f32 {
                    // SAFETY: the caller upholds this function's safety contract (its
                    // `# Safety` section or the module's), which every unsafe operation
                    // below relies on.
                    unsafe {
                        match kind {
                            ScaleKind::F16 => {
                                let bits = u16::from_le_bytes([*p.add(2 * g), *p.add(2 * g + 1)]);
                                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
                            }
                            ScaleKind::BF16 => {
                                let bits = u16::from_le_bytes([*p.add(2 * g), *p.add(2 * g + 1)]);
                                f32::from_bits((bits as u32) << 16)
                            }
                            ScaleKind::F32 => f32::from_le_bytes([
                                *p.add(4 * g),
                                *p.add(4 * g + 1),
                                *p.add(4 * g + 2),
                                *p.add(4 * g + 3),
                            ]),
                        }
                    }
                }

                /// Scale and bias `g` of two rows (arrays at `s0`, `b0` and `s1`, `b1`) as
                /// `[s0, b0, s1, b1]`: for 16-bit storage the four values in one zero-extending
                /// 64-bit move, then one `vcvtph2ps` (f16) or one interleave with zeros (bf16 is
                /// the top half of an f32).
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn pair_scales(
                    kind: ScaleKind,
                    [s0, b0, s1, b1]: [*const u8; 4],
                    g: usize,
                ) -> __m128 {
                    // SAFETY: the caller upholds this function's safety contract (its
                    // `# Safety` section or the module's), which every unsafe operation
                    // below relies on.
                    unsafe {
                        let half = |p: *const u8| u16::from_le_bytes([*p.add(2 * g), *p.add(2 * g + 1)]) as u64;
                        let single = |p: *const u8| scale_at(ScaleKind::F32, p, g);
                        if kind == ScaleKind::F32 {
                            return _mm_set_ps(single(b1), single(s1), single(b0), single(s0));
                        }
                        let bits = half(s0) | (half(b0) << 16) | (half(s1) << 32) | (half(b1) << 48);
                        // SAFETY: this module's functions run with AVX2 (see `vmovq_to_xmm`).
                        let v = crate::native::x86::vmovq_to_xmm(bits);
                        if kind == ScaleKind::F16 {
                            _mm_cvtph_ps(v)
                        } else {
                            _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), v))
                        }
                    }
                }

                /// One row × a tile of `N` Q8 token rows.
                #[target_feature(enable = $features)]
                unsafe fn row_n<const BITS: u32, const N: usize>(
                    layout: MlxLayout,
                    row: &[u8],
                    scales: *const u8,
                    biases: *const u8,
                    acts: &[&[BlockQ8]],
                    out: &mut [f32],
                ) {
                    // SAFETY: the caller upholds this function's safety contract (its
                    // `# Safety` section or the module's), which every unsafe operation
                    // below relies on.
                    unsafe {
                        let block_bytes = QK8 * BITS as usize / 8;
                        let blocks_per_group = layout.group / QK8;
                        let n_groups = row.len() / (block_bytes * blocks_per_group);
                        let c = centre(BITS);
                        let centre_bytes = _mm256_set1_epi8(c as u8 as i8);
                        let mut acc = [_mm256_setzero_ps(); N];
                        let mut bias_terms = [0f32; N];
                        for g in 0..n_groups {
                            let s = scale_at(layout.scales, scales, g);
                            let b = scale_at(layout.scales, biases, g);
                            // 8-bit values are centred (Q8_0's dot), 4-bit ones used as they
                            // are (Q4_1's); the bias left after centring is 0 for a Q8_0 copy.
                            let centred = BITS == 8;
                            let rest = if centred { b + c as f32 * s } else { b };
                            for k in 0..blocks_per_group {
                                let i = g * blocks_per_group + k;
                                let q = unpack::<BITS>(row.as_ptr().add(i * block_bytes));
                                if centred {
                                    // Signed values; |q| against sign-adjusted activations (ggml's trick).
                                    let qs = _mm256_sub_epi8(q, centre_bytes);
                                    let ax = _mm256_sign_epi8(qs, qs);
                                    for t in 0..N {
                                        let a = acts.get_unchecked(t).get_unchecked(i);
                                        let ay = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                                        let p =
                                            _mm256_cvtepi32_ps($mul_sum(ax, _mm256_sign_epi8(ay, qs)));
                                        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(s * a.d), p, acc[t]);
                                        if rest != 0.0 {
                                            bias_terms[t] = rest.mul_add(a.s, bias_terms[t]);
                                        }
                                    }
                                } else {
                                    // Unsigned 4-bit values straight into `maddubs` (Q4_1).
                                    for t in 0..N {
                                        let a = acts.get_unchecked(t).get_unchecked(i);
                                        let ay = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                                        let p = _mm256_cvtepi32_ps($mul_sum(q, ay));
                                        // ggml's `summs += m·s`, which GCC contracts to an FMA.
                                        bias_terms[t] = rest.mul_add(a.s, bias_terms[t]);
                                        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(s * a.d), p, acc[t]);
                                    }
                                }
                            }
                        }
                        for t in 0..N {
                            out[t] = hsum(acc[t]) + bias_terms[t];
                        }
                    }
                }

                /// Row `r`'s scales and biases and row `r + 1`'s, as [`pair_scales`] takes them.
                #[inline(always)]
                unsafe fn pair_scale_ptrs(rows: &MlxRowsData, r: usize) -> [*const u8; 4] {
                    // SAFETY: the caller upholds this function's safety contract (its
                    // `# Safety` section or the module's), which every unsafe operation
                    // below relies on.
                    unsafe {
                        let sb = rows.scale_row_bytes;
                        let (s0, b0) = (rows.scales.as_ptr().add(r * sb), rows.biases.as_ptr().add(r * sb));
                        [s0, b0, s0.add(sb), b0.add(sb)]
                    }
                }

                /// The last row of an odd group through the token-tiled kernel.
                #[inline(always)]
                unsafe fn last_row<const BITS: u32>(
                    layout: MlxLayout,
                    rows: &MlxRowsData,
                    acts: &[&[BlockQ8]],
                    out: &mut [f32],
                ) {
                    // SAFETY: the caller upholds this function's safety contract (its
                    // `# Safety` section or the module's), which every unsafe operation
                    // below relies on.
                    unsafe {
                        let n = rows.n_rows();
                        if n % 2 == 1 {
                            let (data, scales, biases) = rows.row(n - 1);
                            row_n::<BITS, 1>(layout, data, scales.as_ptr(), biases.as_ptr(), acts, &mut out[n - 1..n]);
                        }
                    }
                }

                /// `a`'s first `n_blocks` blocks with each block's even values apart from its odd
                /// ones, each half in both 128-bit lanes: bytes j and 16 + j of `split[i]` are
                /// value 2j of block i, bytes 32 + j and 48 + j its value 2j + 1 (the order of an
                /// MLX row's low and high nibbles). Stored twice so the kernel's loads are plain
                /// 32-byte loads, not broadcasts (a shuffle µop each on Zen 3).
                #[target_feature(enable = $features)]
                unsafe fn split_even_odd(a: &[BlockQ8], n_blocks: usize, split: &mut Vec<[u8; 64]>) {
                    // SAFETY: the caller upholds this function's safety contract (its
                    // `# Safety` section or the module's), which every unsafe operation
                    // below relies on.
                    unsafe {
                        split.clear();
                        split.resize(n_blocks, [0; 64]);
                        // Within each 128-bit lane: its even bytes, then its odd ones.
                        let within = _mm256_setr_epi8(
                            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, //
                            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                        );
                        for (dst, ab) in split.iter_mut().zip(a) {
                            let v = _mm256_shuffle_epi8(_mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i), within);
                            // [even 0..16 | odd 0..16 | even 16..32 | odd 16..32] → [even | even], [odd | odd].
                            let even = _mm256_permute4x64_epi64(v, 0b10_00_10_00);
                            let odd = _mm256_permute4x64_epi64(v, 0b11_01_11_01);
                            _mm256_storeu_si256(dst.as_mut_ptr() as *mut __m256i, even);
                            _mm256_storeu_si256(dst.as_mut_ptr().add(32) as *mut __m256i, odd);
                        }
                    }
                }

                /// One token × every row of `rows`, 4-bit: adjacent row pairs, two pairs (four rows)
                /// per pass through [`gemv4_pair_runs`] (one activation load, one `d_a` broadcast
                /// and one prefetch stream for all four), then a last pair, then an odd last row
                /// through `row_n`. The group loop is unrolled for groups of 32, 64 and 128.
                #[target_feature(enable = $features)]
                unsafe fn gemv4_pairs(
                    layout: MlxLayout,
                    rows: &MlxRowsData,
                    acts: &[&[BlockQ8]],
                    out: &mut [f32],
                ) {
                    // SAFETY: the caller upholds this function's safety contract (its
                    // `# Safety` section or the module's), which every unsafe operation
                    // below relies on.
                    unsafe {
                        let mut split = SPLIT_ACTS.with(|c| c.take());
                        split_even_odd(acts.get_unchecked(0), rows.row_bytes / (QK8 / 2), &mut split);
                        let a = split.as_ptr() as *const u8;
                        let q8 = *acts.get_unchecked(0);
                        let n_pairs = rows.n_rows() / 2;
                        let bulk = n_pairs / 2 * 2;
                        macro_rules! runs {
                            ($g:literal) => {{
                                gemv4_pair_runs::<2, $g>(layout, rows, a, q8, 0..bulk, out);
                                gemv4_pair_runs::<1, $g>(layout, rows, a, q8, bulk..n_pairs, out);
                            }};
                        }
                        match layout.group / QK8 {
                            1 => runs!(1),
                            2 => runs!(2),
                            4 => runs!(4),
                            _ => runs!(0),
                        }
                        SPLIT_ACTS.with(|c| c.replace(split));
                        last_row::<4>(layout, rows, acts, out);
                    }
                }

                /// Most groups per row whose scales [`gemv4_pair_runs`] converts ahead of a pass
                /// (16 KiB of stack with two pairs; 32 768 columns at group 64); wider rows
                /// convert in the loop.
                const MAX_TABLE_GROUPS: usize = 512;

                /// Row pairs `pairs` (a multiple of `P` of them) of a 4-bit MLX weight × one token,
                /// `P` adjacent pairs per pass, `G` blocks per group (0: the layout's, at run time);
                /// `a` is the token's activations split by [`split_even_odd`], `q8` the same
                /// blocks (for `d_a` and `s_a`). Each output is bit for bit what `row_n::<4, 1>`
                /// gives (ggml's Q4_1 order), whose accumulator lane k sums `fma(s·d_a, Σq·a, ·)`
                /// over values 4k..4k+4 of each block:
                /// - a block's 16 bytes of a pair's first row go in the low 128 bits, the second
                ///   row's in the high. Byte j holds values 2j (low nibble) and 2j+1, so `maddubs`
                ///   of the low nibbles with the block's even activations gives
                ///   `q₄ₖa₄ₖ + q₄ₖ₊₂a₄ₖ₊₂` in 16-bit lane k, of the high nibbles with the odd
                ///   activations the other two products of lane k: their sum is lane k's exact
                ///   integer sum (at most 4·15·127, no overflow), with no byte shuffle of the
                ///   weights. The activations are split into even and odd values once per call;
                /// - the even 16-bit lanes (sign-extended by `madd` with 1) feed the `even`
                ///   accumulator, the odd ones (shifted down) the `odd` one: lane m of `even` is
                ///   the first row's lane 2m (m < 4) or the second's lane 2(m − 4), `odd` the
                ///   lanes 2m + 1, each the same chain of FMAs as in `row_n`;
                /// - at the end, interleaving `even` and `odd` gives each row's lanes 0..4 and
                ///   4..8 back, whose sum is `hsum`'s first step; the bias terms are the same
                ///   chain of FMAs (`b·s_a`, lanes 1 and 3 of `[s0, b0, s1, b1]`).
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn gemv4_pair_runs<const P: usize, const G: usize>(
                    layout: MlxLayout,
                    rows: &MlxRowsData,
                    a: *const u8,
                    q8: &[BlockQ8],
                    pairs: std::ops::Range<usize>,
                    out: &mut [f32],
                ) {
                    // SAFETY: the caller upholds this function's safety contract (its
                    // `# Safety` section or the module's), which every unsafe operation
                    // below relies on.
                    unsafe {
                        const BLOCK_BYTES: usize = QK8 / 2;
                        let (rb, sb) = (rows.row_bytes, rows.scale_row_bytes);
                        let blocks_per_group = if G == 0 { layout.group / QK8 } else { G };
                        let n_groups = rb / (BLOCK_BYTES * blocks_per_group);
                        let ahead = scales_ahead(rb, sb);
                        let nibble = _mm256_set1_epi8(0x0F);
                        let low_i16 = _mm256_set1_epi32(1);
                        // Lane 0 (s0) of `[s0, b0, s1, b1]` into lanes 0..4, lane 2 (s1) into 4..8.
                        let pick = _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0);
                        let mut table = [const { std::mem::MaybeUninit::<__m128>::uninit() }; 2 * MAX_TABLE_GROUPS];
                        let converted = P * n_groups <= table.len();
                        for first in pairs.step_by(P) {
                            // The `2P` rows of this pass are adjacent, and so are their scales and biases.
                            // (Plain loops fill the per-pair arrays: a closure would not inherit this
                            // function's target features, and its intrinsics would become calls.)
                            let r0 = rows.data.as_ptr().add(2 * first * rb);
                            let mut scales = [[std::ptr::null::<u8>(); 4]; P];
                            for q in 0..P {
                                scales[q] = pair_scale_ptrs(rows, 2 * (first + q));
                            }
                            prefetch_scales(scales[0][0], scales[0][1], 2 * P * sb, ahead);
                            // Every group's [s0, b0, s1, b1] of each pair, converted before the values'
                            // loop, where the eight scale and bias pointers would not fit in registers.
                            if converted {
                                for g in 0..n_groups {
                                    for q in 0..P {
                                        table.get_unchecked_mut(g * P + q).write(pair_scales(layout.scales, scales[q], g));
                                    }
                                }
                            }
                            let mut even = [_mm256_setzero_ps(); P];
                            let mut odd = [_mm256_setzero_ps(); P];
                            let mut bias_terms = [_mm_setzero_ps(); P];
                            for g in 0..n_groups {
                                // [s0, b0, s1, b1] of each pair for this group, converted once for its
                                // blocks, and its scales spread as [s0 ×4 | s1 ×4].
                                let (mut sb4, mut s8) = ([_mm_setzero_ps(); P], [_mm256_setzero_ps(); P]);
                                for q in 0..P {
                                    sb4[q] = if converted {
                                        table.get_unchecked(g * P + q).assume_init()
                                    } else {
                                        pair_scales(layout.scales, scales[q], g)
                                    };
                                    s8[q] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(sb4[q]), pick);
                                }
                                for k in 0..blocks_per_group {
                                    let i = g * blocks_per_group + k;
                                    // One linear prefetch stream over the pass's rows.
                                    prefetch_linear(r0.wrapping_add(2 * P * i * BLOCK_BYTES), 2 * P * BLOCK_BYTES);
                                    let ab = q8.get_unchecked(i);
                                    let a_even = _mm256_loadu_si256(a.add(64 * i) as *const __m256i);
                                    let a_odd = _mm256_loadu_si256(a.add(64 * i + 32) as *const __m256i);
                                    let da = _mm256_set1_ps(ab.d);
                                    let sa = _mm_set1_ps(ab.s);
                                    for q in 0..P {
                                        // Both rows' bytes: values 2j in the low nibbles, 2j + 1 in the high.
                                        // (The pair's second row follows its first in `rows.data`.)
                                        let b0 = r0.add(2 * q * rb + i * BLOCK_BYTES);
                                        let v = pair_halves(b0, b0.add(rb));
                                        let q_even = _mm256_and_si256(v, nibble);
                                        let q_odd = high_nibbles(v);
                                        // 16-bit lane k of a row: Σ of its values 4k..4k+4 times the activations.
                                        let sums = _mm256_add_epi16(
                                            _mm256_maddubs_epi16(q_even, a_even),
                                            _mm256_maddubs_epi16(q_odd, a_odd),
                                        );
                                        let (p_even, p_odd) = (_mm256_madd_epi16(sums, low_i16), _mm256_srai_epi32(sums, 16));
                                        // [s0·d_a ×4 | s1·d_a ×4]: the same f32 products as `row_n`'s `s·d_a`.
                                        let dd = _mm256_mul_ps(s8[q], da);
                                        even[q] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(p_even), even[q]);
                                        odd[q] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(p_odd), odd[q]);
                                        // Lanes 1 and 3: `b·s_a` fused into each row's bias sum.
                                        bias_terms[q] = _mm_fmadd_ps(sb4[q], sa, bias_terms[q]);
                                    }
                                }
                            }
                            for q in 0..P {
                                // Each row's lanes 0..4 and 4..8 back in order, and hsum's first step.
                                let (lo, hi) = (_mm256_unpacklo_ps(even[q], odd[q]), _mm256_unpackhi_ps(even[q], odd[q]));
                                let halves = _mm256_add_ps(lo, hi);
                                let b = bias_terms[q];
                                let o = 2 * (first + q);
                                *out.get_unchecked_mut(o) = hsum128(_mm256_castps256_ps128(halves)) + _mm_cvtss_f32(_mm_movehdup_ps(b));
                                *out.get_unchecked_mut(o + 1) = hsum128(_mm256_extractf128_ps(halves, 1)) + _mm_cvtss_f32(_mm_shuffle_ps(b, b, 3));
                            }
                        }
                    }
                }

                /// One token × every row of `rows`, 8-bit: two adjacent rows at a time (one
                /// activation load and one linear prefetch stream for both, two independent
                /// FMA chains), each row exactly `row_n::<8, 1>`'s sums (Q8_0's order: values
                /// centred to q − 128, the leftover bias `b + 128·s` apart). An odd last row
                /// goes through `row_n`.
                #[target_feature(enable = $features)]
                unsafe fn gemv8_pairs(
                    layout: MlxLayout,
                    rows: &MlxRowsData,
                    acts: &[&[BlockQ8]],
                    out: &mut [f32],
                ) {
                    // SAFETY: the caller upholds this function's safety contract (its
                    // `# Safety` section or the module's), which every unsafe operation
                    // below relies on.
                    unsafe {
                        const BLOCK_BYTES: usize = QK8;
                        let a = *acts.get_unchecked(0);
                        let (rb, sb) = (rows.row_bytes, rows.scale_row_bytes);
                        let blocks_per_group = layout.group / QK8;
                        let n_groups = rb / (BLOCK_BYTES * blocks_per_group);
                        let ahead = scales_ahead(rb, sb);
                        let c = centre(8);
                        let centre_bytes = _mm256_set1_epi8(c as u8 as i8);
                        for (pair, o) in out.chunks_exact_mut(2).take(rows.n_rows() / 2).enumerate() {
                            let r0 = rows.data.as_ptr().add(2 * pair * rb);
                            let r1 = r0.add(rb);
                            let [s0p, b0p, s1p, b1p] = pair_scale_ptrs(rows, 2 * pair);
                            prefetch_scales(s0p, b0p, 2 * sb, ahead);
                            let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                            let (mut bias0, mut bias1) = (0f32, 0f32);
                            for g in 0..n_groups {
                                let (s0, s1) = (scale_at(layout.scales, s0p, g), scale_at(layout.scales, s1p, g));
                                // The bias left after centring (0 for a Q8_0 copy), as `row_n`.
                                let rest0 = scale_at(layout.scales, b0p, g) + c as f32 * s0;
                                let rest1 = scale_at(layout.scales, b1p, g) + c as f32 * s1;
                                for k in 0..blocks_per_group {
                                    let i = g * blocks_per_group + k;
                                    // One linear prefetch stream over the pair (a line per block).
                                    prefetch_linear(r0.wrapping_add(2 * i * BLOCK_BYTES), 2 * BLOCK_BYTES);
                                    let ab = a.get_unchecked(i);
                                    let ay = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                                    // Signed values; |q| against sign-adjusted activations (ggml's trick).
                                    let q0 = _mm256_sub_epi8(_mm256_loadu_si256(r0.add(i * BLOCK_BYTES) as *const __m256i), centre_bytes);
                                    let q1 = _mm256_sub_epi8(_mm256_loadu_si256(r1.add(i * BLOCK_BYTES) as *const __m256i), centre_bytes);
                                    let p0 = $mul_sum(_mm256_sign_epi8(q0, q0), _mm256_sign_epi8(ay, q0));
                                    let p1 = $mul_sum(_mm256_sign_epi8(q1, q1), _mm256_sign_epi8(ay, q1));
                                    acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s0 * ab.d), _mm256_cvtepi32_ps(p0), acc0);
                                    acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s1 * ab.d), _mm256_cvtepi32_ps(p1), acc1);
                                    if rest0 != 0.0 {
                                        bias0 = rest0.mul_add(ab.s, bias0);
                                    }
                                    if rest1 != 0.0 {
                                        bias1 = rest1.mul_add(ab.s, bias1);
                                    }
                                }
                            }
                            o[0] = hsum(acc0) + bias0;
                            o[1] = hsum(acc1) + bias1;
                        }
                        last_row::<8>(layout, rows, acts, out);
                    }
                }

                /// Every row of `rows` × the tile, `BITS` fixed.
                #[target_feature(enable = $features)]
                unsafe fn rows_bits<const BITS: u32, const N: usize>(
                    layout: MlxLayout,
                    rows: &MlxRowsData,
                    acts: &[&[BlockQ8]],
                    out: &mut [f32],
                ) {
                    // SAFETY: the caller upholds this function's safety contract (its
                    // `# Safety` section or the module's), which every unsafe operation
                    // below relies on.
                    unsafe {
                        for r in 0..rows.n_rows() {
                            let (data, scales, biases) = rows.row(r);
                            row_n::<BITS, N>(
                                layout,
                                data,
                                scales.as_ptr(),
                                biases.as_ptr(),
                                acts,
                                &mut out[r * N..(r + 1) * N],
                            );
                        }
                    }
                }

                /// Rows × a tile of 1..=4 Q8 token rows (falls back to the scalar
                /// kernel on arguments it cannot prove in bounds).
                pub(crate) fn rows(
                    layout: MlxLayout,
                    rows: &MlxRowsData,
                    acts: &[&[BlockQ8]],
                    out: &mut [f32],
                ) {
                    if !rows.fits(layout, acts, out) {
                        return rows_scalar(layout, rows, acts, out);
                    }
                    // SAFETY: the host supports this module's features (checked before the
                    // dispatch handed this function out), and `fits` proved every row holds
                    // whole groups with their scales and biases, every activation row holds
                    // a Q8 block per 32 values, and `out` a value per row and token.
                    unsafe {
                        match (layout.bits, acts.len()) {
                            // One token: two rows at a time, for memory bandwidth.
                            (4, 1) => gemv4_pairs(layout, rows, acts, out),
                            (8, 1) => gemv8_pairs(layout, rows, acts, out),
                            _ => by_bits_and_tile!(rows_bits; layout, rows, acts, out),
                        }
                    }
                }
            }
        };
    }

    mlx_kernels!(avx2, "avx2,fma,f16c", super::mul_sum_maddubs);
    mlx_kernels!(
        vnni,
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        super::mul_sum_vnni
    );
}

impl ScaleKind {
    /// Bytes per value (for the SIMD kernels' bounds check).
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(dead_code)
    )]
    pub(crate) fn size(self) -> usize {
        match self {
            ScaleKind::F16 | ScaleKind::BF16 => 2,
            ScaleKind::F32 => 4,
        }
    }
}
