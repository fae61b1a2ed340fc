//! A draft model as proposer: a smaller model with the target's vocabulary
//! runs a few tokens ahead, one at a time, and the target checks them in one
//! pass. The draft keeps its own sequence (and KV cache) across passes and
//! only re-feeds what changed since its last proposal.

use super::{Proposal, Proposer};
use crate::error::{Result, RuntimeError};
use crate::executor::{Sequence, StepOptions};
use crate::model::Model;
use flatrun_model::sampling::{Sampler, SamplingParams};
use flatrun_model::tokenizer::Tokenizer;

/// Refuse a draft whose tokens are not the target's: the same ids must
/// spell the same bytes, or the target would verify a different text than
/// the draft proposed.
pub fn check_same_vocabulary(target: &Tokenizer, draft: &Tokenizer) -> Result<()> {
    if target.vocab_size() != draft.vocab_size() {
        return Err(RuntimeError::Draft(format!(
            "its vocabulary has {} tokens, the target's {}; a draft must share the target's tokenizer",
            draft.vocab_size(),
            target.vocab_size()
        )));
    }
    let differs = (0..target.vocab_size() as u32)
        .find(|&id| target.token_to_piece(id) != draft.token_to_piece(id));
    if let Some(id) = differs {
        return Err(RuntimeError::Draft(format!(
            "token {id} is {:?} in the draft but {:?} in the target; a draft must share the target's tokenizer",
            String::from_utf8_lossy(&draft.token_to_piece(id)),
            String::from_utf8_lossy(&target.token_to_piece(id)),
        )));
    }
    Ok(())
}

/// The draft's side of one generation: its sequence and its sampler.
#[derive(Debug)]
pub struct DraftState {
    seq: Sequence,
    sampler: Sampler,
}

impl DraftState {
    /// A fresh draft sequence of at most `positions` positions; the draft
    /// samples with the target's settings (its own RNG stream), so its
    /// proposals follow the distribution speculative sampling corrects.
    pub(crate) fn new(draft: &Model, sampling: &SamplingParams, positions: usize) -> DraftState {
        let mut params = sampling.clone();
        params.seed = params.seed.map(|s| s ^ 0x9e37_79b9_7f4a_7c15);
        DraftState {
            seq: draft.executor().new_sequence_with_capacity(positions),
            sampler: Sampler::new(params),
        }
    }
}

/// A draft model proposing for one generation.
pub struct DraftProposer<'a> {
    model: &'a mut Model,
    state: &'a mut DraftState,
}

impl<'a> DraftProposer<'a> {
    pub(crate) fn new(model: &'a mut Model, state: &'a mut DraftState) -> DraftProposer<'a> {
        DraftProposer { model, state }
    }
}

impl Proposer for DraftProposer<'_> {
    fn propose(&mut self, context: &[u32], max: usize) -> Result<Proposal> {
        let seq = &mut self.state.seq;
        // Room in the draft's own context for the context and the proposals.
        let max = max.min(seq.capacity().saturating_sub(context.len()));
        if max == 0 || context.is_empty() {
            return Ok(Proposal::default());
        }
        // Keep what the draft already evaluated of this context; feed the rest
        // (at least the last token, whose logits start the proposal).
        let common = seq
            .tokens()
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        seq.truncate(common);
        let executor = self.model.executor_mut();
        let mut logits = executor
            .step(seq, &context[common..], StepOptions::default())?
            .logits;
        let mut history = context.to_vec();
        let mut tokens = Vec::with_capacity(max);
        let mut drafts = Vec::with_capacity(max);
        for i in 0..max {
            let dist = self.state.sampler.distribution(&mut logits, &history);
            let id = self.state.sampler.draw_from(&dist);
            tokens.push(id);
            drafts.push(dist);
            history.push(id);
            if i + 1 < max {
                logits = executor.step(seq, &[id], StepOptions::default())?.logits;
            }
        }
        Ok(Proposal {
            tokens,
            drafts: Some(drafts),
        })
    }
}
