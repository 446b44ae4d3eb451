//! Editing the provider's own answer: what of each text field the client
//! gets, whatever the wire format.
//!
//! The verifier sees each part of a choice (content, reasoning, arguments)
//! as one text, the concatenation of the fields that carried it; it reports
//! what the client may see as positions in that text
//! ([`Release`]: how far, and the spans it removed). A field that carried
//! bytes `span` of its part is shown as the bytes of `span` the release
//! keeps ([`kept`]), further cut where the client's token limit runs out
//! ([`Delivery::admit`]). The wire format applies the kept ranges to the
//! string and to whatever else follows the text (logprobs).
//!
//! Longer than 500 lines: over 100 of them are the unit tests, which hold
//! the kept ranges and the token limit to worked examples through private
//! helpers, and so live here.

use std::ops::Range;
use std::sync::Arc;

use canarygate_policies::tokens::{count_text_high, pieces_high};
use canarygate_policies::verify::{Part, Release};
use serde_json::Value;

use crate::wire::positions::KeptChars;

/// Counts completion tokens: with the provider's tokenizer when the policy
/// names one, else [`count_text_high`], an estimate meant to count at least
/// as many tokens as a BPE tokenizer, so a cut errs short.
#[derive(Clone, Default)]
pub struct TokenCounter {
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
}

impl TokenCounter {
    /// A counter using `tokenizer`, if any.
    pub fn new(tokenizer: Option<Arc<tokenizers::Tokenizer>>) -> Self {
        Self { tokenizer }
    }

    /// Tokens of `text`.
    pub fn count(&self, text: &str) -> u64 {
        match &self.tokenizer {
            Some(tokenizer) => match tokenizer.encode(text, false) {
                Ok(encoding) => encoding.get_ids().len() as u64,
                Err(_) => count_text_high(text),
            },
            None => count_text_high(text),
        }
    }

    /// The longest prefix of `text` of at most `limit` tokens, as a byte
    /// length (on a char boundary).
    pub fn prefix_within(&self, text: &str, limit: u64) -> usize {
        if let Some(tokenizer) = &self.tokenizer
            && let Ok(encoding) = tokenizer.encode(text, false)
        {
            let offsets = encoding.get_offsets();
            let limit = usize::try_from(limit).unwrap_or(usize::MAX);
            if offsets.len() <= limit {
                return text.len();
            }
            // Offsets are in bytes of `text`; the token `limit` starts the cut.
            let mut cut = offsets[limit].0.min(text.len());
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            return cut;
        }
        let mut used = 0;
        for (start, _, tokens) in pieces_high(text) {
            if used + tokens > limit {
                return start;
            }
            used += tokens;
        }
        text.len()
    }
}

/// The byte ranges of a field's text (local to the field) that survive
/// `removed`, for a field that carried bytes `span` of its part.
pub fn kept(span: Range<usize>, removed: &[Range<usize>]) -> Vec<Range<usize>> {
    kept_ranges(span, removed).collect()
}

/// [`kept`], one range at a time, nothing allocated.
fn kept_ranges(
    span: Range<usize>,
    removed: &[Range<usize>],
) -> impl Iterator<Item = Range<usize>> + '_ {
    let mut at = span.start;
    let mut cuts = removed.iter();
    let mut ended = false;
    std::iter::from_fn(move || {
        if ended {
            return None;
        }
        for cut in cuts.by_ref() {
            if cut.end <= at || cut.start >= span.end {
                continue;
            }
            let before = at;
            at = at.max(cut.end);
            if cut.start > before {
                return Some(before - span.start..cut.start - span.start);
            }
        }
        ended = true;
        (at < span.end).then(|| at - span.start..span.end - span.start)
    })
}

/// Whether a field of `len` bytes that carried bytes `span` of its part
/// survives `removed` whole: [`keeps_all`] of [`kept`], nothing allocated.
fn keeps_whole(span: Range<usize>, removed: &[Range<usize>], len: usize) -> bool {
    let mut ranges = kept_ranges(span, removed);
    len == 0 || (ranges.next() == Some(0..len) && ranges.next().is_none())
}

/// `text` with only `ranges` kept.
pub fn apply(text: &str, ranges: &[Range<usize>]) -> String {
    let mut shown = String::with_capacity(text.len());
    join_kept(&mut shown, text, ranges);
    shown
}

/// [`apply`] into `into` (cleared first), for a caller that reuses it.
fn join_kept<'s>(into: &'s mut String, text: &str, ranges: &[Range<usize>]) -> &'s str {
    into.clear();
    for range in ranges {
        into.push_str(&text[range.clone()]);
    }
    into
}

/// Whether `ranges` keep all of a text of `len` bytes.
pub fn keeps_all(ranges: &[Range<usize>], len: usize) -> bool {
    len == 0 || matches!(ranges, [only] if *only == (0..len))
}

/// What one field becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldEdit {
    /// Byte ranges of the field's text the client gets.
    pub kept: Vec<Range<usize>>,
    /// The field's text length as received.
    pub len: usize,
}

impl FieldEdit {
    /// Whether the field passes unchanged.
    pub fn unchanged(&self) -> bool {
        keeps_all(&self.kept, self.len)
    }
}

/// How an answer's `usage` reaches the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageOptions {
    /// The client asked for a stream's usage itself (canarygate always does).
    pub client_wants_usage: bool,
    /// Report usage as the client would have seen it without canarygate
    /// (canarygate's own tokens taken out) instead of the provider's billed
    /// numbers.
    pub without_canarygate: bool,
    /// Prompt tokens canarygate added (its estimate).
    pub overhead_prompt: u64,
}

/// The client-facing side of one answer's delivery: each choice's token
/// budget (the client's `max_tokens`, when canarygate raised the provider's
/// limit to make room for the echo), canarygate's own completion tokens
/// (the echo and canaries removed, the tokens cut), and how usage is
/// reported.
#[derive(Clone)]
pub struct Delivery {
    counter: TokenCounter,
    /// Tokens each choice may deliver; `None`: no limit of ours.
    limit: Option<u64>,
    used: Vec<u64>,
    cut: Vec<bool>,
    overhead_completion: u64,
    usage: UsageOptions,
    /// Choices the request asked for: text of any other choice is dropped.
    choices: u32,
    /// Which characters of each choice's content reached the client, for
    /// the positions annotations point at ([`Delivery::content_positions`]);
    /// kept only for a format that has them
    /// ([`Delivery::follow_content_positions`]).
    content_chars: Vec<KeptChars>,
    follows_positions: bool,
    /// The provider counted the whole answer within the client's limit
    /// ([`Delivery::fits_the_limit`]): no estimate cuts it.
    fits: bool,
    /// Reasoning is neither cut nor counted against the limit
    /// ([`Delivery::keep_reasoning_whole`]).
    reasoning_whole: bool,
    /// Characters canarygate appended to each choice's prompt
    /// ([`Delivery::prompt_chars_appended`]).
    prompt_chars_appended: Vec<usize>,
    /// Request fields the answer repeats, as the client sent them
    /// ([`Delivery::repeated_fields`]).
    repeated_fields: Vec<(String, Value)>,
    /// Reused for the text whose tokens are counted (removed or shown).
    scratch: String,
}

impl Delivery {
    /// A delivery of `choices` choices, cutting each at `limit` tokens
    /// (counted by `counter`), reporting usage per `usage`.
    pub fn new(
        counter: TokenCounter,
        limit: Option<u64>,
        usage: UsageOptions,
        choices: u32,
    ) -> Self {
        Self {
            counter,
            limit,
            used: Vec::new(),
            cut: Vec::new(),
            overhead_completion: 0,
            usage,
            choices,
            content_chars: Vec::new(),
            follows_positions: false,
            fits: false,
            reasoning_whole: false,
            prompt_chars_appended: Vec::new(),
            repeated_fields: Vec::new(),
            scratch: String::new(),
        }
    }

    /// Takes the characters canarygate appended to the prompt each choice
    /// continues, by choice index, for a format whose answers count
    /// positions from the prompt's start (legacy completions'
    /// `text_offset`).
    pub fn with_prompt_chars_appended(mut self, chars: Vec<usize>) -> Self {
        self.prompt_chars_appended = chars;
        self
    }

    /// Takes the request fields canarygate changed that the answer repeats,
    /// as the client sent them ([`Injection::repeated_fields`]).
    ///
    /// [`Injection::repeated_fields`]: canarygate_policies::inject::Injection::repeated_fields
    pub fn with_repeated_fields(mut self, fields: Vec<(String, Value)>) -> Self {
        self.repeated_fields = fields;
        self
    }

    /// The request fields the answer repeats, as the client sent them:
    /// what the answer's copies of them are set back to.
    pub fn repeated_fields(&self) -> &[(String, Value)] {
        &self.repeated_fields
    }

    /// Characters canarygate appended to the prompt choice `choice`
    /// continues: positions counted from the prompt's start move back by
    /// as many.
    pub fn prompt_chars_appended(&self, choice: u32) -> usize {
        self.prompt_chars_appended
            .get(choice as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Never cuts reasoning, nor counts it against the client's limit: for
    /// signed reasoning (Anthropic's `thinking`), which a cut would break,
    /// and which the provider itself keeps below the limit.
    pub fn keep_reasoning_whole(&mut self) {
        self.reasoning_whole = true;
    }

    /// Takes the provider's count of a whole answer's output tokens
    /// (`completion_tokens`, every choice's, the echo's included) and the
    /// fewest of them the echoes took (`echo_tokens`, none when the echo
    /// was not written): when the rest is within the client's limit,
    /// nothing of the answer is cut, whatever the estimate counts (it counts
    /// high, as a cut must; an answer that fits, or a long reasoning, counted
    /// high would lose text).
    pub fn fits_the_limit(&mut self, completion_tokens: Option<u64>, echo_tokens: u64) {
        if let (Some(limit), Some(tokens)) = (self.limit, completion_tokens) {
            self.fits = tokens.saturating_sub(echo_tokens) <= limit;
        }
    }

    /// Keeps which characters of each choice's content reach the client
    /// ([`Delivery::content_positions`]), for a format whose answers point
    /// into their content (Chat's annotations); others do not pay for it.
    pub fn follow_content_positions(&mut self) {
        self.follows_positions = true;
    }

    /// Which characters of choice `choice`'s content, as the provider wrote
    /// it, reached the client so far; `None` unless they are followed.
    pub fn content_positions(&self, choice: u32) -> Option<&KeptChars> {
        self.content_chars.get(choice as usize)
    }

    /// Whether the client asked for a stream's usage itself.
    pub fn client_wants_usage(&self) -> bool {
        self.usage.client_wants_usage
    }

    /// Whether usage is reported without canarygate's tokens: an edit of
    /// the provider's `usage` ([`Self::report_usage`]).
    pub fn rewrites_usage(&self) -> bool {
        self.usage.without_canarygate
    }

    /// Prompt tokens canarygate added (its estimate).
    pub fn overhead_prompt(&self) -> u64 {
        self.usage.overhead_prompt
    }

    /// `x-canarygate-overhead-tokens`: `prompt=41, completion=12`.
    pub fn overhead_header(&self) -> String {
        format!(
            "prompt={}, completion={}",
            self.usage.overhead_prompt, self.overhead_completion
        )
    }

    /// Rewrites a provider's `usage` object (OpenAI's or Anthropic's shape)
    /// as the client would have seen it without canarygate, when the policy
    /// says so; returns whether it changed.
    pub fn report_usage(&self, usage: &mut Value) -> bool {
        if !self.usage.without_canarygate {
            return false;
        }
        let mut changed = false;
        let mut less = |key: &str, by: u64| {
            if let Some(number) = usage.get(key).and_then(Value::as_u64) {
                usage[key] = Value::from(number.saturating_sub(by));
                changed = true;
            }
        };
        less("prompt_tokens", self.usage.overhead_prompt);
        less("completion_tokens", self.overhead_completion);
        less("input_tokens", self.usage.overhead_prompt);
        less("output_tokens", self.overhead_completion);
        if let (Some(prompt), Some(completion)) = (
            usage.get("prompt_tokens").and_then(Value::as_u64),
            usage.get("completion_tokens").and_then(Value::as_u64),
        ) && usage.get("total_tokens").is_some()
        {
            usage["total_tokens"] = Value::from(prompt + completion);
        }
        changed
    }

    /// What field `text` of `part` of choice `choice`, which carried bytes
    /// `span` of its part, becomes under `release` (which must cover `span`)
    /// and the choice's budget.
    pub fn admit(
        &mut self,
        choice: u32,
        part: Part,
        text: &str,
        span: Range<usize>,
        release: Release<'_>,
    ) -> FieldEdit {
        if choice >= self.choices {
            // A choice nobody asked for (it fails the finish check): its text
            // never reaches the client, whatever the policy.
            return FieldEdit {
                kept: Vec::new(),
                len: text.len(),
            };
        }
        let index = choice as usize;
        self.track(index);
        let mut ranges = kept(span, release.removed);
        let removed_len = text.len() - ranges.iter().map(Range::len).sum::<usize>();
        // Withheld reasoning is the model's, billed as the client would
        // have been billed without canarygate: not canarygate's overhead.
        if removed_len > 0 && is_generated_once(part) && !release.withheld {
            let removed = join_removed(&mut self.scratch, text, &ranges);
            self.overhead_completion += self.counter.count(removed);
        }
        if let Some(limit) = self.limit_of(part) {
            if self.cut[index] {
                let shown = join_kept(&mut self.scratch, text, &ranges);
                self.overhead_completion += self.counter.count(shown);
                ranges.clear();
            } else {
                ranges = self.within_budget(index, limit, text, ranges);
            }
        }
        if self.follows_positions && part == Part::Content {
            self.content_chars[index].push(text, &ranges);
        }
        FieldEdit {
            kept: ranges,
            len: text.len(),
        }
    }

    /// Whether [`Delivery::admit`] would cut field `text` of `part` of
    /// choice `choice` (which carried bytes `span`) at the client's limit
    /// now, by the count as it goes; nothing is accounted for. A stream may
    /// hold such text until the provider's own count at its end says
    /// whether the answer fits ([`Delivery::fits_the_limit`]).
    pub fn would_cut<'r>(
        &mut self,
        choice: u32,
        part: Part,
        text: &str,
        span: Range<usize>,
        release: impl FnOnce() -> Release<'r>,
    ) -> bool {
        let Some(limit) = self.limit_of(part).filter(|_| choice < self.choices) else {
            return false;
        };
        let index = choice as usize;
        self.track(index);
        if self.cut[index] {
            return true;
        }
        let left = limit.saturating_sub(self.used[index]);
        // No count gives a text more tokens than bytes: far from the limit,
        // nothing to count.
        if text.len() as u64 <= left {
            return false;
        }
        let release = release();
        if keeps_whole(span.clone(), release.removed, text.len()) {
            return self.counter.count(text) > left;
        }
        let ranges = kept(span, release.removed);
        let shown = join_kept(&mut self.scratch, text, &ranges);
        self.counter.count(shown) > left
    }

    /// [`Delivery::admit`] for a field expected to pass whole: when `admit`
    /// would leave it unchanged, accounts for it as `admit` does and returns
    /// true; otherwise changes nothing and returns false (the caller then
    /// edits the field through `admit`).
    pub fn admit_whole(
        &mut self,
        choice: u32,
        part: Part,
        text: &str,
        span: Range<usize>,
        release: Release<'_>,
    ) -> bool {
        if choice >= self.choices || !keeps_whole(span, release.removed, text.len()) {
            return false;
        }
        let index = choice as usize;
        self.track(index);
        if let Some(limit) = self.limit_of(part) {
            if self.cut[index] {
                return false;
            }
            let tokens = self.counter.count(text);
            if tokens > limit.saturating_sub(self.used[index]) {
                return false;
            }
            self.used[index] += tokens;
        }
        if self.follows_positions && part == Part::Content {
            self.content_chars[index].push_whole(text);
        }
        true
    }

    /// The client's token limit on `part`, when it has one (the text parts
    /// count; call arguments never are cut).
    fn limit_of(&self, part: Part) -> Option<u64> {
        let budgeted = match part {
            Part::Content | Part::Refusal => true,
            Part::Reasoning => !self.reasoning_whole,
            _ => false,
        };
        self.limit.filter(|_| budgeted && !self.fits)
    }

    /// Makes room for choice `index` in the budget counters.
    fn track(&mut self, index: usize) {
        if self.used.len() <= index {
            self.used.resize(index + 1, 0);
            self.cut.resize(index + 1, false);
            self.content_chars
                .resize_with(index + 1, KeptChars::default);
        }
    }

    /// Trims `ranges` of `text` to what choice `index`'s budget allows.
    fn within_budget(
        &mut self,
        index: usize,
        limit: u64,
        text: &str,
        ranges: Vec<Range<usize>>,
    ) -> Vec<Range<usize>> {
        let shown = join_kept(&mut self.scratch, text, &ranges);
        let tokens = self.counter.count(shown);
        let left = limit.saturating_sub(self.used[index]);
        if tokens <= left {
            self.used[index] += tokens;
            return ranges;
        }
        // Over the limit: keep the prefix of the shown text that fits.
        let keep = self.counter.prefix_within(shown, left);
        self.used[index] = limit;
        self.cut[index] = true;
        self.overhead_completion += self.counter.count(&shown[keep..]);
        let mut trimmed = Vec::new();
        let mut budget = keep;
        for range in ranges {
            if budget == 0 {
                break;
            }
            let take = range.len().min(budget);
            trimmed.push(range.start..range.start + take);
            budget -= take;
        }
        trimmed
    }

    /// Whether choice `choice` was cut at the client's limit (its finish
    /// reason becomes `length`).
    pub fn was_cut(&self, choice: u32) -> bool {
        self.cut.get(choice as usize).copied().unwrap_or(false)
    }

    /// Completion tokens the client did not get: the echo and canaries
    /// removed and the tokens cut at its limit.
    pub fn overhead_completion(&self) -> u64 {
        self.overhead_completion
    }
}

/// Whether text removed from `part` is completion tokens the provider
/// billed once: the text a model generated (content, reasoning, refusals,
/// call arguments), not a copy of it (reasoning under a second name,
/// OpenRouter's details, a spoken reply's transcript) or of the request (the
/// instructions a response repeats), nor a string of another field.
fn is_generated_once(part: Part) -> bool {
    matches!(
        part,
        Part::Content
            | Part::Reasoning
            | Part::Refusal
            | Part::ToolArguments(_)
            | Part::FunctionArguments
    )
}

/// The bytes of `text` outside `ranges`, into `into` (cleared first).
fn join_removed<'s>(into: &'s mut String, text: &str, ranges: &[Range<usize>]) -> &'s str {
    into.clear();
    let mut at = 0;
    for range in ranges {
        into.push_str(&text[at..range.start]);
        at = range.end;
    }
    into.push_str(&text[at..]);
    into
}

#[cfg(test)]
#[allow(
    clippy::single_range_in_vec_init,
    reason = "lists of byte ranges that happen to hold one range"
)]
mod tests {
    use super::*;

    /// Usage as the client asked for it, `without_canarygate` or not, with
    /// `overhead_prompt` prompt tokens of canarygate's.
    fn usage(without_canarygate: bool, overhead_prompt: u64) -> UsageOptions {
        UsageOptions {
            client_wants_usage: true,
            without_canarygate,
            overhead_prompt,
        }
    }

    /// Everything released, but the `removed` spans.
    fn released(removed: &[Range<usize>]) -> Release<'_> {
        Release {
            through: usize::MAX,
            removed,
            withheld: false,
        }
    }

    #[test]
    fn kept_ranges_are_local_to_the_field() {
        // The part: "[CG1] Hello" with the echo `[CG1] ` removed (0..6).
        let removed = [0..6];
        assert_eq!(kept(0..3, &removed), Vec::<Range<usize>>::new());
        assert_eq!(kept(3..8, &removed), [3..5]);
        assert_eq!(kept(8..11, &removed), [0..3]);
        assert_eq!(kept(2..11, &[4..6, 8..9]), [0..2, 4..6, 7..9]);
        assert!(keeps_all(&kept(20..25, &removed), 5));
    }

    #[test]
    fn the_whole_field_check_agrees_with_the_kept_ranges() {
        // Every span and every pair of cuts (empty ones too) within 0..6.
        let ranges: Vec<Range<usize>> = (0..=6)
            .flat_map(|start| (start..=6).map(move |end| start..end))
            .collect();
        for span in &ranges {
            for first in &ranges {
                for second in ranges.iter().filter(|second| second.start >= first.start) {
                    let removed = [first.clone(), second.clone()];
                    let len = span.len();
                    assert_eq!(
                        keeps_whole(span.clone(), &removed, len),
                        keeps_all(&kept(span.clone(), &removed), len),
                        "{span:?} less {removed:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_choice_is_cut_at_its_limit_and_the_rest_dropped() {
        let usage = usage(true, 40);
        let mut delivery = Delivery::new(TokenCounter::default(), Some(3), usage, 2);
        let release = released(&[]);
        // Words of up to four letters: one token each by the estimate.
        let text = "one two six ten";
        let edit = delivery.admit(0, Part::Content, text, 0..text.len(), release);
        assert_eq!(apply(text, &edit.kept), "one two six ");
        assert!(delivery.was_cut(0));
        let later = delivery.admit(0, Part::Content, " five", 15..20, release);
        assert!(later.kept.is_empty());
        assert!(!delivery.was_cut(1));
        assert!(delivery.overhead_completion() >= 2);
        // Arguments are never cut.
        let arguments = delivery.admit(0, Part::ToolArguments(0), "{}", 0..2, release);
        assert!(arguments.unchanged());
        // A choice nobody asked for shows nothing.
        let stray = delivery.admit(u32::MAX, Part::Content, "CG1", 0..3, release);
        assert!(stray.kept.is_empty());

        let mut usage = serde_json::json!({"prompt_tokens": 100, "completion_tokens": 10,
                                           "total_tokens": 110});
        assert!(delivery.report_usage(&mut usage));
        let overhead = delivery.overhead_completion();
        assert_eq!(usage["prompt_tokens"], 60);
        assert_eq!(usage["completion_tokens"], 10 - overhead);
        assert_eq!(usage["total_tokens"], 60 + 10 - overhead);
        assert_eq!(
            delivery.overhead_header(),
            format!("prompt=40, completion={overhead}")
        );
    }

    /// Only text a model generated, once, counts as canarygate's completion
    /// tokens: not a copy of it under another name, nor the request's
    /// instructions a response repeats.
    #[test]
    fn removed_copies_are_not_counted_as_completion_tokens() {
        let usage = usage(true, 0);
        let mut delivery = Delivery::new(TokenCounter::default(), None, usage, 1);
        let text = "I begin with CG123456789012345 now";
        let release = released(&[13..30]);
        for part in [
            Part::ReasoningAlias,
            Part::ReasoningDetail(0),
            Part::Transcript,
            Part::Other(0),
        ] {
            let edit = delivery.admit(0, part, text, 0..text.len(), release);
            assert_eq!(apply(text, &edit.kept), "I begin with  now", "{part:?}");
            assert_eq!(delivery.overhead_completion(), 0, "{part:?}");
        }
        // Reasoning withheld whole is the model's, billed as without
        // canarygate: not counted either.
        let whole = [0..text.len()];
        let withheld = Release {
            withheld: true,
            ..released(&whole)
        };
        let edit = delivery.admit(0, Part::Reasoning, text, 0..text.len(), withheld);
        assert!(edit.kept.is_empty());
        assert_eq!(delivery.overhead_completion(), 0);
        delivery.admit(0, Part::Reasoning, text, 0..text.len(), release);
        assert!(delivery.overhead_completion() > 0);
    }

    /// `would_cut` says what `admit` would do, and accounts for nothing.
    #[test]
    fn would_cut_foresees_admit_and_counts_nothing() {
        let usage = usage(false, 0);
        let release = released(&[]);
        // Words of up to four letters: one token each by the estimate.
        let mut delivery = Delivery::new(TokenCounter::default(), Some(3), usage, 1);
        assert!(!delivery.would_cut(0, Part::Content, "one two", 0..7, || release));
        assert!(delivery.would_cut(0, Part::Content, "one two six ten", 0..15, || release));
        // Nothing was counted: the first two words still fit.
        assert!(
            delivery
                .admit(0, Part::Content, "one two", 0..7, release)
                .unchanged()
        );
        assert!(delivery.would_cut(0, Part::Content, " six ten", 7..15, || release));
        assert!(!delivery.would_cut(
            0,
            Part::ToolArguments(0),
            "{\"a\": 1, \"b\": 2}",
            0..16,
            || release
        ));
    }

    #[test]
    fn a_whole_answer_the_provider_counts_within_the_limit_is_not_cut() {
        let usage = usage(false, 0);
        let release = released(&[]);
        // Reasoning the estimate counts high: 8 "tokens" against a limit of 5.
        let thinking = "aaaaa bbbbb ccccc ddddd";
        let answer = "Yes.";
        // The provider's count holds the echo's tokens: 12 at least for two
        // canaries in OpenAI's tokenizers.
        for (provider_count, echo, cut) in [
            (Some(5), 0, false),
            (Some(6), 0, true),
            (None, 0, true),
            (Some(17), 12, false),
            (Some(18), 12, true),
        ] {
            let mut delivery = Delivery::new(TokenCounter::default(), Some(5), usage, 1);
            delivery.fits_the_limit(provider_count, echo);
            let reasoning = delivery.admit(0, Part::Reasoning, thinking, 0..23, release);
            let content = delivery.admit(0, Part::Content, answer, 0..4, release);
            assert_eq!(
                !(reasoning.unchanged() && content.unchanged()),
                cut,
                "{provider_count:?}"
            );
            assert_eq!(delivery.was_cut(0), cut, "{provider_count:?}");
        }
    }

    #[test]
    fn admit_whole_passes_only_what_admit_leaves_unchanged_and_counts_it_alike() {
        let usage = usage(true, 0);
        let fresh = || Delivery::new(TokenCounter::default(), Some(3), usage, 1);
        let all = released(&[]);
        let (mut whole, mut edited) = (fresh(), fresh());
        // Within the budget: both pass it and count the same tokens, so
        // the next field is cut at the same place by either.
        assert!(whole.admit_whole(0, Part::Content, "one two", 0..7, all));
        assert!(
            edited
                .admit(0, Part::Content, "one two", 0..7, all)
                .unchanged()
        );
        let after_whole = whole.admit(0, Part::Content, " six ten", 7..15, all);
        let after_edit = edited.admit(0, Part::Content, " six ten", 7..15, all);
        assert_eq!(after_whole, after_edit);
        assert!(!after_whole.unchanged());
        // Past the budget, after a cut, with the echo removed, or for a
        // choice nobody asked for: not whole, and nothing is counted.
        let mut delivery = fresh();
        assert!(!delivery.admit_whole(0, Part::Content, "one two six ten", 0..15, all));
        assert!(!delivery.was_cut(0));
        assert!(delivery.admit_whole(0, Part::Content, "one two six", 0..11, all));
        assert!(!whole.admit_whole(0, Part::Content, "more", 15..19, all));
        let echo = released(&[0..6]);
        assert!(!fresh().admit_whole(0, Part::Content, "[CG1] Hi", 0..8, echo));
        assert!(!fresh().admit_whole(1, Part::Content, "Hi", 0..2, all));
        assert_eq!(fresh().overhead_completion(), 0);
    }
}
