//! OpenAI Chat Completions (`POST /v1/chat/completions`): the first wire format.
//!
//! Requests are validated only as far as canarygate relies on them
//! ([`request`]); every other field passes through for the provider to
//! judge. Canaries go where [`canarygate_policies::inject`] puts them in a
//! `messages` array. Text is read from `choices[i].message.content` and
//! `tool_calls[j].function.arguments` (whole answers) or the same fields
//! under `delta` (stream chunks), with reasoning, refusals and legacy
//! `function_call` arguments ([`answer`]). The client gets the provider's
//! own answer and chunks, edited where their text changed ([`edit_fields`];
//! the common chunk is read without building its JSON tree, [`light`];
//! logprobs follow the content, [`logprobs`]; a stream's chunks are held
//! until verified, [`stream`]). Errors are
//! `{"error":{"message","type","param","code"}}`.

mod answer;
mod deliver;
mod joined;
#[cfg(test)]
mod json_text;
mod light;
mod light_answer;
mod logprobs;
mod null_usage;
mod request;
mod stored;
mod stream;

use std::ops::Range;

use std::borrow::Cow;

use axum::http::StatusCode;
use canarygate_policies::EchoCost;
use canarygate_policies::config::ProviderApi;
use canarygate_policies::inject::{
    InjectError, Injection, RequestCanaries, SystemRole, inject_for,
};
use canarygate_policies::sse::{SseEvent, encode_data, encode_json};
use canarygate_policies::verify::{ProviderUsage, Verifier};
use canarygate_policies::verify_config::EchoMode;
use serde::Deserialize;
use serde_json::{Value, json};

use self::answer::read_choices;
pub use self::answer::{index_of, map_choices, read_only_strings, residual_members, usage_of};
pub use self::deliver::Edited;
use self::deliver::edit_fields;
pub use self::joined::joined_other;
pub use self::logprobs::followed as followed_logprobs;
pub use self::request::{check_stream_options, json_object, model_of, stream_of};
pub use self::stored::scrub as scrub_stored_completion;
pub use self::stream::{ChatStream, ChunkEditor};
use crate::error::{ApiError, ErrorCode};
use crate::wire::edit::Delivery;
use crate::wire::format::{
    AnswerView, Choices, Chunk, ClientRequest, EventView, LightAnswer, LocalStream, StreamMemo,
    WireFormat,
};
use crate::wire::location::Key;

/// OpenAI Chat Completions.
pub struct Chat;

impl WireFormat for Chat {
    type StreamWriter = ChatStream;
    type LocalStream = ChatLocal;

    const ENDPOINT: &'static str = "chat_completions";
    const PATH: &'static str = crate::upstream::CHAT_COMPLETIONS;
    const API: ProviderApi = ProviderApi::Openai;
    const FORWARDED_HEADERS: &'static [&'static str] = &OPENAI_HEADERS;
    const PROMPT_PARAM: &'static str = "messages";
    const LIMIT_PARAM: &'static str = "max_tokens";

    fn parse_request(bytes: &[u8]) -> Result<ClientRequest, ApiError> {
        request::parse(bytes)
    }

    fn set_model(body: &mut Value, model: &str) {
        body["model"] = json!(model);
    }

    fn prompt_messages(body: &Value) -> Cow<'_, [Value]> {
        Cow::Borrowed(request::messages(body))
    }

    fn place_canaries(
        body: &mut Value,
        echo: EchoMode,
        cost: EchoCost,
        canaries: RequestCanaries,
        system_role: SystemRole,
    ) -> Result<Injection, ApiError> {
        // vLLM's prompt logprobs and token ids spell the prompt back, and
        // with it the canaries and their instruction.
        for field in PROMPT_ECHO_FIELDS {
            if body
                .get(field)
                .is_some_and(|value| !value.is_null() && *value != json!(false))
            {
                return Err(ApiError::invalid_param(
                    field,
                    format!(
                        "`{field}` returns the prompt as the provider saw it, canarygate's \
                         canaries included; it is not served on the verified path."
                    ),
                ));
            }
        }
        inject_for(body, echo, cost, canaries, system_role).map_err(|error| match error {
            InjectError::BadChoiceCount => ApiError::invalid_param("n", error.to_string()),
            InjectError::NotAnObject | InjectError::NoMessages | InjectError::BadMessage(_) => {
                ApiError::invalid_param("messages", error.to_string())
            }
        })
    }

    fn read_answer(answer: &Value) -> AnswerView {
        AnswerView {
            choices: read_choices(answer, Key::Message),
            usage: usage_of(answer),
        }
    }

    fn usage_in(answer: &[u8]) -> Option<ProviderUsage> {
        /// Just `usage` of an answer; the rest is skipped unparsed.
        #[derive(Deserialize)]
        struct UsageOnly {
            usage: Option<Value>,
        }
        ProviderUsage::from_usage(&serde_json::from_slice::<UsageOnly>(answer).ok()?.usage?)
    }

    fn read_answer_light(answer: &str) -> Option<LightAnswer> {
        light_answer::read(answer)
    }

    fn read_event(event: &SseEvent) -> EventView {
        read_chunk(event, None)
    }

    fn read_stream_event(event: &SseEvent, memo: &mut StreamMemo) -> EventView {
        read_chunk(event, Some(memo))
    }

    fn is_end_marker(event: &SseEvent) -> bool {
        event.is_done()
    }

    fn stream_writer(delivery: Delivery) -> ChatStream {
        ChatStream::new(delivery)
    }

    fn deliver_answer(
        answer: &mut Value,
        view: &AnswerView,
        spans: &[Range<usize>],
        verifier: &Verifier,
        delivery: &mut Delivery,
    ) {
        delivery.follow_content_positions();
        let fields: Vec<_> = view
            .choices
            .iter()
            .flat_map(|choice| &choice.texts)
            .copied()
            .zip(spans.iter().cloned())
            .collect();
        edit_fields(answer, &view.choices, &fields, verifier, delivery);
        if let Some(usage) = answer.get_mut("usage").filter(|usage| usage.is_object()) {
            delivery.report_usage(usage);
        }
    }

    fn is_error_body(body: &[u8]) -> bool {
        serde_json::from_slice::<Value>(body)
            .is_ok_and(|value| value.get("error").is_some_and(Value::is_object))
    }

    fn error_event_status(data: &str) -> Option<StatusCode> {
        error_status(&serde_json::from_str(data).ok()?)
    }

    fn error_body(error: &ApiError) -> Vec<u8> {
        error_json(error).to_string().into_bytes()
    }

    fn error_event(error: &ApiError) -> Vec<u8> {
        let mut event = Vec::new();
        encode_json(&error_json(error), &mut event);
        event
    }

    fn local_request(body: &Value) -> Result<Value, ApiError> {
        Ok(body.clone())
    }

    fn local_answer(chat: Value, _request: &Value) -> Value {
        chat
    }

    fn local_stream(_request: &Value, _prompt_tokens: u64) -> ChatLocal {
        ChatLocal
    }
}

/// The local engine's stream is already Chat Completions: passed as it is.
pub struct ChatLocal;

impl LocalStream for ChatLocal {
    fn translate(&mut self, event: &SseEvent, out: &mut Vec<u8>) {
        encode_data(&event.data, out);
    }
}

/// Request headers of OpenAI's API passed on to the provider.
pub const OPENAI_HEADERS: [&str; 3] = ["openai-organization", "openai-project", "openai-beta"];

/// Request fields that make a provider return the prompt itself.
const PROMPT_ECHO_FIELDS: [&str; 2] = ["prompt_logprobs", "return_token_ids"];

/// The HTTP status an OpenAI-shaped error (`{"error": {...}}`, as a stream
/// sends it in a chunk) stands for: its `code` when that is an HTTP status
/// (OpenRouter's), else by its `type` or `code` as OpenAI names them (rate
/// limits and quota 429, a bad request 400, a bad key 401), else 500, a
/// server error. `None` when `value` is no such error.
pub fn error_status(value: &Value) -> Option<StatusCode> {
    let error = value.get("error").filter(|error| error.is_object())?;
    if let Some(code) = error.get("code").and_then(Value::as_u64)
        && let Ok(code) = u16::try_from(code)
        && let Ok(status) = StatusCode::from_u16(code)
        && (status.is_client_error() || status.is_server_error())
    {
        return Some(status);
    }
    let named = |names: &[&str]| {
        ["type", "code"].iter().any(|key| {
            error
                .get(key)
                .and_then(Value::as_str)
                .is_some_and(|name| names.contains(&name))
        })
    };
    Some(
        if named(&[
            "rate_limit_exceeded",
            "rate_limit_error",
            "insufficient_quota",
        ]) {
            StatusCode::TOO_MANY_REQUESTS
        } else if named(&["invalid_request_error"]) {
            StatusCode::BAD_REQUEST
        } else if named(&["authentication_error", "invalid_api_key"]) {
            StatusCode::UNAUTHORIZED
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        },
    )
}

/// OpenAI's error object for `error` (every OpenAI-API format writes its
/// errors so).
pub fn error_json(error: &ApiError) -> Value {
    let code = error.code;
    let mut body = json!({"error": {
        "message": error.message, "type": code.kind(), "param": error.param, "code": code.code(),
    }});
    if code == ErrorCode::VerificationFailed {
        // This error also names the failed checks.
        body["error"]["failed_checks"] = json!(error.failed_checks);
    }
    body
}

/// One event of a Chat stream: read in place when it is light (after the
/// prefix the stream's chunks share, with a `memo`), else from its tree.
fn read_chunk(event: &SseEvent, memo: Option<&mut StreamMemo>) -> EventView {
    if event.is_done() {
        return EventView::Done;
    }
    let light = match memo {
        Some(memo) => light::read_in_stream(&event.data, memo),
        None => light::read(&event.data),
    };
    if let Some(chunk) = light {
        return EventView::Chunk(chunk);
    }
    read_chunk_tree(&event.data, |chunk| read_choices(chunk, Key::Delta))
}

/// A chunk of an OpenAI-shaped stream (Chat Completions, legacy
/// completions) read from its tree: an `{"error": …}` event, or a chunk
/// whose choices `choices_of` reads, with its usage.
pub fn read_chunk_tree(data: &str, choices_of: impl FnOnce(&Value) -> Choices) -> EventView {
    let Ok(chunk) = serde_json::from_str::<Value>(data) else {
        return EventView::Malformed;
    };
    if let Some(error) = chunk.get("error") {
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("no message");
        return EventView::Error(message.to_owned());
    }
    if !answer::indexes_are_counts(&chunk) {
        return EventView::Malformed;
    }
    let choices = choices_of(&chunk);
    let usage = usage_of(&chunk);
    EventView::Chunk(Chunk::parsed(chunk, choices, usage))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::format::put_text;
    use canarygate_policies::verify::Part;

    #[test]
    fn an_error_chunk_stands_for_its_status() {
        for (error, status) in [
            (
                json!({"message": "Overloaded", "type": "server_error"}),
                500,
            ),
            (
                json!({"message": "slow down", "code": "rate_limit_exceeded"}),
                429,
            ),
            (
                json!({"message": "bad", "type": "invalid_request_error"}),
                400,
            ),
            // OpenRouter's numeric codes are statuses.
            (
                json!({"message": "Provider returned error", "code": 502}),
                502,
            ),
            (json!({"message": "odd", "code": 42}), 500),
        ] {
            let data = json!({"error": error}).to_string();
            assert_eq!(
                Chat::error_event_status(&data),
                Some(StatusCode::from_u16(status).unwrap()),
                "{data}"
            );
        }
        assert_eq!(Chat::error_event_status(r#"{"choices": []}"#), None);
    }

    #[test]
    fn text_fields_point_at_their_strings() {
        let answer = json!({"choices": [{"index": 0, "message": {
            "content": "hello",
            "tool_calls": [{"function": {"name": "f", "arguments": "{\"a\":1}"}}],
        }, "finish_reason": "stop"}], "usage": {"prompt_tokens": 7, "completion_tokens": "x",
            "prompt_tokens_details": {"cached_tokens": 5}}});
        let view = Chat::read_answer(&answer);
        assert_eq!(view.choices.len(), 1);
        let choice = &view.choices[0];
        assert_eq!(choice.finish_reason.as_deref(), Some("stop"));
        let texts: Vec<&str> = choice
            .texts
            .iter()
            .map(|field| field.text(&answer))
            .collect();
        assert_eq!(texts, ["hello", "{\"a\":1}"]);
        let mut edited = answer.clone();
        put_text(&mut edited, &choice.texts[0], "verified".into());
        assert_eq!(edited["choices"][0]["message"]["content"], "verified");
        assert_eq!(
            edited["choices"][0]["message"]["tool_calls"],
            answer["choices"][0]["message"]["tool_calls"]
        );
        assert_eq!(choice.texts[1].kind, Part::ToolArguments(0), "{choice:?}");
        assert_eq!(
            view.usage,
            Some(ProviderUsage {
                prompt_tokens: 7,
                completion_tokens: None,
                cached_prompt_tokens: Some(5),
            })
        );
        assert_eq!(
            Chat::usage_in(answer.to_string().as_bytes()),
            view.usage,
            "both readings of usage agree"
        );
    }

    #[test]
    fn canary_text_anywhere_in_a_message_is_a_text_field() {
        let canary = "CG123456789012345";
        let answer = json!({"choices": [{"index": 0, "message": {
            "role": "assistant",
            "content": "hi",
            "audio": {"id": "a1", "transcript": format!("said {canary}")},
            "vendor_extension": {"notes": [{"text": format!("[{canary}]")}, {"text": "clean"}]},
            "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": canary}}],
        }, "finish_reason": "stop"}]});
        let view = Chat::read_answer(&answer);
        let others: Vec<&str> = view.choices[0]
            .texts
            .iter()
            .filter(|field| matches!(field.kind, Part::Other(_)))
            .map(|field| field.text(&answer))
            .collect();
        assert_eq!(others, [format!("[{canary}]")]);
        // The transcript of a spoken reply is a text of its own.
        let transcripts: Vec<&str> = view.choices[0]
            .texts
            .iter()
            .filter(|field| field.kind == Part::Transcript)
            .map(|field| field.text(&answer))
            .collect();
        assert_eq!(transcripts, [format!("said {canary}")]);
        // The arguments are read as their own part, once.
        assert_eq!(
            view.choices[0]
                .texts
                .iter()
                .filter(|field| field.text(&answer) == canary)
                .count(),
            1
        );
    }

    #[test]
    fn a_blocked_answer_names_the_failed_checks() {
        let mut error = ApiError::new(
            ErrorCode::VerificationFailed,
            "failed checks: echo, foreign_canary",
        );
        error.failed_checks = vec!["echo", "foreign_canary"];
        let body: Value = serde_json::from_slice(&Chat::error_body(&error)).unwrap();
        assert_eq!(
            body,
            json!({"error": {"message": "failed checks: echo, foreign_canary",
                             "type": "canarygate_verification_failed", "param": null,
                             "code": "canarygate_verification_failed",
                             "failed_checks": ["echo", "foreign_canary"]}})
        );
        // The stream's error event carries the same object.
        let event = String::from_utf8(Chat::error_event(&error)).unwrap();
        let data = event.strip_prefix("data: ").unwrap().trim_end();
        assert_eq!(serde_json::from_str::<Value>(data).unwrap(), body);
        let other: Value =
            serde_json::from_slice(&Chat::error_body(&ApiError::invalid_param("n", "bad n")))
                .unwrap();
        assert_eq!(
            other,
            json!({"error": {"message": "bad n", "type": "invalid_request_error", "param": "n",
                             "code": "invalid_value"}})
        );
    }

    #[test]
    fn canaries_that_cannot_be_placed_are_a_400_about_the_field() {
        let canaries = RequestCanaries::mint();
        for (mut body, param) in [
            (
                json!({"messages": [{"role": "user", "content": 5}]}),
                "messages",
            ),
            (
                json!({"messages": [{"role": "system", "content": 7}, {"role": "user", "content": "hi"}]}),
                "messages",
            ),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "user", "content": "hi"}], "n": 0}),
                "n",
            ),
        ] {
            let before = body.clone();
            let error = Chat::place_canaries(
                &mut body,
                EchoMode::HeadTail,
                EchoCost::DIGIT_BY_DIGIT,
                canaries,
                SystemRole::Accepted,
            )
            .unwrap_err();
            assert_eq!(body, before, "nothing placed on failure");
            assert_eq!(error.code, ErrorCode::InvalidValue, "{error}");
            assert_eq!(error.status(), StatusCode::BAD_REQUEST);
            let wire: Value = serde_json::from_slice(&Chat::error_body(&error)).unwrap();
            assert_eq!(wire["error"]["type"], "invalid_request_error", "{wire}");
            assert_eq!(wire["error"]["code"], "invalid_value", "{wire}");
            assert_eq!(wire["error"]["param"], param, "{wire}");
        }
    }
}
