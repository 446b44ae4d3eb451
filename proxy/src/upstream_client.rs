//! The HTTP client a provider is called with: hyper's pooled client over
//! hyper-rustls, so upstream I/O is one layer and its every setting is here.
//!
//! - **Connections** are pooled per provider: kept idle for
//!   [`POOL_IDLE_TIMEOUT`], at most [`POOL_MAX_IDLE_PER_HOST`] of them, TCP
//!   without Nagle (a streamed token leaves at once) and with TCP keepalive
//!   probes after 15 s of silence.
//! - **HTTP/2** is used where the provider offers it over TLS (ALPN `h2`,
//!   else `http/1.1`); plain `http://` speaks HTTP/1.1.
//! - **TLS** is rustls with the ring provider, trusting the Mozilla roots
//!   (webpki-roots) and the provider's `extra_ca_file`.
//! - **Deadlines**: connecting (TCP and the TLS handshake together) within
//!   `limits.connect_timeout_ms`, here; every read of a whole body within
//!   `limits.idle_timeout_ms` ([`read_whole`]), here too; the response head
//!   and a stream's reads have theirs where they are awaited
//!   ([`crate::context`], [`crate::relay`]).
//! - **No proxy** from the environment: `HTTP(S)_PROXY` are not read; the
//!   provider is called at its `base_url` itself.
//! - **Nothing is retried or redirected**: a retry is a policy decision, and
//!   a redirect's answer is the provider's to give to the client. (hyper
//!   sends a request again on a fresh connection only when a pooled one
//!   closed before the request was written.)
//!
//! What a failed send was ([`SendFailure`]) is read from the error here, so
//! the client-facing mapping ([`crate::upstream::Upstream::send_error`]) does
//! not depend on the client's error types.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Uri;
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls_pki_types::CertificateDer;
use tokio::net::TcpStream;
use tower_service::Service;

use crate::clock::RequestClock;
use crate::error::{ApiError, ErrorCode, error_chain};

/// Largest upstream response body read whole (a non-streamed answer).
pub const MAX_UPSTREAM_BODY: usize = 64 * 1024 * 1024;

/// How long an idle pooled connection is kept.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Most idle connections kept per provider host.
pub const POOL_MAX_IDLE_PER_HOST: usize = 1024;

/// Idle time before the first TCP keepalive probe, and between probes.
const TCP_KEEPALIVE: Duration = Duration::from_secs(15);

/// Unanswered keepalive probes before the connection counts as dead.
const TCP_KEEPALIVE_RETRIES: u32 = 3;

/// A request to a provider.
pub type UpstreamRequest = hyper::Request<Full<Bytes>>;

pub use crate::upstream_body::UpstreamBody;

/// A provider's response: the head, and the body as it arrives.
pub type UpstreamResponse = hyper::Response<UpstreamBody>;

/// A failed send, as hyper's client reports it.
pub type SendError = hyper_util::client::legacy::Error;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One provider's pooled client (cheap to clone: the pool is shared).
#[derive(Clone)]
pub struct UpstreamClient {
    client: Client<TimedConnector, Full<Bytes>>,
}

impl UpstreamClient {
    /// A client trusting the webpki roots and `extra_roots`, connecting
    /// within `connect_timeout`.
    pub fn new(
        extra_roots: Vec<CertificateDer<'static>>,
        connect_timeout: Duration,
    ) -> Result<Self, rustls::Error> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        for root in extra_roots {
            roots.add(root)?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut tcp = HttpConnector::new();
        // `https://` is handled by the TLS layer above it.
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        tcp.set_keepalive(Some(TCP_KEEPALIVE));
        tcp.set_keepalive_interval(Some(TCP_KEEPALIVE));
        tcp.set_keepalive_retries(Some(TCP_KEEPALIVE_RETRIES));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(tcp);
        let connector = TimedConnector {
            inner: https,
            timeout: connect_timeout,
        };
        let client = Client::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(POOL_MAX_IDLE_PER_HOST)
            .build(connector);
        Ok(Self { client })
    }

    /// Sends `request` and resolves with the response head (no deadline of
    /// its own beyond connecting: callers set the head's).
    pub async fn send(&self, request: UpstreamRequest) -> Result<UpstreamResponse, SendError> {
        let response = self.client.request(request).await?;
        Ok(response.map(UpstreamBody::from))
    }
}

/// How long reading a whole answer's body may take.
#[derive(Debug, Clone, Copy)]
pub struct BodyDeadlines {
    /// The longest wait for its next chunk (`limits.idle_timeout_ms`).
    pub idle: Duration,
    /// The longest it may take, from its head (`limits.first_byte_timeout_ms`):
    /// a provider that trickles bytes never waits long for the next.
    pub whole: Duration,
}

/// Reads the whole body of `provider`'s `response` (at most
/// [`MAX_UPSTREAM_BODY`]) within `deadlines`; the waits count on `clock` as
/// waiting on the provider. An answer that came in one chunk is returned as
/// it is, uncopied.
pub async fn read_whole(
    provider: &str,
    clock: &mut RequestClock,
    response: UpstreamResponse,
    deadlines: BodyDeadlines,
) -> Result<Bytes, ApiError> {
    let mut body = response.into_body();
    let whole_by = body.head_at() + deadlines.whole;
    let announced = usize::try_from(hyper::body::Body::size_hint(&body).exact().unwrap_or(0))
        .unwrap_or(MAX_UPSTREAM_BODY)
        .min(MAX_UPSTREAM_BODY);
    // The only chunk so far, kept uncopied; `joined` once there are more.
    let mut single: Option<Bytes> = None;
    let mut joined = Vec::new();
    loop {
        let idle_by = tokio::time::Instant::now() + deadlines.idle;
        match clock
            .wait(tokio::time::timeout_at(idle_by.min(whole_by), body.frame()))
            .await
        {
            Err(_) if idle_by < whole_by => {
                return Err(ApiError::new(
                    ErrorCode::UpstreamTimeout,
                    format!(
                        "Provider `{provider}` stopped sending its answer for {} ms \
                         (limits.idle_timeout_ms).",
                        deadlines.idle.as_millis()
                    ),
                ));
            }
            Err(_) => {
                return Err(ApiError::new(
                    ErrorCode::UpstreamTimeout,
                    format!(
                        "Provider `{provider}` did not finish sending its answer within {} ms \
                         of its head (limits.first_byte_timeout_ms).",
                        deadlines.whole.as_millis()
                    ),
                ));
            }
            Ok(None) => return Ok(single.unwrap_or_else(|| Bytes::from(joined))),
            Ok(Some(Err(error))) => {
                return Err(ApiError::new(
                    ErrorCode::UpstreamError,
                    format!(
                        "Provider `{provider}` failed while sending its answer: {}",
                        error_chain(&error)
                    ),
                ));
            }
            Ok(Some(Ok(frame))) => {
                // Trailers (HTTP/2) carry no answer.
                let Ok(chunk) = frame.into_data() else {
                    continue;
                };
                let received = single.as_ref().map_or(joined.len(), Bytes::len);
                if received + chunk.len() > MAX_UPSTREAM_BODY {
                    return Err(ApiError::new(
                        ErrorCode::UpstreamResponseTooLarge,
                        format!("Provider `{provider}` sent more than {MAX_UPSTREAM_BODY} bytes."),
                    ));
                }
                match single.take() {
                    None if joined.is_empty() => single = Some(chunk),
                    None => joined.extend_from_slice(&chunk),
                    Some(first) => {
                        joined.reserve(announced.max(first.len() + chunk.len()));
                        joined.extend_from_slice(&first);
                        joined.extend_from_slice(&chunk);
                    }
                }
            }
        }
    }
}

/// What kind of failure a failed send was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendFailure {
    /// Connecting (TCP or the TLS handshake) ran past its deadline, or the
    /// system timed the connection out.
    Timeout,
    /// The TLS handshake failed on the provider's certificate.
    Certificate,
    /// No connection could be made (refused, unresolvable, reset, TLS).
    Connect,
    /// The connection was made, and the exchange failed on it.
    Exchange,
}

impl SendFailure {
    /// The kind of `error`.
    pub fn of(error: &SendError) -> Self {
        let mut source = std::error::Error::source(error);
        while let Some(cause) = source {
            let timed_out = cause.is::<ConnectTimeout>()
                || cause
                    .downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut);
            if timed_out {
                return Self::Timeout;
            }
            source = cause.source();
        }
        if !error.is_connect() {
            Self::Exchange
        } else if error_chain(error).contains("certificate") {
            Self::Certificate
        } else {
            Self::Connect
        }
    }
}

/// Connecting ran past `limits.connect_timeout_ms`.
#[derive(Debug, thiserror::Error)]
#[error("connecting took longer than {} ms (limits.connect_timeout_ms)", .0.as_millis())]
pub struct ConnectTimeout(Duration);

/// The TLS-or-plain connector, with one deadline over the TCP connect and
/// the TLS handshake together.
#[derive(Clone)]
struct TimedConnector {
    inner: HttpsConnector<HttpConnector>,
    timeout: Duration,
}

type Connecting =
    Pin<Box<dyn Future<Output = Result<MaybeHttpsStream<TokioIo<TcpStream>>, BoxError>> + Send>>;

impl Service<Uri> for TimedConnector {
    type Response = MaybeHttpsStream<TokioIo<TcpStream>>;
    type Error = BoxError;
    type Future = Connecting;

    fn poll_ready(&mut self, context: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(context)
    }

    fn call(&mut self, uri: Uri) -> Connecting {
        let connecting = self.inner.call(uri);
        let timeout = self.timeout;
        Box::pin(async move {
            tokio::time::timeout(timeout, connecting)
                .await
                .unwrap_or_else(|_| Err(ConnectTimeout(timeout).into()))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    use futures_util::StreamExt;
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    use hyper::service::service_fn;
    use tokio::net::TcpListener;

    use super::*;
    use crate::metrics::Metrics;

    /// An HTTP/1.1 server on a local port answering every request with
    /// `chunks`, each its own chunk of a chunked body, and then ending the
    /// body or, when `stall`, never; the URL and how many connections it
    /// accepted.
    async fn serve_chunks_then(
        chunks: &'static [&'static str],
        stall: bool,
    ) -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let service = service_fn(move |_request| async move {
                    let frames = chunks.iter().map(|chunk| {
                        Ok::<_, Infallible>(Frame::data(Bytes::from_static(chunk.as_bytes())))
                    });
                    let rest = match stall {
                        true => futures_util::stream::pending().left_stream(),
                        false => futures_util::stream::empty().right_stream(),
                    };
                    let body = StreamBody::new(futures_util::stream::iter(frames).chain(rest));
                    Ok::<_, Infallible>(hyper::Response::new(body))
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        (url, accepted)
    }

    /// [`serve_chunks_then`] ending each body after its chunks.
    async fn serve_chunks(chunks: &'static [&'static str]) -> (String, Arc<AtomicUsize>) {
        serve_chunks_then(chunks, false).await
    }

    fn get(url: &str) -> UpstreamRequest {
        let mut request = UpstreamRequest::new(Full::new(Bytes::new()));
        *request.uri_mut() = url.parse().unwrap();
        request
    }

    #[tokio::test]
    async fn connections_are_pooled_and_chunked_answers_read_whole() {
        let (url, accepted) = serve_chunks(&["{\"answer\":", " \"in three", " chunks\"}"]).await;
        let client = UpstreamClient::new(Vec::new(), Duration::from_secs(5)).unwrap();
        let mut clock = RequestClock::start(Arc::new(Metrics::new()));
        for _ in 0..3 {
            let response = client.send(get(&url)).await.unwrap();
            let deadlines = BodyDeadlines {
                idle: Duration::from_secs(5),
                whole: Duration::from_secs(5),
            };
            let body = read_whole("sim", &mut clock, response, deadlines)
                .await
                .unwrap();
            assert_eq!(&body[..], b"{\"answer\": \"in three chunks\"}");
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "three requests in turn share one connection"
        );
    }

    #[tokio::test]
    async fn reading_ahead_and_reading_whole_share_one_deadline_from_the_head() {
        // Whitespace, then nothing: a body whose format never shows.
        let (url, _) = serve_chunks_then(&["\n"], true).await;
        let client = UpstreamClient::new(Vec::new(), Duration::from_secs(5)).unwrap();
        let mut response = client.send(get(&url)).await.unwrap();
        let whole = Duration::from_millis(3000);
        tokio::time::sleep(Duration::from_millis(2000)).await;
        let reading_ahead = Instant::now();
        assert_eq!(response.body_mut().first_byte(whole).await, None);
        assert!(
            reading_ahead.elapsed() < Duration::from_millis(2500),
            "the read-ahead waits what is left of the deadline, not all of it: {:?}",
            reading_ahead.elapsed()
        );
        let mut clock = RequestClock::start(Arc::new(Metrics::new()));
        let deadlines = BodyDeadlines {
            idle: Duration::from_secs(30),
            whole,
        };
        let reading = Instant::now();
        let error = read_whole("sim", &mut clock, response, deadlines)
            .await
            .unwrap_err();
        assert!(
            reading.elapsed() < Duration::from_millis(1500),
            "the deadline had passed: {:?}",
            reading.elapsed()
        );
        assert!(
            error.to_string().contains("limits.first_byte_timeout_ms"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn the_connect_deadline_covers_the_tls_handshake() {
        // Accepts TCP and never answers the TLS client hello.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let client = UpstreamClient::new(Vec::new(), Duration::from_millis(200)).unwrap();
        let started = Instant::now();
        let error = tokio::time::timeout(Duration::from_secs(10), client.send(get(&url)))
            .await
            .expect("the connect deadline ends the send")
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(3));
        assert_eq!(SendFailure::of(&error), SendFailure::Timeout);
        assert!(
            error_chain(&error).contains("limits.connect_timeout_ms"),
            "{}",
            error_chain(&error)
        );
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_failure() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        drop(listener);
        let client = UpstreamClient::new(Vec::new(), Duration::from_secs(5)).unwrap();
        let error = client.send(get(&url)).await.unwrap_err();
        assert_eq!(SendFailure::of(&error), SendFailure::Connect);
    }
}
