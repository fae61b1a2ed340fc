//! The scale model's shapes in CI: a synthetic `qwen3moe` with
//! Qwen3-30B-A3B's layers (width 2048, 128 experts of 768, top-8, Q4_K_M
//! types; `scripts/gen_moe_scale.py --layers 2`, about 1.1 GiB, written on
//! first use into `$FLATRUN_SYNTHETIC/scale`). The 48-layer, 17 GiB file is
//! the benchmark's (`benches/race/moe_scale.py`), not CI's.
//!
//! Checked here on real-sized experts: stream mode reads exactly the routed
//! experts' bytes per decoded token; a cap that keeps the dense parts and a
//! quarter of the experts gives the resident logits bit for bit, and its
//! cache turns repeated routing into hits.
//!
//! Run in release mode: `cargo test --release -p flatrun-runtime --test moe_scale -- --nocapture`.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::synthetic::{python, require_models, synthetic_dir};
use flatrun_runtime::{LoadOptions, Model, Residency, StepOptions};

/// The 2-layer scale file, generated when missing (the script caches it
/// behind a sidecar of its size and sha256).
fn scale_model() -> Option<PathBuf> {
    let py = python();
    if !py.exists() {
        assert!(!require_models(), "{} is missing", py.display());
        eprintln!(
            "skipping: {} not found (run scripts/setup-test-env.sh)",
            py.display()
        );
        return None;
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gen_moe_scale.py");
    let out = Command::new(&py)
        .arg(&script)
        .args(["--layers", "2", "--out"])
        .arg(synthetic_dir().join("scale"))
        .output()
        .expect("run gen_moe_scale.py");
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        assert!(!require_models(), "gen_moe_scale.py failed: {why}");
        eprintln!("skipping: gen_moe_scale.py failed: {why}");
        return None;
    }
    let path = PathBuf::from(
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .lines()
            .last()?
            .trim(),
    );
    Some(path)
}

fn load(path: &PathBuf, residency: Residency) -> Model {
    Model::load(
        path,
        LoadOptions {
            residency,
            ctx: Some(64),
            ..LoadOptions::default()
        },
    )
    .expect("load the scale model")
}

const PROMPT: [u32; 6] = [785, 3974, 315, 9625, 374, 12095];

/// The prompt's logits in one step, then `decode` greedy tokens one step each.
fn run(model: &mut Model, decode: usize) -> Vec<Vec<f32>> {
    let mut session = model.session();
    let first = session
        .step_with(
            &PROMPT,
            StepOptions {
                all_logits: true,
                ..Default::default()
            },
        )
        .expect("prefill")
        .all_logits
        .expect("all logits");
    let vocab = first.len() / PROMPT.len();
    let mut next = flatrun_runtime::argmax(&first[first.len() - vocab..]);
    let mut out = vec![first];
    for _ in 0..decode {
        let logits = session.step(&[next]).expect("decode");
        next = flatrun_runtime::argmax(&logits);
        out.push(logits);
    }
    out
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn scale_shapes_stream_and_cap_read_only_routed_experts_bit_for_bit() {
    let Some(path) = scale_model() else { return };
    let mut resident = load(&path, Residency::Resident);
    let want = run(&mut resident, 4);
    let manifest = resident.executor().manifest().clone();
    drop(resident);
    let counts = manifest.experts.expect("a mixture-of-experts model");
    assert_eq!((counts.n_expert, counts.n_used), (128, 8));
    let experts: u64 = manifest.layers.iter().map(|l| l.expert_bytes()).sum();
    let dense: u64 = manifest.layers.iter().map(|l| l.dense_bytes()).sum();
    let used = manifest.used_expert_bytes_per_token();

    // Stream mode: each decode step reads exactly its 8 experts per layer.
    let mut stream = load(&path, Residency::Stream);
    let mut session = stream.session();
    session.step(&PROMPT).expect("prefill");
    let before = session.model().profiler().experts();
    session.step(&[PROMPT[0]]).expect("decode");
    let step = session.model().profiler().experts().since(&before);
    drop(session);
    eprintln!("stream: one decode step {step:?}, {used} bytes used per token");
    assert_eq!(
        step.bytes_read, used,
        "a decode step reads the routed experts' bytes"
    );
    assert_eq!(step.misses, (counts.n_used * manifest.layers.len()) as u64);
    let got = run(&mut stream, 4);
    common::logits::assert_bit_identical(&got, &want, "stream vs resident");
    drop(stream);

    // A cap holding the dense parts, the head and a quarter of the experts.
    let cap =
        dense + manifest.output.bytes + experts / 4 + 2 * manifest.largest_dense_layer_bytes();
    let mut capped = load(&path, Residency::Cap(cap));
    let plan = capped.executor().residency().clone();
    assert!(plan.split_experts && plan.expert_cache_bytes > experts / 8);
    let got = run(&mut capped, 4);
    common::logits::assert_bit_identical(&got, &want, "cap vs resident");
    let first = capped.profiler().experts();
    let again = run(&mut capped, 4);
    common::logits::assert_bit_identical(&again, &want, "cap, second run");
    let second = capped.profiler().experts().since(&first);
    let (held, budget) = capped.executor().expert_cache();
    eprintln!(
        "cap {cap}: cache {held} of {budget}; first run {first:?} ({:.0}% hits), second {second:?} ({:.0}% hits)",
        100.0 * first.hit_rate(),
        100.0 * second.hit_rate()
    );
    assert!(held <= budget);
    assert!(second.hits > 0 && second.bytes_read < first.bytes_read);
}
