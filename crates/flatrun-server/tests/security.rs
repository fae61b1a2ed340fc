//! The server's security limits over the mock model: the API key on every
//! endpoint but the health probes (and `/metrics` behind a flag), the
//! per-request token and time limits, the request head's size and time
//! limits (slowloris), CORS off by default and per origin with `--cors`,
//! and no path from a request to the filesystem.

mod common;

use std::time::{Duration, Instant};

use common::{TestServer, config, open_stream_until, request};
use flatrun_server::SchedulerConfig;
use flatrun_server::mock::MockConfig;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn chat(max_tokens: Option<u64>, stream: bool) -> String {
    let mut body = json!({"messages": [{"role": "user", "content": "Hi"}], "stream": stream});
    if let Some(n) = max_tokens {
        body["max_tokens"] = json!(n);
    }
    body.to_string()
}

#[tokio::test]
async fn api_key_guards_everything_but_the_probes() {
    let mut cfg = config();
    cfg.api_key = Some("s3cret-key".to_string());
    let server = TestServer::start(MockConfig::default(), SchedulerConfig::default(), cfg).await;
    for path in ["/health", "/health/ready", "/health/live"] {
        assert_eq!(server.get(path).await.status, 200, "{path}");
    }
    for (method, path) in [
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/mock"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/no/such/path"),
    ] {
        for key in ["", "s3cret-ke", "s3cret-keyX", "S3CRET-KEY"] {
            let auth = format!("Bearer {key}");
            let headers: &[(&str, &str)] = if key.is_empty() {
                &[]
            } else {
                &[("Authorization", auth.as_str())]
            };
            let response = request(server.addr, method, path, headers, b"{}").await;
            assert_eq!(response.status, 401, "{method} {path} with {key:?}");
        }
    }
    let ok = request(
        server.addr,
        "GET",
        "/metrics",
        &[("x-api-key", "s3cret-key")],
        b"",
    )
    .await;
    assert_eq!(ok.status, 200);
    server.shutdown().await.unwrap();

    // `--public-metrics` opens /metrics, nothing else.
    let mut cfg = config();
    cfg.api_key = Some("s3cret-key".to_string());
    cfg.public_metrics = true;
    let server = TestServer::start(MockConfig::default(), SchedulerConfig::default(), cfg).await;
    assert_eq!(server.get("/metrics").await.status, 200);
    assert_eq!(server.get("/v1/models").await.status, 401);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn max_tokens_limit_refuses_more_and_caps_the_default() {
    let mut cfg = config();
    cfg.max_tokens_limit = Some(5);
    let mock = MockConfig {
        repeat: true,
        ..MockConfig::default()
    };
    let server = TestServer::start(mock, SchedulerConfig::default(), cfg).await;
    let over = server
        .post("/v1/chat/completions", &chat(Some(6), false))
        .await;
    assert_eq!(over.status, 400, "{}", over.body);
    assert_eq!(over.json()["error"]["code"], "max_tokens_limit");
    let over = server
        .post(
            "/v1/messages",
            &json!({"max_tokens": 100, "messages": [{"role": "user", "content": "Hi"}]})
                .to_string(),
        )
        .await;
    assert_eq!(over.status, 400);
    assert!(over.body.contains("limit of 5"), "{}", over.body);
    // No max_tokens: at most the limit (the endless mock would run to the context).
    let capped = server
        .post("/v1/chat/completions", &chat(None, false))
        .await;
    assert_eq!(capped.status, 200, "{}", capped.body);
    assert_eq!(capped.json()["usage"]["completion_tokens"], 5);
    assert_eq!(capped.json()["choices"][0]["finish_reason"], "length");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn request_timeout_ends_answers_and_streams_and_frees_the_slot() {
    let mut cfg = config();
    cfg.request_timeout = Some(Duration::from_millis(300));
    let mock = MockConfig {
        repeat: true,
        step_delay: Duration::from_millis(5),
        ..MockConfig::default()
    };
    let server = TestServer::start(mock, SchedulerConfig::default(), cfg).await;
    let started = Instant::now();
    let late = server
        .post("/v1/chat/completions", &chat(Some(400), false))
        .await;
    assert_eq!(late.status, 504, "{}", late.body);
    assert_eq!(late.json()["error"]["code"], "request_timeout");
    assert!(started.elapsed() < Duration::from_secs(2));
    server.wait_all_freed().await;

    for (path, body, last) in [
        ("/v1/chat/completions", chat(Some(400), true), "\"request_timeout\""),
        (
            "/v1/messages",
            json!({"max_tokens": 400, "stream": true, "messages": [{"role": "user", "content": "Hi"}]})
                .to_string(),
            "event: error",
        ),
    ] {
        let stream = request(server.addr, "POST", path, &[], body.as_bytes()).await;
        assert_eq!(stream.status, 200);
        assert!(stream.body.contains(last), "{path}: {}", stream.body);
        assert!(stream.body.contains("timeout"), "{path}: {}", stream.body);
        server.wait_all_freed().await;
    }
    // A quick request is untouched.
    let quick = server
        .post("/v1/chat/completions", &chat(Some(3), false))
        .await;
    assert_eq!(quick.status, 200, "{}", quick.body);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn slow_and_oversized_request_heads_are_cut_off() {
    let mut cfg = config();
    cfg.header_timeout = Duration::from_millis(500);
    cfg.max_header_bytes = 16 * 1024;
    let server = TestServer::default_with(cfg).await;

    // Slowloris: a head trickled byte by byte never completes.
    let mut socket = TcpStream::connect(server.addr).await.unwrap();
    let started = Instant::now();
    let head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    let mut closed = false;
    for &byte in head.iter().chain(std::iter::repeat(&b'a')) {
        if socket.write_all(&[byte]).await.is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        if started.elapsed() > Duration::from_secs(5) {
            break;
        }
        let mut buf = [0u8; 256];
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(1), socket.read(&mut buf)).await
        {
            closed = n == 0 || String::from_utf8_lossy(&buf[..n]).contains("408");
            if closed {
                break;
            }
        }
    }
    assert!(closed, "a slow client is disconnected");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );

    // A head over the limit: 431.
    let big = "a".repeat(32 * 1024);
    let response = request(server.addr, "GET", "/health", &[("X-Big", &big)], b"").await;
    assert_eq!(response.status, 431);
    // The server still answers.
    assert_eq!(server.get("/health").await.status, 200);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn cors_is_off_by_default_and_per_origin_with_the_flag() {
    let server = TestServer::default().await;
    let plain = request(
        server.addr,
        "GET",
        "/v1/models",
        &[("Origin", "https://evil.example")],
        b"",
    )
    .await;
    assert_eq!(plain.status, 200);
    assert_eq!(plain.header("access-control-allow-origin"), None);
    let preflight = request(
        server.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &[
            ("Origin", "https://evil.example"),
            ("Access-Control-Request-Method", "POST"),
        ],
        b"",
    )
    .await;
    assert_eq!(preflight.header("access-control-allow-origin"), None);
    server.shutdown().await.unwrap();

    let mut cfg = config();
    cfg.cors_origins = vec!["https://app.example".to_string()];
    cfg.api_key = Some("k".to_string());
    let server = TestServer::default_with(cfg).await;
    let preflight = request(
        server.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &[
            ("Origin", "https://app.example"),
            ("Access-Control-Request-Method", "POST"),
            (
                "Access-Control-Request-Headers",
                "authorization, content-type",
            ),
        ],
        b"",
    )
    .await;
    assert_eq!(preflight.status, 204, "preflights need no key");
    assert_eq!(
        preflight.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    assert!(
        preflight
            .header("access-control-allow-headers")
            .is_some_and(|h| h.contains("authorization"))
    );
    let call = request(
        server.addr,
        "GET",
        "/v1/models",
        &[("Origin", "https://app.example"), ("x-api-key", "k")],
        b"",
    )
    .await;
    assert_eq!(call.status, 200);
    assert_eq!(
        call.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    let other = request(
        server.addr,
        "GET",
        "/v1/models",
        &[("Origin", "https://evil.example"), ("x-api-key", "k")],
        b"",
    )
    .await;
    assert_eq!(other.header("access-control-allow-origin"), None);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn model_names_never_become_paths() {
    let server = TestServer::default().await;
    for name in [
        "../../../../etc/passwd",
        "/etc/passwd",
        "mock/../../etc/passwd",
        "file:///etc/passwd",
        "%2e%2e%2fetc%2fpasswd",
    ] {
        let chat = json!({"model": name, "max_tokens": 2,
                          "messages": [{"role": "user", "content": "Hi"}]});
        let response = server.post_json("/v1/chat/completions", &chat).await;
        assert_eq!(response.status, 404, "{name}: {}", response.body);
        assert!(!response.body.contains("root:"), "{}", response.body);
        let response = server.post_json("/v1/messages", &chat).await;
        assert_eq!(response.status, 404, "{name}: {}", response.body);
        let path = format!("/v1/models/{}", name.replace('/', "%2F"));
        let response = server.get(&path).await;
        assert_eq!(response.status, 404, "{path}: {}", response.body);
    }
    // A disconnect mid-stream still frees the slot with the limits layer on.
    let (socket, _) = open_stream_until(
        server.addr,
        "/v1/chat/completions",
        &[],
        &chat(Some(50), true),
        "data:",
    )
    .await;
    drop(socket);
    server.wait_all_freed().await;
    server.shutdown().await.unwrap();
}
