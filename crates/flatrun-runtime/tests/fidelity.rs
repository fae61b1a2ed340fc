//! Fidelity against llama.cpp: teacher-forced logits and greedy
//! continuations of the three real models, on both kernel backends.
//!
//! Fixtures: `tests/fixtures/<model>.logits.json`, made by
//! `scripts/gen_logit_fixtures.py` from the reference llama.cpp build
//! (parsed and compared by the shared `common::logits`), and
//! `tests/fixtures/llama_cpp_self_agreement.json`, made by
//! `scripts/gen_self_agreement.py`: the same llama.cpp on the same tokens
//! with its batch size changed from 512 to 1, 2 and 4, which changes nothing
//! but the order of its f32 sums.
//!
//! Criteria (per model and backend):
//! * arg-max agrees with the reference at ≥ 99% of the teacher-forced
//!   positions whose reference top-2 gap is at least `DECISIVE_GAP`, and at
//!   ≥ 99% of all positions (native);
//! * each of the reference's top-10 logits is matched within the backend's
//!   tolerance at ≥ 99% of positions, and the mean absolute difference stays
//!   under its bound ([`NATIVE`], [`reference_limits`]);
//! * greedy 64-token continuations of five prompts are identical, except
//!   that a divergence may start where the reference's top-2 gap is below
//!   `NEAR_TIE` (a near-tie; printed).
//!
//! The native backend reproduces llama.cpp's CPU arithmetic on x86 (AVX2 and
//! up) operation for operation, so on such hosts it matches to the fixtures'
//! printed precision: SmolLM2 342/342, Qwen2.5-Coder 315/315, Gemma 3 329/329,
//! mean and max |diff| 0.0000, every greedy continuation identical.
//!
//! The reference backend is the exact (f64) math of the same quantized
//! operands and imitates no summation order. Any change of order moves
//! llama.cpp's own near-tie arg-maxes: run one or two tokens per batch
//! instead of 512 and llama.cpp agrees with its own fixtures at only
//! 96.4–99.0% of all positions (Gemma 3: 317/329), and its own greedy
//! continuations leave the fixtures' at top-2 gaps up to 0.265 (SmolLM2).
//! The 99% / 0.1 thresholds above are therefore met only by copying one
//! build's float order, so the reference backend is held to llama.cpp's own
//! floor instead, read from the self-agreement fixture
//! ([`reference_limits`], [`reference_near_tie`]): ≥ 99% of the decisive
//! positions agree (measured 297/299, 279/279, 276/278; llama.cpp's own runs
//! all), its arg-max share is at most `REFERENCE_SHARE_SLACK` below
//! llama.cpp's worst batch size, its mean |diff| at most
//! `REFERENCE_MEAN_FACTOR` × llama.cpp's worst, and a greedy divergence may
//! start wherever llama.cpp's own did. `docs/families.md` has the figures.
//!
//! Run in release mode: `cargo test --release -p flatrun-runtime --test fidelity -- --nocapture`.
//! A debug build reports these tests as ignored.

mod common;

use common::logits::{Bounds, LogitFixture, floats, ids, teacher_forced};
use flatrun_runtime::{BackendKind, LoadOptions, Model, Residency, argmax};

/// What each backend must reach on the teacher-forced positions.
struct Limits {
    /// Share of all positions whose arg-max must agree.
    argmax_share: f64,
    /// Largest tolerated |ours − reference| on a top-10 logit (at 99% of positions).
    top10_tolerance: f32,
    /// Largest tolerated mean |ours − reference| over all top-10 logits.
    mean_tolerance: f32,
}

/// Native: llama.cpp's own float order (measured: every logit equal to the
/// fixtures' 4 decimals). Loose enough for hosts where the kernels fall back
/// to the portable ones (another summation order).
const NATIVE: Limits = Limits {
    argmax_share: 0.99,
    top10_tolerance: 0.5,
    mean_tolerance: 0.05,
};
/// How far the reference backend's arg-max share may sit below the worst of
/// llama.cpp's own small-batch runs (SmolLM2: llama.cpp 336/342 at batch 1,
/// the reference 330/342; one flip is 0.3%).
const REFERENCE_SHARE_SLACK: f64 = 0.025;
/// The reference backend's mean |diff| bound, as a multiple of the worst of
/// llama.cpp's own small-batch runs (measured: SmolLM2 0.167 against 0.118,
/// Gemma 3 0.230 against 0.232, Qwen2.5 0.066 against 0.064).
const REFERENCE_MEAN_FACTOR: f32 = 1.5;

/// llama.cpp against itself for one model: the worst figures over the batch
/// sizes of `fixtures/llama_cpp_self_agreement.json`.
struct SelfAgreement {
    /// Lowest share of all positions whose arg-max agrees with the fixtures.
    argmax_share: f64,
    /// Lowest share of decisive positions that agree.
    decisive_share: f64,
    /// Highest mean |llama.cpp(batch) − fixture| over the top-10 logits.
    mean_abs: f32,
    /// Widest fixture top-2 gap at which a greedy continuation diverged.
    widest_divergence_gap: f32,
}

fn self_agreement(file: &str) -> SelfAgreement {
    let path = common::fixtures().join("llama_cpp_self_agreement.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading fixture {}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).expect("self-agreement JSON");
    let runs = json["models"][file]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no runs for {file}", path.display()));
    let num = |v: &serde_json::Value| v.as_f64().expect("number");
    let mut worst = SelfAgreement {
        argmax_share: 1.0,
        decisive_share: 1.0,
        mean_abs: 0.0,
        widest_divergence_gap: 0.0,
    };
    for run in runs {
        let tf = &run["teacher_forced"];
        worst.argmax_share = worst
            .argmax_share
            .min(num(&tf["argmax_agree"]) / num(&tf["positions"]));
        worst.decisive_share = worst
            .decisive_share
            .min(num(&tf["decisive_agree"]) / num(&tf["decisive_positions"]));
        worst.mean_abs = worst.mean_abs.max(num(&tf["top10_mean_abs_diff"]) as f32);
        for g in run["greedy"].as_array().expect("greedy runs") {
            if let Some(gap) = g["fixture_top2_gap"].as_f64() {
                worst.widest_divergence_gap = worst.widest_divergence_gap.max(gap as f32);
            }
        }
    }
    worst
}

/// Reference backend: exact math of the same operands, held to llama.cpp's
/// own agreement with itself across batch sizes (see the module docs).
fn reference_limits(file: &str) -> Limits {
    let floor = self_agreement(file);
    eprintln!(
        "{file}: llama.cpp against itself (batch 1/2/4 vs 512): worst arg-max share {:.4}, \
         decisive {:.4}, mean |diff| {:.4}, widest greedy divergence gap {:.3}",
        floor.argmax_share, floor.decisive_share, floor.mean_abs, floor.widest_divergence_gap
    );
    Limits {
        argmax_share: floor.argmax_share - REFERENCE_SHARE_SLACK,
        // llama.cpp's own top-10 logits move by up to 1.91 (Gemma 3, batch 2).
        top10_tolerance: 2.5,
        mean_tolerance: floor.mean_abs * REFERENCE_MEAN_FACTOR,
    }
}

/// The reference backend's near-tie: a greedy divergence may start where
/// llama.cpp's own did when only its batch size changed, or below `NEAR_TIE`.
fn reference_near_tie(file: &str) -> f32 {
    // Just above the widest gap: llama.cpp diverged *at* that gap.
    NEAR_TIE.max(self_agreement(file).widest_divergence_gap + 1e-3)
}

/// A teacher-forced position is decisive when the reference's top-2 gap is at least this.
const DECISIVE_GAP: f32 = 0.25;
/// A divergence starting where the reference's top-2 gap is below this is a near-tie.
const NEAR_TIE: f32 = 0.1;
/// Greedy prompts per model, and tokens per continuation.
const GREEDY_PROMPTS: usize = 5;
const GREEDY_LEN: usize = 64;

/// Which half of the proof a test runs.
#[derive(PartialEq)]
enum Part {
    TeacherForced,
    Greedy,
}

fn check(file: &str, backend: BackendKind, part: Part) {
    let Some(path) = common::model(file) else {
        return;
    };
    let fixture = LogitFixture::load(
        &common::fixtures().join(format!("{}.logits.json", file.trim_end_matches(".gguf"))),
    );
    let mut model = Model::load(
        &path,
        LoadOptions {
            backend,
            residency: Residency::Resident,
            ..LoadOptions::default()
        },
    )
    .expect("load");
    let label = format!("{file} [{backend:?}]");
    match part {
        Part::TeacherForced => {
            let limits = match backend {
                BackendKind::Native => NATIVE,
                _ => reference_limits(file),
            };
            let bounds = Bounds {
                argmax_share: limits.argmax_share,
                decisive_gap: DECISIVE_GAP,
                decisive_share: 0.99,
                top10_tolerance: limits.top10_tolerance,
                top10_share: 0.99,
                mean_tolerance: limits.mean_tolerance,
                min_positions: 200,
            };
            teacher_forced(
                &mut model,
                &fixture,
                format!("{label} teacher-forced"),
                bounds,
            )
            .assert_within();
        }
        Part::Greedy => {
            let near_tie = match backend {
                BackendKind::Native => NEAR_TIE,
                _ => reference_near_tie(file),
            };
            greedy(&label, &mut model, &fixture, near_tie)
        }
    }
}

/// Greedy continuations: identical to the reference's, except divergences
/// that start at a near-tie (a reference top-2 gap below `near_tie`).
fn greedy(label: &str, model: &mut Model, fixture: &LogitFixture, near_tie: f32) {
    let mut failures = Vec::new();
    let cases = fixture.json["greedy"].as_array().expect("greedy");
    for case in cases.iter().take(GREEDY_PROMPTS) {
        let prompt = ids(&case["prompt_tokens"]);
        let want = ids(&case["tokens"]);
        let gaps = floats(&case["top2_gap"]);
        let n = want.len().min(GREEDY_LEN);
        // Prefill the prompt in one step, then decode one token at a time (as the reference did).
        let mut session = model.session();
        let mut logits = session.step(&prompt).expect("prefill");
        let mut got = Vec::with_capacity(n);
        for _ in 0..n {
            let id = argmax(&logits);
            got.push(id);
            logits = session.step(&[id]).expect("decode");
        }
        match got.iter().zip(&want).position(|(a, b)| a != b) {
            None => eprintln!("{label} greedy {:?}: {n} tokens identical", case["prompt"]),
            Some(k) => {
                let gap = gaps.get(k).copied().unwrap_or(f32::INFINITY);
                eprintln!(
                    "{label} greedy {:?}: diverges at step {k} (ours {}, reference {}, reference top-2 gap {gap})",
                    case["prompt"], got[k], want[k]
                );
                if gap >= near_tie {
                    failures.push(format!("{:?}: step {k}, gap {gap}", case["prompt"]));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{label}: greedy divergences not at a near-tie: {failures:?}"
    );
}

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";
const QWEN2: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn smollm2_native() {
    check(SMOLLM2, BackendKind::Native, Part::TeacherForced);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn smollm2_reference() {
    check(SMOLLM2, BackendKind::Reference, Part::TeacherForced);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn gemma3_native() {
    check(GEMMA3, BackendKind::Native, Part::TeacherForced);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn gemma3_reference() {
    check(GEMMA3, BackendKind::Reference, Part::TeacherForced);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen2_native() {
    check(QWEN2, BackendKind::Native, Part::TeacherForced);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen2_reference() {
    check(QWEN2, BackendKind::Reference, Part::TeacherForced);
}

// Greedy 64-token continuations of five prompts per model.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn smollm2_native_greedy() {
    check(SMOLLM2, BackendKind::Native, Part::Greedy);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn smollm2_reference_greedy() {
    check(SMOLLM2, BackendKind::Reference, Part::Greedy);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn gemma3_native_greedy() {
    check(GEMMA3, BackendKind::Native, Part::Greedy);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn gemma3_reference_greedy() {
    check(GEMMA3, BackendKind::Reference, Part::Greedy);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen2_native_greedy() {
    check(QWEN2, BackendKind::Native, Part::Greedy);
}
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen2_reference_greedy() {
    check(QWEN2, BackendKind::Reference, Part::Greedy);
}
