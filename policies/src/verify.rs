//! The streaming verifier: checks an answer as it arrives and decides what
//! the client may see.
//!
//! One [`Verifier`] per upstream attempt. The proxy feeds it, in order:
//!
//! 1. [`Verifier::observe_ttft`] when the first content arrives (or, for a
//!    non-streamed answer, when the response head arrives);
//! 2. [`Verifier::push`] for every content delta of every choice (a
//!    non-streamed answer is one push per choice). Each push returns the text
//!    the client may see now, and whether the proxy must stop;
//!    Other texts (reasoning, refusals, tool-call and function arguments) go
//!    to [`Verifier::push_part`] ([`Verifier::push_tool_arguments`] for tool
//!    calls): scanned the same way, released with the choice's content.
//!    [`Verifier::release_of`] gives any text's release as positions in the
//!    text received (how far the client may see it, and the spans removed),
//!    for a proxy that edits the provider's own events;
//! 3. [`Verifier::finish`] with the [`Facts`] of the end of the answer. It
//!    returns the [`Verdict`], the last text to release per choice and the
//!    verified tool-call arguments.
//!
//! Then [`Verdict::decide`] turns the verdict and the policy's [`FailureAction`] into
//! a [`Decision`].
//!
//! Text is held until the echo (the request's canaries at the start of the
//! reply, in the forms [`ECHO_PREAMBLE_CHARS`] describes) is verified, and
//! the echo is removed. Every canary-shaped span is looked up in the
//! registry: this request's own canaries are removed, any other live canary
//! fails `foreign_canary`, even one of the same session (clients never see
//! canaries, so no honest prompt can contain one), unless the request
//! continues a conversation the provider keeps, whose earlier turns hold
//! the session's own canaries ([`Verifier::accept_session_canaries`]). A
//! span that could still grow into a canary (at most
//! [`MAX_MATCH_BYTES`](crate::canary::MAX_MATCH_BYTES)) stays held until the
//! next delta decides it, so a canary split across deltas is never released.
//! When another text of the choice begins instead (the model moved from
//! reasoning to content), the held span is decided as it stands and
//! released, and kept: should its text resume, a canary begun in the held
//! span and ended in the resumed text is still found, so a provider cannot
//! hide one by interleaving texts.
//! Release policy:
//!
//! - `verdict-first` (and every non-streamed answer): nothing is released
//!   before [`Verifier::finish`], and only if the verdict passed;
//! - `echo-first`: text flows once the choice's echo passed; after a failure
//!   nothing more is released and `stop` is set;
//! - action `flag` never withholds an answer: text flows once the echo is
//!   decided, pass or fail, with the echo and own canaries stripped.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::canary::{Canary, Shape, Starts, find_canaries, match_at, starts_span};
use crate::inject::{BLOCK_SEPARATOR, BLOCK_WORDINGS, ECHO_PHRASE, Injection, PassiveReason};
use crate::registry::{CanaryRegistry, Registration};
use crate::verify_config::{FailureAction, ReleasePolicy, VerifyConfig};

/// Most characters before the first echoed canary: any text without a
/// canary-shaped span (`Sure! `, `Here are the codes:\n\n`, quotes, `**`).
/// The echo passes when the reply opens with at most this many characters,
/// then the expected canaries in order, each in any copy variation
/// [`find_canaries`] accepts, each at most
/// [`ECHO_GAP_CHARS`] characters after the previous one; then at most
/// [`ECHO_CLOSING_CHARS`] closing characters (quotes, brackets, emphasis,
/// `.,;:!`), spaces or tabs, and at most two line breaks (and the closing
/// fence of a code block the preamble opened). All of it is removed from the
/// delivered text.
pub const ECHO_PREAMBLE_CHARS: usize = 64;

/// Most characters between two echoed canaries (`, `, ` and `, `` `\n` ``).
pub const ECHO_GAP_CHARS: usize = 16;

/// Most closing characters right after the last echoed canary.
pub const ECHO_CLOSING_CHARS: usize = 8;

/// Most bytes of closing characters and whitespace removed after the echo.
const ECHO_TRAILER_BYTES: usize = 64;

/// A Markdown code fence: an echo inside a code block loses its closing fence
/// too.
const FENCE: &str = "```";

/// Foreign canaries kept as evidence (the count covers all of them).
const MAX_FOREIGN_EVIDENCE: usize = 16;

/// A check, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// The reply opened with the request's canaries.
    Echo,
    /// No other request's canary in the answer.
    ForeignCanary,
    /// The provider's prompt-token count fits the prompt we sent.
    PromptTokens,
    /// The first token did not come sooner than a real prefill allows.
    Ttft,
    /// The answer ended like a real one.
    Finish,
    /// The answer is about what was asked (the topic check, decided
    /// outside the verifier: `crate::topic`).
    Topic,
}

impl Check {
    /// The check's name as it appears in headers, errors and audit records.
    pub fn name(self) -> &'static str {
        match self {
            Check::Echo => "echo",
            Check::ForeignCanary => "foreign_canary",
            Check::PromptTokens => "prompt_tokens",
            Check::Ttft => "ttft",
            Check::Finish => "finish",
            Check::Topic => "topic",
        }
    }
}

/// Outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Ran and passed.
    Pass,
    /// Ran and failed.
    Fail,
    /// Did not run; the result's `reason` says why.
    Skip,
}

/// How one choice's echo went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EchoOutcome {
    /// Both expected canaries, in order, at the start of the reply.
    Passed,
    /// The reply does not start with a canary.
    Missing,
    /// The reply starts with the tail canary: the head of the prompt was lost.
    HeadMissing,
    /// The head canary is not followed by the tail: the tail was lost.
    TailMissing,
    /// The reply starts with a canary that is not this request's.
    WrongCanary,
    /// The answer ended inside the echo.
    Incomplete,
    /// The provider withheld the reply, or failed to give one: no text at
    /// all, and a finish reason that says so ([`WITHHELD_FINISH_REASONS`]).
    /// Nothing reaches the client that an echo would vouch for, so the echo
    /// does not fail.
    Withheld,
    /// The reply reached its token limit (finish `length`) before any text:
    /// a reasoning model spent the whole budget on reasoning it does not
    /// show (OpenAI's o-series and GPT-5, Anthropic's redacted thinking).
    /// As with [`EchoOutcome::Withheld`], nothing reaches the client that an
    /// echo would vouch for.
    CutBeforeText,
    /// The reply reached its token limit (finish `length`) in reasoning it
    /// shows, before any other text, and that reasoning quoted every canary
    /// the echo asks for: the model saw both ends of this prompt, which is
    /// what the echo vouches for.
    QuotedInReasoning,
    /// The reply reached its token limit (finish `length`) in reasoning it
    /// shows, before any other text, and that reasoning did not quote every
    /// canary: nothing vouches for it, so it is withheld (removed whole), and
    /// the reply goes out as [`EchoOutcome::CutBeforeText`]'s does, as a
    /// model that hides its reasoning would have sent it.
    ReasoningWithheld,
    /// The provider ended the answer with its own error (an error event in
    /// its stream) before the echo was decided
    /// ([`Verifier::ended_by_provider_error`]): what it had sent is
    /// withheld and the client gets the error, so nothing reaches it that
    /// an echo would vouch for.
    EndedByProviderError,
}

/// Finish reasons of a reply the provider withheld or did not give:
/// OpenAI's and Azure's content filter, Anthropic's `refusal` stop reason,
/// and a Responses API response that `failed` or was `cancelled`.
pub const WITHHELD_FINISH_REASONS: [&str; 4] = ["content_filter", "refusal", "failed", "cancelled"];

/// The finish reason of a reply that reached its token limit, in Chat's
/// words (every wire format maps its own to them).
const LIMIT_FINISH_REASON: &str = "length";

/// Another request's canary found in the answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ForeignHit {
    /// Choice it appeared in.
    pub choice: u32,
    /// Session that owns it.
    pub session: String,
    /// Request that owns it.
    pub request: String,
}

/// What the finish check found wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishProblem {
    /// The answer has no choices.
    EmptyChoices,
    /// Fewer choices than the request asked for.
    MissingChoices,
    /// A delta for a choice index the request did not ask for.
    UnexpectedChoice(u32),
    /// A choice without `finish_reason`.
    NoFinishReason(u32),
    /// `finish_reason: "length"` with almost no output.
    LengthWithoutOutput(u32),
    /// The stream ended without `data: [DONE]`.
    NoDoneMarker,
}

/// Numbers and findings behind a check result.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Evidence {
    /// `echo`: outcome per choice, in choice order.
    Echo {
        /// One entry per choice.
        choices: Vec<EchoOutcome>,
    },
    /// `foreign_canary`.
    ForeignCanary {
        /// Live canaries of other requests found (all of them).
        foreign: u64,
        /// The first few, with owners.
        hits: Vec<ForeignHit>,
        /// Canary-shaped spans that are not live canaries (harmless).
        lookalikes: u64,
        /// Canary-shaped spans the shared registry could not be asked about
        /// (it was unreachable): looked up in this instance only.
        #[serde(skip_serializing_if = "is_zero")]
        unresolved: u64,
    },
    /// `prompt_tokens`.
    PromptTokens {
        /// `usage.prompt_tokens` from the provider.
        reported: Option<u64>,
        /// Our count of the prompt we sent.
        counted: u64,
        /// `counted` comes from the provider's tokenizer.
        exact: bool,
        /// Smallest acceptable report.
        min_allowed: u64,
        /// Largest acceptable report (exact counts only).
        max_allowed: Option<u64>,
    },
    /// `ttft`.
    Ttft {
        /// Time to first token, measured by the proxy.
        ttft_ms: Option<u64>,
        /// Fastest plausible time for this prompt on this provider.
        min_plausible_ms: Option<u64>,
        /// Prompt tokens the bound is computed from: our count, less the
        /// cached tokens credited.
        prompt_tokens: u64,
        /// Prompt tokens credited as served from the provider's cache: its
        /// report, at most what precedes the head canary. `None` when the
        /// bound did not depend on it.
        cached_tokens: Option<u64>,
    },
    /// `finish`.
    Finish {
        /// Choices the answer had.
        choices: u32,
        /// Choices the request asked for.
        expected_choices: u32,
        /// `usage.completion_tokens`, if reported.
        completion_tokens: Option<u64>,
        /// What was wrong (empty when passed).
        problems: Vec<FinishProblem>,
    },
    /// `topic`.
    Topic(TopicEvidence),
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// `topic`: the cosine similarity of question and answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopicEvidence {
    /// The similarity, when it was scored.
    pub similarity: Option<f32>,
    /// The policy's threshold.
    pub min_similarity: f32,
    /// The embedding model.
    pub model: String,
}

/// One check's result, for the verdict and the audit log.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckResult {
    /// Which check.
    pub check: Check,
    /// Pass, fail or skip.
    pub status: Status,
    /// Why it was skipped, or a one-line account of the failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What the check saw.
    pub evidence: Evidence,
}

/// All check results of one answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// Set when no echo was asked (passive checks only), and why.
    pub passive: Option<PassiveReason>,
    /// One result per check, in [`Check`] order.
    pub checks: Vec<CheckResult>,
    /// The shared canary registry could not be asked: canaries were
    /// registered or looked up in this instance only, so a leak from another
    /// instance's request may have gone unseen.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub registry_degraded: bool,
}

/// What the proxy does with an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Send it.
    Deliver,
    /// Send it, marked failed in `x-canarygate-verdict`.
    Flag,
    /// Discard it and send the request upstream again with fresh canaries.
    Retry,
    /// Discard it and serve the request from the local engine.
    Fallback,

    /// HTTP 502 naming the failed checks ([`Verdict::failure_message`]), or,
    /// when bytes already went out (echo-first), end the stream with that
    /// error as an event.
    Block,
}

impl Verdict {
    /// True when no check failed.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|check| check.status != Status::Fail)
    }

    /// Names of the failed checks.
    pub fn failed_checks(&self) -> Vec<Check> {
        self.checks
            .iter()
            .filter(|check| check.status == Status::Fail)
            .map(|check| check.check)
            .collect()
    }

    /// The result of `check`.
    pub fn result(&self, check: Check) -> Option<&CheckResult> {
        self.checks.iter().find(|result| result.check == check)
    }

    /// What to do under `action`. `attempt` counts upstream attempts before
    /// this one (0 for the first); `released_any` says whether text of this
    /// answer already reached the client (then it cannot be retried).
    /// `Fallback` re-serves locally only while nothing was released.
    pub fn decide(&self, action: FailureAction, attempt: u32, released_any: bool) -> Decision {
        if self.passed() {
            return Decision::Deliver;
        }
        match action {
            FailureAction::Flag => Decision::Flag,
            FailureAction::Retry if attempt == 0 && !released_any => Decision::Retry,
            FailureAction::Fallback if !released_any => Decision::Fallback,
            FailureAction::Retry | FailureAction::Block | FailureAction::Fallback => {
                Decision::Block
            }
        }
    }

    /// Value of the `x-canarygate-verdict` header: `pass`,
    /// `pass; passive=json_mode`, `pass; withheld=reasoning` or
    /// `fail; checks=echo,foreign_canary`.
    pub fn header_value(&self) -> String {
        let mut value = if self.passed() {
            let mut value = match self.passive {
                Some(reason) => format!("pass; passive={}", passive_name(reason)),
                None => "pass".to_owned(),
            };
            if self.withheld_reasoning() {
                value.push_str("; withheld=reasoning");
            }
            value
        } else {
            let names: Vec<_> = self.failed_checks().into_iter().map(Check::name).collect();
            format!("fail; checks={}", names.join(","))
        };
        if self.registry_degraded {
            value.push_str("; registry_degraded");
        }
        value
    }

    /// Whether a choice's reasoning was withheld
    /// ([`EchoOutcome::ReasoningWithheld`]).
    pub fn withheld_reasoning(&self) -> bool {
        matches!(
            self.result(Check::Echo).map(|result| &result.evidence),
            Some(Evidence::Echo { choices })
                if choices.contains(&EchoOutcome::ReasoningWithheld)
        )
    }

    /// Names of the failed checks, as the error of a blocked answer lists them.
    pub fn failed_check_names(&self) -> Vec<&'static str> {
        self.failed_checks().into_iter().map(Check::name).collect()
    }

    /// The message of a blocked answer. Names the failed checks, never
    /// another request's identity or content.
    pub fn failure_message(&self) -> String {
        format!(
            "canarygate could not verify that the provider's answer belongs to this request \
             (failed checks: {})",
            self.failed_check_names().join(", ")
        )
    }
}

fn passive_name(reason: PassiveReason) -> &'static str {
    match reason {
        PassiveReason::EchoOff => "echo_off",
        PassiveReason::JsonMode => "json_mode",
        PassiveReason::Tools => "tools",
        PassiveReason::Prefill => "prefill",
        PassiveReason::StopSequence => "stop_sequence",
        PassiveReason::Audio => "audio",
    }
}

/// Usage figures reported by the provider (`usage` of its answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProviderUsage {
    /// `usage.prompt_tokens`: every prompt token, cached or not.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens`, if present.
    pub completion_tokens: Option<u64>,
    /// Prompt tokens served from the provider's prompt cache (not prefilled
    /// for this request), if the provider says: OpenAI's
    /// `prompt_tokens_details.cached_tokens`, Anthropic's
    /// `cache_read_input_tokens`, DeepSeek's `prompt_cache_hit_tokens`.
    pub cached_prompt_tokens: Option<u64>,
}

impl ProviderUsage {
    /// Reads a provider's `usage` object: OpenAI's shape (`prompt_tokens`,
    /// `completion_tokens`, `prompt_tokens_details.cached_tokens`, or
    /// DeepSeek's `prompt_cache_hit_tokens`) or Anthropic's (`input_tokens`,
    /// `output_tokens`, `cache_read_input_tokens`,
    /// `cache_creation_input_tokens`). Anthropic's `input_tokens` counts only
    /// the tokens after the last cache breakpoint, so the prompt is the sum of
    /// the three input figures. `None` when no prompt-token count is a number.
    pub fn from_usage(usage: &serde_json::Value) -> Option<Self> {
        let details_cached = usage
            .get("prompt_tokens_details")
            .and_then(|details| details.get("cached_tokens"))
            .and_then(serde_json::Value::as_u64);
        Self::from_counts(
            |name| usage.get(name).and_then(serde_json::Value::as_u64),
            details_cached,
        )
    }

    /// [`Self::from_usage`] of a usage object whose member `name` holds the
    /// count `field(name)` (`None` when it is missing or not a count), and
    /// whose `prompt_tokens_details.cached_tokens` is `details_cached`: for
    /// a reader that does not build the object's tree.
    pub fn from_counts(
        field: impl Fn(&str) -> Option<u64>,
        details_cached: Option<u64>,
    ) -> Option<Self> {
        if let Some(prompt_tokens) = field("prompt_tokens") {
            let cached_prompt_tokens = details_cached.or_else(|| field("prompt_cache_hit_tokens"));
            return Some(Self {
                prompt_tokens,
                completion_tokens: field("completion_tokens"),
                cached_prompt_tokens,
            });
        }
        let input_tokens = field("input_tokens")?;
        let cache_read = field("cache_read_input_tokens");
        let cache_creation = field("cache_creation_input_tokens").unwrap_or(0);
        Some(Self {
            prompt_tokens: input_tokens
                .saturating_add(cache_read.unwrap_or(0))
                .saturating_add(cache_creation),
            completion_tokens: field("output_tokens"),
            cached_prompt_tokens: cache_read,
        })
    }
}

/// How the answer ended, as the proxy saw it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Facts {
    /// `finish_reason` per choice index; the length is the number of choices
    /// the answer had (highest index seen + 1 for streams).
    pub finish_reasons: Vec<Option<String>>,
    /// The provider's usage, if it sent any.
    pub usage: Option<ProviderUsage>,
    /// Streams: whether `data: [DONE]` arrived. `None` for non-streamed answers.
    pub done_marker: Option<bool>,
}

/// Text the client may see now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Step {
    /// Verified text of the pushed choice, echo and own canaries removed.
    /// Often empty while text is held.
    pub release: String,
    /// A check failed and the policy withholds the answer: stop reading
    /// upstream, call [`Verifier::finish`], and act on its verdict.
    pub stop: bool,
}

/// End of verification.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// All check results.
    pub verdict: Verdict,
    /// Last content to release, per choice index (empty when withheld).
    pub release: Vec<String>,
    /// Every other text fed with [`Verifier::push_part`] (reasoning, refusals,
    /// tool-call and function arguments): what was not yet taken as a
    /// [`Step::release`], own canaries removed; tool-call and function
    /// arguments whole (empty when withheld).
    pub parts: Vec<PartText>,
}

impl Finished {
    /// The text of `part` of choice `choice` in [`Finished::parts`], if any.
    pub fn part(&self, choice: u32, part: Part) -> Option<&str> {
        self.parts
            .iter()
            .find(|text| text.choice == choice && text.part == part)
            .map(|text| text.text.as_str())
    }
}

/// Which text of a choice a piece of model output is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Part {
    /// The answer's text: the echo is expected at its start.
    Content,
    /// The model's reasoning (`reasoning_content`, `reasoning`), which comes
    /// before the content: scanned like content, held until the choice's echo
    /// is decided.
    Reasoning,
    /// `reasoning` when the same message or delta also has
    /// `reasoning_content` (servers in the middle of renaming the field send
    /// both): scanned on its own, so the two never run together.
    ReasoningAlias,
    /// A refusal's text.
    Refusal,
    /// The transcript of a spoken reply (Chat's `audio.transcript`), which
    /// a stream sends in pieces: scanned like content.
    Transcript,
    /// The text of entry `n` (by its `index`) of OpenRouter's
    /// `reasoning_details` (a `reasoning.text`'s `text`, a
    /// `reasoning.summary`'s `summary`), which repeats the reasoning in
    /// pieces beside it: scanned like it.
    ReasoningDetail(u32),
    /// The `function.arguments` of tool call `n` of the choice.
    ToolArguments(u32),
    /// The `arguments` of a legacy `function_call`.
    FunctionArguments,
    /// Any other string of the choice that holds something canary-shaped
    /// (an unknown field, a citation), number `n` of the
    /// answer: each is pushed whole, scanned, and its own canaries removed.
    /// A span that could still grow into a canary at the end of one is
    /// looked at with the next string pushed under the same number (a
    /// stream's strings that clients join across chunks share one).
    Other(u32),
}

impl Part {
    /// Whether [`Verifier::push_part`] releases the part's text as it comes
    /// (content, reasoning, refusals); arguments and other strings come
    /// whole in [`Finished::parts`].
    fn is_text(self) -> bool {
        matches!(
            self,
            Part::Content
                | Part::Reasoning
                | Part::ReasoningAlias
                | Part::Refusal
                | Part::Transcript
                | Part::ReasoningDetail(_)
        )
    }

    /// The text this part is written with: the names of one reasoning come
    /// in the same deltas, and one beginning does not end another.
    fn sequence(self) -> Part {
        match self {
            Part::ReasoningAlias | Part::ReasoningDetail(_) => Part::Reasoning,
            part => part,
        }
    }
}

/// The verified text of one part of one choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartText {
    /// Choice index.
    pub choice: u32,
    /// Which text.
    pub part: Part,
    /// The text, own canaries removed.
    pub text: String,
}

/// How much of one text of a choice the client may see, in bytes of the text
/// as received (the concatenation of its pushed deltas).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release<'a> {
    /// Everything received before this offset is decided and may be shown,
    /// except the `removed` spans.
    pub through: usize,
    /// Spans removed from the text (the echo, this request's canaries), in
    /// order; some may lie past `through`, in text decided but not yet
    /// released.
    pub removed: &'a [Range<usize>],
    /// The text is withheld whole ([`EchoOutcome::ReasoningWithheld`]): its
    /// one removed span is the model's text, not canarygate's.
    pub withheld: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EchoState {
    Waiting,
    Done(EchoOutcome),
    NotExpected,
}

/// One text of one choice, as received and as decided.
#[derive(Debug, Default)]
struct Track {
    /// Received text not yet scanned to a decision (held).
    pending: String,
    /// Scanned, cleaned text not yet taken as a string release.
    ready: String,
    /// Bytes received before `pending`: scanned, kept or removed.
    decided: usize,
    /// Bytes received that the client may see ([`Release::through`]).
    released: usize,
    /// Spans removed, in received bytes, in order.
    removed: Vec<Range<usize>>,
    /// The span that was held when another text began, and the text
    /// received since, while it could still grow into a canary: decided and
    /// released, but still looked at with what follows
    /// (`Verifier::check_carry`).
    carry: String,
    /// Which of the request's two canaries (head, tail) the text quoted.
    quoted: [bool; 2],
}

impl Track {
    fn received(&self) -> usize {
        self.decided + self.pending.len()
    }
}

#[derive(Debug)]
struct ChoiceState {
    /// Every text of the choice; `Content` always present.
    tracks: BTreeMap<Part, Track>,
    echo: EchoState,
    /// The text pushed last (`Part::sequence`, other strings aside): a
    /// model writes one text after the other, so when the next begins, the
    /// last one's held tail is decided (and carried, `Track::carry`).
    last_part: Option<Part>,
}

impl ChoiceState {
    fn content(&mut self) -> &mut Track {
        self.tracks.entry(Part::Content).or_default()
    }
}

/// Streaming verifier of one upstream answer (see the module docs).
#[derive(Debug)]
pub struct Verifier {
    own: [Canary; 2],
    /// A session whose other canaries are this conversation's earlier
    /// turns ([`Verifier::accept_session_canaries`]).
    own_session: Option<String>,
    echo: Vec<Canary>,
    passive: Option<PassiveReason>,
    release: ReleasePolicy,
    /// The action withholds failed answers (anything but `flag`).
    gated: bool,
    expected_choices: u32,
    client_max_tokens: Option<u64>,
    prompt_tokens: u64,
    exact_prompt_tokens: bool,
    estimate_min_ratio: f64,
    exact_tolerance: f64,
    exact_slack_tokens: u64,
    prompt_tokens_min: u64,
    ttft_min_prompt_tokens: u64,
    max_prefill_rate: Option<f64>,
    finish_min_length_tokens: u64,
    choices: Vec<ChoiceState>,
    findings: Findings,
    unexpected_choice: Option<u32>,
    /// Our estimate of the tokens before the head canary, in the units of
    /// `prompt_tokens`: the most a prompt cache can hold of this prompt.
    cacheable_prompt_tokens: u64,
    ttft: Option<CheckResult>,
    /// A first token too fast for the whole prompt, not for its uncached
    /// part: decided by [`Verifier::finish`] from the cached tokens reported.
    ttft_pending: Option<PendingTtft>,
    failed: bool,
    released_any: bool,
    /// [`Verifier::finish`] ran.
    finished: bool,
    /// The provider ended the answer with its own error
    /// ([`Verifier::ended_by_provider_error`]).
    provider_error: bool,
}

/// A `ttft` decision waiting for the provider's usage.
#[derive(Debug, Clone, Copy)]
struct PendingTtft {
    ttft_ms: u64,
    rate: f64,
}

impl Verifier {
    /// A verifier for the answer to the request `injection` describes, under
    /// `config`, served by `provider`. `exact_prompt_tokens` is the prompt's
    /// token count by the provider's own tokenizer, when the proxy has it;
    /// otherwise the injection's estimate is used with a loose tolerance.
    pub fn new(
        injection: &Injection,
        config: &VerifyConfig,
        provider: &str,
        exact_prompt_tokens: Option<u64>,
    ) -> Self {
        let release = if injection.stream {
            config.release
        } else {
            ReleasePolicy::VerdictFirst
        };
        let prompt_tokens = exact_prompt_tokens.unwrap_or(injection.prompt_tokens_estimate);
        // The estimate before the head canary, scaled to the count in use.
        let cacheable_prompt_tokens =
            injection.scaled_to_exact(injection.cacheable_prompt_tokens, exact_prompt_tokens);
        Self {
            own: [injection.canaries.head, injection.canaries.tail],
            own_session: None,
            echo: injection.echo.clone(),
            passive: injection.passive,
            release,
            gated: config.action() != FailureAction::Flag,
            expected_choices: injection.choices.max(1),
            client_max_tokens: injection.client_max_tokens,
            prompt_tokens,
            exact_prompt_tokens: exact_prompt_tokens.is_some(),
            estimate_min_ratio: *config.estimate_min_ratio.get_ref(),
            exact_tolerance: *config.exact_tolerance.get_ref(),
            exact_slack_tokens: config.exact_slack_tokens,
            prompt_tokens_min: config.prompt_tokens_min,
            ttft_min_prompt_tokens: config.ttft_min_prompt_tokens,
            max_prefill_rate: config.max_prefill_rate(provider),
            finish_min_length_tokens: config.finish_min_length_tokens,
            choices: Vec::new(),
            findings: Findings::default(),
            unexpected_choice: None,
            cacheable_prompt_tokens: cacheable_prompt_tokens.min(prompt_tokens),
            ttft: None,
            ttft_pending: None,
            failed: false,
            released_any: false,
            finished: false,
            provider_error: false,
        }
    }

    /// The request continues a conversation the provider keeps (the
    /// Responses API's `previous_response_id`): its earlier turns, with
    /// their canaries, are in the model's context. Canaries registered to
    /// `session` (the caller's) are then removed like this request's own
    /// instead of failing `foreign_canary`; another session's still fail.
    pub fn accept_session_canaries(&mut self, session: &str) {
        self.own_session = Some(session.to_owned());
    }

    /// True once any text was released to the client.
    pub fn released_any(&self) -> bool {
        self.released_any
    }

    /// True when a failure was seen and the policy withholds the answer.
    pub fn stopped(&self) -> bool {
        self.failed && self.gated
    }

    /// Records the time to first token. Returns true when the proxy must
    /// stop (the ttft check failed and the policy withholds failed answers).
    ///
    /// The bound counts only the prompt tokens the provider had to prefill:
    /// a prompt cache serves a repeated prefix without prefilling it. A first
    /// token fast enough for the whole prompt passes here; one too fast even
    /// for the tokens from the head canary on (which no cache can hold: the
    /// canary is new) fails here; one in between waits for the cached tokens
    /// the provider reports in its usage, and [`Verifier::finish`] decides.
    pub fn observe_ttft(&mut self, ttft_ms: u64) -> bool {
        let rate = match self.max_prefill_rate {
            None => {
                self.ttft = Some(skipped(
                    Check::Ttft,
                    "no max_prefill_tokens_per_second for this provider",
                    ttft_evidence(Some(ttft_ms), None, self.prompt_tokens, None),
                ));
                return false;
            }
            Some(_) if self.prompt_tokens < self.ttft_min_prompt_tokens => {
                self.ttft = Some(skipped(
                    Check::Ttft,
                    "prompt below ttft_min_prompt_tokens",
                    ttft_evidence(Some(ttft_ms), None, self.prompt_tokens, None),
                ));
                return false;
            }
            Some(rate) => rate,
        };
        let whole_ms = prefill_ms(self.prompt_tokens, rate);
        if ttft_ms >= whole_ms {
            self.ttft = Some(CheckResult {
                check: Check::Ttft,
                status: Status::Pass,
                reason: None,
                evidence: ttft_evidence(Some(ttft_ms), Some(whole_ms), self.prompt_tokens, None),
            });
            return false;
        }
        let most_cached = self.most_cached_tokens(None);
        let fresh = self.prompt_tokens - most_cached;
        let fresh_ms = prefill_ms(fresh, rate);
        if ttft_ms >= fresh_ms {
            self.ttft_pending = Some(PendingTtft { ttft_ms, rate });
            return false;
        }
        self.failed = true;
        self.ttft = Some(CheckResult {
            check: Check::Ttft,
            status: Status::Fail,
            reason: Some(format!(
                "first token after {ttft_ms} ms; prefilling the {fresh} prompt tokens from the \
                 head canary on, which no cache holds, takes at least {fresh_ms} ms"
            )),
            evidence: ttft_evidence(Some(ttft_ms), Some(fresh_ms), fresh, Some(most_cached)),
        });
        self.stopped()
    }

    /// The most prompt tokens a cache can be credited with: what precedes the
    /// head canary, plus the framing slack, and no more than the provider's
    /// own prompt count when given.
    fn most_cached_tokens(&self, reported_prompt_tokens: Option<u64>) -> u64 {
        self.cacheable_prompt_tokens
            .saturating_add(self.exact_slack_tokens)
            .min(self.prompt_tokens)
            // A reported 0 is no count (`prompt_tokens_result`).
            .min(
                reported_prompt_tokens
                    .filter(|reported| *reported > 0)
                    .unwrap_or(u64::MAX),
            )
    }

    /// The `ttft` result at the end of the answer: decided already, or
    /// decided now from the cached tokens in `usage`.
    fn ttft_result(&self, usage: Option<ProviderUsage>, stopped_early: bool) -> CheckResult {
        if let Some(result) = &self.ttft {
            return result.clone();
        }
        let Some(PendingTtft { ttft_ms, rate }) = self.ttft_pending else {
            return skipped(
                Check::Ttft,
                "time to first token not measured",
                ttft_evidence(None, None, self.prompt_tokens, None),
            );
        };
        let reported_cached = usage.and_then(|usage| usage.cached_prompt_tokens);
        if stopped_early && usage.is_none() {
            return skipped(
                Check::Ttft,
                "stopped after an earlier failure, before the usage",
                ttft_evidence(Some(ttft_ms), None, self.prompt_tokens, None),
            );
        }
        let cached = reported_cached
            .unwrap_or(0)
            .min(self.most_cached_tokens(usage.map(|usage| usage.prompt_tokens)));
        let uncached = self.prompt_tokens - cached;
        let min_ms = prefill_ms(uncached, rate);
        let evidence = ttft_evidence(Some(ttft_ms), Some(min_ms), uncached, Some(cached));
        if ttft_ms >= min_ms {
            return CheckResult {
                check: Check::Ttft,
                status: Status::Pass,
                reason: None,
                evidence,
            };
        }
        let cache = match reported_cached {
            None => "the provider reported no cached tokens".to_owned(),
            Some(reported) if reported > cached => {
                format!("{reported} reported cached, {cached} of them possible")
            }
            Some(reported) => format!("{reported} reported cached"),
        };
        CheckResult {
            check: Check::Ttft,
            status: Status::Fail,
            reason: Some(format!(
                "first token after {ttft_ms} ms; prefilling {uncached} uncached prompt tokens \
                 ({cache}) takes at least {min_ms} ms"
            )),
            evidence,
        }
    }

    /// Feeds a content delta of choice `choice`; returns what the client may
    /// see now (see [`Step`]).
    pub fn push(&mut self, choice: u32, delta: &str, registry: &dyn CanaryRegistry) -> Step {
        self.push_part(choice, Part::Content, delta, registry)
    }

    /// Feeds a fragment of the `function.arguments` of tool call `tool_call`
    /// in choice `choice`; returns true when the proxy must stop. Arguments
    /// are scanned like content; as strings they come whole in
    /// [`Finished::parts`], as positions they are released like content
    /// ([`Verifier::release_of`]).
    pub fn push_tool_arguments(
        &mut self,
        choice: u32,
        tool_call: u32,
        delta: &str,
        registry: &dyn CanaryRegistry,
    ) -> bool {
        self.push_part(choice, Part::ToolArguments(tool_call), delta, registry)
            .stop
    }

    /// Feeds a delta of `part` of choice `choice`. Every part is scanned for
    /// canaries; content also carries the echo. The step's release is the
    /// pushed part's newly released text for content, reasoning and
    /// refusals, and always empty for arguments (whole in
    /// [`Finished::parts`]). Whatever the part, [`Verifier::release_of`]
    /// then tells how much of each text of the choice the client may see.
    pub fn push_part(
        &mut self,
        choice: u32,
        part: Part,
        delta: &str,
        registry: &dyn CanaryRegistry,
    ) -> Step {
        let release = match self.scan_part(choice, part, delta, registry) {
            Some(index) if part.is_text() => self.take_release(index, part, false),
            _ => String::new(),
        };
        Step {
            release,
            stop: self.stopped(),
        }
    }

    /// [`Verifier::push_part`] for a caller that reads what the client may
    /// see as positions ([`Verifier::release_of`]): the released text is
    /// dropped where it is instead of returned, so a delta costs no string
    /// of its own. Returns [`Step::stop`]. Mixing it with `push_part` on one
    /// verifier leaves `push_part`'s releases without the text this dropped.
    /// Other strings are not kept for [`Finished::parts`] either: a stream
    /// may send one under the same number in every event (a field clients
    /// join), and the caller reads them where they are.
    pub fn push_part_positions(
        &mut self,
        choice: u32,
        part: Part,
        delta: &str,
        registry: &dyn CanaryRegistry,
    ) -> bool {
        let Some(index) = self.scan_part(choice, part, delta, registry) else {
            return self.stopped();
        };
        let other = matches!(part, Part::Other(_));
        if (other || part.is_text() && self.may_release(index, false))
            && let Some(track) = self.choices[index].tracks.get_mut(&part)
        {
            self.released_any |= !other && !track.ready.is_empty();
            track.ready.clear();
        }
        self.stopped()
    }

    /// Scans `delta` of `part` of choice `choice` and releases what it
    /// decided as positions; the choice's index, unless the delta was not
    /// taken (the verifier had stopped, or the choice was not asked for).
    fn scan_part(
        &mut self,
        choice: u32,
        part: Part,
        delta: &str,
        registry: &dyn CanaryRegistry,
    ) -> Option<usize> {
        if self.stopped() {
            return None;
        }
        if choice >= self.expected_choices {
            self.unexpected_choice.get_or_insert(choice);
            self.failed = true;
            return None;
        }
        let index = choice as usize;
        self.ensure_choices(index + 1);
        if !matches!(part, Part::Other(_)) {
            let previous = self.choices[index].last_part.replace(part.sequence());
            if let Some(previous) = previous.filter(|previous| *previous != part.sequence()) {
                // A text that received nothing (a stream's first chunk, its
                // content empty) has nothing to end: an empty content is
                // no reply without the echo.
                let interrupted: Vec<Part> = self.choices[index]
                    .tracks
                    .iter()
                    .filter(|(held, track)| held.sequence() == previous && track.received() > 0)
                    .map(|(held, _)| *held)
                    .collect();
                for held in interrupted {
                    self.interrupt(index, held, registry);
                }
            }
        }
        let track = self.choices[index].tracks.entry(part).or_default();
        track.pending.push_str(delta);
        if !track.carry.is_empty() {
            let carry = std::mem::take(&mut track.carry);
            self.check_carry(index, part, carry, delta, registry);
        }
        self.process(index, part, false, registry);
        if matches!(part, Part::Other(_)) {
            // Decided whole, but its tail may begin a canary the next string
            // under the same number ends.
            self.carry_tail(index, part, delta);
        }
        self.open(index, false);
        Some(index)
    }

    /// Bytes of `part` of choice `choice` pushed so far.
    pub fn received(&self, choice: u32, part: Part) -> usize {
        self.track(choice, part).map_or(0, Track::received)
    }

    /// How much of `part` of choice `choice` the client may see now (nothing
    /// before the choice's echo is decided, nothing more after a failure
    /// under a withholding policy, everything decided once released).
    pub fn release_of(&self, choice: u32, part: Part) -> Release<'_> {
        match self.track(choice, part) {
            Some(track) => Release {
                through: track.released,
                removed: &track.removed,
                withheld: part.sequence() == Part::Reasoning && self.withholds_reasoning(choice),
            },
            None => Release {
                through: 0,
                removed: &[],
                withheld: false,
            },
        }
    }

    /// Whether choice `choice`'s reasoning is withheld whole
    /// ([`EchoOutcome::ReasoningWithheld`]), once [`Verifier::finish`]
    /// decided it: a wire format whose reasoning is signed, and never
    /// edited, drops it instead.
    pub fn withholds_reasoning(&self, choice: u32) -> bool {
        self.choices
            .get(choice as usize)
            .is_some_and(|state| state.echo == EchoState::Done(EchoOutcome::ReasoningWithheld))
    }

    /// The canary-shaped spans that pushing `delta` to `part` of `choice`
    /// could decide, other than this request's own, once each: what a
    /// registry that answers asynchronously must resolve before the push
    /// (the push's own lookups are synchronous). Every span the push looks
    /// up is among them; most texts have none, and cost one `memchr` pass (two
    /// when they hold other than ASCII).
    pub fn spans_to_look_up(&self, choice: u32, part: Part, delta: &str) -> Vec<Canary> {
        let (pending, carry) = self.track(choice, part).map_or(("", ""), |track| {
            (track.pending.as_str(), track.carry.as_str())
        });
        let has_start = |text: &str| Starts::new(text.as_bytes()).next().is_some();
        if !has_start(pending) && !has_start(delta) && carry.is_empty() {
            return Vec::new();
        }
        // Spans begun in the held text, and in a carried one.
        let mut texts = vec![format!("{pending}{delta}")];
        if !carry.is_empty() {
            texts.push(format!("{carry}{delta}"));
        }
        let mut spans = Vec::new();
        for text in &texts {
            for found in find_canaries(text) {
                if !self.own.contains(&found.canary) && !spans.contains(&found.canary) {
                    spans.push(found.canary);
                }
            }
        }
        spans
    }

    /// The shared registry could not be asked: registering this request's
    /// canaries (`unresolved` 0) or resolving `unresolved` canary-shaped
    /// spans of the answer, which were then looked up in this instance only.
    /// With `fail` (the policy fails closed), unresolved spans fail
    /// `foreign_canary`. The verdict says `registry_degraded` either way.
    pub fn registry_degraded(&mut self, unresolved: u64, fail: bool) {
        let findings = &mut self.findings;
        findings.registry_degraded = true;
        findings.unresolved += unresolved;
        findings.unresolved_fail |= fail;
        if fail && unresolved > 0 {
            self.failed = true;
        }
    }

    fn track(&self, choice: u32, part: Part) -> Option<&Track> {
        self.choices.get(choice as usize)?.tracks.get(&part)
    }

    /// Records that the provider ended the answer with its own error (an
    /// error event in its stream), before [`Verifier::finish`]. That is an
    /// honest failure, not an answer dressed as whole: an echo not decided
    /// yet is settled as [`EchoOutcome::EndedByProviderError`] (the text
    /// that would have opened the reply withheld, unscanned: at most a
    /// preamble and part of an echo), and the `echo` and `finish` checks
    /// are skipped rather than failed. Every canary already seen still
    /// counts, and so does what [`Verifier::finish`] scans of the other
    /// texts still held.
    pub fn ended_by_provider_error(&mut self) {
        self.provider_error = true;
    }

    /// Ends the answer: decides what is still held, runs the end-of-answer
    /// checks and returns the verdict with the last text per choice.
    pub fn finish(&mut self, facts: &Facts, registry: &dyn CanaryRegistry) -> Finished {
        let stopped_early = self.stopped();
        self.finished = true;
        let seen = facts
            .finish_reasons
            .len()
            .min(self.expected_choices as usize)
            .max(self.choices.len())
            .max(1);
        self.ensure_choices(seen);
        if !stopped_early {
            self.mark_textless(&facts.finish_reasons);
            if self.provider_error {
                self.settle_echo_ended_by_error();
            }
            for index in 0..self.choices.len() {
                let parts: Vec<Part> = self.choices[index].tracks.keys().copied().collect();
                for part in parts {
                    self.process(index, part, true, registry);
                }
            }
            self.withhold_reasoning();
        }
        let stopped_reason = stopped_early.then(|| "stopped after an earlier failure".to_owned());

        let mut checks = vec![self.echo_result(stopped_early), self.foreign_result()];
        checks.push(match &stopped_reason {
            Some(reason) => skipped(Check::PromptTokens, reason, self.prompt_evidence(None)),
            None => self.prompt_tokens_result(facts.usage),
        });
        checks.push(self.ttft_result(facts.usage, stopped_early));
        checks.push(self.finish_result(facts, stopped_early));
        let verdict = Verdict {
            passive: self.passive,
            checks,
            registry_degraded: self.findings.registry_degraded,
        };
        if !verdict.passed() {
            self.failed = true;
        }
        let mut release = Vec::with_capacity(self.choices.len());
        let mut parts = Vec::new();
        for index in 0..self.choices.len() {
            self.open(index, true);
            let others: Vec<Part> = self.choices[index]
                .tracks
                .keys()
                .copied()
                .filter(|part| *part != Part::Content)
                .collect();
            release.push(self.take_release(index, Part::Content, true));
            for part in others {
                let text = self.take_release(index, part, true);
                if self.gated && self.failed {
                    continue;
                }
                parts.push(PartText {
                    choice: index as u32,
                    part,
                    text,
                });
            }
        }
        Finished {
            verdict,
            release,
            parts,
        }
    }

    /// Settles the echo of each choice still awaiting it as
    /// [`EchoOutcome::EndedByProviderError`], withholding the text that
    /// would have opened the reply, its content or its refusal (at most a
    /// preamble and the start of an echo: [`match_echo`] decides as soon as
    /// the text departs from one, or holds a whole canary).
    fn settle_echo_ended_by_error(&mut self) {
        for state in &mut self.choices {
            if state.echo != EchoState::Waiting {
                continue;
            }
            state.echo = EchoState::Done(EchoOutcome::EndedByProviderError);
            for part in [Part::Content, Part::Refusal] {
                if let Some(track) = state.tracks.get_mut(&part) {
                    let held = track.pending.len();
                    track.pending.clear();
                    track.removed.push(track.decided..track.decided + held);
                    track.decided += held;
                }
            }
        }
    }

    /// Settles the echo of each choice that gave no text: still awaited,
    /// no text received in any of its parts (strings of other fields
    /// aside), and a finish reason (`reasons`, by choice) that says why:
    /// withheld ([`EchoOutcome::Withheld`]) or cut at the token limit
    /// ([`EchoOutcome::CutBeforeText`]). A choice the token limit cut in
    /// its reasoning, before any other text, is settled too: passed when
    /// that reasoning quoted every canary of the echo
    /// ([`EchoOutcome::QuotedInReasoning`]), else with the reasoning to be
    /// withheld ([`EchoOutcome::ReasoningWithheld`], [`Self::withhold_reasoning`]).
    fn mark_textless(&mut self, reasons: &[Option<String>]) {
        let (own, echo) = (&self.own, &self.echo);
        for (state, reason) in self.choices.iter_mut().zip(reasons) {
            let outcome = match reason.as_deref() {
                Some(LIMIT_FINISH_REASON) => EchoOutcome::CutBeforeText,
                Some(reason) if WITHHELD_FINISH_REASONS.contains(&reason) => EchoOutcome::Withheld,
                _ => continue,
            };
            if state.echo != EchoState::Waiting {
                continue;
            }
            // Every text but `spoken` (the names of one reasoning count as
            // one, `Part::sequence`) and other strings received nothing.
            let silent_but = |spoken: Option<Part>| {
                state.tracks.iter().all(|(part, track)| {
                    matches!(part, Part::Other(_))
                        || Some(part.sequence()) == spoken
                        || track.received() == 0
                })
            };
            let quoted_echo = state.tracks.get(&Part::Reasoning).is_some_and(|track| {
                !echo.is_empty()
                    && echo.iter().all(|canary| {
                        own.iter()
                            .zip(track.quoted)
                            .any(|(own, quoted)| quoted && own == canary)
                    })
            });
            if silent_but(None) {
                state.echo = EchoState::Done(outcome);
            } else if outcome == EchoOutcome::CutBeforeText && silent_but(Some(Part::Reasoning)) {
                state.echo = EchoState::Done(if quoted_echo {
                    EchoOutcome::QuotedInReasoning
                } else {
                    EchoOutcome::ReasoningWithheld
                });
            }
        }
    }

    /// Removes the whole reasoning of each choice whose reply the token
    /// limit cut in reasoning nothing vouches for
    /// ([`EchoOutcome::ReasoningWithheld`]), once it is all decided: none of
    /// it was released, as it waited for the echo.
    fn withhold_reasoning(&mut self) {
        for state in &mut self.choices {
            if state.echo != EchoState::Done(EchoOutcome::ReasoningWithheld) {
                continue;
            }
            for (part, track) in &mut state.tracks {
                if part.sequence() == Part::Reasoning {
                    debug_assert_eq!(track.released, 0, "reasoning waits for the echo");
                    let received = track.received();
                    track.removed.clear();
                    track.removed.push(0..received);
                    track.ready.clear();
                }
            }
        }
    }

    fn ensure_choices(&mut self, count: usize) {
        while self.choices.len() < count {
            let echo = if self.echo.is_empty() {
                EchoState::NotExpected
            } else {
                EchoState::Waiting
            };
            let mut state = ChoiceState {
                tracks: BTreeMap::new(),
                echo,
                last_part: None,
            };
            state.content();
            self.choices.push(state);
        }
    }

    /// Decides `part`'s held tail because another text of choice `index`
    /// began: released as it stands, and what of it could still grow into a
    /// canary carried (`Track::carry`).
    fn interrupt(&mut self, index: usize, part: Part, registry: &dyn CanaryRegistry) {
        let held = self.choices[index]
            .tracks
            .get(&part)
            .map(|track| track.pending.clone())
            .unwrap_or_default();
        self.process(index, part, true, registry);
        self.carry_tail(index, part, &held);
    }

    /// Carries the span at the end of `text`, decided, that could still grow
    /// into a canary, for `part` of choice `index` to look at with what
    /// comes next ([`Verifier::check_carry`]), unless a carry is kept
    /// already.
    fn carry_tail(&mut self, index: usize, part: Part, text: &str) {
        let Some(track) = self.choices[index].tracks.get_mut(&part) else {
            return;
        };
        if !track.carry.is_empty() {
            return;
        }
        let bytes = text.as_bytes();
        let partial = Starts::new(bytes)
            .find(|&start| matches!(match_at(bytes, start), Shape::Partial { .. }));
        if let Some(start) = partial {
            track.carry = text[start..].to_owned();
        }
    }

    /// Looks at a `carry` of `part` of choice `index` with the `delta` that
    /// resumes it: a canary begun in the carry and ended in the delta is
    /// judged as any other (only another request's fails the answer; the
    /// rest of it was released); what could still grow stays carried.
    fn check_carry(
        &mut self,
        index: usize,
        part: Part,
        mut carry: String,
        delta: &str,
        registry: &dyn CanaryRegistry,
    ) {
        let carried = carry.len();
        carry.push_str(delta);
        let bytes = carry.as_bytes();
        let mut starts = Starts::new(bytes);
        let mut still_partial = None;
        while let Some(start) = starts.next().filter(|&start| start < carried) {
            match match_at(bytes, start) {
                Shape::Complete { canary, end } => {
                    let own = (&self.own, self.own_session.as_deref());
                    if let SpanOwner::Foreign(owner) = owner_of(canary, own, registry) {
                        self.findings.record_foreign(index as u32, owner);
                        self.failed = true;
                    }
                    starts.skip_to(end);
                }
                Shape::Partial { .. } => {
                    still_partial = Some(start);
                    break;
                }
                Shape::NoMatch => {}
            }
        }
        if let Some(start) = still_partial
            && let Some(track) = self.choices[index].tracks.get_mut(&part)
        {
            carry.drain(..start);
            track.carry = carry;
        }
    }

    /// Decides as much of `part` of choice `index` as possible: the echo at
    /// the start of the content, then canaries.
    fn process(&mut self, index: usize, part: Part, end: bool, registry: &dyn CanaryRegistry) {
        let state = &mut self.choices[index];
        // The reply opens with the content, or, when the content has
        // nothing, with a refusal (a reply that is only a refusal may open
        // it with the echo, as it would open any reply).
        let opens_reply = match part {
            Part::Content => true,
            Part::Refusal => state
                .tracks
                .get(&Part::Content)
                .is_none_or(|content| content.received() == 0),
            _ => false,
        };
        if opens_reply && state.echo == EchoState::Waiting {
            let track = state.tracks.entry(part).or_default();
            match match_echo(&track.pending, &self.echo, end) {
                EchoMatch::Pending => return,
                EchoMatch::Passed(len) => {
                    track.pending.drain(..len);
                    track.removed.push(track.decided..track.decided + len);
                    track.decided += len;
                    state.echo = EchoState::Done(EchoOutcome::Passed);
                }
                EchoMatch::Failed(outcome) => {
                    state.echo = EchoState::Done(outcome);
                    self.failed = true;
                }
            }
        }
        let track = state.tracks.entry(part).or_default();
        // Other strings come whole: nothing of them can grow later.
        let end = end || matches!(part, Part::Other(_));
        let found = scan(
            track,
            end,
            (&self.own, self.own_session.as_deref()),
            registry,
            index as u32,
            &mut self.findings,
        );
        self.failed |= found;
        if self.failed && self.gated {
            // Withheld for good: keep nothing that could be released later.
            for track in state.tracks.values_mut() {
                track.ready.clear();
            }
        }
    }

    /// Whether anything of choice `choice` may reach the client now: its
    /// echo is decided (or none is asked), the policy releases before the
    /// verdict (`echo-first`), and nothing failed that withholds the answer.
    /// After [`Verifier::finish`], only failures withhold.
    pub fn may_show(&self, choice: u32) -> bool {
        let index = choice as usize;
        if index < self.choices.len() {
            return self.may_release(index, self.finished);
        }
        // Nothing of it arrived yet: as a fresh choice would be.
        let withheld = self.gated && self.failed;
        !withheld
            && (self.finished || self.echo.is_empty() && self.release == ReleasePolicy::EchoFirst)
    }

    /// Whether choice `index`'s decided text may reach the client now.
    fn may_release(&self, index: usize, at_finish: bool) -> bool {
        let withheld = self.gated && self.failed;
        !withheld
            && self.choices[index].echo != EchoState::Waiting
            && (at_finish || self.release == ReleasePolicy::EchoFirst)
    }

    /// Releases, as positions, everything decided of choice `index` if the
    /// policy lets it out now.
    fn open(&mut self, index: usize, at_finish: bool) {
        if !self.may_release(index, at_finish) {
            return;
        }
        for track in self.choices[index].tracks.values_mut() {
            let newly = track.released..track.decided;
            let removed: usize = track
                .removed
                .iter()
                .map(|span| {
                    span.end
                        .min(newly.end)
                        .saturating_sub(span.start.max(newly.start))
                })
                .sum();
            self.released_any |= newly.len() > removed;
            track.released = track.decided;
        }
    }

    /// Takes `part` of choice `index`'s ready text if the policy lets it out now.
    fn take_release(&mut self, index: usize, part: Part, at_finish: bool) -> String {
        if !self.may_release(index, at_finish) {
            return String::new();
        }
        let Some(track) = self.choices[index].tracks.get_mut(&part) else {
            return String::new();
        };
        let text = std::mem::take(&mut track.ready);
        self.released_any |= !text.is_empty();
        text
    }

    fn echo_result(&self, stopped_early: bool) -> CheckResult {
        let choices: Vec<_> = self
            .choices
            .iter()
            .map(|state| match state.echo {
                EchoState::Done(outcome) => outcome,
                // Only reachable when stopped early for another reason.
                EchoState::Waiting => EchoOutcome::Incomplete,
                EchoState::NotExpected => EchoOutcome::Passed,
            })
            .collect();
        if let Some(reason) = self.passive {
            return skipped(
                Check::Echo,
                &format!("passive request: {}", passive_name(reason)),
                Evidence::Echo {
                    choices: Vec::new(),
                },
            );
        }
        let vouches = |outcome: &EchoOutcome| {
            matches!(
                outcome,
                EchoOutcome::Passed
                    | EchoOutcome::Withheld
                    | EchoOutcome::CutBeforeText
                    | EchoOutcome::QuotedInReasoning
                    | EchoOutcome::ReasoningWithheld
                    | EchoOutcome::EndedByProviderError
            )
        };
        let refuted = self
            .choices
            .iter()
            .any(|state| matches!(&state.echo, EchoState::Done(outcome) if !vouches(outcome)));
        let undecided = self
            .choices
            .iter()
            .any(|state| state.echo == EchoState::Waiting);
        if stopped_early && undecided && !refuted {
            return skipped(
                Check::Echo,
                "stopped after an earlier failure",
                Evidence::Echo { choices },
            );
        }
        // Not a failure, and no echo seen either.
        if !refuted && choices.contains(&EchoOutcome::EndedByProviderError) {
            return skipped(
                Check::Echo,
                "the provider ended the answer with its own error",
                Evidence::Echo { choices },
            );
        }
        let failed = choices.iter().position(|outcome| !vouches(outcome));
        CheckResult {
            check: Check::Echo,
            status: if failed.is_some() {
                Status::Fail
            } else {
                Status::Pass
            },
            reason: failed.map(|index| format!("choice {index}: {:?}", choices[index])),
            evidence: Evidence::Echo { choices },
        }
    }

    fn foreign_result(&self) -> CheckResult {
        let Findings {
            foreign,
            hits,
            lookalikes,
            unresolved,
            unresolved_fail,
            registry_degraded,
        } = &self.findings;
        let unresolved_failed = *unresolved_fail && *unresolved > 0;
        let reason = if *foreign > 0 {
            Some(format!(
                "{foreign} canaries of other requests in the answer"
            ))
        } else if unresolved_failed {
            Some(format!(
                "the shared registry was unreachable: {unresolved} canary-shaped spans \
                 could not be looked up"
            ))
        } else {
            registry_degraded
                .then(|| "registry_degraded: canaries looked up in this instance only".to_owned())
        };
        CheckResult {
            check: Check::ForeignCanary,
            status: if *foreign > 0 || unresolved_failed {
                Status::Fail
            } else {
                Status::Pass
            },
            reason,
            evidence: Evidence::ForeignCanary {
                foreign: *foreign,
                hits: hits.clone(),
                lookalikes: *lookalikes,
                unresolved: *unresolved,
            },
        }
    }

    fn prompt_bounds(&self) -> (u64, Option<u64>) {
        let counted = self.prompt_tokens as f64;
        if self.exact_prompt_tokens {
            let slack = counted * self.exact_tolerance + self.exact_slack_tokens as f64;
            (
                (counted - slack).max(0.0).floor() as u64,
                Some((counted + slack).ceil() as u64),
            )
        } else {
            ((counted * self.estimate_min_ratio).floor() as u64, None)
        }
    }

    fn prompt_evidence(&self, reported: Option<u64>) -> Evidence {
        let (min_allowed, max_allowed) = self.prompt_bounds();
        Evidence::PromptTokens {
            reported,
            counted: self.prompt_tokens,
            exact: self.exact_prompt_tokens,
            min_allowed,
            max_allowed,
        }
    }

    fn prompt_tokens_result(&self, usage: Option<ProviderUsage>) -> CheckResult {
        let reported = usage.map(|usage| usage.prompt_tokens);
        let evidence = self.prompt_evidence(reported);
        let Some(reported) = reported else {
            return skipped(Check::PromptTokens, "no usage reported", evidence);
        };
        if reported == 0 {
            // No prompt is empty (ours alone holds the canaries): a count of
            // 0 is one the server did not take, as Ollama reports a prompt
            // served from its cache (ollama#5370), not a truncation.
            return skipped(
                Check::PromptTokens,
                "provider reported 0 prompt tokens: no count",
                evidence,
            );
        }
        if self.prompt_tokens < self.prompt_tokens_min {
            return skipped(
                Check::PromptTokens,
                "prompt below prompt_tokens_min",
                evidence,
            );
        }
        let (min_allowed, max_allowed) = self.prompt_bounds();
        let fits = reported >= min_allowed && max_allowed.is_none_or(|max| reported <= max);
        CheckResult {
            check: Check::PromptTokens,
            status: if fits { Status::Pass } else { Status::Fail },
            reason: (!fits).then(|| {
                format!(
                    "provider reported {reported} prompt tokens for a prompt of {} tokens",
                    self.prompt_tokens
                )
            }),
            evidence,
        }
    }

    fn finish_result(&self, facts: &Facts, stopped_early: bool) -> CheckResult {
        let completion_tokens = facts.usage.and_then(|usage| usage.completion_tokens);
        let mut problems = Vec::new();
        if let Some(index) = self.unexpected_choice {
            problems.push(FinishProblem::UnexpectedChoice(index));
        }
        let evidence = |problems| Evidence::Finish {
            choices: facts.finish_reasons.len() as u32,
            expected_choices: self.expected_choices,
            completion_tokens,
            problems,
        };
        if stopped_early && problems.is_empty() {
            return skipped(
                Check::Finish,
                "stopped after an earlier failure",
                evidence(problems),
            );
        }
        if !stopped_early && self.provider_error && problems.is_empty() {
            return skipped(
                Check::Finish,
                "the provider ended the answer with its own error",
                evidence(problems),
            );
        }
        if !stopped_early && !self.provider_error {
            if facts.finish_reasons.is_empty() {
                problems.push(FinishProblem::EmptyChoices);
            } else if facts.finish_reasons.len() < self.expected_choices as usize {
                problems.push(FinishProblem::MissingChoices);
            }
            // Fewer output tokens than this on a length finish is an abort,
            // unless the client itself asked for so few.
            let floor = self
                .finish_min_length_tokens
                .min(self.client_max_tokens.unwrap_or(u64::MAX));
            for (index, reason) in facts.finish_reasons.iter().enumerate() {
                match reason.as_deref() {
                    None | Some("") => problems.push(FinishProblem::NoFinishReason(index as u32)),
                    Some("length") if completion_tokens.is_some_and(|tokens| tokens < floor) => {
                        problems.push(FinishProblem::LengthWithoutOutput(index as u32));
                    }
                    Some(_) => {}
                }
            }
            if facts.done_marker == Some(false) {
                problems.push(FinishProblem::NoDoneMarker);
            }
        }
        CheckResult {
            check: Check::Finish,
            status: if problems.is_empty() {
                Status::Pass
            } else {
                Status::Fail
            },
            reason: problems.first().map(|problem| format!("{problem:?}")),
            evidence: evidence(problems),
        }
    }
}

/// Foreign canaries and lookalikes seen so far.
#[derive(Debug, Default)]
struct Findings {
    foreign: u64,
    hits: Vec<ForeignHit>,
    lookalikes: u64,
    /// Spans the shared registry could not resolve.
    unresolved: u64,
    /// Unresolved spans fail the check (the policy fails closed).
    unresolved_fail: bool,
    /// The shared registry could not be asked at some point.
    registry_degraded: bool,
}

impl Findings {
    /// Counts a canary of another request, owned by `owner`, found in
    /// choice `choice`.
    fn record_foreign(&mut self, choice: u32, owner: Registration) {
        self.foreign += 1;
        if self.hits.len() < MAX_FOREIGN_EVIDENCE {
            self.hits.push(ForeignHit {
                choice,
                session: owner.session,
                request: owner.request,
            });
        }
    }
}

/// Whose a canary-shaped span is.
enum SpanOwner {
    /// This request's, or an earlier turn's of a kept conversation.
    Own,
    /// Another request's.
    Foreign(Registration),
    /// No live canary's (a look-alike).
    Nobody,
}

/// Whose `canary` is, for a request owning `own` in `own_session` (the
/// registry asked only when it is not this request's).
fn owner_of(
    canary: Canary,
    (own, own_session): (&[Canary; 2], Option<&str>),
    registry: &dyn CanaryRegistry,
) -> SpanOwner {
    if own.contains(&canary) {
        return SpanOwner::Own;
    }
    match registry.owner(&canary) {
        Some(owner) if own_session == Some(owner.session.as_str()) => SpanOwner::Own,
        Some(owner) => SpanOwner::Foreign(owner),
        None => SpanOwner::Nobody,
    }
}

/// Moves the decided part of the track's pending text to `ready`, without
/// own canaries (the request's, and any of `own_session`'s; recorded as
/// removed spans); keeps pending a suffix that may still grow into a canary
/// (nothing when `end`). Returns true when a foreign canary was found.
fn scan(
    track: &mut Track,
    end: bool,
    (own, own_session): (&[Canary; 2], Option<&str>),
    registry: &dyn CanaryRegistry,
    choice: u32,
    findings: &mut Findings,
) -> bool {
    // Read where it is: `pending` keeps its buffer for the next delta.
    let Track {
        pending,
        ready,
        removed,
        decided,
        quoted,
        ..
    } = track;
    let text = pending.as_str();
    let bytes = text.as_bytes();
    let mut foreign = false;
    let mut copied = 0;
    let mut held = bytes.len();
    let mut starts = Starts::new(bytes);
    while let Some(start) = starts.next() {
        match match_at(bytes, start) {
            Shape::Partial { .. } if !end => {
                held = start;
                break;
            }
            // The reply ended inside one of this request's canaries (cut at
            // its limit while quoting it): the digits it got to are
            // canarygate's, and go.
            Shape::Partial { digits, value }
                if digits > 0 && own.iter().any(|canary| canary.starts_with(digits, value)) =>
            {
                ready.push_str(&text[copied..start]);
                removed.push(*decided + start..*decided + text.len());
                copied = text.len();
                break;
            }
            Shape::Partial { .. } | Shape::NoMatch => {}
            Shape::Complete { canary, end: stop } => {
                match owner_of(canary, (own, own_session), registry) {
                    SpanOwner::Own => {
                        for (quoted, own) in quoted.iter_mut().zip(own) {
                            *quoted |= *own == canary;
                        }
                        let span = match quoted_block(text, copied, start..stop, end) {
                            Quoted::Block(span) => span,
                            Quoted::Undecided(from) => {
                                held = from;
                                break;
                            }
                            Quoted::Canary => start..stop,
                        };
                        ready.push_str(&text[copied..span.start]);
                        removed.push(*decided + span.start..*decided + span.end);
                        copied = span.end;
                        starts.skip_to(span.end);
                    }
                    SpanOwner::Foreign(owner) => {
                        foreign = true;
                        findings.record_foreign(choice, owner);
                        starts.skip_to(stop);
                    }
                    SpanOwner::Nobody => findings.lookalikes += 1,
                }
            }
        }
    }
    if !end {
        // A block of ours may be opening before what is held (or at the
        // end): its wording goes with its canary, so it waits too.
        held -= opening_block(&text[copied..held]);
    }
    ready.push_str(&text[copied..held]);
    pending.drain(..held);
    *decided += held;
    foreign
}

/// `text` without what canarygate put there, read back from where a
/// provider kept it: the text left once [`own_text_removals`] are taken
/// out. `None` when nothing is.
pub fn without_own_text(
    text: &str,
    ours: &dyn Fn(Canary) -> bool,
    opens_reply: bool,
) -> Option<String> {
    let removals = own_text_removals(text, ours, opens_reply);
    if removals.is_empty() {
        return None;
    }
    let mut kept = String::with_capacity(text.len());
    let mut copied = 0;
    for removed in removals {
        kept.push_str(&text[copied..removed.start]);
        copied = removed.end;
    }
    kept.push_str(&text[copied..]);
    Some(kept)
}

/// What canarygate put in `text`, as the provider kept it (a stored
/// response fetched again), for the canaries `ours` says are the caller's
/// own (registered to its session): each block of ours whole (its wording
/// and the separator before it); when `text` opens a reply (`opens_reply`),
/// the echo it opened with, as an answer's echo is matched (its preamble,
/// the canaries, the closing and spacing after them); then any other own
/// canary. Canary-shaped text that is not the caller's stays. Byte ranges
/// of `text`, in order and apart; linear in `text`.
pub fn own_text_removals(
    text: &str,
    ours: &dyn Fn(Canary) -> bool,
    opens_reply: bool,
) -> Vec<Range<usize>> {
    let own = |text: &str| {
        find_canaries(text)
            .filter(|span| ours(span.canary))
            .collect::<Vec<_>>()
    };
    let spans = own(text);
    if spans.is_empty() {
        return Vec::new();
    }
    // Blocks first: an instruction's wording would pass for an echo's
    // preamble.
    let mut blocks = Vec::new();
    let mut unblocked = String::new();
    let mut copied = 0;
    for span in &spans {
        if span.start < copied {
            continue;
        }
        let (before, after) = (&text[copied..span.start], &text[span.end..]);
        let Some((open, close)) = BLOCK_WORDINGS
            .iter()
            .find(|(open, close)| before.ends_with(open) && after.starts_with(close))
        else {
            continue;
        };
        let mut from = span.start - open.len();
        if text[copied..from].ends_with(BLOCK_SEPARATOR) {
            from -= BLOCK_SEPARATOR.len();
        }
        unblocked.push_str(&text[copied..from]);
        copied = span.end + close.len();
        blocks.push(from..copied);
    }
    // The rest is read in the text without the blocks (`text` itself when
    // there were none), its positions taken back to `text` past the blocks
    // before them.
    let (unblocked, spans) = if blocks.is_empty() {
        (text, spans)
    } else {
        unblocked.push_str(&text[copied..]);
        let spans = own(&unblocked);
        (unblocked.as_str(), spans)
    };
    let mut original = Unremoved::new(&blocks);
    let mut removals = blocks.clone();
    // The echo: the reply's first own canaries, as the answer's echo is
    // matched (head and tail, or the head alone).
    let echoed: Vec<Canary> = spans.iter().take(2).map(|span| span.canary).collect();
    let opening = [&echoed[..], &echoed[..echoed.len().min(1)]]
        .into_iter()
        .filter(|expected| opens_reply && !expected.is_empty())
        .find_map(|expected| match match_echo(unblocked, expected, true) {
            EchoMatch::Passed(end) => Some(end),
            _ => None,
        })
        .unwrap_or(0);
    if opening > 0 {
        removals.push(0..original.at(opening));
    }
    // Any other own canary: the span alone.
    let mut copied = opening;
    for span in spans.iter().filter(|span| span.start >= opening) {
        if span.start < copied {
            continue;
        }
        removals.push(original.at(span.start)..original.at(span.end));
        copied = span.end;
    }
    removals.sort_by_key(|range| range.start);
    let mut merged: Vec<Range<usize>> = Vec::with_capacity(removals.len());
    for range in removals {
        match merged.last_mut() {
            Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
            _ => merged.push(range),
        }
    }
    merged
}

/// Positions in a text with some ranges removed, taken back to the text
/// they were removed from; asked in order, so each asks only about the
/// ranges since the last.
struct Unremoved<'a> {
    removed: &'a [Range<usize>],
    /// Removed ranges already passed.
    passed: usize,
    /// Their bytes.
    shift: usize,
}

impl<'a> Unremoved<'a> {
    fn new(removed: &'a [Range<usize>]) -> Self {
        Self {
            removed,
            passed: 0,
            shift: 0,
        }
    }

    /// Where byte `at` of the shorter text is in the original: past every
    /// removed range that starts at or before it. `at` never decreases.
    fn at(&mut self, at: usize) -> usize {
        while let Some(range) = self.removed.get(self.passed)
            && range.start <= at + self.shift
        {
            self.shift += range.len();
            self.passed += 1;
        }
        at + self.shift
    }
}

/// What surrounds one of the request's own canaries, at `canary` in
/// `text` (whose bytes from `copied` are not yet decided).
enum Quoted {
    /// One of canarygate's blocks, quoted whole: this span of `text` goes.
    Block(Range<usize>),
    /// A block's wording may still follow: the text from this byte waits.
    Undecided(usize),
    /// The canary alone.
    Canary,
}

/// Whether the own canary at `canary` in `text` is one of canarygate's
/// blocks (an instruction, a tail block, a marker) quoted whole, as a model
/// that restates the prompt writes it ([`BLOCK_WORDINGS`]): the block's
/// wording is canarygate's too, and goes with it. Only wording not yet
/// decided (from `copied`) is read; until the stream's `end`, a block whose
/// closing wording may still come waits for it.
fn quoted_block(text: &str, copied: usize, canary: Range<usize>, end: bool) -> Quoted {
    let before = &text[copied..canary.start];
    let after = &text[canary.end..];
    let mut undecided = None;
    for (open, close) in BLOCK_WORDINGS {
        if !before.ends_with(open) {
            continue;
        }
        let from = canary.start - open.len();
        if after.starts_with(close) {
            return Quoted::Block(from..canary.end + close.len());
        }
        if !end && close.starts_with(after) {
            undecided = Some(from);
        }
    }
    undecided.map_or(Quoted::Canary, Quoted::Undecided)
}

/// The length of the longest end of `text` that may open one of
/// canarygate's blocks ([`BLOCK_WORDINGS`]): a tail block's or a marker's
/// bracket, or the head instruction's opening ([`ECHO_PHRASE`]) or a start
/// of it. Held back until what follows says.
fn opening_block(text: &str) -> usize {
    let Some(&last) = text.as_bytes().last() else {
        return 0;
    };
    if matches!(last, b'(' | b'[') {
        return 1;
    }
    let phrase = ECHO_PHRASE.as_bytes();
    (1..=phrase.len())
        .rev()
        .find(|&len| phrase[len - 1] == last && text.as_bytes().ends_with(&phrase[..len]))
        .unwrap_or(0)
}

/// Fastest plausible prefill of `tokens` at `rate` tokens/s, in whole ms.
fn prefill_ms(tokens: u64, rate: f64) -> u64 {
    (tokens as f64 / rate * 1000.0).floor() as u64
}

fn ttft_evidence(
    ttft_ms: Option<u64>,
    min_plausible_ms: Option<u64>,
    prompt_tokens: u64,
    cached_tokens: Option<u64>,
) -> Evidence {
    Evidence::Ttft {
        ttft_ms,
        min_plausible_ms,
        prompt_tokens,
        cached_tokens,
    }
}

fn skipped(check: Check, reason: &str, evidence: Evidence) -> CheckResult {
    CheckResult {
        check,
        status: Status::Skip,
        reason: Some(reason.to_owned()),
        evidence,
    }
}

enum EchoMatch {
    /// Not decided yet: hold everything.
    Pending,
    /// The echo and the padding after it take this many bytes.
    Passed(usize),
    /// Refuted.
    Failed(EchoOutcome),
}

/// Characters closing an echo: quotes, brackets, emphasis and punctuation.
fn is_closing(c: char) -> bool {
    matches!(
        c,
        '"' | '\''
            | '`'
            | '*'
            | '_'
            | ')'
            | ']'
            | '}'
            | '>'
            | '.'
            | ','
            | ';'
            | ':'
            | '!'
            | '\u{201D}'
            | '\u{2019}'
            | '\u{BB}'
    )
}

/// The first canary-shaped span starting at most `window` characters after
/// byte `from` of `text`.
enum Next {
    /// This canary, from this byte to this byte.
    Found(Canary, usize, usize),
    /// None within the window.
    None,
    /// The text ends inside a span that may still grow into a canary.
    Incomplete,
    /// Not decided until more text arrives.
    Pending,
}

fn next_canary(text: &str, from: usize, window: usize, end: bool) -> Next {
    for (count, (offset, c)) in text[from..].char_indices().enumerate() {
        if count > window {
            return Next::None;
        }
        if starts_span(c) {
            match match_at(text.as_bytes(), from + offset) {
                Shape::Complete { canary, end: stop } => {
                    return Next::Found(canary, from + offset, stop);
                }
                Shape::Partial { .. } if end => return Next::Incomplete,
                Shape::Partial { .. } => return Next::Pending,
                Shape::NoMatch => {}
            }
        }
    }
    if end { Next::None } else { Next::Pending }
}

/// Matches the expected echo at the start of `text` (see [`ECHO_PREAMBLE_CHARS`]):
/// a preamble, the canaries in order with short gaps between them, then
/// closing characters, spaces or tabs, and at most two line breaks (with the
/// closing fence of a code block the preamble opened). Whatever follows is
/// the answer, untouched.
fn match_echo(text: &str, expected: &[Canary], end: bool) -> EchoMatch {
    let mut index = 0;
    let mut fenced = false;
    for (position, want) in expected.iter().enumerate() {
        let (window, lost) = if position == 0 {
            (ECHO_PREAMBLE_CHARS, EchoOutcome::Missing)
        } else {
            (ECHO_GAP_CHARS, EchoOutcome::TailMissing)
        };
        let canary = match next_canary(text, index, window, end) {
            Next::Found(canary, start, stop) => {
                if position == 0 {
                    fenced = text[..start].contains(FENCE);
                }
                index = stop;
                canary
            }
            Next::None => return EchoMatch::Failed(lost),
            Next::Incomplete => return EchoMatch::Failed(EchoOutcome::Incomplete),
            Next::Pending => return EchoMatch::Pending,
        };
        if canary == *want {
            continue;
        }
        return EchoMatch::Failed(if position == 0 && expected.get(1) == Some(&canary) {
            EchoOutcome::HeadMissing
        } else if position > 0 || expected.contains(&canary) {
            lost
        } else {
            EchoOutcome::WrongCanary
        });
    }
    // Closing characters, spaces, up to two line breaks. Each step needs to
    // see the character after it, so an unfinished tail waits for more text.
    let mut rest = text[index..].char_indices().peekable();
    let mut closing = 0;
    let mut breaks = 0;
    let mut spaced = false;
    loop {
        let Some(&(offset, c)) = rest.peek() else {
            return if end {
                EchoMatch::Passed(text.len())
            } else {
                EchoMatch::Pending
            };
        };
        let after = &text[index + offset..];
        if fenced && breaks > 0 && c == '`' {
            if after.starts_with(FENCE) {
                fenced = false;
                rest.nth(FENCE.len() - 1);
                continue;
            }
            if FENCE.starts_with(after) && !end {
                return EchoMatch::Pending;
            }
        }
        let take = if !spaced && closing < ECHO_CLOSING_CHARS && is_closing(c) {
            closing += 1;
            true
        } else if (c == ' ' || c == '\t') && breaks == 0 {
            spaced = true;
            true
        } else if (c == '\r' || c == '\n') && breaks < 2 {
            if c == '\n' {
                breaks += 1;
            }
            spaced = true;
            true
        } else {
            false
        };
        if !take || offset > ECHO_TRAILER_BYTES {
            return EchoMatch::Passed(index + offset);
        }
        rest.next();
    }
}
