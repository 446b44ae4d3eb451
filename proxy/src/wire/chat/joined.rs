//! The strings of a Chat stream's delta that SDKs join across chunks.
//!
//! openai-python's stream helper joins every string of a delta with the
//! string at the same path in the chunks before (all but `index` and
//! `type`): a field canarygate does not know, a tool call's `id` and
//! `name`. Each such string is read as a [`Part::Other`] numbered by its
//! path ([`joined_strings`]), the same number in every chunk, and the
//! verifier looks at a string's tail that could grow into a canary with the
//! next string under that number: a canary split across chunks is read as
//! the client's SDK puts it together.

use canarygate_policies::canary::{find_canaries, may_join_a_canary};
use canarygate_policies::verify::Part;
use serde_json::Value;

use crate::wire::format::{TextField, TextFields};
use crate::wire::location::Location;

/// Where every delta's paths begin ([`path_step`] of this is `delta`'s).
pub(super) const ROOT: u32 = 0x811c_9dc5;

/// The bit that sets a stream delta's joined strings' numbers
/// ([`joined_strings`]) apart from the others' (counted from 0).
const JOINED: u32 = 1 << 31;

/// Pushes onto `texts` every string under `value` (at `at`, reached by
/// member `key`) of a stream's delta that SDKs join with the string at the
/// same path in the chunks before (openai-python's stream helper joins
/// every string of a delta but `index` and `type`, which are read whole),
/// except tool and function arguments (their own parts): a [`Part::Other`] field numbered
/// by `path` (member names, and a listed entry's `index`), so that the
/// verifier reads a canary split across chunks as the client's SDK puts it
/// together. Only strings that may be part of a canary are pushed
/// ([`may_join_a_canary`]).
pub(super) fn joined_strings(
    value: &Value,
    at: Location,
    (choice, path): (u32, u32),
    key: &str,
    texts: &mut TextFields,
) {
    match value {
        // Replaced by each chunk's, not joined: read whole.
        Value::String(text)
            if matches!(key, "index" | "type") && find_canaries(text).next().is_some() =>
        {
            let n = texts.len() as u32;
            texts.push(TextField {
                choice,
                kind: Part::Other(n),
                at,
            });
        }
        Value::String(_) if matches!(key, "index" | "type") => {}
        Value::String(text) if key != "arguments" && may_join_a_canary(text) => {
            texts.push(TextField {
                choice,
                kind: Part::Other(path | JOINED),
                at,
            });
        }
        Value::Array(items) if at.has_room() => {
            for (position, item) in items.iter().enumerate() {
                // Entries with an `index` are joined by it, others appended.
                let step = match item.get("index").and_then(Value::as_u64) {
                    Some(index) => path_step(path, b'#', &index.to_le_bytes()),
                    None => path_step(path, b'@', &(position as u64).to_le_bytes()),
                };
                joined_strings(item, at.index(position), (choice, step), key, texts);
            }
        }
        Value::Object(members) if at.has_room() => {
            for (position, (member, inner)) in members.iter().enumerate() {
                let step = path_step(path, b'.', member.as_bytes());
                joined_strings(inner, at.member(position), (choice, step), member, texts);
            }
        }
        _ => {}
    }
}

/// The [`Part::Other`] of a string that SDKs join across a stream's events
/// sharing `keys` (a Responses delta of a kind canarygate does not read as
/// text: its type and its item's index), numbered as [`joined_strings`]
/// numbers a delta's.
pub fn joined_other(keys: &[&[u8]]) -> Part {
    let path = keys
        .iter()
        .fold(ROOT, |path, key| path_step(path, b'.', key));
    Part::Other(path | JOINED)
}

/// `path` one step further, by `tag` and `bytes` (FNV-1a, 31 bits).
pub(super) fn path_step(path: u32, tag: u8, bytes: &[u8]) -> u32 {
    let mut hash = path;
    for &byte in std::iter::once(&tag).chain(bytes) {
        hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
    }
    hash & !JOINED
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use serde_json::json;

    use super::*;
    use crate::wire::chat::answer::read_choices;
    use crate::wire::location::Key;

    #[test]
    fn a_deltas_strings_are_numbered_by_their_path_across_chunks() {
        let first = json!({"choices": [{"index": 0, "delta": {"role": "assistant",
            "x_note": "see CG1234",
            "tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                            "function": {"name": "look_CG12", "arguments": ""}}]}}]});
        let second = json!({"choices": [{"index": 0, "delta": {
            "tool_calls": [{"index": 1, "function": {"name": "345", "arguments": "{}"}}],
            "x_note": "56789 end"}}]});
        let others = |chunk: &Value| -> Vec<(u32, String)> {
            read_choices(chunk, Key::Delta)[0]
                .texts
                .iter()
                .filter_map(|field| match field.kind {
                    Part::Other(n) => Some((n, field.text(chunk).to_owned())),
                    _ => None,
                })
                .collect()
        };
        let (first, second) = (others(&first), others(&second));
        let texts: Vec<&str> = first.iter().map(|(_, text)| text.as_str()).collect();
        // The role cannot join a canary, and the call's `type` is replaced,
        // not joined: neither is pushed.
        assert_eq!(texts, ["see CG1234", "call_1", "look_CG12"]);
        let numbers: HashSet<u32> = first.iter().map(|(n, _)| *n).collect();
        assert_eq!(numbers.len(), 3, "one number per path: {first:?}");
        assert!(numbers.iter().all(|n| n & JOINED != 0));
        // The next chunk's pieces go under their path's number, wherever
        // they stand in the delta.
        assert_eq!(
            second,
            [
                (first[2].0, "345".to_owned()),
                (first[0].0, "56789 end".to_owned())
            ]
        );
    }
}
