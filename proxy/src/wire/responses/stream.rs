//! The client's side of a verified Responses stream: the provider's own
//! typed events, held until their text is verified, passed on edited.
//!
//! Deltas carry the text the verifier reads; each becomes what the release
//! and the delivery leave of it (an emptied delta is still sent, so the
//! `sequence_number`s run on). The events that repeat a text whole (the
//! `.done` events, `content_part.done`, `output_item.done` and the final
//! `response.completed`, whose `output` the SDK trusts) are rewritten from
//! what was delivered for that `(output_index, content or summary index)`.
//! Every event goes out with its `event:` line; one that nothing changed as
//! the provider's own data.
//!
//! Longer than 500 lines: about 680 of them are the unit tests, which relay
//! whole streams through the writer's private state (the delivered texts,
//! the rewritten `.done` events, the allocation budget).

use crate::wire::held::{Held, HeldEvents};
use std::ops::Range;

use canarygate_policies::sse::{SpentBuffers, SseEvent, encode_data, encode_json};
use canarygate_policies::verify::{Part, Verdict, Verifier};
use serde_json::{Value, json};

use super::answer::slot_of;
use super::answer::{delta_part, event_type, read_tree};
use super::deliver::{
    Delivered, Shown, Slot, has_text, item_repeats_undelivered, mark_cut, part_has_text,
    report_usage, restate_output_text, restore_request_fields, rewrite_item, rewrite_part,
};
use super::error::error_event_json;
use super::light::{Delta, delta_of};
use super::repeated::undelivered_texts;
use crate::error::ApiError;
use crate::wire::chat::followed_logprobs;
use crate::wire::edit::{Delivery, apply};
use crate::wire::format::{Chunk, EventView, Spans, StreamWriter, put_text};
use crate::wire::positions::follow_annotations;

/// One event of a provider's Responses stream, as the verifier reads it: a
/// delta without its tree ([`light`](super::light)), any other event from
/// its tree.
pub fn read_event(event: &SseEvent) -> EventView {
    if event.is_done() {
        return EventView::Done;
    }
    match super::light::read(&event.data) {
        Some(chunk) => EventView::Chunk(chunk),
        None => read_tree(event),
    }
}

/// The client's side of a verified Responses stream (see the module docs).
pub struct ResponsesStream {
    delivery: Delivery,
    held: HeldEvents,
    delivered: Delivered,
    /// An event had to change and could not be edited
    /// ([`StreamWriter::failure`]).
    failure: Option<&'static str>,
    /// Buffers of events written out ([`StreamWriter::spent`]).
    spent: SpentBuffers,
    /// The highest `sequence_number` of the events written out: canarygate's
    /// own error event follows it.
    last_sequence: Option<u64>,
    /// The last event taken was the provider's `error` event.
    last_was_error: bool,
}

/// [`ResponsesStream::failure`] of an event that had to change and has no
/// tree (unreachable for what the light reading accepts; never passed on
/// unedited).
const UNEDITABLE: &str = "sent an event that must be edited and cannot be";

/// [`ResponsesStream::failure`] of an event that repeats text no delta
/// delivered: rewritten from what was delivered, the text would reach the
/// client empty, and it was never verified as it came.
const REPEATED_UNDELIVERED: &str =
    "sent text only in an event that repeats it (no delta carried it), which cannot be relayed";

impl ResponsesStream {
    /// A writer delivering by `delivery`.
    pub fn new(delivery: Delivery) -> Self {
        Self {
            delivery,
            held: HeldEvents::default(),
            delivered: Delivered::new(),
            failure: None,
            spent: SpentBuffers::default(),
            last_sequence: None,
            last_was_error: false,
        }
    }

    /// Notes `number`, the `sequence_number` of an event written out.
    fn wrote(&mut self, number: Option<u64>) {
        if number > self.last_sequence {
            self.last_sequence = number;
        }
    }

    /// Whether `held` may go out now, before the verdict. An event without
    /// text (`response.created`, an item opening) waits until the answer
    /// has begun: nothing opens the client's stream before the echo passed.
    fn ready(held: &Held, verifier: &Verifier) -> bool {
        if held.ends {
            return false;
        }
        if held.chunk.choices.is_empty() {
            return verifier.released_any();
        }
        held.chunk
            .choices
            .iter()
            .all(|choice| verifier.may_show(choice.index))
            && held.chunk.texts().zip(&held.spans).all(|(field, span)| {
                verifier.release_of(field.choice, field.kind).through >= span.end
            })
    }

    /// Whether a light event (a delta) goes out as the provider sent it:
    /// its text passes whole, and is then accounted for and added to what
    /// was delivered; otherwise nothing changed and the event is edited
    /// from its tree.
    fn passes_unchanged(
        &mut self,
        chunk: &Chunk,
        data: &str,
        delta: &Delta<'_>,
        spans: &[Range<usize>],
        verifier: &Verifier,
    ) -> bool {
        let (Some(field), Some(span)) = (chunk.texts().next(), spans.first()) else {
            return false;
        };
        let text = chunk.with_data(data).text(field);
        let release = verifier.release_of(field.choice, field.kind);
        if !self
            .delivery
            .admit_whole(field.choice, field.kind, text, span.clone(), release)
        {
            return false;
        }
        let shown = self
            .delivered
            .entry((delta.output_index, delta.slot))
            .or_default();
        shown.text.push_str(text);
        shown.chars.push_whole(text);
        true
    }

    /// Writes one held event to `out` as the verifier and the delivery
    /// leave it.
    fn write(
        &mut self,
        mut chunk: Chunk,
        event: &SseEvent,
        spans: Spans,
        verifier: &Verifier,
        out: &mut Vec<u8>,
    ) {
        if chunk.is_light() {
            if let Some(delta) = delta_of(&event.data)
                && self.passes_unchanged(&chunk, &event.data, &delta, &spans, verifier)
            {
                self.wrote(delta.sequence_number);
                out.extend_from_slice(b"event: ");
                out.extend_from_slice(delta.kind.as_bytes());
                out.push(b'\n');
                encode_data(&event.data, out);
                return;
            }
            if !chunk.build_tree(&event.data) {
                self.failure = Some(UNEDITABLE);
                return;
            }
        }
        let original = chunk.event.clone();
        let kind = event_type(&original, event).to_owned();
        let data = &mut chunk.event;
        let at_index = |key: &str| data.get(key).and_then(Value::as_u64);
        let output_index = at_index("output_index").unwrap_or(0);
        let slot = slot_of(&kind, at_index("content_index"), at_index("summary_index"));
        let fields: Vec<_> = chunk
            .choices
            .iter()
            .flat_map(|choice| &choice.texts)
            .copied()
            .collect();
        let is_delta = delta_part(&kind, &original).is_some();
        // The texts this event repeats that no delta carried: read from it,
        // as their deltas would have been (`repeated`).
        let undelivered = match is_delta {
            true => Vec::new(),
            false => undelivered_texts(&kind, &original, |slot| {
                self.delivered.contains_key(&(output_index, slot))
            }),
        };
        for (field, span) in fields.iter().zip(spans) {
            let text = field.text(&original).to_owned();
            let edit = self.delivery.admit(
                field.choice,
                field.kind,
                &text,
                span,
                verifier.release_of(field.choice, field.kind),
            );
            let kept = apply(&text, &edit.kept);
            // The delta's text, not a string beside it; or a text only this
            // repeat carried.
            let text_slot = match is_delta {
                true => (!matches!(field.kind, Part::Other(_))).then_some(slot),
                // The reader read it as its part; a string it declined
                // (its place left) is at most a canary-shaped one beside.
                false => undelivered
                    .iter()
                    .find(|repeated| repeated.at == field.at && repeated.part == field.kind)
                    .map(|repeated| repeated.slot),
            };
            if let Some(slot) = text_slot {
                let shown = self.delivered.entry((output_index, slot)).or_default();
                shown.text.push_str(&kept);
                shown.chars.push(&text, &edit.kept);
                if let Some(entries) = original.get("logprobs").and_then(Value::as_array) {
                    let followed = followed_logprobs(entries.to_vec(), &text, &edit.kept);
                    if !edit.unchanged() {
                        data["logprobs"] = json!(followed);
                    }
                    shown.logprobs.extend(followed);
                }
            }
            if !edit.unchanged() {
                put_text(data, field, kept);
            }
        }
        if self.repeats_undelivered(&kind, &original, output_index, slot) {
            self.failure = Some(REPEATED_UNDELIVERED);
            return;
        }
        let cut = self.delivery.was_cut(0);
        // Read where it is: a delta's text grows with the answer.
        let nothing_shown = Shown::default();
        let shown = self
            .delivered
            .get(&(output_index, slot))
            .unwrap_or(&nothing_shown);
        match kind.as_str() {
            "response.output_text.done"
            | "response.reasoning_summary_text.done"
            | "response.reasoning_text.done" => {
                data["text"] = json!(shown.text);
                if data
                    .get("logprobs")
                    .and_then(Value::as_array)
                    .is_some_and(|entries| !entries.is_empty())
                {
                    data["logprobs"] = json!(shown.logprobs);
                }
            }
            "response.refusal.done" => data["refusal"] = json!(shown.text),
            "response.output_text.annotation.added" => {
                if let Some(annotation) = data.get_mut("annotation") {
                    // One annotation, followed as a list of one.
                    let mut list = Value::Array(vec![annotation.take()]);
                    follow_annotations(&mut list, &shown.chars);
                    *annotation = list.as_array_mut().and_then(Vec::pop).unwrap_or_default();
                }
            }
            "response.function_call_arguments.done" => data["arguments"] = json!(shown.text),
            "response.content_part.added"
            | "response.content_part.done"
            | "response.reasoning_summary_part.added"
            | "response.reasoning_summary_part.done" => {
                if let Some(part) = data.get_mut("part") {
                    rewrite_part(part, shown);
                }
            }
            "response.output_item.added" | "response.output_item.done" => {
                if let Some(item) = data.get_mut("item") {
                    rewrite_item(item, output_index, &self.delivered, cut);
                }
            }
            "response.created"
            | "response.queued"
            | "response.in_progress"
            | "response.completed"
            | "response.incomplete"
            | "response.failed" => {
                if let Some(response) = data.get_mut("response").filter(|value| value.is_object()) {
                    restore_request_fields(response, self.delivery.repeated_fields());
                    if let Some(items) = response.get_mut("output").and_then(Value::as_array_mut) {
                        for (index, item) in items.iter_mut().enumerate() {
                            rewrite_item(item, index as u64, &self.delivered, cut);
                        }
                    }
                    report_usage(response, &self.delivery);
                    restate_output_text(response);
                    if cut && kind == "response.completed" {
                        mark_cut(response);
                        data["type"] = json!("response.incomplete");
                    }
                }
            }
            _ => {}
        }
        let number = data.get("sequence_number").and_then(Value::as_u64);
        let name = data
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(&kind)
            .to_owned();
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.as_bytes());
        out.push(b'\n');
        if *data == original {
            encode_data(&event.data, out);
        } else {
            encode_json(data, out);
        }
        self.wrote(number);
    }
}

impl ResponsesStream {
    /// Whether event `data` of type `kind` (at `output_index` and `slot`)
    /// repeats text that no delta of the stream delivered: a `.done`
    /// event's text, a part's, an item's, the response's output.
    fn repeats_undelivered(&self, kind: &str, data: &Value, output_index: u64, slot: Slot) -> bool {
        let delivered = &self.delivered;
        let missing = |slot: Slot| !delivered.contains_key(&(output_index, slot));
        match kind {
            "response.output_text.done"
            | "response.reasoning_summary_text.done"
            | "response.reasoning_text.done" => has_text(data.get("text")) && missing(slot),
            "response.refusal.done" => has_text(data.get("refusal")) && missing(slot),
            "response.function_call_arguments.done" => {
                has_text(data.get("arguments")) && missing(Slot::Arguments)
            }
            "response.content_part.added"
            | "response.content_part.done"
            | "response.reasoning_summary_part.added"
            | "response.reasoning_summary_part.done" => {
                data.get("part").is_some_and(part_has_text) && missing(slot)
            }
            "response.output_item.added" | "response.output_item.done" => data
                .get("item")
                .is_some_and(|item| item_repeats_undelivered(item, output_index, delivered)),
            _ => data
                .get("response")
                .and_then(|response| response.get("output"))
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .enumerate()
                .any(|(index, item)| item_repeats_undelivered(item, index as u64, delivered)),
        }
    }
}

impl StreamWriter for ResponsesStream {
    fn take(&mut self, chunk: Chunk, event: SseEvent, spans: Spans) {
        let ends = chunk
            .choices
            .iter()
            .any(|choice| choice.finish_reason.is_some());
        // A delta is light; an `error` event is read from its tree.
        self.last_was_error = !chunk.is_light() && event_type(&chunk.event, &event) == "error";
        self.held.push(Held {
            chunk,
            event,
            spans,
            ends,
        });
    }

    fn flush(&mut self, verifier: &Verifier, at_end: bool, out: &mut Vec<u8>) {
        while self.failure.is_none()
            && let Some(held) =
                self.held
                    .pop_ready(at_end, Self::ready, &mut self.delivery, verifier)
        {
            self.write(held.chunk, &held.event, held.spans, verifier, out);
            self.spent.keep(held.event);
        }
    }

    fn failure(&self) -> Option<&str> {
        self.failure
    }

    fn spent(&mut self) -> Option<String> {
        self.spent.pop()
    }

    fn delivery(&self) -> &Delivery {
        &self.delivery
    }

    fn delivery_mut(&mut self) -> &mut Delivery {
        &mut self.delivery
    }

    fn ended_by_provider_error(&self) -> bool {
        // Taken last, so still held while anything is.
        self.last_was_error && self.held.is_empty()
    }

    fn take_unsent_provider_error(&mut self) -> Option<(SseEvent, String)> {
        if !self.last_was_error {
            return None;
        }
        // Taken last, so the last held when it is still held.
        let held = self.held.pop_last()?;
        self.last_was_error = false;
        let message = serde_json::from_str::<Value>(&held.event.data)
            .ok()
            .and_then(|data| data.get("message")?.as_str().map(str::to_owned))
            .unwrap_or_else(|| "error event without a message".to_owned());
        Some((held.event, message))
    }

    /// canarygate's `error` event, numbered after the last event written
    /// out.
    fn error_event(&self, error: &ApiError) -> Option<Vec<u8>> {
        let mut data = error_event_json(error);
        data["sequence_number"] = json!(self.last_sequence.map_or(0, |last| last + 1));
        let mut event = b"event: error\n".to_vec();
        encode_json(&data, &mut event);
        Some(event)
    }

    /// The verdict and canarygate's token overhead as SSE comments: a
    /// Responses stream ends with its `response.completed` event, no
    /// `[DONE]`.
    fn done(&self, verdict: &Verdict) -> Vec<u8> {
        let mut tail = b": x-canarygate-verdict ".to_vec();
        tail.extend_from_slice(verdict.header_value().as_bytes());
        tail.extend_from_slice(b"\n: x-canarygate-overhead-tokens ");
        tail.extend_from_slice(self.delivery.overhead_header().as_bytes());
        tail.extend_from_slice(b"\n\n");
        tail
    }
}

#[cfg(test)]
mod tests {
    use canarygate_policies::EchoCost;
    use canarygate_policies::inject::{Injection, RequestCanaries};
    use canarygate_policies::registry::MemoryRegistry;
    use canarygate_policies::sse::SseParser;
    use canarygate_policies::verify::Facts;
    use canarygate_policies::verify_config::{EchoMode, VerifyConfig};

    use super::*;
    use crate::wire::edit::{TokenCounter, UsageOptions};
    use crate::wire::format::{StreamMemo, WireFormat};
    use crate::wire::responses::Responses;
    use crate::wire::responses::request::place;

    /// What an echo is costed at in these tests: a token per digit.
    const COST: EchoCost = EchoCost::DIGIT_BY_DIGIT;

    /// A provider's stream of `deltas` (one message), as the real API
    /// orders it, numbered from 0, with the request's instructions.
    fn provider_events(deltas: &[String], instructions: &str, limit: Value) -> Vec<SseEvent> {
        let whole: String = deltas.concat();
        let at = |kind: &str| {
            json!({"type": kind, "item_id": "msg_1", "output_index": 0,
                                      "content_index": 0})
        };
        let response = |status: &str, output: Value| {
            json!({"id": "resp_1", "object": "response",
            "status": status, "instructions": instructions, "max_output_tokens": limit,
            "output": output, "usage": if status == "completed" {
                json!({"input_tokens": 90, "output_tokens": 30, "total_tokens": 120})
            } else { Value::Null }})
        };
        let item = |text: &str| {
            json!({"id": "msg_1", "type": "message", "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": text,
            "annotations": [], "logprobs": []}]})
        };
        let mut events = vec![
            json!({"type": "response.created", "response": response("in_progress", json!([]))}),
            json!({"type": "response.in_progress", "response": response("in_progress", json!([]))}),
            json!({"type": "response.output_item.added", "output_index": 0,
                   "item": {"id": "msg_1", "type": "message", "status": "in_progress",
                            "role": "assistant", "content": []}}),
        ];
        let mut added = at("response.content_part.added");
        added["part"] = json!({"type": "output_text", "text": "", "annotations": []});
        events.push(added);
        for delta in deltas {
            let mut event = at("response.output_text.delta");
            event["delta"] = json!(delta);
            event["logprobs"] = json!([]);
            events.push(event);
        }
        let mut done = at("response.output_text.done");
        done["text"] = json!(whole);
        events.push(done);
        let mut part_done = at("response.content_part.done");
        part_done["part"] = json!({"type": "output_text", "text": whole, "annotations": []});
        events.push(part_done);
        events.push(
            json!({"type": "response.output_item.done", "output_index": 0,
                           "item": item(&whole)}),
        );
        events.push(json!({"type": "response.completed",
                           "response": response("completed", json!([item(&whole)]))}));
        numbered(events)
    }

    /// `events` as the provider sends them: numbered from 0, each with its
    /// `event:` line.
    fn numbered(events: Vec<Value>) -> Vec<SseEvent> {
        events
            .into_iter()
            .enumerate()
            .map(|(number, mut event)| {
                event["sequence_number"] = json!(number);
                SseEvent {
                    event: Some(event["type"].as_str().unwrap().to_owned()),
                    data: event.to_string(),
                    id: None,
                }
            })
            .collect()
    }

    /// Feeds `chunk`'s text fields (its data `data`) to `verifier`; returns
    /// the span of its part each carried, as the verified path does.
    fn feed(
        chunk: &Chunk,
        data: &str,
        verifier: &mut Verifier,
        registry: &MemoryRegistry,
    ) -> Spans {
        let mut spans = Spans::new();
        for field in chunk.texts() {
            let text = chunk.with_data(data).text(field);
            let start = verifier.received(field.choice, field.kind);
            spans.push(start..start + text.len());
            verifier.push_part_positions(field.choice, field.kind, text, registry);
        }
        spans
    }

    /// A writer of one choice for `injection`'s request, cutting at
    /// `client_limit`, usage as sent.
    fn writer(client_limit: Option<u64>, injection: &Injection) -> ResponsesStream {
        let usage = UsageOptions {
            client_wants_usage: true,
            without_canarygate: false,
            overhead_prompt: 0,
        };
        ResponsesStream::new(
            Delivery::new(TokenCounter::default(), client_limit, usage, 1)
                .with_repeated_fields(injection.repeated_fields.clone()),
        )
    }

    /// Runs `events` through a verifier and the writer, as the verified
    /// path does; returns the client's events (name, data) and the bytes.
    fn relay(
        events: Vec<SseEvent>,
        injection: &Injection,
        client_limit: Option<u64>,
    ) -> (Vec<(String, Value)>, String) {
        let registry = MemoryRegistry::new(b"test");
        let mut verifier = Verifier::new(injection, &VerifyConfig::default(), "p", None);
        let mut writer = writer(client_limit, injection);
        let mut out = Vec::new();
        let mut reasons = Vec::new();
        let mut memo = StreamMemo::default();
        for event in events {
            let (chunk, last) = match Responses::read_stream_event(&event, &mut memo) {
                EventView::Chunk(chunk) => (chunk, false),
                EventView::Final(chunk) => (chunk, true),
                other => panic!("{other:?}"),
            };
            if let Some(place) = chunk.place {
                assert!(memo.keeps_order(place), "{}", event.data);
            }
            let spans = feed(&chunk, &event.data, &mut verifier, &registry);
            for choice in &chunk.choices {
                if choice.finish_reason.is_some() {
                    reasons = vec![choice.finish_reason.clone()];
                }
            }
            writer.take(chunk, event, spans);
            if last {
                let facts = Facts {
                    finish_reasons: reasons.clone(),
                    usage: None,
                    done_marker: Some(true),
                };
                let finished = verifier.finish(&facts, &registry);
                assert!(finished.verdict.passed(), "{:?}", finished.verdict);
                writer.flush(&verifier, true, &mut out);
                out.extend(writer.done(&finished.verdict));
            } else {
                writer.flush(&verifier, false, &mut out);
            }
        }
        let text = String::from_utf8(out).unwrap();
        let mut parser = SseParser::new();
        let mut parsed = Vec::new();
        parser.feed(text.as_bytes(), &mut parsed);
        let events = parsed
            .into_iter()
            .map(|event| {
                (
                    event.event.unwrap_or_default(),
                    serde_json::from_str(&event.data).unwrap(),
                )
            })
            .collect();
        (events, text)
    }

    fn setup(max_output_tokens: Option<u64>) -> (Injection, Value, RequestCanaries) {
        let canaries = RequestCanaries::mint();
        let mut body = json!({"model": "m", "instructions": "Be brief.", "input": "Name the planets",
                              "stream": true});
        if let Some(limit) = max_output_tokens {
            body["max_output_tokens"] = json!(limit);
        }
        let injection = place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        (injection, body, canaries)
    }

    /// Text that only an event repeating it carries (a function call's
    /// arguments in `function_call_arguments.done` and the item, no delta)
    /// would be rewritten from what was delivered, nothing: the stream ends
    /// with an error instead of passing the call on empty.
    #[test]
    fn text_no_delta_carried_ends_the_stream() {
        let canaries = RequestCanaries::mint();
        let mut body = json!({"model": "m", "input": "Weather in Paris?", "stream": true,
                              "tools": [{"type": "function", "name": "weather",
                                         "parameters": {"type": "object"}}]});
        let injection = place(&mut body, EchoMode::HeadTail, COST, canaries).unwrap();
        let registry = MemoryRegistry::new(b"test");
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let mut writer = writer(None, &injection);
        let call = |arguments: &str| {
            json!({"type": "function_call", "id": "fc_1", "call_id": "call_1",
                   "name": "weather", "arguments": arguments, "status": "completed"})
        };
        let events = [
            json!({"type": "response.output_item.added", "output_index": 0, "item": call("")}),
            json!({"type": "response.function_call_arguments.done", "item_id": "fc_1",
                   "output_index": 0, "arguments": "{\"city\":\"Paris\"}"}),
        ];
        let mut out = Vec::new();
        for data in events {
            let event = SseEvent {
                event: Some(data["type"].as_str().unwrap().to_owned()),
                data: data.to_string(),
                id: None,
            };
            let EventView::Chunk(chunk) = read_event(&event) else {
                panic!("a chunk");
            };
            let spans = feed(&chunk, &event.data, &mut verifier, &registry);
            writer.take(chunk, event, spans);
            writer.flush(&verifier, false, &mut out);
        }
        writer.flush(&verifier, true, &mut out);
        assert_eq!(writer.failure(), Some(REPEATED_UNDELIVERED));
        let written = String::from_utf8(out).unwrap();
        assert!(
            !written.contains("function_call_arguments.done"),
            "{written}"
        );
    }

    /// A response that failed before any text is the provider's failure,
    /// passed on as it came: no echo was there to fail.
    #[test]
    fn a_response_that_failed_before_any_text_reaches_the_client() {
        let (injection, body, _) = setup(None);
        let instructions = body["instructions"].as_str().unwrap();
        let mut events: Vec<SseEvent> = provider_events(&[], instructions, Value::Null)
            .into_iter()
            .take(2)
            .collect();
        events.push(SseEvent {
            event: Some("response.failed".into()),
            data: json!({"type": "response.failed", "sequence_number": 2, "response": {
                "id": "resp_1", "object": "response", "status": "failed", "output": [],
                "error": {"code": "server_error", "message": "The server had an error."}}})
            .to_string(),
            id: None,
        });
        let (events, _) = relay(events, &injection, None);
        let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.failed"
            ]
        );
        assert_eq!(events[2].1["response"]["error"]["code"], "server_error");
    }

    /// canarygate's own `error` event follows the last event written out
    /// in the stream's numbering.
    #[test]
    fn canarygates_error_event_is_numbered_after_the_last_event_written() {
        let (injection, body, canaries) = setup(None);
        let echo = format!("{} {}\n", canaries.head, canaries.tail);
        let deltas = [echo, "Mercury ".into(), "and Venus".into()];
        let instructions = body["instructions"].as_str().unwrap();
        // The stream breaks off after the second text delta.
        let events: Vec<SseEvent> = provider_events(&deltas, instructions, Value::Null)
            .into_iter()
            .take(7)
            .collect();
        let registry = MemoryRegistry::new(b"test");
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let mut writer = writer(None, &injection);
        let mut out = Vec::new();
        for event in events {
            let EventView::Chunk(chunk) = read_event(&event) else {
                panic!("{event:?}");
            };
            let spans = feed(&chunk, &event.data, &mut verifier, &registry);
            writer.take(chunk, event, spans);
            writer.flush(&verifier, false, &mut out);
        }
        let error = writer
            .error_event(&ApiError::internal("the provider broke off"))
            .unwrap();
        out.extend(error);
        let mut parsed = Vec::new();
        SseParser::new().feed(&out, &mut parsed);
        let numbers: Vec<u64> = parsed
            .iter()
            .map(|event| {
                let data: Value = serde_json::from_str(&event.data).unwrap();
                data["sequence_number"].as_u64().unwrap()
            })
            .collect();
        assert_eq!(parsed.last().unwrap().event.as_deref(), Some("error"));
        assert!(numbers.len() >= 3, "{numbers:?}");
        assert!(
            numbers.windows(2).all(|pair| pair[0] < pair[1]),
            "{numbers:?}"
        );
        assert_eq!(numbers[numbers.len() - 1], numbers[numbers.len() - 2] + 1);
    }

    /// A citation's positions, counted in the provider's text, point into
    /// the client's: in `annotation.added` and in every event that repeats
    /// the part (`content_part.done`, `output_item.done`,
    /// `response.completed`).
    #[test]
    fn annotations_point_into_the_delivered_text() {
        let (injection, body, canaries) = setup(None);
        let echo = format!("{} {}\n", canaries.head, canaries.tail);
        let deltas = [echo.clone(), "Pluto ".into(), "is far.".into()];
        let instructions = body["instructions"].as_str().unwrap();
        let pluto = echo.chars().count();
        let annotation = json!({"type": "url_citation", "start_index": pluto,
                                "end_index": pluto + 5, "url": "u", "title": "t"});
        let mut events: Vec<Value> = provider_events(&deltas, instructions, Value::Null)
            .into_iter()
            .map(|event| serde_json::from_str(&event.data).unwrap())
            .collect();
        for event in &mut events {
            let part = match event["type"].as_str().unwrap() {
                "response.content_part.done" => &mut event["part"],
                "response.output_item.done" => &mut event["item"]["content"][0],
                "response.completed" => &mut event["response"]["output"][0]["content"][0],
                _ => continue,
            };
            part["annotations"] = json!([annotation]);
        }
        let done = events
            .iter()
            .position(|event| event["type"] == "response.output_text.done")
            .unwrap();
        events.insert(
            done,
            json!({"type": "response.output_text.annotation.added", "item_id": "msg_1",
                   "output_index": 0, "content_index": 0, "annotation_index": 0,
                   "annotation": annotation}),
        );
        let events = numbered(events);
        let (events, _) = relay(events, &injection, None);
        let moved = json!({"type": "url_citation", "start_index": 0, "end_index": 5,
                           "url": "u", "title": "t"});
        let mut seen = 0;
        for (name, data) in &events {
            let annotation = match name.as_str() {
                "response.output_text.annotation.added" => &data["annotation"],
                "response.content_part.done" => &data["part"]["annotations"][0],
                "response.output_item.done" => &data["item"]["content"][0]["annotations"][0],
                "response.completed" => {
                    &data["response"]["output"][0]["content"][0]["annotations"][0]
                }
                _ => continue,
            };
            assert_eq!(annotation, &moved, "{name}");
            seen += 1;
        }
        assert_eq!(seen, 4);
        let (_, done) = events
            .iter()
            .find(|(name, _)| name == "response.output_text.done")
            .unwrap();
        assert_eq!(&done["text"].as_str().unwrap()[..5], "Pluto");
    }

    /// The relay's work for one text delta once the echo has passed, as
    /// `paths::verified::stream` does it (less hyper and the client's
    /// write), allocates only to grow the text kept for the `.done` events
    /// (the SSE parser reads the event's name and data into buffers of
    /// events the writer has written out, `StreamWriter::spent`): at most
    /// one allocation per hundred deltas, and no more bytes than twice what
    /// it forwards however long the answer; the delta goes out as the
    /// provider's bytes.
    #[test]
    fn a_relayed_text_delta_allocates_within_its_budget() {
        const BUDGET: f64 = 0.01;
        const DELTAS: usize = 2_000;
        const SETTLED: usize = 16;
        let (injection, body, canaries) = setup(None);
        let mut deltas = vec![format!("{} {}\n", canaries.head, canaries.tail)];
        deltas.extend((0..DELTAS).map(|n| format!(" word{n}")));
        let instructions = body["instructions"].as_str().unwrap();
        let events = provider_events(&deltas, instructions, Value::Null);
        let reads: Vec<(bool, Vec<u8>)> = events
            .iter()
            .map(|event| {
                let name = event.event.as_deref().unwrap();
                let wire = format!("event: {name}\ndata: {}\n\n", event.data);
                (name == "response.output_text.delta", wire.into_bytes())
            })
            .collect();
        let registry = MemoryRegistry::new(b"test");
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let mut writer = writer(None, &injection);
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        let mut out = Vec::new();
        let mut tally = crate::allocations::Tally::default();
        for (read, (is_delta, bytes)) in reads.iter().enumerate() {
            let before = crate::allocations::on_this_thread();
            parser.feed(bytes, &mut events);
            for event in events.drain(..) {
                let EventView::Chunk(chunk) = read_event(&event) else {
                    break;
                };
                let spans = feed(&chunk, &event.data, &mut verifier, &registry);
                writer.take(chunk, event, spans);
                writer.flush(&verifier, false, &mut out);
            }
            while let Some(buffer) = writer.spent() {
                parser.recycle(buffer);
            }
            // The first events open the answer, carry the echo and settle
            // the buffers.
            if *is_delta && read > SETTLED {
                tally.add(crate::allocations::on_this_thread() - before, bytes.len());
                assert_eq!(out, *bytes, "delta {read} went out as it came");
            }
            out.clear();
        }
        eprintln!("{}", tally.report("responses text delta"));
        assert!(
            tally.count_per_event() <= BUDGET * 1.01,
            "{}, budget {BUDGET}",
            tally.report("responses")
        );
        assert!(
            tally.bytes_per_forwarded() <= 2.0,
            "{}, budget 2x the bytes forwarded",
            tally.report("responses")
        );
    }

    #[test]
    fn every_event_passes_numbered_with_the_echo_stripped_everywhere() {
        let (injection, body, canaries) = setup(None);
        let answer = "Mercury, Venus, Earth and Mars are rocky.";
        let mut deltas = vec![
            format!("{} ", canaries.head),
            format!("{}\n", canaries.tail),
        ];
        deltas.extend(answer.split_inclusive(' ').map(str::to_owned));
        let instructions = body["instructions"].as_str().unwrap();
        let events = provider_events(&deltas, instructions, Value::Null);
        let count = events.len();
        let (client, bytes) = relay(events, &injection, None);
        assert_eq!(client.len(), count, "no event dropped: {bytes}");
        for (number, (name, data)) in client.iter().enumerate() {
            assert_eq!(data["sequence_number"], number, "{bytes}");
            assert_eq!(data["type"], *name, "every event has its event: line");
        }
        assert!(!bytes.contains(&canaries.head.to_string()), "{bytes}");
        assert!(!bytes.contains(&canaries.tail.to_string()), "{bytes}");
        assert!(!bytes.contains("[DONE]"));
        assert!(bytes.contains(": x-canarygate-verdict pass"), "{bytes}");
        let deltas: String = client
            .iter()
            .filter(|(name, _)| name == "response.output_text.delta")
            .map(|(_, data)| data["delta"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(deltas, answer);
        let data = |name: &str| &client.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(data("response.output_text.done")["text"], answer);
        assert_eq!(data("response.content_part.done")["part"]["text"], answer);
        assert_eq!(
            data("response.output_item.done")["item"]["content"][0]["text"],
            answer
        );
        let completed = &data("response.completed")["response"];
        assert_eq!(completed["output"][0]["content"][0]["text"], answer);
        assert_eq!(completed["instructions"], "Be brief.");
        assert_eq!(
            data("response.created")["response"]["instructions"],
            "Be brief."
        );
        assert_eq!(completed["usage"]["total_tokens"], 120, "usage as billed");
    }

    /// Texts some providers send only in the events that repeat them: a
    /// reasoning summary in its item's `output_item.done` (OpenAI's
    /// computer-use model), a message in its `.done` events. Each is read
    /// where it first comes, verified as a delta would be, and delivered,
    /// the echo stripped, in every event that repeats it.
    #[test]
    fn texts_sent_only_in_their_repeats_are_read_there() {
        let (injection, body, canaries) = setup(None);
        let echo = format!("{} {}\n", canaries.head, canaries.tail);
        let answer = "Mercury, Venus, Earth and Mars.";
        let whole = format!("{echo}{answer}");
        let summary = "The user wants the rocky planets.";
        let reasoning = |text: &str| {
            json!({"id": "rs_1", "type": "reasoning",
                   "summary": [{"type": "summary_text", "text": text}]})
        };
        let message = |text: &str| {
            json!({"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]})
        };
        let at = |kind: &str| json!({"type": kind, "item_id": "msg_1", "output_index": 1, "content_index": 0});
        let mut text_done = at("response.output_text.done");
        text_done["text"] = json!(whole);
        let mut part_done = at("response.content_part.done");
        part_done["part"] = json!({"type": "output_text", "text": whole, "annotations": []});
        let instructions = body["instructions"].as_str().unwrap();
        let response = |output: Value| {
            json!({"id": "resp_1", "object": "response", "status": "completed",
                   "instructions": instructions, "output": output})
        };
        let events = numbered(vec![
            json!({"type": "response.created", "response": response(json!([]))}),
            json!({"type": "response.output_item.added", "output_index": 0,
                   "item": {"id": "rs_1", "type": "reasoning", "summary": []}}),
            json!({"type": "response.output_item.done", "output_index": 0,
                   "item": reasoning(summary)}),
            json!({"type": "response.output_item.added", "output_index": 1,
                   "item": {"id": "msg_1", "type": "message", "status": "in_progress",
                            "role": "assistant", "content": []}}),
            text_done,
            part_done,
            json!({"type": "response.output_item.done", "output_index": 1,
                   "item": message(&whole)}),
            json!({"type": "response.completed",
                   "response": response(json!([reasoning(summary), message(&whole)]))}),
        ]);
        let (client, bytes) = relay(events, &injection, None);
        assert!(!bytes.contains(&canaries.head.to_string()), "{bytes}");
        assert!(bytes.contains(": x-canarygate-verdict pass"), "{bytes}");
        let data = |name: &str, nth: usize| {
            &client
                .iter()
                .filter(|(n, _)| n == name)
                .nth(nth)
                .unwrap_or_else(|| panic!("no {name} in {bytes}"))
                .1
        };
        let item = data("response.output_item.done", 0);
        assert_eq!(item["item"]["summary"][0]["text"], summary, "{bytes}");
        assert_eq!(data("response.output_text.done", 0)["text"], answer);
        assert_eq!(
            data("response.content_part.done", 0)["part"]["text"],
            answer
        );
        let item = data("response.output_item.done", 1);
        assert_eq!(item["item"]["content"][0]["text"], answer);
        let output = &data("response.completed", 0)["response"]["output"];
        assert_eq!(output[0]["summary"][0]["text"], summary);
        assert_eq!(output[1]["content"][0]["text"], answer);
    }

    /// A reply that is only a refusal, opened with the echo: the refusal's
    /// deltas, its `.done` and the final response carry it without.
    #[test]
    fn a_refusal_that_opens_with_the_echo_is_delivered_without_it() {
        let (injection, body, canaries) = setup(None);
        let echo = format!("{} {}\n", canaries.head, canaries.tail);
        let refusal = "I can't help with that.";
        let at = |kind: &str| json!({"type": kind, "item_id": "msg_1", "output_index": 0, "content_index": 0});
        let message = |text: &str| {
            json!({"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
                   "content": [{"type": "refusal", "refusal": text}]})
        };
        let instructions = body["instructions"].as_str().unwrap();
        let mut events = vec![
            json!({"type": "response.created", "response": {"id": "resp_1",
                   "instructions": instructions, "output": []}}),
            json!({"type": "response.output_item.added", "output_index": 0,
                   "item": {"id": "msg_1", "type": "message", "role": "assistant",
                            "content": []}}),
        ];
        for piece in [echo.as_str(), refusal] {
            let mut delta = at("response.refusal.delta");
            delta["delta"] = json!(piece);
            events.push(delta);
        }
        let mut done = at("response.refusal.done");
        done["refusal"] = json!(format!("{echo}{refusal}"));
        events.push(done);
        events.push(
            json!({"type": "response.output_item.done", "output_index": 0,
                           "item": message(&format!("{echo}{refusal}"))}),
        );
        events.push(
            json!({"type": "response.completed", "response": {"id": "resp_1",
            "status": "completed", "instructions": instructions,
            "output": [message(&format!("{echo}{refusal}"))]}}),
        );
        let (client, bytes) = relay(numbered(events), &injection, None);
        assert!(!bytes.contains(&canaries.head.to_string()), "{bytes}");
        let deltas: String = client
            .iter()
            .filter(|(name, _)| name == "response.refusal.delta")
            .map(|(_, data)| data["delta"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(deltas, refusal, "{bytes}");
        let data = |name: &str| &client.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(data("response.refusal.done")["refusal"], refusal);
        assert_eq!(
            data("response.completed")["response"]["output"][0]["content"][0]["refusal"],
            refusal
        );
    }

    /// A repeat whose text no delta carried, for an item the stream had
    /// already left (its text would go back before texts already read):
    /// not read, and the stream ends instead of passing it on.
    #[test]
    fn a_repeat_for_an_item_the_stream_left_ends_it() {
        let (injection, _, canaries) = setup(None);
        let registry = MemoryRegistry::new(b"test");
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let mut writer = writer(None, &injection);
        let mut memo = StreamMemo::default();
        let echo = format!("{} {}\n", canaries.head, canaries.tail);
        let events = numbered(vec![
            json!({"type": "response.output_item.added", "output_index": 0,
                   "item": {"id": "rs_1", "type": "reasoning", "summary": []}}),
            json!({"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 1,
                   "content_index": 0, "delta": format!("{echo}Mercury.")}),
            json!({"type": "response.output_item.done", "output_index": 0,
                   "item": {"id": "rs_1", "type": "reasoning", "summary": [
                       {"type": "summary_text", "text": "Plan."}]}}),
        ]);
        let mut out = Vec::new();
        let mut read_back = 0;
        for event in events {
            let EventView::Chunk(chunk) = Responses::read_stream_event(&event, &mut memo) else {
                panic!("a chunk");
            };
            if let Some(place) = chunk.place {
                assert!(memo.keeps_order(place));
            }
            read_back += chunk.texts().count();
            let spans = feed(&chunk, &event.data, &mut verifier, &registry);
            writer.take(chunk, event, spans);
            writer.flush(&verifier, false, &mut out);
        }
        writer.flush(&verifier, true, &mut out);
        assert_eq!(read_back, 1, "only the delta's text was read");
        assert_eq!(writer.failure(), Some(REPEATED_UNDELIVERED));
        assert!(!String::from_utf8_lossy(&out).contains("Plan."));
    }

    #[test]
    fn a_cut_at_the_clients_limit_ends_incomplete() {
        // The API's least limit, 16: words of up to four letters are a
        // token each by the estimate.
        let (injection, body, canaries) = setup(Some(16));
        let words = [
            "one", "two", "six", "ten", "red", "sun", "sky", "sea", "cat", "dog", "owl", "elk",
            "fox", "bee", "ant", "cow", "pig", "hen", "ram", "yak",
        ];
        let mut deltas = vec![format!("{} {}\n", canaries.head, canaries.tail)];
        deltas.extend(words.map(|word| format!("{word} ")));
        let limit = body["max_output_tokens"].clone();
        assert_eq!(limit, 16 + COST.allowance(2));
        let events = provider_events(&deltas, body["instructions"].as_str().unwrap(), limit);
        let (client, bytes) = relay(events, &injection, Some(16));
        let (name, last) = client.last().unwrap();
        assert_eq!(name, "response.incomplete", "{bytes}");
        let response = &last["response"];
        assert_eq!(response["status"], "incomplete");
        assert_eq!(
            response["incomplete_details"]["reason"],
            "max_output_tokens"
        );
        assert_eq!(response["max_output_tokens"], 16, "the client's own limit");
        let text = response["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap();
        let first_16: String = words[..16].iter().map(|word| format!("{word} ")).collect();
        assert_eq!(text, first_16);
        assert_eq!(response["output"][0]["status"], "incomplete");
    }
}
