//! Injected conversations under a strict chat template: one leading system
//! message at most, strict user/assistant alternation, well-formed tool
//! turns. The template is checked to refuse each broken shape, then every
//! conversation below (and random valid ones) must render after injection,
//! in every echo mode and as a passive request, with the client's text and
//! turns unchanged and everything before the head canary the same for every
//! request.

mod common;

use canarygate_policies::EchoCost;
use canarygate_policies::inject::{
    RequestCanaries, client_text, inject, obedient_echo, prefix_spans_turns,
};
use canarygate_policies::tokens::content_text;
use canarygate_policies::{EchoMode, Injection};
use common::canary;
use common::strict::render;
use proptest::prelude::*;
use serde_json::{Value, json};

fn tool_call(id: &str, name: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": "{\"q\": \"x\"}"}})
}

/// Conversations real clients send, each valid under the strict template.
fn conversations() -> Vec<(&'static str, Value)> {
    vec![
        (
            "one user message",
            json!([{"role": "user", "content": "Hi"}]),
        ),
        (
            "system prompt",
            json!([
                {"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "Explain hash maps."}
            ]),
        ),
        (
            "multi-turn",
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Tell me a joke"},
                {"role": "assistant", "content": "Why did the chicken..."},
                {"role": "user", "content": "Another one"}
            ]),
        ),
        (
            "multi-turn without system",
            json!([
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}
            ]),
        ),
        (
            "array-of-parts content",
            json!([
                {"role": "system", "content": [{"type": "text", "text": "Describe images."}]},
                {"role": "user", "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                ]},
                {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
                {"role": "user", "content": [{"type": "text", "text": "And its colour?"}]}
            ]),
        ),
        (
            "tool round trip",
            json!([
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Weather in Oslo and Bergen?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    tool_call("call_1", "weather"), tool_call("call_2", "weather")
                ]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3 C"},
                {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "5 C"}]}
            ]),
        ),
        (
            "tool round trip, then a new question",
            json!([
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [tool_call("c1", "weather")]},
                {"role": "tool", "tool_call_id": "c1", "content": "3 C"},
                {"role": "assistant", "content": "3 C in Oslo."},
                {"role": "user", "content": "Thanks. Bergen?"}
            ]),
        ),
        (
            "empty system content",
            json!([{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]),
        ),
    ]
}

/// The request kinds that change what is injected.
fn requests(messages: &Value) -> Vec<(&'static str, EchoMode, Value)> {
    let base = json!({"model": "m", "messages": messages});
    let mut json_mode = base.clone();
    json_mode["response_format"] = json!({"type": "json_object"});
    let mut tools = base.clone();
    tools["tools"] =
        json!([{"type": "function", "function": {"name": "weather", "parameters": {}}}]);
    vec![
        ("head+tail", EchoMode::HeadTail, base.clone()),
        ("head", EchoMode::Head, base.clone()),
        ("off", EchoMode::Off, base),
        ("json mode", EchoMode::HeadTail, json_mode),
        ("tools", EchoMode::HeadTail, tools),
    ]
}

fn canaries(n: u64) -> RequestCanaries {
    RequestCanaries {
        head: canary(2 * n),
        tail: canary(2 * n + 1),
    }
}

/// Injects and checks what every injection must keep: it renders, the roles
/// and the assistant and tool turns are the client's, each client text is
/// still there in front of whatever was added, and the canaries are in.
fn check_injection(name: &str, request: &Value, echo: EchoMode, n: u64) -> (Value, Injection) {
    let client = request["messages"].as_array().unwrap().clone();
    render(&request["messages"]).unwrap_or_else(|e| panic!("{name}: the client's own: {e}"));
    let mut injected = request.clone();
    let injection = inject(&mut injected, echo, EchoCost::DIGIT_BY_DIGIT, canaries(n)).unwrap();
    render(&injected["messages"]).unwrap_or_else(|e| panic!("{name}: injected: {e}\n{injected}"));
    let messages = injected["messages"].as_array().unwrap();
    let added = messages.len() - client.len();
    // A system message is added only when the head needs one: the client
    // sent none and its stable prefix ends before its turns. Passive markers
    // end a tool loop's newest output, the one tool turn that changes.
    let leads_with_system = client[0]["role"] == "system";
    let ends_with_tool = client.last().is_some_and(|last| last["role"] == "tool");
    let tool_end =
        (injection.passive.is_some() && ends_with_tool).then(|| client.len() - 1 + added);
    let inserts = !leads_with_system && !prefix_spans_turns(&client) && tool_end.is_none();
    assert_eq!(added, usize::from(inserts), "{name}");
    if added == 1 {
        assert_eq!(messages[0]["role"], "system", "{name}");
        assert_eq!(client_text(&content_text(&messages[0]["content"])), "");
    }
    for (index, (original, now)) in client.iter().zip(&messages[added..]).enumerate() {
        assert_eq!(original["role"], now["role"], "{name}");
        if original["role"] == "user"
            || original["role"] == "system"
            || tool_end == Some(index + added)
        {
            let (before, after) = (
                content_text(&original["content"]),
                content_text(&now["content"]),
            );
            assert!(
                after.starts_with(before.as_ref()),
                "{name}: {before:?} -> {after:?}"
            );
            assert_eq!(client_text(&after).trim_end(), before.trim_end(), "{name}");
        } else {
            assert_eq!(
                original, now,
                "{name}: assistant turns and earlier tool turns are untouched"
            );
        }
    }
    let text = injected["messages"].to_string();
    for canary in [injection.canaries.head, injection.canaries.tail] {
        assert!(text.contains(&canary.to_string()), "{name}");
    }
    (injected, injection)
}

#[test]
fn every_injected_conversation_renders_under_the_strict_template() {
    let mut n = 0;
    for (conversation, messages) in conversations() {
        for (kind, echo, request) in requests(&messages) {
            n += 1;
            let name = format!("{conversation}, {kind}");
            let (injected, injection) = check_injection(&name, &request, echo, n);
            let expected: Vec<String> = injection.echo.iter().map(ToString::to_string).collect();
            assert_eq!(
                obedient_echo(&injected),
                (!expected.is_empty()).then(|| expected.join(" ")),
                "{name}"
            );
        }
    }
}

#[test]
fn the_strict_template_refuses_what_strict_templates_refuse() {
    let user = json!({"role": "user", "content": "q"});
    let assistant = json!({"role": "assistant", "content": "a"});
    let system = json!({"role": "system", "content": "s"});
    let calling =
        json!({"role": "assistant", "content": null, "tool_calls": [tool_call("c1", "f")]});
    let result = json!({"role": "tool", "tool_call_id": "c1", "content": "r"});
    let refused = [
        (
            "canarygate's old shape",
            json!([system, user, system]),
            "only allowed first",
        ),
        (
            "two system messages",
            json!([system, system, user]),
            "only allowed first",
        ),
        ("user twice", json!([user, user]), "must alternate"),
        (
            "assistant first",
            json!([assistant, user]),
            "must alternate",
        ),
        (
            "assistant twice",
            json!([user, assistant, assistant, user]),
            "must alternate",
        ),
        (
            "ends with the assistant",
            json!([user, assistant]),
            "must end with",
        ),
        ("unanswered tool call", json!([user, calling]), "unanswered"),
        (
            "tool without a call",
            json!([user, result]),
            "answers no tool call",
        ),
        (
            "tool naming another call",
            json!([user, calling, {"role": "tool", "tool_call_id": "c9", "content": "r"}]),
            "unknown or answered",
        ),
        (
            "same call answered twice",
            json!([user, {"role": "assistant", "content": null, "tool_calls": [tool_call("c1", "f"), tool_call("c2", "f")]}, result, result]),
            "unknown or answered",
        ),
        (
            "malformed tool call",
            json!([user, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}]}]),
            "malformed tool call",
        ),
        (
            "user after a tool call",
            json!([user, calling, user]),
            "must alternate",
        ),
        (
            "image in a system message",
            json!([{"role": "system", "content": [{"type": "image_url", "image_url": {}}]}, user]),
            "unsupported content part",
        ),
        (
            "content as an object",
            json!([{"role": "user", "content": {"text": "q"}}]),
            "must be a string",
        ),
        (
            "unknown role",
            json!([{"role": "narrator", "content": "q"}]),
            "unknown role",
        ),
    ];
    for (name, messages, complaint) in refused {
        let error = render(&messages).expect_err(name);
        assert!(error.contains(complaint), "{name}: {error}");
    }
    assert!(render(&json!([system, user, calling, result])).is_ok());
}

#[test]
fn everything_before_the_head_canary_is_the_same_for_every_request() {
    // A provider's prompt cache holds the longest repeated prefix: it must
    // reach past the client's whole system prompt, to our fixed text.
    let system_prompt = "You are the nightly report writer. ".repeat(40);
    for (messages, client_prefix) in [
        (
            json!([{"role": "system", "content": system_prompt}, {"role": "user", "content": "Report for Monday"}]),
            system_prompt.clone(),
        ),
        (
            json!([{"role": "user", "content": "Report for Monday"}]),
            String::new(),
        ),
    ] {
        let request = json!({"model": "m", "messages": messages});
        let client_render = render(&request["messages"]).unwrap();
        let renders: Vec<(String, Injection)> = (0..3)
            .map(|n| {
                let mut injected = request.clone();
                let injection = inject(
                    &mut injected,
                    EchoMode::HeadTail,
                    EchoCost::DIGIT_BY_DIGIT,
                    canaries(100 + n),
                )
                .unwrap();
                let question = injected["messages"].as_array().unwrap().len() - 1;
                assert!(
                    injected["messages"][question]["content"]
                        .as_str()
                        .unwrap()
                        .starts_with("Report for Monday")
                );
                (render(&injected["messages"]).unwrap(), injection)
            })
            .collect();
        let head_at = |(text, injection): &(String, Injection)| {
            text.find(&injection.canaries.head.to_string()).unwrap()
        };
        let shared = common_prefix(&renders[0].0, &renders[1].0)
            .min(common_prefix(&renders[1].0, &renders[2].0));
        assert!(
            shared >= head_at(&renders[0]),
            "the prefix reaches the head canary"
        );
        // And up to there the prompt is the client's own system prompt,
        // byte for byte, then fixed text of ours.
        let fixed = &renders[0].0[..head_at(&renders[0])];
        let client_system_end = client_render.find("[/SYSTEM]").unwrap_or("<s>".len());
        assert_eq!(
            &fixed[..client_system_end],
            &client_render[..client_system_end]
        );
        assert!(fixed.contains(&client_prefix));
    }
}

fn common_prefix(a: &str, b: &str) -> usize {
    a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
}

/// A random conversation the strict template accepts: an optional system
/// message, then turns from a small state machine (user, assistant, tool
/// round trips), content as strings or parts.
fn conversation() -> impl Strategy<Value = Value> {
    (
        any::<bool>(),
        any::<bool>(),
        proptest::collection::vec((0u8..4, any::<bool>(), 1usize..3), 0..8),
    )
        .prop_map(|(system, system_parts, turns)| {
            let content = |text: String, parts: bool| {
                if parts {
                    json!([{"type": "text", "text": text}])
                } else {
                    json!(text)
                }
            };
            let mut messages = Vec::new();
            if system {
                messages.push(json!({"role": "system", "content": content("Rules.".into(), system_parts)}));
            }
            messages.push(json!({"role": "user", "content": "First question"}));
            for (index, (kind, parts, calls)) in turns.into_iter().enumerate() {
                match kind {
                    // A tool round trip, then the answer.
                    0 => {
                        let ids: Vec<String> = (0..calls).map(|c| format!("call_{index}_{c}")).collect();
                        let calls: Vec<Value> = ids.iter().map(|id| tool_call(id, "lookup")).collect();
                        messages.push(json!({"role": "assistant", "content": null, "tool_calls": calls}));
                        for id in &ids {
                            messages.push(json!({"role": "tool", "tool_call_id": id, "content": content(format!("result {id}"), parts)}));
                        }
                        messages.push(json!({"role": "assistant", "content": content(format!("Answer {index}"), parts)}));
                    }
                    _ => messages.push(json!({"role": "assistant", "content": content(format!("Answer {index}"), parts)})),
                }
                messages.push(json!({"role": "user", "content": content(format!("Question {index}"), parts)}));
            }
            Value::Array(messages)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_valid_conversations_stay_valid(messages in conversation(), kind in 0usize..5, n in 0u64..1000) {
        let (name, echo, request) = requests(&messages).swap_remove(kind);
        check_injection(name, &request, echo, n);
    }
}
