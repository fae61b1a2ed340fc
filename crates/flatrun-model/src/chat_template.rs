//! Chat templates: the model's own Jinja template rendered with `minijinja`
//! the way Hugging Face renders it (`trim_blocks`, `lstrip_blocks`, Python
//! string methods, `raise_exception`, `strftime_now`, Python-style `tojson`),
//! or a built-in template chosen by architecture when the checkpoint has none.
//!
//! Templates come from untrusted files, so rendering runs in minijinja's
//! sandbox with a fuel limit (instructions executed) and a recursion limit,
//! and the template is compiled into instrumented instructions
//! (`sandbox.rs`) that hold the output, every captured block and macro
//! output, and every string and sequence the template builds under size
//! limits while they grow (`budget.rs`, `guard.rs`), plus a limit on all the
//! bytes one render builds; a hostile template fails with
//! [`TemplateError::Limit`] instead of running forever or filling memory.
//!
//! ```
//! use flatrun_model::chat_template::{ChatMessage, ChatTemplate};
//! let template = ChatTemplate::builtin_for_arch("qwen2", false);
//! assert_eq!(template.name(), "ChatML");
//! let prompt = template
//!     .render(&[ChatMessage::new("user", "Hi!")], true, "", "<|im_end|>")
//!     .unwrap();
//! assert_eq!(prompt, "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n");
//! ```

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use flatrun_format::{MetaValue, Metadata};
use minijinja::machinery::Vm;
use minijinja::{AutoEscape, Environment, ErrorKind, Value};
use serde::Serialize;

mod budget;
mod guard;
pub mod harmony;
mod sandbox;
pub mod tools;

use budget::Budget;

/// One message of a conversation. The tool fields follow Hugging Face's
/// chat-template conventions; they are absent from the template's view
/// when unset.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's tool calls: `[{"type": "function", "id": …,
    /// "function": {"name": …, "arguments": {…}}}]`, the arguments as a
    /// JSON object (templates apply `tojson` to them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` message: the name of the tool that answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// Errors of loading and rendering chat templates.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: {what}")]
    BadConfig { path: PathBuf, what: String },
    /// The template does not parse.
    #[error("chat template `{name}` does not compile: {what}")]
    Syntax { name: String, what: String },
    /// The template called `raise_exception(message)`.
    #[error("chat template `{name}` raised an exception: {message}")]
    Raised { name: String, message: String },
    /// A sandbox limit stopped the template.
    #[error("chat template `{name}` stopped: {what}")]
    Limit { name: String, what: String },
    /// Any other rendering failure.
    #[error("chat template `{name}` failed to render: {what}")]
    Render { name: String, what: String },
}

/// Sandbox limits for rendering untrusted templates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemplateLimits {
    /// Template instructions one render may execute.
    pub fuel: u64,
    /// Nesting depth of macro calls, includes and recursive loops.
    pub recursion: usize,
    /// Bytes of rendered output.
    pub max_output_bytes: usize,
    /// Bytes of any string the template builds (`~`, `+`, `*`, filters,
    /// captured blocks, macro output), and text weight of any sequence.
    pub max_string_bytes: usize,
    /// Items of any sequence the template builds (`+`, `*`, `batch`…).
    pub max_items: usize,
    /// Bytes one render may write and build in total (output, captures,
    /// macro output, operator and filter results).
    pub max_total_bytes: usize,
}

impl Default for TemplateLimits {
    fn default() -> Self {
        TemplateLimits {
            fuel: 2_000_000,
            recursion: 64,
            max_output_bytes: 4 << 20,
            max_string_bytes: 4 << 20,
            max_items: 1 << 20,
            max_total_bytes: 64 << 20,
        }
    }
}

/// Name given to templates read from a checkpoint.
pub const CUSTOM_NAME: &str = "custom (from file)";

const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
const GEMMA: &str = "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";
const LLAMA3: &str = "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
const LLAMA2: &str = "{% if messages[0]['role'] == 'system' %}{% set system = '<<SYS>>\n' + messages[0]['content'] | trim + '\n<</SYS>>\n\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + (system if loop.first else '') + message['content'] | trim + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}";

/// A chat template ready to render.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    name: String,
    source: String,
    limits: TemplateLimits,
}

impl ChatTemplate {
    /// The template in `tokenizer.chat_template`, or a built-in one chosen by
    /// `arch` (and the vocabulary: a llama model with `<|im_start|>` is ChatML).
    pub fn from_gguf_metadata(md: &Metadata, arch: &str) -> Result<ChatTemplate, TemplateError> {
        let find = |key: &str| md.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        if let Some(MetaValue::String(source)) = find("tokenizer.chat_template") {
            return ChatTemplate::from_source(CUSTOM_NAME, source);
        }
        let has_token = |text: &str| match find("tokenizer.ggml.tokens") {
            Some(MetaValue::Array(tokens)) => tokens
                .iter()
                .any(|t| matches!(t, MetaValue::String(s) if s == text)),
            _ => false,
        };
        let arch = if arch.starts_with("llama") && has_token("<|start_header_id|>") {
            "llama3"
        } else {
            arch
        };
        Ok(ChatTemplate::builtin_for_arch(
            arch,
            has_token("<|im_start|>"),
        ))
    }

    /// `chat_template.jinja`, or `chat_template` in `tokenizer_config.json`,
    /// or a built-in template chosen by `arch`.
    pub fn from_hf_dir(dir: &Path, arch: &str) -> Result<ChatTemplate, TemplateError> {
        let jinja = dir.join("chat_template.jinja");
        match std::fs::read_to_string(&jinja) {
            Ok(source) => return ChatTemplate::from_source(CUSTOM_NAME, &source),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(TemplateError::Io {
                    path: jinja,
                    source,
                });
            }
        }
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| TemplateError::BadConfig {
                path: config_path.clone(),
                what: e.to_string(),
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(source) => {
                return Err(TemplateError::Io {
                    path: config_path,
                    source,
                });
            }
        };
        match config.get("chat_template") {
            Some(serde_json::Value::String(source)) => {
                return ChatTemplate::from_source(CUSTOM_NAME, source);
            }
            // A list of named templates: use the one called "default".
            Some(serde_json::Value::Array(list)) => {
                let default = list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or(list.first());
                if let Some(source) = default
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                {
                    return ChatTemplate::from_source(CUSTOM_NAME, source);
                }
            }
            _ => {}
        }
        let vocab_text = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap_or_default();
        let arch = if arch.starts_with("llama") && vocab_text.contains("<|start_header_id|>") {
            "llama3"
        } else {
            arch
        };
        Ok(ChatTemplate::builtin_for_arch(
            arch,
            vocab_text.contains("<|im_start|>"),
        ))
    }

    /// A template from Jinja source; checks that it compiles.
    pub fn from_source(name: &str, source: &str) -> Result<ChatTemplate, TemplateError> {
        let syntax = |e: &minijinja::Error| TemplateError::Syntax {
            name: name.to_string(),
            what: describe(e),
        };
        let template = ChatTemplate {
            name: name.to_string(),
            source: source.to_string(),
            limits: TemplateLimits::default(),
        };
        // The sandbox compiles it (refusing oversized constants before
        // minijinja's constant folding would build them)…
        let Err(e) = sandbox::compile(name, source, template.limits.max_string_bytes) else {
            return Ok(template);
        };
        let error = template.compile_error(&e);
        if matches!(error, TemplateError::Syntax { .. }) {
            // …and a syntax error is reported by minijinja's own compiler, with its context.
            let budget = Arc::new(Budget::new(template.limits));
            template
                .environment(budget)
                .template_from_str(source)
                .map_err(|e| syntax(&e))?;
        }
        Err(error)
    }

    /// The built-in template for an architecture: Gemma turns for `gemma*`,
    /// Llama 3 headers for `llama3`, `[INST]` for other llama models without
    /// `<|im_start|>`, ChatML otherwise (Qwen, SmolLM, unknown).
    pub fn builtin_for_arch(arch: &str, vocab_has_im_start: bool) -> ChatTemplate {
        let (name, source) = if arch.starts_with("gemma") {
            ("Gemma", GEMMA)
        } else if arch == "llama3" {
            ("Llama 3", LLAMA3)
        } else if (arch == "llama" || arch == "llama2") && !vocab_has_im_start {
            ("Llama 2", LLAMA2)
        } else {
            ("ChatML", CHATML)
        };
        ChatTemplate {
            name: name.to_string(),
            source: source.to_string(),
            limits: TemplateLimits::default(),
        }
    }

    /// `"ChatML"`, `"Gemma"`, `"Llama 3"`, `"Llama 2"` or `"custom (from file)"`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Replace the sandbox limits.
    pub fn with_limits(mut self, limits: TemplateLimits) -> ChatTemplate {
        self.limits = limits;
        self
    }

    /// Render a conversation into a prompt.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, TemplateError> {
        self.render_with(
            messages,
            add_generation_prompt,
            bos_token,
            eos_token,
            Value::UNDEFINED,
        )
    }

    /// The tool-call syntax this template teaches, if it takes tools.
    pub fn tool_syntax(&self) -> Option<tools::ToolSyntax> {
        tools::ToolSyntax::from_template(&self.source)
    }

    /// Render a conversation with tool definitions (`tools`, a list of
    /// OpenAI-shaped `{"type": "function", "function": {…}}` objects).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &serde_json::Value,
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, TemplateError> {
        self.render_with(
            messages,
            add_generation_prompt,
            bos_token,
            eos_token,
            minijinja::context! { tools => Value::from_serialize(tools) },
        )
    }

    /// Render with extra template variables (e.g. `tools`), given as a map value.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
        extra: Value,
    ) -> Result<String, TemplateError> {
        let budget = Arc::new(Budget::new(self.limits));
        let env = self.environment(budget);
        let compiled = sandbox::compile(&self.name, &self.source, self.limits.max_string_bytes)
            .map_err(|e| self.compile_error(&e))?;
        let base = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        };
        let ctx = if extra.is_undefined() {
            base
        } else {
            minijinja::context! { ..base, ..extra }
        };
        // Run the instrumented instructions; the formatter writes every byte
        // and holds the output under its limit.
        let mut rendered = String::new();
        let result = Vm::new(&env).eval(
            &compiled.instructions,
            Value::from_serialize(&ctx),
            &compiled.blocks,
            &mut minijinja::machinery::make_string_output(&mut rendered),
            AutoEscape::None,
        );
        match result {
            Ok(_) => Ok(rendered),
            Err(e) => Err(self.classify(&e)),
        }
    }

    /// A sandboxed environment configured like Hugging Face's.
    fn environment(&self, budget: Arc<Budget>) -> Environment<'_> {
        let mut env = Environment::new();
        // Hugging Face compiles chat templates with these two on.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(self.limits.fuel));
        env.set_recursion_limit(self.limits.recursion);
        minijinja_contrib::add_to_environment(&mut env);
        let formatter_budget = budget.clone();
        env.set_formatter(move |out, state, value| formatter_budget.emit(out, state, value));
        guard::add_guards(&mut env, self.limits, budget);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env
    }

    /// A sandbox compile error: a constant that is too large, or syntax.
    fn compile_error(&self, e: &minijinja::Error) -> TemplateError {
        match e.detail().and_then(|d| d.strip_prefix(guard::TOO_LARGE)) {
            Some(what) => TemplateError::Limit {
                name: self.name.clone(),
                what: what.to_string(),
            },
            None => TemplateError::Syntax {
                name: self.name.clone(),
                what: describe(e),
            },
        }
    }

    fn classify(&self, e: &minijinja::Error) -> TemplateError {
        let name = self.name.clone();
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(err) = cause {
            if let Some(m) = err.downcast_ref::<minijinja::Error>() {
                if m.kind() == ErrorKind::OutOfFuel {
                    return TemplateError::Limit {
                        name,
                        what: format!("ran out of fuel ({} instructions)", self.limits.fuel),
                    };
                }
                if let Some(message) = m.detail().and_then(|d| d.strip_prefix(RAISED)) {
                    return TemplateError::Raised {
                        name,
                        message: message.to_string(),
                    };
                }
                if m.detail().is_some_and(|d| d.contains("recursion limit")) {
                    return TemplateError::Limit {
                        name,
                        what: format!("recursion deeper than {}", self.limits.recursion),
                    };
                }
                if let Some(what) = m.detail().and_then(|d| d.strip_prefix(guard::TOO_LARGE)) {
                    return TemplateError::Limit {
                        name,
                        what: what.to_string(),
                    };
                }
                if m.detail().is_some_and(|d| d.contains("too large")) {
                    return TemplateError::Limit {
                        name,
                        what: describe(m),
                    };
                }
            }
            cause = err.source();
        }
        TemplateError::Render {
            name,
            what: describe(e),
        }
    }
}

/// Marker that tells `raise_exception` errors apart.
const RAISED: &str = "raise_exception: ";

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{message}"),
    ))
}

/// Error text with the template line where minijinja knows it.
fn describe(e: &minijinja::Error) -> String {
    match e.line() {
        Some(line) => format!("{e} (line {line})"),
        None => e.to_string(),
    }
}

/// `strftime_now(format)`: the current UTC time, for templates that date their system prompt.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, secs)
}

/// A small `strftime` over a Unix time (UTC): `%Y %m %d %e %B %b %A %a %H %M %S %y %j %%`.
pub(crate) fn strftime(format: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let month_starts = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = month_starts[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('e') => write!(out, "{day:2}"),
            Some('j') => write!(out, "{yday:03}"),
            Some('B') => write!(out, "{month_name}"),
            Some('b') => write!(out, "{}", &month_name[..3]),
            Some('A') => write!(out, "{weekday}"),
            Some('a') => write!(out, "{}", &weekday[..3]),
            Some('H') => write!(out, "{:02}", secs_of_day / 3600),
            Some('M') => write!(out, "{:02}", secs_of_day / 60 % 60),
            Some('S') => write!(out, "{:02}", secs_of_day % 60),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// The largest `tojson(indent=…)` accepted.
const MAX_JSON_INDENT: usize = 64;

/// `tojson` as Hugging Face defines it: Python's `json.dumps(x, ensure_ascii=False, indent=indent)`
/// (keys in insertion order, `", "` and `": "` separators).
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Each line repeats the indent per nesting level; a huge one is an attack.
    if indent.is_some_and(|n| n > MAX_JSON_INDENT) {
        return Err(guard::too_large(format!(
            "`tojson` indent {} (limit {MAX_JSON_INDENT})",
            indent.unwrap_or(0)
        )));
    }
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_python_json(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// JSON with Python's separators, or one item per line when indented.
fn write_python_json(
    v: &Value,
    indent: Option<usize>,
    level: usize,
    out: &mut String,
) -> Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    let bad =
        |e: serde_json::Error| minijinja::Error::new(ErrorKind::BadSerialization, e.to_string());
    match v.kind() {
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_python_json(item, indent, level + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, level);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                let key_text = key
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| key.to_string());
                out.push_str(&serde_json::to_string(&key_text).map_err(bad)?);
                out.push_str(": ");
                write_python_json(&v.get_item(key)?, indent, level + 1, out)?;
            }
            if !keys.is_empty() {
                newline(out, level);
            }
            out.push('}');
        }
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        _ => out.push_str(&serde_json::to_string(v).map_err(bad)?),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `source` rendered by minijinja's own compiler without the sandbox
    /// (same configuration and helpers): what the instrumented instructions
    /// must reproduce.
    fn render_plain(
        source: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let template = env.template_from_str(source).map_err(|e| e.to_string())?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => "<BOS>",
                eos_token => "<EOS>",
            })
            .map_err(|e| e.to_string())
    }

    /// Every chat template at hand: built-ins, the jinja2 fixtures, and the
    /// templates in the GGUF files of `$FLATRUN_VOCAB` and `$FLATRUN_MODELS`.
    fn known_templates() -> Vec<(String, String)> {
        let mut templates: Vec<(String, String)> = [CHATML, GEMMA, LLAMA3, LLAMA2]
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("builtin {i}"), t.to_string()))
            .collect();
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
        for file in ["chat_smollm2.json", "chat_qwen2.5.json"] {
            let text = std::fs::read_to_string(fixtures.join(file)).expect("fixture");
            let json: serde_json::Value = serde_json::from_str(&text).expect("fixture json");
            if let Some(t) = json["template"].as_str() {
                templates.push((file.to_string(), t.to_string()));
            }
        }
        let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
        let dirs = [
            std::env::var_os("FLATRUN_VOCAB")
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(".cache/flatrun/vocab")),
            std::env::var_os("FLATRUN_MODELS")
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(".cache/flatrun/models")),
        ];
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            let mut paths: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
                .collect();
            paths.sort();
            for path in paths {
                let Ok(backend) = flatrun_format::open(&path) else {
                    continue;
                };
                let found = backend
                    .metadata()
                    .entries
                    .iter()
                    .find(|(k, _)| k == "tokenizer.chat_template")
                    .map(|(_, v)| v.clone());
                if let Some(MetaValue::String(t)) = found {
                    templates.push((path.display().to_string(), t));
                }
            }
        }
        templates
    }

    #[test]
    fn sandbox_renders_like_minijinja() {
        let conversations = [
            vec![ChatMessage::new("user", "Hi")],
            vec![
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "What is 2+2?"),
                ChatMessage::new("assistant", "4"),
                ChatMessage::new("user", "And 3+3? {{ not a tag }} <|im_end|> é 漢字 🙂"),
            ],
            vec![
                ChatMessage::new("user", "  padded\n\n  "),
                ChatMessage::new("assistant", "ok"),
            ],
        ];
        let mut compared = 0;
        let templates = known_templates();
        for (name, source) in &templates {
            let (name, source) = (name.as_str(), source.as_str());
            let sandboxed = match ChatTemplate::from_source(name, source) {
                Ok(t) => t,
                Err(e) => {
                    assert!(
                        render_plain(source, &conversations[0], true).is_err(),
                        "{name}: only the sandbox refuses it: {e}"
                    );
                    continue;
                }
            };
            for messages in &conversations {
                for generation_prompt in [true, false] {
                    let plain = render_plain(source, messages, generation_prompt);
                    let ours = sandboxed.render(messages, generation_prompt, "<BOS>", "<EOS>");
                    match (plain, ours) {
                        (Ok(plain), Ok(ours)) => {
                            assert_eq!(ours, plain, "{name}");
                            compared += 1;
                        }
                        (Err(_), Err(_)) => {}
                        (plain, ours) => panic!("{name}: plain {plain:?}, sandboxed {ours:?}"),
                    }
                }
            }
        }
        eprintln!(
            "{compared} renders of {} templates compared",
            templates.len()
        );
        assert!(compared >= 20, "only {compared} renders compared");
    }

    #[test]
    fn strftime_known_dates() {
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %A %j", 1_709_251_199),
            "2024-02-29 23:59:59 Thursday 060"
        );
    }

    #[test]
    fn python_json_separators() {
        let empty: std::collections::BTreeMap<String, i32> = Default::default();
        let v = minijinja::context! { b => (1, "é"), a => empty };
        let mut s = String::new();
        write_python_json(&v, None, 0, &mut s).unwrap();
        assert_eq!(s, r#"{"b": [1, "é"], "a": {}}"#);
        let mut s = String::new();
        write_python_json(
            &Value::from_serialize(serde_json::json!({"a": [1]})),
            Some(2),
            0,
            &mut s,
        )
        .unwrap();
        assert_eq!(s, "{\n  \"a\": [\n    1\n  ]\n}");
    }
}
