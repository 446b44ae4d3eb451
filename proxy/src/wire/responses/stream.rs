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

use std::collections::VecDeque;
use std::ops::Range;

use canarygate_policies::sse::{SseEvent, encode_data};
use canarygate_policies::verify::{Verdict, Verifier};
use serde_json::{Value, json};

use super::answer::{delta_part, event_type};
use super::deliver::{
    Delivered, Slot, follow_logprobs, mark_cut, report_usage, restore_request_fields, rewrite_item,
    rewrite_part,
};
use crate::wire::edit::{Delivery, apply};
use crate::wire::format::{Chunk, StreamWriter, put_text};

/// One provider event waiting for its text to be verified.
struct Held {
    chunk: Chunk,
    /// The event as received.
    event: SseEvent,
    /// The span of its part each text field carried.
    spans: Vec<Range<usize>>,
    /// It ends the answer (`response.completed` / `incomplete`): it waits
    /// for the verdict.
    ends: bool,
}

/// The client's side of a verified Responses stream (see the module docs).
pub struct ResponsesStream {
    delivery: Delivery,
    held: VecDeque<Held>,
    delivered: Delivered,
}

impl ResponsesStream {
    /// A writer delivering by `delivery`.
    pub fn new(delivery: Delivery) -> Self {
        Self {
            delivery,
            held: VecDeque::new(),
            delivered: Delivered::new(),
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

    fn write(&mut self, held: Held, verifier: &Verifier, out: &mut Vec<u8>) {
        let Held {
            mut chunk,
            event,
            spans,
            ..
        } = held;
        let original = chunk.event.clone();
        let kind = event_type(&original, &event).to_owned();
        let data = &mut chunk.event;
        let at_index = |key: &str| data.get(key).and_then(Value::as_u64).unwrap_or(0);
        let output_index = at_index("output_index");
        let content_index = at_index("content_index");
        let summary_index = at_index("summary_index");
        let slot = match kind.as_str() {
            "response.reasoning_summary_text.delta"
            | "response.reasoning_summary_text.done"
            | "response.reasoning_summary_part.added"
            | "response.reasoning_summary_part.done" => Slot::Summary(summary_index),
            "response.function_call_arguments.delta" | "response.function_call_arguments.done" => {
                Slot::Arguments
            }
            _ => Slot::Content(content_index),
        };
        let fields: Vec<_> = chunk
            .choices
            .iter()
            .flat_map(|choice| &choice.texts)
            .copied()
            .collect();
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
            if delta_part(&kind, &original).is_some() {
                let shown = self.delivered.entry((output_index, slot)).or_default();
                shown.text.push_str(&kept);
                if let Some(entries) = original.get("logprobs").and_then(Value::as_array) {
                    let followed = follow_logprobs(entries, &text, &edit.kept);
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
        let cut = self.delivery.was_cut(0);
        let shown = self
            .delivered
            .get(&(output_index, slot))
            .cloned()
            .unwrap_or_default();
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
            "response.function_call_arguments.done" => data["arguments"] = json!(shown.text),
            "response.content_part.added"
            | "response.content_part.done"
            | "response.reasoning_summary_part.added"
            | "response.reasoning_summary_part.done" => {
                if let Some(part) = data.get_mut("part") {
                    rewrite_part(part, &shown);
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
            | "response.incomplete" => {
                let mut restored = original.get("response").cloned().unwrap_or(Value::Null);
                if let Some(response) = data.get_mut("response").filter(|value| value.is_object()) {
                    if restore_request_fields(&mut restored) {
                        response["instructions"] = restored["instructions"].clone();
                        response["max_output_tokens"] = restored["max_output_tokens"].clone();
                    }
                    if let Some(items) = response.get_mut("output").and_then(Value::as_array_mut) {
                        for (index, item) in items.iter_mut().enumerate() {
                            rewrite_item(item, index as u64, &self.delivered, cut);
                        }
                    }
                    report_usage(response, &self.delivery);
                    if cut && kind == "response.completed" {
                        mark_cut(response);
                        data["type"] = json!("response.incomplete");
                    }
                }
            }
            _ => {}
        }
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
            encode_data(&data.to_string(), out);
        }
    }
}

impl StreamWriter for ResponsesStream {
    fn take(&mut self, chunk: Chunk, event: SseEvent, spans: Vec<Range<usize>>) {
        let ends = chunk
            .choices
            .iter()
            .any(|choice| choice.finish_reason.is_some());
        self.held.push_back(Held {
            chunk,
            event,
            spans,
            ends,
        });
    }

    fn flush(&mut self, verifier: &Verifier, at_end: bool, out: &mut Vec<u8>) {
        while let Some(held) = self.held.front() {
            if !at_end && !Self::ready(held, verifier) {
                return;
            }
            let held = self.held.pop_front().expect("just looked at it");
            self.write(held, verifier, out);
        }
    }

    fn delivery(&self) -> &Delivery {
        &self.delivery
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
