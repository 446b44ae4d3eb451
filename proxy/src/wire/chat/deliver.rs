//! Editing a Chat Completions answer or chunk in place for the client: text
//! fields cut to what the verifier's release and the delivery keep, logprobs
//! and the positions citation annotations point at following them, finish
//! reasons of cut choices.

use std::collections::HashMap;
use std::ops::Range;

use canarygate_policies::verify::{Part, Verifier};
use serde_json::{Value, json};

use super::logprobs;
use crate::wire::edit::{Delivery, apply};
use crate::wire::format::{ChoiceView, TextField, put_text};
use crate::wire::location::{Key, Location};
use crate::wire::positions::{follow_annotations, follow_filter_offsets};

/// Keys of a message or delta that hold text the verifier reads.
const TEXT_KEYS: [&str; 4] = ["content", "reasoning_content", "reasoning", "refusal"];

/// What [`edit_fields`] did to an answer or chunk.
#[derive(Debug, Default)]
pub struct Edited {
    /// Some field or finish reason changed.
    pub changed: bool,
    /// Text was there and all of it was removed.
    pub emptied: bool,
    /// A choice carries something besides text: a role, a finish reason,
    /// tool calls, audio.
    pub keeps_other_fields: bool,
}

/// Edits the text `fields` of `value` (an answer or chunk whose choices are
/// `choices`; each field with the span of its part it carried) to what the
/// verifier's release and `delivery` leave of them: logprobs follow the
/// content and the refusal (and go where they no longer spell what was
/// delivered), the choice's `annotations` point into the delivered content
/// ([`follow_annotations`]), and so do its `content_filter_offsets`
/// ([`follow_filter_offsets`]), and a choice cut at the client's limit
/// finishes with `length`.
pub fn edit_fields(
    value: &mut Value,
    choices: &[ChoiceView],
    fields: &[(TextField, Range<usize>)],
    verifier: &Verifier,
    delivery: &mut Delivery,
) -> Edited {
    let mut edited = Edited::default();
    let mut had_text = false;
    let mut shows_text = false;
    let position_of: HashMap<u32, usize> = choices
        .iter()
        .map(|choice| (choice.index, choice.position))
        .collect();
    let mut changed_choices = Vec::new();
    for (field, span) in fields {
        let text = field.text(value).to_owned();
        had_text |= !text.is_empty();
        let edit = delivery.admit(
            field.choice,
            field.kind,
            &text,
            span.clone(),
            verifier.release_of(field.choice, field.kind),
        );
        shows_text |= edit.kept.iter().any(|range| !range.is_empty());
        if edit.unchanged() {
            continue;
        }
        edited.changed = true;
        let Some(&position) = position_of.get(&field.choice) else {
            continue;
        };
        changed_choices.push(position);
        let list = match field.kind {
            Part::Content => Some("content"),
            Part::Refusal => Some("refusal"),
            _ => None,
        };
        if let Some(list) = list
            && let Some(logprobs) = logprobs_at(value, position)
        {
            logprobs::follow(logprobs, list, &text, &edit);
        }
        put_text(value, field, apply(&text, &edit.kept));
    }
    edited.emptied = had_text && !shows_text;
    for position in changed_choices {
        let delivered = |key: &str| {
            let at = Location::ROOT.key(Key::Choices).index(position);
            let body = at
                .get(value)
                .and_then(|choice| choice.get("delta").or_else(|| choice.get("message")));
            body.and_then(|body| body.get(key))
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned()
        };
        let (content, refusal) = (delivered("content"), delivered("refusal"));
        if let Some(logprobs) = logprobs_at(value, position) {
            logprobs::check(logprobs, "content", &content);
            logprobs::check(logprobs, "refusal", &refusal);
        }
    }
    for choice in choices {
        let at = Location::ROOT.key(Key::Choices).index(choice.position);
        let Some(slot) = at.get_mut(value) else {
            continue;
        };
        if let (Some(offsets), Some(kept)) = (
            slot.get_mut("content_filter_offsets"),
            delivery.content_positions(choice.index),
        ) {
            edited.changed |= follow_filter_offsets(offsets, kept);
        }
        if choice.finish_reason.is_some() {
            edited.keeps_other_fields = true;
            if delivery.was_cut(choice.index) && choice.finish_reason.as_deref() != Some("length") {
                slot["finish_reason"] = json!("length");
                edited.changed = true;
            }
        }
        let key = if slot.get("delta").is_some() {
            "delta"
        } else {
            "message"
        };
        if let Some(body) = slot.get_mut(key).and_then(Value::as_object_mut) {
            edited.keeps_other_fields |= body
                .iter()
                .any(|(key, value)| !TEXT_KEYS.contains(&key.as_str()) && !value.is_null());
            if let (Some(annotations), Some(kept)) = (
                body.get_mut("annotations"),
                delivery.content_positions(choice.index),
            ) {
                edited.changed |= follow_annotations(annotations, kept);
            }
        }
    }
    edited
}

/// The `logprobs` object of the choice at `position`, if it has one.
fn logprobs_at(value: &mut Value, position: usize) -> Option<&mut Value> {
    Location::ROOT
        .key(Key::Choices)
        .index(position)
        .key(Key::Logprobs)
        .get_mut(value)
        .filter(|logprobs| logprobs.is_object())
}
