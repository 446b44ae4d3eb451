//! An Anthropic Messages answer, rendered: the `message` object and the
//! events of its stream, in Anthropic's order.
//!
//! Content blocks: a `thinking` block (with a `signature`) when the model
//! thought, then one `text` block, or one `tool_use` block per call (its
//! `input` the parsed arguments; `{}` when the budget cut them mid-JSON).
//! `stop_reason`: `end_turn`, `max_tokens` or `tool_use`. Usage as Anthropic
//! reports it with prompt caching: `input_tokens` counts only what was
//! neither read from nor written to the cache.
//!
//! Stream: `message_start` (the message with empty content and the input
//! usage), then per block `content_block_start`, its deltas (`thinking_delta`
//! then one `signature_delta`, `text_delta`, or `input_json_delta`) and
//! `content_block_stop`, a `ping` after the first block starts, then
//! `message_delta` (`stop_reason` and cumulative usage) and `message_stop`.
//! Every event has an `event:` line naming its `type`.

use serde_json::{Value, json};

use super::request::thinking_signature;
use crate::answer::{Answer, Call, Said};
use crate::delivery::{Frames, event_frame};
use crate::error::OVERLOADED_MESSAGE;

/// What a message is rendered from.
pub struct Rendering<'a> {
    pub id: &'a str,
    pub model: &'a str,
    pub answer: &'a Answer,
    /// Prompt tokens read from the cache.
    pub cache_read: u64,
    /// Prompt tokens written to the cache.
    pub cache_written: u64,
    /// The writes were for the one-hour cache.
    pub hour_cache: bool,
}

/// One content block.
enum Block<'a> {
    Thinking(&'a [String]),
    Text(&'a [String]),
    ToolUse(&'a Call),
}

impl Rendering<'_> {
    fn blocks(&self) -> Vec<Block<'_>> {
        let Some(choice) = self.answer.choices().first() else {
            return Vec::new();
        };
        let mut blocks = Vec::new();
        if !choice.reasoning.is_empty() {
            blocks.push(Block::Thinking(&choice.reasoning));
        }
        match &choice.said {
            // A budget spent (on thinking, or `max_tokens: 0`) leaves no text block.
            Said::Content(tokens) if tokens.is_empty() && choice.finish_reason == "length" => {}
            Said::Content(tokens) => blocks.push(Block::Text(tokens)),
            Said::Calls { calls, .. } => blocks.extend(calls.iter().map(Block::ToolUse)),
        }
        blocks
    }

    fn stop_reason(&self) -> &'static str {
        match self
            .answer
            .choices()
            .first()
            .map(|choice| choice.finish_reason)
        {
            Some("length") => "max_tokens",
            Some("tool_calls" | "function_call") => "tool_use",
            _ => "end_turn",
        }
    }

    /// A thinking block's signature: opaque, and bound to the thinking
    /// ([`thinking_signature`]).
    fn signature(&self, thinking: &[String]) -> String {
        thinking_signature(self.id, &thinking.concat())
    }

    fn tool_id(call: &Call) -> String {
        format!(
            "toolu_{}",
            call.id.strip_prefix("call_").unwrap_or(&call.id)
        )
    }

    fn block_json(&self, block: &Block<'_>) -> Value {
        match block {
            Block::Thinking(tokens) => json!({"type": "thinking", "thinking": tokens.concat(),
                                              "signature": self.signature(tokens)}),
            Block::Text(tokens) => json!({"type": "text", "text": tokens.concat()}),
            Block::ToolUse(call) => {
                let input: Value = serde_json::from_str(&call.arguments())
                    .ok()
                    .filter(Value::is_object)
                    .unwrap_or_else(|| json!({}));
                json!({"type": "tool_use", "id": Self::tool_id(call), "name": call.name,
                       "input": input})
            }
        }
    }

    /// The uncached input tokens.
    fn input_tokens(&self) -> u64 {
        self.answer
            .prompt_tokens
            .saturating_sub(self.cache_read + self.cache_written)
    }

    fn usage(&self, output_tokens: u64) -> Value {
        let (five_minutes, hour) = if self.hour_cache {
            (0, self.cache_written)
        } else {
            (self.cache_written, 0)
        };
        json!({
            "input_tokens": self.input_tokens(),
            "cache_creation_input_tokens": self.cache_written,
            "cache_read_input_tokens": self.cache_read,
            "cache_creation": {
                "ephemeral_5m_input_tokens": five_minutes,
                "ephemeral_1h_input_tokens": hour,
            },
            "output_tokens": output_tokens,
            "service_tier": "standard",
        })
    }

    fn object(&self, content: Vec<Value>, stop_reason: Value, output_tokens: u64) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": null,
            "usage": self.usage(output_tokens),
        })
    }

    /// The whole `message`.
    pub fn message(&self) -> Value {
        let content = self
            .blocks()
            .iter()
            .map(|block| self.block_json(block))
            .collect();
        self.object(
            content,
            json!(self.stop_reason()),
            self.answer.completion_tokens(),
        )
    }

    /// The events of the streamed message, encoded.
    pub fn frames(&self) -> Frames {
        let event = |data: Value| {
            let kind = data["type"].as_str().unwrap_or("").to_owned();
            event_frame(&kind, &data)
        };
        let start =
            json!({"type": "message_start", "message": self.object(Vec::new(), Value::Null, 1)});
        let mut steps: Vec<Vec<Value>> = Vec::new();
        for (index, block) in self.blocks().iter().enumerate() {
            let delta = |delta: Value| json!({"type": "content_block_delta", "index": index, "delta": delta});
            let opening = match block {
                Block::Thinking(_) => json!({"type": "thinking", "thinking": "", "signature": ""}),
                Block::Text(_) => json!({"type": "text", "text": ""}),
                Block::ToolUse(call) => json!({"type": "tool_use", "id": Self::tool_id(call),
                                               "name": call.name, "input": {}}),
            };
            let mut block_steps: Vec<Vec<Value>> = match block {
                Block::Thinking(tokens) => tokens
                    .iter()
                    .map(|token| vec![delta(json!({"type": "thinking_delta", "thinking": token}))])
                    .collect(),
                Block::Text(tokens) => tokens
                    .iter()
                    .map(|token| vec![delta(json!({"type": "text_delta", "text": token}))])
                    .collect(),
                // The name costs a token (the start); then one per fragment.
                Block::ToolUse(call) => std::iter::once(Vec::new())
                    .chain(call.fragments.iter().map(|fragment| {
                        vec![delta(
                            json!({"type": "input_json_delta", "partial_json": fragment}),
                        )]
                    }))
                    .collect(),
            };
            if block_steps.is_empty() {
                block_steps.push(Vec::new());
            }
            let mut head = vec![
                json!({"type": "content_block_start", "index": index, "content_block": opening}),
            ];
            if index == 0 {
                head.push(json!({"type": "ping"}));
            }
            head.append(&mut block_steps[0]);
            block_steps[0] = head;
            let last = block_steps.len() - 1;
            if let Block::Thinking(tokens) = block {
                block_steps[last].push(delta(json!({"type": "signature_delta",
                                                    "signature": self.signature(tokens)})));
            }
            block_steps[last].push(json!({"type": "content_block_stop", "index": index}));
            steps.extend(block_steps);
        }
        let mut usage = self.usage(self.answer.completion_tokens());
        if let Some(fields) = usage.as_object_mut() {
            fields.retain(|key, _| {
                matches!(
                    key.as_str(),
                    "input_tokens"
                        | "cache_creation_input_tokens"
                        | "cache_read_input_tokens"
                        | "output_tokens"
                )
            });
        }
        let closing = vec![
            json!({"type": "message_delta", "delta": {"stop_reason": self.stop_reason(),
                   "stop_sequence": null}, "usage": usage}),
            json!({"type": "message_stop"}),
        ];
        let failure = json!({"type": "error", "error": {"type": "overloaded_error",
                             "message": OVERLOADED_MESSAGE}});
        Frames {
            opening: vec![event(start)],
            steps: steps
                .into_iter()
                .map(|step| step.into_iter().map(event).collect())
                .collect(),
            closing: closing.into_iter().map(event).collect(),
            failure: vec![event(failure)],
            content_type: "text/event-stream; charset=utf-8",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::Compose;
    use crate::model::Segment;
    use crate::request::{CallChoice, FunctionSpec, Generation, Tooling};

    fn answer(generation: &Generation) -> Answer {
        let context = [
            Segment {
                role: "system".into(),
                text: "Begin your reply with \"CG-9\" now.".into(),
            },
            Segment {
                role: "user".into(),
                text: "use get_weather for Oslo".into(),
            },
        ];
        Answer::compose(Compose {
            id: "msg_sim000000000001".into(),
            created: 7,
            generation,
            context: &context,
            prompt_tokens: 1500,
            cached_tokens: 1024,
        })
    }

    fn rendering(answer: &Answer) -> Rendering<'_> {
        Rendering {
            id: "msg_sim000000000001",
            model: "sim-model",
            answer,
            cache_read: 1024,
            cache_written: 128,
            hour_cache: true,
        }
    }

    #[test]
    fn usage_splits_the_prompt_as_anthropic_does() {
        let answer = answer(&Generation::plain("sim-model"));
        let message = rendering(&answer).message();
        let usage = &message["usage"];
        assert_eq!(usage["input_tokens"], 1500 - 1024 - 128);
        assert_eq!(usage["cache_read_input_tokens"], 1024);
        assert_eq!(usage["cache_creation_input_tokens"], 128);
        assert_eq!(usage["cache_creation"]["ephemeral_1h_input_tokens"], 128);
        assert_eq!(usage["cache_creation"]["ephemeral_5m_input_tokens"], 0);
        assert!(
            message["content"][0]["text"]
                .as_str()
                .unwrap()
                .starts_with("CG-9 You wrote:")
        );
    }

    #[test]
    fn a_spent_budget_leaves_no_empty_text_block() {
        let generation = Generation {
            max_tokens: Some(0),
            ..Generation::plain("sim-model")
        };
        let answer = answer(&generation);
        let message = rendering(&answer).message();
        assert_eq!(message["content"], json!([]));
        assert_eq!(message["stop_reason"], "max_tokens");
        let thinking = Generation {
            max_tokens: Some(5),
            thinks: true,
            ..Generation::plain("sim-model")
        };
        let answer = self::answer(&thinking);
        let message = rendering(&answer).message();
        let kinds: Vec<&Value> = message["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| &b["type"])
            .collect();
        assert_eq!(kinds, [&json!("thinking")]);
    }

    #[test]
    fn a_cut_tool_call_streams_partial_json_and_keeps_an_object_input() {
        let generation = Generation {
            max_tokens: Some(4),
            tooling: Some(Tooling {
                functions: vec![FunctionSpec {
                    name: "get_weather".into(),
                    parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
                }],
                choice: CallChoice::Required,
                legacy: false,
                parallel: true,
            }),
            ..Generation::plain("sim-model")
        };
        let answer = answer(&generation);
        let rendering = rendering(&answer);
        let message = rendering.message();
        assert_eq!(message["stop_reason"], "max_tokens");
        assert_eq!(message["content"][0]["input"], json!({}), "cut mid-JSON");
        let frames = rendering.frames();
        assert_eq!(
            frames.steps.len(),
            4,
            "a token for the name, one per fragment"
        );
        let text: String = frames
            .steps
            .iter()
            .flatten()
            .map(|frame| String::from_utf8_lossy(frame).into_owned())
            .collect();
        assert!(
            text.contains("input_json_delta") && text.contains("\"index\":0"),
            "{text}"
        );
    }
}
