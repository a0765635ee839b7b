//! Errors as OpenAI's API returns them: `{"error": {"message", "type", "param", "code"}}`
//! with the HTTP status that says whose fault it was.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// One failed request, ready to be answered.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A stable machine-readable code (`model_not_found`, `context_length_exceeded`, …).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A request that cannot be served as written (400).
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    /// A field dspec does not implement yet (400), named so a client can drop it.
    pub fn unsupported(param: &str) -> Self {
        Self::invalid(
            param,
            format!("`{param}` is not supported yet by dspec serve; leave it out of the request"),
        )
        .with_code("unsupported_parameter")
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// OpenAI's error `type` for this status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_carry_openai_fields_and_a_type_from_the_status() {
        let body = ApiError::unsupported("tools").body();
        assert_eq!(body["error"]["param"], "tools");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["code"], "unsupported_parameter");
        assert!(body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("not supported yet")));
        let busy = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "queue full").body();
        assert_eq!(busy["error"]["type"], "rate_limit_error");
        assert!(busy["error"]["param"].is_null());
    }
}
