//! The audit log as `canarygate serve` writes it: real server and simulated
//! provider processes, real sockets, the real data directory, read back with
//! the `canarygate audit` CLI.
//!
//! - `acknowledged_answers_survive_sigkill_under_load`: every answer a client
//!   received in full has its durable record, across SIGKILLs and restarts.
//! - `records_carry_what_the_client_saw`: field by field, for a verified
//!   non-stream answer, a stream, a blocked answer and a client that left.
//! - `requests_abandoned_before_the_answer_are_recorded`: a client that gives
//!   up while the provider is still prefilling still leaves a record.
//! - `spot_check_walkthrough_runs`: `examples/spot-check/walkthrough.sh`.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use canarygate_audit::sha256_hex;
use serde_json::{Value, json};

use crate::common::{
    ProxyDir, Running, chat_body, client, start_proxy, start_proxy_with_policy, start_sim,
};

/// Runs `canarygate audit --data DIR <args>`.
fn audit(data: &Path, args: &[&str]) -> Output {
    Command::new(crate::common::binary())
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
            let id = record["request_id"]
                .as_str()
                .expect("request_id")
                .to_owned();
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

/// One chat request of the load; `Some((request_id, SHA-256 of the body))`
/// when the client received a complete answer (a 200 JSON body with choices, or a stream ending in
/// `data: [DONE]`), `None` for anything else (the server was killed).
async fn one_request(
    client: &reqwest::Client,
    url: &str,
    task: usize,
    n: usize,
    stream: bool,
) -> Option<(String, String)> {
    let mut request = client
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth("sk-crash-test")
        .json(&json!({
            "model": "sim-model",
            "stream": stream,
            "max_tokens": 24,
            "messages": [{"role": "user", "content": format!("task {task} request {n}: summarise the ledger entries of the day")}],
        }));
    if task.is_multiple_of(3) {
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
    let body = response.bytes().await.ok()?;
    let body = String::from_utf8(body.to_vec()).ok()?;
    let complete = if stream {
        body.trim_end().ends_with("data: [DONE]")
    } else {
        serde_json::from_str::<Value>(&body)
            .ok()
            .is_some_and(|answer| answer["choices"][0]["message"]["content"].is_string())
    };
    complete.then(|| (request_id, sha256_hex(body.as_bytes())))
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
    // (request id, SHA-256 of the body the client received)
    let mut acknowledged: Vec<(String, String)> = Vec::new();
    let mut incomplete = 0;
    // Odd rounds restart serve right after the kill, so serve itself opens
    // (and repairs) the file SIGKILL left; even rounds let the CLI open it first.
    let mut restarted: Option<Running> = None;
    for round in 0..ROUNDS {
        // Starts cleanly on the data dir the previous round's SIGKILL left behind.
        let mut proxy = match restarted.take() {
            Some(proxy) => proxy,
            None => start_proxy(&dir, &sim.url),
        };
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
        if round % 2 == 1 {
            let proxy = start_proxy(&dir, &sim.url);
            assert_healthy(&client, &proxy).await;
            restarted = Some(proxy);
        }
        // The store left by SIGKILL opens (the CLI repairs it unless serve
        // already did, and reads it alongside serve) and the chain holds.
        assert_verifies(&data);
        let records = requests_by_id(&data);
        for (id, sha256) in &acknowledged {
            let record = records.get(id).unwrap_or_else(|| {
                panic!("round {round} (seed {seed}): answered request {id} has no record")
            });
            assert_eq!(record["outcome"], "complete", "{record}");
            assert_eq!(record["verdict"], "pass", "{record}");
            assert_eq!(record["response_sha256"], sha256.as_str(), "{record}");
        }
        eprintln!(
            "round {round}: SIGKILL after {delay} ms, {round_done} complete answers, \
             {} records in the log",
            records.len()
        );
    }
    let unique: HashSet<_> = acknowledged.iter().map(|(id, _)| id).collect();
    assert_eq!(unique.len(), acknowledged.len(), "request ids repeat");
    // The restart after the final kill serves, and the chain still verifies.
    let proxy = restarted
        .take()
        .unwrap_or_else(|| start_proxy(&dir, &sim.url));
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

/// A policy routing model `honest` to `honest`, `truncating` to `truncating`
/// and `slow` to `slow` (three simulated providers), verification as in the
/// default preset.
fn three_provider_policy(dir: &ProxyDir, honest: &str, truncating: &str, slow: &str) -> PathBuf {
    let mut text = String::new();
    for (name, url) in [
        ("honest", honest),
        ("truncating", truncating),
        ("slow", slow),
    ] {
        text.push_str(&format!(
            "[[providers]]\nname = \"{name}\"\nbase_url = \"{url}/v1\"\ncontext_window = 128000\n\n\
             [[routes]]\nmodel = \"{name}\"\nprovider = \"{name}\"\n\n"
        ));
    }
    text.push_str(
        "[verify]\necho = \"head+tail\"\nrelease = \"echo-first\"\naction = \"block\"\n\
         estimate_min_ratio = 0.25\nttft_min_prompt_tokens = 4096\n",
    );
    dir.policy(&text)
}

/// What the client got back from one request.
struct Answer {
    status: u16,
    request_id: String,
    session: String,
    body: Vec<u8>,
}

async fn send(client: &reqwest::Client, url: &str, model: &str, stream: bool) -> Answer {
    let response = client
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(API_KEY)
        .header("x-canarygate-session", "nightly-report")
        .json(&json!({
            "model": model,
            "stream": stream,
            "messages": [{"role": "user", "content": "List three facts about the ledger of the day."}],
        }))
        .send()
        .await
        .expect("request");
    let header = |name: &str| {
        response.headers()[name]
            .to_str()
            .expect("header text")
            .to_owned()
    };
    let (request_id, session) = (
        header("x-canarygate-request-id"),
        header("x-canarygate-session"),
    );
    let status = response.status().as_u16();
    let body = response.bytes().await.expect("body").to_vec();
    Answer {
        status,
        request_id,
        session,
        body,
    }
}

/// The client's API key; it must not appear anywhere in the data directory.
const API_KEY: &str = "sk-audit-serve-7f3a9c1e5b";

/// Whether `haystack` holds a canary value (`CG` in any case and 15
/// digits, as canarygate writes it into prompts), raw or in JSON.
fn holds_canary_value(haystack: &[u8]) -> bool {
    haystack.windows(17).any(|window| {
        window[..2].eq_ignore_ascii_case(b"CG") && window[2..].iter().all(u8::is_ascii_digit)
    })
}

/// Every file under `dir`, at any depth.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files
}

/// Asserts the fields every verified, forwarded, complete record carries.
fn assert_verified_record(record: &Value, answer: &Answer, model: &str) {
    assert_eq!(record["request_id"], answer.request_id.as_str(), "{record}");
    assert_eq!(record["session"], answer.session.as_str(), "{record}");
    assert_eq!(record["provider"], model, "{record}");
    assert_eq!(record["model"], model, "{record}");
    assert_eq!(record["route"], "upstream", "{record}");
    assert!(
        record["prompt_tokens_ours"].as_u64().unwrap() > 0,
        "{record}"
    );
    assert!(
        record["prompt_tokens_provider"].as_u64().unwrap() > 0,
        "{record}"
    );
    let canaries = record["canary_ids"].as_array().expect("canary_ids");
    assert_eq!(canaries.len(), 2, "head and tail canaries: {record}");
    for id in canaries {
        let id = id.as_str().unwrap();
        assert!(
            !id.is_empty() && id.bytes().all(|b| b.is_ascii_hexdigit()),
            "canary id {id}"
        );
    }
    let checks: HashMap<&str, &str> = record["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .map(|check| {
            (
                check["name"].as_str().unwrap(),
                check["result"].as_str().unwrap(),
            )
        })
        .collect();
    let names: HashSet<&str> = checks.keys().copied().collect();
    assert_eq!(
        names,
        HashSet::from(["echo", "foreign_canary", "prompt_tokens", "ttft", "finish"]),
        "{record}"
    );
    assert_eq!(checks["echo"], "pass", "{record}");
    assert_eq!(checks["foreign_canary"], "pass", "{record}");
    assert_eq!(checks["finish"], "pass", "{record}");
    assert!(
        checks.values().all(|r| ["pass", "skip"].contains(r)),
        "{record}"
    );
    assert_eq!(record["verdict"], "pass", "{record}");
    assert_eq!(record["action"], "forward", "{record}");
    assert_eq!(record["outcome"], "complete", "{record}");
    assert_eq!(
        record["bytes_out"].as_u64().unwrap(),
        answer.body.len() as u64,
        "{record}"
    );
    assert!(!answer.body.is_empty());
    assert_eq!(
        record["response_sha256"],
        sha256_hex(&answer.body).as_str(),
        "response_sha256 is the hash of the bytes the client received: {record}"
    );
    let latency = &record["latency"];
    assert!(latency["ttfb_ms"].is_u64(), "{record}");
    assert!(latency["total_ms"].is_u64(), "{record}");
    assert!(latency["overhead_ms"].is_u64(), "{record}");
    assert!(
        latency["total_ms"].as_u64() >= latency["ttfb_ms"].as_u64(),
        "{record}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_carry_what_the_client_saw() {
    // The scanner below finds canary values in both spellings.
    assert!(holds_canary_value(b"{\"x\":\"CG482937105662831\"}"));
    assert!(holds_canary_value(b"cg482937105662831"));
    assert!(!holds_canary_value(b"CG12 and ledger-entry 2024"));
    let honest = start_sim(&[]);
    let truncating = start_sim(&["--mode", "truncate-head"]);
    let slow = start_sim(&["--decode-tps", "20"]);
    let dir = ProxyDir::new();
    let data = dir.data();
    let policy = three_provider_policy(&dir, &honest.url, &truncating.url, &slow.url);
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let client = client();

    let whole = send(&client, &proxy.url, "honest", false).await;
    assert_eq!(whole.status, 200, "{}", text(&whole.body));
    let streamed = send(&client, &proxy.url, "honest", true).await;
    assert_eq!(streamed.status, 200);
    assert!(text(&streamed.body).trim_end().ends_with("data: [DONE]"));
    assert_eq!(
        whole.session, streamed.session,
        "same key and label, same session"
    );

    // Blocked: the provider dropped the head of the prompt, so the echo fails.
    let blocked = send(&client, &proxy.url, "truncating", false).await;
    assert_eq!(blocked.status, 502, "{}", text(&blocked.body));

    // A client that leaves mid-stream.
    let response = client
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth(API_KEY)
        .json(&json!({
            "model": "slow",
            "stream": true,
            "messages": [{"role": "user", "content": "Restate this slowly: ".to_owned() + &"ledger entry ".repeat(60)}],
        }))
        .send()
        .await
        .expect("slow request");
    assert_eq!(response.status(), 200);
    let left_id = response.headers()["x-canarygate-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    let mut response = response;
    let first = tokio::time::timeout(Duration::from_secs(20), response.chunk())
        .await
        .expect("first chunk in time")
        .expect("first chunk")
        .expect("stream not over yet");
    assert!(!first.is_empty());
    drop(response); // the client goes away mid-stream

    // The interrupted record is appended from a guard once the body is dropped.
    let deadline = Instant::now() + Duration::from_secs(15);
    let records = loop {
        let records = requests_by_id(&data);
        if records.contains_key(&left_id) || Instant::now() > deadline {
            break records;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let left = records
        .get(&left_id)
        .unwrap_or_else(|| panic!("no record for the client that left ({left_id})"));
    assert_eq!(left["outcome"], "interrupted_by_client", "{left}");
    assert_eq!(left["provider"], "slow", "{left}");
    assert_eq!(left["request_id"], left_id.as_str(), "{left}");
    assert!(left["bytes_out"].as_u64().unwrap() > 0, "{left}");

    assert_verified_record(&records[&whole.request_id], &whole, "honest");
    assert_verified_record(&records[&streamed.request_id], &streamed, "honest");

    let record = &records[&blocked.request_id];
    assert_eq!(
        record["request_id"],
        blocked.request_id.as_str(),
        "{record}"
    );
    assert_eq!(record["verdict"], "fail", "{record}");
    assert_eq!(record["action"], "block", "{record}");
    assert!(
        record["checks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|check| check["name"] == "echo" && check["result"] == "fail"),
        "{record}"
    );
    assert!(
        record["sample"].is_object(),
        "failed verdicts are sampled: {record}"
    );
    assert_eq!(
        record["response_sha256"],
        sha256_hex(&blocked.body).as_str(),
        "{record}"
    );
    // `audit show` prints the record and its sample text, with no canary value.
    let show = audit(&data, &["show", &record["id"].to_string()]);
    assert!(show.status.success(), "{}", text(&show.stderr));
    let shown = text(&show.stdout);
    assert!(shown.contains(&blocked.request_id), "{shown}");
    assert!(shown.contains("--- request text ---"), "{shown}");
    assert!(shown.contains("--- response text ---"), "{shown}");
    assert!(shown.contains("List three facts"), "{shown}");
    assert!(!holds_canary_value(shown.as_bytes()), "{shown}");

    let exported = text(&audit(&data, &["export"]).stdout);
    assert!(!holds_canary_value(exported.as_bytes()), "{exported}");
    assert_verifies(&data);

    // Nothing under the data directory holds the client's key or a canary value,
    // while serve runs and after it stopped.
    drop(proxy);
    let mut scanned = 0;
    for path in files_under(&data) {
        let bytes = std::fs::read(&path).expect("read data file");
        scanned += bytes.len();
        assert!(
            !bytes
                .windows(API_KEY.len())
                .any(|w| w == API_KEY.as_bytes()),
            "{} holds the client API key",
            path.display()
        );
        assert!(
            !holds_canary_value(&bytes),
            "{} holds a canary value",
            path.display()
        );
    }
    assert!(scanned > 0, "the data directory holds the store");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spot_check_walkthrough_runs() {
    let work = tempfile::tempdir().expect("tempdir");
    let log = work.path().join("walkthrough.log");
    let script = crate::common::workspace_root().join("examples/spot-check/walkthrough.sh");
    let mut child = Command::new("bash")
        .arg(&script)
        .env("CANARYGATE_BIN", env!("CARGO_BIN_EXE_canarygate"))
        .env("WORK_DIR", work.path().join("run"))
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&log).expect("log file"))
        .stderr(std::fs::File::create(work.path().join("stderr.log")).expect("log file"))
        .spawn()
        .expect("run walkthrough.sh");
    // Bounded wait: the script takes a few seconds.
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("walkthrough.sh still running after 90 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let out = std::fs::read_to_string(&log).expect("log");
    let err = std::fs::read_to_string(work.path().join("stderr.log")).unwrap_or_default();
    assert!(
        status.success(),
        "walkthrough failed ({status}):\n{out}\n{err}"
    );

    let count = |needle: &str| out.matches(needle).count();
    assert_eq!(count("status 200 request cg-"), 3, "{out}");
    assert_eq!(count("status 502 request cg-"), 1, "{out}");
    assert!(out.contains("4 records exported"), "{out}");
    assert!(out.contains("ok: 4 records verified"), "{out}");
    assert_eq!(count(" pass cg-"), 3, "unreviewed list: {out}");
    assert_eq!(count(" fail cg-"), 1, "unreviewed list: {out}");
    assert_eq!(count(" marked ok: review record "), 3, "{out}");
    assert_eq!(count(" marked bad: review record "), 1, "{out}");
    assert!(out.contains("unreviewed samples left: 0"), "{out}");
    assert!(out.contains("ok: 8 records verified"), "{out}");
    assert!(out.contains("requests: 4 (4 sampled)"), "{out}");
    assert!(out.contains("review: bad 1, ok 3"), "{out}");
    assert!(out.contains("verdict: fail 1, pass 3"), "{out}");
    assert!(
        !holds_canary_value(out.as_bytes()),
        "samples shown are redacted: {out}"
    );

    // The script stopped what it started: the proxy no longer answers.
    assert!(out.contains("stopped 3 processes"), "{out}");
    let proxy = out
        .lines()
        .find_map(|line| line.strip_prefix("proxy: "))
        .and_then(|rest| rest.split_whitespace().next())
        .expect("proxy URL line");
    let gone = client()
        .get(format!("{proxy}/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(gone.is_err(), "the proxy still runs after the script ended");
    // Its data directory holds the chain the script built, reviews included.
    assert!(assert_verifies(&work.path().join("run/data")).starts_with("ok: 8 records verified"));
}

/// Number of `request` records in the log.
fn request_count(data: &Path) -> usize {
    export(data)
        .iter()
        .filter(|record| record["kind"] == "request")
        .count()
}

/// A client that gives up before the provider's first byte (here: a slow
/// prefill) leaves no answer to record, but the request must still be
/// recorded, whole or streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_abandoned_before_the_answer_are_recorded() {
    // 600 prompt tokens at 200 tokens/s: the first byte comes after ~3 s.
    let sim = start_sim(&["--prefill-tps", "200"]);
    let dir = ProxyDir::new();
    let data = dir.data();
    let proxy = start_proxy(&dir, &sim.url);
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .expect("client");
    for stream in [false, true] {
        let before = request_count(&data);
        let result = impatient
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth(API_KEY)
            .json(&json!({
                "model": "sim-model",
                "stream": stream,
                "messages": [{"role": "user", "content": "ledger entry ".repeat(300)}],
            }))
            .send()
            .await;
        assert!(
            result.is_err(),
            "the client gave up before the answer (stream={stream})"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while request_count(&data) == before && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            request_count(&data),
            before + 1,
            "abandoned request (stream={stream}) has no record"
        );
        let records = export(&data);
        let last = records.last().expect("a record");
        assert_eq!(last["outcome"], "interrupted_by_client", "{last}");
        assert_eq!(last["bytes_out"], 0, "{last}");
        assert_eq!(last["verdict"], "unchecked", "{last}");
        assert_eq!(last["action"], "forward", "{last}");
        if !stream {
            // (A stream's response head comes before the prefill, so it has a ttfb.)
            assert!(last["latency"]["ttfb_ms"].is_null(), "{last}");
        }
    }
    assert_verifies(&data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_durability_records_every_request_shortly_after_its_answer() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let policy = dir.policy(&format!(
        r#"
[[providers]]
name = "sim"
base_url = "{}/v1"
context_window = 128000

[[routes]]
model = "*"
provider = "sim"

[audit]
durability = "background"
"#,
        sim.url
    ));
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let client = client();
    for index in 0..20 {
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("sk-background")
            .json(&chat_body(
                "m",
                &format!("question {index}"),
                index % 2 == 0,
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while request_count(&dir.data()) < 20 {
        assert!(Instant::now() < deadline, "background records did not land");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(request_count(&dir.data()), 20);
    assert_verifies(&dir.data());
}
