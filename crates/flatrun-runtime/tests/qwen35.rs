//! Parity of the Qwen3.5 hybrid stack (gated delta-net layers with gated
//! full attention every third layer) against llama.cpp, on synthetic
//! checkpoints of the exact `qwen35` architecture.
//!
//! The checkpoints are written by `scripts/gen_synthetic_qwen35.py` (the real
//! Qwen3.5 tokenizer vocabulary, seeded random weights; deterministic) into
//! `$FLATRUN_SYNTHETIC` (default `~/.cache/flatrun/synthetic`). When a file is
//! missing or its sha256 differs from `tests/fixtures/qwen35/manifest.json`
//! the test reruns the generator with `$FLATRUN_PYTHON` (default
//! `~/.cache/flatrun/venv/bin/python`); if that python is absent the test is
//! skipped with a message, unless `FLATRUN_REQUIRE_MODELS=1`.
//!
//! Fixtures: `tests/fixtures/qwen35/<file>.logits.json`, the reference's
//! teacher-forced top-10 logits at every position of three prompts and a
//! greedy continuation, made by `scripts/gen_synthetic_fixtures.sh qwen35`.
//!
//! Criteria (per file and backend, see [`Bounds`]):
//! * arg-max agrees with the reference at ≥ 99% of the *decisive* positions
//!   (reference top-2 gap ≥ `DECISIVE_GAP`) and at a share of all positions;
//! * each of the reference's top-10 logits is matched within a tolerance
//!   (absolute) at ≥ 99% of the positions, and the mean absolute difference
//!   stays under a bound.
//!   The `native` backend (both files) and the `reference` backend on f16
//!   weights are held to ≥ 99% arg-max, top-10 within 0.5, mean ≤ 0.05
//!   (measured: 133/133; mean 0.004 / 0.0065 f16, < 0.0001 native Q8_0).
//!   The `reference` backend on Q8_0 weights multiplies unquantized f32
//!   activations, while llama.cpp (and the native kernels) quantize
//!   activations to Q8_0 first; it is held to the dense families' bounds for
//!   quantized weights: ≥ 90% arg-max, top-10 within 0.75, mean ≤ 0.15
//!   (measured: 125/133, every miss at a reference gap < 0.5; mean 0.078,
//!   max 0.52);
//! * the greedy continuation (prefill, then one token per step through the
//!   recurrent state and the KV cache) equals the reference's token for
//!   token, except that it may leave the reference's path at a near-tie
//!   (reference top-2 gap < `NEAR_TIE`) by taking the reference's second
//!   choice; the comparison stops there, since the paths then differ.
//!
//! Run in release mode: `cargo test --release -p flatrun-runtime --test qwen35 -- --nocapture`.
//! A debug build reports these tests as ignored.

mod common;

use std::path::PathBuf;

use common::logits::{Bounds, LogitFixture, all_logits, greedy_on_reference_path, teacher_forced};
use flatrun_runtime::{BackendKind, LoadOptions, Model, Residency, argmax};

/// Native kernels (which quantize activations like llama.cpp), or f16 weights.
const STRICT: Bounds = Bounds {
    argmax_share: 0.99,
    decisive_gap: DECISIVE_GAP,
    decisive_share: 0.99,
    top10_tolerance: 0.5,
    top10_share: 0.99,
    mean_tolerance: 0.05,
    min_positions: MIN_POSITIONS,
};
/// The reference backend on quantized weights (unquantized activations).
const REFERENCE_QUANTIZED: Bounds = Bounds {
    argmax_share: 0.90,
    decisive_gap: DECISIVE_GAP,
    decisive_share: 0.99,
    top10_tolerance: 0.75,
    top10_share: 0.99,
    mean_tolerance: 0.15,
    min_positions: MIN_POSITIONS,
};
/// A position is decisive when the reference's top-2 gap is at least this.
const DECISIVE_GAP: f32 = 1.0;
/// A greedy step may leave the reference's path only where its top-2 gap is below this.
const NEAR_TIE: f32 = 0.5;
/// Fewest teacher-forced positions a fixture must hold.
const MIN_POSITIONS: usize = 100;

fn bounds(file: &str, backend: BackendKind) -> Bounds {
    match backend {
        BackendKind::Reference if !file.ends_with("-f16.gguf") => REFERENCE_QUANTIZED,
        _ => STRICT,
    }
}

fn fixtures() -> PathBuf {
    common::fixtures().join("qwen35")
}

/// The model and its fixture, or `None` when skipped.
fn setup(file: &str, backend: BackendKind, residency: Residency) -> Option<(Model, LogitFixture)> {
    let path = common::synthetic::synthetic_model(file, &fixtures(), "gen_synthetic_qwen35.py")?;
    let fixture = LogitFixture::load(
        &fixtures().join(format!("{}.logits.json", file.trim_end_matches(".gguf"))),
    );
    let model = Model::load(
        &path,
        LoadOptions {
            backend,
            residency,
            ..LoadOptions::default()
        },
    )
    .expect("load");
    Some((model, fixture))
}

/// Teacher-forced logits at every position of every prompt vs the reference.
fn check_logits(file: &str, backend: BackendKind, residency: Residency) {
    let Some((mut model, fixture)) = setup(file, backend, residency) else {
        return;
    };
    let label = format!("{file} [{backend:?}, {residency:?}]");
    teacher_forced(&mut model, &fixture, label, bounds(file, backend)).assert_within();
}

/// Greedy decoding, one token per step, vs the reference's continuation.
fn check_greedy(file: &str, backend: BackendKind) {
    let Some((mut model, fixture)) = setup(file, backend, Residency::Resident) else {
        return;
    };
    greedy_on_reference_path(
        &mut model,
        &fixture,
        &format!("{file} [{backend:?}]"),
        NEAR_TIE,
    );
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_f16_native() {
    check_logits(
        "qwen35-synth-f16.gguf",
        BackendKind::Native,
        Residency::Resident,
    );
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_f16_reference() {
    check_logits(
        "qwen35-synth-f16.gguf",
        BackendKind::Reference,
        Residency::Resident,
    );
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_q8_0_native() {
    check_logits(
        "qwen35-synth-q8_0.gguf",
        BackendKind::Native,
        Residency::Resident,
    );
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_q8_0_reference() {
    check_logits(
        "qwen35-synth-q8_0.gguf",
        BackendKind::Reference,
        Residency::Resident,
    );
}
/// Streamed layers: the recurrent state stays resident while the weights come and go.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_q8_0_native_streamed() {
    check_logits(
        "qwen35-synth-q8_0.gguf",
        BackendKind::Native,
        Residency::Stream,
    );
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_f16_native_greedy() {
    check_greedy("qwen35-synth-f16.gguf", BackendKind::Native);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_f16_reference_greedy() {
    check_greedy("qwen35-synth-f16.gguf", BackendKind::Reference);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_q8_0_native_greedy() {
    check_greedy("qwen35-synth-q8_0.gguf", BackendKind::Native);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_q8_0_reference_greedy() {
    check_greedy("qwen35-synth-q8_0.gguf", BackendKind::Reference);
}

/// Truncating a sequence rewinds the KV caches and rebuilds the recurrent
/// state from the kept tokens: the logits after `truncate` + new tokens equal
/// a fresh run over the same tokens.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_truncate_rebuilds_recurrent_state() {
    let Some((mut model, fixture)) = setup(
        "qwen35-synth-f16.gguf",
        BackendKind::Native,
        Residency::Resident,
    ) else {
        return;
    };
    let tokens = fixture.teacher_forced[0].tokens.clone();
    let (keep, tail) = (tokens.len() / 2, &tokens[tokens.len() / 2..]);
    let fresh = model.session().step(&tokens).expect("fresh");
    let mut session = model.session();
    session.step(&tokens).expect("first pass");
    // Rewind to `keep` tokens, then continue with the same tail.
    session.truncate(keep);
    assert_eq!(session.sequence().len(), keep);
    let again = session.step(tail).expect("after truncate");
    let worst = fresh
        .iter()
        .zip(&again)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst < 1e-2,
        "logits after truncate differ by up to {worst}"
    );
    assert_eq!(argmax(&fresh), argmax(&again));
}

/// Largest |prefill − decode| logit difference over a prompt: the same tokens
/// run in one step (all logits) and one token per step (the recurrent state
/// and the conv window carried between steps).
fn prefill_vs_decode(file: &str, backend: BackendKind) -> Option<f32> {
    let (mut model, fixture) = setup(file, backend, Residency::Resident)?;
    let tokens = fixture.teacher_forced[0].tokens.clone();
    let vocab = model.executor().vocab_size();
    let all = all_logits(&mut model, &tokens);
    let mut session = model.session();
    let mut worst = 0f32;
    for (p, &t) in tokens.iter().enumerate() {
        let logits = session.step(&[t]).expect("decode");
        let row = &all[p * vocab..(p + 1) * vocab];
        let diff = row
            .iter()
            .zip(&logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        worst = worst.max(diff);
    }
    eprintln!("{file} [{backend:?}]: max |prefill − decode| {worst:.5}");
    Some(worst)
}

/// Decoding token by token gives the prefill's logits, on the reference
/// backend (whose matmuls barely depend on the number of tokens; measured
/// 0.02 with f16 weights, 0 with Q8_0). The native Q8_0 kernels are left
/// out: their one-token path differs from their many-token path by up to
/// ~1 logit on this file (a kernel matter, not the recurrence).
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_decode_matches_prefill() {
    for file in ["qwen35-synth-f16.gguf", "qwen35-synth-q8_0.gguf"] {
        if let Some(worst) = prefill_vs_decode(file, BackendKind::Reference) {
            assert!(
                worst < 0.05,
                "{file}: decode differs from prefill by {worst}"
            );
        }
    }
}

/// A context shift cannot cut a recurrent state: the model asks for a
/// recompute and leaves the sequence as it was.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_shift_asks_for_recompute() {
    let Some((mut model, fixture)) = setup(
        "qwen35-synth-f16.gguf",
        BackendKind::Native,
        Residency::Resident,
    ) else {
        return;
    };
    let tokens = fixture.teacher_forced[0].tokens.clone();
    let mut seq = model.new_sequence();
    model
        .executor_mut()
        .step(&mut seq, &tokens, flatrun_runtime::StepOptions::default())
        .expect("step");
    let shifted = model.shift(&mut seq, 1, tokens.len() / 2).expect("shift");
    assert_eq!(
        shifted,
        flatrun_runtime::KvShift::Recompute(flatrun_runtime::ShiftRefusal::Recurrent)
    );
    assert_eq!(seq.tokens(), &tokens[..]);
}
