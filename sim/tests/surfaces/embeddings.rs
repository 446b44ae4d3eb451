//! Embeddings on a real socket: float and base64 vectors, dimensions,
//! batches, and the failure modes (a swapped context embeds someone
//! else's text).

use std::time::Duration;

use crate::common::*;
use canarygate_sim::SimConfig;
use serde_json::{Value, json};

const PATH: &str = "/v1/embeddings";

/// Decodes standard base64 (padded) little-endian `f32`s.
fn decode(text: &str) -> Vec<f32> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let mut bytes = Vec::new();
    for group in text.as_bytes().chunks(4) {
        let digits: Vec<u8> = group
            .iter()
            .filter(|c| **c != b'=')
            .map(|c| value(*c))
            .collect();
        let word = digits
            .iter()
            .enumerate()
            .fold(0u32, |word, (i, d)| word | u32::from(*d) << (18 - 6 * i));
        bytes.extend(word.to_be_bytes()[1..digits.len()].iter());
    }
    bytes
        .chunks(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn vector(item: &Value) -> Vec<f32> {
    match &item["embedding"] {
        Value::String(text) => decode(text),
        Value::Array(values) => values.iter().map(|v| v.as_f64().unwrap() as f32).collect(),
        other => panic!("not an embedding: {other}"),
    }
}

fn norm(vector: &[f32]) -> f32 {
    vector.iter().map(|x| x * x).sum::<f32>().sqrt()
}

#[tokio::test]
async fn vectors_come_as_floats_or_base64_in_openais_shape() {
    let sim = Sim::shared();
    let body = |format: &str| {
        json!({"model": "sim-embed", "input": ["the harbour survey", "a reef chart"],
                                     "encoding_format": format})
    };
    let floats = post(sim, PATH, Auth::OpenAi, &body("float"), None).await;
    assert_eq!(floats.status, 200, "{}", floats.text);
    assert!(floats.header("x-request-id").starts_with("req_"));
    assert_eq!(floats.header("x-sim-context"), "own");
    let floats = floats.json();
    assert_eq!(floats["object"], "list");
    assert_eq!(floats["model"], "sim-embed");
    assert_eq!(
        floats["usage"],
        json!({"prompt_tokens": 6, "total_tokens": 6})
    );
    let data = floats["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    for (index, item) in data.iter().enumerate() {
        assert_eq!(item["object"], "embedding");
        assert_eq!(item["index"], index);
        let vector = vector(item);
        assert_eq!(vector.len(), 1536);
        assert!((norm(&vector) - 1.0).abs() < 1e-4);
    }
    // base64 (what the openai SDK asks for by default) holds the same numbers.
    let encoded = post(sim, PATH, Auth::OpenAi, &body("base64"), None)
        .await
        .json();
    assert!(encoded["data"][0]["embedding"].is_string());
    assert_eq!(vector(&encoded["data"][0]), vector(&data[0]));
    assert_ne!(vector(&data[0]), vector(&data[1]));

    let short = json!({"model": "sim-embed", "input": [[17, 42, 9]], "dimensions": 16});
    let short = post(sim, PATH, Auth::OpenAi, &short, None).await.json();
    let vector = vector(&short["data"][0]);
    assert_eq!(vector.len(), 16);
    assert!((norm(&vector) - 1.0).abs() < 1e-4);
    assert_eq!(short["usage"]["prompt_tokens"], 3, "one token per id");

    for bad in [
        json!({"model": "m", "input": ""}),
        json!({"model": "m", "input": "x", "dimensions": 0}),
    ] {
        let reply = post(sim, PATH, Auth::OpenAi, &bad, None).await;
        assert_eq!(reply.status, 400, "{bad}");
        assert_eq!(reply.json()["error"]["type"], "invalid_request_error");
    }
}

#[tokio::test]
async fn failure_modes_reach_embeddings() {
    let sim = Sim::shared();
    let body =
        json!({"model": "sim-embed", "input": "count the moorings", "encoding_format": "float"});
    let cut = try_post(
        sim,
        PATH,
        Auth::OpenAi,
        &body,
        Some("cut"),
        Duration::from_secs(10),
    )
    .await;
    assert!(cut.is_err(), "{cut:?}");
    let stalled = try_post(
        sim,
        PATH,
        Auth::OpenAi,
        &body,
        Some("stall-first-byte"),
        Duration::from_millis(300),
    )
    .await;
    assert!(stalled.is_err());
    let limited = post(sim, PATH, Auth::OpenAi, &body, Some("rate-limited")).await;
    assert_eq!(limited.status, 429);
    assert_eq!(limited.header("retry-after"), "1");
    let overloaded = post(sim, PATH, Auth::OpenAi, &body, Some("overloaded")).await;
    assert_eq!(overloaded.status, 503);
    let truncated = post(sim, PATH, Auth::OpenAi, &body, Some("truncate-tail")).await;
    assert_eq!(truncated.header("x-sim-context"), "truncated");
    assert_eq!(
        truncated.json()["usage"]["prompt_tokens"],
        2,
        "a third of three tokens dropped"
    );
}

#[tokio::test]
async fn a_swapped_context_embeds_the_other_requests_text() {
    let sim = Sim::start(SimConfig::default());
    let body =
        |input: &str| json!({"model": "sim-embed", "input": input, "encoding_format": "float"});
    let theirs = post(
        &sim,
        PATH,
        Auth::OpenAi,
        &body("someone else's private notes"),
        None,
    )
    .await
    .json();
    let ours = post(
        &sim,
        PATH,
        Auth::OpenAi,
        &body("our own question"),
        Some("swap"),
    )
    .await;
    assert_eq!(ours.header("x-sim-context"), "swapped");
    assert!(ours.header("x-sim-context-from").starts_with("embd-sim-"));
    let ours = ours.json();
    assert_eq!(vector(&ours["data"][0]), vector(&theirs["data"][0]));
    assert_eq!(ours["usage"]["prompt_tokens"], 3, "our own usage");
    let honest = post(&sim, PATH, Auth::OpenAi, &body("our own question"), None)
        .await
        .json();
    assert_ne!(vector(&honest["data"][0]), vector(&theirs["data"][0]));
    assert_eq!(sim.stats().await["surfaces"]["embeddings"], 3);
}
