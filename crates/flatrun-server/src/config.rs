//! [`ServerConfig`]: what `flatrun serve` fills from its flags.

use std::time::Duration;

use crate::models::ModelPolicy;
use flatrun_model::sampling::SamplingParams;

/// Settings of the HTTP server. The batch limits (`--max-seqs`,
/// `--max-queue`) belong to the engine: see [`crate::SchedulerConfig`].
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to bind (`--host`); loopback unless asked otherwise.
    pub host: String,
    /// Port to bind (`--port`); 0 picks a free one.
    pub port: u16,
    /// When set (`--api-key` or `FLATRUN_API_KEY`), every endpoint but
    /// `/health` (and `/metrics` with [`ServerConfig::public_metrics`])
    /// requires it as `Authorization: Bearer KEY` or `x-api-key: KEY`,
    /// compared in constant time.
    pub api_key: Option<String>,
    /// Largest accepted request body in bytes (`--max-body`); larger → 413.
    pub max_body_bytes: usize,
    /// Name to serve the model under, instead of the engine's own name.
    pub served_model_name: Option<String>,
    /// Sampling used where a request does not say: [`api_default_sampling`]
    /// with the CLI's sampling flags over it. A request's own `temperature`,
    /// `top_p`, `top_k` and `seed` replace these; the other fields apply as
    /// they are.
    pub default_sampling: SamplingParams,
    /// Anthropic streams send a `ping` event, OpenAI streams an SSE comment,
    /// after this long without output (queued, or a long prefill).
    pub ping_interval: Duration,
    /// On SIGINT/SIGTERM, how long in-flight requests may run before they
    /// are cancelled.
    pub shutdown_grace: Duration,
    /// `/metrics` answers without the API key (`--public-metrics`).
    pub public_metrics: bool,
    /// Largest `max_tokens` a request may ask for (`--max-tokens-limit`); a
    /// request that asks for more is a 400, one that does not say gets this.
    pub max_tokens_limit: Option<u64>,
    /// Longest a request may take, reading its body to its last byte out
    /// (`--request-timeout`): a late answer is a 504, a late stream ends
    /// with an error event.
    pub request_timeout: Option<Duration>,
    /// Longest a client may take to send its request head
    /// (`--header-timeout`): slow clients are disconnected.
    pub header_timeout: Duration,
    /// Largest request head in bytes (`--max-header`): larger is a 431.
    pub max_header_bytes: usize,
    /// Origins allowed to call the server from a browser (`--cors`); empty
    /// means no CORS headers at all, `*` allows any origin.
    pub cors_origins: Vec<String>,
    /// What a request too long for the context gets (`--context-overflow`).
    pub context_overflow: ContextOverflow,
    /// The memory budget of the served models and when idle ones unload
    /// (`--max-resident`, `--keep-alive`).
    pub model_policy: ModelPolicy,
}

/// What happens to a request whose prompt plus `max_tokens` does not fit
/// the context (`--context-overflow`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContextOverflow {
    /// The API's error (OpenAI `context_length_exceeded`, Anthropic
    /// `invalid_request_error`), before any work.
    #[default]
    Error,
    /// Chat requests: drop the oldest messages after the system prompt
    /// until the conversation fits (the newest turns are kept); a plain
    /// completion prompt loses its oldest tokens.
    TruncateMiddle,
    /// Generate on past the end, as llama.cpp's `--context-shift`: when a
    /// sequence fills the context, the oldest half of the tokens after the
    /// system prompt is dropped and the rest moves down, its cached keys
    /// re-rotated to their new positions (or, where the model cannot do
    /// that, computed again there). A prompt longer than the context loses
    /// its oldest tokens after the system prompt first.
    Shift,
}

impl std::str::FromStr for ContextOverflow {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "error" => Ok(ContextOverflow::Error),
            "truncate-middle" => Ok(ContextOverflow::TruncateMiddle),
            "shift" => Ok(ContextOverflow::Shift),
            other => Err(format!(
                "`{other}` (expected error, truncate-middle or shift)"
            )),
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".to_string(),
            port: 8080,
            api_key: None,
            max_body_bytes: 4 * 1024 * 1024,
            served_model_name: None,
            default_sampling: api_default_sampling(),
            ping_interval: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(10),
            public_metrics: false,
            max_tokens_limit: None,
            request_timeout: None,
            header_timeout: Duration::from_secs(10),
            max_header_bytes: 64 * 1024,
            cors_origins: Vec::new(),
            context_overflow: ContextOverflow::Error,
            model_policy: ModelPolicy::default(),
        }
    }
}

/// The OpenAI and Anthropic defaults: temperature 1, no top-k or top-p
/// truncation, no penalties, a fresh seed per request.
pub fn api_default_sampling() -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: None,
        penalty_window: 0,
        ..SamplingParams::default()
    }
}
