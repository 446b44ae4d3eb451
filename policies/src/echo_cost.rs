//! What an echo costs the provider in output tokens, and so how many a
//! request gets on top of the client's own limit ([`EchoCost::allowance`]).
//!
//! The echo is the canaries the reply opens with. Its tokens come out of the
//! request's `max_tokens`, so canarygate raises the provider's limit by an
//! allowance: too small, and the echo eats the client's budget (the client
//! gets fewer tokens than it asked for); too large, and an answer that runs
//! to its limit makes the provider write, and bill, tokens that canarygate
//! reads, verifies and cuts at the client's limit.
//!
//! A canary is `CG` and fifteen digits, so its cost is set by how the
//! provider's tokenizer splits a run of digits:
//!
//! - in groups of up to three: OpenAI's `cl100k_base` and `o200k_base`
//!   (their split pattern's `\p{N}{1,3}`, in tiktoken's
//!   `tiktoken_ext/openai_public.py`) and Llama 3's tokenizer. `CG` and five
//!   groups, 6 tokens; the whole two-canary echo with its line break is 13
//!   tokens in both o200k_base and Llama 3
//!   (`policies/benches/token_cost/run.sh`);
//! - one token per digit, as tokenizers without digit merges do: 16 tokens.
//!
//! [`EchoCost::for_model`] knows the first kind by model name and costs any
//! other model as the second, so an echo never eats the client's budget
//! unless a tokenizer spends more than a token per digit. A provider with a
//! `tokenizer_file` is measured instead ([`EchoCost::measured`]), and a
//! provider's `tokenizer_digits` says which kind it is outright
//! ([`TokenizerDigits`]: a deployment name such as Azure's says nothing of
//! the model behind it).

use serde::Deserialize;

/// How a provider's tokenizer splits a run of digits, as a policy says it
/// (`[[providers]] tokenizer_digits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TokenizerDigits {
    /// In groups of up to three: OpenAI's and Llama 3's tokenizers.
    GroupsOfThree,
    /// A token per digit.
    OnePerDigit,
}

/// Output tokens one canary costs in a provider's tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EchoCost {
    tokens_per_canary: u64,
    /// The client's limit is raised for the echo ([`EchoCost::allowance`]);
    /// off, the echo is written within it ([`EchoCost::within_client_limit`]).
    raises_limit: bool,
}

/// Tokens on top of the canaries an echo is allowed: a pair of quotes a
/// model may write around it.
pub const ECHO_SLACK_TOKENS: u64 = 2;

/// Most tokens a canary is costed at, whatever a tokenizer measures: a
/// token per digit and one for `CG`. It bounds [`ECHO_TOKEN_ALLOWANCE_MAX`];
/// a tokenizer that spends more (`CG` in two tokens) finds its spare in the
/// separators and [`ECHO_SLACK_TOKENS`].
pub const MOST_TOKENS_PER_CANARY: u64 = 16;

/// Fewest tokens a canary costs in the tokenizers canarygate knows: `CG` and
/// five groups of three digits, in OpenAI's and Llama 3's (a tokenizer that
/// merged longer runs of digits would spend fewer).
pub const LEAST_TOKENS_PER_CANARY: u64 = 6;

/// The most output tokens any request is allowed for its echo (two canaries
/// at [`MOST_TOKENS_PER_CANARY`]): what a context check counts on before it
/// knows the request's own.
pub const ECHO_TOKEN_ALLOWANCE_MAX: u64 = EchoCost::DIGIT_BY_DIGIT.allowance(2);

/// Canaries, as a tokenizer would see them in an echo, measured by
/// [`EchoCost::measured`]: digits of every kind (runs, repeats, zeros).
const MEASURED_CANARIES: [&str; 4] = [
    "CG482937105662831",
    "CG000000000000000",
    "CG123456789012345",
    "CG999999999999999",
];

/// Model-name prefixes of OpenAI's models served with `cl100k_base` or
/// `o200k_base` (after any `vendor/` path and a fine-tune's `ft:`;
/// `gpt-35` is Azure's name for GPT-3.5).
const OPENAI_PREFIXES: [&str; 8] = [
    "gpt-3.5",
    "gpt-35",
    "gpt-4",
    "gpt-5",
    "gpt-oss",
    "chatgpt-",
    "davinci-002",
    "babbage-002",
];

/// OpenAI's reasoning models, named alone or followed by `-`.
const OPENAI_REASONING: [&str; 3] = ["o1", "o3", "o4"];

/// How Llama 3 models are written in names (Meta's, Ollama's, Bedrock's).
const LLAMA_3_MARKS: [&str; 3] = ["llama-3", "llama3", "llama_3"];

impl EchoCost {
    /// Tokenizers that split digit runs into groups of up to three: `CG` and
    /// five groups.
    pub const DIGITS_IN_THREES: Self = Self {
        tokens_per_canary: 6,
        raises_limit: true,
    };

    /// Tokenizers that spend a token per digit: `CG` and fifteen. Any model
    /// [`EchoCost::for_model`] does not know is costed this way.
    pub const DIGIT_BY_DIGIT: Self = Self {
        tokens_per_canary: MOST_TOKENS_PER_CANARY,
        raises_limit: true,
    };

    /// The cost of an echo to a tokenizer that splits digits as `digits`
    /// says.
    pub fn of_digits(digits: TokenizerDigits) -> Self {
        match digits {
            TokenizerDigits::GroupsOfThree => Self::DIGITS_IN_THREES,
            TokenizerDigits::OnePerDigit => Self::DIGIT_BY_DIGIT,
        }
    }

    /// The cost of an echo to `model` (the name sent upstream), by the
    /// tokenizer its family is known to use.
    pub fn for_model(model: &str) -> Self {
        let name = model
            .rsplit('/')
            .next()
            .unwrap_or(model)
            .to_ascii_lowercase();
        let name = name.strip_prefix("ft:").unwrap_or(&name);
        let openai = OPENAI_PREFIXES
            .iter()
            .any(|prefix| name.starts_with(prefix))
            || OPENAI_REASONING.iter().any(|family| {
                name.strip_prefix(family)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
            });
        let llama_3 = LLAMA_3_MARKS.iter().any(|mark| name.contains(mark));
        if openai || llama_3 {
            Self::DIGITS_IN_THREES
        } else {
            Self::DIGIT_BY_DIGIT
        }
    }

    /// The cost counted by a provider's tokenizer (`count` gives the tokens
    /// of a text): the most any of a few canaries takes, at least 1 and at
    /// most [`MOST_TOKENS_PER_CANARY`].
    pub fn measured(count: impl Fn(&str) -> u64) -> Self {
        let most = MEASURED_CANARIES
            .iter()
            .map(|canary| count(canary))
            .max()
            .unwrap_or(0);
        Self {
            tokens_per_canary: most.clamp(1, MOST_TOKENS_PER_CANARY),
            raises_limit: true,
        }
    }

    /// This cost, written within the client's limit: no tokens are added
    /// to it. For a provider that refused the raised limit (a model's
    /// output cap the client asked for in full).
    pub const fn within_client_limit(self) -> Self {
        Self {
            raises_limit: false,
            ..self
        }
    }

    /// Tokens one canary costs.
    pub fn tokens_per_canary(self) -> u64 {
        self.tokens_per_canary
    }

    /// The fewest output tokens `echoed` canaries cost a provider, its
    /// count of an answer less them bounding the tokens of the rest: each at
    /// this cost and at most [`LEAST_TOKENS_PER_CANARY`], which no tokenizer
    /// canarygate knows goes below.
    pub fn least(self, echoed: usize) -> u64 {
        echoed as u64 * self.tokens_per_canary.min(LEAST_TOKENS_PER_CANARY)
    }

    /// Output tokens added to the client's limit when `echoed` canaries are
    /// asked back: each with the space or line break after it, and
    /// [`ECHO_SLACK_TOKENS`]. None when nothing is echoed, or when the echo
    /// is written within the client's limit.
    pub const fn allowance(self, echoed: usize) -> u64 {
        if echoed == 0 || !self.raises_limit {
            return 0;
        }
        echoed as u64 * (self.tokens_per_canary + 1) + ECHO_SLACK_TOKENS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fewest tokens an echo costs is what the cheapest known tokenizer
    /// spends on its canaries: never more than the cost it is allowed for.
    #[test]
    fn the_least_an_echo_costs_bounds_every_known_tokenizer_from_below() {
        assert_eq!(EchoCost::DIGITS_IN_THREES.least(2), 12);
        assert_eq!(EchoCost::DIGIT_BY_DIGIT.least(2), 12);
        assert_eq!(EchoCost::measured(|_| 4).least(1), 4);
        for cost in [EchoCost::DIGITS_IN_THREES, EchoCost::DIGIT_BY_DIGIT] {
            for echoed in 0..3 {
                assert!(cost.least(echoed) <= cost.allowance(echoed));
            }
        }
    }

    #[test]
    fn openai_and_llama_3_models_are_costed_by_groups_of_three() {
        for model in [
            "gpt-4o-mini",
            "gpt-4.1",
            "gpt-5-nano",
            "gpt-3.5-turbo",
            "gpt-35-turbo",
            "GPT-4o",
            "openai/gpt-4o",
            "ft:gpt-4o-mini-2024-07-18:acme::abc123",
            "o1",
            "o3-mini",
            "o4-mini-2025-04-16",
            "gpt-oss-120b",
            "chatgpt-4o-latest",
            "meta-llama/Meta-Llama-3.1-8B-Instruct",
            "llama-3.3-70b-versatile",
            "llama3.1:8b",
            "meta.llama3-1-70b-instruct-v1:0",
        ] {
            assert_eq!(
                EchoCost::for_model(model),
                EchoCost::DIGITS_IN_THREES,
                "{model}"
            );
        }
    }

    #[test]
    fn other_models_are_costed_a_token_per_digit() {
        for model in [
            "claude-sonnet-4-5",
            "qwen2.5-72b-instruct",
            "gemma-2-9b-it",
            "mistral-large-latest",
            "o1x",
            "go3",
            "my-azure-deployment",
            "llama-2-70b",
            "",
        ] {
            assert_eq!(
                EchoCost::for_model(model),
                EchoCost::DIGIT_BY_DIGIT,
                "{model}"
            );
        }
    }

    #[test]
    fn the_allowance_covers_each_canary_its_separator_and_the_slack() {
        // o200k_base and Llama 3 spend 13 tokens on the two-canary echo and
        // its line break (policies/benches/token_cost/run.sh).
        let threes = EchoCost::DIGITS_IN_THREES.allowance(2);
        assert!((13..=16).contains(&threes), "{threes}");
        // A token per digit: `CG`, 15 digits, a space, `CG`, 15, a line break.
        let by_digit = EchoCost::DIGIT_BY_DIGIT.allowance(2);
        assert!(by_digit >= 2 * 16 + 2, "{by_digit}");
        assert_eq!(EchoCost::DIGIT_BY_DIGIT.allowance(0), 0);
        assert!(EchoCost::DIGITS_IN_THREES.allowance(1) < threes);
        assert_eq!(by_digit, ECHO_TOKEN_ALLOWANCE_MAX);
    }

    #[test]
    fn a_measured_cost_is_the_most_a_canary_took_within_bounds() {
        let by_digit = EchoCost::measured(|text| text.len() as u64 - 1);
        assert_eq!(by_digit, EchoCost::DIGIT_BY_DIGIT);
        // Zeros merged into one token, every other digit run costing five.
        let uneven = EchoCost::measured(|text| if text.contains("000") { 2 } else { 6 });
        assert_eq!(uneven, EchoCost::DIGITS_IN_THREES);
        assert_eq!(EchoCost::measured(|_| 0).tokens_per_canary(), 1);
        assert_eq!(
            EchoCost::measured(|_| 1_000).tokens_per_canary(),
            MOST_TOKENS_PER_CANARY
        );
    }
}
