//! The local engine's Chat Completions answers as Responses API answers:
//! a whole `response` object, or the typed event sequence the SDK's
//! `responses.stream()` helper accepts (`response.created`,
//! `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta`s,
//! `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done`, `response.completed`), numbered from 0.
//!
//! Longer than 500 lines: about 150 of them are the unit tests, which turn
//! requests into the engine's and its answers and streams into responses.

use canarygate_policies::sse::{SseEvent, encode_json};
use serde_json::{Value, json};

use super::error::error_event_json;
use super::request::chat_messages;
use crate::error::{ApiError, ErrorCode};
use crate::wire::format::LocalStream;

/// The client's request as a Chat Completions request for the local
/// engine: instructions and input as messages, `max_output_tokens` as
/// `max_tokens`, the stream with its usage.
pub fn local_request(body: &Value) -> Result<Value, ApiError> {
    refuse_unsupported(body)?;
    // Earlier turns' reasoning is skipped: the provider keeps it out of a
    // later turn's context too.
    let mut read = body.clone();
    if let Some(items) = read.get_mut("input").and_then(Value::as_array_mut) {
        items.retain(|item| item["type"] != "reasoning");
    }
    let messages = chat_messages(&read);
    if !messages.iter().any(|message| message["role"] == "user") {
        return Err(ApiError::invalid_param(
            "input",
            "The local engine needs a user message in `input` to answer.",
        ));
    }
    let mut chat = json!({"model": body["model"], "messages": messages});
    if let Some(limit) = body
        .get("max_output_tokens")
        .filter(|value| !value.is_null())
    {
        chat["max_tokens"] = limit.clone();
    }
    for field in ["temperature", "top_p"] {
        if let Some(value) = body.get(field).filter(|value| !value.is_null()) {
            chat[field] = value.clone();
        }
    }
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        chat["stream"] = json!(true);
        chat["stream_options"] = json!({"include_usage": true});
    }
    Ok(chat)
}

/// Input content parts the engine reads.
const TEXT_PARTS: [&str; 2] = ["input_text", "output_text"];

/// Refuses a request for what the local engine cannot do (a 400 naming the
/// field): tools, JSON output, logprobs, a conversation the provider keeps,
/// a background answer, and input other than text (images, files, function
/// calls and their outputs). Reasoning items of earlier turns are skipped;
/// `reasoning.effort` is a hint, ignored (the engine's models write no
/// reasoning to spend it on).
fn refuse_unsupported(body: &Value) -> Result<(), ApiError> {
    let refused =
        |param: &'static str, what: String| Err(ApiError::local_engine_cannot_serve(param, what));
    let set = |field: &str| body.get(field).is_some_and(|value| !value.is_null());
    if body["top_logprobs"].as_u64().is_some_and(|top| top > 0) {
        return refused("top_logprobs", "logprobs".into());
    }
    if body["include"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|included| {
            included
                .as_str()
                .is_some_and(|name| name.ends_with("logprobs"))
        })
    {
        return refused("include", "logprobs".into());
    }
    if body["tools"]
        .as_array()
        .is_some_and(|tools| !tools.is_empty())
    {
        return refused("tools", "tool calls".into());
    }
    if matches!(body["text"]["format"]["type"].as_str(), Some(kind) if kind != "text") {
        return refused("text", "JSON output (`text.format`)".into());
    }
    for field in ["previous_response_id", "conversation"] {
        if set(field) {
            return refused(
                field,
                format!("a conversation the provider keeps (`{field}`)"),
            );
        }
    }
    if body["background"] == json!(true) {
        return refused("background", "a background answer".into());
    }
    for (index, item) in body["input"].as_array().into_iter().flatten().enumerate() {
        let kind = item["type"].as_str().unwrap_or("message");
        let unread = match kind {
            "message" => item["content"].as_array().and_then(|parts| {
                parts
                    .iter()
                    .filter_map(|part| part["type"].as_str())
                    .find(|part| !TEXT_PARTS.contains(part))
            }),
            "reasoning" => None,
            other => Some(other),
        };
        if let Some(unread) = unread {
            return refused("input", format!("input[{index}]: `{unread}` (text only)"));
        }
    }
    Ok(())
}

/// A fresh id with `prefix` (`resp`, `msg`).
fn fresh_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::now_v7().simple())
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

/// The facts of one local answer a Responses object is built from.
struct Answer<'a> {
    id: &'a str,
    message_id: &'a str,
    created_at: u64,
    request: &'a Value,
    /// The model the engine reports (the route's local model).
    model: &'a Value,
}

impl Answer<'_> {
    /// The message item holding `text`, `in_progress` or finished.
    fn message(&self, text: Option<&str>, status: &str) -> Value {
        let content = match text {
            Some(text) => json!([text_part(text)]),
            None => json!([]),
        };
        json!({"id": self.message_id, "type": "message", "status": status,
               "role": "assistant", "content": content})
    }

    /// The response object: `output` and `usage` once finished.
    fn response(&self, status: &str, output: Vec<Value>, usage: Option<Value>) -> Value {
        let field = |key: &str| self.request.get(key).cloned().unwrap_or(Value::Null);
        json!({
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": null,
            "incomplete_details": if status == "incomplete" {
                json!({"reason": "max_output_tokens"})
            } else {
                Value::Null
            },
            "instructions": field("instructions"), "max_output_tokens": field("max_output_tokens"),
            "model": self.model, "output": output, "parallel_tool_calls": true,
            "previous_response_id": field("previous_response_id"), "store": false,
            "temperature": field("temperature"), "top_p": field("top_p"),
            "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
            "truncation": "disabled", "usage": usage, "metadata": field("metadata"),
        })
    }
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// Responses `usage` from a chat `usage`.
fn usage(chat: &Value) -> Option<Value> {
    let input = chat.get("prompt_tokens").and_then(Value::as_u64)?;
    let output = chat
        .get("completion_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    Some(json!({
        "input_tokens": input, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input + output,
    }))
}

/// `completed`, or `incomplete` when the engine stopped at the limit.
fn status_of(finish_reason: Option<&str>) -> &'static str {
    if finish_reason == Some("length") {
        "incomplete"
    } else {
        "completed"
    }
}

/// The engine's whole chat completion as a Responses object.
pub fn local_answer(chat: &Value, request: &Value) -> Value {
    let (id, message_id) = (fresh_id("resp"), fresh_id("msg"));
    let answer = Answer {
        id: &id,
        message_id: &message_id,
        created_at: chat
            .get("created")
            .and_then(Value::as_u64)
            .unwrap_or_else(now_secs),
        request,
        model: chat.get("model").unwrap_or(&Value::Null),
    };
    let choice = &chat["choices"][0];
    let text = choice["message"]["content"].as_str().unwrap_or("");
    let status = status_of(choice["finish_reason"].as_str());
    let message = answer.message(Some(text), status);
    answer.response(status, vec![message], chat.get("usage").and_then(usage))
}

/// Turns the engine's chat stream into Responses events (see the module
/// docs).
pub struct ResponsesLocal {
    id: String,
    message_id: String,
    created_at: u64,
    request: Value,
    /// The model the engine reports, from its first chunk.
    model: Value,
    /// The next event's `sequence_number`.
    sequence: u64,
    /// The opening events were written.
    opened: bool,
    text: String,
    finish_reason: Option<String>,
    usage: Option<Value>,
    /// The stream ended (its last event, or an error, was written).
    ended: bool,
}

impl ResponsesLocal {
    /// A translator for the engine's stream answering `request`.
    pub fn new(request: &Value) -> Self {
        Self {
            id: fresh_id("resp"),
            message_id: fresh_id("msg"),
            created_at: now_secs(),
            request: request.clone(),
            model: Value::Null,
            sequence: 0,
            opened: false,
            text: String::new(),
            finish_reason: None,
            usage: None,
            ended: false,
        }
    }

    fn answer(&self) -> Answer<'_> {
        Answer {
            id: &self.id,
            message_id: &self.message_id,
            created_at: self.created_at,
            request: &self.request,
            model: &self.model,
        }
    }

    /// Writes `event` (its `type` names it), numbered.
    fn emit(&mut self, mut event: Value, out: &mut Vec<u8>) {
        event["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        let name = event["type"].as_str().unwrap_or("").to_owned();
        out.extend_from_slice(format!("event: {name}\n").as_bytes());
        encode_json(&event, out);
    }

    fn open(&mut self, out: &mut Vec<u8>) {
        if std::mem::replace(&mut self.opened, true) {
            return;
        }
        let snapshot = self.answer().response("in_progress", Vec::new(), None);
        let item = self.answer().message(None, "in_progress");
        let part = json!({"item_id": self.message_id, "output_index": 0, "content_index": 0,
                          "part": text_part("")});
        self.emit(
            json!({"type": "response.created", "response": snapshot}),
            out,
        );
        self.emit(
            json!({"type": "response.in_progress", "response": snapshot}),
            out,
        );
        self.emit(
            json!({"type": "response.output_item.added", "output_index": 0, "item": item}),
            out,
        );
        let mut added = part;
        added["type"] = json!("response.content_part.added");
        self.emit(added, out);
    }

    fn close(&mut self, out: &mut Vec<u8>) {
        self.open(out);
        let at = json!({"item_id": self.message_id, "output_index": 0, "content_index": 0});
        let status = status_of(self.finish_reason.as_deref());
        let with = |mut event: Value| {
            for (key, value) in at.as_object().into_iter().flatten() {
                event[key] = value.clone();
            }
            event
        };
        let text = self.text.clone();
        self.emit(
            with(json!({"type": "response.output_text.done", "text": text, "logprobs": []})),
            out,
        );
        self.emit(
            with(json!({"type": "response.content_part.done", "part": text_part(&text)})),
            out,
        );
        let item = self.answer().message(Some(&text), status);
        self.emit(
            json!({"type": "response.output_item.done", "output_index": 0, "item": item.clone()}),
            out,
        );
        let response = self
            .answer()
            .response(status, vec![item], self.usage.clone());
        self.emit(
            json!({"type": format!("response.{status}"), "response": response}),
            out,
        );
        self.ended = true;
    }
}

impl LocalStream for ResponsesLocal {
    fn translate(&mut self, event: &SseEvent, out: &mut Vec<u8>) {
        if self.ended {
            return;
        }
        if event.is_done() {
            return self.close(out);
        }
        let Ok(chunk) = serde_json::from_str::<Value>(&event.data) else {
            return;
        };
        if let Some(error) = chunk.get("error") {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("the local engine failed");
            let error = ApiError::new(ErrorCode::LocalEngineFailed, message);
            let mut event = error_event_json(&error);
            event["sequence_number"] = json!(self.sequence);
            self.sequence += 1;
            out.extend_from_slice(b"event: error\n");
            encode_json(&event, out);
            self.ended = true;
            return;
        }
        if self.model.is_null()
            && let Some(model) = chunk.get("model")
        {
            self.model = model.clone();
        }
        self.open(out);
        if let Some(usage) = chunk.get("usage").and_then(usage) {
            self.usage = Some(usage);
        }
        let Some(choice) = chunk.pointer("/choices/0") else {
            return;
        };
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(reason.to_owned());
        }
        let delta = choice
            .pointer("/delta/content")
            .and_then(Value::as_str)
            .unwrap_or("");
        if !delta.is_empty() {
            self.text.push_str(delta);
            let event = json!({"type": "response.output_text.delta", "item_id": self.message_id,
                "output_index": 0, "content_index": 0, "delta": delta, "logprobs": []});
            self.emit(event, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_engine_gets_chat_messages() {
        let body = json!({"model": "m", "instructions": "Be brief.", "max_output_tokens": 7,
            "stream": true, "input": [
                {"role": "developer", "content": "Use metric units."},
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]});
        let chat = local_request(&body).unwrap();
        assert_eq!(
            chat["messages"],
            json!([{"role": "system", "content": "Be brief."},
                   {"role": "system", "content": "Use metric units."},
                   {"role": "user", "content": "hi"}])
        );
        assert_eq!(chat["max_tokens"], 7);
        assert_eq!(chat["stream_options"]["include_usage"], true);
        let error = local_request(&json!({"model": "m", "instructions": "x"})).unwrap_err();
        assert_eq!(error.param, Some("input"));
    }

    #[test]
    fn earlier_reasoning_is_skipped_and_logprobs_refused() {
        let body = json!({"model": "m", "input": [
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "id": "rs_1", "summary": [
                {"type": "summary_text", "text": "The user greets."}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": "again"}]});
        let chat = local_request(&body).unwrap();
        assert_eq!(
            chat["messages"],
            json!([{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": "again"}])
        );
        for (field, value) in [
            ("top_logprobs", json!(3)),
            ("include", json!(["message.output_text.logprobs"])),
        ] {
            let mut asking = body.clone();
            asking[field] = value;
            let error = local_request(&asking).unwrap_err();
            assert_eq!(error.param, Some(field), "{error}");
        }
        let mut zero = body.clone();
        zero["top_logprobs"] = json!(0);
        assert!(local_request(&zero).is_ok());
    }

    #[test]
    fn a_whole_local_answer_is_a_response() {
        let chat = json!({"id": "chatcmpl-local-1", "created": 7, "choices": [{"index": 0,
            "message": {"role": "assistant", "content": "hello there"},
            "finish_reason": "length"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}});
        let request = json!({"model": "m", "instructions": "Be brief.", "input": "hi"});
        let response = local_answer(&chat, &request);
        assert!(response["id"].as_str().unwrap().starts_with("resp_"));
        assert_eq!(response["object"], "response");
        assert_eq!(response["status"], "incomplete");
        assert_eq!(
            response["incomplete_details"]["reason"],
            "max_output_tokens"
        );
        assert_eq!(response["output"][0]["content"][0]["text"], "hello there");
        assert_eq!(response["usage"]["input_tokens"], 9);
        assert_eq!(response["usage"]["total_tokens"], 11);
        assert_eq!(response["instructions"], "Be brief.");
    }

    #[test]
    fn the_local_stream_is_the_responses_event_sequence() {
        let mut local = ResponsesLocal::new(&json!({"model": "m", "input": "hi"}));
        let mut out = Vec::new();
        let chunk = |delta: Value, finish: Value| SseEvent {
            data: json!({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
                .to_string(),
            ..SseEvent::default()
        };
        for event in [
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            chunk(json!({"content": "hel"}), Value::Null),
            chunk(json!({"content": "lo"}), Value::Null),
            chunk(json!({}), json!("stop")),
            SseEvent {
                data: json!({"choices": [], "usage": {"prompt_tokens": 4,
                    "completion_tokens": 2}})
                .to_string(),
                ..SseEvent::default()
            },
            SseEvent {
                data: "[DONE]".into(),
                ..SseEvent::default()
            },
        ] {
            local.translate(&event, &mut out);
        }
        let mut events = Vec::new();
        canarygate_policies::sse::SseParser::new().feed(&out, &mut events);
        let types: Vec<String> = events.iter().map(|e| e.event.clone().unwrap()).collect();
        assert_eq!(
            types,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let data: Vec<Value> = events
            .iter()
            .map(|e| serde_json::from_str(&e.data).unwrap())
            .collect();
        for (number, event) in data.iter().enumerate() {
            assert_eq!(event["sequence_number"], number);
            assert_eq!(event["type"], types[number]);
        }
        let completed = &data[9]["response"];
        assert_eq!(
            completed["id"], data[0]["response"]["id"],
            "one response id"
        );
        assert_eq!(completed["output"][0]["content"][0]["text"], "hello");
        assert_eq!(completed["usage"]["output_tokens"], 2);
        assert_eq!(data[6]["text"], "hello");

        // An engine failure ends the stream with an error event.
        let mut failing = ResponsesLocal::new(&json!({"model": "m", "input": "hi"}));
        let mut out = Vec::new();
        failing.translate(
            &SseEvent {
                data: json!({"error": {"message": "engine stopped"}}).to_string(),
                ..SseEvent::default()
            },
            &mut out,
        );
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("event: error\n"), "{text}");
        assert!(text.contains("engine stopped"));
    }
}
