//! The evidence a reviewer needs: what a blocked answer held and whose
//! canary it carried; the topic score in every verified record, and the
//! sample drawn toward the answers that do not fit their question.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use crate::common::*;

/// Runs `canarygate audit --data DATA show ID` and returns its output.
fn audit_show(data: &Path, id: u64) -> String {
    let output = Command::new(binary())
        .args(["audit", "--data"])
        .arg(data)
        .args(["show", &id.to_string()])
        .env("CANARYGATE_LOG", "warn")
        .output()
        .expect("run audit show");
    assert!(
        output.status.success(),
        "audit show failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The text of section `--- {title}` of `audit show`'s output, up to the
/// next section.
fn section<'a>(shown: &'a str, title: &str) -> Option<&'a str> {
    let start = shown.find(&format!("--- {title}"))?;
    let body = &shown[start..];
    let body = &body[body.find('\n')? + 1..];
    Some(body.split("\n--- ").next().unwrap_or(body))
}

/// Sends one chat request as `key`; returns the status and the request id.
async fn ask(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    text: &str,
    stream: bool,
) -> (u16, String) {
    let response = client
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({
            "model": "sim-model",
            "stream": stream,
            "messages": [{"role": "user", "content": text}],
        }))
        .send()
        .await
        .expect("request");
    let status = response.status().as_u16();
    let id = response.headers()["x-canarygate-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    response.text().await.expect("body");
    (status, id)
}

fn request_record<'a>(records: &'a [Value], request_id: &str) -> &'a Value {
    records
        .iter()
        .find(|record| record["kind"] == "request" && record["request_id"] == request_id)
        .unwrap_or_else(|| panic!("no record of {request_id}"))
}

#[tokio::test]
async fn a_blocked_leak_keeps_what_the_provider_sent_and_whose_canary_it_was() {
    // Every request but the first is answered from the previous request's
    // context: the owner asks first, the victim gets the owner's answer.
    let sim = start_sim(&["--mode", "swap"]);
    let dir = ProxyDir::new();
    let policy = dir.policy(&format!(
        r#"
[[providers]]
name = "sim"
base_url = "{}/v1"
context_window = 1048576

[[routes]]
model = "*"
provider = "sim"

[verify]
action = "block"

[audit]
sample_rate = 0.0
"#,
        sim.url
    ));
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let client = client();
    for stream in [false, true] {
        let secret = if stream {
            "quokkaledger"
        } else {
            "wombatpayroll"
        };
        let (status, owner) = ask(
            &client,
            &proxy.url,
            "sk-owner",
            &format!("Summarise the {secret} figures for March"),
            stream,
        )
        .await;
        assert!(status == 200 || stream, "owner: {status}");
        let (status, victim) = ask(
            &client,
            &proxy.url,
            "sk-victim",
            "What is the capital of Peru?",
            stream,
        )
        .await;
        assert_eq!(
            status, 502,
            "stream={stream}: the swapped answer is blocked"
        );

        let records = audit_export(&dir.data());
        let owner_record = request_record(&records, &owner);
        let victim_record = request_record(&records, &victim);
        assert_eq!(victim_record["verdict"], "fail");
        assert_eq!(victim_record["action"], "block");
        // The record names whose canary was found: the owner's request and
        // session, so the owner of the exposed data can be told.
        let foreign = victim_record["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|check| check["name"] == "foreign_canary")
            .expect("a foreign_canary check");
        assert_eq!(foreign["result"], "fail", "{foreign}");
        let hit = &foreign["evidence"]["seen"]["hits"][0];
        assert_eq!(hit["request"], owner.as_str(), "{foreign}");
        assert_eq!(hit["session"], owner_record["session"], "{foreign}");
        assert_ne!(owner_record["session"], victim_record["session"]);

        // The sample shows the provider's text beside what the client got.
        let shown = audit_show(&dir.data(), victim_record["id"].as_u64().unwrap());
        let received = section(&shown, "response text").expect(&shown);
        assert!(
            received.contains("canarygate_verification_failed"),
            "{shown}"
        );
        assert!(!received.contains(secret), "{shown}");
        let sent = section(&shown, "provider text").expect(&shown);
        if stream {
            // A stream is read until its first failed check (the echo, here,
            // which opened with the owner's canary): what came before it is
            // kept, and the sample says where the reading stopped.
            assert!(sent.contains("canarygate stopped reading here"), "{shown}");
        } else {
            assert!(sent.contains(secret), "the leaked text is kept: {shown}");
        }
        assert!(sent.contains("[canary]"), "canaries are redacted: {shown}");
        assert!(!holds_canary(sent), "no canary value is stored: {shown}");
        if !stream {
            // The very first request is answered honestly and, passing,
            // keeps no sample (the second owner got a swapped answer too).
            assert!(owner_record["sample"].is_null(), "{owner_record}");
        }
    }
}

/// The real sentence-embedding model (all-MiniLM-L6-v2), fetched by
/// `scripts/embedding-model.sh` (which `scripts/test.sh` runs first).
fn embedding_model() -> std::path::PathBuf {
    if let Ok(dir) = std::env::var("CANARYGATE_TOPIC_MODEL") {
        return dir.into();
    }
    let dir = workspace_root().join(".cache/models/all-MiniLM-L6-v2");
    assert!(
        dir.join("model.safetensors").is_file(),
        "no embedding model at {}: run scripts/embedding-model.sh, or set CANARYGATE_TOPIC_MODEL",
        dir.display()
    );
    dir
}

fn topic_policy(dir: &ProxyDir, upstream: &str, action: &str) -> std::path::PathBuf {
    let sections = format!(
        "[audit]\nsample_rate = 0.0\n\n[topic]\nmodel_dir = \"{}\"\naction = \"{action}\"\n\
         timeout_ms = 5000\n",
        embedding_model().display()
    );
    verified_policy(dir, upstream, &sections)
}

/// Two questions on unrelated topics, asked in JSON mode: no echo is asked,
/// so a swapped answer carries no canary and only its topic gives it away.
const QUESTIONS: [&str; 2] = [
    "Which soil and how much water does a potted cactus need? Answer in JSON.",
    "How do I reset the timing belt on a diesel car engine? Answer in JSON.",
];

/// Sends question `index` in JSON mode; returns status, request id and the
/// verdict header.
async fn ask_json(
    client: &reqwest::Client,
    url: &str,
    index: usize,
    stream: bool,
) -> (u16, String, String) {
    let response = client
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(format!("sk-topic-{index}"))
        .json(&json!({
            "model": "sim-model",
            "stream": stream,
            "response_format": {"type": "json_object"},
            "messages": [{"role": "user", "content": QUESTIONS[index]}],
        }))
        .send()
        .await
        .expect("request");
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|value| value.to_str().unwrap().to_owned())
            .unwrap_or_default()
    };
    let (id, verdict) = (
        header("x-canarygate-request-id"),
        header("x-canarygate-verdict"),
    );
    response.text().await.expect("body");
    (status, id, verdict)
}

/// The records once every request record has its topic record (scored
/// off the critical path, so shortly after the answer).
async fn records_with_scores(data: &Path, requests: usize) -> Vec<Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let records = audit_export(data);
        let scored = records
            .iter()
            .filter(|record| record["kind"] == "topic")
            .count();
        if scored >= requests {
            return records;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{scored} of {requests} requests scored: {records:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn every_answer_is_scored_and_the_swapped_one_is_low_and_sampled() {
    let sim = start_sim(&["--mode", "swap"]);
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &topic_policy(&dir, &sim.url, "record"), &[]);
    let client = client();
    // The first is answered honestly, the second from the first's context.
    let (status, honest, verdict) = ask_json(&client, &proxy.url, 0, false).await;
    assert_eq!((status, verdict.as_str()), (200, "pass; passive=json_mode"));
    let (status, swapped, verdict) = ask_json(&client, &proxy.url, 1, true).await;
    assert_eq!(
        status, 200,
        "delivered: the score is evidence, not a verdict"
    );
    assert!(
        verdict.starts_with("pending") || verdict.starts_with("pass"),
        "{verdict}"
    );

    let records = records_with_scores(&dir.data(), 2).await;
    let topic_of = |request_id: &str| {
        let record = request_record(&records, request_id);
        assert!(
            record["topic"].is_null(),
            "record mode scores after the record"
        );
        records
            .iter()
            .find(|entry| entry["kind"] == "topic" && entry["scored_id"] == record["id"])
            .unwrap_or_else(|| panic!("no topic record for {request_id}: {records:?}"))
            .clone()
    };
    let (honest, swapped) = (topic_of(&honest), topic_of(&swapped));
    let similarity = |entry: &Value| entry["score"]["similarity"].as_f64().expect("scored");
    let min = swapped["score"]["min_similarity"].as_f64().unwrap();
    assert!(similarity(&honest) >= min, "{honest}");
    assert!(similarity(&swapped) < min, "{swapped}");
    assert_eq!(swapped["score"]["model"], "all-MiniLM-L6-v2");
    // With no random share, only the low answer's text is kept, and
    // review starts with it.
    assert!(honest["sample"].is_null(), "{honest}");
    assert!(swapped["sample"].is_object(), "{swapped}");
    let shown = audit_show(&dir.data(), swapped["scored_id"].as_u64().unwrap());
    assert!(shown.contains("LOW"), "{shown}");
    assert!(section(&shown, "response text").is_some(), "{shown}");
}

#[tokio::test]
async fn a_low_score_flags_or_blocks_when_the_policy_says_so() {
    for (action, stream) in [("flag", false), ("block", false), ("block", true)] {
        let sim = start_sim(&["--mode", "swap"]);
        let dir = ProxyDir::new();
        let proxy = start_proxy_with_policy(&dir, &topic_policy(&dir, &sim.url, action), &[]);
        let client = client();
        let context = format!("action={action} stream={stream}");
        let (status, honest, verdict) = ask_json(&client, &proxy.url, 0, stream).await;
        assert_eq!(status, 200, "{context}");
        if !stream {
            assert_eq!(verdict, "pass; passive=json_mode", "{context}");
        }
        let (status, swapped, verdict) = ask_json(&client, &proxy.url, 1, stream).await;
        let records = audit_export(&dir.data());
        let record = request_record(&records, &swapped);
        assert_eq!(record["verdict"], "fail", "{context}: {record}");
        assert!(
            record["topic"]["similarity"].as_f64().unwrap()
                < record["topic"]["min_similarity"].as_f64().unwrap()
        );
        let check = record["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|check| check["name"] == "topic")
            .expect("a topic check");
        assert_eq!(check["result"], "fail", "{context}: {check}");
        match action {
            "flag" => {
                assert_eq!(
                    (status, verdict.as_str()),
                    (200, "fail; checks=topic"),
                    "{context}"
                );
                assert_eq!(record["action"], "flag", "{context}");
            }
            _ if stream => {
                // Echo-first released the text already: the stream ends with
                // the verification error instead of its end.
                assert_eq!(status, 200, "{context}");
                assert_eq!(record["action"], "block", "{context}");
            }
            _ => {
                assert_eq!(status, 502, "{context}");
                assert_eq!(record["action"], "block", "{context}");
            }
        }
        let honest = request_record(&records, &honest);
        assert!(
            honest["topic"]["similarity"].as_f64().is_some(),
            "{context}: {honest}"
        );
        assert_eq!(honest["verdict"], "pass", "{context}: {honest}");
    }
}
