//! Errors as each API shapes them, with their HTTP status.
//!
//! OpenAI: `{"error": {"message", "type", "param", "code"}}`.
//! Anthropic: `{"type": "error", "error": {"type", "message"}}`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::engine::EngineError;

/// Which API's conventions a response follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiFlavor {
    OpenAi,
    Anthropic,
}

impl ApiFlavor {
    /// Anthropic for `/v1/messages…`, OpenAI for everything else.
    pub fn for_path(path: &str) -> Self {
        if path.starts_with("/v1/messages") {
            ApiFlavor::Anthropic
        } else {
            ApiFlavor::OpenAi
        }
    }
}

/// The kind of failure, which fixes the status and the error type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// 400: malformed JSON, wrong types, missing fields, context overflow.
    InvalidRequest,
    /// 401: missing or wrong API key.
    Authentication,
    /// 404: unknown model or path.
    NotFound,
    /// 405: wrong method on a known path.
    MethodNotAllowed,
    /// 413: body over the limit.
    PayloadTooLarge,
    /// 429 (OpenAI) / 529 (Anthropic): the queue is full.
    Overloaded,
    /// 503: the model is still loading, or the server is shutting down.
    Unavailable,
    /// 504: the request ran past `--request-timeout`.
    Timeout,
    /// 500: anything else.
    Internal,
}

/// An error response in the shape of one API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub flavor: ApiFlavor,
    pub kind: ErrorKind,
    pub message: String,
    /// OpenAI's machine-readable `code` (Anthropic has none).
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(flavor: ApiFlavor, kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError {
            flavor,
            kind,
            message: message.into(),
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn invalid(flavor: ApiFlavor, message: impl Into<String>) -> Self {
        ApiError::new(flavor, ErrorKind::InvalidRequest, message)
    }

    /// Maps an engine refusal onto this API's error.
    pub fn from_engine(flavor: ApiFlavor, error: EngineError) -> Self {
        let message = error.to_string();
        match error {
            EngineError::QueueFull { .. } => ApiError::new(flavor, ErrorKind::Overloaded, message)
                .with_code("rate_limit_exceeded"),
            EngineError::ContextOverflow { .. } => {
                ApiError::invalid(flavor, message).with_code("context_length_exceeded")
            }
            EngineError::InvalidRequest(_) => ApiError::invalid(flavor, message),
            EngineError::Text(_) => ApiError::invalid(flavor, message),
            EngineError::ShuttingDown => {
                ApiError::new(flavor, ErrorKind::Unavailable, message).with_code("shutting_down")
            }
        }
    }

    pub fn status(&self) -> StatusCode {
        match (self.kind, self.flavor) {
            (ErrorKind::InvalidRequest, _) => StatusCode::BAD_REQUEST,
            (ErrorKind::Authentication, _) => StatusCode::UNAUTHORIZED,
            (ErrorKind::NotFound, _) => StatusCode::NOT_FOUND,
            (ErrorKind::MethodNotAllowed, _) => StatusCode::METHOD_NOT_ALLOWED,
            (ErrorKind::PayloadTooLarge, _) => StatusCode::PAYLOAD_TOO_LARGE,
            (ErrorKind::Overloaded, ApiFlavor::OpenAi) => StatusCode::TOO_MANY_REQUESTS,
            // Anthropic's "overloaded_error" status.
            (ErrorKind::Overloaded, ApiFlavor::Anthropic) => {
                StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE)
            }
            (ErrorKind::Unavailable, _) => StatusCode::SERVICE_UNAVAILABLE,
            (ErrorKind::Timeout, _) => StatusCode::GATEWAY_TIMEOUT,
            (ErrorKind::Internal, _) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The `type` field of the error object.
    pub fn error_type(&self) -> &'static str {
        match self.flavor {
            ApiFlavor::OpenAi => match self.kind {
                ErrorKind::Authentication => "authentication_error",
                ErrorKind::NotFound => "not_found_error",
                ErrorKind::Overloaded => "rate_limit_error",
                ErrorKind::Unavailable | ErrorKind::Internal | ErrorKind::Timeout => "server_error",
                _ => "invalid_request_error",
            },
            ApiFlavor::Anthropic => match self.kind {
                ErrorKind::InvalidRequest | ErrorKind::MethodNotAllowed => "invalid_request_error",
                ErrorKind::Authentication => "authentication_error",
                ErrorKind::NotFound => "not_found_error",
                ErrorKind::PayloadTooLarge => "request_too_large",
                ErrorKind::Overloaded | ErrorKind::Unavailable => "overloaded_error",
                ErrorKind::Timeout => "timeout_error",
                ErrorKind::Internal => "api_error",
            },
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            ApiFlavor::OpenAi => json!({
                "error": {
                    "message": self.message,
                    "type": self.error_type(),
                    "param": null,
                    "code": self.code,
                }
            }),
            ApiFlavor::Anthropic => json!({
                "type": "error",
                "error": {"type": self.error_type(), "message": self.message},
            }),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status(), Json(self.body())).into_response()
    }
}
