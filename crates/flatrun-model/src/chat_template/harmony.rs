//! gpt-oss's "harmony" answers, split by channel as they stream.
//!
//! After the generation prompt `<|start|>assistant` a gpt-oss model writes
//! one or more messages, each a header, `<|message|>`, a body and an end
//! marker:
//!
//! ```text
//! <|channel|>analysis<|message|>…chain of thought…<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
//! <|start|>assistant<|channel|>final<|message|>…the answer…<|return|>
//! ```
//!
//! [`HarmonyStream`] turns that into [`HarmonyEvent`]s: the `analysis`
//! channel is reasoning, `final` (and `commentary` without a recipient, the
//! model's preambles) is the answer, and a message addressed
//! `to=functions.NAME` is a tool call. Text that does not open with a
//! harmony header (a model of another family, or one that skipped the
//! format) passes through as answer text unchanged.
//!
//! ```
//! use flatrun_model::chat_template::harmony::{HarmonyEvent, HarmonyStream};
//! let mut s = HarmonyStream::new();
//! let mut events = s.push("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant");
//! events.extend(s.push("<|channel|>final<|message|>Hello!<|return|>"));
//! events.extend(s.finish());
//! assert_eq!(events, [
//!     HarmonyEvent::Reasoning("Think.".into()),
//!     HarmonyEvent::Content("Hello!".into()),
//! ]);
//! ```

use super::tools::{ParsedToolCall, ToolSyntax, parse_tool_calls};

const CHANNEL: &str = "<|channel|>";
const START: &str = "<|start|>";
const MESSAGE: &str = "<|message|>";
const ENDS: [&str; 3] = ["<|end|>", "<|return|>", "<|call|>"];
const RECIPIENT: &str = "to=functions.";
/// A header may start with its recipient (`<|start|>assistant to=functions.f<|channel|>…`).
const RECIPIENT_OPEN: &str = "to=";

/// A part of a harmony answer, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HarmonyEvent {
    /// Text of the `analysis` channel.
    Reasoning(String),
    /// Text meant for the user (`final`, or `commentary` preambles).
    Content(String),
    /// A message addressed to a function.
    ToolCall(ParsedToolCall),
}

/// What the body being read is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Body {
    Reasoning,
    Content,
    /// A tool call: its header, kept until the body ends.
    Call(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Nothing seen yet: is this a harmony answer?
    Start,
    /// Inside a header, up to `<|message|>`.
    Header,
    Body(Body),
    /// Not a harmony answer: everything is content.
    Plain,
}

/// The incremental splitter (see the module docs).
#[derive(Clone, Debug)]
pub struct HarmonyStream {
    state: State,
    held: String,
}

impl Default for HarmonyStream {
    fn default() -> Self {
        HarmonyStream::new()
    }
}

/// How many bytes at the end of `text` could begin one of `markers`.
fn partial_suffix(text: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .map(|m| {
            (1..m.len().min(text.len() + 1))
                .rev()
                .find(|&n| {
                    text.is_char_boundary(text.len() - n) && m.starts_with(&text[text.len() - n..])
                })
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0)
}

/// The body kind a header announces.
fn body_of(header: &str) -> Body {
    if header.contains(RECIPIENT) {
        Body::Call(header.to_string())
    } else if header
        .rsplit(CHANNEL)
        .next()
        .is_some_and(|c| c.trim_start().starts_with("analysis"))
    {
        Body::Reasoning
    } else {
        Body::Content
    }
}

impl HarmonyStream {
    pub fn new() -> HarmonyStream {
        HarmonyStream {
            state: State::Start,
            held: String::new(),
        }
    }

    /// Whether the answer turned out to be in the harmony format (false
    /// until its first header is recognized).
    pub fn is_harmony(&self) -> bool {
        !matches!(self.state, State::Start | State::Plain)
    }

    /// Feeds generated text; returns what can be released.
    pub fn push(&mut self, text: &str) -> Vec<HarmonyEvent> {
        let mut events = Vec::new();
        self.held.push_str(text);
        loop {
            match &self.state {
                State::Plain => {
                    if !self.held.is_empty() {
                        events.push(HarmonyEvent::Content(std::mem::take(&mut self.held)));
                    }
                    return events;
                }
                State::Start => {
                    let t = self.held.trim_start();
                    if t.starts_with(CHANNEL)
                        || t.starts_with(START)
                        || t.starts_with(RECIPIENT_OPEN)
                    {
                        self.state = State::Header;
                    } else if [CHANNEL, START, RECIPIENT_OPEN]
                        .iter()
                        .any(|m| m.starts_with(t))
                    {
                        return events;
                    } else {
                        self.state = State::Plain;
                    }
                }
                State::Header => {
                    let Some(at) = self.held.find(MESSAGE) else {
                        return events;
                    };
                    let header: String = self.held.drain(..at + MESSAGE.len()).collect();
                    self.state = State::Body(body_of(&header[..at]));
                }
                State::Body(body) => {
                    let end = ENDS
                        .iter()
                        .filter_map(|m| self.held.find(m).map(|i| (i, m.len())))
                        .min();
                    let (cut, marker) = match end {
                        Some((i, len)) => (i, len),
                        None => (self.held.len() - partial_suffix(&self.held, &ENDS), 0),
                    };
                    let body = body.clone();
                    if let Body::Call(header) = &body {
                        if end.is_none() {
                            // A call is released whole, at its end marker.
                            return events;
                        }
                        let text: String = self.held.drain(..cut).collect();
                        let raw = format!("{header}{MESSAGE}{text}<|call|>");
                        let parsed = parse_tool_calls(ToolSyntax::Harmony, &raw);
                        match parsed.tool_calls.into_iter().next() {
                            Some(call) => events.push(HarmonyEvent::ToolCall(call)),
                            None => events.push(HarmonyEvent::Content(text)),
                        }
                    } else {
                        let text: String = self.held.drain(..cut).collect();
                        if !text.is_empty() {
                            events.push(match body {
                                Body::Reasoning => HarmonyEvent::Reasoning(text),
                                _ => HarmonyEvent::Content(text),
                            });
                        }
                    }
                    if end.is_none() {
                        return events;
                    }
                    self.held.drain(..marker);
                    self.state = State::Header;
                }
            }
        }
    }

    /// The end of the answer: everything still held. An unfinished body
    /// keeps its channel; an unfinished header or call is dropped (it holds
    /// no text meant for anyone).
    pub fn finish(mut self) -> Vec<HarmonyEvent> {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Start | State::Plain if !held.is_empty() => vec![HarmonyEvent::Content(held)],
            State::Body(Body::Reasoning) if !held.is_empty() => {
                vec![HarmonyEvent::Reasoning(held)]
            }
            State::Body(Body::Content) if !held.is_empty() => vec![HarmonyEvent::Content(held)],
            _ => Vec::new(),
        }
    }
}

/// A whole answer's final text (the `final` and preamble channels), or the
/// text itself when it is not a harmony answer: what a chat history keeps.
pub fn final_text(answer: &str) -> String {
    let mut s = HarmonyStream::new();
    let mut events = s.push(answer);
    events.extend(s.finish());
    events
        .into_iter()
        .filter_map(|e| match e {
            HarmonyEvent::Content(c) => Some(c),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANSWER: &str = "<|channel|>analysis<|message|>User wants weather. Use the tool.<|end|>\
        <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json\
        <|message|>{\"city\": \"Paris\"}<|call|>";

    fn all(text: &str, split: usize) -> Vec<HarmonyEvent> {
        let mut s = HarmonyStream::new();
        let mut events = s.push(&text[..split]);
        events.extend(s.push(&text[split..]));
        events.extend(s.finish());
        // Merge neighbouring pieces of the same kind.
        let mut merged: Vec<HarmonyEvent> = Vec::new();
        for e in events {
            match (merged.last_mut(), e) {
                (Some(HarmonyEvent::Reasoning(a)), HarmonyEvent::Reasoning(b)) => a.push_str(&b),
                (Some(HarmonyEvent::Content(a)), HarmonyEvent::Content(b)) => a.push_str(&b),
                (_, e) => merged.push(e),
            }
        }
        merged
    }

    #[test]
    fn analysis_is_reasoning_and_a_function_message_is_a_call_at_every_split() {
        let want = vec![
            HarmonyEvent::Reasoning("User wants weather. Use the tool.".into()),
            HarmonyEvent::ToolCall(ParsedToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into(),
            }),
        ];
        for split in 0..=ANSWER.len() {
            if ANSWER.is_char_boundary(split) {
                assert_eq!(all(ANSWER, split), want, "split at {split}");
            }
        }
    }

    #[test]
    fn final_channel_is_the_answer_and_preambles_are_shown() {
        let text = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary\
            <|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Sunny, 21 °C.<|return|>";
        assert_eq!(final_text(text), "Checking.Sunny, 21 °C.");
        let events = all(text, 17);
        assert_eq!(events[0], HarmonyEvent::Reasoning("hm".into()));
    }

    #[test]
    fn other_text_passes_through() {
        for text in ["Plain answer.", "<think>x</think>y", "<|"] {
            assert_eq!(final_text(text), text);
        }
        assert_eq!(final_text(""), "");
    }

    #[test]
    fn an_unfinished_body_keeps_its_channel() {
        let events = all("<|channel|>analysis<|message|>still thinking", 5);
        assert_eq!(events, [HarmonyEvent::Reasoning("still thinking".into())]);
        assert!(all("<|channel|>fin", 3).is_empty());
    }
}
