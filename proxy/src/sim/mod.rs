//! The simulated provider: a real OpenAI-compatible HTTP server for tests,
//! benchmarks and the demo.
//!
//! It serves `POST /v1/chat/completions` (streamed and not, with usage),
//! `GET /v1/models` and `GET /sim/stats`. Its model ([`model`]) is
//! deterministic. Timing follows `--prefill-tps` (first token after
//! prompt_tokens / rate seconds) and `--decode-tps` (one token per 1 / rate
//! seconds); both default to instant. Prompts over the context window get
//! HTTP 400 `context_length_exceeded`, as real providers answer.
//!
//! Failure modes ([`Mode`]) are chosen with `--mode` or, per request, with the
//! test-only header `x-sim-mode`. What the model sees is decided in one place,
//! [`SimProvider::visible_context`]: the seam where a shared paged KV pool
//! plugs in.

pub mod model;

use std::convert::Infallible;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use canarygate_policies::sse::encode_data;
use canarygate_policies::tokens::{content_text, count_chat_messages};
use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::error::ApiError;
use model::{Reply, Segment, generate};

/// Per-request override of the failure mode (tests only).
pub const MODE_HEADER: &str = "x-sim-mode";

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
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Ok(match text {
            "honest" => Self::Honest,
            "cut" => Self::Cut,
            "stall-first-byte" => Self::StallFirstByte,
            "stall-mid-stream" => Self::StallMidStream,
            other => {
                return Err(format!(
                    "unknown sim mode `{other}` (honest, cut, stall-first-byte, stall-mid-stream)"
                ));
            }
        })
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
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            context_window: 128_000,
            prefill_tps: 0.0,
            decode_tps: 0.0,
            mode: Mode::Honest,
            api_key: None,
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
}

/// The simulated provider's state.
pub struct SimProvider {
    config: SimConfig,
    stats: Stats,
    next_id: AtomicU64,
}

/// A routed simulated provider, ready for `axum::serve` or [`crate::tls::serve_tls`].
pub fn router(config: SimConfig) -> Router {
    let sim = Arc::new(SimProvider {
        config,
        stats: Stats::default(),
        next_id: AtomicU64::new(1),
    });
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/sim/stats", get(stats))
        .with_state(sim)
}

async fn models() -> impl IntoResponse {
    axum::Json(json!({"object": "list", "data": [
        {"id": "sim-model", "object": "model", "created": 0, "owned_by": "canarygate-sim"}
    ]}))
}

async fn stats(State(sim): State<Arc<SimProvider>>) -> impl IntoResponse {
    let stats = &sim.stats;
    axum::Json(json!({
        "requests": stats.requests.load(Ordering::Relaxed),
        "completed": stats.completed.load(Ordering::Relaxed),
        "cancelled": stats.cancelled.load(Ordering::Relaxed),
        "rejected": stats.rejected.load(Ordering::Relaxed),
    }))
}

/// One parsed request as the simulator needs it.
struct SimRequest {
    model: String,
    messages: Vec<Value>,
    stream: bool,
    include_usage: bool,
    max_tokens: Option<u64>,
}

impl SimRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let request = crate::request::ChatRequest::parse(body)?;
        let body = &request.body;
        Ok(Self {
            messages: request.messages().to_vec(),
            max_tokens: body
                .get("max_completion_tokens")
                .or_else(|| body.get("max_tokens"))
                .and_then(Value::as_u64),
            include_usage: body
                .pointer("/stream_options/include_usage")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            stream: request.stream,
            model: request.model,
        })
    }
}

async fn chat_completions(
    State(sim): State<Arc<SimProvider>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    sim.stats.requests.fetch_add(1, Ordering::Relaxed);
    match sim.serve(&headers, &body).await {
        Ok(response) => response,
        Err(error) => {
            sim.stats.rejected.fetch_add(1, Ordering::Relaxed);
            error.into_response()
        }
    }
}

impl SimProvider {
    async fn serve(
        self: &Arc<Self>,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<Response, ApiError> {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .ok_or_else(|| {
                ApiError::unauthorized("missing_api_key", "You didn't provide an API key.")
            })?;
        if self
            .config
            .api_key
            .as_deref()
            .is_some_and(|key| key != presented)
        {
            return Err(ApiError::unauthorized(
                "invalid_api_key",
                "Incorrect API key provided.",
            ));
        }
        let mode = match headers.get(MODE_HEADER) {
            Some(value) => value
                .to_str()
                .map_err(|_| ApiError::invalid_request("invalid_sim_mode", "bad x-sim-mode"))?
                .parse()
                .map_err(|error: String| ApiError::invalid_request("invalid_sim_mode", error))?,
            None => self.config.mode,
        };
        let request = SimRequest::parse(body)?;
        let prompt_tokens = count_chat_messages(&request.messages);
        let window = self.config.context_window;
        let requested = prompt_tokens + request.max_tokens.unwrap_or(0);
        if requested > window {
            return Err(ApiError::invalid_request(
                "context_length_exceeded",
                format!(
                    "This model's maximum context length is {window} tokens. However, you \
                     requested {requested} tokens ({prompt_tokens} in the messages, {} in the \
                     completion). Please reduce the length of the messages or completion.",
                    request.max_tokens.unwrap_or(0)
                ),
            ));
        }

        if mode == Mode::StallFirstByte {
            std::future::pending::<()>().await;
        }
        let context = self.visible_context(&request.messages);
        let reply = generate(&context, request.max_tokens);
        let usage = json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": reply.tokens.len(),
            "total_tokens": prompt_tokens + reply.tokens.len() as u64,
        });
        let answer = Answer {
            id: format!(
                "chatcmpl-sim-{}",
                self.next_id.fetch_add(1, Ordering::Relaxed)
            ),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: request.model.clone(),
            reply,
            usage,
            mode,
            prefill: delay(prompt_tokens as f64, self.config.prefill_tps),
            per_token: delay(1.0, self.config.decode_tps),
        };
        if request.stream {
            Ok(self.clone().stream(answer, request.include_usage))
        } else {
            Ok(self.complete(answer).await)
        }
    }

    /// What the model sees. Honest: the request's own messages.
    fn visible_context(&self, messages: &[Value]) -> Vec<Segment> {
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

    async fn complete(&self, answer: Answer) -> Response {
        tokio::time::sleep(answer.prefill + answer.per_token * answer.reply.tokens.len() as u32)
            .await;
        let body = json!({
            "id": answer.id,
            "object": "chat.completion",
            "created": answer.created,
            "model": answer.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": answer.reply.text()},
                "logprobs": null,
                "finish_reason": answer.reply.finish_reason,
            }],
            "usage": answer.usage,
        })
        .to_string();
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

    fn stream(self: Arc<Self>, answer: Answer, include_usage: bool) -> Response {
        let (sender, receiver) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(4);
        tokio::spawn(async move {
            let mut guard = CancelGuard {
                sim: self.clone(),
                finished: false,
            };
            if send_stream(&answer, include_usage, &sender).await.is_ok() {
                guard.finished = true;
                if answer.mode == Mode::Honest {
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

fn delay(amount: f64, rate: f64) -> Duration {
    if rate > 0.0 {
        Duration::from_secs_f64(amount / rate)
    } else {
        Duration::ZERO
    }
}

/// Everything needed to send one answer.
struct Answer {
    id: String,
    created: u64,
    model: String,
    reply: Reply,
    usage: Value,
    mode: Mode,
    prefill: Duration,
    per_token: Duration,
}

impl Answer {
    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
        })
    }
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

/// Sends the SSE events of `answer`; `Err` when the client went away.
async fn send_stream(answer: &Answer, include_usage: bool, sender: &Sender) -> Result<(), ()> {
    async fn send(sender: &Sender, data: &str) -> Result<(), ()> {
        let mut bytes = Vec::with_capacity(data.len() + 8);
        encode_data(data, &mut bytes);
        sender.send(Ok(Bytes::from(bytes))).await.map_err(|_| ())
    }

    send(
        sender,
        &answer
            .chunk(json!({"role": "assistant", "content": ""}), None)
            .to_string(),
    )
    .await?;
    tokio::time::sleep(answer.prefill).await;
    let tokens = &answer.reply.tokens;
    let cut_at = match answer.mode {
        Mode::Cut | Mode::StallMidStream => tokens.len() / 2,
        _ => tokens.len(),
    };
    for token in &tokens[..cut_at] {
        tokio::time::sleep(answer.per_token).await;
        send(
            sender,
            &answer.chunk(json!({"content": token}), None).to_string(),
        )
        .await?;
    }
    match answer.mode {
        Mode::Cut => return Ok(()),
        Mode::StallMidStream => {
            // Hold the connection open and silent until the client gives up.
            sender.closed().await;
            return Err(());
        }
        _ => {}
    }
    send(
        sender,
        &answer
            .chunk(json!({}), Some(answer.reply.finish_reason))
            .to_string(),
    )
    .await?;
    if include_usage {
        let usage = json!({
            "id": answer.id,
            "object": "chat.completion.chunk",
            "created": answer.created,
            "model": answer.model,
            "choices": [],
            "usage": answer.usage,
        });
        send(sender, &usage.to_string()).await?;
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
                () = crate::tls::serve_tls(listener, router, tls) => {}
                () = shutdown => {}
            }
            Ok(())
        }
        None => {
            axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
}
