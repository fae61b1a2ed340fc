//! The default token sampler: greedy, or temperature with top-k and top-p,
//! from a seeded generator so that a request with a `seed` is reproducible.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::engine::SamplingParams;

/// A small, fast, seedable generator (SplitMix64).
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// A generator seeded from the clock and a process-wide counter.
    pub fn from_entropy() -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let count = COUNTER.fetch_add(1, Ordering::Relaxed);
        SplitMix64::new(nanos ^ count.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Per-sequence sampler state.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(seed) => SplitMix64::new(seed),
            None => SplitMix64::from_entropy(),
        };
        Sampler { params, rng }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks a token id from `logits`. Non-finite logits are never picked
    /// unless all are; an empty slice gives 0.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        // Candidates: (id, logit), finite only, sorted by logit descending.
        let mut candidates: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l))
            .collect();
        if candidates.is_empty() {
            return argmax(logits);
        }
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1));
        // Top-k: keep the k most likely.
        if self.params.top_k > 0 && candidates.len() > self.params.top_k {
            candidates.truncate(self.params.top_k);
        }
        // Softmax with temperature, relative to the largest logit.
        let max = candidates[0].1;
        let temperature = self.params.temperature;
        let mut probs: Vec<f64> = candidates
            .iter()
            .map(|&(_, l)| (((l - max) / temperature) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        // Top-p: the smallest prefix whose mass reaches top_p.
        if self.params.top_p < 1.0 {
            let mut mass = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                mass += p;
                if mass >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            candidates.truncate(keep);
        }
        // Draw from what is left.
        let kept_mass: f64 = probs.iter().sum();
        let mut target = self.rng.next_f64() * kept_mass;
        for (i, p) in probs.iter().enumerate() {
            if target < *p {
                return candidates[i].0;
            }
            target -= p;
        }
        candidates[candidates.len() - 1].0
    }
}

/// Index of the largest logit (the first one on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if l > best_value {
            best = i;
            best_value = l;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_k,
            seed: Some(seed),
        }
    }

    #[test]
    fn greedy_picks_the_largest() {
        let mut s = Sampler::new(params(0.0, 0, 1.0, 1));
        assert_eq!(s.sample(&[0.1, 3.0, f32::NAN, 2.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, seed));
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(params(5.0, 1, 1.0, 3));
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.9]), 1);
        }
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let mut s = Sampler::new(params(5.0, 0, 0.01, 3));
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.9]), 1);
        }
    }

    #[test]
    fn empty_logits_do_not_panic() {
        let mut s = Sampler::new(params(1.0, 0, 1.0, 3));
        assert_eq!(s.sample(&[]), 0);
    }
}
