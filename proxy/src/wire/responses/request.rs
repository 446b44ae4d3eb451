//! A Responses API request: validated as far as canarygate relies on it,
//! read as chat messages (token counts, the local engine), and given its
//! canaries.
//!
//! The model reads `instructions` first, then the conversation a
//! `previous_response_id` (or `conversation`) continues, then `input`. The
//! head block goes at the end of `instructions` (set when absent: a kept
//! conversation does not carry earlier instructions over); the tail block
//! at the end of the last user item's text. When the client's stable prefix
//! runs past `instructions` (the request continues a kept conversation, or
//! its `input` holds earlier turns before its last user message) the head
//! goes there too, before the tail, so those turns stay a cacheable prefix;
//! when `input` ends with a tool call's output and the blocks are passive
//! markers (no echo is asked: tools offered, JSON output...), both go at
//! the end of that output
//! ([`tool_loop_end`]), so the loop's calls and earlier outputs stay
//! cacheable too. A kept request's blocks come back in the history of the
//! requests that continue it: the echo of those asks for their own head
//! alone, the newest turn's instruction.
//!
//! Longer than 500 lines: about 160 of them are the unit tests, which hold
//! each placement and each refused shape to a request.

use canarygate_policies::EchoCost;
use canarygate_policies::inject::{
    Blocks, EchoObstacles, Injection, PromptEstimate, RequestCanaries, append_to_content,
    passive_reason,
};
use canarygate_policies::tokens::count_chat_messages;
use canarygate_policies::verify_config::EchoMode;
use serde_json::{Map, Value, json};

use crate::error::{ApiError, ErrorCode};
use crate::wire::chat::{json_object, model_of, stream_of};
use crate::wire::format::ClientRequest;

/// The least `max_output_tokens` OpenAI's Responses API accepts (it answers
/// less with 400 `integer_below_min_value`).
const MIN_OUTPUT_TOKENS: u64 = 16;

/// Parses and validates a Responses API request.
pub fn parse(bytes: &[u8]) -> Result<ClientRequest, ApiError> {
    let body = json_object(bytes)?;
    let object = body.as_object().expect("json_object returns an object");
    let model = model_of(object)?;
    check_input(object.get("input"))?;
    match object.get("instructions") {
        None | Some(Value::Null | Value::String(_)) => {}
        Some(_) => {
            return Err(ApiError::invalid_param(
                "instructions",
                "`instructions` must be a string.",
            ));
        }
    }
    let stream = stream_of(object)?;
    let max_tokens = match object.get("max_output_tokens") {
        None | Some(Value::Null) => None,
        Some(value) => Some(value.as_u64().ok_or_else(|| {
            ApiError::invalid_param(
                "max_output_tokens",
                "`max_output_tokens` must be a non-negative integer.",
            )
        })?),
    };
    for (field, what) in [("tools", "an array"), ("text", "an object")] {
        let fits = match object.get(field) {
            None | Some(Value::Null) => true,
            Some(Value::Array(_)) => field == "tools",
            Some(Value::Object(_)) => field == "text",
            Some(_) => false,
        };
        if !fits {
            return Err(ApiError::invalid_param(
                if field == "tools" { "tools" } else { "text" },
                format!("`{field}` must be {what}."),
            ));
        }
    }
    Ok(ClientRequest {
        body,
        model,
        stream,
        max_tokens,
    })
}

/// `input`: absent, a string, or an array of item objects whose messages
/// have a string role and string or array content.
fn check_input(input: Option<&Value>) -> Result<(), ApiError> {
    let items = match input {
        None | Some(Value::Null | Value::String(_)) => return Ok(()),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "input",
                "`input` must be a string or an array of input items.",
            ));
        }
    };
    for (index, item) in items.iter().enumerate() {
        let Some(item) = item.as_object() else {
            return Err(ApiError::invalid_param(
                "input",
                format!("input[{index}] must be an object."),
            ));
        };
        if !is_message(item) {
            if item.get("type").and_then(Value::as_str).is_none() {
                return Err(ApiError::invalid_param(
                    "input",
                    format!("input[{index}] must have a string `type` or `role`."),
                ));
            }
            continue;
        }
        if item.get("role").and_then(Value::as_str).is_none() {
            return Err(ApiError::invalid_param(
                "input",
                format!("input[{index}] is a message: it must have a string `role`."),
            ));
        }
        match item.get("content") {
            Some(Value::String(_)) => {}
            Some(Value::Array(parts)) if parts.iter().all(Value::is_object) => {}
            _ => {
                return Err(ApiError::invalid_param(
                    "input",
                    format!(
                        "input[{index}].content must be a string or an array of content parts."
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Whether an input item is a message (`type: "message"`, or no type and a
/// role: the easy form).
fn is_message(item: &Map<String, Value>) -> bool {
    match item.get("type").and_then(Value::as_str) {
        Some(kind) => kind == "message",
        None => item.contains_key("role"),
    }
}

/// Whether the provider adds a conversation it keeps to this request's
/// context (`previous_response_id` or `conversation`): earlier turns'
/// canaries come back with it.
pub fn continues_stored_conversation(body: &Value) -> bool {
    ["previous_response_id", "conversation"]
        .iter()
        .any(|field| body.get(*field).is_some_and(|value| !value.is_null()))
}

/// The text of an item's `content` (a string, or the `text`/`refusal` of
/// its parts), for token counts and the local engine.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| {
                part.get("text")
                    .or_else(|| part.get("refusal"))
                    .and_then(Value::as_str)
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// Chat role of a Responses message role.
fn chat_role(role: &str) -> &str {
    match role {
        "developer" => "system",
        role => role,
    }
}

/// The prompt as chat messages `{role, content}`: instructions as the
/// system message, then each input item (function calls as the
/// assistant's, their outputs and other items' text as the user's).
pub fn chat_messages(body: &Value) -> Vec<Value> {
    let mut messages = Vec::new();
    if let Some(instructions) = body.get("instructions").and_then(Value::as_str) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match body.get("input") {
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for item in items {
                if let Some(message) = item_message(item) {
                    messages.push(message);
                }
            }
        }
        _ => {}
    }
    messages
}

/// One input item as a chat message, if it holds text.
fn item_message(item: &Value) -> Option<Value> {
    let object = item.as_object()?;
    if is_message(object) {
        let role = object.get("role").and_then(Value::as_str).unwrap_or("user");
        let content = content_text(object.get("content").unwrap_or(&Value::Null));
        return Some(json!({"role": chat_role(role), "content": content}));
    }
    let text = |key: &str| object.get(key).and_then(Value::as_str).unwrap_or("");
    match object.get("type").and_then(Value::as_str)? {
        "function_call" => Some(json!({"role": "assistant",
            "content": format!("{}({})", text("name"), text("arguments"))})),
        kind if kind.ends_with("_call_output") => {
            let output = object.get("output").unwrap_or(&Value::Null);
            Some(json!({"role": "user", "content": content_text(output)}))
        }
        "reasoning" => {
            let summary = object.get("summary").map(content_text).unwrap_or_default();
            (!summary.is_empty()).then(|| json!({"role": "assistant", "content": summary}))
        }
        _ => None,
    }
}

/// Places `canaries` in `body` (already [`parse`]d) per `echo`; on error
/// the body is left as it was.
pub fn place(
    body: &mut Value,
    echo: EchoMode,
    cost: EchoCost,
    canaries: RequestCanaries,
) -> Result<Injection, ApiError> {
    if body
        .get("background")
        .is_some_and(|value| *value == json!(true))
    {
        return Err(ApiError::invalid_param(
            "background",
            "`background: true` answers later, through GET /v1/responses/{id}: it cannot be \
             verified as it is answered, so it is not served on the verified path.",
        ));
    }
    let before = count_chat_messages(&chat_messages(body));
    let json_mode = body
        .pointer("/text/format/type")
        .and_then(Value::as_str)
        .is_some_and(|kind| kind == "json_object" || kind == "json_schema");
    let has_tools = body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|tools| !tools.is_empty());
    // Earlier turns of a stored conversation hold their own tail blocks:
    // "the code in square brackets below" would name several. The head is
    // fresh in every request's instructions, so the echo asks for it alone
    // and the tail is a passive marker.
    let echo = match echo {
        EchoMode::HeadTail if continues_stored_conversation(body) => EchoMode::Head,
        echo => echo,
    };
    let obstacles = EchoObstacles {
        json_mode,
        tools: has_tools,
        ..EchoObstacles::default()
    };
    let passive = passive_reason(echo, obstacles);
    let blocks = Blocks::new(echo, passive, canaries);
    let tail_slot = passive
        .and_then(|_| tool_loop_end(body))
        .or_else(|| last_user_text(body));
    let head_joins_the_tail =
        matches!(tail_slot, Some(TailSlot::Output(_))) || history_before_last_user(body, tail_slot);
    let object = body.as_object_mut().ok_or_else(|| {
        ApiError::new(
            ErrorCode::InvalidJson,
            "The request body must be a JSON object.",
        )
    })?;
    if let Some(slot) = tail_slot {
        let placed = match slot {
            TailSlot::Input => object.get_mut("input"),
            TailSlot::Item(index) => object
                .get_mut("input")
                .and_then(|input| input.get_mut(index))
                .and_then(|item| item.get_mut("content")),
            TailSlot::Output(index) => object
                .get_mut("input")
                .and_then(|input| input.get_mut(index))
                .and_then(|item| item.get_mut("output")),
        }
        .is_some_and(|content| {
            if head_joins_the_tail && !append_to_content(content, &blocks.head, "input_text") {
                return false;
            }
            append_to_content(content, &blocks.tail, "input_text")
        });
        if !placed {
            return Err(ApiError::invalid_param(
                "input",
                "The last user message's content must be a string or an array of parts.",
            ));
        }
    }
    let mut repeated_fields = Vec::new();
    if !head_joins_the_tail {
        let client_instructions = object.get("instructions").cloned();
        repeated_fields.push((
            "instructions".to_owned(),
            client_instructions.unwrap_or(Value::Null),
        ));
        let instructions = object.entry("instructions").or_insert(Value::Null);
        append_to_content(instructions, &blocks.head, "input_text");
        if tail_slot.is_none() {
            append_to_content(instructions, &blocks.tail, "input_text");
        }
    }
    let client_max_tokens = object.get("max_output_tokens").and_then(Value::as_u64);
    let mut echo_allowance = 0;
    // A limit below the API's least goes as it came, for the provider to
    // refuse: raised, it would pass.
    if let Some(limit) = client_max_tokens
        && limit >= MIN_OUTPUT_TOKENS
        && !blocks.echo.is_empty()
    {
        echo_allowance = cost.allowance(blocks.echo.len());
        object["max_output_tokens"] = json!(limit.saturating_add(echo_allowance));
        repeated_fields.push(("max_output_tokens".to_owned(), json!(limit)));
    }
    let stream = object
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let estimate = PromptEstimate::of(before, &chat_messages(body), canaries.head);
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
        // Usage always comes with `response.completed`.
        client_wants_usage: true,
        prompt_tokens_estimate: estimate.total,
        prompt_tokens_added: estimate.added,
        cacheable_prompt_tokens: estimate.cacheable,
        prompt_chars_appended: Vec::new(),
        repeated_fields,
    })
}

/// Where the tail block goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TailSlot {
    /// `input` is a string.
    Input,
    /// The content of input item `index`, the last user message.
    Item(usize),
    /// The `output` of input item `index`, the tool output that ends a tool
    /// loop ([`tool_loop_end`]); the head goes there too.
    Output(usize),
}

/// The input item that ends a tool loop, when passive markers go there
/// (as in Chat: [`inject::tool_loop_end`]): the last item of an `input`
/// list is a function's or a custom tool's output (`function_call_output`,
/// `custom_tool_call_output`) whose `output` is a string or a list of input
/// content parts (`input_text`, `input_image`...). Other tools' outputs
/// have shapes of their own (a shell call's `stdout`/`stderr` entries, a
/// computer call's screenshot), where text would be refused. In a request
/// the provider keeps, the markers come back in the history of the
/// requests that continue it, where they ask nothing.
///
/// [`inject::tool_loop_end`]: canarygate_policies::inject::tool_loop_end
fn tool_loop_end(body: &Value) -> Option<TailSlot> {
    let Some(Value::Array(items)) = body.get("input") else {
        return None;
    };
    let last = items.last()?;
    let kind = last.get("type").and_then(Value::as_str);
    let takes_text = match last.get("output") {
        Some(Value::String(_)) => true,
        Some(Value::Array(parts)) => parts.iter().all(|part| {
            part.get("type")
                .and_then(Value::as_str)
                .is_some_and(|kind| kind.starts_with("input_"))
        }),
        _ => false,
    };
    (matches!(
        kind,
        Some("function_call_output" | "custom_tool_call_output")
    ) && takes_text)
        .then(|| TailSlot::Output(items.len() - 1))
}

/// Whether the head goes with the tail into the last user text of the
/// request (`slot`), as in Chat ([`prefix_spans_turns`]): the request
/// continues a conversation the provider keeps (its history comes between
/// `instructions` and `input`), or items other than user, system or
/// developer messages come before that text in `input` (earlier turns, a
/// tool loop's calls). Either way the client's stable prefix runs past
/// `instructions`. A kept request's blocks come back in the history of the
/// requests that continue it, each before the reply that obeyed it; a
/// model follows the newest turn's instruction, and the echo of a
/// continuing request asks for its head alone (see [`place`]).
///
/// [`prefix_spans_turns`]: canarygate_policies::inject::prefix_spans_turns
fn history_before_last_user(body: &Value, slot: Option<TailSlot>) -> bool {
    match (slot, body.get("input")) {
        (Some(TailSlot::Input | TailSlot::Item(_)), _) if continues_stored_conversation(body) => {
            true
        }
        (Some(TailSlot::Item(last)), Some(Value::Array(items))) => {
            items[..last].iter().any(|item| {
                let role = item.get("role").and_then(Value::as_str);
                !(item.as_object().is_some_and(is_message)
                    && matches!(role, Some("user" | "system" | "developer")))
            })
        }
        _ => false,
    }
}

/// The last user text of `input`, if any.
fn last_user_text(body: &Value) -> Option<TailSlot> {
    match body.get("input")? {
        Value::String(_) => Some(TailSlot::Input),
        Value::Array(items) => items
            .iter()
            .rposition(|item| {
                item.as_object().is_some_and(is_message)
                    && item.get("role").and_then(Value::as_str) == Some("user")
            })
            .map(TailSlot::Item),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use canarygate_policies::inject::client_text;

    /// What an echo is costed at in these tests: a token per digit.
    const COST: EchoCost = EchoCost::DIGIT_BY_DIGIT;

    fn parsed(body: Value) -> Value {
        parse(body.to_string().as_bytes()).unwrap().body
    }

    fn param(body: &str) -> Option<&'static str> {
        parse(body.as_bytes()).unwrap_err().param
    }

    #[test]
    fn rejects_bad_shapes_naming_the_param() {
        assert_eq!(
            parse(b"{nope").unwrap_err().code,
            ErrorCode::InvalidJson,
            "not JSON"
        );
        assert_eq!(param(r#"{"input":"hi"}"#), Some("model"));
        assert_eq!(param(r#"{"model":"m","input":5}"#), Some("input"));
        assert_eq!(param(r#"{"model":"m","input":[3]}"#), Some("input"));
        assert_eq!(
            param(r#"{"model":"m","input":[{"role":"user","content":7}]}"#),
            Some("input")
        );
        assert_eq!(
            param(r#"{"model":"m","input":"x","instructions":["a"]}"#),
            Some("instructions")
        );
        assert_eq!(
            param(r#"{"model":"m","input":"x","max_output_tokens":-2}"#),
            Some("max_output_tokens")
        );
        assert_eq!(
            param(r#"{"model":"m","input":"x","stream":"yes"}"#),
            Some("stream")
        );
        assert_eq!(
            param(r#"{"model":"m","input":"x","tools":{}}"#),
            Some("tools")
        );
        let request =
            parse(br#"{"model":"m","input":"x","max_output_tokens":9,"stream":true}"#).unwrap();
        assert_eq!((request.max_tokens, request.stream), (Some(9), true));
    }

    #[test]
    fn head_goes_after_the_instructions_or_with_the_tail_after_earlier_turns() {
        let canaries = RequestCanaries::mint();
        let mut body = parsed(json!({"model": "m", "instructions": "Be brief.",
        "max_output_tokens": 100, "store": false,
        "input": [
            {"role": "user", "content": "first"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "ok"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "second"}]},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ]}));
        let injection = place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        // Earlier turns: the instructions and the history are the client's;
        // a plain text part takes the head, then the tail, at the end of its
        // text.
        assert_eq!(body["instructions"], "Be brief.");
        assert_eq!(
            body["input"][0]["content"], "first",
            "earlier turns untouched"
        );
        let parts = body["input"][2]["content"].as_array().unwrap();
        assert_eq!(parts.len(), 1);
        assert_eq!(parts[0]["type"], "input_text");
        let text = parts[0]["text"].as_str().unwrap();
        let (head, tail) = (canaries.head.to_string(), canaries.tail.to_string());
        assert!(text.starts_with("second\n\n"), "{text}");
        assert!(
            text.find(&head).unwrap() < text.find(&tail).unwrap(),
            "{text}"
        );
        assert!(text.ends_with(&format!("\n\n[{tail}]")), "{text}");
        assert_eq!(client_text(text), "second");
        assert_eq!(injection.echo, vec![canaries.head, canaries.tail]);
        assert_eq!(injection.client_max_tokens, Some(100));
        assert_eq!(body["max_output_tokens"], 100 + COST.allowance(2));
        assert!(injection.prompt_tokens_added > 0);
        assert!(injection.cacheable_prompt_tokens < injection.prompt_tokens_estimate);

        // The same turns kept by the provider (`store` is true unless
        // false), or continuing a kept conversation: the history is the
        // stable prefix there too, and both blocks end the newest user text.
        let history = json!([{"role": "user", "content": "first"},
                             {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": "second"}]);
        for (extra, input, last) in [
            (json!({}), history.clone(), "/input/2/content"),
            (json!({"store": null}), history.clone(), "/input/2/content"),
            (
                json!({"store": "false"}),
                history.clone(),
                "/input/2/content",
            ),
            (
                json!({"previous_response_id": "resp_1"}),
                json!([{"role": "user", "content": "second"}]),
                "/input/0/content",
            ),
            (
                json!({"conversation": "conv_1", "store": false}),
                json!("second"),
                "/input",
            ),
        ] {
            let mut body = json!({"model": "m", "instructions": "Be brief.", "input": input});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let mut body = parsed(body);
            place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
            assert_eq!(body["instructions"], "Be brief.", "{extra}");
            let text = body.pointer(last).unwrap().as_str().unwrap();
            assert!(text.starts_with("second\n\n"), "{extra}: {text}");
            assert!(
                text.find(&head).unwrap() < text.find(&tail).unwrap(),
                "{extra}: {text}"
            );
        }
        // Nothing but instructions of the client's before its question, in
        // a request that continues nothing: the head follows `instructions`.
        let mut body = parsed(
            json!({"model": "m", "instructions": "Be brief.", "store": false,
            "input": [{"role": "developer", "content": "Rules."},
                      {"role": "system", "content": "More rules."},
                      {"role": "user", "content": "second"}]}),
        );
        place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        assert!(body["instructions"].as_str().unwrap().contains(&head));
        assert_eq!(body["input"][2]["content"], format!("second\n\n[{tail}]"));

        // One turn (and a system message in `input`): the head follows the
        // instructions.
        let mut body = parsed(json!({"model": "m", "instructions": "Be brief.",
            "input": [{"role": "developer", "content": "Rules."},
                      {"role": "user", "content": "first"}]}));
        place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        let instructions = body["instructions"].as_str().unwrap();
        assert!(instructions.starts_with("Be brief.\n\n"), "{instructions}");
        assert!(instructions.contains(&head) && !instructions.contains(&tail));
        assert_eq!(client_text(instructions), "Be brief.");
        assert_eq!(body["input"][1]["content"], format!("first\n\n[{tail}]"));
    }

    #[test]
    fn a_tool_loop_ends_its_newest_output_with_the_markers() {
        let canaries = RequestCanaries::mint();
        let (head, tail) = (canaries.head.to_string(), canaries.tail.to_string());
        let input = json!([
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "Warm"}]},
        ]);
        let tools = json!([{"type": "function", "name": "w", "parameters": {}}]);
        let mut body = parsed(json!({"model": "m", "instructions": "Use the tools.",
            "store": false, "tools": tools, "input": input}));
        let injection = place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        assert!(injection.passive.is_some());
        // The instructions and every item before the newest output are the
        // client's; the instructions are not repeated back, as unchanged.
        assert_eq!(body["instructions"], "Use the tools.");
        assert_eq!(
            body["input"].as_array().unwrap()[..4],
            input.as_array().unwrap()[..4]
        );
        assert!(injection.repeated_fields.is_empty());
        let parts = body["input"][4]["output"].as_array().unwrap();
        assert_eq!(parts.len(), 1);
        let text = parts[0]["text"].as_str().unwrap();
        assert_eq!(client_text(text), "Warm");
        assert!(
            text.find(&head).unwrap() < text.find(&tail).unwrap(),
            "{text}"
        );
        assert!(injection.cacheable_prompt_tokens + 40 > injection.prompt_tokens_estimate);

        // A string output, a custom tool's: the same.
        let mut body = parsed(json!({"model": "m", "store": false, "tools": tools,
            "input": [{"role": "user", "content": "Run it."},
                      {"type": "custom_tool_call", "call_id": "c1", "name": "sh", "input": "ls"},
                      {"type": "custom_tool_call_output", "call_id": "c1", "output": "a.txt"}]}));
        place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        let output = body["input"][2]["output"].as_str().unwrap();
        assert!(
            output.starts_with("a.txt\n\n") && output.contains(&head) && output.contains(&tail)
        );
        assert_eq!(body["input"][0]["content"], "Run it.");

        // Another tool's output, shaped its own way: placed as any turn.
        for output in [
            json!({"type": "shell_call_output", "call_id": "c1",
                   "output": [{"stdout": "a.txt", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}]}),
            json!({"type": "function_call_output", "call_id": "c1",
                   "output": [{"stdout": "a.txt"}]}),
        ] {
            let mut body = parsed(json!({"model": "m", "store": false, "tools": tools,
                "input": [{"role": "user", "content": "Run it."}, output.clone()]}));
            place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
            assert_eq!(body["input"][1], output);
        }

        // Kept, or continuing a kept conversation with the newest output
        // alone (the history comes back from the provider): the same. Asked
        // for an echo (no tools offered): the output stays the client's.
        for (extra, input, takes_markers) in [
            (json!({"tools": tools, "store": true}), input.clone(), true),
            (
                json!({"tools": tools, "previous_response_id": "resp_1"}),
                json!([input[4].clone()]),
                true,
            ),
            (json!({"store": false}), input.clone(), false),
        ] {
            let newest = input.as_array().unwrap().last().unwrap().clone();
            let mut body = json!({"model": "m", "instructions": "Use the tools.", "input": input});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let mut body = parsed(body);
            place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
            let output = body["input"].as_array().unwrap().last().unwrap()["output"].to_string();
            assert_eq!(output.contains(&head), takes_markers, "{extra}: {output}");
            assert_eq!(
                body["instructions"].as_str().unwrap().contains(&head),
                !takes_markers,
                "{extra}"
            );
            if !takes_markers {
                assert_eq!(body["input"][4], newest, "{extra}");
            }
        }
    }

    #[test]
    fn a_limit_below_the_apis_least_goes_as_it_came() {
        for (limit, sent) in [(5, 5), (15, 15), (16, 16 + COST.allowance(2))] {
            let mut body = parsed(json!({"model": "m", "input": "hi", "max_output_tokens": limit}));
            let injection =
                place(&mut body, EchoMode::HeadTail, COST, RequestCanaries::mint()).unwrap();
            assert_eq!(body["max_output_tokens"], sent, "{limit}");
            assert_eq!(injection.echo_allowance, sent - limit, "{limit}");
        }
    }

    #[test]
    fn a_string_input_gets_the_tail_and_no_user_item_puts_it_in_the_instructions() {
        let canaries = RequestCanaries::mint();
        let mut body = parsed(json!({"model": "m", "input": "hello"}));
        place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        let input = body["input"].as_str().unwrap();
        assert!(input.starts_with("hello\n\n") && input.contains(&canaries.tail.to_string()));
        let instructions = body["instructions"].as_str().unwrap();
        assert!(instructions.contains(&canaries.head.to_string()));
        assert!(!instructions.contains(&canaries.tail.to_string()));

        let mut body = parsed(json!({"model": "m", "input": [
            {"type": "function_call_output", "call_id": "c1", "output": "42"}]}));
        place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        let instructions = body["instructions"].as_str().unwrap();
        let (head, tail) = (canaries.head.to_string(), canaries.tail.to_string());
        assert!(instructions.find(&head).unwrap() < instructions.find(&tail).unwrap());
    }

    #[test]
    fn json_mode_and_tools_are_passive_and_a_stored_conversation_echoes_the_head() {
        let canaries = RequestCanaries::mint();
        for extra in [
            json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}),
            json!({"text": {"format": {"type": "json_object"}}}),
            json!({"tools": [{"type": "function", "name": "f", "parameters": {}}]}),
        ] {
            let mut body = json!({"model": "m", "input": "x", "max_output_tokens": 50});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let injection = place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
            assert!(injection.echo.is_empty() && injection.passive.is_some());
            assert_eq!(body["max_output_tokens"], 50, "no echo, no allowance");
        }
        let mut body = json!({"model": "m", "input": "x", "previous_response_id": "resp_1"});
        assert!(continues_stored_conversation(&body));
        let injection = place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        assert_eq!(injection.echo, vec![canaries.head]);
        let mut body = json!({"model": "m", "input": "x", "background": true});
        let error = place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap_err();
        assert_eq!(error.param, Some("background"));
    }
}
