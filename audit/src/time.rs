//! Times on the command line and in output.
//!
//! Accepted forms (all UTC-based):
//! - RFC 3339: `2026-11-30T12:00:00Z`, `2026-11-30T12:00:00.250+01:00`
//! - a date: `2026-11-30` (midnight UTC)
//! - relative to now: `90s`, `15m`, `24h`, `7d`, `2w` (that long ago)

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, in unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64)
}

/// A time argument that is not one of the accepted forms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadTime {
    /// A span ago that reaches before 1970.
    #[error("time `{0}` reaches before 1970")]
    BeforeEpoch(String),
    /// Not RFC 3339, a date or a span.
    #[error(
        "cannot read time `{0}`: use RFC 3339 (2026-11-30T12:00:00Z), a date (2026-11-30) or a \
         span ago (90s, 15m, 24h, 7d, 2w)"
    )]
    Unreadable(String),
}

/// Parses a time argument into unix milliseconds; `now_ms` anchors relative forms.
pub fn parse_time(text: &str, now_ms: u64) -> Result<u64, BadTime> {
    let text = text.trim();
    if let Some(ago) = parse_relative(text) {
        return ago
            .and_then(|ago| now_ms.checked_sub(ago))
            .ok_or_else(|| BadTime::BeforeEpoch(text.to_owned()));
    }
    parse_rfc3339(text).ok_or_else(|| BadTime::Unreadable(text.to_owned()))
}

/// `Some(None)` when `text` looks relative but overflows.
fn parse_relative(text: &str) -> Option<Option<u64>> {
    let unit_at = text.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = text.split_at(unit_at);
    if digits.is_empty() {
        return None;
    }
    let unit_ms: u64 = match unit {
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "w" => 7 * 86_400_000,
        _ => return None,
    };
    Some(
        digits
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(unit_ms)),
    )
}

fn parse_rfc3339(text: &str) -> Option<u64> {
    let bytes = text.as_bytes();
    let number = |range: std::ops::Range<usize>| -> Option<i64> {
        let part = text.get(range)?;
        part.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| part.parse().ok())?
    };
    if bytes.len() < 10 || bytes[4] != b'-' || bytes[7] != b'-' {
        return None;
    }
    let (year, month, day) = (number(0..4)?, number(5..7)?, number(8..10)?);
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return None;
    }
    let mut seconds = days_from_civil(year, month, day) * 86_400;
    let mut millis = 0;
    if bytes.len() > 10 {
        if !matches!(bytes[10], b'T' | b't' | b' ') || bytes.len() < 19 {
            return None;
        }
        if bytes[13] != b':' || bytes[16] != b':' {
            return None;
        }
        let (hour, minute, second) = (number(11..13)?, number(14..16)?, number(17..19)?);
        if hour > 23 || minute > 59 || second > 60 {
            return None;
        }
        seconds += hour * 3600 + minute * 60 + second.min(59);
        let mut rest = &text[19..];
        if let Some(fraction) = rest.strip_prefix('.') {
            let digits = fraction.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return None;
            }
            let padded = format!("{:0<3}", &fraction[..digits.min(3)]);
            millis = padded.parse::<i64>().ok()?;
            rest = &fraction[digits..];
        }
        match rest {
            "Z" | "z" => {}
            offset if offset.len() == 6 && offset.as_bytes()[3] == b':' => {
                let sign = match offset.as_bytes()[0] {
                    b'+' => 1,
                    b'-' => -1,
                    _ => return None,
                };
                let hours: i64 = offset[1..3].parse().ok()?;
                let minutes: i64 = offset[4..6].parse().ok()?;
                if hours > 23 || minutes > 59 {
                    return None;
                }
                seconds -= sign * (hours * 3600 + minutes * 60);
            }
            _ => return None,
        }
    }
    u64::try_from(seconds * 1000 + millis).ok()
}

/// Formats unix milliseconds as RFC 3339 UTC with milliseconds.
pub fn format_rfc3339(ms: u64) -> String {
    let seconds = (ms / 1000) as i64;
    let (days, day_seconds) = (seconds.div_euclid(86_400), seconds.rem_euclid(86_400));
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        day_seconds / 3600,
        day_seconds / 60 % 60,
        day_seconds % 60,
        ms % 1000
    )
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

// Howard Hinnant's civil calendar algorithms (public domain).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_764_504_000_000; // 2025-11-30T12:00:00Z

    #[test]
    fn rfc3339_round_trips() {
        assert_eq!(format_rfc3339(NOW), "2025-11-30T12:00:00.000Z");
        assert_eq!(parse_time("2025-11-30T12:00:00Z", 0), Ok(NOW));
        assert_eq!(parse_time("2025-11-30T13:00:00.5+01:00", 0), Ok(NOW + 500));
        assert_eq!(parse_time("2025-11-30", 0), Ok(NOW - 12 * 3_600_000));
        assert_eq!(parse_time("1970-01-01T00:00:00Z", 0), Ok(0));
        assert_eq!(format_rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        for ms in [0, 1, NOW, 951_782_400_123, 4_102_444_800_000] {
            assert_eq!(parse_time(&format_rfc3339(ms), 0), Ok(ms));
        }
    }

    #[test]
    fn relative_forms_count_back_from_now() {
        assert_eq!(parse_time("24h", NOW), Ok(NOW - 86_400_000));
        assert_eq!(parse_time("7d", NOW), Ok(NOW - 7 * 86_400_000));
        assert_eq!(parse_time("90s", NOW), Ok(NOW - 90_000));
        assert_eq!(parse_time("15m", NOW), Ok(NOW - 900_000));
    }

    #[test]
    fn bad_times_are_errors() {
        for bad in [
            "",
            "yesterday",
            "24x",
            "h",
            "2025-13-01",
            "2025-02-30",
            "2025-11-30T25:00:00Z",
            "2025-11-30T12:00:00",
            "2025-11-30T12:00:00+0100",
            "99999999999999999999d",
        ] {
            assert!(parse_time(bad, NOW).is_err(), "{bad:?} parsed");
        }
    }
}
