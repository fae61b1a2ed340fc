//! `flatrun chat` in a real terminal: tmux runs it, `send-keys` types and
//! `capture-pane` reads the screen. Covers a turn with history, a second
//! turn that prefills only its new tokens (the KV cache is kept), `/stats`,
//! multi-line input, Ctrl-C stopping an answer without leaving, `/reset`,
//! `exit` and Ctrl-D. Skips when tmux is missing (scripts/setup-test-env.sh
//! installs it), unless FLATRUN_REQUIRE_MODELS=1.

mod common;
#[path = "common/tmux.rs"]
mod tmux;

use std::path::Path;
use std::time::Duration;
use tmux::{Tmux, tmux_available};

fn prompts(screen: &str) -> usize {
    screen.lines().filter(|l| l.starts_with(">>> ")).count()
        + screen.lines().filter(|l| l.trim_end() == ">>>").count()
}

/// `(prefilled, reused)` from the last `/stats` line `last turn: prefilled P tok, reused R cached tok`.
fn last_turn_counts(screen: &str) -> (usize, usize) {
    let line = screen
        .lines()
        .rev()
        .find(|l| l.starts_with("last turn: prefilled "))
        .unwrap_or_else(|| panic!("no `last turn` line:\n{screen}"));
    let numbers: Vec<usize> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(numbers.len(), 2, "{line}");
    (numbers[0], numbers[1])
}

fn chat_command(model: &Path, max_new: usize) -> String {
    format!(
        "{} chat --model '{}' --max-new {max_new} --ctx 2048",
        common::flatrun_path().display(),
        model.display()
    )
}

#[test]
fn chat_session_in_a_terminal() {
    let Some(model) = common::smollm2() else {
        return;
    };
    if !tmux_available() {
        return;
    }
    let tmux = Tmux::start("chat", &chat_command(&model, 200));
    tmux.wait_for("the first prompt", 120, |s| {
        prompts(s) >= 1 && s.contains("loaded in")
    });

    // A turn: the answer appears and a new prompt follows.
    tmux.line("What is the capital of France? Answer in one word.");
    let screen = tmux.wait_for("the answer", 120, |s| prompts(s) >= 2);
    assert!(screen.contains("Answer in one word."), "{screen}");

    // /stats reports the turn.
    tmux.line("/stats");
    tmux.wait_for("/stats", 20, |s| s.contains("turns 1") && prompts(s) >= 3);

    // Turn 2 reuses the KV cache: only the new tokens are prefilled.
    tmux.line("And of Germany?");
    tmux.wait_for("the second answer", 120, |s| prompts(s) >= 4);
    tmux.line("/stats");
    let screen = tmux.wait_for("/stats after turn 2", 20, |s| {
        s.contains("turns 2") && prompts(s) >= 5
    });
    let (prefilled, reused) = last_turn_counts(&screen);
    assert!(
        reused > 0 && prefilled < reused && prefilled <= 40,
        "turn 2 should prefill only its new tokens (prefilled {prefilled}, reused {reused}):\n{screen}"
    );

    // Multi-line input: a trailing backslash continues the line.
    tmux.line("Repeat after me: one \\");
    tmux.wait_for("the continuation prompt", 20, |s| {
        s.lines().any(|l| l.starts_with("... "))
    });
    tmux.line("two");
    tmux.wait_for("the multi-line answer", 120, |s| prompts(s) >= 6);

    // A """ block.
    tmux.line("\"\"\"Say hello");
    tmux.line("to me\"\"\"");
    tmux.wait_for("the block answer", 120, |s| prompts(s) >= 7);

    // Ctrl-C stops a long answer and keeps the session.
    tmux.line("Write a very long story about a dragon who learns to cook, with many chapters.");
    std::thread::sleep(Duration::from_millis(300));
    tmux.send(&["C-c"]);
    let screen = tmux.wait_for("the stopped answer", 120, |s| {
        prompts(s) >= 8 && s.contains("[stopped]")
    });
    assert!(!tmux.pane_dead(), "Ctrl-C ended the session:\n{screen}");

    // /reset forgets the conversation.
    tmux.line("/reset");
    tmux.wait_for("/reset", 20, |s| s.contains("(conversation cleared)"));
    tmux.line("/stats");
    let screen = tmux.wait_for("history after /reset", 20, |s| {
        s.contains("history 0 messages")
    });
    assert!(screen.contains("cached 0 of 2048 tokens"), "{screen}");

    // `exit` leaves.
    tmux.line("exit");
    tmux.wait_dead("exit");
}

#[test]
fn chat_leaves_on_ctrl_d() {
    let Some(model) = common::smollm2() else {
        return;
    };
    if !tmux_available() {
        return;
    }
    let tmux = Tmux::start("chatd", &chat_command(&model, 8));
    tmux.wait_for("the first prompt", 120, |s| prompts(s) >= 1);
    tmux.send(&["C-d"]);
    tmux.wait_dead("Ctrl-D");
}
