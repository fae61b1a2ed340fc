//! MLX affine quantization: `w = scale * q + bias`, one scale and bias per
//! group of `group_size` consecutive values along a row.
//!
//! The `bits`-bit values q are packed as one continuous little-endian bit
//! stream in u32 words: value `i` occupies bits `i*bits .. (i+1)*bits` of the
//! row, so for 3, 5 and 6 bits a value may straddle two words. A group of 32
//! values always fills exactly `bits` words (`bits` bytes per 8 values), so
//! groups, and rows, start on word boundaries.

use flatrun_format::{DType, GgmlType};
use half::{bf16, f16};

use crate::error::{DequantError, Result};

/// Bit widths MLX's affine mode supports.
pub const MLX_BITS: &[u8] = &[1, 2, 3, 4, 5, 6, 8];
/// Group sizes MLX's affine mode supports.
pub const MLX_GROUP_SIZES: &[usize] = &[32, 64, 128];

/// Storage type of the scales and biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleType {
    F16,
    BF16,
    F32,
}

impl ScaleType {
    /// Bytes per value.
    pub const fn size(self) -> usize {
        match self {
            ScaleType::F16 | ScaleType::BF16 => 2,
            ScaleType::F32 => 4,
        }
    }

    /// The scale type of a storage dtype (`F16`, `BF16` or `F32`).
    pub fn from_dtype(dtype: DType) -> Result<ScaleType> {
        match dtype {
            DType::Ggml(GgmlType::F16) => Ok(ScaleType::F16),
            DType::Ggml(GgmlType::BF16) => Ok(ScaleType::BF16),
            DType::Ggml(GgmlType::F32) => Ok(ScaleType::F32),
            other => Err(DequantError::MlxParams(format!(
                "scales of dtype {other:?}"
            ))),
        }
    }

    /// Value `i` of a little-endian array of this type.
    #[inline]
    fn read(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            ScaleType::F16 => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            ScaleType::BF16 => bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            ScaleType::F32 => f32::from_le_bytes([
                bytes[4 * i],
                bytes[4 * i + 1],
                bytes[4 * i + 2],
                bytes[4 * i + 3],
            ]),
        }
    }
}

/// Parameters of one MLX affine-quantized tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlxAffine {
    /// Bits per value (1, 2, 3, 4, 5, 6 or 8).
    pub bits: u8,
    /// Values per scale/bias pair (32, 64 or 128).
    pub group_size: usize,
    /// Storage type of scales and biases.
    pub scale_type: ScaleType,
}

impl MlxAffine {
    /// Check the parameters against what MLX supports.
    pub fn new(bits: u8, group_size: usize, scale_type: ScaleType) -> Result<MlxAffine> {
        if !MLX_BITS.contains(&bits) {
            return Err(DequantError::MlxParams(format!(
                "{bits} bits (supported: {MLX_BITS:?})"
            )));
        }
        if !MLX_GROUP_SIZES.contains(&group_size) {
            return Err(DequantError::MlxParams(format!(
                "group size {group_size} (supported: {MLX_GROUP_SIZES:?})"
            )));
        }
        Ok(MlxAffine {
            bits,
            group_size,
            scale_type,
        })
    }

    /// Packed bytes holding `n` values.
    pub fn packed_bytes(&self, n: usize) -> usize {
        n / 8 * self.bits as usize
    }

    /// Number of values in `packed` bytes, or an error when they are not a
    /// whole number of groups.
    pub fn value_count(&self, packed_len: usize) -> Result<usize> {
        let group_bytes = self.group_size / 8 * self.bits as usize;
        if !packed_len.is_multiple_of(group_bytes) {
            return Err(DequantError::MlxParams(format!(
                "{packed_len} packed bytes is not a whole number of {}-value groups of {} bits",
                self.group_size, self.bits
            )));
        }
        Ok(packed_len / group_bytes * self.group_size)
    }

    /// Decode `packed` (with one scale and bias per group) into `out`,
    /// which holds exactly as many values as `packed` encodes, computing
    /// `scale * q + bias` in f32 (one rounding).
    ///
    /// MLX itself evaluates in the scale dtype, rounding the product and the
    /// sum to f16/bf16; for f16/bf16 scales that can differ from this by one
    /// unit in the last place of that dtype. [`MlxAffine::dequantize_like_mlx`]
    /// reproduces MLX bit for bit.
    pub fn dequantize(
        &self,
        packed: &[u8],
        scales: &[u8],
        biases: &[u8],
        out: &mut [f32],
    ) -> Result<()> {
        self.check(packed, scales, biases, out.len())?;
        self.decode_with(packed, scales, biases, out, |s, q, b| s * q + b);
        Ok(())
    }

    /// As [`MlxAffine::dequantize`], rounding like MLX: for f16/bf16 scales
    /// the product and the sum are each rounded to the scale dtype.
    pub fn dequantize_like_mlx(
        &self,
        packed: &[u8],
        scales: &[u8],
        biases: &[u8],
        out: &mut [f32],
    ) -> Result<()> {
        self.check(packed, scales, biases, out.len())?;
        match self.scale_type {
            ScaleType::F32 => self.decode_with(packed, scales, biases, out, |s, q, b| s * q + b),
            ScaleType::F16 => self.decode_with(packed, scales, biases, out, |s, q, b| {
                let product = f16::from_f32(s * q).to_f32();
                f16::from_f32(product + b).to_f32()
            }),
            ScaleType::BF16 => self.decode_with(packed, scales, biases, out, |s, q, b| {
                let product = bf16::from_f32(s * q).to_f32();
                bf16::from_f32(product + b).to_f32()
            }),
        }
        Ok(())
    }

    /// Check the sizes of the inputs and of the output.
    fn check(&self, packed: &[u8], scales: &[u8], biases: &[u8], out_len: usize) -> Result<()> {
        let n = self.value_count(packed.len())?;
        let n_groups = n / self.group_size;
        let side = n_groups * self.scale_type.size();
        for (what, arr) in [("scales", scales), ("biases", biases)] {
            if arr.len() != side {
                return Err(DequantError::InputSize {
                    what: format!("MLX {what} of {n_groups} groups"),
                    expected: side,
                    got: arr.len(),
                });
            }
        }
        if out_len != n {
            return Err(DequantError::OutputSize {
                what: format!("MLX affine {}-bit tensor", self.bits),
                expected: n,
                got: out_len,
            });
        }
        Ok(())
    }

    /// Unpack every value and combine it with its group's scale and bias.
    #[inline(always)]
    fn decode_with(
        &self,
        packed: &[u8],
        scales: &[u8],
        biases: &[u8],
        out: &mut [f32],
        combine: impl Fn(f32, f32, f32) -> f32,
    ) {
        let bits = self.bits as usize;
        let mask = (1u64 << bits) - 1;
        let group_bytes = self.group_size / 8 * bits;
        for (g, (raw, y)) in packed
            .chunks_exact(group_bytes)
            .zip(out.chunks_exact_mut(self.group_size))
            .enumerate()
        {
            let scale = self.scale_type.read(scales, g);
            let bias = self.scale_type.read(biases, g);
            // Eight values at a time: `bits` bytes form one little-endian window.
            for (bytes8, y8) in raw.chunks_exact(bits).zip(y.chunks_exact_mut(8)) {
                let mut window = [0u8; 8];
                window[..bits].copy_from_slice(bytes8);
                let word = u64::from_le_bytes(window);
                for (k, o) in y8.iter_mut().enumerate() {
                    let q = ((word >> (k * bits)) & mask) as f32;
                    *o = combine(scale, q, bias);
                }
            }
        }
    }
}
