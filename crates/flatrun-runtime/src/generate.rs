//! Streaming generation: [`Generation`] is an iterator of [`TokenEvent`]s.

use crate::error::{Result, RuntimeError};
use crate::executor::{Sequence, StepOptions};
use crate::model::Model;
use crate::speculative::draft::DraftState;
use crate::speculative::{
    DraftLength, PromptLookup, Proposal, Proposer, ProposerKind, Speculation,
};
use flatrun_model::sampling::{FinishReason, Sampler, SamplingParams, StopMatcher, Verdict};
use std::collections::VecDeque;
use std::time::Instant;

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
    /// Speculative decoding (`None`: one token per pass).
    pub speculation: Option<Speculation>,
}

impl GenerateOptions {
    /// Greedy decoding of up to `max_new` tokens.
    pub fn greedy(max_new: usize) -> GenerateOptions {
        GenerateOptions {
            sampling: SamplingParams::default(),
            max_new,
            stop: Vec::new(),
            stop_at_eos: true,
            speculation: None,
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
    /// Speculative decoding's state, when it is on.
    speculative: Option<SpeculativeRun>,
    /// Tokens decided by a verification pass and not yet emitted.
    ready: VecDeque<u32>,
    /// The sequence position of `ready`'s first token.
    ready_position: usize,
}

/// What speculative decoding keeps across the passes of one generation.
struct SpeculativeRun {
    length: DraftLength,
    proposer: ActiveProposer,
}

enum ActiveProposer {
    Lookup(PromptLookup),
    /// The model's attached draft model, with this generation's draft sequence.
    Draft(Box<DraftState>),
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
        let speculative = match &opts.speculation {
            None => None,
            Some(spec) => {
                let proposer = match spec.proposer {
                    ProposerKind::Lookup {
                        ngram_max,
                        ngram_min,
                    } => ActiveProposer::Lookup(PromptLookup::new(ngram_max, ngram_min)),
                    ProposerKind::Draft => {
                        let draft = model.draft.as_deref().ok_or_else(|| {
                            RuntimeError::Draft(
                                "speculation with a draft model, but none is attached".into(),
                            )
                        })?;
                        ActiveProposer::Draft(Box::new(DraftState::new(
                            draft,
                            &opts.sampling,
                            draft.executor().context_size(),
                        )))
                    }
                };
                Some(SpeculativeRun {
                    length: DraftLength::new(spec.draft_max, spec.adaptive),
                    proposer,
                })
            }
        };
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
            speculative,
            ready: VecDeque::new(),
            ready_position: 0,
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
        if self.ready.is_empty() && self.speculative.is_some() && self.pending.len() == 1 {
            self.speculative_step()?;
        }
        if let Some(id) = self.ready.pop_front() {
            let position = self.ready_position;
            self.ready_position += 1;
            return self.emit(id, Some(position)).map(Some);
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
        self.pending = vec![id];
        self.emit(id, None).map(Some)
    }

    /// One speculative pass: propose, verify the pending token and the
    /// proposals in one pass of the target, keep the accepted prefix and
    /// the target's own next token in `ready`. Leaves `ready` empty (and
    /// the ordinary path to run) when nothing is proposed.
    fn speculative_step(&mut self) -> Result<()> {
        let Some(run) = self.speculative.as_mut() else {
            return Ok(());
        };
        let started = Instant::now();
        let before = self.seq.len();
        // Room for the proposals: the tokens still wanted after the one the
        // pass produces anyway, and the context left after the pending token.
        let wanted = self.opts.max_new.saturating_sub(self.generated + 1);
        let room = self.seq.capacity().saturating_sub(before + 1);
        let k = run.length.get().min(wanted).min(room);
        if k == 0 {
            return Ok(());
        }
        let mut context = Vec::with_capacity(before + 1);
        context.extend_from_slice(self.seq.tokens());
        context.extend_from_slice(&self.pending);
        let mut proposal = match &mut run.proposer {
            ActiveProposer::Lookup(lookup) => Proposer::propose(lookup, &context, k)?,
            ActiveProposer::Draft(state) => self.model.propose_with_draft(state, &context, k)?,
        };
        let propose_time = started.elapsed();
        let vocab = self.model.executor.vocab_size();
        proposal.tokens.truncate(k);
        if proposal.tokens.is_empty() {
            return Ok(());
        }
        let Proposal { tokens, drafts } = proposal;
        let k = tokens.len();

        // Verify: the pending token and every proposal in one pass.
        let checkpoint = self
            .seq
            .has_recurrent_state()
            .then(|| self.seq.checkpoint());
        let mut feed = std::mem::take(&mut self.pending);
        feed.extend_from_slice(&tokens);
        let opts = StepOptions {
            all_logits: true,
            ..StepOptions::default()
        };
        let mut outputs = self
            .model
            .executor
            .step_batch_verify(&mut [(&mut self.seq, &feed[..])], opts)?;
        let mut all = outputs
            .pop()
            .and_then(|o| o.all_logits)
            .ok_or(RuntimeError::EmptyStep)?;
        let t0 = Instant::now();
        let mut accepted = 0;
        let mut next = None;
        for (i, logits) in all.chunks_exact_mut(vocab).enumerate().take(k + 1) {
            let history = &self.seq.tokens()[..before + 1 + i];
            if i == k {
                next = Some(self.sampler.sample(logits, history));
                break;
            }
            let draft = drafts.as_ref().and_then(|d| d.get(i));
            match self
                .sampler
                .check_proposal(logits, history, tokens[i], draft)
            {
                Verdict::Accept => accepted += 1,
                Verdict::Replace(own) => {
                    next = Some(own);
                    break;
                }
            }
        }
        let next = next.ok_or(RuntimeError::EmptyStep)?;
        self.model
            .executor
            .profiler
            .record_other("sampling", t0.elapsed());

        // Drop the rejected proposals. A recurrent state has absorbed them,
        // so it goes back to its checkpoint and takes the kept tokens again.
        if accepted < k {
            match checkpoint {
                Some(point) => {
                    self.seq.rollback(point);
                    let kept = &feed[..1 + accepted];
                    self.model
                        .executor
                        .step_batch_verify(&mut [(&mut self.seq, kept)], StepOptions::default())?;
                }
                None => self.seq.truncate(before + 1 + accepted),
            }
        }
        run.length.update(k, accepted);
        let stats = &mut self.model.executor.profiler.speculative;
        stats.passes += 1;
        stats.proposed += k;
        stats.accepted += accepted;
        stats.emitted += accepted + 1;
        stats.propose_time += propose_time;
        self.model
            .executor
            .profiler
            .add_decode(accepted + 1, started.elapsed());

        self.ready.extend(&tokens[..accepted]);
        self.ready.push_back(next);
        self.ready_position = before + 1;
        self.pending = vec![next];
        Ok(())
    }

    /// Turn a chosen token into its event: text (held back while UTF-8 or a
    /// stop string is incomplete) and the finish reason. `fed` is the
    /// token's position when a verification pass already fed it; a
    /// generation that finishes there drops it and what follows from the
    /// sequence, so the sequence ends before its last token as it does
    /// without speculation.
    fn emit(&mut self, id: u32, fed: Option<usize>) -> Result<TokenEvent> {
        self.generated += 1;
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
            self.ready.clear();
            if let Some(position) = fed {
                self.seq.truncate(position);
            }
        }
        Ok(TokenEvent { id, text, finish })
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
