//! Rendering arbitrary chat templates with arbitrary messages: must never
//! panic, hang or grow without bound (fuel, recursion, output, string,
//! sequence and total-bytes limits, captured blocks and macro output).
#![no_main]

use flatrun_model::chat_template::{ChatMessage, ChatTemplate, TemplateLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    // Template source, then messages separated by NUL: "role\u{1}content".
    let mut parts = text.split('\0');
    let source = parts.next().unwrap_or_default();
    let messages: Vec<ChatMessage> = parts
        .map(|m| {
            let (role, content) = m.split_once('\u{1}').unwrap_or(("user", m));
            ChatMessage::new(role, content)
        })
        .collect();
    let limits = TemplateLimits {
        fuel: 50_000,
        recursion: 32,
        max_output_bytes: 1 << 16,
        max_string_bytes: 1 << 16,
        max_items: 1 << 12,
        max_total_bytes: 1 << 20,
    };
    if let Ok(template) = ChatTemplate::from_source("fuzz", source) {
        let template = template.with_limits(limits);
        if let Ok(out) = template.render(&messages, data.len() % 2 == 0, "<s>", "</s>") {
            assert!(out.len() <= limits.max_output_bytes);
        }
    }
});
