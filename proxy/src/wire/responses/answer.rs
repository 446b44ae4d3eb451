//! Where text sits in a Responses API answer and in its stream's events.
//!
//! A response's `output` is a list of items: a `message`'s `output_text`
//! parts are the content and its `refusal` parts the refusal, a
//! `reasoning` item's `summary[].text` and `content[].text` the reasoning,
//! a `function_call`'s `arguments` the arguments of tool call N (N: the
//! item's `output_index`); any other string holding a canary-shaped span is
//! verified too. A stream carries the same texts as deltas of typed events;
//! the `.done` events and `response.completed` repeat them whole: their
//! texts are not read (the writer rewrites them from what was delivered;
//! a text no delta carried is read from its first repeat, in
//! [`super::repeated`]), but any other string in the items and the
//! response they repeat is.
//!
//! Longer than 500 lines: about 300 of them are the unit tests, which read
//! whole responses and stream events of every item kind.

use canarygate_policies::canary::{find_canaries, may_join_a_canary};
use canarygate_policies::sse::SseEvent;
use canarygate_policies::verify::{Part, ProviderUsage};
use serde_json::Value;

use super::deliver::Slot;
use crate::wire::chat::joined_other;
use crate::wire::format::{
    ChoiceView, Chunk, EventView, TextField, TextFields, TextPlace, canary_shaped_names,
};
use crate::wire::location::{Key, Location};

/// `usage` of a response: `input_tokens` (cached ones included),
/// `output_tokens`, `input_tokens_details.cached_tokens`.
pub fn usage_of(response: &Value) -> Option<ProviderUsage> {
    let usage = response.get("usage")?;
    let prompt_tokens = usage.get("input_tokens").and_then(Value::as_u64)?;
    Some(ProviderUsage {
        prompt_tokens,
        completion_tokens: usage.get("output_tokens").and_then(Value::as_u64),
        cached_prompt_tokens: usage
            .pointer("/input_tokens_details/cached_tokens")
            .and_then(Value::as_u64),
    })
}

/// The finish reason of a response, as Chat Completions names it: `stop`
/// (`tool_calls` when it calls a function), `length` when
/// `max_output_tokens` ran out, `content_filter`; `None` while it is not
/// finished.
pub fn finish_of(response: &Value) -> Option<String> {
    let status = response.get("status").and_then(Value::as_str)?;
    let reason = match status {
        "completed" => {
            let calls = response
                .get("output")
                .and_then(Value::as_array)
                .is_some_and(|items| items.iter().any(|item| item["type"] == "function_call"));
            if calls { "tool_calls" } else { "stop" }
        }
        "incomplete" => match response
            .pointer("/incomplete_details/reason")
            .and_then(Value::as_str)
        {
            Some("max_output_tokens") => "length",
            Some("content_filter") => "content_filter",
            Some(other) => return Some(other.to_owned()),
            None => "length",
        },
        "failed" | "cancelled" => status,
        _ => return None,
    };
    Some(reason.to_owned())
}

/// The texts of a whole response's output items (at `at`), in order.
pub fn output_texts(response: &Value, at: Location) -> TextFields {
    let mut texts = TextFields::new();
    let Some(items) = response.get("output").and_then(Value::as_array) else {
        return texts;
    };
    let at = at.key(Key::Output);
    for (position, item) in items.iter().enumerate() {
        item_texts(item, at.index(position), position as u32, &mut texts);
    }
    texts
}

/// The texts of output item `output_index` (at `at`).
fn item_texts(item: &Value, at: Location, output_index: u32, texts: &mut TextFields) {
    let list = |key: &str| {
        item.get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
    };
    let is_string = |part: &Value, key: &str| part.get(key).is_some_and(Value::is_string);
    let mut known: &[&str] = &[];
    match item.get("type").and_then(Value::as_str) {
        Some("message") => {
            known = &["content"];
            for (index, part) in list("content").enumerate() {
                let at = at.key(Key::Content).index(index);
                let text = match part.get("type").and_then(Value::as_str) {
                    Some("output_text") if is_string(part, "text") => {
                        push(texts, Part::Content, at.key(Key::Text));
                        "text"
                    }
                    Some("refusal") if is_string(part, "refusal") => {
                        push(texts, Part::Refusal, at.key(Key::Refusal));
                        "refusal"
                    }
                    _ => "",
                };
                // Annotations and the like (logprobs follow the text).
                for (position, (key, value)) in part.as_object().into_iter().flatten().enumerate() {
                    if key != text && key != "logprobs" {
                        residual(value, at.member(position), texts);
                    }
                }
            }
        }
        Some("reasoning") => {
            known = &["summary", "content"];
            for key in [Key::Summary, Key::Content] {
                for (index, part) in list(key.name()).enumerate() {
                    let at = at.key(key);
                    if is_string(part, "text") {
                        push(texts, Part::Reasoning, at.index(index).key(Key::Text));
                    } else {
                        residual(part, at.index(index), texts);
                    }
                }
            }
        }
        Some("function_call") => {
            known = &["arguments"];
            if is_string(item, "arguments") {
                push(
                    texts,
                    Part::ToolArguments(output_index),
                    at.key(Key::Arguments),
                );
            }
        }
        _ => {}
    }
    if let Some(members) = item.as_object() {
        for (position, (key, value)) in members.iter().enumerate() {
            if !known.contains(&key.as_str()) {
                residual(value, at.member(position), texts);
            }
        }
    }
}

fn push(texts: &mut TextFields, kind: Part, at: Location) {
    texts.push(TextField {
        choice: 0,
        kind,
        at,
    });
}

/// Pushes onto `texts` every string under `value` (at `at`) that holds a
/// canary-shaped span, as a [`Part::Other`] field; an MCP call's or a custom
/// tool's `arguments` too (a function call's are their own part, read by
/// [`item_texts`]). Strings nested deeper than a [`Location`] reaches are
/// not looked at.
pub fn residual(value: &Value, at: Location, texts: &mut TextFields) {
    match value {
        Value::String(text) if find_canaries(text).next().is_some() => {
            let n = texts.len() as u32;
            push(texts, Part::Other(n), at);
        }
        Value::Array(items) if at.has_room() => {
            for (position, item) in items.iter().enumerate() {
                residual(item, at.index(position), texts);
            }
        }
        Value::Object(members) if at.has_room() => {
            for (position, inner) in members.values().enumerate() {
                residual(inner, at.member(position), texts);
            }
        }
        _ => {}
    }
}

/// An event's type: its data's `type`, else its `event:` name.
pub fn event_type<'a>(data: &'a Value, event: &'a SseEvent) -> &'a str {
    data.get("type")
        .and_then(Value::as_str)
        .or(event.event.as_deref())
        .unwrap_or("")
}

/// The part whose text a delta event of type `kind` carries in `delta`.
pub fn delta_part(kind: &str, data: &Value) -> Option<Part> {
    part_of_delta(kind, data.get("output_index").and_then(Value::as_u64))
}

/// [`delta_part`] of an event whose `output_index` is `output_index`.
pub fn part_of_delta(kind: &str, output_index: Option<u64>) -> Option<Part> {
    Some(match kind {
        "response.output_text.delta" => Part::Content,
        "response.refusal.delta" => Part::Refusal,
        "response.reasoning_summary_text.delta" | "response.reasoning_text.delta" => {
            Part::Reasoning
        }
        "response.function_call_arguments.delta" => {
            Part::ToolArguments(u32::try_from(output_index?).ok()?)
        }
        _ => return None,
    })
}

/// Which text of its output item an event of type `kind` is about, as
/// `content_index` and `summary_index` place it (0 when absent).
pub fn slot_of(kind: &str, content_index: Option<u64>, summary_index: Option<u64>) -> Slot {
    match kind {
        "response.reasoning_summary_text.delta"
        | "response.reasoning_summary_text.done"
        | "response.reasoning_summary_part.added"
        | "response.reasoning_summary_part.done" => Slot::Summary(summary_index.unwrap_or(0)),
        "response.function_call_arguments.delta" | "response.function_call_arguments.done" => {
            Slot::Arguments
        }
        _ => Slot::Content(content_index.unwrap_or(0)),
    }
}

/// Where a delta of `part` in `slot` of output item `output_index` goes
/// ([`Chunk::place`]): texts only (a call's arguments are its item's own).
pub fn text_place(part: Part, output_index: u64, slot: Slot) -> Option<TextPlace> {
    let (list, index) = match slot {
        Slot::Content(index) => (0, index),
        Slot::Summary(index) => (1, index),
        Slot::Arguments => return None,
    };
    matches!(part, Part::Content | Part::Reasoning | Part::Refusal).then_some(TextPlace {
        item: output_index,
        list,
        index,
    })
}

/// Events that carry no model text of their own: the response's
/// lifecycle, items and parts opening (empty), and the events that repeat
/// streamed text whole (rewritten by the writer from what was delivered).
pub const WITHOUT_TEXT: [&str; 16] = [
    "response.created",
    "response.queued",
    "response.in_progress",
    "response.output_item.added",
    "response.output_item.done",
    "response.content_part.added",
    "response.content_part.done",
    "response.output_text.done",
    "response.refusal.done",
    "response.reasoning_summary_part.added",
    "response.reasoning_summary_part.done",
    "response.reasoning_summary_text.done",
    "response.reasoning_text.done",
    "response.function_call_arguments.done",
    "response.completed",
    "response.incomplete",
];

/// One event of a provider's Responses stream, read from its JSON tree
/// ([`read_event`](super::stream::read_event) reads deltas without it).
pub(super) fn read_tree(event: &SseEvent) -> EventView {
    if event.is_done() {
        return EventView::Done;
    }
    let Ok(data) = serde_json::from_str::<Value>(&event.data) else {
        return EventView::Malformed;
    };
    if !data.is_object() {
        return EventView::Malformed;
    }
    let kind = event_type(&data, event).to_owned();
    match kind.as_str() {
        // An `error` event is one of the stream's events (`response.failed`
        // follows it): passed on in order, as the provider sent it. A failed
        // response ends the answer as a completed one does: its output is
        // the text so far, delivered edited, and the SDK reads the failure
        // from it.
        "response.completed" | "response.incomplete" | "response.failed" => {
            let response = data.get("response").unwrap_or(&Value::Null);
            let mut texts = repeated_texts(&kind, &data);
            beside_texts(&kind, &data, &mut texts);
            canary_shaped_names(&data, Location::ROOT, 0, &mut texts);
            let choices = smallvec::smallvec![ChoiceView {
                index: 0,
                position: 0,
                texts,
                finish_reason: finish_of(response),
            }];
            let usage = usage_of(response);
            return EventView::Final(Chunk::parsed(data, choices, usage));
        }
        _ => {}
    }
    let mut texts = TextFields::new();
    let mut place = None;
    if let Some(part) = delta_part(&kind, &data) {
        if data.get("delta").is_some_and(Value::is_string) {
            push(&mut texts, part, Location::ROOT.key(Key::Delta));
            let index = |key: &str| data.get(key).and_then(Value::as_u64);
            let slot = slot_of(&kind, index("content_index"), index("summary_index"));
            place = text_place(part, index("output_index").unwrap_or(0), slot);
        }
        // Any other string beside the text (its item's id, the padding),
        // its logprobs' read only (they follow the text).
        for (position, (key, value)) in data.as_object().into_iter().flatten().enumerate() {
            let at = Location::ROOT.member(position);
            match key.as_str() {
                "delta" => {}
                "logprobs" => residual(value, at.read_only(), &mut texts),
                _ => residual(value, at, &mut texts),
            }
        }
    } else if matches!(
        kind.as_str(),
        "response.created"
            | "response.queued"
            | "response.in_progress"
            | "response.output_item.added"
            | "response.output_item.done"
    ) {
        // The response or item they repeat (the instructions hold
        // canarygate's blocks), and what is beside it.
        texts = repeated_texts(&kind, &data);
        beside_texts(&kind, &data, &mut texts);
    } else if WITHOUT_TEXT.contains(&kind.as_str()) {
        beside_texts(&kind, &data, &mut texts);
    } else if let (true, Some(delta)) = (
        kind.ends_with(".delta"),
        data.get("delta").and_then(Value::as_str),
    ) {
        // A delta of a kind not read as text (a custom tool's input, an MCP
        // call's arguments, code): SDKs join its pieces by item, so its
        // pieces are one string (`chat::joined`), and its other strings are
        // read as any.
        if may_join_a_canary(delta) {
            let index = |key: &str| data.get(key).and_then(Value::as_u64).unwrap_or(0);
            let keys = [
                kind.as_bytes(),
                &index("output_index").to_le_bytes(),
                &index("content_index").to_le_bytes(),
            ];
            push(
                &mut texts,
                joined_other(&keys),
                Location::ROOT.key(Key::Delta),
            );
        }
        for (position, (key, value)) in data.as_object().into_iter().flatten().enumerate() {
            if key != "delta" {
                residual(value, Location::ROOT.member(position), &mut texts);
            }
        }
    } else {
        // An event of another kind (annotations, audio...): any
        // canary-shaped text in it is verified.
        residual(&data, Location::ROOT, &mut texts);
    }
    canary_shaped_names(&data, Location::ROOT, 0, &mut texts);
    let choices = if texts.is_empty() {
        Default::default()
    } else {
        smallvec::smallvec![ChoiceView {
            index: 0,
            position: 0,
            texts,
            finish_reason: None,
        }]
    };
    let mut chunk = Chunk::parsed(data, choices, None);
    chunk.place = place;
    EventView::Chunk(chunk)
}

/// Pushes onto `texts` every string of a Responses event of type `kind`
/// (`data`) that holds a canary-shaped span, but what is read on its own
/// (the `response` or `item` it repeats, [`repeated_texts`]) and what the
/// stream's writer rewrites from what was delivered: the text a `.done`
/// event repeats, a part's text. Logprobs are read only. Anything else
/// passes to the client as the provider sent it (an `error` member, which
/// SDKs raise, a part's annotations, ids), so another request's canary
/// there fails the answer.
fn beside_texts(kind: &str, data: &Value, texts: &mut TextFields) {
    let Some(members) = data.as_object() else {
        return;
    };
    let repeats = |key: &str| match kind {
        "response.output_item.added" | "response.output_item.done" => key == "item",
        "response.output_text.done"
        | "response.reasoning_summary_text.done"
        | "response.reasoning_text.done" => key == "text",
        "response.refusal.done" => key == "refusal",
        "response.function_call_arguments.done" => key == "arguments",
        "response.created"
        | "response.queued"
        | "response.in_progress"
        | "response.completed"
        | "response.incomplete"
        | "response.failed" => key == "response",
        _ => false,
    };
    for (position, (key, value)) in members.iter().enumerate() {
        let at = Location::ROOT.member(position);
        if repeats(key) {
            continue;
        }
        match key.as_str() {
            "logprobs" => residual(value, at.read_only(), texts),
            "part" => {
                for (position, (key, inner)) in value.as_object().into_iter().flatten().enumerate()
                {
                    match key.as_str() {
                        "text" | "refusal" => {}
                        "logprobs" => residual(inner, at.member(position).read_only(), texts),
                        _ => residual(inner, at.member(position), texts),
                    }
                }
            }
            _ => residual(value, at, texts),
        }
    }
}

/// Whether `event` ends a Responses stream: `response.completed`,
/// `response.incomplete` or `response.failed`.
pub fn is_end(event: &SseEvent) -> bool {
    serde_json::from_str::<Value>(&event.data).is_ok_and(|data| {
        matches!(
            event_type(&data, event),
            "response.completed" | "response.incomplete" | "response.failed"
        )
    })
}

/// The texts of a whole response: its output's, the instructions it
/// repeats when they hold a canary-shaped span, and any other string or
/// member name that holds one.
pub fn response_texts(response: &Value) -> TextFields {
    let mut texts = output_texts(response, Location::ROOT);
    instructions_texts(response, Location::ROOT, &mut texts);
    member_texts(response, Location::ROOT, &mut texts);
    canary_shaped_names(response, Location::ROOT, 0, &mut texts);
    texts
}

/// The strings of a response's (at `at`) own members, beside its output,
/// instructions and usage, that hold a canary-shaped span: [`Part::Other`]
/// fields.
fn member_texts(response: &Value, at: Location, texts: &mut TextFields) {
    let Some(members) = response.as_object() else {
        return;
    };
    for (position, (key, value)) in members.iter().enumerate() {
        if !matches!(key.as_str(), "output" | "instructions" | "usage") {
            residual(value, at.member(position), texts);
        }
    }
}

/// What a stream's events that repeat items whole (`output_item.added` and
/// `.done`, the final response) hold besides the texts rewritten from what
/// was delivered: their [`Part::Other`] fields (a web search's query, an
/// MCP call's arguments, an item or member of a kind canarygate does not
/// read, the instructions the final response repeats), renumbered in order.
fn repeated_texts(kind: &str, data: &Value) -> TextFields {
    let mut found = TextFields::new();
    match kind {
        "response.output_item.added" | "response.output_item.done" => {
            if let Some((at, item)) = Location::ROOT.named(data, "item") {
                let index = data
                    .get("output_index")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                item_texts(
                    item,
                    at,
                    u32::try_from(index).unwrap_or(u32::MAX),
                    &mut found,
                );
            }
        }
        _ => {
            if let Some(response) = data.get("response") {
                let at = Location::ROOT.key(Key::Response);
                found = output_texts(response, at);
                instructions_texts(response, at, &mut found);
                member_texts(response, at, &mut found);
            }
        }
    }
    let mut texts = TextFields::new();
    for field in found {
        if matches!(field.kind, Part::Other(_)) {
            let n = texts.len() as u32;
            push(&mut texts, Part::Other(n), field.at);
        }
    }
    texts
}

/// The `instructions` a response (at `at`) repeats, as a [`Part::Other`]
/// field when they hold a canary-shaped span.
fn instructions_texts(response: &Value, at: Location, texts: &mut TextFields) {
    if let Some((at, instructions)) = at.named(response, "instructions") {
        residual(instructions, at, texts);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::wire::responses::stream::read_event;

    fn event(data: Value) -> SseEvent {
        SseEvent {
            event: data["type"].as_str().map(str::to_owned),
            data: data.to_string(),
            id: None,
        }
    }

    #[test]
    fn strings_of_items_and_members_canarygate_does_not_read_are_verified() {
        let canary = "CG123456789012345";
        let items = json!([
            {"type": "web_search_call", "id": "ws_1", "status": "completed",
             "action": {"type": "search", "query": format!("who owns {canary}")}},
            {"type": "mcp_call", "id": "mcp_1", "name": "lookup",
             "arguments": format!("{{\"q\":\"{canary}\"}}")},
        ]);
        let response = json!({"id": "resp_1", "object": "response", "output": items,
                              "provider_note": format!("cached for {canary}")});
        // A whole response: the items' strings and the response's own member.
        let texts = response_texts(&response);
        let read: Vec<&str> = texts.iter().map(|field| field.text(&response)).collect();
        assert_eq!(
            read,
            [
                format!("who owns {canary}"),
                format!("{{\"q\":\"{canary}\"}}"),
                format!("cached for {canary}"),
            ]
        );
        // A stream's events that repeat them whole.
        let item_done = event(
            json!({"type": "response.output_item.done", "output_index": 0,
                                     "item": items[0], "sequence_number": 9}),
        );
        let EventView::Chunk(chunk) = read_tree(&item_done) else {
            panic!("a chunk");
        };
        let fields: Vec<(Part, &str)> = chunk.choices[0]
            .texts
            .iter()
            .map(|field| (field.kind, field.text(&chunk.event)))
            .collect();
        assert_eq!(
            fields,
            [(Part::Other(0), format!("who owns {canary}").as_str())]
        );
        let completed = event(json!({"type": "response.completed", "response": response,
                                     "sequence_number": 10}));
        let EventView::Final(chunk) = read_tree(&completed) else {
            panic!("the final event");
        };
        assert_eq!(chunk.choices[0].texts.len(), 3);
        // The instructions the final response repeats are read as the first
        // event's are: another request's there fail the answer.
        let mut repeating = response.clone();
        repeating["instructions"] = json!(format!("Be brief.\n\n[{canary}]"));
        for kind in [
            "response.created",
            "response.completed",
            "response.incomplete",
        ] {
            let data = json!({"type": kind, "response": repeating, "sequence_number": 1});
            let (EventView::Chunk(chunk) | EventView::Final(chunk)) = read_tree(&event(data))
            else {
                panic!("{kind}: an event with texts");
            };
            let texts: Vec<&str> = chunk.choices[0]
                .texts
                .iter()
                .map(|field| field.text(&chunk.event))
                .collect();
            assert!(
                texts.contains(&format!("Be brief.\n\n[{canary}]").as_str()),
                "{kind}: {texts:?}"
            );
        }
    }

    /// What an event repeats and the writer rewrites from what was
    /// delivered (a `.done` event's text, a part's text) is not read; any
    /// other string of it is, wherever it is, logprobs read only.
    #[test]
    fn every_string_an_event_passes_on_as_it_came_is_read() {
        let canary = "CG123456789012345";
        let seen = format!("x{canary}");
        let place = json!({"item_id": "msg_1", "output_index": 0, "content_index": 0});
        let with = |kind: &str, more: Value| {
            let mut data = place.clone();
            data["type"] = json!(kind);
            for (key, value) in more.as_object().unwrap() {
                data[key] = value.clone();
            }
            data
        };
        let response = json!({"id": "resp_1", "status": "in_progress", "output": [],
                              "metadata": {"note": seen}});
        let part = json!({"type": "output_text", "text": format!("{canary} repeated"),
                          "annotations": [{"type": "url_citation", "title": seen}]});
        let cases = [
            json!({"type": "response.created", "response": response}),
            json!({"type": "response.in_progress", "response": response}),
            json!({"type": "response.created", "response": {"output": []},
                   "error": {"message": seen}}),
            json!({"type": "response.completed", "response": {"output": []}, "note": seen}),
            with("response.content_part.added", json!({"part": part})),
            with("response.content_part.done", json!({"part": part})),
            with(
                "response.output_text.done",
                json!({"text": format!("{canary} repeated"),
                                                     "note": seen}),
            ),
            with(
                "response.output_text.delta",
                json!({"delta": "hi",
                "logprobs": [{"token": seen, "logprob": -0.1, "top_logprobs": []}]}),
            ),
            json!({"type": "response.output_item.done", "output_index": 0, "note": seen,
                   "item": {"type": "message", "id": "msg_1", "role": "assistant",
                            "content": [{"type": "output_text", "text": canary}]}}),
        ];
        for data in cases {
            let (EventView::Chunk(chunk) | EventView::Final(chunk)) =
                read_tree(&event(data.clone()))
            else {
                panic!("{data}: an event");
            };
            let read: Vec<(&str, bool)> = chunk
                .texts()
                .filter(|field| matches!(field.kind, Part::Other(_)))
                .map(|field| (field.text(&chunk.event), field.at.is_read_only()))
                .collect();
            let logprobs = data.get("logprobs").is_some();
            assert_eq!(read, [(seen.as_str(), logprobs)], "{data}");
        }
    }

    /// The pieces of a delta not read as text (a custom tool's input) are
    /// one string per item, which SDKs join: one number across events.
    #[test]
    fn deltas_of_other_kinds_are_joined_by_item() {
        let number = |output_index: u64, delta: &str| {
            let data = json!({"type": "response.custom_tool_call_input.delta",
                              "output_index": output_index, "item_id": "ct_1", "delta": delta});
            let EventView::Chunk(chunk) = read_tree(&event(data)) else {
                panic!("a chunk");
            };
            chunk.texts().map(|field| field.kind).collect::<Vec<_>>()
        };
        let first = number(1, "print('CG1234");
        assert_eq!(first.len(), 1);
        assert_eq!(number(1, "5678')"), first);
        assert_ne!(number(2, "5678')"), first);
        // A piece that cannot be part of a canary is not read.
        assert!(number(1, "hello").is_empty());
    }

    #[test]
    fn every_output_text_is_read_with_its_part() {
        let canary = "CG123456789012345";
        let response = json!({"id": "resp_1", "object": "response", "status": "completed",
            "instructions": format!("Be brief.\n\n[{canary}]"),
            "output": [
                {"type": "reasoning", "id": "rs_1",
                 "summary": [{"type": "summary_text", "text": "thinking"}],
                 "content": [{"type": "reasoning_text", "text": "more"}]},
                {"type": "message", "id": "msg_1", "role": "assistant", "content": [
                    {"type": "output_text", "text": "hello", "annotations": [
                        {"type": "url_citation", "url": format!("https://x/{canary}")}]},
                    {"type": "refusal", "refusal": "no"}]},
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
                 "arguments": "{\"a\":1}"},
            ],
            "usage": {"input_tokens": 20, "output_tokens": 9,
                      "input_tokens_details": {"cached_tokens": 4}, "total_tokens": 29}});
        let texts = response_texts(&response);
        let read: Vec<(Part, &str)> = texts
            .iter()
            .map(|field| (field.kind, field.text(&response)))
            .collect();
        assert_eq!(
            read,
            [
                (Part::Reasoning, "thinking"),
                (Part::Reasoning, "more"),
                (Part::Content, "hello"),
                (Part::Other(3), format!("https://x/{canary}").as_str()),
                (Part::Refusal, "no"),
                (Part::ToolArguments(2), "{\"a\":1}"),
                (Part::Other(6), format!("Be brief.\n\n[{canary}]").as_str()),
            ]
        );
        assert_eq!(finish_of(&response).as_deref(), Some("tool_calls"));
        assert_eq!(
            usage_of(&response),
            Some(ProviderUsage {
                prompt_tokens: 20,
                completion_tokens: Some(9),
                cached_prompt_tokens: Some(4),
            })
        );
    }

    #[test]
    fn finish_reasons_are_chats() {
        let finish = |response: Value| finish_of(&response);
        assert_eq!(
            finish(json!({"status": "completed", "output": []})).unwrap(),
            "stop"
        );
        assert_eq!(
            finish(json!({"status": "incomplete",
                          "incomplete_details": {"reason": "max_output_tokens"}}))
            .unwrap(),
            "length"
        );
        assert_eq!(
            finish(json!({"status": "incomplete",
                          "incomplete_details": {"reason": "content_filter"}}))
            .unwrap(),
            "content_filter"
        );
        assert_eq!(finish(json!({"status": "in_progress"})), None);
    }

    #[test]
    fn events_are_read_by_type() {
        let delta = |kind: &str| {
            let event = event(json!({"type": kind, "output_index": 3,
                "content_index": 0, "summary_index": 0, "delta": "abc", "sequence_number": 5}));
            let view = read_event(&event);
            let EventView::Chunk(chunk) = view else {
                panic!("{view:?}")
            };
            let field = chunk.texts().next().copied().unwrap();
            assert_eq!(chunk.with_data(&event.data).text(&field), "abc");
            field.kind
        };
        assert_eq!(delta("response.output_text.delta"), Part::Content);
        assert_eq!(delta("response.refusal.delta"), Part::Refusal);
        assert_eq!(
            delta("response.reasoning_summary_text.delta"),
            Part::Reasoning
        );
        assert_eq!(delta("response.reasoning_text.delta"), Part::Reasoning);
        assert_eq!(
            delta("response.function_call_arguments.delta"),
            Part::ToolArguments(3)
        );
        // The repeats carry no text of their own.
        let view = read_event(&event(json!({"type": "response.output_text.done",
            "text": "CG123456789012345", "output_index": 0})));
        assert!(matches!(view, EventView::Chunk(chunk) if chunk.choices.is_empty()));
        // Another kind of event: canary-shaped text in it is read.
        let view = read_event(&event(json!({"type": "response.audio.transcript.delta",
            "delta": "said CG123456789012345"})));
        let EventView::Chunk(chunk) = view else {
            panic!()
        };
        assert_eq!(chunk.texts().count(), 1);

        let view = read_event(&event(json!({"type": "response.completed", "response": {
            "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "x"}]}],
            "usage": {"input_tokens": 5, "output_tokens": 2}}})));
        let EventView::Final(chunk) = view else {
            panic!("{view:?}")
        };
        assert_eq!(chunk.choices[0].finish_reason.as_deref(), Some("length"));
        assert_eq!(
            chunk.texts().count(),
            0,
            "the final event is not pushed again"
        );
        assert_eq!(chunk.usage.unwrap().prompt_tokens, 5);

        // An error event passes in order; a failed response ends the answer,
        // as a completed one does.
        let failure = json!({"type": "error", "code": "server_error", "message": "boom"});
        assert!(matches!(read_event(&event(failure)), EventView::Chunk(_)));
        let failed = json!({"type": "response.failed",
                            "response": {"status": "failed", "error": {"message": "boom"}}});
        let EventView::Final(chunk) = read_event(&event(failed)) else {
            panic!("a failed response is the answer's end");
        };
        assert_eq!(chunk.choices[0].finish_reason.as_deref(), Some("failed"));
        let not_json = SseEvent {
            data: "nope".into(),
            ..SseEvent::default()
        };
        assert!(matches!(read_event(&not_json), EventView::Malformed));
        assert!(is_end(&event(json!({"type": "response.incomplete"}))));
        assert!(!is_end(&event(
            json!({"type": "response.output_text.done"})
        )));
    }
}
