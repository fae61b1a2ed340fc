//! MLX directories written by mlx-lm itself, against mlx-lm's own answers.
//!
//! `scripts/gen_mlx_lm_checkpoints.py` (run by `scripts/setup-test-env.sh`)
//! converts the Hugging Face directories of `gen_hf_checkpoints.py` with the
//! real `mlx_lm.convert` (mlx-lm 0.32.2, mlx[cpu] 0.32.4) into
//! `$FLATRUN_MLX_CKPT/lm/<family>-<recipe>`: 4-bit g64 (mlx-lm's default),
//! 8-bit g32, 3-bit g64 and the `mixed_3_6` recipe (per-layer 3/6-bit entries
//! in `config.json`) for SmolLM2, Qwen2.5, Gemma 3 and the synthetic Qwen3 of
//! `gen_synthetic_models.py` (random weights: more near-ties); for SmolLM2
//! also 2-bit g128, 5-bit g32, 6-bit g128 and a sharded copy
//! (`model.safetensors.index.json` over 20 MB shards). The fixtures `tests/fixtures/mlx-lm/<name>.json` hold
//! mlx-lm's logits on the same directory in float32 (`model.set_dtype(mx.float32)`):
//! teacher-forced top-10 over fixed texts, and greedy continuations with the
//! top-2 gap of every step (`gen_mlx_lm_checkpoints.py --goldens`).
//!
//! Criteria, per directory and backend:
//! * teacher-forced arg-max equal to mlx-lm's at ≥ 99% of the positions whose
//!   mlx-lm top-2 gap is at least [`NEAR_TIE`]; the near-ties are excused and
//!   listed (printed with `--nocapture`);
//! * greedy continuations identical, except a divergence that starts at a
//!   near-tie (listed);
//! * the directory's `tokenizer.json` gives mlx-lm's token ids.
//!
//! A missing directory is a skip (message printed), unless
//! `FLATRUN_REQUIRE_MODELS=1`. Run in release mode:
//! `cargo test --release -p flatrun-runtime --test mlx_lm_parity -- --nocapture`.

mod common;

use std::path::PathBuf;

use common::logits::{LogitFixture, all_logits, floats, ids};
use flatrun_runtime::{BackendKind, LoadOptions, MlxActivations, Model, Residency, argmax};

/// A position or greedy step whose mlx-lm top-2 gap is below this is a near-tie.
const NEAR_TIE: f32 = 0.1;
/// Share of the other teacher-forced positions whose arg-max must agree.
const ARGMAX_SHARE: f64 = 0.99;

fn ckpt_dir() -> PathBuf {
    match std::env::var_os("FLATRUN_MLX_CKPT") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/flatrun/mlx-ckpt"),
    }
    .join("lm")
}

/// The directory `name`, or `None` (after a skip message) when it is missing,
/// unless `FLATRUN_REQUIRE_MODELS=1`.
fn checkpoint(name: &str) -> Option<PathBuf> {
    let dir = ckpt_dir().join(name);
    if dir.join(".done").exists() {
        return Some(dir);
    }
    let hint = "run scripts/gen_mlx_lm_checkpoints.py";
    if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!(
            "{} is missing and FLATRUN_REQUIRE_MODELS=1 ({hint})",
            dir.display()
        );
    }
    eprintln!("skipping: {} not found ({hint})", dir.display());
    None
}

fn fixture(name: &str) -> LogitFixture {
    LogitFixture::load(&common::fixtures().join(format!("mlx-lm/{name}.json")))
}

/// What one directory gave against mlx-lm's answers.
struct Agreement {
    label: String,
    /// Teacher-forced positions whose mlx-lm top-2 gap is at least [`NEAR_TIE`].
    positions: usize,
    /// Those of them whose arg-max is mlx-lm's.
    agree: usize,
    /// The largest |difference| over mlx-lm's top-10 logits.
    worst: f32,
    /// Greedy continuations that part from mlx-lm's at a step that is no near-tie.
    greedy_failures: Vec<String>,
}

/// Every check of one directory on one backend with the format's numerics.
fn check(name: &str, backend: BackendKind) {
    let Some(a) = measure(name, backend, MlxActivations::F32) else {
        return;
    };
    let label = &a.label;
    assert!(a.positions >= 40, "{label}: too few positions");
    assert!(
        a.agree as f64 >= ARGMAX_SHARE * a.positions as f64,
        "{label}: teacher-forced arg-max {}/{} below {ARGMAX_SHARE}",
        a.agree,
        a.positions
    );
    assert!(
        a.greedy_failures.is_empty(),
        "{label}: greedy divergences not at a near-tie: {:?}",
        a.greedy_failures
    );
}

/// Load `name` with `backend` and `mlx` activations and compare it with
/// mlx-lm's answers (the tokenizer's ids are asserted; the rest is printed and
/// returned). `None` when the directory is missing.
fn measure(name: &str, backend: BackendKind, mlx: MlxActivations) -> Option<Agreement> {
    let dir = checkpoint(name)?;
    let fixture = fixture(name);
    let mut model = Model::load(
        &dir,
        LoadOptions {
            backend,
            mlx_activations: mlx,
            residency: Residency::Resident,
            ..LoadOptions::default()
        },
    )
    .expect("load the mlx-lm directory");
    let label = match mlx {
        MlxActivations::F32 => format!("{name} [{backend:?}]"),
        MlxActivations::Q8 => format!("{name} [{backend:?}, Q8 activations]"),
    };
    let vocab = model.executor().vocab_size();

    // Tokenizer: the directory's tokenizer.json gives mlx-lm's ids.
    for case in &fixture.teacher_forced {
        let prompt = case.prompt.as_deref().expect("fixture prompt");
        let got = model.encode(prompt, true).expect("encode");
        assert_eq!(got, case.tokens, "{label}: token ids differ from mlx-lm's");
    }

    // Teacher-forced arg-max.
    let (mut positions, mut agree, mut excused) = (0usize, 0usize, Vec::new());
    let mut worst = 0f32;
    for (c, case) in fixture.teacher_forced.iter().enumerate() {
        let all = all_logits(&mut model, &case.tokens);
        for (p, (rid, rl)) in case.top_ids.iter().zip(&case.top_logits).enumerate() {
            let row = &all[p * vocab..(p + 1) * vocab];
            for (&id, &want) in rid.iter().zip(rl) {
                worst = worst.max((row[id as usize] - want).abs());
            }
            let gap = rl[0] - rl[1];
            let ours = argmax(row);
            if gap < NEAR_TIE {
                if ours != rid[0] {
                    excused.push(format!(
                        "case {c} position {p}: ours {ours}, mlx-lm {} (gap {gap:.3})",
                        rid[0]
                    ));
                }
                continue;
            }
            positions += 1;
            if ours == rid[0] {
                agree += 1;
            } else {
                eprintln!(
                    "  {label}: arg-max differs at case {c} position {p}: ours {ours}, mlx-lm {} (gap {gap:.3})",
                    rid[0]
                );
            }
        }
    }
    for e in &excused {
        eprintln!("  {label}: near-tie excused: {e}");
    }
    eprintln!(
        "{label}: teacher-forced arg-max {agree}/{positions} (near-ties below {NEAR_TIE} excused: {}), \
         largest top-10 |diff| {worst:.4}",
        excused.len()
    );

    // Greedy continuations: prefill, then one token at a time (as mlx-lm did).
    let mut failures = Vec::new();
    for case in fixture.json["greedy"].as_array().expect("greedy") {
        let (prompt, want, gaps) = (
            ids(&case["tokens"]),
            ids(&case["generated"]),
            floats(&case["gaps"]),
        );
        let mut session = model.session();
        let mut logits = session.step(&prompt).expect("prefill");
        let mut got = Vec::with_capacity(want.len());
        for _ in 0..want.len() {
            let id = argmax(&logits);
            got.push(id);
            logits = session.step(&[id]).expect("decode");
        }
        match got.iter().zip(&want).position(|(a, b)| a != b) {
            None => eprintln!(
                "{label} greedy {:?}: {} tokens identical",
                case["prompt"],
                want.len()
            ),
            Some(k) => {
                let gap = gaps.get(k).copied().unwrap_or(f32::INFINITY);
                eprintln!(
                    "{label} greedy {:?}: diverges at step {k} (ours {}, mlx-lm {}, mlx-lm top-2 gap {gap}){}",
                    case["prompt"],
                    got[k],
                    want[k],
                    if gap < NEAR_TIE {
                        " — near-tie, excused"
                    } else {
                        ""
                    }
                );
                if gap >= NEAR_TIE {
                    failures.push(format!("{:?}: step {k}, gap {gap}", case["prompt"]));
                }
            }
        }
    }
    Some(Agreement {
        label,
        positions,
        agree,
        worst,
        greedy_failures: failures,
    })
}

/// `$name_native` and `$name_reference` for the directory `$dir`;
/// `long` marks the reference run of a larger model as run on demand.
macro_rules! cases {
    ($($name:ident => $dir:literal $(, $long:literal)?;)*) => {
        mod native {
            use super::*;
            $(
                #[test]
                #[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
                fn $name() {
                    check($dir, BackendKind::Native);
                }
            )*
        }
        mod reference {
            use super::*;
            $(
                #[test]
                #[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
                $(#[cfg_attr(not(debug_assertions), ignore = $long)])?
                fn $name() {
                    check($dir, BackendKind::Reference);
                }
            )*
        }
    };
}

cases! {
    smollm2_q4g64 => "smollm2-135m-q4g64";
    smollm2_q8g32 => "smollm2-135m-q8g32";
    smollm2_q3g64 => "smollm2-135m-q3g64";
    smollm2_mixed36 => "smollm2-135m-mixed36";
    smollm2_q2g128 => "smollm2-135m-q2g128", "reference backend, the native run is in CI: run with --ignored";
    smollm2_q5g32 => "smollm2-135m-q5g32", "reference backend, the native run is in CI: run with --ignored";
    smollm2_q6g128 => "smollm2-135m-q6g128", "reference backend, the native run is in CI: run with --ignored";
    smollm2_q4g64_sharded => "smollm2-135m-q4g64-sharded", "same numerics as smollm2_q4g64: run with --ignored";
    qwen25_q4g64 => "qwen2.5-0.5b-q4g64", "reference backend on a larger directory: run with --ignored";
    qwen25_q8g32 => "qwen2.5-0.5b-q8g32", "reference backend on a larger directory: run with --ignored";
    qwen25_q3g64 => "qwen2.5-0.5b-q3g64", "reference backend on a larger directory: run with --ignored";
    qwen25_mixed36 => "qwen2.5-0.5b-mixed36", "reference backend on a larger directory: run with --ignored";
    gemma3_q4g64 => "gemma3-270m-q4g64", "reference backend on a larger directory: run with --ignored";
    gemma3_q8g32 => "gemma3-270m-q8g32", "reference backend on a larger directory: run with --ignored";
    gemma3_q3g64 => "gemma3-270m-q3g64", "reference backend on a larger directory: run with --ignored";
    gemma3_mixed36 => "gemma3-270m-mixed36", "reference backend on a larger directory: run with --ignored";
    qwen3_q4g64 => "qwen3-synth-q4g64";
    qwen3_q8g32 => "qwen3-synth-q8g32", "reference backend, the native run is in CI: run with --ignored";
    qwen3_q3g64 => "qwen3-synth-q3g64", "reference backend, the native run is in CI: run with --ignored";
    qwen3_mixed36 => "qwen3-synth-mixed36", "reference backend, the native run is in CI: run with --ignored";
}

/// The cost in fidelity of `--mlx-activations q8` (ggml's numerics: the
/// activations quantized to Q8 blocks, integer dots; 4- and 8-bit layouts).
/// Printed for every 4- and 8-bit directory; the bound it asserts is loose
/// (a measurement, not the format's numerics).
#[test]
#[ignore = "measures the Q8-activation flag against mlx-lm: run with --ignored --nocapture"]
fn q8_activations_fidelity() {
    const DIRS: [&str; 7] = [
        "smollm2-135m-q4g64",
        "smollm2-135m-q8g32",
        "qwen2.5-0.5b-q4g64",
        "qwen2.5-0.5b-q8g32",
        "gemma3-270m-q4g64",
        "gemma3-270m-q8g32",
        "qwen3-synth-q4g64",
    ];
    let mut rows = Vec::new();
    for name in DIRS {
        let Some(a) = measure(name, BackendKind::Native, MlxActivations::Q8) else {
            continue;
        };
        rows.push(format!(
            "{}: teacher-forced {}/{}, largest top-10 |diff| {:.4}, greedy divergences {:?}",
            a.label, a.agree, a.positions, a.worst, a.greedy_failures
        ));
        assert!(
            a.agree as f64 >= 0.9 * a.positions as f64,
            "{}: teacher-forced arg-max {}/{} below 0.9",
            a.label,
            a.agree,
            a.positions
        );
    }
    for r in &rows {
        eprintln!("{r}");
    }
}
