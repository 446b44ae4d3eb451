//! What a request must get through before the pipeline sees it: a
//! credential, a whole body within the limits and in time, and a
//! concurrency slot.
//!
//! The slot comes last: a client that sends its body slowly holds its
//! connection (until `limits.client_body_timeout_ms`), never one of the
//! `limits.max_concurrent_requests` slots.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::request::Parts;
use axum::http::{HeaderMap, header};
use canarygate_policies::config::Limits;
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::error::{ApiError, ErrorCode, error_chain};
use crate::metrics::Metrics;
use crate::pipeline::Admitted;
use crate::state::AppState;
use crate::trail::Trail;

/// Admits one request: authenticates the caller (recorded in `trail`),
/// reads the body (413 over the size limit, 408 past a deadline), then
/// takes a slot (429 when none is free).
pub async fn admit<'a>(
    state: &AppState,
    request_id: Arc<str>,
    parts: &'a Parts,
    body: Body,
    trail: &mut Trail,
) -> Result<Admitted<'a>, ApiError> {
    let headers = &parts.headers;
    let limits = &state.policy.limits;
    let caller = state.auth.authenticate(headers)?;
    if let Some(client) = &caller.client_name {
        tracing::debug!(%request_id, client, "managed client");
    }
    trail.caller(&caller);
    let body = read_body(headers, body, limits, &state.metrics).await?;
    let permit = state
        .slots
        .clone()
        .try_acquire_owned()
        .map_err(|_| ApiError::overloaded(limits.max_concurrent_requests))?;
    Ok(Admitted {
        request_id,
        caller,
        headers,
        query: parts.uri.query(),
        body,
        permit: Some(permit),
    })
}

/// Reads the request body: uncompressed (415 for any `Content-Encoding` but
/// `identity`), at most `limits.max_body_bytes`, all of it within
/// `limits.client_body_timeout_ms`, no two chunks further apart than
/// `limits.client_body_idle_timeout_ms`.
async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limits: &Limits,
    metrics: &Metrics,
) -> Result<Bytes, ApiError> {
    // A compressed body would read as invalid JSON: say what it is.
    // Every value of every `Content-Encoding` line.
    let mut encodings = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .flat_map(|value| value.as_bytes().split(|byte| *byte == b','));
    if let Some(encoding) =
        encodings.find(|coding| !coding.trim_ascii().eq_ignore_ascii_case(b"identity"))
    {
        return Err(ApiError::new(
            ErrorCode::UnsupportedContentEncoding,
            format!(
                "canarygate reads request bodies uncompressed: `Content-Encoding: {}` is not \
                 accepted. Send the body without it.",
                String::from_utf8_lossy(encoding.trim_ascii())
            ),
        ));
    }
    let limit = limits.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(ApiError::body_too_large(limit));
    }
    let total = Duration::from_millis(limits.client_body_timeout_ms);
    let idle = Duration::from_millis(limits.client_body_idle_timeout_ms);
    let deadline = Instant::now() + total;
    let mut body = http_body_util::Limited::new(body, limit);
    let mut chunks: Vec<Bytes> = Vec::new();
    loop {
        let next_chunk_by = (Instant::now() + idle).min(deadline);
        let frame = match tokio::time::timeout_at(next_chunk_by, body.frame()).await {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(_) if next_chunk_by >= deadline => {
                metrics.count_client_timeout("body");
                return Err(ApiError::body_timeout(
                    "client_body_timeout_ms",
                    limits.client_body_timeout_ms,
                ));
            }
            Err(_) => {
                metrics.count_client_timeout("body_idle");
                return Err(ApiError::body_timeout(
                    "client_body_idle_timeout_ms",
                    limits.client_body_idle_timeout_ms,
                ));
            }
        };
        match frame {
            // Trailers carry nothing a chat request needs.
            Ok(frame) => {
                if let Ok(data) = frame.into_data()
                    && !data.is_empty()
                {
                    chunks.push(data);
                }
            }
            Err(error) => {
                let over_limit = std::iter::successors(
                    Some(error.as_ref() as &(dyn std::error::Error + 'static)),
                    |e| e.source(),
                )
                .any(|e| e.is::<http_body_util::LengthLimitError>());
                return Err(if over_limit {
                    ApiError::body_too_large(limit)
                } else {
                    ApiError::new(
                        ErrorCode::InvalidBody,
                        format!(
                            "Could not read the request body: {}",
                            error_chain(error.as_ref())
                        ),
                    )
                });
            }
        }
    }
    Ok(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().unwrap_or_default(),
        _ => chunks.concat().into(),
    })
}
