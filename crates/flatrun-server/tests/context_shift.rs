//! `--context-overflow shift` against llama-server's `--context-shift` on
//! Qwen2.5-Coder-0.5B: the same prompt with a 256-token context, greedy,
//! generating well past the context (several shifts), must give llama.cpp's
//! token ids (`tests/data/context_shift_qwen25coder.json`, made as its
//! README beside it says), and every shift must have re-rotated the cache
//! in place (`/metrics`' counters).
//!
//! Needs `$FLATRUN_MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`; skipped
//! without it unless FLATRUN_REQUIRE_MODELS=1. Release mode:
//! `cargo test --release -p flatrun-server --test context_shift`.

#![cfg(feature = "runtime")]

use std::path::PathBuf;

use flatrun_runtime::{LoadOptions, Model};
use flatrun_server::{Engine, GenerationEvent, GenerationRequest, SamplingParams, SchedulerConfig};
use serde_json::Value;

const MODEL: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

fn model_path() -> Option<PathBuf> {
    let dir = std::env::var_os("FLATRUN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/models")
        });
    let path = dir.join(MODEL);
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{} is missing and FLATRUN_REQUIRE_MODELS=1", path.display());
    }
    eprintln!("skipping: {} not found", path.display());
    None
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of token ids")
        .iter()
        .map(|x| x.as_u64().expect("a token id") as u32)
        .collect()
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn greedy_with_context_shift_matches_llama_server() {
    let Some(path) = model_path() else { return };
    let golden_path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/context_shift_qwen25coder.json");
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(&golden_path).expect("golden file"))
            .expect("golden JSON");
    let ctx = golden["n_ctx"].as_u64().expect("n_ctx") as usize;
    let n_keep = golden["n_keep"].as_u64().expect("n_keep") as usize;
    let n_predict = golden["n_predict"].as_u64().expect("n_predict") as usize;
    let prompt = ids(&golden["prompt_tokens"]);
    let expected = ids(&golden["tokens"]);
    assert!(
        prompt.len() + expected.len() > 2 * ctx,
        "the golden run should shift"
    );

    let model = Model::load(
        &path,
        LoadOptions {
            ctx: Some(ctx),
            ..LoadOptions::default()
        },
    )
    .expect("load");
    // The prompt as llama-server tokenized it.
    let text = golden["prompt"].as_str().expect("prompt");
    assert_eq!(model.encode(text, true).expect("encode"), prompt);
    let engine =
        flatrun_server::runtime::engine(model, SchedulerConfig::default()).expect("engine");
    let mut stream = engine
        .submit(GenerationRequest {
            prompt: prompt.clone(),
            sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            max_tokens: n_predict,
            keep: n_keep,
            shift: true,
            ..GenerationRequest::default()
        })
        .expect("submit");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio");
    let mut got = Vec::new();
    runtime.block_on(async {
        while let Some(event) = stream.next_event().await {
            match event {
                GenerationEvent::Token { id, .. } => got.push(id),
                GenerationEvent::Finished { .. } => break,
                GenerationEvent::Failed { message } => panic!("generation failed: {message}"),
            }
        }
    });
    let stats = engine.stats();
    eprintln!(
        "{} tokens; shifts: {} rotated, {} recomputed",
        got.len(),
        stats.context_shifts_rotated_total,
        stats.context_shifts_recomputed_total
    );
    assert!(stats.context_shifts_rotated_total >= 2, "{stats:?}");
    assert_eq!(stats.context_shifts_recomputed_total, 0);
    // The prompt is evaluated once: shifting in place feeds nothing again.
    assert_eq!(stats.prompt_tokens_total, prompt.len() as u64);
    let first = got.iter().zip(&expected).position(|(a, b)| a != b);
    if let Some(i) = first {
        let context = |v: &[u32]| v[i.saturating_sub(5)..(i + 5).min(v.len())].to_vec();
        panic!(
            "first difference at generated token {i} (position {} before any shift): \
             ours {:?} vs llama.cpp {:?}",
            prompt.len() + i,
            context(&got),
            context(&expected)
        );
    }
    assert_eq!(got.len(), expected.len(), "lengths differ");
}
