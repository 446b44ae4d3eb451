//! What a provider stored of a request canarygate placed, read back: the
//! provider kept what canarygate sent it (its blocks) and what the model
//! answered (the echo the reply opened with). Taking out what belongs to
//! the caller's own canaries lets the client read back what it sent and
//! what it was delivered; canary-shaped text that is not the caller's (a
//! ticket number of its own) stays. Each API's stored objects are walked
//! by its own module (the Responses API's responses and input items, Chat
//! Completions' stored completions and their messages) with the helpers
//! here.

use std::collections::HashSet;
use std::ops::Range;

use canarygate_policies::canary::{Canary, find_canaries};
use canarygate_policies::verify::{own_text_removals, without_own_text};
use serde_json::Value;

use crate::wire::positions::KeptChars;

/// What [`scrub_text`] took out of a text.
pub struct Scrubbed {
    /// The text as the provider stored it.
    pub original: String,
    /// The byte ranges of it kept, in order (what its logprobs follow).
    pub kept: Vec<Range<usize>>,
    /// The characters kept, for the positions citations point at.
    pub chars: KeptChars,
}

/// Every canary-shaped span in the strings of `body`, once each: what to
/// ask the registry about before scrubbing.
pub fn canaries_in(body: &Value) -> Vec<Canary> {
    fn walk(value: &Value, found: &mut HashSet<Canary>) {
        match value {
            Value::String(text) => found.extend(find_canaries(text).map(|span| span.canary)),
            Value::Array(items) => items.iter().for_each(|item| walk(item, found)),
            Value::Object(members) => members.values().for_each(|member| walk(member, found)),
            _ => {}
        }
    }
    let mut found = HashSet::new();
    walk(body, &mut found);
    found.into_iter().collect()
}

/// Takes the text of the canaries `ours` owns out of the string
/// `holder[key]`, by [`own_text_removals`] (the echo too, when the text
/// `opens_reply`); what was kept, when anything was taken.
pub fn scrub_text(
    holder: &mut Value,
    key: &str,
    ours: &dyn Fn(Canary) -> bool,
    opens_reply: bool,
) -> Option<Scrubbed> {
    let text = holder.get(key)?.as_str()?;
    let removals = own_text_removals(text, ours, opens_reply);
    if removals.is_empty() {
        return None;
    }
    let mut kept_ranges = Vec::with_capacity(removals.len() + 1);
    let mut from = 0;
    for removed in removals {
        kept_ranges.push(from..removed.start);
        from = removed.end;
    }
    kept_ranges.push(from..text.len());
    let mut chars = KeptChars::default();
    chars.push(text, &kept_ranges);
    let clean: String = kept_ranges
        .iter()
        .map(|range| &text[range.clone()])
        .collect();
    let original = std::mem::replace(&mut holder[key], Value::String(clean));
    Some(Scrubbed {
        original: original.as_str().unwrap_or_default().to_owned(),
        kept: kept_ranges,
        chars,
    })
}

/// Scrubs every string in `value` (none as a reply's opening); whether any
/// changed. A plain text part (`type` and `text` alone) left empty was
/// canarygate's, and goes.
pub fn scrub_strings(value: &mut Value, ours: &dyn Fn(Canary) -> bool) -> bool {
    match value {
        Value::String(text) => match without_own_text(text, ours, false) {
            Some(clean) => {
                *text = clean;
                true
            }
            None => false,
        },
        Value::Array(items) => {
            let mut changed = false;
            items.retain_mut(|item| {
                let was_text = plain_text(item).is_some_and(|text| !text.is_empty());
                changed |= scrub_strings(item, ours);
                !(was_text && plain_text(item) == Some(""))
            });
            changed
        }
        Value::Object(members) => members.values_mut().fold(false, |changed, member| {
            scrub_strings(member, ours) | changed
        }),
        _ => false,
    }
}

/// The text of a plain text part: an object of `type` and a string `text`
/// alone, as canarygate adds one.
fn plain_text(part: &Value) -> Option<&str> {
    let part = part.as_object()?;
    (part.len() == 2 && part.get("type").is_some_and(Value::is_string))
        .then(|| part.get("text")?.as_str())
        .flatten()
}
