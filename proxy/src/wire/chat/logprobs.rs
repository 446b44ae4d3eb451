//! Logprobs follow the content: when a content field is edited, its token
//! entries (`logprobs.content`, whose `token`s concatenate to the field's
//! text) are edited the same way, so joining the delivered tokens gives the
//! delivered content.

use serde_json::{Value, json};

use crate::wire::edit::FieldEdit;

/// Edits the `content` list of `logprobs` (a choice's `logprobs` object) to
/// follow `edit` of the content `text`: entries wholly removed go, entries
/// cut in part keep their kept bytes (and lose their alternatives, which
/// were alternatives to another token). When the tokens do not spell `text`
/// the entries cannot be placed, and all of them go.
pub fn follow(logprobs: &mut Value, text: &str, edit: &FieldEdit) {
    if edit.unchanged() {
        return;
    }
    let Some(entries) = logprobs.get_mut("content").and_then(Value::as_array_mut) else {
        return;
    };
    let spelled: Option<usize> = entries
        .iter()
        .map(|entry| entry.get("token").and_then(Value::as_str).map(str::len))
        .sum();
    if spelled != Some(text.len()) {
        entries.clear();
        return;
    }
    let mut at = 0;
    let mut kept = Vec::with_capacity(entries.len());
    for mut entry in entries.drain(..) {
        let token = entry["token"].as_str().unwrap_or("").to_owned();
        let span = at..at + token.len();
        at = span.end;
        let mut shown = String::new();
        for range in &edit.kept {
            let start = range.start.max(span.start);
            let end = range.end.min(span.end);
            if start < end {
                // Token boundaries may split a character; keep whole ones.
                if let Some(piece) = text.get(start..end) {
                    shown.push_str(piece);
                }
            }
        }
        if shown.len() == token.len() {
            kept.push(entry);
        } else if !shown.is_empty() {
            entry["bytes"] = json!(shown.as_bytes());
            entry["token"] = json!(shown);
            entry["top_logprobs"] = json!([]);
            kept.push(entry);
        }
    }
    *entries = kept;
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
        follow(&mut logprobs, text, &edit);
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
        follow(&mut logprobs, "[CG1] Hi!", &edit);
        assert_eq!(logprobs["content"], json!([]));
    }
}
