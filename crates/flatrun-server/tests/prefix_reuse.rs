//! Prompt prefix reuse and context overflow against the mock: the next turn
//! of a conversation prefills only what is new (reported as OpenAI
//! `cached_tokens` and Anthropic `cache_read_input_tokens`, counted in
//! `/metrics`), `n` choices prefill their prompt once, `cache_prompt: false`
//! opts out, the budget evicts; and `--context-overflow` error,
//! truncate-middle and shift.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{TestServer, config};
use flatrun_server::config::ContextOverflow;
use flatrun_server::mock::MockConfig;
use flatrun_server::{SchedulerConfig, ServerConfig};
use serde_json::{Value, json};

fn reusing() -> MockConfig {
    MockConfig {
        prefix_reuse: true,
        ..MockConfig::default()
    }
}

async fn server(mock: MockConfig, scheduler: SchedulerConfig, config: ServerConfig) -> TestServer {
    TestServer::start(mock, scheduler, config).await
}

fn chat(messages: &Value, extra: Value) -> Value {
    let mut body = json!({"messages": messages, "max_tokens": 12, "temperature": 0});
    if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        body.extend(extra.clone());
    }
    body
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from\n{text}"))
}

#[tokio::test]
async fn the_next_turn_reuses_the_previous_one() {
    let server = server(reusing(), SchedulerConfig::default(), config()).await;
    let mut messages = json!([
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hi there"}
    ]);
    let first = server
        .post_json("/v1/chat/completions", &chat(&messages, json!({})))
        .await
        .json();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let answer = first["choices"][0]["message"]["content"].clone();
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let fed_before = server.stats.tokens_fed.load(Ordering::SeqCst);
    messages.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": answer}),
        json!({"role": "user", "content": "And again?"}),
    ]);
    let second = server
        .post_json("/v1/chat/completions", &chat(&messages, json!({})))
        .await
        .json();
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The whole first prompt came from the cache; the answer (decoded one
    // token at a time, so not reusable exactly) and the new turn were computed.
    assert_eq!(cached, first_prompt, "{second}");
    let fed = server.stats.tokens_fed.load(Ordering::SeqCst) - fed_before;
    let completion = second["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(fed, prompt - cached + completion - 1, "{second}");
    // The same answer as a server that reuses nothing.
    let fresh = TestServer::default().await;
    let expected = fresh
        .post_json("/v1/chat/completions", &chat(&messages, json!({})))
        .await
        .json();
    assert_eq!(second["choices"], expected["choices"]);
    assert_eq!(
        expected["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );

    // Anthropic: the same conversation again, every prompt token but the last two cached.
    let body = json!({"max_tokens": 12, "temperature": 0,
        "system": "You are a terse assistant.",
        "messages": messages.as_array().unwrap()[1..]});
    let reply = server.post_json("/v1/messages", &body).await.json();
    let usage = &reply["usage"];
    assert_eq!(
        usage["input_tokens"].as_u64().unwrap()
            + usage["cache_read_input_tokens"].as_u64().unwrap(),
        prompt,
        "{reply}"
    );
    assert_eq!(usage["input_tokens"], 2, "{reply}");

    let metrics = server.get("/metrics").await.body;
    assert_eq!(metric(&metrics, "flatrun_prefix_cache_lookups_total"), 3);
    assert_eq!(metric(&metrics, "flatrun_prefix_cache_hits_total"), 2);
    assert_eq!(
        metric(&metrics, "flatrun_prefix_reused_tokens_total"),
        cached + prompt - 2
    );
    // One conversation, one cached sequence: each turn replaced the last.
    assert_eq!(metric(&metrics, "flatrun_prompt_cache_sequences"), 1);
    assert!(metric(&metrics, "flatrun_prompt_cache_bytes") > 0);
    assert!(metric(&metrics, "flatrun_kv_bytes") >= metric(&metrics, "flatrun_prompt_cache_bytes"));
}

#[tokio::test]
async fn n_choices_prefill_their_prompt_once() {
    let server = server(reusing(), SchedulerConfig::default(), config()).await;
    let body = json!({"prompt": "A rather long prompt that all choices share, word for word.",
                      "max_tokens": 5, "n": 4, "temperature": 0, "cache_prompt": false});
    // With `cache_prompt: false` every choice computes the prompt.
    let alone = server.post_json("/v1/completions", &body).await.json();
    let prompt = alone["usage"]["prompt_tokens"].as_u64().unwrap();
    let fed_alone = server.stats.tokens_fed.load(Ordering::SeqCst);
    assert_eq!(fed_alone, 4 * (prompt + 4), "{alone}");
    let mut body = body;
    body["cache_prompt"] = json!(true);
    body["prompt"] = json!("Another prompt, shared by the four choices of one request.");
    let shared = server.post_json("/v1/completions", &body).await.json();
    let prompt = shared["usage"]["prompt_tokens"].as_u64().unwrap();
    let fed = server.stats.tokens_fed.load(Ordering::SeqCst) - fed_alone;
    // One prefill; each other choice computes the prompt's last two tokens only.
    assert_eq!(fed, prompt + 3 * 2 + 4 * 4, "{shared}");
    assert_eq!(shared["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let texts: Vec<&Value> = shared["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["text"])
        .collect();
    assert!(texts.iter().all(|t| *t == texts[0]), "{shared}");
}

#[tokio::test]
async fn the_budget_evicts_the_least_recently_used() {
    // 64 bytes a position in the mock: room for about one short conversation.
    let scheduler = SchedulerConfig {
        prompt_cache_bytes: 64 * 60,
        ..SchedulerConfig::default()
    };
    let server = server(reusing(), scheduler, config()).await;
    for topic in ["apples", "pears", "plums"] {
        let messages = json!([{"role": "user", "content": format!("Tell me about {topic}")}]);
        let r = server
            .post_json("/v1/chat/completions", &chat(&messages, json!({})))
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let metrics = server.get("/metrics").await.body;
    assert_eq!(metric(&metrics, "flatrun_prompt_cache_sequences"), 1);
    assert_eq!(metric(&metrics, "flatrun_prompt_cache_evictions_total"), 2);
    assert!(metric(&metrics, "flatrun_prompt_cache_bytes") <= 64 * 60);
    // Nothing kept at all with a zero budget: every sequence is freed.
    let off = SchedulerConfig {
        prompt_cache_bytes: 0,
        ..SchedulerConfig::default()
    };
    let server = self::server(reusing(), off, config()).await;
    let messages = json!([{"role": "user", "content": "Hi"}]);
    server
        .post_json("/v1/chat/completions", &chat(&messages, json!({})))
        .await;
    server.wait_all_freed().await;
}

fn overflow(mode: ContextOverflow) -> ServerConfig {
    ServerConfig {
        context_overflow: mode,
        ..config()
    }
}

fn small_context() -> MockConfig {
    MockConfig {
        context_length: 128,
        repeat: true,
        step_delay: Duration::ZERO,
        ..reusing()
    }
}

/// A conversation of `turns` user/assistant pairs, then a last question.
fn long_conversation(turns: usize) -> Value {
    let mut messages = vec![json!({"role": "system", "content": "Be brief."})];
    for i in 0..turns {
        messages.push(json!({"role": "user", "content": format!("Question number {i}?")}));
        messages.push(json!({"role": "assistant", "content": format!("Answer {i}.")}));
    }
    messages.push(json!({"role": "user", "content": "The last one?"}));
    Value::Array(messages)
}

#[tokio::test]
async fn overflow_is_an_api_error_by_default() {
    let server = server(small_context(), SchedulerConfig::default(), config()).await;
    let r = server
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": long_conversation(8), "max_tokens": 40}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json()["error"]["code"],
        "context_length_exceeded",
        "{}",
        r.body
    );
    let r = server
        .post_json(
            "/v1/messages",
            &json!({"messages": long_conversation(8).as_array().unwrap()[1..], "max_tokens": 40}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json()["error"]["type"],
        "invalid_request_error",
        "{}",
        r.body
    );
}

#[tokio::test]
async fn truncate_middle_keeps_the_system_prompt_and_the_newest_turns() {
    let server = server(
        small_context(),
        SchedulerConfig::default(),
        overflow(ContextOverflow::TruncateMiddle),
    )
    .await;
    let body = json!({"messages": long_conversation(8), "max_tokens": 40, "temperature": 0});
    let r = server.post_json("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let usage = &r.json()["usage"];
    assert!(
        usage["prompt_tokens"].as_u64().unwrap() <= 128 - 40,
        "{usage}"
    );
    assert_eq!(usage["completion_tokens"], 40);
    let messages = json!({"max_tokens": 40, "system": "Be brief.",
        "messages": long_conversation(8).as_array().unwrap()[1..]});
    let r = server.post_json("/v1/messages", &messages).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // A completion prompt loses its oldest tokens.
    let text = "y".repeat(200);
    let r = server
        .post_json("/v1/completions", &json!({"prompt": text, "max_tokens": 8}))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["prompt_tokens"], 128 - 8);
}

#[tokio::test]
async fn shift_generates_past_the_end_of_the_context() {
    let server = server(
        small_context(),
        SchedulerConfig::default(),
        overflow(ContextOverflow::Shift),
    )
    .await;
    let body = json!({"messages": long_conversation(2), "max_tokens": 300, "temperature": 0});
    let r = server.post_json("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let reply = r.json();
    assert_eq!(reply["usage"]["completion_tokens"], 300, "{reply}");
    assert_eq!(reply["choices"][0]["finish_reason"], "length");
    // A prompt longer than the context is cut first, then shifts.
    let r = server
        .post_json(
            "/v1/completions",
            &json!({"prompt": "z".repeat(300), "max_tokens": 100}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["completion_tokens"], 100);
    // Without shift the same request is refused.
    let strict = self::server(small_context(), SchedulerConfig::default(), config()).await;
    let r = strict.post_json("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 400);
}
