//! Hostile clients against a real `canarygate serve`, on raw sockets: slow
//! uploaders, stalled and trickling bodies, heads that never end, idle
//! keep-alive connections, more idle sockets than `limits.max_connections`;
//! a client that reads nothing of its answers; every error's shape across
//! routes and methods; the data directory's
//! modes under a permissive umask, and refusal to start on a loose one.
//!
//! Each attack runs while a normal request is made, which must still
//! succeed promptly. Timeouts are set short in each test's policy so the
//! whole file takes seconds.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;

/// How long a normal request may take while an attack is under way (the
/// simulated provider answers in milliseconds; this is slack for a loaded
/// machine, far below every attack's own duration).
const PROMPTLY: Duration = Duration::from_secs(5);

/// Slack on top of a deadline for the server to act on it and the client
/// to see it (the graceful close of a connection lingers up to 1 s).
const SLACK: Duration = Duration::from_millis(2500);

fn address(url: &str) -> &str {
    url.trim_start_matches("http://")
}

/// A normal chat request that must be answered 200 within [`PROMPTLY`];
/// returns how long it took.
async fn normal_request(url: &str) -> Duration {
    let started = Instant::now();
    let response = tokio::time::timeout(
        PROMPTLY,
        client()
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth("sk-normal")
            .json(&chat_body("sim-model", "hello there", false))
            .send(),
    )
    .await
    .unwrap_or_else(|_| panic!("a normal request got no answer within {PROMPTLY:?}"))
    .expect("normal request");
    assert_eq!(response.status(), 200, "{:?}", response.text().await);
    started.elapsed()
}

/// The head of a chat request announcing `length` body bytes.
fn chat_head(length: usize) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: canarygate\r\n\
         Authorization: Bearer sk-slow\r\nContent-Type: application/json\r\n\
         Content-Length: {length}\r\n\r\n"
    )
}

/// A connection that sent a head announcing 400 bytes, then 18 of them.
async fn slow_uploader(url: &str) -> TcpStream {
    let mut stream = TcpStream::connect(address(url)).await.expect("connect");
    stream
        .write_all(format!("{}{{\"model\": \"sim-mo", chat_head(400)).as_bytes())
        .await
        .expect("write head");
    stream
}

/// A [`slow_uploader`] whose request is known to be in flight: its head
/// asks `Expect: 100-continue`, and its 18 body bytes go only after the
/// server's `100 Continue`, which it sends once the handler reads the body.
/// (A fixed wait for the server to read the head is not enough on a loaded
/// machine: a connection whose head was not read yet is idle, and may be
/// evicted.)
async fn uploader_in_flight(url: &str) -> TcpStream {
    let mut stream = TcpStream::connect(address(url)).await.expect("connect");
    let head = chat_head(400).replace("\r\n\r\n", "\r\nExpect: 100-continue\r\n\r\n");
    stream.write_all(head.as_bytes()).await.expect("write head");
    let mut interim = Vec::new();
    let mut byte = [0u8; 1];
    tokio::time::timeout(PROMPTLY, async {
        while !interim.ends_with(b"\r\n\r\n") {
            let read = stream.read(&mut byte).await.expect("read 100 Continue");
            assert_eq!(
                read,
                1,
                "closed before 100 Continue: {:?}",
                String::from_utf8_lossy(&interim)
            );
            interim.push(byte[0]);
        }
    })
    .await
    .expect("100 Continue in time");
    assert!(
        interim.starts_with(b"HTTP/1.1 100"),
        "not 100 Continue: {:?}",
        String::from_utf8_lossy(&interim)
    );
    stream
        .write_all(b"{\"model\": \"sim-mo")
        .await
        .expect("write body");
    stream
}

/// One HTTP/1.1 response read off a raw socket.
#[derive(Debug)]
struct RawResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl RawResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|error| {
            panic!(
                "body is not JSON ({error}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

/// Reads one response (its body sized by `Content-Length`).
async fn read_response(stream: &mut TcpStream) -> RawResponse {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = buffer.windows(4).position(|window| window == b"\r\n\r\n") {
            break at;
        }
        let read = stream.read(&mut chunk).await.expect("read response");
        assert!(
            read > 0,
            "closed before a response head: {:?}",
            String::from_utf8_lossy(&buffer)
        );
        buffer.extend_from_slice(&chunk[..read]);
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {head:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(key, value)| (key.trim().to_owned(), value.trim().to_owned()))
        .collect();
    let mut response = RawResponse {
        status,
        headers,
        body: buffer[head_end + 4..].to_vec(),
    };
    let length: usize = response
        .header("content-length")
        .unwrap_or_else(|| panic!("no Content-Length in {head:?}"))
        .parse()
        .expect("Content-Length");
    while response.body.len() < length {
        let read = stream.read(&mut chunk).await.expect("read body");
        assert!(read > 0, "closed inside a response body");
        response.body.extend_from_slice(&chunk[..read]);
    }
    response
}

/// Waits until the server closes `stream` (EOF or reset), at most `limit`;
/// returns how long after `since` that was. Panics on any byte received.
async fn closed_within(stream: &mut TcpStream, since: Instant, limit: Duration) -> Duration {
    let mut chunk = [0u8; 1024];
    match tokio::time::timeout(
        limit.saturating_sub(since.elapsed()),
        stream.read(&mut chunk),
    )
    .await
    {
        Ok(Ok(0) | Err(_)) => since.elapsed(),
        Ok(Ok(read)) => panic!(
            "expected a close, got {:?}",
            String::from_utf8_lossy(&chunk[..read])
        ),
        Err(_) => panic!(
            "still open {:?} after it should have closed",
            since.elapsed()
        ),
    }
}

/// Whether nothing has arrived on `stream` (and it is not closed) yet.
async fn still_waiting(stream: &mut TcpStream) -> bool {
    let mut chunk = [0u8; 64];
    tokio::time::timeout(Duration::from_millis(20), stream.read(&mut chunk))
        .await
        .is_err()
}

/// The value of the metric line starting with `series` (0 when absent).
async fn metric(url: &str, series: &str) -> f64 {
    let text = client()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |value| value.trim().parse().expect("metric value"))
}

/// Asserts `body` is `{"error": {...}}` with exactly `message`, `type`,
/// `param`, `code` (and `extra`); returns the error object.
fn assert_four_keys<'a>(body: &'a Value, extra: &[&str], context: &str) -> &'a Value {
    let error = &body["error"];
    let keys: BTreeSet<&str> = error
        .as_object()
        .unwrap_or_else(|| panic!("{context}: no error object in {body}"))
        .keys()
        .map(String::as_str)
        .collect();
    let mut expected: BTreeSet<&str> = ["message", "type", "param", "code"].into();
    expected.extend(extra);
    assert_eq!(keys, expected, "{context}: {body}");
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{context}: {body}"
    );
    assert!(error["type"].is_string(), "{context}: {body}");
    assert!(error["code"].is_string(), "{context}: {body}");
    assert!(
        error["param"].is_null() || error["param"].is_string(),
        "{context}: {body}"
    );
    error
}

#[tokio::test]
async fn slow_uploaders_cannot_pin_the_concurrency_slots() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    // Body deadlines far beyond the test: only taking the slot after the
    // body lets the normal requests through.
    let proxy = start_plain_proxy_with(
        &dir,
        &sim.url,
        "[limits]\nmax_concurrent_requests = 2\n\
             client_body_timeout_ms = 120000\nclient_body_idle_timeout_ms = 120000\n",
    );
    // Each is in flight, its body awaited, before the normal requests.
    let mut uploaders = Vec::new();
    for _ in 0..4 {
        uploaders.push(uploader_in_flight(&proxy.url).await);
    }
    for round in 0..3 {
        let took = normal_request(&proxy.url).await;
        eprintln!("normal request {round} with 4 slow uploaders: {took:?}");
    }
    // Two at once: both slots are free.
    let (first, second) = tokio::join!(normal_request(&proxy.url), normal_request(&proxy.url));
    eprintln!("two at once: {first:?}, {second:?}");
    for uploader in &mut uploaders {
        assert!(
            still_waiting(uploader).await,
            "the slow uploads are pending"
        );
    }
}

#[tokio::test]
async fn stalled_and_trickling_bodies_get_408_within_their_deadlines() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let proxy = start_plain_proxy_with(
        &dir,
        &sim.url,
        "[limits]\nclient_body_timeout_ms = 2500\nclient_body_idle_timeout_ms = 800\n",
    );
    let url = proxy.url.clone();

    // Stalled: 18 bytes of 400, then nothing.
    let stalled = tokio::spawn({
        let url = url.clone();
        async move {
            let mut stream = slow_uploader(&url).await;
            let started = Instant::now();
            let response = tokio::time::timeout(Duration::from_millis(800) + SLACK, async {
                read_response(&mut stream).await
            })
            .await
            .expect("a stalled body is answered");
            let took = started.elapsed();
            let closed =
                closed_within(&mut stream, started, Duration::from_millis(800) + SLACK).await;
            (response, took, closed)
        }
    });
    // Trickling: a byte every 200 ms, never idle for 800 ms, never done.
    let trickling = tokio::spawn({
        let url = url.clone();
        async move {
            let stream = TcpStream::connect(address(&url)).await.expect("connect");
            let (mut reader, mut writer) = stream.into_split();
            writer
                .write_all(chat_head(400).as_bytes())
                .await
                .expect("head");
            let started = Instant::now();
            let feeder = tokio::spawn(async move {
                while writer.write_all(b" ").await.is_ok() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            });
            let mut bytes = Vec::new();
            tokio::time::timeout(Duration::from_millis(2500) + SLACK, async {
                reader.read_to_end(&mut bytes).await
            })
            .await
            .expect("a trickling body is answered")
            .ok();
            feeder.abort();
            (
                String::from_utf8_lossy(&bytes).into_owned(),
                started.elapsed(),
            )
        }
    });
    // Meanwhile normal traffic flows.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let took = normal_request(&url).await;
    eprintln!("normal request during the stalled bodies: {took:?}");

    let (response, took, closed) = stalled.await.unwrap();
    eprintln!("stalled body: 408 after {took:?}, closed after {closed:?}");
    assert_eq!(response.status, 408, "{response:?}");
    assert!(took >= Duration::from_millis(700), "too early: {took:?}");
    assert_eq!(response.header("connection"), Some("close"));
    let body = response.json();
    let error = assert_four_keys(&body, &[], "stalled body");
    assert_eq!(error["code"], "request_timeout");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("client_body_idle_timeout_ms"),
        "{body}"
    );

    let (raw, took) = trickling.await.unwrap();
    eprintln!("trickling body: answered after {took:?}");
    assert!(raw.starts_with("HTTP/1.1 408"), "{raw}");
    assert!(raw.contains("client_body_timeout_ms"), "{raw}");
    assert!(took >= Duration::from_millis(2400), "too early: {took:?}");

    assert!(
        metric(
            &url,
            "canarygate_client_timeouts_total{phase=\"body_idle\"}"
        )
        .await
            >= 1.0
    );
    assert!(metric(&url, "canarygate_client_timeouts_total{phase=\"body\"}").await >= 1.0);
    assert_eq!(
        metric(
            &url,
            "canarygate_requests_total{route=\"chat_completions\",status=\"408\"}"
        )
        .await,
        2.0
    );
}

#[tokio::test]
async fn unfinished_heads_and_idle_keepalive_connections_are_closed() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let proxy = start_plain_proxy_with(
        &dir,
        &sim.url,
        "[limits]\nclient_header_timeout_ms = 700\nclient_keepalive_timeout_ms = 1500\n",
    );
    let url = proxy.url.clone();
    let header = Duration::from_millis(700);
    let keepalive = Duration::from_millis(1500);

    let silent = tokio::spawn({
        let url = url.clone();
        async move {
            let mut stream = TcpStream::connect(address(&url)).await.unwrap();
            closed_within(&mut stream, Instant::now(), header + SLACK).await
        }
    });
    let partial = tokio::spawn({
        let url = url.clone();
        async move {
            let mut stream = TcpStream::connect(address(&url)).await.unwrap();
            let started = Instant::now();
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: canarygate\r\nX-Slow: ")
                .await
                .unwrap();
            closed_within(&mut stream, started, header + SLACK).await
        }
    });
    let kept_alive = tokio::spawn({
        let url = url.clone();
        async move {
            let mut stream = TcpStream::connect(address(&url)).await.unwrap();
            let request = b"GET /healthz HTTP/1.1\r\nHost: canarygate\r\n\r\n";
            stream.write_all(request).await.unwrap();
            assert_eq!(read_response(&mut stream).await.status, 200);
            // Idle longer than the header timeout, shorter than keep-alive:
            // the connection is still there for the next request.
            tokio::time::sleep(header + Duration::from_millis(300)).await;
            stream.write_all(request).await.unwrap();
            assert_eq!(read_response(&mut stream).await.status, 200);
            let idle_from = Instant::now();
            closed_within(&mut stream, idle_from, keepalive + SLACK).await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let took = normal_request(&url).await;
    eprintln!("normal request beside the idle sockets: {took:?}");

    let silent = silent.await.unwrap();
    let partial = partial.await.unwrap();
    let kept_alive = kept_alive.await.unwrap();
    eprintln!(
        "closed: silent {silent:?}, partial head {partial:?}, idle keep-alive {kept_alive:?}"
    );
    let early = Duration::from_millis(100);
    assert!(
        silent >= header - early,
        "silent socket closed early: {silent:?}"
    );
    assert!(
        partial >= header - early,
        "partial head closed early: {partial:?}"
    );
    assert!(
        kept_alive >= keepalive - early,
        "keep-alive closed early: {kept_alive:?}"
    );
    assert!(metric(&url, "canarygate_client_timeouts_total{phase=\"header\"}").await >= 2.0);
    assert!(
        metric(
            &url,
            "canarygate_client_timeouts_total{phase=\"keepalive\"}"
        )
        .await
            >= 1.0
    );
}

#[tokio::test]
async fn connections_beyond_max_connections_neither_starve_nor_evict_requests() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    // Idle sockets never time out during the test; bodies stall for 1.5 s.
    let proxy = start_plain_proxy_with(
        &dir,
        &sim.url,
        "[limits]\nmax_connections = 8\nclient_header_timeout_ms = 60000\n\
             client_keepalive_timeout_ms = 60000\nclient_body_idle_timeout_ms = 1500\n",
    );
    let url = proxy.url.clone();

    // Five times the cap in sockets that never send a byte.
    let mut idle = Vec::new();
    for _ in 0..40 {
        idle.push(TcpStream::connect(address(&url)).await.expect("connect"));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let took = normal_request(&url).await;
    eprintln!("normal request past 40 idle sockets at max_connections = 8: {took:?}");
    let mut closed = 0;
    for stream in &mut idle {
        if !still_waiting(stream).await {
            closed += 1;
        }
    }
    eprintln!("{closed} of 40 idle sockets closed to make room");
    assert!(closed >= 32, "only {closed} idle sockets were closed");
    assert!(metric(&url, "canarygate_client_connections_evicted_total").await >= 32.0);
    let open = metric(&url, "canarygate_client_connections").await;
    assert!((1.0..=8.0).contains(&open), "{open} connections open");
    drop(idle);

    // Every place taken by a request in flight (bodies stalled): a new
    // connection waits, and is served once one of them ends with its 408.
    let mut uploaders = Vec::new();
    for _ in 0..8 {
        uploaders.push(uploader_in_flight(&url).await);
    }
    let took = normal_request(&url).await;
    eprintln!("normal request queued behind 8 stalled uploads: {took:?}");
    for (index, uploader) in uploaders.iter_mut().enumerate() {
        let response = tokio::time::timeout(PROMPTLY, read_response(uploader))
            .await
            .unwrap_or_else(|_| panic!("uploader {index}: no answer"));
        assert_eq!(
            response.status, 408,
            "uploader {index}: a request in flight is answered, never evicted"
        );
    }
}

/// A chat request whose body carries `values` numbers in an extra field:
/// about 2 bytes each on the wire, far more parsed.
fn many_values(values: usize) -> String {
    let numbers = vec!["0"; values].join(",");
    format!(
        r#"{{"model":"sim-model","max_tokens":30,"messages":[{{"role":"user","content":"hello"}}],"padding":[{numbers}]}}"#
    )
}

#[tokio::test]
async fn bodies_are_parsed_within_the_memory_budget() {
    // 30 tokens at 20 a second: a request stays in flight 1.5 s.
    let sim = start_sim(&["--decode-tps", "20"]);
    let dir = ProxyDir::new();
    // 200,000 values are bounded at about 26 MB parsed: one fits, two do not.
    let proxy = start_plain_proxy_with(&dir, &sim.url, "[limits]\nmax_parsed_bytes = 40000000\n");
    let url = proxy.url.clone();
    let post = |path: &'static str, body: String| {
        client()
            .post(format!("{url}{path}"))
            .bearer_auth("sk-many")
            .header("anthropic-version", "2023-06-01")
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    // A body that could never fit: 413 in the endpoint's own shape.
    let huge = many_values(400_000);
    let response = post("/v1/chat/completions", huge.clone()).await.unwrap();
    assert_eq!(response.status(), 413);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "request_too_large", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limits.max_parsed_bytes"),
        "{body}"
    );
    let anthropic = huge.replace("sim-model", "claude");
    let response = post("/v1/messages", anthropic).await.unwrap();
    assert_eq!(response.status(), 413);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], "request_too_large", "{body}");

    // One in flight holds its share; a second does not fit beside it (429,
    // with when to come back), a small request does.
    let first = tokio::spawn(post("/v1/chat/completions", many_values(200_000)));
    let in_flight = Instant::now();
    while sim_stats(&sim).await["requests"].as_u64().unwrap() < 1 {
        assert!(
            in_flight.elapsed() < PROMPTLY,
            "the first request never reached the sim"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second = post("/v1/chat/completions", many_values(200_000))
        .await
        .unwrap();
    assert_eq!(second.status(), 429);
    assert_eq!(second.headers()["retry-after"], "1");
    let body: Value = second.json().await.unwrap();
    assert_eq!(
        body["error"]["code"], "too_many_concurrent_requests",
        "{body}"
    );
    normal_request(&url).await;
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), 200, "{:?}", first.text().await);
    // Its share is back once it is answered.
    let again = post("/v1/chat/completions", many_values(200_000))
        .await
        .unwrap();
    assert_eq!(again.status(), 200, "{:?}", again.text().await);
}

#[tokio::test]
async fn a_client_that_reads_nothing_is_dropped_at_the_write_deadline() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let proxy = start_plain_proxy_with(&dir, &sim.url, "[limits]\nclient_write_timeout_ms = 800\n");
    // A small receive buffer, and 4,000 pipelined requests for /metrics (a few
    // KB each): the answers fill both sides' buffers, so the server's writes
    // block while this client reads nothing.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stuck = socket
        .connect(address(&proxy.url).parse().unwrap())
        .await
        .unwrap();
    let requests = "GET /metrics HTTP/1.1\r\nHost: canarygate\r\n\r\n".repeat(4000);
    stuck.write_all(requests.as_bytes()).await.unwrap();
    let sent = Instant::now();
    // The write deadline is counted from the first blocked write; meanwhile
    // other clients are served.
    normal_request(&proxy.url).await;
    let deadline = Instant::now() + Duration::from_millis(800) + SLACK;
    while metric(
        &proxy.url,
        "canarygate_client_timeouts_total{phase=\"write\"}",
    )
    .await
        < 1.0
    {
        if Instant::now() >= deadline {
            let text = client()
                .get(format!("{}/metrics", proxy.url))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let client_lines: Vec<&str> = text
                .lines()
                .filter(|line| line.starts_with("canarygate_client"))
                .collect();
            panic!(
                "the stuck connection is still open {:?} after its requests: {client_lines:#?}",
                sent.elapsed()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        sent.elapsed() >= Duration::from_millis(800),
        "dropped before the deadline: {:?}",
        sent.elapsed()
    );
    // The socket was dropped: what it had buffered, then the end (a reset
    // or a close), long before 4,000 answers.
    let mut received = 0usize;
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        match tokio::time::timeout(PROMPTLY, stuck.read(&mut chunk)).await {
            Ok(Ok(0) | Err(_)) => break,
            Ok(Ok(read)) => received += read,
            Err(_) => panic!("the stuck connection was not closed ({received} bytes read)"),
        }
    }
    let one_answer = client()
        .get(format!("{}/metrics", proxy.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
        .len();
    assert!(
        received < 3000 * one_answer,
        "{received} bytes: most of the 4,000 answers ({one_answer} bytes each) went out"
    );
    normal_request(&proxy.url).await;
}

#[tokio::test]
async fn every_error_has_the_four_keys_and_405_names_allow() {
    let dir = ProxyDir::new();
    let proxy = start_plain_proxy(&dir, &closed_url());
    let client = client();
    let routes: [(&str, Option<&str>); 11] = [
        // GET lists stored completions (forwarded; this upstream is closed).
        ("/v1/chat/completions", Some("GET, HEAD, POST")),
        ("/v1/models", Some("GET, HEAD")),
        ("/healthz", Some("GET, HEAD")),
        ("/metrics", Some("GET, HEAD")),
        ("/", None),
        ("/v1", None),
        ("/v1/completions", Some("POST")),
        ("/v1/chat/completions/one/extra", None),
        ("/v1/embeddings", Some("POST")),
        ("/v1/responses", Some("POST")),
        ("/v1/audio/speech", None),
    ];
    let methods = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];
    let mut checked = 0;
    for (path, allow) in routes {
        for method in methods {
            let context = format!("{method} {path}");
            let response = client
                .request(method.parse().unwrap(), format!("{}{path}", proxy.url))
                .bearer_auth("sk-test")
                .header("content-type", "application/json")
                .body("{")
                .send()
                .await
                .unwrap_or_else(|error| panic!("{context}: {error}"));
            let status = response.status().as_u16();
            let allowed = allow.is_some_and(|allow| allow.split(", ").any(|m| m == method));
            let expected = match (allow, allowed) {
                (None, _) => 404,
                (Some(_), false) => 405,
                // A body of `{` to an endpoint that reads JSON: invalid JSON.
                (Some(_), true) if method == "POST" => 400,
                // Forwarded to a provider that cannot be reached.
                (Some(_), true) if path == "/v1/chat/completions" => 502,
                (Some(_), true) => 200,
            };
            assert_eq!(status, expected, "{context}");
            let allow_header = response
                .headers()
                .get("allow")
                .map(|value| value.to_str().unwrap().to_owned());
            if status == 405 {
                assert_eq!(allow_header.as_deref(), allow, "{context}: Allow");
            } else {
                assert_eq!(allow_header, None, "{context}: Allow only on 405");
            }
            if status < 400 || method == "HEAD" {
                continue;
            }
            let body: Value = response
                .json()
                .await
                .unwrap_or_else(|error| panic!("{context}: body is not JSON: {error}"));
            let error = assert_four_keys(&body, &[], &context);
            let code = match status {
                404 => "unknown_url",
                405 => "method_not_allowed",
                502 => "upstream_unreachable",
                _ => "invalid_json",
            };
            assert_eq!(error["code"], code, "{context}");
            checked += 1;
        }
    }
    // Unknown paths: 6 methods with a body (HEAD has none); GET paths: 5
    // other methods with a body; the POST endpoints: 5 plus their 400.
    let posts = routes
        .iter()
        .filter(|(_, allow)| allow.is_some_and(|allow| allow.split(", ").any(|m| m == "POST")))
        .count();
    let unknown = routes.iter().filter(|(_, allow)| allow.is_none()).count();
    assert_eq!(
        checked,
        unknown * 6 + 3 * 5 + posts * 6,
        "error bodies checked"
    );

    // Errors before the body: no credential; a body over the limit.
    let response = client
        .post(format!("{}/v1/chat/completions", proxy.url))
        .json(&chat_body("m", "hi", false))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        assert_four_keys(&body, &[], "no key")["code"],
        "missing_api_key"
    );
    let mut stream = TcpStream::connect(address(&proxy.url)).await.unwrap();
    stream
        .write_all(chat_head(1 << 30).as_bytes())
        .await
        .unwrap();
    let response = read_response(&mut stream).await;
    assert_eq!(response.status, 413);
    assert_eq!(
        assert_four_keys(&response.json(), &[], "too large")["code"],
        "request_too_large"
    );

    // A compressed body is named for what it is, not as invalid JSON; an
    // `identity` one is read as it is.
    for (encoding, status, code) in [
        ("gzip", 415, "unsupported_content_encoding"),
        ("br", 415, "unsupported_content_encoding"),
        ("identity", 400, "invalid_json"),
        ("identity, gzip", 415, "unsupported_content_encoding"),
    ] {
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("sk-test")
            .header("content-type", "application/json")
            .header("content-encoding", encoding)
            .body(vec![0x1f, 0x8b, 0x08, 0x00])
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), status, "{encoding}");
        let body: Value = response.json().await.unwrap();
        let error = assert_four_keys(&body, &[], encoding);
        assert_eq!(error["code"], code, "{encoding}");
    }
}

#[tokio::test]
async fn verification_failures_have_param_null_in_the_body_and_the_stream() {
    // The sim drops the head of every prompt: each answer fails its echo.
    let sim = start_sim(&["--mode", "truncate-head"]);
    let dir = ProxyDir::new();
    let policy = dir.policy(&format!(
        r#"
[[providers]]
name = "sim"
base_url = "{}/v1"
context_window = 1048576

[[routes]]
model = "*"
provider = "sim"

[verify]
release = "echo-first"
action = "block"
"#,
        sim.url
    ));
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    for stream in [false, true] {
        let response = client()
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("sk-test")
            .json(&chat_body(
                "sim-model",
                "zq00001 asks about the ledger entry",
                stream,
            ))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        // A whole answer (or a stream refused before its first byte) is a
        // 502 body; a stream already started ends with an error event.
        let body: Value = if status == 502 {
            serde_json::from_str(&text).unwrap()
        } else {
            assert_eq!(status, 200, "{text}");
            sse_data(&text)
                .iter()
                .filter_map(|data| serde_json::from_str::<Value>(data).ok())
                .find(|event| event.get("error").is_some())
                .unwrap_or_else(|| panic!("no error event in {text}"))
        };
        let context = format!("stream = {stream}");
        let error = assert_four_keys(&body, &["failed_checks"], &context);
        assert_eq!(error["code"], "canarygate_verification_failed", "{context}");
        assert_eq!(error["param"], Value::Null, "{context}");
    }
}

/// Every path under `root` (itself included) with its permission bits.
fn modes_under(root: &Path) -> Vec<(PathBuf, u32, bool)> {
    let mut found = Vec::new();
    let mut pending = vec![root.to_owned()];
    while let Some(path) = pending.pop() {
        let metadata = std::fs::metadata(&path).unwrap();
        if metadata.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap() {
                pending.push(entry.unwrap().path());
            }
        }
        found.push((
            path,
            metadata.permissions().mode() & 0o777,
            metadata.is_dir(),
        ));
    }
    found
}

/// `canarygate serve` on `data` with `policy`, under `umask`, its stderr
/// written to `stderr`.
fn serve_command(umask: &str, data: &Path, policy: &Path, stderr: &Path) -> Command {
    let mut command = Command::new("/bin/sh");
    command
        .arg("-c")
        .arg("umask \"$UMASK\" && exec \"$@\" 2>\"$STDERR_FILE\"")
        .arg("sh")
        .arg(binary())
        .args(["serve", "--listen", "127.0.0.1:0", "--data"])
        .arg(data)
        .arg("--config")
        .arg(policy)
        .env("UMASK", umask)
        .env("STDERR_FILE", stderr);
    command
}

/// Runs `command` to its end (at most 30 s): its exit status and stderr.
fn run_to_exit(mut command: Command, stderr: &Path) -> (std::process::ExitStatus, String) {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .env("CANARYGATE_LOG", "warn")
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("serve did not exit: it should have refused to start");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status, std::fs::read_to_string(stderr).unwrap_or_default())
}

#[tokio::test]
async fn the_data_dir_is_owner_only_under_umask_000_and_serve_says_what_is_in_clear() {
    let dir = ProxyDir::new();
    let policy = plain_policy(&dir, &closed_url(), "");
    // Missing parents are created too, owner-only.
    let data = dir.dir.path().join("state/canarygate");
    let stderr = dir.dir.path().join("serve.stderr");
    let proxy = Running::start_command(serve_command("000", &data, &policy, &stderr), &[]);
    let health = client()
        .get(format!("{}/healthz", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let modes = modes_under(&dir.dir.path().join("state"));
    for name in ["canarygate.redb", "secret.key"] {
        assert!(
            modes.iter().any(|(path, _, _)| path.ends_with(name)),
            "{name} missing: {modes:?}"
        );
    }
    for (path, mode, is_dir) in &modes {
        let expected = if *is_dir { 0o700 } else { 0o600 };
        assert_eq!(*mode, expected, "{} is {mode:o}", path.display());
    }
    // `serve` says once, at start, what the store keeps in clear.
    let deadline = Instant::now() + Duration::from_secs(10);
    let log = loop {
        let log = std::fs::read_to_string(&stderr).unwrap_or_default();
        if log.contains("keeps in clear") || Instant::now() > deadline {
            break log;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        log.contains("keeps in clear the prompt and answer text"),
        "{log}"
    );
    assert_eq!(log.matches("keeps in clear").count(), 1, "said once: {log}");
}

#[tokio::test]
async fn serve_refuses_a_data_dir_others_can_read_unless_the_policy_allows() {
    let dir = ProxyDir::new();
    let upstream = closed_url();
    let data = dir.data();
    let stderr = dir.dir.path().join("serve.stderr");
    std::fs::create_dir(&data).unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();

    let strict = plain_policy(&dir, &upstream, "");
    let (status, log) = run_to_exit(serve_command("022", &data, &strict, &stderr), &stderr);
    assert!(!status.success(), "{log}");
    let named = format!("{} (mode 0755)", data.display());
    assert!(log.contains(&named), "{log}");
    assert!(
        log.contains(&format!("chmod -R go-rwx {}", data.display())),
        "{log}"
    );
    assert!(log.contains("data_readable_by = \"group\""), "{log}");
    assert!(
        !data.join("canarygate.redb").exists(),
        "nothing written into a refused directory"
    );

    // Group access is accepted when the policy says so; others' still not.
    let group = plain_policy(&dir, &upstream, "[audit]\ndata_readable_by = \"group\"\n");
    let (status, log) = run_to_exit(serve_command("022", &data, &group, &stderr), &stderr);
    assert!(!status.success(), "{log}");
    assert!(log.contains("chmod -R o-rwx"), "{log}");
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o750)).unwrap();
    let proxy = Running::start_command(serve_command("022", &data, &group, &stderr), &[]);
    let health = client()
        .get(format!("{}/healthz", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    // What it creates in the accepted directory is still owner-only.
    let mode = std::fs::metadata(data.join("canarygate.redb"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

/// Under a file-size limit (`ulimit -f`, systemd's `LimitFSIZE=`), a write
/// of the audit store past it fails as a full disk's would: `serve` is not
/// killed (SIGXFSZ) and goes on answering.
#[tokio::test]
async fn a_file_size_limit_does_not_kill_serve() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let policy = plain_policy(&dir, &sim.url, "[audit]\nsample_rate = 1.0\n");
    let mut command = Command::new("/bin/sh");
    command
        .arg("-c")
        // 2000 blocks of 512 bytes: about 1 MB per file.
        .arg("ulimit -f 2000 && exec \"$@\"")
        .arg("sh")
        .arg(binary())
        .args(["serve", "--listen", "127.0.0.1:0", "--data"])
        .arg(dir.data())
        .arg("--config")
        .arg(&policy);
    let mut proxy = Running::start_command(command, &[("CANARYGATE_LOG", "error")]);
    let big = "word ".repeat(100_000);
    for round in 0..6 {
        let response = client()
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("sk-e2e")
            .json(&chat_body("sim-model", &format!("{big}{round}"), false))
            .send()
            .await
            .unwrap_or_else(|error| panic!("round {round}: serve is gone: {error}"));
        assert!(
            [200, 500].contains(&response.status().as_u16()),
            "round {round}: {}",
            response.status()
        );
    }
    assert_eq!(proxy.exited_within(Duration::from_millis(300)), None);
}
