//! The Anthropic-compatible endpoints: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`.

use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, StreamExt};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api_error::{ApiError, ApiFlavor, ErrorKind};
use crate::engine::{GenerationEvent, GenerationStream, Usage};
use crate::request_body::{RawBody, parse_json};
use crate::state::{AppState, SamplingOverrides, random_id};
use flatrun_model::chat_template::ChatMessage;
use flatrun_model::sampling::FinishReason;

const FLAVOR: ApiFlavor = ApiFlavor::Anthropic;

/// A content block; only `text` blocks are supported.
#[derive(Debug, Deserialize)]
pub struct ContentBlock {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// Content (or `system`): a string or a list of blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<ContentBlock>),
}

#[derive(Debug, Deserialize)]
pub struct InputMessage {
    pub role: String,
    pub content: Content,
}

/// The fields of `POST /v1/messages` that Flatrun reads (others ignored).
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<InputMessage>,
    #[serde(default)]
    pub system: Option<Content>,
    /// Required by the API; `Option` so that its absence is our own 400.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<u64>,
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: Option<bool>,
}

/// The fields of `POST /v1/messages/count_tokens`.
#[derive(Debug, Deserialize)]
pub struct CountTokensRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<InputMessage>,
    #[serde(default)]
    pub system: Option<Content>,
}

fn content_text(content: Content, location: &str) -> Result<String, ApiError> {
    match content {
        Content::Text(text) => Ok(text),
        Content::Blocks(blocks) => {
            let mut text = String::new();
            for (j, block) in blocks.into_iter().enumerate() {
                match (block.kind.as_str(), block.text) {
                    ("text", Some(t)) => text.push_str(&t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            FLAVOR,
                            format!("{location}.{j}: only text blocks are supported, got `{kind}`"),
                        ));
                    }
                }
            }
            Ok(text)
        }
    }
}

/// The conversation as plain-text chat turns, the system prompt first.
fn chat_messages(
    system: Option<Content>,
    messages: Vec<InputMessage>,
) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            FLAVOR,
            "messages: at least one message is required",
        ));
    }
    let mut turns = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = system {
        let text = content_text(system, "system")?;
        if !text.is_empty() {
            turns.push(ChatMessage::new("system", text));
        }
    }
    for (i, message) in messages.into_iter().enumerate() {
        let role = match message.role.as_str() {
            "user" => "user",
            "assistant" => "assistant",
            other => {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!("messages.{i}.role: `{other}` is not one of user, assistant"),
                ));
            }
        };
        let content = content_text(message.content, &format!("messages.{i}.content"))?;
        turns.push(ChatMessage::new(role, content));
    }
    // As Anthropic's API: a prefill may not end in whitespace.
    if let Some(last) = turns.last()
        && last.role == "assistant"
        && last.content.ends_with(char::is_whitespace)
    {
        return Err(ApiError::invalid(
            FLAVOR,
            "messages: final assistant content cannot end with trailing whitespace",
        ));
    }
    Ok(turns)
}

/// Anthropic's `stop_reason` and `stop_sequence`.
fn stop_reason(reason: &FinishReason) -> (&'static str, Value) {
    match reason {
        FinishReason::Eos => ("end_turn", Value::Null),
        FinishReason::Length | FinishReason::Context => ("max_tokens", Value::Null),
        FinishReason::Stop(stop) => ("stop_sequence", json!(stop)),
    }
}

/// `POST /v1/messages`.
pub async fn messages(State(state): State<AppState>, body: RawBody) -> Response {
    match messages_inner(state, body).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn messages_inner(state: AppState, body: RawBody) -> Result<Response, ApiError> {
    let engine = state.engine(FLAVOR)?;
    let request: MessagesRequest = parse_json(FLAVOR, body)?;
    let Some(max_tokens) = request.max_tokens else {
        return Err(ApiError::invalid(FLAVOR, "max_tokens: Field required"));
    };
    let model = state.check_model(FLAVOR, engine.as_ref(), request.model.as_deref())?;
    let turns = chat_messages(request.system, request.messages)?;
    // A final assistant message is the start of the answer (prefill).
    let prompt = engine
        .encode_chat_continuing(&turns)
        .map_err(|e| ApiError::from_engine(FLAVOR, e))?;
    let sampling = state.sampling(SamplingOverrides {
        temperature: request.temperature,
        top_p: request.top_p,
        top_k: request.top_k.map(|k| k as usize),
        seed: None,
    });
    let stop = request.stop_sequences.unwrap_or_default();
    let input_tokens = prompt.len();
    let generation = state.submit(
        FLAVOR,
        engine.as_ref(),
        prompt,
        Some(max_tokens),
        sampling,
        stop,
    )?;
    let id = format!("msg_{}", random_id());
    if request.stream.unwrap_or(false) {
        let stream = MessageStream {
            generation,
            id,
            model,
            input_tokens,
            ping_interval: state.config.ping_interval,
            phase: Phase::MessageStart,
        };
        let events = stream::unfold(stream, MessageStream::next).map(Ok::<_, Infallible>);
        return Ok(Sse::new(events).into_response());
    }
    let (text, reason, usage) = generation
        .collect_text()
        .await
        .map_err(|message| ApiError::new(FLAVOR, ErrorKind::Internal, message))?;
    let (stop_reason, stop_sequence) = stop_reason(&reason);
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens},
    }))
    .into_response())
}

/// `POST /v1/messages/count_tokens`.
pub async fn count_tokens(State(state): State<AppState>, body: RawBody) -> Response {
    let result = (|| {
        let engine = state.engine(FLAVOR)?;
        let request: CountTokensRequest = parse_json(FLAVOR, body)?;
        state.check_model(FLAVOR, engine.as_ref(), request.model.as_deref())?;
        let turns = chat_messages(request.system, request.messages)?;
        let prompt = engine
            .encode_chat_continuing(&turns)
            .map_err(|e| ApiError::from_engine(FLAVOR, e))?;
        Ok::<_, ApiError>(json!({"input_tokens": prompt.len()}))
    })();
    match result {
        Ok(body) => Json(body).into_response(),
        Err(error) => error.into_response(),
    }
}

/// Where an Anthropic stream is.
enum Phase {
    MessageStart,
    BlockStart,
    Deltas,
    BlockStop(FinishReason, Usage),
    MessageDelta(FinishReason, Usage),
    MessageStop,
    End,
}

/// State of one `/v1/messages` SSE stream.
struct MessageStream {
    generation: GenerationStream,
    id: String,
    model: String,
    input_tokens: usize,
    ping_interval: Duration,
    phase: Phase,
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

fn text_delta(text: &str) -> Event {
    event(
        "content_block_delta",
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
    )
}

impl MessageStream {
    /// The next SSE event, or `None` at the end.
    async fn next(mut self) -> Option<(Event, Self)> {
        loop {
            let event = match std::mem::replace(&mut self.phase, Phase::End) {
                Phase::MessageStart => {
                    self.phase = Phase::BlockStart;
                    event(
                        "message_start",
                        json!({"type": "message_start", "message": {
                            "id": self.id,
                            "type": "message",
                            "role": "assistant",
                            "model": self.model,
                            "content": [],
                            "stop_reason": null,
                            "stop_sequence": null,
                            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
                        }}),
                    )
                }
                Phase::BlockStart => {
                    self.phase = Phase::Deltas;
                    event(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": 0,
                               "content_block": {"type": "text", "text": ""}}),
                    )
                }
                Phase::Deltas => {
                    // Wait for output; a ping keeps the connection alive meanwhile.
                    let next = tokio::select! {
                        next = self.generation.next_event() => next,
                        _ = tokio::time::sleep(self.ping_interval) => {
                            self.phase = Phase::Deltas;
                            return Some((event("ping", json!({"type": "ping"})), self));
                        }
                    };
                    match next {
                        Some(GenerationEvent::Token { text, .. }) => {
                            self.phase = Phase::Deltas;
                            if text.is_empty() {
                                continue;
                            }
                            text_delta(&text)
                        }
                        Some(GenerationEvent::Finished {
                            reason,
                            usage,
                            text,
                        }) => {
                            self.phase = Phase::BlockStop(reason, usage);
                            if text.is_empty() {
                                continue;
                            }
                            text_delta(&text)
                        }
                        Some(GenerationEvent::Failed { message }) => error_event(&message),
                        None => error_event("generation ended unexpectedly"),
                    }
                }
                Phase::BlockStop(reason, usage) => {
                    self.phase = Phase::MessageDelta(reason, usage);
                    event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": 0}),
                    )
                }
                Phase::MessageDelta(reason, usage) => {
                    self.phase = Phase::MessageStop;
                    let (stop_reason, stop_sequence) = stop_reason(&reason);
                    event(
                        "message_delta",
                        json!({"type": "message_delta",
                               "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                               "usage": {"output_tokens": usage.completion_tokens}}),
                    )
                }
                Phase::MessageStop => {
                    self.phase = Phase::End;
                    event("message_stop", json!({"type": "message_stop"}))
                }
                Phase::End => return None,
            };
            return Some((event, self));
        }
    }
}

fn error_event(message: &str) -> Event {
    event(
        "error",
        ApiError::new(FLAVOR, ErrorKind::Internal, message).body(),
    )
}
