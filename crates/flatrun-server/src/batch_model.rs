//! The lower-level model interface the batch scheduler drives.
//!
//! A runtime plugs into the server by implementing two traits:
//!
//! - [`TextModel`] (shared, `&self`, called from HTTP handlers at any time):
//!   name, context length, tokenizer, chat template, end-of-generation tokens.
//! - [`BatchModel`] (owned by the scheduler thread, `&mut self`): sequences
//!   with their own KV cache, and [`BatchModel::step`], which runs **one pass
//!   through the layers for every sequence in the batch** and returns the
//!   logits of each sequence's last new position.
//!
//! [`crate::BatchEngine`] turns the pair into an [`crate::Engine`].
//!
//! # Contract of `step`
//!
//! The scheduler calls `step` with at most one [`StepInput`] per live
//! sequence. A sequence that is still reading its prompt gets a chunk of it
//! (up to [`crate::SchedulerConfig::prefill_chunk`] tokens); a decoding
//! sequence gets the one token sampled at the previous step. The model
//! appends every given token to that sequence's KV cache (positions continue
//! where the sequence left off) and returns, in the same order as `batch`,
//! the logits (`vocab_size` floats) of the last given position for each input
//! with `logits_needed`, and an empty vector for the others (intermediate
//! prompt chunks). A streaming runtime should load each layer once per call
//! and apply it to every sequence of the batch.
//!
//! # Speculative decoding
//!
//! A model whose [`BatchModel::speculates`] is true lets the scheduler
//! (configured with [`crate::SchedulerConfig::speculation`]) check several
//! proposed tokens per sequence in one pass: once no sequence of the batch
//! is reading its prompt, each decoding sequence is given its last sampled
//! token followed by up to `draft_max` proposals (prompt lookup, or the
//! model's own draft through [`BatchModel::propose`]), and
//! [`BatchModel::verify`] returns the logits of every position. The
//! scheduler keeps the proposals the sampler accepts (greedy: those it
//! would have picked; sampling: speculative sampling, which keeps the
//! target's distribution), plus the target's own next token, and
//! [`BatchModel::truncate`]s the rest away.
//!
//! `new_sequence` is told how many positions the sequence will ever hold
//! (its prompt plus `max_tokens`, never more than the context), so a runtime
//! can size its KV cache to the request instead of the whole context.
//! `free` releases the KV cache of a sequence; the scheduler calls it exactly
//! once per sequence, when the generation ends or its client went away.
//!
//! Sampling (`flatrun_model::sampling`), stop strings and streaming
//! detokenization are the scheduler's; a model only provides the logits and,
//! through [`TextModel::stream_decoder`], its tokenizer's streaming decoder.

use std::sync::Arc;

use flatrun_model::chat_template::ChatMessage;
use flatrun_model::chat_template::tools::ToolSyntax;
use flatrun_model::sampling::{TokenLogprobs, Vocabulary};
use flatrun_model::tokenizer::StreamDecoder;

/// Identifies a sequence (a KV cache) inside a [`BatchModel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// New tokens of one sequence for one [`BatchModel::step`].
#[derive(Clone, Copy, Debug)]
pub struct StepInput<'a> {
    pub seq: SeqId,
    /// Tokens to append, at the sequence's next positions.
    pub tokens: &'a [u32],
    /// Whether the logits of the last of `tokens` are wanted.
    pub logits_needed: bool,
}

/// A failure inside the model (reported to every sequence of the failed step).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("model error: {0}")]
pub struct ModelError(pub String);

/// How much of the model's weights is in memory, for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Residency {
    pub resident_bytes: u64,
    pub total_bytes: u64,
}

/// The text side of a model: shared by every request handler.
pub trait TextModel: Send + Sync + 'static {
    /// The name clients use in the `model` field.
    fn model_name(&self) -> &str;
    /// Context length in tokens.
    fn context_length(&self) -> usize;
    /// Text to token ids; `add_special` adds BOS where the model wants it.
    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ModelError>;
    /// Token ids to text (invalid UTF-8 replaced by U+FFFD).
    fn detokenize(&self, tokens: &[u32]) -> Result<String, ModelError>;
    /// The chat template over `messages`, with the assistant prompt appended.
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, ModelError>;
    /// The chat template over `messages` with tool definitions; `None`
    /// when the template cannot take tools.
    fn render_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: &serde_json::Value,
    ) -> Option<Result<String, ModelError>> {
        let _ = (messages, tools);
        None
    }
    /// How the model writes tool calls, when its template teaches it.
    fn tool_syntax(&self) -> Option<ToolSyntax> {
        None
    }
    /// Vocabulary size, when known.
    fn vocab_size(&self) -> Option<usize> {
        None
    }
    /// Every token's bytes in id order, when known (grammars need them).
    fn vocabulary(&self) -> Option<Arc<Vocabulary>> {
        None
    }
    /// True for tokens that end a generation (EOS, `<|im_end|>`, ...).
    fn is_end_of_generation(&self, token: u32) -> bool;
    /// A streaming detokenizer for one generation (for a Flatrun model:
    /// its tokenizer's [`StreamDecoder`]).
    fn stream_decoder(&self) -> Box<dyn TokenTextStream + '_>;
}

/// Turns the tokens of one generation into text as they arrive, never
/// splitting a UTF-8 character.
pub trait TokenTextStream {
    /// Feeds one token; returns the text it completes (possibly empty).
    fn push(&mut self, token: u32) -> String;
    /// Whatever is still held back at the end of the generation.
    fn finish(self: Box<Self>) -> String;
}

impl TokenTextStream for StreamDecoder<'_> {
    fn push(&mut self, token: u32) -> String {
        StreamDecoder::push(self, token).unwrap_or_default()
    }
    fn finish(self: Box<Self>) -> String {
        StreamDecoder::finish(*self)
    }
}

/// What [`BatchModel::shift`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shifted {
    /// The cache was shifted in place (its keys re-rotated).
    Rotated,
    /// Nothing changed, for this reason: the kept tokens must be computed
    /// again.
    Recompute(String),
}

/// The compute side of a model: owned by the scheduler thread.
pub trait BatchModel: Send + 'static {
    /// Opens a new, empty sequence that will hold at most `positions`
    /// tokens (prompt plus `max_tokens`, at most the context length).
    fn new_sequence(&mut self, positions: usize) -> Result<SeqId, ModelError>;
    /// Runs one pass through the layers for the whole batch (see the module
    /// docs for the contract).
    fn step(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Vec<f32>>, ModelError>;
    /// Releases a sequence and its KV cache.
    fn free(&mut self, seq: SeqId);
    /// Whether [`BatchModel::fork`] can work at all (false for models whose
    /// state cannot be cut at a prefix); the scheduler only looks for shared
    /// prefixes when it can.
    fn reuses_prefixes(&self) -> bool {
        false
    }
    /// A new sequence of `positions` positions that starts with the first
    /// `len` tokens of `source` and their KV cache (copied; `source` stays
    /// as it is), so that feeding it the rest of a prompt gives what a fresh
    /// sequence fed the whole prompt would. `None` when this model cannot
    /// give that prefix (the scheduler then prefills the whole prompt).
    fn fork(
        &mut self,
        source: SeqId,
        len: usize,
        positions: usize,
    ) -> Option<Result<SeqId, ModelError>> {
        let _ = (source, len, positions);
        None
    }
    /// Context shift of `seq` in place: its first `keep` cached tokens
    /// stay, the `dropped` after them go, and the later ones move down by
    /// `dropped` positions with their KV (keys re-rotated to the new
    /// positions), so that `seq` goes on as if it had computed the kept
    /// tokens there. [`Shifted::Recompute`] (and `seq` unchanged) when this
    /// model cannot: the scheduler then feeds the kept tokens to a new
    /// sequence.
    fn shift(&mut self, seq: SeqId, keep: usize, dropped: usize) -> Result<Shifted, ModelError> {
        let _ = (seq, keep, dropped);
        Ok(Shifted::Recompute(
            "the model cannot shift a cache in place".into(),
        ))
    }
    /// Whether [`BatchModel::verify`] and [`BatchModel::truncate`] work, so
    /// that the scheduler may speculate (see the module docs).
    fn speculates(&self) -> bool {
        false
    }
    /// A speculative verification pass: [`BatchModel::step`] for decoding
    /// sequences, each given its last sampled token and the proposals after
    /// it, returning for every input the logits of **each** given position
    /// (`tokens.len()` rows of `vocab_size` floats, one after the other),
    /// each as a step of that one token would give it, so that accepting a
    /// proposal the target would have picked itself changes nothing.
    fn verify(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        let _ = batch;
        Err(ModelError("this model cannot verify proposals".into()))
    }
    /// Drops the positions of `seq` from `len` on (the proposals a
    /// verification pass rejected), as if they had never been fed.
    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), ModelError> {
        let _ = (seq, len);
        Err(ModelError("this model cannot drop positions".into()))
    }
    /// Whether [`BatchModel::propose`] has a draft model behind it.
    fn has_draft(&self) -> bool {
        false
    }
    /// Up to `max` tokens the model's draft model proposes after `context`
    /// (every token of `seq` so far, the one about to be fed included),
    /// each its most likely next token.
    fn propose(&mut self, seq: SeqId, context: &[u32], max: usize) -> Result<Vec<u32>, ModelError> {
        let _ = (seq, context, max);
        Ok(Vec::new())
    }
    /// Bytes the KV cache of `seq` occupies (its written positions).
    fn kv_bytes(&self, seq: SeqId) -> u64 {
        let _ = seq;
        0
    }
    /// One L2-normalized embedding per input, pooled as the model says
    /// (every input run as a fresh sequence, together through the layers);
    /// `None` when the model cannot.
    fn embed(&mut self, inputs: &[Vec<u32>]) -> Option<Result<Vec<Vec<f32>>, ModelError>> {
        let _ = inputs;
        None
    }
    /// Teacher-forced log-probabilities of `tokens[1..]` with the `top`
    /// most likely tokens at each position (a fresh sequence); `None` when
    /// the model cannot.
    fn score(
        &mut self,
        tokens: &[u32],
        top: usize,
    ) -> Option<Result<Vec<TokenLogprobs>, ModelError>> {
        let _ = (tokens, top);
        None
    }
    /// Weight residency, if the model tracks it.
    fn residency(&self) -> Option<Residency> {
        None
    }
}
