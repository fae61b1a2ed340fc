//! Speculative decoding: a cheap proposer guesses the next few tokens, and
//! one pass of the target model over the pending token and the guesses
//! checks them all at once. A pass through the layers costs about the same
//! for one position as for a handful (the weights are read once either way:
//! from disk when streaming, from RAM when resident), so every accepted guess
//! is a token for nearly nothing.
//!
//! Proposers ([`Proposer`]): prompt lookup ([`PromptLookup`], n-gram matches
//! in the text so far) and a small draft model sharing the target's
//! vocabulary ([`DraftProposer`]). Verification is exact: greedy output is
//! token for token the output without speculation, and sampled output keeps
//! the target's distribution (speculative sampling, see
//! [`flatrun_model::sampling::Verdict`]).

pub(crate) mod draft;
mod lookup;

pub(crate) use draft::{DraftProposer, check_same_vocabulary};
pub(crate) use lookup::PromptLookup;

use crate::error::Result;
use flatrun_model::sampling::Distribution;
use std::time::Duration;

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
    /// The draft model attached with [`crate::Model::set_draft`].
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

/// What a proposer guesses.
#[derive(Clone, Debug, Default)]
pub(crate) struct Proposal {
    /// The proposed tokens, in order.
    pub(crate) tokens: Vec<u32>,
    /// For sampled proposals, the distribution each was drawn from (one per
    /// token); `None` when the tokens were chosen without sampling (each is
    /// then a certain draw).
    pub(crate) drafts: Option<Vec<Distribution>>,
}

/// A source of proposed continuations.
pub(crate) trait Proposer {
    /// Up to `max` tokens likely to follow `context` (every token so far,
    /// the one about to be fed included).
    fn propose(&mut self, context: &[u32], max: usize) -> Result<Proposal>;
}

/// How speculation went, summed over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpeculativeStats {
    /// Verification passes (each one pass through the layers).
    pub passes: usize,
    /// Tokens proposed.
    pub proposed: usize,
    /// Proposals accepted.
    pub accepted: usize,
    /// Tokens emitted by those passes (accepted proposals plus the target's
    /// own token after them).
    pub emitted: usize,
    /// Time spent proposing (the draft model's passes; lookups are
    /// negligible).
    pub propose_time: Duration,
}

impl SpeculativeStats {
    /// Accepted proposals ÷ proposals (0 when none were made).
    pub fn acceptance_rate(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.accepted as f64 / self.proposed as f64
        }
    }

    /// Tokens emitted per verification pass (1 means no gain).
    pub fn tokens_per_pass(&self) -> f64 {
        if self.passes == 0 {
            0.0
        } else {
            self.emitted as f64 / self.passes as f64
        }
    }
}

/// The adaptive number of tokens to propose: it grows by two after a pass
/// that accepted everything and falls to one more than the accepted count
/// after a rejection.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DraftLength {
    current: usize,
    max: usize,
    adaptive: bool,
}

impl DraftLength {
    pub(crate) fn new(spec: &Speculation) -> DraftLength {
        let max = spec.draft_max.max(1);
        DraftLength {
            current: if spec.adaptive { max.min(4) } else { max },
            max,
            adaptive: spec.adaptive,
        }
    }

    pub(crate) fn get(&self) -> usize {
        self.current
    }

    pub(crate) fn update(&mut self, proposed: usize, accepted: usize) {
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
    fn draft_length_grows_on_acceptance_and_shrinks_on_rejection() {
        let mut len = DraftLength::new(&Speculation::lookup(10));
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
        let mut fixed = DraftLength::new(&Speculation {
            adaptive: false,
            ..Speculation::draft(5)
        });
        fixed.update(5, 0);
        assert_eq!(fixed.get(), 5);
    }
}
