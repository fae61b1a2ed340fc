//! Health while loading, metrics, tokenize/detokenize, the API key, and
//! graceful shutdown.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{TestServer, config, open_stream_until, request};
use flatrun_server::SchedulerConfig;
use flatrun_server::mock::MockConfig;
use serde_json::json;

#[tokio::test]
async fn health_is_503_while_loading_then_200() {
    let (server, engine) =
        TestServer::start_loading(MockConfig::default(), SchedulerConfig::default(), config())
            .await;
    let health = server.get("/health").await;
    assert_eq!(health.status, 503);
    assert_eq!(health.json()["status"], "loading");
    // API calls while loading: 503 in each API's shape.
    let chat = server
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(chat.status, 503);
    assert_eq!(chat.json()["error"]["code"], "model_loading");
    let message = server
        .post_json(
            "/v1/messages",
            &json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(message.status, 503);
    assert_eq!(message.json()["type"], "error");
    assert!(
        server
            .get("/metrics")
            .await
            .body
            .contains("flatrun_model_loaded 0")
    );

    server.slot.set(engine);
    let health = server.get("/health").await;
    assert_eq!(health.status, 200);
    assert_eq!(health.json(), json!({"status": "ok", "model": "mock"}));
}

#[tokio::test]
async fn metrics_count_requests_and_tokens() {
    let server = TestServer::default().await;
    let body =
        json!({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 7});
    server.post_json("/v1/chat/completions", &body).await;
    server.post("/v1/chat/completions", "{").await;
    // The scheduler frees a finished sequence just after its last event.
    let mut metrics = server.get("/metrics").await;
    for _ in 0..200 {
        if metrics.body.contains("flatrun_active_sequences 0") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        metrics = server.get("/metrics").await;
    }
    assert_eq!(metrics.status, 200);
    assert!(
        metrics
            .header("content-type")
            .unwrap()
            .starts_with("text/plain")
    );
    let text = metrics.body;
    for needle in [
        "# TYPE flatrun_requests_total counter",
        "flatrun_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1",
        "flatrun_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1",
        "flatrun_generated_tokens_total 7",
        "flatrun_prompt_tokens_total 27",
        "flatrun_queue_depth 0",
        "flatrun_active_sequences 0",
        "flatrun_model_loaded 1",
        "flatrun_model_resident_bytes 1048576",
        "flatrun_generated_tokens_per_second ",
        "flatrun_process_peak_resident_memory_bytes ",
    ] {
        assert!(text.contains(needle), "missing `{needle}` in:\n{text}");
    }
}

#[tokio::test]
async fn tokenize_and_detokenize_round_trip() {
    let server = TestServer::default().await;
    let tokens = server
        .post_json("/tokenize", &json!({"content": "héllo"}))
        .await
        .json();
    assert_eq!(tokens["tokens"], json!([104, 195, 169, 108, 108, 111]));
    let with_bos = server
        .post_json("/tokenize", &json!({"content": "a", "add_special": true}))
        .await
        .json();
    assert_eq!(with_bos["tokens"], json!([256, 97]));
    let text = server
        .post_json(
            "/detokenize",
            &json!({"tokens": [104, 195, 169, 108, 108, 111]}),
        )
        .await
        .json();
    assert_eq!(text["content"], "héllo");
    let bad = server
        .post_json("/detokenize", &json!({"tokens": [99999]}))
        .await;
    assert_eq!(bad.status, 400);
    assert_eq!(
        server.post("/tokenize", r#"{"content": 5}"#).await.status,
        400
    );
}

#[tokio::test]
async fn api_key_is_required_as_bearer_or_x_api_key() {
    let mut cfg = config();
    cfg.api_key = Some("sekrit".to_string());
    let server = TestServer::start(MockConfig::default(), SchedulerConfig::default(), cfg).await;
    let chat =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).to_string();
    let message =
        json!({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}).to_string();

    // Missing and wrong keys: 401 in each API's shape, before any work.
    let missing = request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat.as_bytes(),
    )
    .await;
    assert_eq!(missing.status, 401);
    assert_eq!(missing.json()["error"]["code"], "invalid_api_key");
    let wrong = request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer nope")],
        chat.as_bytes(),
    )
    .await;
    assert_eq!(wrong.status, 401);
    let wrong = request(
        server.addr,
        "POST",
        "/v1/messages",
        &[("x-api-key", "nope")],
        message.as_bytes(),
    )
    .await;
    assert_eq!(wrong.status, 401);
    assert_eq!(wrong.json()["error"]["type"], "authentication_error");
    assert_eq!(
        request(server.addr, "GET", "/v1/models", &[], b"")
            .await
            .status,
        401
    );
    assert_eq!(
        request(server.addr, "GET", "/metrics", &[], b"")
            .await
            .status,
        401
    );
    assert_eq!(server.stats.sequences_opened.load(Ordering::SeqCst), 0);

    // Right key, either header; /health is open.
    let ok = request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer sekrit")],
        chat.as_bytes(),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    let ok = request(
        server.addr,
        "POST",
        "/v1/messages",
        &[("x-api-key", "sekrit")],
        message.as_bytes(),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(server.get("/health").await.status, 200);
}

#[tokio::test]
async fn shutdown_lets_short_requests_finish_and_cancels_endless_ones() {
    let mock = MockConfig {
        repeat: true,
        step_delay: Duration::from_millis(5),
        context_length: 100_000,
        ..MockConfig::default()
    };
    let mut cfg = config();
    cfg.shutdown_grace = Duration::from_millis(300);
    let server = TestServer::start(mock, SchedulerConfig::default(), cfg).await;
    let addr = server.addr;
    // A stream that would run for minutes.
    let body = json!({"model": "mock", "max_tokens": 50_000, "stream": true,
                      "messages": [{"role": "user", "content": "Hi"}]})
    .to_string();
    let (mut socket, _) =
        open_stream_until(addr, "/v1/messages", &[], &body, "content_block_delta").await;
    // A short request in flight when the signal comes: it completes.
    let short =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20}).to_string();
    let short = tokio::spawn(async move {
        request(addr, "POST", "/v1/chat/completions", &[], short.as_bytes()).await
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let stats = server.stats.clone();
    let started = std::time::Instant::now();
    server.shutdown().await.expect("clean shutdown");
    let short = short.await.unwrap();
    assert_eq!(short.status, 200, "{}", short.body);
    assert_eq!(short.json()["usage"]["completion_tokens"], 20);
    assert!(started.elapsed() < Duration::from_secs(5));
    // The stream ended with an error event; the sequence is freed.
    let mut rest = Vec::new();
    use tokio::io::AsyncReadExt;
    let _ = tokio::time::timeout(Duration::from_secs(5), socket.read_to_end(&mut rest)).await;
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("event: error"), "{rest}");
    assert_eq!(stats.live_sequences.load(Ordering::SeqCst), 0);
    // Nothing listens any more.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
