//! Proxy overhead benchmark: requests/s and latency through canarygate versus
//! straight to the simulated provider, measured in the same run.
//!
//! Run with `cargo bench --bench proxy_overhead`. Both servers are real
//! processes (`canarygate sim-provider`, `canarygate serve`) on 127.0.0.1; the
//! load generator is a single-threaded tokio runtime driving hyper HTTP/1.1
//! keep-alive connections.
//!
//! For each round, each mode (non-streaming, streaming) and each target
//! (direct, through canarygate; the order alternates between rounds):
//! - warm-up, then saturation throughput with a fixed number of connections
//!   for a fixed duration, with the CPU time the proxy and the sim spent
//!   (from `/proc/PID/stat`) divided by the requests served;
//! - latency at a fixed open-loop rate (requests are sent on schedule whatever
//!   the earlier ones are doing; latency counts from the scheduled send time).
//!
//! Reported numbers are medians over the rounds; ratios and added latency are
//! computed within each round (same conditions) and then their median taken.
//!
//! Settings (environment):
//! - `CANARYGATE_BENCH_SECONDS` (default 3): length of each measured phase.
//! - `CANARYGATE_BENCH_ROUNDS` (default 3).
//! - `CANARYGATE_BENCH_CONCURRENCY` (default 32): connections at saturation.
//! - `CANARYGATE_BENCH_RATE` (default 200): requests/s of the latency phase.
//! - `CANARYGATE_BENCH_PIN=1`: pin the servers to CPU 1 and the load generator
//!   to CPU 0 with `taskset` (off by default; other load on the machine is not
//!   pinned, so pinning can make a shared machine noisier, not quieter).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Longest a single request may take before the benchmark gives up on it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Benchmark settings.
#[derive(Debug, Clone, Copy)]
struct Settings {
    seconds: f64,
    rounds: usize,
    concurrency: usize,
    rate: f64,
    pin: bool,
}

impl Settings {
    fn from_env() -> Self {
        fn var<T: std::str::FromStr>(name: &str, default: T) -> T {
            match std::env::var(name) {
                Ok(text) => text
                    .parse()
                    .unwrap_or_else(|_| panic!("{name}={text} does not parse")),
                Err(_) => default,
            }
        }
        let settings = Self {
            seconds: var("CANARYGATE_BENCH_SECONDS", 3.0),
            rounds: var("CANARYGATE_BENCH_ROUNDS", 3),
            concurrency: var("CANARYGATE_BENCH_CONCURRENCY", 32),
            rate: var("CANARYGATE_BENCH_RATE", 200.0),
            pin: var("CANARYGATE_BENCH_PIN", 0u8) == 1,
        };
        assert!(
            settings.seconds > 0.0,
            "CANARYGATE_BENCH_SECONDS must be > 0"
        );
        assert!(settings.rounds > 0, "CANARYGATE_BENCH_ROUNDS must be > 0");
        assert!(
            settings.concurrency > 0,
            "CANARYGATE_BENCH_CONCURRENCY must be > 0"
        );
        assert!(settings.rate > 0.0, "CANARYGATE_BENCH_RATE must be > 0");
        settings
    }

    fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.seconds)
    }

    fn warmup(&self) -> Duration {
        Duration::from_secs_f64((self.seconds / 4.0).clamp(0.2, 1.0))
    }
}

/// A `canarygate` child process, killed when dropped (also on panic).
struct Server {
    child: Child,
    url: String,
    addr: SocketAddr,
}

impl Server {
    /// Starts `canarygate <args>` and waits for its "listening on URL" line.
    fn start(args: &[&str], pin_cpu: Option<usize>) -> Self {
        let binary = env!("CARGO_BIN_EXE_canarygate");
        let mut command = match pin_cpu {
            Some(cpu) => {
                let mut command = Command::new("taskset");
                command.args(["-c", &cpu.to_string(), binary]);
                command
            }
            None => Command::new(binary),
        };
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .env("CANARYGATE_LOG", "warn");
        let mut child = command.spawn().expect("spawn canarygate");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let line = match lines.next() {
            Some(Ok(line)) => line,
            other => {
                let _ = child.kill();
                let status = child.wait().ok();
                panic!("canarygate {args:?} exited before listening: {other:?}, status {status:?}");
            }
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        let url = line
            .rsplit(' ')
            .next()
            .filter(|url| url.starts_with("http://"))
            .unwrap_or_else(|| panic!("unexpected first line: {line}"))
            .to_owned();
        let addr: SocketAddr = url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .parse()
            .unwrap_or_else(|e| panic!("address in {url}: {e}"));
        assert!(addr.ip().is_loopback(), "{url} is not a loopback address");
        Self { child, url, addr }
    }

    /// CPU time (user + system) the process has used so far.
    fn cpu_time(&self) -> Duration {
        cpu_time_of(&format!("/proc/{}/stat", self.child.id()))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Clock ticks per second of `/proc/*/stat` times.
fn clock_ticks() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(100)
    })
}

/// utime + stime of a `/proc/.../stat` file.
fn cpu_time_of(path: &str) -> Duration {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Duration::ZERO;
    };
    // Fields after the parenthesised command name: state is field 3, so
    // utime (14) and stime (15) are at indices 11 and 12.
    let rest = &text[text.rfind(')').map_or(0, |i| i + 1)..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum())
        .unwrap_or(0);
    Duration::from_secs_f64(ticks as f64 / clock_ticks() as f64)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Direct,
    Proxy,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Proxy => "canarygate",
        }
    }
}

/// What to send to one target.
#[derive(Clone)]
struct Endpoint {
    addr: SocketAddr,
    host: String,
    path: &'static str,
    body: Bytes,
    stream: bool,
}

/// The request body: a user message long enough for a full-length reply.
fn chat_body(stream: bool) -> Bytes {
    let words: Vec<String> = (0..96).map(|i| format!("word{i}")).collect();
    let text = format!("Please summarise these notes: {}", words.join(" "));
    let body = serde_json::json!({
        "model": "m",
        "stream": stream,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": text}],
    });
    Bytes::from(body.to_string())
}

type Sender = SendRequest<Full<Bytes>>;

async fn connect(addr: SocketAddr) -> Sender {
    let stream = TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    sender
}

/// Outcome of one request.
#[derive(Clone, Copy)]
struct Sample {
    ok: bool,
    bytes: usize,
    events: usize,
}

/// Sends one request on `sender` and reads the whole answer.
async fn send(sender: &mut Sender, endpoint: &Endpoint) -> Sample {
    let failed = Sample {
        ok: false,
        bytes: 0,
        events: 0,
    };
    let request = hyper::Request::post(endpoint.path)
        .header(hyper::header::HOST, &endpoint.host)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(hyper::header::AUTHORIZATION, "Bearer x")
        .body(Full::new(endpoint.body.clone()))
        .expect("request");
    let work = async {
        if sender.ready().await.is_err() {
            return failed;
        }
        let Ok(response) = sender.send_request(request).await else {
            return failed;
        };
        let status = response.status();
        let Ok(body) = response.into_body().collect().await else {
            return failed;
        };
        let body = body.to_bytes();
        let complete = if endpoint.stream {
            body.windows(12).any(|w| w == b"data: [DONE]")
        } else {
            body.first() == Some(&b'{')
        };
        Sample {
            ok: status.is_success() && complete,
            bytes: body.len(),
            events: if endpoint.stream {
                body.windows(6).filter(|w| w == b"data: ").count()
            } else {
                1
            },
        }
    };
    tokio::time::timeout(REQUEST_TIMEOUT, work)
        .await
        .unwrap_or(failed)
}

/// Result of a saturation run.
#[derive(Debug, Clone, Copy, Default)]
struct Throughput {
    requests: u64,
    errors: u64,
    rps: f64,
    /// Mean response body size.
    bytes: f64,
    /// Mean SSE events per response (streaming).
    events: f64,
}

/// Closed loop: `concurrency` connections, each sending back to back, for `duration`.
async fn saturate(endpoint: &Endpoint, concurrency: usize, duration: Duration) -> Throughput {
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    let mut senders = Vec::new();
    for _ in 0..concurrency {
        senders.push(connect(endpoint.addr).await);
    }
    let start = Instant::now();
    for mut sender in senders {
        let stop = stop.clone();
        let endpoint = endpoint.clone();
        workers.push(tokio::spawn(async move {
            let (mut ok, mut errors, mut bytes, mut events) = (0u64, 0u64, 0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let sample = send(&mut sender, &endpoint).await;
                if sample.ok {
                    ok += 1;
                    bytes += sample.bytes as u64;
                    events += sample.events as u64;
                } else {
                    errors += 1;
                    sender = connect(endpoint.addr).await;
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

/// Result of a fixed-rate run.
#[derive(Debug, Clone, Copy, Default)]
struct Latency {
    requests: u64,
    errors: u64,
    p50_us: f64,
    p99_us: f64,
    /// Requests/s actually dispatched (should equal the target rate).
    achieved: f64,
}

/// Open loop: one request every `1/rate` s, each on a free pooled connection
/// (a new one is opened when none is free); latency from the scheduled time.
async fn fixed_rate(endpoint: &Endpoint, rate: f64, duration: Duration) -> Latency {
    let pool: Arc<std::sync::Mutex<Vec<Sender>>> = Arc::new(std::sync::Mutex::new(Vec::new()));
    for _ in 0..8 {
        let sender = connect(endpoint.addr).await;
        pool.lock().unwrap().push(sender);
    }
    let total = (rate * duration.as_secs_f64()).round().max(1.0) as u64;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(total as usize);
    let mut last_dispatch = start;
    for i in 0..total {
        let scheduled = start + interval * i as u32;
        tokio::time::sleep_until(scheduled).await;
        last_dispatch = tokio::time::Instant::now();
        let pool = pool.clone();
        let endpoint = endpoint.clone();
        tasks.push(tokio::spawn(async move {
            let pooled = pool.lock().unwrap().pop();
            let mut sender = match pooled {
                Some(sender) => sender,
                None => connect(endpoint.addr).await,
            };
            let sample = send(&mut sender, &endpoint).await;
            let latency = scheduled.elapsed();
            if sample.ok {
                pool.lock().unwrap().push(sender);
            }
            (sample.ok, latency)
        }));
    }
    let mut latencies = Vec::with_capacity(total as usize);
    let mut errors = 0;
    for task in tasks {
        let (ok, latency) = task.await.expect("request task");
        if ok {
            latencies.push(latency.as_secs_f64() * 1e6);
        } else {
            errors += 1;
        }
    }
    // Dispatch rate: how well the generator kept to the schedule.
    let dispatch_span = (last_dispatch - start).as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    Latency {
        requests: latencies.len() as u64,
        errors,
        p50_us: percentile(&latencies, 0.50),
        p99_us: percentile(&latencies, 0.99),
        achieved: if total > 1 && dispatch_span > 0.0 {
            (total - 1) as f64 / dispatch_span
        } else {
            rate
        },
    }
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn median(mut values: Vec<f64>) -> f64 {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// One target measured once.
#[derive(Debug, Clone, Copy, Default)]
struct Measurement {
    throughput: Throughput,
    latency: Latency,
    /// Proxy process CPU per request at saturation (µs); 0 for direct.
    proxy_cpu_us: f64,
    /// Sim process CPU per request at saturation (µs).
    sim_cpu_us: f64,
    /// Load generator CPU per request at saturation (µs).
    client_cpu_us: f64,
}

struct Bench {
    settings: Settings,
    sim: Server,
    proxy: Server,
    _data: tempfile::TempDir,
}

impl Bench {
    fn endpoint(&self, target: Target, stream: bool) -> Endpoint {
        let server = match target {
            Target::Direct => &self.sim,
            Target::Proxy => &self.proxy,
        };
        Endpoint {
            addr: server.addr,
            host: server.addr.to_string(),
            path: "/v1/chat/completions",
            body: chat_body(stream),
            stream,
        }
    }

    async fn measure(&self, target: Target, stream: bool) -> Measurement {
        let endpoint = self.endpoint(target, stream);
        let settings = self.settings;
        saturate(&endpoint, settings.concurrency, settings.warmup()).await;

        let before = (
            self.proxy.cpu_time(),
            self.sim.cpu_time(),
            cpu_time_of("/proc/self/stat"),
        );
        let throughput = saturate(&endpoint, settings.concurrency, settings.duration()).await;
        let after = (
            self.proxy.cpu_time(),
            self.sim.cpu_time(),
            cpu_time_of("/proc/self/stat"),
        );
        let per_request = |b: Duration, a: Duration| {
            a.saturating_sub(b).as_secs_f64() * 1e6 / throughput.requests.max(1) as f64
        };
        let proxy_cpu_us = match target {
            Target::Direct => 0.0,
            Target::Proxy => per_request(before.0, after.0),
        };
        let sim_cpu_us = per_request(before.1, after.1);
        let client_cpu_us = per_request(before.2, after.2);

        // Let the servers settle after saturation.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let latency = fixed_rate(&endpoint, settings.rate, settings.duration()).await;
        Measurement {
            throughput,
            latency,
            proxy_cpu_us,
            sim_cpu_us,
            client_cpu_us,
        }
    }
}

/// Medians and paired ratios of one mode (streaming or not) over the rounds.
#[derive(Default)]
struct ModeResults {
    direct: Vec<Measurement>,
    proxy: Vec<Measurement>,
}

impl ModeResults {
    fn med(list: &[Measurement], f: impl Fn(&Measurement) -> f64) -> f64 {
        median(list.iter().map(f).collect())
    }

    fn paired(&self, f: impl Fn(&Measurement, &Measurement) -> f64) -> f64 {
        median(
            self.direct
                .iter()
                .zip(&self.proxy)
                .map(|(d, p)| f(d, p))
                .collect(),
        )
    }
}

fn print_round(label: &str, target: Target, m: &Measurement) {
    println!(
        "  {label:<10} {:<10} {:>9.0} req/s ({} ok, {} err) | p50 {:>7.0} µs p99 {:>7.0} µs at {:.0} req/s ({} ok, {} err) | cpu/req proxy {:>5.0} µs sim {:>5.0} µs client {:>5.0} µs | {:.0} B, {:.1} events/resp",
        target.name(),
        m.throughput.rps,
        m.throughput.requests,
        m.throughput.errors,
        m.latency.p50_us,
        m.latency.p99_us,
        m.latency.achieved,
        m.latency.requests,
        m.latency.errors,
        m.proxy_cpu_us,
        m.sim_cpu_us,
        m.client_cpu_us,
        m.throughput.bytes,
        m.throughput.events,
    );
}

fn main() {
    let settings = Settings::from_env();
    let pin = settings.pin && Command::new("taskset").arg("-p").arg("1").output().is_ok();
    if settings.pin && !pin {
        eprintln!("taskset not available: not pinning");
    }
    let data = tempfile::tempdir().expect("tempdir");
    let sim = Server::start(
        &["sim-provider", "--listen", "127.0.0.1:0"],
        pin.then_some(1),
    );
    let data_dir = data.path().join("data");
    let upstream = format!("{}/v1", sim.url.trim_end_matches('/'));
    let proxy = Server::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data",
            data_dir.to_str().expect("utf-8 temp path"),
            "--upstream",
            &upstream,
        ],
        pin.then_some(1),
    );
    if pin {
        // Pin this process (the load generator) to the other CPU.
        let _ = Command::new("taskset")
            .args(["-p", "-c", "0", &std::process::id().to_string()])
            .stdout(Stdio::null())
            .status();
    }
    let bench = Bench {
        settings,
        sim,
        proxy,
        _data: data,
    };

    println!(
        "proxy_overhead: {} round(s), {:.1} s phases, {} connections at saturation, {:.0} req/s for latency, cpus {}{}",
        settings.rounds,
        settings.seconds,
        settings.concurrency,
        settings.rate,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        if pin {
            " (servers pinned to cpu 1, load generator to cpu 0)"
        } else {
            " (unpinned)"
        },
    );
    println!(
        "  sim at {} (pid {}), canarygate at {} (pid {})",
        bench.sim.url,
        bench.sim.child.id(),
        bench.proxy.url,
        bench.proxy.child.id()
    );

    // One thread: the load generator takes at most one core of the machine.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut results = [ModeResults::default(), ModeResults::default()];
    runtime.block_on(async {
        for round in 0..settings.rounds {
            println!("round {}", round + 1);
            let order = if round % 2 == 0 {
                [Target::Direct, Target::Proxy]
            } else {
                [Target::Proxy, Target::Direct]
            };
            for (index, stream) in [false, true].into_iter().enumerate() {
                let label = if stream { "stream" } else { "non-stream" };
                for target in order {
                    let m = bench.measure(target, stream).await;
                    print_round(label, target, &m);
                    match target {
                        Target::Direct => results[index].direct.push(m),
                        Target::Proxy => results[index].proxy.push(m),
                    }
                }
            }
        }
    });
    drop(runtime);

    println!();
    println!(
        "medians over {} round(s) ({:.1} s phases, {} connections, latency at {:.0} req/s open loop):",
        settings.rounds, settings.seconds, settings.concurrency, settings.rate
    );
    println!();
    println!(
        "| mode | target | req/s | p50 µs | p99 µs | proxy CPU µs/req | sim CPU µs/req | resp bytes |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for (index, label) in ["non-stream", "stream"].into_iter().enumerate() {
        let r = &results[index];
        for (target, list) in [(Target::Direct, &r.direct), (Target::Proxy, &r.proxy)] {
            println!(
                "| {label} | {} | {:.0} | {:.0} | {:.0} | {} | {:.0} | {:.0} |",
                target.name(),
                ModeResults::med(list, |m| m.throughput.rps),
                ModeResults::med(list, |m| m.latency.p50_us),
                ModeResults::med(list, |m| m.latency.p99_us),
                match target {
                    Target::Direct => "-".to_owned(),
                    Target::Proxy => format!("{:.0}", ModeResults::med(list, |m| m.proxy_cpu_us)),
                },
                ModeResults::med(list, |m| m.sim_cpu_us),
                ModeResults::med(list, |m| m.throughput.bytes),
            );
        }
    }
    println!();
    println!("| mode | canarygate/direct req/s | added p50 µs | added p99 µs |");
    println!("|---|---:|---:|---:|");
    for (index, label) in ["non-stream", "stream"].into_iter().enumerate() {
        let r = &results[index];
        println!(
            "| {label} | {:.2} | {:.0} | {:.0} |",
            r.paired(|d, p| p.throughput.rps / d.throughput.rps),
            r.paired(|d, p| p.latency.p50_us - d.latency.p50_us),
            r.paired(|d, p| p.latency.p99_us - d.latency.p99_us),
        );
    }
    let errors: u64 = results
        .iter()
        .flat_map(|r| r.direct.iter().chain(&r.proxy))
        .map(|m| m.throughput.errors + m.latency.errors)
        .sum();
    if errors > 0 {
        println!();
        println!("warning: {errors} failed request(s); see the per-round lines");
    }
}
