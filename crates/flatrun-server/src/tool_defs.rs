//! Tool definitions and `tool_choice` of both APIs in one shape: checked
//! (names, schemas), rendered for the chat template (OpenAI's
//! `{"type": "function", "function": {…}}`, which Hugging Face templates
//! expect), and turned into the grammar of a forced call.

use serde_json::{Value, json};

use crate::api_error::{ApiError, ApiFlavor};
use crate::grammar::GrammarSpec;
use crate::request_fields::forced_call_grammar;
use flatrun_model::chat_template::tools::ToolSyntax;

/// One tool the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema of the arguments object.
    pub parameters: Value,
}

/// What the request allows or demands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default with tools).
    Auto,
    /// No tool call; tools are not shown to the model.
    None,
    /// At least one call, of any tool.
    Required,
    /// A call of this tool.
    Named(String),
}

/// The tools of a request and how they may be used.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSet {
    pub tools: Vec<ToolDef>,
    pub choice: ToolChoice,
    /// More than one call in an answer (`parallel_tool_calls`,
    /// Anthropic's `disable_parallel_tool_use` negated).
    pub parallel: bool,
}

impl ToolSet {
    /// The tools of a request and its choice, checked as both APIs check
    /// them: distinct names, a named choice among the tools, and a forced
    /// call only with tools to call.
    pub fn new(
        flavor: ApiFlavor,
        tools: Vec<ToolDef>,
        choice: ToolChoice,
        parallel: bool,
    ) -> Result<ToolSet, ApiError> {
        check_unique(flavor, &tools)?;
        if let ToolChoice::Named(name) = &choice
            && !tools.iter().any(|t| &t.name == name)
        {
            return Err(ApiError::invalid(
                flavor,
                format!("tool_choice names `{name}`, which is not one of the tools"),
            ));
        }
        if matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) && tools.is_empty() {
            return Err(ApiError::invalid(
                flavor,
                "tool_choice requires a tool call, but tools is empty",
            ));
        }
        Ok(ToolSet {
            tools,
            choice,
            parallel,
        })
    }

    /// The grammar of the call the choice forces (`required`, a named
    /// tool), written in the model's tool-call syntax; `None` when nothing
    /// is forced or the model has no syntax.
    pub fn forced_grammar(&self, syntax: Option<ToolSyntax>) -> Option<GrammarSpec> {
        let forced = self.forced();
        match syntax {
            Some(syntax) if !forced.is_empty() => {
                Some(forced_call_grammar(syntax, &forced, self.parallel))
            }
            _ => None,
        }
    }

    /// The tools as the chat template takes them; `None` when the model must
    /// not see them.
    pub fn template_value(&self) -> Option<Value> {
        if self.tools.is_empty() || self.choice == ToolChoice::None {
            return None;
        }
        Some(Value::Array(
            self.tools
                .iter()
                .map(|t| {
                    let mut function = json!({"name": t.name, "parameters": t.parameters});
                    if let Some(d) = &t.description {
                        function["description"] = json!(d);
                    }
                    json!({"type": "function", "function": function})
                })
                .collect(),
        ))
    }

    /// Whether the answer is parsed for calls.
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }

    /// The tools a forced call may use (none when the call is not forced).
    pub fn forced(&self) -> Vec<&ToolDef> {
        match &self.choice {
            ToolChoice::Required => self.tools.iter().collect(),
            ToolChoice::Named(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
            _ => Vec::new(),
        }
    }

    /// Looks a tool up by name.
    pub fn get(&self, name: &str) -> Option<&ToolDef> {
        self.tools.iter().find(|t| t.name == name)
    }
}

/// A tool name as both APIs allow it: 1–64 of `[A-Za-z0-9_-]` (dots too,
/// which some clients use for namespaces).
pub fn check_name(flavor: ApiFlavor, name: &str, location: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            flavor,
            format!(
                "{location}: tool name `{name}` must be 1-64 characters of a-z, A-Z, 0-9, _ and -"
            ),
        ))
    }
}

/// Checks a tool's parameter schema: a JSON object that the grammar
/// engine can compile (checked again when a grammar is built from it).
pub fn check_schema(flavor: ApiFlavor, schema: &Value, location: &str) -> Result<(), ApiError> {
    let Some(object) = schema.as_object() else {
        return Err(ApiError::invalid(
            flavor,
            format!("{location}: the schema must be a JSON object, got {schema}"),
        ));
    };
    if let Some(kind) = object.get("type")
        && !(kind.is_string() || kind.is_array())
    {
        return Err(ApiError::invalid(
            flavor,
            format!("{location}.type must be a string or a list of strings, got {kind}"),
        ));
    }
    if let Some(properties) = object.get("properties")
        && !properties.is_object()
    {
        return Err(ApiError::invalid(
            flavor,
            format!("{location}.properties must be an object, got {properties}"),
        ));
    }
    if let Some(required) = object.get("required")
        && !required
            .as_array()
            .is_some_and(|r| r.iter().all(Value::is_string))
    {
        return Err(ApiError::invalid(
            flavor,
            format!("{location}.required must be a list of property names, got {required}"),
        ));
    }
    Ok(())
}

/// Rejects two tools of one name.
fn check_unique(flavor: ApiFlavor, tools: &[ToolDef]) -> Result<(), ApiError> {
    for (i, tool) in tools.iter().enumerate() {
        if tools[..i].iter().any(|t| t.name == tool.name) {
            return Err(ApiError::invalid(
                flavor,
                format!(
                    "tools: the name `{}` is used by more than one tool",
                    tool.name
                ),
            ));
        }
    }
    Ok(())
}

/// The arguments object a forced call must produce, for the grammar: the
/// tool's schema (an empty schema allows any object).
pub fn arguments_schema(tool: &ToolDef) -> Value {
    let mut schema = tool.parameters.clone();
    if let Some(object) = schema.as_object_mut()
        && !object.contains_key("type")
    {
        object.insert("type".into(), json!("object"));
    }
    schema
}
