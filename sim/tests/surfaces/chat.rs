//! Chat completions through the pipeline every surface shares, on a real
//! socket: the answer and its stream, the `overloaded` mode, a swap from a
//! Messages request, and the stats of every surface.

use crate::common::*;
use canarygate_sim::SimConfig;
use serde_json::{Value, json};

const PATH: &str = "/v1/chat/completions";

fn request(canaried: &Canaried, stream: bool) -> Value {
    json!({"model": "sim-model", "stream": stream, "messages": [
        {"role": "system", "content": canaried.system},
        {"role": "user", "content": canaried.user}]})
}

#[tokio::test]
async fn chat_answers_streams_and_breaks_as_before() {
    let sim = Sim::shared();
    let canaried = Canaried::new(31, "Plan the harbour survey");
    let whole = post(sim, PATH, Auth::OpenAi, &request(&canaried, false), None)
        .await
        .json();
    let content = whole["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(content.starts_with(&canaried.opening()), "{content}");
    assert_eq!(whole["object"], "chat.completion");

    let reply = post(sim, PATH, Auth::OpenAi, &request(&canaried, true), None).await;
    assert_eq!(reply.header("content-type"), "text/event-stream");
    assert!(reply.events().last().unwrap().is_done());
    let streamed: String = reply
        .event_data()
        .iter()
        .filter_map(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(streamed, content);

    // overloaded: 503 whole; streamed, half the chunks then an error chunk.
    let refused = post(
        sim,
        PATH,
        Auth::OpenAi,
        &request(&canaried, false),
        Some("overloaded"),
    )
    .await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.json()["error"]["type"], "server_error");
    let broken = post(
        sim,
        PATH,
        Auth::OpenAi,
        &request(&canaried, true),
        Some("overloaded"),
    )
    .await;
    let chunks = broken.event_data();
    assert_eq!(chunks.last().unwrap()["error"]["message"], "Overloaded");
    assert!(chunks.len() > 3 && !broken.text.contains("[DONE]"));

    let mut huge = request(&canaried, false);
    huge["max_tokens"] = json!(u64::MAX);
    let huge = post(sim, PATH, Auth::OpenAi, &huge, None).await;
    assert_eq!(huge.status, 400);
    assert_eq!(huge.json()["error"]["code"], "context_length_exceeded");

    let models: Value = client()
        .get(format!("{}/v1/models", sim.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"].as_array().unwrap().len(), 5);
}

#[tokio::test]
async fn a_chat_swap_answers_from_a_messages_request_and_stats_count_every_surface() {
    let sim = Sim::start(SimConfig::default());
    let theirs = Canaried::new(32, "an Anthropic job's question");
    let message = json!({"model": "sim-model", "max_tokens": 100, "system": theirs.system,
                         "messages": [{"role": "user", "content": theirs.user}]});
    let message = post(&sim, "/v1/messages", Auth::Anthropic, &message, None)
        .await
        .json();
    let ours = Canaried::new(33, "our chat question");
    let swapped = post(
        &sim,
        PATH,
        Auth::OpenAi,
        &request(&ours, false),
        Some("swap"),
    )
    .await;
    assert_eq!(swapped.header("x-sim-context"), "swapped");
    assert_eq!(
        swapped.header("x-sim-context-from"),
        message["id"].as_str().unwrap()
    );
    let content = swapped.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        opening_canaries(&content),
        [theirs.head, theirs.tail],
        "{content}"
    );

    post(
        &sim,
        "/v1/embeddings",
        Auth::OpenAi,
        &json!({"model": "e", "input": "x"}),
        None,
    )
    .await;
    post(
        &sim,
        "/v1/completions",
        Auth::OpenAi,
        &json!({"model": "m", "prompt": "x"}),
        Some("rate-limited"),
    )
    .await;
    post(
        &sim,
        "/v1/responses",
        Auth::OpenAi,
        &json!({"model": "m", "input": "x"}),
        Some("overloaded"),
    )
    .await;
    let stats = sim.stats().await;
    assert_eq!(
        stats["surfaces"],
        json!({"chat_completions": 1, "responses": 1, "messages": 1, "completions": 1, "embeddings": 1})
    );
    assert_eq!(stats["requests"], 5);
    assert_eq!(stats["completed"], 3);
    assert_eq!(stats["swapped"], 1);
    assert_eq!(stats["rate_limited"], 1);
    assert_eq!(stats["overloaded"], 1);
}
