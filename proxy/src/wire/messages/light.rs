//! Reading the common Messages event without building its JSON tree.
//!
//! Nearly every event of a Messages stream is a `content_block_delta` that
//! carries one piece of a text block (`text_delta`) or of a thinking block
//! (`thinking_delta`), passed on to the client exactly as the provider sent
//! it. Such an event is deserialised into borrowed views, and nothing is
//! built but its text's place in the event's data.
//!
//! Any other event is not light and [`read`] says so; the caller reads it
//! from its tree ([`super::stream::read_event`]), which gives what this
//! reading gives for a light event. Not light: every other event type and
//! delta type, a member of the event or of its delta that is not listed
//! below (a string there may hold a canary: the tree's reading decides), a
//! member of the wrong type, and a delta whose text is not the member its
//! type names.

use canarygate_policies::verify::Part;
use serde::Deserialize;
use smallvec::smallvec;

use crate::wire::format::{ChoiceView, Chunk, TextField, TextPlace};
use crate::wire::json_str::JsonStr;
use crate::wire::location::{Key, Location};

/// A `content_block_delta`, nothing else.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LightEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: JsonStr<'a>,
    /// The block's index: where the text goes ([`Chunk::place`]).
    index: u64,
    #[serde(borrow)]
    delta: LightDelta<'a>,
}

/// The delta of a text or thinking block.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LightDelta<'a> {
    #[serde(rename = "type", borrow)]
    kind: JsonStr<'a>,
    #[serde(borrow, default)]
    text: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    thinking: Option<JsonStr<'a>>,
}

/// The event whose data is `data`, when it is light (see the module docs).
pub fn read(data: &str) -> Option<Chunk> {
    let LightEvent { kind, index, delta } = serde_json::from_str(data).ok()?;
    if kind != *"content_block_delta" {
        return None;
    }
    let (key, part, text) = match (delta.kind.0.as_ref(), delta.text, delta.thinking) {
        ("text_delta", Some(text), None) => (Key::Text, Part::Content, text),
        ("thinking_delta", None, Some(thinking)) => (Key::Thinking, Part::Reasoning, thinking),
        _ => return None,
    };
    let field = TextField {
        choice: 0,
        kind: part,
        at: Location::ROOT.key(Key::Delta).key(key),
    };
    let choice = ChoiceView {
        index: 0,
        position: 0,
        texts: smallvec![field],
        finish_reason: None,
    };
    let mut chunk = Chunk::light(smallvec![choice], Some(text.in_data(data)), false);
    chunk.place = Some(block_place(index));
    Some(chunk)
}

/// The place of a text in block `index` ([`Chunk::place`]).
pub fn block_place(index: u64) -> TextPlace {
    TextPlace {
        item: index,
        list: 0,
        index: 0,
    }
}

#[cfg(test)]
mod tests {
    use canarygate_policies::sse::SseEvent;
    use serde_json::{Value, json};

    use super::*;
    use crate::wire::format::EventView;

    /// The tree's reading of `data`, as [`super::super::stream::read_event`]
    /// gives it for an event that is not light.
    fn tree(data: &str) -> Chunk {
        let event = SseEvent {
            event: Some("content_block_delta".into()),
            data: data.into(),
            id: None,
        };
        match super::super::stream::read_tree(&event) {
            EventView::Chunk(chunk) => chunk,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn text_and_thinking_deltas_are_light_and_read_as_the_tree_reads_them() {
        for data in [
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": "Hello"}}),
            json!({"type": "content_block_delta", "index": 2,
                   "delta": {"type": "text_delta", "text": "say \"hi\"\n\u{e9}"}}),
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "thinking_delta", "thinking": "Let me see"}}),
            json!({"type": "content_block_delta", "index": 1,
                   "delta": {"type": "text_delta", "text": ""}}),
        ] {
            let data = data.to_string();
            let light = read(&data).unwrap_or_else(|| panic!("not light: {data}"));
            let tree = tree(&data);
            assert!(light.is_light());
            assert_eq!(light.choices.len(), tree.choices.len(), "{data}");
            // Its text goes to its block.
            let index = serde_json::from_str::<Value>(&data).unwrap()["index"].as_u64();
            assert_eq!(light.place, index.map(block_place), "{data}");
            assert_eq!(light.place, tree.place, "{data}");
            for (ours, theirs) in light.choices.iter().zip(&tree.choices) {
                assert_eq!(
                    (ours.index, ours.position, &ours.finish_reason),
                    (theirs.index, theirs.position, &theirs.finish_reason),
                    "{data}"
                );
                assert_eq!(ours.texts, theirs.texts, "{data}");
            }
            for field in tree.texts() {
                assert_eq!(
                    light.with_data(&data).text(field),
                    tree.with_data(&data).text(field),
                    "{data}"
                );
            }
        }
    }

    #[test]
    fn anything_else_is_read_from_the_tree() {
        for data in [
            // Other deltas and events.
            json!({"type": "content_block_delta", "index": 1,
                   "delta": {"type": "input_json_delta", "partial_json": "{\"a\""}}),
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "signature_delta", "signature": "EqQB"}}),
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "citations_delta", "citation": {"cited_text": "x"}}}),
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}),
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                   "usage": {"output_tokens": 5}}),
            json!({"type": "ping"}),
            // Members not listed (a string there may hold a canary).
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": "a", "note": "b"}}),
            json!({"type": "content_block_delta", "index": 0, "extra": "b",
                   "delta": {"type": "text_delta", "text": "a"}}),
            // The text under the other type's member, both, or neither.
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "thinking": "a"}}),
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "thinking_delta", "thinking": "a", "text": "b"}}),
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta"}}),
            // Wrong types, no index.
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": 7}}),
            json!({"type": "content_block_delta", "index": -1,
                   "delta": {"type": "text_delta", "text": "a"}}),
            json!({"type": "content_block_delta",
                   "delta": {"type": "text_delta", "text": "a"}}),
            Value::Null,
        ] {
            let data = data.to_string();
            assert!(read(&data).is_none(), "light: {data}");
        }
        assert!(read("not json").is_none());
    }
}
