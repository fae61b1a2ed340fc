//! A `flatrun serve` child process for the server tests (`serve.rs`,
//! `serve_load.rs`): started on a free loopback port, killed on drop.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A running `flatrun serve`.
pub struct ServeProcess {
    child: Child,
    /// `host:port` it listens on.
    pub address: String,
}

impl ServeProcess {
    /// `flatrun serve --model MODEL --port 0 ARGS...` with `envs` set; its
    /// stderr is echoed with a `[serve]` prefix.
    pub fn start(model: &Path, args: &[&str], envs: &[(&str, &str)]) -> ServeProcess {
        let mut child = Command::new(crate::common::flatrun_path())
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0"])
            .args(args)
            .envs(envs.iter().copied())
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn flatrun serve");
        // The first stderr line names the bound address; keep draining the rest.
        let stderr = child.stderr.take().expect("stderr");
        let mut lines = BufReader::new(stderr).lines();
        let first = lines.next().and_then(|l| l.ok()).unwrap_or_default();
        let address = first
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in `{first}`"))
            .to_string();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                eprintln!("[serve] {line}");
            }
        });
        ServeProcess { child, address }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Status code of a GET, or `None` when the connection fails.
    pub fn get_status(&self, path: &str) -> Option<u16> {
        let mut socket = TcpStream::connect(&self.address).ok()?;
        write!(
            socket,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut response = String::new();
        socket.read_to_string(&mut response).ok()?;
        response.split_whitespace().nth(1)?.parse().ok()
    }

    /// Waits for `/health` 200; returns whether it answered 503 (loading)
    /// before.
    pub fn wait_healthy(&self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut saw_loading = false;
        loop {
            match self.get_status("/health") {
                Some(200) => return saw_loading,
                Some(503) => saw_loading = true,
                None => {}
                Some(other) => panic!("/health answered {other}"),
            }
            assert!(Instant::now() < deadline, "the server never became healthy");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn terminate(&mut self) -> ExitStatus {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "flatrun serve did not stop on SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
