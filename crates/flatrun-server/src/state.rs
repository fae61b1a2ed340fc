//! Shared state of the handlers: the engine (once loaded), the config, the
//! metrics, and the request checks common to both APIs.

use std::sync::{Arc, OnceLock};

use crate::api_error::{ApiError, ApiFlavor, ErrorKind};
use crate::config::ServerConfig;
use crate::engine::{Engine, GenerationRequest, GenerationStream};
use crate::metrics::Metrics;
use crate::models::{AcquireError, ModelSet};
use flatrun_model::sampling::SamplingParams;

/// Where the engine appears once loaded; `/health` answers 503 until then.
#[derive(Clone, Default)]
pub struct EngineSlot(Arc<OnceLock<Arc<dyn Engine>>>);

impl EngineSlot {
    /// Installs the loaded engine (only the first call has an effect).
    pub fn set(&self, engine: Arc<dyn Engine>) {
        let _ = self.0.set(engine);
    }

    pub fn get(&self) -> Option<&Arc<dyn Engine>> {
        self.0.get()
    }
}

/// Everything a handler needs.
#[derive(Clone)]
pub struct AppState {
    /// The served models, the default first.
    pub models: ModelSet,
    pub config: Arc<ServerConfig>,
    pub metrics: Arc<Metrics>,
}

/// Sampling fields a request may set.
#[derive(Clone, Copy, Debug, Default)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
}

impl AppState {
    /// The name the model is served under.
    pub fn model_name(&self, engine: &dyn Engine) -> String {
        self.config
            .served_model_name
            .clone()
            .unwrap_or_else(|| engine.model_name().to_string())
    }

    /// The default model's served name; 503 while a model the caller
    /// installs has not been installed yet.
    fn default_name(&self, flavor: ApiFlavor) -> Result<String, ApiError> {
        self.config
            .served_model_name
            .clone()
            .or_else(|| self.models.default_name())
            .ok_or_else(|| loading(flavor, "the model is still loading"))
    }

    /// The engine and name a request's `model` field picks: the default
    /// model for no name or its own, another served model by its name; any
    /// other name is a 404 listing what this server serves. A model not in
    /// memory is loaded first (the request waits); one installed by the
    /// caller and not yet there is a 503.
    pub async fn route(
        &self,
        flavor: ApiFlavor,
        requested: Option<&str>,
    ) -> Result<(Arc<dyn Engine>, String), ApiError> {
        let default = self.default_name(flavor)?;
        let (index, name) = match requested {
            None | Some("") => (0, default),
            Some(name) if name == default => (0, default),
            Some(name) => match self.models.index_of(Some(name)).filter(|&i| i > 0) {
                Some(index) => (index, name.to_string()),
                None => return Err(self.not_found(flavor, name)),
            },
        };
        let engine = self
            .models
            .acquire(index)
            .await
            .map_err(|e| acquire_error(flavor, &name, e))?;
        Ok((engine, name))
    }

    /// The 404 for a model this server does not serve, listing those it does.
    pub fn not_found(&self, flavor: ApiFlavor, name: &str) -> ApiError {
        let served = match self.served_names(flavor) {
            Ok(names) => names,
            Err(error) => return error,
        };
        ApiError::new(
            flavor,
            ErrorKind::NotFound,
            format!(
                "model `{name}` not found: this server serves {}",
                served
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
        .with_code("model_not_found")
    }

    /// The names of every served model, the default's first.
    pub fn served_names(&self, flavor: ApiFlavor) -> Result<Vec<String>, ApiError> {
        let mut names = vec![self.default_name(flavor)?];
        names.extend(self.models.names());
        Ok(names)
    }

    /// Sampling of a request: its own fields over the server's defaults.
    pub fn sampling(&self, overrides: SamplingOverrides) -> SamplingParams {
        let defaults = &self.config.default_sampling;
        SamplingParams {
            temperature: overrides.temperature.unwrap_or(defaults.temperature),
            top_p: overrides.top_p.unwrap_or(defaults.top_p),
            top_k: overrides.top_k.unwrap_or(defaults.top_k),
            seed: overrides.seed.or(defaults.seed),
            ..defaults.clone()
        }
    }

    /// Checks the limits and submits: context overflow is a 400 before any
    /// work, a full queue a 429/529, more than `--max-tokens-limit` a 400.
    /// `max_tokens` of `None` means "up to the end of the context" (or the
    /// limit, if sooner).
    pub fn submit(
        &self,
        flavor: ApiFlavor,
        engine: &dyn Engine,
        prompt: Vec<u32>,
        max_tokens: Option<u64>,
        sampling: SamplingParams,
        stop: Vec<String>,
    ) -> Result<GenerationStream, ApiError> {
        let request = GenerationRequest {
            prompt,
            sampling,
            stop,
            ..GenerationRequest::default()
        };
        self.submit_request(flavor, engine, request, max_tokens)
    }

    /// [`AppState::submit`] of a whole request (logprobs, grammar);
    /// `request.max_tokens` is set from `max_tokens`.
    pub fn submit_request(
        &self,
        flavor: ApiFlavor,
        engine: &dyn Engine,
        mut request: GenerationRequest,
        max_tokens: Option<u64>,
    ) -> Result<GenerationStream, ApiError> {
        let context = engine.context_length();
        let mode = self.config.context_overflow;
        crate::overflow::fit_prompt(&mut request, mode, context, max_tokens);
        let prompt = &request.prompt;
        let overflow = |max_tokens: u64| {
            ApiError::invalid(
                flavor,
                format!(
                    "this model's context is {context} tokens, but the request needs {} \
                     ({} in the prompt + {max_tokens} max_tokens); shorten the prompt or lower max_tokens",
                    (prompt.len() as u64).saturating_add(max_tokens),
                    prompt.len()
                ),
            )
            .with_code("context_length_exceeded")
        };
        let limit = self.config.max_tokens_limit;
        if let (Some(n), Some(limit)) = (max_tokens, limit)
            && n > limit
        {
            return Err(ApiError::invalid(
                flavor,
                format!("max_tokens = {n} is more than this server's limit of {limit}"),
            )
            .with_code("max_tokens_limit"));
        }
        let max_tokens = match max_tokens {
            Some(0) => return Err(ApiError::invalid(flavor, "max_tokens must be at least 1")),
            Some(n)
                if !request.shift && (prompt.len() as u64).saturating_add(n) > context as u64 =>
            {
                return Err(overflow(n));
            }
            Some(n) => n as usize,
            None if prompt.len() >= context => return Err(overflow(1)),
            None => (context - prompt.len()).min(limit.map_or(usize::MAX, |l| l as usize)),
        };
        request.max_tokens = max_tokens;
        engine
            .submit(request)
            .map_err(|e| ApiError::from_engine(flavor, e))
    }
}

fn loading(flavor: ApiFlavor, message: impl Into<String>) -> ApiError {
    ApiError::new(flavor, ErrorKind::Unavailable, message).with_code("model_loading")
}

fn acquire_error(flavor: ApiFlavor, name: &str, error: AcquireError) -> ApiError {
    match error {
        AcquireError::Loading => loading(flavor, format!("model `{name}` is still loading")),
        AcquireError::LoadFailed { .. } => {
            ApiError::new(flavor, ErrorKind::Internal, error.to_string())
                .with_code("model_load_failed")
        }
        AcquireError::NoMemory { .. } => {
            ApiError::new(flavor, ErrorKind::Unavailable, error.to_string())
                .with_code("insufficient_memory")
        }
    }
}

/// Unix time in seconds, for `created` fields.
pub fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A short random hex id for responses (`chatcmpl-…`, `msg_…`).
pub fn random_id() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let count = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut rng = flatrun_model::sampling::Xoshiro256::seed_from_u64(nanos ^ count.rotate_left(40));
    format!("{:016x}{:08x}", rng.next_u64(), rng.next_u64() as u32)
}
