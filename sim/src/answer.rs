//! Answers as real providers send them: what each choice holds (reasoning,
//! content or function calls, a finish reason, usage), the whole
//! `chat.completion` body, and the `chat.completion.chunk`s of a stream.
//!
//! A stream is planned here and sent (and paced, and cut) by the server: an
//! opening chunk per choice (`role: "assistant"`), then decode steps, each
//! with at most one chunk per choice (choices are decoded side by side, so
//! their chunks interleave as OpenAI's do), then a finish chunk per choice,
//! then the usage chunk (`choices: []`) when `stream_options.include_usage`
//! asks for it.

use serde_json::{Value, json};

use crate::hash;
use crate::model::{Segment, generate_choice, last_user_text, subject, think};
use crate::request::SimRequest;
use crate::tools;

/// The reasoning model whose thinking comes in `reasoning_content`, as
/// DeepSeek, GLM and Qwen (served by vLLM or SGLang) send it.
pub const REASONER_MODEL: &str = "sim-reasoner";

/// The reasoning model whose thinking comes in `reasoning`, as OpenRouter
/// sends it.
pub const OPENROUTER_REASONER_MODEL: &str = "sim-reasoner-openrouter";

/// Every model served, for `GET /v1/models`.
pub const MODELS: [&str; 3] = ["sim-model", REASONER_MODEL, OPENROUTER_REASONER_MODEL];

/// `system_fingerprint` of every answer.
pub const SYSTEM_FINGERPRINT: &str = "fp_sim0001";

/// Common tokens offered as `top_logprobs` alternatives.
const ALTERNATIVES: [&str; 21] = [
    " the", " a", ",", ".", " and", " of", " to", " in", " is", " that", " it", " for", " on",
    " with", " as", " I", " you", " be", " at", " this", " or",
];

/// Where a model's thinking goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReasoningField {
    /// `reasoning_content`; stream deltas carry `content: null` beside it.
    ReasoningContent,
    /// `reasoning`; stream deltas carry `content: ""` beside it.
    Reasoning,
}

impl ReasoningField {
    fn of(model: &str) -> Option<Self> {
        match model {
            REASONER_MODEL => Some(Self::ReasoningContent),
            OPENROUTER_REASONER_MODEL => Some(Self::Reasoning),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::ReasoningContent => "reasoning_content",
            Self::Reasoning => "reasoning",
        }
    }

    /// `content` beside a reasoning delta.
    fn content_beside(self) -> Value {
        match self {
            Self::ReasoningContent => Value::Null,
            Self::Reasoning => json!(""),
        }
    }
}

/// One function call of a choice.
#[derive(Debug, Clone, PartialEq)]
struct Call {
    id: String,
    name: String,
    /// The arguments' JSON text, in the fragments a stream sends (a token
    /// each); concatenated they are the arguments.
    fragments: Vec<String>,
}

impl Call {
    fn arguments(&self) -> String {
        self.fragments.concat()
    }
}

/// What a choice says after its reasoning.
#[derive(Debug, Clone, PartialEq)]
enum Said {
    Content(Vec<String>),
    /// `tool_calls`, or with `legacy` one `function_call`.
    Calls {
        calls: Vec<Call>,
        legacy: bool,
    },
}

/// One choice.
#[derive(Debug, Clone, PartialEq)]
struct Choice {
    reasoning: Vec<String>,
    said: Said,
    finish_reason: &'static str,
}

impl Choice {
    fn completion_tokens(&self) -> usize {
        self.reasoning.len()
            + match &self.said {
                Said::Content(tokens) => tokens.len(),
                Said::Calls { calls, .. } => {
                    calls.iter().map(|call| 1 + call.fragments.len()).sum()
                }
            }
    }

    fn content(&self) -> Option<String> {
        match &self.said {
            Said::Content(tokens) => Some(tokens.concat()),
            Said::Calls { .. } => None,
        }
    }
}

/// A whole answer, ready to be sent whole or streamed.
#[derive(Debug, Clone)]
pub struct Answer {
    pub id: String,
    pub created: u64,
    model: String,
    reasoning_field: Option<ReasoningField>,
    choices: Vec<Choice>,
    /// `Some(k)` when logprobs were asked, with `k` alternatives per token.
    top_logprobs: Option<usize>,
    obfuscation: bool,
    include_usage: bool,
    pub usage: Value,
}

/// The chunks of a stream, in the order they are sent.
#[derive(Debug, Clone)]
pub struct StreamPlan {
    /// Sent at once: one chunk per choice, `role: "assistant"`.
    pub opening: Vec<Value>,
    /// One decode step (one token time) each: at most one chunk per choice.
    pub steps: Vec<Vec<Value>>,
    /// A chunk per choice with its `finish_reason`.
    pub closing: Vec<Value>,
    /// The usage chunk, when asked for.
    pub usage: Option<Value>,
}

/// What an answer is made from.
pub struct Compose<'a> {
    pub id: String,
    pub created: u64,
    pub request: &'a SimRequest,
    /// What the model sees.
    pub context: &'a [Segment],
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl Answer {
    /// Generates every choice of the answer to `compose.request`.
    pub fn compose(compose: Compose<'_>) -> Self {
        let request = compose.request;
        let context = compose.context;
        let reasoning_field = ReasoningField::of(&request.model);
        let user_text = last_user_text(context);
        let called = request
            .tooling
            .as_ref()
            .map(|tooling| (tools::calls(tooling, user_text), tooling.legacy))
            .unwrap_or_default();
        let called_names: Vec<&str> = called.0.iter().map(|spec| spec.name.as_str()).collect();
        let max = request.max_tokens();
        let choices = (0..request.choices.max(1))
            .map(|index| {
                let mut reasoning = match reasoning_field {
                    Some(_) => think(context, &called_names),
                    None => Vec::new(),
                };
                // Reasoning is spent from the same budget as the answer.
                let budget = max.map(|max| usize::try_from(max).unwrap_or(usize::MAX));
                if let Some(budget) = budget
                    && reasoning.len() >= budget
                {
                    reasoning.truncate(budget);
                    return Choice {
                        reasoning,
                        said: if called.0.is_empty() {
                            Said::Content(Vec::new())
                        } else {
                            Said::Calls {
                                calls: Vec::new(),
                                legacy: called.1,
                            }
                        },
                        finish_reason: "length",
                    };
                }
                let rest = budget.map(|budget| budget - reasoning.len());
                if called.0.is_empty() {
                    let reply = generate_choice(context, rest.map(|rest| rest as u64), index);
                    return Choice {
                        reasoning,
                        said: Said::Content(reply.tokens),
                        finish_reason: reply.finish_reason,
                    };
                }
                let mut calls: Vec<Call> = called
                    .0
                    .iter()
                    .enumerate()
                    .map(|(number, spec)| Call {
                        id: format!(
                            "call_{}",
                            hash::alphanumeric(
                                hash::of(&[
                                    compose.id.as_bytes(),
                                    &index.to_le_bytes(),
                                    &number.to_le_bytes()
                                ]),
                                24
                            )
                        ),
                        name: spec.name.clone(),
                        fragments: fragments(&tools::arguments(spec, user_text, subject(context))),
                    })
                    .collect();
                let mut finish_reason = if called.1 {
                    "function_call"
                } else {
                    "tool_calls"
                };
                if let Some(mut left) = rest {
                    // A call costs a token for its name, then one per fragment.
                    calls.retain_mut(|call| {
                        if left == 0 {
                            return false;
                        }
                        left -= 1;
                        let kept = call.fragments.len().min(left);
                        call.fragments.truncate(kept);
                        left -= kept;
                        true
                    });
                    if left == 0 {
                        let full = called.0.len();
                        let cut = calls.len() < full
                            || calls.iter().zip(&called.0).any(|(call, spec)| {
                                call.arguments()
                                    != tools::arguments(spec, user_text, subject(context))
                            });
                        if cut {
                            finish_reason = "length";
                        }
                    }
                }
                Choice {
                    reasoning,
                    said: Said::Calls {
                        calls,
                        legacy: called.1,
                    },
                    finish_reason,
                }
            })
            .collect::<Vec<_>>();
        let completion: usize = choices.iter().map(Choice::completion_tokens).sum();
        let reasoning: usize = choices.iter().map(|choice| choice.reasoning.len()).sum();
        let usage = json!({
            "prompt_tokens": compose.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": compose.prompt_tokens + completion as u64,
            "prompt_tokens_details": {"cached_tokens": compose.cached_tokens, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": reasoning,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        });
        Self {
            id: compose.id,
            created: compose.created,
            model: request.model.clone(),
            reasoning_field,
            choices,
            top_logprobs: request.top_logprobs_wanted,
            obfuscation: request.include_obfuscation(),
            include_usage: request.include_usage(),
            usage,
        }
    }

    /// Decode steps of the longest choice: what pacing a whole answer takes.
    pub fn decode_steps(&self) -> usize {
        self.choices
            .iter()
            .map(Choice::completion_tokens)
            .max()
            .unwrap_or(0)
    }

    /// The `chat.completion` body.
    pub fn body(&self) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(index, choice)| {
                let mut message = json!({
                    "role": "assistant",
                    "content": choice.content(),
                    "refusal": null,
                    "annotations": [],
                });
                if let Some(field) = self.reasoning_field {
                    message[field.name()] = json!(choice.reasoning.concat());
                }
                match &choice.said {
                    Said::Calls {
                        calls,
                        legacy: true,
                    } => {
                        if let Some(call) = calls.first() {
                            message["function_call"] =
                                json!({"name": call.name, "arguments": call.arguments()});
                        }
                    }
                    Said::Calls { calls, .. } if !calls.is_empty() => {
                        let calls: Vec<Value> = calls
                            .iter()
                            .map(|call| {
                                json!({"id": call.id, "type": "function", "function": {
                                    "name": call.name, "arguments": call.arguments(),
                                }})
                            })
                            .collect();
                        message["tool_calls"] = json!(calls);
                    }
                    _ => {}
                }
                let logprobs = match (&choice.said, self.top_logprobs) {
                    (_, None) => Value::Null,
                    (Said::Content(tokens), Some(top)) => logprobs(tokens, 0, top),
                    (Said::Calls { .. }, Some(_)) => json!({"content": null, "refusal": null}),
                };
                json!({
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                })
            })
            .collect();
        json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage,
            "service_tier": "default",
            "system_fingerprint": SYSTEM_FINGERPRINT,
        })
    }

    /// The chunks of the streamed answer.
    pub fn stream_plan(&self) -> StreamPlan {
        let mut sequence = 0_u64;
        let mut chunk = |index: usize, delta: Value, logprobs: Value, finish: Option<&str>| {
            sequence += 1;
            self.chunk(
                json!([{"index": index, "delta": delta, "logprobs": logprobs,
                        "finish_reason": finish}]),
                sequence,
            )
        };
        let mut opening = Vec::new();
        let mut events: Vec<Vec<(Value, Value)>> = Vec::new();
        for (index, choice) in self.choices.iter().enumerate() {
            let content_opening = match (&choice.said, self.reasoning_field) {
                (_, Some(field)) => field.content_beside(),
                (Said::Content(_), None) => json!(""),
                (Said::Calls { .. }, None) => Value::Null,
            };
            let mut delta =
                json!({"role": "assistant", "content": content_opening, "refusal": null});
            if let Some(field) = self.reasoning_field {
                delta[field.name()] = json!("");
            }
            opening.push(chunk(index, delta, Value::Null, None));
            events.push(self.choice_events(choice));
        }
        let longest = events.iter().map(Vec::len).max().unwrap_or(0);
        let steps = (0..longest)
            .map(|step| {
                events
                    .iter()
                    .enumerate()
                    .filter_map(|(index, events)| {
                        let (delta, logprobs) = events.get(step)?.clone();
                        Some(chunk(index, delta, logprobs, None))
                    })
                    .collect()
            })
            .collect();
        let closing = self
            .choices
            .iter()
            .enumerate()
            .map(|(index, choice)| chunk(index, json!({}), Value::Null, Some(choice.finish_reason)))
            .collect();
        let usage = self.include_usage.then(|| {
            let mut usage = self.chunk(json!([]), 0);
            usage["usage"] = self.usage.clone();
            usage
        });
        StreamPlan {
            opening,
            steps,
            closing,
            usage,
        }
    }

    /// The deltas (and their logprobs) of `choice` after its opening.
    fn choice_events(&self, choice: &Choice) -> Vec<(Value, Value)> {
        let mut events = Vec::new();
        if let Some(field) = self.reasoning_field {
            for token in &choice.reasoning {
                events.push((
                    json!({field.name(): token, "content": field.content_beside()}),
                    Value::Null,
                ));
            }
        }
        match &choice.said {
            Said::Content(tokens) => {
                for (position, token) in tokens.iter().enumerate() {
                    let mut delta = json!({"content": token});
                    if let Some(field) = self.reasoning_field {
                        delta[field.name()] = Value::Null;
                    }
                    let logprobs = self.top_logprobs.map_or(Value::Null, |top| {
                        logprobs(std::slice::from_ref(token), position, top)
                    });
                    events.push((delta, logprobs));
                }
            }
            Said::Calls { calls, legacy } => {
                for (number, call) in calls.iter().enumerate() {
                    events.push((
                        if *legacy {
                            json!({"function_call": {"name": call.name, "arguments": ""}})
                        } else {
                            json!({"tool_calls": [{"index": number, "id": call.id,
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]})
                        },
                        Value::Null,
                    ));
                    for fragment in &call.fragments {
                        events.push((
                            if *legacy {
                                json!({"function_call": {"arguments": fragment}})
                            } else {
                                json!({"tool_calls": [{"index": number,
                                    "function": {"arguments": fragment}}]})
                            },
                            Value::Null,
                        ));
                    }
                }
            }
        }
        events
    }

    /// A `chat.completion.chunk` with `choices`; `sequence` seeds its padding.
    fn chunk(&self, choices: Value, sequence: u64) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "service_tier": "default",
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        if self.obfuscation {
            let seed = hash::of(&[self.id.as_bytes(), &sequence.to_le_bytes()]);
            chunk["obfuscation"] = json!(hash::alphanumeric(seed, 1 + (seed % 15) as usize));
        }
        chunk
    }
}

/// `{"content": [...], "refusal": null}` for `tokens`, the first at
/// `position` of its choice's content, with `top` alternatives each.
fn logprobs(tokens: &[String], position: usize, top: usize) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .enumerate()
        .map(|(offset, token)| {
            let logprob = token_logprob(token, position + offset);
            let alternatives: Vec<Value> = std::iter::once((token.as_str(), logprob))
                .chain(
                    ALTERNATIVES
                        .iter()
                        .filter(|alternative| **alternative != token.as_str())
                        .enumerate()
                        .map(|(rank, alternative)| {
                            (*alternative, logprob - 0.75 - rank as f64 * 0.5)
                        }),
                )
                .take(top)
                .map(|(token, logprob)| entry(token, logprob))
                .collect();
            let mut entry = entry(token, logprob);
            entry["top_logprobs"] = json!(alternatives);
            entry
        })
        .collect();
    json!({"content": content, "refusal": null})
}

fn entry(token: &str, logprob: f64) -> Value {
    json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
}

/// A deterministic log probability in [-4, -0.00001] for `token` at `position`.
fn token_logprob(token: &str, position: usize) -> f64 {
    let seed = hash::of(&[token.as_bytes(), &position.to_le_bytes()]);
    -((1 + seed % 400_000) as f64) / 100_000.0
}

/// `arguments` in the fragments of 2 to 6 characters a stream sends.
fn fragments(arguments: &str) -> Vec<String> {
    let chars: Vec<char> = arguments.chars().collect();
    let mut fragments = Vec::new();
    let mut start = 0;
    while start < chars.len() {
        let len = 2 + (hash::of(&[arguments.as_bytes(), &start.to_le_bytes()]) % 5) as usize;
        let end = (start + len).min(chars.len());
        fragments.push(chars[start..end].iter().collect());
        start = end;
    }
    fragments
}
