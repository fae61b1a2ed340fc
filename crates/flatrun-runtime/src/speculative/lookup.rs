//! Prompt lookup: the text so far predicts itself. When its last few tokens
//! already occurred earlier (in the prompt or in what was generated), the
//! tokens that followed them then are proposed now. No model, no memory; it
//! pays on code edits, summaries, answers that quote their sources and
//! tool-call arguments, where the output copies spans of the input.

use super::{Proposal, Proposer};
use crate::error::Result;

/// N-gram matching against the context.
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
    fn default() -> Self {
        PromptLookup::new(3, 1)
    }
}

impl Proposer for PromptLookup {
    fn propose(&mut self, context: &[u32], max: usize) -> Result<Proposal> {
        let tokens = (self.ngram_min..=self.ngram_max)
            .rev()
            .find_map(|n| PromptLookup::continuation(context, n, max))
            .map(<[u32]>::to_vec)
            .unwrap_or_default();
        Ok(Proposal {
            tokens,
            drafts: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_match_of_the_longest_key() {
        let mut lookup = PromptLookup::new(3, 1);
        // "1 2 3 4 5 ... 1 2 3 9 ... 2 3" → key "2 3" (3-gram "x 2 3" does not
        // recur), latest earlier match is followed by 9.
        let context = [1, 2, 3, 4, 5, 7, 1, 2, 3, 9, 8, 6, 2, 3];
        assert_eq!(lookup.propose(&context, 2).unwrap().tokens, vec![9, 8]);
        // A 3-gram match wins over shorter ones.
        let context = [5, 2, 3, 4, 1, 2, 3, 9, 0, 5, 2, 3];
        assert_eq!(lookup.propose(&context, 3).unwrap().tokens, vec![4, 1, 2]);
        // Nothing recurs: no proposal.
        assert!(lookup.propose(&[1, 2, 3], 4).unwrap().tokens.is_empty());
        // The continuation stops at the end of the context.
        assert_eq!(lookup.propose(&[7, 8, 7], 5).unwrap().tokens, vec![8, 7]);
    }
}
