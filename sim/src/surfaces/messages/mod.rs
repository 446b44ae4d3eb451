//! Anthropic's Messages API: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`.
//!
//! Authentication as Anthropic takes it: the key in `x-api-key`, or (as
//! the anthropic Python SDK 2.x sends it) `Authorization: Bearer`; without
//! one, 401 `authentication_error` "x-api-key header is required". The
//! `anthropic-version` header is required (400 otherwise). Errors, 429s
//! and the overloaded 529 come in Anthropic's shape (see
//! [`crate::error`]), with Anthropic's headers.
//!
//! Prompt caching follows Anthropic's rules, not OpenAI's: only prefixes
//! ending at a `cache_control` breakpoint (a marked block, or the last
//! block with a top-level `cache_control`) are cached, from the prefix
//! cache's minimum length (1024 tokens by default, Anthropic's minimum for
//! its Sonnet models); a prefix read is reported in
//! `cache_read_input_tokens`, the rest up to the last breakpoint is written
//! and reported in `cache_creation_input_tokens`, and `input_tokens` counts
//! only the remainder. Anthropic also looks back up to 20 blocks before a
//! breakpoint for an earlier cached prefix; the simulator looks at the ends
//! of the 20 messages before it ([`crate::conversation::LOOKBACK_MESSAGES`])
//! and writes only at breakpoints.

mod render;
mod request;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::conversation::{CacheRule, Conversation, Framing, Turn};
use crate::delivery::{Rendered, deliver};
use crate::error::SimError;
use crate::headers::RateSnapshot;
use crate::surface::Surface;
use crate::surfaces::exchange::{Sim, begin, begin_uncounted, finish};
pub use render::Rendering;
pub use request::MessagesRequest;

/// `POST /v1/messages`.
pub async fn create(State(sim): State<Sim>, headers: HeaderMap, body: Bytes) -> Response {
    let mut exchange = begin(&sim, Surface::Messages);
    let result = serve(&sim, &headers, &body, &mut exchange.rate).await;
    finish(&sim, exchange, result)
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`.
pub async fn count_tokens(State(sim): State<Sim>, headers: HeaderMap, body: Bytes) -> Response {
    let exchange = begin_uncounted(&sim, Surface::Messages);
    let result = admit(&sim, &headers)
        .and_then(|()| MessagesRequest::parse(&body, true))
        .map(|request| {
            let tokens = conversation(&request).prompt_tokens();
            Json(json!({"input_tokens": tokens})).into_response()
        });
    finish(&sim, exchange, result)
}

/// Checks the key and `anthropic-version`.
fn admit(sim: &Sim, headers: &HeaderMap) -> Result<(), SimError> {
    let text = |name| headers.get(name).and_then(|value| value.to_str().ok());
    let presented = text(header::HeaderName::from_static("x-api-key"))
        .or_else(|| text(header::AUTHORIZATION).and_then(|value| value.strip_prefix("Bearer ")));
    let Some(presented) = presented else {
        return Err(SimError::unauthorized(
            "missing_api_key",
            "x-api-key header is required",
        ));
    };
    if sim
        .config
        .api_key
        .as_deref()
        .is_some_and(|key| key != presented)
    {
        return Err(SimError::unauthorized(
            "invalid_api_key",
            "invalid x-api-key",
        ));
    }
    if text(header::HeaderName::from_static("anthropic-version")).is_none() {
        return Err(SimError::invalid_request(
            None,
            "anthropic-version: header is required",
        ));
    }
    Ok(())
}

fn conversation(request: &MessagesRequest) -> Conversation {
    Conversation {
        messages: request.messages.clone(),
        framing: Framing::Chat,
        cache: CacheRule::Breakpoints(request.breakpoints.clone()),
    }
}

async fn serve(
    sim: &Sim,
    headers: &HeaderMap,
    body: &[u8],
    rate: &mut Option<RateSnapshot>,
) -> Result<Response, SimError> {
    admit(sim, headers)?;
    let request = MessagesRequest::parse(body, false)?;
    let turn = Turn {
        surface: Surface::Messages,
        generation: request.generation.clone(),
        conversations: vec![conversation(&request)],
    };
    let run = sim.run(headers, &turn, rate).await?;
    let view = &run.views[0];
    let answer = run.answers(&turn.generation).remove(0);
    let rendering = Rendering {
        id: &run.id,
        model: &turn.generation.model,
        answer: &answer,
        cache_read: view.cached_tokens,
        cache_written: view.cache_written,
        hour_cache: request.hour_cache,
    };
    let rendered = if turn.generation.stream {
        Rendered::Stream(rendering.frames())
    } else {
        Rendered::Whole {
            body: rendering.message().to_string(),
            decode_steps: answer.decode_steps(),
        }
    };
    Ok(deliver(sim, &run, rendered).await)
}
