//! `canarygate engine` end to end: init-tiny, generate --json, and serve over real HTTP.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use canarygate_engine::{Engine, EngineConfig, GenerationRequest};
use serde_json::Value;

fn canarygate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_canarygate"))
}

fn init_tiny(dir: &Path) {
    let status = canarygate()
        .args(["engine", "init-tiny"])
        .arg(dir)
        .args(["--seed", "7"])
        .status()
        .unwrap();
    assert!(status.success());
}

fn generate_json(dir: &Path) -> Value {
    let out = canarygate()
        .args(["engine", "generate", "--model"])
        .arg(dir)
        .args([
            "--prompt",
            "hello canary",
            "--max-tokens",
            "8",
            "--greedy",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("KV pool holds"),
        "capacity not printed: {stderr}"
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn init_tiny_then_generate_json_matches_the_library() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    init_tiny(&model);
    let first = generate_json(&model);
    // Byte-level tokenizer: each ASCII byte is its own id.
    let prompt_ids: Vec<u32> = "hello canary".bytes().map(u32::from).collect();
    assert_eq!(first["prompt_ids"], serde_json::json!(prompt_ids));
    let generated: Vec<u32> = serde_json::from_value(first["generated_ids"].clone()).unwrap();
    assert!(!generated.is_empty() && generated.len() <= 8);
    assert!(first["text"].is_string());
    // Deterministic, and the same as the in-process API.
    assert_eq!(generate_json(&model), first);
    let engine = Engine::start(EngineConfig::new(&model)).unwrap();
    let library = engine
        .submit(GenerationRequest::greedy(prompt_ids, 8))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(library.token_ids, generated);
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_server(model: &Path) -> (Server, String) {
    let mut child = canarygate()
        .args([
            "engine",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--max-context",
            "64",
            "--model",
        ])
        .arg(model)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let server = Server(child);
    for line in BufReader::new(stderr).lines() {
        let line = line.unwrap();
        if let Some(url) = line.split("listening on ").nth(1) {
            return (server, url.trim().to_string());
        }
    }
    panic!("server exited before listening");
}

#[tokio::test(flavor = "multi_thread")]
async fn serve_chat_completions_stream_and_context_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    init_tiny(&model);
    let (_server, base) = start_server(&model);
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/chat/completions");

    let body = serde_json::json!({"messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6, "temperature": 0.0});
    let response = client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let json: Value = response.json().await.unwrap();
    assert_eq!(json["object"], "chat.completion");
    let completion_tokens = json["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=6).contains(&completion_tokens));
    // The chat template of the tiny model: bos + header + "hi" + eot + assistant header.
    assert_eq!(json["usage"]["prompt_tokens"], 25);
    let content = json["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();

    let mut stream_body = body.clone();
    stream_body["stream"] = Value::Bool(true);
    let response = client.post(&url).json(&stream_body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(
        streamed, content,
        "stream and non-stream differ for greedy decoding"
    );

    let long = "x".repeat(80);
    let over =
        serde_json::json!({"messages": [{"role": "user", "content": long}], "max_tokens": 4});
    let response = client.post(&url).json(&over).send().await.unwrap();
    assert_eq!(response.status(), 400);
    let json: Value = response.json().await.unwrap();
    assert_eq!(json["error"]["code"], "context_length_exceeded");
    let message = json["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("64") && message.contains("107"),
        "{message}"
    );

    let response = client.post(&url).body("not json").send().await.unwrap();
    assert_eq!(response.status(), 400);
    let json: Value = response.json().await.unwrap();
    assert_eq!(json["error"]["type"], "invalid_request_error");
}
