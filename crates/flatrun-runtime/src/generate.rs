//! Streaming generation: [`Generation`] is an iterator of [`TokenEvent`]s.

use crate::error::{Result, RuntimeError};
use crate::executor::{Sequence, StepOptions};
use crate::model::Model;

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
    /// Temperature (0 = greedy arg-max), seed and truncation.
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: u64,
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
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
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

/// Why generation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new` tokens were generated.
    Length,
    /// An end-of-generation token.
    Eos,
    /// A stop string matched.
    Stop(String),
    /// The context is full.
    Context,
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
    /// Raw bytes not yet emitted (incomplete UTF-8 or a possible stop prefix).
    held: Vec<u8>,
    rng: u64,
    finished: bool,
}

impl<'m> Generation<'m> {
    pub(crate) fn new(model: &'m mut Model, seq: Sequence, prompt: Vec<u32>, opts: GenerateOptions) -> Result<Self> {
        if prompt.is_empty() {
            return Err(RuntimeError::EmptyStep);
        }
        let rng = opts.seed ^ 0x9E37_79B9_7F4A_7C15;
        Ok(Generation {
            model,
            seq,
            pending: prompt,
            opts,
            generated: 0,
            held: Vec::new(),
            rng,
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
        let out = self
            .model
            .executor
            .step(&mut self.seq, &tokens, StepOptions::default())?;
        let t0 = std::time::Instant::now();
        let id = self.sample(&out.logits);
        self.model.executor.profiler.record_other("sampling", t0.elapsed());
        self.generated += 1;
        self.pending = vec![id];

        let tok = self.model.tokenizer()?;
        let is_eos = self.opts.stop_at_eos && tok.stop_ids().contains(&id);
        if !is_eos {
            self.held.extend_from_slice(&tok.token_to_piece(id));
        }
        let mut finish = if is_eos {
            Some(FinishReason::Eos)
        } else if self.generated >= self.opts.max_new {
            Some(FinishReason::Length)
        } else {
            None
        };
        // Emit the held bytes up to a stop string, an incomplete UTF-8
        // sequence, or a suffix that could still become a stop string.
        let text = String::from_utf8_lossy(&self.held).into_owned();
        let valid_len = match std::str::from_utf8(&self.held) {
            Ok(_) => self.held.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => self.held.len(),
        };
        let mut emit_len = if finish.is_some() { text.len() } else { valid_len.min(text.len()) };
        for stop in &self.opts.stop {
            if let Some(at) = text.find(stop.as_str()) {
                if at <= emit_len {
                    emit_len = at;
                    finish = Some(FinishReason::Stop(stop.clone()));
                }
            }
        }
        if !matches!(finish, Some(FinishReason::Stop(_))) && finish.is_none() {
            // Hold back a tail that is a prefix of some stop string.
            for stop in &self.opts.stop {
                for k in (1..stop.len()).rev() {
                    if stop.is_char_boundary(k) && text[..emit_len].ends_with(&stop[..k]) {
                        emit_len = emit_len.min(emit_len - k);
                        break;
                    }
                }
            }
        }
        let emitted = text[..emit_len].to_string();
        self.held = text.as_bytes()[emit_len..].to_vec();
        if finish.is_some() {
            self.finished = true;
            self.held.clear();
        }
        Ok(Some(TokenEvent {
            id,
            text: emitted,
            finish,
        }))
    }

    /// Greedy arg-max, or temperature / top-k / top-p sampling.
    fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.opts.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / self.opts.temperature))
            .collect();
        let k = if self.opts.top_k == 0 { cand.len() } else { self.opts.top_k.min(cand.len()) };
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
            cand.truncate(k);
        }
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
        let max = cand.first().map_or(0.0, |c| c.1);
        let mut probs: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        let mut cum = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            cum += p;
            if cum >= self.opts.top_p {
                keep = i + 1;
                break;
            }
        }
        let total: f32 = probs[..keep].iter().sum();
        // xorshift64* step
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = (self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
        let mut acc = 0.0;
        for (i, p) in probs[..keep].iter().enumerate() {
            acc += p / total;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
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
