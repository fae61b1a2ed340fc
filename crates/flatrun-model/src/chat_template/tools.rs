//! Tool calls in a model's output: the syntax a chat template teaches
//! ([`ToolSyntax`], recognized from the template source, never from the
//! model's name), a parser for a whole answer ([`parse_tool_calls`]) and an
//! incremental one for streams ([`ToolCallStream`]).
//!
//! | Syntax | Families | What the model writes |
//! |---|---|---|
//! | [`ToolSyntax::Hermes`] | Qwen2.5, Qwen3, Hermes | `<tool_call>{"name": …, "arguments": {…}}</tool_call>` |
//! | [`ToolSyntax::Llama3`] | Llama 3.1–3.3 | `{"name": …, "parameters": {…}}`, optionally after `<\|python_tag\|>` |
//! | [`ToolSyntax::Mistral`] | Mistral, Mixtral | `[TOOL_CALLS][{"name": …, "arguments": {…}}]` or `[TOOL_CALLS]name[ARGS]{…}` |
//! | [`ToolSyntax::Harmony`] | gpt-oss | `<\|channel\|>commentary to=functions.name … <\|message\|>{…}<\|call\|>` |
//!
//! ```
//! use flatrun_model::chat_template::tools::{ToolSyntax, parse_tool_calls};
//! let out = parse_tool_calls(
//!     ToolSyntax::Hermes,
//!     "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
//! );
//! assert_eq!(out.content, "Let me look.");
//! assert_eq!(out.tool_calls[0].name, "weather");
//! assert_eq!(out.tool_calls[0].arguments, r#"{"city":"Paris"}"#);
//! ```

use serde_json::Value;

/// How a family writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolSyntax {
    Hermes,
    Llama3,
    Mistral,
    Harmony,
}

impl ToolSyntax {
    /// The syntax a chat template's source teaches, if it takes tools.
    pub fn from_template(source: &str) -> Option<ToolSyntax> {
        if source.contains("<tool_call>") {
            Some(ToolSyntax::Hermes)
        } else if source.contains("[TOOL_CALLS]") {
            Some(ToolSyntax::Mistral)
        } else if source.contains("to=functions") || source.contains("<|channel|>") {
            Some(ToolSyntax::Harmony)
        } else if source.contains("<|python_tag|>")
            || (source.contains("ipython") && source.contains("tools"))
        {
            Some(ToolSyntax::Llama3)
        } else {
            None
        }
    }

    /// The text that opens a tool call in this syntax (for a grammar that
    /// forces one, and for the stream parser to hold text back).
    pub fn opener(self) -> &'static str {
        match self {
            ToolSyntax::Hermes => "<tool_call>",
            ToolSyntax::Llama3 => "{\"name\"",
            ToolSyntax::Mistral => "[TOOL_CALLS]",
            ToolSyntax::Harmony => "<|channel|>commentary to=functions.",
        }
    }

    /// The exact text of one call of `name` with `arguments` (a JSON text):
    /// what a forced call must look like.
    pub fn call_prefix(self, name: &str) -> String {
        let name_json = Value::String(name.to_string()).to_string();
        match self {
            ToolSyntax::Hermes => format!("<tool_call>\n{{\"name\": {name_json}, \"arguments\": "),
            ToolSyntax::Llama3 => format!("{{\"name\": {name_json}, \"parameters\": "),
            ToolSyntax::Mistral => format!("[TOOL_CALLS][{{\"name\": {name_json}, \"arguments\": "),
            ToolSyntax::Harmony => {
                format!("<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>")
            }
        }
    }

    /// What closes a call opened by [`ToolSyntax::call_prefix`].
    pub fn call_suffix(self) -> &'static str {
        match self {
            ToolSyntax::Hermes => "}\n</tool_call>",
            ToolSyntax::Llama3 => "}",
            ToolSyntax::Mistral => "}]",
            ToolSyntax::Harmony => "<|call|>",
        }
    }
}

/// One tool call found in the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedToolCall {
    pub name: String,
    /// The arguments as compact JSON text (`{}` when the model gave none).
    pub arguments: String,
}

/// An answer split into its text and its tool calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    /// The text outside the calls, trimmed.
    pub content: String,
    pub tool_calls: Vec<ParsedToolCall>,
}

/// A call from a JSON object with `name` and `arguments` (or `parameters`).
fn call_from_json(value: &Value) -> Option<ParsedToolCall> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?.to_string();
    let arguments = object
        .get("arguments")
        .or_else(|| object.get("parameters"))
        .cloned()
        .unwrap_or_else(|| Value::Object(Default::default()));
    // Some models write the arguments as a JSON string.
    let arguments = match arguments {
        Value::String(text) => serde_json::from_str::<Value>(&text).unwrap_or(Value::String(text)),
        other => other,
    };
    Some(ParsedToolCall {
        name,
        arguments: arguments.to_string(),
    })
}

/// The first JSON value at the start of `text` (after whitespace) and the
/// rest of the text after it.
fn leading_json(text: &str) -> Option<(Value, &str)> {
    let trimmed = text.trim_start();
    let mut stream = serde_json::Deserializer::from_str(trimmed).into_iter::<Value>();
    let value = stream.next()?.ok()?;
    Some((value, &trimmed[stream.byte_offset()..]))
}

/// Splits a whole answer into its text and tool calls. Text that only looks
/// like a call (malformed JSON, no name) stays in the content.
pub fn parse_tool_calls(syntax: ToolSyntax, text: &str) -> ParsedOutput {
    let mut content = String::new();
    let mut calls = Vec::new();
    match syntax {
        ToolSyntax::Hermes => {
            let mut rest = text;
            while let Some(start) = rest.find("<tool_call>") {
                let body = &rest[start + "<tool_call>".len()..];
                let (inner, after) = match body.find("</tool_call>") {
                    Some(end) => (&body[..end], &body[end + "</tool_call>".len()..]),
                    None => (body, ""),
                };
                match serde_json::from_str::<Value>(inner.trim())
                    .ok()
                    .as_ref()
                    .and_then(call_from_json)
                {
                    Some(call) => {
                        content.push_str(&rest[..start]);
                        calls.push(call);
                    }
                    None => content.push_str(&rest[..start + "<tool_call>".len() + inner.len()]),
                }
                rest = after;
            }
            content.push_str(rest);
        }
        ToolSyntax::Llama3 => {
            let body = text.trim_start();
            let body = body.strip_prefix("<|python_tag|>").unwrap_or(body);
            // One or more objects, separated by `;` or whitespace.
            let mut rest = body;
            while let Some((value, after)) = leading_json(rest) {
                match call_from_json(&value) {
                    Some(call) => calls.push(call),
                    None => break,
                }
                rest = after.trim_start().trim_start_matches(';');
            }
            if calls.is_empty() {
                content.push_str(text);
            } else {
                content.push_str(rest);
            }
        }
        ToolSyntax::Mistral => match text.find("[TOOL_CALLS]") {
            Some(start) => {
                content.push_str(&text[..start]);
                let mut rest = &text[start + "[TOOL_CALLS]".len()..];
                loop {
                    let trimmed = rest.trim_start();
                    if let Some((Value::Array(items), after)) = leading_json(trimmed) {
                        calls.extend(items.iter().filter_map(call_from_json));
                        rest = after;
                    } else if let Some(args_at) = trimmed.find("[ARGS]") {
                        let name = trimmed[..args_at].trim().to_string();
                        match leading_json(&trimmed[args_at + "[ARGS]".len()..]) {
                            Some((args, after)) if !name.is_empty() => {
                                calls.push(ParsedToolCall {
                                    name,
                                    arguments: args.to_string(),
                                });
                                rest = after;
                            }
                            _ => break,
                        }
                    } else {
                        break;
                    }
                    match rest.trim_start().strip_prefix("[TOOL_CALLS]") {
                        Some(next) => rest = next,
                        None => break,
                    }
                }
                content.push_str(rest);
            }
            None => content.push_str(text),
        },
        ToolSyntax::Harmony => {
            let marker = "to=functions.";
            let mut rest = text;
            while let Some(at) = rest.find(marker) {
                let before = &rest[..at];
                let after_marker = &rest[at + marker.len()..];
                let name_end = after_marker
                    .find(|c: char| c.is_whitespace() || c == '<')
                    .unwrap_or(after_marker.len());
                let name = after_marker[..name_end].to_string();
                let Some(msg) = after_marker.find("<|message|>") else {
                    break;
                };
                let body = &after_marker[msg + "<|message|>".len()..];
                let end = body
                    .find("<|call|>")
                    .or_else(|| body.find("<|end|>"))
                    .unwrap_or(body.len());
                let arguments = serde_json::from_str::<Value>(body[..end].trim())
                    .map(|v| v.to_string())
                    .unwrap_or_else(|_| body[..end].trim().to_string());
                // The channel header that opened the call is not content.
                let header = before.rfind("<|channel|>").map_or(before, |h| &before[..h]);
                let header = header.rfind("<|start|>").map_or(header, |h| &header[..h]);
                content.push_str(header);
                calls.push(ParsedToolCall { name, arguments });
                let consumed = (end + "<|call|>".len()).min(body.len());
                rest = &body[consumed..];
            }
            content.push_str(rest);
        }
    }
    ParsedOutput {
        content: content.trim().to_string(),
        tool_calls: calls,
    }
}

/// What [`ToolCallStream`] releases.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolStreamEvent {
    /// Text outside any call.
    Content(String),
    /// A complete call.
    Call(ParsedToolCall),
}

/// An incremental [`parse_tool_calls`]: text is released as soon as it
/// cannot be the start of a call; a call is released once complete (Hermes)
/// or at the end (the syntaxes without a closing marker).
#[derive(Clone, Debug)]
pub struct ToolCallStream {
    syntax: ToolSyntax,
    /// Text not yet released.
    held: String,
    /// A call opener was seen: everything is held until it is complete.
    in_call: bool,
    /// Any text has been released (Llama 3 calls only begin an answer).
    released_any: bool,
}

impl ToolCallStream {
    pub fn new(syntax: ToolSyntax) -> ToolCallStream {
        ToolCallStream {
            syntax,
            held: String::new(),
            in_call: false,
            released_any: false,
        }
    }

    /// Feeds generated text; returns what can be released.
    pub fn push(&mut self, text: &str) -> Vec<ToolStreamEvent> {
        self.held.push_str(text);
        let mut events = Vec::new();
        loop {
            if self.in_call {
                // Only Hermes has a closing marker to release a call early.
                if self.syntax != ToolSyntax::Hermes {
                    return events;
                }
                let Some(end) = self.held.find("</tool_call>") else {
                    return events;
                };
                let block: String = self.held.drain(..end + "</tool_call>".len()).collect();
                let parsed = parse_tool_calls(self.syntax, &block);
                if !parsed.content.is_empty() {
                    events.push(ToolStreamEvent::Content(parsed.content));
                }
                events.extend(parsed.tool_calls.into_iter().map(ToolStreamEvent::Call));
                self.in_call = false;
                continue;
            }
            let opener = match self.syntax {
                // A Llama 3 call is the whole answer: it may only start it.
                ToolSyntax::Llama3 if self.released_any => return self.release_all(events),
                ToolSyntax::Llama3 => {
                    let trimmed = self.held.trim_start();
                    if trimmed.is_empty() {
                        return events;
                    }
                    let call = trimmed.starts_with("<|python_tag|>")
                        || trimmed.starts_with('{')
                        || "<|python_tag|>".starts_with(trimmed);
                    if call {
                        self.in_call = true;
                        return events;
                    }
                    return self.release_all(events);
                }
                other => other.opener(),
            };
            if let Some(at) = self.held.find(opener) {
                if at > 0 {
                    let text: String = self.held.drain(..at).collect();
                    self.released_any = true;
                    events.push(ToolStreamEvent::Content(text));
                }
                self.in_call = true;
                continue;
            }
            // Hold back a suffix that could begin the opener.
            let keep = (1..opener.len().min(self.held.len() + 1))
                .rev()
                .find(|&n| {
                    self.held.is_char_boundary(self.held.len() - n)
                        && opener.starts_with(&self.held[self.held.len() - n..])
                })
                .unwrap_or(0);
            let cut = self.held.len() - keep;
            if cut > 0 {
                let text: String = self.held.drain(..cut).collect();
                self.released_any = true;
                events.push(ToolStreamEvent::Content(text));
            }
            return events;
        }
    }

    fn release_all(&mut self, mut events: Vec<ToolStreamEvent>) -> Vec<ToolStreamEvent> {
        if !self.held.is_empty() {
            self.released_any = true;
            events.push(ToolStreamEvent::Content(std::mem::take(&mut self.held)));
        }
        events
    }

    /// The end of the answer: whatever is held, parsed.
    pub fn finish(mut self) -> Vec<ToolStreamEvent> {
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return Vec::new();
        }
        if !self.in_call {
            return vec![ToolStreamEvent::Content(held)];
        }
        let parsed = parse_tool_calls(self.syntax, &held);
        let mut events = Vec::new();
        if parsed.tool_calls.is_empty() {
            // Not a call after all: the text as it was.
            events.push(ToolStreamEvent::Content(held));
            return events;
        }
        if !parsed.content.is_empty() {
            events.push(ToolStreamEvent::Content(parsed.content));
        }
        events.extend(parsed.tool_calls.into_iter().map(ToolStreamEvent::Call));
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ParsedToolCall {
        ParsedToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn each_syntax_parses() {
        let cases = [
            (
                ToolSyntax::Hermes,
                "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>",
                vec![call("a", r#"{"x":1}"#), call("b", "{}")],
            ),
            (
                ToolSyntax::Llama3,
                "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}",
                vec![call("a", r#"{"x":1}"#)],
            ),
            (
                ToolSyntax::Mistral,
                "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": \"{}\"}]",
                vec![call("a", r#"{"x":1}"#), call("b", "{}")],
            ),
            (
                ToolSyntax::Mistral,
                "[TOOL_CALLS]a[ARGS]{\"x\": 1}",
                vec![call("a", r#"{"x":1}"#)],
            ),
            (
                ToolSyntax::Harmony,
                "<|channel|>commentary to=functions.a <|constrain|>json<|message|>{\"x\": 1}<|call|>",
                vec![call("a", r#"{"x":1}"#)],
            ),
        ];
        for (syntax, text, expected) in cases {
            let out = parse_tool_calls(syntax, text);
            assert_eq!(out.tool_calls, expected, "{syntax:?}");
            assert_eq!(out.content, "", "{syntax:?}");
        }
    }

    #[test]
    fn malformed_calls_stay_text() {
        let text = "<tool_call>{not json}</tool_call> done";
        let out = parse_tool_calls(ToolSyntax::Hermes, text);
        assert!(out.tool_calls.is_empty());
        assert_eq!(out.content, "<tool_call>{not json} done");
        let out = parse_tool_calls(ToolSyntax::Llama3, "The answer is {\"x\": 1}");
        assert!(out.tool_calls.is_empty());
    }

    #[test]
    fn the_stream_parser_equals_the_whole_parser_at_every_split() {
        let text = "Sure.<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": \"é\"}}\n</tool_call> <tool_call>{\"name\": \"b\"}</tool_call>";
        let whole = parse_tool_calls(ToolSyntax::Hermes, text);
        for split in 1..text.len() {
            if !text.is_char_boundary(split) {
                continue;
            }
            let mut stream = ToolCallStream::new(ToolSyntax::Hermes);
            let mut events = stream.push(&text[..split]);
            events.extend(stream.push(&text[split..]));
            events.extend(stream.finish());
            let mut content = String::new();
            let mut calls = Vec::new();
            for e in events {
                match e {
                    ToolStreamEvent::Content(t) => content.push_str(&t),
                    ToolStreamEvent::Call(c) => calls.push(c),
                }
            }
            assert_eq!(calls, whole.tool_calls, "split {split}");
            assert_eq!(content.trim(), "Sure.", "split {split}");
        }
    }

    #[test]
    fn templates_choose_their_syntax() {
        assert_eq!(
            ToolSyntax::from_template("{{- '<tool_call>' }}"),
            Some(ToolSyntax::Hermes)
        );
        assert_eq!(
            ToolSyntax::from_template("[TOOL_CALLS]"),
            Some(ToolSyntax::Mistral)
        );
        assert_eq!(
            ToolSyntax::from_template("<|python_tag|>"),
            Some(ToolSyntax::Llama3)
        );
        assert_eq!(ToolSyntax::from_template("{{ messages }}"), None);
    }
}
