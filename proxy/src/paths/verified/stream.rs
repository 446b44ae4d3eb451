//! A streamed answer, verified as it is relayed.
//!
//! The stream is driven here until the first verified byte can go out
//! (`echo-first`) or until the verdict (`verdict-first`): so a failed echo,
//! or any failure under verdict-first, is answered with a plain HTTP 502 and
//! no byte of the suspect answer. After that the rest goes out through the
//! audited body ([`crate::body`]), the events of each burst in one write
//! (see [`crate::relay`]), and a later failure ends the stream with an
//! explicit error event. What the client sees is the provider's own events,
//! held by the wire format's [`StreamWriter`] until the verifier lets their
//! text out and edited there. What the provider sends that cannot go out
//! yet (held for the echo or the verdict, or an event that never ends) is
//! bounded as a whole answer is: past [`MAX_UPSTREAM_BODY`] bytes read since
//! the last write to the client, the stream ends as too large.
//!
//! Longer than 500 lines: one type, [`VerifiedStream`], whose reading,
//! verifying, releasing and ending share its state; split, each part would
//! take all of it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderValue, StatusCode};
use canarygate_audit::TopicScore;
use canarygate_policies::sse::{SseEvent, SseParser, encode_data};
use canarygate_policies::verify::{Decision, Facts, Finished, ProviderUsage, Verdict};
use canarygate_policies::verify_config::{FailureAction, ReleasePolicy};
use http_body_util::{BodyDataStream, BodyExt};
use tokio::sync::OwnedSemaphorePermit;

use super::attempt::{Attempt, Decided, blocked, elapsed_ms};
use crate::body::{PendingBody, Served, StreamSource};
use crate::clock::RequestClock;
use crate::context::{OVERHEAD_HEADER, RequestContext};
use crate::error::{ApiError, ErrorCode, error_chain};
use crate::registry::CanaryBook;
use crate::relay::{COALESCE_BYTES, early_end, interrupted, next_ready, next_within};
use crate::trail::{Ending, Trail};
use crate::upstream::without_canary_text;
use crate::upstream_client::{MAX_UPSTREAM_BODY, UpstreamBody, UpstreamResponse};
use crate::wire::{EventView, StreamMemo, StreamWriter, WireFormat, drop_read_only};

/// `x-canarygate-verdict` of a stream whose verdict comes after the head;
/// the final verdict then goes in the stream's end marker where the format
/// can carry it.
const VERDICT_PENDING: &str = "pending; release=echo-first";

/// What an `echo-first` stream sends while it holds the provider's events
/// longer than `limits.stream_keepalive_ms`: an SSE comment, which clients
/// skip, so their read timeouts do not fire.
const KEEPALIVE_COMMENT: &[u8] = b": canarygate: verifying\n\n";

/// Verifies the stream in `response` up to the point where the client can
/// be answered, and decides.
pub async fn serve<W: WireFormat>(
    context: &RequestContext<'_, W>,
    response: UpstreamResponse,
    attempt: Attempt,
    trail: &mut Trail,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> Decided {
    let mut stream = VerifiedStream::<W>::new(context, response, attempt);
    let driven = stream.drive_to_release(trail.clock()).await;
    stream.fill(trail);
    match driven {
        Driven::Retry => Decided::Retry,
        Driven::Fallback => Decided::Fallback,
        Driven::Blocked(verdict) => Decided::Served(Served::Whole(blocked(context, &verdict))),
        Driven::Failed(error) => {
            Decided::Served(Served::Whole(context.error_response(&error, None)))
        }
        Driven::ProviderError(status, body) => {
            Decided::Served(Served::Whole(context.provider_error_response(status, body)))
        }
        Driven::Stream(verdict) => {
            stream.permit = permit.take();
            let mut head = context.event_stream_response(Some(&verdict));
            // Verdict-first streams are answered once everything is known.
            let delivery = stream.writer.delivery();
            let overhead = match stream.end {
                Some(End::Delivered) => delivery.overhead_header(),
                _ => format!("prompt={}, completion=pending", delivery.overhead_prompt()),
            };
            if let Ok(value) = HeaderValue::from_str(&overhead) {
                head.headers_mut().insert(OVERHEAD_HEADER, value);
            }
            Decided::Served(Served::Stream(head, PendingBody::new(stream)))
        }
    }
}

/// Result of driving a stream before answering the client.
enum Driven {
    /// The verdict failed before anything was released and the policy retries.
    Retry,
    /// The verdict failed before anything was released: serve locally.
    Fallback,
    /// The verdict failed before anything was released: HTTP 502.
    Blocked(Verdict),
    /// The provider failed before anything was released.
    Failed(ApiError),
    /// The provider sent its own error event before anything was released:
    /// the error (in the format's shape) and the status it stands for.
    ProviderError(StatusCode, Bytes),
    /// Answer 200 and relay the rest; the string is the verdict header.
    Stream(String),
}

/// How a verified stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Delivered (possibly flagged), ending in the end marker.
    Delivered,
    /// Failed verification with this decision (block or retry).
    Failed(Decision),
    /// The provider failed, stalled or closed early.
    Interrupted,
}

/// The provider's body, chunk by chunk as hyper hands it over.
type ByteStream = BodyDataStream<UpstreamBody>;

/// A verified SSE relay (see the module docs).
struct VerifiedStream<W: WireFormat> {
    upstream: ByteStream,
    parser: SseParser,
    /// The events of one read, kept empty between reads for its buffer.
    events: Vec<SseEvent>,
    /// What the stream's events so far tell the reading of the next.
    memo: StreamMemo,
    attempt: Attempt,
    release: ReleasePolicy,
    action: FailureAction,
    provider: String,
    idle_timeout: Duration,
    registry: Arc<CanaryBook>,
    writer: W::StreamWriter,
    finish_reasons: Vec<Option<String>>,
    usage: Option<ProviderUsage>,
    ttft_seen: bool,
    /// Bytes ready for the client.
    out: Vec<u8>,
    /// Bytes of the last write to the client (at most [`COALESCE_BYTES`]).
    last_write: usize,
    /// Whether any byte was handed to the client.
    committed: bool,
    /// Bytes read from the provider since the last write to the client:
    /// what is held in memory, bounded by [`MAX_UPSTREAM_BODY`].
    held_bytes: usize,
    /// The interruption was the provider sending more than that.
    too_large: bool,
    /// Until the provider's first event, when it must have come: the
    /// request's first-byte deadline (`limits.first_byte_timeout_ms`).
    /// Keep-alive comments before it do not put it off.
    first_event_by: Option<Instant>,
    /// The last bytes of the stream (the end marker or an error event),
    /// sent only once the audit record is durable.
    tail: Option<Vec<u8>>,
    end: Option<End>,
    verdict: Option<Verdict>,
    interruption: Option<String>,
    /// The interruption was the provider going silent past the idle timeout.
    stalled: bool,
    /// Since when the provider has sent no whole event, once a wait for it
    /// began (`None` right after one): the idle timeout counts from it, so
    /// bytes that never end an event, and comments alone, do not put it off.
    idle_since: Option<Instant>,
    /// How long the client may get nothing while events are held
    /// (`limits.stream_keepalive_ms`, `echo-first` only).
    keepalive: Option<Duration>,
    /// Since when the client has got nothing, once a wait began (`None`
    /// right after a write): a keep-alive comment is due a `keepalive` later.
    quiet_since: Option<Instant>,
    /// The provider's own error event that interrupted the stream, in the
    /// format's error shape, with the HTTP status it stands for.
    provider_error: Option<(StatusCode, Bytes)>,
    /// The topic score taken before the decision (`[topic] action =
    /// "flag"` or `"block"`).
    topic_score: Option<TopicScore>,
    /// A failed check stopped the reading before the provider's end.
    stopped_reading: bool,
    /// The concurrency slot, released when the stream ends.
    permit: Option<OwnedSemaphorePermit>,
}

impl<W: WireFormat> VerifiedStream<W> {
    fn new(context: &RequestContext<'_, W>, response: UpstreamResponse, attempt: Attempt) -> Self {
        let config = &context.state.policy.verify;
        let delivery = attempt.delivery.clone();
        let first_byte_timeout =
            Duration::from_millis(context.state.policy.limits.first_byte_timeout_ms);
        let first_event_by = Some(attempt.sent_at + first_byte_timeout);
        let keepalive_ms = context.state.policy.limits.stream_keepalive_ms;
        let keepalive = (config.release == ReleasePolicy::EchoFirst && keepalive_ms > 0)
            .then(|| Duration::from_millis(keepalive_ms));
        let quiet_since = Some(attempt.sent_at);
        Self {
            upstream: response.into_body().into_data_stream(),
            parser: SseParser::new(),
            events: Vec::new(),
            memo: StreamMemo::default(),
            attempt,
            release: config.release,
            action: config.action(),
            provider: context.upstream.name.clone(),
            idle_timeout: context.idle_timeout(),
            registry: context.state.registry.clone(),
            writer: W::stream_writer(delivery),
            finish_reasons: Vec::new(),
            usage: None,
            ttft_seen: false,
            out: Vec::new(),
            last_write: 0,
            committed: false,
            held_bytes: 0,
            too_large: false,
            first_event_by,
            tail: None,
            end: None,
            verdict: None,
            interruption: None,
            stalled: false,
            idle_since: None,
            keepalive,
            quiet_since,
            provider_error: None,
            topic_score: None,
            stopped_reading: false,
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
                Some(End::Failed(_)) if self.verdict.is_some() => {
                    return Driven::Blocked(self.verdict.clone().expect("checked just above"));
                }
                Some(End::Interrupted) => {
                    if let Some((status, body)) = self.provider_error.take() {
                        return Driven::ProviderError(status, body);
                    }
                    let detail = self.interruption.take().unwrap_or_default();
                    // Nothing went out: a stall is a timeout, and too much
                    // too large, as a whole answer's are.
                    let code = if self.stalled {
                        ErrorCode::UpstreamTimeout
                    } else if self.too_large {
                        ErrorCode::UpstreamResponseTooLarge
                    } else {
                        ErrorCode::UpstreamStreamInterrupted
                    };
                    return Driven::Failed(ApiError::new(
                        code,
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

    /// Copies what the stream learnt (verdict, provider usage, an
    /// interruption) into `trail`.
    fn fill(&mut self, trail: &mut Trail) {
        if let Some(verdict) = &self.verdict {
            trail.verdict(verdict);
        }
        if let Some(score) = self.topic_score.take() {
            trail.topic_score(score);
        }
        self.attempt
            .record_answer(trail, self.verdict.as_ref(), self.stopped_reading);
        trail.prompt_tokens_provider(self.usage.map(|usage| usage.prompt_tokens));
        if self.end == Some(End::Delivered) {
            let delivery = self.writer.delivery();
            trail.overhead_tokens(delivery.overhead_prompt(), delivery.overhead_completion());
        }
        if self.end == Some(End::Interrupted) {
            trail.upstream_interrupted();
        }
    }

    /// One upstream read and everything it completes.
    async fn advance(&mut self, clock: &mut RequestClock) {
        // The wait, worked out (and the clock read) only when nothing is
        // ready: until the first event, its own deadline (comments do not
        // count), then the idle timeout; a keep-alive comment due before
        // then ends it early.
        let mut keepalive_due = None;
        let wait = || {
            let now = Instant::now();
            let by = match self.first_event_by {
                Some(first) => first,
                None => *self.idle_since.get_or_insert(now) + self.idle_timeout,
            };
            keepalive_due = self
                .keepalive
                .map(|keepalive| *self.quiet_since.get_or_insert(now) + keepalive)
                .filter(|due| *due < by);
            keepalive_due.unwrap_or(by).saturating_duration_since(now)
        };
        match next_within(&mut self.upstream, clock, wait).await {
            Err(_) if keepalive_due.is_some() => {
                self.out.extend_from_slice(KEEPALIVE_COMMENT);
                self.quiet_since = Some(Instant::now());
            }
            Err(_) => {
                let detail = format!(
                    "sent no whole event for {} ms (limits.idle_timeout_ms)",
                    self.idle_timeout.as_millis()
                );
                self.stalled = true;
                let detail = match self.first_event_by {
                    Some(by) if Instant::now() >= by => "sent no event by its first-byte deadline \
                         (limits.first_byte_timeout_ms), keep-alives aside"
                        .to_owned(),
                    _ => detail,
                };
                self.interrupt(detail);
            }
            Ok(next) => self.take(next).await,
        }
    }

    /// Takes what else the provider has already sent, until [`COALESCE_BYTES`]
    /// are ready for the client or nothing more is ready now. The yields to
    /// the provider's connection task count as waiting on the provider.
    async fn advance_ready(&mut self, clock: &mut RequestClock) {
        while self.end.is_none() && self.out.len() < COALESCE_BYTES {
            match next_ready(&mut self.upstream, clock).await {
                Some(next) => self.take(next).await,
                None => return,
            }
        }
    }

    /// Everything one upstream read completes, or the end of the stream.
    async fn take(&mut self, next: Option<Result<Bytes, hyper::Error>>) {
        match next {
            None => {
                // The last event may lack its blank line: taken as ended.
                let mut events = std::mem::take(&mut self.events);
                self.parser.flush_last_event(&mut events);
                self.on_events(events).await;
                if self.end.is_some() {
                    return;
                }
                if self.is_whole_without_end_marker() {
                    // Servers that never send the end marker
                    // (text-generation-inference before 2.2, llama-box):
                    // every choice finished, so the answer is whole.
                    return self.finalize(None).await;
                }
                let detail = early_end(&mut self.parser).to_owned();
                if self.writer.ended_by_provider_error() {
                    // The provider's own error event was its stream's end.
                    self.interrupt_with(detail, Some(Vec::new()));
                } else {
                    self.interrupt(detail);
                }
            }
            Some(Err(error)) => self.interrupt(format!("stream failed: {}", error_chain(&error))),
            Some(Ok(bytes)) => {
                self.held_bytes += bytes.len();
                if self.held_bytes > MAX_UPSTREAM_BODY {
                    self.too_large = true;
                    return self.interrupt(format!(
                        "sent more than {MAX_UPSTREAM_BODY} bytes that could not go out yet \
                         (held for verification, or an event that does not end)"
                    ));
                }
                let mut events = std::mem::take(&mut self.events);
                self.parser.feed(&bytes, &mut events);
                // Only a whole event is progress: a provider that trickles
                // bytes of one, or sends comments alone, is idle.
                if !events.is_empty() {
                    self.idle_since = None;
                }
                self.on_events(events).await;
                while let Some(data) = self.writer.spent() {
                    self.parser.recycle(data);
                }
            }
        }
    }

    /// Takes `events` in order until the stream ends; keeps their list's
    /// buffer for the next read.
    async fn on_events(&mut self, mut events: Vec<SseEvent>) {
        for event in events.drain(..) {
            if self.end.is_some() {
                break;
            }
            self.on_event(event).await;
        }
        self.events = events;
    }

    async fn on_event(&mut self, event: SseEvent) {
        self.first_event_by = None;
        let (mut chunk, last) = match W::read_stream_event(&event, &mut self.memo) {
            EventView::Done => return self.finalize(Some(true)).await,
            EventView::Final(chunk) => (chunk, true),
            EventView::Malformed => {
                return self.interrupt(
                    "sent an event that cannot be read (not JSON, or not of its API)".into(),
                );
            }
            EventView::Error(message) => return self.end_with_provider_error(&event, &message),
            EventView::Chunk(chunk) => (chunk, false),
        };
        // A text that goes back to an earlier block or part: SDKs would
        // join it where it goes, not where the verifier read it.
        if let Some(place) = chunk.place
            && !self.memo.keeps_order(place)
        {
            return self.interrupt("sent a text for a block it had already left".into());
        }
        if chunk.usage.is_some() {
            self.usage = chunk.usage;
        }
        // When the event arrived, until the first text was seen (the clock
        // is read only while it can matter): a registry lookup before it is
        // pushed is canarygate's time, not the provider's.
        let arrived_ms = (!self.ttft_seen).then(|| elapsed_ms(self.attempt.sent_at));
        let ttft_seen = &mut self.ttft_seen;
        let (mut spans, stop) = self
            .attempt
            .feed(
                &self.registry,
                &chunk.choices,
                &chunk.with_data(&event.data),
                &mut self.finish_reasons,
                |verifier| {
                    // The first generated text of any kind: reasoning models
                    // think before they answer.
                    !std::mem::replace(ttft_seen, true)
                        && arrived_ms.is_some_and(|arrived_ms| verifier.observe_ttft(arrived_ms))
                },
            )
            .await;
        drop_read_only(&mut chunk.choices, &mut spans);
        self.writer.take(chunk, event, spans);
        if last {
            return self.finalize(Some(true)).await;
        }
        if stop {
            self.stopped_reading = true;
            return self.finalize(None).await;
        }
        if self.out.capacity() == 0 {
            // Room for twice the last write (it goes to the client whole,
            // and is freed once written), so a burst's events are written
            // without growing the buffer step by step.
            self.out
                .reserve((2 * self.last_write).clamp(1024, COALESCE_BYTES));
        }
        self.writer
            .flush(&self.attempt.verifier, false, &mut self.out);
        if let Some(detail) = self.writer.failure() {
            let detail = detail.to_owned();
            self.interrupt(detail);
        }
    }

    /// Whether the stream, closed at an event's end without its end marker,
    /// still holds a whole answer: every choice asked for has a finish
    /// reason (the usage that may follow it is not needed), and no error
    /// event ended it.
    fn is_whole_without_end_marker(&self) -> bool {
        let expected = self.attempt.injection.choices.max(1) as usize;
        !self.parser.has_partial()
            && !self.writer.ended_by_provider_error()
            && self.finish_reasons.len() >= expected
            && self
                .finish_reasons
                .iter()
                .all(|reason| reason.as_deref().is_some_and(|reason| !reason.is_empty()))
    }

    /// Ends verification. `done`: whether the end marker arrived (`None`
    /// when we stopped reading ourselves, or the provider closed a whole
    /// answer without it).
    async fn finalize(&mut self, done: Option<bool>) {
        let mut finished = self.finish_verifier(done);
        self.topic_score = self.attempt.judge_topic(&mut finished.verdict).await;
        let released = self.committed || !self.out.is_empty();
        let decision = self
            .attempt
            .decide(&finished.verdict, self.action, released);
        match decision {
            Decision::Deliver | Decision::Flag => {
                // Text held for the client's limit passes whole if the
                // provider's own count says the answer fits.
                let echo_tokens = self.attempt.echo_tokens_counted(&finished.verdict);
                self.writer.delivery_mut().fits_the_limit(
                    self.usage.and_then(|usage| usage.completion_tokens),
                    echo_tokens,
                );
                self.writer
                    .flush(&self.attempt.verifier, true, &mut self.out);
                if let Some(detail) = self.writer.failure() {
                    // The answer verified, but part of it cannot be sent.
                    let detail = detail.to_owned();
                    self.end_interrupted(detail, None);
                } else {
                    self.tail = Some(self.writer.done(&finished.verdict));
                    self.end = Some(End::Delivered);
                }
            }
            Decision::Retry | Decision::Block | Decision::Fallback => {
                if released {
                    let error = ApiError::verification_failed(&finished.verdict);
                    self.tail = Some(self.own_error_event(&error));
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
            usage: self.usage,
            done_marker: done,
        };
        let lookup = self.registry.lookup(&self.attempt.fetched);
        self.attempt.verifier.finish(&facts, &lookup)
    }

    /// The provider broke the stream: record the verdict, end with an error.
    fn interrupt(&mut self, detail: String) {
        // A provider's error event still held ended its answer, whatever
        // came after it (a reset, a stall, the end).
        if let Some((event, message)) = self.writer.take_unsent_provider_error() {
            return self.end_with_provider_error(&event, &message);
        }
        self.interrupt_with(detail, None);
    }

    /// Ends the stream with the provider's own error `event` (its
    /// `message`): before anything went out, its error is the answer, with
    /// the status it stands for; after, the event as it came (but for any
    /// canary-shaped text) ends what went out.
    fn end_with_provider_error(&mut self, event: &SseEvent, message: &str) {
        self.provider_error = W::error_event_status(&event.data)
            .map(|status| (status, Bytes::from(W::error_event_body(&event.data))));
        let mut own = Vec::new();
        if let Some(name) = &event.event {
            own.extend_from_slice(b"event: ");
            own.extend_from_slice(name.as_bytes());
            own.push(b'\n');
        }
        match without_canary_text(event.data.as_bytes()) {
            Some(withheld) => encode_data(&String::from_utf8_lossy(&withheld), &mut own),
            None => encode_data(&event.data, &mut own),
        }
        // An honest failure, not an answer dressed as whole: the verdict
        // does not count it against the provider's answers.
        self.attempt.verifier.ended_by_provider_error();
        let detail = format!("sent an error mid-stream: {message}");
        self.interrupt_with(detail, Some(own));
    }

    /// [`Self::interrupt`], ending with `provider_event` (the provider's own
    /// error event, encoded) instead of canarygate's, when there is one.
    fn interrupt_with(&mut self, detail: String, provider_event: Option<Vec<u8>>) {
        let finished = self.finish_verifier(Some(false));
        self.verdict = Some(finished.verdict);
        self.end_interrupted(detail, provider_event);
    }

    /// canarygate's event ending the stream with `error`, as the writer
    /// writes it (numbered, for a Responses stream).
    fn own_error_event(&self, error: &ApiError) -> Vec<u8> {
        self.writer
            .error_event(error)
            .unwrap_or_else(|| W::error_event(error))
    }

    /// Ends the stream as interrupted: with an error event when anything
    /// went or is ready to go to the client, the provider's own
    /// (`provider_event`) when it sent one, else canarygate's.
    fn end_interrupted(&mut self, detail: String, provider_event: Option<Vec<u8>>) {
        tracing::warn!(provider = %self.provider, "stream interrupted: {detail}");
        if self.committed || !self.out.is_empty() {
            self.tail =
                Some(provider_event.unwrap_or_else(|| {
                    self.own_error_event(&interrupted(&self.provider, &detail))
                }));
        }
        self.interruption = Some(detail);
        self.end = Some(End::Interrupted);
    }
}

impl<W: WireFormat> StreamSource for VerifiedStream<W> {
    /// Released text as it is verified.
    async fn next_bytes(&mut self, clock: &mut RequestClock) -> Option<Vec<u8>> {
        loop {
            if !self.out.is_empty() {
                self.advance_ready(clock).await;
                self.committed = true;
                // A keep-alive alone sends nothing held: what is held stays
                // bounded as before it.
                if self.out != KEEPALIVE_COMMENT {
                    self.held_bytes = 0;
                }
                self.quiet_since = None;
                self.last_write = self.out.len().min(COALESCE_BYTES);
                return Some(std::mem::take(&mut self.out));
            }
            if self.end.is_some() {
                return None;
            }
            self.advance(clock).await;
        }
    }

    fn finish(&mut self, trail: &mut Trail) -> (Vec<u8>, Ending) {
        self.fill(trail);
        let blocked = matches!(self.end, Some(End::Failed(_)));
        (
            self.tail.take().unwrap_or_default(),
            Ending::Stream { blocked },
        )
    }

    fn abandon(&mut self, trail: &mut Trail) {
        self.fill(trail);
    }

    fn error_event(&self, error: &ApiError) -> Vec<u8> {
        self.own_error_event(error)
    }
}
