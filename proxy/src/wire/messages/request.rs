//! A Messages request: validated as far as canarygate relies on it, read as
//! chat messages for token counts, and given its canaries.
//!
//! The head block goes with the system prompt, after the client's own text:
//! appended to a `system` string, or as a new text block after the
//! client's blocks (so every `cache_control` prefix the client marked stays
//! byte-identical); a request without `system` gets the head as its
//! `system`. The tail block goes at the end of the last user turn: appended
//! to its string, or as a new text block after its blocks (`tool_result`
//! blocks stay first in the turn, as Anthropic requires). When the stable
//! prefix spans turns (earlier turns, or a `cache_control` mark in a user
//! turn: [`prefix_spans_turns`]), the head goes there too, before the tail,
//! and `system` is left as it came. `max_tokens` is
//! raised by the echo's allowance ([`EchoCost::allowance`]) when an echo is
//! asked, which keeps a thinking budget below it (a limit of 0, which
//! Anthropic refuses, goes as it came). Tools, a structured output format,
//! a prefill (the conversation ends with an assistant turn, which the model
//! continues) or a stop sequence that could cut the echo off
//! ([`stops_may_cut_echo`]) leave the checks passive, as in Chat
//! Completions.
//!
//! Longer than 500 lines: about 200 of them are the unit tests, which hold
//! each refused shape, each placement and each passive reason to a request.

use canarygate_policies::EchoCost;
use canarygate_policies::inject::{
    BLOCK_SEPARATOR, Blocks, EchoObstacles, Injection, PromptEstimate, RequestCanaries,
    append_to_content, passive_reason, prefix_spans_turns, stops_may_cut_echo,
};
use canarygate_policies::tokens::count_chat_messages;
use canarygate_policies::verify_config::EchoMode;
use serde_json::{Map, Value, json};

use crate::error::{ApiError, ErrorCode};
use crate::wire::chat::json_object;
use crate::wire::format::ClientRequest;

/// Parses and validates a Messages request.
pub fn parse(bytes: &[u8]) -> Result<ClientRequest, ApiError> {
    let body = json_object(bytes)?;
    let object = body.as_object().expect("json_object returns an object");
    let model = match object.get("model") {
        Some(Value::String(model)) if !model.is_empty() => model.clone(),
        Some(_) => return Err(invalid("model", "model: must be a non-empty string")),
        None => return Err(invalid("model", "model: Field required")),
    };
    let max_tokens = match object.get("max_tokens") {
        Some(value) => value
            .as_u64()
            .ok_or_else(|| invalid("max_tokens", "max_tokens: must be a non-negative integer"))?,
        None => return Err(invalid("max_tokens", "max_tokens: Field required")),
    };
    check_messages(object.get("messages"))?;
    check_system(object.get("system"))?;
    let stream = match object.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => *stream,
        Some(_) => return Err(invalid("stream", "stream: must be a boolean")),
    };
    check_thinking(object.get("thinking"))?;
    match object.get("tools") {
        None | Some(Value::Null | Value::Array(_)) => {}
        Some(_) => return Err(invalid("tools", "tools: must be an array of tools")),
    }
    Ok(ClientRequest {
        body,
        model,
        stream,
        max_tokens: Some(max_tokens),
    })
}

fn invalid(param: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, message)
}

/// `messages`: a non-empty array of objects with a string `role` and a
/// string or an array of content blocks (objects with a string `type`).
fn check_messages(messages: Option<&Value>) -> Result<(), ApiError> {
    let messages = match messages {
        Some(Value::Array(messages)) if !messages.is_empty() => messages,
        Some(Value::Array(_)) => {
            return Err(invalid(
                "messages",
                "messages: at least one message is required",
            ));
        }
        Some(_) => return Err(invalid("messages", "messages: must be an array")),
        None => return Err(invalid("messages", "messages: Field required")),
    };
    for (index, message) in messages.iter().enumerate() {
        if message.get("role").and_then(Value::as_str).is_none() {
            return Err(invalid(
                "messages",
                format!("messages.{index}: must be an object with a string `role`"),
            ));
        }
        match message.get("content") {
            Some(Value::String(_)) => {}
            Some(Value::Array(blocks)) => check_blocks(blocks, &format!("messages.{index}"))?,
            _ => {
                return Err(invalid(
                    "messages",
                    format!(
                        "messages.{index}.content: must be a string or an array of content blocks"
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn check_blocks(blocks: &[Value], at: &str) -> Result<(), ApiError> {
    for (index, block) in blocks.iter().enumerate() {
        if block.get("type").and_then(Value::as_str).is_none() {
            return Err(invalid(
                "messages",
                format!("{at}.content.{index}: must be a content block with a string `type`"),
            ));
        }
    }
    Ok(())
}

/// `system`: absent, a string, or an array of text blocks.
fn check_system(system: Option<&Value>) -> Result<(), ApiError> {
    match system {
        None | Some(Value::Null | Value::String(_)) => Ok(()),
        Some(Value::Array(blocks)) => {
            for (index, block) in blocks.iter().enumerate() {
                let is_text = block.get("type").and_then(Value::as_str) == Some("text")
                    && block.get("text").is_some_and(Value::is_string);
                if !is_text {
                    return Err(invalid(
                        "system",
                        format!("system.{index}: must be a text block (`type: \"text\"`, `text`)"),
                    ));
                }
            }
            Ok(())
        }
        Some(_) => Err(invalid(
            "system",
            "system: must be a string or an array of text blocks",
        )),
    }
}

/// `thinking`: an object; its `budget_tokens`, when set, a non-negative
/// integer. Whether it must be below `max_tokens` is the provider's to say:
/// Anthropic requires it, except with interleaved thinking (a beta), where
/// the budget spans every thinking block of the turn; canarygate raises the
/// limit only for a budget below it ([`place`]), so the provider
/// judges the client's own numbers.
fn check_thinking(thinking: Option<&Value>) -> Result<(), ApiError> {
    let thinking = match thinking {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(thinking)) => thinking,
        Some(_) => return Err(invalid("thinking", "thinking: must be an object")),
    };
    match thinking.get("budget_tokens") {
        None | Some(Value::Null) => Ok(()),
        Some(budget) => match budget.as_u64() {
            Some(_) => Ok(()),
            None => Err(invalid(
                "thinking",
                "thinking.budget_tokens: must be a non-negative integer",
            )),
        },
    }
}

/// The text a model reads in a content slot: a string, or the text of its
/// blocks (text, thinking, tool inputs and results), one per line.
fn blocks_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter_map(|block| match block.get("type").and_then(Value::as_str) {
                Some("text") => block.get("text").and_then(Value::as_str).map(str::to_owned),
                Some("thinking") => block
                    .get("thinking")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                Some("tool_use") => block.get("input").map(Value::to_string),
                Some("tool_result") => block.get("content").map(blocks_text),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The prompt as chat messages (`{role, content}` with string content): the
/// system prompt first, then every turn, for token counts and the context
/// preflight.
pub fn chat_messages(body: &Value) -> Vec<Value> {
    let mut messages = Vec::new();
    if let Some(system) = body.get("system").filter(|system| !system.is_null()) {
        messages.push(json!({"role": "system", "content": blocks_text(system)}));
    }
    for message in body["messages"].as_array().map_or(&[][..], Vec::as_slice) {
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or("user");
        let content = message.get("content").map(blocks_text).unwrap_or_default();
        messages.push(json!({"role": role, "content": content}));
    }
    messages
}

/// Places `canaries` in `body` (a request [`parse`] accepted) per `echo`.
pub fn place(
    body: &mut Value,
    echo: EchoMode,
    cost: EchoCost,
    canaries: RequestCanaries,
) -> Result<Injection, ApiError> {
    let prompt_tokens_before = count_chat_messages(&chat_messages(body));
    let object = body
        .as_object_mut()
        .ok_or_else(|| ApiError::new(ErrorCode::InvalidJson, "The body must be an object."))?;
    let last_user = last_user_turn(object)?;
    let has_tools = object
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|tools| !tools.is_empty());
    let obstacles = EchoObstacles {
        json_mode: json_mode(object),
        tools: has_tools,
        prefill: ends_with_assistant_turn(object),
        stop_sequence: stops_may_cut_echo(object.get("stop_sequences")),
        audio: false,
    };
    let passive = passive_reason(echo, obstacles);
    let blocks = Blocks::new(echo, passive, canaries);
    let stream = object
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let client_max_tokens = object.get("max_tokens").and_then(Value::as_u64);
    let thinking_budget = object
        .get("thinking")
        .and_then(|thinking| thinking.get("budget_tokens"))
        .and_then(Value::as_u64);
    let mut echo_allowance = 0;
    if let Some(limit) = client_max_tokens
        && limit > 0
        && thinking_budget.is_none_or(|budget| budget < limit)
        && !blocks.echo.is_empty()
    {
        // A thinking budget below the client's limit stays below the raised
        // one. One at or above it goes with the client's own limit, for the
        // provider to refuse as it would without canarygate (or to accept,
        // with interleaved thinking).
        echo_allowance = cost.allowance(blocks.echo.len());
        object.insert(
            "max_tokens".into(),
            Value::from(limit.saturating_add(echo_allowance)),
        );
    }
    let spans_turns = object
        .get("messages")
        .and_then(Value::as_array)
        .is_some_and(|messages| prefix_spans_turns(messages));
    // What goes after the client's system prompt, if anything.
    let system_text = match last_user {
        Some(index) if spans_turns => {
            // The history is the stable prefix: both blocks end the last
            // user turn, the head first.
            let content = &mut object["messages"][index]["content"];
            append_to_content(content, &blocks.head, "text");
            append_to_content(content, &blocks.tail, "text");
            None
        }
        Some(index) => {
            let content = &mut object["messages"][index]["content"];
            append_to_content(content, &blocks.tail, "text");
            Some(blocks.head)
        }
        None => Some([blocks.head, blocks.tail].join(BLOCK_SEPARATOR)),
    };
    if let Some(text) = system_text {
        let system = object.entry("system").or_insert(Value::Null);
        if !append_to_content(system, &text, "text") {
            return Err(invalid(
                "system",
                "system: must be a string or an array of text blocks",
            ));
        }
    }
    let estimate = PromptEstimate::of(prompt_tokens_before, &chat_messages(body), canaries.head);
    let echo_tokens_least = cost.least(blocks.echo.len());
    Ok(Injection {
        canaries,
        system_inserted: false,
        echo: blocks.echo,
        passive,
        stream,
        choices: 1,
        client_max_tokens,
        echo_allowance,
        echo_tokens_least,
        // Anthropic always reports usage; nothing is asked on the client's behalf.
        client_wants_usage: true,
        prompt_tokens_estimate: estimate.total,
        prompt_tokens_added: estimate.added,
        cacheable_prompt_tokens: estimate.cacheable,
        prompt_chars_appended: Vec::new(),
        repeated_fields: Vec::new(),
    })
}

/// The index of the last user turn, if any, checked to take a block.
fn last_user_turn(object: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    let messages = object
        .get("messages")
        .and_then(Value::as_array)
        .filter(|messages| !messages.is_empty())
        .ok_or_else(|| invalid("messages", "messages: at least one message is required"))?;
    let last = messages
        .iter()
        .rposition(|message| message.get("role").and_then(Value::as_str) == Some("user"));
    if let Some(index) = last
        && !matches!(
            messages[index].get("content"),
            Some(Value::String(_) | Value::Array(_))
        )
    {
        return Err(invalid(
            "messages",
            format!("messages.{index}.content: must be a string or an array of content blocks"),
        ));
    }
    Ok(last)
}

/// Whether the conversation ends with an assistant turn: Anthropic's
/// prefill, which the model continues, so its reply cannot open with an echo.
fn ends_with_assistant_turn(object: &Map<String, Value>) -> bool {
    object
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|messages| messages.last())
        .and_then(|last| last.get("role"))
        .and_then(Value::as_str)
        == Some("assistant")
}

/// Whether an assistant turn of the conversation holds a `thinking` block:
/// signed reasoning sent back as it was delivered, with any of canarygate's
/// canaries it quoted ([`super::deliver`]).
pub fn replays_thinking(body: &Value) -> bool {
    let messages = body.get("messages").and_then(Value::as_array);
    messages.into_iter().flatten().any(|message| {
        message.get("role").and_then(Value::as_str) == Some("assistant")
            && message
                .get("content")
                .and_then(Value::as_array)
                .is_some_and(|blocks| {
                    blocks
                        .iter()
                        .any(|block| block.get("type").and_then(Value::as_str) == Some("thinking"))
                })
    })
}

/// Whether the request asks for structured JSON output (`output_config.
/// format`, or the beta's `output_format`): an echo would break it.
fn json_mode(object: &Map<String, Value>) -> bool {
    let format = object
        .get("output_config")
        .and_then(|config| config.get("format"))
        .or_else(|| object.get("output_format"));
    format.is_some_and(Value::is_object)
}

#[cfg(test)]
mod tests {
    use super::*;
    use canarygate_policies::inject::PassiveReason;

    /// What an echo is costed at in these tests: a token per digit.
    const COST: EchoCost = EchoCost::DIGIT_BY_DIGIT;

    fn param(body: Value) -> Option<&'static str> {
        parse(body.to_string().as_bytes()).unwrap_err().param
    }

    fn minimal() -> Value {
        json!({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]})
    }

    #[test]
    fn bad_shapes_are_400s_naming_the_field() {
        assert_eq!(
            parse(b"{nope").unwrap_err().code,
            ErrorCode::InvalidJson,
            "not JSON"
        );
        let with = |key: &str, value: Value| {
            let mut body = minimal();
            body[key] = value;
            body
        };
        let mut no_max = minimal();
        no_max.as_object_mut().unwrap().remove("max_tokens");
        assert_eq!(param(no_max), Some("max_tokens"));
        assert_eq!(param(with("max_tokens", json!(-1))), Some("max_tokens"));
        assert_eq!(param(with("model", json!(""))), Some("model"));
        assert_eq!(param(with("messages", json!([]))), Some("messages"));
        assert_eq!(
            param(with("messages", json!([{"role": "user", "content": 3}]))),
            Some("messages")
        );
        assert_eq!(
            param(with(
                "messages",
                json!([{"role": "user", "content": [{"text": "x"}]}])
            )),
            Some("messages")
        );
        assert_eq!(param(with("system", json!(5))), Some("system"));
        assert_eq!(
            param(with("system", json!([{"type": "image"}]))),
            Some("system")
        );
        assert_eq!(param(with("stream", json!("yes"))), Some("stream"));
        assert_eq!(param(with("tools", json!({}))), Some("tools"));
        assert_eq!(
            param(with(
                "thinking",
                json!({"type": "enabled", "budget_tokens": -1})
            )),
            Some("thinking")
        );
        // A budget at or over the limit is the provider's to judge
        // (interleaved thinking allows it).
        assert!(
            parse(
                with("thinking", json!({"type": "enabled", "budget_tokens": 64}))
                    .to_string()
                    .as_bytes()
            )
            .is_ok()
        );
        let request = parse(minimal().to_string().as_bytes()).unwrap();
        assert_eq!(request.max_tokens, Some(64));
        assert!(!request.stream);
    }

    #[test]
    fn blocks_go_after_the_clients_text_and_the_limit_is_raised() {
        let canaries = RequestCanaries::mint();
        let cached =
            json!({"type": "text", "text": "long policy", "cache_control": {"type": "ephemeral"}});
        let mut body = json!({
            "model": "m", "max_tokens": 100,
            "thinking": {"type": "enabled", "budget_tokens": 99},
            "system": [cached],
            "messages": [
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "42"}]},
            ],
        });
        let injection = place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        assert_eq!(injection.echo.len(), 2);
        assert_eq!(injection.client_max_tokens, Some(100));
        assert_eq!(body["max_tokens"], 100 + COST.allowance(2));
        assert!(body["thinking"]["budget_tokens"].as_u64().unwrap() < 100 + COST.allowance(2));
        // A budget at the client's limit keeps the limit as it came.
        let mut over = json!({"model": "m", "max_tokens": 100,
            "thinking": {"type": "enabled", "budget_tokens": 100},
            "messages": [{"role": "user", "content": "hi"}]});
        let injection =
            place(&mut over, EchoMode::HeadTail, COST, RequestCanaries::mint()).unwrap();
        assert_eq!(
            (over["max_tokens"].as_u64(), injection.echo_allowance),
            (Some(100), 0)
        );
        // Earlier turns: the system prompt and the history are the client's,
        // byte for byte. The tool result stays first in its turn; the head,
        // then the tail, follow it.
        assert_eq!(body["system"], json!([cached]));
        let turn = &body["messages"][2]["content"];
        assert_eq!(turn[0]["type"], "tool_result");
        let blocks = turn[1]["text"].as_str().unwrap();
        let (head, tail) = (canaries.head.to_string(), canaries.tail.to_string());
        assert!(
            blocks.find(&head).unwrap() < blocks.find(&tail).unwrap(),
            "{blocks}"
        );
        assert_eq!(body["messages"][0]["content"], "first");
        assert!(injection.prompt_tokens_added > 0);
        assert!(injection.cacheable_prompt_tokens < injection.prompt_tokens_estimate);

        // One turn: the head follows the client's cached system block.
        let mut body = json!({
            "model": "m", "max_tokens": 100, "system": [cached],
            "messages": [{"role": "user", "content": "first"}],
        });
        place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        assert_eq!(body["system"][0], cached);
        let system = body["system"][1]["text"].as_str().unwrap();
        assert!(
            system.contains(&head) && !system.contains(&tail),
            "{system}"
        );
        let turn = body["messages"][0]["content"].as_str().unwrap();
        assert!(turn.contains(&tail) && !turn.contains(&head), "{turn}");

        // One turn that marks its own block: the head follows it there.
        let mut body = json!({
            "model": "m", "max_tokens": 100, "system": "Be brief.",
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "long document", "cache_control": {"type": "ephemeral"}}]}],
        });
        place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        assert_eq!(body["system"], "Be brief.");
        let blocks = body["messages"][0]["content"][1]["text"].as_str().unwrap();
        assert!(
            blocks.find(&head).unwrap() < blocks.find(&tail).unwrap(),
            "{blocks}"
        );

        // A conversation without `system` gets none.
        let mut body = json!({
            "model": "m", "max_tokens": 100,
            "messages": [{"role": "user", "content": "first"},
                         {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "second"}],
        });
        place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        assert!(body.get("system").is_none(), "{body}");
        assert!(
            body["messages"][2]["content"]
                .as_str()
                .unwrap()
                .contains(&head)
        );
    }

    #[test]
    fn a_request_without_system_gets_the_head_as_its_system() {
        let canaries = RequestCanaries::mint();
        let mut body = minimal();
        place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        let system = body["system"].as_str().unwrap();
        assert!(system.contains(&canaries.head.to_string()), "{system}");
        let user = body["messages"][0]["content"].as_str().unwrap();
        assert!(user.starts_with("hi\n\n") && user.contains(&canaries.tail.to_string()));

        // A string system keeps its text first.
        let mut body = minimal();
        body["system"] = json!("Be brief.");
        place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        assert!(
            body["system"]
                .as_str()
                .unwrap()
                .starts_with("Be brief.\n\n")
        );

        // Only an assistant prefill: both blocks go with the system prompt.
        let mut body = minimal();
        body["messages"] = json!([{"role": "assistant", "content": "Sure"}]);
        place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        let system = body["system"].as_str().unwrap();
        assert!(system.contains(&canaries.tail.to_string()), "{system}");
        assert_eq!(body["messages"][0]["content"], "Sure");
    }

    #[test]
    fn tools_structured_output_prefill_and_stop_sequences_are_passive_and_keep_the_limit() {
        let canaries = RequestCanaries::mint();
        let prefilled = json!([
            {"role": "user", "content": "Answer in JSON."},
            {"role": "assistant", "content": "{"},
        ]);
        for (key, value, reason) in [
            (
                "tools",
                json!([{"name": "f", "input_schema": {"type": "object"}}]),
                PassiveReason::Tools,
            ),
            (
                "output_config",
                json!({"format": {"type": "json_schema", "schema": {}}}),
                PassiveReason::JsonMode,
            ),
            ("messages", prefilled, PassiveReason::Prefill),
            (
                "stop_sequences",
                json!(["</answer>", "\n"]),
                PassiveReason::StopSequence,
            ),
        ] {
            let mut body = minimal();
            body[key] = value;
            let injection = place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
            assert!(injection.echo.is_empty(), "{key}");
            assert_eq!(injection.passive, Some(reason), "{key}");
            assert_eq!(body["max_tokens"], 64, "{key}");
        }
        // A stop sequence that cannot occur in an echo leaves it asked.
        let mut body = minimal();
        body["stop_sequences"] = json!(["</answer>"]);
        let injection = place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        assert_eq!(injection.passive, None);
    }

    #[test]
    fn a_limit_of_zero_goes_as_it_came() {
        let mut body = minimal();
        body["max_tokens"] = json!(0);
        let injection =
            place(&mut body, EchoMode::HeadTail, COST, RequestCanaries::mint()).unwrap();
        assert_eq!(body["max_tokens"], 0);
        assert_eq!(injection.echo_allowance, 0);
    }

    #[test]
    fn the_prompt_reads_as_chat_messages() {
        let body = json!({"system": [{"type": "text", "text": "S"}], "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "input": {"q": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "content": [{"type": "text", "text": "r"}]}]},
        ]});
        assert_eq!(
            chat_messages(&body),
            vec![
                json!({"role": "system", "content": "S"}),
                json!({"role": "user", "content": "a"}),
                json!({"role": "assistant", "content": "{\"q\":1}"}),
                json!({"role": "user", "content": "r"}),
            ]
        );
    }
}
