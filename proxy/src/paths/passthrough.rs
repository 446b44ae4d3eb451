//! The passthrough path: endpoints whose answers carry no model text to
//! verify. Embeddings, `[endpoints] passthrough` paths, and the auxiliary
//! endpoints of the verified APIs (a stored response fetched or deleted,
//! Anthropic's token count) are forwarded as they are, and their answer
//! comes back whole, as the provider sent it: status, body, content type,
//! the provider headers clients act on. A stored response or chat
//! completion is the one answer edited ([`Forward::stored`]): the provider
//! kept canarygate's blocks and the echo, which are taken out. Each is
//! recorded with the verdict `unverifiable` and the endpoint it called.

use std::collections::HashMap;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use canarygate_policies::canary::Canary;
use canarygate_policies::registry::CanaryRegistry;
use serde_json::Value;

use crate::context::RequestContext;
use crate::error::ApiError;
use crate::trail::Trail;
use crate::upstream::is_json_media;
use crate::wire::WireFormat;
use crate::wire::chat::scrub_stored_completion;
use crate::wire::responses::scrub_stored_response;
use crate::wire::stored::canaries_in;

/// Objects a provider stored of requests canarygate placed, read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// The Responses API's responses and input items
    /// ([`scrub_stored_response`]).
    Responses,
    /// Chat Completions' stored completions and their messages
    /// ([`scrub_stored_completion`]).
    ChatCompletions,
}

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
    /// The answer is a stored object read back: a successful JSON one has
    /// the text of the caller's own canaries taken out; its bytes stay the
    /// provider's unless that changed something.
    pub stored: Option<Stored>,
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
    let body = match forward.stored {
        Some(stored) if content_type.as_ref().is_some_and(is_json_media) => {
            scrubbed(context, stored, body).await
        }
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

/// A stored object's `body` without the text of the caller's own
/// canaries (registered to its session, asked of the shared registry when
/// there is one): the provider's own bytes when it is not JSON or nothing
/// is taken out. A canary the registry cannot vouch for stays.
async fn scrubbed<W: WireFormat>(
    context: &RequestContext<'_, W>,
    stored: Stored,
    body: Bytes,
) -> Bytes {
    let Ok(mut value) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    let spans = canaries_in(&value);
    if spans.is_empty() {
        return body;
    }
    let registry = &context.state.registry;
    let mut fetched = HashMap::new();
    // Unresolved spans are settled as unknown: they stay.
    let _ = registry.resolve(&spans, &mut fetched).await;
    let lookup = registry.lookup(&fetched);
    let session = &context.caller.session_id;
    let ours = |canary: Canary| {
        lookup
            .owner(&canary)
            .is_some_and(|owner| owner.session == *session)
    };
    let changed = match stored {
        Stored::Responses => scrub_stored_response(&mut value, &ours),
        Stored::ChatCompletions => scrub_stored_completion(&mut value, &ours),
    };
    if !changed {
        return body;
    }
    serde_json::to_vec(&value).map_or(body, Bytes::from)
}
