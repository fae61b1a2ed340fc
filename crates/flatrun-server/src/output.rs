//! What a generated answer holds, for both APIs: reasoning (`<think>` …
//! `</think>`, or gpt-oss's `analysis` channel), text, and tool calls in the
//! model's own syntax. One parser for streamed and whole answers: a whole
//! answer is one push and a finish.

use crate::engine::{GenerationEvent, GenerationStream, Usage};
use flatrun_model::chat_template::harmony::{HarmonyEvent, HarmonyStream};
use flatrun_model::chat_template::tools::{
    ParsedToolCall, ToolCallStream, ToolStreamEvent, ToolSyntax,
};
use flatrun_model::sampling::{FinishReason, TokenLogprobs};

/// A generation's next event, simplified for the API layers.
pub enum GenerationItem {
    Token {
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        text: String,
        reason: FinishReason,
        usage: Usage,
    },
    Failed(String),
}

impl GenerationItem {
    pub async fn next(generation: &mut GenerationStream) -> GenerationItem {
        match generation.next_event().await {
            Some(GenerationEvent::Token { text, logprobs, .. }) => {
                GenerationItem::Token { text, logprobs }
            }
            Some(GenerationEvent::Finished {
                reason,
                usage,
                text,
            }) => GenerationItem::Finished {
                text,
                reason,
                usage,
            },
            Some(GenerationEvent::Failed { message }) => GenerationItem::Failed(message),
            None => GenerationItem::Failed("generation ended unexpectedly".to_string()),
        }
    }
}

/// A whole generation: its text, the log-probabilities of its tokens (when
/// asked), how it ended.
#[derive(Debug)]
pub struct Collected {
    pub text: String,
    pub logprobs: Vec<TokenLogprobs>,
    pub reason: FinishReason,
    pub usage: Usage,
}

impl Collected {
    pub async fn from_stream(mut generation: GenerationStream) -> Result<Collected, String> {
        let mut text = String::new();
        let mut logprobs = Vec::new();
        loop {
            match GenerationItem::next(&mut generation).await {
                GenerationItem::Token {
                    text: piece,
                    logprobs: lp,
                } => {
                    text.push_str(&piece);
                    logprobs.extend(lp);
                }
                GenerationItem::Finished {
                    text: rest,
                    reason,
                    usage,
                } => {
                    text.push_str(&rest);
                    return Ok(Collected {
                        text,
                        logprobs,
                        reason,
                        usage,
                    });
                }
                GenerationItem::Failed(message) => return Err(message),
            }
        }
    }
}

/// A part of the answer, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutputEvent {
    Reasoning(String),
    Content(String),
    ToolCall(ParsedToolCall),
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Think {
    /// Not yet known whether the answer starts with `<think>`.
    Start,
    Inside,
    Done,
}

/// Splits generated text into [`OutputEvent`]s as it arrives.
#[derive(Debug)]
pub struct OutputParser {
    think: Think,
    held: String,
    tools: Option<ToolCallStream>,
    /// gpt-oss's channels, split before the rest (see [`HarmonyStream`]:
    /// other answers pass through it unchanged).
    harmony: Option<HarmonyStream>,
    /// Whether reasoning is reported (else a harmony `analysis` channel is
    /// dropped: it is never the answer).
    reasoning: bool,
}

/// How many bytes at the end of `text` could begin `marker`.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

impl OutputParser {
    /// `reasoning`: split `<think>` blocks off (else they stay in the text)
    /// and report harmony's `analysis` channel (else it is dropped);
    /// `tools`: parse calls in this syntax.
    pub fn new(reasoning: bool, tools: Option<ToolSyntax>) -> OutputParser {
        OutputParser {
            think: if reasoning { Think::Start } else { Think::Done },
            held: String::new(),
            tools: tools.map(ToolCallStream::new),
            harmony: Some(HarmonyStream::new()),
            reasoning,
        }
    }

    /// Feeds text; returns what can be released.
    pub fn push(&mut self, text: &str) -> Vec<OutputEvent> {
        let Some(harmony) = self.harmony.as_mut() else {
            return self.push_text(text);
        };
        let parts = harmony.push(text);
        self.harmony_events(parts)
    }

    /// The events of harmony parts: the answer's text goes on through the
    /// `<think>` and tool-call parsers.
    fn harmony_events(&mut self, parts: Vec<HarmonyEvent>) -> Vec<OutputEvent> {
        let mut events = Vec::new();
        for part in parts {
            match part {
                HarmonyEvent::Reasoning(r) if self.reasoning => {
                    events.push(OutputEvent::Reasoning(r))
                }
                HarmonyEvent::Reasoning(_) => {}
                HarmonyEvent::Content(c) => events.extend(self.push_text(&c)),
                HarmonyEvent::ToolCall(call) => events.push(OutputEvent::ToolCall(call)),
            }
        }
        events
    }

    /// Feeds text after the harmony split.
    fn push_text(&mut self, text: &str) -> Vec<OutputEvent> {
        let mut events = Vec::new();
        let mut rest = String::new();
        if self.think == Think::Done {
            rest.push_str(text);
        } else {
            self.held.push_str(text);
            if self.think == Think::Start {
                let trimmed = self.held.trim_start();
                if trimmed.starts_with(THINK_OPEN) {
                    let at = self.held.len() - trimmed.len() + THINK_OPEN.len();
                    self.held.drain(..at);
                    self.think = Think::Inside;
                } else if THINK_OPEN.starts_with(trimmed) {
                    return events;
                } else {
                    self.think = Think::Done;
                    rest = std::mem::take(&mut self.held);
                }
            }
            if self.think == Think::Inside {
                if let Some(end) = self.held.find(THINK_CLOSE) {
                    let reasoning: String = self.held.drain(..end).collect();
                    self.held.drain(..THINK_CLOSE.len());
                    if !reasoning.is_empty() {
                        events.push(OutputEvent::Reasoning(reasoning));
                    }
                    self.think = Think::Done;
                    rest = std::mem::take(&mut self.held).trim_start().to_string();
                } else {
                    let keep = partial_suffix(&self.held, THINK_CLOSE);
                    let cut = self.held.len() - keep;
                    if cut > 0 {
                        events.push(OutputEvent::Reasoning(self.held.drain(..cut).collect()));
                    }
                    return events;
                }
            }
        }
        self.content(&rest, &mut events);
        events
    }

    fn content(&mut self, text: &str, events: &mut Vec<OutputEvent>) {
        if text.is_empty() {
            return;
        }
        match self.tools.as_mut() {
            None => events.push(OutputEvent::Content(text.to_string())),
            Some(tools) => events.extend(tools.push(text).into_iter().map(convert)),
        }
    }

    /// The end of the answer: everything still held.
    pub fn finish(mut self) -> Vec<OutputEvent> {
        let mut events = match self.harmony.take() {
            Some(harmony) => self.harmony_events(harmony.finish()),
            None => Vec::new(),
        };
        let held = std::mem::take(&mut self.held);
        match self.think {
            // An unclosed `<think>` is all reasoning.
            Think::Inside if !held.is_empty() => events.push(OutputEvent::Reasoning(held)),
            Think::Start => self.content(&held, &mut events),
            _ => {}
        }
        if let Some(tools) = self.tools.take() {
            events.extend(tools.finish().into_iter().map(convert));
        }
        events
    }
}

fn convert(event: ToolStreamEvent) -> OutputEvent {
    match event {
        ToolStreamEvent::Content(text) => OutputEvent::Content(text),
        ToolStreamEvent::Call(call) => OutputEvent::ToolCall(call),
    }
}

/// A whole answer parsed: reasoning, text (trimmed when there are tool
/// calls) and calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedAnswer {
    pub reasoning: Option<String>,
    pub content: String,
    pub tool_calls: Vec<ParsedToolCall>,
}

/// Parses a whole answer.
pub fn parse_answer(text: &str, reasoning: bool, tools: Option<ToolSyntax>) -> ParsedAnswer {
    let mut parser = OutputParser::new(reasoning, tools);
    let mut events = parser.push(text);
    events.extend(parser.finish());
    let mut answer = ParsedAnswer::default();
    for event in events {
        match event {
            OutputEvent::Reasoning(r) => answer
                .reasoning
                .get_or_insert_with(String::new)
                .push_str(&r),
            OutputEvent::Content(c) => answer.content.push_str(&c),
            OutputEvent::ToolCall(call) => answer.tool_calls.push(call),
        }
    }
    if !answer.tool_calls.is_empty() {
        answer.content = answer.content.trim().to_string();
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn harmony_analysis_is_reasoning_and_function_messages_are_calls() {
        let text = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant\
            <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>";
        let answer = parse_answer(text, true, Some(ToolSyntax::Harmony));
        assert_eq!(answer.reasoning.as_deref(), Some("Need the weather."));
        assert_eq!(answer.content, "");
        assert_eq!(answer.tool_calls.len(), 1);
        assert_eq!(answer.tool_calls[0].name, "get_weather");
        assert_eq!(answer.tool_calls[0].arguments, r#"{"city":"Paris"}"#);
        let final_answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant\
            <|channel|>final<|message|>Paris.<|return|>";
        let answer = parse_answer(final_answer, true, None);
        assert_eq!(answer.reasoning.as_deref(), Some("Easy."));
        assert_eq!(answer.content, "Paris.");
        // Without reasoning, the analysis channel is not shown.
        let answer = parse_answer(final_answer, false, None);
        assert_eq!(
            (answer.reasoning, answer.content.as_str()),
            (None, "Paris.")
        );
    }

    #[test]
    fn reasoning_text_and_calls_split_at_every_boundary() {
        let text = "<think>\nplan it</think>\n\nSure.<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
        let whole = parse_answer(text, true, Some(ToolSyntax::Hermes));
        assert_eq!(whole.reasoning.as_deref(), Some("\nplan it"));
        assert_eq!(whole.content, "Sure.");
        assert_eq!(whole.tool_calls.len(), 1);
        for split in 1..text.len() {
            let mut parser = OutputParser::new(true, Some(ToolSyntax::Hermes));
            let mut events = parser.push(&text[..split]);
            events.extend(parser.push(&text[split..]));
            events.extend(parser.finish());
            let mut reasoning = String::new();
            let mut content = String::new();
            let mut calls = 0;
            for e in events {
                match e {
                    OutputEvent::Reasoning(r) => reasoning.push_str(&r),
                    OutputEvent::Content(c) => content.push_str(&c),
                    OutputEvent::ToolCall(_) => calls += 1,
                }
            }
            assert_eq!(reasoning, "\nplan it", "split {split}");
            assert_eq!(content.trim(), "Sure.", "split {split}");
            assert_eq!(calls, 1, "split {split}");
        }
    }

    #[test]
    fn without_reasoning_the_think_block_stays_text() {
        let answer = parse_answer("<think>x</think>y", false, None);
        assert_eq!(answer.content, "<think>x</think>y");
        assert_eq!(answer.reasoning, None);
        assert_eq!(parse_answer("plain", true, None).content, "plain");
    }
}
