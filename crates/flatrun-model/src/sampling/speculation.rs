//! The model-free parts of speculative decoding, shared by the library's
//! generation loop and the server's scheduler: the settings
//! ([`Speculation`]), prompt lookup ([`PromptLookup`], proposals from the
//! text so far) and the adaptive number of tokens to propose
//! ([`DraftLength`]). Checking a
//! proposal is [`crate::sampling::Sampler::check_proposal`].

/// Which proposer speculative decoding uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProposerKind {
    /// N-gram matches against the prompt and the text so far.
    Lookup {
        /// Longest suffix of the text tried as a key.
        ngram_max: usize,
        /// Shortest suffix tried before giving up.
        ngram_min: usize,
    },
    /// The target's draft model: a smaller model with the same vocabulary
    /// (in the library, the one attached with `Model::set_draft`).
    Draft,
}

/// Speculative decoding settings of a generation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Speculation {
    /// Where proposals come from.
    pub proposer: ProposerKind,
    /// Most tokens proposed per pass.
    pub draft_max: usize,
    /// Grow the number proposed while every proposal is accepted and shrink
    /// it on a rejection (between 1 and `draft_max`); `false` always
    /// proposes `draft_max`.
    pub adaptive: bool,
}

impl Speculation {
    /// Prompt lookup with keys of 1–3 tokens, up to `draft_max` proposals.
    pub fn lookup(draft_max: usize) -> Speculation {
        Speculation {
            proposer: ProposerKind::Lookup {
                ngram_max: 3,
                ngram_min: 1,
            },
            draft_max,
            adaptive: true,
        }
    }

    /// The attached draft model, up to `draft_max` proposals.
    pub fn draft(draft_max: usize) -> Speculation {
        Speculation {
            proposer: ProposerKind::Draft,
            draft_max,
            adaptive: true,
        }
    }
}

/// Prompt lookup: the text so far predicts itself. When its last few tokens
/// already occurred earlier (in the prompt or in what was generated), the
/// tokens that followed them then are proposed now. No model, no memory; it
/// pays on code edits, summaries, answers that quote their sources and
/// tool-call arguments, where the output copies spans of the input.
#[derive(Clone, Debug)]
pub struct PromptLookup {
    ngram_max: usize,
    ngram_min: usize,
}

impl PromptLookup {
    /// Keys of `ngram_max` tokens down to `ngram_min` (both at least 1).
    pub fn new(ngram_max: usize, ngram_min: usize) -> PromptLookup {
        let ngram_min = ngram_min.max(1);
        PromptLookup {
            ngram_max: ngram_max.max(ngram_min),
            ngram_min,
        }
    }

    /// Up to `max` tokens likely to follow `context`: what followed the most
    /// recent earlier occurrence of its longest recurring suffix (empty when
    /// no suffix of `ngram_min` tokens or more recurs).
    pub fn propose<'c>(&self, context: &'c [u32], max: usize) -> &'c [u32] {
        (self.ngram_min..=self.ngram_max)
            .rev()
            .find_map(|n| PromptLookup::continuation(context, n, max))
            .unwrap_or_default()
    }

    /// The tokens that followed the most recent earlier occurrence of the
    /// context's last `n` tokens, at most `max` of them.
    fn continuation(context: &[u32], n: usize, max: usize) -> Option<&[u32]> {
        if context.len() <= n {
            return None;
        }
        let key = &context[context.len() - n..];
        // Occurrences that end before the key itself, newest first.
        (0..context.len() - n)
            .rev()
            .find(|&start| &context[start..start + n] == key)
            .map(|start| {
                let from = start + n;
                &context[from..(from + max).min(context.len())]
            })
    }
}

impl Default for PromptLookup {
    /// Keys of 3 tokens down to 1.
    fn default() -> Self {
        PromptLookup::new(3, 1)
    }
}

/// The adaptive number of tokens to propose: it grows by two after a pass
/// that accepted everything and falls to one more than the accepted count
/// after a rejection, between 1 and its maximum; a fixed length always
/// proposes the maximum.
#[derive(Clone, Copy, Debug)]
pub struct DraftLength {
    current: usize,
    max: usize,
    adaptive: bool,
}

impl DraftLength {
    /// Starts at 4 (or `max` when smaller, or when not `adaptive`).
    pub fn new(max: usize, adaptive: bool) -> DraftLength {
        let max = max.max(1);
        DraftLength {
            current: if adaptive { max.min(4) } else { max },
            max,
            adaptive,
        }
    }

    /// Tokens to propose at the next pass.
    pub fn get(&self) -> usize {
        self.current
    }

    /// Takes the outcome of a pass: `accepted` of `proposed` tokens kept.
    pub fn update(&mut self, proposed: usize, accepted: usize) {
        if !self.adaptive || proposed == 0 {
            return;
        }
        self.current = if accepted == proposed {
            (self.current + 2).min(self.max)
        } else {
            (accepted + 1).clamp(1, self.max)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_match_of_the_longest_key() {
        let lookup = PromptLookup::new(3, 1);
        // "1 2 3 4 5 ... 1 2 3 9 ... 2 3" → key "2 3" (3-gram "x 2 3" does not
        // recur), latest earlier match is followed by 9.
        let context = [1, 2, 3, 4, 5, 7, 1, 2, 3, 9, 8, 6, 2, 3];
        assert_eq!(lookup.propose(&context, 2), [9, 8]);
        // A 3-gram match wins over shorter ones.
        let context = [5, 2, 3, 4, 1, 2, 3, 9, 0, 5, 2, 3];
        assert_eq!(lookup.propose(&context, 3), [4, 1, 2]);
        // Nothing recurs: no proposal.
        assert!(lookup.propose(&[1, 2, 3], 4).is_empty());
        // The continuation stops at the end of the context.
        assert_eq!(lookup.propose(&[7, 8, 7], 5), [8, 7]);
    }

    #[test]
    fn draft_length_grows_on_acceptance_and_shrinks_on_rejection() {
        let mut len = DraftLength::new(10, true);
        assert_eq!(len.get(), 4);
        len.update(4, 4);
        assert_eq!(len.get(), 6);
        len.update(6, 6);
        len.update(8, 8);
        assert_eq!(len.get(), 10);
        len.update(10, 2);
        assert_eq!(len.get(), 3);
        len.update(3, 0);
        assert_eq!(len.get(), 1);
        let mut fixed = DraftLength::new(5, false);
        fixed.update(5, 0);
        assert_eq!(fixed.get(), 5);
    }
}
