//! canarygate-bench: the load generator of `bench/run.sh`.
//!
//! It drives already running OpenAI-compatible endpoints (`--target
//! NAME=URL`) with the same chat request over HTTP/1.1 keep-alive connections
//! and reports, per target and mode (non-streaming, streaming):
//! - saturation throughput: `concurrency` connections sending back to back
//!   for `seconds` (after a short warm-up), with the CPU time (user + system)
//!   the target's process tree (`pid=`) and the upstream (`--upstream-pid`)
//!   spent per request, from `/proc`;
//! - latency at a fixed open-loop rate below every target's saturation
//!   (requests leave on schedule whatever earlier ones are doing; latency
//!   counts from the scheduled time), p50/p99, and the latency *added* over
//!   the baseline target (the upstream itself) in the same round; for
//!   targets marked `metrics` (canarygate), also their own time per request
//!   over the phase, from the overhead histogram at `/metrics`.
//!
//! A target may be a pool of instances (`NAME=URL1|URL2`, e.g. two
//! canarygate instances sharing a Redis registry): its load is spread
//! round-robin over them, its CPU is that of every listed process tree
//! (`pid=P1+P2+P3`), and its own time per request comes from the sum of the
//! instances' histograms.
//!
//! Each round measures every target once per mode, in an order that changes
//! from round to round (rotated, and reversed every other round). Reported
//! numbers are medians over the rounds; ratios and added latency are computed
//! within each round and their median taken. Every answer is checked: 2xx and
//! complete (a JSON object, or a stream ending in `data: [DONE]`); before
//! measuring, one answer per target and mode is parsed in full.
//!
//! `bench/run.sh` starts the servers (sim provider, nginx, canarygate, LiteLLM)
//! and calls this, as `bench/registry.sh` does for canarygate on a shared
//! Redis registry; see `--help` for the knobs, each also an environment
//! variable.

use std::collections::BTreeMap;
use std::time::Duration;

use clap::Parser;
use serde_json::{Value, json};

use canarygate_bench::disk;
use canarygate_bench::load::{self, Answer, Endpoint, Latency, Throughput};
use canarygate_bench::memory::median;
use canarygate_bench::overhead::{self, Overhead};
use canarygate_bench::procstat;
use canarygate_bench::target::Target;

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Load generator for OpenAI-compatible chat endpoints (bench/run.sh)",
    long_about = None
)]
struct Args {
    /// A target: `NAME=URL[|URL...][,pid=PID[+PID...]][,concurrency=N][,slow][,metrics]`.
    /// URL is the API base (e.g. `http://127.0.0.1:8080/v1`); requests go to
    /// `URL/chat/completions`. Several URLs make a pool measured as one
    /// target: connections and fixed-rate requests are spread round-robin
    /// over them, a connection staying with its instance. PID: a process
    /// whose tree's CPU time is counted as the target's; with several, the
    /// trees' times are summed (a pool's instances and a server they share).
    /// `slow`: left out of the high-rate latency phase. `metrics`: the target
    /// is canarygate; its own time per request is read from `/metrics` (of
    /// every instance, summed) around each latency phase. Repeat for each
    /// target.
    #[arg(long = "target", required = true)]
    targets: Vec<String>,

    /// The target others are compared to for added latency (default: the first).
    #[arg(long)]
    baseline: Option<String>,

    /// Targets every other target is also compared to (throughput and CPU
    /// ratios), e.g. `--reference nginx --reference litellm`.
    #[arg(long = "reference")]
    references: Vec<String>,

    /// PID of the upstream (simulated provider), whose CPU per request is reported.
    #[arg(long)]
    upstream_pid: Option<u32>,

    /// Length of each measured saturation phase, seconds.
    #[arg(long, env = "CANARYGATE_BENCH_SECONDS", default_value_t = 3.0)]
    seconds: f64,

    /// Length of each fixed-rate latency phase, seconds (default: `seconds`,
    /// and long enough for 200 requests, at most 10 s).
    #[arg(long, env = "CANARYGATE_BENCH_LATENCY_SECONDS")]
    latency_seconds: Option<f64>,

    /// Rounds; medians are taken over them.
    #[arg(long, env = "CANARYGATE_BENCH_ROUNDS", default_value_t = 3)]
    rounds: usize,

    /// Connections at saturation (a target's `concurrency=` overrides it).
    #[arg(long, env = "CANARYGATE_BENCH_CONCURRENCY", default_value_t = 32)]
    concurrency: usize,

    /// Requests/s of the non-streaming latency phase; 0: automatic,
    /// `rate_fraction` of the slowest target's saturation throughput in round
    /// 1, rounded down to one significant digit.
    #[arg(long, env = "CANARYGATE_BENCH_RATE", default_value_t = 0.0)]
    rate: f64,

    /// Requests/s of the streaming latency phase; 0: automatic (as `rate`).
    #[arg(long, env = "CANARYGATE_BENCH_STREAM_RATE", default_value_t = 0.0)]
    stream_rate: f64,

    /// Requests/s of a second latency phase for the targets not marked
    /// `slow` (when some are): 0: automatic (as `rate`, over those targets
    /// only, with `fast_rate_fraction`); negative: no second phase.
    #[arg(
        long,
        env = "CANARYGATE_BENCH_FAST_RATE",
        default_value_t = 0.0,
        allow_hyphen_values = true
    )]
    fast_rate: f64,

    /// Fraction of the slowest saturation throughput an automatic rate may reach.
    #[arg(long, env = "CANARYGATE_BENCH_RATE_FRACTION", default_value_t = 0.5)]
    rate_fraction: f64,

    /// Fraction of the slowest saturation throughput (targets not marked
    /// `slow`) an automatic fast rate may reach. Lower than `rate_fraction`:
    /// the load generator, the upstream and the target share the machine.
    #[arg(
        long,
        env = "CANARYGATE_BENCH_FAST_RATE_FRACTION",
        default_value_t = 0.25
    )]
    fast_rate_fraction: f64,

    /// Modes to run: `non-stream`, `stream`, or both (comma-separated).
    #[arg(
        long,
        env = "CANARYGATE_BENCH_MODES",
        default_value = "non-stream,stream",
        value_delimiter = ','
    )]
    modes: Vec<String>,

    /// `max_tokens` of every request: the length of every answer in tokens.
    #[arg(long, env = "CANARYGATE_BENCH_MAX_TOKENS", default_value_t = 64)]
    max_tokens: u64,

    /// Words in the user message (each `word_tokens` tokens).
    #[arg(long, env = "CANARYGATE_BENCH_PROMPT_WORDS", default_value_t = 96)]
    prompt_words: usize,

    /// Tokens per word of the user message (odd, at least 3). The simulated
    /// provider restates 12 to 39 of the message's words, so answers reach
    /// `max_tokens` when 12 words hold that many tokens.
    #[arg(long, env = "CANARYGATE_BENCH_WORD_TOKENS", default_value_t = 7)]
    word_tokens: usize,

    /// Length of the user message in bytes instead of `prompt_words`: as many
    /// words as fill it (0: use `prompt_words`).
    #[arg(long, env = "CANARYGATE_BENCH_PROMPT_BYTES", default_value_t = 0)]
    prompt_bytes: usize,

    /// Skip the fixed-rate latency phases: saturation throughput and CPU
    /// per request only (the growth curves).
    #[arg(long, env = "CANARYGATE_BENCH_NO_LATENCY")]
    no_latency: bool,

    /// Streams do not ask for the usage chunk (`stream_options`), as the
    /// openai SDKs' default: canarygate asks for it and keeps it, and the
    /// `usage: null` of every chunk, from the client.
    #[arg(long, env = "CANARYGATE_BENCH_NO_STREAM_USAGE")]
    no_stream_usage: bool,

    /// `model` of every request.
    #[arg(long, env = "CANARYGATE_BENCH_MODEL", default_value = load::DEFAULT_MODEL)]
    model: String,

    /// Bearer token sent to every target.
    #[arg(long, env = "CANARYGATE_BENCH_API_KEY", default_value = "sk-bench")]
    api_key: String,

    /// Load generator threads (1: it takes at most one core).
    #[arg(long, env = "CANARYGATE_BENCH_CLIENT_THREADS", default_value_t = 1)]
    client_threads: usize,

    /// How long to wait for every target to answer correctly before starting.
    #[arg(long, default_value_t = 120.0)]
    ready_timeout: f64,

    /// Write every measurement, the medians and ratios to this JSON file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,

    /// Free text about the setup, copied into the JSON and the report.
    #[arg(long, default_value = "")]
    note: String,

    /// A directory on the disk the targets' data lives on: each round
    /// starts by timing `sync_samples` 4 KiB appends + `fdatasync` there,
    /// and the report sets the targets' own p99 against that sync p99 (the
    /// floor of a durable answer).
    #[arg(long)]
    sync_probe_dir: Option<std::path::PathBuf>,

    /// Probes per round in `sync_probe_dir`.
    #[arg(long, env = "CANARYGATE_BENCH_SYNC_SAMPLES", default_value_t = 300)]
    sync_samples: usize,

    /// With `sync_probe_dir`: syncs per second timed there, at random
    /// moments, during each latency phase of a `metrics` target (the disk's
    /// sync under that load); 0: none.
    #[arg(
        long,
        env = "CANARYGATE_BENCH_LOADED_SYNC_RATE",
        default_value_t = 200.0
    )]
    loaded_sync_rate: f64,
}

/// The request every instance of `t` gets in this mode.
fn endpoints(args: &Args, t: &Target, stream: bool) -> Vec<Endpoint> {
    let prompt = load::prompt_text(args.prompt_words, args.word_tokens, args.prompt_bytes);
    let usage = stream && !args.no_stream_usage;
    let body = load::chat_body(&args.model, stream, usage, args.max_tokens, &prompt);
    t.endpoints(&body, &format!("Bearer {}", args.api_key), stream)
}

/// One target measured once in one mode.
#[derive(Debug, Clone, Copy, Default)]
struct Measurement {
    throughput: Throughput,
    latency: Latency,
    /// Latency at the fast rate (targets not marked `slow`; default otherwise).
    fast_latency: Latency,
    /// The target's own time per request in the latency phase (`metrics`).
    overhead: Option<Overhead>,
    /// The same in the fast latency phase.
    fast_overhead: Option<Overhead>,
    /// CPU of the target's process tree per request at saturation, µs (NaN without pid).
    target_cpu_us: f64,
    /// CPU of the upstream per request at saturation, µs (NaN without pid).
    upstream_cpu_us: f64,
    /// CPU of the load generator per request at saturation, µs.
    client_cpu_us: f64,
}

impl Measurement {
    /// The target's own time in the latency phase at the usual rate, or at
    /// the fast rate when `fast`.
    fn overhead_at(&self, fast: bool) -> Option<Overhead> {
        if fast {
            self.fast_overhead
        } else {
            self.overhead
        }
    }

    fn to_json(self) -> Value {
        let t = self.throughput;
        let latency = |l: Latency, o: Option<Overhead>| {
            json!({
                "requests": l.requests, "errors": l.failures.total(),
                "failures": l.failures.to_json(), "achieved_rps": l.achieved,
                "p50_us": finite(l.p50_us), "p90_us": finite(l.p90_us),
                "p99_us": finite(l.p99_us), "max_us": finite(l.max_us),
                "overhead": o.map(|o| json!({
                    "requests": o.requests,
                    "p50_at_most_us": finite(o.p50_us),
                    "p99_at_most_us": finite(o.p99_us),
                    "journal_syncs": o.journal_syncs,
                    "journal_sync_p99_at_most_us": finite(o.journal_sync_p99_us),
                    "record_wait_p99_at_most_us": finite(o.record_wait_p99_us),
                    "loaded_syncs": o.loaded_sync.map_or(0, |s| s.samples),
                    "loaded_sync_p50_us": o.loaded_sync.map(|s| s.p50_us),
                    "loaded_sync_p99_us": o.loaded_sync.map(|s| s.p99_us),
                })),
            })
        };
        json!({
            "rps": t.rps, "requests": t.requests, "errors": t.errors,
            "resp_bytes": t.bytes, "resp_events": t.events,
            "target_cpu_us_per_req": finite(self.target_cpu_us),
            "upstream_cpu_us_per_req": finite(self.upstream_cpu_us),
            "client_cpu_us_per_req": self.client_cpu_us,
            "latency": latency(self.latency, self.overhead),
            "fast_latency": if self.fast_latency.requests + self.fast_latency.failures.total() > 0 {
                latency(self.fast_latency, self.fast_overhead)
            } else {
                Value::Null
            },
        })
    }
}

fn finite(value: f64) -> Value {
    if value.is_finite() {
        json!(value)
    } else {
        Value::Null
    }
}

/// `x` rounded down to one significant digit (…, 8, 10, 20, …, 90, 100,
/// 200, …), at least 1: a rate that reads as chosen, not measured.
fn round_rate(x: f64) -> f64 {
    if !(x.is_finite() && x >= 1.0) {
        return 1.0;
    }
    let decade = 10f64.powf(x.log10().floor());
    // The small tolerance keeps 300 from becoming 200 through rounding error.
    (x / decade + 1e-9).floor() * decade
}

/// The order of the targets in `round`: rotated by the round, reversed every
/// other round, so that no target is always measured first or right after
/// the same neighbour. Two targets are only rotated: reversing the rotated
/// pair would undo the rotation, and the first would always go first.
fn order(count: usize, round: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..count).map(|i| (i + round) % count).collect();
    if round % 2 == 1 && count > 2 {
        order.reverse();
    }
    order
}

/// All rounds of one mode: `rounds[round][target]`.
struct ModeRuns {
    label: &'static str,
    stream: bool,
    rate: f64,
    latency_seconds: f64,
    /// Rate of the second latency phase (0: none).
    fast_rate: f64,
    rounds: Vec<Vec<Measurement>>,
    answers: Vec<Answer>,
}

impl ModeRuns {
    fn per_round(&self, f: impl Fn(&[Measurement]) -> f64) -> f64 {
        median(self.rounds.iter().map(|round| f(round)).collect())
    }

    fn med(&self, target: usize, f: impl Fn(&Measurement) -> f64) -> f64 {
        self.per_round(|round| f(&round[target]))
    }
}

/// Everything measured: each mode's rounds, and the disk's sync per round
/// (empty without `--sync-probe-dir`).
struct Runs {
    modes: Vec<ModeRuns>,
    syncs: Vec<disk::SyncSummary>,
}

fn fmt(value: f64, decimals: usize) -> String {
    if value.is_finite() {
        format!("{value:.decimals$}")
    } else {
        "-".to_owned()
    }
}

fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name"))
        .and_then(|rest| rest.split_once(':'))
        .map(|(_, name)| name.trim().to_owned());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: Option<u64> = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok());
    json!({
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "cpu_model": model,
        "mem_gib": mem_kib.map(|kib| (kib as f64 / 1048576.0 * 10.0).round() / 10.0),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_owned()),
    })
}

struct Bench {
    args: Args,
    targets: Vec<Target>,
    baseline: usize,
    references: Vec<usize>,
}

impl Bench {
    fn concurrency(&self, target: usize) -> usize {
        self.targets[target]
            .concurrency
            .unwrap_or(self.args.concurrency)
    }

    async fn saturation(&self, target: usize, stream: bool) -> Measurement {
        let t = &self.targets[target];
        let endpoints = endpoints(&self.args, t, stream);
        let concurrency = self.concurrency(target);
        let warmup = Duration::from_secs_f64((self.args.seconds / 4.0).clamp(0.2, 1.0));
        load::saturate(&endpoints, concurrency, warmup).await;
        let cpu = |pid: Option<u32>| pid.map(procstat::tree_cpu);
        let before = (t.cpu(), cpu(self.args.upstream_pid), procstat::self_cpu());
        let throughput = load::saturate(
            &endpoints,
            concurrency,
            Duration::from_secs_f64(self.args.seconds),
        )
        .await;
        let after = (t.cpu(), cpu(self.args.upstream_pid), procstat::self_cpu());
        let per_request = |b: Option<Duration>, a: Option<Duration>| match (b, a) {
            (Some(b), Some(a)) => {
                a.saturating_sub(b).as_secs_f64() * 1e6 / throughput.requests.max(1) as f64
            }
            _ => f64::NAN,
        };
        Measurement {
            throughput,
            target_cpu_us: per_request(before.0, after.0),
            upstream_cpu_us: per_request(before.1, after.1),
            client_cpu_us: per_request(Some(before.2), Some(after.2)),
            latency: Latency::default(),
            fast_latency: Latency::default(),
            overhead: None,
            fast_overhead: None,
        }
    }

    /// The target's histograms now (its own time, and its journal's syncs),
    /// summed over its instances;
    /// None unless it is `metrics` and every instance answers with one.
    async fn scrape(&self, target: usize) -> Option<overhead::Scrape> {
        let t = &self.targets[target];
        if !t.metrics {
            return None;
        }
        let mut scrapes = Vec::with_capacity(t.instances.len());
        for instance in &t.instances {
            scrapes.push(overhead::scrape(instance.addr, &instance.host).await?);
        }
        overhead::Scrape::sum(&scrapes)
    }

    /// Runs one fixed-rate phase, with the target's own time per request
    /// over it when the target reports it.
    async fn latency_phase(
        &self,
        target: usize,
        endpoints: &[Endpoint],
        rate: f64,
        seconds: f64,
    ) -> Result<(Latency, Option<Overhead>), String> {
        let before = self.scrape(target).await;
        let probe = match (&self.args.sync_probe_dir, &before) {
            (Some(dir), Some(_)) if self.args.loaded_sync_rate > 0.0 => Some(
                disk::LoadedSyncProbe::start(dir, self.args.loaded_sync_rate)
                    .map_err(|e| format!("sync probe in {}: {e}", dir.display()))?,
            ),
            _ => None,
        };
        let latency = load::fixed_rate(endpoints, rate, Duration::from_secs_f64(seconds)).await;
        let loaded_sync = match probe {
            Some(probe) => disk::SyncSummary::of(
                probe
                    .finish()
                    .map_err(|e| format!("sync probe under load: {e}"))?,
            ),
            None => None,
        };
        let mut overhead = match before {
            Some(before) => self
                .scrape(target)
                .await
                .and_then(|after| Overhead::of_phase(&before, &after)),
            None => None,
        };
        if let Some(overhead) = &mut overhead {
            overhead.loaded_sync = loaded_sync;
        }
        Ok((latency, overhead))
    }

    fn print_round_line(&self, mode: &ModeRuns, target: usize, m: &Measurement) {
        let t = m.throughput;
        let l = m.latency;
        let f = m.fast_latency;
        let own = |o: Option<Overhead>| {
            o.map_or(String::new(), |o| {
                let mut audit = if o.journal_syncs > 0 {
                    format!(
                        ", {} journal syncs p99 ≤ {:.0} µs",
                        o.journal_syncs, o.journal_sync_p99_us
                    )
                } else {
                    String::new()
                };
                if o.record_wait_p99_us.is_finite() {
                    audit += &format!(", record wait p99 ≤ {:.0} µs", o.record_wait_p99_us);
                }
                if let Some(s) = o.loaded_sync {
                    audit += &format!(
                        ", disk sync under load p50 {:.0} µs p99 {:.0} µs ({} probes)",
                        s.p50_us, s.p99_us, s.samples
                    );
                }
                format!(
                    ", own p50 ≤ {:.0} µs p99 ≤ {:.0} µs{audit}",
                    o.p50_us, o.p99_us
                )
            })
        };
        let fast = if f.requests + f.failures.total() > 0 {
            format!(
                " | at {:.0}/s: p50 {:.0} µs p99 {:.0} µs ({} ok, {} err{})",
                mode.fast_rate,
                f.p50_us,
                f.p99_us,
                f.requests,
                f.failures.total(),
                own(m.fast_overhead)
            )
        } else {
            String::new()
        };
        println!(
            "  {:<10} {:<24} {:>6.0} req/s ({} ok, {} err, c={}) | cpu/req target {:>5} µs upstream {:>4} µs client {:>4} µs | {:.0} B, {:.1} events | at {:.0}/s: p50 {:.0} µs p99 {:.0} µs ({} ok, {} err{}){fast}",
            mode.label,
            self.targets[target].name,
            t.rps,
            t.requests,
            t.errors,
            self.concurrency(target),
            fmt(m.target_cpu_us, 0),
            fmt(m.upstream_cpu_us, 0),
            fmt(m.client_cpu_us, 0),
            t.bytes,
            t.events,
            mode.rate,
            l.p50_us,
            l.p99_us,
            l.requests,
            l.failures.total(),
            own(m.overhead),
        );
    }

    async fn check_all(&self, modes: &[(&'static str, bool)]) -> Result<Vec<Vec<Answer>>, String> {
        let timeout = Duration::from_secs_f64(self.args.ready_timeout);
        let mut all = Vec::new();
        for &(label, stream) in modes {
            let mut answers = Vec::new();
            for t in &self.targets {
                // Every instance of a pool is checked; the first one's answer
                // stands for the pool in the results.
                let mut first = None;
                for (k, (instance, endpoint)) in t
                    .instances
                    .iter()
                    .zip(endpoints(&self.args, t, stream))
                    .enumerate()
                {
                    let answer = load::wait_ready(&endpoint, timeout)
                        .await
                        .map_err(|e| format!("{} ({label}) at {}: {e}", t.name, instance.url))?;
                    let name = if t.instances.len() > 1 {
                        format!("{}[{}]", t.name, k + 1)
                    } else {
                        t.name.clone()
                    };
                    println!(
                        "  check {label:<10} {:<22} {} B, {} events, {} text events, {} chars, completion_tokens {}, finish {}",
                        name,
                        answer.bytes,
                        answer.events,
                        answer.content_events,
                        answer.content_chars,
                        answer
                            .completion_tokens
                            .map_or("-".to_owned(), |n| n.to_string()),
                        answer.finish_reason.as_deref().unwrap_or("-"),
                    );
                    first.get_or_insert(answer);
                }
                answers.push(first.expect("a target has an instance"));
            }
            all.push(answers);
        }
        for t in self.targets.iter().filter(|t| t.metrics) {
            for instance in &t.instances {
                if overhead::scrape(instance.addr, &instance.host)
                    .await
                    .is_none()
                {
                    return Err(format!(
                        "{}: no canarygate_proxy_overhead_seconds histogram at {}/metrics",
                        t.name, instance.host
                    ));
                }
            }
        }
        Ok(all)
    }

    async fn run(&self) -> Result<Runs, String> {
        let args = &self.args;
        let mut modes = Vec::new();
        for mode in &args.modes {
            match mode.trim() {
                "non-stream" => modes.push(("non-stream", false)),
                "stream" => modes.push(("stream", true)),
                other => return Err(format!("unknown mode {other}")),
            }
        }
        println!(
            "checking every target answers (up to {:.0} s):",
            args.ready_timeout
        );
        let answers = self.check_all(&modes).await?;
        for t in &self.targets {
            println!(
                "  {:<24} {} (pid {}, {} process(es) now)",
                t.name,
                t.url,
                t.pids_text(),
                procstat::trees_size(&t.pids),
            );
        }
        // One unmeasured pass first: lazy initialisation (LiteLLM imports
        // modules on first use), connection pools, page cache.
        let warmup = Duration::from_secs_f64((args.seconds * 0.67).clamp(1.0, 2.0));
        println!(
            "warming up ({:.1} s per target and mode)",
            warmup.as_secs_f64()
        );
        for &(_, stream) in &modes {
            for (i, t) in self.targets.iter().enumerate() {
                load::saturate(&endpoints(args, t, stream), self.concurrency(i), warmup).await;
            }
        }
        let has_slow = self.targets.iter().any(|t| t.slow);
        let mut runs: Vec<ModeRuns> = modes
            .iter()
            .zip(answers)
            .map(|(&(label, stream), answers)| ModeRuns {
                label,
                stream,
                rate: if stream { args.stream_rate } else { args.rate },
                latency_seconds: 0.0,
                fast_rate: if has_slow { args.fast_rate } else { -1.0 },
                rounds: Vec::new(),
                answers,
            })
            .collect();
        let mut syncs = Vec::new();
        for round in 0..args.rounds {
            let order = order(self.targets.len(), round);
            let names: Vec<&str> = order
                .iter()
                .map(|&i| self.targets[i].name.as_str())
                .collect();
            println!("round {} (order: {})", round + 1, names.join(", "));
            if let Some(dir) = &args.sync_probe_dir {
                let latencies = disk::sync_latencies_us(dir, args.sync_samples)
                    .map_err(|e| format!("sync probe in {}: {e}", dir.display()))?;
                // `--sync-samples 0` times nothing: its percentiles are NaN.
                let probe = disk::SyncSummary::of(latencies).unwrap_or(disk::SyncSummary {
                    samples: 0,
                    p50_us: f64::NAN,
                    p99_us: f64::NAN,
                });
                println!(
                    "  disk: {} × {} B append + fdatasync, p50 {:.0} µs p99 {:.0} µs",
                    args.sync_samples,
                    disk::PROBE_BYTES,
                    probe.p50_us,
                    probe.p99_us
                );
                syncs.push(probe);
            }
            for mode in &mut runs {
                let mut measured = vec![Measurement::default(); self.targets.len()];
                for &target in &order {
                    measured[target] = self.saturation(target, mode.stream).await;
                }
                // The growth curves measure saturation only.
                if !args.no_latency {
                    let slowest = |fast_only: bool| {
                        measured
                            .iter()
                            .zip(&self.targets)
                            .filter(|(_, t)| !(fast_only && t.slow))
                            .map(|(m, _)| m.throughput.rps)
                            .filter(|rps| *rps > 0.0)
                            .fold(f64::INFINITY, f64::min)
                    };
                    if mode.rate <= 0.0 {
                        mode.rate = round_rate(slowest(false) * args.rate_fraction);
                        println!(
                            "  {} latency rate: {:.0} req/s ({} of the slowest saturation, {:.0} req/s)",
                            mode.label,
                            mode.rate,
                            args.rate_fraction,
                            slowest(false)
                        );
                    }
                    if mode.fast_rate == 0.0 {
                        mode.fast_rate = round_rate(slowest(true) * args.fast_rate_fraction);
                        println!(
                            "  {} high latency rate: {:.0} req/s ({} of the slowest saturation without the slow targets, {:.0} req/s)",
                            mode.label,
                            mode.fast_rate,
                            args.fast_rate_fraction,
                            slowest(true)
                        );
                    }
                    if mode.latency_seconds == 0.0 {
                        mode.latency_seconds = args
                            .latency_seconds
                            .unwrap_or_else(|| args.seconds.max((200.0 / mode.rate).min(10.0)));
                    }
                    let fast_seconds = args.latency_seconds.unwrap_or(args.seconds);
                    for &target in &order {
                        // Let the servers settle after saturation.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        let endpoints = endpoints(args, &self.targets[target], mode.stream);
                        (measured[target].latency, measured[target].overhead) = self
                            .latency_phase(target, &endpoints, mode.rate, mode.latency_seconds)
                            .await?;
                        if mode.fast_rate > 0.0 && !self.targets[target].slow {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            (
                                measured[target].fast_latency,
                                measured[target].fast_overhead,
                            ) = self
                                .latency_phase(target, &endpoints, mode.fast_rate, fast_seconds)
                                .await?;
                        }
                    }
                }
                for &target in &order {
                    self.print_round_line(mode, target, &measured[target]);
                }
                mode.rounds.push(measured);
            }
        }
        Ok(Runs { modes: runs, syncs })
    }

    /// The disk's sync latency and, per mode, each `metrics` target's own
    /// p99 less the sync p99 of the same round (medians over rounds):
    /// printed through `line`, and returned as JSON (null without probes).
    fn report_syncs(&self, measured: &Runs, line: &mut impl FnMut(String)) -> Value {
        let syncs = &measured.syncs;
        if syncs.is_empty() {
            return Value::Null;
        }
        let p50 = median(syncs.iter().map(|s| s.p50_us).collect());
        let p99 = median(syncs.iter().map(|s| s.p99_us).collect());
        line(String::new());
        line(format!(
            "Disk: {} × {} B append + fdatasync per round, p50 {p50:.0} µs, p99 {p99:.0} µs, alone. A durable answer cannot beat that p99, nor the same disk's sync under the phase's load (the load generator's own {} B writes + fdatasync at random moments, {}/s, beside the phase), nor its journal's syncs in that phase (canarygate_audit_journal_sync_seconds; durable audit only); own p99 less each is taken per round:",
            self.args.sync_samples,
            disk::PROBE_BYTES,
            disk::PROBE_BYTES,
            self.args.loaded_sync_rate,
        ));
        line(String::new());
        line(
            "| mode | target | rate | own p99 µs | sync p99 µs | own p99 - sync p99 µs | sync under load p99 µs | own p99 - sync under load p99 µs | journal sync p99 µs | own p99 - journal sync p99 µs |"
                .to_owned(),
        );
        line("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|".to_owned());
        let mut rows = Vec::new();
        for run in &measured.modes {
            for (i, t) in self.targets.iter().enumerate().filter(|(_, t)| t.metrics) {
                let phases = [(false, run.rate), (true, run.fast_rate)];
                for (fast, rate) in phases.into_iter().filter(|(_, rate)| *rate > 0.0) {
                    let own = |m: &Measurement| m.overhead_at(fast).map_or(f64::NAN, |o| o.p99_us);
                    let own_p99 = run.med(i, own);
                    let less_sync = median(
                        run.rounds
                            .iter()
                            .zip(syncs)
                            .map(|(round, sync)| own(&round[i]) - sync.p99_us)
                            .collect(),
                    );
                    let journal = |m: &Measurement| {
                        m.overhead_at(fast)
                            .map_or(f64::NAN, |o| o.journal_sync_p99_us)
                    };
                    let journal_p99 = run.med(i, journal);
                    let less_journal = run.med(i, |m| own(m) - journal(m));
                    let loaded = |m: &Measurement| {
                        m.overhead_at(fast)
                            .and_then(|o| o.loaded_sync)
                            .map_or(f64::NAN, |s| s.p99_us)
                    };
                    let loaded_p99 = run.med(i, loaded);
                    let less_loaded = run.med(i, |m| own(m) - loaded(m));
                    line(format!(
                        "| {} | {} | {rate:.0}/s | {} | {p99:.0} | {} | {} | {} | {} | {} |",
                        run.label,
                        t.name,
                        fmt(own_p99, 0),
                        fmt(less_sync, 0),
                        fmt(loaded_p99, 0),
                        fmt(less_loaded, 0),
                        fmt(journal_p99, 0),
                        fmt(less_journal, 0),
                    ));
                    rows.push(json!({
                        "mode": run.label, "target": t.name, "rate": rate,
                        "own_p99_at_most_us": finite(own_p99),
                        "own_p99_less_sync_p99_us": finite(less_sync),
                        "sync_under_load_p99_us": finite(loaded_p99),
                        "own_p99_less_sync_under_load_p99_us": finite(less_loaded),
                        "journal_sync_p99_at_most_us": finite(journal_p99),
                        "own_p99_less_journal_sync_p99_us": finite(less_journal),
                    }));
                }
            }
        }
        json!({
            "samples_per_round": self.args.sync_samples,
            "bytes": disk::PROBE_BYTES,
            "rounds": syncs.iter().map(|s| json!({"p50_us": s.p50_us, "p99_us": s.p99_us})).collect::<Vec<_>>(),
            "p50_us": p50,
            "p99_us": p99,
            "own_p99": rows,
        })
    }

    fn report(&self, measured: &Runs) -> (String, Value) {
        let runs = &measured.modes[..];
        let args = &self.args;
        let base = self.baseline;
        let base_name = &self.targets[base].name;
        let mut out = String::new();
        let mut line = |text: String| {
            out.push_str(&text);
            out.push('\n');
        };
        line(format!(
            "Medians of {} round(s). Saturation: {} connections (unless noted) for {:.1} s, CPU per request of the target's process tree. Latency: open loop at the rate shown, added = target - {base_name} in the same round; own = the target's own time per request in that phase from its `/metrics` (canarygate: total minus waiting on provider and client), at most this bucket bound. Every answer {} tokens ({} prompt words).",
            args.rounds, args.concurrency, args.seconds, args.max_tokens, args.prompt_words
        ));
        line(String::new());
        line(format!(
            "| mode | target | req/s | ÷ {base_name} | CPU µs/req | latency at | p50 µs | p99 µs | added p50 µs | added p99 µs | own p50 µs | own p99 µs | errors |"
        ));
        line("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|".to_owned());
        let mut medians = serde_json::Map::new();
        let mut fast_rows = Vec::new();
        for run in runs {
            let mut mode_json = serde_json::Map::new();
            for (i, t) in self.targets.iter().enumerate() {
                let is_base = i == base;
                let unless_base = |value: f64, decimals: usize| {
                    if is_base {
                        "-".to_owned()
                    } else {
                        fmt(value, decimals)
                    }
                };
                let rps = run.med(i, |m| m.throughput.rps);
                let ratio = run.per_round(|r| r[i].throughput.rps / r[base].throughput.rps);
                let added = |f: fn(&Latency) -> f64, fast: bool| {
                    run.per_round(|r| {
                        let pick = |m: &Measurement| if fast { m.fast_latency } else { m.latency };
                        f(&pick(&r[i])) - f(&pick(&r[base]))
                    })
                };
                let p50 = run.med(i, |m| m.latency.p50_us);
                let p99 = run.med(i, |m| m.latency.p99_us);
                let added_p50 = added(|l| l.p50_us, false);
                let added_p99 = added(|l| l.p99_us, false);
                let own = |f: fn(&Overhead) -> f64, fast: bool| {
                    run.med(i, |m| m.overhead_at(fast).as_ref().map_or(f64::NAN, f))
                };
                let (own_p50, own_p99) = (own(|o| o.p50_us, false), own(|o| o.p99_us, false));
                let cpu = run.med(i, |m| m.target_cpu_us);
                let errors: u64 = run
                    .rounds
                    .iter()
                    .map(|r| {
                        r[i].throughput.errors
                            + r[i].latency.failures.total()
                            + r[i].fast_latency.failures.total()
                    })
                    .sum();
                let concurrency = match t.concurrency {
                    Some(c) if c != args.concurrency => format!(" (c={c})"),
                    _ => String::new(),
                };
                line(format!(
                    "| {} | {}{concurrency} | {:.0} | {} | {} | {:.0}/s | {:.0} | {:.0} | {} | {} | {} | {} | {errors} |",
                    run.label,
                    t.name,
                    rps,
                    unless_base(ratio, 2),
                    fmt(cpu, 0),
                    run.rate,
                    p50,
                    p99,
                    unless_base(added_p50, 0),
                    unless_base(added_p99, 0),
                    fmt(own_p50, 0),
                    fmt(own_p99, 0),
                ));
                let mut fast_json = Value::Null;
                if run.fast_rate > 0.0 && !t.slow {
                    let p50 = run.med(i, |m| m.fast_latency.p50_us);
                    let p99 = run.med(i, |m| m.fast_latency.p99_us);
                    let added_p50 = added(|l| l.p50_us, true);
                    let added_p99 = added(|l| l.p99_us, true);
                    let (own_p50, own_p99) = (own(|o| o.p50_us, true), own(|o| o.p99_us, true));
                    fast_rows.push(format!(
                        "| {} | {} | {:.0}/s | {:.0} | {:.0} | {} | {} | {} | {} |",
                        run.label,
                        t.name,
                        run.fast_rate,
                        p50,
                        p99,
                        unless_base(added_p50, 0),
                        unless_base(added_p99, 0),
                        fmt(own_p50, 0),
                        fmt(own_p99, 0),
                    ));
                    fast_json = json!({
                        "rate": run.fast_rate,
                        "p50_us": finite(p50),
                        "p99_us": finite(p99),
                        "added_p50_us": if is_base { Value::Null } else { finite(added_p50) },
                        "added_p99_us": if is_base { Value::Null } else { finite(added_p99) },
                        "own_p50_at_most_us": finite(own_p50),
                        "own_p99_at_most_us": finite(own_p99),
                    });
                }
                mode_json.insert(
                    t.name.clone(),
                    json!({
                        "rps": rps,
                        "rps_ratio_to_baseline": finite(ratio),
                        "latency_rate": run.rate,
                        "p50_us": finite(p50),
                        "p99_us": finite(p99),
                        "added_p50_us": if is_base { Value::Null } else { finite(added_p50) },
                        "added_p99_us": if is_base { Value::Null } else { finite(added_p99) },
                        "own_p50_at_most_us": finite(own_p50),
                        "own_p99_at_most_us": finite(own_p99),
                        "fast_latency": fast_json,
                        "target_cpu_us_per_req": finite(cpu),
                        "upstream_cpu_us_per_req": finite(run.med(i, |m| m.upstream_cpu_us)),
                        "client_cpu_us_per_req": finite(run.med(i, |m| m.client_cpu_us)),
                        "resp_bytes": run.med(i, |m| m.throughput.bytes),
                        "resp_events": run.med(i, |m| m.throughput.events),
                        "errors": errors,
                        "concurrency": self.concurrency(i),
                    }),
                );
            }
            medians.insert(run.label.to_owned(), Value::Object(mode_json));
        }
        if !fast_rows.is_empty() {
            let slow: Vec<&str> = self
                .targets
                .iter()
                .filter(|t| t.slow)
                .map(|t| t.name.as_str())
                .collect();
            line(String::new());
            line(format!(
                "Latency at a higher rate, below the saturation of every target but {}:",
                slow.join(", ")
            ));
            line(String::new());
            line(
                "| mode | target | rate | p50 µs | p99 µs | added p50 µs | added p99 µs | own p50 µs | own p99 µs |"
                    .to_owned(),
            );
            line("|---|---|---:|---:|---:|---:|---:|---:|---:|".to_owned());
            for row in fast_rows {
                line(row);
            }
        }

        let mut ratios = serde_json::Map::new();
        if !self.references.is_empty() {
            line(String::new());
            let mut header = "| mode | target |".to_owned();
            let mut rule = "|---|---|".to_owned();
            for &r in &self.references {
                header.push_str(&format!(" req/s ÷ {} |", self.targets[r].name));
                rule.push_str("---:|");
            }
            for &r in &self.references {
                header.push_str(&format!(" CPU/req ÷ {} |", self.targets[r].name));
                rule.push_str("---:|");
            }
            line(header);
            line(rule);
            for run in runs {
                let mut mode_json = serde_json::Map::new();
                for (i, t) in self.targets.iter().enumerate() {
                    if i == base || self.references.contains(&i) {
                        continue;
                    }
                    let mut row = format!("| {} | {} |", run.label, t.name);
                    let mut target_json = serde_json::Map::new();
                    for &r in &self.references {
                        let value = run.per_round(|x| x[i].throughput.rps / x[r].throughput.rps);
                        row.push_str(&format!(" {} |", fmt(value, 2)));
                        target_json
                            .insert(format!("rps_vs_{}", self.targets[r].name), finite(value));
                    }
                    for &r in &self.references {
                        let value = run.per_round(|x| x[i].target_cpu_us / x[r].target_cpu_us);
                        row.push_str(&format!(" {} |", fmt(value, 2)));
                        target_json.insert(
                            format!("cpu_per_req_vs_{}", self.targets[r].name),
                            finite(value),
                        );
                    }
                    line(row);
                    mode_json.insert(t.name.clone(), Value::Object(target_json));
                }
                ratios.insert(run.label.to_owned(), Value::Object(mode_json));
            }
        }

        let sync_json = self.report_syncs(measured, &mut line);

        let errors: u64 = runs
            .iter()
            .flat_map(|run| run.rounds.iter().flatten())
            .map(|m| m.throughput.errors + m.latency.failures.total())
            .sum();
        if errors > 0 {
            line(String::new());
            line(format!(
                "warning: {errors} failed request(s) in all; see the per-round lines"
            ));
        }

        let json = json!({
            "settings": {
                "seconds": args.seconds,
                "rounds": args.rounds,
                "concurrency": args.concurrency,
                "rate_fraction": args.rate_fraction,
                "fast_rate_fraction": args.fast_rate_fraction,
                "max_tokens": args.max_tokens,
                "prompt_words": args.prompt_words,
                "word_tokens": args.word_tokens,
                "prompt_bytes": args.prompt_bytes,
                "prompt_text_bytes": load::prompt_text(args.prompt_words, args.word_tokens, args.prompt_bytes).len(),
                "latency_phases": !args.no_latency,
                "client_threads": args.client_threads,
                "baseline": base_name,
            },
            "note": args.note,
            "machine": machine(),
            "targets": self.targets.iter().enumerate().map(|(i, t)| {
                let pid = match t.pids[..] {
                    [pid] => Some(pid),
                    _ => None,
                };
                let mut target = json!({
                    "name": t.name, "url": t.url, "pid": pid, "concurrency": self.concurrency(i),
                });
                if t.is_pool() {
                    target["instances"] = json!(t.instances.iter().map(|i| &i.url).collect::<Vec<_>>());
                    target["pids"] = json!(t.pids);
                }
                target
            }).collect::<Vec<_>>(),
            "modes": runs.iter().map(|run| json!({
                "mode": run.label,
                "latency_rate": run.rate,
                "latency_seconds": run.latency_seconds,
                "fast_latency_rate": if run.fast_rate > 0.0 { json!(run.fast_rate) } else { Value::Null },
                "checks": self.targets.iter().zip(&run.answers).map(|(t, a)| (t.name.clone(), json!({
                    "bytes": a.bytes, "events": a.events, "content_events": a.content_events,
                    "content_chars": a.content_chars, "completion_tokens": a.completion_tokens,
                    "finish_reason": a.finish_reason,
                }))).collect::<serde_json::Map<_, _>>(),
                "rounds": run.rounds.iter().enumerate().map(|(round, measured)| json!({
                    "order": order(self.targets.len(), round).iter().map(|&i| self.targets[i].name.clone()).collect::<Vec<_>>(),
                    "measurements": self.targets.iter().zip(measured).map(|(t, m)| (t.name.clone(), m.to_json())).collect::<serde_json::Map<_, _>>(),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "medians": medians,
            "ratios": ratios,
            "disk_sync": sync_json,
            "errors": errors,
        });
        (out, json)
    }
}

fn main() {
    let args = Args::parse();
    if let Err(error) = run(args) {
        eprintln!("canarygate-bench: {error}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), String> {
    if args.seconds.is_nan() || args.seconds <= 0.0 || args.rounds == 0 || args.concurrency == 0 {
        return Err("seconds, rounds and concurrency must be > 0".to_owned());
    }
    let targets = args
        .targets
        .iter()
        .map(|spec| Target::parse(spec))
        .collect::<Result<Vec<_>, _>>()?;
    let index_of = |name: &str| {
        targets
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| format!("no target named {name}"))
    };
    let mut seen = BTreeMap::new();
    for t in &targets {
        if seen.insert(t.name.as_str(), ()).is_some() {
            return Err(format!("two targets named {}", t.name));
        }
    }
    let baseline = match &args.baseline {
        Some(name) => index_of(name)?,
        None => 0,
    };
    let references = args
        .references
        .iter()
        .map(|name| index_of(name))
        .collect::<Result<Vec<_>, _>>()?;

    println!(
        "canarygate-bench: {} target(s), {} round(s), {:.1} s saturation phases with {} connections, {} client thread(s), {} cpus",
        targets.len(),
        args.rounds,
        args.seconds,
        args.concurrency,
        args.client_threads,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    let bench = Bench {
        args: args.clone(),
        targets,
        baseline,
        references,
    };
    let runtime = if args.client_threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.client_threads)
            .enable_all()
            .build()
    }
    .map_err(|e| format!("runtime: {e}"))?;
    let runs = runtime.block_on(bench.run())?;
    drop(runtime);

    let (table, json) = bench.report(&runs);
    println!();
    if !args.note.is_empty() {
        println!("{}", args.note);
        println!();
    }
    print!("{table}");
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&json).expect("json");
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
        println!();
        println!("results: {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_round_down_to_one_digit() {
        assert_eq!(round_rate(75.0), 70.0);
        assert_eq!(round_rate(50.0), 50.0);
        assert_eq!(round_rate(4.5), 4.0);
        assert_eq!(round_rate(300.0), 300.0);
        assert_eq!(round_rate(1234.0), 1000.0);
        assert_eq!(round_rate(9.9), 9.0);
        assert_eq!(round_rate(0.2), 1.0);
        assert_eq!(round_rate(f64::INFINITY), 1.0);
    }

    #[test]
    fn orders_rotate_and_alternate() {
        assert_eq!(order(3, 0), vec![0, 1, 2]);
        assert_eq!(order(3, 1), vec![0, 2, 1]);
        assert_eq!(order(3, 2), vec![2, 0, 1]);
        for round in 0..6 {
            let mut o = order(5, round);
            o.sort();
            assert_eq!(o, vec![0, 1, 2, 3, 4]);
        }
        // Two targets take turns going first.
        let firsts: Vec<usize> = (0..4).map(|round| order(2, round)[0]).collect();
        assert_eq!(firsts, vec![0, 1, 0, 1]);
        assert_eq!(order(1, 3), vec![0]);
    }
}
