//! The headers real providers send on every response, and the rate limit
//! they report.
//!
//! OpenAI sends `x-request-id`, `openai-processing-ms`, `openai-version`,
//! `openai-organization` and `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`
//! (resets as durations like `6m0s`, `1.5s`, `20ms`); Cloudflare in front of
//! it adds a `__cf_bm` bot-management cookie, which a proxy must not pass on.
//!
//! Anthropic sends `request-id` (`req_011C...`), `anthropic-organization-id`
//! and `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`
//! (resets as RFC 3339 times); the simulator has one token budget, which
//! the three token families all report.
//!
//! The rate limit is a fixed window ([`RateLimitConfig`]): requests and
//! tokens (prompt plus `max_tokens` per choice, as OpenAI estimates them)
//! admitted since the window opened. A request over either limit is refused
//! with 429 and not counted.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, HeaderName, HeaderValue};

use crate::hash;

/// `openai-version` of every response.
pub const OPENAI_VERSION: &str = "2020-10-01";

/// `openai-organization` of every response.
pub const ORGANIZATION: &str = "sim-org";

/// `anthropic-organization-id` of every Messages response.
pub const ANTHROPIC_ORGANIZATION_ID: &str = "5a1e0000-0000-4000-8000-00000000051e";

/// Limits per window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitConfig {
    /// Requests admitted per window.
    pub requests: u64,
    /// Tokens admitted per window.
    pub tokens: u64,
    /// The window's length.
    pub window: Duration,
}

impl Default for RateLimitConfig {
    /// 1,000,000 requests and 1,000,000,000 tokens a minute: reported like a
    /// real limit, too high for a test or benchmark to meet.
    fn default() -> Self {
        Self {
            requests: 1_000_000,
            tokens: 1_000_000_000,
            window: Duration::from_secs(60),
        }
    }
}

/// The rate-limit state one response reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateSnapshot {
    pub limit_requests: u64,
    pub remaining_requests: u64,
    pub limit_tokens: u64,
    pub remaining_tokens: u64,
    /// Until the window reopens.
    pub reset: Duration,
}

/// Why a request was refused: `requests` or `tokens` (OpenAI's error types).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub kind: &'static str,
    pub message: String,
    pub snapshot: RateSnapshot,
}

/// The fixed window's counts.
#[derive(Debug)]
pub struct RateWindow {
    config: RateLimitConfig,
    opened: Instant,
    requests: u64,
    tokens: u64,
}

impl RateWindow {
    pub fn new(config: RateLimitConfig, now: Instant) -> Self {
        Self {
            config,
            opened: now,
            requests: 0,
            tokens: 0,
        }
    }

    fn roll(&mut self, now: Instant) {
        if now.duration_since(self.opened) >= self.config.window {
            self.opened = now;
            self.requests = 0;
            self.tokens = 0;
        }
    }

    /// The state now, admitting nothing; `request_limit` overrides the
    /// configured request limit.
    pub fn peek(&mut self, now: Instant, request_limit: Option<u64>) -> RateSnapshot {
        self.roll(now);
        let limit_requests = request_limit.unwrap_or(self.config.requests);
        RateSnapshot {
            limit_requests,
            remaining_requests: limit_requests.saturating_sub(self.requests),
            limit_tokens: self.config.tokens,
            remaining_tokens: self.config.tokens.saturating_sub(self.tokens),
            reset: (self.opened + self.config.window).saturating_duration_since(now),
        }
    }

    /// Admits a request of `tokens` tokens, or refuses it (counting nothing).
    pub fn admit(
        &mut self,
        now: Instant,
        tokens: u64,
        request_limit: Option<u64>,
    ) -> Result<RateSnapshot, Refusal> {
        let before = self.peek(now, request_limit);
        let wait = format_duration(before.reset);
        if before.remaining_requests == 0 {
            return Err(Refusal {
                kind: "requests",
                message: format!(
                    "Rate limit reached for requests per min (RPM) in organization {ORGANIZATION}: \
                     Limit {}, Used {}, Requested 1. Please try again in {wait}.",
                    before.limit_requests, self.requests
                ),
                snapshot: before,
            });
        }
        if tokens > before.remaining_tokens {
            return Err(Refusal {
                kind: "tokens",
                message: format!(
                    "Rate limit reached for tokens per min (TPM) in organization {ORGANIZATION}: \
                     Limit {}, Used {}, Requested {tokens}. Please try again in {wait}.",
                    before.limit_tokens, self.tokens
                ),
                snapshot: before,
            });
        }
        self.requests += 1;
        self.tokens += tokens;
        Ok(self.peek(now, request_limit))
    }
}

/// A duration as OpenAI writes rate-limit resets: `6m0s`, `1.5s`, `20ms`.
pub fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis < 1000 {
        return format!("{millis}ms");
    }
    let minutes = millis / 60_000;
    let seconds = (millis % 60_000) as f64 / 1000.0;
    let seconds = format!("{seconds:.3}");
    let seconds = seconds.trim_end_matches('0').trim_end_matches('.');
    if minutes > 0 {
        format!("{minutes}m{seconds}s")
    } else {
        format!("{seconds}s")
    }
}

/// A fresh `req_` + 32 hex digits id: unique per `number` and process start.
pub fn request_id(number: u64, started_nanos: u128) -> String {
    let high = hash::of(&[&number.to_le_bytes(), &started_nanos.to_le_bytes()]);
    let low = hash::of(&[&started_nanos.to_le_bytes(), &number.to_le_bytes(), b"low"]);
    format!("req_{high:016x}{low:016x}")
}

/// Inserts the provider headers of one response.
pub fn insert(
    headers: &mut HeaderMap,
    request_id: &str,
    processing: Duration,
    rate: &RateSnapshot,
) {
    let mut put = |name: &'static str, value: String| {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(name), value);
        }
    };
    put("x-request-id", request_id.to_owned());
    put("openai-processing-ms", processing.as_millis().to_string());
    put("openai-version", OPENAI_VERSION.to_owned());
    put("openai-organization", ORGANIZATION.to_owned());
    put(
        "x-ratelimit-limit-requests",
        rate.limit_requests.to_string(),
    );
    put(
        "x-ratelimit-remaining-requests",
        rate.remaining_requests.to_string(),
    );
    put("x-ratelimit-reset-requests", format_duration(rate.reset));
    put("x-ratelimit-limit-tokens", rate.limit_tokens.to_string());
    put(
        "x-ratelimit-remaining-tokens",
        rate.remaining_tokens.to_string(),
    );
    put("x-ratelimit-reset-tokens", format_duration(rate.reset));
    let cookie = hash::alphanumeric(hash::of(&[request_id.as_bytes(), b"cf"]), 43);
    put(
        "set-cookie",
        format!("__cf_bm={cookie}; path=/; HttpOnly; Secure; SameSite=None"),
    );
}

/// A fresh Anthropic `request-id`: `req_011C` and 20 characters, unique
/// per `number` and process start.
pub fn anthropic_request_id(number: u64, started_nanos: u128) -> String {
    let seed = hash::of(&[
        &number.to_le_bytes(),
        &started_nanos.to_le_bytes(),
        b"anthropic",
    ]);
    format!("req_011C{}", hash::alphanumeric(seed, 20))
}

/// Inserts Anthropic's headers of one response, its resets counted from `now`.
pub fn insert_anthropic(
    headers: &mut HeaderMap,
    request_id: &str,
    rate: &RateSnapshot,
    now: SystemTime,
) {
    let mut put = |name: String, value: String| {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::from_str(&value)) {
            headers.insert(name, value);
        }
    };
    put("request-id".into(), request_id.to_owned());
    put(
        "anthropic-organization-id".into(),
        ANTHROPIC_ORGANIZATION_ID.to_owned(),
    );
    let reset = rfc3339(now + rate.reset);
    let families = [
        ("requests", rate.limit_requests, rate.remaining_requests),
        ("tokens", rate.limit_tokens, rate.remaining_tokens),
        ("input-tokens", rate.limit_tokens, rate.remaining_tokens),
        ("output-tokens", rate.limit_tokens, rate.remaining_tokens),
    ];
    for (family, limit, remaining) in families {
        put(
            format!("anthropic-ratelimit-{family}-limit"),
            limit.to_string(),
        );
        put(
            format!("anthropic-ratelimit-{family}-remaining"),
            remaining.to_string(),
        );
        put(format!("anthropic-ratelimit-{family}-reset"), reset.clone());
    }
}

/// `time` as RFC 3339 in UTC, to the second: `2025-07-29T09:59:33Z`.
pub fn rfc3339(time: SystemTime) -> String {
    let seconds = time
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    let (days, rest) = (seconds / 86_400, seconds % 86_400);
    let (year, month, day) = civil_date(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01: count in 400-year
/// eras of 146,097 days, each starting on March 1st so that the leap day
/// ends the year.
fn civil_date(days: u64) -> (u64, u64, u64) {
    let shifted = days + 719_468; // days from 0000-03-01 to 1970-01-01
    let era = shifted / 146_097;
    let day_of_era = shifted % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_openais() {
        assert_eq!(format_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_duration(Duration::from_millis(61_250)), "1m1.25s");
        assert_eq!(format_duration(Duration::from_millis(20)), "20ms");
        assert_eq!(format_duration(Duration::from_secs(1)), "1s");
    }

    #[test]
    fn the_window_counts_down_refuses_and_reopens() {
        let start = Instant::now();
        let config = RateLimitConfig {
            requests: 2,
            tokens: 100,
            window: Duration::from_secs(10),
        };
        let mut window = RateWindow::new(config, start);
        let first = window.admit(start, 30, None).unwrap();
        assert_eq!((first.remaining_requests, first.remaining_tokens), (1, 70));
        let refused = window.admit(start, 80, None).unwrap_err();
        assert_eq!(refused.kind, "tokens");
        assert_eq!(refused.snapshot.remaining_tokens, 70, "nothing counted");
        let second = window
            .admit(start + Duration::from_secs(4), 10, None)
            .unwrap();
        assert_eq!(second.remaining_requests, 0);
        assert_eq!(second.reset, Duration::from_secs(6));
        let refused = window.admit(start, 1, None).unwrap_err();
        assert_eq!(refused.kind, "requests");
        assert!(
            refused.message.contains("Limit 2, Used 2"),
            "{}",
            refused.message
        );
        // A per-request limit of 5 lets this one through.
        assert!(window.admit(start, 1, Some(5)).is_ok());
        let reopened = window
            .admit(start + Duration::from_secs(10), 1, None)
            .unwrap();
        assert_eq!(reopened.remaining_requests, 1);
    }

    #[test]
    fn rfc3339_dates_are_right_across_leap_years() {
        let at = |seconds: u64| rfc3339(UNIX_EPOCH + Duration::from_secs(seconds));
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(1_753_783_173), "2025-07-29T09:59:33Z");
        assert_eq!(at(4_107_542_399), "2100-02-28T23:59:59Z");
        assert_eq!(
            at(4_107_542_400),
            "2100-03-01T00:00:00Z",
            "2100 is no leap year"
        );
    }

    #[test]
    fn anthropic_headers_are_set() {
        let mut headers = HeaderMap::new();
        let id = anthropic_request_id(3, 42);
        assert!(id.starts_with("req_011C") && id.len() == 28, "{id}");
        assert_ne!(id, anthropic_request_id(4, 42));
        let rate = RateSnapshot {
            limit_requests: 10,
            remaining_requests: 9,
            limit_tokens: 100,
            remaining_tokens: 90,
            reset: Duration::from_secs(60),
        };
        insert_anthropic(&mut headers, &id, &rate, UNIX_EPOCH);
        let get = |name: &str| headers[name].to_str().unwrap().to_owned();
        assert_eq!(get("request-id"), id);
        assert_eq!(get("anthropic-organization-id"), ANTHROPIC_ORGANIZATION_ID);
        assert_eq!(get("anthropic-ratelimit-requests-remaining"), "9");
        assert_eq!(get("anthropic-ratelimit-input-tokens-limit"), "100");
        assert_eq!(
            get("anthropic-ratelimit-output-tokens-reset"),
            "1970-01-01T00:01:00Z"
        );
        assert!(headers.get("x-request-id").is_none());
    }

    #[test]
    fn every_provider_header_is_set() {
        let mut headers = HeaderMap::new();
        let id = request_id(1, 42);
        assert_eq!(id.len(), 36);
        assert_ne!(id, request_id(2, 42));
        let rate = RateSnapshot {
            limit_requests: 10,
            remaining_requests: 9,
            limit_tokens: 100,
            remaining_tokens: 90,
            reset: Duration::from_secs(360),
        };
        insert(&mut headers, &id, Duration::from_millis(12), &rate);
        let get = |name: &str| headers[name].to_str().unwrap().to_owned();
        assert_eq!(get("x-request-id"), id);
        assert_eq!(get("openai-processing-ms"), "12");
        assert_eq!(get("openai-version"), "2020-10-01");
        assert_eq!(get("openai-organization"), "sim-org");
        assert_eq!(get("x-ratelimit-remaining-requests"), "9");
        assert_eq!(get("x-ratelimit-reset-tokens"), "6m0s");
        assert!(get("set-cookie").starts_with("__cf_bm="));
        assert!(get("set-cookie").ends_with("; path=/; HttpOnly; Secure; SameSite=None"));
    }
}
