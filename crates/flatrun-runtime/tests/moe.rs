//! Mixture-of-experts families against llama.cpp, on synthetic checkpoints
//! of each family's exact architecture (`scripts/gen_synthetic_moe.py`:
//! real tokenizer vocabularies, seeded random weights, f16 and Q8_0;
//! deterministic, checked by sha256 against `tests/fixtures/moe/manifest.json`
//! and regenerated with `$FLATRUN_PYTHON` when missing).
//!
//! Fixtures: `tests/fixtures/moe/<file>.logits.json`, the reference's
//! teacher-forced top-10 logits at every position of three prompts and a
//! greedy continuation with its top-2 per step, made by
//! `scripts/gen_synthetic_fixtures.sh moe`.
//!
//! Criteria, per file and backend (the bounds of `tests/qwen35.rs`; Qwen3.5-MoE
//! on Q8_0 weights see `HYBRID_QUANTIZED`):
//! arg-max agreement ≥ 99% at the decisive positions (reference top-2 gap
//! ≥ 1) and over all positions (≥ 90% for the reference backend on Q8_0
//! weights, which multiplies unquantized activations where llama.cpp
//! quantizes them), top-10 logits within a tolerance, and the greedy
//! continuation on the reference's path (leaving it only at a near-tie, onto
//! the reference's second choice).
//!
//! Run in release mode: `cargo test --release -p flatrun-runtime --test moe -- --nocapture`.

mod common;

use std::path::PathBuf;

use common::logits::{Bounds, LogitFixture, greedy_on_reference_path, teacher_forced};
use flatrun_runtime::{BackendKind, LoadOptions, Model, Residency};

/// Native kernels (which quantize activations like llama.cpp), or f16 weights.
const STRICT: Bounds = Bounds {
    argmax_share: 0.99,
    decisive_gap: 1.0,
    decisive_share: 0.99,
    top10_tolerance: 0.5,
    top10_share: 0.99,
    mean_tolerance: 0.05,
    min_positions: 100,
};
/// The reference backend on quantized weights (unquantized activations).
const REFERENCE_QUANTIZED: Bounds = Bounds {
    argmax_share: 0.90,
    top10_tolerance: 0.75,
    mean_tolerance: 0.15,
    ..STRICT
};
/// Qwen3.5-MoE with Q8_0 weights: the delta-net layers carry activation
/// rounding along the prompt and a router near-tie turns it into another
/// expert at a few non-decisive positions. Measured (native): arg-max
/// 131/133 (decisive 75/75), top-10 within 0.5 at 129/133, mean 0.061;
/// reference: 133/133, 132/133 within 0.75, mean 0.059.
const HYBRID_QUANTIZED: Bounds = Bounds {
    argmax_share: 0.98,
    top10_tolerance: 0.75,
    top10_share: 0.96,
    mean_tolerance: 0.1,
    ..STRICT
};
/// A greedy step may leave the reference's path only where its top-2 gap is below this.
const NEAR_TIE: f32 = 0.5;

fn bounds(file: &str, backend: BackendKind) -> Bounds {
    let quantized = !file.ends_with("-f16.gguf");
    match backend {
        _ if quantized && file.starts_with("qwen35moe") => HYBRID_QUANTIZED,
        BackendKind::Reference if quantized => REFERENCE_QUANTIZED,
        _ => STRICT,
    }
}

fn fixtures() -> PathBuf {
    common::fixtures().join("moe")
}

/// The model and its fixture, or `None` when skipped.
fn setup(file: &str, backend: BackendKind, residency: Residency) -> Option<(Model, LogitFixture)> {
    let path = common::synthetic::synthetic_model(file, &fixtures(), "gen_synthetic_moe.py")?;
    let fixture = LogitFixture::load(
        &fixtures().join(format!("{}.logits.json", file.trim_end_matches(".gguf"))),
    );
    let opts = LoadOptions {
        backend,
        residency,
        ..LoadOptions::default()
    };
    Some((Model::load(&path, opts).expect("load"), fixture))
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
    let label = format!("{file} [{backend:?}]");
    greedy_on_reference_path(&mut model, &fixture, &label, NEAR_TIE);
}

/// Every check of one synthetic file: logits and greedy, both backends.
macro_rules! family_file {
    ($name:ident, $file:literal) => {
        mod $name {
            use super::*;
            #[test]
            #[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
            fn logits_native() {
                check_logits($file, BackendKind::Native, Residency::Resident);
            }
            #[test]
            #[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
            fn logits_reference() {
                check_logits($file, BackendKind::Reference, Residency::Resident);
            }
            #[test]
            #[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
            fn greedy_native() {
                check_greedy($file, BackendKind::Native);
            }
            #[test]
            #[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
            fn greedy_reference() {
                check_greedy($file, BackendKind::Reference);
            }
        }
    };
}

family_file!(qwen3moe_f16, "qwen3moe-synth-f16.gguf");
family_file!(qwen3moe_q8_0, "qwen3moe-synth-q8_0.gguf");
family_file!(mixtral_f16, "mixtral-synth-f16.gguf");
family_file!(mixtral_q8_0, "mixtral-synth-q8_0.gguf");
family_file!(olmoe_f16, "olmoe-synth-f16.gguf");
family_file!(olmoe_q8_0, "olmoe-synth-q8_0.gguf");
family_file!(qwen2moe_f16, "qwen2moe-synth-f16.gguf");
family_file!(qwen2moe_q8_0, "qwen2moe-synth-q8_0.gguf");
family_file!(qwen35moe_f16, "qwen35moe-synth-f16.gguf");
family_file!(qwen35moe_q8_0, "qwen35moe-synth-q8_0.gguf");

/// Streamed layers: the routed experts' rows come through the weight engine.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen3moe_q8_0_native_streamed() {
    check_logits(
        "qwen3moe-synth-q8_0.gguf",
        BackendKind::Native,
        Residency::Stream,
    );
}

/// In stream mode a decode step reads only the routed experts' rows: per
/// layer and token, `k` experts' gate, up and down of the `n_expert` stacked.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn streamed_decode_reads_only_the_routed_experts() {
    let file = "qwen3moe-synth-q8_0.gguf";
    let Some((mut model, fixture)) = setup(file, BackendKind::Native, Residency::Stream) else {
        return;
    };
    let moe = model.executor().config().moe.clone().expect("experts");
    let stacked: u64 = model
        .executor()
        .manifest()
        .layers
        .iter()
        .flat_map(|l| &l.tensors)
        .filter(|t| t.role().is_some_and(|r| r.is_experts()))
        .map(|t| t.bytes)
        .sum();
    let token = fixture.teacher_forced[0].tokens[0];
    model.session().step(&[token]).expect("one-token step");
    let read: u64 = model
        .executor()
        .profiler
        .layers
        .iter()
        .map(|l| l.expert_bytes_read)
        .sum();
    let want = stacked * moe.n_expert_used as u64 / moe.n_expert as u64;
    eprintln!(
        "{file}: one decode step read {read} expert bytes of {stacked} stacked (top-{} of {})",
        moe.n_expert_used, moe.n_expert
    );
    assert_eq!(
        read, want,
        "a decode step reads exactly the routed experts' rows"
    );
}

/// Logits of the first fixture prompt in one step, then of `decode` tokens
/// one step each (the decode path's fused experts).
fn prompt_and_decode(model: &mut Model, tokens: &[u32], decode: usize) -> Vec<Vec<f32>> {
    let (prompt, rest) = tokens.split_at(tokens.len() - decode);
    let mut session = model.session();
    let mut out = vec![
        session
            .step_with(
                prompt,
                flatrun_runtime::StepOptions {
                    all_logits: true,
                    ..Default::default()
                },
            )
            .expect("prefill")
            .all_logits
            .expect("all logits"),
    ];
    for &t in rest {
        out.push(session.step(&[t]).expect("decode step"));
    }
    out
}

/// Under a cap that cannot hold the model, a mixture-of-experts layer keeps
/// its dense part and reads each routed expert once routed, through the
/// expert cache: the logits are the resident ones bit for bit (prefill and
/// decode, either policy), every expert a pass needs is counted once as a
/// hit or a miss, and under LFU the second run of a prompt finds experts
/// cached.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn capped_experts_come_through_the_cache_bit_for_bit() {
    use flatrun_runtime::ExpertPolicy;
    for file in [
        "qwen3moe-synth-q8_0.gguf",
        "mixtral-synth-f16.gguf",
        "qwen2moe-synth-q8_0.gguf",
        "qwen35moe-synth-q8_0.gguf",
    ] {
        let Some((mut resident, fixture)) = setup(file, BackendKind::Native, Residency::Resident)
        else {
            return;
        };
        let tokens = &fixture.teacher_forced[0].tokens;
        let want = prompt_and_decode(&mut resident, tokens, 4);
        let manifest = resident.executor().manifest().clone();
        let experts: u64 = manifest.layers.iter().map(|l| l.expert_bytes()).sum();
        let dense: u64 = manifest.layers.iter().map(|l| l.dense_bytes()).sum();
        // Room for the dense parts, the head and about half the experts,
        // besides the read buffers a cap pays for (two of the largest
        // streamed item: a dense layer, or a head chunk of 1-4 MiB).
        let chunk = manifest.largest_layer_bytes().clamp(1 << 20, 4 << 20);
        let buffers = 2 * manifest.largest_dense_layer_bytes().max(chunk);
        let cap = dense + manifest.output.bytes + experts / 2 + buffers;
        // Without reading ahead: the same bits, nothing read ahead.
        let path = common::synthetic::synthetic_model(file, &fixtures(), "gen_synthetic_moe.py")
            .expect("generated above");
        let mut plain = Model::load(
            &path,
            LoadOptions {
                residency: Residency::Cap(cap),
                expert_prefetch: false,
                ..LoadOptions::default()
            },
        )
        .expect("load capped");
        let got = prompt_and_decode(&mut plain, tokens, 4);
        common::logits::assert_bit_identical(&got, &want, &format!("{file} capped, no read-ahead"));
        let stats = plain.profiler().experts();
        assert_eq!((stats.ahead_used, stats.ahead_wasted), (0, 0), "{file}");
        for policy in [ExpertPolicy::Lru, ExpertPolicy::Lfu] {
            let path =
                common::synthetic::synthetic_model(file, &fixtures(), "gen_synthetic_moe.py")
                    .expect("generated above");
            let mut model = Model::load(
                &path,
                LoadOptions {
                    residency: Residency::Cap(cap),
                    expert_policy: policy,
                    ..LoadOptions::default()
                },
            )
            .expect("load capped");
            let plan = model.executor().residency().clone();
            assert!(plan.split_experts, "{file}: the cap splits the experts off");
            assert!(
                plan.expert_cache_bytes > 0 && plan.expert_cache_bytes < experts,
                "{file}: an expert cache of part of the experts ({} of {experts})",
                plan.expert_cache_bytes
            );
            let got = prompt_and_decode(&mut model, tokens, 4);
            common::logits::assert_bit_identical(
                &got,
                &want,
                &format!("{file} capped ({policy:?}) vs resident"),
            );
            let first = model.profiler().experts();
            let again = prompt_and_decode(&mut model, tokens, 4);
            common::logits::assert_bit_identical(&again, &want, &format!("{file} again"));
            let second = model.profiler().experts().since(&first);
            let (held, budget) = model.executor().expert_cache();
            eprintln!(
                "{file} {policy:?}: cache {held} of {budget} bytes; first run {first:?} ({:.0}% hits), second {second:?} ({:.0}% hits)",
                100.0 * first.hit_rate(),
                100.0 * second.hit_rate()
            );
            assert!(first.misses > 0 && held <= budget);
            // Each layer predicted the next one's experts and read them
            // ahead; some of those reads were the router's choices.
            assert!(
                first.ahead_used > 0 && first.ahead_used <= first.misses,
                "{file}: experts read ahead and used ({first:?})"
            );
            assert_eq!(
                first.hits + first.misses,
                second.hits + second.misses,
                "{file}: the same passes need the same experts"
            );
            // LFU keeps what it cached; LRU, over a repeated sequence of
            // more experts than it holds, gives each up before its reuse.
            if policy == ExpertPolicy::Lfu {
                assert!(
                    second.hits > first.hits,
                    "{file}: the second run finds cached experts"
                );
            }
        }
    }
}

/// Stream mode given an expert cache that holds every expert reads each
/// expert once: a repeated prompt reads nothing more.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn a_cache_of_every_expert_reads_each_once() {
    let file = "qwen3moe-synth-q8_0.gguf";
    let Some(path) = common::synthetic::synthetic_model(file, &fixtures(), "gen_synthetic_moe.py")
    else {
        return;
    };
    let fixture = LogitFixture::load(&fixtures().join("qwen3moe-synth-q8_0.logits.json"));
    let mut model = Model::load(
        &path,
        LoadOptions {
            residency: Residency::Stream,
            expert_cache_bytes: Some(1 << 30),
            ..LoadOptions::default()
        },
    )
    .expect("load");
    model.profiler_mut().trace_experts();
    let tokens = &fixture.teacher_forced[0].tokens;
    prompt_and_decode(&mut model, tokens, 4);
    let first = model.profiler().experts();
    prompt_and_decode(&mut model, tokens, 4);
    let second = model.profiler().experts().since(&first);
    assert_eq!(second.misses, 0, "every expert was cached: {second:?}");
    assert_eq!(second.bytes_read, 0);
    let trace = model.profiler().expert_trace.clone().expect("traced");
    assert_eq!(
        trace.len() as u64,
        first.hits + first.misses + second.hits + second.misses,
        "one trace entry per expert a pass needed"
    );
}
