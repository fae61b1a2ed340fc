//! Reference quantizers of the K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K,
//! byte for byte equal to ggml's `quantize_row_q{2,3,4,5,6}_K_ref` (no
//! importance matrix).
//!
//! Each sub-block gets its own scale (and, for Q4_K/Q5_K, min) from a small
//! search minimising the weighted squared error; the sub-block scales are
//! then quantized to 6 (8) bits against one f16 super-block scale, and the
//! weights requantized with the final scales.

use half::f16;

use crate::blocks::k_quants::{K_SCALE_SIZE, scale_min_k4};
use crate::blocks::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, QK_K};
use crate::quantize::{BlockQuantizer, nearest_int};

/// ggml's `GROUP_MAX_EPS`: below this a group counts as all zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `make_qx_quants` with `rmse_type = 1` (weights x²) and no
/// importance: symmetric quants `L` in `0..2*nmax` and the scale, trying 18
/// scales around `-nmax/max`.
fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    // Weighted sums of x·l and l² at one inverse scale.
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = quant(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    for (o, &v) in l_out.iter_mut().zip(x) {
        *o = (quant(iscale, v) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in l_out.iter_mut().zip(x) {
                *o = (quant(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// How [`make_qkx2_quants`] weighs an error.
#[derive(Clone, Copy, PartialEq)]
enum ErrorNorm {
    Squared,
    /// Absolute (ggml's `use_mad`).
    Absolute,
}

/// ggml's `make_qkx2_quants`: asymmetric quants `L` in `0..=nmax` for
/// `x ≈ scale*L - min`, searching `nstep+1` scales. Returns (scale, min)
/// with min ≥ 0 meaning an offset of −min.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    norm: ErrorNorm,
) -> (f32, f32) {
    let err = |d: f32| match norm {
        ErrorNorm::Squared => d * d,
        ErrorNorm::Absolute => d.abs(),
    };
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.fill(0);
        return (0.0, -min);
    }
    let quant = |iscale: f32, v: f32, min: f32| nearest_int(iscale * (v - min)).clamp(0, nmax);
    // First guess: the full range.
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        l_out[i] = quant(iscale, x[i], min) as u8;
        let diff = scale * l_out[i] as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    // Then a least-squares fit of scale and min at each candidate scale.
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = quant(iscale, x[i], min);
            laux[i] = l as u8;
            let (w, l) = (weights[i], l as f32);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Shared first half of Q4_K and Q5_K: per-32 scales and mins, packed into
/// 12 bytes of 6-bit values, the two f16 super-block scales, and the final
/// quants `L` (0..=nmax) requantized with them.
fn quantize_k4_scales(
    x: &[f32],
    nmax: i32,
    rmin: f32,
    nstep: i32,
) -> ([u8; K_SCALE_SIZE], f16, f16, [u8; QK_K]) {
    let mut l_all = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 32];
    let mut mins = [0f32; QK_K / 32];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..QK_K / 32 {
        let xs = &x[32 * j..32 * j + 32];
        // Weights: RMS of the sub-block plus each value's magnitude.
        let sum_x2 = xs.iter().fold(0.0f32, |s, v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0f32; 32];
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let l = &mut l_all[32 * j..32 * j + 32];
        (scales[j], mins[j]) =
            make_qkx2_quants(nmax, xs, &weights, l, rmin, 0.1, nstep, ErrorNorm::Squared);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    // 6-bit sub-block scales and mins.
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; K_SCALE_SIZE];
    for j in 0..QK_K / 32 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    // Requantize with the stored scales (sub-blocks of scale 0 keep the search's L).
    for j in 0..QK_K / 32 {
        let (sc, m) = scale_min_k4(j, &packed);
        let dj = d.to_f32() * sc as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * m as f32;
        for ii in 0..32 {
            l_all[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / dj).clamp(0, nmax) as u8;
        }
    }
    (packed, d, dmin, l_all)
}

/// ggml's `make_q3_quants` with `do_rmse`: symmetric quants in
/// `0..2*nmax` (stored with +nmax) and their scale, refined by up to five
/// passes of coordinate descent on the x²-weighted error.
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (li, &v) in l.iter_mut().zip(x) {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *li = q as i8;
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * (q * q) as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for (li, &v) in l.iter_mut().zip(x) {
            let w = v * v;
            let cur = *li as f32;
            let mut slx = sumlx - w * v * cur;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * cur * cur;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *li as i32 {
                    slx += w * v * new_l as f32;
                    sl2 += w * (new_l * new_l) as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *li = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for li in l.iter_mut() {
        *li += nmax as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Pack 2-bit values: byte `l` of each 32-byte group holds weights
/// `l`, `l+32`, `l+64`, `l+96` of its 128.
fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8; QK_K / 4]) {
    for (g, q) in qs.chunks_exact_mut(32).enumerate() {
        let l = &l[128 * g..128 * g + 128];
        for (i, byte) in q.iter_mut().enumerate() {
            *byte = l[i] | (l[i + 32] << 2) | (l[i + 64] << 4) | (l[i + 96] << 6);
        }
    }
}

impl BlockQuantizer for BlockQ2K {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        const Q4SCALE: f32 = 15.0;
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; QK_K / 16];
        let mut mins = [0f32; QK_K / 16];
        let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
        for j in 0..QK_K / 16 {
            let xs = &x[16 * j..16 * j + 16];
            let mut weights = [0f32; 16];
            for (w, v) in weights.iter_mut().zip(xs) {
                *w = v.abs();
            }
            let lj = &mut l[16 * j..16 * j + 16];
            (scales[j], mins[j]) =
                make_qkx2_quants(3, xs, &weights, lj, -0.5, 0.1, 15, ErrorNorm::Absolute);
            if scales[j] > max_scale {
                max_scale = scales[j];
            }
            if mins[j] > max_min {
                max_min = mins[j];
            }
        }
        let mut block = BlockQ2K {
            scales: [0; QK_K / 16],
            qs: [0; QK_K / 4],
            d: f16::from_f32(0.0),
            dmin: f16::from_f32(0.0),
        };
        if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for (s, &scale) in block.scales.iter_mut().zip(&scales) {
                *s = nearest_int(iscale * scale) as u8;
            }
            block.d = f16::from_f32(max_scale / Q4SCALE);
        }
        if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for (s, &min) in block.scales.iter_mut().zip(&mins) {
                *s |= (nearest_int(iscale * min) << 4) as u8;
            }
            block.dmin = f16::from_f32(max_min / Q4SCALE);
        }
        for j in 0..QK_K / 16 {
            let d = block.d.to_f32() * (block.scales[j] & 0xF) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = block.dmin.to_f32() * (block.scales[j] >> 4) as f32;
            for ii in 0..16 {
                l[16 * j + ii] = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3) as u8;
            }
        }
        pack_2bit(&l, &mut block.qs);
        block
    }
}

impl BlockQuantizer for BlockQ3K {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; QK_K / 16];
        let (mut max_scale, mut amax) = (0.0f32, 0.0f32);
        for j in 0..QK_K / 16 {
            scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        let mut block = BlockQ3K {
            hmask: [0; QK_K / 8],
            qs: [0; QK_K / 4],
            scales: [0; 12],
            d: f16::from_f32(0.0),
        };
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (j, &scale) in scales.iter().enumerate() {
                // ggml stores the clamped value in an int8_t, then shifts it.
                let q = (nearest_int(iscale * scale) as i8).clamp(-32, 31) + 32;
                if j < 8 {
                    block.scales[j] = (q & 0xF) as u8;
                } else {
                    block.scales[j - 8] |= ((q & 0xF) << 4) as u8;
                }
                block.scales[j % 4 + 8] |= ((q as u8) >> 4) << (2 * (j / 4));
            }
            block.d = f16::from_f32(1.0 / iscale);
        }
        for j in 0..QK_K / 16 {
            let low = if j < 8 {
                block.scales[j] & 0xF
            } else {
                block.scales[j - 8] >> 4
            };
            let high = (block.scales[8 + j % 4] >> (2 * (j / 4))) & 3;
            let sc = (low | (high << 4)) as i32 - 32;
            let d = block.d.to_f32() * sc as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-4, 3) + 4) as i8;
            }
        }
        // High bits: weight j's in bit j / 32 of byte j % 32.
        let mut low = [0u8; QK_K];
        for (j, (&q, lo)) in l.iter().zip(low.iter_mut()).enumerate() {
            let mut q = q as u8;
            if q > 3 {
                block.hmask[j % (QK_K / 8)] |= 1 << (j / (QK_K / 8));
                q -= 4;
            }
            *lo = q;
        }
        pack_2bit(&low, &mut block.qs);
        block
    }
}

impl BlockQuantizer for BlockQ4K {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let (scales, d, dmin, l) = quantize_k4_scales(x, 15, -1.0, 20);
        // Each 64 weights: low nibbles the first 32, high nibbles the next 32.
        let mut qs = [0u8; QK_K / 2];
        for (g, q) in qs.chunks_exact_mut(32).enumerate() {
            for (i, byte) in q.iter_mut().enumerate() {
                *byte = l[64 * g + i] | (l[64 * g + i + 32] << 4);
            }
        }
        BlockQ4K {
            d,
            dmin,
            scales,
            qs,
        }
    }
}

impl BlockQuantizer for BlockQ5K {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let (scales, d, dmin, l) = quantize_k4_scales(x, 31, -0.5, 15);
        let mut qs = [0u8; QK_K / 2];
        let mut qh = [0u8; QK_K / 8];
        for (g, q) in qs.chunks_exact_mut(32).enumerate() {
            // Fifth bits of group g: bit 2g (first 32) and 2g+1 (next 32).
            let (m1, m2) = (1u8 << (2 * g), 2u8 << (2 * g));
            for (i, byte) in q.iter_mut().enumerate() {
                let (mut l1, mut l2) = (l[64 * g + i], l[64 * g + i + 32]);
                if l1 > 15 {
                    l1 -= 16;
                    qh[i] |= m1;
                }
                if l2 > 15 {
                    l2 -= 16;
                    qh[i] |= m2;
                }
                *byte = l1 | (l2 << 4);
            }
        }
        BlockQ5K {
            d,
            dmin,
            scales,
            qh,
            qs,
        }
    }
}

impl BlockQuantizer for BlockQ6K {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; QK_K / 16];
        let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
        // A symmetric 6-bit fit per 16 weights.
        for ib in 0..QK_K / 16 {
            let scale =
                make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
            scales[ib] = scale;
            if scale.abs() > max_abs_scale {
                max_abs_scale = scale.abs();
                max_scale = scale;
            }
        }
        let mut block = BlockQ6K {
            ql: [0; QK_K / 2],
            qh: [0; QK_K / 4],
            scales: [0; QK_K / 16],
            d: f16::from_f32(0.0),
        };
        if max_abs_scale < GROUP_MAX_EPS {
            return block;
        }
        // 8-bit sub-block scales against the f16 super-block scale.
        let iscale = -128.0 / max_scale;
        block.d = f16::from_f32(1.0 / iscale);
        for (s, &scale) in block.scales.iter_mut().zip(&scales) {
            *s = nearest_int(iscale * scale).min(127) as i8;
        }
        // Requantize with the stored scales.
        for j in 0..QK_K / 16 {
            let d = block.d.to_f32() * block.scales[j] as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-32, 31) + 32) as i8;
            }
        }
        // Pack: per 128 weights, 64 bytes of low nibbles and 32 of high bit pairs.
        for n in 0..2 {
            let (ql, qh) = (
                &mut block.ql[64 * n..64 * n + 64],
                &mut block.qh[32 * n..32 * n + 32],
            );
            let lq = |k: usize| l[128 * n + k] as u8;
            for i in 0..32 {
                ql[i] = (lq(i) & 0x0F) | ((lq(i + 64) & 0x0F) << 4);
                ql[i + 32] = (lq(i + 32) & 0x0F) | ((lq(i + 96) & 0x0F) << 4);
                qh[i] = (lq(i) >> 4)
                    | ((lq(i + 32) >> 4) << 2)
                    | ((lq(i + 64) >> 4) << 4)
                    | ((lq(i + 96) >> 4) << 6);
            }
        }
        block
    }
}
