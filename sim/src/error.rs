//! The simulated provider's errors, in the wire format of the surface that
//! answers them: OpenAI's `{"error":{"message","type","param","code"}}` or
//! Anthropic's `{"type":"error","error":{"type","message"},"request_id"}`.
//!
//! An error is made once, with OpenAI's status and type; Anthropic's shape
//! maps the status to its own type (Anthropic, "Errors": 400
//! `invalid_request_error`, 401 `authentication_error`, 403
//! `permission_error`, 404 `not_found_error`, 413 `request_too_large`, 429
//! `rate_limit_error`, 500 `api_error`, 529 `overloaded_error`), and an
//! overloaded provider answers 503 on OpenAI's surfaces and 529 on
//! Anthropic's.

use std::time::Duration;

use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Which provider's error format a response is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    OpenAi,
    Anthropic,
}

/// An error answered by the simulated provider.
#[derive(Debug, Clone)]
pub struct SimError {
    status: StatusCode,
    kind: &'static str,
    code: Option<&'static str>,
    param: Option<&'static str>,
    message: String,
    /// Sent as `retry-after` (whole seconds, rounded up) and `retry-after-ms`.
    retry_after: Option<Duration>,
}

impl SimError {
    /// 400 with OpenAI's `invalid_request_error` type.
    pub fn invalid_request(code: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code,
            param: None,
            message: message.into(),
            retry_after: None,
        }
    }

    /// 429 `rate_limit_exceeded`, of type `requests` or `tokens` (as OpenAI
    /// types it), with `retry-after` / `retry-after-ms` saying when to retry.
    pub fn rate_limited(kind: &'static str, message: impl Into<String>, retry: Duration) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind,
            code: Some("rate_limit_exceeded"),
            param: None,
            message: message.into(),
            retry_after: Some(retry),
        }
    }

    /// 503 on OpenAI's surfaces, 529 `overloaded_error` on Anthropic's: the
    /// provider has no capacity for the request now.
    pub fn overloaded() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: None,
            param: None,
            message: OVERLOADED_MESSAGE.to_owned(),
            retry_after: None,
        }
    }

    /// 404: no such object (a stored response, a route).
    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            ..Self::invalid_request(None, message)
        }
    }

    /// True for [`SimError::overloaded`].
    pub fn is_overloaded(&self) -> bool {
        self.status == StatusCode::SERVICE_UNAVAILABLE
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The HTTP status.
    pub fn status(&self) -> u16 {
        self.status.as_u16()
    }

    /// The request field the error is about.
    pub fn param(&self) -> Option<&'static str> {
        self.param
    }

    /// 401: no key, or not the configured one.
    pub fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            ..Self::invalid_request(Some(code), message)
        }
    }

    /// 500: the simulator itself failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: None,
            param: None,
            message: message.into(),
            retry_after: None,
        }
    }

    /// The same error about request field `param`.
    pub fn with_param(self, param: &'static str) -> Self {
        Self {
            param: Some(param),
            ..self
        }
    }
}

/// The message of an overloaded provider's errors.
pub const OVERLOADED_MESSAGE: &str = "Overloaded";

/// Anthropic's status and error type for an error of OpenAI status `status`.
fn anthropic_type(status: StatusCode) -> (StatusCode, &'static str) {
    match status.as_u16() {
        400 => (status, "invalid_request_error"),
        401 => (status, "authentication_error"),
        403 => (status, "permission_error"),
        404 => (status, "not_found_error"),
        413 => (status, "request_too_large"),
        429 => (status, "rate_limit_error"),
        503 => (
            StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error",
        ),
        _ => (status, "api_error"),
    }
}

impl SimError {
    /// Anthropic's error type of this error.
    pub fn anthropic_type(&self) -> &'static str {
        anthropic_type(self.status).1
    }

    /// The response in `shape`; Anthropic's body carries `request_id`.
    pub fn render(self, shape: ErrorShape, request_id: &str) -> Response {
        match shape {
            ErrorShape::OpenAi => self.into_response(),
            ErrorShape::Anthropic => {
                let (status, kind) = anthropic_type(self.status);
                let body = json!({
                    "type": "error",
                    "error": {"type": kind, "message": self.message},
                    "request_id": request_id,
                });
                let mut response = (status, body.to_string()).into_response();
                response.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                if let Some(retry) = self.retry_after {
                    // Anthropic sends whole seconds only.
                    response.headers_mut().insert(
                        header::RETRY_AFTER,
                        HeaderValue::from(retry.as_millis().div_ceil(1000) as u64),
                    );
                }
                response
            }
        }
    }
}

impl IntoResponse for SimError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
        }});
        let mut response = (self.status, body.to_string()).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        // The SDKs obey the provider's word on retrying over their own rule.
        let retry =
            matches!(self.status.as_u16(), 408 | 409 | 429) || self.status.is_server_error();
        response.headers_mut().insert(
            HeaderName::from_static("x-should-retry"),
            HeaderValue::from_static(if retry { "true" } else { "false" }),
        );
        if let Some(retry) = self.retry_after {
            let millis = retry.as_millis();
            let headers = response.headers_mut();
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from(millis.div_ceil(1000) as u64),
            );
            headers.insert(
                HeaderName::from_static("retry-after-ms"),
                HeaderValue::from(millis as u64),
            );
        }
        response
    }
}
