//! The verified path: canaries in, verdict out.
//!
//! Per upstream attempt: mint two canaries, place them in the request
//! ([`canarygate_policies::inject`]), register them, send, feed every piece of
//! the answer to a [`Verifier`], and act on its verdict (deliver, flag, retry
//! once, block).
//!
//! Streams are driven by the handler until the first verified byte can go out
//! (`echo-first`) or until the verdict (`verdict-first`): so a failed echo, or
//! any failure under verdict-first, is answered with a plain HTTP 502 and no
//! byte of the suspect answer. After that the rest is relayed from the
//! response body, the events of each burst in one write (see
//! [`crate::relay`]), and a later failure ends the stream with an
//! explicit error event. The client's chunks are rebuilt from the verified
//! text (the echo and our canaries removed), keeping the provider's `id`,
//! `created` and `model`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::Response;
use canarygate_policies::inject::{InjectError, Injection, RequestCanaries, inject};
use canarygate_policies::registry::{MemoryRegistry, Registration};
use canarygate_policies::sse::{SseEvent, SseParser, encode_data};
use canarygate_policies::verify::{Decision, Facts, Finished, Usage, Verdict, Verifier};
use canarygate_policies::verify_config::{Action, ReleasePolicy, VerifyConfig};
use futures_util::{Stream, StreamExt};
use serde_json::{Map, Value, json};
use tokio::sync::OwnedSemaphorePermit;

use crate::audit::{Action as AuditAction, CanaryEntry, Outcome};
use crate::clock::RequestClock;
use crate::error::{ApiError, error_body, error_chain};
use crate::local::LocalReason;
use crate::relay::{COALESCE_BYTES, STREAM_INTERRUPTED, early_end, next_ready};
use crate::request::ChatRequest;
use crate::server::{Exchange, Served, StreamBody, is_event_stream, read_upstream_body};
use crate::trail::Trail;

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64)
}

/// `x-canarygate-verdict` of a stream whose verdict comes after the head;
/// the final verdict is then sent as the SSE comment `: x-canarygate-verdict ...`
/// just before `[DONE]`.
const VERDICT_PENDING: &str = "pending; release=echo-first";

/// Serves one chat request on the verified path.
///
/// `request` is the client's request (model renamed for the provider); its
/// body gets the canaries in place. `original` is the body as received: a
/// retry or a local fallback parses it again rather than every request
/// paying for a deep copy.
pub(crate) async fn serve(
    exchange: &Exchange<'_>,
    request: ChatRequest,
    original: &Bytes,
    trail: &mut Trail,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> Result<Served, ApiError> {
    let config = &exchange.state.policy.verify;
    let mut unused = Some(request);
    for attempt in 0..2 {
        let mut body = match unused.take() {
            Some(request) => request.body,
            None => exchange.reparse(original)?.body,
        };
        let injection = inject_registered(exchange, &mut body, config, trail)?;
        let messages = body["messages"].as_array().map_or(&[][..], Vec::as_slice);
        let exact_prompt_tokens = exchange.upstream.count_prompt_tokens(messages);
        trail.prompt_tokens_ours =
            Some(exact_prompt_tokens.unwrap_or(injection.prompt_tokens_estimate));
        let bytes = Bytes::from(serde_json::to_vec(&body).map_err(|error| {
            ApiError::internal(format!("re-encoding the request failed: {error}"))
        })?);
        let verifier = Verifier::new(
            &injection,
            config,
            &exchange.upstream.name,
            exact_prompt_tokens,
        );
        let sent_at = Instant::now();
        trail.forwarded = true;
        let response = exchange
            .send(&mut trail.clock, bytes, injection.stream)
            .await?;
        trail.ttfb_ms = Some(elapsed_ms(sent_at));
        let status = response.status();
        if !status.is_success() {
            let body = read_upstream_body(
                &mut trail.clock,
                response,
                &exchange.upstream.name,
                exchange.idle_timeout(),
            )
            .await?;
            return Ok(Served::Whole(
                exchange.upstream_error_response(status, body),
            ));
        }
        let attempt_state = Attempt {
            injection,
            verifier,
            sent_at,
            attempt,
        };
        if attempt_state.injection.stream && is_event_stream(&response) {
            let mut stream = VerifiedStream::new(exchange, response, attempt_state);
            let driven = stream.drive_to_release(&mut trail.clock).await;
            stream.fill(trail);
            match driven {
                Driven::Retry => {}
                Driven::Fallback => return fall_back(exchange, original, trail, permit).await,
                Driven::Blocked => {
                    let verdict = stream.verdict.as_ref().expect("a block has a verdict");
                    return Ok(Served::Whole(blocked(exchange, verdict)));
                }
                Driven::Failed(error) => {
                    trail.outcome = Some(Outcome::InterruptedByUpstream);
                    return Ok(Served::Whole(exchange.error_response(error, None)));
                }
                Driven::Stream(verdict) => {
                    stream.permit = permit.take();
                    let head = exchange.event_stream_response(Body::empty(), Some(&verdict));
                    return Ok(Served::Stream(head, StreamBody::Verified(Box::new(stream))));
                }
            }
        } else {
            match complete(exchange, response, attempt_state, trail).await? {
                Completed::Answer(response) => return Ok(Served::Whole(response)),
                Completed::Retry => {}
                Completed::Fallback => return fall_back(exchange, original, trail, permit).await,
            }
        }
        tracing::warn!(
            request_id = %exchange.request_id,
            "verification failed; retrying upstream once with fresh canaries"
        );
    }
    Err(ApiError::internal(
        "verification retry loop ended without a decision",
    ))
}

/// Serves the request from the local engine after the provider's answer
/// failed verification, before any of it reached the client.
async fn fall_back(
    exchange: &Exchange<'_>,
    original: &Bytes,
    trail: &mut Trail,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> Result<Served, ApiError> {
    let request = exchange.reparse(original)?;
    tracing::warn!(
        request_id = %exchange.request_id,
        provider = %exchange.upstream.name,
        "verification failed; serving the request from the local engine"
    );
    crate::local::serve(
        exchange,
        &request,
        exchange.local_model,
        LocalReason::VerificationFailed,
        trail,
        permit,
    )
    .await
}

/// One upstream attempt's verification state.
struct Attempt {
    injection: Injection,
    verifier: Verifier,
    sent_at: Instant,
    /// Attempts before this one.
    attempt: u32,
}

fn inject_error(error: InjectError) -> ApiError {
    match error {
        InjectError::BadChoiceCount => ApiError::invalid_param("n", error.to_string()),
        InjectError::NotAnObject | InjectError::NoMessages | InjectError::BadMessage(_) => {
            ApiError::invalid_param("messages", error.to_string())
        }
    }
}

/// Mints this attempt's canaries, registered as this request's (values
/// already live are refused and drawn again, so they are unique), and places
/// them into `body`. Registered in memory at once, and in the audit store
/// with the next group commit (not awaited: a crash in the next few
/// milliseconds forgets them; the record's canary ids still name them).
fn inject_registered(
    exchange: &Exchange<'_>,
    body: &mut Value,
    config: &VerifyConfig,
    trail: &mut Trail,
) -> Result<Injection, ApiError> {
    let state = exchange.state;
    let expires_at_ms = now_ms().saturating_add(config.canary_ttl_secs.saturating_mul(1000));
    let registration = Registration {
        session: exchange.caller.session_id.clone(),
        request: exchange.request_id.to_string(),
        expires_at_ms,
    };
    let (canaries, keys) = RequestCanaries::mint_registered(&state.registry, &registration)
        .map_err(|error| ApiError::internal(format!("no OS randomness: {error}")))?;
    let injection = match inject(body, config.echo, canaries) {
        Ok(injection) => injection,
        Err(error) => {
            state.registry.remove(&canaries.head);
            state.registry.remove(&canaries.tail);
            return Err(inject_error(error));
        }
    };
    let mut entries = Vec::with_capacity(2);
    for key in keys {
        trail.canary_ids.push(hex::encode(key.0));
        entries.push(CanaryEntry {
            key,
            session: exchange.caller.session_id.clone(),
            request_id: exchange.request_id.to_string(),
            expires_at_ms,
        });
    }
    if let Err(error) = state.audit.register_canaries_soon(entries) {
        tracing::warn!("persisting canaries: {error}");
    }
    Ok(injection)
}

fn elapsed_ms(since: Instant) -> u64 {
    since.elapsed().as_millis().try_into().unwrap_or(u64::MAX)
}

fn usage_of(value: &Value) -> Option<Usage> {
    let usage = value.get("usage")?;
    Some(Usage {
        prompt_tokens: usage.get("prompt_tokens")?.as_u64()?,
        completion_tokens: usage.get("completion_tokens").and_then(Value::as_u64),
    })
}

fn blocked(exchange: &Exchange<'_>, verdict: &Verdict) -> Response {
    tracing::warn!(
        request_id = %exchange.request_id,
        provider = %exchange.upstream.name,
        verdict = %verdict.header_value(),
        "answer blocked"
    );
    exchange.json_response(
        StatusCode::BAD_GATEWAY,
        Body::from(verdict.error_body().to_string()),
        Some(&verdict.header_value()),
    )
}

/// What became of a non-streamed answer.
enum Completed {
    /// Answer the client with this (the verified answer, or the block).
    Answer(Response),
    /// Discard it and try upstream again.
    Retry,
    /// Discard it and serve from the local engine.
    Fallback,
}

/// A non-streamed answer: read whole, verify, rewrite.
async fn complete(
    exchange: &Exchange<'_>,
    response: reqwest::Response,
    mut attempt: Attempt,
    trail: &mut Trail,
) -> Result<Completed, ApiError> {
    let registry = &*exchange.state.registry;
    let stop = attempt.verifier.observe_ttft(elapsed_ms(attempt.sent_at));
    let status = response.status();
    let bytes = read_upstream_body(
        &mut trail.clock,
        response,
        &exchange.upstream.name,
        exchange.idle_timeout(),
    )
    .await?;
    let mut answer: Value = serde_json::from_slice(&bytes).map_err(|error| {
        ApiError::bad_gateway(
            "upstream_invalid_json",
            format!(
                "Provider `{}` answered with invalid JSON: {error}",
                exchange.upstream.name
            ),
        )
    })?;

    let mut finish_reasons = Vec::new();
    if !stop && let Some(choices) = answer.get("choices").and_then(Value::as_array) {
        for (position, choice) in choices.iter().enumerate() {
            let index = choice_index(choice, position);
            let message = &choice["message"];
            if let Some(content) = message.get("content").and_then(Value::as_str) {
                attempt.verifier.push(index, content, registry);
            }
            if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
                for (call_index, call) in calls.iter().enumerate() {
                    if let Some(arguments) =
                        call.pointer("/function/arguments").and_then(Value::as_str)
                    {
                        attempt.verifier.push_tool_arguments(
                            index,
                            call_index as u32,
                            arguments,
                            registry,
                        );
                    }
                }
            }
            set_reason(&mut finish_reasons, index, choice.get("finish_reason"));
        }
    }
    let finished = attempt.verifier.finish(
        &Facts {
            finish_reasons,
            usage: usage_of(&answer),
            done_marker: None,
        },
        registry,
    );
    let verdict = &finished.verdict;
    trail.verdict(verdict);
    trail.prompt_tokens_provider = usage_of(&answer).map(|usage| usage.prompt_tokens);
    let config = &exchange.state.policy.verify;
    match verdict.decide(config.action(), attempt.attempt, false) {
        Decision::Retry => Ok(Completed::Retry),
        Decision::Fallback => Ok(Completed::Fallback),
        Decision::Block => Ok(Completed::Answer(blocked(exchange, verdict))),
        Decision::Deliver | Decision::Flag => {
            if let Some(choices) = answer.get_mut("choices").and_then(Value::as_array_mut) {
                for (position, choice) in choices.iter_mut().enumerate() {
                    let index = choice_index(choice, position) as usize;
                    let message = &mut choice["message"];
                    if message.get("content").is_some_and(Value::is_string) {
                        message["content"] =
                            Value::String(finished.release.get(index).cloned().unwrap_or_default());
                    }
                }
            }
            for tool in &finished.tool_arguments {
                let pointer = format!(
                    "/choices/{}/message/tool_calls/{}/function/arguments",
                    tool.choice, tool.tool_call
                );
                if let Some(slot) = answer.pointer_mut(&pointer) {
                    *slot = Value::String(tool.arguments.clone());
                }
            }
            Ok(Completed::Answer(exchange.json_response(
                status,
                Body::from(answer.to_string()),
                Some(&verdict.header_value()),
            )))
        }
    }
}

fn choice_index(choice: &Value, position: usize) -> u32 {
    choice
        .get("index")
        .and_then(Value::as_u64)
        .unwrap_or(position as u64)
        .min(u64::from(u32::MAX)) as u32
}

fn set_reason(reasons: &mut Vec<Option<String>>, index: u32, reason: Option<&Value>) {
    let index = index as usize;
    if reasons.len() <= index {
        reasons.resize(index + 1, None);
    }
    if let Some(reason) = reason.and_then(Value::as_str) {
        reasons[index] = Some(reason.to_owned());
    }
}

/// Result of driving a stream before answering the client.
enum Driven {
    /// The verdict failed before anything was released and the policy retries.
    Retry,
    /// The verdict failed before anything was released: serve locally.
    Fallback,
    /// The verdict failed before anything was released: HTTP 502.
    Blocked,
    /// The provider failed before anything was released.
    Failed(ApiError),
    /// Answer 200 and relay the rest; the string is the verdict header.
    Stream(String),
}

/// How a verified stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Delivered (possibly flagged), ending in `[DONE]`.
    Delivered,
    /// Failed verification with this decision (block or retry).
    Failed(Decision),
    /// The provider failed, stalled or closed early.
    Interrupted,
}

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// Identity of a tool call, from its first delta.
#[derive(Debug, Default)]
struct ToolCallHead {
    id: Option<Value>,
    kind: Option<Value>,
    name: Option<Value>,
}

/// A verified SSE relay (see the module docs).
pub(crate) struct VerifiedStream {
    upstream: ByteStream,
    parser: SseParser,
    attempt: Attempt,
    release: ReleasePolicy,
    action: Action,
    provider: String,
    idle_timeout: Duration,
    registry: Arc<MemoryRegistry>,
    /// `id`, `object`, `created`, `model`, `system_fingerprint` of upstream chunks.
    template: Map<String, Value>,
    /// [`Self::chunk_prefix`], once built.
    chunk_prefix: Vec<u8>,
    finish_reasons: Vec<Option<String>>,
    usage: Option<Value>,
    tool_calls: BTreeMap<(u32, u32), ToolCallHead>,
    /// Choices whose first chunk (with `role`) went out.
    role_sent: Vec<bool>,
    ttft_seen: bool,
    /// Bytes ready for the client.
    out: Vec<u8>,
    /// Whether any byte was handed to the client.
    committed: bool,
    /// The last bytes of the stream (`[DONE]` or an error event), sent only
    /// once the audit record is durable.
    tail: Option<Vec<u8>>,
    end: Option<End>,
    verdict: Option<Verdict>,
    interruption: Option<String>,
    /// The concurrency slot, released when the stream ends.
    permit: Option<OwnedSemaphorePermit>,
}

impl VerifiedStream {
    fn new(exchange: &Exchange<'_>, response: reqwest::Response, attempt: Attempt) -> Self {
        let config = &exchange.state.policy.verify;
        Self {
            upstream: Box::pin(response.bytes_stream()),
            parser: SseParser::new(),
            attempt,
            release: config.release,
            action: config.action(),
            provider: exchange.upstream.name.clone(),
            idle_timeout: exchange.idle_timeout(),
            registry: exchange.state.registry.clone(),
            template: Map::new(),
            chunk_prefix: Vec::new(),
            finish_reasons: Vec::new(),
            usage: None,
            tool_calls: BTreeMap::new(),
            role_sent: Vec::new(),
            ttft_seen: false,
            out: Vec::new(),
            committed: false,
            tail: None,
            end: None,
            verdict: None,
            interruption: None,
            permit: None,
        }
    }

    /// Reads upstream until the client can be answered: the first released
    /// bytes (echo-first), or the end (verdict-first, or any failure).
    async fn drive_to_release(&mut self, clock: &mut RequestClock) -> Driven {
        while self.end.is_none()
            && (self.release == ReleasePolicy::VerdictFirst || self.out.is_empty())
        {
            self.advance(clock).await;
        }
        if self.out.is_empty() && self.tail.is_none() {
            match self.end {
                Some(End::Failed(Decision::Retry)) => return Driven::Retry,
                Some(End::Failed(Decision::Fallback)) => return Driven::Fallback,
                Some(End::Failed(_)) if self.verdict.is_some() => return Driven::Blocked,
                Some(End::Interrupted) => {
                    let detail = self.interruption.take().unwrap_or_default();
                    return Driven::Failed(ApiError::bad_gateway(
                        STREAM_INTERRUPTED,
                        format!("Provider `{}` {detail}; no answer.", self.provider),
                    ));
                }
                _ => {}
            }
        }
        let header = match (&self.verdict, self.end) {
            (Some(verdict), Some(_)) => verdict.header_value(),
            _ => VERDICT_PENDING.to_owned(),
        };
        Driven::Stream(header)
    }

    /// The provider's `usage.prompt_tokens`, once its usage chunk arrived.
    fn provider_prompt_tokens(&self) -> Option<u64> {
        self.usage
            .as_ref()
            .and_then(|usage| usage.get("prompt_tokens"))
            .and_then(Value::as_u64)
    }

    /// How the exchange ended, for the audit record.
    fn conclusion(&self) -> (Outcome, AuditAction) {
        match self.end {
            Some(End::Delivered) => {
                let flagged = self.verdict.as_ref().is_some_and(|v| !v.passed());
                let action = if flagged {
                    AuditAction::Flag
                } else {
                    AuditAction::Forward
                };
                (Outcome::Complete, action)
            }
            Some(End::Failed(_)) => (Outcome::Complete, AuditAction::Block),
            Some(End::Interrupted) | None => (Outcome::InterruptedByUpstream, AuditAction::Forward),
        }
    }

    /// One upstream read and everything it completes.
    async fn advance(&mut self, clock: &mut RequestClock) {
        let next = clock
            .wait(tokio::time::timeout(
                self.idle_timeout,
                self.upstream.next(),
            ))
            .await;
        match next {
            Err(_) => self.interrupt(format!(
                "sent nothing for {} ms (limits.idle_timeout_ms)",
                self.idle_timeout.as_millis()
            )),
            Ok(next) => self.take(next),
        }
    }

    /// Takes what else the provider has already sent, until [`COALESCE_BYTES`]
    /// are ready for the client or nothing more is ready now. The yields to
    /// the provider's connection task count as waiting on the provider.
    async fn advance_ready(&mut self, clock: &mut RequestClock) {
        while self.end.is_none() && self.out.len() < COALESCE_BYTES {
            match next_ready(&mut self.upstream, clock).await {
                Some(next) => self.take(next),
                None => return,
            }
        }
    }

    /// Everything one upstream read completes, or the end of the stream.
    fn take(&mut self, next: Option<reqwest::Result<Bytes>>) {
        match next {
            None => {
                let detail = early_end(&mut self.parser);
                self.interrupt(detail.to_owned());
            }
            Some(Err(error)) => self.interrupt(format!("stream failed: {}", error_chain(&error))),
            Some(Ok(bytes)) => {
                let mut events = Vec::new();
                self.parser.feed(&bytes, &mut events);
                for event in events {
                    if self.end.is_some() {
                        break;
                    }
                    self.on_event(&event);
                }
            }
        }
    }

    fn on_event(&mut self, event: &SseEvent) {
        if event.is_done() {
            self.finalize(Some(true));
            return;
        }
        let chunk: Value = match serde_json::from_str(&event.data) {
            Ok(chunk) => chunk,
            Err(_) => return self.interrupt("sent an event that is not JSON".into()),
        };
        if let Some(error) = chunk.get("error") {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("no message");
            return self.interrupt(format!("sent an error mid-stream: {message}"));
        }
        if self.template.is_empty() {
            for field in ["id", "object", "created", "model", "system_fingerprint"] {
                if let Some(value) = chunk.get(field) {
                    self.template.insert(field.to_owned(), value.clone());
                }
            }
        }
        if chunk.get("usage").is_some_and(Value::is_object) {
            self.usage = Some(chunk["usage"].clone());
        }
        let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
            return;
        };
        let registry = self.registry.clone();
        for (position, choice) in choices.iter().enumerate() {
            let index = choice_index(choice, position);
            let delta = &choice["delta"];
            if let Some(content) = delta.get("content").and_then(Value::as_str)
                && !content.is_empty()
            {
                if !self.ttft_seen {
                    self.ttft_seen = true;
                    let ttft = elapsed_ms(self.attempt.sent_at);
                    if self.attempt.verifier.observe_ttft(ttft) {
                        return self.finalize(None);
                    }
                }
                let step = self.attempt.verifier.push(index, content, &*registry);
                if !step.release.is_empty() {
                    self.emit_content(index, &step.release);
                }
                if step.stop {
                    return self.finalize(None);
                }
            }
            if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
                for (call_position, call) in calls.iter().enumerate() {
                    let call_index = choice_index(call, call_position);
                    let head = self.tool_calls.entry((index, call_index)).or_default();
                    for (slot, pointer) in [
                        (&mut head.id, "/id"),
                        (&mut head.kind, "/type"),
                        (&mut head.name, "/function/name"),
                    ] {
                        if let Some(value) = call.pointer(pointer).filter(|v| !v.is_null()) {
                            *slot = Some(value.clone());
                        }
                    }
                    if let Some(fragment) =
                        call.pointer("/function/arguments").and_then(Value::as_str)
                    {
                        let stop = self
                            .attempt
                            .verifier
                            .push_tool_arguments(index, call_index, fragment, &*registry);
                        if stop {
                            return self.finalize(None);
                        }
                    }
                }
            }
            set_reason(&mut self.finish_reasons, index, choice.get("finish_reason"));
        }
    }

    /// Ends verification. `done`: whether `[DONE]` arrived (`None` when we
    /// stopped reading ourselves).
    fn finalize(&mut self, done: Option<bool>) {
        let finished = self.finish_verifier(done);
        let released =
            self.committed || !self.out.is_empty() || self.attempt.verifier.released_any();
        let decision = finished
            .verdict
            .decide(self.action, self.attempt.attempt, released);
        match decision {
            Decision::Deliver | Decision::Flag => {
                for (index, text) in finished.release.iter().enumerate() {
                    if !text.is_empty() {
                        self.emit_content(index as u32, text);
                    }
                }
                for tool in &finished.tool_arguments {
                    self.emit_tool_call(tool.choice, tool.tool_call, &tool.arguments);
                }
                for index in 0..self.finish_reasons.len() {
                    let reason = self.finish_reasons[index].clone();
                    let mut delta = Map::new();
                    self.take_role(index as u32, &mut delta);
                    self.emit_choices(json!([{
                        "index": index, "delta": delta, "logprobs": null, "finish_reason": reason,
                    }]));
                }
                if self.attempt.injection.client_wants_usage
                    && let Some(usage) = self.usage.clone()
                {
                    let mut chunk = self.chunk_base();
                    chunk.insert("choices".into(), json!([]));
                    chunk.insert("usage".into(), usage);
                    encode_data(&Value::Object(chunk).to_string(), &mut self.out);
                }
                let mut tail = b": x-canarygate-verdict ".to_vec();
                tail.extend_from_slice(finished.verdict.header_value().as_bytes());
                tail.extend_from_slice(b"\n\ndata: [DONE]\n\n");
                self.tail = Some(tail);
                self.end = Some(End::Delivered);
            }
            Decision::Retry | Decision::Block | Decision::Fallback => {
                if released {
                    let mut tail = Vec::new();
                    encode_data(&finished.verdict.error_body().to_string(), &mut tail);
                    self.tail = Some(tail);
                    self.end = Some(End::Failed(Decision::Block));
                } else {
                    self.end = Some(End::Failed(decision));
                }
            }
        }
        self.verdict = Some(finished.verdict);
    }

    /// Runs the verifier's end-of-answer checks on what the stream showed.
    fn finish_verifier(&mut self, done: Option<bool>) -> Finished {
        let facts = Facts {
            finish_reasons: self.finish_reasons.clone(),
            usage: self
                .usage
                .as_ref()
                .and_then(|usage| usage_of(&json!({ "usage": usage }))),
            done_marker: done,
        };
        self.attempt.verifier.finish(&facts, &*self.registry)
    }

    /// Copies what the stream learnt (verdict, provider usage) into `trail`.
    fn fill(&self, trail: &mut Trail) {
        if let Some(verdict) = &self.verdict {
            trail.verdict(verdict);
        }
        trail.prompt_tokens_provider = self.provider_prompt_tokens();
    }

    /// The provider broke the stream: record the verdict, end with an error.
    fn interrupt(&mut self, detail: String) {
        tracing::warn!(provider = %self.provider, "stream interrupted: {detail}");
        let finished = self.finish_verifier(Some(false));
        self.verdict = Some(finished.verdict);
        if self.committed || !self.out.is_empty() {
            let message = format!(
                "Provider `{}` {detail}; the answer is incomplete.",
                self.provider
            );
            let mut tail = Vec::new();
            encode_data(
                &error_body(&message, "upstream_error", STREAM_INTERRUPTED, None).to_string(),
                &mut tail,
            );
            self.tail = Some(tail);
        }
        self.interruption = Some(detail);
        self.end = Some(End::Interrupted);
    }

    fn chunk_base(&self) -> Map<String, Value> {
        let mut chunk = self.template.clone();
        chunk
            .entry("object")
            .or_insert_with(|| json!("chat.completion.chunk"));
        chunk
    }

    /// `data: {"id":…,"object":…,"created":…,"model":…,"choices":` of every
    /// rebuilt chunk, serialised once per stream.
    fn chunk_prefix(&mut self) -> &[u8] {
        if self.chunk_prefix.is_empty() {
            let mut prefix = b"data: ".to_vec();
            let base = Value::Object(self.chunk_base());
            // A map of plain values always serialises.
            let _ = serde_json::to_writer(&mut prefix, &base);
            prefix.pop(); // the closing brace
            if prefix.last() != Some(&b'{') {
                prefix.push(b',');
            }
            prefix.extend_from_slice(b"\"choices\":");
            self.chunk_prefix = prefix;
        }
        &self.chunk_prefix
    }

    /// Appends one chunk event whose `choices` is written by `choices`.
    fn emit_with(&mut self, choices: impl FnOnce(&mut Vec<u8>)) {
        let mut out = std::mem::take(&mut self.out);
        out.extend_from_slice(self.chunk_prefix());
        choices(&mut out);
        out.extend_from_slice(b"}\n\n");
        self.out = out;
    }

    fn emit_choices(&mut self, choices: Value) {
        // JSON values always serialise.
        self.emit_with(|out| drop(serde_json::to_writer(out, &choices)));
    }

    /// Adds `role` to the first delta of a choice.
    fn take_role(&mut self, index: u32, delta: &mut Map<String, Value>) {
        let index = index as usize;
        if self.role_sent.len() <= index {
            self.role_sent.resize(index + 1, false);
        }
        if !self.role_sent[index] {
            self.role_sent[index] = true;
            delta.insert("role".into(), json!("assistant"));
        }
    }

    /// The hot path of a stream: one content delta, written straight out.
    fn emit_content(&mut self, index: u32, text: &str) {
        let mut role = Map::new();
        self.take_role(index, &mut role);
        self.emit_with(|out| {
            out.extend_from_slice(b"[{\"index\":");
            out.extend_from_slice(index.to_string().as_bytes());
            out.extend_from_slice(b",\"delta\":{");
            if !role.is_empty() {
                out.extend_from_slice(b"\"role\":\"assistant\",");
            }
            out.extend_from_slice(b"\"content\":");
            // A string always serialises.
            let _ = serde_json::to_writer(&mut *out, text);
            out.extend_from_slice(b"},\"logprobs\":null,\"finish_reason\":null}]");
        });
    }

    fn emit_tool_call(&mut self, index: u32, call_index: u32, arguments: &str) {
        let head = self
            .tool_calls
            .remove(&(index, call_index))
            .unwrap_or_default();
        let mut call = Map::new();
        call.insert("index".into(), json!(call_index));
        if let Some(id) = head.id {
            call.insert("id".into(), id);
        }
        call.insert(
            "type".into(),
            head.kind.unwrap_or_else(|| json!("function")),
        );
        let mut function = Map::new();
        if let Some(name) = head.name {
            function.insert("name".into(), name);
        }
        function.insert("arguments".into(), json!(arguments));
        call.insert("function".into(), Value::Object(function));
        let mut delta = Map::new();
        self.take_role(index, &mut delta);
        delta.insert("tool_calls".into(), json!([call]));
        self.emit_choices(json!([{
            "index": index, "delta": delta, "logprobs": null, "finish_reason": null,
        }]));
    }
}

/// The body of a verified stream: released text as it is verified, then the
/// last bytes once the audit record is durable.
struct StreamingBody {
    stream: Box<VerifiedStream>,
    trail: Option<Trail>,
    last_yield: Option<Instant>,
}

/// Turns a verified stream into the response body; `trail` records the
/// request when the stream ends.
pub(crate) fn streaming_body(stream: Box<VerifiedStream>, trail: Trail) -> Body {
    let body = StreamingBody {
        stream,
        trail: Some(trail),
        last_yield: None,
    };
    Body::from_stream(futures_util::stream::unfold(body, |mut body| async move {
        let chunk = body.next_chunk().await?;
        Some((Ok::<_, Infallible>(chunk), body))
    }))
}

impl StreamingBody {
    async fn next_chunk(&mut self) -> Option<Bytes> {
        let trail = self.trail.as_mut()?;
        if let Some(yielded) = self.last_yield.take() {
            // Between our yield and this poll the client connection was writing.
            trail.clock.add_waiting(yielded.elapsed());
        }
        let stream = &mut self.stream;
        loop {
            if !stream.out.is_empty() {
                stream.advance_ready(&mut trail.clock).await;
                let bytes = std::mem::take(&mut stream.out);
                trail.sent(&bytes);
                stream.committed = true;
                self.last_yield = Some(Instant::now());
                return Some(Bytes::from(bytes));
            }
            if stream.end.is_some() {
                break;
            }
            stream.advance(&mut trail.clock).await;
        }
        // The end: record, durably, then send the last bytes.
        let mut trail = self.trail.take()?;
        stream.fill(&mut trail);
        let tail = stream.tail.take().unwrap_or_default();
        trail.sent(&tail);
        let (outcome, action) = stream.conclusion();
        match trail.commit(outcome, action).await {
            Ok(()) if tail.is_empty() => None,
            Ok(()) => Some(Bytes::from(tail)),
            Err(error) => {
                tracing::error!("audit append failed: {error}; the stream ends in an error");
                let mut bytes = Vec::new();
                encode_data(&audit_failure_body().to_string(), &mut bytes);
                Some(Bytes::from(bytes))
            }
        }
    }
}

impl Drop for StreamingBody {
    fn drop(&mut self) {
        // The client went away before the end: record the request as interrupted.
        if let Some(mut trail) = self.trail.take() {
            self.stream.fill(&mut trail);
            tokio::spawn(async move {
                if let Err(error) = trail
                    .commit(Outcome::InterruptedByClient, AuditAction::Forward)
                    .await
                {
                    tracing::error!("audit append of an interrupted stream failed: {error}");
                }
            });
        }
    }
}

/// The error a client gets when its answer could not be recorded.
pub(crate) fn audit_failure_body() -> Value {
    error_body(
        "canarygate could not record this request in its audit log, so the answer is withheld.",
        "server_error",
        "audit_log_unavailable",
        None,
    )
}
