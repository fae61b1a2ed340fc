//! `flatrun chat` in a real terminal: tmux runs it, `send-keys` types and
//! `capture-pane` reads the screen. Covers a turn with history, a second
//! turn that prefills only its new tokens (the KV cache is kept), `/stats`,
//! multi-line input, Ctrl-C stopping an answer without leaving, `/reset`,
//! `exit` and Ctrl-D. Skips when tmux is missing (scripts/setup-test-env.sh
//! installs it), unless FLATRUN_REQUIRE_MODELS=1.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A tmux server of our own (its own socket), with one session running a command.
struct Tmux {
    socket: String,
    session: String,
}

impl Tmux {
    fn start(name: &str, command: &str) -> Tmux {
        let tmux = Tmux {
            socket: format!("flatrun-test-{}-{name}", std::process::id()),
            session: name.to_string(),
        };
        let ok = Command::new("tmux")
            .args([
                "-L",
                &tmux.socket,
                "new-session",
                "-d",
                "-s",
                name,
                "-x",
                "160",
                "-y",
                "50",
                command,
            ])
            .status()
            .expect("run tmux")
            .success();
        assert!(ok, "tmux new-session failed");
        // Keep the pane after the command exits, to see how it ended.
        let _ = Command::new("tmux")
            .args([
                "-L",
                &tmux.socket,
                "set-option",
                "-t",
                name,
                "remain-on-exit",
                "on",
            ])
            .status();
        tmux
    }

    fn send(&self, keys: &[&str]) {
        let status = Command::new("tmux")
            .args(["-L", &self.socket, "send-keys", "-t", &self.session])
            .args(keys)
            .status()
            .expect("tmux send-keys");
        assert!(status.success());
    }

    /// Type `text` literally, then Enter.
    fn line(&self, text: &str) {
        self.send(&["-l", text]);
        self.send(&["Enter"]);
    }

    fn screen(&self) -> String {
        let out = Command::new("tmux")
            .args([
                "-L",
                &self.socket,
                "capture-pane",
                "-p",
                "-J",
                "-S",
                "-200",
                "-t",
                &self.session,
            ])
            .output()
            .expect("tmux capture-pane");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn pane_dead(&self) -> bool {
        let out = Command::new("tmux")
            .args([
                "-L",
                &self.socket,
                "display-message",
                "-p",
                "-t",
                &self.session,
                "#{pane_dead}",
            ])
            .output()
            .expect("tmux display-message");
        String::from_utf8_lossy(&out.stdout).trim() == "1"
    }

    /// Wait until `ready(screen)` holds (panics with the screen after `secs`).
    fn wait_for(&self, what: &str, secs: u64, ready: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let screen = self.screen();
            if ready(&screen) {
                return screen;
            }
            if Instant::now() > deadline {
                panic!("timed out waiting for {what}; screen:\n{screen}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn wait_dead(&self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.pane_dead() {
            if Instant::now() > deadline {
                panic!("{what}: chat did not exit; screen:\n{}", self.screen());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["-L", &self.socket, "kill-server"])
            .status();
    }
}

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

fn tmux_available() -> bool {
    if Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return true;
    }
    if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("tmux is missing: run scripts/setup-test-env.sh");
    }
    eprintln!("skipping: tmux is missing (run scripts/setup-test-env.sh)");
    false
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
