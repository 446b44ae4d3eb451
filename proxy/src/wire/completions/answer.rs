//! Where text sits in a completions answer or stream chunk: each choice's
//! `text` (its content), any other string of the choice that holds a
//! canary-shaped span, its finish reason; the answer's usage.

use canarygate_policies::sse::SseEvent;
use canarygate_policies::verify::Part;
use serde_json::Value;

use crate::wire::chat::{
    index_of, map_choices, read_chunk_tree, read_only_strings, residual_members, usage_of,
};
use crate::wire::format::{AnswerView, ChoiceView, Choices, EventView, TextField, TextFields};
use crate::wire::location::{Key, Location};

/// Members of a choice read on their own: the text, and what is not model
/// output (`logprobs` follow the text, [`super::logprobs`], their tokens
/// read only). The finish reason is a string like any other: scanned when
/// canary-shaped.
const KNOWN: [&str; 3] = ["text", "index", "logprobs"];

/// Choice `position` of an answer's or chunk's `choices`.
pub fn read_choice(choice: &Value, position: usize) -> ChoiceView {
    let index = index_of(choice, position);
    let at = Location::ROOT.key(Key::Choices).index(position);
    let mut texts = TextFields::new();
    if choice.get("text").is_some_and(Value::is_string) {
        texts.push(TextField {
            choice: index,
            kind: Part::Content,
            at: at.key(Key::Text),
        });
    }
    // A provider's own fields (SGLang's `matched_stop`, vLLM's
    // `stop_reason`) may repeat prompt or output text.
    residual_members(choice, at, index, |key| KNOWN.contains(&key), &mut texts);
    if let Some((logprobs_at, logprobs)) = at.named(choice, "logprobs") {
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

/// The choices of `value`'s `choices`.
fn choices_of(value: &Value) -> Choices {
    map_choices(value, read_choice)
}

/// A whole `text_completion` answer.
pub fn read_answer(answer: &Value) -> AnswerView {
    AnswerView {
        choices: choices_of(answer),
        usage: usage_of(answer),
    }
}

/// One event of a completions stream: chunks, an `{"error": …}` event, or
/// `[DONE]`.
pub fn read_event(event: &SseEvent) -> EventView {
    if event.is_done() {
        return EventView::Done;
    }
    read_chunk_tree(&event.data, choices_of)
}

#[cfg(test)]
mod tests {
    use super::*;
    use canarygate_policies::verify::ProviderUsage;
    use serde_json::json;

    #[test]
    fn each_choice_text_is_its_content_and_stray_canaries_are_read_too() {
        let canary = "CG123456789012345";
        let answer = json!({"object": "text_completion", "choices": [
            {"index": 0, "text": "one", "logprobs": null, "finish_reason": "stop"},
            {"index": 1, "text": "two", "logprobs": {"tokens": ["two"]}, "finish_reason": "length",
             "matched_stop": format!("[{canary}]")},
        ], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}});
        let view = read_answer(&answer);
        assert_eq!(view.choices.len(), 2);
        let texts: Vec<(u32, Part, &str)> = view
            .choices
            .iter()
            .flat_map(|choice| &choice.texts)
            .map(|field| (field.choice, field.kind, field.text(&answer)))
            .collect();
        let stray = format!("[{canary}]");
        assert_eq!(
            texts,
            [
                (0, Part::Content, "one"),
                (1, Part::Content, "two"),
                (1, Part::Other(1), stray.as_str()),
            ]
        );
        assert_eq!(view.choices[1].finish_reason.as_deref(), Some("length"));
        assert_eq!(
            view.usage,
            Some(ProviderUsage {
                prompt_tokens: 9,
                completion_tokens: Some(2),
                cached_prompt_tokens: None,
            })
        );
    }

    #[test]
    fn stream_events_are_chunks_errors_or_the_end() {
        let event = |data: &str| SseEvent {
            data: data.to_owned(),
            ..SseEvent::default()
        };
        let EventView::Chunk(chunk) = read_event(&event(
            r#"{"object":"text_completion","choices":[{"index":3,"text":"hi","finish_reason":null}]}"#,
        )) else {
            panic!("a chunk");
        };
        assert_eq!(chunk.choices[0].index, 3);
        assert_eq!(chunk.texts().next().unwrap().text(&chunk.event), "hi");
        assert!(matches!(read_event(&event("[DONE]")), EventView::Done));
        assert!(matches!(read_event(&event("nope")), EventView::Malformed));
        assert!(matches!(
            read_event(&event(r#"{"error":{"message":"overloaded"}}"#)),
            EventView::Error(message) if message == "overloaded"
        ));
    }
}
