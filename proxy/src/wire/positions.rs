//! Positions in an answer's text that the answer itself points at, moved
//! with the text when canarygate removes part of it.
//!
//! A citation annotation (Chat Completions' `message.annotations[]
//! .url_citation`, the Responses API's `output_text.annotations[]`) names
//! the span of the text it cites by `start_index` and `end_index`, or a
//! point by `index`, counted in characters (Unicode scalar values) of the
//! text as the provider wrote it. Once the echo, a canary or the text past
//! the client's limit is removed, those counts point elsewhere: each text
//! keeps a [`KeptChars`] of what was removed from it, and
//! [`follow_annotations`] moves every position by the characters removed
//! before it. An annotation whose cited span was removed whole stays, its
//! span empty where the text resumes: annotations are not dropped, so a
//! stream's `annotation_index` and the final answer's list still agree.
//! Azure's asynchronous content filter points at the content the same way,
//! by a choice's `content_filter_offsets` ([`follow_filter_offsets`]).

use std::ops::Range;

use serde_json::Value;

/// Which characters of a text reached the client: the text as the provider
/// wrote it, piece by piece, with the characters removed from it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KeptChars {
    /// Characters of the provider's text read so far.
    seen: usize,
    /// Runs of removed characters, `(first, count)` in the provider's text,
    /// in order and apart.
    removed: Vec<(usize, usize)>,
}

impl KeptChars {
    /// Adds the next piece of the provider's text, `text`, of which the
    /// client got the byte ranges `kept` (in order, on char boundaries).
    pub fn push(&mut self, text: &str, kept: &[Range<usize>]) {
        let mut byte = 0;
        for range in kept {
            self.remove_next(&text[byte..range.start]);
            self.seen += text[range.clone()].chars().count();
            byte = range.end;
        }
        self.remove_next(&text[byte..]);
    }

    /// Adds the next piece of the provider's text, which the client got
    /// whole.
    pub fn push_whole(&mut self, text: &str) {
        self.seen += text.chars().count();
    }

    /// Reads `removed`, the next characters of the text, as removed.
    fn remove_next(&mut self, removed: &str) {
        let count = removed.chars().count();
        if count == 0 {
            return;
        }
        match self.removed.last_mut() {
            Some((first, run)) if *first + *run == self.seen => *run += count,
            _ => self.removed.push((self.seen, count)),
        }
        self.seen += count;
    }

    /// Whether nothing was removed.
    pub fn keeps_all(&self) -> bool {
        self.removed.is_empty()
    }

    /// Where character `index` of the provider's text is in the client's:
    /// `index` less the characters removed before it (a removed character
    /// maps to where the text resumes).
    pub fn map(&self, index: usize) -> usize {
        let mut before = 0;
        for &(first, count) in &self.removed {
            if index <= first {
                break;
            }
            before += count.min(index - first);
        }
        index - before
    }
}

/// Moves the positions of `annotations` (an array of annotations of one
/// text) by what `kept` says was removed from that text: `start_index`,
/// `end_index` and `index` of each annotation, or of the object in it that
/// holds them (`url_citation`). Returns whether anything changed.
pub fn follow_annotations(annotations: &mut Value, kept: &KeptChars) -> bool {
    if kept.keeps_all() {
        return false;
    }
    let mut moved = false;
    for annotation in annotations.as_array_mut().into_iter().flatten() {
        moved |= follow(annotation, kept);
    }
    moved
}

/// Moves one annotation's positions; returns whether any moved.
fn follow(annotation: &mut Value, kept: &KeptChars) -> bool {
    let holds = |value: &Value| {
        ["start_index", "end_index", "index"]
            .iter()
            .any(|key| value.get(key).is_some_and(Value::is_u64))
    };
    let holder = if holds(annotation) {
        Some(annotation)
    } else {
        annotation
            .as_object_mut()
            .and_then(|members| members.values_mut().find(|member| holds(member)))
    };
    let Some(holder) = holder else {
        return false;
    };
    move_positions(holder, &["start_index", "end_index", "index"], kept)
}

/// Moves the positions of a choice's `content_filter_offsets` (Azure
/// OpenAI's asynchronous filter: `check_offset`, `start_offset` and
/// `end_offset`, characters of the content it checked) by what `kept` says
/// was removed from the content, so they neither point past the delivered
/// text nor tell how long the removed echo was. Returns whether anything
/// changed.
pub fn follow_filter_offsets(offsets: &mut Value, kept: &KeptChars) -> bool {
    if kept.keeps_all() {
        return false;
    }
    move_positions(
        offsets,
        &["check_offset", "start_offset", "end_offset"],
        kept,
    )
}

/// Moves the positions `holder` holds under `keys` (counts, in characters
/// of the provider's text) to the client's; returns whether any moved.
fn move_positions(holder: &mut Value, keys: &[&str], kept: &KeptChars) -> bool {
    let mut changed = false;
    for &key in keys {
        if let Some(at) = holder.get(key).and_then(Value::as_u64) {
            let moved = kept.map(usize::try_from(at).unwrap_or(usize::MAX)) as u64;
            if moved != at {
                holder[key] = Value::from(moved);
                changed = true;
            }
        }
    }
    changed
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // kept ranges are lists, often of one
mod tests {
    use serde_json::json;

    use super::*;

    /// What the client gets of `text` with `kept`, and the map.
    fn kept_of(pieces: &[(&str, &[Range<usize>])]) -> (String, KeptChars) {
        let mut shown = String::new();
        let mut kept = KeptChars::default();
        for (text, ranges) in pieces {
            for range in *ranges {
                shown.push_str(&text[range.clone()]);
            }
            kept.push(text, ranges);
        }
        (shown, kept)
    }

    #[test]
    fn positions_move_by_the_characters_removed_before_them() {
        // "CG1 [CG2]\n" removed from the front of the first piece, a canary
        // from the middle of the second; multi-byte characters count once.
        let first = "CG1 [CG2]\nHéllo wörld, ";
        let second = "see CG9 this";
        let (shown, kept) = kept_of(&[(first, &[10..first.len()]), (second, &[0..4, 7..12])]);
        assert_eq!(shown, "Héllo wörld, see  this");
        let original: Vec<char> = format!("{first}{second}").chars().collect();
        let client: Vec<char> = shown.chars().collect();
        // Every kept character lands on itself.
        for (index, c) in original.iter().enumerate() {
            let removed = index < 10 || (27..30).contains(&index);
            if !removed {
                assert_eq!(client[kept.map(index)], *c, "{index}");
            }
        }
        assert_eq!(kept.map(0), 0);
        assert_eq!(kept.map(5), 0, "inside the echo: where the text resumes");
        assert_eq!(kept.map(original.len()), client.len());
    }

    #[test]
    fn annotations_follow_their_text() {
        let text = "CG1 [CG2]\nHello world. More.";
        let (shown, kept) = kept_of(&[(text, &[10..text.len() - 5])]);
        assert_eq!(shown, "Hello world. ");
        // Responses' shape, and Chat's (the positions one level down).
        let mut annotations = json!([
            {"type": "url_citation", "start_index": 16, "end_index": 21, "url": "u"},
            {"type": "file_citation", "index": 22, "file_id": "f"},
            {"type": "url_citation", "url_citation": {"start_index": 10, "end_index": 15}},
            {"type": "url_citation", "start_index": 2, "end_index": 8},
            {"type": "url_citation", "start_index": 23, "end_index": 28},
            {"type": "other"},
        ]);
        assert!(follow_annotations(&mut annotations, &kept));
        assert_eq!(
            annotations,
            json!([
                {"type": "url_citation", "start_index": 6, "end_index": 11, "url": "u"},
                {"type": "file_citation", "index": 12, "file_id": "f"},
                {"type": "url_citation", "url_citation": {"start_index": 0, "end_index": 5}},
                // Their cited text is gone: an empty span where it resumes.
                {"type": "url_citation", "start_index": 0, "end_index": 0},
                {"type": "url_citation", "start_index": 13, "end_index": 13},
                {"type": "other"},
            ])
        );
        let cited: String = shown.chars().skip(6).take(5).collect();
        assert_eq!(cited, "world");
    }

    #[test]
    fn filter_offsets_follow_their_content() {
        let text = "CG1 [CG2]\nHello world.";
        let (shown, kept) = kept_of(&[(text, &[10..text.len()])]);
        let mut offsets = json!({"check_offset": 0, "start_offset": 10, "end_offset": 22});
        assert!(follow_filter_offsets(&mut offsets, &kept));
        assert_eq!(
            offsets,
            json!({"check_offset": 0, "start_offset": 0, "end_offset": 12})
        );
        assert_eq!(shown.chars().count(), 12);
        // Nothing removed: nothing moves.
        let (_, whole) = kept_of(&[(text, &[0..text.len()])]);
        assert!(!follow_filter_offsets(&mut offsets, &whole));
    }

    #[test]
    fn nothing_removed_changes_nothing() {
        let mut kept = KeptChars::default();
        kept.push_whole("Hello");
        kept.push("world", &[0..5]);
        let mut annotations = json!([{"start_index": 1, "end_index": 3}]);
        assert!(!follow_annotations(&mut annotations, &kept));
        assert_eq!(annotations, json!([{"start_index": 1, "end_index": 3}]));
    }
}
