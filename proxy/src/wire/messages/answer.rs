//! Where text sits in a Messages answer: its content blocks, read as one
//! choice (Anthropic answers with one).
//!
//! `text` blocks are [`Part::Content`], `thinking` blocks
//! [`Part::Reasoning`] (their `signature` is opaque and passes untouched),
//! and every other string that holds a canary-shaped span (a string in a
//! `tool_use` block's `input` object, a citation, a server tool's result)
//! a [`Part::Other`]. `redacted_thinking` data and signatures are opaque
//! and pass. The stop reason is mapped to Chat's finish reasons for the
//! verifier's finish check ([`finish_reason`]).

use canarygate_policies::canary::find_canaries;
use canarygate_policies::verify::{Part, ProviderUsage};
use serde_json::Value;

use crate::wire::format::{AnswerView, ChoiceView, TextField, TextFields, canary_shaped_names};
use crate::wire::location::{Key, Location};

/// Chat's finish reason for Anthropic's `stop_reason`: `end_turn` and
/// `stop_sequence` stop, `pause_turn` (a server tool's long turn, to be
/// continued by the client) stops too, `max_tokens` and
/// `model_context_window_exceeded` are `length`, `tool_use` is
/// `tool_calls`, `refusal` is `content_filter`; an unknown reason passes
/// as it is.
pub fn finish_reason(stop_reason: &str) -> String {
    match stop_reason {
        "end_turn" | "stop_sequence" | "pause_turn" => "stop",
        "max_tokens" | "model_context_window_exceeded" => "length",
        "tool_use" => "tool_calls",
        "refusal" => "content_filter",
        other => other,
    }
    .to_owned()
}

/// The usage of a whole answer or of a stream's `message_delta`: Anthropic's
/// prompt is `input_tokens` plus the cache's read and written tokens
/// ([`ProviderUsage::from_usage`]).
pub fn usage_of(usage: Option<&Value>) -> Option<ProviderUsage> {
    ProviderUsage::from_usage(usage?)
}

/// Pushes onto `texts` every string under `value` (at `at`) that holds a
/// canary-shaped span, as a [`Part::Other`] field, signatures and ids
/// included (no honest one holds a canary, and another request's fails the
/// answer wherever it is); base64 data is skipped. (A source's `data` is
/// opaque only when it is `base64`: a document's plain-text source, a
/// fetched page's, is text.)
pub fn residual_strings(value: &Value, at: Location, texts: &mut TextFields) {
    match value {
        Value::String(text) if find_canaries(text).next().is_some() => {
            let n = texts.len() as u32;
            texts.push(TextField {
                choice: 0,
                kind: Part::Other(n),
                at,
            });
        }
        Value::Array(items) if at.has_room() => {
            for (position, item) in items.iter().enumerate() {
                residual_strings(item, at.index(position), texts);
            }
        }
        Value::Object(members) if at.has_room() => {
            let base64 = members.get("type").and_then(Value::as_str) == Some("base64");
            for (position, (member, inner)) in members.iter().enumerate() {
                if !(base64 && member == "data") {
                    residual_strings(inner, at.member(position), texts);
                }
            }
        }
        _ => {}
    }
}

/// The text fields of one content block at `at`: its text or thinking, then
/// any other canary-shaped string in it.
pub fn block_texts(block: &Value, at: Location, texts: &mut TextFields) {
    let kind = block.get("type").and_then(Value::as_str).unwrap_or("");
    let own = match kind {
        "text" => Some((Key::Text, Part::Content)),
        "thinking" => Some((Key::Thinking, Part::Reasoning)),
        "redacted_thinking" => return,
        _ => None,
    };
    if let Some((key, part)) = own
        && block.get(key.name()).is_some_and(Value::is_string)
    {
        texts.push(TextField {
            choice: 0,
            kind: part,
            at: at.key(key),
        });
    }
    if let Some(members) = block.as_object() {
        for (position, (member, value)) in members.iter().enumerate() {
            if own.is_some_and(|(key, _)| key.name() == member) {
                continue;
            }
            residual_strings(value, at.member(position), texts);
        }
    }
}

/// A whole `message`, as the verifier reads it: its blocks, and any string
/// of its other members (a provider's own) holding a canary-shaped span.
pub fn read(answer: &Value) -> AnswerView {
    let mut texts = TextFields::new();
    if let Some(blocks) = answer.get("content").and_then(Value::as_array) {
        for (position, block) in blocks.iter().enumerate() {
            block_texts(
                block,
                Location::ROOT.key(Key::Content).index(position),
                &mut texts,
            );
        }
    }
    for (position, (member, value)) in answer.as_object().into_iter().flatten().enumerate() {
        if member != "content" {
            residual_strings(value, Location::ROOT.member(position), &mut texts);
        }
    }
    canary_shaped_names(answer, Location::ROOT, 0, &mut texts);
    AnswerView {
        choices: smallvec::smallvec![ChoiceView {
            index: 0,
            position: 0,
            texts,
            finish_reason: answer
                .get("stop_reason")
                .and_then(Value::as_str)
                .map(finish_reason),
        }],
        usage: usage_of(answer.get("usage")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_fetched_text_and_the_messages_own_members_are_read_base64_is_not() {
        let canary = "CG123456789012345";
        let answer = json!({"type": "message", "provider_note": format!("see {canary}"),
        "content": [
            {"type": "web_fetch_tool_result", "tool_use_id": "srvtoolu_1", "content": {
                "type": "web_fetch_result", "url": "https://x.test/",
                "content": {"type": "document", "source": {"type": "text",
                    "media_type": "text/plain", "data": format!("page text {canary}")}}}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                "data": format!("iVBOR{canary}")}},
        ]});
        let view = read(&answer);
        let read: Vec<&str> = view.choices[0]
            .texts
            .iter()
            .map(|field| field.text(&answer))
            .collect();
        assert_eq!(
            read,
            [format!("page text {canary}"), format!("see {canary}")]
        );
    }

    #[test]
    fn blocks_are_read_as_their_parts() {
        let canary = "CG123456789012345";
        let answer = json!({"type": "message", "content": [
            {"type": "thinking", "thinking": "let me think", "signature": format!("sig{canary}")},
            {"type": "redacted_thinking", "data": format!("{canary}opaque")},
            {"type": "text", "text": "hello", "citations": [{"cited_text": format!("[{canary}]")}]},
            {"type": "tool_use", "id": "toolu_1", "name": "f",
             "input": {"q": format!("see {canary}"), "n": 1, "clean": "x"}},
        ], "stop_reason": "tool_use", "usage": {"input_tokens": 10,
            "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 24, "output_tokens": 7}});
        let view = read(&answer);
        let choice = &view.choices[0];
        assert_eq!(choice.finish_reason.as_deref(), Some("tool_calls"));
        let texts: Vec<(Part, &str)> = choice
            .texts
            .iter()
            .map(|field| (field.kind, field.text(&answer)))
            .collect();
        assert_eq!(
            texts,
            [
                (Part::Reasoning, "let me think"),
                (Part::Other(1), &*format!("sig{canary}")),
                (Part::Content, "hello"),
                (Part::Other(3), &*format!("[{canary}]")),
                (Part::Other(4), &*format!("see {canary}")),
            ]
        );
        assert_eq!(
            view.usage,
            Some(ProviderUsage {
                prompt_tokens: 1034,
                completion_tokens: Some(7),
                cached_prompt_tokens: Some(1000),
            })
        );
    }

    #[test]
    fn stop_reasons_map_to_chats_finish_reasons() {
        for (stop, finish) in [
            ("end_turn", "stop"),
            ("stop_sequence", "stop"),
            ("pause_turn", "stop"),
            ("max_tokens", "length"),
            ("tool_use", "tool_calls"),
            ("refusal", "content_filter"),
        ] {
            assert_eq!(finish_reason(stop), finish);
        }
        assert_eq!(read(&json!({"content": []})).choices[0].finish_reason, None);
    }
}
