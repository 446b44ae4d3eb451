//! Test-only: Chat Completions answers and chunks as a provider might write
//! them, for the property tests that hold the in-place readers
//! ([`super::light`], [`super::light_answer`]) to the tree's reading.
//!
//! A generated document is a [`Node`] rendered with a [`Style`]: members in
//! any order, strings with JSON escapes where a serialiser may or may not
//! use them (`\u00e9`, `\/`, surrogate pairs), whitespace between tokens or
//! none, numbers as written (`1.5`, `-1`, beyond `u64`), and now and then
//! a member twice or bytes after the document: everything a reader of the
//! provider's own bytes has to get right, or decline.

use proptest::prelude::*;

/// A JSON value as written: members in order, duplicates allowed, numbers
/// as text.
#[derive(Debug, Clone)]
pub enum Node {
    Null,
    Number(String),
    Str(String),
    Array(Vec<Node>),
    Object(Vec<(&'static str, Node)>),
}

/// How a document is written.
#[derive(Debug, Clone, Copy)]
pub struct Style {
    /// Whitespace around every token.
    pub spaced: bool,
    /// Non-ASCII characters as `\u` escapes (astral ones as surrogate
    /// pairs), `/` as `\/`, and member names' first letter escaped.
    pub escaped: bool,
}

impl Node {
    /// A string node.
    pub fn str(text: &str) -> Self {
        Self::Str(text.to_owned())
    }

    /// A number node, written as `text`.
    pub fn number(text: &str) -> Self {
        Self::Number(text.to_owned())
    }

    /// This node as JSON text in `style`.
    pub fn render(&self, style: Style) -> String {
        let mut out = String::new();
        self.write(style, &mut out);
        out
    }

    fn write(&self, style: Style, out: &mut String) {
        let gap = if style.spaced { " " } else { "" };
        match self {
            Self::Null => out.push_str("null"),
            Self::Number(text) => out.push_str(text),
            Self::Str(text) => write_str(text, style.escaped, out),
            Self::Array(items) => {
                out.push('[');
                for (n, item) in items.iter().enumerate() {
                    if n > 0 {
                        out.push(',');
                    }
                    out.push_str(gap);
                    item.write(style, out);
                }
                out.push_str(gap);
                out.push(']');
            }
            Self::Object(members) => {
                out.push('{');
                for (n, (name, value)) in members.iter().enumerate() {
                    if n > 0 {
                        out.push(',');
                    }
                    out.push_str(gap);
                    write_name(name, style.escaped, out);
                    out.push_str(gap);
                    out.push(':');
                    out.push_str(gap);
                    value.write(style, out);
                }
                out.push_str(gap);
                out.push('}');
            }
        }
    }
}

fn write_name(name: &str, escaped: bool, out: &mut String) {
    let mut chars = name.chars();
    match chars.next() {
        Some(first) if escaped => {
            out.push_str(&format!("\"\\u{:04x}", u32::from(first)));
            out.push_str(chars.as_str());
            out.push('"');
        }
        _ => write_str(name, false, out),
    }
}

fn write_str(text: &str, escaped: bool, out: &mut String) {
    if !escaped {
        out.push_str(&serde_json::to_string(text).expect("a string serialises"));
        return;
    }
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '/' => out.push_str("\\/"),
            '\n' => out.push_str("\\n"),
            c if c.is_ascii() && !c.is_ascii_control() => out.push(c),
            c => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
    out.push('"');
}

/// Text a model might write: quotes, backslashes, line breaks, accents,
/// emoji, a NUL, a line separator.
pub fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        4 => "[a-z ]{1,6}",
        1 => Just("\"".to_owned()),
        1 => Just("\\".to_owned()),
        1 => Just("\n".to_owned()),
        1 => Just("/".to_owned()),
        1 => Just("é".to_owned()),
        1 => Just("😀".to_owned()),
        1 => Just("\u{0}".to_owned()),
        1 => Just("\u{2028}".to_owned()),
    ];
    proptest::collection::vec(piece, 0..6).prop_map(|pieces| pieces.concat())
}

/// A text member's value: a string, or now and then null.
pub fn text_or_null() -> impl Strategy<Value = Node> {
    prop_oneof![5 => text().prop_map(Node::Str), 1 => Just(Node::Null)]
}

/// The members canarygate never reads, as providers send them.
pub fn skipped_members() -> impl Strategy<Value = Vec<(&'static str, Node)>> {
    let members = vec![
        ("id", Node::str("chatcmpl-9x")),
        ("object", Node::str("chat.completion")),
        ("created", Node::number("1733500000")),
        ("model", Node::str("gpt-4o-mini-2024-07-18")),
        ("system_fingerprint", Node::Null),
        ("service_tier", Node::str("default")),
        ("obfuscation", Node::str("a/b\"c")),
        (
            "prompt_filter_results",
            Node::Array(vec![Node::Object(vec![(
                "content_filter_results",
                Node::Object(vec![]),
            )])]),
        ),
    ];
    proptest::sample::subsequence(members.clone(), 0..=members.len())
}

/// A member list shuffled, with a chance of one member written twice (the
/// tree keeps the last; an in-place reader must decline).
pub fn arrange(
    members: Vec<(&'static str, Node)>,
) -> impl Strategy<Value = (Vec<(&'static str, Node)>, bool)> {
    let count = members.len();
    (Just(members).prop_shuffle(), 0..count.max(1) * 12).prop_map(move |(mut members, dup)| {
        let twice = dup < count;
        if twice {
            let again = members[dup].clone();
            members.push(again);
        }
        (members, twice)
    })
}

/// A token count as a provider writes it, or now and then what no count
/// is. The flag: whether it is one an in-place reader takes.
pub fn count() -> impl Strategy<Value = (Node, bool)> {
    prop_oneof![
        8 => (0u32..5000).prop_map(|n| (Node::number(&n.to_string()), true)),
        1 => Just((Node::number("1.5"), false)),
        1 => Just((Node::number("-3"), false)),
        1 => Just((Node::number("18446744073709551616"), false)),
        1 => Just((Node::Null, true)),
    ]
}

/// A `usage` member: the counts of OpenAI, DeepSeek or Anthropic-style
/// servers, null, or absent (`None`). The flag: whether every count is one
/// an in-place reader takes.
pub fn usage() -> impl Strategy<Value = Option<(Node, bool)>> {
    /// The three counts' names, as OpenAI, DeepSeek and Anthropic-style
    /// servers write them.
    const SHAPES: [[&str; 3]; 3] = [
        ["prompt_tokens", "completion_tokens", "total_tokens"],
        [
            "prompt_tokens",
            "completion_tokens",
            "prompt_cache_hit_tokens",
        ],
        ["input_tokens", "output_tokens", "cache_read_input_tokens"],
    ];
    let counts = (count(), count(), count(), 0..4usize).prop_map(|(a, b, c, shape)| {
        let (mut members, takes): (Vec<(&'static str, Node)>, bool) = match SHAPES.get(shape) {
            Some(names) => (
                names.iter().copied().zip([a.0, b.0, c.0]).collect(),
                a.1 && b.1 && c.1,
            ),
            // Only the completion's count.
            None => (vec![("completion_tokens", b.0)], b.1),
        };
        members.push((
            "prompt_tokens_details",
            Node::Object(vec![("cached_tokens", Node::number("0"))]),
        ));
        (Node::Object(members), takes)
    });
    prop_oneof![
        3 => counts.prop_map(Some),
        1 => Just(Some((Node::Null, true))),
        2 => Just(None),
    ]
}
