//! SSE relay: a stream of events (the provider's, with checks off, or the
//! local engine's) passed to the client as they come.
//!
//! The relay pulls from its source only when the client's connection asks for
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
//! A stream never ends in a way that looks clean unless the source sent its
//! end marker: a failure, a timeout or an early close ends it with an
//! explicit error event in the wire format's shape. The last bytes go out
//! only once the audit record is durable ([`crate::body`]).

use std::marker::PhantomData;
use std::pin::Pin;
use std::time::{Duration, Instant};

use bytes::Bytes;
use canarygate_policies::sse::{SseEvent, SseParser, encode_data};
use futures_util::{FutureExt, Stream, StreamExt};
use http_body_util::BodyExt;
use tokio::sync::OwnedSemaphorePermit;

use crate::body::StreamSource;
use crate::clock::RequestClock;
use crate::error::{ApiError, ErrorCode, error_chain};
use crate::trail::{Ending, Trail};
use crate::upstream_client::UpstreamResponse;
use crate::wire::WireFormat;

/// Most bytes gathered for one write to the client.
pub const COALESCE_BYTES: usize = 16 * 1024;

/// Scheduler rounds [`next_ready`] gives the provider's connection task.
const READY_ROUNDS: usize = 2;

/// The next item of `upstream` if it is ready now, or within
/// [`READY_ROUNDS`] yields to the scheduler; `None` when it is not.
/// `Some(None)`: the stream ended. The time counts on `clock` as waiting on
/// the provider, like awaiting its next chunk.
///
/// hyper's pooled client drives each provider connection in a task of its
/// own, and hands a response body over one chunk at a time: that task
/// decodes the next chunk from its read buffer only after the previous one
/// was taken (HTTP/1.1; over HTTP/2 it moves frames already received into
/// the stream's queue as it reads them), and it runs after the tasks
/// already queued on this worker. Yielding lets it run, so events that
/// arrived together leave together; when the provider has sent nothing more
/// this costs two empty scheduler rounds, microseconds. The first event of
/// a read is never held: it is taken by [`next_within`] as it comes, and
/// only what is ready behind it joins its write.
pub async fn next_ready<S: Stream + Unpin>(
    upstream: &mut S,
    clock: &mut RequestClock,
) -> Option<Option<S::Item>> {
    // What is ready now costs no wait (and no read of the clock).
    if let Some(item) = upstream.next().now_or_never() {
        return Some(item);
    }
    clock
        .wait(async {
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

/// The next item of `upstream`, waiting at most what `wait` says (asked
/// only when nothing is ready now: what is ready needs no timer, and no
/// read of the clock); the wait counts on `clock` as waiting on the
/// provider. `Err` when nothing came in time.
pub async fn next_within<S: Stream + Unpin>(
    upstream: &mut S,
    clock: &mut RequestClock,
    wait: impl FnOnce() -> Duration,
) -> Result<Option<S::Item>, tokio::time::error::Elapsed> {
    if let Some(item) = upstream.next().now_or_never() {
        return Ok(item);
    }
    clock
        .wait(tokio::time::timeout(wait(), upstream.next()))
        .await
}

/// How a stream that ended without its end marker ended, for the error event.
pub fn early_end(parser: &mut SseParser) -> &'static str {
    if parser.finish() {
        "closed the stream in the middle of an event"
    } else {
        "closed the stream before its end marker"
    }
}

/// The error that ends a stream the provider broke off.
pub fn interrupted(provider: &str, detail: &str) -> ApiError {
    ApiError::new(
        ErrorCode::UpstreamStreamInterrupted,
        format!("Provider `{provider}` {detail}; the answer is incomplete."),
    )
}

/// Any error a byte source can fail with.
type SourceError = Box<dyn std::error::Error + Send + Sync>;

type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, SourceError>> + Send>>;

/// An SSE stream on its way to the client, in wire format `W`.
pub struct Relay<W> {
    upstream: ByteStream,
    parser: SseParser,
    events: Vec<SseEvent>,
    idle_timeout: Duration,
    /// Until the first event, when it must have come (the provider's
    /// first-byte deadline; comments before it do not put it off). `None`
    /// once it came, or for the local engine.
    first_event_by: Option<Instant>,
    /// Who sends the events (the provider's name, or `local`).
    source: String,
    /// The last bytes: the end marker or the error event.
    tail: Option<Vec<u8>>,
    interrupted: bool,
    _permit: OwnedSemaphorePermit,
    wire: PhantomData<fn() -> W>,
}

impl<W: WireFormat> Relay<W> {
    /// Relays the SSE body of the provider's `response`, whose first event
    /// must come by `first_event_by`; the permit is held until it ends.
    pub fn provider(
        response: UpstreamResponse,
        provider: String,
        idle_timeout: Duration,
        first_event_by: Instant,
        permit: OwnedSemaphorePermit,
    ) -> Self {
        let mut relay = Self::new(
            Box::pin(
                response
                    .into_body()
                    .into_data_stream()
                    .map(|chunk| chunk.map_err(SourceError::from)),
            ),
            provider,
            idle_timeout,
            permit,
        );
        relay.first_event_by = Some(first_event_by);
        relay
    }

    /// Relays an SSE stream produced in this process (the local engine's).
    pub fn local(
        stream: impl Stream<Item = Bytes> + Send + 'static,
        source: String,
        idle_timeout: Duration,
        permit: OwnedSemaphorePermit,
    ) -> Self {
        Self::new(Box::pin(stream.map(Ok)), source, idle_timeout, permit)
    }

    fn new(
        upstream: ByteStream,
        source: String,
        idle_timeout: Duration,
        permit: OwnedSemaphorePermit,
    ) -> Self {
        Self {
            upstream,
            parser: SseParser::new(),
            events: Vec::new(),
            idle_timeout,
            first_event_by: None,
            source,
            tail: None,
            interrupted: false,
            _permit: permit,
            wire: PhantomData,
        }
    }

    /// Reads upstream until at least one event is ready or the stream ends,
    /// then takes what else is ready, up to [`COALESCE_BYTES`].
    async fn read(&mut self, clock: &mut RequestClock) -> Vec<u8> {
        let mut out = Vec::new();
        // Since when no whole event came: bytes of one that never ends, and
        // comments alone, do not put the idle timeout off.
        let mut idle_since = None;
        while out.is_empty() && self.tail.is_none() {
            let (first_event_by, idle_timeout) = (self.first_event_by, self.idle_timeout);
            let wait = || {
                let now = Instant::now();
                let by = match first_event_by {
                    Some(first) => first,
                    None => *idle_since.get_or_insert(now) + idle_timeout,
                };
                by.saturating_duration_since(now)
            };
            match next_within(&mut self.upstream, clock, wait).await {
                Err(_) if self.first_event_by.is_some() => self.interrupt(
                    "sent no event by its first-byte deadline (limits.first_byte_timeout_ms), \
                     keep-alives aside",
                ),
                Err(_) => self.interrupt(&format!(
                    "sent no whole event for {} ms (limits.idle_timeout_ms)",
                    self.idle_timeout.as_millis()
                )),
                Ok(next) => self.take(next, &mut out),
            }
        }
        while self.tail.is_none() && out.len() < COALESCE_BYTES {
            match next_ready(&mut self.upstream, clock).await {
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
                if !self.events.is_empty() {
                    self.first_event_by = None;
                }
                for event in self.events.drain(..) {
                    let start = out.len();
                    if let Some(name) = &event.event {
                        out.extend_from_slice(b"event: ");
                        out.extend_from_slice(name.as_bytes());
                        out.push(b'\n');
                    }
                    encode_data(&event.data, out);
                    if W::is_end_marker(&event) {
                        self.tail = Some(out.split_off(start));
                        break;
                    }
                }
            }
        }
    }

    fn interrupt(&mut self, detail: &str) {
        tracing::warn!(provider = %self.source, "stream interrupted: {detail}");
        self.tail = Some(W::error_event(&interrupted(&self.source, detail)));
        self.interrupted = true;
    }
}

impl<W: WireFormat> StreamSource for Relay<W> {
    async fn next_bytes(&mut self, clock: &mut RequestClock) -> Option<Vec<u8>> {
        if self.tail.is_some() {
            return None;
        }
        let out = self.read(clock).await;
        (!out.is_empty()).then_some(out)
    }

    fn finish(&mut self, trail: &mut Trail) -> (Vec<u8>, Ending) {
        if self.interrupted {
            trail.upstream_interrupted();
        }
        (
            self.tail.take().unwrap_or_default(),
            Ending::Stream { blocked: false },
        )
    }

    fn abandon(&mut self, _trail: &mut Trail) {}

    fn error_event(&self, error: &ApiError) -> Vec<u8> {
        W::error_event(error)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::{Notify, Semaphore, mpsc};

    use super::*;
    use crate::metrics::Metrics;
    use crate::wire::chat::Chat;

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

    fn relay(upstream: ByteStream) -> Relay<Chat> {
        let permit = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        Relay::new(upstream, "sim".into(), Duration::from_secs(5), permit)
    }

    fn events_in(bytes: &[u8]) -> usize {
        String::from_utf8_lossy(bytes).matches("data: {").count()
    }

    #[tokio::test]
    async fn events_already_sent_leave_in_one_write_and_a_pause_ends_it() {
        let mut clock = RequestClock::start(Arc::new(Metrics::new()));
        let resume = Arc::new(Notify::new());
        let mut relay = relay(one_at_a_time(60, 40, resume.clone()));

        // 40 events are ready, one at a time: one read takes them all, and
        // returns without waiting for the 41st.
        let first = tokio::time::timeout(Duration::from_secs(5), relay.read(&mut clock))
            .await
            .expect("a pause upstream must not hold back what is ready");
        assert_eq!(events_in(&first), 40);
        assert!(relay.tail.is_none());

        resume.notify_one();
        let rest = relay.read(&mut clock).await;
        assert_eq!(events_in(&rest), 20);
        assert_eq!(relay.tail.as_deref(), Some(b"data: [DONE]\n\n".as_slice()));
        assert!(String::from_utf8_lossy(&rest).ends_with("data: {\"n\":59}\n\n"));
    }

    #[tokio::test]
    async fn time_yielded_to_the_provider_counts_as_waiting() {
        let mut clock = RequestClock::start(Arc::new(Metrics::new()));
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
            events += events_in(&relay.read(&mut clock).await);
        }
        assert_eq!(events, 5);
        let overhead = clock.overhead();
        assert!(
            overhead < Duration::from_millis(15),
            "the provider's 80 ms counted as the proxy's own time: {overhead:?}"
        );
    }
}
