//! Verification end to end: every failure mode of the simulated provider,
//! streamed and not, under both release policies. Through canarygate no
//! answer carrying another request's content is ever delivered.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use canarygate_policies::EchoCost;
use canarygate_policies::tokens::count_text;
use serde_json::{Value, json};

use crate::common::*;

/// What the client got for one request.
#[derive(Debug)]
struct Outcome {
    status: u16,
    /// The content delivered to the client (streams: concatenated deltas).
    content: String,
    /// For streams: whether it ended with `[DONE]`.
    done: bool,
    /// Error code, from a JSON error body or a stream's error event.
    error_code: Option<String>,
    /// `x-canarygate-verdict`.
    verdict: Option<String>,
    /// The body as the client got it.
    body: String,
}

fn policy(dir: &ProxyDir, upstream: &str, release: &str, action: &str) -> std::path::PathBuf {
    let verify = format!("[verify]\nrelease = \"{release}\"\naction = \"{action}\"\n");
    verified_policy(dir, upstream, &verify)
}

/// A policy with an OpenAI provider and an Anthropic one (for model
/// `claude-sim`), both at `upstream`.
fn two_apis_policy(dir: &ProxyDir, upstream: &str) -> std::path::PathBuf {
    dir.policy(&format!(
        r#"
[[providers]]
name = "openai"
base_url = "{upstream}/v1"
context_window = 1048576

[[providers]]
name = "anthropic"
api = "anthropic"
base_url = "{upstream}/v1"
context_window = 100000

[[routes]]
model = "claude-sim"
provider = "anthropic"

[[routes]]
model = "*"
provider = "openai"
"#
    ))
}

/// A request asking `text` of an API by its `path` under [`two_apis_policy`]:
/// Chat, legacy completions, Responses (model `gpt-sim`) or Messages
/// (`claude-sim`, `max_tokens` 200).
fn api_body(path: &str, text: &str, stream: bool) -> Value {
    match path {
        "/v1/chat/completions" => json!({"model": "gpt-sim", "stream": stream,
            "messages": [{"role": "user", "content": text}]}),
        "/v1/completions" => json!({"model": "gpt-sim", "stream": stream, "prompt": text}),
        "/v1/responses" => json!({"model": "gpt-sim", "stream": stream, "input": text}),
        _ => json!({"model": "claude-sim", "max_tokens": 200, "stream": stream,
                    "messages": [{"role": "user", "content": text}]}),
    }
}

/// Sends `body` to `path` of the proxy at `url`, with what either API's
/// clients send (a bearer key, Anthropic's version header).
async fn send_api(
    client: &reqwest::Client,
    url: &str,
    path: &str,
    body: &Value,
) -> reqwest::Response {
    client
        .post(format!("{url}{path}"))
        .bearer_auth("sk-e2e")
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .expect("request")
}

/// A unique word for request `index`: survives the sim's tokenizer whole.
fn marker(index: usize) -> String {
    format!("zq{index:05}")
}

/// A user message of roughly `words` words that names its marker.
fn prompt(index: usize, words: usize) -> String {
    let marker = marker(index);
    let mut text = format!("{marker} {marker} asks:");
    for word in 0..words {
        text.push_str(if word % 7 == 0 { " ledger" } else { " entry" });
    }
    text
}

async fn ask(client: &reqwest::Client, url: &str, text: &str, stream: bool) -> Outcome {
    let body = json!({
        "model": "sim-model",
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    });
    ask_body(client, url, &body).await
}

/// What the client got for the Chat request `body`.
async fn ask_body(client: &reqwest::Client, url: &str, body: &Value) -> Outcome {
    let stream = body["stream"] == true;
    let response = client
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth("sk-e2e")
        .json(body)
        .send()
        .await
        .expect("request");
    let status = response.status().as_u16();
    let verdict = response
        .headers()
        .get("x-canarygate-verdict")
        .map(|value| value.to_str().unwrap().to_owned());
    let body = response.text().await.expect("body");
    if stream && status == 200 {
        let events = sse_data(&body);
        let error_code = events
            .iter()
            .filter_map(|data| serde_json::from_str::<Value>(data).ok())
            .find_map(|event| event["error"]["code"].as_str().map(str::to_owned));
        Outcome {
            status,
            content: stream_content(&body),
            done: events.last().is_some_and(|data| data == "[DONE]"),
            error_code,
            verdict,
            body,
        }
    } else {
        let value: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        Outcome {
            status,
            content: value["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            done: status == 200,
            error_code: value["error"]["code"].as_str().map(str::to_owned),
            verdict,
            body,
        }
    }
}

/// Markers of other requests found in `content`.
fn foreign_markers(content: &str, own: usize) -> Vec<String> {
    let own = marker(own);
    content
        .split(|c: char| !c.is_alphanumeric())
        .filter(|word| word.len() == 7 && word.starts_with("zq") && *word != own)
        .map(str::to_owned)
        .collect::<HashSet<_>>()
        .into_iter()
        .collect()
}

/// Asserts the client-visible guarantees for one outcome and returns whether
/// the answer was delivered whole.
fn check(outcome: &Outcome, index: usize, context: &str) -> bool {
    let foreign = foreign_markers(&outcome.content, index);
    assert!(
        foreign.is_empty(),
        "{context}: request {index} was delivered another request's text {foreign:?}: {outcome:?}"
    );
    assert!(
        !holds_canary(&outcome.content),
        "{context}: a canary reached the client: {outcome:?}"
    );
    let delivered = outcome.status == 200 && outcome.done && outcome.error_code.is_none();
    if !delivered {
        assert!(
            matches!(outcome.status, 502 | 504) || (outcome.status == 200 && !outcome.done),
            "{context}: a failed answer is a 502, a 504 or a stream ending in an error: {outcome:?}"
        );
        assert!(outcome.error_code.is_some(), "{context}: {outcome:?}");
    }
    delivered
}

/// Runs `rounds` requests per (stream, release) against a sim in `mode`;
/// `prepare` sends priming traffic first. Returns (delivered, failed) counts
/// per combination.
async fn run_mode(mode_args: &[&str], prompt_words: usize, expect_all_fail: bool) {
    let sim = start_sim(mode_args);
    let client = client();
    let mut next_index = 0;
    for release in ["echo-first", "verdict-first"] {
        let dir = ProxyDir::new();
        let proxy = start_proxy_with_policy(&dir, &policy(&dir, &sim.url, release, "block"), &[]);
        for stream in [false, true] {
            for _ in 0..4 {
                let index = next_index;
                next_index += 1;
                let outcome = ask(&client, &proxy.url, &prompt(index, prompt_words), stream).await;
                let context = format!("{mode_args:?} release={release} stream={stream}");
                let delivered = check(&outcome, index, &context);
                if expect_all_fail {
                    assert!(!delivered, "{context}: must be blocked: {outcome:?}");
                    if outcome.status == 502 {
                        assert_eq!(
                            outcome.error_code.as_deref(),
                            Some("canarygate_verification_failed"),
                            "{context}"
                        );
                    }
                }
            }
        }
    }
}

#[tokio::test]
async fn truncated_prompts_are_blocked() {
    run_mode(&["--mode", "truncate-head"], 30, true).await;
    run_mode(&["--mode", "truncate-tail"], 30, true).await;
}

#[tokio::test]
async fn swapped_answers_are_blocked_and_never_delivered() {
    // The first request has nothing to swap with; every later one gets the
    // previous request's answer and must be blocked.
    let sim = start_sim(&["--mode", "swap"]);
    let client = client();
    let mut index = 0;
    for release in ["echo-first", "verdict-first"] {
        let dir = ProxyDir::new();
        let proxy = start_proxy_with_policy(&dir, &policy(&dir, &sim.url, release, "block"), &[]);
        for stream in [false, true] {
            for _ in 0..4 {
                let outcome = ask(&client, &proxy.url, &prompt(index, 20), stream).await;
                let context = format!("swap release={release} stream={stream}");
                let delivered = check(&outcome, index, &context);
                if index > 0 {
                    assert!(!delivered, "{context}: {outcome:?}");
                    // Under echo-first a failed echo sends nothing at all.
                    assert_eq!(outcome.status, 502, "{context}: {outcome:?}");
                }
                index += 1;
            }
        }
    }
}

#[tokio::test]
async fn cut_streams_end_in_an_error_and_cut_bodies_are_502() {
    let sim = start_sim(&["--mode", "cut"]);
    let client = client();
    for release in ["echo-first", "verdict-first"] {
        let dir = ProxyDir::new();
        let proxy = start_proxy_with_policy(&dir, &policy(&dir, &sim.url, release, "block"), &[]);
        for stream in [false, true] {
            let outcome = ask(&client, &proxy.url, &prompt(7, 40), stream).await;
            let context = format!("cut release={release} stream={stream}");
            assert!(!check(&outcome, 7, &context), "{context}: {outcome:?}");
            if stream && release == "verdict-first" {
                assert_eq!(outcome.status, 502, "{context}: nothing before the verdict");
            }
            if stream && release == "echo-first" {
                // Either the echo passed and verified text went out, then the
                // explicit error; or the cut came first and nothing went out.
                assert_eq!(
                    outcome.error_code.as_deref(),
                    Some("upstream_stream_interrupted"),
                    "{context}: {outcome:?}"
                );
                let content = &outcome.content;
                if outcome.status == 200 {
                    assert!(
                        "You wrote:".starts_with(content.as_str())
                            || content.starts_with("You wrote:"),
                        "{context}: only verified text: {outcome:?}"
                    );
                } else {
                    assert_eq!(outcome.status, 502, "{context}: {outcome:?}");
                }
            }
        }
    }
}

#[tokio::test]
async fn leak_on_overflow_is_blocked_and_honest_requests_pass() {
    // Pool and window in the incident's ratio: 681,280 / 1,048,576.
    let sim = start_sim(&[
        "--mode",
        "leak-on-overflow",
        "--context-window",
        "4096",
        "--pool-tokens",
        "2661",
    ]);
    let client = client();
    let mut index = 0;
    for release in ["echo-first", "verdict-first"] {
        let dir = ProxyDir::new();
        let proxy = start_proxy_with_policy(&dir, &policy(&dir, &sim.url, release, "block"), &[]);
        for stream in [false, true] {
            for round in 0..6 {
                // Alternate prompts that fit the pool with prompts that do not.
                let over_pool = round % 2 == 1;
                let words = if over_pool { 3000 } else { 200 };
                let outcome = ask(&client, &proxy.url, &prompt(index, words), stream).await;
                let context =
                    format!("leak release={release} stream={stream} over_pool={over_pool}");
                let delivered = check(&outcome, index, &context);
                if over_pool {
                    assert!(!delivered, "{context}: {outcome:?}");
                    assert_eq!(
                        outcome.status, 502,
                        "{context}: the echo fails first: {outcome:?}"
                    );
                } else {
                    assert!(delivered, "{context}: false alarm: {outcome:?}");
                    assert_eq!(
                        outcome.verdict.as_deref().map(|v| v.starts_with("p")),
                        Some(true)
                    );
                }
                index += 1;
            }
        }
    }
}

#[tokio::test]
async fn observe_preset_flags_but_delivers() {
    let sim = start_sim(&["--mode", "truncate-head"]);
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &policy(&dir, &sim.url, "echo-first", "flag"), &[]);
    let client = client();
    let outcome = ask(&client, &proxy.url, &prompt(1, 30), false).await;
    assert_eq!(outcome.status, 200, "{outcome:?}");
    let verdict = outcome.verdict.unwrap();
    assert!(
        verdict.starts_with("fail; checks=") && verdict.contains("echo"),
        "{verdict}"
    );
    assert!(!holds_canary(&outcome.content));
}

#[tokio::test]
async fn honest_traffic_raises_no_false_alarm() {
    let sim = start_sim(&[]);
    let client = client();
    let tricky = [
        "Explain this code: ```rust\nfn main() { println!(\"CG-1234\"); }\n```",
        "Is CG-ABCD-EFGH-JKMN-PQRS a valid serial number?",
        "Is CG482937105662831 a valid serial number, or cg 482 937 105 662 830?",
        "ok",
        "Reply with a JSON object describing a cat",
        "Begin your reply with \"hello\" and then count to three",
        "cg 7kq4 m2xd 9pta wv3e is what my label says",
        "Begin your reply with \"CG000000000000001\" and then say hi",
        // A code in square brackets of the client's own, as the tail block
        // is: the echo asks for the head alone.
        "Please file ticket [CG123456789012345]",
        "My tickets were [CG000000000000002] and [CG-77]; which is older?",
    ];
    for release in ["echo-first", "verdict-first"] {
        let dir = ProxyDir::new();
        let proxy = start_proxy_with_policy(&dir, &policy(&dir, &sim.url, release, "block"), &[]);
        for (index, text) in tricky.iter().enumerate() {
            for stream in [false, true] {
                let outcome = ask(&client, &proxy.url, text, stream).await;
                assert!(
                    outcome.status == 200 && outcome.done && outcome.error_code.is_none(),
                    "false alarm on {index} ({release}, stream={stream}): {outcome:?}"
                );
                assert!(!outcome.content.is_empty());
            }
        }
        // JSON mode: passive checks only, and the verdict says so.
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("k")
            .json(&json!({
                "model": "m",
                "response_format": {"type": "json_object"},
                "messages": [{"role": "user", "content": "a JSON cat"}],
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers()["x-canarygate-verdict"],
            "pass; passive=json_mode"
        );
    }
}

#[tokio::test]
async fn stalled_streams_end_in_an_error_under_verification() {
    let sim = start_sim(&["--mode", "stall-mid-stream"]);
    let client = client();
    for release in ["echo-first", "verdict-first"] {
        let dir = ProxyDir::new();
        let text = policy(&dir, &sim.url, release, "block");
        let with_timeouts =
            std::fs::read_to_string(&text).unwrap() + "\n[limits]\nidle_timeout_ms = 400\n";
        let path = dir.policy(&with_timeouts);
        let proxy = start_proxy_with_policy(&dir, &path, &[]);
        for stream in [false, true] {
            let outcome = ask(&client, &proxy.url, &prompt(3, 30), stream).await;
            let context = format!("stall release={release} stream={stream}");
            assert!(!check(&outcome, 3, &context), "{context}: {outcome:?}");
            // A stream that began ends in an error event; one that sent
            // nothing yet is a timeout, as a whole answer's is.
            let expected = if stream && outcome.status == 200 {
                "upstream_stream_interrupted"
            } else {
                "upstream_timeout"
            };
            if stream && release == "verdict-first" {
                assert_eq!(outcome.status, 504, "{context}: {outcome:?}");
            }
            assert_eq!(
                outcome.error_code.as_deref(),
                Some(expected),
                "{context}: {outcome:?}"
            );
        }
    }
}

/// `canarygate serve --config preset:NAME --upstream URL`, as a user starts it.
fn start_preset(dir: &ProxyDir, preset: &str, upstream: &str) -> Running {
    let data = dir.data();
    Running::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data",
            data.to_str().unwrap(),
            "--config",
            &format!("preset:{preset}"),
            "--upstream",
            &format!("{upstream}/v1"),
        ],
        &[],
    )
}

#[tokio::test]
async fn shipped_presets_behave_as_documented() {
    let truncating = start_sim(&["--mode", "truncate-head"]);
    let honest = start_sim(&[]);
    let client = client();
    for (preset, expect_delivered_failure) in
        [("default", false), ("strict", false), ("observe", true)]
    {
        let dir = ProxyDir::new();
        let proxy = start_preset(&dir, preset, &truncating.url);
        for stream in [false, true] {
            let outcome = ask(&client, &proxy.url, &prompt(11, 30), stream).await;
            let context = format!("preset {preset} stream={stream}");
            let delivered = check(&outcome, 11, &context);
            assert_eq!(
                delivered, expect_delivered_failure,
                "{context}: {outcome:?}"
            );
            if preset == "observe" {
                // Flag only: the answer arrives, marked.
                let verdict = outcome.verdict.as_deref().unwrap_or_default();
                if stream {
                    assert_eq!(verdict, "pending; release=echo-first", "{context}");
                } else {
                    assert!(
                        verdict.starts_with("fail; checks=echo"),
                        "{context}: {verdict}"
                    );
                }
            } else {
                assert_eq!(outcome.status, 502, "{context}: {outcome:?}");
            }
        }
        let dir = ProxyDir::new();
        let proxy = start_preset(&dir, preset, &honest.url);
        for stream in [false, true] {
            let outcome = ask(&client, &proxy.url, &prompt(12, 30), stream).await;
            assert!(
                check(&outcome, 12, preset),
                "preset {preset} false alarm: {outcome:?}"
            );
        }
    }
}

#[tokio::test]
async fn retry_action_sends_once_more_with_fresh_canaries_then_blocks() {
    let sim = start_sim(&["--mode", "truncate-tail"]);
    let dir = ProxyDir::new();
    let proxy =
        start_proxy_with_policy(&dir, &policy(&dir, &sim.url, "verdict-first", "retry"), &[]);
    let client = client();
    let stats = |client: reqwest::Client, url: String| async move {
        let stats: Value = client
            .get(format!("{url}/sim/stats"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        stats["requests"].as_u64().unwrap()
    };
    for stream in [false, true] {
        let before = stats(client.clone(), sim.url.clone()).await;
        let outcome = ask(&client, &proxy.url, &prompt(21, 30), stream).await;
        assert_eq!(outcome.status, 502, "{outcome:?}");
        assert_eq!(
            outcome.error_code.as_deref(),
            Some("canarygate_verification_failed")
        );
        let after = stats(client.clone(), sim.url.clone()).await;
        assert_eq!(after - before, 2, "one retry, stream={stream}");
    }
}

#[tokio::test]
async fn canaries_in_flight_survive_a_restart() {
    // A pool of 665 tokens in a 1,024-token window: prompts of ~300 words
    // fit, prompts of ~800 words are answered from stale pages.
    let sim = start_sim(&[
        "--mode",
        "leak-on-overflow",
        "--context-window",
        "1024",
        "--pool-tokens",
        "665",
    ]);
    let client = client();
    let dir = ProxyDir::new();
    let path = policy(&dir, &sim.url, "verdict-first", "block");

    // Before the restart: an honest request whose canaries stay in the pool.
    let mut first = start_proxy_with_policy(&dir, &path, &[]);
    let outcome = ask(&client, &first.url, &prompt(31, 300), false).await;
    assert!(check(&outcome, 31, "before restart"), "{outcome:?}");
    // Canaries are persisted with the next group commit; the record is
    // durable before the answer, so by now both are on disk.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    first.kill();

    // After: an over-pool request gets the stale pages of the first request,
    // canaries included. They are recognised as another request's.
    let second = start_proxy_with_policy(&dir, &path, &[]);
    let outcome = ask(&client, &second.url, &prompt(32, 800), false).await;
    assert!(!check(&outcome, 32, "after restart"), "{outcome:?}");
    let verdict = outcome.verdict.unwrap_or_default();
    assert!(
        verdict.contains("foreign_canary"),
        "the first process's canaries are still known after the restart: {verdict}"
    );
}

/// A tokenizer.json that splits text the way the simulated provider counts:
/// whitespace-separated words, then runs of up to 8 letters or digits, and
/// runs of other characters two stretches a piece (a stretch: one character
/// repeated up to 16 times). `per_char` makes every character a token
/// instead.
fn sim_tokenizer(dir: &std::path::Path, per_char: bool) -> String {
    let pattern = if per_char {
        "."
    } else {
        "[A-Za-z0-9]{1,8}|([^A-Za-z0-9\\s])\\1{0,15}(?:([^A-Za-z0-9\\s])\\2{0,15})?"
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"},
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false}
        ]},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}
    });
    let path = dir.join(if per_char {
        "per-char.json"
    } else {
        "tokenizer.json"
    });
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    path.to_str().unwrap().to_owned()
}

#[tokio::test]
async fn with_the_providers_tokenizer_prompt_tokens_are_checked_exactly() {
    let sim = start_sim(&[]);
    let client = client();
    // The per-character tokenizer, and the sim's own with and without a
    // `tokenizer_digits` that overrides its measure of the echo.
    for (per_char, digits) in [(false, ""), (true, ""), (false, "groups-of-three")] {
        let dir = ProxyDir::new();
        let tokenizer = sim_tokenizer(dir.dir.path(), per_char);
        let digits_line = if digits.is_empty() {
            String::new()
        } else {
            format!("tokenizer_digits = \"{digits}\"")
        };
        let path = dir.policy(&format!(
            r#"
[[providers]]
name = "sim"
base_url = "{}/v1"
context_window = 1048576
tokenizer_file = "{tokenizer}"
{digits_line}

[[routes]]
model = "*"
provider = "sim"
"#,
            sim.url
        ));
        let proxy = start_proxy_with_policy(&dir, &path, &[]);
        let outcome = ask(&client, &proxy.url, &prompt(41, 60), false).await;
        if per_char {
            // Our exact count is several times what the provider reports: the
            // tight tolerance fails it (the loose estimate floor would not).
            assert_eq!(outcome.status, 502, "{outcome:?}");
            let verdict = outcome.verdict.clone().unwrap_or_default();
            assert_eq!(verdict, "fail; checks=prompt_tokens", "{outcome:?}");
        } else {
            assert!(check(&outcome, 41, "exact count"), "{outcome:?}");
            let record = audit_export(&dir.data()).pop().expect("a record");
            let check = record["checks"]
                .as_array()
                .unwrap()
                .iter()
                .find(|check| check["name"] == "prompt_tokens")
                .unwrap()
                .clone();
            let seen = &check["evidence"]["seen"];
            assert_eq!(check["result"], "pass", "{check}");
            assert_eq!(seen["exact"], true, "{check}");
            assert_eq!(seen["counted"], seen["reported"], "{check}");

            // The echo's allowance is measured by the same tokenizer (or
            // set by `tokenizer_digits`): the provider is asked for the
            // client's 5 tokens and the echo's cost, and the client gets its
            // 5 exactly.
            let answer: Value = client
                .post(format!("{}/v1/chat/completions", proxy.url))
                .bearer_auth("sk-e2e")
                .json(&json!({"model": "sim-model", "max_tokens": 5, "messages": [
                    {"role": "user", "content": prompt(41, 60)}]}))
                .send()
                .await
                .expect("request")
                .json()
                .await
                .expect("an answer");
            let measured = EchoCost::measured(count_text);
            assert_ne!(measured, EchoCost::DIGITS_IN_THREES, "an override shows");
            let allowance = if digits.is_empty() {
                measured.allowance(2)
            } else {
                EchoCost::DIGITS_IN_THREES.allowance(2)
            };
            assert!(
                allowance < EchoCost::DIGIT_BY_DIGIT.allowance(2),
                "{allowance}"
            );
            assert_eq!(
                answer["usage"]["completion_tokens"],
                5 + allowance,
                "{answer}"
            );
            let content = answer["choices"][0]["message"]["content"].as_str().unwrap();
            assert_eq!(count_text(content), 5, "{answer}");
            assert_eq!(answer["choices"][0]["finish_reason"], "length", "{answer}");
        }
    }
}

/// The head canary of the request a provider answered last, which it
/// gives the next: another request's canary, registered and live.
type LastHead = std::sync::Arc<std::sync::Mutex<Option<String>>>;

/// What an obedient model opens its answer to `request` with (the request's
/// texts read wherever its API keeps them), and the head canary of the
/// request before it (empty for the first); this one's is kept for the next.
fn opening_and_earlier(last: &LastHead, request: &Value) -> (String, String) {
    let texts = strings_of(request);
    let opening = canarygate_policies::inject::obedient_opening(texts.iter().map(String::as_str))
        .unwrap_or_default();
    let head = opening.split_whitespace().next().unwrap_or("").to_owned();
    let earlier = last.lock().unwrap().replace(head).unwrap_or_default();
    (opening, earlier)
}

/// A provider whose first chunk holds the echo and text beside a number no
/// JSON tree holds (`1e400`): the chunk must be edited (the echo removed)
/// and cannot be. Returns its base URL.
async fn uneditable_upstream() -> String {
    use axum::{Json, Router, routing::post};
    async fn answer(Json(request): Json<Value>) -> ([(&'static str, &'static str); 1], String) {
        let opening = canarygate_policies::inject::obedient_echo(&request).unwrap_or_default();
        let text = json!(format!("{opening}\nMercury, Venus.")).to_string();
        let events = format!(
            "data: {{\"id\":\"c1\",\"created\":1e400,\"choices\":[{{\"index\":0,\
             \"delta\":{{\"content\":{text}}},\"finish_reason\":null}}]}}\n\n\
             data: {{\"id\":\"c1\",\"choices\":[{{\"index\":0,\"delta\":{{}},\
             \"finish_reason\":\"stop\"}}]}}\n\n\
             data: [DONE]\n\n"
        );
        ([("content-type", "text/event-stream")], events)
    }
    let app = Router::new().route("/v1/chat/completions", post(answer));
    serve_upstream(app).await
}

#[tokio::test]
async fn a_chunk_that_cannot_be_edited_ends_the_stream_in_an_error() {
    let upstream = uneditable_upstream().await;
    let client = client();
    for release in ["echo-first", "verdict-first"] {
        let dir = ProxyDir::new();
        // `flag`: whatever the checks say, the answer would be delivered;
        // what stops it is the chunk.
        let proxy = start_proxy_with_policy(&dir, &policy(&dir, &upstream, release, "flag"), &[]);
        let outcome = ask(&client, &proxy.url, "Name two planets", true).await;
        assert_eq!(outcome.status, 502, "{release}: {outcome:?}");
        assert_eq!(
            outcome.error_code.as_deref(),
            Some("upstream_stream_interrupted"),
            "{release}: {outcome:?}"
        );
        assert!(!outcome.content.contains("Venus"), "{release}: {outcome:?}");
    }
}

/// A provider that fails its stream with its own error event: once text
/// went out (echo-first), that event ends the stream as the provider sent
/// it; before anything went out (verdict-first), it is the answer, with the
/// status it stands for (the sim's `server_error`: 500). Either way it is
/// recorded as the provider's broken stream, not as a failed verification:
/// the verdict passes what was seen, and `finish` is skipped.
#[tokio::test]
async fn a_providers_error_event_reaches_the_client_as_its_own() {
    let sim = start_sim(&["--mode", "overloaded"]);
    let client = client();
    for release in ["echo-first", "verdict-first"] {
        let dir = ProxyDir::new();
        let proxy = start_proxy_with_policy(&dir, &policy(&dir, &sim.url, release, "block"), &[]);
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("sk-e2e")
            .json(&json!({"model": "sim-model", "stream": true,
                          "messages": [{"role": "user", "content": prompt(3, 30)}]}))
            .send()
            .await
            .expect("request");
        let status = response.status().as_u16();
        let body = response.text().await.expect("body");
        let error: Value = if release == "echo-first" {
            assert_eq!(status, 200, "{release}: {body}");
            let events = sse_data(&body);
            serde_json::from_str(events.last().expect("an event")).unwrap()
        } else {
            assert_eq!(status, 500, "{release}: {body}");
            serde_json::from_str(&body).unwrap()
        };
        assert_eq!(error["error"]["type"], "server_error", "{release}: {body}");
        assert_eq!(error["error"]["message"], "Overloaded", "{release}: {body}");
        assert!(error["error"]["code"].is_null(), "{release}: {body}");

        let record = audit_export(&dir.data()).pop().expect("a record");
        assert_eq!(record["verdict"], "pass", "{release}: {record}");
        assert_eq!(
            record["outcome"], "interrupted_by_upstream",
            "{release}: {record}"
        );
        let results: Vec<(&str, &str)> = record["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .map(|check| {
                let field = |key: &str| check[key].as_str().unwrap_or_default();
                (field("name"), field("result"))
            })
            .collect();
        assert!(results.contains(&("finish", "skip")), "{release}: {record}");
        assert!(
            results.contains(&("foreign_canary", "pass")),
            "{release}: {record}"
        );
    }
}

/// A provider that streams without a `Content-Type` and says `x-should-retry:
/// false` of every answer: its stream is read as one, and its word on
/// retrying is not put on canarygate's own error (a blocked answer), which
/// SDKs retry by their own rule.
/// An obedient model's stream answering `request` with two planets: the
/// echo and the text, the finish, then `end`.
fn planets_stream(request: &Value, end: &str) -> String {
    let opening = canarygate_policies::inject::obedient_echo(request).unwrap_or_default();
    let text = json!(format!("{opening}\nMercury, Venus.")).to_string();
    format!(
        "data: {{\"id\":\"c1\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{text}}},\
         \"finish_reason\":null}}]}}\n\n\
         data: {{\"id\":\"c1\",\"choices\":[{{\"index\":0,\"delta\":{{}},\
         \"finish_reason\":\"stop\"}}]}}\n\n{end}"
    )
}

async fn terse_upstream() -> String {
    use axum::body::Body;
    use axum::http::Response;
    use axum::{Json, Router, routing::post};
    async fn answer(Json(request): Json<Value>) -> Response<Body> {
        let mut response = if request["stream"] == true {
            Response::new(Body::from(planets_stream(&request, "data: [DONE]\n\n")))
        } else {
            // No echo: blocked.
            let body = json!({"id": "c2", "object": "chat.completion", "choices": [{"index": 0,
                "message": {"role": "assistant", "content": "Mercury, Venus."},
                "finish_reason": "stop"}]});
            let mut response = Response::new(Body::from(body.to_string()));
            response
                .headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            response
        };
        response
            .headers_mut()
            .insert("x-should-retry", "false".parse().unwrap());
        response
    }
    let app = Router::new().route("/v1/chat/completions", post(answer));
    serve_upstream(app).await
}

#[tokio::test]
async fn a_stream_without_a_media_type_is_read_and_canarygates_errors_keep_their_retry_rule() {
    let upstream = terse_upstream().await;
    let client = client();
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &policy(&dir, &upstream, "echo-first", "block"), &[]);
    let streamed = ask(&client, &proxy.url, "Name two planets", true).await;
    assert_eq!(streamed.status, 200, "{streamed:?}");
    assert!(streamed.done, "{streamed:?}");
    assert_eq!(streamed.content, "Mercury, Venus.", "{streamed:?}");
    let blocked = client
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("sk-e2e")
        .json(&json!({"model": "sim-model",
                      "messages": [{"role": "user", "content": "Name two planets"}]}))
        .send()
        .await
        .expect("request");
    assert_eq!(blocked.status(), 502);
    assert!(
        blocked.headers().get("x-should-retry").is_none(),
        "{:?}",
        blocked.headers()
    );
}

/// A model whose chat template refuses a system message (the sim's
/// `sim-systemless`, as Gemma's): a request without one of its own is
/// refused once, for the system message canarygate added, then served with
/// the head canary in its first user message, and the model's later
/// requests go that way at once; with `system_messages = false` it is never
/// refused. A system message the client sent is refused as it would be
/// without canarygate.
#[tokio::test]
async fn a_model_without_a_system_role_is_served_with_the_head_in_the_user_turn() {
    let sim = start_sim(&[]);
    let client = client();
    let rejected = || async { sim_stats(&sim).await["rejected"].as_u64().unwrap() };
    let request = |stream: bool, messages: Value| json!({"model": "sim-systemless", "stream": stream, "messages": messages});
    let user_only = json!([{"role": "user", "content": "Name two planets"}]);
    let served = |outcome: &Outcome| {
        assert_eq!(outcome.status, 200, "{outcome:?}");
        // A stream's verdict comes in its last comment.
        assert!(
            outcome.verdict.as_deref() == Some("pass")
                || outcome.body.contains("\n: x-canarygate-verdict pass\n"),
            "{outcome:?}"
        );
        assert!(outcome.done, "{outcome:?}");
        assert!(
            outcome.content.starts_with("You wrote: Name two planets"),
            "{outcome:?}"
        );
        assert!(!outcome.content.contains("CG"), "{outcome:?}");
    };

    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &verified_policy(&dir, &sim.url, ""), &[]);
    served(&ask_body(&client, &proxy.url, &request(false, user_only.clone())).await);
    assert_eq!(rejected().await, 1, "refused once, then sent again");
    served(&ask_body(&client, &proxy.url, &request(true, user_only.clone())).await);
    assert_eq!(rejected().await, 1, "remembered: not refused again");
    let with_system = json!([{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Name two planets"}]);
    let refused = ask_body(&client, &proxy.url, &request(false, with_system)).await;
    assert_eq!(refused.status, 400, "{refused:?}");
    assert!(
        refused.body.contains("System role not supported"),
        "{refused:?}"
    );
    assert_eq!(
        rejected().await,
        2,
        "the client's own system message: sent once"
    );

    let dir = ProxyDir::new();
    let policy = dir.policy(&format!(
        "[[providers]]\nname = \"sim\"\nbase_url = \"{}/v1\"\ncontext_window = 1048576\n\
         system_messages = false\n\n[[routes]]\nmodel = \"*\"\nprovider = \"sim\"\n",
        sim.url
    ));
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    served(&ask_body(&client, &proxy.url, &request(true, user_only)).await);
    assert_eq!(rejected().await, 2, "never refused");
}

/// A Responses provider whose stream ends with its own `error` event and
/// nothing after (no `response.failed`): after the echo and some text; or,
/// asked about moons, before any text; or, asked about rings, before any
/// text after a pause longer than the keep-alive (a model thinking); or,
/// asked about comets, before any text and then a broken connection.
async fn erring_responses_upstream() -> String {
    use axum::body::{Body, Bytes};
    use axum::response::Response;
    use axum::{Json, Router, routing::post};
    async fn answer(Json(request): Json<Value>) -> Response {
        // The canaries are in the instructions and the input.
        let texts = ["instructions", "input"].map(|key| request[key].as_str().unwrap_or(""));
        let opening = canarygate_policies::inject::obedient_opening(texts).unwrap_or_default();
        let asked = request["input"].as_str().unwrap_or("").to_owned();
        let created = json!({"type": "response.created", "sequence_number": 0,
               "response": {"id": "resp_1", "object": "response", "status": "in_progress",
                            "output": []}});
        let error = |sequence: u64| {
            json!({"type": "error", "sequence_number": sequence, "code": "server_error",
                   "message": "The server had an error.", "param": null})
        };
        let (first, rest) = if ["moons", "rings", "comets"]
            .iter()
            .any(|topic| asked.contains(topic))
        {
            (vec![created], vec![error(1)])
        } else {
            let events = vec![
                created,
                json!({"type": "response.output_text.delta", "sequence_number": 1,
                       "item_id": "m", "output_index": 0, "content_index": 0,
                       "delta": format!("{opening}\n")}),
                json!({"type": "response.output_text.delta", "sequence_number": 2,
                       "item_id": "m", "output_index": 0, "content_index": 0,
                       "delta": "Mercury, Venus."}),
                error(3),
            ];
            (events, Vec::new())
        };
        let pause = Duration::from_millis(if asked.contains("rings") { 800 } else { 0 });
        use futures_util::StreamExt;
        let broken = asked.contains("comets");
        let parts = futures_util::stream::iter([(first, Duration::ZERO), (rest, pause)])
            .then(|(events, pause): (Vec<Value>, Duration)| async move {
                tokio::time::sleep(pause).await;
                Ok(Bytes::from(typed_events(&events)))
            })
            // The break comes once the error event is on the wire.
            .chain(
                futures_util::stream::iter(broken.then_some(())).then(|()| async {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Err(std::io::Error::other("connection lost"))
                }),
            );
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(parts))
            .unwrap()
    }
    let app = Router::new().route("/v1/responses", post(answer));
    serve_upstream(app).await
}

/// A streamed Responses request for `input` through `proxy`.
async fn ask_stream(proxy: &Running, input: &str) -> reqwest::Response {
    client()
        .post(format!("{}/v1/responses", proxy.url))
        .bearer_auth("sk-e2e")
        .json(&json!({"model": "sim-model", "input": input, "stream": true}))
        .send()
        .await
        .expect("request")
}

/// The provider's `error` event, the last it sent, is the stream's end:
/// canarygate adds no error of its own after it (on which the openai SDK
/// would raise, where it does not on the provider's).
#[tokio::test]
async fn a_responses_stream_the_provider_ends_with_its_error_gets_no_second_one() {
    let upstream = erring_responses_upstream().await;
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &policy(&dir, &upstream, "echo-first", "block"), &[]);
    let response = ask_stream(&proxy, "Name two planets").await;
    let status = response.status();
    let body = response.text().await.expect("body");
    assert_eq!(status, 200, "{body}");
    let events: Vec<Value> = sse_data(&body)
        .iter()
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    let last = events.last().expect("events");
    assert_eq!(last["type"], "error", "{body}");
    assert_eq!(last["code"], "server_error", "{body}");
    assert_eq!(
        events
            .iter()
            .filter(|event| event["type"] == "error")
            .count(),
        1,
        "{body}"
    );
    assert!(body.contains("Mercury, Venus."), "{body}");

    // Before anything went out, the provider's error is the answer, with
    // the status its code stands for, in OpenAI's error shape.
    // So too when the connection breaks after it.
    for input in ["Name two moons", "Name two comets"] {
        let response = ask_stream(&proxy, input).await;
        assert_eq!(response.status(), 500, "{input}");
        let error: Value = response.json().await.expect("JSON");
        assert_eq!(error["error"]["code"], "server_error", "{error}");
        assert_eq!(
            error["error"]["message"], "The server had an error.",
            "{error}"
        );
    }

    // After the keep-alive began the stream, its error event ends it.
    let dir = ProxyDir::new();
    let verify = "[verify]\nrelease = \"echo-first\"\n[limits]\nstream_keepalive_ms = 200\n";
    let proxy = start_proxy_with_policy(&dir, &verified_policy(&dir, &upstream, verify), &[]);
    let response = ask_stream(&proxy, "Name two rings").await;
    assert_eq!(response.status(), 200);
    let body = response.text().await.expect("body");
    assert!(body.starts_with(": "), "the keep-alive went first: {body}");
    let events: Vec<Value> = sse_data(&body)
        .iter()
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    assert_eq!(events.len(), 1, "{body}");
    assert_eq!(events[0]["type"], "error", "{body}");
    assert_eq!(events[0]["message"], "The server had an error.", "{body}");
}

/// A provider that answers each request honestly but lists, in a top-level
/// `citations` member of its own (as Perplexity's answers carry), a URL
/// holding the head canary of the request before it; or, asked about moons,
/// in a `source` member of its own beside the choice's message or delta; or,
/// asked about voices, in a spoken reply's transcript (streamed in two
/// pieces that split the canary).
async fn citing_upstream() -> String {
    use axum::extract::State;
    use axum::{Json, Router, routing::post};
    async fn answer(
        State(last): State<LastHead>,
        Json(request): Json<Value>,
    ) -> ([(&'static str, &'static str); 1], String) {
        let (opening, earlier) = opening_and_earlier(&last, &request);
        let source = format!("https://sources.test/{earlier}");
        let text = format!("{opening}\nMercury, Venus.");
        let asked = request.to_string();
        let beside = asked.contains("moons");
        let spoken = asked.contains("voices");
        // Reasoning sent under two names (OpenRouter's `reasoning` and
        // `reasoning_details`), quoting this request's canary split across
        // two deltas (`thoughts`), or with another request's in the details
        // alone (`secrets`); or another request's canary in the content,
        // split around a piece of transcript (`threads`).
        let thoughts = asked.contains("thoughts");
        let secrets = asked.contains("secrets");
        let threads = asked.contains("threads");
        let (citations, source) = if beside {
            (json!([]), json!(source))
        } else if spoken || thoughts || secrets || threads {
            (json!([]), Value::Null)
        } else {
            (json!([source]), Value::Null)
        };
        if request["stream"] == true {
            let chunk = json!({"id": "c1", "citations": citations, "choices": [{"index": 0,
                "delta": {"content": text}, "source": source, "finish_reason": null}]});
            // A spoken reply's transcript, the canary split across two pieces.
            let (first, second) = earlier.split_at(earlier.len() / 2);
            let audio = |transcript: String| {
                json!({"id": "c1", "choices": [{"index": 0,
                    "delta": {"audio": {"id": "audio_1", "transcript": transcript}},
                    "finish_reason": null}]})
            };
            let spoken_chunks = if spoken {
                format!(
                    "data: {}\n\ndata: {}\n\n",
                    audio(format!("say {first}")),
                    audio(second.to_owned())
                )
            } else {
                String::new()
            };
            let thought = |reasoning: String, detail: String| {
                json!({"id": "c1", "choices": [{"index": 0, "delta": {"reasoning": reasoning,
                    "reasoning_details": [{"type": "reasoning.text", "text": detail,
                                           "format": "unknown", "index": 0}]},
                    "finish_reason": null}]})
            };
            let own = opening.split_whitespace().next().unwrap_or("");
            let (own_first, own_second) = own.split_at(own.len() / 2);
            let thinking = if thoughts {
                format!(
                    "data: {}\n\ndata: {}\n\n",
                    thought(
                        format!("I begin with {own_first}"),
                        format!("I begin with {own_first}")
                    ),
                    thought(format!("{own_second}."), format!("{own_second}."))
                )
            } else if secrets {
                format!(
                    "data: {}\n\ndata: {}\n\n",
                    thought("Recall ".into(), format!("Recall {first}")),
                    thought("it.".into(), format!("{second} it."))
                )
            } else {
                String::new()
            };
            let threaded = if threads {
                let around = json!({"id": "c1", "choices": [{"index": 0,
                    "delta": {"content": format!(" and {first}"), "audio": {"transcript": "x"}},
                    "finish_reason": null}]});
                let rest = json!({"id": "c1", "choices": [{"index": 0,
                    "delta": {"content": format!("{second}.")}, "finish_reason": null}]});
                format!("data: {around}\n\ndata: {rest}\n\n")
            } else {
                String::new()
            };
            let end = json!({"id": "c1", "citations": citations, "choices": [{"index": 0,
                "delta": {}, "finish_reason": "stop"}]});
            let body = format!(
                "{thinking}data: {chunk}\n\n{spoken_chunks}{threaded}data: {end}\n\ndata: [DONE]\n\n"
            );
            ([("content-type", "text/event-stream")], body)
        } else {
            let audio = if spoken {
                json!({"id": "audio_1", "transcript": format!("say {earlier}")})
            } else {
                Value::Null
            };
            let body = json!({"id": "c1", "object": "chat.completion", "citations": citations,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                                                     "audio": audio},
                             "source": source, "finish_reason": "stop"}]});
            ([("content-type", "application/json")], body.to_string())
        }
    }
    let last: LastHead = LastHead::default();
    let app = Router::new()
        .route("/v1/chat/completions", post(answer))
        .with_state(last);
    serve_upstream(app).await
}

/// Another request's canary in a member of the provider's own, outside the
/// choices or beside a choice's message, or in a spoken reply's transcript
/// split across chunks, is caught as it is in the text: whole and streamed.
/// So is one split across two chunks of OpenRouter's `reasoning_details`,
/// or of the content around a piece of another text; and this request's
/// own canary quoted in reasoning under two names, split across chunks, is
/// removed from both.
#[tokio::test]
async fn another_requests_canary_outside_the_choices_is_caught() {
    let upstream = citing_upstream().await;
    let client = client();
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &policy(&dir, &upstream, "echo-first", "block"), &[]);
    // The first request has no earlier one to be given.
    let first = ask(&client, &proxy.url, "Name two planets", false).await;
    assert_eq!(first.status, 200, "{first:?}");
    for question in ["Name two planets", "Name two moons", "Name two voices"] {
        for stream in [false, true] {
            let outcome = ask(&client, &proxy.url, question, stream).await;
            // Blocked before anything went out, or (the transcript coming
            // after the released text) the stream ends in the error event.
            let after_text = stream && question.contains("voices");
            let status = if after_text { 200 } else { 502 };
            assert_eq!(
                outcome.status, status,
                "{question}, stream={stream}: {outcome:?}"
            );
            assert!(!outcome.done, "{question}, stream={stream}: {outcome:?}");
            assert_eq!(
                outcome.error_code.as_deref(),
                Some("canarygate_verification_failed"),
                "{question}, stream={stream}: {outcome:?}"
            );
        }
    }
    // The content's split comes in the same read as its start: blocked
    // before anything went out, or the stream ends in the error event.
    for (question, statuses) in [
        ("Name two secrets", &[502][..]),
        ("Name two threads", &[200, 502]),
    ] {
        let outcome = ask(&client, &proxy.url, question, true).await;
        assert!(
            statuses.contains(&outcome.status),
            "{question}: {outcome:?}"
        );
        assert!(!outcome.done, "{question}: {outcome:?}");
        assert_eq!(
            outcome.error_code.as_deref(),
            Some("canarygate_verification_failed"),
            "{question}: {outcome:?}"
        );
    }
    let outcome = ask(&client, &proxy.url, "Name two thoughts", true).await;
    assert!(outcome.done, "{outcome:?}");
    let events: Vec<Value> = sse_data(&outcome.body)
        .iter()
        .filter_map(|data| serde_json::from_str(data).ok())
        .collect();
    let delta = |event: &Value| event["choices"][0]["delta"].clone();
    let reasoning: String = events
        .iter()
        .filter_map(|event| delta(event)["reasoning"].as_str().map(str::to_owned))
        .collect();
    let details: String = events
        .iter()
        .filter_map(|event| {
            delta(event)["reasoning_details"][0]["text"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(reasoning, "I begin with .", "{outcome:?}");
    assert_eq!(details, reasoning, "{outcome:?}");
}

/// A provider whose stream never lets anything out: an event that never
/// ends (`endless` in the prompt), or reasoning deltas without end and no
/// echo. It stops after 80 MiB.
async fn hoarding_upstream() -> String {
    use axum::body::{Body, Bytes};
    use axum::http::Response;
    use axum::{Json, Router, routing::post};
    async fn answer(Json(request): Json<Value>) -> Response<Body> {
        let endless = request.to_string().contains("endless");
        let piece = if endless {
            Bytes::from(vec![b'x'; 1 << 20])
        } else {
            let thought = "y".repeat(1 << 20);
            Bytes::from(format!(
                "data: {{\"id\":\"c1\",\"choices\":[{{\"index\":0,\"delta\":\
                 {{\"reasoning_content\":\"{thought}\"}},\"finish_reason\":null}}]}}\n\n"
            ))
        };
        let opening = Bytes::from_static(b"data: {\"id\":\"c1\",\"x\":\"");
        let pieces = (0..80).map(move |_| piece.clone());
        let body = futures_util::stream::iter(
            std::iter::once(opening)
                .filter(move |_| endless)
                .chain(pieces)
                .map(Ok::<_, std::io::Error>),
        );
        let mut response = Response::new(Body::from_stream(body));
        response
            .headers_mut()
            .insert("content-type", "text/event-stream".parse().unwrap());
        response
    }
    let app = Router::new().route("/v1/chat/completions", post(answer));
    serve_upstream(app).await
}

/// What a stream holds back (for the echo or the verdict, or an event that
/// never ends) is bounded as a whole answer is: past 64 MiB the client gets
/// a 502 `upstream_response_too_large`, not a process that grows until it
/// dies.
#[tokio::test]
async fn a_stream_that_never_lets_anything_out_is_bounded() {
    let upstream = hoarding_upstream().await;
    let client = client();
    for release in ["echo-first", "verdict-first"] {
        let dir = ProxyDir::new();
        let proxy = start_proxy_with_policy(&dir, &policy(&dir, &upstream, release, "block"), &[]);
        for text in ["an endless event", "a long thought"] {
            let outcome = ask(&client, &proxy.url, text, true).await;
            assert_eq!(outcome.status, 502, "{release} {text}: {outcome:?}");
            assert_eq!(
                outcome.error_code.as_deref(),
                Some("upstream_response_too_large"),
                "{release} {text}: {outcome:?}"
            );
        }
    }
}

/// A gateway that answers its error with a 200, as JSON, streamed or not.
async fn error_200_upstream() -> String {
    use axum::{Router, routing::post};
    async fn answer() -> ([(&'static str, &'static str); 1], &'static str) {
        (
            [("content-type", "application/json")],
            r#"{"error": {"message": "The server had an error while processing your request.", "type": "server_error", "param": null, "code": null}}"#,
        )
    }
    let app = Router::new().route("/v1/chat/completions", post(answer));
    serve_upstream(app).await
}

/// A provider's error answered with a 200 reaches the client as the
/// provider's error, with the status its type stands for (`server_error`:
/// 500, which SDKs retry as they would direct), not as a failed check.
#[tokio::test]
async fn a_providers_error_with_a_200_is_its_error_not_a_failed_check() {
    let upstream = error_200_upstream().await;
    let client = client();
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &policy(&dir, &upstream, "echo-first", "block"), &[]);
    for stream in [false, true] {
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("sk-e2e")
            .json(&json!({"model": "sim-model", "stream": stream,
                          "messages": [{"role": "user", "content": "Name two planets"}]}))
            .send()
            .await
            .expect("request");
        assert_eq!(response.status(), 500, "stream {stream}");
        let error: Value = response.json().await.expect("a JSON error");
        assert_eq!(error["error"]["type"], "server_error", "{error}");
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|message| message.starts_with("The server had an error")),
            "{error}"
        );
    }
}

/// A provider whose stream ends right after `data: [DONE]` and its line
/// end, with no blank line: the SDKs take it as ended.
async fn curt_upstream() -> String {
    use axum::{Json, Router, routing::post};
    async fn answer(Json(request): Json<Value>) -> ([(&'static str, &'static str); 1], String) {
        let events = planets_stream(&request, "data: [DONE]\n");
        ([("content-type", "text/event-stream")], events)
    }
    let app = Router::new().route("/v1/chat/completions", post(answer));
    serve_upstream(app).await
}

#[tokio::test]
async fn a_stream_whose_last_event_lacks_its_blank_line_ends_whole() {
    let upstream = curt_upstream().await;
    let client = client();
    for release in ["echo-first", "verdict-first"] {
        let dir = ProxyDir::new();
        let proxy = start_proxy_with_policy(&dir, &policy(&dir, &upstream, release, "block"), &[]);
        let outcome = ask(&client, &proxy.url, "Name two planets", true).await;
        assert_eq!(outcome.status, 200, "{release}: {outcome:?}");
        assert!(outcome.done, "{release}: {outcome:?}");
        assert_eq!(outcome.error_code, None, "{release}: {outcome:?}");
        assert_eq!(outcome.content, "Mercury, Venus.", "{release}: {outcome:?}");
    }
}

/// The Accept-Encoding the compressing gateway last saw.
static SEEN_ACCEPT_ENCODING: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

/// A gateway that compresses whatever it is asked: its answer says
/// `content-encoding: gzip`.
async fn compressing_upstream() -> String {
    use axum::http::HeaderMap;
    use axum::{Router, routing::post};
    async fn answer(
        headers: HeaderMap,
        body: String,
    ) -> (
        axum::http::StatusCode,
        [(&'static str, &'static str); 3],
        &'static str,
    ) {
        *SEEN_ACCEPT_ENCODING.lock().unwrap() = headers
            .get("accept-encoding")
            .map(|value| value.to_str().unwrap().to_owned())
            .unwrap_or_default();
        // Over its rate limit when asked about limits.
        let status = if body.contains("limits") {
            axum::http::StatusCode::TOO_MANY_REQUESTS
        } else {
            axum::http::StatusCode::OK
        };
        (
            status,
            [
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
                ("retry-after", "1"),
            ],
            "\u{1f}\u{8b} not JSON",
        )
    }
    let app = Router::new().route("/v1/chat/completions", post(answer));
    serve_upstream(app).await
}

/// canarygate asks providers for no compression (it reads every answer);
/// one that compresses anyway gets a clear 502, not garbled bytes or a
/// misleading "invalid JSON".
#[tokio::test]
async fn a_compressed_answer_is_refused_clearly_and_none_is_asked_for() {
    let upstream = compressing_upstream().await;
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &policy(&dir, &upstream, "echo-first", "block"), &[]);
    for stream in [false, true] {
        let response = client()
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("sk-e2e")
            .json(&json!({"model": "sim-model", "stream": stream,
                          "messages": [{"role": "user", "content": "Name two planets"}]}))
            .send()
            .await
            .expect("request");
        assert_eq!(response.status(), 502, "stream {stream}");
        let error: Value = response.json().await.expect("a JSON error");
        assert_eq!(error["error"]["code"], "upstream_error", "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("Content-Encoding `gzip`"), "{message}");
        assert_eq!(*SEEN_ACCEPT_ENCODING.lock().unwrap(), "identity");
    }
    // A compressed error keeps its status and retry hints.
    let limited = client()
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("sk-e2e")
        .json(&json!({"model": "sim-model",
                      "messages": [{"role": "user", "content": "What are your limits?"}]}))
        .send()
        .await
        .expect("request");
    assert_eq!(limited.status(), 429);
    assert_eq!(limited.headers()["retry-after"], "1");
}

/// A provider that opens its stream, then sends keep-alive comments every
/// 100 ms and never an event.
async fn keep_alive_upstream() -> String {
    use axum::body::{Body, Bytes};
    use axum::http::Response;
    use axum::{Router, routing::post};
    async fn answer() -> Response<Body> {
        let ticks = tokio_stream_ticks();
        let mut response = Response::new(Body::from_stream(ticks));
        response
            .headers_mut()
            .insert("content-type", "text/event-stream".parse().unwrap());
        response
    }
    fn tokio_stream_ticks() -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send
    {
        futures_util::stream::unfold((), |()| async {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            Some((Ok(Bytes::from_static(b": keep-alive\n\n")), ()))
        })
    }
    let app = Router::new().route("/v1/chat/completions", post(answer));
    serve_upstream(app).await
}

/// Keep-alives do not stand for an answer: a stream with nothing but them
/// ends by the request's first-byte deadline with a 504, though each
/// comment comes well within the idle timeout.
#[tokio::test]
async fn a_stream_of_keep_alives_alone_ends_by_the_first_byte_deadline() {
    let upstream = keep_alive_upstream().await;
    let dir = ProxyDir::new();
    let policy_path = verified_policy(
        &dir,
        &upstream,
        "[limits]\nfirst_byte_timeout_ms = 1500\nidle_timeout_ms = 5000\n",
    );
    let proxy = start_proxy_with_policy(&dir, &policy_path, &[]);
    let started = std::time::Instant::now();
    let outcome = ask(&client(), &proxy.url, "Name two planets", true).await;
    assert_eq!(outcome.status, 504, "{outcome:?}");
    assert_eq!(outcome.error_code.as_deref(), Some("upstream_timeout"));
    let waited = started.elapsed();
    assert!(
        waited < std::time::Duration::from_secs(4),
        "ended by the first-byte deadline, not the idle timeout: {waited:?}"
    );
}

/// `events` as an SSE body, each named by its `type` (as Messages and
/// Responses streams name theirs).
fn typed_events(events: &[Value]) -> String {
    events
        .iter()
        .map(|data| {
            format!(
                "event: {}\ndata: {data}\n\n",
                data["type"].as_str().unwrap()
            )
        })
        .collect()
}

/// Every string of `value`, in order.
fn strings_of(value: &Value) -> Vec<String> {
    match value {
        Value::String(text) => vec![text.clone()],
        Value::Array(items) => items.iter().flat_map(strings_of).collect(),
        Value::Object(members) => members.values().flat_map(strings_of).collect(),
        _ => Vec::new(),
    }
}

/// A provider that streams the echo and its answer in the first text block
/// (Messages) or content part (Responses), then the second half of the
/// previous request's canary in a second one, then the first half back in
/// the first: an SDK joins the blocks by index, and shows the canary whole.
async fn reordering_upstream() -> String {
    use axum::extract::State;
    use axum::http::Uri;
    use axum::{Json, Router, routing::post};
    async fn answer(
        State(last): State<LastHead>,
        uri: Uri,
        Json(request): Json<Value>,
    ) -> ([(&'static str, &'static str); 1], String) {
        let (opening, earlier) = opening_and_earlier(&last, &request);
        let (first, second) = earlier.split_at(earlier.len() / 2);
        let body = typed_events(&if uri.path().ends_with("/messages") {
            let start = |index: u64| {
                json!({"type": "content_block_start", "index": index,
                                            "content_block": {"type": "text", "text": ""}})
            };
            let delta = |index: u64, text: String| {
                json!({"type": "content_block_delta",
                "index": index, "delta": {"type": "text_delta", "text": text}})
            };
            vec![
                json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
                    "role": "assistant", "model": "m", "content": [], "stop_reason": null,
                    "usage": {"input_tokens": 50, "output_tokens": 1}}}),
                start(0),
                delta(0, format!("{opening}\nParis is the capital.")),
                start(1),
                delta(1, format!("{second} end.")),
                delta(0, format!(" Ref {first}")),
                json!({"type": "content_block_stop", "index": 1}),
                json!({"type": "content_block_stop", "index": 0}),
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {"output_tokens": 30}}),
                json!({"type": "message_stop"}),
            ]
        } else {
            let delta = |content_index: u64, text: String| {
                json!({
                "type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
                "content_index": content_index, "delta": text})
            };
            let part = |content_index: u64| {
                json!({"type": "response.content_part.added",
                "item_id": "msg_1", "output_index": 0, "content_index": content_index,
                "part": {"type": "output_text", "text": "", "annotations": []}})
            };
            let response = |status: &str| {
                json!({"id": "resp_1", "object": "response",
                "status": status, "output": [], "usage": null})
            };
            vec![
                json!({"type": "response.created", "response": response("in_progress")}),
                json!({"type": "response.output_item.added", "output_index": 0,
                       "item": {"type": "message", "id": "msg_1", "role": "assistant",
                                "status": "in_progress", "content": []}}),
                part(0),
                delta(0, format!("{opening}\nParis is the capital.")),
                part(1),
                delta(1, format!("{second} end.")),
                delta(0, format!(" Ref {first}")),
                json!({"type": "response.completed", "response": response("completed")}),
            ]
        });
        ([("content-type", "text/event-stream")], body)
    }
    let last: LastHead = LastHead::default();
    let app = Router::new()
        .route("/v1/messages", post(answer))
        .route("/v1/responses", post(answer))
        .with_state(last);
    serve_upstream(app).await
}

/// A text sent back to a block or content part the stream had already
/// left ends the stream: the verifier reads a stream's texts in the order
/// they come, SDKs join them by index, so the two would read different
/// texts (here, another request's canary cut in two and put together
/// again).
#[tokio::test]
async fn a_text_sent_back_to_an_earlier_block_ends_the_stream() {
    let upstream = reordering_upstream().await;
    let client = client();
    let dir = ProxyDir::new();
    let policy = two_apis_policy(&dir, &upstream);
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    for path in ["/v1/messages", "/v1/responses"] {
        let body = api_body(path, "Capital of France?", true);
        // The first request primes the provider with a canary to give the
        // second.
        for attempt in 0..2 {
            let response = send_api(&client, &proxy.url, path, &body).await;
            let status = response.status().as_u16();
            let text = response.text().await.expect("body");
            let ended = text.contains("message_stop") || text.contains("response.completed");
            assert!(
                [200, 502].contains(&status) && !ended,
                "{path}, attempt {attempt}: {status} {text}"
            );
            assert!(
                text.contains("already left"),
                "{path}, attempt {attempt}: the reason is said: {text}"
            );
        }
    }
}

/// A provider that answers every API with the echo and a short text, and
/// puts the previous request's head canary where canarygate cannot edit
/// it: in a member's name (`place:name` in the prompt) or in the finish
/// reason (`place:finish`: Chat's and completions' `finish_reason`, Messages'
/// `stop_reason`, a response's `status`); or, in a Chat stream, split
/// across two chunks' pieces of a delta's field canarygate does not know
/// (`place:split`), which SDKs join.
async fn renaming_upstream() -> String {
    use axum::extract::State;
    use axum::http::Uri;
    use axum::{Json, Router, routing::post};
    async fn answer(
        State(last): State<LastHead>,
        uri: Uri,
        Json(request): Json<Value>,
    ) -> ([(&'static str, &'static str); 1], String) {
        let (opening, earlier) = opening_and_earlier(&last, &request);
        let asked = request.to_string();
        let named = asked.contains("place:name") && !earlier.is_empty();
        let finish = |normal: &str| {
            if asked.contains("place:finish") && !earlier.is_empty() {
                format!("{normal} {earlier}")
            } else {
                normal.to_owned()
            }
        };
        let text = format!("{opening}\nParis.");
        let stream = request["stream"] == true;
        let path = uri.path();
        let mut extra = serde_json::Map::new();
        if named {
            extra.insert(format!("x_{earlier}"), json!(1));
        }
        let extra = Value::Object(extra);
        let merge = |mut value: Value| {
            for (key, inner) in extra.as_object().unwrap() {
                value[key] = inner.clone();
            }
            value
        };
        let sse = |events: Vec<Value>, done: bool| {
            let mut body: String = events
                .iter()
                .map(|data| match data["type"].as_str() {
                    Some(kind) => format!("event: {kind}\ndata: {data}\n\n"),
                    None => format!("data: {data}\n\n"),
                })
                .collect();
            if done {
                body.push_str("data: [DONE]\n\n");
            }
            body
        };
        let body = if path.ends_with("/chat/completions") {
            let usage = json!({"prompt_tokens": 60, "completion_tokens": 20, "total_tokens": 80});
            if stream {
                let chunk = |delta: Value, finish: Value| {
                    json!({"id": "c1", "object": "chat.completion.chunk", "model": "m",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
                };
                let mut events = vec![
                    chunk(json!({"role": "assistant", "content": ""}), Value::Null),
                    merge(chunk(json!({"content": text}), Value::Null)),
                ];
                if asked.contains("place:split") {
                    let (first, second) = earlier.split_at(earlier.len() / 2);
                    events.push(chunk(
                        json!({"x_note": format!("see {first}")}),
                        Value::Null,
                    ));
                    events.push(chunk(
                        json!({"x_note": format!("{second} end")}),
                        Value::Null,
                    ));
                }
                events.push(chunk(json!({}), json!(finish("stop"))));
                events.push(json!({"id": "c1", "choices": [], "usage": usage}));
                sse(events, true)
            } else {
                json!({"id": "c1", "object": "chat.completion", "model": "m",
                       "choices": [{"index": 0,
                                    "message": merge(json!({"role": "assistant", "content": text})),
                                    "finish_reason": finish("stop")}],
                       "usage": usage})
                .to_string()
            }
        } else if path.ends_with("/completions") {
            let choice = |text: &str, finish: Value| {
                merge(json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}))
            };
            let answer = |choices: Value| {
                json!({"id": "c1", "object": "text_completion", "model": "m", "choices": choices,
                       "usage": {"prompt_tokens": 60, "completion_tokens": 20,
                                 "total_tokens": 80}})
            };
            if stream {
                sse(
                    vec![
                        answer(json!([choice(&text, Value::Null)])),
                        answer(json!([choice("", json!(finish("stop")))])),
                    ],
                    true,
                )
            } else {
                answer(json!([choice(&text, json!(finish("stop")))])).to_string()
            }
        } else if path.ends_with("/responses") {
            let response = |status: String, output: Value| {
                json!({"id": "resp_1", "object": "response", "status": status, "output": output,
                       "usage": {"input_tokens": 60, "output_tokens": 20, "total_tokens": 80}})
            };
            let part = merge(json!({"type": "output_text", "text": text, "annotations": []}));
            let item = json!({"type": "message", "id": "msg_1", "role": "assistant",
                              "status": "completed", "content": [part]});
            if stream {
                let delta = json!({"type": "response.output_text.delta", "item_id": "msg_1",
                                   "output_index": 0, "content_index": 0, "delta": text});
                sse(
                    vec![
                        json!({"type": "response.created",
                               "response": response("in_progress".into(), json!([]))}),
                        json!({"type": "response.output_item.added", "output_index": 0,
                               "item": {"type": "message", "id": "msg_1", "role": "assistant",
                                        "status": "in_progress", "content": []}}),
                        merge(delta),
                        json!({"type": "response.completed",
                               "response": response(finish("completed"), json!([item]))}),
                    ],
                    false,
                )
            } else {
                response(finish("completed"), json!([item])).to_string()
            }
        } else {
            let block = merge(json!({"type": "text", "text": text}));
            if stream {
                sse(
                    vec![
                        json!({"type": "message_start", "message": {"id": "msg_1",
                               "type": "message", "role": "assistant", "model": "m",
                               "content": [], "stop_reason": null,
                               "usage": {"input_tokens": 60, "output_tokens": 1}}}),
                        json!({"type": "content_block_start", "index": 0,
                               "content_block": {"type": "text", "text": ""}}),
                        json!({"type": "content_block_delta", "index": 0,
                               "delta": {"type": "text_delta", "text": text}}),
                        json!({"type": "content_block_stop", "index": 0}),
                        merge(json!({"type": "message_delta",
                                     "delta": {"stop_reason": finish("end_turn")},
                                     "usage": {"output_tokens": 20}})),
                        json!({"type": "message_stop"}),
                    ],
                    false,
                )
            } else {
                json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                       "content": [block], "stop_reason": finish("end_turn"),
                       "usage": {"input_tokens": 60, "output_tokens": 20}})
                .to_string()
            }
        };
        let kind = if stream {
            "text/event-stream"
        } else {
            "application/json"
        };
        ([("content-type", kind)], body)
    }
    let last: LastHead = LastHead::default();
    let app = Router::new()
        .route("/v1/chat/completions", post(answer))
        .route("/v1/completions", post(answer))
        .route("/v1/responses", post(answer))
        .route("/v1/messages", post(answer))
        .with_state(last);
    serve_upstream(app).await
}

/// Another request's canary where canarygate cannot edit it (a member's
/// name) or in a finish reason fails the answer, in every API, whole and
/// streamed, and so does one split across a Chat stream's pieces of a field
/// canarygate does not know: the client never sees it.
#[tokio::test]
async fn another_requests_canary_in_a_name_or_a_finish_fails_the_answer() {
    let upstream = renaming_upstream().await;
    let client = client();
    let dir = ProxyDir::new();
    let policy = two_apis_policy(&dir, &upstream);
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let send = |path: &'static str, text: &str, stream: bool| {
        let body = api_body(path, text, stream);
        let (client, url) = (&client, &proxy.url);
        async move {
            let response = send_api(client, url, path, &body).await;
            let status = response.status().as_u16();
            let verdict = response
                .headers()
                .get("x-canarygate-verdict")
                .map(|value| value.to_str().unwrap().to_owned());
            (status, verdict, response.text().await.expect("body"))
        }
    };
    // The first request has no earlier one to be given; an honest answer.
    let (status, verdict, body) = send("/v1/chat/completions", "Capital?", false).await;
    assert_eq!(status, 200, "{verdict:?} {body}");
    let mut failures = Vec::new();
    for path in [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
    ] {
        for place in ["name", "finish", "split"] {
            if path == "/v1/completions" && place == "name" {
                // Read by the same code as Chat's choices.
                continue;
            }
            for stream in [false, true] {
                if place == "split" && !(stream && path == "/v1/chat/completions") {
                    continue;
                }
                let case = format!("{path} {place} stream={stream}");
                let asked = format!("Capital? place:{place}");
                let (status, verdict, body) = send(path, &asked, stream).await;
                // Blocked before anything went out, or (the place coming
                // after the released text) the stream ends in the error event.
                let failed = if stream && status == 200 {
                    body.contains("canarygate_verification_failed")
                } else {
                    status == 502 && verdict.is_some_and(|v| v.contains("foreign_canary"))
                };
                if holds_canary(&body) || !failed {
                    failures.push(format!("{case}: {status} {body}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A provider whose whole answer, after the echo, is `words` (from the
/// prompt: `words: N`) and counts `usage: N` completion tokens, the echo's
/// among them.
async fn counting_upstream() -> String {
    use axum::{Json, Router, routing::post};
    async fn answer(Json(request): Json<Value>) -> ([(&'static str, &'static str); 1], String) {
        let opening = canarygate_policies::inject::obedient_echo(&request).unwrap_or_default();
        let asked = request["messages"].to_string();
        let number = |key: &str| -> usize {
            let at = asked.find(key).unwrap() + key.len();
            asked[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .unwrap()
        };
        let text = vec!["Internationalisation"; number("words: ")].join(" ");
        let usage = json!({"prompt_tokens": 90, "completion_tokens": number("usage: "),
                           "total_tokens": 90 + number("usage: ")});
        if request["stream"] != true {
            let answer = json!({"id": "c1", "object": "chat.completion", "model": "gpt-4o",
                "choices": [{"index": 0, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": format!("{opening}\n{text}")}}],
                "usage": usage});
            return ([("content-type", "application/json")], answer.to_string());
        }
        // Streamed: reasoning first (`thoughts: N` pieces of it), then the
        // text a word a chunk, then the usage OpenAI sends last.
        let chunk = |delta: Value, finish: Value| {
            let chunk = json!({"id": "c1", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
            format!("data: {chunk}\n\n")
        };
        let mut body = String::new();
        for _ in 0..number("thoughts: ") {
            body.push_str(&chunk(
                json!({"reasoning_content": "Considering "}),
                Value::Null,
            ));
        }
        body.push_str(&chunk(
            json!({"content": format!("{opening}\n")}),
            Value::Null,
        ));
        for (position, word) in text.split(' ').enumerate() {
            let word = if position == 0 {
                word.to_owned()
            } else {
                format!(" {word}")
            };
            body.push_str(&chunk(json!({"content": word}), Value::Null));
        }
        body.push_str(&chunk(json!({}), json!("stop")));
        let last = json!({"id": "c1", "object": "chat.completion.chunk", "choices": [],
                          "usage": usage});
        body.push_str(&format!("data: {last}\n\ndata: [DONE]\n\n"));
        ([("content-type", "text/event-stream")], body)
    }
    serve_upstream(Router::new().route("/v1/chat/completions", post(answer))).await
}

/// A whole answer the provider counts within the client's `max_tokens` once
/// the echo's tokens (13 for two canaries in OpenAI's tokenizers, 12 at
/// least) are taken out reaches the client whole, though the estimate counts
/// it over the limit; one the provider counts over the limit is cut. So
/// does a stream, its reasoning counted against the limit too: text the
/// count as it goes would cut waits for the provider's count at the end.
#[tokio::test]
async fn an_answer_within_the_limit_but_for_its_echo_is_not_cut() {
    let upstream = counting_upstream().await;
    let client = client();
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &policy(&dir, &upstream, "echo-first", "block"), &[]);
    let words = 12;
    let text = vec!["Internationalisation"; words].join(" ");
    let limit = count_text(&text) - 2;
    for (usage, cut) in [(limit + 12, false), (limit + 13, true)] {
        let answer: Value = client
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("sk-e2e")
            .json(
                &json!({"model": "gpt-4o", "max_tokens": limit, "messages": [
                {"role": "user", "content": format!("words: {words}, usage: {usage}")}]}),
            )
            .send()
            .await
            .expect("request")
            .json()
            .await
            .expect("an answer");
        let choice = &answer["choices"][0];
        let content = choice["message"]["content"].as_str().unwrap();
        if cut {
            assert!(content.len() < text.len(), "{answer}");
            assert_eq!(choice["finish_reason"], "length", "{answer}");
        } else {
            assert_eq!(content, text, "{answer}");
            assert_eq!(choice["finish_reason"], "stop", "{answer}");
        }
    }
    // Streamed after 20 pieces of reasoning, 80 tokens by the estimate (as
    // the content's 12 words are 84), against a limit of 100: the count as
    // it goes would cut the content after a few words.
    let limit = 100;
    for (usage, cut) in [(limit + 12, false), (limit + 13, true)] {
        let body = client
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("sk-e2e")
            .json(
                &json!({"model": "gpt-4o", "max_tokens": limit, "stream": true,
                "messages": [{"role": "user",
                    "content": format!("words: {words}, usage: {usage}, thoughts: 20")}]}),
            )
            .send()
            .await
            .expect("request")
            .text()
            .await
            .expect("a stream");
        let content = stream_content(&body);
        let finish = sse_data(&body)
            .iter()
            .filter_map(|data| serde_json::from_str::<Value>(data).ok())
            .find_map(|chunk| {
                chunk["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_owned)
            });
        if cut {
            assert!(content.len() < text.len(), "{body}");
            assert_eq!(finish.as_deref(), Some("length"), "{body}");
        } else {
            assert_eq!(content, text, "{body}");
            assert_eq!(finish.as_deref(), Some("stop"), "{body}");
        }
    }
}

/// A provider that streams a Messages or Responses answer: the echo, then
/// `words: N` words one event each, and `usage: N` output tokens at the end.
async fn counting_stream_upstream() -> String {
    use axum::http::Uri;
    use axum::{Json, Router, routing::post};
    async fn answer(
        uri: Uri,
        Json(request): Json<Value>,
    ) -> ([(&'static str, &'static str); 1], String) {
        let texts = strings_of(&request);
        let opening =
            canarygate_policies::inject::obedient_opening(texts.iter().map(String::as_str))
                .unwrap_or_default();
        let asked = request.to_string();
        let number = |key: &str| -> usize {
            let at = asked.find(key).unwrap() + key.len();
            asked[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .unwrap()
        };
        let mut pieces = vec![format!("{opening}\n")];
        for position in 0..number("words: ") {
            let space = if position == 0 { "" } else { " " };
            pieces.push(format!("{space}Internationalisation"));
        }
        let usage = number("usage: ");
        let text: String = pieces.concat();
        let events: Vec<Value> = if uri.path().ends_with("/messages") {
            let mut events = vec![
                json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
                       "role": "assistant", "model": "claude-sim", "content": [],
                       "stop_reason": null, "usage": {"input_tokens": 90, "output_tokens": 1}}}),
                json!({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "text", "text": ""}}),
            ];
            events.extend(pieces.iter().map(|piece| {
                json!({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": piece}})
            }));
            events.extend([
                json!({"type": "content_block_stop", "index": 0}),
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {"output_tokens": usage}}),
                json!({"type": "message_stop"}),
            ]);
            events
        } else {
            let part = |text: &str| json!({"type": "output_text", "text": text, "annotations": []});
            let item = |status: &str, content: Value| {
                json!({"type": "message", "id": "msg_1", "role": "assistant", "status": status,
                       "content": content})
            };
            let place = json!({"item_id": "msg_1", "output_index": 0, "content_index": 0});
            let with = |kind: &str, more: Value| {
                let mut event = place.clone();
                event["type"] = json!(kind);
                for (key, value) in more.as_object().unwrap() {
                    event[key] = value.clone();
                }
                event
            };
            let response = |status: &str, output: Value, usage: Value| {
                json!({"id": "resp_1", "object": "response", "status": status,
                       "output": output, "usage": usage})
            };
            let mut events = vec![
                json!({"type": "response.created",
                       "response": response("in_progress", json!([]), Value::Null)}),
                json!({"type": "response.output_item.added", "output_index": 0,
                       "item": item("in_progress", json!([]))}),
                with("response.content_part.added", json!({"part": part("")})),
            ];
            events.extend(
                pieces
                    .iter()
                    .map(|piece| with("response.output_text.delta", json!({"delta": piece}))),
            );
            events.extend([
                with("response.output_text.done", json!({"text": text})),
                with("response.content_part.done", json!({"part": part(&text)})),
                json!({"type": "response.output_item.done", "output_index": 0,
                       "item": item("completed", json!([part(&text)]))}),
                json!({"type": "response.completed", "response": response("completed",
                       json!([item("completed", json!([part(&text)]))]),
                       json!({"input_tokens": 90, "output_tokens": usage,
                              "total_tokens": 90 + usage}))}),
            ]);
            events
        };
        (
            [("content-type", "text/event-stream")],
            typed_events(&events),
        )
    }
    let app = Router::new()
        .route("/v1/messages", post(answer))
        .route("/v1/responses", post(answer));
    serve_upstream(app).await
}

/// A Messages or Responses stream that the provider counts within the
/// client's limit reaches the client whole, though the count as it goes
/// would cut it (the text waits for the provider's count at the end); one
/// the provider counts over the limit is cut.
#[tokio::test]
async fn a_messages_or_responses_stream_within_the_limit_is_not_cut() {
    let upstream = counting_stream_upstream().await;
    let client = client();
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &two_apis_policy(&dir, &upstream), &[]);
    let words = 12;
    let text = vec!["Internationalisation"; words].join(" ");
    // Below the estimate's count of the text (84), at or above the
    // provider's.
    let limit = count_text(&text) - 4;
    for (path, delta_type) in [
        ("/v1/messages", "content_block_delta"),
        ("/v1/responses", "response.output_text.delta"),
    ] {
        for (usage, cut) in [(limit, false), (limit + 40, true)] {
            let mut body = api_body(path, &format!("words: {words}, usage: {usage}"), true);
            if path == "/v1/messages" {
                body["max_tokens"] = json!(limit);
            } else {
                // A model whose tokenizer the echo's cost is known in.
                body["model"] = json!("gpt-4o");
                body["max_output_tokens"] = json!(limit);
            }
            let body = send_api(&client, &proxy.url, path, &body)
                .await
                .text()
                .await
                .expect("a stream");
            let delivered: String = sse_data(&body)
                .iter()
                .filter_map(|data| serde_json::from_str::<Value>(data).ok())
                .filter(|event| event["type"] == delta_type)
                .filter_map(|event| {
                    let piece = event["delta"]["text"].as_str().or(event["delta"].as_str());
                    piece.map(str::to_owned)
                })
                .collect();
            if cut {
                assert!(delivered.len() < text.len(), "{path}: {body}");
            } else {
                assert_eq!(delivered, text, "{path}: {body}");
            }
        }
    }
}

/// A provider whose errors quote the previous request's canary: a 400
/// (whole), or an error event after the answer began (streamed).
async fn quoting_error_upstream() -> String {
    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::{Json, Router, routing::post};
    async fn answer(
        State(last): State<LastHead>,
        Json(request): Json<Value>,
    ) -> (StatusCode, [(&'static str, &'static str); 1], String) {
        let (opening, earlier) = opening_and_earlier(&last, &request);
        let error = json!({"error": {"message": format!("Invalid content: 'Recall {earlier}'"),
                                     "type": "invalid_request_error", "param": "messages",
                                     "code": null}});
        if request["stream"] == true {
            let chunk = json!({"id": "c1", "choices": [{"index": 0,
                "delta": {"content": format!("{opening}\nMercury, Venus.")},
                "finish_reason": null}]});
            let body = format!("data: {chunk}\n\ndata: {error}\n\n");
            (
                StatusCode::OK,
                [("content-type", "text/event-stream")],
                body,
            )
        } else {
            let status = StatusCode::BAD_REQUEST;
            (
                status,
                [("content-type", "application/json")],
                error.to_string(),
            )
        }
    }
    let last: LastHead = LastHead::default();
    let app = Router::new()
        .route("/v1/chat/completions", post(answer))
        .with_state(last);
    serve_upstream(app).await
}

/// A provider's error that quotes canary-shaped text (here another
/// request's canary) reaches the client with that text withheld, its status
/// and type kept: whole, and as an error event after the answer began.
#[tokio::test]
async fn a_providers_error_quoting_a_canary_is_withheld() {
    let upstream = quoting_error_upstream().await;
    let client = client();
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &policy(&dir, &upstream, "echo-first", "block"), &[]);
    // The first request has no earlier one to be given.
    ask(&client, &proxy.url, "Name two planets", false).await;
    for stream in [false, true] {
        let outcome = ask(&client, &proxy.url, "Name two planets", stream).await;
        assert!(!holds_canary(&outcome.body), "stream={stream}: {outcome:?}");
        assert_eq!(
            outcome.status,
            if stream { 200 } else { 400 },
            "{outcome:?}"
        );
        assert!(!outcome.done, "{outcome:?}");
        let withheld = "the provider's error quoted canary-shaped text";
        assert!(outcome.body.contains(withheld), "{outcome:?}");
        assert!(
            outcome.body.contains("invalid_request_error"),
            "{outcome:?}"
        );
    }
}

/// A provider's answer of media type `kind` whose body is `pieces`, each
/// sent 100 ms after the one before.
fn paced(
    pieces: impl Iterator<Item = axum::body::Bytes> + Send + 'static,
    kind: &'static str,
) -> axum::http::Response<axum::body::Body> {
    use futures_util::StreamExt;
    let pieces = futures_util::stream::iter(pieces).then(|piece| async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        Ok::<_, std::io::Error>(piece)
    });
    let mut response = axum::http::Response::new(axum::body::Body::from_stream(pieces));
    response
        .headers_mut()
        .insert("content-type", kind.parse().unwrap());
    response
}

/// A reasoning model that thinks for about 1.2 s (a reasoning delta every
/// 100 ms) before its answer, which opens with the echo unless the prompt
/// says `forget`.
async fn slow_thinking_upstream() -> String {
    use axum::body::{Body, Bytes};
    use axum::http::Response;
    use axum::{Json, Router, routing::post};
    async fn answer(Json(request): Json<Value>) -> Response<Body> {
        let opening = canarygate_policies::inject::obedient_echo(&request).unwrap_or_default();
        let opening = if request.to_string().contains("forget") {
            "Mercury".to_owned()
        } else {
            opening
        };
        let chunk = |delta: Value| {
            let chunk = json!({"id": "c1", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": null}]});
            Bytes::from(format!("data: {chunk}\n\n"))
        };
        let thoughts =
            (0..12).map(move |n| chunk(json!({"reasoning_content": format!("step {n}. ")})));
        let end =
            json!({"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
        let rest = [
            chunk(json!({"content": format!("{opening}\nMercury, Venus.")})),
            Bytes::from(format!("data: {end}\n\ndata: [DONE]\n\n")),
        ];
        paced(thoughts.chain(rest), "text/event-stream")
    }
    serve_upstream(Router::new().route("/v1/chat/completions", post(answer))).await
}

/// While an `echo-first` stream holds a long reasoning for its echo, the
/// client gets the response head and a keep-alive comment every
/// `limits.stream_keepalive_ms`, so its read timeout does not fire; the
/// answer then flows as usual, and an echo that fails after the head ends
/// the stream with the error event.
#[tokio::test]
async fn a_long_hold_sends_the_head_and_keep_alives() {
    use futures_util::StreamExt;
    let upstream = slow_thinking_upstream().await;
    let dir = ProxyDir::new();
    let policy = verified_policy(&dir, &upstream, "[limits]\nstream_keepalive_ms = 300\n");
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    // A client that gives up after 700 ms without a byte.
    let client = reqwest::Client::builder()
        .read_timeout(Duration::from_millis(700))
        .build()
        .unwrap();
    for (question, passes) in [("Name two planets", true), ("forget it", false)] {
        let started = Instant::now();
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("sk-e2e")
            .json(&json!({"model": "sim-reasoner", "stream": true,
                          "messages": [{"role": "user", "content": question}]}))
            .send()
            .await
            .expect("the head, before the read timeout");
        assert!(
            started.elapsed() < Duration::from_millis(1000),
            "{question}"
        );
        assert_eq!(response.status(), 200, "{question}");
        assert_eq!(
            response.headers()["x-canarygate-verdict"],
            "pending; release=echo-first"
        );
        let mut body = String::new();
        let mut pieces = response.bytes_stream();
        while let Some(piece) = pieces.next().await {
            body.push_str(std::str::from_utf8(&piece.expect("no read timeout")).unwrap());
        }
        assert!(body.starts_with(": canarygate: verifying\n\n"), "{body}");
        assert!(
            body.matches(": canarygate: verifying").count() >= 2,
            "{body}"
        );
        let events = sse_data(&body);
        if passes {
            assert_eq!(stream_content(&body), "Mercury, Venus.", "{body}");
            assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
        } else {
            assert!(body.contains("canarygate_verification_failed"), "{body}");
            assert!(!body.contains("[DONE]"), "{body}");
            assert!(!body.contains("step 0"), "nothing of the answer: {body}");
        }
    }
}

/// A provider that keeps its connection busy without finishing: after the
/// answer's first event (with the echo), a byte of an event that never ends
/// every 100 ms (`trickle`), or a keep-alive comment every 100 ms
/// (`comments`); a whole answer, one byte of its JSON every 100 ms.
async fn trickling_upstream() -> String {
    use axum::body::{Body, Bytes};
    use axum::http::Response;
    use axum::{Json, Router, routing::post};
    async fn answer(Json(request): Json<Value>) -> Response<Body> {
        let opening = canarygate_policies::inject::obedient_echo(&request).unwrap_or_default();
        let asked = request.to_string();
        let first = json!({"id": "c1", "choices": [{"index": 0,
            "delta": {"content": format!("{opening}\nMercury")}, "finish_reason": null}]});
        let (opening, piece): (String, &'static [u8]) = if request["stream"] != true {
            (String::new(), b" ")
        } else if asked.contains("comments") {
            (format!("data: {first}\n\n"), b": keep-alive\n\n")
        } else {
            (format!("data: {first}\n\ndata: {{\"id\": \"c1\""), b" ")
        };
        let kind = if request["stream"] == true {
            "text/event-stream"
        } else {
            "application/json"
        };
        let pieces = std::iter::once(Bytes::from(opening))
            .chain(std::iter::repeat_n(Bytes::from_static(piece), 300));
        paced(pieces, kind)
    }
    serve_upstream(Router::new().route("/v1/chat/completions", post(answer))).await
}

/// Bytes that never finish an event, comments alone, or a whole answer
/// trickled a byte at a time keep no request open past its deadlines: a
/// stream ends with the error event at the idle timeout since its last
/// whole event, a whole answer with 504 at the first-byte timeout since its
/// head.
#[tokio::test]
async fn a_provider_that_trickles_is_held_to_its_deadlines() {
    let upstream = trickling_upstream().await;
    let client = client();
    let limits = "[limits]\nidle_timeout_ms = 700\nfirst_byte_timeout_ms = 1500\n";
    // Verified, and relayed as it comes (checks off).
    for plain in [false, true] {
        let dir = ProxyDir::new();
        let policy = if plain {
            plain_policy(&dir, &upstream, limits)
        } else {
            verified_policy(&dir, &upstream, limits)
        };
        let proxy = start_proxy_with_policy(&dir, &policy, &[]);
        for (question, stream) in [("trickle", true), ("comments", true), ("whole", false)] {
            let started = Instant::now();
            let outcome = ask(&client, &proxy.url, question, stream).await;
            let took = started.elapsed();
            let what = format!("{question}, plain {plain}");
            assert!(took < Duration::from_secs(5), "{what}: {took:?}");
            assert!(!outcome.done, "{what}: {outcome:?}");
            if stream {
                assert_eq!(outcome.status, 200, "{what}: {outcome:?}");
                assert!(
                    outcome.body.contains("no whole event"),
                    "{what}: {outcome:?}"
                );
            } else {
                assert_eq!(outcome.status, 504, "{what}: {outcome:?}");
                assert!(
                    outcome.body.contains("first_byte_timeout_ms"),
                    "{outcome:?}"
                );
            }
        }
    }
}

/// A provider that refuses every key with a 401 quoting it, as a gateway
/// may.
async fn key_quoting_upstream() -> String {
    use axum::http::{HeaderMap, StatusCode};
    use axum::{Router, routing::post};
    async fn answer(headers: HeaderMap) -> (StatusCode, [(&'static str, &'static str); 1], String) {
        let key = headers["authorization"]
            .to_str()
            .unwrap()
            .trim_start_matches("Bearer ")
            .to_owned();
        let error = json!({"error": {"message": format!("Incorrect API key provided: {key}."),
                                     "type": "invalid_request_error", "code": "invalid_api_key"}});
        (
            StatusCode::UNAUTHORIZED,
            [("content-type", "application/json")],
            error.to_string(),
        )
    }
    serve_upstream(Router::new().route("/v1/chat/completions", post(answer))).await
}

/// The key a provider's error quotes back reaches neither the client nor
/// the audit store (every answer sampled): both keep the provider's error,
/// the key withheld. So does the key a client pasted into its own prompt.
#[tokio::test]
async fn a_key_quoted_in_a_providers_error_is_withheld() {
    let upstream = key_quoting_upstream().await;
    let dir = ProxyDir::new();
    let policy = verified_policy(&dir, &upstream, "[audit]\nsample_rate = 1.0\n");
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let key = "sk-e2e-quoted-0123456789";
    for stream in [false, true] {
        let response = client()
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth(key)
            .json(&json!({"model": "m", "stream": stream,
                          "messages": [{"role": "user", "content": format!("my key is {key}")}]}))
            .send()
            .await
            .expect("request");
        assert_eq!(response.status(), 401);
        let body = response.text().await.unwrap();
        assert!(!body.contains(key), "{body}");
        assert!(body.contains("credential withheld by canarygate"), "{body}");
        assert!(body.contains("invalid_api_key"), "{body}");
    }
    drop(proxy);
    let records = audit_export(&dir.data());
    assert_eq!(records.len(), 2, "{records:?}");
    // The samples keep the error, its key withheld.
    let shown = audit_show(&dir, &records[0]);
    assert!(
        shown.contains("credential withheld by canarygate"),
        "{shown} {}",
        records[0]
    );
    for file in files_under(&dir.data()) {
        let bytes = std::fs::read(&file).unwrap();
        assert!(
            lacks(&bytes, key.as_bytes()),
            "{}: holds the key",
            file.display()
        );
    }
}

/// A model that repeats a key pasted into its prompt streams it a few
/// characters an event, so no event holds it whole: the sample keeps no
/// such answer (every answer sampled here).
#[tokio::test]
async fn a_key_a_stream_spells_across_its_events_is_not_sampled() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let policy = verified_policy(&dir, &sim.url, "[audit]\nsample_rate = 1.0\n");
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let key = "sk-e2e-spelled-0123456789";
    let body = client()
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth(key)
        .json(&json!({"model": "sim-model", "stream": true,
                      "messages": [{"role": "user", "content": format!("my key is {key}")}]}))
        .send()
        .await
        .expect("request")
        .text()
        .await
        .unwrap();
    // The client gets its own key back, spelled across events.
    assert!(stream_content(&body).contains(key), "{body}");
    assert!(!body.contains(key), "no event holds it whole: {body}");
    drop(proxy);
    let records = audit_export(&dir.data());
    assert_eq!(records.len(), 1, "{records:?}");
    let shown = audit_show(&dir, &records[0]);
    assert!(shown.contains("answer withheld by canarygate"), "{shown}");
    assert!(!stream_content(&shown).contains(key), "{shown}");
}

/// What `canarygate audit show` prints of `record` (with its sample's
/// texts), and what it said on its error output.
fn audit_show(dir: &ProxyDir, record: &Value) -> String {
    let shown = std::process::Command::new(binary())
        .args(["audit", "--data"])
        .arg(dir.data())
        .args(["show", &record["id"].to_string()])
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&shown.stdout),
        String::from_utf8_lossy(&shown.stderr)
    )
}

/// Whether `haystack` does not hold `needle`.
fn lacks(haystack: &[u8], needle: &[u8]) -> bool {
    !haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

/// SIGHUP, like SIGTERM, lets the requests in flight finish, then `serve`
/// exits; a second signal stops it at once, with a request the provider
/// keeps open still in flight.
#[tokio::test]
async fn a_signal_lets_requests_finish_and_a_second_stops_at_once() {
    let slow = slow_thinking_upstream().await;
    let stuck = trickling_upstream().await;
    for (upstream, question) in [(slow, "Name two planets"), (stuck, "trickle")] {
        let dir = ProxyDir::new();
        let mut proxy =
            start_proxy_with_policy(&dir, &policy(&dir, &upstream, "echo-first", "block"), &[]);
        let url = proxy.url.clone();
        let asked = tokio::spawn(async move { ask(&client(), &url, question, true).await });
        tokio::time::sleep(Duration::from_millis(400)).await;
        proxy.signal("HUP");
        if question == "trickle" {
            assert_eq!(
                proxy.exited_within(Duration::from_millis(600)),
                None,
                "draining"
            );
            proxy.signal("TERM");
            let status = proxy.exited_within(Duration::from_secs(3));
            assert!(status.is_some(), "a second signal stops it");
            asked.abort();
        } else {
            let outcome = asked.await.unwrap();
            assert!(outcome.done, "the stream in flight finished: {outcome:?}");
            let status = proxy.exited_within(Duration::from_secs(5));
            assert!(status.is_some_and(|status| status.success()), "{status:?}");
            let records = audit_export(&dir.data());
            assert_eq!(records.len(), 1, "its record written: {records:?}");
        }
    }
}
