//! Legacy logprobs follow the text: `{tokens, token_logprobs, top_logprobs,
//! text_offset}`, four lists of one entry per token, the `tokens` spelling
//! the choice's text (or, in a stream chunk, the chunk's). When the text is
//! edited, the entries are edited the same way: tokens wholly removed go
//! from all four lists, tokens cut in part keep their kept characters (and
//! lose their alternatives, which were alternatives to another token), and
//! every `text_offset` moves back by the characters removed before it, so
//! the offsets line up with the text the client got. Where the provider
//! counts offsets from the prompt's start, they also move back by the
//! characters canarygate appended to the prompt ([`prompt_shift`]), so they
//! count from the client's own prompt as direct. Entries that cannot be
//! placed, or that would spell a canary or text the client did not get, all
//! go (the lists are left empty), as in Chat Completions.

use canarygate_policies::canary::find_canaries;
use serde_json::{Map, Value, json};

use crate::wire::edit::FieldEdit;

/// The four lists, in the order of their entries.
const LISTS: [&str; 4] = ["tokens", "token_logprobs", "top_logprobs", "text_offset"];

/// The `tokens` of `logprobs`, when every entry is a string.
fn tokens(logprobs: &Value) -> Option<Vec<&str>> {
    logprobs
        .get("tokens")?
        .as_array()?
        .iter()
        .map(Value::as_str)
        .collect()
}

/// Empties every list of `logprobs` it has.
fn clear(logprobs: &mut Value) {
    for list in LISTS {
        if let Some(entries) = logprobs.get_mut(list).and_then(Value::as_array_mut) {
            entries.clear();
        }
    }
}

/// Whether every list `logprobs` has holds `len` entries.
fn lists_agree(logprobs: &Value, len: usize) -> bool {
    LISTS.iter().all(|list| match logprobs.get(*list) {
        None | Some(Value::Null) => true,
        Some(Value::Array(entries)) => entries.len() == len,
        Some(_) => false,
    })
}

/// How far back canarygate's `appended` characters of the prompt move the
/// `text_offset`s of `logprobs`, the first of a choice: all of them where
/// the provider counts from the prompt's start (OpenAI, whose first offset
/// is the prompt's length), none where it counts from the completion's
/// (vLLM's streams, whose first offset is 0); `None` while no offset came.
pub fn prompt_shift(logprobs: &Value, appended: usize) -> Option<usize> {
    let first = logprobs.get("text_offset")?.as_array()?.first()?.as_u64()?;
    Some(if first >= appended as u64 {
        appended
    } else {
        0
    })
}

/// Moves every `text_offset` of `logprobs` back by `by` characters.
pub fn shift(logprobs: &mut Value, by: usize) {
    if by == 0 {
        return;
    }
    if let Some(offsets) = logprobs
        .get_mut("text_offset")
        .and_then(Value::as_array_mut)
    {
        for offset in offsets {
            if let Some(at) = offset.as_u64() {
                *offset = json!(at.saturating_sub(by as u64));
            }
        }
    }
}

/// Edits `logprobs` (a choice's legacy logprobs object) to follow `edit` of
/// its `text`, `removed_before` characters of the choice having been removed
/// before this text.
pub fn follow(logprobs: &mut Value, text: &str, edit: &FieldEdit, removed_before: usize) {
    let Some(tokens) =
        tokens(logprobs).map(|tokens| tokens.into_iter().map(str::to_owned).collect::<Vec<_>>())
    else {
        clear(logprobs);
        return;
    };
    if tokens.concat() != text || !lists_agree(logprobs, tokens.len()) {
        clear(logprobs);
        return;
    }
    // Each list taken out, `None` where the object has none.
    let mut lists: [Option<Vec<Value>>; 4] = LISTS.map(|list| {
        logprobs
            .get_mut(list)
            .and_then(Value::as_array_mut)
            .map(std::mem::take)
    });
    let mut kept: [Vec<Value>; 4] = Default::default();
    let mut removed = removed_before;
    let mut at = 0;
    for (position, token) in tokens.iter().enumerate() {
        let span = at..at + token.len();
        at = span.end;
        let mut shown = String::new();
        for range in &edit.kept {
            let (start, end) = (range.start.max(span.start), range.end.min(span.end));
            if start < end {
                shown.push_str(&text[start..end]);
            }
        }
        if !shown.is_empty() {
            let whole = shown.len() == token.len();
            for (list, (entries, out)) in LISTS.iter().zip(lists.iter_mut().zip(&mut kept)) {
                let Some(entries) = entries else { continue };
                let entry = std::mem::take(&mut entries[position]);
                out.push(match *list {
                    "tokens" if !whole => json!(shown),
                    "top_logprobs" if !whole => Value::Object(Map::new()),
                    "text_offset" => match entry.as_u64() {
                        Some(offset) => json!(offset.saturating_sub(removed as u64)),
                        None => entry,
                    },
                    _ => entry,
                });
            }
        }
        removed += token.chars().count() - shown.chars().count();
    }
    for ((name, list), entries) in LISTS.iter().zip(lists).zip(kept) {
        if list.is_some() {
            logprobs[*name] = Value::Array(entries);
        }
    }
}

/// Empties `logprobs` unless its tokens spell `delivered` exactly and
/// nothing canary-shaped: the last guard for a choice some text of which
/// was edited.
pub fn check(logprobs: &mut Value, delivered: &str) {
    let agrees = tokens(logprobs).is_some_and(|tokens| {
        let joined = tokens.concat();
        joined == delivered && find_canaries(&joined).next().is_none()
    });
    if !agrees {
        clear(logprobs);
    }
}

#[cfg(test)]
#[allow(
    clippy::single_range_in_vec_init,
    reason = "lists of byte ranges that happen to hold one range"
)]
mod tests {
    use super::*;

    /// Logprobs of `tokens`, their offsets counted from `base`.
    fn logprobs(tokens: &[&str], base: usize) -> Value {
        let mut offsets = Vec::new();
        let mut at = base;
        for token in tokens {
            offsets.push(at);
            at += token.chars().count();
        }
        json!({
            "tokens": tokens,
            "token_logprobs": tokens.iter().map(|_| -0.25).collect::<Vec<_>>(),
            "top_logprobs": tokens.iter().map(|token| json!({*token: -0.25})).collect::<Vec<_>>(),
            "text_offset": offsets,
        })
    }

    #[test]
    fn the_echo_goes_and_the_offsets_follow_the_delivered_text() {
        // "[CG1] Hi thé re": the echo "[CG1] " (0..6) removed.
        let text = "[CG1] Hi thé re";
        let mut probs = logprobs(&["[CG", "1]", " H", "i", " thé", " re"], 10);
        let edit = FieldEdit {
            kept: vec![6..text.len()],
            len: text.len(),
        };
        follow(&mut probs, text, &edit, 0);
        assert_eq!(probs["tokens"], json!(["H", "i", " thé", " re"]));
        assert_eq!(
            probs["top_logprobs"][0],
            json!({}),
            "a cut token's alternatives go"
        );
        assert_eq!(probs["top_logprobs"][1], json!({"i": -0.25}));
        assert_eq!(probs["token_logprobs"].as_array().unwrap().len(), 4);
        // "Hi thé re" from offset 10: H 10, i 11, " thé" 12, " re" 16.
        assert_eq!(probs["text_offset"], json!([10, 11, 12, 16]));
        check(&mut probs, "Hi thé re");
        assert_eq!(probs["tokens"].as_array().unwrap().len(), 4, "{probs}");

        // A later chunk of the same choice: shifted by what went before.
        let mut later = logprobs(&[" again"], 25);
        let unchanged = FieldEdit {
            kept: vec![0..6],
            len: 6,
        };
        follow(&mut later, " again", &unchanged, 7);
        assert_eq!(later["text_offset"], json!([18]));
        let mut shifted = logprobs(&[" again"], 25);
        shift(&mut shifted, 7);
        assert_eq!(shifted, later);
    }

    #[test]
    fn canarygates_prompt_text_is_uncounted_only_where_the_provider_counts_it() {
        // 150 characters appended to a 20-character prompt. Counted from the
        // prompt's start (OpenAI), the first offset is 170: shift all 150.
        assert_eq!(prompt_shift(&logprobs(&["Hi"], 170), 150), Some(150));
        // Counted from the completion's start (vLLM's streams): none.
        assert_eq!(prompt_shift(&logprobs(&["Hi"], 0), 150), Some(0));
        // Nothing to decide on yet.
        assert_eq!(prompt_shift(&logprobs(&[], 0), 150), None);
        assert_eq!(prompt_shift(&Value::Null, 150), None);
    }

    #[test]
    fn entries_that_cannot_be_placed_or_would_leak_all_go() {
        let empty = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []});
        let edit = FieldEdit {
            kept: vec![4..9],
            len: 9,
        };
        // Tokens that do not spell the text.
        let mut probs = logprobs(&["[CG1]", " Hello"], 0);
        follow(&mut probs, "[CG] Hi!!", &edit, 0);
        assert_eq!(probs, empty);
        // Lists of different lengths.
        let mut probs = logprobs(&["[CG]", " Hi!!"], 0);
        probs["text_offset"] = json!([0]);
        follow(&mut probs, "[CG] Hi!!", &edit, 0);
        assert_eq!(probs, empty);
        // Tokens that spell a canary, or not what was delivered.
        let mut leaking = logprobs(&["CG1234567", "89012345"], 0);
        check(&mut leaking, "CG123456789012345");
        assert_eq!(leaking, empty);
        let mut other = logprobs(&["Hello"], 0);
        check(&mut other, "Hi");
        assert_eq!(other, empty);
    }
}
