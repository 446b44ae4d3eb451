//! Canaries: minting, canonical form, keyed hash, and finding copies in text.
//!
//! A canary is 80 random bits written as `CG-` and 16 Crockford base32
//! symbols in groups of four: `CG-7KQ4-M2XD-9PTA-WV3E`. Crockford base32 has
//! no `I`, `L`, `O` or `U`, so a model's copy is unambiguous, and the `CG`
//! prefix plus 16 symbols almost never occurs in ordinary text (and when it
//! does, only a registered value counts as a canary).
//!
//! [`find_canaries`] recognises the copy variations models produce: any letter
//! case, `O`/`I`/`L` for `0`/`1`/`1`, and up to [`MAX_SEPARATOR_RUN`] separator
//! characters (space, `-`, `_`, `.`, no-break spaces, Unicode hyphens and
//! dashes) before and between symbols. A match spans from the `C` of `CG` to
//! the 16th symbol; quotes or backticks around it are not part of it. Every
//! `C` is tried as a start, so overlapping text never hides a canary, and each
//! try reads at most [`MAX_MATCH_BYTES`] bytes: scanning is linear in the
//! text and does not depend on how many canaries are live.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Random symbols in a canary (5 bits each: 80 bits).
pub const CANARY_SYMBOLS: usize = 16;

/// Separator characters allowed in a row before or between two symbols.
pub const MAX_SEPARATOR_RUN: usize = 3;

/// Longest byte span a match can cover (`CG`, 16 symbols, separator runs of
/// 3-byte characters before each symbol).
pub const MAX_MATCH_BYTES: usize = 2 + CANARY_SYMBOLS * (1 + MAX_SEPARATOR_RUN * 3);

const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";

/// One canary: 16 symbol values in `0..32`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Canary([u8; CANARY_SYMBOLS]);

/// Fixed-size keyed hash of a canary ([`Canary::key`]): what registries and
/// the audit store keep instead of the raw value.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CanaryKey(pub [u8; 16]);

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
    /// A fresh canary from the operating system's CSPRNG.
    pub fn mint() -> Result<Self, getrandom::Error> {
        let mut bytes = [0u8; 10];
        getrandom::fill(&mut bytes)?;
        Ok(Self::from_random(bytes))
    }

    /// The canary whose 80 bits are `bytes` (for callers that bring their own
    /// randomness, and for tests).
    pub fn from_random(bytes: [u8; 10]) -> Self {
        let mut value = 0u128;
        for byte in bytes {
            value = (value << 8) | u128::from(byte);
        }
        let mut symbols = [0u8; CANARY_SYMBOLS];
        for (index, symbol) in symbols.iter_mut().enumerate() {
            *symbol = ((value >> (75 - 5 * index)) & 31) as u8;
        }
        Self(symbols)
    }

    /// Parses text that is exactly one canary, in any variation
    /// [`find_canaries`] accepts.
    pub fn parse(text: &str) -> Option<Self> {
        match match_at(text.as_bytes(), 0) {
            Shape::Complete { canary, end } if end == text.len() => Some(canary),
            _ => None,
        }
    }

    /// Canonical form without separators: `CG` and 16 upper-case symbols.
    pub fn canonical(&self) -> [u8; 2 + CANARY_SYMBOLS] {
        let mut out = [0u8; 2 + CANARY_SYMBOLS];
        out[0] = b'C';
        out[1] = b'G';
        for (slot, symbol) in out[2..].iter_mut().zip(self.0) {
            *slot = ALPHABET[usize::from(symbol)];
        }
        out
    }

    /// HMAC-SHA256 of the canonical form under `secret`, truncated to 128 bits.
    pub fn key(&self, secret: &[u8]) -> CanaryKey {
        // HMAC accepts keys of any length, so this cannot fail.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        mac.update(&self.canonical());
        let digest = mac.finalize().into_bytes();
        let mut key = [0u8; 16];
        key.copy_from_slice(&digest[..16]);
        CanaryKey(key)
    }
}

impl fmt::Display for Canary {
    /// `CG-XXXX-XXXX-XXXX-XXXX`, the form written into prompts.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let canonical = self.canonical();
        f.write_str("CG")?;
        for group in canonical[2..].chunks(4) {
            f.write_str("-")?;
            // The alphabet is ASCII.
            f.write_str(std::str::from_utf8(group).unwrap_or_default())?;
        }
        Ok(())
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
    /// The text ends while still consistent with a canary.
    Partial,
    /// Not a canary.
    NoMatch,
}

/// Matches the canary shape starting exactly at `start`.
pub(crate) fn match_at(text: &[u8], start: usize) -> Shape {
    let mut index = start;
    for expected in [b'C', b'G'] {
        match text.get(index) {
            None => return Shape::Partial,
            Some(byte) if byte.to_ascii_uppercase() == expected => index += 1,
            Some(_) => return Shape::NoMatch,
        }
    }
    let mut symbols = [0u8; CANARY_SYMBOLS];
    for symbol in &mut symbols {
        let mut separators = 0;
        loop {
            let Some(rest) = text.get(index..).filter(|rest| !rest.is_empty()) else {
                return Shape::Partial;
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
        match symbol_value(text[index]) {
            Some(value) => *symbol = value,
            None => return Shape::NoMatch,
        }
        index += 1;
    }
    Shape::Complete {
        canary: Canary(symbols),
        end: index,
    }
}

/// Length in bytes of the separator character `rest` starts with, if any.
fn separator_len(rest: &[u8]) -> Option<usize> {
    match rest {
        [b' ' | b'-' | b'_' | b'.', ..] => Some(1),
        // U+00A0 no-break space.
        [0xC2, 0xA0, ..] => Some(2),
        // U+2010..U+2015 hyphens and dashes, U+202F narrow no-break space.
        [0xE2, 0x80, 0x90..=0x95 | 0xAF, ..] => Some(3),
        // U+2212 minus sign.
        [0xE2, 0x88, 0x92, ..] => Some(3),
        _ => None,
    }
}

/// Value of a Crockford base32 symbol, any case; `O` reads as 0, `I`/`L` as 1.
fn symbol_value(byte: u8) -> Option<u8> {
    let upper = byte.to_ascii_uppercase();
    match upper {
        b'O' => Some(0),
        b'I' | b'L' => Some(1),
        _ => ALPHABET
            .iter()
            .position(|&symbol| symbol == upper)
            .map(|value| value as u8),
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
        assert_eq!(text.len(), 22);
        assert!(text.starts_with("CG-"));
        assert_eq!(Canary::parse(&text), Some(canary));
    }

    #[test]
    fn random_bits_all_reach_symbols() {
        let zero = Canary::from_random([0; 10]);
        for byte in 0..10 {
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
        let canonical = String::from_utf8(canary.canonical().to_vec()).unwrap();
        let variants = [
            text.to_lowercase(),
            text.replace('-', " "),
            text.replace('-', "_"),
            text.replace('-', "."),
            text.replace('-', " - "),
            text.replace('-', "\u{2011}"),
            text.replace('-', "\u{2014}"),
            canonical.clone(),
            canonical.replace('0', "O"),
            format!("CG-{}", &canonical[2..]),
        ];
        for variant in variants {
            let found: Vec<_> = find_canaries(&format!("see `{variant}`.")).collect();
            assert_eq!(found.len(), 1, "{variant}");
            assert_eq!(found[0].canary, canary, "{variant}");
            assert_eq!(found[0].start, 5, "{variant}");
            assert_eq!(found[0].end, 5 + variant.len(), "{variant}");
        }
    }

    #[test]
    fn non_canaries_are_not_matched() {
        for text in [
            "CG-7KQ4-M2XD-9PTA",         // too short
            "CG-7KQ4-M2XD-9PTA-WV3U",    // U is not a symbol
            "CG----7KQ4-M2XD-9PTA-WV3E", // separator run too long
            "the cgi script",
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
        assert_eq!(match_at(b"C", 0), Shape::Partial);
        assert_eq!(match_at(b"cg-7KQ4-", 0), Shape::Partial);
        assert_eq!(match_at(b"cx", 0), Shape::NoMatch);
        let long = format!("{}", sample());
        assert!(long.len() <= MAX_MATCH_BYTES);
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
    fn minted_canaries_differ() {
        assert_ne!(Canary::mint().unwrap(), Canary::mint().unwrap());
    }
}
