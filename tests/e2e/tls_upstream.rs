//! Upstream over TLS: the simulated provider behind a private CA made here.

use serde_json::Value;

use crate::common::*;

fn policy(dir: &ProxyDir, base_url: &str, extra_ca: Option<&str>) -> std::path::PathBuf {
    let extra = extra_ca
        .map(|path| format!("extra_ca_file = \"{path}\""))
        .unwrap_or_default();
    dir.policy(&format!(
        r#"
[[providers]]
name = "private-gateway"
base_url = "{base_url}/v1"
context_window = 8192
{extra}

[[routes]]
model = "*"
provider = "private-gateway"
"#
    ))
}

#[tokio::test]
async fn trusted_extra_ca_works_and_an_untrusted_one_fails_clearly() {
    let pki = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_pki(pki.path());
    let sim = start_sim(&["--tls-cert", &cert, "--tls-key", &key]);
    assert!(sim.url.starts_with("https://"), "{}", sim.url);
    let client = client();

    let trusted_dir = ProxyDir::new();
    let trusted = start_proxy_with_policy(
        &trusted_dir,
        &policy(&trusted_dir, &sim.url, Some(&ca)),
        &[],
    );
    for stream in [false, true] {
        let response = client
            .post(format!("{}/v1/chat/completions", trusted.url))
            .bearer_auth("k")
            .json(&chat_body("m", "over TLS", stream))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let body = response.text().await.unwrap();
        let content = if stream {
            stream_content(&body)
        } else {
            let value: Value = serde_json::from_str(&body).unwrap();
            value["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        assert!(content.starts_with("You wrote: over TLS"), "{content}");
    }
    // The proxy negotiated HTTP/2 (ALPN `h2`) with the provider: the sim
    // counts both requests (and perhaps the proxy's reachability check) as
    // HTTP/2. The stats are read over HTTP/1.1 so they do not count.
    let sim_client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&std::fs::read(&ca).unwrap()).unwrap())
        .http1_only()
        .build()
        .unwrap();
    let stats: Value = sim_client
        .get(format!("{}/sim/stats", sim.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let http2 = stats["http2_requests"].as_u64().unwrap();
    assert!(http2 >= 2, "the proxy spoke HTTP/2 over TLS: {stats}");

    let untrusted_dir = ProxyDir::new();
    let untrusted =
        start_proxy_with_policy(&untrusted_dir, &policy(&untrusted_dir, &sim.url, None), &[]);
    let response = client
        .post(format!("{}/v1/chat/completions", untrusted.url))
        .bearer_auth("k")
        .json(&chat_body("m", "over TLS", false))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "upstream_tls_error");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("private-gateway") && message.contains("UnknownIssuer"),
        "the error names the provider and the certificate problem: {message}"
    );
}

#[test]
fn unreadable_extra_ca_stops_serve_with_a_clear_error() {
    let dir = ProxyDir::new();
    let policy = policy(&dir, "https://127.0.0.1:1", Some("/nonexistent/ca.pem"));
    let output = std::process::Command::new(binary())
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&policy)
        .arg("--data")
        .arg(dir.data())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("private-gateway") && stderr.contains("/nonexistent/ca.pem"),
        "{stderr}"
    );
}
