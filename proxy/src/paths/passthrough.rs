//! The passthrough path: endpoints whose answers carry no model text to
//! verify. Embeddings, `[endpoints] passthrough` paths, and the auxiliary
//! endpoints of the verified APIs (a stored response fetched or deleted,
//! Anthropic's token count) are forwarded as they are, and their answer
//! comes back whole, as the provider sent it: status, body, content type,
//! the provider headers clients act on. A stored response is the one
//! answer edited ([`Forward::scrub`]): the provider kept canarygate's blocks
//! and the echo, which are taken out. Each is recorded with the verdict
//! `unverifiable` and the endpoint it called.

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use serde_json::Value;

use crate::context::RequestContext;
use crate::error::ApiError;
use crate::trail::Trail;
use crate::wire::WireFormat;

/// One request to forward: the provider endpoint and what goes there.
pub struct Forward {
    /// The HTTP method, as the client sent it.
    pub method: Method,
    /// The provider's endpoint relative to its `base_url` (`embeddings`,
    /// `responses/resp_1`); the client's query string is added to it.
    pub endpoint: String,
    /// The body to send (the client's, with the model renamed when the
    /// route renames it); `None` when the client sent none.
    pub body: Option<Bytes>,
    /// The client's `Content-Type` (a file upload is multipart, not JSON).
    pub content_type: Option<HeaderValue>,
    /// Takes canarygate's own text out of a successful JSON answer (a
    /// stored response read back): the answer's bytes stay the provider's
    /// unless it changed something.
    pub scrub: Option<fn(&mut Value) -> bool>,
}

/// Forwards `forward` to the route's provider and answers with what it
/// answered.
pub async fn serve<W: WireFormat>(
    context: &RequestContext<'_, W>,
    forward: Forward,
    trail: &mut Trail,
) -> Result<Response, ApiError> {
    let upstream = context.upstream;
    let url = context.endpoint_url(&forward.endpoint)?;
    let mut outgoing = context.outgoing(forward.method, url, forward.body, false)?;
    if let Some(content_type) = forward.content_type {
        // Replaces the JSON content type the request was built with.
        outgoing
            .headers_mut()
            .insert(header::CONTENT_TYPE, content_type);
    }
    trail.forwarded();
    let started = std::time::Instant::now();
    let response = context.send_request(trail.clock(), outgoing).await?;
    trail.first_byte(started.elapsed().as_millis() as u64);
    trail.provider_request_id(context.provider_request_id());
    let status = response.status();
    let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
    let body = upstream
        .read_whole(trail.clock(), response, context.body_deadlines())
        .await?;
    if !status.is_success() {
        return Ok(context.provider_error_response(status, body));
    }
    let body = match forward.scrub {
        Some(scrub) if is_json(content_type.as_ref()) => scrubbed(body, scrub),
        _ => body,
    };
    let mut answer = context.json_response(status, Body::from(body), None);
    let headers = answer.headers_mut();
    match content_type {
        Some(value) => headers.insert(header::CONTENT_TYPE, value),
        None => headers.remove(header::CONTENT_TYPE),
    };
    headers.insert(
        crate::context::VERDICT_HEADER,
        HeaderValue::from_static("unverifiable"),
    );
    if status == StatusCode::NO_CONTENT {
        headers.remove(header::CONTENT_TYPE);
    }
    Ok(answer)
}

/// Whether a content type is JSON's (`application/json`, with parameters
/// or not).
fn is_json(content_type: Option<&HeaderValue>) -> bool {
    content_type
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|kind| kind.trim().eq_ignore_ascii_case("application/json"))
}

/// `body` after `scrub`: the provider's own bytes when it is not JSON or
/// nothing changed.
fn scrubbed(body: Bytes, scrub: fn(&mut Value) -> bool) -> Bytes {
    let Ok(mut value) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    if !scrub(&mut value) {
        return body;
    }
    serde_json::to_vec(&value).map_or(body, Bytes::from)
}
