//! Plain streaming relay (`[verify] enabled = false`): upstream SSE in,
//! client SSE out.
//!
//! The relay pulls from the provider only when the client's connection asks for
//! more (hyper polls the body stream when its write buffer has room), so a slow
//! client slows the provider read instead of growing a buffer. Dropping the
//! stream (the client went away) drops the upstream response, which closes the
//! upstream connection and so cancels the request there.
//!
//! Events the provider has already sent go out together: after each read the
//! relay takes whatever else is ready ([`next_ready`]), so a burst of events
//! costs one write to the client instead of one per event, and a slow
//! provider's tokens still leave the moment they arrive.
//!
//! A stream never ends in a way that looks clean unless the provider sent
//! `[DONE]`: a failure, a timeout or an early close ends it with an explicit
//! error event in OpenAI's format. The last bytes go out only once the audit
//! record is durable.

use std::convert::Infallible;
use std::pin::Pin;
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use canarygate_policies::sse::{SseEvent, SseParser, encode_data};
use futures_util::{FutureExt, Stream, StreamExt};
use tokio::sync::OwnedSemaphorePermit;

use crate::audit::{Action, Outcome};
use crate::clock::RequestClock;
use crate::error::{error_body, error_chain};
use crate::trail::Trail;

/// Error code of the event that ends an interrupted stream.
pub const STREAM_INTERRUPTED: &str = "upstream_stream_interrupted";

/// Most bytes gathered for one write to the client.
pub(crate) const COALESCE_BYTES: usize = 16 * 1024;

/// Scheduler rounds [`next_ready`] gives the provider's connection task.
const READY_ROUNDS: usize = 2;

/// The next item of `upstream` if it is ready now, or within
/// [`READY_ROUNDS`] yields to the scheduler; `None` when it is not.
/// `Some(None)`: the stream ended. The time counts on `clock` as waiting on
/// the provider, like awaiting its next chunk.
///
/// hyper hands a response body over one chunk at a time: the provider's
/// connection task decodes the next chunk from its read buffer only after the
/// previous one was taken, and it runs after the tasks already queued on this
/// worker. Yielding lets it run, so events that arrived together leave
/// together; when the provider has sent nothing more this costs two empty
/// scheduler rounds, microseconds.
pub(crate) async fn next_ready<S: Stream + Unpin>(
    upstream: &mut S,
    clock: &mut RequestClock,
) -> Option<Option<S::Item>> {
    clock
        .wait(async {
            if let Some(item) = upstream.next().now_or_never() {
                return Some(item);
            }
            for _ in 0..READY_ROUNDS {
                tokio::task::yield_now().await;
                if let Some(item) = upstream.next().now_or_never() {
                    return Some(item);
                }
            }
            None
        })
        .await
}

/// How a stream that ended without `[DONE]` ended, for the error event.
pub(crate) fn early_end(parser: &mut SseParser) -> &'static str {
    if parser.finish() {
        "closed the stream in the middle of an event"
    } else {
        "closed the stream without sending [DONE]"
    }
}

/// Any error a byte source can fail with.
type SourceError = Box<dyn std::error::Error + Send + Sync>;

type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, SourceError>> + Send>>;

/// An SSE stream (the provider's, or the local engine's) on its way to the client.
pub(crate) struct Relay {
    upstream: ByteStream,
    /// What the audit record says was done with the answer.
    action: Action,
    parser: SseParser,
    events: Vec<SseEvent>,
    idle_timeout: Duration,
    provider: String,
    /// The last bytes: `[DONE]` or the error event.
    tail: Option<Vec<u8>>,
    interrupted: bool,
    _permit: OwnedSemaphorePermit,
}

/// Relays the SSE body of `response`; the permit is held until it ends.
pub(crate) fn relay_sse(
    response: reqwest::Response,
    provider: String,
    idle_timeout: Duration,
    permit: OwnedSemaphorePermit,
) -> Relay {
    Relay::new(
        Box::pin(
            response
                .bytes_stream()
                .map(|chunk| chunk.map_err(SourceError::from)),
        ),
        Action::Forward,
        provider,
        idle_timeout,
        permit,
    )
}

/// Relays the local engine's SSE answer (served instead of the provider's);
/// the permit is held until it ends.
pub(crate) fn relay_local(
    stream: impl Stream<Item = Bytes> + Send + 'static,
    idle_timeout: Duration,
    permit: OwnedSemaphorePermit,
) -> Relay {
    Relay::new(
        Box::pin(stream.map(Ok)),
        Action::Fallback,
        crate::local::LOCAL_PROVIDER.to_owned(),
        idle_timeout,
        permit,
    )
}

/// The relay with the request's trail, as a response body.
struct RelayBody {
    relay: Relay,
    trail: Option<Trail>,
    last_yield: Option<Instant>,
}

impl Relay {
    fn new(
        upstream: ByteStream,
        action: Action,
        provider: String,
        idle_timeout: Duration,
        permit: OwnedSemaphorePermit,
    ) -> Self {
        Self {
            upstream,
            action,
            parser: SseParser::new(),
            events: Vec::new(),
            idle_timeout,
            provider,
            tail: None,
            interrupted: false,
            _permit: permit,
        }
    }

    /// The response body; `trail` records the request when the stream ends.
    pub(crate) fn into_body(self: Box<Self>, trail: Trail) -> Body {
        let body = RelayBody {
            relay: *self,
            trail: Some(trail),
            last_yield: None,
        };
        Body::from_stream(futures_util::stream::unfold(body, |mut body| async move {
            let chunk = body.next_chunk().await?;
            Some((Ok::<_, Infallible>(chunk), body))
        }))
    }

    /// Reads upstream until at least one event is ready or the stream ends,
    /// then takes what else is ready, up to [`COALESCE_BYTES`].
    async fn read(&mut self, trail: &mut Trail) -> Vec<u8> {
        let mut out = Vec::new();
        while out.is_empty() && self.tail.is_none() {
            let next = trail
                .clock
                .wait(tokio::time::timeout(
                    self.idle_timeout,
                    self.upstream.next(),
                ))
                .await;
            match next {
                Err(_) => self.interrupt(&format!(
                    "sent nothing for {} ms (limits.idle_timeout_ms)",
                    self.idle_timeout.as_millis()
                )),
                Ok(next) => self.take(next, &mut out),
            }
        }
        while self.tail.is_none() && out.len() < COALESCE_BYTES {
            match next_ready(&mut self.upstream, &mut trail.clock).await {
                Some(next) => self.take(next, &mut out),
                None => break,
            }
        }
        out
    }

    /// Appends the events of one upstream read to `out`, or ends the stream.
    fn take(&mut self, next: Option<Result<Bytes, SourceError>>, out: &mut Vec<u8>) {
        match next {
            None => {
                let detail = early_end(&mut self.parser);
                self.interrupt(detail);
            }
            Some(Err(error)) => self.interrupt(&format!("stream failed: {}", error_chain(&*error))),
            Some(Ok(bytes)) => {
                self.parser.feed(&bytes, &mut self.events);
                for event in self.events.drain(..) {
                    if event.is_done() {
                        self.tail = Some(b"data: [DONE]\n\n".to_vec());
                        break;
                    }
                    if let Some(name) = &event.event {
                        out.extend_from_slice(b"event: ");
                        out.extend_from_slice(name.as_bytes());
                        out.push(b'\n');
                    }
                    encode_data(&event.data, out);
                }
            }
        }
    }

    fn interrupt(&mut self, detail: &str) {
        let message = format!(
            "Provider `{}` {detail}; the answer is incomplete.",
            self.provider
        );
        tracing::warn!(provider = %self.provider, "stream interrupted: {detail}");
        let mut tail = Vec::new();
        encode_data(
            &error_body(&message, "upstream_error", STREAM_INTERRUPTED, None).to_string(),
            &mut tail,
        );
        self.tail = Some(tail);
        self.interrupted = true;
    }
}

impl RelayBody {
    async fn next_chunk(&mut self) -> Option<Bytes> {
        let trail = self.trail.as_mut()?;
        if let Some(yielded) = self.last_yield.take() {
            // Between our yield and this poll the client connection was writing.
            trail.clock.add_waiting(yielded.elapsed());
        }
        if self.relay.tail.is_none() {
            let out = self.relay.read(trail).await;
            if !out.is_empty() {
                trail.sent(&out);
                self.last_yield = Some(Instant::now());
                return Some(Bytes::from(out));
            }
        }
        // The end: record, durably, then send the last bytes.
        let mut trail = self.trail.take()?;
        let tail = self.relay.tail.take().unwrap_or_default();
        trail.sent(&tail);
        let outcome = if self.relay.interrupted {
            Outcome::InterruptedByUpstream
        } else {
            Outcome::Complete
        };
        match trail.commit(outcome, self.relay.action).await {
            Ok(()) => Some(Bytes::from(tail)),
            Err(error) => {
                tracing::error!("audit append failed: {error}; the stream ends in an error");
                let mut bytes = Vec::new();
                encode_data(
                    &crate::verified::audit_failure_body().to_string(),
                    &mut bytes,
                );
                Some(Bytes::from(bytes))
            }
        }
    }
}

impl Drop for RelayBody {
    fn drop(&mut self) {
        // The client went away before the end: record the request as interrupted.
        if let Some(trail) = self.trail.take() {
            let action = self.relay.action;
            tokio::spawn(async move {
                if let Err(error) = trail.commit(Outcome::InterruptedByClient, action).await {
                    tracing::error!("audit append of an interrupted stream failed: {error}");
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::{Notify, Semaphore, mpsc};

    use super::*;
    use crate::audit::{AuditLog, AuditOptions};
    use crate::metrics::Metrics;

    /// SSE events handed over one at a time, as hyper hands over a response
    /// body: the producer task pushes the next event only once the previous
    /// one was taken. After `pause_after` events it waits for `resume`.
    fn one_at_a_time(events: usize, pause_after: usize, resume: Arc<Notify>) -> ByteStream {
        let (sender, receiver) = mpsc::channel::<Bytes>(1);
        tokio::spawn(async move {
            for n in 0..events {
                if n == pause_after {
                    resume.notified().await;
                }
                let event = Bytes::from(format!("data: {{\"n\":{n}}}\n\n"));
                if sender.send(event).await.is_err() {
                    return;
                }
            }
            let _ = sender.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        });
        received(receiver)
    }

    /// The upstream body: what a producer task sends, chunk by chunk.
    fn received(receiver: mpsc::Receiver<Bytes>) -> ByteStream {
        Box::pin(futures_util::stream::unfold(
            receiver,
            |mut receiver| async {
                let chunk = receiver.recv().await?;
                Some((Ok(chunk), receiver))
            },
        ))
    }

    fn relay(upstream: ByteStream) -> Relay {
        let permit = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        Relay::new(
            upstream,
            Action::Forward,
            "sim".into(),
            Duration::from_secs(5),
            permit,
        )
    }

    fn events_in(bytes: &[u8]) -> usize {
        String::from_utf8_lossy(bytes).matches("data: {").count()
    }

    #[tokio::test]
    async fn events_already_sent_leave_in_one_write_and_a_pause_ends_it() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
        let mut trail = Trail::start(log, "r1", Arc::new(Metrics::new()));
        let resume = Arc::new(Notify::new());
        let mut relay = relay(one_at_a_time(60, 40, resume.clone()));

        // 40 events are ready, one at a time: one read takes them all, and
        // returns without waiting for the 41st.
        let first = tokio::time::timeout(Duration::from_secs(5), relay.read(&mut trail))
            .await
            .expect("a pause upstream must not hold back what is ready");
        assert_eq!(events_in(&first), 40);
        assert!(relay.tail.is_none());

        resume.notify_one();
        let rest = relay.read(&mut trail).await;
        assert_eq!(events_in(&rest), 20);
        assert_eq!(relay.tail.as_deref(), Some(b"data: [DONE]\n\n".as_slice()));
        assert!(String::from_utf8_lossy(&rest).ends_with("data: {\"n\":59}\n\n"));
    }

    #[tokio::test]
    async fn time_yielded_to_the_provider_counts_as_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
        let mut trail = Trail::start(log, "r1", Arc::new(Metrics::new()));
        // The provider's side works 20 ms on each event after the first,
        // blocking this single-threaded runtime as a busy connection task
        // would: some of that falls in the relay's yields.
        let (sender, receiver) = mpsc::channel::<Bytes>(1);
        tokio::spawn(async move {
            for n in 0..5 {
                if n > 0 {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let event = Bytes::from(format!("data: {{\"n\":{n}}}\n\n"));
                if sender.send(event).await.is_err() {
                    return;
                }
            }
            let _ = sender.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        });
        let mut relay = relay(received(receiver));
        let mut events = 0;
        while relay.tail.is_none() {
            events += events_in(&relay.read(&mut trail).await);
        }
        assert_eq!(events, 5);
        let overhead = trail.clock.overhead();
        assert!(
            overhead < Duration::from_millis(15),
            "the provider's 80 ms counted as the proxy's own time: {overhead:?}"
        );
    }
}
