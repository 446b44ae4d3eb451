//! Parsing and validating a Chat Completions request.

use serde_json::{Map, Value};

use crate::error::{ApiError, ErrorCode};
use crate::wire::format::ClientRequest;

/// The `messages` array (validated non-empty by [`parse`]).
pub fn messages(body: &Value) -> &[Value] {
    body["messages"].as_array().map_or(&[], Vec::as_slice)
}

/// Parses and validates a chat completion request.
pub fn parse(bytes: &[u8]) -> Result<ClientRequest, ApiError> {
    let body = json_object(bytes)?;
    let object = body.as_object().expect("json_object returns an object");
    let model = model_of(object)?;
    check_messages(object.get("messages"))?;
    let stream = stream_of(object)?;
    check_stream_options(object)?;
    for field in ["max_tokens", "max_completion_tokens", "n"] {
        match object.get(field) {
            None | Some(Value::Null) => {}
            Some(value) if value.as_u64().is_some() => {}
            Some(_) => {
                return Err(ApiError::invalid_param(
                    field_name(field),
                    format!("`{field}` must be a non-negative integer."),
                ));
            }
        }
    }
    let max_tokens = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|field| object.get(*field).and_then(Value::as_u64));
    Ok(ClientRequest {
        body,
        model,
        stream,
        max_tokens,
    })
}

/// The request body as a JSON object, or a 400 `invalid_json` (every
/// format's first check).
pub fn json_object(bytes: &[u8]) -> Result<Value, ApiError> {
    let body: Value = serde_json::from_slice(bytes).map_err(|error| {
        ApiError::new(
            ErrorCode::InvalidJson,
            format!("We could not parse the JSON body of your request: {error}"),
        )
    })?;
    if !body.is_object() {
        return Err(ApiError::new(
            ErrorCode::InvalidJson,
            "The request body must be a JSON object.",
        ));
    }
    Ok(body)
}

/// `model`: a non-empty string, as OpenAI's endpoints require it.
pub fn model_of(object: &Map<String, Value>) -> Result<String, ApiError> {
    match object.get("model") {
        Some(Value::String(model)) if !model.is_empty() => Ok(model.clone()),
        Some(_) => Err(ApiError::invalid_param(
            "model",
            "`model` must be a non-empty string.",
        )),
        None => Err(ApiError::invalid_param(
            "model",
            "You must provide a model parameter.",
        )),
    }
}

/// `stream`: a boolean, absent or null meaning false.
pub fn stream_of(object: &Map<String, Value>) -> Result<bool, ApiError> {
    match object.get("stream") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(stream)) => Ok(*stream),
        Some(_) => Err(ApiError::invalid_param(
            "stream",
            "`stream` must be a boolean.",
        )),
    }
}

/// `stream_options`: absent, null or an object whose `include_usage` is a
/// boolean or null. canarygate asks for the usage chunk itself, so a value
/// the provider would refuse must be refused here, not overwritten.
pub fn check_stream_options(object: &Map<String, Value>) -> Result<(), ApiError> {
    match object.get("stream_options") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Object(options)) => match options.get("include_usage") {
            None | Some(Value::Null | Value::Bool(_)) => Ok(()),
            Some(_) => Err(ApiError::invalid_param(
                "stream_options.include_usage",
                "`stream_options.include_usage` must be a boolean.",
            )),
        },
        Some(_) => Err(ApiError::invalid_param(
            "stream_options",
            "`stream_options` must be an object.",
        )),
    }
}

/// `messages`: a non-empty array of objects with a string `role` and string,
/// array or absent `content`.
fn check_messages(messages: Option<&Value>) -> Result<(), ApiError> {
    let messages = match messages {
        Some(Value::Array(messages)) if !messages.is_empty() => messages,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` must hold at least one message.",
            ));
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` must be an array of message objects.",
            ));
        }
        None => {
            return Err(ApiError::invalid_param(
                "messages",
                "Missing required parameter: `messages`.",
            ));
        }
    };
    for (index, message) in messages.iter().enumerate() {
        if message.get("role").and_then(Value::as_str).is_none() {
            return Err(ApiError::invalid_param(
                "messages",
                format!("messages[{index}] must be an object with a string `role`."),
            ));
        }
        match message.get("content") {
            None | Some(Value::Null | Value::String(_) | Value::Array(_)) => {}
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "messages",
                    format!("messages[{index}].content must be a string or an array of parts."),
                ));
            }
        }
    }
    Ok(())
}

fn field_name(field: &str) -> &'static str {
    match field {
        "max_tokens" => "max_tokens",
        "max_completion_tokens" => "max_completion_tokens",
        _ => "n",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(body: &str) -> (ErrorCode, Option<&'static str>) {
        let error = parse(body.as_bytes()).unwrap_err();
        (error.code, error.param)
    }

    #[test]
    fn accepts_minimal_request() {
        let request =
            parse(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#)
                .unwrap();
        assert_eq!(request.model, "m");
        assert!(request.stream);
        assert_eq!(messages(&request.body).len(), 1);
    }

    #[test]
    fn a_stream_options_canarygate_would_overwrite_is_checked_first() {
        let with = |options: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"stream":true,"stream_options":{options}}}"#
            )
        };
        for bad in ["\"x\"", "42", "[]"] {
            assert_eq!(
                code(&with(bad)),
                (ErrorCode::InvalidValue, Some("stream_options")),
                "{bad}"
            );
        }
        assert_eq!(
            code(&with(r#"{"include_usage":"yes"}"#)).1,
            Some("stream_options.include_usage")
        );
        for good in [
            "null",
            "{}",
            r#"{"include_usage":false}"#,
            r#"{"include_obfuscation":false}"#,
        ] {
            assert!(parse(with(good).as_bytes()).is_ok(), "{good}");
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        assert_eq!(code("{not json").0, ErrorCode::InvalidJson);
        assert_eq!(code("[1]").0, ErrorCode::InvalidJson);
        assert_eq!(code(r#"{"messages":[]}"#).1, Some("model"));
        assert_eq!(code(r#"{"model":3,"messages":[]}"#).1, Some("model"));
        assert_eq!(code(r#"{"model":"m"}"#).1, Some("messages"));
        assert_eq!(code(r#"{"model":"m","messages":"hi"}"#).1, Some("messages"));
        assert_eq!(
            code(r#"{"model":"m","messages":[{"content":"x"}]}"#).1,
            Some("messages")
        );
        assert_eq!(
            code(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":"yes"}"#).1,
            Some("stream")
        );
        assert_eq!(
            code(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#).1,
            Some("max_tokens")
        );
    }
}
