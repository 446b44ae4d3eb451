//! Errors in OpenAI's wire format: `{"error":{"message","type","param","code"}}`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to the client in OpenAI's format.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable explanation.
    pub message: String,
    /// OpenAI error type, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// Machine-readable code, e.g. `model_not_found`.
    pub code: &'static str,
    /// The request field at fault, if any.
    pub param: Option<&'static str>,
}

impl ApiError {
    fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            code,
            param: None,
        }
    }

    /// 400: the request is malformed.
    pub fn invalid_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    /// 400 about one field of the request.
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param),
            ..Self::invalid_request("invalid_value", message)
        }
    }

    /// 401: no usable credential.
    pub fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            code,
            message,
        )
    }

    /// 404: no route for the model.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            param: Some("model"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("The model `{model}` is not routed by this canarygate policy."),
            )
        }
    }

    /// 413: body over the policy's limit.
    pub fn body_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("Request body exceeds the limit of {limit} bytes (limits.max_body_bytes)."),
        )
    }

    /// 429: too many requests in flight.
    pub fn overloaded(limit: usize) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "too_many_concurrent_requests",
            format!(
                "canarygate is serving its limit of {limit} concurrent requests \
                 (limits.max_concurrent_requests); retry shortly."
            ),
        )
    }

    /// 502: the provider could not be reached or answered nonsense.
    pub fn bad_gateway(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "upstream_error", code, message)
    }

    /// 504: the provider was too slow.
    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            "upstream_timeout",
            message,
        )
    }

    /// 500: canarygate itself failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            message,
        )
    }

    /// The JSON body `{"error":{...}}`.
    pub fn body(&self) -> serde_json::Value {
        error_body(&self.message, self.kind, self.code, self.param)
    }
}

/// An OpenAI-style error object.
pub fn error_body(message: &str, kind: &str, code: &str, param: Option<&str>) -> serde_json::Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.body().to_string()).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

/// The message of `error` followed by each of its sources, `: `-separated, so
/// that a TLS failure deep in the stack ("invalid peer certificate: UnknownIssuer")
/// reaches the client and the log.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
