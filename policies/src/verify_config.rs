//! `[verify]`: how answers are verified and what happens when a check fails.
//!
//! Every field has a default, so a policy without `[verify]` verifies with
//! head+tail echo, echo-first release and the block action.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use serde::{Deserialize, Serialize};
use toml::Spanned;

/// Which canaries the model is asked to echo at the start of its reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
pub enum EchoMode {
    /// Head canary (first message) and tail canary (after the last user
    /// message): catches a prompt truncated at either end.
    #[default]
    #[serde(rename = "head+tail")]
    HeadTail,
    /// Head canary only.
    #[serde(rename = "head")]
    Head,
    /// No echo: canaries are still placed in the prompt (so a leak of this
    /// request is recognised elsewhere) but only passive checks run.
    #[serde(rename = "off")]
    Off,
}

/// When verified text may reach the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReleasePolicy {
    /// Stream as soon as the echo passed; a later failure ends the stream
    /// with an explicit error event.
    #[default]
    EchoFirst,
    /// Nothing reaches the client until the whole answer passed every check.
    VerdictFirst,
}

/// What to do with an answer that failed a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureAction {
    /// HTTP 502 `canarygate_verification_failed` naming the failed checks.
    #[default]
    Block,
    /// Deliver the answer unchanged (canaries stripped) and mark it in the
    /// `x-canarygate-verdict` header.
    Flag,
    /// Retry upstream once with fresh canaries, then block.
    Retry,
    /// Serve from the local engine instead (needs `[local] model_dir`). A
    /// stream whose bytes already reached the client ends with an error event.
    Fallback,
}

/// Which `usage` numbers the client gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum UsageReport {
    /// The provider's billed numbers, unchanged.
    #[default]
    Provider,
    /// As the client would have seen them without canarygate: the prompt
    /// tokens it added and the completion tokens it removed (the echo) or
    /// cut (past the client's limit) taken out. For client-side cost
    /// trackers that compare usage with their own counts.
    WithoutCanarygate,
}

/// `[verify]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VerifyConfig {
    /// `false` turns canarygate into a plain proxy: no canaries, no checks.
    /// For measuring overhead and for debugging; default `true`.
    pub enabled: bool,
    /// `"head+tail"` (default), `"head"` or `"off"`.
    pub echo: EchoMode,
    /// `"echo-first"` (default) or `"verdict-first"`.
    pub release: ReleasePolicy,
    /// `"block"` (default), `"flag"`, `"retry"` or `"fallback"`.
    pub action: Spanned<FailureAction>,
    /// How long a minted canary stays registered, in seconds.
    pub canary_ttl_secs: u64,
    /// Without the provider's tokenizer: the provider must report at least
    /// this fraction of our prompt-token estimate.
    pub estimate_min_ratio: Spanned<f64>,
    /// With the provider's tokenizer: allowed relative difference between the
    /// reported and the counted prompt tokens...
    pub exact_tolerance: Spanned<f64>,
    /// ...plus this many tokens (framing the provider adds).
    pub exact_slack_tokens: u64,
    /// Prompts smaller than this (our count) skip the prompt_tokens check.
    pub prompt_tokens_min: u64,
    /// Prompts smaller than this (our count) skip the ttft check.
    pub ttft_min_prompt_tokens: u64,
    /// Fastest plausible prefill per provider name, in tokens per second. A
    /// first token sooner than `prompt_tokens / rate` fails the ttft check;
    /// providers not listed skip it.
    pub max_prefill_tokens_per_second: HashMap<String, Spanned<f64>>,
    /// `finish_reason: "length"` with fewer completion tokens than this (and
    /// fewer than the client's own `max_tokens`) fails the finish check.
    pub finish_min_length_tokens: u64,
    /// `"provider"` (default): `usage` is the provider's billed numbers;
    /// `"without-canarygate"`: canarygate's own tokens taken out. Either way
    /// they are in `x-canarygate-overhead-tokens` and the audit record.
    pub usage: UsageReport,
}

impl Default for VerifyConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            echo: EchoMode::default(),
            release: ReleasePolicy::default(),
            action: Spanned::new(0..0, FailureAction::Block),
            canary_ttl_secs: 3600,
            estimate_min_ratio: Spanned::new(0..0, 0.25),
            exact_tolerance: Spanned::new(0..0, 0.02),
            exact_slack_tokens: 8,
            prompt_tokens_min: 16,
            ttft_min_prompt_tokens: 4096,
            max_prefill_tokens_per_second: HashMap::new(),
            finish_min_length_tokens: 4,
            usage: UsageReport::default(),
        }
    }
}

impl VerifyConfig {
    /// The configured action.
    pub fn action(&self) -> FailureAction {
        *self.action.get_ref()
    }

    /// Fastest plausible prefill of `provider`, if configured.
    pub fn max_prefill_rate(&self, provider: &str) -> Option<f64> {
        self.max_prefill_tokens_per_second
            .get(provider)
            .map(|rate| *rate.get_ref())
    }

    pub(crate) fn validate(
        &self,
        providers: &HashSet<&str>,
        local_engine: bool,
    ) -> Result<(), (Option<Range<usize>>, String)> {
        if self.action() == FailureAction::Fallback && !local_engine {
            return Err((
                Some(self.action.span()),
                "verify.action = \"fallback\" needs the local engine: set [local] model_dir, \
                 or use \"block\", \"retry\" or \"flag\""
                    .into(),
            ));
        }

        if self.canary_ttl_secs == 0 {
            return Err((None, "verify.canary_ttl_secs must be greater than 0".into()));
        }
        let ratio = *self.estimate_min_ratio.get_ref();
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err((
                Some(self.estimate_min_ratio.span()),
                "verify.estimate_min_ratio must be in (0, 1]".into(),
            ));
        }
        let tolerance = *self.exact_tolerance.get_ref();
        if !(0.0..1.0).contains(&tolerance) {
            return Err((
                Some(self.exact_tolerance.span()),
                "verify.exact_tolerance must be in [0, 1)".into(),
            ));
        }
        let mut rates: Vec<_> = self.max_prefill_tokens_per_second.iter().collect();
        rates.sort_by_key(|(_, rate)| rate.span().start);
        for (name, rate) in rates {
            if !providers.contains(name.as_str()) {
                return Err((
                    Some(rate.span()),
                    format!(
                        "verify.max_prefill_tokens_per_second names provider `{name}`, \
                         which is not defined"
                    ),
                ));
            }
            if !(rate.get_ref().is_finite() && *rate.get_ref() > 0.0) {
                return Err((
                    Some(rate.span()),
                    format!("max_prefill_tokens_per_second for `{name}` must be greater than 0"),
                ));
            }
        }
        Ok(())
    }
}
