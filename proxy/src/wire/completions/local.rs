//! Completions served by the local engine, which speaks Chat Completions:
//! the prompt goes as one user message (the engine applies its chat
//! template: an instruction-following answer, not a raw continuation), the
//! answer comes back as a `text_completion` object or chunks.
//!
//! The engine serves one conversation and one choice per request, so a list
//! of several prompts, `n` over 1, token-id prompts, a `suffix` (text to
//! insert before, which a chat model cannot do) and `logprobs` (the engine
//! computes none) are refused with a clear 400 rather than answered with
//! fewer choices, a different kind of text or no logprobs. `echo` is served
//! (the client's own prompt, without canaries, opens the text).

use canarygate_policies::sse::{SseEvent, encode_data, encode_json};
use serde_json::{Map, Value, json};

use super::request::{DEFAULT_MAX_TOKENS, Prompts, prompts};
use crate::error::{ApiError, ErrorCode};
use crate::wire::format::LocalStream;

/// Sampling fields the engine reads, passed as the client set them.
const SAMPLING: [&str; 7] = [
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
];

fn refused(param: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::LocalEngineRejected, message).with_param(param)
}

/// The client's request as a Chat Completions body for the engine.
pub fn request(body: &Value) -> Result<Value, ApiError> {
    let prompt = match prompts(body) {
        Prompts::Texts(texts) if texts.len() == 1 => texts[0],
        Prompts::Texts(texts) => {
            return Err(refused(
                "prompt",
                format!(
                    "This request must be served by canarygate's local engine, which serves one \
                     prompt per request; it has {}. Send the prompts one request each.",
                    texts.len()
                ),
            ));
        }
        Prompts::TokenIds(_) => {
            return Err(refused(
                "prompt",
                "This request must be served by canarygate's local engine, which reads prompts \
                 as text, not token ids.",
            ));
        }
    };
    if body.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Err(refused(
            "n",
            "This request must be served by canarygate's local engine, which gives one choice \
             per request; send `n` = 1.",
        ));
    }
    if body
        .get("logprobs")
        .is_some_and(|logprobs| !logprobs.is_null())
    {
        return Err(refused(
            "logprobs",
            "This request must be served by canarygate's local engine, which cannot give \
             logprobs.",
        ));
    }
    if body
        .get("suffix")
        .and_then(Value::as_str)
        .is_some_and(|suffix| !suffix.is_empty())
    {
        return Err(refused(
            "suffix",
            "This request must be served by canarygate's local engine, which cannot insert text \
             before a `suffix`.",
        ));
    }
    let mut chat = Map::new();
    chat.insert("model".into(), body["model"].clone());
    chat.insert(
        "messages".into(),
        json!([{"role": "user", "content": prompt}]),
    );
    let max_tokens = body
        .get("max_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    chat.insert("max_tokens".into(), json!(max_tokens));
    for field in SAMPLING {
        if let Some(value) = body.get(field).filter(|value| !value.is_null()) {
            chat.insert(field.into(), value.clone());
        }
    }
    Ok(Value::Object(chat))
}

/// What opens each choice's text: the prompt, when the client asked for
/// `echo`.
fn echoed(request: &Value) -> String {
    match (
        request.get("echo").and_then(Value::as_bool),
        prompts(request),
    ) {
        (Some(true), Prompts::Texts(texts)) => texts.concat(),
        _ => String::new(),
    }
}

/// `cmpl-…` for the engine's `chatcmpl-…` id.
fn completion_id(chat: &Value) -> Value {
    match chat.get("id").and_then(Value::as_str) {
        Some(id) => json!(format!(
            "cmpl-{}",
            id.strip_prefix("chatcmpl-").unwrap_or(id)
        )),
        None => Value::Null,
    }
}

/// The engine's `chat.completion` as a `text_completion`.
pub fn answer(chat: Value, request: &Value) -> Value {
    let prefix = echoed(request);
    let choices: Vec<Value> = chat
        .get("choices")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .map(|choice| {
            let content = choice["message"]["content"].as_str().unwrap_or("");
            json!({"text": format!("{prefix}{content}"), "index": choice["index"],
                   "logprobs": null, "finish_reason": choice["finish_reason"]})
        })
        .collect();
    json!({
        "id": completion_id(&chat),
        "object": "text_completion",
        "created": chat["created"],
        "model": chat["model"],
        "choices": choices,
        "usage": chat["usage"],
    })
}

/// The engine's chunks as `text_completion` chunks.
pub struct CompletionsLocal {
    /// The echoed prompt, until the first chunk carries it.
    prefix: Option<String>,
}

impl CompletionsLocal {
    /// A translator for the engine's answer to `request`.
    pub fn new(request: &Value) -> Self {
        Self {
            prefix: Some(echoed(request)).filter(|prefix| !prefix.is_empty()),
        }
    }
}

impl LocalStream for CompletionsLocal {
    fn translate(&mut self, event: &SseEvent, out: &mut Vec<u8>) {
        let chunk = match serde_json::from_str::<Value>(&event.data) {
            Ok(chunk) if chunk.get("error").is_none() && !event.is_done() => chunk,
            // `[DONE]`, the engine's error event (already OpenAI's shape).
            _ => return encode_data(&event.data, out),
        };
        let mut choices = Vec::new();
        for choice in chunk["choices"].as_array().map_or(&[][..], Vec::as_slice) {
            let mut text = choice["delta"]["content"].as_str().unwrap_or("").to_owned();
            if let Some(prefix) = self.prefix.take() {
                text.insert_str(0, &prefix);
            }
            if text.is_empty() && choice["finish_reason"].is_null() {
                // The opening chunk (the role only): nothing to say yet.
                continue;
            }
            choices.push(
                json!({"text": text, "index": choice["index"], "logprobs": null,
                                "finish_reason": choice["finish_reason"]}),
            );
        }
        let usage = chunk.get("usage").filter(|usage| usage.is_object());
        if choices.is_empty() && usage.is_none() {
            return;
        }
        let mut translated = json!({
            "id": completion_id(&chunk),
            "object": "text_completion",
            "created": chunk["created"],
            "model": chunk["model"],
            "choices": choices,
        });
        if let Some(usage) = usage {
            translated["usage"] = usage.clone();
        }
        encode_json(&translated, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(data: &str) -> SseEvent {
        SseEvent {
            data: data.to_owned(),
            ..SseEvent::default()
        }
    }

    #[test]
    fn one_text_prompt_becomes_one_user_message_with_the_default_limit() {
        let body = json!({"model": "m", "prompt": ["Write a haiku"], "temperature": 0,
                          "stream": true, "best_of": 3, "echo": true});
        let chat = request(&body).unwrap();
        assert_eq!(
            chat,
            json!({"model": "m", "messages": [{"role": "user", "content": "Write a haiku"}],
                   "max_tokens": DEFAULT_MAX_TOKENS, "temperature": 0, "stream": true})
        );
        for (body, param) in [
            (json!({"model": "m", "prompt": ["a", "b"]}), "prompt"),
            (json!({"model": "m", "prompt": [1, 2]}), "prompt"),
            (json!({"model": "m", "prompt": "a", "n": 2}), "n"),
            (
                json!({"model": "m", "prompt": "a", "suffix": "end"}),
                "suffix",
            ),
            (
                json!({"model": "m", "prompt": "a", "logprobs": 2}),
                "logprobs",
            ),
        ] {
            let error = request(&body).unwrap_err();
            assert_eq!(error.code, ErrorCode::LocalEngineRejected, "{body}");
            assert_eq!(error.param, Some(param));
        }
    }

    #[test]
    fn answers_and_chunks_are_text_completions() {
        let chat = json!({"id": "chatcmpl-local-7", "object": "chat.completion", "created": 5,
            "model": "tiny", "choices": [{"index": 0, "message": {"role": "assistant",
            "content": " there"}, "logprobs": null, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}});
        let request = json!({"model": "m", "prompt": "Hello", "echo": true});
        let answer = answer(chat, &request);
        assert_eq!(
            answer,
            json!({"id": "cmpl-local-7", "object": "text_completion", "created": 5,
                   "model": "tiny", "choices": [{"text": "Hello there", "index": 0,
                   "logprobs": null, "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
        );

        let mut local = CompletionsLocal::new(&json!({"model": "m", "prompt": "Hi"}));
        let mut out = Vec::new();
        let chunk = |delta: Value, finish: Value| {
            json!({"id": "chatcmpl-local-8", "object": "chat.completion.chunk", "created": 6,
                   "model": "tiny", "choices": [{"index": 0, "delta": delta,
                   "finish_reason": finish}]})
            .to_string()
        };
        for data in [
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            chunk(json!({"content": "Hey"}), Value::Null),
            chunk(json!({}), json!("stop")),
            json!({"id": "chatcmpl-local-8", "choices": [], "created": 6, "model": "tiny",
                   "usage": {"prompt_tokens": 1}})
            .to_string(),
            "[DONE]".to_owned(),
        ] {
            local.translate(&event(&data), &mut out);
        }
        let text = String::from_utf8(out).unwrap();
        let events: Vec<&str> = text
            .split("\n\n")
            .filter(|event| !event.is_empty())
            .map(|event| event.strip_prefix("data: ").unwrap())
            .collect();
        assert_eq!(events.len(), 4, "the role-only opener is dropped: {text}");
        let first: Value = serde_json::from_str(events[0]).unwrap();
        assert_eq!(first["object"], "text_completion");
        assert_eq!(first["id"], "cmpl-local-8");
        assert_eq!(first["choices"][0]["text"], "Hey");
        let last: Value = serde_json::from_str(events[1]).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        assert_eq!(last["choices"][0]["text"], "");
        let usage: Value = serde_json::from_str(events[2]).unwrap();
        assert_eq!(usage["usage"]["prompt_tokens"], 1);
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(events[3], "[DONE]");

        // The engine's error event passes as it is (OpenAI's shape).
        let mut out = Vec::new();
        local.translate(&event(r#"{"error":{"message":"boom"}}"#), &mut out);
        assert_eq!(out, b"data: {\"error\":{\"message\":\"boom\"}}\n\n");
    }
}
