//! canarygate-bench-memory: resident memory against the work a proxy holds
//! (`bench/growth.sh` starts the servers).
//!
//! - `streams`: RSS of each target's process tree with N slow streams open
//!   (each on its own connection, its events read as they come) against
//!   just before, for each N in turn: bytes per open stream.
//! - `canaries`: RSS of canarygate before and after a number of
//!   non-streamed requests, each leaving its canaries live (for the
//!   registry's TTL): bytes per request and per canary, an upper bound (it
//!   counts whatever else the requests leave behind).
//! - `soak`: steady load at a fixed rate (by default half the target's
//!   saturation) for some minutes, RSS sampled every few seconds: the slope
//!   (bytes per minute), start and end. For a target with `metrics`
//!   (canarygate), what it holds is read from `/metrics` with each sample
//!   (its audit store's page cache, its canaries, its client connections),
//!   and the same figures are given for the RSS less that cache, which is
//!   bounded and fills as the audit file grows.
//!
//! Each prints its numbers and writes them to `--json`.

use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use serde_json::{Value, json};

use canarygate_bench::load::{self, Endpoint};
use canarygate_bench::memory::{self, median};
use canarygate_bench::overhead;
use canarygate_bench::target::Target;

#[derive(Parser, Debug)]
#[command(
    about = "Resident memory with open streams, per canary, and over a soak (bench/growth.sh)"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
    /// `max_tokens` of every request.
    #[arg(long, global = true, default_value_t = 64)]
    max_tokens: u64,
    /// Words in the user message (7 tokens each).
    #[arg(long, global = true, default_value_t = 96)]
    prompt_words: usize,
    /// Write the results to this JSON file.
    #[arg(long, global = true)]
    json: Option<std::path::PathBuf>,
    /// Free text copied into the JSON.
    #[arg(long, global = true, default_value = "")]
    note: String,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// RSS with N open streams against without, per target and N.
    Streams {
        /// `NAME=URL,pid=PID` (the `canarygate-bench` syntax); repeat.
        #[arg(long = "target", required = true)]
        targets: Vec<String>,
        /// Numbers of streams, measured in this order on each target.
        #[arg(long, value_delimiter = ',', default_value = "100,1000,10000")]
        counts: Vec<usize>,
        /// Connections being opened at a time.
        #[arg(long, default_value_t = 256)]
        opening: usize,
        /// Longest wait for every stream to open, seconds.
        #[arg(long, default_value_t = 90.0)]
        open_timeout: f64,
        /// Wait after the last stream opened before reading RSS, seconds.
        #[arg(long, default_value_t = 2.0)]
        settle: f64,
        /// Longest wait, before each point, for the target to let go of the
        /// last point's streams (its open files back to idle), seconds.
        #[arg(long, default_value_t = 180.0)]
        drain_timeout: f64,
    },
    /// RSS of canarygate before and after REQUESTS requests.
    Canaries {
        /// `NAME=URL,pid=PID`; repeat.
        #[arg(long = "target", required = true)]
        targets: Vec<String>,
        /// Requests measured (each leaves `canaries_per_request` live).
        #[arg(long, default_value_t = 5000)]
        requests: u64,
        /// Requests sent first, unmeasured (pools, caches, the allocator's arenas).
        #[arg(long, default_value_t = 1000)]
        warmup: u64,
        /// Connections sending.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// Canaries each request registers (the default preset's `head+tail` echo: 2).
        #[arg(long, default_value_t = 2)]
        canaries_per_request: u64,
    },
    /// Steady load for MINUTES, RSS sampled.
    Soak {
        /// `NAME=URL,pid=PID` (with `,metrics`, also what it holds).
        #[arg(long = "target", required = true)]
        target: String,
        /// Length of the steady load, minutes.
        #[arg(long, default_value_t = 10.0)]
        minutes: f64,
        /// Seconds between RSS samples.
        #[arg(long, default_value_t = 5.0)]
        sample_seconds: f64,
        /// Requests/s (0: `rate_fraction` of the saturation measured first).
        #[arg(long, default_value_t = 0.0)]
        rate: f64,
        /// Fraction of saturation for the automatic rate.
        #[arg(long, default_value_t = 0.5)]
        rate_fraction: f64,
        /// Connections for the saturation measurement.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// Samples of the first WARMUP seconds are left out of the slope
        /// (default: 60 s, at most a fifth of the soak).
        #[arg(long)]
        warmup: Option<f64>,
        /// Streamed requests instead of non-streamed.
        #[arg(long)]
        stream: bool,
    },
}

fn endpoint(args: &Args, spec: &str, stream: bool) -> Result<(Target, Endpoint), String> {
    let target = Target::parse(spec)?;
    if target.pids.is_empty() || target.instances.len() != 1 {
        return Err(format!("{spec}: one URL and pid=PID wanted"));
    }
    let prompt = load::prompt_text(args.prompt_words, 7, 0);
    let body = load::chat_body(
        load::DEFAULT_MODEL,
        stream,
        stream,
        args.max_tokens,
        &prompt,
    );
    let mut endpoints = target.endpoints(&body, "Bearer sk-bench", stream);
    Ok((target, endpoints.remove(0)))
}

/// The median of three RSS readings of `target` 200 ms apart, bytes.
async fn steady_rss(target: &Target) -> f64 {
    let mut readings = Vec::new();
    for k in 0..3 {
        if k > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        readings.push(target.rss().unwrap_or(0) as f64);
    }
    median(readings)
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / 1048576.0)
}

#[allow(clippy::too_many_arguments)]
async fn streams(
    args: &Args,
    specs: &[String],
    counts: &[usize],
    opening: usize,
    open_timeout: f64,
    settle: f64,
    drain_timeout: f64,
) -> Result<Value, String> {
    let mut results = Vec::new();
    for spec in specs {
        let (target, endpoint) = endpoint(args, spec, true)?;
        // A slow model's whole answer takes minutes: check that one stream opens.
        let probe = load::open_streams(&endpoint, 1, 1, Duration::from_secs(60)).await;
        if probe.counts().0 != 1 {
            return Err(format!(
                "{}: a stream did not open (open, failed, ended: {:?})",
                target.name,
                probe.counts()
            ));
        }
        drop(probe);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let idle_files = memory::trees_open_files(&target.pids);
        for &count in counts {
            // A proxy may still hold the streams of the last point (their
            // provider side runs on after the client left): wait until its
            // open files are back near where they were.
            let started = Instant::now();
            let drain = Duration::from_secs_f64(drain_timeout);
            while memory::trees_open_files(&target.pids) > idle_files + 64
                && started.elapsed() < drain
            {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            let drained_seconds = started.elapsed().as_secs_f64();
            let files_before = memory::trees_open_files(&target.pids);
            tokio::time::sleep(Duration::from_secs(1)).await;
            let before = steady_rss(&target).await;
            let started = Instant::now();
            let held = load::open_streams(
                &endpoint,
                count,
                opening,
                Duration::from_secs_f64(open_timeout),
            )
            .await;
            let open_seconds = started.elapsed().as_secs_f64();
            tokio::time::sleep(Duration::from_secs_f64(settle)).await;
            let during = steady_rss(&target).await;
            let (open, failed, ended) = held.counts();
            let files_open = memory::trees_open_files(&target.pids);
            drop(held);
            tokio::time::sleep(Duration::from_secs(2)).await;
            let after = steady_rss(&target).await;
            let files_after = memory::trees_open_files(&target.pids);
            let per_stream = if open > 0 {
                (during - before) / open as f64
            } else {
                f64::NAN
            };
            println!(
                "  {:<28} {count:>6} streams: {open} open, {failed} failed, {ended} ended (opened in {open_seconds:.1} s, after {drained_seconds:.0} s for the last point's to drain); RSS {} -> {} ({:.0} B per open stream), {} 2 s after closing; open files {files_before} -> {files_open} -> {files_after}",
                target.name,
                mib(before),
                mib(during),
                per_stream,
                mib(after),
            );
            results.push(json!({
                "target": target.name, "streams": count, "open": open, "failed": failed,
                "ended": ended, "open_seconds": open_seconds, "drained_seconds": drained_seconds,
                "open_files_before": files_before, "open_files_open": files_open,
                "open_files_after_close": files_after,
                "rss_before": before, "rss_open": during, "rss_after_close": after,
                "bytes_per_stream": if per_stream.is_finite() { json!(per_stream) } else { Value::Null },
            }));
        }
    }
    Ok(json!({ "streams": results }))
}

async fn canaries(
    args: &Args,
    specs: &[String],
    requests: u64,
    warmup: u64,
    concurrency: usize,
    per_request: u64,
) -> Result<Value, String> {
    let mut results = Vec::new();
    for spec in specs {
        let (target, endpoint) = endpoint(args, spec, false)?;
        load::wait_ready(&endpoint, Duration::from_secs(60))
            .await
            .map_err(|e| format!("{}: {e}", target.name))?;
        let (_, warm_errors) = load::send_count(&endpoint, concurrency, warmup).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let before = steady_rss(&target).await;
        let (ok, errors) = load::send_count(&endpoint, concurrency, requests).await;
        // Background commits of the last records, then a quiet moment.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = steady_rss(&target).await;
        let canaries = ok * per_request;
        let per_canary = (after - before) / canaries.max(1) as f64;
        println!(
            "  {:<28} {ok} requests ({errors} failed; after {warmup} unmeasured, {warm_errors} failed), {canaries} canaries: RSS {} -> {}, {:.0} B per request, {:.0} B per canary",
            target.name,
            mib(before),
            mib(after),
            (after - before) / ok.max(1) as f64,
            per_canary,
        );
        results.push(json!({
            "target": target.name, "requests": ok, "errors": errors + warm_errors,
            "warmup_requests": warmup, "canaries": canaries,
            "rss_before": before, "rss_after": after,
            "bytes_per_request": (after - before) / ok.max(1) as f64,
            "bytes_per_canary": per_canary,
        }));
    }
    Ok(json!({ "canaries": results }))
}

/// canarygate's gauges read with each soak sample: what it holds.
const SOAK_GAUGES: [&str; 3] = [
    "canarygate_audit_cache_bytes",
    "canarygate_canaries_in_memory",
    "canarygate_client_connections",
];

/// The samples of a soak that count for its slope: those from `warmup`
/// seconds on (all of them when fewer than two are left).
fn steady_samples(samples: &[(f64, f64)], warmup: f64) -> &[(f64, f64)] {
    let first = samples.partition_point(|s| s.0 < warmup);
    if samples.len() - first >= 2 {
        &samples[first..]
    } else {
        samples
    }
}

/// A soak series, `(seconds, bytes)`: its first and last sample after the
/// warm-up, its largest sample, and its slope after the warm-up.
struct Trend {
    start: (f64, f64),
    end: (f64, f64),
    max: f64,
    /// Bytes per minute.
    slope: Option<f64>,
    /// Samples the slope is fitted to.
    steady: usize,
}

impl Trend {
    /// `samples` is not empty.
    fn of(samples: &[(f64, f64)], warmup: f64) -> Self {
        let steady = steady_samples(samples, warmup);
        Self {
            start: steady[0],
            end: steady[steady.len() - 1],
            max: samples.iter().map(|s| s.1).fold(0.0, f64::max),
            slope: memory::slope_per_minute(steady),
            steady: steady.len(),
        }
    }

    fn slope_text(&self) -> String {
        self.slope.map_or("-".to_owned(), |s| format!("{s:.0} B"))
    }
}

#[allow(clippy::too_many_arguments)]
async fn soak(
    args: &Args,
    spec: &str,
    minutes: f64,
    sample_seconds: f64,
    mut rate: f64,
    rate_fraction: f64,
    concurrency: usize,
    warmup: Option<f64>,
    stream: bool,
) -> Result<Value, String> {
    let (target, endpoint) = endpoint(args, spec, stream)?;
    load::wait_ready(&endpoint, Duration::from_secs(60))
        .await
        .map_err(|e| format!("{}: {e}", target.name))?;
    let endpoints = [endpoint];
    let mut saturation = Value::Null;
    if rate <= 0.0 {
        let measured = load::saturate(&endpoints, concurrency, Duration::from_secs(3)).await;
        rate = (measured.rps * rate_fraction).floor().max(1.0);
        saturation = json!(measured.rps);
        println!(
            "  {}: saturation {:.0} req/s ({concurrency} connections), soak at {rate:.0} req/s",
            target.name, measured.rps
        );
    }
    let seconds = minutes * 60.0;
    let warmup = warmup.unwrap_or((seconds / 5.0).min(60.0));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (stop, pids) = (stop.clone(), target.pids.clone());
        let metrics = target
            .metrics
            .then(|| (endpoints[0].addr, endpoints[0].host.clone()));
        let interval = Duration::from_secs_f64(sample_seconds);
        std::thread::spawn(move || {
            // Its own runtime for the scrapes: the load's runs on the main
            // thread, which joins this one when the load ends.
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("sampler runtime");
            let start = Instant::now();
            let (mut samples, mut gauges) = (Vec::new(), Vec::new());
            let mut k = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let due = start + interval * k;
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait.min(Duration::from_millis(100)));
                    continue;
                }
                let at = start.elapsed().as_secs_f64();
                samples.push((at, memory::trees_rss(&pids) as f64));
                if let Some((addr, host)) = &metrics {
                    let text = runtime.block_on(load::get(*addr, host, "/metrics"));
                    let text = text
                        .as_deref()
                        .and_then(|text| std::str::from_utf8(text).ok());
                    let values =
                        SOAK_GAUGES.map(|name| text.and_then(|t| overhead::gauge(t, name)));
                    gauges.push((at, values));
                }
                k += 1;
            }
            (samples, gauges)
        })
    };
    let latency = load::fixed_rate(&endpoints, rate, Duration::from_secs_f64(seconds)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (samples, gauges) = sampler.join().expect("sampler");
    if samples.is_empty() {
        return Err("no RSS sample taken".to_owned());
    }
    // Each gauge's readings, `(seconds, value)`.
    let series: Vec<Vec<(f64, f64)>> = (0..SOAK_GAUGES.len())
        .map(|g| {
            gauges
                .iter()
                .filter_map(|(at, values)| Some((*at, values[g]?)))
                .collect()
        })
        .collect();
    let cache = &series[0];
    // The RSS less the audit cache, where the cache was read with the RSS.
    let less_cache = (cache.len() == samples.len()).then(|| {
        samples
            .iter()
            .zip(cache)
            .map(|(rss, cache)| (rss.0, rss.1 - cache.1))
            .collect::<Vec<_>>()
    });
    let rss = Trend::of(&samples, warmup);
    println!(
        "  {}: {:.1} min at {rate:.0} req/s ({} ok, {} failed: {}, p50 {:.0} µs, p99 {:.0} µs); RSS {} at {:.0} s -> {} at {:.0} s (max {}), slope {} per minute over {} samples",
        target.name,
        minutes,
        latency.requests,
        latency.failures.total(),
        latency.failures.describe(),
        latency.p50_us,
        latency.p99_us,
        mib(rss.start.1),
        rss.start.0,
        mib(rss.end.1),
        rss.end.0,
        mib(rss.max),
        rss.slope_text(),
        rss.steady,
    );
    let less_cache_json = match &less_cache {
        Some(less_cache) => {
            let less = Trend::of(less_cache, warmup);
            let cache_max = Trend::of(cache, warmup).max;
            println!(
                "  {}: less the audit cache (at most {}): {} -> {}, slope {} per minute",
                target.name,
                mib(cache_max),
                mib(less.start.1),
                mib(less.end.1),
                less.slope_text(),
            );
            json!({
                "start": less.start.1, "end": less.end.1, "max": less.max,
                "slope_bytes_per_minute": less.slope,
                "cache_max": cache_max,
            })
        }
        None => Value::Null,
    };
    let mut gauges_json = serde_json::Map::new();
    for (name, readings) in SOAK_GAUGES.iter().zip(&series) {
        if readings.is_empty() {
            continue;
        }
        let steady = steady_samples(readings, warmup);
        let (low, high) = steady.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), s| {
            (lo.min(s.1), hi.max(s.1))
        });
        println!(
            "  {}: {name} after the warm-up: {low:.0} to {high:.0}",
            target.name
        );
        let samples: Vec<_> = readings.iter().map(|s| json!([s.0, s.1])).collect();
        gauges_json.insert((*name).to_owned(), json!(samples));
    }
    Ok(json!({ "soak": {
        "target": target.name, "minutes": minutes, "rate": rate, "stream": stream,
        "saturation_rps": saturation, "requests": latency.requests, "errors": latency.failures.total(),
        "failures": latency.failures.to_json(),
        "p50_us": latency.p50_us, "p99_us": latency.p99_us,
        "warmup_seconds": warmup, "sample_seconds": sample_seconds,
        "rss_start": rss.start.1, "rss_end": rss.end.1, "rss_max": rss.max,
        "slope_bytes_per_minute": rss.slope,
        "samples": samples.iter().map(|s| json!([s.0, s.1])).collect::<Vec<_>>(),
        "less_audit_cache": less_cache_json,
        "gauges": gauges_json,
    }}))
}

fn main() {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let result = runtime.block_on(async {
        match &args.command {
            Command::Streams {
                targets,
                counts,
                opening,
                open_timeout,
                settle,
                drain_timeout,
            } => {
                streams(
                    &args,
                    targets,
                    counts,
                    *opening,
                    *open_timeout,
                    *settle,
                    *drain_timeout,
                )
                .await
            }
            Command::Canaries {
                targets,
                requests,
                warmup,
                concurrency,
                canaries_per_request,
            } => {
                canaries(
                    &args,
                    targets,
                    *requests,
                    *warmup,
                    *concurrency,
                    *canaries_per_request,
                )
                .await
            }
            Command::Soak {
                target,
                minutes,
                sample_seconds,
                rate,
                rate_fraction,
                concurrency,
                warmup,
                stream,
            } => {
                soak(
                    &args,
                    target,
                    *minutes,
                    *sample_seconds,
                    *rate,
                    *rate_fraction,
                    *concurrency,
                    *warmup,
                    *stream,
                )
                .await
            }
        }
    });
    match result {
        Ok(mut value) => {
            value["note"] = json!(args.note);
            value["max_tokens"] = json!(args.max_tokens);
            value["prompt_words"] = json!(args.prompt_words);
            if let Some(path) = &args.json {
                let text = serde_json::to_string_pretty(&value).expect("json");
                if let Err(e) = std::fs::write(path, text + "\n") {
                    eprintln!("canarygate-bench-memory: {}: {e}", path.display());
                    std::process::exit(1);
                }
            }
        }
        Err(error) => {
            eprintln!("canarygate-bench-memory: {error}");
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slope_leaves_out_the_warm_up() {
        let samples = [(0.0, 1.0), (5.0, 2.0), (10.0, 3.0), (15.0, 3.0)];
        assert_eq!(steady_samples(&samples, 7.0), &samples[2..]);
        assert_eq!(steady_samples(&samples, 0.0), &samples[..]);
        // Too few left: all of them.
        assert_eq!(steady_samples(&samples, 12.0), &samples[..]);
        assert_eq!(steady_samples(&samples[..1], 0.0), &samples[..1]);
    }
}
