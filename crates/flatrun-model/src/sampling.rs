//! Choosing the next token from logits: greedy, temperature, top-k, top-p,
//! min-p, repetition / presence / frequency penalties over a window, a
//! per-token logit bias, an optional mask of allowed tokens (grammars), a
//! seeded reproducible RNG, stop strings matched across token boundaries
//! ([`StopMatcher`]) and the log-probabilities of a step
//! ([`token_logprobs`]).
//!
//! The logit processing happens in one order for every caller (CLI,
//! library, server): penalties, then the logit bias, then the allowed-token
//! mask, then greedy or temperature / top-k / top-p / min-p and a draw.
//!
//! Cost per step is linear in the vocabulary and small (0.05–0.4 ms for
//! 150k tokens depending on the mode, `benches/sampling.rs`): softmax weights
//! come from a vectorized `exp` in one pass, a draw skips through block sums,
//! top-p narrows the candidates with a logit window (several window widths
//! tested in one pass) before sorting the few that remain, and top-k counts
//! tokens above a few thresholds in one pass and partially selects the few
//! above the right one; never a full sort of the vocabulary.
//!
//! ```
//! use flatrun_model::sampling::{Sampler, SamplingParams};
//! let mut greedy = Sampler::new(SamplingParams::default());
//! let mut logits = vec![0.1, 2.0, -1.0, 0.5];
//! assert_eq!(greedy.sample(&mut logits, &[]), 1);
//!
//! let params = SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: Some(7), ..Default::default() };
//! let (mut a, mut b) = (Sampler::new(params.clone()), Sampler::new(params));
//! let logits = vec![1.0f32; 1000];
//! for _ in 0..10 {
//!     assert_eq!(a.sample(&mut logits.clone(), &[]), b.sample(&mut logits.clone(), &[]));
//! }
//! ```

mod constraint;
mod distribution;
mod finish;
mod logprobs;
mod rng;
mod speculation;
mod stop;
mod weights;

pub use constraint::{ConstraintFactory, TokenConstraint, Vocabulary};
pub use distribution::{Distribution, Verdict};
pub use finish::FinishReason;
pub use logprobs::{TokenLogprobs, log_sum_exp, token_logprobs};
pub use rng::Xoshiro256;
pub use speculation::{DraftLength, PromptLookup, ProposerKind, Speculation};
pub use stop::{StopMatcher, StopResult};

use std::collections::HashMap;

/// How to pick tokens. The default is greedy decoding with no penalties.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `<= 0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; `>= 1` disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one; `0` disables.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recently seen tokens; `1` disables.
    pub repeat_penalty: f32,
    /// Subtract from the logit of every token seen in the window.
    pub presence_penalty: f32,
    /// Subtract this × the number of times a token was seen in the window.
    pub frequency_penalty: f32,
    /// How many of the most recent tokens the penalties look at (`0` = none).
    pub penalty_window: usize,
    /// Seed for reproducible runs; `None` seeds from the clock.
    pub seed: Option<u64>,
    /// Added to the logit of each listed token after the penalties (OpenAI's
    /// `logit_bias`: -100 bans a token, +100 all but forces it). Ids outside
    /// the vocabulary are ignored.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_window: 64,
            seed: None,
            logit_bias: Vec::new(),
        }
    }
}

/// A token sampler with its own RNG and scratch space.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256,
    /// Candidate (id, logit) pairs of the current step.
    candidates: Vec<(u32, f32)>,
    /// Unnormalized probabilities of the candidates (or of the whole vocabulary).
    weights: Vec<f32>,
    /// Sums of `weights` by block, for a fast draw over the whole vocabulary.
    block_sums: Vec<f32>,
    counts: HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let seed = params.seed.unwrap_or_else(|| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            now ^ (std::process::id() as u64).rotate_left(32)
        });
        Sampler {
            params,
            rng: Xoshiro256::seed_from_u64(seed),
            candidates: Vec::new(),
            weights: Vec::new(),
            block_sums: Vec::new(),
            counts: HashMap::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Pick the next token. `logits` is modified in place by the penalties;
    /// `history` is the sequence so far (prompt and generated ids).
    /// An empty `logits` returns 0.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        self.sample_allowed(logits, history, None)
    }

    /// [`Sampler::sample`] restricted to the tokens whose bit is set in
    /// `allowed` (bit `i % 32` of word `i / 32`; a grammar's mask). When the
    /// mask allows no token of `logits`, the mask is ignored.
    pub fn sample_allowed(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        allowed: Option<&[u32]>,
    ) -> u32 {
        match self.prepare(logits, history, allowed) {
            Prepared::Token(id) => id,
            Prepared::Vocabulary { total } => {
                let target = self.rng.next_f64() * total;
                weights::draw(&self.weights, &self.block_sums, target)
                    .map(|i| i as u32)
                    .unwrap_or_else(|| argmax(logits))
            }
            Prepared::Candidates { total } => {
                let mut target = self.rng.next_f64() * total;
                for (c, &w) in self.candidates.iter().zip(&self.weights) {
                    if target < w as f64 {
                        return c.0;
                    }
                    target -= w as f64;
                }
                self.candidates
                    .last()
                    .map(|c| c.0)
                    .unwrap_or_else(|| argmax(logits))
            }
        }
    }

    /// Steps 1–8 of [`Sampler::sample`] without the draw: the penalties,
    /// the bias and the mask, then either a certain token or the unnormalized weights to draw from
    /// (over the whole vocabulary in `weights`, or over `candidates`).
    fn prepare(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        allowed: Option<&[u32]>,
    ) -> Prepared {
        if logits.is_empty() {
            return Prepared::Token(0);
        }
        // 1. Penalties over the last `penalty_window` tokens, then the bias.
        self.apply_penalties(logits, history);
        for &(id, bias) in &self.params.logit_bias {
            if let Some(logit) = logits.get_mut(id as usize) {
                *logit += bias;
            }
        }
        if let Some(mask) = allowed {
            apply_mask(logits, mask);
        }
        // 2. Greedy: the argmax (lowest id on ties).
        if self.params.temperature <= 0.0 {
            return Prepared::Token(argmax(logits));
        }
        // 3. The best logit, and a floor below which tokens cannot matter:
        //    relative probability under 1e-12 (at temperature ≥ 1), under
        //    min-p, or below the k-th best logit.
        let t = self.params.temperature;
        let max_logit = max_value(logits);
        if max_logit == f32::NEG_INFINITY || max_logit.is_nan() {
            return Prepared::Token(argmax(logits));
        }
        let mut floor = max_logit - NEGLIGIBLE_LOG_PROB * t.max(1.0);
        if self.params.min_p > 0.0 && self.params.min_p <= 1.0 {
            floor = floor.max(max_logit + self.params.min_p.ln());
        }
        let k = self.params.top_k;
        let top_k_active = k > 0 && k < logits.len();
        self.candidates.clear();
        if top_k_active {
            // The tokens at or above the k-th best logit, in id order.
            floor = floor.max(self.collect_top_k(logits, max_logit, k));
            self.candidates.retain(|c| c.1 >= floor);
            self.candidates.sort_unstable_by_key(|c| c.0);
        }
        let top_p = self.params.top_p;
        let top_p_active = top_p > 0.0 && top_p < 1.0;
        // 4. Temperature (and min-p) only: draw from the whole vocabulary's
        //    weights at once, no candidate list.
        if !top_k_active && !top_p_active {
            let total = weights::masked_exp(
                logits,
                max_logit,
                1.0 / t,
                floor,
                &mut self.weights,
                &mut self.block_sums,
            );
            if !(total.is_finite() && total > 0.0) {
                return Prepared::Token(argmax(logits));
            }
            return Prepared::Vocabulary { total };
        }
        // 5. Top-p: the softmax mass (at temperature 1, over the tokens
        //    above the floor) the kept tokens must reach, and a floor that
        //    keeps at least that mass, found by widening a window below the
        //    best logit.
        //    With top-k the candidates above the floor are already known and
        //    few, so the mass comes from them alone.
        let mut top_p_need = None;
        if top_p_active && top_k_active {
            let total = weights::masked_total_of(&self.candidates, logits.len(), max_logit);
            if total.is_finite() && total > 0.0 {
                top_p_need = Some(top_p as f64 * total);
            }
        } else if top_p_active {
            let total = weights::masked_exp(
                logits,
                max_logit,
                1.0,
                floor,
                &mut self.weights,
                &mut self.block_sums,
            );
            if total.is_finite() && total > 0.0 {
                let need = top_p as f64 * total;
                floor = top_p_floor(logits, &self.weights, max_logit, floor, need);
                top_p_need = Some(need);
            }
        }
        // 6. Candidates above the floor; then exactly the top-k of them.
        if !top_k_active {
            weights::collect_at_or_above(logits, floor, &mut self.candidates);
        }
        if top_k_active && k < self.candidates.len() {
            self.candidates
                .select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            self.candidates.truncate(k);
        }
        // 7. Top-p: the most likely candidates until their mass reaches the need.
        if let Some(need) = top_p_need {
            keep_top_p(&mut self.candidates, need, max_logit);
        }
        // 8. Temperature, softmax and a draw.
        self.weights.clear();
        let mut total = 0.0f64;
        for c in &self.candidates {
            let w = weights::exp_non_positive((c.1 - max_logit) / t);
            total += w as f64;
            self.weights.push(w);
        }
        if !(total.is_finite() && total > 0.0) {
            return Prepared::Token(
                self.candidates
                    .iter()
                    .max_by(|a, b| a.1.total_cmp(&b.1))
                    .map(|c| c.0)
                    .unwrap_or_else(|| argmax(logits)),
            );
        }
        Prepared::Candidates { total }
    }

    /// Repetition, presence and frequency penalties, llama.cpp style.
    fn apply_penalties(&mut self, logits: &mut [f32], history: &[u32]) {
        let p = &self.params;
        let active =
            p.repeat_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if !active || p.penalty_window == 0 || history.is_empty() {
            return;
        }
        self.counts.clear();
        let window = &history[history.len().saturating_sub(p.penalty_window)..];
        for &id in window {
            *self.counts.entry(id).or_insert(0) += 1;
        }
        for (&id, &count) in &self.counts {
            let Some(logit) = logits.get_mut(id as usize) else {
                continue;
            };
            if p.repeat_penalty != 1.0 && p.repeat_penalty > 0.0 {
                if *logit > 0.0 {
                    *logit /= p.repeat_penalty;
                } else {
                    *logit *= p.repeat_penalty;
                }
            }
            *logit -= count as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
}

/// What [`Sampler::prepare`] leaves to draw from.
enum Prepared {
    /// No choice: greedy, or nothing finite to weigh.
    Token(u32),
    /// `Sampler::weights` over the whole vocabulary (with `block_sums`).
    Vocabulary { total: f64 },
    /// `Sampler::weights` over `Sampler::candidates`.
    Candidates { total: f64 },
}

/// Sets the logit of every token not allowed by `mask` to `-inf`, unless
/// that would leave no token at all. When the model gives every allowed
/// token `-inf` (a grammar demands what the model rules out), the allowed
/// tokens become equally likely, so the grammar still holds.
fn apply_mask(logits: &mut [f32], mask: &[u32]) {
    let allowed = |i: usize| mask.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1);
    if !(0..logits.len()).any(allowed) {
        return;
    }
    let mut any_finite = false;
    for (i, logit) in logits.iter_mut().enumerate() {
        if !allowed(i) {
            *logit = f32::NEG_INFINITY;
        } else if *logit > f32::NEG_INFINITY {
            any_finite = true;
        }
    }
    if !any_finite {
        for (i, logit) in logits.iter_mut().enumerate() {
            if allowed(i) {
                *logit = 0.0;
            }
        }
    }
}

/// Natural log of the relative probability (1e-12) below which a token is ignored.
const NEGLIGIBLE_LOG_PROB: f32 = 27.6;

/// The first window width below the best logit that top-p tries; each next one is twice as wide.
const TOP_P_FIRST_WIDTH: f32 = 0.5;

/// The highest floor `max - 0.5·2^j` (above `floor`) whose tokens hold at
/// least `need` of the weights, or `floor` when none does. The widths are
/// tried four at a time in one pass over the vocabulary.
fn top_p_floor(logits: &[f32], weights: &[f32], max: f32, floor: f32, need: f64) -> f32 {
    let mut width = TOP_P_FIRST_WIDTH;
    while max - width > floor {
        let mut thresholds = [f32::INFINITY; weights::MASS_THRESHOLDS];
        let mut w = width;
        for t in thresholds.iter_mut() {
            if max - w > floor {
                *t = max - w;
            }
            w *= 2.0;
        }
        let masses = weights::mass_at_or_above_each(logits, weights, &thresholds);
        for (&t, &mass) in thresholds.iter().zip(&masses) {
            if t != f32::INFINITY && mass >= need {
                return t;
            }
        }
        width = w;
    }
    floor
}

impl Sampler {
    /// Put every token whose logit could be among the best `k` into the
    /// candidates (id order not kept) and return the k-th largest logit
    /// (NaN ignored; the smallest one when fewer than `k` are not NaN).
    /// One counting pass picks a threshold `max - 2^j` (j = 0..8) with at least `k`
    /// tokens above it, so only those are collected and partially sorted.
    fn collect_top_k(&mut self, logits: &[f32], max: f32, k: usize) -> f32 {
        let mut thresholds = [f32::NEG_INFINITY; weights::THRESHOLDS];
        let mut width = 1.0f32;
        for t in thresholds.iter_mut() {
            *t = max - width;
            width *= 2.0;
        }
        let counts = weights::count_at_or_above_each(logits, &thresholds);
        let threshold = thresholds
            .iter()
            .zip(&counts)
            .find(|&(_, &count)| count >= k)
            .map(|(&t, _)| t)
            .unwrap_or(f32::NEG_INFINITY);
        weights::collect_at_or_above(logits, threshold, &mut self.candidates);
        if self.candidates.len() >= k {
            let (_, kth, _) = self
                .candidates
                .select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
            kth.1
        } else {
            self.candidates
                .iter()
                .map(|c| c.1)
                .min_by(|a, b| a.total_cmp(b))
                .unwrap_or(f32::NEG_INFINITY)
        }
    }
}

/// Index of the largest logit (the first one on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    // Two simple passes vectorize better than one pass that tracks the index.
    let max = max_value(logits);
    // Find the first chunk of eight that holds it, then the lane.
    let chunks = logits.chunks_exact(8);
    let tail = logits.len() - chunks.remainder().len();
    for (c, chunk) in chunks.enumerate() {
        if chunk.iter().fold(false, |hit, &v| hit | (v == max)) {
            return (c * 8 + chunk.iter().position(|&v| v == max).unwrap_or(0)) as u32;
        }
    }
    logits[tail..]
        .iter()
        .position(|&v| v == max)
        .map_or(0, |i| (tail + i) as u32)
}

/// The largest value, ignoring NaN (`-inf` when there is none). Eight
/// independent lanes, so the compiler can use vector max instructions
/// (`f32::max` in a fold is a serial chain).
fn max_value(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            // A NaN compares false and is skipped.
            *lane = if v > *lane { v } else { *lane };
        }
    }
    lanes
        .iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// Keep the most likely candidates until their softmax mass (at
/// temperature 1) reaches `need`, sorting only a prefix that grows until it
/// holds enough mass.
fn keep_top_p(candidates: &mut Vec<(u32, f32)>, need: f64, max_logit: f32) {
    if candidates.is_empty() {
        return;
    }
    let mut prefix = 64.min(candidates.len());
    loop {
        if prefix < candidates.len() {
            candidates.select_nth_unstable_by(prefix - 1, |a, b| b.1.total_cmp(&a.1));
        }
        candidates[..prefix].sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut mass = 0.0;
        for i in 0..prefix {
            mass += weights::exp_non_positive(candidates[i].1 - max_logit) as f64;
            if mass >= need {
                candidates.truncate(i + 1);
                return;
            }
        }
        if prefix == candidates.len() {
            return;
        }
        prefix = (prefix * 4).min(candidates.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_p_keeps_the_smallest_sufficient_set() {
        let mut c: Vec<(u32, f32)> = (0..1000)
            .map(|i| (i, if i == 7 { 10.0 } else { 0.0 }))
            .collect();
        let total = 1.0 + 999.0 * (-10.0f64).exp();
        keep_top_p(&mut c, 0.5 * total, 10.0);
        assert_eq!(c, vec![(7, 10.0)]);
    }
}
