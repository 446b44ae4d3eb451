//! The simulated provider's failure modes, called directly (no proxy): real
//! `canarygate sim-provider` processes on real sockets, streamed and not.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use canarygate_policies::EchoCost;
use canarygate_policies::canary::Canary;
use canarygate_policies::inject::{RequestCanaries, inject};
use canarygate_policies::tokens::count_chat_messages;
use canarygate_policies::verify_config::EchoMode;
use serde_json::{Value, json};

use crate::common::*;

/// What one chat completion call returned, streamed or not.
#[derive(Debug)]
struct Outcome {
    status: u16,
    headers: reqwest::header::HeaderMap,
    /// The reply text (all `delta.content` of a stream).
    content: String,
    usage: Value,
    finish_reason: Value,
    /// The response id (`chatcmpl-sim-N`).
    id: String,
    /// A stream ended with `[DONE]` (always true when not streamed).
    done: bool,
    /// The parsed body of an error response.
    error: Value,
    elapsed: Duration,
}

impl Outcome {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
    }

    /// The reply's first two words parsed as canaries (a reply opening with
    /// `HEAD TAIL` gives both).
    fn opening_canaries(&self) -> Vec<Canary> {
        self.content
            .split_whitespace()
            .take(2)
            .map_while(Canary::parse)
            .collect()
    }
}

/// Posts `body` to the sim at `url`, with `x-sim-mode: mode` when given.
async fn send(url: &str, body: &Value, mode: Option<&str>) -> Outcome {
    let mut request = client()
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth("sk-test")
        .json(body);
    if let Some(mode) = mode {
        request = request.header("x-sim-mode", mode);
    }
    let started = Instant::now();
    let response = request.send().await.expect("send");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.expect("whole body");
    let elapsed = started.elapsed();
    let mut outcome = Outcome {
        status,
        headers,
        content: String::new(),
        usage: Value::Null,
        finish_reason: Value::Null,
        id: String::new(),
        done: true,
        error: Value::Null,
        elapsed,
    };
    if status != 200 {
        outcome.error = serde_json::from_str(&text).expect("error body is JSON");
        return outcome;
    }
    if body["stream"] == true {
        let events = sse_data(&text);
        outcome.done = events.last().is_some_and(|last| last == "[DONE]");
        outcome.content = stream_content(&text);
        for chunk in events
            .iter()
            .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        {
            if outcome.id.is_empty() {
                outcome.id = chunk["id"].as_str().unwrap_or_default().to_owned();
            }
            if !chunk["usage"].is_null() {
                outcome.usage = chunk["usage"].clone();
            }
            let finish = &chunk["choices"][0]["finish_reason"];
            if !finish.is_null() {
                outcome.finish_reason = finish.clone();
            }
        }
    } else {
        let completion: Value = serde_json::from_str(&text).expect("completion is JSON");
        outcome.content = completion["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_owned();
        outcome.usage = completion["usage"].clone();
        outcome.finish_reason = completion["choices"][0]["finish_reason"].clone();
        outcome.id = completion["id"].as_str().expect("id").to_owned();
    }
    outcome
}

/// A request whose messages carry canaries exactly as canarygate injects them.
struct Injected {
    body: Value,
    canaries: RequestCanaries,
}

impl Injected {
    /// `user` as the only client message, with both canaries injected.
    fn new(user: &str, stream: bool) -> Self {
        Self::with_messages(vec![json!({"role": "user", "content": user})], stream)
    }

    fn with_messages(messages: Vec<Value>, stream: bool) -> Self {
        let mut body = json!({"model": "sim-model", "stream": stream, "messages": messages});
        let canaries = RequestCanaries::mint();
        inject(
            &mut body,
            EchoMode::HeadTail,
            EchoCost::DIGIT_BY_DIGIT,
            canaries,
        )
        .expect("inject");
        Self { body, canaries }
    }

    fn echo(&self) -> String {
        format!("{} {}", self.canaries.head, self.canaries.tail)
    }

    fn messages(&self) -> &[Value] {
        self.body["messages"].as_array().expect("messages")
    }

    fn prompt_tokens(&self) -> u64 {
        count_chat_messages(self.messages())
    }

    /// Whether `text` holds either of this request's canaries.
    fn appears_in(&self, text: &str) -> bool {
        text.contains(&self.canaries.head.to_string())
            || text.contains(&self.canaries.tail.to_string())
    }
}

/// `count` distinct one-token words after `marker`.
fn long_text(marker: &str, count: usize) -> String {
    let mut text = marker.to_owned();
    for index in 0..count {
        text.push_str(&format!(" w{index}"));
    }
    text
}

#[tokio::test]
async fn honest_model_opens_with_head_and_tail_canaries() {
    let sim = start_sim(&[]);
    for stream in [false, true] {
        let request = Injected::new("Plan the harbour survey for Tuesday", stream);
        let outcome = send(&sim.url, &request.body, None).await;
        assert_eq!(outcome.status, 200);
        let expected = format!(
            "{} You wrote: Plan the harbour survey for Tuesday",
            request.echo()
        );
        assert!(
            outcome.content.starts_with(&expected),
            "{}",
            outcome.content
        );
        assert_eq!(outcome.usage["prompt_tokens"], request.prompt_tokens());
        assert_eq!(outcome.finish_reason, "stop");
        assert!(outcome.done);
        assert_eq!(outcome.header("x-sim-context"), "own");
        assert_eq!(outcome.header("x-sim-context-from"), "");
    }
    let stats = sim_stats(&sim).await;
    assert_eq!(stats["leaked"], 0, "{stats}");
    assert_eq!(stats["completed"], 2, "{stats}");
}

/// The prefix cache: a job's second request with the same long system
/// prompt reports the cached prefix (OpenAI's 1024 + k * 128 tokens) in whole
/// answers and in a stream's usage chunk, and prefills only the rest; the
/// first request, a changed system prompt and a short prompt report 0.
#[tokio::test]
async fn a_repeated_prompt_prefix_is_cached_and_prefilled_no_more() {
    // 5,000 tokens/s: the 4,000-token system prompt takes 0.8 s to prefill.
    let sim = start_sim(&["--prefill-tps", "5000"]);
    let system = long_text("House rules:", 4_000);
    let ask = |system: &str, question: &str, stream: bool| {
        let mut body = json!({"model": "sim-model", "stream": stream, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]});
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    };
    let cached = |outcome: &Outcome| {
        outcome.usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached_tokens: {}", outcome.usage))
    };
    let first = send(&sim.url, &ask(&system, "Which rule is first?", false), None).await;
    assert_eq!(first.status, 200);
    assert_eq!(cached(&first), 0);
    assert!(
        first.elapsed >= Duration::from_millis(800),
        "{:?}",
        first.elapsed
    );
    for stream in [false, true] {
        let again = send(&sim.url, &ask(&system, "And which is last?", stream), None).await;
        assert_eq!(again.status, 200);
        let tokens = cached(&again);
        let prompt = again.usage["prompt_tokens"].as_u64().unwrap();
        assert!(
            tokens >= 1024 && (tokens - 1024).is_multiple_of(128) && prompt - tokens < 128 + 16,
            "{tokens} of {prompt}"
        );
        assert!(
            again.elapsed < first.elapsed / 2,
            "{:?} against {:?}",
            again.elapsed,
            first.elapsed
        );
    }
    let changed = send(&sim.url, &ask(&format!("New {system}"), "Q?", true), None).await;
    assert_eq!(cached(&changed), 0);
    let short = send(&sim.url, &ask("Be brief.", "Q?", false), None).await;
    assert_eq!(cached(&short), 0);
    let stats = sim_stats(&sim).await;
    assert_eq!(stats["prefix_cache"]["hits"], 2, "{stats}");

    // Caching off: every prompt prefilled in full.
    let plain = start_sim(&["--cache-capacity-tokens", "0"]);
    for _ in 0..2 {
        let outcome = send(&plain.url, &ask(&system, "Q?", false), None).await;
        assert_eq!(cached(&outcome), 0);
    }
}

/// SGLang issue #30233 in miniature: window 1024, prefill pool 665 (the
/// incident's 681,280 / 1,048,576).
#[tokio::test]
async fn leak_on_overflow_answers_over_pool_prompts_from_earlier_requests() {
    let sim = start_sim(&[
        "--mode",
        "leak-on-overflow",
        "--context-window",
        "1024",
        "--pool-tokens",
        "665",
        "--prefill-tps",
        "500",
    ]);
    let secrets = [
        "Confidential memo for Ashford: merger with Bellweather closes Friday",
        "Patient Corrigan was prescribed 40mg of Dravolin on admission",
        "Wire 250000 to account Eskerfield before the audit",
    ];
    // Prompts that fit the pool are served honestly, and stay in the pool.
    let mut earlier = Vec::new();
    let mut earlier_ids = HashSet::new();
    for (index, secret) in secrets.iter().enumerate() {
        let request = Injected::new(secret, index % 2 == 1);
        let outcome = send(&sim.url, &request.body, None).await;
        assert_eq!(outcome.status, 200);
        assert!(
            outcome.content.starts_with(&request.echo()),
            "{}",
            outcome.content
        );
        assert_eq!(outcome.usage["prompt_tokens"], request.prompt_tokens());
        assert_eq!(outcome.header("x-sim-context"), "own");
        earlier_ids.insert(outcome.id.clone());
        earlier.push(request);
    }
    let latest = &earlier[secrets.len() - 1];

    for stream in [false, true] {
        let over = Injected::new(&long_text("Quarterly plan of Fennimore", 640), stream);
        assert!(
            (666..=1024).contains(&over.prompt_tokens()),
            "over the pool, within the window: {}",
            over.prompt_tokens()
        );
        let outcome = send(&sim.url, &over.body, None).await;
        assert_eq!(outcome.status, 200, "{:?}", outcome.error);
        assert_eq!(outcome.usage["prompt_tokens"], 1);
        assert_eq!(outcome.finish_reason, "stop");
        assert!(outcome.done, "a clean stream end");
        // It obeys the stale instructions of the most recent request...
        assert!(
            outcome.content.starts_with(&latest.echo()),
            "{}",
            outcome.content
        );
        // ...never its own, and restates another request's text.
        assert!(!over.appears_in(&outcome.content), "{}", outcome.content);
        assert!(!outcome.content.contains("Fennimore"));
        let restated = ["Ashford", "Corrigan", "Eskerfield"]
            .iter()
            .any(|word| outcome.content.contains(word));
        assert!(restated, "{}", outcome.content);
        // No prefill happened: over 665 tokens at 500 tokens/s take over 1.3 s.
        assert!(
            outcome.elapsed < Duration::from_millis(700),
            "{:?}",
            outcome.elapsed
        );
        assert_eq!(outcome.header("x-sim-context"), "stale");
        let from: Vec<&str> = outcome.header("x-sim-context-from").split(',').collect();
        assert!(from.iter().all(|id| earlier_ids.contains(*id)), "{from:?}");
    }

    // The same long prompt, served honestly, does pay for its prefill.
    let over = Injected::new(&long_text("Quarterly plan of Fennimore", 640), false);
    let honest = send(&sim.url, &over.body, Some("honest")).await;
    assert_eq!(honest.status, 200);
    assert!(
        honest.content.starts_with(&over.echo()),
        "{}",
        honest.content
    );
    assert_eq!(honest.usage["prompt_tokens"], over.prompt_tokens());
    assert!(
        honest.elapsed >= Duration::from_millis(1300),
        "{:?}",
        honest.elapsed
    );

    // Over the advertised window the same substitution happens, still HTTP 200:
    // a provider that never checks what it holds does not check its window either.
    let huge = Injected::new(&long_text("too long", 1100), false);
    let accepted = send(&sim.url, &huge.body, None).await;
    assert_eq!(accepted.status, 200);
    assert_eq!(accepted.usage["prompt_tokens"], 1);
    assert_eq!(accepted.header("x-sim-context"), "stale");

    // Honest mode refuses it as real providers do.
    let rejected = send(&sim.url, &huge.body, Some("honest")).await;
    assert_eq!(rejected.status, 400);
    assert_eq!(rejected.error["error"]["code"], "context_length_exceeded");

    let stats = sim_stats(&sim).await;
    assert_eq!(stats["placeholder_substitutions"], 3, "{stats}");
    assert_eq!(stats["leaked"], 3, "{stats}");
    assert_eq!(stats["rejected"], 1, "{stats}");
    assert_eq!(stats["prefill_pool_tokens"], 665, "{stats}");
}

/// The demo's traffic: concurrent sessions on both sides of the pool.
#[tokio::test]
async fn leak_on_overflow_under_concurrency_leaks_whole_canary_pairs() {
    let sim = start_sim(&[
        "--mode",
        "leak-on-overflow",
        "--context-window",
        "1024",
        "--pool-tokens",
        "665",
    ]);
    let opener = Injected::new("Opening session of Ingleby", false);
    assert_eq!(send(&sim.url, &opener.body, None).await.status, 200);

    let mut tasks = Vec::new();
    for index in 0..24 {
        let over = index % 3 == 0;
        let text = if over {
            long_text(&format!("Long session {index}"), 640)
        } else {
            format!("Short session {index} about Juniper")
        };
        let request = Injected::new(&text, index % 2 == 0);
        let url = sim.url.clone();
        tasks.push(tokio::spawn(async move {
            let outcome = send(&url, &request.body, None).await;
            (over, request, outcome)
        }));
    }
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.expect("task"));
    }
    let mut pairs: Vec<(Canary, Canary)> = vec![(opener.canaries.head, opener.canaries.tail)];
    pairs.extend(
        results
            .iter()
            .filter(|(over, _, _)| !over)
            .map(|(_, request, _)| (request.canaries.head, request.canaries.tail)),
    );
    let mut leaks = 0;
    for (over, request, outcome) in &results {
        assert_eq!(outcome.status, 200);
        assert!(outcome.done);
        if *over {
            leaks += 1;
            assert_eq!(outcome.usage["prompt_tokens"], 1);
            assert!(!request.appears_in(&outcome.content), "{}", outcome.content);
            let echoed = outcome.opening_canaries();
            assert_eq!(echoed.len(), 2, "{}", outcome.content);
            assert!(
                pairs.contains(&(echoed[0], echoed[1])),
                "both canaries of one short request: {}",
                outcome.content
            );
        } else {
            assert!(
                outcome.content.starts_with(&request.echo()),
                "short requests are served honestly: {}",
                outcome.content
            );
        }
    }
    let stats = sim_stats(&sim).await;
    assert_eq!(stats["leaked"], leaks, "{stats}");
    assert_eq!(stats["placeholder_substitutions"], leaks, "{stats}");
}

#[tokio::test]
async fn leak_on_overflow_on_a_fresh_pool_leaks_nothing() {
    let sim = start_sim(&["--context-window", "1024", "--pool-tokens", "665"]);
    let over = Injected::new(&long_text("alone", 700), false);
    let outcome = send(&sim.url, &over.body, Some("leak-on-overflow")).await;
    assert_eq!(outcome.status, 200);
    assert_eq!(outcome.usage["prompt_tokens"], 1);
    assert!(outcome.opening_canaries().is_empty(), "{}", outcome.content);
    assert!(
        outcome.content.starts_with("You wrote:"),
        "{}",
        outcome.content
    );
    assert_eq!(outcome.header("x-sim-context"), "stale");
    assert_eq!(outcome.header("x-sim-context-from"), "");
    let stats = sim_stats(&sim).await;
    assert_eq!(stats["placeholder_substitutions"], 1, "{stats}");
    assert_eq!(stats["leaked"], 0, "{stats}");
}

#[tokio::test]
async fn truncation_loses_the_head_or_the_tail_canary() {
    let sim = start_sim(&[]);
    for stream in [false, true] {
        let request = Injected::new("Summarise the tide tables", stream);
        let messages = request.messages();

        let head_cut = send(&sim.url, &request.body, Some("truncate-head")).await;
        assert_eq!(head_cut.status, 200);
        let expected = format!(
            "{} You wrote: Summarise the tide tables",
            request.canaries.tail
        );
        assert!(
            head_cut.content.starts_with(&expected),
            "{}",
            head_cut.content
        );
        assert!(
            !head_cut
                .content
                .contains(&request.canaries.head.to_string())
        );
        assert_eq!(
            head_cut.usage["prompt_tokens"],
            count_chat_messages(&messages[1..])
        );
        assert_eq!(head_cut.header("x-sim-context"), "truncated");

        // The tail canary ends the last user message: losing it loses the
        // question too.
        let tail_cut = send(&sim.url, &request.body, Some("truncate-tail")).await;
        assert_eq!(tail_cut.status, 200);
        let expected = format!("{} You wrote: nothing", request.canaries.head);
        assert!(
            tail_cut.content.starts_with(&expected),
            "{}",
            tail_cut.content
        );
        assert!(
            !tail_cut
                .content
                .contains(&request.canaries.tail.to_string())
        );
        assert_eq!(
            tail_cut.usage["prompt_tokens"],
            count_chat_messages(&messages[..messages.len() - 1])
        );
        assert!(tail_cut.done);
    }

    // A longer conversation loses a third of its messages at the head. Its
    // canaries both end its newest turn (its history stays a cacheable
    // prefix), so the cut loses neither; the prompt tokens it reports are
    // the kept messages' (what canarygate's `prompt_tokens` check reads).
    let request = Injected::with_messages(
        vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "First question"}),
            json!({"role": "assistant", "content": "First answer"}),
            json!({"role": "user", "content": "Second question"}),
        ],
        false,
    );
    assert_eq!(request.messages().len(), 4, "canaries add no message");
    let outcome = send(&sim.url, &request.body, Some("truncate-head")).await;
    assert_eq!(
        outcome.usage["prompt_tokens"],
        count_chat_messages(&request.messages()[1..])
    );
    assert!(
        outcome
            .content
            .starts_with(&format!("{} You wrote: Second", request.echo())),
        "{}",
        outcome.content
    );

    // A lone message is never dropped.
    let alone = json!({"model": "m", "messages": [{"role": "user", "content": "just me"}]});
    let outcome = send(&sim.url, &alone, Some("truncate-tail")).await;
    assert!(
        outcome.content.starts_with("You wrote: just me"),
        "{}",
        outcome.content
    );
    assert_eq!(outcome.header("x-sim-context"), "own");

    let stats = sim_stats(&sim).await;
    assert_eq!(stats["truncated"], 5, "{stats}");
    assert_eq!(stats["leaked"], 0, "{stats}");
}

#[tokio::test]
async fn swap_answers_with_the_previous_requests_context() {
    let sim = start_sim(&["--mode", "swap"]);
    // The very first request has nobody to swap with.
    let first = Injected::new("Ledger of Halvorsen holdings", false);
    let outcome = send(&sim.url, &first.body, None).await;
    assert!(
        outcome.content.starts_with(&first.echo()),
        "{}",
        outcome.content
    );
    assert_eq!(outcome.header("x-sim-context"), "own");

    let mut previous = (first, "Ledger of Halvorsen holdings".to_owned(), outcome.id);
    for (index, stream) in [false, true].into_iter().enumerate() {
        let text = format!("Itinerary number {index} of Okonkwo");
        let request = Injected::new(&text, stream);
        let outcome = send(&sim.url, &request.body, None).await;
        assert_eq!(outcome.status, 200);
        let (other, other_text, other_id) = &previous;
        let expected = format!("{} You wrote: {other_text}", other.echo());
        assert!(
            outcome.content.starts_with(&expected),
            "{}",
            outcome.content
        );
        assert!(!request.appears_in(&outcome.content));
        assert!(!outcome.content.contains(&text));
        assert_eq!(outcome.usage["prompt_tokens"], request.prompt_tokens());
        assert_eq!(outcome.header("x-sim-context"), "swapped");
        assert_eq!(outcome.header("x-sim-context-from"), other_id);
        assert!(outcome.done);
        previous = (request, text, outcome.id);
    }
    let stats = sim_stats(&sim).await;
    assert_eq!(stats["swapped"], 2, "{stats}");
    assert_eq!(stats["leaked"], 2, "{stats}");
}

#[tokio::test]
async fn cut_ends_without_done_or_a_complete_body() {
    let sim = start_sim(&[]);
    let request = Injected::new("tell me a long story about the sea", true);
    let outcome = send(&sim.url, &request.body, Some("cut")).await;
    assert_eq!(outcome.status, 200);
    assert!(!outcome.done, "no [DONE] after a cut");
    let head = request.canaries.head.to_string();
    assert!(outcome.content.starts_with(&head), "{}", outcome.content);
    assert_eq!(outcome.finish_reason, Value::Null);

    let mut body = request.body.clone();
    body["stream"] = json!(false);
    // Not streamed: the connection closes mid-body, before or after the
    // response head reached the client; never a complete JSON body.
    let sent = client()
        .post(format!("{}/v1/chat/completions", sim.url))
        .bearer_auth("k")
        .header("x-sim-mode", "cut")
        .json(&body)
        .send()
        .await;
    if let Ok(response) = sent {
        assert_eq!(response.status(), 200);
        let parsed = response
            .bytes()
            .await
            .ok()
            .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok());
        assert!(parsed.is_none(), "a cut body never parses: {parsed:?}");
    }
    let stats = sim_stats(&sim).await;
    assert_eq!(stats["completed"], 0, "{stats}");
    assert_eq!(stats["requests"], 2, "{stats}");
}

#[tokio::test]
async fn unknown_modes_are_refused() {
    let sim = start_sim(&[]);
    let body = chat_body("m", "hi", false);
    let outcome = send(&sim.url, &body, Some("leak-sometimes")).await;
    assert_eq!(outcome.status, 400);
    assert_eq!(outcome.error["error"]["code"], "invalid_sim_mode");
    let message = outcome.error["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("leak-on-overflow"), "{message}");

    for args in [["--mode", "leak-sometimes"], ["--page-tokens", "0"]] {
        let output = std::process::Command::new(binary())
            .arg("sim-provider")
            .args(args)
            .output()
            .expect("run");
        assert!(!output.status.success(), "{args:?} accepted");
    }
}

#[tokio::test]
async fn stalls_hold_the_connection_silent() {
    let sim = start_sim(&[]);
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(600))
        .build()
        .expect("client");
    let post = |mode: &'static str, stream: bool| {
        quick
            .post(format!("{}/v1/chat/completions", sim.url))
            .bearer_auth("k")
            .header("x-sim-mode", mode)
            .json(&chat_body("m", "are you there", stream))
            .send()
    };

    for stream in [false, true] {
        let error = post("stall-first-byte", stream)
            .await
            .expect_err("no response head");
        assert!(error.is_timeout(), "{error}");

        let mut response = post("stall-mid-stream", stream).await.expect("head");
        assert_eq!(response.status(), 200);
        let first = response.chunk().await.expect("first bytes");
        assert!(first.is_some_and(|bytes| !bytes.is_empty()));
        let mut received = Vec::new();
        let error = loop {
            match response.chunk().await {
                Ok(Some(bytes)) => received.extend_from_slice(&bytes),
                Ok(None) => panic!("the stall ended the body"),
                Err(error) => break error,
            }
        };
        assert!(error.is_timeout(), "{error}");
        let received = String::from_utf8_lossy(&received);
        assert!(!received.contains("[DONE]"), "{received}");
    }
}

/// `rate-limited` through the binary: 429 in OpenAI's shape with short
/// `retry-after` headers, streamed or not; a small `--rate-limit-requests`
/// serves that many, then refuses with the same shape; every response
/// carries the provider headers, and the remaining count goes down.
#[tokio::test]
async fn rate_limits_answer_429_with_retry_after_and_provider_headers() {
    let sim = start_sim(&[
        "--rate-limit-requests",
        "3",
        "--rate-limit-window-ms",
        "60000",
    ]);
    for stream in [false, true] {
        let outcome = send(
            &sim.url,
            &chat_body("m", "hi", stream),
            Some("rate-limited"),
        )
        .await;
        assert_eq!(outcome.status, 429);
        assert_eq!(outcome.header("retry-after"), "1");
        assert_eq!(outcome.header("retry-after-ms"), "1000");
        assert_eq!(outcome.header("x-ratelimit-remaining-requests"), "0");
        assert_eq!(outcome.header("x-ratelimit-remaining-tokens"), "0");
        assert_eq!(outcome.error["error"]["type"], "requests");
        assert_eq!(outcome.error["error"]["code"], "rate_limit_exceeded");
        assert_eq!(outcome.error["error"]["param"], Value::Null);
    }
    let mut remaining = Vec::new();
    for stream in [false, true, false] {
        let outcome = send(&sim.url, &chat_body("m", "hi", stream), None).await;
        assert_eq!(outcome.status, 200);
        assert!(outcome.header("x-request-id").starts_with("req_"));
        assert!(
            outcome
                .header("openai-processing-ms")
                .parse::<u64>()
                .is_ok()
        );
        assert_eq!(outcome.header("openai-version"), "2020-10-01");
        assert_eq!(outcome.header("x-ratelimit-limit-requests"), "3");
        assert!(outcome.header("set-cookie").starts_with("__cf_bm="));
        remaining.push(outcome.header("x-ratelimit-remaining-requests").to_owned());
    }
    assert_eq!(remaining, ["2", "1", "0"]);
    let refused = send(&sim.url, &chat_body("m", "hi", false), None).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.error["error"]["code"], "rate_limit_exceeded");
    let retry_ms: u64 = refused
        .header("retry-after-ms")
        .parse()
        .expect("retry-after-ms");
    assert!((1..=60_000).contains(&retry_ms), "{retry_ms}");
    let stats = sim_stats(&sim).await;
    assert_eq!(stats["rate_limited"], 3, "{stats}");
    assert_eq!(stats["completed"], 3, "{stats}");
}

/// A reasoning model with n = 2, logprobs and a tool through the binary:
/// the stream's reasoning comes first, each choice's logprob tokens join to
/// its content, and a required tool call streams in increments.
#[tokio::test]
async fn real_provider_fields_reach_a_client_over_the_wire() {
    let sim = start_sim(&[]);
    let request = Injected::new("Chart the reef", true);
    let mut body = request.body.clone();
    body["model"] = json!("sim-reasoner");
    body["n"] = json!(2);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    let text = client()
        .post(format!("{}/v1/chat/completions", sim.url))
        .bearer_auth("k")
        .json(&body)
        .send()
        .await
        .expect("send")
        .text()
        .await
        .expect("body");
    let mut content = [String::new(), String::new()];
    let mut logprob_tokens = [String::new(), String::new()];
    let mut reasoning = [String::new(), String::new()];
    for data in sse_data(&text) {
        let Ok(chunk) = serde_json::from_str::<Value>(&data) else {
            continue;
        };
        assert_eq!(chunk["system_fingerprint"], "fp_sim0001");
        // The usage chunk has no choice.
        let Some(choice) = chunk["choices"].get(0) else {
            continue;
        };
        let index = choice["index"].as_u64().expect("index") as usize;
        if let Some(piece) = choice["delta"]["reasoning_content"].as_str() {
            assert!(content[index].is_empty(), "reasoning after content");
            reasoning[index].push_str(piece);
        }
        if let Some(piece) = choice["delta"]["content"].as_str() {
            content[index].push_str(piece);
        }
        for entry in choice["logprobs"]["content"]
            .as_array()
            .into_iter()
            .flatten()
        {
            logprob_tokens[index].push_str(entry["token"].as_str().expect("token"));
        }
    }
    for index in 0..2 {
        assert!(
            content[index].starts_with(&request.echo()),
            "{}",
            content[index]
        );
        assert_eq!(logprob_tokens[index], content[index]);
        assert!(
            reasoning[index].contains(&format!("begin my reply with \"{}\"", request.echo())),
            "{}",
            reasoning[index]
        );
    }
    assert_ne!(content[0], content[1]);

    let tools = json!([{"type": "function", "function": {"name": "chart",
        "parameters": {"type": "object", "properties": {"area": {"type": "string"}}}}}]);
    let body = json!({"model": "sim-model", "stream": true, "tools": tools,
        "tool_choice": "required", "messages": [{"role": "user", "content": "the reef"}]});
    let text = client()
        .post(format!("{}/v1/chat/completions", sim.url))
        .bearer_auth("k")
        .json(&body)
        .send()
        .await
        .expect("send")
        .text()
        .await
        .expect("body");
    let calls: Vec<Value> = sse_data(&text)
        .iter()
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .filter_map(|chunk| chunk["choices"][0]["delta"]["tool_calls"].get(0).cloned())
        .collect();
    assert!(calls.len() > 3, "{calls:?}");
    assert_eq!(calls[0]["function"]["name"], "chart");
    let arguments: String = calls
        .iter()
        .map(|call| call["function"]["arguments"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&arguments).expect("JSON arguments"),
        json!({"area": "the reef"})
    );
}
