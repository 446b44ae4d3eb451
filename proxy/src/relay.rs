//! Streaming relay: upstream SSE in, client SSE out, one event at a time.
//!
//! The relay pulls from the provider only when the client's connection asks for
//! more (hyper polls the body stream when its write buffer has room), so a slow
//! client slows the provider read instead of growing a buffer. Dropping the
//! stream (the client went away) drops the upstream response, which closes the
//! upstream connection and so cancels the request there.
//!
//! A stream never ends in a way that looks clean unless the provider sent
//! `[DONE]`: a failure, a timeout or an early close ends it with an explicit
//! error event in OpenAI's format.

use std::convert::Infallible;
use std::pin::Pin;
use std::time::{Duration, Instant};

use bytes::Bytes;
use canarygate_policies::sse::{SseEvent, SseParser, encode_data};
use futures_util::{Stream, StreamExt};

use crate::clock::RequestClock;
use crate::error::{error_body, error_chain};

/// Error code of the event that ends an interrupted stream.
pub const STREAM_INTERRUPTED: &str = "upstream_stream_interrupted";

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// How a relayed stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// The provider sent `[DONE]`.
    Done,
    /// The provider failed, stalled or closed early; the client got an error event.
    Interrupted,
}

struct Relay {
    upstream: ByteStream,
    parser: SseParser,
    events: Vec<SseEvent>,
    idle_timeout: Duration,
    provider: String,
    clock: RequestClock,
    last_yield: Option<Instant>,
    end: Option<StreamEnd>,
}

/// Relays the SSE body of `response` to the client.
pub fn relay_sse(
    response: reqwest::Response,
    provider: String,
    idle_timeout: Duration,
    clock: RequestClock,
) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
    let relay = Relay {
        upstream: Box::pin(response.bytes_stream()),
        parser: SseParser::new(),
        events: Vec::new(),
        idle_timeout,
        provider,
        clock,
        last_yield: None,
        end: None,
    };
    futures_util::stream::unfold(relay, |mut relay| async move {
        if relay.end.is_some() {
            return None;
        }
        let chunk = relay.next_chunk().await;
        Some((Ok(chunk), relay))
    })
}

impl Relay {
    /// Reads upstream until at least one event is ready (or the stream ends)
    /// and returns the bytes to send.
    async fn next_chunk(&mut self) -> Bytes {
        let resumed = Instant::now();
        if let Some(yielded) = self.last_yield {
            // Between our yield and this poll the client connection was writing.
            self.clock.add_waiting(resumed - yielded);
        }
        let mut out = Vec::new();
        while out.is_empty() && self.end.is_none() {
            let next = self
                .clock
                .wait(tokio::time::timeout(
                    self.idle_timeout,
                    self.upstream.next(),
                ))
                .await;
            match next {
                Err(_) => self.interrupt(
                    &mut out,
                    &format!(
                        "no data for {} ms (limits.idle_timeout_ms)",
                        self.idle_timeout.as_millis()
                    ),
                ),
                Ok(None) => {
                    let detail = if self.parser.finish() {
                        "closed the stream in the middle of an event"
                    } else {
                        "closed the stream without sending [DONE]"
                    };
                    self.interrupt(&mut out, detail);
                }
                Ok(Some(Err(error))) => {
                    self.interrupt(&mut out, &format!("stream failed: {}", error_chain(&error)))
                }
                Ok(Some(Ok(bytes))) => {
                    self.parser.feed(&bytes, &mut self.events);
                    for event in self.events.drain(..) {
                        if event.is_done() {
                            out.extend_from_slice(b"data: [DONE]\n\n");
                            self.end = Some(StreamEnd::Done);
                            break;
                        }
                        if let Some(name) = &event.event {
                            out.extend_from_slice(b"event: ");
                            out.extend_from_slice(name.as_bytes());
                            out.push(b'\n');
                        }
                        encode_data(&event.data, &mut out);
                    }
                }
            }
        }
        self.last_yield = Some(Instant::now());
        Bytes::from(out)
    }

    fn interrupt(&mut self, out: &mut Vec<u8>, detail: &str) {
        let message = format!(
            "Provider `{}` {detail}; the answer is incomplete.",
            self.provider
        );
        tracing::warn!(provider = %self.provider, "stream interrupted: {detail}");
        encode_data(
            &error_body(&message, "upstream_error", STREAM_INTERRUPTED, None).to_string(),
            out,
        );
        self.end = Some(StreamEnd::Interrupted);
    }
}
