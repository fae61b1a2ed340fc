//! A conversation longer than the context: refused, or cut in the middle
//! (the system prompt and the newest turns kept).

mod common;

use flatrun_runtime::{ChatMessage, ContextOverflow, LoadOptions, Model, RuntimeError};

#[test]
fn long_conversations_are_refused_or_cut_in_the_middle() {
    let Some(path) = common::model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let model = Model::load(&path, LoadOptions::default()).expect("load");
    let mut messages = vec![ChatMessage::new("system", "You are terse.".to_string())];
    for i in 0..12 {
        messages.push(ChatMessage::new(
            "user",
            format!("Question {i}: what is {i} plus {i}?"),
        ));
        messages.push(ChatMessage::new("assistant", format!("{}", 2 * i)));
    }
    messages.push(ChatMessage::new("user", "And the last one?".to_string()));
    let (_, all, dropped) = model
        .fit_conversation(&messages, usize::MAX, ContextOverflow::Error)
        .unwrap();
    assert_eq!(dropped, 0);
    let room = all.len() / 2;
    assert!(matches!(
        model.fit_conversation(&messages, room, ContextOverflow::Error),
        Err(RuntimeError::ContextOverflow { .. })
    ));
    let (kept, tokens, dropped) = model
        .fit_conversation(&messages, room, ContextOverflow::TruncateMiddle)
        .unwrap();
    assert!(tokens.len() <= room && dropped > 0);
    assert_eq!(kept.len() + dropped, messages.len());
    assert_eq!(kept.first().unwrap().role, "system");
    assert_eq!(kept.last().unwrap().content, "And the last one?");
    // The newest turns are the ones kept.
    assert_eq!(kept[kept.len() - 2].content, "22");
    // Too little room even for the system prompt and the last message.
    assert!(
        model
            .fit_conversation(&messages, 5, ContextOverflow::TruncateMiddle)
            .is_err()
    );
}
