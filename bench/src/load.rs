//! HTTP/1.1 keep-alive load: closed-loop saturation, open-loop fixed rate,
//! and a one-request check of what a target answers.
//!
//! A target is one [`Endpoint`] or a pool of them (several instances of a
//! service, one endpoint each): the load functions take a slice and spread
//! the load round-robin over it, the way a client-side balancer would. A
//! connection always stays with the instance it was opened to.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Longest a single request may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Where and what to send: one instance of a target.
#[derive(Clone)]
pub struct Endpoint {
    pub addr: SocketAddr,
    /// `Host` header.
    pub host: String,
    /// Request path, e.g. `/v1/chat/completions`.
    pub path: String,
    pub authorization: String,
    pub body: Bytes,
    pub stream: bool,
}

/// The user message: `words` words of `word_tokens` tokens each (`w12-a-b-c`
/// is 7 pieces: the number, then a `-` and a letter per 2 more), or, when
/// `bytes` is not 0, as many such words as fill `bytes` (the text is at
/// least `bytes` long, by less than a word more). The simulated provider's
/// reply restates 12 to 39 of the words, so it runs into `max_tokens`
/// whenever 12 words hold that many tokens, and every answer is exactly
/// `max_tokens` tokens (`finish_reason: length`).
pub fn prompt_text(words: usize, word_tokens: usize, bytes: usize) -> String {
    let letters = word_tokens.saturating_sub(1) / 2;
    let suffix: String = (0..letters)
        .map(|k| format!("-{}", char::from(b'a' + (k % 26) as u8)))
        .collect();
    let mut text = String::new();
    let mut i = 0;
    while if bytes > 0 {
        text.len() < bytes
    } else {
        i < words
    } {
        if i > 0 {
            text.push(' ');
        }
        text.push_str(&format!("w{i}{suffix}"));
        i += 1;
    }
    text
}

/// The `model` the bench asks for unless told otherwise: an OpenAI model's
/// name, as most traffic through canarygate names one. The simulated
/// provider serves any name the same way; canarygate sizes the output
/// tokens it adds for the echo by the name's tokenizer family.
pub const DEFAULT_MODEL: &str = "gpt-4o-mini";

/// The request body: one user message `prompt` (see [`prompt_text`]); a
/// stream asks for its usage chunk when `usage`.
pub fn chat_body(model: &str, stream: bool, usage: bool, max_tokens: u64, prompt: &str) -> Bytes {
    let mut body = serde_json::json!({
        "model": model,
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
    });
    if stream && usage {
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    Bytes::from(body.to_string())
}

type Sender = SendRequest<Full<Bytes>>;

async fn try_connect(addr: SocketAddr) -> std::io::Result<Sender> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// Connects, retrying for a few seconds (a proxy that dropped connections
/// under load may take a moment to accept again).
async fn connect(addr: SocketAddr) -> Option<Sender> {
    for attempt in 0..50 {
        match try_connect(addr).await {
            Ok(sender) => return Some(sender),
            Err(_) if attempt < 49 => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(_) => {}
        }
    }
    None
}

/// `GET path` on a new connection; the body of a 2xx answer. Connecting
/// and reading share one 5 s deadline.
pub async fn get(addr: SocketAddr, host: &str, path: &str) -> Option<Bytes> {
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, host)
        .body(Full::new(Bytes::new()))
        .ok()?;
    let work = async {
        let mut sender = try_connect(addr).await.ok()?;
        let response = sender.send_request(request).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        Some(response.into_body().collect().await.ok()?.to_bytes())
    };
    tokio::time::timeout(Duration::from_secs(5), work)
        .await
        .ok()?
}

/// Why one request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// No connection could be opened, after retries.
    Connect,
    /// No whole answer within [`REQUEST_TIMEOUT`].
    Timeout,
    /// The connection broke before the whole answer was read.
    Transport,
    /// An answer with a status other than 2xx.
    Status,
    /// A 2xx answer that is not whole: no `data: [DONE]` in a stream, not a
    /// JSON object otherwise.
    Incomplete,
}

impl Failure {
    /// Every kind, in the order reports list them.
    const ALL: [Failure; 5] = [
        Failure::Connect,
        Failure::Timeout,
        Failure::Transport,
        Failure::Status,
        Failure::Incomplete,
    ];

    fn name(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Timeout => "timeout",
            Failure::Transport => "transport",
            Failure::Status => "status",
            Failure::Incomplete => "incomplete",
        }
    }
}

/// The failed requests of a fixed-rate run, counted by why they failed:
/// connect, timeout, transport (the connection broke), status (not 2xx),
/// incomplete (a 2xx answer cut short).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Failures([u64; Failure::ALL.len()]);

impl Failures {
    fn count(&mut self, failure: Failure) {
        self.0[failure as usize] += 1;
    }

    /// Failed requests of every kind.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// The kinds that occurred, with their counts: `"3 timeout, 1 status"`,
    /// or `"none"`.
    pub fn describe(&self) -> String {
        let seen: Vec<String> = Failure::ALL
            .iter()
            .filter(|&&kind| self.0[kind as usize] > 0)
            .map(|&kind| format!("{} {}", self.0[kind as usize], kind.name()))
            .collect();
        if seen.is_empty() {
            "none".to_owned()
        } else {
            seen.join(", ")
        }
    }

    /// The counts as a JSON object, every kind by name.
    pub fn to_json(&self) -> serde_json::Value {
        Failure::ALL
            .iter()
            .map(|&kind| (kind.name().to_owned(), self.0[kind as usize].into()))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

/// Outcome of one request.
#[derive(Clone, Copy)]
struct Sample {
    failure: Option<Failure>,
    bytes: usize,
    events: usize,
}

impl Sample {
    fn failed(failure: Failure) -> Self {
        Self {
            failure: Some(failure),
            bytes: 0,
            events: 0,
        }
    }

    fn ok(&self) -> bool {
        self.failure.is_none()
    }
}

fn request(endpoint: &Endpoint) -> hyper::Request<Full<Bytes>> {
    hyper::Request::post(endpoint.path.as_str())
        .header(hyper::header::HOST, &endpoint.host)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(hyper::header::AUTHORIZATION, &endpoint.authorization)
        .body(Full::new(endpoint.body.clone()))
        .expect("request")
}

/// Sends one request on `sender` and reads the whole answer.
async fn exchange(
    sender: &mut Sender,
    endpoint: &Endpoint,
) -> Result<(hyper::StatusCode, Bytes), Failure> {
    let work = async {
        sender.ready().await.ok()?;
        let response = sender.send_request(request(endpoint)).await.ok()?;
        let status = response.status();
        let body = response.into_body().collect().await.ok()?.to_bytes();
        Some((status, body))
    };
    match tokio::time::timeout(REQUEST_TIMEOUT, work).await {
        Ok(answer) => answer.ok_or(Failure::Transport),
        Err(_) => Err(Failure::Timeout),
    }
}

/// Sends one request and checks cheaply that the answer is complete.
async fn send(sender: &mut Sender, endpoint: &Endpoint) -> Sample {
    let (status, body) = match exchange(sender, endpoint).await {
        Ok(answer) => answer,
        Err(failure) => return Sample::failed(failure),
    };
    let complete = if endpoint.stream {
        body.ends_with(b"data: [DONE]\n\n") || body.windows(12).any(|w| w == b"data: [DONE]")
    } else {
        body.first() == Some(&b'{')
    };
    Sample {
        failure: if !status.is_success() {
            Some(Failure::Status)
        } else if !complete {
            Some(Failure::Incomplete)
        } else {
            None
        },
        bytes: body.len(),
        events: if endpoint.stream {
            body.windows(6).filter(|w| w == b"data: ").count()
        } else {
            1
        },
    }
}

/// Result of a saturation run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Throughput {
    pub requests: u64,
    pub errors: u64,
    pub rps: f64,
    /// Mean response body size.
    pub bytes: f64,
    /// Mean SSE `data:` events per response (1 when not streaming).
    pub events: f64,
}

/// Closed loop: `concurrency` connections, each sending back to back, for
/// `duration`. Connection `k` goes to `endpoints[k % len]`; one whose request
/// failed is replaced by a new one to the same endpoint. `endpoints` is not
/// empty.
pub async fn saturate(
    endpoints: &[Endpoint],
    concurrency: usize,
    duration: Duration,
) -> Throughput {
    let stop = Arc::new(AtomicBool::new(false));
    let mut senders = Vec::new();
    for k in 0..concurrency {
        let endpoint = &endpoints[k % endpoints.len()];
        match connect(endpoint.addr).await {
            Some(sender) => senders.push((sender, endpoint.clone())),
            None => break,
        }
    }
    if senders.is_empty() {
        return Throughput {
            errors: 1,
            ..Throughput::default()
        };
    }
    let start = Instant::now();
    let mut workers = Vec::new();
    for (mut sender, endpoint) in senders {
        let stop = stop.clone();
        workers.push(tokio::spawn(async move {
            let (mut ok, mut errors, mut bytes, mut events) = (0u64, 0u64, 0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let sample = send(&mut sender, &endpoint).await;
                if sample.ok() {
                    ok += 1;
                    bytes += sample.bytes as u64;
                    events += sample.events as u64;
                } else {
                    errors += 1;
                    match connect(endpoint.addr).await {
                        Some(fresh) => sender = fresh,
                        None => break,
                    }
                }
            }
            (ok, errors, bytes, events)
        }));
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut total = (0u64, 0u64, 0u64, 0u64);
    for worker in workers {
        let (ok, errors, bytes, events) = worker.await.expect("worker");
        total.0 += ok;
        total.1 += errors;
        total.2 += bytes;
        total.3 += events;
    }
    // Requests in flight when `stop` was set finish after the window; count
    // the whole time they took so the rate is not inflated.
    let elapsed = start.elapsed().as_secs_f64();
    let requests = total.0;
    Throughput {
        requests,
        errors: total.1,
        rps: requests as f64 / elapsed,
        bytes: total.2 as f64 / requests.max(1) as f64,
        events: total.3 as f64 / requests.max(1) as f64,
    }
}

/// Closed loop for an exact number of requests: `concurrency` connections
/// to `endpoint` sending back to back until `total` requests were sent.
/// Returns the requests that passed and failed.
pub async fn send_count(endpoint: &Endpoint, concurrency: usize, total: u64) -> (u64, u64) {
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (endpoint, next) = (endpoint.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let (mut ok, mut errors) = (0u64, 0u64);
            let Some(mut sender) = connect(endpoint.addr).await else {
                return (ok, errors);
            };
            while next.fetch_add(1, Ordering::Relaxed) < total {
                if send(&mut sender, &endpoint).await.ok() {
                    ok += 1;
                } else {
                    errors += 1;
                    match connect(endpoint.addr).await {
                        Some(fresh) => sender = fresh,
                        None => break,
                    }
                }
            }
            (ok, errors)
        }));
    }
    let mut total_ok = (0, 0);
    for worker in workers {
        let (ok, errors) = worker.await.expect("worker");
        total_ok.0 += ok;
        total_ok.1 += errors;
    }
    // Requests never sent (every connection failed) count as failed.
    let sent = total_ok.0 + total_ok.1;
    (total_ok.0, total_ok.1 + total.saturating_sub(sent))
}

/// Streams opened by [`open_streams`], each on its own connection, read as
/// their events come until dropped (which closes the connections).
pub struct OpenStreams {
    /// Streams whose response head (2xx) arrived and that have not ended.
    pub open: Arc<std::sync::atomic::AtomicUsize>,
    /// Streams that failed: no connection, not 2xx, or an error.
    pub failed: Arc<std::sync::atomic::AtomicUsize>,
    /// Streams the target ended (the answer was complete) while held.
    pub ended: Arc<std::sync::atomic::AtomicUsize>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl OpenStreams {
    /// (open, failed, ended) now.
    pub fn counts(&self) -> (usize, usize, usize) {
        (
            self.open.load(Ordering::SeqCst),
            self.failed.load(Ordering::SeqCst),
            self.ended.load(Ordering::SeqCst),
        )
    }
}

impl Drop for OpenStreams {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Opens `count` streamed requests to `endpoint` (a streaming one), each on
/// a new connection, at most `opening` connecting at a time; waits until
/// every one is open or failed, or `timeout` passes. The streams stay open,
/// their events read as they arrive, until the result is dropped.
pub async fn open_streams(
    endpoint: &Endpoint,
    count: usize,
    opening: usize,
    timeout: Duration,
) -> OpenStreams {
    use std::sync::atomic::AtomicUsize;
    let streams = OpenStreams {
        open: Arc::new(AtomicUsize::new(0)),
        failed: Arc::new(AtomicUsize::new(0)),
        ended: Arc::new(AtomicUsize::new(0)),
        tasks: Vec::with_capacity(count),
    };
    let permits = Arc::new(tokio::sync::Semaphore::new(opening.max(1)));
    let mut streams = streams;
    for _ in 0..count {
        let endpoint = endpoint.clone();
        let (open, failed, ended) = (
            streams.open.clone(),
            streams.failed.clone(),
            streams.ended.clone(),
        );
        let permits = permits.clone();
        streams.tasks.push(tokio::spawn(async move {
            let response = {
                let head = async {
                    // Only the connecting is limited: a proxy that holds the
                    // response head back (canarygate until the canary echo)
                    // must not slow the opening down.
                    let permit = permits.acquire().await.expect("semaphore");
                    let mut sender = connect(endpoint.addr).await?;
                    drop(permit);
                    sender.ready().await.ok()?;
                    let response = sender.send_request(request(&endpoint)).await.ok()?;
                    // The connection task ends with the sender: keep it.
                    Some((sender, response))
                };
                match tokio::time::timeout(REQUEST_TIMEOUT, head).await {
                    Ok(Some((sender, response))) if response.status().is_success() => {
                        Some((sender, response))
                    }
                    _ => None,
                }
            };
            let Some((_sender, response)) = response else {
                failed.fetch_add(1, Ordering::SeqCst);
                return;
            };
            open.fetch_add(1, Ordering::SeqCst);
            let mut body = response.into_body();
            loop {
                match body.frame().await {
                    Some(Ok(_)) => {}
                    Some(Err(_)) => {
                        open.fetch_sub(1, Ordering::SeqCst);
                        failed.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    None => {
                        open.fetch_sub(1, Ordering::SeqCst);
                        ended.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                }
            }
        }));
    }
    let deadline = Instant::now() + timeout;
    loop {
        let (open, failed, ended) = streams.counts();
        if open + failed + ended >= count || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    streams
}

/// Result of a fixed-rate run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Latency {
    pub requests: u64,
    /// The requests that failed, by kind ([`Failures::total`] of them).
    pub failures: Failures,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// Requests/s actually dispatched (should equal the target rate).
    pub achieved: f64,
}

/// Idle keep-alive connections of one endpoint, the most recently used last.
type Pool = Arc<std::sync::Mutex<Vec<Sender>>>;

/// The most recently used pooled connection that is still open. Connections
/// the server closed while they sat idle (its keep-alive timeout) are
/// dropped, as a client's pool does, instead of failing the next request.
fn take_open(pool: &Pool) -> Option<Sender> {
    let mut pool = pool.lock().unwrap();
    while let Some(sender) = pool.pop() {
        if !sender.is_closed() {
            return Some(sender);
        }
    }
    None
}

/// Open loop: one request every `1/rate` s, each on a free pooled connection
/// (a new one is opened when none is free and open); latency counts from the scheduled
/// send time, so a stall of the target or the generator is not hidden.
/// Request `i` goes to `endpoints[i % len]`, each endpoint with its own pool
/// of connections, so that every instance of a pool gets its share even
/// when one connection would carry the whole rate. `endpoints` is not empty.
///
/// The sends are paced by an OS thread sleeping to each scheduled instant, not
/// by the runtime's timer: tokio's timer wheel rounds every wake-up up to the
/// next millisecond, which would add 0–1 ms to every sample and send requests
/// in bursts on each tick.
pub async fn fixed_rate(endpoints: &[Endpoint], rate: f64, duration: Duration) -> Latency {
    let pools: Vec<(Endpoint, Pool)> = endpoints
        .iter()
        .map(|endpoint| (endpoint.clone(), Pool::default()))
        .collect();
    // 8 connections ready in all, spread round-robin.
    for k in 0..8 {
        let (endpoint, pool) = &pools[k % pools.len()];
        if let Some(sender) = connect(endpoint.addr).await {
            pool.lock().unwrap().push(sender);
        }
    }
    let total = (rate * duration.as_secs_f64()).round().max(1.0) as u64;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let runtime = tokio::runtime::Handle::current();
    let (dispatched, mut tasks) = tokio::sync::mpsc::unbounded_channel();
    let pacer = std::thread::spawn(move || {
        let start = Instant::now();
        let mut last_dispatch = start;
        for i in 0..total {
            let scheduled = start + interval.mul_f64(i as f64);
            if let Some(wait) = scheduled.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            last_dispatch = Instant::now();
            let (endpoint, pool) = pools[i as usize % pools.len()].clone();
            let task = runtime.spawn(async move {
                let pooled = take_open(&pool);
                let sender = match pooled {
                    Some(sender) => Some(sender),
                    None => connect(endpoint.addr).await,
                };
                let Some(mut sender) = sender else {
                    return (Some(Failure::Connect), scheduled.elapsed());
                };
                let sample = send(&mut sender, &endpoint).await;
                let latency = scheduled.elapsed();
                if sample.ok() {
                    pool.lock().unwrap().push(sender);
                }
                (sample.failure, latency)
            });
            if dispatched.send(task).is_err() {
                break;
            }
        }
        last_dispatch - start
    });
    let mut latencies = Vec::with_capacity(total as usize);
    let mut failures = Failures::default();
    while let Some(task) = tasks.recv().await {
        match task.await.expect("request task") {
            (None, latency) => latencies.push(latency.as_secs_f64() * 1e6),
            (Some(failure), _) => failures.count(failure),
        }
    }
    let dispatch_span = pacer.join().expect("pacer thread").as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    Latency {
        requests: latencies.len() as u64,
        failures,
        p50_us: percentile(&latencies, 0.50),
        p90_us: percentile(&latencies, 0.90),
        p99_us: percentile(&latencies, 0.99),
        max_us: latencies.last().copied().unwrap_or(f64::NAN),
        achieved: if total > 1 && dispatch_span > 0.0 {
            (total - 1) as f64 / dispatch_span
        } else {
            rate
        },
    }
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// What one fully parsed answer held.
#[derive(Debug, Clone, Default)]
pub struct Answer {
    pub bytes: usize,
    /// SSE `data:` events (streaming).
    pub events: usize,
    /// Events whose delta carried text (streaming), i.e. about the tokens.
    pub content_events: usize,
    pub content_chars: usize,
    pub completion_tokens: Option<u64>,
    pub finish_reason: Option<String>,
}

/// Sends one request and parses the whole answer. `Err` explains what is
/// wrong with it (not 2xx, not JSON, no `[DONE]`, no text).
pub async fn check(endpoint: &Endpoint) -> Result<Answer, String> {
    let mut sender = try_connect(endpoint.addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (status, body) = exchange(&mut sender, endpoint)
        .await
        .map_err(|failure| format!("no complete answer ({})", failure.name()))?;
    let text = String::from_utf8_lossy(&body);
    let snippet: String = text.chars().take(400).collect();
    if !status.is_success() {
        return Err(format!("HTTP {status}: {snippet}"));
    }
    let mut answer = Answer {
        bytes: body.len(),
        ..Answer::default()
    };
    let usage_tokens = |value: &serde_json::Value| value["usage"]["completion_tokens"].as_u64();
    if endpoint.stream {
        let mut done = false;
        for line in text.lines() {
            let Some(data) = line.strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            answer.events += 1;
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(data)
                .map_err(|e| format!("event is not JSON ({e}): {data}"))?;
            if let Some(error) = value.get("error") {
                return Err(format!("error event: {error}"));
            }
            let choice = &value["choices"][0];
            if let Some(content) = choice["delta"]["content"].as_str()
                && !content.is_empty()
            {
                answer.content_events += 1;
                answer.content_chars += content.chars().count();
            }
            if let Some(reason) = choice["finish_reason"].as_str() {
                answer.finish_reason = Some(reason.to_owned());
            }
            if let Some(tokens) = usage_tokens(&value) {
                answer.completion_tokens = Some(tokens);
            }
        }
        if !done {
            return Err(format!("stream without [DONE]: {snippet}"));
        }
    } else {
        let value: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| format!("not JSON ({e}): {snippet}"))?;
        let choice = &value["choices"][0];
        answer.content_chars = choice["message"]["content"]
            .as_str()
            .map_or(0, |c| c.chars().count());
        answer.finish_reason = choice["finish_reason"].as_str().map(str::to_owned);
        answer.completion_tokens = usage_tokens(&value);
        answer.events = 1;
    }
    if answer.content_chars == 0 {
        return Err(format!("answer without text: {snippet}"));
    }
    Ok(answer)
}

/// [`check`], retried until it passes or `timeout` runs out (servers that
/// are still starting, like LiteLLM, refuse connections for a while).
pub async fn wait_ready(endpoint: &Endpoint, timeout: Duration) -> Result<Answer, String> {
    let deadline = Instant::now() + timeout;
    loop {
        match check(endpoint).await {
            Ok(answer) => return Ok(answer),
            Err(error) if Instant::now() >= deadline => return Err(error),
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// A server on a free port answering `{}` to everything; counts the
    /// connections it accepted and the requests it answered.
    struct CountingServer {
        endpoint: Endpoint,
        connections: Arc<AtomicU64>,
        requests: Arc<AtomicU64>,
    }

    impl CountingServer {
        async fn start() -> Self {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let connections = Arc::new(AtomicU64::new(0));
            let requests = Arc::new(AtomicU64::new(0));
            let (accepted, answered) = (connections.clone(), requests.clone());
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let answered = answered.clone();
                    let service = hyper::service::service_fn(
                        move |request: hyper::Request<hyper::body::Incoming>| {
                            let answered = answered.clone();
                            async move {
                                request.into_body().collect().await?;
                                answered.fetch_add(1, Ordering::SeqCst);
                                Ok::<_, hyper::Error>(hyper::Response::new(Full::new(
                                    Bytes::from_static(b"{}"),
                                )))
                            }
                        },
                    );
                    tokio::spawn(
                        hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service),
                    );
                }
            });
            let endpoint = Endpoint {
                addr,
                host: addr.to_string(),
                path: "/v1/chat/completions".to_owned(),
                authorization: "Bearer sk-test".to_owned(),
                body: chat_body("m", false, false, 8, &prompt_text(3, 7, 0)),
                stream: false,
            };
            Self {
                endpoint,
                connections,
                requests,
            }
        }

        fn counts(&self) -> (u64, u64) {
            (
                self.connections.load(Ordering::SeqCst),
                self.requests.load(Ordering::SeqCst),
            )
        }
    }

    #[tokio::test]
    async fn a_pool_shares_the_load_round_robin() {
        let (a, b) = (CountingServer::start().await, CountingServer::start().await);
        let pool = [a.endpoint.clone(), b.endpoint.clone()];

        // Fixed rate: requests alternate, 10 each, whatever connection is free.
        let latency = fixed_rate(&pool, 200.0, Duration::from_millis(100)).await;
        assert_eq!((latency.requests, latency.failures.total()), (20, 0));
        assert_eq!(a.counts().1, 10);
        assert_eq!(b.counts().1, 10);

        // Saturation: 3 connections to a, 3 to b, each kept for the run.
        let (a0, b0) = (a.counts(), b.counts());
        let throughput = saturate(&pool, 6, Duration::from_millis(100)).await;
        assert_eq!(throughput.errors, 0);
        let (a1, b1) = (a.counts(), b.counts());
        assert_eq!((a1.0 - a0.0, b1.0 - b0.0), (3, 3));
        assert!(a1.1 > a0.1 && b1.1 > b0.1);
        assert_eq!(a1.1 - a0.1 + b1.1 - b0.1, throughput.requests);

        // One endpoint gets everything.
        let latency = fixed_rate(&pool[..1], 200.0, Duration::from_millis(50)).await;
        assert_eq!(latency.requests, 10);
        assert_eq!(a.counts().1, a1.1 + 10);
        assert_eq!(b.counts().1, b1.1);
    }

    #[tokio::test]
    async fn exact_counts_and_held_streams() {
        let server = CountingServer::start().await;
        let (ok, errors) = send_count(&server.endpoint, 4, 25).await;
        assert_eq!((ok, errors), (25, 0));
        assert_eq!(server.counts(), (4, 25));

        // The counting server answers at once: each stream opens, then ends.
        let streams = open_streams(&server.endpoint, 10, 3, Duration::from_secs(5)).await;
        assert_eq!(streams.counts(), (0, 0, 10));
        assert_eq!(server.counts(), (14, 35));

        // Nothing listening: every stream fails, none hangs.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut closed = server.endpoint.clone();
        closed.addr = listener.local_addr().unwrap();
        drop(listener);
        let (ok, errors) = send_count(&closed, 2, 5).await;
        assert_eq!((ok, errors), (0, 5));
    }

    /// A server on a free port answering every request with `status` and
    /// `body`.
    async fn answering(status: u16, body: &'static [u8]) -> Endpoint {
        serving(status, body, true).await
    }

    /// [`answering`], closing each connection after its first answer when
    /// `keep_alive` is false.
    async fn serving(status: u16, body: &'static [u8], keep_alive: bool) -> Endpoint {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let service = hyper::service::service_fn(
                    move |request: hyper::Request<hyper::body::Incoming>| async move {
                        request.into_body().collect().await?;
                        let mut response =
                            hyper::Response::new(Full::new(Bytes::from_static(body)));
                        *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                        Ok::<_, hyper::Error>(response)
                    },
                );
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .keep_alive(keep_alive)
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        Endpoint {
            addr,
            host: addr.to_string(),
            path: "/v1/chat/completions".to_owned(),
            authorization: "Bearer sk-test".to_owned(),
            body: chat_body("m", false, false, 8, "hi"),
            stream: false,
        }
    }

    #[tokio::test]
    async fn failures_are_counted_by_kind() {
        let refused = answering(503, b"{\"error\":{}}").await;
        let latency = fixed_rate(
            std::slice::from_ref(&refused),
            200.0,
            Duration::from_millis(50),
        )
        .await;
        assert_eq!((latency.requests, latency.failures.total()), (0, 10));
        assert_eq!(latency.failures, Failures([0, 0, 0, 10, 0]));
        assert_eq!(latency.failures.describe(), "10 status");

        let cut = answering(200, b"data: {}").await;
        let latency = fixed_rate(&[cut], 200.0, Duration::from_millis(50)).await;
        assert_eq!(latency.failures, Failures([0, 0, 0, 0, 10]));
        assert_eq!(latency.failures.describe(), "10 incomplete");

        let whole = answering(200, b"{}").await;
        let latency = fixed_rate(&[whole], 200.0, Duration::from_millis(50)).await;
        assert_eq!((latency.requests, latency.failures.total()), (10, 0));
        assert_eq!(latency.failures.describe(), "none");
        let every_kind = Failures([1, 2, 3, 4, 5]);
        assert_eq!(
            every_kind.describe(),
            "1 connect, 2 timeout, 3 transport, 4 status, 5 incomplete"
        );
        assert_eq!(
            every_kind.to_json(),
            serde_json::json!({"connect": 1, "timeout": 2, "transport": 3, "status": 4, "incomplete": 5})
        );
    }

    #[tokio::test]
    async fn connections_the_server_closed_are_not_reused() {
        // Every connection is closed after one answer, as a server's
        // keep-alive timeout closes the idle ones in a pool: none of them
        // may fail a later request.
        let closing = serving(200, b"{}", false).await;
        let latency = fixed_rate(&[closing], 200.0, Duration::from_millis(100)).await;
        assert_eq!((latency.requests, latency.failures.total()), (20, 0));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 0.5), 50.0);
        assert_eq!(percentile(&values, 0.99), 99.0);
        assert_eq!(percentile(&values, 1.0), 100.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn body_is_the_same_json_for_every_target() {
        let body = chat_body("m", true, true, 64, &prompt_text(3, 7, 0));
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["max_tokens"], 64);
        assert_eq!(value["stream"], true);
        assert_eq!(
            value["messages"][0]["content"],
            "w0-a-b-c w1-a-b-c w2-a-b-c"
        );
        assert_eq!(value["stream_options"]["include_usage"], true);
        let plain: serde_json::Value =
            serde_json::from_slice(&chat_body("m", false, false, 64, "hi")).unwrap();
        assert!(plain.get("stream_options").is_none());
        let unasked: serde_json::Value =
            serde_json::from_slice(&chat_body("m", true, false, 64, "hi")).unwrap();
        assert!(unasked.get("stream_options").is_none());
    }

    #[test]
    fn prompts_have_the_asked_words_tokens_or_bytes() {
        assert_eq!(prompt_text(2, 3, 0), "w0-a w1-a");
        assert_eq!(prompt_text(1, 1, 0), "w0");
        assert_eq!(prompt_text(0, 7, 0), "");
        // Letters cycle past z.
        let long = prompt_text(1, 61, 0);
        assert_eq!(long.matches('-').count(), 30);
        assert!(long.ends_with("-z-a-b-c-d"));
        // A length in bytes: at least that long, by less than a word more.
        for bytes in [1, 1024, 65_536, 1 << 20] {
            let text = prompt_text(96, 7, bytes);
            let last_word = text.rsplit(' ').next().unwrap().len();
            assert!(text.len() >= bytes, "{bytes}");
            assert!(text.len() < bytes + last_word + 1, "{bytes}");
        }
        // Words stay distinct, so no two prompts share more than they must.
        let text = prompt_text(0, 7, 4096);
        let words: std::collections::HashSet<&str> = text.split(' ').collect();
        assert_eq!(words.len(), text.split(' ').count());
    }
}
