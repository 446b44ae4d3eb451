//! A Responses API answer, rendered: the `response` object and the typed
//! events of its stream, in the order OpenAI sends them.
//!
//! Output items, in order: a `reasoning` item when the model thought (its
//! `summary` filled only when the request asked for one, as OpenAI does),
//! then a `message` with one `output_text` part, or one `function_call` per
//! call. A budget that ran out makes the response `incomplete`
//! (`incomplete_details.reason: "max_output_tokens"`).
//!
//! Stream: `response.created`, `response.in_progress`, then per item
//! `response.output_item.added`, its content events and
//! `response.output_item.done`; for a message `response.content_part.added`,
//! `response.output_text.delta`s, `response.output_text.done`,
//! `response.content_part.done`; for reasoning with a summary
//! `response.reasoning_summary_part.added`,
//! `response.reasoning_summary_text.delta`s and `.done`,
//! `response.reasoning_summary_part.done`; for a call
//! `response.function_call_arguments.delta`s and `.done`; then
//! `response.completed` (or `response.incomplete`). Every event has an
//! `event:` line and a `sequence_number` from 0; no `[DONE]`. Each token is
//! one decode step; an item's opening events go with its first token, its
//! closing events with its last.

use axum::body::Bytes;
use serde_json::{Value, json};

use super::request::ResponsesRequest;
use crate::answer::{Answer, Call, Said, logprob_entries};
use crate::delivery::{Frames, event_frame, midpoint};
use crate::error::OVERLOADED_MESSAGE;
use crate::hash;

/// What a response is rendered from.
pub struct Rendering<'a> {
    pub id: &'a str,
    pub created_at: u64,
    pub request: &'a ResponsesRequest,
    pub answer: &'a Answer,
}

/// One output item.
enum Item<'a> {
    Reasoning { id: String, tokens: &'a [String] },
    Message { id: String, tokens: &'a [String] },
    Call { id: String, call: &'a Call },
}

impl Rendering<'_> {
    fn item_id(&self, prefix: &str, index: usize) -> String {
        let seed = |salt: &[u8]| hash::of(&[self.id.as_bytes(), &index.to_le_bytes(), salt]);
        format!(
            "{prefix}_{:016x}{:016x}{:016x}",
            seed(b"a"),
            seed(b"b"),
            seed(b"c")
        )
    }

    fn items(&self) -> Vec<Item<'_>> {
        let Some(choice) = self.answer.choices().first() else {
            return Vec::new();
        };
        let mut items = Vec::new();
        if !choice.reasoning.is_empty() {
            items.push(Item::Reasoning {
                id: self.item_id("rs", 0),
                tokens: &choice.reasoning,
            });
        }
        match &choice.said {
            // A budget spent on reasoning leaves no message.
            Said::Content(tokens) if tokens.is_empty() && self.incomplete() => {}
            Said::Content(tokens) => items.push(Item::Message {
                id: self.item_id("msg", items.len()),
                tokens,
            }),
            Said::Calls { calls, .. } => {
                for call in calls {
                    items.push(Item::Call {
                        id: self.item_id("fc", items.len()),
                        call,
                    });
                }
            }
        }
        items
    }

    fn incomplete(&self) -> bool {
        self.answer
            .choices()
            .first()
            .is_some_and(|choice| choice.finish_reason == "length")
    }

    /// `completed` or `incomplete`.
    pub fn status(&self) -> &'static str {
        if self.incomplete() {
            "incomplete"
        } else {
            "completed"
        }
    }

    fn logprobs(&self, tokens: &[String], position: usize) -> Value {
        match self.answer_top_logprobs() {
            Some(top) => json!(logprob_entries(tokens, position, top)),
            None => json!([]),
        }
    }

    fn answer_top_logprobs(&self) -> Option<usize> {
        self.request.generation.top_logprobs
    }

    /// An item as `response.output_item.added` (`done: false`) or in the
    /// finished output.
    fn item_json(&self, item: &Item<'_>, done: bool) -> Value {
        let status = match (done, self.incomplete()) {
            (false, _) => "in_progress",
            (true, true) => "incomplete",
            (true, false) => "completed",
        };
        match item {
            Item::Reasoning { id, tokens } => {
                let summary = if done && self.request.summary {
                    json!([{"type": "summary_text", "text": tokens.concat()}])
                } else {
                    json!([])
                };
                json!({"id": id, "type": "reasoning", "summary": summary})
            }
            Item::Message { id, tokens } => {
                let content = if done {
                    json!([self.text_part(tokens)])
                } else {
                    json!([])
                };
                json!({"id": id, "type": "message", "status": status, "content": content,
                       "role": "assistant"})
            }
            Item::Call { id, call } => {
                let arguments = if done {
                    call.arguments()
                } else {
                    String::new()
                };
                json!({"id": id, "type": "function_call", "status": status,
                       "arguments": arguments, "call_id": call.id, "name": call.name})
            }
        }
    }

    fn text_part(&self, tokens: &[String]) -> Value {
        json!({"type": "output_text", "annotations": [], "logprobs": self.logprobs(tokens, 0),
               "text": tokens.concat()})
    }

    fn usage(&self) -> Value {
        let input = self.answer.prompt_tokens;
        let output = self.answer.completion_tokens();
        json!({
            "input_tokens": input,
            "input_tokens_details": {"cached_tokens": self.answer.cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": self.answer.reasoning_tokens()},
            "total_tokens": input + output,
        })
    }

    /// The `response` object with `status`: `in_progress` has no output
    /// and no usage yet, `failed` its error.
    fn object(&self, status: &str) -> Value {
        let finished = matches!(status, "completed" | "incomplete");
        let output: Vec<Value> = if finished {
            self.items()
                .iter()
                .map(|item| self.item_json(item, true))
                .collect()
        } else {
            Vec::new()
        };
        let echo = &self.request.echo;
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": false,
            "error": if status == "failed" {
                json!({"code": "server_error", "message": OVERLOADED_MESSAGE})
            } else {
                Value::Null
            },
            "incomplete_details": if status == "incomplete" {
                json!({"reason": "max_output_tokens"})
            } else {
                Value::Null
            },
            "instructions": self.request.instructions,
            "max_output_tokens": echo["max_output_tokens"],
            "max_tool_calls": null,
            "model": self.request.generation.model,
            "output": output,
            "parallel_tool_calls": echo["parallel_tool_calls"],
            "previous_response_id": self.request.previous_response_id,
            "prompt_cache_key": null,
            "reasoning": echo["reasoning"],
            "safety_identifier": null,
            "service_tier": "default",
            "store": self.request.store,
            "temperature": echo["temperature"],
            "text": echo["text"],
            "tool_choice": echo["tool_choice"],
            "tools": echo["tools"],
            "top_logprobs": echo["top_logprobs"],
            "top_p": echo["top_p"],
            "truncation": echo["truncation"],
            "usage": if finished { self.usage() } else { Value::Null },
            "user": echo["user"],
            "metadata": echo["metadata"],
        })
    }

    /// The finished `response` object.
    pub fn response(&self) -> Value {
        self.object(self.status())
    }

    /// The `response` object of a stream that failed mid-way.
    pub fn failed(&self) -> Value {
        self.object("failed")
    }

    /// A delta event's `obfuscation` padding, when the stream carries it.
    fn pad(&self, event: &mut Value, step: usize) {
        if self.request.generation.include_obfuscation {
            let seed = hash::of(&[self.id.as_bytes(), &step.to_le_bytes(), b"obfuscation"]);
            event["obfuscation"] = json!(hash::alphanumeric(seed, 1 + (seed % 15) as usize));
        }
    }

    /// The item events, one step per token (see the module docs).
    fn steps(&self) -> Vec<Vec<Value>> {
        let mut steps: Vec<Vec<Value>> = Vec::new();
        for (output_index, item) in self.items().iter().enumerate() {
            let added = json!({"type": "response.output_item.added", "output_index": output_index,
                               "item": self.item_json(item, false)});
            let done = json!({"type": "response.output_item.done", "output_index": output_index,
                              "item": self.item_json(item, true)});
            let (mut item_steps, opening, closing) = match item {
                Item::Reasoning { id, tokens } => self.reasoning_steps(id, output_index, tokens),
                Item::Message { id, tokens } => self.message_steps(id, output_index, tokens),
                Item::Call { id, call } => self.call_steps(id, output_index, call),
            };
            if item_steps.is_empty() {
                item_steps.push(Vec::new());
            }
            let first = item_steps
                .first_mut()
                .map(std::mem::take)
                .unwrap_or_default();
            item_steps[0] = std::iter::once(added).chain(opening).chain(first).collect();
            if let Some(last) = item_steps.last_mut() {
                last.extend(closing);
                last.push(done);
            }
            steps.extend(item_steps);
        }
        steps
    }

    /// A reasoning item's token steps, the events that open its content
    /// and those that close it.
    fn reasoning_steps(
        &self,
        id: &str,
        output_index: usize,
        tokens: &[String],
    ) -> (Vec<Vec<Value>>, Vec<Value>, Vec<Value>) {
        if !self.request.summary {
            // Hidden thinking: its tokens take time and send nothing.
            return (vec![Vec::new(); tokens.len()], Vec::new(), Vec::new());
        }
        let at = json!({"item_id": id, "output_index": output_index, "summary_index": 0});
        let with = |mut event: Value, fields: Value| {
            for (key, value) in at
                .as_object()
                .into_iter()
                .flatten()
                .chain(fields.as_object().into_iter().flatten())
            {
                event[key] = value.clone();
            }
            event
        };
        let text = tokens.concat();
        let steps = tokens
            .iter()
            .enumerate()
            .map(|(position, token)| {
                let mut delta = with(
                    json!({"type": "response.reasoning_summary_text.delta"}),
                    json!({"delta": token}),
                );
                self.pad(&mut delta, position);
                vec![delta]
            })
            .collect();
        let part = json!({"type": "summary_text", "text": ""});
        let opening = vec![with(
            json!({"type": "response.reasoning_summary_part.added"}),
            json!({"part": part}),
        )];
        let closing = vec![
            with(
                json!({"type": "response.reasoning_summary_text.done"}),
                json!({"text": text}),
            ),
            with(
                json!({"type": "response.reasoning_summary_part.done"}),
                json!({"part": {"type": "summary_text", "text": text}}),
            ),
        ];
        (steps, opening, closing)
    }

    fn message_steps(
        &self,
        id: &str,
        output_index: usize,
        tokens: &[String],
    ) -> (Vec<Vec<Value>>, Vec<Value>, Vec<Value>) {
        let at = |kind: &str| json!({"type": kind, "item_id": id, "output_index": output_index, "content_index": 0});
        let steps = tokens
            .iter()
            .enumerate()
            .map(|(position, token)| {
                let mut delta = at("response.output_text.delta");
                delta["delta"] = json!(token);
                delta["logprobs"] = self.logprobs(std::slice::from_ref(token), position);
                self.pad(&mut delta, 1_000_000 + position);
                vec![delta]
            })
            .collect();
        let mut added = at("response.content_part.added");
        added["part"] =
            json!({"type": "output_text", "annotations": [], "logprobs": [], "text": ""});
        let mut text_done = at("response.output_text.done");
        text_done["text"] = json!(tokens.concat());
        text_done["logprobs"] = self.logprobs(tokens, 0);
        let mut part_done = at("response.content_part.done");
        part_done["part"] = self.text_part(tokens);
        (steps, vec![added], vec![text_done, part_done])
    }

    fn call_steps(
        &self,
        id: &str,
        output_index: usize,
        call: &Call,
    ) -> (Vec<Vec<Value>>, Vec<Value>, Vec<Value>) {
        let at = |kind: &str| json!({"type": kind, "item_id": id, "output_index": output_index});
        // The name costs a token: the step of `output_item.added`.
        let mut steps = vec![Vec::new()];
        for (position, fragment) in call.fragments.iter().enumerate() {
            let mut delta = at("response.function_call_arguments.delta");
            delta["delta"] = json!(fragment);
            self.pad(&mut delta, 2_000_000 + output_index * 10_000 + position);
            steps.push(vec![delta]);
        }
        let mut done = at("response.function_call_arguments.done");
        done["arguments"] = json!(call.arguments());
        (steps, Vec::new(), vec![done])
    }

    /// The events of the streamed response, numbered and encoded.
    pub fn frames(&self) -> Frames {
        let snapshot = self.object("in_progress");
        let opening = vec![
            json!({"type": "response.created", "response": snapshot}),
            json!({"type": "response.in_progress", "response": snapshot}),
        ];
        let steps = self.steps();
        let status = self.status();
        let closing =
            vec![json!({"type": format!("response.{status}"), "response": self.response()})];
        let mut failure = vec![
            json!({"type": "error", "code": "server_error", "message": OVERLOADED_MESSAGE, "param": null}),
            json!({"type": "response.failed", "response": self.failed()}),
        ];
        // Sequence numbers run through what is sent: a failure follows
        // the first half of the steps.
        let mut sequence = 0_u64;
        let number = |events: Vec<Value>, sequence: &mut u64| -> Vec<Bytes> {
            events
                .into_iter()
                .map(|mut event| {
                    event["sequence_number"] = json!(*sequence);
                    *sequence += 1;
                    let kind = event["type"].as_str().unwrap_or("").to_owned();
                    event_frame(&kind, &event)
                })
                .collect()
        };
        let opening = number(opening, &mut sequence);
        let half = midpoint(steps.len());
        let mut failure_at = sequence + steps[..half].iter().map(Vec::len).sum::<usize>() as u64;
        let steps: Vec<Vec<Bytes>> = steps
            .into_iter()
            .map(|step| number(step, &mut sequence))
            .collect();
        let closing = number(closing, &mut sequence);
        let failure = number(std::mem::take(&mut failure), &mut failure_at);
        Frames {
            opening,
            steps,
            closing,
            failure,
            content_type: "text/event-stream; charset=utf-8",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::Compose;
    use crate::model::Segment;

    fn request(body: Value) -> ResponsesRequest {
        ResponsesRequest::parse(body.to_string().as_bytes()).unwrap()
    }

    fn answer(request: &ResponsesRequest) -> Answer {
        let context = [Segment {
            role: "user".into(),
            text: "chart the northern reef".into(),
        }];
        Answer::compose(Compose {
            id: "resp_sim000000000001".into(),
            created: 7,
            generation: &request.generation,
            context: &context,
            prompt_tokens: 12,
            cached_tokens: 0,
        })
    }

    fn events(frames: &[Bytes]) -> Vec<Value> {
        frames
            .iter()
            .map(|frame| {
                let text = std::str::from_utf8(frame).unwrap();
                let data = text
                    .lines()
                    .find_map(|line| line.strip_prefix("data: "))
                    .unwrap();
                serde_json::from_str(data).unwrap()
            })
            .collect()
    }

    #[test]
    fn logprobs_come_when_included_and_join_to_the_text() {
        let request = request(json!({"model": "sim-model", "input": "x",
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}));
        let answer = answer(&request);
        let rendering = Rendering {
            id: "resp_sim000000000001",
            created_at: 7,
            request: &request,
            answer: &answer,
        };
        let part = &rendering.response()["output"][0]["content"][0];
        let tokens: String = part["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|entry| entry["token"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(tokens, part["text"].as_str().unwrap());
        assert_eq!(
            part["logprobs"][0]["top_logprobs"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        let frames = rendering.frames();
        let streamed: Vec<Value> = events(&frames.steps.concat())
            .into_iter()
            .filter(|event| event["type"] == "response.output_text.delta")
            .flat_map(|event| event["logprobs"].as_array().unwrap().clone())
            .collect();
        assert_eq!(
            &streamed,
            part["logprobs"].as_array().unwrap(),
            "the same numbers streamed"
        );
    }

    #[test]
    fn a_budget_spent_on_reasoning_leaves_only_the_reasoning_item() {
        let request =
            request(json!({"model": "sim-reasoner", "input": "x", "max_output_tokens": 16}));
        let answer = answer(&request);
        let rendering = Rendering {
            id: "resp_sim000000000001",
            created_at: 7,
            request: &request,
            answer: &answer,
        };
        let response = rendering.response();
        assert_eq!(response["status"], "incomplete");
        let output = response["output"].as_array().unwrap();
        assert_eq!(output.len(), 1);
        assert_eq!(output[0]["type"], "reasoning");
        assert_eq!(
            response["usage"]["output_tokens_details"]["reasoning_tokens"],
            16
        );
        // Streamed: one step per hidden reasoning token, then response.incomplete.
        let frames = rendering.frames();
        assert_eq!(frames.steps.len(), 16);
        let closing = events(&frames.closing);
        assert_eq!(closing[0]["type"], "response.incomplete");
        // The failure after half the steps continues the numbering.
        let failure = events(&frames.failure);
        let sent = events(&frames.opening).len() + events(&frames.steps[..8].concat()).len();
        assert_eq!(failure[0]["sequence_number"], sent);
        assert_eq!(failure[1]["response"]["status"], "failed");
        assert_eq!(failure[1]["response"]["error"]["code"], "server_error");
    }
}
