//! A bounded loopback load test over the mock model (4 ms per step, like a
//! small model whose step cost is loading its layers): 16 concurrent
//! streaming clients, 200 requests, no failure, and the aggregate tokens/s
//! against one client at a time; then clients killed mid-stream are freed
//! and the server still answers.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{TestServer, config, open_stream_until, request};
use flatrun_server::SchedulerConfig;
use flatrun_server::mock::MockConfig;
use serde_json::{Value, json};

const REPLY: &str = "Hello from the Flatrun mock model.";

/// One streaming chat request; returns the completion tokens, or why it failed.
async fn streaming_chat(addr: std::net::SocketAddr) -> Result<u64, String> {
    let body = json!({"model": "mock", "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "Hi"}]})
    .to_string();
    let response = request(addr, "POST", "/v1/chat/completions", &[], body.as_bytes()).await;
    if response.status != 200 {
        return Err(format!("status {}: {}", response.status, response.body));
    }
    let events = response.sse_events();
    if events.last().map(|e| e.1.as_str()) != Some("[DONE]") {
        return Err(format!("no [DONE]: {}", response.body));
    }
    let mut text = String::new();
    let mut tokens = 0;
    for (_, data) in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(data).map_err(|e| e.to_string())?;
        if let Some(piece) = chunk["choices"][0]["delta"]["content"].as_str() {
            text.push_str(piece);
        }
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            tokens = n;
        }
    }
    if text != REPLY {
        return Err(format!("wrong text {text:?}"));
    }
    Ok(tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_streaming_clients_two_hundred_requests() {
    let mock = MockConfig {
        step_delay: Duration::from_millis(4),
        ..MockConfig::default()
    };
    let scheduler = SchedulerConfig {
        max_seqs: 16,
        max_queue: 64,
        ..SchedulerConfig::default()
    };
    let server = TestServer::start(mock, scheduler, config()).await;
    let addr = server.addr;

    // One client at a time.
    let sequential_requests = 10;
    let started = Instant::now();
    let mut sequential_tokens = 0;
    for _ in 0..sequential_requests {
        sequential_tokens += streaming_chat(addr).await.expect("sequential request");
    }
    let sequential_rate = sequential_tokens as f64 / started.elapsed().as_secs_f64();

    // 16 clients, 200 requests in all.
    let total_requests = 200;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let next = next.clone();
            tokio::spawn(async move {
                let mut tokens = 0u64;
                let mut failures = Vec::new();
                while next.fetch_add(1, Ordering::SeqCst) < total_requests {
                    match streaming_chat(addr).await {
                        Ok(n) => tokens += n,
                        Err(e) => failures.push(e),
                    }
                }
                (tokens, failures)
            })
        })
        .collect();
    let mut concurrent_tokens = 0;
    let mut failures = Vec::new();
    for client in clients {
        let (tokens, mut errors) = client.await.expect("client task");
        concurrent_tokens += tokens;
        failures.append(&mut errors);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let concurrent_rate = concurrent_tokens as f64 / elapsed;
    eprintln!(
        "load: 1 client: {sequential_rate:.0} tok/s; 16 clients, {total_requests} requests: \
         {concurrent_rate:.0} tok/s aggregate ({:.1}x), {elapsed:.2} s, {} failures, largest batch {}",
        concurrent_rate / sequential_rate,
        failures.len(),
        server.stats.max_batch.load(Ordering::SeqCst)
    );
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(concurrent_tokens, (total_requests * REPLY.len()) as u64);
    assert!(
        concurrent_rate > 4.0 * sequential_rate,
        "batching gave too little"
    );
    server.wait_all_freed().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_clients_are_freed_and_the_server_keeps_answering() {
    let mock = MockConfig {
        step_delay: Duration::from_millis(4),
        repeat: true,
        context_length: 1_000_000,
        ..MockConfig::default()
    };
    let scheduler = SchedulerConfig {
        max_seqs: 16,
        ..SchedulerConfig::default()
    };
    let server = TestServer::start(mock, scheduler, config()).await;
    let body = json!({"model": "mock", "max_tokens": 100_000, "stream": true,
                      "messages": [{"role": "user", "content": "Hi"}]})
    .to_string();
    // Twelve endless streams, read a little, then killed.
    let mut sockets = Vec::new();
    for i in 0..12 {
        let path = if i % 2 == 0 {
            "/v1/chat/completions"
        } else {
            "/v1/messages"
        };
        let needle = if i % 2 == 0 {
            r#""content":"l""#
        } else {
            r#""text":"l""#
        };
        sockets.push(
            open_stream_until(server.addr, path, &[], &body, needle)
                .await
                .0,
        );
    }
    assert_eq!(server.stats.live_sequences.load(Ordering::SeqCst), 12);
    let steps_before = server.stats.steps.load(Ordering::SeqCst);
    drop(sockets);
    server.wait_all_freed().await;
    let steps_to_free = server.stats.steps.load(Ordering::SeqCst) - steps_before;
    eprintln!("load: 12 killed streams freed within {steps_to_free} steps");
    let metrics = server.get("/metrics").await.body;
    assert!(metrics.contains("flatrun_active_sequences 0"), "{metrics}");
    let ok = server
        .post_json("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}))
        .await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json()["choices"][0]["message"]["content"], "Hello");
}
