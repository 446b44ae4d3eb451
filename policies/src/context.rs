//! The context a provider is trusted with, and the preflight that keeps
//! requests within it.
//!
//! Trusted limit = min(advertised window, probed effective limit, policy cap).
//! A request whose prompt tokens (our count, with what injection adds) plus
//! its `max_tokens` exceed it never goes upstream: it is served locally or
//! rejected (`[local] on_untrusted_context`).

use serde::Serialize;

use crate::echo_cost::EchoCost;

/// Upper bound on the prompt tokens [`crate::inject::inject`] adds to a
/// request (instructions and two canaries), by our count. A unit test holds
/// injection to it.
pub const INJECTION_TOKENS_MAX: u64 = 128;

/// Which figure set the trusted limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitSource {
    /// The window the provider advertises.
    Advertised,
    /// What `canarygate probe` measured.
    Probed,
    /// The policy's `max_context_tokens`.
    Policy,
}

impl LimitSource {
    /// Name used in errors and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Advertised => "advertised window",
            Self::Probed => "probed limit",
            Self::Policy => "policy cap",
        }
    }
}

/// The context, in tokens, a provider is trusted with for one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TrustedLimit {
    /// Prompt plus completion tokens.
    pub tokens: u64,
    /// The smallest figure's origin (the advertised window wins ties).
    pub source: LimitSource,
}

/// min(advertised, probed, cap).
pub fn trusted_limit(advertised: u64, probed: Option<u64>, cap: Option<u64>) -> TrustedLimit {
    let mut limit = TrustedLimit {
        tokens: advertised,
        source: LimitSource::Advertised,
    };
    for (candidate, source) in [(probed, LimitSource::Probed), (cap, LimitSource::Policy)] {
        if let Some(tokens) = candidate
            && tokens < limit.tokens
        {
            limit = TrustedLimit { tokens, source };
        }
    }
    limit
}

/// What a request asks of the provider's context, by our count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ContextDemand {
    /// Prompt tokens as the provider will see them (injection included).
    pub prompt_tokens: u64,
    /// Completion tokens the request allows (echo allowance included).
    pub completion_tokens: u64,
}

impl ContextDemand {
    /// The demand of a request of `prompt_tokens` (the client's messages,
    /// our count) and `max_tokens`; `verified` is the cost of an echo to the
    /// provider when the request gets canaries and an echo (both canaries
    /// echoed, the most an echo asks), `None` when it is not verified.
    pub fn new(prompt_tokens: u64, max_tokens: Option<u64>, verified: Option<EchoCost>) -> Self {
        let (injected, allowance) = match verified {
            Some(cost) => (INJECTION_TOKENS_MAX, cost.allowance(2)),
            None => (0, 0),
        };
        Self {
            prompt_tokens: prompt_tokens.saturating_add(injected),
            completion_tokens: max_tokens.map_or(0, |max| max.saturating_add(allowance)),
        }
    }

    /// Prompt plus completion tokens.
    pub fn total(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }

    /// Whether the demand fits within `limit`.
    pub fn fits(&self, limit: TrustedLimit) -> bool {
        self.total() <= limit.tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canary::Canary;
    use crate::inject::{RequestCanaries, inject};
    use crate::tokens::count_chat_messages;
    use crate::verify_config::EchoMode;
    use serde_json::json;

    #[test]
    fn the_smallest_figure_wins() {
        assert_eq!(
            trusted_limit(8192, None, None),
            TrustedLimit {
                tokens: 8192,
                source: LimitSource::Advertised
            }
        );
        assert_eq!(
            trusted_limit(8192, Some(5300), Some(6000)).source,
            LimitSource::Probed
        );
        assert_eq!(trusted_limit(8192, Some(5300), Some(4000)).tokens, 4000);
        assert_eq!(
            trusted_limit(8192, Some(8192), None).source,
            LimitSource::Advertised
        );
    }

    #[test]
    fn demand_counts_injection_and_echo_allowance() {
        let limit = trusted_limit(1000, None, None);
        let plain = ContextDemand::new(900, Some(100), None);
        assert_eq!(plain.total(), 1000);
        assert!(plain.fits(limit));
        let cost = EchoCost::DIGIT_BY_DIGIT;
        let verified = ContextDemand::new(900, Some(100), Some(cost));
        assert_eq!(
            verified.total(),
            900 + INJECTION_TOKENS_MAX + 100 + cost.allowance(2)
        );
        assert!(!verified.fits(limit));
        let cheaper = ContextDemand::new(900, Some(100), Some(EchoCost::DIGITS_IN_THREES));
        assert!(cheaper.total() < verified.total());
        assert_eq!(
            ContextDemand::new(10, None, Some(cost)).completion_tokens,
            0
        );
    }

    #[test]
    fn injection_stays_within_its_bound() {
        for messages in [
            json!([{"role": "user", "content": "hi"}]),
            json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
                   {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]),
        ] {
            let mut body = json!({"model": "m", "messages": messages});
            let before = count_chat_messages(body["messages"].as_array().unwrap());
            let canaries = RequestCanaries {
                head: Canary::from_random([7; 10]),
                tail: Canary::from_random([9; 10]),
            };
            inject(
                &mut body,
                EchoMode::HeadTail,
                EchoCost::DIGIT_BY_DIGIT,
                canaries,
            )
            .unwrap();
            let after = count_chat_messages(body["messages"].as_array().unwrap());
            assert!(
                after - before <= INJECTION_TOKENS_MAX,
                "injection added {} tokens",
                after - before
            );
        }
    }
}
