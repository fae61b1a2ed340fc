//! Shared helpers: random but valid weight bytes for every format, and the
//! check of every SIMD level against the reference backend.
#![allow(dead_code)]

use flatrun_format::{DType, GgmlType};
use flatrun_kernels::{
    Kernels, NativeKernels, ReferenceKernels, Weight, WeightFormat, supported_levels,
};
use half::{bf16, f16};

/// A small deterministic generator (xorshift), so failures reproduce.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn byte(&mut self) -> u8 {
        (self.next_u64() >> 32) as u8
    }
}

/// Where the f16 scales of one block sit, and their magnitude.
fn scale_offsets(t: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match t {
        Q4_0 | Q5_0 | Q8_0 | IQ4_NL | Q1_0 | IQ4_XS => &[0],
        Q4_K | Q5_K => &[0, 2],
        Q4_1 | Q5_1 => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        _ => &[],
    }
}

/// `rows × cols` random weights of format `t`: random packed bits, finite scales.
pub fn random_ggml(t: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let n = rows * cols;
    match t {
        GgmlType::F32 => (0..n).flat_map(|_| rng.f32().to_le_bytes()).collect(),
        GgmlType::F16 => (0..n)
            .flat_map(|_| f16::from_f32(rng.f32()).to_le_bytes())
            .collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| bf16::from_f32(rng.f32()).to_le_bytes())
            .collect(),
        _ => {
            let ts = t.type_size();
            let nb = n / t.block_size();
            let mut bytes: Vec<u8> = (0..nb * ts).map(|_| rng.byte()).collect();
            // Scales of a plausible size (a min may be negative for Q4_1/Q5_1).
            let magnitude = if t.block_size() == 256 { 0.002 } else { 0.05 };
            if t == GgmlType::MXFP4 {
                // An E8M0 exponent byte: scales 2^-9 … 2^-2.
                for blk in bytes.chunks_exact_mut(ts) {
                    blk[0] = 118 + rng.byte() % 8;
                }
                return bytes;
            }
            for blk in bytes.chunks_exact_mut(ts) {
                for (k, &off) in scale_offsets(t).iter().enumerate() {
                    let v = if k == 0 {
                        rng.f32().abs() + 0.1
                    } else {
                        rng.f32()
                    } * magnitude;
                    blk[off..off + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
            bytes
        }
    }
}

/// An MLX affine tensor: its packed values, scales and biases, owned.
pub struct MlxTensor {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<u8>,
    pub scales: Vec<u8>,
    pub biases: Vec<u8>,
}

impl MlxTensor {
    /// Random `bits`-bit weights, one scale/bias pair of type `scale` per `group`
    /// values; `symmetric` groups get the bias `−2^(bits−1)·s` (a Q4_0/Q8_0 copy).
    pub fn random(
        bits: u8,
        group: usize,
        scale: GgmlType,
        rows: usize,
        cols: usize,
        symmetric: bool,
        rng: &mut Rng,
    ) -> MlxTensor {
        let data = (0..rows * cols * bits as usize / 8)
            .map(|_| rng.byte())
            .collect();
        let (mut scales, mut biases) = (Vec::new(), Vec::new());
        for _ in 0..rows * cols / group {
            // Rounded to the storage type first, so −c·s is exact there too.
            let s = round_to(rng.f32().abs() * 0.02 + 0.001, scale);
            let b = if symmetric {
                -((1u32 << (bits - 1)) as f32) * s
            } else {
                rng.f32() * 0.1
            };
            scales.extend(encode(s, scale));
            biases.extend(encode(b, scale));
        }
        MlxTensor {
            format: mlx_format(bits, group, scale),
            rows,
            cols,
            data,
            scales,
            biases,
        }
    }

    /// The tensor as a kernel operand.
    pub fn weight(&self) -> Weight<'_> {
        Weight::new(
            self.format,
            self.rows,
            self.cols,
            &self.data,
            Some(&self.scales),
            Some(&self.biases),
        )
        .expect("a well-formed MLX tensor")
    }
}

/// `v` stored as type `t` (F16, BF16 or F32), little-endian.
pub fn encode(v: f32, t: GgmlType) -> Vec<u8> {
    match t {
        GgmlType::F16 => f16::from_f32(v).to_le_bytes().to_vec(),
        GgmlType::BF16 => bf16::from_f32(v).to_le_bytes().to_vec(),
        _ => v.to_le_bytes().to_vec(),
    }
}

/// `v` rounded to storage type `t`.
pub fn round_to(v: f32, t: GgmlType) -> f32 {
    match t {
        GgmlType::F16 => f16::from_f32(v).to_f32(),
        GgmlType::BF16 => bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// The GGML formats with a kernel, and the relative error budget of the native dot against
/// the f32 reference: `|native − reference| ≤ budget · Σ|w·x|` (the activation quantization
/// to 8 bits is the only deliberate loss; float formats are exact up to rounding).
pub const GGML_BUDGETS: &[(GgmlType, f32)] = &[
    (GgmlType::F32, 1e-5),
    (GgmlType::F16, 1e-5),
    (GgmlType::BF16, 1e-5),
    (GgmlType::Q4_0, 5e-3),
    (GgmlType::Q4_1, 5e-3),
    (GgmlType::Q5_0, 5e-3),
    (GgmlType::Q5_1, 5e-3),
    (GgmlType::Q8_0, 5e-3),
    (GgmlType::IQ4_NL, 5e-3),
    (GgmlType::MXFP4, 5e-3),
    (GgmlType::Q1_0, 5e-3),
    (GgmlType::Q2_K, 5e-3),
    (GgmlType::Q3_K, 5e-3),
    (GgmlType::Q4_K, 5e-3),
    (GgmlType::Q5_K, 5e-3),
    (GgmlType::Q6_K, 5e-3),
    (GgmlType::IQ4_XS, 5e-3),
];

/// MLX formats tested (bits, group): 4/8-bit have fused kernels, the others decode rows then take an f32 dot.
pub const MLX_FORMATS: &[(u8, usize)] = &[(4, 32), (4, 64), (8, 64), (3, 32), (6, 64), (2, 128)];

/// MLX affine `bits`-bit, `group` values per scale/bias pair of type `scale`.
pub fn mlx_format(bits: u8, group: usize, scale: GgmlType) -> WeightFormat {
    WeightFormat::MlxAffine {
        bits,
        group_size: group as u32,
        scale_dtype: DType::Ggml(scale),
    }
}

/// Σ|w·x| per output, the scale the error budgets are relative to.
pub fn magnitudes(w: &Weight, x: &[f32], n_tokens: usize) -> Vec<f32> {
    let mut dense = vec![0f32; w.rows * w.cols];
    ReferenceKernels
        .dequantize_rows(w, 0..w.rows, &mut dense)
        .unwrap();
    let mut m = vec![0f32; n_tokens * w.rows];
    for t in 0..n_tokens {
        for r in 0..w.rows {
            m[t * w.rows + r] = (0..w.cols)
                .map(|c| (dense[r * w.cols + c] * x[t * w.cols + c]).abs())
                .sum();
        }
    }
    m
}

/// Native at every SIMD level the host supports against the reference, on
/// random activations: `|native − reference| ≤ budget · Σ|w·x|` for every output.
/// Returns the worst relative error seen.
pub fn check_levels(w: &Weight, n_tokens: usize, budget: f32, rng: &mut Rng) -> f32 {
    let x: Vec<f32> = (0..n_tokens * w.cols).map(|_| rng.f32()).collect();
    let mut want = vec![0f32; n_tokens * w.rows];
    ReferenceKernels.matmul(w, &x, n_tokens, &mut want).unwrap();
    let mag = magnitudes(w, &x, n_tokens);
    let mut worst = 0f32;
    for level in supported_levels() {
        let mut got = vec![f32::NAN; n_tokens * w.rows];
        NativeKernels::new(level)
            .matmul(w, &x, n_tokens, &mut got)
            .unwrap();
        for i in 0..got.len() {
            let rel = (got[i] - want[i]).abs() / mag[i].max(1e-20);
            assert!(
                rel <= budget,
                "{} at {level}: [{} x {}] x {n_tokens} tokens, output {i}: native {} reference {} (rel {rel:e} > {budget:e})",
                w.format,
                w.rows,
                w.cols,
                got[i],
                want[i]
            );
            worst = worst.max(rel);
        }
    }
    worst
}

/// The legacy (32-value block) formats with fused kernels.
pub const LEGACY_FORMATS: &[GgmlType] = &[
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::IQ4_NL,
    GgmlType::Q1_0,
];

/// Random `rows × cols` weights of type `t` and `n` random token rows.
pub fn random_case(
    t: GgmlType,
    rows: usize,
    cols: usize,
    n: usize,
    rng: &mut Rng,
) -> (Vec<u8>, Vec<f32>) {
    let bytes = random_ggml(t, rows, cols, rng);
    let x = (0..n * cols).map(|_| rng.f32()).collect();
    (bytes, x)
}

/// `x · Wᵀ` for `n` tokens with the kernels `k` (token-major, as `Kernels::matmul` writes it).
pub fn matmul_with(k: &NativeKernels, w: &Weight, x: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * w.rows];
    k.matmul(w, x, n, &mut out).unwrap();
    out
}

/// Every token's GEMV (`Kernels::matmul` with one token) equals, bit for bit, that token's
/// column of the `n`-token GEMM over the same `x`, at every SIMD level the host supports.
/// `label` names the case in a failure.
#[allow(dead_code)] // not every test file that includes `common` uses it
pub fn assert_gemv_equals_gemm_columns(w: &Weight, x: &[f32], n: usize, label: &str) {
    assert_gemv_equals_gemm_columns_with(NativeKernels::new, w, x, n, label)
}

/// [`assert_gemv_equals_gemm_columns`] with the kernels `make(level)`.
#[allow(dead_code)] // not every test file that includes `common` uses it
pub fn assert_gemv_equals_gemm_columns_with(
    make: impl Fn(flatrun_kernels::SimdLevel) -> NativeKernels,
    w: &Weight,
    x: &[f32],
    n: usize,
    label: &str,
) {
    let (rows, cols) = (w.rows, w.cols);
    for level in flatrun_kernels::supported_levels() {
        let k = make(level);
        let gemm = matmul_with(&k, w, x, n);
        for tok in 0..n {
            let gemv = matmul_with(&k, w, &x[tok * cols..(tok + 1) * cols], 1);
            for r in 0..rows {
                let (a, b) = (gemm[tok * rows + r], gemv[r]);
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{label} {level} {rows}x{cols}: token {tok} row {r}: GEMM {a} vs GEMV {b}"
                );
            }
        }
    }
}
