//! Whether a provider's model takes a system message: what the policy says
//! of the provider (`system_messages`), and what canarygate learned from
//! the provider's refusals of the system message it added
//! ([`refuses_system_message`]).
//!
//! A request without a system message of its own gets one from canarygate
//! (the head canary's), which some chat templates refuse: Gemma's raise
//! `System role not supported`, Mistral's first Instruct models' require
//! the conversation to open with a user turn. Such a refusal sends the
//! request once more with the head canary in the first user message
//! ([`SystemRole::Refused`]), and the model is remembered, so its later
//! requests go that way at once.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{PoisonError, RwLock};

use axum::http::StatusCode;
use canarygate_policies::inject::SystemRole;

/// Most models remembered per provider: a wildcard route passes any name
/// a client sends.
const MAX_REMEMBERED: usize = 1024;

/// What refusals of a system message say, lowercased: Hugging Face
/// templates (`System role not supported`, `Conversation roles must
/// alternate user/assistant/...`), OpenAI's models without a system role
/// (`'messages[0].role' does not support 'system' with this model`), and
/// Google's Gemma models (`Developer instruction is not enabled`).
const REFUSALS: [&[u8]; 4] = [
    b"system role",
    b"roles must alternate",
    b"support 'system'",
    b"developer instruction",
];

/// Whether a provider's answer (`status`, `body`) to a request that led
/// with canarygate's own system message refuses that message.
pub fn refuses_system_message(status: StatusCode, body: &[u8]) -> bool {
    // vLLM and OpenAI answer 400, Text Generation Inference 422.
    if !matches!(status.as_u16(), 400 | 422) {
        return false;
    }
    let lowered = body.to_ascii_lowercase();
    REFUSALS.iter().any(|phrase| {
        lowered
            .windows(phrase.len())
            .any(|window| window == *phrase)
    })
}

/// One provider's system role: the policy's word for all its models, and
/// the models it refused a system message for.
#[derive(Debug)]
pub struct SystemRoles {
    /// The policy's `system_messages`: its models take one.
    configured: bool,
    /// Some model is remembered (read before the lock, which a provider
    /// that never refused never takes).
    any_refused: AtomicBool,
    refused: RwLock<HashSet<Box<str>>>,
}

impl SystemRoles {
    /// A provider whose models take a system message or not (`configured`).
    pub fn new(configured: bool) -> Self {
        Self {
            configured,
            any_refused: AtomicBool::new(false),
            refused: RwLock::new(HashSet::new()),
        }
    }

    /// Whether `model` (the name sent to the provider) takes a system
    /// message.
    pub fn of(&self, model: &str) -> SystemRole {
        let refused = !self.configured
            || (self.any_refused.load(Ordering::Relaxed)
                && self
                    .refused
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .contains(model));
        if refused {
            SystemRole::Refused
        } else {
            SystemRole::Accepted
        }
    }

    /// Remembers that the provider refused a system message for `model`
    /// (beyond [`MAX_REMEMBERED`] models, each refusal is learned again).
    pub fn remember_refused(&self, model: &str) {
        let mut refused = self.refused.write().unwrap_or_else(PoisonError::into_inner);
        if refused.len() < MAX_REMEMBERED {
            refused.insert(model.into());
            self.any_refused.store(true, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_of_a_system_message_are_told_from_other_errors() {
        for body in [
            r#"{"error":{"message":"System role not supported","type":"BadRequestError","param":null,"code":400}}"#,
            r#"{"error":"Template error: Conversation roles must alternate user/assistant/user/assistant/...","error_type":"template_error"}"#,
            r#"{"error":{"message":"Unsupported value: 'messages[0].role' does not support 'system' with this model.","type":"invalid_request_error","param":"messages[0].role","code":"unsupported_value"}}"#,
            r#"[{"error":{"code":400,"message":"Developer instruction is not enabled for models/gemma-3-27b-it","status":"INVALID_ARGUMENT"}}]"#,
        ] {
            assert!(
                refuses_system_message(StatusCode::BAD_REQUEST, body.as_bytes()),
                "{body}"
            );
        }
        assert!(refuses_system_message(
            StatusCode::UNPROCESSABLE_ENTITY,
            b"Template error: System role not supported"
        ));
        for (status, body) in [
            (
                StatusCode::BAD_REQUEST,
                r#"{"error":{"message":"max_tokens is too large"}}"#,
            ),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "System role not supported",
            ),
            (StatusCode::TOO_MANY_REQUESTS, "system role rate limit"),
        ] {
            assert!(!refuses_system_message(status, body.as_bytes()), "{body}");
        }
    }

    #[test]
    fn a_refusal_is_remembered_per_model() {
        let roles = SystemRoles::new(true);
        assert_eq!(roles.of("gemma-2-9b-it"), SystemRole::Accepted);
        roles.remember_refused("gemma-2-9b-it");
        assert_eq!(roles.of("gemma-2-9b-it"), SystemRole::Refused);
        assert_eq!(roles.of("llama-3.1-8b"), SystemRole::Accepted);
        let none = SystemRoles::new(false);
        assert_eq!(none.of("any"), SystemRole::Refused);
    }
}
