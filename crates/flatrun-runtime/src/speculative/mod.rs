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

pub use draft::DraftState;
pub(crate) use draft::{DraftProposer, check_same_vocabulary};
pub(crate) use flatrun_model::sampling::DraftLength;
pub use flatrun_model::sampling::{ProposerKind, Speculation};
pub(crate) use lookup::PromptLookup;

use crate::error::Result;
use flatrun_model::sampling::Distribution;
use std::time::Duration;

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
