//! Anthropic's Messages API through canarygate, with the official anthropic
//! SDK (tests/python/surface_messages.py): honest answers plain, streamed
//! and through `messages.stream()`, canaries stripped; a leak
//! (`truncate-head`) and a foreign canary (`swap`) blocked with an
//! Anthropic-shaped 502 the SDK raises; a provider failing mid-stream ends
//! in an `event: error` the SDK raises; the local engine serving a prompt
//! the provider is not trusted with, in Messages' shape; canarygate's own
//! errors (no key, wrong API, bad request, wrong method) in Anthropic's
//! shape; every request in the audit log under endpoint `messages`.

use std::process::Command;

use serde_json::Value;

use crate::common::*;

/// Words of the prompt sent to the local engine (over the route's trusted
/// context of 300 tokens).
const LONG_WORDS: usize = 500;

fn long_text() -> String {
    let filler = ["the", "orbit", "of", "each", "planet", "was", "logged"];
    let words: Vec<&str> = (0..LONG_WORDS)
        .map(|index| filler[index % filler.len()])
        .collect();
    format!("Planet log: {}", words.join(" "))
}

fn anthropic_provider(name: &str, url: &str) -> String {
    format!(
        r#"
[[providers]]
name = "{name}"
api = "anthropic"
base_url = "{url}/v1"
context_window = 100000
"#
    )
}

fn route(model: &str, provider: &str, extra: &str) -> String {
    format!(
        r#"
[[routes]]
model = "{model}"
provider = "{provider}"
upstream_model = "sim-model"
local_model = "tiny-local"
{extra}
"#
    )
}

fn text(value: &Value) -> &str {
    value.as_str().unwrap_or_default()
}

/// An honest answer: the sim's reply, canaries gone.
fn assert_honest(answer: &Value, what: &str) {
    let text = text(&answer["text"]);
    assert!(
        text.starts_with("You wrote: Name the planets"),
        "{what}: {answer}"
    );
    assert!(!holds_canary(text), "{what}: {answer}");
}

fn assert_blocked(error: &Value, check: &str, what: &str) {
    assert_eq!(error["class"], "InternalServerError", "{what}: {error}");
    assert_eq!(error["status"], 502, "{what}: {error}");
    let body = &error["body"];
    assert_eq!(body["type"], "error", "{what}: {error}");
    assert_eq!(body["error"]["type"], "api_error", "{what}: {error}");
    assert_eq!(
        body["error"]["code"], "canarygate_verification_failed",
        "{what}: {error}"
    );
    let checks = body["error"]["failed_checks"].as_array().unwrap();
    assert!(checks.iter().any(|name| name == check), "{what}: {error}");
    assert!(!holds_canary(&body.to_string()), "{what}: {error}");
}

#[test]
fn the_anthropic_sdk_gets_every_guarantee_on_messages() {
    let honest = start_sim(&[]);
    let truncate = start_sim(&["--mode", "truncate-head"]);
    let swap = start_sim(&["--mode", "swap"]);
    let overloaded = start_sim(&["--mode", "overloaded", "--decode-tps", "400"]);
    let dir = ProxyDir::new();
    let model = tiny_model(dir.dir.path(), "tiny", 4096);
    let mut policy = String::from("[limits]\nfirst_byte_timeout_ms = 5000\n");
    for (name, sim) in [
        ("honest", &honest),
        ("truncate", &truncate),
        ("swap", &swap),
        ("overloaded", &overloaded),
    ] {
        policy.push_str(&anthropic_provider(name, &sim.url));
    }
    policy.push_str(&format!(
        "\n[[providers]]\nname = \"openai\"\nbase_url = \"{}/v1\"\ncontext_window = 100000\n",
        honest.url
    ));
    for (model, provider, extra) in [
        ("m-honest", "honest", ""),
        ("m-truncate", "truncate", ""),
        ("m-swap", "swap", ""),
        ("m-overloaded", "overloaded", ""),
        ("m-openai", "openai", ""),
        ("m-local", "honest", "max_context_tokens = 300"),
    ] {
        policy.push_str(&route(model, provider, extra));
    }
    policy.push_str(&format!(
        "\n[local]\nmodel_dir = \"{}\"\nkv_budget_mib = 32\n",
        model.display()
    ));
    let proxy = start_proxy_with_policy(&dir, &dir.policy(&policy), &[]);

    let output = Command::new(python())
        .arg(workspace_root().join("tests/python/surface_messages.py"))
        .arg(&proxy.url)
        .arg(long_text())
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "surface_messages.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let result: Value = serde_json::from_str(stdout.trim()).expect("one JSON line");

    // Honest answers, canaries stripped, whichever way they are read.
    let plain = &result["plain"];
    assert_honest(plain, "plain");
    assert_eq!(plain["verdict"], "pass", "{plain}");
    assert_eq!(plain["served_by"], "upstream", "{plain}");
    assert_eq!(plain["types"], serde_json::json!(["text"]), "{plain}");
    assert!(text(&plain["id"]).starts_with("msg_"), "{plain}");
    assert!(plain["input_tokens"].as_u64().unwrap() > 5, "{plain}");
    let stream = &result["stream"];
    assert_honest(stream, "stream");
    let events: Vec<&str> = stream["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(text)
        .collect();
    assert_eq!(events.first(), Some(&"message_start"), "{stream}");
    assert_eq!(events.last(), Some(&"message_stop"), "{stream}");
    assert!(events.contains(&"message_delta"), "{stream}");
    assert!(stream["output_tokens"].as_u64().unwrap() > 3, "{stream}");
    let helper = &result["helper"];
    assert_honest(helper, "helper");
    assert_eq!(helper["text"], helper["final_text"], "{helper}");

    // Thinking passes with its signature; the echo never shows.
    let thinking = &result["thinking"];
    assert_eq!(
        thinking["types"],
        serde_json::json!(["thinking", "text"]),
        "{thinking}"
    );
    assert!(!text(&thinking["signature"]).is_empty(), "{thinking}");
    assert!(!text(&thinking["thinking"]).is_empty(), "{thinking}");
    assert_honest(thinking, "thinking");
    // Thinking goes as the model wrote it (its signature signs it), so the
    // turn sent back is accepted, streamed or not.
    for how in ["stream_sent_back", "plain_sent_back"] {
        assert_eq!(thinking[how]["class"], Value::Null, "{how}: {thinking}");
    }
    // Tools: passive checks, the call's input intact both ways.
    let tools = &result["tools"];
    assert_eq!(tools["verdict"], "pass; passive=tools", "{tools}");
    assert_eq!(tools["stop_reason"], "tool_use", "{tools}");
    assert!(tools["inputs"][0]["city"].is_string(), "{tools}");
    assert_eq!(tools["stream_inputs"], tools["inputs"], "{tools}");
    assert_eq!(tools["stream_stop_reason"], "tool_use", "{tools}");
    // A prefill and a stop sequence that could cut the echo: passive, served.
    let passive = &result["passive"];
    assert_eq!(
        passive["prefill_verdict"], "pass; passive=prefill",
        "{passive}"
    );
    assert!(!text(&passive["prefill_text"]).is_empty(), "{passive}");
    assert!(!holds_canary(text(&passive["prefill_text"])), "{passive}");
    assert_eq!(
        passive["stop_verdict"], "pass; passive=stop_sequence",
        "{passive}"
    );
    // Asking for the model's whole output cap is served, not refused.
    let cap = &result["output_cap"];
    assert_eq!(cap["verdict"], "pass", "{cap}");
    assert_eq!(cap["stop_reason"], "end_turn", "{cap}");
    // The client's max_tokens holds although canarygate raised the provider's.
    let limit = &result["limit"];
    assert_eq!(limit["plain"]["stop_reason"], "max_tokens", "{limit}");
    assert_eq!(limit["stream"]["stop_reason"], "max_tokens", "{limit}");
    for shown in [
        text(&limit["plain"]["content"][0]["text"]),
        text(&limit["stream"]["text"]),
    ] {
        assert!(
            !holds_canary(shown) && shown.split_whitespace().count() <= 4,
            "{limit}"
        );
    }
    // The SDK's beta surface (`?beta=true`): verified, and its query string
    // reaches the provider (the last one the honest provider saw: nothing
    // after it asks that provider with a query).
    let beta = &result["beta"];
    assert_eq!(beta["verdict"], "pass", "{beta}");
    assert!(text(&beta["text"]).starts_with("You wrote: Name the planets"));
    assert!(!holds_canary(text(&beta["text"])), "{beta}");
    let stats = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(sim_stats(&honest));
    assert_eq!(stats["last_query"], "/v1/messages beta=true", "{stats}");

    // A leak (the head canary's message dropped) is blocked, plain and streamed.
    assert_blocked(&result["leak"], "echo", "leak");
    let leak = &result["leak_stream"];
    assert!(leak["events"].as_array().unwrap().is_empty(), "{leak}");
    assert_blocked(&leak["error"], "echo", "leak stream");
    // Another session's canaries in the answer.
    assert_blocked(&result["swap"], "foreign_canary", "swap");

    // The provider's own error passes as it sent it, before the stream
    // began and after: its error event, which the SDK raises.
    let refused = &result["overloaded"];
    assert_eq!(refused["class"], "OverloadedError", "{refused}");
    assert_eq!(refused["body"]["error"]["type"], "overloaded_error");
    assert!(refused["body"]["error"].get("code").is_none(), "{refused}");
    let broken = &result["overloaded_stream"];
    assert!(!text(&broken["text"]).is_empty(), "{broken}");
    assert!(!holds_canary(text(&broken["text"])), "{broken}");
    assert_eq!(broken["error"]["class"], "APIStatusError", "{broken}");
    let body = &broken["error"]["body"];
    assert_eq!(body["type"], "error", "{broken}");
    assert_eq!(body["error"]["type"], "overloaded_error", "{broken}");
    assert!(body["error"].get("code").is_none(), "{broken}");

    // canarygate's own errors, in Anthropic's shape.
    let other_api = &result["other_api"];
    assert_eq!(other_api["class"], "NotFoundError", "{other_api}");
    assert_eq!(other_api["body"]["error"]["type"], "not_found_error");
    assert!(
        text(&other_api["body"]["error"]["message"]).contains("api \"openai\""),
        "{other_api}"
    );
    let no_key = &result["no_key"];
    assert_eq!(no_key["class"], "AuthenticationError", "{no_key}");
    assert_eq!(no_key["body"]["error"]["type"], "authentication_error");
    assert_eq!(no_key["body"]["error"]["code"], "missing_api_key");
    let bad = &result["bad_request"];
    assert_eq!(bad["class"], "BadRequestError", "{bad}");
    assert_eq!(bad["body"]["error"]["param"], "messages", "{bad}");
    let old_client = &result["x_api_key"];
    assert_eq!(old_client["status"], 200, "{old_client}");
    assert!(!holds_canary(&old_client["body"].to_string()));
    for (key, status) in [("get", 405), ("unknown", 404)] {
        let answer = &result[key];
        assert_eq!(answer["status"], status, "{answer}");
        assert_eq!(answer["body"]["type"], "error", "{answer}");
    }

    // `models.list()`: the Anthropic routes' models, in Anthropic's shape;
    // an OpenAI client on the same proxy gets the OpenAI route's, in OpenAI's.
    let models = result["models"].as_array().unwrap();
    let ids: Vec<&str> = models.iter().map(|model| text(&model["id"])).collect();
    assert_eq!(
        ids,
        [
            "m-honest",
            "m-truncate",
            "m-swap",
            "m-overloaded",
            "m-local"
        ],
        "{models:?}"
    );
    assert!(
        models.iter().all(|model| model["type"] == "model"),
        "{models:?}"
    );
    assert_eq!(result["model"]["id"], "m-honest", "{}", result["model"]);
    assert_eq!(result["model"]["type"], "model", "{}", result["model"]);
    let openai = &result["openai_models"]["body"];
    assert_eq!(openai["object"], "list", "{openai}");
    assert_eq!(openai["data"][0]["id"], "m-openai", "{openai}");
    assert_eq!(openai["data"].as_array().unwrap().len(), 1, "{openai}");
    wildcard_models_are_asked_of_the_callers_api(&honest);

    // The local engine serves what the provider is not trusted with.
    let local = &result["local"];
    assert_eq!(local["served_by"], "local", "{local}");
    assert_eq!(local["model"], "tiny-local", "{local}");
    assert!(text(&local["id"]).starts_with("msg_"), "{local}");
    assert!(!text(&local["text"]).is_empty(), "{local}");
    let local_stream = &local["stream"];
    assert_eq!(local_stream["text"], local["text"], "greedy: {local}");
    assert_eq!(local_stream["stop_reason"], local["stop_reason"], "{local}");
    assert_eq!(local["helper"]["final_text"], local["text"], "{local}");

    // Every request is recorded under the Messages endpoint.
    drop(proxy);
    let records = audit_export(&dir.data());
    let messages: Vec<&Value> = records
        .iter()
        .filter(|record| record["endpoint"] == "messages")
        .collect();
    assert!(messages.len() >= 12, "{records:?}");
    assert!(
        messages.iter().any(|record| record["route"] == "local"),
        "{messages:?}"
    );
    assert!(
        messages
            .iter()
            .any(|record| record["verdict"].to_string().contains("fail")),
        "{messages:?}"
    );
}

/// With a wildcard route for each API, an Anthropic client's key goes to the
/// Anthropic provider only, which is asked in its own API (every model in
/// one page); the OpenAI provider is never asked.
fn wildcard_models_are_asked_of_the_callers_api(anthropic: &Running) {
    let dir = ProxyDir::new();
    let policy = format!(
        "{}\n[[providers]]\nname = \"openai\"\nbase_url = \"{}/v1\"\ncontext_window = 1000\n\n\
         [[routes]]\nmodel = \"named\"\nprovider = \"claude\"\n\n\
         [[routes]]\nmodel = \"*\"\nprovider = \"claude\"\n\n\
         [[routes]]\nmodel = \"*\"\nprovider = \"openai\"\n",
        anthropic_provider("claude", &anthropic.url),
        closed_url()
    );
    let proxy = start_proxy_with_policy(&dir, &dir.policy(&policy), &[]);
    let get = |path: String| {
        tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(async {
                let response = client()
                    .get(format!("{}{path}", proxy.url))
                    .header("x-api-key", "sk-ant-models")
                    .header("anthropic-version", "2023-06-01")
                    .send()
                    .await?;
                let status = response.status().as_u16();
                Ok::<_, reqwest::Error>((status, response.json::<Value>().await?))
            })
            .unwrap_or_else(|error| panic!("GET {path}: {error}"))
    };
    // One model (`models.retrieve`): named, or asked of the provider.
    for id in ["named", "sim-model"] {
        let (status, model) = get(format!("/v1/models/{id}"));
        assert_eq!(status, 200, "{model}");
        assert_eq!(
            (model["type"].as_str(), model["id"].as_str()),
            (Some("model"), Some(id))
        );
    }
    let (status, missing) = get("/v1/models/claude-none".to_owned());
    assert_eq!(status, 404, "{missing}");
    assert_eq!(missing["error"]["type"], "not_found_error", "{missing}");
    let (_, list) = get("/v1/models".to_owned());
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|model| text(&model["id"]))
        .collect();
    assert_eq!(
        ids,
        [
            "named",
            "sim-model",
            "sim-reasoner",
            "sim-reasoner-openrouter",
            "sim-reasoner-hidden",
            "sim-reasoner-terse"
        ],
        "{list}"
    );
    assert!(
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|model| model["type"] == "model"),
        "the provider was asked in Anthropic's API: {list}"
    );
    assert_eq!(list["has_more"], false, "{list}");
    assert_eq!(list["first_id"], "named", "{list}");
    assert_eq!(list["last_id"], "sim-reasoner-terse", "{list}");
}
