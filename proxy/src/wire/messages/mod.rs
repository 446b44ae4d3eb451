//! Anthropic's Messages API (`POST /v1/messages`), served to providers
//! declared `api = "anthropic"`.
//!
//! Requests are validated as far as canarygate relies on them
//! ([`request`]): `model`, `max_tokens` (required, as Anthropic requires
//! it), `messages` with string or block content, `system` as a string or
//! text blocks, `stream`, `thinking`, `tools`; every other field passes
//! through. The head canary goes after the client's system text, the tail
//! after the last user turn's content (both there when the client's stable
//! prefix runs past its system text: earlier turns, a cache breakpoint in a
//! turn, a tool loop's results), as new text blocks where the content is
//! blocks. A whole answer's content blocks are read as one
//! choice ([`answer`]); a stream's events are read and held until verified
//! ([`stream`]). The client gets the provider's own answer and events,
//! edited where their text changed ([`deliver`]). Errors are Anthropic's
//! `{"type":"error","error":{"type","message"}}` with canarygate's own
//! `code` beside them ([`error`]). The local engine's answers are
//! translated into messages and Messages events ([`local`]).
//!
//! Longer than 500 lines: about 500 of them are the unit tests of the
//! format as a whole (a stream relayed end to end, an emptied block dropped,
//! strings read wherever a stream puts them, the allocation budget);
//! the code is the first 140.

mod answer;
mod deliver;
mod error;
mod light;
mod local;
mod request;
mod stream;

use std::borrow::Cow;
use std::ops::Range;

use axum::http::StatusCode;
use canarygate_policies::EchoCost;
use canarygate_policies::config::ProviderApi;
use canarygate_policies::inject::{Injection, RequestCanaries, SystemRole};
use canarygate_policies::sse::SseEvent;
use canarygate_policies::verify::{ProviderUsage, Verifier};
use canarygate_policies::verify_config::EchoMode;
use serde::Deserialize;
use serde_json::{Value, json};

use self::local::MessagesLocal;
use self::stream::MessagesStream;
use crate::error::ApiError;
use crate::wire::edit::Delivery;
use crate::wire::format::{AnswerView, ClientRequest, EventView, StreamMemo, WireFormat};

/// Anthropic's Messages API.
pub struct Messages;

impl WireFormat for Messages {
    type StreamWriter = MessagesStream;
    type LocalStream = MessagesLocal;

    const ENDPOINT: &'static str = "messages";
    const PATH: &'static str = "messages";
    const API: ProviderApi = ProviderApi::Anthropic;
    const FORWARDED_HEADERS: &'static [&'static str] = &["anthropic-version", "anthropic-beta"];
    const PROMPT_PARAM: &'static str = "messages";
    const LIMIT_PARAM: &'static str = "max_tokens";

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
        request::replays_thinking(body)
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
        answer::read(answer)
    }

    fn usage_in(answer: &[u8]) -> Option<ProviderUsage> {
        /// Just `usage` of a message; the rest is skipped unparsed.
        #[derive(Deserialize)]
        struct UsageOnly {
            usage: Option<Value>,
        }
        answer::usage_of(
            serde_json::from_slice::<UsageOnly>(answer)
                .ok()?
                .usage
                .as_ref(),
        )
    }

    fn read_event(event: &SseEvent) -> EventView {
        stream::read_event(event)
    }

    /// [`stream::read_event`], each `message_delta`'s output count (alone
    /// in its usage, as Anthropic sends it) completed with the prompt's
    /// that `message_start` reported: the answer's count, which says at the
    /// end whether text held for the client's limit fits.
    fn read_stream_event(event: &SseEvent, memo: &mut StreamMemo) -> EventView {
        let mut view = stream::read_event(event);
        if let EventView::Chunk(chunk) = &mut view {
            match chunk.usage {
                Some(usage) if usage.completion_tokens.is_none() => {
                    memo.opening_usage = Some(usage);
                }
                Some(_) => {}
                None => {
                    let output = chunk
                        .event
                        .get("usage")
                        .and_then(|usage| usage.get("output_tokens"))
                        .and_then(Value::as_u64);
                    if let (Some(opening), Some(output)) = (memo.opening_usage, output) {
                        chunk.usage = Some(ProviderUsage {
                            completion_tokens: Some(output),
                            ..opening
                        });
                    }
                }
            }
        }
        view
    }

    fn is_end_marker(event: &SseEvent) -> bool {
        stream::is_end_marker(event)
    }

    fn stream_writer(delivery: Delivery) -> MessagesStream {
        MessagesStream::new(delivery)
    }

    fn deliver_answer(
        answer: &mut Value,
        view: &AnswerView,
        spans: &[Range<usize>],
        verifier: &Verifier,
        delivery: &mut Delivery,
    ) {
        deliver::deliver(answer, view, spans, verifier, delivery);
    }

    fn is_error_body(body: &[u8]) -> bool {
        error::is_error_body(body)
    }

    fn error_event_status(data: &str) -> Option<StatusCode> {
        let value: Value = serde_json::from_str(data).ok()?;
        error::is_error_value(&value)
            .then(|| error::status_of_type(value["error"]["type"].as_str().unwrap_or("")))
    }

    fn error_body(error: &ApiError) -> Vec<u8> {
        error::error_json(error).to_string().into_bytes()
    }

    fn error_event(error: &ApiError) -> Vec<u8> {
        error::error_event(error)
    }

    fn local_request(body: &Value) -> Result<Value, ApiError> {
        local::request(body)
    }

    fn local_answer(chat: Value, request: &Value) -> Value {
        local::answer(chat, request)
    }

    fn local_stream(_request: &Value, prompt_tokens: u64) -> MessagesLocal {
        MessagesLocal::new(prompt_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use canarygate_policies::inject::obedient_echo;
    use canarygate_policies::registry::MemoryRegistry;
    use canarygate_policies::sse::SseParser;
    use canarygate_policies::verify::{Facts, Part, Verdict};
    use canarygate_policies::verify_config::VerifyConfig;

    use crate::wire::StreamWriter;
    use crate::wire::edit::{TokenCounter, UsageOptions};
    use crate::wire::format::{ChoiceView, Chunk, Spans, TextSource};

    /// What an echo is costed at in these tests: a token per digit.
    const COST: EchoCost = EchoCost::DIGIT_BY_DIGIT;

    /// A request with canaries placed, its injection, and the opening an
    /// obedient model writes.
    fn placed(body: Value) -> (Value, Injection, String) {
        let mut body = Messages::parse_request(body.to_string().as_bytes())
            .unwrap()
            .body;
        let canaries = RequestCanaries::mint();
        let injection = Messages::place_canaries(
            &mut body,
            EchoMode::HeadTail,
            COST,
            canaries,
            SystemRole::Accepted,
        )
        .unwrap();
        let opening = obedient_echo(&json!({"messages": request::chat_messages(&body)})).unwrap();
        (body, injection, opening)
    }

    fn delivery(injection: &Injection) -> Delivery {
        Delivery::new(
            TokenCounter::default(),
            injection.client_max_tokens,
            UsageOptions {
                client_wants_usage: true,
                without_canarygate: true,
                overhead_prompt: injection.prompt_tokens_added,
            },
            1,
        )
    }

    /// Pushes every text field of `choices` (read from `value`) to the
    /// verifier as the verified path does; returns each field's span.
    fn feed(verifier: &mut Verifier, choices: &[ChoiceView], value: &impl TextSource) -> Spans {
        let registry = MemoryRegistry::new(b"test");
        let mut spans = Spans::new();
        for field in choices.iter().flat_map(|choice| &choice.texts) {
            let text = value.text_of(field);
            let start = verifier.received(field.choice, field.kind);
            spans.push(start..start + text.len());
            if !text.is_empty() {
                verifier.push_part_positions(field.choice, field.kind, text, &registry);
            }
        }
        spans
    }

    fn finish(verifier: &mut Verifier, reason: &str, usage: Option<ProviderUsage>) -> Verdict {
        let facts = Facts {
            finish_reasons: vec![Some(reason.to_owned())],
            usage,
            done_marker: Some(true),
        };
        let verdict = verifier
            .finish(&facts, &MemoryRegistry::new(b"test"))
            .verdict;
        assert!(verdict.passed(), "{}", verdict.header_value());
        verdict
    }

    fn request(max_tokens: u64, stream: bool) -> Value {
        json!({"model": "claude", "max_tokens": max_tokens, "stream": stream,
               "system": [{"type": "text", "text": "Be brief."}],
               "messages": [{"role": "user", "content": "Name the planets"}]})
    }

    #[test]
    fn a_whole_answer_is_delivered_edited_in_place() {
        let (_, injection, opening) = placed(request(200, false));
        let prompt = injection.prompt_tokens_estimate;
        let mut answer = json!({"id": "msg_1", "type": "message", "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "The planets.", "signature": "c2ln"},
                {"type": "text", "text": format!("{opening}\nMercury, Venus.")},
            ],
            "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": prompt - 5, "cache_read_input_tokens": 5,
                      "output_tokens": 20}});
        let view = Messages::read_answer(&answer);
        assert_eq!(view.usage.unwrap().prompt_tokens, prompt);
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let spans = feed(&mut verifier, &view.choices, &answer);
        finish(&mut verifier, "stop", view.usage);
        let mut delivery = delivery(&injection);
        Messages::deliver_answer(&mut answer, &view, &spans, &verifier, &mut delivery);
        assert_eq!(answer["content"][1]["text"], "Mercury, Venus.");
        assert_eq!(
            answer["content"][0],
            json!({"type": "thinking", "thinking": "The planets.", "signature": "c2ln"})
        );
        assert_eq!(answer["stop_reason"], "end_turn");
        let usage = &answer["usage"];
        assert_eq!(
            usage["input_tokens"],
            (prompt - 5).saturating_sub(injection.prompt_tokens_added)
        );
        assert!(usage["output_tokens"].as_u64().unwrap() < 20, "{usage}");
        assert_eq!(usage["cache_read_input_tokens"], 5);
    }

    #[test]
    fn an_answer_past_the_clients_limit_is_cut_and_stops_for_max_tokens() {
        let (body, injection, opening) = placed(request(3, false));
        assert_eq!(body["max_tokens"], 3 + injection.echo_allowance);
        assert_eq!(injection.echo_allowance, COST.allowance(2));
        let mut answer = json!({"type": "message", "content": [
            {"type": "text", "text": format!("{opening} one two six ten and more words")}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": injection.prompt_tokens_estimate, "output_tokens": 30}});
        let view = Messages::read_answer(&answer);
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let spans = feed(&mut verifier, &view.choices, &answer);
        finish(&mut verifier, "stop", view.usage);
        let mut delivery = delivery(&injection);
        Messages::deliver_answer(&mut answer, &view, &spans, &verifier, &mut delivery);
        assert_eq!(answer["content"][0]["text"], "one two six ");
        assert_eq!(answer["stop_reason"], "max_tokens");
    }

    #[test]
    fn a_streams_other_strings_are_verified_wherever_they_are() {
        let canary = "CG123456789012345";
        for (name, data, text) in [
            (
                "message_start",
                json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
                    "role": "assistant", "content": [], "note": format!("see {canary}"),
                    "usage": {"input_tokens": 5, "output_tokens": 1}}}),
                format!("see {canary}"),
            ),
            (
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0, "note": format!("[{canary}]")}),
                format!("[{canary}]"),
            ),
            (
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn",
                    "note": canary}, "usage": {"output_tokens": 9}}),
                canary.to_owned(),
            ),
            (
                "ping",
                json!({"type": "ping", "note": format!("x{canary}")}),
                format!("x{canary}"),
            ),
        ] {
            let EventView::Chunk(chunk) = Messages::read_event(&sse(name, data)) else {
                panic!("{name}: a chunk");
            };
            let read: Vec<(Part, &str)> = chunk
                .texts()
                .map(|field| (field.kind, field.text(&chunk.event)))
                .collect();
            assert_eq!(read, [(Part::Other(0), text.as_str())], "{name}");
        }
        // An event's name goes out as it came: one holding a canary is no
        // event of a stream.
        let named = sse(
            &format!("content_block_delta {canary}"),
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": "hi"}}),
        );
        assert!(matches!(Messages::read_event(&named), EventView::Malformed));
        // A block named by anything but a count is no block SDKs and
        // canarygate would both read as the same.
        for index in [json!(-1), json!("1"), json!(0.5), Value::Null] {
            let data = json!({"type": "content_block_delta", "index": index,
                              "delta": {"type": "text_delta", "text": "hi"}});
            let event = sse("content_block_delta", data);
            assert!(
                matches!(Messages::read_event(&event), EventView::Malformed),
                "{index}"
            );
        }
    }

    fn sse(name: &str, data: Value) -> SseEvent {
        SseEvent {
            event: Some(name.to_owned()),
            data: data.to_string(),
            id: None,
        }
    }

    /// A provider's stream answering with `opening` then `text` in two
    /// text deltas, after a thinking block.
    fn provider_stream(opening: &str, text: &str, input_tokens: u64) -> Vec<SseEvent> {
        vec![
            sse(
                "message_start",
                json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
                  "role": "assistant", "content": [], "stop_reason": null,
                  "usage": {"input_tokens": input_tokens, "output_tokens": 1}}}),
            ),
            sse(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
            ),
            sse("ping", json!({"type": "ping"})),
            sse(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "thinking_delta", "thinking": "Planets."}}),
            ),
            sse(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "signature_delta", "signature": "c2ln"}}),
            ),
            sse(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0}),
            ),
            sse(
                "content_block_start",
                json!({"type": "content_block_start", "index": 1,
                       "content_block": {"type": "text", "text": ""}}),
            ),
            sse(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1,
                       "delta": {"type": "text_delta", "text": format!("{opening}\n")}}),
            ),
            sse(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1,
                       "delta": {"type": "text_delta", "text": text}}),
            ),
            sse(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 1}),
            ),
            sse(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn",
                       "stop_sequence": null}, "usage": {"output_tokens": 25}}),
            ),
            sse("message_stop", json!({"type": "message_stop"})),
        ]
    }

    #[test]
    fn a_stream_is_held_until_the_echo_and_delivered_with_every_block() {
        let (_, injection, opening) = placed(request(200, true));
        let events = provider_stream(&opening, "Mercury.", injection.prompt_tokens_estimate);
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let mut writer = Messages::stream_writer(delivery(&injection));
        let mut out = Vec::new();
        let mut usage = None;
        let mut verdict = None;
        for (position, event) in events.into_iter().enumerate() {
            let chunk: Chunk = match Messages::read_event(&event) {
                EventView::Chunk(chunk) => chunk,
                EventView::Done => {
                    assert_eq!(position, 11, "message_stop ends the stream");
                    verdict = Some(finish(&mut verifier, "stop", usage));
                    writer.flush(&verifier, true, &mut out);
                    break;
                }
                other => panic!("{other:?}"),
            };
            usage = chunk.usage.or(usage);
            let spans = feed(&mut verifier, &chunk.choices, &chunk.with_data(&event.data));
            writer.take(chunk, event, spans);
            writer.flush(&verifier, false, &mut out);
            if position < 7 {
                assert!(out.is_empty(), "nothing before the echo is verified");
            }
        }
        out.extend(writer.done(&verdict.unwrap()));
        let mut parsed = Vec::new();
        SseParser::new().feed(&out, &mut parsed);
        let names: Vec<&str> = parsed.iter().filter_map(|e| e.event.as_deref()).collect();
        assert_eq!(parsed.len(), names.len(), "every event is named");
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ],
            "the echo's delta is dropped, every block kept"
        );
        let data: Vec<Value> = parsed
            .iter()
            .map(|event| serde_json::from_str(&event.data).unwrap())
            .collect();
        assert_eq!(data[4]["delta"]["signature"], "c2ln");
        assert_eq!(data[7]["delta"]["text"], "Mercury.");
        assert_eq!(data[6]["index"], 1);
        assert!(data[9]["usage"]["output_tokens"].as_u64().unwrap() < 25);
        let start_usage = &data[0]["message"]["usage"];
        assert_eq!(
            start_usage["input_tokens"],
            injection.prompt_tokens_estimate - injection.prompt_tokens_added
        );
    }

    #[test]
    fn thinking_cut_at_the_limit_before_the_reply_is_dropped_whole() {
        // A redacted block, then thinking that quotes no canary, cut by the
        // token limit before any text.
        let (_, injection, _) = placed(request(200, true));
        let mut events = provider_stream("", "", injection.prompt_tokens_estimate);
        events.truncate(6);
        // The thinking delta without its event name (read light all the same).
        events[3].event = None;
        for event in &mut events[1..] {
            let mut data: Value = serde_json::from_str(&event.data).unwrap();
            if data.get("index").is_some() {
                data["index"] = json!(1);
                event.data = data.to_string();
            }
        }
        events.splice(
            1..1,
            [
                sse(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "redacted_thinking", "data": "b3BhcXVl"}}),
                ),
                sse(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": 0}),
                ),
            ],
        );
        events.push(sse(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens",
                   "stop_sequence": null}, "usage": {"output_tokens": 200}}),
        ));
        events.push(sse("message_stop", json!({"type": "message_stop"})));
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let mut writer = Messages::stream_writer(delivery(&injection));
        let mut out = Vec::new();
        let mut usage = None;
        for event in events {
            let chunk = match Messages::read_event(&event) {
                EventView::Chunk(chunk) => chunk,
                EventView::Done => break,
                other => panic!("{other:?}"),
            };
            usage = chunk.usage.or(usage);
            let spans = feed(&mut verifier, &chunk.choices, &chunk.with_data(&event.data));
            writer.take(chunk, event, spans);
            writer.flush(&verifier, false, &mut out);
        }
        assert!(out.is_empty(), "the thinking waited for the echo");
        let verdict = finish(&mut verifier, "length", usage);
        assert_eq!(verdict.header_value(), "pass; withheld=reasoning");
        writer.flush(&verifier, true, &mut out);
        let mut parsed = Vec::new();
        SseParser::new().feed(&out, &mut parsed);
        let names: Vec<&str> = parsed.iter().filter_map(|e| e.event.as_deref()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_stop",
                "ping",
                "message_delta"
            ],
            "the thinking block's start, deltas and stop are dropped"
        );
        assert!(!String::from_utf8_lossy(&out).contains("Planets"));

        // The same answer whole: its thinking block goes, the redacted one stays.
        let (_, injection, _) = placed(request(200, false));
        let mut answer = json!({"id": "msg_1", "type": "message", "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "b3BhcXVl"},
                {"type": "thinking", "thinking": "The planets.", "signature": "c2ln"},
            ],
            "stop_reason": "max_tokens", "stop_sequence": null,
            "usage": {"input_tokens": injection.prompt_tokens_estimate, "output_tokens": 200}});
        let view = Messages::read_answer(&answer);
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let spans = feed(&mut verifier, &view.choices, &answer);
        let verdict = finish(&mut verifier, "length", view.usage);
        assert_eq!(verdict.header_value(), "pass; withheld=reasoning");
        let mut delivery = delivery(&injection);
        Messages::deliver_answer(&mut answer, &view, &spans, &verifier, &mut delivery);
        assert_eq!(
            answer["content"],
            json!([{"type": "redacted_thinking", "data": "b3BhcXVl"}])
        );
    }

    /// The provider's stream of `provider_stream` with its text block (1)
    /// holding only the echo, then `block_2`'s events as block 2.
    fn with_block_2(opening: &str, input_tokens: u64, block_2: Vec<SseEvent>) -> Vec<SseEvent> {
        let mut events = provider_stream(opening, "", input_tokens);
        events.retain(|event| {
            event.event.as_deref() != Some("content_block_delta")
                || !event.data.contains(r#""text":"""#)
        });
        let stop_1 = events
            .iter()
            .rposition(|event| event.event.as_deref() == Some("content_block_stop"))
            .unwrap();
        events.splice(stop_1 + 1..stop_1 + 1, block_2);
        events
    }

    /// Relays `events` through a verifier and the writer, as the verified
    /// path does (the verdict must pass); returns the client's block events
    /// (name, `index`, data) and the bytes.
    fn relay_blocks(
        events: Vec<SseEvent>,
        injection: &Injection,
    ) -> (Vec<(String, Value)>, Vec<u8>) {
        let mut verifier = Verifier::new(injection, &VerifyConfig::default(), "p", None);
        let mut writer = Messages::stream_writer(delivery(injection));
        let mut out = Vec::new();
        let mut usage = None;
        for event in events {
            let chunk: Chunk = match Messages::read_event(&event) {
                EventView::Chunk(chunk) => chunk,
                EventView::Done => {
                    let verdict = finish(&mut verifier, "stop", usage);
                    assert!(verdict.passed(), "{verdict:?}");
                    writer.flush(&verifier, true, &mut out);
                    break;
                }
                other => panic!("{other:?}"),
            };
            usage = chunk.usage.or(usage);
            let spans = feed(&mut verifier, &chunk.choices, &chunk.with_data(&event.data));
            writer.take(chunk, event, spans);
            writer.flush(&verifier, false, &mut out);
        }
        let mut parsed = Vec::new();
        SseParser::new().feed(&out, &mut parsed);
        let blocks = parsed
            .iter()
            .filter(|event| event.event.as_deref().unwrap().starts_with("content_block"))
            .map(|event| {
                let data: Value = serde_json::from_str(&event.data).unwrap();
                (event.event.clone().unwrap(), data)
            })
            .collect();
        (blocks, out)
    }

    /// The names and indices of `blocks`.
    fn names_and_indices(blocks: &[(String, Value)]) -> Vec<(String, Value)> {
        blocks
            .iter()
            .map(|(name, data)| (name.clone(), data["index"].clone()))
            .collect()
    }

    fn block_event(name: &str, index: u64, rest: Value) -> SseEvent {
        let mut data = json!({"type": name, "index": index});
        for (key, value) in rest.as_object().unwrap() {
            data[key] = value.clone();
        }
        sse(name, data)
    }

    /// A text block that held only the echo is dropped, start and stop, as
    /// a whole answer drops it, and the blocks after it are numbered down.
    #[test]
    fn a_text_block_emptied_by_the_echo_is_dropped_and_later_blocks_renumbered() {
        let (_, injection, opening) = placed(request(200, true));
        let block_2 = vec![
            block_event(
                "content_block_start",
                2,
                json!({"content_block": {"type": "text", "text": ""}}),
            ),
            block_event(
                "content_block_delta",
                2,
                json!({"delta": {"type": "text_delta", "text": "Mercury."}}),
            ),
            block_event("content_block_stop", 2, json!({})),
        ];
        let events = with_block_2(&opening, injection.prompt_tokens_estimate, block_2);
        let (blocks, out) = relay_blocks(events, &injection);
        let expected: Vec<(String, Value)> = [
            ("content_block_start", 0),
            ("content_block_delta", 0),
            ("content_block_delta", 0),
            ("content_block_stop", 0),
            ("content_block_start", 1),
            ("content_block_delta", 1),
            ("content_block_stop", 1),
        ]
        .iter()
        .map(|(name, index)| ((*name).to_owned(), json!(index)))
        .collect();
        assert_eq!(names_and_indices(&blocks), expected);
        assert!(String::from_utf8_lossy(&out).contains("Mercury."));
    }

    /// A text block's start goes before its first delta of any kind: a
    /// `citations_delta` ahead of the block's text does not overtake it.
    #[test]
    fn a_citation_ahead_of_its_text_follows_its_blocks_start() {
        let (_, injection, opening) = placed(request(200, true));
        let citation = json!({"type": "char_location", "cited_text": "Mercury is hot.",
                              "document_index": 0, "start_char_index": 0, "end_char_index": 15});
        let block_2 = vec![
            block_event(
                "content_block_start",
                2,
                json!({"content_block": {"type": "text", "text": "", "citations": []}}),
            ),
            block_event(
                "content_block_delta",
                2,
                json!({"delta": {"type": "citations_delta", "citation": citation}}),
            ),
            block_event(
                "content_block_delta",
                2,
                json!({"delta": {"type": "text_delta", "text": "Mercury is hot."}}),
            ),
            block_event("content_block_stop", 2, json!({})),
        ];
        let events = with_block_2(&opening, injection.prompt_tokens_estimate, block_2);
        let (blocks, _) = relay_blocks(events, &injection);
        let kinds: Vec<&str> = blocks[4..]
            .iter()
            .map(|(name, data)| {
                assert_eq!(data["index"], 1, "{name}");
                data["delta"]["type"].as_str().unwrap_or(name)
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "content_block_start",
                "citations_delta",
                "text_delta",
                "content_block_stop"
            ]
        );
    }

    /// The relay's work for one text delta once the echo has passed, as
    /// `paths::verified::stream` does it (less hyper and the client's
    /// write), allocates nothing: the SSE parser reads the event's name and
    /// data into buffers of events the writer has written out
    /// (`StreamWriter::spent`), and the delta goes out as the provider's
    /// bytes.
    #[test]
    fn a_relayed_text_delta_allocates_within_its_budget() {
        const DELTAS: usize = 400;
        let (_, injection, opening) = placed(request(100_000, true));
        let registry = MemoryRegistry::new(b"test");
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let mut writer = Messages::stream_writer(delivery(&injection));
        let wire = |name: &str, data: Value| format!("event: {name}\ndata: {data}\n\n");
        let delta = |text: &str| {
            let data = json!({"type": "content_block_delta", "index": 0,
                              "delta": {"type": "text_delta", "text": text}});
            wire("content_block_delta", data)
        };
        let reads: Vec<String> = [
            wire(
                "message_start",
                json!({"type": "message_start", "message": {"id": "msg_1", "type": "message",
                       "role": "assistant", "content": [], "stop_reason": null,
                       "usage": {"input_tokens": 10, "output_tokens": 1}}}),
            ),
            wire(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "text", "text": ""}}),
            ),
            delta(&format!("{opening}\n")),
        ]
        .into_iter()
        .chain((0..DELTAS).map(|n| delta(&format!(" word{n}"))))
        .collect();
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        let mut tally = crate::allocations::Tally::default();
        let mut out = Vec::new();
        const SETTLED: usize = 16;
        for (read, bytes) in reads.iter().enumerate() {
            let before = crate::allocations::on_this_thread();
            parser.feed(bytes.as_bytes(), &mut events);
            for event in events.drain(..) {
                let EventView::Chunk(chunk) = Messages::read_event(&event) else {
                    panic!("not a chunk: {event:?}");
                };
                let mut spans = Spans::new();
                for field in chunk.texts() {
                    let text = chunk.with_data(&event.data).text(field);
                    let start = verifier.received(field.choice, field.kind);
                    spans.push(start..start + text.len());
                    verifier.push_part_positions(field.choice, field.kind, text, &registry);
                }
                writer.take(chunk, event, spans);
                writer.flush(&verifier, false, &mut out);
            }
            while let Some(buffer) = writer.spent() {
                parser.recycle(buffer);
            }
            // The first events carry the echo and settle the buffers.
            if read > SETTLED {
                let spent = crate::allocations::on_this_thread() - before;
                tally.add(spent, bytes.len());
                assert_eq!(
                    spent,
                    crate::allocations::Allocated::default(),
                    "delta {read} allocated, for {} bytes",
                    bytes.len()
                );
                assert_eq!(out, bytes.as_bytes(), "delta {read} went out as it came");
            }
            out.clear();
        }
        eprintln!("{}", tally.report("messages text delta"));
    }

    /// Another request's canary, as a string beside a text.
    fn canary_beside() -> &'static str {
        "CG123456789012345"
    }

    #[test]
    fn stream_events_are_read_as_their_parts() {
        let read = |name: &str, data: Value| match Messages::read_event(&sse(name, data)) {
            EventView::Chunk(chunk) => chunk,
            other => panic!("{other:?}"),
        };
        let chunk = read(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 2,
                   "delta": {"type": "input_json_delta", "partial_json": "{\"q\":"}}),
        );
        let field = chunk.texts().next().unwrap();
        assert_eq!(field.kind, Part::ToolArguments(2));
        assert_eq!(field.text(&chunk.event), "{\"q\":");
        let delta = read(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                   "usage": {"output_tokens": 9}}),
        );
        assert_eq!(delta.choices[0].finish_reason.as_deref(), Some("length"));
        assert_eq!(delta.usage, None, "no prompt count in it");
        let start = read(
            "message_start",
            json!({"type": "message_start", "message": {"usage": {"input_tokens": 5,
                   "cache_creation_input_tokens": 7, "output_tokens": 1}}}),
        );
        assert!(start.choices.is_empty());
        assert_eq!(
            start.usage,
            Some(ProviderUsage {
                prompt_tokens: 12,
                completion_tokens: None,
                cached_prompt_tokens: None,
            })
        );
        // A string beside a delta's text, in the delta or the event.
        for data in [
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": "hi", "note": canary_beside()}}),
            json!({"type": "content_block_delta", "index": 0, "note": canary_beside(),
                   "delta": {"type": "text_delta", "text": "hi"}}),
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "signature_delta", "signature": canary_beside()}}),
        ] {
            let chunk = read("content_block_delta", data.clone());
            let texts: Vec<&str> = chunk
                .texts()
                .map(|field| field.text(&chunk.event))
                .collect();
            assert!(texts.contains(&canary_beside()), "{data}: {texts:?}");
        }
        // Content in `message_start` (real providers send none; SDKs take
        // it as the message's first blocks) and its usage are read too.
        let canary = "CG123456789012345";
        let start = read(
            "message_start",
            json!({"type": "message_start", "message": {
                "content": [{"type": "text", "text": format!("Ref {canary}.")}],
                "usage": {"input_tokens": 5, "output_tokens": 1, "note": canary}}}),
        );
        let texts: Vec<&str> = start
            .texts()
            .map(|field| field.text(&start.event))
            .collect();
        assert_eq!(texts, [format!("Ref {canary}."), canary.to_owned()]);
        let error = sse(
            "error",
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        );
        assert!(
            matches!(Messages::read_event(&error), EventView::Error(message) if message.contains("Overloaded"))
        );
        let stop = sse("message_stop", json!({"type": "message_stop"}));
        assert!(matches!(Messages::read_event(&stop), EventView::Done));
        assert!(Messages::is_end_marker(&stop));
        assert!(!Messages::is_end_marker(&sse(
            "ping",
            json!({"type": "ping"})
        )));
        let broken = SseEvent {
            data: "{not json".into(),
            ..SseEvent::default()
        };
        assert!(matches!(
            Messages::read_event(&broken),
            EventView::Malformed
        ));
    }
}
