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
