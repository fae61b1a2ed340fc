//! `flatrun serve` on SmolLM2: the official `openai` and `anthropic` Python
//! SDK tests of the server crate (`crates/flatrun-server/tests/sdk/test_sdk.py`)
//! against the real runtime, including "the greedy answer equals
//! `flatrun run --chat` with the same prompt"; then a clean SIGTERM shutdown.

mod common;
#[path = "common/serve_process.rs"]
mod serve_process;

use std::path::PathBuf;
use std::process::Command;

use common::{flatrun, python_with, smollm2, stderr_of, stdout_of};
use serve_process::ServeProcess;

const API_KEY: &str = "serve-test-key";
const CONTEXT: usize = 1024;
const MAX_BODY: usize = 64 * 1024;
const GREEDY_PROMPT: &str = "What is the capital of France?";
const GREEDY_MAX: usize = 24;

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

    let (context, max_body) = (CONTEXT.to_string(), MAX_BODY.to_string());
    let mut server = ServeProcess::start(
        &model,
        &[
            "--api-key",
            API_KEY,
            "--max-body",
            &max_body,
            "--ctx",
            &context,
            "--max-seqs",
            "4",
            "-q",
        ],
        &[],
    );
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
