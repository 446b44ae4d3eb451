//! The simulated provider's deterministic "model".
//!
//! It reads a sequence of [`Segment`]s (what is in its context, role by role)
//! and writes a reply:
//! 1. if the context holds the instruction `Begin your reply with "<text>"`,
//!    the reply opens with `<text>` exactly (the last such instruction wins);
//! 2. then it restates the last user segment that is not an instruction,
//!    cycling through its words, for a length derived from the context.
//!
//! The same context always gives the same reply, and a reply shows what the
//! model could see: a context filled with someone else's text gives an answer
//! about someone else's text, which is what the leak failure mode needs.

use canarygate_policies::tokens::pieces;

/// The instruction the model follows.
pub const BEGIN_INSTRUCTION: &str = "Begin your reply with \"";

/// One message-sized piece of context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text the model sees.
    pub text: String,
}

/// A generated reply, as the tokens the provider streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Token texts; concatenated they are the reply.
    pub tokens: Vec<String>,
    /// `stop` when the reply ended by itself, `length` when `max_tokens` cut it.
    pub finish_reason: &'static str,
}

impl Reply {
    /// The whole reply text.
    pub fn text(&self) -> String {
        self.tokens.concat()
    }
}

/// Shortest and longest natural reply body, in tokens.
const BODY_TOKENS: std::ops::Range<usize> = 12..40;

/// Writes the reply to `context`, at most `max_tokens` tokens long.
pub fn generate(context: &[Segment], max_tokens: Option<u64>) -> Reply {
    let quoted = |phrase: &str| {
        context
            .iter()
            .find_map(|segment| quoted_after(&segment.text, phrase))
    };
    let prefix = match (
        quoted(BEGIN_INSTRUCTION),
        quoted(canarygate_policies::inject::TAIL_PHRASE),
    ) {
        (Some(head), Some(tail)) => Some(format!("{head} {tail}")),
        (head, tail) => head.or(tail).map(str::to_owned),
    };
    let subject = context
        .iter()
        .rev()
        .find(|segment| segment.role == "user" && !segment.text.contains(BEGIN_INSTRUCTION))
        .map_or("", |segment| segment.text.as_str());

    let words: Vec<&str> = pieces(subject).collect();
    let body_len = BODY_TOKENS.start + (fnv1a(context) % BODY_TOKENS.len() as u64) as usize;
    let mut text = String::new();
    if let Some(prefix) = &prefix {
        text.push_str(prefix);
        text.push(' ');
    }
    text.push_str("You wrote:");
    for index in 0..body_len {
        text.push(' ');
        text.push_str(
            words
                .get(index % words.len().max(1))
                .copied()
                .unwrap_or("nothing"),
        );
    }
    text.push('.');

    let mut tokens = tokenize_keeping_spaces(&text);
    let mut finish_reason = "stop";
    if let Some(max) = max_tokens {
        let max = usize::try_from(max).unwrap_or(usize::MAX);
        if tokens.len() > max {
            tokens.truncate(max);
            finish_reason = "length";
        }
    }
    Reply {
        tokens,
        finish_reason,
    }
}

/// The `<text>` of `<phrase><text>"` in `text`.
fn quoted_after<'a>(text: &'a str, phrase: &str) -> Option<&'a str> {
    let start = text.find(phrase)? + phrase.len();
    let length = text[start..].find('"')?;
    Some(&text[start..start + length]).filter(|prefix| !prefix.is_empty())
}

/// Splits `text` into tokens that each carry their leading whitespace, so
/// that concatenating them gives `text` back.
pub fn tokenize_keeping_spaces(text: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut start = 0;
    for piece in pieces(text) {
        let end = piece.as_ptr() as usize - text.as_ptr() as usize + piece.len();
        tokens.push(text[start..end].to_owned());
        start = end;
    }
    if start < text.len()
        && let Some(last) = tokens.last_mut()
    {
        last.push_str(&text[start..]);
    }
    tokens
}

/// FNV-1a over the context: a stable, cheap, deterministic length seed.
fn fnv1a(context: &[Segment]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for segment in context {
        for byte in segment.role.bytes().chain(segment.text.bytes()) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(role: &str, text: &str) -> Segment {
        Segment {
            role: role.into(),
            text: text.into(),
        }
    }

    #[test]
    fn follows_begin_instruction_and_restates_user_text() {
        let context = [
            segment(
                "system",
                "Begin your reply with \"CG-1 CG-2\" and then answer.",
            ),
            segment("user", "Summarise the quarterly report"),
        ];
        let reply = generate(&context, None);
        let text = reply.text();
        assert!(
            text.starts_with("CG-1 CG-2 You wrote: Summarise the quarterly"),
            "{text}"
        );
        assert_eq!(reply.finish_reason, "stop");
        assert_eq!(generate(&context, None), reply, "deterministic");
    }

    #[test]
    fn max_tokens_cuts_with_length() {
        let reply = generate(&[segment("user", "hello there")], Some(3));
        assert_eq!(reply.tokens.len(), 3);
        assert_eq!(reply.finish_reason, "length");
        assert_eq!(reply.text(), "You wrote:");
    }

    #[test]
    fn tokens_concatenate_to_text() {
        let text = "  a, b  c!d";
        assert_eq!(tokenize_keeping_spaces(text).concat(), text);
    }
}
