//! Canaries: minting, canonical form, keyed hash, and finding copies in text.
//!
//! A canary is `CG` and 15 random decimal digits: `CG482937105662831`, about
//! 49.8 bits. It costs 6 tokens in both OpenAI's o200k_base and Llama 3's
//! vocabulary (`CG` and five 3-digit groups: both split digit runs into
//! groups of three), where the base32 canaries it replaced cost 17. Digits
//! copy reliably; `CG` followed by fifteen digits almost never occurs in
//! ordinary text (and when it does, only a registered value counts).
//!
//! [`find_canaries`] recognises the copies models and their serializers
//! produce. A span is `C`, `G` and fifteen digits, each read as a
//! character (`unit_at`):
//! - `C` and `G` in any case, in fullwidth forms (`ＣＧ`), and `C` as its
//!   Cyrillic look-alike `С`;
//! - digits ASCII, fullwidth (`１２３`), Arabic-Indic, Devanagari or
//!   mathematical (`𝟏𝟐𝟑`);
//! - up to [`MAX_SEPARATOR_RUN`] separator characters before `G` and before
//!   each digit: spaces of every width (no-break, thin, ideographic),
//!   invisible characters (zero-width space and joiners, word joiner, soft
//!   hyphen, byte-order mark), line breaks and tabs, hyphens and dashes,
//!   `_ . , ' ’ * \` and backticks (grouping marks, markdown around or
//!   inside the span), their fullwidth forms, and, before the first digit
//!   only, a label's `:` and `#`:
//!   `CG-482 937 105 662 831`, `cg 482,937,105,662,831`, `**CG**482…`,
//!   `CG: 482'937'…`;
//! - any of them written as a JSON escape `\uXXXX`, as a tool call's
//!   arguments carry them (`CG\u00a0482…`).
//!
//! A match spans from the `C` to the 15th digit; quotes or backticks around
//! it are not part of it. Every possible `C` is tried as a start
//! (`Starts`), so overlapping text never hides a canary, and each try
//! reads at most [`MAX_MATCH_BYTES`] bytes: scanning is linear in the text
//! and does not depend on how many canaries are live.

use std::fmt;
use std::hash::{BuildHasherDefault, Hash, Hasher};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Random decimal digits in a canary.
pub const CANARY_DIGITS: usize = 15;

/// Number of distinct canaries: 10^15 (about 2^49.8).
pub const CANARY_VALUES: u64 = 1_000_000_000_000_000;

/// Separator characters allowed in a row before `G` and before each digit.
pub const MAX_SEPARATOR_RUN: usize = 4;

/// Longest character a span reads, in bytes: a `\uXXXX` escape.
const MAX_UNIT_BYTES: usize = 6;

/// Longest byte span a match can cover (`C`, `G`, 15 digits, and a run of
/// separators before `G` and before each digit, every character at its
/// longest).
pub const MAX_MATCH_BYTES: usize =
    MAX_UNIT_BYTES * (2 + CANARY_DIGITS + (1 + CANARY_DIGITS) * MAX_SEPARATOR_RUN);

/// Length of the canonical form ([`Canary::canonical`]), which is also the
/// form written into prompts.
pub const CANONICAL_LEN: usize = 2 + CANARY_DIGITS;

/// One canary: a value below [`CANARY_VALUES`], written as its 15 digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Canary(u64);

/// Fixed-size keyed hash of a canary ([`Canary::key`]): what registries and
/// the audit store keep instead of the raw value.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CanaryKey(pub [u8; 16]);

impl Hash for CanaryKey {
    /// Its last eight bytes as one `u64` (an HMAC's bytes are uniform, so
    /// these are as good as all sixteen), for [`KeyHasher`].
    fn hash<H: Hasher>(&self, state: &mut H) {
        let mut tail = [0; 8];
        tail.copy_from_slice(&self.0[8..]);
        state.write_u64(u64::from_le_bytes(tail));
    }
}

/// A hasher for tables keyed by [`CanaryKey`]: the key's own bytes, not
/// hashed again. They are an HMAC under a secret, so uniform and unknown to
/// anyone who would want to make them collide (a value read from an answer
/// is keyed the same way before it is looked up). The registry's shard is
/// picked by the first byte, so the hash takes the last eight.
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }

    /// Anything but a [`CanaryKey`]: its bytes folded in (not expected).
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }
}

/// Builds [`KeyHasher`]s.
pub type BuildKeyHasher = BuildHasherDefault<KeyHasher>;

impl fmt::Debug for CanaryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CanaryKey(")?;
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        write!(f, ")")
    }
}

impl Canary {
    /// A fresh canary from the thread's CSPRNG (`rand`'s `ThreadRng`:
    /// ChaCha12 seeded and periodically reseeded from the operating system,
    /// so a canary costs no system call). Unique among live canaries only
    /// when drawn through a registry
    /// ([`MemoryRegistry::insert_new`](crate::registry::MemoryRegistry::insert_new)).
    pub fn mint() -> Self {
        let mut bytes = [0u8; 10];
        rand::Rng::fill_bytes(&mut rand::rng(), &mut bytes);
        Self::from_random(bytes)
    }

    /// The canary made from 80 random bits (for callers that bring their own
    /// randomness, and for tests): their value modulo 10^15. Each canary is
    /// then drawn with probability within 2^-30 (relative) of 10^-15.
    pub fn from_random(bytes: [u8; 10]) -> Self {
        let value = bytes
            .iter()
            .fold(0u128, |value, &byte| (value << 8) | u128::from(byte));
        Self((value % u128::from(CANARY_VALUES)) as u64)
    }

    /// Whether this canary's first `digits` digits are `value` (`digits`
    /// at most [`CANARY_DIGITS`]): the text read of it so far, when a reply
    /// ends inside it.
    pub fn starts_with(self, digits: usize, value: u64) -> bool {
        let Some(rest) = CANARY_DIGITS.checked_sub(digits) else {
            return false;
        };
        self.0 / 10u64.pow(rest as u32) == value
    }

    /// Parses text that is exactly one canary, in any variation
    /// [`find_canaries`] accepts.
    pub fn parse(text: &str) -> Option<Self> {
        match match_at(text.as_bytes(), 0) {
            Shape::Complete { canary, end } if end == text.len() => Some(canary),
            _ => None,
        }
    }

    /// Canonical form: `CG` and the 15 digits, as written into prompts.
    pub fn canonical(&self) -> [u8; CANONICAL_LEN] {
        let mut out = [0u8; CANONICAL_LEN];
        out[0] = b'C';
        out[1] = b'G';
        let mut rest = self.0;
        for slot in out[2..].iter_mut().rev() {
            *slot = b'0' + (rest % 10) as u8;
            rest /= 10;
        }
        out
    }

    /// HMAC-SHA256 of the canonical form under `secret`, truncated to 128 bits.
    pub fn key(&self, secret: &[u8]) -> CanaryKey {
        CanaryKeyer::new(secret).key(self)
    }
}

/// [`Canary::key`] under one secret, the HMAC keyed once: each key then
/// costs two SHA-256 blocks instead of four.
#[derive(Clone)]
pub struct CanaryKeyer(Hmac<Sha256>);

impl CanaryKeyer {
    /// Keys canaries under `secret`.
    pub fn new(secret: &[u8]) -> Self {
        // HMAC accepts keys of any length, so this cannot fail.
        Self(
            <Hmac<Sha256> as Mac>::new_from_slice(secret)
                .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length")),
        )
    }

    /// The key of `canary` ([`Canary::key`]).
    pub fn key(&self, canary: &Canary) -> CanaryKey {
        let mut mac = self.0.clone();
        mac.update(&canary.canonical());
        let digest = mac.finalize().into_bytes();
        let mut key = [0u8; 16];
        key.copy_from_slice(&digest[..16]);
        CanaryKey(key)
    }
}

impl fmt::Debug for CanaryKeyer {
    /// Never the secret.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CanaryKeyer")
    }
}

impl fmt::Display for Canary {
    /// `CG482937105662831`, the form written into prompts.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The canonical form is ASCII.
        f.write_str(std::str::from_utf8(&self.canonical()).unwrap_or_default())
    }
}

impl fmt::Debug for Canary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Canary({self})")
    }
}

/// A canary-shaped span of text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CanaryMatch {
    /// The canary it spells.
    pub canary: Canary,
    /// Byte range in the scanned text.
    pub start: usize,
    /// End of the range (exclusive).
    pub end: usize,
}

/// `text` with every canary-shaped span replaced by `replacement` (a span
/// overlapping one already replaced is part of it).
pub fn replace_canaries(text: &str, replacement: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    for found in find_canaries(text) {
        if found.start < copied {
            continue;
        }
        out.push_str(&text[copied..found.start]);
        out.push_str(replacement);
        copied = found.end;
    }
    out.push_str(&text[copied..]);
    out
}

/// Every canary-shaped span of `text`, in order, overlapping ones included.
/// Whether a span is a live canary is the registry's question.
pub fn find_canaries(text: &str) -> impl Iterator<Item = CanaryMatch> + '_ {
    let bytes = text.as_bytes();
    Starts::new(bytes).filter_map(move |start| match match_at(bytes, start) {
        Shape::Complete { canary, end } => Some(CanaryMatch { canary, start, end }),
        _ => None,
    })
}

/// Whether `text` may be part of a canary-shaped span that other text
/// joined to it completes: it has a character a span may start with, or it
/// begins with one a span may go on with (anything but an ASCII letter
/// other than `G`). A text for which this is false neither holds, begins
/// nor ends such a span.
pub fn may_join_a_canary(text: &str) -> bool {
    let goes_on = text
        .bytes()
        .next()
        .is_some_and(|first| !first.is_ascii_alphabetic() || first.eq_ignore_ascii_case(&b'G'));
    goes_on || Starts::new(text.as_bytes()).next().is_some()
}

/// The bytes of a text where a span may start, in order: each `C` or `c`,
/// and each fullwidth or Cyrillic one. Both kinds are found with `memchr`,
/// each search resumed where it stopped, so a scan reads the text once
/// however many starts it has.
pub(crate) struct Starts<'a> {
    bytes: &'a [u8],
    /// Where the next search starts.
    from: usize,
    /// The next ASCII start at or after `from`, once searched for (`None`
    /// inside: none left).
    ascii: Option<Option<usize>>,
    /// Likewise, the next other start.
    wide: Option<Option<usize>>,
}

impl<'a> Starts<'a> {
    /// The starts of `bytes`.
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self {
            bytes,
            from: 0,
            ascii: None,
            wide: None,
        }
    }

    /// Goes on from byte `at` (past a span read whole), if that is further.
    pub(crate) fn skip_to(&mut self, at: usize) {
        if at <= self.from {
            return;
        }
        self.from = at;
        for cached in [&mut self.ascii, &mut self.wide] {
            if matches!(cached, Some(Some(start)) if *start < at) {
                *cached = None;
            }
        }
    }

    fn next_wide(&self) -> Option<usize> {
        let mut at = self.from;
        while let Some(offset) = memchr::memchr3(0xEF, 0xD0, 0xD1, &self.bytes[at..]) {
            let lead = at + offset;
            if matches!(unit_at(self.bytes, lead), Some((Unit::C, _))) {
                return Some(lead);
            }
            at = lead + 1;
        }
        None
    }
}

impl Iterator for Starts<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let bytes = self.bytes;
        let from = self.from;
        if self.wide == Some(None) {
            // ASCII starts only, as in most text.
            let start = from + memchr::memchr2(b'C', b'c', bytes.get(from..)?)?;
            self.from = start + 1;
            return Some(start);
        }
        let ascii = *self.ascii.get_or_insert_with(|| {
            memchr::memchr2(b'C', b'c', &bytes[from..]).map(|offset| from + offset)
        });
        let wide = match self.wide {
            Some(wide) => wide,
            None => *self.wide.insert(self.next_wide()),
        };
        let start = match (ascii, wide) {
            (Some(ascii), Some(wide)) => ascii.min(wide),
            (start, None) | (None, start) => start?,
        };
        self.from = start + 1;
        if ascii == Some(start) {
            self.ascii = None;
        }
        if wide == Some(start) {
            self.wide = None;
        }
        Some(start)
    }
}

/// Whether `c` may start a span (read as `C`).
pub(crate) fn starts_span(c: char) -> bool {
    classify(c) == Unit::C
}

/// How the text at one position relates to the canary shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// A whole canary ends at byte `end`.
    Complete { canary: Canary, end: usize },
    /// The text ends while still consistent with a canary: `digits` of its
    /// digits read, whose value is `value` ([`Canary::starts_with`]).
    Partial { digits: usize, value: u64 },
    /// Not a canary.
    NoMatch,
}

/// Matches the canary shape starting exactly at `start`.
pub(crate) fn match_at(text: &[u8], start: usize) -> Shape {
    const NOTHING_YET: Shape = Shape::Partial {
        digits: 0,
        value: 0,
    };
    // Most starts are the `c` of a word, decided by the letter after it.
    if let [b'C' | b'c', next, ..] = text[start..]
        && next.is_ascii()
        && matches!(ASCII_UNITS[usize::from(next)], Unit::Other | Unit::Digit(_))
    {
        return Shape::NoMatch;
    }
    let mut index = start;
    match unit_at(text, index) {
        None => return NOTHING_YET,
        Some((Unit::C, len)) => index += len,
        Some(_) => return Shape::NoMatch,
    }
    let mut separators = 0;
    loop {
        match unit_at(text, index) {
            None => return NOTHING_YET,
            Some((Unit::G, len)) => {
                index += len;
                break;
            }
            Some((Unit::Separator, len)) if separators < MAX_SEPARATOR_RUN => {
                separators += 1;
                index += len;
            }
            Some(_) => return Shape::NoMatch,
        }
    }
    let mut value = 0u64;
    for digits in 0..CANARY_DIGITS {
        let mut separators = 0;
        loop {
            match unit_at(text, index) {
                None => return Shape::Partial { digits, value },
                Some((Unit::Digit(digit), len)) => {
                    value = value * 10 + u64::from(digit);
                    index += len;
                    break;
                }
                Some((Unit::Separator, len)) if separators < MAX_SEPARATOR_RUN => {
                    separators += 1;
                    index += len;
                }
                Some((Unit::Label, len)) if digits == 0 && separators < MAX_SEPARATOR_RUN => {
                    separators += 1;
                    index += len;
                }
                Some(_) => return Shape::NoMatch,
            }
        }
    }
    Shape::Complete {
        canary: Canary(value),
        end: index,
    }
}

/// What one character of text reads as in a span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    C,
    G,
    Digit(u8),
    Separator,
    /// A separator only before the first digit.
    Label,
    Other,
}

/// The character at byte `at` of `text` (UTF-8, or a `\uXXXX` escape) as
/// a [`Unit`], and its length in bytes; `None` when the text ends inside
/// it (or at `at`), so it may still become one.
#[inline]
fn unit_at(text: &[u8], at: usize) -> Option<(Unit, usize)> {
    let lead = *text.get(at)?;
    if lead == b'\\' {
        return escape_at(text, at);
    }
    if lead.is_ascii() {
        return Some((ASCII_UNITS[usize::from(lead)], 1));
    }
    wide_unit_at(text, at, lead)
}

/// [`unit_at`] for a character that is not ASCII (lead byte `lead`).
fn wide_unit_at(text: &[u8], at: usize, lead: u8) -> Option<(Unit, usize)> {
    let len = match lead {
        0xC0..=0xDF => 2,
        0xE0..=0xEF => 3,
        0xF0..=0xF7 => 4,
        // Inside a character (never where a scan starts): not part of a span.
        _ => return Some((Unit::Other, 1)),
    };
    let bytes = text.get(at..at + len)?;
    let c = std::str::from_utf8(bytes)
        .ok()
        .and_then(|decoded| decoded.chars().next());
    Some((c.map_or(Unit::Other, classify), len))
}

/// A backslash at `at`: a `\uXXXX` escape read as its character, else a
/// separator (markdown's escape, `CG\_482\_…`); `None` while the text ends
/// where an escape could still follow.
#[cold]
fn escape_at(text: &[u8], at: usize) -> Option<(Unit, usize)> {
    let rest = &text[at + 1..];
    let Some((&b'u', hex)) = rest.split_first() else {
        return if rest.is_empty() {
            None
        } else {
            Some((Unit::Separator, 1))
        };
    };
    let digits = hex
        .iter()
        .take(4)
        .take_while(|byte| byte.is_ascii_hexdigit())
        .count();
    match digits {
        4 => {
            let code = std::str::from_utf8(&hex[..4])
                .ok()
                .and_then(|hex| u32::from_str_radix(hex, 16).ok());
            let unit = code.and_then(char::from_u32).map_or(Unit::Other, classify);
            Some((unit, 6))
        }
        // The text ends inside what may be an escape.
        _ if digits == hex.len() => None,
        _ => Some((Unit::Separator, 1)),
    }
}

/// [`classify`] of every ASCII character, looked up.
const ASCII_UNITS: [Unit; 128] = {
    let mut units = [Unit::Other; 128];
    let mut byte = 0;
    while byte < 128 {
        units[byte] = classify(byte as u8 as char);
        byte += 1;
    }
    units
};

/// What `c` reads as in a span.
const fn classify(c: char) -> Unit {
    match c {
        'C' | 'c' | '\u{FF23}' | '\u{FF43}' | '\u{0421}' | '\u{0441}' => Unit::C,
        'G' | 'g' | '\u{FF27}' | '\u{FF47}' => Unit::G,
        '0'..='9' => Unit::Digit(c as u8 - b'0'),
        // Fullwidth, Arabic-Indic, extended Arabic-Indic, Devanagari digits.
        '\u{FF10}'..='\u{FF19}' => Unit::Digit((c as u32 - 0xFF10) as u8),
        '\u{0660}'..='\u{0669}' => Unit::Digit((c as u32 - 0x0660) as u8),
        '\u{06F0}'..='\u{06F9}' => Unit::Digit((c as u32 - 0x06F0) as u8),
        '\u{0966}'..='\u{096F}' => Unit::Digit((c as u32 - 0x0966) as u8),
        // Mathematical bold, double-struck, sans-serif, sans-serif bold and
        // monospace digits, ten of each.
        '\u{1D7CE}'..='\u{1D7FF}' => Unit::Digit(((c as u32 - 0x1D7CE) % 10) as u8),
        ' ' | '\t' | '\n' | '\r' | '-' | '_' | '.' | ',' | '\'' | '*' | '`' | '\\' => {
            Unit::Separator
        }
        // A label's marks: only between `CG` and the digits (`CG: 482…`).
        ':' | '#' | '\u{FF1A}' => Unit::Label,
        // No-break space, soft hyphen.
        '\u{00A0}' | '\u{00AD}' => Unit::Separator,
        // Spaces of every width, zero-width space and (non-)joiners, marks,
        // hyphens and dashes, quotation marks used as group marks, the narrow
        // no-break space, word joiner, medium mathematical space, minus.
        '\u{2000}'..='\u{2015}'
        | '\u{2018}'
        | '\u{2019}'
        | '\u{202F}'
        | '\u{2060}'
        | '\u{205F}'
        | '\u{2212}' => Unit::Separator,
        // Ideographic space and comma, byte-order mark (zero-width no-break
        // space), fullwidth comma, hyphen, full stop, low line.
        '\u{3000}' | '\u{3001}' | '\u{FEFF}' | '\u{FF0C}' | '\u{FF0D}' | '\u{FF0E}'
        | '\u{FF3F}' => Unit::Separator,
        _ => Unit::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Canary {
        Canary::from_random([0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x0f, 0xed])
    }

    #[test]
    fn only_text_that_neither_holds_begins_nor_ends_a_span_cannot_join_one() {
        for text in ["assistant", "tool", "Paris", ""] {
            assert!(!may_join_a_canary(text), "{text:?}");
        }
        // Holds a start (a `C`), or goes on with a digit, a separator or `G`.
        for text in [
            "function", "x CG12", "345 end", " 678", "G123", "gold", "\\u0043", "１２",
        ] {
            assert!(may_join_a_canary(text), "{text:?}");
        }
    }

    #[test]
    fn display_parse_round_trip() {
        let canary = sample();
        let text = canary.to_string();
        assert_eq!(text.len(), CANONICAL_LEN);
        assert!(text.starts_with("CG"));
        assert!(text[2..].bytes().all(|b| b.is_ascii_digit()));
        assert_eq!(Canary::parse(&text), Some(canary));
        // Leading zeros are kept.
        let small = Canary::from_random([0, 0, 0, 0, 0, 0, 0, 0, 0, 7]);
        assert_eq!(small.to_string(), "CG000000000000007");
        assert_eq!(Canary::parse("CG000000000000007"), Some(small));
    }

    #[test]
    fn values_cover_the_range() {
        let top = Canary::from_random([0xff; 10]);
        assert!(top.0 < CANARY_VALUES);
        let zero = Canary::from_random([0; 10]);
        // Low bits of the random value all reach the canary.
        for byte in 5..10 {
            for bit in 0..8 {
                let mut bytes = [0u8; 10];
                bytes[byte] = 1 << bit;
                assert_ne!(Canary::from_random(bytes), zero, "byte {byte} bit {bit}");
            }
        }
    }

    #[test]
    fn copy_variations_are_recognised() {
        let canary = sample();
        let text = canary.to_string();
        let digits = &text[2..];
        let grouped = |separator: &str| {
            let groups: Vec<&str> = (0..5).map(|g| &digits[3 * g..3 * g + 3]).collect();
            groups.join(separator)
        };
        let variants = [
            text.to_lowercase(),
            format!("Cg{digits}"),
            format!("CG-{digits}"),
            format!("CG {digits}"),
            format!("CG {}", grouped(" ")),
            format!("CG-{}", grouped("-")),
            format!("CG{}", grouped(",")),
            format!("CG {}", grouped(".")),
            format!("CG {}", grouped(" - ")),
            format!("CG\u{a0}{}", grouped("\u{2009}")),
            format!("CG\u{2011}{}", grouped("\u{202f}")),
            format!("CG\u{2014}{}", grouped("\u{2212}")),
            format!("CG_{}", grouped("_")),
            // Markdown inside the span, labels and other grouping marks.
            format!("**CG**{digits}"),
            format!("`CG` {}", grouped(" ")),
            format!("CG\\_{}", grouped("\\_")),
            format!("CG: {}", grouped("'")),
            format!("CG #{}", grouped("\u{2019}")),
            format!("C G {}", grouped(" ")),
            format!("C-G: {}", grouped(".")),
            format!("CG\n{}", grouped("\n")),
            format!("CG\t{}", grouped("    ")),
            // Invisible characters between the digits or the letters.
            format!("C\u{200b}G{}", grouped("\u{200b}")),
            format!("CG{}", grouped("\u{200d}")),
            format!("CG{}", grouped("\u{00ad}")),
            format!("CG{}", grouped("\u{2060}\u{feff}")),
            format!("CG\u{3000}{}", grouped("\u{ff0c}")),
            // Other forms of the letters and digits.
            fullwidth(&text),
            format!("CG{}", fullwidth(digits)),
            format!("\u{0421}G{digits}"),
            format!("CG{}", shifted(digits, 0x0660)),
            format!("CG {}", shifted(digits, 0x1D7CE)),
            // JSON escapes, as a tool call's arguments may carry them.
            format!("CG\\u00a0{}", grouped("\\u2009")),
            format!("CG{}", escaped(digits)),
        ];
        for variant in variants {
            let found: Vec<_> = find_canaries(&format!("see `{variant}`.")).collect();
            assert_eq!(found.len(), 1, "{variant}");
            assert_eq!(found[0].canary, canary, "{variant}");
            let first = variant
                .char_indices()
                .find(|(_, c)| starts_span(*c))
                .unwrap();
            assert_eq!(found[0].start, 5 + first.0, "{variant}");
            assert_eq!(found[0].end, 5 + variant.len(), "{variant}");
            assert!(variant.len() <= MAX_MATCH_BYTES);
        }
    }

    /// `text` in fullwidth forms.
    fn fullwidth(text: &str) -> String {
        text.chars()
            .map(|c| char::from_u32(c as u32 + 0xFEE0).unwrap())
            .collect()
    }

    /// ASCII `digits` as the digits of the block starting at `zero`.
    fn shifted(digits: &str, zero: u32) -> String {
        digits
            .bytes()
            .map(|digit| char::from_u32(zero + u32::from(digit - b'0')).unwrap())
            .collect()
    }

    /// ASCII `digits` as JSON `\uXXXX` escapes.
    fn escaped(digits: &str) -> String {
        digits
            .bytes()
            .map(|digit| format!("\\u{:04x}", digit))
            .collect()
    }

    #[test]
    fn partial_escapes_and_characters_wait_for_more_text() {
        // The text ends inside an escape or a multi-byte character that may
        // still be part of the span.
        for text in ["CG482\\", "CG482\\u", "CG482\\u00a", "CG482\u{ff11}"] {
            let cut = &text.as_bytes()[..text.len() - usize::from(text.ends_with('\u{ff11}'))];
            assert!(
                matches!(
                    match_at(cut, 0),
                    Shape::Partial {
                        digits: 3,
                        value: 482
                    }
                ),
                "{text}: {:?}",
                match_at(cut, 0)
            );
        }
        let starts = |text: &str| Starts::new(text.as_bytes()).collect::<Vec<_>>();
        assert_eq!(starts("ab ＣＧ1 c"), [3, 11]);
        assert_eq!(starts("Ｃ c \u{0421}"), [0, 4, 6]);
        assert_eq!(starts("\u{feff}да"), Vec::<usize>::new());
        let mut skipping = Starts::new(b"C C C");
        assert_eq!(skipping.next(), Some(0));
        skipping.skip_to(3);
        assert_eq!(skipping.collect::<Vec<_>>(), [4]);
    }

    #[test]
    fn non_canaries_are_not_matched() {
        for text in [
            "CG48293710566283",              // 14 digits
            "CG4829371056628x1",             // a letter among the digits
            "CG-----482937105662831",        // separator run too long
            "C  -  G482937105662831",        // likewise between C and G
            "CX482937105662831",             // not G
            "482937105662831",               // no prefix
            "CG 482 937 105 662 83½",        // a digit of another kind
            "Cg4829371056628\\u00zz31",      // a backslash that is no escape, then letters
            "CG 482:937:105:662:831",        // a label's mark among the digits
            "cg 2024-12-01 10:15:00,123 up", // a log line's time
            "the cgi script, CGRect and cgroup v2",
            "",
        ] {
            assert_eq!(find_canaries(text).count(), 0, "{text}");
        }
    }

    #[test]
    fn overlapping_prefix_does_not_hide_a_canary() {
        let canary = sample();
        let text = format!("CG {canary} and cg-{canary}");
        let found: Vec<_> = find_canaries(&text)
            .filter(|m| m.canary == canary)
            .collect();
        assert_eq!(found.len(), 2);
        assert_eq!(&text[found[0].start..found[0].end], canary.to_string());
    }

    #[test]
    fn partial_shapes() {
        let canary = Canary::parse("CG482937105662831").unwrap();
        assert!(canary.starts_with(6, 482_937));
        assert!(canary.starts_with(15, 482_937_105_662_831));
        assert!(canary.starts_with(0, 0));
        assert!(!canary.starts_with(6, 482_938));
        assert!(!canary.starts_with(16, 0));
        assert_eq!(
            match_at(b"C", 0),
            Shape::Partial {
                digits: 0,
                value: 0
            }
        );
        assert_eq!(
            match_at(b"cg-482 937", 0),
            Shape::Partial {
                digits: 6,
                value: 482_937
            }
        );
        assert_eq!(match_at(b"cx", 0), Shape::NoMatch);
        assert_eq!(match_at(b"CG48a", 0), Shape::NoMatch);
    }

    #[test]
    fn keys_depend_on_secret_and_value() {
        let canary = sample();
        let other = Canary::from_random([1; 10]);
        assert_eq!(canary.key(b"s"), canary.key(b"s"));
        assert_ne!(canary.key(b"s"), canary.key(b"t"));
        assert_ne!(canary.key(b"s"), other.key(b"s"));
    }

    #[test]
    fn a_keyer_gives_each_canary_its_hmac_however_often_it_is_used() {
        // Keys are stored (the audit log's canary rows, the shared
        // registry): they must stay HMAC-SHA256(secret, canonical)[..16].
        let keyer = CanaryKeyer::new(b"registry secret");
        for canary in [sample(), Canary::from_random([1; 10]), sample()] {
            let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(b"registry secret").unwrap();
            mac.update(&canary.canonical());
            assert_eq!(keyer.key(&canary).0[..], mac.finalize().into_bytes()[..16]);
        }
    }

    #[test]
    fn a_key_hashes_as_its_last_eight_bytes() {
        use std::hash::BuildHasher;
        let mut key = CanaryKey([0; 16]);
        key.0[8..].copy_from_slice(&0x0123_4567_89ab_cdef_u64.to_le_bytes());
        key.0[0] = 0xff;
        assert_eq!(
            BuildKeyHasher::default().hash_one(key),
            0x0123_4567_89ab_cdef
        );
    }

    #[test]
    fn minted_canaries_differ() {
        assert_ne!(Canary::mint(), Canary::mint());
    }
}
