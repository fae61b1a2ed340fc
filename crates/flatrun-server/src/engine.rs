//! What the HTTP layer needs from a loaded model: the [`Engine`] trait and
//! the request/event types that cross it.
//!
//! The HTTP handlers only translate wire formats onto this trait. The usual
//! implementation is [`crate::BatchEngine`], a scheduler over a lower-level
//! [`crate::BatchModel`]: the Flatrun runtime (`crate::runtime`), or in tests
//! the deterministic mock (`crate::mock`, feature `testing`).
//!
//! Chat turns, sampling settings and finish reasons are the model crate's
//! own types ([`ChatMessage`], [`SamplingParams`], [`FinishReason`]); the
//! HTTP handlers convert to and from the wire formats.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::mpsc;

use flatrun_model::chat_template::ChatMessage;
use flatrun_model::chat_template::tools::ToolSyntax;
use flatrun_model::sampling::Vocabulary;
use flatrun_model::sampling::{ConstraintFactory, FinishReason, SamplingParams, TokenLogprobs};

/// One generation to run: an already tokenized prompt and its limits.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    /// The sampler's settings, used as they are (the HTTP handlers start
    /// from [`crate::ServerConfig::default_sampling`]).
    pub sampling: SamplingParams,
    /// Hard cap on generated tokens (the sequence also stops at the context end).
    pub max_tokens: usize,
    /// Generation ends when the text contains one of these; the stop string
    /// itself is not returned.
    pub stop: Vec<String>,
    /// Report each token's log-probability and the `n` most likely
    /// alternatives (`Some(0)`: the token's alone).
    pub logprobs: Option<usize>,
    /// A grammar the tokens must follow (structured output, forced tool calls).
    pub constraint: Option<Arc<dyn ConstraintFactory>>,
    /// Reuse the KV of a cached or running sequence sharing a prefix with
    /// the prompt, and keep this one's for later requests
    /// (llama-server's `cache_prompt`; on by default).
    pub cache_prompt: bool,
    /// Leading prompt tokens that overflow handling never drops (the
    /// system prompt).
    pub keep: usize,
    /// Context shift (`--context-overflow shift`): when the sequence fills
    /// the context, drop the oldest half of its tokens after the first
    /// `keep` and go on; otherwise stop with [`FinishReason::Context`].
    pub shift: bool,
    /// Most tokens proposed per pass when the server speculates
    /// ([`crate::SchedulerConfig::speculation`]): `None` takes the server's
    /// `draft_max`, `Some(0)` turns speculation off for this request
    /// (llama-server's `speculative.n_max`).
    pub draft_max: Option<usize>,
}

/// The longest draft a request may ask for ([`GenerationRequest::draft_max`]).
pub const MAX_DRAFT: usize = 64;

impl Default for GenerationRequest {
    fn default() -> Self {
        GenerationRequest {
            prompt: Vec::new(),
            sampling: SamplingParams::default(),
            max_tokens: 0,
            stop: Vec::new(),
            logprobs: None,
            constraint: None,
            cache_prompt: true,
            keep: 0,
            shift: false,
            draft_max: None,
        }
    }
}

/// Where the embeddings of one request arrive ([`Engine::embed`]), one
/// per input.
pub type EmbeddingReceiver = tokio::sync::oneshot::Receiver<Result<Vec<Vec<f32>>, EngineError>>;

/// Where a prompt's log-probabilities arrive ([`Engine::score`]).
pub type ScoreReceiver = tokio::sync::oneshot::Receiver<Result<Vec<TokenLogprobs>, EngineError>>;

/// Token counts of one finished generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV was reused from an earlier sequence rather
    /// than computed (included in `prompt_tokens`).
    pub cached_tokens: usize,
}

impl Usage {
    /// Adds one choice of a request to the request's usage (`total` starts
    /// as `None`): the prompt counted once, every choice's completion
    /// tokens, and as cached the least any choice reused (the prompt's KV
    /// was computed once and the other choices copied it).
    pub fn add_choice(total: &mut Option<Usage>, choice: Usage) {
        *total = Some(match *total {
            None => choice,
            Some(t) => Usage {
                prompt_tokens: choice.prompt_tokens,
                completion_tokens: t.completion_tokens + choice.completion_tokens,
                cached_tokens: t.cached_tokens.min(choice.cached_tokens),
            },
        });
    }

    /// OpenAI's `usage` object (`prompt_tokens_details.cached_tokens`: the
    /// prompt tokens whose KV was reused).
    pub fn openai_json(self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    /// Anthropic's `usage` object: as Anthropic counts, `input_tokens` are
    /// the prompt tokens computed and `cache_read_input_tokens` the reused
    /// ones (together the whole prompt).
    pub fn anthropic_json(self) -> serde_json::Value {
        serde_json::json!({
            "input_tokens": self.prompt_tokens - self.cached_tokens.min(self.prompt_tokens),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached_tokens,
            "output_tokens": self.completion_tokens,
        })
    }
}

/// What a running generation reports, in order: any number of `Token`s, then
/// exactly one `Finished` or `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum GenerationEvent {
    /// A generated token and the text it released. The text may be empty
    /// (an incomplete UTF-8 character, or text held back because it could be
    /// the start of a stop string) or carry text held back earlier.
    Token {
        id: u32,
        text: String,
        /// With [`GenerationRequest::logprobs`]: the log-softmax of the
        /// model's logits at this step, before any sampling transform.
        logprobs: Option<TokenLogprobs>,
    },
    /// The generation ended normally. `text` is the text still held back
    /// at the end (an incomplete stop-string prefix), usually empty.
    Finished {
        reason: FinishReason,
        usage: Usage,
        text: String,
    },
    /// The generation was aborted (model error, server shutting down).
    Failed { message: String },
}

/// Receiving end of a submitted generation. Dropping it cancels the
/// generation: the scheduler frees the sequence at its next step.
#[derive(Debug)]
pub struct GenerationStream {
    events: mpsc::UnboundedReceiver<GenerationEvent>,
    cancelled: Arc<AtomicBool>,
}

/// Sending end of a generation, held by the engine.
#[derive(Debug, Clone)]
pub struct GenerationSink {
    events: mpsc::UnboundedSender<GenerationEvent>,
    cancelled: Arc<AtomicBool>,
}

/// A connected stream/sink pair.
pub fn generation_channel() -> (GenerationSink, GenerationStream) {
    let (tx, rx) = mpsc::unbounded_channel();
    let cancelled = Arc::new(AtomicBool::new(false));
    (
        GenerationSink {
            events: tx,
            cancelled: cancelled.clone(),
        },
        GenerationStream {
            events: rx,
            cancelled,
        },
    )
}

impl GenerationStream {
    /// The next event, or `None` once the engine dropped the generation
    /// (after its last event).
    pub async fn next_event(&mut self) -> Option<GenerationEvent> {
        self.events.recv().await
    }

    /// Collects the whole generation: its text and how it ended.
    pub async fn collect_text(mut self) -> Result<(String, FinishReason, Usage), String> {
        let mut text = String::new();
        while let Some(event) = self.next_event().await {
            match event {
                GenerationEvent::Token { text: piece, .. } => text.push_str(&piece),
                GenerationEvent::Finished {
                    reason,
                    usage,
                    text: rest,
                } => {
                    text.push_str(&rest);
                    return Ok((text, reason, usage));
                }
                GenerationEvent::Failed { message } => return Err(message),
            }
        }
        Err("the engine dropped the generation without finishing it".to_string())
    }
}

impl Drop for GenerationStream {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Release);
    }
}

impl GenerationSink {
    /// Sends an event; returns false when the client is gone.
    pub fn send(&self, event: GenerationEvent) -> bool {
        self.events.send(event).is_ok()
    }

    /// True once the receiving [`GenerationStream`] was dropped.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire) || self.events.is_closed()
    }
}

/// Errors an engine reports to the HTTP layer.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum EngineError {
    /// Every sequence slot and queue place is taken.
    #[error("server overloaded: {active} sequences running and {queued} queued (limit {limit})")]
    QueueFull {
        active: usize,
        queued: usize,
        limit: usize,
    },
    /// The prompt plus the requested tokens do not fit the context.
    #[error(
        "prompt of {prompt_tokens} tokens plus max_tokens {max_tokens} exceeds the context of {context_length} tokens"
    )]
    ContextOverflow {
        prompt_tokens: usize,
        max_tokens: usize,
        context_length: usize,
    },
    /// The request is not usable (empty prompt, invalid sampling value, ...).
    #[error("{0}")]
    InvalidRequest(String),
    /// Tokenizer or template failure.
    #[error("{0}")]
    Text(String),
    /// The engine stopped (shutting down, or its scheduler thread ended).
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// Engine-wide counters for `/metrics`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Sequences currently in the batch.
    pub active_sequences: usize,
    /// Admitted requests waiting for a sequence slot.
    pub queued_requests: usize,
    /// Prompt tokens evaluated since start.
    pub prompt_tokens_total: u64,
    /// Tokens generated since start.
    pub generated_tokens_total: u64,
    /// Context shifts done in place (cached keys re-rotated), and those
    /// that computed the kept tokens again.
    pub context_shifts_rotated_total: u64,
    pub context_shifts_recomputed_total: u64,
    /// Decode steps run since start (one pass through the layers each).
    pub steps_total: u64,
    /// Recent generation throughput over all sequences, tokens per second.
    pub generated_tokens_per_second: f64,
    /// Requests that reused a shared prefix's KV, and requests that looked.
    pub prefix_hits_total: u64,
    pub prefix_lookups_total: u64,
    /// Grammar masks computed (one per constrained sequence per step).
    pub grammar_masks_total: u64,
    /// Time spent computing them, on threads beside the layers.
    pub grammar_mask_seconds_total: f64,
    /// Time steps waited for masks after the layers were done (what the
    /// masks cost the decode).
    pub grammar_wait_seconds_total: f64,
    /// Prompt tokens not computed thanks to prefix reuse.
    pub prefix_reused_tokens_total: u64,
    /// Finished sequences kept for reuse, and their KV bytes.
    pub prompt_cache_entries: usize,
    pub prompt_cache_bytes: u64,
    /// Cached sequences dropped to stay under the budget.
    pub prompt_cache_evictions_total: u64,
    /// KV bytes in use: running sequences plus the prompt cache.
    pub kv_bytes: u64,
    /// Speculative decoding: verification passes of one sequence with
    /// proposals, the tokens proposed, and those accepted.
    pub speculative_passes_total: u64,
    pub speculative_proposed_total: u64,
    pub speculative_accepted_total: u64,
    /// Model bytes currently resident (weights in memory), if known.
    pub resident_bytes: Option<u64>,
    /// Total model weight bytes, if known.
    pub model_bytes: Option<u64>,
}

/// A loaded model as the HTTP server sees it.
///
/// Everything is `&self`: handlers call it concurrently. Generation is
/// asynchronous: [`Engine::submit`] returns at once with a
/// [`GenerationStream`]; dropping the stream cancels the generation.
pub trait Engine: Send + Sync + 'static {
    /// The name clients use in the `model` field.
    fn model_name(&self) -> &str;
    /// Context length in tokens (prompt + generated).
    fn context_length(&self) -> usize;
    /// Text to token ids. `add_special` adds the model's BOS (or similar)
    /// where the model wants one.
    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, EngineError>;
    /// Token ids back to text (invalid UTF-8 replaced).
    fn detokenize(&self, tokens: &[u32]) -> Result<String, EngineError>;
    /// Renders the chat template over `messages`, ending with the prompt
    /// for the assistant's next turn.
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError>;
    /// The prompt tokens for a chat: the rendered template, tokenized.
    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, EngineError> {
        let text = self.render_chat(messages)?;
        self.tokenize(&text, true)
    }
    /// The prompt tokens for a chat whose last message, when it is the
    /// assistant's, is the beginning of the answer to continue (Anthropic's
    /// prefill): the template over the earlier messages, ending with the
    /// assistant prompt, then that text. Otherwise [`Engine::encode_chat`].
    fn encode_chat_continuing(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, EngineError> {
        match messages.split_last() {
            Some((last, earlier)) if last.role == "assistant" => {
                let mut text = self.render_chat(earlier)?;
                text.push_str(&last.content);
                self.tokenize(&text, true)
            }
            _ => self.encode_chat(messages),
        }
    }
    /// The chat template over `messages` with tool definitions (`tools`:
    /// OpenAI-shaped function objects). Engines whose template cannot take
    /// tools refuse a request that has some.
    fn render_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
    ) -> Result<String, EngineError> {
        match tools {
            None => self.render_chat(messages),
            Some(_) => Err(EngineError::InvalidRequest(
                "this model's chat template does not take tools".to_string(),
            )),
        }
    }
    /// The prompt tokens of a chat with tools; `continuing` as
    /// [`Engine::encode_chat_continuing`].
    fn encode_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        continuing: bool,
    ) -> Result<Vec<u32>, EngineError> {
        match messages.split_last() {
            Some((last, earlier)) if continuing && last.role == "assistant" => {
                let mut text = self.render_chat_tools(earlier, tools)?;
                text.push_str(&last.content);
                self.tokenize(&text, true)
            }
            _ => {
                let text = self.render_chat_tools(messages, tools)?;
                self.tokenize(&text, true)
            }
        }
    }
    /// How the model writes tool calls (from its chat template), if it can.
    fn tool_syntax(&self) -> Option<ToolSyntax> {
        None
    }
    /// The vocabulary size, when known (to check token ids in requests).
    fn vocab_size(&self) -> Option<usize> {
        None
    }
    /// The bytes of every token of the vocabulary, in id order (for
    /// grammars), when the model can give them.
    fn vocabulary(&self) -> Option<Arc<Vocabulary>> {
        None
    }
    /// The embeddings of `inputs`: the model's final hidden states, pooled
    /// as the model says (mean by default) and L2-normalized, computed
    /// between generation steps with every input in one batch. The
    /// receiver gets one vector per input or why there are none.
    fn embed(&self, inputs: Vec<Vec<u32>>) -> Result<EmbeddingReceiver, EngineError> {
        let _ = inputs;
        Err(EngineError::InvalidRequest(
            "this model does not serve embeddings".to_string(),
        ))
    }
    /// Teacher-forced log-probabilities of `tokens[1..]` (each with the
    /// `top` most likely tokens at its position), computed between
    /// generation steps: the prompt part of completions' `echo` with
    /// `logprobs`.
    fn score(&self, tokens: Vec<u32>, top: usize) -> Result<ScoreReceiver, EngineError> {
        let _ = (tokens, top);
        Err(EngineError::InvalidRequest(
            "this model does not score prompts".to_string(),
        ))
    }
    /// Starts a generation, or refuses it at once (queue full, too long).
    fn submit(&self, request: GenerationRequest) -> Result<GenerationStream, EngineError>;
    /// Counters for `/metrics`.
    fn stats(&self) -> EngineStats;
    /// Ends every running and queued generation with
    /// [`GenerationEvent::Failed`] and refuses new ones.
    fn shutdown(&self);
}
