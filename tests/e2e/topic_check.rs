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
