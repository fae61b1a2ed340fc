//! Forking a sequence at a prefix (a server's prompt reuse): the copy goes
//! on exactly as a sequence that computed the prefix itself, and a prefix a
//! sliding-window ring no longer holds is refused.

mod common;

use flatrun_runtime::{LoadOptions, Model, StepOptions};

/// Token ids of a long text for `model`.
fn text_tokens(model: &Model, words: usize) -> Vec<u32> {
    let text: String = (0..words)
        .map(|i| format!("word{} is number {i}, ", i % 37))
        .collect();
    model
        .tokenizer()
        .unwrap()
        .encode(&text, true, true)
        .unwrap()
}

/// The logits after `chunks` fed one after another into `seq`.
fn feed(model: &mut Model, seq: &mut flatrun_runtime::Sequence, chunks: &[&[u32]]) -> Vec<f32> {
    let mut logits = Vec::new();
    for chunk in chunks {
        logits = model
            .executor_mut()
            .step(seq, chunk, StepOptions::default())
            .expect("step")
            .logits;
    }
    logits
}

/// Forks a sequence of `prompt_len` (+1) tokens at `cut` and checks the
/// fork against a fresh sequence; with `lost`, a fork at that position (one
/// a sliding window's ring no longer holds) must be refused.
fn check_fork_is_exact(file: &str, prompt_len: usize, cut: usize, lost: Option<usize>) {
    let Some(path) = common::model(file) else {
        return;
    };
    let mut model = Model::load(&path, LoadOptions::default()).expect("load");
    let tokens = text_tokens(&model, prompt_len);
    assert!(tokens.len() >= prompt_len, "{} tokens", tokens.len());
    let tokens = &tokens[..prompt_len];
    let capacity = prompt_len + 64;

    // The source: the whole prompt, then one more token.
    let mut src = model.executor().new_sequence_with_capacity(capacity);
    feed(&mut model, &mut src, &[tokens, &tokens[..1]]);
    assert!(src.kv_used_bytes() > 0 && src.kv_used_bytes() <= src.kv_bytes());

    // A fork at `cut` fed the rest equals a sequence fed the same two chunks.
    let mut fork = model
        .executor()
        .fork_sequence(&src, cut, capacity)
        .expect("fork");
    assert_eq!(fork.len(), cut);
    assert_eq!(fork.tokens(), &tokens[..cut]);
    let forked = feed(&mut model, &mut fork, &[&tokens[cut..]]);
    let mut fresh = model.executor().new_sequence_with_capacity(capacity);
    let direct = feed(&mut model, &mut fresh, &[&tokens[..cut], &tokens[cut..]]);
    assert_eq!(forked, direct, "{file}: forked logits differ");

    // Beyond the source's length there is nothing to copy.
    assert!(
        model
            .executor()
            .fork_sequence(&src, src.len() + 1, capacity)
            .is_none()
    );
    if let Some(lost) = lost {
        assert!(
            model
                .executor()
                .fork_sequence(&src, lost, capacity)
                .is_none()
        );
    }
}

#[test]
#[cfg_attr(debug_assertions, ignore = "real model: run in release")]
fn fork_of_a_full_attention_model_is_exact() {
    check_fork_is_exact("SmolLM2-135M-Instruct.Q4_1.gguf", 300, 250, None);
}

/// Gemma 3's local layers keep a ring of `window + max_batch` slots (512 +
/// 512): after 1201 positions it holds 177..1201, so a cut at 1100 (whose
/// window needs 588..1100) forks exactly, and one at 100 is refused.
#[test]
#[cfg_attr(debug_assertions, ignore = "real model: run in release")]
fn fork_through_a_sliding_window_ring() {
    check_fork_is_exact("gemma-3-270m-q4_k_m.gguf", 1200, 1100, Some(100));
}
