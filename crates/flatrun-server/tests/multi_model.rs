//! One server, several models: each request is routed by its `model` field
//! (OpenAI and Anthropic), `/v1/models` lists them all, an unknown name is
//! each API's own 404, a model still loading a 503.

mod common;

use common::{TestServer, config};
use flatrun_server::mock::{MockConfig, mock_engine};
use flatrun_server::{Engine, SchedulerConfig};
use serde_json::json;
use std::sync::Arc;

async fn two_models() -> TestServer {
    let server = TestServer::default_with(config()).await;
    let second = MockConfig {
        model_name: "second".into(),
        reply: "Answer of the second model.".into(),
        ..MockConfig::default()
    };
    let (engine, _) = mock_engine(second, SchedulerConfig::default()).unwrap();
    let engine: Arc<dyn Engine> = Arc::new(engine);
    server.models.add("second").unwrap().set(engine);
    // Registered, never loaded.
    server.models.add("third").unwrap();
    server
}

fn chat(model: Option<&str>) -> serde_json::Value {
    let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0});
    if let Some(m) = model {
        body["model"] = json!(m);
    }
    body
}

#[tokio::test]
async fn requests_reach_the_model_they_name() {
    let server = two_models().await;
    for (model, served, reply) in [
        (None, "mock", "Hello"),
        (Some("mock"), "mock", "Hello"),
        (Some("second"), "second", "Answer"),
    ] {
        let r = server.post_json("/v1/chat/completions", &chat(model)).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["model"], served);
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(text.starts_with(reply), "{model:?}: {text}");
    }
    let r = server
        .post_json(
            "/v1/messages",
            &json!({"model": "second", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["model"], "second");
    assert!(
        v["content"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("Answer")
    );
    let r = server
        .post_json(
            "/v1/completions",
            &json!({"model": "second", "prompt": "x", "max_tokens": 4, "temperature": 0}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], "second");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn models_lists_every_model() {
    let server = two_models().await;
    let r = server.get("/v1/models").await;
    assert_eq!(r.status, 200);
    let ids: Vec<String> = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, vec!["mock", "second", "third"]);
    assert_eq!(server.get("/v1/models/second").await.status, 200);
    assert_eq!(server.get("/v1/models/nope").await.status, 404);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn unknown_and_loading_models_get_each_apis_error() {
    let server = two_models().await;
    let r = server
        .post_json("/v1/chat/completions", &chat(Some("nope")))
        .await;
    assert_eq!(r.status, 404, "{}", r.body);
    let v = r.json();
    assert_eq!(v["error"]["code"], "model_not_found");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("`mock`") && message.contains("`second`"),
        "{message}"
    );
    let r = server
        .post_json(
            "/v1/messages",
            &json!({"model": "nope", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}),
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "not_found_error");
    let r = server
        .post_json("/v1/chat/completions", &chat(Some("third")))
        .await;
    assert_eq!(r.status, 503, "{}", r.body);
    server.shutdown().await.unwrap();
}
