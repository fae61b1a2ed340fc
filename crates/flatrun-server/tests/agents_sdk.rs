//! The official `openai` and `anthropic` Python SDKs against the real
//! server on Qwen2.5-Coder-0.5B-Instruct (`tests/sdk/test_agents.py`): tool
//! loops in both APIs, forced calls and `json_schema` output validated on
//! 50 seeded tries each, logprobs against llama.cpp's
//! (`tests/data/logprobs_qwen05b.json`), the sampling fields' effects.
//!
//! Needs `$FLATRUN_MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf` and the
//! venv of `scripts/setup-test-env.sh` (`$FLATRUN_PYTHON`); skipped without
//! them unless FLATRUN_REQUIRE_MODELS=1. The default (release) run takes
//! the tool loops of both APIs, streamed and not, and the logprobs against
//! llama.cpp's (a couple of minutes); the whole suite, with its 50-try
//! checks, is on demand (about 20 minutes on a busy 2-core machine):
//! `cargo test --release -p flatrun-server --test agents_sdk -- --ignored`.

#![cfg(feature = "runtime")]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use common::config;
use flatrun_runtime::{LoadOptions, Model};
use flatrun_server::{SchedulerConfig, Server};

const MODEL: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

fn required() -> bool {
    std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1")
}

fn skip(why: String) {
    if required() {
        panic!("{why} and FLATRUN_REQUIRE_MODELS=1");
    }
    eprintln!("skipping: {why}");
}

fn python() -> PathBuf {
    match std::env::var_os("FLATRUN_PYTHON") {
        Some(path) => PathBuf::from(path),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/flatrun/venv/bin/python"),
    }
}

#[test]
#[ignore = "about 20 minutes (50-try checks on a real model): run on demand with --ignored"]
fn official_sdks_drive_agents_on_qwen() {
    run_agent_tests(&[]);
}

/// The part of the suite in every (release) run: tool loops and logprobs.
#[test]
#[cfg_attr(debug_assertions, ignore = "real model: run in release")]
fn official_sdks_tool_loops_on_qwen() {
    run_agent_tests(&[
        "test_tool_loop",
        "test_completion_logprobs_match_llama_cpp",
        "test_echo_scores",
        "test_embeddings_through",
    ]);
}

/// Runs `tests/sdk/test_agents.py` (only the tests whose names contain one
/// of `only`, when given) against the server on the real model.
fn run_agent_tests(only: &[&'static str]) {
    let Some(dir) = std::env::var_os("FLATRUN_MODELS") else {
        return skip(format!(
            "FLATRUN_MODELS is not set (it should hold {MODEL})"
        ));
    };
    let path = PathBuf::from(dir).join(MODEL);
    if !path.is_file() {
        return skip(format!("{} not found", path.display()));
    }
    let python = python();
    let sdks = Command::new(&python)
        .args(["-c", "import openai, anthropic, jsonschema"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !sdks {
        return skip(format!(
            "{} cannot import openai, anthropic and jsonschema: run scripts/setup-test-env.sh",
            python.display()
        ));
    }
    let options = LoadOptions {
        ctx: Some(2048),
        ..LoadOptions::default()
    };
    let model = Model::load(&path, options).expect("load Qwen2.5-Coder-0.5B");
    let scheduler = SchedulerConfig {
        max_seqs: 25,
        max_queue: 64,
        ..SchedulerConfig::default()
    };
    let engine = flatrun_server::runtime::engine(model, scheduler).expect("engine");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio");
    runtime.block_on(async move {
        let server = Server::bind(config()).await.expect("bind");
        let addr = server.local_addr().expect("addr");
        server.engine_slot().set(Arc::new(engine));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(server.run_until(async move {
            let _ = stopped.await;
        }));
        let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let script = manifest.join("tests/sdk/test_agents.py");
        let golden = manifest.join("tests/data/logprobs_qwen05b.json");
        let only = only.to_vec();
        let output = tokio::task::spawn_blocking(move || {
            Command::new(&python)
                .arg(&script)
                .arg("-v")
                .args(only.iter().flat_map(|pattern| ["-k", pattern]))
                .env("FLATRUN_BASE_URL", format!("http://{addr}"))
                .env("FLATRUN_SDK_MODEL", MODEL.trim_end_matches(".gguf"))
                .env("FLATRUN_LOGPROB_GOLDEN", golden)
                .output()
        })
        .await
        .expect("join")
        .expect("run python");
        eprintln!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let _ = stop.send(());
        let _ = serving.await;
        assert!(
            output.status.success(),
            "the agent SDK tests failed (see above)"
        );
    });
}
