//! What a path hands back ([`Served`]), and the one audited response body
//! every stream goes out through ([`StreamSource`], [`stream_body`]).
//!
//! The rule for both shapes: the audit record is durable before the client
//! gets the last byte. A whole response is held until its record is
//! committed ([`deliver_whole`]); a stream's last bytes (its end marker or
//! its closing error event) are. When the record cannot be made durable the
//! answer is withheld: HTTP 500, or an error event instead of the end. A
//! client that goes away mid-stream still gets its request recorded.

use std::convert::Infallible;
use std::future::Future;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::response::Response;

use crate::clock::RequestClock;
use crate::context::error_response;
use crate::error::ApiError;
use crate::trail::{Ending, Trail};
use crate::wire::WireFormat;

/// What a path produced.
pub enum Served {
    /// A whole response: an answer or an error.
    Whole(Response),
    /// A stream: its head now; its body, given the trail, records the end.
    Stream(Response, PendingBody),
}

/// A stream's body, waiting for the request's trail.
pub struct PendingBody(Box<dyn FnOnce(Trail) -> Body + Send>);

impl PendingBody {
    /// The body of `source`.
    pub fn new(source: impl StreamSource) -> Self {
        Self(Box::new(move |trail| stream_body(source, trail)))
    }

    /// The body, recording the request in `trail` when it ends.
    pub fn into_body(self, trail: Trail) -> Body {
        (self.0)(trail)
    }
}

/// Where a streamed answer's bytes come from: a relayed provider stream, a
/// verified one, or the local engine.
pub trait StreamSource: Send + 'static {
    /// The next bytes for the client; `None` once the stream has ended.
    /// Waiting on the provider counts on `clock`.
    fn next_bytes(
        &mut self,
        clock: &mut RequestClock,
    ) -> impl Future<Output = Option<Vec<u8>>> + Send;

    /// The stream has ended: records what it learnt in `trail`, and gives
    /// the last bytes (sent once the record is durable) and how it ended.
    fn finish(&mut self, trail: &mut Trail) -> (Vec<u8>, Ending);

    /// The client went away: records what is known in `trail`.
    fn abandon(&mut self, trail: &mut Trail);

    /// `error` as this stream's closing event.
    fn error_event(&self, error: &ApiError) -> Vec<u8>;
}

/// The response body of `source`: its bytes as they come, then, once the
/// record is durable, its last bytes.
pub fn stream_body(source: impl StreamSource, trail: Trail) -> Body {
    let body = AuditedBody {
        source,
        trail: Some(trail),
        last_yield: None,
    };
    Body::from_stream(futures_util::stream::unfold(body, |mut body| async move {
        let chunk = body.next_chunk().await?;
        Some((Ok::<_, Infallible>(chunk), body))
    }))
}

struct AuditedBody<S: StreamSource> {
    source: S,
    /// Taken at the end, to record the request.
    trail: Option<Trail>,
    last_yield: Option<Instant>,
}

impl<S: StreamSource> AuditedBody<S> {
    async fn next_chunk(&mut self) -> Option<Bytes> {
        let trail = self.trail.as_mut()?;
        if let Some(yielded) = self.last_yield.take() {
            // Between our yield and this poll the client connection was writing.
            trail.clock().add_waiting(yielded.elapsed());
        }
        if let Some(bytes) = self.source.next_bytes(trail.clock()).await {
            trail.sent(&bytes);
            self.last_yield = Some(Instant::now());
            return Some(Bytes::from(bytes));
        }
        // The end: record, durably, then send the last bytes.
        let mut trail = self.trail.take()?;
        let (tail, ending) = self.source.finish(&mut trail);
        trail.sent(&tail);
        match trail.commit(ending).await {
            Ok(()) if tail.is_empty() => None,
            Ok(()) => Some(Bytes::from(tail)),
            Err(error) => {
                tracing::error!("audit append failed: {error}; the stream ends in an error");
                Some(Bytes::from(
                    self.source.error_event(&ApiError::audit_unavailable()),
                ))
            }
        }
    }
}

impl<S: StreamSource> Drop for AuditedBody<S> {
    fn drop(&mut self) {
        // The client went away before the end: record the request as interrupted.
        if let Some(mut trail) = self.trail.take() {
            self.source.abandon(&mut trail);
            trail.commit_later(Ending::ClientLeft);
        }
    }
}

/// Appends the record of a request answered with one whole `response`
/// (format `W`), then returns that response; if the record cannot be made
/// durable, the answer is withheld (HTTP 500).
pub async fn deliver_whole<W: WireFormat>(mut trail: Trail, response: Response) -> Response {
    let (parts, body) = response.into_parts();
    // Whole responses are built from bytes in memory: collecting cannot fail or block.
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    trail.sent(&bytes);
    match trail.commit(Ending::Whole(parts.status)).await {
        Ok(()) => Response::from_parts(parts, Body::from(bytes)),
        Err(error) => {
            tracing::error!("audit append failed: {error}; the answer is withheld");
            error_response::<W>(&ApiError::audit_unavailable())
        }
    }
}
