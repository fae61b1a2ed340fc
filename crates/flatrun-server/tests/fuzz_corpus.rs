//! Replays every committed fuzz input (`fuzz/corpus/TARGET/*`, the minimized
//! corpus of each `cargo fuzz` campaign, and `fuzz/regressions/TARGET/*`,
//! inputs that once crashed) through the fuzz targets' own entry points, on
//! stable Rust, so a fixed defect stays fixed.

#[allow(dead_code, unused_imports)]
#[path = "../../../fuzz/src/lib.rs"]
mod entry;

use std::path::{Path, PathBuf};

fn inputs(target: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut files = Vec::new();
    for dir in ["corpus", "regressions"] {
        if let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) {
            files.extend(entries.filter_map(|e| e.ok()).map(|e| e.path()));
        }
    }
    files.sort();
    files
}

fn replay(target: &str, run: fn(&[u8])) {
    let files = inputs(target);
    assert!(!files.is_empty(), "no corpus for fuzz target {target}");
    for file in &files {
        let data = std::fs::read(file).unwrap();
        let outcome = std::panic::catch_unwind(|| run(&data));
        assert!(outcome.is_ok(), "{target}: {} fails", file.display());
    }
    println!("{target}: {} inputs", files.len());
}

#[test]
fn gguf_header() {
    replay("gguf_header", entry::gguf_header::run);
}

#[test]
fn safetensors_mlx() {
    replay("safetensors_mlx", entry::safetensors_mlx::run);
}

#[test]
fn tokenize() {
    entry::tokenize::init();
    replay("tokenize", entry::tokenize::run);
}

#[test]
fn template() {
    replay("template", entry::template::run);
}

#[test]
fn server_request() {
    replay("server_request", entry::server_request::run);
}

#[test]
fn dequant() {
    replay("dequant", entry::dequant::run);
}

#[test]
fn tool_calls() {
    replay("tool_calls", entry::tool_calls::run);
}

#[test]
fn grammar() {
    replay("grammar", entry::grammar::run);
}
