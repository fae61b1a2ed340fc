//! Requests longer than the context (`--context-overflow`): the chat
//! prompt without its oldest turns, a token prompt without its oldest
//! tokens, and the system prompt's length that both keep.

use crate::config::ContextOverflow;
use crate::engine::{Engine, EngineError, GenerationRequest};
use crate::prefix_cache::common_prefix;
use flatrun_model::chat_template::ChatMessage;

/// A chat's prompt tokens and how many of them are its system prompt.
#[derive(Debug)]
pub struct ChatPrompt {
    pub tokens: Vec<u32>,
    /// Leading tokens shared with the system messages alone (what overflow
    /// handling keeps); 0 when the mode is `error`.
    pub keep: usize,
}

/// Room the prompt of a request gets under `truncate-middle`: the context
/// less `max_tokens` (a quarter of the context when the request does not
/// say).
pub fn prompt_room(context: usize, max_tokens: Option<u64>) -> usize {
    let answer = max_tokens.map_or(context / 4, |n| n.min(context as u64) as usize);
    context - answer
}

fn is_system(message: &ChatMessage) -> bool {
    matches!(message.role.as_str(), "system" | "developer")
}

/// The prompt of `messages` (with `tools`; `continuing` a final assistant
/// message, as [`Engine::encode_chat_tools`]). Under `truncate-middle`, when
/// it does not fit `room` tokens, the oldest turns after the system
/// messages go (whole turns: a kept conversation starts with a user
/// message), never the last message; if it still does not fit, the caller
/// refuses it or cuts tokens.
pub fn chat_prompt(
    engine: &dyn Engine,
    mode: ContextOverflow,
    messages: &[ChatMessage],
    tools: Option<&serde_json::Value>,
    continuing: bool,
    room: usize,
) -> Result<ChatPrompt, EngineError> {
    let mut tokens = engine.encode_chat_tools(messages, tools, continuing)?;
    if mode == ContextOverflow::Error {
        return Ok(ChatPrompt { tokens, keep: 0 });
    }
    let system = messages.iter().take_while(|m| is_system(m)).count();
    if mode == ContextOverflow::TruncateMiddle && tokens.len() > room {
        let mut kept = messages.to_vec();
        while tokens.len() > room && kept.len() > system + 1 {
            kept.remove(system);
            while kept.len() > system + 1 && kept[system].role != "user" {
                kept.remove(system);
            }
            tokens = engine.encode_chat_tools(&kept, tools, continuing)?;
        }
    }
    // (A template that cannot render without a user message keeps nothing.)
    let head = engine
        .encode_chat_tools(&messages[..system], tools, false)
        .unwrap_or_default();
    let keep = common_prefix(&head, &tokens);
    Ok(ChatPrompt { tokens, keep })
}

/// Applies `mode` to a request's token prompt: under `truncate-middle` a
/// prompt without room for `max_tokens` loses tokens after its first
/// `request.keep`; under `shift` the request shifts, and a prompt that
/// fills the context loses half of what follows its first `keep` tokens.
pub fn fit_prompt(
    request: &mut GenerationRequest,
    mode: ContextOverflow,
    context: usize,
    max_tokens: Option<u64>,
) {
    let keep = request.keep;
    match mode {
        ContextOverflow::Error => {}
        ContextOverflow::TruncateMiddle => {
            cut_middle(&mut request.prompt, keep, prompt_room(context, max_tokens));
        }
        ContextOverflow::Shift => {
            request.shift = true;
            if request.prompt.len() >= context {
                let keep = keep.min(context / 2);
                cut_middle(&mut request.prompt, keep, keep + (context - keep) / 2);
            }
        }
    }
}

/// Drops tokens right after the first `keep` until `tokens` has at most
/// `target` (never fewer than `keep` are left).
pub fn cut_middle(tokens: &mut Vec<u32>, keep: usize, target: usize) {
    let keep = keep.min(tokens.len());
    let excess = tokens.len().saturating_sub(target.max(keep));
    tokens.drain(keep..keep + excess.min(tokens.len() - keep));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_keeps_the_head_and_the_newest_tokens() {
        let mut t: Vec<u32> = (0..10).collect();
        cut_middle(&mut t, 2, 6);
        assert_eq!(t, [0, 1, 6, 7, 8, 9]);
        let mut t: Vec<u32> = (0..4).collect();
        cut_middle(&mut t, 3, 1);
        assert_eq!(t, [0, 1, 2]);
        assert_eq!(prompt_room(100, Some(30)), 70);
        assert_eq!(prompt_room(100, None), 75);
        assert_eq!(prompt_room(100, Some(500)), 0);
    }
}
