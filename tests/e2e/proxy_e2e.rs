//! End to end through `canarygate serve` to `canarygate sim-provider`:
//! real processes, real sockets.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::*;

/// A chunk or completion without the fields that differ between two calls
/// (the stream padding `obfuscation` is random, as OpenAI's is).
fn without_call_identity(mut value: Value) -> Value {
    if let Some(object) = value.as_object_mut() {
        object.remove("id");
        object.remove("created");
        object.remove("obfuscation");
    }
    value
}

async fn assert_openai_error(response: reqwest::Response, status: u16, code: &str) -> Value {
    assert_eq!(response.status().as_u16(), status, "status for {code}");
    assert!(
        response.headers().contains_key("x-canarygate-request-id"),
        "request id header on errors"
    );
    let body: Value = response.json().await.expect("error body is JSON");
    let error = &body["error"];
    assert_eq!(error["code"], code, "{body}");
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(error["type"].is_string(), "{body}");
    body
}

#[tokio::test]
async fn non_streaming_matches_a_direct_call() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let proxy = start_plain_proxy(&dir, &sim.url);
    let client = client();
    let body = json!({
        "model": "sim-model",
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": "Begin your reply with \"OK-42\" please."},
            {"role": "user", "content": "List three prime numbers"}
        ],
    });
    let direct = client
        .post(format!("{}/v1/chat/completions", sim.url))
        .bearer_auth("sk-test")
        .json(&body)
        .send()
        .await
        .unwrap();
    let direct: Value = direct.json().await.unwrap();

    let proxied = client
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("sk-test")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(proxied.status(), 200);
    let headers = proxied.headers().clone();
    assert!(
        headers["x-canarygate-request-id"]
            .to_str()
            .unwrap()
            .starts_with("cg-")
    );
    assert_eq!(headers["x-canarygate-session"].len(), 32);
    assert_eq!(headers["content-type"], "application/json");
    let proxied: Value = proxied.json().await.unwrap();

    assert_eq!(
        without_call_identity(proxied.clone()),
        without_call_identity(direct)
    );
    let content = proxied["choices"][0]["message"]["content"]
        .as_str()
        .unwrap();
    assert_eq!(content, "OK-42 You wrote: List three");
    assert!(proxied["usage"]["prompt_tokens"].as_u64().unwrap() > 10);
    assert_eq!(proxied["usage"]["completion_tokens"], 8);
    assert_eq!(proxied["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn streaming_matches_a_direct_call_event_for_event() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let proxy = start_plain_proxy(&dir, &sim.url);
    let client = client();
    let body = json!({
        "model": "sim-model",
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "Describe a lighthouse at night"}],
    });
    let fetch = |url: String| {
        let client = client.clone();
        let body = body.clone();
        async move {
            let response = client
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth("sk-test")
                .json(&body)
                .send()
                .await
                .unwrap();
            let headers = response.headers().clone();
            (headers, response.text().await.unwrap())
        }
    };
    let (_, direct) = fetch(sim.url.clone()).await;
    let (headers, proxied) = fetch(proxy.url.clone()).await;
    assert_eq!(headers["content-type"], "text/event-stream");
    assert!(headers.contains_key("x-canarygate-request-id"));
    assert!(headers.contains_key("x-canarygate-session"));

    let events = |body: &str| -> Vec<Value> {
        sse_data(body)
            .iter()
            .map(|data| match serde_json::from_str::<Value>(data) {
                Ok(value) => without_call_identity(value),
                Err(_) => Value::String(data.clone()),
            })
            .collect()
    };
    let (direct_events, proxied_events) = (events(&direct), events(&proxied));
    assert!(direct_events.len() > 10);
    assert_eq!(proxied_events, direct_events);
    assert_eq!(proxied_events.last().unwrap(), "[DONE]");
    assert_eq!(stream_content(&proxied), stream_content(&direct));
    let usage = &proxied_events[proxied_events.len() - 2]["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5, "{usage}");
}

#[tokio::test]
async fn models_health_and_metrics() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let policy = dir.policy(&format!(
        r#"
[[providers]]
name = "sim"
base_url = "{}/v1"
context_window = 4096

[[routes]]
model = "small"
provider = "sim"
upstream_model = "sim-model"
"#,
        sim.url
    ));
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let client = client();

    let models: Value = client
        .get(format!("{}/v1/models", proxy.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "small");
    assert_eq!(models["data"][0]["owned_by"], "sim");

    let health = client
        .get(format!("{}/healthz", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);

    // The route maps the client's name to the provider's.
    let answer: Value = client
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("k")
        .json(&chat_body("small", "hello", false))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["model"], "sim-model");

    let metrics = metrics(&client, &proxy.url).await;
    assert!(
        metrics.contains(r#"canarygate_requests_total{route="chat_completions",status="200"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics.contains("canarygate_in_flight_requests 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("canarygate_proxy_overhead_seconds_count 1"),
        "{metrics}"
    );
    // The audit store's tables were written when it opened: their pages
    // are in its cache.
    let cache_bytes: u64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix("canarygate_audit_cache_bytes "))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(cache_bytes > 0, "{metrics}");
    // The answer's canaries (the preset's head and tail echo) are held.
    assert!(
        metrics.contains("canarygate_canaries_in_memory 2"),
        "{metrics}"
    );
    // The answer waited for its record's journal sync (durable audit).
    let syncs: u64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix("canarygate_audit_journal_sync_seconds_count "))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(syncs >= 1, "{metrics}");
    // ... and its wait for that record is observed, once.
    assert!(
        metrics.contains("canarygate_audit_record_wait_seconds_count 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn bad_input_gets_openai_errors_and_the_server_stays_up() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let policy = dir.policy(&format!(
        r#"
[limits]
max_body_bytes = 2048

[[providers]]
name = "sim"
base_url = "{}/v1"
context_window = 4096

[[routes]]
model = "small"
provider = "sim"
"#,
        sim.url
    ));
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let client = client();
    let url = format!("{}/v1/chat/completions", proxy.url);
    let post = |body: String| {
        client
            .post(&url)
            .bearer_auth("k")
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    assert_openai_error(post("{not json".into()).await.unwrap(), 400, "invalid_json").await;
    let body = assert_openai_error(
        post(r#"{"model": 7, "messages": []}"#.into())
            .await
            .unwrap(),
        400,
        "invalid_value",
    )
    .await;
    assert_eq!(body["error"]["param"], "model");
    let body = assert_openai_error(
        post(r#"{"model": "small", "messages": "hi"}"#.into())
            .await
            .unwrap(),
        400,
        "invalid_value",
    )
    .await;
    assert_eq!(body["error"]["param"], "messages");
    let body = assert_openai_error(
        post(json!({"model": "small", "stream": "yes", "messages": [{"role": "user", "content": "x"}]}).to_string())
            .await
            .unwrap(),
        400,
        "invalid_value",
    )
    .await;
    assert_eq!(body["error"]["param"], "stream");

    let huge = chat_body("small", &"word ".repeat(1000), false).to_string();
    assert_openai_error(post(huge).await.unwrap(), 413, "request_too_large").await;

    // Over the limit without a Content-Length: chunked upload.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..10).map(|_| Ok(vec![b' '; 512])).collect();
    let chunked = client
        .post(&url)
        .bearer_auth("k")
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await
        .unwrap();
    assert_openai_error(chunked, 413, "request_too_large").await;

    let body = assert_openai_error(
        post(chat_body("gpt-unknown", "x", false).to_string())
            .await
            .unwrap(),
        404,
        "model_not_found",
    )
    .await;
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("gpt-unknown")
    );

    let no_auth = client
        .post(&url)
        .json(&chat_body("small", "x", false))
        .send()
        .await
        .unwrap();
    assert_openai_error(no_auth, 401, "missing_api_key").await;

    let unknown_path = client
        .get(format!("{}/v1/nope", proxy.url))
        .send()
        .await
        .unwrap();
    assert_openai_error(unknown_path, 404, "unknown_url").await;

    // Still serving.
    let ok = post(chat_body("small", "still there?", false).to_string())
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}

#[tokio::test]
async fn provider_errors_pass_through_in_openai_format() {
    let sim = start_sim(&["--context-window", "400", "--api-key", "sk-right"]);
    let dir = ProxyDir::new();
    let proxy = start_proxy(&dir, &sim.url);
    let client = client();
    let url = format!("{}/v1/chat/completions", proxy.url);

    let too_long = client
        .post(&url)
        .bearer_auth("sk-right")
        .json(&chat_body("m", &"many words here ".repeat(150), true))
        .send()
        .await
        .unwrap();
    let body = assert_openai_error(too_long, 400, "context_length_exceeded").await;
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 400")
    );

    // Passthrough auth: the client's key reaches the provider, which judges it.
    let wrong_key = client
        .post(&url)
        .bearer_auth("sk-wrong")
        .json(&chat_body("m", "hi", false))
        .send()
        .await
        .unwrap();
    assert_openai_error(wrong_key, 401, "invalid_api_key").await;
    let right_key = client
        .post(&url)
        .bearer_auth("sk-right")
        .json(&chat_body("m", "hi", false))
        .send()
        .await
        .unwrap();
    assert_eq!(right_key.status(), 200);
}

#[tokio::test]
async fn managed_auth_attaches_the_provider_key() {
    let sim = start_sim(&["--api-key", "sk-provider-secret"]);
    let dir = ProxyDir::new();
    let client_key = "cg-client-key-1";
    let hash = {
        use std::io::Write;
        let mut child = std::process::Command::new(binary())
            .arg("hash-key")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(format!("{client_key}\n").as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        String::from_utf8(output.stdout).unwrap().trim().to_owned()
    };
    let policy = dir.policy(&format!(
        r#"
[auth]
mode = "managed"
client_keys = [{{ name = "nightly", sha256 = "{hash}" }}]

[[providers]]
name = "sim"
base_url = "{}/v1"
context_window = 4096
api_key_env = "SIM_PROVIDER_KEY"

[[routes]]
model = "*"
provider = "sim"
"#,
        sim.url
    ));
    let proxy =
        start_proxy_with_policy(&dir, &policy, &[("SIM_PROVIDER_KEY", "sk-provider-secret")]);
    let client = client();
    let url = format!("{}/v1/chat/completions", proxy.url);
    let ok = client
        .post(&url)
        .bearer_auth(client_key)
        .json(&chat_body("m", "hi", false))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let wrong = client
        .post(&url)
        .bearer_auth("sk-provider-secret")
        .json(&chat_body("m", "hi", false))
        .send()
        .await
        .unwrap();
    assert_openai_error(wrong, 401, "invalid_api_key").await;

    // Neither key is written anywhere under the data directory.
    for entry in files_under(&dir.data()) {
        let bytes = std::fs::read(&entry).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            !text.contains(client_key) && !text.contains("sk-provider-secret"),
            "{entry:?}"
        );
    }
}

#[tokio::test]
async fn upstream_down_is_502() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = ProxyDir::new();
    let proxy = start_proxy(&dir, &format!("http://127.0.0.1:{port}"));
    let client = client();
    for stream in [false, true] {
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("k")
            .json(&chat_body("m", "hi", stream))
            .send()
            .await
            .unwrap();
        assert_openai_error(response, 502, "upstream_unreachable").await;
    }
    // Recorded as forwarded requests that ended in an error, not as rejections.
    let records = audit_export(&dir.data());
    assert_eq!(records.len(), 2);
    for record in records {
        assert_eq!(record["action"], "forward", "{record}");
        assert_eq!(record["outcome"], "error", "{record}");
    }
}

/// Short timeouts; `[verify] enabled = false`, so these tests see the
/// transport alone (verification of broken streams: tests/verification_e2e.rs).
fn timeout_policy(dir: &ProxyDir, upstream: &str) -> std::path::PathBuf {
    dir.policy(&format!(
        r#"
[limits]
first_byte_timeout_ms = 400
idle_timeout_ms = 400

[[providers]]
name = "sim"
base_url = "{upstream}/v1"
context_window = 4096

[[routes]]
model = "*"
provider = "sim"

[verify]
enabled = false
"#
    ))
}

#[tokio::test]
async fn stalled_upstream_hits_each_timeout() {
    let client = client();

    let stall_head = start_sim(&["--mode", "stall-first-byte"]);
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &timeout_policy(&dir, &stall_head.url), &[]);
    for stream in [false, true] {
        let started = Instant::now();
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("k")
            .json(&chat_body("m", "hi", stream))
            .send()
            .await
            .unwrap();
        assert_openai_error(response, 504, "upstream_timeout").await;
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    let stall_body = start_sim(&["--mode", "stall-mid-stream"]);
    let dir = ProxyDir::new();
    let proxy = start_proxy_with_policy(&dir, &timeout_policy(&dir, &stall_body.url), &[]);
    let response = client
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("k")
        .json(&chat_body("m", "hi", false))
        .send()
        .await
        .unwrap();
    assert_openai_error(response, 504, "upstream_timeout").await;

    let response = client
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("k")
        .json(&chat_body("m", "tell me about the sea", true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    assert_stream_ends_with_interruption(&body);
    assert!(body.contains("idle_timeout_ms"), "{body}");
}

fn assert_stream_ends_with_interruption(body: &str) {
    let events = sse_data(body);
    assert!(events.len() >= 2, "{body}");
    assert!(
        !events.iter().any(|data| data == "[DONE]"),
        "no clean end: {body}"
    );
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(
        last["error"]["code"], "upstream_stream_interrupted",
        "{body}"
    );
    assert!(
        !stream_content(body).is_empty(),
        "the first half was relayed"
    );
}

#[tokio::test]
async fn upstream_cut_mid_answer_is_an_error_never_a_clean_end() {
    let sim = start_sim(&["--mode", "cut"]);
    let dir = ProxyDir::new();
    let proxy = start_plain_proxy(&dir, &sim.url);
    let client = client();
    let response = client
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("k")
        .json(&chat_body("m", "a long story please", true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    assert_stream_ends_with_interruption(&body);
    assert!(body.contains("before its end marker"), "{body}");

    let response = client
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("k")
        .json(&chat_body("m", "a long story please", false))
        .send()
        .await
        .unwrap();
    assert_openai_error(response, 502, "upstream_error").await;
}

/// Posts `body` to `path` at `base` with the key as that API's client sends
/// it: the status and the whole body.
async fn post_as_client(base: &str, path: &str, body: &Value) -> (u16, String) {
    let request = client().post(format!("{base}{path}")).json(body);
    let request = if path == "/v1/messages" {
        request
            .header("x-api-key", "k")
            .header("anthropic-version", "2023-06-01")
    } else {
        request.bearer_auth("k")
    };
    let response = request.send().await.unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

#[tokio::test]
async fn a_whole_stream_closed_without_its_end_marker_ends_cleanly() {
    // text-generation-inference before 2.2 ended its streams without
    // `[DONE]`: every choice finished, the answer is whole.
    let sim = start_sim(&["--mode", "no-end-marker"]);
    let dir = ProxyDir::new();
    let proxy = start_proxy(&dir, &sim.url);
    let chat = chat_body("m", "name three rivers", true);
    let (_, direct) = post_as_client(&sim.url, "/v1/chat/completions", &chat).await;
    assert!(!direct.contains("[DONE]"), "{direct}");
    let (status, body) = post_as_client(&proxy.url, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 200);
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert!(body.contains(": x-canarygate-verdict pass\n"), "{body}");
    assert!(stream_content(&body).contains("You wrote"), "{body}");

    let messages = serde_json::json!({"model": "claude-sonnet-4-5", "max_tokens": 200,
        "stream": true, "messages": [{"role": "user", "content": "name three rivers"}]});
    let (_, direct) = post_as_client(&sim.url, "/v1/messages", &messages).await;
    assert!(
        direct.contains("message_delta") && !direct.contains("message_stop"),
        "{direct}"
    );
    let (_, body) = post_as_client(&proxy.url, "/v1/messages", &messages).await;
    assert!(body.contains(": x-canarygate-verdict pass\n"), "{body}");
    assert!(
        body.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
        "{body}"
    );
}

/// A provider in front of `sim` that labels every answer
/// `application/json`, its streams included, as some OpenAI-compatible
/// servers do.
async fn json_labelling_upstream(sim: &str) -> String {
    use axum::body::{Body, Bytes};
    use axum::http::HeaderMap;
    use axum::response::Response;
    use axum::routing::post;
    let sim = sim.to_owned();
    let relabel = move |headers: HeaderMap, body: Bytes| {
        let sim = sim.clone();
        async move {
            let answer = client()
                .post(format!("{sim}/v1/chat/completions"))
                .header("authorization", headers["authorization"].clone())
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            Response::builder()
                .status(answer.status())
                .header("content-type", "application/json")
                .body(Body::from_stream(answer.bytes_stream()))
                .unwrap()
        }
    };
    serve_upstream(axum::Router::new().route("/v1/chat/completions", post(relabel))).await
}

#[tokio::test]
async fn a_stream_labelled_json_is_read_as_the_stream_it_is() {
    let sim = start_sim(&[]);
    let upstream = json_labelling_upstream(&sim.url).await;
    let dir = ProxyDir::new();
    let proxy = start_proxy(&dir, &upstream);
    let client = client();
    for stream in [true, false] {
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url))
            .bearer_auth("k")
            .json(&chat_body("m", "name three rivers", stream))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{stream}");
        let body = response.text().await.unwrap();
        let content = if stream {
            assert!(body.contains(": x-canarygate-verdict pass\n"), "{body}");
            assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
            stream_content(&body)
        } else {
            let answer: Value = serde_json::from_str(&body).unwrap();
            answer["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        assert!(content.starts_with("You wrote"), "{stream}: {body}");
    }
}

#[tokio::test]
async fn client_disconnect_cancels_the_upstream_request() {
    let sim = start_sim(&["--decode-tps", "20"]);
    let dir = ProxyDir::new();
    let proxy = start_proxy(&dir, &sim.url);
    let client = client();
    let mut response = client
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("k")
        .json(&chat_body("m", "a slow answer", true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let first = response.chunk().await.unwrap().unwrap();
    assert!(!first.is_empty());
    drop(response);

    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats: Value = client
            .get(format!("{}/sim/stats", sim.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if stats["cancelled"] == 1 {
            assert_eq!(stats["completed"], 0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "upstream never saw the cancel: {stats}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The request stays in flight until its audit record (interrupted by the
    // client) is committed, which a loaded disk may take a while to do.
    loop {
        let metrics = metrics(&client, &proxy.url).await;
        if metrics.contains("canarygate_in_flight_requests 0") {
            break;
        }
        assert!(Instant::now() < deadline, "{metrics}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn five_hundred_concurrent_streams_without_cross_talk() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let proxy = start_proxy(&dir, &sim.url);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let url = format!("{}/v1/chat/completions", proxy.url);
    let tasks: Vec<_> = (0..500)
        .map(|index| {
            let client = client.clone();
            let url = url.clone();
            tokio::spawn(async move {
                let marker = format!("q{index:03}");
                let response = client
                    .post(&url)
                    .bearer_auth(format!("key-{}", index % 7))
                    .json(&chat_body("m", &format!("{marker} {marker}"), true))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), 200);
                let body = response.text().await.unwrap();
                (index, body)
            })
        })
        .collect();
    for task in tasks {
        let (index, body) = task.await.unwrap();
        let content = stream_content(&body);
        assert!(
            sse_data(&body).last().is_some_and(|d| d == "[DONE]"),
            "{body}"
        );
        let marker = format!("q{index:03}");
        let expected = format!("You wrote: {marker} {marker}");
        assert!(content.starts_with(&expected), "{index}: {content}");
        let foreign = content
            .split(|c: char| !c.is_alphanumeric())
            .filter(|word| word.len() == 4 && word.starts_with('q'))
            .any(|word| word != marker);
        assert!(!foreign, "cross-talk in {index}: {content}");
    }
}

#[tokio::test]
async fn over_the_concurrency_limit_is_429_and_the_others_complete() {
    // 20 tokens/s: each answer takes a second or more, so two stay in flight.
    let sim = start_sim(&["--decode-tps", "20"]);
    let dir = ProxyDir::new();
    let policy = dir.policy(&format!(
        r#"
[limits]
max_concurrent_requests = 2

[[providers]]
name = "sim"
base_url = "{}/v1"
context_window = 4096

[[routes]]
model = "*"
provider = "sim"

# Response heads arrive at once without verification, so both streams are
# surely still running when the third request comes.
[verify]
enabled = false
"#,
        sim.url
    ));
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let client = client();
    let url = format!("{}/v1/chat/completions", proxy.url);
    let mut slow = Vec::new();
    for index in 0..2 {
        let response = client
            .post(&url)
            .bearer_auth("k")
            .json(&chat_body("m", &format!("slow answer {index}"), true))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        slow.push(response);
    }
    let refused = client
        .post(&url)
        .bearer_auth("k")
        .json(&chat_body("m", "one too many", false))
        .send()
        .await
        .unwrap();
    let body = assert_openai_error(refused, 429, "too_many_concurrent_requests").await;
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("2 concurrent")
    );
    for response in slow {
        let body = response.text().await.unwrap();
        assert!(
            sse_data(&body).last().is_some_and(|d| d == "[DONE]"),
            "{body}"
        );
    }
    // Slots are released when streams end.
    let after = client
        .post(&url)
        .bearer_auth("k")
        .json(&chat_body("m", "now there is room", false))
        .send()
        .await
        .unwrap();
    assert_eq!(after.status(), 200);
}

/// The proxy's `/metrics` text.
async fn metrics(client: &reqwest::Client, proxy: &str) -> String {
    client
        .get(format!("{proxy}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}
