//! The Responses API surface (`POST /v1/responses`) end to end, with the
//! official openai SDK: honest answers (whole, streamed, the stream helper,
//! a reasoning summary, a two-turn conversation the provider keeps) pass
//! with the canaries stripped everywhere the SDK reads text; a dropped head
//! canary and a swapped context are blocked; a stream that fails half-way
//! ends with an error the SDK raises; the local engine answers in the
//! Responses shape; every audit record names the endpoint.

use std::process::Command;

use serde_json::{Value, json};

use crate::common::*;

fn policy(sims: &[(&str, &Running)], model: &std::path::Path) -> String {
    let mut policy = String::from("[limits]\nfirst_byte_timeout_ms = 5000\n");
    for (name, sim) in sims {
        policy.push_str(&format!(
            "\n[[providers]]\nname = \"{name}\"\nbase_url = \"{}/v1\"\ncontext_window = 100000\n",
            sim.url
        ));
    }
    let routes = [
        ("m-honest", "honest", "sim-model", ""),
        ("m-reasoner", "honest", "sim-reasoner", ""),
        ("m-trunc", "trunc", "sim-model", ""),
        ("m-swap", "swap", "sim-model", ""),
        ("m-overloaded", "overloaded", "sim-model", ""),
        // Any prompt is over this trusted context: the local engine serves.
        (
            "m-local",
            "honest",
            "sim-model",
            "max_context_tokens = 20\n",
        ),
    ];
    for (model, provider, upstream, extra) in routes {
        policy.push_str(&format!(
            "\n[[routes]]\nmodel = \"{model}\"\nprovider = \"{provider}\"\n\
             upstream_model = \"{upstream}\"\nlocal_model = \"tiny-local\"\n{extra}"
        ));
    }
    policy.push_str(&format!(
        "\n[local]\nmodel_dir = \"{}\"\nkv_budget_mib = 32\n",
        model.display()
    ));
    policy
}

fn text<'a>(value: &'a Value, pointer: &str) -> &'a str {
    value
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer}: {value}"))
}

#[test]
fn responses_surface_with_the_openai_sdk() {
    let honest = start_sim(&[]);
    let trunc = start_sim(&["--mode", "truncate-head"]);
    let swap = start_sim(&["--mode", "swap"]);
    let overloaded = start_sim(&["--mode", "overloaded"]);
    let dir = ProxyDir::new();
    let model = tiny_model(dir.dir.path(), "tiny", 4096);
    let sims = [
        ("honest", &honest),
        ("trunc", &trunc),
        ("swap", &swap),
        ("overloaded", &overloaded),
    ];
    let policy_path = dir.policy(&policy(&sims, &model));
    let proxy = start_proxy_with_policy(&dir, &policy_path, &[]);

    let output = Command::new(python())
        .arg(workspace_root().join("tests/python/surface_responses.py"))
        .arg(format!("{}/v1", proxy.url))
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "surface_responses.py failed:\n{stdout}\n{stderr}"
    );
    let result: Value = serde_json::from_str(stdout.trim()).expect("one JSON line");

    // Whole: the echo stripped, the repeated request fields the client's own.
    let plain = &result["plain"];
    assert!(
        text(plain, "/text").starts_with("You wrote: Name the planets"),
        "{plain}"
    );
    assert_eq!(plain["instructions"], "Be brief.", "{plain}");
    assert_eq!(
        result["instructions_back"],
        serde_json::json!(["Ticket [CG123456789012345] is open; be terse.", ""]),
    );
    assert_eq!(plain["max_output_tokens"], 40, "{plain}");
    assert!(text(plain, "/id").starts_with("resp_"), "{plain}");
    assert_eq!(plain["verdict"], "pass", "{plain}");
    assert!(plain["input_tokens"].as_u64().unwrap() > 10, "{plain}");

    // Streamed: the deltas, the .done text and the final output agree.
    let stream = &result["stream"];
    let deltas = text(stream, "/deltas");
    assert!(
        deltas.starts_with("You wrote: Name the planets"),
        "{stream}"
    );
    assert_eq!(stream["done"][0], deltas, "{stream}");
    assert_eq!(stream["final_text"], deltas, "{stream}");
    let sequence: Vec<u64> = stream["sequence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|number| number.as_u64().unwrap())
        .collect();
    assert_eq!(
        sequence,
        (0..sequence.len() as u64).collect::<Vec<_>>(),
        "every event passes, numbered as the provider numbered it"
    );
    assert_eq!(stream["types"][0], "response.created", "{stream}");

    // The helper, with a reasoning summary that quoted the canaries.
    let helper = &result["helper"];
    assert!(
        text(helper, "/deltas").starts_with("You wrote: Name the planets"),
        "{helper}"
    );
    assert_eq!(helper["final_text"], helper["deltas"], "{helper}");
    assert!(
        text(helper, "/summary").starts_with("Let me read"),
        "{helper}"
    );
    assert_eq!(helper["final_summary"][0], helper["summary"], "{helper}");

    // A conversation the provider keeps: the session's own earlier canaries
    // in the context are not foreign.
    let conversation = &result["conversation"];
    for turn in ["/second", "/third"] {
        assert!(
            text(conversation, turn).contains("You wrote:"),
            "{conversation}"
        );
    }
    // Read back (`responses.retrieve`): the text the client was delivered,
    // no canary anywhere (the script checks), and no instructions where the
    // client sent none (canarygate's head was all they held).
    assert_eq!(
        conversation["read_back"],
        json!([true, true]),
        "{conversation}"
    );
    assert_eq!(
        conversation["read_back_instructions"],
        json!([null, null]),
        "{conversation}"
    );
    // A client's own canary-shaped ticket stays in what it reads back.
    assert_eq!(conversation["ticket_kept"], true, "{conversation}");

    let bad = &result["bad_input"];
    assert_eq!(bad["status"], 400, "{bad}");
    assert_eq!(bad["code"], "invalid_value", "{bad}");
    assert_eq!(bad["param"], "input", "{bad}");

    // A leak and a foreign canary are blocked.
    for (case, check) in [("truncated", "echo"), ("swapped", "foreign_canary")] {
        let error = &result[case];
        assert_eq!(error["status"], 502, "{case}: {error}");
        assert_eq!(error["code"], "canarygate_verification_failed", "{error}");
        assert!(text(error, "/message").contains(check), "{case}: {error}");
    }

    // A failure mid-stream: the provider's own error and failed response
    // reach the client, the failed response's output edited (no canary).
    let failed = &result["overloaded"];
    assert_eq!(
        failed["types"],
        serde_json::json!(["error", "response.failed"]),
        "{failed}"
    );
    assert_eq!(failed["error_code"], "server_error", "{failed}");
    assert_eq!(failed["status"], "failed", "{failed}");
    let deltas = text(failed, "/deltas");
    assert!(deltas.starts_with("You wrote:"), "{failed}");
    assert!(!holds_canary(text(failed, "/final_text")), "{failed}");

    // The local engine, in the Responses shape.
    let local = &result["local"];
    assert_eq!(local["served_by"], "local", "{local}");
    assert_eq!(local["object"], "response", "{local}");
    assert!(text(local, "/id").starts_with("resp_"), "{local}");
    assert!(!text(local, "/text").is_empty(), "{local}");
    assert!(local["output_tokens"].as_u64().unwrap() > 0, "{local}");
    assert!(!text(local, "/stream_deltas").is_empty(), "{local}");
    assert_eq!(local["stream_text"], local["stream_deltas"], "{local}");

    let records = audit_export(&dir.data());
    assert!(records.len() >= 13, "{}", records.len());
    let read_back = records
        .iter()
        .filter(|record| record["endpoint"] == "responses_stored")
        .inspect(|record| assert_eq!(record["verdict"], "unverifiable", "{record}"))
        .count();
    assert_eq!(read_back, 3, "the three stored responses read back");
    for record in &records {
        assert!(
            record["endpoint"] == "responses" || record["endpoint"] == "responses_stored",
            "{record}"
        );
    }
}
