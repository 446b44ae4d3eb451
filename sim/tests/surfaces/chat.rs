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

/// `store: true` keeps the completion and its messages, as OpenAI's stored
/// completions: read, listed by metadata, updated, their messages listed,
/// deleted; a completion not asked to be stored is not kept.
#[tokio::test]
async fn stored_completions_are_read_listed_updated_and_deleted() {
    let sim = Sim::shared();
    let canaried = Canaried::new(47, "Count the lighthouses");
    let mut body = request(&canaried, false);
    body["store"] = json!(true);
    body["metadata"] = json!({"survey": "coast-47"});
    let stored = post(sim, PATH, Auth::OpenAi, &body, None).await.json();
    let id = stored["id"].as_str().unwrap();
    let url = format!("{}{PATH}/{id}", sim.url);
    // One call of a stored-completion endpoint: its status and JSON body.
    let call = |method: reqwest::Method, url: String, body: Option<Value>| async move {
        let mut request = client().request(method, url).bearer_auth("k");
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        (
            status,
            response.json::<Value>().await.unwrap_or(Value::Null),
        )
    };
    let get = |url: String| async move { call(reqwest::Method::GET, url, None).await.1 };
    let read = get(url.clone()).await;
    assert_eq!(read["choices"], stored["choices"]);
    assert_eq!(read["metadata"], json!({"survey": "coast-47"}));
    let messages = get(format!("{url}/messages")).await;
    let contents: Vec<&Value> = messages["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|message| &message["content"])
        .collect();
    assert_eq!(contents, [&json!(canaried.system), &json!(canaried.user)]);
    let listed = get(format!("{}{PATH}?metadata[survey]=coast-47", sim.url)).await;
    assert_eq!(listed["data"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed["data"][0]["id"], id);

    let metadata = json!({"metadata": {"survey": "coast-47", "checked": "yes"}});
    let (_, updated) = call(reqwest::Method::POST, url.clone(), Some(metadata)).await;
    assert_eq!(updated["metadata"]["checked"], "yes");
    let (_, deleted) = call(reqwest::Method::DELETE, url.clone(), None).await;
    assert_eq!(deleted["deleted"], true);
    assert_eq!(call(reqwest::Method::GET, url, None).await.0, 404);

    let unstored = post(sim, PATH, Auth::OpenAi, &request(&canaried, false), None)
        .await
        .json();
    let url = format!("{}{PATH}/{}", sim.url, unstored["id"].as_str().unwrap());
    assert_eq!(call(reqwest::Method::GET, url, None).await.0, 404);
}
