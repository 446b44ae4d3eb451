//! The official Python `openai` SDK as the client, and the cron examples.

use std::process::Command;

use serde_json::Value;

use crate::common::*;

fn run_python(script: &str, args: &[&str], envs: &[(&str, &str)]) -> (String, String) {
    let output = Command::new(python())
        .arg(workspace_root().join(script))
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "{script} failed:\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}

#[test]
fn openai_sdk_plain_streamed_and_error() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let policy = dir.policy(&format!(
        r#"
[[providers]]
name = "sim"
base_url = "{}/v1"
context_window = 4096

[[routes]]
model = "reporter"
provider = "sim"
upstream_model = "sim-model"
"#,
        sim.url
    ));
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let (stdout, _) = run_python(
        "tests/python/sdk_client.py",
        &[&format!("{}/v1", proxy.url), "reporter", "no-such-model"],
        &[],
    );
    let result: Value = serde_json::from_str(stdout.trim()).expect("one JSON line");

    let plain = &result["plain"];
    // The echo of the canaries is stripped: the client sees only the answer.
    let content = plain["content"].as_str().unwrap();
    assert!(
        content.starts_with("You wrote: Name the planets"),
        "{content}"
    );
    assert!(!holds_canary(content), "{content}");
    assert_eq!(plain["verdict"], "pass");
    // The reply's length depends on the (random) canaries in the context.
    assert!(
        plain["finish_reason"] == "length" || plain["finish_reason"] == "stop",
        "{plain}"
    );

    assert!(plain["prompt_tokens"].as_u64().unwrap() > 10);
    assert!(plain["request_id"].as_str().unwrap().starts_with("cg-"));
    assert_eq!(plain["session"].as_str().unwrap().len(), 32);

    let stream = &result["stream"];
    let content = stream["content"].as_str().unwrap();
    assert!(
        content.starts_with("You wrote: Name the planets") && !holds_canary(content),
        "{content}"
    );
    assert!(stream["completion_tokens"].as_u64().unwrap() > 12);

    let error = &result["error"];
    assert_eq!(error["status"], 404);
    assert_eq!(error["code"], "model_not_found");

    // Stored completions read back as sent and delivered, through every
    // endpoint the SDK has for them.
    let stored = &result["stored"];
    let delivered = &stored["content"];
    assert!(!delivered.as_str().unwrap().is_empty(), "{stored}");
    assert_eq!(stored["kept"], *delivered, "{stored}");
    assert_eq!(stored["listed"], serde_json::json!([delivered]), "{stored}");
    assert_eq!(stored["updated"][0], *delivered, "{stored}");
    assert_eq!(stored["updated"][1]["seen"], "yes", "{stored}");
    assert_eq!(
        stored["messages"],
        serde_json::json!([{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "Name the planets"}]),
        "{stored}"
    );
    assert_eq!(stored["deleted"], true);
    let raw = stored["raw"].as_str().unwrap();
    assert!(!holds_canary(raw), "{raw}");
    assert!(!raw.contains("Begin your reply"), "{raw}");
    assert!(error["message"].as_str().unwrap().contains("no-such-model"));
}

#[test]
fn cron_examples_run_against_canarygate() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let proxy = start_proxy(&dir, &sim.url);
    let base_url = format!("{}/v1", proxy.url);
    let envs = [
        ("OPENAI_BASE_URL", base_url.as_str()),
        ("OPENAI_API_KEY", "sk-cron-test"),
        ("JOB_SESSION", "nightly"),
    ];

    let output = Command::new("bash")
        .arg(workspace_root().join("examples/cron/job.sh"))
        .arg("Count the failed deploys")
        .envs(envs)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.starts_with("You wrote: Count the failed deploys"),
        "{stdout}"
    );
    assert!(stderr.contains("x-canarygate-request-id"), "{stderr}");

    let (stdout, stderr) = run_python("examples/cron/job.py", &["Count the failed deploys"], &envs);
    assert!(
        stdout.starts_with("You wrote: Count the failed deploys"),
        "{stdout}"
    );
    assert!(stderr.contains("request id: cg-"), "{stderr}");

    let mut streamed = envs.to_vec();
    streamed.push(("JOB_STREAM", "1"));
    let (stdout, _) = run_python(
        "examples/cron/job.py",
        &["Count the failed deploys"],
        &streamed,
    );
    assert!(
        stdout.starts_with("You wrote: Count the failed deploys"),
        "{stdout}"
    );

    // A failing job exits non-zero (cron mails the operator).
    let output = Command::new("bash")
        .arg(workspace_root().join("examples/cron/job.sh"))
        .envs(envs)
        .env("OPENAI_BASE_URL", "http://127.0.0.1:1/v1")
        .output()
        .unwrap();
    assert!(!output.status.success());
}
