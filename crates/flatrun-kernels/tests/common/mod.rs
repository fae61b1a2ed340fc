//! Shared helpers: random but valid weight bytes for every format.
#![allow(dead_code)]

use flatrun_format::{DType, GgmlType};
use flatrun_kernels::WeightFormat;
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

/// Random MLX affine weights: packed values, f16 scales and biases.
pub fn random_mlx(
    bits: u8,
    group: usize,
    rows: usize,
    cols: usize,
    rng: &mut Rng,
) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let data = (0..rows * cols * bits as usize / 8)
        .map(|_| rng.byte())
        .collect();
    let ng = rows * cols / group;
    let scales = (0..ng)
        .flat_map(|_| f16::from_f32(rng.f32().abs() * 0.02 + 0.001).to_le_bytes())
        .collect();
    let biases = (0..ng)
        .flat_map(|_| f16::from_f32(rng.f32() * 0.1).to_le_bytes())
        .collect();
    (data, scales, biases)
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

pub fn mlx_format(bits: u8, group: usize) -> WeightFormat {
    WeightFormat::MlxAffine {
        bits,
        group_size: group as u32,
        scale_dtype: DType::Ggml(GgmlType::F16),
    }
}
