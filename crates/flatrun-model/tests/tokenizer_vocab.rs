//! Token-for-token equality with llama.cpp on the vocab-only GGUF files that
//! ship with llama.cpp (`ggml-vocab-*.gguf` + `.inp`/`.out` golden pairs),
//! fetched into `$FLATRUN_VOCAB` by `scripts/setup-test-env.sh`.

use std::path::PathBuf;

use flatrun_model::tokenizer::Tokenizer;

/// Every vocabulary whose tokenizer family Flatrun supports.
const SUPPORTED: &[&str] = &[
    "llama-bpe",
    "llama-spm",
    "qwen2",
    "qwen35",
    "gpt-2",
    "deepseek-llm",
    "deepseek-coder",
    "falcon",
    "mpt",
    "starcoder",
    "command-r",
    "refact",
    "phi-3",
];

fn vocab_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("FLATRUN_VOCAB")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/flatrun/vocab")
        });
    if dir.join("ggml-vocab-qwen2.gguf").exists() {
        return Some(dir);
    }
    if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!(
            "vocab fixtures missing in {} (run scripts/setup-test-env.sh)",
            dir.display()
        );
    }
    eprintln!(
        "skipping: vocab fixtures missing in {} (run scripts/setup-test-env.sh)",
        dir.display()
    );
    None
}

/// The golden pairs of one vocabulary, split the way llama.cpp's test-tokenizer-0 splits them.
fn golden_pairs(dir: &std::path::Path, name: &str) -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.inp")))
        .expect("read .inp");
    let out = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.out")))
        .expect("read .out");
    let sep = "\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < inp.len() {
        match inp[pos..].find(sep) {
            Some(next) => {
                inputs.push(inp[pos..pos + next].to_string());
                pos += next + sep.len();
            }
            None => {
                inputs.push(inp[pos..].to_string());
                break;
            }
        }
    }
    let outputs: Vec<Vec<u32>> = out
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|t| t.parse().expect("id"))
                .collect()
        })
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{name}: .inp and .out disagree in length"
    );
    inputs.into_iter().zip(outputs).collect()
}

fn load(dir: &std::path::Path, name: &str) -> Tokenizer {
    let path = dir.join(format!("ggml-vocab-{name}.gguf"));
    let backend =
        flatrun_format::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    Tokenizer::from_gguf_metadata(backend.metadata()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn vocab_golden_pairs_match_llama_cpp() {
    let Some(dir) = vocab_dir() else { return };
    let mut failures = Vec::new();
    for name in SUPPORTED {
        let tok = load(&dir, name);
        let pairs = golden_pairs(&dir, name);
        let mut bad = 0;
        for (text, expected) in &pairs {
            let got = tok.encode(text, false, false).expect("encode");
            if &got != expected {
                bad += 1;
                if bad <= 3 {
                    eprintln!("{name}: {text:?}\n  expected {expected:?}\n  got      {got:?}");
                }
            }
        }
        eprintln!(
            "{name} ({}): {}/{} golden pairs equal",
            tok.kind(),
            pairs.len() - bad,
            pairs.len()
        );
        if bad > 0 {
            failures.push(format!("{name}: {bad} of {}", pairs.len()));
        }
    }
    assert!(failures.is_empty(), "mismatches: {failures:?}");
}

#[test]
fn vocab_round_trip() {
    let Some(dir) = vocab_dir() else { return };
    let mut failures = Vec::new();
    for name in SUPPORTED {
        let tok = load(&dir, name);
        for (text, _) in golden_pairs(&dir, name) {
            let ids = tok.encode(&text, false, false).expect("encode");
            let back = tok.decode(&ids, false).expect("decode");
            if back != text {
                failures.push(format!("{name}: {text:?} -> {back:?}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} round-trip failures: {:#?}",
        failures.len(),
        &failures[..failures.len().min(10)]
    );
}
