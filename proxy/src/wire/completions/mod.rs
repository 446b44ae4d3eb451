//! OpenAI's legacy completions (`POST /v1/completions`): a raw text prompt,
//! or a list of them, continued by the model.
//!
//! Requests are validated only as far as canarygate relies on them
//! ([`request`]): `prompt` a string, a list of strings, token ids or lists
//! of token ids; `n`, `max_tokens` (16 when absent, OpenAI's default),
//! `best_of`, `logprobs`, `echo`, `suffix`, `stream`; everything else passes
//! through for the provider to judge.
//!
//! Where the canaries go. A plain prompt has no system slot, and the prompt
//! cache of a provider matches prefixes, so the client's prompt stays a
//! byte-identical prefix and canarygate's text follows it: each prompt
//! becomes `PROMPT`, a blank line, the head instruction (`Begin your reply
//! with "HEAD", a space and the CG code in square brackets below…`), a blank
//! line, the tail block `[TAIL]`, and a closing blank line. An
//! instruction-following completion model (gpt-3.5-turbo-instruct and its
//! kind) reads the instruction last, right where its answer starts, and
//! opens the completion with the echo; the closing blank line puts that
//! answer on a line of its own. Each prompt of a list gets the same blocks,
//! so each of the `len(prompt) × n` choices (indexed prompt-major) must
//! echo. What cannot carry canaries is refused with a 400 naming the field:
//! token-id prompts (`prompt`), and `echo: true` (`echo`), which would hand
//! the prompt back with the canaries and their instruction in it. A
//! `suffix` passes untouched: the completion is generated between the
//! blocks and it.
//!
//! Answers: `choices[i].text` is choice `index`'s content ([`answer`]); the
//! client gets the provider's own answer and chunks, edited where their
//! text changed ([`deliver`]: the echo and canaries removed, the text cut
//! at the client's `max_tokens` with `finish_reason: "length"`; legacy
//! logprobs follow the text, [`logprobs`]). A stream's chunks are held until
//! verified by Chat Completions' writer ([`ChatStream`]) with this format's
//! editing; it ends with `data: [DONE]`. Errors are OpenAI's
//! ([`crate::wire::chat::error_json`]). The local engine serves a single
//! prompt ([`local`]).

mod answer;
mod deliver;
mod local;
mod logprobs;
mod request;

use std::borrow::Cow;
use std::ops::Range;

use axum::http::StatusCode;
use canarygate_policies::EchoCost;
use canarygate_policies::config::ProviderApi;
use canarygate_policies::inject::{Injection, RequestCanaries, SystemRole};
use canarygate_policies::sse::SseEvent;
use canarygate_policies::verify::{ProviderUsage, Verifier};
use canarygate_policies::verify_config::EchoMode;
use serde_json::{Value, json};

use self::deliver::TextEdits;
use self::local::CompletionsLocal;
use crate::error::ApiError;
use crate::wire::chat::{Chat, ChatStream, OPENAI_HEADERS};
use crate::wire::edit::Delivery;
use crate::wire::format::{AnswerView, ClientRequest, EventView, WireFormat};

/// OpenAI's legacy completions.
pub struct Completions;

impl WireFormat for Completions {
    type StreamWriter = ChatStream<TextEdits>;
    type LocalStream = CompletionsLocal;

    const ENDPOINT: &'static str = "completions";
    const PATH: &'static str = "completions";
    const API: ProviderApi = ProviderApi::Openai;
    const FORWARDED_HEADERS: &'static [&'static str] = &OPENAI_HEADERS;
    const PROMPT_PARAM: &'static str = "prompt";
    const LIMIT_PARAM: &'static str = "max_tokens";

    fn parse_request(bytes: &[u8]) -> Result<ClientRequest, ApiError> {
        request::parse(bytes)
    }

    fn set_model(body: &mut Value, model: &str) {
        body["model"] = json!(model);
    }

    fn prompt_messages(body: &Value) -> Cow<'_, [Value]> {
        Cow::Owned(request::messages(body))
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
        answer::read_answer(answer)
    }

    fn usage_in(answer: &[u8]) -> Option<ProviderUsage> {
        Chat::usage_in(answer)
    }

    fn read_event(event: &SseEvent) -> EventView {
        answer::read_event(event)
    }

    fn is_end_marker(event: &SseEvent) -> bool {
        event.is_done()
    }

    fn stream_writer(delivery: Delivery) -> Self::StreamWriter {
        ChatStream::with_editor(delivery, TextEdits::default())
    }

    fn deliver_answer(
        answer: &mut Value,
        view: &AnswerView,
        spans: &[Range<usize>],
        verifier: &Verifier,
        delivery: &mut Delivery,
    ) {
        let fields: Vec<_> = view
            .choices
            .iter()
            .flat_map(|choice| &choice.texts)
            .copied()
            .zip(spans.iter().cloned())
            .collect();
        TextEdits::default().edit_fields(answer, &view.choices, &fields, verifier, delivery);
        if let Some(usage) = answer.get_mut("usage").filter(|usage| usage.is_object()) {
            delivery.report_usage(usage);
        }
    }

    fn is_error_body(body: &[u8]) -> bool {
        Chat::is_error_body(body)
    }

    fn error_event_status(data: &str) -> Option<StatusCode> {
        Chat::error_event_status(data)
    }

    fn error_body(error: &ApiError) -> Vec<u8> {
        Chat::error_body(error)
    }

    fn error_event(error: &ApiError) -> Vec<u8> {
        Chat::error_event(error)
    }

    fn local_request(body: &Value) -> Result<Value, ApiError> {
        local::request(body)
    }

    fn local_answer(chat: Value, request: &Value) -> Value {
        local::answer(chat, request)
    }

    fn local_stream(request: &Value, _prompt_tokens: u64) -> CompletionsLocal {
        CompletionsLocal::new(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;
    use crate::wire::StreamWriter;
    use crate::wire::edit::{TokenCounter, UsageOptions};
    use canarygate_policies::registry::MemoryRegistry;
    use canarygate_policies::verify::{Facts, Part};
    use canarygate_policies::verify_config::VerifyConfig;

    /// A request placed, its verifier and delivery.
    fn placed(body: Value) -> (Injection, Verifier, Delivery) {
        let mut body = body;
        let canaries = RequestCanaries::mint();
        let injection = Completions::place_canaries(
            &mut body,
            EchoMode::HeadTail,
            EchoCost::DIGIT_BY_DIGIT,
            canaries,
            SystemRole::Accepted,
        )
        .unwrap();
        let verifier = Verifier::new(&injection, &VerifyConfig::default(), "sim", None);
        let usage = UsageOptions {
            client_wants_usage: injection.client_wants_usage,
            without_canarygate: true,
            overhead_prompt: injection.prompt_tokens_added,
        };
        let delivery = Delivery::new(
            TokenCounter::default(),
            injection.client_max_tokens,
            usage,
            injection.choices,
        )
        .with_prompt_chars_appended(injection.prompt_chars_appended.clone());
        (injection, verifier, delivery)
    }

    /// Legacy logprobs of `tokens`, offsets from `base`.
    fn logprobs(tokens: &[&str], base: usize) -> Value {
        let mut offsets = Vec::new();
        let mut at = base;
        for token in tokens {
            offsets.push(at);
            at += token.chars().count();
        }
        json!({"tokens": tokens, "token_logprobs": vec![-0.5; tokens.len()],
               "top_logprobs": tokens.iter().map(|token| json!({*token: -0.5})).collect::<Vec<_>>(),
               "text_offset": offsets})
    }

    #[test]
    fn a_whole_answer_loses_the_echo_in_every_choice_and_is_cut_at_the_clients_limit() {
        let (injection, mut verifier, mut delivery) = placed(json!({"model": "m",
            "prompt": ["Hello", "Count"], "max_tokens": 3, "logprobs": 1}));
        let echo = format!("{} {}", injection.canaries.head, injection.canaries.tail);
        let first = [echo.as_str(), "\n", "Hi", " there"];
        // The provider counts offsets from the start of the prompt it got.
        let sent_prompt = "Hello".len() + injection.prompt_chars_appended[0];
        let mut answer = json!({"id": "cmpl-1", "object": "text_completion", "choices": [
            {"index": 0, "text": first.concat(), "logprobs": logprobs(&first, sent_prompt),
             "finish_reason": "stop"},
            {"index": 1, "text": format!("{echo} one two six ten"), "logprobs": null,
             "finish_reason": "stop"},
        ], "usage": {"prompt_tokens": 90, "completion_tokens": 20, "total_tokens": 110}});
        let view = Completions::read_answer(&answer);
        let registry = MemoryRegistry::new(b"secret");
        let mut spans = crate::wire::Spans::new();
        for field in view.choices.iter().flat_map(|choice| &choice.texts) {
            let text = field.text(&answer);
            let start = verifier.received(field.choice, field.kind);
            spans.push(start..start + text.len());
            verifier.push_part_positions(field.choice, field.kind, text, &registry);
        }
        let finished = verifier.finish(
            &Facts {
                finish_reasons: vec![Some("stop".into()), Some("stop".into())],
                usage: view.usage,
                done_marker: None,
            },
            &registry,
        );
        assert!(finished.verdict.passed(), "{:?}", finished.verdict);
        // The tokens in `top_logprobs` are members' names: read, not
        // delivered.
        let mut view = view;
        crate::wire::drop_read_only(&mut view.choices, &mut spans);
        Completions::deliver_answer(&mut answer, &view, &spans, &verifier, &mut delivery);
        let choices = &answer["choices"];
        assert_eq!(choices[0]["text"], "Hi there");
        assert_eq!(choices[0]["finish_reason"], "stop");
        let probs = &choices[0]["logprobs"];
        assert_eq!(probs["tokens"], json!(["Hi", " there"]));
        // canarygate's blocks, the echo and its line break came out: "Hi"
        // follows the client's own prompt, as the client sent it.
        assert_eq!(probs["text_offset"], json!([5, 7]));
        assert_eq!(choices[1]["text"], "one two six ");
        assert_eq!(
            choices[1]["finish_reason"], "length",
            "cut at the client's 3 tokens"
        );
        assert!(answer["usage"]["completion_tokens"].as_u64().unwrap() < 20);
    }

    #[test]
    fn a_stream_is_held_until_verified_and_the_echo_chunks_are_dropped() {
        let (injection, mut verifier, delivery) = placed(json!({"model": "m",
            "prompt": "Hello", "stream": true}));
        let mut writer = Completions::stream_writer(delivery);
        let registry = MemoryRegistry::new(b"secret");
        let echo = format!("{} {} ", injection.canaries.head, injection.canaries.tail);
        let chunk = |text: &str, finish: Value, probs: Value| {
            json!({"id": "cmpl-2", "object": "text_completion", "model": "m",
                   "choices": [{"index": 0, "text": text, "logprobs": probs,
                                "finish_reason": finish}]})
            .to_string()
        };
        // The provider counts offsets from the start of the prompt it got.
        let offset = "Hello".len() + injection.prompt_chars_appended[0];
        let events = [
            chunk(&echo, Value::Null, logprobs(&[echo.as_str()], offset)),
            chunk("Hi", Value::Null, logprobs(&["Hi"], offset + echo.len())),
            chunk("", json!("stop"), Value::Null),
            json!({"id": "cmpl-2", "object": "text_completion", "choices": [],
                   "usage": {"prompt_tokens": 60, "completion_tokens": 12, "total_tokens": 72}})
            .to_string(),
        ];
        let mut out = Vec::new();
        for data in &events {
            let event = SseEvent {
                data: data.clone(),
                ..SseEvent::default()
            };
            let EventView::Chunk(chunk) = Completions::read_event(&event) else {
                panic!("a chunk: {data}");
            };
            let mut spans = crate::wire::Spans::new();
            for field in chunk.texts() {
                let text = field.text(&chunk.event);
                let start = verifier.received(field.choice, field.kind);
                spans.push(start..start + text.len());
                verifier.push_part_positions(field.choice, field.kind, text, &registry);
            }
            // The token in `top_logprobs` is a member's name: read, not
            // delivered.
            let mut chunk = chunk;
            crate::wire::drop_read_only(&mut chunk.choices, &mut spans);
            writer.take(chunk, event, spans);
            writer.flush(&verifier, false, &mut out);
        }
        let finished = verifier.finish(
            &Facts {
                finish_reasons: vec![Some("stop".into())],
                usage: None,
                done_marker: Some(true),
            },
            &registry,
        );
        writer.flush(&verifier, true, &mut out);
        out.extend(writer.done(&finished.verdict));
        let text = String::from_utf8(out).unwrap();
        let data: Vec<Value> = text
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .filter(|data| *data != "[DONE]")
            .map(|data| serde_json::from_str(data).unwrap())
            .collect();
        assert_eq!(
            data.len(),
            2,
            "the echo chunk and the unasked usage chunk go: {text}"
        );
        assert_eq!(data[0]["choices"][0]["text"], "Hi");
        assert_eq!(
            data[0]["choices"][0]["logprobs"]["text_offset"],
            json!(["Hello".len()])
        );
        assert_eq!(data[1]["choices"][0]["finish_reason"], "stop");
        assert!(text.ends_with("data: [DONE]\n\n"));
        assert!(!text.contains(&injection.canaries.head.to_string()));
    }

    #[test]
    fn errors_are_openai_shaped() {
        let error = ApiError::invalid_param("prompt", "bad prompt");
        let body: Value = serde_json::from_slice(&Completions::error_body(&error)).unwrap();
        assert_eq!(
            body,
            json!({"error": {"message": "bad prompt", "type": "invalid_request_error",
                             "param": "prompt", "code": "invalid_value"}})
        );
        assert!(Completions::is_error_body(&Completions::error_body(&error)));
        let error = ApiError::new(ErrorCode::UpstreamStreamInterrupted, "cut");
        let event = String::from_utf8(Completions::error_event(&error)).unwrap();
        assert!(event.starts_with("data: {\"error\""), "{event}");
        assert_eq!(
            Completions::read_answer(&json!({"choices": [{"text": "x", "index": 0}]})).choices[0]
                .texts[0]
                .kind,
            Part::Content
        );
    }
}
