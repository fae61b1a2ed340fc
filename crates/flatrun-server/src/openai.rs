//! The OpenAI-compatible endpoints: `POST /v1/chat/completions`,
//! `POST /v1/completions`, `POST /v1/embeddings`, `GET /v1/models`.
//!
//! Chat requests take tools (rendered through the model's chat template,
//! calls parsed in the model's own syntax), `response_format` and the
//! `regex` / `grammar` extensions (grammar-constrained sampling), logprobs,
//! every sampling field and `n` choices, streamed or not.

use std::collections::HashSet;
use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::api_error::{ApiError, ApiFlavor, ErrorKind};
use crate::engine::{Engine, GenerationRequest, GenerationStream, Usage};
use crate::grammar::GrammarSpec;
use crate::output::{Collected, GenerationItem, OutputEvent, OutputParser, parse_answer};
use crate::overflow;
use crate::prefix_cache::common_prefix;
use crate::request_body::{RawBody, parse_json};
use crate::request_fields::{
    ExtraSampling, RequestSettings, check_stop, compile, response_format_grammar,
};
use crate::state::{AppState, random_id, unix_time};
use crate::tool_defs::{ToolChoice, ToolDef, ToolSet, check_name, check_schema};
use flatrun_model::chat_template::ChatMessage;
use flatrun_model::chat_template::tools::ParsedToolCall;
use flatrun_model::sampling::{FinishReason, TokenLogprobs};

const FLAVOR: ApiFlavor = ApiFlavor::OpenAi;

/// The most choices one request may ask for.
const MAX_N: u64 = 64;

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

/// A function call of an assistant message.
#[derive(Debug, Deserialize)]
pub struct RequestFunctionCall {
    pub name: String,
    /// JSON text, as the API sends it.
    #[serde(default)]
    pub arguments: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct RequestToolCall {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    pub function: RequestFunctionCall,
}

#[derive(Debug, Deserialize)]
pub struct RequestMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
    #[serde(default)]
    pub tool_calls: Option<Vec<RequestToolCall>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

/// The fields of `POST /v1/chat/completions` that Flatrun reads; fields
/// it cannot honour (audio, predictions, web search) are refused.
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
    #[serde(flatten)]
    pub extra: ExtraSampling,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u64>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub response_format: Option<Value>,
    /// Extension: a Lark grammar (llguidance's dialect) the answer follows.
    #[serde(default)]
    pub grammar: Option<String>,
    /// Extension: a regular expression the answer matches.
    #[serde(default)]
    pub regex: Option<String>,
    /// Refused: no audio output.
    #[serde(default)]
    pub audio: Option<Value>,
    #[serde(default)]
    pub modalities: Option<Vec<String>>,
    /// Refused: predicted outputs.
    #[serde(default)]
    pub prediction: Option<Value>,
    /// Refused: no web search.
    #[serde(default)]
    pub web_search_options: Option<Value>,
}

/// `prompt`: a string, or a list holding exactly one string.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    One(String),
    Many(Vec<String>),
    /// Token ids, fed as they are (no BOS added).
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
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
    pub stop: Option<StopField>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub logprobs: Option<u64>,
    #[serde(flatten)]
    pub extra: ExtraSampling,
    #[serde(default)]
    pub grammar: Option<String>,
    #[serde(default)]
    pub regex: Option<String>,
    /// Refused: only one completion per prompt is returned.
    #[serde(default)]
    pub best_of: Option<u64>,
    /// Refused: no fill-in-the-middle.
    #[serde(default)]
    pub suffix: Option<String>,
}

/// OpenAI's `finish_reason`.
fn finish_reason(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::Length | FinishReason::Context => "length",
        FinishReason::Eos | FinishReason::Stop(_) => "stop",
    }
}

fn usage_json(usage: Usage) -> Value {
    usage.openai_json()
}

fn check_n(n: Option<u64>) -> Result<usize, ApiError> {
    match n.unwrap_or(1) {
        n @ 1..=MAX_N => Ok(n as usize),
        n => Err(ApiError::invalid(
            FLAVOR,
            format!("n must be between 1 and {MAX_N}, got {n}"),
        )),
    }
}

fn unsupported(field: &str, why: &str) -> ApiError {
    ApiError::invalid(FLAVOR, format!("{field} is not supported: {why}"))
        .with_code("unsupported_parameter")
}

/// The tools and `tool_choice` of a chat request.
fn tool_set(
    tools: Option<Vec<Value>>,
    choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<ToolSet, ApiError> {
    let mut defs = Vec::new();
    for (i, tool) in tools.unwrap_or_default().into_iter().enumerate() {
        let at = format!("tools[{i}]");
        let kind = tool.get("type").and_then(Value::as_str).unwrap_or("");
        if kind != "function" {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("{at}.type must be `function`, got `{kind}`"),
            ));
        }
        let Some(function) = tool.get("function").and_then(Value::as_object) else {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("{at}.function is required"),
            ));
        };
        let Some(name) = function.get("name").and_then(Value::as_str) else {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("{at}.function.name is required"),
            ));
        };
        check_name(FLAVOR, name, &format!("{at}.function.name"))?;
        let parameters = function
            .get("parameters")
            .cloned()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        check_schema(FLAVOR, &parameters, &format!("{at}.function.parameters"))?;
        let description = match function.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(other) => {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!("{at}.function.description must be a string, got {other}"),
                ));
            }
        };
        defs.push(ToolDef {
            name: name.to_string(),
            description,
            parameters,
        });
    }
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!(
                        "tool_choice `{other}` is not one of none, auto, required or a named function"
                    ),
                ));
            }
        },
        Some(object) => {
            let name = object
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (object.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(name)) => ToolChoice::Named(name.to_string()),
                _ => {
                    return Err(ApiError::invalid(
                        FLAVOR,
                        format!(
                            "tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": …}}}}, got {object}"
                        ),
                    ));
                }
            }
        }
    };
    ToolSet::new(FLAVOR, defs, choice, parallel.unwrap_or(true))
}

/// Text of a message's content (text parts only).
fn content_text(content: Option<MessageContent>, i: usize) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(MessageContent::Text(text)) => Ok(text),
        Some(MessageContent::Parts(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.into_iter().enumerate() {
                match (part.kind.as_str(), part.text) {
                    ("text", Some(t)) => text.push_str(&t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            FLAVOR,
                            format!("messages[{i}].content[{j}]: only text parts are supported, got `{kind}`"),
                        )
                        .with_code("unsupported_content"));
                    }
                }
            }
            Ok(text)
        }
    }
}

/// OpenAI messages as chat-template turns, tool calls and results included.
fn chat_messages(messages: Vec<RequestMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(FLAVOR, "messages must not be empty"));
    }
    let mut call_ids: HashSet<String> = HashSet::new();
    let mut turns = Vec::with_capacity(messages.len());
    for (i, message) in messages.into_iter().enumerate() {
        let role = match message.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            other => {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!(
                        "messages[{i}].role `{other}` is not supported (system, developer, user, assistant, tool)"
                    ),
                ));
            }
        };
        let mut turn = ChatMessage::new(role, content_text(message.content, i)?);
        if let Some(calls) = message.tool_calls.filter(|c| !c.is_empty()) {
            if role != "assistant" {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!("messages[{i}]: only assistant messages have tool_calls"),
                ));
            }
            let mut rendered = Vec::with_capacity(calls.len());
            for (j, call) in calls.into_iter().enumerate() {
                if call.kind.as_deref().is_some_and(|k| k != "function") {
                    return Err(ApiError::invalid(
                        FLAVOR,
                        format!("messages[{i}].tool_calls[{j}].type must be `function`"),
                    ));
                }
                let text = call.function.arguments.unwrap_or_else(|| "{}".into());
                let arguments: Value = serde_json::from_str(&text).map_err(|e| {
                    ApiError::invalid(
                        FLAVOR,
                        format!("messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}"),
                    )
                })?;
                let id = call.id.unwrap_or_else(|| format!("call_{i}_{j}"));
                call_ids.insert(id.clone());
                rendered.push(json!({
                    "id": id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments},
                }));
            }
            turn.tool_calls = Some(Value::Array(rendered));
        }
        if role == "tool" {
            let Some(id) = message.tool_call_id else {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!("messages[{i}]: a tool message needs tool_call_id"),
                ));
            };
            if !call_ids.contains(&id) {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!(
                        "messages[{i}]: tool_call_id `{id}` does not answer any tool call of an earlier assistant message"
                    ),
                ));
            }
            turn.tool_call_id = Some(id);
            turn.name = message.name;
        }
        turns.push(turn);
    }
    Ok(turns)
}

/// At most one of the grammar sources.
fn one_grammar(
    sources: [(&str, Option<GrammarSpec>); 3],
) -> Result<Option<(String, GrammarSpec)>, ApiError> {
    let mut given = sources
        .into_iter()
        .filter_map(|(field, spec)| spec.map(|s| (field.to_string(), s)));
    let first = given.next();
    if let Some((other, _)) = given.next() {
        return Err(ApiError::invalid(
            FLAVOR,
            format!(
                "{} and {other} cannot be used together",
                first.as_ref().map_or("", |f| f.0.as_str())
            ),
        ));
    }
    Ok(first)
}

/// The log-probability fields of one token, OpenAI's chat shape.
fn logprob_entry(engine: &dyn Engine, lp: &TokenLogprobs) -> Value {
    let vocabulary = engine.vocabulary();
    let token = |id: u32| {
        let bytes = match &vocabulary {
            Some(v) => {
                let piece = v.tokens.get(id as usize).map(Vec::as_slice).unwrap_or(&[]);
                piece
                    .strip_prefix(&[flatrun_model::sampling::Vocabulary::SPECIAL])
                    .unwrap_or(piece)
                    .to_vec()
            }
            None => engine.detokenize(&[id]).unwrap_or_default().into_bytes(),
        };
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    };
    let (text, bytes) = token(lp.token);
    let top: Vec<Value> = lp
        .top
        .iter()
        .map(|&(id, logprob)| {
            let (text, bytes) = token(id);
            json!({"token": text, "logprob": finite(logprob), "bytes": bytes})
        })
        .collect();
    json!({"token": text, "logprob": finite(lp.logprob), "bytes": bytes, "top_logprobs": top})
}

/// JSON has no infinity: impossible tokens get OpenAI's floor of -9999.
fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    }
}

/// One tool call in a response.
fn tool_call_json(call: &ParsedToolCall) -> Value {
    json!({
        "id": format!("call_{}", random_id()),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    })
}

/// What every choice of a request shares.
#[derive(Clone)]
struct ChoiceSettings {
    chat: bool,
    /// Split `<think>` reasoning into `reasoning_content`.
    reasoning: bool,
    tools: Option<flatrun_model::chat_template::tools::ToolSyntax>,
    parallel: bool,
    logprobs: bool,
    /// Completions: the prompt to put before the answer.
    echo: Option<Echo>,
}

/// Completions' `echo`: the prompt's text, and with `logprobs` its tokens'
/// log-probabilities (the legacy object, the first token's `null`).
#[derive(Clone)]
struct Echo {
    text: String,
    logprobs: Option<Value>,
}

/// Submits `n` generations of one prompt (seeds `seed`, `seed + 1`, …).
fn submit_n(
    state: &AppState,
    engine: &dyn Engine,
    request: GenerationRequest,
    max_tokens: Option<u64>,
    n: usize,
) -> Result<Vec<GenerationStream>, ApiError> {
    (0..n)
        .map(|i| {
            let mut request = request.clone();
            if let Some(seed) = request.sampling.seed {
                request.sampling.seed = Some(seed.wrapping_add(i as u64));
            }
            state.submit_request(FLAVOR, engine, request, max_tokens)
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
    let request: ChatCompletionRequest = parse_json(FLAVOR, body)?;
    let (engine, model) = state.route(FLAVOR, request.model.as_deref()).await?;
    let n = check_n(request.n)?;
    if request.audio.is_some() {
        return Err(unsupported("audio", "this server generates text only"));
    }
    if let Some(modalities) = &request.modalities
        && modalities.iter().any(|m| m != "text")
    {
        return Err(unsupported("modalities", "only `text` is available"));
    }
    if request.prediction.is_some() {
        return Err(unsupported(
            "prediction",
            "predicted outputs are not implemented",
        ));
    }
    if request.web_search_options.is_some() {
        return Err(unsupported(
            "web_search_options",
            "this server has no web search",
        ));
    }
    let top_logprobs = match (request.logprobs.unwrap_or(false), request.top_logprobs) {
        (_, Some(k)) if k > 20 => {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("top_logprobs must be between 0 and 20, got {k}"),
            ));
        }
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                FLAVOR,
                "top_logprobs requires logprobs to be true",
            ));
        }
        (true, k) => Some(k.unwrap_or(0) as usize),
        (false, None) => None,
    };
    let tools = tool_set(
        request.tools,
        request.tool_choice,
        request.parallel_tool_calls,
    )?;
    let syntax = engine.tool_syntax();
    if tools.active() && syntax.is_none() {
        return Err(ApiError::invalid(
            FLAVOR,
            "tools are not supported by this model: its chat template has no tool-call syntax",
        ));
    }
    let messages = chat_messages(request.messages)?;
    let max_tokens = request.max_completion_tokens.or(request.max_tokens);
    // OpenAI's own API answers a final assistant message with a new turn;
    // `continue_final_message` (as vLLM) continues it instead.
    let prompt = overflow::chat_prompt(
        engine.as_ref(),
        state.config.context_overflow,
        &messages,
        tools.template_value().as_ref(),
        request.continue_final_message.unwrap_or(false),
        overflow::prompt_room(engine.context_length(), max_tokens),
    )
    .map_err(|e| ApiError::from_engine(FLAVOR, e))?;
    // The grammar: a forced call, else the response format, else the extensions.
    let forced_grammar = tools.forced_grammar(syntax);
    let format_grammar = match &request.response_format {
        Some(format) => response_format_grammar(FLAVOR, format)?,
        None => None,
    };
    let grammar = one_grammar([
        ("tool_choice", forced_grammar),
        ("response_format", format_grammar),
        ("regex", request.regex.map(GrammarSpec::Regex)),
    ])?;
    let grammar = match (grammar, request.grammar) {
        (Some((field, _)), Some(_)) => {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("{field} and grammar cannot be used together"),
            ));
        }
        (None, Some(lark)) => Some(("grammar".to_string(), GrammarSpec::Lark(lark))),
        (g, None) => g,
    };
    let constraint = match &grammar {
        Some((field, spec)) => Some(compile(FLAVOR, engine.as_ref(), spec, field)?),
        None => None,
    };
    let RequestSettings {
        sampling,
        cache_prompt,
        draft_max,
    } = request.extra.resolve(FLAVOR, &state, engine.as_ref())?;
    let stop = request.stop.map(StopField::into_vec).unwrap_or_default();
    check_stop(FLAVOR, &stop, "stop")?;
    let generation = GenerationRequest {
        prompt: prompt.tokens,
        keep: prompt.keep,
        sampling,
        stop,
        logprobs: top_logprobs,
        constraint,
        cache_prompt,
        draft_max,
        ..GenerationRequest::default()
    };
    let streams = submit_n(&state, engine.as_ref(), generation, max_tokens, n)?;
    let settings = ChoiceSettings {
        chat: true,
        reasoning: true,
        tools: syntax.filter(|_| tools.active()),
        parallel: tools.parallel,
        logprobs: top_logprobs.is_some(),
        echo: None,
    };
    let meta = ChunkMeta {
        id: format!("chatcmpl-{}", random_id()),
        created: unix_time(),
        model,
    };
    if request.stream.unwrap_or(false) {
        let include_usage = request.stream_options.is_some_and(|o| o.include_usage);
        return Ok(sse(
            engine,
            streams,
            settings,
            meta,
            include_usage,
            state.config.ping_interval,
        ));
    }
    respond(engine.as_ref(), streams, &settings, meta).await
}

/// The non-streamed response of either endpoint.
async fn respond(
    engine: &dyn Engine,
    streams: Vec<GenerationStream>,
    settings: &ChoiceSettings,
    meta: ChunkMeta,
) -> Result<Response, ApiError> {
    let results = futures::future::join_all(streams.into_iter().map(Collected::from_stream)).await;
    let mut choices = Vec::with_capacity(results.len());
    let mut usage = None;
    for (index, result) in results.into_iter().enumerate() {
        let collected = result.map_err(internal)?;
        Usage::add_choice(&mut usage, collected.usage);
        choices.push(choice_json(engine, settings, index, &collected));
    }
    Ok(Json(json!({
        "id": meta.id,
        "object": if settings.chat { "chat.completion" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage_json(usage.unwrap_or_default()),
    }))
    .into_response())
}

/// One whole choice.
fn choice_json(
    engine: &dyn Engine,
    settings: &ChoiceSettings,
    index: usize,
    c: &Collected,
) -> Value {
    if !settings.chat {
        let echo = settings.echo.as_ref();
        let mut text = echo.map(|e| e.text.clone()).unwrap_or_default();
        let offset = text.len();
        text.push_str(&c.text);
        let logprobs = settings.logprobs.then(|| {
            let (answer, _) = legacy_logprobs(engine, &c.logprobs, offset);
            match echo.and_then(|e| e.logprobs.clone()) {
                Some(prompt) => join_legacy_logprobs(prompt, answer),
                None => answer,
            }
        });
        return json!({
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(&c.reason),
        });
    }
    let mut answer = parse_answer(&c.text, settings.reasoning, settings.tools);
    if !settings.parallel {
        answer.tool_calls.truncate(1);
    }
    let mut message = json!({"role": "assistant", "content": answer.content});
    if let Some(reasoning) = answer.reasoning {
        message["reasoning_content"] = json!(reasoning);
    }
    let finish = if answer.tool_calls.is_empty() {
        finish_reason(&c.reason)
    } else {
        if answer.content.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = answer.tool_calls.iter().map(tool_call_json).collect();
        "tool_calls"
    };
    let logprobs = settings.logprobs.then(|| {
        json!({"content": c.logprobs.iter().map(|lp| logprob_entry(engine, lp)).collect::<Vec<_>>()})
    });
    json!({
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish,
    })
}

/// The completions endpoint's `logprobs` object for `tokens` whose text
/// starts at byte `offset`, and the offset after them. Special tokens (a
/// BOS the tokenizer added, an end token) take no room in the text.
fn legacy_logprobs(
    engine: &dyn Engine,
    tokens: &[TokenLogprobs],
    mut offset: usize,
) -> (Value, usize) {
    let vocabulary = engine.vocabulary();
    let special = |id: u32| {
        vocabulary
            .as_ref()
            .and_then(|v| v.tokens.get(id as usize))
            .is_some_and(|piece| {
                piece.first() == Some(&flatrun_model::sampling::Vocabulary::SPECIAL)
            })
    };
    let mut texts = Vec::new();
    let mut logprobs = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for lp in tokens {
        let entry = logprob_entry(engine, lp);
        let text = entry["token"].as_str().unwrap_or_default().to_string();
        offsets.push(offset);
        if !special(lp.token) {
            offset += text.len();
        }
        let mut top = Map::new();
        for alt in entry["top_logprobs"].as_array().into_iter().flatten() {
            top.insert(
                alt["token"].as_str().unwrap_or_default().to_string(),
                alt["logprob"].clone(),
            );
        }
        texts.push(text);
        logprobs.push(entry["logprob"].clone());
        tops.push(Value::Object(top));
    }
    let value = json!({"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets});
    (value, offset)
}

/// The legacy `logprobs` object of a prompt: every token, the first with
/// `null` (no context scores it), the rest from `scored`.
fn prompt_logprobs(engine: &dyn Engine, prompt: &[u32], scored: &[TokenLogprobs]) -> Value {
    let first = prompt.first().map(|&token| TokenLogprobs {
        token,
        logprob: 0.0,
        top: Vec::new(),
    });
    let all: Vec<TokenLogprobs> = first.into_iter().chain(scored.iter().cloned()).collect();
    let (mut value, _) = legacy_logprobs(engine, &all, 0);
    if !all.is_empty() {
        value["token_logprobs"][0] = Value::Null;
        value["top_logprobs"][0] = Value::Null;
    }
    value
}

/// `prompt`'s legacy logprobs arrays followed by `answer`'s.
fn join_legacy_logprobs(mut prompt: Value, answer: Value) -> Value {
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(head), Some(tail)) = (prompt[key].as_array_mut(), answer[key].as_array()) {
            head.extend(tail.iter().cloned());
        }
    }
    prompt
}

/// `POST /v1/completions`.
pub async fn completions(State(state): State<AppState>, body: RawBody) -> Response {
    match completions_inner(state, body).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn completions_inner(state: AppState, body: RawBody) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse_json(FLAVOR, body)?;
    let (engine, model) = state.route(FLAVOR, request.model.as_deref()).await?;
    let n = check_n(request.n)?;
    if request.best_of.is_some_and(|b| b as usize != n) {
        return Err(unsupported("best_of", "each choice is returned (use n)"));
    }
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported(
            "suffix",
            "fill-in-the-middle is not implemented",
        ));
    }
    let logprobs = match request.logprobs {
        Some(k) if k > 5 => {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("logprobs must be between 0 and 5, got {k}"),
            ));
        }
        k => k.map(|k| k as usize),
    };
    let echo = request.echo.unwrap_or(false);
    let one_prompt = |count: usize| {
        ApiError::invalid(
            FLAVOR,
            format!("prompt must be one string or one list of token ids, got a list of {count}"),
        )
    };
    let tokens = match request.prompt {
        PromptField::One(text) => Err(text),
        PromptField::Many(mut texts) if texts.len() == 1 => Err(texts.remove(0)),
        PromptField::Many(texts) => return Err(one_prompt(texts.len())),
        PromptField::Tokens(tokens) => Ok(tokens),
        PromptField::TokenLists(mut lists) if lists.len() == 1 => Ok(lists.remove(0)),
        PromptField::TokenLists(lists) => return Err(one_prompt(lists.len())),
    };
    let (prompt_text, prompt) = match tokens {
        Err(text) => {
            let tokens = engine
                .tokenize(&text, true)
                .map_err(|e| ApiError::from_engine(FLAVOR, e))?;
            (text, tokens)
        }
        Ok(tokens) => {
            if let Some(vocab) = engine.vocab_size()
                && let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab)
            {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!("prompt: token id {bad} is outside the vocabulary of {vocab} tokens"),
                ));
            }
            let text = engine
                .detokenize(&tokens)
                .map_err(|e| ApiError::from_engine(FLAVOR, e))?;
            (text, tokens)
        }
    };
    let grammar = one_grammar([
        ("regex", request.regex.map(GrammarSpec::Regex)),
        ("grammar", request.grammar.map(GrammarSpec::Lark)),
        ("", None),
    ])?;
    let constraint = match &grammar {
        Some((field, spec)) => Some(compile(FLAVOR, engine.as_ref(), spec, field)?),
        None => None,
    };
    let RequestSettings {
        sampling,
        cache_prompt,
        draft_max,
    } = request.extra.resolve(FLAVOR, &state, engine.as_ref())?;
    let stop = request.stop.map(StopField::into_vec).unwrap_or_default();
    check_stop(FLAVOR, &stop, "stop")?;
    // OpenAI's legacy default is 16 tokens.
    let max_tokens = request.max_tokens.unwrap_or(16);
    // With echo, the prompt's own log-probabilities (evaluation harnesses
    // score texts this way, with max_tokens 0).
    let echo = if echo {
        let scored = match logprobs {
            Some(top) => {
                let scored = engine
                    .score(prompt.clone(), top)
                    .map_err(|e| ApiError::from_engine(FLAVOR, e))?
                    .await
                    .map_err(|_| internal("the engine dropped the prompt's scores".into()))?
                    .map_err(|e| ApiError::from_engine(FLAVOR, e))?;
                Some(prompt_logprobs(engine.as_ref(), &prompt, &scored))
            }
            None => None,
        };
        Some(Echo {
            text: prompt_text,
            logprobs: scored,
        })
    } else {
        None
    };
    if max_tokens == 0 {
        let Some(echo) = echo else {
            return Err(ApiError::invalid(
                FLAVOR,
                "max_tokens must be at least 1 (0 only with echo)",
            ));
        };
        let stream = request.stream.unwrap_or(false).then(|| {
            request
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage)
        });
        return Ok(echo_only(&echo, n, &model, prompt.len(), stream));
    }
    let max_tokens = Some(max_tokens);
    // What overflow handling keeps: the BOS, where the model has one.
    let keep = engine
        .tokenize("", true)
        .map_or(0, |bos| common_prefix(&bos, &prompt));
    let generation = GenerationRequest {
        prompt,
        keep,
        cache_prompt,
        sampling,
        stop,
        logprobs,
        constraint,
        draft_max,
        ..GenerationRequest::default()
    };
    let streams = submit_n(&state, engine.as_ref(), generation, max_tokens, n)?;
    let settings = ChoiceSettings {
        chat: false,
        reasoning: false,
        tools: None,
        parallel: false,
        logprobs: logprobs.is_some(),
        echo,
    };
    let meta = ChunkMeta {
        id: format!("cmpl-{}", random_id()),
        created: unix_time(),
        model,
    };
    if request.stream.unwrap_or(false) {
        let include_usage = request.stream_options.is_some_and(|o| o.include_usage);
        return Ok(sse(
            engine,
            streams,
            settings,
            meta,
            include_usage,
            state.config.ping_interval,
        ));
    }
    respond(engine.as_ref(), streams, &settings, meta).await
}

/// The answer to a completions request with `echo` and `max_tokens` 0:
/// the prompt alone in every choice, nothing generated; `stream` is
/// `Some(include_usage)` for an SSE answer.
fn echo_only(
    echo: &Echo,
    n: usize,
    model: &str,
    prompt_tokens: usize,
    stream: Option<bool>,
) -> Response {
    let choice = |index: usize| {
        json!({
            "index": index,
            "text": echo.text,
            "logprobs": echo.logprobs,
            "finish_reason": "length",
        })
    };
    let usage = usage_json(Usage {
        prompt_tokens,
        ..Usage::default()
    });
    let envelope = json!({
        "id": format!("cmpl-{}", random_id()),
        "object": "text_completion",
        "created": unix_time(),
        "model": model,
    });
    let with = |choices: Vec<Value>, usage: Option<&Value>| {
        let mut body = envelope.clone();
        body["choices"] = json!(choices);
        if let Some(usage) = usage {
            body["usage"] = usage.clone();
        }
        body
    };
    let Some(include_usage) = stream else {
        return Json(with((0..n).map(choice).collect(), Some(&usage))).into_response();
    };
    let mut events: Vec<String> = (0..n)
        .map(|i| with(vec![choice(i)], include_usage.then_some(&Value::Null)).to_string())
        .collect();
    if include_usage {
        events.push(with(Vec::new(), Some(&usage)).to_string());
    }
    events.push("[DONE]".to_string());
    let events = stream::iter(events).map(|data| Event::default().data(data));
    Sse::new(ok_events(events)).into_response()
}

fn internal(message: String) -> ApiError {
    ApiError::new(FLAVOR, ErrorKind::Internal, message)
}

/// `GET /v1/models`: every served model, with whether it is in memory
/// (`status.value`: `loaded` or `unloaded`, as llama-server's router lists
/// its models) and with which residency.
pub async fn list_models(State(state): State<AppState>) -> Response {
    match state.served_names(FLAVOR) {
        Ok(names) => {
            let status = state.models.status();
            let data: Vec<Value> = names
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    let mut object = model_object(name);
                    if let Some(s) = status.get(i) {
                        let mut value =
                            json!({"value": if s.loaded { "loaded" } else { "unloaded" }});
                        if let Some(residency) = &s.residency {
                            value["residency"] = json!(residency);
                            value["memory_bytes"] = json!(s.memory_bytes);
                        }
                        object["status"] = value;
                    }
                    object
                })
                .collect();
            Json(json!({"object": "list", "data": data})).into_response()
        }
        Err(error) => error.into_response(),
    }
}

/// `GET /v1/models/{id}` (does not load the model).
pub async fn get_model(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    match state.served_names(FLAVOR) {
        Ok(names) if names.contains(&id) => Json(model_object(&id)).into_response(),
        Ok(_) => state.not_found(FLAVOR, &id).into_response(),
        Err(error) => error.into_response(),
    }
}

fn model_object(name: &str) -> Value {
    json!({"id": name, "object": "model", "created": 0, "owned_by": "flatrun"})
}

/// What every chunk of one stream repeats.
#[derive(Clone)]
struct ChunkMeta {
    id: String,
    created: u64,
    model: String,
}

/// What one choice's stream yields.
enum ChoiceItem {
    /// A choice object (`delta` or `text`) for one chunk.
    Choice(Value),
    /// The choice ended normally with this usage.
    Done(Usage),
    /// The choice failed.
    Error(String),
}

/// The chunks of one choice, as its generation produces tokens.
struct ChoiceStream {
    index: usize,
    engine: std::sync::Arc<dyn Engine>,
    generation: GenerationStream,
    settings: ChoiceSettings,
    parser: Option<OutputParser>,
    /// Chat: the role chunk is next.
    role_pending: bool,
    /// Log-probabilities of tokens whose text is not released yet.
    pending_logprobs: Vec<TokenLogprobs>,
    /// Completions: bytes of text sent so far (for `text_offset`).
    offset: usize,
    calls: usize,
    finished: bool,
}

impl ChoiceStream {
    fn new(
        index: usize,
        engine: std::sync::Arc<dyn Engine>,
        generation: GenerationStream,
        settings: ChoiceSettings,
    ) -> ChoiceStream {
        let parser = settings
            .chat
            .then(|| OutputParser::new(settings.reasoning, settings.tools));
        ChoiceStream {
            index,
            engine,
            generation,
            parser,
            role_pending: settings.chat,
            offset: settings.echo.as_ref().map_or(0, |e| e.text.len()),
            settings,
            pending_logprobs: Vec::new(),
            calls: 0,
            finished: false,
        }
    }

    /// The logprobs of a chunk, taking the pending ones.
    fn take_logprobs(&mut self) -> Value {
        if !self.settings.logprobs {
            return Value::Null;
        }
        let tokens = std::mem::take(&mut self.pending_logprobs);
        if self.settings.chat {
            let entries: Vec<Value> = tokens
                .iter()
                .map(|lp| logprob_entry(self.engine.as_ref(), lp))
                .collect();
            json!({"content": entries})
        } else {
            let (value, offset) = legacy_logprobs(self.engine.as_ref(), &tokens, self.offset);
            self.offset = offset;
            value
        }
    }

    fn chat_chunk(&mut self, delta: Value, finish: Option<&str>) -> Value {
        let logprobs = if finish.is_none() || !self.pending_logprobs.is_empty() {
            self.take_logprobs()
        } else {
            Value::Null
        };
        json!({"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
    }

    fn text_chunk(&mut self, text: &str, finish: Option<&str>) -> Value {
        let logprobs = self.take_logprobs();
        json!({"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish})
    }

    /// Chunks for parsed output events.
    fn chat_events(&mut self, events: Vec<OutputEvent>, items: &mut Vec<ChoiceItem>) {
        for event in events {
            match event {
                OutputEvent::Content(text) if text.is_empty() => {}
                OutputEvent::Content(text) => {
                    let chunk = self.chat_chunk(json!({"content": text}), None);
                    items.push(ChoiceItem::Choice(chunk));
                }
                OutputEvent::Reasoning(text) => {
                    let chunk = self.chat_chunk(json!({"reasoning_content": text}), None);
                    items.push(ChoiceItem::Choice(chunk));
                }
                OutputEvent::ToolCall(call) => {
                    if !self.settings.parallel && self.calls > 0 {
                        continue;
                    }
                    let index = self.calls;
                    self.calls += 1;
                    // As OpenAI streams a call: id, type and name with empty
                    // arguments first, then the arguments.
                    let head = json!({"tool_calls": [{
                        "index": index,
                        "id": format!("call_{}", random_id()),
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }]});
                    let chunk = self.chat_chunk(head, None);
                    items.push(ChoiceItem::Choice(chunk));
                    let args = json!({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]});
                    let chunk = self.chat_chunk(args, None);
                    items.push(ChoiceItem::Choice(chunk));
                }
            }
        }
    }

    /// The next chunks; `None` once the choice is over.
    async fn next(mut self) -> Option<(Vec<ChoiceItem>, Self)> {
        if self.finished {
            return None;
        }
        let mut items = Vec::new();
        if self.role_pending {
            self.role_pending = false;
            let chunk = self.chat_chunk(json!({"role": "assistant", "content": ""}), None);
            items.push(ChoiceItem::Choice(chunk));
            return Some((items, self));
        }
        if let Some(echo) = self.settings.echo.take() {
            items.push(ChoiceItem::Choice(json!({
                "index": self.index,
                "text": echo.text,
                "logprobs": echo.logprobs,
                "finish_reason": null,
            })));
            return Some((items, self));
        }
        match GenerationItem::next(&mut self.generation).await {
            GenerationItem::Token { text, logprobs } => {
                self.pending_logprobs.extend(logprobs);
                if self.settings.chat {
                    let events = self
                        .parser
                        .as_mut()
                        .map(|p| p.push(&text))
                        .unwrap_or_default();
                    self.chat_events(events, &mut items);
                } else if !text.is_empty() {
                    let chunk = self.text_chunk(&text, None);
                    items.push(ChoiceItem::Choice(chunk));
                }
            }
            GenerationItem::Finished {
                text,
                reason,
                usage,
            } => {
                self.finished = true;
                if self.settings.chat {
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
                    self.chat_events(events, &mut items);
                    let finish = if self.calls > 0 {
                        "tool_calls"
                    } else {
                        finish_reason(&reason)
                    };
                    let chunk = self.chat_chunk(json!({}), Some(finish));
                    items.push(ChoiceItem::Choice(chunk));
                } else {
                    if !text.is_empty() {
                        let chunk = self.text_chunk(&text, None);
                        items.push(ChoiceItem::Choice(chunk));
                    }
                    let chunk = self.text_chunk("", Some(finish_reason(&reason)));
                    items.push(ChoiceItem::Choice(chunk));
                }
                items.push(ChoiceItem::Done(usage));
            }
            GenerationItem::Failed(message) => {
                self.finished = true;
                items.push(ChoiceItem::Error(message));
            }
        }
        Some((items, self))
    }
}

/// The SSE response of `n` choices. While no chunk comes (waiting in the
/// queue, a long prefill) an SSE comment line every `keep_alive` keeps the
/// connection alive and lets the server notice a client that went away.
fn sse(
    engine: std::sync::Arc<dyn Engine>,
    streams: Vec<GenerationStream>,
    settings: ChoiceSettings,
    meta: ChunkMeta,
    include_usage: bool,
    keep_alive: Duration,
) -> Response {
    let chat = settings.chat;
    let n = streams.len();
    let choices = stream::select_all(streams.into_iter().enumerate().map(|(index, generation)| {
        let choice = ChoiceStream::new(index, engine.clone(), generation, settings.clone());
        stream::unfold(choice, ChoiceStream::next)
            .flat_map(stream::iter)
            .boxed()
    }));
    let envelope = move |choices: Vec<Value>, usage: Option<Usage>| {
        let mut chunk = json!({
            "id": meta.id,
            "object": if chat { "chat.completion.chunk" } else { "text_completion" },
            "created": meta.created,
            "model": meta.model,
            "choices": choices,
        });
        if include_usage {
            chunk["usage"] = usage.map_or(Value::Null, usage_json);
        }
        chunk.to_string()
    };
    // Every choice's chunks as they come; after the last choice ends, the
    // usage chunk (with `include_usage`) and `[DONE]`.
    let mut done = 0;
    let mut total = None;
    let mut failed = false;
    let events = choices
        .map(move |item| match item {
            ChoiceItem::Choice(choice) => vec![envelope(vec![choice], None)],
            ChoiceItem::Done(usage) => {
                done += 1;
                Usage::add_choice(&mut total, usage);
                let mut tail = Vec::new();
                if done == n {
                    if include_usage {
                        tail.push(envelope(Vec::new(), total));
                    }
                    tail.push("[DONE]".to_string());
                }
                tail
            }
            ChoiceItem::Error(message) if !failed => {
                failed = true;
                vec![
                    ApiError::new(FLAVOR, ErrorKind::Internal, message)
                        .body()
                        .to_string(),
                    "[DONE]".to_string(),
                ]
            }
            ChoiceItem::Error(_) => Vec::new(),
        })
        .flat_map(stream::iter)
        .map(|data| Event::default().data(data));
    Sse::new(ok_events(events))
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}

fn ok_events(
    events: impl Stream<Item = Event> + Send + 'static,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    events.map(Ok)
}

/// `input` of an embeddings request: text(s) or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// The fields of `POST /v1/embeddings`.
#[derive(Debug, Deserialize)]
pub struct EmbeddingRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub input: EmbeddingInput,
    #[serde(default)]
    pub encoding_format: Option<String>,
    /// Refused: the model's hidden size is the only one.
    #[serde(default)]
    pub dimensions: Option<u64>,
    #[serde(default)]
    pub user: Option<String>,
}

/// The most inputs one embeddings request may hold.
const MAX_EMBEDDING_INPUTS: usize = 256;

/// `POST /v1/embeddings`: the model's final-normed hidden states, pooled
/// over each input's tokens as the model's `pooling_type` says (mean when
/// it says nothing) and L2-normalized; all inputs in one batch.
pub async fn embeddings(State(state): State<AppState>, body: RawBody) -> Response {
    match embeddings_inner(state, body).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn embeddings_inner(state: AppState, body: RawBody) -> Result<Response, ApiError> {
    use base64::Engine as _;
    let request: EmbeddingRequest = parse_json(FLAVOR, body)?;
    let (engine, model) = state.route(FLAVOR, request.model.as_deref()).await?;
    if request.dimensions.is_some() {
        return Err(unsupported(
            "dimensions",
            "embeddings have the model's hidden size and cannot be shortened",
        ));
    }
    let base64 = match request.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                FLAVOR,
                format!("encoding_format must be float or base64, got `{other}`"),
            ));
        }
    };
    let inputs: Vec<Vec<u32>> = match request.input {
        EmbeddingInput::Text(text) => vec![tokenize_input(engine.as_ref(), &text)?],
        EmbeddingInput::Texts(texts) => texts
            .iter()
            .map(|t| tokenize_input(engine.as_ref(), t))
            .collect::<Result<_, _>>()?,
        EmbeddingInput::Tokens(tokens) => vec![tokens],
        EmbeddingInput::TokenLists(lists) => lists,
    };
    if inputs.is_empty() || inputs.len() > MAX_EMBEDDING_INPUTS {
        return Err(ApiError::invalid(
            FLAVOR,
            format!(
                "input must hold 1 to {MAX_EMBEDDING_INPUTS} items, got {}",
                inputs.len()
            ),
        ));
    }
    if let Some(vocab) = engine.vocab_size() {
        for (index, input) in inputs.iter().enumerate() {
            if let Some(&bad) = input.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::invalid(
                    FLAVOR,
                    format!(
                        "input[{index}]: token id {bad} is outside the vocabulary of {vocab} tokens"
                    ),
                ));
            }
        }
    }
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    // Every input goes through the layers in one batch.
    let vectors = engine
        .embed(inputs)
        .map_err(|e| ApiError::from_engine(FLAVOR, e))?
        .await
        .map_err(|_| internal("the engine dropped the embeddings".into()))?
        .map_err(|e| ApiError::from_engine(FLAVOR, e))?;
    let mut data = Vec::with_capacity(vectors.len());
    for (index, vector) in vectors.into_iter().enumerate() {
        let embedding = if base64 {
            let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            json!(vector)
        };
        data.push(json!({"object": "embedding", "index": index, "embedding": embedding}));
    }
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}

fn tokenize_input(engine: &dyn Engine, text: &str) -> Result<Vec<u32>, ApiError> {
    engine
        .tokenize(text, true)
        .map_err(|e| ApiError::from_engine(FLAVOR, e))
}
