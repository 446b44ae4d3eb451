//! One client request on its way: who sent it, where its route leads, and
//! the responses it is answered with (every one tagged with the session and
//! who served it).

use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::Response;
use canarygate_policies::EchoCost;
use canarygate_policies::config::ResolvedRoute;
use canarygate_policies::inject::SystemRole;

use crate::clock::RequestClock;
use crate::error::{ApiError, ErrorCode};
use crate::identity::Caller;
use crate::state::AppState;
use crate::upstream::{ANTHROPIC_VERSION_HEADER, Upstream, relayed_headers, without_canary_text};
use crate::upstream_client::{BodyDeadlines, UpstreamRequest, UpstreamResponse};
use crate::wire::{ClientRequest, WireFormat};

/// Response header carrying the id of the request (also in the audit log).
pub const REQUEST_ID_HEADER: &str = "x-canarygate-request-id";

/// Response header carrying the caller's session id.
pub const SESSION_ID_HEADER: &str = "x-canarygate-session";

/// Response header carrying the verification verdict.
pub const VERDICT_HEADER: &str = "x-canarygate-verdict";

/// Response header naming who answered: `upstream` or `local`.
pub const SERVED_BY_HEADER: &str = "x-canarygate-served-by";

/// Response header with canarygate's own tokens in the answer:
/// `prompt=41, completion=12` (a stream's head says `completion=pending`;
/// its last comment carries the number).
pub const OVERHEAD_HEADER: &str = "x-canarygate-overhead-tokens";

/// Response headers naming the provider's id for the request.
const PROVIDER_REQUEST_ID_HEADERS: [&str; 2] = ["x-request-id", "request-id"];

/// Marks a response that passes a provider's own error on.
#[derive(Debug, Clone, Copy)]
pub struct ProviderError;

/// Whose answer a response is: the provider's (its answer or its error,
/// passed on) or canarygate's own error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Speaker {
    Provider,
    Canarygate,
}

/// The provider's word on whether to retry its answer (the SDKs obey it).
const SHOULD_RETRY_HEADER: &str = "x-should-retry";

/// A request canarygate accepted, in wire format `W`: what every path needs.
pub struct RequestContext<'a, W> {
    /// Shared state.
    pub state: &'a AppState,
    /// The provider the route leads to.
    pub upstream: &'a Upstream,
    /// Who sent it.
    pub caller: Caller,
    /// Its id.
    pub request_id: Arc<str>,
    /// `model` reported if the local engine answers.
    pub local_model: &'a str,
    client_headers: &'a HeaderMap,
    /// The client's query string, passed on with every provider request.
    client_query: Option<&'a str>,
    session_header: HeaderValue,
    /// `model` sent upstream.
    upstream_model: &'a str,
    /// What an echo costs the provider for that model.
    echo_cost: EchoCost,
    /// What of the provider's last response head the client gets
    /// ([`relayed_headers`]): rate limits, retry hints, its request id.
    provider_headers: Mutex<HeaderMap>,
    wire: PhantomData<W>,
}

impl<'a, W: WireFormat> RequestContext<'a, W> {
    /// The context of a request from `caller` with `headers` and `query`,
    /// routed by `route`.
    pub fn new(
        state: &'a AppState,
        caller: Caller,
        request_id: Arc<str>,
        headers: &'a HeaderMap,
        query: Option<&'a str>,
        route: &ResolvedRoute<'a>,
    ) -> Result<Self, ApiError> {
        let upstream = state.upstreams.at(route.provider_index);
        Ok(Self {
            session_header: HeaderValue::from_str(&caller.session_id)
                .map_err(|_| ApiError::internal("session id is not header text"))?,
            state,
            upstream,
            caller,
            request_id,
            local_model: route.local_model,
            client_headers: headers,
            client_query: query,
            upstream_model: route.upstream_model,
            echo_cost: upstream.echo_cost(route.upstream_model),
            provider_headers: Mutex::new(HeaderMap::new()),
            wire: PhantomData,
        })
    }

    /// The client's request parsed again from the bytes received, with the
    /// model renamed for the provider (retries and fallbacks).
    pub fn reparse(&self, original: &Bytes) -> Result<ClientRequest, ApiError> {
        let mut request = W::parse_request(original)?;
        if request.model != self.upstream_model {
            W::set_model(&mut request.body, self.upstream_model);
        }
        Ok(request)
    }

    /// What an echo costs the provider for the model this request goes to.
    pub fn echo_cost(&self) -> EchoCost {
        self.echo_cost
    }

    /// Whether the model this request goes to takes a system message.
    pub fn system_role(&self) -> SystemRole {
        self.upstream.system_role(self.upstream_model)
    }

    /// Remembers that the provider refused the system message canarygate
    /// added for the model this request goes to.
    pub fn remember_system_refused(&self) {
        self.upstream.remember_system_refused(self.upstream_model);
    }

    /// The policy's idle timeout between upstream chunks.
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.state.policy.limits.idle_timeout_ms)
    }

    /// How long reading a whole answer may take: the idle timeout between
    /// its chunks, the first-byte timeout for all of it from its head.
    pub fn body_deadlines(&self) -> BodyDeadlines {
        BodyDeadlines {
            idle: self.idle_timeout(),
            whole: Duration::from_millis(self.state.policy.limits.first_byte_timeout_ms),
        }
    }

    /// Sends `body` to the provider and waits (at most the first-byte
    /// timeout) for the response head; the wait counts on `clock`.
    pub async fn send(
        &self,
        clock: &mut RequestClock,
        body: Bytes,
        stream: bool,
    ) -> Result<UpstreamResponse, ApiError> {
        let url = self.endpoint_url(W::PATH)?;
        let outgoing = self.outgoing(Method::POST, url, Some(body), stream)?;
        self.send_request(clock, outgoing).await
    }

    /// The provider's URL of `endpoint` (relative to its `base_url`), with
    /// the client's query string.
    pub fn endpoint_url(&self, endpoint: &str) -> Result<Uri, ApiError> {
        match self.client_query {
            Some(query) => self.upstream.endpoint_url(&format!("{endpoint}?{query}")),
            None => self.upstream.endpoint_url(endpoint),
        }
    }

    /// Sends `outgoing` (built by [`RequestContext::outgoing`]) and waits,
    /// as [`RequestContext::send`] does, for the response head.
    pub async fn send_request(
        &self,
        clock: &mut RequestClock,
        outgoing: UpstreamRequest,
    ) -> Result<UpstreamResponse, ApiError> {
        let upstream = self.upstream;
        let limit_ms = self.state.policy.limits.first_byte_timeout_ms;
        match clock
            .wait(tokio::time::timeout(
                Duration::from_millis(limit_ms),
                upstream.send(outgoing),
            ))
            .await
        {
            Err(_) => Err(ApiError::new(
                ErrorCode::UpstreamTimeout,
                format!(
                    "Provider `{}` sent no response within {limit_ms} ms \
                     (limits.first_byte_timeout_ms).",
                    upstream.name
                ),
            )),
            Ok(Err(error)) => Err(upstream.send_error(&error)),
            Ok(Ok(response)) => {
                *self.provider_headers() = relayed_headers(response.headers());
                // An error keeps its status and retry hints, whatever its
                // body; an answer canarygate cannot read is refused.
                if let Some(coding) = response
                    .headers()
                    .get(header::CONTENT_ENCODING)
                    .filter(|coding| !coding.as_bytes().eq_ignore_ascii_case(b"identity"))
                    .filter(|_| response.status().is_success())
                {
                    let coding = String::from_utf8_lossy(coding.as_bytes()).into_owned();
                    return Err(ApiError::new(
                        ErrorCode::UpstreamError,
                        format!(
                            "Provider `{}` answered with Content-Encoding `{coding}` although \
                             canarygate asked for none (Accept-Encoding: identity).",
                            upstream.name,
                        ),
                    ));
                }
                Ok(response)
            }
        }
    }

    /// `method` on the provider's `url` with `body`, the key (managed, or
    /// the caller's) and the client's headers that format `W` passes on.
    pub fn outgoing(
        &self,
        method: Method,
        url: Uri,
        body: Option<Bytes>,
        stream: bool,
    ) -> Result<UpstreamRequest, ApiError> {
        let key = match self.upstream.managed_key() {
            Some(key) => key.clone(),
            None => self.caller.passthrough_key()?,
        };
        // A retry's answer is about the retry only.
        self.forget_provider_headers();
        let mut outgoing = self.upstream.request(method, url, body, Some(&key), stream);
        let headers = outgoing.headers_mut();
        for name in W::FORWARDED_HEADERS {
            if let Some(value) = self.client_headers.get(*name) {
                headers.append(*name, value.clone());
            }
        }
        if !self.client_headers.contains_key(ANTHROPIC_VERSION_HEADER) {
            // Anthropic's API requires a version; its SDKs always send one.
            headers.extend(self.upstream.api_headers());
        }
        Ok(outgoing)
    }

    fn provider_headers(&self) -> std::sync::MutexGuard<'_, HeaderMap> {
        self.provider_headers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The provider's id for its last response to this request, if it sent one.
    pub fn provider_request_id(&self) -> Option<String> {
        let headers = self.provider_headers();
        PROVIDER_REQUEST_ID_HEADERS
            .iter()
            .find_map(|name| headers.get(*name)?.to_str().ok())
            .map(str::to_owned)
    }

    /// Stops passing the provider's headers on (the local engine answers).
    pub fn forget_provider_headers(&self) {
        self.provider_headers().clear();
    }

    /// A JSON response carrying the session (and verdict, when known) headers.
    pub fn json_response(&self, status: StatusCode, body: Body, verdict: Option<&str>) -> Response {
        let mut response = json_response(status, body);
        self.tag(&mut response, verdict, Speaker::Provider);
        response
    }

    /// A `text/event-stream` response head carrying the session (and verdict) headers.
    pub fn event_stream_response(&self, verdict: Option<&str>) -> Response {
        let mut response = Response::new(Body::empty());
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        self.tag(&mut response, verdict, Speaker::Provider);
        response
    }

    /// `error` as a response carrying the session header.
    pub fn error_response(&self, error: &ApiError, verdict: Option<&str>) -> Response {
        let mut response = error_response::<W>(error);
        self.tag(&mut response, verdict, Speaker::Canarygate);
        response
    }

    /// The provider's error answer: passed on when it is in the client's
    /// format, wrapped otherwise; marked [`ProviderError`].
    pub fn provider_error_response(&self, status: StatusCode, body: Bytes) -> Response {
        // What it quotes of the request is withheld: the key it was sent,
        // and canary-shaped text (it may quote another session's prompt).
        let body = self.withheld(body, "the credential it was sent", |body| {
            self.caller
                .without_credentials(body, self.upstream.managed_key())
        });
        let body = self.withheld(body, "canary-shaped text", without_canary_text);
        let mut response = if W::is_error_body(&body) {
            json_response(status, Body::from(body))
        } else {
            error_response::<W>(&self.upstream.wrapped_error(status, &body))
        };
        self.tag(&mut response, None, Speaker::Provider);
        response.extensions_mut().insert(ProviderError);
        response
    }

    /// The provider's error `body` less what `withhold` takes out of it
    /// (logged as its quoting `what`).
    fn withheld(
        &self,
        body: Bytes,
        what: &str,
        withhold: impl FnOnce(&[u8]) -> Option<Vec<u8>>,
    ) -> Bytes {
        match withhold(&body) {
            Some(withheld) => {
                tracing::warn!(
                    request_id = %self.request_id,
                    provider = %self.upstream.name,
                    "the provider's error quoted {what}: withheld"
                );
                Bytes::from(withheld)
            }
            None => body,
        }
    }

    /// Adds the provider's relayed headers (those the response lacks), the
    /// session and served-by headers, and the verdict. The provider's
    /// `x-should-retry` speaks of its own answer: not of an error of
    /// canarygate's (a blocked answer, a broken stream), which SDKs retry by
    /// their own rule.
    fn tag(&self, response: &mut Response, verdict: Option<&str>, speaker: Speaker) {
        let headers = response.headers_mut();
        for (name, value) in self.provider_headers().iter() {
            let not_about_this = speaker == Speaker::Canarygate && name == SHOULD_RETRY_HEADER;
            if not_about_this || headers.contains_key(name) {
                continue;
            }
            headers.append(name.clone(), value.clone());
        }
        headers.insert(
            HeaderName::from_static(SESSION_ID_HEADER),
            self.session_header.clone(),
        );
        headers.insert(
            HeaderName::from_static(SERVED_BY_HEADER),
            HeaderValue::from_static("upstream"),
        );
        if let Some(value) = verdict.and_then(|v| HeaderValue::from_str(v).ok()) {
            headers.insert(HeaderName::from_static(VERDICT_HEADER), value);
        }
    }
}

/// A JSON response.
pub fn json_response(status: StatusCode, body: Body) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// `error` in wire format `W`, at its status. canarygate's own 429 says
/// when to come back (`retry-after: 1`), as providers' do: the SDKs wait
/// that long instead of their own backoff.
pub fn error_response<W: WireFormat>(error: &ApiError) -> Response {
    let mut response = json_response(error.status(), Body::from(W::error_body(error)));
    if error.code == ErrorCode::TooManyConcurrentRequests {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}
