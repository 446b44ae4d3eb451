//! The local engine serving a Messages request: the request as a Chat
//! Completions body, the engine's answer as a `message`, and its stream as
//! the Messages events the SDK's `messages.stream()` helper accumulates
//! (`message_start`, one text block's start, deltas and stop,
//! `message_delta` with the stop reason and usage, `message_stop`).
//!
//! Longer than 500 lines: about 175 of them are the unit tests, which turn
//! requests into the engine's (thinking, prefills, ranges) and its answers
//! and streams into messages.

use canarygate_policies::sse::{SseEvent, encode_json};
use serde_json::{Value, json};

use super::error::error_json;
use crate::error::{ApiError, ErrorCode};
use crate::wire::format::LocalStream;

/// The client's Messages request as a Chat Completions request for the
/// engine: the system prompt as a system message, every turn's text
/// (earlier turns' thinking skipped, as Anthropic leaves it out of the
/// context), the limit and sampling. A last assistant turn is a prefill,
/// which the answer continues (`continue_final_message`), as Claude does.
pub fn request(body: &Value) -> Result<Value, ApiError> {
    refuse_unsupported(body)?;
    let mut messages = local_messages(body);
    // An empty last assistant turn (Anthropic allows one; a turn of
    // thinking alone reads as one) asks for a reply from nothing: a new
    // turn, as without it.
    if messages
        .last()
        .is_some_and(|message| message["role"] == "assistant" && message["content"] == "")
    {
        messages.pop();
    }
    let prefill = messages
        .last()
        .is_some_and(|message| message["role"] == "assistant");
    let mut chat = json!({
        "model": body.get("model").cloned().unwrap_or(Value::Null),
        "messages": messages,
        "continue_final_message": prefill,
        "max_tokens": body.get("max_tokens").cloned().unwrap_or(Value::Null),
        "stream": body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        // The stream's `message_delta` reports the usage.
        "stream_options": {"include_usage": true},
    });
    for field in ["temperature", "top_p", "top_k"] {
        if let Some(value) = body.get(field).filter(|value| !value.is_null()) {
            chat[field] = value.clone();
        }
    }
    if let Some(stops) = body.get("stop_sequences").filter(|stops| !stops.is_null()) {
        chat["stop"] = stops.clone();
    }
    Ok(chat)
}

/// Content blocks the engine reads: text; earlier turns' thinking, which
/// Anthropic itself leaves out of the context, is skipped.
const READ_BLOCKS: [&str; 3] = ["text", "thinking", "redacted_thinking"];

/// The text of a content slot the engine reads: the string, or its text
/// blocks, one per line.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter(|block| block["type"] == "text")
            .filter_map(|block| block["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The conversation as chat messages for the engine: the system prompt
/// first, then each turn's text (a turn that held only thinking stays, its
/// text empty, so the turns still alternate as templates require).
fn local_messages(body: &Value) -> Vec<Value> {
    let mut messages = Vec::new();
    if !body["system"].is_null() {
        messages.push(json!({"role": "system", "content": text_of(&body["system"])}));
    }
    for message in body["messages"].as_array().into_iter().flatten() {
        messages.push(json!({"role": message["role"], "content": text_of(&message["content"])}));
    }
    messages
}

/// Refuses a request for what the local engine cannot do (a 400 naming the
/// field): tools, thinking, and content other than text (images,
/// documents, tool calls and their results).
fn refuse_unsupported(body: &Value) -> Result<(), ApiError> {
    let refused =
        |param: &'static str, what: String| Err(ApiError::local_engine_cannot_serve(param, what));
    if body["tools"]
        .as_array()
        .is_some_and(|tools| !tools.is_empty())
    {
        return refused("tools", "tool use".into());
    }
    if matches!(
        body["thinking"]["type"].as_str(),
        Some("enabled" | "adaptive")
    ) {
        return refused("thinking", "extended thinking".into());
    }
    // Anthropic's range, narrower than OpenAI's (the engine's): refused as
    // Anthropic refuses it.
    if let Some(temperature) = body["temperature"].as_f64() {
        let bound = match temperature {
            t if t < 0.0 => Some("greater than or equal to 0"),
            t if t > 1.0 => Some("less than or equal to 1"),
            _ => None,
        };
        if let Some(bound) = bound {
            return Err(ApiError::invalid_param(
                "temperature",
                format!("temperature: Input should be {bound}"),
            ));
        }
    }
    let blocks = |content: &Value| -> Vec<String> {
        content
            .as_array()
            .map(|blocks| {
                blocks
                    .iter()
                    .filter_map(|block| block["type"].as_str())
                    .filter(|kind| !READ_BLOCKS.contains(kind))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    if let Some(kind) = blocks(&body["system"]).first() {
        return refused("system", format!("a `{kind}` block (text only)"));
    }
    for (index, message) in body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        // Anthropic takes the system prompt in `system`, and only these roles
        // in `messages`.
        if !matches!(message["role"].as_str(), Some("user" | "assistant")) {
            return Err(ApiError::invalid_param(
                "messages",
                format!("messages.{index}.role: Input should be 'user' or 'assistant'"),
            ));
        }
        if let Some(kind) = blocks(&message["content"]).first() {
            return refused(
                "messages",
                format!("messages[{index}]: a `{kind}` block (text only)"),
            );
        }
    }
    Ok(())
}

/// Anthropic's `stop_reason` and `stop_sequence` for a choice of the
/// engine's: `max_tokens` at its length, `stop_sequence` with the string
/// it stopped at (the choice's `stop_reason`), else `end_turn`.
fn stop_of(choice: &Value) -> (&'static str, Value) {
    match (choice["finish_reason"].as_str(), &choice["stop_reason"]) {
        (Some("length"), _) => ("max_tokens", Value::Null),
        (Some("stop"), Value::String(sequence)) => ("stop_sequence", json!(sequence)),
        _ => ("end_turn", Value::Null),
    }
}

/// A `msg_` id from the engine's completion id.
fn message_id(chat: &Value) -> String {
    let id = chat.get("id").and_then(Value::as_str).unwrap_or("local");
    format!("msg_{}", id.strip_prefix("chatcmpl-").unwrap_or(id))
}

fn count(usage: &Value, key: &str) -> u64 {
    usage.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// The engine's whole answer as a `message`.
pub fn answer(chat: Value, _request: &Value) -> Value {
    let choice = &chat["choices"][0];
    let text = choice["message"]["content"].as_str().unwrap_or("");
    let content: Vec<Value> = if text.is_empty() {
        Vec::new()
    } else {
        vec![json!({"type": "text", "text": text})]
    };
    let usage = &chat["usage"];
    let (stop_reason, stop_sequence) = stop_of(choice);
    json!({
        "id": message_id(&chat),
        "type": "message",
        "role": "assistant",
        "model": chat.get("model").cloned().unwrap_or(Value::Null),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": count(usage, "prompt_tokens"),
                  "output_tokens": count(usage, "completion_tokens")},
    })
}

/// Translates the engine's Chat Completions stream into Messages events.
#[derive(Default)]
pub struct MessagesLocal {
    /// The prompt's tokens, which `message_start` reports as Anthropic does.
    prompt_tokens: u64,
    started: bool,
    /// `stop_reason` and `stop_sequence`, once the engine's answer ended.
    stop: Option<(&'static str, Value)>,
    usage: Option<(u64, u64)>,
    ended: bool,
}

fn event(name: &str, data: &Value, out: &mut Vec<u8>) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.push(b'\n');
    encode_json(data, out);
}

impl MessagesLocal {
    /// A translator for an answer to a prompt of `prompt_tokens`.
    pub fn new(prompt_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            ..Self::default()
        }
    }

    fn start(&mut self, chunk: &Value, out: &mut Vec<u8>) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        let message = json!({
            "id": message_id(chunk), "type": "message", "role": "assistant",
            "model": chunk.get("model").cloned().unwrap_or(Value::Null),
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        });
        event(
            "message_start",
            &json!({"type": "message_start", "message": message}),
            out,
        );
        event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
            out,
        );
    }

    fn end(&mut self, out: &mut Vec<u8>) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        self.start(&Value::Null, out);
        event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": 0}),
            out,
        );
        let (input, output) = self.usage.unwrap_or((0, 0));
        let (stop_reason, stop_sequence) = self.stop.take().unwrap_or(("end_turn", Value::Null));
        event(
            "message_delta",
            &json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"input_tokens": input, "output_tokens": output}}),
            out,
        );
        event(
            super::stream::MESSAGE_STOP,
            &json!({"type": "message_stop"}),
            out,
        );
    }
}

impl LocalStream for MessagesLocal {
    fn translate(&mut self, sse: &SseEvent, out: &mut Vec<u8>) {
        if self.ended {
            return;
        }
        if sse.is_done() {
            return self.end(out);
        }
        let Ok(chunk) = serde_json::from_str::<Value>(&sse.data) else {
            return;
        };
        if let Some(error) = chunk.get("error") {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("the local engine failed");
            let failed = ApiError::new(
                ErrorCode::LocalEngineFailed,
                format!("Local engine: {message}"),
            );
            event("error", &error_json(&failed), out);
            self.ended = true;
            return;
        }
        self.start(&chunk, out);
        if let Some(usage) = chunk.get("usage").filter(|usage| usage.is_object()) {
            self.usage = Some((
                count(usage, "prompt_tokens"),
                count(usage, "completion_tokens"),
            ));
        }
        let Some(choice) = chunk["choices"].get(0) else {
            return;
        };
        if let Some(text) = choice["delta"]["content"]
            .as_str()
            .filter(|text| !text.is_empty())
        {
            event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": text}}),
                out,
            );
        }
        if choice["finish_reason"].is_string() {
            self.stop = Some(stop_of(choice));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use canarygate_policies::sse::SseParser;

    #[test]
    fn the_request_reads_as_a_chat_request() {
        let body = json!({"model": "m", "max_tokens": 9, "stream": true, "temperature": 0.5,
            "stop_sequences": ["END"], "system": "S",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
        let chat = request(&body).unwrap();
        assert_eq!(
            chat["messages"],
            json!([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
        );
        assert_eq!(chat["max_tokens"], 9);
        assert_eq!(chat["stream"], true);
        assert_eq!(chat["stop"], json!(["END"]));
        assert_eq!(chat["temperature"], 0.5);
        assert_eq!(chat["continue_final_message"], false);
    }

    #[test]
    fn earlier_thinking_is_left_out_and_a_prefill_is_continued() {
        let thinking = json!({"type": "thinking", "thinking": "Plan: greet.", "signature": "s"});
        let body = json!({"model": "m", "max_tokens": 9, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [thinking, {"type": "text", "text": "Hello."}]},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
            {"role": "user", "content": "a story"},
            {"role": "assistant", "content": "Once upon"}]});
        let chat = request(&body).unwrap();
        assert_eq!(
            chat["messages"],
            json!([{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": "again"},
                   {"role": "assistant", "content": ""},
                   {"role": "user", "content": "a story"},
                   {"role": "assistant", "content": "Once upon"}])
        );
        assert_eq!(chat["continue_final_message"], true);
        let mut hot = body.clone();
        hot["temperature"] = json!(1.5);
        assert_eq!(request(&hot).unwrap_err().param, Some("temperature"));
        // An empty last turn (or thinking alone) asks for a new reply.
        let mut empty = body.clone();
        empty["messages"][5]["content"] = json!([{"type": "thinking", "thinking": "t"}]);
        let chat = request(&empty).unwrap();
        assert_eq!(chat["continue_final_message"], false);
        assert_eq!(
            chat["messages"].as_array().unwrap().last().unwrap()["role"],
            "user"
        );
    }

    #[test]
    fn the_answer_is_a_message() {
        let chat = json!({"id": "chatcmpl-local-7", "model": "tiny", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": "hello"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}});
        assert_eq!(
            answer(chat, &Value::Null),
            json!({"id": "msg_local-7", "type": "message", "role": "assistant", "model": "tiny",
                   "content": [{"type": "text", "text": "hello"}], "stop_reason": "max_tokens",
                   "stop_sequence": null, "usage": {"input_tokens": 12, "output_tokens": 3}})
        );
    }

    #[test]
    fn a_stop_string_is_a_stop_sequence_whole_and_streamed() {
        let finished = json!({"index": 0, "message": {"role": "assistant", "content": "hi"},
            "finish_reason": "stop", "stop_reason": "END"});
        let chat = json!({"id": "chatcmpl-local-8", "model": "tiny", "choices": [finished],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}});
        let message = answer(chat, &Value::Null);
        assert_eq!(
            (&message["stop_reason"], &message["stop_sequence"]),
            (&json!("stop_sequence"), &json!("END"))
        );
        let events = translate(&[
            &json!({"id": "chatcmpl-local-8", "model": "tiny", "choices": [{"index": 0,
                "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]})
            .to_string(),
            "[DONE]",
        ]);
        let delta: Value = events
            .iter()
            .find(|event| event.event.as_deref() == Some("message_delta"))
            .map(|event| serde_json::from_str(&event.data).unwrap())
            .expect("a message_delta");
        assert_eq!(
            delta["delta"],
            json!({"stop_reason": "stop_sequence", "stop_sequence": "END"})
        );
        // The end of the sequence, with no stop string: end_turn.
        let events = translate(&[
            &json!({"id": "c", "model": "tiny", "choices": [{"index": 0, "delta": {},
                "finish_reason": "stop", "stop_reason": null}]})
            .to_string(),
            "[DONE]",
        ]);
        assert!(
            events
                .iter()
                .any(|event| event.data.contains(r#""stop_reason":"end_turn""#))
        );
    }

    fn translate(events: &[&str]) -> Vec<SseEvent> {
        // The engine counted the prompt at 5 tokens.
        let mut local = MessagesLocal::new(5);
        let mut out = Vec::new();
        for data in events {
            let sse = SseEvent {
                data: (*data).to_owned(),
                ..SseEvent::default()
            };
            local.translate(&sse, &mut out);
        }
        let mut parsed = Vec::new();
        SseParser::new().feed(&out, &mut parsed);
        parsed
    }

    #[test]
    fn the_stream_is_the_messages_event_sequence() {
        let chunk = |delta: Value, finish: Value| {
            json!({"id": "chatcmpl-local-1", "model": "tiny",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
            .to_string()
        };
        let events = translate(&[
            &chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            &chunk(json!({"content": "Hel"}), Value::Null),
            &chunk(json!({"content": "lo"}), Value::Null),
            &chunk(json!({}), json!("stop")),
            &json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
                .to_string(),
            "[DONE]",
        ]);
        let names: Vec<&str> = events
            .iter()
            .map(|event| event.event.as_deref().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        for event in &events {
            let data: Value = serde_json::from_str(&event.data).unwrap();
            assert_eq!(data["type"], event.event.as_deref().unwrap());
        }
        // The prompt's tokens from the start, as Anthropic reports them.
        let start: Value = serde_json::from_str(&events[0].data).unwrap();
        assert_eq!(start["message"]["usage"]["input_tokens"], 5);
        let delta: Value = serde_json::from_str(&events[5].data).unwrap();
        assert_eq!(delta["delta"]["stop_reason"], "end_turn");
        assert_eq!(delta["usage"]["output_tokens"], 2);
        assert_eq!(delta["usage"]["input_tokens"], 5);

        let failed = translate(&[r#"{"error": {"message": "boom"}}"#]);
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].event.as_deref(), Some("error"));
        assert!(failed[0].data.contains("boom"));
    }
}
