//! Decoding whole tensors, rows and row ranges of any GGML type into a
//! caller-provided buffer (f32, f16 or bf16), without allocating.

use std::ops::Range;

use flatrun_format::GgmlType;
use half::{bf16, f16, slice::HalfFloatSliceExt};

use crate::blocks::*;
use crate::error::{DequantError, Result};

/// Calls `$body` with `$B` bound to the block struct of a quantized `$ty`;
/// evaluates `$other` for the plain types.
macro_rules! with_block_type {
    ($ty:expr, $B:ident => $body:expr, _ => $other:expr) => {
        match $ty {
            GgmlType::Q4_0 => {
                type $B = BlockQ4_0;
                $body
            }
            GgmlType::Q4_1 => {
                type $B = BlockQ4_1;
                $body
            }
            GgmlType::Q5_0 => {
                type $B = BlockQ5_0;
                $body
            }
            GgmlType::Q5_1 => {
                type $B = BlockQ5_1;
                $body
            }
            GgmlType::Q8_0 => {
                type $B = BlockQ8_0;
                $body
            }
            GgmlType::Q8_1 => {
                type $B = BlockQ8_1;
                $body
            }
            GgmlType::Q2_K => {
                type $B = BlockQ2K;
                $body
            }
            GgmlType::Q3_K => {
                type $B = BlockQ3K;
                $body
            }
            GgmlType::Q4_K => {
                type $B = BlockQ4K;
                $body
            }
            GgmlType::Q5_K => {
                type $B = BlockQ5K;
                $body
            }
            GgmlType::Q6_K => {
                type $B = BlockQ6K;
                $body
            }
            GgmlType::Q8_K => {
                type $B = BlockQ8K;
                $body
            }
            GgmlType::IQ2_XXS => {
                type $B = BlockIq2Xxs;
                $body
            }
            GgmlType::IQ2_XS => {
                type $B = BlockIq2Xs;
                $body
            }
            GgmlType::IQ3_XXS => {
                type $B = BlockIq3Xxs;
                $body
            }
            GgmlType::IQ1_S => {
                type $B = BlockIq1S;
                $body
            }
            GgmlType::IQ4_NL => {
                type $B = BlockIq4Nl;
                $body
            }
            GgmlType::IQ3_S => {
                type $B = BlockIq3S;
                $body
            }
            GgmlType::IQ2_S => {
                type $B = BlockIq2S;
                $body
            }
            GgmlType::IQ4_XS => {
                type $B = BlockIq4Xs;
                $body
            }
            GgmlType::IQ1_M => {
                type $B = BlockIq1M;
                $body
            }
            GgmlType::TQ1_0 => {
                type $B = BlockTq1_0;
                $body
            }
            GgmlType::TQ2_0 => {
                type $B = BlockTq2_0;
                $body
            }
            GgmlType::MXFP4 => {
                type $B = BlockMxfp4;
                $body
            }
            GgmlType::NVFP4 => {
                type $B = BlockNvfp4;
                $body
            }
            GgmlType::Q1_0 => {
                type $B = BlockQ1_0;
                $body
            }
            GgmlType::Q2_0 => {
                type $B = BlockQ2_0;
                $body
            }
            GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::F64
            | GgmlType::I8
            | GgmlType::I16
            | GgmlType::I32
            | GgmlType::I64 => $other,
        }
    };
}

/// Whether this crate decodes `ty` (every type of the table: the block
/// formats, the floats and the integer types, which are converted to f32).
pub fn is_supported(ty: GgmlType) -> bool {
    GgmlType::ALL.contains(&ty)
}

/// The activation format ggml quantizes to for a dot product with `ty`
/// weights (the block's [`BlockFormat::DotPartner`]): Q8_0, Q8_1 or Q8_K.
/// `None` for the plain float and integer types.
pub fn dot_partner(ty: GgmlType) -> Option<GgmlType> {
    with_block_type!(ty, B => Some(<<B as BlockFormat>::DotPartner as BlockFormat>::TYPE), _ => None)
}

/// Number of blocks in `len` bytes of `ty`, or an error when `len` is not a
/// whole number of blocks.
pub fn block_count(ty: GgmlType, len: usize) -> Result<usize> {
    let block_bytes = ty.type_size();
    if block_bytes == 0 || !len.is_multiple_of(block_bytes) {
        return Err(DequantError::PartialBlock {
            ty,
            len,
            block_bytes,
        });
    }
    Ok(len / block_bytes)
}

/// Number of values `bytes.len()` bytes of `ty` decode to.
pub fn element_count(ty: GgmlType, len: usize) -> Result<usize> {
    Ok(block_count(ty, len)? * ty.block_size())
}

/// Bytes of one row of `row_len` values of `ty`.
pub fn row_bytes(ty: GgmlType, row_len: usize) -> Result<usize> {
    let block_elems = ty.block_size();
    if block_elems == 0 || !row_len.is_multiple_of(block_elems) {
        return Err(DequantError::PartialBlockElements {
            ty,
            elems: row_len,
            block_elems,
        });
    }
    (row_len / block_elems)
        .checked_mul(ty.type_size())
        .ok_or_else(|| DequantError::Unsupported(format!("{ty}: row of {row_len} overflows")))
}

/// Decode every block of `bytes` (a whole number of `B` blocks) into `out`
/// (exactly as many values).
fn decode_blocks<B: BlockFormat>(bytes: &[u8], out: &mut [f32]) {
    match bytemuck::try_cast_slice::<u8, B>(bytes) {
        // Aligned: view the bytes as blocks.
        Ok(blocks) => {
            for (block, y) in blocks.iter().zip(out.chunks_exact_mut(B::BLOCK_ELEMS)) {
                block.dequantize(y);
            }
        }
        // Unaligned (e.g. a GGUF tensor at an odd offset): copy each block out.
        Err(_) => {
            for (raw, y) in bytes
                .chunks_exact(B::BLOCK_BYTES)
                .zip(out.chunks_exact_mut(B::BLOCK_ELEMS))
            {
                let block: B = bytemuck::pod_read_unaligned(raw);
                block.dequantize(y);
            }
        }
    }
}

/// Decode typed blocks into `out` (exactly `blocks.len() * B::BLOCK_ELEMS`
/// values).
pub fn dequantize_blocks<B: BlockFormat>(blocks: &[B], out: &mut [f32]) -> Result<()> {
    if out.len() != blocks.len() * B::BLOCK_ELEMS {
        return Err(DequantError::OutputSize {
            what: format!("{} {} blocks", blocks.len(), B::TYPE),
            expected: blocks.len() * B::BLOCK_ELEMS,
            got: out.len(),
        });
    }
    for (block, y) in blocks.iter().zip(out.chunks_exact_mut(B::BLOCK_ELEMS)) {
        block.dequantize(y);
    }
    Ok(())
}

/// Decode plain little-endian scalars of `ty` into `out`.
fn decode_plain(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    macro_rules! each {
        ($n:literal, |$b:ident| $conv:expr) => {
            for (raw, o) in bytes.chunks_exact($n).zip(out.iter_mut()) {
                let mut $b = [0u8; $n];
                $b.copy_from_slice(raw);
                *o = $conv;
            }
        };
    }
    match ty {
        GgmlType::F32 => each!(4, |b| f32::from_le_bytes(b)),
        GgmlType::F16 => decode_halves::<f16>(bytes, out),
        GgmlType::BF16 => decode_halves::<bf16>(bytes, out),
        GgmlType::F64 => each!(8, |b| f64::from_le_bytes(b) as f32),
        GgmlType::I8 => each!(1, |b| b[0] as i8 as f32),
        GgmlType::I16 => each!(2, |b| i16::from_le_bytes(b) as f32),
        GgmlType::I32 => each!(4, |b| i32::from_le_bytes(b) as f32),
        GgmlType::I64 => each!(8, |b| i64::from_le_bytes(b) as f32),
        _ => {}
    }
}

/// Decode little-endian f16/bf16 values through a stack buffer, with `half`'s
/// slice conversion (which uses F16C / SIMD where the CPU has them).
fn decode_halves<T>(bytes: &[u8], out: &mut [f32])
where
    T: Copy + Default + bytemuck::Pod,
    [T]: HalfFloatSliceExt,
{
    let mut buf = [T::default(); 256];
    for (raw, dst) in bytes.chunks(2 * buf.len()).zip(out.chunks_mut(buf.len())) {
        let tmp = &mut buf[..dst.len()];
        bytemuck::cast_slice_mut::<T, u8>(tmp).copy_from_slice(raw);
        tmp.convert_to_f32_slice(dst);
    }
}

/// Decode whole blocks of `ty` without checking sizes (callers check).
fn decode_unchecked(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    with_block_type!(ty, B => decode_blocks::<B>(bytes, out), _ => decode_plain(ty, bytes, out))
}

/// Decode a whole tensor of type `ty` into `out`, which must hold exactly
/// as many values as `bytes` encodes.
///
/// ```
/// use flatrun_dequant::{dequantize, GgmlType};
/// // One Q8_0 block: scale 0.5 (f16 0x3800), then 32 quants.
/// let mut bytes = vec![0x00, 0x38];
/// bytes.extend((0..32).map(|i| i as u8));
/// let mut out = [0f32; 32];
/// dequantize(GgmlType::Q8_0, &bytes, &mut out)?;
/// assert_eq!(out[3], 1.5);
/// # Ok::<(), flatrun_dequant::DequantError>(())
/// ```
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let n = element_count(ty, bytes.len())?;
    if out.len() != n {
        return Err(DequantError::OutputSize {
            what: format!("{ty} tensor of {} bytes", bytes.len()),
            expected: n,
            got: out.len(),
        });
    }
    decode_unchecked(ty, bytes, out);
    Ok(())
}

/// Decode a whole tensor into a new vector.
pub fn dequantize_to_vec(ty: GgmlType, bytes: &[u8]) -> Result<Vec<f32>> {
    let mut out = vec![0f32; element_count(ty, bytes.len())?];
    decode_unchecked(ty, bytes, &mut out);
    Ok(out)
}

/// The byte range of `rows` in a tensor of `bytes.len()` bytes whose rows hold
/// `row_len` values.
fn row_span(
    ty: GgmlType,
    bytes: &[u8],
    row_len: usize,
    rows: &Range<usize>,
) -> Result<Range<usize>> {
    let rb = row_bytes(ty, row_len)?;
    let n_rows = if rb == 0 {
        0
    } else {
        if !bytes.len().is_multiple_of(rb) {
            return Err(DequantError::PartialBlock {
                ty,
                len: bytes.len(),
                block_bytes: rb,
            });
        }
        bytes.len() / rb
    };
    if rows.start > rows.end || rows.end > n_rows {
        return Err(DequantError::RowRange {
            ty,
            start: rows.start,
            end: rows.end,
            rows: n_rows,
        });
    }
    Ok(rows.start * rb..rows.end * rb)
}

/// Decode rows `rows` of a tensor (`bytes` is the whole tensor, each row
/// holding `row_len` values) into `out`, which holds exactly
/// `rows.len() * row_len` values.
pub fn dequantize_rows(
    ty: GgmlType,
    bytes: &[u8],
    row_len: usize,
    rows: Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    let span = row_span(ty, bytes, row_len, &rows)?;
    let expected = rows.len() * row_len;
    if out.len() != expected {
        return Err(DequantError::OutputSize {
            what: format!("{ty} rows {}..{} of {row_len}", rows.start, rows.end),
            expected,
            got: out.len(),
        });
    }
    decode_unchecked(ty, &bytes[span], out);
    Ok(())
}

/// Decode row `row` of a tensor (see [`dequantize_rows`]).
pub fn dequantize_row(
    ty: GgmlType,
    bytes: &[u8],
    row_len: usize,
    row: usize,
    out: &mut [f32],
) -> Result<()> {
    dequantize_rows(ty, bytes, row_len, row..row.saturating_add(1), out)
}

/// Values decoded per step when converting to 16-bit floats (a multiple of
/// every block size).
const CHUNK: usize = 256;

/// Decode into 16-bit values through a small f32 buffer on the stack.
fn dequantize_narrow<T>(
    ty: GgmlType,
    bytes: &[u8],
    out: &mut [T],
    narrow: impl Fn(f32) -> T,
) -> Result<()> {
    let n = element_count(ty, bytes.len())?;
    if out.len() != n {
        return Err(DequantError::OutputSize {
            what: format!("{ty} tensor of {} bytes", bytes.len()),
            expected: n,
            got: out.len(),
        });
    }
    // Whole blocks per step: CHUNK values, or one block when blocks are larger.
    let block_elems = ty.block_size().max(1);
    let blocks_per_step = (CHUNK / block_elems).max(1);
    let step_bytes = blocks_per_step * ty.type_size();
    let step_elems = blocks_per_step * block_elems;
    let mut buf = [0f32; CHUNK];
    for (raw, dst) in bytes.chunks(step_bytes).zip(out.chunks_mut(step_elems)) {
        let tmp = &mut buf[..dst.len()];
        decode_unchecked(ty, raw, tmp);
        for (d, &v) in dst.iter_mut().zip(tmp.iter()) {
            *d = narrow(v);
        }
    }
    Ok(())
}

/// Decode a whole tensor to f16 (round to nearest even, as `half`).
pub fn dequantize_to_f16(ty: GgmlType, bytes: &[u8], out: &mut [f16]) -> Result<()> {
    dequantize_narrow(ty, bytes, out, f16::from_f32)
}

/// Decode a whole tensor to bf16 (round to nearest even, as `half`).
pub fn dequantize_to_bf16(ty: GgmlType, bytes: &[u8], out: &mut [bf16]) -> Result<()> {
    dequantize_narrow(ty, bytes, out, bf16::from_f32)
}

/// Check that `bytes` is a whole number of blocks of `ty` and that every
/// block's scales are finite. Decoding does not check scales (it is the hot
/// path); call this once on data read from a file.
pub fn validate(ty: GgmlType, bytes: &[u8]) -> Result<()> {
    block_count(ty, bytes.len())?;
    with_block_type!(ty, B => validate_blocks::<B>(bytes), _ => Ok(()))
}

fn validate_blocks<B: BlockFormat>(bytes: &[u8]) -> Result<()> {
    for (i, raw) in bytes.chunks_exact(B::BLOCK_BYTES).enumerate() {
        let block: B = bytemuck::pod_read_unaligned(raw);
        let scales = block.scales();
        if let Some(&value) = scales.as_slice().iter().find(|v| !v.is_finite()) {
            return Err(DequantError::NonFiniteScale {
                ty: B::TYPE,
                block: i,
                offset: i * B::BLOCK_BYTES,
                value,
            });
        }
    }
    Ok(())
}
