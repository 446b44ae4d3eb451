//! canarygate-bench-ttft: time to the first visible token of a streamed
//! chat, per target, in one run (`bench/ttft.sh` starts the targets).
//!
//! Each sample sends one streamed chat completion over a fresh connection
//! and records the time from sending the request to the first SSE event
//! whose `choices[0].delta.content` is not empty (what a client can show),
//! and to the end of the stream (`data: [DONE]`). Targets take turns sample
//! by sample, so a slow moment of the machine hits all of them. Every target
//! gets the same questions. Prints the medians and each target's ratio to
//! the target it is compared with (`vs=`, by default the first).

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

#[derive(Parser, Debug)]
#[command(about = "Time to first visible token of streamed chats, per target (bench/ttft.sh)")]
struct Args {
    /// A target: `NAME=URL[,vs=OTHER]`. URL is the API base
    /// (`http://127.0.0.1:9000/v1`); `vs`: the target its ratios are
    /// computed against (default: the first target). Repeat per target.
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    /// Samples per target.
    #[arg(long, env = "TTFT_SAMPLES", default_value_t = 30)]
    samples: usize,
    /// `max_tokens` of each request.
    #[arg(long, default_value_t = 64)]
    max_tokens: u64,
    /// Model name sent.
    #[arg(long, default_value = "sim-model")]
    model: String,
}

struct Target {
    name: String,
    addr: SocketAddr,
    host: String,
    path: String,
    vs: Option<String>,
    first_token: Vec<f64>,
    total: Vec<f64>,
}

impl Target {
    fn parse(spec: &str) -> Result<Self, String> {
        let (name, rest) = spec
            .split_once('=')
            .ok_or_else(|| format!("target `{spec}` is not NAME=URL"))?;
        let mut parts = rest.split(',');
        let url = parts.next().unwrap_or_default();
        let mut vs = None;
        for option in parts {
            match option.split_once('=') {
                Some(("vs", other)) => vs = Some(other.to_owned()),
                _ => return Err(format!("unknown target option `{option}` in `{spec}`")),
            }
        }
        let without_scheme = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("target URL `{url}` must start with http://"))?;
        let (host, base) = without_scheme
            .split_once('/')
            .map_or((without_scheme, ""), |(host, base)| (host, base));
        let addr = host
            .to_socket_addrs()
            .map_err(|error| format!("target host `{host}`: {error}"))?
            .next()
            .ok_or_else(|| format!("target host `{host}` has no address"))?;
        Ok(Self {
            name: name.to_owned(),
            addr,
            host: host.to_owned(),
            path: format!("/{}/chat/completions", base.trim_end_matches('/')).replace("//", "/"),
            vs,
            first_token: Vec::new(),
            total: Vec::new(),
        })
    }
}

/// One streamed chat: (seconds to the first visible content, seconds to `[DONE]`).
async fn sample(target: &Target, body: Bytes) -> Result<(f64, f64), String> {
    let started = Instant::now();
    let stream = tokio::net::TcpStream::connect(target.addr)
        .await
        .map_err(|error| format!("connect: {error}"))?;
    stream.set_nodelay(true).ok();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|error| format!("handshake: {error}"))?;
    tokio::spawn(connection);
    let request = Request::post(&target.path)
        .header("host", &target.host)
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-bench")
        .body(Full::new(body))
        .map_err(|error| error.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|error| format!("request: {error}"))?;
    if !response.status().is_success() {
        let status = response.status();
        let text = response
            .into_body()
            .collect()
            .await
            .map(|body| body.to_bytes());
        return Err(format!("HTTP {status}: {text:?}"));
    }
    let mut body = response.into_body();
    let mut buffer = Vec::new();
    let mut first = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| format!("body: {error}"))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        buffer.extend_from_slice(data);
        while let Some(end) = buffer.windows(2).position(|pair| pair == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for line in text.lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" {
                    let first = first.ok_or("stream ended without visible content")?;
                    return Ok((first, started.elapsed().as_secs_f64()));
                }
                let chunk: Value = serde_json::from_str(data)
                    .map_err(|error| format!("bad event `{data}`: {error}"))?;
                if chunk.get("error").is_some() {
                    return Err(format!("error event: {data}"));
                }
                let visible = chunk["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|content| !content.is_empty());
                if visible && first.is_none() {
                    first = Some(started.elapsed().as_secs_f64());
                }
            }
        }
    }
    Err("stream ended without [DONE]".into())
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let middle = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    } else {
        sorted[middle]
    }
}

fn percentile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    let mut targets: Vec<Target> = match args
        .targets
        .iter()
        .map(|spec| Target::parse(spec))
        .collect()
    {
        Ok(targets) => targets,
        Err(error) => {
            eprintln!("canarygate-bench-ttft: {error}");
            std::process::exit(2);
        }
    };
    let names: Vec<String> = targets.iter().map(|target| target.name.clone()).collect();
    for target in &targets {
        if let Some(vs) = &target.vs
            && !names.contains(vs)
        {
            eprintln!(
                "canarygate-bench-ttft: target `{}` is compared with unknown `{vs}`",
                target.name
            );
            std::process::exit(2);
        }
    }
    let questions = [
        "What does the harbour master check before the tide turns?",
        "Summarise the survey plan for Tuesday in two lines.",
        "Which buoys need new batteries this week?",
        "List the boats due back before noon.",
        "How far is the lighthouse from the north pier?",
    ];
    // One warm-up per target (not counted), then the samples in turns.
    for round in 0..=args.samples {
        let question = questions[round % questions.len()];
        let body = Bytes::from(
            json!({
                "model": args.model,
                "stream": true,
                "max_tokens": args.max_tokens,
                "messages": [{"role": "user", "content": format!("{question} (#{round})")}],
            })
            .to_string(),
        );
        for target in &mut targets {
            let result =
                tokio::time::timeout(Duration::from_secs(60), sample(target, body.clone()))
                    .await
                    .unwrap_or_else(|_| Err("no answer within 60 s".into()));
            match result {
                Ok((first, total)) if round > 0 => {
                    target.first_token.push(first);
                    target.total.push(total);
                }
                Ok(_) => {}
                Err(error) => {
                    eprintln!("canarygate-bench-ttft: {}: {error}", target.name);
                    std::process::exit(1);
                }
            }
        }
    }
    println!(
        "| target | samples | first visible token p50 ms | p90 ms | ÷ baseline (p50) | whole stream p50 ms | baseline |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|");
    let baseline_of = |target: &Target| target.vs.clone().unwrap_or_else(|| names[0].clone());
    for target in &targets {
        let baseline_name = baseline_of(target);
        let baseline = targets
            .iter()
            .find(|other| other.name == baseline_name)
            .expect("checked above");
        let first = median(&target.first_token);
        let ratio = if baseline.name == target.name {
            String::new()
        } else {
            format!("{:.1}×", first / median(&baseline.first_token))
        };
        println!(
            "| {} | {} | {:.1} | {:.1} | {} | {:.1} | {} |",
            target.name,
            target.first_token.len(),
            first * 1000.0,
            percentile(&target.first_token, 0.9) * 1000.0,
            ratio,
            median(&target.total) * 1000.0,
            if baseline.name == target.name {
                "—"
            } else {
                &baseline.name
            },
        );
    }
}
