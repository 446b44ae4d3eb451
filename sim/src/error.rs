//! The simulated provider's errors, in OpenAI's wire format:
//! `{"error":{"message","type","param","code"}}`, as real providers send them.

use std::time::Duration;

use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

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
