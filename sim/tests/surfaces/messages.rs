//! Anthropic's Messages API on a real socket: authentication, the message
//! object, the event stream, thinking, tools, prompt caching as Anthropic
//! reports it, `count_tokens`, Anthropic's errors, and the failure modes.

use std::time::Duration;

use crate::common::*;
use canarygate_sim::SimConfig;
use serde_json::{Value, json};

const PATH: &str = "/v1/messages";

fn request(canaried: &Canaried, fields: Value) -> Value {
    let mut body = json!({"model": "sim-model", "max_tokens": 300, "system": canaried.system,
                          "messages": [{"role": "user", "content": canaried.user}]});
    for (key, value) in fields.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

fn text_of(message: &Value) -> String {
    message["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|block| block["type"] == "text")
        .map(|block| block["text"].as_str().unwrap().to_owned())
        .collect()
}

/// Checks an Anthropic error: status, type, and the body's shape.
fn assert_error(reply: &Reply, status: u16, kind: &str) {
    assert_eq!(reply.status, status, "{}", reply.text);
    let body = reply.json();
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], kind, "{body}");
    assert!(body["error"]["message"].is_string());
    assert_eq!(body["request_id"], reply.header("request-id"));
}

#[tokio::test]
async fn a_message_follows_the_system_prompt_in_anthropics_shape() {
    let sim = Sim::shared();
    let canaried = Canaried::new(11, "Plan the harbour survey");
    let reply = post(
        sim,
        PATH,
        Auth::Anthropic,
        &request(&canaried, json!({})),
        None,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(reply.header("request-id").starts_with("req_011C"));
    assert!(!reply.header("anthropic-organization-id").is_empty());
    assert!(
        !reply
            .header("anthropic-ratelimit-requests-remaining")
            .is_empty()
    );
    assert!(
        reply
            .header("anthropic-ratelimit-tokens-reset")
            .ends_with('Z')
    );
    assert!(
        reply.headers.get("x-request-id").is_none(),
        "no OpenAI headers"
    );
    assert_eq!(reply.header("x-sim-context"), "own");
    let message = reply.json();
    assert!(message["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(message["type"], "message");
    assert_eq!(message["role"], "assistant");
    assert_eq!(message["model"], "sim-model");
    assert_eq!(message["stop_reason"], "end_turn");
    assert_eq!(message["stop_sequence"], Value::Null);
    let text = text_of(&message);
    assert!(
        text.starts_with(&format!(
            "{} You wrote: Plan the harbour survey",
            canaried.opening()
        )),
        "{text}"
    );
    let usage = &message["usage"];
    assert!(usage["input_tokens"].as_u64().unwrap() > 20);
    assert_eq!(usage["cache_creation_input_tokens"], 0);
    assert_eq!(usage["cache_read_input_tokens"], 0);
    assert_eq!(usage["service_tier"], "standard");
    assert!(usage["output_tokens"].as_u64().unwrap() > 10);

    // System as blocks and content as blocks read the same.
    let blocks = json!({"model": "sim-model", "max_tokens": 300,
        "system": [{"type": "text", "text": canaried.system}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": canaried.user}]}]});
    let same = post(sim, PATH, Auth::Anthropic, &blocks, None).await.json();
    assert_eq!(text_of(&same), text);

    // max_tokens cuts: stop_reason max_tokens.
    let short = post(
        sim,
        PATH,
        Auth::Anthropic,
        &request(&canaried, json!({"max_tokens": 3})),
        None,
    )
    .await
    .json();
    assert_eq!(short["stop_reason"], "max_tokens");
    assert_eq!(short["usage"]["output_tokens"], 3);

    // count_tokens agrees with the input the message reported.
    let mut count = request(&canaried, json!({}));
    count.as_object_mut().unwrap().remove("max_tokens");
    let counted = post(
        sim,
        "/v1/messages/count_tokens",
        Auth::Anthropic,
        &count,
        None,
    )
    .await;
    assert_eq!(
        counted.json(),
        json!({"input_tokens": usage["input_tokens"]})
    );
    assert!(counted.header("request-id").starts_with("req_"));
}

#[tokio::test]
async fn authentication_version_and_bad_bodies_get_anthropics_errors() {
    let sim = Sim::shared();
    let canaried = Canaried::new(12, "hello");
    let body = request(&canaried, json!({}));
    let anonymous = post(sim, PATH, Auth::None, &body, None).await;
    assert_error(&anonymous, 401, "authentication_error");
    assert_eq!(
        anonymous.json()["error"]["message"],
        "x-api-key header is required"
    );

    // The anthropic SDK 2.x sends the key as a bearer token: accepted.
    let bearer = client()
        .post(format!("{}{PATH}", sim.url))
        .bearer_auth("sk-ant")
        .header("anthropic-version", "2023-06-01")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(bearer.status(), 200);
    let unversioned = client()
        .post(format!("{}{PATH}", sim.url))
        .header("x-api-key", "k")
        .json(&body)
        .send()
        .await
        .unwrap();
    let unversioned = Reply {
        status: unversioned.status().as_u16(),
        headers: unversioned.headers().clone(),
        text: unversioned.text().await.unwrap(),
    };
    assert_error(&unversioned, 400, "invalid_request_error");
    assert_eq!(
        unversioned.json()["error"]["message"],
        "anthropic-version: header is required"
    );

    let mut no_budget = body.clone();
    no_budget.as_object_mut().unwrap().remove("max_tokens");
    let refused = post(sim, PATH, Auth::Anthropic, &no_budget, None).await;
    assert_error(&refused, 400, "invalid_request_error");
    assert_eq!(
        refused.json()["error"]["message"],
        "max_tokens: Field required"
    );
    let thinking = request(
        &canaried,
        json!({"thinking": {"type": "enabled", "budget_tokens": 100}}),
    );
    assert_error(
        &post(sim, PATH, Auth::Anthropic, &thinking, None).await,
        400,
        "invalid_request_error",
    );
}

/// Checks the stream's framing (an `event:` line naming each type) and
/// returns the events.
fn checked_events(reply: &Reply) -> Vec<Value> {
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(
        reply.header("content-type"),
        "text/event-stream; charset=utf-8"
    );
    let data = reply.event_data();
    for (event, data) in reply.events().iter().zip(&data) {
        assert_eq!(event.event.as_deref(), data["type"].as_str(), "{data}");
    }
    data
}

#[tokio::test]
async fn a_stream_thinks_signs_and_answers_in_anthropics_order() {
    let sim = Sim::shared();
    let canaried = Canaried::new(13, "Chart the northern reef");
    let body = request(
        &canaried,
        json!({"stream": true, "max_tokens": 2000,
        "thinking": {"type": "enabled", "budget_tokens": 1024}}),
    );
    let events = checked_events(&post(sim, PATH, Auth::Anthropic, &body, None).await);
    let kinds: Vec<String> = events
        .iter()
        .map(|event| match event["delta"]["type"].as_str() {
            Some(delta) => format!("{}:{delta}", event["type"].as_str().unwrap()),
            None => event["type"].as_str().unwrap().to_owned(),
        })
        .collect();
    let mut compact = kinds.clone();
    compact.dedup();
    assert_eq!(
        compact,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta:thinking_delta",
            "content_block_delta:signature_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta:text_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let start = &events[0]["message"];
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert!(start["usage"]["input_tokens"].as_u64().unwrap() > 20);
    assert_eq!(
        events[1]["content_block"],
        json!({"type": "thinking", "thinking": "", "signature": ""})
    );
    let joined = |delta: &str, field: &str| -> String {
        events
            .iter()
            .filter(|event| event["delta"]["type"] == delta)
            .map(|event| event["delta"][field].as_str().unwrap().to_owned())
            .collect()
    };
    let thinking = joined("thinking_delta", "thinking");
    assert!(
        thinking.contains(&canaried.opening()),
        "the thinking quotes the opening: {thinking}"
    );
    let text = joined("text_delta", "text");
    assert!(text.starts_with(&canaried.opening()), "{text}");
    assert!(joined("signature_delta", "signature").len() >= 64);
    let text_start = events
        .iter()
        .find(|e| e["content_block"]["type"] == "text")
        .unwrap();
    assert_eq!(text_start["index"], 1);
    let delta = &events[events.len() - 2];
    assert_eq!(
        delta["delta"],
        json!({"stop_reason": "end_turn", "stop_sequence": null})
    );

    // The same request whole: the same blocks, the same usage.
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let message = post(sim, PATH, Auth::Anthropic, &whole, None).await.json();
    assert_eq!(message["content"][0]["type"], "thinking");
    assert_eq!(message["content"][0]["thinking"], thinking.as_str());
    // Its own signature: bound to its message.
    let signature = message["content"][0]["signature"].as_str().unwrap();
    assert!(signature.len() >= 64 && signature != joined("signature_delta", "signature"));
    assert_eq!(text_of(&message), text);
    assert_eq!(
        delta["usage"]["output_tokens"],
        message["usage"]["output_tokens"]
    );
}

#[tokio::test]
async fn tools_are_used_whole_or_as_input_json_deltas() {
    let sim = Sim::shared();
    let tools = json!([{"name": "get_weather", "description": "Weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let body = json!({"model": "sim-model", "max_tokens": 300, "tools": tools,
        "messages": [{"role": "user", "content": "use get_weather for Oslo"}]});
    let message = post(sim, PATH, Auth::Anthropic, &body, None).await.json();
    assert_eq!(message["stop_reason"], "tool_use");
    let block = &message["content"][0];
    assert_eq!(block["type"], "tool_use");
    assert_eq!(block["name"], "get_weather");
    assert!(block["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(block["input"], json!({"city": "use get_weather for Oslo"}));

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = checked_events(&post(sim, PATH, Auth::Anthropic, &streamed, None).await);
    let start = events
        .iter()
        .find(|e| e["type"] == "content_block_start")
        .unwrap();
    let opened = &start["content_block"];
    assert_eq!(opened["type"], "tool_use");
    assert!(opened["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(opened["name"], "get_weather");
    assert_eq!(opened["input"], json!({}));
    let partial: String = events
        .iter()
        .filter(|e| e["delta"]["type"] == "input_json_delta")
        .map(|e| e["delta"]["partial_json"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&partial).unwrap(),
        block["input"]
    );

    // The result goes back; the model reads the turn around it.
    let follow = json!({"model": "sim-model", "max_tokens": 300, "tools": tools, "messages": [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": [block]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "sunny"}]},
    ]});
    let answer = post(sim, PATH, Auth::Anthropic, &follow, None).await.json();
    assert_eq!(answer["stop_reason"], "end_turn");
    assert!(text_of(&answer).starts_with("You wrote: weather in Oslo?"));
}

#[tokio::test]
async fn prompt_caching_reads_and_writes_at_breakpoints() {
    let sim = Sim::start(SimConfig::default());
    let rules = "Rule: keep every mooring logged and every buoy checked. ".repeat(120);
    let cached = |question: &str| {
        json!({"model": "sim-model", "max_tokens": 50,
            "system": [{"type": "text", "text": rules, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": question}]})
    };
    let usage = |reply: Reply| reply.json()["usage"].clone();
    let first = usage(post(&sim, PATH, Auth::Anthropic, &cached("first question"), None).await);
    let written = first["cache_creation_input_tokens"].as_u64().unwrap();
    assert!(written > 1024, "the system prompt is written: {first}");
    assert_eq!(first["cache_read_input_tokens"], 0);
    assert_eq!(
        first["cache_creation"]["ephemeral_5m_input_tokens"],
        written
    );
    let second = usage(
        post(
            &sim,
            PATH,
            Auth::Anthropic,
            &cached("second question"),
            None,
        )
        .await,
    );
    assert_eq!(second["cache_read_input_tokens"], written, "{second}");
    assert_eq!(second["cache_creation_input_tokens"], 0);
    // input_tokens is what is neither read nor written.
    let mut count = cached("second question");
    count.as_object_mut().unwrap().remove("max_tokens");
    let total = post(
        &sim,
        "/v1/messages/count_tokens",
        Auth::Anthropic,
        &count,
        None,
    )
    .await
    .json()["input_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(second["input_tokens"].as_u64().unwrap() + written, total);
    // Streamed, message_start reports it.
    let mut streamed = cached("third question");
    streamed["stream"] = json!(true);
    let events = post(&sim, PATH, Auth::Anthropic, &streamed, None)
        .await
        .event_data();
    assert_eq!(
        events[0]["message"]["usage"]["cache_read_input_tokens"],
        written
    );

    // No breakpoint, no caching, however often the prefix repeats.
    for _ in 0..2 {
        let plain = json!({"model": "sim-model", "max_tokens": 50, "system": rules,
            "messages": [{"role": "user", "content": "plain"}]});
        let plain = usage(post(&sim, PATH, Auth::Anthropic, &plain, None).await);
        assert_eq!(plain["cache_read_input_tokens"], 0);
        assert_eq!(plain["cache_creation_input_tokens"], 0);
    }
    // Below the minimum: nothing cached, no error.
    let short = json!({"model": "sim-model", "max_tokens": 50,
        "system": [{"type": "text", "text": "Short rules.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "q"}]});
    for _ in 0..2 {
        let short = usage(post(&sim, PATH, Auth::Anthropic, &short, None).await);
        assert_eq!(short["cache_creation_input_tokens"], 0);
        assert_eq!(short["cache_read_input_tokens"], 0);
    }
}

/// A conversation marking its last user turn each time (Anthropic's
/// multi-turn pattern) reads the turn before from the cache: a hit is looked
/// for at the message ends before a breakpoint, though only the breakpoint
/// is written.
#[tokio::test]
async fn a_breakpoint_moved_to_the_last_turn_reads_the_turn_before() {
    let sim = Sim::start(SimConfig::default());
    let long = |turn: usize| format!("Turn {turn}: ") + &"the mooring log grows. ".repeat(300);
    let marked = |text: String| {
        json!({"role": "user", "content": [
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]})
    };
    let mut history = vec![];
    let mut last_written = 0;
    for turn in 0..3 {
        let mut messages = history.clone();
        messages.push(marked(long(turn)));
        let body = json!({"model": "sim-model", "max_tokens": 20, "messages": messages});
        let answer = post(&sim, PATH, Auth::Anthropic, &body, None).await.json();
        let usage = &answer["usage"];
        let (read, written) = (
            usage["cache_read_input_tokens"].as_u64().unwrap(),
            usage["cache_creation_input_tokens"].as_u64().unwrap(),
        );
        if turn == 0 {
            assert_eq!(read, 0, "{usage}");
        } else {
            // Everything the turn before wrote, up to its marked turn.
            assert_eq!(read, last_written, "turn {turn}: {usage}");
        }
        assert!(written > 0, "{usage}");
        last_written = read + written;
        history.push(json!({"role": "user", "content": long(turn)}));
        history.push(json!({"role": "assistant", "content": text_of(&answer)}));
    }
    // The boundary looked at is not written: a prompt that only shares a
    // message end with nothing marked there reads nothing.
    let unmarked = json!({"model": "sim-model", "max_tokens": 20, "messages": [
        {"role": "user", "content": long(7)}, {"role": "assistant", "content": "ok"},
        marked("next".into())]});
    post(&sim, PATH, Auth::Anthropic, &unmarked, None).await;
    let again = json!({"model": "sim-model", "max_tokens": 20, "messages": [
        {"role": "user", "content": long(7)}, {"role": "assistant", "content": "ok"},
        marked("other".into())]});
    let usage = post(&sim, PATH, Auth::Anthropic, &again, None).await.json()["usage"].clone();
    assert_eq!(usage["cache_read_input_tokens"], 0, "{usage}");
}

#[tokio::test]
async fn failure_modes_break_messages_as_they_break_chat() {
    let sim = Sim::shared();
    let canaried = Canaried::new(14, "Count the moorings");
    let streamed = request(&canaried, json!({"stream": true}));

    let limited = post(sim, PATH, Auth::Anthropic, &streamed, Some("rate-limited")).await;
    assert_error(&limited, 429, "rate_limit_error");
    assert_eq!(limited.header("retry-after"), "1");
    assert_eq!(
        limited.header("anthropic-ratelimit-requests-remaining"),
        "0"
    );
    assert!(
        limited.headers.get("retry-after-ms").is_none(),
        "Anthropic sends seconds"
    );

    let overloaded = post(
        sim,
        PATH,
        Auth::Anthropic,
        &request(&canaried, json!({})),
        Some("overloaded"),
    )
    .await;
    assert_error(&overloaded, 529, "overloaded_error");
    let events =
        checked_events(&post(sim, PATH, Auth::Anthropic, &streamed, Some("overloaded")).await);
    assert_eq!(
        events.last().unwrap(),
        &json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    );
    assert!(events.iter().any(|e| e["delta"]["type"] == "text_delta"));
    assert!(!events.iter().any(|e| e["type"] == "message_stop"));

    let (text, ended) = read_stream(
        sim,
        PATH,
        Auth::Anthropic,
        &streamed,
        Some("cut"),
        Duration::from_secs(10),
    )
    .await;
    assert!(
        ended && text.contains("text_delta") && !text.contains("message_delta"),
        "{text}"
    );
    let (text, ended) = read_stream(
        sim,
        PATH,
        Auth::Anthropic,
        &streamed,
        Some("stall-mid-stream"),
        Duration::from_millis(400),
    )
    .await;
    assert!(!ended && text.contains("text_delta"), "{text}");

    // truncate-tail drops the last turn, and the tail canary with it.
    let mut turns = request(&canaried, json!({}));
    turns["messages"] = json!([{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"},
                               {"role": "user", "content": canaried.user}]);
    let truncated = post(sim, PATH, Auth::Anthropic, &turns, Some("truncate-tail")).await;
    assert_eq!(truncated.header("x-sim-context"), "truncated");
    assert_eq!(
        opening_canaries(&text_of(&truncated.json())),
        [canaried.head]
    );
}

#[tokio::test]
async fn swap_answers_from_a_completions_request() {
    let sim = Sim::start(SimConfig::default());
    let other = Canaried::new(15, "the other job's prompt");
    let prompt = format!("{}\n\n{}", other.system, other.user);
    let completion = post(
        &sim,
        "/v1/completions",
        Auth::OpenAi,
        &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 40}),
        None,
    )
    .await
    .json();
    let ours = Canaried::new(16, "our question");
    let swapped = post(
        &sim,
        PATH,
        Auth::Anthropic,
        &request(&ours, json!({})),
        Some("swap"),
    )
    .await;
    assert_eq!(swapped.header("x-sim-context"), "swapped");
    assert_eq!(
        swapped.header("x-sim-context-from"),
        completion["id"].as_str().unwrap()
    );
    assert_eq!(
        opening_canaries(&text_of(&swapped.json())),
        [other.head, other.tail]
    );
}
