//! The client's side of a verified Chat Completions stream: chunks rebuilt
//! from the verified text.

use std::collections::BTreeMap;

use canarygate_policies::sse::encode_data;
use canarygate_policies::verify::Verdict;
use serde_json::{Map, Value, json};

use super::answer::index_of;
use crate::wire::format::{Chunk, StreamEnd, StreamWriter};

/// Identity of a tool call, from its first delta.
#[derive(Debug, Default)]
struct ToolCallHead {
    id: Option<Value>,
    kind: Option<Value>,
    name: Option<Value>,
}

/// The client's side of a verified Chat Completions stream: chunks rebuilt
/// from the verified text, the provider's `id`, `object`, `created`,
/// `model` and `system_fingerprint` kept.
#[derive(Debug, Default)]
pub struct ChatStream {
    /// `id`, `object`, `created`, `model`, `system_fingerprint` of the
    /// provider's first chunk.
    template: Map<String, Value>,
    /// [`Self::chunk_prefix`], once built.
    chunk_prefix: Vec<u8>,
    /// The provider's last usage object.
    usage: Option<Value>,
    tool_calls: BTreeMap<(u32, u32), ToolCallHead>,
    /// Choices whose first chunk (with `role`) went out.
    role_sent: Vec<bool>,
}

impl StreamWriter for ChatStream {
    fn observe(&mut self, chunk: &Chunk) {
        let event = &chunk.event;
        if self.template.is_empty() {
            for field in ["id", "object", "created", "model", "system_fingerprint"] {
                if let Some(value) = event.get(field) {
                    self.template.insert(field.to_owned(), value.clone());
                }
            }
        }
        if event.get("usage").is_some_and(Value::is_object) {
            self.usage = Some(event["usage"].clone());
        }
        let Some(choices) = event.get("choices").and_then(Value::as_array) else {
            return;
        };
        for (position, choice) in choices.iter().enumerate() {
            let index = index_of(choice, position);
            let calls = choice
                .get("delta")
                .and_then(|delta| delta.get("tool_calls"))
                .and_then(Value::as_array);
            let Some(calls) = calls else {
                continue;
            };
            for (call_position, call) in calls.iter().enumerate() {
                let head = self
                    .tool_calls
                    .entry((index, index_of(call, call_position)))
                    .or_default();
                for (slot, pointer) in [
                    (&mut head.id, "/id"),
                    (&mut head.kind, "/type"),
                    (&mut head.name, "/function/name"),
                ] {
                    if let Some(value) = call.pointer(pointer).filter(|v| !v.is_null()) {
                        *slot = Some(value.clone());
                    }
                }
            }
        }
    }

    /// The hot path of a stream: one content delta, written straight out.
    fn content(&mut self, choice: u32, text: &str, out: &mut Vec<u8>) {
        let role = self.take_role(choice);
        self.emit_with(out, |out| {
            out.extend_from_slice(b"[{\"index\":");
            out.extend_from_slice(choice.to_string().as_bytes());
            out.extend_from_slice(b",\"delta\":{");
            if role {
                out.extend_from_slice(b"\"role\":\"assistant\",");
            }
            out.extend_from_slice(b"\"content\":");
            // A string always serialises.
            let _ = serde_json::to_writer(&mut *out, text);
            out.extend_from_slice(b"},\"logprobs\":null,\"finish_reason\":null}]");
        });
    }

    fn finish(&mut self, end: &StreamEnd<'_>, out: &mut Vec<u8>) {
        for (index, text) in end.finished.release.iter().enumerate() {
            if !text.is_empty() {
                self.content(index as u32, text, out);
            }
        }
        for tool in &end.finished.tool_arguments {
            self.emit_tool_call(tool.choice, tool.tool_call, &tool.arguments, out);
        }
        for (index, reason) in end.finish_reasons.iter().enumerate() {
            let mut delta = Map::new();
            if self.take_role(index as u32) {
                delta.insert("role".into(), json!("assistant"));
            }
            self.emit_choices(
                out,
                &json!([{
                    "index": index, "delta": delta, "logprobs": null, "finish_reason": reason,
                }]),
            );
        }
        if end.client_wants_usage
            && let Some(usage) = self.usage.clone()
        {
            let mut chunk = self.chunk_base();
            chunk.insert("choices".into(), json!([]));
            chunk.insert("usage".into(), usage);
            encode_data(&Value::Object(chunk).to_string(), out);
        }
    }

    fn done(&self, verdict: &Verdict) -> Vec<u8> {
        let mut tail = b": x-canarygate-verdict ".to_vec();
        tail.extend_from_slice(verdict.header_value().as_bytes());
        tail.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        tail
    }
}

impl ChatStream {
    fn chunk_base(&self) -> Map<String, Value> {
        let mut chunk = self.template.clone();
        chunk
            .entry("object")
            .or_insert_with(|| json!("chat.completion.chunk"));
        chunk
    }

    /// `data: {"id":…,"object":…,"created":…,"model":…,"choices":` of every
    /// rebuilt chunk, serialised once per stream.
    fn chunk_prefix(&mut self) -> &[u8] {
        if self.chunk_prefix.is_empty() {
            let mut prefix = b"data: ".to_vec();
            let base = Value::Object(self.chunk_base());
            // A map of plain values always serialises.
            let _ = serde_json::to_writer(&mut prefix, &base);
            prefix.pop(); // the closing brace
            if prefix.last() != Some(&b'{') {
                prefix.push(b',');
            }
            prefix.extend_from_slice(b"\"choices\":");
            self.chunk_prefix = prefix;
        }
        &self.chunk_prefix
    }

    /// Appends one chunk event whose `choices` is written by `choices`.
    fn emit_with(&mut self, out: &mut Vec<u8>, choices: impl FnOnce(&mut Vec<u8>)) {
        out.extend_from_slice(self.chunk_prefix());
        choices(out);
        out.extend_from_slice(b"}\n\n");
    }

    fn emit_choices(&mut self, out: &mut Vec<u8>, choices: &Value) {
        // JSON values always serialise.
        self.emit_with(out, |out| drop(serde_json::to_writer(out, choices)));
    }

    /// Whether the next delta of choice `index` is its first (and carries `role`).
    fn take_role(&mut self, index: u32) -> bool {
        let index = index as usize;
        if self.role_sent.len() <= index {
            self.role_sent.resize(index + 1, false);
        }
        !std::mem::replace(&mut self.role_sent[index], true)
    }

    fn emit_tool_call(&mut self, index: u32, call_index: u32, arguments: &str, out: &mut Vec<u8>) {
        let head = self
            .tool_calls
            .remove(&(index, call_index))
            .unwrap_or_default();
        let mut call = Map::new();
        call.insert("index".into(), json!(call_index));
        if let Some(id) = head.id {
            call.insert("id".into(), id);
        }
        call.insert(
            "type".into(),
            head.kind.unwrap_or_else(|| json!("function")),
        );
        let mut function = Map::new();
        if let Some(name) = head.name {
            function.insert("name".into(), name);
        }
        function.insert("arguments".into(), json!(arguments));
        call.insert("function".into(), Value::Object(function));
        let mut delta = Map::new();
        if self.take_role(index) {
            delta.insert("role".into(), json!("assistant"));
        }
        delta.insert("tool_calls".into(), json!([call]));
        self.emit_choices(
            out,
            &json!([{
                "index": index, "delta": delta, "logprobs": null, "finish_reason": null,
            }]),
        );
    }
}
