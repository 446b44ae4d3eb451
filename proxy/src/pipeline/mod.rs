//! The one place that decides how a request is served.
//!
//! ```text
//! parse (wire format) ─ route ─ preflight ─┬─ over the trusted limit ─> local, or 400
//!                                          ├─ [verify] enabled ──────> verified ─┬─ failed, action = fallback ─> local
//!                                          │                                     └─ answer / block / retry
//!                                          └─ checks off ────────────> plain
//! provider down (unreachable, no first byte, 5xx) and on_upstream_unavailable ─> local
//! ```

mod preflight;

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{HeaderMap, Method};
use axum::response::Response;
use canarygate_policies::endpoints_config::Unverifiable;
use canarygate_policies::local_config::UntrustedContext;
use canarygate_policies::topic::question_text;
use serde_json::Value;
use tokio::sync::OwnedSemaphorePermit;

use crate::body::Served;
use crate::context::{ProviderError, RequestContext};
use crate::error::{ApiError, ErrorCode};
use crate::identity::Caller;
use crate::paths::local::{self, LocalReason};
use crate::paths::passthrough::{self, Forward, Stored};
use crate::paths::plain;
use crate::paths::verified::{self, Verified};
use crate::state::AppState;
use crate::trail::Trail;
use crate::wire::WireFormat;
use crate::wire::chat::{json_object, model_of};

/// A request the server admitted: a slot, a caller and a whole body.
pub struct Admitted<'a> {
    /// The request's id.
    pub request_id: Arc<str>,
    /// Who sent it.
    pub caller: Caller,
    /// Its headers.
    pub headers: &'a HeaderMap,
    /// Its query string (without `?`), passed on to the provider: Azure's
    /// `api-version`, the Anthropic SDK's `beta=true`.
    pub query: Option<&'a str>,
    /// Its body, as received.
    pub body: Bytes,
    /// Its concurrency slot; a stream takes it and holds it to its end.
    pub permit: Option<OwnedSemaphorePermit>,
}

/// Bodies smaller than this are not counted against
/// `limits.max_parsed_bytes` (parsed, one takes at most about 1 MiB).
const PARSE_COUNTED_FROM: usize = 16 * 1024;

/// What one JSON value may take parsed: its `serde_json::Value` (80 bytes,
/// maps keeping their order) and its share of the growth of the array or
/// map that holds it (measured: 537 MB of peak RSS for an 8 MiB body of 4.2
/// million numbers).
const PARSED_BYTES_PER_VALUE: u64 = 128;

/// A bound on the memory `body` takes parsed, for a body of
/// [`PARSE_COUNTED_FROM`] bytes or more: its bytes and
/// [`PARSED_BYTES_PER_VALUE`] per value. Every value but the first follows
/// a `,` or opens with `[` or `{`; those in strings count too, so the bound
/// is high, never low.
fn parsed_size_bound(body: &[u8]) -> Option<u64> {
    (body.len() >= PARSE_COUNTED_FROM).then(|| {
        let values = memchr::memchr3_iter(b',', b'[', b'{', body).count() as u64 + 1;
        body.len() as u64 + values * PARSED_BYTES_PER_VALUE
    })
}

/// Reserves from `limits.max_parsed_bytes` what `body` may take parsed,
/// until the permit drops: 413 when it could never fit, 429 when it does
/// not fit beside the requests being parsed now.
fn reserve_parsing(
    state: &AppState,
    body: &[u8],
) -> Result<Option<OwnedSemaphorePermit>, ApiError> {
    let Some(bound) = parsed_size_bound(body) else {
        return Ok(None);
    };
    let budget = state.policy.limits.max_parsed_bytes;
    if bound > budget {
        return Err(ApiError::too_large_parsed(bound, budget));
    }
    let kib = u32::try_from(bound.div_ceil(1024)).unwrap_or(u32::MAX);
    state
        .parsing
        .clone()
        .try_acquire_many_owned(kib)
        .map(Some)
        .map_err(|_| ApiError::parsing_full(budget))
}

/// Serves one request in wire format `W`.
pub async fn serve<W: WireFormat>(
    state: &AppState,
    mut admitted: Admitted<'_>,
    trail: &mut Trail,
) -> Result<Served, ApiError> {
    let bytes = admitted.body.clone();
    trail.request_body(&bytes);
    trail.surface(W::ENDPOINT);
    // Held until the request is served or its stream begins: by then its
    // tree has been written out and dropped.
    let _parsing = reserve_parsing(state, &bytes)?;
    let mut request = W::parse_request(&bytes)?;
    let model = request.model.clone();
    trail.model(&model);
    if let Some(check) = &state.topic {
        trail.topic(
            Arc::clone(check),
            question_text(&W::prompt_messages(&request.body)),
        );
    }
    let route = state.policy.route(&model, W::API).ok_or_else(|| {
        match state.policy.api_serving(&model, W::API) {
            Some(api) => ApiError::model_on_other_api(&model, api),
            None => ApiError::model_not_found(&model),
        }
    })?;
    trail.provider(route.provider);
    let renamed = route.upstream_model != model;
    if renamed {
        W::set_model(&mut request.body, route.upstream_model);
    }
    let context = RequestContext::<W>::new(
        state,
        admitted.caller,
        admitted.request_id,
        admitted.headers,
        admitted.query,
        &route,
    )?;
    let permit = &mut admitted.permit;

    if let Some(over) = preflight::check(&context, &request, bytes.len(), &route, trail) {
        return match state.policy.local.untrusted_context() {
            UntrustedContext::Local if state.local.is_some() => {
                local::serve(
                    &context,
                    &request,
                    LocalReason::UntrustedContext,
                    trail,
                    permit,
                )
                .await
            }
            _ => Err(
                ApiError::new(ErrorCode::ContextLengthExceeded, over.message(&route))
                    .with_param(W::PROMPT_PARAM),
            ),
        };
    }
    let served = if state.policy.verify.enabled {
        match verified::serve(&context, request, &bytes, trail, permit).await {
            Ok(Verified::Served(served)) => Ok(served),
            Ok(Verified::Fallback) => {
                tracing::warn!(
                    request_id = %context.request_id,
                    provider = %context.upstream.name,
                    "verification failed; serving the request from the local engine"
                );
                return serve_locally(
                    &context,
                    &bytes,
                    LocalReason::VerificationFailed,
                    trail,
                    permit,
                )
                .await;
            }
            Err(error) => Err(error),
        }
    } else {
        plain::serve(&context, &request, bytes.clone(), renamed, trail, permit).await
    };
    if state.local.is_some()
        && state.policy.local.on_upstream_unavailable()
        && provider_unavailable(&served)
    {
        if let Err(error) = &served {
            tracing::warn!(request_id = %context.request_id, "{error}; serving locally");
        }
        return serve_locally(
            &context,
            &bytes,
            LocalReason::UpstreamUnavailable,
            trail,
            permit,
        )
        .await;
    }
    served
}

/// An endpoint served by forwarding: what it is and where it goes.
pub struct Passthrough<'a> {
    /// Its name in metrics and audit records (`embeddings`, ...).
    pub endpoint: &'static str,
    /// Refused under `[endpoints] unverifiable = "block"` (embeddings,
    /// passthrough paths; not the auxiliary endpoints of verified APIs).
    pub blockable: bool,
    /// Its body is a JSON object naming a `model` (embeddings, a token
    /// count): anything else is a 400 before anything is sent.
    pub needs_model: bool,
    /// The client's method.
    pub method: Method,
    /// The provider endpoint relative to its `base_url` (the client's
    /// query string is added to it).
    pub upstream_endpoint: &'a str,
    /// Its answer is a stored object read back, which holds canarygate's
    /// own text: taken out.
    pub stored: Option<Stored>,
}

/// Forwards one request of an endpoint without answer text to verify
/// ([`passthrough`]): routed by the `model` of a JSON body when it names
/// one (renamed as the route says), else to the API's provider
/// ([`canarygate_policies::config::Policy::api_route`]).
pub async fn pass_through<W: WireFormat>(
    state: &AppState,
    admitted: Admitted<'_>,
    endpoint: Passthrough<'_>,
    trail: &mut Trail,
) -> Result<Response, ApiError> {
    let bytes = admitted.body;
    let admitted_content_type = admitted
        .headers
        .get(axum::http::header::CONTENT_TYPE)
        .cloned();
    trail.request_body(&bytes);
    trail.surface(endpoint.endpoint);
    trail.unverifiable();
    if endpoint.blockable && state.policy.endpoints.unverifiable == Unverifiable::Block {
        return Err(ApiError::new(
            ErrorCode::UnverifiableEndpoint,
            format!(
                "canarygate cannot verify the answers of {} and its policy refuses such \
                 endpoints ([endpoints] unverifiable = \"block\").",
                endpoint.endpoint
            ),
        ));
    }
    let parsed = serde_json::from_slice::<Value>(&bytes);
    let model = parsed
        .as_ref()
        .ok()
        .and_then(|body| body.get("model")?.as_str())
        .map(str::to_owned);
    if endpoint.needs_model && model.as_deref().is_none_or(str::is_empty) {
        // What a verified endpoint would say: the parser's own words, or
        // what is wrong with the model.
        let body = json_object(&bytes)?;
        let refused = body.as_object().and_then(|object| model_of(object).err());
        return Err(refused.unwrap_or_else(|| {
            ApiError::invalid_param("model", "`model` must be a non-empty string.")
        }));
    }
    let mut body = parsed.ok();
    let route = match &model {
        Some(model) => {
            trail.model(model);
            state.policy.route(model, W::API).ok_or_else(|| {
                match state.policy.api_serving(model, W::API) {
                    Some(api) => ApiError::model_on_other_api(model, api),
                    None => ApiError::model_not_found(model),
                }
            })?
        }
        None => state.policy.api_route(W::API).ok_or_else(|| {
            ApiError::new(
                ErrorCode::UnknownUrl,
                format!(
                    "No provider of api \"{}\" in this canarygate policy serves {}.",
                    W::API.name(),
                    endpoint.endpoint
                ),
            )
        })?,
    };
    trail.provider(route.provider);
    let upstream_body = match (&mut body, &model) {
        (Some(json), Some(model)) if route.upstream_model != model => {
            json["model"] = Value::from(route.upstream_model);
            Some(Bytes::from(json.to_string()))
        }
        _ if bytes.is_empty() => None,
        _ => Some(bytes.clone()),
    };
    let context = RequestContext::<W>::new(
        state,
        admitted.caller,
        admitted.request_id,
        admitted.headers,
        admitted.query,
        &route,
    )?;
    let forward = Forward {
        method: endpoint.method,
        endpoint: endpoint.upstream_endpoint.to_owned(),
        content_type: upstream_body
            .as_ref()
            .and_then(|_| admitted_content_type.clone()),
        body: upstream_body,
        stored: endpoint.stored,
    };
    passthrough::serve(&context, forward, trail).await
}

/// Serves the client's request (parsed again from the `bytes` received,
/// without canaries) from the local engine, for `reason`.
async fn serve_locally<W: WireFormat>(
    context: &RequestContext<'_, W>,
    bytes: &Bytes,
    reason: LocalReason,
    trail: &mut Trail,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> Result<Served, ApiError> {
    let request = context.reparse(bytes)?;
    local::serve(context, &request, reason, trail, permit).await
}

/// Whether the provider could not serve at all: unreachable, timed out
/// before its first byte, or answered 5xx (nothing reached the client).
fn provider_unavailable(served: &Result<Served, ApiError>) -> bool {
    match served {
        Err(error) => error.code.provider_unavailable(),
        Ok(Served::Whole(response)) => {
            response.status().is_server_error()
                && response.extensions().get::<ProviderError>().is_some()
        }
        Ok(Served::Stream(..)) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bodys_parsed_size_is_bounded_by_its_values() {
        // Small bodies are not counted.
        assert_eq!(parsed_size_bound(&[b'0'; PARSE_COUNTED_FROM - 1]), None);
        // An array of small numbers: one value per comma, and the array.
        let numbers = format!("[{}0]", "0,".repeat(10_000));
        let bound = parsed_size_bound(numbers.as_bytes()).unwrap();
        assert_eq!(
            bound,
            numbers.len() as u64 + (10_000 + 1 + 1) * PARSED_BYTES_PER_VALUE
        );
        // Prose holds few values: its bound stays near its size.
        let prose = format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "the orbit of each planet was logged, ".repeat(1_000)
        );
        let bound = parsed_size_bound(prose.as_bytes()).unwrap();
        assert!(
            bound < 5 * prose.len() as u64,
            "{bound} for {}",
            prose.len()
        );
    }
}
