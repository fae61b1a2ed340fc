//! Tokenization of arbitrary text and decoding of arbitrary ids, for each
//! supported tokenizer family: must never panic, ids stay in the vocabulary,
//! and decoding what was encoded gives the text back.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use flatrun_format::{MetaValue, Metadata};
use flatrun_model::tokenizer::{StreamDecoder, Tokenizer};
use libfuzzer_sys::fuzz_target;

/// A tiny synthetic vocabulary of each family, plus the llama.cpp vocab
/// files of `$FLATRUN_VOCAB` when they are present.
fn tokenizers() -> &'static [Tokenizer] {
    static ALL: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    ALL.get_or_init(|| {
        let mut all = vec![synthetic_bpe(), synthetic_spm()];
        let dir = std::env::var_os("FLATRUN_VOCAB")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                    .join(".cache/flatrun/vocab")
            });
        for name in [
            "llama-spm",
            "qwen2",
            "llama-bpe",
            "gpt-2",
            "deepseek-llm",
            "deepseek-coder",
            "falcon",
            "starcoder",
            "phi-3",
        ] {
            let path = dir.join(format!("ggml-vocab-{name}.gguf"));
            if let Ok(backend) = flatrun_format::open(&path) {
                if let Ok(tok) = Tokenizer::from_gguf_metadata(backend.metadata()) {
                    all.push(tok);
                }
            }
        }
        all
    })
}

fn strings(items: &[&str]) -> MetaValue {
    MetaValue::Array(
        items
            .iter()
            .map(|s| MetaValue::String(s.to_string()))
            .collect(),
    )
}

fn synthetic_bpe() -> Tokenizer {
    // Every byte as a GPT-2 character, a few merges and a control token.
    let mut tokens: Vec<String> = (0u32..256)
        .map(|b| {
            let printable = (0x21..=0x7e).contains(&b)
                || (0xa1..=0xac).contains(&b)
                || (0xae..=0xff).contains(&b);
            if printable {
                char::from_u32(b).unwrap().to_string()
            } else {
                String::new()
            }
        })
        .collect();
    let mut shifted = 0x100;
    for t in tokens.iter_mut().filter(|t| t.is_empty()) {
        *t = char::from_u32(shifted).unwrap().to_string();
        shifted += 1;
    }
    tokens.extend(["Ġt", "he", "Ġthe", "<|im_start|>"].map(String::from));
    let mut types = vec![MetaValue::I32(1); tokens.len()];
    types[tokens.len() - 1] = MetaValue::I32(3);
    let md = Metadata {
        entries: vec![
            (
                "tokenizer.ggml.model".into(),
                MetaValue::String("gpt2".into()),
            ),
            (
                "tokenizer.ggml.pre".into(),
                MetaValue::String("qwen2".into()),
            ),
            (
                "tokenizer.ggml.tokens".into(),
                MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
            ),
            ("tokenizer.ggml.token_type".into(), MetaValue::Array(types)),
            (
                "tokenizer.ggml.merges".into(),
                strings(&["Ġ t", "h e", "Ġt he"]),
            ),
        ],
    };
    Tokenizer::from_gguf_metadata(&md).expect("synthetic BPE")
}

fn synthetic_spm() -> Tokenizer {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    tokens.extend((0..256).map(|b| format!("<0x{b:02X}>")));
    tokens.extend(["▁", "a", "b", "▁a", "ab", "▁ab", "<start_of_turn>"].map(String::from));
    let n = tokens.len();
    let types: Vec<MetaValue> = (0..n)
        .map(|i| {
            MetaValue::I32(if i < 3 || i == n - 1 {
                3
            } else if i < 259 {
                6
            } else {
                1
            })
        })
        .collect();
    let scores: Vec<MetaValue> = (0..n).map(|i| MetaValue::F32(-(i as f32))).collect();
    let md = Metadata {
        entries: vec![
            (
                "tokenizer.ggml.model".into(),
                MetaValue::String("llama".into()),
            ),
            (
                "tokenizer.ggml.tokens".into(),
                MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
            ),
            ("tokenizer.ggml.token_type".into(), MetaValue::Array(types)),
            ("tokenizer.ggml.scores".into(), MetaValue::Array(scores)),
        ],
    };
    Tokenizer::from_gguf_metadata(&md).expect("synthetic SPM")
}

fuzz_target!(init: {
    // Load the vocabularies once, outside the per-input timeout.
    tokenizers();
}, |data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let all = tokenizers();
    let tok = &all[selector as usize % all.len()];
    let add_special = selector & 0x40 != 0;
    let parse_special = selector & 0x80 != 0;
    let text = String::from_utf8_lossy(rest);
    let ids = tok
        .encode(&text, add_special, parse_special)
        .expect("encode never fails on text");
    assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
    // Round trip, for vocabularies that can spell every byte (falcon, for
    // one, has no token for some control bytes and drops them, like llama.cpp;
    // SentencePiece reads a literal `▁` back as a space, like llama.cpp).
    if !add_special && !parse_special && (selector as usize % all.len()) < 6 && !text.contains('\u{2581}') {
        assert_eq!(tok.decode(&ids, false).expect("decode"), text, "round trip");
    }
    // Arbitrary ids: decoding may refuse out-of-range ids but never panics.
    let raw: Vec<u32> = rest
        .chunks(2)
        .map(|c| c.iter().fold(0u32, |a, &b| a << 8 | b as u32))
        .collect();
    let _ = tok.decode(&raw, selector & 1 == 0);
    let mut stream = StreamDecoder::new(tok);
    for &id in &raw {
        let _ = stream.push(id);
        let _ = tok.token_to_piece(id);
    }
    let _ = stream.finish();
});
