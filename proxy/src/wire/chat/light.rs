//! Reading the common Chat Completions chunk without building its JSON tree.
//!
//! Nearly every chunk of a stream is one choice whose delta holds a role
//! and at most one text (`content`, or reasoning while a model thinks),
//! passed on to the client exactly as the provider sent it, or, while a
//! model calls a tool, one piece of the call's arguments. Such a chunk is
//! read in place: the parser's visitors fill the chunk's choice views as
//! they meet its members, the members canarygate does not read as text
//! (`id`, `model`, `created`, `system_fingerprint`, ...) are only searched
//! for a canary-shaped span, without being allocated, and nothing else is
//! built but the text itself.
//!
//! Any other shape is not light and [`read`] says so; the caller reads it
//! from its tree ([`super::answer::read_choice`]), which gives what this
//! reading gives for a light chunk. Not light: a tool call's first delta
//! (its id and name), more than one call, function calls, logprobs, usage,
//! an `error` member, a member of a choice or delta that is not listed
//! below, a member twice, a member of the wrong type, anything after the
//! chunk, or more than one text in the chunk. What is listed covers every
//! string of a delta, so a canary-shaped span anywhere in a light chunk's
//! delta is read as text, as the tree's residual scan would find it.
//!
//! In a stream, [`read_in_stream`] reads less of each chunk: the bytes
//! before `choices` that every chunk of an answer repeats are left out, and
//! a chunk with the same bytes around its text as an earlier one (a
//! [`TextFrame`]) is read as that one was, with its own text, parsing only
//! what follows `choices`.
//!
//! Longer than 500 lines: about 620 of them are the unit tests, which hold
//! every light reading to the tree's reading of the same chunk, for listed
//! chunks and for generated ones (property tests over the shapes and
//! spellings providers use, `json_text.rs`, alone and after other chunks of
//! their stream).

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use canarygate_policies::canary::{CANONICAL_LEN, find_canaries, may_join_a_canary};
use canarygate_policies::verify::Part;
use serde::Deserialize;
use serde::de::{
    DeserializeSeed, Deserializer, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor,
};
use serde_json::value::RawValue;

use crate::wire::format::{
    ChoiceView, Choices, Chunk, LightText, StreamMemo, TextField, TextFields, TextFrame,
};
use crate::wire::json_str::JsonStr;
use crate::wire::location::{Key, Location};

/// The members of a chunk (or a whole answer, [`super::light_answer`])
/// that a light reading looks at: `choices`, `usage`, and `error`, which
/// must not be there; any other member (the metadata every chunk carries,
/// a provider's own) is skipped unless it holds a canary-shaped span
/// ([`skip_other`]) or its name does ([`member_name`]).
#[derive(Clone, Copy)]
pub(super) enum TopMember {
    Choices,
    /// A chunk's usage is read from the tree (`null`, OpenAI's chunks
    /// before the last under `include_usage`, is no usage); an answer's is
    /// read as counts.
    Usage,
    /// Any `error`, even `null`, is the tree's to judge.
    Error,
    /// `id`, `model`, `obfuscation`, OpenRouter's `provider`, Perplexity's
    /// `citations`...: see [`skip_other`].
    Other,
}

impl<'de> Deserialize<'de> for TopMember {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(match &*member_name(deserializer)? {
            "choices" => TopMember::Choices,
            "usage" => TopMember::Usage,
            "error" => TopMember::Error,
            _ => TopMember::Other,
        })
    }
}

/// A member's name, where a light reading takes any name: an error for one
/// that holds a canary-shaped span, which the tree's reading scans
/// ([`crate::wire::format::canary_shaped_names`]).
pub(super) fn member_name<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Cow<'de, str>, D::Error> {
    let JsonStr(name) = JsonStr::deserialize(deserializer)?;
    if name.len() >= CANONICAL_LEN && find_canaries(&name).next().is_some() {
        return Err(D::Error::custom("not read lightly"));
    }
    Ok(name)
}

/// Skips the value of a top-level member a light reading does not read
/// ([`TopMember::Other`]), unless it holds a canary-shaped span: then the
/// chunk is not light, and the tree's reading scans the member as text
/// ([`super::answer::top_level_texts`]).
pub(super) fn skip_other<'de, M: MapAccess<'de>>(map: &mut M) -> Result<(), M::Error> {
    let value: &'de RawValue = map.next_value()?;
    if find_canaries(value.get()).next().is_some() {
        return Err(M::Error::custom("not read lightly"));
    }
    Ok(())
}

/// The members a light choice may have.
#[derive(Clone, Copy, Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum ChoiceMember {
    Index,
    Delta,
    FinishReason,
    Logprobs,
}

/// The members a light delta may have: its role and its texts, nothing
/// else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum DeltaMember {
    /// Never read as text (as in the tree's reading).
    Role,
    ReasoningContent,
    Reasoning,
    Content,
    Refusal,
    ToolCalls,
    FunctionCall,
}

/// A delta, as a light chunk may hold it: at most one text, or one piece
/// of one call's arguments.
#[derive(Default)]
struct LightDelta<'a> {
    /// It has a role, or a call: something besides its text.
    keeps_other_fields: bool,
    /// Its one text, with the member it sits under, or its call's index
    /// and arguments.
    text: Option<(DeltaText, JsonStr<'a>)>,
}

/// Where a light delta's one text sits.
#[derive(Clone, Copy)]
enum DeltaText {
    /// Under this member of the delta.
    Member(Key),
    /// In the arguments of the one call, with this `index`.
    Call(Option<u64>),
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

impl<'de: 'a, 'a> Deserialize<'de> for LightDelta<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// Reads the members one by one, keeping the one text.
        struct DeltaVisitor<'a>(PhantomData<LightDelta<'a>>);

        impl<'de: 'a, 'a> Visitor<'de> for DeltaVisitor<'a> {
            type Value = LightDelta<'a>;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a chunk's delta")
            }

            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
                let mut delta = LightDelta::default();
                let mut seen = Members::default();
                while let Some(member) = map.next_key::<DeltaMember>()? {
                    seen.first(member as u8)?;
                    let text = match member {
                        DeltaMember::Role => {
                            let role = map.next_value::<Option<&'de RawValue>>()?;
                            // One that may join a canary with the next
                            // chunk's is the tree's to read (as a joined
                            // string, `super::joined::joined_strings`).
                            let joins = |role: &RawValue| {
                                let quoted = role.get();
                                let inner = quoted
                                    .strip_prefix('"')
                                    .and_then(|role| role.strip_suffix('"'));
                                inner.is_some_and(may_join_a_canary)
                                    || find_canaries(quoted).next().is_some()
                            };
                            if role.is_some_and(joins) {
                                return Err(M::Error::custom("not read lightly"));
                            }
                            delta.keeps_other_fields |= role.is_some();
                            None
                        }
                        DeltaMember::ReasoningContent => {
                            text_under(&mut map, Key::ReasoningContent)?
                        }
                        DeltaMember::Reasoning => text_under(&mut map, Key::Reasoning)?,
                        DeltaMember::Content => text_under(&mut map, Key::Content)?,
                        DeltaMember::Refusal => text_under(&mut map, Key::Refusal)?,
                        DeltaMember::ToolCalls => {
                            let call = map.next_value::<Option<LightCalls<'de>>>()?;
                            delta.keeps_other_fields |= call.is_some();
                            call.map(|LightCalls { index, arguments }| {
                                (DeltaText::Call(index), arguments)
                            })
                        }
                        DeltaMember::FunctionCall => {
                            map.next_value::<Option<Refused>>()?;
                            None
                        }
                    };
                    if text.is_some() && delta.text.is_some() {
                        return Err(M::Error::custom("more than one text"));
                    }
                    delta.text = delta.text.or(text);
                }
                Ok(delta)
            }
        }

        /// The text under member `key`, when it is a string.
        fn text_under<'de, M: MapAccess<'de>>(
            map: &mut M,
            key: Key,
        ) -> Result<Option<(DeltaText, JsonStr<'de>)>, M::Error> {
            Ok(map
                .next_value::<Option<JsonStr<'de>>>()?
                .map(|text| (DeltaText::Member(key), text)))
        }

        deserializer.deserialize_map(DeltaVisitor(PhantomData))
    }
}

/// The members of an object read so far, to refuse one that comes twice
/// (the tree keeps the last; a light reading would have to undo the first).
#[derive(Default, Clone, Copy)]
pub(super) struct Members(u32);

impl Members {
    /// Notes member `code`; an error when it came before.
    pub(super) fn first<E: serde::de::Error>(&mut self, code: u8) -> Result<(), E> {
        let bit = 1 << code;
        if self.0 & bit != 0 {
            return Err(E::custom("a member twice"));
        }
        self.0 |= bit;
        Ok(())
    }
}

/// A member a light chunk may have only as `null` (inside an `Option`):
/// any value makes the chunk (or answer) not light.
pub(super) struct Refused;

impl<'de> Deserialize<'de> for Refused {
    fn deserialize<D: Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Err(D::Error::custom("not read lightly"))
    }
}

/// A light chunk's choices, each read into its view as it is parsed: the
/// parser fills these in place (through [`ChunkSeed`], [`ChoicesSeed`] and
/// [`ChoiceSeed`]), so no choice is built and then moved into them.
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
    /// Adds the next choice, at index `index` (its position when `None`),
    /// with its `delta` and `finish_reason`; an error when the chunk now has
    /// a second text (it is not light).
    fn add(
        &mut self,
        index: Option<u64>,
        delta: Option<LightDelta<'a>>,
        finish_reason: Option<String>,
    ) -> Result<(), &'static str> {
        let position = self.views.len();
        let index = index.unwrap_or(position as u64).min(u64::from(u32::MAX)) as u32;
        let mut texts = TextFields::new();
        if let Some(LightDelta {
            keeps_other_fields,
            text,
        }) = delta
        {
            self.keeps_other_fields |= keeps_other_fields;
            if let Some((place, text)) = text {
                if self.text.is_some() {
                    return Err("more than one text");
                }
                let delta = Location::ROOT
                    .key(Key::Choices)
                    .index(position)
                    .key(Key::Delta);
                // The parts of the tree's reading (`TEXT_FIELDS`); with one
                // text there is no reasoning alias.
                let (kind, at) = match place {
                    DeltaText::Member(key) => {
                        let kind = match key {
                            Key::Content => Part::Content,
                            Key::Refusal => Part::Refusal,
                            _ => Part::Reasoning,
                        };
                        (kind, delta.key(key))
                    }
                    DeltaText::Call(call_index) => (
                        Part::ToolArguments(call_index.unwrap_or(0).min(u64::from(u32::MAX)) as u32),
                        delta
                            .key(Key::ToolCalls)
                            .index(0)
                            .key(Key::Function)
                            .key(Key::Arguments),
                    ),
                };
                texts.push(TextField {
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
            texts,
            finish_reason,
        });
        Ok(())
    }
}

/// Reads a chunk into [`LightChoices`], the top-level members in
/// [`Members`] taken as read already.
struct ChunkSeed<'s, 'a>(&'s mut LightChoices<'a>, Members);

/// [`Members`] code of a chunk's `choices`.
const CHOICES: u8 = 0;

/// [`Members`] code of a chunk's `usage`.
const USAGE: u8 = 1;

impl<'de: 'a, 'a> DeserializeSeed<'de> for ChunkSeed<'_, 'a> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for ChunkSeed<'_, 'a> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a chunk")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<(), M::Error> {
        let mut seen = self.1;
        while let Some(member) = map.next_key::<TopMember>()? {
            match member {
                TopMember::Choices => {
                    seen.first(CHOICES)?;
                    map.next_value_seed(ChoicesSeed(&mut *self.0))?;
                }
                TopMember::Usage => {
                    seen.first(USAGE)?;
                    map.next_value::<Option<Refused>>()?;
                }
                TopMember::Error => return Err(M::Error::custom("not read lightly")),
                TopMember::Other => skip_other(&mut map)?,
            }
        }
        Ok(())
    }
}

/// Reads a chunk's `choices` into [`LightChoices`].
struct ChoicesSeed<'s, 'a>(&'s mut LightChoices<'a>);

impl<'de: 'a, 'a> DeserializeSeed<'de> for ChoicesSeed<'_, 'a> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for ChoicesSeed<'_, 'a> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("an array of choices")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(ChoiceSeed(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

/// Reads one choice into [`LightChoices`].
struct ChoiceSeed<'s, 'a>(&'s mut LightChoices<'a>);

impl<'de: 'a, 'a> DeserializeSeed<'de> for ChoiceSeed<'_, 'a> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for ChoiceSeed<'_, 'a> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a chunk's choice")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<(), M::Error> {
        let (mut index, mut delta, mut finish_reason) = (None, None, None);
        let mut seen = Members::default();
        while let Some(member) = map.next_key::<ChoiceMember>()? {
            seen.first(member as u8)?;
            match member {
                ChoiceMember::Index => index = map.next_value::<Option<u64>>()?,
                ChoiceMember::Delta => delta = map.next_value::<Option<LightDelta<'de>>>()?,
                ChoiceMember::FinishReason => {
                    finish_reason = map.next_value::<Option<String>>()?;
                    // A canary-shaped finish is the tree's to scan.
                    if finish_reason
                        .as_deref()
                        .is_some_and(|finish| find_canaries(finish).next().is_some())
                    {
                        return Err(M::Error::custom("not read lightly"));
                    }
                }
                ChoiceMember::Logprobs => {
                    map.next_value::<Option<Refused>>()?;
                }
            }
        }
        self.0
            .add(index, delta, finish_reason)
            .map_err(M::Error::custom)
    }
}

/// The chunk in `data`, when it is light (see the module docs).
pub fn read(data: &str) -> Option<Chunk> {
    read_shifted(data, 0)
}

/// The key of a chunk's `choices`, as compact JSON writes it.
const CHOICES_KEY: &str = "\"choices\":";

/// Times a stream's reading looks for the prefix its chunks share
/// ([`StreamMemo`]) before it gives up on that stream.
const PREFIX_SEARCHES: u8 = 4;

/// [`read`], for the next chunk of a stream. A provider begins every chunk
/// of one answer with the same members (`{"id":…,"object":…,"created":…,
/// "model":…,…,` before `"choices"`), which the reading skips: `memo` keeps
/// those bytes once a chunk that was read in place had them
/// ([`skipped_prefix`]), and a chunk that begins with exactly them, then
/// `"choices":`, is read as `{` and what follows them.
///
/// That is the same reading. The prefix's bytes were parsed as JSON when
/// they were learnt, so the same bytes are valid again; they are `{` and
/// whole members, each followed by a comma, at the chunk's top level, none
/// of them a member the reading looks at (`choices`, `usage`, `error`), so
/// they leave the reading as it was; after them the parser expects a key,
/// as it does after `{`, and the key that comes is `choices` in both. The
/// text's place is mapped back into `data`.
pub fn read_in_stream(data: &str, memo: &mut StreamMemo) -> Option<Chunk> {
    if let Some(frame) = &memo.text_frame
        && let Some(chunk) = read_framed(frame, data, &mut memo.scratch)
    {
        return Some(chunk);
    }
    let chunk = read_after_prefix(data, memo)?;
    if memo.frames_learnt < FRAME_LEARNS
        && let Some(frame) = text_frame(data, &chunk)
    {
        memo.frames_learnt += 1;
        memo.text_frame = Some(frame);
    }
    Some(chunk)
}

/// [`read`], from after the prefix the stream's chunks share when `data`
/// begins with it (see [`read_in_stream`]), learning that prefix from the
/// first chunks.
fn read_after_prefix(data: &str, memo: &mut StreamMemo) -> Option<Chunk> {
    let prefix = memo.skipped_prefix.as_str();
    if let Some(rest) = data
        .strip_prefix(prefix)
        .filter(|rest| !prefix.is_empty() && rest.starts_with(CHOICES_KEY))
    {
        let shift = prefix.len() - 1;
        memo.scratch.clear();
        memo.scratch.push('{');
        memo.scratch.push_str(rest);
        return read_shifted(&memo.scratch, shift);
    }
    let chunk = read(data)?;
    if memo.prefix_searches < PREFIX_SEARCHES {
        memo.prefix_searches += 1;
        memo.skipped_prefix.clear();
        if let Some(end) = skipped_prefix(data) {
            memo.skipped_prefix.push_str(&data[..end]);
        }
    }
    Some(chunk)
}

/// Times a stream's reading learns the frame of a chunk ([`text_frame`])
/// before it keeps the last one it learnt.
const FRAME_LEARNS: u8 = 4;

/// The frame of `chunk`, the light reading of `data`: the bytes around
/// its one text, when that text's string held no escape and `choices` is
/// the first member or comes after members the reading skips
/// ([`skipped_prefix`]).
fn text_frame(data: &str, chunk: &Chunk) -> Option<TextFrame> {
    let text = chunk.light_text_in_data()?;
    let choices_first = data
        .strip_prefix('{')
        .is_some_and(|rest| rest.starts_with(CHOICES_KEY));
    if !choices_first {
        skipped_prefix(data)?;
    }
    let bytes = data.as_bytes();
    let opening = text.start.checked_sub(1)?;
    if bytes[opening] != b'"' || bytes.get(text.end) != Some(&b'"') {
        return None;
    }
    let end = choices_end(bytes, opening, text.end + 1)?;
    Some(TextFrame {
        before: data[..text.start].to_owned(),
        after: data[text.end..end].to_owned(),
        choices: chunk.choices.clone(),
        keeps_other_fields: chunk.light_keeps_other_fields(),
    })
}

/// Where the top-level `choices` of `chunk` ends (just past its `]`), for
/// a string of it that opens at `opening` and ends just before `from`:
/// the nesting is counted up to the string, then followed from its end
/// until it is back at the chunk's own object.
fn choices_end(chunk: &[u8], opening: usize, from: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut at = 0;
    while at < opening {
        match chunk[at] {
            b'"' => at = string_end(chunk, at + 1)? + 1,
            b'{' | b'[' => (depth, at) = (depth + 1, at + 1),
            b'}' | b']' => (depth, at) = (depth.checked_sub(1)?, at + 1),
            _ => at += 1,
        }
    }
    if at != opening {
        return None;
    }
    at = from;
    while let Some(&byte) = chunk.get(at) {
        match byte {
            b'"' => at = string_end(chunk, at + 1)? + 1,
            b'{' | b'[' => (depth, at) = (depth + 1, at + 1),
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                at += 1;
                if depth == 1 {
                    return (byte == b']').then_some(at);
                }
            }
            _ => at += 1,
        }
    }
    None
}

/// Where the JSON string whose contents begin at `start` in `json` ends:
/// its closing quote.
fn string_end(json: &[u8], start: usize) -> Option<usize> {
    let mut at = start;
    loop {
        match json.get(at)? {
            b'\\' => at += 2,
            b'"' => return Some(at),
            _ => at += 1,
        }
    }
}

/// `data` read through the stream's `frame`: when it has the frame's bytes
/// around a text that holds no escape, no quote and no control character,
/// and ends after `choices` as a light chunk may, it reads as the frame's
/// chunk did, with this text. `scratch` holds what follows `choices`.
///
/// That is the same reading as [`read`]'s. The two chunks are the same
/// bytes but for the text's string and what follows `choices`. A string of
/// other such characters is a valid JSON string read without an escape, so
/// the parser meets the same tokens in the same places up to the end of
/// `choices`: the same choices, the text at the same place, its bytes
/// now these. Before `choices` there are only members the reading skips
/// (the frame is learnt only then), so after it the reading has seen
/// `choices` and nothing else it reads, which is where
/// [`after_choices`]'s reading begins.
fn read_framed(frame: &TextFrame, data: &str, scratch: &mut String) -> Option<Chunk> {
    let rest = data.strip_prefix(frame.before.as_str())?;
    let len = rest
        .bytes()
        .position(|byte| matches!(byte, b'"' | b'\\') || byte < 0x20)?;
    let tail = rest[len..].strip_prefix(frame.after.as_str())?;
    after_choices(tail, scratch)?;
    let start = frame.before.len();
    Some(Chunk::light(
        frame.choices.clone(),
        Some(LightText::InData(start..start + len)),
        frame.keeps_other_fields,
    ))
}

/// Whether `tail`, what follows a chunk's `choices`, ends the chunk as a
/// light reading takes it: `}` and whitespace, or `,` and members read as
/// [`ChunkSeed`] reads them with `choices` read already (written into
/// `scratch` as an object of their own).
fn after_choices(tail: &str, scratch: &mut String) -> Option<()> {
    const WHITESPACE: [char; 4] = [' ', '\n', '\t', '\r'];
    if let Some(end) = tail.strip_prefix('}') {
        return end.trim_start_matches(WHITESPACE).is_empty().then_some(());
    }
    let members = tail.strip_prefix(',')?;
    // A canary-shaped span there is the parser's to find, and the tree's.
    if find_canaries(members).next().is_none()
        && let Some(light) = plain_members(members.as_bytes())
    {
        return light.then_some(());
    }
    // A member follows the comma (a trailing comma is no JSON).
    if !members.trim_start_matches(WHITESPACE).starts_with('"') {
        return None;
    }
    scratch.clear();
    scratch.push('{');
    scratch.push_str(members);
    let mut parser = serde_json::Deserializer::from_str(scratch);
    let mut read = Members::default();
    read.first::<serde_json::Error>(CHOICES).ok()?;
    ChunkSeed(&mut LightChoices::default(), read)
        .deserialize(&mut parser)
        .ok()?;
    parser.end().ok()
}

/// [`after_choices`]'s `members`, read without a parser when they are
/// written as providers write them: `"name":null` or `"name":"text"`,
/// names and texts without escapes or control characters, `,` between
/// them and `}` last, no whitespace. Whether the chunk is light (`usage`
/// at most once and null, no `choices` or `error`, as [`ChunkSeed`] reads
/// them), or `None` for anything else, which the parser reads.
fn plain_members(members: &[u8]) -> Option<bool> {
    /// The end of the string whose contents begin at `start`: its closing
    /// quote, when it holds no escape and no control character.
    fn plain_string_end(json: &[u8], start: usize) -> Option<usize> {
        let len = json
            .get(start..)?
            .iter()
            .position(|&byte| matches!(byte, b'"' | b'\\') || byte < 0x20)?;
        (json[start + len] == b'"').then_some(start + len)
    }
    let mut usage = false;
    let mut at = 0;
    loop {
        if *members.get(at)? != b'"' {
            return None;
        }
        let name_end = plain_string_end(members, at + 1)?;
        let name = &members[at + 1..name_end];
        at = name_end + 1;
        if *members.get(at)? != b':' {
            return None;
        }
        at += 1;
        let null = members[at..].starts_with(b"null");
        at = if null {
            at + 4
        } else if *members.get(at)? == b'"' {
            plain_string_end(members, at + 1)? + 1
        } else {
            return None;
        };
        match name {
            b"choices" | b"error" => return Some(false),
            b"usage" if usage || !null => return Some(false),
            b"usage" => usage = true,
            _ => {}
        }
        match members.get(at)? {
            b',' => at += 1,
            b'}' => return (at + 1 == members.len()).then_some(true),
            _ => return None,
        }
    }
}

/// Where the top-level `choices` member of `chunk` (valid JSON) begins,
/// when everything before it is `{` and whole members that the reading
/// skips, each followed by a comma, with nothing between the first `{` and
/// the first member nor between the last comma and `"choices"`: a prefix
/// [`read_in_stream`] may leave out. A member name with an escape is not
/// looked into, and a prefix that holds a canary-shaped span is never left
/// out (the tree's reading scans it): there is no prefix then.
fn skipped_prefix(chunk: &str) -> Option<usize> {
    let end = chunk.find(CHOICES_KEY)?;
    if find_canaries(&chunk[..end]).next().is_some() {
        return None;
    }
    let head = &chunk.as_bytes()[..end];
    if head.first() != Some(&b'{') || head.last() != Some(&b',') {
        return None;
    }
    // Depth below the chunk's own object, and whether a top-level member
    // name comes next.
    let (mut depth, mut name_next, mut at) = (0usize, true, 1);
    while at < head.len() {
        match head[at] {
            b'"' => {
                let start = at + 1;
                let close = string_end(head, start)?;
                if depth == 0 && name_next {
                    let name = &head[start..close];
                    if name.contains(&b'\\') || matches!(name, b"choices" | b"usage" | b"error") {
                        return None;
                    }
                    name_next = false;
                }
                at = close + 1;
            }
            b'{' | b'[' => {
                depth += 1;
                at += 1;
            }
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                at += 1;
            }
            b',' if depth == 0 => {
                name_next = true;
                at += 1;
            }
            _ => at += 1,
        }
    }
    (depth == 0 && name_next).then_some(end)
}

/// The chunk in `json`, when it is light, its text's place counted
/// `shift` bytes further on: `json` is the event's data with that many
/// bytes after its `{` left out ([`read_in_stream`]).
fn read_shifted(json: &str, shift: usize) -> Option<Chunk> {
    let mut choices = LightChoices::default();
    let mut parser = serde_json::Deserializer::from_str(json);
    ChunkSeed(&mut choices, Members::default())
        .deserialize(&mut parser)
        .ok()?;
    parser.end().ok()?;
    let text = choices.text.map(|text| match text.in_data(json) {
        LightText::InData(range) => LightText::InData(range.start + shift..range.end + shift),
        unescaped => unescaped,
    });
    Some(Chunk::light(
        choices.views,
        text,
        choices.keeps_other_fields,
    ))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::Value;

    use super::super::json_text::{Node, Style, arrange, skipped_members, text, usage};
    use super::*;

    /// The tree's reading of `data`, as Chat's `read_event` does it.
    fn tree(data: &str) -> Chunk {
        let value: Value = serde_json::from_str(data).unwrap();
        let choices = super::super::answer::read_choices(&value, Key::Delta);
        Chunk::parsed(value, choices, None)
    }

    /// Asserts that `data` is light and read as the tree reads it.
    fn same_as_tree(data: &str) {
        let light = read(data).unwrap_or_else(|| panic!("not light: {data}"));
        reads_as_tree(&light, data);
    }

    /// Asserts that `light`, the in-place reading of `data`, is what the
    /// tree's reading gives.
    fn reads_as_tree(light: &Chunk, data: &str) {
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
            // An escaped member name, a null role, whitespace around.
            r#" {"choices":[{"index":0,"delta":{"role":null,"cont\u0065nt":"a b"},"finish_reason":"length"}]} "#,
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
            // A member twice (the tree keeps the last), something after the
            // chunk.
            r#"{"choices":[{"index":0,"index":1,"delta":{"content":"a"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a","content":"b"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","role":"assistant"}}]}"#,
            r#"{"choices":[],"choices":[{"index":0,"delta":{"content":"a"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"}}]} {}"#,
            // A provider's own member holding a canary-shaped span (the
            // tree's residual scan reads it), before or after `choices`.
            r#"{"citations":["https://x.test/CG123456789012345"],"choices":[{"index":0,"delta":{"content":"a"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"}}],"search_results":[{"snippet":"cg 123456789012345"}]}"#,
        ] {
            assert!(read(data).is_none(), "light: {data}");
        }
    }

    /// Another request's canary in a chunk's metadata (`id`, `model`,
    /// `obfuscation`), its delta's `role`, or a member after `choices`,
    /// read in place or through a frame, is not light: the tree reads it as
    /// text, as SDKs show it.
    #[test]
    fn canary_text_in_metadata_role_and_later_members_is_the_trees() {
        let canary = "CG123456789012345";
        for data in [
            format!(r#"{{"id":"{canary}","choices":[{{"index":0,"delta":{{"content":"a"}}}}]}}"#),
            format!(
                r#"{{"model":"m {canary}","choices":[{{"index":0,"delta":{{"content":"a"}}}}]}}"#
            ),
            format!(r#"{{"choices":[{{"index":0,"delta":{{"role":"assistant {canary}"}}}}]}}"#),
            format!(
                r#"{{"choices":[{{"index":0,"delta":{{"content":"a"}}}}],"obfuscation":"{canary}"}}"#
            ),
        ] {
            assert!(read(&data).is_none(), "light: {data}");
            let tree = tree(&data);
            let texts: Vec<&str> = tree
                .texts()
                .map(|field| tree.with_data(&data).text(field))
                .collect();
            assert!(
                texts.iter().any(|text| text.contains(canary)),
                "{data}: {texts:?}"
            );
        }
        // After a chunk that taught the stream its frame, a later one whose
        // members after `choices` hold a canary is still read from its tree.
        let first =
            r#"{"id":"c1","choices":[{"index":0,"delta":{"content":"a"}}],"obfuscation":"xyz"}"#;
        let later = format!(
            r#"{{"id":"c1","choices":[{{"index":0,"delta":{{"content":"b"}}}}],"obfuscation":"{canary}"}}"#
        );
        let mut memo = StreamMemo::default();
        read_in_stream(first, &mut memo).expect("light");
        read_in_stream(first, &mut memo).expect("light");
        assert!(read_in_stream(&later, &mut memo).is_none(), "{later}");
    }

    #[test]
    fn a_providers_own_member_without_a_canary_is_skipped() {
        same_as_tree(
            r#"{"id":"c1","provider":"OpenAI","citations":["https://x.test/a"],"choices":[{"index":0,"delta":{"content":"a"}}]}"#,
        );
        // With a canary-shaped span, the tree reads it as text.
        let data = r#"{"citations":["https://x.test/CG123456789012345"],"choices":[{"index":0,"delta":{"content":"a"}}]}"#;
        let tree = tree(data);
        let texts: Vec<&str> = tree
            .texts()
            .map(|field| tree.with_data(data).text(field))
            .collect();
        assert_eq!(texts, ["a", "https://x.test/CG123456789012345"]);
    }

    /// A delta, and whether an in-place reading takes it.
    fn delta() -> impl Strategy<Value = (Node, bool)> {
        const TEXTS: [&str; 4] = ["content", "refusal", "reasoning_content", "reasoning"];
        // Mostly one text, as streams carry them; now and then none, or two
        // (not light: a light chunk carries at most one).
        let texts = prop_oneof![
            6 => (0..4usize, text()).prop_map(|(n, text)| vec![(TEXTS[n], Node::Str(text))]),
            1 => Just(vec![]),
            1 => (text(), text()).prop_map(|(a, b)| vec![(TEXTS[0], Node::Str(a)), (TEXTS[2], Node::Str(b))]),
        ];
        let nulls = proptest::sample::subsequence(TEXTS.to_vec(), 0..=2);
        let role =
            proptest::option::of(prop_oneof![Just(Node::str("assistant")), Just(Node::Null)]);
        let arguments = |arguments: Node| {
            Node::Array(vec![Node::Object(vec![
                ("index", Node::number("0")),
                ("function", Node::Object(vec![("arguments", arguments)])),
            ])])
        };
        let call = prop_oneof![
            8 => Just((None, true)),
            1 => Just((Some(("tool_calls", Node::Null)), true)),
            1 => Just((Some(("function_call", Node::Null)), true)),
            2 => text().prop_map(move |piece| (Some(("tool_calls", arguments(Node::Str(piece)))), true)),
            1 => Just((Some(("tool_calls", Node::Array(vec![Node::Object(vec![
                ("index", Node::number("0")),
                ("id", Node::str("call_1")),
                ("function", Node::Object(vec![("name", Node::str("f"))])),
            ])]))), false)),
            1 => Just((Some(("audio", Node::Object(vec![("transcript", Node::str("t"))]))), false)),
        ];
        (texts, nulls, role, call).prop_flat_map(|(texts, nulls, role, (call, call_takes))| {
            let strings =
                texts.len() + usize::from(matches!(&call, Some(("tool_calls", Node::Array(_)))));
            let mut members = texts;
            for name in nulls {
                if members.iter().all(|(taken, _)| *taken != name) {
                    members.push((name, Node::Null));
                }
            }
            members.extend(role.map(|role| ("role", role)));
            members.extend(call);
            // A light chunk carries at most one text.
            let takes = call_takes && strings <= 1;
            arrange(members)
                .prop_map(move |(members, twice)| (Node::Object(members), takes && !twice))
        })
    }

    /// A choice of a chunk, and whether an in-place reading takes it.
    fn chunk_choice() -> impl Strategy<Value = (Node, bool)> {
        let index = prop_oneof![
            8 => Just((Some(Node::number("0")), true)),
            2 => Just((None, true)),
            1 => Just((Some(Node::number("-1")), false)),
        ];
        let finish_reason = prop_oneof![
            6 => Just((Some(Node::Null), true)),
            2 => Just((Some(Node::str("stop")), true)),
            2 => Just((None, true)),
            1 => Just((Some(Node::number("7")), false)),
        ];
        let logprobs = prop_oneof![
            5 => Just((None, true)),
            5 => Just((Some(Node::Null), true)),
            1 => Just((Some(Node::Object(vec![("content", Node::Array(vec![]))])), false)),
        ];
        (index, delta(), finish_reason, logprobs).prop_flat_map(
            |(index, delta, finish_reason, logprobs)| {
                let takes = index.1 && delta.1 && finish_reason.1 && logprobs.1;
                let members: Vec<(&'static str, Node)> = [
                    ("index", index.0),
                    ("delta", Some(delta.0)),
                    ("finish_reason", finish_reason.0),
                    ("logprobs", logprobs.0),
                ]
                .into_iter()
                .filter_map(|(name, value)| Some((name, value?)))
                .collect();
                arrange(members)
                    .prop_map(move |(members, twice)| (Node::Object(members), takes && !twice))
            },
        )
    }

    /// A chunk's data as JSON text, and whether an in-place reading takes it.
    fn chunk_text() -> impl Strategy<Value = (String, bool)> {
        let choices = prop_oneof![
            1 => Just(vec![]),
            6 => chunk_choice().prop_map(|choice| vec![choice]),
            // Two choices: light when at most one carries text.
            1 => proptest::collection::vec(chunk_choice(), 2..3)
                .prop_map(|choices| choices.into_iter().map(|(choice, _)| (choice, false)).collect()),
        ];
        // Usage comes in a chunk of its own, without choices (not light);
        // null or absent on the others.
        let usage = prop_oneof![
            6 => Just(None),
            2 => Just(Some((Node::Null, true))),
            1 => usage().prop_map(|usage| usage.map(|(usage, _)| { let null = matches!(usage, Node::Null); (usage, null) })),
        ];
        (
            skipped_members(),
            choices,
            usage,
            0..12usize,
            any::<(bool, bool)>(),
        )
            .prop_flat_map(|(mut members, choices, usage, after, (spaced, escaped))| {
                let takes = choices.iter().all(|choice| choice.1)
                    && usage.as_ref().is_none_or(|usage| usage.1)
                    && after > 0;
                members.push((
                    "choices",
                    Node::Array(choices.into_iter().map(|c| c.0).collect()),
                ));
                members.extend(usage.map(|usage| ("usage", usage.0)));
                arrange(members).prop_map(move |(members, twice)| {
                    let mut text = Node::Object(members).render(Style { spaced, escaped });
                    if after == 0 {
                        text.push_str(" {}");
                    }
                    (text, takes && !twice)
                })
            })
    }

    /// Asserts that `data`, read after the chunks `before` of its stream,
    /// reads as it does on its own; returns what the memo kept.
    fn read_after(before: &[&str], data: &str) -> String {
        let mut memo = StreamMemo::default();
        for earlier in before {
            read_in_stream(earlier, &mut memo);
        }
        let kept = memo.skipped_prefix.clone();
        match read_in_stream(data, &mut memo) {
            Some(light) => {
                assert!(read(data).is_some(), "read in place only after: {data}");
                reads_as_tree(&light, data);
            }
            None => assert!(read(data).is_none(), "not read in place after: {data}"),
        }
        kept
    }

    #[test]
    fn a_stream_s_chunks_are_read_from_after_the_prefix_they_share() {
        let prefix = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","service_tier":"default","system_fingerprint":"fp",""#;
        let first = format!(
            r#"{prefix}choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"finish_reason":null}}]}}"#
        );
        let kept = read_after(&[], &first);
        assert_eq!(kept, "");
        for next in [
            r#"choices":[{"index":0,"delta":{"content":" Hello \"you\""},"finish_reason":null}],"usage":null,"obfuscation":"ab"}"#,
            r#"choices":[{"index":0,"delta":{"content":"caf\u00e9"},"finish_reason":null}]}"#,
            r#"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            // What is not read in place after it is not read in place.
            r#"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","function":{"name":"f"}}]}}]}"#,
            r#"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#,
            r#"choices":[],"choices":[]}"#,
            r#"choices":[]} {}"#,
            r#"choices":[}"#,
            r#"choices":"#,
        ] {
            let data = format!("{prefix}{next}");
            let kept = read_after(&[&first], &data);
            assert_eq!(kept, &prefix[..prefix.len() - 1], "{data}");
        }
        // Another answer's chunk, or one whose prefix differs anywhere, is
        // read whole.
        let other = first.replace("chatcmpl-1", "chatcmpl-2");
        assert_eq!(read_after(&[&first], &other), &prefix[..prefix.len() - 1]);
        let text = r#"{"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"a"}}]}"#;
        read_after(&[&first], text);
    }

    #[test]
    fn a_prefix_is_kept_only_when_it_holds_whole_members_that_are_skipped() {
        let choices = r#""choices":[{"index":0,"delta":{"content":"a"}}]}"#;
        for (head, kept) in [
            (r#"{"id":"a","#, true),
            // Strings with escapes, `"choices":` in a string, nesting.
            (r#"{"x":"a\"b\\","id":"c","#, true),
            (r#"{"x":"\"choices\":","#, true),
            (r#"{"x":[{"y":"}"}],"z":null,"#, true),
            // A member the reading looks at, or one whose name it cannot
            // tell without unescaping it.
            (r#"{"usage":null,"#, false),
            (r#"{"\u0075sage":null,"#, false),
            (r#"{"\u0069d":"a","#, false),
            // `"choices":` inside a skipped member comes first.
            (r#"{"x":{"choices":1},"#, false),
            // Whitespace before the member, or around its comma.
            (r#"{"id":"a" ,"#, true),
            (r#"{"id":"a", "#, false),
            (r#" {"id":"a","#, false),
        ] {
            let data = format!("{head}{choices}");
            assert!(read(&data).is_some(), "{data}");
            let mut memo = StreamMemo::default();
            read_in_stream(&data, &mut memo);
            let expected = if kept { head } else { "" };
            assert_eq!(memo.skipped_prefix, expected, "{data}");
            read_after(&[&data], &data);
        }
        // A member that holds a canary-shaped span is never left out: the
        // chunk is read from its tree, every time.
        let head = r#"{"id":"a","provider":"cG-123456789012345","#;
        let data = format!("{head}{choices}");
        assert!(read(&data).is_none(), "{data}");
        assert_eq!(skipped_prefix(&data), None, "{data}");
        let without = r#"{"id":"a","provider":"OpenAI","#;
        assert_eq!(
            skipped_prefix(&format!("{without}{choices}")),
            Some(without.len())
        );
    }

    #[test]
    fn a_provider_whose_chunks_never_begin_alike_is_searched_a_few_times() {
        let mut memo = StreamMemo::default();
        for n in 0..10 {
            let data =
                format!(r#"{{"id":"{n}","choices":[{{"index":0,"delta":{{"content":"a"}}}}]}}"#);
            assert!(read_in_stream(&data, &mut memo).is_some());
        }
        assert_eq!(memo.prefix_searches, PREFIX_SEARCHES);
    }

    #[test]
    fn a_stream_s_chunks_are_read_through_the_frame_around_their_text() {
        let chunk = |delta: &str, tail: &str| {
            format!(
                r#"{{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp","choices":[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":null}}]{tail}"#
            )
        };
        let first = chunk(
            r#"{"role":"assistant","content":""}"#,
            r#","usage":null,"obfuscation":"a"}"#,
        );
        let second = chunk(
            r#"{"content":"Hello"}"#,
            r#","usage":null,"obfuscation":"xY3"}"#,
        );
        let mut memo = StreamMemo::default();
        for data in [&first, &second] {
            read_in_stream(data, &mut memo).unwrap();
        }
        let frame = memo.text_frame.as_ref().expect("a frame learnt");
        assert!(
            frame.before.ends_with(r#""delta":{"content":""#),
            "{frame:?}"
        );
        assert_eq!(frame.after, r#""},"logprobs":null,"finish_reason":null}]"#);
        // Read through the frame, and as the tree reads them.
        for (delta, tail) in [
            (
                r#"{"content":" world, café"}"#,
                r#","usage":null,"obfuscation":"q"}"#,
            ),
            (
                r#"{"content":" again"}"#,
                r#","obfuscation":"abcdefghijklmno","usage":null}"#,
            ),
            (r#"{"content":""}"#, "}"),
            (r#"{"content":"é😀  /"}"#, "} \n"),
            (
                r#"{"content":"CG482937105662831"}"#,
                r#","id":"again","usage":null}"#,
            ),
        ] {
            let data = chunk(delta, tail);
            let mut scratch = String::new();
            let framed = read_framed(frame, &data, &mut scratch)
                .unwrap_or_else(|| panic!("not read through the frame: {data}"));
            reads_as_tree(&framed, &data);
            read_after(&[&first, &second], &data);
        }
        // Not read through the frame; read as they are alone, in place or
        // not.
        for (delta, tail) in [
            // An escape, or a control character no JSON string holds raw.
            (r#"{"content":"say \"hi\""}"#, "}"),
            (r#"{"content":"a\nb"}"#, "}"),
            ("{\"content\":\"a\u{1}b\"}", "}"),
            // Another member, or another delta.
            (r#"{"refusal":"no"}"#, "}"),
            (r#"{"content":"a","role":"assistant"}"#, "}"),
            // After `choices`: usage, `choices` again, an error, a trailing
            // comma, bytes after the chunk, an unclosed chunk.
            (
                r#"{"content":"a"}"#,
                r#","usage":{"prompt_tokens":1,"completion_tokens":1}}"#,
            ),
            (r#"{"content":"a"}"#, r#","usage":null,"usage":null}"#),
            (r#"{"content":"a"}"#, r#","choices":[]}"#),
            (r#"{"content":"a"}"#, r#","error":null}"#),
            (r#"{"content":"a"}"#, ",}"),
            (r#"{"content":"a"}"#, "} {}"),
            (r#"{"content":"a"}"#, ""),
            (r#"{"content":"a"}"#, r#","usage":null"#),
            (r#"{"content":"a"}"#, " }"),
        ] {
            let data = chunk(delta, tail);
            let mut scratch = String::new();
            assert!(
                read_framed(frame, &data, &mut scratch).is_none(),
                "read through the frame: {data}"
            );
            read_after(&[&first, &second], &data);
        }
    }

    #[test]
    fn the_members_after_choices_are_read_without_a_parser_when_plainly_written() {
        for (members, plain) in [
            (r#""usage":null,"obfuscation":"xY3"}"#, Some(true)),
            (r#""obfuscation":"","usage":null}"#, Some(true)),
            (r#""id":"a","x":null}"#, Some(true)),
            (r#""usage":null,"usage":null}"#, Some(false)),
            (r#""usage":"a"}"#, Some(false)),
            (r#""choices":null}"#, Some(false)),
            (r#""error":null}"#, Some(false)),
            // For the parser: numbers, objects, escapes, whitespace,
            // anything after the chunk or nothing to close it.
            (r#""x":1}"#, None),
            (r#""usage":{"prompt_tokens":1}}"#, None),
            (r#""\u0075sage":null}"#, None),
            (r#""x":"a\"b"}"#, None),
            (r#""x":nullx}"#, None),
            (r#""x":null }"#, None),
            (r#""x":null} "#, None),
            (r#""x":null"#, None),
            ("\"x\":\"a\u{1}\"}", None),
            ("}", None),
        ] {
            assert_eq!(plain_members(members.as_bytes()), plain, "{members}");
            let mut scratch = String::new();
            let parsed = {
                scratch.push('{');
                scratch.push_str(members);
                let mut parser = serde_json::Deserializer::from_str(&scratch);
                let mut read = Members::default();
                read.first::<serde_json::Error>(CHOICES).unwrap();
                ChunkSeed(&mut LightChoices::default(), read)
                    .deserialize(&mut parser)
                    .is_ok()
                    && parser.end().is_ok()
            };
            if let Some(light) = plain {
                assert_eq!(light, parsed, "the parser reads {members} otherwise");
            }
            // A comma and then `}` is no JSON, though `{}` is.
            let light = parsed && members.starts_with('"');
            assert_eq!(
                after_choices(&format!(",{members}"), &mut String::new()).is_some(),
                light,
                "{members}"
            );
        }
    }

    #[test]
    fn a_frame_is_learnt_only_around_an_unescaped_text_after_skipped_members() {
        for (data, learnt) in [
            (
                r#"{"id":"a","choices":[{"index":0,"delta":{"content":"a"}}]}"#,
                true,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"content":"a"}}],"usage":null}"#,
                true,
            ),
            (
                r#"{"x":[{"y":"]"}],"choices":[{"delta":{"content":"a"},"finish_reason":null}]}"#,
                true,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}"#,
                true,
            ),
            (
                r#"{"id":"a","choices":[{"index":0,"delta":{"content":"a\"b"}}]}"#,
                false,
            ),
            (
                r#"{"usage":null,"choices":[{"index":0,"delta":{"content":"a"}}]}"#,
                false,
            ),
            (r#"{"id":"a","choices":[{"index":0,"delta":{}}]}"#, false),
            (
                r#"{"id":"a" , "choices":[{"index":0,"delta":{"content":"a"}}]}"#,
                false,
            ),
        ] {
            let mut memo = StreamMemo::default();
            read_in_stream(data, &mut memo).unwrap();
            assert_eq!(memo.text_frame.is_some(), learnt, "{data}");
            read_after(&[data], data);
        }
    }

    #[test]
    fn a_provider_whose_chunks_never_repeat_their_frame_is_learnt_from_a_few_times() {
        let mut memo = StreamMemo::default();
        for n in 0..10 {
            let data =
                format!(r#"{{"id":"a","choices":[{{"index":{n},"delta":{{"content":"a"}}}}]}}"#);
            assert!(read_in_stream(&data, &mut memo).is_some());
        }
        assert_eq!(memo.frames_learnt, FRAME_LEARNS);
    }

    /// `node` with the string of every text member (content, refusal,
    /// reasoning, a call's arguments) set to `text`.
    fn retext(node: &Node, text: &str) -> Node {
        const TEXTS: [&str; 5] = [
            "content",
            "refusal",
            "reasoning_content",
            "reasoning",
            "arguments",
        ];
        match node {
            Node::Object(members) => Node::Object(
                members
                    .iter()
                    .map(|(name, value)| match value {
                        Node::Str(_) if TEXTS.contains(name) => (*name, Node::str(text)),
                        value => (*name, retext(value, text)),
                    })
                    .collect(),
            ),
            Node::Array(items) => {
                Node::Array(items.iter().map(|item| retext(item, text)).collect())
            }
            other => other.clone(),
        }
    }

    /// Two chunks of one stream alike but for their text and the members
    /// after `choices` (`usage: null`, OpenAI's `obfuscation` padding, in
    /// either order, or none): the second is read through the frame of the
    /// first when the first's can be learnt.
    fn framed_pair() -> impl Strategy<Value = (String, String)> {
        let tail = || {
            (
                proptest::option::of(Just(Node::Null)),
                proptest::option::of("[a-zA-Z0-9]{1,15}"),
                any::<bool>(),
            )
        };
        (
            skipped_members().prop_shuffle(),
            chunk_choice(),
            text(),
            tail(),
            tail(),
            any::<(bool, bool)>(),
        )
            .prop_map(|(skipped, (choice, _), text, first, second, (spaced, escaped))| {
                let render = |choice: Node, (usage, padding, swap): (Option<Node>, Option<String>, bool)| {
                    let mut members = skipped.clone();
                    members.push(("choices", Node::Array(vec![choice])));
                    let mut after: Vec<(&'static str, Node)> = Vec::new();
                    after.extend(usage.map(|usage| ("usage", usage)));
                    after.extend(padding.map(|padding| ("obfuscation", Node::Str(padding))));
                    if swap {
                        after.reverse();
                    }
                    members.extend(after);
                    Node::Object(members).render(Style { spaced, escaped })
                };
                let other = retext(&choice, &text);
                (render(choice, first), render(other, second))
            })
    }

    /// Two chunks of one stream: the members the reading skips, written
    /// alike before `choices` in both, then each chunk's own choices and
    /// usage; and whether the first one's prefix can be kept.
    fn chunk_pair() -> impl Strategy<Value = (String, String, bool)> {
        let rest = || {
            let choices = prop_oneof![
                1 => Just(vec![]),
                6 => chunk_choice().prop_map(|(choice, _)| vec![choice]),
                1 => proptest::collection::vec(chunk_choice(), 2..3)
                    .prop_map(|choices| choices.into_iter().map(|(choice, _)| choice).collect()),
            ];
            let usage = prop_oneof![
                3 => Just(None),
                1 => Just(Some(Node::Null)),
                1 => usage().prop_map(|usage| usage.map(|(usage, _)| usage)),
            ];
            (choices, usage)
        };
        (
            skipped_members().prop_shuffle(),
            rest(),
            rest(),
            any::<(bool, bool)>(),
        )
            .prop_map(|(skipped, first, second, (spaced, escaped))| {
                let render = |(choices, usage): (Vec<Node>, Option<Node>)| {
                    let mut members = skipped.clone();
                    members.push(("choices", Node::Array(choices)));
                    members.extend(usage.map(|usage| ("usage", usage)));
                    Node::Object(members).render(Style { spaced, escaped })
                };
                let keeps = !skipped.is_empty() && !spaced && !escaped;
                (render(first), render(second), keeps)
            })
    }

    proptest! {
        /// Whatever the provider writes, a chunk read in place reads as its
        /// tree reads it, and every chunk of the shapes the reading takes
        /// is read in place.
        #[test]
        fn any_chunk_read_in_place_reads_as_its_tree((data, takes) in chunk_text()) {
            match read(&data) {
                Some(light) => reads_as_tree(&light, &data),
                None => prop_assert!(!takes, "not read in place: {data}"),
            }
        }

        /// A chunk read after another of its stream, from after the prefix
        /// they share, reads as it does alone, and as its tree reads it.
        #[test]
        fn a_chunk_read_after_the_prefix_it_shares_reads_as_it_does_alone(
            (first, second, keeps) in chunk_pair()
        ) {
            let kept = read_after(&[&first], &second);
            if keeps && read(&first).is_some() {
                prop_assert!(!kept.is_empty(), "no prefix kept of {}", first);
            }
            read_after(&[&second], &second);
        }

        /// A chunk read through the frame learnt from another of its
        /// stream reads as it does alone, and as its tree reads it.
        #[test]
        fn a_chunk_read_through_a_frame_reads_as_it_does_alone((first, second) in framed_pair()) {
            read_after(&[&first], &second);
            read_after(&[&first, &second], &first);
        }
    }
}
