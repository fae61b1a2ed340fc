//! The Anthropic-compatible endpoints: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`.
//!
//! Messages take tools (`tool_use` / `tool_result` blocks, streamed
//! `input_json_delta`s, `stop_reason: "tool_use"`), `tool_choice` (a
//! forced call is grammar-constrained to the tool's schema), `thinking`
//! (`<think>` reasoning as `thinking` blocks) and every sampling field.

use std::collections::{HashSet, VecDeque};
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
use crate::config::ContextOverflow;
use crate::engine::{Engine, GenerationRequest, GenerationStream, Usage};
use crate::output::{Collected, GenerationItem, OutputEvent, OutputParser, parse_answer};
use crate::overflow;
use crate::request_body::{RawBody, parse_json};
use crate::request_fields::{ExtraSampling, RequestSettings, check_stop, compile};
use crate::state::{AppState, random_id};
use crate::tool_defs::{ToolChoice, ToolDef, ToolSet, check_name, check_schema};
use flatrun_model::chat_template::ChatMessage;
use flatrun_model::chat_template::tools::ParsedToolCall;
use flatrun_model::sampling::FinishReason;

const FLAVOR: ApiFlavor = ApiFlavor::Anthropic;

/// A content block: `text`, `tool_use`, `tool_result`, `thinking`.
#[derive(Debug, Deserialize)]
pub struct ContentBlock {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub input: Option<Value>,
    #[serde(default)]
    pub tool_use_id: Option<String>,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub is_error: Option<bool>,
    #[serde(default)]
    pub thinking: Option<String>,
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

/// `thinking`: `{"type": "enabled", "budget_tokens": N}` or disabled.
#[derive(Debug, Deserialize)]
pub struct ThinkingConfig {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub budget_tokens: Option<u64>,
}

/// The fields of `POST /v1/messages` that Flatrun reads.
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
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub thinking: Option<ThinkingConfig>,
    /// Accepted and ignored (`user_id`).
    #[serde(default)]
    pub metadata: Option<Value>,
    /// `temperature`, `top_p`, `top_k`, and extensions shared with the
    /// OpenAI side (`seed`, penalties, …).
    #[serde(flatten)]
    pub extra: ExtraSampling,
}

/// The fields of `POST /v1/messages/count_tokens`.
#[derive(Debug, Deserialize)]
pub struct CountTokensRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<InputMessage>,
    #[serde(default)]
    pub system: Option<Content>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
}

fn unsupported_block(location: &str, kind: &str) -> ApiError {
    ApiError::invalid(
        FLAVOR,
        format!(
            "{location}: content blocks of type `{kind}` are not supported (text, tool_use, tool_result, thinking)"
        ),
    )
}

/// The text of `system` or of a `tool_result`'s content.
fn plain_text(content: Content, location: &str) -> Result<String, ApiError> {
    match content {
        Content::Text(text) => Ok(text),
        Content::Blocks(blocks) => {
            let mut text = String::new();
            for (j, block) in blocks.into_iter().enumerate() {
                match (block.kind.as_str(), block.text) {
                    ("text", Some(t)) => text.push_str(&t),
                    (kind, _) => return Err(unsupported_block(&format!("{location}.{j}"), kind)),
                }
            }
            Ok(text)
        }
    }
}

/// The tools and `tool_choice` of a request.
fn tool_set(tools: Option<Vec<Value>>, choice: Option<Value>) -> Result<ToolSet, ApiError> {
    let mut defs = Vec::new();
    for (i, tool) in tools.unwrap_or_default().into_iter().enumerate() {
        let at = format!("tools.{i}");
        if let Some(kind) = tool.get("type").and_then(Value::as_str)
            && kind != "custom"
        {
            return Err(ApiError::invalid(
                FLAVOR,
                format!(
                    "{at}: server tools such as `{kind}` are not supported; define client tools with name and input_schema"
                ),
            ));
        }
        let Some(name) = tool.get("name").and_then(Value::as_str) else {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("{at}.name: Field required"),
            ));
        };
        check_name(FLAVOR, name, &format!("{at}.name"))?;
        let Some(schema) = tool.get("input_schema") else {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("{at}.input_schema: Field required"),
            ));
        };
        check_schema(FLAVOR, schema, &format!("{at}.input_schema"))?;
        defs.push(ToolDef {
            name: name.to_string(),
            description: tool
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_string),
            parameters: schema.clone(),
        });
    }
    let mut parallel = true;
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(choice) => {
            parallel = !choice
                .get("disable_parallel_tool_use")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            match choice.get("type").and_then(Value::as_str) {
                Some("auto") => ToolChoice::Auto,
                Some("any") => ToolChoice::Required,
                Some("none") => ToolChoice::None,
                Some("tool") => {
                    let Some(name) = choice.get("name").and_then(Value::as_str) else {
                        return Err(ApiError::invalid(
                            FLAVOR,
                            "tool_choice.name: Field required",
                        ));
                    };
                    ToolChoice::Named(name.to_string())
                }
                _ => {
                    return Err(ApiError::invalid(
                        FLAVOR,
                        format!("tool_choice.type must be auto, any, tool or none, got {choice}"),
                    ));
                }
            }
        }
    };
    ToolSet::new(FLAVOR, defs, choice, parallel)
}

/// The conversation as chat-template turns, the system prompt first;
/// `tool_result` blocks become `tool` turns.
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
        let text = plain_text(system, "system")?;
        if !text.is_empty() {
            turns.push(ChatMessage::new("system", text));
        }
    }
    let mut tool_use_ids: HashSet<String> = HashSet::new();
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
        let blocks = match message.content {
            Content::Text(text) => {
                turns.push(ChatMessage::new(role, text));
                continue;
            }
            Content::Blocks(blocks) => blocks,
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for (j, block) in blocks.into_iter().enumerate() {
            let at = format!("messages.{i}.content.{j}");
            match (block.kind.as_str(), role) {
                ("text", _) => text.push_str(block.text.as_deref().unwrap_or_default()),
                // Earlier reasoning is not shown to the model again.
                ("thinking" | "redacted_thinking", "assistant") => {}
                ("tool_use", "assistant") => {
                    let (Some(id), Some(name)) = (block.id, block.name) else {
                        return Err(ApiError::invalid(
                            FLAVOR,
                            format!("{at}: a tool_use block needs id and name"),
                        ));
                    };
                    tool_use_ids.insert(id.clone());
                    calls.push(json!({
                        "id": id,
                        "type": "function",
                        "function": {"name": name, "arguments": block.input.unwrap_or(json!({}))},
                    }));
                }
                ("tool_result", "user") => {
                    let Some(id) = block.tool_use_id else {
                        return Err(ApiError::invalid(
                            FLAVOR,
                            format!("{at}.tool_use_id: Field required"),
                        ));
                    };
                    if !tool_use_ids.contains(&id) {
                        return Err(ApiError::invalid(
                            FLAVOR,
                            format!(
                                "{at}: tool_result for `{id}` has no matching tool_use block in an earlier assistant message"
                            ),
                        ));
                    }
                    let mut result = match block.content {
                        Some(content) => plain_text(content, &format!("{at}.content"))?,
                        None => String::new(),
                    };
                    if block.is_error == Some(true) {
                        result = format!("Error: {result}");
                    }
                    let mut turn = ChatMessage::new("tool", result);
                    turn.tool_call_id = Some(id);
                    turns.push(turn);
                }
                (kind, _) => return Err(unsupported_block(&at, kind)),
            }
        }
        if !text.is_empty() || !calls.is_empty() || role == "assistant" {
            let mut turn = ChatMessage::new(role, text);
            if !calls.is_empty() {
                turn.tool_calls = Some(Value::Array(calls));
            }
            turns.push(turn);
        }
    }
    // As Anthropic's API: a prefill may not end in whitespace.
    if let Some(last) = turns.last()
        && last.role == "assistant"
        && last.tool_calls.is_none()
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

/// A call's arguments as the `input` object.
fn call_input(call: &ParsedToolCall) -> Value {
    serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}))
}

/// The prompt of a request with tools, and whether the model may see them.
fn encode(
    engine: &dyn Engine,
    turns: &[ChatMessage],
    tools: &ToolSet,
    overflow: (ContextOverflow, usize),
) -> Result<overflow::ChatPrompt, ApiError> {
    if tools.active() && engine.tool_syntax().is_none() {
        return Err(ApiError::invalid(
            FLAVOR,
            "tools: this model's chat template has no tool-call syntax",
        ));
    }
    // A final assistant message is the start of the answer (prefill).
    let (mode, room) = overflow;
    let tools = tools.template_value();
    overflow::chat_prompt(engine, mode, turns, tools.as_ref(), true, room)
        .map_err(|e| ApiError::from_engine(FLAVOR, e))
}

/// `POST /v1/messages`.
pub async fn messages(State(state): State<AppState>, body: RawBody) -> Response {
    match messages_inner(state, body).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn messages_inner(state: AppState, body: RawBody) -> Result<Response, ApiError> {
    let request: MessagesRequest = parse_json(FLAVOR, body)?;
    let Some(max_tokens) = request.max_tokens else {
        return Err(ApiError::invalid(FLAVOR, "max_tokens: Field required"));
    };
    let (engine, model) = state.route(FLAVOR, request.model.as_deref()).await?;
    let thinking = match &request.thinking {
        None => false,
        Some(t) if t.kind == "disabled" => false,
        Some(t) if t.kind == "enabled" => {
            if t.budget_tokens.is_some_and(|b| b >= max_tokens) {
                return Err(ApiError::invalid(
                    FLAVOR,
                    "thinking.budget_tokens must be less than max_tokens",
                ));
            }
            true
        }
        Some(t) => {
            return Err(ApiError::invalid(
                FLAVOR,
                format!(
                    "thinking.type must be enabled or disabled, got `{}`",
                    t.kind
                ),
            ));
        }
    };
    let tools = tool_set(request.tools, request.tool_choice)?;
    let turns = chat_messages(request.system, request.messages)?;
    let room = overflow::prompt_room(engine.context_length(), Some(max_tokens));
    let overflow = (state.config.context_overflow, room);
    let prompt = encode(engine.as_ref(), &turns, &tools, overflow)?;
    let syntax = engine.tool_syntax().filter(|_| tools.active());
    let constraint = match tools.forced_grammar(syntax) {
        Some(spec) => Some(compile(FLAVOR, engine.as_ref(), &spec, "tool_choice")?),
        None => None,
    };
    let RequestSettings {
        sampling,
        cache_prompt,
        draft_max,
    } = request.extra.resolve(FLAVOR, &state, engine.as_ref())?;
    let stop = request.stop_sequences.unwrap_or_default();
    check_stop(FLAVOR, &stop, "stop_sequences")?;
    let input_tokens = prompt.tokens.len();
    let generation = state.submit_request(
        FLAVOR,
        engine.as_ref(),
        GenerationRequest {
            prompt: prompt.tokens,
            keep: prompt.keep,
            sampling,
            stop,
            constraint,
            cache_prompt,
            draft_max,
            ..GenerationRequest::default()
        },
        Some(max_tokens),
    )?;
    let id = format!("msg_{}", random_id());
    if request.stream.unwrap_or(false) {
        let stream = MessageStream {
            generation,
            id,
            model,
            input_tokens,
            ping_interval: state.config.ping_interval,
            parser: Some(OutputParser::new(thinking, syntax)),
            parallel: tools.parallel,
            calls: 0,
            open: None,
            blocks: 0,
            queue: VecDeque::new(),
            started: false,
            finished: false,
        };
        let events = stream::unfold(stream, MessageStream::next).map(Ok::<_, Infallible>);
        return Ok(Sse::new(events).into_response());
    }
    let collected = Collected::from_stream(generation)
        .await
        .map_err(|message| ApiError::new(FLAVOR, ErrorKind::Internal, message))?;
    let mut answer = parse_answer(&collected.text, thinking, syntax);
    if !tools.parallel {
        answer.tool_calls.truncate(1);
    }
    let mut content = Vec::new();
    if let Some(reasoning) = answer.reasoning {
        content.push(json!({"type": "thinking", "thinking": reasoning, "signature": ""}));
    }
    if !answer.content.is_empty() || answer.tool_calls.is_empty() {
        content.push(json!({"type": "text", "text": answer.content}));
    }
    for call in &answer.tool_calls {
        content.push(json!({
            "type": "tool_use",
            "id": format!("toolu_{}", random_id()),
            "name": call.name,
            "input": call_input(call),
        }));
    }
    let (mut stop_reason, stop_sequence) = stop_reason(&collected.reason);
    if !answer.tool_calls.is_empty() {
        stop_reason = "tool_use";
    }
    let usage = collected.usage;
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage.anthropic_json(),
    }))
    .into_response())
}

/// `POST /v1/messages/count_tokens`.
pub async fn count_tokens(State(state): State<AppState>, body: RawBody) -> Response {
    let result = async {
        let request: CountTokensRequest = parse_json(FLAVOR, body)?;
        let (engine, _) = state.route(FLAVOR, request.model.as_deref()).await?;
        let tools = tool_set(request.tools, request.tool_choice)?;
        let turns = chat_messages(request.system, request.messages)?;
        let exact = (ContextOverflow::Error, usize::MAX);
        let prompt = encode(engine.as_ref(), &turns, &tools, exact)?;
        Ok::<_, ApiError>(json!({"input_tokens": prompt.tokens.len()}))
    }
    .await;
    match result {
        Ok(body) => Json(body).into_response(),
        Err(error) => error.into_response(),
    }
}

/// The kind of the content block being streamed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Block {
    Text,
    Thinking,
}

/// State of one `/v1/messages` SSE stream: blocks open as the answer
/// needs them (thinking, text, one per tool call).
struct MessageStream {
    generation: GenerationStream,
    id: String,
    model: String,
    input_tokens: usize,
    ping_interval: Duration,
    parser: Option<OutputParser>,
    parallel: bool,
    calls: usize,
    /// The text or thinking block open now.
    open: Option<Block>,
    /// Blocks started so far (the next block's index).
    blocks: usize,
    queue: VecDeque<Event>,
    started: bool,
    finished: bool,
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

impl MessageStream {
    fn close(&mut self) {
        if self.open.take().is_some() {
            self.queue.push_back(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.blocks - 1}),
            ));
        }
    }

    fn delta(&mut self, block: Block, text: String) {
        if self.open != Some(block) {
            self.close();
            let start = match block {
                Block::Text => json!({"type": "text", "text": ""}),
                Block::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            };
            self.queue.push_back(event(
                "content_block_start",
                json!({"type": "content_block_start", "index": self.blocks, "content_block": start}),
            ));
            self.blocks += 1;
            self.open = Some(block);
        }
        let delta = match block {
            Block::Text => json!({"type": "text_delta", "text": text}),
            Block::Thinking => json!({"type": "thinking_delta", "thinking": text}),
        };
        self.queue.push_back(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}),
        ));
    }

    fn tool_use(&mut self, call: ParsedToolCall) {
        if !self.parallel && self.calls > 0 {
            return;
        }
        self.close();
        self.calls += 1;
        let index = self.blocks;
        self.blocks += 1;
        self.queue.push_back(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": {
                "type": "tool_use", "id": format!("toolu_{}", random_id()), "name": call.name, "input": {},
            }}),
        ));
        self.queue.push_back(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "input_json_delta", "partial_json": call_input(&call).to_string()}}),
        ));
        self.queue.push_back(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
    }

    fn output(&mut self, events: Vec<OutputEvent>) {
        for e in events {
            match e {
                OutputEvent::Content(text) if text.is_empty() => {}
                OutputEvent::Content(text) => self.delta(Block::Text, text),
                OutputEvent::Reasoning(text) => self.delta(Block::Thinking, text),
                OutputEvent::ToolCall(call) => self.tool_use(call),
            }
        }
    }

    fn finish(&mut self, text: String, reason: FinishReason, usage: Usage) {
        let mut events = self
            .parser
            .as_mut()
            .map(|p| p.push(&text))
            .unwrap_or_default();
        events.extend(
            self.parser
                .take()
                .map(OutputParser::finish)
                .unwrap_or_default(),
        );
        self.output(events);
        if self.blocks == 0 {
            // At least one (empty) text block, as the API always answers.
            self.delta(Block::Text, String::new());
        }
        self.close();
        let (mut stop_reason, stop_sequence) = stop_reason(&reason);
        if self.calls > 0 {
            stop_reason = "tool_use";
        }
        self.queue.push_back(event(
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                   "usage": usage.anthropic_json()}),
        ));
        self.queue
            .push_back(event("message_stop", json!({"type": "message_stop"})));
    }

    /// The next SSE event, or `None` at the end.
    async fn next(mut self) -> Option<(Event, Self)> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                return Some((event, self));
            }
            if self.finished {
                return None;
            }
            if !self.started {
                self.started = true;
                return Some((
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
                    ),
                    self,
                ));
            }
            // Wait for output; a ping keeps the connection alive meanwhile.
            let next = tokio::select! {
                next = GenerationItem::next(&mut self.generation) => next,
                _ = tokio::time::sleep(self.ping_interval) => {
                    return Some((event("ping", json!({"type": "ping"})), self));
                }
            };
            match next {
                GenerationItem::Token { text, .. } => {
                    let events = self
                        .parser
                        .as_mut()
                        .map(|p| p.push(&text))
                        .unwrap_or_default();
                    self.output(events);
                }
                GenerationItem::Finished {
                    text,
                    reason,
                    usage,
                } => {
                    self.finished = true;
                    self.finish(text, reason, usage);
                }
                GenerationItem::Failed(message) => {
                    self.finished = true;
                    self.queue.push_back(error_event(&message));
                }
            }
        }
    }
}

fn error_event(message: &str) -> Event {
    event(
        "error",
        ApiError::new(FLAVOR, ErrorKind::Internal, message).body(),
    )
}
