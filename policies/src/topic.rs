//! The topic check: is the answer about what was asked?
//!
//! Canaries prove an answer came from the caller's session; they say
//! nothing about whether it answers the caller's question, and JSON-mode
//! and tool requests carry no echo at all. The topic check embeds what the
//! client asked ([`question_text`]) and what it got ([`answer_text`]) with a
//! sentence-embedding model and records their cosine similarity. This module
//! holds the policy (`[topic]`: [`TopicConfig`]), which texts are compared,
//! and how a score steers the review sample ([`sample_chance`]); the model
//! runs in `canarygate-topic`, the scoring in the proxy.

use std::ops::Range;
use std::path::PathBuf;

use serde::Deserialize;
use serde_json::Value;
use toml::Spanned;

use crate::canary::replace_canaries;
use crate::verify::{Check, Decision, Verdict};
use crate::verify_config::FailureAction;

/// `[topic] min_similarity` when none is given: the threshold that keeps
/// false alarms at or under 1 % on honest question/answer pairs in the
/// calibration benchmark (bench/README.md, "Topic check calibration").
pub const DEFAULT_MIN_SIMILARITY: f32 = 0.24;

/// A system prompt at most this long (in characters) is part of the
/// question; a longer one is boilerplate more than topic.
pub const SHORT_SYSTEM_CHARS: usize = 400;

/// Most characters of each text handed to the model. The model reads its
/// first 256 tokens (about 1,000 characters of English) anyway; this
/// bounds the tokenizer's work on a huge answer.
pub const MAX_TEXT_CHARS: usize = 4096;

/// Above the threshold, scores within this distance of it raise the chance
/// of being sampled from the plain rate toward 1 ([`sample_chance`]).
pub const SUSPICIOUS_BAND: f32 = 0.15;

/// `[topic] action`: what a low score does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TopicAction {
    /// The score is evidence: recorded, and it steers sampling. Scored
    /// after the answer is delivered, off the request's critical path.
    #[default]
    Record,
    /// A low score fails the `topic` check and the answer is delivered
    /// flagged (`action: flag` in the record).
    Flag,
    /// A low score fails the `topic` check and the answer is withheld
    /// like any failed verdict.
    Block,
}

/// `[topic]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopicConfig {
    /// A sentence-transformers directory (BERT family, mean pooling:
    /// `config.json`, `tokenizer.json`, `model.safetensors`). Unset: the
    /// check is off.
    pub model_dir: Option<Spanned<PathBuf>>,
    /// What a score below `min_similarity` does.
    pub action: TopicAction,
    /// Scores below this are low: failed with `flag` or `block`, always
    /// sampled with `record`.
    pub min_similarity: Spanned<f32>,
    /// With `flag` or `block`, how long the answer may wait for its score;
    /// past it the check is skipped (`timeout`) and the answer goes on.
    pub timeout_ms: Spanned<u64>,
}

impl Default for TopicConfig {
    fn default() -> Self {
        Self {
            model_dir: None,
            action: TopicAction::Record,
            min_similarity: Spanned::new(0..0, DEFAULT_MIN_SIMILARITY),
            timeout_ms: Spanned::new(0..0, 200),
        }
    }
}

impl TopicConfig {
    /// Whether a model is configured.
    pub fn enabled(&self) -> bool {
        self.model_dir.is_some()
    }

    /// The threshold.
    pub fn min_similarity(&self) -> f32 {
        *self.min_similarity.get_ref()
    }

    /// Checks the threshold and the timeout.
    pub(crate) fn validate(&self) -> Result<(), (Option<Range<usize>>, String)> {
        let min = *self.min_similarity.get_ref();
        if !(-1.0..=1.0).contains(&min) {
            return Err((
                Some(self.min_similarity.span()),
                format!("topic.min_similarity {min} is outside -1.0..=1.0 (a cosine similarity)"),
            ));
        }
        let timeout = *self.timeout_ms.get_ref();
        if !(1..=60_000).contains(&timeout) {
            return Err((
                Some(self.timeout_ms.span()),
                format!("topic.timeout_ms {timeout} must be 1 to 60000"),
            ));
        }
        if let Some(dir) = &self.model_dir
            && dir.get_ref().as_os_str().is_empty()
        {
            return Err((Some(dir.span()), "topic.model_dir is empty".into()));
        }
        Ok(())
    }
}

/// What the client asked, from chat-shaped `messages` (every wire format
/// gives its prompt this shape): the last user message, then the system
/// (or developer) prompt when it is short. `None` when there is no user
/// text.
pub fn question_text(messages: &[Value]) -> Option<String> {
    fn role(message: &Value) -> &str {
        message.get("role").and_then(Value::as_str).unwrap_or("")
    }
    let user = messages
        .iter()
        .rev()
        .filter(|message| role(message) == "user")
        .map(|message| message_text(message.get("content")))
        .find(|text| !text.trim().is_empty())?;
    let mut question = user;
    let system: String = messages
        .iter()
        .filter(|message| matches!(role(message), "system" | "developer"))
        .map(|message| message_text(message.get("content")))
        .collect::<Vec<_>>()
        .join("\n");
    let system = system.trim();
    if !system.is_empty() && system.chars().count() <= SHORT_SYSTEM_CHARS {
        question.push_str("\n\n");
        question.push_str(system);
    }
    Some(bounded(replace_canaries(&question, "")))
}

/// What the client got, for the comparison: the answer's content and its
/// tool-call (or function-call) arguments. A text that is a JSON document
/// (JSON mode, structured outputs, tool arguments) contributes its string
/// values, in document order, keys left out: `{"city": "Paris"}` reads as
/// `Paris`. Canary-shaped spans are removed. `None` when nothing is left.
pub fn answer_text<'a>(texts: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let mut answer = String::new();
    for text in texts {
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let readable = match serde_json::from_str::<Value>(text) {
            Ok(value @ (Value::Object(_) | Value::Array(_))) => json_strings(&value),
            _ => text.to_owned(),
        };
        if !answer.is_empty() {
            answer.push('\n');
        }
        answer.push_str(&readable);
        if answer.len() > MAX_TEXT_CHARS * 4 {
            break;
        }
    }
    let answer = replace_canaries(&answer, "");
    (!answer.trim().is_empty()).then(|| bounded(answer))
}

/// The chance (0 to 1) that a request's text is kept for review.
///
/// A failed verdict or a low score (below `min_similarity`) is always kept.
/// Every other request keeps the plain random share, `rate`; a score just
/// above the threshold raises it, linearly from 1 at the threshold to
/// `rate` at [`SUSPICIOUS_BAND`] above it. So the sample holds every
/// suspicious answer, more of the doubtful ones, and a uniform share of
/// the rest.
pub fn sample_chance(rate: f64, failed: bool, similarity: Option<f32>, min_similarity: f32) -> f64 {
    let rate = rate.clamp(0.0, 1.0);
    if failed {
        return 1.0;
    }
    let Some(similarity) = similarity else {
        return rate;
    };
    if similarity < min_similarity {
        return 1.0;
    }
    let closeness = 1.0 - f64::from(similarity - min_similarity) / f64::from(SUSPICIOUS_BAND);
    rate + (1.0 - rate) * closeness.clamp(0.0, 1.0)
}

/// What to do with an answer whose verdict may include a failed `topic`
/// check: a low score alone under `action = "flag"` delivers it flagged;
/// anything else is [`Verdict::decide`] under `[verify] action`.
pub fn decide(
    verdict: &Verdict,
    topic: TopicAction,
    action: FailureAction,
    attempt: u32,
    released_any: bool,
) -> Decision {
    if topic == TopicAction::Flag && verdict.failed_checks() == [Check::Topic] {
        return Decision::Flag;
    }
    verdict.decide(action, attempt, released_any)
}

/// The text of a message's `content`: a string, or the `text` of its parts.
fn message_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| match part {
                Value::String(text) => Some(text.as_str()),
                part => part.get("text").and_then(Value::as_str),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The string values of a JSON document, in order, one per line.
fn json_strings(value: &Value) -> String {
    fn walk<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
        match value {
            Value::String(text) => out.push(text),
            Value::Array(items) => items.iter().for_each(|item| walk(item, out)),
            Value::Object(members) => members.values().for_each(|item| walk(item, out)),
            _ => {}
        }
    }
    let mut strings = Vec::new();
    walk(value, &mut strings);
    strings.join("\n")
}

/// At most [`MAX_TEXT_CHARS`] characters of `text`.
fn bounded(mut text: String) -> String {
    if let Some((cut, _)) = text.char_indices().nth(MAX_TEXT_CHARS) {
        text.truncate(cut);
    }
    text
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_question_is_the_last_user_text_and_a_short_system_prompt() {
        let messages = [
            json!({"role": "system", "content": "You answer questions about birds."}),
            json!({"role": "user", "content": "What do owls eat?"}),
            json!({"role": "assistant", "content": "Mice."}),
            json!({"role": "user", "content": [{"type": "text", "text": "And hawks?"}]}),
        ];
        assert_eq!(
            question_text(&messages).unwrap(),
            "And hawks?\n\nYou answer questions about birds."
        );
        let long_system = "x".repeat(SHORT_SYSTEM_CHARS + 1);
        let messages = [
            json!({"role": "developer", "content": long_system}),
            json!({"role": "user", "content": "What do owls eat?"}),
        ];
        assert_eq!(question_text(&messages).unwrap(), "What do owls eat?");
        assert_eq!(
            question_text(&[json!({"role": "system", "content": "hi"})]),
            None
        );
        assert_eq!(
            question_text(&[json!({"role": "user", "content": "  "})]),
            None
        );
    }

    #[test]
    fn canaries_never_reach_the_model() {
        let messages = [json!({"role": "user", "content": "CG482937105662831 What do owls eat?"})];
        assert_eq!(question_text(&messages).unwrap(), " What do owls eat?");
        assert_eq!(
            answer_text(["CG482937105662831 CG193847561029384\nOwls eat mice."]).unwrap(),
            " \nOwls eat mice."
        );
        assert_eq!(answer_text(["CG482937105662831"]), None);
    }

    #[test]
    fn json_answers_read_as_their_string_values() {
        let content =
            r#"{"answer": "Owls eat mice", "confidence": 0.9, "tags": ["birds", {"k": "night"}]}"#;
        assert_eq!(
            answer_text([content]).unwrap(),
            "Owls eat mice\nbirds\nnight"
        );
        // Tool-call arguments after the content; a bare JSON string or
        // number stays as written.
        assert_eq!(
            answer_text(["", r#"{"city": "Paris"}"#, "\"quoted\"", "42"]).unwrap(),
            "Paris\n\"quoted\"\n42"
        );
        assert_eq!(answer_text(["", "  "]), None);
    }

    #[test]
    fn texts_are_bounded_on_a_character_boundary() {
        let answer = answer_text(["é".repeat(MAX_TEXT_CHARS * 2).as_str()]).unwrap();
        assert_eq!(answer.chars().count(), MAX_TEXT_CHARS);
    }

    #[test]
    fn suspicious_answers_are_sampled_first() {
        let min = 0.2;
        assert_eq!(sample_chance(0.0, true, None, min), 1.0);
        assert_eq!(sample_chance(0.0, false, Some(0.1), min), 1.0);
        assert_eq!(sample_chance(0.02, false, None, min), 0.02);
        // Far above the band: the plain rate.
        assert_eq!(sample_chance(0.02, false, Some(0.9), min), 0.02);
        // Inside the band: between the rate and 1, falling as the score rises.
        let near = sample_chance(0.02, false, Some(min + 0.01), min);
        let farther = sample_chance(0.02, false, Some(min + 0.1), min);
        assert!(
            near > farther && farther > 0.02 && near < 1.0,
            "{near} {farther}"
        );
        assert_eq!(sample_chance(2.0, false, None, min), 1.0);
    }

    #[test]
    fn bad_settings_are_named() {
        let mut config = TopicConfig::default();
        config.validate().unwrap();
        config.min_similarity = Spanned::new(3..7, 1.5);
        let (span, message) = config.validate().unwrap_err();
        assert_eq!(span, Some(3..7));
        assert!(message.contains("topic.min_similarity"), "{message}");
        let config = TopicConfig {
            timeout_ms: Spanned::new(0..1, 0),
            ..TopicConfig::default()
        };
        assert!(config.validate().unwrap_err().1.contains("timeout_ms"));
    }
}
