//! Streaming generation: [`Generation`] is an iterator of [`TokenEvent`]s.

use crate::error::{Result, RuntimeError};
use crate::executor::{Sequence, StepOptions};
use crate::model::Model;
use flatrun_model::sampling::{FinishReason, Sampler, SamplingParams, StopMatcher};

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Text, tokenized with the checkpoint's BOS rule.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Prompt {
        Prompt::Text(s.to_string())
    }
}
impl From<String> for Prompt {
    fn from(s: String) -> Prompt {
        Prompt::Text(s)
    }
}
impl From<Vec<u32>> for Prompt {
    fn from(ids: Vec<u32>) -> Prompt {
        Prompt::Tokens(ids)
    }
}
impl From<&[u32]> for Prompt {
    fn from(ids: &[u32]) -> Prompt {
        Prompt::Tokens(ids.to_vec())
    }
}

/// Settings of one generation.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Temperature, truncation, penalties and seed (default: greedy).
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_new: usize,
    /// Stop strings (the text before them is emitted, they are not).
    pub stop: Vec<String>,
    /// Stop at the tokenizer's end-of-generation ids.
    pub stop_at_eos: bool,
}

impl GenerateOptions {
    /// Greedy decoding of up to `max_new` tokens.
    pub fn greedy(max_new: usize) -> GenerateOptions {
        GenerateOptions {
            sampling: SamplingParams::default(),
            max_new,
            stop: Vec::new(),
            stop_at_eos: true,
        }
    }
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions::greedy(128)
    }
}

/// One generated token.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    /// Its id.
    pub id: u32,
    /// The text it completes (may be empty while a UTF-8 sequence or a
    /// possible stop string is pending).
    pub text: String,
    /// Set on the last event.
    pub finish: Option<FinishReason>,
}

/// Streaming generation; each `next()` runs one step.
pub struct Generation<'m> {
    model: &'m mut Model,
    seq: Sequence,
    /// Tokens to feed at the next step (the prompt, then the last sample).
    pending: Vec<u32>,
    opts: GenerateOptions,
    generated: usize,
    /// Raw bytes of an incomplete UTF-8 sequence not yet emitted.
    held: Vec<u8>,
    sampler: Sampler,
    stops: StopMatcher,
    finished: bool,
}

impl<'m> Generation<'m> {
    pub(crate) fn new(
        model: &'m mut Model,
        seq: Sequence,
        prompt: Vec<u32>,
        opts: GenerateOptions,
    ) -> Result<Self> {
        if prompt.is_empty() {
            return Err(RuntimeError::EmptyStep);
        }
        let sampler = Sampler::new(opts.sampling.clone());
        let stops = StopMatcher::new(opts.stop.iter().cloned());
        Ok(Generation {
            model,
            seq,
            pending: prompt,
            opts,
            generated: 0,
            held: Vec::new(),
            sampler,
            stops,
            finished: false,
        })
    }

    /// The sequence so far (prompt and generated tokens that were fed back).
    pub fn sequence(&self) -> &Sequence {
        &self.seq
    }

    /// The model (for its profiler).
    pub fn model(&self) -> &Model {
        self.model
    }

    /// End the generation and take the sequence back: every token fed so
    /// far (the last sampled token has not been fed yet).
    pub fn into_sequence(self) -> Sequence {
        self.seq
    }

    fn next_token(&mut self) -> Result<Option<TokenEvent>> {
        if self.finished {
            return Ok(None);
        }
        if self.seq.len() + self.pending.len() > self.seq.capacity() {
            self.finished = true;
            return Ok(Some(TokenEvent {
                id: 0,
                text: String::from_utf8_lossy(&std::mem::take(&mut self.held)).into_owned(),
                finish: Some(FinishReason::Context),
            }));
        }
        let tokens = std::mem::take(&mut self.pending);
        let mut out = self
            .model
            .executor
            .step(&mut self.seq, &tokens, StepOptions::default())?;
        // Pick the next token.
        let t0 = std::time::Instant::now();
        let id = self.sampler.sample(&mut out.logits, self.seq.tokens());
        self.model
            .executor
            .profiler
            .record_other("sampling", t0.elapsed());
        self.generated += 1;
        self.pending = vec![id];

        let tok = self.model.tokenizer()?;
        let is_eos = self.opts.stop_at_eos && tok.stop_ids().contains(&id);
        let mut finish = if is_eos {
            Some(FinishReason::Eos)
        } else if self.generated >= self.opts.max_new {
            Some(FinishReason::Length)
        } else {
            None
        };
        // Complete UTF-8 text so far (an incomplete sequence is held back).
        if !is_eos {
            self.held.extend_from_slice(&tok.token_to_piece(id));
        }
        let complete = match std::str::from_utf8(&self.held) {
            Ok(_) => self.held.len(),
            Err(e) if e.error_len().is_none() && finish.is_none() => e.valid_up_to(),
            Err(_) => self.held.len(),
        };
        let piece = String::from_utf8_lossy(&self.held[..complete]).into_owned();
        self.held.drain(..complete);
        // Stop strings may span tokens: the matcher holds back possible prefixes.
        let matched = self.stops.push(&piece);
        let mut text = matched.emit;
        if matched.stopped {
            finish = Some(FinishReason::Stop(
                self.opts
                    .stop
                    .iter()
                    .find(|s| !s.is_empty())
                    .cloned()
                    .unwrap_or_default(),
            ));
        } else if finish.is_some() {
            text.push_str(&self.stops.finish());
        }
        if finish.is_some() {
            self.finished = true;
        }
        Ok(Some(TokenEvent { id, text, finish }))
    }
}

/// Index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Iterator for Generation<'_> {
    type Item = Result<TokenEvent>;
    fn next(&mut self) -> Option<Self::Item> {
        match self.next_token() {
            Ok(Some(ev)) => Some(Ok(ev)),
            Ok(None) => None,
            Err(e) => {
                self.finished = true;
                Some(Err(e))
            }
        }
    }
}
