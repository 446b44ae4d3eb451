//! Logprobs follow the content: when a content field is edited, its token
//! entries (`logprobs.content`, whose `token`s concatenate to the field's
//! text) are edited the same way, so joining the delivered tokens gives the
//! delivered content.

use std::ops::Range;

use canarygate_policies::canary::find_canaries;
use serde_json::{Value, json};

use crate::wire::edit::FieldEdit;

/// The bytes a logprobs entry stands for: its `bytes` (exact even for a
/// token that splits a character), else its `token`.
fn entry_bytes(entry: &Value) -> Option<Vec<u8>> {
    match entry.get("bytes").and_then(Value::as_array) {
        Some(bytes) => bytes
            .iter()
            .map(|byte| byte.as_u64().and_then(|byte| u8::try_from(byte).ok()))
            .collect(),
        None => entry
            .get("token")
            .and_then(Value::as_str)
            .map(|token| token.as_bytes().to_vec()),
    }
}

/// Edits list `list` (`content` or `refusal`) of `logprobs` (a choice's
/// `logprobs` object) to follow `edit` of the field's `text`
/// ([`followed`]).
pub fn follow(logprobs: &mut Value, list: &str, text: &str, edit: &FieldEdit) {
    if edit.unchanged() {
        return;
    }
    if let Some(entries) = logprobs.get_mut(list).and_then(Value::as_array_mut) {
        *entries = followed(std::mem::take(entries), text, &edit.kept);
    }
}

/// Token `entries` (whose tokens, or `bytes`, spell `text`) as they follow
/// the `kept` ranges of `text`: entries wholly removed go, entries cut in
/// part keep their kept bytes (and lose their alternatives, which were
/// alternatives to another token). When the entries do not spell `text`
/// they cannot be placed, and all of them go.
pub fn followed(entries: Vec<Value>, text: &str, kept: &[Range<usize>]) -> Vec<Value> {
    let spelled: Option<Vec<Vec<u8>>> = entries.iter().map(entry_bytes).collect();
    let Some(spelled) = spelled.filter(|spelled| spelled.concat() == text.as_bytes()) else {
        return Vec::new();
    };
    let mut at = 0;
    let mut out = Vec::with_capacity(entries.len());
    for (mut entry, bytes) in entries.into_iter().zip(spelled) {
        let span = at..at + bytes.len();
        at = span.end;
        let mut shown = Vec::new();
        for range in kept {
            let start = range.start.max(span.start);
            let end = range.end.min(span.end);
            if start < end {
                shown.extend_from_slice(&text.as_bytes()[start..end]);
            }
        }
        if shown.len() == bytes.len() {
            out.push(entry);
        } else if !shown.is_empty() {
            entry["token"] = json!(String::from_utf8_lossy(&shown));
            entry["bytes"] = json!(shown);
            entry["top_logprobs"] = json!([]);
            out.push(entry);
        }
    }
    out
}

/// Clears list `list` of `logprobs` unless its entries spell `delivered`
/// exactly and spell nothing canary-shaped: the last guard, for a choice
/// some field of which was edited, so that no logprobs the client gets
/// disagree with what it got or show a canary (vLLM attaches logprobs to
/// reasoning deltas too).
pub fn check(logprobs: &mut Value, list: &str, delivered: &str) {
    let Some(entries) = logprobs.get_mut(list).and_then(Value::as_array_mut) else {
        return;
    };
    let spelled: Option<Vec<Vec<u8>>> = entries.iter().map(entry_bytes).collect();
    let agrees = spelled.is_some_and(|spelled| {
        let joined = spelled.concat();
        joined == delivered.as_bytes()
            && find_canaries(&String::from_utf8_lossy(&joined))
                .next()
                .is_none()
    });
    if !agrees {
        entries.clear();
    }
}

#[cfg(test)]
#[allow(
    clippy::single_range_in_vec_init,
    reason = "lists of byte ranges that happen to hold one range"
)]
mod tests {
    use super::*;

    fn entry(token: &str) -> Value {
        json!({"token": token, "logprob": -0.5, "bytes": token.as_bytes(),
               "top_logprobs": [{"token": token, "logprob": -0.5, "bytes": token.as_bytes()}]})
    }

    fn tokens(logprobs: &Value) -> Vec<&str> {
        logprobs["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|entry| entry["token"].as_str().unwrap())
            .collect()
    }

    #[test]
    fn removed_tokens_go_and_cut_ones_keep_their_kept_bytes() {
        // "[CG1] Hi there": the echo "[CG1] " (0..6) removed.
        let text = "[CG1] Hi there";
        let mut logprobs = json!({"content": [entry("[CG"), entry("1]"), entry(" Hi"), entry(" there")],
                                  "refusal": null});
        let edit = FieldEdit {
            kept: vec![6..14],
            len: text.len(),
        };
        follow(&mut logprobs, "content", text, &edit);
        assert_eq!(tokens(&logprobs), ["Hi", " there"]);
        assert_eq!(logprobs["content"][0]["bytes"], json!(b"Hi"));
        assert_eq!(logprobs["content"][0]["top_logprobs"], json!([]));
        assert_eq!(logprobs["content"][1], entry(" there"));
        assert_eq!(logprobs["refusal"], Value::Null);
    }

    #[test]
    fn tokens_that_do_not_spell_the_text_all_go() {
        let mut logprobs = json!({"content": [entry("[CG1]"), entry(" Hello")]});
        let edit = FieldEdit {
            kept: vec![6..9],
            len: 9,
        };
        follow(&mut logprobs, "content", "[CG1] Hi!", &edit);
        assert_eq!(logprobs["content"], json!([]));
    }

    #[test]
    fn tokens_are_measured_by_their_bytes() {
        // A token that splits a character: its `token` is an escape, its
        // bytes are exact.
        let text = "CG1 日";
        let split = json!({"token": "\\xe6\\x97", "logprob": -1.0, "bytes": [0xe6, 0x97],
                           "top_logprobs": []});
        let last = json!({"token": "\\xa5", "logprob": -1.0, "bytes": [0xa5], "top_logprobs": []});
        let mut logprobs = json!({"content": [entry("CG1"), entry(" "), split, last]});
        let edit = FieldEdit {
            kept: vec![4..7],
            len: text.len(),
        };
        follow(&mut logprobs, "content", text, &edit);
        assert_eq!(logprobs["content"].as_array().unwrap().len(), 2);
        check(&mut logprobs, "content", "日");
        assert_eq!(
            logprobs["content"].as_array().unwrap().len(),
            2,
            "{logprobs}"
        );
        // Entries that spell a canary, or not what was delivered, go.
        let mut leaking = json!({"content": [entry("CG1234567"), entry("89012345")]});
        check(&mut leaking, "content", "CG123456789012345");
        assert_eq!(leaking["content"], json!([]));
        let mut other = json!({"content": [entry("Hello")]});
        check(&mut other, "content", "Hi");
        assert_eq!(other["content"], json!([]));
    }
}
