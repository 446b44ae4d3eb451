//! Editing a completions answer or chunk in place for the client: each
//! choice's `text` (and any other string the verifier read) cut to what the
//! verifier's release and the delivery keep, logprobs following the text,
//! the finish reason of a choice cut at the client's limit.

use std::collections::HashMap;
use std::ops::Range;

use canarygate_policies::verify::{Part, Verifier};
use serde_json::{Value, json};

use super::logprobs;
use crate::wire::chat::{ChunkEditor, Edited};
use crate::wire::edit::{Delivery, apply};
use crate::wire::format::{ChoiceView, TextField, put_text};
use crate::wire::location::{Key, Location};

/// Members of a choice that are not "something besides text" (a chunk
/// whose text was all removed and that carries only these, or nulls, is
/// dropped); a finish reason is counted apart.
const TEXT_MEMBERS: [&str; 4] = ["text", "index", "logprobs", "finish_reason"];

/// Edits of one answer or stream: how far back the `text_offset`s of each
/// choice's next tokens move. By the characters canarygate appended to the
/// choice's prompt, where the provider counts offsets from the prompt's
/// start (decided on the choice's first offset, [`logprobs::prompt_shift`]),
/// and by those removed of its text so far.
#[derive(Debug, Default)]
pub struct TextEdits {
    removed: HashMap<u32, usize>,
    prompt_shift: HashMap<u32, usize>,
}

impl ChunkEditor for TextEdits {
    fn edit(
        &mut self,
        chunk: &mut Value,
        choices: &[ChoiceView],
        fields: &[(TextField, Range<usize>)],
        verifier: &Verifier,
        delivery: &mut Delivery,
    ) -> Edited {
        self.edit_fields(chunk, choices, fields, verifier, delivery)
    }
}

impl TextEdits {
    /// Edits the text `fields` of `value` (an answer or chunk whose choices
    /// are `choices`; each field with the span of its part it carried) to
    /// what the verifier's release and `delivery` leave of them.
    pub fn edit_fields(
        &mut self,
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
            let position = position_of.get(&field.choice).copied();
            if field.kind == Part::Content
                && let Some(logprobs) = position.and_then(|position| logprobs_at(value, position))
            {
                let prompt_shift = match self.prompt_shift.get(&field.choice) {
                    Some(shift) => *shift,
                    None => {
                        let appended = delivery.prompt_chars_appended(field.choice);
                        let decided = logprobs::prompt_shift(logprobs, appended);
                        if let Some(shift) = decided {
                            self.prompt_shift.insert(field.choice, shift);
                        }
                        decided.unwrap_or(0)
                    }
                };
                let removed_before =
                    prompt_shift + self.removed.get(&field.choice).copied().unwrap_or(0);
                if !edit.unchanged() {
                    logprobs::follow(logprobs, &text, &edit, removed_before);
                } else if removed_before > 0 {
                    logprobs::shift(logprobs, removed_before);
                    edited.changed = true;
                }
            }
            if edit.unchanged() {
                continue;
            }
            edited.changed = true;
            let shown = apply(&text, &edit.kept);
            if field.kind == Part::Content {
                let removed = text.chars().count() - shown.chars().count();
                *self.removed.entry(field.choice).or_default() += removed;
            }
            if let Some(position) = position {
                changed_choices.push(position);
            }
            put_text(value, field, shown);
        }
        edited.emptied = had_text && !shows_text;
        for position in changed_choices {
            let at = Location::ROOT.key(Key::Choices).index(position);
            let delivered = at
                .key(Key::Text)
                .get(value)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned();
            if let Some(logprobs) = logprobs_at(value, position) {
                logprobs::check(logprobs, &delivered);
            }
        }
        for choice in choices {
            let at = Location::ROOT.key(Key::Choices).index(choice.position);
            let Some(slot) = at.get_mut(value) else {
                continue;
            };
            if choice.finish_reason.is_some() {
                edited.keeps_other_fields = true;
                if delivery.was_cut(choice.index)
                    && choice.finish_reason.as_deref() != Some("length")
                {
                    slot["finish_reason"] = json!("length");
                    edited.changed = true;
                }
            }
            if let Some(members) = slot.as_object() {
                edited.keeps_other_fields |= members
                    .iter()
                    .any(|(key, value)| !TEXT_MEMBERS.contains(&key.as_str()) && !value.is_null());
            }
        }
        edited
    }
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
