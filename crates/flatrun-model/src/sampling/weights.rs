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
    let rounded = x * LOG2_E + ROUND;
    let n = rounded - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // e^r by its Taylor series to r^6 (error below 2e-7 on the interval).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^n built from its exponent bits (n >= -126, so it is a normal number).
    // `rounded` lies in [2^23, 2^24) where the float step is 1, so its bits
    // minus those of ROUND are exactly n: integer arithmetic that vectorizes
    // (a float-to-int `as` cast saturates and does not, on SSE2).
    let n_int = rounded.to_bits().wrapping_sub(ROUND.to_bits());
    let two_n = f32::from_bits(n_int.wrapping_add(127) << 23);
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
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { masked_exp_avx2(logits, max, scale, floor, weights, block_sums) };
    }
    masked_exp_portable(logits, max, scale, floor, weights, block_sums)
}

/// [`masked_exp_portable`] compiled for AVX2 (the same operations in the
/// same order, so the same results, on eight lanes at once).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn masked_exp_avx2(
    logits: &[f32],
    max: f32,
    scale: f32,
    floor: f32,
    weights: &mut Vec<f32>,
    block_sums: &mut Vec<f32>,
) -> f64 {
    masked_exp_portable(logits, max, scale, floor, weights, block_sums)
}

#[inline(always)]
fn masked_exp_portable(
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

/// Sum of the weights whose logit is at or above `threshold` (the
/// one-threshold reference for [`mass_at_or_above_each`]).
#[cfg(test)]
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

/// Number of thresholds [`count_at_or_above_each`] handles in one pass.
pub(crate) const THRESHOLDS: usize = 8;

/// Number of thresholds [`mass_at_or_above_each`] handles in one pass (its
/// accumulators must fit in vector registers).
pub(crate) const MASS_THRESHOLDS: usize = 4;

/// [`mass_at_or_above`] for several thresholds in one pass over the
/// vocabulary, each summed in exactly the same order (so with the same
/// rounding) as a separate call would.
pub(crate) fn mass_at_or_above_each(
    logits: &[f32],
    weights: &[f32],
    thresholds: &[f32; MASS_THRESHOLDS],
) -> [f64; MASS_THRESHOLDS] {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { mass_at_or_above_each_avx2(logits, weights, thresholds) };
    }
    mass_at_or_above_each_portable(logits, weights, thresholds)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn mass_at_or_above_each_avx2(
    logits: &[f32],
    weights: &[f32],
    thresholds: &[f32; MASS_THRESHOLDS],
) -> [f64; MASS_THRESHOLDS] {
    mass_at_or_above_each_portable(logits, weights, thresholds)
}

#[inline(always)]
fn mass_at_or_above_each_portable(
    logits: &[f32],
    weights: &[f32],
    thresholds: &[f32; MASS_THRESHOLDS],
) -> [f64; MASS_THRESHOLDS] {
    let mut totals = [0.0f64; MASS_THRESHOLDS];
    // Block by block (a block stays in L1 cache), one simple loop per threshold.
    for (w_block, l_block) in weights.chunks(BLOCK).zip(logits.chunks(BLOCK)) {
        let tail = w_block.len() - w_block.len() % 8;
        for (total, &threshold) in totals.iter_mut().zip(thresholds) {
            let mut lanes = [0.0f32; 8];
            for (w8, l8) in w_block.chunks_exact(8).zip(l_block.chunks_exact(8)) {
                for j in 0..8 {
                    // The weight or +0, by a bit mask: no branch, no
                    // conditional load, so the loop vectorizes.
                    let keep = ((l8[j] >= threshold) as u32).wrapping_neg();
                    lanes[j] += f32::from_bits(w8[j].to_bits() & keep);
                }
            }
            let mut sum: f32 = lanes.iter().sum();
            for (w, &l) in w_block[tail..].iter().zip(&l_block[tail..]) {
                if l >= threshold {
                    sum += w;
                }
            }
            *total += sum as f64;
        }
    }
    totals
}

/// How many logits are at or above each threshold, in one pass.
pub(crate) fn count_at_or_above_each(
    logits: &[f32],
    thresholds: &[f32; THRESHOLDS],
) -> [usize; THRESHOLDS] {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { count_at_or_above_each_avx2(logits, thresholds) };
    }
    count_at_or_above_each_portable(logits, thresholds)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn count_at_or_above_each_avx2(
    logits: &[f32],
    thresholds: &[f32; THRESHOLDS],
) -> [usize; THRESHOLDS] {
    count_at_or_above_each_portable(logits, thresholds)
}

#[inline(always)]
fn count_at_or_above_each_portable(
    logits: &[f32],
    thresholds: &[f32; THRESHOLDS],
) -> [usize; THRESHOLDS] {
    let mut counts = [0usize; THRESHOLDS];
    // Block by block (a block stays in L1 cache), one simple loop per threshold.
    for block in logits.chunks(BLOCK) {
        let chunks = block.chunks_exact(8);
        let rest = chunks.remainder();
        for (count, &threshold) in counts.iter_mut().zip(thresholds) {
            let mut lanes = [0u32; 8];
            for l8 in chunks.clone() {
                for j in 0..8 {
                    lanes[j] += (l8[j] >= threshold) as u32;
                }
            }
            *count += lanes.iter().map(|&c| c as usize).sum::<usize>()
                + rest.iter().filter(|&&l| l >= threshold).count();
        }
    }
    counts
}

/// Append `(id, logit)` for every logit at or above `floor`, in id order,
/// skipping eight logits at a time when none of them qualifies.
pub(crate) fn collect_at_or_above(logits: &[f32], floor: f32, out: &mut Vec<(u32, f32)>) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { collect_at_or_above_avx2(logits, floor, out) };
    }
    collect_at_or_above_portable(logits, floor, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn collect_at_or_above_avx2(logits: &[f32], floor: f32, out: &mut Vec<(u32, f32)>) {
    collect_at_or_above_portable(logits, floor, out)
}

#[inline(always)]
fn collect_at_or_above_portable(logits: &[f32], floor: f32, out: &mut Vec<(u32, f32)>) {
    let chunks = logits.chunks_exact(8);
    let tail = logits.len() - chunks.remainder().len();
    for (c, l8) in chunks.enumerate() {
        let hits = l8.iter().fold(0u32, |hits, &l| hits | (l >= floor) as u32);
        if hits != 0 {
            let base = c * 8;
            for (j, &l) in l8.iter().enumerate() {
                if l >= floor {
                    out.push(((base + j) as u32, l));
                }
            }
        }
    }
    for (i, &l) in logits.iter().enumerate().skip(tail) {
        if l >= floor {
            out.push((i as u32, l));
        }
    }
}

/// The total [`masked_exp`] returns at scale 1 when exactly `kept` (sorted
/// by id, each logit at or above the floor) pass the floor of a vocabulary of
/// `vocab` tokens, without touching the others: the same sums in the same
/// order (adding a masked-out 0 changes nothing), so the same rounding.
pub(crate) fn masked_total_of(kept: &[(u32, f32)], vocab: usize, max: f32) -> f64 {
    let mut total = 0.0f64;
    let mut i = 0;
    while i < kept.len() {
        let block = kept[i].0 as usize / BLOCK;
        let block_start = block * BLOCK;
        let block_len = BLOCK.min(vocab.saturating_sub(block_start));
        let tail_start = block_start + block_len - block_len % 8;
        let mut lanes = [0.0f32; 8];
        while i < kept.len()
            && (kept[i].0 as usize) / BLOCK == block
            && (kept[i].0 as usize) < tail_start
        {
            lanes[kept[i].0 as usize % 8] += exp_non_positive(kept[i].1 - max);
            i += 1;
        }
        let mut sum: f32 = lanes.iter().sum();
        while i < kept.len() && (kept[i].0 as usize) / BLOCK == block {
            sum += exp_non_positive(kept[i].1 - max);
            i += 1;
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

    #[test]
    fn one_pass_helpers_match_the_simple_ones_exactly() {
        let logits: Vec<f32> = (0..3001)
            .map(|i| ((i * 37) % 101) as f32 * 0.1 - 5.0)
            .collect();
        let (mut w, mut sums) = (Vec::new(), Vec::new());
        let floor = 2.0;
        let total = masked_exp(&logits, 5.0, 1.0, floor, &mut w, &mut sums);
        let thresholds = [4.5, 4.0, 3.0, 1.0];
        let masses = mass_at_or_above_each(&logits, &w, &thresholds);
        for (&t, &m) in thresholds.iter().zip(&masses) {
            assert_eq!(m, mass_at_or_above(&logits, &w, t));
        }
        let mut kept = Vec::new();
        collect_at_or_above(&logits, floor, &mut kept);
        assert_eq!(kept.len(), logits.iter().filter(|&&l| l >= floor).count());
        assert_eq!(masked_total_of(&kept, logits.len(), 5.0), total);
        let counts = count_at_or_above_each(&logits, &[4.0; THRESHOLDS]);
        assert_eq!(counts[0], logits.iter().filter(|&&l| l >= 4.0).count());
    }
}
