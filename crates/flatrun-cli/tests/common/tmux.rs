//! A tmux server of the tests' own for CLI tests in a real terminal:
//! `new-session -d` runs a command, `send-keys` types, `capture-pane` reads
//! the screen.
#![allow(dead_code)]

use std::process::Command;
use std::time::{Duration, Instant};

/// A tmux server of our own (its own socket), with one session running a command.
pub struct Tmux {
    socket: String,
    session: String,
}

impl Tmux {
    pub fn start(name: &str, command: &str) -> Tmux {
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

    pub fn send(&self, keys: &[&str]) {
        let status = Command::new("tmux")
            .args(["-L", &self.socket, "send-keys", "-t", &self.session])
            .args(keys)
            .status()
            .expect("tmux send-keys");
        assert!(status.success());
    }

    /// Type `text` literally, then Enter.
    pub fn line(&self, text: &str) {
        self.send(&["-l", text]);
        self.send(&["Enter"]);
    }

    pub fn screen(&self) -> String {
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

    pub fn pane_dead(&self) -> bool {
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
    pub fn wait_for(&self, what: &str, secs: u64, ready: impl Fn(&str) -> bool) -> String {
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

    pub fn wait_dead(&self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.pane_dead() {
            if Instant::now() > deadline {
                panic!(
                    "{what}: the command did not exit; screen:\n{}",
                    self.screen()
                );
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

/// Whether tmux runs here (skip otherwise, or fail under FLATRUN_REQUIRE_MODELS=1).
pub fn tmux_available() -> bool {
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
