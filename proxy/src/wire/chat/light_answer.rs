//! Reading the common Chat Completions answer without building its JSON
//! tree ([`LightAnswer`]).
//!
//! Light: an object whose `choices` each have a `message` holding a role
//! and text fields (`content`, `refusal`, `reasoning_content`,
//! `reasoning`, each a string or null), optionally an empty `annotations`
//! list and null `tool_calls`, `function_call` or `audio`; a string or
//! null `finish_reason`; no logprobs. A choice's other members and the
//! answer's other members are skipped unless they hold a canary-shaped
//! span, which the tree's reading scans as text; `usage` is read as the
//! tree reads it. Not light: any other member of a
//! message (a string there may hold a canary: the tree's residual scan
//! reads it), a member of the wrong type, a member twice, an `error`,
//! anything after the answer. Those are read from the tree
//! ([`super::answer::read_choice`]), which gives what this reading gives
//! for a light answer.
//!
//! Longer than 500 lines: over 400 of them are the unit tests, which hold
//! the reading and the delivery to the tree's, for listed answers and for
//! generated ones (property tests, `json_text.rs`).

use std::fmt;
use std::ops::Range;

use canarygate_policies::canary::find_canaries;
use canarygate_policies::verify::{Part, ProviderUsage};
use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::light::{Members, Refused, TopMember, member_name, skip_other};
use crate::wire::format::{AnswerView, ChoiceView, LightAnswer, LightField, TextField, TextFields};
use crate::wire::location::{Key, Location};

/// A choice's finish reason when the client's limit cut it.
const CUT_REASON: &str = "length";

/// The members of a choice that are read; any other is skipped unless it
/// or its name holds a canary-shaped span ([`skip_other`], [`member_name`]).
#[derive(Clone, Copy)]
enum ChoiceMember {
    Index,
    Message,
    FinishReason,
    Logprobs,
    Other,
}

impl<'de> Deserialize<'de> for ChoiceMember {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(match &*member_name(deserializer)? {
            "index" => ChoiceMember::Index,
            "message" => ChoiceMember::Message,
            "finish_reason" => ChoiceMember::FinishReason,
            "logprobs" => ChoiceMember::Logprobs,
            _ => ChoiceMember::Other,
        })
    }
}

/// The members a light message may have.
#[derive(Clone, Copy, Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum MessageMember {
    Role,
    ReasoningContent,
    Reasoning,
    Content,
    Refusal,
    Annotations,
    ToolCalls,
    FunctionCall,
    Audio,
}

/// The answer read so far.
struct Reading<'de> {
    answer: &'de str,
    view: AnswerView,
    fields: Vec<(TextField, LightField)>,
    finish_reasons: Vec<Option<Range<usize>>>,
}

/// The counts of a `usage` object that [`ProviderUsage::from_usage`] reads,
/// without its tree. A count of another type (a string, a float) is an
/// error, and the answer is read from its tree, as the tree's reading reads
/// it.
#[derive(Deserialize)]
struct UsageCounts {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    prompt_tokens_details: Option<UsageDetails>,
    prompt_cache_hit_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

/// `usage.prompt_tokens_details`: its cached tokens.
#[derive(Deserialize)]
struct UsageDetails {
    cached_tokens: Option<u64>,
}

impl UsageCounts {
    fn usage(self) -> Option<ProviderUsage> {
        let field = |name: &str| match name {
            "prompt_tokens" => self.prompt_tokens,
            "completion_tokens" => self.completion_tokens,
            "prompt_cache_hit_tokens" => self.prompt_cache_hit_tokens,
            "input_tokens" => self.input_tokens,
            "output_tokens" => self.output_tokens,
            "cache_read_input_tokens" => self.cache_read_input_tokens,
            "cache_creation_input_tokens" => self.cache_creation_input_tokens,
            _ => None,
        };
        let details_cached = self
            .prompt_tokens_details
            .as_ref()
            .and_then(|details| details.cached_tokens);
        ProviderUsage::from_counts(field, details_cached)
    }
}

/// Reads the answer into its [`Reading`].
struct AnswerSeed<'r, 'de>(&'r mut Reading<'de>);

impl<'de> DeserializeSeed<'de> for AnswerSeed<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for AnswerSeed<'_, 'de> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("an answer")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<(), M::Error> {
        let mut seen = Members::default();
        while let Some(member) = map.next_key::<TopMember>()? {
            match member {
                TopMember::Choices => {
                    seen.first(0)?;
                    map.next_value_seed(ChoicesSeed(&mut *self.0))?;
                }
                TopMember::Usage => {
                    seen.first(1)?;
                    // Its counts; a string of its own that is canary-shaped
                    // is the tree's to scan.
                    let raw = map.next_value::<&'de RawValue>()?;
                    if find_canaries(raw.get()).next().is_some() {
                        return Err(M::Error::custom("not read lightly"));
                    }
                    let usage: Option<UsageCounts> =
                        serde_json::from_str(raw.get()).map_err(M::Error::custom)?;
                    self.0.view.usage = usage.and_then(UsageCounts::usage);
                }
                TopMember::Error => return Err(M::Error::custom("not read lightly")),
                TopMember::Other => skip_other(&mut map)?,
            }
        }
        Ok(())
    }
}

/// Reads the answer's `choices`.
struct ChoicesSeed<'r, 'de>(&'r mut Reading<'de>);

impl<'de> DeserializeSeed<'de> for ChoicesSeed<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for ChoicesSeed<'_, 'de> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("an array of choices")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(ChoiceSeed(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

/// Reads one choice.
struct ChoiceSeed<'r, 'de>(&'r mut Reading<'de>);

impl<'de> DeserializeSeed<'de> for ChoiceSeed<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ChoiceSeed<'_, 'de> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a choice")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<(), M::Error> {
        let reading = self.0;
        let position = reading.view.choices.len();
        let mut index = None;
        let mut message = Message::default();
        let mut finish: Option<LightField> = None;
        let mut seen = Members::default();
        while let Some(member) = map.next_key::<ChoiceMember>()? {
            if !matches!(member, ChoiceMember::Other) {
                seen.first(member as u8)?;
            }
            match member {
                ChoiceMember::Index => index = map.next_value::<Option<u64>>()?,
                ChoiceMember::Message => {
                    map.next_value_seed(MessageSeed {
                        answer: reading.answer,
                        message: &mut message,
                    })?;
                }
                ChoiceMember::FinishReason => {
                    finish = match map.next_value::<Option<&'de RawValue>>()? {
                        None => None,
                        // A canary-shaped finish is the tree's to scan.
                        Some(raw) if find_canaries(raw.get()).next().is_some() => {
                            return Err(M::Error::custom("not read lightly"));
                        }
                        Some(raw) => Some(
                            LightField::of(reading.answer, raw)
                                .ok_or_else(|| M::Error::custom("not read lightly"))?,
                        ),
                    };
                }
                ChoiceMember::Logprobs => {
                    map.next_value::<Option<Refused>>()?;
                }
                ChoiceMember::Other => skip_other(&mut map)?,
            }
        }
        let index = index.unwrap_or(position as u64).min(u64::from(u32::MAX)) as u32;
        let at = Location::ROOT
            .key(Key::Choices)
            .index(position)
            .key(Key::Message);
        // The order and parts of the tree's reading (`TEXT_FIELDS`).
        let both_reasonings = message.reasoning_content.is_some();
        let slots = [
            (
                Key::ReasoningContent,
                Part::Reasoning,
                message.reasoning_content,
            ),
            (
                Key::Reasoning,
                if both_reasonings {
                    Part::ReasoningAlias
                } else {
                    Part::Reasoning
                },
                message.reasoning,
            ),
            (Key::Content, Part::Content, message.content),
            (Key::Refusal, Part::Refusal, message.refusal),
        ];
        let mut texts = TextFields::new();
        for (key, kind, light) in slots {
            let Some(light) = light else { continue };
            let field = TextField {
                choice: index,
                kind,
                at: at.key(key),
            };
            texts.push(field);
            reading.fields.push((field, light));
        }
        let finish_reason = finish
            .as_ref()
            .map(|light| light.text(reading.answer).to_owned());
        reading
            .finish_reasons
            .push(finish.map(|light| light.literal()));
        reading.view.choices.push(ChoiceView {
            index,
            position,
            texts,
            finish_reason,
        });
        Ok(())
    }
}

/// A light message's text fields, each with its literal.
#[derive(Default)]
struct Message {
    reasoning_content: Option<LightField>,
    reasoning: Option<LightField>,
    content: Option<LightField>,
    refusal: Option<LightField>,
}

/// Reads a choice's message into a [`Message`].
struct MessageSeed<'m, 'de> {
    answer: &'de str,
    message: &'m mut Message,
}

impl<'de> DeserializeSeed<'de> for MessageSeed<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MessageSeed<'_, 'de> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a message")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<(), M::Error> {
        let answer = self.answer;
        // A text member: a string (its literal), or null (none).
        let text = |map: &mut M| -> Result<Option<LightField>, M::Error> {
            match map.next_value::<Option<&'de RawValue>>()? {
                None => Ok(None),
                Some(raw) => LightField::of(answer, raw)
                    .map(Some)
                    .ok_or_else(|| M::Error::custom("not read lightly")),
            }
        };
        let mut seen = Members::default();
        while let Some(member) = map.next_key::<MessageMember>()? {
            seen.first(member as u8)?;
            match member {
                // Scanned, as the tree's reading scans it.
                MessageMember::Role => skip_other(&mut map)?,
                MessageMember::ReasoningContent => self.message.reasoning_content = text(&mut map)?,
                MessageMember::Reasoning => self.message.reasoning = text(&mut map)?,
                MessageMember::Content => self.message.content = text(&mut map)?,
                MessageMember::Refusal => self.message.refusal = text(&mut map)?,
                MessageMember::Annotations => {
                    if !map.next_value::<Vec<Refused>>()?.is_empty() {
                        return Err(M::Error::custom("not read lightly"));
                    }
                }
                MessageMember::ToolCalls | MessageMember::FunctionCall | MessageMember::Audio => {
                    map.next_value::<Option<Refused>>()?;
                }
            }
        }
        Ok(())
    }
}

/// The answer in `answer`, when it is light (see the module docs).
pub fn read(answer: &str) -> Option<LightAnswer> {
    let mut reading = Reading {
        answer,
        view: AnswerView::default(),
        fields: Vec::new(),
        finish_reasons: Vec::new(),
    };
    let mut parser = serde_json::Deserializer::from_str(answer);
    AnswerSeed(&mut reading).deserialize(&mut parser).ok()?;
    parser.end().ok()?;
    Some(LightAnswer::new(
        reading.view,
        reading.fields,
        reading.finish_reasons,
        CUT_REASON,
    ))
}

#[cfg(test)]
mod tests {
    use canarygate_policies::EchoCost;
    use canarygate_policies::inject::{Injection, RequestCanaries, SystemRole, obedient_echo};
    use canarygate_policies::registry::MemoryRegistry;
    use canarygate_policies::verify::{Facts, Verifier};
    use canarygate_policies::verify_config::{EchoMode, VerifyConfig};
    use serde_json::{Value, json};

    use proptest::prelude::*;

    use super::super::json_text::{
        Node, Style, arrange, skipped_members, text, text_or_null, usage,
    };
    use super::*;
    use crate::wire::TextSource;
    use crate::wire::chat::Chat;
    use crate::wire::edit::{Delivery, TokenCounter, UsageOptions};
    use crate::wire::format::WireFormat;

    /// Asserts that `answer` is light and read as the tree reads it.
    fn same_as_tree(answer: &str) {
        let light = read(answer).unwrap_or_else(|| panic!("not light: {answer}"));
        reads_as_tree(&light, answer);
    }

    /// Asserts that `light`, the in-place reading of `answer`, is what the
    /// tree's reading gives.
    fn reads_as_tree(light: &LightAnswer, answer: &str) {
        let tree: Value = serde_json::from_str(answer)
            .unwrap_or_else(|error| panic!("read in place, not JSON ({error}): {answer}"));
        let view = Chat::read_answer(&tree);
        assert_eq!(light.view.choices.len(), view.choices.len(), "{answer}");
        for (ours, theirs) in light.view.choices.iter().zip(&view.choices) {
            assert_eq!(ours.index, theirs.index, "{answer}");
            assert_eq!(ours.position, theirs.position, "{answer}");
            assert_eq!(ours.texts, theirs.texts, "{answer}");
            assert_eq!(ours.finish_reason, theirs.finish_reason, "{answer}");
            for field in &theirs.texts {
                assert_eq!(
                    light.texts(answer).text_of(field),
                    tree.text_of(field),
                    "{answer}"
                );
            }
        }
        assert_eq!(light.view.usage, view.usage, "{answer}");
    }

    #[test]
    fn common_answers_are_light_and_read_as_the_tree_reads_them() {
        for answer in [
            r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there","refusal":null,"annotations":[]},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":0}},"service_tier":"default","system_fingerprint":"fp"}"#,
            // Escapes, reasoning (both names: the second is an alias),
            // members in another order, a choice's own extra members.
            r#"{"choices":[{"finish_reason":"length","message":{"content":"line\none \"q\" \u00e9","reasoning":"r","reasoning_content":"rc","role":"assistant"},"index":0,"content_filter_results":{"hate":{"filtered":false}}}]}"#,
            r#"{"choices":[{"index":0,"message":{"role":"assistant","content":null,"refusal":"I can't","tool_calls":null,"function_call":null,"audio":null},"finish_reason":"stop"}]}"#,
            // Two choices, one without an index, no finish reason, no usage.
            r#"{"choices":[{"message":{"content":"a"}},{"index":1,"message":{"content":"b"},"finish_reason":null}],"usage":null}"#,
            r#"{"choices":[]}"#,
            r#" {"choices":[{"index":0,"message":{"role":"assistant","content":""},"finish_reason":"stop"}]} "#,
            // Usage as DeepSeek and Anthropic-compatible servers report it.
            r#"{"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":5,"prompt_cache_hit_tokens":16,"prompt_tokens_details":null}}"#,
            r#"{"choices":[],"usage":{"input_tokens":4,"output_tokens":5,"cache_read_input_tokens":16,"cache_creation_input_tokens":2,"server_tool_use":{"web_search_requests":0}}}"#,
            r#"{"choices":[],"usage":{"completion_tokens":5}}"#,
        ] {
            same_as_tree(answer);
        }
    }

    #[test]
    fn anything_else_is_read_from_the_tree() {
        for answer in [
            // Tool calls, function calls, audio, annotations: strings the
            // tree's residual scan reads.
            r#"{"choices":[{"index":0,"message":{"content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"message":{"function_call":{"name":"f","arguments":"{}"}}}]}"#,
            r#"{"choices":[{"index":0,"message":{"audio":{"transcript":"t"}}}]}"#,
            r#"{"choices":[{"index":0,"message":{"content":"a","annotations":[{"type":"url_citation","url_citation":{"title":"t"}}]}}]}"#,
            r#"{"choices":[{"index":0,"message":{"content":"a","custom":"b"}}]}"#,
            // A provider's own member holding a canary-shaped span; the
            // metadata, the role or the usage holding one.
            r#"{"citations":["https://x.test/CG123456789012345"],"choices":[{"index":0,"message":{"content":"a"}}]}"#,
            r#"{"id":"CG123456789012345","choices":[{"index":0,"message":{"content":"a"}}]}"#,
            r#"{"choices":[{"index":0,"message":{"role":"CG123456789012345","content":"a"}}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1,"note":"CG123456789012345"}}"#,
            // Logprobs (edited with the text), an error.
            r#"{"choices":[{"index":0,"message":{"content":"a"},"logprobs":{"content":[]}}]}"#,
            r#"{"error":{"message":"overloaded"}}"#,
            // Wrong types, a member twice, anything after the answer.
            r#"{"choices":[{"index":0,"message":{"content":["a"]}}]}"#,
            r#"{"choices":[{"index":0,"message":{"content":"a"},"finish_reason":7}]}"#,
            r#"{"choices":[{"index":-1,"message":{"content":"a"}}]}"#,
            r#"{"choices":[{"index":0,"message":null}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1.5}}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1,"prompt_tokens":2}}"#,
            r#"{"choices":[{"index":0,"message":{"content":"a","content":"b"}}]}"#,
            r#"{"choices":[],"choices":[]}"#,
            r#"{"choices":[]} {}"#,
            "[1]",
            "not json",
        ] {
            assert!(read(answer).is_none(), "light: {answer}");
        }
    }

    #[test]
    fn texts_are_found_in_any_order_and_many_choices_read_in_order() {
        let choices: Vec<Value> = (0..2_000)
            .map(|n| {
                json!({"index": n, "message": {"content": format!("text {n}"),
                            "reasoning_content": format!("thought {n}")}})
            })
            .collect();
        let answer = json!({"choices": choices}).to_string();
        let light = read(&answer).unwrap();
        let texts = light.texts(&answer);
        let fields: Vec<&TextField> = light
            .view
            .choices
            .iter()
            .flat_map(|choice| &choice.texts)
            .collect();
        assert_eq!(fields.len(), 4_000);
        for (n, pair) in fields.chunks(2).enumerate() {
            assert_eq!(texts.text_of(pair[0]), format!("thought {n}"));
            assert_eq!(texts.text_of(pair[1]), format!("text {n}"));
        }
        // Out of order, and a field of another answer.
        assert_eq!(texts.text_of(fields[7]), "text 3");
        assert_eq!(texts.text_of(fields[0]), "thought 0");
        let elsewhere = TextField {
            at: Location::ROOT.key(Key::Output),
            ..*fields[0]
        };
        assert_eq!(texts.text_of(&elsewhere), "");
    }

    /// A request of `max_tokens` with canaries placed, and the opening an
    /// obedient model writes.
    fn placed(max_tokens: u64) -> (Injection, String) {
        let request = json!({"model": "m", "max_tokens": max_tokens,
                             "messages": [{"role": "user", "content": "Name the planets"}]});
        let mut body = Chat::parse_request(request.to_string().as_bytes())
            .unwrap()
            .body;
        let injection = Chat::place_canaries(
            &mut body,
            EchoMode::HeadTail,
            EchoCost::DIGIT_BY_DIGIT,
            RequestCanaries::mint(),
            SystemRole::Accepted,
        )
        .unwrap();
        (injection, obedient_echo(&body).unwrap())
    }

    /// What the client gets of `answer` after verification under
    /// `injection`: read in place (`light`) or from the tree.
    fn deliver(injection: &Injection, answer: &str, light: bool) -> Vec<u8> {
        let registry = MemoryRegistry::new(b"test");
        let mut verifier = Verifier::new(injection, &VerifyConfig::default(), "p", None);
        let usage = UsageOptions {
            client_wants_usage: false,
            without_canarygate: false,
            overhead_prompt: injection.prompt_tokens_added,
        };
        let mut delivery = Delivery::new(
            TokenCounter::default(),
            injection.client_max_tokens,
            usage,
            2,
        );
        let mut tree: Value = serde_json::from_str(answer).unwrap();
        let tree_view = Chat::read_answer(&tree);
        let in_place = read(answer).unwrap();
        let view = if light { &in_place.view } else { &tree_view };
        let mut spans = Vec::new();
        for field in view.choices.iter().flat_map(|choice| &choice.texts) {
            let text = if light {
                in_place.texts(answer).text_of(field).to_owned()
            } else {
                tree.text_of(field).to_owned()
            };
            let start = verifier.received(field.choice, field.kind);
            spans.push(start..start + text.len());
            if !text.is_empty() {
                verifier.push_part_positions(field.choice, field.kind, &text, &registry);
            }
        }
        let facts = Facts {
            finish_reasons: view
                .choices
                .iter()
                .map(|choice| choice.finish_reason.clone())
                .collect(),
            usage: view.usage,
            done_marker: None,
        };
        verifier.finish(&facts, &registry);
        if light {
            return in_place.deliver(answer, &spans, &verifier, &mut delivery);
        }
        Chat::deliver_answer(&mut tree, &tree_view, &spans, &verifier, &mut delivery);
        serde_json::to_vec(&tree).unwrap()
    }

    #[test]
    fn a_light_answer_is_delivered_as_its_tree_would_be() {
        for max_tokens in [3, 6, 200] {
            let (injection, opening) = placed(max_tokens);
            let text = format!("{opening}\nMercury, Venus, \"Earth\"\nand Mars.");
            let answer = json!({"id": "c1", "object": "chat.completion", "created": 1,
                "model": "m", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text,
                     "refusal": null, "annotations": []}, "logprobs": null,
                     "finish_reason": "stop"},
                    {"index": 1, "message": {"role": "assistant", "reasoning_content": "hmm",
                     "content": format!("{opening} Pluto")}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 90, "completion_tokens": 40, "total_tokens": 130}})
            .to_string();
            let light = deliver(&injection, &answer, true);
            let tree = deliver(&injection, &answer, false);
            assert_eq!(
                String::from_utf8_lossy(&light),
                String::from_utf8_lossy(&tree),
                "{max_tokens}"
            );
            let delivered: Value = serde_json::from_slice(&light).unwrap();
            let content = delivered["choices"][0]["message"]["content"]
                .as_str()
                .unwrap();
            assert!(
                !content.contains(&opening),
                "the echo is removed: {content}"
            );
            if max_tokens == 3 {
                assert_eq!(delivered["choices"][0]["finish_reason"], "length");
            }
        }
    }

    /// A message, and whether an in-place reading takes it.
    fn message() -> impl Strategy<Value = (Node, bool)> {
        let texts = ["content", "refusal", "reasoning_content", "reasoning"]
            .map(|name| proptest::option::of(text_or_null()).prop_map(move |text| (name, text)));
        let role =
            proptest::option::of(prop_oneof![Just(Node::str("assistant")), Just(Node::Null)]);
        (texts, role, 0..14usize).prop_flat_map(|(texts, role, other)| {
            let mut members: Vec<(&'static str, Node)> = texts
                .into_iter()
                .filter_map(|(name, text)| Some((name, text?)))
                .collect();
            members.extend(role.map(|role| ("role", role)));
            let (other, takes) = match other {
                0 => (Some(("annotations", Node::Array(vec![]))), true),
                1 => (Some(("tool_calls", Node::Null)), true),
                2 => (Some(("function_call", Node::Null)), true),
                3 => (
                    Some((
                        "annotations",
                        Node::Array(vec![Node::Object(vec![(
                            "type",
                            Node::str("url_citation"),
                        )])]),
                    )),
                    false,
                ),
                4 => (
                    Some((
                        "tool_calls",
                        Node::Array(vec![Node::Object(vec![("id", Node::str("call_1"))])]),
                    )),
                    false,
                ),
                5 => (
                    Some(("audio", Node::Object(vec![("transcript", Node::str("t"))]))),
                    false,
                ),
                6 => (Some(("custom", Node::str("x"))), false),
                _ => (None, true),
            };
            members.extend(other);
            arrange(members)
                .prop_map(move |(members, twice)| (Node::Object(members), takes && !twice))
        })
    }

    /// A choice, and whether an in-place reading takes it.
    fn choice() -> impl Strategy<Value = (Node, bool)> {
        let index = prop_oneof![
            8 => (0u32..3).prop_map(|n| (Some(Node::number(&n.to_string())), true)),
            2 => Just((None, true)),
            1 => Just((Some(Node::number("-1")), false)),
            1 => Just((Some(Node::number("1.5")), false)),
        ];
        let message = prop_oneof![
            8 => message().prop_map(|(message, takes)| (Some(message), takes)),
            1 => Just((Some(Node::Null), false)),
            1 => Just((None, true)),
        ];
        let finish_reason = prop_oneof![
            4 => Just((Some(Node::str("stop")), true)),
            2 => Just((Some(Node::str("length")), true)),
            2 => Just((Some(Node::Null), true)),
            2 => Just((None, true)),
            1 => Just((Some(Node::number("7")), false)),
        ];
        let logprobs = prop_oneof![
            4 => Just((None, true)),
            4 => Just((Some(Node::Null), true)),
            1 => Just((Some(Node::Object(vec![("content", Node::Array(vec![]))])), false)),
        ];
        let filter = proptest::option::of(Just(Node::Object(vec![(
            "hate",
            Node::Object(vec![("filtered", Node::Null)]),
        )])));
        (index, message, finish_reason, logprobs, filter).prop_flat_map(
            |(index, message, finish_reason, logprobs, filter)| {
                let takes = index.1 && message.1 && finish_reason.1 && logprobs.1;
                let members: Vec<(&'static str, Node)> = [
                    ("index", index.0),
                    ("message", message.0),
                    ("finish_reason", finish_reason.0),
                    ("logprobs", logprobs.0),
                    ("content_filter_results", filter),
                ]
                .into_iter()
                .filter_map(|(name, value)| Some((name, value?)))
                .collect();
                arrange(members)
                    .prop_map(move |(members, twice)| (Node::Object(members), takes && !twice))
            },
        )
    }

    /// A whole answer as JSON text, and whether an in-place reading takes it.
    fn answer_text() -> impl Strategy<Value = (String, bool)> {
        let choices = proptest::collection::vec(choice(), 0..3);
        let error = prop_oneof![
            8 => Just(None),
            1 => Just(Some(Node::Object(vec![("message", Node::str("overloaded"))]))),
        ];
        (
            skipped_members(),
            choices,
            usage(),
            error,
            0..12usize,
            any::<(bool, bool)>(),
        )
            .prop_flat_map(
                |(mut members, choices, usage, error, after, (spaced, escaped))| {
                    let takes = choices.iter().all(|choice| choice.1)
                        && usage.as_ref().is_none_or(|usage| usage.1)
                        && error.is_none()
                        && after > 0;
                    members.push((
                        "choices",
                        Node::Array(choices.into_iter().map(|c| c.0).collect()),
                    ));
                    members.extend(usage.map(|usage| ("usage", usage.0)));
                    members.extend(error.map(|error| ("error", error)));
                    arrange(members).prop_map(move |(members, twice)| {
                        let mut text = Node::Object(members).render(Style { spaced, escaped });
                        if after == 0 {
                            text.push_str(" {}");
                        }
                        (text, takes && !twice)
                    })
                },
            )
    }

    proptest! {
        /// Whatever the provider writes, an answer read in place reads as
        /// its tree reads it, and every answer of the shapes the reading
        /// takes is read in place.
        #[test]
        fn any_answer_read_in_place_reads_as_its_tree((answer, takes) in answer_text()) {
            match read(&answer) {
                Some(light) => reads_as_tree(&light, &answer),
                None => prop_assert!(!takes, "not read in place: {answer}"),
            }
        }

        /// An answer read in place is delivered as its tree would be: the
        /// same JSON, and the same bytes when the provider wrote them as
        /// serde_json does (echo removed, text cut at the client's limit;
        /// whether the verdict passes is not this test's concern).
        #[test]
        fn any_answer_read_in_place_is_delivered_as_its_tree(
            max_tokens in prop_oneof![Just(3u64), Just(6), Just(200)],
            tail in text(),
            second in proptest::option::of(text()),
            skipped in skipped_members(),
            (spaced, escaped) in any::<(bool, bool)>(),
        ) {
            let (injection, opening) = placed(max_tokens);
            let mut choices = vec![Node::Object(vec![
                ("index", Node::number("0")),
                ("message", Node::Object(vec![
                    ("role", Node::str("assistant")),
                    ("content", Node::Str(format!("{opening}{tail}"))),
                ])),
                ("finish_reason", Node::str("stop")),
            ])];
            if let Some(second) = second {
                choices.push(Node::Object(vec![
                    ("index", Node::number("1")),
                    ("message", Node::Object(vec![
                        ("reasoning_content", Node::str("thinking")),
                        ("content", Node::Str(format!("{opening} {second}"))),
                    ])),
                    ("finish_reason", Node::str("stop")),
                ]));
            }
            let mut members = skipped;
            members.push(("choices", Node::Array(choices)));
            let style = Style { spaced, escaped };
            let answer = Node::Object(members).render(style);
            prop_assert!(read(&answer).is_some(), "not read in place: {answer}");
            let light = deliver(&injection, &answer, true);
            let tree = deliver(&injection, &answer, false);
            let light_value: Value = serde_json::from_slice(&light).unwrap();
            let tree_value: Value = serde_json::from_slice(&tree).unwrap();
            prop_assert_eq!(&light_value, &tree_value, "{}", answer);
            if !spaced && !escaped {
                prop_assert_eq!(
                    String::from_utf8_lossy(&light),
                    String::from_utf8_lossy(&tree)
                );
            }
        }
    }
}
