//! The local engine as fallback, end to end: each route to it (context
//! preflight, failed verdict, unavailable provider), streamed and not, with
//! the answer checked against the engine serving the same request directly.

use std::path::Path;

use serde_json::{Value, json};

use crate::common::*;

/// Words of a prompt far longer than the routes' trusted context.
const LONG_WORDS: usize = 700;

fn long_text(subject: &str, words: usize) -> String {
    let filler = [
        "the", "river", "survey", "was", "open", "in", "spring", "again",
    ];
    let mut text = format!("{subject}:");
    for index in 0..words {
        text.push(' ');
        text.push_str(filler[index % filler.len()]);
    }
    text
}

/// A greedy request (so the local answer is reproducible).
fn request(text: &str, stream: bool) -> Value {
    json!({
        "model": "m",
        "stream": stream,
        "temperature": 0,
        "max_tokens": 12,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}],
    })
}

fn policy(upstream: &str, model: &Path, route_extra: &str, extra: &str) -> String {
    format!(
        r#"
[limits]
first_byte_timeout_ms = 2000

[[providers]]
name = "sim"
base_url = "{upstream}/v1"
context_window = 100000

[[routes]]
model = "m"
provider = "sim"
local_model = "tiny-local"
{route_extra}

[local]
model_dir = "{}"
kv_budget_mib = 32
{extra}
"#,
        model.display()
    )
}

/// What the client got.
#[derive(Debug)]
struct Answer {
    status: u16,
    served_by: String,
    reason: String,
    content: String,
    model: String,
    done: bool,
    error_code: Option<String>,
}

async fn send(url: &str, body: &Value) -> Answer {
    let response = client()
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth("sk-local-test")
        .json(body)
        .send()
        .await
        .expect("send");
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let (served_by, reason) = (
        header("x-canarygate-served-by"),
        header("x-canarygate-local-reason"),
    );
    let text = response.text().await.expect("body");
    if body["stream"] == true && status == 200 {
        let events = sse_data(&text);
        let model = events
            .first()
            .and_then(|first| serde_json::from_str::<Value>(first).ok())
            .and_then(|chunk| chunk["model"].as_str().map(str::to_owned))
            .unwrap_or_default();
        let error_code = events
            .iter()
            .filter_map(|data| serde_json::from_str::<Value>(data).ok())
            .find_map(|chunk| chunk["error"]["code"].as_str().map(str::to_owned));
        return Answer {
            status,
            served_by,
            reason,
            content: stream_content(&text),
            model,
            done: events.last().is_some_and(|last| last == "[DONE]"),
            error_code,
        };
    }
    let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    Answer {
        status,
        served_by,
        reason,
        content: json["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_owned(),
        model: json["model"].as_str().unwrap_or("").to_owned(),
        done: true,
        error_code: json["error"]["code"].as_str().map(str::to_owned),
    }
}

/// The engine's own answer to `body`, served directly.
async fn reference(engine: &Running, body: &Value) -> String {
    let mut body = body.clone();
    body["stream"] = json!(false);
    let answer = send(&engine.url, &body).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert!(!answer.content.is_empty());
    answer.content
}

fn assert_local(answer: &Answer, reason: &str, expected: &str) {
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.served_by, "local", "{answer:?}");
    assert_eq!(answer.reason, reason, "{answer:?}");
    assert_eq!(answer.model, "tiny-local", "{answer:?}");
    assert!(answer.done, "{answer:?}");
    assert_eq!(
        answer.content, expected,
        "the local answer differs from the engine's"
    );
    assert!(!holds_canary(&answer.content) && !answer.content.contains("You wrote"));
}

/// Sends `body` (not streamed) and the same body streamed; both must be
/// served locally for `reason`, with the engine's answer `expected`.
async fn assert_local_both_ways(url: &str, body: &Value, reason: &str, expected: &str) {
    for stream in [false, true] {
        let mut body = body.clone();
        body["stream"] = json!(stream);
        assert_local(&send(url, &body).await, reason, expected);
    }
}

fn records_with_route(data: &Path, route: &str) -> Vec<Value> {
    audit_export(data)
        .into_iter()
        .filter(|record| record["route"] == route)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn preflight_sends_untrusted_context_to_local_before_anything_goes_upstream() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let model = tiny_model(dir.dir.path(), "tiny", 4096);
    let engine = start_engine_server(&model);
    let policy_path = dir.policy(&policy(&sim.url, &model, "max_context_tokens = 300", ""));
    let proxy = start_proxy_with_policy(&dir, &policy_path, &[]);

    let long = request(&long_text("Harvest log of Quenby", LONG_WORDS), false);
    let expected = reference(&engine, &long).await;
    assert_local_both_ways(&proxy.url, &long, "untrusted_context", &expected).await;
    assert_eq!(sim_stats(&sim).await["requests"], 0, "a byte went upstream");

    // Within the trusted context: the provider answers, verified.
    let short = send(&proxy.url, &request("Name three rivers", false)).await;
    assert_eq!(short.status, 200, "{short:?}");
    assert_eq!(short.served_by, "upstream");
    assert!(short.content.starts_with("You wrote:"), "{short:?}");
    assert_eq!(sim_stats(&sim).await["requests"], 1);

    let local = records_with_route(&dir.data(), "local");
    assert_eq!(local.len(), 2, "{local:?}");
    for record in &local {
        assert_eq!(record["action"], "fallback", "{record}");
        assert_eq!(record["outcome"], "complete", "{record}");
        let check = record["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|check| check["name"] == "context_claim")
            .expect("a context_claim check");
        assert_eq!(check["result"], "fail");
        assert_eq!(check["evidence"]["seen"]["limit"]["tokens"], 300);
        assert_eq!(check["evidence"]["seen"]["limit"]["source"], "policy");
    }
    drop(proxy);

    // `reject` answers the same request with a clean 400 instead.
    let reject_dir = ProxyDir::new();
    let reject_policy = reject_dir.policy(&policy(
        &sim.url,
        &model,
        "max_context_tokens = 300",
        "on_untrusted_context = \"reject\"",
    ));
    let proxy = start_proxy_with_policy(&reject_dir, &reject_policy, &[]);
    let rejected = send(&proxy.url, &long).await;
    assert_eq!(rejected.status, 400, "{rejected:?}");
    assert_eq!(
        rejected.error_code.as_deref(),
        Some("context_length_exceeded")
    );
    assert_eq!(sim_stats(&sim).await["requests"], 1, "a byte went upstream");
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_verdicts_are_served_locally_streamed_or_not_under_both_releases() {
    // Prompts over the provider's KV pool get another request's stale context.
    let sim = start_sim(&[
        "--mode",
        "leak-on-overflow",
        "--context-window",
        "4096",
        "--pool-tokens",
        "400",
    ]);
    let dir = ProxyDir::new();
    let model = tiny_model(dir.dir.path(), "tiny", 4096);
    let engine = start_engine_server(&model);

    let mut expected_records = 0;
    for release in ["echo-first", "verdict-first"] {
        let data_dir = ProxyDir::new();
        let policy_path = data_dir.policy(&policy(
            &sim.url,
            &model,
            "",
            &format!("\n[verify]\naction = \"fallback\"\nrelease = \"{release}\""),
        ));
        let proxy = start_proxy_with_policy(&data_dir, &policy_path, &[]);
        // Fill the provider's pool with someone else's request first.
        let other = send(&proxy.url, &request("Tax records of Ingleby", false)).await;
        assert_eq!(other.served_by, "upstream", "{other:?}");

        for stream in [false, true] {
            let body = request(&long_text("Diary of Fennimore", LONG_WORDS), stream);
            let expected = reference(&engine, &body).await;
            let before = sim_stats(&sim).await["leaked"].as_u64().unwrap();
            let answer = send(&proxy.url, &body).await;
            assert!(
                sim_stats(&sim).await["leaked"].as_u64().unwrap() > before,
                "the provider did not leak, so nothing was tested"
            );
            // No upstream byte reached the client: the whole answer is the engine's.
            assert_local(&answer, "verification_failed", &expected);
            assert!(!answer.content.contains("Ingleby"), "{answer:?}");
            expected_records += 1;
        }

        let local = records_with_route(&data_dir.data(), "local");
        assert_eq!(local.len(), 2, "{release}: {local:?}");
        for record in &local {
            assert_eq!(record["action"], "fallback");
            assert_eq!(record["verdict"], "fail", "{record}");
            assert!(
                record["prompt_tokens_provider"].as_u64().unwrap() > 500,
                "{record}"
            );
        }
    }
    assert_eq!(expected_records, 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn unavailable_providers_are_served_locally_only_when_asked() {
    let closed = closed_url();
    let stalled = start_sim(&["--mode", "stall-first-byte"]);
    let dir = ProxyDir::new();
    let model = tiny_model(dir.dir.path(), "tiny", 4096);
    let engine = start_engine_server(&model);
    let body = request("Name three rivers", false);
    let expected = reference(&engine, &body).await;

    for upstream in [closed.as_str(), stalled.url.as_str()] {
        let proxy_dir = ProxyDir::new();
        let fallback = proxy_dir.policy(&policy(
            upstream,
            &model,
            "",
            "on_upstream_unavailable = true",
        ));
        let proxy = start_proxy_with_policy(&proxy_dir, &fallback, &[]);
        assert_local_both_ways(&proxy.url, &body, "upstream_unavailable", &expected).await;
        drop(proxy);

        // Without the option the client gets the provider's failure.
        let plain_dir = ProxyDir::new();
        let plain = plain_dir.policy(&policy(upstream, &model, "", ""));
        let proxy = start_proxy_with_policy(&plain_dir, &plain, &[]);
        let failed = send(&proxy.url, &body).await;
        assert!(failed.status == 502 || failed.status == 504, "{failed:?}");
        assert_eq!(failed.served_by, "");
    }
}

#[test]
fn the_openai_sdk_gets_correct_answers_through_every_route() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let honest = start_sim(&[]);
    let leaky = start_sim(&[
        "--mode",
        "leak-on-overflow",
        "--context-window",
        "4096",
        "--pool-tokens",
        "400",
    ]);
    let closed = closed_url();
    let dir = ProxyDir::new();
    let model = tiny_model(dir.dir.path(), "tiny", 4096);
    let engine = start_engine_server(&model);
    let long = long_text("Diary of Fennimore", LONG_WORDS);
    let expected_long = runtime.block_on(reference(&engine, &request(&long, false)));
    let expected_short = runtime.block_on(reference(&engine, &request("Name three rivers", false)));

    let routes = [
        (
            "untrusted_context",
            policy(&honest.url, &model, "max_context_tokens = 300", ""),
            &long,
            &expected_long,
        ),
        (
            "verification_failed",
            policy(&leaky.url, &model, "", "\n[verify]\naction = \"fallback\""),
            &long,
            &expected_long,
        ),
        (
            "upstream_unavailable",
            policy(&closed, &model, "", "on_upstream_unavailable = true"),
            &"Name three rivers".to_owned(),
            &expected_short,
        ),
    ];
    for (reason, policy_text, text, expected) in routes {
        let proxy_dir = ProxyDir::new();
        let policy_path = proxy_dir.policy(&policy_text);
        let proxy = start_proxy_with_policy(&proxy_dir, &policy_path, &[]);
        let output = std::process::Command::new(python())
            .arg(workspace_root().join("tests/python/sdk_local.py"))
            .args([&format!("{}/v1", proxy.url), "m", text.as_str()])
            .output()
            .expect("run python");
        assert!(
            output.status.success(),
            "{reason}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let result: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
        for kind in ["plain", "stream"] {
            let seen = &result[kind];
            assert_eq!(seen["served_by"], "local", "{reason} {kind}: {seen}");
            assert_eq!(seen["reason"], reason, "{kind}: {seen}");
            assert_eq!(seen["model"], "tiny-local", "{reason} {kind}: {seen}");
            assert_eq!(
                seen["content"],
                expected.as_str(),
                "{reason} {kind}: {seen}"
            );
            assert!(
                seen["finish_reason"] == "length" || seen["finish_reason"] == "stop",
                "{seen}"
            );
        }
        assert!(result["plain"]["prompt_tokens"].as_u64().unwrap() > 3);
        // The SDK's request id is canarygate's, as it is the provider's
        // on the provider's answers.
        assert_eq!(
            result["plain"]["request_id"], result["plain"]["canarygate_request_id"],
            "{reason}"
        );
        assert!(result["plain"]["request_id"].is_string(), "{reason}");
        assert_eq!(
            result["stream"]["completion_tokens"],
            result["plain"]["completion_tokens"]
        );
    }
}

#[test]
fn the_local_fallback_example_runs() {
    let work = tempfile::tempdir().expect("tempdir");
    let output = std::process::Command::new("bash")
        .arg(workspace_root().join("examples/local-fallback/run.sh"))
        .env("CANARYGATE_BIN", binary())
        .env("WORK_DIR", work.path().join("run"))
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run examples/local-fallback/run.sh");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for expected in [
        "served-by=upstream  reason=-  model=reporter",
        "served-by=local  reason=untrusted_context  model=reporter-local",
        "served-by=local  reason=upstream_unavailable  model=reporter-local",
        "route=local    action=fallback",
        "local fallback example: ok",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
}

/// A Messages route, `a`, on an Anthropic provider at `upstream`, whose
/// trusted context (5 tokens) sends every request to the local engine.
fn anthropic_route(upstream: &str) -> String {
    format!(
        r#"
[[providers]]
name = "anthropic"
api = "anthropic"
base_url = "{upstream}/v1"
context_window = 100000

[[routes]]
model = "a"
provider = "anthropic"
local_model = "tiny-local"
max_context_tokens = 5
"#
    )
}

/// What the local engine cannot do is refused in the API's own error shape,
/// a 400 naming the field, never served without it: more than one choice,
/// logprobs, tools, JSON output, content other than text, tool turns, a
/// conversation the provider keeps, a background answer, thinking; and what
/// the API itself refuses (`n` 0, `temperature` 3, an unknown role). A text
/// request on the same route is served.
#[tokio::test(flavor = "multi_thread")]
async fn what_the_local_engine_cannot_serve_is_refused_in_each_apis_format() {
    let closed = closed_url();
    let dir = ProxyDir::new();
    let model = tiny_model(dir.dir.path(), "tiny", 4096);
    // Every request is over the routes' trusted context: all go to local.
    let mut policy_text = policy(&closed, &model, "max_context_tokens = 5", "");
    policy_text.push_str(&anthropic_route(&closed));
    let proxy_dir = ProxyDir::new();
    let policy_path = proxy_dir.policy(&policy_text);
    let proxy = start_proxy_with_policy(&proxy_dir, &policy_path, &[]);
    let engine = start_engine_server(&model);

    let user = |text: &str| json!([{"role": "user", "content": text}]);
    let chat = |extra: Value| {
        let mut body = json!({"model": "m", "max_tokens": 4, "messages": user("Name a river")});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let image_part = json!([{"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]);
    let tool = json!([{"type": "function", "function": {"name": "weather",
        "parameters": {"type": "object", "properties": {}}}}]);
    let chat_cases = [
        ("n", chat(json!({"n": 2}))),
        ("n", chat(json!({"n": 0}))),
        ("temperature", chat(json!({"temperature": 3}))),
        ("max_tokens", chat(json!({"max_tokens": 0}))),
        (
            "max_completion_tokens",
            chat(json!({"max_completion_tokens": 0})),
        ),
        (
            "messages",
            chat(json!({"messages": [{"role": "wizard", "content": "Name a river"}]})),
        ),
        (
            "logprobs",
            chat(json!({"logprobs": true, "top_logprobs": 2})),
        ),
        (
            "tools",
            chat(json!({"tools": tool, "tool_choice": "required"})),
        ),
        (
            "response_format",
            chat(json!({"response_format": {"type": "json_object"}})),
        ),
        (
            "messages",
            chat(json!({"messages": [{"role": "user", "content": image_part}]})),
        ),
        (
            "messages",
            chat(json!({"messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                    "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})),
        ),
    ];
    let responses = |extra: Value| {
        let mut body = json!({"model": "m", "max_output_tokens": 16, "input": "Name a river"});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let responses_cases = [
        (
            "max_output_tokens",
            responses(json!({"max_output_tokens": 0})),
        ),
        (
            "tools",
            responses(json!({"tools": [{"type": "function", "name": "weather",
            "parameters": {"type": "object", "properties": {}}}]})),
        ),
        (
            "text",
            responses(json!({"text": {"format": {"type": "json_object"}}})),
        ),
        (
            "previous_response_id",
            responses(json!({"previous_response_id": "resp_1"})),
        ),
        (
            "input",
            responses(json!({"input": [{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}]})),
        ),
    ];
    let messages = |extra: Value| {
        let mut body = json!({"model": "a", "max_tokens": 4, "messages": user("Name a river")});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let messages_cases = [
        (
            "messages",
            messages(
                json!({"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Name a river"}]}),
            ),
        ),
        (
            "tools",
            messages(json!({"tools": [{"name": "weather",
            "input_schema": {"type": "object", "properties": {}}}]})),
        ),
        (
            "thinking",
            messages(json!({"max_tokens": 2048,
            "thinking": {"type": "enabled", "budget_tokens": 1024}})),
        ),
        (
            "messages",
            messages(json!({"messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "iVBORw0KGgo="}},
                {"type": "text", "text": "What is this?"}]}]})),
        ),
    ];

    let post = |path: &'static str, body: Value| {
        let request = client()
            .post(format!("{}/v1/{path}", proxy.url))
            .bearer_auth("sk-local-test")
            .header("anthropic-version", "2023-06-01")
            .json(&body)
            .send();
        async move {
            let response = request.await.expect("send");
            let status = response.status().as_u16();
            let body: Value = response.json().await.expect("a JSON body");
            (status, body)
        }
    };
    let completions_cases = [(
        "logprobs",
        json!({"model": "m", "max_tokens": 4, "prompt": "Name a river", "logprobs": 2}),
    )];
    for (path, cases) in [
        ("chat/completions", &chat_cases[..]),
        ("responses", &responses_cases[..]),
        ("messages", &messages_cases[..]),
        ("completions", &completions_cases[..]),
    ] {
        for (param, body) in cases {
            let (status, answer) = post(path, body.clone()).await;
            assert_eq!(status, 400, "{path} {param}: {answer}");
            // OpenAI's shape, or Anthropic's on the Messages endpoint.
            let error = if path == "messages" {
                assert_eq!(answer["type"], "error", "{answer}");
                assert_eq!(answer["error"]["type"], "invalid_request_error", "{answer}");
                &answer["error"]
            } else {
                assert_eq!(answer["error"]["param"], *param, "{path}: {answer}");
                &answer["error"]
            };
            // The local engine refused it (or, for a role Anthropic refuses,
            // canarygate did as Anthropic would); nothing went upstream.
            let message = error["message"].as_str().unwrap();
            assert!(
                message.starts_with("Local engine: cannot serve")
                    || message.starts_with(&format!("Local engine: `{param}` must be"))
                    || message.contains("unknown role")
                    || message.contains("Input should be 'user' or 'assistant'")
                    || message.contains("must be served by canarygate's local engine, which"),
                "{path} {param}: {answer}"
            );
        }
        // Plain text on the same route is served.
        let plain = match path {
            "chat/completions" => chat(json!({})),
            "responses" => responses(json!({})),
            "completions" => json!({"model": "m", "max_tokens": 4, "prompt": "Name a river"}),
            _ => messages(json!({})),
        };
        let (status, answer) = post(path, plain).await;
        assert_eq!(status, 200, "{path}: {answer}");
        // Every API reports the route's local model.
        assert_eq!(answer["model"], "tiny-local", "{path}: {answer}");
    }

    // A prompt over the engine's window names the format's prompt field.
    let long = long_text("Diary", 5000);
    for (path, body, param) in [
        ("responses", responses(json!({"input": long})), "input"),
        (
            "completions",
            json!({"model": "m", "max_tokens": 4, "prompt": long}),
            "prompt",
        ),
        (
            "chat/completions",
            chat(json!({"messages": user(&long)})),
            "messages",
        ),
    ] {
        let (status, answer) = post(path, body).await;
        assert_eq!(status, 400, "{path}: {answer}");
        assert_eq!(
            answer["error"]["code"], "context_length_exceeded",
            "{answer}"
        );
        assert_eq!(answer["error"]["param"], param, "{path}: {answer}");
    }

    // `canarygate engine serve` refuses the same, and `n` 2.0 too (a float
    // is no count; it was served as one choice).
    for n in [json!(2), json!(2.0)] {
        let response = client()
            .post(format!("{}/v1/chat/completions", engine.url))
            .json(&chat(json!({"n": n})))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "n = {n}");
        let answer: Value = response.json().await.unwrap();
        assert_eq!(answer["error"]["param"], "n", "{answer}");
    }
    // Another path or method, or a body over 2 MiB: OpenAI's errors, not
    // empty bodies or plain text.
    let huge = chat(json!({"messages": user(&"a".repeat(2_100_000))}));
    for (request, status, code) in [
        (
            client()
                .post(format!("{}/v1/chat/completions", engine.url))
                .json(&huge),
            413,
            "request_too_large",
        ),
        (
            client().post(format!("{}/v1/completions", engine.url)),
            404,
            "unknown_url",
        ),
        (
            client().get(format!("{}/v1/chat/completions", engine.url)),
            405,
            "method_not_allowed",
        ),
    ] {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), status);
        let answer: Value = response.json().await.expect("a JSON error");
        assert_eq!(answer["error"]["code"], code, "{answer}");
    }
}

/// An answer the local engine cut at a stop string names it: Chat's
/// `stop_reason` (as vLLM names it) on the engine, Anthropic's
/// `stop_sequence` through the Messages endpoint.
#[tokio::test(flavor = "multi_thread")]
async fn the_stop_string_a_local_answer_stopped_at_is_named() {
    let closed = closed_url();
    let dir = ProxyDir::new();
    let model = tiny_model(dir.dir.path(), "tiny", 4096);
    let engine = start_engine_server(&model);
    let mut policy_text = policy(&closed, &model, "", "");
    policy_text.push_str(&anthropic_route(&closed));
    let proxy_dir = ProxyDir::new();
    let policy_path = proxy_dir.policy(&policy_text);
    let proxy = start_proxy_with_policy(&proxy_dir, &policy_path, &[]);

    // A stop string from the middle of the greedy answer.
    let stop_in = |text: &str| -> String {
        let chars: Vec<char> = text.chars().collect();
        assert!(chars.len() >= 8, "too little text: {text:?}");
        chars[4..6].iter().collect()
    };
    let mut body = request("Name three rivers", false);
    body["max_tokens"] = json!(24);
    let whole = reference(&engine, &body).await;
    let stop = stop_in(&whole);
    body["stop"] = json!(["no such stop", stop]);
    let answer: Value = client()
        .post(format!("{}/v1/chat/completions", engine.url))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{answer}");
    assert_eq!(choice["stop_reason"], json!(stop), "{answer}");

    let messages = |stop_sequences: Value, stream: bool| {
        json!({"model": "a", "max_tokens": 24, "temperature": 0, "stream": stream,
               "stop_sequences": stop_sequences,
               "messages": [{"role": "user", "content": "Name three rivers"}]})
    };
    let post = |body: Value| {
        client()
            .post(format!("{}/v1/messages", proxy.url))
            .header("x-api-key", "sk-local-test")
            .header("anthropic-version", "2023-06-01")
            .json(&body)
            .send()
    };
    let whole: Value = post(messages(json!([]), false))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let stop = stop_in(whole["content"][0]["text"].as_str().unwrap());
    let cut: Value = post(messages(json!([stop]), false))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(cut["stop_reason"], "stop_sequence", "{cut}");
    assert_eq!(cut["stop_sequence"], json!(stop), "{cut}");
    let streamed = post(messages(json!([stop]), true))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        streamed.contains(&format!(
            r#""stop_reason":"stop_sequence","stop_sequence":{}"#,
            json!(stop)
        )),
        "{streamed}"
    );
}
