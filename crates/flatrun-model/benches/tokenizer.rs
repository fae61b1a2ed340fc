//! Tokenizing 1 MB of mixed text (the stress corpus repeated: code, emoji,
//! CJK, whitespace runs, numbers, special-token look-alikes) with each real
//! model's tokenizer and with the llama.cpp vocab-only files of the main
//! byte-level BPE pre-tokenizers and SentencePiece (skipped when missing
//! from `$FLATRUN_MODELS` / `$FLATRUN_VOCAB`). Figures are in
//! `docs/tokenizer.md`.

use std::path::PathBuf;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use flatrun_model::tokenizer::Tokenizer;

fn one_megabyte() -> String {
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/corpus");
    let mut seed = String::new();
    let mut names: Vec<_> = std::fs::read_dir(&corpus)
        .expect("corpus")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    names.sort();
    for path in names {
        seed.push_str(&std::fs::read_to_string(path).expect("read"));
        seed.push('\n');
    }
    let mut text = String::with_capacity(1 << 20);
    while text.len() < 1 << 20 {
        text.push_str(&seed);
    }
    text
}

fn bench(c: &mut Criterion) {
    let models = std::env::var_os("FLATRUN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/models")
        });
    let vocab_dir = std::env::var_os("FLATRUN_VOCAB")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/flatrun/vocab")
        });
    let text = one_megabyte();
    let mut group = c.benchmark_group("tokenize_1MB");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(text.len() as u64));
    let mut files: Vec<(String, PathBuf)> = [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ]
    .iter()
    .map(|f| (f.to_string(), models.join(f)))
    .collect();
    for name in ["llama-bpe", "gpt-2", "qwen2", "deepseek-coder", "llama-spm"] {
        let file = format!("ggml-vocab-{name}.gguf");
        files.push((file.clone(), vocab_dir.join(file)));
    }
    for (file, path) in files {
        if !path.exists() {
            eprintln!("skipping {file}: missing");
            continue;
        }
        let backend = flatrun_format::open(&path).expect("open");
        let tok = Tokenizer::from_gguf_metadata(backend.metadata()).expect("tokenizer");
        group.bench_function(file.as_str(), |b| {
            b.iter(|| tok.encode(&text, true, true).expect("encode").len())
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
