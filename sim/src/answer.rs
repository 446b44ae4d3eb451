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
use crate::model::{
    OPENROUTER_REASONER_MODEL, REASONER_MODEL, Segment, TERSE_REASONER_MODEL, generate_choice,
    last_user_text, subject, think,
};
use crate::request::Generation;
use crate::tools;

/// `system_fingerprint` of every answer.
pub const SYSTEM_FINGERPRINT: &str = "fp_sim0001";

/// A JSON-mode answer: the reply as `{"answer": ...}`, in tokens.
fn json_answer(text: &str) -> Vec<String> {
    let document = json!({ "answer": text.trim() }).to_string();
    crate::model::tokenize_keeping_spaces(&document)
}

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
            REASONER_MODEL | TERSE_REASONER_MODEL => Some(Self::ReasoningContent),
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

    /// OpenRouter's `reasoning_details` beside `reasoning`: the same text
    /// as one `reasoning.text` entry; nothing for the others.
    fn details(self, text: &str) -> Option<Value> {
        (self == Self::Reasoning).then(
            || json!([{"type": "reasoning.text", "text": text, "format": "unknown", "index": 0}]),
        )
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
pub struct Call {
    /// `call_` and 24 characters.
    pub id: String,
    pub name: String,
    /// The arguments' JSON text, in the fragments a stream sends (a token
    /// each); concatenated they are the arguments.
    pub fragments: Vec<String>,
}

impl Call {
    /// The arguments' JSON text (cut mid-JSON when the budget ran out).
    pub fn arguments(&self) -> String {
        self.fragments.concat()
    }
}

/// What a choice says after its reasoning.
#[derive(Debug, Clone, PartialEq)]
pub enum Said {
    Content(Vec<String>),
    /// `tool_calls`, or with `legacy` one `function_call`.
    Calls {
        calls: Vec<Call>,
        legacy: bool,
    },
}

/// One choice.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The reasoning tokens (empty unless the model thinks).
    pub reasoning: Vec<String>,
    pub said: Said,
    /// `stop`, `length`, `tool_calls` or `function_call`.
    pub finish_reason: &'static str,
}

impl Choice {
    /// Reasoning, content and call tokens.
    pub fn completion_tokens(&self) -> usize {
        self.reasoning.len()
            + match &self.said {
                Said::Content(tokens) => tokens.len(),
                Said::Calls { calls, .. } => {
                    calls.iter().map(|call| 1 + call.fragments.len()).sum()
                }
            }
    }

    /// The content text; `None` for calls.
    pub fn content(&self) -> Option<String> {
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
    /// The content cites a source ([`citations`]).
    cites: bool,
    pub usage: Value,
    /// Prompt tokens reported (all of them, cached ones included).
    pub prompt_tokens: u64,
    /// Of those, tokens served from the prefix cache.
    pub cached_tokens: u64,
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
    pub generation: &'a Generation,
    /// What the model sees.
    pub context: &'a [Segment],
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl Answer {
    /// Generates every choice of the answer to `compose.request`.
    pub fn compose(compose: Compose<'_>) -> Self {
        let request = compose.generation;
        let context = compose.context;
        let reasoning_field = ReasoningField::of(&request.model);
        let user_text = last_user_text(context);
        let (called, legacy) = request
            .tooling
            .as_ref()
            .map(|tooling| (tools::calls(tooling, user_text), tooling.legacy))
            .unwrap_or_default();
        let called_names: Vec<&str> = called.iter().map(|spec| spec.name.as_str()).collect();
        let max = request.max_tokens;
        let choices = (0..request.choices.max(1))
            .map(|index| {
                let mut reasoning = if request.thinks {
                    think(
                        context,
                        &called_names,
                        request.model != TERSE_REASONER_MODEL,
                    )
                } else {
                    Vec::new()
                };
                // Reasoning is spent from the same budget as the answer.
                let budget = max.map(|max| usize::try_from(max).unwrap_or(usize::MAX));
                if let Some(budget) = budget
                    && reasoning.len() >= budget
                {
                    reasoning.truncate(budget);
                    return Choice {
                        reasoning,
                        said: if called.is_empty() {
                            Said::Content(Vec::new())
                        } else {
                            Said::Calls {
                                calls: Vec::new(),
                                legacy,
                            }
                        },
                        finish_reason: "length",
                    };
                }
                let rest = budget.map(|budget| budget - reasoning.len());
                if called.is_empty() {
                    let reply = generate_choice(context, rest.map(|rest| rest as u64), index);
                    let tokens = if request.json_mode {
                        json_answer(&reply.text())
                    } else {
                        reply.tokens
                    };
                    return Choice {
                        reasoning,
                        said: Said::Content(tokens),
                        finish_reason: reply.finish_reason,
                    };
                }
                let mut calls: Vec<Call> = called
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
                let mut finish_reason = if legacy {
                    "function_call"
                } else {
                    "tool_calls"
                };
                if let Some(mut left) = rest {
                    // A call costs a token for its name, then one per fragment.
                    let mut cut = false;
                    calls.retain_mut(|call| {
                        if left == 0 {
                            cut = true;
                            return false;
                        }
                        left -= 1;
                        if call.fragments.len() > left {
                            call.fragments.truncate(left);
                            cut = true;
                        }
                        left -= call.fragments.len();
                        true
                    });
                    if cut {
                        finish_reason = "length";
                    }
                }
                Choice {
                    reasoning,
                    said: Said::Calls { calls, legacy },
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
            top_logprobs: request.top_logprobs,
            obfuscation: request.include_obfuscation,
            include_usage: request.include_usage,
            cites: request.web_search,
            usage,
            prompt_tokens: compose.prompt_tokens,
            cached_tokens: compose.cached_tokens,
        }
    }

    /// The choices, in order.
    pub fn choices(&self) -> &[Choice] {
        &self.choices
    }

    /// Completion tokens of all choices (reasoning included).
    pub fn completion_tokens(&self) -> u64 {
        self.choices
            .iter()
            .map(|c| c.completion_tokens() as u64)
            .sum()
    }

    /// Reasoning tokens of all choices.
    pub fn reasoning_tokens(&self) -> u64 {
        self.choices.iter().map(|c| c.reasoning.len() as u64).sum()
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
                    "annotations": self.annotations(choice),
                });
                if let Some(field) = self.reasoning_field {
                    let reasoning = choice.reasoning.concat();
                    if let Some(details) = field.details(&reasoning) {
                        message["reasoning_details"] = details;
                    }
                    message[field.name()] = json!(reasoning);
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
            .map(|(index, choice)| {
                // A search model's citations come with the last chunk.
                let delta = match self.annotations(choice) {
                    annotations if annotations.is_empty() => json!({}),
                    annotations => json!({"annotations": annotations}),
                };
                chunk(index, delta, Value::Null, Some(choice.finish_reason))
            })
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

    /// The annotations of `choice`'s content: its citations when the
    /// answer cites, none otherwise.
    fn annotations(&self, choice: &Choice) -> Vec<Value> {
        match (self.cites, choice.content()) {
            (true, Some(content)) => citations(&content),
            _ => Vec::new(),
        }
    }

    /// The deltas (and their logprobs) of `choice` after its opening.
    fn choice_events(&self, choice: &Choice) -> Vec<(Value, Value)> {
        let mut events = Vec::new();
        if let Some(field) = self.reasoning_field {
            for token in &choice.reasoning {
                let mut delta = json!({field.name(): token, "content": field.content_beside()});
                if let Some(details) = field.details(token) {
                    delta["reasoning_details"] = details;
                }
                events.push((delta, Value::Null));
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

/// What a search model cites in `content`: its last word of three letters
/// or more, as a `url_citation` whose `start_index` and `end_index` count
/// characters of the whole content, as OpenAI's do.
pub fn citations(content: &str) -> Vec<Value> {
    let chars: Vec<char> = content.chars().collect();
    let mut end = chars.len();
    loop {
        while end > 0 && !chars[end - 1].is_alphabetic() {
            end -= 1;
        }
        let mut start = end;
        while start > 0 && chars[start - 1].is_alphabetic() {
            start -= 1;
        }
        if start == end {
            return Vec::new();
        }
        if end - start >= 3 {
            let word: String = chars[start..end].iter().collect();
            return vec![json!({"type": "url_citation", "url_citation": {
                "start_index": start, "end_index": end,
                "url": format!("https://sources.example/{}", word.to_lowercase()),
                "title": word,
            }})];
        }
        end = start;
    }
}

/// `{"content": [...], "refusal": null}` for `tokens`, the first at
/// `position` of its choice's content, with `top` alternatives each.
fn logprobs(tokens: &[String], position: usize, top: usize) -> Value {
    json!({"content": logprob_entries(tokens, position, top), "refusal": null})
}

/// The `{"token", "logprob", "bytes", "top_logprobs"}` entries of `tokens`
/// (Chat Completions and Responses both send them), the first at `position`.
pub fn logprob_entries(tokens: &[String], position: usize, top: usize) -> Vec<Value> {
    tokens
        .iter()
        .enumerate()
        .map(|(offset, token)| {
            let (logprob, alternatives) = alternatives(token, position + offset, top);
            let alternatives: Vec<Value> = alternatives
                .into_iter()
                .map(|(token, logprob)| entry(token, logprob))
                .collect();
            let mut entry = entry(token, logprob);
            entry["top_logprobs"] = json!(alternatives);
            entry
        })
        .collect()
}

/// The log probability of `token` at `position`, and its `top` most likely
/// alternatives, the token itself first, each with its log probability.
pub fn alternatives(token: &str, position: usize, top: usize) -> (f64, Vec<(&str, f64)>) {
    let logprob = token_logprob(token, position);
    let alternatives = std::iter::once((token, logprob))
        .chain(
            ALTERNATIVES
                .iter()
                .filter(|alternative| **alternative != token)
                .enumerate()
                .map(|(rank, alternative)| (*alternative, logprob - 0.75 - rank as f64 * 0.5)),
        )
        .take(top)
        .collect();
    (logprob, alternatives)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::HIDDEN_REASONER_MODEL;
    use crate::request::ChatRequest;

    const USER: &str = "Use get_weather for the harbour of Tromsø";

    fn context() -> Vec<Segment> {
        vec![
            Segment {
                role: "system".into(),
                text: "Begin your reply with \"CG-1\" and then answer.".into(),
            },
            Segment {
                role: "user".into(),
                text: USER.into(),
            },
        ]
    }

    /// The answer to `fields` added to a plain request.
    fn answer(fields: Value) -> Answer {
        let mut body =
            json!({"model": "sim-model", "messages": [{"role": "user", "content": USER}]});
        for (key, value) in fields.as_object().unwrap() {
            body[key] = value.clone();
        }
        let request = ChatRequest::parse(body.to_string().as_bytes())
            .expect("valid request")
            .generation;
        Answer::compose(Compose {
            id: "chatcmpl-sim-1".into(),
            created: 7,
            generation: &request,
            context: &context(),
            prompt_tokens: 20,
            cached_tokens: 0,
        })
    }

    /// Every chunk of the stream, in order.
    fn chunks(answer: &Answer) -> Vec<Value> {
        let plan = answer.stream_plan();
        plan.opening
            .into_iter()
            .chain(plan.steps.into_iter().flatten())
            .chain(plan.closing)
            .chain(plan.usage)
            .collect()
    }

    /// `(index, delta, logprobs, finish_reason)` of every chunk with a choice.
    fn deltas(answer: &Answer) -> Vec<(usize, Value, Value, Value)> {
        chunks(answer)
            .iter()
            .filter_map(|chunk| {
                let choice = chunk["choices"].get(0)?;
                Some((
                    choice["index"].as_u64().unwrap() as usize,
                    choice["delta"].clone(),
                    choice["logprobs"].clone(),
                    choice["finish_reason"].clone(),
                ))
            })
            .collect()
    }

    fn streamed(answer: &Answer, index: usize, field: &str) -> String {
        deltas(answer)
            .iter()
            .filter(|(at, ..)| *at == index)
            .filter_map(|(_, delta, ..)| delta[field].as_str().map(str::to_owned))
            .collect()
    }

    #[test]
    fn a_plain_answer_carries_the_fields_real_ones_do() {
        let answer = answer(json!({}));
        let body = answer.body();
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(body["system_fingerprint"], "fp_sim0001");
        assert_eq!(body["service_tier"], "default");
        let choice = &body["choices"][0];
        assert_eq!(choice["index"], 0);
        assert_eq!(choice["logprobs"], Value::Null);
        assert_eq!(choice["finish_reason"], "stop");
        let message = &choice["message"];
        assert_eq!(message["role"], "assistant");
        assert_eq!(message["refusal"], Value::Null);
        assert_eq!(message["annotations"], json!([]));
        assert!(message.get("reasoning_content").is_none());
        assert!(message.get("tool_calls").is_none());
        let content = message["content"].as_str().unwrap();
        assert!(
            content.starts_with("CG-1 You wrote: Use get_weather"),
            "{content}"
        );
        assert_eq!(
            body["usage"]["completion_tokens_details"]["reasoning_tokens"],
            0
        );

        for chunk in chunks(&answer) {
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!(chunk["system_fingerprint"], "fp_sim0001");
            assert_eq!(chunk["service_tier"], "default");
            assert!(!chunk["obfuscation"].as_str().unwrap().is_empty());
            assert!(chunk.get("usage").is_none(), "no usage asked");
        }
        assert_eq!(streamed(&answer, 0, "content"), content);
        let opening = &deltas(&answer)[0].1;
        assert_eq!(
            opening,
            &json!({"role": "assistant", "content": "", "refusal": null})
        );
    }

    #[test]
    fn the_usage_chunk_has_no_choices_and_padding_can_be_turned_off() {
        let answer = answer(json!({"stream": true,
            "stream_options": {"include_usage": true, "include_obfuscation": false}}));
        let all = chunks(&answer);
        let (last, rest) = all.split_last().unwrap();
        assert_eq!(last["choices"], json!([]));
        assert_eq!(last["usage"], answer.usage);
        assert!(
            rest.iter()
                .all(|chunk| chunk["usage"].is_null() && chunk.get("usage").is_some())
        );
        assert!(all.iter().all(|chunk| chunk.get("obfuscation").is_none()));
    }

    #[test]
    fn n_choices_share_the_opening_and_interleave_when_streamed() {
        let answer = answer(json!({"n": 3}));
        let body = answer.body();
        let choices = body["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3);
        let contents: Vec<&str> = choices
            .iter()
            .map(|choice| choice["message"]["content"].as_str().unwrap())
            .collect();
        for (index, (choice, content)) in choices.iter().zip(&contents).enumerate() {
            assert_eq!(choice["index"], index);
            assert!(content.starts_with("CG-1 You wrote: "), "{content}");
            assert_eq!(streamed(&answer, index, "content"), *content);
        }
        assert_ne!(contents[0], contents[1]);
        assert_ne!(contents[1], contents[2]);
        let tokens: usize = contents
            .iter()
            .map(|content| crate::model::tokenize_keeping_spaces(content).len())
            .sum();
        assert_eq!(body["usage"]["completion_tokens"], tokens);

        let plan = answer.stream_plan();
        let indices = |chunks: &[Value]| -> Vec<u64> {
            chunks
                .iter()
                .map(|chunk| chunk["choices"][0]["index"].as_u64().unwrap())
                .collect()
        };
        assert_eq!(indices(&plan.opening), [0, 1, 2]);
        for chunk in &plan.opening {
            assert_eq!(chunk["choices"][0]["delta"]["role"], "assistant");
        }
        // Each decode step has one chunk per choice still decoding, in order.
        assert_eq!(indices(&plan.steps[0]), [0, 1, 2]);
        assert!(
            plan.steps
                .iter()
                .all(|step| indices(step).windows(2).all(|w| w[0] < w[1]))
        );
        assert_eq!(indices(&plan.closing), [0, 1, 2]);
        for chunk in &plan.closing {
            assert_eq!(chunk["choices"][0]["finish_reason"], "stop");
            assert_eq!(chunk["choices"][0]["delta"], json!({}));
        }
        // max_tokens applies per choice.
        let short = answer_with_budget(json!({"n": 2, "max_tokens": 4}));
        assert_eq!(short["usage"]["completion_tokens"], 8);
        assert!(
            short["choices"]
                .as_array()
                .unwrap()
                .iter()
                .all(|c| c["finish_reason"] == "length")
        );
    }

    fn answer_with_budget(fields: Value) -> Value {
        answer(fields).body()
    }

    #[test]
    fn reasoning_models_think_first_and_quote_the_opening() {
        let answer = answer(json!({"model": REASONER_MODEL, "stream": true,
            "stream_options": {"include_usage": true}}));
        let body = answer.body();
        let message = &body["choices"][0]["message"];
        let reasoning = message["reasoning_content"].as_str().unwrap();
        assert!(
            reasoning.contains("begin my reply with \"CG-1\""),
            "{reasoning}"
        );
        let content = message["content"].as_str().unwrap();
        assert!(content.starts_with("CG-1 You wrote:"), "{content}");
        let reasoning_tokens = crate::model::tokenize_keeping_spaces(reasoning).len();
        let content_tokens = crate::model::tokenize_keeping_spaces(content).len();
        assert!(reasoning_tokens >= 24, "{reasoning_tokens}");
        let usage = &body["usage"];
        assert_eq!(
            usage["completion_tokens_details"]["reasoning_tokens"],
            reasoning_tokens
        );
        assert_eq!(
            usage["completion_tokens"],
            reasoning_tokens + content_tokens
        );

        let deltas = deltas(&answer);
        assert_eq!(
            deltas[0].1,
            json!({"role": "assistant", "content": null, "refusal": null, "reasoning_content": ""})
        );
        let first_content = deltas
            .iter()
            .position(|(_, delta, ..)| delta["content"].is_string())
            .unwrap();
        let last_reasoning = deltas
            .iter()
            .rposition(|(_, delta, ..)| {
                delta["reasoning_content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
            })
            .unwrap();
        assert!(last_reasoning < first_content, "reasoning before content");
        for (_, delta, logprobs, _) in &deltas[1..=last_reasoning] {
            assert_eq!(delta["content"], Value::Null);
            assert!(delta.get("content").is_some());
            assert_eq!(logprobs, &Value::Null);
        }
        assert_eq!(streamed(&answer, 0, "reasoning_content"), reasoning);
        assert_eq!(streamed(&answer, 0, "content"), content);

        // OpenRouter's field, with "" content beside it.
        let routed = answer_with(json!({"model": OPENROUTER_REASONER_MODEL}));
        assert_eq!(
            routed.body()["choices"][0]["message"]["reasoning"],
            reasoning
        );
        let second = &deltas_of(&routed)[1];
        assert_eq!(second["content"], "");
        assert!(second["reasoning"].is_string());
    }

    fn answer_with(fields: Value) -> Answer {
        answer(fields)
    }

    fn deltas_of(answer: &Answer) -> Vec<Value> {
        deltas(answer)
            .into_iter()
            .map(|(_, delta, ..)| delta)
            .collect()
    }

    #[test]
    fn reasoning_is_spent_from_max_tokens() {
        let cut = answer(json!({"model": REASONER_MODEL, "max_tokens": 5})).body();
        assert_eq!(cut["choices"][0]["finish_reason"], "length");
        assert_eq!(cut["choices"][0]["message"]["content"], "");
        assert_eq!(cut["usage"]["completion_tokens"], 5);
        assert_eq!(
            cut["usage"]["completion_tokens_details"]["reasoning_tokens"],
            5
        );

        let full = answer(json!({"model": REASONER_MODEL})).body();
        let thought = full["usage"]["completion_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap();
        let some =
            answer(json!({"model": REASONER_MODEL, "max_completion_tokens": thought + 3})).body();
        assert_eq!(some["usage"]["completion_tokens"], thought + 3);
        let whole = full["choices"][0]["message"]["content"].as_str().unwrap();
        let first: String = crate::model::tokenize_keeping_spaces(whole)[..3].concat();
        assert_eq!(some["choices"][0]["message"]["content"], first);
        assert_eq!(some["choices"][0]["finish_reason"], "length");
    }

    #[test]
    fn hidden_reasoning_is_billed_and_never_shown() {
        let cut = answer(json!({"model": HIDDEN_REASONER_MODEL, "max_tokens": 5}));
        let body = cut.body();
        let message = &body["choices"][0]["message"];
        assert_eq!(message["content"], "");
        assert!(message.get("reasoning_content").is_none() && message.get("reasoning").is_none());
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        assert_eq!(
            body["usage"]["completion_tokens_details"]["reasoning_tokens"],
            5
        );
        // Streamed: no delta carries the thinking.
        for delta in deltas_of(&cut) {
            assert!(delta.get("reasoning_content").is_none() && delta.get("reasoning").is_none());
            assert!(
                delta["content"].as_str().is_none_or(str::is_empty),
                "{delta}"
            );
        }
    }

    #[test]
    fn logprob_tokens_join_to_the_content_in_both_modes() {
        let answer = answer(json!({"logprobs": true, "top_logprobs": 3}));
        let body = answer.body();
        let choice = &body["choices"][0];
        let content = choice["message"]["content"].as_str().unwrap();
        assert_eq!(choice["logprobs"]["refusal"], Value::Null);
        let entries = choice["logprobs"]["content"].as_array().unwrap();
        let joined: String = entries
            .iter()
            .map(|e| e["token"].as_str().unwrap())
            .collect();
        assert_eq!(joined, content);
        assert!(
            entries.iter().any(|e| e["token"] == " You"),
            "tokens carry their space"
        );
        for entry in entries {
            let token = entry["token"].as_str().unwrap();
            let bytes: Vec<u8> = entry["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect();
            assert_eq!(bytes, token.as_bytes());
            let logprob = entry["logprob"].as_f64().unwrap();
            assert!((-4.0..0.0).contains(&logprob), "{logprob}");
            let top = entry["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 3);
            assert_eq!(top[0]["token"], token);
            assert_eq!(top[0]["logprob"], entry["logprob"]);
            assert!(top[1]["logprob"].as_f64().unwrap() < logprob);
            assert_ne!(top[1]["token"], token);
            assert!(top[0].get("top_logprobs").is_none());
        }
        // Streamed: each content chunk's logprobs are its delta's tokens.
        let mut joined = String::new();
        for (_, delta, logprobs, finish) in deltas(&answer) {
            match delta["content"].as_str() {
                Some(text) if !text.is_empty() => {
                    let tokens: String = logprobs["content"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|e| e["token"].as_str().unwrap())
                        .collect();
                    assert_eq!(tokens, text);
                    joined.push_str(text);
                }
                _ => assert_eq!(logprobs, Value::Null, "{delta} {finish}"),
            }
        }
        assert_eq!(joined, content);
        let streamed_entries: Vec<Value> = deltas(&answer)
            .into_iter()
            .filter_map(|(_, _, logprobs, _)| logprobs["content"].as_array().cloned())
            .flatten()
            .collect();
        assert_eq!(&streamed_entries, entries, "the same numbers in both modes");

        let none = answer_with(json!({"logprobs": true})).body();
        assert_eq!(
            none["choices"][0]["logprobs"]["content"][0]["top_logprobs"],
            json!([])
        );
    }

    fn weather_tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"place": {"type": "string"}, "days": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "get_tides", "parameters": {
                "type": "object", "properties": {"harbour": {"type": "string"}}}}},
        ])
    }

    #[test]
    fn tool_calls_come_whole_or_in_increments() {
        let answer = answer(json!({"tools": weather_tools(), "tool_choice": "required"}));
        let body = answer.body();
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        let message = &choice["message"];
        assert_eq!(message["content"], Value::Null);
        let calls = message["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "only get_weather is named");
        let call = &calls[0];
        let id = call["id"].as_str().unwrap();
        assert!(id.starts_with("call_") && id.len() == 29, "{id}");
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], "get_weather");
        let arguments = call["function"]["arguments"].as_str().unwrap();
        let parsed: Value = serde_json::from_str(arguments).unwrap();
        assert_eq!(parsed, json!({"days": 7, "place": USER}), "7 words");

        let deltas = deltas_of(&answer);
        assert_eq!(
            deltas[0],
            json!({"role": "assistant", "content": null, "refusal": null})
        );
        assert_eq!(
            deltas[1],
            json!({"tool_calls": [{"index": 0, "id": id, "type": "function",
                "function": {"name": "get_weather", "arguments": ""}}]})
        );
        let fragments: Vec<&Value> = deltas[2..]
            .iter()
            .filter(|delta| delta.get("tool_calls").is_some())
            .collect();
        assert!(fragments.len() > 3, "{fragments:?}");
        let mut joined = String::new();
        for fragment in fragments {
            let call = &fragment["tool_calls"][0];
            assert_eq!(
                call.as_object().unwrap().len(),
                2,
                "index and function only: {call}"
            );
            assert_eq!(call["index"], 0);
            assert_eq!(call["function"].as_object().unwrap().len(), 1);
            let piece = call["function"]["arguments"].as_str().unwrap();
            assert!((1..=6).contains(&piece.chars().count()), "{piece}");
            joined.push_str(piece);
        }
        assert_eq!(joined, arguments);
        assert_eq!(deltas.last().unwrap(), &json!({}));
        assert_eq!(deltas_finish(&answer), "tool_calls");

        // Both named, in parallel: two calls, indexed 0 and 1.
        let mut both = answer_for_user(
            json!({"tools": weather_tools()}),
            "get_tides then get_weather",
        );
        let calls = both.body()["choices"][0]["message"]["tool_calls"].clone();
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[1]["function"]["name"], "get_tides");
        assert_ne!(calls[0]["id"], calls[1]["id"]);
        both.obfuscation = false;
        let second: Vec<Value> = deltas_of(&both)
            .into_iter()
            .filter(|delta| delta["tool_calls"][0]["index"] == 1)
            .collect();
        assert_eq!(second[0]["tool_calls"][0]["id"], calls[1]["id"]);

        // Auto and no tool named: a plain answer.
        let plain = answer_for_user(json!({"tools": weather_tools()}), "hello there").body();
        assert!(plain["choices"][0]["message"]["content"].is_string());
        assert_eq!(plain["choices"][0]["finish_reason"], "stop");
    }

    fn deltas_finish(answer: &Answer) -> Value {
        deltas(answer).last().unwrap().3.clone()
    }

    fn answer_for_user(fields: Value, user: &str) -> Answer {
        let mut body =
            json!({"model": "sim-model", "messages": [{"role": "user", "content": user}]});
        for (key, value) in fields.as_object().unwrap() {
            body[key] = value.clone();
        }
        let request = ChatRequest::parse(body.to_string().as_bytes())
            .unwrap()
            .generation;
        let context = [Segment {
            role: "user".into(),
            text: user.into(),
        }];
        Answer::compose(Compose {
            id: "chatcmpl-sim-2".into(),
            created: 7,
            generation: &request,
            context: &context,
            prompt_tokens: 10,
            cached_tokens: 0,
        })
    }

    #[test]
    fn legacy_function_calls_come_whole_or_in_increments() {
        let functions = json!([{"name": "get_weather", "parameters": {
            "type": "object", "properties": {"place": {"type": "string"}}}}]);
        let answer =
            answer(json!({"functions": functions, "function_call": {"name": "get_weather"}}));
        let body = answer.body();
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "function_call");
        assert_eq!(choice["message"]["content"], Value::Null);
        assert!(choice["message"].get("tool_calls").is_none());
        let call = &choice["message"]["function_call"];
        assert_eq!(call["name"], "get_weather");
        let arguments = call["arguments"].as_str().unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(arguments).unwrap(),
            json!({"place": USER})
        );

        let deltas = deltas_of(&answer);
        assert_eq!(
            deltas[1],
            json!({"function_call": {"name": "get_weather", "arguments": ""}})
        );
        let mut joined = String::new();
        for delta in &deltas[2..deltas.len() - 1] {
            assert_eq!(
                delta["function_call"].as_object().unwrap().len(),
                1,
                "{delta}"
            );
            joined.push_str(delta["function_call"]["arguments"].as_str().unwrap());
        }
        assert_eq!(joined, arguments);
        assert_eq!(deltas_finish(&answer), "function_call");
    }

    #[test]
    fn a_short_budget_cuts_the_call_arguments() {
        let body =
            answer(json!({"tools": weather_tools(), "tool_choice": "required", "max_tokens": 3}))
                .body();
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "length");
        assert_eq!(body["usage"]["completion_tokens"], 3);
        let arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap();
        assert!(
            serde_json::from_str::<Value>(arguments).is_err(),
            "cut mid-JSON: {arguments}"
        );
    }
}
