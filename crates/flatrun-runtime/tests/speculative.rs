//! Speculative decoding changes how many tokens a pass yields, never which:
//! greedy generation with prompt lookup or with a draft model is token for
//! token the generation without it (same text, same finish, same sequence
//! left behind), on the real models and on every synthetic family —
//! Qwen3.5's recurrent state included, which a rejected proposal must roll
//! back. With sampling, speculative sampling keeps the target's
//! distribution: a chi-square test compares the tokens it yields with plain
//! sampling's.

mod common;

use flatrun_runtime::{
    FinishReason, GenerateOptions, LayerSelection, LoadOptions, Model, Residency, RuntimeError,
    SamplingParams, Speculation,
};
use std::path::{Path, PathBuf};

/// Prompts that give the proposers something to match (a list, code that
/// repeats itself, prose, a chat turn).
const PROMPTS: &[&str] = &[
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived",
];

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

/// What a generation produced: the token ids, the finish, and the
/// sequence's tokens afterwards.
#[derive(Debug, PartialEq)]
struct Outcome {
    ids: Vec<u32>,
    text: String,
    finish: Option<FinishReason>,
    sequence: Vec<u32>,
}

fn generate(model: &mut Model, prompt: &str, opts: GenerateOptions) -> Outcome {
    let tokens = model.encode(prompt, true).expect("encode");
    let seq = model.new_sequence();
    let mut generation = model.generate_in(seq, tokens, opts).expect("generate");
    let mut out = Outcome {
        ids: Vec::new(),
        text: String::new(),
        finish: None,
        sequence: Vec::new(),
    };
    for event in generation.by_ref() {
        let event = event.expect("token");
        out.ids.push(event.id);
        out.text.push_str(&event.text);
        if event.finish.is_some() {
            out.finish = event.finish;
            break;
        }
    }
    out.sequence = generation.into_sequence().tokens().to_vec();
    out
}

/// Greedy generation of `target` with no speculation, with prompt lookup,
/// and with `draft` attached: all three agree on every prompt. Returns the
/// proposals and acceptances of the draft runs.
fn check_exact(target: &Path, draft: Model, prompts: &[&str], max_new: usize) -> (usize, usize) {
    let mut model = load(target, None);
    model.set_draft(draft).expect("same vocabulary");
    let greedy = |speculation| GenerateOptions {
        speculation,
        stop: vec!["\n\n\n".into()],
        ..GenerateOptions::greedy(max_new)
    };
    let (mut proposed, mut accepted) = (0, 0);
    for prompt in prompts {
        let plain = generate(&mut model, prompt, greedy(None));
        // Lookup grows to 6 proposals; the draft proposes a fixed 3 (a draft
        // that is often wrong would otherwise shrink to one).
        for spec in [
            Speculation::lookup(6),
            Speculation {
                adaptive: false,
                ..Speculation::draft(3)
            },
        ] {
            let before = model.profiler().speculative;
            let fast = generate(&mut model, prompt, greedy(Some(spec.clone())));
            assert_eq!(
                fast,
                plain,
                "{}: {spec:?} differs on {prompt:?}",
                target.display()
            );
            let after = model.profiler().speculative;
            if spec.proposer == flatrun_runtime::ProposerKind::Draft {
                proposed += after.proposed - before.proposed;
                accepted += after.accepted - before.accepted;
            }
        }
    }
    (proposed, accepted)
}

/// A draft of `path` itself with only some of its layers: cheaper and
/// wrong often enough that rejections (and the rollback) are exercised.
fn partial_draft(path: &Path, layers: &str) -> Model {
    load(path, Some(layers))
}

fn assert_rejections(what: &str, (proposed, accepted): (usize, usize)) {
    eprintln!("{what}: {accepted} of {proposed} draft proposals accepted");
    assert!(proposed > 0, "{what}: no proposals");
    assert!(accepted < proposed, "{what}: no rejection to roll back");
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn greedy_speculation_is_exact_on_the_real_models() {
    for (file, draft_layers) in [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "0-9"),
        ("gemma-3-270m-q4_k_m.gguf", "0-5"),
        ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "0-7"),
    ] {
        let Some(path) = common::model(file) else {
            continue;
        };
        let stats = check_exact(&path, partial_draft(&path, draft_layers), &PROMPTS[..2], 24);
        assert_rejections(file, stats);
    }
}

fn synthetic(file: &str, dir: &str, generator: &str) -> Option<PathBuf> {
    common::synthetic::synthetic_model(file, &common::fixtures().join(dir), generator)
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn greedy_speculation_is_exact_on_every_synthetic_family() {
    // The f16 checkpoint drafts for its quantized twin: the same weights up
    // to rounding, so most proposals stand and some do not.
    for (target, draft, dir, generator) in [
        (
            "llama3-synth-q8_0.gguf",
            "llama3-synth-f16.gguf",
            "families",
            "gen_synthetic_models.py",
        ),
        (
            "qwen3-synth-q8_0.gguf",
            "qwen3-synth-f16.gguf",
            "families",
            "gen_synthetic_models.py",
        ),
        (
            "bonsai-synth-q1_0.gguf",
            "bonsai-synth-f16.gguf",
            "families",
            "gen_synthetic_models.py",
        ),
        (
            "qwen35-synth-q8_0.gguf",
            "qwen35-synth-f16.gguf",
            "qwen35",
            "gen_synthetic_qwen35.py",
        ),
    ] {
        let (Some(target_path), Some(draft_path)) = (
            synthetic(target, dir, generator),
            synthetic(draft, dir, generator),
        ) else {
            continue;
        };
        let mut stats = check_exact(&target_path, load(&draft_path, None), PROMPTS, 32);
        eprintln!("{target} drafted by {draft}: {stats:?}");
        if target.starts_with("qwen35") || stats.1 == stats.0 {
            // A draft with half the layers rejects often: every rollback
            // path (Qwen3.5's recurrent state's included) is taken many times.
            let n_layer = load(&target_path, None).config().n_layer;
            let half = format!("0-{}", (n_layer / 2).max(1) - 1);
            stats = check_exact(
                &target_path,
                partial_draft(&target_path, &half),
                &PROMPTS[..2],
                32,
            );
        }
        assert_rejections(target, stats);
    }
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn a_draft_with_another_vocabulary_is_refused() {
    let (Some(qwen), Some(smol)) = (
        common::model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        common::model("SmolLM2-135M-Instruct.Q4_1.gguf"),
    ) else {
        return;
    };
    let mut model = load(&smol, None);
    let err = model.set_draft(load(&qwen, None)).unwrap_err();
    assert!(matches!(err, RuntimeError::Draft(_)), "{err}");
    assert!(err.to_string().contains("tokenizer"), "{err}");
    // Asking for a draft that is not attached is an error too, not a panic.
    let err = model
        .generate(
            "Hello",
            GenerateOptions {
                speculation: Some(Speculation::draft(4)),
                ..GenerateOptions::greedy(4)
            },
        )
        .err()
        .expect("no draft attached");
    assert!(matches!(err, RuntimeError::Draft(_)), "{err}");
}

/// The upper 0.1% point of chi-square with `df` degrees of freedom
/// (Wilson–Hilferty).
fn chi2_critical_001(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.090; // standard normal, upper 0.1%
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// The second generated token of `draws` seeded runs (the first comes from
/// the prompt's pass; the second, with speculation, from a verification).
fn second_tokens(
    model: &mut Model,
    prompt: &[u32],
    spec: Option<Speculation>,
    draws: u64,
) -> Vec<u32> {
    let (head, last) = prompt.split_at(prompt.len() - 1);
    let mut seq = model.new_sequence();
    model
        .executor_mut()
        .step(&mut seq, head, Default::default())
        .expect("prefill");
    let mut out = Vec::new();
    for seed in 0..draws {
        let opts = GenerateOptions {
            sampling: SamplingParams {
                temperature: 1.0,
                top_k: 6,
                seed: Some(seed * 7 + 1),
                ..SamplingParams::default()
            },
            stop_at_eos: false,
            speculation: spec.clone(),
            ..GenerateOptions::greedy(2)
        };
        let mut generation = model
            .generate_in(seq, last.to_vec(), opts)
            .expect("generate");
        let ids: Vec<u32> = generation.by_ref().map(|e| e.expect("token").id).collect();
        out.push(ids[1]);
        seq = generation.into_sequence();
        seq.truncate(head.len());
    }
    out
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn speculative_sampling_keeps_the_target_distribution() {
    let Some(path) = common::model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let mut model = load(&path, None);
    model
        .set_draft(partial_draft(&path, "0-23"))
        .expect("same vocabulary");
    let prompt = model
        .encode("My favourite colour is", true)
        .expect("encode");
    let draws = 500;
    let plain = second_tokens(&mut model, &prompt, None, draws);
    let before = model.profiler().speculative;
    let fast = second_tokens(&mut model, &prompt, Some(Speculation::draft(2)), draws);
    let stats = model.profiler().speculative;
    let (proposed, accepted) = (
        stats.proposed - before.proposed,
        stats.accepted - before.accepted,
    );
    eprintln!("draft proposals: {accepted} of {proposed} accepted");
    assert!(
        accepted > 0 && accepted < proposed,
        "both verdicts must occur"
    );

    // Chi-square test of homogeneity; tokens seen fewer than 10 times in
    // both samples together share one cell.
    let mut counts = std::collections::BTreeMap::<u32, (f64, f64)>::new();
    for &t in &plain {
        counts.entry(t).or_default().0 += 1.0;
    }
    for &t in &fast {
        counts.entry(t).or_default().1 += 1.0;
    }
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut rare = (0.0, 0.0);
    for &(a, b) in counts.values() {
        if a + b < 10.0 {
            rare.0 += a;
            rare.1 += b;
        } else {
            cells.push((a, b));
        }
    }
    if rare.0 + rare.1 > 0.0 {
        cells.push(rare);
    }
    let n = draws as f64;
    let chi2: f64 = cells
        .iter()
        .map(|&(a, b)| {
            let expected = (a + b) / 2.0;
            (a - expected).powi(2) / expected + (b - expected).powi(2) / expected
        })
        .sum();
    let df = cells.len().saturating_sub(1).max(1);
    let critical = chi2_critical_001(df);
    eprintln!(
        "{} cells over {n} + {n} draws: chi2 {chi2:.2}, critical (p = 0.001) {critical:.2}",
        cells.len()
    );
    assert!(
        cells.len() >= 3,
        "too few distinct tokens to test: {cells:?}"
    );
    assert!(chi2 < critical, "distributions differ: {cells:?}");
}

/// A verification pass gives every position the bits of a one-token step
/// (the kernels sum in the one-token order inside it), from 2 to 9 tokens:
/// K-quant tiles of 4, the tiled order from 8 tokens, f16 attention scores.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn verification_logits_equal_one_token_steps() {
    for file in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ] {
        let Some(path) = common::model(file) else {
            continue;
        };
        let mut model = load(&path, None);
        let prompt = model
            .encode(
                "The quick brown fox jumps over the lazy dog. The quick",
                true,
            )
            .expect("encode");
        let extra = model
            .encode(" brown fox is a classic example of a sentence", false)
            .expect("encode");
        let vocab = model.executor().vocab_size();
        let ex = model.executor_mut();
        for n in [2, 4, 5, 9] {
            let extra = &extra[..n.min(extra.len())];
            let (mut one, mut many) = (ex.new_sequence(), ex.new_sequence());
            ex.step(&mut one, &prompt, Default::default())
                .expect("prefill");
            ex.step(&mut many, &prompt, Default::default())
                .expect("prefill");
            let all = ex
                .step_batch_verify(
                    &mut [(&mut many, extra)],
                    flatrun_runtime::StepOptions {
                        all_logits: true,
                        ..Default::default()
                    },
                )
                .expect("verify")
                .pop()
                .and_then(|o| o.all_logits)
                .expect("all logits");
            for (i, &t) in extra.iter().enumerate() {
                let single = ex
                    .step(&mut one, &[t], Default::default())
                    .expect("step")
                    .logits;
                let batched = &all[i * vocab..(i + 1) * vocab];
                let same = single
                    .iter()
                    .zip(batched)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{file}: position {i} of a {n}-token pass differs from its own step"
                );
            }
        }
    }
}
