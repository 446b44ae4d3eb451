//! Where text sits in a Chat Completions answer or stream chunk: each
//! choice's content and tool-call arguments with their location, its
//! finish reason, and the answer's usage.

use canarygate_policies::verify::ProviderUsage;
use serde_json::Value;

use crate::wire::format::{ChoiceView, Location, TextField, TextKind};

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

/// Choice `position` of an answer (`part` = `message`) or chunk (`delta`).
pub fn read_choice(choice: &Value, position: usize, part: &'static str) -> ChoiceView {
    let index = index_of(choice, position);
    let mut texts = Vec::new();
    let message = &choice[part];
    let at = Location::ROOT.key("choices").index(position).key(part);
    if message.get("content").is_some_and(Value::is_string) {
        texts.push(TextField {
            choice: index,
            kind: TextKind::Content,
            at: at.key("content"),
        });
    }
    if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
        for (call_position, call) in calls.iter().enumerate() {
            // Whole answers list calls in order; stream deltas name theirs.
            let call_index = match part {
                "delta" => index_of(call, call_position),
                _ => call_position as u32,
            };
            let arguments = call
                .get("function")
                .and_then(|function| function.get("arguments"));
            if arguments.is_some_and(Value::is_string) {
                texts.push(TextField {
                    choice: index,
                    kind: TextKind::ToolArguments { call: call_index },
                    at: at
                        .key("tool_calls")
                        .index(call_position)
                        .key("function")
                        .key("arguments"),
                });
            }
        }
    }
    ChoiceView {
        index,
        texts,
        finish_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_owned),
    }
}
