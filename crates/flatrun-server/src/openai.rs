//! The OpenAI-compatible endpoints: `POST /v1/chat/completions`,
//! `POST /v1/completions`, `GET /v1/models`.

use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, Stream};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api_error::{ApiError, ApiFlavor, ErrorKind};
use crate::engine::{GenerationEvent, GenerationStream, Usage};
use crate::request_body::{RawBody, parse_json};
use crate::state::{AppState, SamplingOverrides, random_id, unix_time};
use flatrun_model::chat_template::ChatMessage;
use flatrun_model::sampling::FinishReason;

const FLAVOR: ApiFlavor = ApiFlavor::OpenAi;

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// A content part; only `text` parts are supported.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// Message content: a string or a list of parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct RequestMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// The fields of `POST /v1/chat/completions` that Flatrun reads (others are
/// ignored).
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<RequestMessage>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<u64>,
    /// vLLM's extension: continue a final assistant message instead of
    /// starting a new turn after it.
    #[serde(default)]
    pub continue_final_message: Option<bool>,
}

/// `prompt`: a string, or a list holding exactly one string.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    One(String),
    Many(Vec<String>),
}

/// The fields of `POST /v1/completions` that Flatrun reads.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: PromptField,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub echo: Option<bool>,
}

/// OpenAI's `finish_reason`.
fn finish_reason(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::Length | FinishReason::Context => "length",
        FinishReason::Eos | FinishReason::Stop(_) => "stop",
    }
}

fn usage_json(usage: Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    })
}

fn check_n(n: Option<u64>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::invalid(
            FLAVOR,
            format!("n = {n} is not supported: this server returns exactly one choice (n = 1)"),
        )),
    }
}

/// Flattens OpenAI messages to plain-text chat turns.
fn chat_messages(messages: Vec<RequestMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(FLAVOR, "messages must not be empty"));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, message)| {
            let role = match message.role.as_str() {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                other => {
                    return Err(ApiError::invalid(
                        FLAVOR,
                        format!("messages[{i}].role `{other}` is not supported (system, developer, user, assistant)"),
                    ))
                }
            };
            let content = match message.content {
                None => String::new(),
                Some(MessageContent::Text(text)) => text,
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, part) in parts.into_iter().enumerate() {
                        match (part.kind.as_str(), part.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    FLAVOR,
                                    format!("messages[{i}].content[{j}]: only text parts are supported, got `{kind}`"),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(state): State<AppState>, body: RawBody) -> Response {
    match chat_completions_inner(state, body).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn chat_completions_inner(state: AppState, body: RawBody) -> Result<Response, ApiError> {
    let engine = state.engine(FLAVOR)?;
    let request: ChatCompletionRequest = parse_json(FLAVOR, body)?;
    let model = state.check_model(FLAVOR, engine.as_ref(), request.model.as_deref())?;
    check_n(request.n)?;
    let messages = chat_messages(request.messages)?;
    // OpenAI's own API answers a final assistant message with a new turn;
    // `continue_final_message` (as vLLM) continues it instead.
    let prompt = if request.continue_final_message.unwrap_or(false) {
        engine.encode_chat_continuing(&messages)
    } else {
        engine.encode_chat(&messages)
    }
    .map_err(|e| ApiError::from_engine(FLAVOR, e))?;
    let sampling = state.sampling(SamplingOverrides {
        temperature: request.temperature,
        top_p: request.top_p,
        top_k: None,
        seed: request.seed,
    });
    let stop = request.stop.map(StopField::into_vec).unwrap_or_default();
    let max_tokens = request.max_completion_tokens.or(request.max_tokens);
    let generation = state.submit(FLAVOR, engine.as_ref(), prompt, max_tokens, sampling, stop)?;
    let meta = ChunkMeta {
        id: format!("chatcmpl-{}", random_id()),
        created: unix_time(),
        model,
    };
    if request.stream.unwrap_or(false) {
        let include_usage = request.stream_options.is_some_and(|o| o.include_usage);
        let stream = SseState::new(generation, meta, include_usage, true);
        return Ok(sse(stream, state.config.ping_interval));
    }
    let (text, reason, usage) = generation.collect_text().await.map_err(internal)?;
    Ok(Json(json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": finish_reason(&reason),
        }],
        "usage": usage_json(usage),
    }))
    .into_response())
}

/// `POST /v1/completions`.
pub async fn completions(State(state): State<AppState>, body: RawBody) -> Response {
    match completions_inner(state, body).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn completions_inner(state: AppState, body: RawBody) -> Result<Response, ApiError> {
    let engine = state.engine(FLAVOR)?;
    let request: CompletionRequest = parse_json(FLAVOR, body)?;
    let model = state.check_model(FLAVOR, engine.as_ref(), request.model.as_deref())?;
    check_n(request.n)?;
    if request.echo == Some(true) {
        return Err(ApiError::invalid(FLAVOR, "echo is not supported"));
    }
    let prompt_text = match request.prompt {
        PromptField::One(text) => text,
        PromptField::Many(mut texts) if texts.len() == 1 => texts.remove(0),
        PromptField::Many(texts) => {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("prompt must be one string, got a list of {}", texts.len()),
            ));
        }
    };
    let prompt = engine
        .tokenize(&prompt_text, true)
        .map_err(|e| ApiError::from_engine(FLAVOR, e))?;
    let sampling = state.sampling(SamplingOverrides {
        temperature: request.temperature,
        top_p: request.top_p,
        top_k: None,
        seed: request.seed,
    });
    let stop = request.stop.map(StopField::into_vec).unwrap_or_default();
    // OpenAI's legacy default is 16 tokens.
    let max_tokens = Some(request.max_tokens.unwrap_or(16));
    let generation = state.submit(FLAVOR, engine.as_ref(), prompt, max_tokens, sampling, stop)?;
    let meta = ChunkMeta {
        id: format!("cmpl-{}", random_id()),
        created: unix_time(),
        model,
    };
    if request.stream.unwrap_or(false) {
        let include_usage = request.stream_options.is_some_and(|o| o.include_usage);
        let stream = SseState::new(generation, meta, include_usage, false);
        return Ok(sse(stream, state.config.ping_interval));
    }
    let (text, reason, usage) = generation.collect_text().await.map_err(internal)?;
    Ok(Json(json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": null,
            "finish_reason": finish_reason(&reason),
        }],
        "usage": usage_json(usage),
    }))
    .into_response())
}

fn internal(message: String) -> ApiError {
    ApiError::new(FLAVOR, ErrorKind::Internal, message)
}

/// `GET /v1/models`.
pub async fn list_models(State(state): State<AppState>) -> Response {
    match state.engine(FLAVOR) {
        Ok(engine) => Json(json!({
            "object": "list",
            "data": [model_object(&state.model_name(engine.as_ref()))],
        }))
        .into_response(),
        Err(error) => error.into_response(),
    }
}

/// `GET /v1/models/{id}`.
pub async fn get_model(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    let result = state
        .engine(FLAVOR)
        .and_then(|engine| state.check_model(FLAVOR, engine.as_ref(), Some(&id)));
    match result {
        Ok(name) => Json(model_object(&name)).into_response(),
        Err(error) => error.into_response(),
    }
}

fn model_object(name: &str) -> Value {
    json!({"id": name, "object": "model", "created": 0, "owned_by": "flatrun"})
}

/// What every chunk of one stream repeats.
struct ChunkMeta {
    id: String,
    created: u64,
    model: String,
}

/// Where an OpenAI stream is.
enum Phase {
    /// Chat only: the first chunk, carrying the role.
    Role,
    Tokens,
    /// The finish chunk is next.
    Finish(FinishReason, Usage),
    /// The usage chunk is next (with `include_usage`).
    Usage(Usage),
    Done,
    End,
}

/// State of an OpenAI SSE stream (chat or completions).
struct SseState {
    generation: GenerationStream,
    meta: ChunkMeta,
    include_usage: bool,
    chat: bool,
    phase: Phase,
}

impl SseState {
    fn new(generation: GenerationStream, meta: ChunkMeta, include_usage: bool, chat: bool) -> Self {
        SseState {
            generation,
            meta,
            include_usage,
            chat,
            phase: if chat { Phase::Role } else { Phase::Tokens },
        }
    }

    /// One chunk with `delta` (chat) or `text` (completions).
    fn chunk(&self, text: Option<&str>, role: bool, finish: Option<&FinishReason>) -> Value {
        let choice = if self.chat {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(text) = text {
                delta.insert("content".into(), json!(text));
            }
            json!({
                "index": 0,
                "delta": delta,
                "logprobs": null,
                "finish_reason": finish.map(finish_reason),
            })
        } else {
            json!({
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": null,
                "finish_reason": finish.map(finish_reason),
            })
        };
        self.envelope(vec![choice], None)
    }

    fn envelope(&self, choices: Vec<Value>, usage: Option<Usage>) -> Value {
        let mut chunk = json!({
            "id": self.meta.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        });
        if self.include_usage {
            chunk["usage"] = usage.map_or(Value::Null, usage_json);
        }
        chunk
    }

    /// The next SSE event, or `None` at the end.
    async fn next(mut self) -> Option<(Event, Self)> {
        loop {
            let data = match std::mem::replace(&mut self.phase, Phase::End) {
                Phase::Role => {
                    self.phase = Phase::Tokens;
                    self.chunk(Some(""), true, None).to_string()
                }
                Phase::Tokens => match self.generation.next_event().await {
                    Some(GenerationEvent::Token { text, .. }) => {
                        self.phase = Phase::Tokens;
                        if text.is_empty() {
                            continue;
                        }
                        self.chunk(Some(&text), false, None).to_string()
                    }
                    Some(GenerationEvent::Finished {
                        reason,
                        usage,
                        text,
                    }) => {
                        self.phase = Phase::Finish(reason, usage);
                        if text.is_empty() {
                            continue;
                        }
                        self.chunk(Some(&text), false, None).to_string()
                    }
                    Some(GenerationEvent::Failed { message }) => {
                        self.phase = Phase::Done;
                        ApiError::new(FLAVOR, ErrorKind::Internal, message)
                            .body()
                            .to_string()
                    }
                    None => {
                        self.phase = Phase::Done;
                        ApiError::new(FLAVOR, ErrorKind::Internal, "generation ended unexpectedly")
                            .body()
                            .to_string()
                    }
                },
                Phase::Finish(reason, usage) => {
                    self.phase = if self.include_usage {
                        Phase::Usage(usage)
                    } else {
                        Phase::Done
                    };
                    let text = if self.chat { None } else { Some("") };
                    self.chunk(text, false, Some(&reason)).to_string()
                }
                Phase::Usage(usage) => {
                    self.phase = Phase::Done;
                    self.envelope(Vec::new(), Some(usage)).to_string()
                }
                Phase::Done => {
                    self.phase = Phase::End;
                    "[DONE]".to_string()
                }
                Phase::End => return None,
            };
            return Some((Event::default().data(data), self));
        }
    }
}

/// The SSE response. While no chunk comes (waiting in the queue, a long
/// prefill) an SSE comment line every `keep_alive` keeps the connection
/// alive and lets the server notice a client that went away.
fn sse(state: SseState, keep_alive: Duration) -> Response {
    let events = stream::unfold(state, SseState::next);
    Sse::new(ok_events(events))
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}

fn ok_events(
    events: impl Stream<Item = Event> + Send + 'static,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    use futures::StreamExt;
    events.map(Ok)
}
