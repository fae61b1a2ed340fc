//! Help, version and every error path of the command: one or two lines with
//! the cause and what to do, a non-zero exit code, no backtrace. None of
//! these needs a model.

mod common;

use common::{flatrun, stderr_of};
use predicates::prelude::*;

#[test]
fn version_is_printed() {
    flatrun()
        .arg("--version")
        .assert()
        .success()
        .stdout(predicate::str::starts_with("flatrun "));
}

#[test]
fn help_lists_every_command() {
    let out = flatrun().arg("--help").output().unwrap();
    let text = common::stdout_of(&out);
    for command in ["run", "chat", "bench", "inspect", "tokenize", "serve"] {
        assert!(
            text.contains(command),
            "`{command}` missing from --help:\n{text}"
        );
    }
}

#[test]
fn help_of_each_command_shows_its_flags_and_defaults() {
    let shared = [
        "--backend",
        "--threads",
        "--ctx",
        "--residency",
        "--prefetch",
        "--stream-reads",
        "--kv-type",
        "--weights",
        "--layers",
        "--profile",
        "--profile-detailed",
        "--profile-save",
        "--trace-memory",
        "--verbose",
        "--quiet",
    ];
    let sampling = [
        "--temperature",
        "--top-k",
        "--top-p",
        "--min-p",
        "--repeat-penalty",
        "--seed",
        "--stop",
    ];
    for command in ["run", "chat", "bench", "serve"] {
        let out = flatrun().args(["help", command]).output().unwrap();
        assert!(out.status.success());
        let text = common::stdout_of(&out);
        for flag in shared {
            assert!(
                text.contains(flag),
                "{flag} missing from `flatrun help {command}`"
            );
        }
        if command != "bench" {
            for flag in sampling {
                assert!(
                    text.contains(flag),
                    "{flag} missing from `flatrun help {command}`"
                );
            }
        }
        assert!(
            text.contains("[default: native]"),
            "no defaults in `flatrun help {command}`"
        );
    }
    let out = flatrun().args(["help", "serve"]).output().unwrap();
    let text = common::stdout_of(&out);
    for flag in [
        "--port",
        "--host",
        "--api-key",
        "--max-seqs",
        "[default: 8080]",
        "[default: 127.0.0.1]",
    ] {
        assert!(
            text.contains(flag),
            "{flag} missing from `flatrun help serve`"
        );
    }
    let out = flatrun().args(["help", "bench"]).output().unwrap();
    let text = common::stdout_of(&out);
    for flag in [
        "-p",
        "-n",
        "-r",
        "--json",
        "[default: 128]",
        "[default: 64]",
        "[default: 3]",
    ] {
        assert!(
            text.contains(flag),
            "{flag} missing from `flatrun help bench`"
        );
    }
    for command in ["inspect", "tokenize"] {
        flatrun().args(["help", command]).assert().success();
    }
}

/// An error: exit code 1, `error:` first, at most two lines, no backtrace.
fn assert_short_error(args: &[&str], needle: &str) {
    let out = flatrun().args(args).write_stdin("").output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr_of(&out));
    let err = stderr_of(&out);
    assert!(err.starts_with("error: "), "{args:?}: {err}");
    assert!(
        err.trim_end().lines().count() <= 2,
        "{args:?}: more than two lines:\n{err}"
    );
    assert!(err.contains(needle), "{args:?}: `{needle}` not in:\n{err}");
    assert!(
        !err.contains("stack backtrace"),
        "{args:?}: backtrace:\n{err}"
    );
    assert!(out.stdout.is_empty(), "{args:?}: wrote to stdout");
}

#[test]
fn missing_model_file() {
    assert_short_error(
        &["--model", "/nonexistent/model.gguf", "--prompt", "hi"],
        "model not found",
    );
    assert_short_error(
        &["chat", "--model", "/nonexistent/model.gguf"],
        "model not found",
    );
    assert_short_error(
        &["bench", "--model", "/nonexistent/model.gguf"],
        "model not found",
    );
    assert_short_error(
        &[
            "tokenize",
            "--model",
            "/nonexistent/model.gguf",
            "--text",
            "x",
        ],
        "model not found",
    );
    assert_short_error(
        &["serve", "--model", "/nonexistent/model.gguf", "--port", "0"],
        "model not found",
    );
}

#[test]
fn directory_without_weights() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("README.md"), "nothing here").unwrap();
    let path = dir.path().to_str().unwrap();
    assert_short_error(
        &["run", "--model", path, "--prompt", "hi"],
        "holds no weights",
    );
}

#[test]
fn not_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.gguf");
    std::fs::write(&file, b"this is not a gguf file at all, just text").unwrap();
    assert_short_error(
        &["run", "--model", file.to_str().unwrap(), "--prompt", "hi"],
        "cannot load",
    );
}

#[test]
fn bad_flag_values() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("m.gguf");
    std::fs::write(&file, b"x").unwrap();
    let m = file.to_str().unwrap();
    assert_short_error(
        &[
            "run",
            "--model",
            m,
            "--prompt",
            "hi",
            "--residency",
            "sometimes",
        ],
        "--residency",
    );
    assert_short_error(
        &[
            "run",
            "--model",
            m,
            "--prompt",
            "hi",
            "--residency",
            "cap=lots",
        ],
        "--residency",
    );
    assert_short_error(
        &["run", "--model", m, "--prompt", "hi", "--temperature=-1"],
        "--temperature",
    );
    assert_short_error(
        &["run", "--model", m, "--prompt", "hi", "--top-p", "0"],
        "--top-p",
    );
    assert_short_error(
        &[
            "run",
            "--model",
            m,
            "--prompt",
            "hi",
            "--weights",
            "f16",
            "--residency",
            "stream",
        ],
        "--weights f16 needs --residency resident",
    );
    assert_short_error(
        &["run", "--model", m, "--prompt", "hi", "--layers", "0-x"],
        "--layers",
    );
    assert_short_error(
        &["run", "--model", m, "--prompt", "hi", "--layers", "3-1"],
        "--layers",
    );
    assert_short_error(
        &["run", "--model", m, "--prompt", "hi", "--threads", "0"],
        "--threads",
    );
    assert_short_error(
        &[
            "run",
            "--model",
            m,
            "--prompt",
            "hi",
            "--stream-reads",
            "mmap",
        ],
        "--stream-reads",
    );
    assert_short_error(&["bench", "--model", m, "-r", "0"], "--repetitions");
    // Values clap itself rejects exit with 2 and name the flag.
    let out = flatrun()
        .args(["run", "--model", m, "--backend", "gpu"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("--backend"));
    let out = flatrun()
        .args(["run", "--model", m, "--max-new", "many"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = flatrun().args(["run", "--no-such-flag"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn tokenize_needs_an_input() {
    let out = flatrun()
        .args(["tokenize", "--model", "x.gguf"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("--text"));
}

/// A minimal GGUF v3 file: `general.architecture = arch` and the given tensor
/// infos (name, dims, GGML type id), each at offset 0, then 256 zero bytes.
fn tiny_gguf(arch: &str, tensors: &[(&str, &[u64], u32)]) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&1u64.to_le_bytes());
    string(&mut out, "general.architecture");
    out.extend_from_slice(&8u32.to_le_bytes()); // string value
    string(&mut out, arch);
    for (name, dims, ty) in tensors {
        string(&mut out, name);
        out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in *dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
    }
    out.resize(out.len().next_multiple_of(32) + 256, 0);
    out
}

#[test]
fn unsupported_architecture_is_named_with_the_supported_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mamba.gguf");
    std::fs::write(&path, tiny_gguf("mamba", &[])).unwrap();
    let out = flatrun()
        .env_remove("RUST_BACKTRACE")
        .args(["--model", path.to_str().unwrap(), "--prompt", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr_of(&out);
    assert!(err.contains("unsupported architecture `mamba`"), "{err}");
    assert!(
        err.contains("llama") && err.contains("qwen2") && err.contains("gemma3"),
        "{err}"
    );
    assert!(err.lines().count() <= 2, "no backtrace expected:\n{err}");
}

#[test]
fn unknown_quant_type_is_named_with_its_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("quant99.gguf");
    std::fs::write(
        &path,
        tiny_gguf("llama", &[("token_embd.weight", &[32, 4], 99)]),
    )
    .unwrap();
    let out = flatrun()
        .env_remove("RUST_BACKTRACE")
        .args(["--model", path.to_str().unwrap(), "--prompt", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr_of(&out);
    assert!(
        err.contains("token_embd.weight") && err.contains("99"),
        "{err}"
    );
    assert!(err.lines().count() <= 2, "no backtrace expected:\n{err}");
}

#[test]
fn rust_backtrace_in_the_environment_adds_no_backtrace_to_an_error() {
    let out = flatrun()
        .env("RUST_BACKTRACE", "1")
        .args(["--model", "/nonexistent/model.gguf", "--prompt", "hi"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr_of(&out);
    assert!(err.starts_with("error: model not found"), "{err}");
    assert!(err.trim_end().lines().count() <= 2, "{err}");
    assert!(!err.contains("backtrace") && !err.contains("at "), "{err}");
}
