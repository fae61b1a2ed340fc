//! `flatrun serve` on SmolLM2 under load, over loopback, bounded to a couple
//! of minutes (short answers):
//!
//! 1. one client at a time, then 16 concurrent streaming clients sending
//!    200 requests in all: no failure, every answer complete, the same greedy
//!    text batched as alone, and the aggregate tokens/s of each (printed);
//! 2. the batch and the queue full (`--max-seqs 16 --max-queue 4`): the
//!    next request gets 429 (OpenAI) / 529 (Anthropic) at once; then every
//!    client is killed mid-stream, all sequences are freed and the server
//!    still answers;
//! 3. Anthropic behaviour on the real model: `ping` events during a long
//!    prefill, assistant prefill, `stop_reason: "stop_sequence"` with the
//!    matched `stop_sequence`; the API key from `FLATRUN_API_KEY`;
//! 4. SIGTERM with a stream in flight: the stream ends cleanly and the
//!    process exits with success.
//!
//! Figures go to stderr (`cargo test --release -p flatrun-cli --test
//! serve_load -- --nocapture`).

mod common;
#[path = "common/serve_process.rs"]
mod serve_process;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::smollm2;
use serde_json::{Value, json};
use serve_process::ServeProcess;

const API_KEY: &str = "load-test-key";
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";
const CLIENTS: usize = 16;
const REQUESTS: usize = 200;
const SEQUENTIAL_REQUESTS: usize = 8;
const MAX_TOKENS: usize = 16;
const QUEUE: usize = 4;
const QUESTIONS: [&str; 4] = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 2 + 2?",
    "Say hello.",
];

/// The server under test and a small HTTP client for it.
struct Server {
    process: ServeProcess,
    address: String,
}

impl Server {
    /// Starts the server with the API key from the environment (not a flag).
    fn start(model: &Path) -> Server {
        let (clients, queue) = (CLIENTS.to_string(), QUEUE.to_string());
        let process = ServeProcess::start(
            model,
            &[
                "--ctx",
                "1024",
                "-q",
                "--max-seqs",
                &clients,
                "--max-queue",
                &queue,
                "--ping-interval",
                "0.05",
                "--shutdown-grace",
                "1",
            ],
            &[("FLATRUN_API_KEY", API_KEY)],
        );
        let address = process.address.clone();
        Server { process, address }
    }

    fn try_request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> std::io::Result<Response> {
        let mut socket = send(&self.address, method, path, headers, body)?;
        let mut raw = Vec::new();
        socket.read_to_end(&mut raw)?;
        Ok(Response::parse(&raw))
    }

    /// A request with the API key; panics on a transport error.
    fn request(&self, method: &str, path: &str, body: &Value) -> Response {
        self.try_request(method, path, &[("x-api-key", API_KEY)], &body.to_string())
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// The gauges and counters of `/metrics`.
    fn metric(&self, name: &str) -> f64 {
        let text = self
            .try_request("GET", "/metrics", &[("x-api-key", API_KEY)], "")
            .expect("GET /metrics")
            .body;
        text.lines()
            .find_map(|line| {
                let (key, value) = line.split_once(' ')?;
                (key == name).then(|| value.trim().parse().ok())?
            })
            .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
    }

    /// Polls `/metrics` until `active` sequences run and `queued` wait.
    fn wait_for_counts(&self, active: usize, queued: usize, within: Duration) -> Duration {
        let started = Instant::now();
        loop {
            let now = (
                self.metric("flatrun_active_sequences") as usize,
                self.metric("flatrun_queue_depth") as usize,
            );
            if now == (active, queued) {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < within,
                "expected {active} active and {queued} queued, have {now:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Opens a connection and sends one HTTP/1.1 request (`Connection: close`).
fn send(
    address: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<TcpStream> {
    let mut socket = TcpStream::connect(address)?;
    socket.set_read_timeout(Some(Duration::from_secs(300)))?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    socket.write_all(head.as_bytes())?;
    socket.write_all(body.as_bytes())?;
    Ok(socket)
}

struct Response {
    status: u16,
    body: String,
}

impl Response {
    fn parse(raw: &[u8]) -> Response {
        let text = String::from_utf8_lossy(raw);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)
        } else {
            body.to_string()
        };
        Response { status, body }
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The SSE events: (event name, data).
    fn events(&self) -> Vec<(Option<String>, String)> {
        let mut events = Vec::new();
        for block in self.body.split("\n\n") {
            let mut name = None;
            let mut data = String::new();
            for line in block.lines() {
                if let Some(rest) = line.strip_prefix("event:") {
                    name = Some(rest.trim().to_string());
                } else if let Some(rest) = line.strip_prefix("data:") {
                    data.push_str(rest.trim_start());
                }
            }
            if name.is_some() || !data.is_empty() {
                events.push((name, data));
            }
        }
        events
    }
}

/// The payload of a chunked transfer encoding.
fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || tail.len() < size {
            break;
        }
        out.push_str(&tail[..size]);
        rest = tail[size..].trim_start_matches("\r\n");
    }
    out
}

fn chat_body(question: &str, max_tokens: usize) -> Value {
    json!({"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "stream": true,
           "stream_options": {"include_usage": true},
           "messages": [{"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": question}]})
}

/// One streaming chat request: its text and completion tokens, or why it failed.
fn streaming_chat(server: &Server, question: &str) -> Result<(String, u64), String> {
    let response = server
        .try_request(
            "POST",
            "/v1/chat/completions",
            &[("Authorization", &format!("Bearer {API_KEY}"))],
            &chat_body(question, MAX_TOKENS).to_string(),
        )
        .map_err(|e| e.to_string())?;
    if response.status != 200 {
        return Err(format!("status {}: {}", response.status, response.body));
    }
    let events = response.events();
    if events.last().map(|e| e.1.as_str()) != Some("[DONE]") {
        return Err(format!("no [DONE]: {}", response.body));
    }
    let (mut text, mut tokens) = (String::new(), None);
    for (_, data) in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
        if chunk.get("error").is_some() {
            return Err(format!("error event: {data}"));
        }
        if let Some(piece) = chunk["choices"][0]["delta"]["content"].as_str() {
            text.push_str(piece);
        }
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            tokens = Some(n);
        }
    }
    match tokens {
        Some(n) if n > 0 && !text.is_empty() => Ok((text, n)),
        _ => Err(format!("no usage or no text: {}", response.body)),
    }
}

#[test]
fn flatrun_serve_under_load() {
    let Some(model) = smollm2() else { return };
    let server = Server::start(&model);
    let saw_loading = server.process.wait_healthy();
    eprintln!("load: /health answered 503 while loading: {saw_loading}");

    // --- 1a. One client at a time: the reference answers and the base rate.
    let mut reference = Vec::new();
    let started = Instant::now();
    let mut sequential_tokens = 0;
    for i in 0..SEQUENTIAL_REQUESTS {
        let (text, tokens) = streaming_chat(&server, QUESTIONS[i % QUESTIONS.len()])
            .unwrap_or_else(|e| panic!("sequential request {i}: {e}"));
        sequential_tokens += tokens;
        if i < QUESTIONS.len() {
            reference.push(text);
        }
    }
    let sequential_seconds = started.elapsed().as_secs_f64();
    let sequential_rate = sequential_tokens as f64 / sequential_seconds;

    // --- 1b. 16 concurrent streaming clients, 200 requests in all.
    let server = Arc::new(server);
    let next = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let mismatches = Arc::new(AtomicUsize::new(0));
    let reference = Arc::new(reference);
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (server, next, failures) = (server.clone(), next.clone(), failures.clone());
            let (reference, mismatches) = (reference.clone(), mismatches.clone());
            std::thread::spawn(move || {
                let mut tokens = 0;
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= REQUESTS {
                        return tokens;
                    }
                    let q = i % QUESTIONS.len();
                    match streaming_chat(&server, QUESTIONS[q]) {
                        Ok((text, n)) => {
                            tokens += n;
                            if text != reference[q] {
                                mismatches.fetch_add(1, Ordering::SeqCst);
                                eprintln!(
                                    "load: batched answer differs: {text:?} vs {:?}",
                                    reference[q]
                                );
                            }
                        }
                        Err(e) => failures.lock().expect("failures").push(e),
                    }
                }
            })
        })
        .collect();
    let concurrent_tokens: u64 = clients.into_iter().map(|c| c.join().expect("client")).sum();
    let concurrent_seconds = started.elapsed().as_secs_f64();
    let concurrent_rate = concurrent_tokens as f64 / concurrent_seconds;
    let failures = failures.lock().expect("failures").clone();
    let peak_rss = server.metric("flatrun_process_peak_resident_memory_bytes");
    let steps = server.metric("flatrun_decode_steps_total");
    eprintln!(
        "load: 1 client: {sequential_tokens} tokens in {sequential_seconds:.1} s = \
         {sequential_rate:.1} tok/s; {CLIENTS} clients, {REQUESTS} requests: \
         {concurrent_tokens} tokens in {concurrent_seconds:.1} s = {concurrent_rate:.1} tok/s \
         aggregate ({:.1}x); {} failures; {} batched answers differ from the lone ones; \
         {steps} steps; peak RSS {:.0} MiB",
        concurrent_rate / sequential_rate,
        failures.len(),
        mismatches.load(Ordering::SeqCst),
        peak_rss / (1024.0 * 1024.0),
    );
    assert!(
        failures.is_empty(),
        "{} failures: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(concurrent_tokens >= (REQUESTS as u64), "too few tokens");
    // The throughput ratio is printed above, not asserted: speed claims live in
    // benchmarks, and a shared machine's noise would make this test flaky.
    // Each sequence's KV cache is sized to its request, not the context.
    assert!(peak_rss < 512.0 * 1024.0 * 1024.0, "peak RSS {peak_rss}");
    server.wait_for_counts(0, 0, Duration::from_secs(10));

    // --- 2. Batch and queue full, then every client killed mid-stream.
    let long = chat_body("Write a long story about a dragon.", 600).to_string();
    let auth = [("x-api-key", API_KEY)];
    let mut streams = Vec::new();
    for _ in 0..CLIENTS + QUEUE {
        streams.push(
            send(
                &server.address,
                "POST",
                "/v1/chat/completions",
                &auth,
                &long,
            )
            .expect("send"),
        );
    }
    let filled = server.wait_for_counts(CLIENTS, QUEUE, Duration::from_secs(120));
    let openai_full = server.request("POST", "/v1/chat/completions", &chat_body("Hi", 4));
    let anthropic_full = server.request(
        "POST",
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(openai_full.status, 429, "{}", openai_full.body);
    assert_eq!(openai_full.json()["error"]["type"], "rate_limit_error");
    assert_eq!(anthropic_full.status, 529, "{}", anthropic_full.body);
    assert_eq!(anthropic_full.json()["error"]["type"], "overloaded_error");
    // Read a little of each running stream, then kill every client.
    let mut first = [0u8; 256];
    for stream in streams.iter_mut().take(4) {
        let _ = stream.read(&mut first);
    }
    let generated_before = server.metric("flatrun_generated_tokens_total");
    drop(streams);
    let freed_in = server.wait_for_counts(0, 0, Duration::from_secs(30));
    let generated_after = server.metric("flatrun_generated_tokens_total");
    let after = streaming_chat(&server, QUESTIONS[0]).expect("a request after the kills");
    assert_eq!(after.0, reference[0]);
    eprintln!(
        "load: {CLIENTS} running + {QUEUE} queued in {:.1} s, then 429 / 529 at once; \
         {} clients killed mid-stream: all freed in {:.2} s ({} tokens generated meanwhile), \
         the server answers again",
        filled.as_secs_f64(),
        CLIENTS + QUEUE,
        freed_in.as_secs_f64(),
        generated_after - generated_before,
    );

    // --- 3a. Pings during a long prefill, before the first text.
    let long_prompt = "The quick brown fox jumps over the lazy dog. ".repeat(80);
    let response = server.request(
        "POST",
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 4, "stream": true, "temperature": 0,
                "messages": [{"role": "user", "content": long_prompt}]}),
    );
    assert_eq!(response.status, 200, "{}", response.body);
    let names: Vec<String> = response
        .events()
        .into_iter()
        .filter_map(|(name, _)| name)
        .collect();
    let first_delta = names
        .iter()
        .position(|n| n == "content_block_delta")
        .expect("no text");
    let pings = names[..first_delta].iter().filter(|n| *n == "ping").count();
    assert!(pings > 0, "no ping during the prefill: {names:?}");
    let without_pings: Vec<&String> = names.iter().filter(|n| *n != "ping").collect();
    assert_eq!(without_pings[..2], ["message_start", "content_block_start"]);
    assert_eq!(
        without_pings[without_pings.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );

    // --- 3b. Assistant prefill: the answer continues the given text.
    let question = "What is the capital of France?";
    let prefilled = server.request(
        "POST",
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": question},
                             {"role": "assistant", "content": "The capital of France is"}]}),
    );
    assert_eq!(prefilled.status, 200, "{}", prefilled.body);
    let continuation = prefilled.json()["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        continuation.starts_with(" Paris"),
        "prefill continued with {continuation:?}"
    );

    // --- 3c. stop_sequence: cut the greedy answer at one of its words.
    let plain = server.request(
        "POST",
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": question}]}),
    );
    let answer = plain.json()["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let word = answer
        .split_whitespace()
        .nth(2)
        .unwrap_or_else(|| panic!("short answer {answer:?}"))
        .to_string();
    let cut = server.request(
        "POST",
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 24, "temperature": 0,
                "stop_sequences": ["#never#", word],
                "messages": [{"role": "user", "content": question}]}),
    );
    let cut = cut.json();
    assert_eq!(cut["stop_reason"], "stop_sequence", "{cut}");
    assert_eq!(cut["stop_sequence"], word.as_str(), "{cut}");
    let expected = &answer[..answer.find(&word).expect("word in answer")];
    assert_eq!(cut["content"][0]["text"], expected, "{cut}");

    // --- 3d. The key from FLATRUN_API_KEY is required.
    let no_key = server
        .try_request(
            "POST",
            "/v1/messages",
            &[],
            &json!({"max_tokens": 1}).to_string(),
        )
        .expect("request");
    assert_eq!(no_key.status, 401);
    assert_eq!(no_key.json()["error"]["type"], "authentication_error");

    // --- 4. SIGTERM with a stream in flight.
    let mut in_flight = send(
        &server.address,
        "POST",
        "/v1/chat/completions",
        &auth,
        &long,
    )
    .expect("send");
    let mut seen = Vec::new();
    let mut buffer = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"content\":\"") {
        let n = in_flight.read(&mut buffer).expect("read the stream");
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buffer[..n]);
    }
    let mut server = Arc::try_unwrap(server).ok().expect("the only owner");
    let stopping = Instant::now();
    let status = server.process.terminate();
    let _ = in_flight.read_to_end(&mut seen);
    let tail = Response::parse(&seen);
    assert!(status.success(), "flatrun serve exited with {status}");
    assert!(
        tail.body.trim_end().ends_with("data: [DONE]"),
        "the stream did not end cleanly: {}",
        &tail.body[tail.body.len().saturating_sub(300)..]
    );
    eprintln!(
        "load: SIGTERM with a stream in flight: stream closed with [DONE], exit {status} after {:.1} s",
        stopping.elapsed().as_secs_f64()
    );
}
