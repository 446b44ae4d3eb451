//! Editing a Messages answer or stream event in place for the client: each
//! text field cut to what the verifier's release and the delivery keep, the
//! stop reason of an answer cut at the client's `max_tokens`, usage.
//!
//! A `thinking` block goes as the provider wrote it: its `signature` signs
//! its text, and Anthropic refuses a block sent back (to continue a tool
//! call, or in a later turn) whose text changed. So canarygate's own
//! canaries a model quotes while it thinks stay in it (they are the
//! caller's, and dead once the request ends; a later turn that sends them
//! back accepts them, [`super::request::replays_thinking`]), and thinking
//! is never cut at the client's limit (Anthropic keeps `budget_tokens`
//! below `max_tokens`, so only the text after it can run past the limit).
//! A thinking block quoting another request's canary still fails
//! verification, and one whose reasoning the verifier withheld (a reply
//! cut at the token limit in reasoning nothing vouches for) is dropped
//! whole, as its text cannot be emptied.

use std::ops::Range;

use canarygate_policies::verify::{Part, Release, Verifier};
use serde_json::{Value, json};

use crate::wire::edit::{Delivery, apply};
use crate::wire::format::{AnswerView, TextField, put_text};

/// What [`edit_texts`] did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Edited {
    /// Some text changed.
    pub changed: bool,
    /// Text was there and all of it was removed.
    pub emptied: bool,
}

/// Edits the text `fields` of `value` (each with the span of its part it
/// carried) to what the verifier's release and `delivery` leave of them.
pub fn edit_texts(
    value: &mut Value,
    fields: &[(TextField, Range<usize>)],
    verifier: &Verifier,
    delivery: &mut Delivery,
) -> Edited {
    let mut edited = Edited::default();
    let mut had_text = false;
    let mut shows_text = false;
    for (field, span) in fields {
        let text = field.text(value).to_owned();
        had_text |= !text.is_empty();
        let mut release = verifier.release_of(field.choice, field.kind);
        if field.kind == Part::Reasoning {
            // Signed: shown as written (see the module docs).
            release = Release {
                removed: &[],
                ..release
            };
        }
        let edit = delivery.admit(field.choice, field.kind, &text, span.clone(), release);
        shows_text |= edit.kept.iter().any(|range| !range.is_empty());
        if edit.unchanged() {
            continue;
        }
        edited.changed = true;
        put_text(value, field, apply(&text, &edit.kept));
    }
    edited.emptied = had_text && !shows_text;
    edited
}

/// `stop_reason` of an answer cut at the client's limit: `max_tokens`.
/// Returns whether `slot` (the answer, or a `message_delta`'s `delta`)
/// changed.
pub fn cut_stop_reason(slot: &mut Value, delivery: &Delivery) -> bool {
    let reason = slot.get("stop_reason").and_then(Value::as_str);
    if delivery.was_cut(0) && reason.is_some() && reason != Some("max_tokens") {
        slot["stop_reason"] = json!("max_tokens");
        slot["stop_sequence"] = Value::Null;
        return true;
    }
    false
}

/// Edits a verified whole `message` for the client: its text fields, the
/// stop reason, usage; a text block the edit emptied is dropped (Anthropic
/// refuses empty text blocks when a conversation is sent back), and so is a
/// thinking block whose reasoning the verifier withheld (its signature
/// forbids emptying it).
pub fn deliver(
    answer: &mut Value,
    view: &AnswerView,
    spans: &[Range<usize>],
    verifier: &Verifier,
    delivery: &mut Delivery,
) {
    delivery.keep_reasoning_whole();
    let fields: Vec<_> = view
        .choices
        .iter()
        .flat_map(|choice| &choice.texts)
        .copied()
        .zip(spans.iter().cloned())
        .collect();
    let had_text = text_blocks_with_text(answer);
    edit_texts(answer, &fields, verifier, delivery);
    let withheld = verifier.withholds_reasoning(0);
    if let Some(blocks) = answer.get_mut("content").and_then(Value::as_array_mut) {
        let mut position = 0;
        blocks.retain(|block| {
            let emptied = had_text.contains(&position)
                && block.get("text").and_then(Value::as_str) == Some("");
            let withheld =
                withheld && block.get("type").and_then(Value::as_str) == Some("thinking");
            position += 1;
            !emptied && !withheld
        });
    }
    cut_stop_reason(answer, delivery);
    if let Some(usage) = answer.get_mut("usage").filter(|usage| usage.is_object()) {
        delivery.report_usage(usage);
    }
}

/// Positions of the answer's text blocks that hold text.
fn text_blocks_with_text(answer: &Value) -> Vec<usize> {
    answer
        .get("content")
        .and_then(Value::as_array)
        .map(|blocks| {
            blocks
                .iter()
                .enumerate()
                .filter(|(_, block)| {
                    block.get("type").and_then(Value::as_str) == Some("text")
                        && block
                            .get("text")
                            .and_then(Value::as_str)
                            .is_some_and(|text| !text.is_empty())
                })
                .map(|(position, _)| position)
                .collect()
        })
        .unwrap_or_default()
}
