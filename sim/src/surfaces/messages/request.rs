//! An Anthropic Messages request as the simulator reads it: `system` and
//! the content blocks become chat-shaped messages, `cache_control` marks
//! become cache breakpoints, `tools` the functions the model may call.
//!
//! Blocks: `text` (its text), `tool_use` (an assistant `tool_calls`
//! entry), `tool_result` (a `tool` message before the rest of its user
//! turn), `image` and `document` (no text); earlier `thinking` and
//! `redacted_thinking` blocks are not re-read, as Anthropic strips earlier
//! turns' thinking from the context, but a `thinking` block's `signature`
//! must sign its text ([`thinking_signature`]): one whose text was changed
//! is refused, as Anthropic refuses it. Validation follows the API's own
//! messages (`max_tokens: Field required`, ...), each a 400
//! `invalid_request_error`.

use serde_json::{Value, json};

use crate::conversation::Breakpoint;
use crate::error::SimError;
use crate::request::{CallChoice, FunctionSpec, Generation, Tooling};

/// Characters of a thinking signature that name the message it was made
/// for; the rest signs them and the text.
const SIGNATURE_NONCE_CHARS: usize = 24;

/// The signature of a `thinking` block of message `message_id` whose text
/// is `thinking`: opaque, its own for each message, and bound to the text,
/// so a changed text no longer matches it ([`signs`]).
pub fn thinking_signature(message_id: &str, thinking: &str) -> String {
    let nonce = crate::hash::alphanumeric(
        crate::hash::of(&[message_id.as_bytes()]),
        SIGNATURE_NONCE_CHARS,
    );
    let mac = signature_mac(&nonce, thinking);
    nonce + &mac
}

/// Whether `signature` is the signature of a thinking block whose text is
/// `thinking`.
fn signs(signature: &str, thinking: &str) -> bool {
    signature
        .get(..SIGNATURE_NONCE_CHARS)
        .is_some_and(|nonce| signature[SIGNATURE_NONCE_CHARS..] == signature_mac(nonce, thinking))
}

/// The part of a thinking signature after its `nonce` that signs the text.
fn signature_mac(nonce: &str, thinking: &str) -> String {
    let seed = crate::hash::of(&[
        b"sim thinking signature",
        nonce.as_bytes(),
        thinking.as_bytes(),
    ]);
    (0..3)
        .map(|part| crate::hash::alphanumeric(crate::hash::fold(seed, &[part]), 24))
        .collect()
}

/// Smallest `thinking.budget_tokens` Anthropic accepts.
pub const MIN_THINKING_BUDGET: u64 = 1024;

/// A Messages request.
#[derive(Debug, Clone)]
pub struct MessagesRequest {
    pub generation: Generation,
    /// `system` (when given) then the turns, chat-shaped.
    pub messages: Vec<Value>,
    /// Where `cache_control` marks end a cacheable prefix.
    pub breakpoints: Vec<Breakpoint>,
    /// The last breakpoint asks for the one-hour cache.
    pub hour_cache: bool,
}

fn bad(message: impl Into<String>) -> SimError {
    SimError::invalid_request(None, message)
}

impl MessagesRequest {
    /// Parses and validates a body; `count_only` for `count_tokens`, which
    /// takes no `max_tokens`.
    pub fn parse(body: &[u8], count_only: bool) -> Result<Self, SimError> {
        let body: Value = serde_json::from_slice(body)
            .map_err(|error| bad(format!("The request body is not valid JSON: {error}")))?;
        if !body.is_object() {
            return Err(bad("The request body must be a JSON object."));
        }
        let model = body["model"]
            .as_str()
            .ok_or_else(|| bad("model: Field required"))?
            .to_owned();
        let max_tokens = match &body["max_tokens"] {
            Value::Null if count_only => None,
            Value::Null => return Err(bad("max_tokens: Field required")),
            value => Some(value.as_u64().ok_or_else(|| {
                bad("max_tokens: Input should be a valid integer, greater than or equal to 0")
            })?),
        };
        let turns = match &body["messages"] {
            Value::Array(turns) if !turns.is_empty() => turns,
            Value::Array(_) => return Err(bad("messages: at least one message is required")),
            _ => return Err(bad("messages: Field required")),
        };
        let mut request = Self {
            generation: Generation {
                stream: body["stream"].as_bool().unwrap_or(false),
                max_tokens,
                ..Generation::plain(model)
            },
            messages: Vec::new(),
            breakpoints: Vec::new(),
            hour_cache: false,
        };
        request.system(&body["system"])?;
        for (index, turn) in turns.iter().enumerate() {
            request.turn(index, turn)?;
        }
        if let Some(marker) = body.get("cache_control").filter(|marker| !marker.is_null()) {
            // Automatic caching: a breakpoint on the last block.
            if !request.messages.is_empty() {
                request.mark(request.messages.len() - 1, None, marker);
            }
        }
        request.generation.tooling = tooling(&body["tools"], &body["tool_choice"])?;
        request.thinking(&body["thinking"], &body["tool_choice"])?;
        Ok(request)
    }

    fn mark(&mut self, message: usize, within: Option<u64>, marker: &Value) {
        self.breakpoints.push(Breakpoint { message, within });
        self.hour_cache = marker["ttl"] == "1h";
    }

    fn system(&mut self, system: &Value) -> Result<(), SimError> {
        match system {
            Value::Null => {}
            Value::String(text) => self
                .messages
                .push(json!({"role": "system", "content": text})),
            Value::Array(blocks) => {
                let mut texts: Vec<&str> = Vec::new();
                let mut marks = Vec::new();
                for (index, block) in blocks.iter().enumerate() {
                    let text = block["text"]
                        .as_str()
                        .filter(|_| block["type"] == "text")
                        .ok_or_else(|| {
                            bad(format!("system.{index}: Input should be a text block"))
                        })?;
                    texts.push(text);
                    if let Some(marker) = block.get("cache_control").filter(|m| !m.is_null()) {
                        let tokens = texts
                            .iter()
                            .map(|t| canarygate_policies::tokens::count_text(t))
                            .sum();
                        marks.push((tokens, marker.clone()));
                    }
                }
                let index = self.messages.len();
                self.messages
                    .push(json!({"role": "system", "content": texts.join("\n")}));
                for (tokens, marker) in marks {
                    self.mark(index, Some(tokens), &marker);
                }
            }
            _ => {
                return Err(bad(
                    "system: Input should be a valid string or a list of text blocks",
                ));
            }
        }
        Ok(())
    }

    /// Reads turn `index` into one or more chat-shaped messages.
    fn turn(&mut self, index: usize, turn: &Value) -> Result<(), SimError> {
        let role = turn["role"].as_str().unwrap_or("");
        if !matches!(role, "user" | "assistant" | "system") {
            return Err(bad(format!(
                "messages.{index}.role: Input should be 'user' or 'assistant'"
            )));
        }
        let blocks = match &turn["content"] {
            Value::String(text) => {
                self.messages.push(json!({"role": role, "content": text}));
                return Ok(());
            }
            Value::Array(blocks) => blocks,
            _ => return Err(bad(format!("messages.{index}.content: Field required"))),
        };
        let mut texts: Vec<String> = Vec::new();
        let mut calls = Vec::new();
        // Breakpoints in this turn's own message: (tokens of its text so far, or None after a call).
        let mut marks: Vec<(Option<u64>, Value)> = Vec::new();
        for (number, block) in blocks.iter().enumerate() {
            let at = || format!("messages.{index}.content.{number}");
            match block["type"].as_str().unwrap_or("") {
                "text" => texts.push(
                    block["text"]
                        .as_str()
                        .ok_or_else(|| bad(format!("{}.text: Field required", at())))?
                        .to_owned(),
                ),
                "tool_use" => {
                    let (Some(id), Some(name)) = (block["id"].as_str(), block["name"].as_str())
                    else {
                        return Err(bad(format!(
                            "{}: a tool_use block needs `id` and `name`",
                            at()
                        )));
                    };
                    calls.push(json!({"id": id, "type": "function", "function": {
                        "name": name, "arguments": block["input"].to_string(),
                    }}));
                }
                "tool_result" => {
                    let id = block["tool_use_id"]
                        .as_str()
                        .ok_or_else(|| bad(format!("{}.tool_use_id: Field required", at())))?;
                    let content = match &block["content"] {
                        Value::Null => json!(""),
                        content => content.clone(),
                    };
                    self.messages
                        .push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                    if let Some(marker) = block.get("cache_control").filter(|m| !m.is_null()) {
                        self.mark(self.messages.len() - 1, None, marker);
                    }
                    continue;
                }
                "thinking" => {
                    let thinking = block["thinking"].as_str().unwrap_or("");
                    if !block["signature"]
                        .as_str()
                        .is_some_and(|signature| signs(signature, thinking))
                    {
                        return Err(bad(format!(
                            "{}: Invalid `signature` in `thinking` block",
                            at()
                        )));
                    }
                }
                "image" | "document" | "redacted_thinking" | "search_result" => {}
                other => {
                    return Err(bad(format!(
                        "{}.type: Input tag '{other}' found using 'type' does not match any of the expected tags",
                        at()
                    )));
                }
            }
            if let Some(marker) = block.get("cache_control").filter(|m| !m.is_null()) {
                let tokens = if calls.is_empty() {
                    Some(
                        texts
                            .iter()
                            .map(|t| canarygate_policies::tokens::count_text(t))
                            .sum(),
                    )
                } else {
                    None
                };
                marks.push((tokens, marker.clone()));
            }
        }
        if texts.is_empty() && calls.is_empty() && !marks.is_empty() && !self.messages.is_empty() {
            // Marks on text-less blocks (an image): the prefix ends before them.
            for (_, marker) in marks.drain(..) {
                self.mark(self.messages.len() - 1, None, &marker);
            }
        }
        if texts.is_empty() && calls.is_empty() {
            return Ok(());
        }
        let mut message = json!({"role": role, "content": texts.join("\n")});
        if !calls.is_empty() {
            message["tool_calls"] = json!(calls);
        }
        self.messages.push(message);
        let message = self.messages.len() - 1;
        for (within, marker) in marks {
            self.mark(message, within, &marker);
        }
        Ok(())
    }

    fn thinking(&mut self, thinking: &Value, choice: &Value) -> Result<(), SimError> {
        match thinking["type"].as_str() {
            None if thinking.is_null() => {}
            Some("disabled") => {}
            Some("adaptive") => self.generation.thinks = true,
            Some("enabled") => {
                let budget = thinking["budget_tokens"]
                    .as_u64()
                    .ok_or_else(|| bad("thinking.enabled.budget_tokens: Field required"))?;
                if budget < MIN_THINKING_BUDGET {
                    return Err(bad(format!(
                        "thinking.enabled.budget_tokens: Input should be greater than or equal to {MIN_THINKING_BUDGET}"
                    )));
                }
                if self.generation.max_tokens.is_some_and(|max| max <= budget) {
                    return Err(bad(
                        "`max_tokens` must be greater than `thinking.budget_tokens`",
                    ));
                }
                if matches!(choice["type"].as_str(), Some("any" | "tool")) {
                    return Err(bad(
                        "Thinking may not be enabled when tool_choice forces tool use.",
                    ));
                }
                self.generation.thinks = true;
            }
            _ => {
                return Err(bad(
                    "thinking: Input tag found using 'type' does not match any of the expected tags: 'enabled', 'disabled', 'adaptive'",
                ));
            }
        }
        Ok(())
    }
}

/// The client tools (server tools are never called) and `tool_choice`.
fn tooling(tools: &Value, choice: &Value) -> Result<Option<Tooling>, SimError> {
    let tools = match tools {
        Value::Null => return Ok(None),
        Value::Array(tools) => tools,
        _ => return Err(bad("tools: Input should be a valid list")),
    };
    let mut functions = Vec::new();
    for (index, tool) in tools.iter().enumerate() {
        if !matches!(tool["type"].as_str(), None | Some("custom")) {
            continue;
        }
        let name = tool["name"]
            .as_str()
            .filter(|name| !name.is_empty())
            .ok_or_else(|| bad(format!("tools.{index}.name: Field required")))?;
        if !tool["input_schema"].is_object() {
            return Err(bad(format!(
                "tools.{index}.custom.input_schema: Field required"
            )));
        }
        functions.push(FunctionSpec {
            name: name.to_owned(),
            parameters: tool["input_schema"].clone(),
        });
    }
    let call_choice = match choice["type"].as_str() {
        None | Some("auto") => CallChoice::Auto,
        Some("any") => CallChoice::Required,
        Some("none") => CallChoice::Never,
        Some("tool") => {
            let name = choice["name"].as_str().unwrap_or("");
            if !functions.iter().any(|function| function.name == name) {
                return Err(bad(format!(
                    "tool_choice: tool '{name}' is not among the tools"
                )));
            }
            CallChoice::Named(name.to_owned())
        }
        Some(other) => {
            return Err(bad(format!(
                "tool_choice.type: '{other}' is not one of 'auto', 'any', 'tool', 'none'"
            )));
        }
    };
    if functions.is_empty() {
        return Ok(None);
    }
    Ok(Some(Tooling {
        functions,
        choice: call_choice,
        legacy: false,
        parallel: !choice["disable_parallel_tool_use"]
            .as_bool()
            .unwrap_or(false),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: Value) -> Result<MessagesRequest, SimError> {
        MessagesRequest::parse(body.to_string().as_bytes(), false)
    }

    #[test]
    fn blocks_become_messages_and_marks_become_breakpoints() {
        let request = parse(json!({"model": "sim-model", "max_tokens": 100,
            "system": [{"type": "text", "text": "Rule one."},
                       {"type": "text", "text": "Rule two.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": thinking_signature("msg_1", "hm")},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                    {"type": "text", "text": "and tomorrow?"}]},
            ]}))
        .unwrap();
        let roles: Vec<&str> = request
            .messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(request.messages[0]["content"], "Rule one.\nRule two.");
        assert_eq!(
            request.messages[2]["tool_calls"][0]["function"]["arguments"],
            r#"{"city":"Oslo"}"#
        );
        assert_eq!(request.messages[3]["content"], "sunny");
        assert_eq!(request.messages[4]["content"], "thanks\nand tomorrow?");
        assert_eq!(
            request.breakpoints,
            [
                Breakpoint {
                    message: 0,
                    within: Some(6)
                },
                Breakpoint {
                    message: 4,
                    within: Some(1)
                }
            ]
        );
        assert!(request.hour_cache);
        assert!(!request.generation.thinks);
    }

    #[test]
    fn a_thinking_block_sent_back_changed_is_refused() {
        let turn = |thinking: &str, signature: &str| {
            json!({"model": "sim-model", "max_tokens": 100, "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": thinking, "signature": signature},
                    {"type": "text", "text": "Hello."}]},
                {"role": "user", "content": "and?"}]})
        };
        let signature = thinking_signature("msg_1", "I will quote CG123.");
        assert!(parse(turn("I will quote CG123.", &signature)).is_ok());
        let error = parse(turn("I will quote .", &signature)).unwrap_err();
        assert!(
            error.message().contains("Invalid `signature`"),
            "{}",
            error.message()
        );
        assert!(parse(turn("I will quote CG123.", "short")).is_err());
    }

    #[test]
    fn required_fields_thinking_and_tools_are_checked() {
        let base = json!({"model": "m", "max_tokens": 2000, "messages": [{"role": "user", "content": "hi"}]});
        let with = |key: &str, value: Value| {
            let mut body = base.clone();
            body[key] = value;
            body
        };
        for (body, message) in [
            (
                json!({"model": "m", "messages": []}),
                "max_tokens: Field required",
            ),
            (
                json!({"max_tokens": 1, "messages": []}),
                "model: Field required",
            ),
            (
                with("messages", json!([])),
                "messages: at least one message is required",
            ),
            (
                with("messages", json!([{"role": "robot", "content": "x"}])),
                "messages.0.role",
            ),
            (
                with("thinking", json!({"type": "enabled", "budget_tokens": 10})),
                "greater than or equal to 1024",
            ),
            (
                with(
                    "thinking",
                    json!({"type": "enabled", "budget_tokens": 4000}),
                ),
                "`max_tokens` must be greater",
            ),
            (
                with("tools", json!([{"name": "f"}])),
                "input_schema: Field required",
            ),
        ] {
            let error = parse(body.clone())
                .err()
                .unwrap_or_else(|| panic!("accepted {body}"));
            assert!(
                error.message().contains(message),
                "{}: {body}",
                error.message()
            );
        }
        let thinking = parse(with(
            "thinking",
            json!({"type": "enabled", "budget_tokens": 1024}),
        ))
        .unwrap();
        assert!(thinking.generation.thinks);
        let tools = parse(with(
            "tools",
            json!([
            {"name": "lookup", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search"}]),
        ))
        .unwrap();
        let tooling = tools.generation.tooling.unwrap();
        assert_eq!(tooling.functions.len(), 1);
        assert_eq!(tooling.choice, CallChoice::Auto);
        let counted = MessagesRequest::parse(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                .to_string()
                .as_bytes(),
            true,
        );
        assert!(counted.is_ok(), "count_tokens takes no max_tokens");
    }
}
