//! The simulated provider's deterministic "model".
//!
//! It reads a sequence of [`Segment`]s (what is in its context, role by role)
//! and writes a reply. It is the obedient model of
//! [`mod@canarygate_policies::inject`], applied to what it sees rather than to a
//! request:
//! 1. it opens with what [`obedient_opening_of_turns`] says for the
//!    segments (`head tail`, or whichever of the two it can see; the newest
//!    turn's instruction first), then a space;
//! 2. then it restates the *subject*, the client's text of the last user
//!    segment ([`client_text`]), cycling through its whitespace-separated words, for
//!    a length in words derived from the context; or, when some segment asks
//!    for the needles of a context probe ([`RECALL_PHRASE`]), it lists every
//!    passphrase it can see, in order.
//!
//! With `n` choices, choice `i` rotates the subject's words by `i` and takes
//! its own length; its opening is the same. A reasoning model first
//! [`think`]s: it restates the instructions it sees, quoting the opening they
//! ask for, as real reasoning models do.
//!
//! The same context always gives the same reply, and a reply shows what the
//! model could see: a context filled with someone else's text gives an answer
//! about someone else's text, which is what the leak failure mode needs.

use canarygate_policies::inject::{client_text, obedient_opening_of_turns};
use canarygate_policies::probe::{RECALL_PHRASE, passphrases};
use canarygate_policies::tokens::pieces;

/// The reasoning model whose thinking comes in `reasoning_content`, as
/// DeepSeek, GLM and Qwen (served by vLLM or SGLang) send it.
pub const REASONER_MODEL: &str = "sim-reasoner";

/// The reasoning model whose thinking comes in `reasoning`, as OpenRouter
/// sends it.
pub const OPENROUTER_REASONER_MODEL: &str = "sim-reasoner-openrouter";

/// The reasoning model whose thinking is billed (`reasoning_tokens`) but
/// never shown, as OpenAI's o-series and GPT-5 serve Chat Completions.
pub const HIDDEN_REASONER_MODEL: &str = "sim-reasoner-hidden";

/// The reasoning model whose thinking comes in `reasoning_content`, as
/// [`REASONER_MODEL`]'s does, but never restates the instructions it sees,
/// as most real reasoning models: it names no opening, and it thinks longer
/// (about 70 tokens), so a small limit cuts it before its reply.
pub const TERSE_REASONER_MODEL: &str = "sim-reasoner-terse";

/// A model served through a chat template without a system role, as
/// Gemma 1 and 2 are (their templates raise `System role not supported`):
/// a Chat request with a `system` or `developer` message is refused with the
/// 400 vLLM answers such a template's error with. Not listed in [`MODELS`].
pub const SYSTEMLESS_MODEL: &str = "sim-systemless";

/// Every model served, for `GET /v1/models`.
pub const MODELS: [&str; 5] = [
    "sim-model",
    REASONER_MODEL,
    OPENROUTER_REASONER_MODEL,
    HIDDEN_REASONER_MODEL,
    TERSE_REASONER_MODEL,
];

/// Whether `model` is one of the reasoning models (they think first).
pub fn is_reasoner(model: &str) -> bool {
    [
        REASONER_MODEL,
        OPENROUTER_REASONER_MODEL,
        HIDDEN_REASONER_MODEL,
        TERSE_REASONER_MODEL,
    ]
    .contains(&model)
}

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
    generate_choice(context, max_tokens, 0)
}

/// The last user segment's text as the model sees it (canary blocks
/// included), or `""`. A user segment of canary blocks alone is passed
/// over: it is the text block a proxy added after tool results, which a
/// model reads as part of the turn that holds them, not as a new request
/// (the same turn without it would have no user segment here at all).
pub fn last_user_text(context: &[Segment]) -> &str {
    context
        .iter()
        .rev()
        .filter(|segment| segment.role == "user")
        .find(|segment| {
            let client = client_text(&segment.text);
            let blocks_only = client.len() < segment.text.len() && client.trim().is_empty();
            !blocks_only
        })
        .map_or("", |segment| segment.text.as_str())
}

/// The subject of a reply: the client's part of the last user segment.
pub fn subject(context: &[Segment]) -> &str {
    client_text(last_user_text(context))
}

/// Writes choice `choice` of the replies to `context` (choice 0 is
/// [`generate`]'s reply): the same opening, the subject's words rotated by
/// `choice`, a length of its own.
pub fn generate_choice(context: &[Segment], max_tokens: Option<u64>, choice: usize) -> Reply {
    let prefix = obedient_prefix(context);
    let words: Vec<&str> = subject(context).split_whitespace().collect();
    // 5 is prime to the range's length (28): 28 choices of distinct lengths.
    let seed = fnv1a(context).wrapping_add(5 * choice as u64);
    let body_len = BODY_TOKENS.start + (seed % BODY_TOKENS.len() as u64) as usize;
    let mut text = String::new();
    if let Some(prefix) = prefix {
        text.push_str(&prefix);
        text.push(' ');
    }
    if context
        .iter()
        .any(|segment| segment.text.contains(RECALL_PHRASE))
    {
        // A needle test: list every passphrase the model can see, in order.
        text.push_str("The passphrases are:");
        for segment in context {
            for passphrase in passphrases(&segment.text) {
                text.push(' ');
                text.push_str(passphrase);
            }
        }
        text.push('.');
        return finish(text, max_tokens);
    }
    text.push_str("You wrote:");
    for index in 0..body_len {
        text.push(' ');
        text.push_str(
            words
                .get((index + choice) % words.len().max(1))
                .copied()
                .unwrap_or("nothing"),
        );
    }
    text.push('.');
    finish(text, max_tokens)
}

/// What a reasoning model thinks before it answers `context`: with
/// `restates`, it restates the instructions it sees, quoting the opening
/// they ask for (canaries included); without, it weighs how to answer
/// instead, at more length ([`TERSE_REASONER_MODEL`]). Then what the user
/// wrote and what it will do. `plan` names the tools it will call, if any.
/// A few dozen tokens, never cut here.
pub fn think(context: &[Segment], plan: &[&str], restates: bool) -> Vec<String> {
    let mut text = String::from("Let me read the conversation first.");
    match obedient_prefix(context) {
        _ if !restates => text.push_str(
            " I should weigh what they want before I answer, and keep the answer short, \
             plain and accurate, adding nothing they did not ask for. Shorter answers \
             are easier to check, so I will leave out every detail that does not help.",
        ),
        Some(opening) => text.push_str(&format!(
            " The instructions ask me to begin my reply with \"{opening}\", so I will start \
             with exactly that."
        )),
        None => text.push_str(" Nothing tells me how to begin my reply."),
    }
    let words: Vec<&str> = subject(context).split_whitespace().take(8).collect();
    if words.is_empty() {
        text.push_str(" The user wrote nothing I can restate.");
    } else {
        text.push_str(&format!(" The user wrote \"{}\".", words.join(" ")));
    }
    if plan.is_empty() {
        text.push_str(" I will restate what they wrote, briefly and plainly.");
    } else {
        text.push_str(&format!(
            " The request fits {}, so I will call it with their words.",
            plan.join(" and ")
        ));
    }
    tokenize_keeping_spaces(&text)
}

/// `text` as reply tokens, cut at `max_tokens`.
fn finish(text: String, max_tokens: Option<u64>) -> Reply {
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

/// What an obedient model opens its reply with in `context`: `head tail`,
/// `head`, `tail`, or nothing (see the module docs).
pub fn obedient_prefix(context: &[Segment]) -> Option<String> {
    let turns: Vec<(&str, &str)> = context
        .iter()
        .map(|segment| (segment.role.as_str(), segment.text.as_str()))
        .collect();
    obedient_opening_of_turns(&turns)
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
    context.iter().fold(crate::hash::SEED, |hash, segment| {
        crate::hash::fold(
            crate::hash::fold(hash, segment.role.as_bytes()),
            segment.text.as_bytes(),
        )
    })
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
    fn a_user_segment_of_blocks_alone_is_not_the_request() {
        // Anthropic tool results with a proxy's text block after them: the
        // block is a user segment of its own here, read as part of the turn.
        let canary = canarygate_policies::canary::Canary::from_random([3; 10]);
        let marker = format!("({canary} is a marker: never repeat it.)");
        let context = [
            segment("user", "Read the log with read_log"),
            segment("assistant", ""),
            segment("tool", "page one"),
            segment("user", &marker),
        ];
        assert_eq!(last_user_text(&context), "Read the log with read_log");
        assert_eq!(subject(&context), "Read the log with read_log");
        // A client's own text before the block, or an empty turn of the
        // client's, is the request.
        let own = format!("Thanks\n\n{marker}");
        let context = [segment("user", "first"), segment("user", &own)];
        assert_eq!(subject(&context), "Thanks");
        let context = [segment("user", "first"), segment("user", "")];
        assert_eq!(last_user_text(&context), "");
    }

    #[test]
    fn echoes_head_and_tail_of_injected_request() {
        use canarygate_policies::EchoCost;
        use canarygate_policies::canary::Canary;
        use canarygate_policies::inject::{RequestCanaries, inject};
        use canarygate_policies::verify_config::EchoMode;

        let canaries = RequestCanaries {
            head: Canary::from_random([7; 10]),
            tail: Canary::from_random([9; 10]),
        };
        let mut body = serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": "Plan the harbour survey"}
        ]});
        inject(
            &mut body,
            EchoMode::HeadTail,
            EchoCost::DIGIT_BY_DIGIT,
            canaries,
        )
        .unwrap();
        let context: Vec<Segment> = body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|message| {
                segment(
                    message["role"].as_str().unwrap(),
                    message["content"].as_str().unwrap(),
                )
            })
            .collect();
        let text = generate(&context, None).text();
        let expected = format!(
            "{} {} You wrote: Plan the harbour survey",
            canaries.head, canaries.tail
        );
        assert!(text.starts_with(&expected), "{text}");

        // Head lost: the tail alone. Tail lost: the head alone.
        let tail_only = generate(&context[1..], None).text();
        assert!(
            tail_only.starts_with(&format!("{} You wrote:", canaries.tail)),
            "{tail_only}"
        );
        let head_only = generate(&context[..1], None).text();
        assert!(
            head_only.starts_with(&format!("{} You wrote:", canaries.head)),
            "{head_only}"
        );
    }

    #[test]
    fn first_instruction_wins_and_unterminated_ones_are_ignored() {
        let context = [
            segment("system", "Begin your reply with \"never closed"),
            segment("system", "Begin your reply with \"A1\" please."),
            segment("system", "Begin your reply with \"B2\" please."),
            segment("user", "hello"),
        ];
        assert_eq!(obedient_prefix(&context).as_deref(), Some("A1"));
        assert!(
            generate(&context, None)
                .text()
                .starts_with("A1 You wrote: hello")
        );
        assert_eq!(obedient_prefix(&[segment("user", "hi")]), None);
    }

    #[test]
    fn max_tokens_cuts_with_length() {
        let reply = generate(&[segment("user", "hello there")], Some(3));
        assert_eq!(reply.tokens.len(), 3);
        assert_eq!(reply.finish_reason, "length");
        assert_eq!(reply.text(), "You wrote:");
    }

    #[test]
    fn choices_share_the_opening_and_differ_in_body() {
        let context = [
            segment("system", "Begin your reply with \"CG-1\" now."),
            segment("user", "chart the northern reef"),
        ];
        let first = generate_choice(&context, None, 0);
        assert_eq!(first, generate(&context, None));
        let second = generate_choice(&context, None, 1).text();
        assert!(
            second.starts_with("CG-1 You wrote: the northern reef chart"),
            "{second}"
        );
        assert_ne!(first.text(), second);
        assert_eq!(
            generate_choice(&context, None, 1).text(),
            second,
            "deterministic"
        );
    }

    #[test]
    fn thinking_quotes_the_opening_it_was_asked_for() {
        let context = [
            segment("system", "Begin your reply with \"CG-7\" please."),
            segment("user", "list the moorings"),
        ];
        let thought = think(&context, &[], true).concat();
        assert!(
            thought.contains("begin my reply with \"CG-7\""),
            "{thought}"
        );
        assert!(thought.contains("\"list the moorings\""), "{thought}");
        assert!((20..80).contains(&think(&context, &[], true).len()));
        let plan = think(&context, &["get_weather"], true).concat();
        assert!(plan.contains("fits get_weather"), "{plan}");
        assert!(
            !think(&[segment("user", "hi")], &[], true)
                .concat()
                .contains("CG-")
        );
        // The terse model names no opening, and thinks longer.
        let terse = think(&context, &[], false);
        assert!(!terse.concat().contains("CG-7"), "{}", terse.concat());
        assert!(terse.concat().contains("\"list the moorings\""));
        assert!((60..120).contains(&terse.len()), "{}", terse.len());
    }

    #[test]
    fn tokens_concatenate_to_text() {
        let text = "  a, b  c!d";
        assert_eq!(tokenize_keeping_spaces(text).concat(), text);
    }
}
