//! The OpenAI endpoints against the mock model: responses, streaming chunk
//! order, and every error with its status and shape.

mod common;

use common::{TestServer, config};
use flatrun_server::SchedulerConfig;
use flatrun_server::mock::MockConfig;
use serde_json::{Value, json};

const REPLY: &str = "Hello from the Flatrun mock model.";

fn assert_openai_error(response: &common::HttpResponse, status: u16, error_type: &str) -> Value {
    assert_eq!(response.status, status, "body: {}", response.body);
    let body = response.json();
    let error = &body["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert_eq!(error["type"], error_type, "{body}");
    assert!(error.get("code").is_some(), "{body}");
    body
}

#[tokio::test]
async fn chat_completion_greedy_returns_the_reply_with_usage() {
    let server = TestServer::default().await;
    let response = server
        .post_json(
            "/v1/chat/completions",
            &json!({"model": "mock", "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"}], "temperature": 0}),
        )
        .await;
    assert_eq!(response.status, 200, "{}", response.body);
    let body = response.json();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "mock");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], REPLY);
    assert_eq!(choice["finish_reason"], "stop");
    // The mock's template: "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n" plus BOS.
    let prompt = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n";
    assert_eq!(body["usage"]["prompt_tokens"], prompt.len() + 1);
    assert_eq!(body["usage"]["completion_tokens"], REPLY.len());
    assert_eq!(
        body["usage"]["total_tokens"],
        prompt.len() + 1 + REPLY.len()
    );
    server.wait_all_freed().await;
}

#[tokio::test]
async fn chat_accepts_text_parts_and_omitted_model() {
    let server = TestServer::default().await;
    let response = server
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
                "temperature": 0, "max_completion_tokens": 5}),
        )
        .await;
    assert_eq!(response.status, 200, "{}", response.body);
    let body = response.json();
    assert_eq!(body["choices"][0]["message"]["content"], "Hello");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    let prompt = "<|user|>\nHi there\n<|assistant|>\n";
    assert_eq!(body["usage"]["prompt_tokens"], prompt.len() + 1);
}

#[tokio::test]
async fn max_tokens_gives_length_and_stop_strings_cut_the_text() {
    let server = TestServer::default().await;
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let body = server
        .post_json("/v1/chat/completions", &chat(json!({"max_tokens": 8})))
        .await
        .json();
    assert_eq!(body["choices"][0]["message"]["content"], "Hello fr");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 8);

    let body = server
        .post_json("/v1/chat/completions", &chat(json!({"stop": "Flatrun"})))
        .await
        .json();
    assert_eq!(body["choices"][0]["message"]["content"], "Hello from the ");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");

    let body = server
        .post_json(
            "/v1/chat/completions",
            &chat(json!({"stop": ["zzz", "mock", "from"]})),
        )
        .await
        .json();
    assert_eq!(body["choices"][0]["message"]["content"], "Hello ");
}

#[tokio::test]
async fn same_seed_same_sampled_text() {
    let server = TestServer::default().await;
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "temperature": 1.5, "seed": 42, "max_tokens": 30});
    let a = server.post_json("/v1/chat/completions", &body).await.json();
    let b = server.post_json("/v1/chat/completions", &body).await.json();
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );
}

#[tokio::test]
async fn chat_stream_has_role_first_then_content_then_done() {
    let server = TestServer::default().await;
    let response = server
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "stream": true}),
        )
        .await;
    assert_eq!(response.status, 200, "{}", response.body);
    assert!(
        response
            .header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = response.sse_events();
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(name, data)| {
            assert!(name.is_none());
            serde_json::from_str(data).unwrap()
        })
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["id"], chunks[0]["id"]);
        assert!(
            chunk.get("usage").is_none(),
            "usage only with include_usage"
        );
        if let Some(piece) = chunk["choices"][0]["delta"]["content"].as_str() {
            text.push_str(piece);
        }
    }
    assert_eq!(text, REPLY);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(last["choices"][0]["delta"], json!({}));
    for chunk in &chunks[..chunks.len() - 1] {
        assert!(chunk["choices"][0]["finish_reason"].is_null());
    }
}

#[tokio::test]
async fn chat_stream_include_usage_adds_a_usage_chunk() {
    let server = TestServer::default().await;
    let response = server
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 4,
                    "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await;
    let events = response.sse_events();
    let n = events.len();
    assert_eq!(events[n - 1].1, "[DONE]");
    let usage_chunk: Value = serde_json::from_str(&events[n - 2].1).unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 4);
    let finish_chunk: Value = serde_json::from_str(&events[n - 3].1).unwrap();
    assert_eq!(finish_chunk["choices"][0]["finish_reason"], "length");
    assert!(finish_chunk["usage"].is_null());
}

#[tokio::test]
async fn completions_plain_and_streaming() {
    let server = TestServer::default().await;
    let body = server
        .post_json(
            "/v1/completions",
            &json!({"model": "mock", "prompt": "Once upon", "temperature": 0}),
        )
        .await
        .json();
    assert_eq!(body["object"], "text_completion");
    // The legacy default max_tokens is 16.
    assert_eq!(body["choices"][0]["text"], &REPLY[..16]);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["prompt_tokens"], "Once upon".len() + 1);

    let response = server
        .post_json(
            "/v1/completions",
            &json!({"prompt": ["Once upon"], "temperature": 0, "max_tokens": 100, "stream": true}),
        )
        .await;
    let events = response.sse_events();
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let mut text = String::new();
    let mut finish = Value::Null;
    for (_, data) in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert_eq!(chunk["object"], "text_completion");
        text.push_str(chunk["choices"][0]["text"].as_str().unwrap());
        if !chunk["choices"][0]["finish_reason"].is_null() {
            finish = chunk["choices"][0]["finish_reason"].clone();
        }
    }
    assert_eq!(text, REPLY);
    assert_eq!(finish, "stop");
}

#[tokio::test]
async fn models_lists_the_served_model() {
    let server = TestServer::default().await;
    let body = server.get("/v1/models").await.json();
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"][0]["id"], "mock");
    assert_eq!(body["data"][0]["object"], "model");
    assert_eq!(server.get("/v1/models/mock").await.json()["id"], "mock");
    assert_openai_error(
        &server.get("/v1/models/gpt-4").await,
        404,
        "not_found_error",
    );
}

#[tokio::test]
async fn errors_have_the_openai_shape_and_status() {
    let mut cfg = config();
    cfg.max_body_bytes = 2048;
    let mock = MockConfig {
        context_length: 128,
        ..MockConfig::default()
    };
    let server = TestServer::start(mock, SchedulerConfig::default(), cfg).await;
    let chat = "/v1/chat/completions";

    // Malformed JSON.
    let body = assert_openai_error(
        &server.post(chat, "{\"messages\": [").await,
        400,
        "invalid_request_error",
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("malformed JSON")
    );
    // Wrong types.
    assert_openai_error(
        &server.post(chat, r#"{"messages": "hi"}"#).await,
        400,
        "invalid_request_error",
    );
    assert_openai_error(
        &server
            .post(
                chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}"#,
            )
            .await,
        400,
        "invalid_request_error",
    );
    // Missing messages, empty messages, unknown role, image parts.
    assert_openai_error(
        &server.post(chat, r#"{"model": "mock"}"#).await,
        400,
        "invalid_request_error",
    );
    assert_openai_error(
        &server.post(chat, r#"{"messages": []}"#).await,
        400,
        "invalid_request_error",
    );
    assert_openai_error(
        &server
            .post(
                chat,
                r#"{"messages": [{"role": "wizard", "content": "x"}]}"#,
            )
            .await,
        400,
        "invalid_request_error",
    );
    assert_openai_error(
        &server
            .post(chat, r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#)
            .await,
        400,
        "invalid_request_error",
    );
    // n outside 1..=64.
    let body = assert_openai_error(
        &server
            .post(
                chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "n": 65}"#,
            )
            .await,
        400,
        "invalid_request_error",
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("got 65")
    );
    // Unknown model.
    let body = assert_openai_error(
        &server
            .post(
                chat,
                r#"{"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}"#,
            )
            .await,
        404,
        "not_found_error",
    );
    assert_eq!(body["error"]["code"], "model_not_found");
    // Oversized body.
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(4096)}]}).to_string();
    let body = assert_openai_error(&server.post(chat, &big).await, 413, "invalid_request_error");
    assert_eq!(body["error"]["code"], "request_too_large");
    // Context overflow: 128-token context.
    let long =
        json!({"messages": [{"role": "user", "content": "y".repeat(100)}], "max_tokens": 100})
            .to_string();
    let body = assert_openai_error(
        &server.post(chat, &long).await,
        400,
        "invalid_request_error",
    );
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    let body = assert_openai_error(
        &server
            .post(
                "/v1/completions",
                &json!({"prompt": "z".repeat(200)}).to_string(),
            )
            .await,
        400,
        "invalid_request_error",
    );
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    // Bad sampling values.
    assert_openai_error(
        &server
            .post(
                chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "top_p": 0}"#,
            )
            .await,
        400,
        "invalid_request_error",
    );
    // Unknown path and wrong method.
    assert_openai_error(&server.get("/v1/nothing").await, 404, "not_found_error");
    assert_openai_error(&server.get(chat).await, 405, "invalid_request_error");
    // No generation was started by any of these.
    assert_eq!(
        server
            .stats
            .sequences_opened
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
}

#[tokio::test]
async fn without_max_tokens_generation_may_use_the_rest_of_the_context() {
    let mock = MockConfig {
        context_length: 40,
        repeat: true,
        ..MockConfig::default()
    };
    let server = TestServer::start(mock, SchedulerConfig::default(), config()).await;
    let body = server
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}),
        )
        .await
        .json();
    let prompt = "<|user|>\nHi\n<|assistant|>\n".len() + 1;
    assert_eq!(body["usage"]["completion_tokens"], 40 - prompt);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn a_final_assistant_message_is_a_past_turn_unless_continued() {
    let server = TestServer::default().await;
    let messages = json!([{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Sure:"}]);
    // OpenAI's behaviour: the assistant message is history, a new turn follows.
    let new_turn = server
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": messages, "temperature": 0}),
        )
        .await;
    let prompt = "<|user|>\nHi\n<|assistant|>\nSure:\n<|assistant|>\n";
    assert_eq!(new_turn.json()["usage"]["prompt_tokens"], prompt.len() + 1);
    // vLLM's `continue_final_message`: the answer continues that message.
    let continued = server
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": messages, "temperature": 0, "continue_final_message": true}),
        )
        .await;
    let body = continued.json();
    let prompt = "<|user|>\nHi\n<|assistant|>\nSure:";
    assert_eq!(body["usage"]["prompt_tokens"], prompt.len() + 1);
    assert_eq!(body["choices"][0]["message"]["content"], REPLY);
    server.wait_all_freed().await;
}
