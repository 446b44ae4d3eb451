//! A Responses API request as the simulator reads it: its input items
//! become chat-shaped messages, its tools the functions the model may call.
//!
//! Input items (OpenAI's `response_input_param`): a string (one user
//! message); messages `{role, content}` with `content` a string or parts
//! (`input_text`, `output_text`; images and files have no text); earlier
//! `function_call`s (an assistant message with `tool_calls`) and
//! `function_call_output`s (a `tool` message); `reasoning` and
//! `item_reference` items carry nothing the model re-reads. Function tools
//! are flat (`{type: "function", name, parameters}`); other tool types are
//! echoed back and never called.

use serde_json::{Value, json};

use crate::error::SimError;
use crate::model::is_reasoner;
use crate::request::{
    CallChoice, FunctionSpec, Generation, MAX_TOP_LOGPROBS, StreamOptions, Tooling, bounded,
    invalid, parse_json,
};

/// Smallest `max_output_tokens` OpenAI accepts.
pub const MIN_OUTPUT_TOKENS: u64 = 16;

/// What `include` names to get the logprobs of output text.
pub const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

#[derive(serde::Deserialize)]
struct ResponsesBody {
    model: String,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    reasoning: Option<Value>,
    #[serde(default)]
    max_output_tokens: Option<Value>,
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    include: Option<Vec<String>>,
    #[serde(default)]
    top_logprobs: Option<Value>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    truncation: Option<String>,
    #[serde(default)]
    user: Option<String>,
}

/// A Responses API request.
#[derive(Debug, Clone)]
pub struct ResponsesRequest {
    pub generation: Generation,
    /// This request's input, as chat-shaped messages.
    pub input: Vec<Value>,
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub store: bool,
    /// `reasoning.summary` asked for: reasoning items carry a summary.
    pub summary: bool,
    /// The request fields a response echoes: `tools`, `tool_choice`,
    /// `text`, `reasoning`, `metadata`, `temperature`, `top_p`,
    /// `truncation`, `user`, `parallel_tool_calls`, `max_output_tokens`,
    /// `top_logprobs`.
    pub echo: serde_json::Map<String, Value>,
}

impl ResponsesRequest {
    /// Parses and validates a body (400 naming the `param` otherwise).
    pub fn parse(body: &[u8]) -> Result<Self, SimError> {
        let body: ResponsesBody = parse_json(body)?;
        let input = match &body.input {
            None | Some(Value::Null) if body.previous_response_id.is_some() => Vec::new(),
            None | Some(Value::Null) => {
                return Err(SimError::invalid_request(
                    None,
                    "Missing required parameter: 'input'.",
                )
                .with_param("input"));
            }
            Some(Value::String(text)) => vec![json!({"role": "user", "content": text})],
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(|item| message(item).transpose())
                .collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(invalid(
                    "input",
                    "Invalid type for 'input': expected a string or an array of input items.",
                ));
            }
        };
        if input.is_empty() && body.previous_response_id.is_none() {
            return Err(SimError::invalid_request(
                Some("empty_array"),
                "Invalid 'input': empty array. Expected an array with minimum length 1.",
            )
            .with_param("input"));
        }
        let max_output_tokens = bounded(
            body.max_output_tokens.as_ref(),
            "max_output_tokens",
            MIN_OUTPUT_TOKENS,
            u64::MAX >> 1,
        )?;
        let tools = body.tools.clone().unwrap_or_default();
        let tooling = tooling(&tools, body.tool_choice.as_ref(), body.parallel_tool_calls)?;
        let text = body
            .text
            .clone()
            .unwrap_or_else(|| json!({"format": {"type": "text"}}));
        check_format(&text["format"])?;
        let top = bounded(
            body.top_logprobs.as_ref(),
            "top_logprobs",
            0,
            MAX_TOP_LOGPROBS,
        )?;
        let logprobs = body
            .include
            .iter()
            .flatten()
            .any(|item| item == INCLUDE_LOGPROBS);
        let reasoning = body.reasoning.clone().unwrap_or(Value::Null);
        let summary = ["summary", "generate_summary"].iter().any(|field| {
            reasoning[field]
                .as_str()
                .is_some_and(|value| value != "none")
        });
        let reasoner = is_reasoner(&body.model);
        let mut echo = serde_json::Map::new();
        echo.insert("tools".into(), json!(tools));
        echo.insert(
            "tool_choice".into(),
            body.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        );
        echo.insert("text".into(), text);
        echo.insert(
            "reasoning".into(),
            if reasoner {
                json!({"effort": reasoning.get("effort").cloned().unwrap_or(json!("medium")),
                       "summary": reasoning.get("summary").cloned().unwrap_or(Value::Null)})
            } else {
                json!({"effort": null, "summary": null})
            },
        );
        echo.insert(
            "metadata".into(),
            body.metadata.clone().unwrap_or_else(|| json!({})),
        );
        echo.insert("temperature".into(), json!(body.temperature.unwrap_or(1.0)));
        echo.insert("top_p".into(), json!(body.top_p.unwrap_or(1.0)));
        echo.insert(
            "truncation".into(),
            json!(body.truncation.clone().unwrap_or_else(|| "disabled".into())),
        );
        echo.insert("user".into(), json!(body.user));
        echo.insert(
            "parallel_tool_calls".into(),
            json!(body.parallel_tool_calls.unwrap_or(true)),
        );
        echo.insert("max_output_tokens".into(), json!(max_output_tokens));
        echo.insert("top_logprobs".into(), json!(top.unwrap_or(0)));
        let options = body.stream_options.unwrap_or_default();
        Ok(Self {
            generation: Generation {
                stream: body.stream.unwrap_or(false),
                max_tokens: max_output_tokens,
                top_logprobs: logprobs.then(|| top.unwrap_or(0) as usize),
                tooling,
                thinks: reasoner,
                include_obfuscation: options.include_obfuscation.unwrap_or(true),
                ..Generation::plain(body.model)
            },
            input,
            instructions: body.instructions,
            previous_response_id: body.previous_response_id,
            store: body.store.unwrap_or(true),
            summary: reasoner && summary,
            echo,
        })
    }
}

/// The chat-shaped message of one input item; `None` for items the model
/// does not re-read.
fn message(item: &Value) -> Result<Option<Value>, SimError> {
    let kind = item["type"].as_str();
    Ok(Some(match kind {
        None | Some("message") => {
            let role = item["role"].as_str().unwrap_or("");
            if !matches!(role, "user" | "assistant" | "system" | "developer") {
                return Err(invalid(
                    "input",
                    &format!(
                        "Invalid value for 'input[].role': '{role}' is not one of 'user', 'assistant', 'system', 'developer'."
                    ),
                ));
            }
            match &item["content"] {
                Value::String(_) | Value::Array(_) => {
                    json!({"role": role, "content": item["content"]})
                }
                _ => {
                    return Err(invalid(
                        "input",
                        "Invalid 'input[].content': expected a string or an array of content parts.",
                    ));
                }
            }
        }
        Some("function_call") => {
            let (Some(call_id), Some(name)) = (item["call_id"].as_str(), item["name"].as_str())
            else {
                return Err(invalid(
                    "input",
                    "Invalid 'input[]': a function_call needs 'call_id' and 'name'.",
                ));
            };
            json!({"role": "assistant", "content": null, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": name, "arguments": item["arguments"].as_str().unwrap_or("")},
            }]})
        }
        Some("function_call_output") => {
            let Some(call_id) = item["call_id"].as_str() else {
                return Err(invalid(
                    "input",
                    "Invalid 'input[]': a function_call_output needs 'call_id'.",
                ));
            };
            json!({"role": "tool", "tool_call_id": call_id, "content": item["output"]})
        }
        Some("reasoning" | "item_reference") => return Ok(None),
        Some(other) => {
            return Err(invalid(
                "input",
                &format!("Invalid 'input[].type': '{other}' is not supported."),
            ));
        }
    }))
}

/// The functions offered and how the model must choose among them.
fn tooling(
    tools: &[Value],
    choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<Option<Tooling>, SimError> {
    let functions: Vec<FunctionSpec> = tools
        .iter()
        .filter(|tool| tool["type"] == "function")
        .map(|tool| {
            tool["name"]
                .as_str()
                .filter(|name| !name.is_empty())
                .map(|name| FunctionSpec {
                    name: name.to_owned(),
                    parameters: tool["parameters"].clone(),
                })
                .ok_or_else(|| invalid("tools", "Missing required parameter: 'tools[].name'."))
        })
        .collect::<Result<_, _>>()?;
    let choice = match choice {
        None | Some(Value::Null) => CallChoice::Auto,
        Some(Value::String(text)) => match text.as_str() {
            "none" => CallChoice::Never,
            "auto" => CallChoice::Auto,
            "required" => CallChoice::Required,
            _ => {
                return Err(invalid(
                    "tool_choice",
                    &format!("Invalid value for 'tool_choice': '{text}'."),
                ));
            }
        },
        Some(object) if object["type"] == "function" => {
            let name = object["name"].as_str().unwrap_or("");
            if !functions.iter().any(|function| function.name == name) {
                return Err(invalid(
                    "tool_choice",
                    &format!(
                        "Invalid value for 'tool_choice': function '{name}' is not among the tools."
                    ),
                ));
            }
            CallChoice::Named(name.to_owned())
        }
        // Hosted-tool and allowed-tools choices: the model calls no hosted tool.
        Some(_) => CallChoice::Auto,
    };
    if functions.is_empty() {
        return Ok(None);
    }
    Ok(Some(Tooling {
        functions,
        choice,
        legacy: false,
        parallel: parallel.unwrap_or(true),
    }))
}

/// Checks `text.format`: `text`, `json_object`, or `json_schema` with a
/// `name` and a `schema`.
fn check_format(format: &Value) -> Result<(), SimError> {
    match format["type"].as_str() {
        None | Some("text" | "json_object") => Ok(()),
        Some("json_schema") => {
            if format["name"].as_str().is_none_or(str::is_empty) {
                return Err(SimError::invalid_request(
                    None,
                    "Missing required parameter: 'text.format.name'.",
                )
                .with_param("text.format.name"));
            }
            if !format["schema"].is_object() {
                return Err(SimError::invalid_request(
                    None,
                    "Missing required parameter: 'text.format.schema'.",
                )
                .with_param("text.format.schema"));
            }
            Ok(())
        }
        Some(other) => Err(invalid(
            "text.format.type",
            &format!("Invalid value for 'text.format.type': '{other}'."),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: Value) -> Result<ResponsesRequest, SimError> {
        ResponsesRequest::parse(body.to_string().as_bytes())
    }

    #[test]
    fn input_items_become_messages() {
        let request = parse(json!({"model": "sim-model", "instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        ]}))
        .unwrap();
        let roles: Vec<&str> = request
            .input
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
        assert_eq!(
            request.input[1]["tool_calls"][0]["function"]["name"],
            "get_weather"
        );
        assert_eq!(request.input[2]["content"], "sunny");
        assert_eq!(request.instructions.as_deref(), Some("Be brief."));
        assert!(request.store, "stored by default");
        let plain = parse(json!({"model": "m", "input": "hi"})).unwrap();
        assert_eq!(plain.input, [json!({"role": "user", "content": "hi"})]);
        assert_eq!(plain.echo["tool_choice"], "auto");
        assert_eq!(plain.echo["text"], json!({"format": {"type": "text"}}));
    }

    #[test]
    fn bad_fields_name_their_param() {
        for (body, param) in [
            (json!({"model": "m"}), "input"),
            (json!({"model": "m", "input": 3}), "input"),
            (json!({"model": "m", "input": []}), "input"),
            (
                json!({"model": "m", "input": [{"role": "robot", "content": "x"}]}),
                "input",
            ),
            (
                json!({"model": "m", "input": [{"type": "mystery"}]}),
                "input",
            ),
            (
                json!({"model": "m", "input": "x", "max_output_tokens": 15}),
                "max_output_tokens",
            ),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "function"}]}),
                "tools",
            ),
            (
                json!({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "f"}}),
                "tool_choice",
            ),
            (
                json!({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}),
                "text.format.name",
            ),
        ] {
            let error = parse(body.clone())
                .err()
                .unwrap_or_else(|| panic!("accepted {body}"));
            assert_eq!(error.param(), Some(param), "{body}");
        }
        assert!(parse(json!({"model": "m", "previous_response_id": "resp_1"})).is_ok());
    }

    #[test]
    fn tools_reasoning_and_logprobs_are_read() {
        let request = parse(json!({"model": "sim-reasoner", "input": "x",
            "tools": [{"type": "function", "name": "lookup", "parameters": {}}, {"type": "web_search"}],
            "tool_choice": {"type": "function", "name": "lookup"}, "parallel_tool_calls": false,
            "reasoning": {"effort": "low", "summary": "auto"},
            "include": [INCLUDE_LOGPROBS], "top_logprobs": 2}))
        .unwrap();
        let tooling = request.generation.tooling.unwrap();
        assert_eq!(tooling.functions.len(), 1, "hosted tools are never called");
        assert_eq!(tooling.choice, CallChoice::Named("lookup".into()));
        assert!(!tooling.parallel);
        assert!(request.generation.thinks && request.summary);
        assert_eq!(request.generation.top_logprobs, Some(2));
        assert_eq!(
            request.echo["reasoning"],
            json!({"effort": "low", "summary": "auto"})
        );
        let quiet = parse(json!({"model": "sim-reasoner", "input": "x"})).unwrap();
        assert!(
            quiet.generation.thinks && !quiet.summary,
            "no summary unless asked"
        );
    }
}
