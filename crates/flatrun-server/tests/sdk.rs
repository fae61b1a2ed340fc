//! Runs the official `openai` and `anthropic` Python SDKs
//! (`tests/sdk/test_sdk.py`) against an in-process server over the mock
//! model, with an API key set.
//!
//! The Python comes from `$FLATRUN_PYTHON` (default
//! `~/.cache/flatrun/venv/bin/python`, made by `scripts/setup-test-env.sh`).
//! Without it (or without the SDKs) the test prints a skip message, unless
//! `FLATRUN_REQUIRE_MODELS=1` (CI), where it fails.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{TestServer, config};
use flatrun_server::SchedulerConfig;
use flatrun_server::mock::MockConfig;

fn python() -> PathBuf {
    match std::env::var_os("FLATRUN_PYTHON") {
        Some(path) => PathBuf::from(path),
        None => {
            let home = std::env::var_os("HOME").unwrap_or_default();
            PathBuf::from(home).join(".cache/flatrun/venv/bin/python")
        }
    }
}

fn sdks_available(python: &PathBuf) -> bool {
    Command::new(python)
        .args(["-c", "import openai, anthropic"])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_sdks_against_the_mock_server() {
    let python = python();
    if !sdks_available(&python) {
        let message = format!(
            "{} cannot import openai and anthropic: run scripts/setup-test-env.sh",
            python.display()
        );
        if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
            panic!("{message}");
        }
        eprintln!("skipping: {message}");
        return;
    }
    let mut cfg = config();
    cfg.api_key = Some("sdk-test-key".to_string());
    cfg.max_body_bytes = 64 * 1024;
    let mock = MockConfig {
        context_length: 1024,
        ..MockConfig::default()
    };
    let server = TestServer::start(mock, SchedulerConfig::default(), cfg).await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/test_sdk.py");
    let base_url = format!("http://{}", server.addr);
    let output = tokio::task::spawn_blocking(move || {
        Command::new(&python)
            .arg(&script)
            .arg("-v")
            .env("FLATRUN_BASE_URL", base_url)
            .env("FLATRUN_SDK_MODEL", "mock")
            .env("FLATRUN_SDK_API_KEY", "sdk-test-key")
            .env("FLATRUN_SDK_CONTEXT", "1024")
            .env("FLATRUN_SDK_MAX_BODY", (64 * 1024).to_string())
            .env("FLATRUN_SDK_MOCK", "1")
            .output()
    })
    .await
    .expect("join")
    .expect("run python");
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("{}{stderr}", String::from_utf8_lossy(&output.stdout));
    assert!(output.status.success(), "the SDK tests failed (see above)");
    server.wait_all_freed().await;
}
