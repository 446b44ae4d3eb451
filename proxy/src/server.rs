//! The proxy's HTTP server: routes, middleware and the chat completion path.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use canarygate_policies::config::{Policy, ResolvedRoute};
use canarygate_policies::context::{ContextDemand, trusted_limit};
use canarygate_policies::local_config::UntrustedContext;
use canarygate_policies::registry::{MemoryRegistry, Registration};
use futures_util::StreamExt;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::audit::{AuditLog, AuditOptions, CheckRecord, CheckResult};
use crate::clock::RequestClock;
use crate::error::{ApiError, error_chain};
use crate::identity::Authenticator;
use crate::local::{LocalEngine, LocalReason};
use crate::metrics::Metrics;
use crate::probe::ProbeBook;
use crate::relay::relay_sse;
use crate::request::ChatRequest;
use crate::trail::{PendingTrail, Trail};
use crate::upstream::{Upstream, build_upstreams, send_error};

/// Response header carrying the id of the request (also in the audit log).
pub const REQUEST_ID_HEADER: &str = "x-canarygate-request-id";

/// Response header carrying the caller's session id.
pub const SESSION_ID_HEADER: &str = "x-canarygate-session";

/// Response header carrying the verification verdict.
pub const VERDICT_HEADER: &str = "x-canarygate-verdict";

/// Request headers forwarded to the provider besides `Authorization`.
const FORWARDED_HEADERS: [&str; 3] = ["openai-organization", "openai-project", "openai-beta"];

/// Largest upstream response body read for a non-streaming request.
const MAX_UPSTREAM_BODY: usize = 64 * 1024 * 1024;

/// What `canarygate serve` needs.
pub struct ServeOptions {
    /// The validated policy (with any `--upstream` override applied).
    pub policy: Policy,
    /// Where to listen.
    pub listen: SocketAddr,
    /// The data directory: per-install secret and audit store.
    pub data_dir: PathBuf,
}

/// Shared state of every request handler.
pub(crate) struct AppState {
    pub(crate) policy: Policy,
    upstreams: Vec<Upstream>,
    auth: Authenticator,
    pub(crate) metrics: Arc<Metrics>,
    slots: Arc<Semaphore>,
    /// Every live canary of this process.
    pub(crate) registry: Arc<MemoryRegistry>,
    /// The durable audit store (records, persisted canaries).
    pub(crate) audit: AuditLog,
    /// The bundled engine, when `[local]` names a model.
    pub(crate) local: Option<LocalEngine>,
    /// Probed context limits from the data directory.
    pub(crate) probes: Arc<ProbeBook>,
}

/// A bound, not yet running server.
pub struct Server {
    listener: TcpListener,
    router: Router,
    startup: Startup,
}

/// What `serve` found at start, for its first lines of output.
#[derive(Debug, Clone)]
pub struct Startup {
    /// The local engine: served context window and KV pool, in tokens.
    pub local_engine: Option<(usize, usize)>,
    /// Stored probe results.
    pub probes: Vec<Arc<canarygate_policies::probe::ProbeResult>>,
}

/// How often `serve` drops expired canaries from its in-memory registry.
const REGISTRY_PURGE_INTERVAL: Duration = Duration::from_secs(1);

/// How often `serve` drops expired canaries from its audit store: each sweep
/// is a write transaction, queued behind the requests' audit records.
const STORE_SWEEP_INTERVAL: Duration = Duration::from_secs(60);

/// How often `serve` re-reads the probe results of its data directory.
const PROBE_RELOAD_INTERVAL: Duration = Duration::from_secs(30);

impl Server {
    /// Loads secrets, builds provider clients and binds the listener.
    pub async fn bind(options: ServeOptions) -> Result<Self, String> {
        let upstreams = build_upstreams(&options.policy)?;
        let audit = open_audit_log(&options).await?;
        let secrets = audit.secrets().clone();
        let registry = Arc::new(MemoryRegistry::new(&secrets.secret("canary")));
        let live = audit
            .live_canaries(crate::verified::now_ms())
            .map_err(|error| format!("audit store: {error}"))?;
        if !live.is_empty() {
            tracing::info!(
                canaries = live.len(),
                "restored live canaries of requests still in flight before the restart"
            );
        }
        for entry in live {
            registry.restore(
                entry.key,
                Registration {
                    session: entry.session,
                    request: entry.request_id,
                    expires_at_ms: entry.expires_at_ms,
                },
            );
        }
        spawn_registry_sweeper(Arc::downgrade(&registry), audit.clone());
        let local_config = options.policy.local.clone();
        let local = tokio::task::spawn_blocking(move || crate::local::start(&local_config))
            .await
            .map_err(|error| format!("starting the local engine failed: {error}"))??;
        let probes = Arc::new(ProbeBook::open(&options.data_dir));
        let startup = Startup {
            local_engine: local
                .as_ref()
                .map(|engine| (engine.context_window(), engine.pool_tokens())),
            probes: probes.all(),
        };
        let listener = TcpListener::bind(options.listen)
            .await
            .map_err(|error| format!("cannot listen on {}: {error}", options.listen))?;
        let state = Arc::new(AppState {
            registry,
            audit,
            auth: Authenticator::new(&options.policy.auth, secrets.secret("session")),
            slots: Arc::new(Semaphore::new(
                options.policy.limits.max_concurrent_requests,
            )),
            metrics: Arc::new(Metrics::new()),
            upstreams,
            local,
            probes,
            policy: options.policy,
        });
        spawn_probe_tasks(Arc::downgrade(&state), options.data_dir.clone());
        spawn_reachability_check(Arc::downgrade(&state));
        Ok(Self {
            listener,
            router: router(state),
            startup,
        })
    }

    /// What was found at start: the local engine, stored probe results.
    pub fn startup(&self) -> &Startup {
        &self.startup
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` resolves, then finishes the requests in flight.
    pub async fn run(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        // No Nagle: a streamed token must leave at once, not wait for an ACK.
        let listener = self.listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, self.router)
            .with_graceful_shutdown(shutdown)
            .await
    }
}

/// Opens the audit store of the data directory (blocking: it checks the file).
async fn open_audit_log(options: &ServeOptions) -> Result<AuditLog, String> {
    let audit_options = AuditOptions::from_policy(&options.policy.audit)
        .map_err(|error| format!("[audit]: {error}"))?;
    let dir = options.data_dir.clone();
    std::fs::create_dir_all(&dir)
        .map_err(|error| format!("cannot create data dir {}: {error}", dir.display()))?;
    tokio::task::spawn_blocking(move || {
        AuditLog::open(&dir, audit_options)
            .map_err(|error| format!("audit store in {}: {error}", dir.display()))
    })
    .await
    .map_err(|error| format!("opening the audit store failed: {error}"))?
}

/// Drops expired canaries from memory every [`REGISTRY_PURGE_INTERVAL`] and
/// from the store every [`STORE_SWEEP_INTERVAL`], until the registry is gone.
/// A purge removes only what expired since the last one (the registry keeps
/// an expiry index), so each shard's lock is held for microseconds.
fn spawn_registry_sweeper(registry: std::sync::Weak<MemoryRegistry>, audit: AuditLog) {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(REGISTRY_PURGE_INTERVAL);
        let mut last_store_sweep: Option<tokio::time::Instant> = None;
        loop {
            ticks.tick().await;
            let Some(registry) = registry.upgrade() else {
                return;
            };
            let now = crate::verified::now_ms();
            // Off the runtime's workers, like any lock-taking batch.
            let _ = tokio::task::spawn_blocking(move || registry.purge_expired(now)).await;
            if last_store_sweep.is_none_or(|at| at.elapsed() >= STORE_SWEEP_INTERVAL) {
                last_store_sweep = Some(tokio::time::Instant::now());
                if let Err(error) = audit.sweep_canaries(now).await {
                    tracing::warn!("sweeping expired canaries from the audit store: {error}");
                }
            }
        }
    });
}

/// Re-reads probe results every [`PROBE_RELOAD_INTERVAL`] (so a
/// `canarygate probe` run while serving takes effect), and re-probes each
/// routed model on `[probe] every_hours`, until the server is gone.
fn spawn_probe_tasks(state: std::sync::Weak<AppState>, data_dir: PathBuf) {
    let reload_state = state.clone();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(PROBE_RELOAD_INTERVAL);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let Some(state) = reload_state.upgrade() else {
                return;
            };
            let probes = state.probes.clone();
            drop(state);
            let _ = tokio::task::spawn_blocking(move || probes.reload()).await;
        }
    });
    tokio::spawn(async move {
        loop {
            let Some(strong) = state.upgrade() else {
                return;
            };
            let Some(interval) = strong.policy.probe.interval() else {
                return;
            };
            let due = scheduled_probes(&strong, interval);
            drop(strong);
            for target in due {
                let Some(strong) = state.upgrade() else {
                    return;
                };
                let policy = strong.policy.clone();
                let probes = strong.probes.clone();
                drop(strong);
                let budget = policy.probe.budget_tokens;
                // The provider's api_key_env authenticates the probe (also in passthrough auth).
                let api_key = policy
                    .providers
                    .iter()
                    .find(|provider| provider.name.get_ref() == &target.provider)
                    .and_then(|provider| provider.api_key_env.as_deref())
                    .and_then(|variable| std::env::var(variable).ok());
                tracing::info!(provider = %target.provider, model = %target.model, "scheduled context probe");
                match crate::probe::run(&policy, &target, api_key.as_deref(), budget, |_| {}).await
                {
                    Ok(result) => {
                        tracing::info!(
                            provider = %result.provider,
                            model = %result.model,
                            effective_limit_tokens = result.effective_limit_tokens,
                            trusted = result.trusted,
                            "context probe finished"
                        );
                        if let Err(error) = crate::probe::store(&data_dir, &result) {
                            tracing::warn!("storing the probe result: {error}");
                        }
                        probes.reload();
                    }
                    Err(error) => tracing::warn!("scheduled context probe failed: {error}"),
                }
            }
            tokio::time::sleep(interval.min(Duration::from_secs(3600))).await;
        }
    });
}

/// Says, once at start, which providers do not answer at all: the server
/// still serves `/v1/models`, health and metrics, and their requests get 502
/// (or the local engine) until they do.
fn spawn_reachability_check(state: std::sync::Weak<AppState>) {
    tokio::spawn(async move {
        let Some(state) = state.upgrade() else {
            return;
        };
        for upstream in &state.upstreams {
            if let Err(error) = upstream.check_reachable().await {
                let fallback =
                    if state.local.is_some() && state.policy.local.on_upstream_unavailable() {
                        "its requests are served by the local engine until it is"
                    } else {
                        "its requests fail with 502 until it is"
                    };
                tracing::warn!(
                    "provider `{}` is not reachable ({error}); {fallback}",
                    upstream.name
                );
            }
        }
    });
}

/// Routed models whose last probe is older than `interval` (or missing).
fn scheduled_probes(state: &AppState, interval: Duration) -> Vec<crate::probe::ProbeTarget> {
    let now = crate::verified::now_ms();
    let mut seen = std::collections::HashSet::new();
    state
        .policy
        .named_models()
        .filter_map(|model| state.policy.route(model))
        .filter(|route| seen.insert((route.provider, route.upstream_model)))
        .filter(|route| {
            state
                .probes
                .get(route.provider, route.upstream_model)
                .is_none_or(|result| {
                    now.saturating_sub(result.probed_at_ms) >= interval.as_millis() as u64
                })
        })
        .map(|route| crate::probe::ProbeTarget {
            provider: route.provider.to_owned(),
            model: route.upstream_model.to_owned(),
            advertised_window_tokens: route.context_window,
        })
        .collect()
}

fn router(state: Arc<AppState>) -> Router {
    let metrics = state.metrics.clone();
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(list_models))
        .route(
            "/healthz",
            get(|| async { axum::Json(json!({"status": "ok"})) }),
        )
        .route("/metrics", get(render_metrics))
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                message: "Unknown endpoint: canarygate serves POST /v1/chat/completions, \
                          GET /v1/models, GET /healthz and GET /metrics."
                    .into(),
                kind: "invalid_request_error",
                code: "unknown_url",
                param: None,
            }
        })
        .layer(middleware::from_fn_with_state(metrics, tag_and_count))
        .with_state(state)
}

/// Request id of the current request, set by the middleware.
#[derive(Clone)]
pub struct RequestId(pub Arc<str>);

/// Gives every request an id (request extension + response header) and counts
/// every response by endpoint and status.
async fn tag_and_count(
    State(metrics): State<Arc<Metrics>>,
    mut request: Request,
    next: Next,
) -> Response {
    let id: Arc<str> = format!("cg-{}", uuid::Uuid::now_v7().simple()).into();
    let route = match request
        .extensions()
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
    {
        Some("/v1/chat/completions") => "chat_completions",
        Some("/v1/models") => "models",
        Some("/healthz") => "healthz",
        Some("/metrics") => "metrics",
        _ => "unknown",
    };
    request.extensions_mut().insert(RequestId(id.clone()));
    let mut response = next.run(request).await;
    metrics.count_request(route, response.status().as_u16());
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

async fn render_metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    state
        .metrics
        .set_audit_background_failures(state.audit.background_failures());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

async fn list_models(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let data: Vec<_> = state
        .policy
        .named_models()
        .filter_map(|model| {
            let route = state.policy.route(model)?;
            Some(json!({"id": model, "object": "model", "created": 0, "owned_by": route.provider}))
        })
        .collect();
    axum::Json(json!({"object": "list", "data": data}))
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    axum::Extension(request_id): axum::Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    // Recorded even when the client leaves before the answer (the guard's Drop).
    let mut trail = PendingTrail::new(Trail::start(
        state.audit.clone(),
        &request_id.0,
        state.metrics.clone(),
    ));
    let response = match serve_chat(&state, &request_id, &headers, body, trail.get()).await {
        Ok(Served::Stream(mut head, body)) => {
            *head.body_mut() = body.into_body(trail.take());
            return head;
        }
        Ok(Served::Whole(response)) => response,
        Err(error) => {
            if error.status.is_server_error() {
                tracing::warn!(request_id = %request_id.0, "{error}");
            } else {
                tracing::debug!(request_id = %request_id.0, "{error}");
            }
            error.into_response()
        }
    };
    record_whole(trail.take(), response).await
}

/// Appends the audit record of a request answered with one whole response,
/// then returns that response; if the record cannot be made durable, the
/// answer is withheld.
async fn record_whole(mut trail: Trail, response: Response) -> Response {
    let (parts, body) = response.into_parts();
    // Whole responses are built from bytes in memory: collecting cannot fail or block.
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    trail.sent(&bytes);
    let (outcome, action) = trail.conclude(parts.status);
    match trail.commit(outcome, action).await {
        Ok(()) => Response::from_parts(parts, Body::from(bytes)),
        Err(error) => {
            tracing::error!("audit append failed: {error}; the answer is withheld");
            let body = crate::verified::audit_failure_body().to_string();
            let mut response = (StatusCode::INTERNAL_SERVER_ERROR, body).into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
    }
}

/// What the chat path produced.
pub(crate) enum Served {
    /// A whole response: an answer or an error.
    Whole(Response),
    /// A stream: its head now; its body takes the trail, to record the end.
    Stream(Response, StreamBody),
}

/// The body of a streamed answer.
pub(crate) enum StreamBody {
    /// Relayed as is (`[verify] enabled = false`).
    Plain(Box<crate::relay::Relay>),
    /// Verified as it streams.
    Verified(Box<crate::verified::VerifiedStream>),
}

impl StreamBody {
    fn into_body(self, trail: Trail) -> Body {
        match self {
            StreamBody::Plain(relay) => relay.into_body(trail),
            StreamBody::Verified(stream) => crate::verified::streaming_body(stream, trail),
        }
    }
}

async fn serve_chat(
    state: &AppState,
    request_id: &RequestId,
    headers: &HeaderMap,
    body: Body,
    trail: &mut Trail,
) -> Result<Served, ApiError> {
    let limits = &state.policy.limits;
    let mut permit = Some(
        state
            .slots
            .clone()
            .try_acquire_owned()
            .map_err(|_| ApiError::overloaded(limits.max_concurrent_requests))?,
    );

    let caller = state.auth.authenticate(headers)?;
    trail.session = Some(caller.session_id.clone());
    trail.credential = Some(caller.credential_hash.clone());
    let bytes = read_body(headers, body, limits.max_body_bytes).await?;
    trail.request_body(&bytes);
    let mut request = ChatRequest::parse(&bytes)?;
    let model = request.model.clone();
    trail.model = Some(model.clone());
    let route = state
        .policy
        .route(&model)
        .ok_or_else(|| ApiError::model_not_found(&model))?;
    trail.provider = Some(route.provider.to_owned());
    let renamed = route.upstream_model != request.model;
    if renamed {
        request.body["model"] = json!(route.upstream_model);
    }
    let exchange = Exchange {
        session_header: HeaderValue::from_str(&caller.session_id)
            .map_err(|_| ApiError::internal("session id is not header text"))?,
        state,
        upstream: &state.upstreams[route.provider_index],
        caller,
        request_id: request_id.0.clone(),
        client_headers: headers,
        upstream_model: route.upstream_model,
        local_model: route.local_model,
    };

    if let Some(served) =
        preflight(&exchange, &request, bytes.len(), &route, trail, &mut permit).await?
    {
        return Ok(served);
    }
    let served = if state.policy.verify.enabled {
        crate::verified::serve(&exchange, request, &bytes, trail, &mut permit).await
    } else {
        serve_plain(
            &exchange,
            &request,
            bytes.clone(),
            renamed,
            trail,
            &mut permit,
        )
        .await
    };
    if state.local.is_some()
        && state.policy.local.on_upstream_unavailable()
        && provider_unavailable(&served)
    {
        if let Err(error) = &served {
            tracing::warn!(request_id = %request_id.0, "{error}; serving locally");
        }
        return crate::local::serve(
            &exchange,
            &exchange.reparse(&bytes)?,
            route.local_model,
            LocalReason::UpstreamUnavailable,
            trail,
            &mut permit,
        )
        .await;
    }
    served
}

/// Whether the provider could not serve at all: unreachable, timed out
/// before its first byte, or answered 5xx (nothing reached the client).
fn provider_unavailable(served: &Result<Served, ApiError>) -> bool {
    match served {
        Err(error) => matches!(
            error.code,
            "upstream_unreachable" | "upstream_timeout" | "upstream_error"
        ),
        Ok(Served::Whole(response)) => {
            response.status().is_server_error()
                && response.extensions().get::<ProviderError>().is_some()
        }
        Ok(Served::Stream(..)) => false,
    }
}

/// Marks a response that passes a provider's own error on.
#[derive(Debug, Clone, Copy)]
struct ProviderError;

/// The context preflight: a request over the provider's trusted limit is
/// served locally or rejected, before anything is sent upstream.
async fn preflight(
    exchange: &Exchange<'_>,
    request: &ChatRequest,
    body_len: usize,
    route: &ResolvedRoute<'_>,
    trail: &mut Trail,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> Result<Option<Served>, ApiError> {
    let state = exchange.state;
    let probed = state
        .probes
        .get(route.provider, route.upstream_model)
        .map(|result| result.effective_limit_tokens);
    let limit = trusted_limit(route.context_window, probed, route.max_context_tokens);
    // No count can exceed the body's length in bytes (every token, ours or a
    // tokenizer's, covers at least one byte of it): most requests fit
    // without counting.
    let at_most = ContextDemand::new(
        body_len as u64,
        request.max_tokens(),
        state.policy.verify.enabled,
    );
    if at_most.fits(limit) {
        return Ok(None);
    }
    let messages = request.messages();
    let prompt_tokens = exchange.upstream.prompt_tokens(messages);
    let demand = ContextDemand::new(
        prompt_tokens,
        request.max_tokens(),
        state.policy.verify.enabled,
    );
    if demand.fits(limit) {
        return Ok(None);
    }
    trail.prompt_tokens_ours = Some(prompt_tokens);
    trail.extra_checks.push(CheckRecord {
        name: "context_claim".into(),
        result: CheckResult::Fail,
        evidence: json!({
            "reason": "prompt plus max_tokens exceed the provider's trusted context",
            "seen": {"demand": demand, "limit": limit, "advertised": route.context_window,
                     "probed": probed, "cap": route.max_context_tokens},
        }),
    });
    let over = format!(
        "This request needs {} tokens ({} in the prompt with canarygate's additions, {} to \
         generate), more than the {} tokens provider `{}` is trusted with for `{}` ({}).",
        demand.total(),
        demand.prompt_tokens,
        demand.completion_tokens,
        limit.tokens,
        route.provider,
        route.upstream_model,
        limit.source.name()
    );
    match state.policy.local.untrusted_context() {
        UntrustedContext::Local if state.local.is_some() => crate::local::serve(
            exchange,
            request,
            route.local_model,
            LocalReason::UntrustedContext,
            trail,
            permit,
        )
        .await
        .map(Some),
        _ => Err(ApiError {
            param: Some("messages"),
            ..ApiError::invalid_request(
                "context_length_exceeded",
                format!("{over} Shorten the messages or lower max_tokens."),
            )
        }),
    }
}

/// The plain proxy (`[verify] enabled = false`): the client's bytes go
/// upstream untouched unless the model name changes.
async fn serve_plain(
    exchange: &Exchange<'_>,
    request: &ChatRequest,
    bytes: Bytes,
    renamed: bool,
    trail: &mut Trail,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> Result<Served, ApiError> {
    trail.prompt_tokens_ours = Some(canarygate_policies::tokens::count_chat_messages(
        request.messages(),
    ));
    let upstream_body = if renamed {
        Bytes::from(serde_json::to_vec(&request.body).map_err(|error| {
            ApiError::internal(format!("re-encoding the request failed: {error}"))
        })?)
    } else {
        bytes
    };
    let sent_at = std::time::Instant::now();
    trail.forwarded = true;
    let response = exchange
        .send(&mut trail.clock, upstream_body, request.stream)
        .await?;
    trail.ttfb_ms = Some(sent_at.elapsed().as_millis() as u64);
    let status = response.status();
    if status.is_success() && request.stream && is_event_stream(&response) {
        let permit = permit
            .take()
            .ok_or_else(|| ApiError::internal("the request's concurrency slot is gone"))?;
        let relay = relay_sse(
            response,
            exchange.upstream.name.clone(),
            exchange.idle_timeout(),
            permit,
        );
        let head = exchange.event_stream_response(Body::empty(), None);
        return Ok(Served::Stream(head, StreamBody::Plain(Box::new(relay))));
    }

    let body = read_upstream_body(
        &mut trail.clock,
        response,
        &exchange.upstream.name,
        exchange.idle_timeout(),
    )
    .await?;
    if !status.is_success() {
        return Ok(Served::Whole(
            exchange.upstream_error_response(status, body),
        ));
    }
    /// Just `usage.prompt_tokens` of an answer; the rest is skipped unparsed.
    #[derive(serde::Deserialize)]
    struct UsageOnly {
        usage: Option<PromptTokens>,
    }
    #[derive(serde::Deserialize)]
    struct PromptTokens {
        prompt_tokens: Option<u64>,
    }
    if let Ok(answer) = serde_json::from_slice::<UsageOnly>(&body) {
        trail.prompt_tokens_provider = answer.usage.and_then(|usage| usage.prompt_tokens);
    }
    Ok(Served::Whole(exchange.json_response(
        status,
        Body::from(body),
        None,
    )))
}

/// One chat request on its way to a provider: what both the plain and the
/// verified path need.
pub(crate) struct Exchange<'a> {
    pub(crate) state: &'a AppState,
    pub(crate) upstream: &'a Upstream,
    pub(crate) caller: crate::identity::Caller,
    pub(crate) request_id: Arc<str>,
    client_headers: &'a HeaderMap,
    session_header: HeaderValue,
    /// `model` sent upstream.
    upstream_model: &'a str,
    /// `model` reported if the local engine answers.
    pub(crate) local_model: &'a str,
}

impl Exchange<'_> {
    /// The client's request parsed again from the bytes received, with the
    /// model renamed for the provider (retries and fallbacks).
    pub(crate) fn reparse(&self, original: &Bytes) -> Result<ChatRequest, ApiError> {
        let mut request = ChatRequest::parse(original)?;
        if request.model != self.upstream_model {
            request.body["model"] = json!(self.upstream_model);
        }
        Ok(request)
    }

    /// The policy's idle timeout between upstream chunks.
    pub(crate) fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.state.policy.limits.idle_timeout_ms)
    }

    /// Sends `body` to the provider and waits (at most the first-byte
    /// timeout) for the response head.
    pub(crate) async fn send(
        &self,
        clock: &mut RequestClock,
        body: Bytes,
        stream: bool,
    ) -> Result<reqwest::Response, ApiError> {
        let upstream = self.upstream;
        let authorization = match upstream.managed_key() {
            Some(key) => key.clone(),
            None => self.caller.passthrough_authorization()?,
        };
        let mut outgoing = upstream
            .chat_completions()
            .header(header::AUTHORIZATION, authorization)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        for name in FORWARDED_HEADERS {
            if let Some(value) = self.client_headers.get(name) {
                outgoing = outgoing.header(name, value);
            }
        }
        if stream {
            outgoing = outgoing.header(header::ACCEPT, "text/event-stream");
        }
        let limit_ms = self.state.policy.limits.first_byte_timeout_ms;
        match clock
            .wait(tokio::time::timeout(
                Duration::from_millis(limit_ms),
                outgoing.send(),
            ))
            .await
        {
            Err(_) => Err(ApiError::gateway_timeout(format!(
                "Provider `{}` sent no response within {limit_ms} ms (limits.first_byte_timeout_ms).",
                upstream.name
            ))),
            Ok(Err(error)) => Err(send_error(&upstream.name, &error)),
            Ok(Ok(response)) => Ok(response),
        }
    }

    /// A JSON response carrying the session (and verdict, when known) headers.
    pub(crate) fn json_response(
        &self,
        status: StatusCode,
        body: Body,
        verdict: Option<&str>,
    ) -> Response {
        let mut response = Response::new(body);
        *response.status_mut() = status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        self.tag(&mut response, verdict);
        response
    }

    /// A `text/event-stream` response carrying the session (and verdict) headers.
    pub(crate) fn event_stream_response(&self, body: Body, verdict: Option<&str>) -> Response {
        let mut response = Response::new(body);
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        self.tag(&mut response, verdict);
        response
    }

    /// `error` as a response carrying the session header.
    pub(crate) fn error_response(&self, error: ApiError, verdict: Option<&str>) -> Response {
        let mut response = error.into_response();
        self.tag(&mut response, verdict);
        response
    }

    fn tag(&self, response: &mut Response, verdict: Option<&str>) {
        let headers = response.headers_mut();
        headers.insert(
            HeaderName::from_static(SESSION_ID_HEADER),
            self.session_header.clone(),
        );
        headers.insert(
            HeaderName::from_static(crate::local::SERVED_BY_HEADER),
            HeaderValue::from_static("upstream"),
        );
        if let Some(value) = verdict.and_then(|v| HeaderValue::from_str(v).ok()) {
            headers.insert(HeaderName::from_static(VERDICT_HEADER), value);
        }
    }

    /// Passes a provider error through when it is in OpenAI's format, and wraps it otherwise.
    pub(crate) fn upstream_error_response(&self, status: StatusCode, body: Bytes) -> Response {
        let is_openai_error = serde_json::from_slice::<serde_json::Value>(&body)
            .is_ok_and(|value| value.get("error").is_some_and(serde_json::Value::is_object));
        let body = if is_openai_error {
            body
        } else {
            let excerpt: String = String::from_utf8_lossy(&body).chars().take(200).collect();
            Bytes::from(
                crate::error::error_body(
                    &format!(
                        "Provider `{}` answered HTTP {}: {excerpt}",
                        self.upstream.name,
                        status.as_u16()
                    ),
                    "upstream_error",
                    "upstream_http_error",
                    None,
                )
                .to_string(),
            )
        };
        let mut response = self.json_response(status, Body::from(body), None);
        response.extensions_mut().insert(ProviderError);
        response
    }
}

/// Whether the provider answered with an SSE stream.
pub(crate) fn is_event_stream(response: &reqwest::Response) -> bool {
    response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("text/event-stream"))
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
            ApiError::invalid_request(
                "invalid_body",
                format!("Could not read the request body: {}", error_chain(&error)),
            )
        }
    })
}

/// Reads a whole (non-streamed) upstream body with the idle timeout between chunks.
pub(crate) async fn read_upstream_body(
    clock: &mut RequestClock,
    response: reqwest::Response,
    provider: &str,
    idle_timeout: Duration,
) -> Result<Bytes, ApiError> {
    let mut stream = response.bytes_stream();
    let mut body = Vec::new();
    loop {
        match clock
            .wait(tokio::time::timeout(idle_timeout, stream.next()))
            .await
        {
            Err(_) => {
                return Err(ApiError::gateway_timeout(format!(
                    "Provider `{provider}` stopped sending its answer for {} ms \
                     (limits.idle_timeout_ms).",
                    idle_timeout.as_millis()
                )));
            }
            Ok(None) => return Ok(Bytes::from(body)),
            Ok(Some(Err(error))) => {
                return Err(ApiError::bad_gateway(
                    "upstream_error",
                    format!(
                        "Provider `{provider}` failed while sending its answer: {}",
                        error_chain(&error)
                    ),
                ));
            }
            Ok(Some(Ok(chunk))) => {
                if body.len() + chunk.len() > MAX_UPSTREAM_BODY {
                    return Err(ApiError::bad_gateway(
                        "upstream_response_too_large",
                        format!("Provider `{provider}` sent more than {MAX_UPSTREAM_BODY} bytes."),
                    ));
                }
                body.extend_from_slice(&chunk);
            }
        }
    }
}
