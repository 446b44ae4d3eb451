//! `GET /v1/models` and `GET /v1/models/{id}`: the models a client may
//! name, in its own API. Both APIs have these paths; the caller's headers
//! say which it speaks ([`anthropic_client`]), and only that API's routes and
//! provider are listed or asked, so a caller's key never goes to the other
//! API's provider.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use canarygate_policies::config::ProviderApi;
use serde_json::{Value, json};

use crate::clock::RequestClock;
use crate::context::{error_response, json_response};
use crate::error::ApiError;
use crate::state::AppState;
use crate::upstream::ModelsError;
use crate::wire::WireFormat;
use crate::wire::chat::Chat;
use crate::wire::messages::Messages;

/// `GET /v1/models`, in the caller's API: an Anthropic client (one that
/// sends `anthropic-version`, or its key in `x-api-key` with no
/// `Authorization`) gets the models of the Anthropic routes in Anthropic's
/// shape, anyone else those of the OpenAI routes in OpenAI's; a caller's
/// key is never sent to the other API's provider. The named routes, then,
/// for a wildcard route, the provider's own list (asked with the provider
/// key in managed auth, the caller's credentials in passthrough), without
/// duplicates. A provider's error answer is passed on (wrapped when not in
/// its API's shape); when the provider cannot be asked (no credentials to
/// pass on, unreachable, no list in its answer) the named routes alone are
/// listed, and why is logged.
pub(super) async fn list_models(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Response {
    if anthropic_client(&headers) {
        models_of::<Messages>(&state, &headers).await
    } else {
        models_of::<Chat>(&state, &headers).await
    }
}

/// Whether a request to an endpoint both APIs have (`/v1/models`) comes
/// from an Anthropic client: it sends `anthropic-version`, or its key in
/// `x-api-key` with no `Authorization`.
pub(super) fn anthropic_client(headers: &HeaderMap) -> bool {
    headers.contains_key("anthropic-version")
        || (headers.contains_key("x-api-key") && !headers.contains_key(header::AUTHORIZATION))
}

/// `GET /v1/models/{id}` (the SDKs' `models.retrieve`) for the routes of
/// `W`'s API: a model the policy routes by name is described here, and
/// without a wildcard route any other is 404 `model_not_found`; `None`
/// when the wildcard route's provider is to be asked.
pub(super) fn described<W: WireFormat>(state: &AppState, id: &str) -> Option<Response> {
    let named = state
        .policy
        .named_routes()
        .find(|(model, _, api)| *model == id && *api == W::API)
        .map(|(model, route, _)| model_entry(W::API, model, route.provider));
    if let Some(entry) = named {
        return Some(axum::Json(entry).into_response());
    }
    state
        .policy
        .wildcard_provider(W::API)
        .is_none()
        .then(|| error_response::<W>(&ApiError::model_not_found(id)))
}

/// The model list of [`list_models`] for the routes of `W`'s API.
async fn models_of<W: WireFormat>(state: &AppState, headers: &HeaderMap) -> Response {
    let policy = &state.policy;
    let mut data: Vec<Value> = policy
        .named_routes()
        .filter(|(_, _, api)| *api == W::API)
        .map(|(model, route, _)| model_entry(W::API, model, route.provider))
        .collect();
    if let Some(provider) = policy.wildcard_provider(W::API) {
        match provider_models::<W>(state, provider, headers).await {
            Ok(models) => {
                for model in models {
                    let id = model.get("id").and_then(Value::as_str);
                    let listed = data
                        .iter()
                        .any(|named| named.get("id").and_then(Value::as_str) == id);
                    if id.is_some() && !listed {
                        data.push(model);
                    }
                }
            }
            Err(response) => return response,
        }
    }
    let list = match W::API {
        ProviderApi::Openai => json!({"object": "list", "data": data}),
        ProviderApi::Anthropic => {
            // One page holds every model: a client paging on never asks again.
            let id = |model: Option<&Value>| model.and_then(|model| model.get("id")).cloned();
            json!({"first_id": id(data.first()), "last_id": id(data.last()),
                   "has_more": false, "data": data})
        }
    };
    axum::Json(list).into_response()
}

/// A named route's entry in `api`'s model list.
fn model_entry(api: ProviderApi, model: &str, provider: &str) -> Value {
    match api {
        ProviderApi::Openai => {
            json!({"id": model, "object": "model", "created": 0, "owned_by": provider})
        }
        ProviderApi::Anthropic => json!({"type": "model", "id": model, "display_name": model,
                                         "created_at": "1970-01-01T00:00:00Z"}),
    }
}

/// The model list of `provider`, or the response to answer with instead.
async fn provider_models<W: WireFormat>(
    state: &AppState,
    provider: &str,
    headers: &HeaderMap,
) -> Result<Vec<Value>, Response> {
    let fail = |error: &ApiError| error_response::<W>(error);
    let unlisted = |error: &ApiError| {
        tracing::warn!(
            provider,
            "GET /v1/models lists the named routes only: {error}"
        );
        Vec::new()
    };
    let upstream = state
        .upstreams
        .named(provider)
        .map_err(|error| fail(&ApiError::internal(error.to_string())))?;
    let caller = match state.auth.authenticate(headers) {
        Ok(caller) => caller,
        Err(error) => return Ok(unlisted(&error)),
    };
    let key = match upstream.managed_key() {
        Some(key) => key.clone(),
        None => match caller.passthrough_key() {
            Ok(key) => key,
            Err(error) => return Ok(unlisted(&error)),
        },
    };
    let limits = &state.policy.limits;
    let mut clock = RequestClock::start(state.metrics.clone());
    let listed = upstream
        .list_models(
            &mut clock,
            key,
            Duration::from_millis(limits.first_byte_timeout_ms),
            Duration::from_millis(limits.idle_timeout_ms),
        )
        .await;
    match listed {
        Ok(models) => Ok(models),
        Err(ModelsError::Provider(status, body)) if W::is_error_body(&body) => {
            Err(json_response(status, Body::from(body)))
        }
        Err(ModelsError::Provider(status, body)) => {
            Err(fail(&upstream.wrapped_error(status, &body)))
        }
        Err(ModelsError::Canarygate(error)) => Ok(unlisted(&error)),
    }
}
