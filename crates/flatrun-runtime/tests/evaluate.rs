//! `Model::score` (teacher-forced log-probabilities of a text's own tokens)
//! and `Model::embed` (pooled sequence embeddings) on a real model.

mod common;

use common::logits::LogitFixture;
use flatrun_model::sampling::token_logprobs;
use flatrun_runtime::{LoadOptions, Model, StepOptions};

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn load() -> Option<Model> {
    let path = common::model(MODEL)?;
    Some(Model::load(&path, LoadOptions::default()).expect("load"))
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// Every scored entry is the log-softmax of the logits one whole-prompt
/// step gives at the position before it, and its best alternative is the
/// reference's arg-max wherever the reference is not at a near-tie.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn score_is_the_log_softmax_of_the_teacher_forced_logits() {
    let Some(mut model) = load() else { return };
    let fixture =
        LogitFixture::load(&common::fixtures().join("SmolLM2-135M-Instruct.Q4_1.logits.json"));
    let vocab = model.executor().vocab_size();
    let mut positions = 0;
    for case in &fixture.teacher_forced {
        let tokens = &case.tokens;
        let scored = model.score(tokens, 3).expect("score");
        assert_eq!(scored.len(), tokens.len() - 1);
        let all = model
            .session()
            .step_with(
                tokens,
                StepOptions {
                    all_logits: true,
                    ..StepOptions::default()
                },
            )
            .expect("step")
            .all_logits
            .unwrap();
        for (i, entry) in scored.iter().enumerate() {
            let row = &all[i * vocab..(i + 1) * vocab];
            let expected = token_logprobs(row, tokens[i + 1], 3);
            assert_eq!(entry.token, tokens[i + 1]);
            assert!(
                (entry.logprob - expected.logprob).abs() < 2e-3,
                "position {i}: {} vs {}",
                entry.logprob,
                expected.logprob
            );
            assert!(entry.logprob <= 0.0 && entry.top.len() == 3);
            let reference = &case.top_logits[i];
            if reference[0] - reference[1] >= 0.1 {
                assert_eq!(entry.top[0].0, case.top_ids[i][0], "position {i}");
            }
            positions += 1;
        }
    }
    assert!(positions > 100, "{positions} positions scored");
    // One token has no context to be scored in.
    assert!(
        model
            .score(&fixture.teacher_forced[0].tokens[..1], 3)
            .unwrap()
            .is_empty()
    );
}

/// The vector of an input does not depend on what else shares its batch,
/// is unit length, is the mean of the final-normed hidden states, and
/// differs between texts.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn embeddings_are_mean_pooled_normalized_and_batch_independent() {
    let Some(mut model) = load() else { return };
    let texts = [
        "The cat sat on the mat.",
        "A kitten was sitting on the rug, purring quietly in the afternoon sun.",
        "Quarterly revenue grew by twelve percent.",
    ];
    let inputs: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| model.encode(t, true).unwrap())
        .collect();
    let batched = model.embed(&inputs).expect("embed");
    assert_eq!(batched.len(), 3);
    let d = model.config().n_embd;
    for (input, vector) in inputs.iter().zip(&batched) {
        assert_eq!(vector.len(), d);
        let norm: f64 = vector
            .iter()
            .map(|x| f64::from(*x).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        let alone = model.embed(std::slice::from_ref(input)).unwrap().remove(0);
        assert!(
            cosine(vector, &alone) > 0.99999,
            "{}",
            cosine(vector, &alone)
        );
        // The mean of the hidden states of a plain step, normalized.
        let states = model
            .session()
            .step_with(
                input,
                StepOptions {
                    all_hidden: true,
                    no_logits: true,
                    ..StepOptions::default()
                },
            )
            .unwrap()
            .all_hidden
            .unwrap();
        assert_eq!(states.len(), input.len() * d);
        let mut mean = vec![0.0f32; d];
        for row in states.chunks_exact(d) {
            mean.iter_mut().zip(row).for_each(|(m, x)| *m += x);
        }
        assert!(cosine(vector, &mean) > 0.99999);
    }
    // Different texts get different vectors.
    for (a, b) in [(0, 1), (0, 2), (1, 2)] {
        let c = cosine(&batched[a], &batched[b]);
        assert!(c < 0.9999, "texts {a} and {b}: cosine {c}");
    }
    // An empty input is refused, not pooled into NaNs.
    assert!(model.embed(&[Vec::new()]).is_err());
}

/// The vectors llama.cpp's server gives for the same texts (mean pooling,
/// normalized; `tests/fixtures/embeddings/`, made by
/// `scripts/gen_embedding_fixtures.py`).
fn matches_llama_cpp(model_file: &str) {
    let Some(path) = common::model(model_file) else {
        return;
    };
    let stem = model_file.trim_end_matches(".gguf");
    let fixture_path = common::fixtures().join(format!("embeddings/{stem}.json"));
    let text = std::fs::read_to_string(&fixture_path).expect("fixture");
    let fixture: serde_json::Value = serde_json::from_str(&text).expect("fixture JSON");
    let mut model = Model::load(&path, LoadOptions::default()).expect("load");
    let texts: Vec<&str> = fixture["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let inputs: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| model.encode(t, true).unwrap())
        .collect();
    let ours = model.embed(&inputs).expect("embed");
    let mut worst = 1.0f64;
    for (i, (vector, reference)) in ours
        .iter()
        .zip(fixture["embeddings"].as_array().unwrap())
        .enumerate()
    {
        let reference = common::logits::floats(reference);
        assert_eq!(vector.len(), reference.len(), "text {i}");
        let c = cosine(vector, &reference);
        worst = worst.min(c);
        assert!(
            c > 0.9995,
            "{model_file} text {i}: cosine {c} with llama.cpp"
        );
    }
    eprintln!("{model_file}: least cosine with llama.cpp {worst:.6}");
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn embeddings_match_llama_cpp_smollm2() {
    matches_llama_cpp(MODEL);
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn embeddings_match_llama_cpp_qwen25() {
    matches_llama_cpp("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
}
