//! Request fields both APIs share: the sampling extensions and penalties,
//! `logit_bias`, checks of ranges, and the grammar that constrains a
//! request (structured output, a forced tool call, `regex` / `grammar`).

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::api_error::{ApiError, ApiFlavor};
use crate::engine::{Engine, MAX_DRAFT};
use crate::grammar::{Grammar, GrammarSpec};
use crate::state::{AppState, SamplingOverrides};
use crate::tool_defs::{ToolDef, arguments_schema};
use flatrun_model::chat_template::tools::ToolSyntax;
use flatrun_model::sampling::{ConstraintFactory, SamplingParams};

/// The sampling fields of every generation request of both APIs.
/// `temperature`, `top_p` and `seed` are OpenAI's (Anthropic's without the
/// seed), as are `frequency_penalty`, `presence_penalty` and `logit_bias`;
/// `min_p`, `repeat_penalty`, `top_k` (Anthropic's own) and
/// `penalty_window` are llama-server / vLLM extensions, and so are
/// `cache_prompt` and `speculative.n_max`.
#[derive(Debug, Default, Deserialize)]
pub struct ExtraSampling {
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<u64>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub repeat_penalty: Option<f32>,
    /// How many of the latest generated tokens the penalties look at
    /// (default: all of them, as OpenAI).
    #[serde(default)]
    pub penalty_window: Option<usize>,
    #[serde(default)]
    pub logit_bias: Option<HashMap<String, f32>>,
    /// llama-server's `cache_prompt`: `false` neither reuses a cached
    /// prefix nor keeps this request's KV for later ones.
    #[serde(default)]
    pub cache_prompt: Option<bool>,
    /// llama-server's `speculative.n_max` (also `draft_max`): most tokens
    /// proposed per pass when the server speculates; 0 turns speculation
    /// off for this request.
    #[serde(default, rename = "speculative.n_max", alias = "draft_max")]
    pub draft_max: Option<usize>,
}

/// A request's settings beyond its prompt and limits.
#[derive(Debug)]
pub struct RequestSettings {
    pub sampling: SamplingParams,
    /// Reuse and keep a prompt cache.
    pub cache_prompt: bool,
    /// The request's draft length, if it set one.
    pub draft_max: Option<usize>,
}

impl ExtraSampling {
    /// The request's sampling (the server's defaults under the request's
    /// fields, checked), whether it may reuse and keep a prompt cache, and
    /// its draft length.
    pub fn resolve(
        self,
        flavor: ApiFlavor,
        state: &AppState,
        engine: &dyn Engine,
    ) -> Result<RequestSettings, ApiError> {
        let mut sampling = state.sampling(SamplingOverrides {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k.map(|k| k as usize),
            seed: self.seed,
        });
        let cache_prompt = self.cache_prompt.unwrap_or(true);
        let draft_max = self.draft_max;
        if let Some(n) = draft_max.filter(|&n| n > MAX_DRAFT) {
            return Err(ApiError::invalid(
                flavor,
                format!("speculative.n_max must be at most {MAX_DRAFT}, got {n}"),
            ));
        }
        self.apply(flavor, engine, &mut sampling)?;
        Ok(RequestSettings {
            sampling,
            cache_prompt,
            draft_max,
        })
    }

    /// Checks the fields (OpenAI's ranges) and writes them into `params`.
    pub fn apply(
        self,
        flavor: ApiFlavor,
        engine: &dyn Engine,
        params: &mut SamplingParams,
    ) -> Result<(), ApiError> {
        let invalid = |m: String| Err(ApiError::invalid(flavor, m));
        if let Some(min_p) = self.min_p {
            if !(0.0..=1.0).contains(&min_p) {
                return invalid(format!("min_p must be in [0, 1], got {min_p}"));
            }
            params.min_p = min_p;
        }
        for (name, value, target) in [
            (
                "frequency_penalty",
                self.frequency_penalty,
                &mut params.frequency_penalty,
            ),
            (
                "presence_penalty",
                self.presence_penalty,
                &mut params.presence_penalty,
            ),
        ] {
            if let Some(v) = value {
                if !(-2.0..=2.0).contains(&v) {
                    return invalid(format!("{name} must be in [-2, 2], got {v}"));
                }
                *target = v;
            }
        }
        if let Some(r) = self.repeat_penalty {
            if !(r.is_finite() && r > 0.0) {
                return invalid(format!("repeat_penalty must be > 0 (1 = off), got {r}"));
            }
            params.repeat_penalty = r;
        }
        let penalized = params.frequency_penalty != 0.0
            || params.presence_penalty != 0.0
            || params.repeat_penalty != 1.0;
        params.penalty_window = match self.penalty_window {
            Some(w) => w,
            None if penalized => usize::MAX,
            None => params.penalty_window,
        };
        if let Some(bias) = self.logit_bias {
            let vocab = engine.vocab_size();
            let mut entries = Vec::with_capacity(bias.len());
            for (key, value) in bias {
                let Ok(id) = key.parse::<u32>() else {
                    return invalid(format!("logit_bias: `{key}` is not a token id"));
                };
                if vocab.is_some_and(|v| id as usize >= v) {
                    return invalid(format!(
                        "logit_bias: token id {id} is outside the vocabulary of {} tokens",
                        vocab.unwrap_or(0)
                    ));
                }
                if !(-100.0..=100.0).contains(&value) {
                    return invalid(format!(
                        "logit_bias[{key}] must be in [-100, 100], got {value}"
                    ));
                }
                entries.push((id, value));
            }
            entries.sort_unstable_by_key(|e| e.0);
            params.logit_bias = entries;
        }
        Ok(())
    }
}

/// `stop` / `stop_sequences`: at most four, none empty.
pub fn check_stop(flavor: ApiFlavor, stop: &[String], field: &str) -> Result<(), ApiError> {
    if flavor == ApiFlavor::OpenAi && stop.len() > 4 {
        return Err(ApiError::invalid(
            flavor,
            format!("{field}: at most 4 stop sequences, got {}", stop.len()),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            flavor,
            format!("{field}: stop sequences must not be empty"),
        ));
    }
    Ok(())
}

/// A JSON string literal's Lark form.
fn lark_string(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

/// The grammar of a forced tool call: one call (or, with `parallel`, one or
/// more) of one of `tools`, in the model's syntax, with arguments valid for
/// the tool's schema.
pub fn forced_call_grammar(syntax: ToolSyntax, tools: &[&ToolDef], parallel: bool) -> GrammarSpec {
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let schema = arguments_schema(tool);
        rules.push(format!(
            "call_{i}: {} %json{} {}",
            lark_string(&syntax.call_prefix(&tool.name)),
            schema,
            lark_string(syntax.call_suffix())
        ));
        alternatives.push(format!("call_{i}"));
    }
    let call = format!("call: {}", alternatives.join(" | "));
    let start = if parallel {
        "start: call (\"\\n\" call)*"
    } else {
        "start: call"
    };
    GrammarSpec::Lark(format!("{start}\n{call}\n{}\n", rules.join("\n")))
}

/// Compiles a grammar for the engine's vocabulary; a grammar the engine
/// cannot compile is the client's 400.
pub fn compile(
    flavor: ApiFlavor,
    engine: &dyn Engine,
    spec: &GrammarSpec,
    field: &str,
) -> Result<Arc<dyn ConstraintFactory>, ApiError> {
    let vocabulary = engine.vocabulary().ok_or_else(|| {
        ApiError::invalid(
            flavor,
            format!("{field}: this model does not support grammars"),
        )
    })?;
    Grammar::compile(spec, &vocabulary)
        .map(|g| Arc::new(g) as Arc<dyn ConstraintFactory>)
        .map_err(|e| ApiError::invalid(flavor, format!("{field}: invalid grammar: {e}")))
}

/// OpenAI's `response_format`.
pub fn response_format_grammar(
    flavor: ApiFlavor,
    format: &Value,
) -> Result<Option<GrammarSpec>, ApiError> {
    let kind = format.get("type").and_then(Value::as_str).unwrap_or("");
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(GrammarSpec::JsonObject)),
        "json_schema" => {
            let Some(spec) = format.get("json_schema") else {
                return Err(ApiError::invalid(
                    flavor,
                    "response_format.json_schema is required when type is json_schema",
                ));
            };
            if spec.get("name").and_then(Value::as_str).is_none() {
                return Err(ApiError::invalid(
                    flavor,
                    "response_format.json_schema.name is required",
                ));
            }
            let schema = spec.get("schema").cloned().unwrap_or(json!({}));
            crate::tool_defs::check_schema(flavor, &schema, "response_format.json_schema.schema")?;
            Ok(Some(GrammarSpec::JsonSchema(schema)))
        }
        other => Err(ApiError::invalid(
            flavor,
            format!("response_format.type `{other}` is not one of text, json_object, json_schema"),
        )),
    }
}
