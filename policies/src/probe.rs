//! Context probing: what a provider really serves, measured with needles.
//!
//! A probe sends prompts of growing length (doubling, then a binary search
//! between the last good and the first bad length, up to the advertised
//! window). Each prompt hides fresh needles (`PROBE-` and 15 digits) at
//! several depths of filler text and asks for all of them back; the request
//! also carries the usual canaries and echo. A length is good when every
//! needle comes back, the echo passes and `usage.prompt_tokens` matches our
//! count. Finally one prompt just over the advertised window must get a clean
//! 4xx: a 200 there means the provider silently serves what it cannot hold.
//!
//! This module is the pure part: needles, prompt text, the length search and
//! the result. Sending requests is the caller's job.

use serde::{Deserialize, Serialize};

use crate::canary::Canary;
use crate::echo_cost::ECHO_TOKEN_ALLOWANCE_MAX;
use crate::tokens::count_text;

/// Start of every needle.
pub const NEEDLE_PREFIX: &str = "PROBE-";

/// The instruction that asks for the needles back.
pub const RECALL_PHRASE: &str = "List every passphrase in the text above that starts with PROBE-";

/// Where needles sit in the filler, as fractions of its length.
pub const NEEDLE_DEPTHS: [f64; 3] = [0.1, 0.5, 0.9];

/// `max_tokens` of each probe request (echo and needles fit easily).
pub const PROBE_MAX_TOKENS: u64 = 96;

/// Completion tokens a probe request asks the provider for, at most: its
/// `max_tokens` plus the largest echo allowance injection adds.
pub const PROBE_COMPLETION_TOKENS: u64 = PROBE_MAX_TOKENS + ECHO_TOKEN_ALLOWANCE_MAX;

/// How far past the advertised window the over-window request goes, in tokens.
pub const OVER_WINDOW_TOKENS: u64 = 64;

/// First length tried, in prompt tokens (smaller windows start lower).
pub const FIRST_LENGTH_TOKENS: u64 = 1024;

/// One needle: a random passphrase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Needle(String);

impl Needle {
    /// A needle from 10 random bytes (use the OS CSPRNG).
    pub fn from_random(bytes: [u8; 10]) -> Self {
        let canary = Canary::from_random(bytes).to_string();
        // `CG` and 15 digits: keep the digits, not the canary prefix.
        Self(format!("{NEEDLE_PREFIX}{}", &canary[2..]))
    }

    /// Fresh needles from the OS CSPRNG.
    pub fn mint(count: usize) -> Result<Vec<Self>, getrandom::Error> {
        (0..count)
            .map(|_| {
                let mut bytes = [0; 10];
                getrandom::fill(&mut bytes)?;
                Ok(Self::from_random(bytes))
            })
            .collect()
    }

    /// The passphrase.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// User-message text of about `target_tokens` tokens (our estimate): filler
/// with `needles` at [`NEEDLE_DEPTHS`], then the recall instruction.
pub fn needle_text(target_tokens: u64, needles: &[Needle]) -> String {
    let instruction = format!("\n\n{RECALL_PHRASE}, in order, separated by spaces.");
    let fixed = count_text(&instruction)
        + needles
            .iter()
            .map(|needle| count_text(needle.as_str()))
            .sum::<u64>();
    let filler_tokens = target_tokens.saturating_sub(fixed);
    let mut places: Vec<u64> = NEEDLE_DEPTHS
        .iter()
        .take(needles.len())
        .map(|depth| (filler_tokens as f64 * depth) as u64)
        .collect();
    places.reverse();
    let mut needles = needles.iter();
    let mut text = String::with_capacity(filler_tokens as usize * 6);
    let mut written = 0;
    let mut words = Filler::default();
    while written < filler_tokens || !places.is_empty() {
        if places.last().is_some_and(|&at| written >= at) {
            places.pop();
            if let Some(needle) = needles.next() {
                text.push_str(" The passphrase is ");
                text.push_str(needle.as_str());
                text.push('.');
                written += 4;
                continue;
            }
        }
        let word = words.next_word();
        text.push(' ');
        text.push_str(word);
        written += count_text(word);
    }
    text.push_str(&instruction);
    text.trim_start().to_owned()
}

/// Needle-shaped passphrases in `text`, in order.
pub fn passphrases(text: &str) -> Vec<&str> {
    text.match_indices(NEEDLE_PREFIX)
        .map(|(start, _)| {
            let rest = &text[start..];
            let end = rest
                .char_indices()
                .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '-'))
                .map_or(rest.len(), |(end, _)| end);
            rest[..end].trim_end_matches('-')
        })
        .filter(|passphrase| passphrase.len() > NEEDLE_PREFIX.len())
        .collect()
}

/// How many of `needles` appear in `reply`.
pub fn recalled(reply: &str, needles: &[Needle]) -> usize {
    let found = passphrases(reply);
    needles
        .iter()
        .filter(|needle| found.contains(&needle.as_str()))
        .count()
}

/// Deterministic filler words (a pseudo-random walk over a small vocabulary).
#[derive(Debug)]
struct Filler(u64);

impl Default for Filler {
    fn default() -> Self {
        Self(0x9E37_79B9_7F4A_7C15)
    }
}

impl Filler {
    const WORDS: [&'static str; 32] = [
        "the",
        "survey",
        "recorded",
        "river",
        "levels",
        "across",
        "northern",
        "valleys",
        "during",
        "spring",
        "while",
        "engineers",
        "measured",
        "bridge",
        "loads",
        "and",
        "farmers",
        "planted",
        "barley",
        "near",
        "old",
        "stone",
        "walls",
        "under",
        "clear",
        "skies",
        "before",
        "autumn",
        "storms",
        "arrived",
        "quietly",
        "again",
    ];

    fn next_word(&mut self) -> &'static str {
        // xorshift64
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        Self::WORDS[(self.0 % Self::WORDS.len() as u64) as usize]
    }
}

/// The length search: doubling from a first length up to the largest prompt
/// the window allows, then bisection between the last good and the first bad
/// length until they are `resolution` tokens apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LengthSearch {
    first: u64,
    top: u64,
    resolution: u64,
    good: Option<u64>,
    bad: Option<u64>,
}

impl LengthSearch {
    /// A search for a window of `advertised` tokens, with requests allowing
    /// [`PROBE_COMPLETION_TOKENS`]; bisection stops at 1% of the window.
    pub fn for_window(advertised: u64) -> Self {
        let top = advertised.saturating_sub(PROBE_COMPLETION_TOKENS).max(1);
        Self {
            first: FIRST_LENGTH_TOKENS.min(top / 4).max(1).min(top),
            top,
            resolution: (advertised / 100).max(8),
            good: None,
            bad: None,
        }
    }

    /// The next prompt length to try, or `None` when the search is done.
    pub fn next(&self) -> Option<u64> {
        match (self.good, self.bad) {
            (Some(good), None) if good >= self.top => None,
            (good, None) => Some(good.map_or(self.first, |good| (good * 2).min(self.top))),
            (good, Some(bad)) => {
                let low = good.unwrap_or(0);
                (bad.saturating_sub(low) > self.resolution).then(|| low + (bad - low) / 2)
            }
        }
    }

    /// Records the outcome of a prompt of `length` tokens (as measured).
    pub fn record(&mut self, length: u64, ok: bool) {
        if ok {
            if self.bad.is_none_or(|bad| length < bad) {
                self.good = Some(self.good.map_or(length, |good| good.max(length)));
            }
        } else {
            self.bad = Some(self.bad.map_or(length, |bad| bad.min(length)));
            if self.good.is_some_and(|good| good >= length) {
                // A shorter prompt failed after a longer one passed: trust neither.
                self.good = None;
            }
        }
    }

    /// Longest length that passed.
    pub fn last_good(&self) -> Option<u64> {
        self.good
    }

    /// Shortest length that failed.
    pub fn first_bad(&self) -> Option<u64> {
        self.bad
    }

    /// Largest prompt tried (the window minus the completion allowance).
    pub fn top(&self) -> u64 {
        self.top
    }

    /// Upper bound on the prompt tokens of a whole probe, over-window request
    /// included: doubling up to the top, a full bisection, each request at
    /// most the window.
    pub fn cost_bound(&self) -> ProbeCost {
        let mut requests = 0u64;
        let mut tokens = 0u64;
        let mut length = self.first;
        loop {
            requests += 1;
            tokens += length;
            if length >= self.top {
                break;
            }
            length = (length * 2).min(self.top);
        }
        let mut span = self.top;
        while span > self.resolution {
            requests += 1;
            tokens += self.top;
            span /= 2;
        }
        requests += 1;
        tokens += self.top + OVER_WINDOW_TOKENS;
        ProbeCost {
            requests,
            prompt_tokens: tokens,
            completion_tokens: requests * PROBE_COMPLETION_TOKENS,
        }
    }
}

/// What a probe may spend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProbeCost {
    /// Requests sent.
    pub requests: u64,
    /// Prompt tokens, our count.
    pub prompt_tokens: u64,
    /// Completion tokens allowed.
    pub completion_tokens: u64,
}

/// One request of a probe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeStep {
    /// Prompt tokens, our count.
    pub prompt_tokens: u64,
    /// HTTP status of the answer (0: no answer).
    pub status: u16,
    /// Whether this length is served correctly.
    pub ok: bool,
    /// Needles hidden, and how many came back.
    pub needles: u32,
    /// Needles recalled.
    pub recalled: u32,
    /// `usage.prompt_tokens` the provider reported.
    pub prompt_tokens_reported: Option<u64>,
    /// Why the step failed.
    pub problem: Option<String>,
}

/// What a probe found, as stored in the data directory and printed by
/// `canarygate probe --json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeResult {
    /// Provider name in the policy.
    pub provider: String,
    /// Model probed (the name sent upstream).
    pub model: String,
    /// The window the policy says the provider advertises.
    pub advertised_window_tokens: u64,
    /// Largest context served correctly (prompt plus completion, our count).
    pub effective_limit_tokens: u64,
    /// Status of the request just over the advertised window (`None`: not sent).
    pub over_window_status: Option<u16>,
    /// The provider serves its whole advertised window correctly and refuses
    /// beyond it.
    pub trusted: bool,
    /// The search finished (not cut short by the token budget).
    pub complete: bool,
    /// Prompt tokens spent, our count.
    pub tokens_spent: u64,
    /// When the probe finished, milliseconds since the Unix epoch.
    pub probed_at_ms: u64,
    /// Every request, in order.
    pub steps: Vec<ProbeStep>,
}

/// Effective limit and trust from a finished (or budget-stopped) search.
///
/// The effective limit is the prompt of the last good request: whether a
/// failure came from the prompt or the completion cannot be told apart, so
/// the smaller figure is trusted. A provider that served the largest prompt
/// and refused the over-window one with a 4xx is trusted with its advertised
/// window; one that answered 200 past its window is trusted only up to its
/// last good length.
pub fn conclude(
    search: &LengthSearch,
    advertised: u64,
    over_window_status: Option<u16>,
    complete: bool,
) -> (u64, bool) {
    let good = search.last_good().unwrap_or(0);
    let refused_over_window = over_window_status.is_some_and(|s| (400..500).contains(&s));
    let whole_window =
        complete && search.first_bad().is_none() && search.last_good() >= Some(search.top());
    if whole_window && refused_over_window {
        (advertised, true)
    } else {
        (good.min(advertised), false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canary::CANARY_DIGITS;

    fn needles() -> Vec<Needle> {
        (0..3u8).map(|i| Needle::from_random([i; 10])).collect()
    }

    #[test]
    fn needle_text_hits_its_length_and_hides_every_needle() {
        let needles = needles();
        for target in [200, 1024, 5000] {
            let text = needle_text(target, &needles);
            let tokens = count_text(&text);
            assert!(
                tokens.abs_diff(target) <= 8,
                "target {target}, got {tokens}"
            );
            assert_eq!(recalled(&text, &needles), 3);
            let first = text.find(needles[0].as_str()).unwrap();
            let last = text.find(needles[2].as_str()).unwrap();
            assert!(first < text.len() / 4 && last > text.len() * 3 / 4);
            assert!(text.contains(RECALL_PHRASE));
        }
    }

    #[test]
    fn passphrases_are_found_whole() {
        let needle = Needle::from_random([1; 10]);
        let reply = format!("Sure: {}, and PROBE-. done", needle.as_str());
        assert_eq!(passphrases(&reply)[0], needle.as_str());
        assert_eq!(recalled(&reply, &[needle]), 1);
        assert!(needle_looks_right(Needle::from_random([2; 10]).as_str()));
    }

    fn needle_looks_right(needle: &str) -> bool {
        needle.len() == NEEDLE_PREFIX.len() + CANARY_DIGITS
            && needle.starts_with(NEEDLE_PREFIX)
            && needle[NEEDLE_PREFIX.len()..]
                .bytes()
                .all(|b| b.is_ascii_digit())
    }

    /// Runs a search against a provider that serves prompts up to `limit`.
    fn run(advertised: u64, limit: u64) -> LengthSearch {
        let mut search = LengthSearch::for_window(advertised);
        let mut steps = 0;
        while let Some(length) = search.next() {
            search.record(length, length <= limit);
            steps += 1;
            assert!(steps < 64, "the search does not converge");
        }
        search
    }

    #[test]
    fn search_finds_a_limit_within_its_resolution() {
        for (advertised, limit) in [(8192, 5322), (128_000, 81_000), (8192, 100), (4096, 4000)] {
            let search = run(advertised, limit);
            let good = search.last_good().unwrap_or(0);
            assert!(good <= limit, "{advertised}/{limit}: good {good}");
            assert!(
                limit - good <= advertised / 100 + 1,
                "{advertised}/{limit}: good {good}"
            );
            let cost = search.cost_bound();
            assert!(cost.prompt_tokens >= advertised);
        }
    }

    #[test]
    fn an_honest_window_is_confirmed_only_with_a_clean_refusal() {
        let search = run(8192, u64::MAX);
        assert_eq!(search.last_good(), Some(search.top()));
        assert_eq!(conclude(&search, 8192, Some(400), true), (8192, true));
        let (limit, trusted) = conclude(&search, 8192, Some(200), true);
        assert!(!trusted);
        assert_eq!(limit, search.top());
        assert!(!conclude(&search, 8192, Some(400), false).1);
    }

    #[test]
    fn a_leaky_provider_is_limited_to_its_last_good_length() {
        let search = run(8192, 5322);
        let (limit, trusted) = conclude(&search, 8192, Some(200), true);
        assert!(!trusted);
        assert!((5322 - 82..=5322).contains(&limit), "{limit}");
    }

    #[test]
    fn a_shorter_failure_after_a_longer_success_distrusts_both() {
        let mut search = LengthSearch::for_window(8192);
        search.record(4096, true);
        search.record(2048, false);
        assert_eq!(search.last_good(), None);
        assert_eq!(search.next(), Some(1024));
    }

    #[test]
    fn tiny_windows_terminate() {
        for advertised in [1, 50, 97, 200] {
            let search = run(advertised, u64::MAX);
            assert!(search.last_good().is_some());
        }
    }
}
