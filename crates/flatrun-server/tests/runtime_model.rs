//! The server over the real runtime (`flatrun_server::runtime`) on
//! SmolLM2-135M: the engine's greedy answers, alone and batched, equal the
//! runtime's own `Model::generate`; over HTTP the chat and completion
//! endpoints return that text, `/tokenize` the model's tokenizer, and
//! `/metrics` the model's residency.
//!
//! Needs `$FLATRUN_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf`; skipped when
//! FLATRUN_MODELS is unset or the file is missing, unless
//! FLATRUN_REQUIRE_MODELS=1, which makes a missing model a failure. Run it in
//! release mode: `cargo test --release -p flatrun-server --test runtime_model`.

#![cfg(feature = "runtime")]

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::config;
use flatrun_runtime::{ChatMessage, GenerateOptions, LoadOptions, Model, Prompt};
use flatrun_server::{
    Engine, FinishReason, GenerationRequest, SamplingParams, SchedulerConfig, Server,
};
use serde_json::json;

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const SERVED_NAME: &str = "SmolLM2-135M-Instruct.Q4_1";
const CONTEXT: usize = 512;
const MAX_TOKENS: usize = 20;
const QUESTION: &str = "What is the capital of France?";

/// The model file, or `None` after a skip message.
fn smollm2() -> Option<PathBuf> {
    let required = std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1");
    let missing = |why: String| {
        if required {
            panic!("{why} and FLATRUN_REQUIRE_MODELS=1");
        }
        eprintln!("skipping: {why}");
        None
    };
    let Some(dir) = std::env::var_os("FLATRUN_MODELS") else {
        return missing(format!(
            "FLATRUN_MODELS is not set (it should hold {MODEL})"
        ));
    };
    let path = PathBuf::from(dir).join(MODEL);
    if !path.is_file() {
        return missing(format!("{} not found", path.display()));
    }
    Some(path)
}

fn load(path: &PathBuf) -> Model {
    let options = LoadOptions {
        ctx: Some(CONTEXT),
        ..LoadOptions::default()
    };
    Model::load(path, options).expect("load SmolLM2")
}

/// The runtime's own greedy answer to `prompt`: its text and how many tokens
/// it generated before the end-of-generation token (if any).
fn reference(model: &mut Model, prompt: &[u32]) -> (String, usize, FinishReason) {
    let mut text = String::new();
    let mut tokens = 0;
    let mut finish = None;
    let generation = model
        .generate(
            Prompt::Tokens(prompt.to_vec()),
            GenerateOptions::greedy(MAX_TOKENS),
        )
        .expect("generate");
    for event in generation {
        let event = event.expect("step");
        text.push_str(&event.text);
        if event.finish != Some(FinishReason::Eos) {
            tokens += 1;
        }
        finish = event.finish;
    }
    (text, tokens, finish.expect("a finish reason"))
}

fn greedy(prompt: Vec<u32>) -> GenerationRequest {
    GenerationRequest {
        prompt,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        max_tokens: MAX_TOKENS,
        stop: Vec::new(),
        ..GenerationRequest::default()
    }
}

#[test]
fn runtime_engine_matches_the_runtime_alone_and_batched() {
    let Some(path) = smollm2() else { return };
    let mut model = load(&path);
    let chat = [ChatMessage::new("user", QUESTION)];
    let chat_prompt = model
        .encode(
            &model.apply_chat_template(&chat, true).expect("template"),
            true,
        )
        .expect("encode");
    let plain_prompt = model
        .encode("The capital of France is", true)
        .expect("encode");
    let chat_reference = reference(&mut model, &chat_prompt);
    let plain_reference = reference(&mut model, &plain_prompt);
    assert!(!chat_reference.0.is_empty() && !plain_reference.0.is_empty());

    let engine =
        flatrun_server::runtime::engine(model, SchedulerConfig::default()).expect("engine");
    assert_eq!(engine.model_name(), SERVED_NAME);
    assert_eq!(engine.context_length(), CONTEXT);
    // The engine renders and tokenizes the chat as the runtime does.
    assert_eq!(engine.encode_chat(&chat).expect("encode chat"), chat_prompt);

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio");
    let collect = |prompt: &[u32]| engine.submit(greedy(prompt.to_vec())).expect("submit");
    // Alone, then both prompts in one batch (one pass through the layers
    // per step for the two sequences).
    for batch in [
        vec![&chat_prompt],
        vec![&plain_prompt],
        vec![&chat_prompt, &plain_prompt],
    ] {
        let streams: Vec<_> = batch.iter().map(|prompt| collect(prompt)).collect();
        for (prompt, stream) in batch.into_iter().zip(streams) {
            let (text, reason, usage) =
                runtime.block_on(stream.collect_text()).expect("generation");
            let (expected, tokens, expected_reason) = if prompt == &chat_prompt {
                &chat_reference
            } else {
                &plain_reference
            };
            assert_eq!(&text, expected);
            assert_eq!(usage.prompt_tokens, prompt.len());
            assert_eq!(usage.completion_tokens, *tokens);
            assert_eq!(&reason, expected_reason);
        }
    }
    // Every sequence is freed once its generation finished (the scheduler
    // frees it right after sending the last event).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while engine.stats().active_sequences != 0 {
        assert!(std::time::Instant::now() < deadline, "{:?}", engine.stats());
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let stats = engine.stats();
    assert!(stats.generated_tokens_total > 0, "{stats:?}");
    assert!(
        stats.model_bytes.is_some_and(|bytes| bytes > 50_000_000),
        "{stats:?}"
    );
    engine.shutdown();
}

#[test]
fn http_endpoints_over_the_runtime() {
    let Some(path) = smollm2() else { return };
    let mut model = load(&path);
    let chat = [ChatMessage::new("user", QUESTION)];
    let chat_prompt = model
        .encode(
            &model.apply_chat_template(&chat, true).expect("template"),
            true,
        )
        .expect("encode");
    let (expected_chat, chat_tokens, _) = reference(&mut model, &chat_prompt);
    let completion_prompt = model
        .encode("The capital of France is", true)
        .expect("encode");
    let (expected_completion, _, _) = reference(&mut model, &completion_prompt);
    let hello = model.encode("Hello, world", false).expect("encode");

    let engine =
        flatrun_server::runtime::engine(model, SchedulerConfig::default()).expect("engine");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio");
    runtime.block_on(async move {
        let server = Server::bind(config()).await.expect("bind");
        let addr = server.local_addr().expect("addr");
        server.engine_slot().set(Arc::new(engine));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(server.run_until(async move {
            let _ = stopped.await;
        }));
        let post = |path: &'static str, body: serde_json::Value| async move {
            common::request(addr, "POST", path, &[], body.to_string().as_bytes()).await
        };

        let models = common::request(addr, "GET", "/v1/models", &[], b"").await;
        assert_eq!(models.status, 200, "{}", models.body);
        assert_eq!(models.json()["data"][0]["id"], SERVED_NAME);

        let reply = post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": QUESTION}],
                   "temperature": 0, "max_tokens": MAX_TOKENS}),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        let reply = reply.json();
        assert_eq!(
            reply["choices"][0]["message"]["content"],
            expected_chat.as_str()
        );
        assert_eq!(reply["usage"]["prompt_tokens"], chat_prompt.len());
        assert_eq!(reply["usage"]["completion_tokens"], chat_tokens);

        let completion = post(
            "/v1/completions",
            json!({"prompt": "The capital of France is", "temperature": 0,
                   "max_tokens": MAX_TOKENS}),
        )
        .await;
        assert_eq!(completion.status, 200, "{}", completion.body);
        assert_eq!(
            completion.json()["choices"][0]["text"],
            expected_completion.as_str()
        );

        let anthropic = post(
            "/v1/messages",
            json!({"messages": [{"role": "user", "content": QUESTION}],
                   "temperature": 0, "max_tokens": MAX_TOKENS}),
        )
        .await;
        assert_eq!(anthropic.status, 200, "{}", anthropic.body);
        assert_eq!(
            anthropic.json()["content"][0]["text"],
            expected_chat.as_str()
        );

        let tokens = post("/tokenize", json!({"content": "Hello, world"})).await;
        assert_eq!(tokens.status, 200, "{}", tokens.body);
        assert_eq!(tokens.json()["tokens"], json!(hello));

        let metrics = common::request(addr, "GET", "/metrics", &[], b"").await;
        assert_eq!(metrics.status, 200);
        assert!(
            metrics.body.contains("flatrun_model_bytes"),
            "{}",
            metrics.body
        );

        let _ = stop.send(());
        serving.await.expect("server task").expect("server");
    });
}

/// The second turn of a conversation through an engine that reuses the
/// first turn's KV and through one that reuses nothing: the same greedy
/// answer, with most of the prompt reported as cached.
#[test]
fn prefix_reuse_gives_the_same_greedy_answers() {
    let Some(path) = smollm2() else { return };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio");
    let questions = [
        QUESTION,
        "And what is the capital of Italy?",
        "Which of the two cities is older?",
    ];
    let mut answers: Vec<Vec<(String, usize)>> = Vec::new();
    for budget in [flatrun_server::scheduler::DEFAULT_PROMPT_CACHE_BYTES, 0] {
        let scheduler = SchedulerConfig {
            prompt_cache_bytes: budget,
            ..SchedulerConfig::default()
        };
        let engine = flatrun_server::runtime::engine(load(&path), scheduler).expect("engine");
        let mut chat = vec![ChatMessage::new("system", "You are a helpful assistant.")];
        let mut turns = Vec::new();
        for question in questions {
            chat.push(ChatMessage::new("user", question));
            let prompt = engine.encode_chat(&chat).expect("encode");
            let stream = engine.submit(greedy(prompt.clone())).expect("submit");
            let (text, _, usage) = runtime.block_on(stream.collect_text()).expect("generation");
            chat.push(ChatMessage::new("assistant", text.clone()));
            turns.push((text, usage.cached_tokens));
        }
        engine.shutdown();
        answers.push(turns);
    }
    let (reused, fresh) = (&answers[0], &answers[1]);
    for (turn, ((a, cached), (b, none))) in reused.iter().zip(fresh).enumerate() {
        assert_eq!(a, b, "turn {turn}");
        assert_eq!(*none, 0);
        if turn > 0 {
            assert!(*cached > 20, "turn {turn}: {cached} cached tokens");
        }
    }
}
