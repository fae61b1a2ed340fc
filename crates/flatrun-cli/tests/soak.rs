//! The short server soak on SmolLM2 (`scripts/soak.py`, bounded to about two
//! minutes): 16 concurrent streaming clients mixing OpenAI chat, completions
//! and Anthropic messages, 10% of requests hanging up mid-stream and 5%
//! malformed or oversized; no 5xx, every completed stream equal to the greedy
//! reference, every slot freed, RSS flat. `scripts/soak.sh` runs the
//! 30-minute version. Figures: `-- --nocapture`.

mod common;
#[path = "common/serve_process.rs"]
mod serve_process;

use std::path::PathBuf;
use std::process::Command;

use common::{python_with, smollm2, stderr_of, stdout_of};
use serve_process::ServeProcess;

const API_KEY: &str = "soak-test-key";

#[test]
#[cfg_attr(debug_assertions, ignore = "real model: run in release")]
fn short_soak() {
    let Some(model) = smollm2() else { return };
    let Some(python) = python_with("json, http.client") else {
        return;
    };
    let seconds = std::env::var("FLATRUN_SOAK_SECONDS").unwrap_or_else(|_| "120".into());
    let server = ServeProcess::start(
        &model,
        &[
            "--ctx",
            "1024",
            "-q",
            "--max-seqs",
            "16",
            "--max-queue",
            "64",
            "--max-body",
            "256K",
            "--api-key",
            API_KEY,
        ],
        &[],
    );
    server.wait_healthy();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/soak.py");
    let output = Command::new(python)
        .arg(script)
        .args(["--url", &format!("http://{}", server.address)])
        .args(["--pid", &server.pid().to_string()])
        .args(["--api-key", API_KEY, "--max-body", "262144"])
        .args([
            "--clients",
            "16",
            "--requests",
            "200",
            "--duration",
            &seconds,
        ])
        .output()
        .unwrap();
    eprintln!("{}", stdout_of(&output));
    assert!(
        output.status.success(),
        "soak failed:\n{}\n{}",
        stdout_of(&output),
        stderr_of(&output)
    );
}
