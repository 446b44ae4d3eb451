//! The simulated provider's prompt prefix cache.
//!
//! Real providers keep the KV entries of prompt prefixes they have computed
//! and reuse them when a later prompt starts with the same tokens: only the
//! rest is prefilled, the answer comes sooner, and the cached part is
//! reported in `usage.prompt_tokens_details.cached_tokens`. The rules this
//! cache follows, with their defaults ([`PrefixCacheConfig::default`]), are
//! OpenAI's:
//!
//! - caching starts at prompts of 1024 tokens, and a hit covers the longest
//!   matching prefix in increments of 128 tokens (1024, 1152, 1280, ...)
//!   (OpenAI, "Prompt caching" guide: "Caching is enabled automatically for
//!   prompts that are 1024 tokens or longer"; OpenAI Cookbook, "Prompt
//!   Caching 201": "cache hits occurring in increments of 128 tokens");
//! - an unused prefix is dropped after a few minutes (Azure OpenAI, "Prompt
//!   caching", in-memory retention: cleared within 5 to 10 minutes of
//!   inactivity, always within one hour): here after
//!   [`PrefixCacheConfig::idle_ttl`] unused, 5 minutes by default;
//! - the match is exact, token for token from the first, and per model.
//!
//! Block-aligned caches such as vLLM's and SGLang's paged prefix caches are
//! the same rule with the minimum and the increment both set to the block
//! size (`--cache-min-tokens 16 --cache-increment-tokens 16`).
//!
//! A cached prefix always leaves at least one prompt token to prefill: the
//! first output token is computed from the last prompt position.
//!
//! Memory is bounded: at most [`PrefixCacheConfig::capacity_tokens`] /
//! increment prefixes are remembered (one hash per prefix length); the least
//! recently used go first.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use crate::pool::Position;

/// Settings of the prompt prefix cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixCacheConfig {
    /// Shortest prefix cached, in tokens (0 is taken as 1).
    pub min_tokens: u64,
    /// Cached prefixes are `min_tokens` plus a multiple of this (0 is taken
    /// as 1).
    pub increment_tokens: u64,
    /// Prompt tokens the cache may hold: each prefix length it remembers
    /// stands for one increment of KV entries; the least recently used are
    /// dropped past it.
    pub capacity_tokens: u64,
    /// A prefix unused for this long is gone.
    pub idle_ttl: Duration,
}

impl Default for PrefixCacheConfig {
    /// OpenAI's rules (see the module docs); room for 16 Mi prompt tokens.
    fn default() -> Self {
        Self {
            min_tokens: 1024,
            increment_tokens: 128,
            capacity_tokens: 16 << 20,
            idle_ttl: Duration::from_secs(300),
        }
    }
}

impl PrefixCacheConfig {
    /// The cacheable prefixes of `positions` (a prompt for `model`): every
    /// length `min_tokens + k * increment_tokens` shorter than the prompt.
    /// Computed without the cache, so outside its lock.
    pub fn hashes(&self, model: &str, positions: &[Position]) -> PrefixHashes {
        let (min, step) = (self.min_tokens.max(1), self.increment_tokens.max(1));
        prefix_hashes(model, positions, |length| {
            length >= min && (length - min).is_multiple_of(step)
        })
    }

    /// The prefixes of `positions` ending at `breakpoints` (token counts, as
    /// Anthropic's `cache_control` marks them), those of at least
    /// `min_tokens` and shorter than the prompt: below the minimum nothing
    /// is cached, and no error is raised.
    ///
    /// `lookback` are the lengths a hit may also end at, though nothing is
    /// written there: Anthropic checks the block boundaries before each
    /// breakpoint for an earlier request's prefix, so a breakpoint moved to
    /// the end of a conversation each turn still reads the one before.
    pub fn hashes_at(
        &self,
        model: &str,
        positions: &[Position],
        breakpoints: &[u64],
        lookback: &[u64],
    ) -> PrefixHashes {
        let min = self.min_tokens.max(1);
        let mut hashes = prefix_hashes(model, positions, |length| {
            length >= min && (breakpoints.contains(&length) || lookback.contains(&length))
        });
        hashes.read_only = hashes
            .prefixes
            .iter()
            .map(|(length, _)| !breakpoints.contains(length))
            .collect();
        hashes
    }
}

/// The hashes of the prefixes of `positions` whose length `cached` accepts,
/// shorter than the whole (a prompt always leaves a token to prefill).
fn prefix_hashes(
    model: &str,
    positions: &[Position],
    cached: impl Fn(u64) -> bool,
) -> PrefixHashes {
    let mut prefixes = Vec::new();
    let mut hasher = DefaultHasher::new();
    model.hash(&mut hasher);
    for (index, position) in positions.iter().enumerate() {
        let length = index as u64 + 1;
        if length >= positions.len() as u64 {
            break;
        }
        position.hash(&mut hasher);
        if cached(length) {
            let mut at = hasher.clone();
            length.hash(&mut at);
            prefixes.push((length, at.finish()));
        }
    }
    PrefixHashes {
        read_only: vec![false; prefixes.len()],
        prefixes,
    }
}

impl PrefixHashes {
    /// The longest prefix written, in tokens (0 when there is none).
    pub fn longest(&self) -> u64 {
        self.written().last().map_or(0, |(length, _)| *length)
    }

    /// The prefixes a prompt leaves in the cache.
    fn written(&self) -> Vec<(u64, u64)> {
        self.prefixes
            .iter()
            .zip(&self.read_only)
            .filter(|(_, read_only)| !**read_only)
            .map(|(prefix, _)| *prefix)
            .collect()
    }
}

/// A bounded LRU set of prompt prefixes, by hash (see the module docs).
#[derive(Debug)]
pub struct PrefixCache {
    config: PrefixCacheConfig,
    /// Most prefixes remembered.
    max_entries: usize,
    /// Prefix hash -> (last use, when).
    entries: HashMap<u64, (u64, Instant)>,
    /// Last use -> prefix hash: the eviction order.
    by_use: BTreeMap<u64, u64>,
    uses: u64,
}

/// The hashes of a prompt's cacheable prefixes, computed before taking the
/// cache's lock ([`PrefixCacheConfig::hashes`], [`PrefixCacheConfig::hashes_at`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixHashes {
    /// (prefix length in tokens, hash), shortest first.
    prefixes: Vec<(u64, u64)>,
    /// By prefix: read on a hit, never written ([`PrefixCacheConfig::hashes_at`]'s lookback).
    read_only: Vec<bool>,
}

impl PrefixCache {
    /// An empty cache.
    pub fn new(mut config: PrefixCacheConfig) -> Self {
        config.min_tokens = config.min_tokens.max(1);
        config.increment_tokens = config.increment_tokens.max(1);
        let max_entries =
            usize::try_from(config.capacity_tokens / config.increment_tokens).unwrap_or(usize::MAX);
        Self {
            config,
            max_entries,
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            uses: 0,
        }
    }

    /// Prefixes remembered now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Serves one prompt at `now`: returns its cached tokens (the longest
    /// remembered prefix, or 0), then remembers its prefixes (those it
    /// writes, and the one it read).
    pub fn serve(&mut self, prompt: &PrefixHashes, now: Instant) -> u64 {
        let ttl = self.config.idle_ttl;
        let hit = prompt.prefixes.iter().rev().find(|(_, hash)| {
            self.entries
                .get(hash)
                .is_some_and(|(_, used)| now.saturating_duration_since(*used) < ttl)
        });
        let cached = hit.map_or(0, |(length, _)| *length);
        let mut used = prompt.written();
        used.extend(hit.copied());
        for (_, hash) in used {
            self.uses += 1;
            if let Some((previous, _)) = self.entries.insert(hash, (self.uses, now)) {
                self.by_use.remove(&previous);
            }
            self.by_use.insert(self.uses, hash);
        }
        while self.entries.len() > self.max_entries {
            let Some((_, hash)) = self.by_use.pop_first() else {
                break;
            };
            self.entries.remove(&hash);
        }
        cached
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::prompt_positions;
    use serde_json::json;

    fn prompt(system: &str, question: &str) -> Vec<Position> {
        prompt_positions(&[
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": question}),
        ])
    }

    /// A system prompt of about `tokens` tokens.
    fn system(tokens: usize) -> String {
        "rule ".repeat(tokens)
    }

    #[test]
    fn a_repeated_prefix_is_cached_in_increments_from_the_minimum() {
        let config = PrefixCacheConfig::default();
        let mut cache = PrefixCache::new(config.clone());
        let now = Instant::now();
        let first = prompt(&system(3000), "What is rule one?");
        let hashes = config.hashes("m", &first);
        assert_eq!(cache.serve(&hashes, now), 0, "nothing seen yet");
        let second = prompt(&system(3000), "And rule two, in detail?");
        let shared = first
            .iter()
            .zip(&second)
            .take_while(|(a, b)| a == b)
            .count() as u64;
        let cached = cache.serve(&config.hashes("m", &second), now);
        assert!(
            cached >= 1024 && (cached - 1024).is_multiple_of(128),
            "{cached}"
        );
        assert!(
            cached <= shared && shared - cached < 128,
            "{cached} of {shared}"
        );
        // The very same prompt again: all of it but the last token's block.
        let again = cache.serve(&config.hashes("m", &second), now);
        assert!(again >= cached && again < second.len() as u64, "{again}");
        // Another model shares nothing.
        assert_eq!(cache.serve(&config.hashes("other", &second), now), 0);
    }

    #[test]
    fn short_prompts_and_changed_prefixes_are_not_cached() {
        let config = PrefixCacheConfig::default();
        let mut cache = PrefixCache::new(config.clone());
        let now = Instant::now();
        let short = prompt(&system(900), "Hi");
        assert!(config.hashes("m", &short).prefixes.is_empty());
        assert_eq!(cache.serve(&config.hashes("m", &short), now), 0);
        assert_eq!(cache.serve(&config.hashes("m", &short), now), 0);
        let long = prompt(&system(3000), "Hi");
        cache.serve(&config.hashes("m", &long), now);
        // One token changed at the start: no prefix in common.
        let changed = prompt(&format!("Rule {}", system(3000)), "Hi");
        assert_eq!(cache.serve(&config.hashes("m", &changed), now), 0);
    }

    #[test]
    fn prefixes_expire_when_idle_and_memory_stays_bounded() {
        let config = PrefixCacheConfig {
            min_tokens: 16,
            increment_tokens: 16,
            capacity_tokens: 16 * 100,
            idle_ttl: Duration::from_secs(60),
        };
        let mut cache = PrefixCache::new(config.clone());
        let start = Instant::now();
        let job = prompt(&system(500), "q");
        let hashes = config.hashes("m", &job);
        cache.serve(&hashes, start);
        assert!(cache.serve(&hashes, start + Duration::from_secs(59)) > 0);
        assert_eq!(
            cache.serve(&hashes, start + Duration::from_secs(59 + 61)),
            0,
            "idle past the ttl"
        );
        // Many different prompts: never more than 100 prefixes; the most
        // recent stay, the oldest go.
        for n in 0..50 {
            let other = prompt(&format!("job {n} {}", system(400)), "q");
            cache.serve(&config.hashes("m", &other), start);
            assert!(cache.len() <= 100, "{}", cache.len());
        }
        let last = prompt(&format!("job 49 {}", system(400)), "q");
        assert!(cache.serve(&config.hashes("m", &last), start) > 0);
        let first = prompt(&format!("job 0 {}", system(400)), "q");
        assert_eq!(cache.serve(&config.hashes("m", &first), start), 0);
        // Degenerate settings are taken as 1 and never panic.
        let degenerate = PrefixCacheConfig {
            min_tokens: 0,
            increment_tokens: 0,
            capacity_tokens: 0,
            idle_ttl: Duration::ZERO,
        };
        let mut tiny = PrefixCache::new(degenerate.clone());
        let hashes = degenerate.hashes("m", &job);
        assert_eq!(
            hashes.prefixes.len(),
            job.len() - 1,
            "every length but the whole"
        );
        assert_eq!(tiny.serve(&hashes, start), 0);
        assert_eq!(tiny.serve(&hashes, start), 0, "a zero ttl keeps nothing");
        assert!(tiny.is_empty());
    }
}
