//! `flatrun serve` on SmolLM2: the official `openai` and `anthropic` Python
//! SDK tests of the server crate (`crates/flatrun-server/tests/sdk/test_sdk.py`)
//! against the real runtime, including "the greedy answer equals
//! `flatrun run --chat` with the same prompt"; then a clean SIGTERM shutdown.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{flatrun, flatrun_path, python_with, smollm2, stderr_of, stdout_of};

const API_KEY: &str = "serve-test-key";
const CONTEXT: usize = 1024;
const MAX_BODY: usize = 64 * 1024;
const GREEDY_PROMPT: &str = "What is the capital of France?";
const GREEDY_MAX: usize = 24;

/// A running `flatrun serve`, killed on drop.
struct Server {
    child: Child,
    address: String,
}

impl Server {
    fn start(model: &PathBuf) -> Server {
        let mut child = Command::new(flatrun_path())
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args([
                "--port",
                "0",
                "--api-key",
                API_KEY,
                "--max-body",
                &MAX_BODY.to_string(),
            ])
            .args(["--ctx", &CONTEXT.to_string(), "--max-seqs", "4", "-q"])
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
        Server { child, address }
    }

    /// Status code of a GET.
    fn get_status(&self, path: &str) -> Option<u16> {
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

    fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            match self.get_status("/health") {
                Some(200) => return,
                // 503 while loading.
                Some(503) | None if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                other => panic!("/health answered {other:?}"),
            }
        }
    }

    fn terminate(&mut self) -> std::process::ExitStatus {
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
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn official_sdks_against_flatrun_serve() {
    let Some(model) = smollm2() else { return };
    let Some(python) = python_with("openai, anthropic") else {
        return;
    };

    // The reference: `flatrun run --chat` with the same prompt, greedy.
    let reference = flatrun()
        .arg("run")
        .arg("--model")
        .arg(&model)
        .args([
            "--chat",
            "-q",
            "--ctx",
            &CONTEXT.to_string(),
            "--max-new",
            &GREEDY_MAX.to_string(),
        ])
        .args(["--prompt", GREEDY_PROMPT])
        .output()
        .unwrap();
    assert!(reference.status.success(), "{}", stderr_of(&reference));
    let expected = stdout_of(&reference);
    let expected = expected.strip_suffix('\n').unwrap_or(&expected).to_string();
    assert!(!expected.is_empty());

    let mut server = Server::start(&model);
    server.wait_healthy();
    let name = model
        .file_name()
        .unwrap()
        .to_string_lossy()
        .trim_end_matches(".gguf")
        .to_string();
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../flatrun-server/tests/sdk/test_sdk.py");
    let output = Command::new(&python)
        .arg(&script)
        .arg("-v")
        .env("FLATRUN_BASE_URL", format!("http://{}", server.address))
        .env("FLATRUN_SDK_MODEL", &name)
        .env("FLATRUN_SDK_API_KEY", API_KEY)
        .env("FLATRUN_SDK_CONTEXT", CONTEXT.to_string())
        .env("FLATRUN_SDK_MAX_BODY", MAX_BODY.to_string())
        .env("FLATRUN_SDK_GREEDY_PROMPT", GREEDY_PROMPT)
        .env("FLATRUN_SDK_GREEDY_EXPECTED", &expected)
        .env("FLATRUN_SDK_GREEDY_MAX", GREEDY_MAX.to_string())
        .output()
        .expect("run the SDK tests");
    let report = format!("{}{}", stdout_of(&output), stderr_of(&output));
    eprintln!("{report}");
    assert!(
        output.status.success(),
        "the SDK tests failed against flatrun serve (see above)"
    );
    assert!(
        report.lines().any(
            |l| l.starts_with("test_greedy_answer_matches_the_reference") && l.ends_with("... ok")
        ),
        "the greedy check did not run"
    );

    // SIGTERM: a clean, successful exit.
    let status = server.terminate();
    assert!(status.success(), "flatrun serve exited with {status}");
}

#[test]
fn serve_reports_a_busy_port() {
    let Some(model) = smollm2() else { return };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let out = flatrun()
        .arg("serve")
        .arg("--model")
        .arg(&model)
        .args(["--port", &port])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr_of(&out).contains("--port"), "{}", stderr_of(&out));
}
