//! The real models' tokenizers (and a few vocab-only GGUFs) against llama.cpp
//! on Flatrun's stress corpus (`tests/fixtures/tokenizer/corpus/*.txt`).
//! Expected ids: `tests/fixtures/tokenizer/oracle_ids.json`, made by
//! `scripts/gen_tokenizer_fixtures.py ids` with the llama.cpp reference CLI.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use flatrun_model::tokenizer::{StreamDecoder, Tokenizer};

const REAL_MODELS: &[&str] = &[
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

fn cache_dir(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(default)
    })
}

/// The GGUF file for a fixture model name, or `None` (with a skip message) when absent.
fn model_path(name: &str) -> Option<PathBuf> {
    let path = if name.starts_with("ggml-vocab-") {
        cache_dir("FLATRUN_VOCAB", ".cache/flatrun/vocab").join(name)
    } else {
        cache_dir("FLATRUN_MODELS", ".cache/flatrun/models").join(name)
    };
    if path.exists() {
        return Some(path);
    }
    if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!(
            "{} is missing (run scripts/setup-test-env.sh)",
            path.display()
        );
    }
    eprintln!(
        "skipping {name}: {} is missing (run scripts/setup-test-env.sh)",
        path.display()
    );
    None
}

fn load(path: &Path) -> Tokenizer {
    let backend =
        flatrun_format::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    Tokenizer::from_gguf_metadata(backend.metadata())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn corpus() -> BTreeMap<String, String> {
    let mut texts = BTreeMap::new();
    for entry in std::fs::read_dir(fixtures().join("corpus")).expect("corpus dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "txt") {
            let stem = path
                .file_stem()
                .and_then(|s| s.to_str())
                .expect("name")
                .to_string();
            texts.insert(
                stem,
                std::fs::read_to_string(&path).expect("read corpus text"),
            );
        }
    }
    texts
}

type Expected = BTreeMap<String, BTreeMap<String, BTreeMap<String, Vec<u32>>>>;

#[test]
fn stress_corpus_matches_llama_cpp() {
    let expected: Expected = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("oracle_ids.json")).expect("oracle_ids.json"),
    )
    .expect("parse");
    let texts = corpus();
    let mut failures = Vec::new();
    let mut checked = 0;
    for (model, by_text) in &expected {
        let Some(path) = model_path(model) else {
            continue;
        };
        let tok = load(&path);
        for (name, modes) in by_text {
            let text = &texts[name];
            for (mode, ids) in modes {
                let got = tok.encode(text, true, mode == "special").expect("encode");
                checked += 1;
                if &got != ids {
                    let first_diff = got
                        .iter()
                        .zip(ids)
                        .position(|(a, b)| a != b)
                        .unwrap_or(got.len().min(ids.len()));
                    failures.push(format!("{model} {name} {mode}: first difference at {first_diff}: got {:?} expected {:?}", &got[first_diff..(first_diff + 5).min(got.len())], &ids[first_diff..(first_diff + 5).min(ids.len())]));
                }
            }
        }
    }
    eprintln!("{checked} encodings checked against llama.cpp");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn real_models_round_trip_and_stream() {
    let texts = corpus();
    for model in REAL_MODELS {
        let Some(path) = model_path(model) else {
            continue;
        };
        let tok = load(&path);
        for (name, text) in &texts {
            for parse_special in [false, true] {
                let ids = tok.encode(text, false, parse_special).expect("encode");
                let back = tok.decode(&ids, false).expect("decode");
                assert_eq!(
                    &back, text,
                    "{model} {name}: decode(encode(text)) differs (parse_special={parse_special})"
                );
            }
            // Streaming yields the same text, never a broken UTF-8 sequence.
            let ids = tok.encode(text, false, false).expect("encode");
            let mut stream = StreamDecoder::new(&tok);
            let mut streamed = String::new();
            for &id in &ids {
                if let Some(piece) = stream.push(id) {
                    assert!(
                        !piece.contains('\u{fffd}'),
                        "{model} {name}: stream emitted a replacement character"
                    );
                    streamed.push_str(&piece);
                }
            }
            streamed.push_str(&stream.finish());
            assert_eq!(&streamed, text, "{model} {name}: streamed text differs");
        }
    }
}

#[test]
fn real_models_metadata() {
    if let Some(path) = model_path("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") {
        let tok = load(&path);
        assert_eq!(tok.kind(), "gpt2 BPE (qwen2)");
        assert_eq!(tok.vocab_size(), 151936);
        let im_end = tok.token_id("<|im_end|>").expect("<|im_end|>");
        let eot = tok.token_id("<|endoftext|>").expect("<|endoftext|>");
        assert!(
            tok.stop_ids().contains(&im_end) && tok.stop_ids().contains(&eot),
            "{:?}",
            tok.stop_ids()
        );
        assert!(tok.is_special(im_end));
        assert!(!tok.adds_bos());
        // A chat prompt keeps its control tokens whole; without parsing they are text.
        let ids = tok
            .encode("<|im_start|>user\nhi<|im_end|>", false, true)
            .expect("encode");
        assert_eq!(ids.first(), tok.token_id("<|im_start|>").as_ref());
        assert_eq!(ids.last(), Some(&im_end));
        let plain = tok.encode("<|im_start|>", false, false).expect("encode");
        assert!(plain.len() > 1);
        assert_eq!(tok.decode(&ids, true).expect("decode"), "user\nhi");
    }
    if let Some(path) = model_path("gemma-3-270m-q4_k_m.gguf") {
        let tok = load(&path);
        assert_eq!(tok.kind(), "SentencePiece");
        assert_eq!(tok.vocab_size(), 262144);
        assert!(tok.adds_bos());
        let end_of_turn = tok.token_id("<end_of_turn>").expect("<end_of_turn>");
        assert!(tok.stop_ids().contains(&end_of_turn));
        assert!(tok.eos().is_some_and(|e| tok.stop_ids().contains(&e)));
        let ids = tok.encode("Hello", true, true).expect("encode");
        assert_eq!(ids[0], tok.bos().expect("bos"));
        assert_eq!(tok.decode(&ids, true).expect("decode"), "Hello");
    }
    if let Some(path) = model_path("SmolLM2-135M-Instruct.Q4_1.gguf") {
        let tok = load(&path);
        assert_eq!(tok.kind(), "gpt2 BPE (smollm)");
        assert_eq!(tok.vocab_size(), 49152);
        assert!(
            tok.stop_ids()
                .contains(&tok.token_id("<|im_end|>").expect("<|im_end|>"))
        );
    }
}
