//! OpenAI's legacy completions on a real socket: prompts and their choices,
//! the chunk stream, and the failure modes on a raw text prompt.

use std::time::Duration;

use crate::common::*;
use canarygate_sim::SimConfig;
use serde_json::{Value, json};

const PATH: &str = "/v1/completions";

/// A raw prompt with canarygate's blocks in it: the head instruction, the
/// question, the tail block.
fn prompt(canaried: &Canaried) -> String {
    format!("{}\n\n{}", canaried.system, canaried.user)
}

#[tokio::test]
async fn a_completion_follows_the_prompt_in_openais_shape() {
    let sim = Sim::shared();
    let canaried = Canaried::new(21, "Plan the harbour survey");
    let body = json!({"model": "sim-model", "prompt": prompt(&canaried), "max_tokens": 60});
    let reply = post(sim, PATH, Auth::OpenAi, &body, None).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(reply.header("x-request-id").starts_with("req_"));
    assert_eq!(reply.header("x-sim-context"), "own");
    let completion = reply.json();
    assert!(completion["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(completion["object"], "text_completion");
    let choice = &completion["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["logprobs"], Value::Null);
    assert_eq!(choice["finish_reason"], "stop");
    let text = choice["text"].as_str().unwrap();
    assert!(text.starts_with(&canaried.opening()), "{text}");
    let usage = &completion["usage"];
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 20);
    assert_eq!(
        usage["total_tokens"],
        prompt_tokens + usage["completion_tokens"].as_u64().unwrap()
    );

    // No max_tokens: 16, as OpenAI's default.
    let default = json!({"model": "sim-model", "prompt": prompt(&canaried)});
    let default = post(sim, PATH, Auth::OpenAi, &default, None).await.json();
    assert_eq!(default["usage"]["completion_tokens"], 16);
    assert_eq!(default["choices"][0]["finish_reason"], "length");

    let bad = post(
        sim,
        PATH,
        Auth::OpenAi,
        &json!({"model": "m", "prompt": []}),
        None,
    )
    .await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["param"], "prompt");
}

#[tokio::test]
async fn prompts_and_choices_stream_as_text_completion_chunks() {
    let sim = Sim::shared();
    let body = json!({"model": "sim-model", "prompt": ["chart the reef", "log the buoys"], "n": 2,
        "max_tokens": 60, "stream": true, "stream_options": {"include_usage": true}});
    let reply = post(sim, PATH, Auth::OpenAi, &body, None).await;
    assert_eq!(reply.header("content-type"), "text/event-stream");
    assert!(reply.events().last().unwrap().is_done());
    let chunks = reply.event_data();
    let mut texts = vec![String::new(); 4];
    let mut finishes = vec![Value::Null; 4];
    for chunk in &chunks[..chunks.len() - 1] {
        assert_eq!(chunk["object"], "text_completion");
        assert_eq!(chunk["usage"], Value::Null);
        let choice = &chunk["choices"][0];
        let index = choice["index"].as_u64().unwrap() as usize;
        texts[index].push_str(choice["text"].as_str().unwrap());
        if !choice["finish_reason"].is_null() {
            finishes[index] = choice["finish_reason"].clone();
        }
    }
    for (index, text) in texts.iter().enumerate() {
        let subject = if index < 2 {
            "chart the reef"
        } else {
            "log the buoys"
        };
        assert!(
            text.starts_with("You wrote:") && text.contains(subject),
            "{index}: {text}"
        );
        assert_eq!(finishes[index], "stop");
    }
    assert_ne!(texts[0], texts[1], "choices differ");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    let completion_tokens = usage["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(completion_tokens > 20);

    // The same request whole: the same texts.
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let whole = post(sim, PATH, Auth::OpenAi, &whole, None).await.json();
    let whole_texts: Vec<&str> = whole["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(whole_texts, texts);
    assert_eq!(whole["usage"]["completion_tokens"], completion_tokens);
}

#[tokio::test]
async fn echo_and_logprobs_cover_prompt_and_completion() {
    let sim = Sim::shared();
    let body = json!({"model": "sim-model", "prompt": "Say hello", "max_tokens": 8, "echo": true, "logprobs": 2});
    let choice = post(sim, PATH, Auth::OpenAi, &body, None).await.json()["choices"][0].clone();
    let text = choice["text"].as_str().unwrap();
    assert!(text.starts_with("Say helloYou wrote:"), "{text}");
    let logprobs = &choice["logprobs"];
    let tokens: Vec<&str> = logprobs["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), text);
    assert_eq!(logprobs["token_logprobs"][0], Value::Null);
    assert_eq!(logprobs["text_offset"][0], 0);
    assert_eq!(logprobs["top_logprobs"][2].as_object().unwrap().len(), 2);
}

#[tokio::test]
async fn failure_modes_break_completions_as_they_break_chat() {
    let sim = Sim::shared();
    let canaried = Canaried::new(22, "Count the moorings");
    let body = json!({"model": "sim-model", "prompt": prompt(&canaried), "max_tokens": 80});
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);

    // The head instruction opens the prompt, the tail block ends it.
    let head = post(sim, PATH, Auth::OpenAi, &body, Some("truncate-head")).await;
    assert_eq!(head.header("x-sim-context"), "truncated");
    let text = head.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(opening_canaries(&text), [canaried.tail], "{text}");
    let tail = post(sim, PATH, Auth::OpenAi, &body, Some("truncate-tail"))
        .await
        .json();
    assert_eq!(
        opening_canaries(tail["choices"][0]["text"].as_str().unwrap()),
        [canaried.head]
    );
    assert!(
        tail["usage"]["prompt_tokens"].as_u64().unwrap()
            < post(sim, PATH, Auth::OpenAi, &body, None).await.json()["usage"]["prompt_tokens"]
                .as_u64()
                .unwrap()
    );

    let (text, ended) = read_stream(
        sim,
        PATH,
        Auth::OpenAi,
        &streamed,
        Some("cut"),
        Duration::from_secs(10),
    )
    .await;
    assert!(
        ended && text.contains("text_completion") && !text.contains("[DONE]"),
        "{text}"
    );
    let reply = post(sim, PATH, Auth::OpenAi, &streamed, Some("overloaded")).await;
    let last = reply.event_data().pop().unwrap();
    assert_eq!(last["error"]["type"], "server_error", "{last}");
    assert!(!reply.text.contains("[DONE]"));
    let limited = post(sim, PATH, Auth::OpenAi, &body, Some("rate-limited")).await;
    assert_eq!(limited.status, 429);
    assert_eq!(limited.json()["error"]["code"], "rate_limit_exceeded");
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
}

#[tokio::test]
async fn each_prompt_of_a_list_leaks_on_overflow() {
    let sim = Sim::start(SimConfig {
        context_window: 8192,
        pool_tokens: Some(200),
        ..SimConfig::default()
    });
    let earlier = Canaried::new(23, "an earlier job's question");
    post(
        &sim,
        PATH,
        Auth::OpenAi,
        &json!({"model": "sim-model", "prompt": prompt(&earlier)}),
        None,
    )
    .await;
    let long = "padding words ".repeat(150);
    let body = json!({"model": "sim-model", "prompt": [long, "short prompt"], "max_tokens": 60});
    let reply = post(&sim, PATH, Auth::OpenAi, &body, Some("leak-on-overflow")).await;
    assert_eq!(reply.header("x-sim-context"), "stale");
    let completion = reply.json();
    let leaked = completion["choices"][0]["text"].as_str().unwrap();
    // The placeholder overwrote the first position the earlier prompt left,
    // its first word: the head instruction is broken, the tail obeyed.
    assert_eq!(opening_canaries(leaked), [earlier.tail], "{leaked}");
    assert!(leaked.contains("an earlier job's"), "{leaked}");
    assert!(
        completion["choices"][1]["text"]
            .as_str()
            .unwrap()
            .starts_with("You wrote: short prompt")
    );
    // One token for the replaced prompt, the short one counted in full.
    assert_eq!(completion["usage"]["prompt_tokens"], 1 + 2);
}
