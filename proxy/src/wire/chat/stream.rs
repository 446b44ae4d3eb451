//! The client's side of a verified Chat Completions stream: the provider's
//! own chunks, held until their text is verified, passed on edited.
//!
//! Legacy completions stream the same way (chunks with `choices`, a usage
//! chunk without, `data: [DONE]`) with text elsewhere in a choice: the writer
//! takes the chunk editing as a [`ChunkEditor`].
//!
//! canarygate asks every stream for its usage; for a client that did not,
//! the usage chunk is dropped and the `"usage": null` a provider puts on
//! every other chunk is taken out ([`encode_without_null_usage`]).
//!
//! Longer than 500 lines: about 390 of them are the unit tests, which relay
//! whole streams through the writer's private state (held chunks, the
//! light path against the tree path, the allocation budget).

use crate::wire::held::{Held, HeldEvents};
use std::ops::Range;

use canarygate_policies::sse::{SpentBuffers, SseEvent, encode_data, encode_json};
use canarygate_policies::verify::{Verdict, Verifier};
use serde_json::Value;

use super::deliver::{Edited, edit_fields};
use super::null_usage::encode_without_null_usage;
use crate::wire::edit::{Delivery, apply};
use crate::wire::format::{ChoiceView, Chunk, Spans, StreamWriter, TextField, put_text};

/// Edits one chunk for the client, as the format's whole answers are edited:
/// its text `fields` (each with the span of its part it carried) become what
/// `verifier` and `delivery` leave of them, with what follows the text.
pub trait ChunkEditor: Send + 'static {
    /// Edits `chunk`, whose choices are `choices`.
    fn edit(
        &mut self,
        chunk: &mut Value,
        choices: &[ChoiceView],
        fields: &[(TextField, Range<usize>)],
        verifier: &Verifier,
        delivery: &mut Delivery,
    ) -> Edited;
}

/// Chat Completions chunks: [`edit_fields`].
pub struct ChatChunks;

impl ChunkEditor for ChatChunks {
    fn edit(
        &mut self,
        chunk: &mut Value,
        choices: &[ChoiceView],
        fields: &[(TextField, Range<usize>)],
        verifier: &Verifier,
        delivery: &mut Delivery,
    ) -> Edited {
        edit_fields(chunk, choices, fields, verifier, delivery)
    }
}

/// [`StreamWriter::failure`] of a chunk that had to change and has no tree
/// (a number no `serde_json::Value` holds, which the light reading skips).
const UNEDITABLE: &str = "sent a chunk that must be edited and cannot be (a number out of range)";

/// What [`ChatStream::admit_light`] leaves of a light chunk.
enum LightEdit {
    /// It goes out as the provider sent it.
    Unchanged,
    /// Nothing of it goes out.
    Dropped,
    /// Its one text field becomes this text.
    Text(String),
}

/// The client's side of a verified Chat Completions stream (see the module
/// docs). Chunks leave in the order they came; a chunk whose every text
/// was removed (the echo) is dropped, one that nothing changed goes out as
/// the provider's own bytes. `E` edits the chunks.
pub struct ChatStream<E = ChatChunks> {
    delivery: Delivery,
    held: HeldEvents,
    editor: E,
    /// A chunk had to change and could not be edited
    /// ([`StreamWriter::failure`]).
    failure: Option<&'static str>,
    /// Data of chunks written out ([`StreamWriter::spent`]).
    spent: SpentBuffers,
}

impl ChatStream {
    /// A writer of Chat Completions chunks delivering by `delivery` (their
    /// annotations point into the delivered content).
    pub fn new(mut delivery: Delivery) -> Self {
        delivery.follow_content_positions();
        Self::with_editor(delivery, ChatChunks)
    }
}

impl<E: ChunkEditor> ChatStream<E> {
    /// A writer delivering by `delivery`, its chunks edited by `editor`.
    pub fn with_editor(delivery: Delivery, editor: E) -> Self {
        Self {
            delivery,
            held: HeldEvents::default(),
            editor,
            failure: None,
            spent: SpentBuffers::default(),
        }
    }

    /// Whether `held` may go out now, before the verdict. A chunk with no
    /// choice (Azure's `prompt_filter_results`, keep-alives) waits until the
    /// answer has begun: it must not open the client's stream before the
    /// echo passed.
    fn ready(held: &Held, verifier: &Verifier) -> bool {
        if held.chunk.choices.is_empty() {
            return !held.ends && verifier.released_any();
        }
        !held.ends
            && held
                .chunk
                .choices
                .iter()
                .all(|choice| verifier.may_show(choice.index))
            && held.chunk.texts().zip(&held.spans).all(|(field, span)| {
                verifier.release_of(field.choice, field.kind).through >= span.end
            })
    }

    /// Whether a light chunk (see [`Chunk::light`]) goes out as the
    /// provider sent it: no choice of it was cut at the client's limit
    /// (its finish reason stays), and its text, if any, passes whole. Then
    /// its text is accounted for; otherwise nothing changed and the chunk is
    /// edited from its tree.
    fn passes_unchanged(
        &mut self,
        chunk: &Chunk,
        data: &str,
        spans: &[Range<usize>],
        verifier: &Verifier,
    ) -> bool {
        let cut = chunk.choices.iter().any(|choice| {
            choice
                .finish_reason
                .as_deref()
                .is_some_and(|reason| reason != "length" && self.delivery.was_cut(choice.index))
        });
        if cut {
            return false;
        }
        // A light chunk carries at most one text.
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

    /// How a light chunk's text changes, when its text is all that may
    /// change: it has one text field, in a chunk where no choice finishes
    /// (a finish reason may turn to `length`) and no logprobs follow the
    /// text. Then the text is accounted for as [`edit_fields`] accounts for
    /// it, and the answer is the one that edit gives; otherwise (`None`)
    /// nothing is accounted for and the chunk is edited from its tree.
    fn admit_light(
        &mut self,
        chunk: &Chunk,
        data: &str,
        spans: &[Range<usize>],
        verifier: &Verifier,
    ) -> Option<LightEdit> {
        if chunk
            .choices
            .iter()
            .any(|choice| choice.finish_reason.is_some())
        {
            return None;
        }
        let (field, span) = (chunk.texts().next()?, spans.first()?);
        let text = chunk.with_data(data).text(field);
        let edit = self.delivery.admit(
            field.choice,
            field.kind,
            text,
            span.clone(),
            verifier.release_of(field.choice, field.kind),
        );
        Some(if edit.unchanged() {
            LightEdit::Unchanged
        } else if edit.kept.iter().all(Range::is_empty) && !chunk.light_keeps_other_fields() {
            // Its text was there and is all removed, and nothing else is
            // in the chunk.
            LightEdit::Dropped
        } else {
            LightEdit::Text(apply(text, &edit.kept))
        })
    }

    /// Writes one held chunk (its data as received) to `out` as the
    /// verifier and the delivery leave it.
    fn write(
        &mut self,
        mut chunk: Chunk,
        data: &str,
        spans: Spans,
        verifier: &Verifier,
        out: &mut Vec<u8>,
    ) {
        if chunk.is_light() {
            if self.passes_unchanged(&chunk, data, &spans, verifier) {
                return self.pass(data, out);
            }
            match self.admit_light(&chunk, data, &spans, verifier) {
                Some(LightEdit::Unchanged) => return self.pass(data, out),
                Some(LightEdit::Dropped) => return,
                Some(LightEdit::Text(text)) => {
                    let field = chunk.texts().next().copied();
                    match field {
                        Some(field) if chunk.build_tree(data) => {
                            put_text(&mut chunk.event, &field, text);
                            self.remove_null_usage(&mut chunk.event);
                            encode_json(&chunk.event, out);
                        }
                        _ => self.failure = Some(UNEDITABLE),
                    }
                    return;
                }
                None => {}
            }
            if !chunk.build_tree(data) {
                // It must change and cannot be edited: it never goes out
                // as it came (its text may hold the echo), and the stream
                // does not go on without it.
                self.failure = Some(UNEDITABLE);
                return;
            }
        }
        let fields: Vec<_> = chunk.texts().copied().zip(spans).collect();
        let edited = self.editor.edit(
            &mut chunk.event,
            &chunk.choices,
            &fields,
            verifier,
            &mut self.delivery,
        );
        let mut changed = edited.changed;
        let has_choices = chunk
            .event
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|choices| !choices.is_empty());
        if chunk.event.get("usage").is_some_and(Value::is_object) {
            // The usage chunk (no choices) is the one canarygate asked for;
            // usage beside choices is the provider's own habit (Mistral
            // sends it on the last chunk whatever was asked), and goes on.
            if self.delivery.client_wants_usage() || has_choices {
                if let Some(usage) = chunk.event.get_mut("usage") {
                    changed |= self.delivery.report_usage(usage);
                }
            } else if let Some(event) = chunk.event.as_object_mut() {
                // canarygate asked for it; the client did not.
                event.remove("usage");
                changed = true;
            }
        }
        let has_usage = chunk.event.get("usage").is_some_and(Value::is_object);
        let only_removed_text = edited.emptied && !edited.keeps_other_fields;
        if (!has_choices && !has_usage && changed) || (has_choices && only_removed_text) {
            return;
        }
        if changed {
            self.remove_null_usage(&mut chunk.event);
            encode_json(&chunk.event, out);
        } else {
            self.pass(data, out);
        }
    }

    /// Writes a chunk that needs no edit of its text (`data`, as received),
    /// less the `"usage": null` canarygate's request for usage brought, when
    /// the client did not ask for it ([`encode_without_null_usage`]).
    fn pass(&self, data: &str, out: &mut Vec<u8>) {
        if self.delivery.client_wants_usage() {
            encode_data(data, out);
        } else {
            encode_without_null_usage(data, out);
        }
    }

    /// [`Self::pass`] for a chunk edited from its tree.
    fn remove_null_usage(&self, chunk: &mut Value) {
        if !self.delivery.client_wants_usage()
            && chunk.get("usage").is_some_and(Value::is_null)
            && let Some(members) = chunk.as_object_mut()
        {
            members.remove("usage");
        }
    }
}

impl<E: ChunkEditor> StreamWriter for ChatStream<E> {
    fn take(&mut self, chunk: Chunk, event: SseEvent, spans: Spans) {
        // A finish reason ends a choice; the usage chunk (no choices) ends
        // the answer. Usage on every chunk (vLLM's continuous usage stats)
        // does not hold them back.
        let ends = chunk
            .choices
            .iter()
            .any(|choice| choice.finish_reason.is_some())
            || chunk.choices.is_empty() && chunk.event.get("usage").is_some_and(Value::is_object);
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
            self.write(held.chunk, &held.event.data, held.spans, verifier, out);
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
        tail.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        tail
    }
}

#[cfg(test)]
mod tests {
    use canarygate_policies::EchoCost;
    use canarygate_policies::inject::{Injection, RequestCanaries, SystemRole, obedient_echo};
    use canarygate_policies::registry::MemoryRegistry;
    use canarygate_policies::sse::SseParser;
    use canarygate_policies::verify::Facts;
    use canarygate_policies::verify_config::{EchoMode, VerifyConfig};
    use serde_json::json;

    use super::*;
    use crate::wire::chat::Chat;
    use crate::wire::chat::answer::read_choices;
    use crate::wire::edit::{TokenCounter, UsageOptions};
    use crate::wire::format::{EventView, StreamMemo, WireFormat};
    use crate::wire::location::Key;

    /// A streamed request of `max_tokens` with canaries placed, and the
    /// opening an obedient model writes.
    fn placed(max_tokens: u64) -> (Injection, String) {
        let request = json!({"model": "m", "stream": true, "max_tokens": max_tokens,
                             "messages": [{"role": "user", "content": "Name the planets"}]});
        let mut body = Chat::parse_request(request.to_string().as_bytes())
            .unwrap()
            .body;
        let canaries = RequestCanaries::mint();
        let injection = Chat::place_canaries(
            &mut body,
            EchoMode::HeadTail,
            EchoCost::DIGIT_BY_DIGIT,
            canaries,
            SystemRole::Accepted,
        )
        .unwrap();
        (injection, obedient_echo(&body).unwrap())
    }

    /// The provider's chunks: a role chunk, the opening and the answer a
    /// few bytes at a time (so chunks straddle the echo's end and the
    /// client's limit), a role chunk with text, a finish, usage.
    fn provider_chunks(opening: &str) -> Vec<String> {
        let chunk = |delta: Value, finish: Value| {
            json!({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "system_fingerprint": "fp", "choices": [{"index": 0, "delta": delta,
                   "logprobs": null, "finish_reason": finish}], "usage": null})
            .to_string()
        };
        let text = format!("{opening}\nMercury, Venus, Earth, Mars, Jupiter and Saturn.");
        let mut chunks = vec![chunk(
            json!({"role": "assistant", "content": ""}),
            json!(null),
        )];
        let bytes: Vec<char> = text.chars().collect();
        for (at, piece) in bytes.chunks(5).enumerate() {
            let piece: String = piece.iter().collect();
            let delta = if at == 3 {
                json!({"role": "assistant", "content": piece})
            } else {
                json!({"content": piece})
            };
            chunks.push(chunk(delta, json!(null)));
        }
        chunks.push(chunk(json!({}), json!("stop")));
        chunks.push(
            json!({"id": "c1", "choices": [], "usage": {"prompt_tokens": 90,
                   "completion_tokens": 40, "total_tokens": 130}})
            .to_string(),
        );
        chunks
    }

    /// The chunk of `data` as read from its tree, never light.
    fn tree_chunk(data: &str) -> Chunk {
        let value: Value = serde_json::from_str(data).unwrap();
        let choices = read_choices(&value, Key::Delta);
        Chunk::parsed(value, choices, None)
    }

    /// What the client gets of `chunks` under the injection's limit, each
    /// chunk read lightly where it can be (`light`) or always from its tree;
    /// and the writer after the end.
    fn relay(injection: &Injection, chunks: &[String], light: bool) -> (Vec<u8>, ChatStream) {
        let registry = MemoryRegistry::new(b"test");
        let mut verifier = Verifier::new(injection, &VerifyConfig::default(), "p", None);
        let usage = UsageOptions {
            client_wants_usage: false,
            without_canarygate: true,
            overhead_prompt: injection.prompt_tokens_added,
        };
        let limit = injection.client_max_tokens;
        let mut writer = ChatStream::new(Delivery::new(TokenCounter::default(), limit, usage, 1));
        let mut out = Vec::new();
        for data in chunks {
            let event = SseEvent {
                event: None,
                data: data.clone(),
                id: None,
            };
            let chunk = match Chat::read_event(&event) {
                EventView::Chunk(chunk) if light => chunk,
                EventView::Chunk(_) => tree_chunk(data),
                other => panic!("{other:?}"),
            };
            let mut spans = Spans::new();
            for field in chunk.texts() {
                let text = chunk.with_data(&event.data).text(field);
                let start = verifier.received(field.choice, field.kind);
                spans.push(start..start + text.len());
                if !text.is_empty() {
                    verifier.push_part_positions(field.choice, field.kind, text, &registry);
                }
            }
            writer.take(chunk, event, spans);
            writer.flush(&verifier, false, &mut out);
        }
        let facts = Facts {
            finish_reasons: vec![Some("stop".into())],
            usage: None,
            done_marker: Some(true),
        };
        verifier.finish(&facts, &registry);
        writer.flush(&verifier, true, &mut out);
        (out, writer)
    }

    #[test]
    fn light_chunks_are_delivered_as_their_trees_would_be() {
        for max_tokens in [3, 6, 200] {
            let (injection, opening) = placed(max_tokens);
            let chunks = provider_chunks(&opening);
            let (light, light_writer) = relay(&injection, &chunks, true);
            let (tree, tree_writer) = relay(&injection, &chunks, false);
            let light_text = String::from_utf8_lossy(&light);
            assert_eq!(light_text, String::from_utf8_lossy(&tree), "{max_tokens}");
            let overhead = |writer: &ChatStream| writer.delivery().overhead_header();
            assert_eq!(
                overhead(&light_writer),
                overhead(&tree_writer),
                "{max_tokens}"
            );

            let mut events = Vec::new();
            SseParser::new().feed(&light, &mut events);
            let delivered: String = events
                .iter()
                .filter_map(|event| {
                    let chunk: Value = serde_json::from_str(&event.data).ok()?;
                    chunk["choices"][0]["delta"]["content"]
                        .as_str()
                        .map(str::to_owned)
                })
                .collect();
            assert!(!delivered.contains(&opening), "{delivered}");
            assert!(delivered.starts_with("Mercury"), "{delivered}");
            // The role chunk in the answer's middle keeps its role.
            assert_eq!(light_text.matches("\"role\"").count(), 2, "{max_tokens}");
            // The client asked for no usage: neither the usage chunk nor the
            // `usage: null` on every chunk that canarygate's asking brought.
            assert!(!light_text.contains("usage"), "{light_text}");
            if max_tokens == 200 {
                assert!(delivered.ends_with("Saturn."), "{delivered}");
                assert!(light_text.contains("\"stop\""));
            } else {
                assert!(delivered.len() < 30, "cut at the limit: {delivered}");
                assert!(light_text.contains("\"length\""));
            }
        }
    }

    #[test]
    fn usage_beside_choices_is_the_providers_and_goes_on() {
        // Mistral puts usage on its last chunk, beside the finish, whether
        // or not it was asked: the client gets it as direct. The usage chunk
        // without choices is the one canarygate asked for, and goes.
        let (injection, opening) = placed(200);
        let mut chunks = provider_chunks(&opening);
        let usage = json!({"prompt_tokens": 90, "completion_tokens": 40, "total_tokens": 130});
        let finish = chunks.len() - 2;
        let mut last: Value = serde_json::from_str(&chunks[finish]).unwrap();
        last["usage"] = usage;
        chunks[finish] = last.to_string();
        for light in [true, false] {
            let (out, _) = relay(&injection, &chunks, light);
            let mut events = Vec::new();
            SseParser::new().feed(&out, &mut events);
            let with_usage: Vec<Value> = events
                .iter()
                .filter_map(|event| serde_json::from_str::<Value>(&event.data).ok())
                .filter(|chunk| chunk.get("usage").is_some())
                .collect();
            assert_eq!(with_usage.len(), 1, "{light}: {with_usage:?}");
            assert_eq!(with_usage[0]["choices"][0]["finish_reason"], "stop");
            assert!(
                with_usage[0]["usage"]["completion_tokens"]
                    .as_u64()
                    .unwrap()
                    > 0
            );
        }
    }

    #[test]
    fn azures_filter_offsets_point_into_the_delivered_content() {
        // Azure's asynchronous filter: after the finish, chunks with no text
        // whose offsets count characters of the content as the provider
        // wrote it, echo included; the client's limit may cut the content.
        for limit in [200, 6] {
            azure_offsets_follow_the_content(limit);
        }
    }

    /// [`azures_filter_offsets_point_into_the_delivered_content`] at the
    /// client's `limit`.
    fn azure_offsets_follow_the_content(limit: u64) {
        let (injection, opening) = placed(limit);
        let mut chunks = provider_chunks(&opening);
        let written = format!("{opening}\nMercury, Venus, Earth, Mars, Jupiter and Saturn.");
        let end = written.chars().count();
        let annotation = json!({"id": "", "choices": [{"index": 0, "finish_reason": null,
            "delta": {}, "content_filter_offsets": {"check_offset": 0,
            "start_offset": 0, "end_offset": end},
            "content_filter_results": {"hate": {"filtered": false, "severity": "safe"}}}]});
        chunks.insert(chunks.len() - 1, annotation.to_string());
        let (out, _) = relay(&injection, &chunks, true);
        let mut events = Vec::new();
        SseParser::new().feed(&out, &mut events);
        let chunks: Vec<Value> = events
            .iter()
            .filter_map(|event| serde_json::from_str(&event.data).ok())
            .collect();
        let delivered: String = chunks
            .iter()
            .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str())
            .collect();
        let whole = "Mercury, Venus, Earth, Mars, Jupiter and Saturn.";
        assert!(whole.starts_with(&delivered), "{limit}: {delivered}");
        assert_eq!(limit == 200, delivered == whole, "{limit}: {delivered}");
        let offsets: Vec<&Value> = chunks
            .iter()
            .map(|chunk| &chunk["choices"][0]["content_filter_offsets"])
            .filter(|offsets| !offsets.is_null())
            .collect();
        assert_eq!(
            offsets,
            [&json!({"check_offset": 0, "start_offset": 0,
                     "end_offset": delivered.chars().count()})],
            "{limit}"
        );
    }

    #[test]
    fn tool_call_arguments_are_delivered_as_their_trees_would_be() {
        let (injection, opening) = placed(200);
        let chunk = |delta: Value, finish: Value| {
            json!({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": delta, "logprobs": null,
                   "finish_reason": finish}]})
            .to_string()
        };
        let call = |call: Value| chunk(json!({"tool_calls": [call]}), json!(null));
        let head = injection.canaries.head.to_string();
        let mut chunks = vec![
            chunk(json!({"role": "assistant", "content": ""}), json!(null)),
            chunk(json!({"content": format!("{opening}\n")}), json!(null)),
            call(json!({"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "weather", "arguments": ""}})),
        ];
        // The arguments a few bytes at a time, one piece repeating the
        // request's own canary (removed, as from any text).
        let arguments = format!("{{\"city\": \"Paris {head}\", \"unit\": \"C\"}}");
        for piece in arguments.as_bytes().chunks(4) {
            let piece = std::str::from_utf8(piece).unwrap();
            chunks.push(call(json!({"index": 0, "function": {"arguments": piece}})));
        }
        chunks.push(chunk(json!({}), json!("tool_calls")));
        let (light, _) = relay(&injection, &chunks, true);
        let (tree, _) = relay(&injection, &chunks, false);
        let light_text = String::from_utf8_lossy(&light);
        assert_eq!(light_text, String::from_utf8_lossy(&tree));
        let mut events = Vec::new();
        SseParser::new().feed(&light, &mut events);
        let delivered: String = events
            .iter()
            .filter_map(|event| {
                let chunk: Value = serde_json::from_str(&event.data).ok()?;
                chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        assert!(!delivered.contains(&head), "{delivered}");
        assert!(delivered.starts_with("{\"city\": \"Paris"), "{delivered}");
        assert!(delivered.ends_with("\"unit\": \"C\"}"), "{delivered}");
        assert!(light_text.contains("\"tool_calls\""));
    }

    /// The relay's work for one provider chunk once the echo has passed,
    /// as `paths::verified::stream` does it (less hyper and the client's
    /// write), allocates nothing: the SSE parser reads the event's data
    /// into the buffer of an event the writer has written out
    /// ([`StreamWriter::spent`]), the light reading borrows the text from
    /// it (or, after the prefix the stream's chunks share, from the memo's
    /// buffer, which it reuses), the choice, its text field and its span
    /// are kept inline, and the verifier scans the text in buffers it
    /// keeps. The output buffer is the client's write and is not counted
    /// (it is reused here).
    #[test]
    fn a_relayed_chunk_allocates_within_its_budget() {
        const CHUNKS: usize = 400;
        let (injection, opening) = placed(100_000);
        let registry = MemoryRegistry::new(b"test");
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let usage = UsageOptions {
            client_wants_usage: false,
            without_canarygate: true,
            overhead_prompt: injection.prompt_tokens_added,
        };
        let limit = injection.client_max_tokens;
        let mut writer = ChatStream::new(Delivery::new(TokenCounter::default(), limit, usage, 1));
        let wire = |content: &str| {
            let chunk = json!({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                               "model": "m", "system_fingerprint": "fp", "choices": [{"index": 0,
                               "delta": {"content": content}, "logprobs": null,
                               "finish_reason": null}]});
            format!("data: {chunk}\n\n").into_bytes()
        };
        let reads: Vec<Vec<u8>> = std::iter::once(wire(&format!("{opening}\n")))
            .chain((0..CHUNKS).map(|n| wire(&format!(" word{n}"))))
            .collect();
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        let mut memo = StreamMemo::default();
        let mut tally = crate::allocations::Tally::default();
        let mut out = Vec::new();
        for (read, bytes) in reads.iter().enumerate() {
            let before = crate::allocations::on_this_thread();
            parser.feed(bytes, &mut events);
            for event in events.drain(..) {
                let EventView::Chunk(chunk) = Chat::read_stream_event(&event, &mut memo) else {
                    panic!("not a chunk: {event:?}");
                };
                assert!(chunk.is_light());
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
            while let Some(data) = writer.spent() {
                parser.recycle(data);
            }
            // The first chunks carry the echo and settle the buffers.
            if read > 16 {
                let spent = crate::allocations::on_this_thread() - before;
                tally.add(spent, bytes.len());
                assert_eq!(
                    spent,
                    crate::allocations::Allocated::default(),
                    "chunk {read} allocated, for {} bytes",
                    bytes.len()
                );
                assert_eq!(out, *bytes, "chunk {read} went out as it came");
            }
            out.clear();
        }
        eprintln!("{}", tally.report("chat chunk"));
    }

    #[test]
    fn a_chunk_that_must_change_and_has_no_tree_stops_the_writer() {
        let (injection, opening) = placed(200);
        // `1e400` is skipped by the light reading; no `Value` holds it.
        let echo_and_text = json!(format!("{opening}\nMercury")).to_string();
        let chunks = [
            format!(
                r#"{{"created":1e400,"choices":[{{"index":0,"delta":{{"content":{echo_and_text}}}}}]}}"#
            ),
            r#"{"choices":[{"index":0,"delta":{"content":", Venus."}}]}"#.to_owned(),
        ];
        let (out, writer) = relay(&injection, &chunks, true);
        assert!(writer.failure().is_some());
        assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
    }
}
