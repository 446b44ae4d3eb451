//! canarygate-sim: the simulated provider, a real HTTP server speaking
//! OpenAI's and Anthropic's APIs, for tests, benchmarks and the demo. It
//! knows nothing of the proxy: like a real provider it reads what the client
//! sends and answers.
//!
//! # Surfaces
//!
//! | route | API | module |
//! |---|---|---|
//! | `POST /v1/chat/completions`; stored completions: `GET /v1/chat/completions`, `GET`/`POST`/`DELETE /v1/chat/completions/{id}`, its `/messages` | OpenAI Chat Completions | `surfaces/chat.rs`, `answer.rs`, `store.rs` |
//! | `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}` | OpenAI Responses | `surfaces/responses/` |
//! | `POST /v1/messages`, `POST /v1/messages/count_tokens` | Anthropic Messages | `surfaces/messages/` |
//! | `POST /v1/completions` | OpenAI legacy completions | `surfaces/completions.rs` |
//! | `POST /v1/embeddings` | OpenAI embeddings | `surfaces/embeddings.rs` |
//! | `GET /v1/models`, `GET /v1/models/{id}`, `GET /sim/stats` | models (OpenAI's shape, or Anthropic's), counters | here, `provider.rs` |
//!
//! # How a request is answered
//!
//! The same way on every surface, so that every failure mode reaches every
//! surface:
//!
//! 1. the surface parses its request (as its API validates it, errors in its
//!    shape: OpenAI's `{"error": {...}}` or Anthropic's `{"type": "error"}`)
//!    into a `Turn`: a `Generation` (what to generate: model, budget,
//!    choices, tools, thinking) and one or more `Conversation`s of
//!    chat-shaped messages (`conversation.rs`): Responses `instructions` and
//!    Anthropic `system` become the system message, as the model reads them;
//! 2. `SimProvider::run` (`provider.rs`) picks the mode, checks the context
//!    window, admits the request against the rate limit, stalls, and decides
//!    what the model sees in one place, `SimProvider::visible_contexts`,
//!    reading it back from the paged KV pool all requests share ([`pool`])
//!    and counting what the prefix cache ([`prefix_cache`]) holds;
//! 3. `answer.rs` composes the answer from what the model sees with the
//!    deterministic [`model`] (which obeys the echo instructions it finds
//!    there, canaries included);
//! 4. the surface renders it in its wire format, a body or stream frames
//!    (pure code, apart from the handlers);
//! 5. `delivery.rs` paces it and breaks it as the mode says; the
//!    surface's provider headers (`headers.rs`) and the ground-truth headers
//!    go on every response.
//!
//! Timing follows `--prefill-tps` (first token after uncached prompt tokens /
//! rate seconds) and `--decode-tps` (one token per 1 / rate seconds); both
//! default to instant. Prompts over the context window get HTTP 400
//! `context_length_exceeded` (Anthropic: `prompt is too long`).
//!
//! Like real providers it caches prompt prefixes: OpenAI's surfaces by
//! OpenAI's rules (automatically, from 1024 tokens, in increments of 128;
//! `prompt_tokens_details.cached_tokens`, `input_tokens_details.cached_tokens`),
//! Messages by Anthropic's (only at `cache_control` breakpoints;
//! `cache_read_input_tokens` and `cache_creation_input_tokens`).
//!
//! # What chat answers carry
//!
//! Built in `answer.rs` from what the request asks (`request.rs` validates it
//! as OpenAI does: a 400 `invalid_request_error` naming the `param`); the
//! other surfaces render the same choices their own way (sim/README.md has a
//! table per surface):
//!
//! - `n` (1..=128): that many choices, each from the same context (same
//!   opening, own body); streamed, their chunks interleave, each with its
//!   `index`, its own `role` delta and its own finish chunk. `max_tokens` /
//!   `max_completion_tokens` apply per choice; usage sums the choices.
//! - `model: "sim-reasoner"` (`reasoning_content`, as DeepSeek, GLM, Qwen)
//!   or `"sim-reasoner-openrouter"` (`reasoning`): the model thinks first,
//!   restating the instructions it sees and quoting the opening they ask for
//!   (canaries included). Streamed, reasoning deltas (`content: null`, or `""`
//!   for OpenRouter) come before content deltas. The reasoning is spent from
//!   `max_tokens` and reported in `completion_tokens_details.reasoning_tokens`.
//!   `"sim-reasoner-hidden"` thinks the same, billed and never shown, as
//!   OpenAI's o-series: a budget spent thinking leaves `content: ""` and
//!   `finish_reason: "length"`. `"sim-reasoner-terse"` (`reasoning_content`)
//!   never restates its instructions, as most real reasoning models, and
//!   thinks longer (about 70 tokens): a small limit cuts it before its reply
//!   with no canary quoted.
//! - `logprobs: true` (`top_logprobs` 0..=20): `logprobs.content` entries
//!   (`token`, `logprob`, `bytes`, `top_logprobs`) whose tokens join to the
//!   content exactly; streamed, each content chunk carries its own tokens'.
//! - `tools` with `tool_choice` (`required`, a named function, or `auto` and
//!   a name in the last user message; `tools.rs`): `message.tool_calls`,
//!   `content: null`, `finish_reason: "tool_calls"`; streamed, a first delta
//!   with `index`, `id`, `type`, `function.name` and `arguments: ""`, then
//!   `arguments` fragments. Legacy `functions` / `function_call`:
//!   `message.function_call`, `finish_reason: "function_call"`.
//! - `response_format` `json_object` or `json_schema`: the content is a JSON
//!   object, `{"answer": "..."}`; `json_object` is a 400 (`param: messages`)
//!   unless a message mentions JSON, as OpenAI answers it.
//! - Always: `system_fingerprint`, `service_tier`, `message.refusal`,
//!   `message.annotations`; stream chunks carry an `obfuscation` padding
//!   string (`stream_options.include_obfuscation: false` drops it) and, with
//!   `include_usage`, `usage: null` until the usage chunk (`choices: []`).
//!
//! Every response of an OpenAI surface (answers, errors, streams) carries
//! OpenAI's headers: `x-request-id`, `openai-processing-ms`,
//! `openai-version`, `openai-organization`, `x-ratelimit-*` from a fixed
//! window ([`RateLimitConfig`]; over it, 429 with `retry-after` and
//! `retry-after-ms`) and a Cloudflare `__cf_bm` `set-cookie`. Messages
//! responses carry Anthropic's: `request-id`, `anthropic-organization-id`,
//! `anthropic-ratelimit-*` (resets as RFC 3339 times), `retry-after` on a
//! 429. The test-only header [`RATE_LIMIT_AFTER_HEADER`] lowers the request
//! limit for one request.
//!
//! Failure modes ([`Mode`]) are chosen with `--mode` or, per request, with the
//! test-only header `x-sim-mode`, on every surface alike.
//!
//! # The leak of SGLang issue #30233 (`leak-on-overflow`)
//!
//! Two capacities, as in the incident: the advertised context window
//! (`context_window`) and the smaller prefill KV pool (`pool_tokens`). The
//! shared KV pool the model reads from (the decode side) is sized for the
//! window, and every request's prompt is written into it, whatever its
//! surface; freed pages keep their content. In `leak-on-overflow` a prompt
//! over `pool_tokens` (but within the window) is "rejected" the way SGLang
//! did it: the prompt is replaced by a one-token placeholder and the error is
//! set aside, never answered. The decode side still reserves pages for the
//! full prompt, prefill writes one position, and the model reads the whole
//! reservation: the placeholder, then stale positions of earlier requests,
//! most recent first. The reply obeys the stale canary instructions and
//! restates another request's text, with HTTP 200, one prompt token reported
//! (`prompt_tokens`, `input_tokens`), and no prefill delay. Other modes serve
//! such a prompt correctly. Prompts over the advertised window get the same
//! placeholder in this mode (the provider checks nothing), where every other
//! mode answers HTTP 400.
//!
//! # Ground truth for tests and demos
//!
//! Each response, on every surface, carries [`CONTEXT_HEADER`] (`own`,
//! `stale`, `swapped`, `truncated`) and, when the context came from other
//! requests, [`CONTEXT_FROM_HEADER`] with the ids of their answers (on
//! whatever surface they came). `GET /sim/stats` counts them, and the
//! requests per surface. A real provider sends nothing like it; the proxy
//! does not forward it.

mod answer;
mod conversation;
mod delivery;
mod error;
mod hash;
mod headers;
pub mod model;
pub mod pool;
pub mod prefix_cache;
mod provider;
mod request;
mod store;
mod surface;
mod surfaces;
pub mod tls;
mod tools;

use std::str::FromStr;

use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use serde_json::{Value, json};

pub use answer::SYSTEM_FINGERPRINT;
pub use error::SimError;
pub use headers::{ANTHROPIC_ORGANIZATION_ID, OPENAI_VERSION, ORGANIZATION, RateLimitConfig};
use model::MODELS;
pub use model::{
    HIDDEN_REASONER_MODEL, OPENROUTER_REASONER_MODEL, REASONER_MODEL, TERSE_REASONER_MODEL,
};
pub use prefix_cache::PrefixCacheConfig;
use provider::SimProvider;
pub use store::MAX_STORED;
use surfaces::Sim;

/// Per-request override of the failure mode (tests only).
pub const MODE_HEADER: &str = "x-sim-mode";

/// Per-request override of the requests-per-window limit (tests only):
/// `x-sim-rate-limit-after: K` serves this request only while fewer than `K`
/// requests were admitted in the current window, else answers 429.
pub const RATE_LIMIT_AFTER_HEADER: &str = "x-sim-rate-limit-after";

/// Response header saying where the model's context came from: `own`,
/// `stale` (KV pool pages of earlier requests), `swapped` (another request's
/// context) or `truncated` (part of its own). Ground truth for tests.
pub const CONTEXT_HEADER: &str = "x-sim-context";

/// Response header listing, comma-separated, the answer ids of the other
/// requests whose context this response was generated from (`chatcmpl-sim-N`,
/// `resp_sim…`, `msg_sim…`, `cmpl-sim-N`, `embd-sim-N`).
pub const CONTEXT_FROM_HEADER: &str = "x-sim-context-from";

/// Prefill pool size per advertised context token in the incident:
/// 681,280 / 1,048,576. The default of [`SimConfig::pool_tokens`].
pub const INCIDENT_POOL_RATIO: (u64, u64) = (681_280, 1_048_576);

/// How the simulated provider misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Answers correctly.
    #[default]
    Honest,
    /// Sends about half the answer, then closes the connection: a stream
    /// ends without its closing events (no `[DONE]`, no
    /// `response.completed`, no `message_stop`), a whole body is truncated.
    Cut,
    /// Answers whole, but ends a stream without its end marker: Chat's and
    /// legacy completions' `data: [DONE]`, Messages' `message_stop`, as
    /// text-generation-inference before 2.2 did. A Responses stream, whose
    /// last event is the answer's `response.completed`, and a whole body go
    /// as always.
    NoEndMarker,
    /// Accepts the request and never sends the response head.
    StallFirstByte,
    /// Streams the first tokens, then goes silent with the connection open.
    StallMidStream,
    /// SGLang issue #30233: a prompt over the prefill pool (within the
    /// window) is answered from stale KV pages of earlier requests, with
    /// HTTP 200 and `prompt_tokens: 1` (see the module docs).
    LeakOnOverflow,
    /// Silently drops the first third of the messages (at least one, never
    /// all): the head canary message is lost. A raw text prompt (legacy
    /// completions, embeddings) loses the first third of its tokens instead.
    /// Usage reports the tokens kept.
    TruncateHead,
    /// Silently drops the last third of the messages (at least one, never
    /// all), or of a raw text prompt's tokens: the tail canary is lost.
    /// Usage reports the tokens kept.
    TruncateTail,
    /// Answers from the most recent other request's context (its canaries,
    /// its text), whatever surface it came in on, reporting this request's
    /// own usage. The very first request has nobody to swap with and is
    /// answered honestly.
    Swap,
    /// Refuses every request with 429 `rate_limit_exceeded`, `retry-after: 1`,
    /// `retry-after-ms: 1000` and `x-ratelimit-remaining-*: 0` (Anthropic's
    /// 429 `rate_limit_error` on Messages).
    RateLimited,
    /// No capacity: a request not streamed is refused (503 `server_error`
    /// on OpenAI's surfaces, 529 `overloaded_error` on Messages); a stream
    /// sends about half its answer, then the surface's error event, and
    /// ends.
    Overloaded,
}

impl Mode {
    /// Every mode, in the order of [`Mode::name`]'s documentation.
    pub const ALL: [Self; 11] = [
        Self::Honest,
        Self::LeakOnOverflow,
        Self::TruncateHead,
        Self::TruncateTail,
        Self::Swap,
        Self::Cut,
        Self::NoEndMarker,
        Self::StallFirstByte,
        Self::StallMidStream,
        Self::RateLimited,
        Self::Overloaded,
    ];

    /// The name used by `--mode` and `x-sim-mode`: `honest`,
    /// `leak-on-overflow`, `truncate-head`, `truncate-tail`, `swap`, `cut`,
    /// `no-end-marker`, `stall-first-byte`, `stall-mid-stream`, `rate-limited`, `overloaded`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Honest => "honest",
            Self::LeakOnOverflow => "leak-on-overflow",
            Self::TruncateHead => "truncate-head",
            Self::TruncateTail => "truncate-tail",
            Self::Swap => "swap",
            Self::Cut => "cut",
            Self::NoEndMarker => "no-end-marker",
            Self::StallFirstByte => "stall-first-byte",
            Self::StallMidStream => "stall-mid-stream",
            Self::RateLimited => "rate-limited",
            Self::Overloaded => "overloaded",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A `--mode` or `x-sim-mode` that names no mode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown sim mode `{0}` ({names})", names = mode_names())]
pub struct UnknownMode(String);

fn mode_names() -> String {
    let names: Vec<&str> = Mode::ALL.iter().map(|mode| mode.name()).collect();
    names.join(", ")
}

impl FromStr for Mode {
    type Err = UnknownMode;

    fn from_str(text: &str) -> Result<Self, UnknownMode> {
        Self::ALL
            .into_iter()
            .find(|mode| mode.name() == text)
            .ok_or_else(|| UnknownMode(text.to_owned()))
    }
}

/// Settings of a simulated provider.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Largest prompt accepted, in tokens.
    pub context_window: u64,
    /// Most output tokens a request may ask for (`max_tokens` and its kin);
    /// more get a 400, as a real model's output cap does.
    pub max_output_tokens: u64,
    /// Prefill speed in tokens/s; 0 means instant.
    pub prefill_tps: f64,
    /// Decode speed in tokens/s; 0 means instant.
    pub decode_tps: f64,
    /// Failure mode when a request names none.
    pub mode: Mode,
    /// When set, requests must carry `Authorization: Bearer <this>`.
    pub api_key: Option<String>,
    /// Prefill KV pool capacity in tokens: in `leak-on-overflow`, longer
    /// prompts are replaced by a placeholder. `None`: the window times
    /// [`INCIDENT_POOL_RATIO`].
    pub pool_tokens: Option<u64>,
    /// Positions per page of the shared KV pool (0 is taken as 1).
    pub page_tokens: u32,
    /// Prompt prefix caching; `None` prefills every prompt in full.
    pub prefix_cache: Option<PrefixCacheConfig>,
    /// The rate limit reported in `x-ratelimit-*` and enforced with 429s.
    pub rate_limit: RateLimitConfig,
}

impl SimConfig {
    /// The prefill pool capacity in effect ([`SimConfig::pool_tokens`]).
    pub fn prefill_pool_tokens(&self) -> u64 {
        self.pool_tokens.unwrap_or_else(|| {
            let (part, whole) = INCIDENT_POOL_RATIO;
            u64::try_from(u128::from(self.context_window) * u128::from(part) / u128::from(whole))
                .unwrap_or(u64::MAX)
        })
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            context_window: 128_000,
            // gpt-4o's, and claude-3-5-sonnet's was 8,192.
            max_output_tokens: 16_384,
            prefill_tps: 0.0,
            decode_tps: 0.0,
            mode: Mode::Honest,
            api_key: None,
            pool_tokens: None,
            page_tokens: 16,
            prefix_cache: Some(PrefixCacheConfig::default()),
            rate_limit: RateLimitConfig::default(),
        }
    }
}

/// A routed simulated provider, ready for `axum::serve` or [`tls::serve_tls`].
pub fn router(config: SimConfig) -> Router {
    let sim = SimProvider::new(config);
    Router::new()
        .route(
            "/v1/chat/completions",
            post(surfaces::chat::chat_completions).get(surfaces::chat::list),
        )
        .route(
            "/v1/chat/completions/{id}",
            get(surfaces::chat::retrieve)
                .post(surfaces::chat::update)
                .delete(surfaces::chat::delete),
        )
        .route(
            "/v1/chat/completions/{id}/messages",
            get(surfaces::chat::messages),
        )
        .route("/v1/responses", post(surfaces::responses::create))
        .route(
            "/v1/responses/{id}",
            get(surfaces::responses::retrieve).delete(surfaces::responses::delete),
        )
        .route("/v1/messages", post(surfaces::messages::create))
        .route(
            "/v1/messages/count_tokens",
            post(surfaces::messages::count_tokens),
        )
        .route("/v1/completions", post(surfaces::completions::create))
        .route("/v1/embeddings", post(surfaces::embeddings::create))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/sim/stats", get(stats))
        .layer(axum::middleware::from_fn_with_state(
            sim.clone(),
            note_request_shape,
        ))
        .with_state(sim)
}

/// Notes how a request came: over HTTP/2 (counted as `http2_requests` in
/// `/sim/stats`, so a test can tell which protocol a client negotiated),
/// with a query string (kept as `last_query`, so a test can tell what a
/// proxy passed on).
async fn note_request_shape(
    State(sim): State<Sim>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if request.version() == axum::http::Version::HTTP_2 {
        sim.stats
            .http2_requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    if let Some(query) = request.uri().query()
        && request.uri().path() != "/sim/stats"
    {
        *sim.stats
            .last_query
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(format!("{} {query}", request.uri().path()));
    }
    next.run(request).await
}

/// `GET /v1/models`: OpenAI's list, whole; or, to a client that sends
/// `anthropic-version`, Anthropic's: pages of `limit` models (20 unless
/// asked, at most 1,000) after `after_id`, with `has_more`.
async fn models(
    headers: axum::http::HeaderMap,
    axum::extract::Query(query): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> impl IntoResponse {
    if !headers.contains_key("anthropic-version") {
        let data: Vec<Value> = MODELS
            .iter()
            .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "canarygate-sim"}))
            .collect();
        return axum::Json(json!({"object": "list", "data": data}));
    }
    let limit = query
        .get("limit")
        .and_then(|limit| limit.parse::<usize>().ok())
        .unwrap_or(20)
        .clamp(1, 1000);
    let start = query
        .get("after_id")
        .and_then(|after| MODELS.iter().position(|id| id == after))
        .map_or(0, |index| index + 1);
    let page: Vec<Value> = MODELS
        .iter()
        .skip(start)
        .take(limit)
        .map(|id| {
            json!({"type": "model", "id": id, "display_name": id,
                   "created_at": "2026-01-01T00:00:00Z"})
        })
        .collect();
    let id = |model: Option<&Value>| model.and_then(|model| model.get("id")).cloned();
    axum::Json(json!({
        "first_id": id(page.first()), "last_id": id(page.last()),
        "has_more": start + page.len() < MODELS.len(), "data": page,
    }))
}

/// `GET /v1/models/{id}`: one model in OpenAI's shape, or in Anthropic's to
/// a client that sends `anthropic-version`; a 404 in that API's shape for
/// a model not served.
async fn model(
    headers: axum::http::HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> axum::response::Response {
    let anthropic = headers.contains_key("anthropic-version");
    if !MODELS.contains(&id.as_str()) {
        let error = if anthropic {
            json!({"type": "error", "error": {"type": "not_found_error", "message": format!("model: {id}")}})
        } else {
            json!({"error": {"message": format!("The model '{id}' does not exist"),
                             "type": "invalid_request_error", "param": "model",
                             "code": "model_not_found"}})
        };
        return (axum::http::StatusCode::NOT_FOUND, axum::Json(error)).into_response();
    }
    let model = if anthropic {
        json!({"type": "model", "id": id, "display_name": id, "created_at": "2026-01-01T00:00:00Z"})
    } else {
        json!({"id": id, "object": "model", "created": 0, "owned_by": "canarygate-sim"})
    };
    axum::Json(model).into_response()
}

async fn stats(State(sim): State<Sim>) -> impl IntoResponse {
    axum::Json(sim.stats_json())
}

/// Serves a simulated provider on `listener` (HTTPS when `tls` is given)
/// until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: SimConfig,
    tls: Option<rustls::ServerConfig>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = router(config);
    match tls {
        Some(tls) => {
            tokio::select! {
                () = tls::serve_tls(listener, router, tls) => {}
                () = shutdown => {}
            }
            Ok(())
        }
        None => {
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use axum::body::Bytes;
    use axum::http::{HeaderMap, HeaderValue, StatusCode, header};

    use super::*;
    use surfaces::chat::chat_completions;

    #[test]
    fn mode_names_round_trip() {
        for mode in Mode::ALL {
            assert_eq!(mode.name().parse::<Mode>(), Ok(mode));
            assert_eq!(mode.to_string(), mode.name());
        }
        let error = "leaky".parse::<Mode>().unwrap_err().to_string();
        assert!(error.contains("leak-on-overflow, truncate-head"), "{error}");
    }

    #[test]
    fn default_prefill_pool_follows_the_incident_ratio() {
        let config = SimConfig {
            context_window: 1_048_576,
            ..SimConfig::default()
        };
        assert_eq!(config.prefill_pool_tokens(), 681_280);
        let config = SimConfig {
            context_window: u64::MAX,
            ..SimConfig::default()
        };
        assert!(config.prefill_pool_tokens() < u64::MAX);
        let config = SimConfig {
            pool_tokens: Some(665),
            ..SimConfig::default()
        };
        assert_eq!(config.prefill_pool_tokens(), 665);
    }

    /// Posts `body` to a provider's handler, with extra `headers`.
    async fn post(
        sim: &Arc<SimProvider>,
        body: Value,
        headers: &[(&'static str, &str)],
    ) -> (StatusCode, HeaderMap, String) {
        let mut map = HeaderMap::new();
        map.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        for (name, value) in headers {
            map.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        let response =
            chat_completions(State(sim.clone()), map, Bytes::from(body.to_string())).await;
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, headers, String::from_utf8(bytes.to_vec()).unwrap())
    }

    fn hello(stream: bool) -> Value {
        json!({"model": "sim-model", "stream": stream, "max_tokens": 100,
               "messages": [{"role": "user", "content": "hello there"}]})
    }

    fn header_of<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    #[tokio::test]
    async fn every_answer_carries_provider_headers_and_the_counts_go_down() {
        let sim = SimProvider::new(SimConfig::default());
        let mut ids = std::collections::HashSet::new();
        let mut remaining = Vec::new();
        for (body, status) in [
            (hello(false), StatusCode::OK),
            (hello(true), StatusCode::OK),
            (
                json!({"model": "m", "messages": []}),
                StatusCode::BAD_REQUEST,
            ),
            (hello(false), StatusCode::OK),
        ] {
            let (got, headers, _) = post(&sim, body, &[]).await;
            assert_eq!(got, status);
            let id = header_of(&headers, "x-request-id");
            assert!(id.starts_with("req_") && id.len() == 36, "{id}");
            assert!(ids.insert(id.to_owned()), "unique");
            assert!(
                header_of(&headers, "openai-processing-ms")
                    .parse::<u64>()
                    .is_ok()
            );
            assert_eq!(header_of(&headers, "openai-version"), "2020-10-01");
            assert_eq!(header_of(&headers, "openai-organization"), "sim-org");
            assert_eq!(header_of(&headers, "x-ratelimit-limit-requests"), "1000000");
            assert_eq!(
                header_of(&headers, "x-ratelimit-limit-tokens"),
                "1000000000"
            );
            let reset = header_of(&headers, "x-ratelimit-reset-requests");
            assert!(reset.ends_with('s'), "{reset}");
            assert!(!header_of(&headers, "x-ratelimit-reset-tokens").is_empty());
            assert!(header_of(&headers, "set-cookie").starts_with("__cf_bm="));
            remaining.push((
                header_of(&headers, "x-ratelimit-remaining-requests")
                    .parse::<u64>()
                    .unwrap(),
                header_of(&headers, "x-ratelimit-remaining-tokens")
                    .parse::<u64>()
                    .unwrap(),
            ));
        }
        // Admitted requests count (prompt + max_tokens); a malformed one does not.
        assert_eq!(remaining[0].0, 999_999);
        assert_eq!(remaining[1].0, 999_998);
        assert_eq!(remaining[2], remaining[1]);
        assert_eq!(remaining[3].0, 999_997);
        assert!(remaining[0].1 < 1_000_000_000 - 100 && remaining[3].1 < remaining[1].1);
    }

    #[tokio::test]
    async fn rate_limited_answers_429_with_retry_after() {
        let sim = SimProvider::new(SimConfig::default());
        for stream in [false, true] {
            let (status, headers, body) =
                post(&sim, hello(stream), &[(MODE_HEADER, "rate-limited")]).await;
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(header_of(&headers, "retry-after"), "1");
            assert_eq!(header_of(&headers, "retry-after-ms"), "1000");
            assert_eq!(header_of(&headers, "x-ratelimit-remaining-requests"), "0");
            assert_eq!(header_of(&headers, "x-ratelimit-remaining-tokens"), "0");
            assert_eq!(header_of(&headers, "x-ratelimit-reset-requests"), "1s");
            assert!(header_of(&headers, "x-request-id").starts_with("req_"));
            let error: Value = serde_json::from_str(&body).unwrap();
            let error = &error["error"];
            assert!(
                error["message"]
                    .as_str()
                    .unwrap()
                    .starts_with("Rate limit reached for requests")
            );
            assert_eq!(error["type"], "requests");
            assert_eq!(error["param"], Value::Null);
            assert_eq!(error["code"], "rate_limit_exceeded");
        }

        // Serve two, then refuse until the window reopens.
        let after = [(RATE_LIMIT_AFTER_HEADER, "2")];
        assert_eq!(post(&sim, hello(false), &after).await.0, StatusCode::OK);
        assert_eq!(post(&sim, hello(false), &after).await.0, StatusCode::OK);
        let (status, headers, body) = post(&sim, hello(false), &after).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
        assert_eq!(header_of(&headers, "x-ratelimit-limit-requests"), "2");
        assert_eq!(header_of(&headers, "x-ratelimit-remaining-requests"), "0");
        let retry_ms: u64 = header_of(&headers, "retry-after-ms").parse().unwrap();
        assert!((1..=60_000).contains(&retry_ms), "{retry_ms}");
        let (status, ..) = post(&sim, hello(false), &[(RATE_LIMIT_AFTER_HEADER, "x")]).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(sim.stats.rate_limited.load(Ordering::Relaxed), 3);

        // A short window reopens.
        let sim = SimProvider::new(SimConfig {
            rate_limit: RateLimitConfig {
                requests: 1,
                window: Duration::from_millis(200),
                ..RateLimitConfig::default()
            },
            ..SimConfig::default()
        });
        assert_eq!(post(&sim, hello(false), &[]).await.0, StatusCode::OK);
        assert_eq!(
            post(&sim, hello(true), &[]).await.0,
            StatusCode::TOO_MANY_REQUESTS
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(post(&sim, hello(false), &[]).await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn invalid_n_is_refused_in_openais_shape() {
        let sim = SimProvider::new(SimConfig::default());
        let mut body = hello(false);
        body["n"] = json!(0);
        let (status, headers, text) = post(&sim, body, &[]).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(header_of(&headers, "x-request-id").starts_with("req_"));
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["type"], "invalid_request_error");
        assert_eq!(error["error"]["param"], "n");
        assert_eq!(error["error"]["code"], "integer_below_min_value");

        let mut body = hello(true);
        body["n"] = json!(2);
        let (status, _, text) = post(&sim, body, &[]).await;
        assert_eq!(status, StatusCode::OK);
        let finishes = text.matches("\"finish_reason\":\"stop\"").count();
        assert_eq!(finishes, 2, "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    }

    #[tokio::test]
    async fn models_lists_the_reasoners() {
        let response = models(Default::default(), axum::extract::Query(Default::default()))
            .await
            .into_response();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        let list: Value = serde_json::from_slice(&bytes).unwrap();
        let ids: Vec<&str> = list["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|model| model["id"].as_str().unwrap())
            .collect();
        assert_eq!(
            ids,
            [
                "sim-model",
                REASONER_MODEL,
                OPENROUTER_REASONER_MODEL,
                HIDDEN_REASONER_MODEL,
                TERSE_REASONER_MODEL
            ]
        );
    }

    #[tokio::test]
    async fn anthropic_clients_get_anthropics_list_in_pages() {
        let mut headers = axum::http::HeaderMap::new();
        headers.insert("anthropic-version", "2023-06-01".parse().unwrap());
        let page = |query: &[(&str, &str)]| {
            let query = query
                .iter()
                .map(|(name, value)| (name.to_string(), value.to_string()))
                .collect();
            let headers = headers.clone();
            async move {
                let response = models(headers, axum::extract::Query(query))
                    .await
                    .into_response();
                let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
                    .await
                    .unwrap();
                serde_json::from_slice::<Value>(&bytes).unwrap()
            }
        };
        let first = page(&[("limit", "3")]).await;
        assert_eq!(first["data"][0]["type"], "model", "{first}");
        assert_eq!(first["data"].as_array().unwrap().len(), 3, "{first}");
        assert_eq!(first["has_more"], true, "{first}");
        assert_eq!(first["last_id"], OPENROUTER_REASONER_MODEL, "{first}");
        let rest = page(&[("after_id", OPENROUTER_REASONER_MODEL)]).await;
        assert_eq!(rest["first_id"], HIDDEN_REASONER_MODEL, "{rest}");
        assert_eq!(rest["has_more"], false, "{rest}");
    }
}
