//! JSON request bodies with each API's errors: an oversized body is a 413,
//! malformed JSON and wrong types are 400s (never axum's default 415/422/500).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::api_error::{ApiError, ApiFlavor, ErrorKind};

/// The extractor result handlers take: the raw body or why it could not be read.
pub type RawBody = Result<Bytes, BytesRejection>;

/// Parses a request body as `T`, in `flavor`'s error shape.
pub fn parse_json<T: DeserializeOwned>(flavor: ApiFlavor, body: RawBody) -> Result<T, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                flavor,
                ErrorKind::PayloadTooLarge,
                "request body is larger than the server's limit",
            )
            .with_code("request_too_large")
        } else {
            ApiError::invalid(
                flavor,
                format!("could not read the request body: {}", rejection.body_text()),
            )
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Data => "invalid request",
            _ => "malformed JSON in request body",
        };
        ApiError::invalid(flavor, format!("{what}: {e}")).with_code("invalid_request")
    })
}
