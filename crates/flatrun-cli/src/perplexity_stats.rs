//! The arithmetic of `flatrun perplexity`, as `llama-perplexity` does it:
//! the negative log-likelihood of each scored token (a float log-softmax
//! with a double sum), the running and final estimates with their standard
//! error, the base log-probabilities compressed to 16 bits per token in
//! llama.cpp's `_logits_` file format, and the KL-divergence statistics
//! against such a file. Files written here are read by
//! `llama-perplexity --kl-divergence` and the other way round.

use anyhow::{Context, Result, bail};
use std::io::{Read, Write};

/// Magic of a base log-probability file.
const MAGIC: &[u8; 8] = b"_logits_";

/// `u16` values per stored row: the vocabulary rounded up to even, plus
/// two `f32`s (scale, minimum log-probability).
pub fn row_len(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// `-log p(tok)` under the softmax of `logits`.
pub fn nll(logits: &[f32], tok: usize) -> f64 {
    let max = logits.iter().copied().fold(logits[0], f32::max);
    let sum_exp: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    -(f64::from(logits[tok] - max) - sum_exp.ln())
}

/// Round to the nearest integer, ties to even, as ggml's `nearest_int`.
fn nearest_int(value: f32) -> i32 {
    ((value + 12_582_912.0).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Compress the log-softmax of `logits` into `row` (see [`row_len`]) and
/// return `-log p(tok)`.
pub fn compress(logits: &[f32], row: &mut [u16], tok: usize) -> f64 {
    let mut max = logits[0];
    let mut min = logits[0];
    for &l in &logits[1..] {
        max = max.max(l);
        min = min.min(l);
    }
    let min = min.max(max - 16.0);
    let sum_exp: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    let log_sum_exp = sum_exp.ln() as f32;
    let min_log_prob = min - max - log_sum_exp;
    let scale = (max - min) / 65535.0;
    let (head, values) = row.split_at_mut(4);
    let [s0, s1] = split_f32(scale);
    let [m0, m1] = split_f32(min_log_prob);
    head.copy_from_slice(&[s0, s1, m0, m1]);
    if scale != 0.0 {
        let inv = 1.0 / scale;
        for (v, &l) in values.iter_mut().zip(logits) {
            *v = if l > min {
                nearest_int(inv * (l - min)) as u16
            } else {
                0
            };
        }
    } else {
        values.fill(0);
    }
    f64::from(max) + f64::from(log_sum_exp) - f64::from(logits[tok])
}

/// An `f32` as the two `u16`s it occupies in memory (little-endian).
fn split_f32(v: f32) -> [u16; 2] {
    let b = v.to_le_bytes();
    [
        u16::from_le_bytes([b[0], b[1]]),
        u16::from_le_bytes([b[2], b[3]]),
    ]
}

fn join_f32(lo: u16, hi: u16) -> f32 {
    let (a, b) = (lo.to_le_bytes(), hi.to_le_bytes());
    f32::from_le_bytes([a[0], a[1], b[0], b[1]])
}

/// Sums of the negative log-likelihoods of the scored tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct Nll {
    pub sum: f64,
    pub sum2: f64,
    pub count: usize,
}

impl Nll {
    pub fn add(&mut self, v: f64) {
        self.sum += v;
        self.sum2 += v * v;
        self.count += 1;
    }

    /// The running estimate `exp(mean nll)`.
    pub fn ppl(&self) -> f64 {
        (self.sum / self.count as f64).exp()
    }

    /// The final estimate and its standard error (`None` when it is not
    /// defined: fewer than two tokens or no spread).
    pub fn estimate(&self) -> (f64, Option<f64>) {
        let n = self.count as f64;
        let mean = self.sum / n;
        let var = self.sum2 / n - mean * mean;
        let ppl = mean.exp();
        if var > 0.0 && self.count > 1 {
            (ppl, Some((var / (n - 1.0)).sqrt() * ppl))
        } else {
            (ppl, None)
        }
    }
}

/// The KL-divergence statistics of `llama-perplexity --kl-divergence`.
#[derive(Clone, Debug, Default)]
pub struct Kld {
    pub nll: Nll,
    pub nll_base: Nll,
    pub sum_nll_nll_base: f64,
    pub kld: Nll,
    pub p_diff: Nll,
    pub p_diff4: f64,
    pub same_top: usize,
    /// Per-token KL divergence and Δp, for the percentiles.
    pub kld_values: Vec<f32>,
    pub p_diff_values: Vec<f32>,
}

impl Kld {
    /// Add one scored position: `logits` of the model under test, `base`
    /// the stored row of the base model, `tok` the next token.
    pub fn add(&mut self, logits: &[f32], base: &[u16], tok: usize) {
        let mut max = logits[0];
        let mut imax = 0;
        for (i, &l) in logits.iter().enumerate().skip(1) {
            if l > max {
                max = l;
                imax = i;
            }
        }
        let sum_exp: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
        let log_sum_exp = sum_exp.ln() as f32;
        let scale = join_f32(base[0], base[1]);
        let min_log_prob = join_f32(base[2], base[3]);
        let values = &base[4..];
        let nll = max + log_sum_exp - logits[tok];
        self.nll.add(f64::from(nll));
        let nll_base = -(scale * f32::from(values[tok]) + min_log_prob);
        self.nll_base.add(f64::from(nll_base));
        self.sum_nll_nll_base += f64::from(nll * nll_base);
        let max = max + log_sum_exp;
        let mut sum = 0.0f64;
        let mut imax_base = 0;
        let mut p_log_base_max = 0.0f32;
        for (i, (&v, &l)) in values.iter().zip(logits).enumerate() {
            let p_log_base = scale * f32::from(v) + min_log_prob;
            if i == 0 || p_log_base > p_log_base_max {
                p_log_base_max = p_log_base;
                imax_base = i;
            }
            if p_log_base > -16.0 {
                let p_base = p_log_base.exp();
                sum += f64::from(p_base * (p_log_base - l + max));
            }
        }
        self.kld.add(sum);
        self.same_top += usize::from(imax == imax_base);
        let p_diff = (-nll).exp() - (-nll_base).exp();
        self.p_diff.add(f64::from(p_diff));
        let d2 = f64::from(p_diff) * f64::from(p_diff);
        self.p_diff4 += d2 * d2;
        self.kld_values.push(sum as f32);
        self.p_diff_values.push(p_diff);
    }
}

/// Mean and standard error of the mean, as llama.cpp's
/// `mean_and_uncertainty` (no error below 11 values).
pub fn mean_and_error(sum: f64, sum2: f64, count: usize) -> (f64, f64) {
    if count < 1 {
        return (0.0, 0.0);
    }
    let n = count as f64;
    let mean = sum / n;
    let var = sum2 / n - mean * mean;
    let err = if var > 0.0 && count > 10 {
        (var / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    (mean, err)
}

/// Covariance of the means of two series (0 below 10 values).
pub fn covariance(sum_a: f64, sum_b: f64, sum_ab: f64, count: usize) -> f64 {
    if count < 10 {
        return 0.0;
    }
    let n = count as f64;
    (sum_ab / n - (sum_a / n) * (sum_b / n)) / (n - 1.0)
}

/// The header of a base log-probability file.
#[derive(Clone, Debug, PartialEq)]
pub struct BaseHeader {
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub n_chunk: usize,
    /// `n_chunk × n_ctx` token ids (the evaluated text, before any BOS).
    pub tokens: Vec<u32>,
}

/// Write the header of a base file.
pub fn write_header(out: &mut impl Write, h: &BaseHeader) -> std::io::Result<()> {
    out.write_all(MAGIC)?;
    for v in [h.n_ctx, h.n_vocab, h.n_chunk] {
        out.write_all(&(v as i32).to_le_bytes())?;
    }
    for &t in &h.tokens[..h.n_chunk * h.n_ctx] {
        out.write_all(&(t as i32).to_le_bytes())?;
    }
    Ok(())
}

/// Write rows of compressed log-probabilities.
pub fn write_rows(out: &mut impl Write, rows: &[u16]) -> std::io::Result<()> {
    let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
    out.write_all(&bytes)
}

fn read_i32(input: &mut impl Read) -> std::io::Result<i32> {
    let mut b = [0u8; 4];
    input.read_exact(&mut b)?;
    Ok(i32::from_le_bytes(b))
}

/// Read and check the header of a base file.
pub fn read_header(input: &mut impl Read) -> Result<BaseHeader> {
    let mut magic = [0u8; 8];
    input
        .read_exact(&mut magic)
        .context("it is shorter than a header")?;
    if &magic != MAGIC {
        bail!("it is not a log-probability file (no `_logits_` magic)");
    }
    let mut field = |what: &str| -> Result<usize> {
        let v = read_i32(input).with_context(|| format!("cannot read {what}"))?;
        usize::try_from(v)
            .ok()
            .filter(|&v| v > 0)
            .with_context(|| format!("{what} is {v}"))
    };
    let n_ctx = field("n_ctx")?;
    let n_vocab = field("n_vocab")?;
    let n_chunk = field("n_chunk")?;
    if n_ctx < 4 || n_ctx.saturating_mul(n_chunk) > 1 << 30 || n_vocab > 1 << 24 {
        bail!("implausible sizes: n_ctx {n_ctx}, n_vocab {n_vocab}, {n_chunk} chunks");
    }
    let mut raw = vec![0u8; n_ctx * n_chunk * 4];
    input
        .read_exact(&mut raw)
        .context("it ends inside its token ids")?;
    let tokens = raw
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(BaseHeader {
        n_ctx,
        n_vocab,
        n_chunk,
        tokens,
    })
}

/// Read `rows` stored rows of `n_vocab` into `out`.
pub fn read_rows(
    input: &mut impl Read,
    n_vocab: usize,
    rows: usize,
    out: &mut Vec<u16>,
) -> Result<()> {
    let mut raw = vec![0u8; rows * row_len(n_vocab) * 2];
    input.read_exact(&mut raw).context("it ends early")?;
    out.clear();
    out.extend(
        raw.chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]])),
    );
    Ok(())
}

/// Linear-interpolated percentile of sorted `values`.
pub fn percentile(sorted: &[f32], fraction: f32) -> f32 {
    if fraction <= 0.0 {
        return sorted[0];
    }
    if fraction >= 1.0 {
        return sorted[sorted.len() - 1];
    }
    let p = fraction * (sorted.len() - 1) as f32;
    let ip = p as usize;
    let p = p - ip as f32;
    (1.0 - p) * sorted[ip] + p * sorted[(ip + 1).min(sorted.len() - 1)]
}

/// Median of sorted `values`.
pub fn median(sorted: &[f32]) -> f32 {
    let n = sorted.len();
    if n.is_multiple_of(2) {
        0.5 * (sorted[n / 2] + sorted[n / 2 - 1])
    } else {
        sorted[n / 2]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_of_a_uniform_distribution_is_log_vocab() {
        let logits = vec![0.5f32; 1000];
        assert!((nll(&logits, 3) - 1000f64.ln()).abs() < 1e-9);
    }

    #[test]
    fn compressed_rows_give_the_model_back_its_own_nll_and_no_divergence() {
        let logits: Vec<f32> = (0..101)
            .map(|i| ((i * 37) % 23) as f32 * 0.4 - 3.0)
            .collect();
        let mut row = vec![0u16; row_len(logits.len())];
        assert_eq!(row.len(), 106);
        let v = compress(&logits, &mut row, 7);
        assert!((v - nll(&logits, 7)).abs() < 1e-6);
        let mut kld = Kld::default();
        kld.add(&logits, &row, 7);
        assert!(kld.kld.sum.abs() < 1e-3, "{}", kld.kld.sum);
        assert!((kld.nll_base.sum - kld.nll.sum).abs() < 1e-3);
        assert_eq!(kld.same_top, 1);
    }

    #[test]
    fn the_base_file_round_trips_and_rejects_other_files() {
        let h = BaseHeader {
            n_ctx: 8,
            n_vocab: 5,
            n_chunk: 2,
            tokens: (0..16).collect(),
        };
        let mut buf = Vec::new();
        write_header(&mut buf, &h).unwrap();
        write_rows(&mut buf, &[1, 2, 3]).unwrap();
        let mut input = &buf[..];
        assert_eq!(read_header(&mut input).unwrap(), h);
        assert_eq!(input.len(), 6);
        assert!(read_header(&mut &b"GGUF and more bytes"[..]).is_err());
        assert!(read_header(&mut &buf[..20]).is_err());
    }

    #[test]
    fn ties_round_to_even_as_ggml() {
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(3.5), 4);
        assert_eq!(nearest_int(65534.6), 65535);
    }

    #[test]
    fn estimate_has_the_standard_error_of_the_mean() {
        let mut n = Nll::default();
        for v in [1.0, 2.0, 3.0, 4.0] {
            n.add(v);
        }
        let (ppl, err) = n.estimate();
        assert!((ppl - 2.5f64.exp()).abs() < 1e-12);
        // population variance 1.25, / (n - 1) = 0.41667, sqrt × ppl
        assert!((err.unwrap() - (1.25f64 / 3.0).sqrt() * ppl).abs() < 1e-9);
    }
}
