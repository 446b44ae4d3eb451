//! The incident replay that `canarygate demo` runs, on embedded defaults:
//! a client program of the workspace's crates (the simulator, the proxy,
//! the engine's tiny model), not part of any of them.
//!
//! Starts, in this process, a simulated provider in `leak-on-overflow` mode
//! (its KV pool and advertised window scaled down in the incident's ratio,
//! 681,280 / 1,048,576) and a canarygate with the default policy in front of
//! it, plus a `[local]` engine (a tiny random model written for the demo) and
//! `verify.action = "fallback"`. canarygate first probes the provider (see
//! [`canarygate_proxy::probe`]), which finds its real limit near the pool size. One
//! request fills the provider's pool, as earlier traffic would. Then many
//! concurrent sessions send prompts on both sides of the pool size, first
//! straight to the provider, then through canarygate, and the demo counts
//! what each client received: through canarygate, prompts the provider cannot
//! hold are served by the local engine.
//!
//! The local model has random weights, so its answers are word salad; what
//! the demo shows is that they are HTTP 200, come from the engine, and hold
//! nothing of any other request. Point `[local] model_dir` at a real model
//! for real answers.
//!
//! Every prompt carries a word unique to its request (`rq00042`). An answer
//! that contains another request's word is a leak: the client got someone
//! else's text.
//!
//! The requests take turns across the APIs jobs call ([`Surface`]): Chat
//! Completions, the Responses API and Anthropic's Messages API, each
//! streamed and not; the simulator leaks on all three alike, and the report
//! counts each surface on its own too.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use canarygate_engine::{TinyModel, TinyTokenizer, write_tiny_model};
use canarygate_policies::config::{DEFAULT_PRESET, Policy};
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use anyhow::{Context, anyhow};
use canarygate_proxy::probe::{self, ProbeTarget};
use canarygate_proxy::{SERVED_BY_HEADER, ServeOptions, Server, store_probe_result};
use canarygate_sim::{Mode, SimConfig};

/// The advertised window of the simulated provider, in tokens.
pub const DEMO_WINDOW_TOKENS: u64 = 8192;

/// Model name the demo's clients ask for.
const DEMO_MODEL: &str = "sim-model";

/// Prefill speed of the simulated provider, tokens per second.
pub const DEMO_PREFILL_TOKENS_PER_SECOND: f64 = 50_000.0;

/// Prompt sizes within this many tokens of the pool size are moved below it.
const BOUNDARY_MARGIN: usize = 256;

/// Output tokens a Messages request asks for (the API requires a limit):
/// enough for an answer to show whose text it holds.
const MESSAGES_MAX_TOKENS: u64 = 256;

/// An API the demo's clients call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Surface {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/responses`.
    Responses,
    /// `POST /v1/messages` (Anthropic).
    Messages,
}

impl Surface {
    /// The surface of request `index`: they take turns.
    fn of(index: usize) -> Self {
        [Self::Chat, Self::Responses, Self::Messages][index % 3]
    }

    /// The name the audit record gives the endpoint.
    fn name(self) -> &'static str {
        match self {
            Self::Chat => "chat_completions",
            Self::Responses => "responses",
            Self::Messages => "messages",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Responses => "/v1/responses",
            Self::Messages => "/v1/messages",
        }
    }

    /// The request body for `prompt`.
    fn body(self, prompt: String, stream: bool) -> Value {
        match self {
            Self::Chat => json!({
                "model": DEMO_MODEL, "stream": stream,
                "messages": [{"role": "user", "content": prompt}],
            }),
            Self::Responses => json!({"model": DEMO_MODEL, "stream": stream, "input": prompt}),
            Self::Messages => json!({
                "model": DEMO_MODEL, "stream": stream, "max_tokens": MESSAGES_MAX_TOKENS,
                "messages": [{"role": "user", "content": prompt}],
            }),
        }
    }

    /// The answer's text in a whole answer.
    fn text(self, answer: &Value) -> String {
        let parts = |list: Option<&Value>, kind: &str| -> String {
            list.and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter(|part| part["type"] == kind)
                .filter_map(|part| part["text"].as_str())
                .collect()
        };
        match self {
            Self::Chat => answer
                .pointer("/choices/0/message/content")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            Self::Responses => answer["output"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|item| parts(item.get("content"), "output_text"))
                .collect(),
            Self::Messages => parts(answer.get("content"), "text"),
        }
    }

    /// The text one stream event adds.
    fn delta(self, event: &Value) -> Option<&str> {
        match self {
            Self::Chat => event.pointer("/choices/0/delta/content")?.as_str(),
            Self::Responses if event["type"] == "response.output_text.delta" => {
                event["delta"].as_str()
            }
            Self::Messages if event.pointer("/delta/type")? == "text_delta" => {
                event.pointer("/delta/text")?.as_str()
            }
            _ => None,
        }
    }
}

/// What one surface's clients received, direct and through canarygate.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SurfaceReport {
    /// Requests sent on it in each phase.
    pub requests: usize,
    /// Direct: answers with HTTP 200 that carried another request's text.
    pub direct_leaks_delivered: usize,
    /// Through canarygate: the same.
    pub proxied_leaks_delivered: usize,
    /// Through canarygate: answers served by the local engine.
    pub proxied_served_local: usize,
}

/// Settings of one demo run.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Concurrent client sessions.
    pub sessions: usize,
    /// Requests per session.
    pub requests_per_session: usize,
    /// Requests in flight at once.
    pub concurrency: usize,
}

impl Default for DemoOptions {
    fn default() -> Self {
        Self {
            sessions: 48,
            requests_per_session: 4,
            concurrency: 16,
        }
    }
}

/// What the clients received, direct and through canarygate.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DemoReport {
    /// Requests sent in each phase.
    pub requests: usize,
    /// Prompts larger than the provider's KV pool (but inside its window).
    pub over_pool_requests: usize,
    /// Direct: answers with HTTP 200.
    pub direct_delivered: usize,
    /// Direct: answers with HTTP 200 that carried another request's text.
    pub direct_leaks_delivered: usize,
    /// Through canarygate: answers with HTTP 200.
    pub proxied_delivered: usize,
    /// Through canarygate: answers with HTTP 200 that carried another request's text.
    pub proxied_leaks_delivered: usize,
    /// Through canarygate: answers blocked by verification.
    pub proxied_blocked: usize,
    /// Through canarygate: honest answers (prompt within the pool) that were blocked.
    pub false_positives: usize,
    /// Through canarygate: answers served by the local engine (HTTP 200).
    pub proxied_served_local: usize,
    /// What canarygate's probe found the provider serves correctly, in tokens.
    pub probed_limit_tokens: u64,
    /// Advertised window of the simulated provider, in tokens.
    pub window_tokens: u64,
    /// Its KV pool, in tokens.
    pub pool_tokens: u64,
    /// The same counts per API (`chat_completions`, `responses`,
    /// `messages`).
    pub surfaces: std::collections::BTreeMap<&'static str, SurfaceReport>,
    /// Wall time of the whole run, in seconds.
    pub seconds: f64,
}

/// One request of the replay.
#[derive(Debug, Clone)]
struct Job {
    index: usize,
    session: usize,
    words: usize,
}

impl Job {
    fn marker(&self) -> String {
        marker(self.index)
    }

    fn prompt(&self) -> String {
        let marker = self.marker();
        let mut text = format!("{marker} private notes of session {}:", self.session);
        let filler = ["invoice", "total", "customer", "ledger", "balance", "due"];
        for word in 0..self.words {
            text.push(' ');
            // The marker recurs, so any stretch of this prompt shows whose it is.
            if word % 8 == 7 {
                text.push_str(&marker);
            } else {
                text.push_str(filler[(word + self.index) % filler.len()]);
            }
        }

        text
    }
}

fn marker(index: usize) -> String {
    format!("rq{index:05}")
}

/// Whether `content` holds the marker of any request other than `own`.
fn carries_foreign_text(content: &str, own: &str) -> bool {
    content
        .split(|c: char| !c.is_alphanumeric())
        .any(|word| word.len() == 7 && word.starts_with("rq") && word != own)
}

/// Runs the replay and returns its report.
pub async fn run(options: &DemoOptions) -> anyhow::Result<DemoReport> {
    let started = Instant::now();
    let sim_config = SimConfig {
        context_window: DEMO_WINDOW_TOKENS,
        mode: Mode::LeakOnOverflow,
        // A real prefill takes time: the default policy's ttft check expects
        // no provider to prefill faster than 200,000 tokens/s.
        prefill_tps: DEMO_PREFILL_TOKENS_PER_SECOND,
        ..SimConfig::default()
    };
    let pool_tokens = sim_config.prefill_pool_tokens();
    let sim_addr = spawn_sim(sim_config).await?;

    let scratch = scratch_dir()?;
    // The model beside the data directory, not in it: serve accepts only
    // owner-only files there.
    let model_dir = scratch.path.join("local-model");
    let data_dir = scratch.path.join("data");
    let writing = model_dir.clone();
    tokio::task::spawn_blocking(move || write_tiny_model(&writing, &demo_local_model()))
        .await
        .context("writing the demo's local model")?
        .context("writing the demo's local model")?;
    let policy_text = format!(
        "{}\n[local]\nmodel_dir = {:?}\nkv_budget_mib = 64\n",
        DEFAULT_PRESET.replace("action = \"block\"", "action = \"fallback\""),
        model_dir.display().to_string()
    );
    let mut policy = Policy::from_toml_str(&policy_text, "demo policy")?;
    policy.override_upstream(&format!("http://{sim_addr}/v1"))?;

    // Prompt sizes sweep 5%..95% of the window: about a third land over the pool.
    let total = options.sessions * options.requests_per_session;
    let jobs: Vec<Job> = (0..total)
        .map(|index| {
            let spread = (index * 7919) % total;
            let fraction = 0.05 + 0.90 * spread as f64 / total.max(2) as f64;
            let mut words = (fraction * DEMO_WINDOW_TOKENS as f64) as usize;
            // Keep clear of the pool boundary, where canarygate's own
            // instructions (a few dozen tokens) could tip a prompt over.
            // A Messages request's limit on output counts against the
            // context too: its prompts keep clear of that as well.
            let pool = pool_tokens as usize;
            let below = match Surface::of(index) {
                Surface::Messages => BOUNDARY_MARGIN + MESSAGES_MAX_TOKENS as usize,
                _ => BOUNDARY_MARGIN,
            };
            if (pool.saturating_sub(below)..pool + BOUNDARY_MARGIN).contains(&words) {
                words = pool.saturating_sub(below);
            }
            Job {
                index,
                session: index % options.sessions,
                words,
            }
        })
        .collect();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()?;

    let mut report = DemoReport {
        requests: total,
        window_tokens: DEMO_WINDOW_TOKENS,
        pool_tokens,
        ..DemoReport::default()
    };
    // The provider has served traffic before the replay starts: one honest
    // request just under the pool size leaves its text in the pool, as
    // earlier traffic would. Otherwise an over-pool prompt that reached the
    // pool first would read never-used pages, and whether it leaked would
    // depend on which request arrived first.
    let warm_up = Job {
        index: total,
        session: options.sessions,
        words: (pool_tokens as usize).saturating_sub(BOUNDARY_MARGIN),
    };
    let warmed = run_phase(&client, sim_addr, std::slice::from_ref(&warm_up), 1).await?;
    if warmed.iter().any(|answer| answer.status != 200) {
        return Err(anyhow!("the warm-up request failed: {warmed:?}"));
    }
    let direct = run_phase(&client, sim_addr, &jobs, options.concurrency).await?;

    // What `canarygate probe --yes` does before serving, stored where
    // `serve` reads it: each provider (OpenAI's API and Anthropic's, both
    // the simulator) is probed in its own API.
    let providers: Vec<String> = policy
        .providers
        .iter()
        .map(|provider| provider.name.get_ref().clone())
        .collect();
    for provider in providers {
        let target = ProbeTarget {
            provider,
            model: DEMO_MODEL.to_owned(),
            advertised_window_tokens: DEMO_WINDOW_TOKENS,
        };
        let probed = probe::run(&policy, &target, Some("sk-demo-probe"), u64::MAX, |_| {})
            .await
            .with_context(|| format!("probing the simulated provider `{}`", target.provider))?;
        store_probe_result(&data_dir, &probed)?;
        // The report names the lowest limit found.
        report.probed_limit_tokens = match report.probed_limit_tokens {
            0 => probed.effective_limit_tokens,
            found => found.min(probed.effective_limit_tokens),
        };
    }
    let server = Server::bind(ServeOptions {
        policy,
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        data_dir: data_dir.clone(),
        instance: Some("demo".to_owned()),
    })
    .await?;
    let proxy_addr = server.local_addr()?;
    tokio::spawn(server.run(std::future::pending()));

    let proxied = run_phase(&client, proxy_addr, &jobs, options.concurrency).await?;
    for (job, (direct, proxied)) in jobs.iter().zip(direct.iter().zip(&proxied)) {
        let own = job.marker();
        let over_pool = job.words > pool_tokens as usize;
        report.over_pool_requests += usize::from(over_pool);
        let surface = report
            .surfaces
            .entry(Surface::of(job.index).name())
            .or_default();
        surface.requests += 1;
        if direct.status == 200 {
            report.direct_delivered += 1;
            let leaked = usize::from(carries_foreign_text(&direct.content, &own));
            report.direct_leaks_delivered += leaked;
            surface.direct_leaks_delivered += leaked;
        }
        if proxied.status == 200 {
            let leaked = usize::from(carries_foreign_text(&proxied.content, &own));
            report.proxied_delivered += 1;
            report.proxied_served_local += usize::from(proxied.local);
            report.proxied_leaks_delivered += leaked;
            surface.proxied_served_local += usize::from(proxied.local);
            surface.proxied_leaks_delivered += leaked;
        } else if proxied.code.as_deref() == Some("canarygate_verification_failed") {
            report.proxied_blocked += 1;
            report.false_positives += usize::from(!over_pool);
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// What one client saw.
#[derive(Debug)]
struct Answer {
    status: u16,
    content: String,
    code: Option<String>,
    /// `x-canarygate-served-by: local`.
    local: bool,
}

async fn run_phase(
    client: &reqwest::Client,
    target: SocketAddr,
    jobs: &[Job],
    concurrency: usize,
) -> anyhow::Result<Vec<Answer>> {
    let slots = Arc::new(Semaphore::new(concurrency.max(1)));
    let mut tasks = Vec::with_capacity(jobs.len());
    for job in jobs {
        let permit = slots.clone().acquire_owned().await?;
        let client = client.clone();
        let base = format!("http://{target}");
        let job = job.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            ask(&client, &base, &job).await
        }));
    }
    let mut answers = Vec::with_capacity(tasks.len());
    for task in tasks {
        answers.push(task.await??);
    }
    Ok(answers)
}

async fn ask(client: &reqwest::Client, base: &str, job: &Job) -> anyhow::Result<Answer> {
    let surface = Surface::of(job.index);
    // Each surface streams every other request: both paths are exercised.
    let stream = (job.index / 3) % 2 == 1;
    let key = format!("sk-demo-session-{}", job.session);
    let request = client.post(format!("{base}{}", surface.path()));
    let request = match surface {
        // Anthropic's clients send their key as x-api-key, and the version.
        Surface::Messages => request
            .header("x-api-key", key)
            .header("anthropic-version", "2023-06-01"),
        _ => request.bearer_auth(key),
    };
    let response = request
        .json(&surface.body(job.prompt(), stream))
        .send()
        .await
        .context("demo request failed")?;
    let status = response.status().as_u16();
    let local = response
        .headers()
        .get(SERVED_BY_HEADER)
        .is_some_and(|value| value == "local");
    if stream && status == 200 {
        let mut body = response.bytes_stream();
        let mut parser = canarygate_policies::sse::SseParser::new();
        let mut events = Vec::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk?;
            parser.feed(&chunk, &mut events);
        }
        let mut content = String::new();
        let mut code = None;
        for event in events.iter().filter(|event| !event.is_done()) {
            let Ok(value) = serde_json::from_str::<Value>(&event.data) else {
                continue;
            };
            if let Some(error_code) = error_code(&value) {
                code = Some(error_code);
            }
            if let Some(text) = surface.delta(&value) {
                content.push_str(text);
            }
        }
        // A stream that ended in an error event was not delivered whole.
        let status = if code.is_some() { 502 } else { 200 };
        return Ok(Answer {
            status,
            content,
            code,
            local,
        });
    }
    let value: Value = response.json().await.unwrap_or(Value::Null);
    Ok(Answer {
        status,
        content: surface.text(&value),
        code: error_code(&value),
        local,
    })
}

/// canarygate's (or the provider's) error code in an answer or event, in
/// any of the three APIs' shapes.
fn error_code(value: &Value) -> Option<String> {
    let error = value.get("error")?;
    error
        .get("code")
        .or_else(|| error.get("type"))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// The demo's local model: tiny, random, one token per word, with a window
/// above the provider's so every request fits.
fn demo_local_model() -> TinyModel {
    TinyModel {
        hidden_size: 32,
        intermediate_size: 64,
        num_layers: 1,
        num_heads: 2,
        num_kv_heads: 1,
        max_position_embeddings: 2 * DEMO_WINDOW_TOKENS as usize,
        tokenizer: TinyTokenizer::Words,
        ..TinyModel::default()
    }
}

async fn spawn_sim(config: SimConfig) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .context("cannot start the simulated provider")?;
    let addr = listener.local_addr()?;
    tokio::spawn(canarygate_sim::serve(
        listener,
        config,
        None,
        std::future::pending(),
    ));
    Ok(addr)
}

/// A temporary directory (owner-only), removed when dropped.
struct ScratchDir {
    path: PathBuf,
}

fn scratch_dir() -> anyhow::Result<ScratchDir> {
    let path = std::env::temp_dir().join(format!(
        "canarygate-demo-{}-{}",
        std::process::id(),
        canarygate_audit::time::now_ms()
    ));
    canarygate_audit::files::create_private_dir_all(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    Ok(ScratchDir { path })
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

impl DemoReport {
    /// The human-readable table.
    pub fn table(&self) -> String {
        let ratio = self.pool_tokens as f64 / self.window_tokens as f64;
        format!(
            "canarygate demo: replay of the KV-pool leak (SGLang #30233)\n\
             simulated provider: advertised window {} tokens, KV pool {} tokens ({ratio:.4} of the window, as in the incident)\n\
             {} requests per phase from concurrent sessions; {} prompts larger than the pool\n\
             canarygate's probe found the provider correct up to {} tokens; longer requests go to its local engine\n\
             \n\
             {:<44}{:>10}{:>22}\n\
             {:<44}{:>10}{:>22}\n\
             {:<44}{:>10}{:>22}\n\
             {:<44}{:>10}{:>22}\n\
             {:<44}{:>10}{:>22}\n\
             {:<44}{:>10}{:>22}\n\
             \n\
             {}\
             finished in {:.1} s\n",
            self.window_tokens,
            self.pool_tokens,
            self.requests,
            self.over_pool_requests,
            self.probed_limit_tokens,
            "",
            "direct",
            "through canarygate",
            "responses",
            self.requests,
            self.requests,
            "delivered with HTTP 200",
            self.direct_delivered,
            self.proxied_delivered,
            "  of which leaked another request's text",
            self.direct_leaks_delivered,
            self.proxied_leaks_delivered,
            "  of which served by the local engine",
            "-",
            self.proxied_served_local,
            "blocked by verification (false alarms)",
            "-",
            format!("{} ({})", self.proxied_blocked, self.false_positives),
            self.surfaces
                .iter()
                .map(|(name, surface)| format!(
                    "{name}: {} requests, leaks {} direct / {} through canarygate, {} served locally\n",
                    surface.requests,
                    surface.direct_leaks_delivered,
                    surface.proxied_leaks_delivered,
                    surface.proxied_served_local
                ))
                .collect::<String>(),
            self.seconds,
        )
    }

    /// The same numbers as one JSON object.
    pub fn json(&self) -> Value {
        serde_json::to_value(self).expect("a report of numbers always serialises")
    }
}
