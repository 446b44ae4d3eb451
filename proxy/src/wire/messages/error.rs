//! Errors in Anthropic's shape: `{"type":"error","error":{"type","message"}}`,
//! the error `type` chosen from the HTTP status as Anthropic documents it
//! (docs.claude.com/en/api/errors; the SDK's `types/shared/error_type.py`),
//! with canarygate's own `code` (and, for a blocked answer, the failed
//! checks) kept beside it, so a client can tell canarygate's error from the
//! provider's.

use axum::http::StatusCode;
use canarygate_policies::sse::encode_json;
use serde_json::{Value, json};

use crate::error::{ApiError, ErrorCode};

/// Anthropic's error `type` for an answer with HTTP `status`.
///
/// 400 `invalid_request_error`, 401 `authentication_error`, 402
/// `billing_error`, 403 `permission_error`, 404 `not_found_error`, 408 and
/// 504 `timeout_error`, 409 `conflict_error`, 413 `request_too_large`, 429
/// `rate_limit_error`, 503 and 529 `overloaded_error` (the API cannot take
/// the request now), any other 5xx `api_error` (Anthropic's 500; canarygate's
/// 502s: the provider failed or its answer was withheld), any other 4xx
/// `invalid_request_error`.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "invalid_request_error",
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        409 => "conflict_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        code if code >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The HTTP status Anthropic answers an error of `kind` with: the status
/// [`error_type`] names it for (`api_error` is Anthropic's 500, and
/// `overloaded_error` its 529); an unknown type is a 500.
pub fn status_of_type(kind: &str) -> StatusCode {
    let code = match kind {
        "invalid_request_error" => 400,
        "authentication_error" => 401,
        "billing_error" => 402,
        "permission_error" => 403,
        "not_found_error" => 404,
        "conflict_error" => 409,
        "request_too_large" => 413,
        "rate_limit_error" => 429,
        "timeout_error" => 504,
        "overloaded_error" => 529,
        _ => 500,
    };
    StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// `error` as Anthropic's error object, with canarygate's `code`, the
/// `param` at fault and, for a blocked answer, `failed_checks` beside
/// Anthropic's `type` and `message`.
pub fn error_json(error: &ApiError) -> Value {
    let mut body = json!({"type": "error", "error": {
        "type": error_type(error.status()),
        "message": error.message,
        "code": error.code.code(),
    }});
    if let Some(param) = error.param {
        body["error"]["param"] = json!(param);
    }
    if error.code == ErrorCode::VerificationFailed {
        body["error"]["failed_checks"] = json!(error.failed_checks);
    }
    body
}

/// `error` as the event that ends a stream: `event: error` with the error
/// object (the anthropic SDK raises `APIStatusError` on it).
pub fn error_event(error: &ApiError) -> Vec<u8> {
    let mut event = b"event: error\n".to_vec();
    encode_json(&error_json(error), &mut event);
    event
}

/// Whether `body` is an Anthropic error object: `type: "error"` and an
/// `error` object with a string `type`.
pub fn is_error_body(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body).is_ok_and(|value| is_error_value(&value))
}

/// [`is_error_body`] of a parsed value.
pub fn is_error_value(value: &Value) -> bool {
    value.get("type").and_then(Value::as_str) == Some("error")
        && value
            .get("error")
            .and_then(|error| error.get("type"))
            .is_some_and(Value::is_string)
}

/// The message of an Anthropic error object (a stream's `error` event).
pub fn message_of(value: &Value) -> String {
    let error = &value["error"];
    let kind = error.get("type").and_then(Value::as_str).unwrap_or("error");
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("no message");
    format!("{kind}: {message}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use canarygate_policies::sse::SseParser;

    #[test]
    fn an_error_type_stands_for_the_status_anthropic_answers_it_with() {
        for kind in [
            "invalid_request_error",
            "authentication_error",
            "permission_error",
            "not_found_error",
            "rate_limit_error",
            "api_error",
            "overloaded_error",
        ] {
            assert_eq!(error_type(status_of_type(kind)), kind, "{kind}");
        }
        assert_eq!(status_of_type("overloaded_error").as_u16(), 529);
        assert_eq!(status_of_type("something_new").as_u16(), 500);
    }

    #[test]
    fn types_follow_the_status_as_anthropic_documents_them() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (405, "invalid_request_error"),
            (408, "timeout_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (502, "api_error"),
            (503, "overloaded_error"),
            (504, "timeout_error"),
            (529, "overloaded_error"),
        ] {
            assert_eq!(error_type(StatusCode::from_u16(status).unwrap()), kind);
        }
        // Every error canarygate answers with gets a documented type.
        for code in ErrorCode::ALL {
            let body = error_json(&ApiError::new(code, "x"));
            assert!(is_error_value(&body), "{body}");
            assert_eq!(body["error"]["code"], code.code());
        }
    }

    #[test]
    fn a_blocked_answer_is_an_api_error_naming_canarygate_and_its_checks() {
        let mut error = ApiError::new(ErrorCode::VerificationFailed, "failed checks: echo");
        error.failed_checks = vec!["echo"];
        assert_eq!(
            error_json(&error),
            json!({"type": "error", "error": {"type": "api_error", "message": "failed checks: echo",
                   "code": "canarygate_verification_failed", "failed_checks": ["echo"]}})
        );
        let bad = error_json(&ApiError::invalid_param("max_tokens", "bad"));
        assert_eq!(bad["error"]["type"], "invalid_request_error");
        assert_eq!(bad["error"]["param"], "max_tokens");

        let mut events = Vec::new();
        SseParser::new().feed(&error_event(&error), &mut events);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].event.as_deref(), Some("error"));
        let data: Value = serde_json::from_str(&events[0].data).unwrap();
        assert_eq!(data, error_json(&error));
        assert!(message_of(&data).starts_with("api_error: "));
    }

    #[test]
    fn only_anthropic_error_bodies_are_recognised() {
        assert!(is_error_body(
            br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
        ));
        assert!(!is_error_body(
            br#"{"error":{"message":"x","type":"invalid_request_error"}}"#
        ));
        assert!(!is_error_body(br#"{"type":"message","content":[]}"#));
        assert!(!is_error_body(b"<html>bad gateway</html>"));
    }
}
