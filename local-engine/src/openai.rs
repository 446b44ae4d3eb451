//! OpenAI chat completions on the engine: a request body in, a
//! `chat.completion` object or an SSE stream of `chat.completion.chunk`s out.
//!
//! Shared by `canarygate engine serve` and the proxy's in-process fallback, so
//! both answer in exactly the same shape. Errors carry OpenAI's fields; a
//! request over the context window is HTTP 400 `context_length_exceeded`.
//!
//! What the engine cannot honour is refused, never dropped: more than one
//! choice, logprobs, tools and function calls (offered, required, or turns
//! of an earlier call), JSON output, audio output, web search, and content
//! other than text (`refuse_unsupported`). Penalties, `logit_bias` (token
//! ids of another tokenizer) and `reasoning_effort` (the engine's models
//! write no reasoning to spend it on) are hints, ignored. A last assistant
//! message is continued with `continue_final_message` (as vLLM reads it),
//! else answered with a new turn.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::Stream;
use serde_json::{Value, json};

use crate::{
    AdmissionError, ChatMessage, EngineHandle, Event, FinishReason, GenerationRequest,
    SamplingParams,
};

/// Events buffered between the engine thread and the response body.
const STREAM_BUFFER: usize = 64;

/// Why the engine could not serve a chat request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatFailure {
    /// The request is malformed (HTTP 400, no code).
    Invalid,
    /// Prompt plus `max_tokens` exceed the served window (HTTP 400
    /// `context_length_exceeded`).
    ContextLengthExceeded,
    /// The engine is shutting down (HTTP 503 `engine_unavailable`).
    Unavailable,
    /// The engine failed while generating (HTTP 500 `engine_error`).
    Failed,
}

/// A request the engine cannot serve, in OpenAI's error vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatError {
    /// What went wrong.
    pub failure: ChatFailure,
    /// `error.param`.
    pub param: Option<&'static str>,
    /// `error.message`.
    pub message: String,
}

impl ChatError {
    /// A malformed request (`param` names the field at fault).
    pub fn invalid(param: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            failure: ChatFailure::Invalid,
            param,
            message: message.into(),
        }
    }

    fn failed(message: impl Into<String>) -> Self {
        Self {
            failure: ChatFailure::Failed,
            param: None,
            message: message.into(),
        }
    }

    /// HTTP status.
    pub fn status(&self) -> u16 {
        match self.failure {
            ChatFailure::Invalid | ChatFailure::ContextLengthExceeded => 400,
            ChatFailure::Unavailable => 503,
            ChatFailure::Failed => 500,
        }
    }

    /// `error.type`.
    pub fn kind(&self) -> &'static str {
        match self.failure {
            ChatFailure::Invalid | ChatFailure::ContextLengthExceeded => "invalid_request_error",
            ChatFailure::Unavailable | ChatFailure::Failed => "server_error",
        }
    }

    /// `error.code`.
    pub fn code(&self) -> Option<&'static str> {
        match self.failure {
            ChatFailure::Invalid => None,
            ChatFailure::ContextLengthExceeded => Some("context_length_exceeded"),
            ChatFailure::Unavailable => Some("engine_unavailable"),
            ChatFailure::Failed => Some("engine_error"),
        }
    }

    /// `{"error": {...}}`.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "param": self.param,
                         "code": self.code()}})
    }
}

impl From<AdmissionError> for ChatError {
    fn from(error: AdmissionError) -> Self {
        let failure = match error {
            AdmissionError::ContextLengthExceeded { .. } => ChatFailure::ContextLengthExceeded,
            AdmissionError::Invalid(_) => ChatFailure::Invalid,
            AdmissionError::Unavailable => ChatFailure::Unavailable,
        };
        Self {
            failure,
            param: (failure == ChatFailure::ContextLengthExceeded).then_some("messages"),
            message: error.to_string(),
        }
    }
}

/// An admitted chat request, generating.
pub struct ChatCall {
    generation: crate::Generation,
    id: String,
    created: u64,
    model: String,
    stream: bool,
    include_usage: bool,
    /// The request's stop strings, for the one an answer stopped at.
    stop: Vec<String>,
}

/// Admits the chat request `body` (OpenAI's schema) on `engine`; `model` is
/// the name the answer reports. Nothing is allocated for a rejected request.
pub fn start_chat(engine: &EngineHandle, body: &Value, model: &str) -> Result<ChatCall, ChatError> {
    let object = body
        .as_object()
        .ok_or_else(|| ChatError::invalid(None, "the request body must be a JSON object"))?;
    refuse_out_of_range(object)?;
    refuse_unsupported(object)?;
    let flag = |field: &'static str| -> Result<bool, ChatError> {
        match object.get(field) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(set)) => Ok(*set),
            Some(_) => Err(ChatError::invalid(
                Some(field),
                format!("`{field}` must be a boolean"),
            )),
        }
    };
    let stream = flag("stream")?;
    let continuing = flag("continue_final_message")?;
    let messages = parse_messages(object.get("messages"))?;
    let prompt = if continuing {
        if messages
            .last()
            .is_none_or(|message| message.role != "assistant")
        {
            return Err(ChatError::invalid(
                Some("continue_final_message"),
                "`continue_final_message` continues a last message from the assistant",
            ));
        }
        engine.chat_prompt_continuing(&messages)
    } else {
        engine.chat_prompt(&messages)
    }
    .map_err(|error| ChatError::invalid(Some("messages"), error.to_string()))?;
    let number = |field: &'static str| -> Result<Option<f64>, ChatError> {
        match object.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => value.as_f64().map(Some).ok_or_else(|| {
                ChatError::invalid(Some(field), format!("`{field}` must be a number"))
            }),
        }
    };
    let count = |field: &'static str| -> Result<Option<u64>, ChatError> {
        match object.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => value.as_u64().map(Some).ok_or_else(|| {
                ChatError::invalid(
                    Some(field),
                    format!("`{field}` must be a non-negative integer"),
                )
            }),
        }
    };
    let defaults = SamplingParams::default();
    let (limit_field, max_tokens) = match count("max_completion_tokens")? {
        Some(max) => ("max_completion_tokens", Some(max)),
        None => ("max_tokens", count("max_tokens")?),
    };
    if max_tokens == Some(0) {
        return Err(ChatError::invalid(
            Some(limit_field),
            format!("`{limit_field}` must be at least 1"),
        ));
    }
    let stop = match object.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(stop)) => vec![stop.clone()],
        Some(Value::Array(stops)) => stops
            .iter()
            .map(|stop| stop.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                ChatError::invalid(Some("stop"), "`stop` must be a string or strings")
            })?,
        Some(_) => {
            return Err(ChatError::invalid(
                Some("stop"),
                "`stop` must be a string or strings",
            ));
        }
    };
    let request = GenerationRequest {
        prompt,
        max_tokens: max_tokens.map(|max| usize::try_from(max).unwrap_or(usize::MAX)),
        stop: stop.clone(),
        sampling: SamplingParams {
            temperature: number("temperature")?.map_or(defaults.temperature, |t| t as f32),
            top_p: number("top_p")?.map_or(defaults.top_p, |p| p as f32),
            top_k: count("top_k")?.map_or(defaults.top_k, |k| k as usize),
            seed: count("seed")?.unwrap_or_else(now_nanos),
        },
        return_logits: false,
    };
    let generation = engine.submit(request)?;
    Ok(ChatCall {
        id: format!("chatcmpl-local-{}", generation.id()),
        created: now_secs(),
        model: model.to_owned(),
        stream,
        include_usage: object
            .get("stream_options")
            .and_then(|options| options.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        stop,
        generation,
    })
}

/// Sets its flag when dropped: tells a waiting thread its caller is gone.
struct AbandonOnDrop(Arc<AtomicBool>);

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A choice's `stop_reason` (as vLLM names it): the stop string the answer
/// stopped at, else null.
fn stop_reason(stop: &[String], finish: FinishReason) -> Value {
    match finish {
        FinishReason::StopString(index) => stop.get(index).map_or(Value::Null, |s| json!(s)),
        FinishReason::Stop | FinishReason::Length => Value::Null,
    }
}

/// Refuses what OpenAI's API refuses as out of range (a 400 naming the
/// field), rather than serve it: `n` below 1, `temperature` outside 0 to 2,
/// `top_p` outside 0 to 1.
fn refuse_out_of_range(request: &serde_json::Map<String, Value>) -> Result<(), ChatError> {
    let number = |field: &str| request.get(field).and_then(Value::as_f64);
    let out_of_range = |field: &'static str, range: &str| {
        Err(ChatError::invalid(
            Some(field),
            format!("`{field}` must be {range}"),
        ))
    };
    // `2.0` is no count of choices (and would pass for one below).
    if request
        .get("n")
        .is_some_and(|n| !n.is_null() && n.as_i64().is_none() && n.as_u64().is_none())
    {
        return out_of_range("n", "a whole number");
    }
    if number("n").is_some_and(|n| n < 1.0) {
        return out_of_range("n", "at least 1");
    }
    if number("temperature").is_some_and(|t| !(0.0..=2.0).contains(&t)) {
        return out_of_range("temperature", "from 0 to 2");
    }
    if number("top_p").is_some_and(|p| !(0.0..=1.0).contains(&p)) {
        return out_of_range("top_p", "from 0 to 1");
    }
    Ok(())
}

/// Refuses a request for what the engine cannot do (a 400 naming the
/// field): an answer without it would not be the answer asked for.
fn refuse_unsupported(request: &serde_json::Map<String, Value>) -> Result<(), ChatError> {
    let set = |field: &str| request.get(field).filter(|value| !value.is_null());
    let unsupported = |field: &'static str, what: &str| {
        Err(ChatError::invalid(
            Some(field),
            format!("cannot serve {what}"),
        ))
    };
    if set("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return unsupported("n", "more than one choice (`n` > 1)");
    }
    if set("web_search_options").is_some() {
        return unsupported("web_search_options", "web search");
    }
    if set("logprobs").and_then(Value::as_bool) == Some(true) || set("top_logprobs").is_some() {
        return unsupported("logprobs", "logprobs");
    }
    for field in ["tools", "functions"] {
        if set(field)
            .and_then(Value::as_array)
            .is_some_and(|list| !list.is_empty())
        {
            return unsupported(field, "tool or function calls");
        }
    }
    // `none` and `auto` ask for nothing the engine cannot give; anything
    // else demands a call (OpenAI refuses it without tools, as here).
    if let Some(choice) = set("tool_choice")
        && !matches!(choice.as_str(), Some("none" | "auto"))
    {
        return unsupported("tool_choice", "a required tool or function call");
    }
    if let Some(format) = set("response_format")
        && format.get("type").and_then(Value::as_str) != Some("text")
    {
        return unsupported("response_format", "JSON output (`response_format`)");
    }
    let audio_out = set("modalities")
        .and_then(Value::as_array)
        .is_some_and(|modalities| modalities.iter().any(|m| m != "text"));
    if audio_out || set("audio").is_some() {
        return unsupported("modalities", "audio output");
    }
    Ok(())
}

/// The engine's messages: text only. A part that is not text (an image,
/// audio, a file) or a turn of a tool call is refused.
fn parse_messages(messages: Option<&Value>) -> Result<Vec<ChatMessage>, ChatError> {
    let messages = messages
        .and_then(Value::as_array)
        .filter(|messages| !messages.is_empty())
        .ok_or_else(|| {
            ChatError::invalid(Some("messages"), "`messages` must be a non-empty array")
        })?;
    messages
        .iter()
        .enumerate()
        .map(|(index, message)| {
            let role = message.get("role").and_then(Value::as_str).ok_or_else(|| {
                ChatError::invalid(
                    Some("messages"),
                    format!("messages[{index}] must be an object with a string `role`"),
                )
            })?;
            if !matches!(
                role,
                "system" | "developer" | "user" | "assistant" | "tool" | "function"
            ) {
                return Err(ChatError::invalid(
                    Some("messages"),
                    format!("messages[{index}] has the unknown role `{role}`"),
                ));
            }
            let tool_turn = matches!(role, "tool" | "function")
                || ["tool_calls", "function_call"]
                    .iter()
                    .any(|field| message.get(field).is_some_and(|value| !value.is_null()));
            if tool_turn {
                return Err(ChatError::invalid(
                    Some("messages"),
                    format!("cannot serve messages[{index}]: a turn of a tool or function call"),
                ));
            }
            let content = match message.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(text)) => text.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|part| {
                        part.get("text").and_then(Value::as_str).ok_or_else(|| {
                            let kind = part.get("type").and_then(Value::as_str).unwrap_or("?");
                            ChatError::invalid(
                                Some("messages"),
                                format!(
                                    "cannot serve messages[{index}]: a `{kind}` part (text only)"
                                ),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join("\n"),
                Some(_) => {
                    return Err(ChatError::invalid(
                        Some("messages"),
                        format!("messages[{index}].content must be a string or an array of parts"),
                    ));
                }
            };
            Ok(ChatMessage {
                role: role.to_owned(),
                content,
            })
        })
        .collect()
}

impl ChatCall {
    /// The request asked for a stream.
    pub fn is_stream(&self) -> bool {
        self.stream
    }

    /// Prompt tokens, by the engine's tokenizer.
    pub fn prompt_tokens(&self) -> usize {
        self.generation.prompt_tokens()
    }

    /// Waits for the whole answer: a `chat.completion` object.
    pub async fn complete(self) -> Result<Value, ChatError> {
        let Self {
            generation,
            id,
            created,
            model,
            stop,
            ..
        } = self;
        // The waiting thread gives up, and the generation stops, when this
        // future is dropped (the client went away), as a stream's does.
        let abandoned = Arc::new(AtomicBool::new(false));
        let _abandon = AbandonOnDrop(Arc::clone(&abandoned));
        let completion = tokio::task::spawn_blocking(move || generation.wait_unless(&abandoned))
            .await
            .map_err(|error| ChatError::failed(error.to_string()))?
            .map_err(|error| ChatError::failed(error.to_string()))?;
        let usage = &completion.usage;
        Ok(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                         "logprobs": null, "finish_reason": completion.finish_reason.as_str(),
                         "stop_reason": stop_reason(&stop, completion.finish_reason)}],
            "usage": {"prompt_tokens": usage.prompt_tokens,
                      "completion_tokens": usage.completion_tokens,
                      "total_tokens": usage.prompt_tokens + usage.completion_tokens},
        }))
    }

    /// The answer as SSE bytes, one chunk per event, ending with `data: [DONE]`
    /// (or, if the engine fails, with an error event and no `[DONE]`).
    /// Dropping the stream stops the generation.
    pub fn into_sse(self) -> impl Stream<Item = Bytes> + Send + 'static {
        let (sender, receiver) = tokio::sync::mpsc::channel::<Bytes>(STREAM_BUFFER);
        let Self {
            generation,
            id,
            created,
            model,
            include_usage,
            stop,
            ..
        } = self;
        tokio::task::spawn_blocking(move || {
            // A chunk of `delta`; the last carries why the answer ended.
            let chunk = |delta: Value, finish: Option<FinishReason>| {
                let mut choice = json!({"index": 0, "delta": delta, "logprobs": null,
                    "finish_reason": finish.map(FinishReason::as_str)});
                if let Some(finish) = finish {
                    choice["stop_reason"] = stop_reason(&stop, finish);
                }
                let chunk = json!({"id": id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [choice]});
                Bytes::from(format!("data: {chunk}\n\n"))
            };
            let first = chunk(json!({"role": "assistant", "content": ""}), None);
            if sender.blocking_send(first).is_err() {
                return;
            }
            for event in generation {
                let bytes = match event {
                    Event::Token { text, .. } if text.is_empty() => continue,
                    Event::Token { text, .. } => chunk(json!({"content": text}), None),
                    Event::Done {
                        finish_reason,
                        usage,
                    } => {
                        let mut last = vec![chunk(json!({}), Some(finish_reason))];
                        if include_usage {
                            let usage = json!({"id": id, "object": "chat.completion.chunk",
                                "created": created, "model": model, "choices": [],
                                "usage": {"prompt_tokens": usage.prompt_tokens,
                                          "completion_tokens": usage.completion_tokens,
                                          "total_tokens": usage.prompt_tokens + usage.completion_tokens}});
                            last.push(Bytes::from(format!("data: {usage}\n\n")));
                        }
                        last.push(Bytes::from_static(b"data: [DONE]\n\n"));
                        for bytes in last {
                            if sender.blocking_send(bytes).is_err() {
                                return;
                            }
                        }
                        return;
                    }
                    Event::Failed(error) => {
                        // No [DONE]: the stream ends with the error so clients
                        // cannot mistake it for a complete answer.
                        let body = ChatError::failed(error.to_string()).body();
                        let _ = sender.blocking_send(Bytes::from(format!("data: {body}\n\n")));
                        return;
                    }
                };
                if sender.blocking_send(bytes).is_err() {
                    return;
                }
            }
        });
        futures_util::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|bytes| (bytes, receiver))
        })
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos() as u64)
}
