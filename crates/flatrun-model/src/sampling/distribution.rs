//! The distribution a [`Sampler`] draws from, made explicit for speculative
//! sampling: a proposal `x` drawn from a draft distribution `q` is accepted
//! with probability `min(1, p(x) / q(x))`, and on rejection the token is drawn
//! from the residual `max(0, p − q)` normalized. The tokens that come out are
//! distributed exactly as draws from `p` (Leviathan et al., Chen et al.,
//! 2023), whatever `q` is.

use super::{Prepared, Sampler, argmax};

/// A probability distribution over token ids.
#[derive(Clone, Debug, PartialEq)]
pub enum Distribution {
    /// All the mass on one token (greedy decoding, or a proposer that
    /// proposes without sampling).
    Certain(u32),
    /// Normalized probabilities of a few ids, sorted by id.
    Sparse { ids: Vec<u32>, probs: Vec<f32> },
    /// Normalized probabilities of every id (index = id).
    Dense(Vec<f32>),
}

impl Distribution {
    /// The probability of `id`.
    pub fn prob(&self, id: u32) -> f32 {
        match self {
            Distribution::Certain(t) => f32::from(u8::from(*t == id)),
            Distribution::Sparse { ids, probs } => {
                ids.binary_search(&id).map(|i| probs[i]).unwrap_or(0.0)
            }
            Distribution::Dense(probs) => probs.get(id as usize).copied().unwrap_or(0.0),
        }
    }

    /// The most likely id (the lowest one on ties).
    pub fn mode(&self) -> u32 {
        match self {
            Distribution::Certain(t) => *t,
            Distribution::Sparse { ids, probs } => ids[argmax(probs) as usize],
            Distribution::Dense(probs) => argmax(probs),
        }
    }

    /// Every `(id, probability)` with a non-zero probability, in id order.
    fn support(&self) -> Box<dyn Iterator<Item = (u32, f32)> + '_> {
        match self {
            Distribution::Certain(t) => Box::new(std::iter::once((*t, 1.0))),
            Distribution::Sparse { ids, probs } => {
                Box::new(ids.iter().copied().zip(probs.iter().copied()))
            }
            Distribution::Dense(probs) => Box::new(
                probs
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| **p > 0.0)
                    .map(|(i, &p)| (i as u32, p)),
            ),
        }
    }
}

/// The outcome of checking one proposed token against the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The proposal stands.
    Accept,
    /// The proposal is rejected; this token (drawn from the residual) takes its place.
    Replace(u32),
}

impl Sampler {
    /// The distribution [`Sampler::sample`] would draw from for these
    /// logits and history (penalties applied to `logits` in place), without
    /// drawing.
    pub fn distribution(&mut self, logits: &mut [f32], history: &[u32]) -> Distribution {
        match self.prepare(logits, history, None) {
            Prepared::Token(id) => Distribution::Certain(id),
            Prepared::Vocabulary { total } => {
                let scale = (1.0 / total) as f32;
                Distribution::Dense(self.weights.iter().map(|&w| w * scale).collect())
            }
            Prepared::Candidates { total } => {
                let mut pairs: Vec<(u32, f32)> = self
                    .candidates
                    .iter()
                    .zip(&self.weights)
                    .map(|(c, &w)| (c.0, (w as f64 / total) as f32))
                    .collect();
                pairs.sort_unstable_by_key(|p| p.0);
                let (ids, probs) = pairs.into_iter().unzip();
                Distribution::Sparse { ids, probs }
            }
        }
    }

    /// A draw from `dist` with this sampler's RNG.
    pub fn draw_from(&mut self, dist: &Distribution) -> u32 {
        match dist {
            Distribution::Certain(t) => *t,
            _ => self
                .draw_weighted(dist.support(), 1.0)
                .unwrap_or_else(|| dist.mode()),
        }
    }

    /// Checks `proposal` at a position whose target logits are `logits`
    /// (penalties applied in place with `history`): greedy sampling accepts
    /// exactly the token [`Sampler::sample`] picks, so speculation changes no
    /// greedy output; otherwise [`Sampler::verify`] against the target's
    /// distribution, `proposal` drawn from `draft` (`None`: chosen with
    /// certainty, as prompt lookup does).
    pub fn check_proposal(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        proposal: u32,
        draft: Option<&Distribution>,
    ) -> Verdict {
        if self.params.temperature <= 0.0 {
            let own = self.sample(logits, history);
            return if own == proposal {
                Verdict::Accept
            } else {
                Verdict::Replace(own)
            };
        }
        let target = self.distribution(logits, history);
        let certain = Distribution::Certain(proposal);
        self.verify(&target, draft.unwrap_or(&certain), proposal)
    }

    /// Speculative sampling's test of `proposal`, drawn from `draft`,
    /// against the `target` distribution: accept with probability
    /// `min(1, p/q)`, otherwise draw the replacement from `max(0, p − q)`.
    /// A `Certain` target (greedy) accepts exactly its own token.
    pub fn verify(
        &mut self,
        target: &Distribution,
        draft: &Distribution,
        proposal: u32,
    ) -> Verdict {
        if let Distribution::Certain(t) = target {
            return if *t == proposal {
                Verdict::Accept
            } else {
                Verdict::Replace(*t)
            };
        }
        let p = target.prob(proposal) as f64;
        let q = draft.prob(proposal) as f64;
        // (q = 0 cannot happen for a proposal drawn from q; such a
        // proposal stands when the target gives it any mass.)
        if p > 0.0 && (q <= 0.0 || p >= q || self.rng.next_f64() * q < p) {
            return Verdict::Accept;
        }
        let residual = target
            .support()
            .map(|(id, pi)| (id, (pi - draft.prob(id)).max(0.0)));
        let total: f64 = target
            .support()
            .map(|(id, pi)| (pi - draft.prob(id)).max(0.0) as f64)
            .sum();
        if total > 0.0
            && let Some(id) = self.draw_weighted(residual, total)
        {
            return Verdict::Replace(id);
        }
        // p ≤ q everywhere means p = q: a rejection is then impossible in
        // exact arithmetic; rounding can get here, and p itself is right.
        Verdict::Replace(self.draw_from(target))
    }

    /// A draw from unnormalized `(id, weight)` pairs summing to `total`.
    fn draw_weighted(
        &mut self,
        pairs: impl Iterator<Item = (u32, f32)>,
        total: f64,
    ) -> Option<u32> {
        let mut target = self.rng.next_f64() * total;
        let mut last = None;
        for (id, w) in pairs {
            if w <= 0.0 {
                continue;
            }
            if target < w as f64 {
                return Some(id);
            }
            target -= w as f64;
            last = Some(id);
        }
        last
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    fn sampler(seed: u64) -> Sampler {
        Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        })
    }

    #[test]
    fn distribution_is_what_sample_draws_from() {
        let logits = vec![0.0f32, 1.0, 2.0, -1.0];
        let d = sampler(1).distribution(&mut logits.clone(), &[]);
        let z: f32 = logits.iter().map(|l| (l - 2.0).exp()).sum();
        for (id, l) in logits.iter().enumerate() {
            assert!((d.prob(id as u32) - (l - 2.0).exp() / z).abs() < 1e-6);
        }
        let greedy = Sampler::new(SamplingParams::default()).distribution(&mut logits.clone(), &[]);
        assert_eq!(greedy, Distribution::Certain(2));
        let mut top_k = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 2,
            ..SamplingParams::default()
        });
        match top_k.distribution(&mut logits.clone(), &[]) {
            Distribution::Sparse { ids, probs } => {
                assert_eq!(ids, vec![1, 2]);
                assert!((probs[0] + probs[1] - 1.0).abs() < 1e-6);
            }
            other => panic!("expected a sparse distribution, got {other:?}"),
        }
    }

    /// Draft proposals verified against the target come out distributed as
    /// the target, whatever the draft (a chi-square test over seeded draws).
    #[test]
    fn speculative_sampling_preserves_the_target() {
        let target = Distribution::Dense(vec![0.5, 0.3, 0.15, 0.05]);
        let drafts = [
            Distribution::Dense(vec![0.1, 0.1, 0.1, 0.7]),
            Distribution::Certain(3),
            Distribution::Sparse {
                ids: vec![0, 2],
                probs: vec![0.2, 0.8],
            },
        ];
        for draft in &drafts {
            let mut s = sampler(42);
            let n = 40_000;
            let mut counts = [0usize; 4];
            for _ in 0..n {
                let x = s.draw_from(draft);
                let out = match s.verify(&target, draft, x) {
                    Verdict::Accept => x,
                    Verdict::Replace(t) => t,
                };
                counts[out as usize] += 1;
            }
            let chi2: f64 = counts
                .iter()
                .enumerate()
                .map(|(i, &c)| {
                    let e = n as f64 * target.prob(i as u32) as f64;
                    (c as f64 - e).powi(2) / e
                })
                .sum();
            // 3 degrees of freedom: P(chi2 > 16.27) = 0.001.
            assert!(
                chi2 < 16.27,
                "draft {draft:?}: counts {counts:?}, chi2 {chi2}"
            );
        }
    }

    #[test]
    fn a_certain_target_accepts_only_its_token() {
        let mut s = sampler(3);
        let t = Distribution::Certain(5);
        assert_eq!(s.verify(&t, &Distribution::Certain(5), 5), Verdict::Accept);
        assert_eq!(
            s.verify(&t, &Distribution::Certain(4), 4),
            Verdict::Replace(5)
        );
    }
}
