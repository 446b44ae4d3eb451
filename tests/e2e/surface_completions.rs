//! Legacy completions (`POST /v1/completions`) end to end, with the official
//! openai SDK as the client: honest answers verified with the canaries
//! stripped (one prompt, a list of prompts with `n`, streamed), a provider
//! that lost the head of the prompt blocked, a foreign canary caught, a
//! failure after the stream began ended with an error event the SDK
//! raises, the local engine answering in this format, and every request in
//! the audit log under the `completions` endpoint.

use std::process::Command;

use serde_json::Value;

use crate::common::*;

/// Words of a prompt well over the `m-local` route's trusted context.
const LONG_WORDS: usize = 200;

#[tokio::test(flavor = "multi_thread")]
async fn completions_through_the_sdk_keep_every_guarantee() {
    let honest = start_sim(&[]);
    let truncating = start_sim(&["--mode", "truncate-head"]);
    let swapping = start_sim(&["--mode", "swap"]);
    let overloaded = start_sim(&["--mode", "overloaded"]);
    let dir = ProxyDir::new();
    let model = tiny_model(dir.dir.path(), "tiny", 4096);
    let mut providers = String::new();
    for (name, sim) in [
        ("honest", &honest),
        ("truncate", &truncating),
        ("swap", &swapping),
        ("overloaded", &overloaded),
    ] {
        providers.push_str(&format!(
            "[[providers]]\nname = \"{name}\"\nbase_url = \"{}/v1\"\ncontext_window = 100000\n\n\
             [[routes]]\nmodel = \"m-{name}\"\nprovider = \"{name}\"\nupstream_model = \"sim-model\"\n\n",
            sim.url
        ));
    }
    let policy = dir.policy(&format!(
        r#"
{providers}
[[routes]]
model = "m-local"
provider = "honest"
upstream_model = "sim-model"
local_model = "tiny-local"
max_context_tokens = 100

[local]
model_dir = "{}"
kv_budget_mib = 32
"#,
        model.display()
    ));
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);
    let long_prompt = vec!["harbour"; LONG_WORDS].join(" ");
    let output = Command::new(python())
        .arg(workspace_root().join("tests/python/surface_completions.py"))
        .arg(format!("{}/v1", proxy.url))
        .arg(&long_prompt)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "surface_completions.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let result: Value = serde_json::from_str(stdout.trim()).expect("one JSON line");

    // Honest, one prompt: verified, the echo stripped.
    let plain = &result["plain"];
    assert_eq!(plain["verdict"], "pass", "{plain}");
    assert_eq!(plain["served_by"], "upstream");
    assert_eq!(plain["object"], "text_completion");
    let text = plain["choices"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with("You wrote: Name the planets") && !holds_canary(text),
        "{text}"
    );
    assert!(plain["prompt_tokens"].as_u64().unwrap() > 10, "{plain}");

    // A list of prompts with n = 2: four choices, prompt-major.
    let list = result["list"].as_array().unwrap();
    assert_eq!(list.len(), 4, "{list:?}");
    for (index, choice) in list.iter().enumerate() {
        assert_eq!(choice["index"], index);
        let text = choice["text"].as_str().unwrap();
        // Each choice answers its own prompt (the sim varies the choices).
        let word = if index < 2 { "Mars" } else { "rivers" };
        assert!(
            text.starts_with("You wrote:") && text.contains(word) && !holds_canary(text),
            "choice {index}: {text}"
        );
        // Legacy logprobs count characters into the client's own prompt
        // and the text it got, as direct: canarygate's blocks and the echo
        // are not counted.
        let prompt = ["Count the moons of Mars", "List three rivers"][index / 2];
        assert_offsets_follow(choice, prompt.chars().count(), text);
    }

    // Streamed: the same, with the usage chunk only when asked.
    let stream = &result["stream"];
    let text = stream["text"].as_str().unwrap();
    assert!(
        text.starts_with("You wrote: Describe the harbour") && !holds_canary(text),
        "{stream}"
    );
    assert!(stream["finish_reason"].is_string(), "{stream}");
    assert!(
        stream["completion_tokens"].as_u64().unwrap() > 5,
        "{stream}"
    );
    assert_eq!(stream["objects"], serde_json::json!(["text_completion"]));
    // The sim streams offsets from the completion's start, as vLLM does.
    assert_offsets_follow(stream, 0, text);
    assert_eq!(result["stream_usage_chunks_unasked"], 0);

    // What cannot carry canaries: a 400 naming the field.
    for (key, param) in [("echo_refused", "echo"), ("token_ids_refused", "prompt")] {
        let error = &result[key];
        assert_eq!(error["status"], 400, "{key}: {error}");
        assert_eq!(error["param"], param, "{key}: {error}");
    }

    // The head of the prompt lost: blocked.
    let truncated = &result["truncated"];
    assert_eq!(truncated["status"], 502, "{truncated}");
    assert_eq!(truncated["code"], "canarygate_verification_failed");
    assert!(
        truncated["failed_checks"].to_string().contains("echo"),
        "{truncated}"
    );

    // Swapped context: the first request is answered honestly, the second
    // from the first's context, its canaries foreign.
    assert_eq!(result["swap_first"], Value::Null, "{result}");
    let swapped = &result["swap_second"];
    assert_eq!(swapped["status"], 502, "{swapped}");
    assert!(
        swapped["failed_checks"]
            .to_string()
            .contains("foreign_canary"),
        "{swapped}"
    );

    // A failure after the stream began: an error event the SDK raises.
    let failed = &result["overloaded"];
    assert_eq!(failed["raised"], "APIError", "{failed}");
    let text = failed["text"].as_str().unwrap();
    assert!(
        text.starts_with("You wrote:") && !holds_canary(text),
        "the verified head went out first: {failed}"
    );

    // The local engine, in this format, plain and streamed.
    let local = &result["local"];
    assert_eq!(local["served_by"], "local", "{local}");
    assert_eq!(local["reason"], "untrusted_context");
    assert_eq!(local["object"], "text_completion");
    assert!(
        local["id"].as_str().unwrap().starts_with("cmpl-"),
        "{local}"
    );
    assert_eq!(local["choices"].as_array().unwrap().len(), 1);
    assert!(local["choices"][0]["finish_reason"].is_string(), "{local}");
    assert!(local["completion_tokens"].as_u64().unwrap() > 0);
    let local_stream = &result["local_stream"];
    assert_eq!(local_stream["served_by"], "local", "{local_stream}");
    assert_eq!(
        local_stream["objects"],
        serde_json::json!(["text_completion"])
    );
    assert_eq!(
        local_stream["text"], local["choices"][0]["text"],
        "greedy: the same answer both ways"
    );
    let refused = &result["local_list_refused"];
    assert_eq!(refused["status"], 400, "{refused}");
    assert_eq!(refused["param"], "prompt", "{refused}");
    assert_eq!(
        sim_stats(&honest).await["requests"],
        4,
        "nothing of m-local went upstream"
    );

    // Every request is in the audit log, under this endpoint.
    let records = audit_export(&dir.data());
    // 4 honest, 2 refused before sending, truncated, 2 swap, overloaded,
    // 3 local (one refused).
    assert_eq!(records.len(), 13, "{records:?}");
    for record in &records {
        assert_eq!(record["endpoint"], "completions", "{record}");
    }
    let local = records
        .iter()
        .filter(|record| record["route"] == "local" && record["outcome"] == "complete")
        .count();
    assert_eq!(local, 2, "both local answers recorded");
}

/// The `text_offset`s of `seen` (its `tokens` beside them) start at `from`
/// and step by each token's characters, and the tokens join to `text`.
fn assert_offsets_follow(seen: &Value, from: usize, text: &str) {
    let tokens: Vec<&str> = seen["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("tokens: {seen}"))
        .iter()
        .map(|token| token.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), text, "{seen}");
    let offsets: Vec<usize> = tokens
        .iter()
        .scan(from, |at, token| {
            let offset = *at;
            *at += token.chars().count();
            Some(offset)
        })
        .collect();
    assert_eq!(seen["text_offset"], serde_json::json!(offsets), "{seen}");
}
