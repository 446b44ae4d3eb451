//! Where text sits in a Chat Completions answer or stream chunk: each
//! choice's reasoning, content, refusal, tool-call and function-call
//! arguments with their location, its finish reason, and the answer's usage.

use canarygate_policies::canary::find_canaries;
use canarygate_policies::verify::{Part, ProviderUsage};
use serde_json::Value;

use super::joined::{self, joined_strings, path_step};
use crate::wire::format::{ChoiceView, Choices, TextField, TextFields, canary_shaped_names};
use crate::wire::location::{Key, Location};

/// `usage` of an answer or chunk, when it reports prompt tokens (with the
/// cached ones, [`ProviderUsage::from_usage`]).
pub fn usage_of(value: &Value) -> Option<ProviderUsage> {
    ProviderUsage::from_usage(value.get("usage")?)
}

/// The `index` field of a choice or tool call, else its position.
pub fn index_of(item: &Value, position: usize) -> u32 {
    item.get("index")
        .and_then(Value::as_u64)
        .unwrap_or(position as u64)
        .min(u64::from(u32::MAX)) as u32
}

/// The text fields of a message or delta that are model output, in the
/// order a model writes them, with the part each belongs to. Reasoning:
/// `reasoning_content` (DeepSeek, vLLM, SGLang, GLM, Qwen) and `reasoning`
/// (OpenRouter, newer vLLM; [`Part::ReasoningAlias`] when both are there).
const TEXT_FIELDS: [(Key, Part); 4] = [
    (Key::ReasoningContent, Part::Reasoning),
    (Key::Reasoning, Part::Reasoning),
    (Key::Content, Part::Content),
    (Key::Refusal, Part::Refusal),
];

/// Pushes onto `texts` every string under `value` (at `at`, reached by
/// member `key`) that holds a canary-shaped span, as a [`Part::Other`]
/// field, except tool and function arguments (their own parts). Strings
/// nested deeper than a [`Location`] reaches are not looked at: no provider
/// nests model output that deep.
fn residual_strings(value: &Value, at: Location, choice: u32, key: &str, texts: &mut TextFields) {
    match value {
        Value::String(text) if key != "arguments" && find_canaries(text).next().is_some() => {
            let n = texts.len() as u32;
            texts.push(TextField {
                choice,
                kind: Part::Other(n),
                at,
            });
        }
        Value::Array(items) if at.has_room() => {
            for (position, item) in items.iter().enumerate() {
                residual_strings(item, at.index(position), choice, key, texts);
            }
        }
        Value::Object(members) if at.has_room() => {
            for (position, (member, inner)) in members.iter().enumerate() {
                residual_strings(inner, at.member(position), choice, member, texts);
            }
        }
        _ => {}
    }
}

/// Pushes onto `texts`, as read-only [`Part::Other`] fields of choice
/// `choice` ([`Location::read_only`]), every string under `value` (at `at`)
/// that holds a canary-shaped span: for logprobs, whose tokens follow the
/// text they spell (another request's canary there fails the answer; the
/// delivery moves them with the text, never writes them).
pub fn read_only_strings(value: &Value, at: Location, choice: u32, texts: &mut TextFields) {
    residual_strings(value, at.read_only(), choice, "", texts);
}

/// Pushes onto `texts`, as [`Part::Other`] fields of choice `choice`, every
/// string under the members of `object` (at `at`) that holds a canary-shaped
/// span, except under the members `known` says are read as their own parts
/// (and tool or function arguments, always their own parts).
pub fn residual_members(
    object: &Value,
    at: Location,
    choice: u32,
    known: impl Fn(&str) -> bool,
    texts: &mut TextFields,
) {
    let Some(members) = object.as_object() else {
        return;
    };
    for (position, (key, value)) in members.iter().enumerate() {
        if !known(key) {
            residual_strings(value, at.member(position), choice, key, texts);
        }
    }
}

/// Whether every `index` of a chunk's choices and of their tool calls that
/// is there is a count. SDKs place a piece by it (Node's accumulator at
/// `choices[index]`, where `-1` or `0.5` is a property no final answer
/// shows, and `"1"` is 1): canarygate, which reads a choice by its
/// position when it has no count, would join pieces the SDK keeps apart.
pub fn indexes_are_counts(chunk: &Value) -> bool {
    let counted = |item: &Value| {
        item.get("index")
            .is_none_or(|index| index.as_u64().is_some())
    };
    chunk
        .get("choices")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .all(|choice| {
            let calls = choice
                .get("delta")
                .and_then(|delta| delta.get("tool_calls"))
                .and_then(Value::as_array);
            counted(choice) && calls.into_iter().flatten().all(counted)
        })
}

/// Every choice of `value`'s `choices` (none when it is not an array),
/// each read by [`read_choice`] with its text under `part`.
pub fn read_choices(value: &Value, part: Key) -> Choices {
    map_choices(value, |choice, position| {
        read_choice(choice, position, part)
    })
}

/// Every choice of `value`'s `choices` (none when it is not an array), each
/// read by `read` from the choice and its position in the array, and the
/// strings of the answer's other members that hold a canary-shaped span
/// ([`top_level_texts`]) as texts of the first choice.
pub fn map_choices(value: &Value, read: impl Fn(&Value, usize) -> ChoiceView) -> Choices {
    let mut choices: Choices = value
        .get("choices")
        .and_then(Value::as_array)
        .map(|choices| {
            choices
                .iter()
                .enumerate()
                .map(|(position, choice)| read(choice, position))
                .collect()
        })
        .unwrap_or_default();
    let first = choices.first().map_or(0, |choice| choice.index);
    let texts = top_level_texts(value, first);
    if !texts.is_empty() {
        match choices.first_mut() {
            // Numbered after the choice's own: each other string its own.
            Some(choice) => {
                for field in texts {
                    let n = choice.texts.len() as u32;
                    choice.texts.push(TextField {
                        kind: Part::Other(n),
                        ..field
                    });
                }
            }
            // No choice to carry them: one that is not in the array.
            None => choices.push(ChoiceView {
                index: 0,
                position: usize::MAX,
                texts,
                finish_reason: None,
            }),
        }
    }
    choices
}

/// The strings under an answer's (or chunk's) members other than
/// `choices` and `error` (its metadata, `id` and `model` among them, its
/// usage, and a provider's own: Perplexity's `citations` and
/// `search_results`) that hold a canary-shaped span, as [`Part::Other`]
/// fields of choice `choice`: another request's canary there fails the
/// answer, and canarygate's own is removed. And every member name of the
/// answer, `choices` included, that holds one ([`canary_shaped_names`]).
pub fn top_level_texts(value: &Value, choice: u32) -> TextFields {
    let mut texts = TextFields::new();
    let known = |key: &str| matches!(key, "choices" | "error");
    residual_members(value, Location::ROOT, choice, known, &mut texts);
    canary_shaped_names(value, Location::ROOT, choice, &mut texts);
    texts
}

/// Pushes onto `texts` the text of each entry of OpenRouter's
/// `reasoning_details` (at `at`) of choice `choice`: a `reasoning.text`'s
/// `text` or a `reasoning.summary`'s `summary`, as the entry's
/// [`Part::ReasoningDetail`] (numbered by its `index`, which a stream's
/// pieces of one entry share, else its position), and any other string of
/// an entry that holds a canary-shaped span, as other text.
fn reasoning_details(details: &Value, at: Location, choice: u32, texts: &mut TextFields) {
    let Some(entries) = details.as_array() else {
        return;
    };
    for (position, entry) in entries.iter().enumerate() {
        let entry_at = at.index(position);
        let number = entry
            .get("index")
            .and_then(Value::as_u64)
            .and_then(|index| u32::try_from(index).ok())
            .unwrap_or(position as u32);
        let text = ["text", "summary"]
            .into_iter()
            .find(|key| entry.get(*key).is_some_and(Value::is_string));
        if let Some(key) = text
            && let Some((text_at, _)) = entry_at.named(entry, key)
        {
            texts.push(TextField {
                choice,
                kind: Part::ReasoningDetail(number),
                at: text_at,
            });
        }
        residual_members(
            entry,
            entry_at,
            choice,
            |member| Some(member) == text,
            texts,
        );
    }
}

/// Choice `position` of an answer (`part` = `message`) or chunk (`delta`).
pub fn read_choice(choice: &Value, position: usize, part: Key) -> ChoiceView {
    let index = index_of(choice, position);
    let mut texts = TextFields::new();
    let message = &choice[part.name()];
    let at = Location::ROOT.key(Key::Choices).index(position).key(part);
    let both_reasonings = message
        .get("reasoning_content")
        .is_some_and(Value::is_string);
    for (field, kind) in &TEXT_FIELDS {
        let mut kind = *kind;
        if message.get(field.name()).is_some_and(Value::is_string) {
            if *field == Key::Reasoning && both_reasonings {
                kind = Part::ReasoningAlias;
            }
            texts.push(TextField {
                choice: index,
                kind,
                at: at.key(*field),
            });
        }
    }
    if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
        for (call_position, call) in calls.iter().enumerate() {
            // Whole answers list calls in order; stream deltas name theirs.
            let call_index = match part {
                Key::Delta => index_of(call, call_position),
                _ => call_position as u32,
            };
            let arguments = call
                .get("function")
                .and_then(|function| function.get("arguments"));
            if arguments.is_some_and(Value::is_string) {
                texts.push(TextField {
                    choice: index,
                    kind: Part::ToolArguments(call_index),
                    at: at
                        .key(Key::ToolCalls)
                        .index(call_position)
                        .key(Key::Function)
                        .key(Key::Arguments),
                });
            }
        }
    }
    if message
        .get("function_call")
        .and_then(|call| call.get("arguments"))
        .is_some_and(Value::is_string)
    {
        texts.push(TextField {
            choice: index,
            kind: Part::FunctionArguments,
            at: at.key(Key::FunctionCall).key(Key::Arguments),
        });
    }
    // Canary text may turn up anywhere the provider puts model output or the
    // prompt: any other string of the message that holds a canary-shaped span
    // is verified too.
    // A spoken reply's transcript, which a stream sends in pieces: a text
    // of its own, so that its pieces join across chunks as a content's do;
    // the audio's other strings (its id) are scanned as any other.
    let audio = at.named(message, "audio");
    let transcript = audio
        .and_then(|(audio_at, audio)| audio_at.named(audio, "transcript"))
        .filter(|(_, transcript)| transcript.is_string())
        .map(|(transcript_at, _)| transcript_at);
    if let (Some(transcript), Some((audio_at, audio))) = (transcript, audio) {
        texts.push(TextField {
            choice: index,
            kind: Part::Transcript,
            at: transcript,
        });
        residual_members(
            audio,
            audio_at,
            index,
            |key| key == "transcript",
            &mut texts,
        );
    }
    // OpenRouter's `reasoning_details`, which repeat the reasoning in
    // pieces: each entry's text is a text of its own, and its other strings
    // (a signature, encrypted data) are scanned as any other.
    let details = at
        .named(message, "reasoning_details")
        .filter(|(_, details)| details.is_array());
    if let Some((details_at, details)) = details {
        reasoning_details(details, details_at, index, &mut texts);
    }
    let known = |key: &str| {
        TEXT_FIELDS.iter().any(|(field, _)| field.name() == key)
            || (key == "audio" && transcript.is_some())
            || (key == "reasoning_details" && details.is_some())
    };
    match (part, message.as_object()) {
        // A stream's delta: its strings join across chunks (but a spoken
        // reply's audio data, which is scanned chunk by chunk rather than
        // kept whole).
        (Key::Delta, Some(members)) => {
            let root = path_step(joined::ROOT, b'.', b"delta");
            for (position, (key, value)) in members.iter().enumerate() {
                let member_at = at.member(position);
                if key == "audio" && !known(key) {
                    residual_strings(value, member_at, index, key, &mut texts);
                } else if !known(key) {
                    let path = path_step(root, b'.', key.as_bytes());
                    joined_strings(value, member_at, (index, path), key, &mut texts);
                }
            }
        }
        _ => residual_members(message, at, index, known, &mut texts),
    }
    // And any string beside the message in the choice (a provider's own
    // member, the finish reason), but its index, and its logprobs (read
    // only, below).
    let beside = |key: &str| key == part.name() || matches!(key, "index" | "logprobs");
    let choice_at = Location::ROOT.key(Key::Choices).index(position);
    residual_members(choice, choice_at, index, beside, &mut texts);
    if let Some((logprobs_at, logprobs)) = choice_at.named(choice, "logprobs") {
        read_only_strings(logprobs, logprobs_at, index, &mut texts);
    }
    ChoiceView {
        index,
        position,
        texts,
        finish_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_owned),
    }
}

#[cfg(test)]
mod tests {
    use canarygate_policies::verify::Part;
    use serde_json::json;

    use super::*;

    #[test]
    fn an_index_that_is_no_count_is_told() {
        let chunk = |choice: Value, call: Value| json!({"choices": [{"index": choice, "delta": {"tool_calls": [{"index": call}]}}]});
        assert!(indexes_are_counts(&chunk(json!(0), json!(1))));
        assert!(indexes_are_counts(
            &json!({"choices": [{"delta": {"content": "a"}}]})
        ));
        for (choice, call) in [
            (json!(-1), json!(0)),
            (json!("0"), json!(0)),
            (json!(0), json!(0.5)),
        ] {
            assert!(
                !indexes_are_counts(&chunk(choice.clone(), call.clone())),
                "{choice} {call}"
            );
        }
    }

    #[test]
    fn logprobs_tokens_are_read_only() {
        let canary = "CG123456789012345";
        let entry = json!({"token": "Hi", "logprob": -0.1,
                           "top_logprobs": [{"token": format!("x{canary}"), "logprob": -2.0}]});
        for (answer, part) in [
            (
                json!({"choices": [{"index": 0, "message": {"content": "Hi"},
                    "logprobs": {"content": [entry]}, "finish_reason": "stop"}]}),
                Key::Message,
            ),
            (
                json!({"choices": [{"index": 0, "delta": {"content": "Hi"},
                    "logprobs": {"content": [entry]}, "finish_reason": null}]}),
                Key::Delta,
            ),
        ] {
            let choices = read_choices(&answer, part);
            let others: Vec<(&str, bool)> = choices[0]
                .texts
                .iter()
                .filter(|field| matches!(field.kind, Part::Other(_)))
                .map(|field| (field.text(&answer), field.at.is_read_only()))
                .collect();
            assert_eq!(others, [(format!("x{canary}").as_str(), true)], "{answer}");
        }
    }

    #[test]
    fn openrouters_reasoning_details_are_texts_of_their_own() {
        let canary = "CG123456789012345";
        let delta = json!({"choices": [{"index": 0, "delta": {
            "reasoning": "I begin with CG1234",
            "reasoning_details": [
                {"type": "reasoning.text", "text": "I begin with CG1234", "index": 0, "format": "unknown"},
                {"type": "reasoning.summary", "summary": "A plan.", "index": 3},
                {"type": "reasoning.encrypted", "data": format!("x{canary}"), "index": 4},
            ],
        }}]});
        let choices = read_choices(&delta, Key::Delta);
        let texts: Vec<(Part, &str)> = choices[0]
            .texts
            .iter()
            .map(|field| (field.kind, field.text(&delta)))
            .collect();
        assert_eq!(
            texts,
            [
                (Part::Reasoning, "I begin with CG1234"),
                (Part::ReasoningDetail(0), "I begin with CG1234"),
                (Part::ReasoningDetail(3), "A plan."),
                (Part::Other(3), &*format!("x{canary}")),
            ]
        );
    }
    #[test]
    fn canary_shaped_names_and_finishes_are_text_fields_read_from_the_tree() {
        let canary = "CG123456789012345";
        let name = format!("x_{canary}");
        let finish = format!("stop {canary}");
        let chunks = [
            json!({"id": "c1", &name: 1, "choices": [{"index": 0, "delta": {"content": "hi"},
                   "finish_reason": null}]}),
            json!({"id": "c1", "choices": [{"index": 0, "delta": {"content": "hi"},
                   "finish_reason": null, &name: {"a": 1}}]}),
            json!({"id": "c1", "choices": [{"index": 0, "delta": {"content": "hi"},
                   "finish_reason": null}], "usage": null, "extra": [{&name: null}]}),
            json!({"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}),
        ];
        for (chunk, read) in chunks.iter().zip([&name, &name, &name, &finish]) {
            let data = chunk.to_string();
            assert!(
                super::super::light::read(&data).is_none(),
                "the tree's to read: {data}"
            );
            let read_tree = |chunk: &Value| read_choices(chunk, Key::Delta);
            let crate::wire::EventView::Chunk(tree) =
                super::super::read_chunk_tree(&data, read_tree)
            else {
                panic!("a chunk: {data}");
            };
            let others: Vec<&str> = tree.choices[0]
                .texts
                .iter()
                .filter(|field| matches!(field.kind, Part::Other(_)))
                .map(|field| field.text(&tree.event))
                .collect();
            assert_eq!(others, [read.as_str()], "{data}");
        }
        // A whole answer, likewise.
        for answer in [
            json!({"choices": [{"index": 0, "message": {"content": "hi", &name: null},
                   "finish_reason": "stop"}]}),
            json!({"choices": [{"index": 0, "message": {"content": "hi"},
                   "finish_reason": finish}]}),
        ] {
            assert!(
                super::super::light_answer::read(&answer.to_string()).is_none(),
                "{answer}"
            );
            let choices = read_choices(&answer, Key::Message);
            assert!(
                choices[0].texts.iter().any(|field| {
                    matches!(field.kind, Part::Other(_))
                        && canarygate_policies::canary::find_canaries(field.text(&answer))
                            .next()
                            .is_some()
                }),
                "{answer}"
            );
        }
        // Names shorter than a canary, and canary-free ones, stay light.
        let plain = json!({"id": "c1", "x_CG123": 1, "choices": [{"index": 0,
                           "delta": {"content": "hi"}, "finish_reason": "stop"}]});
        assert!(super::super::light::read(&plain.to_string()).is_some());
    }
}
