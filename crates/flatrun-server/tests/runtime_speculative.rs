//! Speculative decoding in the server over the real runtime: with prompt
//! lookup or a draft model, the engine's greedy answers, alone and batched,
//! are token for token the runtime's own greedy answers without
//! speculation, on SmolLM2-135M and on the synthetic Qwen3.5 (whose
//! delta-net layers' recurrent state goes back to its checkpoint at every
//! rejection). The draft is the target with only its first layers: cheap,
//! and wrong often enough that rejections are many.
//!
//! Needs `$FLATRUN_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf` and the test
//! tools' python (`scripts/setup-test-env.sh`) for the synthetic model;
//! skipped without them unless FLATRUN_REQUIRE_MODELS=1. Release mode:
//! `cargo test --release -p flatrun-server --test runtime_speculative`.

#![cfg(feature = "runtime")]

mod common;
#[path = "../../flatrun-runtime/tests/common/synthetic.rs"]
#[allow(dead_code)]
mod synthetic;

use std::path::{Path, PathBuf};

use flatrun_runtime::{GenerateOptions, LayerSelection, LoadOptions, Model, Prompt, Residency};
use flatrun_server::{
    BatchEngine, Engine, GenerationRequest, SamplingParams, SchedulerConfig, Speculation,
};

const PROMPTS: &[&str] = &[
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Once upon a time, in a small village by the sea, there lived",
];
const MAX_TOKENS: usize = 40;

fn load(path: &Path, layers: Option<&str>) -> Model {
    Model::load(
        path,
        LoadOptions {
            residency: Residency::Resident,
            ctx: Some(512),
            layers: layers.map(|l| l.parse::<LayerSelection>().expect("layer range")),
            ..LoadOptions::default()
        },
    )
    .expect("load")
}

fn smollm2() -> Option<PathBuf> {
    let dir = std::env::var_os("FLATRUN_MODELS").map(PathBuf::from);
    let path = dir.map(|d| d.join("SmolLM2-135M-Instruct.Q4_1.gguf"));
    match path {
        Some(p) if p.is_file() => Some(p),
        _ if synthetic::require_models() => {
            panic!("SmolLM2-135M-Instruct.Q4_1.gguf is missing and FLATRUN_REQUIRE_MODELS=1")
        }
        _ => {
            eprintln!("skipping SmolLM2: set FLATRUN_MODELS (scripts/fetch-models.py)");
            None
        }
    }
}

fn qwen35() -> Option<PathBuf> {
    let fixtures =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../flatrun-runtime/tests/fixtures/qwen35");
    synthetic::synthetic_model(
        "qwen35-synth-q8_0.gguf",
        &fixtures,
        "gen_synthetic_qwen35.py",
    )
}

/// The runtime's greedy answers, without speculation.
fn references(model: &mut Model, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .map(|prompt| {
            model
                .generate(
                    Prompt::Tokens(prompt.clone()),
                    GenerateOptions::greedy(MAX_TOKENS),
                )
                .expect("generate")
                .map(|event| event.expect("step"))
                .filter(|event| event.finish != Some(flatrun_runtime::FinishReason::Eos))
                .map(|event| event.id)
                .collect()
        })
        .collect()
}

/// The engine's greedy answers to `prompts`, submitted together.
fn answers(engine: &BatchEngine, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let requests = prompts
        .iter()
        .map(|prompt| GenerationRequest {
            prompt: prompt.clone(),
            sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            max_tokens: MAX_TOKENS,
            cache_prompt: false,
            ..GenerationRequest::default()
        })
        .collect();
    common::answer_ids(engine, requests)
}

/// Lookup and a draft of the first `draft_layers`: every answer, alone and
/// in a batch of all prompts, equals the runtime's.
fn check(path: &Path, draft_layers: &str) {
    let mut model = load(path, None);
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| model.encode(p, true).expect("encode"))
        .collect();
    let expected = references(&mut model, &prompts);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    for speculation in [Speculation::lookup(6), Speculation::draft(4)] {
        let mut model = load(path, None);
        if speculation == Speculation::draft(4) {
            model
                .set_draft(load(path, Some(draft_layers)))
                .expect("draft");
        }
        let scheduler = SchedulerConfig {
            speculation: Some(speculation.clone()),
            ..SchedulerConfig::default()
        };
        let engine = flatrun_server::runtime::engine(model, scheduler).expect("engine");
        for (i, prompt) in prompts.iter().enumerate() {
            let got = answers(&engine, std::slice::from_ref(prompt));
            assert_eq!(
                got[0], expected[i],
                "{name}, {speculation:?}, prompt {i} alone"
            );
        }
        let batched = answers(&engine, &prompts);
        assert_eq!(batched, expected, "{name}, {speculation:?}, batched");
        let stats = engine.stats();
        eprintln!(
            "{name} {:?}: {} of {} proposals accepted in {} passes",
            speculation.proposer,
            stats.speculative_accepted_total,
            stats.speculative_proposed_total,
            stats.speculative_passes_total
        );
        assert!(stats.speculative_accepted_total > 0, "{stats:?}");
        assert!(
            stats.speculative_accepted_total < stats.speculative_proposed_total,
            "{name}: no rejection to roll back: {stats:?}"
        );
        engine.shutdown();
    }
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn greedy_speculation_in_the_server_is_exact_on_smollm2() {
    if let Some(path) = smollm2() {
        check(&path, "0-23");
    }
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn greedy_speculation_in_the_server_is_exact_on_qwen35() {
    if let Some(path) = qwen35() {
        let layers = load(&path, None).config().n_layer;
        check(&path, &format!("0-{}", (layers / 2).max(1) - 1));
    }
}
