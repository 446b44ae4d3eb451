//! Editing a Responses API answer for the client: each text becomes what
//! the verifier's release and the delivery leave of it (logprobs and the
//! positions its annotations point at follow),
//! a cut at the client's limit makes the response `incomplete`, usage is
//! edited by the delivery, and the request fields a response repeats
//! (`instructions`, `max_output_tokens`) are the client's own again.

use std::collections::BTreeMap;
use std::ops::Range;

use canarygate_policies::verify::{Part, Verifier};
use serde_json::{Value, json};

use crate::wire::chat::followed_logprobs;
use crate::wire::edit::{Delivery, apply};
use crate::wire::format::{AnswerView, put_text};
use crate::wire::location::{Key, Location};
use crate::wire::positions::{KeptChars, follow_annotations};

/// Which text of an output item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Slot {
    /// `content[i]` (a message's text or refusal, a reasoning text).
    Content(u64),
    /// `summary[i]` of a reasoning item.
    Summary(u64),
    /// A function call's `arguments`.
    Arguments,
}

/// What the client got of one text, so far.
#[derive(Debug, Default, Clone)]
pub struct Shown {
    /// The text.
    pub text: String,
    /// The logprobs of what was shown, when the provider sent them.
    pub logprobs: Vec<Value>,
    /// Which characters of the provider's text were shown, for the
    /// positions its annotations point at.
    pub chars: KeptChars,
}

/// What the client got of each text, by `(output_index, slot)`.
pub type Delivered = BTreeMap<(u64, Slot), Shown>;

/// Makes the request fields a response repeats the client's own again:
/// each of `fields` (the ones canarygate changed, as the client sent them:
/// [`Delivery::repeated_fields`]) that `response` repeats is set back,
/// `instructions` without canarygate's blocks and `max_output_tokens` the
/// client's limit instead of the raised one.
pub fn restore_request_fields(response: &mut Value, fields: &[(String, Value)]) {
    let Some(response) = response.as_object_mut() else {
        return;
    };
    for (name, client) in fields {
        if let Some(repeated) = response.get_mut(name) {
            repeated.clone_from(client);
        }
    }
}

/// Sets output item `item` (at `output_index`) to what was delivered of
/// its texts; a message of a cut answer is `incomplete`.
pub fn rewrite_item(item: &mut Value, output_index: u64, delivered: &Delivered, cut: bool) {
    let shown = |slot| {
        delivered
            .get(&(output_index, slot))
            .cloned()
            .unwrap_or_default()
    };
    match item.get("type").and_then(Value::as_str) {
        Some("message") => {
            if let Some(parts) = item.get_mut("content").and_then(Value::as_array_mut) {
                for (index, part) in parts.iter_mut().enumerate() {
                    rewrite_part(part, &shown(Slot::Content(index as u64)));
                }
            }
            if cut && item.get("status").is_some() {
                item["status"] = json!("incomplete");
            }
        }
        Some("reasoning") => {
            for (key, slot) in [
                ("summary", Slot::Summary as fn(u64) -> Slot),
                ("content", Slot::Content),
            ] {
                if let Some(parts) = item.get_mut(key).and_then(Value::as_array_mut) {
                    for (index, part) in parts.iter_mut().enumerate() {
                        rewrite_part(part, &shown(slot(index as u64)));
                    }
                }
            }
        }
        Some("function_call") if item.get("arguments").is_some_and(Value::is_string) => {
            item["arguments"] = json!(shown(Slot::Arguments).text);
        }
        _ => {}
    }
}

/// Whether `item` (at `output_index` of the output) holds text that no
/// delta of the stream delivered (`delivered` has no entry for its slot):
/// rewritten from what was delivered, it would reach the client empty.
pub fn item_repeats_undelivered(item: &Value, output_index: u64, delivered: &Delivered) -> bool {
    let missing = |slot: Slot| !delivered.contains_key(&(output_index, slot));
    let parts_missing = |key: &str, slot: fn(u64) -> Slot| {
        item.get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
            .any(|(index, part)| part_has_text(part) && missing(slot(index as u64)))
    };
    match item.get("type").and_then(Value::as_str) {
        Some("message") => parts_missing("content", Slot::Content),
        Some("reasoning") => {
            parts_missing("summary", Slot::Summary) || parts_missing("content", Slot::Content)
        }
        Some("function_call") => has_text(item.get("arguments")) && missing(Slot::Arguments),
        _ => false,
    }
}

/// Whether a content or summary part holds text (or a refusal).
pub fn part_has_text(part: &Value) -> bool {
    has_text(part.get("text")) || has_text(part.get("refusal"))
}

/// Whether `value` is a string that is not empty.
pub fn has_text(value: Option<&Value>) -> bool {
    value
        .and_then(Value::as_str)
        .is_some_and(|text| !text.is_empty())
}

/// Sets a content or summary part to `shown`.
pub fn rewrite_part(part: &mut Value, shown: &Shown) {
    let key = if part.get("type").and_then(Value::as_str) == Some("refusal") {
        "refusal"
    } else {
        "text"
    };
    if part.get(key).is_some_and(Value::is_string) {
        part[key] = json!(shown.text);
    }
    if part
        .get("logprobs")
        .and_then(Value::as_array)
        .is_some_and(|entries| !entries.is_empty())
    {
        part["logprobs"] = json!(shown.logprobs);
    }
    if let Some(annotations) = part.get_mut("annotations") {
        follow_annotations(annotations, &shown.chars);
    }
}

/// The response of an answer cut at the client's limit: `incomplete`, as
/// `max_output_tokens` makes it.
pub fn mark_cut(response: &mut Value) {
    response["status"] = json!("incomplete");
    response["incomplete_details"] = json!({"reason": "max_output_tokens"});
}

/// A response's `usage` as the delivery reports it (`total_tokens`
/// following); returns whether it changed.
pub fn report_usage(response: &mut Value, delivery: &Delivery) -> bool {
    let Some(usage) = response.get_mut("usage").filter(|usage| usage.is_object()) else {
        return false;
    };
    if !delivery.report_usage(usage) {
        return false;
    }
    if let (Some(input), Some(output), true) = (
        usage["input_tokens"].as_u64(),
        usage["output_tokens"].as_u64(),
        usage.get("total_tokens").is_some(),
    ) {
        usage["total_tokens"] = json!(input + output);
    }
    true
}

/// Where each output text of `response` sits: `(output_index, slot)` by
/// location.
fn slots(response: &Value) -> Vec<(Location, u64, Slot)> {
    let mut slots = Vec::new();
    let items = response.get("output").and_then(Value::as_array);
    for (index, item) in items.into_iter().flatten().enumerate() {
        let at = Location::ROOT.key(Key::Output).index(index);
        let output_index = index as u64;
        for (key, slot, field) in [
            (Key::Content, Slot::Content as fn(u64) -> Slot, Key::Text),
            (Key::Content, Slot::Content, Key::Refusal),
            (Key::Summary, Slot::Summary, Key::Text),
        ] {
            let parts = item.get(key.name()).and_then(Value::as_array);
            for (part, _) in parts.into_iter().flatten().enumerate() {
                slots.push((
                    at.key(key).index(part).key(field),
                    output_index,
                    slot(part as u64),
                ));
            }
        }
        slots.push((at.key(Key::Arguments), output_index, Slot::Arguments));
    }
    slots
}

/// Edits a verified whole response for the client (see the module docs).
pub fn deliver_answer(
    answer: &mut Value,
    view: &AnswerView,
    spans: &[Range<usize>],
    verifier: &Verifier,
    delivery: &mut Delivery,
) {
    let original = answer.clone();
    let slots = slots(&original);
    let fields = view.choices.iter().flat_map(|choice| &choice.texts);
    for (field, span) in fields.zip(spans) {
        let text = field.text(&original).to_owned();
        let edit = delivery.admit(
            field.choice,
            field.kind,
            &text,
            span.clone(),
            verifier.release_of(field.choice, field.kind),
        );
        if edit.unchanged() {
            continue;
        }
        put_text(answer, field, apply(&text, &edit.kept));
        if !matches!(field.kind, Part::Content | Part::Refusal) {
            continue;
        }
        let Some(&(_, output_index, Slot::Content(part))) =
            slots.iter().find(|(at, _, _)| *at == field.at)
        else {
            continue;
        };
        let at = Location::ROOT
            .key(Key::Output)
            .index(output_index as usize)
            .key(Key::Content)
            .index(part as usize);
        if let Some(logprobs) = at.key(Key::Logprobs).get_mut(answer)
            && let Some(entries) = logprobs.as_array().filter(|entries| !entries.is_empty())
        {
            *logprobs = json!(followed_logprobs(entries.to_vec(), &text, &edit.kept));
        }
        if let Some(annotations) = at
            .get_mut(answer)
            .and_then(|part| part.get_mut("annotations"))
        {
            let mut chars = KeptChars::default();
            chars.push(&text, &edit.kept);
            follow_annotations(annotations, &chars);
        }
    }
    if delivery.was_cut(0) {
        mark_cut(answer);
        if let Some(items) = answer.get_mut("output").and_then(Value::as_array_mut) {
            for item in items.iter_mut().filter(|item| item["type"] == "message") {
                if item.get("status").is_some() {
                    item["status"] = json!("incomplete");
                }
            }
        }
    }
    // What the client sent, not the verifier's edit, decides what the
    // repeated request fields become.
    restore_request_fields(answer, delivery.repeated_fields());
    report_usage(answer, delivery);
    restate_output_text(answer);
}

/// A response's `output_text`, when the provider sent one (SDKs compute it
/// themselves, but Node's stream keeps one that is there): the text of its
/// messages' `output_text` parts as delivered, not the provider's.
pub fn restate_output_text(response: &mut Value) {
    if !response.get("output_text").is_some_and(Value::is_string) {
        return;
    }
    let text: String = response
        .get("output")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|item| item["type"] == "message")
        .filter_map(|item| item.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|part| part["type"] == "output_text")
        .filter_map(|part| part.get("text").and_then(Value::as_str))
        .collect();
    response["output_text"] = json!(text);
}

#[cfg(test)]
mod tests {
    use canarygate_policies::EchoCost;
    use canarygate_policies::inject::RequestCanaries;
    use canarygate_policies::registry::MemoryRegistry;
    use canarygate_policies::verify::Facts;
    use canarygate_policies::verify_config::{EchoMode, VerifyConfig};

    use super::*;

    #[test]
    fn a_responses_output_text_is_its_delivered_messages() {
        let mut response = json!({"output_text": "Berlin, and the echo", "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Hm."}]},
            {"type": "message", "content": [{"type": "output_text", "text": "Paris"},
                                            {"type": "refusal", "refusal": "no"}]},
            {"type": "message", "content": [{"type": "output_text", "text": " is it."}]},
        ]});
        restate_output_text(&mut response);
        assert_eq!(response["output_text"], "Paris is it.");
        // None sent, none made.
        let mut without = json!({"output": []});
        restate_output_text(&mut without);
        assert_eq!(without, json!({"output": []}));
    }
    use crate::wire::edit::{TokenCounter, UsageOptions};
    use crate::wire::format::ChoiceView;
    use crate::wire::responses::answer::response_texts;
    use crate::wire::responses::request::place;

    #[test]
    fn a_whole_answer_is_edited_in_place() {
        let canaries = RequestCanaries::mint();
        let mut body = json!({"model": "m", "instructions": "Be brief.", "input": "hi",
                              "max_output_tokens": 3});
        let injection = place(
            &mut body,
            EchoMode::HeadTail,
            EchoCost::DIGIT_BY_DIGIT,
            canaries,
        )
        .unwrap();
        let echo = format!("{} {}\n", canaries.head, canaries.tail);
        let text = format!("{echo}one two six ten");
        // A token that spans the echo's end, and "s" as a byte token (as
        // providers write a token that is not whole UTF-8).
        let mut tokens: Vec<Value> = [&echo[..echo.len() - 1], "\none ", "two "]
            .iter()
            .map(|token| json!({"token": token, "logprob": -0.1, "bytes": token.as_bytes()}))
            .collect();
        tokens.push(json!({"token": "bytes:\\x73", "logprob": -0.1, "bytes": [115]}));
        for token in ["ix ", "ten"] {
            tokens.push(json!({"token": token, "logprob": -0.1, "bytes": token.as_bytes()}));
        }
        // Citations of "two" and of "ten" (past the client's limit), counted
        // in characters of the text as the provider wrote it.
        let two = echo.chars().count() + 4;
        let annotations = json!([
            {"type": "url_citation", "start_index": two, "end_index": two + 3, "url": "u"},
            {"type": "url_citation", "start_index": two + 8, "end_index": two + 11, "url": "v"},
        ]);
        let mut answer = json!({"id": "resp_1", "object": "response", "status": "completed",
            "instructions": body["instructions"], "max_output_tokens": body["max_output_tokens"],
            "output": [{"type": "message", "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": text, "logprobs": tokens,
                                     "annotations": annotations}]}],
            "usage": {"input_tokens": 50, "output_tokens": 20, "total_tokens": 70}});
        let view = AnswerView {
            choices: smallvec::smallvec![ChoiceView {
                index: 0,
                position: 0,
                texts: response_texts(&answer),
                finish_reason: Some("stop".into()),
            }],
            usage: None,
        };
        let registry = MemoryRegistry::new(b"test");
        let mut verifier = Verifier::new(&injection, &VerifyConfig::default(), "p", None);
        let mut spans = crate::wire::Spans::new();
        for field in &view.choices[0].texts {
            let text = field.text(&answer);
            let start = verifier.received(0, field.kind);
            spans.push(start..start + text.len());
            verifier.push_part_positions(0, field.kind, text, &registry);
        }
        let facts = Facts {
            finish_reasons: vec![Some("stop".into())],
            usage: None,
            done_marker: None,
        };
        assert!(verifier.finish(&facts, &registry).verdict.passed());
        let usage = UsageOptions {
            client_wants_usage: true,
            without_canarygate: true,
            overhead_prompt: 30,
        };
        let mut delivery = Delivery::new(TokenCounter::default(), Some(3), usage, 1)
            .with_repeated_fields(injection.repeated_fields.clone());
        deliver_answer(&mut answer, &view, &spans, &verifier, &mut delivery);
        let part = &answer["output"][0]["content"][0];
        assert_eq!(part["text"], "one two six ");
        let kept: Vec<&str> = part["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|entry| entry["token"].as_str().unwrap())
            .collect();
        assert_eq!(
            kept,
            ["one ", "two ", "bytes:\\x73", "ix "],
            "logprobs follow the text"
        );
        assert_eq!(
            part["annotations"],
            json!([
                {"type": "url_citation", "start_index": 4, "end_index": 7, "url": "u"},
                // The cited word was cut: an empty span at the text's end.
                {"type": "url_citation", "start_index": 12, "end_index": 12, "url": "v"},
            ]),
            "annotations point into the delivered text"
        );
        assert_eq!(answer["status"], "incomplete");
        assert_eq!(answer["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(answer["output"][0]["status"], "incomplete");
        assert_eq!(answer["instructions"], "Be brief.");
        assert_eq!(answer["max_output_tokens"], 3);
        let usage = &answer["usage"];
        assert_eq!(usage["input_tokens"], 20);
        assert_eq!(
            usage["total_tokens"].as_u64(),
            Some(20 + usage["output_tokens"].as_u64().unwrap())
        );
    }

    #[test]
    fn the_repeated_fields_are_the_clients_as_sent() {
        // Nothing changed by canarygate: the provider's copies stay.
        let mut response = json!({"instructions": "Mine.", "max_output_tokens": 40});
        restore_request_fields(&mut response, &[]);
        assert_eq!(
            response,
            json!({"instructions": "Mine.", "max_output_tokens": 40})
        );
        // The client's own text, canary-shaped ticket included, and its
        // limit; an empty text stays empty, a missing one is null.
        let ours = "Ticket [CG123456789012345] open.\n\nBegin your reply with \"CG123456789012346\" \
            on its own line; then answer normally.";
        for client in [
            json!("Ticket [CG123456789012345] open."),
            json!(""),
            json!(null),
        ] {
            let mut response = json!({"instructions": ours, "max_output_tokens": 59});
            let fields = [
                ("instructions".to_owned(), client.clone()),
                ("max_output_tokens".to_owned(), json!(40)),
            ];
            restore_request_fields(&mut response, &fields);
            assert_eq!(
                response,
                json!({"instructions": client, "max_output_tokens": 40})
            );
        }
        // A field the response does not repeat is not added.
        let mut response = json!({"id": "resp_1"});
        let fields = [("instructions".to_owned(), json!("Mine."))];
        restore_request_fields(&mut response, &fields);
        assert_eq!(response, json!({"id": "resp_1"}));
    }
}
