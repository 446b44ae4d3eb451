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
/// own fields moved under `error` (its `code` standing for its `type` too,
/// as the event has none), a body that already is one as it is. `None`
/// for anything else.
pub fn error_body_of(data: &Value) -> Option<Value> {
    if data.get("error").is_some_and(Value::is_object) {
        return Some(data.clone());
    }
    if data.get("type").and_then(Value::as_str) != Some("error") {
        return None;
    }
    let field = |key: &str| data.get(key).cloned().unwrap_or(Value::Null);
    Some(json!({"error": {
        "message": field("message"),
        "type": field("code"),
        "param": field("param"),
        "code": field("code"),
    }}))
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
        let body = json!({"error": {"message": "m", "type": "t", "param": null, "code": null}});
        assert_eq!(error_body_of(&body).unwrap(), body);
        assert_eq!(error_body_of(&json!({"type": "response.created"})), None);
    }
}
