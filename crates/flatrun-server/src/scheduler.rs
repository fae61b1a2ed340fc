//! The batch scheduler: an [`Engine`] over a [`BatchModel`].
//!
//! One thread owns the model. Each iteration of its loop:
//! 1. takes new submissions from a channel (blocking only when idle);
//! 2. drops sequences whose client went away (their `GenerationStream` was
//!    dropped) and frees their KV cache;
//! 3. admits waiting requests while fewer than `max_seqs` sequences run;
//! 4. runs **one** [`BatchModel::step`] for every running sequence: a prompt
//!    chunk for those still reading their prompt, the last sampled token for
//!    the others;
//!    (with [`SchedulerConfig::speculation`], once no sequence reads its
//!    prompt, the last sampled token followed by the sequence's proposals,
//!    checked by [`BatchModel::verify`]);
//! 5. samples a token for each sequence that got logits
//!    ([`flatrun_model::sampling::Sampler`]), detokenizes it (the model's
//!    [`TextModel::stream_decoder`]), checks the stop strings
//!    ([`flatrun_model::sampling::StopMatcher`]) and limits, and sends the
//!    events.
//!
//! Admission is decided at [`Engine::submit`]: beyond `max_seqs` running and
//! `max_queue` waiting, a request is refused at once with
//! [`EngineError::QueueFull`] (the HTTP layer answers 429 / 529).

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::batch_model::{
    BatchModel, ModelError, SeqId, Shifted, StepInput, TextModel, TokenTextStream,
};
use crate::engine::{
    EmbeddingReceiver, Engine, EngineError, EngineStats, GenerationEvent, GenerationRequest,
    GenerationSink, GenerationStream, MAX_DRAFT, ScoreReceiver, Usage, generation_channel,
};
use crate::prefix_cache::{PrefixCache, common_prefix};
use flatrun_model::chat_template::ChatMessage;
use flatrun_model::chat_template::tools::ToolSyntax;
use flatrun_model::sampling::Vocabulary;
use flatrun_model::sampling::{
    DraftLength, FinishReason, PromptLookup, ProposerKind, Sampler, SamplingParams, Speculation,
    StopMatcher, TokenConstraint, TokenLogprobs, Verdict, token_logprobs,
};

/// Limits of the batch scheduler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Sequences advanced together in one step (`--max-seqs`).
    pub max_seqs: usize,
    /// Requests allowed to wait for a slot beyond `max_seqs` (`--max-queue`).
    pub max_queue: usize,
    /// Prompt tokens fed per sequence per step, so that a long prompt does
    /// not stall the sequences already decoding.
    pub prefill_chunk: usize,
    /// KV bytes of finished sequences kept for prefix reuse
    /// (`--prompt-cache`; 0: none kept).
    pub prompt_cache_bytes: u64,
    /// Speculative decoding (`--lookup`, `--draft`), for models that can
    /// verify proposals ([`BatchModel::speculates`]); requests may lower
    /// or turn off their draft length
    /// ([`GenerationRequest::draft_max`]).
    pub speculation: Option<Speculation>,
}

/// The default `--prompt-cache`: 512 MiB of KV.
pub const DEFAULT_PROMPT_CACHE_BYTES: u64 = 512 << 20;

/// A request waits for a sequence still reading a prompt it shares when
/// that would spare at least this many more tokens than reusing now.
const MIN_WAIT_GAIN: usize = 16;

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_seqs: 4,
            max_queue: 32,
            prefill_chunk: 256,
            prompt_cache_bytes: DEFAULT_PROMPT_CACHE_BYTES,
            speculation: None,
        }
    }
}

/// A submitted request as the scheduler thread sees it.
struct Job {
    request: GenerationRequest,
    sink: GenerationSink,
}

enum Command {
    Submit(Job),
    Embed(EmbedJob),
    Score(ScoreJob),
    CancelAll,
}

/// Embeddings to compute between steps.
struct EmbedJob {
    inputs: Vec<Vec<u32>>,
    reply: tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>, EngineError>>,
}

/// A prompt to score between steps.
struct ScoreJob {
    tokens: Vec<u32>,
    top: usize,
    reply: tokio::sync::oneshot::Sender<Result<Vec<TokenLogprobs>, EngineError>>,
}

/// Counters shared between the scheduler thread and the handlers.
#[derive(Default)]
struct Shared {
    /// Running + waiting requests (the admission count).
    admitted: AtomicUsize,
    active: AtomicUsize,
    queued: AtomicUsize,
    prompt_tokens_total: AtomicU64,
    generated_tokens_total: AtomicU64,
    /// Context shifts done in place (keys re-rotated) and by recomputing.
    shifts_rotated: AtomicU64,
    shifts_recomputed: AtomicU64,
    steps_total: AtomicU64,
    /// Requests that reused a cached or shared prefix, and the tokens reused.
    prefix_hits: AtomicU64,
    prefix_lookups: AtomicU64,
    prefix_reused_tokens: AtomicU64,
    prompt_cache_entries: AtomicUsize,
    prompt_cache_bytes: AtomicU64,
    prompt_cache_evictions: AtomicU64,
    /// KV bytes of the running sequences.
    active_kv_bytes: AtomicU64,
    /// Grammar masks computed, the microseconds computing them took, and
    /// the microseconds steps waited for them after the layers had run.
    grammar_masks: AtomicU64,
    grammar_mask_us: AtomicU64,
    grammar_wait_us: AtomicU64,
    /// Speculative passes (per sequence), proposed and accepted tokens.
    spec_passes: AtomicU64,
    spec_proposed: AtomicU64,
    spec_accepted: AtomicU64,
    /// f64 bits of the smoothed tokens/s.
    tokens_per_second_bits: AtomicU64,
    /// Milliseconds since `started` of the last step.
    last_step_ms: AtomicU64,
    resident_bytes: AtomicU64,
    model_bytes: AtomicU64,
    has_residency: AtomicBool,
    shutting_down: AtomicBool,
}

/// An [`Engine`] that runs every request through one batched scheduler loop.
pub struct BatchEngine {
    text: Arc<dyn TextModel>,
    config: SchedulerConfig,
    shared: Arc<Shared>,
    started: Instant,
    commands: Mutex<Option<Sender<Command>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl BatchEngine {
    /// Starts the scheduler thread over `model`.
    pub fn start<M: BatchModel>(
        model: M,
        text: Arc<dyn TextModel>,
        config: SchedulerConfig,
    ) -> std::io::Result<Self> {
        let config = SchedulerConfig {
            max_seqs: config.max_seqs.max(1),
            max_queue: config.max_queue,
            prefill_chunk: config.prefill_chunk.max(1),
            prompt_cache_bytes: config.prompt_cache_bytes,
            speculation: config.speculation,
        };
        if let Some(spec) = &config.speculation {
            if !model.speculates() {
                tracing::warn!("this model cannot verify proposals: no speculative decoding");
            } else if spec.proposer == ProposerKind::Draft && !model.has_draft() {
                tracing::warn!("speculation with a draft model, but none is attached");
            }
        }
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let started = Instant::now();
        let worker_text = text.clone();
        let worker_config = config.clone();
        let worker_shared = shared.clone();
        let worker_config_budget = config.prompt_cache_bytes;
        let thread = std::thread::Builder::new()
            .name("flatrun-scheduler".to_string())
            .spawn(move || {
                // The worker borrows the text model for the streaming decoders.
                let mut worker = Worker {
                    model,
                    text: worker_text.as_ref(),
                    config: worker_config,
                    shared: worker_shared,
                    started,
                    waiting: VecDeque::new(),
                    active: Vec::new(),
                    cache: PrefixCache::new(worker_config_budget),
                };
                worker.run(rx)
            })?;
        Ok(BatchEngine {
            text,
            config,
            shared,
            started,
            commands: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    fn send(&self, command: Command) -> bool {
        match self.commands.lock() {
            Ok(guard) => guard.as_ref().is_some_and(|tx| tx.send(command).is_ok()),
            Err(_) => false,
        }
    }

    /// Reserves a place in the batch or the queue.
    /// Refuses an embedding or scoring input the model cannot take.
    fn check_evaluation(&self, tokens: &[u32]) -> Result<(), EngineError> {
        if self.shared.shutting_down.load(Ordering::Acquire) {
            return Err(EngineError::ShuttingDown);
        }
        if tokens.is_empty() {
            return Err(EngineError::InvalidRequest(
                "the input is empty (no tokens)".to_string(),
            ));
        }
        if tokens.len() > self.text.context_length() {
            return Err(EngineError::ContextOverflow {
                prompt_tokens: tokens.len(),
                max_tokens: 0,
                context_length: self.text.context_length(),
            });
        }
        Ok(())
    }

    fn admit(&self) -> Result<(), EngineError> {
        let limit = self.config.max_seqs + self.config.max_queue;
        self.shared
            .admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .map(|_| ())
            .map_err(|_| EngineError::QueueFull {
                active: self.shared.active.load(Ordering::Relaxed),
                queued: self.shared.queued.load(Ordering::Relaxed),
                limit,
            })
    }
}

impl Drop for BatchEngine {
    fn drop(&mut self) {
        self.shared.shutting_down.store(true, Ordering::Release);
        // Closing the channel ends the worker loop.
        if let Ok(mut commands) = self.commands.lock() {
            commands.take();
        }
        if let Ok(mut thread) = self.thread.lock()
            && let Some(handle) = thread.take()
        {
            let _ = handle.join();
        }
    }
}

fn text_error(e: ModelError) -> EngineError {
    EngineError::Text(e.0)
}

impl Engine for BatchEngine {
    fn model_name(&self) -> &str {
        self.text.model_name()
    }

    fn context_length(&self) -> usize {
        self.text.context_length()
    }

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, EngineError> {
        self.text.tokenize(text, add_special).map_err(text_error)
    }

    fn detokenize(&self, tokens: &[u32]) -> Result<String, EngineError> {
        self.text.detokenize(tokens).map_err(text_error)
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        self.text.render_chat(messages).map_err(text_error)
    }

    fn render_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
    ) -> Result<String, EngineError> {
        match tools {
            None => self.render_chat(messages),
            Some(tools) => match self.text.render_chat_tools(messages, tools) {
                Some(result) => result.map_err(text_error),
                None => Err(EngineError::InvalidRequest(
                    "this model's chat template does not take tools".to_string(),
                )),
            },
        }
    }

    fn tool_syntax(&self) -> Option<ToolSyntax> {
        self.text.tool_syntax()
    }

    fn vocab_size(&self) -> Option<usize> {
        self.text.vocab_size()
    }

    fn vocabulary(&self) -> Option<Arc<Vocabulary>> {
        self.text.vocabulary()
    }

    fn submit(&self, request: GenerationRequest) -> Result<GenerationStream, EngineError> {
        if self.shared.shutting_down.load(Ordering::Acquire) {
            return Err(EngineError::ShuttingDown);
        }
        validate(&request, self.text.context_length())?;
        self.admit()?;
        let (sink, stream) = generation_channel();
        if !self.send(Command::Submit(Job { request, sink })) {
            self.shared.admitted.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::ShuttingDown);
        }
        Ok(stream)
    }

    fn stats(&self) -> EngineStats {
        let s = &self.shared;
        let now_ms = self.started.elapsed().as_millis() as u64;
        let idle = now_ms.saturating_sub(s.last_step_ms.load(Ordering::Relaxed)) > 5_000;
        let tokens_per_second = if idle {
            0.0
        } else {
            f64::from_bits(s.tokens_per_second_bits.load(Ordering::Relaxed))
        };
        let has_residency = s.has_residency.load(Ordering::Relaxed);
        EngineStats {
            active_sequences: s.active.load(Ordering::Relaxed),
            queued_requests: s.queued.load(Ordering::Relaxed),
            prompt_tokens_total: s.prompt_tokens_total.load(Ordering::Relaxed),
            generated_tokens_total: s.generated_tokens_total.load(Ordering::Relaxed),
            context_shifts_rotated_total: s.shifts_rotated.load(Ordering::Relaxed),
            context_shifts_recomputed_total: s.shifts_recomputed.load(Ordering::Relaxed),
            steps_total: s.steps_total.load(Ordering::Relaxed),
            generated_tokens_per_second: tokens_per_second,
            prefix_hits_total: s.prefix_hits.load(Ordering::Relaxed),
            prefix_lookups_total: s.prefix_lookups.load(Ordering::Relaxed),
            grammar_masks_total: s.grammar_masks.load(Ordering::Relaxed),
            grammar_mask_seconds_total: s.grammar_mask_us.load(Ordering::Relaxed) as f64 * 1e-6,
            grammar_wait_seconds_total: s.grammar_wait_us.load(Ordering::Relaxed) as f64 * 1e-6,
            prefix_reused_tokens_total: s.prefix_reused_tokens.load(Ordering::Relaxed),
            prompt_cache_entries: s.prompt_cache_entries.load(Ordering::Relaxed),
            prompt_cache_bytes: s.prompt_cache_bytes.load(Ordering::Relaxed),
            prompt_cache_evictions_total: s.prompt_cache_evictions.load(Ordering::Relaxed),
            kv_bytes: s.active_kv_bytes.load(Ordering::Relaxed)
                + s.prompt_cache_bytes.load(Ordering::Relaxed),
            speculative_passes_total: s.spec_passes.load(Ordering::Relaxed),
            speculative_proposed_total: s.spec_proposed.load(Ordering::Relaxed),
            speculative_accepted_total: s.spec_accepted.load(Ordering::Relaxed),
            resident_bytes: has_residency.then(|| s.resident_bytes.load(Ordering::Relaxed)),
            model_bytes: has_residency.then(|| s.model_bytes.load(Ordering::Relaxed)),
        }
    }

    fn embed(&self, inputs: Vec<Vec<u32>>) -> Result<EmbeddingReceiver, EngineError> {
        for tokens in &inputs {
            self.check_evaluation(tokens)?;
        }
        let (reply, receiver) = tokio::sync::oneshot::channel();
        if !self.send(Command::Embed(EmbedJob { inputs, reply })) {
            return Err(EngineError::ShuttingDown);
        }
        Ok(receiver)
    }

    fn score(&self, tokens: Vec<u32>, top: usize) -> Result<ScoreReceiver, EngineError> {
        self.check_evaluation(&tokens)?;
        let (reply, receiver) = tokio::sync::oneshot::channel();
        if !self.send(Command::Score(ScoreJob { tokens, top, reply })) {
            return Err(EngineError::ShuttingDown);
        }
        Ok(receiver)
    }

    fn shutdown(&self) {
        self.shared.shutting_down.store(true, Ordering::Release);
        self.send(Command::CancelAll);
    }
}

/// Checks a request against the context before any work.
fn validate(request: &GenerationRequest, context_length: usize) -> Result<(), EngineError> {
    if request.prompt.is_empty() {
        return Err(EngineError::InvalidRequest(
            "the prompt is empty (no tokens)".to_string(),
        ));
    }
    if request.max_tokens == 0 {
        return Err(EngineError::InvalidRequest(
            "max_tokens must be at least 1".to_string(),
        ));
    }
    let SamplingParams {
        temperature, top_p, ..
    } = request.sampling;
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(EngineError::InvalidRequest(format!(
            "temperature must be a finite number >= 0, got {temperature}"
        )));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(EngineError::InvalidRequest(format!(
            "top_p must be in (0, 1], got {top_p}"
        )));
    }
    let fits = if request.shift {
        // Shifting makes room for the answer, not for the prompt.
        request.prompt.len() < context_length
    } else {
        request.prompt.len().saturating_add(request.max_tokens) <= context_length
    };
    if !fits {
        return Err(EngineError::ContextOverflow {
            prompt_tokens: request.prompt.len(),
            max_tokens: request.max_tokens,
            context_length,
        });
    }
    Ok(())
}

/// A sequence in the running batch.
struct Running<'t> {
    seq: SeqId,
    job: Job,
    /// The tokens the KV cache holds before the answer goes on: the prompt,
    /// or after a context shift what was kept of prompt and answer.
    feed: Vec<u32>,
    /// Tokens of `feed` already fed to the model (or copied from a shared
    /// prefix).
    prefilled: usize,
    /// Generated tokens that are part of `feed` (after a shift).
    generated_in_feed: usize,
    /// Positions of the sequence's KV cache.
    capacity: usize,
    /// Prompt tokens whose KV came from a shared prefix instead.
    cached: usize,
    /// Generated tokens already fed back to the model.
    fed_generated: usize,
    /// Leading evaluated tokens computed only in steps of two rows or more
    /// (the matrix-matrix kernels, as a prefill computes them): the part of
    /// this sequence whose KV another sequence may reuse and go on exactly
    /// as if it had computed it. A step of one row (a lone decode) takes
    /// the matrix-vector kernels, which round differently.
    exact: usize,
    /// The last sampled token, fed at the next step.
    last_token: u32,
    /// Tokens generated so far (the sampler's history).
    generated: Vec<u32>,
    sampler: Sampler,
    /// The grammar the tokens must follow, if any.
    constraint: Option<Box<dyn TokenConstraint>>,
    /// Speculative decoding of this sequence, when the server and the
    /// request want it.
    speculation: Option<SequenceSpeculation>,
    /// Always `Some` until the generation finishes.
    decoder: Option<Box<dyn TokenTextStream + 't>>,
    stop: StopMatcher,
    /// Text given to `stop` and not yet released (where a stop string starts).
    held: String,
}

impl Running<'_> {
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.job.request.prompt.len(),
            completion_tokens: self.generated.len(),
            cached_tokens: self.cached,
        }
    }

    /// Every token the sequence's KV cache holds, in order.
    fn evaluated(&self) -> impl Iterator<Item = &u32> {
        self.feed[..self.prefilled]
            .iter()
            .chain(&self.generated[self.generated_in_feed..self.fed_generated])
    }

    fn evaluated_len(&self) -> usize {
        self.prefilled + self.fed_generated - self.generated_in_feed
    }

    /// The evaluated tokens another sequence may reuse.
    fn reusable(&self) -> impl Iterator<Item = &u32> {
        self.evaluated().take(self.exact)
    }

    fn prefilling(&self) -> bool {
        self.prefilled < self.feed.len()
    }

    /// Positions taken once the last sampled token is fed.
    fn positions(&self) -> usize {
        self.feed.len() + self.generated.len() - self.generated_in_feed
    }

    /// Passes text through the stop strings: the text to send now, and the
    /// stop string that ended the generation, if one did.
    fn release(&mut self, piece: &str) -> (String, Option<String>) {
        self.held.push_str(piece);
        let result = self.stop.push(piece);
        let stopped = result.stopped.then(|| {
            // The stop string starts right after the released text.
            let rest = self.held.get(result.emit.len()..).unwrap_or_default();
            self.job
                .request
                .stop
                .iter()
                .filter(|s| !s.is_empty() && rest.starts_with(s.as_str()))
                .max_by_key(|s| s.len())
                .cloned()
                .unwrap_or_default()
        });
        self.held.drain(..result.emit.len().min(self.held.len()));
        (result.emit, stopped)
    }
}

/// Speculative decoding of one sequence: where its proposals come from
/// and how many to make.
struct SequenceSpeculation {
    /// `None`: the model's draft ([`BatchModel::propose`]).
    lookup: Option<PromptLookup>,
    length: DraftLength,
}

impl SequenceSpeculation {
    /// The sequence's speculation under the server's settings, with the
    /// request's draft length (`None` when that is 0).
    fn new(spec: &Speculation, request_max: Option<usize>) -> Option<SequenceSpeculation> {
        let max = request_max.unwrap_or(spec.draft_max).min(MAX_DRAFT);
        (max > 0).then(|| SequenceSpeculation {
            lookup: match spec.proposer {
                ProposerKind::Lookup {
                    ngram_max,
                    ngram_min,
                } => Some(PromptLookup::new(ngram_max, ngram_min)),
                ProposerKind::Draft => None,
            },
            length: DraftLength::new(max, spec.adaptive),
        })
    }
}

/// What to do with a sequence after a step.
enum Next {
    Continue,
    /// The context is full: drop old tokens and go on.
    Shift,
    Finish(FinishReason),
    Fail(String),
    Gone,
}

/// The scheduler thread's state.
struct Worker<'t, M: BatchModel> {
    model: M,
    text: &'t dyn TextModel,
    config: SchedulerConfig,
    shared: Arc<Shared>,
    started: Instant,
    waiting: VecDeque<Job>,
    active: Vec<Running<'t>>,
    /// Finished sequences kept for prefix reuse.
    cache: PrefixCache,
}

impl<'t, M: BatchModel> Worker<'t, M> {
    fn run(&mut self, commands: Receiver<Command>) {
        loop {
            // 1. New submissions; block only when there is nothing to run.
            if self.active.is_empty() && self.waiting.is_empty() {
                match commands.recv() {
                    Ok(command) => self.handle(command),
                    Err(_) => break,
                }
            }
            let mut disconnected = false;
            loop {
                match commands.try_recv() {
                    Ok(command) => self.handle(command),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        disconnected = true;
                        break;
                    }
                }
            }
            if disconnected {
                self.fail_all("the engine was shut down");
                break;
            }
            // 2. Clients that went away.
            self.drop_cancelled();
            // 3. Admission.
            self.admit_waiting();
            self.publish_counts();
            // 4-5. One step for the whole batch.
            if !self.active.is_empty() {
                self.step();
            }
            self.publish_counts();
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit(job) => self.waiting.push_back(job),
            Command::Embed(job) => {
                let result = match self.model.embed(&job.inputs) {
                    None => Err(EngineError::InvalidRequest(
                        "this model does not serve embeddings".to_string(),
                    )),
                    Some(result) => result.map_err(|e| EngineError::Text(e.0)),
                };
                let _ = job.reply.send(result);
            }
            Command::Score(job) => {
                let result = match self.model.score(&job.tokens, job.top) {
                    None => Err(EngineError::InvalidRequest(
                        "this model does not score prompts".to_string(),
                    )),
                    Some(result) => result.map_err(|e| EngineError::Text(e.0)),
                };
                let _ = job.reply.send(result);
            }
            Command::CancelAll => self.fail_all("the server is shutting down"),
        }
    }

    fn publish_counts(&self) {
        self.shared
            .active
            .store(self.active.len(), Ordering::Relaxed);
        self.shared
            .queued
            .store(self.waiting.len(), Ordering::Relaxed);
    }

    /// Releases one admitted request's place.
    fn release_slot(&self) {
        self.shared.admitted.fetch_sub(1, Ordering::AcqRel);
    }

    fn fail_all(&mut self, message: &str) {
        for job in std::mem::take(&mut self.waiting) {
            job.sink.send(GenerationEvent::Failed {
                message: message.to_string(),
            });
            self.release_slot();
        }
        for running in std::mem::take(&mut self.active) {
            running.job.sink.send(GenerationEvent::Failed {
                message: message.to_string(),
            });
            self.release_slot();
            self.model.free(running.seq);
        }
        // A failed step may have left any cache half written.
        for seq in self.cache.clear() {
            self.model.free(seq);
        }
        self.publish_counts();
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|job| !job.sink.is_cancelled());
        for _ in self.waiting.len()..before {
            self.release_slot();
        }
        let mut index = 0;
        while index < self.active.len() {
            if self.active[index].job.sink.is_cancelled() {
                let running = self.active.swap_remove(index);
                tracing::debug!(seq = running.seq.0, "client gone: sequence freed");
                self.release_slot();
                self.retire(running);
            } else {
                index += 1;
            }
        }
    }

    /// Keeps a finished sequence's KV for prefix reuse, or frees it.
    fn retire(&mut self, running: Running<'_>) {
        if !self.cache.enabled()
            || !running.job.request.cache_prompt
            || !self.model.reuses_prefixes()
        {
            self.model.free(running.seq);
            return;
        }
        let tokens: Vec<u32> = running.reusable().copied().collect();
        let bytes = self.model.kv_bytes(running.seq);
        for seq in self.cache.insert(running.seq, tokens, bytes) {
            self.model.free(seq);
        }
        self.publish_cache();
    }

    /// The sequence (cached or running) whose KV holds the longest prefix
    /// of `prompt`, and how many tokens of it can be reused: never the
    /// prompt's last two tokens, which must run (two, so that they take the
    /// matrix-matrix kernels a fresh prefill takes) to give the first logits.
    fn shared_prefix(&self, prompt: &[u32]) -> Option<(SeqId, usize)> {
        let running = self
            .active
            .iter()
            .map(|r| (r.seq, common_prefix(r.reusable(), prompt)));
        self.cache
            .longest(prompt)
            .into_iter()
            .chain(running)
            .map(|(seq, n)| (seq, n.min(prompt.len().saturating_sub(2))))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(_, n)| n)
    }

    /// Whether `request` had better wait for a running sequence that is
    /// still reading a prompt it shares (the `n` choices of one request,
    /// concurrent requests with one system prompt): it then copies that
    /// prompt's KV instead of computing it again.
    fn should_wait(&self, request: &GenerationRequest) -> bool {
        if !request.cache_prompt || !self.model.reuses_prefixes() {
            return false;
        }
        let prompt = &request.prompt;
        let last = prompt.len().saturating_sub(2);
        let coming = self
            .active
            .iter()
            .filter(|r| r.prefilling())
            .map(|r| common_prefix(&r.job.request.prompt, prompt).min(last))
            .max()
            .unwrap_or(0);
        let now = self.shared_prefix(prompt).map_or(0, |(_, n)| n);
        coming >= now + MIN_WAIT_GAIN
    }

    fn admit_waiting(&mut self) {
        let mut index = 0;
        while self.active.len() < self.config.max_seqs && index < self.waiting.len() {
            if self.should_wait(&self.waiting[index].request) {
                index += 1;
                continue;
            }
            if let Some(job) = self.waiting.remove(index) {
                self.start(job);
            }
        }
        self.publish_cache();
    }

    /// Opens a sequence for `job`: a fork of the longest shared prefix when
    /// there is one, else an empty sequence.
    fn start(&mut self, job: Job) {
        // The sequence's KV cache only needs the prompt plus max_tokens.
        let positions =
            (job.request.prompt.len() + job.request.max_tokens).min(self.text.context_length());
        let constraint = match job.request.constraint.as_ref().map(|f| f.start()) {
            None => None,
            Some(Ok(constraint)) => Some(constraint),
            Some(Err(message)) => {
                job.sink.send(GenerationEvent::Failed { message });
                self.release_slot();
                return;
            }
        };
        let reuse = job.request.cache_prompt && self.model.reuses_prefixes();
        let shared = if reuse {
            self.shared.prefix_lookups.fetch_add(1, Ordering::Relaxed);
            self.shared_prefix(&job.request.prompt)
        } else {
            None
        };
        let forked =
            shared.and_then(
                |(source, len)| match self.model.fork(source, len, positions)? {
                    Ok(seq) => Some((seq, len, source)),
                    Err(e) => {
                        tracing::warn!("prefix reuse failed: {e}");
                        None
                    }
                },
            );
        let opened = match forked {
            Some((seq, len, source)) => {
                self.cache.touch(source);
                self.shared.prefix_hits.fetch_add(1, Ordering::Relaxed);
                self.shared
                    .prefix_reused_tokens
                    .fetch_add(len as u64, Ordering::Relaxed);
                Ok((seq, len))
            }
            None => self.model.new_sequence(positions).map(|seq| (seq, 0)),
        };
        match opened {
            Ok((seq, cached)) => {
                let sampler = Sampler::new(job.request.sampling.clone());
                let stop = StopMatcher::new(job.request.stop.iter().cloned());
                // Proposals cannot be checked against a grammar's masks.
                let speculation = self
                    .config
                    .speculation
                    .as_ref()
                    .filter(|_| self.model.speculates() && constraint.is_none())
                    .filter(|spec| spec.proposer != ProposerKind::Draft || self.model.has_draft())
                    .and_then(|spec| SequenceSpeculation::new(spec, job.request.draft_max));
                self.active.push(Running {
                    seq,
                    feed: job.request.prompt.clone(),
                    job,
                    generated_in_feed: 0,
                    capacity: positions,
                    prefilled: cached,
                    cached,
                    exact: cached,
                    fed_generated: 0,
                    last_token: 0,
                    generated: Vec::new(),
                    sampler,
                    constraint,
                    speculation,
                    decoder: Some(self.text.stream_decoder()),
                    stop,
                    held: String::new(),
                });
            }
            Err(e) => {
                job.sink.send(GenerationEvent::Failed {
                    message: e.to_string(),
                });
                self.release_slot();
            }
        }
    }

    /// Context shift of the sequence at `index`, whose cache is full, as
    /// llama-server's: of the cached tokens, keep the first `keep` (the
    /// system prompt; at most half the context), drop half of the rest
    /// (`n_discard = n_left / 2`) and move the newer half down. The model
    /// does that in place when it can (re-rotating the cached keys); when it
    /// cannot, the kept prefix's KV is copied and the newer tokens are fed
    /// again at their new positions (the following steps read them like a
    /// prompt). The answer then goes on with the last sampled token.
    fn shift(&mut self, index: usize) -> Result<(), ModelError> {
        let running = &self.active[index];
        // The cached tokens, then the sampled one not fed yet.
        let all: Vec<u32> = running.feed[..running.prefilled]
            .iter()
            .chain(&running.generated[running.generated_in_feed..])
            .copied()
            .collect();
        let cached = running.evaluated_len().min(all.len().saturating_sub(1));
        let keep = running
            .job
            .request
            .keep
            .min(all.len() / 2)
            .min(cached.saturating_sub(1));
        let dropped = ((cached - keep) / 2).max(1).min(cached - keep);
        let (capacity, old) = (running.capacity, running.seq);
        match self.model.shift(old, keep, dropped)? {
            Shifted::Rotated => {
                tracing::debug!(seq = old.0, keep, dropped, "context shift: keys re-rotated");
                self.shared.shifts_rotated.fetch_add(1, Ordering::Relaxed);
                let running = &mut self.active[index];
                running.feed = all[..keep]
                    .iter()
                    .chain(&all[keep + dropped..cached])
                    .copied()
                    .collect();
                running.prefilled = running.feed.len();
                // Re-rotated keys differ (by rounding) from computed ones.
                running.exact = running.exact.min(keep);
                running.generated_in_feed = running.generated.len() - 1;
                running.fed_generated = running.generated.len() - 1;
                return Ok(());
            }
            Shifted::Recompute(why) => {
                tracing::debug!(seq = old.0, keep, dropped, %why, "context shift: recomputing");
            }
        }
        self.shared
            .shifts_recomputed
            .fetch_add(1, Ordering::Relaxed);
        let kept: Vec<u32> = all[..keep]
            .iter()
            .chain(&all[keep + dropped..])
            .copied()
            .collect();
        let forked = if keep > 0 && self.model.reuses_prefixes() {
            self.model.fork(old, keep, capacity).and_then(Result::ok)
        } else {
            None
        };
        let (seq, prefilled) = match forked {
            Some(seq) => (seq, keep),
            None => (self.model.new_sequence(capacity)?, 0),
        };
        self.model.free(old);
        let running = &mut self.active[index];
        running.seq = seq;
        running.feed = kept;
        running.prefilled = prefilled;
        running.exact = running.exact.min(prefilled);
        running.generated_in_feed = running.generated.len();
        running.fed_generated = running.generated.len();
        Ok(())
    }

    /// The prefix cache's and the running sequences' figures, for `/metrics`.
    fn publish_cache(&self) {
        let s = &self.shared;
        s.prompt_cache_entries
            .store(self.cache.len(), Ordering::Relaxed);
        s.prompt_cache_bytes
            .store(self.cache.bytes(), Ordering::Relaxed);
        s.prompt_cache_evictions
            .store(self.cache.evictions(), Ordering::Relaxed);
        let active: u64 = self.active.iter().map(|r| self.model.kv_bytes(r.seq)).sum();
        s.active_kv_bytes.store(active, Ordering::Relaxed);
    }

    /// The tokens proposed after each running sequence's last sampled token
    /// (empty for a sequence that does not speculate now). Nothing is
    /// proposed while a sequence of the batch reads its prompt: a
    /// verification pass computes every row as a one-token step would,
    /// which a prompt chunk should not pay for.
    fn proposals(&mut self) -> Vec<Vec<u32>> {
        let mut proposals = vec![Vec::new(); self.active.len()];
        if self.active.iter().any(Running::prefilling) {
            return proposals;
        }
        for (running, proposal) in self.active.iter_mut().zip(&mut proposals) {
            let Some(spec) = &running.speculation else {
                continue;
            };
            // Room for the proposals: the tokens still wanted after the one
            // the pass produces anyway, and the positions left after the
            // last sampled token.
            let wanted = running
                .job
                .request
                .max_tokens
                .saturating_sub(running.generated.len() + 1);
            let room = running.capacity.saturating_sub(running.positions());
            let k = spec.length.get().min(wanted).min(room);
            if k == 0 {
                continue;
            }
            let context: Vec<u32> = running
                .evaluated()
                .copied()
                .chain([running.last_token])
                .collect();
            let proposed = match &spec.lookup {
                Some(lookup) => Ok(lookup.propose(&context, k).to_vec()),
                None => self.model.propose(running.seq, &context, k),
            };
            *proposal = proposed.unwrap_or_else(|e| {
                tracing::warn!("the draft model failed, speculation off: {e}");
                running.speculation = None;
                Vec::new()
            });
            proposal.truncate(k);
        }
        proposals
    }

    fn step(&mut self) {
        let chunk = self.config.prefill_chunk;
        let proposals = self.proposals();
        let verifying = proposals.iter().any(|p| !p.is_empty());
        // The last sampled token, then the proposals after it.
        let feeds: Vec<Vec<u32>> = self
            .active
            .iter()
            .zip(&proposals)
            .map(|(running, proposal)| {
                if proposal.is_empty() {
                    Vec::new()
                } else {
                    [&[running.last_token][..], proposal].concat()
                }
            })
            .collect();
        let step_started = Instant::now();
        // The grammars, out of the sequences while the step borrows them.
        let mut constraints: Vec<(usize, Box<dyn TokenConstraint>)> = self
            .active
            .iter_mut()
            .enumerate()
            .filter_map(|(i, running)| running.constraint.take().map(|c| (i, c)))
            .collect();
        // The batch: a prompt chunk or the last sampled token per sequence.
        let rows: usize;
        let result = {
            let inputs: Vec<StepInput<'_>> = self
                .active
                .iter()
                .zip(&feeds)
                .map(|(running, feed)| {
                    let prompt = &running.feed;
                    if !feed.is_empty() {
                        StepInput {
                            seq: running.seq,
                            tokens: feed,
                            logits_needed: true,
                        }
                    } else if running.prefilled < prompt.len() {
                        let end = (running.prefilled + chunk).min(prompt.len());
                        StepInput {
                            seq: running.seq,
                            tokens: &prompt[running.prefilled..end],
                            logits_needed: end == prompt.len(),
                        }
                    } else {
                        StepInput {
                            seq: running.seq,
                            tokens: std::slice::from_ref(&running.last_token),
                            logits_needed: true,
                        }
                    }
                })
                .collect();
            rows = inputs.iter().map(|input| input.tokens.len()).sum::<usize>();
            let model = &mut self.model;
            // The grammar masks of the next tokens are computed on other
            // threads while the layers run.
            std::thread::scope(|scope| {
                let masks: Vec<_> = constraints
                    .iter_mut()
                    .map(|(_, c)| {
                        scope.spawn(move || {
                            let started = Instant::now();
                            let result = c.compute_mask();
                            (result, started.elapsed())
                        })
                    })
                    .collect();
                let pass = || {
                    if verifying {
                        model.verify(&inputs)
                    } else {
                        model.step(&inputs)
                    }
                };
                let result = catch_unwind(AssertUnwindSafe(pass))
                    .unwrap_or_else(|_| Err(ModelError("the model panicked during a step".into())));
                let layers_done = Instant::now();
                let mut mask_time = std::time::Duration::ZERO;
                let count = masks.len() as u64;
                let mask_errors: Vec<String> = masks
                    .into_iter()
                    .filter_map(|h| match h.join() {
                        Ok((result, took)) => {
                            mask_time += took;
                            result.err()
                        }
                        Err(_) => Some("the grammar panicked".to_string()),
                    })
                    .collect();
                if count > 0 {
                    let s = &self.shared;
                    s.grammar_masks.fetch_add(count, Ordering::Relaxed);
                    s.grammar_mask_us
                        .fetch_add(mask_time.as_micros() as u64, Ordering::Relaxed);
                    s.grammar_wait_us
                        .fetch_add(layers_done.elapsed().as_micros() as u64, Ordering::Relaxed);
                }
                (result, mask_errors)
            })
        };
        let (result, mask_errors) = result;
        for (i, c) in constraints {
            self.active[i].constraint = Some(c);
        }
        if let Some(error) = mask_errors.first() {
            tracing::warn!("grammar: {error}");
        }
        let logits = match result {
            Ok(logits) if logits.len() == self.active.len() => logits,
            Ok(logits) => {
                let message = format!(
                    "model returned {} logit rows for a batch of {}",
                    logits.len(),
                    self.active.len()
                );
                self.fail_all(&message);
                return;
            }
            Err(e) => {
                tracing::error!("{e}");
                self.fail_all(&e.to_string());
                return;
            }
        };
        self.shared.steps_total.fetch_add(1, Ordering::Relaxed);

        // Sample, detokenize and report, sequence by sequence.
        let mut sampled = 0u64;
        let mut outcomes = Vec::with_capacity(self.active.len());
        for ((running, mut row), proposed) in self.active.iter_mut().zip(logits).zip(&proposals) {
            if !proposed.is_empty() {
                // Positions the pass left in the cache: the last sampled
                // token and every proposal.
                let fed = running.evaluated_len() + 1 + proposed.len();
                let verified = take_verified(running, &row, proposed, self.text);
                let s = &self.shared;
                s.spec_passes.fetch_add(1, Ordering::Relaxed);
                s.spec_proposed
                    .fetch_add(proposed.len() as u64, Ordering::Relaxed);
                s.spec_accepted
                    .fetch_add(verified.accepted as u64, Ordering::Relaxed);
                sampled += verified.emitted as u64;
                // Drop the KV of the rejected proposals (and of any after
                // the end of the answer).
                let kept = running.evaluated_len();
                let next = if kept < fed
                    && let Err(e) = self.model.truncate(running.seq, kept)
                {
                    Next::Fail(e.to_string())
                } else {
                    verified.next
                };
                outcomes.push(next);
                continue;
            }
            let prompt_len = running.feed.len();
            let fed_now = if running.prefilling() {
                (running.prefilled + chunk).min(prompt_len) - running.prefilled
            } else {
                1
            };
            // A verification pass computes each row as a one-token step.
            if rows >= 2 && !verifying && running.exact == running.evaluated_len() {
                running.exact += fed_now;
            }
            if !running.prefilling() {
                // This step fed the last sampled token.
                running.fed_generated = running.generated.len();
            }
            if running.prefilled < prompt_len {
                let end = (running.prefilled + chunk).min(prompt_len);
                self.shared
                    .prompt_tokens_total
                    .fetch_add((end - running.prefilled) as u64, Ordering::Relaxed);
                running.prefilled = end;
                if end < prompt_len {
                    outcomes.push(Next::Continue);
                    continue;
                }
            }
            if row.is_empty() {
                outcomes.push(Next::Fail("the model returned no logits".to_string()));
                continue;
            }
            let raw = running.job.request.logprobs.map(|n| (row.clone(), n));
            let mask = running.constraint.as_ref().and_then(|c| c.mask());
            let token = running
                .sampler
                .sample_allowed(&mut row, &running.generated, mask);
            sampled += 1;
            let logprobs = raw.map(|(raw, n)| token_logprobs(&raw, token, n));
            if let Some(constraint) = running.constraint.as_mut()
                && let Err(e) = constraint.accept(token)
            {
                tracing::warn!("grammar rejected token {token}: {e}");
            }
            let mut next = advance(running, token, logprobs, self.text);
            if matches!(next, Next::Continue)
                && running.constraint.as_ref().is_some_and(|c| c.is_finished())
            {
                next = Next::Finish(FinishReason::Eos);
            }
            outcomes.push(next);
        }
        self.shared
            .generated_tokens_total
            .fetch_add(sampled, Ordering::Relaxed);
        self.record_throughput(sampled, step_started);

        // Retire finished sequences (back to front keeps indices valid).
        for (index, next) in outcomes.into_iter().enumerate().rev() {
            let event = match next {
                Next::Continue => continue,
                Next::Shift => match self.shift(index) {
                    Ok(()) => continue,
                    Err(e) => Some(GenerationEvent::Failed {
                        message: e.to_string(),
                    }),
                },
                Next::Finish(reason) => Some(finish_event(&mut self.active[index], reason)),
                Next::Fail(message) => Some(GenerationEvent::Failed { message }),
                Next::Gone => None,
            };
            let running = self.active.swap_remove(index);
            let failed = matches!(event, Some(GenerationEvent::Failed { .. }));
            let sink = running.job.sink.clone();
            self.release_slot();
            if failed {
                self.model.free(running.seq);
            } else {
                self.retire(running);
            }
            // Told last, so that a client which then reads `/metrics` sees
            // its sequence freed or cached.
            if let Some(event) = event {
                sink.send(event);
            }
        }
        if let Some(residency) = self.model.residency() {
            self.shared
                .resident_bytes
                .store(residency.resident_bytes, Ordering::Relaxed);
            self.shared
                .model_bytes
                .store(residency.total_bytes, Ordering::Relaxed);
            self.shared.has_residency.store(true, Ordering::Relaxed);
        }
    }

    fn record_throughput(&self, sampled: u64, step_started: Instant) {
        let seconds = step_started.elapsed().as_secs_f64();
        if sampled == 0 || seconds <= 0.0 {
            return;
        }
        let instant = sampled as f64 / seconds;
        let previous = f64::from_bits(self.shared.tokens_per_second_bits.load(Ordering::Relaxed));
        let now_ms = self.started.elapsed().as_millis() as u64;
        let stale = now_ms.saturating_sub(self.shared.last_step_ms.load(Ordering::Relaxed)) > 5_000;
        let smoothed = if previous == 0.0 || stale {
            instant
        } else {
            0.9 * previous + 0.1 * instant
        };
        self.shared
            .tokens_per_second_bits
            .store(smoothed.to_bits(), Ordering::Relaxed);
        self.shared.last_step_ms.store(now_ms, Ordering::Relaxed);
    }
}

/// Takes a sampled token into a sequence: end of generation, text, stop
/// strings, limits.
fn advance(
    running: &mut Running<'_>,
    token: u32,
    logprobs: Option<flatrun_model::sampling::TokenLogprobs>,
    text: &dyn TextModel,
) -> Next {
    // An end-of-generation token ends the answer and is not part of it.
    if text.is_end_of_generation(token) {
        return Next::Finish(FinishReason::Eos);
    }
    running.generated.push(token);
    running.last_token = token;
    // Its text, held back while it could begin a stop string.
    let piece = running
        .decoder
        .as_mut()
        .map(|decoder| decoder.push(token))
        .unwrap_or_default();
    let (released, stopped) = running.release(&piece);
    if !running.job.sink.send(GenerationEvent::Token {
        id: token,
        text: released,
        logprobs,
    }) {
        return Next::Gone;
    }
    if let Some(stop) = stopped {
        return Next::Finish(FinishReason::Stop(stop));
    }
    // Limits: the request's max_tokens, then the context.
    let request = &running.job.request;
    let generated = running.generated.len();
    if generated >= request.max_tokens {
        return Next::Finish(FinishReason::Length);
    }
    if running.positions() >= running.capacity {
        return if request.shift {
            Next::Shift
        } else {
            Next::Finish(FinishReason::Context)
        };
    }
    Next::Continue
}

/// What [`take_verified`] kept of a verification pass.
struct Verified {
    next: Next,
    /// Proposals accepted.
    accepted: usize,
    /// Tokens taken into the answer (accepted proposals and the target's
    /// own token after them, fewer when the answer ended among them).
    emitted: usize,
}

/// Checks the proposals of a verification pass in order against the
/// target's logits (`rows`: one row per position fed, the last sampled token
/// first) and takes the tokens into the answer: each proposal the sampler
/// accepts (greedy: the one it picks itself; sampling: speculative sampling,
/// accept with min(1, p/q), which keeps the target's distribution), then
/// the sampler's own token at the first rejection or after the last
/// proposal. The accepted proposals' KV stays in the cache; the caller drops
/// the rest.
fn take_verified(
    running: &mut Running<'_>,
    rows: &[f32],
    proposed: &[u32],
    text: &dyn TextModel,
) -> Verified {
    let k = proposed.len();
    let mut verified = Verified {
        next: Next::Continue,
        accepted: 0,
        emitted: 0,
    };
    if rows.is_empty() || !rows.len().is_multiple_of(k + 1) {
        verified.next = Next::Fail(format!(
            "the model returned {} logits for {} verified positions",
            rows.len(),
            k + 1
        ));
        return verified;
    }
    let vocab = rows.len() / (k + 1);
    // The pass fed the last sampled token.
    running.fed_generated = running.generated.len();
    let mut logits = Vec::with_capacity(vocab);
    for (i, row) in rows.chunks_exact(vocab).enumerate() {
        logits.clear();
        logits.extend_from_slice(row);
        let sampler = &mut running.sampler;
        let history = &running.generated;
        // The proposals (lookup's, or the draft's greedy ones) are certain draws.
        let (token, is_proposal) = match proposed.get(i) {
            None => (sampler.sample(&mut logits, history), false),
            Some(&guess) => match sampler.check_proposal(&mut logits, history, guess, None) {
                Verdict::Accept => (guess, true),
                Verdict::Replace(own) => (own, false),
            },
        };
        let logprobs = running
            .job
            .request
            .logprobs
            .map(|n| token_logprobs(row, token, n));
        verified.emitted += 1;
        verified.next = advance(running, token, logprobs, text);
        if is_proposal {
            // Its KV is in the cache already.
            verified.accepted += 1;
            running.fed_generated = running.generated.len();
        }
        if !is_proposal || !matches!(verified.next, Next::Continue) {
            break;
        }
    }
    if let Some(spec) = running.speculation.as_mut() {
        spec.length.update(k, verified.accepted);
    }
    verified
}

/// The final event, with any text still held back.
fn finish_event(running: &mut Running<'_>, reason: FinishReason) -> GenerationEvent {
    let mut reason = reason;
    let mut trailing = String::new();
    if !matches!(reason, FinishReason::Stop(_)) {
        // An incomplete character at the very end, then the held-back text.
        let rest = running
            .decoder
            .take()
            .map(|decoder| decoder.finish())
            .unwrap_or_default();
        let (released, stopped) = running.release(&rest);
        trailing = released;
        match stopped {
            Some(stop) => reason = FinishReason::Stop(stop),
            None => trailing.push_str(&running.stop.finish()),
        }
    }
    GenerationEvent::Finished {
        reason,
        usage: running.usage(),
        text: trailing,
    }
}
