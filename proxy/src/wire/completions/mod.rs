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

use canarygate_policies::config::ProviderApi;
use canarygate_policies::inject::{Injection, RequestCanaries};
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
        canaries: RequestCanaries,
    ) -> Result<Injection, ApiError> {
        request::place(body, echo, canaries)
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

    fn local_stream(request: &Value) -> CompletionsLocal {
        CompletionsLocal::new(request)
    }
}
