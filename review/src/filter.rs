//! The list's filters: parsed from the query string, checked strictly (a
//! typo is a 400 page naming it, not a silently ignored filter), and written
//! back into links.

use canarygate_audit::time::parse_time;
use canarygate_audit::{Route, VerdictSummary};

use crate::html::url_encode;

/// Longest value accepted for a free-text filter (check, endpoint, request).
const MAX_VALUE: usize = 200;

/// Records on one page of the list.
pub const PAGE_SIZE: usize = 50;

/// Whether reviewed records are shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reviewed {
    /// Only records with a review.
    Yes,
    /// Only records without one.
    No,
}

/// How the list is ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Order {
    /// Newest record first.
    #[default]
    Newest,
    /// Failed, flagged and sampled records first (then newest first).
    Suspicious,
}

/// What the list shows. Every field is optional: an absent one matches all.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Filter {
    /// Only this verdict.
    pub verdict: Option<VerdictSummary>,
    /// Only records where this check failed.
    pub check: Option<String>,
    /// Only this route.
    pub route: Option<Route>,
    /// Only sessions whose hash starts with this (lowercase hex).
    pub session: Option<String>,
    /// Only this endpoint (`chat_completions`, `messages`, ...).
    pub endpoint: Option<String>,
    /// Only the request with this id (`x-canarygate-request-id`).
    pub request: Option<String>,
    /// Only records written at or after this time (unix ms), as given.
    pub since: Option<(u64, String)>,
    /// Only records written before this time (unix ms), as given.
    pub until: Option<(u64, String)>,
    /// Only answers whose topic score is below its threshold.
    pub low_topic: bool,
    /// Reviewed or not.
    pub reviewed: Option<Reviewed>,
    /// Ordering.
    pub order: Order,
    /// 1-based page number.
    pub page: usize,
}

/// A query parameter the list does not accept, or a value it cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadFilter(pub String);

impl Filter {
    /// Parses the query pairs; `now_ms` anchors relative times (`24h`).
    /// Empty values (an untouched form field) mean "any".
    pub fn parse(pairs: &[(String, String)], now_ms: u64) -> Result<Self, BadFilter> {
        let mut filter = Filter {
            page: 1,
            ..Filter::default()
        };
        let mut seen: Vec<&str> = Vec::new();
        for (name, value) in pairs {
            let value = value.trim();
            if value.is_empty() {
                continue;
            }
            if seen.contains(&name.as_str()) {
                return Err(BadFilter(format!("`{}` is given twice", short(name))));
            }
            seen.push(name);
            match name.as_str() {
                "verdict" => {
                    filter.verdict = Some(match value {
                        "pass" => VerdictSummary::Pass,
                        "fail" => VerdictSummary::Fail,
                        "unchecked" => VerdictSummary::Unchecked,
                        "unverifiable" => VerdictSummary::Unverifiable,
                        other => {
                            return Err(BadFilter(format!(
                                "verdict `{}` must be pass, fail, unchecked or unverifiable",
                                short(other)
                            )));
                        }
                    })
                }
                "check" => filter.check = Some(word("check", value)?),
                "route" => {
                    filter.route = Some(match value {
                        "upstream" => Route::Upstream,
                        "local" => Route::Local,
                        other => {
                            return Err(BadFilter(format!(
                                "route `{}` must be upstream or local",
                                short(other)
                            )));
                        }
                    })
                }
                "session" => {
                    let prefix = value.to_ascii_lowercase();
                    if prefix.len() > 64 || !prefix.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return Err(BadFilter(format!(
                            "session `{}` must be a hex prefix of a session hash (at most 64 characters)",
                            short(value)
                        )));
                    }
                    filter.session = Some(prefix);
                }
                "endpoint" => filter.endpoint = Some(printable("endpoint", value)?),
                "request" => filter.request = Some(printable("request", value)?),
                "since" | "until" => {
                    let at = parse_time(value, now_ms)
                        .map_err(|error| BadFilter(format!("{name}: {error}")))?;
                    let bound = Some((at, value.to_owned()));
                    if name == "since" {
                        filter.since = bound;
                    } else {
                        filter.until = bound;
                    }
                }
                "topic" => {
                    if value != "low" {
                        return Err(BadFilter(format!(
                            "topic `{}` must be low (answers scored below the threshold)",
                            short(value)
                        )));
                    }
                    filter.low_topic = true;
                }
                "reviewed" => {
                    filter.reviewed = Some(match value {
                        "yes" => Reviewed::Yes,
                        "no" => Reviewed::No,
                        other => {
                            return Err(BadFilter(format!(
                                "reviewed `{}` must be yes or no",
                                short(other)
                            )));
                        }
                    })
                }
                "order" => {
                    filter.order = match value {
                        "newest" => Order::Newest,
                        "suspicious" => Order::Suspicious,
                        other => {
                            return Err(BadFilter(format!(
                                "order `{}` must be newest or suspicious",
                                short(other)
                            )));
                        }
                    }
                }
                "page" => {
                    filter.page = value
                        .parse::<usize>()
                        .ok()
                        .filter(|page| (1..=1_000_000).contains(page))
                        .ok_or_else(|| {
                            BadFilter(format!("page `{}` must be a number from 1", short(value)))
                        })?
                }
                other => {
                    return Err(BadFilter(format!(
                        "unknown filter `{}`: use verdict, check, route, session, endpoint, \
                         request, since, until, topic, reviewed, order or page",
                        short(other)
                    )));
                }
            }
        }
        if let (Some((since, _)), Some((until, _))) = (&filter.since, &filter.until)
            && since >= until
        {
            return Err(BadFilter("since must be before until".into()));
        }
        Ok(filter)
    }

    /// The query string (without `?`) that gives back this filter, with
    /// `page` replaced by `page` (1 leaves it out).
    pub fn query(&self, page: usize) -> String {
        let mut pairs: Vec<(&str, String)> = Vec::new();
        if let Some(verdict) = self.verdict {
            pairs.push(("verdict", verdict_name(verdict).into()));
        }
        if let Some(check) = &self.check {
            pairs.push(("check", check.clone()));
        }
        if let Some(route) = self.route {
            pairs.push(("route", route_name(route).into()));
        }
        for (name, value) in [
            ("session", &self.session),
            ("endpoint", &self.endpoint),
            ("request", &self.request),
        ] {
            if let Some(value) = value {
                pairs.push((name, value.clone()));
            }
        }
        if let Some((_, text)) = &self.since {
            pairs.push(("since", text.clone()));
        }
        if let Some((_, text)) = &self.until {
            pairs.push(("until", text.clone()));
        }
        if self.low_topic {
            pairs.push(("topic", "low".into()));
        }
        match self.reviewed {
            Some(Reviewed::Yes) => pairs.push(("reviewed", "yes".into())),
            Some(Reviewed::No) => pairs.push(("reviewed", "no".into())),
            None => {}
        }
        if self.order == Order::Suspicious {
            pairs.push(("order", "suspicious".into()));
        }
        if page > 1 {
            pairs.push(("page", page.to_string()));
        }
        pairs
            .iter()
            .map(|(name, value)| format!("{name}={}", url_encode(value)))
            .collect::<Vec<_>>()
            .join("&")
    }

    /// Whether the time bounds admit `recorded_at_ms`.
    pub fn admits_time(&self, recorded_at_ms: u64) -> bool {
        self.since
            .as_ref()
            .is_none_or(|(at, _)| recorded_at_ms >= *at)
            && self
                .until
                .as_ref()
                .is_none_or(|(at, _)| recorded_at_ms < *at)
    }
}

/// The recorded name of a verdict.
pub fn verdict_name(verdict: VerdictSummary) -> &'static str {
    match verdict {
        VerdictSummary::Pass => "pass",
        VerdictSummary::Fail => "fail",
        VerdictSummary::Unchecked => "unchecked",
        VerdictSummary::Unverifiable => "unverifiable",
    }
}

/// The recorded name of a route.
pub fn route_name(route: Route) -> &'static str {
    match route {
        Route::Upstream => "upstream",
        Route::Local => "local",
    }
}

/// A check name: letters, digits and `_`.
fn word(name: &str, value: &str) -> Result<String, BadFilter> {
    if value.len() <= 64
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        Ok(value.to_owned())
    } else {
        Err(BadFilter(format!(
            "{name} `{}` must be a check name (letters, digits, _)",
            short(value)
        )))
    }
}

/// A bounded value without control characters.
fn printable(name: &str, value: &str) -> Result<String, BadFilter> {
    if value.len() <= MAX_VALUE && !value.chars().any(char::is_control) {
        Ok(value.to_owned())
    } else {
        Err(BadFilter(format!(
            "{name} must be at most {MAX_VALUE} characters without control characters"
        )))
    }
}

/// `text` cut to a length an error message can quote.
fn short(text: &str) -> String {
    const QUOTE: usize = 40;
    match text.char_indices().nth(QUOTE) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_780_000_000_000;

    fn parse(query: &[(&str, &str)]) -> Result<Filter, BadFilter> {
        let pairs: Vec<(String, String)> = query
            .iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect();
        Filter::parse(&pairs, NOW)
    }

    #[test]
    fn every_filter_parses_and_round_trips() {
        let filter = parse(&[
            ("verdict", "fail"),
            ("check", "foreign_canary"),
            ("route", "upstream"),
            ("session", "AB12"),
            ("endpoint", "chat_completions"),
            ("request", "req 1&2"),
            ("since", "2026-11-30"),
            ("until", "2026-12-01T00:00:00Z"),
            ("topic", "low"),
            ("reviewed", "no"),
            ("order", "suspicious"),
            ("page", "3"),
        ])
        .unwrap();
        assert_eq!(filter.verdict, Some(VerdictSummary::Fail));
        assert_eq!(filter.session.as_deref(), Some("ab12"));
        assert_eq!(filter.since.as_ref().unwrap().0, 1_795_996_800_000);
        assert_eq!(filter.page, 3);
        let query = filter.query(3);
        let pairs: Vec<(String, String)> = query
            .split('&')
            .map(|pair| {
                let (name, value) = pair.split_once('=').unwrap();
                (name.to_owned(), decode(value))
            })
            .collect();
        assert_eq!(Filter::parse(&pairs, NOW).unwrap(), filter);
        assert!(query.contains("request=req%201%262"), "{query}");
    }

    fn decode(value: &str) -> String {
        let bytes = value.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%' {
                out.push(u8::from_str_radix(&value[i + 1..i + 3], 16).unwrap());
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn empty_values_mean_any_and_relative_times_work() {
        let filter = parse(&[("verdict", ""), ("check", "  "), ("since", "24h")]).unwrap();
        assert_eq!(filter.verdict, None);
        assert_eq!(filter.check, None);
        assert_eq!(filter.since.as_ref().unwrap().0, NOW - 86_400_000);
        assert!(filter.admits_time(NOW));
        assert!(!filter.admits_time(NOW - 86_400_001));
    }

    #[test]
    fn bad_input_is_named() {
        for (query, expected) in [
            (vec![("verdict", "maybe")], "verdict `maybe`"),
            (vec![("route", "sideways")], "route `sideways`"),
            (vec![("session", "xyz")], "hex prefix"),
            (vec![("check", "a b")], "check name"),
            (vec![("since", "yesterday")], "since: cannot read time"),
            (vec![("page", "0")], "page `0`"),
            (vec![("page", "-1")], "page `-1`"),
            (vec![("order", "random")], "order `random`"),
            (vec![("reviewed", "maybe")], "reviewed `maybe`"),
            (vec![("topic", "high")], "topic `high`"),
            (vec![("verdit", "fail")], "unknown filter `verdit`"),
            (
                vec![("verdict", "fail"), ("verdict", "pass")],
                "given twice",
            ),
            (
                vec![("since", "1h"), ("until", "2h")],
                "since must be before",
            ),
            (vec![("endpoint", "a\u{7}b")], "control characters"),
        ] {
            let error = parse(&query).expect_err(expected).0;
            assert!(error.contains(expected), "{query:?}: {error}");
        }
        let long = "x".repeat(500);
        let error = parse(&[(long.as_str(), "2")]).unwrap_err().0;
        assert!(error.len() < 200, "{error}");
    }
}
