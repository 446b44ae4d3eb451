//! OpenAI's Responses API (`POST /v1/responses`).
//!
//! Requests are validated only as far as canarygate relies on them
//! ([`request`]): `input` as a string or a list of items, `instructions`,
//! `max_output_tokens`, `stream`; every other field passes through for the
//! provider to judge. The head block goes at the end of `instructions`,
//! the tail block at the end of the last user item's text (both there when
//! earlier turns come before it, in `input` or in a kept conversation the
//! request continues; both at the end of a tool loop's newest output, when
//! they are passive markers); `text.format`
//! JSON and tools get passive checks. A request that continues a
//! conversation the provider keeps (`previous_response_id`,
//! `conversation`) asks for the head alone (earlier turns' tail blocks are
//! in that context), and canaries of the caller's own session found in the
//! answer are its earlier turns', removed, not foreign.
//!
//! Text is read from the `output` items ([`answer`]): messages'
//! `output_text` and `refusal` parts, reasoning summaries and texts,
//! function-call arguments, and any other canary-shaped string; streamed,
//! from the typed delta events, or from the event that repeats a text no
//! delta carried ([`repeated`]). The client gets the provider's own
//! response and events, edited ([`deliver`], [`stream`]): the echo and
//! canaries removed, a cut at the client's `max_output_tokens` made
//! `incomplete`, the repeated `instructions` and `max_output_tokens` the
//! client's own. Errors are OpenAI's `{"error": {...}}`; in a stream, an
//! `error` event ([`error`]). The local engine's answers are translated
//! ([`local`]).

mod answer;
mod deliver;
mod error;
mod light;
mod local;
mod repeated;
mod request;
mod stored;
mod stream;

use std::borrow::Cow;
use std::ops::Range;

use axum::http::StatusCode;
use canarygate_policies::EchoCost;
use canarygate_policies::config::ProviderApi;
use canarygate_policies::inject::{Injection, RequestCanaries, SystemRole};
use canarygate_policies::sse::{SseEvent, encode_json};
use canarygate_policies::verify::{ProviderUsage, Verifier};
use canarygate_policies::verify_config::EchoMode;
use serde::Deserialize;
use serde_json::{Value, json};

use self::answer::{finish_of, response_texts, usage_of};
use self::error::error_event_json;
pub use self::local::ResponsesLocal;
pub use self::stored::scrub as scrub_stored_response;
pub use self::stream::ResponsesStream;
use crate::error::ApiError;
use crate::wire::chat::{OPENAI_HEADERS, error_json, error_status};
use crate::wire::edit::Delivery;
use crate::wire::format::{
    AnswerView, ChoiceView, ClientRequest, EventView, StreamMemo, WireFormat,
};

/// OpenAI's Responses API.
pub struct Responses;

impl WireFormat for Responses {
    type StreamWriter = ResponsesStream;
    type LocalStream = ResponsesLocal;

    const ENDPOINT: &'static str = "responses";
    const PATH: &'static str = "responses";
    const API: ProviderApi = ProviderApi::Openai;
    const FORWARDED_HEADERS: &'static [&'static str] = &OPENAI_HEADERS;
    const PROMPT_PARAM: &'static str = "input";
    const LIMIT_PARAM: &'static str = "max_output_tokens";

    fn parse_request(bytes: &[u8]) -> Result<ClientRequest, ApiError> {
        request::parse(bytes)
    }

    fn set_model(body: &mut Value, model: &str) {
        body["model"] = json!(model);
    }

    fn prompt_messages(body: &Value) -> Cow<'_, [Value]> {
        Cow::Owned(request::chat_messages(body))
    }

    fn carries_earlier_canaries(body: &Value) -> bool {
        request::continues_stored_conversation(body)
    }

    fn place_canaries(
        body: &mut Value,
        echo: EchoMode,
        cost: EchoCost,
        canaries: RequestCanaries,
        _system_role: SystemRole,
    ) -> Result<Injection, ApiError> {
        request::place(body, echo, cost, canaries)
    }

    fn read_answer(answer: &Value) -> AnswerView {
        AnswerView {
            choices: smallvec::smallvec![ChoiceView {
                index: 0,
                position: 0,
                texts: response_texts(answer),
                finish_reason: finish_of(answer),
            }],
            usage: usage_of(answer),
        }
    }

    fn usage_in(answer: &[u8]) -> Option<ProviderUsage> {
        /// Just `usage` of a response; the rest is skipped unparsed.
        #[derive(Deserialize)]
        struct UsageOnly {
            usage: Option<Value>,
        }
        let usage = serde_json::from_slice::<UsageOnly>(answer).ok()?.usage?;
        usage_of(&json!({ "usage": usage }))
    }

    fn read_event(event: &SseEvent) -> EventView {
        stream::read_event(event)
    }

    fn read_stream_event(event: &SseEvent, memo: &mut StreamMemo) -> EventView {
        let mut view = stream::read_event(event);
        if let EventView::Chunk(chunk) = &mut view
            && !chunk.is_light()
        {
            let kind = answer::event_type(&chunk.event, event).to_owned();
            repeated::read_undelivered(chunk, &kind, memo);
        }
        view
    }

    fn is_end_marker(event: &SseEvent) -> bool {
        answer::is_end(event)
    }

    fn stream_writer(delivery: Delivery) -> ResponsesStream {
        ResponsesStream::new(delivery)
    }

    fn deliver_answer(
        answer: &mut Value,
        view: &AnswerView,
        spans: &[Range<usize>],
        verifier: &Verifier,
        delivery: &mut Delivery,
    ) {
        deliver::deliver_answer(answer, view, spans, verifier, delivery);
    }

    fn is_error_body(body: &[u8]) -> bool {
        // An `error` object and no response around it.
        serde_json::from_slice::<Value>(body).is_ok_and(|value| {
            value.get("error").is_some_and(Value::is_object)
                && error::error_body_of(&value).is_some()
        })
    }

    fn error_event_status(data: &str) -> Option<StatusCode> {
        let value: Value = serde_json::from_str(data).ok()?;
        error_status(&error::error_body_of(&value)?)
    }

    fn error_event_body(data: &str) -> Vec<u8> {
        serde_json::from_str::<Value>(data)
            .ok()
            .and_then(|value| error::error_body_of(&value))
            .map_or_else(
                || data.as_bytes().to_vec(),
                |body| body.to_string().into_bytes(),
            )
    }

    fn error_body(error: &ApiError) -> Vec<u8> {
        error_json(error).to_string().into_bytes()
    }

    fn error_event(error: &ApiError) -> Vec<u8> {
        let mut event = b"event: error\n".to_vec();
        encode_json(&error_event_json(error), &mut event);
        event
    }

    fn local_request(body: &Value) -> Result<Value, ApiError> {
        local::local_request(body)
    }

    fn local_answer(chat: Value, request: &Value) -> Value {
        local::local_answer(&chat, request)
    }

    fn local_stream(request: &Value, _prompt_tokens: u64) -> ResponsesLocal {
        ResponsesLocal::new(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn errors_are_openais_and_the_stream_event_raises_in_the_sdk() {
        let error = ApiError::invalid_param("input", "bad input");
        let body: Value = serde_json::from_slice(&Responses::error_body(&error)).unwrap();
        assert_eq!(
            body,
            json!({"error": {"message": "bad input", "type": "invalid_request_error",
                             "param": "input", "code": "invalid_value"}})
        );
        assert!(Responses::is_error_body(&Responses::error_body(&error)));
        let failed = ApiError::new(ErrorCode::UpstreamStreamInterrupted, "cut off");
        let event = String::from_utf8(Responses::error_event(&failed)).unwrap();
        let (name, data) = event.split_once('\n').unwrap();
        assert_eq!(name, "event: error");
        let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
        // The Responses event's own fields, and the `error` object the SDK
        // raises on.
        assert_eq!(data["type"], "error");
        assert_eq!(data["code"], "upstream_stream_interrupted");
        assert_eq!(data["message"], "cut off");
        assert_eq!(data["error"], error_json(&failed)["error"]);
    }

    #[test]
    fn a_providers_error_event_or_body_is_an_answer_with_its_status() {
        // The stream's `error` event: OpenAI's error body, its code the
        // status it stands for.
        let event = r#"{"type":"error","sequence_number":1,"code":"server_error","message":"boom","param":null}"#;
        assert_eq!(
            Responses::error_event_status(event),
            Some(StatusCode::INTERNAL_SERVER_ERROR)
        );
        let body: Value = serde_json::from_slice(&Responses::error_event_body(event)).unwrap();
        assert_eq!(body["error"]["message"], "boom");
        assert_eq!(body["error"]["code"], "server_error");
        assert!(Responses::is_error_body(&Responses::error_event_body(
            event
        )));
        let limited = r#"{"type":"error","code":"rate_limit_exceeded","message":"slow down"}"#;
        assert_eq!(
            Responses::error_event_status(limited),
            Some(StatusCode::TOO_MANY_REQUESTS)
        );
        let refused = r#"{"type":"error","code":"invalid_prompt","message":"flagged"}"#;
        assert_eq!(
            Responses::error_event_status(refused),
            Some(StatusCode::BAD_REQUEST)
        );
        // An error body a gateway sent with a 2xx: its own, as it came.
        let body =
            r#"{"error":{"message":"m","type":"invalid_request_error","param":null,"code":null}}"#;
        assert_eq!(
            Responses::error_event_status(body),
            Some(StatusCode::BAD_REQUEST)
        );
        assert_eq!(Responses::error_event_body(body), body.as_bytes());
        // Anything else is no error, a failed response included.
        assert_eq!(
            Responses::error_event_status(r#"{"type":"response.created"}"#),
            None
        );
        let failed = r#"{"object":"response","status":"failed","error":{"code":"server_error"}}"#;
        assert_eq!(Responses::error_event_status(failed), None);
    }
}
