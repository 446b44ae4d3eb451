//! Canaries: minting, canonical form, keyed hash, and finding copies in text.
//!
//! A canary is `CG` and 15 random decimal digits: `CG482937105662831`, about
//! 49.8 bits. It costs 6 tokens in both OpenAI's o200k_base and Llama 3's
//! vocabulary (`CG` and five 3-digit groups: both split digit runs into
//! groups of three), where the base32 canaries it replaced cost 17. Digits
//! copy reliably; `CG` followed by fifteen digits almost never occurs in
//! ordinary text (and when it does, only a registered value counts).
//!
//! [`find_canaries`] recognises the copy variations models produce: `CG` in
//! any letter case, and up to [`MAX_SEPARATOR_RUN`] separator characters
//! (space, `-`, `_`, `.`, `,`, no-break and thin spaces, Unicode hyphens and
//! dashes) before and between digits (`CG-482 937 105 662 831`,
//! `cg 482,937,105,662,831`). A match spans from the `C` of `CG` to the 15th
//! digit; quotes or backticks around it are not part of it. Every `C` is tried
//! as a start, so overlapping text never hides a canary, and each try reads at
//! most [`MAX_MATCH_BYTES`] bytes: scanning is linear in the text and does not
//! depend on how many canaries are live.

use std::fmt;
use std::hash::{BuildHasherDefault, Hash, Hasher};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Random decimal digits in a canary.
pub const CANARY_DIGITS: usize = 15;

/// Number of distinct canaries: 10^15 (about 2^49.8).
pub const CANARY_VALUES: u64 = 1_000_000_000_000_000;

/// Separator characters allowed in a row before or between two digits.
pub const MAX_SEPARATOR_RUN: usize = 3;

/// Longest byte span a match can cover (`CG`, 15 digits, separator runs of
/// 3-byte characters before each digit).
pub const MAX_MATCH_BYTES: usize = 2 + CANARY_DIGITS * (1 + MAX_SEPARATOR_RUN * 3);

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
    let mut from = 0;
    std::iter::from_fn(move || {
        while let Some(offset) = memchr::memchr2(b'C', b'c', &bytes[from..]) {
            let start = from + offset;
            from = start + 1;
            if let Shape::Complete { canary, end } = match_at(bytes, start) {
                return Some(CanaryMatch { canary, start, end });
            }
        }
        from = bytes.len();
        None
    })
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
    let mut index = start;
    for expected in [b'C', b'G'] {
        match text.get(index) {
            None => {
                return Shape::Partial {
                    digits: 0,
                    value: 0,
                };
            }
            Some(byte) if byte.to_ascii_uppercase() == expected => index += 1,
            Some(_) => return Shape::NoMatch,
        }
    }
    let mut value = 0u64;
    for digits in 0..CANARY_DIGITS {
        let mut separators = 0;
        loop {
            let Some(rest) = text.get(index..).filter(|rest| !rest.is_empty()) else {
                return Shape::Partial { digits, value };
            };
            match separator_len(rest) {
                Some(len) if separators < MAX_SEPARATOR_RUN => {
                    separators += 1;
                    index += len;
                }
                Some(_) => return Shape::NoMatch,
                None => break,
            }
        }
        match text[index] {
            digit @ b'0'..=b'9' => value = value * 10 + u64::from(digit - b'0'),
            _ => return Shape::NoMatch,
        }
        index += 1;
    }
    Shape::Complete {
        canary: Canary(value),
        end: index,
    }
}

/// Length in bytes of the separator character `rest` starts with, if any.
fn separator_len(rest: &[u8]) -> Option<usize> {
    match rest {
        [b' ' | b'-' | b'_' | b'.' | b',', ..] => Some(1),
        // U+00A0 no-break space.
        [0xC2, 0xA0, ..] => Some(2),
        // U+2009 thin space, U+2010..U+2015 hyphens and dashes, U+202F narrow
        // no-break space.
        [0xE2, 0x80, 0x89 | 0x90..=0x95 | 0xAF, ..] => Some(3),
        // U+2212 minus sign.
        [0xE2, 0x88, 0x92, ..] => Some(3),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Canary {
        Canary::from_random([0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x0f, 0xed])
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
        ];
        for variant in variants {
            let found: Vec<_> = find_canaries(&format!("see `{variant}`.")).collect();
            assert_eq!(found.len(), 1, "{variant}");
            assert_eq!(found[0].canary, canary, "{variant}");
            assert_eq!(found[0].start, 5, "{variant}");
            assert_eq!(found[0].end, 5 + variant.len(), "{variant}");
            assert!(variant.len() <= MAX_MATCH_BYTES);
        }
    }

    #[test]
    fn non_canaries_are_not_matched() {
        for text in [
            "CG48293710566283",      // 14 digits
            "CG4829371056628x1",     // a letter among the digits
            "CG----482937105662831", // separator run too long
            "C G482937105662831",    // split prefix
            "482937105662831",       // no prefix
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
