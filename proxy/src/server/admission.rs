//! What a request must get through before the pipeline sees it: a
//! concurrency slot, a credential, and a whole body within the limits.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, header};

use crate::error::{ApiError, ErrorCode, error_chain};
use crate::pipeline::Admitted;
use crate::state::AppState;
use crate::trail::Trail;

/// Admits one request: takes a slot (429 when none is free), authenticates
/// the caller (recorded in `trail`) and reads the body.
pub async fn admit<'a>(
    state: &AppState,
    request_id: Arc<str>,
    headers: &'a HeaderMap,
    body: Body,
    trail: &mut Trail,
) -> Result<Admitted<'a>, ApiError> {
    let limits = &state.policy.limits;
    let permit = state
        .slots
        .clone()
        .try_acquire_owned()
        .map_err(|_| ApiError::overloaded(limits.max_concurrent_requests))?;
    let caller = state.auth.authenticate(headers)?;
    if let Some(client) = &caller.client_name {
        tracing::debug!(%request_id, client, "managed client");
    }
    trail.caller(&caller);
    let body = read_body(headers, body, limits.max_body_bytes).await?;
    Ok(Admitted {
        request_id,
        caller,
        headers,
        body,
        permit: Some(permit),
    })
}

/// Reads the request body, refusing anything over `limit` bytes.
async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(ApiError::body_too_large(limit));
    }
    axum::body::to_bytes(body, limit).await.map_err(|error| {
        let over_limit =
            std::iter::successors(Some(&error as &(dyn std::error::Error + 'static)), |e| {
                e.source()
            })
            .any(|e| e.is::<http_body_util::LengthLimitError>());
        if over_limit {
            ApiError::body_too_large(limit)
        } else {
            ApiError::new(
                ErrorCode::InvalidBody,
                format!("Could not read the request body: {}", error_chain(&error)),
            )
        }
    })
}
