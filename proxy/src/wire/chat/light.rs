//! Reading the common Chat Completions chunk without building its JSON tree.
//!
//! Nearly every chunk of a stream is one choice whose delta holds a role
//! and at most one text (`content`, or reasoning while a model thinks),
//! passed on to the client exactly as the provider sent it, or, while a
//! model calls a tool, one piece of the call's arguments. Such a chunk is
//! deserialised into borrowed views: the members canarygate never reads
//! (`id`, `model`, `created`, `system_fingerprint`, ...) are skipped
//! without being allocated, and nothing else is built but the text itself.
//!
//! Any other shape is not light and [`read`] says so; the caller reads it
//! from its tree ([`super::answer::read_choice`]), which gives what this
//! reading gives for a light chunk. Not light: a tool call's first delta
//! (its id and name), more than one call, function calls, logprobs, usage, an `error` member, a member of a choice or delta that
//! is not listed below, a member of the wrong type, or more than one text
//! in the chunk. What is listed covers every string of a delta, so a
//! canary-shaped span anywhere in a light chunk's delta is read as text,
//! as the tree's residual scan would find it.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use canarygate_policies::verify::Part;
use serde::de::{Deserializer, Error as _, SeqAccess, Visitor};
use serde::{Deserialize, de::IgnoredAny};

use crate::wire::format::{ChoiceView, Choices, Chunk, TextField, TextFields};
use crate::wire::json_str::JsonStr;
use crate::wire::location::{Key, Location, Step};

/// A chunk: `choices`, and members that must not be there (anything else
/// is skipped).
#[derive(Deserialize)]
struct LightChunk<'a> {
    #[serde(borrow, default)]
    choices: LightChoices<'a>,
    /// Usage is read from the tree; `null` (OpenAI's chunks before the
    /// last under `include_usage`) is no usage.
    #[serde(rename = "usage", default)]
    _usage: Option<Refused>,
    /// Any `error`, even `null`, is the tree's to judge.
    #[serde(rename = "error", default)]
    _error: Absent,
}

/// One choice of a light chunk.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LightChoice<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(borrow, default)]
    delta: Option<LightDelta<'a>>,
    #[serde(borrow, default)]
    finish_reason: Option<Cow<'a, str>>,
    #[serde(rename = "logprobs", default)]
    _logprobs: Option<Refused>,
}

/// A choice's delta: its role and its texts, nothing else.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LightDelta<'a> {
    /// Never read as text (as in the tree's reading).
    #[serde(default)]
    role: Option<IgnoredAny>,
    #[serde(borrow, default)]
    reasoning_content: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    reasoning: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    content: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    refusal: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    tool_calls: Option<LightCalls<'a>>,
    #[serde(rename = "function_call", default)]
    _function_call: Option<Refused>,
}

/// A delta's `tool_calls` that continues one call's arguments: one call,
/// with its index and a piece of its arguments and nothing else.
struct LightCalls<'a> {
    index: Option<u64>,
    arguments: JsonStr<'a>,
}

/// The one call of [`LightCalls`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LightCall<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(borrow)]
    function: LightFunction<'a>,
}

/// The call's `function`: its arguments only (a name comes in the call's
/// first delta, read from the tree).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LightFunction<'a> {
    #[serde(borrow)]
    arguments: JsonStr<'a>,
}

impl<'de: 'a, 'a> Deserialize<'de> for LightCalls<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// Reads a list of exactly one call.
        struct OneCall<'a>(PhantomData<LightCalls<'a>>);

        impl<'de: 'a, 'a> Visitor<'de> for OneCall<'a> {
            type Value = LightCalls<'a>;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a list of one tool call")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let Some(LightCall { index, function }) = seq.next_element::<LightCall<'de>>()?
                else {
                    return Err(A::Error::custom("not read lightly"));
                };
                if seq.next_element::<IgnoredAny>()?.is_some() {
                    return Err(A::Error::custom("not read lightly"));
                }
                Ok(LightCalls {
                    index,
                    arguments: function.arguments,
                })
            }
        }

        deserializer.deserialize_seq(OneCall(PhantomData))
    }
}

/// A member a light chunk may have only as `null` (inside an `Option`):
/// any value makes the chunk not light.
struct Refused;

impl<'de> Deserialize<'de> for Refused {
    fn deserialize<D: Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Err(D::Error::custom("not read lightly"))
    }
}

/// A member a light chunk must not have at all, whatever its value.
#[derive(Default)]
struct Absent;

impl<'de> Deserialize<'de> for Absent {
    fn deserialize<D: Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Err(D::Error::custom("not read lightly"))
    }
}

/// A light chunk's choices, each read into its view as it is parsed.
#[derive(Default)]
struct LightChoices<'a> {
    views: Choices,
    /// The chunk's one text, if any.
    text: Option<JsonStr<'a>>,
    /// Some choice's delta carries something besides its text: a role, a
    /// tool call.
    keeps_other_fields: bool,
}

impl<'a> LightChoices<'a> {
    /// Adds the next choice; an error when the chunk now has a second text
    /// (it is not light).
    fn add(&mut self, choice: LightChoice<'a>) -> Result<(), &'static str> {
        let position = self.views.len();
        let index = choice
            .index
            .unwrap_or(position as u64)
            .min(u64::from(u32::MAX)) as u32;
        let mut fields = TextFields::new();
        if let Some(delta) = choice.delta {
            self.keeps_other_fields |= delta.role.is_some() || delta.tool_calls.is_some();
            // The order and parts of the tree's reading (`TEXT_FIELDS`).
            let reasoning_kind = match delta.reasoning_content {
                Some(_) => Part::ReasoningAlias,
                None => Part::Reasoning,
            };
            // Where each text sits, as steps below the delta: only the
            // `Location` of a text that is there is built.
            let candidates = [
                (
                    &[Step::Key(Key::ReasoningContent)][..],
                    Part::Reasoning,
                    delta.reasoning_content,
                ),
                (
                    &[Step::Key(Key::Reasoning)][..],
                    reasoning_kind,
                    delta.reasoning,
                ),
                (&[Step::Key(Key::Content)][..], Part::Content, delta.content),
                (&[Step::Key(Key::Refusal)][..], Part::Refusal, delta.refusal),
            ];
            // Then the call's arguments (the tree reads them after the texts).
            let call = delta.tool_calls.map(|LightCalls { index, arguments }| {
                let call_index = index.unwrap_or(0).min(u64::from(u32::MAX)) as u32;
                (
                    &[
                        Step::Key(Key::ToolCalls),
                        Step::Index(0),
                        Step::Key(Key::Function),
                        Step::Key(Key::Arguments),
                    ][..],
                    Part::ToolArguments(call_index),
                    Some(arguments),
                )
            });
            for (steps, kind, text) in candidates.into_iter().chain(call) {
                let Some(text) = text else { continue };
                if self.text.is_some() {
                    return Err("more than one text");
                }
                let at = steps.iter().fold(
                    Location::ROOT
                        .key(Key::Choices)
                        .index(position)
                        .key(Key::Delta),
                    |at, step| at.then(*step),
                );
                fields.push(TextField {
                    choice: index,
                    kind,
                    at,
                });
                self.text = Some(text);
            }
        }
        self.views.push(ChoiceView {
            index,
            position,
            texts: fields,
            finish_reason: choice.finish_reason.map(Cow::into_owned),
        });
        Ok(())
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for LightChoices<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// Reads the array without a list of its own.
        struct ChoiceSeq<'a>(PhantomData<LightChoices<'a>>);

        impl<'de: 'a, 'a> Visitor<'de> for ChoiceSeq<'a> {
            type Value = LightChoices<'a>;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("an array of choices")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut choices = LightChoices::default();
                while let Some(choice) = seq.next_element::<LightChoice<'de>>()? {
                    choices.add(choice).map_err(A::Error::custom)?;
                }
                Ok(choices)
            }
        }

        deserializer.deserialize_seq(ChoiceSeq(PhantomData))
    }
}

/// The chunk in `data`, when it is light (see the module docs).
pub fn read(data: &str) -> Option<Chunk> {
    let LightChunk { choices, .. } = serde_json::from_str(data).ok()?;
    let text = choices.text.map(|text| text.in_data(data));
    Some(Chunk::light(
        choices.views,
        text,
        choices.keeps_other_fields,
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    /// The tree's reading of `data`, as Chat's `read_event` does it.
    fn tree(data: &str) -> Chunk {
        let value: Value = serde_json::from_str(data).unwrap();
        let choices = value["choices"]
            .as_array()
            .map(|choices| {
                choices
                    .iter()
                    .enumerate()
                    .map(|(position, choice)| {
                        super::super::answer::read_choice(choice, position, Key::Delta)
                    })
                    .collect()
            })
            .unwrap_or_default();
        Chunk::parsed(value, choices, None)
    }

    /// Asserts that `data` is light and read as the tree reads it.
    fn same_as_tree(data: &str) {
        let light = read(data).unwrap_or_else(|| panic!("not light: {data}"));
        let tree = tree(data);
        assert_eq!(light.choices.len(), tree.choices.len(), "{data}");
        for (ours, theirs) in light.choices.iter().zip(&tree.choices) {
            assert_eq!(ours.index, theirs.index, "{data}");
            assert_eq!(ours.position, theirs.position, "{data}");
            assert_eq!(ours.texts, theirs.texts, "{data}");
            assert_eq!(ours.finish_reason, theirs.finish_reason, "{data}");
        }
        for field in tree.texts() {
            assert_eq!(
                light.with_data(data).text(field),
                tree.with_data(data).text(field),
                "{data}"
            );
        }
        let value: Value = serde_json::from_str(data).unwrap();
        let keeps_other_fields = value["choices"].as_array().is_some_and(|choices| {
            choices.iter().any(|choice| {
                !choice["delta"]["role"].is_null() || !choice["delta"]["tool_calls"].is_null()
            })
        });
        assert_eq!(
            light.light_keeps_other_fields(),
            keeps_other_fields,
            "{data}"
        );
        assert!(light.is_light());
    }

    #[test]
    fn common_chunks_are_light_and_read_as_the_tree_reads_them() {
        for data in [
            r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c1","choices":[{"index":0,"delta":{"content":"Hello \"world\"\n\u00e9"},"finish_reason":null}],"usage":null,"obfuscation":"x1"}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning_content":"thinking","content":null}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning":"hmm"}}]}"#,
            r#"{"choices":[{"delta":{"refusal":"no"},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":3,"delta":{},"finish_reason":"stop"}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"x","tool_calls":null,"function_call":null}}]}"#,
            r#"{"choices":[]}"#,
            r#"{"id":"keep-alive"}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{"role":"assistant"}}]}"#,
            // A call's arguments, after its first delta.
            r#"{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":null,"tool_calls":[{"index":2,"function":{"arguments":" \"Paris\"}"}}]}}]}"#,
            r#"{"choices":[{"index":1,"delta":{"tool_calls":[{"function":{"arguments":""}}]}}]}"#,
        ] {
            same_as_tree(data);
        }
    }

    #[test]
    fn anything_else_is_read_from_the_tree() {
        for data in [
            // Two texts in one chunk.
            r#"{"choices":[{"index":0,"delta":{"reasoning_content":"a","reasoning":"a"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{"content":"b"}}]}"#,
            // A call's first delta (a name may hold a canary), two calls,
            // a call with something besides its arguments, text and a call.
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}},{"index":1,"function":{"arguments":"{"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"type":"function","function":{"arguments":"{"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{","name":"f"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":7}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a","tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}"#,
            // Function calls, logprobs, usage, an error.
            r#"{"choices":[{"index":0,"delta":{"function_call":{"arguments":"{"}}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"content":[]}}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#,
            r#"{"error":{"message":"overloaded"}}"#,
            r#"{"error":null,"choices":[]}"#,
            // Unknown members of a delta or choice (a string there may
            // hold a canary: the tree's residual scan reads it).
            r#"{"choices":[{"index":0,"delta":{"content":"a","audio":{"transcript":"t"}}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"},"content_filter_results":{}}]}"#,
            // Wrong types.
            r#"{"choices":[{"index":-1,"delta":{"content":"a"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":7}}]}"#,
            r#"{"choices":null}"#,
            r#"[1,2]"#,
            "not json",
        ] {
            assert!(read(data).is_none(), "light: {data}");
        }
    }
}
