//! The audit log as `canarygate serve` writes it: real server and simulated
//! provider processes, real sockets, the real data directory, read back with
//! the `canarygate audit` CLI.
//!
//! - `acknowledged_answers_survive_sigkill_under_load`: every answer a client
//!   received in full has its durable record, across SIGKILLs and restarts.
//! - `records_carry_what_the_client_saw`: field by field, for a verified
//!   non-stream answer, a stream, a blocked answer and a client that left.
//! - `spot_check_walkthrough_runs`: `examples/spot-check/walkthrough.sh`.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use canarygate_proxy::audit::sha256_hex;
use common::{ProxyDir, Running, client, start_proxy, start_proxy_with_policy, start_sim};
use serde_json::{Value, json};

/// Runs `canarygate audit --data DIR <args>`.
fn audit(data: &Path, args: &[&str]) -> Output {
    Command::new(common::binary())
        .arg("audit")
        .arg("--data")
        .arg(data)
        .args(args)
        .env("CANARYGATE_LOG", "warn")
        .output()
        .expect("run canarygate audit")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `audit export` parsed: every record, in chain order.
fn export(data: &Path) -> Vec<Value> {
    let output = audit(data, &["export"]);
    assert!(
        output.status.success(),
        "audit export failed: {}",
        text(&output.stderr)
    );
    text(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect()
}

/// Request records of `audit export`, by request id (each id must appear once).
fn requests_by_id(data: &Path) -> HashMap<String, Value> {
    let mut by_id = HashMap::new();
    for record in export(data) {
        if record["kind"] == "request" {
            let id = record["request_id"].as_str().expect("request_id").to_owned();
            assert!(
                by_id.insert(id.clone(), record).is_none(),
                "request id {id} recorded twice"
            );
        }
    }
    by_id
}

/// Asserts that `audit verify` exits 0 and returns its output.
fn assert_verifies(data: &Path) -> String {
    let output = audit(data, &["verify"]);
    assert!(
        output.status.success(),
        "audit verify failed (status {:?}): {}{}",
        output.status,
        text(&output.stdout),
        text(&output.stderr)
    );
    text(&output.stdout)
}

/// Asserts that the server answers `GET /healthz` with 200.
async fn assert_healthy(client: &reqwest::Client, proxy: &Running) {
    let response = client
        .get(format!("{}/healthz", proxy.url))
        .send()
        .await
        .expect("healthz");
    assert_eq!(response.status(), 200, "healthz after start");
}

/// A small xorshift generator: the test needs varied delays, not secure ones.
struct Rng(u64);

impl Rng {
    fn seeded() -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        Self(nanos | 1)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// One chat request of the load; `Some(request_id)` when the client received
/// a complete answer (a 200 JSON body with choices, or a stream ending in
/// `data: [DONE]`), `None` for anything else (the server was killed).
async fn one_request(
    client: &reqwest::Client,
    url: &str,
    task: usize,
    n: usize,
    stream: bool,
) -> Option<String> {
    let mut request = client
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth("sk-crash-test")
        .json(&json!({
            "model": "sim-model",
            "stream": stream,
            "max_tokens": 24,
            "messages": [{"role": "user", "content": format!("task {task} request {n}: summarise the ledger entries of the day")}],
        }));
    if task % 3 == 0 {
        request = request.header("x-canarygate-session", format!("job-{task}"));
    }
    let response = request.send().await.ok()?;
    if response.status() != 200 {
        return None;
    }
    let request_id = response
        .headers()
        .get("x-canarygate-request-id")?
        .to_str()
        .ok()?
        .to_owned();
    let body = response.text().await.ok()?;
    let complete = if stream {
        body.trim_end().ends_with("data: [DONE]")
    } else {
        serde_json::from_str::<Value>(&body)
            .ok()
            .is_some_and(|answer| answer["choices"][0]["message"]["content"].is_string())
    };
    complete.then_some(request_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_answers_survive_sigkill_under_load() {
    const ROUNDS: usize = 4;
    const TASKS: usize = 24;
    // Streams take a little while, so kills also land mid-stream.
    let sim = start_sim(&["--decode-tps", "400"]);
    let dir = ProxyDir::new();
    let data = dir.data();
    let client = client();
    let mut rng = Rng::seeded();
    let seed = rng.0;
    let mut acknowledged: Vec<String> = Vec::new();
    let mut incomplete = 0;
    for round in 0..ROUNDS {
        // Starts cleanly on the data dir the previous round's SIGKILL left behind.
        let mut proxy = start_proxy(&dir, &sim.url);
        assert_healthy(&client, &proxy).await;
        let stop = Arc::new(AtomicBool::new(false));
        let tasks: Vec<_> = (0..TASKS)
            .map(|task| {
                let (client, url, stop) = (client.clone(), proxy.url.clone(), stop.clone());
                tokio::spawn(async move {
                    let (mut done, mut failed) = (Vec::new(), 0);
                    // Bounded: a task stops at its first failure (the kill) or at `stop`.
                    for n in 0..10_000 {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let stream = (task + n) % 2 == 0;
                        match one_request(&client, &url, task, n, stream).await {
                            Some(id) => done.push(id),
                            None => {
                                failed += 1;
                                break;
                            }
                        }
                    }
                    (done, failed)
                })
            })
            .collect();
        let delay = 200 + rng.below(601);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        proxy.kill(); // SIGKILL, mid-load
        stop.store(true, Ordering::Relaxed);
        let mut round_done = 0;
        for task in tasks {
            let (done, failed) = tokio::time::timeout(Duration::from_secs(30), task)
                .await
                .expect("client task ended after the kill")
                .expect("client task");
            round_done += done.len();
            incomplete += failed;
            acknowledged.extend(done);
        }
        assert!(
            round_done > 0,
            "round {round} (seed {seed}, kill after {delay} ms): no answer completed"
        );
        // The CLI opens the store left by SIGKILL (repairing it) and the chain holds.
        assert_verifies(&data);
        let records = requests_by_id(&data);
        for id in &acknowledged {
            let record = records.get(id).unwrap_or_else(|| {
                panic!("round {round} (seed {seed}): answered request {id} has no record")
            });
            assert_eq!(record["outcome"], "complete", "{record}");
            assert_eq!(record["verdict"], "pass", "{record}");
        }
        eprintln!(
            "round {round}: SIGKILL after {delay} ms, {round_done} complete answers, \
             {} records in the log",
            records.len()
        );
    }
    let unique: HashSet<_> = acknowledged.iter().collect();
    assert_eq!(unique.len(), acknowledged.len(), "request ids repeat");
    // A last clean start after the final kill, and the chain still verifies.
    let proxy = start_proxy(&dir, &sim.url);
    assert_healthy(&client, &proxy).await;
    assert!(
        one_request(&client, &proxy.url, 1, 0, true).await.is_some(),
        "serve answers after the last restart"
    );
    drop(proxy);
    let verified = assert_verifies(&data);
    eprintln!(
        "seed {seed}: {} acknowledged answers all recorded, {incomplete} cut by kills; {verified}",
        acknowledged.len()
    );
}
