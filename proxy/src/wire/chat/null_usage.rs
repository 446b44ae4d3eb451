//! The `"usage": null` member a provider puts on every chunk of a stream
//! that asked for its usage (OpenAI does), taken out of the chunks of a
//! client that did not ask: canarygate always asks, and what it adds to a
//! request must not show in the answer.
//!
//! Read on the chunk's own bytes, so a chunk that needs no other change
//! still goes out as the provider wrote it, less that member.

use std::ops::Range;
use std::sync::LazyLock;

use canarygate_policies::sse::encode_data;
use memchr::memmem;

/// Writes `data` (a chunk's JSON object, as received) to `out` as an SSE
/// event, without its top-level `usage` member when that member is `null`
/// (and without allocating, for a chunk on one line); as it came when it has
/// none (or a non-null one, or one deeper in the chunk).
pub fn encode_without_null_usage(data: &str, out: &mut Vec<u8>) {
    let Some(cut) = null_usage_span(data) else {
        return encode_data(data, out);
    };
    let (before, after) = (&data[..cut.start], &data[cut.end..]);
    if memchr::memchr2(b'\n', b'\r', data.as_bytes()).is_some() {
        return encode_data(&[before, after].concat(), out);
    }
    out.reserve(data.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(before.as_bytes());
    out.extend_from_slice(after.as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// Finds the member's key; built once.
static USAGE_KEY: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"usage\""));

/// The bytes of `data` that make its top-level `"usage": null` member, with
/// the comma that goes with it; `None` when it has no such member.
fn null_usage_span(data: &str) -> Option<Range<usize>> {
    let bytes = data.as_bytes();
    let mut from = 0;
    while let Some(found) = USAGE_KEY.find(&bytes[from..]) {
        let key = from + found;
        from = key + 1;
        let Some(end) = null_value_end(bytes, key + "\"usage\"".len()) else {
            continue;
        };
        if !at_top_level(bytes, key) {
            continue;
        }
        let before = bytes[..key].trim_ascii_end();
        if before.ends_with(b",") {
            // `, "usage": null`: the comma before it goes with it.
            return Some(before.len() - 1..end);
        }
        // The first member: the comma after it goes with it.
        let after = &bytes[end..];
        let rest = after.trim_ascii_start();
        let skipped = after.len() - rest.len();
        return Some(match rest.first() {
            Some(b',') => key..end + skipped + 1,
            _ => key..end,
        });
    }
    None
}

/// Where a `null` value ends, when the bytes from `at` (just after a key)
/// are optional whitespace, `:`, optional whitespace and `null`.
fn null_value_end(bytes: &[u8], at: usize) -> Option<usize> {
    let rest = bytes.get(at..)?.trim_ascii_start();
    let rest = rest.strip_prefix(b":")?.trim_ascii_start();
    let after = rest.strip_prefix(b"null")?;
    // `null` must end there (`nullx` is no JSON, but be strict).
    if after.first().is_some_and(u8::is_ascii_alphanumeric) {
        return None;
    }
    Some(bytes.len() - after.len())
}

/// Whether byte `at` of a JSON document is outside every string and
/// directly inside its outermost object. Strings are skipped to their
/// closing quote by `memchr`, as most of a chunk's bytes are in them.
fn at_top_level(bytes: &[u8], at: usize) -> bool {
    let mut depth = 0_usize;
    let mut next = 0;
    while next < at {
        match bytes[next] {
            b'"' => match string_end(bytes, next + 1, at) {
                Some(after) => {
                    next = after;
                    continue;
                }
                // `at` is inside this string.
                None => return false,
            },
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
        next += 1;
    }
    depth == 1
}

/// Where the string whose content starts at `from` ends (just after its
/// closing quote), if that is at or before `limit`.
fn string_end(bytes: &[u8], mut from: usize, limit: usize) -> Option<usize> {
    while from < limit {
        let found = memchr::memchr2(b'"', b'\\', &bytes[from..limit])?;
        let at = from + found;
        if bytes[at] == b'"' {
            return Some(at + 1);
        }
        // An escape: it and the byte it escapes.
        from = at + 2;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// The event written holds the document serde reads less the member,
    /// and nothing else changes; `expected` is its data (`None`: `data` as
    /// it came).
    fn check(data: &str, expected: Option<&str>) {
        let mut out = Vec::new();
        encode_without_null_usage(data, &mut out);
        let written = String::from_utf8(out).unwrap();
        let edited = written
            .strip_prefix("data: ")
            .and_then(|rest| rest.strip_suffix("\n\n"))
            .unwrap();
        assert_eq!(edited, expected.unwrap_or(data), "{data}");
        if expected.is_some() {
            let mut tree: Value = serde_json::from_str(data).unwrap();
            tree.as_object_mut().unwrap().remove("usage");
            assert_eq!(serde_json::from_str::<Value>(edited).unwrap(), tree);
        }
    }

    #[test]
    fn only_a_top_level_null_usage_goes() {
        check(
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}"#,
            Some(r#"{"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}"#),
        );
        check(
            r#"{"id":"c","usage":null,"obfuscation":"x"}"#,
            Some(r#"{"id":"c","obfuscation":"x"}"#),
        );
        check(
            r#"{ "usage" : null , "id": "c" }"#,
            Some(r#"{  "id": "c" }"#),
        );
        check(r#"{"usage": null}"#, Some("{}"));
        // A usage of numbers, one deeper in the chunk, or the words in a
        // text: left alone.
        check(r#"{"id":"c","usage":{"prompt_tokens":3}}"#, None);
        check(r#"{"choices":[{"delta":{"usage":null}}]}"#, None);
        check(
            r#"{"choices":[{"delta":{"content":"say \"usage\":null"}}]}"#,
            None,
        );
        check(r#"{"id":"c"}"#, None);
        // Escaped quotes and backslashes before it, a key inside a string.
        check(
            r#"{"t":"a \" b \\","usage":null}"#,
            Some(r#"{"t":"a \" b \\"}"#),
        );
        check(r#"{"t":"x\",\"usage\":null"}"#, None);
        // On several lines: the line break before the member goes with it,
        // one after it stays, ending a data line.
        let mut out = Vec::new();
        encode_without_null_usage("{\"id\":\"c\",\n\"usage\":null}", &mut out);
        assert_eq!(out, b"data: {\"id\":\"c\"}\n\n");
        let mut out = Vec::new();
        encode_without_null_usage("{\"usage\":null,\n\"id\":\"c\"\n}", &mut out);
        assert_eq!(out, b"data: {\ndata: \"id\":\"c\"\ndata: }\n\n");
        // A deeper one first, then the top-level one.
        check(
            r#"{"x":{"usage":null},"usage":null}"#,
            Some(r#"{"x":{"usage":null}}"#),
        );
    }
}
