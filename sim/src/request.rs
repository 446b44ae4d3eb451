//! What the model is asked to generate ([`Generation`]: the settings every
//! surface's request comes down to), and the chat completion request read
//! into it: the fields it honours, validated the way OpenAI validates them (a
//! 400 `invalid_request_error` naming the `param`). Other fields are accepted
//! and ignored, as a provider ignores what it does not implement.

use serde_json::Value;

use crate::error::SimError;

/// Most choices a request may ask for (OpenAI's bound on `n`).
pub const MAX_N: u64 = 128;

/// Most alternatives per token a request may ask for (`top_logprobs`).
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// What the model is asked to generate, whatever the surface: every
/// surface's request is read into one of these and a conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub model: String,
    pub stream: bool,
    /// The completion budget per choice, reasoning included.
    pub max_tokens: Option<u64>,
    /// Choices per conversation (`n`), at least 1.
    pub choices: usize,
    /// `Some(k)` when logprobs were asked, with `k` alternatives per token.
    pub top_logprobs: Option<usize>,
    /// What the model may call.
    pub tooling: Option<Tooling>,
    /// The model thinks before it answers (reasoning models, Anthropic's
    /// extended thinking).
    pub thinks: bool,
    /// Chat streams: a usage chunk at the end.
    pub include_usage: bool,
    /// Chat streams: `obfuscation` padding on every chunk.
    pub include_obfuscation: bool,
    /// `response_format` `json_object` or `json_schema`: the content is a
    /// JSON object, `{"answer": ...}`.
    pub json_mode: bool,
    /// Chat's `web_search_options` (OpenAI's search models): the content
    /// cites a source, a `url_citation` annotation on its last word.
    pub web_search: bool,
}

impl Generation {
    /// A plain generation for `model`: one choice, no budget, no tools.
    pub fn plain(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            stream: false,
            max_tokens: None,
            choices: 1,
            top_logprobs: None,
            tooling: None,
            thinks: false,
            include_usage: false,
            include_obfuscation: false,
            json_mode: false,
            web_search: false,
        }
    }
}

/// A chat completion request: its generation settings and its messages.
#[derive(Debug)]
pub struct ChatRequest {
    pub generation: Generation,
    pub messages: Vec<Value>,
}

/// The chat completion body as sent.
#[derive(serde::Deserialize)]
struct ChatBody {
    model: String,
    messages: Vec<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    n: Option<Value>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<Value>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    functions: Option<Vec<Value>>,
    #[serde(default)]
    function_call: Option<Value>,
    #[serde(default)]
    response_format: Option<Value>,
    #[serde(default)]
    web_search_options: Option<Value>,
}

/// `stream_options` (chat and legacy completions).
#[derive(serde::Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
    #[serde(default)]
    pub include_obfuscation: Option<bool>,
}

/// A function the model may call: a `tools[i].function` or a `functions[i]`
/// (or a Responses or Messages tool).
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionSpec {
    pub name: String,
    /// Its JSON Schema (`parameters`, `input_schema`), `null` when absent.
    pub parameters: Value,
}

/// What the model may call, and how it must choose.
#[derive(Debug, Clone, PartialEq)]
pub struct Tooling {
    pub functions: Vec<FunctionSpec>,
    pub choice: CallChoice,
    /// Legacy `functions`/`function_call`: one `message.function_call`.
    pub legacy: bool,
    /// `parallel_tool_calls` (default true): several calls in one answer.
    pub parallel: bool,
}

/// `tool_choice` / `function_call`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallChoice {
    /// `"none"`: never call.
    Never,
    /// `"auto"` (the default): call the functions the last user message names.
    Auto,
    /// `"required"`: call at least one.
    Required,
    /// `{"type": "function", "function": {"name": ...}}` or `{"name": ...}`.
    Named(String),
}

impl ChatRequest {
    /// Parses and validates a chat completion body; anything malformed is a
    /// 400, as a provider answers it.
    pub fn parse(body: &[u8]) -> Result<Self, SimError> {
        let request: ChatBody = parse_json(body)?;
        let system = |message: &Value| {
            matches!(
                message.get("role").and_then(Value::as_str),
                Some("system" | "developer")
            )
        };
        if request.model == crate::model::SYSTEMLESS_MODEL && request.messages.iter().any(system) {
            return Err(SimError::invalid_request(None, "System role not supported"));
        }
        if request.messages.is_empty() {
            return Err(SimError::invalid_request(
                None,
                "`messages` must hold at least one message.",
            )
            .with_param("messages"));
        }
        let choices = usize::try_from(bounded(request.n.as_ref(), "n", 1, MAX_N)?.unwrap_or(1))
            .unwrap_or(usize::MAX);
        let top = bounded(
            request.top_logprobs.as_ref(),
            "top_logprobs",
            0,
            MAX_TOP_LOGPROBS,
        )?;
        let logprobs = request.logprobs.unwrap_or(false);
        if top.is_some() && !logprobs {
            return Err(SimError::invalid_request(
                Some("invalid_value"),
                "Invalid value for 'top_logprobs': 'logprobs' must be set to true when \
                 'top_logprobs' is used.",
            )
            .with_param("top_logprobs"));
        }
        let tooling = request.tooling()?;
        let json_mode = json_mode(request.response_format.as_ref(), &request.messages)?;
        let options = request.stream_options.unwrap_or_default();
        let generation = Generation {
            thinks: crate::model::is_reasoner(&request.model),
            model: request.model,
            stream: request.stream.unwrap_or(false),
            max_tokens: request.max_completion_tokens.or(request.max_tokens),
            choices,
            top_logprobs: logprobs.then(|| usize::try_from(top.unwrap_or(0)).unwrap_or(0)),
            tooling,
            include_usage: options.include_usage.unwrap_or(false),
            include_obfuscation: options.include_obfuscation.unwrap_or(true),
            json_mode,
            web_search: request.web_search_options.is_some(),
        };
        Ok(Self {
            generation,
            messages: request.messages,
        })
    }
}

/// Whether `response_format` asks for JSON. OpenAI refuses `json_object`
/// when no message mentions JSON (the model would not know to write it).
fn json_mode(format: Option<&Value>, messages: &[Value]) -> Result<bool, SimError> {
    match format
        .and_then(|format| format.get("type"))
        .and_then(Value::as_str)
    {
        Some("json_schema") => Ok(true),
        Some("json_object") => {
            let mentions = messages.iter().any(|message| {
                message
                    .get("content")
                    .is_some_and(|content| content.to_string().to_lowercase().contains("json"))
            });
            if mentions {
                Ok(true)
            } else {
                Err(SimError::invalid_request(
                    None,
                    "'messages' must contain the word 'json' in some form, to use \
                     'response_format' of type 'json_object'.",
                )
                .with_param("messages"))
            }
        }
        _ => Ok(false),
    }
}

/// Parses a JSON request body, or answers 400 as OpenAI does.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, SimError> {
    serde_json::from_slice(body).map_err(|error| {
        SimError::invalid_request(
            None,
            format!("We could not parse the JSON body of your request: {error}"),
        )
    })
}

impl ChatBody {
    fn tooling(&self) -> Result<Option<Tooling>, SimError> {
        let tools = self.tools.as_deref().unwrap_or_default();
        let functions = self.functions.as_deref().unwrap_or_default();
        if !tools.is_empty() {
            let specs = tools
                .iter()
                .map(|tool| {
                    (tool["type"] == "function")
                        .then(|| function_spec(&tool["function"]))
                        .flatten()
                        .ok_or_else(|| {
                            invalid(
                                "tools",
                                "Invalid value for 'tools': each tool must be \
                                 {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                            )
                        })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let choice = call_choice(self.tool_choice.as_ref(), "tool_choice", &specs)?;
            return Ok(Some(Tooling {
                functions: specs,
                choice,
                legacy: false,
                parallel: self.parallel_tool_calls.unwrap_or(true),
            }));
        }
        if self
            .tool_choice
            .as_ref()
            .is_some_and(|choice| !choice.is_null())
        {
            return Err(invalid(
                "tool_choice",
                "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' \
                 are specified.",
            ));
        }
        if !functions.is_empty() {
            let specs = functions
                .iter()
                .map(|function| {
                    function_spec(function).ok_or_else(|| {
                        invalid(
                            "functions",
                            "Invalid value for 'functions': each function needs a 'name'.",
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let choice = call_choice(self.function_call.as_ref(), "function_call", &specs)?;
            return Ok(Some(Tooling {
                functions: specs,
                choice,
                legacy: true,
                parallel: false,
            }));
        }
        Ok(None)
    }
}

/// 400 `invalid_value` about `param`.
pub fn invalid(param: &'static str, message: &str) -> SimError {
    SimError::invalid_request(Some("invalid_value"), message).with_param(param)
}

/// `value` as an integer in `min..=max`, `None` when absent or null.
pub fn bounded(
    value: Option<&Value>,
    param: &'static str,
    min: u64,
    max: u64,
) -> Result<Option<u64>, SimError> {
    let Some(value) = value.filter(|value| !value.is_null()) else {
        return Ok(None);
    };
    let Some(number) = value.as_i64().or_else(|| value.as_u64().map(|n| n as i64)) else {
        return Err(SimError::invalid_request(
            Some("invalid_type"),
            format!("Invalid type for '{param}': expected an integer, but got {value} instead."),
        )
        .with_param(param));
    };
    if number < min as i64 {
        return Err(SimError::invalid_request(
            Some("integer_below_min_value"),
            format!(
                "Invalid '{param}': integer below minimum value. Expected a value >= {min}, \
                 but got {number} instead."
            ),
        )
        .with_param(param));
    }
    if number > max as i64 {
        return Err(SimError::invalid_request(
            Some("integer_above_max_value"),
            format!(
                "Invalid '{param}': integer above maximum value. Expected a value <= {max}, \
                 but got {number} instead."
            ),
        )
        .with_param(param));
    }
    Ok(Some(number as u64))
}

/// A function's `name` and `parameters`, `None` without a name.
pub fn function_spec(function: &Value) -> Option<FunctionSpec> {
    let name = function["name"].as_str().filter(|name| !name.is_empty())?;
    Some(FunctionSpec {
        name: name.to_owned(),
        parameters: function["parameters"].clone(),
    })
}

/// Reads a `tool_choice` (or legacy `function_call`) against the functions
/// offered.
pub fn call_choice(
    value: Option<&Value>,
    param: &'static str,
    specs: &[FunctionSpec],
) -> Result<CallChoice, SimError> {
    let choice = match value {
        None | Some(Value::Null) => CallChoice::Auto,
        Some(Value::String(text)) => match text.as_str() {
            "none" => CallChoice::Never,
            "auto" => CallChoice::Auto,
            "required" if param == "tool_choice" => CallChoice::Required,
            _ => {
                return Err(invalid(
                    param,
                    &format!("Invalid value for '{param}': '{text}' is not one of the choices."),
                ));
            }
        },
        Some(object) => {
            let name = if param == "tool_choice" {
                (object["type"] == "function")
                    .then(|| object["function"]["name"].as_str())
                    .flatten()
            } else {
                object["name"].as_str()
            };
            CallChoice::Named(
                name.ok_or_else(|| {
                    invalid(param, &format!("Invalid value for '{param}': {object}."))
                })?
                .to_owned(),
            )
        }
    };
    if let CallChoice::Named(name) = &choice
        && !specs.iter().any(|spec| &spec.name == name)
    {
        return Err(invalid(
            param,
            &format!(
                "Invalid value for '{param}': function '{name}' is not among the ones offered."
            ),
        ));
    }
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: Value) -> Result<Generation, SimError> {
        ChatRequest::parse(body.to_string().as_bytes()).map(|request| request.generation)
    }

    fn base() -> Value {
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    }

    fn param_of(body: Value) -> String {
        let error = parse(body).expect_err("rejected");
        assert_eq!(error.status(), 400);
        error.param().unwrap_or_default().to_owned()
    }

    #[test]
    fn json_mode_needs_a_message_that_asks_for_json() {
        let mut body = base();
        assert!(!parse(body.clone()).unwrap().json_mode);
        body["response_format"] = json!({"type": "json_object"});
        assert_eq!(param_of(body.clone()), "messages");
        body["messages"][0]["content"] = json!("hi, in JSON please");
        assert!(parse(body.clone()).unwrap().json_mode);
        let mut body = base();
        body["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "a"}});
        assert!(parse(body).unwrap().json_mode);
    }

    #[test]
    fn n_and_top_logprobs_are_bounded() {
        assert_eq!(parse(base()).unwrap().choices, 1);
        let mut body = base();
        body["n"] = json!(128);
        assert_eq!(parse(body.clone()).unwrap().choices, 128);
        for bad in [json!(0), json!(129), json!(-1), json!("2"), json!(1.5)] {
            body["n"] = bad;
            assert_eq!(param_of(body.clone()), "n");
        }
        let mut body = base();
        body["logprobs"] = json!(true);
        assert_eq!(parse(body.clone()).unwrap().top_logprobs, Some(0));
        body["top_logprobs"] = json!(20);
        assert_eq!(parse(body.clone()).unwrap().top_logprobs, Some(20));
        for bad in [json!(21), json!(-1), json!("3")] {
            body["top_logprobs"] = bad;
            assert_eq!(param_of(body.clone()), "top_logprobs");
        }
        let mut body = base();
        body["top_logprobs"] = json!(2);
        assert_eq!(param_of(body), "top_logprobs", "needs logprobs: true");
        assert_eq!(parse(base()).unwrap().top_logprobs, None);
    }

    #[test]
    fn tools_and_functions_are_read_and_checked() {
        let mut body = base();
        body["tools"] = json!([{"type": "function", "function": {"name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]);
        let tooling = parse(body.clone()).unwrap().tooling.unwrap();
        assert_eq!(tooling.functions[0].name, "lookup");
        assert_eq!(tooling.choice, CallChoice::Auto);
        assert!(tooling.parallel && !tooling.legacy);
        body["tool_choice"] = json!("required");
        assert_eq!(
            parse(body.clone()).unwrap().tooling.unwrap().choice,
            CallChoice::Required
        );
        body["tool_choice"] = json!({"type": "function", "function": {"name": "lookup"}});
        assert_eq!(
            parse(body.clone()).unwrap().tooling.unwrap().choice,
            CallChoice::Named("lookup".into())
        );
        body["tool_choice"] = json!({"type": "function", "function": {"name": "other"}});
        assert_eq!(param_of(body.clone()), "tool_choice");
        body["tool_choice"] = json!("sometimes");
        assert_eq!(param_of(body.clone()), "tool_choice");
        body["tools"] = json!([{"type": "function", "function": {}}]);
        assert_eq!(param_of(body), "tools");
        let mut body = base();
        body["tool_choice"] = json!("auto");
        assert_eq!(param_of(body), "tool_choice", "no tools offered");

        let mut body = base();
        body["functions"] = json!([{"name": "lookup"}]);
        body["function_call"] = json!({"name": "lookup"});
        let tooling = parse(body.clone()).unwrap().tooling.unwrap();
        assert!(tooling.legacy && !tooling.parallel);
        assert_eq!(tooling.choice, CallChoice::Named("lookup".into()));
        body["function_call"] = json!("required");
        assert_eq!(param_of(body), "function_call");
    }
}
