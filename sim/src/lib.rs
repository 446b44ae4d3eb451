//! canarygate-sim: the simulated provider, a real OpenAI-compatible HTTP
//! server for tests, benchmarks and the demo. It knows nothing of the proxy:
//! like a real provider it reads what the client sends and answers.
//!
//! It serves `POST /v1/chat/completions` (streamed and not, with usage),
//! `GET /v1/models` and `GET /sim/stats`. Its model ([`model`]) is
//! deterministic. Timing follows `--prefill-tps` (first token after
//! uncached prompt tokens / rate seconds) and `--decode-tps` (one token per
//! 1 / rate seconds); both default to instant. Prompts over the context window
//! get HTTP 400 `context_length_exceeded`, as real providers answer.
//!
//! Like real providers it caches prompt prefixes ([`prefix_cache`], OpenAI's
//! rules by default: from 1024 tokens, in increments of 128): a prompt that
//! starts like a recent one prefills only the rest, and its usage reports
//! the cached part in `prompt_tokens_details.cached_tokens` (in whole answers
//! and in a stream's usage chunk).
//!
//! # What its answers carry
//!
//! Built in `answer.rs` from what the request asks (`request.rs` validates it
//! as OpenAI does: a 400 `invalid_request_error` naming the `param`):
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
//! - `logprobs: true` (`top_logprobs` 0..=20): `logprobs.content` entries
//!   (`token`, `logprob`, `bytes`, `top_logprobs`) whose tokens join to the
//!   content exactly; streamed, each content chunk carries its own tokens'.
//! - `tools` with `tool_choice` (`required`, a named function, or `auto` and
//!   a name in the last user message; `tools.rs`): `message.tool_calls`,
//!   `content: null`, `finish_reason: "tool_calls"`; streamed, a first delta
//!   with `index`, `id`, `type`, `function.name` and `arguments: ""`, then
//!   `arguments` fragments. Legacy `functions` / `function_call`:
//!   `message.function_call`, `finish_reason: "function_call"`.
//! - Always: `system_fingerprint`, `service_tier`, `message.refusal`,
//!   `message.annotations`; stream chunks carry an `obfuscation` padding
//!   string (`stream_options.include_obfuscation: false` drops it) and, with
//!   `include_usage`, `usage: null` until the usage chunk (`choices: []`).
//!
//! Every chat completion response (answers, errors, streams) carries the
//! headers of `headers.rs`: `x-request-id`, `openai-processing-ms`,
//! `openai-version`, `openai-organization`, `x-ratelimit-*` from a fixed
//! window ([`RateLimitConfig`]; over it, 429 with `retry-after` and
//! `retry-after-ms`) and a Cloudflare `__cf_bm` `set-cookie`. The test-only
//! header [`RATE_LIMIT_AFTER_HEADER`] lowers the request limit for one request.
//!
//! Failure modes ([`Mode`]) are chosen with `--mode` or, per request, with the
//! test-only header `x-sim-mode`. What the model sees is decided in one place,
//! `SimProvider::visible_context`, and what it sees is read from a paged KV
//! pool shared by all requests ([`pool`]).
//!
//! # The leak of SGLang issue #30233 (`leak-on-overflow`)
//!
//! Two capacities, as in the incident: the advertised context window
//! (`context_window`) and the smaller prefill KV pool (`pool_tokens`). The
//! shared KV pool the model reads from (the decode side) is sized for the
//! window, and every request's prompt is written into it; freed pages keep
//! their content. In `leak-on-overflow` a prompt over `pool_tokens` (but within
//! the window) is "rejected" the way SGLang did it: the prompt is replaced by a
//! one-token placeholder and the error is set aside, never answered. The
//! decode side still reserves pages for the full prompt, prefill writes one
//! position, and the model reads the whole reservation: the placeholder, then
//! stale positions of earlier requests, most recent first. The reply obeys
//! the stale canary instructions and restates another request's text, with
//! HTTP 200, `usage.prompt_tokens: 1`, and no prefill delay. Other modes serve
//! such a prompt correctly. Prompts over the advertised window get the same
//! placeholder in this mode (the provider checks nothing), where every other
//! mode answers HTTP 400.
//!
//! # Ground truth for tests and demos
//!
//! Each chat response carries [`CONTEXT_HEADER`] (`own`, `stale`, `swapped`,
//! `truncated`) and, when the context came from other requests,
//! [`CONTEXT_FROM_HEADER`] with their response ids. `GET /sim/stats` counts
//! them. A real provider sends nothing like it; the proxy does not forward it.

mod answer;
mod error;
mod hash;
mod headers;
pub mod model;
pub mod pool;
pub mod prefix_cache;
mod request;
pub mod tls;
mod tools;

use std::convert::Infallible;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use canarygate_policies::sse::encode_data;
use canarygate_policies::tokens::{content_text, count_chat_messages};
use futures_util::StreamExt;
use serde_json::{Value, json};

use answer::{Answer, Compose, MODELS};
pub use answer::{OPENROUTER_REASONER_MODEL, REASONER_MODEL, SYSTEM_FINGERPRINT};
pub use error::SimError;
pub use headers::{OPENAI_VERSION, ORGANIZATION, RateLimitConfig};
use headers::{RateSnapshot, RateWindow};
use model::Segment;
use pool::{KvPool, Position, prompt_positions};
use prefix_cache::PrefixCache;
pub use prefix_cache::PrefixCacheConfig;
use request::SimRequest;

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

/// Response header listing, comma-separated, the response ids of the other
/// requests whose context this response was generated from.
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
    /// Sends about half the answer, then closes the connection: no `[DONE]`
    /// on a stream, a truncated body otherwise.
    Cut,
    /// Accepts the request and never sends the response head.
    StallFirstByte,
    /// Streams the first tokens, then goes silent with the connection open.
    StallMidStream,
    /// SGLang issue #30233: a prompt over the prefill pool (within the
    /// window) is answered from stale KV pages of earlier requests, with
    /// HTTP 200 and `prompt_tokens: 1` (see the module docs).
    LeakOnOverflow,
    /// Silently drops the first third of the messages (at least one, never
    /// all): the head canary message is lost. Usage reports the tokens kept.
    TruncateHead,
    /// Silently drops the last third of the messages (at least one, never
    /// all): the tail canary message is lost. Usage reports the tokens kept.
    TruncateTail,
    /// Answers from the most recent other request's context (its canaries,
    /// its text), reporting this request's own usage. The very first request
    /// has nobody to swap with and is answered honestly.
    Swap,
    /// Refuses every request with 429 `rate_limit_exceeded`, `retry-after: 1`,
    /// `retry-after-ms: 1000` and `x-ratelimit-remaining-*: 0`.
    RateLimited,
}

impl Mode {
    /// Every mode, in the order of [`Mode::name`]'s documentation.
    pub const ALL: [Self; 9] = [
        Self::Honest,
        Self::LeakOnOverflow,
        Self::TruncateHead,
        Self::TruncateTail,
        Self::Swap,
        Self::Cut,
        Self::StallFirstByte,
        Self::StallMidStream,
        Self::RateLimited,
    ];

    /// The name used by `--mode` and `x-sim-mode`: `honest`,
    /// `leak-on-overflow`, `truncate-head`, `truncate-tail`, `swap`, `cut`,
    /// `stall-first-byte`, `stall-mid-stream`, `rate-limited`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Honest => "honest",
            Self::LeakOnOverflow => "leak-on-overflow",
            Self::TruncateHead => "truncate-head",
            Self::TruncateTail => "truncate-tail",
            Self::Swap => "swap",
            Self::Cut => "cut",
            Self::StallFirstByte => "stall-first-byte",
            Self::StallMidStream => "stall-mid-stream",
            Self::RateLimited => "rate-limited",
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

/// Counters served at `GET /sim/stats`.
#[derive(Debug, Default)]
struct Stats {
    requests: AtomicU64,
    completed: AtomicU64,
    cancelled: AtomicU64,
    rejected: AtomicU64,
    /// Responses generated from other requests' context (stale or swapped).
    leaked: AtomicU64,
    /// Prompts replaced by a one-token placeholder (`leak-on-overflow`).
    placeholder_substitutions: AtomicU64,
    /// Prompts silently truncated.
    truncated: AtomicU64,
    /// Responses generated from another request's context (`swap`).
    swapped: AtomicU64,
    /// Requests refused with 429.
    rate_limited: AtomicU64,
    /// Prompts served with part of them from the prefix cache.
    cache_hits: AtomicU64,
    /// Prompt tokens served from the prefix cache, summed.
    cached_tokens: AtomicU64,
}

/// The simulated provider's state.
pub struct SimProvider {
    config: SimConfig,
    stats: Stats,
    next_id: AtomicU64,
    /// The shared paged KV pool, sized for the context window.
    pool: Mutex<KvPool>,
    /// The most recent request's id and own context, for `swap`.
    last_context: Mutex<Option<(u64, Arc<Vec<Segment>>)>>,
    /// Prompt prefixes seen, when caching is on.
    prefix_cache: Option<Mutex<PrefixCache>>,
    /// Requests and tokens admitted in the current rate-limit window.
    rate: Mutex<RateWindow>,
    /// When this provider started (nanoseconds since the epoch): makes
    /// `x-request-id`s unique across runs.
    started_nanos: u128,
}

/// Where the model's context came from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// The request's own messages.
    Own,
    /// Stale KV pool positions written by these requests.
    Stale(Vec<u64>),
    /// This other request's context.
    Swapped(u64),
    /// Part of the request's own messages.
    Truncated,
}

/// What the model sees for one request, and what the provider reports.
#[derive(Debug)]
struct Visible {
    context: Vec<Segment>,
    /// Prompt tokens reported in `usage`.
    prompt_tokens: u64,
    /// Of those, tokens served from the prefix cache (not prefilled).
    cached_tokens: u64,
    source: Source,
}

/// The response id of request `number`.
fn response_id(number: u64) -> String {
    format!("chatcmpl-sim-{number}")
}

/// A routed simulated provider, ready for `axum::serve` or [`tls::serve_tls`].
pub fn router(config: SimConfig) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/sim/stats", get(stats))
        .with_state(SimProvider::new(config))
}

impl SimProvider {
    fn new(config: SimConfig) -> Arc<Self> {
        Arc::new(Self {
            pool: Mutex::new(KvPool::new(config.context_window, config.page_tokens)),
            last_context: Mutex::new(None),
            prefix_cache: config
                .prefix_cache
                .clone()
                .map(|cache| Mutex::new(PrefixCache::new(cache))),
            rate: Mutex::new(RateWindow::new(
                config.rate_limit.clone(),
                std::time::Instant::now(),
            )),
            started_nanos: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |since| since.as_nanos()),
            config,
            stats: Stats::default(),
            next_id: AtomicU64::new(1),
        })
    }
}

async fn models() -> impl IntoResponse {
    let data: Vec<Value> = MODELS
        .iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "canarygate-sim"}))
        .collect();
    axum::Json(json!({"object": "list", "data": data}))
}

async fn stats(State(sim): State<Arc<SimProvider>>) -> impl IntoResponse {
    let stats = &sim.stats;
    let (pages, page_tokens) = {
        let pool = sim.pool.lock().unwrap_or_else(PoisonError::into_inner);
        (pool.pages(), pool.page_tokens())
    };
    let cache_prefixes = sim
        .prefix_cache
        .as_ref()
        .map(|cache| cache.lock().unwrap_or_else(PoisonError::into_inner).len());
    axum::Json(json!({
        "requests": stats.requests.load(Ordering::Relaxed),
        "completed": stats.completed.load(Ordering::Relaxed),
        "cancelled": stats.cancelled.load(Ordering::Relaxed),
        "rejected": stats.rejected.load(Ordering::Relaxed),
        "leaked": stats.leaked.load(Ordering::Relaxed),
        "placeholder_substitutions": stats.placeholder_substitutions.load(Ordering::Relaxed),
        "truncated": stats.truncated.load(Ordering::Relaxed),
        "swapped": stats.swapped.load(Ordering::Relaxed),
        "rate_limited": stats.rate_limited.load(Ordering::Relaxed),
        "context_window": sim.config.context_window,
        "prefill_pool_tokens": sim.config.prefill_pool_tokens(),
        "kv_pool": {"pages": pages, "page_tokens": page_tokens},
        "prefix_cache": {
            "enabled": cache_prefixes.is_some(),
            "hits": stats.cache_hits.load(Ordering::Relaxed),
            "cached_tokens": stats.cached_tokens.load(Ordering::Relaxed),
            "prefixes": cache_prefixes.unwrap_or(0),
        },
    }))
}

async fn chat_completions(
    State(sim): State<Arc<SimProvider>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let started = std::time::Instant::now();
    let number = sim.stats.requests.fetch_add(1, Ordering::Relaxed) + 1;
    let mut rate = None;
    let mut response = match sim.serve(&headers, &body, &mut rate).await {
        Ok(response) => response,
        Err(error) => {
            if error.status() == 429 {
                sim.stats.rate_limited.fetch_add(1, Ordering::Relaxed);
            } else {
                sim.stats.rejected.fetch_add(1, Ordering::Relaxed);
            }
            error.into_response()
        }
    };
    let rate = rate.unwrap_or_else(|| {
        sim.rate
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .peek(started, None)
    });
    headers::insert(
        response.headers_mut(),
        &headers::request_id(number, sim.started_nanos),
        started.elapsed(),
        &rate,
    );
    response
}

impl SimProvider {
    async fn serve(
        self: &Arc<Self>,
        headers: &HeaderMap,
        body: &[u8],
        rate: &mut Option<RateSnapshot>,
    ) -> Result<Response, SimError> {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .ok_or_else(|| {
                SimError::unauthorized("missing_api_key", "You didn't provide an API key.")
            })?;
        if self
            .config
            .api_key
            .as_deref()
            .is_some_and(|key| key != presented)
        {
            return Err(SimError::unauthorized(
                "invalid_api_key",
                "Incorrect API key provided.",
            ));
        }
        let mode = match headers.get(MODE_HEADER) {
            Some(value) => value
                .to_str()
                .map_err(|_| SimError::invalid_request(Some("invalid_sim_mode"), "bad x-sim-mode"))?
                .parse()
                .map_err(|error: UnknownMode| {
                    SimError::invalid_request(Some("invalid_sim_mode"), error.to_string())
                })?,
            None => self.config.mode,
        };
        let request = SimRequest::parse(body)?;
        let prompt_tokens = count_chat_messages(&request.messages);
        let window = self.config.context_window;
        let requested = prompt_tokens + request.max_tokens().unwrap_or(0);
        // leak-on-overflow never checks what it can hold, its window included.
        if requested > window && mode != Mode::LeakOnOverflow {
            return Err(SimError::invalid_request(
                Some("context_length_exceeded"),
                format!(
                    "This model's maximum context length is {window} tokens. However, you \
                     requested {requested} tokens ({prompt_tokens} in the messages, {} in the \
                     completion). Please reduce the length of the messages or completion.",
                    request.max_tokens().unwrap_or(0)
                ),
            ));
        }

        self.admit(headers, mode, &request, prompt_tokens, rate)?;
        if mode == Mode::StallFirstByte {
            std::future::pending::<()>().await;
        }
        let number = self.next_id.fetch_add(1, Ordering::Relaxed);
        let visible = self.visible_context(
            number,
            mode,
            &request.model,
            &request.messages,
            prompt_tokens,
        )?;
        let prompt_tokens = visible.prompt_tokens;
        let answer = Answer::compose(Compose {
            id: response_id(number),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            request: &request,
            context: &visible.context,
            prompt_tokens,
            cached_tokens: visible.cached_tokens,
        });
        let answer = Delivery {
            answer,
            mode,
            prefill: delay(
                (prompt_tokens - visible.cached_tokens) as f64,
                self.config.prefill_tps,
            ),
            per_token: delay(1.0, self.config.decode_tps),
        };
        let (label, from) = match &visible.source {
            Source::Own => ("own", Vec::new()),
            Source::Truncated => ("truncated", Vec::new()),
            Source::Stale(writers) => ("stale", writers.clone()),
            Source::Swapped(other) => ("swapped", vec![*other]),
        };
        let mut response = if request.stream() {
            self.clone().stream(answer)
        } else {
            self.complete(answer).await
        };
        let headers = response.headers_mut();
        headers.insert(
            HeaderName::from_static(CONTEXT_HEADER),
            HeaderValue::from_static(label),
        );
        if !from.is_empty() {
            let ids: Vec<String> = from.into_iter().map(response_id).collect();
            if let Ok(value) = HeaderValue::from_str(&ids.join(",")) {
                headers.insert(HeaderName::from_static(CONTEXT_FROM_HEADER), value);
            }
        }
        Ok(response)
    }

    /// Counts the request against the rate limit, or refuses it with 429
    /// (always in `rate-limited`); `rate` gets what the response reports.
    fn admit(
        &self,
        headers: &HeaderMap,
        mode: Mode,
        request: &SimRequest,
        prompt_tokens: u64,
        rate: &mut Option<RateSnapshot>,
    ) -> Result<(), SimError> {
        let limit = match headers.get(RATE_LIMIT_AFTER_HEADER) {
            Some(value) => Some(
                value
                    .to_str()
                    .ok()
                    .and_then(|text| text.trim().parse::<u64>().ok())
                    .ok_or_else(|| {
                        SimError::invalid_request(
                            Some("invalid_sim_rate_limit"),
                            format!("{RATE_LIMIT_AFTER_HEADER} must be a whole number"),
                        )
                    })?,
            ),
            None => None,
        };
        let now = std::time::Instant::now();
        let mut window = self.rate.lock().unwrap_or_else(PoisonError::into_inner);
        if mode == Mode::RateLimited {
            let snapshot = RateSnapshot {
                remaining_requests: 0,
                remaining_tokens: 0,
                reset: Duration::from_secs(1),
                ..window.peek(now, limit)
            };
            let message = format!(
                "Rate limit reached for requests per min (RPM) in organization {ORGANIZATION}: \
                 Limit {limit}, Used {limit}, Requested 1. Please try again in 1s.",
                limit = snapshot.limit_requests
            );
            *rate = Some(snapshot);
            return Err(SimError::rate_limited(
                "requests",
                message,
                Duration::from_secs(1),
            ));
        }
        let choices = request.choices as u64;
        let tokens = prompt_tokens + request.max_tokens().unwrap_or(0).saturating_mul(choices);
        match window.admit(now, tokens, limit) {
            Ok(snapshot) => {
                *rate = Some(snapshot);
                Ok(())
            }
            Err(refusal) => {
                // Retry when the window reopens, at least a millisecond on.
                let retry = refusal.snapshot.reset.max(Duration::from_millis(1));
                *rate = Some(refusal.snapshot);
                Err(SimError::rate_limited(refusal.kind, refusal.message, retry))
            }
        }
    }

    /// What the model sees for request `number` in `mode`, read from the
    /// shared KV pool (see the module docs), and the prompt tokens reported.
    fn visible_context(
        &self,
        number: u64,
        mode: Mode,
        model: &str,
        messages: &[Value],
        prompt_tokens: u64,
    ) -> Result<Visible, SimError> {
        let own = Arc::new(segments(messages));
        let previous = self
            .last_context
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace((number, own.clone()));
        let visible = match mode {
            Mode::LeakOnOverflow if prompt_tokens > self.config.prefill_pool_tokens() => {
                // SGLang's "rejection": a one-token placeholder replaces the
                // prompt and the error goes to a side field nobody reads.
                let to_finish = format!(
                    "prompt of {prompt_tokens} tokens exceeds the prefill KV pool of {} tokens",
                    self.config.prefill_pool_tokens()
                );
                tracing::debug!(%to_finish, "sim: prompt replaced by a one-token placeholder");
                self.stats
                    .placeholder_substitutions
                    .fetch_add(1, Ordering::Relaxed);
                // Decode reserves for the full prompt; prefill writes one.
                let reserved = prompt_tokens.min(self.config.context_window);
                let read = self.run_in_pool(number, reserved, &[Position::Control])?;
                Visible {
                    context: read.context,
                    prompt_tokens: 1,
                    cached_tokens: 0,
                    source: Source::Stale(read.other_writers),
                }
            }
            Mode::TruncateHead | Mode::TruncateTail => {
                let drop = (messages.len() / 3)
                    .max(1)
                    .min(messages.len().saturating_sub(1));
                let kept = if mode == Mode::TruncateHead {
                    &messages[drop..]
                } else {
                    &messages[..messages.len() - drop]
                };
                let mut visible = self.honest(number, model, kept)?;
                if drop > 0 {
                    visible.source = Source::Truncated;
                }
                visible
            }
            Mode::Swap => {
                // The request is processed; the replies cross.
                let mut visible = self.honest(number, model, messages)?;
                if let Some((other, context)) = previous {
                    visible.context = context.as_ref().clone();
                    visible.source = Source::Swapped(other);
                }
                visible
            }
            _ => self.honest(number, model, messages)?,
        };
        match &visible.source {
            Source::Stale(writers) if !writers.is_empty() => {
                self.stats.leaked.fetch_add(1, Ordering::Relaxed);
            }
            Source::Swapped(_) => {
                self.stats.leaked.fetch_add(1, Ordering::Relaxed);
                self.stats.swapped.fetch_add(1, Ordering::Relaxed);
            }
            Source::Truncated => {
                self.stats.truncated.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        Ok(visible)
    }

    /// Writes `messages` into the pool and reads them back; the part of
    /// them the prefix cache holds is not prefilled.
    fn honest(&self, number: u64, model: &str, messages: &[Value]) -> Result<Visible, SimError> {
        let positions = prompt_positions(messages);
        let prompt_tokens = positions.len() as u64;
        let cached_tokens = self.cached_prefix(model, &positions);
        let read = self.run_in_pool(number, prompt_tokens, &positions)?;
        Ok(Visible {
            context: read.context,
            prompt_tokens,
            cached_tokens,
            source: Source::Own,
        })
    }

    /// Tokens of `positions` (a prompt for `model`) the prefix cache holds;
    /// remembers its prefixes for the next prompts.
    fn cached_prefix(&self, model: &str, positions: &[Position]) -> u64 {
        let (Some(config), Some(cache)) = (&self.config.prefix_cache, &self.prefix_cache) else {
            return 0;
        };
        let hashes = config.hashes(model, positions);
        let cached = cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .serve(&hashes, std::time::Instant::now());
        if cached > 0 {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            self.stats
                .cached_tokens
                .fetch_add(cached, Ordering::Relaxed);
        }
        cached
    }

    fn run_in_pool(
        &self,
        number: u64,
        reserved: u64,
        written: &[Position],
    ) -> Result<pool::ReadBack, SimError> {
        self.pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .run(number, reserved, written)
            .ok_or_else(|| SimError::internal("sim: the KV pool has too few free pages"))
    }

    async fn complete(&self, answer: Delivery) -> Response {
        let steps = u32::try_from(answer.answer.decode_steps()).unwrap_or(u32::MAX);
        pace(answer.prefill + answer.per_token * steps).await;
        let body = answer.answer.body().to_string();
        if matches!(answer.mode, Mode::Cut | Mode::StallMidStream) {
            // Half the body, then a reset (cut) or silence with the connection open (stall).
            let half = Bytes::from(body[..body.len() / 2].to_owned());
            let mode = answer.mode;
            let rest = futures_util::stream::once(async move {
                if mode == Mode::StallMidStream {
                    std::future::pending::<()>().await;
                }
                Err::<Bytes, _>(std::io::Error::other("sim: cut mid-body"))
            });
            let body = futures_util::stream::once(async move { Ok(half) }).chain(rest);
            let mut response = Response::new(Body::from_stream(body));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            return response;
        }
        self.stats.completed.fetch_add(1, Ordering::Relaxed);
        ([(header::CONTENT_TYPE, "application/json")], body).into_response()
    }

    fn stream(self: Arc<Self>, answer: Delivery) -> Response {
        let (sender, receiver) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(4);
        tokio::spawn(async move {
            let mut guard = CancelGuard {
                sim: self.clone(),
                finished: false,
            };
            if send_stream(&answer, &sender).await.is_ok() {
                guard.finished = true;
                if !matches!(answer.mode, Mode::Cut | Mode::StallMidStream) {
                    self.stats.completed.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|item| (item, receiver))
        });
        let mut response = Response::new(Body::from_stream(stream));
        *response.status_mut() = StatusCode::OK;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        response
    }
}

/// The request's own messages as the model would see them.
fn segments(messages: &[Value]) -> Vec<Segment> {
    messages
        .iter()
        .map(|message| Segment {
            role: message["role"].as_str().unwrap_or("user").to_owned(),
            text: message
                .get("content")
                .map(content_text)
                .unwrap_or_default()
                .into_owned(),
        })
        .collect()
}

fn delay(amount: f64, rate: f64) -> Duration {
    if rate > 0.0 {
        Duration::from_secs_f64(amount / rate)
    } else {
        Duration::ZERO
    }
}

/// An answer and how to send it.
struct Delivery {
    answer: Answer,
    mode: Mode,
    prefill: Duration,
    per_token: Duration,
}

/// Counts a stream the client abandoned: dropped before it was finished.
struct CancelGuard {
    sim: Arc<SimProvider>,
    finished: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.finished {
            self.sim.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }
}

type Sender = tokio::sync::mpsc::Sender<Result<Bytes, Infallible>>;

/// Sends the SSE events of `delivery`; `Err` when the client went away.
async fn send_stream(delivery: &Delivery, sender: &Sender) -> Result<(), ()> {
    async fn send(sender: &Sender, data: &str) -> Result<(), ()> {
        let mut bytes = Vec::with_capacity(data.len() + 8);
        encode_data(data, &mut bytes);
        sender.send(Ok(Bytes::from(bytes))).await.map_err(|_| ())
    }

    let plan = delivery.answer.stream_plan();
    for chunk in &plan.opening {
        send(sender, &chunk.to_string()).await?;
    }
    pace(delivery.prefill).await;
    let cut_at = match delivery.mode {
        Mode::Cut | Mode::StallMidStream => plan.steps.len() / 2,
        _ => plan.steps.len(),
    };
    for step in &plan.steps[..cut_at] {
        pace(delivery.per_token).await;
        for chunk in step {
            send(sender, &chunk.to_string()).await?;
        }
    }
    match delivery.mode {
        Mode::Cut => return Ok(()),
        Mode::StallMidStream => {
            // Hold the connection open and silent until the client gives up.
            sender.closed().await;
            return Err(());
        }
        _ => {}
    }
    for chunk in plan.closing.iter().chain(&plan.usage) {
        send(sender, &chunk.to_string()).await?;
    }
    send(sender, "[DONE]").await
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

/// Waits `duration`; returns at once for zero. (A zero `tokio::time::sleep`
/// still waits for the next timer tick, up to a millisecond, which would make
/// an "instant" provider pace every token.)
async fn pace(duration: Duration) {
    if !duration.is_zero() {
        tokio::time::sleep(duration).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let response = models().await.into_response();
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
            ["sim-model", REASONER_MODEL, OPENROUTER_REASONER_MODEL]
        );
    }
}
