//! Parsing and validating a chat completion request body.
//!
//! Only what canarygate relies on is checked; every other field passes through
//! untouched for the provider to judge.

use serde_json::Value;

use crate::error::ApiError;

/// A chat completion request canarygate accepted.
#[derive(Debug)]
pub struct ChatRequest {
    /// The whole body, as parsed.
    pub body: Value,
    /// The `model` the client asked for.
    pub model: String,
    /// `stream: true`.
    pub stream: bool,
}

impl ChatRequest {
    /// Parses `bytes` as a chat completion request.
    pub fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        let body: Value = serde_json::from_slice(bytes).map_err(|error| {
            ApiError::invalid_request(
                "invalid_json",
                format!("We could not parse the JSON body of your request: {error}"),
            )
        })?;
        let object = body.as_object().ok_or_else(|| {
            ApiError::invalid_request("invalid_json", "The request body must be a JSON object.")
        })?;
        let model = match object.get("model") {
            Some(Value::String(model)) if !model.is_empty() => model.clone(),
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "model",
                    "`model` must be a non-empty string.",
                ));
            }
            None => {
                return Err(ApiError::invalid_param(
                    "model",
                    "You must provide a model parameter.",
                ));
            }
        };
        let messages = match object.get("messages") {
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
            let role = message.get("role").and_then(Value::as_str);
            if role.is_none() {
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
        let stream = match object.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(stream)) => *stream,
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "stream",
                    "`stream` must be a boolean.",
                ));
            }
        };
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
        Ok(Self {
            body,
            model,
            stream,
        })
    }

    /// The `messages` array (validated non-empty).
    pub fn messages(&self) -> &[Value] {
        self.body["messages"].as_array().map_or(&[], Vec::as_slice)
    }

    /// The client's `max_completion_tokens`, else `max_tokens`, if any.
    pub fn max_tokens(&self) -> Option<u64> {
        ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|field| self.body.get(*field).and_then(Value::as_u64))
    }
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

    fn code(body: &str) -> (&'static str, Option<&'static str>) {
        let error = ChatRequest::parse(body.as_bytes()).unwrap_err();
        (error.code, error.param)
    }

    #[test]
    fn accepts_minimal_request() {
        let request = ChatRequest::parse(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
        )
        .unwrap();
        assert_eq!(request.model, "m");
        assert!(request.stream);
        assert_eq!(request.messages().len(), 1);
    }

    #[test]
    fn rejects_bad_shapes() {
        assert_eq!(code("{not json").0, "invalid_json");
        assert_eq!(code("[1]").0, "invalid_json");
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
