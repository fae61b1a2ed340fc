//! Cost of the chat-template sandbox: rendering the real models' templates
//! (a four-message conversation) through [`ChatTemplate`] (instrumented
//! instructions, guards, byte budget) against plain minijinja with the same
//! configuration and no sandbox. Figures are in `docs/tokenizer.md`.

use std::path::PathBuf;

use criterion::{Criterion, criterion_group, criterion_main};
use flatrun_format::MetaValue;
use flatrun_model::chat_template::{ChatMessage, ChatTemplate};

fn templates() -> Vec<(String, String)> {
    let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
    let models = std::env::var_os("FLATRUN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".cache/flatrun/models"));
    let vocab = std::env::var_os("FLATRUN_VOCAB")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".cache/flatrun/vocab"));
    let mut found = Vec::new();
    for path in [
        models.join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        models.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        vocab.join("ggml-vocab-gemma-4.gguf"),
    ] {
        let Ok(backend) = flatrun_format::open(&path) else {
            eprintln!("skipping {}: missing", path.display());
            continue;
        };
        let source = backend
            .metadata()
            .entries
            .iter()
            .find(|(k, _)| k == "tokenizer.chat_template")
            .map(|(_, v)| v.clone());
        if let Some(MetaValue::String(source)) = source {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            found.push((name.into_owned(), source));
        }
    }
    found
}

fn bench(c: &mut Criterion) {
    let messages = [
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", "What is the capital of France?"),
        ChatMessage::new("assistant", "Paris."),
        ChatMessage::new("user", "And of Italy?"),
    ];
    let mut group = c.benchmark_group("chat_template_render");
    for (name, source) in templates() {
        let sandboxed = ChatTemplate::from_source("bench", &source).expect("template");
        group.bench_function(format!("{name}/sandboxed"), |b| {
            b.iter(|| {
                sandboxed
                    .render(&messages, true, "<s>", "</s>")
                    .expect("render")
                    .len()
            })
        });
        group.bench_function(format!("{name}/plain minijinja"), |b| {
            b.iter(|| {
                let mut env = minijinja::Environment::new();
                env.set_trim_blocks(true);
                env.set_lstrip_blocks(true);
                minijinja_contrib::add_to_environment(&mut env);
                env.set_unknown_method_callback(
                    minijinja_contrib::pycompat::unknown_method_callback,
                );
                env.template_from_str(&source)
                    .expect("compile")
                    .render(minijinja::context! {
                        messages => &messages,
                        add_generation_prompt => true,
                        bos_token => "<s>",
                        eos_token => "</s>",
                    })
                    .expect("render")
                    .len()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
