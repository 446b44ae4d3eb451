//! Errors in a Responses stream.
//!
//! A Responses stream reports a failure with an `error` event:
//! `{"type":"error","code","message","param","sequence_number"}`. The
//! openai SDK yields that event to the caller without raising; it raises
//! `APIError` only for event data with a top-level `error` object. So
//! canarygate's error event carries both: the Responses fields, for clients
//! that read the typed event, and OpenAI's `error` object (the same one as
//! a whole-answer error), which makes the SDK's stream fail loudly.

use serde_json::{Value, json};

use crate::error::ApiError;
use crate::wire::chat::error_json;

/// `error` as a Responses `error` event's data (without its
/// `sequence_number`, which the stream's writer adds).
pub fn error_event_json(error: &ApiError) -> Value {
    let body = error_json(error);
    json!({
        "type": "error",
        "code": error.code.code(),
        "message": error.message,
        "param": error.param,
        "error": body["error"],
    })
}

/// A provider's error event or error body (`data`) as OpenAI's error body,
/// `{"error": {"message", "type", "param", "code"}}`: an `error` event's
/// own fields moved under `error`, with the type its `code` stands for
/// ([`type_of_code`]; the event has none); a body that is one (an `error`
/// object and no response around it: a failed `response` also carries
/// `error`, and is an answer) as it is. `None` for anything else.
pub fn error_body_of(data: &Value) -> Option<Value> {
    if data.get("error").is_some_and(Value::is_object) {
        let response = ["object", "status", "output"]
            .iter()
            .any(|key| data.get(*key).is_some());
        return (!response).then(|| data.clone());
    }
    if data.get("type").and_then(Value::as_str) != Some("error") {
        return None;
    }
    let field = |key: &str| data.get(key).cloned().unwrap_or(Value::Null);
    let code = data.get("code").and_then(Value::as_str);
    Some(json!({"error": {
        "message": field("message"),
        "type": type_of_code(code),
        "param": field("param"),
        "code": field("code"),
    }}))
}

/// The error type an `error` event's `code` stands for, as OpenAI's error
/// bodies name them: the request's fault (`invalid_prompt`,
/// `context_length_exceeded`, the `invalid_image_*` and `image_*` codes,
/// `unsupported_*`, `empty_image_file`, `failed_to_download_image`) an
/// `invalid_request_error` (400), a rate or quota limit its own code
/// (429), anything else, or none, a `server_error` (500).
fn type_of_code(code: Option<&str>) -> &str {
    match code {
        Some(code @ ("rate_limit_exceeded" | "insufficient_quota")) => code,
        Some(code)
            if code.starts_with("invalid_")
                || code.starts_with("image_")
                || code.starts_with("unsupported_")
                || matches!(
                    code,
                    "context_length_exceeded" | "empty_image_file" | "failed_to_download_image"
                ) =>
        {
            "invalid_request_error"
        }
        _ => "server_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_event_becomes_an_error_body() {
        let event = json!({"type": "error", "code": "server_error", "message": "boom",
            "param": null, "sequence_number": 3});
        assert_eq!(
            error_body_of(&event).unwrap(),
            json!({"error": {"message": "boom", "type": "server_error", "param": null,
                "code": "server_error"}})
        );
        // The request's fault, a limit, anything else.
        for (code, kind) in [
            ("invalid_prompt", "invalid_request_error"),
            ("context_length_exceeded", "invalid_request_error"),
            ("image_content_policy_violation", "invalid_request_error"),
            ("rate_limit_exceeded", "rate_limit_exceeded"),
            ("vector_store_timeout", "server_error"),
        ] {
            let event = json!({"type": "error", "code": code, "message": "m"});
            assert_eq!(
                error_body_of(&event).unwrap()["error"]["type"],
                kind,
                "{code}"
            );
        }
        let body = json!({"error": {"message": "m", "type": "t", "param": null, "code": null}});
        assert_eq!(error_body_of(&body).unwrap(), body);
        assert_eq!(error_body_of(&json!({"type": "response.created"})), None);
        // A failed response carries an `error` too: it is an answer.
        let failed = json!({"object": "response", "status": "failed", "output": [],
            "error": {"code": "server_error", "message": "boom"}});
        assert_eq!(error_body_of(&failed), None);
    }
}
