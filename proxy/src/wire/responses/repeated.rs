//! Texts a Responses stream sent only in the events that repeat them.
//!
//! A stream normally carries every text in deltas, and its `.done` events,
//! `content_part.done`, `reasoning_summary_part.done` and
//! `output_item.done` repeat it whole; the writer rewrites those from what
//! was delivered. Some providers send a text only in its repeat: OpenAI's
//! computer-use model gives its reasoning summary in `output_item.done`
//! alone, other servers a whole message in its `.done` events. Such a text
//! is read here as its deltas would have been, at the first event that
//! repeats it ([`read_undelivered`]), and the writer delivers it the same
//! way ([`undelivered_texts`]), so the client gets it as direct, verified as
//! any text.
//!
//! Whether a delta carried a text is known by its place (item, list, index):
//! the reader asks the stream's [`StreamMemo`], the writer what it
//! delivered. Both see the same texts: a delta's place is read before the
//! events after it, and written before them. A function call's arguments
//! are not read this way: the event that would repeat them unannounced
//! still ends the stream.

use canarygate_policies::verify::Part;
use serde_json::Value;

use super::answer::{slot_of, text_place};
use super::deliver::Slot;
use crate::wire::format::{ChoiceView, Chunk, StreamMemo, TextField, TextPlace};
use crate::wire::location::{Key, Location};

/// One text an event repeats: the slot and part its deltas would have had,
/// and where it sits in the event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepeatedText {
    /// Its slot in its output item.
    pub slot: Slot,
    /// The part its deltas would have been read as.
    pub part: Part,
    /// Where the string sits in the event.
    pub at: Location,
    /// Where its deltas would have come from.
    pub place: TextPlace,
}

/// The texts (not empty) that event `data` of type `kind` repeats whole,
/// in the order its item holds them: a `.done` event's text, a finished
/// part's, a finished item's message parts and reasoning. None for any
/// other event (an `.added` event opens what its deltas fill).
pub fn repeated_texts(kind: &str, data: &Value) -> Vec<RepeatedText> {
    let index = |key: &str| data.get(key).and_then(Value::as_u64);
    let output_index = index("output_index").unwrap_or(0);
    let slot = slot_of(kind, index("content_index"), index("summary_index"));
    let mut found = Vec::new();
    let mut add = |slot: Slot, part: Part, at: Location, value: &Value| {
        let place = text_place(part, output_index, slot);
        if let (Some(place), Some(text)) = (place, at.text(value))
            && !text.is_empty()
        {
            found.push(RepeatedText {
                slot,
                part,
                at,
                place,
            });
        }
    };
    match kind {
        "response.output_text.done" => {
            add(slot, Part::Content, Location::ROOT.key(Key::Text), data)
        }
        "response.refusal.done" => add(slot, Part::Refusal, Location::ROOT.key(Key::Refusal), data),
        "response.reasoning_summary_text.done" | "response.reasoning_text.done" => {
            add(slot, Part::Reasoning, Location::ROOT.key(Key::Text), data)
        }
        "response.content_part.done" | "response.reasoning_summary_part.done" => {
            if let Some((at, part)) = Location::ROOT.named(data, "part")
                && let Some((part, key)) = part_text(part)
            {
                add(slot, part, at.key(key), data);
            }
        }
        "response.output_item.done" => {
            let Some((at, item)) = Location::ROOT.named(data, "item") else {
                return found;
            };
            let parts = |key: Key| {
                item.get(key.name())
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .enumerate()
            };
            match item.get("type").and_then(Value::as_str) {
                Some("message") => {
                    for (index, part) in parts(Key::Content) {
                        if let Some((kind, key)) = part_text(part) {
                            let at = at.key(Key::Content).index(index).key(key);
                            add(Slot::Content(index as u64), kind, at, data);
                        }
                    }
                }
                Some("reasoning") => {
                    for (index, _) in parts(Key::Summary) {
                        let at = at.key(Key::Summary).index(index).key(Key::Text);
                        add(Slot::Summary(index as u64), Part::Reasoning, at, data);
                    }
                    for (index, _) in parts(Key::Content) {
                        let at = at.key(Key::Content).index(index).key(Key::Text);
                        add(Slot::Content(index as u64), Part::Reasoning, at, data);
                    }
                }
                _ => {}
            }
        }
        _ => {}
    }
    found
}

/// The part a content or summary part's text is read as, and its key.
fn part_text(part: &Value) -> Option<(Part, Key)> {
    match part.get("type").and_then(Value::as_str)? {
        "output_text" => Some((Part::Content, Key::Text)),
        "refusal" => Some((Part::Refusal, Key::Refusal)),
        "summary_text" | "reasoning_text" => Some((Part::Reasoning, Key::Text)),
        _ => None,
    }
}

/// Reads into `chunk` (an event of type `kind` read from its tree) each text
/// it repeats that no delta of the stream carried, as that delta would
/// have been read, and notes its place in `memo`, so no later repeat reads
/// it again. A text whose place the stream had already left is not read:
/// its repeat then ends the stream, as a delta there would.
pub fn read_undelivered(chunk: &mut Chunk, kind: &str, memo: &mut StreamMemo) {
    for text in repeated_texts(kind, &chunk.event) {
        if memo.has_text_at(text.place) || !memo.keeps_order(text.place) {
            continue;
        }
        if chunk.choices.is_empty() {
            chunk.choices.push(ChoiceView {
                index: 0,
                position: 0,
                texts: Default::default(),
                finish_reason: None,
            });
        }
        let texts = &mut chunk.choices[0].texts;
        // Read as its part, not also as a string beside it.
        texts.retain(|field| field.at != text.at);
        texts.push(TextField {
            choice: 0,
            kind: text.part,
            at: text.at,
        });
    }
}

/// The texts event `data` of type `kind` repeats that the writer has not
/// delivered (`delivered` says which slots of the event's item it has):
/// those [`read_undelivered`] read from it, in the same order.
pub fn undelivered_texts(
    kind: &str,
    data: &Value,
    delivered: impl Fn(Slot) -> bool,
) -> Vec<RepeatedText> {
    let mut texts = repeated_texts(kind, data);
    texts.retain(|text| !delivered(text.slot));
    texts
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_finished_items_texts_are_found_with_their_slots() {
        let data = json!({"type": "response.output_item.done", "output_index": 1,
            "item": {"type": "reasoning", "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "Plan the clicks."},
                            {"type": "summary_text", "text": ""}]}});
        let texts = repeated_texts("response.output_item.done", &data);
        assert_eq!(texts.len(), 1, "{texts:?}");
        assert_eq!(texts[0].slot, Slot::Summary(0));
        assert_eq!(texts[0].part, Part::Reasoning);
        assert_eq!(texts[0].at.text(&data), Some("Plan the clicks."));
        assert_eq!(
            texts[0].place,
            TextPlace {
                item: 1,
                list: 1,
                index: 0
            }
        );

        let data = json!({"type": "response.output_item.done", "output_index": 0,
            "item": {"type": "message", "content": [
                {"type": "output_text", "text": "Paris.", "annotations": []},
                {"type": "refusal", "refusal": "No."}]}});
        let texts = repeated_texts("response.output_item.done", &data);
        let read: Vec<_> = texts
            .iter()
            .map(|text| (text.slot, text.part, text.at.text(&data).unwrap()))
            .collect();
        assert_eq!(
            read,
            [
                (Slot::Content(0), Part::Content, "Paris."),
                (Slot::Content(1), Part::Refusal, "No.")
            ]
        );

        // A `.done` event's own text; an `.added` event repeats nothing.
        let data = json!({"type": "response.output_text.done", "output_index": 2,
            "content_index": 1, "text": "Paris."});
        let texts = repeated_texts("response.output_text.done", &data);
        assert_eq!(texts[0].slot, Slot::Content(1));
        let data = json!({"type": "response.output_item.added", "output_index": 0,
            "item": {"type": "message", "content": [{"type": "output_text", "text": "x"}]}});
        assert!(repeated_texts("response.output_item.added", &data).is_empty());
    }
}
