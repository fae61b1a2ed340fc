//! The model file changing under a running model (SmolLM2, a private copy):
//!
//! - `flatrun run`: the file truncated mid-generation → the run stops at the
//!   next step with "the model file changed" and exit status 1 (never
//!   SIGBUS); replaced by rename, or deleted → the run finishes normally
//!   from the original bytes (the mapping keeps the old inode).
//! - `flatrun serve`: replaced by rename, deleted → requests still answered;
//!   truncated with a stream in flight → that stream ends with an error
//!   event, later requests get a clear error, the process stays up (liveness
//!   probe 200) and exits cleanly on SIGTERM.

mod common;
#[path = "common/serve_process.rs"]
mod serve_process;

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{flatrun_path, smollm2};
use serve_process::ServeProcess;

/// A prompt SmolLM2 continues for as long as it is allowed to.
const COUNTING: &str = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,";

/// A private copy of the model in its own directory (removed on drop).
struct Copy {
    dir: PathBuf,
    path: PathBuf,
}

impl Copy {
    fn of(model: &Path, case: &str) -> Copy {
        let dir = std::env::temp_dir().join(format!(
            "flatrun-file-changes-{}-{case}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.gguf");
        std::fs::copy(model, &path).unwrap();
        Copy { dir, path }
    }

    fn len(&self) -> u64 {
        std::fs::metadata(&self.path).unwrap().len()
    }

    fn truncate(&self) {
        let len = self.len();
        File::options()
            .write(true)
            .open(&self.path)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
    }

    /// Another file renamed over the path, as a download tool finishing does.
    fn replace(&self) {
        let other = self.dir.join("model.gguf.partial");
        std::fs::write(&other, b"not a model any more").unwrap();
        std::fs::rename(&other, &self.path).unwrap();
    }

    fn delete(&self) {
        std::fs::remove_file(&self.path).unwrap();
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `flatrun run` on the copy; `change` runs once the first tokens are out.
fn run_while(
    copy: &Copy,
    max_new: usize,
    change: fn(&Copy),
) -> (std::process::ExitStatus, String, String) {
    let mut child = Command::new(flatrun_path())
        .env_remove("RUST_BACKTRACE")
        .arg("run")
        .arg("--model")
        .arg(&copy.path)
        .args(["--prompt", COUNTING, "--max-new", &max_new.to_string()])
        .args(["--ctx", "2048", "-q"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut text = vec![0u8; 16];
    stdout
        .read_exact(&mut text)
        .expect("the run starts generating");
    change(copy);
    stdout.read_to_end(&mut text).unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    (status, String::from_utf8_lossy(&text).into_owned(), stderr)
}

#[test]
#[cfg_attr(debug_assertions, ignore = "real model: run in release")]
fn run_survives_replacement_and_deletion_and_stops_on_truncation() {
    let Some(model) = smollm2() else { return };

    let copy = Copy::of(&model, "run-truncate");
    let (status, text, stderr) = run_while(&copy, 1500, Copy::truncate);
    assert_eq!(status.signal(), None, "killed by a signal: {stderr}");
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the model file changed"), "{stderr}");
    assert!(stderr.contains("truncated while in use"), "{stderr}");
    eprintln!(
        "truncated: stopped after {} bytes of text: {}",
        text.len(),
        stderr.trim()
    );

    for (case, change) in [
        ("run-replace", Copy::replace as fn(&Copy)),
        ("run-delete", Copy::delete),
    ] {
        let copy = Copy::of(&model, case);
        let (status, text, stderr) = run_while(&copy, 200, change);
        assert!(status.success(), "{case}: {status:?}: {stderr}");
        assert!(text.len() > 100, "{case}: {text}");
    }
}

/// One HTTP/1.1 exchange; returns the status and the body as text.
fn post(address: &str, path: &str, body: &str) -> (u16, String) {
    let mut socket = TcpStream::connect(address).unwrap();
    write!(
        socket,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).unwrap();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, response)
}

fn completion(max_tokens: usize, stream: bool) -> String {
    serde_json::json!({
        "prompt": COUNTING,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
    .to_string()
}

#[test]
#[cfg_attr(debug_assertions, ignore = "real model: run in release")]
fn serve_survives_replacement_deletion_and_truncation() {
    let Some(model) = smollm2() else { return };
    let copy = Copy::of(&model, "serve");
    let server = ServeProcess::start(&copy.path, &["--ctx", "2048", "-q"], &[]);
    server.wait_healthy();
    let address = server.address.clone();
    let (status, first) = post(&address, "/v1/completions", &completion(16, false));
    assert_eq!(status, 200, "{first}");

    // Renamed over, then deleted: the mapping keeps the original inode.
    copy.replace();
    let (status, body) = post(&address, "/v1/completions", &completion(16, false));
    assert_eq!(status, 200, "after replacement: {body}");
    copy.delete();
    let (status, body) = post(&address, "/v1/completions", &completion(16, false));
    assert_eq!(status, 200, "after deletion: {body}");

    // A second server on a fresh copy, truncated with a stream in flight.
    drop(server);
    let copy = Copy::of(&model, "serve-truncate");
    let mut server = ServeProcess::start(&copy.path, &["--ctx", "2048", "-q"], &[]);
    server.wait_healthy();
    let address = server.address.clone();
    let mut socket = TcpStream::connect(&address).unwrap();
    let body = completion(1500, true);
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let mut reader = BufReader::new(socket);
    let mut events = 0;
    let mut line = String::new();
    while events < 5 {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "stream ended early"
        );
        events += usize::from(line.starts_with("data: {"));
    }
    copy.truncate();
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    assert!(
        rest.contains("the model file changed"),
        "the stream ends with the error: {rest}"
    );
    assert!(
        !rest.contains("data: [DONE]") || rest.contains("error"),
        "{rest}"
    );

    let (status, body) = post(&address, "/v1/completions", &completion(16, false));
    assert!(status >= 500, "{body}");
    assert!(body.contains("the model file changed"), "{body}");
    assert_eq!(server.get_status("/health/live"), Some(200));
    let status = server.terminate();
    assert!(status.success(), "{status:?}");
}
