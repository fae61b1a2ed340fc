//! Softmax weights over a whole vocabulary, fast: a branch-free `exp` that
//! the compiler vectorizes, sums in eight lanes, and per-block sums so a
//! draw does not have to walk 150k weights one by one.

/// Weights are summed in blocks of this many tokens.
pub(crate) const BLOCK: usize = 1024;

/// `e^x` for `x <= 0`, relative error about 2e-7; `x` below -87 gives a
/// tiny or zero value. Branch-free, so loops over it vectorize.
#[inline(always)]
pub(crate) fn exp_non_positive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that n·ln2 is exact in the first part (Cody–Waite).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 0.0);
    // x = n·ln2 + r with |r| <= ln2/2, so e^x = 2^n · e^r.
    let n = (x * LOG2_E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // e^r by its Taylor series to r^6 (error below 2e-7 on the interval).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^n built from its exponent bits (n >= -126, so it is a normal number).
    let two_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * two_n
}

/// `weights[i] = e^((logits[i] - max) · scale)` for logits at or above
/// `floor`, 0 for the others (and for NaN). Returns the total, and the
/// total of each block of [`BLOCK`] weights in `block_sums`.
pub(crate) fn masked_exp(
    logits: &[f32],
    max: f32,
    scale: f32,
    floor: f32,
    weights: &mut Vec<f32>,
    block_sums: &mut Vec<f32>,
) -> f64 {
    weights.clear();
    weights.resize(logits.len(), 0.0);
    block_sums.clear();
    let mut total = 0.0f64;
    for (w_block, l_block) in weights.chunks_mut(BLOCK).zip(logits.chunks(BLOCK)) {
        let mut lanes = [0.0f32; 8];
        let mut w_chunks = w_block.chunks_exact_mut(8);
        let mut l_chunks = l_block.chunks_exact(8);
        for (w8, l8) in (&mut w_chunks).zip(&mut l_chunks) {
            for j in 0..8 {
                let keep = l8[j] >= floor;
                let w = exp_non_positive((l8[j] - max) * scale);
                w8[j] = if keep { w } else { 0.0 };
                lanes[j] += w8[j];
            }
        }
        let mut sum: f32 = lanes.iter().sum();
        for (w, &l) in w_chunks
            .into_remainder()
            .iter_mut()
            .zip(l_chunks.remainder())
        {
            *w = if l >= floor {
                exp_non_positive((l - max) * scale)
            } else {
                0.0
            };
            sum += *w;
        }
        block_sums.push(sum);
        total += sum as f64;
    }
    total
}

/// Sum of the weights whose logit is at or above `threshold`.
pub(crate) fn mass_at_or_above(logits: &[f32], weights: &[f32], threshold: f32) -> f64 {
    let mut total = 0.0f64;
    for (w_block, l_block) in weights.chunks(BLOCK).zip(logits.chunks(BLOCK)) {
        let mut lanes = [0.0f32; 8];
        for (w8, l8) in w_block.chunks_exact(8).zip(l_block.chunks_exact(8)) {
            for j in 0..8 {
                lanes[j] += if l8[j] >= threshold { w8[j] } else { 0.0 };
            }
        }
        let tail = w_block.len() - w_block.len() % 8;
        let mut sum: f32 = lanes.iter().sum();
        for (w, &l) in w_block[tail..].iter().zip(&l_block[tail..]) {
            if l >= threshold {
                sum += w;
            }
        }
        total += sum as f64;
    }
    total
}

/// The index where the running sum of `weights` first exceeds `target`
/// (`target` in `[0, total)`), using the block sums to skip ahead. Falls back
/// to the last positive weight when rounding leaves `target` past the end.
pub(crate) fn draw(weights: &[f32], block_sums: &[f32], mut target: f64) -> Option<usize> {
    for (b, &block_sum) in block_sums.iter().enumerate() {
        if target >= block_sum as f64 {
            target -= block_sum as f64;
            continue;
        }
        let start = b * BLOCK;
        let end = (start + BLOCK).min(weights.len());
        for (i, &w) in weights[start..end].iter().enumerate() {
            if target < w as f64 {
                return Some(start + i);
            }
            target -= w as f64;
        }
    }
    weights.iter().rposition(|&w| w > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate() {
        let mut x = 0.0f32;
        while x > -80.0 {
            let (fast, exact) = (exp_non_positive(x), x.exp());
            assert!(
                ((fast - exact) / exact).abs() < 1e-6,
                "x={x}: {fast} vs {exact}"
            );
            x -= 0.0137;
        }
        assert_eq!(exp_non_positive(0.0), 1.0);
        assert!(exp_non_positive(-1000.0) < 1e-37);
        assert!(exp_non_positive(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn masked_weights_and_draws() {
        let logits: Vec<f32> = (0..3000).map(|i| (i % 7) as f32 - 6.0).collect();
        let (mut w, mut sums) = (Vec::new(), Vec::new());
        let total = masked_exp(&logits, 0.0, 1.0, -1.5, &mut w, &mut sums);
        // Only logits 0 and -1 are kept.
        let expected: f64 = logits
            .iter()
            .filter(|&&l| l >= -1.5)
            .map(|&l| (l as f64).exp())
            .sum();
        assert!((total - expected).abs() / expected < 1e-5);
        assert_eq!(sums.len(), 3);
        assert!((mass_at_or_above(&logits, &w, -0.5) - 428.0).abs() < 1e-3);
        assert_eq!(draw(&w, &sums, 0.0), Some(5));
        // Past the end: the last kept token.
        assert_eq!(draw(&w, &sums, total * 2.0), Some(2995));
    }
}
