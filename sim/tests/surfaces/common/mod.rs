//! Shared by the sim's integration tests: a simulated provider on a real
//! socket (its own thread and runtime, so that one server can serve every
//! test of a file), requests, SSE streams, and canaries placed as
//! canarygate places them.

#![allow(dead_code)] // Each test file uses its own part of this.

use std::sync::OnceLock;
use std::time::Duration;

use canarygate_policies::EchoCost;
use canarygate_policies::canary::Canary;
use canarygate_policies::inject::{RequestCanaries, inject};
use canarygate_policies::sse::{SseEvent, SseParser};
use canarygate_policies::verify_config::EchoMode;
use canarygate_sim::{SimConfig, serve};
use reqwest::header::HeaderMap;
use serde_json::{Value, json};

/// A running simulated provider.
pub struct Sim {
    pub url: String,
}

impl Sim {
    /// Starts a provider with `config` on a free port; it runs until the
    /// test process ends.
    pub fn start(config: SimConfig) -> Self {
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                sender
                    .send(listener.local_addr().expect("address"))
                    .expect("report the address");
                serve(listener, config, None, std::future::pending())
                    .await
                    .expect("serve");
            });
        });
        let address = receiver.recv().expect("the server starts");
        Self {
            url: format!("http://{address}"),
        }
    }

    /// The provider with the default settings every test of a file shares.
    pub fn shared() -> &'static Sim {
        static SHARED: OnceLock<Sim> = OnceLock::new();
        SHARED.get_or_init(|| Sim::start(SimConfig::default()))
    }

    /// `GET /sim/stats`.
    pub async fn stats(&self) -> Value {
        client()
            .get(format!("{}/sim/stats", self.url))
            .send()
            .await
            .expect("stats")
            .json()
            .await
            .expect("stats JSON")
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("client")
}

/// What one call returned.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub text: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|error| panic!("{error}: {}", self.text))
    }

    /// The SSE events of a stream.
    pub fn events(&self) -> Vec<SseEvent> {
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        parser.feed(self.text.as_bytes(), &mut events);
        events
    }

    /// The JSON of every event but `[DONE]`.
    pub fn event_data(&self) -> Vec<Value> {
        self.events()
            .iter()
            .filter(|event| !event.is_done())
            .map(|event| serde_json::from_str(&event.data).expect("event JSON"))
            .collect()
    }
}

/// How to authenticate.
#[derive(Clone, Copy)]
pub enum Auth {
    /// `Authorization: Bearer` (OpenAI).
    OpenAi,
    /// `x-api-key` and `anthropic-version` (Anthropic).
    Anthropic,
    None,
}

/// Posts `body` to `path`, with `x-sim-mode: mode` when given.
pub async fn post(sim: &Sim, path: &str, auth: Auth, body: &Value, mode: Option<&str>) -> Reply {
    try_post(sim, path, auth, body, mode, Duration::from_secs(20))
        .await
        .expect("a whole reply")
}

/// [`post`] giving up after `timeout`; `Err` when the body did not come
/// whole in time (a cut or a stall).
pub async fn try_post(
    sim: &Sim,
    path: &str,
    auth: Auth,
    body: &Value,
    mode: Option<&str>,
    timeout: Duration,
) -> Result<Reply, String> {
    let mut request = client().post(format!("{}{path}", sim.url)).json(body);
    request = match auth {
        Auth::OpenAi => request.bearer_auth("sk-test"),
        Auth::Anthropic => request
            .header("x-api-key", "sk-ant-test")
            .header("anthropic-version", "2023-06-01"),
        Auth::None => request,
    };
    if let Some(mode) = mode {
        request = request.header("x-sim-mode", mode);
    }
    let exchange = async {
        let response = request.send().await.map_err(|error| error.to_string())?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.map_err(|error| error.to_string())?;
        Ok(Reply {
            status,
            headers,
            text,
        })
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| "timed out".to_owned())?
}

/// Reads a stream until `timeout`: what arrived, and whether it ended.
pub async fn read_stream(
    sim: &Sim,
    path: &str,
    auth: Auth,
    body: &Value,
    mode: Option<&str>,
    timeout: Duration,
) -> (String, bool) {
    let mut request = client().post(format!("{}{path}", sim.url)).json(body);
    request = match auth {
        Auth::OpenAi => request.bearer_auth("sk-test"),
        Auth::Anthropic => request
            .header("x-api-key", "sk-ant-test")
            .header("anthropic-version", "2023-06-01"),
        Auth::None => request,
    };
    if let Some(mode) = mode {
        request = request.header("x-sim-mode", mode);
    }
    let mut response = request.send().await.expect("the head");
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match tokio::time::timeout_at(deadline, response.chunk()).await {
            Ok(Ok(Some(chunk))) => text.push_str(&String::from_utf8_lossy(&chunk)),
            Ok(Ok(None)) => return (text, true),
            Ok(Err(_)) | Err(_) => return (text, false),
        }
    }
}

/// A request's canaries placed as canarygate places them: the head
/// instruction (the system text) and the tail block after `question` (the
/// last user text).
pub struct Canaried {
    pub head: Canary,
    pub tail: Canary,
    pub system: String,
    pub user: String,
}

impl Canaried {
    pub fn new(seed: u8, question: &str) -> Self {
        let canaries = RequestCanaries {
            head: Canary::from_random([seed; 10]),
            tail: Canary::from_random([seed.wrapping_add(101); 10]),
        };
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": question}]});
        inject(
            &mut body,
            EchoMode::HeadTail,
            EchoCost::DIGIT_BY_DIGIT,
            canaries,
        )
        .expect("inject");
        let text = |index: usize| {
            body["messages"][index]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        Self {
            head: canaries.head,
            tail: canaries.tail,
            system: text(0),
            user: text(1),
        }
    }

    /// The opening an obedient model gives: `HEAD TAIL`.
    pub fn opening(&self) -> String {
        format!("{} {}", self.head, self.tail)
    }
}

/// The canaries a reply opens with.
pub fn opening_canaries(text: &str) -> Vec<Canary> {
    text.split_whitespace()
        .take(2)
        .map_while(Canary::parse)
        .collect()
}
