//! A 16k-token prompt with the model's own context (no `ctx` given: 32768
//! for Qwen2.5-Coder, not a 4096 default): the prompt's ids equal
//! llama.cpp's and the greedy answer is llama-server's, token for token.
//!
//! The golden file and the command that made it:
//! `tests/fixtures/long_context/README.md`. A prefill of 16k tokens takes
//! minutes on two cores, so the test runs on demand:
//! `cargo test --release -p flatrun-runtime --test long_context -- --ignored`.

mod common;

use flatrun_runtime::{GenerateOptions, LoadOptions, Model};

const QWEN25: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

struct Golden {
    question: String,
    prompt_tokens: Vec<u32>,
    tokens: Vec<u32>,
    text: String,
}

fn golden() -> Golden {
    let dir = common::fixtures().join("long_context");
    let raw = std::fs::read_to_string(dir.join("qwen25coder-16k.json")).expect("golden file");
    let v: serde_json::Value = serde_json::from_str(&raw).expect("golden JSON");
    let ids = |key: &str| -> Vec<u32> {
        v[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key} missing"))
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    Golden {
        question: v["question"].as_str().expect("question").to_string(),
        prompt_tokens: ids("prompt_tokens"),
        tokens: ids("tokens"),
        text: v["text"].as_str().expect("text").to_string(),
    }
}

/// The chat turn of `scripts/gen_long_context_golden.py`.
fn prompt(question: &str) -> String {
    let dir = common::fixtures().join("long_context");
    let document =
        std::fs::read_to_string(dir.join("python_reference.txt")).expect("reference text");
    format!(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\n{document}\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )
}

#[test]
#[ignore = "slow (a 16k-token prefill, minutes on two cores): run on demand with --ignored"]
fn a_16k_prompt_answers_as_llama_cpp_does() {
    let Some(path) = common::model(QWEN25) else {
        return;
    };
    let golden = golden();
    let mut model = Model::load(&path, LoadOptions::default()).expect("load");
    assert_eq!(
        model.executor().context_size(),
        32768,
        "the model's own context"
    );
    let text = prompt(&golden.question);
    let ids = model.encode(&text, true).expect("encode");
    assert!(ids.len() > 16_000, "{} prompt tokens", ids.len());
    assert_eq!(ids, golden.prompt_tokens, "prompt ids against llama.cpp's");
    let mut opts = GenerateOptions::greedy(golden.tokens.len());
    opts.stop_at_eos = false;
    let mut got = Vec::new();
    let mut answer = String::new();
    for event in model.generate(text.as_str(), opts).expect("generate") {
        let event = event.expect("step");
        got.push(event.id);
        answer.push_str(&event.text);
    }
    assert_eq!(
        got, golden.tokens,
        "ours {answer:?}\nllama.cpp {:?}",
        golden.text
    );
}
