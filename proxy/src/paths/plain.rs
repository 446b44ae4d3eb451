//! The plain path (`[verify] enabled = false`): the client's bytes go
//! upstream untouched unless the model name changes, and the answer comes
//! back as the provider sent it, streams through the [`Relay`].

use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use canarygate_policies::tokens::count_chat_messages;
use tokio::sync::OwnedSemaphorePermit;

use crate::body::{PendingBody, Served};
use crate::context::RequestContext;
use crate::error::ApiError;
use crate::relay::Relay;
use crate::trail::Trail;
use crate::upstream::is_event_stream;
use crate::wire::{ClientRequest, WireFormat};

/// Forwards `request` (received as `bytes`; `renamed` when its model was
/// changed for the provider) and relays the answer.
pub async fn serve<W: WireFormat>(
    context: &RequestContext<'_, W>,
    request: &ClientRequest,
    bytes: Bytes,
    renamed: bool,
    trail: &mut Trail,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> Result<Served, ApiError> {
    trail.prompt_tokens_ours(count_chat_messages(&W::prompt_messages(&request.body)));
    let upstream_body = if renamed {
        Bytes::from(serde_json::to_vec(&request.body).map_err(|error| {
            ApiError::internal(format!("re-encoding the request failed: {error}"))
        })?)
    } else {
        bytes
    };
    let sent_at = Instant::now();
    trail.forwarded();
    let response = context
        .send(trail.clock(), upstream_body, request.stream)
        .await?;
    trail.first_byte(sent_at.elapsed().as_millis() as u64);
    trail.provider_request_id(context.provider_request_id());
    let status = response.status();
    let upstream = context.upstream;
    if status.is_success() && request.stream && is_event_stream(response.headers()) {
        let permit = permit
            .take()
            .ok_or_else(|| ApiError::internal("the request's concurrency slot is gone"))?;
        let first_byte_timeout =
            Duration::from_millis(context.state.policy.limits.first_byte_timeout_ms);
        let relay = Relay::<W>::provider(
            response,
            upstream.name.clone(),
            context.idle_timeout(),
            sent_at + first_byte_timeout,
            permit,
        );
        let head = context.event_stream_response(None);
        return Ok(Served::Stream(head, PendingBody::new(relay)));
    }
    let body = upstream
        .read_whole(trail.clock(), response, context.body_deadlines())
        .await?;
    if !status.is_success() {
        return Ok(Served::Whole(context.provider_error_response(status, body)));
    }
    trail.prompt_tokens_provider(W::usage_in(&body).map(|usage| usage.prompt_tokens));
    Ok(Served::Whole(context.json_response(
        status,
        Body::from(body),
        None,
    )))
}
