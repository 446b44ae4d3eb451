//! One client connection: served by hyper in the protocol the client speaks
//! (HTTP/1.1 or HTTP/2), and watched for the deadlines no request handler
//! can see.
//!
//! Three parts meet in an [`Activity`]: the socket ([`WatchedStream`] notes
//! the first byte after an idle spell), the service ([`ConnectionService`]
//! counts the requests whose response is not finished), and the watchdog
//! ([`watch`]), which closes the connection when
//!
//! - its first request's head has not arrived `client_header_timeout_ms`
//!   after the accept, or a later head `client_header_timeout_ms` after its
//!   first byte (HTTP/1.1);
//! - no request has been on it for `client_keepalive_timeout_ms` (HTTP/1.1
//!   keep-alive, HTTP/2 without an open stream);
//! - the listener evicts it to make room at `limits.max_connections` (only
//!   a connection without a request in flight is evicted);
//! - writing to it has been blocked for `client_write_timeout_ms`: the
//!   client reads nothing of its answer (its receive window is full).
//!
//! Closing is graceful (an HTTP/2 GOAWAY, no cut response); a connection
//! that has not closed a moment later with no request on it is dropped. A
//! connection whose writes are stuck is dropped at once, its requests with
//! it (nothing could reach that client anyway).
//! Request bodies have their own deadlines, in admission.
//!
//! Longer than 500 lines: about 100 of them are the unit tests, which drive
//! the watchdog through `Activity`'s private state and so live here.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Request, Response, Version};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, watch};

use crate::metrics::Metrics;

/// HTTP/2 streams one connection may have open at once (RFC 9113 advises
/// no fewer than 100).
const H2_MAX_CONCURRENT_STREAMS: u32 = 100;

/// How often an HTTP/2 connection is pinged, and how long the answer may
/// take before the peer counts as gone (a vanished client's streams end).
const H2_PING_INTERVAL: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// After a graceful close began, how long a connection with no request
/// left may take to close by itself before it is dropped.
const CLOSE_LINGER: Duration = Duration::from_secs(1);

/// `first_byte_ms` when no byte has arrived since the connection went idle.
const NO_BYTE: u64 = u64::MAX;

/// The deadlines the watchdog holds a connection to.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionDeadlines {
    /// `limits.client_header_timeout_ms`.
    pub header: Duration,
    /// `limits.client_keepalive_timeout_ms`.
    pub keepalive: Duration,
    /// `limits.client_write_timeout_ms`.
    pub write: Duration,
}

/// What every connection shares: the router, hyper's builder, deadlines.
pub struct Shared {
    router: Router,
    http: auto::Builder<TokioExecutor>,
    deadlines: ConnectionDeadlines,
    metrics: Arc<Metrics>,
}

impl Shared {
    /// hyper configured for clients: both protocols, keep-alive, HTTP/2
    /// pings and a stream cap. hyper's own HTTP/1 header timeout stays off:
    /// it would also bound the keep-alive wait, which [`watch`] times
    /// separately.
    pub fn new(router: Router, deadlines: ConnectionDeadlines, metrics: Arc<Metrics>) -> Self {
        let mut http = auto::Builder::new(TokioExecutor::new());
        http.http1().keep_alive(true).header_read_timeout(None);
        http.http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(H2_MAX_CONCURRENT_STREAMS)
            .keep_alive_interval(H2_PING_INTERVAL)
            .keep_alive_timeout(H2_PING_TIMEOUT);
        Self {
            router,
            http,
            deadlines,
            metrics,
        }
    }
}

/// What one connection is doing, as its socket, its requests and its
/// watchdog see it. Times are milliseconds since `opened`.
pub struct Activity {
    opened: Instant,
    /// Requests whose response is not finished.
    requests: AtomicUsize,
    /// Whether a request has started on it (the first head has arrived).
    started: AtomicBool,
    /// Whether it speaks HTTP/2.
    multiplexed: AtomicBool,
    /// When the last response finished (0: the accept).
    idle_since_ms: AtomicU64,
    /// The first byte read since `idle_since_ms`, or [`NO_BYTE`].
    first_byte_ms: AtomicU64,
    /// Since when writing to the socket has been blocked, or [`NO_BYTE`]
    /// when the last write went through.
    write_blocked_ms: AtomicU64,
    /// The socket's descriptor, -1 until it is known: the watchdog asks how
    /// much it still holds to send ([`Activity::client_read_since_blocked`]).
    socket: AtomicI32,
    /// What the socket held to send when the watchdog saw writing block, or
    /// last saw the client read ([`NO_BYTE`]: unknown).
    unsent_when_blocked: AtomicU64,
    evicted: AtomicBool,
    /// Wakes the watchdog: a request started or the last one finished, a
    /// first byte arrived, an eviction.
    changed: Notify,
    /// Shared by all connections: wakes a listener waiting for one to go
    /// idle.
    went_idle: Arc<Notify>,
}

impl Activity {
    /// A connection accepted now; `went_idle` is notified each time it has
    /// no request left.
    pub fn new(went_idle: Arc<Notify>) -> Self {
        Self {
            opened: Instant::now(),
            requests: AtomicUsize::new(0),
            started: AtomicBool::new(false),
            multiplexed: AtomicBool::new(false),
            idle_since_ms: AtomicU64::new(0),
            first_byte_ms: AtomicU64::new(NO_BYTE),
            write_blocked_ms: AtomicU64::new(NO_BYTE),
            socket: AtomicI32::new(-1),
            unsent_when_blocked: AtomicU64::new(NO_BYTE),
            evicted: AtomicBool::new(false),
            changed: Notify::new(),
            went_idle,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    /// Since when it has had no request, when it has none (and is not
    /// already being evicted).
    pub fn idle_since(&self) -> Option<Instant> {
        (self.requests.load(Ordering::Acquire) == 0 && !self.evicted.load(Ordering::Acquire)).then(
            || self.opened + Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire)),
        )
    }

    /// Asks the connection to close (gracefully: a request whose head was
    /// read still gets its answer; one whose head was still arriving is
    /// dropped with the connection, which clients retry). False when it was
    /// asked already.
    pub fn evict(&self) -> bool {
        let first = !self.evicted.swap(true, Ordering::AcqRel);
        if first {
            self.changed.notify_one();
        }
        first
    }

    fn bytes_arrived(&self) {
        if self.requests.load(Ordering::Acquire) == 0
            && self.first_byte_ms.load(Ordering::Acquire) == NO_BYTE
            && self
                .first_byte_ms
                .compare_exchange(NO_BYTE, self.now_ms(), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.changed.notify_one();
        }
    }

    /// Bytes the socket still holds to send (written, not yet acknowledged
    /// by the client): Linux's `SIOCOUTQ`; `None` where it cannot be asked.
    fn unsent(&self) -> Option<u64> {
        let socket = self.socket.load(Ordering::Acquire);
        if socket < 0 {
            return None;
        }
        #[cfg(target_os = "linux")]
        {
            let mut unsent: libc::c_int = 0;
            // SAFETY: `SIOCOUTQ` (`TIOCOUTQ` on sockets) writes one int to the
            // pointer, which points at one; `socket` is this connection's own
            // descriptor, open while its watchdog runs.
            let asked = unsafe { libc::ioctl(socket, libc::TIOCOUTQ, &mut unsent) };
            (asked == 0).then(|| u64::try_from(unsent).unwrap_or(0))
        }
        #[cfg(not(target_os = "linux"))]
        None
    }

    /// Whether the client read some of what the socket held to send since
    /// writing blocked (or since the last time this said so): a client that
    /// reads slowly but steadily leaves writes blocked for long spells (the
    /// kernel wakes a writer only once a third of its buffer is free), and
    /// is not stuck.
    fn client_read_since_blocked(&self) -> bool {
        let Some(unsent) = self.unsent() else {
            return false;
        };
        let before = self.unsent_when_blocked.swap(unsent, Ordering::AcqRel);
        unsent < before
    }

    /// Notes how a write to the socket went: blocked (the first blocked
    /// write of a spell wakes the watchdog) or through.
    fn write_polled<T>(&self, polled: &Poll<T>) {
        let blocked = self.write_blocked_ms.load(Ordering::Acquire);
        match (polled.is_pending(), blocked == NO_BYTE) {
            (true, true) => {
                self.write_blocked_ms
                    .store(self.now_ms(), Ordering::Release);
                self.changed.notify_one();
            }
            (false, false) => self.write_blocked_ms.store(NO_BYTE, Ordering::Release),
            _ => {}
        }
    }

    fn request_started(self: &Arc<Self>, version: Version) -> RequestGuard {
        self.started.store(true, Ordering::Release);
        if version == Version::HTTP_2 {
            self.multiplexed.store(true, Ordering::Release);
        }
        if self.requests.fetch_add(1, Ordering::AcqRel) == 0 {
            self.changed.notify_one();
        }
        RequestGuard(Arc::clone(self))
    }

    fn request_finished(&self) {
        // Set before the count can reach 0, so that the watchdog never sees
        // an idle connection with the previous idle spell's times.
        self.idle_since_ms.store(self.now_ms(), Ordering::Release);
        self.first_byte_ms.store(NO_BYTE, Ordering::Release);
        if self.requests.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.changed.notify_one();
            self.went_idle.notify_waiters();
        }
    }

    /// When an idle connection must close, and which deadline that is.
    fn deadline_ms(&self, deadlines: &ConnectionDeadlines) -> (u64, Closed) {
        let millis = |duration: Duration| u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        let header = (millis(deadlines.header), Closed::TimedOut("header"));
        let keepalive = (millis(deadlines.keepalive), Closed::TimedOut("keepalive"));
        if !self.started.load(Ordering::Acquire) {
            return header;
        }
        let idle_since = self.idle_since_ms.load(Ordering::Acquire);
        let first_byte = self.first_byte_ms.load(Ordering::Acquire);
        let (limit, why) = if self.multiplexed.load(Ordering::Acquire) || first_byte == NO_BYTE {
            (idle_since.saturating_add(keepalive.0), keepalive.1)
        } else {
            (first_byte.saturating_add(header.0), header.1)
        };
        (limit, why)
    }
}

/// Why the watchdog closed a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closed {
    /// A deadline passed: `header` or `keepalive`.
    TimedOut(&'static str),
    /// Writing has been blocked for `client_write_timeout_ms`.
    WriteStuck,
    /// The listener needed its place.
    Evicted,
}

/// Resolves when the connection must close: a deadline passed with no
/// request on it, writing to it stayed blocked too long, or it was evicted.
async fn watch(activity: &Activity, deadlines: &ConnectionDeadlines) -> Closed {
    let write_limit = u64::try_from(deadlines.write.as_millis()).unwrap_or(u64::MAX);
    // The spell of blocked writes last seen: what the socket held to send is
    // noted when one begins (here, off the write's path).
    let mut spell = NO_BYTE;
    loop {
        if activity.evicted.load(Ordering::Acquire) {
            return Closed::Evicted;
        }
        let blocked_since = activity.write_blocked_ms.load(Ordering::Acquire);
        if blocked_since != NO_BYTE && blocked_since != spell {
            spell = blocked_since;
            activity
                .unsent_when_blocked
                .store(activity.unsent().unwrap_or(NO_BYTE), Ordering::Release);
        }
        if blocked_since != NO_BYTE {
            let (deadline, now) = (blocked_since.saturating_add(write_limit), activity.now_ms());
            if now >= deadline {
                if activity.client_read_since_blocked() {
                    // Still reading: a new spell from now.
                    if activity
                        .write_blocked_ms
                        .compare_exchange(blocked_since, now, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        spell = now;
                    }
                    continue;
                }
                return Closed::WriteStuck;
            }
            tokio::select! {
                () = activity.changed.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(deadline - now)) => {}
            }
            continue;
        }
        if activity.requests.load(Ordering::Acquire) > 0 {
            // `notify_one` keeps a wake-up that comes before this wait.
            activity.changed.notified().await;
            continue;
        }
        let (deadline, why) = activity.deadline_ms(deadlines);
        let now = activity.now_ms();
        if now >= deadline {
            return why;
        }
        tokio::select! {
            () = activity.changed.notified() => {}
            () = tokio::time::sleep(Duration::from_millis(deadline - now)) => {}
        }
    }
}

/// Serves one accepted connection until it closes, the watchdog closes it,
/// or `shutdown` changes (then it finishes its requests and closes).
pub async fn serve(
    stream: TcpStream,
    activity: Arc<Activity>,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<()>,
) {
    #[cfg(unix)]
    activity
        .socket
        .store(std::os::fd::AsRawFd::as_raw_fd(&stream), Ordering::Release);
    let io = TokioIo::new(WatchedStream {
        stream,
        activity: Arc::clone(&activity),
    });
    let service = ConnectionService {
        router: shared.router.clone(),
        activity: Arc::clone(&activity),
    };
    let connection = shared.http.serve_connection(io, service);
    tokio::pin!(connection);
    let watchdog = watch(&activity, &shared.deadlines);
    tokio::pin!(watchdog);
    let mut watching = true;
    let mut draining = false;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!("client connection: {error}");
                }
                return;
            }
            closed = &mut watchdog, if watching => {
                watching = false;
                match closed {
                    Closed::TimedOut(phase) => shared.metrics.count_client_timeout(phase),
                    Closed::Evicted => shared.metrics.count_eviction(),
                    Closed::WriteStuck => {
                        // A graceful close would wait on the very writes
                        // that are stuck: drop the connection and its
                        // requests (their upstream requests are cancelled).
                        shared.metrics.count_client_timeout("write");
                        return;
                    }
                }
                if !draining {
                    draining = true;
                    connection.as_mut().graceful_shutdown();
                }
            }
            _ = shutdown.changed(), if !draining => {
                draining = true;
                connection.as_mut().graceful_shutdown();
            }
            () = tokio::time::sleep(CLOSE_LINGER), if !watching => {
                if activity.requests.load(Ordering::Acquire) == 0 {
                    return;
                }
            }
        }
    }
}

/// The client's socket, noting the first byte after an idle spell.
struct WatchedStream {
    stream: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for WatchedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.bytes_arrived();
        }
        polled
    }
}

impl AsyncWrite for WatchedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.activity.write_polled(&polled);
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.activity.write_polled(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_flush(cx);
        this.activity.write_polled(&polled);
        polled
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// The router, counting the connection's requests in flight.
#[derive(Clone)]
struct ConnectionService {
    router: Router,
    activity: Arc<Activity>,
}

impl hyper::service::Service<Request<Incoming>> for ConnectionService {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let request_guard = self.activity.request_started(request.version());
        let mut router = self.router.clone();
        Box::pin(async move {
            let response =
                tower_service::Service::call(&mut router, request.map(Body::new)).await?;
            Ok(response.map(|body| TrackedBody {
                body,
                _request: request_guard,
            }))
        })
    }
}

/// Marks its request finished when dropped (with its response body).
struct RequestGuard(Arc<Activity>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// A response body that keeps its request counted until hyper is done
/// with it.
struct TrackedBody {
    body: Body,
    _request: RequestGuard,
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINES: ConnectionDeadlines = ConnectionDeadlines {
        header: Duration::from_millis(100),
        keepalive: Duration::from_millis(1000),
        write: Duration::from_millis(300),
    };

    fn activity() -> Arc<Activity> {
        Arc::new(Activity::new(Arc::new(Notify::new())))
    }

    #[test]
    fn the_first_head_is_timed_from_the_accept_later_ones_from_their_first_byte() {
        let connection = activity();
        assert_eq!(
            connection.deadline_ms(&DEADLINES),
            (100, Closed::TimedOut("header"))
        );
        let request = connection.request_started(Version::HTTP_11);
        assert!(connection.idle_since().is_none(), "busy");
        connection.bytes_arrived(); // the body: not an idle spell's first byte
        drop(request);
        let idle_since = connection.idle_since_ms.load(Ordering::Acquire);
        assert_eq!(
            connection.deadline_ms(&DEADLINES),
            (idle_since + 1000, Closed::TimedOut("keepalive"))
        );
        connection.bytes_arrived();
        let first_byte = connection.first_byte_ms.load(Ordering::Acquire);
        assert_ne!(first_byte, NO_BYTE);
        assert_eq!(
            connection.deadline_ms(&DEADLINES),
            (first_byte + 100, Closed::TimedOut("header"))
        );
    }

    #[test]
    fn an_http2_connection_is_held_to_the_keepalive_deadline_between_streams() {
        let connection = activity();
        drop(connection.request_started(Version::HTTP_2));
        connection.bytes_arrived(); // a PING or SETTINGS frame
        let idle_since = connection.idle_since_ms.load(Ordering::Acquire);
        assert_eq!(
            connection.deadline_ms(&DEADLINES),
            (idle_since + 1000, Closed::TimedOut("keepalive"))
        );
    }

    #[tokio::test]
    async fn the_watchdog_waits_while_requests_run_and_fires_once_idle() {
        let connection = activity();
        let request = connection.request_started(Version::HTTP_11);
        let watched = {
            let connection = Arc::clone(&connection);
            tokio::spawn(async move { watch(&connection, &DEADLINES).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!watched.is_finished(), "no deadline while a request runs");
        drop(request);
        connection.bytes_arrived();
        let closed = tokio::time::timeout(Duration::from_secs(5), watched)
            .await
            .expect("the header deadline fires")
            .unwrap();
        assert_eq!(closed, Closed::TimedOut("header"));
        assert!(connection.evict());
        assert!(!connection.evict(), "evicted once");
        assert_eq!(watch(&connection, &DEADLINES).await, Closed::Evicted);
    }

    #[tokio::test]
    async fn a_write_blocked_past_its_deadline_closes_a_busy_connection() {
        let connection = activity();
        let _request = connection.request_started(Version::HTTP_11);
        let watched = {
            let connection = Arc::clone(&connection);
            tokio::spawn(async move { watch(&connection, &DEADLINES).await })
        };
        // Blocked, then through before the deadline: nothing fires.
        connection.write_polled(&Poll::<()>::Pending);
        tokio::time::sleep(Duration::from_millis(200)).await;
        connection.write_polled(&Poll::Ready(()));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!watched.is_finished(), "a write went through in time");
        // Blocked for good: the write deadline fires though a request runs.
        let blocked_at = Instant::now();
        connection.write_polled(&Poll::<()>::Pending);
        connection.write_polled(&Poll::<()>::Pending); // still the same spell
        let closed = tokio::time::timeout(Duration::from_secs(5), watched)
            .await
            .expect("the write deadline fires")
            .unwrap();
        assert_eq!(closed, Closed::WriteStuck);
        assert!(blocked_at.elapsed() >= Duration::from_millis(290));
    }

    /// A client that reads slowly but steadily leaves the server's writes
    /// blocked for spells longer than the write deadline (the kernel wakes
    /// a writer once a third of its buffer is free): it is not stuck. One
    /// that stops reading is.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_client_reading_slowly_but_steadily_is_not_stuck() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let connection = activity();
        connection
            .socket
            .store(std::os::fd::AsRawFd::as_raw_fd(&server), Ordering::Release);
        let _request = connection.request_started(Version::HTTP_11);
        let watched = {
            let connection = Arc::clone(&connection);
            tokio::spawn(async move { watch(&connection, &DEADLINES).await })
        };
        let mut writer = WatchedStream {
            stream: server,
            activity: Arc::clone(&connection),
        };
        let writing = tokio::spawn(async move {
            let chunk = vec![b'x'; 64 * 1024];
            while writer.write_all(&chunk).await.is_ok() {}
        });
        // About 1.6 MB/s, for 1.5 s: five write deadlines. (On loopback,
        // whose segments are 64 KiB, a receiver reports the room it made
        // once it is two segments: a client must read more than that in a
        // deadline for the server to see it read.)
        let mut buffer = vec![0; 16 * 1024];
        let reading_until = Instant::now() + Duration::from_millis(1500);
        let mut read = 0;
        while Instant::now() < reading_until {
            read += client.read(&mut buffer).await.unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(read > 100_000, "{read}");
        assert!(
            !watched.is_finished(),
            "a reading client was taken for stuck"
        );
        // It stops reading: stuck within the deadline and a check.
        let closed = tokio::time::timeout(Duration::from_secs(3), watched)
            .await
            .expect("the write deadline fires")
            .unwrap();
        assert_eq!(closed, Closed::WriteStuck);
        writing.abort();
    }
}
