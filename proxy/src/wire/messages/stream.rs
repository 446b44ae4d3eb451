//! A Messages stream: the provider's events read for the verifier, and the
//! client's side of a verified stream, the provider's own events held until
//! their text is verified and passed on edited.
//!
//! Events (research: Anthropic's streaming docs and the SDK's
//! `lib/streaming/_messages.py`): `message_start` (the message, its input
//! usage), per content block `content_block_start`, `content_block_delta`
//! (`text_delta` is content, `thinking_delta` reasoning, `input_json_delta`
//! the tool's arguments, `signature_delta` opaque) and `content_block_stop`,
//! `message_delta` (the stop reason and cumulative usage), `message_stop`
//! (the end marker), `ping`, and `error`. Any other string in them (a
//! provider's own member of the message, of a block's stop, of the delta)
//! holding a canary-shaped span is verified too. The SDK drops events without an
//! `event:` line, so every event is written with its name. An emptied delta
//! is dropped; so is a text block whose every text was removed (the echo
//! alone in its block, a block past the client's limit), start and stop,
//! as a whole answer drops it: Anthropic refuses an empty text block sent
//! back in the next turn. So is a thinking block whose reasoning the
//! verifier withheld (cut at the limit before the reply; its signature
//! forbids emptying it). The SDK addresses blocks by their `index`, so
//! the blocks after a dropped one are numbered down to stay consecutive.
//!
//! Longer than 500 lines: the reading of each event type and the writer
//! that holds, edits, drops and renumbers those events are one protocol,
//! read best side by side.

use crate::wire::held::{Held, HeldEvents};
use std::ops::Range;

use canarygate_policies::canary::find_canaries;
use canarygate_policies::sse::{SpentBuffers, SseEvent, encode_data, encode_json};
use canarygate_policies::verify::{Part, ProviderUsage, Verdict, Verifier};
use serde_json::Value;

use super::answer::{block_texts, finish_reason, residual_strings, usage_of};
use super::deliver::{cut_stop_reason, edit_texts};
use super::error::{is_error_value, message_of};
use crate::wire::edit::Delivery;
use crate::wire::format::{
    ChoiceView, Chunk, EventView, Spans, StreamWriter, TextField, TextFields, canary_shaped_names,
};
use crate::wire::location::{Key, Location};

/// The end marker's name (and its data's `type`).
pub const MESSAGE_STOP: &str = "message_stop";

/// The event's type: its data's `type`, else its `event:` name.
fn event_type<'a>(event: &'a SseEvent, data: &'a Value) -> &'a str {
    data.get("type")
        .and_then(Value::as_str)
        .or(event.event.as_deref())
        .unwrap_or("")
}

/// Whether `event` is `message_stop`.
pub fn is_end_marker(event: &SseEvent) -> bool {
    event.event.as_deref() == Some(MESSAGE_STOP)
        || serde_json::from_str::<Value>(&event.data)
            .is_ok_and(|data| data.get("type").and_then(Value::as_str) == Some(MESSAGE_STOP))
}

/// [`MessagesStream::failure`] of an event that had to change and has no
/// tree (unreachable for what the light reading accepts; never passed on
/// unedited).
const UNEDITABLE: &str = "sent an event that must be edited and cannot be";

/// One event of the provider's stream, as the verifier reads it: a text or
/// thinking delta without its tree ([`light`](super::light)), any other
/// event from its tree.
pub fn read_event(event: &SseEvent) -> EventView {
    // The event's name goes to the client as the provider wrote it, and
    // SDKs read it: one with a canary-shaped span in it is no event of a
    // real stream.
    if event
        .event
        .as_deref()
        .is_some_and(|name| find_canaries(name).next().is_some())
    {
        return EventView::Malformed;
    }
    match super::light::read(&event.data) {
        Some(chunk) => EventView::Chunk(chunk),
        None => read_tree(event),
    }
}

/// [`read_event`] from the event's JSON tree.
pub(super) fn read_tree(event: &SseEvent) -> EventView {
    let Ok(data) = serde_json::from_str::<Value>(&event.data) else {
        return EventView::Malformed;
    };
    if !data.is_object() {
        return EventView::Malformed;
    }
    let kind = event_type(event, &data).to_owned();
    // A block's events name it by a count, which SDKs place it by (Node's
    // at `content[index]`, where `-1` is no block and `"1"` is 1): any other
    // would have canarygate join pieces the SDK keeps apart.
    if kind.starts_with("content_block_") && data.get("index").and_then(Value::as_u64).is_none() {
        return EventView::Malformed;
    }
    let mut texts = TextFields::new();
    let mut finish = None;
    let mut usage = None;
    let mut carries_choice = true;
    let mut place = None;
    match kind.as_str() {
        MESSAGE_STOP => return EventView::Done,
        "error" if is_error_value(&data) => return EventView::Error(message_of(&data)),
        "error" => return EventView::Error("error event without an error object".into()),
        "message_start" => {
            // Every string of the message: its own members (a provider's),
            // as a whole answer's, and its content, which real providers
            // send empty but SDKs take as the message's first blocks.
            if let Some((at, message)) = Location::ROOT.named(&data, "message") {
                residual_strings(message, at, &mut texts);
            }
            carries_choice = !texts.is_empty();
            // Its output count is not the answer's: the final one comes in
            // `message_delta`.
            usage = usage_of(data.get("message").and_then(|message| message.get("usage"))).map(
                |usage| ProviderUsage {
                    completion_tokens: None,
                    ..usage
                },
            );
        }
        // Nothing of a choice, but any string in it is read.
        "ping" => {
            residual_strings(&data, Location::ROOT, &mut texts);
            carries_choice = !texts.is_empty();
        }
        "content_block_start" => block_texts(
            &data["content_block"],
            Location::ROOT.key(Key::ContentBlock),
            &mut texts,
        ),
        "content_block_delta" => {
            delta_texts(&data, &mut texts);
            place = data.get("index").and_then(Value::as_u64).filter(|_| {
                texts
                    .iter()
                    .any(|field| matches!(field.kind, Part::Content | Part::Reasoning))
            });
        }
        // Any string beside the index, the stop reason and the usage.
        "content_block_stop" => residual_strings(&data, Location::ROOT, &mut texts),
        "message_delta" => {
            residual_strings(&data, Location::ROOT, &mut texts);
            finish = data
                .get("delta")
                .and_then(|delta| delta.get("stop_reason"))
                .and_then(Value::as_str)
                .map(finish_reason);
            // Without `input_tokens` it reports only the output count, and
            // the prompt's stays the one `message_start` reported.
            usage = usage_of(data.get("usage"));
        }
        // Anything else (a new event type) is read for canary-shaped text.
        _ => residual_strings(&data, Location::ROOT, &mut texts),
    }
    let before_names = texts.len();
    canary_shaped_names(&data, Location::ROOT, 0, &mut texts);
    carries_choice |= texts.len() > before_names;
    let choices = if carries_choice {
        smallvec::smallvec![ChoiceView {
            index: 0,
            position: 0,
            texts,
            finish_reason: finish,
        }]
    } else {
        Default::default()
    };
    let mut chunk = Chunk::parsed(data, choices, usage);
    chunk.place = place.map(super::light::block_place);
    EventView::Chunk(chunk)
}

/// The text fields of a `content_block_delta`.
fn delta_texts(data: &Value, texts: &mut TextFields) {
    let delta = &data["delta"];
    let at = Location::ROOT.key(Key::Delta);
    let index = data
        .get("index")
        .and_then(Value::as_u64)
        .unwrap_or(0)
        .min(u64::from(u32::MAX)) as u32;
    let own = match delta.get("type").and_then(Value::as_str) {
        Some("text_delta") => Some((Key::Text, Part::Content)),
        Some("thinking_delta") => Some((Key::Thinking, Part::Reasoning)),
        Some("input_json_delta") => Some((Key::PartialJson, Part::ToolArguments(index))),
        // `signature_delta`, `citations_delta` and anything new.
        _ => None,
    };
    let own = own.filter(|(key, _)| delta.get(key.name()).is_some_and(Value::is_string));
    if let Some((key, kind)) = own {
        texts.push(TextField {
            choice: 0,
            kind,
            at: at.key(key),
        });
    }
    // Any other string of the delta, or of the event beside it.
    for (position, (member, value)) in delta.as_object().into_iter().flatten().enumerate() {
        if own.is_none_or(|(key, _)| key.name() != member) {
            residual_strings(value, at.member(position), texts);
        }
    }
    for (position, (member, value)) in data.as_object().into_iter().flatten().enumerate() {
        if member != "delta" {
            residual_strings(value, Location::ROOT.member(position), texts);
        }
    }
}

/// A text block's `content_block_start`, held back until the block shows
/// text.
struct TextStart {
    /// The event, encoded for the client.
    bytes: Vec<u8>,
    /// The provider wrote text in the block (all of it removed so far).
    had_text: bool,
}

/// The client's side of a verified Messages stream (see the module docs).
/// Events leave in the order they came: `message_start` and every event
/// without text wait until text of the answer is released (so nothing
/// reaches the client before the echo is verified), events with text until
/// their text is, `message_delta` until the verdict.
pub struct MessagesStream {
    delivery: Delivery,
    held: HeldEvents,
    /// The start of the text block under way, written out once the block
    /// shows text (dropped with the block if it never does).
    text_start: Option<TextStart>,
    /// Text blocks dropped so far: later blocks' `index` is lowered by it.
    dropped_blocks: u64,
    /// A thinking block whose reasoning was withheld is under way: its
    /// events are dropped to its stop ([`Self::drops_withheld_thinking`]).
    in_withheld_thinking: bool,
    /// An event had to change and could not be edited
    /// ([`StreamWriter::failure`]).
    failure: Option<&'static str>,
    /// Buffers of events written out ([`StreamWriter::spent`]).
    spent: SpentBuffers,
}

impl MessagesStream {
    /// A writer delivering by `delivery`.
    pub fn new(mut delivery: Delivery) -> Self {
        // Signed thinking is never cut (`super::deliver`).
        delivery.keep_reasoning_whole();
        Self {
            delivery,
            held: HeldEvents::default(),
            text_start: None,
            dropped_blocks: 0,
            in_withheld_thinking: false,
            failure: None,
            spent: SpentBuffers::default(),
        }
    }

    /// Writes the held start of the text block under way, now that the
    /// block shows text.
    fn open_text_block(&mut self, out: &mut Vec<u8>) {
        if let Some(start) = self.text_start.take() {
            out.extend_from_slice(&start.bytes);
        }
    }

    /// Whether `event` belongs to a thinking block whose reasoning the
    /// verifier withheld (a reply the token limit cut in reasoning nothing
    /// vouches for): its start, deltas (thinking and signature) and stop are
    /// dropped, as the block's signature forbids emptying its text, and the
    /// blocks after it are numbered down.
    fn drops_withheld_thinking(
        &mut self,
        chunk: &Chunk,
        event: &SseEvent,
        verifier: &Verifier,
    ) -> bool {
        if !verifier.withholds_reasoning(0) {
            return false;
        }
        // A light event is a block's delta, named or not.
        let kind = if chunk.is_light() {
            "content_block_delta"
        } else {
            event_type(event, &chunk.event)
        };
        match kind {
            "content_block_start" => {
                self.in_withheld_thinking =
                    chunk.event["content_block"]["type"].as_str() == Some("thinking");
                self.in_withheld_thinking
            }
            "content_block_delta" => self.in_withheld_thinking,
            "content_block_stop" if self.in_withheld_thinking => {
                self.in_withheld_thinking = false;
                self.dropped_blocks += 1;
                true
            }
            _ => false,
        }
    }

    /// Whether a light event (a text or thinking delta) goes out as the
    /// provider sent it: its text passes whole, and is then accounted for;
    /// otherwise nothing changed and the event is edited from its tree.
    fn passes_unchanged(
        &mut self,
        chunk: &Chunk,
        data: &str,
        spans: &[Range<usize>],
        verifier: &Verifier,
    ) -> bool {
        match (chunk.texts().next(), spans.first()) {
            (Some(field), Some(span)) => self.delivery.admit_whole(
                field.choice,
                field.kind,
                chunk.with_data(data).text(field),
                span.clone(),
                verifier.release_of(field.choice, field.kind),
            ),
            _ => true,
        }
    }

    fn ready(held: &Held, verifier: &Verifier) -> bool {
        if held.ends {
            return false;
        }
        if held.chunk.texts().next().is_none() {
            return verifier.released_any();
        }
        verifier.may_show(0)
            && held.chunk.texts().zip(&held.spans).all(|(field, span)| {
                verifier.release_of(field.choice, field.kind).through >= span.end
            })
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
        if self.drops_withheld_thinking(&chunk, event, verifier) {
            return;
        }
        // Once a block was dropped, every later block's index changes.
        if chunk.is_light()
            && self.dropped_blocks == 0
            && self.passes_unchanged(&chunk, &event.data, &spans, verifier)
        {
            // A light event is a block's delta.
            self.open_text_block(out);
            out.extend_from_slice(b"event: ");
            let name = event.event.as_deref().unwrap_or("content_block_delta");
            out.extend_from_slice(name.as_bytes());
            out.push(b'\n');
            encode_data(&event.data, out);
            return;
        }
        if chunk.is_light() && !chunk.build_tree(&event.data) {
            self.failure = Some(UNEDITABLE);
            return;
        }
        let fields: Vec<_> = chunk.texts().copied().zip(spans).collect();
        let edited = edit_texts(&mut chunk.event, &fields, verifier, &mut self.delivery);
        let mut changed = edited.changed;
        let kind = event_type(event, &chunk.event).to_owned();
        if edited.emptied && kind == "content_block_delta" {
            // All its text was canarygate's (or past the client's limit).
            if let Some(start) = &mut self.text_start {
                start.had_text = true;
            }
            return;
        }
        if self.dropped_blocks > 0
            && let Some(index) = chunk.event.get("index").and_then(Value::as_u64)
        {
            chunk.event["index"] = Value::from(index.saturating_sub(self.dropped_blocks));
            changed = true;
        }
        let usage = match kind.as_str() {
            "message_start" => chunk
                .event
                .get_mut("message")
                .and_then(|message| message.get_mut("usage")),
            "message_delta" => {
                if let Some(delta) = chunk.event.get_mut("delta") {
                    changed |= cut_stop_reason(delta, &self.delivery);
                }
                chunk.event.get_mut("usage")
            }
            _ => None,
        };
        if let Some(usage) = usage.filter(|usage| usage.is_object()) {
            changed |= self.delivery.report_usage(usage);
        }
        let name = event.event.as_deref().unwrap_or(&kind);
        let encode = |into: &mut Vec<u8>| {
            into.extend_from_slice(b"event: ");
            into.extend_from_slice(name.as_bytes());
            into.push(b'\n');
            if changed {
                encode_json(&chunk.event, into);
            } else {
                encode_data(&event.data, into);
            }
        };
        match kind.as_str() {
            "content_block_start" if is_empty_text_block(&chunk.event) => {
                // Held until the block shows text.
                let mut bytes = Vec::new();
                encode(&mut bytes);
                self.text_start = Some(TextStart {
                    bytes,
                    had_text: edited.emptied,
                });
                return;
            }
            "content_block_stop" => match self.text_start.take() {
                Some(start) if start.had_text => {
                    // The block's every text was removed: it goes whole.
                    self.dropped_blocks += 1;
                    return;
                }
                // The provider's own empty block.
                Some(start) => out.extend_from_slice(&start.bytes),
                None => {}
            },
            // Any delta of the block (text, citations) opens it first; an
            // emptied one never got here.
            "content_block_delta" => self.open_text_block(out),
            _ => {}
        }
        encode(out);
    }
}

/// Whether `start`, a `content_block_start`, opens a text block with no
/// text (yet).
fn is_empty_text_block(start: &Value) -> bool {
    let block = &start["content_block"];
    block.get("type").and_then(Value::as_str) == Some("text")
        && block
            .get("text")
            .and_then(Value::as_str)
            .unwrap_or("")
            .is_empty()
}

impl StreamWriter for MessagesStream {
    fn take(&mut self, chunk: Chunk, event: SseEvent, spans: Spans) {
        // A light event is a block's delta.
        let ends = !chunk.is_light() && event_type(&event, &chunk.event) == "message_delta";
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

    fn done(&self, verdict: &Verdict) -> Vec<u8> {
        let mut tail = b": x-canarygate-verdict ".to_vec();
        tail.extend_from_slice(verdict.header_value().as_bytes());
        tail.extend_from_slice(b"\n: x-canarygate-overhead-tokens ");
        tail.extend_from_slice(self.delivery.overhead_header().as_bytes());
        tail.extend_from_slice(b"\n\nevent: message_stop\n");
        encode_data(r#"{"type":"message_stop"}"#, &mut tail);
        tail
    }
}
