//! The batch scheduler: sequences advance together, a full queue is refused
//! at once (429 / 529), and a client that goes away frees its sequence.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{TestServer, config, open_stream_until, request};
use flatrun_server::mock::{MockConfig, mock_engine};
use flatrun_server::{
    Engine, EngineError, GenerationEvent, GenerationRequest, SamplingParams, SchedulerConfig,
};
use serde_json::json;

fn endless() -> MockConfig {
    MockConfig {
        repeat: true,
        step_delay: Duration::from_millis(5),
        context_length: 1_000_000,
        ..MockConfig::default()
    }
}

fn greedy(prompt: &str, max_tokens: usize) -> GenerationRequest {
    let mut tokens = vec![flatrun_server::mock::BOS];
    tokens.extend(prompt.bytes().map(u32::from));
    GenerationRequest {
        prompt: tokens,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        max_tokens,
        stop: vec![],
        ..GenerationRequest::default()
    }
}

#[tokio::test]
async fn concurrent_sequences_share_each_step() {
    let mock = MockConfig {
        step_delay: Duration::from_millis(10),
        ..MockConfig::default()
    };
    let scheduler = SchedulerConfig {
        max_seqs: 4,
        ..SchedulerConfig::default()
    };
    let (engine, stats) = mock_engine(mock, scheduler).unwrap();
    let streams: Vec<_> = (0..4)
        .map(|_| engine.submit(greedy("Hi", 20)).unwrap())
        .collect();
    let mut texts = Vec::new();
    for stream in streams {
        texts.push(stream.collect_text().await.unwrap().0);
    }
    assert!(
        texts.iter().all(|t| t == "Hello from the Flatr"),
        "{texts:?}"
    );
    assert_eq!(stats.max_batch.load(Ordering::SeqCst), 4);
    // 4 × 20 tokens in about 21 steps, not 84.
    assert!(
        stats.steps.load(Ordering::SeqCst) <= 30,
        "{} steps",
        stats.steps.load(Ordering::SeqCst)
    );
    assert_eq!(engine.stats().generated_tokens_total, 80);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while stats.live_sequences.load(Ordering::SeqCst) != 0 {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn long_prompts_are_prefilled_in_chunks_beside_decoding_sequences() {
    let scheduler = SchedulerConfig {
        max_seqs: 2,
        prefill_chunk: 8,
        ..SchedulerConfig::default()
    };
    let (engine, _stats) = mock_engine(MockConfig::default(), scheduler).unwrap();
    let long = engine.submit(greedy(&"p".repeat(100), 10)).unwrap();
    let short = engine.submit(greedy("q", 10)).unwrap();
    let (a, b) = tokio::join!(long.collect_text(), short.collect_text());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.0, "Hello from");
    assert_eq!(b.0, "Hello from");
    assert_eq!(a.2.prompt_tokens, 101);
    assert_eq!(engine.stats().prompt_tokens_total, 101 + 2);
}

#[tokio::test]
async fn full_queue_is_refused_immediately() {
    let scheduler = SchedulerConfig {
        max_seqs: 2,
        max_queue: 1,
        ..SchedulerConfig::default()
    };
    let (engine, stats) = mock_engine(endless(), scheduler).unwrap();
    let held: Vec<_> = (0..3)
        .map(|_| engine.submit(greedy("Hi", 100_000)).unwrap())
        .collect();
    while engine.stats().active_sequences != 2 || engine.stats().queued_requests != 1 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    match engine.submit(greedy("Hi", 10)) {
        Err(EngineError::QueueFull { limit, .. }) => assert_eq!(limit, 3),
        other => panic!("expected QueueFull, got {other:?}"),
    }
    // Dropping a running stream frees its place (at the next step).
    drop(held);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while stats.live_sequences.load(Ordering::SeqCst) != 0 || engine.stats().queued_requests != 0 {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(engine.submit(greedy("Hi", 3)).is_ok());
}

#[tokio::test]
async fn dropping_a_stream_frees_the_sequence_at_the_next_step() {
    let (engine, stats) = mock_engine(endless(), SchedulerConfig::default()).unwrap();
    let mut stream = engine.submit(greedy("Hi", 100_000)).unwrap();
    for _ in 0..3 {
        assert!(matches!(
            stream.next_event().await,
            Some(GenerationEvent::Token { .. })
        ));
    }
    assert_eq!(stats.live_sequences.load(Ordering::SeqCst), 1);
    let steps_at_drop = stats.steps.load(Ordering::SeqCst);
    drop(stream);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while stats.live_sequences.load(Ordering::SeqCst) != 0 {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(stats.steps.load(Ordering::SeqCst) <= steps_at_drop + 2);
    assert_eq!(engine.stats().active_sequences, 0);
}

#[tokio::test]
async fn http_queue_full_is_429_for_openai_and_529_for_anthropic() {
    let scheduler = SchedulerConfig {
        max_seqs: 1,
        max_queue: 1,
        ..SchedulerConfig::default()
    };
    let server = TestServer::start(endless(), scheduler, config()).await;
    let stream_body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100_000, "stream": true}).to_string();
    // One running, one queued (it never produces a token, so wait for its headers only).
    let (_running, _) = open_stream_until(
        server.addr,
        "/v1/chat/completions",
        &[],
        &stream_body,
        r#""content":"l""#,
    )
    .await;
    let (_queued, _) = open_stream_until(
        server.addr,
        "/v1/chat/completions",
        &[],
        &stream_body,
        "\r\n\r\n",
    )
    .await;

    let openai = server
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
        )
        .await;
    assert_eq!(openai.status, 429, "{}", openai.body);
    assert_eq!(openai.json()["error"]["type"], "rate_limit_error");
    let anthropic = server
        .post_json("/v1/messages", &json!({"model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}))
        .await;
    assert_eq!(anthropic.status, 529, "{}", anthropic.body);
    assert_eq!(anthropic.json()["error"]["type"], "overloaded_error");
    // The worker picks up the queued request at its next step.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut metrics = server.get("/metrics").await.body;
    while !metrics.contains("flatrun_queue_depth 1") {
        assert!(std::time::Instant::now() < deadline, "{metrics}");
        tokio::time::sleep(Duration::from_millis(10)).await;
        metrics = server.get("/metrics").await.body;
    }
    assert!(metrics.contains("flatrun_active_sequences 1"), "{metrics}");
    // A queued client that goes away gives its place back.
    drop(_queued);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !server
        .get("/metrics")
        .await
        .body
        .contains("flatrun_queue_depth 0")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "queued request not dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (_accepted, head) = open_stream_until(
        server.addr,
        "/v1/chat/completions",
        &[],
        &stream_body,
        "\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

#[tokio::test]
async fn client_disconnect_mid_stream_frees_its_sequence() {
    let server = TestServer::start(endless(), SchedulerConfig::default(), config()).await;
    let openai = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100_000, "stream": true}).to_string();
    let anthropic = json!({"model": "mock", "max_tokens": 100_000, "stream": true, "messages": [{"role": "user", "content": "Hi"}]}).to_string();
    let (a, _) = open_stream_until(
        server.addr,
        "/v1/chat/completions",
        &[],
        &openai,
        r#""content":"l""#,
    )
    .await;
    let (b, _) = open_stream_until(
        server.addr,
        "/v1/messages",
        &[],
        &anthropic,
        r#""text":"l""#,
    )
    .await;
    assert_eq!(server.stats.live_sequences.load(Ordering::SeqCst), 2);
    drop(a);
    drop(b);
    server.wait_all_freed().await;
    // A non-streaming client that gives up is freed too.
    let addr = server.addr;
    let body =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100_000}).to_string();
    let waiting = tokio::spawn(async move {
        request(addr, "POST", "/v1/chat/completions", &[], body.as_bytes()).await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(server.stats.live_sequences.load(Ordering::SeqCst), 1);
    waiting.abort();
    server.wait_all_freed().await;
    // And the server still answers.
    let ok = server
        .post_json("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}))
        .await;
    assert_eq!(ok.json()["choices"][0]["message"]["content"], "Hel");
}
