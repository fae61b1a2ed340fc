//! Passes that read the model instead of generating: sequence embeddings
//! ([`Model::embed`]) and teacher-forced log-probabilities of a text's own
//! tokens ([`Model::score`]).

use crate::error::{Result, RuntimeError};
use crate::executor::StepOptions;
use crate::model::Model;
use flatrun_model::sampling::{TokenLogprobs, token_logprobs};

/// Tokens of all inputs that go through the layers together in one
/// embedding pass (their KV caches live only for that pass).
const EMBED_BATCH_TOKENS: usize = 2048;

/// Positions whose logits one scoring pass holds at once (each row is a
/// vocabulary's worth of floats).
const SCORE_CHUNK: usize = 64;

impl Model {
    /// One embedding per input: the final-normed hidden states pooled as
    /// the checkpoint's `pooling_type` says (mean when it says nothing),
    /// L2-normalized. Inputs go through each layer together, in batches of
    /// about 2048 tokens, as the sequences of a generation batch do; no
    /// logits are computed.
    pub fn embed(&mut self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let pooling = self.config().pooling;
        if !pooling.pools() {
            return Err(RuntimeError::Pooling(pooling.name()));
        }
        let capacity = self.executor.context_size();
        for input in inputs {
            if input.is_empty() {
                return Err(RuntimeError::EmptyStep);
            }
            if input.len() > capacity {
                return Err(RuntimeError::ContextOverflow {
                    used: 0,
                    new: input.len(),
                    capacity,
                });
            }
        }
        let dim = self.config().n_embd;
        let opts = StepOptions {
            all_hidden: true,
            no_logits: true,
            ..StepOptions::default()
        };
        let mut vectors = Vec::with_capacity(inputs.len());
        let mut start = 0;
        while start < inputs.len() {
            // The next batch: at least one input, then while it fits.
            let mut end = start + 1;
            let mut tokens = inputs[start].len();
            while end < inputs.len() && tokens + inputs[end].len() <= EMBED_BATCH_TOKENS {
                tokens += inputs[end].len();
                end += 1;
            }
            let group = &inputs[start..end];
            let mut sequences: Vec<_> = group
                .iter()
                .map(|t| self.executor.new_sequence_with_capacity(t.len()))
                .collect();
            let mut batch: Vec<_> = sequences
                .iter_mut()
                .zip(group)
                .map(|(seq, t)| (seq, t.as_slice()))
                .collect();
            for out in self.executor.step_batch(&mut batch, opts)? {
                let states = out.all_hidden.unwrap_or_default();
                let vector = pooling
                    .pool(&states, dim)
                    .ok_or(RuntimeError::Pooling(pooling.name()))?;
                vectors.push(vector);
            }
            start = end;
        }
        Ok(vectors)
    }

    /// Teacher-forced log-probabilities of `tokens`: for every token after
    /// the first, its log-softmax under the tokens before it and the `top`
    /// most likely tokens at that position (`tokens.len() - 1` entries; the
    /// first token has no context to be scored in). The values are the raw
    /// model's, before any sampling transform.
    pub fn score(&mut self, tokens: &[u32], top: usize) -> Result<Vec<TokenLogprobs>> {
        let capacity = self.executor.context_size();
        if tokens.len() > capacity {
            return Err(RuntimeError::ContextOverflow {
                used: 0,
                new: tokens.len(),
                capacity,
            });
        }
        let Some(context) = tokens.len().checked_sub(1).filter(|&n| n > 0) else {
            return Ok(Vec::new());
        };
        let vocab = self.executor.vocab_size();
        let mut seq = self.executor.new_sequence_with_capacity(context);
        let opts = StepOptions {
            all_logits: true,
            ..StepOptions::default()
        };
        let mut entries = Vec::with_capacity(context);
        for (c, chunk) in tokens[..context].chunks(SCORE_CHUNK).enumerate() {
            let out = self.executor.step(&mut seq, chunk, opts)?;
            let logits = out.all_logits.unwrap_or_default();
            for (j, row) in logits.chunks_exact(vocab).enumerate() {
                let next = tokens[c * SCORE_CHUNK + j + 1];
                entries.push(token_logprobs(row, next, top));
            }
        }
        Ok(entries)
    }
}
