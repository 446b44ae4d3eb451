//! Endpoints with nothing to verify: embeddings (the openai SDK), the
//! Responses API's stored responses, `[endpoints] passthrough` paths and
//! the `unverifiable = "block"` switch; each recorded `unverifiable` with
//! its endpoint.

use std::process::Command;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use serde_json::{Value, json};

use crate::common::*;

fn policy(sim: &str, endpoints: &str) -> String {
    format!(
        r#"
[[providers]]
name = "sim"
base_url = "{sim}/v1"
context_window = 4096

[[routes]]
model = "embedder"
provider = "sim"
upstream_model = "sim-embed"

[[routes]]
model = "*"
provider = "sim"

[endpoints]
{endpoints}
"#
    )
}

/// POSTs a chat body to `path` exactly as written; the status and body.
async fn raw_post(url: &str, path: &str, key: &str) -> (u16, String) {
    let address = url.trim_start_matches("http://");
    let mut stream = TcpStream::connect(address).await.unwrap();
    let body =
        json!({"model": "sim-model", "messages": [{"role": "user", "content": "x"}]}).to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: {address}\r\nauthorization: {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    (status, answer)
}

#[tokio::test]
async fn unverifiable_endpoints_are_forwarded_and_recorded_or_refused() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let forwarding = dir.policy(&policy(&sim.url, "passthrough = [\"/v1/files\"]\n"));
    let proxy = start_proxy_with_policy(&dir, &forwarding, &[]);
    let http = client();
    let key = "Bearer sk-test-embeddings";

    // The official SDK: base64 asked for and decoded; the model renamed.
    let output = Command::new(python())
        .arg(workspace_root().join("tests/python/surface_embeddings.py"))
        .args([&format!("{}/v1", proxy.url), "embedder"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let seen: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(seen["vectors"], 2, "{seen}");
    assert!(seen["dimensions"].as_u64().unwrap() > 0, "{seen}");
    assert_eq!(seen["finite"], true, "{seen}");
    assert_eq!(seen["verdict"], "unverifiable", "{seen}");

    // A stored response (made at the provider) is fetched and deleted
    // through canarygate as the provider has it.
    let stored: Value = http
        .post(format!("{}/v1/responses", sim.url))
        .header("authorization", key)
        .json(&json!({"model": "sim-model", "input": "keep this"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = stored["id"].as_str().unwrap();
    let fetched = http
        .get(format!("{}/v1/responses/{id}", proxy.url))
        .header("authorization", key)
        .send()
        .await
        .unwrap();
    assert_eq!(fetched.status(), 200);
    assert_eq!(fetched.json::<Value>().await.unwrap()["id"], id);
    let deleted = http
        .delete(format!("{}/v1/responses/{id}", proxy.url))
        .header("authorization", key)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    let gone = http
        .get(format!("{}/v1/responses/{id}", proxy.url))
        .header("authorization", key)
        .send()
        .await
        .unwrap();
    // The provider's own 404, in OpenAI's shape, passed on.
    assert_eq!(gone.status(), 404);
    assert!(gone.json::<Value>().await.unwrap()["error"].is_object());

    // A listed path is forwarded (the simulator has no files API: its 404
    // comes back); an unlisted one is canarygate's 404, and so is a path
    // that would climb out of the listed prefix.
    let listed = http
        .get(format!("{}/v1/files?limit=1", proxy.url))
        .header("authorization", key)
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status(), 404);
    assert!(
        listed.headers().contains_key("x-canarygate-session"),
        "forwarded by canarygate"
    );
    // HTTP clients normalise `..` away: these go out raw.
    for path in [
        "/v1/audio/speech",
        "/v1/files/../chat/completions",
        "/v1/files/%2e%2e/chat/completions",
        "/v1/files/..%2fchat/completions",
    ] {
        let (status, body) = raw_post(&proxy.url, path, key).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert!(body.contains("unknown_url"), "{path}: {body}");
    }
    let stats = sim_stats(&sim).await;
    assert_eq!(
        stats["surfaces"]["chat_completions"].as_u64(),
        Some(0),
        "nothing reached the provider's chat endpoint: {stats}"
    );
    assert_eq!(stats["surfaces"]["embeddings"].as_u64(), Some(1), "{stats}");

    let records = audit_export(&dir.data());
    let endpoints: Vec<(&str, &str)> = records
        .iter()
        .map(|record| {
            (
                record["endpoint"].as_str().unwrap_or("-"),
                record["verdict"].as_str().unwrap(),
            )
        })
        .collect();
    assert!(
        endpoints.contains(&("embeddings", "unverifiable")),
        "{endpoints:?}"
    );
    assert!(
        endpoints.contains(&("responses_stored", "unverifiable")),
        "{endpoints:?}"
    );
    assert!(
        endpoints.contains(&("passthrough", "unverifiable")),
        "{endpoints:?}"
    );
    let embedded = records
        .iter()
        .find(|record| record["endpoint"] == "embeddings")
        .unwrap();
    assert_eq!(embedded["model"], "embedder");
    assert_eq!(embedded["canary_ids"], json!([]));

    // The switch: unverifiable endpoints refused, nothing forwarded.
    let blocking_dir = ProxyDir::new();
    let blocking = blocking_dir.policy(&policy(
        &sim.url,
        "unverifiable = \"block\"\npassthrough = [\"/v1/files\"]\n",
    ));
    let strict = start_proxy_with_policy(&blocking_dir, &blocking, &[]);
    let before = sim_stats(&sim).await;
    for (path, body) in [
        (
            "/v1/embeddings",
            Some(json!({"model": "embedder", "input": "x"})),
        ),
        ("/v1/files", None),
    ] {
        let mut request = http
            .post(format!("{}{path}", strict.url))
            .header("authorization", key);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let refused = request.send().await.unwrap();
        assert_eq!(refused.status(), 403, "{path}");
        let body: Value = refused.json().await.unwrap();
        assert_eq!(
            body["error"]["code"], "canarygate_unverifiable_endpoint",
            "{path}: {body}"
        );
    }
    assert_eq!(
        sim_stats(&sim).await["requests"],
        before["requests"],
        "nothing was forwarded"
    );

    // A body that is not JSON is refused in the words of the parser, as on
    // the verified endpoints.
    let refused = http
        .post(format!("{}/v1/embeddings", proxy.url))
        .header("authorization", key)
        .header("content-type", "application/json")
        .body(r#"{"model": "embedder", "input": "x"} and more"#)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    let body: Value = refused.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("trailing characters"), "{body}");
    // And a model that is not a name, as there.
    let refused = http
        .post(format!("{}/v1/embeddings", proxy.url))
        .header("authorization", key)
        .json(&json!({"model": 5, "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["param"], "model", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("non-empty string"),
        "{body}"
    );
}

/// A provider that answers any path with which provider it is and what it
/// was sent.
async fn naming_upstream(name: &'static str) -> String {
    use axum::Router;
    use axum::http::{HeaderMap, Uri};
    let app = Router::new().fallback(move |uri: Uri, headers: HeaderMap| async move {
        let header = |key: &str| {
            headers
                .get(key)
                .map(|value| value.to_str().unwrap().to_owned())
        };
        axum::Json(
            json!({"provider": name, "path": uri.path(), "query": uri.query(),
                          "x-api-key": header("x-api-key"),
                          "authorization": header("authorization"),
                          "anthropic-version": header("anthropic-version")}),
        )
    });
    serve_upstream(app).await
}

/// A passthrough path of Anthropic's API (`/v1/messages/batches`), or any
/// listed path an Anthropic client asks for, goes to the Anthropic
/// provider with Anthropic's headers; an OpenAI client's to the OpenAI one.
#[tokio::test]
async fn anthropic_passthrough_paths_go_to_the_anthropic_provider() {
    let openai = naming_upstream("openai").await;
    let anthropic = naming_upstream("anthropic").await;
    let dir = ProxyDir::new();
    let policy = dir.policy(&format!(
        r#"
[[providers]]
name = "openai"
base_url = "{openai}/v1"
context_window = 4096

[[providers]]
name = "anthropic"
api = "anthropic"
base_url = "{anthropic}/v1"
context_window = 4096

[[routes]]
model = "*"
provider = "openai"

[[routes]]
model = "*"
provider = "anthropic"

[endpoints]
passthrough = ["/v1/messages/batches", "/v1/files"]
"#
    ));
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let http = client();
    let batches: Value = http
        .post(format!("{}/v1/messages/batches", proxy.url))
        .header("x-api-key", "sk-ant-test")
        .header("anthropic-version", "2023-06-01")
        .json(&json!({"requests": []}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(batches["provider"], "anthropic", "{batches}");
    assert_eq!(batches["path"], "/v1/messages/batches", "{batches}");
    assert_eq!(batches["x-api-key"], "sk-ant-test", "{batches}");
    assert!(batches["anthropic-version"].is_string(), "{batches}");
    let files: Value = http
        .post(format!("{}/v1/files?purpose=batch", proxy.url))
        .bearer_auth("sk-test")
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(files["provider"], "openai", "{files}");
    assert_eq!(files["query"], "purpose=batch", "{files}");
    // A path of Anthropic's that is not listed: Anthropic's error shape.
    let unknown = http
        .post(format!("{}/v1/messages/nothing", proxy.url))
        .header("x-api-key", "sk-ant-test")
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    let error: Value = unknown.json().await.unwrap();
    assert_eq!(error["type"], "error", "{error}");
}
