//! Coherence of the mixture-of-experts path on real weights: Qwen2.5-Coder-0.5B
//! upcycled into a `qwen2moe` GGUF (`scripts/gen_upcycled_moe.py`: the dense
//! FFN, bytes as stored, copied into each expert; every token uses all
//! experts, so the router's softmax weights sum to one; a shared expert that
//! adds zero) must generate the dense model's greedy text, which is also
//! llama.cpp's on both files (`tests/fixtures/upcycled/`).
//!
//! This proves the stacked-expert layout, the expert matmuls on real
//! K-quant/legacy-quant weights, the weighted sum and the shared-expert path
//! through a real tokenizer; choosing among different experts is covered by
//! `tests/moe.rs`.
//!
//! The upcycled file is written into `$FLATRUN_SYNTHETIC` on first use
//! (about 40 s, 0.7 GB). Run in release mode:
//! `cargo test --release -p flatrun-runtime --test upcycled_moe -- --nocapture`.

mod common;

use std::path::PathBuf;
use std::process::Command;

use flatrun_runtime::{LoadOptions, Model, argmax};

const DENSE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
const UPCYCLED: &str = "qwen2.5-coder-0.5b-upcycled-moe.gguf";

/// The upcycled file, written from the dense one when missing.
fn upcycled(dense: &PathBuf) -> Option<PathBuf> {
    let path = common::synthetic::synthetic_dir().join(UPCYCLED);
    if path.exists() {
        return Some(path);
    }
    let py = common::synthetic::python();
    if !py.exists() {
        assert!(
            !common::synthetic::require_models(),
            "{} is missing and FLATRUN_REQUIRE_MODELS=1",
            py.display()
        );
        eprintln!("skipping: {} not found", py.display());
        return None;
    }
    std::fs::create_dir_all(common::synthetic::synthetic_dir()).expect("synthetic dir");
    let tmp = path.with_extension("gguf.tmp");
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gen_upcycled_moe.py");
    let status = Command::new(&py)
        .arg(script)
        .arg(dense)
        .arg(&tmp)
        .status()
        .expect("run gen_upcycled_moe.py");
    assert!(status.success(), "gen_upcycled_moe.py failed");
    std::fs::rename(&tmp, &path).expect("rename");
    Some(path)
}

/// Greedy tokens, one per step.
fn greedy(path: &PathBuf, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut model = Model::load(path, LoadOptions::default()).expect("load");
    let mut session = model.session();
    let mut logits = session.step(prompt).expect("prefill");
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let next = argmax(&logits);
        out.push(next);
        logits = session.step(&[next]).expect("decode");
    }
    out
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn upcycled_moe_generates_the_dense_models_text() {
    let Some(dense) = common::model(DENSE) else {
        return;
    };
    let Some(moe) = upcycled(&dense) else {
        return;
    };
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            common::fixtures().join("upcycled/qwen2.5-coder-0.5b-upcycled-moe.json"),
        )
        .expect("fixture"),
    )
    .expect("fixture JSON");
    let prompt = common::logits::ids(&fixture["prompt_tokens"]);
    let want = common::logits::ids(&fixture["tokens"]);
    let from_dense = greedy(&dense, &prompt, want.len());
    let from_moe = greedy(&moe, &prompt, want.len());
    assert_eq!(from_dense, want, "the dense model left llama.cpp's text");
    assert_eq!(
        from_moe, want,
        "the upcycled MoE left the dense model's text"
    );
}
