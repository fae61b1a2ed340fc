//! Prompt lookup as a proposer ([`flatrun_model::sampling::PromptLookup`]).

use super::{Proposal, Proposer};
use crate::error::Result;
pub(crate) use flatrun_model::sampling::PromptLookup;

impl Proposer for PromptLookup {
    fn propose(&mut self, context: &[u32], max: usize) -> Result<Proposal> {
        Ok(Proposal {
            tokens: PromptLookup::propose(self, context, max).to_vec(),
            drafts: None,
        })
    }
}
