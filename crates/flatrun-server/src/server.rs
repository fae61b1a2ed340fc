//! The router, the middleware (CORS, API key, request time limit, metrics),
//! the small endpoints (`/health`, `/metrics`, `/tokenize`, `/detokenize`),
//! and the server's life cycle: bind, accept (with a deadline and a size
//! limit on each request head), serve, graceful shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;

use crate::api_error::{ApiError, ApiFlavor, ErrorKind};
use crate::config::ServerConfig;
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::models::ModelSet;
use crate::request_body::{RawBody, parse_json};
use crate::state::{AppState, EngineSlot};
use crate::{anthropic, openai};

/// Errors that stop the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("server I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("model failed to load: {0}")]
    Load(String),
}

/// The full router over `state`.
pub fn router(state: AppState) -> Router {
    let body_limit = state.config.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(openai::list_models))
        .route("/v1/models/{id}", get(openai::get_model))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/health", get(health))
        .route("/health/ready", get(health))
        .route("/health/live", get(live))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), limit_time))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), cors))
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// Refuses requests without the configured API key (`/health` and its
/// probes are open, `/metrics` too with `--public-metrics`).
async fn require_api_key(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(expected) = state.config.api_key.as_deref() else {
        return next.run(request).await;
    };
    let path = request.uri().path();
    let open = matches!(path, "/health" | "/health/ready" | "/health/live")
        || (path == "/metrics" && state.config.public_metrics);
    if open
        || presented_key(request.headers())
            .is_some_and(|key| keys_match(key.as_bytes(), expected.as_bytes()))
    {
        return next.run(request).await;
    }
    let message = if presented_key(request.headers()).is_some() {
        "invalid API key"
    } else {
        "missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`"
    };
    ApiError::new(
        ApiFlavor::for_path(path),
        ErrorKind::Authentication,
        message,
    )
    .with_code("invalid_api_key")
    .into_response()
}

/// The key from `Authorization: Bearer KEY` or `x-api-key: KEY`.
fn presented_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(key) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(key.trim());
    }
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// Whether `presented` equals `expected`, in a time that depends only on
/// the expected key's length (no early exit at the first differing byte).
fn keys_match(presented: &[u8], expected: &[u8]) -> bool {
    let mut diff = presented.len() ^ expected.len();
    for (i, &e) in expected.iter().enumerate() {
        let p = presented.get(i).copied().unwrap_or(!e);
        diff |= usize::from(std::hint::black_box(p ^ e));
    }
    std::hint::black_box(diff) == 0
}

/// `--request-timeout`: a request that has not answered by the deadline is a
/// 504; a stream still running at the deadline ends with an error event
/// (dropping the generation, which frees its slot).
async fn limit_time(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(limit) = state.config.request_timeout else {
        return next.run(request).await;
    };
    let flavor = ApiFlavor::for_path(request.uri().path());
    let deadline = tokio::time::Instant::now() + limit;
    let timed_out = || {
        ApiError::new(
            flavor,
            ErrorKind::Timeout,
            format!(
                "the request took longer than this server's limit of {:.1} s",
                limit.as_secs_f64()
            ),
        )
        .with_code("request_timeout")
    };
    let response = match tokio::time::timeout_at(deadline, next.run(request)).await {
        Ok(response) => response,
        Err(_) => return timed_out().into_response(),
    };
    let is_stream = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !is_stream {
        return response;
    }
    let (parts, body) = response.into_parts();
    let error = timed_out();
    let last_event = match flavor {
        ApiFlavor::OpenAi => format!("data: {}\n\n", error.body()),
        ApiFlavor::Anthropic => format!("event: error\ndata: {}\n\n", error.body()),
    };
    let data = Box::pin(body.into_data_stream());
    let sleep = Box::pin(tokio::time::sleep_until(deadline));
    let events = futures::stream::unfold(Some((data, sleep, last_event)), |state| async move {
        let (mut data, mut sleep, last_event) = state?;
        tokio::select! {
            chunk = futures::StreamExt::next(&mut data) => {
                chunk.map(|chunk| (chunk, Some((data, sleep, last_event))))
            }
            _ = &mut sleep => Some((Ok(axum::body::Bytes::from(last_event)), None)),
        }
    });
    Response::from_parts(parts, Body::from_stream(events))
}

/// `--cors ORIGIN`: answers preflights and marks responses for the allowed
/// origins; without the flag no CORS header is ever sent (browsers then
/// refuse cross-origin calls).
async fn cors(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let allowed = &state.config.cors_origins;
    let origin = request.headers().get(header::ORIGIN).cloned();
    let allow = origin.filter(|origin| {
        allowed
            .iter()
            .any(|a| a == "*" || a.as_bytes() == origin.as_bytes())
    });
    let Some(origin) = allow else {
        return next.run(request).await;
    };
    let preflight = request.method() == Method::OPTIONS
        && request
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = if preflight {
        let mut response = StatusCode::NO_CONTENT.into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static(
                "authorization, content-type, x-api-key, anthropic-version, anthropic-beta",
            ),
        );
        headers.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        response
    } else {
        next.run(request).await
    };
    let headers = response.headers_mut();
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    headers.append(header::VARY, HeaderValue::from_static("origin"));
    response
}

/// Counts answered requests by endpoint and status for `/metrics`.
async fn count_requests(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let endpoint = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "other".to_string(), |p| p.as_str().to_string());
    let response = next.run(request).await;
    state
        .metrics
        .record_request(&endpoint, response.status().as_u16());
    response
}

async fn not_found(request: Request) -> Response {
    let path = request.uri().path().to_string();
    ApiError::new(
        ApiFlavor::for_path(&path),
        ErrorKind::NotFound,
        format!("no endpoint {} {path}", request.method()),
    )
    .into_response()
}

async fn method_not_allowed(request: Request) -> Response {
    let path = request.uri().path().to_string();
    ApiError::new(
        ApiFlavor::for_path(&path),
        ErrorKind::MethodNotAllowed,
        format!("method {} is not allowed on {path}", request.method()),
    )
    .into_response()
}

/// `GET /health`: 503 while the default model loads for the first time,
/// 200 after (a model unloaded since loads again on demand).
async fn health(State(state): State<AppState>) -> Response {
    let name = state.served_names(ApiFlavor::OpenAi).ok();
    match (state.models.default_ready(), name) {
        (true, Some(names)) => (
            StatusCode::OK,
            Json(json!({"status": "ok", "model": names[0]})),
        )
            .into_response(),
        _ => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

/// `GET /health/live`: 200 while the process answers (liveness; `/health`
/// and `/health/ready` are the readiness probe).
async fn live() -> Response {
    Json(json!({"status": "alive"})).into_response()
}

/// `GET /metrics`: Prometheus text.
async fn metrics(State(state): State<AppState>) -> Response {
    let default = state.models.default_engine();
    let text = state.metrics.render(
        default.as_ref().map(|engine| engine.as_ref()),
        &state.models.status(),
        state.config.model_policy.max_resident,
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// `POST /tokenize` body (llama-server's shape; `text` is accepted too).
#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    #[serde(alias = "text")]
    content: String,
    #[serde(default)]
    add_special: bool,
    /// The served model whose tokenizer to use (the default without it).
    #[serde(default)]
    model: Option<String>,
}

/// `POST /detokenize` body.
#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
    #[serde(default)]
    model: Option<String>,
}

async fn tokenize(State(state): State<AppState>, body: RawBody) -> Response {
    let flavor = ApiFlavor::OpenAi;
    let result = async {
        let request: TokenizeRequest = parse_json(flavor, body)?;
        let (engine, _) = state.route(flavor, request.model.as_deref()).await?;
        engine
            .tokenize(&request.content, request.add_special)
            .map_err(|e| ApiError::from_engine(flavor, e))
    }
    .await;
    match result {
        Ok(tokens) => Json(json!({"tokens": tokens})).into_response(),
        Err(error) => error.into_response(),
    }
}

async fn detokenize(State(state): State<AppState>, body: RawBody) -> Response {
    let flavor = ApiFlavor::OpenAi;
    let result = async {
        let request: DetokenizeRequest = parse_json(flavor, body)?;
        let (engine, _) = state.route(flavor, request.model.as_deref()).await?;
        engine
            .detokenize(&request.tokens)
            .map_err(|e| ApiError::from_engine(flavor, e))
    }
    .await;
    match result {
        Ok(content) => Json(json!({"content": content})).into_response(),
        Err(error) => error.into_response(),
    }
}

/// A bound server, not yet serving. Lets the caller learn the port (with
/// port 0) and install the engine later (`/health` is 503 until then).
pub struct Server {
    listener: TcpListener,
    state: AppState,
    default_slot: EngineSlot,
}

impl Server {
    /// Binds `config.host:config.port`.
    pub async fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        let address = format!("{}:{}", config.host, config.port);
        let listener = TcpListener::bind((config.host.as_str(), config.port))
            .await
            .map_err(|source| ServerError::Bind {
                address: address.clone(),
                source,
            })?;
        let default_slot = EngineSlot::default();
        Ok(Server {
            listener,
            state: AppState {
                models: ModelSet::new(config.model_policy, default_slot.clone()),
                config: Arc::new(config),
                metrics: Arc::new(Metrics::default()),
            },
            default_slot,
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> Result<SocketAddr, ServerError> {
        Ok(self.listener.local_addr()?)
    }

    /// Where to install the default model's engine once it is loaded
    /// (unless [`ModelSet::set_default_loader`] gave it a loader).
    pub fn engine_slot(&self) -> EngineSlot {
        self.default_slot.clone()
    }

    /// The models this server answers for.
    pub fn models(&self) -> ModelSet {
        self.state.models.clone()
    }

    /// Serves until `shutdown` completes, then stops accepting, lets
    /// in-flight requests finish for `shutdown_grace`, cancels what is left
    /// (their streams end with an error event) and returns.
    pub async fn run_until<F>(self, shutdown: F) -> Result<(), ServerError>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let Server {
            listener, state, ..
        } = self;
        state.models.spawn_keep_alive();
        let grace = state.config.shutdown_grace;
        let (signalled_tx, mut signalled_rx) = tokio::sync::watch::channel(false);
        let app = router(state.clone());
        let serving = accept_loop(listener, app, state.config.clone(), async move {
            shutdown.await;
            tracing::info!("shutting down: no new connections");
            let _ = signalled_tx.send(true);
        });
        tokio::pin!(serving);
        // After the signal, wait out the grace period, then cancel.
        let grace_over = async {
            while !*signalled_rx.borrow_and_update() {
                if signalled_rx.changed().await.is_err() {
                    return;
                }
            }
            tokio::time::sleep(grace).await;
        };
        tokio::select! {
            result = &mut serving => return Ok(result?),
            _ = grace_over => {}
        }
        tracing::info!("grace period over: cancelling in-flight generations");
        for engine in state.models.loaded_engines() {
            engine.shutdown();
        }
        match tokio::time::timeout(Duration::from_secs(5), serving).await {
            Ok(result) => Ok(result?),
            Err(_) => {
                tracing::warn!("connections still open 5 s after cancelling: leaving them");
                Ok(())
            }
        }
    }

    /// Serves until SIGINT or SIGTERM.
    pub async fn run(self) -> Result<(), ServerError> {
        self.run_until(shutdown_signal()).await
    }
}

/// Accepts connections until `shutdown` completes, serving each with HTTP/1.1:
/// a client that has not sent its whole request head within
/// `--header-timeout` is disconnected (slowloris), a head over `--max-header`
/// is a 431. After `shutdown`, idle connections close, busy ones after their
/// current response; returns when all are closed.
async fn accept_loop(
    listener: TcpListener,
    app: Router,
    config: Arc<ServerConfig>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use tower::ServiceExt;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Each connection task holds a clone; `closed()` is all of them gone.
    let (open_tx, open_rx) = tokio::sync::watch::channel(());
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of descriptors and the like: wait instead of spinning.
                    tracing::warn!("accept failed: {error}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<_>| {
            app.clone().oneshot(request.map(Body::new))
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(config.header_timeout)
            .max_buf_size(config.max_header_bytes.max(8192));
        let mut stop = stop_rx.clone();
        let open = open_rx.clone();
        tokio::spawn(async move {
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let mut draining = *stop.borrow();
            if draining {
                connection.as_mut().graceful_shutdown();
            }
            loop {
                tokio::select! {
                    result = connection.as_mut() => {
                        if let Err(error) = result {
                            tracing::debug!("connection ended: {error}");
                        }
                        break;
                    }
                    changed = stop.changed(), if !draining => {
                        draining = true;
                        if changed.is_err() || *stop.borrow() {
                            connection.as_mut().graceful_shutdown();
                        }
                    }
                }
            }
            drop(open);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {}
        _ = terminate => {}
    }
}

/// Serves a loaded engine until SIGINT/SIGTERM.
pub async fn serve(engine: Arc<dyn Engine>, config: ServerConfig) -> Result<(), ServerError> {
    let server = Server::bind(config).await?;
    server.engine_slot().set(engine);
    tracing::info!("listening on http://{}", server.local_addr()?);
    server.run().await
}

/// Binds first, answers `/health` with 503 while `load` runs on a blocking
/// thread, then serves the engine it returns until SIGINT/SIGTERM. A load
/// failure stops the server with [`ServerError::Load`].
pub async fn serve_loading<F>(config: ServerConfig, load: F) -> Result<(), ServerError>
where
    F: FnOnce() -> Result<Arc<dyn Engine>, String> + Send + 'static,
{
    let server = Server::bind(config).await?;
    let slot = server.engine_slot();
    tracing::info!(
        "listening on http://{} (loading the model)",
        server.local_addr()?
    );
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<String>();
    tokio::task::spawn_blocking(move || match load() {
        Ok(engine) => {
            slot.set(engine);
            tracing::info!("model loaded");
        }
        Err(message) => {
            let _ = failed_tx.send(message);
        }
    });
    let (load_error_tx, mut load_error_rx) = tokio::sync::oneshot::channel::<String>();
    let stop = async move {
        tokio::select! {
            _ = shutdown_signal() => {}
            failed = failed_rx => {
                if let Ok(message) = failed {
                    let _ = load_error_tx.send(message);
                } else {
                    // Loaded fine: wait for the signal.
                    shutdown_signal().await;
                }
            }
        }
    };
    server.run_until(stop).await?;
    match load_error_rx.try_recv() {
        Ok(message) => Err(ServerError::Load(message)),
        Err(_) => Ok(()),
    }
}
