//! Reading the common Responses event without building its JSON tree.
//!
//! Nearly every event of a Responses stream is a delta: a piece of a
//! message's text (`response.output_text.delta`), of a refusal, of reasoning
//! or its summary, or of a function call's arguments, passed on to the
//! client exactly as the provider sent it. Such an event is deserialised
//! into borrowed views, and nothing is built but its text's place in the
//! event's data.
//!
//! Any other event is not light and [`read`] says so; the caller reads it
//! from its tree (`super::answer::read_tree`), which gives what this
//! reading gives for a light event. Not light: every other event type, a
//! member that is not listed below (a string there may hold a canary: the
//! tree's reading decides), a member of the wrong type, and logprobs other
//! than none or an empty list (they are edited with the text).

use std::borrow::Cow;

use canarygate_policies::canary::find_canaries;
use serde::Deserialize;
use serde::de::{Deserializer, Error as _, IgnoredAny, SeqAccess, Visitor};
use smallvec::smallvec;

use super::answer::{part_of_delta, slot_of, text_place};
use super::deliver::Slot;
use crate::wire::format::{ChoiceView, Chunk, TextField};
use crate::wire::json_str::JsonStr;
use crate::wire::location::{Key, Location};

/// A delta event's members, nothing else.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LightEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: JsonStr<'a>,
    #[serde(rename = "item_id", borrow, default)]
    item_id: Option<JsonStr<'a>>,
    #[serde(default)]
    output_index: Option<u64>,
    #[serde(default)]
    content_index: Option<u64>,
    #[serde(default)]
    summary_index: Option<u64>,
    #[serde(borrow)]
    delta: JsonStr<'a>,
    #[serde(default)]
    sequence_number: Option<u64>,
    #[serde(rename = "logprobs", default)]
    _logprobs: Option<EmptyList>,
    /// Random padding OpenAI adds against length side channels.
    #[serde(rename = "obfuscation", borrow, default)]
    obfuscation: Option<JsonStr<'a>>,
}

/// An empty JSON array, and nothing else.
struct EmptyList;

impl<'de> Deserialize<'de> for EmptyList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// Accepts an array only while it has no element.
        struct EmptyVisitor;

        impl<'de> Visitor<'de> for EmptyVisitor {
            type Value = EmptyList;

            fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                formatter.write_str("an empty array")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EmptyList, A::Error> {
                match seq.next_element::<IgnoredAny>()? {
                    None => Ok(EmptyList),
                    Some(_) => Err(A::Error::custom("not read lightly")),
                }
            }
        }

        deserializer.deserialize_seq(EmptyVisitor)
    }
}

/// What the writer needs of a light event besides its text: its type and
/// which text of which output item it continues.
pub struct Delta<'a> {
    /// The event's `type`.
    pub kind: Cow<'a, str>,
    /// Its `output_index` (0 when it has none, as the tree's reading).
    pub output_index: u64,
    /// The text it continues.
    pub slot: Slot,
    /// Its `sequence_number`, if it has one.
    pub sequence_number: Option<u64>,
}

/// The delta whose data is `data` and its text, when it is light.
fn read_delta(data: &str) -> Option<(Delta<'_>, TextField, JsonStr<'_>)> {
    let event: LightEvent<'_> = serde_json::from_str(data).ok()?;
    // A canary-shaped span beside the text is the tree's to read.
    let beside = [&event.item_id, &event.obfuscation];
    if beside
        .into_iter()
        .flatten()
        .any(|text| find_canaries(&text.0).next().is_some())
    {
        return None;
    }
    let kind = event.kind.0;
    let part = part_of_delta(&kind, event.output_index)?;
    let slot = slot_of(&kind, event.content_index, event.summary_index);
    let field = TextField {
        choice: 0,
        kind: part,
        at: Location::ROOT.key(Key::Delta),
    };
    let delta = Delta {
        kind,
        output_index: event.output_index.unwrap_or(0),
        slot,
        sequence_number: event.sequence_number,
    };
    Some((delta, field, event.delta))
}

/// The event whose data is `data`, when it is light (see the module docs).
pub fn read(data: &str) -> Option<Chunk> {
    let (delta, field, text) = read_delta(data)?;
    let place = text_place(field.kind, delta.output_index, delta.slot);
    let choice = ChoiceView {
        index: 0,
        position: 0,
        texts: smallvec![field],
        finish_reason: None,
    };
    let mut chunk = Chunk::light(smallvec![choice], Some(text.in_data(data)), false);
    chunk.place = place;
    Some(chunk)
}

/// The type and place of the light event whose data is `data`.
pub fn delta_of(data: &str) -> Option<Delta<'_>> {
    read_delta(data).map(|(delta, ..)| delta)
}

#[cfg(test)]
mod tests {
    use canarygate_policies::sse::SseEvent;
    use serde_json::{Value, json};

    use super::*;
    use crate::wire::format::{EventView, TextPlace};

    /// The tree's reading of `data`.
    fn tree(data: &str) -> Chunk {
        let event = SseEvent {
            event: None,
            data: data.into(),
            id: None,
        };
        match super::super::answer::read_tree(&event) {
            EventView::Chunk(chunk) => chunk,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn deltas_are_light_and_read_as_the_tree_reads_them() {
        let at = json!({"item_id": "msg_1", "output_index": 1, "content_index": 0,
                        "sequence_number": 7});
        let with = |kind: &str, extra: Value| {
            let mut event = at.clone();
            event["type"] = json!(kind);
            for (key, value) in extra.as_object().unwrap() {
                event[key] = value.clone();
            }
            event.to_string()
        };
        for data in [
            with(
                "response.output_text.delta",
                json!({"delta": "Hi", "logprobs": []}),
            ),
            with(
                "response.output_text.delta",
                json!({"delta": "say \"hi\"\n", "obfuscation": "a1"}),
            ),
            with("response.refusal.delta", json!({"delta": "No."})),
            with("response.reasoning_text.delta", json!({"delta": "Hm"})),
            with(
                "response.reasoning_summary_text.delta",
                json!({"delta": "Sum", "summary_index": 2}),
            ),
            with(
                "response.function_call_arguments.delta",
                json!({"delta": "{\"a\":"}),
            ),
            json!({"type": "response.output_text.delta", "delta": ""}).to_string(),
        ] {
            let light = read(&data).unwrap_or_else(|| panic!("not light: {data}"));
            let tree = tree(&data);
            assert!(light.is_light());
            assert_eq!(light.choices.len(), tree.choices.len(), "{data}");
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
            let value: Value = serde_json::from_str(&data).unwrap();
            let delta = delta_of(&data).unwrap();
            assert_eq!(delta.kind, value["type"].as_str().unwrap());
            assert_eq!(
                delta.output_index,
                value["output_index"].as_u64().unwrap_or(0)
            );
            let index = |key: &str| value[key].as_u64();
            assert_eq!(
                delta.slot,
                slot_of(&delta.kind, index("content_index"), index("summary_index"))
            );
        }
    }

    /// A text delta goes to its output item's content or summary part; a
    /// call's arguments have no place among the texts.
    #[test]
    fn a_text_delta_has_its_place() {
        let place = |data: Value| read(&data.to_string()).unwrap().place;
        assert_eq!(
            place(
                json!({"type": "response.output_text.delta", "output_index": 2,
                         "content_index": 1, "delta": "a"})
            ),
            Some(TextPlace {
                item: 2,
                list: 0,
                index: 1
            })
        );
        assert_eq!(
            place(
                json!({"type": "response.reasoning_summary_text.delta", "output_index": 0,
                         "summary_index": 3, "delta": "a"})
            ),
            Some(TextPlace {
                item: 0,
                list: 1,
                index: 3
            })
        );
        assert_eq!(
            place(
                json!({"type": "response.function_call_arguments.delta", "output_index": 1,
                         "delta": "{"})
            ),
            None
        );
    }

    /// A canary-shaped span beside a delta's text (its item's id, the
    /// padding) is read from the tree, which verifies it.
    #[test]
    fn canary_text_beside_a_delta_is_the_trees() {
        let canary = "CG123456789012345";
        for beside in [
            json!({"obfuscation": canary}),
            json!({"item_id": format!("msg_{canary}")}),
        ] {
            let mut data = json!({"type": "response.output_text.delta", "output_index": 0,
                                  "content_index": 0, "delta": "Hi"});
            for (key, value) in beside.as_object().unwrap() {
                data[key] = value.clone();
            }
            let data = data.to_string();
            assert!(read(&data).is_none(), "{data}");
            let tree = tree(&data);
            let texts: Vec<&str> = tree
                .texts()
                .map(|field| tree.with_data(&data).text(field))
                .collect();
            assert_eq!(texts.len(), 2, "{data}: {texts:?}");
            assert!(texts[1].contains(canary), "{data}: {texts:?}");
        }
    }

    #[test]
    fn anything_else_is_read_from_the_tree() {
        for data in [
            // Other events.
            json!({"type": "response.output_text.done", "output_index": 0, "text": "Hi"}),
            json!({"type": "response.created", "response": {"id": "r"}}),
            json!({"type": "response.output_text.annotation.added", "annotation": {"url": "u"}}),
            json!({"type": "response.audio.transcript.delta", "delta": "words"}),
            // Logprobs to edit with the text.
            json!({"type": "response.output_text.delta", "delta": "Hi",
                   "logprobs": [{"token": "Hi", "logprob": -0.1}]}),
            // Members not listed (a string there may hold a canary).
            json!({"type": "response.output_text.delta", "delta": "Hi", "note": "x"}),
            // Wrong types.
            json!({"type": "response.output_text.delta", "delta": 7}),
            json!({"type": "response.output_text.delta", "delta": "Hi", "output_index": -1}),
            json!({"type": "response.output_text.delta", "delta": "Hi", "item_id": 3}),
            // Arguments of no output item, or of one past any choice index.
            json!({"type": "response.function_call_arguments.delta", "delta": "{"}),
            json!({"type": "response.function_call_arguments.delta", "delta": "{",
                   "output_index": 1_u64 << 40}),
            json!({"delta": "Hi"}),
            Value::Null,
        ] {
            let data = data.to_string();
            assert!(read(&data).is_none(), "light: {data}");
        }
        assert!(read("[DONE]").is_none());
    }
}
