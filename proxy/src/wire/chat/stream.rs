//! The client's side of a verified Chat Completions stream: the provider's
//! own chunks, held until their text is verified, passed on edited.
//!
//! Legacy completions stream the same way (chunks with `choices`, a usage
//! chunk without, `data: [DONE]`) with text elsewhere in a choice: the writer
//! takes the chunk editing as a [`ChunkEditor`].

use std::collections::VecDeque;
use std::ops::Range;

use canarygate_policies::sse::{SseEvent, encode_data};
use canarygate_policies::verify::{Verdict, Verifier};
use serde_json::Value;

use super::deliver::{Edited, edit_fields};
use crate::wire::edit::Delivery;
use crate::wire::format::{ChoiceView, Chunk, StreamWriter, TextField, TextSource};

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

/// One provider chunk waiting for its text to be verified.
struct Held {
    chunk: Chunk,
    /// The chunk's data as received.
    data: String,
    /// The span of its part each text field carried.
    spans: Vec<Range<usize>>,
    /// It ends a choice or the answer (a finish reason, or the usage
    /// chunk): it waits for the verdict.
    ends: bool,
}

/// The client's side of a verified Chat Completions stream (see the module
/// docs). Chunks leave in the order they came; a chunk whose every text
/// was removed (the echo) is dropped, one that nothing changed goes out as
/// the provider's own bytes. `E` edits the chunks.
pub struct ChatStream<E = ChatChunks> {
    delivery: Delivery,
    held: VecDeque<Held>,
    editor: E,
}

impl ChatStream {
    /// A writer of Chat Completions chunks delivering by `delivery`.
    pub fn new(delivery: Delivery) -> Self {
        Self::with_editor(delivery, ChatChunks)
    }
}

impl<E: ChunkEditor> ChatStream<E> {
    /// A writer delivering by `delivery`, its chunks edited by `editor`.
    pub fn with_editor(delivery: Delivery, editor: E) -> Self {
        Self {
            delivery,
            held: VecDeque::new(),
            editor,
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
                chunk.text_of(field),
                span.clone(),
                verifier.release_of(field.choice, field.kind),
            ),
            _ => true,
        }
    }

    fn write(&mut self, held: Held, verifier: &Verifier, out: &mut Vec<u8>) {
        let Held {
            mut chunk,
            data,
            spans,
            ..
        } = held;
        if chunk.is_light() {
            if self.passes_unchanged(&chunk, &spans, verifier) {
                encode_data(&data, out);
                return;
            }
            if !chunk.build_tree(&data) {
                // It must change and cannot be edited: it never goes out
                // as it came (its text may hold the echo).
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
        if chunk.event.get("usage").is_some_and(Value::is_object) {
            if self.delivery.client_wants_usage() {
                if let Some(usage) = chunk.event.get_mut("usage") {
                    changed |= self.delivery.report_usage(usage);
                }
            } else if let Some(event) = chunk.event.as_object_mut() {
                // canarygate asked for it; the client did not.
                event.remove("usage");
                changed = true;
            }
        }
        let has_choices = chunk
            .event
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|choices| !choices.is_empty());
        let has_usage = chunk.event.get("usage").is_some_and(Value::is_object);
        let only_removed_text = edited.emptied && !edited.keeps_other_fields;
        if (!has_choices && !has_usage && changed) || (has_choices && only_removed_text) {
            return;
        }
        if changed {
            encode_data(&chunk.event.to_string(), out);
        } else {
            encode_data(&data, out);
        }
    }
}

impl<E: ChunkEditor> StreamWriter for ChatStream<E> {
    fn take(&mut self, chunk: Chunk, event: SseEvent, spans: Vec<Range<usize>>) {
        let data = event.data;
        // A finish reason ends a choice; the usage chunk (no choices) ends
        // the answer. Usage on every chunk (vLLM's continuous usage stats)
        // does not hold them back.
        let ends = chunk
            .choices
            .iter()
            .any(|choice| choice.finish_reason.is_some())
            || chunk.choices.is_empty() && chunk.event.get("usage").is_some_and(Value::is_object);
        self.held.push_back(Held {
            chunk,
            data,
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

    fn done(&self, verdict: &Verdict) -> Vec<u8> {
        let mut tail = b": x-canarygate-verdict ".to_vec();
        tail.extend_from_slice(verdict.header_value().as_bytes());
        tail.extend_from_slice(b"\n: x-canarygate-overhead-tokens ");
        tail.extend_from_slice(self.delivery.overhead_header().as_bytes());
        tail.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        tail
    }
}
