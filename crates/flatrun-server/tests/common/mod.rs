//! Shared helpers of the integration tests: a mock server on a free
//! loopback port and a minimal HTTP/1.1 client (so that the tests control
//! exactly when a connection is dropped).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use flatrun_server::mock::{MockConfig, MockStats, mock_engine};
use flatrun_server::{EngineSlot, ModelSet, SchedulerConfig, Server, ServerConfig};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A running server over the mock model.
pub struct TestServer {
    pub addr: SocketAddr,
    pub stats: Arc<MockStats>,
    pub slot: EngineSlot,
    /// The server's other models, by name.
    pub models: ModelSet,
    stop: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<Result<(), flatrun_server::ServerError>>>,
}

impl TestServer {
    /// A server with the mock engine installed.
    pub async fn start(mock: MockConfig, scheduler: SchedulerConfig, config: ServerConfig) -> Self {
        let (server, engine) = Self::start_loading(mock, scheduler, config).await;
        server.slot.set(engine);
        server
    }

    /// Bound and serving, but with no engine yet (the "loading" state); the
    /// engine is returned for the test to install.
    pub async fn start_loading(
        mock: MockConfig,
        scheduler: SchedulerConfig,
        config: ServerConfig,
    ) -> (Self, Arc<flatrun_server::BatchEngine>) {
        let (engine, stats) = mock_engine(mock, scheduler).expect("start engine");
        let server = Server::bind(config).await.expect("bind");
        let addr = server.local_addr().expect("addr");
        let slot = server.engine_slot();
        let models = server.models();
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(server.run_until(async move {
            let _ = rx.await;
        }));
        let test_server = TestServer {
            addr,
            stats,
            slot,
            models,
            stop: Some(tx),
            handle: Some(handle),
        };
        (test_server, Arc::new(engine))
    }

    pub async fn default() -> Self {
        Self::default_with(config()).await
    }

    /// The default mock under `config`.
    pub async fn default_with(config: ServerConfig) -> Self {
        Self::start(MockConfig::default(), SchedulerConfig::default(), config).await
    }

    /// Signals shutdown and waits for the server to return.
    pub async fn shutdown(mut self) -> Result<(), flatrun_server::ServerError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.handle.take() {
            Some(handle) => handle.await.expect("server task"),
            None => Ok(()),
        }
    }

    pub async fn post(&self, path: &str, body: &str) -> HttpResponse {
        request(self.addr, "POST", path, &[], body.as_bytes()).await
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> HttpResponse {
        self.post(path, &body.to_string()).await
    }

    pub async fn get(&self, path: &str) -> HttpResponse {
        request(self.addr, "GET", path, &[], b"").await
    }

    /// Waits until the mock has no live sequence (or panics after 5 s).
    pub async fn wait_all_freed(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.stats.live_sequences.load(Ordering::SeqCst) != 0 {
            assert!(
                Instant::now() < deadline,
                "sequences not freed: {}",
                self.stats.live_sequences.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A server config on a free loopback port.
pub fn config() -> ServerConfig {
    ServerConfig {
        port: 0,
        shutdown_grace: Duration::from_millis(500),
        ..ServerConfig::default()
    }
}

#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The SSE events of the body: (event name, data).
    pub fn sse_events(&self) -> Vec<(Option<String>, String)> {
        parse_sse(&self.body)
    }
}

/// Parses an SSE body into (event name, data) pairs.
pub fn parse_sse(body: &str) -> Vec<(Option<String>, String)> {
    let mut events = Vec::new();
    for block in body.split("\n\n") {
        let mut name = None;
        let mut data = Vec::new();
        for line in block.lines() {
            if let Some(rest) = line.strip_prefix("event:") {
                name = Some(rest.trim().to_string());
            } else if let Some(rest) = line.strip_prefix("data:") {
                data.push(rest.strip_prefix(' ').unwrap_or(rest).to_string());
            }
        }
        if name.is_some() || !data.is_empty() {
            events.push((name, data.join("\n")));
        }
    }
    events
}

/// Sends one request with `Connection: close` and reads the whole response.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> HttpResponse {
    let mut socket = TcpStream::connect(addr).await.expect("connect");
    write_request(&mut socket, method, path, headers, body).await;
    let mut raw = Vec::new();
    socket.read_to_end(&mut raw).await.expect("read response");
    parse_response(&raw)
}

pub async fn write_request(
    socket: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    socket.write_all(head.as_bytes()).await.expect("write head");
    // A server may answer (413) before reading a large body: ignore write errors.
    let _ = socket.write_all(body).await;
}

pub fn parse_response(raw: &[u8]) -> HttpResponse {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    HttpResponse {
        status,
        headers,
        body: String::from_utf8_lossy(&body).to_string(),
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = data.windows(2).position(|w| w == b"\r\n") {
        let size_text = String::from_utf8_lossy(&data[..line_end]).to_string();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("0").trim(), 16)
            .unwrap_or(0);
        data = &data[line_end + 2..];
        if size == 0 || data.len() < size {
            out.extend_from_slice(&data[..size.min(data.len())]);
            break;
        }
        out.extend_from_slice(&data[..size]);
        data = data.get(size + 2..).unwrap_or_default();
    }
    out
}

/// Opens a streaming request and reads until `needle` appears in what was
/// received, then returns the open socket and the bytes so far.
pub async fn open_stream_until(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    needle: &str,
) -> (TcpStream, String) {
    let mut socket = TcpStream::connect(addr).await.expect("connect");
    write_request(&mut socket, "POST", path, headers, body.as_bytes()).await;
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(10);
    while !String::from_utf8_lossy(&received).contains(needle) {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {needle:?}: {}",
            String::from_utf8_lossy(&received)
        );
        let n = tokio::time::timeout(Duration::from_secs(10), socket.read(&mut buffer))
            .await
            .expect("read timeout")
            .expect("read");
        assert!(
            n > 0,
            "stream closed before {needle:?}: {}",
            String::from_utf8_lossy(&received)
        );
        received.extend_from_slice(&buffer[..n]);
    }
    (socket, String::from_utf8_lossy(&received).to_string())
}

/// The token ids of each request's answer, all submitted to `engine` at
/// once (a failed generation panics).
pub fn answer_ids(
    engine: &dyn flatrun_server::Engine,
    requests: Vec<flatrun_server::GenerationRequest>,
) -> Vec<Vec<u32>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio");
    let streams: Vec<_> = requests
        .into_iter()
        .map(|r| engine.submit(r).expect("submit"))
        .collect();
    streams
        .into_iter()
        .map(|mut stream| {
            runtime.block_on(async {
                let mut ids = Vec::new();
                while let Some(event) = stream.next_event().await {
                    match event {
                        flatrun_server::GenerationEvent::Token { id, .. } => ids.push(id),
                        flatrun_server::GenerationEvent::Finished { .. } => break,
                        flatrun_server::GenerationEvent::Failed { message } => panic!("{message}"),
                    }
                }
                ids
            })
        })
        .collect()
}
