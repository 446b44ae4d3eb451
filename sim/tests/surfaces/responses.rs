//! OpenAI's Responses API on a real socket: the response object, the typed
//! event stream, stored responses and `previous_response_id`, and the
//! failure modes.

use std::collections::HashSet;
use std::time::Duration;

use crate::common::*;
use canarygate_sim::SimConfig;
use serde_json::{Value, json};

const PATH: &str = "/v1/responses";

fn request(canaried: &Canaried, fields: Value) -> Value {
    let mut body = json!({"model": "sim-model", "instructions": canaried.system,
                          "input": canaried.user});
    for (key, value) in fields.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

/// The text of a response object's `output_text` parts.
fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().unwrap().clone())
        .map(|part| part["text"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn a_response_follows_the_instructions_in_openais_shape() {
    let sim = Sim::shared();
    let canaried = Canaried::new(1, "Plan the harbour survey");
    let reply = post(
        sim,
        PATH,
        Auth::OpenAi,
        &request(&canaried, json!({})),
        None,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(reply.header("x-request-id").starts_with("req_"));
    assert_eq!(reply.header("openai-version"), "2020-10-01");
    assert_eq!(reply.header("x-sim-context"), "own");
    let response = reply.json();
    assert_eq!(response["object"], "response");
    assert_eq!(response["status"], "completed");
    assert!(response["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(response["instructions"], canaried.system.as_str());
    assert_eq!(response["store"], true);
    assert_eq!(response["error"], Value::Null);
    assert_eq!(response["incomplete_details"], Value::Null);
    assert_eq!(response["text"], json!({"format": {"type": "text"}}));
    let message = &response["output"][0];
    assert_eq!(message["type"], "message");
    assert_eq!(message["role"], "assistant");
    assert_eq!(message["status"], "completed");
    assert!(message["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(message["content"][0]["type"], "output_text");
    assert_eq!(message["content"][0]["annotations"], json!([]));
    let text = output_text(&response);
    assert!(
        text.starts_with(&format!(
            "{} You wrote: Plan the harbour survey",
            canaried.opening()
        )),
        "{text}"
    );
    let usage = &response["usage"];
    let (input, output) = (
        usage["input_tokens"].as_u64().unwrap(),
        usage["output_tokens"].as_u64().unwrap(),
    );
    assert!(input > 20, "instructions and input: {input}");
    assert_eq!(usage["total_tokens"], input + output);
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 0);

    // A budget too small: incomplete, for max_output_tokens.
    let short = post(
        sim,
        PATH,
        Auth::OpenAi,
        &request(&canaried, json!({"max_output_tokens": 16})),
        None,
    )
    .await;
    let short = short.json();
    assert_eq!(short["status"], "incomplete");
    assert_eq!(
        short["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(short["output"][0]["status"], "incomplete");
    assert_eq!(short["usage"]["output_tokens"], 16);

    // Bad requests: 400 in OpenAI's shape, naming the param.
    let bad = post(
        sim,
        PATH,
        Auth::OpenAi,
        &json!({"model": "m", "input": 5}),
        None,
    )
    .await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["param"], "input");
    let unauthenticated = post(sim, PATH, Auth::None, &request(&canaried, json!({})), None).await;
    assert_eq!(unauthenticated.status, 401);
    assert_eq!(unauthenticated.json()["error"]["code"], "missing_api_key");
}

/// Checks the stream's framing: an `event:` line naming each event's type,
/// sequence numbers from 0, no `[DONE]`. Returns the events.
fn checked_events(reply: &Reply) -> Vec<Value> {
    assert_eq!(
        reply.header("content-type"),
        "text/event-stream; charset=utf-8"
    );
    let events = reply.events();
    assert!(!events.iter().any(|event| event.is_done()), "no [DONE]");
    let data = reply.event_data();
    for (number, (event, data)) in events.iter().zip(&data).enumerate() {
        assert_eq!(event.event.as_deref(), data["type"].as_str(), "{data}");
        assert_eq!(data["sequence_number"], number, "{data}");
    }
    data
}

#[tokio::test]
async fn a_stream_sends_the_typed_events_in_openais_order() {
    let sim = Sim::shared();
    let canaried = Canaried::new(2, "Chart the northern reef");
    let body = request(
        &canaried,
        json!({"model": "sim-reasoner", "stream": true,
        "reasoning": {"effort": "low", "summary": "auto"}}),
    );
    let reply = post(sim, PATH, Auth::OpenAi, &body, None).await;
    assert_eq!(reply.status, 200);
    let events = checked_events(&reply);
    let kinds: Vec<&str> = events
        .iter()
        .map(|event| event["type"].as_str().unwrap())
        .collect();
    let mut compact: Vec<&str> = kinds.clone();
    compact.dedup();
    assert_eq!(
        compact,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.reasoning_summary_part.added",
            "response.reasoning_summary_text.delta",
            "response.reasoning_summary_text.done",
            "response.reasoning_summary_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let created = &events[0]["response"];
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["output"], json!([]));
    assert_eq!(created["usage"], Value::Null);
    let id = created["id"].as_str().unwrap();
    let completed = &events.last().unwrap()["response"];
    assert_eq!(completed["id"], id);
    assert_eq!(completed["status"], "completed");

    // The deltas make the done texts and the final output.
    let joined = |kind: &str| -> String {
        events
            .iter()
            .filter(|event| event["type"] == kind)
            .map(|event| event["delta"].as_str().unwrap().to_owned())
            .collect()
    };
    let text = joined("response.output_text.delta");
    assert!(text.starts_with(&canaried.opening()), "{text}");
    assert_eq!(output_text(completed), text);
    let done = events
        .iter()
        .find(|e| e["type"] == "response.output_text.done")
        .unwrap();
    assert_eq!(done["text"], text.as_str());
    let delta = events
        .iter()
        .find(|e| e["type"] == "response.output_text.delta")
        .unwrap();
    assert_eq!(delta["output_index"], 1);
    assert_eq!(delta["content_index"], 0);
    assert_eq!(delta["logprobs"], json!([]));
    assert!(delta["obfuscation"].is_string());
    assert_eq!(delta["item_id"], completed["output"][1]["id"]);
    // The reasoning summary quotes the opening it was asked for.
    let summary = joined("response.reasoning_summary_text.delta");
    assert!(summary.contains(&canaried.opening()), "{summary}");
    let reasoning = &completed["output"][0];
    assert_eq!(reasoning["type"], "reasoning");
    assert_eq!(
        reasoning["summary"][0],
        json!({"type": "summary_text", "text": summary})
    );
    let usage = &completed["usage"];
    assert!(
        usage["output_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap()
            > 10
    );

    // Without a summary asked: a reasoning item with an empty summary, no
    // summary events, the thinking still counted.
    let quiet = request(&canaried, json!({"model": "sim-reasoner", "stream": true}));
    let quiet = checked_events(&post(sim, PATH, Auth::OpenAi, &quiet, None).await);
    assert!(
        !quiet
            .iter()
            .any(|e| e["type"].as_str().unwrap().contains("summary"))
    );
    let completed = &quiet.last().unwrap()["response"];
    assert_eq!(completed["output"][0]["summary"], json!([]));
    assert!(
        completed["usage"]["output_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap()
            > 10
    );
}

#[tokio::test]
async fn function_calls_come_whole_or_as_argument_deltas() {
    let sim = Sim::shared();
    let tools = json!([{"type": "function", "name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let body = json!({"model": "sim-model", "input": "use get_weather for Oslo", "tools": tools});
    let whole = post(sim, PATH, Auth::OpenAi, &body, None).await.json();
    let call = &whole["output"][0];
    assert_eq!(call["type"], "function_call");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["status"], "completed");
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    assert!(call["id"].as_str().unwrap().starts_with("fc_"));
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "use get_weather for Oslo"}));
    assert_eq!(whole["tools"], tools, "echoed");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = checked_events(&post(sim, PATH, Auth::OpenAi, &streamed, None).await);
    let added = events
        .iter()
        .find(|e| e["type"] == "response.output_item.added")
        .unwrap();
    assert_eq!(added["item"]["arguments"], "");
    assert_eq!(added["item"]["status"], "in_progress");
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .map(|e| e["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(deltas, call["arguments"].as_str().unwrap());
    let done = events
        .iter()
        .find(|e| e["type"] == "response.function_call_arguments.done")
        .unwrap();
    assert_eq!(done["arguments"], call["arguments"]);

    // The call's output goes back as an input item; the model reads it.
    let follow = json!({"model": "sim-model", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather in Oslo?"}]},
        {"type": "function_call", "call_id": call["call_id"], "name": "get_weather", "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
    ]});
    let reply = post(sim, PATH, Auth::OpenAi, &follow, None).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(output_text(&reply.json()).starts_with("You wrote: weather in Oslo?"));
}

#[tokio::test]
async fn stored_responses_are_fetched_deleted_and_continued() {
    let sim = Sim::shared();
    let first_turn = Canaried::new(3, "Survey the east quay");
    let first = post(
        sim,
        PATH,
        Auth::OpenAi,
        &request(&first_turn, json!({})),
        None,
    )
    .await
    .json();
    let id = first["id"].as_str().unwrap();
    let url = format!("{}{PATH}/{id}", sim.url);
    let fetched: Value = client()
        .get(&url)
        .bearer_auth("k")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(fetched, first);

    // The next turn reads the earlier input and output (not the earlier
    // instructions): the earlier tail canary is in its context again.
    let next =
        json!({"model": "sim-model", "input": "and the west quay?", "previous_response_id": id});
    let reply = post(sim, PATH, Auth::OpenAi, &next, None).await;
    let second = reply.json();
    assert_eq!(second["previous_response_id"], id);
    let text = output_text(&second);
    assert!(
        text.starts_with(&format!(
            "{} You wrote: and the west quay?",
            first_turn.tail
        )),
        "{text}"
    );
    assert_eq!(
        opening_canaries(&text),
        [first_turn.tail],
        "no instructions: no head"
    );
    assert!(
        second["usage"]["input_tokens"].as_u64().unwrap()
            > first["usage"]["input_tokens"].as_u64().unwrap()
    );
    assert_eq!(reply.header("x-sim-context"), "own");

    // Not stored: not fetched, not continued.
    let unstored = post(
        sim,
        PATH,
        Auth::OpenAi,
        &request(&first_turn, json!({"store": false})),
        None,
    )
    .await
    .json();
    let gone = client()
        .get(format!(
            "{}{PATH}/{}",
            sim.url,
            unstored["id"].as_str().unwrap()
        ))
        .bearer_auth("k")
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 404);
    let error: Value = gone.json().await.unwrap();
    assert_eq!(error["error"]["type"], "invalid_request_error");
    let orphan =
        json!({"model": "sim-model", "input": "x", "previous_response_id": "resp_nowhere"});
    let orphan = post(sim, PATH, Auth::OpenAi, &orphan, None).await;
    assert_eq!(orphan.status, 400);
    assert_eq!(
        orphan.json()["error"]["code"],
        "previous_response_not_found"
    );
    assert_eq!(orphan.json()["error"]["param"], "previous_response_id");

    let deleted = client().delete(&url).bearer_auth("k").send().await.unwrap();
    assert_eq!(deleted.status(), 200);
    assert!(deleted.headers().contains_key("x-request-id"));
    let deleted: Value = deleted.json().await.unwrap();
    assert_eq!(
        deleted,
        json!({"id": id, "object": "response.deleted", "deleted": true})
    );
    assert_eq!(
        client()
            .delete(&url)
            .bearer_auth("k")
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    assert_eq!(
        client()
            .get(&url)
            .bearer_auth("k")
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    assert_eq!(client().get(&url).send().await.unwrap().status(), 401);
}

#[tokio::test]
async fn failure_modes_break_responses_as_they_break_chat() {
    let sim = Sim::shared();
    let canaried = Canaried::new(4, "Count the moorings");
    let streamed = request(&canaried, json!({"stream": true}));

    // cut: half the events, then the connection ends; no response.completed.
    let (text, ended) = read_stream(
        sim,
        PATH,
        Auth::OpenAi,
        &streamed,
        Some("cut"),
        Duration::from_secs(10),
    )
    .await;
    assert!(ended);
    assert!(
        text.contains("response.output_text.delta") && !text.contains("response.completed"),
        "{text}"
    );
    let whole = try_post(
        sim,
        PATH,
        Auth::OpenAi,
        &request(&canaried, json!({})),
        Some("cut"),
        Duration::from_secs(10),
    )
    .await;
    assert!(whole.is_err(), "a cut body is an error: {whole:?}");

    // stall-mid-stream: some events, then silence with the connection open.
    let (text, ended) = read_stream(
        sim,
        PATH,
        Auth::OpenAi,
        &streamed,
        Some("stall-mid-stream"),
        Duration::from_millis(400),
    )
    .await;
    assert!(
        !ended && text.contains("response.output_text.delta"),
        "{text}"
    );
    // stall-first-byte: not even the head.
    let stalled = try_post(
        sim,
        PATH,
        Auth::OpenAi,
        &streamed,
        Some("stall-first-byte"),
        Duration::from_millis(300),
    )
    .await;
    assert_eq!(stalled.unwrap_err(), "timed out");

    // overloaded: half the events, an error event, response.failed; the
    // numbering runs on. Not streamed: 503.
    let reply = post(sim, PATH, Auth::OpenAi, &streamed, Some("overloaded")).await;
    let events = checked_events(&reply);
    let tail: Vec<&str> = events[events.len() - 2..]
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(tail, ["error", "response.failed"]);
    assert_eq!(events[events.len() - 2]["code"], "server_error");
    assert_eq!(events.last().unwrap()["response"]["status"], "failed");
    let refused = post(
        sim,
        PATH,
        Auth::OpenAi,
        &request(&canaried, json!({})),
        Some("overloaded"),
    )
    .await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.json()["error"]["type"], "server_error");

    // rate-limited: OpenAI's 429.
    let limited = post(sim, PATH, Auth::OpenAi, &streamed, Some("rate-limited")).await;
    assert_eq!(limited.status, 429);
    assert_eq!(limited.header("retry-after-ms"), "1000");
    assert_eq!(limited.header("x-ratelimit-remaining-requests"), "0");
    assert_eq!(limited.json()["error"]["code"], "rate_limit_exceeded");

    // truncate-head: the instructions are lost, and the head canary with them.
    let mut two_turns = request(&canaried, json!({}));
    two_turns["input"] = json!([{"role": "user", "content": "earlier question"},
                                {"role": "assistant", "content": "earlier answer"},
                                {"role": "user", "content": canaried.user}]);
    let truncated = post(sim, PATH, Auth::OpenAi, &two_turns, Some("truncate-head")).await;
    assert_eq!(truncated.header("x-sim-context"), "truncated");
    let text = output_text(&truncated.json());
    assert_eq!(opening_canaries(&text), [canaried.tail], "{text}");
    let truncated = post(sim, PATH, Auth::OpenAi, &two_turns, Some("truncate-tail")).await;
    assert_eq!(
        opening_canaries(&output_text(&truncated.json())),
        [canaried.head]
    );
}

#[tokio::test]
async fn swap_and_leak_cross_surfaces() {
    // Their own provider: "the most recent other request" must be ours.
    let sim = Sim::start(SimConfig {
        context_window: 8192,
        pool_tokens: Some(300),
        ..SimConfig::default()
    });
    let chat_turn = Canaried::new(5, "Chat question about tides");
    let chat = json!({"model": "sim-model", "messages": [
        {"role": "system", "content": chat_turn.system},
        {"role": "user", "content": chat_turn.user}]});
    let chat_reply = post(&sim, "/v1/chat/completions", Auth::OpenAi, &chat, None)
        .await
        .json();

    let ours = Canaried::new(6, "Responses question");
    let swapped = post(
        &sim,
        PATH,
        Auth::OpenAi,
        &request(&ours, json!({})),
        Some("swap"),
    )
    .await;
    assert_eq!(swapped.header("x-sim-context"), "swapped");
    assert_eq!(
        swapped.header("x-sim-context-from"),
        chat_reply["id"].as_str().unwrap()
    );
    let text = output_text(&swapped.json());
    assert!(
        text.starts_with(&format!("{} You wrote: Chat question", chat_turn.opening())),
        "{text}"
    );
    let swapped_id = swapped.json()["id"].as_str().unwrap().to_owned();

    // leak-on-overflow: a prompt over the prefill pool is answered from the
    // KV pages the earlier requests left, with one input token reported.
    let long = Canaried::new(7, &"padding words ".repeat(200));
    let leaked = post(
        &sim,
        PATH,
        Auth::OpenAi,
        &request(&long, json!({})),
        Some("leak-on-overflow"),
    )
    .await;
    assert_eq!(leaked.status, 200);
    assert_eq!(leaked.header("x-sim-context"), "stale");
    let from: HashSet<&str> = leaked.header("x-sim-context-from").split(',').collect();
    assert!(from.contains(swapped_id.as_str()), "{from:?}");
    let leaked = leaked.json();
    assert_eq!(leaked["usage"]["input_tokens"], 1);
    let opening = opening_canaries(&output_text(&leaked));
    let earlier = [ours.head, ours.tail, chat_turn.head, chat_turn.tail];
    assert!(
        !opening.is_empty() && opening.iter().all(|c| earlier.contains(c)),
        "{opening:?}"
    );
    let stats = sim.stats().await;
    assert_eq!(stats["swapped"], 1);
    assert_eq!(stats["placeholder_substitutions"], 1);
    assert_eq!(stats["surfaces"]["responses"], 2);
    assert_eq!(stats["surfaces"]["chat_completions"], 1);
    assert_eq!(stats["stored_responses"], 2);
}
