//! `canarygate probe` against the simulated provider, and `serve` using what
//! it found.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{Value, json};

use crate::common::*;

/// One provider `sim` (window 8,192) with `provider_extra` fields, route
/// `m`, then `extra` tables.
fn sim_policy(
    dir: &ProxyDir,
    upstream: &str,
    provider_extra: &str,
    extra: &str,
) -> std::path::PathBuf {
    dir.policy(&format!(
        r#"
[[providers]]
name = "sim"
base_url = "{upstream}/v1"
context_window = 8192
{provider_extra}

[[routes]]
model = "m"
provider = "sim"
{extra}
"#
    ))
}

/// The incident's provider: window 8,192, KV pool 5,322, leaks over the pool.
fn start_leaky_sim() -> Running {
    start_sim(&[
        "--mode",
        "leak-on-overflow",
        "--context-window",
        "8192",
        "--pool-tokens",
        "5322",
    ])
}

/// Sends `words` words of prompt through `proxy`; returns `x-canarygate-served-by`.
async fn served_by(proxy: &Running, words: usize) -> String {
    let text = vec!["river"; words].join(" ");
    let response = client()
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("sk-client")
        .json(&json!({"model": "m", "max_tokens": 8,
                      "messages": [{"role": "user", "content": text}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.headers()["x-canarygate-served-by"]
        .to_str()
        .unwrap()
        .to_owned()
}

fn probe(policy: &Path, data: &Path, extra: &[&str]) -> Output {
    Command::new(binary())
        .args(["probe", "--config"])
        .arg(policy)
        .arg("--data")
        .arg(data)
        .args(extra)
        .env("OPENAI_API_KEY", "sk-probe-test")
        .output()
        .expect("run canarygate probe")
}

fn probe_json(policy: &Path, data: &Path) -> Value {
    let output = probe(policy, data, &["--yes", "--json"]);
    assert!(
        output.status.success(),
        "probe failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("one JSON object on stdout")
}

#[tokio::test]
async fn a_messages_api_provider_is_probed_in_its_own_api() {
    let sim = start_leaky_sim();
    let dir = ProxyDir::new();
    let policy = sim_policy(&dir, &sim.url, "api = \"anthropic\"", "");
    let result = probe_json(&policy, &dir.data());
    let limit = result["effective_limit_tokens"].as_u64().unwrap();
    assert!(
        limit <= 5322 && limit as f64 >= 5322.0 * 0.95,
        "effective limit {limit} is not within 5% under the pool of 5322: {result}"
    );
    assert_eq!(result["trusted"], false, "{result}");
    let stats = sim_stats(&sim).await;
    assert_eq!(
        stats["surfaces"]["chat_completions"].as_u64(),
        Some(0),
        "{stats}"
    );
    assert!(
        stats["surfaces"]["messages"].as_u64().unwrap() > 3,
        "{stats}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn probe_finds_a_leaky_providers_pool_and_flags_its_over_window_answer() {
    let sim = start_leaky_sim();
    let dir = ProxyDir::new();
    let policy = sim_policy(&dir, &sim.url, "", "");
    let result = probe_json(&policy, &dir.data());

    assert_eq!(result["advertised_window_tokens"], 8192);
    let limit = result["effective_limit_tokens"].as_u64().unwrap();
    assert!(
        limit <= 5322 && limit as f64 >= 5322.0 * 0.95,
        "effective limit {limit} is not within 5% under the pool of 5322"
    );
    assert_eq!(result["over_window_status"], 200, "{result}");
    assert_eq!(result["trusted"], false);
    assert_eq!(result["complete"], true);
    let steps = result["steps"].as_array().unwrap();
    assert!(
        steps
            .iter()
            .any(|step| step["ok"] == false && step["prompt_tokens_reported"] == 1),
        "no step saw the placeholder: {result}"
    );
    let stored: Value = serde_json::from_slice(
        &std::fs::read(dir.data().join("probes/sim--m.json")).expect("stored result"),
    )
    .unwrap();
    assert_eq!(stored, result);

    // `serve` trusts the provider only up to what the probe found: a prompt
    // under the advertised window but over the pool goes to the local engine.
    let model = tiny_model(dir.dir.path(), "tiny", 16384);
    let served = sim_policy(
        &dir,
        &sim.url,
        "",
        &format!(
            "[local]\nmodel_dir = \"{}\"\nkv_budget_mib = 32\n",
            model.display()
        ),
    );
    let proxy = start_proxy_with_policy(&dir, &served, &[]);
    let before = sim_stats(&sim).await["requests"].as_u64().unwrap();
    for (words, expected) in [(6000, "local"), (1000, "upstream")] {
        assert_eq!(served_by(&proxy, words).await, expected, "{words} words");
    }
    assert_eq!(
        sim_stats(&sim).await["requests"].as_u64().unwrap(),
        before + 1,
        "only the short request may reach the provider"
    );
    let local: Vec<Value> = audit_export(&dir.data())
        .into_iter()
        .filter(|record| record["route"] == "local")
        .collect();
    let check = local[0]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|check| check["name"] == "context_claim")
        .cloned()
        .expect("context_claim check");
    assert_eq!(check["evidence"]["seen"]["limit"]["source"], "probed");
    assert_eq!(check["evidence"]["seen"]["limit"]["tokens"], limit);
}

#[tokio::test(flavor = "multi_thread")]
async fn probe_confirms_an_honest_window_and_sends_nothing_without_yes() {
    let sim = start_sim(&["--context-window", "8192"]);
    let dir = ProxyDir::new();
    let policy = sim_policy(&dir, &sim.url, "", "");

    let dry = probe(&policy, &dir.data(), &[]);
    assert!(dry.status.success());
    let stderr = String::from_utf8_lossy(&dry.stderr);
    assert!(
        stderr.contains("prompt tokens") && stderr.contains("--yes"),
        "{stderr}"
    );
    assert_eq!(
        sim_stats(&sim).await["requests"],
        0,
        "a dry run sent traffic"
    );
    assert!(!dir.data().join("probes").exists());

    let result = probe_json(&policy, &dir.data());
    assert_eq!(result["effective_limit_tokens"], 8192, "{result}");
    assert_eq!(result["over_window_status"], 400);
    assert_eq!(result["trusted"], true);
    let spent = result["tokens_spent"].as_u64().unwrap();
    assert!(spent > 8000, "{result}");

    // A budget too small for the search stops it and says so.
    let cut = probe(
        &policy,
        &dir.data(),
        &["--yes", "--json", "--budget-tokens", "3000"],
    );
    let cut: Value = serde_json::from_slice(&cut.stdout).unwrap();
    assert_eq!(cut["complete"], false, "{cut}");
    assert_eq!(cut["trusted"], false);
    assert!(cut["tokens_spent"].as_u64().unwrap() <= 3000);
}

#[test]
fn a_provider_refusing_the_probe_stores_nothing() {
    let sim = start_sim(&["--api-key", "sk-right"]);
    let dir = ProxyDir::new();
    let policy = sim_policy(&dir, &sim.url, "", "");
    let output = probe(&policy, &dir.data(), &["--yes"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("HTTP 401") && stderr.contains("nothing stored"),
        "{stderr}"
    );
    assert!(!dir.data().join("probes").exists());

    // Several providers: the probe asks which.
    let two = dir.policy(&format!(
        r#"
[[providers]]
name = "a"
base_url = "{0}/v1"
context_window = 8192

[[providers]]
name = "b"
base_url = "{0}/v1"
context_window = 8192

[[routes]]
model = "m"
provider = "a"
"#,
        sim.url
    ));
    let output = probe(&two, &dir.data(), &[]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--provider"));
}

/// `[probe] every_hours`: `serve` probes routed models whose last probe is
/// missing or too old, at start and then on schedule, and uses the result.
#[tokio::test(flavor = "multi_thread")]
async fn serve_probes_on_schedule_and_uses_the_result() {
    let sim = start_leaky_sim();
    let dir = ProxyDir::new();
    let model = tiny_model(dir.dir.path(), "tiny", 16384);
    let policy = sim_policy(
        &dir,
        &sim.url,
        "api_key_env = \"SIM_PROBE_KEY\"",
        &format!(
            "[local]\nmodel_dir = \"{}\"\nkv_budget_mib = 32\n\n[probe]\nevery_hours = 24.0\n",
            model.display()
        ),
    );
    let proxy = start_proxy_with_policy(&dir, &policy, &[("SIM_PROBE_KEY", "sk-probe")]);
    let stored = dir.data().join("probes/sim--m.json");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !stored.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "serve did not probe on its schedule"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let result: Value = serde_json::from_slice(&std::fs::read(&stored).unwrap()).unwrap();
    let limit = result["effective_limit_tokens"].as_u64().unwrap();
    assert!((5000..=5322).contains(&limit), "{result}");
    assert_eq!(result["over_window_status"], 200);

    // The server reloads what it just stored: a prompt over the pool but
    // under the advertised window is served locally.
    assert_eq!(served_by(&proxy, 6000).await, "local");
}
