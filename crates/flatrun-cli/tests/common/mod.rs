//! Helpers of the `flatrun` integration tests: the binary, and the real
//! models under the FLATRUN_REQUIRE_MODELS rule.
#![allow(dead_code)]

use std::path::PathBuf;

/// The built `flatrun` binary.
pub fn flatrun() -> assert_cmd::Command {
    let mut cmd = assert_cmd::Command::cargo_bin("flatrun").expect("flatrun binary");
    cmd.env_remove("RUST_BACKTRACE");
    cmd
}

/// Path of the built binary (for tests that spawn it themselves).
pub fn flatrun_path() -> PathBuf {
    assert_cmd::cargo::cargo_bin("flatrun")
}

fn models_dir() -> PathBuf {
    std::env::var_os("FLATRUN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/models")
        })
}

fn required() -> bool {
    std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1")
}

/// A real model, or `None` (after a skip message) when it is missing and
/// FLATRUN_REQUIRE_MODELS is not 1.
pub fn model(name: &str) -> Option<PathBuf> {
    let path = models_dir().join(name);
    if path.is_file() {
        return Some(path);
    }
    if required() {
        panic!(
            "model {} is missing and FLATRUN_REQUIRE_MODELS=1",
            path.display()
        );
    }
    eprintln!(
        "skipping: model {} not found (set FLATRUN_MODELS)",
        path.display()
    );
    None
}

/// SmolLM2-135M, the small model the command tests use.
pub fn smollm2() -> Option<PathBuf> {
    model("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The Python of the test venv, if it imports `modules`; otherwise skip
/// (or fail under FLATRUN_REQUIRE_MODELS=1).
pub fn python_with(modules: &str) -> Option<PathBuf> {
    let python = std::env::var_os("FLATRUN_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/venv/bin/python")
        });
    let ok = std::process::Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(python);
    }
    let message = format!(
        "{} cannot import {modules}: run scripts/setup-test-env.sh",
        python.display()
    );
    if required() {
        panic!("{message}");
    }
    eprintln!("skipping: {message}");
    None
}

/// Stdout of a finished command as text.
pub fn stdout_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Stderr of a finished command as text.
pub fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A Hugging Face checkpoint directory written by
/// scripts/gen_hf_checkpoints.py (under FLATRUN_HF_CKPT), or `None` (after a
/// skip message) when it is missing and FLATRUN_REQUIRE_MODELS is not 1.
pub fn hf_checkpoint(variant: &str) -> Option<PathBuf> {
    let root = std::env::var_os("FLATRUN_HF_CKPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/hf-ckpt")
        });
    let dir = root.join(variant);
    if dir.join("config.json").is_file() {
        return Some(dir);
    }
    if required() {
        panic!(
            "checkpoint {} is missing and FLATRUN_REQUIRE_MODELS=1 (run scripts/setup-test-env.sh)",
            dir.display()
        );
    }
    eprintln!(
        "skipping: checkpoint {} not found (run scripts/setup-test-env.sh)",
        dir.display()
    );
    None
}
