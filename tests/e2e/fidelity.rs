//! A drop-in for Chat Completions: everything the provider sends reaches the
//! client (reasoning, logprobs, tool-call and function-call increments,
//! unknown fields, rate-limit headers), with only canarygate's own text
//! removed, and nothing the client asked for is bent (`max_tokens`, `n`).
//! The simulated provider answers like real ones do (reasoning models,
//! logprobs, `obfuscation` padding, `x-ratelimit-*`, a CDN's `set-cookie`).
//!
//! One simulator and two proxies (usage as billed, usage without
//! canarygate) serve every case, streamed and not.

use std::process::Command;

use canarygate_policies::EchoCost;
use reqwest::header::HeaderMap;
use serde_json::{Value, json};

use crate::common::*;

/// The routes every case uses: the plain model, one whose provider is over
/// its rate limit, and anything else (the reasoning models) through the
/// wildcard.
fn policy(sim: &str, limited: &str, extra: &str) -> String {
    format!(
        r#"
[[providers]]
name = "sim"
base_url = "{sim}/v1"
context_window = 32000

[[providers]]
name = "limited"
base_url = "{limited}/v1"
context_window = 32000

[[routes]]
model = "reporter"
provider = "sim"
upstream_model = "sim-model"

[[routes]]
model = "limited"
provider = "limited"
upstream_model = "sim-model"

[[providers]]
name = "deployment"
base_url = "{sim}/v1"
context_window = 32000
tokenizer_digits = "groups-of-three"

[[routes]]
model = "my-deployment"
provider = "deployment"

[[routes]]
model = "*"
provider = "sim"

[[providers]]
name = "claude"
api = "anthropic"
base_url = "{sim}/v1"
context_window = 32000

[[routes]]
model = "*"
provider = "claude"

{extra}
"#
    )
}

/// Posts `body` and returns status, headers and the body text.
async fn post(proxy: &Running, body: &Value, headers: &[(&str, &str)]) -> (u16, HeaderMap, String) {
    let mut request = client()
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("sk-fidelity")
        .json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("send");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.text().await.expect("body"))
}

/// The JSON chunks of a stream body (without `[DONE]`).
fn chunks(body: &str) -> Vec<Value> {
    sse_data(body)
        .iter()
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).expect("a JSON chunk"))
        .collect()
}

/// Joined `delta[field]` of choice `index` over `chunks`.
fn joined(chunks: &[Value], index: u64, field: &str) -> String {
    chunks
        .iter()
        .flat_map(|chunk| chunk["choices"].as_array().cloned().unwrap_or_default())
        .filter(|choice| choice["index"] == index)
        .filter_map(|choice| choice["delta"][field].as_str().map(str::to_owned))
        .collect()
}

/// Asserts that nothing canary-shaped and none of the instructions around
/// them reached the client anywhere in `body`.
fn assert_clean(body: &str) {
    assert!(!holds_canary(body), "a canary reached the client: {body}");
    assert!(
        !body.contains("Begin your reply with"),
        "the head instruction reached the client: {body}"
    );
}

/// The first member `key` anywhere in `value`.
fn field<'a>(value: &'a Value, key: &str) -> Option<&'a Value> {
    match value {
        Value::Object(members) => members
            .get(key)
            .or_else(|| members.values().find_map(|inner| field(inner, key))),
        Value::Array(items) => items.iter().find_map(|inner| field(inner, key)),
        _ => None,
    }
}

/// The overhead header's two numbers.
fn overhead(value: &str) -> (u64, Option<u64>) {
    let mut prompt = None;
    let mut completion = None;
    for part in value.split(", ") {
        match part.split_once('=') {
            Some(("prompt", n)) => prompt = n.parse().ok(),
            Some(("completion", n)) => completion = n.parse().ok(),
            _ => panic!("bad overhead header {value}"),
        }
    }
    (prompt.expect("prompt overhead"), completion)
}

fn user(model: &str, text: &str, stream: bool) -> Value {
    let mut body = chat_body(model, text, stream);
    body["messages"]
        .as_array_mut()
        .unwrap()
        .insert(0, json!({"role": "system", "content": "You are terse."}));
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_provider_answer_reaches_the_client_whole_and_clean() {
    let sim = start_sim(&[]);
    let limited = start_sim(&["--mode", "rate-limited"]);
    let dir = ProxyDir::new();
    let policy_path = dir.policy(&policy(&sim.url, &limited.url, ""));
    let proxy = start_proxy_with_policy(&dir, &policy_path, &[]);

    reasoning_models(&proxy).await;
    a_budget_spent_on_hidden_reasoning(&proxy).await;
    reasoning_cut_before_its_reply_is_withheld(&proxy).await;
    logprobs_follow_the_content(&proxy).await;
    tool_and_function_calls_keep_their_increments(&proxy).await;
    provider_fields_and_headers_pass(&proxy, &dir).await;
    limits_are_honoured(&proxy).await;
    every_choice_is_verified(&proxy).await;
    models_of_the_wildcard_route_are_listed(&proxy).await;

    // The same answers through the official SDK, both modes.
    let output = Command::new(python())
        .arg(workspace_root().join("tests/python/sdk_fidelity.py"))
        .arg(format!("{}/v1", proxy.url))
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "sdk_fidelity.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let sdk: Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    for mode in ["plain", "stream"] {
        let seen = &sdk[mode];
        assert!(
            seen["reasoning"]
                .as_str()
                .is_some_and(|text| !text.is_empty()),
            "{mode}: {seen}"
        );
        assert_clean(&seen.to_string());
        assert_eq!(seen["logprob_tokens"], seen["content"], "{mode}: {seen}");
        assert!(
            seen["short_completion_tokens"].as_u64().unwrap() <= 5,
            "{mode}: {seen}"
        );
        assert_eq!(seen["short_finish_reason"], "length", "{mode}: {seen}");
        // A citation points at the word it cites (its title) in the content
        // the client got, the echo removed before it.
        let cited = sdk["citations"][mode].as_array().unwrap();
        assert_eq!(cited.len(), 1, "{mode}: {sdk}");
        let (span, title) = cited[0].as_str().unwrap().split_once(' ').unwrap();
        assert_eq!(span, title, "{mode}: {sdk}");
    }

    // Usage as the client would have seen it without canarygate.
    let dir = ProxyDir::new();
    let policy_path = dir.policy(&policy(
        &sim.url,
        &limited.url,
        "[verify]\nusage = \"without-canarygate\"\n",
    ));
    let honest_usage = start_proxy_with_policy(&dir, &policy_path, &[]);
    let body = user("reporter", "Count the moons of Mars", false);
    let (status, headers, without) = post(&honest_usage, &body, &[]).await;
    assert_eq!(status, 200, "{without}");
    let without: Value = serde_json::from_str(&without).unwrap();
    let (prompt, completion) = overhead(headers["x-canarygate-overhead-tokens"].to_str().unwrap());
    let completion = completion.unwrap();
    assert!(prompt > 0 && completion > 0, "{headers:?}");
    let usage = &without["usage"];
    let records = audit_export(&dir.data());
    let billed_prompt = records
        .iter()
        .find_map(|record| field(record, "prompt_tokens_provider")?.as_u64())
        .expect("the provider's prompt tokens in the audit record");
    assert_eq!(usage["prompt_tokens"], billed_prompt - prompt, "{without}");
    // The simulator bills the echo and the answer; what is left is at most
    // the answer's own tokens.
    let content = without["choices"][0]["message"]["content"]
        .as_str()
        .unwrap();
    let reported = usage["completion_tokens"].as_u64().unwrap();
    assert!(
        reported > 0 && reported <= canarygate_policies::tokens::count_text(content),
        "{without}"
    );
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + reported
    );
}

async fn reasoning_models(proxy: &Running) {
    for (model, field) in [
        ("sim-reasoner", "reasoning_content"),
        ("sim-reasoner-openrouter", "reasoning"),
    ] {
        let (status, headers, body) =
            post(proxy, &user(model, "Explain tides briefly", false), &[]).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(headers["x-canarygate-verdict"], "pass", "{body}");
        assert_clean(&body);
        let answer: Value = serde_json::from_str(&body).unwrap();
        let message = &answer["choices"][0]["message"];
        let reasoning = message[field].as_str().expect("reasoning passed on");
        assert!(!reasoning.is_empty(), "{body}");
        assert!(
            message["content"]
                .as_str()
                .unwrap()
                .starts_with("You wrote: Explain tides"),
            "{body}"
        );
        assert!(
            answer["usage"]["completion_tokens_details"]["reasoning_tokens"]
                .as_u64()
                .unwrap()
                > 0,
            "{body}"
        );

        let (status, _, body) = post(proxy, &user(model, "Explain tides briefly", true), &[]).await;
        assert_eq!(status, 200, "{body}");
        assert_clean(&body);
        let chunks = chunks(&body);
        let streamed = joined(&chunks, 0, field);
        assert_eq!(streamed, reasoning, "{model}: the same reasoning, streamed");
        let reasoning_chunks = chunks
            .iter()
            .filter(|chunk| chunk["choices"][0]["delta"][field].is_string())
            .count();
        assert!(reasoning_chunks > 3, "reasoning kept its deltas: {body}");
        // OpenRouter repeats the reasoning in `reasoning_details`, whole and
        // in every delta: the same text reaches the client there too.
        if model == "sim-reasoner-openrouter" {
            let details = |value: &Value| {
                value["reasoning_details"][0]["text"]
                    .as_str()
                    .map(str::to_owned)
            };
            assert_eq!(details(message).as_deref(), Some(reasoning), "{model}");
            let streamed_details: String = chunks
                .iter()
                .filter_map(|chunk| details(&chunk["choices"][0]["delta"]))
                .collect();
            assert_eq!(
                streamed_details, reasoning,
                "{model}: the details, streamed"
            );
        }
        assert!(
            joined(&chunks, 0, "content").starts_with("You wrote: Explain tides"),
            "{body}"
        );
    }
}

/// A reasoning model that spends the whole (small) budget on reasoning it
/// does not show ends with no text and `length`, as direct: the client gets
/// that answer, not an echo failure, in Chat and Responses, whole and
/// streamed. Reasoning that is shown is vouched for by the echo after it,
/// or, cut before the reply, by quoting the canaries the echo asks for (as
/// the sim's reasoning model does, restating its instructions): that
/// answer too reaches the client as direct, its reasoning cut at the
/// client's limit (the policies' unit tests hold the reasoning that quotes
/// less to the echo).
async fn a_budget_spent_on_hidden_reasoning(proxy: &Running) {
    for stream in [false, true] {
        let mut body = user("sim-reasoner-hidden", "Explain tides briefly", stream);
        body["max_completion_tokens"] = json!(5);
        let (status, headers, text) = post(proxy, &body, &[]).await;
        assert_eq!(status, 200, "{text}");
        assert_eq!(headers["x-canarygate-verdict"], "pass", "{text}");
        let (content, finish) = if stream {
            let chunks = chunks(&text);
            let finish = chunks
                .iter()
                .find_map(|chunk| chunk["choices"][0]["finish_reason"].as_str())
                .map(str::to_owned);
            (joined(&chunks, 0, "content"), finish)
        } else {
            let answer: Value = serde_json::from_str(&text).unwrap();
            let reasoning = &answer["usage"]["completion_tokens_details"]["reasoning_tokens"];
            assert_eq!(reasoning, &answer["usage"]["completion_tokens"], "{text}");
            let choice = &answer["choices"][0];
            (
                choice["message"]["content"].as_str().unwrap().to_owned(),
                choice["finish_reason"].as_str().map(str::to_owned),
            )
        };
        assert_eq!((content.as_str(), finish.as_deref()), ("", Some("length")));

        let response = client()
            .post(format!("{}/v1/responses", proxy.url))
            .bearer_auth("sk-fidelity")
            .json(
                &json!({"model": "sim-reasoner", "input": "Explain tides briefly",
                          "max_output_tokens": 16, "stream": stream}),
            )
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-canarygate-verdict"], "pass");
        let text = response.text().await.unwrap();
        let status = text
            .lines()
            .filter_map(|line| line.strip_prefix("data: ").or(Some(line)))
            .filter_map(|data| serde_json::from_str::<Value>(data).ok())
            .map(|event| event.get("response").cloned().unwrap_or(event))
            .find_map(|response| {
                response["incomplete_details"]["reason"]
                    .as_str()
                    .map(str::to_owned)
            });
        assert_eq!(status.as_deref(), Some("max_output_tokens"), "{text}");
    }
    let mut body = user("sim-reasoner", "Explain tides briefly", false);
    body["max_completion_tokens"] = json!(5);
    let (status, headers, text) = post(proxy, &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(headers["x-canarygate-verdict"], "pass", "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{text}");
    assert_eq!(choice["message"]["content"], "", "{text}");
    let reasoning = choice["message"]["reasoning_content"].as_str().unwrap();
    assert!(!reasoning.is_empty() && !reasoning.contains("CG"), "{text}");
}

/// A reasoning model that shows its reasoning, never restates the canary
/// instruction (as most real ones), and is cut at the token limit before
/// its reply: nothing vouches for that reasoning, so it is withheld, and
/// the answer goes out as a hidden reasoner's would (`pass;
/// withheld=reasoning`), never blocked and retried. In Chat, Responses and
/// Messages, whole and streamed. A thinking budget at or over the client's
/// limit reaches the provider, for it to judge.
async fn reasoning_cut_before_its_reply_is_withheld(proxy: &Running) {
    const WITHHELD: &str = "pass; withheld=reasoning";
    for stream in [false, true] {
        let mut body = user("sim-reasoner-terse", "Explain tides briefly", stream);
        body["max_completion_tokens"] = json!(1);
        let (status, headers, text) = post(proxy, &body, &[]).await;
        assert_eq!(status, 200, "{text}");
        assert_eq!(headers["x-canarygate-verdict"], WITHHELD, "{text}");
        assert!(!text.contains("weigh"), "the reasoning is withheld: {text}");
        if stream {
            let chunks = chunks(&text);
            assert_eq!(joined(&chunks, 0, "reasoning_content"), "", "{text}");
            assert_eq!(joined(&chunks, 0, "content"), "", "{text}");
            assert!(text.contains(&format!(": x-canarygate-verdict {WITHHELD}\n")));
            assert!(text.contains("\"length\""), "{text}");
        } else {
            let answer: Value = serde_json::from_str(&text).unwrap();
            let choice = &answer["choices"][0];
            assert_eq!(choice["finish_reason"], "length", "{text}");
            assert_eq!(choice["message"]["content"], "", "{text}");
            assert_eq!(choice["message"]["reasoning_content"], "", "{text}");
            let reasoning = &answer["usage"]["completion_tokens_details"]["reasoning_tokens"];
            assert!(reasoning.as_u64().unwrap() > 1, "billed: {text}");
        }

        let response = client()
            .post(format!("{}/v1/responses", proxy.url))
            .bearer_auth("sk-fidelity")
            .json(
                &json!({"model": "sim-reasoner-terse", "input": "Explain tides briefly",
                          "reasoning": {"summary": "auto"}, "max_output_tokens": 16,
                          "stream": stream}),
            )
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-canarygate-verdict"], WITHHELD);
        let text = response.text().await.unwrap();
        assert!(!text.contains("weigh"), "the summary is withheld: {text}");
        assert!(text.contains("max_output_tokens"), "{text}");

        let response = client()
            .post(format!("{}/v1/messages", proxy.url))
            .header("x-api-key", "sk-fidelity")
            .header("anthropic-version", "2023-06-01")
            .json(&json!({"model": "sim-reasoner-terse", "max_tokens": 20,
                          "thinking": {"type": "adaptive"}, "stream": stream,
                          "messages": [{"role": "user", "content": "Explain tides briefly"}]}))
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-canarygate-verdict"], WITHHELD);
        let text = response.text().await.unwrap();
        assert!(!text.contains("weigh"), "the thinking is withheld: {text}");
        assert!(
            !text.contains("\"thinking\""),
            "its block is dropped: {text}"
        );
        assert!(text.contains("max_tokens"), "{text}");
    }
    // A budget at the limit goes as the client set it: the provider refuses
    // it as Anthropic does (with interleaved thinking it would accept it).
    let response = client()
        .post(format!("{}/v1/messages", proxy.url))
        .header("x-api-key", "sk-fidelity")
        .header("anthropic-version", "2023-06-01")
        .json(&json!({"model": "sim-model", "max_tokens": 2048,
                      "thinking": {"type": "enabled", "budget_tokens": 2048},
                      "messages": [{"role": "user", "content": "Explain tides briefly"}]}))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 400);
    let text = response.text().await.unwrap();
    assert!(
        text.contains("`max_tokens` must be greater than `thinking.budget_tokens`"),
        "the provider's own refusal: {text}"
    );
}

async fn logprobs_follow_the_content(proxy: &Running) {
    let mut body = user("reporter", "Describe a lighthouse", false);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    let (status, _, text) = post(proxy, &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_clean(&text);
    let answer: Value = serde_json::from_str(&text).unwrap();
    let choice = &answer["choices"][0];
    let tokens: String = choice["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["token"].as_str().unwrap())
        .collect();
    assert_eq!(tokens, choice["message"]["content"].as_str().unwrap());
    for entry in choice["logprobs"]["content"].as_array().unwrap() {
        let token = entry["token"].as_str().unwrap();
        assert_eq!(entry["bytes"], json!(token.as_bytes()), "{entry}");
    }

    body["stream"] = json!(true);
    let (status, _, text) = post(proxy, &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_clean(&text);
    let mut content = String::new();
    for chunk in chunks(&text) {
        let Some(choice) = chunk["choices"].get(0) else {
            continue;
        };
        let Some(delta) = choice["delta"]["content"].as_str() else {
            continue;
        };
        content.push_str(delta);
        if delta.is_empty() {
            continue;
        }
        let tokens: String = choice["logprobs"]["content"]
            .as_array()
            .unwrap_or_else(|| panic!("a content chunk keeps its logprobs: {chunk}"))
            .iter()
            .map(|entry| entry["token"].as_str().unwrap())
            .collect();
        assert_eq!(tokens, delta, "{chunk}");
    }
    assert!(
        content.starts_with("You wrote: Describe a lighthouse"),
        "{content}"
    );
}

async fn tool_and_function_calls_keep_their_increments(proxy: &Running) {
    let tools = json!([{"type": "function", "function": {
        "name": "lookup_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]);
    let mut body = user("reporter", "What is the weather in Oslo?", false);
    body["tools"] = tools.clone();
    body["tool_choice"] = json!("required");
    let (status, _, text) = post(proxy, &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_clean(&text);
    let answer: Value = serde_json::from_str(&text).unwrap();
    let call = &answer["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "lookup_weather");
    let arguments = call["function"]["arguments"].as_str().unwrap();
    serde_json::from_str::<Value>(arguments).expect("arguments are JSON");
    assert_eq!(answer["choices"][0]["finish_reason"], "tool_calls");

    body["stream"] = json!(true);
    let (status, _, text) = post(proxy, &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_clean(&text);
    let deltas: Vec<Value> = chunks(&text)
        .iter()
        .filter_map(|chunk| {
            chunk["choices"][0]["delta"]["tool_calls"][0]
                .as_object()
                .cloned()
        })
        .map(Value::Object)
        .collect();
    assert!(deltas.len() >= 3, "increments kept: {text}");
    assert!(
        deltas[0]["id"].as_str().unwrap().starts_with("call_"),
        "{text}"
    );
    assert_eq!(deltas[0]["function"]["name"], "lookup_weather");
    assert!(
        deltas[1].get("id").is_none(),
        "later deltas carry only arguments: {text}"
    );
    let streamed: String = deltas
        .iter()
        .filter_map(|delta| delta["function"]["arguments"].as_str())
        .collect();
    let streamed: Value = serde_json::from_str(&streamed).expect("streamed arguments are JSON");
    assert!(streamed["city"].is_string(), "{streamed}");

    let mut body = user("reporter", "What is the weather in Oslo?", true);
    body["functions"] = json!([tools[0]["function"]]);
    body["function_call"] = json!({"name": "lookup_weather"});
    let (status, _, text) = post(proxy, &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_clean(&text);
    let chunks = chunks(&text);
    let deltas: Vec<&Value> = chunks
        .iter()
        .map(|chunk| &chunk["choices"][0]["delta"]["function_call"])
        .filter(|call| call.is_object())
        .collect();
    assert!(deltas.len() >= 3, "function_call increments kept: {text}");
    assert_eq!(deltas[0]["name"], "lookup_weather");
    let streamed: String = deltas
        .iter()
        .filter_map(|delta| delta["arguments"].as_str())
        .collect();
    serde_json::from_str::<Value>(&streamed).expect("arguments are JSON");
    let last = chunks
        .iter()
        .rev()
        .find(|chunk| chunk["choices"][0]["finish_reason"].is_string())
        .unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "function_call");
}

async fn provider_fields_and_headers_pass(proxy: &Running, dir: &ProxyDir) {
    let (status, headers, text) =
        post(proxy, &user("reporter", "Name three rivers", false), &[]).await;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert!(answer["system_fingerprint"].is_string(), "{text}");
    assert_eq!(answer["service_tier"], "default");
    assert_eq!(answer["choices"][0]["message"]["refusal"], Value::Null);
    assert_eq!(answer["choices"][0]["message"]["annotations"], json!([]));
    assert!(answer["id"].as_str().unwrap().starts_with("chatcmpl-"));
    for name in [
        "x-request-id",
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-remaining-tokens",
        "openai-processing-ms",
        "openai-version",
    ] {
        assert!(
            headers.contains_key(name),
            "{name} not passed on: {headers:?}"
        );
    }
    for name in ["set-cookie", "openai-organization", "x-sim-context"] {
        assert!(!headers.contains_key(name), "{name} passed on: {headers:?}");
    }
    let (prompt, completion) = overhead(headers["x-canarygate-overhead-tokens"].to_str().unwrap());
    assert!(prompt > 10 && completion.is_some(), "{headers:?}");
    let provider_id = headers["x-request-id"].to_str().unwrap().to_owned();
    let our_id = headers["x-canarygate-request-id"]
        .to_str()
        .unwrap()
        .to_owned();

    let (status, headers, text) =
        post(proxy, &user("reporter", "Name three rivers", true), &[]).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        headers.contains_key("x-ratelimit-remaining-requests"),
        "{headers:?}"
    );
    assert!(!headers.contains_key("set-cookie"));
    let head = headers["x-canarygate-overhead-tokens"].to_str().unwrap();
    assert!(head.ends_with("completion=pending"), "{head}");
    assert!(
        text.contains(": x-canarygate-overhead-tokens prompt="),
        "the stream's last comment gives the overhead: {text}"
    );
    let first = &chunks(&text)[0];
    assert!(first["system_fingerprint"].is_string(), "{first}");
    assert!(
        chunks(&text)
            .iter()
            .any(|chunk| chunk["obfuscation"].is_string()),
        "unknown fields pass: {text}"
    );

    // A rate limit reaches the client with the provider's retry hints.
    let (status, headers, text) =
        post(proxy, &user("limited", "Name three rivers", false), &[]).await;
    assert_eq!(status, 429, "{text}");
    assert_eq!(headers["retry-after"], "1");
    assert!(headers.contains_key("retry-after-ms"), "{headers:?}");
    assert_eq!(headers["x-should-retry"], "true", "{headers:?}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "rate_limit_exceeded", "{text}");

    // Fields that would return the prompt (canaries included) are refused.
    let mut body = user("reporter", "Name three rivers", false);
    body["prompt_logprobs"] = json!(1);
    let (status, _, text) = post(proxy, &body, &[]).await;
    assert_eq!(status, 400, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["param"], "prompt_logprobs", "{text}");

    // The provider's id is in the audit record.
    let records = audit_export(&dir.data());
    let record = records
        .iter()
        .find(|record| record.to_string().contains(&our_id))
        .expect("the request's record");
    assert!(
        record
            .to_string()
            .contains(&format!("\"provider_request_id\":\"{provider_id}\"")),
        "{record}"
    );
    assert!(
        record.to_string().contains("\"overhead_tokens\""),
        "{record}"
    );
}

/// The client's limit holds for what it gets, and the provider is asked
/// for that limit plus what the echo costs its model's tokenizer: a
/// digit-by-digit allowance for a model canarygate does not know
/// (`reporter`, sent upstream as `sim-model`), a smaller one for an OpenAI
/// model, whose tokenizer groups digits by three, and for a deployment
/// whose provider says its tokenizer does.
async fn limits_are_honoured(proxy: &Running) {
    for (model, cost) in [
        ("reporter", EchoCost::DIGIT_BY_DIGIT),
        ("gpt-4o-mini", EchoCost::DIGITS_IN_THREES),
        ("my-deployment", EchoCost::DIGITS_IN_THREES),
    ] {
        let allowance = cost.allowance(2);
        for stream in [false, true] {
            for field in ["max_tokens", "max_completion_tokens"] {
                let mut body = user(model, "Tell me about the history of maps", stream);
                body[field] = json!(5);
                let (status, _, text) = post(proxy, &body, &[]).await;
                assert_eq!(status, 200, "{text}");
                assert_clean(&text);
                let (content, finish) = if stream {
                    let chunks = chunks(&text);
                    let finish = chunks
                        .iter()
                        .find_map(|chunk| chunk["choices"][0]["finish_reason"].as_str())
                        .unwrap()
                        .to_owned();
                    (joined(&chunks, 0, "content"), finish)
                } else {
                    let answer: Value = serde_json::from_str(&text).unwrap();
                    // The provider's billed count: the simulator writes to
                    // the limit it was given when its reply is longer.
                    let billed = answer["usage"]["completion_tokens"].as_u64().unwrap();
                    assert!(billed <= 5 + allowance, "{model}: {text}");
                    if cost == EchoCost::DIGITS_IN_THREES {
                        // The reply runs past the 21 tokens asked for.
                        assert_eq!(billed, 5 + allowance, "{model}: {text}");
                    }
                    let choice = &answer["choices"][0];
                    (
                        choice["message"]["content"].as_str().unwrap().to_owned(),
                        choice["finish_reason"].as_str().unwrap().to_owned(),
                    )
                };
                // The simulator's tokens are canarygate's estimate pieces.
                let tokens = canarygate_policies::tokens::count_text(&content);
                assert!(
                    (1..=5).contains(&tokens),
                    "{model} {field}=5 stream={stream}: {tokens} tokens in {content:?}"
                );
                assert_eq!(finish, "length", "{text}");
            }
        }
    }
}

async fn every_choice_is_verified(proxy: &Running) {
    let mut body = user("reporter", "List some birds", false);
    body["n"] = json!(2);
    let (status, headers, text) = post(proxy, &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(headers["x-canarygate-verdict"], "pass");
    assert_clean(&text);
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["choices"].as_array().unwrap().len(), 2, "{text}");

    body["stream"] = json!(true);
    let (status, _, text) = post(proxy, &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_clean(&text);
    let chunks = chunks(&text);
    // The simulator varies each choice's body; each opens like an answer.
    for index in [0, 1] {
        assert!(
            joined(&chunks, index, "content").starts_with("You wrote: "),
            "choice {index}: {text}"
        );
    }
}

async fn models_of_the_wildcard_route_are_listed(proxy: &Running) {
    let response = client()
        .get(format!("{}/v1/models", proxy.url))
        .bearer_auth("sk-fidelity")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let list: Value = response.json().await.unwrap();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|model| model["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids[..3],
        ["reporter", "limited", "my-deployment"],
        "named routes first: {list}"
    );
    for id in ["sim-model", "sim-reasoner"] {
        assert!(ids.contains(&id), "{id} missing: {list}");
    }
    // One model (the SDKs' `models.retrieve`): a named route described
    // here, another asked of the wildcard route's provider, whose 404 for a
    // model it does not serve is passed on.
    let retrieve = |id: &'static str| async move {
        let response = client()
            .get(format!("{}/v1/models/{id}", proxy.url))
            .bearer_auth("sk-fidelity")
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json::<Value>().await.unwrap())
    };
    let (status, named) = retrieve("reporter").await;
    assert_eq!(status, 200, "{named}");
    assert_eq!(
        (named["id"].as_str(), named["owned_by"].as_str()),
        (Some("reporter"), Some("sim")),
        "{named}"
    );
    let (status, asked) = retrieve("sim-reasoner").await;
    assert_eq!(status, 200, "{asked}");
    assert_eq!(asked["id"], "sim-reasoner", "{asked}");
    assert_eq!(asked["object"], "model", "{asked}");
    let (status, missing) = retrieve("no-such-model").await;
    assert_eq!(status, 404, "{missing}");
    assert_eq!(missing["error"]["code"], "model_not_found", "{missing}");

    // Without credentials to pass on: the named routes alone.
    let response = client()
        .get(format!("{}/v1/models", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let list: Value = response.json().await.unwrap();
    assert_eq!(list["data"].as_array().unwrap().len(), 3, "{list}");
}
