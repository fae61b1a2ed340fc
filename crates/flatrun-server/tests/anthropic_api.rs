//! The Anthropic endpoints against the mock model: messages, the exact
//! streaming event sequence (with pings during a slow prefill),
//! count_tokens, and errors in Anthropic's shape.

mod common;

use std::time::Duration;

use common::{TestServer, config};
use flatrun_server::SchedulerConfig;
use flatrun_server::mock::MockConfig;
use serde_json::{Value, json};

const REPLY: &str = "Hello from the Flatrun mock model.";

fn assert_anthropic_error(response: &common::HttpResponse, status: u16, error_type: &str) -> Value {
    assert_eq!(response.status, status, "body: {}", response.body);
    let body = response.json();
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], error_type, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    body
}

#[tokio::test]
async fn message_greedy_returns_the_reply_with_usage() {
    let server = TestServer::default().await;
    let response = server
        .post_json(
            "/v1/messages",
            &json!({"model": "mock", "max_tokens": 100, "temperature": 0,
                    "system": "Be brief.",
                    "messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await;
    assert_eq!(response.status, 200, "{}", response.body);
    let body = response.json();
    assert_eq!(body["type"], "message");
    assert_eq!(body["role"], "assistant");
    assert_eq!(body["model"], "mock");
    assert!(body["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(body["content"], json!([{"type": "text", "text": REPLY}]));
    assert_eq!(body["stop_reason"], "end_turn");
    assert_eq!(body["stop_sequence"], Value::Null);
    let prompt = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n";
    assert_eq!(body["usage"]["input_tokens"], prompt.len() + 1);
    assert_eq!(body["usage"]["output_tokens"], REPLY.len());
}

#[tokio::test]
async fn blocks_max_tokens_top_k_and_stop_sequences() {
    let server = TestServer::default().await;
    let body = server
        .post_json(
            "/v1/messages",
            &json!({"model": "mock", "max_tokens": 5, "top_k": 1, "top_p": 0.9,
                    "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
        )
        .await
        .json();
    assert_eq!(body["content"][0]["text"], "Hello");
    assert_eq!(body["stop_reason"], "max_tokens");
    assert_eq!(body["usage"]["output_tokens"], 5);
    assert_eq!(
        body["usage"]["input_tokens"],
        "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n".len() + 1
    );

    let body = server
        .post_json(
            "/v1/messages",
            &json!({"model": "mock", "max_tokens": 100, "temperature": 0, "stop_sequences": ["mock", "Flatrun"],
                    "messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await
        .json();
    assert_eq!(body["content"][0]["text"], "Hello from the ");
    assert_eq!(body["stop_reason"], "stop_sequence");
    assert_eq!(body["stop_sequence"], "Flatrun");
}

/// Event names of an Anthropic stream, without the pings.
fn names_without_pings(events: &[(Option<String>, String)]) -> Vec<String> {
    events
        .iter()
        .map(|(name, _)| name.clone().expect("every Anthropic event is named"))
        .filter(|name| name != "ping")
        .collect()
}

#[tokio::test]
async fn stream_sends_exactly_the_documented_events() {
    let server = TestServer::default().await;
    let response = server
        .post_json(
            "/v1/messages",
            &json!({"model": "mock", "max_tokens": 100, "temperature": 0, "stream": true,
                    "messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await;
    assert_eq!(response.status, 200, "{}", response.body);
    let events = response.sse_events();
    let names = names_without_pings(&events);
    let n = names.len();
    assert_eq!(names[0], "message_start");
    assert_eq!(names[1], "content_block_start");
    assert!(
        names[2..n - 3]
            .iter()
            .all(|name| name == "content_block_delta"),
        "{names:?}"
    );
    assert!(n > 5);
    assert_eq!(
        &names[n - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );

    let data: Vec<Value> = events
        .iter()
        .filter(|(name, _)| name.as_deref() != Some("ping"))
        .map(|(name, data)| {
            let value: Value = serde_json::from_str(data).unwrap();
            assert_eq!(
                value["type"],
                name.as_deref().unwrap(),
                "data type matches event name"
            );
            value
        })
        .collect();
    let start = &data[0]["message"];
    assert_eq!(start["role"], "assistant");
    assert_eq!(start["content"], json!([]));
    assert_eq!(
        start["usage"]["input_tokens"],
        "<|user|>\nHi\n<|assistant|>\n".len() + 1
    );
    assert_eq!(
        data[1]["content_block"],
        json!({"type": "text", "text": ""})
    );
    let text: String = data[2..n - 3]
        .iter()
        .map(|d| {
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(text, REPLY);
    assert_eq!(data[n - 2]["delta"]["stop_reason"], "end_turn");
    assert_eq!(data[n - 2]["usage"]["output_tokens"], REPLY.len());
}

#[tokio::test]
async fn stream_pings_during_a_slow_prefill() {
    let mock = MockConfig {
        step_delay: Duration::from_millis(60),
        ..MockConfig::default()
    };
    let scheduler = SchedulerConfig {
        prefill_chunk: 4,
        ..SchedulerConfig::default()
    };
    let mut cfg = config();
    cfg.ping_interval = Duration::from_millis(100);
    let server = TestServer::start(mock, scheduler, cfg).await;
    // A 40-byte prompt: about 10 prefill steps of 60 ms.
    let response = server
        .post_json(
            "/v1/messages",
            &json!({"model": "mock", "max_tokens": 3, "temperature": 0, "stream": true,
                    "messages": [{"role": "user", "content": "x".repeat(20)}]}),
        )
        .await;
    let names: Vec<String> = response
        .sse_events()
        .into_iter()
        .map(|(n, _)| n.unwrap())
        .collect();
    let first_delta = names
        .iter()
        .position(|n| n == "content_block_delta")
        .unwrap();
    assert!(
        names[2..first_delta]
            .iter()
            .filter(|n| *n == "ping")
            .count()
            >= 2,
        "{names:?}"
    );
    assert_eq!(
        names_without_pings(&response.sse_events())[..2],
        ["message_start", "content_block_start"]
    );
    assert_eq!(names.last().unwrap(), "message_stop");
}

#[tokio::test]
async fn count_tokens_matches_the_message_usage() {
    let server = TestServer::default().await;
    let request = json!({"model": "mock", "system": "S", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Again"}]});
    let response = server
        .post_json("/v1/messages/count_tokens", &request)
        .await;
    assert_eq!(response.status, 200, "{}", response.body);
    let counted = response.json()["input_tokens"].as_u64().unwrap();
    let mut message = request.clone();
    message["max_tokens"] = json!(1);
    let used = server.post_json("/v1/messages", &message).await.json()["usage"]["input_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(counted, used);
}

#[tokio::test]
async fn errors_have_the_anthropic_shape_and_status() {
    let mut cfg = config();
    cfg.max_body_bytes = 2048;
    let mock = MockConfig {
        context_length: 128,
        ..MockConfig::default()
    };
    let server = TestServer::start(mock, SchedulerConfig::default(), cfg).await;
    let messages = "/v1/messages";
    assert_anthropic_error(
        &server.post(messages, "{not json").await,
        400,
        "invalid_request_error",
    );
    let body = assert_anthropic_error(
        &server
            .post(
                messages,
                r#"{"model": "mock", "messages": [{"role": "user", "content": "x"}]}"#,
            )
            .await,
        400,
        "invalid_request_error",
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens")
    );
    assert_anthropic_error(
        &server
            .post(
                messages,
                r#"{"model": "mock", "max_tokens": "many", "messages": []}"#,
            )
            .await,
        400,
        "invalid_request_error",
    );
    assert_anthropic_error(
        &server.post(messages, r#"{"model": "mock", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}"#).await,
        400,
        "invalid_request_error",
    );
    assert_anthropic_error(
        &server
            .post(messages, r#"{"model": "claude-opus-4", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}"#)
            .await,
        404,
        "not_found_error",
    );
    let big = json!({"model": "mock", "max_tokens": 5, "messages": [{"role": "user", "content": "x".repeat(4096)}]});
    assert_anthropic_error(
        &server.post_json(messages, &big).await,
        413,
        "request_too_large",
    );
    let long = json!({"model": "mock", "max_tokens": 100, "messages": [{"role": "user", "content": "y".repeat(100)}]});
    let body = assert_anthropic_error(
        &server.post_json(messages, &long).await,
        400,
        "invalid_request_error",
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("context")
    );
    assert_anthropic_error(
        &server.post("/v1/messages/count_tokens", "[1,").await,
        400,
        "invalid_request_error",
    );
    assert_anthropic_error(
        &server.get("/v1/messages/nothing").await,
        404,
        "not_found_error",
    );
    assert_eq!(
        server
            .stats
            .sequences_opened
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
}

#[tokio::test]
async fn a_final_assistant_message_is_continued() {
    let server = TestServer::default().await;
    let messages = json!([{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Sure:"}]);
    // The prompt is the template up to the assistant prompt, then the prefill
    // (no end of turn, no second assistant prompt).
    let prompt = "<|user|>\nHi\n<|assistant|>\nSure:";
    let counted = server
        .post_json("/v1/messages/count_tokens", &json!({"messages": messages}))
        .await;
    assert_eq!(counted.json()["input_tokens"], prompt.len() + 1);
    let response = server
        .post_json(
            "/v1/messages",
            &json!({"max_tokens": 100, "temperature": 0, "messages": messages}),
        )
        .await;
    let body = response.json();
    assert_eq!(body["usage"]["input_tokens"], prompt.len() + 1);
    // Only the continuation comes back.
    assert_eq!(body["content"][0]["text"], REPLY);
    // As Anthropic's API: a prefill may not end in whitespace.
    let trailing = server
        .post_json(
            "/v1/messages",
            &json!({"max_tokens": 10, "messages": [{"role": "user", "content": "Hi"},
                                                    {"role": "assistant", "content": "Sure: "}]}),
        )
        .await;
    assert_anthropic_error(&trailing, 400, "invalid_request_error");
}
