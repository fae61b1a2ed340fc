//! Log-probabilities of a step: the model's log-softmax over the raw
//! logits (before penalties, biases, temperature or truncation), as the
//! OpenAI API reports them.

/// The log-probability of the chosen token and of the most likely ones.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The token that was chosen.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The `n` most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// `log(sum(exp(logits)))`, ignoring NaN; `-inf` for an empty or all-`-inf` row.
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    if max == f32::INFINITY {
        return f32::INFINITY;
    }
    let sum: f64 = logits
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| ((v - max) as f64).exp())
        .sum();
    max + sum.ln() as f32
}

/// Log-probabilities of `token` and of the `n` most likely tokens of a
/// row of raw logits. One pass for the normalizer, one partial selection
/// for the top `n`; never a full sort.
pub fn token_logprobs(logits: &[f32], token: u32, n: usize) -> TokenLogprobs {
    let norm = log_sum_exp(logits);
    let at = |id: u32| {
        logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&v| v - norm)
    };
    let mut top = Vec::new();
    if n > 0 && !logits.is_empty() {
        let mut ids: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| !logits[i as usize].is_nan())
            .collect();
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let n = n.min(ids.len());
        if n > 0 && n < ids.len() {
            ids.select_nth_unstable_by(n - 1, by_logit);
            ids.truncate(n);
        }
        ids.sort_unstable_by(by_logit);
        top = ids.into_iter().map(|i| (i, at(i))).collect();
    }
    TokenLogprobs {
        token,
        logprob: at(token),
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, f32::NAN, 3.0];
        let lp = token_logprobs(&logits, 2, 3);
        let z: f64 = [1.0f64, 3.0, 2.0, 3.0].iter().map(|v| v.exp()).sum();
        assert!((lp.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 4, 2]);
        let total: f64 = (0..5)
            .filter(|&i| i != 3)
            .map(|i| (token_logprobs(&logits, i, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
