//! `POST /v1/completions`, OpenAI's legacy completions: a raw text prompt
//! (or several) continued by the model.
//!
//! Read as OpenAI documents it: `prompt` a string, a list of strings, a list
//! of token ids or a list of such lists (token ids are read as their
//! numbers written out, one token each); `max_tokens` 16 when absent
//! (OpenAI's default); `n` choices per prompt, indexed prompt-major
//! (`prompt * n + choice`); `echo` puts the prompt before the completion;
//! `logprobs` (0..=5) gives `tokens`, `token_logprobs`, `top_logprobs`
//! (`{token: logprob}` per position) and `text_offset` (characters into
//! prompt and completion together). Each prompt is its own conversation:
//! its own context, its own failure-mode outcome, its own usage.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Map, Value, json};

use super::chat::openai_stream_error;
use super::exchange::{Sim, begin, finish, openai_key};
use crate::answer::{Answer, SYSTEM_FINGERPRINT, alternatives};
use crate::conversation::{CacheRule, Conversation, Turn};
use crate::delivery::{Frames, Rendered, data_frame, deliver};
use crate::error::SimError;
use crate::headers::RateSnapshot;
use crate::model::tokenize_keeping_spaces;
use crate::request::{Generation, MAX_N, StreamOptions, bounded, parse_json};
use crate::surface::Surface;

/// `max_tokens` when the request names none (OpenAI's API reference).
pub const DEFAULT_MAX_TOKENS: u64 = 16;

/// Most alternatives per position `logprobs` may ask for.
pub const MAX_LOGPROBS: u64 = 5;

/// The handler.
pub async fn create(State(sim): State<Sim>, headers: HeaderMap, body: Bytes) -> Response {
    let mut exchange = begin(&sim, Surface::Completions);
    let result = serve(&sim, &headers, &body, &mut exchange.rate).await;
    finish(&sim, exchange, result)
}

async fn serve(
    sim: &Sim,
    headers: &HeaderMap,
    body: &[u8],
    rate: &mut Option<RateSnapshot>,
) -> Result<Response, SimError> {
    openai_key(sim, headers)?;
    let request = CompletionsRequest::parse(body)?;
    let turn = Turn {
        surface: Surface::Completions,
        generation: request.generation.clone(),
        conversations: request
            .prompts
            .iter()
            .map(|prompt| Conversation::text(prompt.clone(), CacheRule::Automatic))
            .collect(),
    };
    let run = sim.run(headers, &turn, rate).await?;
    let answers = run.answers(&turn.generation);
    let completion = Completion {
        id: &run.id,
        created: run.created,
        request: &request,
        answers: &answers,
    };
    let rendered = if request.generation.stream {
        Rendered::Stream(completion.frames())
    } else {
        Rendered::Whole {
            body: completion.body().to_string(),
            decode_steps: answers.iter().map(Answer::decode_steps).max().unwrap_or(0),
        }
    };
    Ok(deliver(sim, &run, rendered).await)
}

#[derive(serde::Deserialize)]
struct CompletionsBody {
    model: String,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    max_tokens: Option<Value>,
    #[serde(default)]
    n: Option<Value>,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

/// A legacy completions request.
#[derive(Debug)]
pub struct CompletionsRequest {
    pub generation: Generation,
    /// One text per prompt.
    pub prompts: Vec<String>,
    pub echo: bool,
    /// Alternatives per position, when `logprobs` was asked.
    pub logprobs: Option<usize>,
}

impl CompletionsRequest {
    /// Parses and validates a body (400 naming the `param` otherwise).
    pub fn parse(body: &[u8]) -> Result<Self, SimError> {
        let body: CompletionsBody = parse_json(body)?;
        let prompts = prompts(body.prompt.as_ref())?;
        let max_tokens = bounded(body.max_tokens.as_ref(), "max_tokens", 0, u64::MAX >> 1)?
            .unwrap_or(DEFAULT_MAX_TOKENS);
        let choices = bounded(body.n.as_ref(), "n", 1, MAX_N)?.unwrap_or(1) as usize;
        let logprobs =
            bounded(body.logprobs.as_ref(), "logprobs", 0, MAX_LOGPROBS)?.map(|k| k as usize);
        let options = body.stream_options.unwrap_or_default();
        Ok(Self {
            generation: Generation {
                stream: body.stream.unwrap_or(false),
                max_tokens: Some(max_tokens),
                choices,
                include_usage: options.include_usage.unwrap_or(false),
                ..Generation::plain(body.model)
            },
            prompts,
            echo: body.echo.unwrap_or(false),
            logprobs,
        })
    }
}

/// The prompts of `prompt`, each as text.
fn prompts(prompt: Option<&Value>) -> Result<Vec<String>, SimError> {
    let invalid = || {
        SimError::invalid_request(
            Some("invalid_type"),
            "Invalid type for 'prompt': expected a string, an array of strings, an array of \
             token ids or an array of arrays of token ids.",
        )
        .with_param("prompt")
    };
    let ids = |list: &[Value]| -> Option<String> {
        let ids: Option<Vec<String>> = list
            .iter()
            .map(|id| id.as_u64().map(|id| id.to_string()))
            .collect();
        ids.map(|ids| ids.join(" "))
    };
    match prompt {
        None | Some(Value::Null) => Err(SimError::invalid_request(
            None,
            "Missing required parameter: 'prompt'.",
        )
        .with_param("prompt")),
        Some(Value::String(text)) => Ok(vec![text.clone()]),
        Some(Value::Array(list)) if list.is_empty() => Err(SimError::invalid_request(
            Some("empty_array"),
            "Invalid 'prompt': empty array. Expected an array with minimum length 1.",
        )
        .with_param("prompt")),
        Some(Value::Array(list)) if list.iter().all(Value::is_number) => {
            Ok(vec![ids(list).ok_or_else(invalid)?])
        }
        Some(Value::Array(list)) => list
            .iter()
            .map(|item| match item {
                Value::String(text) => Ok(text.clone()),
                Value::Array(tokens) => ids(tokens).ok_or_else(invalid),
                _ => Err(invalid()),
            })
            .collect(),
        Some(_) => Err(invalid()),
    }
}

/// A rendered completion: every prompt's answer.
pub struct Completion<'a> {
    pub id: &'a str,
    pub created: u64,
    pub request: &'a CompletionsRequest,
    /// One per prompt, in order.
    pub answers: &'a [Answer],
}

impl Completion<'_> {
    /// The `text_completion` body.
    pub fn body(&self) -> Value {
        let mut choices = Vec::new();
        for (number, (prompt, answer)) in self.request.prompts.iter().zip(self.answers).enumerate()
        {
            for (index, choice) in answer.choices().iter().enumerate() {
                let tokens = completion_tokens(choice);
                let echoed = if self.request.echo {
                    prompt.as_str()
                } else {
                    ""
                };
                let logprobs = self.request.logprobs.map_or(Value::Null, |top| {
                    let mut prompt_tokens = Vec::new();
                    if self.request.echo {
                        prompt_tokens = tokenize_keeping_spaces(prompt);
                    }
                    legacy_logprobs(&prompt_tokens, &tokens, 0, prompt.chars().count(), top)
                });
                choices.push(json!({
                    "text": format!("{echoed}{}", tokens.concat()),
                    "index": self.index(number, index),
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                }));
            }
        }
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.request.generation.model,
            "choices": choices,
            "usage": self.usage(),
            "system_fingerprint": SYSTEM_FINGERPRINT,
        })
    }

    /// The `index` of choice `choice` of prompt `prompt`.
    fn index(&self, prompt: usize, choice: usize) -> usize {
        prompt * self.request.generation.choices.max(1) + choice
    }

    fn usage(&self) -> Value {
        let prompt: u64 = self.answers.iter().map(|answer| answer.prompt_tokens).sum();
        let completion: u64 = self.answers.iter().map(Answer::completion_tokens).sum();
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        })
    }

    fn chunk(&self, choices: Value) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "choices": choices,
            "model": self.request.generation.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        });
        if self.request.generation.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// The chunks of the streamed completion: the echoed prompt first, then
    /// a token per chunk with choices decoded side by side, a finish chunk
    /// per choice, the usage chunk when asked, `[DONE]`.
    pub fn frames(&self) -> Frames {
        let frame = |chunk: Value| data_frame(&chunk.to_string());
        let text_choice = |index: usize, text: &str, logprobs: Value, finish: Value| json!([{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}]);
        let top = self.request.logprobs;
        let mut opening = Vec::new();
        let mut lanes = Vec::new();
        let mut closing = Vec::new();
        for (number, (prompt, answer)) in self.request.prompts.iter().zip(self.answers).enumerate()
        {
            let prompt_chars = prompt.chars().count();
            for (choice_index, choice) in answer.choices().iter().enumerate() {
                let index = self.index(number, choice_index);
                let mut offset = 0;
                if self.request.echo {
                    let prompt_tokens = tokenize_keeping_spaces(prompt);
                    let logprobs = top.map_or(Value::Null, |top| {
                        legacy_logprobs(&prompt_tokens, &[], 0, prompt_chars, top)
                    });
                    opening.push(frame(self.chunk(text_choice(
                        index,
                        prompt,
                        logprobs,
                        Value::Null,
                    ))));
                    offset = prompt_chars;
                }
                let tokens = completion_tokens(choice);
                let mut lane = Vec::new();
                for (position, token) in tokens.iter().enumerate() {
                    let logprobs = top.map_or(Value::Null, |top| {
                        legacy_logprobs(&[], std::slice::from_ref(token), position, offset, top)
                    });
                    offset += token.chars().count();
                    lane.push(frame(self.chunk(text_choice(
                        index,
                        token,
                        logprobs,
                        Value::Null,
                    ))));
                }
                lanes.push(lane);
                closing.push(frame(self.chunk(text_choice(
                    index,
                    "",
                    Value::Null,
                    json!(choice.finish_reason),
                ))));
            }
        }
        let longest = lanes.iter().map(Vec::len).max().unwrap_or(0);
        let steps = (0..longest)
            .map(|step| {
                lanes
                    .iter()
                    .filter_map(|lane| lane.get(step).cloned())
                    .collect()
            })
            .collect();
        if self.request.generation.include_usage {
            let mut usage = self.chunk(json!([]));
            usage["usage"] = self.usage();
            closing.push(frame(usage));
        }
        closing.push(data_frame("[DONE]"));
        Frames {
            opening,
            steps,
            closing,
            failure: vec![openai_stream_error()],
            content_type: "text/event-stream",
        }
    }
}

/// The tokens a completion choice says (legacy completions have no
/// reasoning and no calls).
fn completion_tokens(choice: &crate::answer::Choice) -> Vec<String> {
    match &choice.said {
        crate::answer::Said::Content(tokens) => tokens.clone(),
        crate::answer::Said::Calls { .. } => Vec::new(),
    }
}

/// Legacy `logprobs` of `prompt` tokens (echoed) then `completion` tokens,
/// the first of those token `first` of its completion, at character
/// `completion_offset` of prompt and completion; an echoed prompt's first
/// token has no logprob (nothing comes before it).
fn legacy_logprobs(
    prompt: &[String],
    completion: &[String],
    first: usize,
    completion_offset: usize,
    top: usize,
) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top_logprobs = Vec::new();
    let mut text_offset = Vec::new();
    let mut offset = if prompt.is_empty() {
        completion_offset
    } else {
        0
    };
    // Prompt positions draw their numbers apart from the completion's.
    let positions = (1_000_000..).take(prompt.len()).chain(first..);
    let all = prompt.iter().chain(completion).zip(positions);
    for (index, (token, position)) in all.enumerate() {
        tokens.push(json!(token));
        text_offset.push(json!(offset));
        offset += token.chars().count();
        if index == 0 && !prompt.is_empty() {
            token_logprobs.push(Value::Null);
            top_logprobs.push(Value::Null);
            continue;
        }
        let (logprob, alternatives) = alternatives(token, position, top);
        token_logprobs.push(json!(logprob));
        let top: Map<String, Value> = alternatives
            .into_iter()
            .map(|(token, logprob)| (token.to_owned(), json!(logprob)))
            .collect();
        top_logprobs.push(Value::Object(top));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::Compose;
    use crate::model::Segment;

    fn request(fields: Value) -> CompletionsRequest {
        let mut body = json!({"model": "sim-model", "prompt": "Say hello to the harbour"});
        for (key, value) in fields.as_object().unwrap() {
            body[key] = value.clone();
        }
        CompletionsRequest::parse(body.to_string().as_bytes()).unwrap()
    }

    fn answers(request: &CompletionsRequest) -> Vec<Answer> {
        request
            .prompts
            .iter()
            .map(|prompt| {
                let context = [Segment {
                    role: "user".into(),
                    text: prompt.clone(),
                }];
                Answer::compose(Compose {
                    id: "cmpl-sim-1".into(),
                    created: 7,
                    generation: &request.generation,
                    context: &context,
                    prompt_tokens: 5,
                    cached_tokens: 0,
                })
            })
            .collect()
    }

    #[test]
    fn prompts_take_every_documented_shape() {
        assert_eq!(request(json!({})).prompts, ["Say hello to the harbour"]);
        assert_eq!(request(json!({"prompt": ["a", "b"]})).prompts, ["a", "b"]);
        assert_eq!(
            request(json!({"prompt": [1, 22, 333]})).prompts,
            ["1 22 333"]
        );
        assert_eq!(
            request(json!({"prompt": [[1], [2, 3]]})).prompts,
            ["1", "2 3"]
        );
        assert_eq!(
            request(json!({})).generation.max_tokens,
            Some(16),
            "OpenAI's default"
        );
        for bad in [json!([]), json!(null), json!(5), json!(["a", 5])] {
            let body = json!({"model": "m", "prompt": bad});
            let error = CompletionsRequest::parse(body.to_string().as_bytes()).unwrap_err();
            assert_eq!(error.param(), Some("prompt"), "{bad}");
        }
        let body = json!({"model": "m", "prompt": "x", "logprobs": 6});
        let error = CompletionsRequest::parse(body.to_string().as_bytes()).unwrap_err();
        assert_eq!(error.param(), Some("logprobs"));
    }

    #[test]
    fn choices_run_prompt_major_and_echo_puts_the_prompt_first() {
        let request = request(json!({"prompt": ["first one", "second one"], "n": 2,
            "echo": true, "max_tokens": 50}));
        let answers = answers(&request);
        let completion = Completion {
            id: "cmpl-sim-1",
            created: 7,
            request: &request,
            answers: &answers,
        };
        let body = completion.body();
        let choices = body["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 4);
        for (index, choice) in choices.iter().enumerate() {
            assert_eq!(choice["index"], index);
            let prompt = if index < 2 { "first one" } else { "second one" };
            let text = choice["text"].as_str().unwrap();
            assert!(text.starts_with(&format!("{prompt}You wrote:")), "{text}");
            assert_eq!(choice["finish_reason"], "stop");
            assert_eq!(choice["logprobs"], Value::Null);
        }
        assert_eq!(body["object"], "text_completion");
        assert_eq!(
            body["usage"]["prompt_tokens"], 10,
            "each prompt counted once"
        );
        let completion_tokens = body["usage"]["completion_tokens"].as_u64().unwrap();
        assert_eq!(body["usage"]["total_tokens"], 10 + completion_tokens);
    }

    #[test]
    fn logprobs_line_up_with_the_text_in_both_modes() {
        let request = request(json!({"logprobs": 3, "echo": true, "max_tokens": 6}));
        let answers = answers(&request);
        let completion = Completion {
            id: "cmpl-sim-1",
            created: 7,
            request: &request,
            answers: &answers,
        };
        let choice = completion.body()["choices"][0].clone();
        let text = choice["text"].as_str().unwrap();
        let logprobs = &choice["logprobs"];
        let tokens: Vec<&str> = logprobs["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(tokens.concat(), text);
        assert_eq!(
            logprobs["token_logprobs"][0],
            Value::Null,
            "the prompt's first"
        );
        assert_eq!(logprobs["top_logprobs"][0], Value::Null);
        let offsets = logprobs["text_offset"].as_array().unwrap();
        for (token, offset) in tokens.iter().zip(offsets) {
            let at = offset.as_u64().unwrap() as usize;
            assert!(text[at..].starts_with(token), "{token} at {at}");
        }
        assert_eq!(logprobs["top_logprobs"][1].as_object().unwrap().len(), 3);
        assert_eq!(choice["finish_reason"], "length");

        // Streamed: the echo, then one token a chunk, the same numbers.
        let frames = completion.frames();
        let parse = |frame: &Bytes| -> Value {
            let text = std::str::from_utf8(frame).unwrap();
            serde_json::from_str(text.trim().strip_prefix("data: ").unwrap()).unwrap()
        };
        let echo = parse(&frames.opening[0]);
        assert_eq!(echo["choices"][0]["text"], "Say hello to the harbour");
        let whole_completion: Vec<&Value> = logprobs["token_logprobs"].as_array().unwrap()[5..]
            .iter()
            .collect();
        let streamed: Vec<Value> = frames
            .steps
            .iter()
            .map(|step| parse(&step[0])["choices"][0]["logprobs"]["token_logprobs"][0].clone())
            .collect();
        assert_eq!(streamed.len(), 6);
        assert_eq!(whole_completion, streamed.iter().collect::<Vec<_>>());
        let last = parse(&frames.closing[0]);
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(frames.closing.last().unwrap(), &data_frame("[DONE]"));
    }
}
